# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 09 · Number representations: Fourier features, the helix, and the heuristic neurons that read them
#
# **Results** (qwen2.5-coder-0.5b, the committed run): [this notebook executed, with its outputs](../figures/qwen2.5-coder-0.5b/notebooks/09_number_representations.ipynb) · [its section of the report](../figures/qwen2.5-coder-0.5b/REPORT.md#notebook-09)
#
# **Running it.** Run as it is (Run All) this notebook writes to `outputs/scratch/figures/<model>/`
# (first made as a copy of the committed `figures/<model>/`, whose notebook-03 tables it reads),
# never to the committed `figures/`. On qwen2.5-coder-0.5b (2-core CPU) it takes about 14 minutes
# (832 s in the committed run, two torch threads;
# [docs/representations.md](../docs/representations.md#cost)); the toy model's quick run takes
# about a minute. For a short run set `model = "toy-arith"` and `quick = True`. Every long
# section is stored (`use_cache`), so a stopped run resumes where it stopped. Only
# `./run_all.sh` writes the committed figures.
#
# **Question.** The three papers this repository reproduces stop at components (heads, MLPs,
# neurons). Two later papers look at the numbers themselves. Zhou et al. (2024, NeurIPS,
# arXiv:2406.03445) find that a pre-trained model's number representations are *sparse in
# the frequency domain*: periods such as 2, 5 and 10 (the answer modulo 2, 5, 10) beside
# low frequencies (magnitude); MLPs mostly use the low ones and attention the high ones; a
# model trained from scratch uses only low frequencies. Kantamneni & Tegmark (2025,
# arXiv:2502.00873) find that number a is a *generalized helix*, a linear image of
# B(a) = [a, cos(2πa/T), sin(2πa/T) for T in (2, 5, 10, 100)], and that patching a layer's
# activation by its helix fit restores most of what patching the whole layer restores.
# Do these models represent numbers that way, and are Nikankin's heuristic neurons
# (notebook 03) reading such a periodic representation?
#
# **Method** (`arithlib.representations.fourier`, `arithlib.representations.helix`, `arithlib.representations`; the summary is
# in [docs/representations.md](../docs/representations.md)).
# 1. *Spectra.* For the numbers that are one token (toy model: 0..999; the per-digit models:
#    0..9), the Fourier power of the embedding along the number axis,
#    P[k] = Σ_j |Σ_n (X[n, j] - mean) e^{-2πikn/N}|², as a share of the non-DC power, against the
#    same matrix with its rows shuffled. Then the residual stream entering every layer at a's
#    last token on prompts "a+b=" (a = 0..`max_operand`, averaged over `n_fit_b` values of b):
#    on the per-digit models this is the last digit of a multi-digit number, the case
#    neither paper covers.
# 2. *Helix fit and its patch* (Kantamneni & Tegmark's protocol, as their code): per layer,
#    PCA to `n_pca` components, then least squares on B(a). On a clean prompt "a+b=" the
#    residual stream at a's last token is replaced by (layer) the activation of "a'+b=", (helix)
#    the helix fit of a', (pca) that activation's projection on the top k = 2P + 1 principal
#    components, (random) on a random k-dimensional subspace, (helix without T) the fit
#    without period T. Effect = logit of a' + b's first token, patched minus clean; share
#    restored = mean effect / mean effect of the layer patch, 95 % bootstrap interval over
#    prompt pairs. The fit uses other values of b than the patched prompts.
# 3. *Filters* (Zhou et al.): the MLP or attention outputs at the answer position, in every
#    layer, lose their low- or high-frequency components in the number-logit space
#    (h' = h - U⁺ B_S B_Sᵀ U h, U the number tokens' unembedding); first-token accuracy, and
#    whether the answer's last digit survives.
# 4. *The bridge.* For notebook 03's circuit neurons that match a heuristic (operator +): the
#    share of their input weight in the Fourier directions their rule reads ("= r mod m":
#    the harmonics of period m; a range rule: the low band), divided by the same share of
#    random neurons of the same layer; and each neuron's activation regressed on
#    [B(a), B(b), B(a + b)] (the paper's neuron fits), held-out R², against random neurons.
#
# ### Where this differs from the papers
# - **Models.** GPT-2-XL fine-tuned (Zhou) and GPT-J, Pythia-6.9B, Llama-3.1-8B (Kantamneni &
#   Tegmark) have one token per number up to 99 or more; here the toy model (one token per
#   number, trained from scratch here, but with number embeddings that *start* as Fourier
#   features, `number_init = "fourier"` in `arithlib.core.toy`) and per-digit models, where a number
#   is read at its last digit.
# - **Filters.** Zhou et al. filter in the logit space of their number tokens; with more
#   number tokens than model dimensions (the toy model: 1000 and 128) the removal is the
#   least-squares one. The per-digit models' number space has 10 tokens: its "low" band is
#   the single period 10.
# - **Neuron fits** use the neuron's activation (what notebook 03 reads), not the
#   preactivation: gated MLPs have two.
# - **Patched prompts** are answered correctly (first token) in both the clean and the source
#   form; the source answer's first token differs from the clean one's.

# %% tags=["parameters"]
model = "qwen2.5-coder-0.5b"
device = "cpu"
dtype = "auto"  # "auto": bfloat16 on a GPU, float32 on a CPU; or "float32", "bfloat16"
device_map = None  # None: the whole model on `device`; "auto", "balanced" or {module: device} splits it across GPUs
quick = False
seed = 0
out_dir = "../outputs/scratch/figures"  # run_all.sh passes the committed figures/ (or its own scratch)
fewshot = 2  # solved examples in the prefix of every prompt
threads = 0  # torch CPU threads (0: torch's default)
max_operand = 99  # numbers a = 0..max_operand (Kantamneni and Tegmark: 0..99)
n_fit_b = 8  # values of b in the prompts the spectra and the helix are fitted on
n_patch_b = 8  # other values of b in the patched prompts
n_pairs = 100  # patched pairs (a, a2, b) (Kantamneni and Tegmark: 100 per layer)
periods = [2, 5, 10, 100]  # helix periods (Kantamneni and Tegmark)
n_pca = 100  # principal components the helix is fitted in (their NUM_PCA)
n_shuffles = 200  # shuffled-number null of each spectrum
low_min_period = 20  # a frequency is "low" when its period is at least this (ours, stated in advance)
n_filter = 400  # prompts of the filter runs
n_neuron_fit = 1000  # prompts a+b= that the neuron fits use
n_random_neurons = 64  # random neurons per layer: the bridge's null
batch_size = 64
use_cache = True  # store each long section in ~/.cache/arithlib/sections: a stopped run resumes there

# %%
import time

import numpy as np
import pandas as pd
import torch
from IPython.display import Markdown, display

import arithlib.core.stats as S
import arithlib.methods.neurons as N
import arithlib.plots.representations as plots
import arithlib.report as R
import arithlib.representations.fourier as FO
import arithlib.representations.helix as HX
import arithlib.representations.passes as RP
from arithlib.core.papers import ZHOU_PERIODS
from arithlib.core.prompt_sets import PromptSet, single_token_max
from arithlib.run.floor import Sections
from arithlib.run.outputs import find_table, read_table, save_figure, save_table
from arithlib.run.paths import cache_root
from arithlib.run.runs import start_run
from arithlib.run.stored import Store

t_start = time.time()
if threads:
    torch.set_num_threads(threads)
if quick:
    n_fit_b, n_patch_b, n_pairs, n_shuffles, n_filter, n_neuron_fit, n_random_neurons = 4, 4, 48, 50, 100, 300, 16
if model == "toy-arith":  # how the number embeddings started: Fourier features planted at init, or pre-trained
    from arithlib.core.toy_data import ToyConfig

    number_init = ToyConfig().number_init
else:
    number_init = "pretrained"
run = start_run(
    "09_number_representations",
    model,
    device,
    seed,
    out_dir,
    quick,
    dtype=dtype,
    device_map=device_map,
    fewshot=fewshot,
    threads=threads,
    max_operand=max_operand,
    n_fit_b=n_fit_b,
    n_patch_b=n_patch_b,
    n_pairs=n_pairs,
    periods=periods,
    n_pca=n_pca,
    n_shuffles=n_shuffles,
    low_min_period=low_min_period,
    n_filter=n_filter,
    n_neuron_fit=n_neuron_fit,
    n_random_neurons=n_random_neurons,
    number_init=number_init,
)
bridge, tok, info = run.bridge, run.tokenizer, run.model.info
store = Store(cache_root() / "sections" / model.replace("/", "__") if use_cache else None)
timed = Sections.of_run(run, [store])  # each section's time and arithmetic against the peak (arithlib.run.floor)
rng = np.random.default_rng(seed)
single = single_token_max(tok)
run.record(single_token_max=single)
layers = list(range(info.n_layers))
print(info, f"| one token per number up to {single} | number embeddings: {number_init}")

# %% [markdown]
# ## 1 · Fourier spectra of the numbers
# The embedding of the single-token numbers, then the residual stream at a's last token,
# layer by layer. The prompts: a = 0..`max_operand`, b from `n_fit_b` values (fit) and
# `n_patch_b` other values (the patch of section 2); one pass records every layer.

# %%
timed.start()
b_all = rng.permutation(max_operand + 1)
fit_bs, patch_bs = sorted(b_all[:n_fit_b].tolist()), sorted(b_all[n_fit_b : n_fit_b + n_patch_b].tolist())
prompts = PromptSet.build(RP.addition_records(range(max_operand + 1), fit_bs + patch_bs, fewshot), tok)
pos = RP.last_token_positions(prompts)
acts, pred = store(
    "09 operand activations",
    lambda: RP.collect_at_positions(bridge, prompts, pos, layers, batch_size),
    code=[RP],
    model=bridge,
    prompts=prompts,
    layers=layers,
)
correct = (pred == prompts.first_answer_ids).numpy()
a_of = np.array([r.a for r in prompts.records])
b_of = np.array([r.b for r in prompts.records])
is_fit = np.isin(b_of, fit_bs)
timed.lap("activations")
print(f"{len(prompts)} prompts, first-token accuracy {correct.mean():.1%} (fit b: {fit_bs}; patch b: {patch_bs})")

# %%
timed.start()
ids = RP.number_ids(tok, range(single + 1))
E = RP.number_embeddings(bridge, ids).numpy()
spec = [FO.spectrum_table(E, n_shuffles, seed, low_min_period).assign(source="embedding", layer=-1, numbers=single + 1)]
for j, L in enumerate(layers):
    _, X = RP.mean_by_number(acts[is_fit, j], a_of[is_fit])
    spec.append(
        FO.spectrum_table(X, n_shuffles, seed, low_min_period).assign(
            source=f"resid {L}", layer=L, numbers=max_operand + 1
        )
    )
spectra = pd.concat(spec, ignore_index=True)
save_table(spectra, run.out, "09_spectra")
bands = spectra.groupby(["source", "layer", "band"], sort=False).agg(share=("share", "sum"), null=("null_mean", "sum"))
bands = bands.reset_index().pivot_table(index=["source", "layer"], columns="band", values=["share", "null"], sort=False)
bands.columns = [f"{v}_{b}" for v, b in bands.columns]
bands = bands.reset_index()
zhou = []
for src, sub in spectra.groupby("source", sort=False):
    ks = FO.frequencies_of_periods(int(sub.numbers.iloc[0]), ZHOU_PERIODS)
    zhou.append(
        {
            "source": src,
            "zhou_share": sub[sub.k.isin(ks)].share.sum(),
            "zhou_null": sub[sub.k.isin(ks)].null_mean.sum(),
            "zhou_ks": " ".join(map(str, ks)),
        }
    )
bands = bands.merge(pd.DataFrame(zhou), on="source")
# the embedding's share at Zhou's periods, with a 95 % interval by a bootstrap over embedding dimensions
pdim = FO.power_by_dimension(E)
zks = FO.frequencies_of_periods(single + 1, ZHOU_PERIODS)
emb_ci = S.bootstrap_ci(lambda cols: FO.set_share(pdim[:, cols], zks), np.arange(pdim.shape[1])) if zks else None
if emb_ci is not None:
    bands.loc[bands.source == "embedding", ["zhou_share_low", "zhou_share_high", "zhou_share_n"]] = [
        emb_ci.low,
        emb_ci.high,
        emb_ci.n,
    ]
save_table(bands, run.out, "09_band_shares")
save_figure(
    plots.spectra_plot(spectra, f"{model}: Fourier power of the numbers (dashed: shuffled null, 95th pct.)"),
    run.out,
    "09_spectra",
)
timed.lap("spectra")
bands.round(3)

# %% [markdown]
# ## 2 · The helix fit and its patch
# Fit per layer on the fit prompts answered correctly; patch on pairs of correctly answered
# prompts with the other values of b.

# %%
timed.start()
first = prompts.first_answer_ids.numpy()
cand = np.flatnonzero(~is_fit & correct)
by_key: dict[tuple, list[int]] = {}
for i in cand:
    by_key.setdefault((b_of[i], len(prompts.input_ids[i]), pos[i]), []).append(int(i))
pairs = []
for key, idx in by_key.items():
    for i in idx:
        others = [j for j in idx if a_of[j] != a_of[i] and first[j] != first[i]]
        if others:
            pairs.append((i, int(rng.choice(others))))
pairs = [pairs[i] for i in sorted(rng.choice(len(pairs), min(n_pairs, len(pairs)), replace=False))] if pairs else []
tgt_idx, src_idx = np.array([p[0] for p in pairs], dtype=int), np.array([p[1] for p in pairs], dtype=int)
targets = PromptSet.build([RP.with_answer(prompts.records[i], prompts.records[j].answer) for i, j in pairs], tok)
fit_rows = np.flatnonzero(is_fit & correct)
values, fits = {}, []
for j, L in enumerate(layers):
    v = HX.patch_values(
        acts[src_idx, j].numpy(),
        a_of[src_idx],
        acts[fit_rows, j].numpy(),
        a_of[fit_rows],
        periods,
        n_pca,
        seed=seed + L,
        a_max=max_operand,
    )
    for m, val in v.items():
        values.setdefault(m, {})[L] = val
    f = HX.fit_helix(acts[fit_rows, j].numpy(), a_of[fit_rows], periods, n_pca, a_max=max_operand)
    fits.append(
        {
            "layer": L,
            "r2_helix": HX.r2(acts[fit_rows, j].numpy(), f.predict(a_of[fit_rows])),
            "n_fit": len(fit_rows),
            "pca_components": f.components.shape[0],
        }
    )
save_table(pd.DataFrame(fits), run.out, "09_helix_fit")
patch = store(
    "09 helix patch",
    lambda: RP.helix_patching(bridge, targets, pos[tgt_idx], values, batch_size=16),
    code=[RP, HX],
    model=bridge,
    prompts=targets,
    values={m: {str(L): x for L, x in v.items()} for m, v in values.items()},
    positions=pos[tgt_idx],
)
patch["a"], patch["a_source"], patch["b"] = (
    a_of[tgt_idx][patch.prompt],
    a_of[src_idx][patch.prompt],
    b_of[tgt_idx][patch.prompt],
)
save_table(patch, run.out, "09_helix_patch_prompts")
summary = []
for (m, L), sub in patch.groupby(["method", "layer"], sort=False):
    lay = patch[(patch.method == "layer") & (patch.layer == L)].set_index("prompt").effect
    e = sub.set_index("prompt").effect.loc[lay.index]
    ci = S.bootstrap_ci(HX.restored_share, e.to_numpy(), lay.to_numpy())
    summary.append(
        {
            "method": m,
            "layer": L,
            "share": ci.estimate,
            "share_low": ci.low,
            "share_high": ci.high,
            "n": ci.n,
            "mean_effect": e.mean(),
            "layer_effect": lay.mean(),
            "accuracy_to_source": sub.correct.mean(),
        }
    )
summary = pd.DataFrame(summary)
save_table(summary, run.out, "09_helix_patch")
save_figure(
    plots.helix_patch_plot(summary, f"{model}: helix patch at a's last token ({len(pairs)} pairs)"),
    run.out,
    "09_helix_patch",
)
timed.lap("helix patch")
display(summary.pivot_table(index="layer", columns="method", values="share").round(2))

# %% [markdown]
# ## 3 · Low- and high-pass filters (Zhou et al.)

# %%
timed.start()
U = RP.number_unembedding(bridge, ids)
fbands = FO.frequency_bands(single + 1, low_min_period)
conditions = RP.filter_conditions(info.n_layers, U, fbands)
pool = np.flatnonzero(correct)
fsel = sorted(rng.choice(pool, min(n_filter, len(pool)), replace=False).tolist())
fprompts = prompts.subset(fsel)
number_of = {t: n for n, t in enumerate(ids)}
filt = store(
    "09 filters",
    lambda: RP.filtering_run(bridge, fprompts, conditions, number_of, batch_size),
    code=[RP, FO],
    model=bridge,
    prompts=fprompts,
    bands=fbands,
)
save_table(filt, run.out, "09_filtering_prompts")
fsum = []
for c, sub in filt.groupby("condition", sort=False):
    ci = S.accuracy_ci(sub.correct.to_numpy())
    fsum.append(
        {
            "condition": c,
            "accuracy": ci.estimate,
            "accuracy_low": ci.low,
            "accuracy_high": ci.high,
            "n": ci.n,
            "last_digit_right": sub.last_digit_right.mean(),
            "mean_abs_error": sub.error.abs().mean(),
            "not_a_number": (sub.pred < 0).mean(),
        }
    )
fsum = pd.DataFrame(fsum)
save_table(fsum, run.out, "09_filtering")
save_figure(
    plots.filtering_plot(fsum, f"{model}: filtering MLP / attention outputs at the answer position"),
    run.out,
    "09_filtering",
)
timed.lap("filters")
print(
    "bands (frequencies of",
    single + 1,
    "numbers):",
    {
        k: (len(v), f"periods {(single + 1) / max(v):.3g}..{(single + 1) / min(v):.3g}") if v else 0
        for k, v in fbands.items()
    },
)
fsum.round(3)

# %% [markdown]
# ## 4 · The bridge: do the heuristic neurons read Fourier directions?
# Notebook 03's circuit neurons for + that match a heuristic (`03_circuit_neurons`).

# %%
timed.start()
bridge_rows, fit_rows_n = [], []
has03 = find_table(run.out, "03_circuit_neurons") is not None
if has03:
    cn = read_table(run.out, "03_circuit_neurons")
    cn = cn[(cn.op == "+") & cn.matched.astype(bool)].reset_index(drop=True)
    nl = single + 1
    rand = {
        L: sorted(rng.choice(info.d_mlp, min(n_random_neurons, info.d_mlp), replace=False).tolist())
        for L in sorted(cn.layer.unique())
    }
    bases, nulls = {}, {}  # by frequency set, and by (layer, frequency set): each computed once
    for r in cn.itertuples():
        ks = tuple(RP.rule_frequencies(str(r.best_heuristic), str(r.best_kind), nl, fbands))
        basis = bases[ks] = bases[ks] if ks in bases else RP.fourier_directions(U, ks)
        share = np.mean(
            [RP.direction_share(w, basis)[0] for w in RP.neuron_input_weights(bridge, int(r.layer), [int(r.neuron)])]
        )
        if (r.layer, ks) not in nulls:
            nulls[r.layer, ks] = np.mean(
                [RP.direction_share(w, basis) for w in RP.neuron_input_weights(bridge, int(r.layer), rand[r.layer])], 0
            )
        null = nulls[r.layer, ks]
        bridge_rows.append(
            {
                "layer": int(r.layer),
                "neuron": int(r.neuron),
                "heuristic": r.best_heuristic,
                "kind": r.best_kind,
                "frequencies": " ".join(map(str, ks)),
                "share": share,
                "random_share": null.mean(),
                "ratio": share / null.mean() if null.mean() > 0 else np.nan,
            }
        )
    bridge_df = pd.DataFrame(bridge_rows)
    if len(bridge_df):
        save_table(bridge_df, run.out, "09_bridge_neurons")
        save_figure(
            plots.bridge_plot(bridge_df, f"{model}: heuristic neurons' weight in their rule's Fourier directions"),
            run.out,
            "09_bridge_neurons",
        )
        # neuron fits (K&T): activation ~ [B(a), B(b), B(a+b)], held-out R^2, circuit vs random neurons
        nsel = sorted(rng.choice(len(prompts), min(n_neuron_fit, len(prompts)), replace=False).tolist())
        nprompts = prompts.subset(nsel)
        nlayers = sorted(cn.layer.unique().tolist())
        nacts = store(
            "09 neuron activations",
            lambda: N.neuron_activations(bridge, nprompts, nlayers, batch_size),
            code=[N],
            model=bridge,
            prompts=nprompts,
            layers=nlayers,
        )
        na, nb = a_of[nsel], b_of[nsel]
        for li, L in enumerate(nlayers):
            circ = cn[cn.layer == L].neuron.astype(int).tolist()
            for kind_, cols in (("heuristic", circ), ("random", rand[L])):
                r2 = HX.neuron_fit_r2(nacts[:, li, cols].numpy(), na, nb, periods, seed=seed)
                fit_rows_n += [{"layer": L, "neuron": c, "set": kind_, "r2": v} for c, v in zip(cols, r2)]
        nfit = pd.DataFrame(fit_rows_n)
        save_table(nfit, run.out, "09_neuron_fits")
else:
    bridge_df = nfit = pd.DataFrame()
    print("no 03_circuit_neurons table in", run.out, "- run notebook 03 first; the bridge is skipped")
timed.lap("bridge")
if len(bridge_df):
    display(bridge_df.groupby("kind")[["share", "random_share", "ratio"]].median().round(4))

# %% [markdown]
# ## What this run found

# %%
timing_table = timed.table(total_wall_s=time.time() - t_start)  # the total includes loading
save_table(timing_table, run.out, "09_timings")
total = timing_table.iloc[-1]


def pct(x):
    return "n/a" if x is None or not np.isfinite(x) else f"{x:.0%}"


emb = bands[bands.source == "embedding"].iloc[0]
top = spectra[spectra.source == "embedding"].sort_values("share", ascending=False).head(5)
lines = [
    f"- Model `{model}` ({info.n_layers} layers), seed {seed}, {'quick' if quick else 'full'} run, "
    f"{total.wall_s:.0f} s"
    + (f" (+ {total.reused_s:.0f} s stored by earlier runs)" if total.reused_s else "")
    + f"; numbers one token up to {single}; number embeddings {number_init}."
]
lines.append(
    f"- Embedding of 0..{single}: top periods "
    + ", ".join(f"{p:.3g} ({s:.0%})" for p, s in zip(top.period, top.share))
    + f"; low band {pct(emb.share_low)} of the power (shuffled {pct(emb.null_low)})"
    + (
        f", high band {pct(emb.share_high)} (shuffled {pct(emb.null_high)})"
        if "share_high" in emb and np.isfinite(emb.share_high)
        else ""
    )
    + (
        f"; Zhou's periods 2, 2.5, 5, 10: {pct(emb.zhou_share)} [{pct(emb.zhou_share_low)}, {pct(emb.zhou_share_high)}] "
        f"(shuffled {pct(emb.zhou_null)})"
        if emb_ci is not None
        else ""
    )
    + "."
)
res = bands[bands.layer >= 0]
lines.append(
    f"- Residual stream at a's last token (0..{max_operand}): low-band share by layer "
    + ", ".join(f"{int(r.layer)}: {pct(r.share_low)}" for r in res.itertuples())
    + f" (shuffled about {pct(res.null_low.mean())})."
)
if len(summary):
    h = summary[summary.method == "helix"].set_index("layer")
    p_ = summary[summary.method == "pca"].set_index("layer")
    rd = summary[summary.method == "random"].set_index("layer")
    lines.append(
        f"- Helix patch ({len(pairs)} pairs; share of the layer patch restored, helix / PCA-{HX.helix_dim(periods)} / "
        "random): "
        + "; ".join(
            f"layer {L}: {h.share[L]:.2f} [{h.share_low[L]:.2f}, {h.share_high[L]:.2f}] / "
            f"{p_.share[L]:.2f} / {rd.share[L]:.2f}"
            for L in h.index
        )
        + "."
    )
    drops = summary[summary.method.str.startswith("helix without")]
    if len(drops):
        worst = drops.groupby("method").share.mean().sort_values()
        lines.append(
            "- Mean share over layers without one period: "
            + ", ".join(f"{m[14:]}: {v:.2f}" for m, v in worst.items())
            + f" (all periods: {h.share.mean():.2f})."
        )
else:
    lines.append("- No pair of correctly answered prompts to patch.")
base = fsum.set_index("condition")
lines.append(
    "- Filters (first-token accuracy; last digit right): "
    + "; ".join(
        f"{c} {r.accuracy:.0%} [{r.accuracy_low:.0%}, {r.accuracy_high:.0%}], {r.last_digit_right:.0%}"
        for c, r in base.iterrows()
    )
    + "."
)
if len(bridge_df):
    kinds = bridge_df.groupby("kind").ratio.median()
    ratio_ci = S.bootstrap_ci(lambda x: float(np.median(x)), np.log(bridge_df.ratio.clip(lower=1e-12)).to_numpy())
    lines.append(
        f"- Bridge: {len(bridge_df)} heuristic neurons (+); median share of input weight in their rule's Fourier "
        f"directions / random neurons' share: {np.exp(ratio_ci.estimate):.2f} [{np.exp(ratio_ci.low):.2f}, "
        f"{np.exp(ratio_ci.high):.2f}]; by kind " + ", ".join(f"{k} {v:.2f}" for k, v in kinds.items()) + "."
    )
    if len(nfit):
        m_ = nfit.groupby("set").r2.median()
        lines.append(
            f"- Neuron fits on [B(a), B(b), B(a+b)] (held-out R², median): heuristic neurons {m_.get('heuristic', np.nan):.2f}, "
            f"random neurons {m_.get('random', np.nan):.2f}."
        )
lines += R.notebook_verdicts(run.out, "09")
Markdown("\n".join(lines))
