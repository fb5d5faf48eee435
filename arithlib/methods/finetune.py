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
  template) together; each group's shared prefix runs once per batch, packed with the
  rows' remaining tokens into one sequence whose mask lets each row see only its prefix
  and itself (:func:`teacher_forced_logits`; gradients flow through the prefix), so a
  batch spanning several small groups still computes each prefix once and no token is
  padding; logits are computed only at the answer positions. Tested equal to a plain
  full forward.
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

import ctypes
import gc
import io
import json
import math
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pandas as pd
import torch
from tqdm.auto import tqdm

from ..core.prompt_sets import PromptSet
from ..core.stats import encode_correct
from ..engine import (
    LayerInputs,
    clean_param_name,
    decoder_layers,
    kept_gradients,
    shared_hf_model,
)
from ..engine import (
    hf_module as _hf,
)
from ..run.atomic import write_text
from ..run.fingerprints import data_fingerprint, fingerprint, model_fingerprint
from ..run.stored import Store, discard, measured, read_verified, sidecar, write_verified
from .answer_loss import answer_accuracy, answer_loss
from .finetune_data import answer_batches, epoch_batches
from .model_weights import training_state, use_weights

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


def _save(path: Path, obj, seconds: float | None = None, gflop: float | None = None) -> None:
    """``torch.save`` ``obj`` to ``path`` atomically, with its checksum beside it
    (:func:`arithlib.run.stored.write_verified`) and the ``seconds`` and ``gflop`` it
    took when given."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    meta = {k: v for k, v in {"seconds": seconds, "gflop": gflop}.items() if v is not None}
    write_verified(path, buffer.getvalue(), **meta)


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


def clip_gradients(params: Sequence[torch.nn.Parameter], max_norm: float) -> None:
    """``torch.nn.utils.clip_grad_norm_(params, max_norm)``: every gradient scaled by
    ``min(1, max_norm / (||g||_2 + 1e-6))``, ``||g||_2`` the norm of all of them together,
    but without torch's multiplication when that factor is 1 (a pass over every gradient
    that changes none of its bits; torch makes it to avoid a device synchronisation):
    in full SFT a read and a write of 2.5 GB a step. Bit for bit torch's result."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return
    total = torch.nn.utils.get_total_norm(grads)
    if float(max_norm / (total + 1e-6)) < 1.0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)


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
    val_inputs: LayerInputs | None = None,
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
    for bit (training batches depend on the config's seed only); ``val_inputs``, the same
    for ``val_set``: each epoch's validation passes start there too. Every parameter's
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
    # flags, grads and modes come back as they were, even on error; gradients on even when the
    # caller turned them off (a notebook's torch.set_grad_enabled(False)), and off again after
    # embeddings trained from block 0 add their gradients into buffers kept for the training
    # (arithlib.engine.gradients: no fresh vocabulary-sized matrix per step, the same gradient)
    with (
        training_state(hf),
        torch.enable_grad(),
        kept_gradients(hf, params.values() if same_below == 0 else ()) as kept,
    ):
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
                kept.zero_()
                loss.backward()
                with torch.no_grad():
                    for n, mult in grad_mult.items():
                        g = params[n].grad
                        if g is not None:
                            g.mul_(mult)
                    if config.grad_clip is not None:
                        clip_gradients(unique, config.grad_clip)
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
                val_acc = float(
                    answer_accuracy(hf, val_set, config.eval_batch_size, inputs=val_inputs, same_below=same_below)[
                        "correct_full"
                    ].mean()
                )
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


def cached_training(
    cache_dir: str | Path | Store | None, key: dict, build: Callable[[Path | None], FineTuned]
) -> FineTuned:
    """``build(checkpoint_dir)`` once per ``key``; its FineTuned is stored in
    ``cache_dir/<hash>/result.pt`` with the seconds and GFLOP the training took, and loaded
    on later calls. ``cache_dir`` a :class:`~arithlib.run.stored.Store`: its folder, and
    what a loaded result took when it was trained is added to the store's reused time
    (:meth:`Store.credit`), so a run that reuses trained weights still shows their cost."""
    store = cache_dir if isinstance(cache_dir, Store) else Store(cache_dir)
    if store.directory is None:
        return build(None)
    folder = store.directory / fingerprint(key)
    path = folder / "result.pt"
    stored = _load(path)
    if stored is not None:
        store.credit(path)
        return stored
    result, seconds, gflop = measured(lambda: build(folder / "checkpoints"))
    _save(path, result, seconds=seconds, gflop=gflop)
    write_text(folder / "key.json", json.dumps(key, indent=1, sort_keys=True, default=str))
    for ck in (folder / "checkpoints").glob("epoch-*.pt"):
        ck.unlink()
        sidecar(ck).unlink(missing_ok=True)
    return result


#: Version of the training code in every cache key: 3 = AdamW's fused kernel (rounds
#: differently from format 2's single-tensor loop); 4 = batches of the same prompts in
#: every epoch, reordered per epoch (:func:`epoch_batches`); 5 = the batch's prefixes and
#: rows packed into one pass (:func:`arithlib.engine.rows_on_prefixes`; rounds differently
#: from format 4's prefix pass and rows on its gathered keys and values).
TRAINING_CACHE_FORMAT = 5


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
    model,
    fit: Callable[[float], FineTuned],
    lrs: Sequence[float],
    val_set: PromptSet | None,
    batch_size: int = 32,
    val_inputs: LayerInputs | None = None,
    unchanged_below: int | None = None,
) -> tuple[FineTuned, pd.DataFrame]:
    """:func:`select_lr` with the whole-answer accuracy of ``model`` with the fitted
    weights swapped in (:func:`evaluate_weights`; ``val_inputs`` and ``unchanged_below``
    as there) on ``val_set``; with one lr, or without validation prompts, ``fit(lrs[0])``
    and a one-row table (val_accuracy NaN)."""
    if len(lrs) > 1 and val_set is not None and len(val_set):
        inputs = {"val": val_inputs} if val_inputs is not None else None

        def val_acc(ft: FineTuned, ps: PromptSet) -> float:
            return float(
                evaluate_weights(
                    model, ft.weights, {"val": ps}, batch_size, inputs=inputs, unchanged_below=unchanged_below
                )["correct_full"].mean()
            )

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
