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
# # 02 · MLP probing: what the MLPs read and write, layer by layer
#
# **Results** (qwen2.5-coder-0.5b, the committed run): [this notebook executed, with its outputs](../figures/qwen2.5-coder-0.5b/notebooks/02_mlp_probing.ipynb) · [its section of the report](../figures/qwen2.5-coder-0.5b/REPORT.md#notebook-02)
#
# **Running it.** Run as it is (Run All), this notebook takes about 7 minutes on qwen2.5-coder-0.5b
# (a 2-core CPU: `figures/qwen2.5-coder-0.5b/timings.csv`) and writes to
# `outputs/scratch/figures/<model>/` (first made as a copy of the committed `figures/<model>/`,
# whose tables later notebooks read), never to the committed `figures/`. For a short run on
# the small toy model, set `model = "toy-arith"` and `quick = True` in the parameters cell.
# Only `./run_all.sh` writes the committed figures.
#
# **Question.** Zhang et al. (2024, Sec. 5.2 "Key MLPs behavior", Fig. 6, 13, 14) find
# that at the last position of an arithmetic prompt the MLP *inputs* pick up the
# operands A and B in the layers where the key attention heads sit, and that later
# MLPs write the answer C while suppressing other numbers, "coarse-to-fine" (for
# "4+3=" the neighbours 6 and 8 come up with 7, then fall back). Does this model show
# the same layer-by-layer picture, and where is the operand and result information
# linearly readable (the probing side of Nikankin et al. 2025)?
#
# **Method.** All activations are taken at the answer position (the last prompt
# token) only.
# 1. Per layer, over the prompts the model answers correctly (Zhang's templates, 4
#    operators, operands 1..9, 2-shot prefix): cos(MLP_in, W_U[A]), cos(MLP_in, W_U[B]),
#    the same for MLP_out, and the cosine of the MLP's contribution with W_U[C] against
#    its mean cosine with W_U[n] over the other candidate numbers n (Zhang Fig. 6a, b),
#    with 95 % confidence bands, and (our control, not in the paper) each target's
#    cosine minus the mean cosine with the other numbers; the start / inflection / peak /
#    end of each curve by the rule of `arithlib.zhang.mlp_curves.curve_points` (layer 0 left out,
#    see below), compared with the layers of the key heads found by notebook 01. The
#    MLP's contribution is read two ways (see **Which reading the verdict takes**): its
#    write into the residual stream, resid_post − resid_mid (the verdict's), and the
#    literal MLP_out − MLP_in with the normalised input (a sensitivity reading). The
#    verdict reads where the write's answer curve climbs, with 95 % intervals by a
#    bootstrap over prompts.
# 2. Single cases ("4+3=" as in Fig. 6c, and "8-5="): cos(MLP_out − MLP_in, W_U[n]) for
#    every number n at every layer; the same over all prompts as a function of |n − C|.
# 3. Logit lens (residual stream after each layer through the final norm and W_U):
#    rank and probability of the answer; direct logit attribution of each layer's
#    attention and MLP output to the answer logit, logit(C) = Σ_c (w ⊙ c / s) · W_U[:, C] + b_U[C]
#    with the final norm's scale s frozen.
# 4. Linear probes (scikit-learn) on the residual stream after each layer: operands A
#    and B, result C (values, held-out R²) and C's last digit (held-out accuracy),
#    trained on Yu & Ananiadou's 2-digit prompts with a split grouped by operand pair,
#    against the same probe trained on shuffled labels.
#
# **Definitions.** MLP_in is the MLP module's input, hook `blocks.L.mlp.hook_in` (the
# residual stream after attention, `resid_mid`, through the block's second norm
# *including* its weight; `ln2.hook_normalized` is the vector before the weight);
# MLP_out is `blocks.L.hook_mlp_out`; the MLP's write is `blocks.L.hook_resid_post` −
# `blocks.L.hook_resid_mid`. W_U[n] is the unembedding column of the first
# token of n written without a space: with the per-digit tokenizers of Qwen and SmolLM2
# operands 1..9 are single tokens and a two-digit answer is read through its first
# digit (the token the model must produce first); the toy model has a token per
# integer. "Other numbers" are the single-token numbers 0..max(9, largest answer)
# except C's token.
#
# **Where this differs from the paper.** Zhang et al. analyse LLaMA2-7B/13B and
# Mistral-7B on 1000 prompts without a prefix; the models here are far smaller (135M to
# 1.5B parameters, or the toy model), every prompt carries the 2-shot prefix that the
# instruct models need to answer reliably (notebook 00 measures their accuracy with and
# without it), and the sizes are set for a CPU run (see the parameters). Qwen2.5's input and output embeddings are tied, and all digit tokens
# share a large common direction in W_U, so raw cosines with W_U[A] partly measure "a
# number is here" rather than "A is here"; panel (c) of the cosine figure subtracts the
# mean over the other numbers to separate the two. Section 2 also shows the MLP's own
# write (MLP_out alone): the literal MLP_out − MLP_in mixes the MLP's write with minus
# its normalised input.

# %% tags=["parameters"]
model = "qwen2.5-coder-0.5b"
device = "cpu"
dtype = "auto"  # "auto": bfloat16 on a GPU, float32 on a CPU; or "float32", "bfloat16"
device_map = None  # None: the whole model on `device`; "auto", "balanced" or {module: device} splits it across GPUs
quick = False
seed = 0
out_dir = "../outputs/scratch/figures"  # run_all.sh passes the committed figures/ (or its own scratch)
fewshot = 2  # solved examples in the prefix of every prompt (query's own template)
n_per_template = 8  # Zhang prompts per template and operator (8 templates x 4 operators, 256 in all):
# the verdict's onset depth must be told apart at 13/32 and 17/32 (0.125 apart), so
# its bootstrap interval must be narrower than ~+-0.06 (1.5 of 24 layers); at ~230
# correct prompts the mean curve's per-layer 95 % band is ~+-0.005 cos, far below the
# steps that define the onset (the report gives the onset's interval)
cases = [["+", 4, 3], ["-", 8, 5]]  # single cases of section 2 (Zhang template 0: A + B =)
lens_max_prompts = 128  # prompts read through the full-vocabulary logit lens (stratified by operator)
probe_ops = ["+", "-"]  # operators of the probe set (Yu 2-digit prompts)
probe_templates = [3]  # Yu Table 14 template indices (3: A + B =)
probe_n_per_template = 250  # operand pairs per operator and template for the probes
probe_test_frac = 0.25  # held-out share of operand pairs
batch_size = 32
compare_model = None  # e.g. "smollm2-135m": run everything on it too and draw both side by side

# %%
import time
from dataclasses import replace
from pathlib import Path

import pandas as pd
import torch
from IPython.display import Markdown, display

import arithlib.core.datasets as ds
import arithlib.plots.probing as plots
import arithlib.zhang.answer_cache as answer_cache
import arithlib.zhang.lens as lens
import arithlib.zhang.mlp_curves as mlp_curves
import arithlib.zhang.path_patching as path_patching
import arithlib.zhang.probing as probing
from arithlib.core.models import load_model
from arithlib.core.prompt_sets import PromptSet, single_token_max, single_token_numbers
from arithlib.run.floor import Sections
from arithlib.run.outputs import find_table, read_table, save_figure, save_table
from arithlib.run.runs import start_run

if quick:
    n_per_template, lens_max_prompts, probe_n_per_template = 2, 24, 60
t_start = time.perf_counter()
params = dict(
    fewshot=fewshot,
    n_per_template=n_per_template,
    cases=cases,
    lens_max_prompts=lens_max_prompts,
    probe_ops=probe_ops,
    probe_templates=probe_templates,
    probe_n_per_template=probe_n_per_template,
    probe_test_frac=probe_test_frac,
    batch_size=batch_size,
    compare_model=compare_model,
    mlp_in_hook="blocks.L.mlp.hook_in",
    mlp_out_hook="blocks.L.hook_mlp_out",
)
run = start_run("02_mlp_probing", model, device, seed, out_dir, quick, dtype=dtype, device_map=device_map, **params)
torch.set_grad_enabled(False)
models = {model: run.model}
# each section's wall time and arithmetic against the machine's peak (arithlib.run.floor)
timed = Sections.of_run(run)
timed.add("load", wall_s=time.perf_counter() - t_start)


# %% [markdown]
# ## Prompts and the reference set
# Zhang's 8 distinct templates per operator (Fig. 8) with operands 1..9 and the 2-shot
# prefix; one forward pass per prompt caches the answer-position activations and greedy
# decoding (from the same key/value cache) decides whether the model answers the whole
# number correctly. Only correct prompts are analysed (Zhang's reference set X_r).


# %%
def zhang_set(tokenizer):
    recs = ds.zhang_prompts(n_per_template=n_per_template, seed=seed, fewshot=fewshot)
    # counterfactuals are not used here: dropping them keeps prompts whose counterfactual
    # would tokenize to a different length (PromptSet.build drops those)
    return PromptSet.build([replace(r, counterfactual=None) for r in recs], tokenizer)


def reference_set(loaded):
    """Cache the Zhang set and keep the prompts the model answers correctly."""
    ps = zhang_set(loaded.tokenizer)
    cache = answer_cache.cache_answer_position(loaded.bridge, ps, batch_size=batch_size)
    ok = cache.correct
    acc = ps.to_frame()[["op"]].assign(correct=ok.numpy()).groupby("op")["correct"].agg(["mean", "size"]).reset_index()
    keep = ok.nonzero().flatten().tolist()
    return ps, cache, ps.subset(keep), cache.subset(keep), acc


sets = {}
with timed("reference set"):
    for name, loaded in models.items():
        sets[name] = reference_set(loaded)
ps_all, cache_all, ps_ok, cache_ok, acc = sets[model]
acc = acc.rename(columns={"mean": "accuracy", "size": "n"})
save_table(acc, run.out, "02_reference_accuracy")
display(acc)
print(f"{len(ps_ok)} of {len(ps_all)} Zhang prompts answered correctly ({len(ps_ok) / len(ps_all):.0%})")


# %% [markdown]
# ## 1 · Operands in the MLP input, answer in the MLP output (Zhang Fig. 6a, 6b)


# %%
def key_layers_of(out: Path) -> tuple[pd.DataFrame | None, list[int]]:
    path = find_table(out, "01_path_patching")  # .csv or .csv.gz
    if path is None:
        return None, []
    heads = path_patching.stored_key_heads(read_table(path))  # notebook 01's key heads (Zhang's -5 %, pooled)
    return heads, sorted(int(layer) for layer in heads.layer.unique())


def cosine_study(loaded, ps, cache):
    if len(ps) == 0:
        return None
    biggest = max(9, max(r.answer for r in ps.records))
    numbers = single_token_numbers(loaded.tokenizer, min(biggest, single_token_max(loaded.tokenizer)))
    frame = mlp_curves.unembed_cosines(cache, ps, mlp_curves.unembed_matrix(loaded.bridge), numbers)
    summary = mlp_curves.summarise_curves(frame)
    return frame, summary, mlp_curves.curve_point_table(summary), numbers


key_heads, key_layers = key_layers_of(run.out)
with timed("cosines"):
    cos_results = {name: cosine_study(models[name], sets[name][2], sets[name][3]) for name in models}
if key_heads is None:
    print(
        "01_path_patching.csv is absent from",
        run.out,
        "- the comparison with key-head layers is skipped (run notebook 01 first to get it).",
    )
else:
    print(f"key heads of notebook 01 (pooled effect < -5 %): {len(key_heads)} in layers {key_layers}")
if cos_results[model] is None:
    print("no correct prompts: section 1 is skipped")
else:
    cos_frame, cos_summary, cos_points, numbers = cos_results[model]
    save_table(cos_summary, run.out, "02_mlp_cosines")
    # per prompt and layer, the curves the verdict reads (the MLP's write) and its sensitivity reading (the
    # literal MLP_out - MLP_in): the report bootstraps the climb and its onset over prompts
    save_table(
        cos_frame[cos_frame.measure.isin(["write_C", "write_other", "delta_C", "delta_other"])],
        run.out,
        "02_mlp_cosines_per_prompt",
    )
    save_table(cos_points, run.out, "02_mlp_cosine_points")
    fig = plots.cosine_curves({model: cos_summary}, {model: key_layers}, {model: cos_points})
    save_figure(fig, run.out, "02_mlp_cosines")
    by_op = mlp_curves.summarise_curves(cos_frame, by=("op", "measure", "layer"))
    save_table(by_op, run.out, "02_mlp_cosines_by_op")
    display(cos_points)


# %% [markdown]
# Panel (c) subtracts, for each target, the mean cosine with the other numbers: a
# positive value means the vector points at that specific number more than at numbers
# in general.
#
# Curve points (rule of `curve_points`, tolerance 10 % of the curve's range R), searched
# from layer 1: *peak* is the layer of the maximum; *start* the layer after the last one
# before the peak that is within 0.1 R of the minimum; *inflection* the steepest one-layer
# rise between start and peak; *end* the first layer from the inflection on after which the
# curve stays within 0.1 R of its last value. For the cosines with W_U[other] the
# rule is applied to the negated curve (its fall). Zhang's (start-inflection-end) for
# LLaMA2-7B are (13-18-28) of 32 layers, and the same points in Fig. 13 and 14.
#
# **Which reading the verdict takes.** Zhang Sec. 4.2: "the MLP layer initially receives
# its input from the residual stream (MLP_in), subsequently adding its output back into
# that stream (MLP_out)", and they subtract the two "to isolate the specific contribution
# of MLP". What the MLP adds to the residual stream is resid_post − resid_mid, its write,
# so the verdict reads cos(resid_post − resid_mid, W_U[C]) (solid curves of panel b). The
# literal reading, the MLP module's output minus its input after the block's second norm
# (with its weight), is kept as a sensitivity reading (dashed): on Qwen2.5 that normalised
# input is far larger than the MLP's output, so the literal curve is close to
# −cos(MLP_in, W_U[C]). The report gives both, each with its interval.
#
# **Which point the verdict reads.** Zhang describe the answer curve as "initial
# stabilization followed by an increase" (App. C, Fig. 14) that begins "from the 17th
# layer" (Sec. 5.2): their inflection (18 of 32) is where the plateau turns into the climb,
# i.e. our *start*, not the steepest step. Whether the curve climbs at all is itself
# judged on the bootstrap (a climb that only some resamples show is inconclusive, not
# "not reproduced"). **Layer 0 is left out** of every
# curve-point search (`mlp_curves.FIRST_CURVE_LAYER`, fixed in advance): the MLP of layer 0
# reads the token embedding after one attention layer, and with tied embeddings its cosine
# with a W_U column is the embedding's similarity with itself (on Qwen-0.5B the answer curve
# jumps from −0.49 at layer 0 to −0.03 at layer 1, a jump that alone would decide the verdict).

# %% [markdown]
# ## 2 · Single cases: top numbers of MLP_out − MLP_in per layer (Zhang Fig. 6c)
# The prefix of the "+" prompts is "3 + 4 = 7\n8 + 1 = 9\n", so for "4 + 3 =" the answer
# 7 is also in the context (3 + 4 = 7); "8 - 5 =" (prefix "7 - 3 = 4\n9 - 5 = 4\n") has an
# answer that appears nowhere in its prompt. Cases are analysed whether or not the model
# answers them (stated below). The heatmap's columns are the single-token numbers
# 0..max(9, C + 5).


# %%
def case_study(loaded, op, a, b):
    recs = [
        replace(r, counterfactual=None)
        for r in ds.zhang_prompts(ops=[op], templates=[0], fewshot=fewshot)
        if r.a == a and r.b == b
    ]
    if not recs:
        raise ValueError(f"{a} {op} {b} is not a Zhang prompt with operands 1..9")
    ps = PromptSet.build(recs, loaded.tokenizer)
    cache = answer_cache.cache_answer_position(loaded.bridge, ps, progress=False)
    c = recs[0].answer
    hi = min(max(9, c + 5), single_token_max(loaded.tokenizer))
    numbers = single_token_numbers(loaded.tokenizer, hi)
    W_U = mlp_curves.unembed_matrix(loaded.bridge)
    proj = mlp_curves.number_projection(cache, 0, W_U, numbers)
    proj_out = mlp_curves.number_projection(cache, 0, W_U, numbers, vector="mlp_out")
    c_num = c if c in numbers else int(str(c)[0])  # per-digit tokenizers: the answer's first digit
    return {
        "text": recs[0].text,
        "answer": c,
        "answer_number": c_num,
        "correct": bool(cache.correct[0]),
        "projection": proj,
        "top": mlp_curves.top_numbers(proj, 3),
        "c2f": mlp_curves.coarse_to_fine(proj, c_num),
        "projection_out": proj_out,
        "c2f_out": mlp_curves.coarse_to_fine(proj_out, c_num),
    }


with timed("cases"):
    case_results = {name: [case_study(models[name], op, a, b) for op, a, b in cases] for name in models}
case_rows = []
for i, res in enumerate(case_results[model]):
    tag = f"case{i + 1}"
    save_table(
        pd.concat(
            [res["projection"].assign(vector="MLP_out - MLP_in"), res["projection_out"].assign(vector="MLP_out")]
        ).assign(case=res["text"].strip()),
        run.out,
        f"02_case_projection_{tag}",
    )
    title = (
        f"{plots.short_name(model)}: '{res['text'].strip()}' (answer {res['answer']}, model correct: {res['correct']})"
    )
    save_figure(
        plots.number_heatmap(res["projection"], res["answer_number"], title=title), run.out, f"02_case_heatmap_{tag}"
    )
    save_figure(
        plots.number_heatmap(res["projection_out"], res["answer_number"], title=title, vector_label="MLP_out"),
        run.out,
        f"02_case_heatmap_{tag}_mlp_out",
    )
    for vec, c2f in (("MLP_out - MLP_in", res["c2f"]), ("MLP_out", res["c2f_out"])):
        case_rows.append(
            {
                "case": res["text"].strip(),
                "vector": vec,
                "answer": res["answer"],
                "model_correct": res["correct"],
                "answer_rank_by_layer": c2f["rank_by_layer"],
                "first_layer_answer_top1_to_end": c2f["first_top1"],
                "neighbour_in_top3_before": c2f["neighbour_top_layers"],
                "coarse_to_fine": c2f["coarse_to_fine"],
            }
        )
    display(res["top"].set_index("layer").T)
case_table = pd.DataFrame(case_rows)
save_table(case_table, run.out, "02_case_summary")
display(case_table)

# %% [markdown]
# Over all correct prompts with a single-token answer: mean cosine with numbers at
# distance |n − C| from the answer. If the answer forms coarse-to-fine, the |n − C| = 1
# curve rises above the farther numbers before (or while) the |n − C| = 0 curve pulls
# away from it.

# %%
profiles = {}
for name, loaded in models.items():
    if cos_results[name] is None:
        continue
    profiles[name] = mlp_curves.distance_profile(
        sets[name][3], sets[name][2], mlp_curves.unembed_matrix(loaded.bridge), cos_results[name][3]
    )
if profiles:
    save_table(profiles[model], run.out, "02_distance_profile")
    fig = plots.distance_curves({model: profiles[model]})
    save_figure(fig, run.out, "02_distance_profile")


# %% [markdown]
# ## 3 · Logit lens and direct logit attribution
# The logit lens reads the full vocabulary, so it runs on at most `lens_max_prompts`
# correct prompts (the same number per operator, seeded); the direct logit attribution
# needs only the answer's column of W_U and runs on all correct prompts. The DLA
# contributions of each prompt sum to its answer logit (checked below).


# %%
def lens_study(loaded, ps, cache):
    if len(ps) == 0:
        return None
    idx = answer_cache.stratified_indices(ps, lens_max_prompts, by="op", seed=seed)
    lens_frame = lens.logit_lens_answer(loaded.bridge, cache.subset(idx), ps.subset(idx))
    dla = lens.direct_logit_attribution_answer(loaded.bridge, cache, ps)
    err = lens.dla_reconstruction_error(dla, cache)
    return (
        lens_frame,
        lens.lens_summary(lens_frame),
        dla,
        mlp_curves.summarise_curves(dla, by=("component", "layer"), value="dla"),
        err,
    )


with timed("lens + DLA"):
    lens_results = {name: lens_study(models[name], sets[name][2], sets[name][3]) for name in models}
if lens_results[model] is None:
    print("no correct prompts: section 3 is skipped")
else:
    lens_frame, lens_sum, dla, dla_sum, dla_err = lens_results[model]
    save_table(lens_sum, run.out, "02_logit_lens")
    save_table(lens.lens_summary(lens_frame, by=("op", "layer")), run.out, "02_logit_lens_by_op")
    save_table(dla_sum, run.out, "02_dla")
    save_figure(plots.lens_curves({model: lens_sum}), run.out, "02_logit_lens")
    save_figure(plots.dla_curves({model: dla_sum}, {model: key_layers}), run.out, "02_dla")
    print(
        f"logit lens on {lens_frame.prompt.nunique()} prompts; DLA on {dla.prompt.nunique()} prompts, "
        f"largest |sum of contributions - answer logit| = {dla_err:.2e}"
    )


# %% [markdown]
# ## 4 · Linear probes at the answer position
# Yu & Ananiadou's 2-digit prompts (Table 14) with the 2-shot prefix, operators and
# templates as in the parameters; every prompt is used (the labels are the true operands
# and result, whether or not the model gets it right; its accuracy is reported). Each
# layer's residual stream (after the block; layer −1 is the embedding) is standardised;
# values are probed with ridge regression (alpha by leave-one-out CV), the last digit
# with multinomial logistic regression (C = 0.1). A quarter of the operand pairs is held
# out (grouped split: a pair never sits on both sides). The baseline is the same probe
# trained on shuffled labels.


# %%
def probe_inputs(loaded):
    """The probe prompts' answer-position residual streams (the model's passes)."""
    recs = ds.yu_prompts(
        ops=probe_ops,
        n_digits=2,
        n_per_template=probe_n_per_template,
        seed=seed,
        fewshot=fewshot,
        templates=probe_templates,
    )
    ps = PromptSet.build(recs, loaded.tokenizer)
    cache = answer_cache.cache_answer_position(
        loaded.bridge, ps, kinds=["resid_pre", "resid_post"], batch_size=batch_size
    )
    return ps, cache


def probe_study(ps, cache):
    """The probes fitted on those streams (scikit-learn)."""
    stack, layer_ids = lens.lens_stack(cache)
    labels = probing.probe_labels(ps, ["a", "b", "result", "result_last_digit"])
    probes = probing.linear_probes(stack, labels, test_frac=probe_test_frac, seed=seed, layer_labels=layer_ids)
    return probes, len(ps), float(cache.correct.float().mean())


# the model's passes and the fits are timed apart: the fits' arithmetic (scikit-learn) is
# not counted in the floor of the timings table
with timed("probes: residual streams"):
    probe_caches = {name: probe_inputs(models[name]) for name in models}
with timed("probes: fits"):
    probe_results = {name: probe_study(*probe_caches[name]) for name in models}
del probe_caches
probes, n_probe, probe_acc = probe_results[model]
save_table(probes, run.out, "02_probes")
best = probing.best_layers(probes)
save_table(best, run.out, "02_probes_best")
save_figure(plots.probe_curves({model: probes}), run.out, "02_probes")
print(
    f"{n_probe} probe prompts ({int(best.n_train[0])} train / {int(best.n_test[0])} held out); "
    f"model accuracy on them {probe_acc:.0%}"
)
display(best)

# %% [markdown]
# ## 5 · A second model side by side
# With `compare_model` set (e.g. `"smollm2-135m"`), sections 1-4 run on it with the same
# prompts and settings, and the curves of both models are drawn side by side (each on
# its own layer axis).

# %%
if compare_model:
    with timed(f"compare model {compare_model}"):
        other = load_model(compare_model, device=device, dtype=dtype)
        models[compare_model] = other
        sets[compare_model] = reference_set(other)
        cos_results[compare_model] = cosine_study(other, sets[compare_model][2], sets[compare_model][3])
        case_results[compare_model] = [case_study(other, op, a, b) for op, a, b in cases]
        lens_results[compare_model] = lens_study(other, sets[compare_model][2], sets[compare_model][3])
        probe_results[compare_model] = probe_study(*probe_inputs(other))
        if cos_results[compare_model] is not None:
            profiles[compare_model] = mlp_curves.distance_profile(
                sets[compare_model][3],
                sets[compare_model][2],
                mlp_curves.unembed_matrix(other.bridge),
                cos_results[compare_model][3],
            )
    both = [m for m in models if cos_results[m] is not None]
    if len(both) == 2:
        save_figure(
            plots.cosine_curves(
                {m: cos_results[m][1] for m in both}, {model: key_layers}, {m: cos_results[m][2] for m in both}
            ),
            run.out,
            "02_compare_mlp_cosines",
        )
        save_figure(plots.distance_curves({m: profiles[m] for m in both}), run.out, "02_compare_distance_profile")
        save_table(pd.concat([cos_results[m][2].assign(model=m) for m in both]), run.out, "02_compare_cosine_points")
    lensed = [m for m in models if lens_results[m] is not None]
    save_figure(plots.lens_curves({m: lens_results[m][1] for m in lensed}), run.out, "02_compare_logit_lens")
    save_figure(plots.dla_curves({m: lens_results[m][3] for m in lensed}), run.out, "02_compare_dla")
    save_figure(plots.probe_curves({m: probe_results[m][0] for m in models}), run.out, "02_compare_probes")
    save_table(
        pd.concat([probing.best_layers(probe_results[m][0]).assign(model=m) for m in models]),
        run.out,
        "02_compare_probes_best",
    )
    for i in range(len(cases)):
        res = case_results[compare_model][i]
        save_figure(
            plots.number_heatmap(
                res["projection"],
                res["answer_number"],
                title=f"{plots.short_name(compare_model)}: '{res['text'].strip()}' (model correct: {res['correct']})",
            ),
            run.out,
            f"02_compare_case_heatmap_case{i + 1}",
        )
else:
    print("compare_model is None: section 5 is skipped")

# %%
timing_table = timed.table(total_wall_s=time.perf_counter() - t_start)  # the total includes loading
save_table(timing_table, run.out, "02_timings")
timing_table


# %% [markdown]
# ## What this run found


# %%
def findings(name: str) -> list[str]:
    out = [f"**{name}** ({models[name].info.n_layers} layers)"]
    ps_a, ps_k = sets[name][0], sets[name][2]
    out.append(
        f"- Reference set: {len(ps_k)} of {len(ps_a)} Zhang prompts answered correctly "
        f"({len(ps_k) / len(ps_a):.0%}), {fewshot}-shot."
    )
    cr = cos_results[name]
    if cr is None:
        out.append("- No correct prompts, so the cosine curves, the logit lens and DLA were skipped.")
    else:
        summ, pts = cr[1], cr[2].set_index("measure")

        def fmt(m):
            r = pts.loc[m]
            peak_val = summ[(summ.measure == m) & (summ.layer == r.peak)]["mean"].item()
            return (
                f"start {int(r.start)}, inflection {int(r.inflection)}, peak {int(r.peak)} "
                f"(mean cos {peak_val:.3f}), end {int(r.end)}"
            )

        out.append(f"- cos(MLP_in, W_U[A]): {fmt('in_A')}; cos(MLP_in, W_U[B]): {fmt('in_B')}.")
        out.append(
            f"- Operands over the other numbers (excess cosine): MLP_in·A {fmt('in_A_x')}; MLP_in·B {fmt('in_B_x')}."
        )
        out.append(f"- cos(MLP_out, W_U[A]): {fmt('out_A')}; cos(MLP_out, W_U[B]): {fmt('out_B')}.")
        out.append(
            f"- The MLP's write, cos(resid_post − resid_mid, W_U[C]) (the verdict's reading): "
            f"{fmt('write_C')}; the falling curve cos(resid_post − resid_mid, W_U[other]) (rule on its "
            f"negation): {fmt('write_other')}."
        )
        out.append(
            f"- Literal cos(MLP_out − MLP_in, W_U[C]) (sensitivity reading): {fmt('delta_C')}; the falling "
            f"curve cos(MLP_out − MLP_in, W_U[other]) (rule on its negation): {fmt('delta_other')}."
        )
        out.append(
            f"- Answer over the other numbers (excess cosine): the MLP's write {fmt('write_C_x')}; "
            f"MLP_out − MLP_in {fmt('delta_C_x')}."
        )
        for vec, c_m, o_m in (
            ("the MLP's write", "write_C", "write_other"),
            ("MLP_out − MLP_in", "delta_C", "delta_other"),
        ):
            c_last = summ[(summ.measure == c_m)].sort_values("layer")["mean"].to_numpy()
            o_last = summ[(summ.measure == o_m)].sort_values("layer")["mean"].to_numpy()
            above = [i for i in range(len(c_last)) if c_last[i] > o_last[i]]
            out.append(
                f"- {vec[0].upper() + vec[1:]} is more aligned with W_U[C] than with the mean other number at "
                f"{len(above)} of {len(c_last)} layers; largest gap {max(c_last - o_last):.3f} at layer "
                f"{int((c_last - o_last).argmax())}."
            )
        if name == model and key_layers:
            for m in ("in_A", "in_A_x", "in_B_x"):
                r = pts.loc[m]
                inside = [layer for layer in key_layers if r.start <= layer <= r.peak]
                out.append(
                    f"- Key heads of notebook 01 sit in layers {key_layers}; {len(inside)} of those "
                    f"{len(key_layers)} layers lie in the climb of {mlp_curves.COSINE_MEASURES[m][2]} "
                    f"(layers {int(r.start)}..{int(r.peak)})."
                )
        elif name == model and key_heads is not None:
            out.append("- Notebook 01 found no key heads (pooled effect < -5 %): no comparison with key-head layers.")
        elif name == model:
            out.append("- No 01_path_patching.csv in the figures folder: no comparison with key-head layers.")
    for res, (vec, c2f) in [  # noqa: B020 (res: each case's result, paired)
        (res, pair)
        for res in case_results[name]
        for pair in (("MLP_out − MLP_in", res["c2f"]), ("MLP_out", res["c2f_out"]))
    ]:
        when = (
            f"is the top-1 number of {vec} from layer {c2f['first_top1']} to the last layer"
            if c2f["first_top1"] is not None
            else f"is not the top-1 number of {vec} at the last layer"
        )
        out.append(
            f"- Case '{res['text'].strip()}' (answer {res['answer']}, model correct: {res['correct']}): the answer "
            f"{res['answer_number']} {when} (its rank among the numbers per layer: {c2f['rank_by_layer']}); "
            f"a neighbour (C ± 1) is in the top 3 before that at layers {c2f['neighbour_top_layers'] or 'none'}; "
            f"coarse-to-fine by the stated rule: {c2f['coarse_to_fine']}."
        )
    lr = lens_results[name]
    if lr is not None:
        ls, dsum = lr[1], lr[3]
        first = lens.first_layer_reaching(ls, "top1", 0.5)
        out.append(
            f"- Logit lens: the answer is the top-1 token for at least half of the prompts from layer "
            f"{first} on; at the last layer for {ls.sort_values('layer').top1.iloc[-1]:.0%}; median rank at "
            f"the middle layer {int(ls.sort_values('layer').median_rank.iloc[len(ls) // 2])}."
        )
        mlp = dsum[dsum.component == "mlp"].sort_values("mean", ascending=False).head(3)
        attn = dsum[dsum.component == "attn"].sort_values("mean", ascending=False).head(3)
        out.append(
            "- DLA: largest mean MLP contributions to the answer logit at layers "
            + ", ".join(f"{int(r.layer)} ({r['mean']:+.2f})" for _, r in mlp.iterrows())
            + "; attention at layers "
            + ", ".join(f"{int(r.layer)} ({r['mean']:+.2f})" for _, r in attn.iterrows())
            + "."
        )
    pr, n_pr, acc_pr = probe_results[name]
    bl = probing.best_layers(pr)
    parts = [
        f"{probing.PROBE_TARGETS[r.target][1]}: {r.metric} {r.score:.2f} at layer {int(r.layer)} (shuffled {r.baseline:.2f})"
        for _, r in bl.iterrows()
    ]
    out.append(
        f"- Probes ({n_pr} Yu 2-digit prompts, {', '.join(probe_ops)}; model accuracy {acc_pr:.0%}): "
        + "; ".join(parts)
        + "."
    )
    return out


lines = []
for name in models:
    lines += findings(name)
import arithlib.report as R

zf = next(f for f in R.FINDINGS if f.id == "zhang_mlp_answer")
zo = R.judge(zf, R.Tables(run.out))
lines.append(f"- **Answer curve, verdict** ({model}, report rule zhang_mlp_answer): {zo.ours} → *{zo.verdict}*.")
lines.append(f"- Wall time {timing_table.wall_s.iloc[-1]:.0f} s on {run.model.device} (quick = {quick}).")
Markdown("\n".join(lines))
