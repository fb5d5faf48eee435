"""Thresholds fixed from the papers, in one place for the analyses, the plots and the report."""

#: Zhang et al. 2024 Sec. 5.1: a key head lowers the answer logit by more than 5 % when
#: path-patched (pooled effect below -0.05).
KEY_HEAD_THRESHOLD = -0.05

#: Zhang et al. 2024 Table 4 (App. E): the knockout that gives the "around 70 %" accuracy
#: drop of Sec. 1 (-69 %) knocks out the top-10 heads by path-patching effect. One k for
#: the knockout verdict (Fig. 3) and the transfer test (Fig. 4), fixed from the paper
#: (not from our curves); capped at half the model's heads, so that a random set of as
#: many other heads exists for the control (matters for tiny models only).
KNOCKOUT_K = 10

#: Nikankin et al. 2025 Sec. 4.1: a neuron implements a heuristic when its match score is
#: at least t = 0.6.
NIKANKIN_MATCH_T = 0.6
#: Nikankin et al. 2025 (authors' answer in the OpenReview thread): their circuit's
#: faithfulness is about 96 %.
NIKANKIN_FAITHFULNESS = 0.96
#: Nikankin et al. 2025 Sec. 2-3: the circuit keeps about 1 % of the neurons of each
#: middle/late MLP (about 200 of Llama3-8B's 14,336).
NIKANKIN_NEURON_SHARE = 0.01
#: Faithfulness a circuit must reach to be called faithful (the paper's 96 % rounded down);
#: the head count of the full circuit is the smallest reaching it on the selection prompts.
FAITHFULNESS_TARGET = 0.9

#: Zhang et al. 2024 Sec. 5.3, Table 1: precise SFT's gains "match" full SFT's although it
#: falls short on some sets (by at most 3.1 points: AddSub, LLaMA2-7B), and full SFT's
#: drop of "about 5 %" on MMLU / CSQA is what the paper calls a loss of general ability.
#: A shortfall of precise SFT against full SFT (arithmetic gain, or general ability kept)
#: of less than 5 points therefore counts as "about as large" (fixed from the paper's text).
ZHANG_PRECISE_MARGIN = 0.05
