"""The small benchmark helpers: py-spy profile shares, the matmul rate, and the benchmark
scripts run on tiny random models."""

import importlib.util
import os
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def _load(name):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_profile_shares_counts_innermost_frames(tmp_path):
    ps = _load("profile_shares")
    raw = tmp_path / "p.txt"
    raw.write_text(
        "<module> (a.py:1);run (arithlib/methods/patching.py:10);forward (torch/nn/linear.py:5);Linear.forward (x.py:3) 6\n"
        "<module> (a.py:1);run (arithlib/methods/patching.py:10);topk (arithlib/yu/cna.py:7) 3\n"
        "<module> (a.py:1);idle (b.py:2) 1\n"
    )
    s = ps.shares(raw)
    assert s["total"] == 10
    assert dict(s["leaf"])["Linear.forward"] == 6
    ours = dict(s["arithlib"])
    assert ours["run (arithlib/methods/patching.py:10)"] == 6 and ours["topk (arithlib/yu/cna.py:7)"] == 3
    assert ours["(outside arithlib)"] == 1


def test_gemm_rate_is_positive_and_table_has_a_cell_per_row_count():
    gm = _load("gemm")
    assert gm.gemm_rate(4, 8, 16, seconds=0.01) > 0
    rows = gm.main(["--models", "smollm2-135m", "--rows", "1", "2", "--seconds", "0.01", "--no-write"])
    assert set(rows[0]["rates"]) == {1, 2} and rows[0]["best"] == max(rows[0]["rates"].values())


def test_layer_weights_benchmark_on_a_random_model():
    lw = _load("layer_weights")
    row = lw.main(["--model", "random-llama", "--repeats", "1", "--no-append"])
    assert row["same"] and row["layers"] == 2 and row["stacked"] > 0 and row["per_layer"] > 0


def test_optimizer_benchmark_on_a_random_model():
    bo = _load("optimizer")
    row = bo.main(["--model", "random-llama", "--steps", "2", "--no-append"])
    assert row["params"] > 0 and row["later_loop"] > 0 and row["later_fused"] > 0
    assert row["max_diff"] < 1e-5 and row["ok"]  # the same update up to float rounding
    # AdamW reads param, grad and two moments and writes three of them: 7 float32 passes
    assert row["bytes_per_step"] == 7 * 4 * row["params"]
    assert row["gbs_fused"] > 0 and 0 < row["frac_fused"] < float("inf") and row["peak_source"] == "measured copy"
    one = bo.main(["--model", "random-llama", "--steps", "2", "--blocks", "1", "--dtype", "bfloat16", "--no-append"])
    assert 0 < one["params"] < row["params"] / 2 and one["stepped"] == "blocks 0-0 of 2"
    assert one["bytes_per_step"] == 7 * 2 * one["params"] and one["ok"]


def test_layer_inputs_benchmark_on_a_random_model():
    bl = _load("layer_inputs")
    rows = bl.main(["--model", "random-llama", "--n", "8", "--batch-size", "4", "--repeats", "1", "--no-append"])
    assert [r["layer"] for r in rows] == [1] and all(r["same"] and r["ok"] and r["full"] > 0 for r in rows)
    # the late start skips block 0 of 2: fewer counted FLOPs, both at a positive share of the peak
    assert all(
        0 < r["flops_late"] < r["flops_full"] and r["tflops_full"] > 0 and 0 < r["frac_late"] < float("inf")
        for r in rows
    )


def test_layer_inputs_perturbation_keeps_the_parameters_device_and_dtype():
    import torch

    import arithlib.methods.finetune as FT
    import arithlib.methods.model_weights as MW
    from arithlib.core.random_models import load_random_model

    bl = _load("layer_inputs")
    hf = FT.shared_hf_model(load_random_model("llama", "tiny", dtype=torch.bfloat16).bridge)
    w = bl.perturbed(hf, 1)
    params = MW.params_by_clean_name(hf)
    assert w and all(n.startswith("model.layers.1.") for n in w)
    assert all(v.dtype == params[n].dtype == torch.bfloat16 and v.device == params[n].device for n, v in w.items())


def test_cna_benchmark_on_a_random_model_reports_flops_and_rates():
    import math

    bc = _load("cna")
    row = bc.main(
        ["--model", "random-llama", "--n-prompts", "4", "--repeats", "1", "--loop-neurons", "8", "--no-append"]
    )
    assert row["loop_neurons"] == 8 < row["d_mlp"] and row["neurons"] == row["layers"] * row["d_mlp"]
    assert row["flops_batched"] > 0 and row["flops_loop"] > 0
    assert row["tflops_batched"] > 0 and row["tflops_loop"] > 0
    assert all(math.isfinite(row[k]) and row[k] > 0 for k in ("frac_batched", "frac_loop", "peak_tflops"))
    assert row["peak_source"] == "measured" and row["close"] and row["max_abs_diff"] <= row["tolerance"]
    assert bc.loop_neurons(128, 8) == [0, 18, 36, 54, 73, 91, 109, 127] and bc.loop_neurons(128, None) is None


def test_bench_model_parse_names_tiny_and_full_shapes():
    import torch

    bm = _load("bench_model")  # the shared modules load as the scripts do
    assert bm.parse("random-llama") == ("llama", "tiny")
    assert bm.parse("random-llama:llama3-8b") == ("llama", "llama3-8b")
    assert bm.parse("qwen2.5-coder-0.5b") is None
    with pytest.raises(ValueError, match="unknown random model 'random-llama:llama9-1t'.*random-llama:llama3-8b"):
        bm.parse("random-llama:llama9-1t")
    assert bm.allowed_flips(100, torch.float32) == 0
    assert bm.allowed_flips(100, torch.bfloat16) == 2 and bm.allowed_flips(10, torch.bfloat16) == 1


def test_roofline_counts_a_linear_layer_and_rates():
    import torch

    rl = _load("roofline")
    m, k, n = 3, 5, 7
    x, w = torch.randn(m, k), torch.randn(n, k)
    assert rl.counted_flops(lambda: torch.nn.functional.linear(x, w)) == 2 * m * k * n
    achieved, fraction = rl.rate(4e12, 2.0, 8.0)
    assert achieved == 2.0 and fraction == 0.25
    flops, seconds, out = rl.measure(lambda: torch.nn.functional.linear(x, w), 2)
    assert flops == 2 * m * k * n and seconds > 0 and out.shape == (m, n)
    assert rl.dtype_name(torch.bfloat16) == "bfloat16"


def test_malloc_benchmark_runs_both_settings():
    bm = _load("malloc")
    rows = bm.main(
        ["--script", "optimizer.py", "--no-append", "--script-args", "--model", "random-llama", "--steps", "2"]
    )
    assert [r["setting"] for r in rows] == ["glibc default", "MALLOC_ENV (kept memory)"]
    assert all(r["wall"] > 0 and r["faults"] > 0 for r in rows)


def test_patching_rows_go_into_the_first_table(tmp_path):
    bp = _load("patching")
    path = tmp_path / "RESULTS.md"
    path.write_text("# R\n\n| a |\n|---|\n| cpu |\n\nnote\n\n## other\n\n| b |\n|---|\n| x |\n")
    bp.insert_row(path, "| gpu |")
    assert path.read_text() == "# R\n\n| a |\n|---|\n| cpu |\n| gpu |\n\nnote\n\n## other\n\n| b |\n|---|\n| x |\n"


def test_threads_benchmark_times_both_phases_and_restores_threads():
    import torch

    import arithlib.nikankin.heuristic_grids as HG
    from arithlib.core.models import load_model
    from arithlib.core.prompt_sets import PromptSet
    from arithlib.core.random_models import random_model_dir

    bt = _load("threads")
    tiny = load_model(str(random_model_dir("llama")))
    grid = PromptSet.build(HG.grid_records("+", (0, 3), fewshot=1), tiny.tokenizer)
    before = torch.get_num_threads()
    prefix_s, passes_s = bt.time_runner(tiny.bridge, grid, threads=1, passes=2)
    assert prefix_s > 0 and passes_s > 0 and torch.get_num_threads() == before


def test_answer_logits_benchmark_times_both_passes_with_equal_results():
    import arithlib.methods.finetune as FT
    import arithlib.methods.finetune_data as FD
    from arithlib.core.models import load_model
    from arithlib.core.prompt_sets import PromptSet
    from arithlib.core.random_models import random_model_dir

    bal = _load("answer_logits")
    tiny = load_model(str(random_model_dir("qwen2")))
    splits = FD.yu_lora_data(n_train=12, n_test=12, n_val=0, seed=0, fewshot=2)
    train, test = (PromptSet.build(splits[k], tiny.tokenizer) for k in ("train", "test"))
    before = [p.requires_grad for p in FT.shared_hf_model(tiny.bridge).parameters()]
    r = bal.time_both(tiny.bridge, train, test, batch_size=8, train_batch=6, repeats=1)
    assert r[True]["accuracy"] == r[False]["accuracy"]
    assert abs(r[True]["loss"] - r[False]["loss"]) < 1e-4 and abs(r[True]["logprob"] - r[False]["logprob"]) < 1e-3
    assert all(r[s][k] > 0 for s in (True, False) for k in ("eval_s", "step_s"))
    assert [p.requires_grad for p in FT.shared_hf_model(tiny.bridge).parameters()] == before
    assert all(r[s][k] > 0 for s in (True, False) for k in ("eval_flops", "step_flops"))


def _rates_ok(row, variants):
    """Counted FLOPs, achieved TFLOP/s and the fraction of the peak of each variant."""
    import math

    return (
        all(
            row[f"{v}_flops"] > 0
            and row[f"{v}_tflops"] > 0
            and math.isfinite(row[f"{v}_fraction"])
            and row[f"{v}_fraction"] > 0
            for v in variants
        )
        and row["peak_tflops"] > 0
    )


def test_stacked_benchmark_on_a_random_model_reports_flops_and_rates():
    import torch

    bs = _load("stacked")
    rows = bs.main(["--model", "random-llama", "--n", "4", "--conditions", "2", "--repeats", "1", "--no-append"])
    assert [r["what"][:2] for r in rows] == ["03", "04", "01"]
    assert all(r["same"] and r["dtype"] == "float32" and _rates_ok(r, ("baseline", "new")) for r in rows)
    assert torch.is_grad_enabled()  # main() must not switch gradients off for the rest of the process


def test_answer_logits_main_on_a_random_model_reports_flops_and_rates():
    bal = _load("answer_logits")
    rows = bal.main(
        [
            "--model",
            "random-llama",
            "--n",
            "12",
            "--batch-size",
            "8",
            "--train-batch",
            "6",
            "--repeats",
            "1",
            "--no-append",
        ]
    )
    assert [r["pass"].split()[0] for r in rows] == ["evaluate", "one"]
    assert all(r["same"] and r["accuracy"] >= 0 and _rates_ok(r, ("whole", "shared")) for r in rows)


def test_evaluate_benchmark_on_a_random_model_reports_flops_and_rates():
    be = _load("evaluate")
    row = be.main(["--model", "random-llama", "--digits", "1", "--n-per-template", "1", "--no-append"])
    assert row["prompts"] > 0 and row["same"] and row["same_verdicts"] == row["prompts"]
    assert 0 <= row["accuracy"] <= 1 and _rates_ok(row, ("greedy", "checked"))


def test_results_section_names_the_command_and_machine():
    r = _load("results")
    text = r.section("T", ["| a |", "|---|", "| 1 |"], where="box", argv=["--x", "a b"], note="n")
    lines = text.split("\n")
    assert lines[0].startswith("## T (") and lines[0].endswith(", box)")
    assert lines[2].startswith("`python benchmarks/") and lines[2].endswith(" --x 'a b'`")
    assert lines[4] == "n" and lines[6:9] == ["| a |", "|---|", "| 1 |"]


@pytest.mark.slow
def test_gpu_suite_commands_run_on_a_tiny_model():
    """benchmarks/gpu.sh --check: every command of the GPU suite, with its flags, on a tiny
    random model on the CPU (a wrong flag would otherwise surface only on a GPU)."""
    import subprocess
    import sys

    env = {**os.environ, "PYTHON": sys.executable}
    done = subprocess.run(
        [str(ROOT / "benchmarks" / "gpu.sh"), "--check"], env=env, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.count(" ok in ") == 8


def test_lora_train_benchmark_on_a_random_model():
    bt = _load("lora_train")
    rows = bt.main(
        ["--model", "random-llama", "--steps", "2", "--batch-size", "4", "--layers", "0", "0.5", "--no-append"]
    )
    assert [r["layer"] for r in rows] == [0, 1, "mean"]
    assert all(r["same"] and r["full"] > 0 and r["late"] > 0 for r in rows)


def test_head_sweep_bound_counts_a_blocks_weights_and_the_engines_query_tokens():
    """The bound's multiply-adds per token and layer are the block's weight-matrix entries
    (counted, so the formula cannot drift from the model), and its query tokens are what
    exact_head_sweep recomputes: each batch's length minus its shared prefix."""
    import torch

    import arithlib.core.datasets as ds
    from arithlib.core.models import hf_module
    from arithlib.core.prompt_sets import PromptSet
    from arithlib.core.random_models import load_random_model

    hb = _load("head_sweep_bound")
    m = load_random_model("qwen2", "tiny")
    layer = hf_module(m.bridge).model.layers[0]
    mats = sum(mod.weight.numel() for mod in layer.modules() if isinstance(mod, torch.nn.Linear))
    assert hb.layer_macs(m.bridge.cfg) == mats
    recs = ds.yu_prompts(["+", "-"], n_digits=1, n_per_template=3, seed=0, fewshot=2, templates=[3])
    ps = PromptSet.build(recs, m.tokenizer)
    q = hb.query_tokens(ps)
    assert len(q) == len(ps) and all(0 < x < len(ps.input_ids[i]) for i, x in enumerate(q))
    assert hb.token_layers(ps, [0, 1], 2) == sum(q) * (2 + 1)


def _timings(folder, nn, rows, peak=10.0):
    from arithlib.run.floor import Sections

    s = Sections(peak_gflop_s=peak)
    for name, wall, gflop in rows:
        s.add(name, wall_s=wall, gflop=gflop)
    s.table(total_wall_s=sum(r[1] for r in rows) + 1).to_csv(folder / f"{nn}_timings.csv", index=False)


def test_floor_table_judges_only_sections_whose_floor_clears_the_bar(tmp_path):
    fl = _load("floor")
    _timings(tmp_path, "01", [("big", 200.0, 1000.0), ("small", 30.0, 10.0), ("none", 5.0, 0.0)])
    _timings(tmp_path, "04", [("fast", 110.0, 1000.0)])
    (tmp_path / "02_timings.csv").write_text("step,seconds\nload,3\n")  # an old table: left out
    table = fl.section_table(tmp_path)
    assert list(table.notebook) == ["01", "01", "01", "04"] and "total" not in set(table.section)
    lines = fl.markdown(table, goal=1.5, min_floor=60.0)
    by = {ln.split(" | ")[1]: ln for ln in lines[2:]}
    assert by["big"].endswith("| **no** |") and "| 2.0 |" in by["big"]  # 200 s against 100 s
    assert by["fast"].endswith("| yes |")
    assert "floor under the bar" in by["small"] and "floor under the bar" in by["none"]
    assert lines[-1].startswith("| all | every section | 345.0 | 2,010.0 | 201.0 | 1.7 |")


def test_pe_dag_benchmark_on_a_random_model():
    bp = _load("pe_dag")
    row = bp.main(["--model", "random-qwen2", "--calls", "2", "--rows", "3", "--repeats", "1", "--no-append"])
    assert row["max_abs_diff"] < 1e-5 and row["literal_s"] > 0 and row["fast_s"] > 0
    assert 0 < row["fast_gflop"] < row["literal_gflop"]  # the neuron's two rows, not the whole MLP
    assert torch.is_grad_enabled()  # the benchmark leaves autograd as it found it (later tests train)


def test_neuron_zeroing_benchmark_on_a_random_model():
    bz = _load("neuron_zeroing")
    row = bz.main(
        ["--model", "random-qwen2", "--prompts", "6", "--draws", "1", "--low", "1", "--repeats", "1", "--no-append"]
    )
    assert row["same_predictions"] and row["max_abs_coef_diff"] < 1e-4
    assert row["fast_gflop"] > 0 and row["literal_gflop"] > 0 and row["literal_s"] > 0 and row["fast_s"] > 0
    assert torch.is_grad_enabled()


def test_readout_benchmark_on_a_random_model():
    br = _load("readout")
    row = br.main(["--model", "random-qwen2", "--prompts", "3", "--orders", "2", "--repeats", "1", "--no-append"])
    assert row["same"] and row["max_diff"] < 1e-4
    assert row["literal_s"] > 0 and row["argmax_s"] > 0 and row["top1_s"] > 0
    assert torch.is_grad_enabled()


def test_grid_pass_benchmark_on_a_random_model():
    bg = _load("grid_pass")
    row = bg.main(
        [
            "--model",
            "random-qwen2",
            "--operand-max",
            "5",
            "--prompts",
            "20",
            "--batch-size",
            "8",
            "--repeats",
            "1",
            "--no-append",
        ]
    )
    assert row["same"] and row["max_diff"] < 1e-4 and row["literal_s"] > 0 and row["fast_s"] > 0
    assert torch.is_grad_enabled()


def test_lora_cna_benchmark_on_a_random_model():
    bl = _load("lora_cna")
    row = bl.main(["--model", "random-qwen2", "--models", "3", "--cases", "4", "--candidates", "5", "--no-append"])
    assert row["same_candidates"] and row["max_abs_diff"] < 1e-5
    assert row["literal_s"] > 0 and row["joint_s"] > 0
    assert 0 < row["joint_gflop"] < row["literal_gflop"]  # the original's rows screened once, not per model
    assert torch.is_grad_enabled()


def test_weight_variants_benchmark_on_a_random_model():
    bw = _load("weight_variants")
    row = bw.main(["--model", "random-qwen2", "--models", "3", "--cases", "6", "--no-append"])
    assert row["max_abs_diff"] < 1e-5 and row["literal_s"] > 0 and row["stacked_s"] > 0
    assert row["stacked_gflop"] > 0 and row["literal_gflop"] > 0  # (a 2-block model saves no blocks)
    assert torch.is_grad_enabled()


def test_vocab_chunk_benchmark_on_a_random_model():
    bv = _load("vocab_chunk")
    row = bv.main(["--model", "random-qwen2", "--rows", "4", "--columns", "2048", "--repeats", "1", "--no-append"])
    assert row["max_abs_diff"] < 1e-4  # the chunking and the stacking only reorder additions
    assert row["log_partition_speedup"] > 0 and row["stats_speedup"] > 0
    assert all(r > 0 for r in row["rates"].values())
    assert torch.is_grad_enabled()


def test_gqa_buffers_benchmark_on_a_random_model():
    bg = _load("gqa_buffers")
    row = bg.main(["--model", "random-qwen2", "--rows", "4", "16", "--prefix", "6", "--repeats", "1", "--no-append"])
    assert row["max_abs_diff"] == 0.0  # the same copy, into a reused buffer
    assert set(row["expand_speedup"]) == {4, 16} and all(s > 0 for s in row["pass_speedup"].values())
    assert torch.is_grad_enabled()


def test_element_blocks_benchmark_is_bit_identical_on_small_shapes():
    eb = _load("element_blocks")
    out = eb.main(
        ["--vocab", "4096", "--neurons", "256", "--rows", "8", "--candidates", "20", "--repeats", "1", "--no-append"]
    )
    assert len(out) == 2 and all(r["identical"] and r["speedup"] > 0 for r in out.values())
    assert torch.is_grad_enabled()


def test_top_merge_benchmark_counts_equal_on_small_shapes():
    tm = _load("top_merge")
    out = tm.main(["--vocab", "8192", "--rows", "300", "--repeats", "1", "--no-append"])
    assert out["identical"] and out["speedup"] > 0
    assert torch.is_grad_enabled()


def test_cache_pass_benchmark_on_a_random_model():
    bc = _load("cache_pass")
    rows = bc.main(
        ["--model", "random-qwen2", "--prefix", "6", "--rest", "2", "--rows", "3", "--repeats", "1", "--no-append"]
    )
    assert [r["rows"] for r in rows] == [1, 3] and all(r["identical"] for r in rows)
    assert all(0 < r["decoder_gflop"] < r["with_logits_gflop"] for r in rows)  # the unembedding is left out
    assert torch.is_grad_enabled()


def test_runner_prefix_benchmark_on_a_random_model():
    br = _load("runner_prefix")
    (row,) = br.main(
        ["--model", "random-qwen2", "--prompts", "40", "--batch-size", "4", "--repeats", "1", "--no-append"]
    )
    assert row["identical"] and row["distinct"] < row["batches"]
    assert 0 < row["per_prefix_gflop"] < row["per_batch_gflop"]  # fewer batch-1 passes


def test_packed_rows_benchmark_on_a_random_model():
    bp = _load("packed_rows")
    rows = bp.main(["--model", "random-qwen2", "--steps", "2", "--n-test", "12", "--no-append"])
    assert [r["layer"] for r in rows] == [0, 1]  # the tiny model's two blocks
    assert all(r["loss_diff"] < 1e-4 and r["logprob_diff"] < 1e-3 and r["flips"] == 0 for r in rows)
    assert bp.AL.rows_on_prefixes is bp.PACKED  # the library's own run is put back


def test_embedding_grad_benchmark_on_a_random_model():
    be = _load("embedding_grad")
    runs = be.main(["--model", "random-qwen2", "--steps", "2", "--rounds", "1", "--no-append"])
    assert [r["way"] for r in runs] == ["torch backward", "kept buffers"]
    assert all(r["seconds"] > 0 and r["gflop"] > 0 for r in runs)
    assert be.FT.kept_gradients is be.KEPT  # the library's own path is put back
