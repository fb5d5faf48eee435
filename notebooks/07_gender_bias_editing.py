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
# # 07 · Gender-bias editing with CNA
#
# **Results** (qwen2.5-coder-0.5b, the committed run): [this notebook executed, with its outputs](../figures/qwen2.5-coder-0.5b/notebooks/07_gender_bias_editing.ipynb) · [its section of the report](../figures/qwen2.5-coder-0.5b/REPORT.md#notebook-07)
#
# **Running it.** Run as it is (Run All), this notebook takes about 14 minutes on qwen2.5-coder-0.5b
# (a 2-core CPU: `figures/qwen2.5-coder-0.5b/timings.csv`) and writes to
# `outputs/scratch/figures/<model>/` (first made as a copy of the committed `figures/<model>/`,
# whose tables later notebooks read), never to the committed `figures/`. For a short run on
# the small toy model, set `model = "toy-arith"` and `quick = True` in the parameters cell.
# Only `./run_all.sh` writes the committed figures.
#
# **Question.** Yu & Ananiadou (2024, Sec. 6.2 and App. D) use Comparative Neuron
# Analysis to find FFN neurons that make a model prefer some professions after
# "woman" and others after "man", zero 18 of them and report that the bias falls by
# 35.7 % (Table 13: 1.26 -> 0.81 nats). Does that hold for our offline models, is it
# more than zeroing any 18 neurons does, what else does the edit change, and does it
# carry over to prompts and professions that were not used to pick the neurons?
#
# **Method.**
# 1. *Professions from the model (App. D, Table 23).* The 8 prompts of Table 22 with
#    "man" and "woman"; each prompt's top-100 next tokens. A token is a *profession
#    token* when a profession of our lexicon `data/professions.json` (260 occupations,
#    compiled by hand for this repository; source and rule in its `_doc`) starts with
#    it: the token is the profession's whole first word, or a prefix of it with at
#    least 5 letters (" reception" for "receptionist"). **Scoring rule: a profession is
#    scored by log p of the first token of " " + profession**; professions that share a
#    first token are one profession token. The paper does not say how it scores a
#    profession of several tokens: its Table 23 lists single words ("reception",
#    "delivery", "police") beside multi-word professions ("machine operator", "domestic
#    helper", "dental assistant"). Here every profession, multi-word ones included, is
#    represented by its first token, the unit of a top-100 next-token list. A
#    profession token is biased towards a gender when it is in that gender's top-100
#    and not in the other's on more prompts than the reverse. Grammatically gendered
#    forms (actress, policeman, ...) are listed but left out of the biased set: a
#    difference on them is agreement, not occupational bias.
# 2. *CNA between the genders (Sec. 4.1, Sec. 6.2).* On the first prompt ("A <gend>
#    works as a"), for each biased profession token w: importance of neuron k of layer
#    l, imp = log p(w | x^{l-1} + A^l + m_k fc2_k) - log p(w | x^{l-1} + A^l), read
#    through the final norm and the unembedding, under w's gender (a) and the other
#    gender (b); change = imp_a - imp_b. As in the authors' code, every vector is read
#    through the final norm with one fixed scale per prompt, the RMS of that prompt's
#    final hidden state (`norm_reading = "final"`, `arithlib.yu.cna_norm`; `"own"`
#    normalises each vector by its own RMS, a variant). **The exact importance of every neuron** where
#    affordable (`exact_importance="auto"`: on a GPU, or when n_layers x d_mlp x d_model
#    x vocab <= 5e12 multiply-adds, e.g. SmolLM2 on a CPU; the two prompts are shared by
#    all professions, so each (prompt, neuron) log-partition is computed once). Otherwise
#    the two-stage screen (exact only for each profession's top-20 by a first-order
#    score and the pooled top-200) plus the exact importance of every neuron of every
#    4th layer (0, 4, 8, ...), where the screen's recall is measured. Either way
#    `07_screen_recall.csv` scores the screen against the exact ranking. Table 12: the
#    top neurons per profession with importance, coefficient under each gender and top
#    projected tokens (softmax(E_u fc2_k)).
# 3. *Edit (Table 13).* The edit set is the top-K neurons by the mean change over the
#    biased professions, gender-balanced (the mean of the two genders' means, so a
#    neuron that shifts *every* profession towards one gender does not rank because
#    one list is longer; the paper does not say how it pools professions). Zeroing is
#    at every position (= setting the neurons' parameters to zero). Bias = mean over
#    prompts and biased professions of |log p(w | woman) - log p(w | man)|, overall
#    and per bias gender, on all 8 prompts: on the model's own biased professions and on
#    the paper's Table 23 professions (scored, like the lexicon, by the first token of
#    " " + profession when it is the first word or a >= 5-letter prefix of it; the others
#    are listed with the reason, never dropped silently). K = 18 as in the paper and a
#    sweep; control: as many random neurons in the same layers, `n_random_seeds` (10)
#    seeds. 95 % intervals: a bootstrap over professions (each with its 8 prompts,
#    stratified by bias gender) crossed with the random seeds.
#    *Early layers (decided before the edit was measured, not tuned):* layer 0, whose
#    residual x^{-1} + A^0 is the token embedding plus one attention layer. A small
#    residual makes any neuron's write turn the normalised direction, so importance read
#    from it through the final norm may be an artefact of scale. Per layer: the RMS of
#    that residual, a neuron's write relative to it, the CNA change and the edit set's
#    layers (`07_edit_layers.csv`, `07_layer_diagnostic.csv`). The edit is measured with
#    and without the early layers: the top-18 from layers >= 1 (refilled) and the top-18
#    less its early neurons; both are reported, neither replaces the main edit.
# 4. *Side effects:* LM loss on fixed English prose (`pydoc_data.topics`,
#    `arithlib.methods.general_ability`), exact-answer accuracy on Yu's 1-digit prompts with
#    the few-shot prefix, and the profession tokens' probability on the gender-free
#    prompts ("A person works as a", ...).
# 5. *Held-out:* the 7 prompts not used by CNA, and professions not used to choose the
#    neurons (a seeded half of each gender's list picks a second edit set).
#
# **Where this differs from the paper.** The model (Qwen2.5-Coder-0.5B, Qwen2.5-Coder-1.5B or
# SmolLM2-135M, not Llama-7B), the lexicon and the rule that makes a predicted token a
# profession (the paper does not give one), the first-token scoring of multi-word
# professions, the pooling of professions, the random control with intervals, the
# early-layer check, side effects and held-out split (not in the paper). The paper's
# professions are Llama-7B's; we measure the bias on them too, but our edit is chosen on
# the model's own list, so the Table-23 row is partly a held-out test. Sec. 6.2 says "four prompts" and 32
# professions, App. D eight prompts and 32 professions from the top-100 lists; we follow
# App. D (CNA on prompt 1, bias on all 8).

# %% tags=["parameters"]
model = "qwen2.5-coder-0.5b"
device = "cpu"
dtype = "auto"  # "auto": bfloat16 on a GPU, float32 on a CPU; or "float32", "bfloat16"
device_map = None  # None: the whole model on `device`; "auto", "balanced" or {module: device} splits it across GPUs
quick = False
seed = 0
out_dir = "../outputs/scratch/figures"  # run_all.sh passes the committed figures/ (or its own scratch)
fewshot = 2  # solved examples in the prefix of the arithmetic side-effect prompts
top_k = 100  # App. D: top-100 next-token predictions per prompt and gender
cna_prompt = 0  # App. D: CNA on the first Table-22 prompt
edit_k = 18  # Sec. 6.2: 18 neurons zeroed
sweep = (6, 12, 18, 36)  # edit sizes
n_random_seeds = 10  # random-neuron controls per edit size
n_side_seeds = 2  # random controls whose side effects are measured (K = edit_k)
exact_importance = "auto"  # exact CNA importance of every neuron: True, False or "auto" (bias_cna.exact_affordable)
norm_reading = "final"  # how CNA reads a vector through the final norm: "final" (the authors') or "own" (variant)
n_candidates = 20  # the screen (without exact): exact importance for each profession's top neurons by stage 1 ...
n_aggregate = 200  # ... and for the top neurons of the pooled stage-1 change; its recall is measured when exact
recall_ks = (10, 18, 36)  # top-k sizes of the screen-recall table (without exact: within every 4th layer)
early_layers = 1  # layers < this are "early" (bias_cna.EARLY_LAYERS: layer 0), fixed before the run
table12_k = 3  # neurons per profession in the Table-12 CSV
arith_per_op = 8  # Yu 1-digit prompts per operator (template "n1 op n2 =", few-shot)
lm_chunks = 2  # LM loss: chunks of 128 tokens of the prose sample
heldout_frac = 0.5  # share of each gender's professions used to choose the held-out edit set
exclude_gendered = True  # leave grammatically gendered forms out of the biased set

# %%
import time

import pandas as pd
import torch
from IPython.display import Markdown, display

import arithlib.core.datasets as ds
import arithlib.plots.bias as plots
import arithlib.report as R
import arithlib.yu.bias as B
import arithlib.yu.bias_cna as BC
import arithlib.yu.bias_professions as BP
from arithlib.core import papers
from arithlib.core.prompt_sets import PromptSet
from arithlib.methods.general_ability import pydoc_prose
from arithlib.run.floor import Sections
from arithlib.run.outputs import save_figure, save_table
from arithlib.run.runs import start_run

if quick:
    sweep, n_random_seeds, n_side_seeds = (6, 18), 2, 1
    n_candidates, n_aggregate, arith_per_op, lm_chunks = 5, 50, 3, 1
    recall_ks = (5, 18)
sweep = tuple(sorted(set(sweep) | {edit_k}))
t_start = time.time()
run = start_run(
    "07_gender_bias_editing",
    model,
    device,
    seed,
    out_dir,
    quick,
    dtype=dtype,
    device_map=device_map,
    fewshot=fewshot,
    top_k=top_k,
    cna_prompt=cna_prompt,
    edit_k=edit_k,
    sweep=list(sweep),
    n_random_seeds=n_random_seeds,
    n_side_seeds=n_side_seeds,
    n_candidates=n_candidates,
    n_aggregate=n_aggregate,
    arith_per_op=arith_per_op,
    lm_chunks=lm_chunks,
    heldout_frac=heldout_frac,
    exclude_gendered=exclude_gendered,
    min_partial_letters=BP.MIN_PARTIAL_LETTERS,
    exact_importance=exact_importance,
    recall_ks=list(recall_ks),
    early_layers=early_layers,
    norm_reading=norm_reading,
)
bridge, tok, out = run.bridge, run.tokenizer, run.out
genders = list(BP.GENDERS)
d_mlp = run.model.info.d_mlp
torch.manual_seed(seed)
if exact_importance == "auto":  # quick mode: exact only where it takes seconds
    exact = BC.exact_affordable(bridge, BC.MAX_EXACT_MACS / (20 if quick else 1))
else:
    exact = bool(exact_importance)
timed = Sections.of_run(run)  # each section's time and arithmetic against the peak (arithlib.run.floor)

# %% [markdown]
# ## The lexicon on this tokenizer
# Which professions get a profession token, which share one, and which are dropped
# (first token too short a word piece, or the unknown token).

# %%
prof_tokens, dropped = BP.profession_tokens(tok)
save_table(prof_tokens, out, "07_profession_tokens")
save_table(dropped, out, "07_lexicon_dropped")
lexicon = BP.load_professions()["professions"]
print(f"{len(lexicon)} professions -> {len(prof_tokens)} profession tokens; {len(dropped)} dropped")
prof_tokens[prof_tokens.n_professions > 1]

# %% [markdown]
# ## 1 · Top-100 predictions and the professions that differ by gender (Table 23)

# %%
lp_orig = BP.gender_logprobs(bridge, tok)
top = BP.top_predictions(lp_orig, tok, prof_tokens, k=top_k)
save_table(top, out, "07_top_predictions")
biased_all = BP.biased_professions(top, exclude_gendered=False)
save_table(biased_all, out, "07_biased_professions_all")
biased = biased_all[biased_all.bias_gender.isin(genders)]
if exclude_gendered:
    biased = biased[~biased.gendered]
biased = biased.reset_index(drop=True)
save_table(biased, out, "07_biased_professions")
paper = BP.paper_profession_tokens(tok, prof_tokens)
paper_set, paper_profs = BP.paper_bias_set(tok)
save_table(paper_profs, out, "07_paper_professions")
comparison = BP.compare_with_paper(biased, paper) if len(paper) else pd.DataFrame()
save_table(comparison, out, "07_paper_comparison")
fig = plots.profession_counts(top, biased, f"{model}: profession tokens in the top-{top_k} per prompt")
save_figure(fig, out, "07_profession_counts")
has_bias = len(biased) > 0
if not has_bias:
    display(
        Markdown(
            f"**No profession token differs by gender in the top-{top_k} lists of `{model}`** "
            f"({int(top.is_profession.sum())} profession tokens in all lists). CNA, the edit and the "
            "held-out check need biased professions and are skipped; the side-effect section still "
            "measures the unedited model."
        )
    )
for g in genders:
    print(f"{g}: " + ", ".join(biased.loc[biased.bias_gender == g, "token"]))
print(
    f"Table 23: {int(paper_profs.used.sum())} of {len(paper_profs)} professions scored "
    f"({int(paper_profs.multi_token.sum())} of several tokens, by their first); not scored: "
    + (
        ", ".join(f"{r.profession} ({r.reason}: '{r.token}')" for r in paper_profs[~paper_profs.used].itertuples())
        or "none"
    )
)
comparison

# %% [markdown]
# ## 2 · CNA between "woman" and "man" on prompt 1 (Table 12)
# Each profession token w is one case: run a is the prompt with w's bias gender, run b
# with the other gender. The two prompts are run once and every case shares their
# activations (`bias_cna.shared_input_importance`). With `exact`: the exact importance of
# every neuron, and the screen's recall against it; the edit set's layers; and, per
# layer, the residual the importance is read from (the early-layer diagnostic).
#

# %%
if has_bias:
    timed.start()
    recall_layers = None if exact else list(range(0, run.model.info.n_layers, BC.RECALL_LAYER_STRIDE))
    result = BC.gender_cna(
        bridge,
        tok,
        biased,
        prompt_id=cna_prompt,
        n_candidates=None if exact else n_candidates,
        n_aggregate=n_aggregate,
        exact_layers=recall_layers or (),
        norm_reading=norm_reading,
    )
    timed.lap("cna")
    table12 = BC.neuron_table(bridge, tok, result, biased, k=table12_k)
    save_table(table12, out, "07_table12_per_profession")
    groups = list(biased.bias_gender)
    neurons_by_k = {k: BC.bias_neurons(result, k, groups=groups) for k in sweep}
    late_set = BC.bias_neurons(result, edit_k, groups=groups, min_layer=early_layers)
    drop_set = BC.without_early(neurons_by_k[edit_k], early_layers)
    edit_layers = BC.edit_layers({"cna": neurons_by_k[edit_k], "cna_late": late_set, "cna_drop": drop_set})
    save_table(edit_layers, out, "07_edit_layers")
    edit_table = BC.edit_set_table(bridge, tok, result, biased, neurons_by_k[max(sweep)])
    edit_table["in_edit_set"] = edit_table["rank"] <= edit_k
    save_table(edit_table, out, "07_edit_neurons")
    fig = plots.edit_set(edit_table[edit_table.in_edit_set], f"{model}: the top-{edit_k} CNA neurons (edit set)")
    save_figure(fig, out, "07_edit_neurons")
    timed.start()
    recall = BC.candidate_screen_recall(result, biased, recall_ks, n_candidates, n_aggregate, layers=recall_layers)
    save_table(recall, out, "07_screen_recall")
    diag = BC.layer_diagnostic(bridge, result, biased, neurons_by_k[edit_k])
    save_table(diag, out, "07_layer_diagnostic")
    timed.lap("recall_and_diagnostic")
    save_figure(
        plots.layer_diagnostic_plot(diag, genders, f"{model}: what the CNA importance of each layer is read from"),
        out,
        "07_layer_diagnostic",
    )
    display(edit_layers.pivot_table(index="layer", columns="edit_set", values="n_neurons", fill_value=0))
    if len(recall):
        per_case = recall[recall.case != "pooled (edit set)"].groupby("k").recall.agg(["mean", "min"])
        display(
            per_case.join(
                recall[recall.case == "pooled (edit set)"]
                .set_index("k")[["recall", "edit_set_overlap"]]
                .add_prefix("edit set ")
            )
        )
    display(table12.groupby("bias_gender").head(2 * table12_k))
else:
    print("skipped: no biased professions")


# %% [markdown]
# ## 3 · Zeroing the neurons: bias before and after (Table 13), with random controls
# Bias on all 8 prompts, on the model's own list and on the paper's Table 23; random sets
# have as many neurons in the same layers (`mask_keep.random_layer_matched`), `n_random_seeds`
# seeds per size. Besides the edit set: the top-`edit_k` from layers >= `early_layers`
# (`cna_late`) and the edit set less its early neurons (`cna_drop`), each with its own
# layer-matched random sets. Intervals: `bias.reduction_intervals` (bootstrap over
# professions crossed with seeds).
#

# %%
if has_bias:
    timed.start()
    random_by_k = {
        k: BC.random_neuron_sets(neurons_by_k[k], d_mlp, [seed + 1000 * k + s for s in range(n_random_seeds)])
        for k in sweep
    }
    conditions = B.edit_conditions(neurons_by_k, random_by_k)
    variants = {"cna_late": late_set, "cna_drop": drop_set}
    for j, (kind, ns) in enumerate(variants.items()):
        if ns and ns != neurons_by_k[edit_k]:  # identical sets are measured once, as "cna"
            rs = BC.random_neuron_sets(ns, d_mlp, [seed + 100_000 * (j + 1) + s for s in range(n_random_seeds)])
            conditions.update(B.edit_conditions({edit_k: ns}, {edit_k: rs}, kind=kind))
    by_set = B.bias_by_set(bridge, tok, {"model": biased, "paper": paper_set}, conditions)
    scores, paper_scores = by_set["model"], by_set["paper"]
    timed.lap("bias_conditions")
    save_table(scores, out, "07_bias_scores")
    save_table(paper_scores, out, "07_paper_bias_scores")
    summary = B.summarize_conditions(scores)
    save_table(summary, out, "07_bias_summary")
    t13 = B.table13(summary, edit_k)
    save_table(t13, out, "07_table13")
    t13_paper = B.table13(B.summarize_conditions(paper_scores), edit_k)
    save_table(t13_paper, out, "07_table13_paper_professions")
    kinds = ("cna", "cna_late", "cna_drop")
    effects = pd.concat(
        [
            B.reduction_intervals(scores, kinds).assign(professions="model's own"),
            B.reduction_intervals(paper_scores, kinds).assign(professions="Table 23"),
        ],
        ignore_index=True,
    )
    save_table(effects, out, "07_edit_effects")
    save_figure(
        plots.bias_before_after(t13, genders, f"{model}: gender bias before / after zeroing {edit_k} neurons"),
        out,
        "07_table13",
    )
    save_figure(plots.bias_sweep(summary, f"{model}: bias vs number of zeroed neurons"), out, "07_bias_sweep")
    save_figure(
        plots.edit_effects(
            effects[effects.K == edit_k],
            papers.YU_BIAS_REDUCTION_PCT,
            f"{model}: bias reduction with 95 % intervals (K = {edit_k})",
        ),
        out,
        "07_edit_effects",
    )
    edited = scores[(scores.kind == "cna") & (scores.K == edit_k)]
    save_figure(
        plots.profession_shift(
            scores[scores.kind == "original"], edited, f"{model}: bias per profession, original vs CNA top-{edit_k}"
        ),
        out,
        "07_profession_shift",
    )
    display(t13)
    display(effects[effects.K == edit_k])
else:
    print("skipped: no biased professions")


# %% [markdown]
# ## 4 · Side effects of the edit
# LM loss on fixed prose, arithmetic accuracy (Yu's 1-digit prompts, template
# "n1 op n2 =", with the few-shot prefix) and the profession tokens' probability on
# the gender-free prompts, for the original model, the CNA edits of size `edit_k` and
# max(`sweep`), and `n_side_seeds` random sets of size `edit_k`.

# %%
prose = pydoc_prose()
arith_records = ds.yu_prompts(n_digits=1, n_per_template=arith_per_op, templates=[3], fewshot=fewshot, seed=seed)
arith = PromptSet.build(arith_records, tok)
side_conditions = {("original", 0, -1): []}
if has_bias:
    for k in sorted({edit_k, max(sweep)}):
        side_conditions[("cna", k, -1)] = conditions[("cna", k, -1)]
    for s in list(random_by_k[edit_k])[:n_side_seeds]:
        side_conditions[("random", edit_k, s)] = conditions[("random", edit_k, s)]
side = B.side_effects(
    bridge,
    tok,
    side_conditions,
    prose=prose.text,
    arith=arith,
    profession_ids=prof_tokens.token_id.tolist(),
    max_chunks=lm_chunks,
)
side["prose_sha256"] = prose.sha256
save_table(side, out, "07_side_effects")
save_figure(plots.side_effects_plot(side, f"{model}: side effects of zeroing neurons"), out, "07_side_effects")
side

# %% [markdown]
# ## 5 · Held-out prompts and professions
# (a) The edit set above was chosen on prompt 1 only: its bias on prompt 1 vs the other
# 7 prompts. (b) A second edit set of `edit_k` neurons chosen on a seeded half of each
# gender's professions (prompt 1), evaluated on that half and on the other half, on
# prompt 1 and on prompts 2-8, against layer-matched random sets.

# %%
heldout_prompts = pd.DataFrame()
heldout_table = pd.DataFrame()
if has_bias:
    others = [p for p in range(8) if p != cna_prompt]
    parts = []
    for name, ids in ((f"prompt {cna_prompt + 1} (CNA)", [cna_prompt]), ("other 7 prompts", others)):
        s = B.summarize_conditions(scores, prompt_ids=ids)
        parts.append(s[s.K.isin([0, edit_k])].assign(prompts=name))
    heldout_prompts = pd.concat(parts, ignore_index=True)
    save_table(heldout_prompts, out, "07_heldout_prompts")
    sel, held = B.split_professions(biased, seed, heldout_frac)
    if sel and held:
        neurons_sel = BC.bias_neurons(result, edit_k, cases=sel, groups=groups)
        random_sel = BC.random_neuron_sets(neurons_sel, d_mlp, [seed + 7 + s for s in range(n_random_seeds)])
        conds_sel = {
            key: h
            for key, h in B.edit_conditions({edit_k: neurons_sel}, {edit_k: random_sel}).items()
            if key[0] != "original"
        }
        scores_sel = pd.concat(
            [scores[scores.kind == "original"], B.bias_under_conditions(bridge, tok, biased, conds_sel)],
            ignore_index=True,
        )
        save_table(scores_sel, out, "07_heldout_scores")
        ids_sel, ids_held = biased.token_id.iloc[sel].tolist(), biased.token_id.iloc[held].tolist()
        cells = []
        for pname, pids in ((f"P{cna_prompt + 1}", [cna_prompt]), ("P-others", others)):
            for fname, fids in (("selection profs", ids_sel), ("held-out profs", ids_held)):
                s = B.summarize_conditions(scores_sel, prompt_ids=pids, token_ids=fids)
                cells.append(s.assign(cell=f"{fname}\n{pname}", professions=fname, prompts=pname))
        heldout_table = pd.concat(cells, ignore_index=True)
        heldout_table["edit_set"] = ", ".join(f"{l}_{n}" for l, n in neurons_sel)
        save_table(heldout_table, out, "07_heldout")
save_figure(
    plots.heldout(heldout_table, f"{model}: edit chosen on half the professions and prompt {cna_prompt + 1}"),
    out,
    "07_heldout",
)
heldout_prompts

# %%
if len(heldout_table):
    display(heldout_table.groupby(["professions", "prompts", "kind"], sort=False)[["total", "reduction_pct"]].mean())

# %% [markdown]
# ## What this run found

# %%
save_table(timed.table(total_wall_s=time.time() - t_start), run.out, "07_timings")  # total: with loading
lines = [
    f"- Model `{model}` (seed {seed}{', quick mode' if quick else ''}). Lexicon: {len(lexicon)} professions -> "
    f"{len(prof_tokens)} profession tokens on this tokenizer ({len(dropped)} dropped)."
]
n_prof_top = int(top.is_profession.sum())
lines.append(
    f"- Top-{top_k} lists of the 8 prompts x 2 genders hold {n_prof_top} profession-token entries; "
    + ", ".join(f"prompt {p + 1}: {int(top[(top.prompt_id == p) & top.is_profession].shape[0])}" for p in range(8))
    + "."
)
if not has_bias:
    lines.append(
        f"- **No profession token differs by gender** in the top-{top_k} lists, so there is nothing to "
        "compare, edit or hold out; only the unedited model's side-effect measures were computed "
        f"(arithmetic accuracy {side.arith_accuracy.iloc[0]:.0%} on {len(arith)} prompts, LM loss "
        f"{side.lm_loss.iloc[0]:.2f} nats/token with {side.unk_share.iloc[0]:.0%} unknown tokens)."
    )
else:
    for g in genders:
        toks = biased.loc[biased.bias_gender == g, "token"].tolist()
        lines.append(f"- Biased towards **{g}** ({len(toks)}): {', '.join(toks)}.")
    gendered = biased_all[biased_all.gendered & biased_all.bias_gender.isin(genders)]
    if len(gendered):
        lines.append(f"- Gendered forms left out: {', '.join(gendered.token)}.")
    for r in comparison.itertuples():
        lines.append(
            f"- Paper's Table 23 {r.gender} list ({r.n_paper} professions): {r.same_gender} of its tokens are "
            f"in this model's {r.gender} list ({r.shared_tokens or 'none'}), {r.other_gender} in the other "
            "gender's."
        )
    top1 = edit_table.iloc[0]
    layers = pd.Series([l for l, _ in neurons_by_k[edit_k]]).value_counts().sort_index()
    lines.append(
        f"- CNA edit set (top {edit_k}) by layer: "
        + ", ".join(f"L{l}: {c}" for l, c in layers.items())
        + f". Strongest: {top1['name']} (mean change {top1.mean_change:.2f} nats; coefficient "
        f"{top1.coef_woman:.2f} under woman vs {top1.coef_man:.2f} under man; top tokens: "
        f"{', '.join(str(top1.top_tokens).split(', ')[:5])})."
    )
    cna_how = (
        "exact importance of every neuron"
        if exact
        else f"two-stage screen ({n_candidates} per profession + pooled {n_aggregate}), plus every neuron of layers "
        f"{', '.join(map(str, recall_layers))} for the recall"
    )
    lines.append(
        f"- CNA scoring: {cna_how}, {timed.wall('cna'):.0f} s; screen recall and layer diagnostic "
        f"{timed.wall('recall_and_diagnostic'):.0f} s; the {len(conditions)} bias conditions "
        f"({n_random_seeds} random seeds per edit) {timed.wall('bias_conditions'):.0f} s."
    )
    if len(recall):
        pooled = recall[recall.case == "pooled (edit set)"].set_index("k")
        per_case = recall[recall.case != "pooled (edit set)"].groupby("k").recall
        lines.append(
            "- **Screen recall** against the exact ranking"
            + ("" if exact else f" within layers {recall.layers.iloc[0]}")
            + f" (screen: {n_candidates} per profession + pooled "
            f"{n_aggregate} = {int(recall.n_screened.iloc[0])} of {int(recall.n_neurons.iloc[0])} neurons): "
            + "; ".join(
                f"top-{k}: mean {per_case.mean()[k]:.0%} (min {per_case.min()[k]:.0%}) per profession, "
                f"edit set {pooled.recall[k]:.0%} screened, {pooled.edit_set_overlap[k]:.0%} the same "
                "neurons"
                for k in pooled.index
            )
            + "."
        )
    n_early = int(edit_layers[(edit_layers.edit_set == "cna") & (edit_layers.layer < early_layers)].n_neurons.sum())
    lines.append(
        f"- **Edit set by layer** (top {edit_k}): "
        + ", ".join(f"L{r.layer}: {r.n_neurons}" for r in edit_layers[edit_layers.edit_set == "cna"].itertuples())
        + f"; {n_early} in the early layers (< {early_layers})."
    )
    rms = diag[[f"resid_rms_{g}" for g in genders]].mean(axis=1)
    early_rows, later_rows = diag.layer < early_layers, diag.layer >= early_layers
    lines.append(
        f"- **Early-layer diagnostic.** RMS of the residual the importance is read from: "
        f"{rms[early_rows].mean():.3g} in the early layers vs median {rms[later_rows].median():.3g} in the "
        f"others (x{rms[later_rows].median() / rms[early_rows].mean():.0f}); a neuron's write relative to it "
        f"(median): {diag.loc[early_rows, f'write_to_resid_{genders[0]}'].mean():.3g} vs "
        f"{diag.loc[later_rows, f'write_to_resid_{genders[0]}'].median():.3g}; mean |pooled change| "
        f"{diag.loc[early_rows, 'mean_abs_change'].mean():.3g} vs median "
        f"{diag.loc[later_rows, 'mean_abs_change'].median():.3g} nats."
    )
    o = t13.iloc[0]
    c = t13[t13.model.str.startswith("CNA")].iloc[0]
    pt = papers.YU_TABLE13
    lines.append(
        f"- **Table 13 (all 8 prompts, the model's {len(biased)} biased professions).** Original: total "
        f"{o.total:.2f}, woman {o.woman:.2f}, man {o.man:.2f} nats. CNA top-{edit_k} zeroed: total {c.total:.2f}, "
        f"woman {c.woman:.2f}, man {c.man:.2f}. Paper (Llama-7B): {pt['original']['total']} -> "
        f"{pt['edited']['total']} ({papers.YU_BIAS_REDUCTION_PCT} %)."
    )
    names = {
        "cna": f"CNA top-{edit_k}",
        "cna_late": f"top-{edit_k} from layers >= {early_layers}",
        "cna_drop": f"top-{edit_k} less its {n_early} early neurons",
    }
    for pro in ("model's own", "Table 23"):
        sub = effects[(effects.K == edit_k) & (effects.professions == pro)]
        if len(sub):
            lines.append(
                f"- **Reduction, {pro} professions** ({int(sub.n_professions.iloc[0])} tokens x 8 prompts; "
                f"95 % intervals): "
                + "; ".join(
                    f"{names[r.kind]}: {r.reduction_pct:.1f} % [{r.reduction_low:.1f}, {r.reduction_high:.1f}] vs "
                    f"random {r.random_pct:.1f} % [{r.random_low:.1f}, {r.random_high:.1f}], difference "
                    f"{r.diff_pts:.1f} [{r.diff_low:.1f}, {r.diff_high:.1f}] points"
                    for r in sub.itertuples()
                )
                + "."
            )
    tp = t13_paper.iloc[0]
    lines.append(
        f"- Table 23's professions: {int(paper_profs.used.sum())} of {len(paper_profs)} scored "
        f"({int(paper_profs[paper_profs.used].multi_token.sum())} of several tokens, by their first), "
        f"{len(paper_set)} tokens; bias of the original model {tp.total:.2f} nats (woman {tp.woman:.2f}, "
        f"man {tp.man:.2f}; paper 1.26 / 1.45 / 1.08)."
    )
    sw = summary[summary.kind == "cna"].sort_values("K")
    rw = summary[summary.kind == "random"].groupby("K").reduction_pct.mean()
    lines.append(
        "- Sweep (reduction %, CNA / random mean over seeds): "
        + "; ".join(f"K={int(r.K)}: {r.reduction_pct:.1f} / {rw.get(r.K, float('nan')):.1f}" for r in sw.itertuples())
        + "."
    )
    rr = t13[t13.model.str.startswith("random")].iloc[0]
    lines.append(
        f"- Signed bias towards the stereotype: {o.toward:.2f} -> {c.toward:.2f} nats (CNA), "
        f"{rr.toward:.2f} (random, mean of {n_random_seeds} seeds)."
    )
    hp = heldout_prompts[(heldout_prompts.kind == "cna") & (heldout_prompts.K == edit_k)]
    lines.append(
        "- Held-out prompts (edit chosen on prompt 1): "
        + "; ".join(f"{r.prompts}: {r.reduction_pct:.1f} % reduction" for r in hp.itertuples())
        + "."
    )
    if len(heldout_table):
        h = heldout_table.groupby(["professions", "prompts", "kind"], sort=False).reduction_pct.mean().unstack("kind")
        lines.append(
            "- Held-out professions (second edit set from half the professions), reduction % CNA / random: "
            + "; ".join(f"{f}, {p}: {r.cna:.1f} / {r.random:.1f}" for (f, p), r in h.iterrows())
            + "."
        )
o_side = side[side.kind == "original"].iloc[0]
for r in side[side.kind != "original"].itertuples():
    lines.append(
        f"- Side effects, {r.kind} K={r.K}{'' if r.kind == 'cna' else f' (seed {r.seed})'}: LM loss "
        f"{r.lm_loss:.3f} vs {o_side.lm_loss:.3f} nats/token ({r.lm_loss_change:+.3f}); arithmetic accuracy "
        f"{r.arith_accuracy:.0%} vs {o_side.arith_accuracy:.0%}; P(profession) on 'A person ...' x"
        f"{r.profession_mass_ratio:.2f}."
    )
lines += R.notebook_verdicts(out, "07")  # the report's rule, from the tables saved above
Markdown("\n".join(lines))
