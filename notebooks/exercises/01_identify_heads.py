# %% [markdown]
# # Exercise 01 · Which attention heads does the model use for arithmetic?
#
# The teaching companion of `notebooks/01_identify_heads.ipynb`. You write, in a few lines
# each, the interventions that notebook gets from `arithlib.methods.patching`:
#
# 1. Zhang et al.'s metric, the **relative logit change** of the answer token;
# 2. **zero-ablating** one attention head (Yu & Ananiadou, Sec. 3.2);
# 3. **activation patching** one head at the answer position (Nikankin et al.);
# 4. Zhang et al.'s **path patching** of one head (Alg. 1, App. B);
# 5. the **path-patching effect of every head**, the heatmap of Zhang's Fig. 2.
#
# Everything runs on the toy model (`toy-arith`: 2 layers x 4 heads, one token per
# integer, trained here in about 4 minutes the first time). After each function, a check
# compares yours with arithlib's on the same prompts and prints ✓, or says what differs.
#
# **Tools.** The model is a TransformerLens `TransformerBridge`. A *hook* is a function
# `fn(activation, hook)` that returns the (edited) activation; run the model with hooks
# inside `with bridge.hooks(fwd_hooks=[(hook_name, fn), ...]):`, where `bridge(tokens)`
# returns the logits `[batch, position, vocab]`. `bridge.run_with_cache(tokens,
# names_filter=[...])` returns `(logits, cache)` with `cache[hook_name]` the activation.
# A head's output is its slice of `blocks.{layer}.attn.hook_z`, shaped
# `[batch, position, head, d_head]` (the input of W_O).

# %%
import pandas as pd
import torch

import arithlib.course.exercises as ex

torch.set_grad_enabled(False)
torch.set_num_threads(1)  # the toy model is tiny: one thread runs it fastest, most of all on a busy machine
toy = ex.check_model()
bridge = toy.bridge
batch = ex.patching_batch()  # Zhang prompts "A + B =" / "A - B =", operator-swapped counterfactuals
print(
    f"{len(batch.prompts)} prompts answered correctly; tokens {tuple(batch.tokens.shape)}; "
    f"{bridge.cfg.n_layers} layers x {bridge.cfg.n_heads} heads"
)
print(batch.prompts.records[0].full_text, "|", batch.prompts.records[0].counterfactual)

# %% [markdown]
# ## 1 · The relative logit change
# > **Objective** score an intervention by its effect on the answer logit, as Zhang et al. do · **Difficulty** ●○○○○ · **Importance** ●●●○○ · **Time** 5 min
#
# Zhang et al. score an intervention by how much it moves the logit of the correct answer
# token, relative to the clean run: s = (logit_patched − logit_clean) / logit_clean
# (their Alg. 1). A key head has a mean s below −5 %. Write it for tensors that broadcast
# (e.g. `[heads, prompts]` against `[prompts]`).


# %%
def relative_logit_change(patched_logit: torch.Tensor, clean_logit: torch.Tensor) -> torch.Tensor:
    """(patched - clean) / clean, elementwise."""
    # BEGIN SOLUTION
    # HINT: one line of tensor arithmetic; broadcasting does the rest
    return (patched_logit - clean_logit) / clean_logit
    # END SOLUTION


# %%
ex.check_relative_logit_change(relative_logit_change)

# %% [markdown]
# ## 2 · Zero-ablate one head
# > **Objective** edit one attention head's output with a hook and read the logits · **Difficulty** ●●○○○ · **Importance** ●●●●○ · **Time** 10 min
#
# Yu & Ananiadou remove a head by zeroing its slice of W_O, which is the same as zeroing
# its output z at every position. Return the logits at the last position, `[batch, vocab]`.


# %%
def zero_head_logits(bridge, tokens: torch.Tensor, layer: int, head: int) -> torch.Tensor:
    """Last-position logits with head (layer, head) zeroed at every position."""

    # BEGIN SOLUTION
    # HINT: a hook on `f"blocks.{layer}.attn.hook_z"` that sets `z[:, :, head] = 0` and returns `z`
    # HINT: `with bridge.hooks(fwd_hooks=[(name, hook)]): logits = bridge(tokens)`
    def hook(z, hook):
        z[:, :, head] = 0.0
        return z

    with bridge.hooks(fwd_hooks=[(f"blocks.{layer}.attn.hook_z", hook)]):
        logits = bridge(tokens)
    return logits[:, -1]
    # END SOLUTION


# %%
ex.check_zero_head_logits(zero_head_logits)

# %% [markdown]
# Which heads matter? First-token accuracy with each head zeroed (Yu's head sweep):

# %%
clean_pred = bridge(batch.tokens)[:, -1].argmax(-1)
sweep = pd.DataFrame(
    [
        {
            "layer": l,
            "head": h,
            "accuracy": float(
                (zero_head_logits(bridge, batch.tokens, l, h).argmax(-1) == batch.answer_ids).float().mean()
            ),
        }
        for l in range(bridge.cfg.n_layers)
        for h in range(bridge.cfg.n_heads)
    ]
)
print(f"clean accuracy {float((clean_pred == batch.answer_ids).float().mean()):.0%}")
sweep.pivot(index="layer", columns="head", values="accuracy")

# %% [markdown]
# ## 3 · Activation patching of one head
# > **Objective** patch one head's output from a counterfactual run into the clean run · **Difficulty** ●●○○○ · **Importance** ●●●●● · **Time** 15 min
#
# Run the counterfactual prompt (operator swapped), keep the head's z at the last
# position, and put it into the clean run at the same place. Everything downstream of the
# head (later heads, MLPs) sees the change.


# %%
def patch_head_logits(bridge, tokens: torch.Tensor, cf_tokens: torch.Tensor, layer: int, head: int) -> torch.Tensor:
    """Last-position logits of ``tokens`` with the head's z at the last position taken from ``cf_tokens``."""
    # BEGIN SOLUTION
    # HINT: `_, cache = bridge.run_with_cache(cf_tokens, names_filter=[name])`, then `z_cf = cache[name]`
    # HINT: then a hook that sets `z[:, -1, head] = z_cf[:, -1, head]` during the clean run
    name = f"blocks.{layer}.attn.hook_z"
    _, cache = bridge.run_with_cache(cf_tokens, names_filter=[name])
    z_cf = cache[name]

    def hook(z, hook):
        z[:, -1, head] = z_cf[:, -1, head]
        return z

    with bridge.hooks(fwd_hooks=[(name, hook)]):
        logits = bridge(tokens)
    return logits[:, -1]
    # END SOLUTION


# %%
ex.check_patch_head_logits(patch_head_logits)

# %% [markdown]
# ## 4 · Path patching of one head (Zhang et al., Alg. 1)
# > **Objective** isolate one head's direct path to the logits by freezing every other head · **Difficulty** ●●●●○ · **Importance** ●●●●○ · **Time** 25 min
#
# Path patching isolates the head's *direct path* through the MLPs: the head's z at the
# last position comes from the counterfactual run, as above, but **every other head is
# frozen at its clean output** (at every position), so later heads cannot pass the change
# on; the MLPs recompute. Return the answer token's logit `[batch]`.


# %%
def path_patch_logit(
    bridge, tokens: torch.Tensor, cf_tokens: torch.Tensor, answer_ids: torch.Tensor, layer: int, head: int
) -> torch.Tensor:
    """Answer-token logit [batch] under path patching of head (layer, head) at the last position."""
    # BEGIN SOLUTION
    # HINT: cache `hook_z` of every layer on the clean and on the counterfactual tokens
    # HINT: in every layer, a hook returns the clean `z` (a copy); in `layer` it also puts the counterfactual `z` of `head` at the last position
    # HINT: `logits[:, -1].gather(1, answer_ids[:, None]).squeeze(1)` reads the answer logit
    names = [f"blocks.{l}.attn.hook_z" for l in range(bridge.cfg.n_layers)]
    _, clean = bridge.run_with_cache(tokens, names_filter=names)
    _, cf = bridge.run_with_cache(cf_tokens, names_filter=names)

    def make_hook(l):
        def hook(z, hook):
            z = clean[names[l]].clone()
            if l == layer:
                z[:, -1, head] = cf[names[l]][:, -1, head]
            return z

        return hook

    with bridge.hooks(fwd_hooks=[(name, make_hook(l)) for l, name in enumerate(names)]):
        logits = bridge(tokens)[:, -1]
    return logits.gather(1, answer_ids[:, None].to(logits.device)).squeeze(1)
    # END SOLUTION


# %%
ex.check_path_patch_logit(path_patch_logit)

# %% [markdown]
# ## 5 · The path-patching effect of every head
# > **Objective** sweep a method over all heads and compare with the paper's heatmap · **Difficulty** ●●○○○ · **Importance** ●●●○○ · **Time** 10 min
#
# Zhang's Fig. 2: the mean over prompts of the relative logit change when each head is
# path-patched. Use your two functions; return `[n_layers, n_heads]`.


# %%
def head_effects(bridge, tokens: torch.Tensor, cf_tokens: torch.Tensor, answer_ids: torch.Tensor) -> torch.Tensor:
    """Mean relative logit change under path patching, per head: [n_layers, n_heads]."""
    # BEGIN SOLUTION
    # HINT: the clean answer logit is `bridge(tokens)[:, -1]` at `answer_ids`
    clean = bridge(tokens)[:, -1].gather(1, answer_ids[:, None]).squeeze(1)
    out = torch.zeros(bridge.cfg.n_layers, bridge.cfg.n_heads)
    for l in range(bridge.cfg.n_layers):
        for h in range(bridge.cfg.n_heads):
            patched = path_patch_logit(bridge, tokens, cf_tokens, answer_ids, l, h)
            out[l, h] = relative_logit_change(patched, clean).mean()
    return out
    # END SOLUTION


# %%
ex.check_head_effects(head_effects)

# %%
effects = head_effects(bridge, batch.tokens, batch.cf_tokens, batch.answer_ids)
table = pd.DataFrame(
    effects.numpy(),
    index=pd.Index(range(bridge.cfg.n_layers), name="layer"),
    columns=pd.Index(range(bridge.cfg.n_heads), name="head"),
)
print(
    "key heads (mean effect below -5 %):",
    [(l, h) for l in range(effects.shape[0]) for h in range(effects.shape[1]) if effects[l, h] < -0.05],
)
table.style.format("{:+.1%}").background_gradient(cmap="RdBu", vmin=-0.5, vmax=0.5)

# %% [markdown]
# **Questions.** (a) Which heads are key heads, and are they the heads whose zero-ablation
# hurt accuracy most in section 2? (b) Why do path patching and activation patching give
# the same number for every head of the last layer? (c) Zhang's counterfactual swaps the
# operator: what would a counterfactual that changes an operand find instead?

# %% [markdown] tags=["solution"]
# **Answers** (toy model, these prompts). (a) Path patching finds two key heads in layer 0
# (L0H2 about −33 %, L0H3 about −21 %). Zeroing hurts most elsewhere: without L0H0 or L0H1
# the model answers no prompt, yet their path-patching effect is about 0. Zeroing removes
# everything a head writes; patching with an operator-swapped counterfactual moves only
# what depends on the operator. So L0H2 and L0H3 carry the operator, and L0H0 and L0H1
# probably carry the operands (test it with (c)). (b) Above a last-layer head lie only its
# own layer's MLP and the unembedding: there is no later head to freeze, so both methods
# run the same computation. (c) Heads that move the operands to the answer position:
# build counterfactuals with another operand (as Nikankin et al. do, notebook 01 section 6)
# and rerun `head_effects`.
