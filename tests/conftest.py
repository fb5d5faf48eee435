"""Shared fixtures: a small per-digit tokenizer that splits like Qwen's (each digit its
own token, a space before a digit a token of its own) so prompt/answer handling is
tested without downloading a real model; a random-weight Qwen2 per test module; torch
on one thread for a test module."""

from __future__ import annotations

import pytest
import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

import arithlib.core.datasets as ds
from arithlib.core.models import load_model
from arithlib.core.random_models import random_model_dir


def _corpus() -> list[str]:
    texts = []
    for records in (
        ds.nikankin_prompts(n_per_op=None),
        ds.yu_prompts(n_digits=2, numerals="both", fewshot=2),
        ds.zhang_prompts(fewshot=2),
        ds.zhang_word_problems(n_per_template=40),
        ds.power_prompts(fewshot=2),
    ):
        for r in records:
            texts.append(r.full_text + r.answer_text)
            if r.counterfactual:
                texts.append(r.counterfactual)
    texts += [str(i) for i in range(10)] + ["-" + str(i) for i in range(10)]
    return texts


@pytest.fixture(scope="session")
def digit_tokenizer() -> PreTrainedTokenizerFast:
    """WordLevel tokenizer over byte-level pieces with digits isolated (Qwen2-like)."""
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r"\d"), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(_corpus(), trainers.WordLevelTrainer(special_tokens=["<unk>", "<pad>", "<eos>"]))
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", eos_token="<eos>")


@pytest.fixture(scope="module")
def one_thread():
    """torch on one thread while a test module runs (small models: threads only add
    overhead); the caller's thread count afterwards. Modules opt in with
    ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def tiny_qwen2():
    """A random-weight Qwen2 (``arithlib.core.random_models.random_model_dir("qwen2")``), one per test
    module (a module may train it in place)."""
    return load_model(str(random_model_dir("qwen2")))
