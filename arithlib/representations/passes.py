"""How a model represents numbers, measured on the model (notebook 09): the passes behind
the Fourier spectra (:mod:`arithlib.representations.fourier`, Zhou et al. 2024), the helix fit and its
patching test (:mod:`arithlib.representations.helix`, Kantamneni & Tegmark 2025), the low- and high-pass
filters, and the bridge to notebook 03's heuristic neurons (Nikankin et al. 2025).

Every pass goes through the engine: activations at per-prompt positions from one pass
with recording hooks (:func:`collect_at_positions`), patches through the fast path of
:func:`arithlib.methods.patching.run_interventions` (:func:`helix_patching`), filters through the
answer-position runner (:func:`filtering_run`).

Numbers and positions: a prompt is Nikankin's "{a}+{b}=" with the notebook's few-shot
prefix. Number a is read at its **last token** (:func:`last_token_positions`): the whole
number on a model with one token per number, its last digit on a per-digit tokenizer
(the open case neither paper covers).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import replace

import numpy as np
import pandas as pd
import torch
from tqdm.auto import tqdm

from ..core.datasets import PromptRecord
from ..core.positions import locate_operands
from ..core.prompt_sets import PromptSet
from ..core.readout import final_norm, unembedding
from ..engine import AnswerPositionRunner, input_device, last_position_logits
from ..methods.patching import Component, Edit, run_interventions
from ..nikankin.heuristic_grids import grid_records
from . import fourier as FO


def resid_hook(layer: int) -> str:
    """The residual stream entering block ``layer`` (Kantamneni & Tegmark patch a
    layer's input)."""
    return f"blocks.{layer}.hook_resid_pre"


# --------------------------------------------------------------------------- numbers in the weights


def number_ids(tokenizer, numbers: Sequence[int]) -> list[int]:
    """Token id of each number written alone; raises when one is not a single token."""
    out = []
    for n in numbers:
        ids = tokenizer(str(n), add_special_tokens=False)["input_ids"]
        if len(ids) != 1:
            raise ValueError(f"{n} is {len(ids)} tokens, not one")
        out.append(ids[0])
    return out


def number_embeddings(model, ids: Sequence[int]) -> torch.Tensor:
    """Embedding rows [N, d] of the number tokens ``ids`` (float32, CPU)."""
    return model.W_E.detach().float()[list(ids)].cpu()


def number_unembedding(model, ids: Sequence[int]) -> torch.Tensor:
    """U [N, d]: the number tokens' logit directions as read after the final norm (the
    norm's weight folded in), so U h is the number-logit profile of a residual vector h."""
    W_U, _ = unembedding(model)
    g = final_norm(model).weight.to(W_U.device)
    return (W_U[:, list(ids)] * g[:, None]).T.float().cpu()


# --------------------------------------------------------------------------- prompts and positions


def addition_records(a_values: Sequence[int], b_values: Sequence[int], fewshot: int = 2) -> list[PromptRecord]:
    """Nikankin's "{a}+{b}=" record for each pair of ``a_values`` x ``b_values``, with
    the few-shot prefix of :func:`arithlib.nikankin.heuristic_grids.grid_records`."""
    hi = max(max(a_values), max(b_values))
    want_a, want_b = set(int(a) for a in a_values), set(int(b) for b in b_values)
    return [r for r in grid_records("+", (0, hi), fewshot=fewshot) if r.a in want_a and r.b in want_b]


def with_answer(record: PromptRecord, answer: int) -> PromptRecord:
    """``record`` whose expected answer is ``answer`` (the patch's target a' + b)."""
    return replace(record, answer=int(answer), answer_text=str(answer))


def last_token_positions(prompts: PromptSet) -> np.ndarray:
    """Position of the last token of operand a in each prompt [N]."""
    return np.array([found["A"][-1] for found in locate_operands(prompts)], dtype=np.int64)


# --------------------------------------------------------------------------- activations


@torch.no_grad()
def collect_at_positions(
    model,
    prompts: PromptSet,
    positions: Sequence[int],
    layers: Sequence[int],
    batch_size: int = 64,
    progress: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual stream entering each of ``layers`` at each prompt's position
    (``positions[i]``), [N, len(layers), d], and the last-position logits' argmax [N]
    (the greedy first answer token), from one pass per batch with recording hooks."""
    device = input_device(model)
    pos = torch.as_tensor(np.asarray(positions), dtype=torch.long)
    out: torch.Tensor | None = None
    pred = torch.empty(len(prompts), dtype=torch.long)
    current: dict[int, torch.Tensor] = {}

    def rec(j: int, rows: torch.Tensor, p: torch.Tensor):
        def fn(act, hook):
            current[j] = act[rows, p.to(act.device)].detach().float().cpu()
            return act

        return fn

    for batch in tqdm(list(prompts.batches(batch_size, device)), desc="activations", disable=not progress, leave=False):
        rows = torch.arange(len(batch.index), device=batch.tokens.device)
        p = pos[batch.index]
        hooks = [(resid_hook(L), rec(j, rows, p)) for j, L in enumerate(layers)]
        with model.hooks(fwd_hooks=hooks):
            logits = last_position_logits(model, batch.tokens)
        if out is None:
            out = torch.empty(len(prompts), len(layers), current[0].shape[-1])
        out[batch.index] = torch.stack([current[j] for j in range(len(layers))], 1)
        pred[batch.index] = logits.argmax(-1).cpu()
    assert out is not None
    return out, pred


def mean_by_number(acts: torch.Tensor | np.ndarray, numbers: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """Rows of ``acts`` [n, ...] averaged per number: (sorted numbers [N], means [N, ...])."""
    x = np.asarray(acts, dtype=np.float64)
    nums = np.asarray(numbers)
    uniq = np.unique(nums)
    return uniq, np.stack([x[nums == u].mean(0) for u in uniq])


# --------------------------------------------------------------------------- the helix patch


@torch.no_grad()
def helix_patching(
    model,
    targets: PromptSet,
    positions: Sequence[int],
    values: Mapping[str, Mapping[int, np.ndarray]],
    batch_size: int = 16,
    progress: bool = False,
) -> pd.DataFrame:
    """Patch each method's value into each target prompt at its operand position, one layer
    at a time (``values[method][layer]``: [N, d], row i for prompt i), through the fast path
    (:func:`arithlib.methods.patching.run_interventions`). ``targets`` are the clean prompts with
    the source's answer as their answer (:func:`with_answer`). One row per (prompt, layer,
    method): ``effect`` = the target answer's logit patched minus clean (Kantamneni &
    Tegmark's logit difference) and ``correct`` (the patched argmax is the target)."""
    methods = list(values)
    layers = sorted({L for m in methods for L in values[m]})
    pos = np.asarray(positions)
    rows = []
    groups: dict[tuple[int, int], list[int]] = {}
    for i, ids in enumerate(targets.input_ids):
        groups.setdefault((len(ids), int(pos[i])), []).append(i)
    for (_, p), idx in groups.items():
        sub = targets.subset(idx)
        index = np.asarray(idx)
        keys = [(m, L) for m in methods for L in layers if L in values[m]]

        def variants(batch, run, index=index, keys=keys, p=p):
            rows_ = index[batch.index.cpu().numpy()]
            return [
                [Edit(Component("resid_pre", L), p, torch.as_tensor(values[m][L][rows_], dtype=torch.float32))]
                for m, L in keys
            ]

        read = run_interventions(model, sub, variants, batch_size=batch_size, progress=progress, desc="helix patch")
        eff = (read.answer_logit - read.clean_answer_logit[None]).numpy()
        corr = read.correct.numpy()
        for v, (m, L) in enumerate(keys):
            for j, i in enumerate(idx):
                rows.append(
                    {
                        "prompt": int(i),
                        "layer": int(L),
                        "method": m,
                        "effect": float(eff[v, j]),
                        "correct": bool(corr[v, j]),
                    }
                )
    return pd.DataFrame(rows).sort_values(["method", "layer", "prompt"]).reset_index(drop=True)


# --------------------------------------------------------------------------- filters


def filter_conditions(
    n_layers: int, unembed: torch.Tensor, bands: Mapping[str, Sequence[int]], modules: Sequence[str] = ("mlp", "attn")
) -> dict[str, list]:
    """Hooks per condition: "none", and for each module (MLP or attention output) and band
    "<module> without <band>" (that band's frequencies removed from the module's output at
    the answer position in every layer, :func:`arithlib.representations.fourier.filter_matrix`)."""
    names = {"mlp": "blocks.{L}.hook_mlp_out", "attn": "blocks.{L}.hook_attn_out"}
    out: dict[str, list] = {"none": []}
    for band, ks in bands.items():
        if not ks:
            continue
        R = FO.filter_matrix(unembed, ks).float()
        for m in modules:
            out[f"{m} without {band}"] = FO.filter_hooks([names[m].format(L=L) for L in range(n_layers)], R)
    return out


@torch.no_grad()
def filtering_run(
    model, prompts: PromptSet, conditions: Mapping[str, list], number_of: Mapping[int, int], batch_size: int = 64
) -> pd.DataFrame:
    """First answer token under each filter condition (one answer-position pass per
    condition, :class:`arithlib.engine.AnswerPositionRunner`). One row per (prompt,
    condition): ``correct``, and where the predicted token is a number (``number_of``:
    token id -> its value; -1 when it is none) the predicted value, the error
    ``pred - target`` and whether the error is 0 modulo 10 (the last digit right).
    ``target`` is the value of the correct first token (the whole answer on a model with
    one token per number, its first digit on a per-digit one)."""
    runner = AnswerPositionRunner(model, prompts, batch_size=batch_size)
    names = list(conditions)
    logits = runner.logits_many([conditions[n] for n in names])
    ans = prompts.first_answer_ids
    target = np.array([number_of.get(int(t), -1) for t in ans])
    rows = []
    for n, lg in zip(names, logits):
        pred_ids = lg.argmax(-1)
        pred = np.array([number_of.get(int(t), -1) for t in pred_ids])
        err = np.where(pred >= 0, pred - target, np.nan)
        for i in range(len(prompts)):
            rows.append(
                {
                    "prompt": i,
                    "condition": n,
                    "correct": bool(pred_ids[i] == ans[i]),
                    "pred": int(pred[i]),
                    "target": int(target[i]),
                    "error": float(err[i]),
                    "last_digit_right": bool(pred[i] >= 0 and (pred[i] - target[i]) % 10 == 0),
                }
            )
    return pd.DataFrame(rows)


# --------------------------------------------------------------------------- the bridge to heuristic neurons


_MOD = re.compile(r"=\s*\d+\s*mod\s*(\d+)")


def rule_frequencies(heuristic: str, kind: str, n_numbers: int, bands: Mapping[str, Sequence[int]]) -> list[int]:
    """The frequencies (of N numbers) a heuristic's rule reads (stated in advance): a
    "= r mod m" rule the harmonics of period m (:func:`arithlib.representations.fourier.harmonics`); a
    last-digit or units rule those of period 10; a range rule (or any other) the low band."""
    m = _MOD.search(heuristic)
    if m:
        return FO.harmonics(n_numbers, int(m.group(1)))
    if "digit" in heuristic and "tens" not in heuristic or "units" in heuristic:
        return FO.harmonics(n_numbers, 10)
    return list(bands["low"])


def fourier_directions(unembed: torch.Tensor, ks: Sequence[int]) -> torch.Tensor:
    """Orthonormal basis [d, m] of the residual directions U^+ B_S whose number-logit
    profiles are the frequencies ``ks`` (the directions :func:`arithlib.representations.fourier.filter_matrix`
    removes)."""
    U = unembed.detach().to(torch.float64).cpu()
    D = torch.linalg.pinv(U) @ FO.fourier_basis(U.shape[0], ks)
    q, r = torch.linalg.qr(D)
    keep = (
        r.diagonal().abs() > 1e-10 * max(float(r.diagonal().abs().max()), 1e-300)
        if len(ks)
        else torch.zeros(0, dtype=torch.bool)
    )
    return q[:, keep]


def direction_share(weights: torch.Tensor, basis: torch.Tensor) -> np.ndarray:
    """Share of each row's squared norm (``weights`` [m, d]) in the span of ``basis`` [d, k]
    (orthonormal columns): ||Q^T w||^2 / ||w||^2."""
    w = weights.detach().to(torch.float64).cpu()
    proj = (w @ basis).pow(2).sum(-1)
    return (proj / w.pow(2).sum(-1).clamp_min(1e-300)).numpy()


def neuron_input_weights(model, layer: int, neurons: Sequence[int]) -> list[torch.Tensor]:
    """The input weight rows [m, d] of ``neurons`` of MLP ``layer`` as the neuron reads the
    residual stream (pre-MLP norm weight folded in): the up (W_in) rows and, for a gated
    MLP, the gate (W_gate) rows (:func:`arithlib.yu.pe_dag.static_keys`)."""
    from ..yu.pe_dag import static_keys

    return [w.cpu() for w in static_keys(model, layer, neurons).values()]
