"""Yu & Ananiadou's head sweep (Sec. 3.2-3.4, App. E, Tables 1-3, 24-27): set one
attention head's parameters to zero, so its output is zero at **every position**, and
measure first-token accuracy per operator and digit count.

Zeroing a head at every position changes the keys and values of every later layer at
every position, so the answer-position shortcut of :mod:`arithlib.methods.patching` does not
apply. What stays exact and cheaper (:func:`zeroed_head_states`):

* everything below the head's layer is the clean run: each pass starts at that layer
  from the recorded residual stream;
* the few-shot prefix, shared by every prompt of an operator, is recomputed once per
  head (batch 1), and the prompts run only their query tokens on top of that
  head-ablated prefix's keys and values;
* all heads of a layer run in one batch (heads x prompts rows).

:func:`arithlib.methods.knockouts.head_sweep` with ``position=None`` (every position recomputed
per prompt) is the reference this is tested equal to, and the baseline of
``benchmarks/head_sweep.py``.

An exact sweep of every head on every prompt costs heads x prompts x query tokens of
forward passes, beyond a 2-core CPU for Qwen2.5-0.5B (336 heads, 1,078 prompts). So
:func:`yu_head_sweep` runs in two stages, both with Yu's intervention (every position):

1. **screen**: every head on ``screen_n`` prompts per setting (operator x digit
   count), ranked by accuracy drop, ties broken by the mean decrease of the answer
   token's logit, then by (layer, head);
2. **exact**: the ``top_k`` screened heads of every setting on all of the setting's
   prompts. Only stage-2 numbers are reported as the sweep's result.

:func:`sweep_recall` measures how many of the exact top heads of a setting the screen
finds, from an exact sweep of every head on that setting.

On a 2-core CPU the sweep of Qwen2.5-0.5B takes hours, longer than a working session:
with ``cache_dir`` (a folder or a :class:`~arithlib.run.stored.Store`) every batch's rows are
stored as they are computed (keyed by the model's weights, the batch's tokens, the heads,
the device, dtype and torch threads, and :data:`SWEEP_CACHE_FORMAT`), so a run that is stopped
resumes where it stopped, with the same numbers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from tqdm.auto import tqdm

from ..core.components import Head
from ..core.prompt_sets import PromptSet
from ..engine import (
    cache_of,
    clean_run,
    common_prefix,
    decoder_norm,
    input_device,
    keys_values_from,
    layer_device,
    resumable,
    run_from,
)
from ..methods.knockouts import head_sweep
from ..methods.patching import Component, Edit, Unembed, variant_hooks
from ..run.fingerprints import fingerprint, model_fingerprint, tensor_fingerprint
from ..run.stored import Store

#: Rows x positions of one batched pass (heads x prompts x query tokens); bounds memory.
MAX_TOKENS = 8192

#: Version of the cached batch rows; raise it when the engine's numbers change.
SWEEP_CACHE_FORMAT = 1

#: Columns of a per-(head, prompt) sweep table.
ROW_COLUMNS = [
    "prompt",
    "op",
    "n_digits",
    "layer",
    "head",
    "correct",
    "clean_correct",
    "answer_logit",
    "clean_answer_logit",
]


def _zero_variants(layer: int, heads: Sequence[int], positions: Sequence[int] | None) -> list[list[Edit]]:
    return [
        [Edit(Component("head", layer, h), p, 0.0) for p in (positions if positions is not None else [None])]
        for h in heads
    ]


@torch.no_grad()
def zeroed_head_states(
    model, tokens: torch.Tensor, heads: Sequence[Head], max_tokens: int = MAX_TOKENS, prefix_store: dict | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Final-normed hidden state at the last position of every prompt of ``tokens``
    [B, T] (same-length rows) with each head of ``heads`` zeroed at every position:
    ``[len(heads), B, d_model]``, and the clean states ``[B, d_model]``.

    The rows' common prefix (the few-shot lines) runs once per head; each head's pass
    starts at its layer from the clean residual stream. ``prefix_store`` (a dict) keeps
    each head's ablated prefix keys and values for later calls whose rows share the same
    prefix (e.g. 1-, 2- and 3-digit prompts of one operator). Llama-style models only
    (:func:`arithlib.engine.resumable`)."""
    if not resumable(model):
        raise ValueError(
            "zeroed_head_states needs a Llama-style model (arithlib.engine.resumable); "
            "use arithlib.methods.knockouts.head_sweep(position=None) for others"
        )
    tokens = tokens.to(input_device(model))
    B, T = tokens.shape
    rows = tokens.tolist()
    n = min(common_prefix(rows), T - 1)
    full = clean_run(model, tokens)  # resid [L, B, T, d] (prefix shared inside)
    pre = clean_run(model, tokens[:1, :n], share_prefix=False) if n else None  # (cheap: one row)
    q = T - n
    out = torch.empty(len(heads), B, full.final.shape[-1], dtype=full.final.dtype, device=full.final.device)
    order = sorted(range(len(heads)), key=lambda i: heads[i])
    by_layer: dict[int, list[int]] = {}
    for i in order:
        by_layer.setdefault(int(heads[i][0]), []).append(i)
    per_pass = max(1, max_tokens // max(1, B * q))
    for layer, idx in by_layer.items():
        for s in range(0, len(idx), per_pass):
            chunk = idx[s : s + per_pass]
            V = len(chunk)
            hs = [int(heads[i][1]) for i in chunk]
            prefix_kv = None
            if n:  # the prefix with the head zeroed, one row per head
                key = (tuple(rows[0][:n]), layer, tuple(hs))
                prefix_kv = prefix_store.get(key) if prefix_store is not None else None
                if prefix_kv is None:
                    with model.hooks(fwd_hooks=variant_hooks(model, _zero_variants(layer, hs, None), 1, 0, n)):
                        prefix_kv = keys_values_from(
                            model, pre.resid[layer].to(layer_device(model, layer)).repeat(V, 1, 1), layer
                        )
                    if prefix_store is not None:
                        prefix_store[key] = prefix_kv
            cache = cache_of(model, prefix_kv, first=layer, rows=B)
            hidden = full.resid[layer][:, n:].to(layer_device(model, layer)).repeat(V, 1, 1)  # variant-major
            hooks = variant_hooks(model, _zero_variants(layer, hs, range(n, T)), B, n, T)
            with model.hooks(fwd_hooks=hooks):
                h = run_from(model, hidden, layer, n, cache)
            out[chunk] = decoder_norm(model, h[:, -1:])[:, 0].view(V, B, -1).to(out.device)
    return out, full.final


@torch.no_grad()
def _batch_key(model_fp: str, model, batch, heads: Sequence[Head]) -> str:
    """Cache key of one batch's rows (module docstring)."""
    p = next(iter(model.parameters()))
    return fingerprint(
        {
            "what": "exact_head_sweep batch",
            "format": SWEEP_CACHE_FORMAT,
            "model": model_fp,
            "tokens": tensor_fingerprint(batch.tokens, batch.answer_ids, torch.as_tensor(batch.index)),
            "heads": [list(h) for h in heads],
            "device": str(p.device),
            "dtype": str(p.dtype),
            "threads": torch.get_num_threads(),
        }
    )


def exact_head_sweep(
    model,
    prompts: PromptSet,
    heads: Sequence[Head] | None = None,
    batch_size: int = 128,
    progress: bool = True,
    desc: str = "head sweep (every position)",
    cache_dir: str | Path | Store | None = None,
) -> pd.DataFrame:
    """Every head of ``heads`` (default: all) zeroed at every position on every prompt
    (Yu Sec. 3.2). One row per (head, prompt): :data:`ROW_COLUMNS` plus ``template_id``,
    ``case``. ``correct``: the answer's first token is the argmax (exact, via
    :meth:`Unembed.top1`); ``answer_logit``: its logit. ``cache_dir``: store each batch's
    rows there and reuse them (a stopped run resumes; module docstring); a
    :class:`~arithlib.run.stored.Store` also counts the reused batches' compute time."""
    cfg = model.cfg
    heads = (
        [tuple(map(int, h)) for h in heads]
        if heads is not None
        else [(l, h) for l in range(cfg.n_layers) for h in range(cfg.n_heads)]
    )
    if not resumable(model):  # same intervention and numbers, every position recomputed per prompt
        return _reference_rows(model, prompts, heads, batch_size, progress)
    unembed = Unembed(model)
    frames = []
    batches = list(prompts.batches(batch_size, by_prefix=True))
    prefix_store: dict = {}
    store = cache_dir if isinstance(cache_dir, Store) else Store(cache_dir)
    model_fp = model_fingerprint(model) if store.directory is not None else ""
    for batch in tqdm(batches, desc=desc, disable=not progress, leave=False):
        path = (
            store.directory / f"{_batch_key(model_fp, model, batch, heads)}.pkl"
            if store.directory is not None
            else None
        )
        # a stopped run never leaves half a batch (Store writes atomically)
        frames.append(store.at(path, lambda: _batch_rows(model, prompts, batch, heads, unembed, prefix_store)))
    rows = pd.concat(frames, ignore_index=True)
    return rows.sort_values(["layer", "head", "prompt"]).reset_index(drop=True)


def _batch_rows(
    model, prompts: PromptSet, batch, heads: Sequence[Head], unembed: Unembed, prefix_store: dict
) -> pd.DataFrame:
    """The sweep's rows of one batch (:func:`exact_head_sweep`)."""
    batch_frames = []
    h, clean = zeroed_head_states(model, batch.tokens, heads, prefix_store=prefix_store)
    ans = batch.answer_ids.to(unembed.device)
    clean_logits = unembed.logits(clean)
    pred, _ = unembed.top1(h, clean, clean_logits, hint_ids=ans)
    a_logit = unembed.token_logits(h, ans)
    c_pred = clean_logits.argmax(-1)
    c_logit = clean_logits.gather(1, ans[:, None])[:, 0]
    idx = [int(i) for i in batch.index]
    meta = pd.DataFrame(
        {
            "prompt": idx,
            "op": [prompts.records[i].op for i in idx],
            "n_digits": [prompts.records[i].n_digits for i in idx],
            "template_id": [prompts.records[i].template_id for i in idx],
            "case": [prompts.records[i].get("case", "") for i in idx],
            "clean_correct": (c_pred == ans).cpu().numpy(),
            "clean_answer_logit": c_logit.cpu().numpy(),
        }
    )
    for j, (layer, head) in enumerate(heads):
        f = meta.copy()
        f["layer"], f["head"] = layer, head
        f["correct"] = (pred[j] == ans).cpu().numpy()
        f["answer_logit"] = a_logit[j].cpu().numpy()
        batch_frames.append(f)
    return pd.concat(batch_frames, ignore_index=True)


def _reference_rows(model, prompts: PromptSet, heads: Sequence[Head], batch_size: int, progress: bool) -> pd.DataFrame:
    rows = head_sweep(model, prompts, heads=heads, position=None, batch_size=min(batch_size, 16), progress=progress)
    rows["answer_logit"] = np.nan
    rows["clean_answer_logit"] = np.nan
    return rows.sort_values(["layer", "head", "prompt"]).reset_index(drop=True)


def setting_accuracy(rows: pd.DataFrame, by: Sequence[str] = ("op", "n_digits")) -> pd.DataFrame:
    """Per head and setting: ``accuracy``, ``baseline_accuracy``, ``accuracy_drop``,
    ``relative_drop`` (1 - after / before, Yu's Table 2), ``logit_drop`` (mean decrease
    of the answer logit), ``n``, and the exact 95 % binomial interval of ``accuracy``."""
    from ..core.stats import binomial_ci

    keys = list(by) + ["layer", "head"]
    g = (
        rows.assign(_drop=rows["clean_answer_logit"] - rows["answer_logit"])
        .groupby(keys)
        .agg(
            correct=("correct", "sum"),
            clean=("clean_correct", "sum"),
            n=("correct", "size"),
            logit_drop=("_drop", "mean"),
        )
        .reset_index()
    )
    g["accuracy"] = g["correct"] / g["n"]
    g["baseline_accuracy"] = g["clean"] / g["n"]
    g["accuracy_drop"] = g["baseline_accuracy"] - g["accuracy"]
    g["relative_drop"] = np.where(g["clean"] > 0, 1 - g["correct"] / g["clean"].where(g["clean"] > 0), np.nan)
    cis = [binomial_ci(int(c), int(n)) for c, n in zip(g["correct"], g["n"])]
    g["accuracy_low"] = [c.low for c in cis]
    g["accuracy_high"] = [c.high for c in cis]
    return g.drop(columns=["correct", "clean"])


def rank_heads(acc: pd.DataFrame, by: Sequence[str] = ("op", "n_digits")) -> pd.DataFrame:
    """``acc`` (:func:`setting_accuracy`) ranked within each setting: largest
    ``accuracy_drop`` first, ties broken by the larger ``logit_drop``, then by the lower
    (layer, head); adds ``rank`` (1 = most damaging)."""
    keys = list(by)
    out = acc.assign(_ld=acc["logit_drop"].fillna(-np.inf)).sort_values(
        keys + ["accuracy_drop", "_ld", "layer", "head"], ascending=[True] * len(keys) + [False, False, True, True]
    )
    out["rank"] = out.groupby(keys).cumcount() + 1
    return out.drop(columns="_ld").reset_index(drop=True)


def sample_settings(prompts: PromptSet, n: int, seed: int, by: Sequence[str] = ("op", "n_digits")) -> PromptSet:
    """At most ``n`` prompts per setting, drawn with ``seed`` (all of a smaller setting)."""
    rng = np.random.default_rng(seed)
    frame = pd.DataFrame({k: [getattr(r, k) for r in prompts.records] for k in by})
    keep: list[int] = []
    for _, g in frame.groupby(list(by), sort=True):
        idx = g.index.to_numpy()
        keep += sorted(rng.choice(idx, size=min(n, len(idx)), replace=False).tolist())
    return prompts.subset(sorted(keep))


@dataclass
class HeadSweep:
    """:func:`yu_head_sweep`'s result."""

    screen: pd.DataFrame  # every head, screen_n prompts per setting: rank_heads rows
    exact: pd.DataFrame  # the top_k screened heads per setting on all its prompts: rank_heads rows
    rows: pd.DataFrame  # per (head, prompt) rows of the exact stage (for bootstrap intervals)
    screen_n: int
    top_k: int

    def top(self, n: int = 5) -> pd.DataFrame:
        """The ``n`` most damaging heads per setting by the exact stage (Yu App. E
        Tables 24-27), with ``head_label`` "L{layer}H{head}"."""
        top = self.exact[self.exact["rank"] <= n].copy()
        top["head_label"] = [f"L{r.layer}H{r.head}" for r in top.itertuples()]
        return top


def yu_head_sweep(
    model,
    prompts: PromptSet,
    screen_n: int,
    top_k: int,
    seed: int = 0,
    batch_size: int = 128,
    progress: bool = True,
    cache_dir: str | Path | Store | None = None,
) -> HeadSweep:
    """Yu's head sweep in two stages (module docstring): every head zeroed at every
    position on ``screen_n`` prompts per setting, then the ``top_k`` heads of each
    setting on all of its prompts. ``cache_dir``: see :func:`exact_head_sweep`."""
    sub = sample_settings(prompts, screen_n, seed)
    screen = rank_heads(
        setting_accuracy(
            exact_head_sweep(
                model, sub, batch_size=batch_size, progress=progress, desc="head sweep: screen", cache_dir=cache_dir
            )
        )
    )
    rows = []
    settings = screen[["op", "n_digits"]].drop_duplicates().itertuples(index=False)
    for op, nd in tqdm(list(settings), desc="head sweep: exact", disable=not progress, leave=False):
        heads = [
            (int(r.layer), int(r.head))
            for r in screen[(screen.op == op) & (screen.n_digits == nd) & (screen["rank"] <= top_k)].itertuples()
        ]
        rows.append(
            exact_head_sweep(
                model, prompts.where(op=op, n_digits=nd), heads, batch_size, progress=False, cache_dir=cache_dir
            )
        )
    rows = pd.concat(rows, ignore_index=True)
    return HeadSweep(screen, rank_heads(setting_accuracy(rows)), rows, screen_n, top_k)


def sweep_recall(
    screen: pd.DataFrame, exact_all: pd.DataFrame, top_k: int, ks: Sequence[int] = (1, 3, 5)
) -> pd.DataFrame:
    """Recall of the screen: for each setting of ``exact_all`` (rank_heads rows of every
    head on all prompts) and each k in ``ks``, the share of the exact top-k heads that are
    among the screen's ``top_k`` (what stage 2 re-measures), and whether the exact top
    head is among them."""
    out = []
    for (op, nd), ex in exact_all.groupby(["op", "n_digits"]):
        sc = screen[(screen.op == op) & (screen.n_digits == nd)]
        picked = {(int(r.layer), int(r.head)) for r in sc[sc["rank"] <= top_k].itertuples()}
        for k in ks:
            truth = [(int(r.layer), int(r.head)) for r in ex[ex["rank"] <= k].itertuples()]
            out.append(
                {
                    "op": op,
                    "n_digits": nd,
                    "k": k,
                    "screen_top": top_k,
                    "recall": sum(h in picked for h in truth) / len(truth),
                    "exact_top_heads": " ".join(f"L{l}H{h}" for l, h in truth),
                }
            )
    return pd.DataFrame(out)


def specificity(model, tokenizer, heads: dict[str, Head], facts: Sequence[dict] | None = None) -> pd.DataFrame:
    """Effect of each operator's top head on a task without arithmetic: factual recall
    (``data/factual_recall.json``, :func:`arithlib.methods.general_ability.factual_recall`) with
    the head zeroed at every position. One row per (op, fact): ``correct`` and
    ``answer_logprob`` with the head zeroed, ``clean_correct``, ``clean_logprob``. Facts
    whose answer does not tokenize as one token after the prompt under ``tokenizer``
    are left out (the toy model's tokenizer knows digits only); an empty frame when
    none is left."""
    from ..methods.ablation import zero_heads_hooks
    from ..methods.general_ability import encode_fact, factual_recall, load_facts

    usable = []
    for f in list(facts) if facts is not None else load_facts():
        try:
            encode_fact(tokenizer, f)
        except Exception:  # noqa: BLE001 (a tokenizer that cannot encode the text, or a split answer)
            continue
        usable.append(f)
    if not usable:
        return pd.DataFrame(
            columns=["op", "layer", "head", "prompt", "correct", "answer_logprob", "clean_correct", "clean_logprob"]
        )
    clean = factual_recall(model, tokenizer, usable)
    frames = []
    for op, (layer, head) in heads.items():
        with model.hooks(fwd_hooks=zero_heads_hooks([(int(layer), int(head))])):
            ab = factual_recall(model, tokenizer, usable)
        frames.append(
            pd.DataFrame(
                {
                    "op": op,
                    "layer": int(layer),
                    "head": int(head),
                    "prompt": ab["prompt"],
                    "correct": ab["correct"],
                    "answer_logprob": ab["answer_logprob"],
                    "clean_correct": clean["correct"],
                    "clean_logprob": clean["answer_logprob"],
                }
            )
        )
    return pd.concat(frames, ignore_index=True)
