"""The findings the report judges: each paper claim with its number, source, rule and the
function that computes ours; judging a folder."""

from __future__ import annotations

import os
import sys

import pandas as pd

from ..core.papers import (
    FAITHFULNESS_TARGET,
    HALF,
    KANTAMNENI_TXT,
    KT_HELIX_SHARE,
    NIKANKIN_FAITHFULNESS,
    NIKANKIN_KNOCKOUT_CAP_SHARE,
    NIKANKIN_MATCH_T,
    NIKANKIN_NEURON_SHARE,
    NIKANKIN_TXT,
    PAPERS,
    YU_TXT,
    ZHANG_PRECISE_MARGIN,
    ZHANG_TXT,
    ZHOU_EXCESS,
    ZHOU_MIN_NUMBERS,
    ZHOU_TXT,
)
from ..core.stats import NOT_APPLICABLE
from .nikankin import _nikankin_faithfulness, _nikankin_heuristic_ablation, _nikankin_prompt_ablation
from .representations import _kantamneni_helix_patch, _zhou_fourier_features, _zhou_scratch
from .rules import Finding, Outcome, _interval_cell, settle_inconclusive
from .tables import ERROR, NOT_JUDGED, NOT_RUN, NotApplicable, NotRun, Tables
from .yu import _yu_mask_keep, _yu_shallow, _yu_single_head
from .yu_edits import _yu_gender, _yu_lora_coef, _yu_lora_layers, _yu_pruning
from .zhang import (
    _zhang_key_heads,
    _zhang_knockout,
    _zhang_late_mlps,
    _zhang_mlp_answer,
    _zhang_precise_sft,
    _zhang_transfer,
)

#: The label test both Nikankin ablations read (:mod:`arithlib.nikankin.heuristic_nulls`), in words.
_LABEL_NULL = (
    "per neuron a permutation test of its best match score against shuffled-operand grids, p-values "
    "max-T adjusted over the rules, Benjamini-Hochberg over the circuit's neurons at the FDR notebook 03 "
    "states (5 %)"
)

FINDINGS: tuple[Finding, ...] = (
    Finding(
        "zhang_key_heads",
        "zhang",
        "Abstract; Sec. 5.1 'Location of key heads', Fig. 2",
        "Fewer than 5 % of the attention heads carry arithmetic (path-patching effect below -5 %).",
        "< 5 % of heads (LLaMA2-7B; key heads in layers 12-17 of 32)",
        f"{ZHANG_TXT}: Abstract; Sec. 1; Sec. 5.1 'Location of key heads'",
        "key-head share = share of heads whose mean path-patching effect over the prompts is below -5 %, its "
        "95 % interval by a bootstrap over prompts (stratified by operator, 01_path_patching_per_prompt.csv.gz); "
        "reproduced if the interval lies in (0, 5 %]; partly if in (0, 10 %) and not within 5 %; not reproduced "
        "if above 10 % or if no resample has a key head; inconclusive if it straddles 0, 5 % or 10 %. Shown "
        "beside it, not judged: the share of the total |mean effect| carried by the top 5 % of heads, with its "
        "95 % bootstrap interval, against the same share with the head labels permuted within each prompt "
        "(1,000 seeded permutations: what the top heads would carry if no head were consistently more "
        "important than another), so the text says whether the effect is sparse where no head crosses -5 %",
        "01",
        _zhang_key_heads,
        figures=("01_path_patching",),
    ),
    Finding(
        "zhang_knockout",
        "zhang",
        "Sec. 1; Sec. 5.1 'Validation of key components', Fig. 3",
        "Knocking out heads in effect order breaks arithmetic; in random order it barely matters.",
        "about -70 % accuracy (effect-rank); random-rank within 2 %",
        f"{ZHANG_TXT}: Sec. 1 ('a decrease of around 70% in accuracy'); Sec. 5.1 ('within 2%')",
        "k = 10 heads (Table 4's top-10 knockout, -69 %; the same k as the transfer test), mean-ablated at every "
        "position of the query (per-position means over X_c; the few-shot prefix, which the paper's prompts lack, "
        "is left intact); gap = effect-rank relative accuracy drop minus the mean "
        "random-rank drop (random sets of 10 heads), 95 % interval by a bootstrap over prompts stratified by "
        "operator (01_knockout_per_prompt.csv.gz); reproduced if the interval is >= 34 points (half of 70 - 2); "
        "partly if within [5, 34); not reproduced if below 5; else inconclusive. Held out: notebook 01 ranks the "
        "heads by path patching on the same prompts it knocks them out on, so the prompts are split in two "
        "(seeded, stratified by operator); when the top 10 by mean path-patching effect on one half are the "
        "knockout's 10, only the other half is scored; otherwise all prompts are, and the text says the heads "
        "were selected on them. The text also says how many of the 10 are key heads (none where no head "
        "crosses -5 %)",
        "01",
        _zhang_knockout,
        figures=("01_knockout",),
    ),
    Finding(
        "zhang_late_mlps",
        "zhang",
        "Sec. 5.1 'Location of key MLPs', Fig. 2 (last column)",
        "MLPs before the key heads have no effect on the answer; MLPs from layer 17 of 32 on do.",
        "MLPs 0-16: about +-0.0 %; from layer 17: about +-10.0 % logit effect",
        f"{ZHANG_TXT}: Sec. 5.1 'Location of key MLPs'",
        "split at layer round(17/32 x L); ratio = late MLPs' mean |mean effect| / early MLPs', 95 % interval by a "
        "bootstrap over prompts (stratified by operator); reproduced if the ratio's interval is >= 2 and the late "
        "MLPs' mean |effect| interval >= 5 % (half of 10 %); partly if the ratio is within [1, 2), or >= 2 with "
        "late effects below 5 %; not reproduced if the ratio is below 1; else inconclusive",
        "01",
        _zhang_late_mlps,
        figures=("01_path_patching",),
    ),
    Finding(
        "zhang_mlp_answer",
        "zhang",
        "Sec. 5.2 'Key MLPs behavior', Fig. 6b, 14",
        "cos(MLP_out - MLP_in, W_U[C]) rises from layer 17 of 32 on: late MLPs write the answer.",
        "start-inflection-end (13-18-28) of 32 layers (LLaMA2-7B)",
        f"{ZHANG_TXT}: Sec. 5.2; App. C (Fig. 13, 14)",
        "the curve read is cos(MLP write, W_U[C]) with the MLP's write resid_post - resid_mid: Zhang Sec. 4.2 "
        "names MLP_in what the MLP receives from the residual stream and MLP_out what it adds back, and "
        "subtracts them 'to isolate the specific contribution of MLP' (the literal module output minus its "
        "normalised input is shown as a sensitivity reading, not judged). The paper's inflection of this curve "
        "is where its initial plateau turns into the climb (App. C, Fig. 14; Sec. 5.2 'starting from the 17th "
        "layer'): the start of the climb to the maximum by the rule of mlp_curves.curve_points, searched from "
        "layer 1 (layer 0's MLP reads the raw embedding; rule fixed in advance); 95 % intervals by one "
        "bootstrap over prompts (stratified by operator, 02_mlp_cosines_per_prompt.csv.gz) for whether the mean "
        "curve climbs at all and for depth = the climb's first layer / n_layers; not reproduced if the curve "
        "climbs in at most 2.5 % of the resamples; inconclusive if the bootstrap cannot settle whether it "
        "climbs; for a curve that climbs, reproduced if the depth's interval is >= 17/32, partly if within "
        "[13/32, 17/32) (13 is the paper's start), not reproduced if below 13/32, else inconclusive; not run "
        "for a run without the per-prompt write curve (rerun notebook 02)",
        "02",
        _zhang_mlp_answer,
        figures=("02_mlp_cosines",),
    ),
    Finding(
        "zhang_transfer",
        "zhang",
        "Sec. 5.1, Fig. 4; App. D, E",
        "Knocking out the key heads also breaks other formats (SVAMP, multi-digit, decimals...).",
        "SVAMP: -66.0 % relative (34.7 % -> 11.8 %)",
        f"{ZHANG_TXT}: Sec. 5.1 ('-22.9% / 34.7% = -66.0%')",
        "over the formats the model answers, gap = mean of (relative accuracy drop after knocking out the top-10 "
        "heads by path-patching effect, the k of the knockout finding, minus the drop after knocking out as many "
        "random heads), 95 % interval by a bootstrap over prompts stratified by format "
        "(01_transfer_per_prompt.csv.gz); reproduced if the interval is >= 33 points (half of 66 %); partly if "
        "within [5, 33); not reproduced if below 5; else inconclusive. The heads are selected on notebook 01's "
        "Zhang prompts and scored on other formats; the text says how many of the 10 are key heads (none where "
        "no head crosses -5 %)",
        "01",
        _zhang_transfer,
        figures=("01_transfer",),
    ),
    Finding(
        "zhang_precise_sft",
        "zhang",
        "Sec. 4.3 (Alg. 2), Sec. 5.3, Table 1",
        "Fine-tuning only the key heads improves arithmetic about as much as full SFT and keeps general ability.",
        "LLaMA2-7B: math +2.8 to +21.1 points (full SFT +2.8 to +23.2); general -5.5 for full SFT, +0.4 precise",
        f"{ZHANG_TXT}: Sec. 5.3, Table 1 ('matches or even surpasses'; full SFT 'about 5% drops')",
        "precise SFT of the top-32 heads by path-patching effect (scaled to the model's heads) and full SFT on the "
        "same data; on the arithmetic test prompts, precise SFT's gain (after - before) and precise minus full "
        "accuracy, and on the factual-recall prompts precise minus full accuracy, 95 % paired bootstrap intervals "
        f"(08_sft_comparison's per-prompt columns) over the prompts and, where the pair was trained with several "
        f"seeds, crossed with a resampling of the training seeds; reproduced if the gain lies > 0 and both differences lie >= "
        f"-{100 * ZHANG_PRECISE_MARGIN:.0f} points (Table 1's shortfalls of precise SFT reach 3.1 points, full "
        "SFT's general drop is 'about 5%'); partly if the gain lies > 0 and one difference does; not reproduced "
        "otherwise; inconclusive when the verdict depends on where in an interval the value is; not run "
        "when full SFT's arithmetic gain lies wholly below 0 (a full SFT that did not train is not Zhang's "
        "reference, whose gains were +2.8 to +23.2 points)",
        "08",
        _zhang_precise_sft,
        figures=("08_sft_comparison",),
    ),
    Finding(
        "yu_single_head",
        "yu",
        "Sec. 3.4, Table 2",
        "Zeroing one head destroys 1-digit +, -, / (not *).",
        "relative 1D accuracy decrease from the top head: + 46.5, - 62.2, / 54.9 (* 6.8) %",
        f"{YU_TXT}: Table 2",
        "the head of largest accuracy drop per operator, zeroed at every position on every 1D prompt (exact "
        "stage of the two-stage sweep); mean over +, -, / of its relative accuracy decrease (1 - after / before, "
        "as in the paper's table), 95 % interval by a bootstrap over prompts within each operator; and each such "
        "head's pattern (Table 1: 17^22 lowers 2D* by 10.8 % against 39.5 % on 2D+/2D-): specific if its "
        "relative 1D * decrease is at most half its decrease on its own operators (own - 2 x (*) >= 0, bootstrap "
        "over prompts) and its factual-recall accuracy drop lies within 5 points (our control); reproduced if "
        "the mean's interval lies above 27 % (half of the paper's mean 54.5 %) and every top head is specific, "
        "partly if the mean's interval lies >= 5 % (a generic head that also breaks * is 'partly'), not "
        "reproduced if below 5 %; every 1D operand pair is measured, so an interval that straddles a threshold "
        "is 'undecidable here'",
        "01",
        _yu_single_head,
        figures=("01_yu_head_sweep",),
    ),
    Finding(
        "nikankin_faithfulness",
        "nikankin",
        "Sec. 2-3, Fig. 4b",
        "A sparse circuit (a few heads, about 1 % of the neurons of each middle/late MLP) reproduces the "
        "model's arithmetic.",
        "about 96 % faithfulness; about 200 neurons per layer of Llama3-8B (about 1 %)",
        f"{NIKANKIN_TXT}: authors' answer ('roughly 96%, see lines 173 and 244'); Sec. 2-3 (circuit size)",
        "full circuit = the heads (per position) of largest activation-patching effect, as many as reach "
        f"faithfulness {FAITHFULNESS_TARGET} on the selection prompts, plus the neurons at the grid share nearest "
        f"{NIKANKIN_NEURON_SHARE:.0%} of each analysed MLP at '='; every other head and neuron mean-ablated at op1, "
        "operator, op2 and '='; F (Eq. 2, means over prompts first) per operator on held-out prompts, averaged "
        "over operators, 95 % bootstrap interval over prompts (stratified by operator); an operator whose "
        "denominator (full minus fully ablated normalised logit) has a 95 % interval reaching 0 (up to float32 "
        "noise, 1e-6) has no F (the "
        "ablated model answers as the full one) and is excluded, with its reason, not averaged; not applicable "
        "if every operator is; reproduced if the whole "
        f"interval >= {FAITHFULNESS_TARGET}; partly if it lies in [{HALF * NIKANKIN_FAITHFULNESS:.2f}, "
        f"{FAITHFULNESS_TARGET}) (half of the paper's 0.96); not reproduced if below "
        f"{HALF * NIKANKIN_FAITHFULNESS:.2f}; inconclusive if it straddles a threshold (undecidable here when "
        "more prompts than the grid's correct held-out ones would be needed)",
        "03",
        _nikankin_faithfulness,
        figures=("03_circuit_faithfulness", "03_faithfulness_curve"),
    ),
    Finding(
        "nikankin_heuristic_ablation",
        "nikankin",
        "Sec. 4.2, Fig. 7",
        "Ablating one heuristic's neurons hurts the prompts it covers more than other prompts.",
        "no number in the available text: associated prompts drop much more (baseline about 0.95)",
        f"{NIKANKIN_TXT}: authors' answers on Fig. 7",
        f"a neuron is associated with every heuristic it matches at t = {NIKANKIN_MATCH_T} whose label beats the "
        f"shuffled-operand null ({_LABEL_NULL}); not applicable if no label does; gap = mean over the ablated "
        "heuristics of (accuracy on other held-out prompts minus on associated ones), 95 % paired bootstrap "
        "interval over prompts (stratified by operator); reproduced if the whole interval >= 10 points; partly "
        "if it lies in [5, 10) points; not reproduced if below 5 points; inconclusive if it straddles 5 or 10 "
        "(undecidable here when more prompts than the grid's correct held-out ones would be needed); not run "
        "for tables without the label test (rerun notebook 03)",
        "03",
        _nikankin_heuristic_ablation,
        figures=("03_heuristic_ablation",),
    ),
    Finding(
        "nikankin_prompt_ablation",
        "nikankin",
        "Sec. 4.2, Fig. 8",
        "Ablating a prompt's heuristic neurons hurts it much more than ablating as many random neurons.",
        "no number in the available text: random neurons affect prompts 'much less'",
        f"{NIKANKIN_TXT}: authors' answer on Fig. 8",
        "per held-out prompt (the authors' prompt_knockout_experiment): its associated neurons (labels at "
        f"t = {NIKANKIN_MATCH_T} that beat the shuffled-operand null, {_LABEL_NULL}), per layer at most "
        f"cap = round({NIKANKIN_KNOCKOUT_CAP_SHARE:.3f} x circuit neurons per layer) of them (25 of 200, Sec. 5), "
        "ranked by how many of the prompt's heuristics they carry, zeroed at the answer position; control: in "
        "each layer as many neurons drawn at random from that layer's circuit neurons minus the zeroed ones "
        "(disjoint, layer-matched); a prompt whose layer has too few such neurons is not testable, counted, "
        "and left out (never filled from the tested set); gap = control minus heuristic accuracy on the "
        "testable prompts, 95 % paired bootstrap interval over prompts (stratified by operator); not applicable "
        "if no label beats the null or no prompt is testable; reproduced if the whole interval >= 10 points; "
        "partly if it lies in [5, 10) points; not reproduced if below 5 points; inconclusive if it straddles 5 "
        "or 10 (undecidable here when more prompts than the grid's correct held-out ones would be needed); not "
        "run for tables without the cap and the control (rerun notebook 03)",
        "03",
        _nikankin_prompt_ablation,
        figures=("03_prompt_ablation",),
    ),
    Finding(
        "kantamneni_helix_patch",
        "kantamneni",
        "helix fitting and its activation patching (authors' code)",
        "Replacing a number's activation by its helix fit restores most of what patching the whole layer restores, "
        "more than a PCA subspace of the same size.",
        "no number quoted here: the helix fit (periods 2, 5, 10, 100) beats a 9-dimensional PCA baseline and "
        "approaches the layer patch in the early layers (GPT-J, Pythia-6.9B, Llama-3.1-8B)",
        f"{KANTAMNENI_TXT}: abstract; the helix-fitting section and its patching figure",
        "prompts 'a+b=' (a, b in 0..99, the notebook's few-shot prefix), pairs (a, a', b) answered correctly "
        "in both forms with different first answer tokens; the residual stream entering a layer at a's last "
        "token replaced by the activation of 'a'+b=' (layer patch), by the helix fit of a' (PCA to 100 "
        "components, least squares on [a, cos, sin of 2 pi a / T for T = 2, 5, 10, 100], fitted on prompts with "
        "other values of b) or by the projection of that activation on its top 2P + 1 principal components; "
        "effect = the logit of a'+b's first token, patched minus clean; summed per pair over the first half of "
        "the layers; share = mean helix effect / mean layer effect, and (helix - PCA) / layer, 95 % bootstrap "
        f"intervals over pairs; reproduced if the share's interval lies >= {KT_HELIX_SHARE:.0%} and helix "
        "minus PCA > 0; partly if one of the two holds; not reproduced if neither; inconclusive when an "
        "interval straddles a threshold the verdict depends on, or when the layer patch's own mean effect has an "
        "interval reaching 0; not applicable when that interval lies at or below 0 (the layer patch does not "
        "move the answer)",
        "09",
        _kantamneni_helix_patch,
        figures=("09_helix_patch",),
    ),
    Finding(
        "zhou_fourier_features",
        "zhou",
        "Sec. 3-4 (Fourier features of number embeddings)",
        "A pre-trained model's number representations are sparse in the frequency domain, with periods 2, 2.5, "
        "5 and 10.",
        "no number quoted here: sparse spectra with peaks at periods 2, 2.5, 5, 10 (GPT-2-XL)",
        f"{ZHOU_TXT}: abstract; Sec. 3-4",
        "Fourier power of the embedding rows of the single-token numbers 0..N-1 along the number axis, each "
        "dimension centred; share of the non-DC power at the frequencies of periods 2, 2.5, 5, 10 (those N is a "
        "multiple of), 95 % bootstrap interval over embedding dimensions, against the mean share of the same "
        f"frequencies with the numbers shuffled (200 shuffles); reproduced if the interval lies >= {ZHOU_EXCESS:g} "
        "x the shuffled share, partly if it lies above the shuffled share, not reproduced if below it; not "
        "applicable to a model trained here (the toy model) or with fewer than "
        f"{ZHOU_MIN_NUMBERS} single-token numbers (per-digit tokenizers: 0..9)",
        "09",
        _zhou_fourier_features,
        figures=("09_spectra",),
    ),
    Finding(
        "zhou_scratch_low_frequency",
        "zhou",
        "Sec. 5 (models trained from scratch)",
        "A model trained from scratch on addition uses only low-frequency features.",
        "no number quoted here: from scratch, only low-frequency features and a lower accuracy",
        f"{ZHOU_TXT}: abstract; Sec. 5",
        "for a model trained here from unordered number embeddings (toy model with number_init = 'random'): "
        "the embedding's share of Fourier power at periods 2, 2.5, 5, 10 as in zhou_fourier_features; "
        f"reproduced if its interval lies below {ZHOU_EXCESS:g} x the shuffled share, not reproduced if at or "
        "above it; not applicable to pre-trained models and to the shipped toy model, whose number "
        "embeddings start as Fourier features (number_init = 'fourier')",
        "09",
        _zhou_scratch,
        figures=("09_spectra",),
    ),
    Finding(
        "yu_mask_keep",
        "yu",
        "Sec. 4.2, Table 5",
        "The top CNA neurons hold the answer: masking them breaks 1D +/-, keeping only them preserves it.",
        "top99: mask -100.0 %, keep -3.9 % accuracy (top10: 68.4 / 38.2)",
        f"{YU_TXT}: Table 5",
        "at K = 99 (else the largest K), on all correct 1D + and - cases: exact binomial (Clopper-Pearson) 95 % "
        "intervals of the mask and keep accuracy decreases (keep = zero every other neuron of the layers CNA "
        "scored, from the key head's layer up), the random mask's interval by a bootstrap over cases and its "
        "seeds (notebook 04's n_random_seeds draws); mask OK if the mask decrease's interval lies >= 50 % and "
        "its low end > 2x the random mask's high end (at least 1 %); keep OK if the keep decrease's interval "
        "lies <= 50 %; reproduced if both, partly if one; inconclusive when an interval straddles a threshold "
        "and the verdict depends on it (undecidable here: every correct 1D case is used); not applicable when "
        "the key head is a fallback (no head lowers 1D accuracy) or is not an arithmetic-specific head (the "
        "single-head finding's pattern: it cuts 1D * by more than half its own decrease, or factual recall by "
        "more than 5 points); where the key head is not the best arithmetic-specific head (the specific head "
        "with the largest own 1D decrease, notebook 04's 04_specific_heads), the same rule on that head's chain "
        "is shown beside the key head's result, not judged; not run for tables of an older notebook-04 method "
        "(rerun notebook 04)",
        "04",
        _yu_mask_keep,
        figures=("04_mask_keep",),
    ),
    Finding(
        "yu_shallow_neurons",
        "yu",
        "Sec. 4.4, Table 8",
        "Zeroing the hidden-interpretable shallow neurons (M = 2) hurts far more than random ones.",
        "M = 2: 1,953 neurons, -53.9 % accuracy vs -2.6 % for random",
        f"{YU_TXT}: Table 8 and the text below it",
        "shallow neurons (FFN layers below the key head) qualify at M = 2 when their value vector carried "
        "through the OV map of any attention layer that reads it (up to the key head's layer) has >= 2 number/"
        "operation concepts among its top-50 tokens; gap = hidden minus random accuracy decrease at M = 2 on all "
        "correct 1D + and - cases (on the 1D / cases with the division key head, Yu App. B Table 17, when the "
        "+ / - key head is in layer 0 and has no FFN layer below it), 95 % interval by a bootstrap over the "
        "cases and the random sets' seeds (per-case correctness in 04_hidden_m_sweep's correct_by_prompt); "
        "reproduced if the interval lies >= 25.7 points (half of 51.3); partly if it lies in [5, 25.7); not "
        "reproduced if below 5; else undecidable here (every correct 1D case is used); not applicable when the "
        "key head it builds on is a fallback or not arithmetic-specific (as for mask / keep); the chain on the "
        "best arithmetic-specific head is shown beside, not judged (as for mask / keep); not run for "
        "tables of an older notebook-04 method (rerun notebook 04)",
        "04",
        _yu_shallow,
        figures=("04_hidden_m_sweep",),
    ),
    Finding(
        "yu_lora_layers",
        "yu",
        "Sec. 5, Fig. 2",
        "LoRA in any single attention layer beats the original; shallow layers most.",
        "all 32 LoRA models > original 62.96 %; layers 1-9 about 90 %, falling from layer 10",
        f"{YU_TXT}: Sec. 5 (text under Fig. 2)",
        "premise: the original's 2-digit accuracy interval reaches 5 % (else not applicable); share of LoRA "
        "layers whose test accuracy beats the original's by >= 5 points (a margin stated in advance), 95 % "
        "interval by a bootstrap over the test prompts crossed with the layers (the unit of the claim; "
        "correct_by_prompt of 05_lora_accuracy_by_layer; one training per layer, so the interval excludes "
        "training variance); reproduced if the interval lies >= 0.9 (nearly every layer) and the shallow minus "
        "deep band accuracy's interval lies > 0; partly if the share's interval lies >= 0.5; inconclusive when "
        "the verdict depends on where in an interval the value is",
        "05",
        _yu_lora_layers,
        figures=("05_lora_accuracy_by_layer",),
    ),
    Finding(
        "yu_lora_coef",
        "yu",
        "Sec. 5, Table 10",
        "LoRA amplifies the answer neurons' coefficients, more for shallow LoRA layers.",
        "+42-59 % (layers 1-9), +29-53 % (10-16), +2-28 % (17-30)",
        f"{YU_TXT}: Table 10",
        "premise: the original's 2-digit accuracy interval reaches 5 % (else not applicable); intervals by a "
        "bootstrap over the CNA cases (05_cna_coef_per_case; one training per layer, so they exclude training "
        "variance): reproduced if the smallest band "
        "mean, shallow minus deep, lie > 0 and shallow >= 21 % (half of the paper's smallest shallow value, 42 %); "
        "partly if the mean over bands lies >= 5 %; inconclusive when an interval straddles a threshold the "
        "verdict depends on (or without the per-case table)",
        "05",
        _yu_lora_coef,
        figures=("05_cna_coef_increase_by_band",),
    ),
    Finding(
        "yu_pruning",
        "yu",
        "Sec. 6.1, Table 11",
        "LoRA on a model keeping only the CNA neurons of the deep FFN (5 %) works; on a random one it fails.",
        "original 62.9, LoRA9 89.3, LoRA9-p 82.3, LoRA9-r 17.1 %",
        f"{YU_TXT}: Table 11",
        "premise: the original's 2-digit accuracy interval reaches 5 % (else not applicable); gap = CNA-pruned "
        "minus random-pruned (mean over seeds) accuracy after LoRA, 95 % interval by a paired bootstrap over the "
        "test prompts and the random prunings (correct_by_prompt of 06_table11; one LoRA training per arm, so "
        "the interval excludes training variance); reproduced if the gap's interval lies "
        ">= 32.6 points (half of 65.2) and CNA-pruned minus original lies > 0; partly if the gap lies >= 5 "
        "points; inconclusive when the verdict depends on where in an interval the value is (or without "
        "per-prompt columns)",
        "06",
        _yu_pruning,
        figures=("06_table11",),
    ),
    Finding(
        "yu_gender_bias",
        "yu",
        "Sec. 6.2, Table 13",
        "Zeroing 18 CNA neurons reduces the gender bias of profession predictions.",
        "1.26 -> 0.81 nats (-35.7 %)",
        f"{YU_TXT}: Sec. 6.2, Table 13",
        "on the model's own biased professions (07_bias_scores, all 8 prompts): reduction of the mean bias by "
        "the top-18 CNA neurons (exact importance of every neuron where affordable) and reduction minus the "
        "layer-matched random sets' (mean over >= 10 seeds), 95 % intervals by a bootstrap over professions "
        "(each with its prompts, stratified by bias gender) crossed with the seeds; reproduced if the reduction "
        "lies >= 17.85 % (half of 35.7) and the difference lies >= 5 points; partly if the difference lies >= 5 "
        "points; not reproduced if it lies below; inconclusive when an interval straddles a threshold the "
        "verdict depends on. Shown, not judged: the same on Table 23's professions, the edit without the early "
        "layers (layer 0), the edit set's early neurons; runs of an older notebook-07 method are not run (rerun notebook 07)",
        "07",
        _yu_gender,
        figures=("07_table13",),
    ),
)


def smoke_test_reason(finding: Finding, tables: Tables) -> str | None:
    """Why ``finding`` was measured at smoke-test sizes in this folder, or None: its
    notebook ran with ``quick``, or it rests on fine-tuning at scale "quick" (notebook
    05's for notebooks 05 and 06, notebook 08's own; "quick" is what ``scale="auto"``
    gave on a CPU in runs that do not record scale_resolved), which shows the pipeline, not the paper's numbers."""
    params = tables.params()
    if params.get(finding.notebook, {}).get("quick"):
        return f"notebook {finding.notebook} ran in quick mode (smoke-test sizes)"
    tuned_by = {"05": "05", "06": "05", "08": "08"}.get(finding.notebook)
    if tuned_by is not None and "scale" in params.get(tuned_by, {}):
        from ..run.scales import FINETUNE_SCALES, resolve_scale

        p = params[tuned_by]
        # the scale the run used: recorded as scale_resolved; where it is not, "auto" meant "quick" on a CPU
        used = p.get("scale_resolved") or resolve_scale(
            str(p["scale"]), str(p.get("device", "cpu")), bool(p.get("quick")), auto_cpu="quick"
        )
        if used == "quick":
            return (
                f"fine-tuned at scale 'quick' (notebook {tuned_by}'s smoke-test sizes: "
                f"{FINETUNE_SCALES['quick']['n_train']} training prompts, a few layers; run scale='cpu', or 'paper' on a "
                "GPU, for a verdict)"
            )
    return None


def judge(finding: Finding, tables: Tables) -> Outcome:
    """Apply one finding to a folder; a missing table or a skipped study is 'not run', a
    failed premise 'not applicable', an exception in the computation is 'error' (also
    printed to stderr), and numbers measured at smoke-test sizes
    (:func:`smoke_test_reason`) are shown but 'not judged'. An inconclusive interval is
    told apart from an undecidable one (:func:`settle_inconclusive`)."""
    try:
        out = finding.compute(tables)
        reason = smoke_test_reason(finding, tables)
        if reason is not None:
            return Outcome(f"{reason}: {out.ours}", NOT_JUDGED, out.metrics, out.interval)
        return settle_inconclusive(out)
    except NotRun as err:
        return Outcome(str(err), NOT_RUN)
    except NotApplicable as err:
        return Outcome(str(err), NOT_APPLICABLE)
    except Exception as err:  # a malformed table must not stop the report: shown, not hidden
        print(f"arithlib.report: {finding.id}: {type(err).__name__}: {err}", file=sys.stderr)
        return Outcome(f"could not compute ({type(err).__name__}: {err})", ERROR)


def findings_table(fig_dir: str | os.PathLike) -> pd.DataFrame:
    """One row per finding: paper, where, claim, paper number, ours, verdict, rule, source,
    the headline number (``value``), the estimate, ends and size of the interval the verdict
    reads (``ci_estimate``, ``ci_low``, ``ci_high``, ``ci_n``) and all metrics (``metrics``, a dict)."""
    tables = Tables(fig_dir)
    rows = []
    for f in FINDINGS:
        out = judge(f, tables)
        value = next(iter(out.metrics.values()), float("nan"))
        ci = out.interval
        rows.append(
            {
                "id": f.id,
                "paper": PAPERS[f.paper],
                "where": f.where,
                "notebook": f.notebook,
                "claim": f.claim,
                "paper_number": f.paper_number,
                "ours": out.ours,
                "verdict": out.verdict,
                "rule": f.rule,
                "source": f.source,
                "value": value,
                "ci_estimate": ci.estimate if ci is not None else float("nan"),
                "ci_low": ci.low if ci is not None else float("nan"),
                "ci_high": ci.high if ci is not None else float("nan"),
                "ci_n": ci.n if ci is not None else 0,
                "interval": _interval_cell(ci),
                "metrics": dict(out.metrics),
            }
        )
    return pd.DataFrame(rows)
