# %% [markdown]
# # Exercise 02 · What do the layers read and write at the answer position?
#
# The teaching companion of `notebooks/02_mlp_probing.ipynb`. You write three readouts of
# the residual stream at the answer position (the last token), which that notebook gets
# from `arithlib.zhang.lens`, `arithlib.zhang.mlp_curves` and `arithlib.zhang.probing`:
#
# 1. the **logit lens**: read each layer's residual stream through the final norm and the
#    unembedding, as if the model stopped there;
# 2. Zhang et al.'s **MLP cosine** cos(MLP_out − MLP_in, W_U[C]): does an MLP write the
#    answer C's direction (Sec. 5.2, Fig. 6b)?
# 3. a **linear probe**: can a linear map read operand A, operand B or the result from the
#    residual stream, on operand pairs it was not fitted on?
#
# Everything runs on the toy model (`toy-arith`: 2 layers, d_model 128, one token per
# integer). After each function, a check compares yours with arithlib's and prints ✓, or
# says what differs.
#
# **Data.** `arithlib.zhang.answer_cache.cache_answer_position` has run the prompts once and
# kept, at the answer position, `cache.acts[kind]` `[prompts, layers, d_model]` for `resid_pre`,
# `resid_post` (the stream before and after each block), `mlp_in` and `mlp_out` (the MLP's
# input, after its norm, and its output). `lens.lens_stack(cache)` stacks the embedding
# (layer −1) and the stream after every block: `[prompts, 1 + n_layers, d_model]`.

# %%
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import torch

import arithlib.course.exercises as ex
import arithlib.zhang.lens as lens
import arithlib.zhang.mlp_curves as MC

torch.set_grad_enabled(False)
torch.set_num_threads(1)  # the toy model is tiny: one thread runs it fastest, most of all on a busy machine
bridge = ex.check_model().bridge
data = ex.answer_batch()  # correctly answered Zhang prompts "A + B =" / "A - B =", 2-shot
stack, layers = lens.lens_stack(data.cache)
print(f"{len(data.prompts)} prompts; residual stack {tuple(stack.shape)} for layers {layers}")

# %% [markdown]
# ## 1 · The logit lens
# > **Objective** read each layer's residual stream through the final norm and the unembedding · **Difficulty** ●●○○○ · **Importance** ●●●●○ · **Time** 15 min
#
# For each prompt and each row of `resid` (layer −1 = the embedding), apply the final norm
# (`bridge.ln_final`) and the unembedding (`bridge.W_U` `[d_model, vocab]`, `bridge.b_U`),
# take the log-softmax over the vocabulary, and return the answer token's log-probability
# and its rank (0 = the top prediction; the number of tokens with a higher log-probability).


# %%
def logit_lens(bridge, resid: torch.Tensor, answer_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprob, rank) of the answer token, each [prompts, rows of resid]."""
    # BEGIN SOLUTION
    # HINT: `logits = bridge.ln_final(resid) @ bridge.W_U + bridge.b_U`, then `.log_softmax(-1)`
    # HINT: pick the answer: `lp.gather(-1, answer_ids[:, None, None].expand(-1, resid.shape[1], 1))`
    # HINT: the rank is how many log-probabilities exceed the answer's
    logprobs = (bridge.ln_final(resid) @ bridge.W_U + bridge.b_U).log_softmax(-1)
    index = answer_ids[:, None, None].expand(-1, resid.shape[1], 1).to(logprobs.device)
    answer = logprobs.gather(-1, index).squeeze(-1)
    rank = (logprobs > answer[..., None]).sum(-1)
    return answer, rank
    # END SOLUTION


# %%
ex.check_logit_lens(logit_lens)

# %%
logprob, rank = logit_lens(bridge, stack, data.answer_ids)
pd.DataFrame(
    {
        "layer": layers,
        "top-1 share": (rank == 0).float().mean(0).numpy(),
        "mean probability": logprob.exp().mean(0).numpy(),
        "median rank": rank.float().median(0).values.numpy(),
    }
)

# %% [markdown]
# ## 2 · Does the MLP write the answer? cos(MLP_out − MLP_in, W_U[C])
# > **Objective** compare what an MLP writes with the answer's unembedding direction · **Difficulty** ●○○○○ · **Importance** ●●●○○ · **Time** 10 min
#
# Zhang et al. compare what an MLP adds with the unembedding direction of the answer C
# (the column `W_U[:, C]`). Return the cosine per prompt and layer, `[prompts, layers]`.


# %%
def delta_cosine(
    mlp_in: torch.Tensor, mlp_out: torch.Tensor, W_U: torch.Tensor, answer_ids: torch.Tensor
) -> torch.Tensor:
    """cos(mlp_out - mlp_in, W_U[:, answer]) per prompt and layer: [prompts, layers]."""
    # BEGIN SOLUTION
    # HINT: `W_U[:, answer_ids].T` is `[prompts, d_model]`; add a layer axis to broadcast
    # HINT: `torch.nn.functional.cosine_similarity(a, b, dim=-1)`
    direction = W_U[:, answer_ids].T[:, None, :]
    return torch.nn.functional.cosine_similarity(mlp_out - mlp_in, direction, dim=-1)
    # END SOLUTION


# %%
ex.check_delta_cosine(delta_cosine)

# %%
W_U = MC.unembed_matrix(bridge)
cos_c = delta_cosine(data.cache.acts["mlp_in"], data.cache.acts["mlp_out"], W_U, data.answer_ids)
wrong = data.answer_ids.roll(1)  # another prompt's answer: a baseline direction
cos_wrong = delta_cosine(data.cache.acts["mlp_in"], data.cache.acts["mlp_out"], W_U, wrong)
fig, ax = plt.subplots(figsize=(4, 3))
ax.plot(cos_c.mean(0).numpy(), "o-", label="answer C")
ax.plot(cos_wrong.mean(0).numpy(), "s--", label="another prompt's answer")
ax.set(xlabel="layer", ylabel="mean cosine", title="MLP_out − MLP_in vs W_U")
ax.legend()
plt.show()

# %% [markdown]
# ## 3 · A linear probe
# > **Objective** tell a linearly decodable quantity from one the model outputs, on held-out operand pairs · **Difficulty** ●●○○○ · **Importance** ●●●●○ · **Time** 15 min
#
# `ex.probe_data()` holds the residual stack of Yu's 2-digit + and − prompts, the labels
# (`a`, `b`, `result`) and a train/test split grouped by operand pair (a pair is never on
# both sides, so a probe cannot pass by remembering pairs). Fit a linear regression from
# the activations to the label on the training rows and return its R² on the test rows.
# Standardise the features and regularise (the activations have 128 dimensions and there
# are only about 90 training rows).


# %%
def probe_r2(x_train: np.ndarray, y_train: np.ndarray, x_test: np.ndarray, y_test: np.ndarray) -> float:
    """Held-out R^2 of a linear probe fitted on (x_train, y_train)."""
    # BEGIN SOLUTION
    # HINT: `sklearn.pipeline.make_pipeline(StandardScaler(), RidgeCV(alphas=np.logspace(-1, 5, 13)))`
    # HINT: `.fit(x_train, y_train)`, then `.score(x_test, y_test)` is the R²
    from sklearn.linear_model import RidgeCV
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    probe = make_pipeline(StandardScaler(), RidgeCV(alphas=np.logspace(-1, 5, 13)))
    return float(probe.fit(x_train, y_train).score(x_test, y_test))
    # END SOLUTION


# %%
ex.check_probe_r2(probe_r2)

# %%
pdata = ex.probe_data()
x = pdata.acts.numpy()
scores = pd.DataFrame(
    [
        {
            "target": t,
            "layer": layer,
            "R2": probe_r2(
                x[pdata.train, i],
                pdata.labels[t].to_numpy()[pdata.train],
                x[pdata.test, i],
                pdata.labels[t].to_numpy()[pdata.test],
            ),
        }
        for t in ("a", "b", "result")
        for i, layer in enumerate(pdata.layers)
    ]
)
scores.pivot(index="target", columns="layer", values="R2").round(3)

# %% [markdown]
# **Questions.** (a) At which layer does the logit lens first rank the answer on top, and
# does the MLP cosine rise there too? (b) Why is every probe's R² about 0 at layer −1?
# (c) A probe reads the result well after layer 0 although the model's own readout (the
# logit lens) does not rank it first there. What is the difference between "linearly
# decodable" and "written in the unembedding's direction"?

# %% [markdown] tags=["solution"]
# **Answers** (toy model, these prompts). (a) Only after layer 1, the last block: there
# the answer is on top for every prompt; after layer 0 for about one prompt in eight
# (median rank 4, in the top 10 for about 80 %). The MLP cosine with W_U[C] is above the
# baseline (another prompt's answer) in both MLPs, and the gap is widest in layer 1's MLP,
# which writes C and pushes the other number away: the answer takes its final form in
# the last layer. (b) Layer −1 is the embedding of the answer position's own token, "=",
# the same for every prompt: there is nothing to read. (c) A probe may use any direction,
# fitted for the purpose; the logit lens reads only the unembedding's directions. The
# operands and the result are decodable after layer 0 (R² above 0.9) although the model
# does not yet output the result there: information can be present long before it is put
# in the form the output reads.
