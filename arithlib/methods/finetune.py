"""The trainer under the papers' fine-tuning: LoRA in one attention layer
(:mod:`arithlib.yu.lora`; Yu & Ananiadou 2024, Sec. 5, Fig. 2, Tables 9-10), precise SFT of
key heads and full SFT (:mod:`arithlib.zhang.sft`; Zhang et al. 2024, Sec. 4.3, Alg. 2, Sec. 5.3,
Tables 1, 2, 5): weights shared with the bridge, data splits and batches, the answer-token
loss under a shared few-shot prefix, the training loop with checkpoints, and trained
weights kept on disk.

Design
------
* **Training runs on a plain HF model that shares its weights with the bridge**
  (:func:`shared_hf_model`): the bridge renames the HF modules it wraps, which peft's
  target matching and clean parameter names need not see; the plain model is built on
  the meta device and takes the bridge's tensors (``load_state_dict(assign=True)``), so
  no second copy of the weights exists and whatever is written into one is seen by the
  other. LoRA leaves the base weights untouched (peft is unloaded after training);
  precise SFT restores the weights it changed; full SFT changes them in place (run it
  last, or on a model you can discard).
* **A fine-tuned model is a set of weights** (:class:`FineTuned.weights`, clean HF
  parameter names -> tensors): for LoRA the merged q/k/v/o weights of its layer
  (W + scaling * B A, what ``merge_and_unload`` computes), for precise SFT the trained
  attention/MLP weights of the layers touched. :func:`use_weights` swaps them into the
  shared model for evaluation or CNA and restores the original exactly afterwards, so
  24 LoRA models cost 24 small weight sets, not 24 models. :func:`to_loaded_model`
  wraps a trained HF model as a :class:`arithlib.core.models.LoadedModel` when a separate
  bridge is wanted.
* **Loss on the answer tokens only**, teacher-forced ("3-5=" -> "-2": every answer token
  given its predecessors). Batches keep few-shot prefix groups (same operator and
  template) together; each group's shared prefix is run once per batch and its keys and
  values are gathered for its rows (:func:`teacher_forced_logits`; gradients flow through
  them), so a batch spanning several small groups still computes each prefix once; the
  rest of every row is right-padded (padding masked out, positions those of the
  unpadded text); logits are computed only at the answer positions. Tested equal to a
  plain full forward.
* **Accuracy** is the teacher-forced version of greedy decoding: every answer token is
  the argmax after its predecessors and the next token does not continue the number
  (the same verdict as ``evaluate.evaluate``'s ``correct_full``).
* **Determinism**: data order comes from ``seed`` and the epoch; LoRA's initialisation
  from ``seed`` (forked RNG); no dropout by default. Same seed -> identical weights on
  the CPU (tested).

Peft provides LoRA; nothing in peft or TransformerLens trains slices of a weight
matrix with per-layer gradient scales (:mod:`arithlib.zhang.sft`) or evaluates answer tokens
under a shared few-shot prefix, hence this module.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import io
import json
import math
import random
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from ..core import datasets as ds
from ..core.datasets import PromptRecord, PromptSet
from ..core.evaluate import continues_number
from ..core.stats import encode_correct
from ..engine import (
    LayerInputs,
    clean_param_name,
    common_prefix,
    decoder_layers,
    input_device,
    module_device,
    rows_on_prefixes,
    shared_hf_model,
)
from ..engine import (
    hf_module as _hf,
)
from ..run.atomic import write_text
from ..run.fingerprints import data_fingerprint, fingerprint, model_fingerprint
from ..run.stored import discard, read_verified, sidecar, write_verified

# --------------------------------------------------------------------------- model plumbing


def params_by_clean_name(model) -> dict[str, torch.nn.Parameter]:
    """``model``'s parameters by clean HF name (no bridge segments)."""
    return {clean_param_name(n): p for n, p in _hf(model).named_parameters()}


@contextlib.contextmanager
def use_weights(model, weights: Mapping[str, torch.Tensor] | None) -> Iterator[None]:
    """Within the block, the parameters named in ``weights`` (clean HF names) hold those
    values (copied in place, so a bridge and a :func:`shared_hf_model` both see them);
    the original values are restored exactly on exit. ``None`` or ``{}``: no change."""
    if not weights:
        yield
        return
    params = params_by_clean_name(model)
    unknown = set(weights) - set(params)
    if unknown:
        raise KeyError(f"unknown parameter(s) {sorted(unknown)[:5]}")
    saved = {}
    try:
        with torch.no_grad():
            for name, value in weights.items():
                p = params[name]
                if p.shape != value.shape:
                    raise ValueError(
                        f"{name}: weight of shape {tuple(value.shape)} for a parameter of {tuple(p.shape)}"
                    )
                saved[name] = p.detach().clone()
                p.copy_(value.to(p.device, p.dtype))
        yield
    finally:
        with torch.no_grad():
            for name, value in saved.items():
                params[name].copy_(value)


@contextlib.contextmanager
def training_state(model) -> Iterator[None]:
    """Within the block the HF model behind ``model`` may change its parameters'
    ``requires_grad`` and ``.grad`` and its modules' train/eval modes; on exit (an
    exception included) every parameter and module present on entry gets them back.
    Kept per object, not per name: a module added in between (peft's LoRA layers,
    removed again by ``unload``) is not tracked, and the base weights it wrapped are the
    same objects, restored like the rest."""
    hf = _hf(model)
    params = [(p, p.requires_grad, p.grad) for p in hf.parameters()]
    modes = [(m, m.training) for m in hf.modules()]
    try:
        yield
    finally:
        for p, flag, grad in params:
            p.grad = grad
            p.requires_grad_(flag)
        for m, training in modes:
            m.training = training


def to_loaded_model(hf_model, tokenizer, name: str = "finetuned", device: str | None = None):
    """Boot a TransformerBridge on a trained HF model (e.g. ``merge_and_unload()``'s
    result) and return it as an :class:`arithlib.core.models.LoadedModel`, the way
    ``models.load_model`` boots a directory (BOS handled like the tokenizer). The
    bridge wraps ``hf_model``'s modules in place: pass a model you hand over (not one
    from :func:`shared_hf_model`)."""
    from transformer_lens.model_bridge import TransformerBridge

    from ..core.models import LoadedModel, model_info, tokenizer_adds_bos

    hf_model = _hf(hf_model)
    device = device or str(input_device(hf_model))
    dtype = next(hf_model.parameters()).dtype
    source = getattr(hf_model.config, "_name_or_path", "") or ""
    bridge = TransformerBridge.boot_transformers(
        source or name, hf_model=hf_model, tokenizer=tokenizer, device=device, dtype=dtype
    )
    bridge.eval()
    bridge.cfg.default_prepend_bos = tokenizer_adds_bos(tokenizer)
    tokenizer.padding_side = bridge.tokenizer.padding_side
    info = model_info(hf_model.config, name=name, source="local", model=hf_model)
    return LoadedModel(bridge=bridge, tokenizer=tokenizer, info=info, device=device, dtype=dtype)


#: Attention projection module names per architecture (q, k, v, o).
ATTENTION_PROJECTIONS: dict[str, tuple[str, str, str, str]] = {
    "llama": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"),
    "mistral": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"),
    "qwen2": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"),
    "qwen3": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"),
    "gptj": ("attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.out_proj"),
}
#: LoRA target modules (suffixes) per architecture, fused projections included.
LORA_TARGETS: dict[str, tuple[str, ...]] = {
    **{arch: names for arch, names in ATTENTION_PROJECTIONS.items()},
    "gpt2": ("attn.c_attn", "attn.c_proj"),
    "gpt_neox": ("attention.query_key_value", "attention.dense"),
}


def architecture(model) -> str:
    """The HF ``model_type`` (``"qwen2"``, ``"llama"``): the key of the projection tables."""
    return str(_hf(model).config.model_type)


def submodule(module: torch.nn.Module, path: str) -> torch.nn.Module:
    """``module``'s submodule at the dotted ``path`` (``"mlp.down_proj"``)."""
    for part in path.split("."):
        module = getattr(module, part)
    return module


def layer_prefix(model, layer: int) -> str:
    """Clean parameter-name prefix of block ``layer`` (e.g. ``model.layers.3.``)."""
    hf = _hf(model)
    block = decoder_layers(hf)[layer]
    for name, module in hf.named_modules():
        if module is block:
            return clean_param_name(name) + "."
    raise RuntimeError("block not found")


def model_shape(model) -> dict[str, int]:
    """n_layers, n_heads, n_kv_heads, d_model, d_head of an HF config."""
    from ..core.models import model_info

    info = model_info(_hf(model).config, name="", source="local")
    return dict(
        n_layers=info.n_layers,
        n_heads=info.n_heads,
        n_kv_heads=info.n_kv_heads,
        d_model=info.d_model,
        d_head=info.d_head,
    )


def count_parameters(model, trainable_only: bool = False) -> int:
    """Number of distinct parameter entries (tied tensors counted once)."""
    seen, total = set(), 0
    for p in _hf(model).parameters():
        if trainable_only and not p.requires_grad:
            continue
        if p.data_ptr() in seen:
            continue
        seen.add(p.data_ptr())
        total += p.numel()
    return total


# --------------------------------------------------------------------------- data


def _record_key(r: PromptRecord) -> tuple:
    return (r.family, r.op, r.a, r.b)


def split_records(
    records: Sequence[PromptRecord], sizes: Mapping[str, int], seed: int = 0
) -> dict[str, list[PromptRecord]]:
    """Disjoint splits of ``records`` with ``sizes`` records each (e.g. ``{"test": 2000,
    "val": 1000, "train": 17000}``, filled in that order), split by operand pair: all
    templates of one (family, operator, a, b) go to the same split, so no test question
    is seen in training in another wording. Pairs are drawn at random (``seed``); a split
    gets fewer than asked only when the pool runs out (ValueError if one gets none)."""
    rng = random.Random(seed)
    groups: dict[tuple, list[PromptRecord]] = {}
    for r in records:
        groups.setdefault(_record_key(r), []).append(r)
    keys = list(groups)
    rng.shuffle(keys)
    out: dict[str, list[PromptRecord]] = {}
    pos = 0
    for name, n in sizes.items():
        chosen: list[PromptRecord] = []
        while len(chosen) < n and pos < len(keys):
            members = groups[keys[pos]][:]
            pos += 1
            rng.shuffle(members)
            chosen.extend(members[: n - len(chosen)])
        if not chosen and n > 0:
            raise ValueError(f"split {name!r} got no records: the pool of {len(records)} records is too small")
        out[name] = chosen
    return out


def yu_lora_data(
    n_train: int = 18_000,
    n_test: int = 2_000,
    n_val: int = 0,
    ops: Sequence[str] = ds.OPS,
    seed: int = 0,
    fewshot: int = 0,
    numerals: str = "digits",
) -> dict[str, list[PromptRecord]]:
    """Yu & Ananiadou Sec. 5's data: 2-digit operands with negative results allowed
    ("13-71=-58"), their four templates per operator (Table 14), 18,000 train / 2,000
    test sentences; ``n_val`` more (held out from train) choose the learning rate. All
    operand pairs of every operator form the pool (so ``/``, with few exact 2-digit
    divisions, is rare); splits are by operand pair (:func:`split_records`)."""
    pool = ds.yu_prompts(
        ops=ops, n_digits=2, numerals=numerals, n_per_template=None, allow_negative=True, seed=seed, fewshot=fewshot
    )
    sizes = {"test": n_test, "val": n_val, "train": n_train}
    splits = split_records(pool, {k: v for k, v in sizes.items() if v > 0}, seed=seed)
    return {k: splits.get(k, []) for k in ("train", "val", "test")}


def word_problem_data(n_train: int, n_test: int, seed: int = 0) -> dict[str, list[PromptRecord]]:
    """Zhang et al.'s word problems (Fig. 10; every template and operand pair with
    A + B < 10), split by operand pair into train and test; counterfactuals dropped
    (fine-tuning does not use them)."""
    pool = [replace(r, counterfactual=None) for r in ds.zhang_word_problems(n_per_template=None, seed=seed)]
    splits = split_records(pool, {"test": n_test, "train": n_train}, seed=seed)
    return {"train": splits["train"], "test": splits["test"]}


def _prefix_key(r: PromptRecord) -> tuple:
    return (r.family, r.op, r.template_id, r.prefix)


def answer_batches(prompts: PromptSet, batch_size: int, shuffle: bool = False, seed: int = 0) -> list[list[int]]:
    """Index batches of ``batch_size`` prompts (the last one may be smaller) that keep
    few-shot prefix groups (family, operator, template) together: the prompts are
    laid out group by group and cut into consecutive batches, so a batch holds one
    group (and shares its prefix) unless groups are smaller than a batch, when it spans
    a few of them. With ``shuffle``: prompts within groups, the order of groups and the
    order of batches are shuffled, from ``seed``."""
    if batch_size < 1:
        raise ValueError("batch_size must be >= 1")
    groups: dict[tuple, list[int]] = {}
    for i, r in enumerate(prompts.records):
        groups.setdefault(_prefix_key(r), []).append(i)
    rng = random.Random(seed)
    order = list(groups.values())
    if shuffle:
        for idx in order:
            rng.shuffle(idx)
        rng.shuffle(order)
    flat = [i for idx in order for i in idx]
    batches = [flat[s : s + batch_size] for s in range(0, len(flat), batch_size)]
    if shuffle:
        rng.shuffle(batches)
    return batches


def epoch_batches(prompts: PromptSet, batch_size: int, seed: int, epoch: int) -> list[list[int]]:
    """The training batches of ``epoch``: their composition is :func:`answer_batches`
    (shuffled) from ``seed`` alone, the same in every epoch; only their order is
    reshuffled per epoch (from ``seed`` and ``epoch``). A batch is thus the same set of
    prompts in every epoch, so the residual stream recorded for it in epoch 1
    (:class:`~arithlib.engine.LayerInputs`, keyed by batch) serves every later
    epoch and every other layer's and learning rate's run: the frozen model's stream is
    recorded once per prompt set, not once per epoch."""
    batches = answer_batches(prompts, batch_size, shuffle=True, seed=seed * 1000)
    order = list(range(len(batches)))
    random.Random(seed * 1000 + 1 + epoch).shuffle(order)
    return [batches[k] for k in order]


# --------------------------------------------------------------------------- answer-position forward


def _row_prefix_lengths(
    prompts: PromptSet, index: Sequence[int], seqs: Sequence[Sequence[int]], starts: Sequence[int]
) -> list[int]:
    """Tokens of each row run in the prefix pass of :func:`teacher_forced_logits`: rows of one
    few-shot prefix group (:func:`_prefix_key`) share the tokens common to all of them;
    a row alone in its group runs its whole prompt but the last token there. Never past
    a row's ``start`` (the position predicting its first answer token)."""
    groups: dict[tuple, list[int]] = {}
    for row, i in enumerate(index):
        groups.setdefault(_prefix_key(prompts.records[i]), []).append(row)
    lengths = [0] * len(index)
    for rows in groups.values():
        p = min(common_prefix([seqs[r] for r in rows]), min(starts[r] for r in rows))
        for r in rows:
            lengths[r] = p
    return lengths


def teacher_forced_logits(
    model,
    prompts: PromptSet,
    index: Sequence[int],
    extra: int = 0,
    share_prefix: bool = True,
    inputs: LayerInputs | None = None,
    same_below: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher-forced logits at the answer positions of prompts ``index``: row i reads
    prompt + answer and gives the logits predicting each answer token (and, with
    ``extra=1``, the token after the answer). Returns ``(logits [B, A, vocab] float32,
    mask [B, A] bool)``, A = longest answer + extra. Differentiable.

    With ``share_prefix`` the rows run in two passes
    (:func:`arithlib.engine.rows_on_prefixes`): first the distinct prefixes
    (:func:`_row_prefix_lengths`: a few-shot group's common tokens, once per group),
    right-padded into one batch; then every row's remaining tokens on top of its
    prefix's keys and values (gathered per row; padded keys masked out, positions
    those of the unpadded text). A batch that spans several groups thus computes each
    group's prefix once instead of every row's whole prompt. Only the answer positions
    are unembedded. Equal to one plain forward per row up to float rounding (tested).

    ``inputs`` (:class:`arithlib.engine.LayerInputs` of this prompt set) with
    ``same_below`` = L, the first block in which ``model`` differs from the reference
    model of ``inputs``: both passes start at the highest layer <= L recorded for this
    batch, and record the layers of ``inputs`` up to L they compute (bit-identical to
    the full pass; Llama-style decoders only, others run in full)."""
    hf = _hf(model)
    unembed = hf.get_output_embeddings()
    seqs = [prompts.input_ids[i] + prompts.answer_ids[i] for i in index]
    starts = [len(prompts.input_ids[i]) - 1 for i in index]  # position predicting answer token 0
    n_keep = [len(prompts.answer_ids[i]) + extra for i in index]  # the token after the answer is
    B = len(seqs)  # predicted at the last answer token
    plen = _row_prefix_lengths(prompts, index, seqs, starts) if share_prefix else [0] * B
    hidden = rows_on_prefixes(
        hf, seqs, plen, inputs=inputs, key=(tuple(index), extra, share_prefix), same_below=same_below
    )
    A = max(n_keep)
    gather = torch.zeros(B, A, dtype=torch.long)
    mask = torch.zeros(B, A, dtype=torch.bool)
    for row, (s, p, k) in enumerate(zip(starts, plen, n_keep)):
        gather[row, :k] = torch.arange(s - p, s - p + k)
        mask[row, :k] = True
    gather = gather.to(hidden.device)
    picked = hidden.gather(1, gather[:, :, None].expand(B, A, hidden.shape[-1]))
    logits = unembed(picked.to(module_device(hf, unembed))).float()  # fp32 for the loss and log-probs
    return logits, mask.to(logits.device)


def _answer_targets(prompts: PromptSet, index: Sequence[int], A: int, device) -> torch.Tensor:
    t = torch.full((len(index), A), -100, dtype=torch.long)
    for row, i in enumerate(index):
        ans = prompts.answer_ids[i]
        t[row, : len(ans)] = torch.tensor(ans)
    return t.to(device)


def answer_loss(
    model,
    prompts: PromptSet,
    index: Sequence[int],
    share_prefix: bool = True,
    inputs: LayerInputs | None = None,
    same_below: int = 0,
) -> torch.Tensor:
    """Mean cross-entropy over the answer tokens of prompts ``index`` (teacher forcing;
    prompt tokens carry no loss). ``inputs``, ``same_below``: as in :func:`teacher_forced_logits`
    (the blocks below ``same_below`` must have no trainable parameter)."""
    logits, _ = teacher_forced_logits(
        model, prompts, index, extra=0, share_prefix=share_prefix, inputs=inputs, same_below=same_below
    )
    targets = _answer_targets(prompts, index, logits.shape[1], logits.device)
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)


@torch.no_grad()
def answer_accuracy(
    model,
    prompts: PromptSet,
    batch_size: int = 32,
    progress: bool = False,
    desc: str = "accuracy",
    share_prefix: bool = True,
    inputs: LayerInputs | None = None,
    same_below: int = 0,
) -> pd.DataFrame:
    """Per-prompt teacher-forced evaluation: ``correct_first`` (first answer token is the
    argmax), ``correct_full`` (every answer token is the argmax after its predecessors
    and the next token does not continue the number: greedy decoding's verdict),
    ``answer_logprob`` (log p of the whole answer) and ``first_logprob``; with the
    prompt's fields (``op``, ``template_id``, ``a``, ``b``, ``answer``, ``family``).
    ``share_prefix``, ``inputs`` and ``same_below``: as in :func:`teacher_forced_logits`."""
    hf = _hf(model)
    was_training = hf.training
    hf.eval()
    tok = prompts.tokenizer
    n = len(prompts)
    first = np.zeros(n, dtype=bool)
    full = np.zeros(n, dtype=bool)
    logprob = np.zeros(n)
    first_lp = np.zeros(n)
    for index in tqdm(answer_batches(prompts, batch_size), desc=desc, disable=not progress, leave=False):
        logits, mask = teacher_forced_logits(
            hf, prompts, index, extra=1, share_prefix=share_prefix, inputs=inputs, same_below=same_below
        )
        answers = [prompts.answer_ids[i] for i in index]
        target = torch.zeros(mask.shape, dtype=torch.long)  # answer ids, padded with 0 (masked out below)
        is_answer = torch.zeros(mask.shape, dtype=torch.bool)
        for row, ans in enumerate(answers):
            target[row, : len(ans)] = torch.tensor(ans)
            is_answer[row, : len(ans)] = True
        # one gather and one device-to-host copy per batch (a GPU syncs once, not per row)
        tok_lp = logits.log_softmax(-1).gather(-1, target.to(logits.device)[..., None])[..., 0].cpu()
        pred = logits.argmax(-1).cpu()
        hit = (pred == target) | ~is_answer
        for row, (i, ans) in enumerate(zip(index, answers)):
            k = len(ans)
            first[i] = bool(hit[row, 0])
            full[i] = bool(hit[row].all()) and not continues_number(tok, int(pred[row, k]))
            logprob[i] = float(tok_lp[row, :k].sum())
            first_lp[i] = float(tok_lp[row, 0])
    hf.train(was_training)
    recs = prompts.records
    return pd.DataFrame(
        {
            "family": [r.family for r in recs],
            "op": [r.op for r in recs],
            "template_id": [r.template_id for r in recs],
            "a": [r.a for r in recs],
            "b": [r.b for r in recs],
            "answer": [r.answer for r in recs],
            "negative": [r.answer < 0 for r in recs],
            "correct_first": first,
            "correct_full": full,
            "answer_logprob": logprob,
            "first_logprob": first_lp,
        }
    )


# --------------------------------------------------------------------------- training loop


@dataclass(frozen=True)
class TrainConfig:
    """One training run. ``epochs`` is the maximum number of epochs (Yu: 4); with a
    validation set the epoch with the best validation accuracy is kept
    (``keep_best``). ``max_steps`` caps the optimizer steps of the whole run (quick
    modes). Learning rate: linear warm-up over ``warmup_ratio`` of the steps, then
    linear decay to 0 (``schedule="linear"``) or constant (``"constant"``)."""

    lr: float = 5e-4
    epochs: int = 1
    batch_size: int = 16
    max_steps: int | None = None
    weight_decay: float = 0.0
    warmup_ratio: float = 0.0
    schedule: str = "linear"
    optimizer: str = "adamw"
    grad_clip: float | None = 1.0
    keep_best: bool = True
    seed: int = 0
    eval_batch_size: int = 32

    def __post_init__(self) -> None:
        if self.lr <= 0 or self.epochs < 1 or self.batch_size < 1:
            raise ValueError("lr must be > 0, epochs and batch_size >= 1")
        if self.optimizer not in ("adamw", "sgd"):
            raise ValueError("optimizer must be 'adamw' or 'sgd'")
        if self.schedule not in ("linear", "constant"):
            raise ValueError("schedule must be 'linear' or 'constant'")
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError("max_steps must be >= 1 or None")


@dataclass
class FineTuned:
    """A fine-tuned model as the weights it changed (clean HF names -> tensors, on the
    CPU), with its training record: ``history`` (step, epoch, loss, lr), ``epochs``
    (epoch, val_accuracy), the kept ``best_epoch``, trainable-parameter count, training
    throughput (samples/s over the optimizer steps only) and a free-form ``info``."""

    method: str
    weights: dict[str, torch.Tensor]
    history: pd.DataFrame
    epochs: pd.DataFrame
    best_epoch: int
    n_trainable: int
    samples_per_second: float
    train_seconds: float
    n_samples: int
    config: TrainConfig
    info: dict = field(default_factory=dict)

    def summary(self) -> dict:
        """One row for a results table."""
        return {
            "method": self.method,
            "lr": self.config.lr,
            "best_epoch": self.best_epoch,
            "n_trainable": self.n_trainable,
            "samples_per_second": self.samples_per_second,
            "train_seconds": self.train_seconds,
            "n_samples": self.n_samples,
            "final_loss": float(self.history["loss"].iloc[-1]) if len(self.history) else float("nan"),
            **{k: v for k, v in self.info.items() if isinstance(v, (int, float, str, bool))},
        }


def _lr_lambda(config: TrainConfig, total: int) -> Callable[[int], float]:
    warm = int(math.ceil(config.warmup_ratio * total))

    def f(step: int) -> float:
        if warm and step < warm:
            return (step + 1) / warm
        if config.schedule == "constant":
            return 1.0
        return max(0.0, (total - step) / max(1, total - warm))

    return f


class Trainable:
    """What a training run updates: named parameters, with optional gradient masks
    (entries outside are frozen) and per-parameter gradient scales."""

    def __init__(
        self,
        params: Mapping[str, torch.nn.Parameter],
        masks: Mapping[str, torch.Tensor] | None = None,
        scales: Mapping[str, torch.Tensor | float] | None = None,
    ):
        self.params = dict(params)
        self.masks = dict(masks or {})
        self.scales = dict(scales or {})

    def n_trainable(self) -> int:
        seen, total = set(), 0
        for name, p in self.params.items():
            if p.data_ptr() in seen:
                continue
            seen.add(p.data_ptr())
            m = self.masks.get(name)
            total += int(m.sum()) if m is not None else p.numel()
        return total


def _state_of(trainable: Trainable) -> dict[str, torch.Tensor]:
    return {n: p.detach().cpu().clone() for n, p in trainable.params.items()}


def _checkpoint_path(checkpoint_dir: Path | None, name: str) -> Path | None:
    return None if checkpoint_dir is None else Path(checkpoint_dir) / name


def _save(path: Path, obj) -> None:
    """``torch.save`` ``obj`` to ``path`` atomically, with its checksum beside it
    (:func:`arithlib.run.stored.write_verified`)."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    write_verified(path, buffer.getvalue())


def _load(path: Path):
    """What :func:`_save` wrote to ``path``, or None: no file, or one that fails its
    checksum or cannot be loaded (then discarded with a warning naming it)."""
    data = read_verified(path)
    if data is None:
        return None
    try:
        return torch.load(io.BytesIO(data), weights_only=False)
    except Exception as exc:  # passed its checksum but not torch.load: written by other code
        discard(path, f"cannot be loaded ({type(exc).__name__}: {exc})")
        return None


def make_optimizer(
    params: Sequence[torch.nn.Parameter], config: TrainConfig, decayed: Sequence[torch.nn.Parameter] = ()
) -> torch.optim.Optimizer:
    """The optimizer of :func:`train_parameters`. AdamW: decoupled weight decay
    (``config.weight_decay``) on the ``decayed`` parameters (the others', masked, is
    applied per entry by the caller), and torch's fused kernel on a CPU or a CUDA
    device: one pass over each parameter and its two moments per step instead of a
    pass per elementwise operation (`benchmarks/optimizer.py`); the same update up to
    float rounding.
    Elsewhere the single-tensor loop (the fused kernel has no other backends). SGD:
    no decay here (the caller's)."""
    if config.optimizer == "sgd":
        return torch.optim.SGD(params, lr=config.lr)
    ids = {id(p) for p in decayed}
    groups = [
        {"params": [p for p in params if id(p) in ids], "weight_decay": config.weight_decay},
        {"params": [p for p in params if id(p) not in ids], "weight_decay": 0.0},
    ]
    fused = all(p.device.type in ("cpu", "cuda") for p in params)
    return torch.optim.AdamW(
        [g for g in groups if g["params"]], lr=config.lr, **({"fused": True} if fused else {"foreach": False})
    )


def train_parameters(
    model,
    trainable: Trainable,
    train_set: PromptSet,
    config: TrainConfig,
    val_set: PromptSet | None = None,
    *,
    progress: bool = True,
    desc: str = "train",
    checkpoint_dir: str | Path | None = None,
    keep_state: bool = True,
    inputs: LayerInputs | None = None,
    unchanged_below: int | None = None,
) -> tuple[dict[str, torch.Tensor], dict]:
    """The training loop shared by LoRA, precise and full SFT: AdamW (or SGD) on
    ``trainable``'s parameters of the HF ``model``, loss on answer tokens, batches from
    :func:`answer_batches` (order from ``config.seed`` and the epoch), gradient masks
    and scales applied before clipping and the step, decoupled weight decay on trained
    entries only. After each epoch: validation accuracy (if ``val_set``) and a
    checkpoint in ``checkpoint_dir`` (trained parameters, optimizer, scheduler, step;
    an interrupted run resumes from the newest one). Returns the kept parameter values
    (the best validation epoch when ``keep_best``, else the last) and a record with
    history, epochs, best_epoch, samples_per_second, train_seconds, n_samples. With
    ``keep_state=False`` no copies are made: the model keeps the last epoch's weights
    and the returned dict is empty (full SFT of a large model). ``inputs``: a
    :class:`~arithlib.engine.LayerInputs` of ``train_set`` shared by the runs on
    one reference model, which ``model`` equals below block ``unchanged_below`` (None:
    everywhere) apart from the trained parameters; the forward passes start at the
    highest block recorded there below both (:func:`first_changed_layer` of the
    trained parameters), as in :func:`teacher_forced_logits`: the same steps and weights bit
    for bit (training batches depend on the config's seed only). Every parameter's
    ``requires_grad`` and ``.grad`` and every module's train/eval mode are as before
    on return, and on an error (:func:`training_state`)."""
    if len(train_set) == 0:
        raise ValueError("empty training set")
    hf = _hf(model)
    params = trainable.params
    low = sorted(
        {str(p.dtype).removeprefix("torch.") for p in params.values() if p.dtype in (torch.bfloat16, torch.float16)}
    )
    if low:  # LoRA adapters are fp32 (peft upcasts them); SFT of a bf16 model's own weights is not
        warnings.warn(
            f"training {', '.join(low)} parameters in place: AdamW keeps its moments in that dtype and "
            "updates below its resolution (about 0.4 % of a weight in bfloat16) are lost; load the model "
            "in float32 (--dtype float32) for full or precise SFT at the paper's learning rates",
            stacklevel=2,
        )
    n_layers = len(decoder_layers(hf))
    same_below = min(n_layers if unchanged_below is None else unchanged_below, first_changed_layer(hf, params))
    with training_state(hf):  # flags, grads and modes come back as they were, even on error
        for p in hf.parameters():
            p.requires_grad_(False)
        for p in params.values():
            p.requires_grad_(True)
        masks = {n: m.to(device=params[n].device, dtype=params[n].dtype) for n, m in trainable.masks.items()}
        grad_mult = {}
        for n, p in params.items():
            mult = masks.get(n)
            scale = trainable.scales.get(n)
            if scale is not None:
                scale = torch.as_tensor(scale, device=p.device, dtype=p.dtype)
                mult = scale if mult is None else mult * scale
            if mult is not None:
                grad_mult[n] = mult
        unique = list({p.data_ptr(): p for p in params.values()}.values())
        # decay of unmasked parameters inside AdamW's step; masked ones (and SGD's) below, per entry
        by_hand = {n for n in params if n in masks or config.optimizer != "adamw"} if config.weight_decay else set()
        opt = make_optimizer(unique, config, [p for n, p in params.items() if n not in by_hand])
        steps_per_epoch = len(answer_batches(train_set, config.batch_size))
        total = steps_per_epoch * config.epochs
        if config.max_steps is not None:
            total = min(total, config.max_steps)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr_lambda(config, total))
        ckdir = Path(checkpoint_dir) if checkpoint_dir is not None else None
        history: list[dict] = []
        epochs: list[dict] = []
        best = (-1.0, 0, None)  # (val acc, epoch, state)
        step, start_epoch, busy, n_samples = 0, 0, 0.0, 0
        if ckdir is not None:
            ck = next((c for c in map(_load, sorted(ckdir.glob("epoch-*.pt"), reverse=True)) if c is not None), None)
            if ck is not None:  # the newest checkpoint that passes its checksum
                with torch.no_grad():
                    for n, v in ck["params"].items():
                        params[n].copy_(v.to(params[n].device))
                opt.load_state_dict(ck["optimizer"])
                sched.load_state_dict(ck["scheduler"])
                step, start_epoch, busy, n_samples = ck["step"], ck["epoch"], ck["busy"], ck["n_samples"]
                history, epochs = ck["history"], ck["epochs"]
                best = (ck["best"][0], ck["best"][1], ck["best"][2])
        hf.train()
        for epoch in range(start_epoch, config.epochs):
            if step >= total:
                break
            batches = epoch_batches(train_set, config.batch_size, config.seed, epoch)
            bar = tqdm(batches, desc=f"{desc} epoch {epoch + 1}/{config.epochs}", disable=not progress, leave=False)
            for index in bar:
                if step >= total:
                    break
                t0 = time.perf_counter()
                loss = answer_loss(hf, train_set, index, inputs=inputs, same_below=same_below)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                with torch.no_grad():
                    for n, mult in grad_mult.items():
                        g = params[n].grad
                        if g is not None:
                            g.mul_(mult)
                    if config.grad_clip is not None:
                        torch.nn.utils.clip_grad_norm_(unique, config.grad_clip)
                    lr_now = opt.param_groups[0]["lr"]
                    for n in by_hand:
                        m = masks.get(n)
                        params[n].mul_(1 - lr_now * config.weight_decay * (m if m is not None else 1.0))
                opt.step()
                sched.step()
                busy += time.perf_counter() - t0
                n_samples += len(index)
                history.append({"step": step, "epoch": epoch, "loss": loss.item(), "lr": lr_now})
                bar.set_postfix(loss=f"{history[-1]['loss']:.3f}")
                step += 1
            hf.eval()
            val_acc = float("nan")
            if val_set is not None and len(val_set):
                val_acc = float(answer_accuracy(hf, val_set, config.eval_batch_size)["correct_full"].mean())
            hf.train()
            epochs.append({"epoch": epoch + 1, "val_accuracy": val_acc, "step": step})
            score = val_acc if not math.isnan(val_acc) else float(epoch)
            if not keep_state:
                best = (score, epoch + 1, None)
            elif not config.keep_best or best[2] is None or score > best[0]:
                best = (score, epoch + 1, _state_of(trainable))
            if ckdir is not None:
                _save(
                    ckdir / f"epoch-{epoch + 1:03d}.pt",
                    {
                        "params": _state_of(trainable),
                        "optimizer": opt.state_dict(),
                        "scheduler": sched.state_dict(),
                        "step": step,
                        "epoch": epoch + 1,
                        "busy": busy,
                        "n_samples": n_samples,
                        "history": history,
                        "epochs": epochs,
                        "best": best,
                    },
                )
    record = {
        "history": pd.DataFrame(history, columns=["step", "epoch", "loss", "lr"]),
        "epochs": pd.DataFrame(epochs, columns=["epoch", "val_accuracy", "step"]),
        "best_epoch": best[1],
        "samples_per_second": n_samples / busy if busy > 0 else float("nan"),
        "train_seconds": busy,
        "n_samples": n_samples,
    }
    if not keep_state:
        return {}, record
    return (best[2] if best[2] is not None else _state_of(trainable)), record


# --------------------------------------------------------------------------- caching trained weights


def cached_training(cache_dir: str | Path | None, key: dict, build: Callable[[Path | None], FineTuned]) -> FineTuned:
    """``build(checkpoint_dir)`` once per ``key``; its FineTuned is stored in
    ``cache_dir/<hash>/result.pt`` and loaded on later calls."""
    if cache_dir is None:
        return build(None)
    folder = Path(cache_dir) / fingerprint(key)
    path = folder / "result.pt"
    stored = _load(path)
    if stored is not None:
        return stored
    result = build(folder / "checkpoints")
    _save(path, result)
    write_text(folder / "key.json", json.dumps(key, indent=1, sort_keys=True, default=str))
    for ck in (folder / "checkpoints").glob("epoch-*.pt"):
        ck.unlink()
        sidecar(ck).unlink(missing_ok=True)
    return result


#: Version of the training code in every cache key: 3 = AdamW's fused kernel (rounds
#: differently from format 2's single-tensor loop); 4 = batches of the same prompts in
#: every epoch, reordered per epoch (:func:`epoch_batches`).
TRAINING_CACHE_FORMAT = 4


def training_key(model, method: str, train_set: PromptSet, val_set: PromptSet | None, config: TrainConfig) -> dict:
    """What a trained result depends on: the method, the model's weights, the data and the
    training settings (no source code: a refactor keeps trained weights)."""
    return {
        "method": method,
        "model": model_fingerprint(model),
        "train": data_fingerprint(train_set),
        "val": data_fingerprint(val_set),
        "config": asdict(config),
        "format": TRAINING_CACHE_FORMAT,
    }


# --------------------------------------------------------------------------- LoRA


def select_lr(
    fit: Callable[[float], FineTuned],
    lrs: Sequence[float],
    val_set: PromptSet,
    evaluate_on: Callable,
) -> tuple[FineTuned, pd.DataFrame]:
    """Train one model per learning rate with ``fit(lr)`` and keep the one with the best
    accuracy on ``val_set`` (``evaluate_on(fine_tuned, val_set)`` -> accuracy; ties go
    to the earlier lr in ``lrs``). Returns the kept model and a table lr, val_accuracy."""
    if not lrs:
        raise ValueError("no learning rates to choose from")
    rows, best = [], None
    for lr in lrs:
        ft = fit(lr)
        acc = float(evaluate_on(ft, val_set))
        rows.append({"lr": lr, "val_accuracy": acc, "best_epoch": ft.best_epoch})
        if best is None or acc > best[0]:
            best = (acc, ft)
    table = pd.DataFrame(rows)
    table["chosen"] = table["lr"] == best[1].config.lr
    return best[1], table


def choose_lr(
    model, fit: Callable[[float], FineTuned], lrs: Sequence[float], val_set: PromptSet | None, batch_size: int = 32
) -> tuple[FineTuned, pd.DataFrame]:
    """:func:`select_lr` with the whole-answer accuracy of ``model`` with the fitted
    weights swapped in (:func:`evaluate_weights`) on ``val_set``; with one lr, or
    without validation prompts, ``fit(lrs[0])`` and a one-row table (val_accuracy NaN)."""
    if len(lrs) > 1 and val_set is not None and len(val_set):

        def val_acc(ft: FineTuned, ps: PromptSet) -> float:
            return float(evaluate_weights(model, ft.weights, {"val": ps}, batch_size)["correct_full"].mean())

        return select_lr(fit, lrs, val_set, val_acc)
    if not lrs:
        raise ValueError("no learning rates to choose from")
    ft = fit(lrs[0])
    return ft, pd.DataFrame([{"lr": lrs[0], "val_accuracy": float("nan"), "best_epoch": ft.best_epoch, "chosen": True}])


def evaluate_weights(
    model,
    weights: Mapping[str, torch.Tensor] | None,
    sets: Mapping[str, PromptSet],
    batch_size: int = 32,
    progress: bool = False,
    inputs: Mapping[str, LayerInputs] | None = None,
    unchanged_below: int | None = None,
) -> pd.DataFrame:
    """:func:`answer_accuracy` of the model with ``weights`` swapped in, on each named
    prompt set, concatenated with a ``set`` column. ``inputs``: a
    :class:`~arithlib.engine.LayerInputs` per set name, recorded from the
    reference model; ``model`` itself equals the reference below block
    ``unchanged_below`` (None: everywhere), and ``weights`` from their first block on
    (:func:`first_changed_layer`), so the passes skip the blocks below the smaller."""
    hf = shared_hf_model(model)
    n_layers = len(decoder_layers(hf))
    same_below = min(n_layers if unchanged_below is None else unchanged_below, first_changed_layer(hf, weights))
    frames = []
    with use_weights(hf, weights):
        for name, ps in sets.items():
            if len(ps):
                frames.append(
                    answer_accuracy(
                        hf,
                        ps,
                        batch_size,
                        progress=progress,
                        desc=name,
                        inputs=(inputs or {}).get(name),
                        same_below=same_below,
                    ).assign(set=name)
                )
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def first_changed_layer(model, weights: Mapping[str, torch.Tensor] | None) -> int:
    """The lowest block holding a parameter named in ``weights`` (clean HF names); the
    number of blocks for no weights, 0 for a parameter outside the blocks (embeddings,
    final norm, unembedding: no block is certain to see the same stream)."""
    blocks = decoder_layers(model)
    if not weights:
        return len(blocks)
    index = {id(b): l for l, b in enumerate(blocks)}
    prefixes = [
        (clean_param_name(name) + ".", index[id(m)]) for name, m in _hf(model).named_modules() if id(m) in index
    ]  # one pass over the modules (not one per block, as layer_prefix)
    return min(next((l for pre, l in prefixes if name.startswith(pre)), 0) for name in weights)


def accuracy_row(frame: pd.DataFrame, **extra) -> dict:
    """One row of accuracies from an :func:`evaluate_weights` frame (all prompts, first
    token, negative and non-negative answers), with ``extra`` columns."""
    neg = frame[frame.negative]
    pos = frame[~frame.negative]
    return {
        **extra,
        "accuracy": float(frame.correct_full.mean()),
        "accuracy_first": float(frame.correct_first.mean()),
        "accuracy_negative": float(neg.correct_full.mean()) if len(neg) else float("nan"),
        "accuracy_nonnegative": float(pos.correct_full.mean()) if len(pos) else float("nan"),
        "mean_answer_logprob": float(frame.answer_logprob.mean()),
        "n_test": len(frame),
        # per-prompt correct_full in test-set order: the paired bootstrap of the report's intervals
        "correct_by_prompt": encode_correct(frame.correct_full.to_numpy()),
    }


# --------------------------------------------------------------------------- layer bands (Yu Fig. 2, Table 10)


# --------------------------------------------------------------------------- CNA on LoRA models (Tables 9, 10)


# --------------------------------------------------------------------------- key heads from notebook 01


# --------------------------------------------------------------------------- precise and full SFT


def available_memory() -> int | None:
    """Bytes of memory available to a new allocation (``MemAvailable``), or None if unknown."""
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:  # pragma: no cover
        try:
            for line in Path("/proc/meminfo").read_text().splitlines():
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
        except OSError:
            return None
    return None


def release_free_memory() -> None:
    """Hand memory the process has freed back to the operating system: Python's cyclic
    garbage, then glibc's free heap pages (``malloc_trim``; nothing elsewhere), so that
    :func:`available_memory` counts it. A process that has run many large evaluations
    otherwise keeps gigabytes of freed heap it no longer uses."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass
