"""The report (arithlib.report): verdict rules at their thresholds on small synthetic
tables, "not run" for missing tables, the files it writes (Markdown, self-contained HTML,
cross-model table) and, on real toy-model outputs when present, that it runs end to end."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

import arithlib.report as R
from arithlib.report.render import _summary_counts as summary_counts
from arithlib.report.rules import _pct as pct

ROOT = Path(__file__).resolve().parents[2]
PNG = b"\x89PNG\r\n\x1a\n" + b"not really an image, only bytes to inline"


def _params(d: Path, nb: str = "01", n_layers: int = 4, n_heads: int = 4, quick: bool = False) -> None:
    d.mkdir(parents=True, exist_ok=True)
    info = {"n_layers": n_layers, "n_heads": n_heads, "d_mlp": 64, "name": d.name}
    extra = {"knockout_k": 10} if nb == "01" else {}  # a notebook-01 run with the corrected X_c (see below)
    (d / f"{nb}_x_params.json").write_text(json.dumps({"model": d.name, "quick": quick, "model_info": info, **extra}))


def _csv(d: Path, name: str, rows: list[dict]) -> None:
    d.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows).to_csv(d / f"{name}.csv", index=False)


OPS4 = ("+", "-", "*", "/")


def _path_patching(
    d: Path,
    head_effects: list[float],
    mlp_effects: list[float],
    n_heads: int = 4,
    n_prompts: int = 40,
    spread: float = 0.0,
) -> None:
    """The pooled table and the per-prompt table the Zhang rules read: ``n_prompts``
    prompts (operators in turn), each component's per-prompt effect = its mean +- ``spread``
    (alternating, so the mean is exact)."""
    rows = [
        {
            "op": "all",
            "component": f"L{i // n_heads}H{i % n_heads}",
            "kind": "head",
            "layer": i // n_heads,
            "head": i % n_heads,
            "effect": e,
        }
        for i, e in enumerate(head_effects)
    ]
    rows += [
        {"op": "all", "component": f"MLP{l}", "kind": "mlp", "layer": l, "head": -1, "effect": e}
        for l, e in enumerate(mlp_effects)
    ]
    rows += [
        {"op": "+", "component": "L0H0", "kind": "head", "layer": 0, "head": 0, "effect": -0.9}
    ]  # per-op row: ignored
    _csv(d, "01_path_patching", rows)
    per = []
    for p in range(n_prompts):
        dev = spread if p % 2 else -spread
        per += [
            {
                "prompt": p,
                "op": OPS4[(p // 2) % 4],
                "template_id": 0,
                "component": r["component"],
                "kind": r["kind"],
                "layer": r["layer"],
                "head": r["head"],
                "effect": r["effect"] + dev,
            }
            for r in rows
            if r["op"] == "all"
        ]
    _csv(d, "01_path_patching_per_prompt", per)


def _per_prompt_correct(n: int, rate: float) -> list[bool]:
    """n prompts of which round(rate * n) are correct, spread evenly over the list."""
    k = int(round(rate * n))
    return [int((i + 1) * k / n) > int(i * k / n) for i in range(n)]


def _outcome(finding_id: str, d: Path) -> R.Outcome:
    finding = next(f for f in R.FINDINGS if f.id == finding_id)
    return R.judge(finding, R.Tables(d))


# --------------------------------------------------------------------------- rules at their thresholds


@pytest.mark.parametrize(
    "n_key, verdict",
    [
        (0, R.NOT_REPRODUCED),
        (4, R.REPRODUCED),
        (5, R.REPRODUCED),
        (6, R.PARTLY),
        (10, R.PARTLY),
        (11, R.NOT_REPRODUCED),
    ],
)
def test_key_head_share_thresholds(tmp_path: Path, n_key: int, verdict: str):
    # 100 heads (10 layers x 10); key heads have effect below -5 %, one head sits just above -5 % (not key)
    effects = [-0.2] * n_key + [-0.0499] + [0.0] * (99 - n_key)
    _params(tmp_path, n_layers=10, n_heads=10)
    _path_patching(tmp_path, effects, [0.0] * 10, n_heads=10)
    out = _outcome("zhang_key_heads", tmp_path)
    assert out.verdict == verdict
    assert out.metrics["key-head share"] == pytest.approx(n_key / 100)
    assert out.interval is not None and out.interval.n == 40


def test_key_head_share_is_judged_on_its_interval(tmp_path: Path):
    """Heads whose mean effect sits near -5 % with noisy prompts make the share
    uncertain: the verdict is 'inconclusive', not the point estimate's band."""
    effects = [-0.2] * 3 + [-0.055] * 5 + [0.0] * 92  # 8 % by the point estimate (partly)
    _params(tmp_path, n_layers=10, n_heads=10)
    _path_patching(tmp_path, effects, [0.0] * 10, n_heads=10, n_prompts=8, spread=0.05)
    out = _outcome("zhang_key_heads", tmp_path)
    assert out.metrics["key-head share"] == pytest.approx(0.08)
    assert out.interval.low <= 0.05 and out.verdict == R.INCONCLUSIVE


def test_key_heads_show_how_concentrated_the_effect_is_beside_a_null(tmp_path: Path):
    """Beside the -5 % verdict (unchanged), the share of the total |mean effect| carried by
    the top 5 % of heads and its head-label-permutation null: three heads at -4 % (no key
    head) carry all of the effect (sparse), far above the null; equal effects are not."""
    _params(tmp_path, n_layers=10, n_heads=10)
    _path_patching(tmp_path, [-0.04] * 3 + [0.0] * 97, [0.0] * 10, n_heads=10)
    out = _outcome("zhang_key_heads", tmp_path)
    assert out.verdict == R.NOT_REPRODUCED  # no head crosses -5 %
    m = out.metrics
    assert m["top-5 % heads' share of |effect|"] == pytest.approx(1.0)
    assert m["top-5 % heads' share of |effect|, head labels permuted"] < 0.3
    assert "the top 5 % of heads (5 of 100) carry 100 % [100, 100]" in out.ours and "permuted" in out.ours
    dense = tmp_path / "dense"
    _params(dense, n_layers=10, n_heads=10)
    _path_patching(dense, [-0.01] * 100, [0.0] * 10, n_heads=10)
    m = _outcome("zhang_key_heads", dense).metrics
    assert m["top-5 % heads' share of |effect|"] == pytest.approx(0.05)
    assert m["top-5 % heads' share of |effect|, head labels permuted"] == pytest.approx(0.05)


def _knockout(d: Path, eff_acc: float, rnd_acc: float, n: int = 200, k: int = 10, n_random: int = 2) -> None:
    rows = []
    for cond, rate in [("none", 1.0), ("effect", eff_acc)] + [(f"random{i}", rnd_acc) for i in range(n_random)]:
        for p, c in enumerate(_per_prompt_correct(n, rate)):
            rows.append(
                {
                    "prompt": p,
                    "op": OPS4[p % 4],
                    "template_id": 0,
                    "condition": cond,
                    "n_heads": 0 if cond == "none" else k,
                    "position": "query",
                    "correct": c,
                }
            )
    rows += [dict(r, position="end", correct=True) for r in rows[:n]]  # the END screen is not judged
    _csv(d, "01_knockout_per_prompt", rows)


@pytest.mark.parametrize(
    "eff_acc, rnd_acc, verdict",
    [
        (0.30, 0.98, R.REPRODUCED),  # gap 0.68
        (0.55, 0.98, R.REPRODUCED),  # gap 0.43, interval above 0.34
        (0.60, 0.98, R.INCONCLUSIVE),  # gap 0.38, interval holds 0.34
        (0.80, 0.98, R.PARTLY),  # gap 0.18
        (0.98, 0.98, R.NOT_REPRODUCED),
    ],
)
def test_knockout_gap_rule(tmp_path: Path, eff_acc: float, rnd_acc: float, verdict: str):
    _params(tmp_path, n_layers=2, n_heads=8)
    _path_patching(tmp_path, [-0.3, -0.2] + [0.0] * 14, [0.0, 0.0])  # 2 key heads: k stays 10 (Table 4)
    _knockout(tmp_path, eff_acc, rnd_acc)
    out = _outcome("zhang_knockout", tmp_path)
    assert out.metrics["k knocked out"] == 10
    assert out.metrics["effect-rank minus random-rank accuracy drop"] == pytest.approx(rnd_acc - eff_acc)
    assert out.interval.low <= rnd_acc - eff_acc <= out.interval.high and out.interval.n == 200
    assert out.verdict == verdict


def test_knockout_reads_every_position_only(tmp_path: Path):
    """The old rule read the END-only curve at k = max(#key heads, 1); the
    judged knockout is at every query position, k = 10 (01_knockout.csv alone is not enough)."""
    _params(tmp_path, n_layers=2, n_heads=8)
    _path_patching(tmp_path, [-0.01] * 16, [0.0, 0.0])
    _csv(
        tmp_path,
        "01_knockout",
        [{"order": "effect", "order_name": "effect", "k": 1, "group": "all", "accuracy": 0.0, "n": 10}],
    )
    assert _outcome("zhang_knockout", tmp_path).verdict == R.NOT_RUN
    _knockout(tmp_path, 0.2, 1.0)
    out = _outcome("zhang_knockout", tmp_path)
    assert out.verdict == R.REPRODUCED and "every query position" in out.ours


def _knockout_matched(d: Path, effect_correct: list[bool], n_random: int = 2, k: int = 10) -> None:
    """01_knockout_per_prompt.csv on the prompts of :func:`_path_patching` (same ids,
    operators and templates, as notebook 01 writes them): nothing broken before or by the
    random sets; ``effect_correct`` per prompt after the effect-rank knockout."""
    rows = []
    for p, ok in enumerate(effect_correct):
        for cond in ["none", "effect"] + [f"random{i}" for i in range(n_random)]:
            rows.append(
                {
                    "prompt": p,
                    "op": OPS4[(p // 2) % 4],
                    "template_id": 0,
                    "condition": cond,
                    "n_heads": 0 if cond == "none" else k,
                    "position": "query",
                    "correct": bool(ok) if cond == "effect" else True,
                }
            )
    _csv(d, "01_knockout_per_prompt", rows)


def test_knockout_is_scored_on_prompts_its_heads_were_not_selected_on(tmp_path: Path):
    """Notebook 01 ranks heads by path patching and knocks them out on the same prompts. The
    top 10 on half A of the prompts (seeded, by operator) are the knockout's 10 here, so only
    half B scores the gap: the effect-rank knockout breaks half A only, which the old rule
    (scored on every prompt) read as a 50-point gap."""
    from arithlib.report.zhang import selection_half

    n = 200
    _params(tmp_path, n_layers=2, n_heads=8)
    _path_patching(tmp_path, [-0.3 + 0.01 * i for i in range(10)] + [0.0] * 6, [0.0, 0.0], n_heads=8, n_prompts=n)
    half_a = selection_half(np.array([OPS4[(p // 2) % 4] for p in range(n)]))
    assert half_a.sum() == n // 2
    _knockout_matched(tmp_path, list(~half_a))
    out = _outcome("zhang_knockout", tmp_path)
    assert out.interval.n == n // 2 and "held out" in out.ours
    assert out.metrics["effect-rank minus random-rank accuracy drop"] == 0.0
    assert out.verdict == R.NOT_REPRODUCED


def test_knockout_says_when_half_a_selects_other_heads(tmp_path: Path):
    """When the top 10 on half A are not the knockout's 10, no half is held out: every
    prompt is scored, and the text says the heads were selected on them."""
    from arithlib.report.zhang import selection_half

    n, H = 40, 8
    ops = np.array([OPS4[(p // 2) % 4] for p in range(n)])
    half_a = selection_half(ops)
    per = []
    for p in range(n):
        eff = [-0.3] * 9 + ([-0.2, 0.0] if half_a[p] else [0.0, -0.5]) + [0.0] * 5  # head 9 on A, head 10 overall
        per += [
            {
                "prompt": p,
                "op": ops[p],
                "template_id": 0,
                "component": f"L{i // H}H{i % H}",
                "kind": "head",
                "layer": i // H,
                "head": i % H,
                "effect": e,
            }
            for i, e in enumerate(eff)
        ]
    _params(tmp_path, n_layers=2, n_heads=H)
    _csv(tmp_path, "01_path_patching_per_prompt", per)
    _knockout_matched(tmp_path, [p % 5 != 0 for p in range(n)])
    out = _outcome("zhang_knockout", tmp_path)
    assert out.interval.n == n
    assert (
        "heads selected and scored on the same prompts" in out.ours and "share only 9 of the knockout's 10" in out.ours
    )


def test_knockout_and_transfer_say_their_heads_are_not_key_heads(tmp_path: Path):
    """Where no head crosses -5 %, the knocked-out top-10 heads are not key heads, and the
    knockout and transfer texts say so (read with notebook 01's rule, stored_key_heads)."""
    _params(tmp_path, n_layers=2, n_heads=8)
    _path_patching(tmp_path, [-0.04] * 16, [0.0, 0.0])
    _knockout(tmp_path, 0.2, 1.0)
    _transfer(tmp_path, 0.3, 0.96)
    for fid in ("zhang_knockout", "zhang_transfer"):
        assert "none of them is a key head" in _outcome(fid, tmp_path).ours, fid
    _path_patching(tmp_path, [-0.3, -0.2] + [-0.04] * 14, [0.0, 0.0])
    assert "only 2 of the 10 are key heads" in _outcome("zhang_knockout", tmp_path).ours


def _transfer(d: Path, after: float, rnd: float, n: int = 100) -> None:
    rows = []
    for f, before in (("a", 1.0), ("b", 1.0), ("c", 0.0)):  # c: never answered, left out
        for cond, rate in (
            ("none", before),
            ("knockout", after * before),
            ("random0", rnd * before),
            ("random1", rnd * before),
        ):
            for p, c in enumerate(_per_prompt_correct(n, rate)):
                rows.append(
                    {"format": f, "prompt": p, "condition": cond, "n_heads": 0 if cond == "none" else 10, "correct": c}
                )
    _csv(d, "01_transfer_per_prompt", rows)


@pytest.mark.parametrize(
    "after, rnd, verdict",
    [
        (0.30, 0.96, R.REPRODUCED),  # gap 0.66
        (0.62, 0.96, R.INCONCLUSIVE),  # gap 0.34: the interval holds 0.33
        (0.80, 0.96, R.PARTLY),  # gap 0.16
        (0.30, 0.30, R.NOT_REPRODUCED),
    ],
)  # random heads hurt as much
def test_transfer_rule_subtracts_random_heads(tmp_path: Path, after: float, rnd: float, verdict: str):
    _params(tmp_path, n_layers=2, n_heads=8)
    _path_patching(tmp_path, [-0.01] * 16, [0.0, 0.0])
    _transfer(tmp_path, after, rnd)
    out = _outcome("zhang_transfer", tmp_path)
    assert out.metrics["formats"] == 2
    assert out.metrics["transfer: relative drop minus random-heads drop"] == pytest.approx(rnd - after)
    assert "top-10 heads" in out.ours
    assert f"a [100/100 correct] {pct(after - 1, 0, signed=True)} ({pct(rnd - 1, 0, signed=True)})" in out.ours
    assert out.interval.n == 200 and out.verdict == verdict


@pytest.mark.parametrize(
    "x, signed, text",
    [
        (0.25, True, "+25 %"),
        (-0.4, True, "-40 %"),
        (0.0, True, "0 %"),
        (-0.001, True, "0 %"),
        (0.25, False, "25 %"),
        (-0.0001, False, "0 %"),
        (float("nan"), True, "n/a"),
    ],
)
def test_percent_changes_carry_their_sign(x: float, signed: bool, text: str):
    assert pct(x, 0, signed=signed) == text


def test_transfer_without_per_prompt_table_is_not_run(tmp_path: Path):
    _params(tmp_path, n_layers=2, n_heads=4)
    _path_patching(tmp_path, [-0.3] + [0.0] * 7, [0.0, 0.0])
    _csv(
        tmp_path,
        "01_transfer",
        [{"format": "a", "n": 10, "accuracy_before": 1.0, "accuracy_after": 0.2, "accuracy_random": 1.0}],
    )
    out = _outcome("zhang_transfer", tmp_path)
    assert out.verdict == R.NOT_RUN and "01_transfer_per_prompt.csv" in out.ours


@pytest.mark.parametrize(
    "early, late, verdict",
    [
        (0.01, 0.10, R.REPRODUCED),
        (0.01, 0.051, R.REPRODUCED),
        (0.03, 0.051, R.PARTLY),
        (0.001, 0.049, R.PARTLY),
        (0.05, 0.04, R.NOT_REPRODUCED),
    ],
)
def test_late_mlp_rule(tmp_path: Path, early: float, late: float, verdict: str):
    # 32 layers: MLPs 0-16 early, 17-31 late (the paper's split); signs must not matter
    _params(tmp_path, n_layers=32, n_heads=1)
    _path_patching(tmp_path, [0.0] * 32, [early] * 17 + [-late] * 15, n_heads=1)
    out = _outcome("zhang_late_mlps", tmp_path)
    assert out.verdict == verdict and out.interval is not None


def test_late_mlp_rule_is_judged_on_its_interval(tmp_path: Path):
    _params(tmp_path, n_layers=32, n_heads=1)
    _path_patching(tmp_path, [0.0] * 32, [0.01] * 17 + [-0.1] * 15, n_heads=1, n_prompts=6, spread=0.3)
    out = _outcome("zhang_late_mlps", tmp_path)
    assert out.interval.low < 2 and out.verdict == R.INCONCLUSIVE


def test_late_mlp_split_scales_with_depth(tmp_path: Path):
    _params(tmp_path, n_layers=24, n_heads=1)  # round(17/32 * 24) = 13
    _path_patching(tmp_path, [0.0] * 24, [0.0] * 13 + [0.1] + [0.0] * 10, n_heads=1)
    out = _outcome("zhang_late_mlps", tmp_path)
    assert out.metrics["early MLP mean |effect|"] == 0.0
    assert out.metrics["strongest MLP layer / n_layers"] == pytest.approx(13 / 24)


def _cosines(
    d: Path, curve: list[float] | None, n: int = 40, spread: float = 0.0, literal: list[float] | None = None
) -> None:
    """Notebook 02's per-prompt answer curves: the MLP's write (``write_C``, the verdict's
    reading) and, if given, the literal MLP_out - MLP_in (``delta_C``, the sensitivity one)."""
    rows = [
        {
            "prompt": p,
            "op": OPS4[p % 4],
            "template_id": 0,
            "layer": layer,
            "measure": measure,
            "value": v + (spread if p % 2 else -spread) * (layer > 0),
        }
        for measure, c in (("write_C", curve), ("delta_C", literal))
        if c is not None
        for p in range(n)
        for layer, v in enumerate(c)
    ]
    _csv(d, "02_mlp_cosines_per_prompt", rows)


@pytest.mark.parametrize(
    "onset, verdict", [(20, R.REPRODUCED), (17, R.REPRODUCED), (14, R.PARTLY), (8, R.NOT_REPRODUCED)]
)
def test_mlp_answer_onset_rule(tmp_path: Path, onset: int, verdict: str):
    """The answer curve is flat, then climbs from layer ``onset`` (32 layers); layer 0
    (the embedding's outlier, far below) is left out, so it cannot decide the verdict."""
    _params(tmp_path, "02", n_layers=32, n_heads=1)
    curve = [-0.5] + [0.0] * (onset - 1) + [0.5 + 0.02 * i for i in range(32 - onset)]
    _cosines(tmp_path, curve)
    out = _outcome("zhang_mlp_answer", tmp_path)
    assert out.metrics["answer-writing inflection layer / n_layers"] == pytest.approx(onset / 32)
    assert out.verdict == verdict


def test_mlp_answer_layer_0_outlier_does_not_decide(tmp_path: Path):
    """On Qwen-0.5B the curve jumps from -0.49 at layer 0 to its maximum at layer
    1 and then falls: no climb, not reproduced (the old rule's inflection was that jump)."""
    _params(tmp_path, "02", n_layers=24, n_heads=1)
    _cosines(tmp_path, [-0.49, -0.03, -0.06, -0.03] + [-0.05] * 16 + [-0.15, -0.15, -0.26, -0.26])
    out = _outcome("zhang_mlp_answer", tmp_path)
    assert out.verdict == R.NOT_REPRODUCED and "does not climb" in out.ours


def test_mlp_answer_reads_the_mlps_write_not_the_literal_difference(tmp_path: Path):
    """Zhang Sec. 4.2 subtracts MLP_in from MLP_out 'to isolate the specific contribution of
    MLP': the verdict reads the MLP's write (resid_post - resid_mid), which here climbs from
    layer 20 of 32; the literal output minus normalised input (here about -input, falling) is
    shown as a sensitivity reading with the verdict it would give, not judged."""
    _params(tmp_path, "02", n_layers=32, n_heads=1)
    write = [-0.5] + [0.0] * 19 + [0.5 + 0.02 * i for i in range(12)]
    literal = [-0.5] + [-0.03 - 0.01 * i for i in range(31)]
    _cosines(tmp_path, write, literal=literal)
    out = _outcome("zhang_mlp_answer", tmp_path)
    assert out.verdict == R.REPRODUCED
    assert out.metrics["answer-writing start layer / n_layers"] == pytest.approx(20 / 32)
    assert out.ours.startswith("cos(MLP write = resid_post - resid_mid, W_U[C])")
    assert "sensitivity, not judged: literal cos(MLP_out - MLP_in, W_U[C])" in out.ours
    assert "would read 'not reproduced'" in out.ours


def test_mlp_answer_without_the_write_curve_is_not_run(tmp_path: Path):
    """An older notebook-02 run stored only the literal MLP_out - MLP_in per prompt: the
    verdict's curve is missing, so 'not run' (rerun notebook 02), with the literal reading
    still shown."""
    _params(tmp_path, "02", n_layers=32, n_heads=1)
    _cosines(tmp_path, None, literal=[-0.5] + [0.0] * 19 + [0.5 + 0.02 * i for i in range(12)])
    out = _outcome("zhang_mlp_answer", tmp_path)
    assert out.verdict == R.NOT_RUN and "rerun notebook 02" in out.ours
    assert "would read 'reproduced'" in out.ours


def test_mlp_answer_climb_is_judged_on_its_interval(tmp_path: Path):
    """Whether the curve climbs at all is judged on the bootstrap: here the mean curve's
    maximum is (just) at its first searched layer, but about half the resamples climb to a
    late peak, so the verdict is inconclusive, not 'not reproduced' (the old rule's reading
    of the point estimate). The same curve is stored under both readings."""
    _params(tmp_path, "02", n_layers=32, n_heads=1)
    rows = []
    for p in range(40):
        bump = 0.09 + (0.3 if (p // 4) % 2 else -0.3)  # varies within every operator
        curve = [-0.5] + [-0.01 * layer for layer in range(1, 29)] + [-0.29 + bump * i for i in (1, 2, 3)]
        rows += [
            {"prompt": p, "op": OPS4[p % 4], "template_id": 0, "layer": layer, "measure": m, "value": v}
            for m in ("write_C", "delta_C")
            for layer, v in enumerate(curve)
        ]
    _csv(tmp_path, "02_mlp_cosines_per_prompt", rows)
    out = _outcome("zhang_mlp_answer", tmp_path)
    assert out.verdict == R.INCONCLUSIVE and "not settled by the bootstrap" in out.ours
    assert out.metrics["answer curve climbs (mean curve)"] == 0.0


def _bits(n_true: int, n: int, start: int = 0) -> str:
    """encode_correct of n prompts, the prompts start..start + n_true - 1 correct."""
    return "".join("T" if start <= i < start + n_true else "F" for i in range(n))


def _mask_keep(d: Path, mask: float, keep: float, rnd: float, n: int, n_seeds: int = 10, new: bool = True) -> None:
    """04_mask_keep.csv at K = 99 and 10: mask / keep rows and ``n_seeds`` random-mask and
    random-keep rows (each seed's correct cases shifted, same count), per-case correctness."""
    rows = []
    for K, scale in ((99, 1.0), (10, 0.5)):
        for kind, v in (("mask", mask), ("keep", keep), ("random mask", rnd), ("random keep", 90.0)):
            k = int(round((1 - v * scale / 100) * n))
            for s in range(n_seeds) if kind.startswith("random") else [None]:
                rows.append(
                    {
                        "group": "+-",
                        "intervention": kind,
                        "K": K,
                        "accuracy": k / n,
                        "accuracy_decrease": 100 * (1 - k / n),
                        "coef_decrease": 0,
                        "n_cases": n,
                        "base_accuracy": 1.0,
                        **(
                            {
                                "seed": float("nan") if s is None else s,
                                "keep_layers": "4-7",
                                "correct_by_prompt": _bits(k, n, start=(s or 0) % max(1, n - k + 1)),
                            }
                            if new
                            else {}
                        ),
                    }
                )
    rows.append(
        {
            "group": "/",
            "intervention": "mask",
            "K": 99,
            "accuracy": 1.0,
            "accuracy_decrease": 0.0,
            "coef_decrease": 0,
            "n_cases": n,
            "base_accuracy": 1.0,
        }
    )
    _csv(d, "04_mask_keep", rows)


@pytest.mark.parametrize(
    "mask, keep, rnd, n, verdict",
    [
        (100, 3.9, 2, 1000, R.REPRODUCED),
        (40, 10, 2, 1000, R.PARTLY),
        (90, 60, 2, 1000, R.PARTLY),
        (60, 10, 40, 1000, R.PARTLY),
        (10, 80, 2, 1000, R.NOT_REPRODUCED),
        (55, 10, 2, 20, R.UNDECIDABLE),
    ],
)  # 9 of 20 cases kept: straddles 50 %, and every correct 1D case is used
def test_mask_keep_rule(tmp_path: Path, mask: float, keep: float, rnd: float, n: int, verdict: str):
    _mask_keep(tmp_path, mask, keep, rnd, n)
    out = _outcome("yu_mask_keep", tmp_path)
    assert out.verdict == verdict
    assert out.interval.n == n and out.interval.method == "binomial"
    assert out.interval.low <= out.metrics["mask accuracy decrease (%)"] <= out.interval.high
    assert f"[{out.interval.low:.1f}, {out.interval.high:.1f}]" in out.ours and "10 seeds" in out.ours


def test_mask_keep_random_interval_spans_seeds(tmp_path: Path):
    """The random mask's interval comes from cases and seeds: seeds that disagree widen it,
    and a mask that beats the random mean but not its interval's 2x is inconclusive."""
    rows = []
    n = 400
    for kind, correct in (("mask", [int(0.4 * n)]), ("keep", [n]), ("random mask", [n - 4 * s for s in range(10)])):
        for s, k in enumerate(correct):
            rows.append(
                {
                    "group": "+-",
                    "intervention": kind,
                    "K": 99,
                    "accuracy": k / n,
                    "n_cases": n,
                    "base_accuracy": 1.0,
                    "seed": s if kind.startswith("random") else float("nan"),
                    "correct_by_prompt": _bits(k, n),
                }
            )
    _csv(tmp_path, "04_mask_keep", rows)
    out = _outcome("yu_mask_keep", tmp_path)
    assert out.metrics["random-mask accuracy decrease (%)"] == pytest.approx(
        100 * np.mean([4 * s for s in range(10)]) / n
    )
    assert out.verdict == R.REPRODUCED  # mask 60 % [55, 65] > 2 x the random mask's high end (< 10 %)
    wide = [row for row in rows if row["intervention"] != "random mask"]
    wide += [
        {**rows[-1], "seed": s, "accuracy": k / n, "correct_by_prompt": _bits(k, n)}
        for s, k in enumerate([n] * 5 + [int(0.5 * n)] * 5)
    ]  # half the seeds lose 50 %: random 25 %
    _csv(tmp_path, "04_mask_keep", wide)
    out = _outcome("yu_mask_keep", tmp_path)
    assert out.verdict == R.INCONCLUSIVE  # 2 x the random interval reaches past the mask's low end


def test_mask_keep_rule_on_tables_before_issue_29_is_not_run(tmp_path: Path):
    _mask_keep(tmp_path, 100, 3.9, 2, 1000, new=False)
    out = _outcome("yu_mask_keep", tmp_path)
    assert out.verdict == R.NOT_RUN and "rerun notebook 04" in out.ours


def test_mask_keep_names_a_fallback_key_head(tmp_path: Path):
    _mask_keep(tmp_path, 100, 3.9, 2, 200)
    _csv(tmp_path, "04_key_heads", [{"group": "+-", "layer": 16, "head": 10, "lowers_1d": False, "op": "+"}])
    out = _outcome("yu_mask_keep", tmp_path)
    assert "L16H10" in out.ours and "NO head lowers 1D accuracy" in out.ours


def _m_sweep(
    d: Path, hidden: float, random: float, n: int = 200, n_seeds: int = 10, new: bool = True, spread: int = 0
) -> None:
    """04_hidden_m_sweep.csv: the hidden set and ``n_seeds`` random sets per M; random
    seed s loses ``spread * (s - mid)`` more or fewer cases than the mean."""
    rows = []
    for M in (0, 1, 2, 3):
        for kind, dec in (("hidden-interpretable", hidden if M == 2 else 99.0), ("random", random if M == 2 else 0.0)):
            for s in range(n_seeds) if kind == "random" else [None]:
                shift = spread * (s - (n_seeds - 1) / 2) if s is not None else 0
                k = int(round((1 - dec / 100) * n - shift))
                rows.append(
                    {
                        "group": "+-",
                        "set": kind,
                        "M": M,
                        "n_neurons": 10,
                        "share_of_shallow": 0.01,
                        "accuracy": k / n,
                        "accuracy_decrease": 100 * (1 - k / n),
                        "base_accuracy": 1.0,
                        "n_cases": n,
                        "correct_by_prompt": _bits(k, n),
                        **(
                            {
                                "seed": float("nan") if s is None else s,
                                "n_shallow": 1000,
                                "paper_n": 1953,
                                "paper_share": 1953 / 176128,
                            }
                            if new
                            else {}
                        ),
                    }
                )
    _csv(d, "04_hidden_m_sweep", rows)


@pytest.mark.parametrize(
    "hidden, random, verdict",
    [
        (53.9, 2.6, R.REPRODUCED),
        (60.0, 5.0, R.REPRODUCED),
        (20.0, 5.0, R.PARTLY),
        (6.0, 5.0, R.NOT_REPRODUCED),
        (28.0, 2.0, R.UNDECIDABLE),
    ],
)  # gap 26 +- 6 straddles 25.7; all cases used
def test_shallow_neuron_rule(tmp_path: Path, hidden: float, random: float, verdict: str):
    _m_sweep(tmp_path, hidden, random)
    out = _outcome("yu_shallow_neurons", tmp_path)
    assert out.verdict == verdict and out.interval.method == "crossed bootstrap" and out.interval.n == 200
    assert "paper 1,953 = 1.1 %" in out.ours


def test_shallow_neuron_interval_widens_with_disagreeing_seeds(tmp_path: Path):
    _m_sweep(tmp_path, 40.0, 5.0)
    narrow = _outcome("yu_shallow_neurons", tmp_path).interval
    _m_sweep(tmp_path, 40.0, 5.0, spread=6)
    wide = _outcome("yu_shallow_neurons", tmp_path).interval
    assert wide.high - wide.low > narrow.high - narrow.low


def test_shallow_neuron_rule_reads_division_when_the_plus_minus_head_is_in_layer_0(tmp_path: Path):
    """A + / - key head in layer 0 has no FFN layer below it (notebook 04 writes no + / -
    sweep): the rule reads the / group (Yu App. B, Table 17) and says why, instead of
    'not run'."""
    _m_sweep(tmp_path, 60.0, 5.0)
    sweep = pd.read_csv(tmp_path / "04_hidden_m_sweep.csv").assign(group="/")
    sweep.to_csv(tmp_path / "04_hidden_m_sweep.csv", index=False)
    _csv(
        tmp_path,
        "04_key_heads",
        [
            {"group": "+-", "layer": 0, "head": 8, "lowers_1d": True, "op": "+"},
            {"group": "/", "layer": 10, "head": 12, "lowers_1d": True, "op": "/"},
        ],
    )
    out = _outcome("yu_shallow_neurons", tmp_path)
    assert out.verdict == R.REPRODUCED and out.interval.n == 200
    assert "L0H8 is in layer 0" in out.ours and "judged on 1D /" in out.ours and "L10H12" in out.ours
    _csv(
        tmp_path,
        "04_key_heads",
        [
            {"group": "+-", "layer": 3, "head": 8, "lowers_1d": True, "op": "+"},
            {"group": "/", "layer": 10, "head": 12, "lowers_1d": True, "op": "/"},
        ],
    )
    assert _outcome("yu_shallow_neurons", tmp_path).verdict == R.NOT_RUN  # a + / - sweep is missing: not run


def test_shallow_neuron_rule_on_tables_before_issue_29_is_not_run(tmp_path: Path):
    _m_sweep(tmp_path, 60.0, 5.0, n_seeds=1, new=False)  # one random set, the key layer's OV, broad concepts
    out = _outcome("yu_shallow_neurons", tmp_path)
    assert out.verdict == R.NOT_RUN and "rerun notebook 04" in out.ours


def _circuit_faithfulness(d: Path, f: float, n: int, noise: float, seed: int = 0) -> None:
    """Per-prompt normalized logits of two operators: full 1, ablated 0, circuit f (+ noise)."""
    rng = np.random.default_rng(seed)
    rows = []
    for op in "+-":
        for i in range(n):
            rows += [
                {"op": op, "prompt": i, "circuit": "full", "normalized_logit": 1.0, "correct": True},
                {
                    "op": op,
                    "prompt": i,
                    "circuit": "ablated",
                    "normalized_logit": float(rng.normal(0, noise)),
                    "correct": False,
                },
                {
                    "op": op,
                    "prompt": i,
                    "circuit": "circuit",
                    "normalized_logit": float(f + rng.normal(0, noise)),
                    "correct": True,
                },
            ]
    _csv(d, "03_circuit_faithfulness_prompts", rows)
    _csv(
        d,
        "03_circuit_faithfulness",
        [{"op": "all", "faithfulness": f, "share_per_layer": 0.01, "k_per_layer": 1, "n_heads": 4, "n_heldout": 2 * n}],
    )


@pytest.mark.parametrize(
    "f, n, noise, verdict",
    [
        (0.97, 200, 0.05, R.REPRODUCED),
        (0.7, 200, 0.05, R.PARTLY),
        (0.2, 200, 0.05, R.NOT_REPRODUCED),
        (0.92, 6, 0.3, R.INCONCLUSIVE),
    ],
)
def test_faithfulness_rule(tmp_path: Path, f: float, n: int, noise: float, verdict: str):
    """The verdict reads the held-out faithfulness of the full circuit (heads and neurons) through its
    bootstrap interval; few noisy prompts near 0.9 are inconclusive."""
    _circuit_faithfulness(tmp_path, f, n, noise)
    out = _outcome("nikankin_faithfulness", tmp_path)
    assert out.verdict == verdict
    assert out.interval is not None and out.interval.low <= out.interval.estimate <= out.interval.high
    assert out.interval.n == 2 * n and abs(out.interval.estimate - f) < 0.1 + noise


def test_faithfulness_rule_ignores_the_neuron_only_curve(tmp_path: Path):
    """The old rule judged the late-MLP-neuron-only curve on the selection prompts; it no longer decides."""
    rows = [
        {"op": op, "k_per_layer": k, "share_per_layer": s, "faithfulness": f}
        for op in "+-"
        for k, s, f in ((0, 0.0, 0.0), (1, 0.01, 0.99), (5, 0.05, 1.0))
    ]
    _csv(tmp_path, "03_faithfulness_curve", rows)
    assert _outcome("nikankin_faithfulness", tmp_path).verdict == R.NOT_RUN
    _circuit_faithfulness(tmp_path, 0.3, 100, 0.05)
    out = _outcome("nikankin_faithfulness", tmp_path)
    assert out.verdict == R.NOT_REPRODUCED and out.metrics["smallest share per layer reaching 0.9"] == 0.01


def _matched_share(d: Path, labelled: float = 0.5, n_circuit: int = 100) -> None:
    """03_matched_share with the label test's columns (two operators)."""
    _csv(
        d,
        "03_matched_share",
        [
            {
                "op": op,
                "n_circuit": n_circuit,
                "n_rules": 50,
                "matched_share": 0.96,
                "matched_share_null": 0.36,
                "labelled_share": labelled,
                "labelled_share_null": 0.0,
                "n_labelled": int(round(labelled * n_circuit)),
                "label_fdr": 0.05,
                "n_permutations": 2000,
            }
            for op in "+-"
        ],
    )


def _knockout_rows(n: int, heur: int, rnd: int, k: int = 40, testable=None) -> list[dict]:
    """03_prompt_ablation rows at the cap the rule reads (5 of 40 per layer) and at a larger
    cap: prompts 0..heur-1 survive the heuristic knockout, 0..rnd-1 the control."""
    rows = []
    for cap in (5, 20):
        for i in range(n):
            ok = True if testable is None else bool(testable(i))
            rows.append(
                {
                    "op": "+-"[i % 2],
                    "a": i,
                    "b": 1,
                    "answer": i + 1,
                    "cap": cap,
                    "k_per_layer": k,
                    "n_assoc_neurons": 30,
                    "n_ablated": min(cap, 30),
                    "n_control": min(cap, 30) if ok else 0,
                    "testable": ok,
                    "correct_full": 1.0,
                    "correct_heuristic_ablated": float(i < heur) if ok else float("nan"),
                    "correct_random_ablated": float(i < rnd) if ok else float("nan"),
                }
            )
    return rows


def test_faithfulness_of_an_operator_whose_ablation_changes_nothing_is_excluded(tmp_path: Path):
    """As SmolLM2's division: the fully ablated model answers every held-out prompt as the full one, so F's
    denominator is float noise and F = 737,124; that operator is excluded with its reason, not averaged."""
    _circuit_faithfulness(tmp_path, 0.95, 100, 0.02)
    rows = pd.read_csv(tmp_path / "03_circuit_faithfulness_prompts.csv").to_dict("records")
    for i in range(4):
        rows += [
            {"op": "/", "prompt": i, "circuit": "full", "normalized_logit": 1.0, "correct": True},
            {"op": "/", "prompt": i, "circuit": "ablated", "normalized_logit": 1.0 - 3e-8, "correct": True},
            {"op": "/", "prompt": i, "circuit": "circuit", "normalized_logit": 1.0 + 0.02, "correct": True},
        ]
    _csv(tmp_path, "03_circuit_faithfulness_prompts", rows)
    out = _outcome("nikankin_faithfulness", tmp_path)
    assert out.verdict == R.REPRODUCED and abs(out.interval.estimate - 0.95) < 0.05
    assert "/ excluded" in out.ours and out.metrics["operators excluded (F's denominator not above 0)"] == 1
    assert out.thresholds == (0.9, 0.48)
    _csv(tmp_path, "03_circuit_faithfulness_prompts", [r for r in rows if r["op"] == "/"])
    out = _outcome("nikankin_faithfulness", tmp_path)
    assert out.verdict == R.NOT_APPLICABLE and "no operator has a faithfulness" in out.ours


@pytest.mark.parametrize(
    "n, heur, rnd, verdict",
    [
        (400, 200, 360, R.REPRODUCED),
        (20, 15, 18, R.INCONCLUSIVE),
        (2000, 1850, 2000, R.PARTLY),
        (400, 360, 360, R.NOT_REPRODUCED),
        (400, 380, 360, R.NOT_REPRODUCED),
    ],
)
def test_prompt_ablation_rule(tmp_path: Path, n: int, heur: int, rnd: int, verdict: str):
    """A 15-point gap on 20 prompts (old rule: reproduced) is inconclusive; the interval decides.
    Paired: prompts 0..heur-1 survive the heuristic ablation, 0..rnd-1 the random one."""
    _matched_share(tmp_path)
    _csv(tmp_path, "03_prompt_ablation", _knockout_rows(n, heur, rnd))
    out = _outcome("nikankin_prompt_ablation", tmp_path)
    assert out.verdict == verdict
    assert out.metrics["random minus heuristic-ablated accuracy"] == pytest.approx((rnd - heur) / n)
    assert out.interval.n == n and out.metrics["neurons zeroed per layer (cap)"] == 5


def test_prompt_knockout_reads_its_cap_and_counts_untestable_prompts(tmp_path: Path):
    """The rule reads the cap at 25/200 of the circuit's neurons per layer, and prompts without a disjoint,
    layer-matched control are counted and left out, never scored from the tested set."""
    _matched_share(tmp_path)
    rows = _knockout_rows(400, 200, 360, testable=lambda i: i % 4 != 3)
    _csv(tmp_path, "03_prompt_ablation", rows)
    out = _outcome("nikankin_prompt_ablation", tmp_path)
    assert out.interval.n == 300 and out.metrics["prompts not testable"] == 100
    assert "100 not testable" in out.ours and out.thresholds == (0.10, 0.05)
    _csv(tmp_path, "03_prompt_ablation", _knockout_rows(50, 0, 50, testable=lambda i: False))
    out = _outcome("nikankin_prompt_ablation", tmp_path)
    assert out.verdict == R.NOT_APPLICABLE and "disjoint" in out.ours and "50 prompts not testable" in out.ours


def test_ablations_need_labels_that_beat_the_shuffled_operand_null(tmp_path: Path):
    """96 % of the neurons match at t, but no label beats the null: both ablations are not applicable;
    a table from before the label test says to rerun notebook 03."""
    _csv(tmp_path, "03_prompt_ablation", _knockout_rows(400, 200, 360))
    _heuristic_rows(tmp_path, 400, 0.5, 0.9)
    _csv(
        tmp_path,
        "03_matched_share",
        [
            {"op": op, "n_circuit": 588, "n_rules": 144, "matched_share": 0.96, "matched_share_null": 0.36}
            for op in "+-"
        ],
    )  # an older run's table
    for fid in ("nikankin_prompt_ablation", "nikankin_heuristic_ablation"):
        out = _outcome(fid, tmp_path)
        assert out.verdict == R.NOT_RUN and "rerun notebook 03" in out.ours
    _matched_share(tmp_path, labelled=0.0)
    for fid in ("nikankin_prompt_ablation", "nikankin_heuristic_ablation"):
        out = _outcome(fid, tmp_path)
        assert out.verdict == R.NOT_APPLICABLE and "beats the shuffled-operand null" in out.ours and "96 %" in out.ours
    _matched_share(tmp_path, labelled=0.3)
    out = _outcome("nikankin_heuristic_ablation", tmp_path)
    assert out.verdict == R.REPRODUCED and "30 %" in out.ours and out.thresholds == (0.10, 0.05)


def test_nikankin_rules_know_the_population_of_held_out_prompts(tmp_path: Path):
    """On a full 1-digit grid the held-out prompts come from a finite population (the correct prompts not used
    for selection): a straddling interval that would need more is undecidable here, not inconclusive."""
    _matched_share(tmp_path)
    _csv(tmp_path, "03_prompt_ablation", _knockout_rows(20, 15, 18))
    _csv(tmp_path, "03_grids", [{"op": op, "operands": "0..9", "n_prompts": 100, "subsampled": False} for op in "+-"])
    _csv(
        tmp_path,
        "03_grid_accuracy",
        [
            {
                "op": op,
                "n_grid": 100,
                "accuracy_first_token": 0.4,
                "accuracy_full_answer": 0.4,
                "n_analysed": 25,
                "n_heldout": 10,
            }
            for op in "+-"
        ],
    )
    out = _outcome("nikankin_prompt_ablation", tmp_path)
    assert out.population == 30 and out.verdict == R.UNDECIDABLE
    _csv(tmp_path, "03_grids", [{"op": op, "operands": "0..99", "n_prompts": 2000, "subsampled": True} for op in "+-"])
    out = _outcome("nikankin_prompt_ablation", tmp_path)
    assert out.population is None and out.verdict == R.INCONCLUSIVE and "would decide" in out.ours


def test_path_patching_with_the_leaking_counterfactual_is_not_judged(tmp_path: Path):
    # a notebook-01 run from before the corrected X_c (no knockout_k parameter) patched from the old X_c
    _small_model_dir(tmp_path, 4)
    info = {"n_layers": 4, "n_heads": 2, "d_mlp": 64, "name": tmp_path.name}
    (tmp_path / "01_x_params.json").write_text(json.dumps({"model": tmp_path.name, "model_info": info}))
    for fid in ("zhang_key_heads", "zhang_late_mlps"):
        out = _outcome(fid, tmp_path)
        assert out.verdict == R.NOT_RUN and "rerun notebook 01" in out.ours


def test_prompt_ablation_of_a_run_without_held_out_prompts_is_not_judged(tmp_path: Path):
    # a notebook-03 run of an older method chose and ablated its neurons on the same prompts
    _params(tmp_path, "03")
    _csv(
        tmp_path,
        "03_prompt_ablation",
        [{"op": "+", "correct_heuristic_ablated": 0.0, "correct_random_ablated": 1.0} for _ in range(50)],
    )
    out = _outcome("nikankin_prompt_ablation", tmp_path)
    assert out.verdict == R.NOT_RUN and "rerun notebook 03" in out.ours


def _heuristic_rows(d: Path, n: int, acc_assoc: float, acc_other: float) -> None:
    rows = []
    for op in "+-":
        for h in ("op1 in [0, 4]", "result mod 2 = 0"):
            for i in range(n):
                assoc = i % 2 == 0
                j = i // 2  # the j-th prompt of its group
                ok = j < round((acc_assoc if assoc else acc_other) * n / 2)
                rows.append(
                    {
                        "op": op,
                        "heuristic": h,
                        "kind": "x",
                        "n_neurons": 3,
                        "prompt": i,
                        "associated": assoc,
                        "correct": ok,
                        "correct_base": True,
                    }
                )
    _csv(d, "03_heuristic_ablation_prompts", rows)


@pytest.mark.parametrize(
    "n, acc_assoc, acc_other, verdict",
    [(400, 0.5, 0.9, R.REPRODUCED), (12, 0.5, 0.9, R.INCONCLUSIVE), (400, 0.9, 0.9, R.NOT_REPRODUCED)],
)
def test_heuristic_ablation_rule(tmp_path: Path, n: int, acc_assoc: float, acc_other: float, verdict: str):
    """Per-prompt rows (one per heuristic and prompt), gap with a paired bootstrap interval."""
    _matched_share(tmp_path)
    _heuristic_rows(tmp_path, n, acc_assoc, acc_other)
    out = _outcome("nikankin_heuristic_ablation", tmp_path)
    assert out.verdict == verdict
    assert out.metrics["other minus associated accuracy"] == pytest.approx(acc_other - acc_assoc, abs=0.07)
    assert out.metrics["heuristics ablated"] == 4 and out.interval.n == 2 * n


def _bias_scores(
    d: Path, cna: float, rnd: float, k: int = 18, noise: float = 0.05, n_seeds: int = 10, params: bool = True
) -> None:
    """Table 13 and the (prompt, profession) scores behind it (20 professions x 10 prompts,
    the same on the paper's professions): the CNA edit scales each pair's bias by
    1 - cna / 100 (times a little noise), each random seed by 1 - rnd / 100; the
    without-early-layers edit as the CNA one; an edit set with 16 neurons in layer 0."""
    rng = np.random.default_rng(0)
    base = rng.uniform(0.5, 1.5, 200)
    conds = {
        ("original", 0, -1): base,
        ("cna", k, -1): base * (1 - cna / 100) * (1 + noise * rng.standard_normal(200)),
        ("cna_late", k, -1): base * (1 - cna / 100),
    }
    for s in range(n_seeds):
        conds[("random", k, 1000 + s)] = base * (1 - rnd / 100) * (1 + noise * rng.standard_normal(200))
        conds[("random_late", k, 2000 + s)] = base * (1 - rnd / 100)
    rows = [
        {
            "prompt_id": i // 20,
            "token_id": i % 20,
            "bias_gender": "woman" if i % 20 < 10 else "man",
            "kind": kind,
            "K": kk,
            "seed": seed,
            "abs_diff": float(v),
        }
        for (kind, kk, seed), vals in conds.items()
        for i, v in enumerate(vals)
    ]
    _csv(d, "07_bias_scores", rows)
    _csv(d, "07_paper_bias_scores", rows)
    _csv(
        d,
        "07_edit_layers",
        [
            {"edit_set": "cna", "layer": 0, "n_neurons": 16, "share": 16 / 18},
            {"edit_set": "cna", "layer": 20, "n_neurons": 2, "share": 2 / 18},
        ],
    )
    if params:
        (d / "07_gender_bias_editing_params.json").write_text(
            json.dumps({"model": d.name, "quick": False, "edit_k": k, "early_layers": 1})
        )
    red = {c: 100 * (1 - np.mean(v) / np.mean(base)) for c, v in conds.items()}
    _csv(
        d,
        "07_table13",
        [
            {"model": "original", "K": 0, "total": float(base.mean()), "reduction_pct": 0.0},
            {
                "model": f"CNA top-{k}",
                "K": k,
                "total": float(conds[("cna", k, -1)].mean()),
                "reduction_pct": red[("cna", k, -1)],
            },
            {
                "model": f"random {k}",
                "K": k,
                "total": 0.0,
                "reduction_pct": float(np.mean([v for c, v in red.items() if c[0] == "random"])),
            },
        ],
    )


@pytest.mark.parametrize(
    "cna, rnd, verdict",
    [
        (35.7, 0.0, R.REPRODUCED),
        (25.0, 10.0, R.REPRODUCED),
        (25.0, 22.0, R.NOT_REPRODUCED),
        (12.0, 2.0, R.PARTLY),
        (10.0, 8.0, R.NOT_REPRODUCED),
        (18.0, 0.0, R.UNDECIDABLE),
    ],
)  # straddles 17.85 %; every biased profession used
def test_gender_bias_rule(tmp_path: Path, cna: float, rnd: float, verdict: str):
    _bias_scores(tmp_path, cna, rnd, noise=0.05 if verdict != R.UNDECIDABLE else 0.3)
    out = _outcome("yu_gender_bias", tmp_path)
    assert out.verdict == verdict and out.interval.n == 20  # professions, each with its 10 prompts
    assert out.interval.estimate == pytest.approx(out.metrics["CNA bias reduction (%)"])
    assert out.metrics["CNA minus random (points)"] == pytest.approx(
        cna - rnd, abs=1.5 if verdict != R.UNDECIDABLE else 5
    )
    assert out.metrics["edited neurons in early layers"] == 16 and "16 of the 18 edited neurons" in out.ours
    assert "Table 23" in out.ours and "without the early layers" in out.ours and "10 seeds" in out.ours


def test_gender_bias_before_issue_29_is_not_run(tmp_path: Path):
    _bias_scores(tmp_path, 35.7, 0.0)
    (tmp_path / "07_paper_bias_scores.csv").unlink()
    out = _outcome("yu_gender_bias", tmp_path)
    assert out.verdict == R.NOT_RUN and "rerun notebook 07" in out.ours and out.interval is None
    _bias_scores(tmp_path / "old", 35.7, 0.0)  # the tables, but the params of a run before the judged CPU scale
    (tmp_path / "old" / "07_gender_bias_editing_params.json").write_text(json.dumps({"model": "m", "edit_k": 18}))
    out = _outcome("yu_gender_bias", tmp_path / "old")
    assert out.verdict == R.NOT_RUN and "rerun notebook 07" in out.ours


def test_gender_bias_without_biased_professions_is_not_run(tmp_path: Path):
    _csv(tmp_path, "07_top_predictions", [{"prompt_id": 0, "token": " nurse", "is_profession": True}])
    out = _outcome("yu_gender_bias", tmp_path)
    assert out.verdict == R.NOT_RUN and "no profession" in out.ours


def _lora_layers(
    d: Path, orig: float, accs: list, bands: dict, n: int = 200, starts: list | None = None, per_prompt: bool = True
) -> None:
    """Notebook 05's per-layer table over n test prompts (original first) and its bands
    (band -> (layers cell, mean accuracy)); ``starts``: the first correct prompt of each LoRA layer."""
    starts = starts or [0] * len(accs)
    rows = [
        {
            "model": "original",
            "layer": -1,
            "accuracy": round(orig * n) / n,
            **({"correct_by_prompt": _bits(round(orig * n), n)} if per_prompt else {}),
        }
    ]
    rows += [
        {
            "model": f"LoRA L{i}",
            "layer": i,
            "accuracy": round(a * n) / n,
            **({"correct_by_prompt": _bits(round(a * n), n, s)} if per_prompt else {}),
        }
        for i, (a, s) in enumerate(zip(accs, starts))
    ]
    _csv(d, "05_lora_accuracy_by_layer", rows)
    _csv(d, "05_lora_accuracy_bands", [{"band": b, "layers": ls, "mean_accuracy": v} for b, (ls, v) in bands.items()])


@pytest.mark.parametrize(
    "orig, accs, bands, starts, verdict",
    [
        (0.6, [0.9, 0.8, 0.75], {"shallow": ("0", 0.9), "deep": ("2", 0.75)}, None, R.REPRODUCED),
        (0.6, [0.75, 0.8, 0.9], {"shallow": ("0", 0.75), "deep": ("2", 0.9)}, None, R.PARTLY),
        # one layer of three ties the original: resampling the three layers cannot decide, and every layer is trained
        (0.6, [0.9, 0.6, 0.7], {"shallow": ("0", 0.9), "deep": ("2", 0.7)}, None, R.UNDECIDABLE),
        (0.6, [0.5, 0.5, 0.7], {"shallow": ("0", 0.5), "deep": ("2", 0.7)}, None, R.UNDECIDABLE),
        # layer 2 leads by 2 points, below the 5-point margin: it does not beat the original
        (0.6, [0.9, 0.9, 0.62], {"shallow": ("0", 0.9), "deep": ("2", 0.62)}, [0, 0, 10], R.UNDECIDABLE),
    ],
)
def test_lora_layer_rule(tmp_path: Path, orig: float, accs: list, bands: dict, starts, verdict: str):
    _lora_layers(tmp_path, orig, accs, bands, starts=starts)
    _params(tmp_path, n_layers=3)
    out = _outcome("yu_lora_layers", tmp_path)
    assert out.verdict == verdict and out.interval.n == 200
    assert out.interval.estimate == pytest.approx(
        out.metrics["share of LoRA layers beating the original by the margin"]
    )


def test_lora_layers_need_the_margin_and_resample_the_layers(tmp_path: Path):
    """A layer one prompt above the original does not beat it, and the interval is over
    layers too: 16 of 20 layers well above and 4 one prompt above give a share of 0.8
    with an interval that reaches below 0.9, judged inconclusive with the layers named as
    what would decide (a bootstrap over prompts alone gave [1, 1], reproduced)."""
    accs = [0.9] * 16 + [0.605] * 4
    _lora_layers(tmp_path, 0.6, accs, {"shallow": ("0-9", 0.9), "deep": ("10-19", 0.8)})
    _params(tmp_path, n_layers=24)
    out = _outcome("yu_lora_layers", tmp_path)
    assert out.interval.estimate == pytest.approx(0.8) and out.interval.low < 0.9 and out.interval.high > 0.5
    assert out.verdict == R.INCONCLUSIVE and "more LoRA layers (now 20 of 24) would decide" in out.ours


def test_lora_layer_rule_without_per_prompt_columns_is_not_run(tmp_path: Path):
    _lora_layers(tmp_path, 0.6, [0.9, 0.8, 0.75], {"shallow": ("0", 0.9), "deep": ("2", 0.75)}, per_prompt=False)
    _params(tmp_path, n_layers=3)
    out = _outcome("yu_lora_layers", tmp_path)
    assert out.verdict == R.NOT_RUN and "rerun notebook 05" in out.ours


@pytest.mark.parametrize(
    "scale, device, quick, resolved, judged",
    [
        ("auto", "cpu", False, None, False),  # an older run: "auto" was "quick" on a CPU
        ("auto", "cpu", False, "cpu", True),  # since: "auto" is the judged "cpu" scale, recorded as such
        ("auto", "cpu", True, "quick", False),
        ("quick", "cuda", False, None, False),
        ("auto", "cuda", True, None, False),
        ("cpu", "cpu", False, None, True),
        ("auto", "cuda", False, None, True),
    ],
)
def test_fine_tuning_at_smoke_test_sizes_is_shown_but_not_judged(
    tmp_path: Path, scale, device, quick, resolved, judged
):
    _lora_layers(tmp_path, 0.6, [0.9, 0.8, 0.7], {"shallow": ("0", 0.9), "deep": ("2", 0.7)})
    _params(tmp_path, n_layers=3)
    p05 = {"scale": scale, "device": device, "quick": quick, **({"scale_resolved": resolved} if resolved else {})}
    (tmp_path / "05_lora_mechanism_params.json").write_text(json.dumps(p05))
    out = _outcome("yu_lora_layers", tmp_path)
    assert out.verdict == (R.REPRODUCED if judged else R.NOT_JUDGED)
    assert "original 60 %" in out.ours and ("smoke-test" in out.ours) != judged


def test_a_quick_notebook_is_not_judged(tmp_path: Path):
    _path_patching(tmp_path, head_effects=[-0.3] + [0.0] * 15, mlp_effects=[0.0] * 4)
    _params(tmp_path, quick=True)
    out = _outcome("zhang_key_heads", tmp_path)
    assert out.verdict == R.NOT_JUDGED and "quick mode" in out.ours and "1 of 16 heads" in out.ours


def _table11(d: Path, orig: float, cna: float, rnd: float, n: int = 200, per_prompt: bool = True) -> None:
    """Table 11 over n test prompts (nested correct sets), two random seeds at rnd -+ 1 point."""
    accs = [
        ("original", orig),
        ("LoRA", 0.893),
        ("LoRA on CNA-pruned", cna),
        ("LoRA on CNA-masked", cna),
        ("LoRA on random-pruned", rnd - 0.01),
        ("LoRA on random-pruned", rnd + 0.01),
    ]
    _csv(
        d,
        "06_table11",
        [
            {
                "model": m,
                "accuracy": round(a * n) / n,
                **({"correct_by_prompt": _bits(round(a * n), n)} if per_prompt else {}),
            }
            for m, a in accs
        ],
    )


@pytest.mark.parametrize(
    "cna, rnd, verdict",
    [
        (0.823, 0.171, R.REPRODUCED),
        (0.90, 0.30, R.REPRODUCED),
        (0.30, 0.02, R.PARTLY),  # gap large but below the original
        (0.70, 0.50, R.PARTLY),
        (0.70, 0.69, R.NOT_REPRODUCED),
        (0.75, 0.40, R.INCONCLUSIVE),
    ],
)  # gap 35 +- 5 straddles 32.6
def test_pruning_rule(tmp_path: Path, cna: float, rnd: float, verdict: str):
    _table11(tmp_path, 0.629, cna, rnd)
    out = _outcome("yu_pruning", tmp_path)
    assert out.verdict == verdict and out.interval.n == 200
    assert out.interval.estimate == pytest.approx(out.metrics["CNA-pruned minus random-pruned accuracy"])


def test_pruning_rule_without_per_prompt_columns_is_not_run(tmp_path: Path):
    _table11(tmp_path, 0.629, 0.823, 0.171, per_prompt=False)
    out = _outcome("yu_pruning", tmp_path)
    assert out.verdict == R.NOT_RUN and "rerun notebook 06" in out.ours


def test_pruning_interval_covers_the_spread_between_random_prunings(tmp_path: Path):
    """Two random prunings 30 points apart: the gap's interval resamples them too, so it
    is wider than the prompts alone would make it and the verdict is not decided."""
    n = 200
    accs = [
        ("original", 0.6),
        ("LoRA", 0.9),
        ("LoRA on CNA-pruned", 0.8),
        ("LoRA on random-pruned", 0.2),
        ("LoRA on random-pruned", 0.5),
    ]
    _csv(
        tmp_path,
        "06_table11",
        [{"model": m, "accuracy": a, "correct_by_prompt": _bits(round(a * n), n)} for m, a in accs],
    )
    out = _outcome("yu_pruning", tmp_path)
    assert out.interval.estimate == pytest.approx(0.45)
    assert out.interval.low < 0.326 < out.interval.high and out.verdict == R.INCONCLUSIVE


# --------------------------------------------------------------------------- missing or broken tables


def test_empty_folder_gives_not_run_for_every_finding(tmp_path: Path):
    table = R.findings_table(tmp_path)
    assert list(table.id) == [f.id for f in R.FINDINGS]
    assert (table.verdict == R.NOT_RUN).all()
    assert table.ours.str.contains("missing").all()


def test_malformed_table_is_an_error_not_a_study_that_did_not_run(tmp_path: Path, capsys):
    _csv(tmp_path, "04_mask_keep", [{"something": 1}])
    out = _outcome("yu_mask_keep", tmp_path)
    assert out.verdict == R.ERROR and "could not compute" in out.ours
    assert "yu_mask_keep" in capsys.readouterr().err
    table = R.findings_table(tmp_path)  # the rest of the report is still written
    assert (table.set_index("id").drop("yu_mask_keep").verdict == R.NOT_RUN).all()
    assert "1 error" in summary_counts(table) and "error" not in summary_counts(table.iloc[:1])


def _yu_sweep(d: Path, n: int, clean: int, after: int) -> None:
    """An exact-stage sweep of one head per operator (+ - /) on ``n`` 1D prompts each:
    ``clean`` answered before, ``after`` with the head zeroed."""
    _csv(
        d,
        "01_yu_head_sweep",
        [
            {
                "op": op,
                "n_digits": 1,
                "layer": 0,
                "head": 0,
                "rank": 1,
                "n": n,
                "accuracy": after / n,
                "baseline_accuracy": clean / n,
                "accuracy_drop": (clean - after) / n,
                "relative_drop": 1 - after / clean,
            }
            for op in ("+", "-", "/")
        ],
    )
    _csv(
        d,
        "01_yu_head_sweep_rows",
        [
            {
                "op": op,
                "n_digits": 1,
                "layer": 0,
                "head": 0,
                "prompt": i,
                "correct": i < after,
                "clean_correct": i < clean,
            }
            for op in ("+", "-", "/")
            for i in range(n)
        ],
    )


def test_yu_single_head_compares_relative_decreases_as_the_paper_does(tmp_path: Path):
    # Yu's Table 2 is relative: 1D+ 88.9 -> 47.6 % is a 46.5 % decrease (Table 24), 41 points
    _yu_sweep(tmp_path, 200, 100, 48)
    out = _outcome("yu_single_head", tmp_path)
    assert out.verdict == R.REPRODUCED, out.ours  # 52 % relative (26 points absolute would be only 'partly')
    assert "+ L0H0 52 %" in out.ours and out.interval.low > 0.27


def test_yu_single_head_is_undecidable_when_its_interval_straddles_a_threshold(tmp_path: Path):
    # the same 52 % decrease on 6 prompts per operator cannot be told from 27 %, and the 1D
    # operand pairs are all measured: more prompts of the same kind do not exist
    _yu_sweep(tmp_path, 6, 4, 2)
    out = _outcome("yu_single_head", tmp_path)
    assert out.verdict == R.UNDECIDABLE, out.ours
    assert out.interval.low < 0.27 < out.interval.high


def test_yu_single_head_needs_the_exact_every_position_sweep(tmp_path: Path):
    # an old run's sweep (answer-position screen, no per-prompt rows) is not judged
    _csv(
        tmp_path,
        "01_yu_head_sweep",
        [
            {
                "op": "add",
                "n_digits": 1,
                "layer": 0,
                "head": 0,
                "accuracy": 0.2,
                "baseline_accuracy": 0.5,
                "accuracy_drop": 0.3,
            }
        ],
    )
    out = _outcome("yu_single_head", tmp_path)
    assert out.verdict == R.NOT_RUN and "rerun notebook 01" in out.ours


def test_findings_are_declared_completely():
    ids = [f.id for f in R.FINDINGS]
    assert len(ids) == len(set(ids))
    for f in R.FINDINGS:
        assert f.paper in R.PAPERS and f.notebook in R.NOTEBOOKS
        assert f.claim and f.paper_number and f.source and f.rule and f.where


# --------------------------------------------------------------------------- files


def _small_model_dir(d: Path, n_layers: int) -> Path:
    _params(d, "01", n_layers=n_layers, n_heads=2, quick=True)
    _path_patching(d, [-0.2] + [0.0] * (2 * n_layers - 1), [0.0] * (n_layers - 1) + [0.3], n_heads=2)
    (d / "01_path_patching.png").write_bytes(PNG)
    (d / "01_findings.json").write_text(json.dumps({"lines": ["- a line <with> markup"]}))
    return d


def test_write_report_files(tmp_path: Path):
    d = _small_model_dir(tmp_path / "m", 4)
    md, page = R.write_report(d)
    text, doc = md.read_text(), page.read_text()
    details, fidelity = (d / R.DETAILS_FILE).read_text(), (d / R.FIDELITY_FILE).read_text()
    assert "| [zhang_key_heads](#zhang_key_heads) |" in text and "(01_path_patching.png)" in text
    assert "QUICK mode" in text and "a line <with> markup" in details and "a line" not in text
    assert '<img alt="zhang_key_heads: figure" src="01_path_patching.png">' in doc and "<figcaption>" in doc
    assert "not run for this model" in text and "Not run for this model." in details  # notebooks 02-08
    assert '<a id="zhang_key_heads"></a>' in fidelity and "| model |" in fidelity
    assert not [p for p in d.iterdir() if p.name.endswith(".tmp")]
    for page_ in (md, page, d / R.DETAILS_FILE, d / R.FIDELITY_FILE):
        assert R.broken_links(page_) == [], page_.name


def test_summary_has_one_line_per_finding(tmp_path: Path):
    """The report opens with the summary: one table row per finding, in FINDINGS order, each
    with its paper, claim, our number with its interval (or why there is none) and verdict."""
    d = _small_model_dir(tmp_path / "m", 4)
    _bias_scores(d, 35.7, 0.0)
    text = R.report_markdown(d)
    assert text.index("## Summary") < text.index("## Findings") < text.index("## Notebooks")
    summary = text[text.index("## Summary") : text.index("## Findings")]
    rows = [line for line in summary.splitlines() if line.startswith("| [")]
    assert [re.match(r"\| \[([a-z_]+)\]", r).group(1) for r in rows] == [f.id for f in R.FINDINGS]
    table = R.findings_table(d).set_index("id")
    for f, row in zip(R.FINDINGS, rows):
        cells = [c.strip() for c in row.strip("|").split(" | ")]
        assert cells[1] == R.PAPERS_SHORT[f.paper] and cells[2] == f.claim and cells[4] == table.at[f.id, "verdict"]
    gender = next(r for r in rows if r.startswith("| [yu_gender_bias]"))
    ci = _outcome("yu_gender_bias", d).interval
    assert f"[{ci.low:.1f}, {ci.high:.1f}], n = {ci.n}" in gender
    assert "no interval (see its section)" in next(r for r in rows if r.startswith("| [yu_pruning]"))  # not run
    for f in R.FINDINGS:  # then one section per finding
        assert text.count(f'<a id="{f.id}"></a>') == 1 and f"### {f.id}: " in text
    assert len(R.summary_frame(R.findings_table(d))) == len(R.FINDINGS)


def test_report_names_its_commits_compactly_and_says_which_were_dirty(tmp_path: Path):
    for nb, commit in (("00", "a" * 40 + "+dirty"), ("01", "b" * 40), ("02", "b" * 40)):
        (tmp_path / f"{nb}_x_params.json").write_text(json.dumps({"model": "m", "environment": {"git_commit": commit}}))
    (tmp_path / "03_x_params.json").write_text(json.dumps({"model": "m"}))
    line = R.commit_summary(R.Tables(tmp_path).params())
    assert "results from 2 commits" in line and "notebook 00 ran with uncommitted changes" in line
    assert "notebook 03 recorded no commit" in line and "DETAILS.md#provenance" in line and "a" * 40 not in line
    (tmp_path / "00_x_params.json").unlink()
    (tmp_path / "03_x_params.json").unlink()
    assert R.commit_summary(R.Tables(tmp_path).params()).startswith("**Code:** results from commit bbbbbbb;")
    details = R.details_markdown(R.Tables(tmp_path), R.findings_table(tmp_path))
    assert f"commit {'b' * 40} (notebooks 01, 02)" in details


def test_reports_do_not_link_an_executed_notebooks_untracked_html(tmp_path: Path):
    d = _small_model_dir(tmp_path / "m", 4)
    (d / "notebooks").mkdir()
    (d / "notebooks" / "01_identify_heads.ipynb").write_text("{}")
    (d / "notebooks" / "01_identify_heads.html").write_text("<html></html>")  # run_all.sh writes it; git ignores it
    md, page = R.write_report(d)
    for text in (md.read_text(), page.read_text(), (d / R.DETAILS_FILE).read_text()):
        assert "notebooks/01_identify_heads.ipynb" in text and "01_identify_heads.html" not in text


def _committed_report_pages() -> list[Path]:
    pages = R.committed_pages(ROOT, ("REPORT.md", "REPORT.html", R.FIDELITY_FILE, R.DETAILS_FILE))
    if not pages:
        pytest.skip("no committed report (or not a git checkout)")
    return pages


def test_committed_reports_link_only_committed_files():
    """Every link of every model folder's REPORT.md / REPORT.html (and the pages they link)
    leads to a file git tracks, and every #anchor exists: what a clean clone shows."""
    tracked = R.links.tracked_files(ROOT)
    pages = _committed_report_pages()
    names = {p.name for p in pages}
    assert {"REPORT.md", "REPORT.html"} <= names
    bad = {p.relative_to(ROOT).as_posix(): R.broken_links(p, exists=lambda q: q in tracked) for p in pages}
    assert not {k: v for k, v in bad.items() if v}, bad


def test_committed_reports_hold_no_process_words():
    """No tracker issue numbers or working-session dates in the generated pages."""
    for page in _committed_report_pages():
        text = page.read_text()
        assert not re.search(r"\bissues? #?\d+", text, re.I), page
        assert not re.search(r"\b20\d\d-\d\d-\d\d\b", text), page


def test_committed_report_is_short():
    """REPORT.md of the default model reads in minutes: the summary comes first, each finding's
    section reads in about a minute (300 words per finding on average, the summary and the
    notebook index included), and the long tables live in FIDELITY.md / DETAILS.md."""
    text = (ROOT / "figures" / "qwen2.5-coder-0.5b" / "REPORT.md").read_text()
    visible = re.sub(r"<details>.*?</details>", "", text, flags=re.S)
    assert len(visible.split()) < 300 * len(R.FINDINGS) and "More figures" not in text and "## Fidelity" not in text
    rows = [
        line
        for line in text[text.index("## Summary") : text.index("## Findings")].splitlines()
        if line.startswith("| [")
    ]
    assert len(rows) == len(R.FINDINGS) and sorted(len(r) for r in rows)[len(rows) // 2] < 300


def test_cross_model_table_normalises_depth(tmp_path: Path):
    a = _small_model_dir(tmp_path / "small", 4)
    b = _small_model_dir(tmp_path / "big", 8)
    frame = R.cross_model_table([a, b])
    assert list(frame.columns) == ["finding", "quantity", "paper", "small", "big"]
    ours = frame[(frame.finding == "yu_pruning") & (frame.quantity == "ours")]
    assert ours["paper"].item().startswith("original 62.9") and "missing" in ours["small"].item()
    row = frame[(frame.finding == "zhang_late_mlps") & (frame.quantity == "strongest MLP layer / n_layers")]
    assert row["small"].item() == pytest.approx(3 / 4) and row["big"].item() == pytest.approx(7 / 8)
    n_layers = frame[frame.quantity == "n_layers"]
    assert (n_layers["small"].item(), n_layers["big"].item()) == (4, 8)
    verdicts = frame[frame.quantity == "verdict"]
    assert len(verdicts) == len(R.FINDINGS) and set(verdicts["small"]) <= set(R.VERDICTS)


def test_cli_writes_reports_and_cross_model(tmp_path: Path):
    dirs = [_small_model_dir(tmp_path / name, n) for name, n in (("m1", 4), ("m2", 6), ("m3", 8))]
    assert R.main([str(d) for d in dirs]) == 0
    for d in dirs:
        assert (d / "REPORT.md").exists() and (d / "REPORT.html").exists()
    csv = pd.read_csv(tmp_path / "CROSS_MODEL.csv")
    assert list(csv.columns) == ["finding", "quantity", "paper", "m1", "m2", "m3"]
    assert "| finding | quantity | paper | m1 | m2 | m3 |" in (tmp_path / "CROSS_MODEL.md").read_text()
    assert (tmp_path / "CROSS_MODEL.png").exists() and (tmp_path / "CROSS_MODEL.pdf").exists()
    metrics = pd.read_csv(tmp_path / "CROSS_MODEL_metrics.csv")
    assert set(metrics["model"]) == {"m1", "m2", "m3"}
    assert set(metrics["panel"]) == {p for p, _, _ in R.CROSS_METRICS}
    key = metrics[metrics["panel"].str.startswith("Key heads")].set_index("model")["value"]
    share = {d.name: _outcome("zhang_key_heads", d).metrics["key-head share"] for d in dirs}
    assert key.to_dict() == pytest.approx(share, nan_ok=True)


def test_verdict_table_one_row_per_finding_and_counts(tmp_path: Path):
    a = _small_model_dir(tmp_path / "a", 4)
    b = _small_model_dir(tmp_path / "b", 8)
    frame = R.cross_model_table([a, b])
    table = R.verdict_table(frame)
    assert list(table.columns) == ["finding", "paper", "paper's number", "a", "b"]
    assert table["finding"].tolist() == [f.id for f in R.FINDINGS] + ["**all**"]
    for m in ("a", "b"):
        verdicts = frame[frame.quantity == "verdict"][m]
        counts = [part.split(" ", 1) for part in table[m].iloc[-1].split(", ")]
        assert {v: int(n) for n, v in counts} == verdicts.value_counts().to_dict()


def test_verdict_table_shows_each_verdicts_interval(tmp_path: Path):
    a, b = _small_model_dir(tmp_path / "a", 4), _small_model_dir(tmp_path / "b", 8)
    _bias_scores(a, 35.7, 0.0)
    table = R.verdict_table(R.cross_model_table([a, b])).set_index("finding")
    ci = _outcome("yu_gender_bias", a).interval
    assert table.at["yu_gender_bias", "a"] == f"reproduced [{ci.low:.3g}, {ci.high:.3g}] (n = 20)"  # professions
    assert table.at["yu_gender_bias", "b"] == R.NOT_RUN  # no interval: the verdict alone
    assert "1 reproduced" in table.at["**all**", "a"]


def test_readme_block_is_replaced_and_missing_markers_are_an_error(tmp_path: Path):
    text = f"# title\n\n{R.README_START}\nold table\n{R.README_END}\n\nafter\n"
    new = R.replace_readme_block(text, "| a |\n|---|\n")
    assert new == f"# title\n\n{R.README_START}\n| a |\n|---|\n{R.README_END}\n\nafter\n"
    assert R.replace_readme_block(new, "| a |\n|---|\n") == new
    with pytest.raises(ValueError, match="no verdict block"):
        R.replace_readme_block("# no block\n", "| a |")


def test_cli_cross_in_writes_readme_table_and_skips_the_toy_model(tmp_path: Path):
    figs = tmp_path / "figures"
    for name, n in (("m1", 4), ("m2", 6)):
        _small_model_dir(figs / name, n)
    _small_model_dir(figs / R.TOY_FOLDER, 2)
    (figs / "empty").mkdir()
    assert [d.name for d in R.model_folders(figs)] == ["m1", "m2"]
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{R.README_START}\n{R.README_END}\n")
    assert R.main(["--cross-in", str(figs), "--readme", str(readme)]) == 0
    text = readme.read_text()
    assert (
        "| finding | paper | paper's number | [m1](figures/m1/REPORT.md) | [m2](figures/m2/REPORT.md) |" in text
        and R.TOY_FOLDER not in text
    )
    assert "| [m1](m1/REPORT.md) | [m2](m2/REPORT.md) |" in (figs / "CROSS_MODEL.md").read_text()
    assert (figs / "CROSS_MODEL.md").exists() and not (figs / "m1" / "REPORT.md").exists()


def test_toy_folder_is_the_toy_model():
    from arithlib.core.models import TOY_MODEL

    assert R.TOY_FOLDER == TOY_MODEL


def test_readme_verdicts_match_the_committed_figures():
    """The README's verdict table is the one the committed figures give (run_all.sh rewrites
    it; after committing new figures without it, this fails)."""
    folders = R.model_folders(ROOT / "figures")
    if len(folders) < 2:
        pytest.skip("fewer than two committed model folders")
    text = (ROOT / "README.md").read_text()
    assert R.replace_readme_block(text, R.verdict_markdown(folders, ROOT)) == text, (
        "README.md's verdict table differs from figures/: run python -m arithlib.report --cross-in figures "
        "--readme README.md"
    )


def _coef_tables(d: Path, shallow: float, middle: float, deep: float, n: int = 50, per_case: bool = True) -> None:
    """Notebook 05's Table 10 (one LoRA model per band) and the per-case parts behind it:
    each case's increase is the band's value plus noise (sd 5 %), den = 1."""
    rng = np.random.default_rng(1)
    _params(d, "05")
    bands = (("shallow", "0", shallow), ("middle", "1", middle), ("deep", "2", deep))
    per, rows, by_band = [], [], []
    for layer, (band, cell, v) in enumerate(bands):
        row = {"band": band, "layers": cell, "n_models": 1, "selection": "cna"}
        for k in (50, 10):
            num = (v + 5 * rng.standard_normal(n)) / 100
            per += [
                {"model": f"LoRA L{layer}", "selection": "cna", "k": k, "case": i, "num": x, "den": 1.0}
                for i, x in enumerate(num)
            ]
            rows.append(
                {
                    "model": f"LoRA L{layer}",
                    "selection": "cna",
                    "k": k,
                    "coef_increase": 100 * num.mean(),
                    "n_cases": n,
                    "layer": layer,
                }
            )
            row[f"top{k}"] = 100 * num.mean()
        by_band.append(row)
    _csv(d, "05_cna_coef_increase_by_band", by_band)
    _csv(d, "05_cna_coef_increase", rows)
    if per_case:
        _csv(d, "05_cna_coef_per_case", per)


@pytest.mark.parametrize(
    "shallow, middle, deep, verdict",
    [
        (30.0, 20.0, 5.0, R.REPRODUCED),
        (15.0, 10.0, 5.0, R.PARTLY),
        (0.3, 0.2, 0.1, R.NOT_REPRODUCED),
        (21.3, 10.0, 5.0, R.INCONCLUSIVE),
    ],
)  # shallow ~ 21 %
def test_lora_coefficient_rule(tmp_path: Path, shallow: float, middle: float, deep: float, verdict: str):
    _coef_tables(tmp_path, shallow, middle, deep)
    out = _outcome("yu_lora_coef", tmp_path)
    assert out.verdict == verdict and out.interval.n == 50
    assert out.interval.estimate == pytest.approx(out.metrics["mean coefficient increase over bands (%)"])


def test_lora_coefficient_rule_without_per_case_table_is_not_run(tmp_path: Path):
    _coef_tables(tmp_path, 30.0, 20.0, 5.0, per_case=False)
    out = _outcome("yu_lora_coef", tmp_path)
    assert out.verdict == R.NOT_RUN and "rerun notebook 05" in out.ours


def test_n_params_from_shapes():
    # Qwen2.5-0.5B's shapes give its published 494 M parameters (norms and biases left out)
    info = {
        "n_layers": 24,
        "d_model": 896,
        "n_heads": 14,
        "n_kv_heads": 2,
        "d_head": 64,
        "d_mlp": 4864,
        "d_vocab": 151936,
        "gated_mlp": True,
    }
    assert R.n_params(info) == pytest.approx(494e6, rel=0.01)
    assert np.isnan(R.n_params({"n_layers": 2}))


def test_cross_model_curves_on_normalised_depth(tmp_path: Path):
    for name, L in (("a", 4), ("b", 8)):
        d = tmp_path / name
        _params(d, "05", n_layers=L)
        _csv(
            d,
            "05_lora_accuracy_by_layer",
            [{"layer": -1, "accuracy": 0.5}] + [{"layer": l, "accuracy": 0.6 + 0.01 * l} for l in range(0, L, 2)],
        )
    curves = R.cross_model_curves([tmp_path / "a", tmp_path / "b"])
    assert set(curves["curve"]) == {"LoRA in one attention layer (Yu Fig. 2)"}
    b = curves[curves["model"] == "b"]
    assert b["layer"].tolist() == [0, 2, 4, 6] and b["depth"].tolist() == [0, 0.25, 0.5, 0.75]
    assert (curves["layer"] >= 0).all()


def test_cross_model_heuristic_share_reads_labels_that_beat_the_null(tmp_path: Path):
    """The cross-model heuristic panel compares the labelled share (t and the null) with the
    null's, not the share passing t alone; a run without the test gives NaN, not its t share."""
    from arithlib.report import cross_model

    d = tmp_path / "m"
    _csv(
        d,
        "03_matched_share",
        [
            {
                "op": "+",
                "matched_share": 0.96,
                "matched_share_null": 0.36,
                "labelled_share": 0.40,
                "labelled_share_null": 0.02,
            }
        ],
    )
    got = cross_model._heuristic_share(R.Tables(d), {})
    assert got == {"labelled (t and null)": pytest.approx(0.40), "labelled, shuffled activations": pytest.approx(0.02)}
    _csv(d, "03_matched_share", [{"op": "+", "matched_share": 0.96, "matched_share_null": 0.36}])
    assert all(np.isnan(v) for v in cross_model._heuristic_share(R.Tables(d), {}).values())


def test_cross_model_mlp_curve_is_the_mlps_write(tmp_path: Path):
    """The cross-model MLP curve draws what the verdict reads, cos(MLP write, W_U[C])
    (``write_C``); the literal MLP_out - ln2(MLP_in) (``delta_C``) is a separate, named curve."""
    d = tmp_path / "m"
    _params(d, "02", n_layers=2)
    _csv(
        d,
        "02_mlp_cosines",
        [{"measure": m, "layer": l, "mean": v + l} for m, v in (("write_C", 0.1), ("delta_C", -0.5)) for l in range(2)],
    )
    curves = R.cross_model_curves([d]).set_index(["curve", "layer"])["value"]
    assert curves[("cos(MLP write, W_U[C]) (Zhang Fig. 6b)", 0)] == pytest.approx(0.1)
    assert curves[("cos(MLP_out - ln2(MLP_in), W_U[C]), literal reading", 1)] == pytest.approx(0.5)


@pytest.mark.parametrize(
    "values, trend",
    [
        ([0.1, 0.2, 0.4], "rises with size"),
        ([0.4, 0.2, 0.1], "falls with size"),
        ([0.0, 0.0, 0.0], "flat"),
        ([1.0, 1.005, 0.998], "flat"),  # steps under 1 % of the largest value
        ([0.1, 0.4, 0.2], "mixed"),
        ([0.1, 0.1, 0.4], "mixed"),  # one flat step, one rise
        ([0.1, float("nan"), 0.4], "fewer than 3 models"),
        ([0.1, 0.2, float("nan"), 0.3], "rises with size"),  # a model that did not run is skipped
    ],
)
def test_size_trend_rule(values: list, trend: str):
    assert R.size_trend(values) == trend


def test_size_trends_orders_models_by_size():
    rows = []
    for model, size, v in (("big", 3e9, 0.3), ("small", 1e8, 0.1), ("mid", 5e8, 0.2)):
        rows.append({"model": model, "n_params": size, "panel": "P", "ylabel": "y", "series": "s", "value": v})
    rows.append({"model": "mid", "n_params": 5e8, "panel": "Q", "ylabel": "y", "series": "", "value": float("nan")})
    trends = R.size_trends(pd.DataFrame(rows))
    assert list(trends.columns) == ["panel", "series", "small", "mid", "big", "trend"]
    assert trends.iloc[0][["small", "mid", "big"]].tolist() == [0.1, 0.2, 0.3]
    assert trends["trend"].tolist() == ["rises with size"]  # a panel that ran nowhere has no row


# --------------------------------------------------------------------------- real toy-model outputs


def _toy_figures() -> Path:
    """$ARITHLIB_TOY_FIGURES, else where `./run_all.sh --model toy-arith --quick` writes
    (outputs/scratch/figures/toy-arith; figures/toy-arith with --figures figures)."""
    if "ARITHLIB_TOY_FIGURES" in os.environ:
        return Path(os.environ["ARITHLIB_TOY_FIGURES"])
    candidates = [ROOT / "figures" / "toy-arith", ROOT / "outputs" / "scratch" / "figures" / "toy-arith"]
    return next((c for c in candidates if (c / "01_path_patching.csv").exists()), candidates[-1])


@pytest.mark.toy_model
def test_report_on_toy_model_outputs(tmp_path: Path):
    """On the tables of `./run_all.sh --model toy-arith --quick` (folder: :func:`_toy_figures`),
    copied so that nothing is written there."""
    src = _toy_figures()
    if not (src / "01_path_patching.csv").exists():
        pytest.skip(
            f"no toy-model outputs in {src}: run ./run_all.sh --model toy-arith --quick "
            "(with --figures DIR, set ARITHLIB_TOY_FIGURES=DIR/toy-arith)"
        )
    d = tmp_path / "toy-arith"
    d.mkdir()
    for p in src.iterdir():
        if p.name.endswith((".csv", ".csv.gz", ".json", ".png")):  # per-prompt tables are gzipped
            shutil.copy2(p, d / p.name)
    table = R.findings_table(d)
    assert set(table.verdict) <= set(R.VERDICTS)
    for f, row in zip(R.FINDINGS, table.itertuples()):  # a notebook that ran gives a verdict, not an error
        assert "could not compute" not in row.ours, (f.id, row.ours)
    assert (table.set_index("id").loc[["zhang_key_heads", "zhang_knockout"], "verdict"] != R.NOT_RUN).all()
    md, page = R.write_report(d)
    srcs = re.findall(r'<img [^>]*src="([^"]+)"', page.read_text())
    assert srcs and all((d / s).is_file() for s in srcs)
    twin = shutil.copytree(d, tmp_path / "toy-copy")
    frame = R.cross_model_table([d, twin])
    verdicts = frame[frame.quantity == "verdict"]
    assert (verdicts["toy-arith"] == verdicts["toy-copy"]).all()


def test_every_figure_is_shown_or_linked(tmp_path: Path):
    """REPORT.html shows each finding's figure (linked PNGs, not embedded); every other figure
    is linked from DETAILS.md, so no figure is lost."""
    d = _small_model_dir(tmp_path / "m", 4)
    for name in ("01_key_heads.png", "04_cna_mask.png"):
        (d / name).write_bytes(PNG)
    R.write_report(d)
    page = (d / "REPORT.html").read_text()
    srcs = re.findall(r'<img [^>]*src="([^"]+)"', page)
    assert srcs == ["01_path_patching.png"] and "base64" not in page
    details = (d / R.DETAILS_FILE).read_text()
    assert all(f"({p.name})" in details for p in d.glob("[0-9][0-9]_*.png"))


def test_notebook_verdicts_are_the_reports(tmp_path: Path):
    _bias_scores(tmp_path, 50.0, 1.0)
    lines = R.notebook_verdicts(tmp_path, "07")
    table = R.findings_table(tmp_path).set_index("id")
    assert len(lines) == 1 and "yu_gender_bias" in lines[0] and "**reproduced**" in lines[0]
    assert f"**{table.at['yu_gender_bias', 'verdict']}**" in lines[0] and table.at["yu_gender_bias", "ours"] in lines[0]
    assert len(R.notebook_verdicts(tmp_path, "01")) == sum(f.notebook == "01" for f in R.FINDINGS)
    with pytest.raises(ValueError, match="unknown notebook"):
        R.notebook_verdicts(tmp_path, "7")


# --------------------------------------------------------------------------- figures inline, links between files


def test_report_md_shows_each_findings_figure_with_a_caption(tmp_path: Path):
    d = _small_model_dir(tmp_path / "m", 4)
    for name in ("01_knockout.png", "01_key_head_attention.png", "04_mask_keep.png"):
        (d / name).write_bytes(PNG)
    (d / "notebooks").mkdir()
    (d / "notebooks" / "01_identify_heads.ipynb").write_text("{}")
    text = R.report_markdown(d)
    pos = {
        k: text.index(k)
        for k in (
            '<a id="zhang_key_heads"></a>',
            "![zhang_key_heads: figure](01_path_patching.png)",
            '<a id="zhang_knockout"></a>',
            "could not use: [01_knockout.png](01_knockout.png)",
            '<a id="zhang_late_mlps"></a>',
            "the one shown under [zhang_key_heads]",
            '<a id="zhang_mlp_answer"></a>',
        )
    }
    assert list(pos.values()) == sorted(pos.values())  # each finding's figure in its own section
    assert R.findings_table(d).set_index("id").at["zhang_knockout", "verdict"] == R.NOT_RUN  # its figure only linked
    assert f"*{R.captions.caption('01_path_patching')}*" in text and "A figure of notebook" not in text
    assert "01_key_head_attention" not in text and "More figures" not in text and "\n\n\n" not in text
    assert "[executed notebook](notebooks/01_identify_heads.ipynb)" in text
    assert "(DETAILS.md#notebook-01)" in text and '<a id="notebook-01"></a>' in text
    page = R.report_html(d)
    assert '<li id="notebook-01">' in page and 'href="notebooks/01_identify_heads.ipynb"' in page


def test_every_findings_figure_has_a_caption():
    for f in R.FINDINGS:
        assert f.figures[0] in R.captions.CAPTIONS and f.id in R.captions.HEADLINES, f.id


def test_findings_name_figures_the_committed_run_has():
    """Each finding names figures of its notebook: in the committed run where that notebook
    ran there, else (a notebook not yet run on the committed model) figures its source saves."""
    fig = ROOT / "figures" / "qwen2.5-coder-0.5b"
    for f in R.FINDINGS:
        assert f.figures, f"{f.id} names no figure"
        ran = any(fig.glob(f"{f.notebook}_*_params.json"))
        source = "".join(p.read_text() for p in (ROOT / "notebooks").glob(f"{f.notebook}_*.py"))
        for name in f.figures:
            assert name.startswith(f.notebook + "_"), (f.id, name)
            assert (fig / f"{name}.png").is_file() if ran else f'"{name}")' in source, (f.id, name)


def _first_cell(notebook: Path) -> str:
    cell = json.loads(notebook.read_text())["cells"][0]
    assert cell["cell_type"] == "markdown", notebook.name
    return "".join(cell["source"])


def test_notebooks_open_with_links_to_their_executed_copy_and_report_section():
    notebooks = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    assert len(notebooks) == len(R.NOTEBOOKS)
    for nb in notebooks:
        line = R.notebook_links(nb.stem)
        assert line in _first_cell(nb).split("\n")[:4], f"{nb.name} does not open with: {line}"
        targets = re.findall(r"\]\(([^)]+)\)", line)
        assert targets[0] == f"../figures/qwen2.5-coder-0.5b/notebooks/{nb.stem}.ipynb"  # written by the next run
        report, anchor = targets[1].split("#")
        assert (nb.parent / report).is_file() and f'<a id="{anchor}"></a>' in (nb.parent / report).read_text()


def test_report_states_the_environment(tmp_path):
    """REPORT.md names the software of its tables, or says it was not recorded."""
    import json

    from arithlib import report
    from arithlib.run.environment import environment

    env = environment()
    (tmp_path / "00_model_accuracy_params.json").write_text(json.dumps({"model": "m", "environment": env}))
    lines = report.environment_lines(report.Tables(tmp_path).params())
    assert len(lines) == 2 and f"transformers {env['packages']['transformers']}" in lines[0]
    assert lines[1].startswith("**Code:** commit ") and "(notebooks 00)" in lines[1]
    (tmp_path / "01_identify_heads_params.json").write_text(json.dumps({"model": "m"}))
    lines = report.environment_lines(report.Tables(tmp_path).params())
    assert any("notebooks 01: not recorded" in line for line in lines)
    tables = report.Tables(tmp_path)
    assert "Environment" in report.details_markdown(tables, report.findings_table(tmp_path))
    assert "**Code:**" in report.report_markdown(tmp_path)


def test_per_prompt_correctness_round_trips_through_a_csv_cell(tmp_path: Path):
    from arithlib.core.stats import decode_correct, encode_correct

    bits = np.array([False, True, True, False, False])
    _csv(tmp_path, "t", [{"correct_by_prompt": encode_correct(bits)}, {"correct_by_prompt": ""}])
    back = R.Tables(tmp_path).csv("t")["correct_by_prompt"]
    assert (decode_correct(back.iloc[0]) == bits).all() and decode_correct(back.iloc[1]) is None
    assert decode_correct("0110") is None  # not a cell encode_correct wrote


def _sft_table(
    d: Path,
    orig: float,
    precise: float,
    full: float,
    facts: tuple[float, float, float] = (0.8, 0.8, 0.7),
    n: int = 400,
    n_facts: int = 55,
    per_prompt: bool = True,
    with_full: bool = True,
) -> None:
    """Notebook 08's 08_sft_comparison: original, precise SFT (scaled top-32) and full SFT
    rows, nested correct sets over n test prompts and n_facts facts."""
    rows = []
    for role, acc, fr in (("original", orig, facts[0]), ("precise", precise, facts[1]), ("full", full, facts[2])):
        if role == "full" and not with_full:
            continue
        rows.append(
            {
                "method": role,
                "role": role,
                "arithmetic_2d": round(acc * n) / n,
                "factual_recall": round(fr * n_facts) / n_facts,
                "lm_loss": 3.5,
                **(
                    {
                        "arithmetic_2d_by_prompt": _bits(round(acc * n), n),
                        "facts_by_prompt": _bits(round(fr * n_facts), n_facts),
                    }
                    if per_prompt
                    else {}
                ),
            }
        )
    _csv(d, "08_sft_comparison", rows)


@pytest.mark.parametrize(
    "orig, precise, full, facts, verdict",
    [
        (0.5, 0.8, 0.8, (0.8, 0.8, 0.7), R.REPRODUCED),  # same gain, general ability kept
        (0.5, 0.8, 0.7, (0.8, 0.8, 0.8), R.REPRODUCED),  # precise gains more
        (0.5, 0.6, 0.9, (0.8, 0.8, 0.7), R.PARTLY),  # gains, far less than full SFT, general kept
        (0.5, 0.5, 0.8, (0.8, 0.8, 0.7), R.NOT_REPRODUCED),  # no gain
        (0.5, 0.75, 0.8, (0.8, 0.8, 0.8), R.INCONCLUSIVE),
    ],
)  # 5 points short: straddles the 5-point margin
def test_precise_sft_rule(tmp_path: Path, orig, precise, full, facts, verdict):
    _sft_table(tmp_path, orig, precise, full, facts)
    out = _outcome("zhang_precise_sft", tmp_path)
    assert out.verdict == verdict and out.interval.n == 400
    assert out.interval.estimate == pytest.approx(out.metrics["precise minus full arithmetic accuracy"])


def test_precise_sft_rule_resamples_training_seeds(tmp_path: Path):
    """With the judged pair trained on several seeds, the estimate averages the seeds and the
    interval resamples them (crossed with the prompts), so seed-to-seed spread widens it; with
    one seed the text says the interval excludes training variance."""
    _sft_table(tmp_path / "one", 0.5, 0.8, 0.8)
    one = _outcome("zhang_precise_sft", tmp_path / "one")
    assert "excludes training variance" in one.ours and one.metrics["training seeds per arm"] == 1
    n, n_facts = 400, 55
    rows = [
        {
            "method": "original",
            "role": "original",
            "train_seed": 0,
            "arithmetic_2d": 0.5,
            "factual_recall": 0.8,
            "lm_loss": 3.5,
            "arithmetic_2d_by_prompt": _bits(200, n),
            "facts_by_prompt": _bits(44, n_facts),
        }
    ]
    for seed, precise in ((0, 0.8), (1, 0.6), (2, 0.95)):
        for role, acc in (("precise", precise), ("full", 0.8)):
            rows.append(
                {
                    "method": f"{role} {seed}",
                    "role": role,
                    "train_seed": seed,
                    "arithmetic_2d": acc,
                    "factual_recall": 0.8,
                    "lm_loss": 3.5,
                    "arithmetic_2d_by_prompt": _bits(round(acc * n), n),
                    "facts_by_prompt": _bits(44, n_facts),
                }
            )
    _csv(tmp_path / "three", "08_sft_comparison", rows)
    three = _outcome("zhang_precise_sft", tmp_path / "three")
    assert three.metrics["training seeds per arm"] == 3 and "3 training seeds per arm" in three.ours
    assert three.interval.estimate == pytest.approx((0.0 - 0.2 + 0.15) / 3)
    assert three.interval.high - three.interval.low > one.interval.high - one.interval.low + 0.1


def test_precise_sft_rule_needs_per_prompt_columns_and_full_sft(tmp_path: Path):
    _sft_table(tmp_path / "old", 0.5, 0.8, 0.8, per_prompt=False)
    out = _outcome("zhang_precise_sft", tmp_path / "old")
    assert out.verdict == R.NOT_RUN and "rerun notebook 08" in out.ours
    _sft_table(tmp_path / "nofull", 0.5, 0.8, 0.8, with_full=False)
    out = _outcome("zhang_precise_sft", tmp_path / "nofull")
    assert out.verdict == R.NOT_RUN and "no full SFT" in out.ours
    assert "precise SFT's own arithmetic gain: 30.0 %" in out.ours  # what did run is still shown


def test_precise_sft_is_notebook_08s_and_judged_only_beyond_its_quick_scale(tmp_path: Path):
    """Precise SFT left notebook 05 for its own notebook 08 (so that it reruns without
    05's LoRA models): the rule reads 08_sft_comparison, and 08's own fine-tuning scale,
    not 05's, decides whether it was a smoke test."""
    finding = next(f for f in R.FINDINGS if f.id == "zhang_precise_sft")
    assert finding.notebook == "08" and finding.figures == ("08_sft_comparison",) and "08" in R.NOTEBOOKS
    _sft_table(tmp_path, 0.5, 0.8, 0.8)
    (tmp_path / "05_x_params.json").write_text(json.dumps({"scale": "quick", "quick": False}))
    assert _outcome("zhang_precise_sft", tmp_path).verdict == R.REPRODUCED
    (tmp_path / "08_x_params.json").write_text(json.dumps({"scale": "auto", "quick": False, "scale_resolved": "quick"}))
    out = _outcome("zhang_precise_sft", tmp_path)
    assert out.verdict == R.NOT_JUDGED and "notebook 08's smoke-test sizes" in out.ours


def test_precise_sft_rule_does_not_judge_against_a_full_sft_that_did_not_train(tmp_path: Path):
    """On Qwen-0.5B, full SFT at the cpu scale's learning rate fell from 45 % to 0 %
    arithmetic; precise SFT beating it says nothing about Zhang's claim."""
    _sft_table(tmp_path, 0.45, 0.68, 0.0)
    out = _outcome("zhang_precise_sft", tmp_path)
    assert out.verdict == R.NOT_RUN and "full SFT did not train" in out.ours


def test_inconclusive_is_told_apart_from_undecidable_and_carries_the_prompts_that_would_decide():
    from arithlib.core.stats import Interval
    from arithlib.report.rules import settle_inconclusive

    ci = Interval(0.30, 0.20, 0.40, 100, "bootstrap")
    more = settle_inconclusive(R.Outcome("x", R.INCONCLUSIVE, {"m": 0.3}, ci, thresholds=(0.25,)))
    assert more.verdict == R.INCONCLUSIVE and "about 400 prompts (now 100) would decide" in more.ours
    spent = settle_inconclusive(R.Outcome("x", R.INCONCLUSIVE, {"m": 0.3}, ci, thresholds=(0.25,), population=100))
    assert spent.verdict == R.UNDECIDABLE and "100 of the 100 possible cases" in spent.ours
    enough = settle_inconclusive(R.Outcome("x", R.INCONCLUSIVE, {"m": 0.3}, ci, thresholds=(0.25,), population=1000))
    assert enough.verdict == R.INCONCLUSIVE
    unknown = settle_inconclusive(R.Outcome("x", R.INCONCLUSIVE, {"m": 0.3}, ci))
    assert unknown.verdict == R.INCONCLUSIVE and unknown.ours.endswith("more prompts would decide")
    done = R.Outcome("x", R.REPRODUCED, {"m": 0.3}, ci, thresholds=(0.25,), population=10)
    assert settle_inconclusive(done) is done


def test_zhang_rules_carry_their_thresholds_and_population(tmp_path: Path):
    """Every Zhang rule gives its thresholds in the headline interval's units, so an
    inconclusive verdict says how many prompts would decide it; the rules on Zhang's prompts
    (operands 1-9, 8 templates per operator) carry that finite population."""
    _params(tmp_path, n_layers=2, n_heads=8)
    _path_patching(tmp_path, [-0.3, -0.2] + [0.0] * 14, [0.0, 0.0])
    _knockout(tmp_path, 0.60, 0.98)  # gap 0.38, interval holds 0.34
    out = _outcome("zhang_knockout", tmp_path)
    assert out.verdict == R.INCONCLUSIVE and re.search(r"about [\d,]+ prompts \(now 200\) would decide", out.ours)
    finding = {f.id: f for f in R.FINDINGS}
    t = R.Tables(tmp_path)
    assert finding["zhang_knockout"].compute(t).thresholds == pytest.approx((0.05, 0.34))
    assert finding["zhang_key_heads"].compute(t).thresholds == pytest.approx((0.05, 0.10))
    pop = (81 + 45 + 81 + 23) * 8  # operand pairs 1-9 with non-negative integer results, 8 templates each
    assert finding["zhang_key_heads"].compute(t).population == pop
    _transfer(tmp_path, 0.62, 0.96)
    assert finding["zhang_transfer"].compute(t).thresholds == pytest.approx((0.05, 0.33))
    late = tmp_path / "late"
    _params(late, n_layers=32, n_heads=1)
    _path_patching(late, [0.0] * 32, [0.01] * 17 + [-0.1] * 15, n_heads=1)
    got = finding["zhang_late_mlps"].compute(R.Tables(late))
    assert got.thresholds == (1.0, 2.0) and got.population == pop
    curve = tmp_path / "curve"
    _params(curve, "02", n_layers=32, n_heads=1)
    _cosines(curve, [-0.5] + [0.0] * 15 + [0.5 + 0.02 * i for i in range(16)])
    got = finding["zhang_mlp_answer"].compute(R.Tables(curve))
    assert got.thresholds == pytest.approx((13 / 32, 17 / 32)) and got.population == pop
    sft = tmp_path / "sft"
    _sft_table(sft, 0.3, 0.5, 0.52)
    assert finding["zhang_precise_sft"].compute(R.Tables(sft)).thresholds == pytest.approx((-0.05,))


def test_a_failed_premise_is_not_applicable_not_not_reproduced(tmp_path):
    from arithlib.report.findings import judge

    def premise_fails(t):
        raise R.NotApplicable("premise failed: the top head also cuts x by 77 %")

    f = R.Finding("x", "yu", "Sec. 4", "claim", "1", "src", "rule", "04", premise_fails)
    out = judge(f, R.Tables(tmp_path))
    assert out.verdict == R.NOT_APPLICABLE and "77 %" in out.ours
    assert R.NOT_APPLICABLE in R.VERDICTS and R.UNDECIDABLE in R.VERDICTS


# --------------------------------------------------------------------------- Yu: premises and the head's pattern


def _head_rows(
    d: Path, layer: int, head: int, drops: dict, n: int = 40, facts: tuple[int, int] | None = (40, 40)
) -> None:
    """01_yu_head_sweep(_rows) where head (layer, head) is every operator's top head and cuts
    each operator's 1D accuracy by ``drops[op]`` (a fraction of ``n`` prompts, all answered
    before); 01_yu_specificity with ``facts`` = (correct before, after) of 40 facts."""
    _csv(
        d,
        "01_yu_head_sweep",
        [
            {
                "op": op,
                "n_digits": 1,
                "layer": layer,
                "head": head,
                "rank": 1,
                "n": n,
                "accuracy": 1 - v,
                "baseline_accuracy": 1.0,
                "accuracy_drop": v,
                "relative_drop": v,
            }
            for op, v in drops.items()
        ],
    )
    _csv(
        d,
        "01_yu_head_sweep_rows",
        [
            {
                "op": op,
                "n_digits": 1,
                "layer": layer,
                "head": head,
                "prompt": i,
                "correct": i >= round(v * n),
                "clean_correct": True,
            }
            for op, v in drops.items()
            for i in range(n)
        ],
    )
    if facts is not None:
        before, after = facts
        _csv(
            d,
            "01_yu_specificity",
            [
                {
                    "op": "+",
                    "layer": layer,
                    "head": head,
                    "prompt": f"fact {i}",
                    "correct": i < after,
                    "clean_correct": i < before,
                }
                for i in range(40)
            ],
        )


def test_a_head_that_also_breaks_multiplication_is_only_partly_yus_head(tmp_path: Path):
    _head_rows(tmp_path, 0, 8, {"+": 0.6, "-": 0.7, "/": 0.6, "*": 0.75})
    generic = _outcome("yu_single_head", tmp_path)
    assert generic.verdict == R.PARTLY and "1D * by 75 %" in generic.ours
    _head_rows(tmp_path, 0, 8, {"+": 0.6, "-": 0.7, "/": 0.6, "*": 0.05})
    specific = _outcome("yu_single_head", tmp_path)
    assert specific.verdict == R.REPRODUCED, specific.ours


def test_a_head_that_breaks_factual_recall_is_not_specific(tmp_path: Path):
    _head_rows(tmp_path, 0, 8, {"+": 0.6, "-": 0.7, "/": 0.6, "*": 0.05}, facts=(40, 20))
    out = _outcome("yu_single_head", tmp_path)
    assert out.verdict == R.PARTLY and "factual recall 100 % -> 50 %" in out.ours


@pytest.mark.parametrize(
    "times, lowers, verdict, words",
    [
        (0.75, True, R.NOT_APPLICABLE, "not an arithmetic-specific head"),
        (0.05, True, R.REPRODUCED, "premise: L0H8"),
        (0.05, False, R.NOT_APPLICABLE, "no head lowers 1D + / - accuracy"),
    ],
)
def test_mask_keep_first_checks_that_its_key_head_is_an_arithmetic_head(tmp_path: Path, times, lowers, verdict, words):
    _head_rows(tmp_path, 0, 8, {"+": 0.6, "-": 0.7, "*": times})
    _csv(
        tmp_path, "04_key_heads", [{"group": "+-", "layer": 0, "head": 8, "lowers_1d": lowers, "op": op} for op in "+-"]
    )
    _mask_keep(tmp_path, 100, 3.9, 2, 1000)
    out = _outcome("yu_mask_keep", tmp_path)
    assert out.verdict == verdict and words in out.ours, out.ours


def _specific_chain(d: Path, layer: int = 16, head: int = 8, times: float = 0.0, facts_after: int = 40) -> None:
    """Notebook 04's head patterns: (layer, head) is + / -'s best specific head, measured on
    1D + (10 %), - (30 %) and * (``times``) and on 40 facts; its chain's mask / keep rows are
    those of :func:`_mask_keep` under group "+- specific"."""
    _csv(
        d,
        "04_head_pattern_rows",
        [
            {
                "op": op,
                "n_digits": 1,
                "layer": layer,
                "head": head,
                "prompt": i,
                "correct": i >= round(v * 40),
                "clean_correct": True,
            }
            for op, v in {"+": 0.1, "-": 0.3, "*": times}.items()
            for i in range(40)
        ],
    )
    _csv(
        d,
        "04_head_pattern_facts",
        [
            {
                "op": f"L{layer}H{head}",
                "layer": layer,
                "head": head,
                "prompt": f"fact {i}",
                "correct": i < facts_after,
                "clean_correct": True,
            }
            for i in range(40)
        ],
    )
    _csv(
        d,
        "04_specific_heads",
        [
            {
                "group": "+-",
                "layer": layer,
                "head": head,
                "is_key_head": False,
                "selection": "largest own 1D drop among the heads that pass the specificity tests",
            },
            {"group": "/", "layer": -1, "head": -1, "is_key_head": False, "selection": "none"},
        ],
    )
    rows = pd.read_csv(d / "04_mask_keep.csv")
    pm = rows[rows.group == "+-"].assign(group="+- specific")
    pd.concat([rows, pm]).to_csv(d / "04_mask_keep.csv", index=False)


def test_mask_keep_shows_the_chain_on_the_best_specific_head_beside_the_key_heads(tmp_path: Path):
    """A generic key head (L0H8 also cuts 1D * by 75 %): its verdict stays 'not applicable',
    and the same rule on the chain of the best specific head (L16H8) is shown beside it."""
    _head_rows(tmp_path, 0, 8, {"+": 0.6, "-": 0.7, "*": 0.75})
    _csv(tmp_path, "04_key_heads", [{"group": "+-", "layer": 0, "head": 8, "lowers_1d": True, "op": op} for op in "+-"])
    _mask_keep(tmp_path, 100, 3.9, 2, 1000)
    assert "best arithmetic-specific head" not in _outcome("yu_mask_keep", tmp_path).ours  # no patterns: nothing added
    _specific_chain(tmp_path)
    out = _outcome("yu_mask_keep", tmp_path)
    assert out.verdict == R.NOT_APPLICABLE and "not an arithmetic-specific head" in out.ours, out.ours
    assert "The chain on the best arithmetic-specific head L16H8" in out.ours
    # the chain's head was chosen for passing the specificity tests: its pattern is not repeated
    assert "premise: L16H8" not in out.ours and out.ours.count("L16H8") == 1, out.ours
    assert f"the same rule gives '{R.REPRODUCED}' there" in out.ours
    _specific_chain(tmp_path, facts_after=10)  # the chosen head fails its own premise: said, not judged
    out = _outcome("yu_mask_keep", tmp_path)
    assert out.verdict == R.NOT_APPLICABLE and "On the best arithmetic-specific head L16H8: not applicable" in out.ours


def test_mask_keep_says_when_no_head_is_arithmetic_specific(tmp_path: Path):
    _head_rows(tmp_path, 0, 8, {"+": 0.6, "-": 0.7, "*": 0.75})
    _csv(tmp_path, "04_key_heads", [{"group": "+-", "layer": 0, "head": 8, "lowers_1d": True, "op": op} for op in "+-"])
    _mask_keep(tmp_path, 100, 3.9, 2, 1000)
    _csv(
        tmp_path,
        "04_specific_heads",
        [{"group": "+-", "layer": -1, "head": -1, "is_key_head": False, "selection": "no head"}],
    )
    out = _outcome("yu_mask_keep", tmp_path)
    assert out.verdict == R.NOT_APPLICABLE and "no arithmetic-specific head to run the chain on" in out.ours


def test_fine_tuning_findings_are_not_applicable_when_the_original_cannot_carry_them(tmp_path: Path):
    _lora_layers(tmp_path, 0.01, [0.03, 0.02, 0.04], {"shallow": ("0", 0.03), "deep": ("2", 0.04)}, n=385)
    _params(tmp_path, n_layers=3)
    out = _outcome("yu_lora_layers", tmp_path)
    assert out.verdict == R.NOT_APPLICABLE and "premise failed: the original model answers 1.0 %" in out.ours
    _lora_layers(tmp_path, 0.10, [0.3, 0.3, 0.3], {"shallow": ("0", 0.3), "deep": ("2", 0.3)}, n=385)
    assert _outcome("yu_lora_layers", tmp_path).verdict != R.NOT_APPLICABLE
