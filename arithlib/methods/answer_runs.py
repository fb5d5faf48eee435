"""Runs of a prompt set under several interventions at once, read at the answer position: the
logits, and per layer the residual stream after attention (``resid_mid``) and the MLP
coefficients that CNA needs (Yu & Ananiadou 2024, Sec. 4.1).

Each intervention (a *condition*: a list of hooks, or a function of the batch rows) gets
its own copy of the batch in one pass (condition-major rows); the few-shot prefix is run
once per condition when the hooks are position-invariant, and :func:`run_answer_conditions`
reuses the clean prefix's keys and values for hooks that act at the answer position only.
The passes are :mod:`arithlib.engine`'s; each is tested equal to a plain run per condition.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from ..core.components import Hook, RowHooks
from ..core.evaluate import continues_number
from ..core.prompt_sets import PromptSet
from ..engine import (
    answer_pass,
    check_variants,
    clean_run,
    common_prefix,
    condition_pass,
    input_device,
    shared_prefix_cache,
    shared_prefix_logits,
    stacked_hooks,
    variant_passes,
)
from .ablation import is_position_invariant


@dataclass
class LastPosition:
    """What one run leaves at the answer position: prediction, log-probability of the
    target, and (if captured) resid_mid [N, L, d], coefficients [N, L, d_mlp] and, with
    resid_mid, the final hidden state [N, d] (the last block's output, the final norm's
    input: CNA's fixed norm scale is read from it)."""

    targets: torch.Tensor
    pred: torch.Tensor
    logprob: torch.Tensor
    resid_mid: torch.Tensor | None = None
    coef: torch.Tensor | None = None
    final_resid: torch.Tensor | None = None

    @property
    def correct(self) -> torch.Tensor:
        return self.pred == self.targets

    @property
    def accuracy(self) -> float:
        return float(self.correct.float().mean()) if len(self.targets) else float("nan")


class _Capture:
    """Forward hooks that record resid_mid (resid_pre + attn_out) and MLP coefficients
    at the last position of every layer, and with resid_mid the last block's output
    (``final_resid``); the last call wins."""

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
        if "resid_mid" in self.what:
            hooks.append((f"blocks.{self.n_layers - 1}.hook_resid_post", self._save(("final",))))
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
            out["resid_mid"] = torch.stack(
                [(self.store[("pre", l)] + self.store[("attn", l)]).to(dev) for l in range(self.n_layers)], 1
            )
            out["final_resid"] = self.store[("final",)].to(dev)
        if "coef" in self.what:
            out["coef"] = torch.stack([self.store[("coef", l)].to(dev) for l in range(self.n_layers)], 1)
        self.store = {}
        return out


def answer_targets(prompts: PromptSet, targets: torch.Tensor | None) -> torch.Tensor:
    """The token each prompt's importance is read for: ``targets``, else each prompt's
    first answer token; checked against the number of prompts."""
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
    return LastPosition(
        targets=targets,
        pred=fields.pop("pred"),
        logprob=fields.pop("logprob"),
        resid_mid=fields.get("resid_mid"),
        coef=fields.get("coef"),
        final_resid=fields.get("final_resid"),
    )


def _split_conditions(
    logits: torch.Tensor,
    captured: dict[str, torch.Tensor],
    targets: torch.Tensor,
    index: torch.Tensor,
    names: Sequence[str],
    parts: dict[str, list],
) -> None:
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
def run_conditions(
    model,
    prompts: PromptSet,
    conditions: Mapping[str, list[Hook] | RowHooks | None],
    *,
    capture: Sequence[str] = ("resid_mid", "coef"),
    targets: torch.Tensor | None = None,
    batch_size: int = 64,
    max_rows: int = 256,
    share_prefix: bool = True,
    progress: bool = False,
    desc: str = "forward",
) -> dict[str, LastPosition]:
    """One run of ``prompts`` per condition (a hook list active at every position, a
    function of the batch's row indices giving per-prompt hooks, or None); returns per
    condition the prediction, log p(target) and the captured answer-position activations.

    Batches hold one few-shot prefix each; with ``share_prefix`` and hook lists whose
    hooks are all position-invariant (:func:`arithlib.methods.ablation.is_position_invariant`: zeroing at every position) the prefix the
    batch's rows share is computed once per condition (with its hooks) and reused
    through the KV cache: the same result as a full forward, several times cheaper.
    Per-prompt hooks and any other hook (``position=-1``, mean ablation) run every row
    in full: the same numbers, without the saving. Conditions are stacked along the
    batch (condition-major, up to ``max_rows`` prompt rows per pass, each condition's
    hooks on its own rows): fewer, larger matrix products.
    """
    device = input_device(model)
    targets = answer_targets(prompts, targets)
    cap = _Capture(int(model.cfg.n_layers), capture)
    names = list(conditions)
    parts: dict[str, list] = {name: [] for name in names}
    for batch in tqdm(
        list(prompts.batches(batch_size, device, by_prefix=share_prefix)), desc=desc, disable=not progress, leave=False
    ):
        tokens = batch.tokens
        B = tokens.shape[0]
        t = targets[batch.index].to(device)
        per_chunk = max(1, max_rows // B)
        for c0 in range(0, len(names), per_chunk):
            chunk = names[c0 : c0 + per_chunk]
            conds = [conditions[name] for name in chunk]
            per = [(c(batch.index) if callable(c) else list(c or [])) for c in conds]
            shared = (
                share_prefix
                and B > 1
                and not any(callable(c) for c in conds)
                and all(is_position_invariant(fn) for hooks in per for _, fn in hooks)
            )
            n = min(common_prefix(tokens.tolist()), tokens.shape[1] - 1) if shared else 0
            logits = condition_pass(model, tokens, per, n, cap.hooks())
            _split_conditions(logits.float(), cap.collect(), t, batch.index, chunk, parts)
    return {name: _assemble(len(prompts), p, targets) for name, p in parts.items()}


def run_last_position(
    model,
    prompts: PromptSet,
    hooks: list[Hook] | RowHooks | None = None,
    *,
    capture: Sequence[str] = ("resid_mid", "coef"),
    targets: torch.Tensor | None = None,
    batch_size: int = 64,
    share_prefix: bool = True,
    progress: bool = False,
    desc: str = "forward",
) -> LastPosition:
    """:func:`run_conditions` with one condition: ``prompts`` with ``hooks`` active at
    every position."""
    return run_conditions(
        model,
        prompts,
        {"run": hooks},
        capture=capture,
        targets=targets,
        batch_size=batch_size,
        share_prefix=share_prefix,
        progress=progress,
        desc=desc,
    )["run"]


@torch.no_grad()
def run_weight_variants(
    model,
    prompts: PromptSet,
    variants: Mapping[str, tuple[int, Mapping[str, torch.Tensor]]],
    base: LastPosition,
    *,
    capture: Sequence[str] = ("resid_mid", "coef"),
    batch_size: int = 64,
    max_rows: int = 1024,
    progress: bool = False,
    desc: str = "weight variants",
) -> dict[str, LastPosition]:
    """:func:`run_last_position` of each weight variant of ``model`` (name -> (block,
    weights): new weights of linear layers in that one block, e.g. a LoRA model's merged
    attention projections), all variants of a batch in one pass that each joins at its
    block from a clean run of the original (:func:`arithlib.engine.variant_passes`),
    up to ``max_rows`` rows per pass. Below its block a variant computes what the
    original does, so its captured activations there are ``base``'s (the original's
    :func:`run_last_position` on ``prompts``, same ``capture``): the same numbers as a
    full run per variant with its weights swapped in (tested)."""
    targets = base.targets
    n_layers = int(model.cfg.n_layers)
    order = sorted(variants, key=lambda name: int(variants[name][0]))  # by block, stable
    check_variants(model, [variants[name] for name in order])
    what = set(capture)
    N = len(prompts)
    out: dict[str, dict[str, torch.Tensor]] = {}
    for name in order:
        fields = {"pred": torch.empty(N, dtype=torch.long), "logprob": torch.empty(N)}
        if "resid_mid" in what:
            fields["resid_mid"] = base.resid_mid.clone()
            fields["final_resid"] = torch.empty_like(base.final_resid)
        if "coef" in what:
            fields["coef"] = base.coef.clone()
        out[name] = fields
    device = input_device(model)
    for batch in tqdm(
        list(prompts.batches(batch_size, device, by_prefix=True)), desc=desc, disable=not progress, leave=False
    ):
        B = batch.tokens.shape[0]
        run = clean_run(model, batch.tokens)
        t = targets[batch.index]
        per_pass = max(1, max_rows // B)
        for c0 in range(0, len(order), per_pass):
            chunk = order[c0 : c0 + per_pass]
            cap = _Capture(n_layers, capture)  # the activations of the rows present at each block
            logits = variant_passes(model, run, [variants[name] for name in chunk], cap.hooks()).float().cpu()
            logprob = logits.log_softmax(-1).gather(1, t.repeat(len(chunk))[:, None])[:, 0]
            pred = logits.argmax(-1)
            store = {key: value.cpu() for key, value in cap.store.items()}
            for j, name in enumerate(chunk):
                rows, f = slice(j * B, (j + 1) * B), out[name]
                f["pred"][batch.index] = pred[rows]
                f["logprob"][batch.index] = logprob[rows]
                for layer in range(int(variants[name][0]), n_layers):
                    if "resid_mid" in what:
                        f["resid_mid"][batch.index, layer] = store[("pre", layer)][rows] + store[("attn", layer)][rows]
                    if "coef" in what:
                        f["coef"][batch.index, layer] = store[("coef", layer)][rows]
                if "resid_mid" in what:
                    f["final_resid"][batch.index] = store[("final",)][rows]
    return {
        name: LastPosition(
            targets=targets,
            pred=out[name]["pred"],
            logprob=out[name]["logprob"],
            resid_mid=out[name].get("resid_mid"),
            coef=out[name].get("coef"),
            final_resid=out[name].get("final_resid"),
        )
        for name in variants
    }


@torch.no_grad()
def run_answer_conditions(
    model,
    prompts: PromptSet,
    conditions: Mapping[str, list[Hook] | RowHooks | None],
    *,
    capture: Sequence[str] = (),
    targets: torch.Tensor | None = None,
    batch_size: int = 64,
    max_rows: int = 512,
    progress: bool = False,
    desc: str = "conditions",
) -> dict[str, LastPosition]:
    """Interventions at the answer position only: every prompt's positions before the
    last are run once without hooks (KV cache, few-shot prefix shared), then the last
    token of all conditions at once, stacked along the batch (up to ``max_rows`` rows),
    each condition's hooks acting on its own rows. A condition is a hook list or a
    function of the batch's row indices (per-prompt neuron sets). Since the hooks act on
    the last token alone, this equals a full forward with hooks at position -1; stacking
    reads the weights once for all conditions (single-token passes are memory-bound)."""
    device = input_device(model)
    targets = answer_targets(prompts, targets)
    cap = _Capture(int(model.cfg.n_layers), capture)
    names = list(conditions)
    parts: dict[str, list] = {name: [] for name in names}
    for batch in tqdm(
        list(prompts.batches(batch_size, device, by_prefix=True)), desc=desc, disable=not progress, leave=False
    ):
        tokens = batch.tokens
        B = tokens.shape[0]
        base = shared_prefix_cache(model, tokens[:, :-1]) if tokens.shape[1] > 1 else None
        t = targets[batch.index].to(device)
        per_chunk = max(1, max_rows // B)
        for c0 in range(0, len(names), per_chunk):
            chunk = names[c0 : c0 + per_chunk]
            nc = len(chunk)
            hooks = stacked_hooks(
                [
                    (cond(batch.index) if callable(cond) else list(cond or []))
                    for cond in (conditions[name] for name in chunk)
                ],
                B,
            )
            with model.hooks(fwd_hooks=hooks + cap.hooks()):
                logits = answer_pass(model, tokens[:, -1:], base, nc)
            _split_conditions(logits.float(), cap.collect(), t, batch.index, chunk, parts)
    return {name: _assemble(len(prompts), p, targets) for name, p in parts.items()}


@torch.no_grad()
def correct_mask(
    model, prompts: PromptSet, criterion: str = "full", batch_size: int = 32, progress: bool = False
) -> torch.Tensor:
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
    chunks = [(key, idx[s : s + batch_size]) for key, idx in groups.items() for s in range(0, len(idx), batch_size)]
    for (length, n_ans), idx in tqdm(chunks, desc="correct", disable=not progress, leave=False):
        seqs = [prompts.input_ids[i] + prompts.answer_ids[i][:n_ans] for i in idx]
        tokens = torch.tensor(seqs, device=device)
        n_keep = n_ans + 1 if criterion == "full" else 1
        inputs = tokens if criterion == "full" else tokens[:, :length]
        n = min(common_prefix(inputs.tolist()), inputs.shape[1] - 1) if len(idx) > 1 else 0
        n = min(n, length - 1)
        logits = shared_prefix_logits(model, inputs, n, n_keep)
        pred = logits.argmax(-1).cpu()  # [B, n_keep]: predictions at positions length-1 .. length-1+n_ans
        for row, i in enumerate(idx):
            ans = prompts.answer_ids[i]
            ok = pred[row, :n_ans].tolist() == ans[:n_ans]
            if criterion == "full" and ok:
                ok = not continues_number(tok, int(pred[row, n_ans]))
            result[i] = ok
    return result
