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
# # 03 · Neuron heuristics: the neuron circuit, heuristic types, their ablations and their emergence in training
#
# **Results** (qwen2.5-coder-0.5b, the committed run): [this notebook executed, with its outputs](../figures/qwen2.5-coder-0.5b/notebooks/03_neuron_heuristics.ipynb) · [its section of the report](../figures/qwen2.5-coder-0.5b/REPORT.md#notebook-03)
#
# **Running it.** Run as it is (Run All), this notebook takes about 25 minutes on qwen2.5-coder-0.5b
# (a 2-core CPU: `figures/qwen2.5-coder-0.5b/timings.csv`) and writes to
# `outputs/scratch/figures/<model>/` (first made as a copy of the committed `figures/<model>/`,
# whose tables later notebooks read), never to the committed `figures/`. For a short run on
# the small toy model, set `model = "toy-arith"` and `quick = True` in the parameters cell.
# Only `./run_all.sh` writes the committed figures.
#
# **Question** (Nikankin et al. 2025, ICLR, "Arithmetic without algorithms"). At the answer
# position, the middle and late MLPs produce the result. Is that done by a sparse set of
# neurons (about 1 % of each layer), and does each of those neurons implement a simple
# *heuristic*, a rule on the operands or the result (op1 in a range, op2 = 1 mod 10,
# result in a range, ...)? Does ablating a heuristic's neurons hurt exactly the prompts the
# rule covers, and do heuristics appear gradually during training?
#
# **Method.**
# 1. *Prompts.* Nikankin's `{x}{op}{y}=` format (no spaces), every operand pair of a
#    range (the operand grid), with the notebook's few-shot prefix in the same format.
#    The analysed prompts are those the model answers correctly (greedy, whole answer).
# 2. *Neuron attribution.* Attribution patching (gradient x activation difference) of
#    every neuron of the middle and late MLPs (the second half of the layers) at the last
#    position, against the neuron's mean activation (mean ablation), on the answer margin
#    (correct-answer logit minus the mean logit of the number tokens). Importance of a
#    neuron = mean |attribution| over the operator's prompts; the circuit of an operator =
#    the top k neurons of each analysed layer. The estimate is a screen: its recall of the
#    exact top neurons (exact single-neuron mean ablation of `n_exact_check` neurons, half
#    the screen's top, half random) is measured and reported.
# 3. *Faithfulness* (the paper's Eq. 2: the correct-answer logit normalised by the maximum
#    logit, scaled so the fully mean-ablated model scores 0 and the full model 1). Every
#    analysed-layer neuron outside the circuit is mean-ablated at the answer position. With
#    y = (correct-answer logit) / (max logit), F = (y_circuit - y_ablated) / (y_full -
#    y_ablated). The paper's text is not in this repository, and what we have of it (a
#    reviewer in the OpenReview thread describes Eq. 2 as "averaging the percentage change
#    in logits") does not say whether the ratio is taken before or after averaging over
#    prompts, so both are computed: **F** (`faithfulness`, the main number here) takes the
#    means over prompts first (`arithlib.core.metrics.faithfulness`); the mean of per-prompt
#    ratios (`faithfulness_per_prompt`) is reported beside it (it is unstable when a
#    prompt's denominator is near 0). Since y = 1 whenever the model's top token is the answer, F
#    mostly measures how many answers survive. This neuron-only curve (selection prompts)
#    picks the circuit size used for the heuristics; the verdict reads the next point.
# 3b. *Full-circuit faithfulness* (what the paper measures). Circuit = the heads of largest
#    activation-patching indirect effect (per position op1 / operator / op2 / "=", Nikankin
#    Sec. 2; `arithlib.nikankin.activation_patching.coarse_to_fine_patching` on Nikankin prompts, as notebook
#    01) + the top neurons (about 1 % of each analysed MLP, the paper's size) at "="; every
#    head and every MLP neuron outside it is mean-ablated at the four positions. Heads and
#    neurons are chosen on selection prompts; F is scored on **held-out** grid prompts with
#    a 95 % bootstrap interval.
# 4. *Heuristics* (Sec. 4.1). A catalogue of rules (`arithlib.nikankin.heuristics`); a neuron's match
#    score with rule h = share of its s_h top-activating grid prompts that satisfy h
#    (s_h = number of prompts satisfying h); it implements h when the score is >= t = 0.6
#    **and** the label beats a null: a permutation test of the neuron's best score against
#    shuffled-operand grids (p-values adjusted over the rules), with the false-discovery
#    rate over the circuit's neurons controlled at `label_fdr` by Benjamini-Hochberg
#    (`arithlib.nikankin.heuristic_nulls`).
# 5. *Ablations* (Sec. 4.2-4.3) on the held-out prompts, a neuron associated with every
#    heuristic it matches at t whose label beats the null. The prompt knockout (Fig. 8)
#    follows the authors' code: per layer at most a cap of the prompt's neurons, zeroed;
#    the control per layer from that layer's other circuit neurons (`arithlib.nikankin.prompt_knockout`).
#    *Training dynamics* (Sec. 5) on saved checkpoints.
#
# **What is judged.** Faithfulness of the full circuit above (not of late-MLP neurons
# alone), scored on held-out prompts (not on the prompts the circuit was chosen on);
# neurons labelled with every rule they match (`labels = "all"`, not only their best one);
# held-out sizes derived from the intervals (`heldout_half_width`); every number the
# report judges comes with a 95 % interval from the per-prompt tables saved here.

# %% tags=["parameters"]
model = "qwen2.5-coder-0.5b"
device = "cpu"
dtype = "auto"  # "auto": bfloat16 on a GPU, float32 on a CPU; or "float32", "bfloat16"
device_map = None  # None: the whole model on `device`; "auto", "balanced" or {module: device} splits it across GPUs
quick = False
seed = 0
out_dir = "../outputs/scratch/figures"  # run_all.sh passes the committed figures/ (or its own scratch)
fewshot = 2  # solved examples in the prefix of every prompt
threads = 0  # torch CPU threads (0: torch's default, one per core); see the note below
n_analysis = 50  # correct prompts analysed per operator (the paper: about 50 per operator and seed): selection
heldout_half_width = 0.05  # held-out prompts: enough for a 95 % half-width of about 5 points on a pooled accuracy gap
n_heldout = None  # held-out correct prompts per operator; None: from heldout_half_width (capped by the grid)
t = 0.6  # Nikankin's match threshold
t_sweep = [0.4, 0.5, 0.6, 0.7, 0.8]
target_faithfulness = 0.9  # circuit size: smallest k per layer whose pooled faithfulness reaches this
max_base_rate = 0.5  # rules satisfied by more of the grid than this are not judged
max_ablated_heuristics = 10  # per operator, in the Fig. 7 ablation (those with the most neurons)
labels = "all"  # association: every rule a neuron matches at t (the paper), or its best rule ("best")
n_exact_check = 64  # neurons whose attribution estimate is checked by exact ablation (half top, half random)
n_exact_prompts = 32  # prompts of that check
circuit_candidates = 40  # full circuit: Nikankin candidate prompts per operator for the head patching
circuit_select_per_op = 4  # correct ones per operator patched to rank the heads (notebook 01's nikankin_per_op)
circuit_refine = 4  # attention blocks at op1/operator/op2 resolved into heads (coarse_to_fine_patching)
circuit_head_ks = [0, 1, 2, 4, 8, 16, 32, 64]  # head counts tried on the selection prompts
gallery_per_op = 2  # circuit neurons per operator in the gallery
dynamics_steps = None  # Sec. 5 checkpoints; None: every toy-arith one; for a hub model such as Pythia, a list of steps
dynamics_n_analysis = 50  # prompts per operator at each checkpoint
batch_size = 64
per_digit_operand_max = 99  # per-digit tokenizers: operands 0..99 (Nikankin: 0..299, one token each); 9: 1-digit only
max_grid_prompts = 2000  # such a grid is subsampled to this many pairs per operator (seeded); the toy keeps its grid
label_fdr = 0.05  # a label must beat shuffled-operand grids at this false-discovery rate (Benjamini-Hochberg)
n_permutations = None  # shuffled grids per operator; None: max(1000, circuit neurons / label_fdr)
knockout_cap_shares = [0.025, 0.05, 0.125, 0.25, 0.5]  # Fig. 8 caps, shares of the circuit per layer: 5..100 of 200
use_cache = True  # store each long section in ~/.cache/arithlib/sections: a stopped run resumes there
# (arithlib.run.stored; the key holds the model, prompts, parameters and code)

# %%
import time

import numpy as np
import pandas as pd
import torch
from IPython.display import Markdown, display

import arithlib.core.datasets as ds
import arithlib.core.positions as positions
import arithlib.core.stats as S
import arithlib.engine as engine
import arithlib.methods.neurons as N
import arithlib.methods.patching as patching
import arithlib.nikankin.activation_patching as activation_patching
import arithlib.nikankin.faithfulness_checks as FC
import arithlib.nikankin.heuristic_ablation as HA
import arithlib.nikankin.heuristic_dynamics as HD
import arithlib.nikankin.heuristic_grids as HG
import arithlib.nikankin.heuristic_nulls as HN
import arithlib.nikankin.heuristics as H
import arithlib.nikankin.operator_analysis as OA
import arithlib.nikankin.prompt_knockout as PK
import arithlib.plots.neurons as plots
from arithlib.core.papers import FAITHFULNESS_TARGET, NIKANKIN_KNOCKOUT_CAP_SHARE, NIKANKIN_NEURON_SHARE
from arithlib.core.prompt_sets import PromptSet, single_token_max
from arithlib.methods.ablation import mean_activations
from arithlib.run.floor import Sections
from arithlib.run.outputs import save_figure, save_table
from arithlib.run.paths import cache_root
from arithlib.run.runs import start_run
from arithlib.run.stored import Store

t_start = time.time()
if threads:
    torch.set_num_threads(threads)
if quick:
    n_analysis, n_exact_check, n_exact_prompts, gallery_per_op, max_ablated_heuristics = 24, 8, 8, 1, 5
    n_heldout, circuit_candidates, circuit_select_per_op, circuit_refine = 24, 12, 2, 1
    circuit_head_ks = [0, 2, 8]
    dynamics_n_analysis, t_sweep = 24, [0.4, 0.6, 0.8]
    max_grid_prompts, n_permutations = 300, 200
if n_heldout is None:  # a pooled accuracy gap of the four operators with the wanted half-width
    n_heldout = int(np.ceil(S.n_for_half_width(0.5, heldout_half_width) / 4))
run = start_run(
    "03_neuron_heuristics",
    model,
    device,
    seed,
    out_dir,
    quick,
    dtype=dtype,
    device_map=device_map,
    fewshot=fewshot,
    threads=threads,
    n_analysis=n_analysis,
    n_heldout=n_heldout,
    heldout_half_width=heldout_half_width,
    n_exact_check=n_exact_check,
    n_exact_prompts=n_exact_prompts,
    circuit_candidates=circuit_candidates,
    circuit_select_per_op=circuit_select_per_op,
    circuit_refine=circuit_refine,
    circuit_head_ks=circuit_head_ks,
    t=t,
    target_faithfulness=target_faithfulness,
    max_base_rate=max_base_rate,
    max_ablated_heuristics=max_ablated_heuristics,
    labels=labels,
    dynamics_steps=dynamics_steps,
    dynamics_n_analysis=dynamics_n_analysis,
    per_digit_operand_max=per_digit_operand_max,
    max_grid_prompts=max_grid_prompts,
    label_fdr=label_fdr,
    n_permutations=n_permutations,
    knockout_cap_shares=knockout_cap_shares,
)
bridge, tok, info = run.bridge, run.tokenizer, run.model.info
layers = N.default_layers(info.n_layers)
store = Store(cache_root() / "sections" / model.replace("/", "__") if use_cache else None)  # long sections
timed = Sections.of_run(run, [store])  # each section's time and arithmetic against the peak (arithlib.run.floor)
print(info)
print("analysed MLP layers:", layers)

# %% [markdown]
# `threads`: the interventions below re-run only the answer position (one token per prompt,
# `arithlib.engine.AnswerPositionRunner`), which is many small matrix products. On free
# cores torch's default (a thread per core) was the faster choice in `benchmarks/threads.py`
# (the measured times are in `benchmarks/RESULTS.md`, in the paragraph on notebook 03's
# `threads`). On a CPU that other jobs share, one thread can be faster; set `threads = 1`
# then. On a CPU `run_all.sh` runs two notebooks at a time, each with the cores divided by
# two as its thread count (`OMP_NUM_THREADS`, which torch's default follows): one thread
# each on a 2-core machine.
#
# ## Prompts: the operand grid and the answer token
# Nikankin's analysis needs every operand and result to be one token (Llama-3 has one token
# per integer up to 999; its grids are operands 0..299). The toy model has one token per
# integer 0..999 and was trained on + and - with operands 0..99 and on * and / with operands
# 0..31: those are its grids, kept whole. Qwen and SmolLM2 write numbers digit by digit. The
# analysis reads the answer position only, so the operands need not be single tokens: they
# get **2-digit operands** 0..`per_digit_operand_max` (a 10 x 10 grid of 1-digit operands
# leaves too few prompts per rule for a match score to beat chance), subsampled to
# `max_grid_prompts` pairs per operator (seeded; every prompt's KV cache is kept), and the
# **first answer token** is the target everywhere (attribution, faithfulness, ablation
# accuracy). The heads of the full circuit (section 1b) are still ranked on single-token
# Nikankin prompts, as in notebook 01 (its counterfactuals must keep the token length). A
# prompt counts as correct when greedy decoding writes the whole answer and stops; ablation
# accuracy is first-token accuracy.

# %%
single = single_token_max(tok)
ops = ["+", "-", "*", "/"]
operand_ranges = HG.operand_ranges(single, quick, per_digit_operand_max, ops)  # quick toy: a corner of its grids
full_grids = {op: HG.grid_records(op, operand_ranges[op], fewshot=fewshot) for op in ops}
grid_limit = max_grid_prompts if single < 99 else None  # the toy model keeps its full grids
grids = {op: PromptSet.build(HG.subsample(full_grids[op], grid_limit, seed), tok) for op in ops}
grid_table = pd.DataFrame(
    [
        {
            "op": op,
            "operands": f"{operand_ranges[op][0]}..{operand_ranges[op][1]}",
            "n_prompts": len(g),
            "n_full_grid": len(full_grids[op]),
            "subsampled": len(g) < len(full_grids[op]),
            "max_result": max(r.answer for r in g.records),
            "answer_tokens_max": max(len(a) for a in g.answer_ids),
            "example": g.records[len(g) // 2].full_text + g.records[len(g) // 2].answer_text,
        }
        for op, g in grids.items()
    ]
)
save_table(grid_table, run.out, "03_grids")
run.record(
    operand_ranges={op: list(r) for op, r in operand_ranges.items()},
    grid_prompts={op: len(g) for op, g in grids.items()},
    grid_full={op: len(full_grids[op]) for op in ops},
)
print(f"largest single-token number: {single}")
grid_table

# %%
timed.lap("prompts")

# %% [markdown]
# ## Clean pass and the analysed prompts
# One pass over each grid records every analysed neuron's activation at the answer position;
# the analysed prompts are up to `n_analysis` correctly answered prompts per operator (seeded
# sample), the **selection** prompts: the circuit (neurons, heads, sizes) is chosen on them.
# Up to `n_heldout` further correct prompts per operator are **held out** (reserved first,
# at most half of an operator's correct prompts, so the small per-digit grids keep some):
# faithfulness and the ablations are scored on them. Mean ablation writes the mean activation over the
# analysed prompts of all operators. The grid pass is the longest step of this notebook on a
# per-digit model (thousands of prompts, each decoded greedily); it is stored per operator.

# %%
analyses = {}
for op, g in grids.items():
    clean = store(
        f"03 grid pass {op}",
        lambda g=g: OA.grid_pass(bridge, g, layers, batch_size),
        code=[OA],
        model=bridge,
        grid=g,
        layers=layers,
        batch_size=batch_size,
    )
    analyses[op] = OA.prepare_operator(
        bridge, g, layers, n_analysis, "full", seed, batch_size, n_heldout=n_heldout, clean=clean
    )
acc = pd.DataFrame(
    [
        {
            "op": op,
            "n_grid": len(an.grid),
            "accuracy_first_token": an.grid_correct_first.mean(),
            "accuracy_full_answer": an.grid_correct_full.mean(),
            "n_analysed": len(an.analysis_index),
            "n_heldout": len(an.heldout_index),
        }
        for op, an in analyses.items()
    ]
)
save_table(acc, run.out, "03_grid_accuracy")
skipped = [op for op, an in analyses.items() if an.runner is None]
analyses = {op: an for op, an in analyses.items() if an.runner is not None}
if skipped:
    print("no correct prompts (operator skipped):", skipped)
if not analyses:
    raise RuntimeError(f"{model} answers no grid prompt correctly; nothing to analyse")
means = OA.reference_means(analyses)
candidates = N.number_token_ids(tok, min(single, max(r.answer for g in grids.values() for r in g.records)))
acc

# %%
timed.lap("clean pass")

# %% [markdown]
# ## 1 · Neuron attribution and faithfulness vs neurons kept per layer
# First the check of the attribution screen: for the `n_exact_check / 2` highest-scoring
# neurons and as many random ones, the estimate vs the exact drop of the answer margin when
# that one neuron is mean-ablated (on `n_exact_prompts` prompts). **Recall** = share of the
# checked neurons' exact top half (by mean |drop|, the exact counterpart of the circuit's
# mean |attribution|) that the screen also ranks in its top half; `missed_random` counts
# random neurons whose exact effect exceeds the smallest exact effect of the screen's top
# (neurons the screen would leave out of a circuit of that size).

# %%
for op, an in analyses.items():
    OA.attribute(an, layers, means, candidates)
check_op = max(analyses, key=lambda o: len(analyses[o].analysis_index))
an = analyses[check_op]
rng = np.random.default_rng(seed)
flat = an.scores.flatten()
top_idx = torch.argsort(flat, descending=True)[: n_exact_check // 2].tolist()
rand_idx = rng.choice(len(flat), n_exact_check - len(top_idx), replace=False).tolist()
check_neurons = [(layers[i // info.d_mlp], i % info.d_mlp) for i in top_idx + rand_idx]
sub = an.runner.subset(list(range(min(n_exact_prompts, len(an.runner)))))
exact = N.exact_neuron_effects(sub, check_neurons, layers, means, candidates)
pos = {x: i for i, x in enumerate(layers)}
sub_attr = an.attribution[: len(sub)]
check = exact.assign(
    op=check_op,
    chosen=["top"] * len(top_idx) + ["random"] * len(rand_idx),
    attribution=[float(sub_attr[:, pos[l], k].mean()) for l, k in check_neurons],
    exact_effect=exact.effect,
)
save_table(check, run.out, "03_attribution_check")
fig = plots.attribution_check_plot(check, f"{model}, operator {check_op}: attribution vs exact ({len(sub)} prompts)")
save_figure(fig, run.out, "03_attribution_check")
attr_corr = float(np.corrcoef(check.attribution, check.exact_effect)[0, 1]) if len(check) > 2 else float("nan")
check["screen_score"] = [float(an.scores[pos[l], k]) for l, k in check_neurons]  # mean |attribution|
attr_recall = activation_patching.topk_recall(check.screen_score, check.abs_effect, len(check) // 2)
top_exact = check[check.chosen == "top"].abs_effect
missed_random = int((check[check.chosen == "random"].abs_effect > top_exact.min()).sum()) if len(top_exact) else 0
save_table(check, run.out, "03_attribution_check")
print(
    f"correlation of estimate and exact effect: {attr_corr:.3f}; recall of the exact top {len(check) // 2}: "
    f"{attr_recall:.2f}; random neurons above the screen's weakest top neuron: {missed_random} of {len(rand_idx)}"
)

# %% [markdown]
# The curve behind "about 1 % of neurons per layer" (Fig. 4b), on the selection prompts:
# faithfulness of the top-k-per-layer circuit of each operator, only the analysed MLPs'
# neurons ablated (a partial test; the full circuit follows). The circuit size used from here on is the
# smallest k whose pooled faithfulness, averaged over operators, reaches
# `target_faithfulness` (the paper's circuit has about 96 %; its size was about 1 % of each
# layer).

# %%
shares = (0, 0.01, 0.05, 0.25, 1.0) if quick else (0, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0)
ks = N.share_grid(info.d_mlp, shares)
curve = store(
    "03 faithfulness curve",
    lambda: OA.faithfulness_curves(analyses, layers, means, ks, progress=True),
    code=[OA],
    model=bridge,
    prompts={op: an.runner.prompts for op, an in analyses.items()},
    scores={op: an.scores for op, an in analyses.items()},
    layers=layers,
    means=means,
    ks=ks,
)
k_circuit = N.smallest_faithful_k(curve, target_faithfulness, "faithfulness")
save_table(curve, run.out, "03_faithfulness_curve")
fig = plots.faithfulness_curve_plot(
    curve, "faithfulness", f"{model}: neuron-circuit faithfulness (pooled)", chosen_k=k_circuit
)
save_figure(fig, run.out, "03_faithfulness_curve")
fig = plots.faithfulness_curve_plot(
    curve, "faithfulness_per_prompt", f"{model}: faithfulness, mean of per-prompt ratios", chosen_k=k_circuit
)
save_figure(fig, run.out, "03_faithfulness_curve_per_prompt")
at_k = curve[curve.k_per_layer == k_circuit]
print(f"circuit: {k_circuit} neurons per layer ({k_circuit / info.d_mlp:.2%} of each of {len(layers)} layers)")
curve.pivot_table(
    index="k_per_layer", columns="op", values=["faithfulness", "faithfulness_per_prompt", "accuracy"]
).round(3)

# %%
timed.lap("1 neuron attribution, faithfulness curve")

# %% [markdown]
# ## 1b · The full circuit: heads and neurons, faithfulness on held-out prompts
# Nikankin's circuit holds heads and MLP neurons, and faithfulness mean-ablates every
# component outside it. Heads: activation patching (operand-changing counterfactual,
# indirect effect $IE = \tfrac12[(P^*(r')-P(r'))/P(r') + (P(r)-P^*(r))/P^*(r)]$) of every MLP
# and attention block at op1 / operator / op2 / "=", every head at "=", the heads of the
# `circuit_refine` strongest attention blocks at the other positions
# (`coarse_to_fine_patching`, as notebook 01, whose section 6 measures this screen's recall
# of the exact per-head patching), on `circuit_select_per_op` correct Nikankin prompts per
# operator that are not held out; (head, position) pairs ranked by median IE (ties: the
# sort is stable on layer, head). Neurons: each operator's top `round(0.01 x d_mlp)` neurons
# per analysed layer by attribution (the paper's ~1 %). Every other head, and every
# analysed-layer neuron outside the circuit, is mean-ablated at op1, operator, op2 and "=";
# the earlier MLPs and the MLPs at the operand and operator positions are kept (part of
# Nikankin's circuit); the few-shot prefix is left clean. Head count: the smallest of
# `circuit_head_ks` whose faithfulness (mean over operators) on the selection prompts
# reaches FAITHFULNESS_TARGET (else the largest). Then $F = (\bar y_{circ} - \bar y_{abl}) /
# (\bar y_{full} - \bar y_{abl})$, $y = \mathrm{logit}(r)/\max\mathrm{logit}$ (Eq. 2), per operator
# on the held-out prompts, averaged over operators, with a 95 % bootstrap interval over
# held-out prompts (stratified by operator); per-prompt values in
# `03_circuit_faithfulness_prompts.csv.gz`. The interval covers the choice of held-out prompts,
# not the choice of the circuit (heads and neurons are fixed before scoring). An operator
# whose denominator $\bar y_{full} - \bar y_{abl}$ is not above zero at 95 % (the fully
# ablated model answers as the full one; `arithlib.nikankin.faithfulness_checks`) has no F: it is
# excluded from the mean, with its reason, rather than averaged as an arbitrarily large ratio.

# %%
names = {"A": "op1", "operator": "operator", "B": "op2", "last": "="}
ref_records = [r for an in analyses.values() for r in an.grid.subset(an.analysis_index + an.heldout_index).records]
held_keys = {(r.op, r.a, r.b) for an in analyses.values() for r in an.grid.subset(an.heldout_index).records}
cand = []
for op in analyses:
    cand += ds.nikankin_prompts(
        [op], max_operand=min(operand_ranges[op][1], single), n_per_op=circuit_candidates, seed=seed, fewshot=fewshot
    )
cand = PromptSet.build([r for r in cand if (r.op, r.a, r.b) not in held_keys], tok)
cand_ok = cand.subset(
    np.flatnonzero(engine.AnswerPositionRunner(bridge, cand, batch_size=batch_size).greedy_correct()).tolist()
)
sel = positions.sample_per_group(cand_ok, circuit_select_per_op, ("op",), seed) if len(cand_ok) else cand_ok
print(f"head patching: {len(cand)} candidate prompts (held-out ones removed), {len(cand_ok)} correct, {len(sel)} used")
if not len(sel):
    raise RuntimeError("no correct Nikankin prompt to rank the heads on")
sel_pos = positions.named_positions(positions.locate_operands(sel), names)
ie_sel = store(
    "03 head patching",
    lambda: activation_patching.coarse_to_fine_patching(bridge, sel, sel_pos, circuit_refine, batch_size=16),
    code=[activation_patching],
    model=bridge,
    prompts=sel,
    positions=sel_pos,
    refine=circuit_refine,
    batch_size=16,
)
ranked_heads = activation_patching.ranked_head_positions(activation_patching.summarise_indirect_effects(ie_sel))
hooks = sorted({c.hook_name for c in patching.heads_and_mlps(bridge)} | {N.post_hook(l) for l in layers})
circuit_means = mean_activations(bridge, PromptSet.build(ref_records + list(sel.records), tok), hooks)
k_full = max(1, int(round(NIKANKIN_NEURON_SHARE * info.d_mlp)))
full_neurons = {op: N.top_neurons_per_layer(an.scores, layers, k_full) for op, an in analyses.items()}
head_ks = [k for k in circuit_head_ks if k <= len(ranked_heads)]
sel_rows = []
for op in analyses:
    sel_op = sel.subset([i for i, r in enumerate(sel.records) if r.op == op])
    if not len(sel_op):
        continue
    circuits = {f"h={k}": (ranked_heads[:k], full_neurons[op]) for k in head_ks}
    sel_op_pos = positions.named_positions(positions.locate_operands(sel_op), names)
    sel_rows.append(
        store(
            f"03 circuit head curve {op}",
            lambda: activation_patching.full_circuit_faithfulness(
                bridge, sel_op, circuits, sel_op_pos, circuit_means, layers, progress=False
            ),
            code=[activation_patching],
            model=bridge,
            prompts=sel_op,
            circuits=circuits,
            positions=sel_op_pos,
            means=circuit_means,
            layers=layers,
        )
    )
sel_rows = pd.concat(sel_rows, ignore_index=True)
head_curve = pd.DataFrame(
    [
        {"op": op, "n_heads": k, "faithfulness": activation_patching.faithfulness_from_prompts(g, f"h={k}")}
        for op, g in sel_rows.groupby("op")
        for k in head_ks
    ]
)
by_k = head_curve.groupby("n_heads").faithfulness.mean()
reach = by_k[by_k >= FAITHFULNESS_TARGET]
n_circuit_heads = int(reach.index.min()) if len(reach) else int(by_k.index.max())
save_table(head_curve, run.out, "03_circuit_head_curve")
held_rows = []
for op, an in analyses.items():
    if not an.heldout_index:
        continue
    held = an.grid.subset(an.heldout_index)
    held_circuit = {"circuit": (ranked_heads[:n_circuit_heads], full_neurons[op])}
    held_pos = positions.named_positions(positions.locate_operands(held), names)
    fr = store(
        f"03 circuit faithfulness {op}",
        lambda: activation_patching.full_circuit_faithfulness(
            bridge, held, held_circuit, held_pos, circuit_means, layers, progress=False
        ),
        code=[activation_patching],
        model=bridge,
        prompts=held,
        circuits=held_circuit,
        positions=held_pos,
        means=circuit_means,
        layers=layers,
    )
    held_rows.append(fr.assign(prompt=[an.heldout_index[i] for i in fr.prompt]))
held_rows = pd.concat(held_rows, ignore_index=True)
save_table(held_rows, run.out, "03_circuit_faithfulness_prompts")
wide = held_rows.pivot_table(index=["op", "prompt"], columns="circuit", values="normalized_logit")
denoms = FC.denominators(wide).set_index("op")  # an operator whose ablation changes nothing has no F: excluded
wide_kept = FC.kept(wide, denoms.reset_index())
op_codes = pd.factorize(wide_kept.index.get_level_values("op"))[0]
full_ci = (
    S.bootstrap_ci(
        FC.faithfulness_of_kept_operators,
        wide_kept["circuit"].to_numpy(),
        wide_kept["full"].to_numpy(),
        wide_kept["ablated"].to_numpy(),
        op_codes,
        groups=op_codes,
    )
    if len(wide_kept)
    else S.Interval(float("nan"), float("nan"), float("nan"), 0, "none")
)
flat_ops = denoms[denoms.excluded]
for op, r in flat_ops.iterrows():
    print(f"operator {op} excluded from the mean: {r.reason}")
circuit_summary = pd.DataFrame(
    [
        {
            "op": op,
            "faithfulness": denoms.loc[str(op), "faithfulness"],
            "accuracy": g[g.circuit == "circuit"].correct.mean(),
            "n_heldout": g.prompt.nunique(),
            "denominator": denoms.loc[str(op), "denominator"],
            "denominator_low": denoms.loc[str(op), "denominator_low"],
            "excluded": bool(denoms.loc[str(op), "excluded"]),
            "reason": denoms.loc[str(op), "reason"],
        }
        for op, g in held_rows.groupby("op")
    ]
    + [
        {
            "op": "all",
            "faithfulness": full_ci.estimate,
            "low": full_ci.low,
            "high": full_ci.high,
            "accuracy": held_rows[held_rows.circuit == "circuit"].correct.mean(),
            "n_heldout": full_ci.n,
        }
    ]
).assign(
    n_heads=n_circuit_heads,
    k_per_layer=k_full,
    share_per_layer=k_full / info.d_mlp,
    n_select_heads=len(sel),
    n_select_neurons=sum(len(an.analysis_index) for an in analyses.values()),
)
save_table(circuit_summary, run.out, "03_circuit_faithfulness")
import matplotlib.pyplot as plt

fig, ax = plt.subplots(figsize=(5.5, 3.8))
for op, g in head_curve.groupby("op"):
    ax.plot(g.n_heads, g.faithfulness, marker="o", lw=1, label=f"{op} (selection)")
ax.errorbar(
    [n_circuit_heads],
    [full_ci.estimate],
    yerr=[[full_ci.estimate - full_ci.low], [full_ci.high - full_ci.estimate]],
    fmt="s",
    color="k",
    capsize=4,
    label="held-out, 95 % CI",
)
ax.axhline(FAITHFULNESS_TARGET, color="grey", ls="--", lw=0.8)
ax.set_xscale("symlog", linthresh=1)
ax.set_xlabel("heads (per position) in the circuit")
ax.set_ylabel("faithfulness F")
ax.set_title(f"{model}: full circuit, {k_full} neurons per layer")
ax.legend(fontsize=7)
save_figure(fig, run.out, "03_circuit_faithfulness")
print(
    f"full circuit: {n_circuit_heads} head-positions + {k_full} neurons per analysed layer; held-out faithfulness "
    f"{full_ci.text()} on {full_ci.n} prompts"
)
circuit_summary.round(3)

# %%
timed.lap("1b full circuit")

# %% [markdown]
# ## 2 · Heuristic classification and the gallery of circuit neurons
# Each operator's circuit neurons are scored against the rules that can be judged on its
# grid (satisfied by at least 3 prompts and at most `max_base_rate` of them, duplicates
# removed). A neuron usually passes t for several overlapping rules (a neuron firing on
# op1 in 2..4 also scores >= 0.6 on op1 in [2, 3]). With `labels = "all"` (the paper's
# association, the default) a neuron is associated with every rule it
# matches at t, for counting and for the ablations; `labels = "best"` keeps each matched
# neuron's best rule only.
#
# **A label must beat a null.** On a small grid a rule passes t by chance for many neurons
# (a rule covering a share p of the grid scores about p on shuffled activations). Per neuron,
# the best match score is compared with its best score on `n_permutations` shuffled-operand
# grids (the same activations, the operand pairs permuted over the prompts), which adjusts
# each label's p-value for the number of rules tried (max-T); Benjamini-Hochberg over the
# circuit's neurons keeps the false-discovery rate at `label_fdr`. Only labels that pass t
# and beat the null associate a neuron with prompts below. `03_matched_share` sets the
# labelled share against the same procedure on shuffled activations (the null's share);
# `03_heuristic_matches` keeps every match at t with its p-value and `beats_null`.

# %%
rows, summaries, shares = [], [], []
for op, an in analyses.items():
    OA.classify_circuit(an, layers, k_circuit, t, max_base_rate, seed)
    acts_c = OA.neuron_matrix(an.grid_acts, an.circuit, layers)
    test, null_test = store(
        f"03 label tests {op}",
        lambda: (
            HN.label_test(acts_c, an.assoc, t, label_fdr, n_permutations, seed=seed, rank_seed=seed),
            HN.null_label_test(acts_c, an.assoc, t, label_fdr, n_permutations, seed=seed),
        ),
        code=[HN],
        acts=acts_c,
        assoc=an.assoc,
        t=t,
        fdr=label_fdr,
        n_permutations=n_permutations,
        seed=seed,
    )
    an.matches = HN.annotate_matches(an.matches, an.circuit, test)
    rows.append(an.matches.assign(op=op))
    s = H.neuron_summary(an.circuit_scores, an.circuit, an.heuristics, an.assoc, t)
    pos_scores = [float(an.scores[pos[l], k]) for l, k in an.circuit]
    summaries.append(
        s.assign(
            op=op,
            importance=pos_scores,
            n_rules=len(an.heuristics),
            labelled=test.labelled,
            p_value=test.p_neuron,
            q_value=test.q_neuron,
        )
    )
    shares.append(
        {
            "op": op,
            "n_circuit": len(an.circuit),
            "n_rules": len(an.heuristics),
            **HN.share_row(test, null_test, an.circuit_null),
        }
    )
matches = pd.concat(rows, ignore_index=True)
neuron_table = pd.concat(summaries, ignore_index=True)
save_table(matches, run.out, "03_heuristic_matches")
save_table(neuron_table, run.out, "03_circuit_neurons")
share_table = pd.DataFrame(shares)
labelled = {op: H.neuron_labels(HN.beating_null(an.matches), labels) for op, an in analyses.items()}  # used below
save_table(share_table, run.out, "03_matched_share")
share_table

# %% [markdown]
# Gallery: the `gallery_per_op` most important circuit neurons of each operator. Top:
# activation over the operand grid (op1 rows, op2 columns; blank = no prompt, e.g. negative
# results). Title: the best-matching rule and its score (matched if >= t). Bottom: the
# logit lens of the neuron's value vector on the number tokens (logit added per unit of
# activation; for per-digit tokenizers the tokens 0..9, i.e. first digits).

# %%
g_grids, g_lens, g_titles, g_rows, l_rows = [], [], [], [], []
for op, an in analyses.items():
    nt = neuron_table[neuron_table.op == op].sort_values("importance", ascending=False).head(gallery_per_op)
    res = [r.answer for r in an.grid.records]
    hi = min(single, max(res))
    ids = N.number_token_ids(tok, hi)
    for r in nt.itertuples():
        col = an.grid_acts[:, pos[r.layer], r.neuron].numpy()
        frame = an.grid.to_frame()
        g_grids.append(N.operand_grid(frame, col))
        lens = N.neuron_logit_lens(bridge, [(r.layer, r.neuron)], ids)
        g_lens.append(lens)
        tag = "labelled" if r.labelled else ("matched, not beating the null" if r.matched else "no match")
        g_titles.append(f"{op}  L{r.layer} N{r.neuron}\nbest: {r.best_heuristic} ({r.best_score:.2f}, {tag})")
        g_rows.append(
            pd.DataFrame(
                {"op": op, "layer": r.layer, "neuron": r.neuron, "a": frame.a, "b": frame.b, "activation": col}
            )
        )
        l_rows.append(lens.assign(op=op))
save_table(pd.concat(g_rows, ignore_index=True), run.out, "03_gallery_grids")
save_table(pd.concat(l_rows, ignore_index=True), run.out, "03_gallery_logit_lens")
fig = plots.neuron_gallery(g_grids, g_lens, g_titles, ncols=4, suptitle=f"{model}: circuit neurons (answer position)")
save_figure(fig, run.out, "03_gallery")

# %%
timed.lap("2 heuristic classification")

# %% [markdown]
# ## 3 · Neurons per heuristic type and operator, and the sensitivity to t
# Counts use each neuron's label(s) (`labels`: best rule, or every matched rule). The
# sensitivity plot shows, for t from 0.4 to 0.8, the share of circuit neurons matching some
# rule, with real activations (solid) and with each neuron's activations shuffled over the
# grid (dotted: what the threshold passes by chance). A rule satisfied by a share p of the
# grid scores about p by chance, and rules up to p = `max_base_rate` are judged, so below
# t = `max_base_rate` nearly every neuron passes even when shuffled: only thresholds above
# it discriminate.

# %%
counts = []
sens = []
for op, an in analyses.items():
    counts.append(H.type_counts(labelled[op]).assign(op=op))
    sens.append(H.threshold_sensitivity(an.circuit_scores, an.heuristics, t_sweep).assign(op=op, activations="real"))
    sens.append(H.threshold_sensitivity(an.circuit_null, an.heuristics, t_sweep).assign(op=op, activations="shuffled"))
counts = pd.concat(counts, ignore_index=True)
sens = pd.concat(sens, ignore_index=True)
type_sens = pd.concat(
    [
        H.type_counts_by_threshold(an.circuit_scores, an.circuit, an.heuristics, an.assoc, t_sweep, labels).assign(
            op=op
        )
        for op, an in analyses.items()
    ],
    ignore_index=True,
)
save_table(counts, run.out, "03_heuristic_counts")
save_table(sens, run.out, "03_threshold_sensitivity")
save_table(type_sens, run.out, "03_heuristic_counts_by_t")
save_figure(
    plots.type_threshold_plot(type_sens, f"{model}: neurons per heuristic type vs t ({labels} labels)"),
    run.out,
    "03_heuristic_counts_by_t",
)
save_figure(
    plots.heuristic_counts_plot(counts, f"{model}: circuit neurons per heuristic type (t = {t}, labels: {labels})"),
    run.out,
    "03_heuristic_counts",
)
save_figure(
    plots.threshold_plot(sens[sens.kind == "any"], f"{model}: neurons matching a heuristic vs t"),
    run.out,
    "03_threshold_sensitivity",
)
sens[sens.kind == "any"].pivot_table(index="t", columns=["op", "activations"], values="share").round(3)

# %%
timed.lap("3 heuristic counts, t sensitivity")

# %% [markdown]
# ## 4 · Ablations
# **Per heuristic (Fig. 7).** Mean-ablate (answer position) the circuit neurons classified
# as one rule; first-token accuracy on the **held-out** prompts that satisfy the rule
# (associated) vs the others. At most `max_ablated_heuristics` rules per operator, those
# with the most neurons (then the highest mean match score, then the name). One row per
# heuristic and held-out prompt in `03_heuristic_ablation_prompts.csv.gz`; the report's gap
# (mean over heuristics of other minus associated accuracy) gets a 95 % paired bootstrap
# interval over prompts from it. Each ablation is a pass of the answer position from the
# lowest ablated layer on, over the held-out prompts' clean run (kept for the per-prompt
# knockout below).

# %%
abl_rows, kept_clean = [], {op: {} for op in analyses}
for op, an in analyses.items():
    if an.heldout_runner is None:
        continue
    r = store(
        f"03 heuristic ablation {op}",
        lambda: HA.heuristic_ablation_prompts(
            an.heldout_runner,
            labelled[op],
            an.heuristics,
            layers,
            means,
            min_prompts=3,
            max_heuristics=max_ablated_heuristics,
            progress=True,
            clean_runs=kept_clean[op],
        ),
        code=[HA],
        model=bridge,
        prompts=an.heldout_runner.prompts,
        labels=labelled[op],
        heuristics=an.heuristics,
        layers=layers,
        means=means,
        min_prompts=3,
        max_heuristics=max_ablated_heuristics,
    )
    abl_rows.append(r.assign(op=op, prompt=[an.heldout_index[i] for i in r.prompt]))
abl_rows = (
    pd.concat(abl_rows, ignore_index=True)
    if abl_rows
    else pd.DataFrame(
        columns=["heuristic", "kind", "n_neurons", "prompt", "associated", "correct", "correct_base", "op"]
    )
)
save_table(abl_rows, run.out, "03_heuristic_ablation_prompts")
abl = HA.summarise_heuristic_ablation(abl_rows)
save_table(abl, run.out, "03_heuristic_ablation")
save_figure(
    plots.heuristic_ablation_plot(abl, f"{model}: ablating one heuristic's neurons"), run.out, "03_heuristic_ablation"
)
abl_summary = (
    abl.groupby("op")[["acc_assoc", "acc_other", "n_neurons"]].mean().reset_index()
    if len(abl)
    else pd.DataFrame(columns=["op", "acc_assoc", "acc_other", "n_neurons"])
)
abl_summary

# %% [markdown]
# **Per prompt (Fig. 8),** as the authors' `prompt_knockout_experiment`: for each held-out
# prompt, its associated heuristic neurons (circuit neurons whose labels beat the null, for
# a rule the prompt satisfies) are ranked by how many of the prompt's rules they carry (ties:
# larger summed match score, then neuron index); in each layer at most `cap` of them are
# **zeroed** at the answer position. The control zeroes, in each layer, as many neurons drawn
# at random (seeded) from that layer's circuit neurons minus the zeroed ones: disjoint from
# the tested set and matched to it layer by layer. Where a layer has too few such neurons the
# prompt is *not testable* at that cap (counted, never filled from the tested set); caps up
# to half the circuit's neurons per layer always leave a pool. The caps are
# `knockout_cap_shares` of the circuit's neurons per layer (the authors sweep 0..100 of 200
# in steps of 5); the report reads the cap at 25 of 200 (Sec. 5: "ablating 25 heuristic
# neurons per layer is enough to cause near-zero accuracy"). One row per held-out prompt and
# cap in `03_prompt_ablation.csv` (paired: both conditions on the same prompt).

# %%
caps = PK.knockout_caps(k_circuit, list(knockout_cap_shares) + [NIKANKIN_KNOCKOUT_CAP_SHARE])
cap_verdict = PK.verdict_cap(k_circuit, NIKANKIN_KNOCKOUT_CAP_SHARE)
pa = []
for op, an in analyses.items():
    if an.heldout_runner is None:
        continue
    pa.append(
        store(
            f"03 prompt knockout {op}",
            lambda: PK.prompt_knockout(
                an.heldout_runner,
                labelled[op],
                an.heuristics,
                an.circuit,
                layers,
                caps,
                info.d_mlp,
                k_circuit,
                seed,
                clean_runs=kept_clean[op],
            ),
            code=[PK],
            model=bridge,
            prompts=an.heldout_runner.prompts,
            labels=labelled[op],
            heuristics=an.heuristics,
            circuit=an.circuit,
            layers=layers,
            caps=caps,
            d_mlp=info.d_mlp,
            k=k_circuit,
            seed=seed,
        )
    )
kept_clean.clear()  # the held-out prompts' clean runs (their residual streams) are not needed below
pa = pd.concat(pa, ignore_index=True)
save_table(pa, run.out, "03_prompt_ablation")
pa_summary = PK.summarise(pa)
save_table(pa_summary, run.out, "03_prompt_ablation_summary")
save_figure(
    plots.prompt_ablation_plot(
        pa_summary, f"{model}: zeroing each prompt's heuristic neurons (k = {k_circuit} per layer)", cap_verdict
    ),
    run.out,
    "03_prompt_ablation",
)
pa_summary

# %% [markdown]
# **Correct vs incorrect prompts (Sec. 4.3).** Over the whole grid: the number of a prompt's
# associated heuristic neurons and their summed direct contribution to the correct answer's
# logit (activation x logit lens of the value vector, divided by the final norm's scale).

# %%
ci = pd.concat(
    [HA.correct_vs_incorrect(bridge, an, layers, labelled[op]) for op, an in analyses.items()], ignore_index=True
)
save_table(ci, run.out, "03_correct_vs_incorrect")
ci_summary = (
    ci.groupby(["op", "correct"])
    .agg(
        n=("a", "size"),
        mean_assoc_neurons=("n_assoc_neurons", "mean"),
        mean_assoc_contribution=("assoc_contribution", "mean"),
    )
    .reset_index()
)
save_table(ci_summary, run.out, "03_correct_vs_incorrect_summary")
save_figure(
    plots.correct_incorrect_plot(ci, f"{model}: associated heuristic neurons, correct vs incorrect prompts"),
    run.out,
    "03_correct_vs_incorrect",
)
ci_summary

# %%
timed.lap("4 ablations")

# %% [markdown]
# ## 5 · Training dynamics (Sec. 5, Fig. 10)
# At each saved checkpoint: first-token accuracy on the grids; the circuit re-discovered
# at that checkpoint with the same k per layer (attribution on `dynamics_n_analysis` sampled
# grid prompts per operator, correct or not, since early checkpoints answer few); its
# pooled faithfulness on those prompts; the share of its neurons labelled with a heuristic
# that passes t and beats the shuffled-operand null at `label_fdr`, as in section 2 (with
# the same procedure on shuffled activations as its null; the share passing t alone is
# kept in the table); and the share of the final checkpoint's labelled rules already
# labelled. The toy model's checkpoints are used for `toy-arith`; for a hub model
# with step revisions (Pythia) pass `dynamics_steps`.

# %%
dyn = overlap = None
if model == "toy-arith" or dynamics_steps:
    from arithlib.core.models import load_model

    if model == "toy-arith":
        from arithlib.core.toy import toy_checkpoint_steps

        steps = toy_checkpoint_steps()  # trained on demand when loaded, only as far as the step
        if dynamics_steps:
            steps = [s for s in steps if s in set(dynamics_steps)]
    else:
        steps = list(dynamics_steps)
    if quick:
        steps = sorted({steps[0], steps[len(steps) // 2], steps[-1]})
    dyn_grids = {op: grids[op] for op in analyses}
    dyn = HD.training_dynamics(
        lambda s: load_model(model, device=device, dtype=dtype, checkpoint=s).bridge,
        steps,
        dyn_grids,
        layers,
        k_circuit,
        dynamics_n_analysis,
        t,
        candidates,
        seed,
        max_base_rate=max_base_rate,
        labels=labels,
        label_fdr=label_fdr,
        n_permutations=n_permutations,
    )
    overlap = HD.heuristic_overlap(dyn)
    save_table(dyn, run.out, "03_training_dynamics")
    save_table(overlap, run.out, "03_training_overlap")
    save_figure(
        plots.dynamics_plot(dyn, overlap, f"{model}: heuristics over training (k = {k_circuit} per layer)"),
        run.out,
        "03_training_dynamics",
    )
    display(dyn.drop(columns="heuristic_set").round(3))
else:
    print(f"{model} has no training checkpoints here; pass dynamics_steps for a hub model with step revisions")

# %%
timed.lap("5 training dynamics")
save_table(timed.table(total_wall_s=time.time() - t_start), run.out, "03_timings")  # total: with loading


# %% [markdown]
# ## What this run found


# %%
def pct(x):
    return "n/a" if x is None or (isinstance(x, float) and np.isnan(x)) else f"{x:.0%}"


lines = [
    f"- Model `{model}`, seed {seed}, {fewshot}-shot prefix; analysed MLP layers {layers[0]}..{layers[-1]} "
    f"({len(layers)} layers x {info.d_mlp} neurons); operands "
    + ", ".join(f"{op} {operand_ranges[op][0]}..{operand_ranges[op][1]}" for op in grids)
    + (" (target: the first answer token)" if single < 99 else "")
    + "."
]
lines.append(
    "- Grid accuracy (whole answer): "
    + ", ".join(f"{r.op} {r.accuracy_full_answer:.0%} (n = {r.n_grid})" for r in acc.itertuples())
    + "; analysed prompts per operator: "
    + ", ".join(f"{r.op} {r.n_analysed}" for r in acc.itertuples())
    + "."
)
if skipped:
    lines.append(f"- Skipped (no correct prompt): {', '.join(skipped)}.")
lines.append(
    "- Selection / held-out prompts per operator: "
    + ", ".join(f"{r.op} {r.n_analysed} / {r.n_heldout}" for r in acc.itertuples())
    + f" (held-out target: {n_heldout} per operator, for a ±{heldout_half_width:.0%} half-width on a pooled gap)."
)
lines.append(
    f"- Attribution screen vs exact single-neuron mean ablation ({len(check)} neurons, {len(sub)} prompts, "
    f"operator {check_op}): correlation {attr_corr:.2f}; recall of the exact top {len(check) // 2}: "
    f"{attr_recall:.0%}; {missed_random} of {len(rand_idx)} random neurons exceed the weakest screened top neuron."
)
lines.append(
    f"- **Full circuit** ({n_circuit_heads} head-positions chosen on {len(sel)} Nikankin prompts, + {k_full} "
    f"neurons = {k_full / info.d_mlp:.2%} of each analysed MLP at '='; everything else mean-ablated at op1, "
    f"operator, op2, '='): held-out faithfulness {full_ci.text()} on {full_ci.n} prompts (per operator "
    + ", ".join(
        f"{r.op} {r.faithfulness:.2f}" + (" excluded: no F, the ablation changes nothing" if r.excluded else "")
        for r in circuit_summary[circuit_summary.op != "all"].itertuples()
    )
    + "; paper: about 96 %)."
)
k_share = k_circuit / info.d_mlp
one_pct = curve.iloc[(curve.share_per_layer - 0.01).abs().argsort()].share_per_layer.iloc[0]
at1 = curve[curve.share_per_layer == one_pct].groupby("op")["faithfulness"].mean()
reach = at_k.faithfulness.mean() >= target_faithfulness
lines.append(
    f"- Neuron circuit: {k_circuit} neurons per layer = {k_share:.2%} of each layer "
    f"({k_circuit * len(layers)} neurons per operator); pooled faithfulness at that size "
    + ", ".join(f"{r.op} {r.faithfulness:.2f}" for r in at_k.itertuples())
    + " (per-prompt mean: "
    + ", ".join(f"{r.op} {r.faithfulness_per_prompt:.2f}" for r in at_k.itertuples())
    + "); "
    + ("reaches" if reach else "does NOT reach")
    + f" the target {target_faithfulness}. "
    + f"At about 1 % per layer ({one_pct:.2%}) the pooled faithfulness is "
    + ", ".join(f"{op} {v:.2f}" for op, v in at1.items())
    + " (paper: about 96 % with about 1 % of neurons per layer)."
)
lines.append(
    f"- Circuit neurons matching a heuristic at t = {t}: "
    + ", ".join(f"{r.op} {r.matched_share:.0%} (shuffled {r.matched_share_null:.0%})" for r in share_table.itertuples())
    + f"; overall {neuron_table.matched.mean():.0%}; a matched neuron passes t for "
    + f"{neuron_table[neuron_table.matched].n_matches.mean():.1f} rules on average."
)
lines.append(
    f"- Labels that beat the shuffled-operand null (permutation test, Benjamini-Hochberg at {label_fdr:.0%}): "
    + ", ".join(
        f"{r.op} {r.labelled_share:.0%} (null {r.labelled_share_null:.0%}, {r.n_permutations} shuffles)"
        for r in share_table.itertuples()
    )
    + f"; overall {neuron_table.labelled.mean():.0%} of the circuit's neurons"
    + (" (none: the ablations have no labels to read)" if not neuron_table.labelled.any() else "")
    + "."
)
if len(counts):
    top_kinds = counts.groupby("kind").n_neurons.sum().sort_values(ascending=False)
    lines.append(
        f"- Most common heuristic types ({labels} labels; neurons, all operators): "
        + ", ".join(f"{k} {v}" for k, v in top_kinds.head(4).items())
        + "."
    )
s_any = sens[(sens.kind == "any")].groupby(["t", "activations"]).share.mean().unstack()
lines.append(
    "- Sensitivity to t (share matching, real / shuffled, mean over operators): "
    + ", ".join(f"t = {ti}: {s_any.loc[ti, 'real']:.0%} / {s_any.loc[ti, 'shuffled']:.0%}" for ti in s_any.index)
    + "."
)
if len(abl):
    gap = (abl.acc_other - abl.acc_assoc).mean()
    lines.append(
        f"- Ablating one heuristic's neurons ({labels} labels, held-out prompts, {len(abl)} heuristics, {abl.n_neurons.mean():.1f} neurons each on "
        f"average): accuracy on associated prompts {abl.acc_assoc.mean():.0%} vs other prompts "
        f"{abl.acc_other.mean():.0%} (other minus associated: {100 * gap:+.1f} points; "
        f"{(abl.acc_assoc < abl.acc_other).mean():.0%} of the heuristics hurt their own prompts more; "
        "paper: associated prompts drop much more)."
    )
else:
    lines.append("- No heuristic had neurons and enough associated prompts to ablate.")
pv = pa[(pa.cap == cap_verdict) & pa.testable.astype(bool)]
if len(pv):
    pa_ci = S.bootstrap_ci(
        lambda h, r: float(np.mean(r - h)),
        pv.correct_heuristic_ablated.astype(float).to_numpy(),
        pv.correct_random_ablated.astype(float).to_numpy(),
        groups=pd.factorize(pv.op)[0],
    )
    n_untestable = int((~pa[pa.cap == cap_verdict].testable.astype(bool)).sum())
    lines.append(
        f"- Per-prompt knockout at {cap_verdict} of {k_circuit} neurons per layer (zeroed): accuracy with the "
        f"prompt's heuristic neurons zeroed {pv.correct_heuristic_ablated.mean():.0%} vs the disjoint, "
        f"layer-matched random control {pv.correct_random_ablated.mean():.0%} on {len(pv)} testable held-out "
        f"prompts ({n_untestable} not testable; random minus heuristic: {pa_ci.text()}; unablated "
        f"{pv.correct_full.mean():.0%}; {pv.n_ablated.mean():.1f} neurons zeroed per prompt of "
        f"{pv.n_assoc_neurons.mean():.1f} associated; paper: the heuristic neurons hurt much more)."
    )
else:
    lines.append(f"- Per-prompt knockout at {cap_verdict} neurons per layer: no testable held-out prompt.")
n_inc = int((~ci.correct).sum())
if n_inc:
    cm = ci.groupby("correct")[["n_assoc_neurons", "assoc_contribution"]].mean()
    lines.append(
        f"- Correct vs incorrect grid prompts ({int(ci.correct.sum())} vs {n_inc}): associated heuristic neurons "
        f"{cm.loc[True, 'n_assoc_neurons']:.1f} vs {cm.loc[False, 'n_assoc_neurons']:.1f}; their summed direct "
        f"contribution to the correct logit {cm.loc[True, 'assoc_contribution']:.2f} vs "
        f"{cm.loc[False, 'assoc_contribution']:.2f} (paper: incorrect prompts have about as many associated neurons "
        "but a smaller contribution)."
    )
else:
    lines.append("- Every grid prompt is answered correctly (first token): no correct-vs-incorrect comparison.")
if dyn is not None:
    d = dyn.groupby("step")[
        ["accuracy", "matched_share", "matched_share_null", "result_label_share", "faithfulness"]
    ].mean()
    first, last = d.index[0], d.index[-1]
    ov = overlap.groupby("step").final_heuristics_present.mean()
    mid = [s for s in d.index if s not in (first, last)]
    lines.append(
        f"- Training dynamics ({len(d)} checkpoints, steps {first}..{last}, mean over operators): accuracy "
        f"{d.accuracy.iloc[0]:.0%} -> {d.accuracy.iloc[-1]:.0%}; circuit neurons matching a heuristic "
        f"{d.matched_share.iloc[0]:.0%} -> {d.matched_share.iloc[-1]:.0%} (chance {d.matched_share_null.iloc[0]:.0%} -> "
        f"{d.matched_share_null.iloc[-1]:.0%}); labelled with a result rule {d.result_label_share.iloc[0]:.0%} -> "
        f"{d.result_label_share.iloc[-1]:.0%}; pooled faithfulness {d.faithfulness.iloc[0]:.2f} -> "
        f"{d.faithfulness.iloc[-1]:.2f}"
        + (
            f"; final rules already present at step {mid[len(mid) // 2]}: {ov.loc[mid[len(mid) // 2]]:.0%}"
            if mid
            else ""
        )
        + "."
    )
    corr = (
        float(np.corrcoef(d.accuracy, d.matched_share)[0, 1])
        if len(d) > 2 and d.matched_share.std() > 0
        else float("nan")
    )
    lines.append(
        f"- Across checkpoints, correlation of accuracy and the matched share: {corr:.2f} (paper: heuristics "
        "appear gradually and early, and their share grows with accuracy)."
        + (
            f" At step {first} (before training) {d.matched_share.iloc[0]:.0%} of the circuit neurons already "
            "match a rule: a neuron whose activation varies smoothly with an operand passes an operand-range "
            "rule, so matching alone does not show a learned heuristic; the shuffled chance level does not "
            "capture this."
            if d.matched_share.iloc[0] >= 0.5
            else ""
        )
    )
lines.append(f"- Wall time of this run: {time.time() - t_start:.0f} s.")
Markdown("\n".join(lines))

# %% [markdown]
# ### Where this differs from the paper
# - **Model and tokens.** Llama-3-8B (one token per integer up to 999, operands up to 300)
#   vs the per-digit models here (Qwen2.5-Coder-0.5B and 1.5B, SmolLM2-135M: operands 0..9,
#   first answer token as target) and the toy model (one token per integer; operands as
#   trained). The few-shot prefix is ours: the instruct models need it (notebook 00 compares
#   their zero-shot and few-shot accuracy).
# - **Neuron attribution.** The paper patches neurons with counterfactual prompts (exact
#   activation patching); here attribution patching against the mean activation gives all
#   neurons in one backward pass, a screen whose recall of the exact top neurons is
#   measured above.
# - **Faithfulness.** The verdict reads the full circuit (heads + neurons, everything else
#   mean-ablated at op1 / operator / op2 / "=") on held-out prompts. Its heads come from
#   notebook 01's coarse-to-fine patching on a few Nikankin prompts per operator (the
#   paper patches every head at every position); MLPs below the analysed layers and MLPs at
#   the operand positions are kept whole; the neuron count is fixed at the paper's ~1 %.
#   The neuron-only curve (section 1) isolates the late-MLP computation.
# - **Circuit size.** Chosen by a stated rule (smallest k reaching `target_faithfulness`
#   pooled), not fixed at the paper's ~1 %; the faithfulness at ~1 % is reported beside it.
# - **Match score.** The top-activating set has the size of the rule's prompt set; rules
#   covering more than `max_base_rate` of the grid are not judged; the chance level from
#   shuffled activations is reported because small grids (10 x 10 for the per-digit
#   models) make chance matches common. Heuristics are classified from activations only;
#   the logit lens is shown in the gallery but not used to classify.
# - **Labels.** Every rule a neuron matches at t (`labels = "all"`, the paper's association)
#   *and* whose label beats the shuffled-operand null at `label_fdr` (the paper applies t
#   alone). `labels = "best"` runs the one-label version.
# - **Prompt knockout (Fig. 8).** As the authors' code: a per-layer cap, the control drawn
#   per layer from the layer's circuit neurons minus the zeroed ones, zero ablation. Here
#   the neurons are zeroed at the answer position only (the authors zero every position);
#   ties in the ranking go to the summed match score (theirs to their rule dictionary's
#   order); a prompt without a disjoint pool is counted as not testable (their draw would
#   fail); the verdict reads one cap (25 of 200 per layer) where the paper shows the curve.
# - **Grids.** The per-digit models' grids have 2-digit operands (0..99, subsampled), the
#   paper's 0..299 single-token operands being unavailable to them.
# - **Training dynamics.** The toy model's checkpoints (minutes of training on arithmetic
#   only) instead of Pythia-6.9B's; the notebook takes Pythia steps through `dynamics_steps`.
