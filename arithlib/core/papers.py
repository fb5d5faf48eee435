"""The three papers' numbers, and the thresholds of this repository's rules, in one place.

Every number that a method derives a setting from, or that a notebook or the report sets
beside ours, is defined here with the place it is quoted from; the modules, the notebooks
and the report import it from here. Values that are this repository's choices rather
than a paper's say so ("ours"). No torch: the report reads this without loading a model.
"""

# --------------------------------------------------------------------------- citations

PAPERS = {
    "zhang": "Zhang et al. 2024 (ICML)",
    "yu": "Yu & Ananiadou 2024 (EMNLP)",
    "nikankin": "Nikankin et al. 2025 (ICLR)",
    "zhou": "Zhou et al. 2024 (NeurIPS)",
    "kantamneni": "Kantamneni & Tegmark 2025 (arXiv)",
}
PAPERS_SHORT = {
    "zhang": "Zhang 2024",
    "yu": "Yu 2024",
    "nikankin": "Nikankin 2025",
    "zhou": "Zhou 2024",
    "kantamneni": "Kantamneni 2025",
}
#: Where each paper's numbers are quoted from (the README's "Citing" section has the BibTeX).
ZHANG_TXT = "Zhang et al. 2024, ICML (PMLR 235; arXiv:2409.01659)"
YU_TXT = "Yu & Ananiadou 2024, EMNLP (arXiv:2409.14144)"
NIKANKIN_TXT = "Nikankin et al. 2025, ICLR, OpenReview discussion (arXiv:2410.21272)"
#: The two papers on number representations that notebook 09 sets beside Nikankin's neurons.
ZHOU_TXT = "Zhou et al. 2024, NeurIPS (arXiv:2406.03445)"
KANTAMNENI_TXT = (
    "Kantamneni & Tegmark 2025 (arXiv:2502.00873) and their code, subhashk01/LLM-addition, "
    "experimentation/helix_fitting.ipynb"
)

# --------------------------------------------------------------------------- Zhang et al. 2024 (ICML)

#: Sec. 5.1: a key head lowers the answer logit by more than 5 % when path-patched
#: (pooled effect below -0.05).
KEY_HEAD_THRESHOLD = -0.05
#: Abstract, Sec. 5.1: fewer than 5 % of the heads are key heads.
ZHANG_KEY_HEAD_SHARE = 0.05
#: Table 4 (App. E): the knockout that gives the "around 70 %" accuracy drop of Sec. 1
#: (-69 %) knocks out the top-10 heads by path-patching effect. One k for the knockout
#: verdict (Fig. 3) and the transfer test (Fig. 4), fixed from the paper (not from our
#: curves); capped at half the model's heads, so that a random set of as many other
#: heads exists for the control (matters for tiny models only).
KNOCKOUT_K = 10
#: Sec. 1: knocking out the key heads lowers accuracy by "around 70 %" ...
ZHANG_KNOCKOUT_DROP = 0.70
#: ... Sec. 5.1: while random heads change it "within 2 %".
ZHANG_RANDOM_KNOCKOUT_WITHIN = 0.02
#: Sec. 5.1, Fig. 2: MLPs from layer 17 of 32 on change the answer logit by about 10 %.
ZHANG_LATE_MLP_LAYER_32 = 17
ZHANG_LATE_MLP_EFFECT = 0.10
#: Sec. 5.2, App. C (Fig. 14): cos(MLP_out - MLP_in, W_U[C]) starts at layer 13, climbs
#: from layer 17 and ends at 28 of 32 (start-inflection-end 13-18-28).
ZHANG_MLP_CURVE_START_32 = 13
ZHANG_MLP_CURVE_CLIMB_32 = 17
#: Sec. 5.1 (Fig. 4): SVAMP accuracy falls by 66.0 % relative (34.7 % -> 11.8 %).
ZHANG_TRANSFER_DROP = 0.66
#: Sec. 5.3: training settings of precise and full SFT (LLaMA2-7B/13B).
ZHANG_SFT = dict(lr=2e-5, batch_size=128, epochs=2, warmup_ratio=0.02, weight_decay=0.1)
#: Table 2: numbers of key heads tuned, out of LLaMA2-7B's 32 x 32 = 1024 heads.
ZHANG_HEAD_COUNTS: tuple[int, ...] = (8, 16, 32, 48, 64)
ZHANG_TOTAL_HEADS = 1024
#: Table 5: numbers of top MLPs added to the top-32 heads.
ZHANG_MLP_COUNTS: tuple[int, ...] = (1, 2, 3, 6)
#: Sec. 5.3, Table 1: precise SFT's gains "match" full SFT's although it falls short on
#: some sets (by at most 3.1 points: AddSub, LLaMA2-7B), and full SFT's drop of "about
#: 5 %" on MMLU / CSQA is what the paper calls a loss of general ability. A shortfall of
#: precise SFT against full SFT (arithmetic gain, or general ability kept) of less than 5
#: points therefore counts as "about as large" (fixed from the paper's text).
ZHANG_PRECISE_MARGIN = 0.05
#: Ours: learning rates of precise and full SFT searched on the validation split at the
#: "cpu" scale: Zhang's 2e-5 and a factor 5 above and below it (fixed before any run).
SFT_LR_GRID: tuple[float, ...] = (1e-4, 2e-5, 4e-6)

# --------------------------------------------------------------------------- Yu & Ananiadou 2024 (EMNLP)

#: Sec. 3.2-3.4: 1-, 2- and 3-digit operations (1D, 2D, 3D); the operand ranges are ours (every
#: number of that many digits, 0 counted as 1-digit).
YU_OPERAND_RANGES: dict[int, tuple[int, int]] = {1: (0, 9), 2: (10, 99), 3: (100, 999)}
#: Table 2: relative 1D accuracy decrease (%) when the top head is zeroed, per operator.
YU_TABLE2 = {"+": 46.5, "-": 62.2, "/": 54.9, "*": 6.8}
#: Table 1 (2-digit prompts, Llama-7B): accuracy (%) of the original model and with the + / - head
#: 17^22 or the / head 14^19 zeroed. Each head leaves the other operators nearly intact: 17^22
#: lowers 2D* by 10.8 % (relative) against a mean of 39.5 % on 2D+ and 2D-.
YU_TABLE1 = {
    "original": {"+": 96.8, "-": 94.4, "*": 56.6, "/": 51.4},
    "17^22": {"+": 42.9, "-": 72.3, "*": 50.5, "/": 48.2},
    "14^19": {"+": 92.5, "-": 93.2, "*": 51.3, "/": 13.8},
}
#: Operator groups of Sec. 4 / App. B: + and - share one key head (17^22), / has its own (14^19).
YU_GROUPS: dict[str, tuple[str, ...]] = {"+-": ("+", "-"), "/": ("/",)}
#: The deep FFN layers, 17..31 of Llama-7B's 32 (the layers from the key head 17^22 up):
#: they start at this fraction of the depth (notebooks 05, 06; notebook 04's "keep" uses
#: the layers CNA scored from its own key head instead).
DEEP_FROM_FRACTION = 17 / 32
#: Ours: prediction-enhancing DAG: an edge lower -> upper is drawn when removing the lower
#: neuron's sub-value from the upper layer's input lowers the upper neuron's coefficient
#: by at least this fraction (direct path, exact).
DAG_EDGE_MIN_ENHANCEMENT = 0.05
#: Numbers on Llama-7B (%) that notebook 04 sets beside ours, by measure, operator group
#: and top-K: mask / keep accuracy decrease (Tables 5, 15), coefficient decrease with the
#: head zeroed (Tables 5, 15), the lowest-neuron test (Tables 6, 16); "M2":
#: hidden-interpretable neurons at M = 2 (Table 8: neurons, accuracy decrease,
#: random-neuron decrease); "M_neurons", "shallow_total", "M_decrease": Tables 8 and 17
#: at every M.
YU_CNA_TABLES: dict[str, dict] = {
    "mask": {"+-": {99: 100.0, 10: 68.4}, "/": {99: 84.6, 10: 51.3}},
    "keep": {"+-": {99: 3.9, 10: 38.2}, "/": {99: 48.7, 10: 64.2}},
    "coef": {"+-": {99: 49.1, 10: 77.1}, "/": {99: 50.0, 10: 73.0}},
    "lowest": {"+-": {99: 15.8, 10: 4.4}, "/": {99: 1.3, 10: 7.0}},
    "M2": {"+-": (1953, 53.9, 2.6)},
    # Table 8 (+ -) and Table 17 (/) list the same neuron counts per M, of the 176,128
    # neurons of FFN layers 0-15; accuracy decrease (%) per M
    "M_neurons": {0: 51980, 1: 10426, 2: 1953, 3: 510},
    "shallow_total": 176128,
    "M_decrease": {"+-": {0: 98.7, 1: 68.4, 2: 53.9, 3: 43.4}, "/": {0: 97.5, 1: 82.1, 2: 30.8, 3: 25.7}},
}
#: Sec. 5: the learning-rate grid of the LoRA models.
YU_LR_GRID: tuple[float, ...] = (1e-3, 5e-4, 1e-4)
#: Table 10's bands of LoRA layers in Llama-7B's 32: 1-9, 10-16, 17-30 (layers 0 and 31
#: left out as "special"); as fractions of the depth.
YU_BANDS_32: dict[str, tuple[int, int]] = {"shallow": (1, 10), "middle": (10, 17), "deep": (17, 31)}
#: Sec. 6.1 uses the LoRA model of layer 9 of 32 as its reference LoRA model.
YU_REFERENCE_LAYER_FRACTION = 9 / 32
#: Table 10: the smallest coefficient increase (%) of the shallow band (layers 1-9).
YU_SHALLOW_COEF_MIN = 42.0
#: Sec. 6.1: each case's top-500 CNA neurons are kept ...
YU_TOP_K = 500
#: ... in Llama-7B's deep layers 17-31: 15 layers x 11,008 neurons ...
YU_DEEP_NEURONS = 15 * 11_008
#: ... which leaves about 5 % of them.
YU_KEPT_SHARE = 0.05
#: Table 11, accuracy (%) on the 2-digit test set.
YU_TABLE11 = {"original": 62.9, "LoRA": 89.3, "LoRA on CNA-pruned": 82.3, "LoRA on random-pruned": 17.1}
#: Sec. 6.2, App. D: the number of neurons zeroed to edit the gender bias.
YU_EDIT_K = 18
#: Table 13 (Llama-7B): mean |log p(prof | woman) - log p(prof | man)| in nats, over all
#: professions and over each gender's, before and after zeroing the 18 neurons.
YU_TABLE13 = {
    "original": {"total": 1.26, "woman": 1.45, "man": 1.08},
    "edited": {"total": 0.81, "woman": 1.04, "man": 0.59},
}
#: Sec. 6.2: the bias is "reduced by 35.7 %" (1 - 0.81 / 1.26).
YU_BIAS_REDUCTION_PCT = 35.7

# --------------------------------------------------------------------------- Nikankin et al. 2025 (ICLR)

#: Sec. 4.1: a neuron implements a heuristic when its match score is at least t = 0.6.
NIKANKIN_MATCH_T = 0.6
#: Authors' answer in the OpenReview thread: their circuit's faithfulness is about 96 %.
NIKANKIN_FAITHFULNESS = 0.96
#: Sec. 2-3: the circuit keeps about 1 % of the neurons of each middle/late MLP (about
#: 200 of Llama3-8B's 14,336).
NIKANKIN_NEURON_SHARE = 0.01
#: Sec. 4.2 (Fig. 8), Sec. 5 (Fig. 10c): the prompt knockout zeroes at most a fixed number of a
#: prompt's heuristic neurons per layer; "ablating 25 heuristic neurons per layer is enough to
#: cause near-zero accuracy" (Pythia-6.9B, 200 circuit neurons per layer). The verdict reads the
#: cap at this share of the circuit's neurons per layer (25 of 200).
NIKANKIN_KNOCKOUT_CAP_SHARE = 25 / 200
#: Ours: faithfulness a circuit must reach to be called faithful (the paper's 96 % rounded
#: down); the head count of the full circuit is the smallest reaching it on the selection
#: prompts.
FAITHFULNESS_TARGET = 0.9

# --------------------------------------------------------------------------- Zhou et al. 2024, Kantamneni & Tegmark 2025

#: Zhou et al., Sec. 3-4: the Fourier features of number representations have periods 2, 2.5,
#: 5 and 10 (the answer modulo 2, 5, 10) beside low frequencies (magnitude).
ZHOU_PERIODS: tuple[float, ...] = (2.0, 2.5, 5.0, 10.0)
#: Ours: a representation "has Fourier features" at those periods when their share of its
#: Fourier power is at least this many times the share a shuffled-number null gives them.
ZHOU_EXCESS = 2.0
#: Ours: Zhou's periods need enough single-token numbers to be told from the rest of the
#: spectrum; with fewer (a per-digit tokenizer's 0..9, where they are 4 of 5 frequencies) the
#: embedding finding is not applicable.
ZHOU_MIN_NUMBERS = 20
#: Kantamneni & Tegmark: the helix's periods (numbers 0..99) and the PCA size they fit it in.
KT_PERIODS: tuple[float, ...] = (2.0, 5.0, 10.0, 100.0)
KT_N_PCA = 100
#: Ours: the helix patch must restore at least this share of the whole layer patch's effect
#: ("most of it"), pooled over the first half of the layers (where the operand's own
#: representation is read, before it is moved to the last token).
KT_HELIX_SHARE = 0.5

# --------------------------------------------------------------------------- the report's rules (ours)

#: Share of the paper's effect that counts as reproducing it.
HALF = 0.5
#: Gap (fraction of prompts, i.e. 10 points) for qualitative "much more" claims.
CLEAR_GAP = 0.10
#: Gap (5 points) in the paper's direction that counts as "partly".
NOISE_GAP = 0.05
