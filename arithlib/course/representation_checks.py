"""Checks for exercise 09, how the numbers themselves are represented (``notebooks/exercises/09_*``),
on the toy model: the Fourier power spectrum of a number representation along the number axis
(Zhou et al. 2024, the spectrum of docs/representations.md), the generalized-helix basis
B(a) = [a, cos(2πa/T), sin(2πa/T) for T in the periods] (Kantamneni & Tegmark 2025) and the
least-squares helix fit in the top principal components, as their code and
:func:`arithlib.representations.helix.fit_helix` do it. As in :mod:`arithlib.course.exercises`, a
check prints one line when the student's function agrees with arithlib's and raises
:class:`CheckFailed` saying what differs (naming the usual mistake where it recognises one) when
it does not.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from threadpoolctl import threadpool_limits

from ..core.papers import KT_PERIODS
from ..core.prompt_sets import PromptSet
from ..representations import fourier as FO
from ..representations import helix as HX
from ..representations import passes as RP
from .exercises import CheckFailed, check_model, passed

#: The operands a = 0..MAX_OPERAND of the prompts "a+b=" (Kantamneni & Tegmark: 0..99).
MAX_OPERAND = 99
#: How many values of b each a is read with (drawn from 0..MAX_OPERAND, seeded).
N_B = 4
#: Largest difference allowed, relative to the largest value of the reference.
REL_TOL = 1e-4


@dataclass(frozen=True)
class RepresentationData:
    """What the notebook-09 checks read on the toy model: the number tokens' embedding rows
    ``embedding`` [1000, d] (numbers 0..999, in order), and on the prompts "a+b=" (a = 0..99,
    :data:`N_B` values of b, 2-shot) the residual stream entering each of ``layers`` at a's token,
    ``acts`` [prompts, layers, d], with each prompt's ``a`` and ``b`` [prompts]."""

    embedding: np.ndarray
    layers: list[int]
    acts: np.ndarray
    a: np.ndarray
    b: np.ndarray

    def number_means(self, j: int) -> np.ndarray:
        """[MAX_OPERAND + 1, d]: ``acts[:, j]`` averaged over the prompts of each a, row n = number n."""
        return RP.mean_by_number(self.acts[:, j], self.a)[1]


@lru_cache(maxsize=1)
def representation_data() -> RepresentationData:
    """The embedding and activations every notebook-09 check uses (:class:`RepresentationData`)."""
    model = check_model()
    bridge, tok = model.bridge, model.tokenizer
    embedding = RP.number_embeddings(bridge, RP.number_ids(tok, range(1000))).numpy().astype(np.float64)
    bs = sorted(np.random.default_rng(0).permutation(MAX_OPERAND + 1)[:N_B].tolist())
    prompts = PromptSet.build(RP.addition_records(range(MAX_OPERAND + 1), bs, fewshot=2), tok)
    layers = list(range(bridge.cfg.n_layers))
    acts, _ = RP.collect_at_positions(bridge, prompts, RP.last_token_positions(prompts), layers)
    a = np.array([r.a for r in prompts.records])
    b = np.array([r.b for r in prompts.records])
    return RepresentationData(embedding, layers, acts.numpy().astype(np.float64), a, b)


def _one_blas_thread(check: Callable) -> Callable:
    """Run ``check`` with one BLAS thread: its fits are small, and multi-threaded BLAS on a
    shared CPU is ten times slower than one thread (as in :mod:`arithlib.zhang.probing`)."""

    @functools.wraps(check)
    def run(fn: Callable) -> None:
        with threadpool_limits(1):
            check(fn)

    return run


def _as_array(value, name: str) -> np.ndarray:
    try:
        out = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError):
        raise CheckFailed(f"{name} should return a numpy array, got {type(value).__name__}") from None
    return out


def _close(mine: np.ndarray, ref: np.ndarray, tol: float = REL_TOL) -> bool:
    if mine.shape != ref.shape or not np.isfinite(mine).all():
        return False
    scale = max(float(np.abs(ref).max()), 1e-300)
    return float(np.abs(mine - ref).max()) <= tol * scale


# --------------------------------------------------------------------------- the power spectrum


def _spectrum_cases() -> list[tuple[str, np.ndarray]]:
    """(name, X) the power spectrum is checked on: the embedding of 0..999, of 0..98 (N odd) and
    the residual stream at a's token averaged per number, per layer."""
    data = representation_data()
    cases = [("the embedding of 0..999", data.embedding), ("the embedding of 0..98", data.embedding[:99])]
    cases += [
        (f"the residual stream entering layer {L} (0..99)", data.number_means(j)) for j, L in enumerate(data.layers)
    ]
    return cases


def _wrong_spectra(x: np.ndarray) -> dict[str, np.ndarray]:
    """What the usual mistakes compute, for the message of :func:`check_power_spectrum`."""
    n, d = x.shape
    xc = x - x.mean(0, keepdims=True)
    f = np.fft.rfft(xc, axis=0)
    power = (np.abs(f) ** 2).sum(1)
    return {
        "the power without removing each dimension's mean over the numbers first (P[0] must be 0: "
        "subtract X.mean(0))": (np.abs(np.fft.rfft(x, axis=0)) ** 2).sum(1),
        "the amplitude |F| summed over dimensions, not the power |F|^2": np.abs(f).sum(1),
        "the square root of the power (an amplitude), not the power": np.sqrt(power),
        "with the mean removed over the dimensions (axis 1) instead of over the numbers (axis 0)": (
            np.abs(np.fft.rfft(x - x.mean(1, keepdims=True), axis=0)) ** 2
        ).sum(1),
        "the power averaged over the dimensions instead of summed": power / d,
        "the power of a normalised DFT (norm='ortho': divided by N); use np.fft.rfft's default": power / n,
        "the power of a normalised DFT (norm='forward': divided by N^2); use np.fft.rfft's default": power / n**2,
        "the shares of the power (divided by the total); return the power itself": power / power[1:].sum(),
    }


@_one_blas_thread
def check_power_spectrum(fn: Callable) -> None:
    """``fn(X)`` (``X`` [N, d], row n the vector of number n): the Fourier power P[k], k = 0..N//2,
    of each dimension's values along the number axis, after removing each dimension's mean over
    the numbers, summed over the dimensions (P[0] = 0); checked on the toy model's embedding of
    0..999 and of 0..98 and on the residual stream at a's token averaged per number (0..99),
    against :func:`arithlib.representations.fourier.power_spectrum`."""
    cases = _spectrum_cases()
    for name, x in cases:
        n, d = x.shape
        ref = FO.power_spectrum(x)
        mine = _as_array(fn(x.copy()), "power_spectrum")
        where = f"power_spectrum of {name} (X of shape {x.shape})"
        if mine.shape != ref.shape:
            if mine.shape == (d // 2 + 1,) or mine.shape == (d,):
                why = "the DFT runs along the wrong axis: it runs over the numbers (axis 0, the rows); sum the power over the dimensions"
            elif mine.shape in ((n // 2 + 1, d), (n, d)):
                why = "sum the power over the dimensions (axis 1)"
            elif mine.shape == (n,) and _close(mine[: n // 2 + 1], ref):
                why = "that is the full DFT; keep the frequencies k = 0..N//2 (np.fft.rfft)"
            elif mine.shape == (n,):
                why = "one value per number: the DFT runs along the wrong axis (it runs over the numbers, axis 0)"
            elif mine.shape == (n // 2,):
                why = "k runs from 0 to N//2 inclusive: N//2 + 1 values"
            else:
                why = "one value per frequency k = 0..N//2"
            raise CheckFailed(f"{where}: shape {mine.shape}, expected {ref.shape}: {why}")
        if _close(mine, ref):
            continue
        if not np.isfinite(mine).all():
            raise CheckFailed(f"{where}: has NaN or inf values")
        why = [w for w, v in _wrong_spectra(x).items() if _close(mine, v)]
        if why:
            raise CheckFailed(f"{where}: your values are {why[0]}")
        ratio = mine[1:] / np.where(ref[1:] > 0, ref[1:], np.nan)
        if np.nanstd(ratio) < 1e-6 * abs(np.nanmean(ratio)):
            raise CheckFailed(
                f"{where}: proportional to the reference but {np.nanmean(ratio):.4g} times it: use the "
                "unnormalised DFT (np.fft.rfft's default), the squared magnitude, summed over the dimensions"
            )
        k = int(np.argmax(np.abs(mine - ref)))
        raise CheckFailed(
            f"{where}: P[{k}] (period {n / k if k else math.inf:.4g}) is {mine[k]:.6g}, expected {ref[k]:.6g}"
        )
    passed(
        f"power_spectrum matches arithlib.representations.fourier.power_spectrum on {len(cases)} number representations"
    )


# --------------------------------------------------------------------------- the helix basis


def _column_names(periods: Sequence[float]) -> list[str]:
    names = ["a / a_max"]
    for T in periods:
        names += [f"cos(2πa/{T:g})", f"sin(2πa/{T:g})"]
    return names + ["1"]


def _helix_cases() -> list[tuple[np.ndarray, tuple[float, ...], float]]:
    """(a, periods, a_max) the basis is checked on: the prompts' operands with the paper's periods,
    0..99 and 0..999 with other periods, and a range whose largest value is not a_max."""
    data = representation_data()
    return [
        (data.a, tuple(KT_PERIODS), float(MAX_OPERAND)),
        (np.arange(100), (10.0,), 99.0),
        (np.arange(1000), (2.0, 2.5, 5.0, 10.0, 100.0, 1000.0), 999.0),
        (np.arange(50), tuple(KT_PERIODS), 99.0),
    ]


def _wrong_bases(a: np.ndarray, periods: Sequence[float], a_max: float) -> dict[str, np.ndarray]:
    """What the usual mistakes compute (all with the right shape), for :func:`check_helix_basis`."""
    x = np.asarray(a, dtype=np.float64)
    ref = HX.helix_basis(x, periods, a_max)
    cos, sin = ref[:, 1:-1:2], ref[:, 2:-1:2]

    def with_first(col: np.ndarray) -> np.ndarray:
        out = ref.copy()
        out[:, 0] = col
        return out

    def with_angle(angle: Callable[[float], np.ndarray]) -> np.ndarray:
        with np.errstate(divide="ignore", invalid="ignore"):
            trig = [f(angle(T)) for T in periods for f in (np.cos, np.sin)]
        return np.stack([x / a_max, *trig, np.ones_like(x)], 1)

    swapped = ref.copy()
    swapped[:, 1:-1:2], swapped[:, 2:-1:2] = sin, cos
    out = {
        "a not divided by a_max (the linear column is a / a_max)": with_first(x),
        "a divided by max(a) instead of by a_max": with_first(x / max(float(np.abs(x).max()), 1.0)),
        "a centred (the linear column is a / a_max, not centred)": with_first((x - x.mean()) / a_max),
        "the angle 2πT/a: the period belongs in the denominator, 2πa/T": with_angle(lambda T: 2 * math.pi * T / x),
        "the angle a/T without the 2π": with_angle(lambda T: x / T),
        "the angle 2π/(aT)": with_angle(lambda T: 2 * math.pi / (x * T)),
        "sin before cos: each period gives cos(2πa/T), then sin(2πa/T)": swapped,
        "all cosines, then all sines: give each period its cos and sin side by side": np.concatenate(
            [ref[:, :1], cos, sin, ref[:, -1:]], 1
        ),
        "the column of ones first: it comes last": np.concatenate([ref[:, -1:], ref[:, :-1]], 1),
    }
    return out


@_one_blas_thread
def check_helix_basis(fn: Callable) -> None:
    """``fn(a, periods, a_max)``: B(a) [n, 2P + 2], the columns a / a_max, then cos(2πa/T) and
    sin(2πa/T) for each period T in turn, then a column of ones (the intercept); checked on the
    prompts' operands with the paper's periods 2, 5, 10, 100 and on other numbers and periods,
    against :func:`arithlib.representations.helix.helix_basis`."""
    cases = _helix_cases()
    for a, periods, a_max in cases:
        ref = HX.helix_basis(a, periods, a_max)
        mine = _as_array(fn(np.asarray(a).copy(), list(periods), a_max), "helix_basis")
        where = f"helix_basis(a = {len(a)} numbers up to {int(np.max(a))}, periods {list(periods)}, a_max {a_max:g})"
        p = len(periods)
        if mine.shape != ref.shape:
            why = f"one row per number and 2P + 2 = {2 * p + 2} columns: {', '.join(_column_names(periods))}"
            if mine.shape == (ref.shape[1], ref.shape[0]):
                why = f"transposed: one row per number ({len(a)}), one column per basis function"
            elif mine.shape == (len(a), 2 * p + 1):
                if _close(mine, HX.helix_basis(a, periods, a_max, constant=False)):
                    why = "no intercept: end with a column of ones"
                elif _close(mine, HX.helix_basis(a, periods, a_max, linear=False)):
                    why = "no linear term: start with a / a_max"
                else:
                    why = f"one column missing; expected {', '.join(_column_names(periods))}"
            elif mine.shape == (len(a), p + 2):
                why = "each period has two columns, cos(2πa/T) and sin(2πa/T): a sine (or cosine) term is missing"
            raise CheckFailed(f"{where}: shape {mine.shape}, expected {ref.shape}: {why}")
        if _close(mine, ref, 1e-9):
            continue
        why = [w for w, v in _wrong_bases(a, periods, a_max).items() if np.allclose(mine, v, atol=1e-9, equal_nan=True)]
        if why:
            raise CheckFailed(f"{where}: yours is {why[0]}")
        if not np.isfinite(mine).all():
            raise CheckFailed(f"{where}: has NaN or inf values (a = 0 is one of the numbers: the angle is 2πa/T)")
        bad = [name for j, name in enumerate(_column_names(periods)) if not _close(mine[:, j], ref[:, j], 1e-9)]
        raise CheckFailed(f"{where}: the columns {', '.join(bad)} differ from the reference")
    passed(
        f"helix_basis matches arithlib.representations.helix.helix_basis on {len(cases)} sets of numbers and periods"
    )


# --------------------------------------------------------------------------- the helix fit


def _fit_cases() -> list[tuple[str, np.ndarray, np.ndarray, tuple[float, ...], int]]:
    """(name, X, a, periods, n_pca) the fit is checked on: the residual stream at a's token of every
    layer (one row per prompt) with the paper's periods in 100 and in 10 principal components, and
    with the periods 10 and 100 only."""
    data = representation_data()
    out = []
    for j, L in enumerate(data.layers):
        x = data.acts[:, j]
        out += [
            (f"layer {L}, n_pca 100", x, data.a, tuple(KT_PERIODS), 100),
            (f"layer {L}, n_pca 10", x, data.a, tuple(KT_PERIODS), 10),
            (f"layer {L}, periods 10 and 100, n_pca 20", x, data.a, (10.0, 100.0), 20),
        ]
    return out


def _wrong_fits(
    x: np.ndarray, a: np.ndarray, periods: Sequence[float], n_pca: int, a_max: float
) -> dict[str, np.ndarray]:
    """What the usual mistakes compute (shape [n, d]), for the message of :func:`check_fit_helix`."""
    ref = HX.fit_helix(x, a, periods, n_pca, a_max)
    mean, comps = ref.mean, ref.components
    coords = (x - mean) @ comps.T
    full = HX.helix_basis(a, periods, a_max)

    def lstsq(b: np.ndarray, y: np.ndarray) -> np.ndarray:
        return b @ np.linalg.lstsq(b, y, rcond=None)[0]

    _, _, vt = np.linalg.svd(x, full_matrices=False)
    raw = vt[:n_pca]
    noisy = full.copy()  # the basis as np.sin writes it: sin(2πa/2) about 1e-14, not 0 (arithlib sets it exactly)
    for j, T in enumerate(periods):
        noisy[:, 2 + 2 * j] = np.sin(2 * np.pi * np.asarray(a, dtype=np.float64) / T)
    q = np.linalg.qr(noisy)[0]
    return {
        "without an intercept: the basis needs its column of ones": mean
        + lstsq(HX.helix_basis(a, periods, a_max, constant=False), coords) @ comps,
        "the centred fit: add the mean of X back": lstsq(full, coords) @ comps,
        "fitted in the model's whole space: fit in the top n_pca principal components": mean + lstsq(full, x - mean),
        "fitted in the principal directions of the uncentred X: take the principal components of X - mean": mean
        + lstsq(full, (x - mean) @ raw.T) @ raw,
        "the fit of the float noise in the sin(2πa/2) column (on integers it is 0, but np.sin(np.pi * a) is "
        "about 1e-14): solve with np.linalg.lstsq(B, Y, rcond=None), which treats that column as the zero "
        "column it is (pinv with a tiny rcond, QR and the normal equations do not)": mean + q @ (q.T @ coords) @ comps,
        "without the sine terms": mean
        + lstsq(np.concatenate([full[:, :1], full[:, 1:-1:2], full[:, -1:]], 1), coords) @ comps,
    }


@_one_blas_thread
def check_fit_helix(fn: Callable) -> None:
    """``fn(X, a, periods, n_pca, a_max)``: the least-squares helix fit of the activations ``X``
    [n, d] of the numbers ``a`` [n], as fitted activations [n, d]: X centred, projected on its top
    ``n_pca`` principal components, the projections regressed on B(a) (with its intercept) by least
    squares, the fit mapped back and the mean added; checked on the residual stream at a's token of
    every layer of the toy model, against
    :func:`arithlib.representations.helix.fit_helix` (``.predict(a)``)."""
    cases = _fit_cases()
    for name, x, a, periods, n_pca in cases:
        a_max = float(MAX_OPERAND)
        fit = HX.fit_helix(x, a, periods, n_pca, a_max)
        ref = fit.predict(a)
        mine = _as_array(fn(x.copy(), np.asarray(a).copy(), list(periods), n_pca, a_max), "fit_helix")
        where = f"fit_helix ({name}, periods {list(periods)})"
        if mine.shape != ref.shape:
            why = "return the fitted activations, one row per row of X, in the model's space"
            if mine.ndim == 2 and mine.shape[0] == len(x) and fit.components.shape[0] <= mine.shape[1] <= n_pca:
                why = "these are principal-component coordinates: map them back (@ components) and add the mean"
            raise CheckFailed(f"{where}: shape {mine.shape}, expected {ref.shape}: {why}")
        if _close(mine, ref):
            continue
        why = [w for w, v in _wrong_fits(x, a, periods, n_pca, a_max).items() if _close(mine, v)]
        if why:
            raise CheckFailed(f"{where}: yours is {why[0]}")
        raise CheckFailed(
            f"{where}: differs from the reference by up to {float(np.abs(mine - ref).max()):.3g} (values up to "
            f"{float(np.abs(ref).max()):.3g}); R² {HX.r2(x, mine):.4f}, expected {HX.r2(x, ref):.4f}. Solve with "
            "np.linalg.lstsq(B, Y, rcond=None): on integers sin(2πa/2) is a column of zeros"
        )
    passed(f"fit_helix matches arithlib.representations.helix.fit_helix on {len(cases)} fits of the toy model")
