"""What the toy model is trained on and how it reads: its vocabulary (one token per
integer 0..999, symbols, newline, the template words), its config (:class:`ToyConfig`:
architecture, data and training), its tokenizer, and the arithmetic examples and
batches of its training set."""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import asdict, dataclass

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from .datasets import apply_op, load_json

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
