"""General ability of a (fine-tuned) model without any download: Zhang et al. 2024
(Sec. 5.3, Tables 1, 2, 5) check that precise SFT keeps a model's generic skills (MMLU,
CSQA) while full SFT loses some. Offline stand-ins, computed the same way for every
model compared:

* **Language-model loss on fixed English prose** that ships with Python itself: the
  documentation text of ``pydoc_data.topics`` (the reference manual's topics that
  ``help()`` shows). Selection (:func:`pydoc_prose`): topics in sorted order, each
  split into paragraphs at blank lines; a paragraph is kept when none of its lines is
  indented (code and grammar blocks are), it has no ``::=``, is at least 200
  characters long and at least 80 % letters and spaces; its lines are joined with
  spaces. The first ``n_chars`` characters of the kept paragraphs, joined by blank
  lines, form the sample. The text depends on the Python version (recorded with a
  sha256 in :class:`ProseSample`). Metric: mean next-token negative log-likelihood
  (nats/token) over fixed-length chunks (:func:`lm_loss`), and its perplexity.
* **Factual recall** (``data/factual_recall.json``, written for this repository, ours,
  not a published benchmark): 55 prompts such as "The capital of France is" ->
  " Paris" whose answer is one token for the Qwen2.5 tokenizer; accuracy = the
  answer's first token is the greedy next token (:func:`factual_recall`).
* **Users' own copies of the papers' benchmarks**: GSM8K (JSONL, ``question`` /
  ``answer`` ending in ``#### N``), SVAMP (JSON list or JSONL with ``Body``,
  ``Question``, ``Answer``) and MMLU (the per-subject CSVs: question, four choices,
  answer letter, no header). Loaders and scorers: :func:`load_gsm8k`,
  :func:`load_svamp`, :func:`load_mmlu`, :func:`word_problem_accuracy` (greedy
  generation, last number in the output), :func:`mmlu_accuracy` (zero-shot, the
  choice letter with the highest next-token logit).

All scorers take an HF causal LM or a TransformerLens bridge (its HF model is used).
"""

from __future__ import annotations

import csv
import hashlib
import json
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from ..engine import forward, greedy_tokens, input_device
from ..run.paths import DATA_DIR

FACTS_FILE = DATA_DIR / "factual_recall.json"


# --------------------------------------------------------------------------- prose sample


@dataclass(frozen=True)
class ProseSample:
    """The fixed English text sample: text, the topics it came from, the Python version
    whose ``pydoc_data`` supplied it, and the text's sha256."""

    text: str
    topics: tuple[str, ...]
    python_version: str
    sha256: str


def _is_prose(paragraph: str, min_chars: int, min_letter_share: float) -> bool:
    lines = paragraph.split("\n")
    if any(line[:1].isspace() for line in lines) or "::=" in paragraph:
        return False
    text = " ".join(line.strip() for line in lines)
    if len(text) < min_chars:
        return False
    letters = sum(c.isalpha() or c == " " for c in text)
    return letters / len(text) >= min_letter_share


def pydoc_prose(n_chars: int = 20_000, min_chars: int = 200, min_letter_share: float = 0.8) -> ProseSample:
    """The first ``n_chars`` characters of prose paragraphs of ``pydoc_data.topics``
    (selection rule in the module docstring), joined by blank lines, cut at a
    paragraph boundary once ``n_chars`` is reached."""
    from pydoc_data.topics import topics

    kept, used, total = [], [], 0
    for name in sorted(topics):
        took = False
        for para in re.split(r"\n\s*\n", topics[name]):
            para = para.strip("\n")
            if _is_prose(para, min_chars, min_letter_share):
                text = " ".join(line.strip() for line in para.split("\n"))
                kept.append(text)
                total += len(text) + 2
                took = True
                if total >= n_chars:
                    break
        if took:
            used.append(name)
        if total >= n_chars:
            break
    text = "\n\n".join(kept)
    return ProseSample(
        text=text,
        topics=tuple(used),
        python_version=sys.version.split()[0],
        sha256=hashlib.sha256(text.encode()).hexdigest(),
    )


@torch.no_grad()
def lm_loss(
    model,
    tokenizer,
    text: str,
    chunk_tokens: int = 128,
    max_chunks: int | None = None,
    batch_size: int = 8,
    progress: bool = False,
) -> dict[str, float]:
    """Mean next-token negative log-likelihood (nats/token) of ``text`` cut into
    consecutive chunks of ``chunk_tokens`` tokens (the first ``max_chunks`` of them;
    a shorter tail is dropped), each chunk scored on its own from its first token
    (BOS prepended where the tokenizer adds one). Also perplexity, token count and the
    share of unknown tokens (a tokenizer without an English vocabulary, such as the
    toy model's, gives a meaningless loss: check ``unk_share``)."""
    if chunk_tokens < 2:
        raise ValueError("chunk_tokens must be >= 2")
    device = input_device(model)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    n = len(ids) // chunk_tokens
    if max_chunks is not None:
        n = min(n, max_chunks)
    if n == 0:
        raise ValueError(f"text of {len(ids)} tokens has no full chunk of {chunk_tokens}")
    chunks = torch.tensor(ids[: n * chunk_tokens]).view(n, chunk_tokens)
    bos = tokenizer.bos_token_id
    adds_bos = bos is not None and tokenizer("a")["input_ids"][:1] == [bos]
    if adds_bos:
        chunks = torch.cat([torch.full((n, 1), bos), chunks], 1)
    total, count = 0.0, 0
    for s in tqdm(range(0, n, batch_size), desc="LM loss", disable=not progress, leave=False):
        x = chunks[s : s + batch_size].to(device)
        logits = forward(model, x).logits.float()
        # every position predicts the next token; with BOS the first text token is scored too
        total += float(F.cross_entropy(logits[:, :-1].flatten(0, 1), x[:, 1:].flatten(), reduction="sum"))
        count += x[:, 1:].numel()
    unk = tokenizer.unk_token_id
    unk_share = float(np.mean([t == unk for t in ids])) if unk is not None else 0.0
    loss = total / count
    return {"lm_loss": loss, "perplexity": float(np.exp(loss)), "n_tokens": count, "unk_share": unk_share}


# --------------------------------------------------------------------------- factual recall


def load_facts(path: str | Path = FACTS_FILE) -> list[dict]:
    """The factual-recall items (prompt, answer with its leading space, category)."""
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    facts = data["facts"] if isinstance(data, dict) else data
    for f in facts:
        if not {"prompt", "answer"} <= set(f):
            raise ValueError(f"fact without prompt/answer: {f}")
    return facts


def encode_fact(tokenizer, fact: dict) -> tuple[list[int], int]:
    """A fact's prompt token ids and its answer's first token; a ValueError when the
    answer does not tokenize after the prompt."""
    p = tokenizer(fact["prompt"])["input_ids"]
    full = tokenizer(fact["prompt"] + fact["answer"])["input_ids"]
    if full[: len(p)] != p or len(full) == len(p):
        raise ValueError(f"answer {fact['answer']!r} does not tokenize after prompt {fact['prompt']!r}")
    return p, full[len(p)]


@torch.no_grad()
def factual_recall(model, tokenizer, facts: Sequence[dict] | None = None, batch_size: int = 16) -> pd.DataFrame:
    """Per fact: whether the answer's first token is the argmax next token after the
    prompt, its log-probability and rank. Prompts are grouped by token length (no
    padding)."""
    device = input_device(model)
    facts = list(facts) if facts is not None else load_facts()
    rows = []
    enc = []
    for f in facts:
        enc.append(encode_fact(tokenizer, f))
    groups: dict[int, list[int]] = {}
    for i, (p, _) in enumerate(enc):
        groups.setdefault(len(p), []).append(i)
    out: dict[int, dict] = {}
    for _, idx in sorted(groups.items()):
        for s in range(0, len(idx), batch_size):
            chunk = idx[s : s + batch_size]
            x = torch.tensor([enc[i][0] for i in chunk], device=device)
            logits = forward(model, x, keep=1).logits[:, -1].float()
            lp = logits.log_softmax(-1)
            for row, i in enumerate(chunk):
                t = enc[i][1]
                out[i] = {
                    "correct": int(logits[row].argmax()) == t,
                    "answer_logprob": float(lp[row, t]),
                    "rank": int((logits[row] > logits[row, t]).sum()),
                    "prediction": tokenizer.decode([int(logits[row].argmax())]),
                }
    for i, f in enumerate(facts):
        rows.append({"prompt": f["prompt"], "answer": f["answer"], "category": f.get("category", ""), **out[i]})
    return pd.DataFrame(rows)


# --------------------------------------------------------------------------- users' benchmark files


def _final_number(text: str) -> float | None:
    nums = re.findall(r"-?\d[\d,]*\.?\d*", text)
    if not nums:
        return None
    try:
        return float(nums[-1].replace(",", "").rstrip("."))
    except ValueError:
        return None


def load_gsm8k(path: str | Path, n: int | None = None) -> list[dict]:
    """GSM8K's JSONL (one ``{"question", "answer"}`` per line, the answer ending in
    ``#### N``) as ``{"question", "answer": float}`` items (the first ``n``)."""
    items = []
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            if not line.strip():
                continue
            row = json.loads(line)
            if "question" not in row or "answer" not in row:
                raise ValueError(f"{path}: GSM8K lines need 'question' and 'answer'")
            m = re.search(r"####\s*(.+)$", str(row["answer"]).strip())
            value = _final_number(m.group(1) if m else str(row["answer"]))
            if value is None:
                raise ValueError(f"{path}: no final number in answer {row['answer'][-80:]!r}")
            items.append({"question": row["question"], "answer": value})
            if n is not None and len(items) >= n:
                break
    return items


def load_svamp(path: str | Path, n: int | None = None) -> list[dict]:
    """SVAMP (the JSON list ``SVAMP.json`` or JSONL) with ``Body``, ``Question``,
    ``Answer`` as ``{"question": Body + " " + Question, "answer": float}``."""
    text = Path(path).read_text(encoding="utf-8").strip()
    rows = json.loads(text) if text.startswith("[") else [json.loads(l) for l in text.splitlines() if l.strip()]
    items = []
    for row in rows:
        if not {"Body", "Question", "Answer"} <= set(row):
            raise ValueError(f"{path}: SVAMP items need 'Body', 'Question' and 'Answer'")
        items.append({"question": f"{row['Body'].strip()} {row['Question'].strip()}", "answer": float(row["Answer"])})
        if n is not None and len(items) >= n:
            break
    return items


def load_mmlu(path: str | Path, n: int | None = None) -> list[dict]:
    """MMLU's CSVs (question, A, B, C, D, answer letter; no header), one file or every
    ``*.csv`` of a folder (sorted), as ``{"question", "choices", "answer": "A".."D",
    "subject"}``."""
    path = Path(path)
    files = sorted(path.glob("*.csv")) if path.is_dir() else [path]
    if not files:
        raise ValueError(f"no MMLU CSV files in {path}")
    items = []
    for f in files:
        subject = re.sub(r"_(test|dev|val)$", "", f.stem)
        with open(f, encoding="utf-8", newline="") as fh:
            for row in csv.reader(fh):
                if len(row) != 6 or row[5].strip() not in "ABCD" or not row[5].strip():
                    raise ValueError(f"{f}: MMLU rows need 6 fields ending in A/B/C/D, got {row[:2]}...")
                items.append({"question": row[0], "choices": row[1:5], "answer": row[5].strip(), "subject": subject})
                if n is not None and len(items) >= n:
                    return items
    return items


@torch.no_grad()
def word_problem_accuracy(
    model,
    tokenizer,
    items: Sequence[dict],
    max_new_tokens: int = 64,
    prompt_format: str = "Question: {question}\nAnswer:",
    progress: bool = False,
) -> pd.DataFrame:
    """GSM8K / SVAMP accuracy by greedy generation (one item at a time, KV cache): the
    last number in the generated text (stopped at a blank line) equals the answer."""
    device = input_device(model)
    rows = []
    for item in tqdm(items, desc="word problems", disable=not progress, leave=False):
        ids = torch.tensor([tokenizer(prompt_format.format(question=item["question"]))["input_ids"]], device=device)
        gen: list[int] = []
        for _, nxt in zip(range(max_new_tokens), greedy_tokens(model, ids)):
            gen.append(int(nxt))
            if tokenizer.eos_token_id is not None and int(nxt) == tokenizer.eos_token_id:
                break
            if "\n\n" in tokenizer.decode(gen):
                break
        text = tokenizer.decode(gen).split("\n\n")[0]
        value = _final_number(text)
        rows.append(
            {
                "question": item["question"][:80],
                "answer": item["answer"],
                "generated": text,
                "predicted": value,
                "correct": value is not None and abs(value - item["answer"]) < 1e-6,
            }
        )
    return pd.DataFrame(rows)


def _mmlu_prompt(item: dict) -> str:
    lines = [item["question"].strip()]
    lines += [f"{letter}. {choice}" for letter, choice in zip("ABCD", item["choices"])]
    return "\n".join(lines) + "\nAnswer:"


@torch.no_grad()
def mmlu_accuracy(model, tokenizer, items: Sequence[dict], progress: bool = False) -> pd.DataFrame:
    """Zero-shot MMLU: the prompt lists the question and the four lettered choices and
    ends in "Answer:"; the prediction is the letter among " A".." D" with the highest
    next-token logit."""
    device = input_device(model)
    letters = []
    for L in "ABCD":
        ids = tokenizer(" " + L, add_special_tokens=False)["input_ids"]
        letters.append(ids[-1])
    rows = []
    for item in tqdm(items, desc="MMLU", disable=not progress, leave=False):
        ids = torch.tensor([tokenizer(_mmlu_prompt(item))["input_ids"]], device=device)
        logits = forward(model, ids, keep=1).logits[0, -1].float()
        pred = "ABCD"[int(logits[letters].argmax())]
        rows.append(
            {
                "subject": item.get("subject", ""),
                "answer": item["answer"],
                "predicted": pred,
                "correct": pred == item["answer"],
            }
        )
    return pd.DataFrame(rows)


# --------------------------------------------------------------------------- one call


def general_ability(
    model,
    tokenizer,
    prose: ProseSample | None = None,
    facts: Sequence[dict] | None = None,
    *,
    chunk_tokens: int = 128,
    max_chunks: int | None = 16,
    gsm8k: str | Path | None = None,
    svamp: str | Path | None = None,
    mmlu: str | Path | None = None,
    n_bench: int | None = 200,
    batch_size: int = 8,
    per_item: bool = False,
) -> dict[str, float | str]:
    """Every general-ability number for one model: ``lm_loss`` and ``perplexity`` on the
    prose sample, ``factual_recall`` accuracy and mean answer log-probability, and, for
    the benchmark files given, ``gsm8k`` / ``svamp`` / ``mmlu`` accuracy on their first
    ``n_bench`` items. ``per_item``: also ``facts_by_prompt``, each fact's correctness in
    the facts' order (``stats.encode_correct``), for a paired interval between models."""
    prose = prose or pydoc_prose()
    out: dict[str, float] = {}
    lm = lm_loss(model, tokenizer, prose.text, chunk_tokens=chunk_tokens, max_chunks=max_chunks, batch_size=batch_size)
    out.update(
        {
            "lm_loss": lm["lm_loss"],
            "perplexity": lm["perplexity"],
            "lm_tokens": lm["n_tokens"],
            "unk_share": lm["unk_share"],
        }
    )
    fr = factual_recall(model, tokenizer, facts)
    out["factual_recall"] = float(fr.correct.mean())
    out["factual_logprob"] = float(fr.answer_logprob.mean())
    if per_item:
        from ..core.stats import encode_correct

        out["facts_by_prompt"] = encode_correct(fr.correct.to_numpy())
    if gsm8k:
        out["gsm8k"] = float(word_problem_accuracy(model, tokenizer, load_gsm8k(gsm8k, n_bench)).correct.mean())
    if svamp:
        out["svamp"] = float(word_problem_accuracy(model, tokenizer, load_svamp(svamp, n_bench)).correct.mean())
    if mmlu:
        out["mmlu"] = float(mmlu_accuracy(model, tokenizer, load_mmlu(mmlu, n_bench)).correct.mean())
    return out
