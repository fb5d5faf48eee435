"""Comparative Neuron Analysis (CNA), Yu & Ananiadou 2024 (EMNLP), Sec. 4 and App. B.

The importance of FFN neuron k of layer l for the predicted token w at the answer
position (Sec. 4.1) is

    imp = log p(w | x^{l-1} + A^l + m_k fc2_k) - log p(w | x^{l-1} + A^l),

where x^{l-1} + A^l is the residual stream after layer l's attention ("resid_mid"),
m_k the neuron's coefficient (its activation, ``blocks.l.mlp.hook_post``) and fc2_k
its value vector (row k of ``W_out``); p is read through the final norm and the
unembedding the model actually applies (``ln_final`` with its weight, ``W_U``,
``b_U``). CNA compares the same neuron between two runs (the original model and a
model with the key head zeroed, or two inputs) and ranks neurons by the change.

Computing it for every neuron at once
-------------------------------------
With an RMSNorm final norm (LayerNorm: the same after centring), for r = resid_mid
and v = fc2_k::

    logits(r + m v) = (A + m B_k) / sigma_k + beta,   A = (g*r) W_U,  B_k = (g*v) W_U,
    sigma_k^2 = (|r|^2 + 2 m r.v + m^2 |v|^2) / d + eps,   beta = b_U (+ b_ln W_U).

B is prompt-independent ([d_mlp, vocab] per layer), sigma_k is cheap for all neurons,
but the log-partition needs one pass over the vocabulary per (neuron, prompt). Two
modes:

* ``"exact"``: every neuron, vocabulary in chunks with an online logsumexp (the
  matrix products are shared by all prompts). Affordable on a GPU and for small
  models (timings: benchmarks/RESULTS.md).
* ``"two_stage"``: stage 1 scores every neuron with the first-order importance,
  whose logit change is exact and whose log-partition is linearised at the
  baseline distribution p = softmax(logits(r)):
  ``imp1 = dz_w - sum_v p_v dz_v`` (:func:`first_order_importance`, cost
  O(d_mlp * d) per prompt and layer once p is known); stage 2 computes the exact
  importance of the top ``n_candidates`` neurons per prompt (ranked by the stage-1
  score or its change between runs). Exact values of the neurons it scores are
  identical to the exact mode's; the others are NaN.

Layers where both runs have bit-identical inputs at the answer position (those
below an ablated head) have zero change; :func:`cna_compare` skips them.

Other pieces: the key head from notebook 01's exact sweep (:func:`select_key_heads`),
interventions on per-prompt neuron sets at the answer position with a cached prompt
prefix (mask / keep, Table 5; the lowest-neuron test, Table 6; the PE-DAG on every
case), each with random controls over several seeds, the vocabulary projection of
neuron values (Geva et al. 2022: softmax(E_u v)), the projection through the OV
matrices of every attention layer that can read a shallow neuron (hidden-interpretable
neurons, Tables 7-8) and an exact, pruned count of number/operation concepts among a
projection's top tokens. TransformerLens gives the hooks and weights; it has no CNA, no per-prompt
neuron interventions and no vocabulary-pruned top-k, hence this module.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Mapping, Sequence

import numpy as np
import pandas as pd
import torch
from tqdm.auto import tqdm

from . import datasets as ds
from .ablation import is_position_invariant, stacked_hooks, zero_neurons_hooks
from .components import Head, Hook, Neuron
from .datasets import PromptRecord, PromptSet
from .stats import encode_correct
from .engine import common_prefix, forward, input_device, layer_device, prefix_cache, repeat_cache, wrapped
from .evaluate import continues_number
from .neurons import w_out
from .papers import DAG_EDGE_MIN_ENHANCEMENT, DEEP_FROM_FRACTION, YU_CNA_TABLES, YU_GROUPS
from .readout import FinalNorm, final_norm, unembedding

RowHooks = Callable[[torch.Tensor], list[Hook]]  # batch row indices (into the PromptSet) -> hooks



# --------------------------------------------------------------------------- model pieces


def _n_layers(model) -> int:
    return int(model.cfg.n_layers)


def mlp_values(model, layer: int) -> torch.Tensor:
    """FFN value vectors fc2_k of ``layer`` (rows of W_out), [d_mlp, d_model], float32:
    :func:`arithlib.neurons.w_out`, one layer's weight (the bridge's ``W_out[layer]``
    stacks every layer first)."""
    return w_out(model, layer)


def deep_layers(n_layers: int, fraction: float = DEEP_FROM_FRACTION) -> list[int]:
    """Yu's deep layers scaled by depth: 17..31 of 32 -> round(17/32 * L)..L-1."""
    start = int(round(fraction * n_layers))
    return list(range(min(start, n_layers - 1), n_layers))


# --------------------------------------------------------------------------- prompts


def yu_division_1d(fewshot: int = 2, template_id: int = 3) -> list[PromptRecord]:
    """Yu's 1D division cases as in the paper's example "72/8=": divisor and quotient in
    1..9, dividend = divisor * quotient (81 prompts), in template ``template_id`` of
    Table 14 with the few-shot prefix. (``datasets.yu_prompts(n_digits=1)`` keeps both
    operands <= 9, which leaves 23 mostly trivial divisions.)"""
    base = ds.load_json("templates.json")["yu"]
    template, sep = base["/"][template_id], base["sep"]
    prefix = ds.fewshot_prefix(template, "/", sep, fewshot)
    records = []
    for b in range(1, 10):
        for q in range(1, 10):
            a = b * q
            text = re.sub(r"\[([^\]]+)\]", r"\1", template.replace("{A}", str(a)).replace("{B}", str(b)))
            records.append(PromptRecord(family="yu", op="/", a=a, b=b, answer=q, template_id=template_id,
                                        template=template, text=text + sep, answer_text=str(q), prefix=prefix,
                                        n_digits=1, carry=False, meta=(("numerals", "digits"),)))
    return records


#: How :func:`select_key_heads` chose a group's head (the ``selection`` column of 04_key_heads.csv).
KEY_HEAD_BY_1D = "largest mean 1D accuracy drop"
KEY_HEAD_FALLBACK = "fallback: no head lowers 1D accuracy; largest mean accuracy drop over all digit counts"


def _read_sweep(sweep: str | Path | pd.DataFrame) -> pd.DataFrame:
    """Notebook 01's exact head sweep (``01_yu_head_sweep.csv``) as a frame with operator
    symbols; FileNotFoundError (run notebook 01) when missing, ValueError when it lacks
    the exact stage's columns."""
    if isinstance(sweep, pd.DataFrame):
        frame = sweep.copy()
    else:
        path = Path(sweep)
        if not path.exists():
            raise FileNotFoundError(f"{path} not found: notebook 04 needs notebook 01's head sweep. Run "
                                    "notebooks/01 (Yu head sweep) with the same model and out_dir first.")
        frame = pd.read_csv(path)
    missing = {"op", "n_digits", "layer", "head", "accuracy", "baseline_accuracy", "accuracy_drop",
               "logit_drop"} - set(frame.columns)
    if missing:
        raise ValueError(f"head sweep lacks columns {sorted(missing)}: it predates notebook 01's exact every-position "
                         "sweep (01_yu_head_sweep.csv with logit_drop); rerun notebook 01")
    names = {v: k for k, v in ds.OP_NAMES.items()}
    frame["op"] = frame["op"].map(lambda o: names.get(o, o))
    frame["n_digits"] = frame["n_digits"].astype(int)
    return frame


def _best_head(rows: pd.DataFrame, n_settings: int) -> pd.Series:
    """The head of ``rows`` (one row per head and setting) measured in the most settings,
    then with the largest mean ``accuracy_drop`` over them, then the largest mean
    ``logit_drop``, then the lowest (layer, head)."""
    g = (rows.assign(_ld=rows["logit_drop"].fillna(-np.inf))
         .groupby(["layer", "head"]).agg(n_settings=("accuracy_drop", "size"), score=("accuracy_drop", "mean"),
                                         logit_score=("_ld", "mean")).reset_index())
    g = g.sort_values(["n_settings", "score", "logit_score", "layer", "head"],
                      ascending=[False, False, False, True, True])
    best = g.iloc[0].copy()
    best["settings_total"] = n_settings
    return best


def select_key_heads(sweep: str | Path | pd.DataFrame, groups: Mapping[str, Sequence[str]] | None = None,
                     n_digits: int = 1) -> pd.DataFrame:
    """The key head of each operator group from notebook 01's **exact** head sweep
    (``01_yu_head_sweep.csv``: the top heads of every setting zeroed at every position on
    all of the setting's prompts), one row per group.

    Rule, fixed before looking at any model (Yu Sec. 4 / App. B: one head for + and -,
    one for /):

    1. Among the heads the exact sweep measured on every operator of the group at
       ``n_digits`` digits (else on the most of them), the largest mean accuracy drop
       over those operators; ties: the larger mean answer-logit drop, then the lower
       (layer, head). It is the key head when that drop is > 0 (``lowers_1d`` True).
    2. When no head lowers ``n_digits``-digit accuracy (a model that answers every 1D
       prompt with any single head zeroed), no head reproduces Yu's premise; the
       comparison head is then, among the heads measured on the most of the group's
       settings (operators x every digit count of the sweep), the one with the largest
       mean accuracy drop over those settings; same ties. ``lowers_1d`` is False and
       ``selection`` says so.

    Columns: group, layer, head, selection, lowers_1d, score (the mean drop the rule
    ranked by), settings_measured, settings_total, logit_score. Raises
    FileNotFoundError when the file is missing (run notebook 01) and ValueError when an
    operator has no rows or the file predates the exact sweep."""
    groups = {g: tuple(ops) for g, ops in (groups or YU_GROUPS).items()}
    frame = _read_sweep(sweep)
    out = []
    for group, ops in groups.items():
        sub = frame[frame["op"].isin(ops)]
        one = sub[sub["n_digits"] == int(n_digits)]
        absent = set(ops) - set(one["op"])
        if absent:
            raise ValueError(f"head sweep has no {n_digits}-digit rows for operator(s) {sorted(absent)}")
        best = _best_head(one, len(ops))
        selection, lowers = KEY_HEAD_BY_1D, bool(best["score"] > 0)
        if not lowers:
            best = _best_head(sub, sub[["op", "n_digits"]].drop_duplicates().shape[0])
            selection = KEY_HEAD_FALLBACK
        out.append({"group": group, "layer": int(best["layer"]), "head": int(best["head"]), "selection": selection,
                    "lowers_1d": lowers, "score": float(best["score"]), "settings_measured": int(best["n_settings"]),
                    "settings_total": int(best["settings_total"]),
                    "logit_score": float(best["logit_score"]) if np.isfinite(best["logit_score"]) else float("nan")})
    return pd.DataFrame(out)


def key_heads_from_sweep(sweep: str | Path | pd.DataFrame, n_digits: int = 1,
                         groups: Mapping[str, Sequence[str]] | None = None) -> dict[str, Head]:
    """Group -> (layer, head) of :func:`select_key_heads` (its rule and fallback there)."""
    sel = select_key_heads(sweep, groups, n_digits)
    return {r.group: (int(r.layer), int(r.head)) for r in sel.itertuples()}


def key_head_table(sweep: str | Path | pd.DataFrame, selected: pd.DataFrame,
                   groups: Mapping[str, Sequence[str]] | None = None, n_digits: int = 1) -> pd.DataFrame:
    """04_key_heads.csv: for each group's selected head (:func:`select_key_heads`), its
    exact-sweep rows on the group's ``n_digits``-digit operators (accuracy with the head
    zeroed, baseline, drop, the binomial interval of the accuracy, logit drop) with the
    selection columns; an operator on which the sweep did not measure the head gets a
    row with NaN numbers (the screen did not rank it among its top heads there)."""
    groups = {g: tuple(ops) for g, ops in (groups or YU_GROUPS).items()}
    frame = _read_sweep(sweep)
    keep = [c for c in ("n", "accuracy", "baseline_accuracy", "accuracy_drop", "relative_drop", "accuracy_low",
                        "accuracy_high", "logit_drop") if c in frame.columns]
    rows = []
    for sel in selected.itertuples(index=False):
        for op in groups[sel.group]:
            r = frame[(frame["op"] == op) & (frame["n_digits"] == int(n_digits)) & (frame["layer"] == sel.layer)
                      & (frame["head"] == sel.head)]
            vals = r.iloc[0][keep].to_dict() if len(r) else {c: float("nan") for c in keep}
            rows.append({**sel._asdict(), "op": op, "n_digits": int(n_digits), **vals})
    return pd.DataFrame(rows)


# --------------------------------------------------------------------------- forward passes


@dataclass
class LastPosition:
    """What one run leaves at the answer position: prediction, log-probability of the
    target, and (if captured) resid_mid [N, L, d] and coefficients [N, L, d_mlp]."""

    targets: torch.Tensor
    pred: torch.Tensor
    logprob: torch.Tensor
    resid_mid: torch.Tensor | None = None
    coef: torch.Tensor | None = None

    @property
    def correct(self) -> torch.Tensor:
        return self.pred == self.targets

    @property
    def accuracy(self) -> float:
        return float(self.correct.float().mean()) if len(self.targets) else float("nan")


class _Capture:
    """Forward hooks that record resid_mid (resid_pre + attn_out) and MLP coefficients
    at the last position of every layer; the last call wins."""

    def __init__(self, n_layers: int, what: Sequence[str]):
        self.n_layers, self.what, self.store = n_layers, set(what), {}

    def hooks(self) -> list[Hook]:
        hooks = []
        for layer in range(self.n_layers):
            if "resid_mid" in self.what:
                hooks.append((f"blocks.{layer}.hook_resid_pre", self._save(("pre", layer))))
                hooks.append((f"blocks.{layer}.hook_attn_out", self._save(("attn", layer))))
            if "coef" in self.what:
                hooks.append((f"blocks.{layer}.mlp.hook_post", self._save(("coef", layer))))
        return hooks

    def _save(self, key):
        def fn(act, hook):
            self.store[key] = act[:, -1].detach().float()
            return act
        return fn

    def collect(self) -> dict[str, torch.Tensor]:
        out = {}
        # recorded in float32 (CNA's log-probability differences need it under bf16); on a
        # split model each layer's record is on its own device: stacked on the first's
        dev = next(iter(self.store.values())).device if self.store else None
        if "resid_mid" in self.what:
            out["resid_mid"] = torch.stack([(self.store[("pre", l)] + self.store[("attn", l)]).to(dev)
                                            for l in range(self.n_layers)], 1)
        if "coef" in self.what:
            out["coef"] = torch.stack([self.store[("coef", l)].to(dev) for l in range(self.n_layers)], 1)
        self.store = {}
        return out


def _prefix_cache(model, tokens: torch.Tensor):
    """KV cache of ``tokens`` [B, T] (bridge hooks active), computing the rows' common
    prefix once at batch 1 and expanding it."""
    B, T = tokens.shape
    n = common_prefix(tokens.tolist()) if B > 1 else 0
    if n > 0:
        cache = prefix_cache(model, tokens[:1, :n], B)
        if n < T:
            forward(model, tokens[:, n:], cache=cache, keep=1)
        return cache
    return forward(model, tokens, keep=1, keep_cache=True).cache


def _targets_for(prompts: PromptSet, targets: torch.Tensor | None) -> torch.Tensor:
    t = prompts.first_answer_ids if targets is None else torch.as_tensor(targets, dtype=torch.long)
    if len(t) != len(prompts):
        raise ValueError(f"{len(t)} targets for {len(prompts)} prompts")
    return t


def _assemble(n: int, parts: list[tuple[torch.Tensor, dict]], targets: torch.Tensor) -> LastPosition:
    fields: dict[str, torch.Tensor] = {}
    for index, values in parts:
        for key, value in values.items():
            if key not in fields:
                fields[key] = torch.empty((n, *value.shape[1:]), dtype=value.dtype)
            fields[key][index] = value.cpu()
    if not parts:
        fields = {"pred": torch.empty(0, dtype=torch.long), "logprob": torch.empty(0)}
    return LastPosition(targets=targets, pred=fields.pop("pred"), logprob=fields.pop("logprob"),
                        resid_mid=fields.get("resid_mid"), coef=fields.get("coef"))


def _split_conditions(logits: torch.Tensor, captured: dict[str, torch.Tensor], targets: torch.Tensor,
                      index: torch.Tensor, names: Sequence[str], parts: dict[str, list]) -> None:
    """Per condition of a condition-major pass (``len(names)`` blocks of the batch's rows):
    prediction, log p(target) and captured activations, appended to ``parts[name]``."""
    nc, B = len(names), len(index)
    pred = logits.argmax(-1).view(nc, B)
    # fp32 log-probabilities (``logits`` are cast to float32 by the callers); targets follow
    # the logits (an accelerate-split model returns them on its input device)
    logprob = logits.log_softmax(-1).gather(1, targets.repeat(nc).to(logits.device)[:, None])[:, 0].view(nc, B)
    captured = {k: v.view(nc, B, *v.shape[1:]) for k, v in captured.items()}
    for c, name in enumerate(names):
        parts[name].append((index, {"pred": pred[c], "logprob": logprob[c], **{k: v[c] for k, v in captured.items()}}))


@torch.no_grad()
def run_conditions(model, prompts: PromptSet, conditions: Mapping[str, list[Hook] | RowHooks | None], *,
                   capture: Sequence[str] = ("resid_mid", "coef"), targets: torch.Tensor | None = None,
                   batch_size: int = 64, max_rows: int = 256, share_prefix: bool = True, progress: bool = False,
                   desc: str = "forward") -> dict[str, LastPosition]:
    """One run of ``prompts`` per condition (a hook list active at every position, a
    function of the batch's row indices giving per-prompt hooks, or None); returns per
    condition the prediction, log p(target) and the captured answer-position activations.

    Batches hold one few-shot prefix each; with ``share_prefix`` and hook lists whose
    hooks are all position-invariant (:func:`arithlib.ablation.is_position_invariant`: zeroing at every position) the prefix the
    batch's rows share is computed once per condition (with its hooks) and reused
    through the KV cache: the same result as a full forward, several times cheaper.
    Per-prompt hooks and any other hook (``position=-1``, mean ablation) run every row
    in full: the same numbers, without the saving. Conditions are stacked along the
    batch (condition-major, up to ``max_rows`` prompt rows per pass, each condition's
    hooks on its own rows): fewer, larger matrix products.
    """
    device = input_device(model)
    targets = _targets_for(prompts, targets)
    cap = _Capture(_n_layers(model), capture)
    names = list(conditions)
    parts: dict[str, list] = {name: [] for name in names}
    for batch in tqdm(list(prompts.batches(batch_size, device, by_prefix=share_prefix)), desc=desc,
                      disable=not progress, leave=False):
        tokens = batch.tokens
        B = tokens.shape[0]
        t = targets[batch.index].to(device)
        per_chunk = max(1, max_rows // B)
        for c0 in range(0, len(names), per_chunk):
            chunk = names[c0:c0 + per_chunk]
            nc = len(chunk)
            conds = [conditions[name] for name in chunk]
            per = [(c(batch.index) if callable(c) else list(c or [])) for c in conds]
            shared = (share_prefix and B > 1 and not any(callable(c) for c in conds)
                      and all(is_position_invariant(fn) for hooks in per for _, fn in hooks))
            n = min(common_prefix(tokens.tolist()), tokens.shape[1] - 1) if shared else 0
            if n > 0:
                with model.hooks(fwd_hooks=stacked_hooks(per, 1)):
                    # condition-major: B copies of each condition's prefix
                    cache = prefix_cache(model, tokens[:1, :n].repeat(nc, 1), B)
                with model.hooks(fwd_hooks=stacked_hooks(per, B) + cap.hooks()):
                    out = forward(model, tokens[:, n:].repeat(nc, 1), cache=cache, keep=1)
            else:
                with model.hooks(fwd_hooks=stacked_hooks(per, B) + cap.hooks()):
                    out = forward(model, tokens.repeat(nc, 1), keep=1)
            _split_conditions(out.logits[:, -1].float(), cap.collect(), t, batch.index, chunk, parts)
    return {name: _assemble(len(prompts), p, targets) for name, p in parts.items()}


def run_last_position(model, prompts: PromptSet, hooks: list[Hook] | RowHooks | None = None, *,
                      capture: Sequence[str] = ("resid_mid", "coef"), targets: torch.Tensor | None = None,
                      batch_size: int = 64, share_prefix: bool = True, progress: bool = False,
                      desc: str = "forward") -> LastPosition:
    """:func:`run_conditions` with one condition: ``prompts`` with ``hooks`` active at
    every position."""
    return run_conditions(model, prompts, {"run": hooks}, capture=capture, targets=targets, batch_size=batch_size,
                          share_prefix=share_prefix, progress=progress, desc=desc)["run"]


@torch.no_grad()
def run_answer_conditions(model, prompts: PromptSet, conditions: Mapping[str, list[Hook] | RowHooks | None], *,
                          capture: Sequence[str] = (), targets: torch.Tensor | None = None, batch_size: int = 64,
                          max_rows: int = 512, progress: bool = False, desc: str = "conditions"
                          ) -> dict[str, LastPosition]:
    """Interventions at the answer position only: every prompt's positions before the
    last are run once without hooks (KV cache, few-shot prefix shared), then the last
    token of all conditions at once, stacked along the batch (up to ``max_rows`` rows),
    each condition's hooks acting on its own rows. A condition is a hook list or a
    function of the batch's row indices (per-prompt neuron sets). Since the hooks act on
    the last token alone, this equals a full forward with hooks at position -1; stacking
    reads the weights once for all conditions (single-token passes are memory-bound)."""
    device = input_device(model)
    targets = _targets_for(prompts, targets)
    cap = _Capture(_n_layers(model), capture)
    names = list(conditions)
    parts: dict[str, list] = {name: [] for name in names}
    for batch in tqdm(list(prompts.batches(batch_size, device, by_prefix=True)), desc=desc, disable=not progress,
                      leave=False):
        tokens = batch.tokens
        B = tokens.shape[0]
        base = _prefix_cache(model, tokens[:, :-1]) if tokens.shape[1] > 1 else None
        t = targets[batch.index].to(device)
        per_chunk = max(1, max_rows // B)
        for c0 in range(0, len(names), per_chunk):
            chunk = names[c0:c0 + per_chunk]
            nc = len(chunk)
            hooks = stacked_hooks([(cond(batch.index) if callable(cond) else list(cond or []))
                                   for cond in (conditions[name] for name in chunk)], B)
            last = tokens[:, -1:].repeat(nc, 1)
            with model.hooks(fwd_hooks=hooks + cap.hooks()):
                if base is not None:
                    out = forward(model, last, cache=repeat_cache(model, base, nc))
                else:
                    out = forward(model, last)
            _split_conditions(out.logits[:, -1].float(), cap.collect(), t, batch.index, chunk, parts)
    return {name: _assemble(len(prompts), p, targets) for name, p in parts.items()}


@torch.no_grad()
def correct_mask(model, prompts: PromptSet, criterion: str = "full", batch_size: int = 32,
                 progress: bool = False) -> torch.Tensor:
    """Which prompts the model answers correctly, by teacher forcing (one forward over
    prompt + answer, shared prefix cached): "first" = the first answer token is the
    argmax; "full" = every answer token is the argmax after its predecessors and the
    next token does not continue the number. Equals greedy decoding's verdict
    (``evaluate.evaluate``'s ``correct_full``) at a fraction of the cost."""
    if criterion not in ("full", "first"):
        raise ValueError("criterion must be 'full' or 'first'")
    device = input_device(model)
    tok = prompts.tokenizer
    groups: dict[tuple[int, int], list[int]] = {}
    for i, (ids, ans) in enumerate(zip(prompts.input_ids, prompts.answer_ids)):
        n_ans = len(ans) if criterion == "full" else 1
        groups.setdefault((len(ids), n_ans), []).append(i)
    result = torch.zeros(len(prompts), dtype=torch.bool)
    chunks = [(key, idx[s:s + batch_size]) for key, idx in groups.items() for s in range(0, len(idx), batch_size)]
    for (length, n_ans), idx in tqdm(chunks, desc="correct", disable=not progress, leave=False):
        seqs = [prompts.input_ids[i] + prompts.answer_ids[i][:n_ans] for i in idx]
        tokens = torch.tensor(seqs, device=device)
        n_keep = n_ans + 1 if criterion == "full" else 1
        inputs = tokens if criterion == "full" else tokens[:, :length]
        n = min(common_prefix(inputs.tolist()), inputs.shape[1] - 1) if len(idx) > 1 else 0
        n = min(n, length - 1)
        if n > 0:
            cache = prefix_cache(model, inputs[:1, :n], len(idx))
            logits = forward(model, inputs[:, n:], cache=cache, keep=n_keep).logits
        else:
            logits = forward(model, inputs, keep=n_keep).logits
        pred = logits.argmax(-1).cpu()  # [B, n_keep]: predictions at positions length-1 .. length-1+n_ans
        for row, i in enumerate(idx):
            ans = prompts.answer_ids[i]
            ok = pred[row, :n_ans].tolist() == ans[:n_ans]
            if criterion == "full" and ok:
                ok = not continues_number(tok, int(pred[row, n_ans]))
            result[i] = ok
    return result


# --------------------------------------------------------------------------- importance: the math


def _centre(x: torch.Tensor, norm: FinalNorm) -> torch.Tensor:
    return x - x.mean(-1, keepdim=True) if norm.kind == "layer" else x


def _beta(norm: FinalNorm, W_U: torch.Tensor, b_U: torch.Tensor) -> torch.Tensor:
    return b_U + norm.bias @ W_U if norm.bias is not None else b_U


@dataclass
class LayerStats:
    """Per-row baseline quantities of one layer: sigma0 (norm scale of r), A_w (target
    logit before scaling), lse0 (log-partition of the baseline logits), pA (= p . A)
    and q (= W_U p, the expected unembedding), with p = softmax(logits(r))."""

    sigma0: torch.Tensor
    A_w: torch.Tensor
    lse0: torch.Tensor
    pA: torch.Tensor
    q: torch.Tensor


def layer_stats(resid: torch.Tensor, targets: torch.Tensor, norm: FinalNorm, W_U: torch.Tensor, b_U: torch.Tensor,
                vocab_chunk: int = 16384) -> tuple[LayerStats, torch.Tensor]:
    """Baseline statistics of rows ``resid`` [R, d] (one pass over the vocabulary with an
    online softmax) and log p(target | resid) [R]."""
    r = _centre(resid.float(), norm)
    d = r.shape[-1]
    gr = r * norm.weight
    sigma0 = torch.sqrt(r.pow(2).sum(-1) / d + norm.eps)
    beta = _beta(norm, W_U, b_U)
    R = r.shape[0]
    m = torch.full((R,), -torch.inf, device=r.device)
    s = torch.zeros(R, device=r.device)
    pA = torch.zeros(R, device=r.device)
    q = torch.zeros(R, d, device=r.device)
    for v0 in range(0, W_U.shape[1], vocab_chunk):
        Wc = W_U[:, v0:v0 + vocab_chunk]
        A = gr @ Wc
        z = A / sigma0[:, None] + beta[v0:v0 + vocab_chunk]
        m_new = torch.maximum(m, z.max(-1).values)
        scale = torch.exp(m - m_new)
        e = torch.exp(z - m_new[:, None])
        s = s * scale + e.sum(-1)
        pA = pA * scale + (e * A).sum(-1)
        q = q * scale[:, None] + e @ Wc.T
        m = m_new
    pA, q = pA / s, q / s[:, None]
    lse0 = m + torch.log(s)
    A_w = (gr * W_U[:, targets.to(W_U.device)].T).sum(-1)
    base = A_w / sigma0 + beta[targets] - lse0
    return LayerStats(sigma0, A_w, lse0, pA, q), base


def _pair_terms(resid: torch.Tensor, coef: torch.Tensor, values: torch.Tensor, norm: FinalNorm):
    """Centred r and v, r.v [R, K], |r|^2 [R], |v|^2 [K] and sigma [R, K] of r + m v."""
    r = _centre(resid.float(), norm)
    v = _centre(values.float(), norm)
    d = r.shape[-1]
    rv = r @ v.T
    rr = r.pow(2).sum(-1)
    vv = v.pow(2).sum(-1)
    m = coef.float()
    sigma = torch.sqrt((rr[:, None] + 2 * m * rv + m.pow(2) * vv[None]) / d + norm.eps)
    return r, v, sigma


def first_order_importance(resid: torch.Tensor, coef: torch.Tensor, values: torch.Tensor, targets: torch.Tensor,
                           norm: FinalNorm, W_U: torch.Tensor, stats: LayerStats) -> torch.Tensor:
    """Stage 1 of the two-stage mode, [R, K]: the importance with the logit change dz
    exact (norm rescaling included) and the log-partition linearised at p:
    ``imp1 = dz_w - p . dz = (A_w - p.A)(1/sigma - 1/sigma0) + m (g v).(W_U[:, w] - q) / sigma``."""
    r, v, sigma = _pair_terms(resid, coef, values, norm)
    gv = v * norm.weight
    w_cols = W_U[:, targets.to(W_U.device)].T  # [R, d]
    term_v = (w_cols - stats.q) @ gv.T  # [R, K]
    return (stats.A_w - stats.pA)[:, None] * (1 / sigma - 1 / stats.sigma0[:, None]) + coef.float() * term_v / sigma


class _Scratch:
    """Reusable blocks for the logits chunks of :func:`exact_importance`: one flat buffer
    per slot, grown when needed, viewed at each chunk's shape. Allocating a fresh block
    per chunk (tens of MB, each mapped and zeroed anew by the OS) took several times
    longer than the arithmetic on it; the values are the same."""

    def __init__(self, device: torch.device | str):
        self.device = device
        self.flat: dict[int, torch.Tensor] = {}

    def get(self, slot: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        n = math.prod(shape)
        buf = self.flat.get(slot)
        if buf is None or buf.numel() < n or buf.dtype != dtype:
            buf = self.flat[slot] = torch.empty(n, device=self.device, dtype=dtype)
        return buf[:n].view(shape)


def exact_importance(resid: torch.Tensor, coef: torch.Tensor, values: torch.Tensor, targets: torch.Tensor,
                     norm: FinalNorm, W_U: torch.Tensor, b_U: torch.Tensor,
                     pairs: tuple[torch.Tensor, torch.Tensor] | None = None, base_logprob: torch.Tensor | None = None,
                     vocab_chunk: int = 8192, block_elems: int = 2 ** 24) -> torch.Tensor:
    """Exact CNA importance (Sec. 4.1) of neurons with values ``values`` [K, d] and
    coefficients ``coef`` [R, K] for rows ``resid`` [R, d] and target tokens [R].

    ``pairs=None``: every (row, neuron), returns [R, K]. ``pairs=(rows, cols)``: only those
    (row, neuron) pairs, returns [P]. The vocabulary is processed in chunks with an
    online logsumexp; the value projections (g v) W_U are computed once per chunk for
    the neurons involved and shared by all rows. ``block_elems`` bounds the size of the
    [pairs, vocab chunk] logits block (memory)."""
    device = W_U.device
    targets = targets.to(device)
    if base_logprob is None:
        _, base_logprob = layer_stats(resid, targets, norm, W_U, b_U)
    r, v, sigma = _pair_terms(resid, coef, values, norm)
    gr, gv = r * norm.weight, v * norm.weight
    beta = _beta(norm, W_U, b_U)
    R, K = coef.shape
    if pairs is None:
        return _exact_importance_all(gr, gv, coef.float(), sigma, targets, W_U, beta, base_logprob.to(device),
                                     vocab_chunk, block_elems)
    rows, cols = (p.to(device) for p in pairs)
    used, inverse = torch.unique(cols, return_inverse=True)  # neurons involved
    P = rows.numel()
    m_pair = coef.float()[rows, cols]
    inv_sigma = 1.0 / sigma[rows, cols]
    # exact target logit
    w_cols = W_U[:, targets].T  # [R, d]
    Aw = (gr * w_cols).sum(-1)
    Bw = (gv[used] @ w_cols.T)  # [U, R]
    z_w = (Aw[rows] + m_pair * Bw[inverse, rows]) * inv_sigma + beta[targets][rows]
    run_max = torch.full((P,), -torch.inf, device=device)
    run_sum = torch.zeros(P, device=device)
    pair_chunk = max(1, block_elems // vocab_chunk)
    gv_used = gv[used]
    row_used = torch.unique(rows)
    row_pos = torch.full((R,), -1, dtype=torch.long, device=device)
    row_pos[row_used] = torch.arange(len(row_used), device=device)
    rows_c = row_pos[rows]
    gr_used = gr[row_used]
    scratch = _Scratch(device)
    for v0 in range(0, W_U.shape[1], vocab_chunk):
        Wc = W_U[:, v0:v0 + vocab_chunk]
        A = gr_used @ Wc  # [rows with pairs, C]
        B = gv_used @ Wc  # [neurons with pairs, C]
        bc = beta[v0:v0 + vocab_chunk]
        for p0 in range(0, P, pair_chunk):
            sl = slice(p0, p0 + pair_chunk)
            n = min(pair_chunk, P - p0)
            z, other = scratch.get(0, (n, Wc.shape[1]), A.dtype), scratch.get(1, (n, Wc.shape[1]), B.dtype)
            torch.index_select(A, 0, rows_c[sl], out=z)
            torch.index_select(B, 0, inverse[sl], out=other)
            z.addcmul_(other, m_pair[sl, None])
            z.mul_(inv_sigma[sl, None]).add_(bc)
            new = torch.maximum(run_max[sl], z.amax(-1))
            run_sum[sl] = run_sum[sl] * torch.exp(run_max[sl] - new) + z.sub_(new[:, None]).exp_().sum(-1)
            run_max[sl] = new
    return z_w - (run_max + torch.log(run_sum)) - base_logprob.to(device)[rows]


def _exact_importance_all(gr: torch.Tensor, gv: torch.Tensor, m: torch.Tensor, sigma: torch.Tensor,
                          targets: torch.Tensor, W_U: torch.Tensor, beta: torch.Tensor, base_logprob: torch.Tensor,
                          vocab_chunk: int, block_elems: int) -> torch.Tensor:
    """:func:`exact_importance` for every (row, neuron): logits blocks [rows, K, chunk] by
    broadcasting (no gathers), online logsumexp over vocabulary chunks. [R, K]. A block
    holds at most ``block_elems`` values: the vocabulary chunk shrinks below
    ``vocab_chunk`` when one row's [K, chunk] block would exceed it (a layer of many neurons)."""
    w_cols = W_U[:, targets].T  # [R, d]
    z_w = ((gr * w_cols).sum(-1)[:, None] + m * (w_cols @ gv.T)) * (1.0 / sigma) + beta[targets][:, None]
    return z_w - log_partition_all(gr, gv, m, sigma, W_U, beta, vocab_chunk, block_elems) - base_logprob[:, None]


def log_partition_all(gr: torch.Tensor, gv: torch.Tensor, m: torch.Tensor, sigma: torch.Tensor, W_U: torch.Tensor,
                      beta: torch.Tensor, vocab_chunk: int = 8192, block_elems: int = 2 ** 24) -> torch.Tensor:
    """log sum_v exp(logits_v(r + m_k v_k)) for every row r and neuron k, [R, K]: the part
    of the exact importance that needs a pass over the vocabulary (``gr``, ``gv``: the
    centred rows and values times the norm weight; ``sigma`` [R, K]: the norm scale of
    r + m_k v_k; ``beta``: the logit offset). It does not depend on the target token, so
    several targets of one row share it (:func:`arithlib.bias.shared_input_importance`)."""
    R, K = m.shape
    device = W_U.device
    inv_sigma = 1.0 / sigma
    run_max = torch.full((R, K), -torch.inf, device=device)
    run_sum = torch.zeros(R, K, device=device)
    chunk = max(1, min(vocab_chunk, W_U.shape[1], block_elems // K))
    row_block = max(1, block_elems // (K * chunk))
    scratch = _Scratch(device)
    for v0 in range(0, W_U.shape[1], chunk):
        Wc = W_U[:, v0:v0 + chunk]
        A = gr @ Wc  # [R, C]
        B = gv @ Wc  # [K, C]
        bc = beta[v0:v0 + chunk]
        dtype = torch.promote_types(torch.promote_types(A.dtype, m.dtype), B.dtype)
        for r0 in range(0, R, row_block):
            rs = slice(r0, r0 + row_block)
            z = torch.addcmul(A[rs, None, :], m[rs, :, None], B[None],
                              out=scratch.get(0, (min(row_block, R - r0), K, Wc.shape[1]), dtype))  # [r, K, C]
            z.mul_(inv_sigma[rs, :, None]).add_(bc)
            new = torch.maximum(run_max[rs], z.amax(-1))
            run_sum[rs] = run_sum[rs] * torch.exp(run_max[rs] - new) + z.sub_(new[..., None]).exp_().sum(-1)
            run_max[rs] = new
    return run_max + torch.log(run_sum)


@torch.no_grad()
def importance_loop(model, resid: torch.Tensor, coef: torch.Tensor, layer: int, targets: torch.Tensor,
                    neurons: Sequence[int] | None = None) -> torch.Tensor:
    """Reference implementation, one neuron at a time: for each neuron k add m_k fc2_k to
    resid_mid, apply the model's own ``ln_final`` module and unembedding, and take the
    change of log p(target). [R, len(neurons)]. The baseline of the benchmark."""
    W_U, b_U = unembedding(model)
    values = mlp_values(model, layer)
    neurons = range(values.shape[0]) if neurons is None else neurons
    dtype = next(model.parameters()).dtype
    t = targets.to(W_U.device)

    def logprob(x):
        y = model.ln_final(x.to(dtype)[:, None, :])[:, 0].float()
        return (y @ W_U + b_U).log_softmax(-1).gather(1, t[:, None])[:, 0]

    base = logprob(resid)
    out = [logprob(resid + coef[:, k, None] * values[k]) - base for k in neurons]
    return torch.stack(out, 1)


# --------------------------------------------------------------------------- CNA over runs


@dataclass
class CNAResult:
    """Importance and coefficient of every neuron in two runs a (original) and b
    (intervened or other input), [N, L, d_mlp] each. ``importance_*`` is exact where
    computed and NaN elsewhere (two-stage mode, or layers skipped because both runs are
    identical there); ``approx_*`` is the stage-1 score of every neuron (NaN in skipped
    layers); ``base_logprob_*`` [N, L] is log p(w | x^{l-1} + A^l)."""

    importance_a: torch.Tensor
    importance_b: torch.Tensor
    approx_a: torch.Tensor
    approx_b: torch.Tensor
    coef_a: torch.Tensor
    coef_b: torch.Tensor
    base_logprob_a: torch.Tensor
    base_logprob_b: torch.Tensor
    run_a: LastPosition
    run_b: LastPosition
    targets: torch.Tensor
    mode: str
    n_candidates: int | None
    layers: list[int]

    @property
    def change(self) -> torch.Tensor:
        """imp_a - imp_b: the CNA score (NaN where not computed)."""
        return self.importance_a - self.importance_b

    @property
    def approx_change(self) -> torch.Tensor:
        return self.approx_a - self.approx_b

    def change_of(self, i: int) -> torch.Tensor:
        """Row ``i`` of :attr:`change`, [L, d_mlp], without computing the other rows (the
        per-case loops of the tables call it once per case and K)."""
        return self.importance_a[i] - self.importance_b[i]

    def __len__(self) -> int:
        return len(self.targets)

    def top(self, i: int, k: int) -> list[Neuron]:
        """The ``k`` neurons with the largest change for case ``i`` (exact scores only)."""
        return top_neurons(self.change_of(i), k)

    def top_frame(self, i: int, k: int, tokenizer=None, model=None, n_tokens: int = 10) -> pd.DataFrame:
        """Table 4 for case ``i``: rank, layer, neuron, importance and coefficient in both
        runs, change, stage-1 change; with ``model`` and ``tokenizer`` the top
        ``n_tokens`` tokens of each neuron's value projected on the vocabulary."""
        rows = []
        change, approx_change = self.change_of(i), self.approx_a[i] - self.approx_b[i]
        for rank, (layer, n) in enumerate(self.top(i, k), 1):
            rows.append({"rank": rank, "layer": layer, "neuron": n, "name": f"{layer}_{n}",
                         "imp_a": float(self.importance_a[i, layer, n]), "imp_b": float(self.importance_b[i, layer, n]),
                         "coef_a": float(self.coef_a[i, layer, n]), "coef_b": float(self.coef_b[i, layer, n]),
                         "change": float(change[layer, n]), "approx_change": float(approx_change[layer, n])})
        frame = pd.DataFrame(rows)
        if model is not None and tokenizer is not None and len(frame):
            vecs = torch.stack([mlp_values(model, l)[n] for l, n in zip(frame.layer, frame.neuron)])
            frame["top_tokens"] = [", ".join(t) for t in top_tokens(model, tokenizer, vecs, n_tokens)]
        return frame


def top_neurons(scores: torch.Tensor, k: int) -> list[Neuron]:
    """(layer, neuron) of the ``k`` largest finite entries of ``scores`` [L, d_mlp], best first."""
    flat = scores.flatten().clone()
    flat[~torch.isfinite(flat)] = -torch.inf
    k = min(k, int(torch.isfinite(flat).sum()))
    idx = flat.topk(k).indices.tolist() if k > 0 else []
    K = scores.shape[-1]
    return [(i // K, i % K) for i in idx]


def resolve_mode(model, mode: str = "auto", max_exact_elems: float = 2e9) -> str:
    """"exact" on a GPU or when L * d_mlp * vocab <= ``max_exact_elems``, else
    "two_stage"; explicit modes pass."""
    if mode in ("exact", "two_stage"):
        return mode
    if mode != "auto":
        raise ValueError("mode must be 'auto', 'exact' or 'two_stage'")
    cfg = model.cfg
    if input_device(model).type == "cuda" or cfg.n_layers * cfg.d_mlp * cfg.d_vocab <= max_exact_elems:
        return "exact"
    return "two_stage"


@torch.no_grad()
def importance_from_runs(model, runs: Sequence[LastPosition], targets: torch.Tensor, *, mode: str = "auto",
                         n_candidates: int = 200, select: str = "change", layers: Sequence[int] | None = None,
                         vocab_chunk: int = 8192, progress: bool = False) -> dict[str, torch.Tensor]:
    """Importance of every neuron in each of ``runs`` (1 or 2 LastPosition with
    resid_mid and coef). Returns ``importance`` [n_runs, N, L, K] (NaN where not exact),
    ``approx`` (stage 1) and ``base_logprob`` [n_runs, N, L].

    Two-stage candidates: per prompt, the ``n_candidates`` neurons over all ``layers``
    with the largest stage-1 score (``select="score"``, of the first run) or stage-1
    change between the two runs (``select="change"``); their exact importance is
    computed in every run."""
    mode = resolve_mode(model, mode)
    norm = final_norm(model)
    W_U, b_U = unembedding(model)  # float32: log-probability differences are computed in fp32
    device = W_U.device            # (where the unembedding is; a split model's last device)
    n_runs = len(runs)
    N = len(targets)
    L, K = runs[0].coef.shape[1], runs[0].coef.shape[2]
    layers = list(range(L)) if layers is None else list(layers)
    importance = torch.full((n_runs, N, L, K), torch.nan)
    approx = torch.full((n_runs, N, L, K), torch.nan)
    base = torch.full((n_runs, N, L), torch.nan)
    t_all = targets.repeat(n_runs).to(device)
    base_by_layer = {}
    for layer in tqdm(layers, desc="stage 1" if mode == "two_stage" else "importance", disable=not progress, leave=False):
        resid = torch.cat([run.resid_mid[:, layer] for run in runs]).to(device)
        coef = torch.cat([run.coef[:, layer] for run in runs]).to(device)
        values = mlp_values(model, layer).to(device)
        stats, b = layer_stats(resid, t_all, norm, W_U, b_U, vocab_chunk=max(vocab_chunk, 16384))
        base[:, :, layer] = b.view(n_runs, N).cpu()
        approx[:, :, layer] = first_order_importance(resid, coef, values, t_all, norm, W_U, stats).view(n_runs, N, K).cpu()
        if mode == "exact":
            imp = exact_importance(resid, coef, values, t_all, norm, W_U, b_U, base_logprob=b, vocab_chunk=vocab_chunk)
            importance[:, :, layer] = imp.view(n_runs, N, K).cpu()
        else:
            base_by_layer[layer] = b
    if mode == "exact":
        return {"importance": importance, "approx": approx, "base_logprob": base}
    # stage 2: exact for each prompt's candidates
    score = approx[0] - approx[1] if (select == "change" and n_runs == 2) else approx[0]
    score = score[:, layers].reshape(N, -1)
    score = torch.where(torch.isfinite(score), score, torch.tensor(-torch.inf))
    c = min(n_candidates, score.shape[1])
    cand = score.topk(c, dim=1).indices  # [N, c] into (len(layers) * K)
    cand_layer = torch.tensor(layers)[cand // K]
    cand_neuron = cand % K
    for layer in tqdm(layers, desc="stage 2 (exact)", disable=not progress, leave=False):
        sel = cand_layer == layer
        if not sel.any():
            continue
        prompt_idx, slot = sel.nonzero(as_tuple=True)
        neurons = cand_neuron[prompt_idx, slot]
        rows = torch.cat([prompt_idx + j * N for j in range(n_runs)])
        cols = neurons.repeat(n_runs)
        resid = torch.cat([run.resid_mid[:, layer] for run in runs]).to(device)
        coef = torch.cat([run.coef[:, layer] for run in runs]).to(device)
        imp = exact_importance(resid, coef, mlp_values(model, layer), t_all, norm, W_U, b_U,
                               pairs=(rows.to(device), cols.to(device)), base_logprob=base_by_layer[layer].to(device),
                               vocab_chunk=vocab_chunk).cpu()
        run_of = torch.arange(n_runs).repeat_interleave(len(prompt_idx))
        importance[run_of, prompt_idx.repeat(n_runs), layer, cols] = imp
    return {"importance": importance, "approx": approx, "base_logprob": base}


def _differing_layers(a: LastPosition, b: LastPosition) -> list[int]:
    L = a.coef.shape[1]
    return [l for l in range(L) if not (torch.equal(a.resid_mid[:, l], b.resid_mid[:, l])
                                        and torch.equal(a.coef[:, l], b.coef[:, l]))]


@torch.no_grad()
def cna_compare(model, prompts: PromptSet, hooks_b: list[Hook] | None = None, prompts_b: PromptSet | None = None, *,
                hooks_a: list[Hook] | None = None, targets: torch.Tensor | None = None, mode: str = "auto",
                n_candidates: int = 200, batch_size: int = 32, skip_identical_layers: bool = True,
                vocab_chunk: int = 8192, progress: bool = True) -> CNAResult:
    """CNA between two runs at the answer position (Sec. 4.1): run a = ``prompts`` with
    ``hooks_a`` (default the plain model), run b = ``prompts_b`` (default the same
    prompts) with ``hooks_b`` (e.g. ``zero_heads_hooks([key_head])``). The target token
    w of case i is ``targets[i]`` (default the first answer token, the prediction of a
    correct case) in both runs. Neurons are ranked by imp_a - imp_b (``.change``)."""
    if prompts_b is not None and len(prompts_b) != len(prompts):
        raise ValueError("prompts and prompts_b must have the same number of cases")
    targets = _targets_for(prompts, targets)
    if prompts_b is None:
        runs = run_conditions(model, prompts, {"a": hooks_a, "b": hooks_b}, targets=targets, batch_size=batch_size,
                              progress=progress, desc="runs a and b")
        run_a, run_b = runs["a"], runs["b"]
    else:
        run_a = run_last_position(model, prompts, hooks_a, targets=targets, batch_size=batch_size, progress=progress,
                                  desc="run a")
        run_b = run_last_position(model, prompts_b, hooks_b, targets=targets, batch_size=batch_size,
                                  progress=progress, desc="run b")
    layers = _differing_layers(run_a, run_b) if skip_identical_layers else list(range(run_a.coef.shape[1]))
    mode = resolve_mode(model, mode)
    if layers:
        out = importance_from_runs(model, [run_a, run_b], targets, mode=mode, n_candidates=n_candidates,
                                   select="change", layers=layers, vocab_chunk=vocab_chunk, progress=progress)
    else:
        shape = (2, len(targets), *run_a.coef.shape[1:])
        out = {"importance": torch.full(shape, torch.nan), "approx": torch.full(shape, torch.nan),
               "base_logprob": torch.full(shape[:3], torch.nan)}
    imp, approx, base = out["importance"], out["approx"], out["base_logprob"]
    return CNAResult(importance_a=imp[0], importance_b=imp[1], approx_a=approx[0], approx_b=approx[1],
                     coef_a=run_a.coef, coef_b=run_b.coef, base_logprob_a=base[0], base_logprob_b=base[1],
                     run_a=run_a, run_b=run_b, targets=targets, mode=mode,
                     n_candidates=None if mode == "exact" else n_candidates, layers=layers)


def candidate_recall(small: CNAResult, large: CNAResult, ks: Sequence[int], small_cases: Sequence[int] | None = None,
                     large_cases: Sequence[int] | None = None) -> pd.DataFrame:
    """Share of the top-k neurons found with a large candidate pool (``large``) that a
    smaller pool (``small``) also ranks top-k, per case and k (rows ``small_cases[j]`` of
    ``small`` and ``large_cases[j]`` of ``large`` are the same case): a check that the
    stage-1 ranking does not miss neurons the exact score ranks high."""
    small_cases = list(range(len(small))) if small_cases is None else list(small_cases)
    large_cases = list(range(len(large))) if large_cases is None else list(large_cases)
    if len(small_cases) != len(large_cases):
        raise ValueError("small_cases and large_cases must pair up")
    rows = []
    for i, j in zip(small_cases, large_cases):
        for k in ks:
            a, b = set(small.top(i, k)), set(large.top(j, k))
            rows.append({"case": i, "k": k, "overlap": len(a & b) / max(1, len(b))})
    return pd.DataFrame(rows)


# --------------------------------------------------------------------------- coefficient decrease


def coefficient_decrease(before: torch.Tensor, after: torch.Tensor) -> float:
    """Decrease (%) of a set of neurons' coefficients from ``before`` to ``after``,
    sign-aware: 100 * sum sign(m0) (m0 - m1) / sum |m0| (SwiGLU coefficients can be
    negative; a neuron whose coefficient moves towards zero decreases)."""
    before, after = before.float(), after.float()
    denom = before.abs().sum()
    if denom == 0:
        return float("nan")
    return float(100 * (torch.sign(before) * (before - after)).sum() / denom)


# --------------------------------------------------------------------------- per-prompt neuron interventions


def rowwise_neuron_hooks(masks: Mapping[int, torch.Tensor], position: int | None = -1) -> RowHooks:
    """Per-prompt neuron zeroing: ``masks[layer]`` is a bool [N, d_mlp] over the whole
    PromptSet (True = zero that neuron for that prompt). Returns a function of a
    batch's row indices giving the hooks (``ablation.zero_neurons_hooks`` zeroes the
    same neurons for every prompt)."""
    def make(index: torch.Tensor) -> list[Hook]:
        hooks = []
        for layer, mask in masks.items():
            def fn(act, hook, m=mask[index.cpu()]):
                m = m.to(act.device)
                if position is None:
                    return act.masked_fill(m[:, None, :], 0.0)
                act[:, position] = act[:, position].masked_fill(m, 0.0)
                return act
            hooks.append((f"blocks.{layer}.mlp.hook_post", fn))
        return hooks
    return make


def neuron_masks(sets: Sequence[Iterable[Neuron]], n_layers: int, d_mlp: int, keep_layers: Sequence[int] | None = None
                 ) -> dict[int, torch.Tensor]:
    """Bool masks [N, d_mlp] per layer from per-prompt neuron sets. Mask mode
    (``keep_layers=None``): True on each prompt's neurons. Keep mode: True on every
    neuron of ``keep_layers`` except the prompt's own (Yu's "keep")."""
    N = len(sets)
    masks: dict[int, torch.Tensor] = {}
    if keep_layers is None:
        for i, neurons in enumerate(sets):
            for layer, n in neurons:
                if layer not in masks:
                    masks[layer] = torch.zeros(N, d_mlp, dtype=torch.bool)
                masks[layer][i, n] = True
        return masks
    for layer in keep_layers:
        masks[layer] = torch.ones(N, d_mlp, dtype=torch.bool)
    for i, neurons in enumerate(sets):
        for layer, n in neurons:
            if layer in masks:
                masks[layer][i, n] = False
    return masks


def random_layer_matched(sets: Sequence[Sequence[Neuron]], d_mlp: int, seed: int) -> list[list[Neuron]]:
    """For each prompt's neuron set, as many random neurons of the same layers (one per
    neuron, not in the set): the control of a mask intervention."""
    rng = np.random.default_rng(seed)
    out = []
    for neurons in sets:
        taken = set(neurons)
        chosen = []
        for layer, _ in neurons:
            while True:
                cand = (layer, int(rng.integers(d_mlp)))
                if cand not in taken:
                    taken.add(cand)
                    chosen.append(cand)
                    break
        out.append(chosen)
    return out


def top_k_sets(result: CNAResult, n_cases: int, k: int) -> list[list[Neuron]]:
    """Each case's top-``k`` CNA neurons, for a table row labelled K = ``k``: a ValueError
    when a case has fewer than ``k`` finite scores (two-stage mode scores only
    ``n_candidates`` neurons per case), since the row would act on fewer neurons than its
    label says."""
    sets = [result.top(i, k) for i in range(n_cases)]
    short = [i for i, s in enumerate(sets) if len(s) < k]
    if short:
        i = short[0]
        fix = (f"raise n_candidates to at least {k} or use mode='exact'" if result.mode == "two_stage" else
               f"use K <= {len(sets[i])}, the neurons of the scored layers {result.layers} (the others have "
               "identical runs a and b)")
        raise ValueError(f"K={k}: {len(short)} of {n_cases} cases have fewer than {k} finite CNA scores (case {i}: "
                         f"{len(sets[i])}; mode {result.mode!r}, n_candidates={result.n_candidates}); {fix}")
    return sets


#: Random controls of notebook 04 (mask / keep, the lowest-neuron test, the shallow
#: sets): independent random draws per K or M, each its own seed.
N_RANDOM_SEEDS = 10


def _seed_of(*parts: int) -> int:
    """A reproducible integer seed from ``parts`` (e.g. notebook seed, draw, K)."""
    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(1)[0])


def layer_span(layers: Iterable[int]) -> str:
    """Layers as text, runs joined: [13, 14, 15, 20] -> "13-15,20"."""
    ls = sorted(set(int(l) for l in layers))
    parts, i = [], 0
    while i < len(ls):
        j = i
        while j + 1 < len(ls) and ls[j + 1] == ls[j] + 1:
            j += 1
        parts.append(f"{ls[i]}-{ls[j]}" if j > i else f"{ls[i]}")
        i = j + 1
    return ",".join(parts)


def random_in_layers(sets: Sequence[Sequence[Neuron]], layers: Sequence[int], d_mlp: int, seed: int
                     ) -> list[list[Neuron]]:
    """For each prompt's neuron set, as many distinct random neurons of ``layers`` (any of
    them, uniformly over their neurons), none in the set: the control of a "keep"."""
    rng = np.random.default_rng(seed)
    layers = list(layers)
    out = []
    for neurons in sets:
        taken = set(neurons)
        chosen: list[Neuron] = []
        while len(chosen) < len(neurons):
            cand = (layers[int(rng.integers(len(layers)))], int(rng.integers(d_mlp)))
            if cand not in taken:
                taken.add(cand)
                chosen.append(cand)
        out.append(chosen)
    return out


def mask_keep_table(model, prompts: PromptSet, result: CNAResult, ks: Sequence[int] = (99, 50, 30, 20, 10), *,
                    keep_layers: Sequence[int] | None = None, seed: int = 0, n_seeds: int = N_RANDOM_SEEDS,
                    control_ks: Sequence[int] | None = None, batch_size: int = 32,
                    progress: bool = True) -> pd.DataFrame:
    """Table 5 / 15 on every case of ``prompts``: for each K, zero each case's top-K CNA
    neurons ("mask"), or zero every other neuron of the layers CNA scored ("keep": Yu
    keeps the top neurons and zeroes the rest of layers 17-31, the layers from the key
    head's up, which are the layers CNA scores; default ``result.layers``), at the
    answer position. Controls, ``n_seeds`` draws each: "random mask" zeroes K neurons
    of the same layers as the top-K (one per top neuron, none of them), "random keep"
    keeps K random neurons of ``keep_layers`` instead of the top-K; at the K of
    ``control_ks`` only (default every K: each control is 2 x ``n_seeds`` more passes).

    One row per (K, intervention, seed; seed NaN for mask / keep): accuracy (first
    token), accuracy decrease (% of the unablated accuracy on the same cases), per-case
    correctness (``correct_by_prompt``, :func:`arithlib.stats.encode_correct`, for exact
    binomial and bootstrap intervals) and, for "mask", the coefficient decrease of the
    top-K neurons from run a to run b (mean over cases). Every case needs K scored
    neurons (:func:`top_k_sets`)."""
    cfg = model.cfg
    if n_seeds < 1:
        raise ValueError(f"n_seeds must be >= 1 (random controls), got {n_seeds}")
    keep_layers = list(result.layers) if keep_layers is None else sorted(int(l) for l in keep_layers)
    if not keep_layers:
        raise ValueError("no layers to keep: CNA scored no layer (runs a and b identical everywhere)")
    conditions: dict[str, list[Hook] | RowHooks | None] = {"none": None}
    coef_dec = {}
    for k in ks:
        sets = top_k_sets(result, len(prompts), k)
        conditions[f"mask|{k}|"] = rowwise_neuron_hooks(neuron_masks(sets, cfg.n_layers, cfg.d_mlp))
        conditions[f"keep|{k}|"] = rowwise_neuron_hooks(neuron_masks(sets, cfg.n_layers, cfg.d_mlp, keep_layers))
        for s in range(n_seeds if control_ks is None or k in control_ks else 0):
            conditions[f"random mask|{k}|{s}"] = rowwise_neuron_hooks(neuron_masks(
                random_layer_matched(sets, cfg.d_mlp, _seed_of(seed, s, k)), cfg.n_layers, cfg.d_mlp))
            conditions[f"random keep|{k}|{s}"] = rowwise_neuron_hooks(neuron_masks(
                random_in_layers(sets, keep_layers, cfg.d_mlp, _seed_of(seed, s, k, 1)), cfg.n_layers, cfg.d_mlp,
                keep_layers))
        coef_dec[k] = float(np.nanmean([coefficient_decrease(result.coef_a[i][tuple(zip(*s))], result.coef_b[i][tuple(zip(*s))])
                                        if s else np.nan for i, s in enumerate(sets)]))
    runs = run_answer_conditions(model, prompts, conditions, targets=result.targets, batch_size=batch_size,
                                 progress=progress, desc="mask/keep")
    base = runs.pop("none").accuracy
    rows = []
    for name, run in runs.items():
        kind, k, s = name.split("|")
        acc = run.accuracy
        rows.append({"K": int(k), "intervention": kind, "seed": int(s) if s else float("nan"), "accuracy": acc,
                     "accuracy_decrease": 100 * (base - acc) / base if base > 0 else float("nan"),
                     "coef_decrease": coef_dec[int(k)] if kind == "mask" else float("nan"),
                     "n_cases": len(prompts), "base_accuracy": base,
                     "keep_layers": layer_span(keep_layers) if kind.endswith("keep") else "",
                     "correct_by_prompt": encode_correct(run.correct.cpu().numpy())})
    return pd.DataFrame(rows)


def lowest_neuron(neurons: Sequence[Neuron], importance: torch.Tensor) -> Neuron:
    """Yu's Sec. 4.3 rule: the neuron of the lowest layer among ``neurons``; among several
    there, the one with the largest importance (``importance`` [L, d_mlp], run a)."""
    low = min(l for l, _ in neurons)
    at_low = [(l, n) for l, n in neurons if l == low]
    return max(at_low, key=lambda ln: float(torch.nan_to_num(importance[ln], nan=-math.inf)))


def lowest_neuron_table(model, prompts: PromptSet, result: CNAResult, ks: Sequence[int] = (99, 50, 30, 20, 10), *,
                        seed: int = 0, n_seeds: int = N_RANDOM_SEEDS, control_ks: Sequence[int] | None = None,
                        batch_size: int = 32, progress: bool = True) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Table 6 / 16 on every case: for each case and K, zero the lowest of its top-K
    neurons (at the answer position, in the original model) and measure the
    coefficient decrease of its other top-K neurons in higher layers (those it can
    influence). Control (not in the paper), ``n_seeds`` draws: zero instead a random
    neuron of the same layer that is not among the top-K, and measure the same upper
    neurons (at the K of ``control_ks`` only; default every K). Returns the summary (per K: mean over cases with at least one higher
    neuron, the mean over seeds of the random control) and the per-case rows
    (``kind`` "lowest" or "random", ``seed``), from which the report bootstraps.
    Every case needs K scored neurons (:func:`top_k_sets`)."""
    cfg = model.cfg
    if n_seeds < 0:
        raise ValueError(f"n_seeds must be >= 0, got {n_seeds}")
    per_case = []
    for k in ks:
        sets = top_k_sets(result, len(prompts), k)
        lows = [lowest_neuron(s, result.importance_a[i]) if s else None for i, s in enumerate(sets)]
        draws: dict[str, list[Neuron | None]] = {"lowest": lows}
        for s_ in range(n_seeds if control_ks is None or k in control_ks else 0):
            rng = np.random.default_rng(_seed_of(seed, s_, k, 2))
            picks = []
            for s, low in zip(sets, lows):
                taken = set(s)
                pick = None
                while low is not None and pick is None:
                    cand = (low[0], int(rng.integers(cfg.d_mlp)))
                    pick = cand if cand not in taken else None
                picks.append(pick)
            draws[f"random|{s_}"] = picks
        conditions = {name: rowwise_neuron_hooks(neuron_masks([[x] if x else [] for x in picks], cfg.n_layers,
                                                              cfg.d_mlp)) for name, picks in draws.items()}
        runs = run_answer_conditions(model, prompts, conditions, capture=("coef",), targets=result.targets,
                                     batch_size=batch_size, progress=progress, desc=f"lowest neuron K={k}")
        for name, picks in draws.items():
            kind, _, s_ = name.partition("|")
            coef_after = runs[name].coef
            for i, (s, low, zeroed) in enumerate(zip(sets, lows, picks)):
                upper = [(l, n) for l, n in s if low is not None and l > low[0]]
                if not upper or zeroed is None:
                    continue
                idx = tuple(zip(*upper))
                per_case.append({"K": k, "kind": kind, "seed": int(s_) if s_ else float("nan"), "case": i,
                                 "lowest_layer": low[0], "lowest_neuron": low[1], "zeroed_neuron": zeroed[1],
                                 "n_upper": len(upper),
                                 "coef_decrease": coefficient_decrease(result.coef_a[i][idx], coef_after[i][idx]),
                                 "correct_after": bool(runs[name].correct[i])})
        del runs
    per_case = pd.DataFrame(per_case, columns=["K", "kind", "seed", "case", "lowest_layer", "lowest_neuron",
                                               "zeroed_neuron", "n_upper", "coef_decrease", "correct_after"])
    if per_case.empty:
        return pd.DataFrame(columns=["K", "coef_decrease", "n_cases", "mean_lowest_layer", "random_coef_decrease",
                                     "n_seeds"]), per_case
    low = per_case[per_case.kind == "lowest"]
    summary = low.groupby("K").agg(coef_decrease=("coef_decrease", "mean"), n_cases=("case", "count"),
                                   mean_lowest_layer=("lowest_layer", "mean")).reset_index()
    rnd = per_case[per_case.kind == "random"]
    summary["random_coef_decrease"] = summary["K"].map(rnd.groupby("K")["coef_decrease"].mean()) if len(rnd) \
        else float("nan")
    summary["n_seeds"] = summary["K"].map(rnd.groupby("K")["seed"].nunique()).fillna(0).astype(int) if len(rnd) else 0
    return summary.sort_values("K", ascending=False).reset_index(drop=True), per_case


# --------------------------------------------------------------------------- MLP keys and the PE-DAG


def _mlp_ln(model, layer: int):
    block = model.blocks[layer]
    if getattr(model.cfg, "parallel_attn_mlp", False):
        raise NotImplementedError("MLP keys are defined here for sequential blocks (Llama/Qwen/Mistral/GPT-2)")
    return block.ln2


def mlp_coefficients(model, layer: int, resid_mid: torch.Tensor) -> torch.Tensor:
    """Coefficients m [R, d_mlp] of layer ``layer``'s MLP for residual inputs ``resid_mid``
    [R, d] (its own ln2 and MLP modules, gated or not); differentiable."""
    store = {}

    def grab(act, hook):
        store["m"] = act
        return act

    p = next(model.parameters())
    x = resid_mid.to(device=layer_device(model, layer), dtype=p.dtype)
    with model.hooks(fwd_hooks=[(f"blocks.{layer}.mlp.hook_post", grab)]):
        model.blocks[layer].mlp(_mlp_ln(model, layer)(x[:, None, :]))
    return store["m"][:, 0].float()


def effective_key(model, layer: int, neuron: int, resid_mid: torch.Tensor) -> torch.Tensor:
    """The key of a neuron at a given input: d m_k / d x at ``resid_mid`` [d] (through ln2
    and the gate and up projections). For a ReLU/GELU MLP this is sigma'(.) times the
    fc1 row seen through the norm; for SwiGLU it mixes the gate and up rows by the
    current activations, which is why a gated neuron has no single fixed key."""
    x = resid_mid.detach().float().clone().requires_grad_(True)
    with torch.enable_grad():
        m = mlp_coefficients(model, layer, x[None])[0, neuron]
        (grad,) = torch.autograd.grad(m, x)
    return grad.detach()


def static_keys(model, layer: int, neurons: Sequence[int]) -> dict[str, torch.Tensor]:
    """Fixed key vectors [n, d] of ``neurons``: ``"in"`` = ln2 weight * W_in row (the up
    projection, fc1 of a non-gated MLP) and, for gated MLPs, ``"gate"`` = ln2 weight *
    W_gate row."""
    g = _mlp_ln(model, layer)
    g = wrapped(g).weight.detach().float()
    mlp = model.blocks[layer].mlp  # one layer's weights (the bridge's W_in / W_gate stack every layer)
    keys = {"in": (mlp.W_in.detach().float()[:, list(neurons)].T * g)}
    if getattr(model.cfg, "gated_mlp", False):
        keys["gate"] = mlp.W_gate.detach().float()[:, list(neurons)].T * g
    return keys


@torch.no_grad()
def pe_dag(model, result: CNAResult, case: int, k: int = 10,
           min_enhancement: float = DAG_EDGE_MIN_ENHANCEMENT) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The prediction-enhancing DAG among case ``case``'s top-``k`` neurons (Sec. 4.3).

    For each pair lower (layer l1) -> upper (l2 > l1): the inner products of the lower
    value fc2 with the upper neuron's static keys (W_gate and W_in rows times the ln2
    weight; also as a percentile among all neurons of layer l2), and the direct
    enhancement: the relative drop of the upper coefficient when the lower neuron's
    sub-value m fc2 is removed from the upper layer's input, recomputed exactly through
    ln2 and the MLP (direct path only). ``edge`` marks enhancement >= ``min_enhancement``.
    Returns (nodes, edges)."""
    top = result.top(case, k)
    change = result.change_of(case)
    nodes = pd.DataFrame([{"layer": l, "neuron": n, "name": f"{l}_{n}", "imp": float(result.importance_a[case, l, n]),
                           "change": float(change[l, n]), "coef": float(result.coef_a[case, l, n])}
                          for l, n in top])
    edges = []
    resid = result.run_a.resid_mid[case]
    for l2, n2 in top:
        lower = [(l1, n1) for l1, n1 in top if l1 < l2]
        if not lower:
            continue
        x = resid[l2].to(layer_device(model, l2))
        m2 = mlp_coefficients(model, l2, x[None])[0, n2]
        keys_all = static_keys(model, l2, range(model.cfg.d_mlp))
        for l1, n1 in lower:
            v = mlp_values(model, l1)[n1].to(x.device)
            m1 = result.coef_a[case, l1, n1].to(v.device)
            m2_without = mlp_coefficients(model, l2, (x - m1 * v)[None])[0, n2]
            row = {"lower": f"{l1}_{n1}", "upper": f"{l2}_{n2}", "lower_layer": l1, "upper_layer": l2,
                   "coef_upper": float(m2), "coef_upper_without_lower": float(m2_without),
                   "enhancement": float(torch.sign(m2) * (m2 - m2_without) / m2.abs().clamp_min(1e-8))}
            for kind, keys in keys_all.items():
                dots = keys @ v
                row[f"dot_{kind}"] = float(dots[n2])
                row[f"dot_{kind}_pct"] = float(100 * (dots.abs() < dots[n2].abs()).float().mean())
            row["edge"] = row["enhancement"] >= min_enhancement
            edges.append(row)
    return nodes, pd.DataFrame(edges)


@torch.no_grad()
def pe_dag_cases(model, result: CNAResult, k: int = 10, *, min_enhancement: float = DAG_EDGE_MIN_ENHANCEMENT,
                 seed: int = 0, n_seeds: int = N_RANDOM_SEEDS, progress: bool = True) -> pd.DataFrame:
    """The PE-DAG test of :func:`pe_dag` on every case of ``result`` (Sec. 4.3 asks
    whether prediction enhancing holds beyond "3+5="): for each case and each pair of
    its top-``k`` neurons lower (layer l1) -> upper (l2 > l1), the direct enhancement
    (relative drop of the upper coefficient when the lower neuron's sub-value m fc2 is
    removed from the upper layer's input, exact through ln2 and the MLP). Control, for
    each of ``n_seeds`` draws: the same with a random neuron of layer l1 that is not
    among the case's top-``k`` (its own coefficient in run a) in place of the lower one.

    One row per (case, draw): case, kind ("top" or "random"), seed, n_pairs, n_edges
    (enhancement >= ``min_enhancement``), share_edges, mean_enhancement."""
    cfg = model.cfg
    rows = []
    for case in tqdm(range(len(result)), desc="PE-DAG on every case", disable=not progress, leave=False):
        top = result.top(case, k)
        taken = set(top)
        rng = np.random.default_rng(_seed_of(seed, case, k, 3))
        resid = result.run_a.resid_mid[case]
        coef = result.coef_a[case]
        enh: dict[str, list[float]] = {"top": [], **{f"random|{s}": [] for s in range(n_seeds)}}
        for l2, n2 in top:
            lower = [(l1, n1) for l1, n1 in top if l1 < l2]
            if not lower:
                continue
            subs = [lower]
            for _ in range(n_seeds):
                draw = []
                for l1, _n in lower:
                    while True:
                        cand = (l1, int(rng.integers(cfg.d_mlp)))
                        if cand not in taken:
                            draw.append(cand)
                            break
                subs.append(draw)
            flat = [nr for draw in subs for nr in draw]
            device = layer_device(model, l2)
            vals = torch.stack([(v * coef[l1, n1].to(v.device)).to(device)
                                for l1, n1 in flat for v in [mlp_values(model, l1)[n1]]])
            x = resid[l2].to(device)
            m = mlp_coefficients(model, l2, torch.cat([x[None], x[None] - vals]))[:, n2]
            m2, without = m[0], m[1:]
            e = (torch.sign(m2) * (m2 - without) / m2.abs().clamp_min(1e-8)).cpu().view(len(subs), len(lower))
            enh["top"] += e[0].tolist()
            for s in range(n_seeds):
                enh[f"random|{s}"] += e[1 + s].tolist()
        for name, vals_ in enh.items():
            kind, _, s = name.partition("|")
            v = np.asarray(vals_, dtype=float)
            rows.append({"case": case, "kind": kind, "seed": int(s) if s else float("nan"), "n_pairs": len(v),
                         "n_edges": int((v >= min_enhancement).sum()),
                         "share_edges": float((v >= min_enhancement).mean()) if len(v) else float("nan"),
                         "mean_enhancement": float(v.mean()) if len(v) else float("nan")})
    return pd.DataFrame(rows)


# --------------------------------------------------------------------------- vocabulary and OV projections


def vocab_logits(model, vectors: torch.Tensor) -> torch.Tensor:
    """Projection of residual-space vectors [n, d] on the vocabulary, E_u v, through the
    final norm's weight (scale-free: the norm's 1/rms does not change the ranking)."""
    norm = final_norm(model)
    W_U, _ = unembedding(model)
    return (vectors.float().to(W_U.device) * norm.weight) @ W_U


def top_tokens(model, tokenizer, vectors: torch.Tensor, k: int = 10) -> list[list[str]]:
    """The ``k`` top tokens of softmax(E_u v) for each vector (Geva et al. 2022; Yu Table 4)."""
    idx = vocab_logits(model, vectors).topk(k, dim=-1).indices.cpu().tolist()
    return [[tokenizer.decode([i]).strip() or repr(tokenizer.decode([i])) for i in row] for row in idx]


def layer_ov(model, layer: int, heads: Sequence[int] | None = None) -> torch.Tensor:
    """The OV map of attention layer ``layer`` as a [d, d] matrix acting on row vectors:
    x -> (g1 * x) sum_h W_V^h W_O^h (``heads`` None: all heads, the layer's value-output
    matrices as in Yu Sec. 4.4), with ln1's weight g1 folded in, grouped-query KV heads
    expanded, value biases left out (they do not depend on the source token)."""
    attn = model.blocks[layer].attn  # one layer's weights (the bridge's W_V / W_O stack every layer)
    W_V = attn.W_V.detach().float()  # [n_kv, d, d_head] (or [H, ...])
    W_O = attn.W_O.detach().float()  # [H, d_head, d]
    H = W_O.shape[0]
    group = H // W_V.shape[0]
    heads = range(H) if heads is None else heads
    ov = sum(W_V[h // group] @ W_O[h] for h in heads)
    ln1 = model.blocks[layer].ln1
    g = wrapped(ln1).weight.detach().float()
    return g[:, None] * ov


#: Number and operation concepts (Yu Sec. 4.4: a hidden-interpretable neuron's top-50
#: tokens hold >= M "concepts related to numbers or operations"). Restricted to numbers
#: and operations: a token counts when its text, stripped of spaces, is a digit string
#: (any length, as its number), an English number word 0-19, a tens word, "hundred" or
#: "thousand" (case-insensitive), or an operator symbol or operation word; each maps to
#: a concept and distinct concepts are counted. Foreign numerals, Roman numerals,
#: ordinals and multiples ("twice", "dozen") are NOT concepts here: counting them made
#: 12 % of SmolLM2's / Qwen's shallow neurons qualify at M = 2 against Yu's 1.1 %.
NUMBER_WORDS_EN = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven",
                   "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen"]
TENS_EN = {20: "twenty", 30: "thirty", 40: "forty", 50: "fifty", 60: "sixty", 70: "seventy", 80: "eighty",
           90: "ninety", 100: "hundred", 1000: "thousand"}
OPERATION_WORDS = {
    "add": ["+", "plus", "add", "adding", "added", "addition", "sum"],
    "sub": ["-", "−", "minus", "subtract", "subtracting", "subtracted", "subtraction", "difference"],
    "mul": ["*", "×", "times", "multiply", "multiplying", "multiplied", "multiplication", "product"],
    "div": ["/", "÷", "divide", "divides", "dividing", "divided", "division", "ratio", "quotient"],
}


def concept_of(text: str) -> str | None:
    """The number/operation concept a token's text stands for ("num:8", "op:add"), or
    None (the restricted list above: digits, English number words, operators)."""
    t = text.strip()
    if not t:
        return None
    if t.isascii() and t.isdigit():
        return f"num:{int(t)}"
    low = t.lower()
    if low in NUMBER_WORDS_EN:
        return f"num:{NUMBER_WORDS_EN.index(low)}"
    for value, word in TENS_EN.items():
        if low == word:
            return f"num:{value}"
    for op, words in OPERATION_WORDS.items():
        if low in words:
            return f"op:{op}"
    return None


def concept_tokens(tokenizer, vocab_size: int | None = None) -> dict[int, str]:
    """Token id -> concept for every vocabulary token whose text is a number/operation concept.

    ``vocab_size`` (the model's, default the tokenizer's) may exceed the tokenizer's
    length (embedding rows padded past its vocabulary): fast tokenizers decode those ids
    to "", sentencepiece ones raise an IndexError, and either way they are no concept.
    Any other failure, or an IndexError on an id the tokenizer has, propagates."""
    n = vocab_size or len(tokenizer)
    known = len(tokenizer)
    out = {}
    for i in range(n):
        try:
            text = tokenizer.decode([i])
        except IndexError:
            if i < known:
                raise
            continue
        c = concept_of(text)
        if c is not None:
            out[i] = c
    return out


@torch.no_grad()
def concept_counts(vectors: torch.Tensor, W: torch.Tensor, concepts: Mapping[int, str], k: int = 50,
                   min_count: int | torch.Tensor = 1, vocab_chunk: int = 8192, row_chunk: int = 4096,
                   n_sample: int = 256, seed: int = 0, progress: bool = False) -> torch.Tensor:
    """Number of distinct concepts among the top-``k`` tokens of ``vectors @ W`` ([n, d] @
    [d, V]), exact for every row whose count is >= ``min_count`` (an int, or one value per
    row); rows below it get 0.

    Pruned exact search: the concept tokens' logits are computed first; the vocabulary
    is then scanned in chunks keeping each row's running top-k, whose k-th value only
    rises; a row whose concepts all fall below it can no longer reach ``min_count`` and
    is dropped. Rows that survive have seen the whole vocabulary. The scan order (any
    order gives the same result) puts first the tokens most often in the top-k of
    ``n_sample`` random rows, so that the k-th value rises early."""
    device = W.device
    ids = torch.tensor(sorted(concepts), dtype=torch.long, device=device)
    names = sorted(set(concepts.values()))
    onehot = torch.zeros(len(ids), len(names), device=device)
    for j, i in enumerate(ids.tolist()):
        onehot[j, names.index(concepts[i])] = 1.0
    V = W.shape[1]
    gen = torch.Generator().manual_seed(seed)
    freq = torch.zeros(V)
    if n_sample > 0 and vectors.shape[0] > 0:
        pick = torch.randperm(vectors.shape[0], generator=gen)[:n_sample]
        sample = vectors[pick].float().to(device)
        running = torch.full((len(pick), k), -torch.inf, device=device)
        running_i = torch.zeros((len(pick), k), dtype=torch.long, device=device)
        for v0 in range(0, V, vocab_chunk):
            z = sample @ W[:, v0:v0 + vocab_chunk]
            vals, idx = torch.cat([running, z], 1).topk(k, dim=1)
            running_i = torch.cat([running_i, torch.arange(v0, v0 + z.shape[1], device=device).expand(len(pick), -1)],
                                  1).gather(1, idx)
            running = vals
        freq = torch.bincount(running_i.flatten().cpu(), minlength=V).float()
    order = torch.argsort(-(freq + 0.5 * torch.rand(V, generator=gen))).to(device)
    # the scan's vocabulary chunks and the concept columns, gathered once for all row chunks
    W_chunks = [W[:, order[v0:v0 + vocab_chunk]] for v0 in range(0, V, vocab_chunk)]
    W_concepts = W[:, ids]
    out = torch.zeros(vectors.shape[0], dtype=torch.long)
    need_all = (torch.as_tensor(min_count, dtype=torch.long).expand(vectors.shape[0]).to(device)
                if not isinstance(min_count, int) else torch.full((vectors.shape[0],), min_count, device=device))
    if len(need_all) != vectors.shape[0]:
        raise ValueError(f"min_count has {len(need_all)} values for {vectors.shape[0]} rows")

    def distinct(mask):
        return ((mask.float() @ onehot) > 0).sum(-1)

    for r0 in tqdm(range(0, vectors.shape[0], row_chunk), desc="concept counts", disable=not progress, leave=False):
        Y = vectors[r0:r0 + row_chunk].float().to(device)
        need = need_all[r0:r0 + row_chunk]
        zS = Y @ W_concepts
        active = torch.arange(Y.shape[0], device=device)
        active = active[need <= len(names)]  # a row needing more concepts than exist cannot qualify
        topv = torch.full((Y.shape[0], k), -torch.inf, device=device)
        for Wc in W_chunks:
            if active.numel() == 0:
                break
            z = Y[active] @ Wc
            merged = torch.cat([topv[active], z], 1).topk(k, dim=1).values
            topv[active] = merged
            ub = distinct(zS[active] >= merged[:, -1:])
            active = active[ub >= need[active]]
        if active.numel():
            out[r0 + active.cpu()] = distinct(zS[active] >= topv[active, -1:]).cpu()
    return out


def layer_ov_factors(model, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(A [d, r], B [r, d])`` with ``A @ B`` = :func:`layer_ov` (all heads): A stacks
    the ln1-weighted value matrices of the KV heads, B the sum of the output matrices
    of the query heads that share each KV head, so r = n_kv_heads x d_head, the OV
    map's rank (128 of 896 for Qwen2.5-0.5B). Projections through the factors cost r/d
    of the full map's. When r >= d: ``(layer_ov, identity)``."""
    attn = model.blocks[layer].attn
    W_V = attn.W_V.detach().float()  # [n_kv, d, d_head]
    W_O = attn.W_O.detach().float()  # [H, d_head, d]
    n_kv, d = W_V.shape[0], W_V.shape[1]
    group = W_O.shape[0] // n_kv
    if n_kv * W_V.shape[2] >= d:
        ov = layer_ov(model, layer)
        return ov, torch.eye(d, device=ov.device)
    ln1 = model.blocks[layer].ln1
    g = wrapped(ln1).weight.detach().float()
    A = torch.cat([g[:, None] * W_V[kv] for kv in range(n_kv)], 1)
    B = torch.cat([W_O[kv * group:(kv + 1) * group].sum(0) for kv in range(n_kv)], 0)
    return A, B


@torch.no_grad()
def shallow_concept_counts(model, tokenizer, head_layer: int, k: int = 50,
                           concepts: Mapping[int, str] | None = None, cap: int | None = None, seed: int = 0,
                           progress: bool = True) -> pd.DataFrame:
    """Table 8 / 17 candidates (Yu Sec. 4.4): every FFN neuron of layers 0..head_layer-1,
    its value vector carried through the OV map (value-output matrices of all heads,
    ln1 weight folded in, :func:`layer_ov`) of every attention layer j that can read it,
    l < j <= head_layer (attention j runs before MLP j in a block, so attention l cannot
    read MLP l; Yu: neurons of layers 0-15, attention layers "0-16", key head in 17),
    each projection put on the vocabulary through the final norm's weight and W_U
    (:func:`vocab_logits`), and the number of distinct number/operation concepts
    (:func:`concept_of`) among its top-``k`` tokens counted. A neuron's ``n_concepts``
    is the largest count over those layers (it qualifies at M when ANY projection
    holds >= M concepts); ``ov_layer`` the first layer reaching it (-1: no concept).

    Fast: the OV maps through their rank-r factors (:func:`layer_ov_factors`), every
    neuron of a source layer in one matrix product per attention layer, the top-k over
    the vocabulary in chunks with pruning (:func:`concept_counts`: a neuron is scanned
    through layer j only while it can still beat its best count so far). ``cap``: a
    neuron that reached ``cap`` concepts is not scanned again (its n_concepts is then
    >= cap, exact below it). Rows: layer, neuron, n_concepts, ov_layer."""
    if head_layer < 1:
        raise ValueError("the key head is in layer 0: there are no shallower FFN layers")
    if head_layer >= _n_layers(model):
        raise ValueError(f"head_layer {head_layer} is not a layer of this {_n_layers(model)}-layer model")
    concepts = concept_tokens(tokenizer, model.cfg.d_vocab) if concepts is None else concepts
    norm = final_norm(model)
    W_U, _ = unembedding(model)
    values = [w_out(model, layer).to(W_U.device) for layer in range(head_layer)]
    factors = [layer_ov_factors(model, j) for j in range(1, head_layer + 1)]
    best, best_j = ov_concept_counts(values, factors, norm.weight, W_U, concepts, k=k, cap=cap, seed=seed,
                                     progress=progress)
    K = model.cfg.d_mlp
    idx = torch.arange(len(best))
    return pd.DataFrame({"layer": (idx // K).numpy(), "neuron": (idx % K).numpy(), "n_concepts": best.numpy(),
                         "ov_layer": best_j.numpy()})


@torch.no_grad()
def ov_concept_counts(values: Sequence[torch.Tensor], factors: Sequence[tuple[torch.Tensor, torch.Tensor]],
                      norm_weight: torch.Tensor, W_U: torch.Tensor, concepts: Mapping[int, str], k: int = 50,
                      cap: int | None = None, seed: int = 0, progress: bool = False
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """The computation of :func:`shallow_concept_counts` on tensors: ``values[l]`` [K, d]
    are the value vectors of MLP layer l (l = 0..H-1), ``factors[j - 1] = (A_j, B_j)``
    the OV map of attention layer j (j = 1..H) as A_j @ B_j. For each neuron of layer l
    the largest count, over j = l+1..H, of distinct concepts among the top-``k`` tokens
    of ((v A_j B_j) * ``norm_weight``) @ ``W_U``, and the first j reaching it (-1 when
    0). Returns (counts [H*K], layers [H*K]), rows layer-major."""
    H = len(values)
    if len(factors) != H:
        raise ValueError(f"{len(factors)} OV maps for {H} source layers: need attention layers 1..{H}")
    n_names = len(set(concepts.values()))
    stacked = torch.cat(list(values))
    sizes = [v.shape[0] for v in values]
    best = torch.zeros(stacked.shape[0], dtype=torch.long)
    best_j = torch.full((stacked.shape[0],), -1, dtype=torch.long)
    for j in tqdm(range(1, H + 1), desc="shallow OV projections", disable=not progress, leave=False):
        rows = sum(sizes[:j])  # neurons of MLP layers 0..j-1, which attention layer j reads
        A, B = factors[j - 1]
        W = (B.to(W_U.device) * norm_weight) @ W_U
        need = best[:rows] + 1
        if cap is not None:
            need = torch.where(best[:rows] >= cap, torch.full_like(need, n_names + 1), need)
        c = concept_counts(stacked[:rows] @ A.to(stacked.device), W, concepts, k=k, min_count=need, seed=seed)
        better = c > best[:rows]
        best[:rows] = torch.where(better, c, best[:rows])
        best_j[:rows] = torch.where(better, torch.full_like(c, j), best_j[:rows])
    return best, best_j


def hidden_interpretable_table(model, prompts: PromptSet, counts: pd.DataFrame, ms: Sequence[int] = (0, 1, 2, 3), *,
                               seed: int = 0, n_seeds: int = N_RANDOM_SEEDS, control_ms: Sequence[int] | None = None,
                               batch_size: int = 32, targets: torch.Tensor | None = None,
                               progress: bool = True) -> pd.DataFrame:
    """Table 8 / 17 on every case of ``prompts``: for each M, zero (at every position) all
    shallow neurons whose projection holds >= M concepts (``counts``:
    :func:`shallow_concept_counts`), and, ``n_seeds`` times, as many neurons drawn at
    random from the same shallow layers (``n_seeds`` draws at the M of ``control_ms``,
    default every M; one draw, as Yu's Table 8, at the others: each draw is a forward
    pass of every prompt); accuracy decrease (%) on ``prompts``.

    One row per (M, set, seed; seed NaN for the hidden-interpretable set): n_neurons,
    share_of_shallow, n_shallow, n_more_than_m (neurons with > M concepts: Table 8's
    M = 0 row, 51,980 of 176,128, cannot be ">= 0", so the paper may count "> M"),
    paper_n and paper_share (Table 8's neuron count at M and its share of 176,128),
    accuracy, accuracy_decrease, base_accuracy, n_cases and per-case correctness
    (``correct_by_prompt``). A neuron set equal to one already run (at M = 0 every set
    is every shallow neuron) is run once; the runs share passes (:func:`run_conditions`)."""
    if n_seeds < 1:
        raise ValueError(f"n_seeds must be >= 1 (random controls), got {n_seeds}")
    pool = list(zip(counts.layer.tolist(), counts.neuron.tolist()))
    plan = []   # (M, kind, seed, neuron set)
    for m in ms:
        chosen = counts[counts.n_concepts >= m]
        neurons = list(zip(chosen.layer.tolist(), chosen.neuron.tolist()))
        plan.append((m, "hidden-interpretable", None, neurons))
        for s in range(n_seeds if control_ms is None or m in control_ms else 1):
            rng = np.random.default_rng(_seed_of(seed, s, m, 4))
            pick = rng.choice(len(pool), size=len(neurons), replace=False) if neurons else []
            plan.append((m, "random", s, [pool[i] for i in pick]))
    distinct = list(dict.fromkeys(frozenset(ns) for *_, ns in plan if ns))
    runs = run_conditions(model, prompts, {"base": None, **{str(j): zero_neurons_hooks(sorted(key))
                                                            for j, key in enumerate(distinct)}},
                          capture=(), targets=targets, batch_size=batch_size, progress=progress, desc="M sweep")
    base = runs["base"].accuracy
    run_of = {frozenset(): runs["base"], **{key: runs[str(j)] for j, key in enumerate(distinct)}}
    paper_n, total = YU_CNA_TABLES["M_neurons"], YU_CNA_TABLES["shallow_total"]
    rows = []
    for m, kind, s, ns in plan:
        run = run_of[frozenset(ns)]
        acc = run.accuracy
        rows.append({"M": m, "set": kind, "seed": float("nan") if s is None else s, "n_neurons": len(ns),
                     "share_of_shallow": len(ns) / max(1, len(pool)), "n_shallow": len(pool),
                     "n_more_than_m": int((counts.n_concepts > m).sum()),
                     "paper_n": paper_n.get(m, float("nan")),
                     "paper_share": paper_n[m] / total if m in paper_n else float("nan"),
                     "accuracy": acc, "accuracy_decrease": 100 * (base - acc) / base if base > 0 else float("nan"),
                     "base_accuracy": base, "n_cases": len(prompts),
                     "correct_by_prompt": encode_correct(run.correct.cpu().numpy())})
    return pd.DataFrame(rows)


@torch.no_grad()
def operand_positions(prompts: PromptSet, i: int) -> dict[str, int]:
    """Positions of operand A and B of 1-token-operand case ``i`` in its query (the last
    occurrences, B after A), found from the decoded tokens. An operand that is not one
    token (a 2-digit operand under a per-digit tokenizer such as Qwen's:
    :func:`datasets.require_single_token_operands`) or not a token of its own in the
    prompt (number words) raises a ValueError naming the prompt."""
    rec = prompts.records[i]
    texts = [prompts.tokenizer.decode([t]).strip() for t in prompts.input_ids[i]]

    def last(name: str, value: int, end: int) -> int:
        hits = [j for j, t in enumerate(texts[:end]) if t == str(value)]
        if not hits:
            ds.require_single_token_operands(prompts.subset([i]))
            raise ValueError(f"operand {name} = {value} of case {i} ({rec.text!r}) is not a token of its own in the "
                             f"prompt{' before operand B' if end < len(texts) else ''} (tokens {texts[-12:]} at the "
                             "end): operand_positions needs operands written in digits, one token each; use "
                             "1-digit prompts (e.g. yu_prompts(n_digits=1, numerals='digits'))")
        return hits[-1]

    pos_b = last("B", rec.b, len(texts))
    return {"A": last("A", rec.a, pos_b), "B": pos_b}


@torch.no_grad()
def shallow_neuron_examples(model, prompts: PromptSet, case: int, key: torch.Tensor, head_layer: int, n: int = 5,
                            n_tokens: int = 10) -> pd.DataFrame:
    """Table 7: the shallow neurons (layers < ``head_layer``) on the operand positions of
    case ``case`` whose sub-value, carried by attention layer ``head_layer``'s OV map,
    has the largest inner product with ``key`` (the PE-DAG root's effective key):
    score = m_k(pos) (OV fc2_k) . key / rms(x_pos). With each neuron's top tokens before
    (E_u fc2_k) and after (E_u OV fc2_k) the transformation, and the same for the
    operand tokens' word embeddings."""
    tok = prompts.tokenizer
    device = input_device(model)
    pos = operand_positions(prompts, case)
    store = {}

    def grab(name):
        def fn(act, hook):
            store[name] = act[0].detach().float()
            return act
        return fn

    tokens = torch.tensor([prompts.input_ids[case]], device=device)
    hooks = [(f"blocks.{l}.mlp.hook_post", grab(l)) for l in range(head_layer)]
    hooks.append((f"blocks.{head_layer}.hook_resid_pre", grab("resid")))
    with model.hooks(fwd_hooks=hooks):
        forward(model, tokens, keep=1)
    ov = layer_ov(model, head_layer)
    u = ov @ key.float().to(ov.device)  # score of a source vector x: (x OV) . key = x . u
    rows = []
    for name, p in pos.items():
        rms = store["resid"][p].pow(2).mean().sqrt()
        for layer in range(head_layer):
            s = store[layer][p] * (mlp_values(model, layer) @ u) / rms
            for j in s.topk(min(n, s.numel())).indices.tolist():
                rows.append({"operand": name, "position": p, "layer": layer, "neuron": j, "name": f"{layer}_{j}",
                             "coef": float(store[layer][p, j]), "score": float(s[j])})
    frame = pd.DataFrame(rows).sort_values("score", ascending=False).head(n).reset_index(drop=True)
    vecs = torch.stack([mlp_values(model, l)[j] for l, j in zip(frame.layer, frame.neuron)])
    frame["tokens_before"] = [", ".join(t) for t in top_tokens(model, tok, vecs, n_tokens)]
    frame["tokens_after_attention"] = [", ".join(t) for t in top_tokens(model, tok, vecs @ ov, n_tokens)]
    emb_rows = []
    W_E = model.W_E.detach().float()
    for name, p in pos.items():
        tid = prompts.input_ids[case][p]
        e = W_E[tid][None]
        emb_rows.append({"operand": name, "position": p, "layer": -1, "neuron": -1,
                         "name": f"word {tok.decode([tid]).strip()!r}", "coef": float("nan"),
                         "score": float(((e @ ov) @ key.float().to(ov.device)).item() / store["resid"][p].pow(2).mean().sqrt()),
                         "tokens_before": ", ".join(top_tokens(model, tok, e, n_tokens)[0]),
                         "tokens_after_attention": ", ".join(top_tokens(model, tok, e @ ov, n_tokens)[0])})
    return pd.concat([frame, pd.DataFrame(emb_rows)], ignore_index=True)
