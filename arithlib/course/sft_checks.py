"""Checks for exercise 08, Zhang et al.'s precise SFT (``notebooks/exercises/08_*``; Sec. 4.3,
Alg. 2, and Sec. 5.3): the gradient masks that leave only the key heads' slices of W_Q, W_K,
W_V, W_O (and whole chosen MLPs, Table 2/5) trainable, the answer-only loss of fine-tuning,
and one step of Alg. 2 (masked, rescaled by H/h). As in :mod:`arithlib.course.exercises`, a
check prints one line when the student's function agrees with arithlib's
(:mod:`arithlib.zhang.sft`, :mod:`arithlib.methods.answer_loss`) and raises
:class:`CheckFailed` saying what differs (naming the usual mistake where it recognises one)
when it does not.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache

import pandas as pd
import torch

from ..core import datasets as ds
from ..core.prompt_sets import PromptSet
from ..core.random_models import build_random
from ..engine import shared_hf_model
from ..methods import finetune as FT
from ..methods import finetune_data as FD
from ..methods import patching as P
from ..methods.answer_loss import answer_loss
from ..methods.model_weights import model_shape, params_by_clean_name, training_state
from ..zhang import path_patching as PP
from ..zhang import sft
from .exercises import CheckFailed, check_model, passed, patching_batch

#: (heads, mlps) the mask check asks for on the toy model (4 heads per layer, 2 KV groups):
#: the key heads of one KV group; head 1 (KV group 0, not 1) with a head of the other layer;
#: one head plus the MLP of the other layer; a whole layer plus an MLP.
TOY_CASES: tuple[tuple[tuple[tuple[int, int], ...], tuple[int, ...]], ...] = (
    (((0, 2), (0, 3)), ()),
    (((0, 1), (1, 2)), ()),
    (((1, 3),), (0,)),
    (((0, 0), (0, 1), (0, 2), (0, 3)), (1,)),
)
#: (heads, mlps) on the small random model with attention biases (6 heads, 2 KV groups of 3).
BIASED_CASES = ((((0, 1), (0, 4), (2, 5)), (1,)),)
#: Learning rate of the step check (plain SGD, so that the update is visible).
STEP_LR = 0.05


def toy_hf() -> torch.nn.Module:
    """The toy model as a plain Hugging Face model sharing the bridge's weights
    (:func:`arithlib.engine.shared_hf_model`): what arithlib's trainer trains."""
    return shared_hf_model(check_model().bridge)


@lru_cache(maxsize=1)
def biased_model() -> torch.nn.Module:
    """A small random Llama-style model with q/k/v/o biases and grouped-query attention
    (3 layers, 6 heads in 2 KV groups, d_head 8): the biases the toy model lacks."""
    from transformers import LlamaConfig

    cfg = LlamaConfig(
        vocab_size=32,
        hidden_size=48,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=8,
        attention_bias=True,
    )
    return build_random(cfg, seed=0, device="cpu", dtype=torch.float32)


@lru_cache(maxsize=1)
def ranked_heads() -> pd.DataFrame:
    """The toy model's heads ranked by Zhang's path-patching effect (notebook 01's measure,
    on the prompts of :func:`arithlib.course.exercises.patching_batch`), most negative first,
    with the ``key`` flag (effect < -5 %): :func:`arithlib.zhang.sft.rank_components`."""
    bridge = check_model().bridge
    res = PP.path_patching(
        bridge,
        patching_batch().prompts,
        senders=P.head_components(bridge.cfg.n_layers, bridge.cfg.n_heads),
        capture_attention=False,
        progress=False,
    )
    heads, _ = sft.rank_components(PP.mean_effects(res.effects, []))
    return heads


def reference_masks(model, heads: Sequence[tuple[int, int]], mlps: Sequence[int] = ()) -> dict[str, torch.Tensor]:
    """What arithlib's precise SFT trains: :func:`arithlib.zhang.sft.head_slices`' masks plus
    every entry of the MLPs of ``mlps`` (:func:`arithlib.zhang.sft.mlp_parameters`)."""
    masks, _, _ = sft.head_slices(model, heads, kv="group")
    params = params_by_clean_name(model)
    out = {n: m.bool() for n, m in masks.items()}
    out.update({n: torch.ones(params[n].shape, dtype=torch.bool) for n in sft.mlp_parameters(model, mlps)})
    return out


# --------------------------------------------------------------------------- 1 · masks


def _as_mask(value, name: str, shape: torch.Size) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise CheckFailed(f"precise_masks[{name!r}] should be a torch.Tensor, got {type(value).__name__}")
    value = value.detach().cpu()
    if tuple(value.shape) != tuple(shape):
        raise CheckFailed(f"precise_masks[{name!r}] has shape {tuple(value.shape)}, the parameter {tuple(shape)}")
    if value.dtype != torch.bool and not bool(((value == 0) | (value == 1)).all()):
        raise CheckFailed(f"precise_masks[{name!r}] should hold 0/1 (or True/False), not other values")
    return value.bool()


def _rows(shape, units: Sequence[int], size: int) -> torch.Tensor:
    m = torch.zeros(shape, dtype=torch.bool)
    for u in units:
        m[u * size : (u + 1) * size] = True
    return m


def _kv_message(mine: torch.Tensor, heads: Sequence[int], n_heads: int, n_kv: int, d_head: int) -> str:
    """Recognise the usual ways of picking a query head's K/V rows wrongly."""
    group = n_heads // n_kv
    variants = {
        "you took the rows of KV group h % n_kv_heads; with grouped-query attention consecutive query heads "
        "share a KV head: head h reads group h // (n_heads // n_kv_heads)": [h % n_kv for h in heads],
        "you took the K/V rows of the query head's own index; W_K and W_V have only n_kv_heads * d_head rows "
        "(grouped-query attention): head h reads the rows of KV group h // (n_heads // n_kv_heads)": list(heads),
    }
    for why, units in variants.items():
        if sorted(set(units)) != sorted({h // group for h in heads}) and torch.equal(
            mine, _rows(mine.shape, units, d_head)
        ):
            return why
    return ""


def _compare_masks(model, heads, mlps, mine: dict, where: str) -> None:
    params = params_by_clean_name(model)
    shape = model_shape(model)
    n_heads, n_kv, d_head = shape["n_heads"], shape["n_kv_heads"], shape["d_head"]
    ref = reference_masks(model, heads, mlps)
    if not isinstance(mine, dict):
        raise CheckFailed(f"precise_masks should return a dict {{parameter name: mask}}, got {type(mine).__name__}")
    unknown = sorted(set(mine) - set(params))
    if unknown:
        raise CheckFailed(f"precise_masks {where}: no parameter is called {unknown[:3]} (use the names of `params`)")
    got = {n: _as_mask(v, n, params[n].shape) for n, v in mine.items()}
    got = {n: m for n, m in got.items() if m.any()}  # an all-zero mask trains nothing, like no entry
    extra, missing = sorted(set(got) - set(ref)), sorted(set(ref) - set(got))
    if extra:
        if any(n.endswith("o_proj.bias") for n in extra):
            raise CheckFailed(
                f"precise_masks {where}: you train the output bias ({[n for n in extra if 'o_proj.bias' in n]}); "
                "it is added once after the heads' outputs are summed, so it is shared by all heads of the layer: "
                "no head owns it, leave it frozen"
            )
        mlp_extra = [n for n in extra if ".mlp." in n]
        if mlp_extra:
            raise CheckFailed(
                f"precise_masks {where}: MLP parameters {mlp_extra[:3]} are trainable; only the MLPs of the layers in "
                f"`mlps` ({list(mlps)}) are trained (whole), the others stay frozen"
            )
        raise CheckFailed(f"precise_masks {where}: parameters that precise SFT does not train: {extra[:4]}")
    if missing:
        if any(n.endswith(".bias") for n in missing):
            raise CheckFailed(
                f"precise_masks {where}: the biases are missing ({[n for n in missing if n.endswith('.bias')][:3]}): "
                "a head's rows of the q/k/v bias belong to its slice (its d_head outputs), train them with the rows"
            )
        if any("k_proj" in n or "v_proj" in n for n in missing):
            raise CheckFailed(
                f"precise_masks {where}: W_K / W_V are missing ({[n for n in missing if 'k_proj' in n or 'v_proj' in n]}"
                "): Zhang's head owns slices of all four of W_Q, W_K, W_V, W_O (arithlib's kv='none' trains only Q "
                "and O); with grouped-query attention its K/V slice is the rows of the KV group it reads"
            )
        if any(".mlp." in n for n in missing):
            raise CheckFailed(
                f"precise_masks {where}: the MLPs of layers {list(mlps)} are trained whole (Zhang's heads + MLPs); "
                f"missing {[n for n in missing if '.mlp.' in n][:3]}"
            )
        raise CheckFailed(f"precise_masks {where}: parameters missing: {missing[:4]}")
    for name, r in ref.items():
        m = got[name]
        if torch.equal(m, r):
            continue
        layer = int(name.split(".layers.")[1].split(".")[0]) if ".layers." in name else -1
        hs = sorted(h for lay, h in heads if lay == layer)
        why = _kv_message(m, hs, n_heads, n_kv, d_head) if ("k_proj" in name or "v_proj" in name) and hs else ""
        if why:
            pass  # a K/V mask of the wrong group, possibly the whole matrix: the group is the message
        elif ".mlp." in name:
            why = "an MLP of `mlps` is trained whole: every entry"
        elif bool(m.all()) and not bool(r.all()):
            why = (
                "the whole matrix of the layer is trainable (masked by layer only): keep only the chosen heads' slices"
            )
        elif "o_proj.weight" in name:
            rows = torch.zeros_like(r)
            cols = r.any(0).nonzero().flatten()
            rows[cols[cols < rows.shape[0]]] = True
            if torch.equal(m, rows):
                why = (
                    "W_O masked on the wrong axis: nn.Linear stores its weight as [out, in]; a head's slice of W_O is "
                    "its d_head *columns* (the inputs of o_proj: the head's z), while for W_Q, W_K, W_V it is rows"
                )
        too_many, too_few = int((m & ~r).sum()), int((r & ~m).sum())
        raise CheckFailed(
            f"precise_masks {where}: the mask of {name} differs from arithlib's ({too_many} entries too many, "
            f"{too_few} missing)" + (f": {why}" if why else "")
        )


def check_precise_masks(fn: Callable) -> None:
    """``fn(params, heads, mlps, n_heads, n_kv_heads)``: {parameter name: bool mask of its shape}
    for every parameter precise SFT trains (Zhang Alg. 2): the rows of W_Q (and its bias) of
    each head in ``heads``, its columns of W_O, the rows of W_K and W_V (and biases) of the KV
    group it reads, and every entry of the MLPs of the layers ``mlps``; nothing else. Checked on
    the toy model (:data:`TOY_CASES`) and on a small model with attention biases
    (:data:`BIASED_CASES`) against :func:`arithlib.zhang.sft.head_slices` and
    :func:`arithlib.zhang.sft.mlp_parameters`."""
    models = [("toy model", toy_hf(), TOY_CASES), ("model with attention biases", biased_model(), BIASED_CASES)]
    n = 0
    for label, model, cases in models:
        shape = model_shape(model)
        for heads, mlps in cases:
            where = f"on the {label}, heads {list(heads)}, mlps {list(mlps)}"
            mine = fn(dict(params_by_clean_name(model)), list(heads), list(mlps), shape["n_heads"], shape["n_kv_heads"])
            _compare_masks(model, heads, mlps, mine, where)
            n += 1
    passed(f"precise_masks matches arithlib.zhang.sft.head_slices (+ mlp_parameters) on {n} head/MLP selections")


# --------------------------------------------------------------------------- 2 · answer-only loss


@dataclass(frozen=True)
class LossBatch:
    """Yu's 2-digit + and - sentences (2-shot, negative results allowed: ``-58`` is two tokens)
    with their answers appended, right-padded: ``tokens`` [B, T], ``prompt_len`` and
    ``answer_len`` [B], the toy model's ``logits`` [B, T, vocab] on them, and the
    ``prompts`` (:class:`~arithlib.core.prompt_sets.PromptSet`) they come from."""

    prompts: PromptSet
    tokens: torch.Tensor
    prompt_len: torch.Tensor
    answer_len: torch.Tensor
    logits: torch.Tensor


def padded_batch(prompts: PromptSet, pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Prompt + answer token ids of every prompt, right-padded with ``pad_id``: (tokens [B, T],
    prompt_len [B], answer_len [B])."""
    seqs = [p + a for p, a in zip(prompts.input_ids, prompts.answer_ids)]
    tokens = torch.full((len(seqs), max(map(len, seqs))), pad_id, dtype=torch.long)
    for row, s in enumerate(seqs):
        tokens[row, : len(s)] = torch.tensor(s)
    return (
        tokens,
        torch.tensor([len(p) for p in prompts.input_ids]),
        torch.tensor([len(a) for a in prompts.answer_ids]),
    )


@lru_cache(maxsize=1)
def loss_batch() -> LossBatch:
    """The batch of the loss check (:class:`LossBatch`): 32 sentences, 8 of them with a
    two-token (negative) answer."""
    model = check_model()
    recs = ds.yu_prompts(ops=["+", "-"], n_digits=2, n_per_template=4, allow_negative=True, seed=0, fewshot=2)
    ps = PromptSet.build(recs, model.tokenizer)
    tokens, prompt_len, answer_len = padded_batch(ps, model.tokenizer.pad_token_id or 0)
    attention = (torch.arange(tokens.shape[1])[None] < (prompt_len + answer_len)[:, None]).long()
    with torch.no_grad():
        logits = toy_hf()(input_ids=tokens, attention_mask=attention).logits.float()
    return LossBatch(ps, tokens, prompt_len, answer_len, logits)


def _wrong_losses(b: LossBatch) -> dict[str, float]:
    """What the usual mistakes compute, for the message of :func:`check_answer_only_loss`."""
    lp = b.logits.log_softmax(-1)
    T = b.tokens.shape[1]
    pos = torch.arange(T)[None]
    end = b.prompt_len + b.answer_len
    nll_next = -lp[:, :-1].gather(-1, b.tokens[:, 1:, None])[..., 0]  # position t predicting token t+1
    nll_same = -lp.gather(-1, b.tokens[..., None])[..., 0]  # position t "predicting" its own token
    answer = (pos[:, :-1] >= (b.prompt_len - 1)[:, None]) & (pos[:, :-1] < (end - 1)[:, None])
    in_text = pos[:, :-1] < (end - 1)[:, None]
    same = (pos >= b.prompt_len[:, None]) & (pos < end[:, None])
    per_prompt = (nll_next * answer).sum(1) / answer.sum(1)
    return {
        "the mean over every token of the text (prompt tokens included): the prompt carries no loss": float(
            nll_next[in_text].mean()
        ),
        "off by one: the logits at position t predict token t + 1, so answer token k is read at position "
        "prompt_len - 1 + k": float(nll_same[same].mean()),
        "the mean over prompts of each prompt's mean; arithlib averages over all answer tokens of the batch "
        "(a two-token answer counts twice)": float(per_prompt.mean()),
        "the sum over the answer tokens, not their mean": float(nll_next[answer].sum()),
        "the answer tokens' loss divided by every position of the batch (mean over the whole sequence)": float(
            nll_next[answer].sum() / nll_next.numel()
        ),
    }


def check_answer_only_loss(fn: Callable) -> None:
    """``fn(logits, tokens, prompt_len, answer_len)`` (``logits`` [B, T, vocab] of the model on
    ``tokens`` [B, T], prompt then answer, right-padded): the mean cross-entropy over the
    answer tokens of the batch, each predicted from its predecessors; against
    :func:`arithlib.methods.answer_loss.answer_loss` (teacher-forced, with the few-shot prefix
    shared) on 32 sentences with one- and two-token answers."""
    b = loss_batch()
    with torch.no_grad():
        ref = float(answer_loss(toy_hf(), b.prompts, list(range(len(b.prompts)))))
    mine = fn(b.logits.clone(), b.tokens.clone(), b.prompt_len.clone(), b.answer_len.clone())
    if not isinstance(mine, torch.Tensor) or mine.numel() != 1:
        raise CheckFailed(
            f"answer_only_loss should return a scalar torch.Tensor (to call .backward() on), got {type(mine).__name__}"
            + (f" of shape {tuple(mine.shape)}" if isinstance(mine, torch.Tensor) else "")
        )
    value = float(mine)
    if abs(value - ref) > 1e-3 * max(1.0, abs(ref)):
        why = [w for w, v in _wrong_losses(b).items() if abs(v - value) <= 1e-3 * max(1.0, abs(v))]
        raise CheckFailed(
            f"answer_only_loss is {value:.4f}, arithlib's answer_loss {ref:.4f}"
            + (f": your value is {why[0]}" if why else "")
        )
    passed(f"answer_only_loss matches arithlib.methods.answer_loss.answer_loss ({ref:.4f} nats per answer token)")


# --------------------------------------------------------------------------- 3 · one step of Alg. 2


#: (heads, mlps) of the step check: the toy's key heads; a head per layer plus an MLP.
STEP_CASES = ((((0, 2), (0, 3)), ()), (((0, 1), (1, 2)), (1,)))


@lru_cache(maxsize=1)
def step_prompts() -> PromptSet:
    """The 8 sentences of the step check (one batch)."""
    b = loss_batch()
    return b.prompts.subset(list(range(1, len(b.prompts), 4)))


def check_precise_sgd_step(fn: Callable) -> None:
    """``fn(params, masks, scales, loss_fn, lr)``: one step of Zhang's Alg. 2 in place, each
    parameter p of ``params`` moved by -lr * scales.get(name, 1) * mask * grad (no mask: every
    entry), the gradient that of ``loss_fn()`` alone (a stale ``.grad`` is left on each
    parameter beforehand); returns the loss before the step. Against one step of
    :func:`arithlib.zhang.sft.precise_sft` with plain SGD (no clipping, constant lr), on the
    toy model's :func:`step_prompts`."""
    hf, ps = toy_hf(), step_prompts()
    index = list(range(len(ps)))
    config = FT.TrainConfig(
        lr=STEP_LR, epochs=1, batch_size=len(ps), max_steps=1, optimizer="sgd", schedule="constant", grad_clip=None
    )
    params = params_by_clean_name(hf)
    for heads, mlps in STEP_CASES:
        where = f"(heads {list(heads)}, mlps {list(mlps)})"
        with torch.enable_grad():
            ref = sft.precise_sft(hf, list(heads), ps, config, mlps=list(mlps), progress=False)
        masks, scales, _ = sft.head_slices(hf, list(heads))
        chosen = {n: params[n] for n in ref.weights}
        before = {n: p.detach().clone() for n, p in chosen.items()}
        try:
            with training_state(hf), torch.enable_grad():
                for p in hf.parameters():
                    p.requires_grad_(False)
                    p.grad = None
                for p in chosen.values():  # what an earlier step would have left
                    p.grad = torch.full_like(p, 0.01)
                try:
                    loss = fn(dict(chosen), dict(masks), dict(scales), lambda: answer_loss(hf, ps, index), STEP_LR)
                except RuntimeError as err:
                    if "does not require grad" not in str(err):
                        raise
                    raise CheckFailed(
                        "precise_sgd_step: the loss has no gradient: the model arrives frozen, so set "
                        "p.requires_grad_(True) on the parameters of `params` before calling loss_fn()"
                    ) from err
            after = {n: p.detach().clone() for n, p in chosen.items()}
        finally:
            with torch.no_grad():
                for n, v in before.items():
                    chosen[n].copy_(v)
        for name in chosen:
            _compare_step(name, after[name] - before[name], ref.weights[name] - before[name], masks, scales, where)
        ref_loss = float(ref.history["loss"].iloc[0])
        if not isinstance(loss, (int, float)) and not (isinstance(loss, torch.Tensor) and loss.numel() == 1):
            raise CheckFailed(f"precise_sgd_step should return the loss (a number), got {type(loss).__name__}")
        if abs(float(loss) - ref_loss) > 1e-3 * max(1.0, abs(ref_loss)):
            raise CheckFailed(
                f"precise_sgd_step {where} returned {float(loss):.4f}, the batch's loss before the step is {ref_loss:.4f}"
            )
    passed(f"precise_sgd_step matches one SGD step of arithlib.zhang.sft.precise_sft on {len(STEP_CASES)} selections")


def _compare_step(name: str, mine: torch.Tensor, ref: torch.Tensor, masks: dict, scales: dict, where: str) -> None:
    scale = float(scales.get(name, 1.0))
    size = float(ref.abs().max())
    tol = 1e-4 * size + 1e-7
    if float((mine - ref).abs().max()) <= tol:
        return
    mask = masks.get(name)
    if float(mine.abs().max()) == 0.0:
        raise CheckFailed(
            f"precise_sgd_step {where}: {name} did not move; update the parameter itself, in place "
            "(`with torch.no_grad(): p -= lr * ...`), not a copy"
        )
    if mask is not None and bool((mine[~mask.bool()] != 0).any()):
        raise CheckFailed(
            f"precise_sgd_step {where}: {name} changed outside its mask ({int((mine[~mask.bool()] != 0).sum())} "
            "entries): multiply the gradient by the mask so that only the chosen heads' slices move"
        )
    stale = -STEP_LR * scale * 0.01 * (mask.to(ref.dtype) if mask is not None else 1.0)
    variants = {
        "the step is not multiplied by H/h (scales[name]), Zhang's per-layer rescaling": ref / scale,
        "the weights moved up the gradient: subtract lr * grad": -ref,
        "the stale .grad left by an earlier step was added to this step's: set p.grad = None before backward": ref
        + stale,
    }
    for why, v in variants.items():
        if float((mine - v).abs().max()) <= tol and float((v - ref).abs().max()) > tol:
            raise CheckFailed(f"precise_sgd_step {where}: {name} moved differently from arithlib's step: {why}")
    raise CheckFailed(
        f"precise_sgd_step {where}: the update of {name} differs from arithlib's by up to "
        f"{float((mine - ref).abs().max()):.3g} (its largest entry is {size:.3g})"
    )


# --------------------------------------------------------------------------- the notebook's comparison


@dataclass(frozen=True)
class SFTSets:
    """The comparison's data on the toy model: ``train`` and ``test``, Yu's "A plus B is" /
    "A minus B is" sentences (a wording the toy model never saw: it was trained on "A+B=C"
    lines), split by operand pair; ``native``, the toy's own "A + B =" wording, the ability
    that fine-tuning should keep."""

    train: PromptSet
    test: PromptSet
    native: PromptSet


@lru_cache(maxsize=1)
def sft_sets(n_train: int = 96, n_test: int = 48) -> SFTSets:
    """The data of :func:`sgd_run` (:class:`SFTSets`)."""
    tok = check_model().tokenizer
    pool = ds.yu_prompts(
        ops=["+", "-"], n_digits=2, n_per_template=None, allow_negative=True, seed=0, fewshot=2, templates=[2, 3]
    )
    words = [r for r in pool if "plus" in r.full_text or "minus" in r.full_text]
    native = [r for r in pool if "plus" not in r.full_text and "minus" not in r.full_text]
    split = FD.split_records(words, {"test": n_test, "train": n_train}, seed=0)
    return SFTSets(
        PromptSet.build(split["train"], tok),
        PromptSet.build(split["test"], tok),
        PromptSet.build(native[:: max(1, len(native) // n_test)][:n_test], tok),
    )


def sgd_run(
    step: Callable,
    names: Sequence[str],
    masks: dict[str, torch.Tensor],
    scales: dict[str, float],
    lr: float,
    epochs: int = 2,
    batch_size: int = 16,
) -> dict:
    """Fine-tune the toy model with the student's ``step`` on :func:`sft_sets`' training
    sentences (``epochs`` passes in batches of ``batch_size``, the batches of
    :func:`arithlib.methods.finetune_data.epoch_batches`), training the parameters ``names``
    under ``masks`` and ``scales``; then restore the model. Returns the losses, the trained
    weights (name -> tensor), and the accuracy (``correct_full``) on the held-out sentences
    and on the toy's own wording before and after."""
    hf, data = toy_hf(), sft_sets()
    params = params_by_clean_name(hf)
    chosen = {n: params[n] for n in names}
    before = {n: p.detach().clone() for n, p in chosen.items()}

    def accuracy() -> dict[str, float]:
        frame = FT.evaluate_weights(hf, None, {"new wording": data.test, "own wording": data.native})
        return frame.groupby("set")["correct_full"].mean().to_dict()

    start = accuracy()
    losses = []
    try:
        with training_state(hf), torch.enable_grad():
            for p in hf.parameters():
                p.requires_grad_(False)
            for epoch in range(epochs):
                for index in FD.epoch_batches(data.train, batch_size, 0, epoch):
                    losses.append(
                        float(step(chosen, masks, scales, lambda index=index: answer_loss(hf, data.train, index), lr))
                    )
        weights = {n: p.detach().clone() for n, p in chosen.items()}
        end = accuracy()
    finally:
        with torch.no_grad():
            for n, v in before.items():
                chosen[n].copy_(v)
    return {"losses": losses, "weights": weights, "before": before, "accuracy_before": start, "accuracy_after": end}


def moved_table(run: dict, masks: dict[str, torch.Tensor]) -> pd.DataFrame:
    """Per trained parameter of an :func:`sgd_run`: its entries, the entries its mask trains,
    the entries that changed, and how many of those lie outside the mask."""
    rows = []
    for name, w in run["weights"].items():
        changed = w != run["before"][name]
        m = masks.get(name, torch.ones_like(changed)).bool()
        rows.append(
            {
                "parameter": name,
                "entries": changed.numel(),
                "in mask": int(m.sum()),
                "changed": int(changed.sum()),
                "changed outside mask": int((changed & ~m).sum()),
            }
        )
    return pd.DataFrame(rows)
