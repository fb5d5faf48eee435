"""The professions the model associates with each gender: Yu & Ananiadou 2024, App. D
(Tables 22, 23). The lexicon ``data/professions.json`` and which first tokens count as a
profession, Table 22's prompts and their next-token log-probabilities, the top-100
predictions per prompt and gender, and the professions biased towards a gender."""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Mapping, Sequence

import numpy as np
import pandas as pd
import torch
from tqdm.auto import tqdm

from ..core.components import Hook
from ..core.datasets import load_gender_data
from ..engine import input_device, last_position_logits, stacked_hooks
from ..run.paths import data_path

#: Top-k next-token predictions per prompt and gender (App. D: "top100 predictions").
TOP_K = 100
#: A first token that is only part of the profession's first word (" reception" of
#: "receptionist") counts when it has at least this many letters; shorter pieces
#: (" c", " but", " par") are generic word pieces or other words.
MIN_PARTIAL_LETTERS = 5
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
