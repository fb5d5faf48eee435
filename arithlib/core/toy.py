"""A small Llama-architecture model that arithlib trains from scratch on arithmetic text.

The toy model is the offline test bed of the notebooks and the subject of the
training-dynamics study (Nikankin et al. 2025, Sec. 5). Like Llama-3 in Nikankin's
setting, its tokenizer has ONE token per integer 0..999, so every operand and every
result is a single token. Training is deterministic from ``ToyConfig.seed``; the
checkpoints are complete Hugging Face folders (weights, config, tokenizer) that
``AutoModelForCausalLM.from_pretrained`` and ``TransformerBridge.boot_transformers``
load.

**Shipped weights.** The default config's trained model ships with the repository,
``data/toy/<ToyConfig.key()>/`` (float32 safetensors, config, tokenizer and
``toy_info.json``, about 3.2 MB), with the SHA-256 of every file in ``SHA256SUMS``
there. :func:`toy_model_dir` uses them whenever a config's key has a shipped folder:
it checks the checksums (a mismatch is :class:`ShippedWeightsChanged`, one line saying
how to restore them) and installs a copy into the cache (``shipped/``), so a fresh
clone never trains the model to load it. Training stays available
(:func:`train_toy`, ``python -m arithlib.core.toy --train``) and is how the shipped weights
were made (``python -m arithlib.core.toy --ship`` writes them); weights trained on another
CPU can differ in their last bits, so the slow test compares a new training run's
accuracies with the shipped ones within a tolerance.

**Checkpoints** (the training-dynamics study, notebook 03 on ``toy-arith``) are not
shipped: :func:`toy_checkpoint_dir` trains on demand, only as far as the step asked
for, and resumes from there when a later step is asked for; the last step
(``cfg.steps``) is the model :func:`toy_model_dir` gives (the shipped one when there is
one).

Layout of the cache (``cache_root()/toy/<ToyConfig.key()>/``)::

    shipped/                        the installed copy of the shipped weights, with
                                    COMPLETE, toy_info.json and SHA256SUMS
    step-000000/ ... step-001000/   checkpoints at log-spaced steps
    final/                          the model trained here, written last, with COMPLETE
                                    and toy_info.json (accuracies, time, steps)

Every folder is written under a temporary name and renamed when complete, so an
interrupted run leaves no half-written folder; the next call resumes from the
newest checkpoint (it carries the optimizer state) or starts over.

Run ``python -m arithlib.core.toy`` to print the default model's accuracies (``--train``
trains it here instead of using the shipped weights).

The vocabulary, :class:`ToyConfig`, the tokenizer and the training examples are
:mod:`arithlib.core.toy_data`'s; the accuracy evaluation is :mod:`arithlib.core.toy_eval`'s.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from ..run.atomic import sha256_file
from ..run.paths import cache_root, data_dir
from .toy_data import MAX_NUMBER_TOKEN, ToyConfig, _batch, _encode_examples, build_tokenizer
from .toy_eval import toy_accuracy_table
from .weights import record_weights

#: Name of the marker file in a finished ``final/`` folder.
COMPLETE_MARKER = "COMPLETE"
#: Training state (optimizer, step) kept in the newest checkpoint folder only.
TRAINING_STATE = "training_state.pt"
TOY_INFO = "toy_info.json"
_TMP_PREFIX = ".tmp-"
#: The files of a shipped model (``data/toy/<key>/``), each with its SHA-256 in
#: :data:`SHIPPED_SUMS` (the format of ``sha256sum``: ``sha256sum -c SHA256SUMS`` checks them).
SHIPPED_FILES: tuple[str, ...] = (
    "model.safetensors",
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    TOY_INFO,
)
SHIPPED_SUMS = "SHA256SUMS"


# --------------------------------------------------------------------------- model


def toy_llama_config(cfg: ToyConfig, tokenizer: PreTrainedTokenizerFast) -> LlamaConfig:
    """The LlamaConfig of the toy model (SwiGLU, RMSNorm, RoPE, grouped-query attention)."""
    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=cfg.d_model,
        intermediate_size=cfg.d_mlp,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads,
        head_dim=cfg.d_model // cfg.n_heads,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=cfg.tie_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        attention_dropout=0.0,
    )


#: Periods of the cos/sin features that number embeddings start with (``number_init="fourier"``);
#: pretrained LLMs' number embeddings have features of periods 2, 5, 10, ... (Zhou et al. 2024).
FOURIER_PERIODS: tuple[float, ...] = (2, 5, 10, 20, 50, 100, 200, 500, 1000)


def number_features(n_numbers: int = MAX_NUMBER_TOKEN + 1, periods: Sequence[float] = FOURIER_PERIODS) -> torch.Tensor:
    """[n_numbers, 2*len(periods)+1] features of each integer: cos/sin(2 pi n / T) per period T, and n/n_numbers."""
    n = torch.arange(n_numbers, dtype=torch.float64)[:, None]
    ang = 2 * math.pi * n / torch.tensor(periods, dtype=torch.float64)[None, :]
    lin = (n / n_numbers - 0.5) * 2
    return torch.cat([ang.cos(), ang.sin(), lin], dim=1).float()


def init_toy_model(cfg: ToyConfig, tokenizer: PreTrainedTokenizerFast) -> LlamaForCausalLM:
    """A freshly initialised toy model, deterministic from ``cfg.seed``.

    With ``number_init="fourier"`` the embedding and unembedding rows of the number
    tokens 0..999 are set to the :func:`number_features` of the number, written into a
    random (seeded) orthonormal subspace, so that numbers start ordered and periodic
    as pretrained LLMs' number embeddings are (Zhou et al. 2024); it makes training
    faster. ``"random"``: the plain Llama init (numbers start as unrelated vectors).
    """
    torch.manual_seed(cfg.seed)
    model = LlamaForCausalLM(toy_llama_config(cfg, tokenizer))
    if cfg.number_init == "fourier":
        gen = torch.Generator().manual_seed(cfg.seed + 7919)
        feats = number_features()
        k = min(feats.shape[1], cfg.d_model)
        feats = feats[:, :k]
        basis, _ = torch.linalg.qr(torch.randn(cfg.d_model, k, generator=gen))  # orthonormal columns
        scale = 0.02 * math.sqrt(cfg.d_model) * 2 / math.sqrt(k / 2)
        ids = tokenizer.convert_tokens_to_ids([str(n) for n in range(MAX_NUMBER_TOKEN + 1)])
        with torch.no_grad():
            model.model.embed_tokens.weight[ids] = scale * feats @ basis.T
            if not cfg.tie_embeddings:
                model.lm_head.weight[ids] = scale * feats @ basis.T
    elif cfg.number_init != "random":
        raise ValueError(f"number_init must be 'fourier' or 'random', not {cfg.number_init!r}")
    return model


def checkpoint_steps(steps: int) -> list[int]:
    """Log-spaced checkpoint steps: 0, 10, 20, 50, 100, 200, 500, ... below ``steps``, then ``steps``."""
    out = [0]
    scale = 10
    while True:
        for m in (1, 2, 5):
            if m * scale >= steps:
                return out + [steps]
            out.append(m * scale)
        scale *= 10


def _lr_factor(cfg: ToyConfig, step: int) -> float:
    """Linear warm-up, then cosine decay to ``min_lr_frac`` at ``cfg.steps``."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    t = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.min_lr_frac + (1 - cfg.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * min(1.0, t)))


def _loss(model: LlamaForCausalLM, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of the tokens where ``mask`` is set (unembedding only there)."""
    hidden = model.model(input_ids=ids).last_hidden_state[:, :-1]
    target = mask[:, 1:]
    return F.cross_entropy(model.lm_head(hidden[target]), ids[:, 1:][target])


def _make_optimizer(cfg: ToyConfig, model: torch.nn.Module) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (not on norms)."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr,
        betas=(0.9, 0.98),
        eps=1e-8,
        foreach=False,
    )


# --------------------------------------------------------------------------- checkpoints


def _step_dir(run_dir: Path, step: int) -> Path:
    return run_dir / f"step-{step:06d}"


def _write_atomically(final_path: Path, write: Any) -> None:
    """Call ``write(tmp_dir)`` on a fresh temporary folder, then rename it to ``final_path``."""
    tmp = final_path.parent / f"{_TMP_PREFIX}{final_path.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    write(tmp)
    if final_path.exists():
        shutil.rmtree(final_path)
    os.replace(tmp, final_path)


def _save_checkpoint(
    path: Path,
    model: LlamaForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    extra: dict[str, Any] | None = None,
    json_files: dict[str, Any] | None = None,
) -> None:
    """Write a complete HF folder (weights, config, tokenizer) plus optional files, atomically."""

    def write(tmp: Path) -> None:
        model.save_pretrained(tmp)
        record_weights(tmp)  # checked whenever it is loaded (arithlib.core.weights)
        tokenizer.save_pretrained(tmp)
        if extra is not None:
            torch.save(extra, tmp / TRAINING_STATE)
        for name, obj in (json_files or {}).items():
            (tmp / name).write_text(json.dumps(obj, indent=1) if not isinstance(obj, str) else obj)

    _write_atomically(path, write)


def _latest_resumable(run_dir: Path) -> tuple[int, Path] | None:
    """The newest checkpoint folder that still has a training state, if any."""
    best: tuple[int, Path] | None = None
    for d in run_dir.glob("step-*"):
        state = d / TRAINING_STATE
        if not state.exists():
            continue
        try:
            step = int(d.name.split("-")[1])
        except ValueError:
            continue
        if best is None or step > best[0]:
            best = (step, d)
    return best


@contextlib.contextmanager
def _torch_settings(num_threads: int | None) -> Iterator[None]:
    """Deterministic algorithms and a fixed thread count inside the block, restored after."""
    old_det = torch.are_deterministic_algorithms_enabled()
    old_threads = torch.get_num_threads()
    try:
        torch.use_deterministic_algorithms(True)
        if num_threads:
            torch.set_num_threads(num_threads)
        yield
    finally:
        torch.use_deterministic_algorithms(old_det)
        torch.set_num_threads(old_threads)


@contextlib.contextmanager
def _quiet_hf() -> Iterator[None]:
    """Hide transformers' own progress bars (shard writing, weight loading) inside the block."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


@contextlib.contextmanager
def _run_lock(run_dir: Path) -> Iterator[None]:
    """An exclusive file lock on a run folder, so two processes do not train the same config."""
    run_dir.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        yield
        return
    with open(run_dir / ".lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


# --------------------------------------------------------------------------- training


def train_toy(
    cfg: ToyConfig,
    out_dir: Path,
    progress: bool = True,
    num_threads: int | None = 2,
    evaluate: bool = True,
    until: int | None = None,
) -> Path:
    """Train the toy model of ``cfg`` into ``out_dir`` and return ``out_dir/final``.

    Writes checkpoints ``out_dir/step-NNNNNN`` at :func:`checkpoint_steps` and the
    final model last (with ``COMPLETE`` and ``toy_info.json``: parameters, training
    time, checkpoint steps and, if ``evaluate``, greedy accuracies). Returns at once
    when ``final`` is complete; resumes from the newest checkpoint otherwise.
    ``num_threads`` sets torch's CPU threads during training (None: leave as is).
    ``until`` (a checkpoint step below ``cfg.steps``): train only as far as that
    checkpoint (it keeps the optimizer state, so a later call goes on from it) and
    return its folder; at once when it exists.
    """
    out_dir = Path(out_dir)
    if until is not None and until < cfg.steps:
        if until not in checkpoint_steps(cfg.steps):
            raise ValueError(f"until={until} is not a checkpoint step of this config: {checkpoint_steps(cfg.steps)}")
        target = _step_dir(out_dir, until)
    else:
        until, target = None, out_dir / "final"
    with _run_lock(out_dir):
        if (target / (COMPLETE_MARKER if until is None else "config.json")).exists():
            return target
        for leftover in out_dir.glob(f"{_TMP_PREFIX}*"):
            shutil.rmtree(leftover, ignore_errors=True)
        with _torch_settings(num_threads), _quiet_hf():
            _train(cfg, out_dir, progress, evaluate, until)
    return target


def _train(cfg: ToyConfig, out_dir: Path, progress: bool, evaluate: bool, until: int | None = None) -> None:
    """The training loop behind :func:`train_toy` (lock held, torch settings applied);
    with ``until``, stops after saving that checkpoint."""
    tokenizer = build_tokenizer()
    enc = _encode_examples(cfg, tokenizer)
    model = init_toy_model(cfg, tokenizer)
    model.train()
    opt = _make_optimizer(cfg, model)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _lr_factor(cfg, s))
    start, elapsed = 0, 0.0
    resume = _latest_resumable(out_dir)
    if resume is not None and until is not None and resume[0] > until:
        resume = None  # the asked-for checkpoint lies before the newest one (it was deleted): train from the start
    if resume is not None:
        state = torch.load(resume[1] / TRAINING_STATE, weights_only=True)
        if state.get("key") == cfg.key():
            model = LlamaForCausalLM.from_pretrained(resume[1], dtype=torch.float32)
            model.train()
            opt = _make_optimizer(cfg, model)
            # the scheduler first: building it resets the lr that the optimizer state restores
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _lr_factor(cfg, s))
            opt.load_state_dict(state["optimizer"])
            sched.load_state_dict(state["scheduler"])
            start, elapsed = state["step"], state["elapsed_s"]
    save_at = [s for s in checkpoint_steps(cfg.steps) if s < cfg.steps]
    prev_state: Path | None = resume[1] / TRAINING_STATE if resume is not None else None

    def save(step: int, spent: float) -> None:
        nonlocal prev_state
        extra = {
            "key": cfg.key(),
            "step": step,
            "elapsed_s": spent,
            "optimizer": opt.state_dict(),
            "scheduler": sched.state_dict(),
        }
        _save_checkpoint(_step_dir(out_dir, step), model, tokenizer, extra)
        if prev_state is not None and prev_state.parent != _step_dir(out_dir, step):
            prev_state.unlink(missing_ok=True)  # only the newest checkpoint keeps optimizer state
        prev_state = _step_dir(out_dir, step) / TRAINING_STATE

    t0 = time.perf_counter() - elapsed
    cpu0 = time.process_time()
    if start == 0 and 0 in save_at:
        save(0, 0.0)
    end = cfg.steps if until is None else until
    bar = tqdm(range(start, end), initial=start, total=end, disable=not progress, desc="toy")
    pad_id, bos_id = tokenizer.pad_token_id, tokenizer.bos_token_id
    for step in bar:
        ids, mask = _batch(cfg, enc, step, pad_id, bos_id)
        loss = _loss(model, ids, mask)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if progress and (step % 10 == 0 or step == cfg.steps - 1):
            bar.set_postfix(loss=f"{loss.item():.4f}")
        if step + 1 in save_at:
            save(step + 1, time.perf_counter() - t0)
    if until is not None:
        return  # the checkpoint at `until` is saved, with the optimizer state to go on from
    train_s = time.perf_counter() - t0
    model.eval()
    info: dict[str, Any] = {
        "config": asdict(cfg),
        "key": cfg.key(),
        "n_params": sum(p.numel() for p in model.parameters()),
        "train_seconds": round(train_s, 1),
        "train_cpu_seconds": round(time.process_time() - cpu0, 1),  # this process only, not resumed parts
        "torch_threads": torch.get_num_threads(),
        "checkpoint_steps": checkpoint_steps(cfg.steps),
    }
    if evaluate:
        t1 = time.perf_counter()
        info["accuracy"] = toy_accuracy_table(model, tokenizer, cfg)
        info["eval_seconds"] = round(time.perf_counter() - t1, 1)
    _save_checkpoint(out_dir / "final", model, tokenizer, json_files={TOY_INFO: info, COMPLETE_MARKER: "ok\n"})
    if prev_state is not None:
        prev_state.unlink(missing_ok=True)


# --------------------------------------------------------------------------- cache API


class ShippedWeightsChanged(RuntimeError):
    """A file of the shipped toy model does not match its recorded SHA-256 (the message,
    one line, names it and says how to restore it)."""


def toy_run_dir(cfg: ToyConfig = ToyConfig()) -> Path:
    """``cache_root()/toy/<cfg.key()>``: the folder of one config's checkpoints."""
    return cache_root() / "toy" / cfg.key()


def shipped_dir(cfg: ToyConfig = ToyConfig()) -> Path | None:
    """``data/toy/<cfg.key()>``, the trained model shipped with the repository, or None
    when ``cfg`` has none (any config but the default, as a rule)."""
    folder = data_dir() / "toy" / cfg.key()
    return folder if (folder / SHIPPED_SUMS).is_file() else None


def read_sums(folder: Path) -> dict[str, str]:
    """File name -> SHA-256 from ``folder/SHA256SUMS`` (``sha256sum``'s format)."""
    sums: dict[str, str] = {}
    for line in (Path(folder) / SHIPPED_SUMS).read_text().splitlines():
        if line.strip():
            digest, name = line.split(maxsplit=1)
            sums[name.lstrip("*")] = digest
    return sums


def verify_shipped(folder: Path) -> dict[str, str]:
    """Check every file of the shipped model ``folder`` against its ``SHA256SUMS``;
    return the sums. :class:`ShippedWeightsChanged` names the first file that is
    missing or differs."""
    folder = Path(folder)
    sums = read_sums(folder)
    restore = (
        f"restore the shipped files (git checkout -- {folder.name} in {folder.parent}, or a fresh clone), "
        "or train the model here: python -m arithlib.core.toy --train"
    )
    for name in SHIPPED_FILES:
        if name not in sums:
            raise ShippedWeightsChanged(f"{folder / SHIPPED_SUMS} has no checksum for {name}; {restore}")
    for name, digest in sums.items():
        path = folder / name
        if not path.is_file():
            raise ShippedWeightsChanged(f"shipped toy model file {path} is missing; {restore}")
        now = sha256_file(path)
        if now != digest:
            raise ShippedWeightsChanged(
                f"shipped toy model file {path} does not match its SHA-256 in {SHIPPED_SUMS} "
                f"({now[:16]}, recorded {digest[:16]}; a Git LFS pointer or an edit?); {restore}"
            )
    return sums


def install_shipped(cfg: ToyConfig = ToyConfig()) -> Path:
    """Check the shipped model of ``cfg`` (:func:`verify_shipped`) and return its
    installed copy ``toy_run_dir(cfg)/shipped`` (copied there, with its weight record
    (:mod:`arithlib.core.weights`) and ``COMPLETE``, when missing or when the shipped files
    changed). FileNotFoundError when ``cfg`` has no shipped model."""
    src = shipped_dir(cfg)
    if src is None:
        raise FileNotFoundError(f"no shipped toy model for config key {cfg.key()} in {data_dir() / 'toy'}")
    sums = verify_shipped(src)
    run = toy_run_dir(cfg)
    dst = run / "shipped"
    with _run_lock(run):
        if (dst / COMPLETE_MARKER).exists() and (dst / SHIPPED_SUMS).is_file() and read_sums(dst) == sums:
            return dst

        def write(tmp: Path) -> None:
            for name in [*sums, SHIPPED_SUMS]:
                shutil.copyfile(src / name, tmp / name)
            record_weights(tmp)  # checked whenever it is loaded (arithlib.core.weights)
            (tmp / COMPLETE_MARKER).write_text("ok\n")

        _write_atomically(dst, write)
    return dst


def installed_model_dir(cfg: ToyConfig = ToyConfig()) -> Path:
    """Where the model of ``cfg`` is (or will be) installed, without installing or
    training anything: ``shipped/`` when ``cfg`` has shipped weights, else ``final/``."""
    return toy_run_dir(cfg) / ("shipped" if shipped_dir(cfg) is not None else "final")


def toy_model_dir(cfg: ToyConfig = ToyConfig(), progress: bool = True) -> Path:
    """The HF folder of the trained toy model of ``cfg``: the shipped weights when
    ``cfg`` has them (:func:`install_shipped`), else the model trained here (trained
    first if missing)."""
    if shipped_dir(cfg) is not None:
        return install_shipped(cfg)
    final = toy_run_dir(cfg) / "final"
    if (final / COMPLETE_MARKER).exists():
        return final
    return train_toy(cfg, toy_run_dir(cfg), progress=progress)


def toy_checkpoint_steps(cfg: ToyConfig = ToyConfig()) -> list[int]:
    """The steps :func:`toy_checkpoint_dir` has (nothing trained to list them)."""
    return checkpoint_steps(cfg.steps)


def toy_checkpoint_dir(cfg: ToyConfig, step: int, progress: bool = True) -> Path:
    """The HF folder of checkpoint ``step`` of ``cfg``'s training run: trained here on
    demand, only as far as ``step`` (a later step goes on from the newest checkpoint);
    the last step (``cfg.steps``) is :func:`toy_model_dir`'s model."""
    steps = toy_checkpoint_steps(cfg)
    if step not in steps:
        raise ValueError(f"the toy model has no checkpoint at step {step}; its steps: {steps}")
    if step == cfg.steps:
        return toy_model_dir(cfg, progress=progress)
    run = toy_run_dir(cfg)
    folder = train_toy(cfg, run, progress=progress, until=step)
    if not (folder / "config.json").exists():
        raise FileNotFoundError(f"toy checkpoint {step} missing under {run}; delete {run} to retrain")
    return folder


def toy_checkpoint_dirs(cfg: ToyConfig = ToyConfig(), progress: bool = True) -> dict[int, Path]:
    """Training step -> HF folder of every checkpoint (:func:`toy_checkpoint_dir`; the
    last is :func:`toy_model_dir`'s model); trains what is missing."""
    steps = toy_checkpoint_steps(cfg)
    last_missing = max(
        (s for s in steps[:-1] if not (_step_dir(toy_run_dir(cfg), s) / "config.json").exists()), default=None
    )
    if last_missing is not None:  # one training run as far as the last missing checkpoint
        toy_checkpoint_dir(cfg, last_missing, progress=progress)
    return {s: toy_checkpoint_dir(cfg, s, progress=progress) for s in steps}


def toy_info(cfg: ToyConfig = ToyConfig()) -> dict[str, Any]:
    """The ``toy_info.json`` of the model (accuracies, time, steps); trains if missing."""
    return json.loads((toy_model_dir(cfg) / TOY_INFO).read_text())


def ship_toy(cfg: ToyConfig = ToyConfig(), dest: Path | None = None, progress: bool = True) -> Path:
    """Write the model of ``cfg`` trained here (trained first if missing) as its shipped
    copy ``dest`` (default ``data/toy/<cfg.key()>`` of this checkout): the files of
    :data:`SHIPPED_FILES` and their ``SHA256SUMS``. Returns ``dest``."""
    final = train_toy(cfg, toy_run_dir(cfg), progress=progress)
    dest = Path(dest) if dest is not None else data_dir() / "toy" / cfg.key()
    dest.mkdir(parents=True, exist_ok=True)
    lines = []
    for name in SHIPPED_FILES:
        shutil.copyfile(final / name, dest / name)
        lines.append(f"{sha256_file(dest / name)}  {name}")
    (dest / SHIPPED_SUMS).write_text("\n".join(lines) + "\n")
    return dest


def accuracy_differences(a: dict[str, dict[str, float]], b: dict[str, dict[str, float]]) -> dict[str, float]:
    """``"op/column"`` -> |a - b| for every accuracy of two :func:`toy_accuracy_table` results."""
    return {f"{op}/{col}": abs(a[op][col] - b[op][col]) for op in a for col in a[op]}


def main(argv: Sequence[str] | None = None) -> None:
    """Print the default toy model's accuracies and where it is (the shipped weights);
    ``--train``: train it here (or reuse this machine's training run) and compare its
    accuracies with the shipped ones; ``--ship``: write the model trained here as the
    shipped copy in data/toy/."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m arithlib.core.toy", description=main.__doc__)
    ap.add_argument(
        "--train", action="store_true", help="train the default model here instead of using the shipped one"
    )
    ap.add_argument(
        "--ship", action="store_true", help="write the model trained here to data/toy/<key>/ (trains first)"
    )
    args = ap.parse_args(argv)
    cfg = ToyConfig()
    t0 = time.perf_counter()
    if args.ship:
        print(f"shipped copy written to {ship_toy(cfg)}")
        return
    final = train_toy(cfg, toy_run_dir(cfg)) if args.train else toy_model_dir(cfg)
    info = json.loads((final / TOY_INFO).read_text())
    print(f"toy model: {final}")
    print(
        f"parameters: {info['n_params']:,}; training time: {info['train_seconds']} s "
        f"(this call {time.perf_counter() - t0:.1f} s); checkpoints at steps {info['checkpoint_steps']}"
    )
    for op, row in info.get("accuracy", {}).items():
        print(f"  {op}: " + "  ".join(f"{k} {100 * v:.1f}%" for k, v in row.items()))
    shipped = shipped_dir(cfg)
    if args.train and shipped is not None and info.get("accuracy"):
        diffs = accuracy_differences(info["accuracy"], json.loads((shipped / TOY_INFO).read_text())["accuracy"])
        worst = max(diffs, key=diffs.get)
        print(f"largest difference from the shipped model's accuracies: {worst} {100 * diffs[worst]:.1f} points")


if __name__ == "__main__":
    main()
