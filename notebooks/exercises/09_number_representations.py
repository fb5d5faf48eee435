# %% [markdown]
# # Exercise 09 · Are the numbers Fourier features on a helix?
#
# The teaching companion of `notebooks/09_number_representations.ipynb`. The three reproduced
# papers stop at components (heads, MLPs, neurons); two later papers look at how the numbers
# themselves are laid out in the model's vectors. Zhou et al. (2024) line the number tokens up in
# order and find that the embeddings are *sparse in the frequency domain*: besides low
# frequencies (the size of a number), peaks at periods 2, 2.5, 5 and 10 (the number modulo 2, 5
# and 10). Kantamneni & Tegmark (2025) model number a as a *generalized helix*, a linear image of
# B(a) = [a, cos(2πa/T), sin(2πa/T) for T in 2, 5, 10, 100], fitted by least squares in the top
# principal components of the activations. You write three pieces of that analysis, which
# notebook 09 gets from `arithlib.representations` (the formulas are in
# `docs/representations.md`, "Spectrum" and "The two papers in brief"):
#
# 1. the **Fourier power spectrum** of a number representation along the number axis, and
#    which periods stand out against the same matrix with its numbers shuffled;
# 2. the **helix basis** B(a);
# 3. the **helix fit**: PCA, then least squares on B(a), mapped back to the model's space;
#    then its R² beside a PCA subspace of the same dimension.
#
# Everything runs on the toy model (`toy-arith`: 2 layers, d_model 128, one token per integer
# 0..999). Its number embeddings *started* as Fourier features of periods 2 to 1000
# (`number_init = "fourier"` in `arithlib.core.toy`) before training: keep that in mind when you
# read what stands out.

# %%
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import torch

import arithlib.course.representation_checks as ex
import arithlib.representations.helix as HX

torch.set_grad_enabled(False)
torch.set_num_threads(1)  # the toy model is tiny: one thread runs it fastest, most of all on a busy machine
data = ex.representation_data()
E = data.embedding  # [1000, d]: the embedding rows of the number tokens 0..999, in order
print(f"embedding {E.shape}; activations {data.acts.shape} (prompts, layers {data.layers}, d) at a's token")
print(f"prompts a+b= with a = 0..{ex.MAX_OPERAND} and b in {sorted(set(data.b.tolist()))}")

# %% [markdown]
# ## 1 · The Fourier power spectrum of the numbers
# > **Objective** read a number representation as signals over the numbers and find its periods with a Fourier transform · **Difficulty** ●●○○○ · **Importance** ●●●●○ · **Time** 15 min
#
# A representation of the numbers 0..N−1 is a matrix X [N, d]: row n is number n's vector.
# Each column j is a signal over the numbers. Remove its mean over the numbers, take its
# discrete Fourier transform along the number axis and sum the power over the columns:
#
# F[k, j] = Σ_n (X[n, j] − mean_n X[·, j]) e^{−2πikn/N},  P[k] = Σ_j |F[k, j]|²,  k = 0..N//2.
#
# Frequency k has period N / k (k = N/10: period 10, the last digit). Use the plain,
# unnormalised DFT. Removing the mean makes P[0] = 0.


# %%
def power_spectrum(X: np.ndarray) -> np.ndarray:
    """P[k], k = 0..N//2: the Fourier power of the rows of ``X`` [N, d] along the number axis,
    each column's mean removed first, summed over the columns."""
    # BEGIN SOLUTION
    # HINT: `np.fft.rfft(x, axis=0)` transforms every column along the rows and keeps k = 0..N//2
    # HINT: subtract `X.mean(0, keepdims=True)` first; the power is `np.abs(F) ** 2`, summed over `axis=1`
    x = np.asarray(X, dtype=np.float64)
    x = x - x.mean(0, keepdims=True)
    return (np.abs(np.fft.rfft(x, axis=0)) ** 2).sum(1)
    # END SOLUTION


# %%
ex.check_power_spectrum(power_spectrum)

# %% [markdown]
# Which periods stand out? Each frequency's share of the power (k ≥ 1), against the **null**:
# the same matrix with its rows (the numbers) shuffled, which keeps every column's values and
# spreads their power over all frequencies (mean of 50 shuffles). The embedding of 0..999, and
# the residual stream entering each layer at a's token, averaged per number (0..99).


# %%
def spectrum_vs_null(X: np.ndarray, n_shuffles: int = 50, seed: int = 0) -> pd.DataFrame:
    """Per frequency k >= 1: its period, its share of the power and the shuffled null's mean share."""
    p = power_spectrum(X)
    rng = np.random.default_rng(seed)
    null = np.zeros(len(p) - 1)
    for _ in range(n_shuffles):
        q = power_spectrum(X[rng.permutation(len(X))])
        null += q[1:] / q[1:].sum() / n_shuffles
    k = np.arange(1, len(p))
    share = p[1:] / p[1:].sum()
    return pd.DataFrame({"k": k, "period": len(X) / k, "share": share, "null": null, "excess": share / null})


spectra = {"embedding 0..999": spectrum_vs_null(E)}
spectra |= {
    f"resid entering layer {L}, 0..99": spectrum_vs_null(data.number_means(j)) for j, L in enumerate(data.layers)
}
top = pd.concat(
    {name: s.sort_values("share", ascending=False).head(6).reset_index(drop=True) for name, s in spectra.items()}
)
fig, axes = plt.subplots(1, len(spectra), figsize=(4 * len(spectra), 3), sharey=True)
for ax, (name, s) in zip(axes, spectra.items()):
    ax.plot(s.period, s.share, ".-", lw=0.6, label="numbers in order")
    ax.plot(s.period, s.null, "k--", lw=0.8, label="numbers shuffled")
    ax.set(xscale="log", yscale="log", xlabel="period (numbers)", title=name)
axes[0].set(ylabel="share of the power")
axes[0].legend()
plt.tight_layout()
plt.show()
top.round(3)

# %% [markdown]
# ## 2 · The helix basis
# > **Objective** write the generalized helix of a number as a design matrix · **Difficulty** ●○○○○ · **Importance** ●●●○○ · **Time** 10 min
#
# Kantamneni & Tegmark write number a as a linear image of
#
# B(a) = [a / a_max, cos(2πa/T₁), sin(2πa/T₁), …, cos(2πa/T_P), sin(2πa/T_P), 1]
#
# one row per number: the linear term a scaled by a_max (not centred), then for each period T
# in turn its cosine and its sine (a circle of period T), then a column of ones, the
# intercept of the least squares in exercise 3. Note that on integers sin(2πa/2) = 0: that
# column is empty (the paper's basis has it too).


# %%
def helix_basis(a: np.ndarray, periods: list[float], a_max: float) -> np.ndarray:
    """B(a) [n, 2P + 2]: a / a_max, cos and sin of 2πa/T for each period T, then ones."""
    # BEGIN SOLUTION
    # HINT: build a list of columns: `[a / a_max]`, then for each `T` both `np.cos(2 * np.pi * a / T)` and `np.sin(...)`, then `np.ones(len(a))`
    # HINT: `np.stack(columns, axis=1)` gives one row per number
    x = np.asarray(a, dtype=np.float64)
    cols = [x / a_max]
    for T in periods:
        cols += [np.cos(2 * np.pi * x / T), np.sin(2 * np.pi * x / T)]
    cols.append(np.ones_like(x))
    return np.stack(cols, 1)
    # END SOLUTION


# %%
ex.check_helix_basis(helix_basis)

# %% [markdown]
# ## 3 · The helix fit
# > **Objective** fit the helix to activations by least squares in their principal components · **Difficulty** ●●●○○ · **Importance** ●●●●○ · **Time** 20 min
#
# The fit, as the authors' code does it: centre the activations X [n, d] (mean μ over the
# rows), project them on their top `n_pca` principal directions V [p, d] (the first rows of
# Vᵀ in the SVD of X − μ), regress those coordinates Y = (X − μ) Vᵀ on B(a) by least
# squares, Y ≈ B(a) C, and map the fit back to the model's space:
#
# X̂ = μ + B(a) C V.
#
# Return X̂ [n, d]. Use your `helix_basis`, with its column of ones: the intercept. The
# column sin(2πa/2) is zero on integers, so B has one column too many for its rank: solve
# with a least squares that drops it.


# %%
def fit_helix(X: np.ndarray, a: np.ndarray, periods: list[float], n_pca: int, a_max: float) -> np.ndarray:
    """The helix fit μ + B(a) C V [n, d] of the activations ``X`` [n, d] of the numbers ``a`` [n],
    in the top ``n_pca`` principal components of X."""
    # BEGIN SOLUTION
    # HINT: `mu = X.mean(0)`; `_, _, vt = np.linalg.svd(X - mu, full_matrices=False)`; `V = vt[:n_pca]`
    # HINT: `C = np.linalg.lstsq(B, Y, rcond=None)[0]`; it treats the sin(2πa/2) column (about 1e-14 in floating point, not exactly 0) as empty, which `pinv`, QR and the normal equations do not
    x = np.asarray(X, dtype=np.float64)
    mu = x.mean(0)
    _, _, vt = np.linalg.svd(x - mu, full_matrices=False)
    V = vt[:n_pca]
    B = helix_basis(a, periods, a_max)
    C, *_ = np.linalg.lstsq(B, (x - mu) @ V.T, rcond=None)
    return mu + B @ C @ V
    # END SOLUTION


# %%
ex.check_fit_helix(fit_helix)

# %% [markdown]
# How much of the activations does the helix explain? Its R² (one minus the residual sum of
# squares over the total, over all dimensions), beside the projection on the top 2P + 1 = 9
# principal components (plus the mean), on a random 9-dimensional subspace, and the helix with
# one period left out. One row per prompt "a+b=" (a = 0..99), the residual stream at a's token.

# %%
periods = [2, 5, 10, 100]
k = HX.helix_dim(periods)
rows = []
for j, L in enumerate(data.layers):
    X = data.acts[:, j]
    mean, comps = HX.pca(X, k)
    row = {
        "layer": L,
        "helix": HX.r2(X, fit_helix(X, data.a, periods, 100, ex.MAX_OPERAND)),
        f"PCA-{k}": HX.r2(X, HX.subspace_projection(X, mean, comps)),
        f"random-{k}": HX.r2(X, HX.subspace_projection(X, mean, HX.random_subspace(X.shape[1], k, seed=L))),
    }
    for T in periods:
        rest = [t for t in periods if t != T]
        row[f"helix without {T}"] = HX.r2(X, fit_helix(X, data.a, rest, 100, ex.MAX_OPERAND))
    rows.append(row)
pd.DataFrame(rows).set_index("layer").round(3)

# %% [markdown]
# **Questions.** (a) Which periods stand out in the embedding of 0..999, and which in the
# residual stream of 0..99? Why can the toy model's embedding not tell us whether training
# *discovers* Fourier features? (b) In the 0..99 spectra, period 2.5 (k = 40) is one of Zhou's
# periods. Why does a representation built from periods 2, 5, 10 and 100 show no peak there?
# (c) The PCA subspace of the helix's dimension explains more of the activations than the
# helix. Why must it (in sample), and why do Kantamneni & Tegmark still prefer the helix
# (think of what each needs to produce the vector of a number a′)? (d) Does the fit depend
# on a_max? Why, or why not?

# %% [markdown] tags=["solution"]
# **Answers.** (a) The embedding of 0..999 puts 88 % of its power on exactly the nine periods
# it was initialised with (out of 500 frequencies): period 2 holds 17 % (81 times its shuffled
# share), 1000, 500, 5, 100, 200, 20, 50 and 10 hold 8 to 13 % each (40 to 65 times the null);
# every other frequency is at or below the null. The residual stream entering layer 0 is the
# embedding itself (a's token has no position added), so its 0..99 spectrum is the
# embedding's: period 100 (39 %, 20 times the null), 2 (17 %), 5 (12 %), 50 (10 %), 20 and 10
# (6 to 7 %). Entering layer 1 the low frequencies keep their lead (period 100 30 %, 50 10 %,
# 33 9 %, 25 6 %), period 2 stays (11 %, 5 times the null), period 5 weakens (5 %) and period 10
# falls to the null (2 %). Since the features were planted at initialisation, finding them
# after training does not show that training discovers them; Zhou et al.'s claim about
# that needs a model trained from unordered embeddings (`number_init = "random"`).
# (b) A pure cosine of period 5 has power at k = 20 only (over 0..99). Period 2.5 (k = 40)
# is the second harmonic of period 5: a general function of n mod 5 needs both, and Zhou
# et al.'s models have it, but the toy model was given cos and sin of period 5 alone. Its
# share at k = 40 is 0.3 % entering layer 0 (0.16 times the null) and 2 % entering layer 1
# (0.93 times, the null level). (c) The projection on the top k principal components is
# the best rank-k approximation of the centred activations (Eckart–Young), and the helix fit
# is one rank-k approximation, so in sample PCA must win: 0.88 against 0.79 entering layer 0,
# 0.98 against 0.50 entering layer 1 (a random 9-dimensional subspace: 0.06). The gap at
# layer 1 is not noise: b comes after a, so the prompts of one a give the same vector and a
# function of a could reach R² = 1. What the helix misses is mostly a smoother, curved
# magnitude (the periods 50, 33 and 25 of the spectrum): with periods 50, 33⅓, 25 and 20
# added to the basis its R² rises from 0.50 to 0.81. The PCA
# projection needs the activation of a′ itself; the helix writes a′'s vector from the number
# a′ alone, so only the helix tests the claim "the model represents a as this function of a"
# when it is patched in. Leaving out period 100 costs the most (0.79 → 0.56 and
# 0.50 → 0.38). (d) No: with an intercept in the basis, rescaling the linear column (a / a_max
# instead of a) only rescales its coefficient, and the fitted values stay the same. a_max
# changes the coefficients C, not the fit.
