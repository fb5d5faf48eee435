# %% [markdown]
# # Exercise 04 · Which neurons does the key head switch on?
#
# The teaching companion of `notebooks/04_cna.ipynb`. Yu & Ananiadou (2024, Sec. 4) find that
# zeroing one attention head breaks 1-digit addition and subtraction, and ask why. Their
# Comparative Neuron Analysis (CNA, Sec. 4.1) scores every FFN neuron by how much it raises the
# log-probability of the predicted token, once in the original model and once with the key head
# zeroed; the neurons whose importance drops most are the ones the head switches on. Then
# (Table 5) they zero those neurons ("mask") or every other neuron of the deep layers ("keep").
# You write three pieces of that analysis, which notebook 04 gets from `arithlib.yu`:
#
# 1. a neuron's **importance** (Sec. 4.1's equation), read through the final norm as the
#    authors' code does;
# 2. the **top-K neurons** by the change of importance between the two runs;
# 3. the **mask / keep** interventions of Table 5, at the answer position.
#
# Everything runs on the toy model (`toy-arith`: 2 layers, 512 neurons per MLP, one token per
# integer) on every 1-digit + and - case it answers correctly, in the prompt format of the
# paper's head sweep ("3 + 5 =", two solved examples before). The key head (the one whose
# zeroing lowers accuracy most) and the runs of both models are computed for you.

# %%
import pandas as pd
import torch

import arithlib.course.cna_checks as ex
from arithlib.core.readout import final_norm, top_tokens, unembedding

torch.set_grad_enabled(False)
data = ex.cna_data()
bridge, tok = ex.check_model().bridge, ex.check_model().tokenizer
res = data.result  # run_a: the original model, run_b: the key head zeroed
print(
    f"{len(data.prompts)} correct cases; key head L{data.key_head[0]}H{data.key_head[1]}: "
    f"first-token accuracy {res.run_a.accuracy:.0%} -> {res.run_b.accuracy:.0%} with it zeroed"
)
print(
    f"per case and layer, at the answer position: resid_mid {tuple(res.run_a.resid_mid.shape)}, coef {tuple(res.run_a.coef.shape)}"
)

# %% [markdown]
# ## 1 · A neuron's CNA importance
# > **Objective** compute Yu's importance of every neuron of a layer from its equation, reading each vector through the final norm as the authors do · **Difficulty** ●●●○○ · **Importance** ●●●●● · **Time** 20 min
#
# At the answer position, let r = x^{l-1} + A^l be the residual stream after layer l's
# attention (`resid`), m_k neuron k's coefficient (its activation, `coef[k]`) and fc2_k its
# value vector, row k of the layer's output matrix (`bridge.blocks[layer].mlp.W_out`,
# [d_mlp, d_model]). The importance of the neuron for the predicted token w is (Sec. 4.1)
#
#     imp_k = log p(w | r + m_k fc2_k) - log p(w | r),
#
# where p reads a residual vector x as if it were the final hidden state: through the final
# norm and the unembedding. The paper does not say how the norm scales a layer-l vector;
# the authors' code uses ONE fixed scale per case, the RMS of the original run's final hidden
# state h_final at the answer position:
#
#     p(. | x) = softmax(W_U (g * x / s) + b_U),   s = sqrt(mean(h_final^2) + eps),
#
# with g the final norm's weight (the toy model's final norm is an RMSNorm: no centring, no
# bias). `final_norm(bridge)` gives `.weight` (g) and `.eps`; `unembedding(bridge)` gives
# `(W_U [d_model, vocab], b_U [vocab])`. Return the importance of every neuron of the layer,
# [d_mlp]. (The check also scores the head-zeroed run's vectors, with the original run's
# `h_final`: the same scale for both runs.)


# %%
def neuron_importance(
    bridge, layer: int, resid: torch.Tensor, coef: torch.Tensor, h_final: torch.Tensor, target: int
) -> torch.Tensor:
    """imp_k = log p(target | resid + coef[k] W_out[k]) - log p(target | resid) for every neuron
    k of ``layer`` [d_mlp], each vector read as softmax(W_U (g * x / s) + b_U), s the RMS of
    ``h_final``."""
    # BEGIN SOLUTION
    # HINT: the vectors with each neuron added, all at once: `resid[None] + coef[:, None] * W_out` is [d_mlp, d_model]
    # HINT: write `logprob(x)` for a batch of vectors: `((x / s * norm.weight) @ W_U + b_U).log_softmax(-1)[:, target]`; the importance is `logprob(with) - logprob(resid[None])`
    norm = final_norm(bridge)
    W_U, b_U = unembedding(bridge)
    W_out = bridge.blocks[layer].mlp.W_out.float()
    s = torch.sqrt(h_final.pow(2).mean() + norm.eps)

    def logprob(x: torch.Tensor) -> torch.Tensor:
        return ((x / s * norm.weight) @ W_U + b_U).log_softmax(-1)[:, target]

    return logprob(resid[None] + coef[:, None] * W_out) - logprob(resid[None])
    # END SOLUTION


# %%
ex.check_neuron_importance(neuron_importance)

# %% [markdown]
# ## 2 · The neurons the key head switches on
# > **Objective** rank neurons by how much their importance drops when the key head is zeroed, leaving out layers CNA did not score · **Difficulty** ●○○○○ · **Importance** ●●●○○ · **Time** 5 min
#
# CNA computes the importance in both runs, imp_ori in the original model and imp_inv with
# the key head zeroed, and ranks neurons by the change imp_ori - imp_inv (largest first): the
# neurons that lose most when the head is gone. In the head-zeroed run each vector is still
# read with the ORIGINAL run's scale s (same prompts, same reading). `change` is
# [n_layers, d_mlp]; a layer below the key head sees the same input in both runs, and CNA
# leaves its scores NaN (not scored). Return the `k` neurons with the largest change as
# `(layer, neuron)` pairs, best first.


# %%
def top_neurons(change: torch.Tensor, k: int) -> list[tuple[int, int]]:
    """The ``k`` (layer, neuron) with the largest finite ``change`` [n_layers, d_mlp], best first."""
    # BEGIN SOLUTION
    # HINT: replace NaN by `-torch.inf` (`change.nan_to_num(-torch.inf)`), flatten, and take `.topk(k)`
    # HINT: a flat index f is `(f // d_mlp, f % d_mlp)`; keep only the finite scores (`k` may exceed their number)
    flat = change.flatten().nan_to_num(nan=-torch.inf)
    k = min(k, int(torch.isfinite(flat).sum()))
    d_mlp = change.shape[1]
    return [(f // d_mlp, f % d_mlp) for f in flat.topk(k).indices.tolist()]
    # END SOLUTION


# %%
ex.check_top_neurons(top_neurons)

# %% [markdown]
# Table 4 for "3+5" with your two functions: each top neuron's importance and coefficient in
# the original ("a") and head-zeroed ("b") model, and the top tokens of its value vector
# projected on the vocabulary (softmax(E_u fc2_k), Geva et al. 2022).

# %%
i = data.case
rec, target, h_final = data.prompts.records[i], int(res.targets[i]), res.run_a.final_resid[i]
imp = {run_name: torch.full((bridge.cfg.n_layers, bridge.cfg.d_mlp), torch.nan) for run_name in ("a", "b")}
for layer in data.keep_layers:
    for run_name, run in (("a", res.run_a), ("b", res.run_b)):
        imp[run_name][layer] = neuron_importance(
            bridge, layer, run.resid_mid[i, layer], run.coef[i, layer], h_final, target
        )
top = top_neurons(imp["a"] - imp["b"], 5)
values = torch.stack([bridge.blocks[layer].mlp.W_out[n].float() for layer, n in top])
print(f'"{rec.text.strip()}" -> "{tok.decode([target])}"')
pd.DataFrame(
    {
        "neuron": [f"{layer}_{n}" for layer, n in top],
        "imp a": [float(imp["a"][t]) for t in top],
        "imp b": [float(imp["b"][t]) for t in top],
        "coef a": [float(res.run_a.coef[i][t]) for t in top],
        "coef b": [float(res.run_b.coef[i][t]) for t in top],
        "top tokens": [", ".join(t) for t in top_tokens(bridge, tok, values, 8)],
    }
).round(3)

# %% [markdown]
# ## 3 · Mask and keep
# > **Objective** zero a prompt's own neuron set, or every other neuron of the scored layers, at the answer position only · **Difficulty** ●●●○○ · **Importance** ●●●●○ · **Time** 20 min
#
# Table 5 tests the top-K neurons of each case in the original model: "mask" zeroes them;
# "keep" zeroes every OTHER neuron of the deep layers (Yu: layers 17-31 of Llama-7B, those
# from the key head's layer up, which are the layers CNA scores; here `data.keep_layers`),
# so that only the top-K neurons of those layers remain. As notebook 04 does, the neurons are
# zeroed at the answer position (the last token) only, where they were scored; the paper
# zeroes their parameters, which acts at every position.
#
# `sets[i]` is prompt i's list of `(layer, neuron)`; each prompt has its own. Zero the
# coefficients `blocks.{layer}.mlp.hook_post` ([batch, position, d_mlp]) with hooks, run
# `tokens` ([N, T], every prompt of one length) and return the last position's logits
# [N, vocab]. With `keep_layers` None, mask; else keep, in every layer of `keep_layers`
# (also one that holds none of the prompt's neurons: all of its neurons are zeroed).


# %%
def zeroed_logits(
    bridge, tokens: torch.Tensor, sets: list[list[tuple[int, int]]], keep_layers: list[int] | None = None
) -> torch.Tensor:
    """Last-position logits [N, vocab] with each prompt's ``sets[i]`` zeroed (``keep_layers``
    None: "mask") or every other neuron of ``keep_layers`` zeroed ("keep"), at the last
    position only."""
    # BEGIN SOLUTION
    # HINT: build one bool matrix [N, d_mlp] per layer, True where a neuron is zeroed: mask starts all False and sets each prompt's neurons True; keep starts all True on `keep_layers` and sets each prompt's own neurons False
    # HINT: a hook `fn(act, hook)` can do `act[:, -1] = act[:, -1].masked_fill(zero, 0.0)` and return `act`; run with `with bridge.hooks(fwd_hooks=[(name, fn), ...]):` so the hooks are removed afterwards
    N, d_mlp = tokens.shape[0], bridge.cfg.d_mlp
    keep = keep_layers is not None
    layers = list(keep_layers) if keep else sorted({layer for s in sets for layer, _ in s})
    zero = {layer: torch.full((N, d_mlp), keep) for layer in layers}
    for i, s in enumerate(sets):
        for layer, n in s:
            if layer in zero:
                zero[layer][i, n] = not keep

    def hook_for(mask: torch.Tensor):
        def fn(act: torch.Tensor, hook) -> torch.Tensor:
            act[:, -1] = act[:, -1].masked_fill(mask.to(act.device), 0.0)
            return act

        return fn

    hooks = [(f"blocks.{layer}.mlp.hook_post", hook_for(mask)) for layer, mask in zero.items()]
    with bridge.hooks(fwd_hooks=hooks):
        return bridge(tokens)[:, -1]
    # END SOLUTION


# %%
ex.check_zeroed_logits(zeroed_logits)

# %% [markdown]
# Table 5 in small with your functions: the accuracy decrease (%, first answer token, relative
# to the unablated accuracy) when each case's top-K neurons are masked or kept, beside random
# controls the paper does not report (K random neurons of the same layers masked; K random
# neurons of the keep layers kept; mean of 3 draws) and the paper's Llama-7B numbers. The toy
# model has 2 x 512 neurons, so K = 99 is a tenth of them (Llama's layers 17-31: 0.3 %).

# %%
ex.mask_keep_accuracy(top_neurons, zeroed_logits)

# %% [markdown]
# **Questions.** (a) In the head-zeroed run the vectors are read with the original run's
# scale s, not their own. What would normalising each vector by its own RMS do to a neuron's
# importance in an early layer, where the residual stream is small? (b) On the toy model,
# how far does masking the top-K neurons go towards the key head's own effect, and how does
# it compare with a random mask of the same layers? (c) "Keep" spares only K neurons of the
# keep layers. What does the gap between keep and random keep say, and why is random keep
# the control it needs (rather than no intervention)? (d) In the "3+5" table, is every top
# neuron one that the head switches on (a coefficient that shrinks towards 0 without the
# head)? What else can give a large imp_a - imp_b?

# %% [markdown] tags=["solution"]
# **Answers.** (a) A vector divided by its own RMS is read as if it had the final state's
# size. On the toy model the residual stream after layer 0's attention has an RMS of about
# 0.27 at the answer position, against s of about 1.03 for the final hidden state (layer 1:
# 0.61), so every logit of a layer-0 vector is scaled up about 3.9 times (layer 1: 1.7): the
# softmax is sharper and a layer-0 neuron's log-probability change larger; a neuron that
# changes the vector's size also rescales r itself. The own-RMS reading favours early
# neurons: over the cases, the share of layer-0 neurons among each case's top-10 rises from
# 13 % to 23 % (top-99: 38 % to 44 %), and only 71 % of the top-10 are the same in both
# readings (`arithlib.yu.cna_norm.reading_sensitivity`). With one fixed s, every layer and
# both runs are read on the same scale, so their importances can be compared.
# (b) Zeroing the key head (L0H1) takes accuracy from 100 % to 0 %, a 100 % decrease.
# Masking each case's top-10 CNA neurons (10 of the toy model's 1,024) gives a 77 % decrease,
# the top-20 89 %, the top-99 99 % (the paper, Llama-7B: 68 % to 100 %): most of the head's
# effect runs through a handful of neurons per case. A random mask of as many neurons of the
# same layers costs at most 3 % (K = 99).
# (c) The key head sits in layer 0, so CNA scores both layers and keep zeroes every MLP neuron
# of the model but the K kept, at the answer position. Keeping the top-99 leaves 62 % of the
# cases correct (a 38 % decrease), the top-10 only 3 % (97 %); keeping 99 random neurons leaves
# almost none (99.8 %). The top neurons carry far more than any K neurons, yet on the toy model
# a top-10 alone cannot answer (the paper: a 38 % decrease at K = 10). Random keep is the
# control because keep removes almost all of the layers' computation: against no intervention
# every keep looks bad, and only against K random neurons kept does the result say something
# about these K neurons rather than about how many neurons survive.
# (d) Not every one. 1_71 (coefficient 6.49 with the head, -0.30 without), 1_462 (4.14 to
# 0.13) and 1_387 (1.51 to -0.43) lose their activation: the head switches them on. 1_39 is
# driven negative by the head (-4.72 to 0.23), so it helps "8" along -fc2_k (its listed top
# tokens, those of +fc2_k, are what it pushes down). 0_369 is the other kind: its coefficient
# rises from 0.05 to 2.84 without the head and its importance falls from about 0 to -1.06; it
# ranks fourth because, without the head, it pushes against "8". imp_a - imp_b is large for a
# neuron the head activates and for one the head keeps quiet. Only 1_71 and 1_387 have "8"
# among their top tokens (in the paper, every neuron of Table 4 does).
