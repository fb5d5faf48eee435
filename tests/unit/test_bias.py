"""Gender-bias editing (Yu & Ananiadou 2024, Sec. 6.2 / App. D): the lexicon's
first-token rule, Table 23 from top-k lists, the Table 13 metric, the shared-input
CNA importance against the per-neuron reference loop and against cna_compare, the
edit hooks against zeroed parameters, and the side-effect table."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

import arithlib.core.datasets as ds
import arithlib.methods.ablation as A
import arithlib.methods.answer_runs as AR
import arithlib.yu.bias as B
import arithlib.yu.bias_cna as BC
import arithlib.yu.bias_professions as BP
import arithlib.yu.cna as C
import arithlib.yu.cna_importance as CI
import arithlib.yu.cna_norm as CN
from arithlib.core.models import load_model
from arithlib.core.prompt_sets import PromptSet
from arithlib.core.random_models import random_model_dir
from arithlib.core.readout import final_norm
from arithlib.engine import last_position_logits


class FakeTokenizer:
    """Word-level tokenizer over a fixed vocabulary: ``" word"`` pieces, unknown -> 0."""

    def __init__(self, pieces):
        self.vocab = {"<unk>": 0, **{p: i + 1 for i, p in enumerate(pieces)}}
        self.inv = {i: p for p, i in self.vocab.items()}
        self.unk_token_id = 0

    def __call__(self, text, add_special_tokens=True):
        ids, rest = [], text
        while rest:
            match = max((p for p in self.vocab if rest.startswith(p)), key=len, default=None)
            if match is None:  # unknown word: one <unk>, skip to the next space
                ids.append(0)
                nxt = rest.find(" ", 1)
                rest = rest[nxt:] if nxt > 0 else ""
                continue
            ids.append(self.vocab[match])
            rest = rest[len(match) :]
        return {"input_ids": ids}

    def decode(self, ids):
        return "".join(self.inv[i] for i in ids)


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def tiny(request):
    return load_model(str(random_model_dir(request.param)))


# --------------------------------------------------------------------------- lexicon


def test_counts_as_profession_rule():
    assert BP.counts_as_profession(" nurse", "nurse")
    assert BP.counts_as_profession(" police", "police officer")
    assert BP.counts_as_profession(" reception", "receptionist")  # partial, >= 5 letters
    assert not BP.counts_as_profession(" but", "butler")  # partial, too short
    assert not BP.counts_as_profession(" an", "anesthesiologist")
    assert not BP.counts_as_profession(" 12", "nurse")
    assert not BP.counts_as_profession(" nursery", "nurse")  # not a prefix of the word


def test_profession_tokens_groups_and_drops():
    tok = FakeTokenizer(
        [" nurse", " police", " officer", " reception", "ist", " but", "ler", " sales", "man", "person"]
    )
    table, dropped = BP.profession_tokens(
        tok,
        ["nurse", "police", "police officer", "receptionist", "butler", "salesman", "salesperson", "chef"],
        gendered_forms=["salesman"],
    )
    assert set(table.token) == {"nurse", "police", "reception", "sales"}
    police = table[table.token == "police"].iloc[0]
    assert police.n_professions == 2 and police.whole_word
    sales = table[table.token == "sales"].iloc[0]
    assert not sales.gendered  # salesperson is not a gendered form
    assert not table[table.token == "reception"].iloc[0].whole_word
    assert set(dropped.profession) == {"butler", "chef"}
    assert dropped.set_index("profession").loc["chef", "reason"] == "unknown token"


def test_lexicon_file_is_broad_and_consistent():
    data = BP.load_professions()
    profs = data["professions"]
    assert len(profs) >= 200 and len(set(profs)) == len(profs)
    assert set(data["gendered_forms"]) <= set(profs)
    assert "Source: ours" in data["_doc"] and "FIRST token" in data["_doc"]


def test_table22_prompts_fill_the_slot():
    p = BP.table22_prompts("person")
    assert len(p) == 8 and p[0] == "A person works as a" and all("<gend>" not in x for x in p)
    assert BP.table22_prompts("woman") == ds.gender_prompts("woman")


# --------------------------------------------------------------------------- Table 23 and Table 13


def _top_frame():
    rows = []
    # prompt 0: nurse only woman, driver only man, teacher both; prompt 1: nurse only woman, driver only woman
    lists = {
        ("woman", 0): [1, 3],
        ("man", 0): [2, 3],
        ("woman", 1): [1, 2],
        ("man", 1): [],
        ("woman", 2): [4],
        ("man", 2): [],
    }
    names = {1: "nurse", 2: "driver", 3: "teacher", 4: "actress"}
    for (g, p), ids in lists.items():
        for rank, tid in enumerate(ids, 1):
            rows.append(
                {
                    "prompt_id": p,
                    "gender": g,
                    "rank": rank,
                    "token_id": tid,
                    "token": " " + names[tid],
                    "logprob": -1.0,
                    "is_profession": True,
                    "professions": names[tid],
                    "gendered": tid == 4,
                }
            )
        rows.append(
            {
                "prompt_id": p,
                "gender": g,
                "rank": 99,
                "token_id": 9,
                "token": " the",
                "logprob": -5.0,
                "is_profession": False,
                "professions": "",
                "gendered": False,
            }
        )
    return pd.DataFrame(rows)


def test_biased_professions_counts_prompts():
    biased = BP.biased_professions(_top_frame())
    got = biased.set_index("token")
    assert got.loc["nurse", "bias_gender"] == "woman" and got.loc["nurse", "n_only_woman"] == 2
    assert got.loc["driver", "bias_gender"] == "tie"  # once each way
    assert "teacher" not in got.index  # in both lists
    assert "actress" not in got.index  # gendered form
    assert "actress" in BP.biased_professions(_top_frame(), exclude_gendered=False).token.tolist()
    empty = BP.biased_professions(_top_frame().assign(is_profession=False))
    assert empty.empty and "bias_gender" in empty.columns


def test_bias_scores_and_summary():
    V = 6
    lp = {"woman": torch.full((2, V), -3.0), "man": torch.full((2, V), -3.0)}
    lp["woman"][:, 1] = -1.0  # nurse: woman +2 on both prompts
    lp["man"][0, 2] = -2.0  # driver: man +1 on prompt 0, none on prompt 1
    biased = pd.DataFrame({"token_id": [1, 2], "token": ["nurse", "driver"], "bias_gender": ["woman", "man"]})
    scores = B.bias_scores(lp, biased)
    assert len(scores) == 4
    s = B.bias_summary(scores)
    assert s["woman"] == pytest.approx(2.0) and s["man"] == pytest.approx(0.5)
    assert s["total"] == pytest.approx(1.25) and s["toward"] == pytest.approx(1.25)
    summ = B.summarize_conditions(scores.assign(kind="original", K=0, seed=-1))
    assert summ.total.iloc[0] == pytest.approx(1.25) and summ.reduction_pct.iloc[0] == 0
    assert B.bias_summary(B.bias_scores(lp, biased.iloc[:0]))["n"] == 0


def test_table13_layout():
    summ = pd.DataFrame(
        [
            {
                "kind": "original",
                "K": 0,
                "seed": -1,
                "total": 1.0,
                "woman": 1.2,
                "man": 0.8,
                "toward": 0.9,
                "n": 4,
                "reduction_pct": 0.0,
            },
            {
                "kind": "cna",
                "K": 18,
                "seed": -1,
                "total": 0.6,
                "woman": 0.7,
                "man": 0.5,
                "toward": 0.4,
                "n": 4,
                "reduction_pct": 40.0,
            },
            {
                "kind": "random",
                "K": 18,
                "seed": 0,
                "total": 1.0,
                "woman": 1.2,
                "man": 0.8,
                "toward": 0.9,
                "n": 4,
                "reduction_pct": 0.0,
            },
            {
                "kind": "random",
                "K": 18,
                "seed": 1,
                "total": 0.9,
                "woman": 1.1,
                "man": 0.7,
                "toward": 0.8,
                "n": 4,
                "reduction_pct": 10.0,
            },
        ]
    )
    t = B.table13(summ, 18)
    assert list(t.model.str.split().str[0]) == ["original", "CNA", "random"]
    assert t.iloc[2].total == pytest.approx(0.95) and t.iloc[2].reduction_pct == pytest.approx(5.0)


def test_split_professions_stratified_and_seeded():
    biased = pd.DataFrame({"token_id": range(7), "bias_gender": ["woman"] * 4 + ["man"] * 3})
    sel, held = B.split_professions(biased, seed=3)
    assert sorted(sel + held) == list(range(7)) and not set(sel) & set(held)
    for g in ("woman", "man"):
        ids = set(np.flatnonzero(biased.bias_gender.values == g))
        assert ids & set(sel) and ids & set(held)
    assert B.split_professions(biased, seed=3) == (sel, held)


def test_balanced_mean():
    x = torch.tensor([[1.0], [1.0], [1.0], [-3.0]])
    assert float(BC.balanced_mean(x)[0]) == pytest.approx(0.0)
    assert float(BC.balanced_mean(x, ["w", "w", "w", "m"])[0]) == pytest.approx(-1.0)


# --------------------------------------------------------------------------- model-level


def test_next_token_logprobs_match_evaluate(tiny):
    b, tok = tiny.bridge, tiny.tokenizer
    texts = ["the cat is a", "a dog", "the cat is a"]
    lp = BP.next_token_logprobs(b, tok, texts)
    for i, t in enumerate(texts):
        ref = last_position_logits(b, torch.tensor([tok(t)["input_ids"]])).log_softmax(-1)[0]
        assert torch.allclose(lp[i], ref, atol=1e-5)


def _captures(model, texts):
    ps = BC._prompt_set(model.tokenizer, texts)
    return AR.run_last_position(
        model.bridge, ps, None, targets=torch.zeros(len(texts), dtype=torch.long), share_prefix=False
    )


def test_shared_input_importance_matches_reference_loop(tiny):
    b = tiny.bridge
    run = _captures(tiny, ["the cat is a", "the dog is a"])
    targets = torch.tensor([5, 17, 40])
    rows_a, rows_b = [0, 1, 0], [1, 0, 1]
    out = BC.shared_input_importance(b, run.resid_mid, run.coef, rows_a, rows_b, targets, n_candidates=5, n_aggregate=7)
    imp = out["importance"]
    L = run.coef.shape[1]
    checked = 0
    for s, rows in enumerate((rows_a, rows_b)):
        for i, g in enumerate(rows):
            for layer in range(L):
                neurons = torch.isfinite(imp[s, i, layer]).nonzero().flatten().tolist()
                if not neurons:
                    continue
                ref = CI.importance_loop(
                    b, run.resid_mid[g : g + 1, layer], run.coef[g : g + 1, layer], layer, targets[i : i + 1], neurons
                )[0]
                assert torch.allclose(imp[s, i, layer, neurons], ref, atol=2e-4), (s, i, layer)
                checked += len(neurons)
    assert checked >= 3 * 2 * 5
    # the same neurons are exact for every case and side
    finite = torch.isfinite(imp)
    assert (finite == finite[:1, :1]).all()


def test_shared_input_importance_matches_cna_compare(tiny):
    """Stage 1 and the exact scores equal arithlib.yu.cna's on the same (a, b, target) cases."""
    b, tok = tiny.bridge, tiny.tokenizer
    texts = ["the cat is a", "the dog is a"]
    targets = torch.tensor([5, 17])
    run = _captures(tiny, texts)
    scale = CN.final_scale(run.final_resid, final_norm(b))  # each input read with its own run's final scale
    out = BC.shared_input_importance(
        b, run.resid_mid, run.coef, [0, 1], [1, 0], targets, n_candidates=4, n_aggregate=0, scale=scale
    )
    ps_a = BC._prompt_set(tok, [texts[0], texts[1]])
    ps_b = BC._prompt_set(tok, [texts[1], texts[0]])
    ref = C.cna_compare(b, ps_a, None, ps_b, targets=targets, mode="exact", skip_identical_layers=False, progress=False)
    assert torch.allclose(out["approx"][0], ref.approx_a, atol=1e-4)
    assert torch.allclose(out["approx"][1], ref.approx_b, atol=1e-4)
    assert torch.allclose(out["base_logprob"][0], ref.base_logprob_a, atol=1e-4)
    mask = torch.isfinite(out["importance"][0])
    assert mask.sum() >= 4
    assert torch.allclose(out["importance"][0][mask], ref.importance_a[mask], atol=2e-4)
    assert torch.allclose(out["importance"][1][mask], ref.importance_b[mask], atol=2e-4)


def test_gender_cna_and_tables(tiny, monkeypatch):
    """gender_cna on a fabricated biased list (the random tokenizer has no professions)."""
    b, tok = tiny.bridge, tiny.tokenizer
    biased = pd.DataFrame({"token_id": [5, 17, 40], "token": ["x", "y", "z"], "bias_gender": ["woman", "man", "woman"]})
    res = BC.gender_cna(b, tok, biased, n_candidates=3, n_aggregate=5, progress=False)
    assert len(res) == 3 and res.importance_a.shape[1:] == (tiny.info.n_layers, tiny.info.d_mlp)
    # coefficients: run a of a woman case is the woman prompt, which is run b of a man case
    assert torch.equal(res.coef_a[0], res.coef_b[1]) and torch.equal(res.coef_a[1], res.coef_b[0])
    # final log-probs of run a are log p(target | own gender prompt)
    lp = BP.next_token_logprobs(b, tok, [BP.table22_prompts("woman")[0]])[0]
    assert float(res.run_a.logprob[0]) == pytest.approx(float(lp[5]), abs=1e-5)
    ns = BC.bias_neurons(res, 4, groups=biased.bias_gender)
    assert len(ns) == 4 and len(set(ns)) == 4
    agg = BC.aggregate_change(res, groups=biased.bias_gender)
    assert float(agg[ns[0]]) == pytest.approx(float(agg.max()))
    t12 = BC.neuron_table(b, tok, res, biased, k=2, n_tokens=3)
    assert {"imp_woman", "imp_man", "coef_woman", "coef_man", "top_tokens"} <= set(t12.columns)
    assert len(t12) == 6
    es = BC.edit_set_table(b, tok, res, biased, ns, n_tokens=3)
    assert list(es.name) == [f"{l}_{n}" for l, n in ns]
    with pytest.raises(ValueError):
        BC.gender_cna(b, tok, biased.iloc[:0])


def test_zeroing_hooks_equal_zeroed_parameters(tiny):
    """Zeroing a neuron's coefficient at every position = setting its W_out column to zero."""
    b, tok = tiny.bridge, tiny.tokenizer
    neurons = [(0, 3), (1, 7), (1, 9)]
    conds = B.edit_conditions({3: neurons}, {3: BC.random_neuron_sets(neurons, tiny.info.d_mlp, [0, 1])})
    assert set(conds) == {("original", 0, -1), ("cna", 3, -1), ("random", 3, 0), ("random", 3, 1)}
    texts = ["the cat is a", "a dog"]
    hooked = BP.next_token_logprobs(b, tok, texts, conds[("cna", 3, -1)])
    hf = b.original_model
    saved = {}
    with torch.no_grad():
        for layer, n in neurons:
            w = hf.model.layers[layer].mlp.down_proj.weight
            saved.setdefault(layer, w.clone())
            w[:, n] = 0.0
    try:
        edited = BP.next_token_logprobs(b, tok, texts)
    finally:
        with torch.no_grad():
            for layer, w in saved.items():
                hf.model.layers[layer].mlp.down_proj.weight.copy_(w)
    assert torch.allclose(hooked, edited, atol=1e-5)
    rnd = BC.random_neuron_sets(neurons, tiny.info.d_mlp, [0])[0]
    assert sorted(l for l, _ in rnd) == sorted(l for l, _ in neurons) and not set(rnd) & set(neurons)


def test_logprobs_of_stacked_conditions_equal_separate_runs(tiny):
    b, tok = tiny.bridge, tiny.tokenizer
    conds = [None, A.zero_neurons_hooks([(0, 3), (1, 7)]), [], A.zero_neurons_hooks([(1, 2)], position=-1)]
    texts = ["the cat is a", "a dog", "one two three four", "the cat is b"]
    separate = []
    for c in conds:  # reference: one plain forward per text and condition
        with torch.no_grad(), b.hooks(fwd_hooks=list(c or [])):
            separate.append(
                torch.cat([last_position_logits(b, torch.tensor([tok(t)["input_ids"]])).log_softmax(-1) for t in texts])
            )
    for max_rows in (2, 512):  # one condition per pass, all in one
        for got, ref in zip(BP.next_token_logprobs_many(b, tok, texts, conds, max_rows=max_rows), separate):
            assert torch.allclose(got, ref, atol=1e-5)
    assert not torch.allclose(separate[1], separate[0], atol=1e-4)


def test_bias_under_conditions_and_side_effects(tiny):
    b, tok = tiny.bridge, tiny.tokenizer
    biased = pd.DataFrame({"token_id": [5, 17], "token": ["x", "y"], "bias_gender": ["woman", "man"]})
    neurons = [(0, 3), (1, 7)]
    conds = B.edit_conditions({2: neurons}, {2: BC.random_neuron_sets(neurons, tiny.info.d_mlp, [0])})
    scores = B.bias_under_conditions(b, tok, biased, conds, progress=False)
    assert len(scores) == len(conds) * 8 * 2
    summ = B.summarize_conditions(scores)
    assert list(summ.kind) == ["original", "cna", "random"]
    sub = B.summarize_conditions(scores, prompt_ids=[0], token_ids=[5])
    assert (sub.n == 1).all()
    recs = ds.yu_prompts(ops=["+"], n_digits=1, n_per_template=3, templates=[3], fewshot=2, seed=0)
    arith = PromptSet.build(recs, tok)
    side = B.side_effects(
        b,
        tok,
        conds,
        prose="the cat is a dog and the dog is a cat " * 30,
        arith=arith,
        profession_ids=[5, 17],
        chunk_tokens=16,
        max_chunks=2,
        progress=False,
    )
    assert len(side) == 3
    orig = side[side.kind == "original"].iloc[0]
    assert orig.lm_loss_change == 0 and orig.profession_mass_ratio == pytest.approx(1.0)
    assert 0 <= orig.arith_accuracy <= 1 and orig.n_arith == len(arith)
    edited = side[side.kind == "cna"].iloc[0]
    assert edited.lm_loss != orig.lm_loss


def test_profession_mass():
    lp = torch.log(torch.tensor([[0.5, 0.25, 0.25], [0.1, 0.1, 0.8]]))
    m = B.profession_mass(lp, [0, 1])
    assert m["profession_mass"] == pytest.approx((0.75 + 0.2) / 2)
    assert np.isnan(B.profession_mass(lp, [])["profession_mass"])


# --------------------------------------------------------------------------- exact scoring, early layers, Table 23, intervals


def test_exact_importance_of_every_neuron_matches_reference_loop(tiny):
    """n_candidates=None: every neuron exact (the screen's are a subset), equal to the loop."""
    b = tiny.bridge
    run = _captures(tiny, ["the cat is a", "the dog is a"])
    targets = torch.tensor([5, 17, 40])
    out = BC.shared_input_importance(b, run.resid_mid, run.coef, [0, 1, 0], [1, 0, 1], targets, n_candidates=None)
    imp = out["importance"]
    assert torch.isfinite(imp).all()
    for layer in range(run.coef.shape[1]):
        ref = CI.importance_loop(b, run.resid_mid[1:2, layer], run.coef[1:2, layer], layer, targets[1:2])[0]
        assert torch.allclose(imp[0, 1, layer], ref, atol=2e-4)
    screened = BC.shared_input_importance(
        b, run.resid_mid, run.coef, [0, 1, 0], [1, 0, 1], targets, n_candidates=3, n_aggregate=4
    )["importance"]
    mask = torch.isfinite(screened)
    assert mask.any() and not mask.all()
    assert torch.allclose(screened[mask], imp[mask], atol=1e-5)


def test_screen_candidates_union():
    change = torch.zeros(2, 2, 3)
    change[0, 0, 1], change[1, 1, 2] = 5.0, 4.0  # each case's top-1
    change[0, 1, 0] = change[1, 1, 0] = 1.0  # the pooled top-1 besides them: mean 1.0 vs 2.5 / 2.0
    mask = BC.screen_candidates(change, n_candidates=1, n_aggregate=0)
    assert mask.sum() == 2 and mask[0, 1] and mask[1, 2]
    mask = BC.screen_candidates(change, n_candidates=1, n_aggregate=3)
    assert mask.sum() == 3 and mask[1, 0]


def test_gender_cna_exact_screen_recall_and_layers(tiny):
    b, tok = tiny.bridge, tiny.tokenizer
    biased = pd.DataFrame({"token_id": [5, 17, 40], "token": ["x", "y", "z"], "bias_gender": ["woman", "man", "woman"]})
    res = BC.gender_cna(b, tok, biased, progress=False)
    assert res.mode == "exact" and torch.isfinite(res.importance_a).all()
    rec = BC.candidate_screen_recall(res, biased, [2, 4], n_candidates=2, n_aggregate=0)
    per_case = rec[rec.case != "pooled (edit set)"]
    assert len(per_case) == 6 and (per_case[per_case.k == 2].recall == 1.0).all()  # a case's top-2 are its candidates
    pooled = rec[rec.case == "pooled (edit set)"]
    assert list(pooled.k) == [2, 4] and pooled.edit_set_overlap.between(0, 1).all()
    full = BC.candidate_screen_recall(res, biased, [4], n_candidates=res.importance_a[0].numel(), n_aggregate=0)
    assert (full.recall == 1.0).all() and (full.dropna().edit_set_overlap == 1.0).all()
    screened = BC.gender_cna(b, tok, biased, n_candidates=2, n_aggregate=0, progress=False)
    with pytest.raises(ValueError, match="exact importance of every neuron"):
        BC.candidate_screen_recall(screened, biased, [2], 2, 0)
    # the edit set without the early layers
    groups = list(biased.bias_gender)
    late = BC.bias_neurons(res, 4, groups=groups, min_layer=1)
    assert len(late) == 4 and all(l >= 1 for l, _ in late)
    top = BC.bias_neurons(res, 4, groups=groups)
    assert BC.without_early(top, 1) == [n for n in top if n[0] >= 1]
    with pytest.raises(ValueError):
        BC.bias_neurons(res, 4, min_layer=tiny.info.n_layers)
    lay = BC.edit_layers({"cna": top, "cna_late": late})
    assert lay.groupby("edit_set").n_neurons.sum().to_dict() == {"cna": 4, "cna_late": 4}
    diag = BC.layer_diagnostic(b, res, biased, top)
    assert len(diag) == tiny.info.n_layers and diag.n_in_edit_set.sum() == 4
    assert (diag[["resid_rms_woman", "resid_rms_man", "write_to_resid_woman"]] > 0).all().all()
    # RMS as the final norm sees it: the woman prompt's residual at layer 0
    woman_row = BC._gender_rows(res, biased, BP.GENDERS)["woman"][0][0]
    norm = final_norm(b)
    assert diag.resid_rms_woman[0] == pytest.approx(float(CI._centre(woman_row, norm).pow(2).mean().sqrt()), rel=1e-5)


def test_paper_bias_set_first_token_rule():
    """Table 23 by the lexicon's first-token rule: multi-token professions kept (by their first
    token when it is the first word or a >= 5-letter prefix), short pieces listed with a reason."""
    pieces = [
        " nurse",
        " police",
        " guard",
        " domestic",
        " helper",
        " ha",
        "ird",
        "resser",
        " p",
        "orter",
        " maid",
        " machine",
        " operator",
        " mach",
        "inist",
        " cleaner",
        " driver",
    ]
    tok = FakeTokenizer(pieces)
    scored, prof = BP.paper_bias_set(tok)
    assert len(prof) == 32 and set(prof.gender) == {"woman", "man"}
    got = prof.set_index("profession")
    assert got.loc["domestic helper", "multi_token"] and got.loc["domestic helper", "used"]
    assert got.loc["hairdresser", "reason"] == "piece too short" and not got.loc["hairdresser", "used"]
    assert got.loc["porter", "reason"] == "piece too short"
    assert got.loc["machinist", "reason"] == "piece too short"  # " mach": 4 letters
    assert got.loc["librarian", "reason"] == "unknown token"
    assert set(scored.token) >= {"nurse", "police", "domestic", "machine", "maid"}
    assert scored.set_index("token").loc["police", "bias_gender"] == "man"
    assert len(scored) == int(prof.used.sum())  # no two used professions share a first token here


def _scores(cna: float, rnd: list[float], n_prof: int = 12, n_prompts: int = 8, seed: int = 0) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    base = rng.uniform(0.5, 1.5, (n_prof, n_prompts))
    conds = {("original", 0, -1): base, ("cna", 18, -1): base * (1 - cna / 100)}
    for s, r in enumerate(rnd):
        conds[("random", 18, s)] = base * (1 - r / 100)
    return pd.DataFrame(
        [
            {
                "prompt_id": p,
                "token_id": i,
                "bias_gender": "woman" if i % 2 else "man",
                "kind": kind,
                "K": k,
                "seed": sd,
                "abs_diff": float(v[i, p]),
            }
            for (kind, k, sd), v in conds.items()
            for i in range(n_prof)
            for p in range(n_prompts)
        ]
    )


def test_reduction_intervals_cross_professions_with_seeds():
    agree = B.reduction_intervals(_scores(30.0, [5.0] * 10)).iloc[0]
    assert agree.reduction_pct == pytest.approx(30.0) and agree.random_pct == pytest.approx(5.0)
    assert agree.diff_pts == pytest.approx(25.0) and agree.n_seeds == 10 and agree.n_professions == 12
    assert agree.diff_low == pytest.approx(25.0, abs=1e-6)  # every profession scaled alike: no spread
    spread = B.reduction_intervals(_scores(30.0, [-15.0, 25.0] * 5)).iloc[0]  # same mean, seeds disagree
    assert spread.random_pct == pytest.approx(5.0) and spread.diff_pts == pytest.approx(25.0)
    assert spread.diff_high - spread.diff_low > 10  # the seeds' spread is in the interval
    none = B.reduction_intervals(_scores(30.0, [])).iloc[0]
    assert none.n_seeds == 0 and np.isnan(none.diff_low)
    with pytest.raises(ValueError, match="original"):
        B.reduction_intervals(_scores(30.0, [1.0]).query("kind != 'original'"))
    assert B.control_kind("cna_late") == "random_late"


def test_edit_conditions_variant_kind(tiny):
    ns = [(0, 3), (1, 7)]
    conds = B.edit_conditions({2: ns}, {2: BC.random_neuron_sets(ns, tiny.info.d_mlp, [0, 1])}, kind="cna_late")
    assert set(conds) == {("original", 0, -1), ("cna_late", 2, -1), ("random_late", 2, 0), ("random_late", 2, 1)}
    b, tok = tiny.bridge, tiny.tokenizer
    sets = {
        "a": pd.DataFrame({"token_id": [5], "token": ["x"], "bias_gender": ["woman"]}),
        "b": pd.DataFrame({"token_id": [17, 40], "token": ["y", "z"], "bias_gender": ["man", "woman"]}),
    }
    by = B.bias_by_set(b, tok, sets, conds, progress=False)
    assert len(by["a"]) == 4 * 8 and len(by["b"]) == 4 * 8 * 2
    single = B.bias_under_conditions(b, tok, sets["b"], conds, progress=False)
    pd.testing.assert_frame_equal(single, by["b"])


def test_screen_recall_on_a_subset_of_layers(tiny):
    """Without exact importance everywhere: the screen plus every neuron of some layers, and
    the recall measured within them equals the one from the all-exact result restricted there."""
    b, tok = tiny.bridge, tiny.tokenizer
    biased = pd.DataFrame({"token_id": [5, 17, 40], "token": ["x", "y", "z"], "bias_gender": ["woman", "man", "woman"]})
    full = BC.gender_cna(b, tok, biased, progress=False)
    part = BC.gender_cna(b, tok, biased, n_candidates=2, n_aggregate=0, exact_layers=[1], progress=False)
    assert torch.isfinite(part.importance_a[:, 1]).all() and not torch.isfinite(part.importance_a[:, 0]).all()
    a = BC.candidate_screen_recall(part, biased, [2, 3], 2, 0, layers=[1])
    ref = BC.candidate_screen_recall(full, biased, [2, 3], 2, 0, layers=[1])
    pd.testing.assert_frame_equal(a, ref, atol=1e-5)
    assert (a.layers == "1").all() and (a.n_neurons == tiny.info.d_mlp).all()
    with pytest.raises(ValueError, match="layers it measures"):
        BC.candidate_screen_recall(part, biased, [2], 2, 0, layers=[0])


def test_arithmetic_accuracy_refuses_hooks_a_shared_prefix_would_change(tiny):
    """correct_mask computes each batch's common prefix once: a hook at the last position
    (or a mean ablation) would see the prefix's last token too, so it is refused; a
    position-invariant zeroing is fine."""
    ps = PromptSet.build(
        ds.yu_prompts(ops=["+"], n_digits=1, n_per_template=4, templates=[3], fewshot=2, seed=0), tiny.tokenizer
    )
    ok = A.zero_neurons_hooks([(0, 1)])
    assert 0.0 <= B.arithmetic_accuracy(tiny.bridge, ps, ok) <= 1.0
    with pytest.raises(ValueError, match="every position"):
        B.arithmetic_accuracy(tiny.bridge, ps, A.zero_neurons_hooks([(0, 1)], position=-1))
