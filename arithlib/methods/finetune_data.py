"""The data of the fine-tuning methods: train / validation / test splits of prompt
records without shared problems (Yu & Ananiadou 2024, Sec. 5; Zhang et al. 2024, Sec. 5),
and batches that keep a few-shot prefix group together, in an order fixed by the seed
and the epoch."""

import random
from collections.abc import Mapping, Sequence
from dataclasses import replace

from ..core import datasets as ds
from ..core.datasets import PromptRecord
from ..core.prompt_sets import PromptSet

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
