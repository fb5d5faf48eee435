# %% [markdown]
# # Exercise 03 · Do neurons do arithmetic as a bag of heuristics?
#
# The teaching companion of `notebooks/03_neuron_heuristics.ipynb`. Nikankin et al. (2025,
# Sec. 4) find that the MLP neurons a model needs for arithmetic each fire on a simple rule of
# the operands or the result ("op1 in [0, 14]", "result = 3 mod 5", ...) and that a prompt is
# answered by the sum of the rules it happens to satisfy. You write three pieces of their
# analysis, which that notebook gets from `arithlib.nikankin`:
#
# 1. the **match score** of a neuron with a rule (Sec. 4.1): does the neuron fire on the
#    prompts that satisfy the rule?
# 2. a prompt's **associated heuristic neurons** (Sec. 4.2): the circuit neurons labelled with
#    a rule the prompt satisfies;
# 3. the **disjoint, layer-matched random control** of their prompt knockout (Fig. 8): zeroing
#    a prompt's associated neurons should hurt it more than zeroing as many other circuit
#    neurons of the same layers.
#
# Everything runs on the toy model (`toy-arith`: one token per integer) on the grid of every
# sum a + b with operands 0..29. The circuit (20 neurons of the last layer's MLP, chosen by
# attribution patching) and the rules that label its neurons are computed for you.

# %%
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

import arithlib.course.heuristic_checks as ex

data = ex.heuristic_data()
an = data.analysis
print(
    f"{len(an.grid)} prompts ({an.grid_correct_first.mean():.0%} answered correctly); "
    f"{len(an.circuit)} circuit neurons; {len(an.heuristics)} rules that can be judged on this grid"
)
print("e.g.", [h.name for h in an.heuristics[:6]])

# %% [markdown]
# ## 1 · The match score of a neuron with a rule
# > **Objective** turn "this neuron fires on this rule's prompts" into a number that does not favour wide rules · **Difficulty** ●●○○○ · **Importance** ●●●●○ · **Time** 15 min
#
# A rule h is satisfied by s_h of the N grid prompts. Take the neuron's s_h top-activating
# prompts; the match score is the share of them that satisfy h. A neuron that fires exactly on
# h's prompts scores 1; one unrelated to h scores about h's base rate s_h / N. The top set is
# matched to the rule's size, so that a wide rule is not easier to match than a narrow one.
# A neuron is labelled with h when its score is at least t = 0.6.


# %%
def match_score(acts: np.ndarray, satisfies: np.ndarray) -> float:
    """The share of the neuron's s_h top-activating prompts that satisfy the rule; ``acts`` [N]
    the neuron's activations, ``satisfies`` [N] bool."""
    # BEGIN SOLUTION
    # HINT: `s = satisfies.sum()`; the top set is `np.argsort(-acts)[:s]`
    # HINT: the score is the mean of `satisfies` over the top set
    s = int(satisfies.sum())
    top = np.argsort(-acts, kind="stable")[:s]
    return float(satisfies[top].mean())
    # END SOLUTION


# %%
ex.check_match_score(match_score)

# %% [markdown]
# Each circuit neuron's best match score, beside the best score of the same neuron with its
# activations shuffled over the grid (the chance level):

# %%
best = [
    max(match_score(data.acts[:, j], an.assoc[h].astype(bool)) for h in range(len(an.heuristics)))
    for j in range(len(an.circuit))
]
shuffled = np.random.default_rng(0).permuted(data.acts, axis=0)
null = [
    max(match_score(shuffled[:, j], an.assoc[h].astype(bool)) for h in range(len(an.heuristics)))
    for j in range(len(an.circuit))
]
fig, ax = plt.subplots(figsize=(5, 3))
ax.hist([best, null], bins=np.linspace(0, 1, 21), label=["circuit neurons", "activations shuffled"])
ax.axvline(0.6, color="k", ls="--", label="t = 0.6")
ax.set(xlabel="best match score of the neuron (share)", ylabel="neurons", title="toy model, a + b, operands 0..29")
ax.legend()
plt.show()

# %% [markdown]
# ## 2 · A prompt's associated heuristic neurons
# > **Objective** link a prompt to the neurons whose rules it satisfies · **Difficulty** ●●○○○ · **Importance** ●●●○○ · **Time** 10 min
#
# `an.matches` has one row per circuit neuron and rule it matches at t: columns `layer`,
# `neuron`, `heuristic` (the rule's name) and `h_index` (the rule's index in `heuristics`).
# Return the neurons (as `(layer, neuron)`, sorted, each once) labelled with a rule that the
# prompt satisfies. A rule `h` tests operands and result arrays: `h.mask(a, b, result)`.


# %%
def associated_neurons(matches: pd.DataFrame, heuristics: list, record) -> list[tuple[int, int]]:
    """The neurons of ``matches`` labelled with a rule that ``record`` (with ``.a``, ``.b``,
    ``.answer``) satisfies, sorted, each once."""
    # BEGIN SOLUTION
    # HINT: a rule holds for the prompt when `heuristics[h].mask(np.array([record.a]), np.array([record.b]), np.array([record.answer]))[0]`
    # HINT: loop over the rows of `matches` (`zip(matches["layer"], matches["neuron"], matches["h_index"])`) and keep a set
    a, b, c = np.array([record.a]), np.array([record.b]), np.array([record.answer])
    found = {
        (int(layer), int(k))
        for layer, k, h in zip(matches["layer"], matches["neuron"], matches["h_index"])
        if heuristics[int(h)].mask(a, b, c)[0]
    }
    return sorted(found)
    # END SOLUTION


# %%
ex.check_associated_neurons(associated_neurons)

# %%
rec = an.grid.records[len(an.grid) // 3]
mine = associated_neurons(an.matches, list(an.heuristics), rec)
rules = an.matches[[(int(a), int(b)) in set(mine) for a, b in zip(an.matches["layer"], an.matches["neuron"])]]
print(f"{rec.a} + {rec.b} = {rec.answer}: {len(mine)} associated neurons of {len(an.circuit)}")
rules[["layer", "neuron", "heuristic", "score"]].head(10)

# %% [markdown]
# ## 3 · The control of the prompt knockout
# > **Objective** build a control that differs from the tested set only in being unrelated to the prompt · **Difficulty** ●●●○○ · **Importance** ●●●●● · **Time** 20 min
#
# Nikankin et al. zero a prompt's associated neurons and, as a control, as many circuit
# neurons drawn at random. A fair control is **layer-matched** (as many from each layer as
# the tested set takes there: layers differ in how much they matter) and **disjoint** (none
# of the tested neurons). Given the tested neurons per layer, `{layer: [neuron, ...]}`, draw
# the control with `rng` (a numpy Generator) from each layer's circuit neurons minus the
# tested ones, and return it sorted per layer. When some layer has too few such neurons, no
# fair control exists: return `None` (the prompt is not testable).


# %%
def draw_control(ablated: dict[int, list[int]], circuit: list[tuple[int, int]], rng: np.random.Generator):
    """{layer: sorted neurons} drawn at random, layer by layer, from the circuit's neurons of that
    layer that are not ablated; None when a layer has fewer of them than it ablates."""
    # BEGIN SOLUTION
    # HINT: first group the circuit by layer: `{layer: set of neurons}`; a layer's pool is that set minus `ablated[layer]`
    # HINT: `rng.choice(sorted(pool), size=len(ks), replace=False)` draws without replacement
    by_layer: dict[int, set[int]] = {}
    for layer, k in circuit:
        by_layer.setdefault(int(layer), set()).add(int(k))
    pools = {layer: sorted(by_layer.get(layer, set()) - set(ks)) for layer, ks in ablated.items()}
    if any(len(pools[layer]) < len(ks) for layer, ks in ablated.items()):
        return None
    return {
        layer: sorted(int(k) for k in rng.choice(pools[layer], size=len(ks), replace=False)) if ks else []
        for layer, ks in ablated.items()
    }
    # END SOLUTION


# %%
ex.check_draw_control(draw_control)

# %% [markdown]
# With your two functions: on 60 held-out prompts, zero each prompt's associated neurons (at
# most 5 per layer, those labelled with the most of its rules first) or as many from your
# control, at the answer position, and read whether the first answer token is still right.

# %%
ex.knockout_accuracy(associated_neurons, draw_control, cap=5)

# %% [markdown]
# **Questions.** (a) Why is the top set of the match score as large as the rule's set, not a
# fixed 10 prompts? What would a fixed size favour? (b) Where does the histogram of shuffled
# activations sit, and what does that say about t = 0.6 on this grid? (c) Why must the control
# be disjoint and layer-matched? What would a control drawn from every layer, or one that may
# overlap the tested neurons, measure instead?

# %% [markdown] tags=["solution"]
# **Answers.** (a) With a fixed top set, a wide rule (satisfied by half the grid) would be
# matched by almost any neuron and a narrow one (a few prompts) by almost none: the score would
# measure the rule's width as much as the neuron. With the top set as large as the rule's set,
# an unrelated neuron scores the rule's base rate whatever its width, and a perfect one scores 1.
# (b) Shuffling keeps each neuron's distribution of activations and breaks its link to the
# operands: the shuffled neurons' best scores are the chance level. Where they reach t (wide
# rules have base rates up to 0.5, and the best of some 200 rules is higher still), a label at
# t = 0.6 is not evidence on its own; notebook 03 therefore tests each label against a
# shuffled-operand null. (c) The question is whether *these* neurons matter for *this* prompt
# more than other circuit neurons do. A control that may overlap the tested set shares part of
# its effect and narrows the gap; one drawn from every layer swaps neurons of an important layer
# for neurons of an unimportant one (or the reverse), so the gap would measure the layers, not
# the association.
