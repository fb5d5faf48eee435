# %% [markdown]
# # Exercise 05 · Does LoRA in one attention layer work by amplifying the answer neurons?
#
# The teaching companion of `notebooks/05_lora_mechanism.ipynb` (and of the start of
# `06_pruning.ipynb`, whose Sec. 6.1 pruning ranks neurons by CNA between the LoRA model of one
# layer and the original). Yu & Ananiadou (2024, Sec. 5) fine-tune one LoRA model per attention
# layer on 2-digit arithmetic, compare each with the original by comparative neuron analysis
# (CNA, Sec. 4.1), and find that the coefficient scores of the deep FFN neurons that write the
# answer grow (Tables 9, 10): "LoRA enhances the final prediction by amplifying the coefficient
# scores of important FFN neurons". You write three pieces of that analysis, which notebook 05
# gets from `arithlib.yu.lora`:
#
# 1. the **weights of a LoRA model of one layer**: W + (alpha / r) B A on that layer's attention
#    projections only, what `lora.train_lora` returns;
# 2. the **coefficient increase** of a set of neurons from the original to the LoRA model
#    (Table 10's quantity), sign-aware;
# 3. **Table 10** for one LoRA model: per case the top-k neurons by CNA between the two
#    models, and their pooled increase (`lora.lora_cna`).
#
# Everything runs on the toy model (`toy-arith`: 2 layers, one token per integer). For exercises
# 2 and 3 the setup trains one LoRA model per attention layer (r = 16, alpha = 32, as notebook
# 05) on 256 of Yu's 2-digit sentences for one epoch, a few seconds each, and runs CNA on 60 of
# Yu's 1-digit cases ("3 + 5 =" first).

# %%
import pandas as pd
import torch

import arithlib.course.lora_checks as ex
import arithlib.methods.model_weights as MW
import arithlib.yu.cna as C
import arithlib.yu.lora as lora

bridge = ex.check_model().bridge
params = MW.params_by_clean_name(bridge)
print(f"{bridge.cfg.n_layers} layers, d_model {bridge.cfg.d_model}, d_mlp {bridge.cfg.d_mlp}")
print("LoRA targets of a Llama block:", ex.TARGETS)
print({n: tuple(p.shape) for n, p in params.items() if n.startswith("model.layers.0.self_attn")})

# %% [markdown]
# ## 1 · The weights of a LoRA model of one layer
# > **Objective** write the low-rank update of one layer's attention projections and merge it into the weights · **Difficulty** ●●○○○ · **Importance** ●●●○○ · **Time** 15 min
#
# LoRA (Hu et al. 2021) freezes a linear map W [d_out, d_in] and learns a low-rank change: for
# an input x the adapted layer computes W x + (alpha / r) B A x, with A [r, d_in] and
# B [d_out, r] (B starts at zero, so training starts from the original model). Since the change
# is linear, it merges into one matrix,
#
#     W' = W + (alpha / r) · B A.
#
# Yu's LoRA models adapt the attention of **one** block: arithlib passes peft
# `LoraConfig(r, lora_alpha, target_modules=[q_proj, k_proj, v_proj, o_proj],
# layers_to_transform=[layer])` and returns the merged weights of that block's projections,
# keyed by their parameter names (`model.layers.<layer>.self_attn.q_proj.weight`, ...); every
# other weight is the original's. Write that dict for the factors given, `{module: (A, B)}`
# with modules named as in `ex.TARGETS`.


# %%
def lora_weights(
    params: dict[str, torch.Tensor],
    layer: int,
    factors: dict[str, tuple[torch.Tensor, torch.Tensor]],
    alpha: float,
    r: int,
) -> dict[str, torch.Tensor]:
    """{``model.layers.<layer>.<module>.weight``: W + (alpha / r) B A} for each ``module`` of
    ``factors`` ({module: (A [r, d_in], B [d_out, r])}), W from ``params`` (by that name)."""
    # BEGIN SOLUTION
    # HINT: the name of a module's weight is `f"model.layers.{layer}.{module}.weight"`; loop over `factors.items()`
    # HINT: `B @ A` has W's shape [d_out, d_in]; the scaling is `alpha / r`
    out = {}
    for module, (A, B) in factors.items():
        name = f"model.layers.{layer}.{module}.weight"
        out[name] = params[name].detach() + (alpha / r) * (B @ A)
    return out
    # END SOLUTION


# %%
ex.check_lora_weights(lora_weights)

# %% [markdown]
# With fixed random factors (B non-zero: a trained adapter rather than a fresh one), your merged
# weights in the model (`MW.use_weights` swaps them in and restores the originals) give the
# same logits as peft's adapter run unmerged; and a model with LoRA in block L computes the
# same residual stream as the original below L (what `arithlib.engine.streams.LayerInputs`
# uses to train and evaluate a LoRA model of layer L from the original's recorded stream).

# %%
case = lora.yu_cna_cases(ex.check_model().tokenizer, fewshot=2, n_cases=16)
tokens = next(case.batches(len(case))).tokens
names = [f"blocks.{l}.hook_resid_pre" for l in range(bridge.cfg.n_layers)]
with torch.no_grad():
    logits0, cache0 = bridge.run_with_cache(tokens, names_filter=names)
rows = []
for layer in range(bridge.cfg.n_layers):
    factors = ex.random_factors(layer, r=4)
    _, peft_logits = ex.peft_lora(layer, factors, alpha=8, r=4, tokens=tokens)
    with MW.use_weights(bridge, lora_weights(params, layer, factors, 8, 4)), torch.no_grad():
        logits1, cache1 = bridge.run_with_cache(tokens, names_filter=names)
    row = {"LoRA in block": layer}
    for name in names:
        row[f"|Δ| entering block {name.split('.')[1]}"] = float((cache1[name] - cache0[name]).abs().max())
    row["|Δ| last-position logits"] = float((logits1[:, -1] - logits0[:, -1]).abs().max())
    row["|yours - peft| logits"] = float((logits1[:, -1] - peft_logits).abs().max())
    rows.append(row)
pd.DataFrame(rows).round(6)

# %% [markdown]
# ## 2 · The coefficient increase of a set of neurons
# > **Objective** turn "the neurons' coefficients grow" into one sign-aware number that large neurons dominate · **Difficulty** ●●○○○ · **Importance** ●●●●○ · **Time** 10 min
#
# A neuron's coefficient score m is its activation at the answer position (`mlp.hook_post`: in a
# SwiGLU MLP, act(gate) · up, which is often negative). Let m0 be a neuron's coefficient in the
# original model and m1 in the LoRA model, for each case and neuron of a set. Yu's Table 10
# reports how much the set's coefficients grow, in %; arithlib (`lora.lora_cna`) pools every
# case and neuron into one ratio and counts growth away from zero, whatever the sign:
#
#     increase = 100 · Σ sign(m0) (m1 - m0) / Σ |m0|.
#
# A negative coefficient that becomes more negative has grown. The ratio of sums weighs each
# neuron by the size of its coefficient, so a neuron near zero cannot blow the number up. It
# is the negative of `cna.coefficient_decrease`, the measure of notebook 04's ablations.


# %%
def coefficient_increase(before: torch.Tensor, after: torch.Tensor) -> float:
    """Sign-aware increase (%) from ``before`` (m0) to ``after`` (m1), both [cases, neurons]:
    100 * sum sign(m0) (m1 - m0) / sum |m0| over every entry."""
    # BEGIN SOLUTION
    # HINT: `torch.sign(before)` is +1 or -1 per entry; sum over **every** entry, then divide
    # HINT: the denominator is `before.abs().sum()`, not the number of entries
    m0, m1 = before.float(), after.float()
    return float(100 * (torch.sign(m0) * (m1 - m0)).sum() / m0.abs().sum())
    # END SOLUTION


# %%
ex.check_coefficient_increase(coefficient_increase)

# %% [markdown]
# Yu's Table 9 in small: for "3 + 5 =", the three most important deep neurons of the original
# model (CNA importance, Sec. 4.1) and their coefficients in the original and each LoRA model
# (`lora.coefficient_table`), with your increase over the three.

# %%
data = ex.lora_data()
neurons = C.top_neurons(data.details["original"]["importance"][0], 3)
table9 = lora.coefficient_table(bridge, data.cases.subset([0]), {"original": None, **data.weights}, neurons)
m0 = torch.tensor(table9["original"].to_numpy())[None]
print(f"{data.cases.records[0].text.strip()!r}: increase over these 3 neurons", end=" ")
print({m: round(coefficient_increase(m0, torch.tensor(table9[m].to_numpy())[None]), 1) for m in data.weights})
table9.round(3)

# %% [markdown]
# ## 3 · Table 10: the increase of the neurons CNA picks between the two models
# > **Objective** select each case's top-k neurons by the change of importance between two models and pool their increase · **Difficulty** ●●●○○ · **Importance** ●●●●● · **Time** 20 min
#
# CNA between a LoRA model M and the original scores every FFN neuron of each case by the
# change of its importance, imp_M - imp_orig (importance: Sec. 4.1, the log-probability of the
# answer with the neuron's output added to the stream minus without). Per case, keep the k
# neurons with the **largest** change, ranked within the deep layers only (the importances
# are NaN elsewhere: rank finite entries only), read their coefficients in both models and
# pool every case's neurons into one increase (exercise 2). That is one cell of Table 10
# (Yu: 42-59 % for LoRA in layers 1-9, 2-28 % for layers 17-30).
#
# Inputs: coefficients and importances `[cases, layers, d_mlp]`, the original's and the LoRA
# model's. The check compares your number with `lora.lora_cna`'s `"cna"` rows for each LoRA
# model of the toy and each k of Table 10 (50, 30, 20, 10).


# %%
def cna_increase(
    coef_orig: torch.Tensor, coef_lora: torch.Tensor, imp_orig: torch.Tensor, imp_lora: torch.Tensor, k: int
) -> float:
    """The coefficient increase (%) from ``coef_orig`` to ``coef_lora`` of each case's k neurons
    with the largest finite imp_lora - imp_orig, pooled over cases and neurons."""
    # BEGIN SOLUTION
    # HINT: `change = (imp_lora - imp_orig).nan_to_num(nan=-torch.inf)` puts the unranked layers last
    # HINT: flatten layers and neurons per case (`.reshape(n_cases, -1)`), take `.topk(k, dim=1).indices` and `.gather(1, idx)` the coefficients
    # HINT: then `coefficient_increase(before, after)` on the [cases, k] coefficients
    n = len(coef_orig)
    change = (imp_lora - imp_orig).nan_to_num(nan=-torch.inf).reshape(n, -1)
    idx = change.topk(k, dim=1).indices
    before = coef_orig.reshape(n, -1).gather(1, idx)
    after = coef_lora.reshape(n, -1).gather(1, idx)
    return coefficient_increase(before, after)
    # END SOLUTION


# %%
ex.check_cna_increase(cna_increase)

# %% [markdown]
# Table 10 in small, with your function: per LoRA model and k, the increase of the neurons CNA
# picks (`cna`) beside arithlib's increase of the original model's own top-k neurons (no
# selection on the change: `original`), and what LoRA did to the cases' answers (first-token
# accuracy, mean change of the answer's log-probability). The toy's two layers are Yu's bands
# scaled down (`lora.yu_bands`): layer 0 shallow, layer 1 deep.

# %%
orig_run = data.details["original"]["run"]
rows = []
for name in data.weights:
    run = data.details[name]["run"]
    row = {"model": name, "accuracy (orig → LoRA)": f"{orig_run.accuracy:.0%} → {run.accuracy:.0%}"}
    row["Δ answer log-prob"] = float((run.logprob - orig_run.logprob).mean())
    for k in ex.KS:
        args = (data.coef_orig, data.coef[name], data.imp_orig[name], data.imp[name], k)
        row[f"cna top{k}"] = cna_increase(*args)
        ref = data.rows[(data.rows.model == name) & (data.rows.selection == "original") & (data.rows.k == k)]
        row[f"original top{k}"] = float(ref.coef_increase.iloc[0])
    rows.append(row)
print("bands:", lora.yu_bands(bridge.cfg.n_layers), "; Yu Table 10 (cna): shallow 42-59 %, deep 2-28 %")
pd.DataFrame(rows).round(2)

# %% [markdown]
# Who are the neurons CNA picks? Each case's top-10 by imp_LoRA - imp_orig, split by the sign of
# their importance in the original model (negative: the neuron lowers the answer's
# log-probability), with your increase of each group.

# %%
rows = []
for name in data.weights:
    change = data.imp[name] - data.imp_orig[name]
    picked = [(i, l, n) for i in range(len(change)) for l, n in C.top_neurons(change[i], 10)]
    i, l, n = (torch.tensor(x) for x in zip(*picked))
    imp0, m0, m1 = data.imp_orig[name][i, l, n], data.coef_orig[i, l, n], data.coef[name][i, l, n]
    for label, sel in (("imp_orig > 0 (helps the answer)", imp0 > 0), ("imp_orig ≤ 0 (hurts it)", imp0 <= 0)):
        rows.append(
            {
                "model": name,
                "CNA top-10 neurons with": label,
                "share": float(sel.float().mean()),
                "increase (%)": coefficient_increase(m0[sel][None], m1[sel][None]),
            }
        )
pd.DataFrame(rows).round(2)

# %% [markdown]
# **Questions.** (a) Why is the update scaled by alpha / r and not by alpha? What does B = 0 at the
# start guarantee, and what does merging (exercise 1's comparison with peft's unmerged forward)
# cost at inference? (b) Why does the first table show no change at all entering block L, and
# what do notebooks 05 and 06 save because of it? (c) Why a ratio of sums, weighted by
# sign(m0)? Construct two neurons for which the mean of the neurons' own ratios says "they
# grew" while the coefficients that matter shrank. (d) Compare the `cna` and `original`
# columns, then read the last table: which neurons does ranking by imp_LoRA - imp_orig pick,
# and what does the pooled increase then add up? (e) Does the toy model show Yu's "LoRA
# amplifies the answer neurons"? What would it need first?

# %% [markdown] tags=["solution"]
# **Answers.** (a) The low-rank update is a sum of r rank-one terms, so its size grows with r;
# alpha / r keeps its scale roughly independent of r and the learning rate need not be
# retuned when r changes (scaling by alpha alone makes notebook 05's r = 16 update 16 times as
# strong). B = 0 makes B A = 0: training starts exactly at the original model. The merged
# W' = W + (alpha / r) B A is one matrix of W's shape, so the adapted model runs as fast as the
# original; your logits equal peft's unmerged ones to float precision (differences of 3e-5 and
# 7e-6 here). (b) LoRA changes only block L's attention, and no block below L sees block L, so
# the stream entering block L (and every block below) is the original's exactly: |Δ| = 0,
# while LoRA in block 0 already moves the stream entering block 1 by up to 0.54. Notebooks 05
# and 06 record that stream once and run only blocks L.. in every training and evaluation pass
# of a LoRA model of layer L (`LayerInputs`). (c) A neuron with m0 = 0.01 that moves to 0.03
# "grows by 200 %" while one with m0 = 4 that drops to 2 shrinks by 50 %: the mean of ratios
# says +75 %, the pooled ratio (0.02 - 2) / 4.01 says -49 %, and only the second reflects what
# reaches the logits. sign(m0) makes a negative coefficient that moves further from zero count
# as growth: SwiGLU neurons write with either sign (in Table 9 here, neuron 1_39 has -4.7).
# (d) For LoRA L0 the neurons CNA picks lose 1.0-2.6 % while the original's own top neurons
# barely move (-0.1 to +0.6 %); for L1 the `cna` columns (+1.0 to +1.3 %) sit a little above the
# `original` ones (+0.7 to +0.9 %). The ranking by importance increase picks two kinds of
# neurons: ones that help the answer and grew, and ones that hurt it (negative importance in
# the original) and were silenced, since a harmful neuron's importance rises when its
# coefficient shrinks. Of each case's CNA top 10, 47 % (L0) and 33 % (L1) are of the second
# kind; their coefficients fall by 16 % and 10 %, while the helpers' rise by 7 % and 4 %. The
# pooled "increase" adds both up, so it reads as amplification only where the helpers
# dominate. The `original` selection fixes the neurons before looking at the LoRA model and
# reads how the original's answer neurons changed, free of that mixture.
# (e) No. The LoRA models, trained for 16 steps, barely change the toy: accuracy on the
# 1-digit cases stays 100 %, the answer's log-probability moves by +0.01 (L0) and -0.02 (L1),
# the increases stay within ±3 %, and the shallow model (L0) is below the deep one for CNA's
# neurons, the reverse of Yu's ordering (42-59 % shallow, 2-28 % deep). Yu's claim explains an
# accuracy gain, and there is none here: notebook 05's own toy run (512 sentences) found no
# gain on the 2-digit test set either (`figures/toy-arith/05_lora_accuracy_by_layer.csv`:
# 16.4 % original, 14.3 % LoRA L0, 16.4 % LoRA L1). The mechanism can only be read on a model
# that LoRA measurably improves.
