"""The paper's setting beside ours, per finding: the fidelity table of REPORT.md.

Each finding of :data:`arithlib.report.FINDINGS` was measured by its paper in one
setting (model, prompts, positions intervened at, metric, scale) and by us in another.
:data:`PAPER` states the papers' settings in one declarative place (cited by section);
ours, read from the run's ``NN_*_params.json`` files, and the differences the small
offline models force are in :mod:`arithlib.report.fidelity_ours` (its ``OURS`` and
``FORCED``); :func:`fidelity_table` sets the three side by side. A value the params do not
hold (an older run, a renamed key) reads "not recorded"; nothing here raises on a folder.
"""

from __future__ import annotations

from collections.abc import Mapping

import pandas as pd

from .fidelity_ours import FORCED, OURS, Getter, Params

#: The aspects compared, in the table's order.
ASPECTS = ("model", "prompts", "positions", "metric", "scale")
NOT_RECORDED = "not recorded"

_ZHANG_MODEL = "LLaMA2-7B (32 layers x 32 heads; LLaMA2-13B too)"
_ZHANG_DATA = (
    "X_r: sentences of 36 templates (Equation, Statement, Question-Answer; App. A, Fig. 8, 10) with "
    "operands 1-9, of 10,000 generated only those the model answers (Sec. 3); X_c: the operator word or "
    "symbol replaced ('nothing', '@', ...); zero-shot"
)
_YU_MODEL = "Llama-7B (32 layers x 32 heads, 11,008 FFN neurons per layer; GPT-J in App. C)"
_YU_1D = "all 1D+ and 1D- cases the model answers (4 prompts per operator, Table 14), zero-shot"
#: How the authors' code reads a vector for CNA (get_bsvalues in their public CNA notebook).
_YU_CNA_READING = (
    "every vector read through the final RMSNorm with the original run's final-state variance at the "
    "answer position (the authors' code; the text does not say)"
)
_YU_2D = (
    "2-digit + - * / sentences of the 4 Table-14 prompts incl. negative results: 18,000 train / 2,000 test "
    "(Sec. 5), zero-shot"
)
_NIK_MODEL = "Llama3-8B (32 layers, 14,336 neurons per MLP; Llama3-70B, Pythia-6.9B, GPT-J too)"
_NIK_DATA = (
    "'{x}{op}{y}=' without spaces, + - * /, single-token operands up to 300, integer results in range; "
    "about 50 correct prompts per operator per seed, several seeds"
)

#: The papers' settings, by finding id (sections as in :mod:`arithlib.report`'s sources).
PAPER: dict[str, dict[str, str]] = {
    "zhang_key_heads": dict(
        model=_ZHANG_MODEL,
        prompts=_ZHANG_DATA,
        positions="path patching (Alg. 1, App. B): each head's output at the END token replaced by its X_c output, "
        "other heads frozen, MLPs recomputed",
        metric="(logit_p - logit_o) / logit_o of the answer token, mean over prompts; key head: below -5 %",
        scale="all 1,024 heads, 4 operators (Fig. 2, 12, 15)",
    ),
    "zhang_knockout": dict(
        model=_ZHANG_MODEL,
        prompts=_ZHANG_DATA,
        positions="mean ablation: each knocked-out head's activation replaced by its average over X_c (Sec. 4.1)",
        metric="accuracy vs k heads knocked out, effect order vs random order (Fig. 3)",
        scale="k up to all heads",
    ),
    "zhang_late_mlps": dict(
        model=_ZHANG_MODEL,
        prompts=_ZHANG_DATA,
        positions="path patching of each MLP at the END token (Fig. 2, last column)",
        metric="logit effect per MLP: layers 0-16 vs 17-31 of 32",
        scale="all 32 MLPs",
    ),
    "zhang_mlp_answer": dict(
        model=_ZHANG_MODEL,
        prompts="1,000 X_r samples (Sec. 5.2, Fig. 6)",
        positions="MLP input and output at the END token, every layer",
        metric="cos(MLP_out - MLP_in, W_U[C]) per layer: start-inflection-end 13-18-28 of 32; MLP_in is what the "
        "MLP receives from the residual stream, MLP_out what it adds back, subtracted 'to isolate the "
        "specific contribution of MLP' (Sec. 4.2)",
        scale="all 32 layers",
    ),
    "zhang_transfer": dict(
        model=_ZHANG_MODEL,
        prompts="SVAMP, multi-digit integers, rational numbers, dates (Sec. 5.1, Fig. 4; App. D, E)",
        positions="the key heads mean-ablated (knockout)",
        metric="accuracy before / after the knockout (SVAMP 34.7 % -> 11.8 %, -66 % relative)",
        scale="the full public sets (SVAMP: 1,000 problems)",
    ),
    "zhang_precise_sft": dict(
        model=_ZHANG_MODEL,
        prompts="training data of GSM8K, AddSub, SingleEq and SVAMP; tested on those four and on MMLU / CSQA (general)",
        positions="Q/K/V/O slices of the top-32 heads by path-patching effect, gradients x H/h per layer (Alg. 2); "
        "full SFT: every weight",
        metric="accuracy before / after on each benchmark (Table 1): math gains, MMLU / CSQA change",
        scale="lr 2e-5, batch 128, 2 epochs, warm-up 0.02, weight decay 0.1",
    ),
    "yu_single_head": dict(
        model=_YU_MODEL,
        prompts="4 prompts per operator (Table 14), numbers and number words; 1D, 2D, 3D sets "
        "(1,600 sentences for 2D), zero-shot",
        positions="one head zeroed (all its parameters), every position",
        metric="accuracy with the head zeroed; relative 1D decrease (Table 2, 24-27)",
        scale="all 1,024 heads (Sec. 3.3)",
    ),
    "yu_mask_keep": dict(
        model=_YU_MODEL,
        prompts=_YU_1D,
        positions="top-K CNA neurons (original vs head 17.22 zeroed) zeroed at the last position; keep: every other "
        "neuron of FFN layers 17-31 zeroed",
        metric="accuracy decrease (%) at K = 99, 50, 30, 20, 10 (Table 5)",
        scale="exact CNA importance of every FFN neuron, " + _YU_CNA_READING,
    ),
    "yu_shallow_neurons": dict(
        model=_YU_MODEL,
        prompts=_YU_1D,
        positions="FFN neurons of layers 0-15 projected through the OV matrices of attention layers 0-16; those with "
        ">= M number/operation concepts among the top-50 tokens zeroed",
        metric="accuracy decrease (%) vs as many random shallow neurons (Table 8: M = 2, 1,953 of 176,128 neurons)",
        scale="every shallow neuron",
    ),
    "yu_lora_layers": dict(
        model=_YU_MODEL,
        prompts=_YU_2D,
        positions="LoRA in one attention layer, one model per layer",
        metric="test accuracy of each LoRA model vs the original (Fig. 2)",
        scale="32 models; lr from {1e-3, 5e-4, 1e-4}, up to 4 epochs",
    ),
    "yu_lora_coef": dict(
        model=_YU_MODEL,
        prompts="1D cases (CNA between each LoRA model and the original)",
        positions="top CNA neurons of the deep FFN layers, last position",
        metric="coefficient increase (%) of the top-k neurons by LoRA layer band (Table 10)",
        scale="the 32 LoRA models of Fig. 2; CNA " + _YU_CNA_READING,
    ),
    "yu_pruning": dict(
        model=_YU_MODEL,
        prompts="CNA on all 1D + - * / cases (top-500 per case); LoRA data as Sec. 5 (18,000 / 2,000)",
        positions="the union of the cases' top-500 kept in FFN layers 17-31 (5 %), the rest pruned; LoRA on layer 9",
        metric="2D test accuracy after LoRA: CNA-pruned vs randomly pruned (Table 11)",
        scale="one random pruning reported; CNA " + _YU_CNA_READING,
    ),
    "yu_gender_bias": dict(
        model=_YU_MODEL,
        prompts="8 prompts x {man, woman} (App. D, Table 22; Sec. 6.2 says four); 32 professions from "
        "the top-100 predictions (Table 23); CNA on the first prompt",
        positions="top-18 CNA neurons zeroed (parameters set to zero)",
        metric="mean |log p(prof | woman) - log p(prof | man)| over prompts and professions (Table 13: 1.26 -> 0.81)",
        scale="18 neurons; no random control reported; CNA " + _YU_CNA_READING,
    ),
    "nikankin_faithfulness": dict(
        model=_NIK_MODEL,
        prompts=_NIK_DATA,
        positions="activation patching per component and position (op1, op, op2, '='), then neurons of the "
        "middle/late MLPs at the last position; everything outside the circuit mean-ablated",
        metric="faithfulness: correct-token logit / max logit, 0 = fully mean-ablated, 1 = full model (about 96 %)",
        scale="about 200 neurons per layer (about 1 %)",
    ),
    "nikankin_heuristic_ablation": dict(
        model=_NIK_MODEL,
        prompts=_NIK_DATA + "; the operand grid (operands 0-299, one token each) for the heuristics",
        positions="the neurons of one heuristic (match score >= 0.6; the authors' code: >= 0.55) zeroed",
        metric="accuracy on the heuristic's associated prompts vs other prompts (Fig. 7)",
        scale="circuit neurons of the middle/late MLPs",
    ),
    "nikankin_prompt_ablation": dict(
        model=_NIK_MODEL,
        prompts=_NIK_DATA,
        positions="per layer at most a cap of the prompt's associated heuristic neurons (ranked by how many of its "
        "heuristics they carry), zeroed at every position; control: per layer as many drawn from that "
        "layer's circuit neurons minus the zeroed ones (heuristics_analysis.prompt_knockout_experiment)",
        metric="accuracy after each knockout against the cap (Fig. 8; no test, labels at t alone)",
        scale="caps 0-100 of 200 circuit neurons per layer in steps of 5 (the authors' script; Fig. 8 shows 0-80)",
    ),
    "kantamneni_helix_patch": dict(
        model="GPT-J, Pythia-6.9B, Llama-3.1-8B (one token per number 0..99)",
        prompts="a+b with a, b in 0..99, a short instruction before it, correct prompts only; pairs (a, a') with the same b",
        positions="the layer's input (residual stream) at a's token, replaced by the helix fit of a', its top-k PCA "
        "projection or the real activation of a'+b",
        metric="logit difference of the answer a'+b, patched minus clean, per layer (helix vs PCA vs layer patch)",
        scale="every layer, 100 pairs per layer; helix fitted in 100 principal components",
    ),
    "zhou_fourier_features": dict(
        model="GPT-2-XL fine-tuned on addition (one token per number up to about 520)",
        prompts="the number tokens' embeddings and module outputs mapped to number-token logits",
        positions="the embedding matrix; MLP and attention outputs at the last token",
        metric="Fourier spectrum over the numbers; peaks at periods 2, 2.5, 5, 10 and low frequencies",
        scale="every number token",
    ),
    "zhou_scratch_low_frequency": dict(
        model="GPT-2-XL's architecture trained from scratch on addition (random number embeddings)",
        prompts="the number tokens' embeddings",
        positions="the embedding matrix",
        metric="Fourier spectrum over the numbers: low frequencies only",
        scale="every number token",
    ),
}


def _safe(get: Getter | None, P: Params, missing: str = NOT_RECORDED) -> str:
    """``get(P)``, or ``missing`` when the params lack what it reads."""
    if get is None:
        return ""
    try:
        return str(get(P))
    except (KeyError, TypeError, ValueError, IndexError):
        return missing


def fidelity_table(params: Params, notebooks: Mapping[str, str] | None = None) -> pd.DataFrame:
    """One row per finding and aspect: finding, aspect, paper (:data:`PAPER`), ours
    (:data:`OURS` of ``params``; "not recorded" when the params lack it) and "forced by
    the offline model" (:data:`FORCED`; "" where nothing is forced). ``notebooks``:
    finding id -> its notebook (``report.FINDINGS``), in that order; a finding whose
    notebook has no params reads "not recorded" throughout; default: every finding of
    :data:`PAPER`, unchecked."""
    rows = []
    for fid in notebooks if notebooks is not None else list(PAPER):
        paper, ours, forced = PAPER.get(fid, {}), OURS.get(fid, {}), FORCED.get(fid, {})
        ran = notebooks is None or notebooks[fid] in params
        for aspect in ASPECTS:
            rows.append(
                {
                    "finding": fid,
                    "aspect": aspect,
                    "paper": paper.get(aspect, NOT_RECORDED),
                    "ours": _safe(ours.get(aspect), params) if ran else NOT_RECORDED,
                    "forced by the offline model": _safe(forced.get(aspect), params, missing=""),
                }
            )
    return pd.DataFrame(rows, columns=["finding", "aspect", "paper", "ours", "forced by the offline model"])
