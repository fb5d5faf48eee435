"""Checks for exercise 07, Yu & Ananiadou's gender-bias edit (Sec. 6.2, Table 13;
``notebooks/exercises/07_*``): the bias metric, zeroing the CNA neurons, and the
reduction against layer-matched random neurons.

The toy model has no gender and no profession: its tokenizer knows integers and a few
arithmetic words, so "woman" and "man" are both the unknown token and the two prompts of
every Table-22 pair are the same token sequence (bias exactly 0). The checks therefore
run the method of :mod:`arithlib.yu.bias` on a stand-in with the same shape: two words
the toy knows (:data:`STAND_IN`) fill Table 22's ``<gend>``, and the number tokens are the
"professions" (:func:`number_professions`). Everything else (the top-100 lists, the
biased set, CNA between the two fillers, the edit and its random controls) is arithlib's
own pipeline of notebook 07. As in :mod:`arithlib.course.exercises`, a check prints one
line when the student's function agrees with arithlib's and raises :class:`CheckFailed`
saying what differs (naming the usual mistake where it recognises one) when it does not.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import pandas as pd
import torch

from ..core import datasets as ds
from ..core.components import Hook, Neuron
from ..core.models import LoadedModel
from ..core.prompt_sets import PromptSet
from ..methods.ablation import zero_neurons_hooks
from ..yu import bias as B
from ..yu import bias_cna as BC
from ..yu import bias_professions as BP
from .exercises import TOL, CheckFailed, check_model, passed

#: The stand-in "genders": two words of the toy's vocabulary that fill Table 22's <gend>.
STAND_IN = ("sum", "product")
#: Edit sizes (the paper zeroes 18 neurons) and random layer-matched sets per size.
EDIT_KS, N_SEEDS = (6, 18), 5
#: Yu's 1-digit arithmetic prompts per operator for the side effect (template "n1 op n2 =", 2-shot).
ARITH_PER_OP = 8


@dataclass(frozen=True)
class BiasData:
    """Notebook 07's pipeline on the toy model with the stand-in genders: ``biased``, the
    number tokens whose top-100 membership differs between the two fillers
    (:func:`arithlib.yu.bias_professions.biased_professions`: token_id, token, bias_gender,
    ...); ``cna``, CNA between the fillers on prompt 1
    (:func:`arithlib.yu.bias_cna.gender_cna`); ``edit_sets`` {K: top-K neurons}
    (:func:`arithlib.yu.bias_cna.bias_neurons`), ``random_sets`` {K: {seed: neurons}}
    (layer-matched); ``scores``, :func:`arithlib.yu.bias.bias_under_conditions` on all 8
    prompts under :func:`arithlib.yu.bias.edit_conditions` of those sets."""

    model: LoadedModel
    genders: tuple[str, str]
    biased: pd.DataFrame
    cna: object
    edit_sets: dict[int, list[Neuron]]
    random_sets: dict[int, dict[int, list[Neuron]]]
    scores: pd.DataFrame

    @property
    def bridge(self):
        return self.model.bridge

    @property
    def tokenizer(self):
        return self.model.tokenizer


def number_professions(tokenizer) -> pd.DataFrame:
    """The stand-in lexicon: every integer 0..999 as a "profession" token, in the layout of
    :func:`arithlib.yu.bias_professions.profession_tokens` (its first token, the toy has one per integer)."""
    words = [str(n) for n in range(1000)]
    return pd.DataFrame(
        {
            "token_id": [BP.first_token(tokenizer, w) for w in words],
            "token": words,
            "professions": words,
            "n_professions": 1,
            "whole_word": True,
            "gendered": False,
        }
    )


@lru_cache(maxsize=1)
def bias_data() -> BiasData:
    """The stand-in bias pipeline every notebook-07 check uses (:class:`BiasData`)."""
    model = check_model()
    bridge, tok, genders = model.bridge, model.tokenizer, STAND_IN
    lp = BP.gender_logprobs(bridge, tok, genders=genders)
    top = BP.top_predictions(lp, tok, number_professions(tok), k=BP.TOP_K)
    biased = BP.biased_professions(top, genders=genders)
    biased = biased[biased.bias_gender.isin(genders)].reset_index(drop=True)
    cna = BC.gender_cna(bridge, tok, biased, 0, genders, progress=False)
    groups = list(biased.bias_gender)
    edit_sets = {k: BC.bias_neurons(cna, k, groups=groups) for k in EDIT_KS}
    d_mlp = bridge.cfg.d_mlp
    random_sets = {
        k: BC.random_neuron_sets(edit_sets[k], d_mlp, [1000 * k + s for s in range(N_SEEDS)]) for k in EDIT_KS
    }
    scores = B.bias_under_conditions(bridge, tok, biased, B.edit_conditions(edit_sets, random_sets), genders, False)
    return BiasData(model, genders, biased, cna, edit_sets, random_sets, scores)


def _matrix(scores: pd.DataFrame, column: str, n_tokens: int) -> torch.Tensor:
    """A column of :func:`arithlib.yu.bias.bias_scores` rows (prompt-major, professions in
    order) as a [prompts, professions] tensor."""
    return torch.tensor(scores[column].to_numpy(np.float64), dtype=torch.float32).view(-1, n_tokens)


def _as_tensor(value, name: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise CheckFailed(f"{name} should return a torch.Tensor, got {type(value).__name__}")
    return value.detach().float().cpu()


def _close(a: torch.Tensor, b: torch.Tensor, tol: float = TOL) -> bool:
    return a.shape == b.shape and bool(torch.isfinite(a).all()) and float((a - b).abs().max()) <= tol


# --------------------------------------------------------------------------- exercise 1: the bias metric


def _why_diff(mine: torch.Tensor, ref: torch.Tensor, sub: pd.DataFrame, genders: Sequence[str]) -> str:
    """The usual mistake that ``mine`` [prompts, professions] makes, or a list of what to check."""
    n = ref.shape[1]
    a, b = _matrix(sub, f"logprob_{genders[0]}", n), _matrix(sub, f"logprob_{genders[1]}", n)
    if _close(mine, -ref):
        return f"the sign is reversed: the difference is log p(w | {genders[0]}) - log p(w | {genders[1]})"
    if _close(mine, a.exp() - b.exp(), 1e-6):
        return "a difference of probabilities: the metric takes log-probabilities (log_softmax), not softmax"
    if _close(mine, ref.exp(), 1e-3) or _close(mine, (-ref).exp(), 1e-3):
        return "a ratio of probabilities: the metric is the difference of the log-probabilities"
    if _close(mine, ref.abs()):
        return "the absolute value |d|: return the signed difference (the metric takes |d| when it averages)"
    offset = mine - ref
    if bool(torch.isfinite(offset).all()) and float(offset.std(1).max()) < TOL and float(offset.abs().max()) > TOL:
        return (
            "each prompt is off by one constant for every profession: you compare logits (or unnormalised "
            "scores); normalise over the vocabulary with log_softmax first"
        )
    return (
        "check the prompts (table22_prompts of each filler, in order), the tokenization "
        "(tokenizer(text)['input_ids'], which starts with the BOS token), the position (the last "
        "token of each prompt) and log_softmax over the whole vocabulary"
    )


def check_bias_diff(fn: Callable) -> None:
    """``fn(model, tokenizer, token_ids, genders, hooks=None)``: the [8, len(token_ids)] tensor
    of d = log p(w | prompt with genders[0]) - log p(w | prompt with genders[1]) at the last
    position of each Table-22 prompt, with ``hooks`` active; against the ``diff`` column of
    :func:`arithlib.yu.bias.bias_scores` (on :func:`arithlib.yu.bias_professions.gender_logprobs`,
    as :func:`arithlib.yu.bias.bias_under_conditions` computes it) for the stand-in genders'
    biased number tokens, without and with the CNA top-18 zeroed."""
    data = bias_data()
    ids = data.biased.token_id.tolist()
    k = max(EDIT_KS)
    hooks = B.edit_conditions({k: data.edit_sets[k]}, {})[("cna", k, -1)]
    sc = data.scores
    original = sc[sc.kind == "original"]
    for label, sub, h in (
        ("the original model", original, None),
        (f"the CNA top-{k} zeroed (hooks given)", sc[(sc.kind == "cna") & (sc.K == k)], hooks),
    ):
        mine = _as_tensor(fn(data.bridge, data.tokenizer, list(ids), data.genders, hooks=h), "bias_diff")
        ref = _matrix(sub, "diff", len(ids))
        if tuple(mine.shape) != tuple(ref.shape):
            raise CheckFailed(
                f"bias_diff on {label}: shape {tuple(mine.shape)}, expected {tuple(ref.shape)} "
                "(one row per Table-22 prompt, one column per token id)"
            )
        if _close(mine, ref):
            continue
        if h is not None and _close(mine, _matrix(original, "diff", len(ids))):
            raise CheckFailed(
                f"bias_diff on {label}: you return the original model's values; run the prompts "
                "inside `with model.hooks(fwd_hooks=hooks):`"
            )
        diff = float((mine - ref).abs().nan_to_num(float("inf")).max())
        raise CheckFailed(
            f"bias_diff on {label} differs from the reference by up to {diff:.3g}: "
            f"{_why_diff(mine, ref, sub, data.genders)}"
        )
    total = float(_matrix(original, "abs_diff", len(ids)).mean())
    passed(
        f"bias_diff matches arithlib.yu.bias.bias_scores on {len(ids)} stand-in professions x 8 prompts "
        f"(mean |d| = {total:.3f} nats), with and without hooks"
    )


# --------------------------------------------------------------------------- exercise 2: the edit


def check_sets() -> dict[str, list[Neuron]]:
    """The neuron sets :func:`check_zero_neuron_hooks` zeroes: the CNA top-18 (all in the
    last layer on the toy) and the top 9 of each layer by the CNA change (layer 0 included,
    whose neurons reach the last position through attention)."""
    data = bias_data()
    k = max(EDIT_KS)
    agg = BC.aggregate_change(data.cna, groups=list(data.biased.bias_gender))
    per_layer = [(layer, int(n)) for layer in range(agg.shape[0]) for n in agg[layer].topk(9).indices]
    return {f"CNA top-{k}": list(data.edit_sets[k]), "top 9 of each layer": per_layer}


@lru_cache(maxsize=1)
def _edit_references() -> dict[str, tuple[list[Neuron], pd.DataFrame]]:
    """Per set of :func:`check_sets`: the neurons and :func:`arithlib.yu.bias.bias_under_conditions`
    under :func:`arithlib.yu.bias.edit_conditions` (kind "cna"), beside what the usual mistakes
    give: the last position only, and the neurons of the next layer (mod the number of layers)."""
    data = bias_data()
    bridge, n_layers = data.bridge, data.bridge.cfg.n_layers
    out = {}
    for label, neurons in check_sets().items():
        k = len(neurons)
        conds = B.edit_conditions({k: neurons}, {})
        conds[("last position only", k, -1)] = zero_neurons_hooks(neurons, position=-1)
        conds[("next layer", k, -1)] = zero_neurons_hooks([((lay + 1) % n_layers, n) for lay, n in neurons])
        out[label] = (neurons, B.bias_under_conditions(bridge, data.tokenizer, data.biased, conds, data.genders, False))
    return out


def _hook_list(hooks, model) -> list[Hook]:
    try:
        hooks = [(name, f) for name, f in hooks]
    except (TypeError, ValueError):
        raise CheckFailed("zero_neuron_hooks should return a list of (hook name, function) pairs") from None
    for name, f in hooks:
        if name not in model.hook_dict:
            raise CheckFailed(
                f"zero_neuron_hooks: {name!r} is not a hook point of the model (layers are numbered "
                f"0..{model.cfg.n_layers - 1}; a neuron's activation is at blocks.<layer>.mlp.hook_post)"
            )
        if not callable(f):
            raise CheckFailed(f"zero_neuron_hooks: the hook at {name!r} is not a function")
    return hooks


def check_zero_neuron_hooks(fn: Callable) -> None:
    """``fn(neurons)`` (a list of (layer, neuron)): hooks that zero those neurons' activations
    (the coefficients m_k of Sec. 2) at every position; the bias with them active, as
    :func:`arithlib.yu.bias.bias_scores` of the stand-in prompts, against
    :func:`arithlib.yu.bias.bias_under_conditions` under :func:`arithlib.yu.bias.edit_conditions`
    (which zeroes with :func:`arithlib.methods.ablation.zero_neurons_hooks`, ``position=None``)
    for the sets of :func:`check_sets`."""
    data = bias_data()
    bridge, tok, G, biased = data.bridge, data.tokenizer, data.genders, data.biased
    saved = {name: p.detach().clone() for name, p in bridge.named_parameters()}
    original = B.bias_summary(data.scores[data.scores.kind == "original"], G)["total"]
    for label, (neurons, ref_all) in _edit_references().items():
        k = len(neurons)
        ref = ref_all[ref_all.kind == "cna"]
        hooks = _hook_list(fn(list(neurons)), bridge)
        changed = [n for n, p in bridge.named_parameters() if not torch.equal(p.detach(), saved[n])]
        if changed:
            with torch.no_grad():
                for n, p in bridge.named_parameters():
                    p.copy_(saved[n])
            raise CheckFailed(
                f"zero_neuron_hooks changed the model's parameters ({changed[0]}, restored now): return "
                "hooks that zero the activations during a forward pass and leave the weights alone"
            )
        try:
            mine = B.bias_scores(BP.gender_logprobs(bridge, tok, hooks, G), biased, G)
        except NotImplementedError:
            raise
        except Exception as e:  # noqa: BLE001 (a broken hook is the student's mistake: say so)
            raise CheckFailed(f"zero_neuron_hooks: running the model with your hooks failed: {e!r}") from e
        a, r = mine["diff"].to_numpy(), ref["diff"].to_numpy()
        if np.abs(a - r).max() <= TOL:
            continue
        total = B.bias_summary(mine, G)["total"]
        alternatives = {
            "your hooks change nothing: zero the activation in place or return the edited tensor": ref_all[
                ref_all.kind == "original"
            ]["diff"].to_numpy(),
            "you zero the last position only; arithlib zeroes every position (position=None), which is what "
            "setting the neurons' parameters to zero does": ref_all[ref_all.kind == "last position only"][
                "diff"
            ].to_numpy(),
            "you zero the neurons of another layer: neuron (l, k) is in blocks.l (0-based)": ref_all[
                ref_all.kind == "next layer"
            ]["diff"].to_numpy(),
        }
        why = next((f": {m}" for m, alt in alternatives.items() if np.abs(a - alt).max() <= TOL), "")
        fallback = (
            ": a neuron is a unit of the MLP's hidden layer, blocks.<layer>.mlp.hook_post[batch, pos, neuron] "
            "(d_mlp units), not a dimension of the residual stream or of the MLP's output"
        )
        raise CheckFailed(
            f"zero_neuron_hooks on the {label} ({k} neurons): bias {total:.4f} nats with your hooks, "
            f"{B.bias_summary(ref, G)['total']:.4f} with arithlib's (original {original:.4f}), per-pair "
            f"differences up to {np.abs(a - r).max():.3g}{why or fallback}"
        )
    passed(
        "zero_neuron_hooks matches arithlib.yu.bias.edit_conditions (bias_under_conditions) on "
        + " and ".join(check_sets())
    )


def arithmetic_side_effect(k: int = 18) -> pd.DataFrame:
    """The edit's side effect on arithmetic (notebook 07, section 4): exact-answer accuracy
    (:func:`arithlib.yu.bias.arithmetic_accuracy`) of Yu's 1-digit prompts ("n1 op n2 =",
    2-shot, :data:`ARITH_PER_OP` per operator) on the original model, with the CNA top-``k``
    zeroed and with each random layer-matched set of ``k`` zeroed (arithlib's hooks)."""
    data = bias_data()
    recs = ds.yu_prompts(n_digits=1, n_per_template=ARITH_PER_OP, templates=[3], fewshot=2, seed=0)
    arith = PromptSet.build(recs, data.tokenizer)
    conds = B.edit_conditions({k: data.edit_sets[k]}, {k: data.random_sets[k]})
    rows = [
        {"kind": kind, "K": kk, "seed": seed, "arith_accuracy": B.arithmetic_accuracy(data.bridge, arith, hooks)}
        for (kind, kk, seed), hooks in conds.items()
    ]
    out = pd.DataFrame(rows)
    out["n_prompts"] = len(arith)
    return out


# --------------------------------------------------------------------------- exercise 3: reduction vs random


def student_scores() -> pd.DataFrame:
    """:attr:`BiasData.scores` as the student gets them: the signed ``diff`` per (condition,
    prompt, profession), without the ``abs_diff`` and ``toward`` columns."""
    return bias_data().scores.drop(columns=["abs_diff", "toward"])


@lru_cache(maxsize=1)
def _reference_reductions() -> pd.DataFrame:
    return B.reduction_intervals(bias_data().scores, ("cna",)).set_index("K")


def _wrong_reductions(scores: pd.DataFrame, k: int) -> dict[str, dict[str, float]]:
    """What the usual mistakes give for each returned number, for the message of
    :func:`check_reduction_vs_random`."""
    s = scores.assign(a=scores["diff"].abs())
    orig, edit = s[s.kind == "original"], s[(s.kind == "cna") & (s.K == k)]
    rnd = s[(s.kind == "random") & (s.K == k)]
    o, e = orig.a.mean(), edit.a.mean()
    r = rnd.groupby("seed").a.mean()
    pairs = orig.set_index(["prompt_id", "token_id"]).a
    per_pair = edit.set_index(["prompt_id", "token_id"]).a.reindex(pairs.index)
    return {
        "reduction_pct": {
            "the signed difference d instead of |d| (professions of the two genders cancel)": 100
            * (1 - edit["diff"].mean() / orig["diff"].mean()),
            "relative to the edited model's bias instead of the original's": 100 * (o - e) / e,
            "the mean of each pair's reduction instead of the reduction of the mean": float(
                (100 * (1 - per_pair / pairs)).mean()
            ),
            "a fraction, not a percentage": 1 - e / o,
        },
        "random_pct": {
            "the signed difference d instead of |d| (professions of the two genders cancel)": float(
                (100 * (1 - rnd.groupby("seed")["diff"].mean() / orig["diff"].mean())).mean()
            ),
            "one seed only, not the mean over the seeds": 100 * (1 - r.iloc[0] / o),
            f"every random set of every size, not only K = {k}": 100 * (1 - s[s.kind == "random"].a.mean() / o),
            "relative to the edited model's bias instead of the original's": float((100 * (o - r) / r).mean()),
            "a fraction, not a percentage": float((1 - r / o).mean()),
        },
    }


def check_reduction_vs_random(fn: Callable) -> None:
    """``fn(scores, k)`` (``scores``: :func:`student_scores`, rows kind / K / seed / prompt_id /
    token_id / diff): a dict with ``reduction_pct`` = 100 (1 - mean |d| edited / mean |d|
    original) for the CNA top-``k``, ``random_pct`` the same for the random sets of size ``k``
    (mean over seeds) and ``diff_pts`` = reduction_pct - random_pct; against the estimates of
    :func:`arithlib.yu.bias.reduction_intervals` for every edit size."""
    ref = _reference_reductions()
    keys = ("reduction_pct", "random_pct", "diff_pts")
    for k in EDIT_KS:
        scores = student_scores()
        mine = fn(scores.copy(), k)
        if not isinstance(mine, dict) or any(key not in mine for key in keys):
            raise CheckFailed(f"reduction_vs_random should return a dict with the keys {list(keys)}")
        wrong = _wrong_reductions(scores, k)
        for key in keys:
            value, expected = float(mine[key]), float(ref.loc[k, key])
            if abs(value - expected) <= 1e-6:
                continue
            if key == "diff_pts" and abs(value + expected) <= 1e-6:
                why = ": the sign is reversed (CNA's reduction minus the random sets')"
            else:
                hits = [w for w, v in wrong.get(key, {}).items() if abs(float(v) - value) <= 1e-6]
                why = f": your value is {hits[0]}" if hits else ""
            raise CheckFailed(f"reduction_vs_random(K = {k})[{key!r}] is {value:.4f}, expected {expected:.4f}{why}")
    passed(
        "reduction_vs_random matches the estimates of arithlib.yu.bias.reduction_intervals for K = "
        + ", ".join(map(str, EDIT_KS))
    )
