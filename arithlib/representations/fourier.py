"""Fourier structure of number representations (Zhou et al. 2024, "Pre-trained Large
Language Models Use Fourier Features to Compute Addition", arXiv:2406.03445).

A representation of the numbers 0..N-1 is a matrix X [N, d]: row n is number n's vector
(its embedding, or the residual stream at its position). Its **Fourier power spectrum**
is taken along the number axis, dimension by dimension, and summed over dimensions:

    F[k, j] = sum_n (X[n, j] - mean_n X[., j]) exp(-2 pi i k n / N),   k = 0..N/2
    P[k]    = sum_j |F[k, j]|^2,      share[k] = P[k] / sum_{k >= 1} P[k]

Frequency k has period T = N / k (k = N/10: period 10, the last digit). A representation
with *Fourier features* puts its power on a few frequencies; the **null** is the same
matrix with its rows (numbers) shuffled, which keeps every dimension's values and
spreads their power over all frequencies (:func:`shuffled_spectra`).

**Low and high frequencies** (:func:`frequency_bands`): a frequency is *low* when its
period is at least :data:`LOW_MIN_PERIOD` (20; the lowest non-zero frequency always is),
*high* otherwise (periods 2 to 10 and those between, where Zhou et al. find the answer
modulo 2, 5 and 10). The DC term (k = 0, the mean over numbers) is in neither band.

**Filters** (:func:`number_space_filter`): Zhou et al. filter a module's output through
the space of number-token logits. With U [N, d] the unembedding rows of the number
tokens and B_S [N, m] an orthonormal real Fourier basis of the frequencies S over the
numbers, a vector h loses the components of frequencies S of its number-logit profile
U h, mapped back by the pseudo-inverse:

    h' = h - U^+ B_S B_S^T U h

When the number tokens are no more than the model width (N <= d, U of full row rank),
U U^+ = I and U h' has exactly no power at S, and h' = h when U h has none (tested).
With more numbers than dimensions (the toy model: 1000 numbers, width 128) the removal
is the least-squares one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import pandas as pd
import torch

#: Frequencies with a period of at least this many numbers are *low* (ours; Zhou et al.
#: call periods 2, 2.5, 5 and 10 high and periods of tens to hundreds low).
LOW_MIN_PERIOD = 20.0


def power_spectrum(X: np.ndarray | torch.Tensor) -> np.ndarray:
    """Fourier power P[k], k = 0..N//2, of the rows of ``X`` [N, d] along the number axis,
    summed over the d dimensions, after removing each dimension's mean (so P[0] = 0)."""
    x = np.asarray(X, dtype=np.float64)
    if x.ndim != 2 or x.shape[0] < 2:
        raise ValueError(f"X must be [N >= 2, d], got {x.shape}")
    x = x - x.mean(0, keepdims=True)
    return (np.abs(np.fft.rfft(x, axis=0)) ** 2).sum(1)


def power_by_dimension(X: np.ndarray | torch.Tensor) -> np.ndarray:
    """Per-dimension Fourier power [N//2 + 1, d] (the terms :func:`power_spectrum` sums),
    for a bootstrap over dimensions."""
    x = np.asarray(X, dtype=np.float64)
    x = x - x.mean(0, keepdims=True)
    return np.abs(np.fft.rfft(x, axis=0)) ** 2


def spectrum_shares(power: np.ndarray) -> np.ndarray:
    """Each frequency's share of the non-DC power (share[0] = 0; NaN for a constant X)."""
    p = np.asarray(power, dtype=np.float64).copy()
    p[0] = 0.0
    total = p.sum()
    return p / total if total > 0 else np.full_like(p, np.nan)


def periods(n_numbers: int) -> np.ndarray:
    """Period N / k of each frequency k = 0..N//2 (inf for k = 0)."""
    k = np.arange(n_numbers // 2 + 1, dtype=np.float64)
    with np.errstate(divide="ignore"):
        return np.where(k > 0, n_numbers / np.maximum(k, 1), np.inf)


def frequencies_of_periods(n_numbers: int, wanted: Sequence[float]) -> list[int]:
    """The frequencies k (1..N//2) whose period N / k equals one of ``wanted`` (exactly,
    up to float rounding); periods that N is no integer multiple of have none."""
    out = []
    for T in wanted:
        k = n_numbers / float(T)
        if abs(k - round(k)) < 1e-9 and 1 <= round(k) <= n_numbers // 2:
            out.append(int(round(k)))
    return sorted(set(out))


def harmonics(n_numbers: int, modulus: int) -> list[int]:
    """Frequencies of a function of n mod ``modulus`` over 0..N-1: the multiples of N /
    modulus (periods modulus / j), when ``modulus`` divides N; else the frequencies nearest
    to them (a residue pattern that does not tile N)."""
    base = n_numbers / modulus
    ks = {int(round(j * base)) for j in range(1, modulus // 2 + 1)}
    return sorted(k for k in ks if 1 <= k <= n_numbers // 2)


def frequency_bands(n_numbers: int, low_min_period: float = LOW_MIN_PERIOD) -> dict[str, list[int]]:
    """``{"low": [...], "high": [...]}``: the non-zero frequencies of N numbers split at
    ``low_min_period`` (a period >= it is low; frequency 1 is always low)."""
    ks = range(1, n_numbers // 2 + 1)
    low = [k for k in ks if n_numbers / k >= low_min_period or k == 1]
    return {"low": low, "high": [k for k in ks if k not in low]}


def shuffled_spectra(X: np.ndarray | torch.Tensor, n_shuffles: int = 200, seed: int = 0) -> np.ndarray:
    """Spectrum shares [n_shuffles, N//2 + 1] of ``X`` with its rows (numbers) permuted:
    the null of a representation with no order over the numbers."""
    x = np.asarray(X, dtype=np.float64)
    rng = np.random.default_rng(seed)
    out = np.empty((n_shuffles, x.shape[0] // 2 + 1))
    for s in range(n_shuffles):
        out[s] = spectrum_shares(power_spectrum(x[rng.permutation(x.shape[0])]))
    return out


def spectrum_table(
    X: np.ndarray | torch.Tensor, n_shuffles: int = 200, seed: int = 0, low_min_period: float = LOW_MIN_PERIOD
) -> pd.DataFrame:
    """One row per non-zero frequency: ``k``, ``period``, ``band`` (low / high), ``share``
    of the non-DC power, the shuffled null's mean and 95th percentile share and
    ``excess`` = share / null mean."""
    x = np.asarray(X, dtype=np.float64)
    n = x.shape[0]
    share = spectrum_shares(power_spectrum(x))
    null = shuffled_spectra(x, n_shuffles, seed)
    bands = frequency_bands(n, low_min_period)
    ks = np.arange(1, n // 2 + 1)
    null_mean = null[:, ks].mean(0)
    return pd.DataFrame(
        {
            "k": ks,
            "period": n / ks,
            "band": ["low" if k in bands["low"] else "high" for k in ks],
            "share": share[ks],
            "null_mean": null_mean,
            "null_q95": np.quantile(null[:, ks], 0.95, axis=0),
            "excess": share[ks] / np.where(null_mean > 0, null_mean, np.nan),
        }
    )


def set_share(power_dims: np.ndarray, ks: Sequence[int]) -> float:
    """Share of the non-DC power (summed over the dimensions given, columns of
    ``power_dims`` [K, d]) that lies at the frequencies ``ks``."""
    p = np.asarray(power_dims).sum(1)
    total = p[1:].sum()
    return float(p[list(ks)].sum() / total) if total > 0 else float("nan")


# --------------------------------------------------------------------------- filters


def fourier_basis(n_numbers: int, ks: Sequence[int]) -> torch.Tensor:
    """Orthonormal real Fourier basis [N, m] over the numbers 0..N-1 for the frequencies
    ``ks`` (each k: its cosine and, except at k = 0 and the Nyquist k = N/2, its sine)."""
    n = torch.arange(n_numbers, dtype=torch.float64)
    cols = []
    for k in ks:
        ang = 2 * math.pi * k * n / n_numbers
        cols.append(torch.cos(ang))
        if 0 < k and 2 * k != n_numbers:
            cols.append(torch.sin(ang))
    if not cols:
        return torch.zeros(n_numbers, 0, dtype=torch.float64)
    B = torch.stack(cols, 1)
    return B / B.norm(dim=0, keepdim=True)


def filter_matrix(unembed: torch.Tensor, ks: Sequence[int]) -> torch.Tensor:
    """M [d, d] with h' = h - M h = (I - U^+ B_S B_S^T U) h written as h' = h @ (I - M)^T:
    returns the matrix R = I - U^+ B B^T U (float64) of the filter that removes the
    frequencies ``ks`` of the number-logit profile (U = ``unembed`` [N, d])."""
    U = unembed.detach().to(torch.float64).cpu()
    B = fourier_basis(U.shape[0], ks)
    return torch.eye(U.shape[1], dtype=torch.float64) - torch.linalg.pinv(U) @ B @ B.T @ U


def number_space_filter(h: torch.Tensor, unembed: torch.Tensor, ks: Sequence[int]) -> torch.Tensor:
    """``h`` [..., d] with the frequencies ``ks`` of its number-logit profile removed
    (module docstring): h' = h - U^+ B_S B_S^T U h. The literal form (tested equal to
    :func:`filter_matrix`'s precomputed one)."""
    U = unembed.detach().to(torch.float64).cpu()
    B = fourier_basis(U.shape[0], ks)
    x = h.detach().to(torch.float64).cpu()
    prof = x @ U.T  # [..., N] number-logit profile
    removed = (prof @ B) @ B.T  # its components at ks
    return (x - removed @ torch.linalg.pinv(U).T).to(h.dtype)


def filter_hooks(hook_names: Sequence[str], R: torch.Tensor, position: int = -1) -> list[tuple[str, object]]:
    """Forward hooks that apply the filter ``R`` (:func:`filter_matrix`) to the
    activation of each hook in ``hook_names`` at ``position`` (-1: the answer position)."""

    def fn(act, hook):
        Rt = R.to(device=act.device, dtype=act.dtype)
        act = act.clone()
        act[:, position] = act[:, position] @ Rt.T
        return act

    return [(name, fn) for name in hook_names]
