"""Exercise 09 (number representations): the checks pass on arithlib's own functions and reject
the typical wrong answers, naming the mistake where they recognise it."""

from __future__ import annotations

import numpy as np
import pytest

import arithlib.course.representation_checks as rc
import arithlib.representations.fourier as FO
import arithlib.representations.helix as HX


def _centred(x: np.ndarray) -> np.ndarray:
    return x - x.mean(0, keepdims=True)


def _basis(a, periods, a_max, sine: bool = True, cosine: bool = True, ones: bool = True, scale: bool = True):
    x = np.asarray(a, dtype=np.float64)
    cols = [x / a_max if scale else x]
    for T in periods:
        cols += ([np.cos(2 * np.pi * x / T)] if cosine else []) + ([np.sin(2 * np.pi * x / T)] if sine else [])
    return np.stack(cols + ([np.ones_like(x)] if ones else []), 1)


def _normal_equations(b: np.ndarray, y: np.ndarray) -> np.ndarray:
    """C from BᵀB C = Bᵀy: it keeps the float noise of the sin(2πa/2) column as a regressor."""
    return np.linalg.solve(b.T @ b, b.T @ y)


def _lstsq(b: np.ndarray, y: np.ndarray) -> np.ndarray:
    return np.linalg.lstsq(b, y, rcond=None)[0]


def _fit(x, a, periods, n_pca, a_max, ones=True, add_mean=True, pca=True, back=True, solve=_lstsq):
    mu = x.mean(0)
    _, _, vt = np.linalg.svd(x - mu, full_matrices=False)
    v = vt[:n_pca] if pca else np.eye(x.shape[1])
    b = _basis(a, periods, a_max, ones=ones)
    c = solve(b, (x - mu) @ v.T)
    if not back:
        return b @ c
    return (mu if add_mean else 0.0) + b @ c @ v


def _grouped(b: np.ndarray) -> np.ndarray:
    """All cosines, then all sines (instead of cos and sin per period)."""
    return np.concatenate([b[:, :1], b[:, 1:-1:2], b[:, 2:-1:2], b[:, -1:]], 1)


@pytest.mark.toy_model
def test_representation_checks_pass_on_arithlib():
    rc.check_power_spectrum(FO.power_spectrum)
    rc.check_helix_basis(lambda a, periods, a_max: HX.helix_basis(a, periods, a_max))
    rc.check_fit_helix(lambda x, a, periods, n_pca, a_max: HX.fit_helix(x, a, periods, n_pca, a_max).predict(a))
    rc.check_fit_helix(_fit)  # the literal recipe of the exercise


@pytest.mark.toy_model
def test_representation_checks_reject_wrong_answers():
    def power(x):
        return np.abs(np.fft.rfft(_centred(x), axis=0)) ** 2

    for wrong, message in (
        (lambda x: (np.abs(np.fft.rfft(_centred(x), axis=1)) ** 2).sum(0), "wrong axis"),
        (lambda x: (np.abs(np.fft.rfft(_centred(x), axis=1)) ** 2).sum(1), "wrong axis"),
        (lambda x: (np.abs(np.fft.rfft(x, axis=0)) ** 2).sum(1), "removing each dimension's mean"),
        (lambda x: np.abs(np.fft.rfft(_centred(x), axis=0)).sum(1), "amplitude"),
        (lambda x: (np.abs(np.fft.fft(_centred(x), axis=0)) ** 2).sum(1), "full DFT"),
        (lambda x: (np.abs(np.fft.rfft(_centred(x), axis=0, norm="ortho")) ** 2).sum(1), "normalised DFT"),
        (lambda x: power(x).sum(1)[: len(x) // 2], "N//2 inclusive"),
        (lambda x: power(x).sum(1) * 2, "times it"),
    ):
        with pytest.raises(rc.CheckFailed, match=message):
            rc.check_power_spectrum(wrong)

    for wrong, message in (
        (lambda a, p, m: _basis(a, p, m, sine=False), "sine"),
        (lambda a, p, m: _basis(a, p, m, ones=False), "no intercept"),
        (lambda a, p, m: _basis(a, p, m, scale=False), "not divided by a_max"),
        (lambda a, p, m: _basis(a, p, float(np.max(a))), "max\\(a\\)"),
        (lambda a, p, m: _grouped(_basis(a, p, m)), "side by side"),
        (lambda a, p, m: _basis(a, p, m).T, "transposed"),
    ):
        with pytest.raises(rc.CheckFailed, match=message):
            rc.check_helix_basis(wrong)

    def swapped_angle(a, p, m):
        x = np.asarray(a, dtype=np.float64)
        with np.errstate(divide="ignore", invalid="ignore"):
            cols = [x / m] + [f(2 * np.pi * T / x) for T in p for f in (np.cos, np.sin)]
        return np.stack(cols + [np.ones_like(x)], 1)

    with pytest.raises(rc.CheckFailed, match="denominator"):
        rc.check_helix_basis(swapped_angle)

    for wrong, message in (
        (lambda x, a, p, n, m: _fit(x, a, p, n, m, ones=False), "intercept"),
        (lambda x, a, p, n, m: _fit(x, a, p, n, m, add_mean=False), "add the mean"),
        (lambda x, a, p, n, m: _fit(x, a, p, n, m, pca=False), "whole space"),
        (lambda x, a, p, n, m: _fit(x, a, p, n, m, back=False), "principal-component coordinates"),
        (lambda x, a, p, n, m: _fit(x, a, p, n, m, solve=_normal_equations), "float noise"),
    ):
        with pytest.raises(rc.CheckFailed, match=message):
            rc.check_fit_helix(wrong)
