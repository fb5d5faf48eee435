"""Notebook 09's computations on cases with a known answer: Fourier spectra and filters
(:mod:`arithlib.representations.fourier`), the helix fit and its patch values (:mod:`arithlib.representations.helix`),
the bridge's direction shares and rule frequencies (:mod:`arithlib.representations.passes`);
each fast path against a literal implementation; and the report's 09 findings on a
folder without notebook 09 (not run)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import arithlib.representations.fourier as FO
import arithlib.representations.helix as HX
import arithlib.representations.passes as RP
from arithlib.core.papers import KT_PERIODS, ZHOU_PERIODS


def _periodic(n: int, d: int, ks: dict[int, float], seed: int = 0) -> np.ndarray:
    """X [n, d]: each frequency k with amplitude ks[k], written into random directions."""
    rng = np.random.default_rng(seed)
    t = np.arange(n)
    X = np.zeros((n, d))
    for k, amp in ks.items():
        X += amp * np.outer(np.cos(2 * math.pi * k * t / n), rng.standard_normal(d))
        X += amp * np.outer(np.sin(2 * math.pi * k * t / n), rng.standard_normal(d))
    return X


# --------------------------------------------------------------------------- spectra


def test_spectrum_of_a_pure_frequency_is_all_at_that_frequency():
    X = _periodic(100, 16, {10: 1.0}) + 3.0  # a constant offset lands in DC, which is dropped
    share = FO.spectrum_shares(FO.power_spectrum(X))
    assert share[10] == pytest.approx(1.0)
    assert np.delete(share, 10).sum() == pytest.approx(0.0, abs=1e-12)
    assert FO.periods(100)[10] == pytest.approx(10.0)


def test_power_spectrum_equals_the_literal_dft():
    X = np.random.default_rng(1).standard_normal((30, 5))
    x = X - X.mean(0)
    n = np.arange(30)
    literal = [
        sum(abs(sum(x[m, j] * np.exp(-2j * math.pi * k * m / 30) for m in n)) ** 2 for j in range(5)) for k in range(16)
    ]
    assert np.allclose(FO.power_spectrum(X), literal)
    assert np.allclose(FO.power_by_dimension(X).sum(1), literal)


def test_spectrum_table_beats_the_shuffled_null_only_where_the_power_is():
    X = _periodic(100, 32, {50: 1.0, 20: 1.0, 1: 2.0}, seed=2)
    t = FO.spectrum_table(X, n_shuffles=100, seed=0)
    strong = set(t[t.share > t.null_q95].k)
    assert strong == {1, 20, 50}
    assert t.set_index("k").band[1] == "low" and t.set_index("k").band[20] == "high"
    assert FO.frequencies_of_periods(100, ZHOU_PERIODS) == [10, 20, 40, 50]
    assert FO.frequencies_of_periods(10, (2, 2.5, 5, 10, 3)) == [1, 2, 4, 5]


def test_bands_and_harmonics():
    b = FO.frequency_bands(1000, 20)
    assert b["low"] == list(range(1, 51)) and b["high"] == list(range(51, 501))
    assert FO.frequency_bands(10, 20) == {"low": [1], "high": [2, 3, 4, 5]}
    assert FO.harmonics(100, 10) == [10, 20, 30, 40, 50]
    assert FO.harmonics(100, 2) == [50]


def test_set_share_of_the_named_frequencies():
    X = _periodic(100, 8, {10: 1.0, 3: 1.0}, seed=3)
    p = FO.power_by_dimension(X)
    assert FO.set_share(p, [10]) + FO.set_share(p, [3]) == pytest.approx(1.0)


# --------------------------------------------------------------------------- filters


def _unembed(n: int, d: int, seed: int = 0) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).standard_normal((n, d)))


def test_filter_removes_exactly_a_pure_frequency_signal():
    """N <= d: a vector whose number-logit profile is a pure frequency k is removed
    entirely when k is filtered and left unchanged when another frequency is."""
    U = _unembed(20, 32)
    B = FO.fourier_basis(20, [3])
    h = (torch.linalg.pinv(U) @ (B[:, 0] * 2.0 + B[:, 1] * 0.5))[None]
    assert torch.allclose(FO.number_space_filter(h, U, [3]), torch.zeros_like(h), atol=1e-10)
    assert torch.allclose(FO.number_space_filter(h, U, [5, 7]), h, atol=1e-10)
    assert torch.allclose(FO.number_space_filter(h, U, [5, 7]) @ U.T, h @ U.T, atol=1e-10)


def test_filtered_profile_has_no_power_in_the_removed_band():
    U = _unembed(20, 32, seed=1)
    h = torch.from_numpy(np.random.default_rng(2).standard_normal((4, 32)))
    out = FO.number_space_filter(h, U, [1, 2, 3])
    spec = np.stack([FO.power_spectrum((out @ U.T)[i].numpy()[:, None]) for i in range(4)])
    assert np.abs(spec[:, 1:4]).max() < 1e-16 * max(1.0, np.abs(spec).max()) + 1e-18


def test_filter_matrix_and_hook_equal_the_literal_filter():
    U = _unembed(30, 16, seed=3)  # more numbers than dimensions: the least-squares removal
    h = torch.from_numpy(np.random.default_rng(4).standard_normal((3, 5, 16)))
    R = FO.filter_matrix(U, [2, 9])
    assert torch.allclose(h @ R.T, FO.number_space_filter(h, U, [2, 9]), atol=1e-10)
    ((name, fn),) = FO.filter_hooks(["x"], R)
    out = fn(h.clone(), None)
    assert torch.allclose(out[:, -1], FO.number_space_filter(h[:, -1], U, [2, 9]), atol=1e-10)
    assert torch.equal(out[:, :-1], h[:, :-1])


def test_fourier_basis_is_orthonormal_with_nyquist_and_dc():
    B = FO.fourier_basis(10, [0, 1, 5])
    assert B.shape == (10, 4)
    assert torch.allclose(B.T @ B, torch.eye(4, dtype=B.dtype), atol=1e-12)


# --------------------------------------------------------------------------- the helix


def _helix_data(n_per: int = 3, d: int = 64, noise: float = 0.0, seed: int = 0):
    rng = np.random.default_rng(seed)
    a = np.repeat(np.arange(100), n_per)
    C = rng.standard_normal((HX.helix_dim(KT_PERIODS) + 1, d))
    X = HX.helix_basis(a, a_max=99) @ C + noise * rng.standard_normal((len(a), d))
    return a, X, C


def test_a_known_helix_is_recovered():
    a, X, _ = _helix_data()
    fit = HX.fit_helix(X, a, a_max=99)
    assert np.allclose(fit.predict(a), X, atol=1e-8)
    assert HX.r2(X, fit.predict(a)) == pytest.approx(1.0)
    # numbers never seen in the fit are predicted too: the helix is a function of a
    keep = a % 7 != 0
    held = HX.fit_helix(X[keep], a[keep], a_max=99)
    assert np.allclose(held.predict(a[~keep]), X[~keep], atol=1e-8)


def test_fit_helix_equals_the_literal_per_coordinate_regression():
    a, X, _ = _helix_data(noise=0.3, seed=1)
    fit = HX.fit_helix(X, a, n_pca=20, a_max=99)
    assert np.allclose(fit.predict(a), HX.fit_helix_literal(X, a, n_pca=20, a_max=99), atol=1e-8)


def test_dropping_a_period_loses_exactly_its_part():
    rng = np.random.default_rng(2)
    a = np.repeat(np.arange(100), 2)
    d = 40
    X = np.outer(np.cos(2 * math.pi * a / 10), rng.standard_normal(d)) + np.outer(a / 99, rng.standard_normal(d))
    assert HX.r2(X, HX.fit_helix(X, a, (2, 5, 100), a_max=99).predict(a)) < 0.9
    assert HX.r2(X, HX.fit_helix(X, a, (2, 5, 10, 100), a_max=99).predict(a)) == pytest.approx(1.0)


def test_patch_values_of_a_pure_helix():
    """On an exact helix the helix fit reproduces the source activation, so its patch is
    the layer patch; a PCA of the helix's own dimension does too; a random subspace of
    that size does not."""
    a, X, _ = _helix_data(n_per=2, d=64)
    src = np.arange(0, len(a), 7)
    v = HX.patch_values(X[src], a[src], X, a, a_max=99)
    assert np.allclose(v["helix"], v["layer"], atol=1e-8)
    assert np.allclose(v["pca"], v["layer"], atol=1e-8)
    assert not np.allclose(v["random"], v["layer"], atol=1e-3)
    assert set(v) == {"layer", "helix", "pca", "random"} | {f"helix without {T:g}" for T in KT_PERIODS}
    assert HX.restored_share(np.array([1.0, 3.0]), np.array([2.0, 2.0])) == pytest.approx(1.0)


def test_subspace_projection_and_random_subspace():
    Q = HX.random_subspace(12, 3, seed=0)
    assert np.allclose(Q @ Q.T, np.eye(3), atol=1e-12)
    x = np.random.default_rng(0).standard_normal((5, 12))
    mean = np.zeros(12)
    proj = HX.subspace_projection(x, mean, Q)
    assert np.allclose(HX.subspace_projection(proj, mean, Q), proj)


def test_neuron_fit_recovers_a_neuron_built_from_the_helix_terms():
    rng = np.random.default_rng(3)
    a, b = rng.integers(0, 100, 600), rng.integers(0, 100, 600)
    good = np.cos(2 * math.pi * (a + b) / 10) + 0.5 * (a + b) / 198
    noise = rng.standard_normal(600)
    r2 = HX.neuron_fit_r2(np.stack([good, noise], 1), a, b)
    assert r2[0] == pytest.approx(1.0, abs=1e-9)
    assert r2[1] < 0.1


# --------------------------------------------------------------------------- the bridge


def test_direction_share_and_rule_frequencies():
    U = _unembed(10, 32, seed=5)
    bands = FO.frequency_bands(10)
    assert RP.rule_frequencies("op1 = 1 mod 2", "operand_mod", 10, bands) == [5]
    assert RP.rule_frequencies("op2 in [2, 6]", "operand_range", 10, bands) == [1]
    assert RP.rule_frequencies("result = 3 mod 10", "result_mod", 100, FO.frequency_bands(100)) == [10, 20, 30, 40, 50]
    Q = RP.fourier_directions(U, [2])
    assert Q.shape == (32, 2)
    inside = (Q @ torch.tensor([1.0, -2.0], dtype=Q.dtype))[None]
    assert RP.direction_share(inside, Q)[0] == pytest.approx(1.0)
    outside = torch.from_numpy(np.random.default_rng(0).standard_normal((1, 32)))
    outside = outside - (outside @ Q) @ Q.T
    assert RP.direction_share(outside, Q)[0] == pytest.approx(0.0, abs=1e-12)


def test_mean_by_number():
    nums, means = RP.mean_by_number(np.array([[1.0], [3.0], [10.0]]), [2, 2, 0])
    assert nums.tolist() == [0, 2] and means[:, 0].tolist() == [10.0, 2.0]


# --------------------------------------------------------------------------- the report


def test_report_findings_of_09_are_not_run_without_its_tables(tmp_path):
    from arithlib.report.findings import FINDINGS, judge
    from arithlib.report.tables import NOT_RUN, Tables

    for f in FINDINGS:
        if f.notebook == "09":
            out = judge(f, Tables(tmp_path))
            assert out.verdict in (NOT_RUN, "not applicable"), (f.id, out)
    kt = next(f for f in FINDINGS if f.id == "kantamneni_helix_patch")
    assert judge(kt, Tables(tmp_path)).verdict == NOT_RUN


def test_helix_basis_is_exact_at_quarter_turns():
    """sin(2 pi a / 2) of an integer a is exactly 0 (the fit does not depend on lstsq
    recognising a 1e-14 column as noise); elsewhere the basis is the plain cos and sin."""
    a = np.arange(200)
    B = HX.helix_basis(a, (2, 5, 10, 100), a_max=199)
    assert np.all(B[:, 2] == 0.0) and set(np.unique(B[:, 1])) == {-1.0, 1.0}
    assert B[25, 8] == 1.0 and B[50, 7] == -1.0  # a quarter and half turn of period 100
    for j, T in enumerate((2, 5, 10, 100)):
        np.testing.assert_allclose(B[:, 1 + 2 * j], np.cos(2 * np.pi * a / T), atol=1e-12)
        np.testing.assert_allclose(B[:, 2 + 2 * j], np.sin(2 * np.pi * a / T), atol=1e-12)
    assert np.linalg.matrix_rank(B) == B.shape[1] - 1  # the sin of period 2 is the one empty column
