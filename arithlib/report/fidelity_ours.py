"""Our side of the fidelity table (:mod:`arithlib.report.fidelity`): for each finding, our
setting read from the run's ``NN_*_params.json`` files, and the differences the small
offline models force.

:data:`OURS` gives our model, prompts, positions, metric and scale as small functions of
the params (parameters, ``quick``, model and ``model_info``, notebook 05's and 08's
fine-tuning scale); :data:`FORCED` names what the offline models force (per-digit
tokenizer, a few-shot prefix for instruct models, fewer layers so layer indices are scaled
by depth, fine-tuning at the CPU scale). A getter raises KeyError (or TypeError,
ValueError, IndexError) when the params lack what it reads; the table then says "not
recorded".

Only the fine-tuning scale reads :mod:`arithlib.run.scales` (its ``FINETUNE_SCALES``),
lazily.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

Params = Mapping[str, dict]  # notebook number ("01") -> its params JSON


def _nb(P: Params, nb: str) -> dict:
    """Notebook ``nb``'s params (KeyError when it did not run: "not recorded")."""
    return P[nb]


def _model(P: Params, nb: str) -> str:
    p = _nb(P, nb)
    i = p["model_info"]
    src = f", {i['source']}" if i.get("source") else ""
    return (
        f"{p['model']} ({i['n_layers']} layers x {i['n_heads']} heads, d_mlp {i['d_mlp']}{src}), "
        f"{str(p.get('dtype', '?')).replace('torch.', '')} on {p.get('device', '?')}"
    )


def _layers(P: Params, nb: str) -> int:
    return int(_nb(P, nb)["model_info"]["n_layers"])


def _depth(layer_of_32: float, L: int) -> int:
    """Layer ``layer_of_32`` of the papers' 32 scaled to ``L`` (as ``report._paper_depth``)."""
    return int(math.floor(layer_of_32 / 32 * L + 0.5))


def _quick(P: Params, nb: str) -> str:
    return "QUICK mode (smoke-test sizes)" if _nb(P, nb).get("quick") else "full run"


def _fewshot(P: Params, nb: str) -> str:
    return f"{_nb(P, nb)['fewshot']}-shot prefix"


def _ft_scale(P: Params, nb: str = "05") -> dict:
    """Notebook ``nb``'s resolved fine-tuning scale and its sizes (``scales.FINETUNE_SCALES``):
    05's (which 06 reuses) or 08's."""
    from ..run.scales import FINETUNE_SCALES, resolve_scale

    p = _nb(P, nb)  # the scale the run recorded; in older runs "auto" was "quick" on a CPU
    name = p.get("scale_resolved") or resolve_scale(
        str(p["scale"]), str(p.get("device", "cpu")), bool(p.get("quick")), auto_cpu="quick"
    )
    return dict(FINETUNE_SCALES[name], scale=name)


def _ft_text(P: Params) -> str:
    s = _ft_scale(P)
    return (
        f"scale '{s['scale']}' (params scale={_nb(P, '05')['scale']!r}): {s['n_train']} train / {s['n_test']} "
        f"test sentences, {s['lora_epochs']} epoch(s), lr search {s['lr_search']}, layers {_LAYERS.get(s['layers'], s['layers'])}"
    )


#: How a scale's ``layers`` setting reads in the fidelity table ("all" keeps its old wording).
_LAYERS = {"bands": "bands (layer 0, Yu's reference layer and the centre of each other band: 4-5 models, not 32)"}


def _sft_lr_text(P: Params) -> str:
    """Notebook 08's SFT learning rate(s): the grid its params recorded (else its scale's),
    chosen per method on the validation split when it has more than one."""
    lrs = _nb(P, "08").get("sft_lrs") or _ft_scale(P, "08")["sft_lrs"]
    if len(lrs) == 1:
        return f"lr {lrs[0]:g}"
    return (
        "lr from {" + ", ".join(f"{lr:g}" for lr in lrs) + "} per method on the validation split (Zhang: one lr, "
        "2e-5, for both)"
    )


def _zhang_prompts(P: Params) -> str:
    p = _nb(P, "01")
    return (
        f"{p['zhang_per_op']} correct prompts per operator ({' '.join(p['ops'])}), {p['zhang_per_template']} "
        f"candidates per template of 8 Zhang templates, operands 1-9; {_fewshot(P, '01')}; X_c as the paper's"
    )


def _yu_1d(P: Params, nb: str) -> str:
    return f"the correct 1D + / - cases of Yu's symbolic prompts ('n1 + n2 ='); {_fewshot(P, nb)}"


_YU_KEY_HEAD = (
    "key head of each operator group from notebook 01's exact every-position sweep: largest mean 1D "
    "accuracy drop over the group's operators (ties: logit drop, then layer and head); if no head lowers "
    "1D accuracy, stated, and the largest mean drop over 1-3 digits (cna.select_key_heads)"
)


def _yu_key_head(P) -> str:
    """:data:`_YU_KEY_HEAD` for a notebook-04 run of the current method (it records
    ``n_random_seeds``); a KeyError (shown as 'not recorded') for an older run."""
    _nb(P, "04")["n_random_seeds"]
    return _YU_KEY_HEAD


def _cna_reading(P: Params, nb: str) -> str:
    """How notebook ``nb``'s CNA read its vectors through the final norm (its ``norm_reading``
    parameter; a run that does not record one read each vector by its own RMS)."""
    reading = _nb(P, nb).get("norm_reading", "own")
    return (
        "CNA read with the original run's final scale (the authors' reading)"
        if reading == "final"
        else "CNA read with each vector's own RMS (not the authors' reading: rerun for it)"
    )


def _nik_grid(P: Params) -> str:
    """Notebook 03's operand grids (recorded by runs that have them), e.g. "operand grid + 0-99
    (2,000 of 10,000 pairs, seeded subsample), ..."."""
    p = _nb(P, "03")
    if "operand_ranges" not in p:
        return "operand grid not recorded (an older run)"
    ranges, n, full = p["operand_ranges"], p["grid_prompts"], p["grid_full"]
    parts = [
        f"{op} {lo}-{hi}"
        + (
            f" ({n[op]:,} of {full[op]:,} pairs, seeded subsample)"
            if n[op] < full[op]
            else f" (all {full[op]:,} pairs)"
        )
        for op, (lo, hi) in ranges.items()
    ]
    return "operand grid " + ", ".join(parts)


def _label_null(P: Params) -> str:
    """Notebook 03's label test, in words."""
    p = _nb(P, "03")
    b = p["n_permutations"]
    return (
        f"beating shuffled-operand grids (permutation test, "
        f"{'max(1000, neurons / FDR)' if b is None else b} shuffles, BH at FDR {p['label_fdr']:.0%})"
    )


def _nik03_prompts(P: Params) -> str:
    """Notebook 03's prompts: its operand grid where the run records one, else as before."""
    p = _nb(P, "03")
    if "operand_ranges" not in p:
        return f"{_nik_prompts(P, 'n_analysis', '03')}; {_nik_grid(P)}"
    return (
        f"'{{x}}{{op}}{{y}}=' prompts of the {_nik_grid(P)}; {p['n_analysis']} correct per operator select the "
        f"circuit, other correct ones score it; {_fewshot(P, '03')}"
    )


def _nik_prompts(P: Params, per_op_key: str, nb: str) -> str:
    p = _nb(P, nb)
    cap = (
        f", operands 0-{p['nikankin_max_operand']} capped at single tokens"
        if "nikankin_max_operand" in p
        else ", single-token operands"
    )
    return f"'{{x}}{{op}}{{y}}=' prompts, {p[per_op_key]} correct per operator{cap}; {_fewshot(P, nb)}"


Getter = Callable[[Params], str]


def _gender_scoring(P: Params) -> str:
    """Notebook 07's CNA scoring: the exact importance of every neuron or the two-stage
    screen, as its ``exact_importance`` resolved (``bias_cna.exact_affordable`` from the model's
    sizes; quick mode: a 20x smaller budget)."""
    from ..yu.bias_cna import MAX_EXACT_MACS

    p = _nb(P, "07")
    how = p["exact_importance"]
    if how == "auto":
        i = p["model_info"]
        budget = MAX_EXACT_MACS / (20 if p.get("quick") else 1)
        how = p.get("device") == "cuda" or i["n_layers"] * i["d_mlp"] * i["d_model"] * i["d_vocab"] <= budget
    if how:
        return "candidate scoring: exact importance of every neuron (the screen's recall measured against it)"
    from ..yu.bias_cna import RECALL_LAYER_STRIDE

    return (
        f"candidate scoring: two-stage screen, exact for {p['n_candidates']} per profession + pooled "
        f"{p['n_aggregate']} (its recall measured on every neuron of every {RECALL_LAYER_STRIDE}th layer)"
    )


#: Our settings, by finding id: aspect -> a function of the run's params (KeyError,
#: TypeError or ValueError there means "not recorded").
OURS: dict[str, dict[str, Getter]] = {
    "zhang_key_heads": dict(
        model=lambda P: _model(P, "01"),
        prompts=_zhang_prompts,
        positions=lambda P: "path patching at the last (END) position, other heads frozen, MLPs recomputed",
        metric=lambda P: f"relative answer-logit effect, key head below {_nb(P, '01')['key_threshold']:+.0%}",
        scale=lambda P: f"every head; {_quick(P, '01')}",
    ),
    "zhang_knockout": dict(
        model=lambda P: _model(P, "01"),
        prompts=_zhang_prompts,
        positions=lambda P: (
            f"verdict at k = {_nb(P, '01')['knockout_k']}: each head mean-ablated at every query "
            "position (its X_c mean per position; the few-shot prefix intact); the curve over k at "
            "the last position only, its agreement with the verdict's knockout in "
            "01_knockout_screen.csv"
        ),
        metric=lambda P: f"accuracy vs k, effect order vs {_nb(P, '01')['n_random_orders']} random orders",
        scale=lambda P: f"k in {_nb(P, '01')['knockout_ks']}; {_quick(P, '01')}",
    ),
    "zhang_late_mlps": dict(
        model=lambda P: _model(P, "01"),
        prompts=_zhang_prompts,
        positions=lambda P: (
            f"path patching of each MLP at the last position; split at layer "
            f"{_depth(17, _layers(P, '01'))} of {_layers(P, '01')}"
        ),
        metric=lambda P: "mean |logit effect| of the late vs the early MLPs",
        scale=lambda P: f"every MLP; {_quick(P, '01')}",
    ),
    "zhang_mlp_answer": dict(
        model=lambda P: _model(P, "02"),
        prompts=lambda P: (
            f"{_nb(P, '02')['n_per_template']} prompts per template and operator (8 templates x 4 "
            f"operators), correct only; {_fewshot(P, '02')}"
        ),
        positions=lambda P: (
            f"the residual stream before and after each MLP (blocks.L.hook_resid_mid, "
            f"blocks.L.hook_resid_post) and MLP in / out ({_nb(P, '02')['mlp_in_hook']}, "
            f"{_nb(P, '02')['mlp_out_hook']}) at the last position, every layer"
        ),
        metric=lambda P: (
            "the verdict reads cos(MLP write, W_U[C]) with the write resid_post - resid_mid, because "
            "the paper subtracts 'to isolate the specific contribution of MLP' (Sec. 4.2), which is what "
            "the MLP writes; the literal MLP module output minus its normalised input (ln2 with its "
            "weight) is a sensitivity reading, not judged; the climb must be settled and begin at "
            "depth >= 17/32"
        ),
        scale=lambda P: f"every layer; {_quick(P, '02')}",
    ),
    "zhang_transfer": dict(
        model=lambda P: _model(P, "01"),
        prompts=lambda P: (
            f"{_nb(P, '01')['transfer_n']} prompts per format (multi-digit, decimals, dates, word "
            f"problems, exponentiation); {_fewshot(P, '01')}"
        ),
        positions=lambda P: "key heads (or the 10 of largest effect) mean-ablated vs as many random heads",
        metric=lambda P: "relative accuracy drop minus the random heads' drop",
        scale=lambda P: f"our generated formats, not SVAMP itself; {_quick(P, '01')}",
    ),
    "yu_single_head": dict(
        model=lambda P: _model(P, "01"),
        prompts=lambda P: (
            f"every 1D operand pair of + - * / and {_nb(P, '01')['yu_multi_per_setting']} prompts per "
            f"2D and 3D setting (Yu template 4, symbolic); {_fewshot(P, '01')}"
        ),
        positions=lambda P: (
            f"one head's W_O slice zeroed at every position; stage 1 screens every head on "
            f"{_nb(P, '01')['yu_screen_n']} prompts per setting, stage 2 zeroes the top "
            f"{_nb(P, '01')['yu_top_k']} of each setting on all its prompts (only stage 2 is judged; "
            f"the screen's recall measured against every head on "
            f"{_nb(P, '01')['yu_recall_setting']!r})"
        ),
        metric=lambda P: "largest relative 1D accuracy decrease from one head",
        scale=lambda P: f"every head; {_quick(P, '01')}",
    ),
    "yu_mask_keep": dict(
        model=lambda P: _model(P, "04") + "; " + _yu_key_head(P),
        prompts=lambda P: _yu_1d(P, "04"),
        positions=lambda P: (
            _yu_key_head(P)
            and "top-K CNA neurons (original vs the key head zeroed at every "
            "position) zeroed at the last "
            "position; keep: every other neuron of the layers CNA scored (the key head's layer to "
            "the last) zeroed"
        ),
        metric=lambda P: (
            f"accuracy decrease at K in {_nb(P, '04')['top_ks']} (exact binomial intervals); random mask "
            f"and random keep over {_nb(P, '04')['n_random_seeds']} seeds"
        ),
        scale=lambda P: (
            f"importance mode {_nb(P, '04')['mode']!r} ({_nb(P, '04')['n_candidates']} exact candidates "
            f"per case in two-stage mode); {_cna_reading(P, '04')}; {_quick(P, '04')}"
        ),
    ),
    "yu_shallow_neurons": dict(
        model=lambda P: _model(P, "04") + "; " + _yu_key_head(P),
        prompts=lambda P: (
            _yu_1d(P, "04") + "; the correct 1D / cases with the division key head (Yu App. B, "
            "Table 17) when the + / - key head is in layer 0 (no FFN layer below it)"
        ),
        positions=lambda P: (
            _yu_key_head(P)
            and "each FFN neuron of layer l below the key head's layer H carried "
            "through the OV (all "
            "heads, ln1 weight folded) of every attention layer l < j <= H; qualifies when any "
            f"projection has >= M number/operation concepts (digits, English number words, "
            f"operators) among its top-{_nb(P, '04')['concept_top']} tokens; zeroed at every position"
        ),
        metric=lambda P: (
            f"accuracy decrease vs {_nb(P, '04')['n_random_seeds']} random sets of as many shallow "
            f"neurons, M in {_nb(P, '04')['ms']}; set size and share beside Table 8's"
        ),
        scale=lambda P: f"every shallow neuron; {_quick(P, '04')}",
    ),
    "yu_lora_layers": dict(
        model=lambda P: _model(P, "05"),
        prompts=lambda P: (
            f"2-digit {' '.join(_nb(P, '05')['ops'])} sentences incl. negative results; {_fewshot(P, '05')}"
        ),
        positions=lambda P: (
            f"LoRA (r = {_nb(P, '05')['lora_r']}, alpha = {_nb(P, '05')['lora_alpha']}) in one "
            "attention layer per model"
        ),
        metric=lambda P: "whole-answer test accuracy of each LoRA model vs the original",
        scale=_ft_text,
    ),
    "yu_lora_coef": dict(
        model=lambda P: _model(P, "05"),
        prompts=lambda P: f"{_ft_scale(P)['cna_cases']} 1D + / - cases; {_fewshot(P, '05')}",
        positions=lambda P: (
            f"top CNA neurons of FFN layers {_depth(17, _layers(P, '05'))}-{_layers(P, '05') - 1}, last position"
        ),
        metric=lambda P: f"coefficient increase (%) of the top-k (k in {_nb(P, '05')['top_ks']}) by band",
        scale=lambda P: f"{_ft_text(P)}; {_cna_reading(P, '05')}",
    ),
    "yu_pruning": dict(
        model=lambda P: _model(P, "06"),
        prompts=lambda P: (
            f"CNA on 1D + - * / cases ({_nb(P, '06')['cases_per_op']} per operator); LoRA data as notebook 05"
        ),
        positions=lambda P: (
            f"{_nb(P, '06')['main_share']:.0%} of the deep FFN neurons (layers "
            f"{_depth(17, _layers(P, '06'))}-{_layers(P, '06') - 1}) kept; LoRA on layer "
            f"{_depth(9, _layers(P, '06'))}"
        ),
        metric=lambda P: "test accuracy after LoRA: CNA-pruned vs randomly pruned (mean over seeds)",
        scale=lambda P: f"{_ft_text(P)}; random prunings {_nb(P, '06')['random_seeds']!r}; {_cna_reading(P, '06')}",
    ),
    "zhang_precise_sft": dict(
        model=lambda P: _model(P, "08"),
        prompts=lambda P: (
            f"notebook 05's 2-digit training split ({_ft_scale(P, '08')['n_train']}) plus "
            f"{_ft_scale(P, '08')['word_train']} of Zhang's word problems; tested on the 2-digit test "
            f"split ({_ft_scale(P, '08')['n_test']}); general ability: factual recall "
            "(data/factual_recall.json) and LM loss on pydoc prose; "
            f"{_fewshot(P, '08')}"
        ),
        positions=lambda P: (
            "Q/K/V/O slices of the top-32 heads (scaled to the model's heads) by notebook 01's "
            f"path-patching effect (kv={_nb(P, '08')['kv']!r} under GQA), gradients x H/h; full SFT"
        ),
        metric=lambda P: "whole-answer accuracy gain on the test split; factual-recall accuracy precise minus full",
        scale=lambda P: (
            f"{_sft_lr_text(P)}, batch {_ft_scale(P, '08')['sft_batch']}, "
            f"{_ft_scale(P, '08')['sft_epochs']} epoch(s); scale '{_ft_scale(P, '08')['scale']}' "
            f"(params scale={_nb(P, '08')['scale']!r})"
        ),
    ),
    "yu_gender_bias": dict(
        model=lambda P: _model(P, "07"),
        prompts=lambda P: (
            f"the 8 Table-22 prompts x {{man, woman}}; professions from the top-{_nb(P, '07')['top_k']} "
            f"predictions (the bias also on Table 23's 32, each by the first token of ' ' + profession "
            f"when it is the first word or a >= 5-letter prefix, the rest listed); CNA on prompt "
            f"{_nb(P, '07')['cna_prompt']}"
        ),
        positions=lambda P: (
            f"top-{_nb(P, '07')['edit_k']} CNA neurons zeroed (and {_nb(P, '07')['n_random_seeds']} random sets)"
        ),
        metric=lambda P: (
            "mean |log p(prof | woman) - log p(prof | man)|, reduction vs the original; 95 % intervals "
            "by a bootstrap over professions crossed with the random seeds"
        ),
        scale=lambda P: (
            f"edit sizes {list(_nb(P, '07')['sweep'])}; {_gender_scoring(P)}; "
            f"{_nb(P, '07')['n_random_seeds']} layer-matched random sets per size; also the top-"
            f"{_nb(P, '07')['edit_k']} from layers >= {_nb(P, '07')['early_layers']} and the edit set "
            f"less its early neurons; {_cna_reading(P, '07')}; {_quick(P, '07')}"
        ),
    ),
    "nikankin_faithfulness": dict(
        model=lambda P: _model(P, "03"),
        prompts=lambda P: _nik03_prompts(P),
        positions=lambda P: (
            "neurons of the analysed late MLPs at the last position; only those MLPs' other neurons mean-ablated"
        ),
        metric=lambda P: (
            f"faithfulness (paper's normalisation), target {_nb(P, '03')['target_faithfulness']}; an "
            "operator whose denominator is not above 0 at 95 % is excluded with its reason (the paper "
            "averages every operator)"
        ),
        scale=lambda P: f"a grid of shares per layer; {_quick(P, '03')}",
    ),
    "nikankin_heuristic_ablation": dict(
        model=lambda P: _model(P, "03"),
        prompts=lambda P: _nik03_prompts(P),
        positions=lambda P: (
            f"the neurons of one heuristic (match >= {_nb(P, '03')['t']}, {_label_null(P)}) "
            "mean-ablated at the last position"
        ),
        metric=lambda P: "accuracy on associated vs other prompts",
        scale=lambda P: f"up to {_nb(P, '03')['max_ablated_heuristics']} heuristics per operator; {_quick(P, '03')}",
    ),
    "nikankin_prompt_ablation": dict(
        model=lambda P: _model(P, "03"),
        prompts=lambda P: _nik03_prompts(P),
        positions=lambda P: (
            f"as the authors' code (cap per layer, ranked by the prompt's heuristics, control per layer "
            f"from the layer's other circuit neurons, zeroed), labels {_label_null(P)}; differences: "
            "zeroed at the answer position only; ranking ties to the larger summed match score; a "
            "prompt without a disjoint pool is counted as not testable"
        ),
        metric=lambda P: (
            "control minus heuristic first-token accuracy on the testable prompts, at one cap (25 of 200 "
            "per layer, Sec. 5)"
        ),
        scale=lambda P: (
            f"caps at {', '.join(f'{x:.3g}' for x in _nb(P, '03')['knockout_cap_shares'])} of the "
            f"circuit's neurons per layer; labels {_nb(P, '03')['labels']!r}; {_quick(P, '03')}"
        ),
    ),
    "kantamneni_helix_patch": dict(
        model=lambda P: _model(P, "09"),
        prompts=lambda P: (
            f"'a+b=' with a in 0..{_nb(P, '09')['max_operand']}, {_fewshot(P, '09')}; pairs answered "
            "correctly (first token) in both forms, different first answer tokens"
        ),
        positions=lambda P: (
            "the residual stream entering each layer at a's last token (its last digit on a per-digit tokenizer)"
        ),
        metric=lambda P: (
            "logit of a'+b's first token, patched minus clean; share of the layer patch, pooled over "
            "the first half of the layers, with 95 % intervals over pairs"
        ),
        scale=lambda P: (
            f"{_nb(P, '09')['n_pairs']} pairs, every layer, periods {_nb(P, '09')['periods']}, helix in "
            f"{_nb(P, '09')['n_pca']} principal components; {_quick(P, '09')}"
        ),
    ),
    "zhou_fourier_features": dict(
        model=lambda P: _model(P, "09"),
        prompts=lambda P: "the embeddings of the single-token numbers (0..999 on the toy model, 0..9 per digit)",
        positions=lambda P: "the embedding matrix (the residual stream by layer is shown, not judged)",
        metric=lambda P: (
            f"share of Fourier power at periods 2, 2.5, 5, 10 against {_nb(P, '09')['n_shuffles']} "
            "shuffles of the numbers"
        ),
        scale=lambda P: _quick(P, "09"),
    ),
    "zhou_scratch_low_frequency": dict(
        model=lambda P: f"{_model(P, '09')}; number embeddings {_nb(P, '09')['number_init']}",
        prompts=lambda P: "the embeddings of the single-token numbers",
        positions=lambda P: "the embedding matrix",
        metric=lambda P: "as zhou_fourier_features",
        scale=lambda P: _quick(P, "09"),
    ),
}


# --------------------------------------------------------------------------- forced by the offline model


_OFFLINE = (
    "only small 4-bit GGUF instruct models install offline (dequantized); the papers' 7-8B base "
    "models cannot be downloaded here"
)


def _prefix(P: Params, nb: str) -> str:
    return (
        f"{_nb(P, nb)['fewshot']}-shot prefix: instruct models answer bare prompts poorly "
        "(1D + 25 % zero-shot vs 100 % with the prefix, Qwen-0.5B)"
    )


def _scaled(P: Params, nb: str, *layers_of_32: int) -> str:
    L = _layers(P, nb)
    return "fewer layers, indices scaled by depth: " + ", ".join(
        f"{l} of 32 -> {_depth(l, L)} of {L}" for l in layers_of_32
    )


_DIGITS = "per-digit tokenizer: operands 1-9 (as the paper's LLaMA2)"
_NIK_TOKENS = "per-digit tokenizer: single-token operands only 0-9 (Llama3 has one token per number up to 999)"
_CPU = "machine (no GPU): fine-tuning at the CPU scale, far below the paper's data"

#: Differences the offline models force, by finding id: aspect -> a function of the params.
FORCED: dict[str, dict[str, Getter]] = {
    "zhang_key_heads": dict(model=lambda P: _OFFLINE, prompts=lambda P: f"{_DIGITS}; {_prefix(P, '01')}"),
    "zhang_knockout": dict(model=lambda P: _OFFLINE, prompts=lambda P: f"{_DIGITS}; {_prefix(P, '01')}"),
    "zhang_late_mlps": dict(
        model=lambda P: _OFFLINE, prompts=lambda P: _prefix(P, "01"), positions=lambda P: _scaled(P, "01", 17)
    ),
    "zhang_mlp_answer": dict(
        model=lambda P: _OFFLINE, prompts=lambda P: _prefix(P, "02"), metric=lambda P: _scaled(P, "02", 13, 17, 18)
    ),
    "zhang_transfer": dict(model=lambda P: _OFFLINE, prompts=lambda P: _prefix(P, "01") + "; SVAMP is not offline"),
    "zhang_precise_sft": dict(
        model=lambda P: _OFFLINE,
        prompts=lambda P: (
            "GSM8K / SVAMP / MMLU / CSQA are not offline: arithmetic and word "
            "problems generated here, factual recall and LM loss for general "
            f"ability; {_prefix(P, '08')}"
        ),
        scale=lambda P: _CPU if _ft_scale(P, "08")["scale"] != "paper" else "",
    ),
    "yu_single_head": dict(model=lambda P: _OFFLINE, prompts=lambda P: _prefix(P, "01")),
    "yu_mask_keep": dict(
        model=lambda P: _OFFLINE,
        prompts=lambda P: _prefix(P, "04"),
        positions=lambda P: "the layers from the model's own key head (Yu: 17-31 from 17.22)",
    ),
    "yu_shallow_neurons": dict(
        model=lambda P: _OFFLINE,
        prompts=lambda P: _prefix(P, "04"),
        positions=lambda P: (
            "layers below the model's own key head, OV of the attention "
            "layers up to it (Yu: 0-15 through 0-16 below 17.22)"
        ),
    ),
    "yu_lora_layers": dict(
        model=lambda P: _OFFLINE,
        prompts=lambda P: _prefix(P, "05"),
        scale=lambda P: _CPU if _ft_scale(P)["scale"] != "paper" else "",
    ),
    "yu_lora_coef": dict(
        model=lambda P: _OFFLINE,
        prompts=lambda P: _prefix(P, "05"),
        positions=lambda P: _scaled(P, "05", 17),
        scale=lambda P: _CPU if _ft_scale(P)["scale"] != "paper" else "",
    ),
    "yu_pruning": dict(
        model=lambda P: _OFFLINE,
        positions=lambda P: _scaled(P, "06", 9, 17),
        scale=lambda P: _CPU if _ft_scale(P)["scale"] != "paper" else "",
    ),
    "yu_gender_bias": dict(model=lambda P: _OFFLINE),
    "nikankin_faithfulness": dict(model=lambda P: _OFFLINE, prompts=lambda P: f"{_NIK_TOKENS}; {_prefix(P, '03')}"),
    "nikankin_heuristic_ablation": dict(
        model=lambda P: _OFFLINE,
        prompts=lambda P: (
            f"{_NIK_TOKENS}: the grid has 2-digit (multi-token) operands, "
            f"the answer's first token as target; {_prefix(P, '03')}"
        ),
    ),
    "nikankin_prompt_ablation": dict(model=lambda P: _OFFLINE, prompts=lambda P: f"{_NIK_TOKENS}; {_prefix(P, '03')}"),
    "kantamneni_helix_patch": dict(
        model=lambda P: _OFFLINE, prompts=lambda P: _prefix(P, "09"), positions=lambda P: _last_digit(P)
    ),
    "zhou_fourier_features": dict(model=lambda P: _OFFLINE, prompts=lambda P: _last_digit(P)),
    "zhou_scratch_low_frequency": dict(model=lambda P: _OFFLINE),
}


def _last_digit(P: Params) -> str:
    return (
        "per-digit tokenizer: only 0-9 are single tokens; a is read at its last digit"
        if int(_nb(P, "09")["single_token_max"]) < 99
        else ""
    )
