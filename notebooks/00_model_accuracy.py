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
# # 00 · How well does the model do arithmetic?
#
# **Results** (qwen2.5-coder-0.5b, the committed run): [this notebook executed, with its outputs](../figures/qwen2.5-coder-0.5b/notebooks/00_model_accuracy.ipynb) · [its section of the report](../figures/qwen2.5-coder-0.5b/REPORT.md#notebook-00)
#
# **Running it.** Run as it is (Run All), this notebook takes about 13 minutes on qwen2.5-coder-0.5b
# (a 2-core CPU: `figures/qwen2.5-coder-0.5b/timings.csv`) and writes to
# `outputs/scratch/figures/<model>/` (first made as a copy of the committed `figures/<model>/`,
# whose tables later notebooks read), never to the committed `figures/`. For a short run on
# the small toy model, set `model = "toy-arith"` and `quick = True` in the parameters cell.
# Only `./run_all.sh` writes the committed figures.
#
# **Question.** Before looking inside a model we need to know what it can do: which of the
# three papers' prompt formats it answers, for which operators and operand sizes, and
# whether it needs a few-shot prefix. The prompts it answers correctly form the
# *reference set* X_r that every later notebook analyses (Zhang et al. Sec. 3; Yu &
# Ananiadou Sec. 3.2; Nikankin et al. Sec. 2).
#
# **Method.** Greedy decoding at the answer position. A prompt is correct when the
# whole answer is generated and the model then stops writing digits
# (`correct_full`); we also report whether the first answer token is the argmax
# (`correct_first`), the quantity the patching metrics use. Each prompt set is run
# zero-shot and with a `fewshot`-example prefix written in the query's own template
# (for "+" in the symbolic format: `3+4=7\n8+1=9\n`).
#
# Prompt sets: Nikankin's `{x}{op}{y}=` (single-token operands and results), Yu's
# four templates per operator (Table 14) with 1-, 2- and 3-digit operands, Zhang's
# eight distinct templates per operator (Fig. 8), Zhang's word problems (Fig. 10) and
# exponentiation (App. D).
#
# **Where this differs from the papers.** *Prefix:* the papers study much larger models
# (7B parameters and up) on prompts without solved examples (Zhang App. A and Yu App. A
# describe none, nor does what we have of Nikankin's setup); here every set is run
# zero-shot and with the `fewshot`-example prefix, and the later notebooks analyse the
# prefixed prompts. *Correctness:* Zhang et al. measure the prediction of the single answer
# token {C} and keep the samples the model predicts correctly (Sec. 3); Yu & Ananiadou
# "take accuracy as metric" (Sec. 3.2) without describing the decoding. Here decoding is
# greedy and `correct_full` asks for the whole, possibly multi-token, answer followed by a
# token that does not continue the number (`arithlib.core.evaluate.evaluate`, checked in one
# teacher-forced pass that gives greedy decoding's verdict); `correct_first` is the
# single-token criterion. *Sizes:* `n_per_template` prompts per template and operator
# instead of Zhang's 10,000 addition samples or Yu's 1,600 two-digit sentences; Nikankin's
# operands and results are single tokens, which for per-digit tokenizers means 0..9 (the
# builder stops at 300). Word problems run zero-shot only, and those a tokenizer cannot
# split at the answer are dropped.

# %% tags=["parameters"]
model = "qwen2.5-coder-0.5b"
device = "cpu"
dtype = "auto"  # "auto": bfloat16 on a GPU, float32 on a CPU; or "float32", "bfloat16"
device_map = None  # None: the whole model on `device`; "auto", "balanced" or {module: device} splits it across GPUs
quick = False
seed = 0
out_dir = "../outputs/scratch/figures"  # run_all.sh passes the committed figures/ (or its own scratch)
fewshot = 2  # solved examples in the prefix of every analysis prompt
n_per_template = 10  # prompts per template and operator (Yu, Zhang, word problems): 40-80 per table cell

# %%
import time

import arithlib.core.datasets as ds
from arithlib.core.evaluate import accuracy, evaluate_sets
from arithlib.core.prompt_sets import PromptSet, single_token_max
from arithlib.plots.accuracy import accuracy_bars, heatmap
from arithlib.run.floor import Sections
from arithlib.run.outputs import save_figure, save_table
from arithlib.run.runs import start_run

if quick:
    n_per_template = 4
t_start = time.perf_counter()
run = start_run(
    "00_model_accuracy",
    model,
    device,
    seed,
    out_dir,
    quick,
    dtype=dtype,
    device_map=device_map,
    fewshot=fewshot,
    n_per_template=n_per_template,
)
tok = run.tokenizer
max_operand = min(single_token_max(tok), 300)
print(run.model.info)
print("largest single-token operand:", max_operand)
timed = Sections.of_run(run)  # wall time and arithmetic against the machine's peak (arithlib.run.floor)


# %% [markdown]
# ## Prompt sets
# Each builder returns tokenizer-free records; `PromptSet.build` tokenizes them and
# checks that prompt and answer split at a token boundary.


# %%
def build_sets(k: int) -> dict[str, PromptSet]:
    sets = {
        "nikankin": ds.nikankin_prompts(
            max_operand=max_operand, n_per_op=None if not quick else 10, seed=seed, fewshot=k
        ),
        "zhang": ds.zhang_prompts(n_per_template=n_per_template, seed=seed, fewshot=k),
        "power": ds.power_prompts(seed=seed, fewshot=k),
    }
    for digits in (1, 2, 3):
        sets[f"yu_{digits}d"] = ds.yu_prompts(n_digits=digits, n_per_template=n_per_template, seed=seed, fewshot=k)
    if k == 0:
        sets["word_problems"] = ds.zhang_word_problems(n_per_template=n_per_template, seed=seed)
    # Word problems end inside a number ("... to the year 197" -> "8"); a tokenizer with
    # whole-number tokens cannot split them, and those prompts are left out (with a warning).
    return {
        name: PromptSet.build(records, tok, drop_unsplittable=name == "word_problems") for name, records in sets.items()
    }


shot_settings = sorted({0, fewshot})
frames = []
for k in shot_settings:
    with timed(f"evaluation, {k}-shot"):
        frame = evaluate_sets(run.bridge, build_sets(k))
    frames.append(frame.assign(fewshot=k))
save_table(timed.table(total_wall_s=time.perf_counter() - t_start), run.out, "00_timings")  # total: with loading
import pandas as pd

results = pd.concat(frames, ignore_index=True)
results[["set", "fewshot", "op", "text", "answer_text", "generated", "correct_first", "correct_full"]].head()

# %% [markdown]
# ## Accuracy by prompt set, operator and prefix

# %%
by_set = accuracy(results, ["set", "op", "fewshot"])
by_set_first = accuracy(results, ["set", "op", "fewshot"], column="correct_first").rename(
    columns={"accuracy": "accuracy_first_token"}
)
table = by_set.merge(by_set_first[["set", "op", "fewshot", "accuracy_first_token"]], on=["set", "op", "fewshot"])
save_table(table, run.out, "00_accuracy_by_set")
table

# %%
fig = accuracy_bars(
    by_set.assign(setting=by_set["set"] + " " + by_set["op"]),
    x="setting",
    hue="fewshot",
    title=f"{model}: exact-answer accuracy",
    xlabel="prompt set and operator",
)
fig.axes[0].tick_params(axis="x", rotation=90)
save_figure(fig, run.out, "00_accuracy_by_set")

# %% [markdown]
# ## Accuracy by template (with the few-shot prefix)

# %%
templ = accuracy(results[results.fewshot == fewshot], ["set", "op", "template_id"])
save_table(templ, run.out, "00_accuracy_by_template")
fig = heatmap(
    templ.assign(acc=templ.accuracy * 100, row=templ["set"] + " t" + templ.template_id.astype(str)),
    index="row",
    columns="op",
    values="acc",
    title=f"{model}: accuracy by template (%), {fewshot}-shot",
    cbar_label="accuracy (%)",
)
save_figure(fig, run.out, "00_accuracy_by_template")

# %% [markdown]
# ## What this run found

# %%
overall = accuracy(results, ["fewshot"])
best = by_set[by_set.fewshot == fewshot].sort_values("accuracy", ascending=False)
lines = [f"- Model `{model}`; {len(results)} prompts evaluated (seed {seed})."]
for _, row in overall.iterrows():
    lines.append(f"- {int(row.fewshot)}-shot: {row.accuracy:.1%} of all prompts answered exactly (n = {int(row.n)}).")
for name in ["nikankin", "yu_1d", "yu_2d", "yu_3d", "zhang"]:
    sub = by_set[(by_set.set == name) & (by_set.fewshot == fewshot)]
    if len(sub):
        parts = ", ".join(f"{r.op} {r.accuracy:.0%}" for r in sub.itertuples())
        lines.append(f"- {name}, {fewshot}-shot: {parts}.")
from IPython.display import Markdown

Markdown("\n".join(lines))
