"""Each finding in the report's words: what its figure shows (the caption under it in REPORT.md
and REPORT.html) and what its headline number is (the summary's "ours" cell).

One caption per figure a finding names (:attr:`arithlib.report.Finding.figures`), written for
any model (the numbers are in the text beside it, not here); a figure without a caption
reads as its notebook's figure (:func:`caption`), never as a file name. The headline is the
interval the verdict reads (:attr:`arithlib.report.Outcome.interval`), labelled and scaled
here; the verdict rules themselves are untouched.
"""

from __future__ import annotations

import math

#: Figure name (the PNG without ``.png``) -> what it shows.
CAPTIONS: dict[str, str] = {
    "01_path_patching": (
        "Path patching at the last token: the relative change of the answer's logit when one head's output "
        "(grid) or one MLP's (last column) is replaced by its counterfactual output, per layer, one panel per "
        "operator and one over all; a key head is a cell below -5 %."
    ),
    "01_knockout": (
        "Accuracy as heads are knocked out (mean-ablated), in order of path-patching effect (red) or in random "
        "order (grey: mean and range over random orders), against the number of heads knocked out."
    ),
    "01_transfer": (
        "Accuracy on other prompt formats before the knockout, after knocking out the 10 heads of largest "
        "path-patching effect, and after knocking out as many random heads (error bars: sd over the random sets)."
    ),
    "02_mlp_cosines": (
        "Per layer, the cosine of each MLP's write with the answer's unembedding (middle panel, solid green: "
        "the curve the verdict reads; dashed: the literal MLP_out - MLP_in, shown for comparison), with the "
        "operands' cosines (left) and the excess over other numbers (right); bands: 95 % intervals over prompts."
    ),
    "09_helix_patch": (
        "Share of the whole layer patch's effect restored when the residual stream at a's last token is "
        "replaced by the helix fit of a' (thick), by its projection on the top principal components or a random "
        "subspace of the helix's dimension, or by the helix without one period, per layer; bands: 95 % "
        "intervals over prompt pairs."
    ),
    "09_spectra": (
        "Share of the Fourier power over the numbers at each period (log scale): the single-token numbers' "
        "embedding, then the residual stream at a's last token entering each layer; dashed: the 95th "
        "percentile of the same share with the numbers shuffled."
    ),
    "08_sft_comparison": (
        "Precise SFT of the top heads beside full SFT: accuracy on held-out arithmetic and word problems "
        "(left), factual recall and language-model loss as general ability (middle), and the parameters each "
        "method tunes against its training speed (right)."
    ),
    "01_yu_head_sweep": (
        "Accuracy drop (points) when one head is zeroed at every position, per layer and head, one panel per "
        "operator and number of digits; this is the screening stage, the verdict reads the exact stage on "
        "every 1-digit prompt."
    ),
    "03_circuit_faithfulness": (
        "Faithfulness of the circuit (its heads plus the selected neurons of each analysed MLP) as heads are "
        "added, per operator on the selection prompts, and the held-out value the verdict reads with its 95 % "
        "interval (black); dashed line: the faithfulness target."
    ),
    "03_faithfulness_curve": ("Faithfulness against the share of neurons kept in each analysed MLP, per operator."),
    "03_heuristic_ablation": (
        "Accuracy after zeroing one heuristic's neurons, on the prompts that heuristic covers (blue) and on "
        "other prompts (orange), heuristic by heuristic, one panel per operator."
    ),
    "03_prompt_ablation": (
        "Accuracy per operator with no ablation, after zeroing each prompt's own heuristic neurons, and after "
        "zeroing as many random circuit neurons of the same layers."
    ),
    "04_mask_keep": (
        "Accuracy decrease against K when the top-K CNA neurons per case are zeroed (mask) or are the only "
        "neurons left in their layers (keep), beside random masks and keeps (top); the key head's effect on "
        "those neurons' coefficients (bottom); left: + and -, right: /."
    ),
    "04_hidden_m_sweep": (
        "Accuracy decrease after zeroing the shallow neurons with at least M number or operation concepts "
        "among their top projected tokens (purple), against as many random shallow neurons (grey), for each M; "
        "n: how many neurons qualify."
    ),
    "05_lora_accuracy_by_layer": (
        "Test accuracy of a model with LoRA in one attention layer, for each layer, on all test prompts and on "
        "those with negative results, against the original model (dotted lines); shading: the layer bands."
    ),
    "05_cna_coef_increase_by_band": (
        "How much LoRA raises the coefficients of the top CNA neurons over the original model, by the band of "
        "the layer carrying the LoRA (shallow, middle, deep) and by how many top neurons are compared."
    ),
    "06_table11": (
        "2-digit test accuracy after LoRA on the original, on the model keeping only the CNA neurons of the "
        "deep MLPs, and on randomly pruned ones, beside the paper's Table 11 (diamonds); also each model's "
        "parameters and forward-pass time."
    ),
    "07_table13": (
        "Gender bias of profession predictions (mean absolute log-probability gap between 'woman' and 'man' "
        "prompts) in the original model, after zeroing the top-18 CNA neurons, and after zeroing 18 random "
        "neurons (mean over seeds, error bars: sd), over all, female- and male-biased professions."
    ),
}


def caption(name: str) -> str:
    """The caption of figure ``name`` (its PNG without the suffix): :data:`CAPTIONS`, else
    a generic line naming its notebook."""
    return CAPTIONS.get(name, f"A figure of notebook {name[:2]}.")


#: Finding id -> (label of the interval its verdict reads, factor to the unit shown, unit, decimals).
HEADLINES: dict[str, tuple[str, float, str, int]] = {
    "zhang_key_heads": ("share of key heads", 100, " %", 1),
    "zhang_knockout": ("accuracy drop, effect-rank minus random", 100, " points", 0),
    "zhang_late_mlps": ("late / early MLP effect", 1, "x", 1),
    "zhang_mlp_answer": ("start of the answer climb, layer / n_layers", 1, "", 2),
    "zhang_transfer": ("drop on other formats, minus random heads'", 100, " points", 0),
    "zhang_precise_sft": ("precise minus full SFT accuracy", 100, " points", 1),
    "yu_single_head": ("1D accuracy decrease from one head", 100, " %", 0),
    "nikankin_faithfulness": ("held-out faithfulness", 1, "", 2),
    "nikankin_heuristic_ablation": ("accuracy, other minus covered prompts", 100, " points", 0),
    "nikankin_prompt_ablation": ("accuracy, random minus heuristic ablation", 100, " points", 0),
    "kantamneni_helix_patch": ("share of the layer patch restored by the helix", 100, " %", 0),
    "zhou_fourier_features": ("embedding power at periods 2-10", 100, " %", 0),
    "zhou_scratch_low_frequency": ("embedding power at periods 2-10", 100, " %", 0),
    "yu_mask_keep": ("accuracy decrease, top-K masked", 1, " %", 0),
    "yu_shallow_neurons": ("decrease, hidden minus random neurons", 1, " points", 0),
    "yu_lora_layers": ("LoRA layers beating the original", 100, " %", 0),
    "yu_lora_coef": ("mean coefficient increase", 1, " %", 1),
    "yu_pruning": ("accuracy, CNA- minus random-pruned", 100, " points", 1),
    "yu_gender_bias": ("bias reduction", 1, " %", 1),
}


def headline(finding_id: str, estimate: float, low: float, high: float, n: int) -> str:
    """ "share of key heads 0.0 % [0.0, 0.0], n = 128": the interval the verdict of
    ``finding_id`` reads, labelled (:data:`HEADLINES`); "" without an interval."""
    if not all(math.isfinite(x) for x in (low, high)):
        return ""
    label, factor, unit, digits = HEADLINES.get(finding_id, ("", 1, "", 3))

    def f(x: float) -> str:
        return f"{round(factor * x, digits) + 0.0:.{digits}f}" if math.isfinite(x) else "n/a"

    est = f"{f(estimate)}{unit} " if math.isfinite(estimate) else ""
    return f"{label} {est}[{f(low)}, {f(high)}], n = {int(n)}".strip()
