"""Gender-bias editing with CNA: Yu & Ananiadou 2024 (EMNLP), Sec. 6.2 and App. D
(Tables 12, 13, 22, 23), with controls and side effects the paper does not report.

Pipeline (notebook 07):

1. **Professions from the model** (App. D, Table 23). The 8 Table-22 prompts with
   "man" and "woman"; each prompt's top-100 next tokens; a token is a *profession
   token* when a profession of the lexicon ``data/professions.json`` starts with it
   (:func:`profession_tokens`). A profession token is biased towards a gender when
   it is in that gender's top-100 and not the other's on more prompts than the
   reverse (:func:`biased_professions`).
2. **Scoring rule.** A profession is scored by log p of the FIRST token of
   ``" " + profession`` at the prompt's last position (the paper compares top-100 token
   predictions; its Table 23 lists single words such as "reception" beside multi-word
   professions such as "domestic helper" and "machine operator", and does not say how
   those were scored); professions sharing a first token are one profession token.
3. **CNA between genders** (Sec. 4.1 importance, Sec. 6.2): for each biased
   profession token w on the first prompt, run a = the prompt with w's gender,
   run b = with the other gender, target w; neurons ranked by
   imp_a - imp_b (:func:`gender_cna` on :func:`arithlib.yu.cna.cna_compare`). The edit
   set is the top-K neurons of the mean change over professions
   (:func:`bias_neurons`).
4. **Bias metric** (Table 13): mean over professions and prompts of
   |log p(prof | woman) - log p(prof | man)|, overall and per bias gender
   (:func:`bias_scores`, :func:`bias_summary`), before and after zeroing the
   neurons at every position (= setting their parameters to zero), against as
   many layer-matched random neurons (:func:`random_neuron_sets`).
5. **Side effects** (:func:`side_effects`): LM loss on fixed neutral text,
   arithmetic accuracy, profession probability on gender-free prompts.

TransformerLens gives hooks; :mod:`arithlib.yu.cna` the importance. What is here is
the gender-specific glue: the lexicon, the bias metric, the edit conditions.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Mapping, Sequence

import numpy as np
import pandas as pd
import torch
from tqdm.auto import tqdm

from ..core.components import Hook, Neuron
from ..core.datasets import PromptRecord, PromptSet, load_gender_data
from ..core.readout import final_norm, top_tokens, unembedding
from ..core.stats import bootstrap_ci, crossed_bootstrap_ci
from ..engine import input_device, last_position_logits, stacked_hooks
from ..methods import general_ability as GA
from ..methods.ablation import is_position_invariant, zero_neurons_hooks
from ..methods.answer_runs import LastPosition, correct_mask, run_last_position
from ..methods.neurons import w_out
from ..run.paths import data_path
from . import cna as C
from .cna_norm import check_norm_reading, run_scales
from .mask_keep import random_layer_matched

#: Top-k next-token predictions per prompt and gender (App. D: "top100 predictions").
TOP_K = 100
#: Layers below this index are "early" in the early-layer check of notebook 07: layer 0,
#: whose residual x^{-1} + A^0 is the token embedding plus one attention layer, read
#: directly through the final norm. Fixed before measuring the edit (from what layer 0's
#: residual is, not from the bias numbers) and not tuned: the notebook reports the edit
#: with and without these layers side by side.
EARLY_LAYERS = 1
#: :func:`exact_affordable`: the exact importance of every neuron costs about
#: n_layers * d_mlp * d_model * vocab multiply-adds (one unembedding per neuron) plus
#: a few passes over n_layers * d_mlp * vocab logits per prompt. Above this bound
#: (SmolLM2-135M: 1.3e12 runs exact; Qwen2.5-0.5B: 1.6e13 gets the screen; timings in
#: benchmarks/RESULTS.md) the screen is used, its recall measured on every
#: ``RECALL_LAYER_STRIDE``-th layer.
MAX_EXACT_MACS = 5e12
#: Without the exact importance of every neuron, the screen's recall is measured on the
#: exact importance of every neuron of layers 0, stride, 2 * stride, ... (a quarter of
#: the cost of all layers; layer 0 included).
RECALL_LAYER_STRIDE = 4
#: A first token that is only part of the profession's first word (" reception" of
#: "receptionist") counts when it has at least this many letters; shorter pieces
#: (" c", " but", " par") are generic word pieces or other words.
MIN_PARTIAL_LETTERS = 5
#: The gender-free filler for Table 22's <gend> in the side-effect prompts.
NEUTRAL_WORD = "person"
GENDERS = ("woman", "man")


# --------------------------------------------------------------------------- lexicon


def load_professions() -> dict:
    """``data/professions.json``: ``professions`` (the lexicon), ``gendered_forms``
    (grammatically gender-marked words) and ``_doc`` (source and scoring rule)."""
    with open(data_path("professions.json"), encoding="utf-8") as f:
        data = json.load(f)
    if not data.get("professions"):
        raise ValueError("data/professions.json has no professions")
    return data


def first_token(tokenizer, word: str) -> int:
    """Id of the first token of ``" " + word`` (no special tokens): the token the
    model predicts after a prompt ending in a word ("... works as a")."""
    ids = tokenizer(" " + word, add_special_tokens=False)["input_ids"]
    if not ids:
        raise ValueError(f"{word!r} tokenizes to nothing")
    return int(ids[0])


def _token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id]).strip()


def counts_as_profession(token_text: str, profession: str, min_partial: int = MIN_PARTIAL_LETTERS) -> bool:
    """Whether a first token stands for ``profession``: its text is the profession's
    whole first word, or a prefix of it with at least ``min_partial`` letters."""
    first_word = profession.split()[0].lower()
    t = token_text.strip().lower()
    if not t.isalpha():
        return False
    return t == first_word or (first_word.startswith(t) and len(t) >= min_partial)


def profession_tokens(
    tokenizer,
    professions: Sequence[str] | None = None,
    gendered_forms: Sequence[str] | None = None,
    min_partial: int = MIN_PARTIAL_LETTERS,
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Map the lexicon onto the tokenizer's first tokens.

    Returns ``(tokens, dropped)``: ``tokens`` has one row per profession token
    (token_id, token, professions "a; b", n_professions, whole_word: the token is a
    whole first word, gendered: all its professions are gendered forms); ``dropped``
    lists professions whose first token does not count (too short a piece, or the
    unknown token) with that token. Defaults: the lexicon of ``data/professions.json``.
    """
    data = load_professions() if professions is None or gendered_forms is None else {}
    professions = list(data["professions"] if professions is None else professions)
    gendered = set(data["gendered_forms"] if gendered_forms is None else gendered_forms)
    unk = getattr(tokenizer, "unk_token_id", None)
    by_token: dict[int, list[str]] = defaultdict(list)
    dropped = []
    for prof in professions:
        tid = first_token(tokenizer, prof)
        text = _token_text(tokenizer, tid)
        if (unk is not None and tid == unk) or not counts_as_profession(text, prof, min_partial):
            dropped.append(
                {
                    "profession": prof,
                    "first_token": text,
                    "token_id": tid,
                    "reason": "unknown token" if unk is not None and tid == unk else "piece too short",
                }
            )
            continue
        by_token[tid].append(prof)
    rows = []
    for tid, profs in sorted(by_token.items()):
        text = _token_text(tokenizer, tid)
        rows.append(
            {
                "token_id": tid,
                "token": text,
                "professions": "; ".join(profs),
                "n_professions": len(profs),
                "whole_word": any(text.lower() == p.split()[0].lower() for p in profs),
                "gendered": all(p in gendered for p in profs),
            }
        )
    cols = ["token_id", "token", "professions", "n_professions", "whole_word", "gendered"]
    return pd.DataFrame(rows, columns=cols), pd.DataFrame(
        dropped, columns=["profession", "first_token", "token_id", "reason"]
    )


def paper_profession_tokens(tokenizer, prof_tokens: pd.DataFrame) -> pd.DataFrame:
    """The paper's Table 23 professions mapped by the same rule (first token of
    ``" " + word``): gender, profession, token, and whether that token is one of
    ``prof_tokens`` (our lexicon's tokens for this tokenizer)."""
    ids = set(prof_tokens.token_id.tolist())
    rows = []
    for gender, words in load_gender_data()["paper_professions"].items():
        for w in words:
            tid = first_token(tokenizer, w)
            rows.append(
                {
                    "gender": gender,
                    "profession": w,
                    "token_id": tid,
                    "token": _token_text(tokenizer, tid),
                    "in_lexicon_tokens": tid in ids,
                }
            )
    return pd.DataFrame(rows)


def paper_bias_set(
    tokenizer, genders: Sequence[str] = GENDERS, min_partial: int = MIN_PARTIAL_LETTERS
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The paper's Table 23 professions as a set to measure the bias on (App. D), by the
    repository's rule: a profession is scored by the FIRST token of ``" " + profession``
    (as the model-discovered list; the paper picked these words from top-100 next-token
    lists, a token-level unit, and CNA's importance is for one predicted token), and with
    the lexicon's test (:func:`counts_as_profession`): the first token must be the
    profession's first word or a prefix of it with at least ``min_partial`` letters (" p"
    of "porter" would score every word in p).

    Returns ``(scored, professions)``. ``professions``: one row per Table-23 profession
    with its gender, number of tokens, ``multi_token``, first token and ``used`` / ``reason``
    (none is dropped silently). ``scored``: one row per (gender, first token), the
    professions that share it joined ("machinist; machine operator"), in the layout of
    :func:`biased_professions` (token_id, token, professions, bias_gender = the paper's
    gender, n_professions). A first token in both genders' lists would measure nothing
    (one log-prob, two opposite stereotypes): its professions are reported, not scored."""
    rows = []
    for gender, words in load_gender_data()["paper_professions"].items():
        if gender not in genders:
            raise ValueError(f"Table 23 gender {gender!r} not in {list(genders)}")
        for w in words:
            ids = tokenizer(" " + w, add_special_tokens=False)["input_ids"]
            tid = first_token(tokenizer, w)
            rows.append(
                {
                    "gender": gender,
                    "profession": w,
                    "n_tokens": len(ids),
                    "multi_token": len(ids) > 1,
                    "token_id": tid,
                    "token": _token_text(tokenizer, tid),
                }
            )
    prof = pd.DataFrame(rows)
    both = prof.groupby("token_id").gender.nunique()
    clash = prof.token_id.isin(set(both[both > 1].index))
    unk = getattr(tokenizer, "unk_token_id", None)
    is_unk = prof.token_id == unk if unk is not None else pd.Series(False, index=prof.index)
    short = ~np.array([counts_as_profession(t, p, min_partial) for t, p in zip(prof.token, prof.profession)])
    prof["used"] = ~(clash | is_unk | short)
    prof["reason"] = np.select(
        [is_unk, short, clash], ["unknown token", "piece too short", "first token in both genders' lists"], ""
    )
    scored = (
        prof[prof.used]
        .groupby(["gender", "token_id"], sort=False)
        .agg(token=("token", "first"), professions=("profession", "; ".join), n_professions=("profession", "size"))
        .reset_index()
        .rename(columns={"gender": "bias_gender"})
    )
    return scored[["token_id", "token", "professions", "bias_gender", "n_professions"]], prof


# --------------------------------------------------------------------------- prompts and forward passes


def table22_prompts(filler: str) -> list[str]:
    """The 8 prompts of Table 22 with ``<gend>`` replaced by ``filler`` ("man",
    "woman", or a gender-free word such as "person")."""
    return [p.replace("<gend>", filler) for p in load_gender_data()["prompts"]]


@torch.no_grad()
def next_token_logprobs(
    model, tokenizer, texts: Sequence[str], hooks: Sequence[Hook] | None = None, batch_size: int = 32
) -> torch.Tensor:
    """log p(next token | text) at the last position of each text, [n, vocab] (float32,
    CPU), with ``hooks`` active at every position. Texts are tokenized as
    :class:`PromptSet` does (special tokens included) and batched by length (no padding)."""
    return next_token_logprobs_many(model, tokenizer, texts, [hooks], batch_size)[0]


@torch.no_grad()
def next_token_logprobs_many(
    model,
    tokenizer,
    texts: Sequence[str],
    conditions: Sequence[Sequence[Hook] | None],
    batch_size: int = 32,
    max_rows: int = 512,
    progress: bool = False,
) -> list[torch.Tensor]:
    """:func:`next_token_logprobs` under each condition (hooks active at every position),
    one [n, vocab] tensor per condition. The conditions share forward passes: a batch is
    repeated once per condition (condition-major, at most ``max_rows`` rows) and each
    condition's hooks act on its own rows (:func:`arithlib.engine.stacked_hooks`); a few
    short prompts per pass would otherwise read every weight for a handful of rows."""
    if not texts:
        raise ValueError("no texts")
    conditions = [list(c or []) for c in conditions]
    ids = [tokenizer(t)["input_ids"] for t in texts]
    device = input_device(model)
    groups: dict[int, list[int]] = defaultdict(list)
    for i, x in enumerate(ids):
        groups[len(x)].append(i)
    out: list[torch.Tensor | None] = [None] * len(conditions)
    for _, idx in tqdm(sorted(groups.items()), desc="lengths", disable=not progress, leave=False):
        for s in range(0, len(idx), batch_size):
            chunk = idx[s : s + batch_size]
            tokens = torch.tensor([ids[i] for i in chunk], device=device)
            step = max(1, max_rows // len(chunk))
            for c0 in range(0, len(conditions), step):
                conds = conditions[c0 : c0 + step]
                with model.hooks(fwd_hooks=stacked_hooks(conds, len(chunk))):
                    logits = last_position_logits(model, tokens.repeat(len(conds), 1))
                lp = logits.log_softmax(-1).cpu().view(len(conds), len(chunk), -1)
                for j in range(len(conds)):
                    if out[c0 + j] is None:
                        out[c0 + j] = torch.empty(len(texts), lp.shape[-1])
                    out[c0 + j][chunk] = lp[j]
    return out


def gender_logprobs(
    model, tokenizer, hooks: Sequence[Hook] | None = None, genders: Sequence[str] = GENDERS
) -> dict[str, torch.Tensor]:
    """``{gender: [8, vocab]}`` next-token log-probabilities on the Table-22 prompts."""
    return gender_logprobs_many(model, tokenizer, [hooks], genders)[0]


def gender_logprobs_many(
    model,
    tokenizer,
    conditions: Sequence[Sequence[Hook] | None],
    genders: Sequence[str] = GENDERS,
    progress: bool = False,
) -> list[dict[str, torch.Tensor]]:
    """:func:`gender_logprobs` under each condition, the conditions sharing passes."""
    texts = [t for g in genders for t in table22_prompts(g)]
    n = len(texts) // len(genders)
    return [
        {g: lp[i * n : (i + 1) * n] for i, g in enumerate(genders)}
        for lp in next_token_logprobs_many(model, tokenizer, texts, conditions, progress=progress)
    ]


# --------------------------------------------------------------------------- Table 23 from the model


def top_predictions(
    logprobs: Mapping[str, torch.Tensor], tokenizer, prof_tokens: pd.DataFrame, k: int = TOP_K
) -> pd.DataFrame:
    """Each prompt's top-``k`` next tokens per gender (App. D): rows prompt_id, prompt,
    gender, rank, token_id, token, logprob, is_profession, professions, gendered."""
    info = prof_tokens.set_index("token_id")
    rows = []
    for gender, lp in logprobs.items():
        prompts = table22_prompts(gender)
        top = lp.topk(min(k, lp.shape[-1]), dim=-1)
        for p in range(lp.shape[0]):
            for rank, (v, tid) in enumerate(zip(top.values[p].tolist(), top.indices[p].tolist()), 1):
                hit = tid in info.index
                rows.append(
                    {
                        "prompt_id": p,
                        "prompt": prompts[p],
                        "gender": gender,
                        "rank": rank,
                        "token_id": tid,
                        "token": tokenizer.decode([tid]),
                        "logprob": v,
                        "is_profession": hit,
                        "professions": info.loc[tid, "professions"] if hit else "",
                        "gendered": bool(info.loc[tid, "gendered"]) if hit else False,
                    }
                )
    return pd.DataFrame(rows)


def biased_professions(
    top: pd.DataFrame, genders: Sequence[str] = GENDERS, exclude_gendered: bool = True
) -> pd.DataFrame:
    """Profession tokens that differ by gender in the top-k lists (Table 23 from the model).

    For each prompt, a profession token is "only <g>" when it is in gender g's top-k
    and not the other's. Over the prompts, it is biased towards the gender it is
    "only" for on more prompts (ties: left out, ``bias_gender`` = "tie" in the
    returned frame, which the caller drops). Gendered forms (actress, policeman) are
    left out when ``exclude_gendered``. Rows: token_id, token, professions,
    n_only_<g> for each gender, n_prompts_in_both, bias_gender, gendered."""
    if len(genders) != 2:
        raise ValueError("two genders")
    g1, g2 = genders
    prof = top[top.is_profession]
    rows = []
    if prof.empty:
        return pd.DataFrame(
            columns=[
                "token_id",
                "token",
                "professions",
                f"n_only_{g1}",
                f"n_only_{g2}",
                "n_prompts_in_both",
                "bias_gender",
                "gendered",
            ]
        ).astype({"gendered": bool})
    meta = prof.drop_duplicates("token_id").set_index("token_id")
    sets = {(g, p): set(sub.token_id) for (g, p), sub in prof.groupby(["gender", "prompt_id"])}
    prompts = sorted(top.prompt_id.unique())
    for tid in meta.index:
        only1 = sum(tid in sets.get((g1, p), set()) and tid not in sets.get((g2, p), set()) for p in prompts)
        only2 = sum(tid in sets.get((g2, p), set()) and tid not in sets.get((g1, p), set()) for p in prompts)
        both = sum(tid in sets.get((g1, p), set()) and tid in sets.get((g2, p), set()) for p in prompts)
        if only1 == only2 == 0:
            continue
        gender = g1 if only1 > only2 else g2 if only2 > only1 else "tie"
        rows.append(
            {
                "token_id": int(tid),
                "token": meta.loc[tid, "token"].strip(),
                "professions": meta.loc[tid, "professions"],
                f"n_only_{g1}": only1,
                f"n_only_{g2}": only2,
                "n_prompts_in_both": both,
                "bias_gender": gender,
                "gendered": bool(meta.loc[tid, "gendered"]),
            }
        )
    frame = pd.DataFrame(
        rows,
        columns=[
            "token_id",
            "token",
            "professions",
            f"n_only_{g1}",
            f"n_only_{g2}",
            "n_prompts_in_both",
            "bias_gender",
            "gendered",
        ],
    ).astype({"gendered": bool})
    if exclude_gendered and len(frame):
        frame = frame[~frame.gendered]
    return frame.sort_values(
        ["bias_gender", f"n_only_{g1}", f"n_only_{g2}"], ascending=[False, False, False]
    ).reset_index(drop=True)


def compare_with_paper(biased: pd.DataFrame, paper: pd.DataFrame) -> pd.DataFrame:
    """For each gender: how many of the paper's Table 23 professions (as tokens) the
    model's biased set has for the same gender, for the other gender, or not at all."""
    rows = []
    for gender, sub in paper.groupby("gender"):
        same = set(biased.loc[biased.bias_gender == gender, "token_id"])
        other = set(biased.loc[(biased.bias_gender != gender) & (biased.bias_gender != "tie"), "token_id"])
        ids = set(sub.token_id)
        rows.append(
            {
                "gender": gender,
                "n_paper": len(sub),
                "n_model": len(same),
                "same_gender": len(ids & same),
                "other_gender": len(ids & other),
                "shared_tokens": ", ".join(sorted(sub[sub.token_id.isin(same)].token.unique())),
                "model_only": ", ".join(sorted(biased.loc[biased.token_id.isin(same - ids), "token"])),
            }
        )
    return pd.DataFrame(rows)


# --------------------------------------------------------------------------- bias metric (Table 13)


def bias_scores(
    logprobs: Mapping[str, torch.Tensor], biased: pd.DataFrame, genders: Sequence[str] = GENDERS
) -> pd.DataFrame:
    """Per prompt and biased profession token: log p under each gender, ``diff`` =
    log p(w | woman) - log p(w | man), ``abs_diff`` and ``toward`` = the difference
    in the direction of the token's bias gender (positive: still biased that way)."""
    g1, g2 = genders
    rows = []
    for p in range(logprobs[g1].shape[0]):
        for r in biased.itertuples():
            a, b = float(logprobs[g1][p, r.token_id]), float(logprobs[g2][p, r.token_id])
            d = a - b
            rows.append(
                {
                    "prompt_id": p,
                    "token_id": r.token_id,
                    "token": r.token,
                    "bias_gender": r.bias_gender,
                    f"logprob_{g1}": a,
                    f"logprob_{g2}": b,
                    "diff": d,
                    "abs_diff": abs(d),
                    "toward": d if r.bias_gender == g1 else -d,
                }
            )
    return pd.DataFrame(
        rows,
        columns=[
            "prompt_id",
            "token_id",
            "token",
            "bias_gender",
            f"logprob_{g1}",
            f"logprob_{g2}",
            "diff",
            "abs_diff",
            "toward",
        ],
    )


def bias_summary(scores: pd.DataFrame, genders: Sequence[str] = GENDERS) -> dict[str, float]:
    """Table 13's numbers: mean |log p(prof | g1) - log p(prof | g2)| over all
    (prompt, profession) pairs (``total``) and over each bias gender's professions
    (``<gender>``), plus the signed mean towards the stereotype (``toward``) and n."""
    out = {
        "total": float(scores.abs_diff.mean()) if len(scores) else float("nan"),
        "toward": float(scores.toward.mean()) if len(scores) else float("nan"),
        "n": int(len(scores)),
    }
    for g in genders:
        sub = scores[scores.bias_gender == g]
        out[g] = float(sub.abs_diff.mean()) if len(sub) else float("nan")
    return out


# --------------------------------------------------------------------------- CNA between genders


def _prompt_set(tokenizer, texts: Sequence[str]) -> PromptSet:
    """``texts`` as a PromptSet (one row each; targets are given separately)."""
    recs, ids = [], []
    for text in texts:
        recs.append(
            PromptRecord(
                family="gender", op="", a=0, b=0, answer=0, template_id=0, template=text, text=text, answer_text=""
            )
        )
        ids.append(list(tokenizer(text)["input_ids"]))
    return PromptSet(recs, ids, [[0] for _ in texts], [None] * len(texts), tokenizer)


def exact_affordable(model, max_macs: float = MAX_EXACT_MACS) -> bool:
    """Whether :func:`gender_cna` should compute the exact importance of every neuron: on
    a GPU, or when n_layers * d_mlp * d_model * vocab <= ``max_macs``."""
    cfg = model.cfg
    if input_device(model).type == "cuda":
        return True
    return cfg.n_layers * cfg.d_mlp * cfg.d_model * cfg.d_vocab <= max_macs


def screen_candidates(
    approx_change: torch.Tensor, n_candidates: int, n_aggregate: int, groups: Sequence[str] | None = None
) -> torch.Tensor:
    """The two-stage screen's candidates, a boolean mask [L, K]: the union of each case's
    top-``n_candidates`` neurons by stage-1 change (``approx_change`` [N, L, K]) and the
    top-``n_aggregate`` by the mean stage-1 change over the cases (gender-balanced with
    ``groups``, :func:`balanced_mean`). Only these get an exact importance in the screen."""
    N, L, K = approx_change.shape
    change = torch.nan_to_num(approx_change.reshape(N, L * K), nan=-torch.inf)
    mask = torch.zeros(L * K, dtype=torch.bool)
    if n_candidates > 0:
        mask[change.topk(min(n_candidates, L * K), dim=1).indices.flatten()] = True
    if n_aggregate > 0:
        mean = balanced_mean(torch.nan_to_num(approx_change, nan=0.0), groups).flatten()
        mask[mean.topk(min(n_aggregate, L * K)).indices] = True
    return mask.view(L, K)


@torch.no_grad()
def shared_input_importance(
    model,
    resid: torch.Tensor,
    coef: torch.Tensor,
    rows_a: Sequence[int],
    rows_b: Sequence[int],
    targets: torch.Tensor,
    *,
    groups: Sequence[str] | None = None,
    n_candidates: int | None = 20,
    n_aggregate: int = 200,
    exact_layers: Sequence[int] = (),
    vocab_chunk: int = 8192,
    block_elems: int = 2**24,
    progress: bool = False,
    scale: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """CNA importance (Sec. 4.1) when many cases share few inputs: ``resid`` [G, L, d] and
    ``coef`` [G, L, K] are the answer-position captures of G distinct prompts; case i
    compares input ``rows_a[i]`` with ``rows_b[i]`` for target token ``targets[i]``.

    Why not :func:`arithlib.yu.cna.cna_compare`: it treats every case as its own input, so
    its vocabulary passes (baseline statistics and, per candidate neuron, the
    log-partition of softmax(W_U norm(r + m v))) are repeated for every case. Here the
    log-partition of each (input, neuron) is computed once and shared by all targets;
    only the target logits differ, and those are cheap. Same two-stage scheme as
    :mod:`arithlib.yu.cna`: stage 1 (:func:`arithlib.yu.cna.first_order_importance`) scores
    every neuron for every case; stage 2 computes the exact importance, for EVERY case,
    of the union of each case's top-``n_candidates`` neurons by stage-1 change and the
    top-``n_aggregate`` by the mean stage-1 change (gender-balanced with ``groups``,
    :func:`balanced_mean`; :func:`screen_candidates`). ``n_candidates=None``: no screen,
    the exact importance of EVERY neuron (one log-partition per input and neuron, so its
    cost does not grow with the number of cases: about the cost of one prompt in
    :func:`arithlib.yu.cna.exact_importance`). ``exact_layers``: every neuron of these layers
    is exact besides the screen's candidates (to measure the screen's recall there).
    ``scale`` [G]: each input's fixed final norm scale (``cna.final_scale`` of its own
    run, the authors' reading); None: each vector's own RMS (the "own" variant).

    Returns ``importance`` and ``approx`` [2, N, L, K] (side a, side b; importance NaN
    outside the candidates) and ``base_logprob`` [2, N, L]."""
    norm = final_norm(model)
    W_U, b_U = unembedding(model)  # float32, as in cna: log-probability differences need it
    device = W_U.device  # a split model's unembedding device
    beta = C._beta(norm, W_U, b_U)
    G, L, d = resid.shape
    K = coef.shape[-1]
    N = len(targets)
    rows_a = torch.as_tensor(list(rows_a), dtype=torch.long)
    rows_b = torch.as_tensor(list(rows_b), dtype=torch.long)
    if len(rows_a) != N or len(rows_b) != N:
        raise ValueError("rows_a, rows_b and targets must have one entry per case")
    sides = torch.stack([rows_a, rows_b])  # [2, N] input of each case on each side
    t = targets.to(device)
    w_cols = W_U[:, t].T  # [N, d]
    approx = torch.full((2, N, L, K), torch.nan)
    base = torch.full((2, N, L), torch.nan)
    stats_by_layer = {}
    scale = None if scale is None else scale.float().to(device)
    for layer in tqdm(range(L), desc="stage 1", disable=not progress, leave=False):
        r = resid[:, layer].to(device).float()
        m = coef[:, layer].to(device).float()
        stats, _ = C.layer_stats(
            r,
            torch.zeros(G, dtype=torch.long, device=device),
            norm,
            W_U,
            b_U,
            vocab_chunk=max(vocab_chunk, 16384),
            scale=scale,
        )
        gr = C._centre(r, norm) * norm.weight  # [G, d]
        A_t = gr @ w_cols.T  # [G, N]: target logits before scaling, every input x every target
        stats_by_layer[layer] = (stats, A_t)
        values = w_out(model, layer).to(device)
        for s in range(2):
            g = sides[s]
            st = C.LayerStats(
                sigma0=stats.sigma0[g], A_w=A_t[g, torch.arange(N)], lse0=stats.lse0[g], pA=stats.pA[g], q=stats.q[g]
            )
            approx[s, :, layer] = C.first_order_importance(
                r[g], m[g], values, t, norm, W_U, st, None if scale is None else scale[g]
            ).cpu()
            base[s, :, layer] = (st.A_w / st.sigma0 + beta[t] - st.lse0).cpu()
    # candidates: the screen's, or every neuron
    if n_candidates is None:
        cand = torch.ones(L, K, dtype=torch.bool)
    else:
        cand = screen_candidates(approx[0] - approx[1], n_candidates, n_aggregate, groups)
        cand[list(exact_layers)] = True
    by_layer = {layer: cand[layer].nonzero().flatten().tolist() for layer in range(L) if cand[layer].any()}
    importance = torch.full((2, N, L, K), torch.nan)
    for layer, neurons in tqdm(sorted(by_layer.items()), desc="stage 2 (exact)", disable=not progress, leave=False):
        stats, A_t = stats_by_layer[layer]
        idx = torch.tensor(neurons, device=device)
        r = resid[:, layer].to(device).float()
        m = coef[:, layer].to(device).float()[:, idx]  # [G, U]
        values = w_out(model, layer).to(device)[idx]
        rc, v, sigma = C._pair_terms(r, m, values, norm, scale)  # sigma [G, U]
        gr, gv = rc * norm.weight, v * norm.weight
        lse = C.log_partition_all(gr, gv, m, sigma, W_U, beta, vocab_chunk, block_elems)  # [G, U]
        B_t = gv @ w_cols.T  # [U, N]
        z_t = (A_t[:, None, :] + m[:, :, None] * B_t[None]) / sigma[:, :, None] + beta[t]  # [G, U, N]
        lp = z_t - lse[:, :, None]  # log p(target_n | input g with neuron u added)
        base_g = A_t / stats.sigma0[:, None] + beta[t] - stats.lse0[:, None]  # [G, N]
        imp = lp - base_g[:, None, :]  # [G, U, N]
        for s in range(2):
            g = sides[s].to(device)
            importance[s, :, layer, idx.cpu()] = imp[g, :, torch.arange(N, device=device)].cpu()
    return {"importance": importance, "approx": approx, "base_logprob": base}


def gender_cna(
    model,
    tokenizer,
    biased: pd.DataFrame,
    prompt_id: int = 0,
    genders: Sequence[str] = GENDERS,
    *,
    n_candidates: int | None = None,
    n_aggregate: int = 200,
    exact_layers: Sequence[int] = (),
    progress: bool = True,
    norm_reading: str = "final",
) -> C.CNAResult:
    """CNA between the genders (Sec. 6.2) on Table-22 prompt ``prompt_id``, one case per
    row of ``biased``: run a = the prompt with the row's bias gender, run b = with the
    other gender, target = the profession token; ``result.change[i]`` ranks the
    neurons that raise p(w_i | its gender) over p(w_i | other gender). The two prompts
    are run once and every case shares their captures (:func:`shared_input_importance`).
    ``n_candidates=None`` (default): the exact importance of every neuron (mode "exact");
    an int: the two-stage screen (:func:`screen_candidates`), plus every neuron of
    ``exact_layers``. ``norm_reading`` "final": each prompt's vectors are read with its own
    run's final norm scale (each gender's prompt is its own original run); "own": each
    vector's own RMS (``cna.NORM_READINGS``)."""
    check_norm_reading(norm_reading)
    if len(biased) == 0:
        raise ValueError("no biased professions: nothing to compare")
    genders = list(genders)
    texts = [table22_prompts(g)[prompt_id] for g in genders]
    ps = _prompt_set(tokenizer, texts)
    targets = torch.tensor(biased.token_id.tolist(), dtype=torch.long)
    run = run_last_position(
        model,
        ps,
        None,
        capture=("resid_mid", "coef"),
        targets=torch.zeros(len(texts), dtype=torch.long),
        share_prefix=False,
    )
    own = [genders.index(g) for g in biased.bias_gender]
    other = [1 - i for i in own]
    out = shared_input_importance(
        model,
        run.resid_mid,
        run.coef,
        own,
        other,
        targets,
        groups=list(biased.bias_gender),
        n_candidates=n_candidates,
        n_aggregate=n_aggregate,
        exact_layers=exact_layers,
        progress=progress,
        scale=run_scales([run], final_norm(model), norm_reading, None)[0],
    )
    lp_final = {}
    with torch.no_grad():
        lp_all = next_token_logprobs(model, tokenizer, texts)
    for side, rows in (("a", own), ("b", other)):
        lp_final[side] = LastPosition(
            targets=targets,
            pred=lp_all[rows].argmax(-1),
            logprob=lp_all[rows, targets],
            resid_mid=run.resid_mid[rows],
            coef=run.coef[rows],
            final_resid=run.final_resid[rows],
        )
    imp, approx, base = out["importance"], out["approx"], out["base_logprob"]
    return C.CNAResult(
        importance_a=imp[0],
        importance_b=imp[1],
        approx_a=approx[0],
        approx_b=approx[1],
        coef_a=run.coef[own],
        coef_b=run.coef[other],
        base_logprob_a=base[0],
        base_logprob_b=base[1],
        run_a=lp_final["a"],
        run_b=lp_final["b"],
        targets=targets,
        mode="exact" if n_candidates is None else "two_stage",
        n_candidates=n_candidates,
        layers=list(range(run.coef.shape[1])),
        norm_reading=norm_reading,
    )


def balanced_mean(x: torch.Tensor, groups: Sequence[str] | None = None) -> torch.Tensor:
    """Mean over dim 0 of ``x``; with ``groups`` (one label per row) the mean of the group
    means, so that each group (bias gender) weighs the same however many rows it has."""
    if groups is None:
        return x.mean(0)
    labels = np.asarray(list(groups))
    if len(labels) != x.shape[0]:
        raise ValueError(f"{len(labels)} group labels for {x.shape[0]} rows")
    return torch.stack([x[torch.as_tensor(np.flatnonzero(labels == g))].mean(0) for g in sorted(set(labels))]).mean(0)


def aggregate_change(
    result: C.CNAResult, cases: Sequence[int] | None = None, groups: Sequence[str] | None = None
) -> torch.Tensor:
    """Mean CNA change over ``cases`` (default all), [L, d_mlp]: the exact change where
    computed, the stage-1 change elsewhere (a neuron outside the exact candidates is
    outside every case's top by the stage-1 score). With ``groups`` (the bias gender of
    every case of ``result``) the mean is gender-balanced (:func:`balanced_mean`): a
    neuron that shifts every profession towards one gender scores + on that gender's
    professions and - on the other's, and cancels out instead of ranking because the
    two lists have different lengths. This aggregation is ours; the paper does not say
    how it pools its 32 professions."""
    idx = list(range(len(result))) if cases is None else list(cases)
    if not idx:
        raise ValueError("no cases to aggregate")
    exact = result.change[idx]
    approx = result.approx_change[idx]
    filled = torch.nan_to_num(torch.where(torch.isfinite(exact), exact, approx), nan=0.0)
    return balanced_mean(filled, None if groups is None else [list(groups)[i] for i in idx])


def bias_neurons(
    result: C.CNAResult,
    k: int,
    cases: Sequence[int] | None = None,
    groups: Sequence[str] | None = None,
    min_layer: int = 0,
) -> list[Neuron]:
    """The ``k`` neurons with the largest (gender-balanced, with ``groups``) mean change
    over ``cases``: the edit set. ``min_layer``: only neurons of layers >= it (the edit
    set without the early layers, refilled to ``k`` from the later ones)."""
    agg = aggregate_change(result, cases, groups).clone()
    if not 0 <= min_layer < agg.shape[0]:
        raise ValueError(f"min_layer {min_layer} outside 0..{agg.shape[0] - 1}")
    agg[:min_layer] = -torch.inf
    return C.top_neurons(agg, k)


def without_early(neurons: Sequence[Neuron], min_layer: int) -> list[Neuron]:
    """``neurons`` less those in layers below ``min_layer`` (the edit set with its early
    neurons removed and not replaced)."""
    return [(l, n) for l, n in neurons if l >= min_layer]


def candidate_screen_recall(
    result: C.CNAResult,
    biased: pd.DataFrame,
    ks: Sequence[int],
    n_candidates: int,
    n_aggregate: int,
    layers: Sequence[int] | None = None,
) -> pd.DataFrame:
    """How much the two-stage screen (:func:`screen_candidates` with ``n_candidates`` per
    case and ``n_aggregate`` pooled) misses, measured against the exact importance of
    every neuron (``result`` from :func:`gender_cna` with ``n_candidates=None``).

    One row per case (profession token) and k: ``recall`` = share of the case's exact
    top-k (by change) among the screen's candidates. Rows with case "pooled (edit set)":
    the same for the exact edit set (top-k of the gender-balanced mean change), and
    ``edit_set_overlap`` = share of it that the screen's edit set (exact change on the
    candidates, stage-1 change elsewhere, :func:`aggregate_change`) also holds.

    ``layers``: measure within these layers only (every neuron of them exact, e.g.
    ``gender_cna(n_candidates=..., exact_layers=layers)``): the top-k are then those of
    these layers. Default: all layers (``result`` exact everywhere)."""
    L = result.importance_a.shape[1]
    layers = list(range(L)) if layers is None else sorted(set(layers))
    if not torch.isfinite(result.importance_a[:, layers]).all():
        raise ValueError(
            "candidate_screen_recall needs the exact importance of every neuron of the layers it measures "
            "(gender_cna(n_candidates=None) or exact_layers=layers)"
        )
    groups = list(biased.bias_gender)
    mask = screen_candidates(result.approx_change, n_candidates, n_aggregate, groups)
    outside = torch.ones(L, dtype=torch.bool)
    outside[layers] = False

    def restrict(imp: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        return torch.where(keep & ~outside[:, None], imp, torch.nan)

    exact = C.CNAResult(
        **{
            **result.__dict__,
            "importance_a": restrict(result.importance_a, torch.tensor(True)),
            "importance_b": restrict(result.importance_b, torch.tensor(True)),
            "approx_a": restrict(result.approx_a, torch.tensor(True)),
            "approx_b": restrict(result.approx_b, torch.tensor(True)),
        }
    )
    screened = C.CNAResult(
        **{
            **exact.__dict__,
            "importance_a": restrict(result.importance_a, mask),
            "importance_b": restrict(result.importance_b, mask),
            "mode": "two_stage",
            "n_candidates": n_candidates,
        }
    )
    rows = []
    base = {
        "n_candidates": n_candidates,
        "n_aggregate": n_aggregate,
        "n_screened": int(mask[layers].sum()),
        "n_neurons": int(mask[layers].numel()),
        "layers": "all" if len(layers) == L else " ".join(map(str, layers)),
    }
    for i, r in enumerate(biased.itertuples()):
        for k in ks:
            top = exact.top(i, k)
            rows.append(
                {
                    "case": r.token,
                    "bias_gender": r.bias_gender,
                    "k": k,
                    **base,
                    "recall": sum(bool(mask[n]) for n in top) / len(top),
                    "edit_set_overlap": float("nan"),
                }
            )
    for k in ks:
        top, screen = (
            C.top_neurons(aggregate_change(res, groups=groups).masked_fill(outside[:, None], -torch.inf), k)
            for res in (exact, screened)
        )
        rows.append(
            {
                "case": "pooled (edit set)",
                "bias_gender": "both",
                "k": k,
                **base,
                "recall": sum(bool(mask[n]) for n in top) / len(top),
                "edit_set_overlap": len(set(top) & set(screen)) / len(top),
            }
        )
    return pd.DataFrame(rows)


def edit_layers(neuron_sets: Mapping[str, Sequence[Neuron]]) -> pd.DataFrame:
    """Layers of each edit set: rows edit_set, layer, n_neurons (layers holding at least
    one of its neurons), share of the set."""
    rows = []
    for name, ns in neuron_sets.items():
        counts = pd.Series([l for l, _ in ns], dtype=int).value_counts().sort_index()
        rows += [
            {"edit_set": name, "layer": int(l), "n_neurons": int(c), "share": c / len(ns)} for l, c in counts.items()
        ]
    return pd.DataFrame(rows, columns=["edit_set", "layer", "n_neurons", "share"])


def _gender_rows(
    result: C.CNAResult, biased: pd.DataFrame, genders: Sequence[str]
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``{gender: (resid_mid [L, d], coef [L, K])}`` at the CNA prompt's last position:
    run a of a case whose bias gender it is, else run b of a case of the other gender."""
    out = {}
    labels = list(biased.bias_gender)
    for g in genders:
        if g in labels:
            i = labels.index(g)
            out[g] = (result.run_a.resid_mid[i], result.coef_a[i])
        else:
            i = next(j for j, x in enumerate(labels) if x != g)
            out[g] = (result.run_b.resid_mid[i], result.coef_b[i])
    return out


@torch.no_grad()
def layer_diagnostic(
    model, result: C.CNAResult, biased: pd.DataFrame, edit_set: Sequence[Neuron], genders: Sequence[str] = GENDERS
) -> pd.DataFrame:
    """Per layer l, what the importance of its neurons is read from (Sec. 4.1: the residual
    x^{l-1} + A^l plus m_k fc2_k, through the final norm and the unembedding):

    ``resid_rms_<g>``: RMS of the (centred) residual under each gender, the scale the final
    norm divides by; ``write_to_resid_<g>``: median over the layer's neurons of
    |m_k fc2_k| / |x^{l-1} + A^l| (a neuron's write relative to the residual it is added
    to: where the residual is small, one neuron turns the normalised direction and the
    importance is large whatever the neuron means); ``mean_abs_importance`` over neurons,
    cases and both runs; ``mean_abs_change`` and ``max_change`` of the pooled change the
    edit set is ranked by; ``n_in_edit_set``."""
    norm = final_norm(model)
    rows_g = _gender_rows(result, biased, genders)
    agg = aggregate_change(result, groups=list(biased.bias_gender))
    L = agg.shape[0]
    in_set = pd.Series([l for l, _ in edit_set], dtype=int).value_counts()
    imp = torch.cat([result.importance_a, result.importance_b]).abs()
    rows = []
    for layer in range(L):
        v = C._centre(w_out(model, layer).float().cpu(), norm).norm(dim=-1)  # [K]
        row = {"layer": layer}
        for g, (resid, coef) in rows_g.items():
            r = C._centre(resid[layer].float(), norm)
            row[f"resid_rms_{g}"] = float(r.pow(2).mean().sqrt())
            row[f"write_to_resid_{g}"] = float((coef[layer].float().abs() * v / r.norm()).median())
        li = imp[:, layer]
        row["mean_abs_importance"] = float(li[torch.isfinite(li)].mean()) if torch.isfinite(li).any() else float("nan")
        row["mean_abs_change"] = float(agg[layer].abs().mean())
        row["max_change"] = float(agg[layer].max())
        row["n_in_edit_set"] = int(in_set.get(layer, 0))
        rows.append(row)
    return pd.DataFrame(rows)


def random_neuron_sets(neurons: Sequence[Neuron], d_mlp: int, seeds: Sequence[int]) -> dict[int, list[Neuron]]:
    """For each seed, as many random neurons as ``neurons``, one in each of their layers
    and none of them (:func:`arithlib.yu.mask_keep.random_layer_matched`)."""
    return {s: random_layer_matched([list(neurons)], d_mlp, s)[0] for s in seeds}


def neuron_table(
    model,
    tokenizer,
    result: C.CNAResult,
    biased: pd.DataFrame,
    k: int = 3,
    n_tokens: int = 8,
    genders: Sequence[str] = GENDERS,
) -> pd.DataFrame:
    """Table 12 per profession: its top-``k`` CNA neurons with importance and coefficient
    under each gender and the top tokens of the neuron's value on the vocabulary."""
    g1, g2 = genders
    frames = []
    for i, r in enumerate(biased.itertuples()):
        f = result.top_frame(i, k, tokenizer, model, n_tokens)
        if f.empty:
            continue
        other = g2 if r.bias_gender == g1 else g1
        f = f.rename(
            columns={
                "imp_a": f"imp_{r.bias_gender}",
                "imp_b": f"imp_{other}",
                "coef_a": f"coef_{r.bias_gender}",
                "coef_b": f"coef_{other}",
            }
        )
        f.insert(0, "profession", r.token)
        f.insert(1, "bias_gender", r.bias_gender)
        frames.append(f)
    if not frames:
        return pd.DataFrame()
    cols = [
        "profession",
        "bias_gender",
        "rank",
        "name",
        "layer",
        "neuron",
        f"imp_{g1}",
        f"imp_{g2}",
        f"coef_{g1}",
        f"coef_{g2}",
        "change",
        "top_tokens",
    ]
    out = pd.concat(frames, ignore_index=True)
    return out[[c for c in cols if c in out.columns]]


def edit_set_table(
    model,
    tokenizer,
    result: C.CNAResult,
    biased: pd.DataFrame,
    neurons: Sequence[Neuron],
    n_tokens: int = 8,
    genders: Sequence[str] = GENDERS,
) -> pd.DataFrame:
    """The edit set: each neuron's mean change over all cases and over each bias
    gender's cases, its coefficient under each gender (the same prompt for every case,
    so one value per gender), and its top vocabulary tokens."""
    if not neurons:
        return pd.DataFrame()
    g1, g2 = genders
    agg = aggregate_change(result, groups=list(biased.bias_gender))
    by_g = {
        g: aggregate_change(result, np.flatnonzero(biased.bias_gender.values == g).tolist())
        if (biased.bias_gender == g).any()
        else None
        for g in genders
    }
    coef = {}
    for g in genders:
        rows_own = np.flatnonzero(biased.bias_gender.values == g)
        rows_other = np.flatnonzero(biased.bias_gender.values != g)
        coef[g] = result.coef_a[rows_own[0]] if len(rows_own) else result.coef_b[rows_other[0]]
    vecs = torch.stack([w_out(model, l)[n] for l, n in neurons])
    toks = top_tokens(model, tokenizer, vecs, n_tokens)
    rows = []
    for rank, ((l, n), t) in enumerate(zip(neurons, toks), 1):
        row = {"rank": rank, "name": f"{l}_{n}", "layer": l, "neuron": n, "mean_change": float(agg[l, n])}
        for g in genders:
            row[f"mean_change_{g}_profs"] = float(by_g[g][l, n]) if by_g[g] is not None else float("nan")
        for g in genders:
            row[f"coef_{g}"] = float(coef[g][l, n])
        row["top_tokens"] = ", ".join(t)
        rows.append(row)
    return pd.DataFrame(rows)


# --------------------------------------------------------------------------- edit and controls


def edit_conditions(
    neurons_by_k: Mapping[int, Sequence[Neuron]],
    random_by_k: Mapping[int, Mapping[int, Sequence[Neuron]]],
    kind: str = "cna",
) -> dict[tuple[str, int, int], list[Hook]]:
    """Hooks per condition ``(kind, K, seed)``: ("original", 0, -1) no edit; (``kind``, K, -1)
    zero the top-K CNA neurons; (:func:`control_kind` of ``kind``, K, seed) zero the seed's
    random set. Zeroing is at every position, which equals setting the neurons' parameters
    to zero. ``kind``: "cna", or a variant such as "cna_late" (the edit set without the
    early layers) whose controls are "random_late"."""
    conds: dict[tuple[str, int, int], list[Hook]] = {("original", 0, -1): []}
    ctrl = control_kind(kind)
    for k, ns in neurons_by_k.items():
        conds[(kind, k, -1)] = zero_neurons_hooks(ns, position=None)
        for seed, rs in random_by_k.get(k, {}).items():
            conds[(ctrl, k, seed)] = zero_neurons_hooks(rs, position=None)
    return conds


def bias_under_conditions(
    model,
    tokenizer,
    biased: pd.DataFrame,
    conditions: Mapping[tuple[str, int, int], list[Hook]],
    genders: Sequence[str] = GENDERS,
    progress: bool = True,
) -> pd.DataFrame:
    """:func:`bias_scores` on all 8 prompts under each condition (the conditions sharing
    forward passes); rows as bias_scores plus kind, K, seed."""
    return bias_by_set(model, tokenizer, {"": biased}, conditions, genders, progress)[""]


def bias_by_set(
    model,
    tokenizer,
    sets: Mapping[str, pd.DataFrame],
    conditions: Mapping[tuple[str, int, int], list[Hook]],
    genders: Sequence[str] = GENDERS,
    progress: bool = True,
) -> dict[str, pd.DataFrame]:
    """:func:`bias_under_conditions` for several profession sets (the model's own list,
    the paper's Table 23) from the same forward passes: ``{name: scores}``."""
    frames: dict[str, list[pd.DataFrame]] = {name: [] for name in sets}
    for (kind, k, seed), lp in zip(
        conditions, gender_logprobs_many(model, tokenizer, list(conditions.values()), genders, progress)
    ):
        for name, profs in sets.items():
            frames[name].append(bias_scores(lp, profs, genders).assign(kind=kind, K=k, seed=seed))
    return {name: pd.concat(f, ignore_index=True) for name, f in frames.items()}


def control_kind(kind: str) -> str:
    """The random control's kind of an edit kind: "cna" -> "random", "cna_late" -> "random_late"."""
    if not kind.startswith("cna"):
        raise ValueError(f"edit kinds start with 'cna', got {kind!r}")
    return "random" + kind[3:]


def _per_profession(scores: pd.DataFrame, kind: str, k: int, seed: int | None = None) -> pd.DataFrame:
    """|bias| of one condition as a professions x prompts matrix (rows token_id, sorted)."""
    sub = scores[(scores.kind == kind) & (scores.K == k)]
    if seed is not None:
        sub = sub[sub.seed == seed]
    return sub.pivot_table(index="token_id", columns="prompt_id", values="abs_diff", aggfunc="first").sort_index()


def reduction_intervals(
    scores: pd.DataFrame, kinds: Sequence[str] = ("cna",), ks: Sequence[int] | None = None
) -> pd.DataFrame:
    """Table 13's reduction with 95 % intervals, per edit kind and size K: ``reduction_pct``
    = 100 (1 - mean bias edited / mean bias original) over the professions and prompts of
    ``scores`` (:func:`bias_scores` rows with kind, K, seed); ``random_pct`` the same for
    the layer-matched random sets (:func:`control_kind`), mean over seeds; ``diff_pts`` =
    reduction minus random. Intervals: a bootstrap over professions (each with all its
    prompts; stratified by bias gender where the column exists) crossed with the random
    seeds (:func:`arithlib.core.stats.crossed_bootstrap_ci`). Rows without random seeds get NaN
    intervals for the control and the difference."""
    orig = _per_profession(scores, "original", 0)
    if orig.empty:
        raise ValueError("no original-model rows in the scores")
    gender = (
        scores.drop_duplicates("token_id").set_index("token_id").bias_gender.reindex(orig.index).to_numpy()
        if "bias_gender" in scores
        else None
    )
    o = orig.to_numpy(float)

    def red(a: np.ndarray, b: np.ndarray) -> float:
        return float(100 * (1 - b.mean() / a.mean()))

    def red_rand(a: np.ndarray, x: np.ndarray) -> float:  # mean over the seeds (last axis) of x
        return float(np.mean(100 * (1 - x.reshape(-1, x.shape[-1]).mean(0) / a.mean())))

    rows = []
    for kind in kinds:
        for k in sorted(scores.loc[scores.kind == kind, "K"].unique()) if ks is None else ks:
            edited = _per_profession(scores, kind, int(k)).reindex(index=orig.index, columns=orig.columns)
            if edited.isna().all().all():
                continue
            e = edited.to_numpy(float)
            rk = scores[(scores.kind == control_kind(kind)) & (scores.K == k)]
            seeds = sorted(rk.seed.unique())
            ci = bootstrap_ci(red, o, e, groups=gender)
            row = {
                "kind": kind,
                "K": int(k),
                "n_professions": len(o),
                "n_prompts": o.shape[1],
                "n_seeds": len(seeds),
                "reduction_pct": ci.estimate,
                "reduction_low": ci.low,
                "reduction_high": ci.high,
            }
            nan = float("nan")
            if seeds:
                x = np.stack(
                    [
                        _per_profession(scores, control_kind(kind), int(k), s)
                        .reindex(index=orig.index, columns=orig.columns)
                        .to_numpy(float)
                        for s in seeds
                    ],
                    -1,
                )
                rc = crossed_bootstrap_ci(red_rand, o, replicates=x, groups=gender)
                dc = crossed_bootstrap_ci(
                    lambda a, b, xx: red(a, b) - red_rand(a, xx), o, e, replicates=x, groups=gender
                )
                row.update(
                    random_pct=rc.estimate,
                    random_low=rc.low,
                    random_high=rc.high,
                    diff_pts=dc.estimate,
                    diff_low=dc.low,
                    diff_high=dc.high,
                )
            else:
                row.update(random_pct=nan, random_low=nan, random_high=nan, diff_pts=nan, diff_low=nan, diff_high=nan)
            rows.append(row)
    return pd.DataFrame(rows)


def summarize_conditions(
    scores: pd.DataFrame,
    prompt_ids: Sequence[int] | None = None,
    token_ids: Sequence[int] | None = None,
    genders: Sequence[str] = GENDERS,
) -> pd.DataFrame:
    """Table 13 per condition (kind, K, seed), restricted to ``prompt_ids`` / ``token_ids``
    when given: total and per-gender bias, signed bias, n, and the reduction (%) of the
    total relative to the original model on the same subset."""
    sub = scores
    if prompt_ids is not None:
        sub = sub[sub.prompt_id.isin(list(prompt_ids))]
    if token_ids is not None:
        sub = sub[sub.token_id.isin(list(token_ids))]
    rows = []
    for (kind, k, seed), g in sub.groupby(["kind", "K", "seed"], sort=False):
        rows.append({"kind": kind, "K": k, "seed": seed, **bias_summary(g, genders)})
    out = pd.DataFrame(rows)
    if out.empty:
        return out
    base = out.loc[out.kind == "original", "total"]
    base = float(base.iloc[0]) if len(base) else float("nan")
    out["reduction_pct"] = 100 * (base - out.total) / base if base else float("nan")
    return out


def table13(summary: pd.DataFrame, k: int, genders: Sequence[str] = GENDERS) -> pd.DataFrame:
    """Table 13 layout for edit size ``k``: original, CNA-edited, random control (mean and
    standard deviation over seeds) with total and per-gender bias and the reduction (%)."""
    cols = ["total", *genders, "toward", "reduction_pct"]
    rows = []
    orig = summary[summary.kind == "original"]
    if len(orig):
        rows.append({"model": "original", "K": 0, **{c: float(orig[c].iloc[0]) for c in cols}})
    cna = summary[(summary.kind == "cna") & (summary.K == k)]
    if len(cna):
        rows.append({"model": f"CNA top-{k} zeroed", "K": k, **{c: float(cna[c].iloc[0]) for c in cols}})
    rnd = summary[(summary.kind == "random") & (summary.K == k)]
    if len(rnd):
        rows.append(
            {
                "model": f"random {k} zeroed (mean of {len(rnd)} seeds)",
                "K": k,
                **{c: float(rnd[c].mean()) for c in cols},
                **{
                    f"{c}_sd": float(rnd[c].std(ddof=1)) if len(rnd) > 1 else float("nan")
                    for c in ("total", "reduction_pct")
                },
            }
        )
    return pd.DataFrame(rows)


# --------------------------------------------------------------------------- held-out split


def split_professions(biased: pd.DataFrame, seed: int, frac: float = 0.5) -> tuple[list[int], list[int]]:
    """Row indices of ``biased`` split into (selection, held-out), stratified by bias
    gender: a ``frac`` share of each gender's professions (at least one, and at least
    one left out when the gender has two or more) chosen with ``seed``."""
    rng = np.random.default_rng(seed)
    sel, held = [], []
    for g in sorted(biased.bias_gender.unique()):
        idx = np.flatnonzero(biased.bias_gender.values == g)
        idx = rng.permutation(idx)
        n = int(round(frac * len(idx)))
        n = min(max(n, 1), len(idx) - 1) if len(idx) > 1 else len(idx)
        sel += idx[:n].tolist()
        held += idx[n:].tolist()
    return sorted(sel), sorted(held)


# --------------------------------------------------------------------------- side effects


def profession_mass(logprobs: torch.Tensor, token_ids: Sequence[int]) -> dict[str, float]:
    """On gender-free prompts ([n, vocab] log-probs): total probability of the profession
    tokens (mean over prompts) and their mean log-probability."""
    ids = torch.tensor(list(token_ids), dtype=torch.long)
    if len(ids) == 0:
        return {"profession_mass": float("nan"), "profession_mean_logprob": float("nan")}
    lp = logprobs[:, ids]
    return {"profession_mass": float(lp.exp().sum(-1).mean()), "profession_mean_logprob": float(lp.mean())}


def arithmetic_accuracy(model, prompts: PromptSet, hooks: Sequence[Hook] | None = None) -> float:
    """Exact-answer accuracy (teacher forcing, :func:`arithlib.methods.answer_runs.correct_mask`, "full")
    of ``prompts`` with ``hooks`` active; NaN for an empty set. ``correct_mask`` runs
    each batch's shared prefix once, so only hooks that act on every position alike
    (:func:`arithlib.methods.ablation.is_position_invariant`) give the full forward's verdict:
    any other hook is refused."""
    odd = [name for name, fn in (hooks or []) if not is_position_invariant(fn)]
    if odd:
        raise ValueError(
            f"arithmetic_accuracy shares each prompt's prefix, so its hooks must act on every position "
            f"alike (zero/keep units with position=None); these do not: {odd[:3]}"
        )
    if len(prompts) == 0:
        return float("nan")
    with model.hooks(fwd_hooks=list(hooks or [])):
        return float(correct_mask(model, prompts, "full").float().mean())


def side_effects(
    model,
    tokenizer,
    conditions: Mapping[tuple[str, int, int], list[Hook]],
    *,
    prose: str,
    arith: PromptSet | None,
    profession_ids: Sequence[int],
    chunk_tokens: int = 128,
    max_chunks: int = 2,
    progress: bool = True,
) -> pd.DataFrame:
    """Side effects of each condition (hooks active): LM loss (nats/token) on the fixed
    English text ``prose`` (:func:`arithlib.methods.general_ability.lm_loss`, the first
    ``max_chunks`` chunks of ``chunk_tokens`` tokens), exact-answer arithmetic accuracy
    on ``arith``, and the profession tokens' total probability and mean log-probability
    on the gender-free Table-22 prompts ("A person works as a", ...). Rows: kind, K,
    seed, the measures and their change from the original model."""
    neutral = table22_prompts(NEUTRAL_WORD)
    rows = []
    for (kind, k, seed), hooks in tqdm(conditions.items(), desc="side effects", disable=not progress, leave=False):
        with model.hooks(fwd_hooks=list(hooks)):
            lm = GA.lm_loss(model, tokenizer, prose, chunk_tokens=chunk_tokens, max_chunks=max_chunks)
        acc = arithmetic_accuracy(model, arith, hooks) if arith is not None else float("nan")
        mass = profession_mass(next_token_logprobs(model, tokenizer, neutral, hooks), profession_ids)
        rows.append(
            {
                "kind": kind,
                "K": k,
                "seed": seed,
                "lm_loss": lm["lm_loss"],
                "lm_tokens": lm["n_tokens"],
                "unk_share": lm["unk_share"],
                "arith_accuracy": acc,
                "n_arith": len(arith) if arith is not None else 0,
                **mass,
            }
        )
    out = pd.DataFrame(rows)
    base = out[out.kind == "original"]
    if len(base):
        b = base.iloc[0]
        out["lm_loss_change"] = out.lm_loss - b.lm_loss
        out["arith_accuracy_change"] = out.arith_accuracy - b.arith_accuracy
        out["profession_mass_ratio"] = out.profession_mass / b.profession_mass if b.profession_mass else float("nan")
    return out
