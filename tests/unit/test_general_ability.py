"""Tests of arithlib.methods.general_ability: the fixed prose sample, LM loss, the factual-recall
set and its scorer, and the loaders/scorers of users' GSM8K / SVAMP / MMLU files
(tiny fixture files, tiny random model)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import arithlib.methods.general_ability as ga
from arithlib.core.models import load_model
from arithlib.core.random_models import random_model_dir
from arithlib.run.paths import cache_root


@pytest.fixture(scope="module")
def tiny():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield load_model(str(random_model_dir("qwen2")))
    torch.set_num_threads(n)


def test_prose_sample_is_fixed_prose():
    a, b = ga.pydoc_prose(5000), ga.pydoc_prose(5000)
    assert a == b and a.sha256 == b.sha256
    assert 5000 <= len(a.text) < 5000 + 5000
    paragraphs = a.text.split("\n\n")
    assert all(len(p) >= 200 and "::=" not in p and "\n" not in p for p in paragraphs)
    assert list(a.topics) == sorted(a.topics)
    assert ga.pydoc_prose(20000).text.startswith(a.text)


def test_lm_loss_matches_manual(tiny):
    text = ga.pydoc_prose(3000).text
    out = ga.lm_loss(tiny.bridge, tiny.tokenizer, text, chunk_tokens=32, max_chunks=3, batch_size=2)
    ids = tiny.tokenizer(text, add_special_tokens=False)["input_ids"][:96]
    hf = tiny.bridge.original_model
    total, n = 0.0, 0
    with torch.no_grad():
        for c in range(3):
            x = torch.tensor([ids[c * 32 : (c + 1) * 32]])
            lp = hf(x).logits[0].log_softmax(-1)
            total -= float(lp[torch.arange(31), x[0, 1:]].sum())
            n += 31
    assert out["n_tokens"] == n
    assert out["lm_loss"] == pytest.approx(total / n, rel=1e-5)
    assert out["perplexity"] == pytest.approx(np.exp(total / n), rel=1e-5)
    with pytest.raises(ValueError):
        ga.lm_loss(tiny.bridge, tiny.tokenizer, "short", chunk_tokens=64)


def test_facts_file():
    facts = ga.load_facts()
    assert 40 <= len(facts) <= 60
    assert all(f["answer"].startswith(" ") and f["prompt"] and not f["prompt"].endswith(" ") for f in facts)
    assert len({f["prompt"] for f in facts}) == len(facts)


def test_facts_are_one_token_for_qwen():
    hf_dir = cache_root() / "models" / "qwen2.5-coder-0.5b" / "hf"
    if not (hf_dir / "tokenizer.json").exists():
        pytest.skip("Qwen2.5 tokenizer not cached")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(hf_dir))
    for f in ga.load_facts():
        p = tok(f["prompt"])["input_ids"]
        assert len(tok(f["prompt"] + f["answer"])["input_ids"]) == len(p) + 1, f


def test_factual_recall_scores_argmax(tiny):
    facts = [
        {"prompt": "the sum of", "answer": " one"},
        {"prompt": "what is the", "answer": " answer"},
        {"prompt": "a", "answer": " b"},
    ]
    frame = ga.factual_recall(tiny.bridge, tiny.tokenizer, facts)
    hf = tiny.bridge.original_model
    with torch.no_grad():
        for f, row in zip(facts, frame.itertuples()):
            ids = tiny.tokenizer(f["prompt"])["input_ids"]
            target = tiny.tokenizer(f["prompt"] + f["answer"])["input_ids"][len(ids)]
            logits = hf(torch.tensor([ids])).logits[0, -1]
            assert row.correct == (int(logits.argmax()) == target)
            assert row.answer_logprob == pytest.approx(float(logits.log_softmax(-1)[target]), abs=1e-4)


@pytest.fixture
def bench_files(tmp_path):
    gsm = tmp_path / "gsm8k.jsonl"
    gsm.write_text(
        "\n".join(
            json.dumps(r)
            for r in [
                {"question": "Tom has 3 apples and buys 4 more. How many?", "answer": "3 + 4 = 7\n#### 7"},
                {"question": "A box holds 1,200 pens; 200 are sold. How many remain?", "answer": "#### 1,000"},
            ]
        )
        + "\n"
    )
    svamp = tmp_path / "SVAMP.json"
    svamp.write_text(
        json.dumps(
            [
                {
                    "Body": "Sam had 5 cars.",
                    "Question": "He lost 2. How many now?",
                    "Equation": "( 5.0 - 2.0 )",
                    "Answer": 3.0,
                    "Type": "Subtraction",
                }
            ]
        )
    )
    mmlu = tmp_path / "mmlu"
    mmlu.mkdir()
    (mmlu / "astronomy_test.csv").write_text(
        '"What is the closest star to Earth?",The Sun,Sirius,Vega,Polaris,A\n2+2=?,3,4,5,6,B\n'
    )
    return gsm, svamp, mmlu


def test_loaders(bench_files):
    gsm, svamp, mmlu = bench_files
    g = ga.load_gsm8k(gsm)
    assert [x["answer"] for x in g] == [7.0, 1000.0]
    assert ga.load_gsm8k(gsm, n=1)[0]["question"].startswith("Tom")
    s = ga.load_svamp(svamp)
    assert s == [{"question": "Sam had 5 cars. He lost 2. How many now?", "answer": 3.0}]
    m = ga.load_mmlu(mmlu)
    assert len(m) == 2 and m[0]["answer"] == "A" and m[1]["choices"] == ["3", "4", "5", "6"]
    assert m[0]["subject"] == "astronomy"
    bad = gsm.parent / "bad.jsonl"
    bad.write_text(json.dumps({"q": 1}) + "\n")
    with pytest.raises(ValueError):
        ga.load_gsm8k(bad)


def test_benchmark_scorers_and_general_ability(tiny, bench_files):
    gsm, svamp, mmlu = bench_files
    wp = ga.word_problem_accuracy(tiny.bridge, tiny.tokenizer, ga.load_gsm8k(gsm), max_new_tokens=4)
    assert len(wp) == 2 and wp.correct.dtype == bool
    mm = ga.mmlu_accuracy(tiny.bridge, tiny.tokenizer, ga.load_mmlu(mmlu))
    assert set(mm.predicted) <= set("ABCD")
    out = ga.general_ability(
        tiny.bridge,
        tiny.tokenizer,
        ga.pydoc_prose(3000),
        max_chunks=2,
        chunk_tokens=32,
        gsm8k=gsm,
        svamp=svamp,
        mmlu=mmlu,
    )
    assert {"lm_loss", "perplexity", "factual_recall", "factual_logprob", "gsm8k", "svamp", "mmlu"} <= set(out)
    assert 0 <= out["factual_recall"] <= 1 and out["lm_loss"] > 0


def test_final_number():
    assert ga._final_number("so the answer is 1,234.") == 1234.0
    assert ga._final_number("-5 degrees") == -5.0
    assert ga._final_number("none") is None
