# %% [markdown]
# # Exercise 08 · Which weights does precise SFT train, on which loss?
#
# The teaching companion of `notebooks/08_precise_sft.ipynb`. Zhang et al. (2024, Sec. 4.3,
# Alg. 2; Sec. 5.3) fine-tune only the attention heads that path patching found to matter for
# arithmetic ("precise SFT"): each key head's slices of W_Q, W_K, W_V, W_O move, every other
# weight stays frozen, and the gradient of a layer's slices is multiplied by H/h (H heads in the
# layer, h of them tuned). Their Table 2 (and App. G, Table 5) also adds whole MLPs. You write
# the three pieces that notebook gets from `arithlib.zhang.sft` and `arithlib.methods`:
#
# 1. the **gradient masks**: which entries of which parameters precise SFT trains;
# 2. the **answer-only loss**: cross-entropy on the answer tokens, none on the prompt;
# 3. **one step of Alg. 2**: the masked, rescaled gradient step.
#
# Everything runs on the toy model (`toy-arith`: 2 layers of 4 heads each, one token per
# integer; grouped-query attention, 2 KV heads per layer), and it ends with a few steps of
# precise SFT against full SFT.

# %%
from collections import Counter

import pandas as pd
import torch
import torch.nn.functional as F
from IPython.display import display

import arithlib.course.sft_checks as ex
from arithlib.methods.model_weights import model_shape, params_by_clean_name

hf = ex.toy_hf()  # the toy model as a plain Hugging Face model (arithlib trains this one)
shape = model_shape(hf)
print(shape)
ranked = ex.ranked_heads()  # Zhang's path-patching effect of each head (notebook 01), most negative first
key = [(int(r.layer), int(r.head)) for r in ranked.itertuples() if r.key]
print("key heads (effect < -5 %):", key)
ranked.head(4)

# %% [markdown]
# ## 1 · The gradient masks of precise SFT
# > **Objective** turn "train head (i, j)" into the exact entries of W_Q, W_K, W_V, W_O it owns · **Difficulty** ●●●○○ · **Importance** ●●●●● · **Time** 20 min
#
# In Zhang's notation head (i, j) has W_Q^{i,j}, W_K^{i,j}, W_V^{i,j} ∈ R^{d × d/H} and
# W_O^{i,j} ∈ R^{d/H × d} (Sec. 3), and W_O^i = [W_O^{i,1}, ..., W_O^{i,H}] is split into equal
# blocks per head (Sec. 4.3). In a Hugging Face model every projection is an `nn.Linear`, whose
# weight is stored as **[out, in]**: head h's slice of `q_proj.weight` is its d_head **rows**
# h·d_head ... (h+1)·d_head (the head's query outputs), and its slice of `o_proj.weight` is the
# same range of **columns** (o_proj reads the heads' concatenated outputs z). A head's rows of a
# q/k/v **bias** belong to it too; the o_proj bias is added once after the heads are summed, so
# no head owns it.
#
# With grouped-query attention (the toy: 4 query heads, 2 KV heads) a query head has no K/V of
# its own: consecutive heads share one, head h reads KV group g = h // (n_heads / n_kv_heads).
# arithlib (as notebook 08) trains **the rows of that group** of `k_proj` and `v_proj`, once
# however many chosen heads read it. Each layer in `mlps` has its MLP trained whole.
#
# Return `{parameter name: bool mask of its shape}` for every parameter with a trained entry.
# Names are those of `params`: `model.layers.{i}.self_attn.q_proj.weight`, `...k_proj.bias`,
# `model.layers.{i}.mlp.up_proj.weight`, ...


# %%
def precise_masks(
    params: dict[str, torch.Tensor],
    heads: list[tuple[int, int]],
    mlps: list[int],
    n_heads: int,
    n_kv_heads: int,
) -> dict[str, torch.Tensor]:
    """Bool masks of the entries precise SFT trains: the Q rows and O columns of each head in
    ``heads`` (layer, head), the K/V rows of the KV group it reads (biases with their rows), and
    every entry of the MLPs of the layers ``mlps``."""
    # BEGIN SOLUTION
    # HINT: `d_head = params[f"model.layers.{layer}.self_attn.q_proj.weight"].shape[0] // n_heads`; head h owns rows `h * d_head:(h + 1) * d_head` of q_proj (weight and bias) and the same *columns* of `o_proj.weight`
    # HINT: its KV group is `g = h // (n_heads // n_kv_heads)`: rows `g * d_head:(g + 1) * d_head` of `k_proj` and `v_proj` (weight and bias, when `name in params`)
    # HINT: an MLP of `mlps` is every parameter whose name starts with `f"model.layers.{layer}.mlp."`: a mask of ones
    masks: dict[str, torch.Tensor] = {}

    def mask(name: str) -> torch.Tensor:
        return masks.setdefault(name, torch.zeros(params[name].shape, dtype=torch.bool))

    for layer, h in heads:
        pre = f"model.layers.{layer}.self_attn."
        d_head = params[pre + "q_proj.weight"].shape[0] // n_heads
        own = slice(h * d_head, (h + 1) * d_head)
        g = h // (n_heads // n_kv_heads)
        group = slice(g * d_head, (g + 1) * d_head)
        for proj, rows in (("q_proj", own), ("k_proj", group), ("v_proj", group)):
            for suffix in ("weight", "bias"):
                if pre + f"{proj}.{suffix}" in params:
                    mask(pre + f"{proj}.{suffix}")[rows] = True
        mask(pre + "o_proj.weight")[:, own] = True
    for layer in mlps:
        for name, p in params.items():
            if name.startswith(f"model.layers.{layer}.mlp."):
                masks[name] = torch.ones(p.shape, dtype=torch.bool)
    return masks
    # END SOLUTION


# %%
ex.check_precise_masks(precise_masks)

# %% [markdown]
# What precise SFT of the toy's key heads trains, beside full SFT (every parameter):

# %%
params = params_by_clean_name(hf)
masks = precise_masks(params, key, [], shape["n_heads"], shape["n_kv_heads"])
total = sum(p.numel() for p in params.values())
table = pd.DataFrame(
    [
        {"parameter": n, "shape": tuple(m.shape), "trained entries": int(m.sum()), "of": m.numel()}
        for n, m in masks.items()
    ]
)
print(f"precise SFT of {key}: {int(table['trained entries'].sum()):,} of {total:,} parameters", end=" ")
print(f"({table['trained entries'].sum() / total:.1%}); full SFT: all {total:,}")
table

# %% [markdown]
# ## 2 · The answer-only loss
# > **Objective** compute the fine-tuning loss on exactly the answer tokens, with the right shift and reduction · **Difficulty** ●●○○○ · **Importance** ●●●●○ · **Time** 15 min
#
# Fine-tuning (notebook 08, like Zhang's SFT) is teacher-forced: the model reads prompt + answer
# and is scored only on the answer, each answer token given its predecessors. With logits
# [B, T, vocab] on `tokens` [B, T] (prompt then answer, right-padded), the logits at position t
# predict token t + 1, so answer token k of row b (at position p_b + k, p_b = `prompt_len[b]`) is
# predicted at position p_b - 1 + k:
#
# L = - (1 / Σ_b a_b) Σ_b Σ_{k < a_b} log softmax(logits[b, p_b - 1 + k])[tokens[b, p_b + k]]
#
# with a_b = `answer_len[b]`: the mean over **all answer tokens of the batch** (a negative
# answer, "-" then "58", counts twice), as `F.cross_entropy(..., ignore_index=-100)` averages.
# Prompt and padding positions carry no loss.


# %%
def answer_only_loss(
    logits: torch.Tensor, tokens: torch.Tensor, prompt_len: torch.Tensor, answer_len: torch.Tensor
) -> torch.Tensor:
    """Mean cross-entropy over the batch's answer tokens (each predicted from its
    predecessors), a scalar tensor."""
    # BEGIN SOLUTION
    # HINT: make `targets` [B, T] full of -100 (ignored) and put row b's answer tokens `tokens[b, p:p + a]` at the positions that predict them, `p - 1:p - 1 + a`
    # HINT: `F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)` averages over the targets that are not ignored
    targets = torch.full(tokens.shape, -100, dtype=torch.long)
    for row in range(tokens.shape[0]):
        p, a = int(prompt_len[row]), int(answer_len[row])
        targets[row, p - 1 : p - 1 + a] = tokens[row, p : p + a]
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
    # END SOLUTION


# %%
ex.check_answer_only_loss(answer_only_loss)

# %% [markdown]
# How much of a sentence the loss reads, and what it would read with the prompt included (the
# operands of the question and the few-shot examples, which no model can predict):

# %%
b = ex.loss_batch()
T = b.tokens.shape[1]
in_text = torch.arange(T - 1)[None] < (b.prompt_len + b.answer_len - 1)[:, None]
nll = -b.logits[:, :-1].log_softmax(-1).gather(-1, b.tokens[:, 1:, None])[..., 0]
print(repr(b.prompts.records[-3].full_text + b.prompts.records[-3].answer_text))
pd.DataFrame(
    [
        {
            "loss": "answer tokens only",
            "tokens": int(b.answer_len.sum()),
            "nats/token": float(answer_only_loss(b.logits, b.tokens, b.prompt_len, b.answer_len)),
        },
        {"loss": "every token of the text", "tokens": int(in_text.sum()), "nats/token": float(nll[in_text].mean())},
    ]
).round(3)

# %% [markdown]
# ## 3 · One step of precise SFT
# > **Objective** write Alg. 2's update: only the masked entries move, scaled by H/h · **Difficulty** ●●○○○ · **Importance** ●●●○○ · **Time** 15 min
#
# Alg. 2 sets `requires_grad` on the key heads' weights, computes the loss, back-propagates and
# moves each trained entry down its gradient: θ ← θ − η · (H/h) · ∇L(θ), the factor H/h
# (`scales[name]`, 1 where absent: an MLP) following Yu et al. (2023). A whole projection matrix
# gets a gradient; the mask (`masks.get(name)`, None for a parameter trained whole) keeps only
# the head's slice. Write one step of plain SGD, in place on the parameters of `params` (the
# rest of the model is frozen already). A parameter may still hold the `.grad` of an earlier
# step: clear it first. Return the loss before the step.


# %%
def precise_sgd_step(
    params: dict[str, torch.nn.Parameter],
    masks: dict[str, torch.Tensor],
    scales: dict[str, float],
    loss_fn,
    lr: float,
) -> float:
    """One SGD step of Zhang's Alg. 2 in place: p -= lr * scales[name] * mask * grad of
    ``loss_fn()``; returns that loss."""
    # BEGIN SOLUTION
    # HINT: for every parameter: `p.grad = None` and `p.requires_grad_(True)`; then `loss = loss_fn()` and `loss.backward()`
    # HINT: under `torch.no_grad()`: `g = p.grad * scales.get(name, 1.0)`, times `masks[name]` when there is one, and `p.sub_(lr * g)`
    for p in params.values():
        p.grad = None
        p.requires_grad_(True)
    loss = loss_fn()
    loss.backward()
    with torch.no_grad():
        for name, p in params.items():
            g = p.grad * scales.get(name, 1.0)
            if name in masks:
                g = g * masks[name].to(g.dtype)
            p.sub_(lr * g)
    return loss.item()
    # END SOLUTION


# %%
ex.check_precise_sgd_step(precise_sgd_step)

# %% [markdown]
# With your three functions: 12 SGD steps (2 epochs of 6 batches of 16, lr 0.03) on "A plus B is" /
# "A minus B is" sentences, a wording the toy model never saw (it was trained on "A+B=C" lines),
# tuning the key heads with your masks (H/h per layer) or every parameter (full SFT). Accuracy
# is on held-out sentences of that wording and on the toy's own wording ("A + B =").

# %%
masks = precise_masks(params, key, [], shape["n_heads"], shape["n_kv_heads"])
per_layer = Counter(layer for layer, _ in key)
scales = {n: shape["n_heads"] / per_layer[int(n.split(".")[2])] for n in masks}  # H / h of the head's layer
runs = {
    f"precise SFT {key}": (list(masks), masks, scales),
    "full SFT": (list(params), {}, {}),
}
rows, results = [], {}
for method, (names, m, s) in runs.items():
    results[method] = r = ex.sgd_run(precise_sgd_step, names, m, s, lr=0.03)
    rows.append(
        {
            "method": method,
            "trained": sum(int(m[n].sum()) if n in m else params[n].numel() for n in names),
            "loss first step": r["losses"][0],
            "loss last 4 steps": sum(r["losses"][-4:]) / 4,
            **{f"{k} before": v for k, v in r["accuracy_before"].items()},
            **{f"{k} after": v for k, v in r["accuracy_after"].items()},
        }
    )
display(pd.DataFrame(rows).round(3))
print("Which entries moved under precise SFT:")
ex.moved_table(results[f"precise SFT {key}"], masks)

# %% [markdown]
# **Questions.** (a) Why is a head's slice of `o_proj.weight` a block of columns while its slice
# of `q_proj.weight` is a block of rows? What would masking rows of W_O train instead? (b) With
# grouped-query attention, training "head 2's K/V" changes what other heads read. Which heads,
# here? (c) Why is the loss taken on the answer tokens only? Compare the two losses of the table
# after exercise 2. (d) In the toy model the key heads sit in layer 0. What did 12 steps of
# precise SFT do to the toy's own wording, and why might a 2-layer model differ from Zhang's
# LLaMA2-7B, where the 32 key heads sit in the middle of 32 layers?

# %% [markdown] tags=["solution"]
# **Answers.** (a) `nn.Linear` computes x @ W.T with W stored [out, in]. W_Q's outputs are the
# query vectors of all heads side by side, so a head's rows of W_Q produce its query; W_O's
# inputs are the heads' concatenated outputs z, so a head's d_head *columns* of W_O read its z.
# Rows of W_O are dimensions of the residual stream: masking them would train a piece of every
# head's write (32 of the 128 residual dimensions per head), not one head. (b) Heads 2 and 3 of
# layer 0 both read KV group 1 (2 // 2 = 3 // 2 = 1), so training head 2's K/V also changes what
# head 3 reads; here both are key heads, and the group's rows are trained once (4,096 entries
# each of W_K and W_V). (c) The prompt's operands and few-shot examples are arbitrary: no model
# can predict them, so their loss is large and mostly irreducible (18.6 nats per token of the
# text against 14.5 per answer token on the toy), and the text has 768 tokens against 40 answer
# tokens, so they would dominate the gradient. What fine-tuning should teach is the answer.
# (d) Precise SFT of the two key heads trains 24,576 of the toy's 794,752 parameters (3.1 %);
# only those entries moved. In 12 steps both methods lower the training loss on the new wording
# (from 22.3 to 5.9 nats per answer token for precise SFT, to 6.7 for full SFT), neither yet
# answers a held-out sentence of it (0 % before and after), and both break the toy's own wording
# (95.8 % before, 0 % after): here precise SFT kept nothing that full SFT lost. In a 2-layer
# model the key heads of layer 0 feed everything after them, so there is no "rest of the model"
# that tuning them leaves alone; in LLaMA2-7B the 32 tuned heads are 3 % of 1,024, in the middle
# of the network, and general ability rests on many components precise SFT does not touch (and
# Zhang train at lr 2e-5 with AdamW, not 12 large SGD steps).
