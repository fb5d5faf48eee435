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
