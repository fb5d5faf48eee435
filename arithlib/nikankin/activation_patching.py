"""Nikankin et al. 2025's arithmetic circuit (Sec. 3): activation patching of every head and
MLP at every position with an operand-changing counterfactual (the indirect effect on the
answer), the circuit's faithfulness under mean ablation of everything outside it, and the
screens that rank head-position pairs (their recall against the exact method is measured:
:func:`screen_recall`, :func:`topk_recall`, :func:`split_half_agreement`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import numpy as np
import pandas as pd
import torch
from tqdm.auto import tqdm

from ..core.prompt_sets import PromptSet, split_answer
from ..engine import RunCache, grouped_clean_run, input_device, prefix_groups
from ..methods.patching import (
    Component,
    Edit,
    Unembed,
    head_components,
    heads_and_mlps,
    mlp_components,
    run_interventions,
    run_variants,
)


def counterfactual_answer_ids(prompts: PromptSet) -> torch.Tensor:
    """First token of each record's counterfactual answer (``meta['cf_answer_text']``, as
    :func:`arithlib.core.datasets.nikankin_prompts` writes it), tokenized like the answers
    (:func:`arithlib.core.prompt_sets.split_answer`, which refuses a prompt that does not end at a
    token boundary)."""
    out = []
    for r in prompts.records:
        cf_text = r.get("cf_answer_text")
        if cf_text is None or r.counterfactual is None:
            raise ValueError(f"prompt {r.text!r} has no counterfactual answer (meta cf_answer_text)")
        out.append(split_answer(prompts.tokenizer, r.counterfactual, str(cf_text)).answer[0])
    return torch.tensor(out, dtype=torch.long)


@torch.no_grad()
def activation_patching(
    model,
    prompts: PromptSet,
    components: Sequence[Component],
    positions: Mapping[str, Sequence[int]] | None = None,
    batch_size: int = 16,
    max_rows: int = 1024,
    progress: bool = True,
    cache: RunCache | None = None,
) -> pd.DataFrame:
    """Activation patching (Nikankin et al. 2025 Sec. 2; Stolfo et al. 2023): each
    component's output at each named position is set to its value on the prompt's
    counterfactual; the indirect effect (:func:`arithlib.core.metrics.indirect_effect`) and
    the answer-logit change are recorded. ``positions`` maps a name to each prompt's
    absolute position (default: ``{"last": T-1}``; see :func:`locate_operands`).
    Fast path: prompts are grouped by length and positions, each position's patches
    recompute only the positions from it on. Returns one row per prompt, position and
    component: ``prompt``, ``op``, ``position``, ``component``, ``kind``, ``layer``,
    ``head``, ``ie``, ``logit_diff_change``, ``answer_logit_change``."""
    from ..core.metrics import indirect_effect

    if not prompts.has_counterfactuals:
        raise ValueError("activation patching needs a counterfactual for every prompt")
    device = input_device(model)
    unembed = Unembed(model)
    if positions is None:
        positions = {"last": [len(ids) - 1 for ids in prompts.input_ids]}
    names = list(positions)
    cf_ids_all = counterfactual_answer_ids(prompts)
    hook_names = sorted({c.hook_name for c in components})
    keys: dict[tuple, list[int]] = {}
    for i, ids in enumerate(prompts.input_ids):
        keys.setdefault((len(ids),) + tuple(positions[n][i] for n in names), []).append(i)
    rows = []
    groups = [(k, idx[s : s + batch_size]) for k, idx in keys.items() for s in range(0, len(idx), batch_size)]
    for key, idx in tqdm(groups, desc="activation patching", disable=not progress, leave=False):
        sub = prompts.subset(idx)
        batch = next(sub.batches(len(idx), device))
        by_prefix = prefix_groups(sub, batch.index)
        run = (
            cache.get(model, batch.tokens, by_prefix)
            if cache is not None
            else grouped_clean_run(model, batch.tokens, by_prefix)
        )
        src = grouped_clean_run(model, batch.cf_tokens, by_prefix, hook_names).captured
        ans = batch.answer_ids.to(unembed.device)
        cf_ans = cf_ids_all[idx].to(unembed.device)
        clean_logits = unembed.logits(run.final)
        variants, labels = [], []
        for n, pos in zip(names, key[1:]):
            for c in components:
                act = src[c.hook_name][:, pos]
                if c.index is not None:
                    act = act[:, c.index]
                variants.append([Edit(c, pos, act)])
                labels.append((n, c))
        h = run_variants(model, run, variants, max_rows=max_rows)  # [V, B, d]
        step = max(1, 256 // len(idx))
        ie_parts, a_parts, c_parts = [], [], []
        for s in range(0, len(variants), step):
            logits = unembed.logits(h[s : s + step])  # [v, B, vocab]
            ie_parts.append(indirect_effect(clean_logits, logits, ans, cf_ans))
            a_parts.append(logits.gather(-1, ans.expand(logits.shape[0], -1)[..., None]).squeeze(-1))
            c_parts.append(logits.gather(-1, cf_ans.expand(logits.shape[0], -1)[..., None]).squeeze(-1))
        ie, a_p, c_p = torch.cat(ie_parts), torch.cat(a_parts), torch.cat(c_parts)
        a_c = clean_logits.gather(1, ans[:, None]).squeeze(1)
        c_c = clean_logits.gather(1, cf_ans[:, None]).squeeze(1)
        ld_change = (a_p - c_p) - (a_c - c_c)
        for j, (n, c) in enumerate(labels):
            for row, i in enumerate(idx):
                rows.append(
                    (
                        i,
                        prompts.records[i].op,
                        n,
                        c.label,
                        c.kind,
                        c.layer,
                        c.index if c.index is not None else -1,
                        float(ie[j, row]),
                        float(ld_change[j, row]),
                        float(a_p[j, row] - a_c[row]),
                    )
                )
    return pd.DataFrame(
        rows,
        columns=[
            "prompt",
            "op",
            "position",
            "component",
            "kind",
            "layer",
            "head",
            "ie",
            "logit_diff_change",
            "answer_logit_change",
        ],
    )


@torch.no_grad()
def circuit_faithfulness(
    model,
    prompts: PromptSet,
    circuits: Mapping[str, Iterable[tuple[Component, str]]],
    positions: Mapping[str, Sequence[int]],
    means: Mapping[str, Mapping[int, torch.Tensor]],
    components: Sequence[Component] | None = None,
    batch_size: int = 16,
    max_rows: int = 1024,
    progress: bool = True,
    cache: RunCache | None = None,
) -> pd.DataFrame:
    """Nikankin et al. 2025 faithfulness: for each named circuit (a set of
    ``(component, position name)`` pairs), mean-ablate every component of
    ``components`` (default: all heads and MLPs) at every named position that is not
    in the circuit, and record the normalized logit. Positions outside ``positions``
    (e.g. a few-shot prefix) stay clean. ``means`` is ``{hook: {length: [T, ...]}}``
    (:func:`arithlib.methods.ablation.mean_activations`). Also scores the full model
    (``"full"``) and the fully ablated one (``"ablated"``). Returns one row per circuit:
    ``circuit``, ``size``, ``normalized_logit``, ``accuracy``, ``faithfulness``."""
    from ..core.metrics import faithfulness

    components = list(components) if components is not None else heads_and_mlps(model)
    names = list(positions)
    keep_sets = {"full": None, "ablated": set()}
    keep_sets.update({k: set(v) for k, v in circuits.items()})

    def variants_for(batch, run):
        T = batch.tokens.shape[1]
        i0 = int(batch.index[0])
        pos = {n: positions[n][i0] for n in names}
        for n in names:
            if any(positions[n][int(i)] != pos[n] for i in batch.index):
                raise ValueError(
                    "prompts of one length must share the named positions; group them with locate_operands first"
                )
        out = []
        for keep in keep_sets.values():
            if keep is None:
                out.append([])
                continue
            edits = []
            for c in components:
                for n in names:
                    if (c, n) in keep:
                        continue
                    mean = means[c.hook_name][T][pos[n]]
                    if c.index is not None:
                        mean = mean[c.index]
                    edits.append(Edit(c, pos[n], mean))
            out.append(edits)
        return out

    ro = run_interventions(
        model, prompts, variants_for, batch_size, max_rows, progress=progress, desc="faithfulness", cache=cache
    )
    nl = ro.normalized_logit.mean(-1)
    full, abl = float(nl[0]), float(nl[1])
    rows = []
    for j, (name, keep) in enumerate(keep_sets.items()):
        rows.append(
            {
                "circuit": name,
                "size": -1 if keep is None else len(keep),
                "normalized_logit": float(nl[j]),
                "accuracy": float(ro.accuracy[j]),
                "faithfulness": faithfulness(float(nl[j]), full, abl),
            }
        )
    return pd.DataFrame(rows)


@torch.no_grad()
def full_circuit_faithfulness(
    model,
    prompts: PromptSet,
    circuits: Mapping[str, tuple[Iterable[tuple[Component, str]], Iterable[tuple[int, int]]]],
    positions: Mapping[str, Sequence[int]],
    means: Mapping[str, Mapping[int, torch.Tensor]],
    neuron_layers: Sequence[int],
    last: str = "=",
    batch_size: int = 16,
    max_rows: int = 1024,
    progress: bool = True,
    cache: RunCache | None = None,
) -> pd.DataFrame:
    """Nikankin et al. 2025 faithfulness of a whole circuit (heads and MLP neurons), per
    prompt. A circuit is ``(heads, neurons)``: ``(head component, position name)`` pairs
    and ``(layer, neuron)`` pairs of the ``neuron_layers`` MLPs at the ``last`` position.
    Every component outside it is mean-ablated at every named position: every head not in
    ``heads``; at ``last`` every neuron of a ``neuron_layers`` MLP not in ``neurons`` (the
    MLP's neurons, hook ``mlp.hook_post``); the other MLPs (earlier layers, and every MLP at
    the operand and operator positions) stay whole, as in Nikankin's circuit, whose MLPs at
    those positions are kept. ``"ablated"`` mean-ablates every head and MLP at every named
    position, ``"full"`` nothing; both are added. Positions outside ``positions`` (the
    few-shot prefix) stay clean. ``means`` (:func:`arithlib.methods.ablation.mean_activations`)
    needs every head hook ``attn.hook_z``, ``hook_mlp_out`` and the ``neuron_layers``'
    ``mlp.hook_post``. Returns one row per circuit and prompt: ``circuit``, ``prompt``,
    ``op``, ``normalized_logit`` (answer logit / max logit, Nikankin's y), ``correct``;
    :func:`faithfulness_from_prompts` turns it into F = (y_circuit - y_ablated) /
    (y_full - y_ablated) (means over prompts first, Eq. 2 as in
    :func:`arithlib.core.metrics.faithfulness`)."""
    if last not in positions:
        raise ValueError(f"positions need the neuron position {last!r} (got {sorted(positions)})")
    cfg = model.cfg
    names = list(positions)
    nl = sorted(set(int(x) for x in neuron_layers))
    heads = head_components(cfg.n_layers, cfg.n_heads)
    specs: dict[str, tuple[set, dict[int, set[int]]] | None] = {"full": None, "ablated": None}
    for name, (hs, ns) in circuits.items():
        if name in specs:
            raise ValueError(f"circuit name {name!r} is reserved")
        keep_n: dict[int, set[int]] = {l: set() for l in nl}
        for l, k in ns:
            if int(l) not in keep_n:
                raise ValueError(f"neuron ({l}, {k}) is not in a neuron layer {nl}")
            keep_n[int(l)].add(int(k))
        specs[name] = (set(hs), keep_n)

    built: dict[tuple, list] = {}  # the edits depend only on the length and the positions

    def build(T: int, pos: dict[str, int]) -> list:
        def mean(c: Component, n: str) -> torch.Tensor:
            m = means[c.hook_name][T][pos[n]]
            return m[c.index] if c.index is not None else m

        out = []
        for name, spec in specs.items():
            if name == "full":
                out.append([])
                continue
            if spec is None:  # ablated: every head and MLP at every named position
                out.append([Edit(c, pos[n], mean(c, n)) for n in names for c in heads + mlp_components(cfg.n_layers)])
                continue
            keep_h, keep_n = spec
            edits = [Edit(c, pos[n], mean(c, n)) for n in names for c in heads if (c, n) not in keep_h]
            for l in nl:
                m = means[Component("neuron", l).hook_name][T][pos[last]].unbind(0)  # views, one op per layer
                edits += [Edit(Component("neuron", l, k), pos[last], m[k]) for k in range(len(m)) if k not in keep_n[l]]
            out.append(edits)
        return out

    # prompts of one token length can place the operands differently (per-digit tokens: "12+3=" and
    # "1+23="); the edits are built per (length, positions), so each such group runs on its own
    groups: dict[tuple, list[int]] = {}
    for i in range(len(prompts)):
        groups.setdefault((len(prompts.input_ids[i]), *(positions[n][i] for n in names)), []).append(i)
    y = np.zeros((len(specs), len(prompts)))
    ok = np.zeros((len(specs), len(prompts)), dtype=bool)
    for (_, *where), idx in groups.items():
        pos = dict(zip(names, where))

        def variants_for(batch, run, pos=pos):
            key = (batch.tokens.shape[1], *pos.values())
            if key not in built:
                built[key] = build(batch.tokens.shape[1], pos)
            return built[key]

        sub = prompts if len(groups) == 1 else prompts.subset(idx)
        ro = run_interventions(
            model, sub, variants_for, batch_size, max_rows, progress=progress, desc="circuit faithfulness", cache=cache
        )
        y[:, idx] = np.asarray(ro.normalized_logit, dtype=float)
        ok[:, idx] = np.asarray(ro.correct, dtype=bool)
    ops = [r.op for r in prompts.records]
    rows = [
        {"circuit": name, "prompt": i, "op": ops[i], "normalized_logit": float(y[j, i]), "correct": bool(ok[j, i])}
        for j, name in enumerate(specs)
        for i in range(len(prompts))
    ]
    return pd.DataFrame(rows)


def faithfulness_from_prompts(frame: pd.DataFrame, circuit: str) -> float:
    """Nikankin's F of ``circuit`` from :func:`full_circuit_faithfulness`'s rows:
    (mean y_circuit - mean y_ablated) / (mean y_full - mean y_ablated) over the prompts
    (:func:`arithlib.core.metrics.faithfulness`)."""
    from ..core.metrics import faithfulness

    y = {c: frame.loc[frame.circuit == c, "normalized_logit"].to_numpy() for c in (circuit, "full", "ablated")}
    return faithfulness(torch.tensor(y[circuit]), torch.tensor(y["full"]), torch.tensor(y["ablated"]))


def faithfulness_by_operator(y_circuit: np.ndarray, y_full: np.ndarray, y_ablated: np.ndarray, op: np.ndarray) -> float:
    """Mean over operators (integer codes ``op``, one per prompt) of Nikankin's F =
    (mean y_circuit - mean y_ablated) / (mean y_full - mean y_ablated), the means over that
    operator's prompts (Eq. 2, as :func:`arithlib.core.metrics.faithfulness`); an operator whose
    full and ablated means coincide has no F and is left out (NaN if none has one). Written
    for :func:`arithlib.core.stats.bootstrap_ci` (resampled prompts, stratified by ``op``)."""
    op = np.asarray(op, dtype=int)
    n = np.bincount(op)
    keep = n > 0
    m = [np.bincount(op, weights=np.asarray(y, dtype=float))[keep] / n[keep] for y in (y_circuit, y_full, y_ablated)]
    den = m[1] - m[2]
    ok = np.abs(den) > 1e-12
    return float(np.mean((m[0][ok] - m[2][ok]) / den[ok])) if ok.any() else float("nan")


def topk_recall(screen: Sequence[float] | np.ndarray, exact: Sequence[float] | np.ndarray, k: int) -> float:
    """Recall of a screen: the share of the ``k`` items of largest ``exact`` score that are
    also among the ``k`` items of largest ``screen`` score (same items, same order in both
    arrays). Ties are broken by position (stable sort), so the result is deterministic."""
    s, e = np.asarray(screen, dtype=float), np.asarray(exact, dtype=float)
    if s.shape != e.shape:
        raise ValueError(f"screen and exact scores differ in shape: {s.shape} vs {e.shape}")
    k = min(int(k), len(s))
    if k <= 0:
        return float("nan")
    top = lambda x: set(np.argsort(-x, kind="stable")[:k].tolist())  # noqa: E731
    return len(top(s) & top(e)) / k


def coarse_to_fine_patching(
    model,
    prompts: PromptSet,
    positions: Mapping[str, Sequence[int]],
    refine: int,
    batch_size: int = 16,
    max_rows: int = 1024,
    cache: RunCache | None = None,
) -> pd.DataFrame:
    """Nikankin et al. 2025 Sec. 2's activation patching within a CPU budget, coarse to
    fine: every MLP and every whole attention layer at each named position, every single
    head at the last position ``"="``, then the heads of the ``refine`` attention layers of
    largest median indirect effect at the other positions. Returns the
    :func:`activation_patching` rows of all three passes."""
    if "=" not in positions:
        raise ValueError(f"positions need the last position '=' (got {sorted(positions)})")
    n_layers, n_heads = model.cfg.n_layers, model.cfg.n_heads
    blocks = [Component("attn", l) for l in range(n_layers)] + [Component("mlp", l) for l in range(n_layers)]
    heads = head_components(n_layers, n_heads)
    ie_blocks = activation_patching(
        model, prompts, blocks, positions, batch_size=batch_size, max_rows=max_rows, cache=cache
    )
    ie_heads = activation_patching(
        model, prompts, heads, {"=": positions["="]}, batch_size=batch_size, max_rows=max_rows, cache=cache
    )
    median = ie_blocks.groupby(["position", "component", "kind", "layer"])["ie"].median().reset_index()
    candidates = (
        median[(median.kind == "attn") & (median.position != "=")].sort_values("ie", ascending=False).head(refine)
    )
    refined = [ie_heads]
    for name, g in candidates.groupby("position"):
        layers = set(g.layer)
        comps = [c for c in heads if c.layer in layers]
        refined.append(
            activation_patching(
                model,
                prompts,
                comps,
                {name: positions[name]},
                batch_size=batch_size,
                max_rows=max_rows,
                progress=False,
                cache=cache,
            )
        )
    return pd.concat([ie_blocks] + refined, ignore_index=True)


def summarise_indirect_effects(ie: pd.DataFrame) -> pd.DataFrame:
    """Per position and component: the **median** indirect effect over prompts (``ie``;
    the effect is heavy-tailed, one confidently answered prompt can dominate a mean),
    the mean (``ie_mean``), the mean logit-difference and answer-logit changes and ``n``."""
    return (
        ie.groupby(["position", "component", "kind", "layer", "head"])
        .agg(
            ie=("ie", "median"),
            ie_mean=("ie", "mean"),
            logit_diff_change=("logit_diff_change", "mean"),
            answer_logit_change=("answer_logit_change", "mean"),
            n=("ie", "size"),
        )
        .reset_index()
    )


def ranked_head_positions(summary: pd.DataFrame) -> list[tuple[Component, str]]:
    """(head, position name) pairs of :func:`summarise_indirect_effects` rows, largest
    median indirect effect first."""
    rows = summary[summary.kind == "head"].sort_values("ie", ascending=False)
    return [(Component("head", int(r.layer), int(r.head)), r.position) for r in rows.itertuples()]


def head_count_circuits(
    ranked: Sequence[tuple[Component, str]], n_layers: int, position_names: Iterable[str], ks: Iterable[int]
) -> dict[str, set[tuple[Component, str]]]:
    """Circuits for :func:`circuit_faithfulness`: every MLP at every named position plus
    the top ``k`` of ``ranked`` heads, named ``"k={k}"`` (each ``k`` no larger than
    ``ranked``)."""
    names = list(position_names)
    mlps = {(Component("mlp", l), n) for l in range(n_layers) for n in names}
    return {f"k={k}": mlps | set(ranked[:k]) for k in ks if k <= len(ranked)}


def circuit_head_counts(faith: pd.DataFrame) -> pd.Series:
    """The k of each :func:`head_count_circuits` row of :func:`circuit_faithfulness`'s
    frame (NaN for "full", "ablated" and other circuits)."""
    return faith["circuit"].str.extract(r"k=(\d+)")[0].astype(float)


def heads_needed(faith: pd.DataFrame, target: float) -> int | None:
    """The smallest k of :func:`head_count_circuits` whose faithfulness reaches
    ``target`` in :func:`circuit_faithfulness`'s rows, or None."""
    k = circuit_head_counts(faith)
    reach = k[(faith["faithfulness"] >= target) & k.notna()]
    return int(reach.min()) if len(reach) else None


def _top_pairs(ie: pd.DataFrame, k: int) -> list[tuple[str, str]]:
    """The ``k`` (component label, position) head pairs of largest median indirect effect
    over the rows' prompts (ties: the stable order of layer, head, position)."""
    heads = ie[ie.kind == "head"]
    med = (
        heads.groupby(["layer", "head", "position", "component"])["ie"]
        .median()
        .reset_index()
        .sort_values("ie", ascending=False, kind="stable")
    )
    return list(zip(med.component, med.position))[:k]


def screen_recall(screen: pd.DataFrame, exact: pd.DataFrame, ks: Iterable[int]) -> pd.DataFrame:
    """Recall of a patching screen (:func:`coarse_to_fine_patching`) against the exact
    per-head per-position activation patching (:func:`activation_patching` of every head
    at every position), both as rows of :func:`activation_patching` on the same prompts:
    for each k, the share of the exact top-k (head, position) pairs (median indirect
    effect) that are in the screen's top k (pairs the screen did not patch cannot be in it).
    Columns: k, recall, n_prompts."""
    n = exact["prompt"].nunique()
    rows, seen = [], set()
    for k in ks:
        top_e = _top_pairs(exact, int(k))
        if not top_e or len(top_e) in seen:  # k beyond the number of pairs: counted once
            continue
        seen.add(len(top_e))
        top_s = set(_top_pairs(screen, len(top_e)))
        rows.append({"k": len(top_e), "recall": sum(p in top_s for p in top_e) / len(top_e), "n_prompts": n})
    return pd.DataFrame(rows, columns=["k", "recall", "n_prompts"])


def split_half_agreement(ie: pd.DataFrame, k: int, n_splits: int = 20, seed: int = 0) -> pd.DataFrame:
    """Stability of the top-k (head, position) set of activation patching under the choice of
    prompts: the prompts are split at random into two halves (within each operator), each
    half ranks the heads by median indirect effect, and the agreement of the two top-k
    sets is their Jaccard index |A & B| / |A | B| (1: the same heads). Columns: split, k,
    jaccard, n_prompts."""
    rng = np.random.default_rng(seed)
    by_op = {op: sorted(g["prompt"].unique()) for op, g in ie.groupby("op")}
    rows = []
    for s in range(n_splits):
        half_a = []
        for prompts in by_op.values():
            perm = rng.permutation(prompts)
            half_a += perm[: len(perm) // 2].tolist()
        in_a = ie["prompt"].isin(half_a)
        a, b = set(_top_pairs(ie[in_a], k)), set(_top_pairs(ie[~in_a], k))
        union = a | b
        rows.append(
            {
                "split": s,
                "k": k,
                "jaccard": len(a & b) / len(union) if union else float("nan"),
                "n_prompts": ie["prompt"].nunique(),
            }
        )
    return pd.DataFrame(rows)
