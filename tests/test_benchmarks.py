"""The small benchmark helpers: py-spy profile shares, the matmul rate, and the benchmark
scripts run on tiny random models."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _load(name):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_profile_shares_counts_innermost_frames(tmp_path):
    ps = _load("profile_shares")
    raw = tmp_path / "p.txt"
    raw.write_text(
        "<module> (a.py:1);run (arithlib/patching.py:10);forward (torch/nn/linear.py:5);Linear.forward (x.py:3) 6\n"
        "<module> (a.py:1);run (arithlib/patching.py:10);topk (arithlib/cna.py:7) 3\n"
        "<module> (a.py:1);idle (b.py:2) 1\n")
    s = ps.shares(raw)
    assert s["total"] == 10
    assert dict(s["leaf"])["Linear.forward"] == 6
    ours = dict(s["arithlib"])
    assert ours["run (arithlib/patching.py:10)"] == 6 and ours["topk (arithlib/cna.py:7)"] == 3
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
    assert row["max_diff"] < 1e-5  # the same update up to float rounding


def test_layer_inputs_benchmark_on_a_random_model():
    bl = _load("layer_inputs")
    rows = bl.main(["--model", "random-llama", "--n", "8", "--batch-size", "4", "--repeats", "1", "--no-append"])
    assert [r["layer"] for r in rows] == [1] and all(r["same"] and r["full"] > 0 for r in rows)


def test_malloc_benchmark_runs_both_settings():
    bm = _load("malloc")
    rows = bm.main(["--script", "optimizer.py", "--no-append", "--script-args", "--model", "random-llama",
                    "--steps", "2"])
    assert [r["setting"] for r in rows] == ["glibc default", "run_all.sh's MALLOC_ENV"]
    assert all(r["wall"] > 0 and r["faults"] > 0 for r in rows)


def test_patching_rows_go_into_the_first_table(tmp_path):
    bp = _load("patching")
    path = tmp_path / "RESULTS.md"
    path.write_text("# R\n\n| a |\n|---|\n| cpu |\n\nnote\n\n## other\n\n| b |\n|---|\n| x |\n")
    bp.insert_row(path, "| gpu |")
    assert path.read_text() == "# R\n\n| a |\n|---|\n| cpu |\n| gpu |\n\nnote\n\n## other\n\n| b |\n|---|\n| x |\n"


def test_threads_benchmark_times_both_phases_and_restores_threads():
    import torch

    import arithlib.heuristics as H
    from arithlib.datasets import PromptSet
    from arithlib.models import load_model, random_model_dir

    bt = _load("threads")
    tiny = load_model(str(random_model_dir("llama")))
    grid = PromptSet.build(H.grid_records("+", (0, 3), fewshot=1), tiny.tokenizer)
    before = torch.get_num_threads()
    prefix_s, passes_s = bt.time_runner(tiny.bridge, grid, threads=1, passes=2)
    assert prefix_s > 0 and passes_s > 0 and torch.get_num_threads() == before


def test_answer_logits_benchmark_times_both_passes_with_equal_results():
    import arithlib.datasets as ds
    import arithlib.finetune as FT
    from arithlib.models import load_model, random_model_dir

    bal = _load("answer_logits")
    tiny = load_model(str(random_model_dir("qwen2")))
    splits = FT.yu_lora_data(n_train=12, n_test=12, n_val=0, seed=0, fewshot=2)
    train, test = (ds.PromptSet.build(splits[k], tiny.tokenizer) for k in ("train", "test"))
    before = [p.requires_grad for p in FT.shared_hf_model(tiny.bridge).parameters()]
    r = bal.time_both(tiny.bridge, train, test, batch_size=8, train_batch=6, repeats=1)
    assert r[True]["accuracy"] == r[False]["accuracy"]
    assert abs(r[True]["loss"] - r[False]["loss"]) < 1e-4 and abs(r[True]["logprob"] - r[False]["logprob"]) < 1e-3
    assert all(r[s][k] > 0 for s in (True, False) for k in ("eval_s", "step_s"))
    assert [p.requires_grad for p in FT.shared_hf_model(tiny.bridge).parameters()] == before


def test_results_section_names_the_command_and_machine():
    r = _load("results")
    text = r.section("T", ["| a |", "|---|", "| 1 |"], where="box", argv=["--x", "a b"], note="n")
    lines = text.split("\n")
    assert lines[0].startswith("## T (") and lines[0].endswith(", box)")
    assert lines[2].startswith("`python benchmarks/") and lines[2].endswith(" --x 'a b'`")
    assert lines[4] == "n" and lines[6:9] == ["| a |", "|---|", "| 1 |"]
