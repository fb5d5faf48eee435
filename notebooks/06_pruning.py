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
# # 06 · Pruning with CNA: how much of the deep FFN does arithmetic need?
#
# **Results** (qwen2.5-coder-0.5b, the committed run): [this notebook executed, with its outputs](../figures/qwen2.5-coder-0.5b/notebooks/06_pruning.ipynb) · [its section of the report](../figures/qwen2.5-coder-0.5b/REPORT.md#notebook-06)
#
# **Running it.** Run as it is (Run All), this notebook takes about 20 minutes on qwen2.5-coder-0.5b
# (a 2-core CPU: `figures/qwen2.5-coder-0.5b/timings.csv`) and writes to
# `outputs/scratch/figures/<model>/` (first made as a copy of the committed `figures/<model>/`,
# whose tables later notebooks read), never to the committed `figures/`. For a short run on
# the small toy model, set `model = "toy-arith"` and `quick = True` in the parameters cell.
# Only `./run_all.sh` writes the committed figures.
#
# **Question.** Yu & Ananiadou (2024, Sec. 6.1, Table 11) find (Sec. 4) that the information
# for the final prediction is concentrated in a few deep FFN neurons, and that LoRA works by
# amplifying them (Sec. 5). If so, a model whose deep FFN layers keep only the neurons CNA
# marks as important, fine-tuned with LoRA, should still do 2-digit arithmetic, and a model
# pruned at random to the same size should not. Their Llama-7B: original 62.9 %, LoRA on
# layer 9 89.3 %, LoRA9 on the CNA-pruned model (5 % of the neurons of layers 17-31 kept)
# 82.3 %, LoRA9 on a randomly pruned model with as many neurons 17.1 %.
#
# **Method.**
# * *CNA* (Sec. 4.1): for FFN neuron k of layer l at the answer position, with
#   x^{l-1} + A^l the residual after layer l's attention, m_k its coefficient and fc2_k its
#   value vector,
#
#   imp = log p(w | x^{l-1} + A^l + m_k fc2_k) - log p(w | x^{l-1} + A^l),
#
#   computed in the LoRA model of Yu's reference layer (9 of 32, scaled to this model; the
#   model notebook 05 trained) and in the original, on the 1D cases of +, -, *, /
#   ("3 + 5 =", target w = the correct first answer token); each case ranks the deep
#   neurons by the change imp_LoRA - imp_orig.
# * *Selection*: Yu keep the union of every case's top-500. A neuron's **best rank** (its
#   best position in any case's ranking) decides it: the union of all top-K is exactly the
#   set with best rank <= K, so sorting by best rank (ties: mean rank over cases) gives one
#   order whose prefixes are these unions. Table 11 keeps the first `main_share` (Yu's
#   "only 5 %") of the deep neurons in that order; the sweep keeps other shares.
# * *Pruning*: every other neuron of the deep layers is **removed** (`arithlib.yu.pruning.prune_ffn`:
#   smaller gate/up/down matrices, a model with fewer parameters), not masked; a masked
#   copy (same neurons zeroed in the full-size model) is evaluated beside it as a check.
# * *Fine-tuning*: LoRA on the reference layer of the pruned model, trained on notebook 05's
#   2-digit training split with its settings; accuracy on its 2-digit test split (whole
#   answer, then stop: `answer_loss.answer_accuracy`). Control: the same number of neurons drawn
#   uniformly at random from the deep layers (several seeds).
# * *Judged* (`yu_pruning` in the report): gap = accuracy after LoRA of the CNA-pruned model minus
#   the mean over the random prunings, 95 % interval by a paired bootstrap over the test prompts
#   that also redraws the random prunings (so the spread between random seeds is in it);
#   reproduced if the interval lies >= 32.6 points (half of Yu's 65.2) and CNA-pruned minus the
#   original lies > 0; partly if the gap lies >= 5 points; inconclusive while an interval straddles
#   a threshold. Runs at scale `quick` are shown but not judged.
# * *Costs*: parameter counts (total and deep FFN) and the wall time of one forward pass
#   over a fixed batch of test prompts (the fastest of a few passes: other work on the machine
#   can only slow a pass down, and `run_all.sh` runs two notebooks at a time).

# %% tags=["parameters"]
model = "qwen2.5-coder-0.5b"
device = "cpu"
dtype = "auto"  # "auto": bfloat16 on a GPU, float32 on a CPU; or "float32", "bfloat16"
device_map = None  # None: the whole model on `device`; "auto", "balanced" or {module: device} splits it across GPUs
quick = False
seed = 0
out_dir = "../outputs/scratch/figures"  # run_all.sh passes the committed figures/ (or its own scratch)
main_share = 0.05  # share of the deep FFN neurons kept in Table 11 (Yu: "only 5 %")
shares = [0.01, 0.02, 0.05, 0.1, 0.2]  # the sweep over the share kept
mode = "auto"  # CNA importance: "exact", "two_stage", or "auto" (exact on a GPU or a small model)
cases_per_op = "auto"  # 1D cases per operator for CNA: an int, None (all), or "auto" (the scale's)
n_candidates = "auto"  # two-stage mode: exact CNA scores per case ("auto": the scale's)
norm_reading = "final"  # CNA through the final norm: "final" (the authors') or "own" (a variant)
random_seeds = "auto"  # random prunings at main_share, each LoRA-tuned ("auto": the scale's)
sweep_seeds = "auto"  # random prunings per share in the sweep ("auto": the scale's)
sweep_lora = "auto"  # fine-tune LoRA at every share of the sweep (True/False/"auto")
use_cache = True  # reuse trained LoRA weights (keyed by model, data and settings)
batch_size = 32  # evaluation batch size (notebook 05's; part of its cache key)

# %%
import json
import time
import warnings

import pandas as pd
from IPython.display import Markdown, display

import arithlib.methods.finetune as FT
import arithlib.methods.finetune_data as FD
import arithlib.plots.pruning as plots
import arithlib.report as R
import arithlib.run.scales as scales
import arithlib.yu.cna as C
import arithlib.yu.lora as lora
import arithlib.yu.pruned_model as pruned_model
import arithlib.yu.pruning as pruning
import arithlib.yu.pruning_selection as selection
from arithlib.core import papers
from arithlib.core.prompt_sets import PromptSet
from arithlib.run.floor import Sections
from arithlib.run.outputs import find_table, read_table, save_figure, save_table
from arithlib.run.paths import cache_root
from arithlib.run.runs import start_run
from arithlib.run.stored import Store

warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")  # raised by peft on every LoRA model
t_start = time.time()
run = start_run(
    "06_pruning",
    model,
    device,
    seed,
    out_dir,
    quick,
    dtype=dtype,
    device_map=device_map,
    main_share=main_share,
    shares=shares,
    mode=mode,
    cases_per_op=cases_per_op,
    n_candidates=n_candidates,
    random_seeds=random_seeds,
    sweep_seeds=sweep_seeds,
    sweep_lora=sweep_lora,
    batch_size=batch_size,
    norm_reading=norm_reading,
)
bridge, tok, info = run.bridge, run.tokenizer, run.model.info
# trained weights; a run that loads them shows what their training took (reused_s)
cache_dir = Store(cache_root() / "finetune" / model.replace("/", "__") if use_cache else None)
timed = Sections.of_run(run, [cache_dir])  # each section's time and arithmetic against the peak (arithlib.run.floor)

# Notebook 05's settings and LoRA table: this notebook fine-tunes exactly as 05 did.
p05_path, acc05_path = run.out / "05_lora_mechanism_params.json", find_table(run.out, "05_lora_accuracy_by_layer")
missing = ([] if p05_path.exists() else [p05_path.name]) + ([] if acc05_path else ["05_lora_accuracy_by_layer.csv"])
if missing:
    raise FileNotFoundError(
        f"{', '.join(missing)} not found in {run.out}: notebook 06 starts from notebook 05's LoRA "
        "model and training settings. Run notebooks/05_lora_mechanism.ipynb with the same model and "
        "out_dir first."
    )
p05 = json.loads(p05_path.read_text())
acc05 = read_table(acc05_path)
for key, mine in (("quick", quick), ("seed", seed)):
    if p05.get(key) != mine:
        print(
            f"note: notebook 05 ran with {key}={p05.get(key)!r}, this run has {key}={mine!r}: its data differ, so the "
            "reference LoRA model is trained again here rather than read from the cache"
        )
# the scale notebook 05 ran at (a params file without scale_resolved: "auto" meant "quick" on a CPU)
scale05 = p05.get("scale_resolved") or scales.resolve_scale(
    p05.get("scale", "auto"), run.model.device, quick, auto_cpu="quick"
)
S05 = scales.scale_settings(scale05, run.model.device, quick, info.n_layers)
S = pruning.pruning_scale(S05["scale"])
for name, value in (
    ("cases_per_op", cases_per_op),
    ("n_candidates", n_candidates),
    ("random_seeds", random_seeds),
    ("sweep_seeds", sweep_seeds),
    ("sweep_lora", sweep_lora),
):
    if value != "auto":
        S[name] = value
deep = C.deep_layers(info.n_layers)
ref_layer = lora.reference_layer(info.n_layers)
widths = {l: pruned_model.ffn_width(bridge, l) for l in deep}
n_deep = sum(widths.values())
k_scaled = pruning.scaled_top_k(n_deep)
mode_used = C.resolve_mode(bridge, mode)
print(info)
print(
    f"deep layers {deep[0]}..{deep[-1]} of 0..{info.n_layers - 1} (Yu: 17..31 of 32), {n_deep:,} deep FFN neurons "
    f"(Yu: {papers.YU_DEEP_NEURONS:,}); LoRA layer {ref_layer} (Yu: 9 of 32); Yu's top-500 scaled to this depth: "
    f"top-{k_scaled}; CNA mode {mode_used}"
)
display(
    pd.DataFrame(
        [
            {
                **{
                    f"05: {k}": str(v)
                    for k, v in S05.items()
                    if k in ("scale", "n_train", "n_val", "n_test", "lora_epochs", "lora_batch")
                },
                **{k: str(v) for k, v in S.items()},
            }
        ]
    ).T.rename(columns={0: "setting"})
)

# %% [markdown]
# ## Scale of this run and differences from the paper
# * **Model and layers.** Yu use Llama-7B (32 layers, 11,008 FFN neurons each): deep layers
#   17-31, LoRA on layer 9. Here both are scaled by depth: deep layers from round(17/32 x L)
#   (`cna.deep_layers`), LoRA on round(9/32 x L) (`lora.reference_layer`), as notebooks 04
#   and 05 do.
# * **How many neurons.** Yu keep the union of every case's top-500, "about 5 %". The size of
#   such a union depends on the number of cases and the model, so here the **share** is the
#   setting (`main_share`, 5 %) and the union order decides which neurons fill it; the run
#   reports which per-case top-K that share corresponds to, and the share Yu's top-500 would
#   give when scaled to this model's deep neurons (500 / 165,120 of them per case).
# * **Cases.** All 1D cases of the four operators (+, * with operands 0..9, - with a >= b,
#   / as "72/8="), or a random subset per operator at the CPU and quick scales (table above).
#   Neurons are ranked within the deep layers only (the layers that are pruned).
# * **CNA mode.** On a CPU, Qwen's 152k-token vocabulary makes the exact importance of every
#   neuron too slow; the two-stage mode scores every neuron to first order and the top
#   `n_candidates` per case exactly. A case's ranking puts its exactly scored neurons first
#   (by exact change) and the rest by the first-order change.
# * **Sizes.** The scale is notebook 05's (the `scale_resolved` of its params: "auto" is `paper`
#   on a GPU and `cpu` on a CPU); this notebook's sizes per scale are `pruning.PRUNING_SCALES`. `paper` (for a GPU): all
#   336 1D cases, 1,000 exact CNA scores per case in two-stage mode, Yu's lr grid for every
#   pruned model, LoRA at every share of the sweep, 3 random seeds. `cpu`: 12 cases per
#   operator, 300 exact CNA scores per case, LoRA trained on the CNA-pruned model and on 3
#   random prunings at 5 %, and the sweep's other shares evaluated before fine-tuning only
#   (one random seed each; set `sweep_lora = True` to fine-tune at every share); it is
#   estimated at about 25 minutes for Qwen2.5-Coder-0.5B on two cores (from measured step
#   times; see benchmarks/RESULTS.md). `quick`: a smoke test with 8 cases per operator, 50 exact
#   scores per case, 2 random seeds at 5 % and LoRA at every share of the sweep (one random
#   seed per share). The table printed above lists what this run used.
# * **Training data and settings** are notebook 05's (same split, lr, epochs, LoRA r/alpha):
#   the "cpu" scale trains on 512 of Yu's 18,000 sentences for one epoch (the size at which
#   notebook 05's measured learning curve separates a LoRA model from the original) and tests on 385 (a 95 % half-width of
#   about 5 points: `stats.n_for_half_width(0.5, 0.05)`); the "quick" scale on 48, so its
#   numbers are not judged. The pruned models get notebook 05's lr for the reference layer
#   (Yu's lr grid is searched for them only at the "paper" scale); the LoRA passes start at
#   the reference layer from the original's recorded stream (the pruned layers are above it).
# * **Random control over seeds.** Yu report one random pruning (17.1 %); here
#   `random_seeds` prunings (3 at the cpu scale), and the report's interval includes the
#   spread between them.
# * **Random control.** Yu's LoRA9-r has "the same number of neurons"; here they are drawn
#   uniformly from all deep neurons (so per-layer counts differ from the CNA set's).
# * **Timing** is wall time on this machine (shared CPU cores are noisy); the pruned model
#   is a plain Hugging Face model with smaller MLP matrices, executed by the same code as the
#   original. A TransformerBridge cannot represent per-layer FFN widths in its stacked weight
#   views, so the pruned models are evaluated and fine-tuned through `arithlib.methods.finetune`.

# %%
timed.start()
splits = FD.yu_lora_data(
    n_train=S05["n_train"], n_test=S05["n_test"], n_val=S05["n_val"], ops=p05["ops"], seed=seed, fewshot=p05["fewshot"]
)
train_set, val_set, test_set = (PromptSet.build(splits[k], tok) for k in ("train", "val", "test"))
val = val_set if len(val_set) else None
row05 = acc05[acc05.layer == ref_layer]
if row05.empty:
    raise ValueError(
        f"05_lora_accuracy_by_layer.csv has no LoRA model of layer {ref_layer} (the reference layer); rerun notebook 05"
    )
config = FT.TrainConfig(
    lr=float(row05.lr.iloc[0]),
    epochs=S05["lora_epochs"],
    batch_size=S05["lora_batch"],
    seed=seed,
    eval_batch_size=batch_size,
)
lora_spec = lora.LoraSpec(r=int(p05["lora_r"]), alpha=int(p05["lora_alpha"]))
lora_ref = lora.train_lora(bridge, ref_layer, train_set, config, val, lora_spec, progress=False, cache_dir=cache_dir)
lrs = list(p05["lrs"]) if S["lr_search"] else []
timed.lap("data + reference LoRA")
print(
    f"{len(train_set)} train / {len(val_set)} val / {len(test_set)} test sentences; reference LoRA: layer {ref_layer}, "
    f"lr {config.lr:g}, {lora_ref.n_trainable:,} LoRA parameters; notebook 05 reported test accuracy "
    f"{float(row05.accuracy.iloc[0]):.1%} ({timed.wall('data + reference LoRA'):.0f} s here)"
)

# %% [markdown]
# ## 1. CNA between the LoRA model and the original on the 1D cases

# %%
timed.start()
cases = selection.yu_1d_cases(tok, fewshot=p05["fewshot"], per_op=S["cases_per_op"], seed=seed)
scores = selection.lora_cna_scores(
    bridge,
    cases,
    lora_ref.weights,
    deep,
    mode=mode_used,
    n_candidates=S["n_candidates"],
    batch_size=batch_size,
    norm_reading=norm_reading,
)
ranking = selection.union_ranking(scores)
curve = selection.union_size_curve(ranking)
n_main = selection.n_for_share(main_share, n_deep)
k_main = selection.k_of_prefix(ranking, n_main)
union_scaled = len(selection.union_top_k(ranking, k_scaled))
timed.lap("1 CNA")
cna_seconds = timed.wall("1 CNA")
case_frame = cases.to_frame()[["op", "a", "b", "answer"]].assign(
    correct_original=scores.correct_original.numpy(), correct_lora=scores.correct_lora.numpy()
)
case_summary = (
    case_frame.groupby("op", sort=False)
    .agg(
        n_cases=("a", "size"),
        first_token_accuracy_original=("correct_original", "mean"),
        first_token_accuracy_lora=("correct_lora", "mean"),
    )
    .reset_index()
)
save_table(case_summary, run.out, "06_cna_cases")
save_table(ranking.head(selection.n_for_share(max(shares), n_deep)), run.out, "06_neuron_ranking")
save_table(curve, run.out, "06_union_size")
fig = plots.union_size(
    curve,
    main=(k_main, n_main / n_deep),
    scaled_k=k_scaled,
    title=f"{model}: union of the cases' top-K CNA neurons ({len(cases)} cases, layers {deep[0]}-{deep[-1]})",
)
save_figure(fig, run.out, "06_union_size")
print(
    f"{len(cases)} cases; first-token accuracy on them: original {scores.accuracy_original:.0%}, LoRA "
    f"{scores.accuracy_lora:.0%}; CNA {scores.mode}"
    + (f" ({scores.n_candidates} exact per case)" if scores.n_candidates else "")
    + f", {cna_seconds:.0f} s"
)
print(
    f"keeping {main_share:.0%} = {n_main:,} of {n_deep:,} deep neurons = the union of every case's top-{k_main} "
    f"(completed in order); Yu's top-500 scaled (top-{k_scaled}) gives {union_scaled:,} neurons = "
    f"{union_scaled / n_deep:.1%}"
)
ranking.head(10)

# %% [markdown]
# ## 2. Table 11: LoRA on the CNA-pruned model vs on a randomly pruned one
# Every model row is evaluated on the same 2-digit test split. "LoRA on CNA-masked" is the
# full-size model with the same neurons zeroed and the pruned model's LoRA weights: it must
# match the pruned row's accuracy (the pruning is exact) but saves neither parameters nor time.

# %%
timed.start()
tokens = pruned_model.timing_tokens(test_set, S["timing_batch"])
seeds = [seed * 1000 + i for i in range(int(S["random_seeds"]))]
if not seeds:
    raise ValueError("random_seeds must be at least 1: Table 11 compares the CNA-pruned model with random prunings")
table, keeps = pruning.table11(
    bridge,
    ranking,
    main_share,
    deep,
    ref_layer,
    lora_ref.weights,
    train_set,
    test_set,
    config,
    random_seeds=seeds,
    lrs=lrs,
    val_set=val,
    lora=lora_spec,
    cache_dir=cache_dir,
    tokens=tokens,
    repeats=S["timing_repeats"],
    batch_size=batch_size,
    n_lora_reference=lora_ref.n_trainable,
)
timed.lap("2 Table 11")
save_table(table, run.out, "06_table11")
fig = plots.table11_plot(
    table,
    title=f"{model}: Yu Table 11 ({main_share:.0%} of the deep FFN neurons of layers "
    f"{deep[0]}-{deep[-1]} kept, LoRA on layer {ref_layer}; {len(test_set)} test sentences, "
    f"{S['scale']} scale; timing: batch {tuple(tokens.shape)})",
)
save_figure(fig, run.out, "06_table11")
print(
    f"timing batch {tuple(tokens.shape)} (prompts x tokens), {S['timing_repeats']} passes, fastest (forward_min_s) compared"
)
table[
    [
        "model",
        "seed",
        "n_kept",
        "accuracy_pruned",
        "accuracy",
        "paper",
        "n_params",
        "n_deep_ffn_params",
        "n_lora",
        "forward_min_s",
        "speedup",
    ]
]

# %% [markdown]
# ## 3. Sweep over the share of deep neurons kept, CNA vs random
# Solid: after LoRA on the pruned model; dashed: the pruned model before fine-tuning (its
# own accuracy, no training). Shares other than `main_share` are fine-tuned only when the
# scale says so (`sweep_lora`).

# %%
timed.start()
others = [s for s in shares if abs(s - main_share) > 1e-12]
sweep_seed_list = [seed * 1000 + i for i in range(int(S["sweep_seeds"]))]
sweep_rest, sweep_keeps = pruning.share_sweep(
    bridge,
    ranking,
    others,
    deep,
    ref_layer,
    train_set,
    test_set,
    config,
    random_seeds=sweep_seed_list,
    fine_tune=bool(S["sweep_lora"]),
    lrs=lrs,
    val_set=val,
    lora=lora_spec,
    cache_dir=cache_dir,
    batch_size=batch_size,
)
main_rows = table[table.selection.isin(["cna", "random"])]
sweep = (
    pd.concat([main_rows[[c for c in sweep_rest.columns if c in main_rows.columns]], sweep_rest], ignore_index=True)
    .sort_values(["selection", "share", "seed"])
    .reset_index(drop=True)
)
sweep["share_pct"] = 100 * sweep.share
summary = pruning.summarize_sweep(sweep)
timed.lap("3 sweep")
save_table(sweep, run.out, "06_share_sweep")
save_table(summary, run.out, "06_share_sweep_summary")
acc = dict(zip(table.model, table.accuracy))
fig = plots.share_sweep_plot(
    sweep,
    reference={"original": acc["original"], f"LoRA L{ref_layer}": acc["LoRA"]},
    main_share=main_share,
    paper=papers.YU_TABLE11,
    title=f"{model}: pruning the deep FFN layers {deep[0]}-{deep[-1]}, CNA union vs random",
)
save_figure(fig, run.out, "06_share_sweep")
summary.pivot_table(index="share", columns="selection", values=["accuracy_pruned", "accuracy"]).round(3)

# %% [markdown]
# ## 4. Where the kept neurons are
# Share of each deep layer's neurons in the CNA set and in the first random set of Table 11.

# %%
first_random = f"random seed {seeds[0]}"
by_layer = selection.kept_by_layer({"CNA union": keeps["cna"], first_random: keeps[first_random]}, widths)
save_table(by_layer, run.out, "06_kept_by_layer")
fig = plots.kept_by_layer_plot(by_layer, title=f"{model}: deep FFN neurons kept per layer ({main_share:.0%} overall)")
save_figure(fig, run.out, "06_kept_by_layer")
by_layer.pivot_table(index="layer", columns="selection", values="n_kept")

# %% [markdown]
# ## What this run found

# %%
save_table(timed.table(total_wall_s=time.time() - t_start), run.out, "06_timings")  # total: with loading
t = table.set_index("model", drop=False)
orig, lora_full = t.loc["original"], t.loc["LoRA"]
pruned, masked = t.loc["LoRA on CNA-pruned"], t.loc["LoRA on CNA-masked"]
rand = table[table.model == "LoRA on random-pruned"]
r_mean, r_sd = float(rand.accuracy.mean()), float(rand.accuracy.std()) if len(rand) > 1 else float("nan")
lines = [
    f"- Model `{model}`, {S['scale']} scale, seed {seed}: {len(train_set)} training / {len(test_set)} test "
    f"sentences (notebook 05's split), LoRA (r = {lora_spec.r}) on layer {ref_layer}, deep layers "
    f"{deep[0]}-{deep[-1]} ({n_deep:,} FFN neurons)."
]
lines.append(
    f"- CNA (LoRA vs original, {scores.mode}"
    + (f", {scores.n_candidates} exact per case" if scores.n_candidates else "")
    + f") on {len(cases)} 1D cases of + - * /. Keeping {main_share:.0%} = {n_main:,} neurons takes "
    f"the union of every case's top-{k_main}; Yu's top-500, scaled to this model (top-{k_scaled}), would keep "
    f"{union_scaled / n_deep:.1%} (Yu: about 5 %)."
)
lines.append(
    f"- Table 11 (2-digit test accuracy, whole answer): original {orig.accuracy:.1%} [Yu 62.9 %], LoRA "
    f"{lora_full.accuracy:.1%} [89.3 %], LoRA on the CNA-pruned model {pruned.accuracy:.1%} [82.3 %], LoRA on "
    f"randomly pruned models {r_mean:.1%}"
    + (f" ± {r_sd:.1%} (sd over {len(rand)} seeds)" if len(rand) > 1 else "")
    + " [17.1 %]."
)
lines.append(
    f"- Before fine-tuning, the pruned models score {pruned.accuracy_pruned:.1%} (CNA) and "
    f"{float(rand.accuracy_pruned.mean()):.1%} (random, mean): LoRA adds "
    f"{100 * (pruned.accuracy - pruned.accuracy_pruned):+.1f} and "
    f"{100 * (r_mean - float(rand.accuracy_pruned.mean())):+.1f} points."
)
verdicts = []
verdicts.append(
    f"the CNA-pruned model {'beats' if pruned.accuracy > r_mean else 'does NOT beat'} the random ones "
    f"({100 * (pruned.accuracy - r_mean):+.1f} points; Yu: +65.2)"
)
verdicts.append(
    f"{'beats' if pruned.accuracy > orig.accuracy else 'does NOT beat'} the unpruned original "
    f"({100 * (pruned.accuracy - orig.accuracy):+.1f}; Yu: +19.4)"
)
verdicts.append(
    f"{'stays below' if pruned.accuracy < lora_full.accuracy else 'reaches'} LoRA on the full model "
    f"({100 * (pruned.accuracy - lora_full.accuracy):+.1f}; Yu: -7.0)"
)
lines.append("- After LoRA, " + "; ".join(verdicts) + ".")
lines.append(
    f"- Size: {int(orig.n_params):,} -> {int(pruned.n_params):,} parameters "
    f"({100 * (pruned.params_share - 1):+.1f} %); deep FFN parameters {int(orig.n_deep_ffn_params):,} -> "
    f"{int(pruned.n_deep_ffn_params):,} ({pruned.deep_ffn_share:.1%} kept; Yu: 5 %); LoRA adds "
    f"{int(pruned.n_lora):,} parameters ({100 * pruned.lora_share:.3f} % of the original; Yu: 0.015 %)."
)
lines.append(
    f"- Forward pass (batch {tuple(tokens.shape)}, fastest of {S['timing_repeats']}): original "
    f"{1000 * orig.forward_min_s:.1f} ms, CNA-pruned {1000 * pruned.forward_min_s:.1f} ms ({pruned.speedup:.2f}x), "
    f"masked {1000 * masked.forward_min_s:.1f} ms ({masked.speedup:.2f}x). The masked model matches the pruned "
    f"one's accuracy ({masked.accuracy:.1%} vs {pruned.accuracy:.1%}: "
    f"{'equal' if abs(masked.accuracy - pruned.accuracy) < 1e-9 else 'DIFFERENT'}) without saving anything."
)
rows = []
for share, g in summary.groupby("share"):
    c, r = g[g.selection == "cna"], g[g.selection == "random"]
    if len(c) and len(r):
        after = (
            f"after LoRA CNA {float(c.accuracy.iloc[0]):.1%} vs random {float(r.accuracy.iloc[0]):.1%}, "
            if pd.notna(c.accuracy.iloc[0])
            else ""
        )
        rows.append(
            f"{100 * share:g} %: {after}before LoRA {float(c.accuracy_pruned.iloc[0]):.1%} vs "
            f"{float(r.accuracy_pruned.iloc[0]):.1%}"
        )
lines.append(
    "- Sweep (share of deep neurons kept; CNA vs random, random averaged over seeds): " + "; ".join(rows) + "."
)
wins = summary.pivot_table(index="share", columns="selection", values="accuracy_pruned")
if {"cna", "random"} <= set(wins.columns):
    n_win = int((wins["cna"] > wins["random"]).sum())
    lines.append(f"- Before fine-tuning, the CNA set beats the random set at {n_win} of {len(wins)} shares.")
lines += R.notebook_verdicts(run.out, "06")  # the report's rule, from the tables saved above
lines.append(f"- Wall time {time.time() - t_start:.0f} s on {run.model.device} (CNA {cna_seconds:.0f} s).")
if S["scale"] == "quick":
    lines.append(
        "- Quick mode: a few training steps on a few dozen prompts and few cases; these numbers test the "
        "pipeline, not the paper's claims."
    )
Markdown("\n".join(lines))
