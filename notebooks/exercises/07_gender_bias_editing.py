# %% [markdown]
# # Exercise 07 · Does zeroing a few CNA neurons reduce a bias, and more than any neurons would?
#
# The teaching companion of `notebooks/07_gender_bias_editing.ipynb`. Yu & Ananiadou (2024,
# Sec. 6.2, App. D, Table 13) prompt a model with "A woman works as a" and "A man works as
# a" (and 7 more templates, Table 22), find the professions whose probability differs by
# gender, rank FFN neurons by Comparative Neuron Analysis between the two genders, zero the
# top 18 and report that the bias falls by 35.7 % (1.26 -> 0.81 nats). You write three
# pieces of that measurement, which notebook 07 gets from `arithlib.yu.bias`:
#
# 1. the **bias metric** (Table 13): the log-probability difference of a profession between
#    the two genders' prompts;
# 2. the **edit**: hooks that zero a set of neurons, so that the bias can be measured on the
#    edited model;
# 3. the **reduction against a control**: how much the edit lowers the bias, beside zeroing
#    as many random neurons of the same layers.
#
# **The toy model has no gender structure.** Its tokenizer knows integers and a few
# arithmetic words; "woman", "man" and every profession are the unknown token, so "A woman
# works as a" and "A man works as a" are the same token sequence and the bias is exactly 0
# (the setup cell shows it; notebook 07 skips its edit on the toy for that reason). The point
# here is the method, so we run it on a **stand-in with the same shape**: two words the toy
# knows, "sum" and "product", fill Table 22's `<gend>`, and the number tokens 0..999 play the
# professions. The "biased professions" are the numbers that are in one filler's top-100
# next tokens and not the other's on more prompts than the reverse (App. D's rule), and the
# edit set is CNA's top-18 between the two fillers, all computed by arithlib's own pipeline
# (`arithlib.course.bias_checks.bias_data`). Nothing below is a finding about gender.

# %%
import matplotlib.pyplot as plt
import pandas as pd
import torch
from IPython.display import display

import arithlib.course.bias_checks as ex
from arithlib.yu.bias_professions import table22_prompts

torch.set_grad_enabled(False)
torch.set_num_threads(1)  # the toy model is tiny: one thread runs it fastest, most of all on a busy machine
data = ex.bias_data()
bridge, tok, genders, biased = data.bridge, data.tokenizer, data.genders, data.biased
print("woman:", tok("A woman works as a")["input_ids"], " man:", tok("A man works as a")["input_ids"])
print(f"stand-in genders {genders}: ", [tok(t)["input_ids"] for t in table22_prompts(genders[0])[:2]])
print(
    f"{len(biased)} stand-in professions (number tokens): "
    + ", ".join(f"{g} {n}" for g, n in biased.bias_gender.value_counts().items())
)
print(f"edit set (CNA top-18, (layer, neuron)): {data.edit_sets[18]}")
biased.head()

# %% [markdown]
# ## 1 · The bias metric
# > **Objective** compute Table 13's per-prompt bias of a profession from the two genders' next-token distributions · **Difficulty** ●●○○○ · **Importance** ●●●●○ · **Time** 15 min
#
# For each of the 8 Table-22 prompts p (`table22_prompts(g)`, with `<gend>` filled by g) and
# each profession token w, Yu's bias is the difference of log-probabilities of w as the next
# token after the prompt's last token, between the two genders:
#
# d(p, w) = log p(w | prompt p with g1) − log p(w | prompt p with g2),  g1, g2 = `genders`.
#
# Table 13 reports the mean of |d| over prompts and professions (overall and per bias
# gender): a profession can be biased towards either gender, so the signed d of the two
# lists would cancel. arithlib (`bias.bias_scores`) scores a profession by its **first
# token** (the token of " " + profession that a next-token list can hold), not by a sum over
# its tokens; here every stand-in profession is one token. Return the signed d as a
# `[8, len(token_ids)]` tensor. Tokenize each prompt as `tokenizer(text)["input_ids"]` (it
# starts with the BOS token), run `model(tokens)` (logits `[batch, pos, vocab]`), and do it
# inside `with model.hooks(fwd_hooks=hooks or []):` so that exercise 2's hooks take effect.


# %%
def bias_diff(model, tokenizer, token_ids: list[int], genders: tuple[str, str], hooks=None) -> torch.Tensor:
    """d[p, j] = log p(token_ids[j] | prompt p with genders[0]) - log p(token_ids[j] | prompt p with
    genders[1]) at each Table-22 prompt's last position, with ``hooks`` active: [8, len(token_ids)]."""
    # BEGIN SOLUTION
    # HINT: for each gender g and each `text` in `table22_prompts(g)`: `tokens = torch.tensor([tokenizer(text)["input_ids"]])`, `logits = model(tokens)[0, -1]`
    # HINT: take `logits.log_softmax(-1)[token_ids]` (log-probabilities, not probabilities or logits), stack the 8 prompts, and subtract the second gender's from the first's
    per_gender = []
    with model.hooks(fwd_hooks=list(hooks or [])):
        for g in genders:
            rows = []
            for text in table22_prompts(g):
                tokens = torch.tensor([tokenizer(text)["input_ids"]])
                logprobs = model(tokens)[0, -1].float().log_softmax(-1)
                rows.append(logprobs[token_ids])
            per_gender.append(torch.stack(rows))
    return per_gender[0] - per_gender[1]
    # END SOLUTION


# %%
ex.check_bias_diff(bias_diff)

# %% [markdown]
# Table 13's numbers for the original model from your function: the mean |d| over all
# (prompt, profession) pairs and over each bias gender's professions, and the signed mean
# towards each profession's own bias gender.

# %%
ids = biased.token_id.tolist()
toward = torch.tensor([1.0 if g == genders[0] else -1.0 for g in biased.bias_gender])


def table13_row(d: torch.Tensor) -> dict[str, float]:
    row = {"total": float(d.abs().mean())}
    for g in genders:
        row[g] = float(d[:, torch.tensor((biased.bias_gender == g).to_numpy())].abs().mean())
    row["toward"] = float((d * toward).mean())
    return row


d = bias_diff(bridge, tok, ids, genders)
pd.DataFrame([table13_row(d)], index=["original"]).round(3)

# %% [markdown]
# ## 2 · The edit: zero the neurons
# > **Objective** zero a set of FFN neurons during the forward pass at the positions the paper's edit acts on · **Difficulty** ●●○○○ · **Importance** ●●●●○ · **Time** 15 min
#
# Yu & Ananiadou edit a neuron "by setting its parameters to zero". A neuron k of layer l adds
# m_k · fc2_k to the residual stream (Sec. 2: its coefficient m_k times its value vector,
# column k of W_out); its activation m_k is `blocks.{l}.mlp.hook_post[batch, pos, k]`.
# Zeroing m_k at **every position** removes the neuron from the model, which is what zeroing
# its weights does (arithlib: `ablation.zero_neurons_hooks(neurons, position=None)` in
# `bias.edit_conditions`). Return one hook per layer, `(name, fn)` with
# `fn(activation, hook)` that sets the layer's listed neurons to 0 and returns the
# activation. (In this gated SiLU MLP without biases, zeroing the gate's pre-activation
# `hook_pre` would give the same: SiLU(0) = 0.)


# %%
def zero_neuron_hooks(neurons: list[tuple[int, int]]) -> list[tuple[str, object]]:
    """Hooks that zero the activation of each (layer, neuron) in ``neurons`` at every position."""
    # BEGIN SOLUTION
    # HINT: group the neurons by layer: `{layer: [neuron, ...]}`
    # HINT: a hook `def fn(act, hook, idx=idx): act[:, :, idx] = 0.0; return act` at `f"blocks.{layer}.mlp.hook_post"` (bind `idx` as a default argument: a closure in a loop sees the last layer's)
    by_layer: dict[int, list[int]] = {}
    for layer, k in neurons:
        by_layer.setdefault(int(layer), []).append(int(k))
    hooks = []
    for layer, idx in sorted(by_layer.items()):

        def fn(act, hook, idx=idx):
            act[:, :, idx] = 0.0
            return act

        hooks.append((f"blocks.{layer}.mlp.hook_post", fn))
    return hooks
    # END SOLUTION


# %%
ex.check_zero_neuron_hooks(zero_neuron_hooks)

# %% [markdown]
# Table 13 with your two functions: the original model, the CNA top-18 zeroed and the first
# random layer-matched set of 18 zeroed; then the side effect on arithmetic (exact-answer
# accuracy on Yu's 1-digit prompts, `bias.arithmetic_accuracy`) of the same edits.

# %%
seed0 = next(iter(data.random_sets[18]))
rows = {
    "original": table13_row(bias_diff(bridge, tok, ids, genders)),
    "CNA top-18 zeroed": table13_row(bias_diff(bridge, tok, ids, genders, zero_neuron_hooks(data.edit_sets[18]))),
    "random 18 zeroed": table13_row(
        bias_diff(bridge, tok, ids, genders, zero_neuron_hooks(data.random_sets[18][seed0]))
    ),
}
t13 = pd.DataFrame(rows).T
fig, ax = plt.subplots(figsize=(6, 3))
t13[["total", *genders]].plot.bar(ax=ax, rot=0)
ax.set(ylabel="mean |d| (nats)", title="toy model, stand-in genders 'sum' / 'product'")
plt.show()
side = ex.arithmetic_side_effect(18)
display(t13.round(3))
side.groupby("kind", sort=False).agg(arith_accuracy=("arith_accuracy", "mean"), sets=("seed", "size"))

# %% [markdown]
# ## 3 · The reduction, against random neurons
# > **Objective** turn before/after biases into Table 13's reduction and compare it with a layer-matched random control · **Difficulty** ●●●○○ · **Importance** ●●●●● · **Time** 15 min
#
# `scores` has one row per condition and (prompt, profession): `kind` ("original", "cna" =
# the CNA top-K zeroed, "random" = a random layer-matched set of K zeroed), `K`, `seed` (the
# random set's; −1 otherwise), `prompt_id`, `token_id`, `bias_gender` and the signed `diff`
# of exercise 1 (computed by `bias.bias_under_conditions`). Table 13's reduction is
#
# reduction = 100 · (1 − mean |d| edited / mean |d| original)   (the paper: 100 · (1 − 0.81 / 1.26) = 35.7 %),
#
# the means over all (prompt, profession) pairs. Zeroing any neurons shifts every
# log-probability somewhat, so the reduction alone does not say that CNA found the bias: the
# control is the same reduction for random sets of K neurons in the same layers, averaged
# over the seeds, and the edit's effect is the difference in points. Return
# `{"reduction_pct": ..., "random_pct": ..., "diff_pts": reduction_pct − random_pct}` for size `k`.


# %%
def reduction_vs_random(scores: pd.DataFrame, k: int) -> dict[str, float]:
    """Reduction (%) of mean |diff| by the CNA top-``k``, the mean over seeds of the same for the
    random sets of size ``k``, and their difference in points."""
    # BEGIN SOLUTION
    # HINT: the bias of a condition is `rows["diff"].abs().mean()`; the original is `scores[scores.kind == "original"]`
    # HINT: per random seed: `scores[(scores.kind == "random") & (scores.K == k)].groupby("seed")`, one reduction per seed, then their mean
    bias = scores.assign(abs_diff=scores["diff"].abs())
    original = bias.loc[bias.kind == "original", "abs_diff"].mean()
    edited = bias.loc[(bias.kind == "cna") & (bias.K == k), "abs_diff"].mean()
    per_seed = bias[(bias.kind == "random") & (bias.K == k)].groupby("seed").abs_diff.mean()
    reduction = float(100 * (1 - edited / original))
    random = float((100 * (1 - per_seed / original)).mean())
    return {"reduction_pct": reduction, "random_pct": random, "diff_pts": reduction - random}
    # END SOLUTION


# %%
ex.check_reduction_vs_random(reduction_vs_random)

# %%
scores = ex.student_scores()
pd.DataFrame({k: reduction_vs_random(scores, k) for k in ex.EDIT_KS}).T.rename_axis("K").round(1)

# %% [markdown]
# **Questions.** (a) Why does Table 13 average |d| and not d? What would the signed mean say
# about a model that favours one list of professions after g1 and another after g2 as
# strongly? (b) The CNA top-18 are all in the last layer here. Why does it not matter for
# them whether you zero every position or only the last one, and for which neurons of this
# 2-layer model does it matter? (c) Is the stand-in reduction more than zeroing 18 random
# neurons does? What does the arithmetic side effect say about what these neurons do, and
# what would you check before calling such an edit "bias removal" in a real model?

# %% [markdown] tags=["solution"]
# **Answers.** (a) d is positive for professions favoured after g1 and negative for those
# favoured after g2; a model biased both ways as strongly has a signed mean near 0. |d|
# counts every difference whichever way it goes (the signed "toward" column keeps the
# direction relative to each profession's own bias gender: 0.29 nats here, of a total 0.36).
# (b) A last-layer neuron at an earlier position writes to that position's residual stream,
# which no later layer reads, so only its last-position activation reaches the prediction;
# zeroing it elsewhere changes nothing. Layer-0 neurons at earlier positions are read by
# layer 1's attention, so for them (the "top 9 of each layer" set of the check) zeroing every
# position and zeroing only the last differ. In a deep model almost every layer is like
# layer 0 here. (c) On the stand-in, the CNA top-18 lower the mean |d| from 0.36 to 0.20
# nats, a 43 % reduction (20 % with the top 6), while random layer-matched sets of 18 change
# it by −0.5 % (+0.6 % for 6, means over 5 seeds): a difference of 44 points (19 for 6). The
# signed bias towards each number's own filler falls from 0.29 to 0.02 nats: the edit
# removes most of the directed preference, not only its size. The edit is not free: the toy
# answers all 32 one-digit arithmetic prompts with the original weights and with each of the
# 5 random sets zeroed, but 75 % with the CNA top-18 zeroed. The stand-in "professions" are
# numbers, so neurons that move number predictions apart are likely to serve arithmetic too;
# the exercise does not test that further. On the toy this shows only that the method finds
# neurons that carry the difference it was pointed at, not anything about gender.
# In a real model one would check the same things notebook 07 does: the
# random control with intervals, side effects on unrelated text and tasks, and whether the
# reduction holds on prompts and professions not used to choose the neurons.
