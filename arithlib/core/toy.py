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
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import random
import shutil
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from tqdm.auto import tqdm
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel, PreTrainedTokenizerFast

from ..engine import input_device
from ..run.atomic import sha256_file
from ..run.paths import cache_root, data_dir
from .datasets import apply_op, load_json
from .weights import record_weights

# --------------------------------------------------------------------------- constants

#: Bump when the tokenizer, the data or the training recipe changes: it is part of
#: every :meth:`ToyConfig.key`, so old caches are not reused.
TOY_FORMAT_VERSION = 2

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD, BOS, EOS, UNK)
#: Integers with a token of their own: 0..MAX_NUMBER_TOKEN.
MAX_NUMBER_TOKEN = 999
#: Operators the toy model is trained on (``^`` has a token but no training data).
TOY_OPERATORS: tuple[str, ...] = ("+", "-", "*", "/")
#: Single-character tokens: operators, ``=``, punctuation and the counterfactual symbols.
TOY_SYMBOLS: tuple[str, ...] = (
    "+",
    "-",
    "*",
    "/",
    "=",
    "^",
    "?",
    ":",
    ".",
    ",",
    "!",
    "(",
    ")",
    "<",
    ">",
    "@",
    "#",
    "&",
    "%",
)
NEWLINE = "\n"

#: Words with a token of their own, each also in capitalised form. They cover the
#: prompt templates of Zhang et al. 2024 (App. A) and Yu & Ananiadou 2024 (App. A),
#: Zhang's counterfactual words, and English number words. Extend it here (and bump
#: TOY_FORMAT_VERSION) when a notebook needs more.
TOY_WORDS: tuple[str, ...] = (
    # Zhang et al. templates ("{A} plus {B} equals to", "Q: What is the sum of ...? A:")
    "plus",
    "minus",
    "times",
    "over",
    "equals",
    "equal",
    "to",
    "the",
    "addition",
    "of",
    "and",
    "is",
    "q",
    "a",
    "how",
    "much",
    "what",
    "result",
    "sum",
    "difference",
    "product",
    "ratio",
    "power",
    "exponent",
    # Yu & Ananiadou templates ("The difference between n1 and n2 is", "n1 divides n2 is")
    "between",
    "divides",
    "divided",
    "by",
    "multiplied",
    "added",
    "subtracted",
    "from",
    # counterfactual words (Zhang et al. App. A)
    "none",
    "nothing",
    "null",
    "nil",
    "void",
    "empty",
    "blank",
    # number words
    "zero",
    "one",
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
    "ten",
    "eleven",
    "twelve",
    "thirteen",
    "fourteen",
    "fifteen",
    "sixteen",
    "seventeen",
    "eighteen",
    "nineteen",
    "twenty",
    "thirty",
    "forty",
    "fifty",
    "sixty",
    "seventy",
    "eighty",
    "ninety",
    "hundred",
    "thousand",
    # a little glue for hand-written prompts
    "answer",
    "question",
    "number",
    "numbers",
    "calculate",
    "compute",
    "are",
    "it",
    "in",
    "an",
)

#: Word templates per operator: Zhang et al.'s (Fig. 8) and Yu & Ananiadou's (Table 14)
#: from data/templates.json, without the operator-word brackets and without the
#: symbolic ones ("{A} + {B} ="). ``{A}`` and ``{B}`` are the operands; the answer
#: follows after a space. Used for the optional template training
#: (``ToyConfig.template_frac``) and in the tests.
TOY_TEMPLATES: dict[str, tuple[str, ...]] = {
    op: tuple(
        dict.fromkeys(
            t.replace("[", "").replace("]", "")
            for family in ("zhang", "yu")
            for t in load_json("templates.json")[family][op]
            if not t.endswith("=")
        )
    )
    for op in TOY_OPERATORS
}

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


# --------------------------------------------------------------------------- config


@dataclass(frozen=True)
class ToyConfig:
    """Everything that determines the toy model: architecture, data and training.

    Two configs with equal fields give bit-identical weights on the same machine
    (CPU, same thread count); :meth:`key` names the cache folder.
    """

    seed: int = 0
    # architecture (LlamaConfig: SwiGLU MLP, RMSNorm, RoPE, grouped-query attention)
    n_layers: int = 2
    d_model: int = 128
    n_heads: int = 4
    n_kv_heads: int = 2
    d_mlp: int = 512
    tie_embeddings: bool = False
    number_init: str = "fourier"  # "fourier": numbers start with value/periodic features; "random"
    # data
    max_operand: int = 99  # + and -: a, b in 0..max_operand
    max_mul_operand: int = 31  # *: a, b in 0..31; /: a = b*q with b in 1..31, q in 0..31
    heldout_frac: float = 0.1  # held-out (a, b) pairs per operator
    op_weights: tuple[float, float, float, float] = (0.42, 0.42, 0.08, 0.08)  # + - * /
    shots: int = 4  # solved examples per training sequence, joined by newlines
    template_frac: float = 0.0  # fraction of examples rendered with a word template
    # training
    steps: int = 2000
    batch_size: int = 64  # sequences per step (each holds `shots` examples)
    lr: float = 1e-3
    weight_decay: float = 0.1
    warmup_steps: int = 50
    min_lr_frac: float = 0.05  # cosine decay from lr to lr*min_lr_frac

    def __post_init__(self) -> None:
        if 2 * self.max_operand > MAX_NUMBER_TOKEN or self.max_mul_operand**2 > MAX_NUMBER_TOKEN:
            raise ValueError(f"operands too large: every result must be a single token (<= {MAX_NUMBER_TOKEN})")
        if len(self.op_weights) != len(TOY_OPERATORS):
            raise ValueError(f"op_weights needs one weight per operator {TOY_OPERATORS}")

    def key(self) -> str:
        """A short stable hash of every field (and TOY_FORMAT_VERSION): the cache folder name."""
        payload = json.dumps({"v": TOY_FORMAT_VERSION, **asdict(self)}, sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:12]


# --------------------------------------------------------------------------- tokenizer


def _vocab() -> dict[str, int]:
    """Token -> id: specials, then numbers 0..999 (id = 4 + n), symbols, newline, words."""
    tokens: list[str] = list(SPECIAL_TOKENS)
    tokens += [str(n) for n in range(MAX_NUMBER_TOKEN + 1)]
    tokens += list(TOY_SYMBOLS) + [NEWLINE]
    for word in TOY_WORDS:
        for form in (word, word.capitalize()):
            if form not in tokens:
                tokens.append(form)
    return {tok: i for i, tok in enumerate(tokens)}


def build_tokenizer() -> PreTrainedTokenizerFast:
    """The toy tokenizer: one token per integer 0..999, symbols, newline and TOY_WORDS.

    Pre-tokenization drops spaces/tabs, keeps each newline, and isolates each digit
    run and each punctuation character, so ``"3+5="`` and ``"3 + 5 ="`` both give
    ``[<bos>, 3, +, 5, =]``. Unknown words, integers above 999 and numbers written
    with leading zeros become ``<unk>``. Encoding with ``add_special_tokens=True``
    (the default) prepends ``<bos>``. Decoding joins numbers and symbols without
    spaces and puts spaces around words: ``"Q: What is 3 plus 5? A: 8"``. Padding is
    on the right (the HF default; RoPE positions then stay those of the unpadded text).
    """
    vocab = _vocab()
    tok = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r"[ \t\r\f\v]+"), behavior="removed"),
            pre_tokenizers.Split(Regex(r"\n"), behavior="isolated"),
            pre_tokenizers.Digits(individual_digits=False),
            pre_tokenizers.Punctuation(behavior="isolated"),
        ]
    )
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])]
    )
    tok.decoder = decoders.Sequence(
        [
            decoders.WordPiece(prefix="##", cleanup=False),  # joins tokens with spaces
            decoders.Fuse(),
            # no space between two non-letters ("3 + 5" -> "3+5", "5 \n 3" -> "5\n3") ...
            decoders.Replace(Regex(r"(?<=[^A-Za-z :,;?.!]) (?=[^A-Za-z ])"), ""),
            # ... nor before closing punctuation ("5 ?" -> "5?", "A :" -> "A:")
            decoders.Replace(Regex(r" (?=[?:.,!)])"), ""),
            decoders.Replace(Regex(r"(?<=\() "), ""),
            decoders.Replace(Regex(r" ?\n ?"), "\n"),
        ]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        pad_token=PAD,
        clean_up_tokenization_spaces=False,
        model_max_length=512,
    )


# --------------------------------------------------------------------------- data


def toy_answer(op: str, a: int, b: int) -> int:
    """The integer result of ``a op b``; ``/`` must divide exactly."""
    return apply_op(a, b, op)


def format_answer(c: int) -> str:
    """How a result is written: ``"8"``, or ``"-"`` then the magnitude, ``"-12"``."""
    return str(c) if c >= 0 else f"-{-c}"


def format_example(op: str, a: int, b: int, with_answer: bool = True) -> str:
    """The bare line ``"{a}{op}{b}={c}"`` (Nikankin's format), or its prompt ``"{a}{op}{b}="``."""
    prompt = f"{a}{op}{b}="
    return prompt + format_answer(toy_answer(op, a, b)) if with_answer else prompt


def operand_pairs(cfg: ToyConfig, op: str) -> list[tuple[int, int]]:
    """All (a, b) pairs of an operator in the toy task, in a fixed order."""
    if op in ("+", "-"):
        r = range(cfg.max_operand + 1)
        return [(a, b) for a in r for b in r]
    if op == "*":
        r = range(cfg.max_mul_operand + 1)
        return [(a, b) for a in r for b in r]
    if op == "/":
        return [(b * q, b) for b in range(1, cfg.max_mul_operand + 1) for q in range(cfg.max_mul_operand + 1)]
    raise ValueError(f"unknown operator {op!r}")


def split_pairs(cfg: ToyConfig) -> dict[str, tuple[list[tuple[int, int]], list[tuple[int, int]]]]:
    """Per operator, (train pairs, held-out pairs): a seeded random ``heldout_frac`` is held out."""
    out: dict[str, tuple[list[tuple[int, int]], list[tuple[int, int]]]] = {}
    for i, op in enumerate(TOY_OPERATORS):
        pairs = operand_pairs(cfg, op)
        rng = random.Random(f"toy-heldout-{cfg.seed}-{i}")
        n_held = round(cfg.heldout_frac * len(pairs))
        held = set(rng.sample(range(len(pairs)), n_held))
        out[op] = (
            [p for j, p in enumerate(pairs) if j not in held],
            [p for j, p in enumerate(pairs) if j in held],
        )
    return out


def make_training_examples(cfg: ToyConfig) -> tuple[list[str], list[str]]:
    """(train lines, held-out lines), each line ``"{a}{op}{b}={c}"``, all operators."""
    split = split_pairs(cfg)
    train = [format_example(op, a, b) for op in TOY_OPERATORS for a, b in split[op][0]]
    held = [format_example(op, a, b) for op in TOY_OPERATORS for a, b in split[op][1]]
    return train, held


@dataclass(frozen=True)
class _Encoded:
    """Token ids of every training example of one operator, prompt and answer apart."""

    prompts: list[list[int]]  # bare format, no <bos>
    templated: list[list[list[int]]]  # per example, one prompt per word template
    answers: list[list[int]]  # answer tokens, then the newline


def _encode_examples(cfg: ToyConfig, tokenizer: PreTrainedTokenizerFast) -> list[_Encoded]:
    """Token ids of the training pairs of each operator (in TOY_OPERATORS order)."""
    newline = tokenizer.convert_tokens_to_ids(NEWLINE)
    split = split_pairs(cfg)
    enc: list[_Encoded] = []
    for op in TOY_OPERATORS:
        pairs = split[op][0]

        def ids(texts: list[str]) -> list[list[int]]:
            return tokenizer(texts, add_special_tokens=False)["input_ids"]

        prompts = ids([format_example(op, a, b, with_answer=False) for a, b in pairs])
        answers = [x + [newline] for x in ids([format_answer(toy_answer(op, a, b)) for a, b in pairs])]
        templated: list[list[list[int]]] = [[] for _ in pairs]
        if cfg.template_frac > 0:
            for t in TOY_TEMPLATES[op]:
                for j, x in enumerate(ids([t.format(A=a, B=b) for a, b in pairs])):
                    templated[j].append(x)
        enc.append(_Encoded(prompts, templated, answers))
    return enc


def _batch(
    cfg: ToyConfig, enc: list[_Encoded], step: int, pad_id: int, bos_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The training batch of one step: (input ids, loss mask on the predicted token).

    Each sequence is ``<bos>`` then ``cfg.shots`` solved examples joined by newlines;
    the loss covers every answer token and the newline after it. The batch depends
    only on (seed, step), so a resumed run sees the same data.
    """
    gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
    n = cfg.batch_size * cfg.shots
    ops = torch.multinomial(torch.tensor(cfg.op_weights, dtype=torch.float64), n, True, generator=gen)
    u = torch.rand(n, generator=gen, dtype=torch.float64)
    use_template = torch.rand(n, generator=gen) < cfg.template_frac
    which_template = torch.randint(0, 1 << 30, (n,), generator=gen)
    seqs: list[list[int]] = []
    masks: list[list[bool]] = []
    for i in range(cfg.batch_size):
        seq, mask = [bos_id], [False]
        for j in range(i * cfg.shots, (i + 1) * cfg.shots):
            e = enc[int(ops[j])]
            k = int(u[j] * len(e.prompts))
            if use_template[j] and e.templated[k]:
                prompt = e.templated[k][int(which_template[j]) % len(e.templated[k])]
            else:
                prompt = e.prompts[k]
            seq += prompt + e.answers[k]
            mask += [False] * len(prompt) + [True] * len(e.answers[k])
        seqs.append(seq)
        masks.append(mask)
    width = max(map(len, seqs))
    ids = torch.full((cfg.batch_size, width), pad_id, dtype=torch.long)
    m = torch.zeros((cfg.batch_size, width), dtype=torch.bool)
    for i, (s, mk) in enumerate(zip(seqs, masks)):
        ids[i, : len(s)] = torch.tensor(s)
        m[i, : len(mk)] = torch.tensor(mk)
    return ids, m


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


# --------------------------------------------------------------------------- evaluation


def eval_prefix(op: str) -> str:
    """The two-example prefix used for few-shot evaluation, e.g. ``"3+4=7\\n8+1=9\\n"``.

    Operands as in data/templates.json (``fewshot_operands``).
    """
    operands = load_json("templates.json")["fewshot_operands"][op]
    return "".join(format_example(op, a, b) + NEWLINE for a, b in operands)


def _logits(model: Any, ids: torch.Tensor) -> torch.Tensor:
    """Last-position logits of an HF causal LM or a TransformerBridge."""
    out = model(ids)
    logits = out.logits if hasattr(out, "logits") else out
    return logits[:, -1]


@torch.no_grad()
def toy_generate_answers(
    model: Any,
    tokenizer: PreTrainedTokenizerFast,
    prompts: Sequence[str],
    max_new_tokens: int,
    batch_size: int = 1024,
) -> list[list[int]]:
    """Greedy continuation ids of each prompt, cut at the first newline/EOS (not included).

    Prompts are encoded with ``<bos>`` and grouped by token length, so no padding is
    needed; works with an HF causal LM and with a TransformerBridge.
    """
    stop = {tokenizer.convert_tokens_to_ids(NEWLINE), tokenizer.eos_token_id}
    encoded = tokenizer(list(prompts), add_special_tokens=True)["input_ids"]
    device = input_device(model)
    by_len: dict[int, list[int]] = {}
    for i, e in enumerate(encoded):
        by_len.setdefault(len(e), []).append(i)
    result: list[list[int]] = [[] for _ in prompts]
    for idx in by_len.values():
        for c in range(0, len(idx), batch_size):
            chunk = idx[c : c + batch_size]
            ids = torch.tensor([encoded[i] for i in chunk], device=device)
            new = []
            for _ in range(max_new_tokens):
                nxt = _logits(model, ids).argmax(-1)
                new.append(nxt)
                ids = torch.cat([ids, nxt[:, None]], dim=1)
            gen = torch.stack(new, 1).tolist()
            for i, g in zip(chunk, gen):
                cut = next((j for j, t in enumerate(g) if t in stop), len(g))
                result[i] = g[:cut] if cut < len(g) else g + [-1]  # -1: no terminator seen
    return result


def toy_accuracy(
    model: Any,
    tokenizer: PreTrainedTokenizerFast,
    op: str,
    pairs: list[tuple[int, int]],
    prefix: str = "",
    template: str | None = None,
    batch_size: int = 1024,
) -> float:
    """Greedy exact-match accuracy on ``prefix + "{a}{op}{b}="`` (or ``template``).

    A prompt counts as right when greedy decoding gives exactly the answer's tokens
    followed by a newline. Computed in one teacher-forced pass per prompt: greedy
    decoding yields the answer iff the argmax at every answer position (and at the
    newline) is the next answer token. ``template`` has ``{A}``/``{B}`` slots, e.g.
    ``"Q: What is {A} plus {B}? A:"``. Works on HF models and on TransformerBridge.
    """
    if not pairs:
        return float("nan")
    template = template or f"{{A}}{op}{{B}}="
    newline = tokenizer.convert_tokens_to_ids(NEWLINE)
    prompts = tokenizer([prefix + template.format(A=a, B=b) for a, b in pairs], add_special_tokens=True)
    answers = tokenizer([format_answer(toy_answer(op, a, b)) for a, b in pairs], add_special_tokens=False)
    seqs = [p + a + [newline] for p, a in zip(prompts["input_ids"], answers["input_ids"])]
    n_prompt = [len(p) for p in prompts["input_ids"]]
    groups: dict[tuple[int, int], list[int]] = {}
    for i, (seq, n) in enumerate(zip(seqs, n_prompt)):
        groups.setdefault((len(seq), n), []).append(i)
    device = input_device(model)
    correct = 0
    with torch.no_grad():
        for (length, n), idx in groups.items():
            for c in range(0, len(idx), batch_size):
                ids = torch.tensor([seqs[i] for i in idx[c : c + batch_size]], device=device)
                keep = {"logits_to_keep": length - n} if isinstance(model, PreTrainedModel) else {}
                out = model(ids[:, :-1], **keep)
                logits = out.logits if hasattr(out, "logits") else out
                pred = logits[:, -(length - n) :].argmax(-1)
                correct += int((pred == ids[:, n:]).all(dim=1).sum())
    return correct / len(pairs)


def toy_accuracy_table(model: Any, tokenizer: PreTrainedTokenizerFast, cfg: ToyConfig) -> dict[str, dict[str, float]]:
    """Accuracy per operator on train and held-out pairs, bare and after :func:`eval_prefix`.

    Keys ``"+"`` ... ``"/"``; values ``{"train", "heldout", "all", "train_fewshot",
    "heldout_fewshot", "all_fewshot"}``.
    """
    table: dict[str, dict[str, float]] = {}
    for op, (train, held) in split_pairs(cfg).items():
        row: dict[str, float] = {}
        for suffix, prefix in (("", ""), ("_fewshot", eval_prefix(op))):
            tr = toy_accuracy(model, tokenizer, op, train, prefix)
            he = toy_accuracy(model, tokenizer, op, held, prefix)
            row["train" + suffix] = round(tr, 4)
            row["heldout" + suffix] = round(he, 4)
            row["all" + suffix] = round((tr * len(train) + he * len(held)) / (len(train) + len(held)), 4)
        table[op] = row
    return table


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
