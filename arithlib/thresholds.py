"""Thresholds fixed from the papers, in one place for the analyses, the plots and the report."""

#: Zhang et al. 2024 Sec. 5.1: a key head lowers the answer logit by more than 5 % when
#: path-patched (pooled effect below -0.05).
KEY_HEAD_THRESHOLD = -0.05
