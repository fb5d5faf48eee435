"""The fidelity table (arithlib.report.fidelity, with arithlib.report.fidelity_ours): the
papers' settings beside ours from synthetic params JSONs, "not recorded" for keys an older
run lacks, and its place in REPORT.md/.html."""

from __future__ import annotations

import json
from pathlib import Path

import arithlib.report as R
import arithlib.report.fidelity as F
import arithlib.report.fidelity_ours as FO

INFO = {"n_layers": 24, "n_heads": 14, "d_mlp": 4864, "source": "pypi-gguf"}


def _p(nb: str, **extra) -> dict:
    return {
        "model": "m-small",
        "model_info": INFO,
        "fewshot": 2,
        "quick": False,
        "device": "cpu",
        "dtype": "torch.float32",
        "notebook": nb,
        **extra,
    }


def _rows(table, finding: str) -> dict:
    return table[table.finding == finding].set_index("aspect").to_dict("index")


def test_every_finding_has_the_papers_setting_ours_and_forced():
    ids = [f.id for f in R.FINDINGS]
    assert set(ids) == set(F.PAPER) == set(FO.OURS) == set(FO.FORCED)
    assert all(set(F.PAPER[i]) == set(F.ASPECTS) and set(FO.OURS[i]) == set(F.ASPECTS) for i in ids)


def test_ours_reads_the_params_and_scales_layers_by_depth():
    params = {"01": _p("01", zhang_per_op=16, zhang_per_template=3, ops=["+", "-"], key_threshold=-0.05)}
    late = _rows(F.fidelity_table(params), "zhang_late_mlps")
    assert "m-small (24 layers x 14 heads, d_mlp 4864" in late["model"]["ours"]
    assert late["positions"]["ours"].endswith("split at layer 13 of 24")
    assert (
        late["positions"]["forced by the offline model"]
        == "fewer layers, indices scaled by depth: 17 of 32 -> 13 of 24"
    )
    key = _rows(F.fidelity_table(params), "zhang_key_heads")
    assert (
        "16 correct prompts per operator (+ -)" in key["prompts"]["ours"] and "2-shot prefix" in key["prompts"]["ours"]
    )
    assert "36 templates" in key["prompts"]["paper"] and "-5%" in key["metric"]["ours"]


def test_missing_params_read_not_recorded_without_raising():
    old = {"01": {"model": "m-old"}}  # a run from before model_info and the renamed keys
    table = F.fidelity_table(old)
    key = _rows(table, "zhang_key_heads")
    assert key["model"]["ours"] == F.NOT_RECORDED and key["prompts"]["ours"] == F.NOT_RECORDED
    nbs = {f.id: f.notebook for f in R.FINDINGS}
    assert (F.fidelity_table({}, nbs)["ours"] == F.NOT_RECORDED).all()  # no notebook ran
    assert _rows(F.fidelity_table({}), "yu_pruning")["positions"]["forced by the offline model"] == ""


def test_fine_tuning_scale_is_the_resolved_one():
    cpu = {"05": _p("05", scale="cpu", ops=["+"], lora_r=16, lora_alpha=32, top_ks=[50])}
    rows = _rows(F.fidelity_table(cpu), "yu_lora_layers")
    from arithlib.run.scales import FINETUNE_SCALES

    sizes = f"{FINETUNE_SCALES['cpu']['n_train']} train / {FINETUNE_SCALES['cpu']['n_test']} test"
    assert "scale 'cpu'" in rows["scale"]["ours"] and sizes in rows["scale"]["ours"]
    assert "no GPU" in rows["scale"]["forced by the offline model"]
    gpu = {"05": _p("05", scale="auto", device="cuda", ops=["+"], lora_r=16, lora_alpha=32, top_ks=[50])}
    rows = _rows(F.fidelity_table(gpu), "yu_lora_layers")
    assert "scale 'paper'" in rows["scale"]["ours"] and rows["scale"]["forced by the offline model"] == ""


def test_fidelity_table_is_its_own_page_linked_per_finding(tmp_path: Path):
    (tmp_path / "07_gender_bias_editing_params.json").write_text(
        json.dumps(_p("07", top_k=100, cna_prompt=0, edit_k=18, n_random_seeds=3, sweep=[6, 18]))
    )
    md, page = R.write_report(tmp_path)
    text, fid = md.read_text(), (tmp_path / R.FIDELITY_FILE).read_text()
    assert "| aspect | paper |" not in text and "(FIDELITY.md#yu_gender_bias)" in text
    assert (
        "| positions | top-18 CNA neurons zeroed (parameters set to zero) | top-18 CNA neurons "
        "zeroed (and 3 random sets) |" in fid
    )
    assert fid.count("| model |") == len(R.FINDINGS) and F.NOT_RECORDED in fid
    assert all(f'<a id="{f.id}"></a>' in fid for f in R.FINDINGS)
    assert 'href="FIDELITY.md#yu_gender_bias"' in page.read_text()


def test_notebook_04_entries_name_key_head_rule_keep_layers_ov_layers_and_seeds():
    base = dict(top_ks=[99, 10], mode="auto", n_candidates=200, concept_top=50, ms=[0, 1, 2, 3])
    new = _rows(F.fidelity_table({"04": _p("04", n_random_seeds=10, **base)}), "yu_mask_keep")
    assert "exact every-position sweep" in new["model"]["ours"] and "no head lowers" in new["model"]["ours"]
    assert "layers CNA scored" in new["positions"]["ours"] and "10 seeds" in new["metric"]["ours"]
    shallow = _rows(F.fidelity_table({"04": _p("04", n_random_seeds=10, **base)}), "yu_shallow_neurons")
    assert "every attention layer l < j <= H" in shallow["positions"]["ours"]
    assert "digits, English number words, operators" in shallow["positions"]["ours"]
    assert "1D / cases with the division key head" in shallow["prompts"]["ours"]  # the report's layer-0 rule
    old = _rows(F.fidelity_table({"04": _p("04", **base)}), "yu_mask_keep")  # a run from before the judged CPU scale
    assert old["metric"]["ours"] == F.NOT_RECORDED


def test_fine_tuning_scale_of_auto_on_a_cpu_is_the_recorded_one():
    """Since "auto" on a CPU is the judged "cpu" scale, recorded as scale_resolved;
    a run without that key ran before, when "auto" meant "quick" there."""
    common = dict(ops=["+"], lora_r=16, lora_alpha=32, top_ks=[50], kv="group")
    old = _rows(F.fidelity_table({"05": _p("05", scale="auto", **common)}), "yu_lora_layers")
    new = _rows(F.fidelity_table({"05": _p("05", scale="auto", scale_resolved="cpu", **common)}), "yu_lora_layers")
    assert "scale 'quick'" in old["scale"]["ours"] and "scale 'cpu'" in new["scale"]["ours"]
    sft = _rows(F.fidelity_table({"05": _p("05", scale="auto", scale_resolved="cpu", **common)}), "zhang_precise_sft")
    assert sft["scale"]["ours"] == F.NOT_RECORDED  # precise SFT is notebook 08's, which did not run here
    p08 = _p("08", scale="auto", scale_resolved="cpu", sft_lrs=[1e-4, 2e-5, 4e-6], ops=["+"], kv="group")
    grid = _rows(F.fidelity_table({"08": p08}), "zhang_precise_sft")
    assert "top-32 heads" in grid["positions"]["ours"] and "scale 'cpu'" in grid["scale"]["ours"]
    assert "lr from {0.0001, 2e-05, 4e-06} per method on the validation split" in grid["scale"]["ours"]
    assert "not offline" in grid["prompts"]["forced by the offline model"]


def test_yu_sweep_and_cna_entries_describe_only_the_method_their_run_used():
    """The head sweep's entry reads the two-stage parameters notebook 01 now
    records (it read keys no run records any more); the notebook-04 entries describe the
    issue-29 key head and keep layers only for a run that recorded them."""
    sweep = dict(yu_multi_per_setting=100, yu_screen_n=8, yu_top_k=10, yu_recall_setting="-1")
    rows = _rows(F.fidelity_table({"01": _p("01", **sweep)}), "yu_single_head")
    assert "every 1D operand pair" in rows["prompts"]["ours"] and "100 prompts per 2D" in rows["prompts"]["ours"]
    assert "every position" in rows["positions"]["ours"] and "top 10" in rows["positions"]["ours"]
    base = dict(top_ks=[99, 10], mode="auto", n_candidates=200, concept_top=50, ms=[0, 1, 2, 3])
    old = _rows(F.fidelity_table({"04": _p("04", **base)}), "yu_mask_keep")
    assert old["model"]["ours"] == old["positions"]["ours"] == F.NOT_RECORDED
    new = _rows(F.fidelity_table({"04": _p("04", n_random_seeds=10, **base)}), "yu_mask_keep")
    assert "exact every-position sweep" in new["model"]["ours"] and "layers CNA scored" in new["positions"]["ours"]


def _current_params() -> dict:
    """Each notebook's params as a run of today's notebooks records them: the keywords of
    its ``params = dict(...)`` and ``start_run(...)`` (values: the parameters cell's
    defaults, literals, else None) plus what every run adds (model, model_info, device,
    dtype)."""
    import ast
    import json
    import sys

    root = Path(__file__).resolve().parents[2]
    sys.path.insert(0, str(root / "scripts"))
    import notebook_files as nf

    info = {**INFO, "d_model": 896, "d_vocab": 151_936}
    out = {}
    for path in sorted((root / "notebooks").glob("[0-9][0-9]_*.ipynb")):
        declared = {k: ast.literal_eval(v) for k, v in nf.notebook_parameters(path).items()}
        recorded = dict(declared)
        for cell in json.loads(path.read_text())["cells"]:
            if cell["cell_type"] != "code" or "parameters" in cell.get("metadata", {}).get("tags", []):
                continue
            for node in ast.walk(
                ast.parse(
                    "\n".join(
                        line
                        for line in "".join(cell["source"]).splitlines()
                        if not line.lstrip().startswith(("%", "!"))
                    )
                )
            ):
                call = (
                    node.value
                    if isinstance(node, ast.Assign) and [getattr(t, "id", "") for t in node.targets] == ["params"]
                    else node
                )
                if isinstance(call, ast.Call) and (
                    call is not node or getattr(call.func, "id", getattr(call.func, "attr", "")) == "start_run"
                ):
                    for kw in (k for k in call.keywords if k.arg):
                        try:  # names of parameters, literals, list(...) of them; anything else None
                            recorded[kw.arg] = eval(
                                compile(ast.Expression(kw.value), "<kw>", "eval"),
                                {"__builtins__": {}, "list": list, "tuple": tuple},
                                declared,
                            )
                        except Exception:  # noqa: BLE001 (a value computed at run time)
                            recorded[kw.arg] = None
        out[path.name[:2]] = {**recorded, **_p(path.name[:2]), "model_info": info}
    return out


def test_every_entry_reads_only_parameters_todays_notebooks_record():
    """A run of the current notebooks leaves no 'ours' cell 'not recorded' (an entry
    that reads a renamed or removed parameter, e.g. 01's old verify_ks, fails here)."""
    params = _current_params()
    table = F.fidelity_table(params, {f.id: f.notebook for f in R.FINDINGS})
    stale = table[table["ours"] == F.NOT_RECORDED][["finding", "aspect"]].values.tolist()
    assert stale == []
