"""Prompt sets: counts, answers, counterfactuals, tokenization, per-token cases."""

from __future__ import annotations

import dataclasses

import pytest

import arithlib.core.datasets as ds
from arithlib.core.prompt_sets import (
    PromptSet,
    UnsplittableError,
    expand_answer_tokens,
    require_single_token_operands,
    single_token_max,
    split_answer,
)


def test_digit_tokenizer_splits_like_qwen(digit_tokenizer):
    pieces = digit_tokenizer.convert_ids_to_tokens(digit_tokenizer("The sum is 42")["input_ids"])
    assert pieces[-4:] == ["Ġis", "Ġ", "4", "2"]


@pytest.mark.parametrize(
    "op,a,b,c", [("+", 3, 5, 8), ("-", 3, 5, -2), ("*", 7, 6, 42), ("/", 72, 8, 9), ("^", 2, 5, 32)]
)
def test_apply_op(op, a, b, c):
    assert ds.apply_op(a, b, op) == c


def test_inexact_division_is_refused():
    with pytest.raises(ValueError, match="exact"):
        ds.apply_op(7, 2, "/")


def test_yu_two_digit_set_has_1600_sentences():
    records = ds.yu_prompts(n_digits=2)
    assert len(records) == 1600
    assert {r.op for r in records} == set(ds.OPS)
    assert all(10 <= r.a <= 99 and r.answer == ds.apply_op(r.a, r.b, r.op) for r in records)
    assert all(r.answer >= 0 for r in records)


def test_yu_number_words():
    r = ds.yu_prompts(["+"], n_digits=1, numerals="words", n_per_template=None, templates=[3])
    eight = [x for x in r if (x.a, x.b) == (3, 5)][0]
    assert eight.text == "three + five = " and eight.answer_text == "eight"
    assert ds.number_to_words(42) == "forty-two" and ds.number_to_words(1000) == "one thousand"


def test_yu_prompts_refuse_unknown_numerals_and_digit_counts():
    with pytest.raises(ValueError, match=r"numerals must be one of \('digits', 'words', 'both'\), got 'word'"):
        ds.yu_prompts(["+"], numerals="word")
    with pytest.raises(ValueError, match=r"n_digits must be one of \[1, 2, 3\].*got 4"):
        ds.yu_prompts(["+"], n_digits=4)
    template = ds.load_json("templates.json")["yu"]["+"][3]
    with pytest.raises(ValueError, match="numerals must be one of"):
        ds.fewshot_prefix(template, "+", " ", 2, numerals="Words")


def test_carry_flags_follow_yu_change_one():
    assert ds.carry_flags(15, 32, "+") == [False, False]  # 47: memorize both digits
    assert ds.carry_flags(15, 37, "+") == [True, False]  # 52: 5 = 1+3+1 is change-one
    assert ds.carry_flags(52, 17, "-") == [True, False]  # 35: borrow reaches the tens
    assert ds.carry_flags(12, 11, "*") == [True, True, False]


def test_zhang_templates_and_counterfactuals(digit_tokenizer):
    records = ds.zhang_prompts(seed=1)
    assert {r.template_id for r in records} == set(range(8))
    # operands 1..9, non-negative exact results
    assert all(1 <= r.a <= 9 and 1 <= r.b <= 9 and r.answer >= 0 for r in records)
    words = set(ds.load_json("templates.json")["zhang_counterfactual"]["words"])
    symbols = set(ds.load_json("templates.json")["zhang_counterfactual"]["symbols"])
    for r in records[:50]:
        assert r.counterfactual != r.full_text
        replaced = set(r.counterfactual.split()) - set(r.full_text.split())
        assert replaced and replaced <= words | symbols | {t.rstrip("?") for t in words}
    ps = PromptSet.build(records, digit_tokenizer)
    assert len(ps) == len(records)
    assert all(len(c) == len(i) for c, i in zip(ps.cf_input_ids, ps.input_ids))


def test_fewshot_prefix_matches_measured_prefix():
    r = ds.nikankin_prompts(["+"], fewshot=2, n_per_op=3)[0]
    assert r.prefix == "3+4=7\n8+1=9\n"
    assert r.full_text.startswith(r.prefix) and r.full_text.endswith("=")


def test_promptset_moves_blank_into_prompt(digit_tokenizer):
    records = ds.yu_prompts(["+"], n_digits=2, n_per_template=5, templates=[0])
    ps = PromptSet.build(records, digit_tokenizer)
    for r, ids, ans in zip(ps.records, ps.input_ids, ps.answer_ids):
        assert digit_tokenizer.decode(ids[-1:]) == " "  # the lone space ends the prompt
        assert digit_tokenizer.decode(ans) == r.answer_text  # answer is its digits only
        assert len(ans) == len(r.answer_text)


def test_nikankin_single_token_operands_and_partners(digit_tokenizer):
    assert single_token_max(digit_tokenizer) == 9
    records = ds.nikankin_prompts(max_operand=9, n_per_op=None)
    assert all(0 <= r.answer <= 9 for r in records)
    assert all(r.get("cf_answer") != r.answer for r in records if r.counterfactual)
    ps = PromptSet.build(records, digit_tokenizer)
    require_single_token_operands(ps)
    two_digit = PromptSet.build(ds.nikankin_prompts(["+"], max_operand=20, max_result=40, n_per_op=20), digit_tokenizer)
    with pytest.raises(ValueError, match="not a single token"):
        require_single_token_operands(two_digit)


def test_builders_are_deterministic():
    assert ds.zhang_prompts(seed=3) == ds.zhang_prompts(seed=3)
    assert ds.yu_prompts(n_digits=2, seed=3) == ds.yu_prompts(n_digits=2, seed=3)
    assert ds.yu_prompts(n_digits=2, seed=3) != ds.yu_prompts(n_digits=2, seed=4)


def test_batches_cover_each_prompt_once_without_padding(digit_tokenizer):
    ps = PromptSet.build(ds.zhang_prompts(n_per_template=3, fewshot=2), digit_tokenizer)
    seen = []
    for batch in ps.batches(batch_size=7):
        assert batch.tokens.shape[0] == len(batch.index) <= 7
        for row, i in enumerate(batch.index.tolist()):
            assert batch.tokens[row].tolist() == ps.input_ids[i]
            assert batch.answer_ids[row].item() == ps.answer_ids[i][0]
            assert batch.cf_tokens[row].tolist() == ps.cf_input_ids[i]
        seen += batch.index.tolist()
    assert sorted(seen) == list(range(len(ps)))


def test_batches_by_prefix_hold_one_fewshot_prefix(digit_tokenizer):
    ps = PromptSet.build(ds.zhang_prompts(n_per_template=3, fewshot=2), digit_tokenizer)
    batches = list(ps.batches(batch_size=7, by_prefix=True))
    assert sorted(i for b in batches for i in b.index.tolist()) == list(range(len(ps)))
    assert all(len({ps.records[i].prefix for i in b.index.tolist()}) == 1 for b in batches)
    assert any(len({ps.records[i].prefix for i in b.index.tolist()}) > 1 for b in ps.batches(batch_size=7))


def test_expand_answer_tokens_gives_memorize_and_change_one(digit_tokenizer):
    ps = PromptSet.build(ds.yu_prompts(["+"], n_digits=2, n_per_template=30, templates=[3]), digit_tokenizer)
    ex = expand_answer_tokens(ps)
    assert len(ex) == sum(len(a) for a in ps.answer_ids)
    frame = ex.to_frame()
    assert set(frame["case"]) == {"memorize", "change-one"}
    row = frame.iloc[1]
    assert row["text"].endswith(" " + str(ps.records[0].answer)[0])


def test_word_problems_and_power(digit_tokenizer):
    wp = ds.zhang_word_problems(n_per_template=5)
    assert {r.template_id for r in wp} == set(range(12))
    assert all(r.answer == r.a + r.b < 10 for r in wp)
    assert "[" not in wp[0].text and "<" not in wp[0].text
    pw = ds.power_prompts()
    assert all(r.answer == r.a**r.b <= 999 for r in pw)


def test_gender_data():
    g = ds.load_gender_data()
    assert len(g["prompts"]) == 8 and g["genders"] == ["man", "woman"]
    assert ds.gender_prompts("woman")[0] == "A woman works as a"
    assert len(g["paper_professions"]["woman"]) == 16


def _pair_naive(records, rng):
    """The quadratic reference: rng.choice over the filtered list."""
    out = []
    for r in records:
        pool = [o for o in records if o.op == r.op and o.template_id == r.template_id and o.answer != r.answer]
        if not pool:
            out.append(r)
            continue
        partner = rng.choice(pool)
        out.append(
            dataclasses.replace(
                r,
                counterfactual=partner.full_text,
                meta=r.meta + (("cf_answer", partner.answer), ("cf_answer_text", partner.answer_text)),
            )
        )
    return out


@pytest.mark.parametrize("max_operand", [3, 9, 40])
def test_operand_counterfactual_pairing_draws_as_the_filtered_list(max_operand):
    import random

    records = ds.nikankin_prompts(max_operand=max_operand, n_per_op=None, seed=0)
    plain = [
        dataclasses.replace(r, counterfactual=None, meta=tuple(m for m in r.meta if not m[0].startswith("cf_")))
        for r in records
    ]
    fast = ds._pair_operand_counterfactuals(plain, random.Random(7))
    assert fast == _pair_naive(plain, random.Random(7))
    assert all(dict(r.meta)["cf_answer"] != r.answer for r in fast if r.counterfactual)


def test_excluding_view_indexes_the_kept_items():
    group, skip = list("abcdefgh"), [0, 3, 4, 7]
    view = ds._Excluding(group, skip)
    assert len(view) == 4 and [view[k] for k in range(len(view))] == ["b", "c", "f", "g"]


class _MergingTokenizer:
    """Greedy longest match over single characters and "1978": "year 197" is a prefix of
    "year 1978" as text but not as tokens."""

    eos_token_id = None
    pieces = ["1978"]

    def __call__(self, text: str) -> dict:
        ids, i = [], 0
        while i < len(text):
            piece = next((p for p in self.pieces if text.startswith(p, i)), text[i])
            ids.append(1000 if piece == "1978" else ord(piece))
            i += len(piece)
        return {"input_ids": ids}

    def decode(self, ids: list[int]) -> str:
        return "".join("1978" if i == 1000 else chr(i) for i in ids)


def test_split_answer_moves_the_blank_and_refuses_a_split_token():
    tok = _MergingTokenizer()
    split = split_answer(tok, "3+5= ", "8")
    assert tok.decode(split.prompt) == "3+5= " and tok.decode(split.answer) == "8"
    assert tok.decode(split.moved) == " "
    with pytest.raises(UnsplittableError, match="token boundary"):
        split_answer(tok, "the year 197", "8")
    with pytest.raises(ValueError, match="no non-blank token"):
        split_answer(tok, "3+5=", " ")


def test_counterfactual_prefix_carries_no_calculation(digit_tokenizer):
    """X_c's few-shot prefix must not show the true results (a op b), nor any
    other arithmetic reading of its operands, or the in-context lines teach the model
    what the nonsense operator means. The old prefix kept the true answers."""
    records = ds.zhang_prompts(fewshot=2, seed=0)
    for r in records:
        cf_lines = r.counterfactual.split("\n")[:-1]
        assert len(cf_lines) == 2
        for (a, b), line, xr_line in zip(ds.fewshot_operands(r.op, 2), cf_lines, r.prefix.split("\n")):
            shown = int(line.rsplit(" ", 1)[1])
            assert shown != ds.apply_op(a, b, r.op)  # not the true result
            assert shown not in ds.operation_results(a, b)  # nor any operation on (a, b)
            assert len(str(shown)) == len(xr_line.rsplit(" ", 1)[1])  # same length as X_r's answer
    # the earlier construction is kept on request, and it does leak
    old = ds.zhang_prompts(fewshot=2, seed=0, xc_prefix="true-answers")
    assert all(
        o.counterfactual.split("\n")[0].endswith(f" {ds.apply_op(*ds.fewshot_operands(o.op, 1)[0], o.op)}") for o in old
    )
    # X_r is unchanged by the X_c construction; positions stay aligned with X_r
    assert [r.full_text for r in records] == [o.full_text for o in old]
    ps = PromptSet.build(records, digit_tokenizer)
    assert len(ps) == len(records)
    with pytest.raises(ValueError, match="xc_prefix"):
        ds.zhang_prompts(fewshot=2, xc_prefix="none")
