"""Shared fixtures: a small per-digit tokenizer that splits like Qwen's (each digit its
own token, a space before a digit a token of its own) so prompt/answer handling is
tested without downloading a real model."""

from __future__ import annotations

import pytest
from tokenizers import Regex, Tokenizer, models, pre_tokenizers, decoders, trainers
from transformers import PreTrainedTokenizerFast

import arithlib.datasets as ds


def _corpus() -> list[str]:
    texts = []
    for records in (ds.nikankin_prompts(n_per_op=None), ds.yu_prompts(n_digits=2, numerals="both", fewshot=2),
                    ds.zhang_prompts(fewshot=2), ds.zhang_word_problems(n_per_template=40), ds.power_prompts(fewshot=2)):
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
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"\d"), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(_corpus(), trainers.WordLevelTrainer(special_tokens=["<unk>", "<pad>", "<eos>"]))
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", eos_token="<eos>")
