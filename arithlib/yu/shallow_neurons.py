"""Hidden-interpretable shallow neurons of Yu & Ananiadou 2024 (Sec. 4.4, Tables 7-8): a
shallow FFN neuron's value vector projected through the OV circuit of every attention
layer that can read it, and an exact (vocabulary-pruned) count of the number and operation
concepts among the projection's top tokens; the lexicon of concepts is
``data/number_words.json``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import pandas as pd
import torch
from tqdm.auto import tqdm

from ..core import datasets as ds
from ..core.papers import YU_CNA_TABLES
from ..core.prompt_sets import PromptSet, require_single_token_operands
from ..core.readout import final_norm, top_tokens, unembedding
from ..core.stats import encode_correct
from ..engine import forward, input_device, wrapped
from ..methods.ablation import zero_neurons_hooks
from ..methods.answer_runs import run_conditions
from ..methods.neurons import value_vectors, w_out
from .mask_keep import N_RANDOM_SEEDS, control_seed


def layer_ov(model, layer: int, heads: Sequence[int] | None = None) -> torch.Tensor:
    """The OV map of attention layer ``layer`` as a [d, d] matrix acting on row vectors:
    x -> (g1 * x) sum_h W_V^h W_O^h (``heads`` None: all heads, the layer's value-output
    matrices as in Yu Sec. 4.4), with ln1's weight g1 folded in, grouped-query KV heads
    expanded, value biases left out (they do not depend on the source token)."""
    attn = model.blocks[layer].attn  # one layer's weights (the bridge's W_V / W_O stack every layer)
    W_V = attn.W_V.detach().float()  # [n_kv, d, d_head] (or [H, ...])
    W_O = attn.W_O.detach().float()  # [H, d_head, d]
    H = W_O.shape[0]
    group = H // W_V.shape[0]
    heads = range(H) if heads is None else heads
    ov = sum(W_V[h // group] @ W_O[h] for h in heads)
    ln1 = model.blocks[layer].ln1
    g = wrapped(ln1).weight.detach().float()
    return g[:, None] * ov


#: Number and operation concepts (Yu Sec. 4.4: a hidden-interpretable neuron's top-50
#: tokens hold >= M "concepts related to numbers or operations"). Restricted to numbers
#: and operations: a token counts when its text, stripped of spaces, is a digit string
#: (any length, as its number), an English number word 0-19, a tens word, "hundred" or
#: "thousand" (case-insensitive), or an operator symbol or operation word; each maps to
#: a concept and distinct concepts are counted. Foreign numerals, Roman numerals,
#: ordinals and multiples ("twice", "dozen") are NOT concepts here: counting them made
#: 12 % of SmolLM2's / Qwen's shallow neurons qualify at M = 2 against Yu's 1.1 %.
_WORDS = ds.load_json("number_words.json")
NUMBER_WORDS_EN: list[str] = list(_WORDS["units"])  # 0..19
TENS_EN: dict[int, str] = {10 * i: w for i, w in enumerate(_WORDS["tens"]) if w} | {
    100: _WORDS["hundred"],
    1000: _WORDS["thousand"],
}
OPERATION_WORDS: dict[str, list[str]] = {op: list(words) for op, words in _WORDS["operation_words"].items()}


def concept_of(text: str) -> str | None:
    """The number/operation concept a token's text stands for ("num:8", "op:add"), or
    None (the restricted list above: digits, English number words, operators)."""
    t = text.strip()
    if not t:
        return None
    if t.isascii() and t.isdigit():
        return f"num:{int(t)}"
    low = t.lower()
    if low in NUMBER_WORDS_EN:
        return f"num:{NUMBER_WORDS_EN.index(low)}"
    for value, word in TENS_EN.items():
        if low == word:
            return f"num:{value}"
    for op, words in OPERATION_WORDS.items():
        if low in words:
            return f"op:{op}"
    return None


def concept_tokens(tokenizer, vocab_size: int | None = None) -> dict[int, str]:
    """Token id -> concept for every vocabulary token whose text is a number/operation concept.

    ``vocab_size`` (the model's, default the tokenizer's) may exceed the tokenizer's
    length (embedding rows padded past its vocabulary): fast tokenizers decode those ids
    to "", sentencepiece ones raise an IndexError, and either way they are no concept.
    Any other failure, or an IndexError on an id the tokenizer has, propagates."""
    n = vocab_size or len(tokenizer)
    known = len(tokenizer)
    out = {}
    for i in range(n):
        try:
            text = tokenizer.decode([i])
        except IndexError:
            if i < known:
                raise
            continue
        c = concept_of(text)
        if c is not None:
            out[i] = c
    return out


#: Columns per group in :func:`merge_top_values`' screen. The groups are strided (column c
#: of a chunk w wide is in group c mod (w / 16)), so one element-wise maximum over 16 rows
#: of the chunk gives every group's maximum.
MERGE_GROUP = 16


def merge_top_values(
    top: torch.Tensor, z: torch.Tensor, group: int | None = MERGE_GROUP
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge each row's running top-k values ``top`` [n, k] (descending) with new values
    ``z`` [n, w]: returns the rows whose top-k changed and their new top-k values,
    ``(rows [c], merged [c, k])``, equal to ``torch.cat([top, z], 1).topk(k).values`` on
    those rows (the other rows keep ``top``).

    Why not that one call: ``topk`` over a chunk cost twice the product that made it
    (5 ns a value at 8,192 columns, 15-25 below 3,200, where torch switches algorithm), and
    a row's k largest values change only where the chunk holds a value above its k-th.
    With ``L`` a lower bound on a row's merged k-th value, its k largest values are those
    of ``top`` and the chunk's values >= L, usually a few dozen. ``L`` is the k-th value of
    ``top``, or, where that lets through more than an eighth of the chunk's groups (the
    first chunk), the k-th largest group maximum (k values of the chunk are at least it).
    The values >= L are found through the group maxima, then merged with one ``topk`` a
    few dozen wide. A chunk whose width ``group`` does not divide, or with fewer than k
    groups, is merged whole, as every chunk is with ``group=None`` (the literal method,
    which ``benchmarks/top_merge.py`` times against this)."""
    n, k = top.shape
    w = z.shape[1]
    kth = top[:, -1]
    n_groups = 0 if group is None else w // group
    if n_groups < k or w % group:
        rows = (z.amax(1) > kth).nonzero().squeeze(1)
        return rows, torch.cat([top[rows], z[rows]], 1).topk(k, dim=1).values
    z3 = z.view(n, group, n_groups)  # z3[r, i, g] = z[r, i * n_groups + g]: the members of group g
    gmax = z3.amax(1)  # [n, n_groups]
    count = (gmax > kth[:, None]).sum(1)
    rows = count.nonzero().squeeze(1)  # rows whose k largest values change
    if rows.numel() == 0:
        return rows, top[:0]
    bound = kth[rows]
    dense = count[rows] > n_groups // 8
    if bool(dense.any()):
        bound[dense] = torch.maximum(bound[dense], gmax[rows[dense]].topk(k, dim=1).values[:, -1])
    # every value >= its row's bound, found in the groups whose maximum reaches it
    r_pos, g_idx = (gmax[rows] >= bound[:, None]).nonzero(as_tuple=True)
    vals = z3[rows[r_pos], :, g_idx]  # [groups, group]
    keep = vals >= bound[r_pos, None]
    v = vals[keep]
    row_of = r_pos.repeat_interleave(keep.sum(1))  # each kept value's row, rows in order
    per_row = torch.bincount(row_of, minlength=rows.numel())
    slot = torch.arange(v.numel(), device=z.device) - (per_row.cumsum(0) - per_row)[row_of]
    padded = torch.full((rows.numel(), int(per_row.max())), -torch.inf, dtype=z.dtype, device=z.device)
    padded[row_of, slot] = v
    return rows, torch.cat([top[rows], padded], 1).topk(k, dim=1).values


@torch.no_grad()
def concept_counts(
    vectors: torch.Tensor,
    W: torch.Tensor,
    concepts: Mapping[int, str],
    k: int = 50,
    min_count: int | torch.Tensor = 1,
    vocab_chunk: int = 8192,
    row_chunk: int = 4096,
    n_sample: int = 256,
    seed: int = 0,
    progress: bool = False,
    merge_group: int | None = MERGE_GROUP,
) -> torch.Tensor:
    """Number of distinct concepts among the top-``k`` tokens of ``vectors @ W`` ([n, d] @
    [d, V]), exact for every row whose count is >= ``min_count`` (an int, or one value per
    row); rows below it get 0.

    Pruned exact search: the concept tokens' logits are computed first; the vocabulary
    is then scanned in chunks keeping each row's running top-k, whose k-th value only
    rises; a row whose concepts all fall below it can no longer reach ``min_count`` and
    is dropped. Rows that survive have seen the whole vocabulary. The scan order (any
    order gives the same result) puts first the tokens most often in the top-k of
    ``n_sample`` random rows, so that the k-th value rises early. Each chunk's values are
    merged into the running top-k by :func:`merge_top_values` (``merge_group``: the width
    of its screen's groups; None merges every chunk whole)."""
    device = W.device
    ids = torch.tensor(sorted(concepts), dtype=torch.long, device=device)
    names = sorted(set(concepts.values()))
    onehot = torch.zeros(len(ids), len(names), device=device)
    for j, i in enumerate(ids.tolist()):
        onehot[j, names.index(concepts[i])] = 1.0
    V = W.shape[1]
    gen = torch.Generator().manual_seed(seed)
    freq = torch.zeros(V)
    if n_sample > 0 and vectors.shape[0] > 0:
        pick = torch.randperm(vectors.shape[0], generator=gen)[:n_sample]
        sample = vectors[pick].float().to(device)
        running = torch.full((len(pick), k), -torch.inf, device=device)
        running_i = torch.zeros((len(pick), k), dtype=torch.long, device=device)
        for v0 in range(0, V, vocab_chunk):
            z = sample @ W[:, v0 : v0 + vocab_chunk]
            vals, idx = torch.cat([running, z], 1).topk(k, dim=1)
            running_i = torch.cat(
                [running_i, torch.arange(v0, v0 + z.shape[1], device=device).expand(len(pick), -1)], 1
            ).gather(1, idx)
            running = vals
        freq = torch.bincount(running_i.flatten().cpu(), minlength=V).float()
    order = torch.argsort(-(freq + 0.5 * torch.rand(V, generator=gen))).to(device)
    # the scan's vocabulary chunks and the concept columns, gathered once for all row chunks
    # (columns gathered as rows of W's transpose: a strided column gather took longer than
    # the products it feeds; the chunks are the same values)
    W_T = W.T.contiguous()
    W_chunks = [W_T[order[v0 : v0 + vocab_chunk]].T.contiguous() for v0 in range(0, V, vocab_chunk)]
    W_concepts = W[:, ids]
    out = torch.zeros(vectors.shape[0], dtype=torch.long)
    need_all = (
        torch.as_tensor(min_count, dtype=torch.long).expand(vectors.shape[0]).to(device)
        if not isinstance(min_count, int)
        else torch.full((vectors.shape[0],), min_count, device=device)
    )
    if len(need_all) != vectors.shape[0]:
        raise ValueError(f"min_count has {len(need_all)} values for {vectors.shape[0]} rows")

    def distinct(mask):
        return ((mask.float() @ onehot) > 0).sum(-1)

    # one buffer for the chunk's values, reused by every chunk of every row chunk (no fresh
    # pages per product: Qwen-0.5B's 4,096-row products ran at about 30 GFLOP/s into a fresh
    # 135 MB buffer, 40 into a reused one)
    buf = torch.empty(min(row_chunk, max(vectors.shape[0], 1)) * vocab_chunk, device=device)

    for r0 in tqdm(range(0, vectors.shape[0], row_chunk), desc="concept counts", disable=not progress, leave=False):
        Y = vectors[r0 : r0 + row_chunk].float().to(device)
        need = need_all[r0 : r0 + row_chunk]
        zS = Y @ W_concepts
        active = torch.arange(Y.shape[0], device=device)
        active = active[need <= len(names)]  # a row needing more concepts than exist cannot qualify
        topv = torch.full((Y.shape[0], k), -torch.inf, device=device)
        for Wc in W_chunks:
            if active.numel() == 0:
                break
            z = buf[: active.numel() * Wc.shape[1]].view(active.numel(), Wc.shape[1])
            torch.mm(torch.index_select(Y, 0, active), Wc, out=z)
            changed, merged = merge_top_values(torch.index_select(topv, 0, active), z, merge_group)
            if changed.numel() == 0:
                continue  # no row's top-k changed, nor its bound
            rows = active[changed]
            topv[rows] = merged
            ub = distinct(zS[rows] >= merged[:, -1:])
            keep = torch.ones(active.numel(), dtype=torch.bool, device=device)
            keep[changed] = ub >= need[rows]
            active = active[keep]
        if active.numel():
            out[r0 + active.cpu()] = distinct(zS[active] >= topv[active, -1:]).cpu()
    return out


def layer_ov_factors(model, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(A [d, r], B [r, d])`` with ``A @ B`` = :func:`layer_ov` (all heads): A stacks
    the ln1-weighted value matrices of the KV heads, B the sum of the output matrices
    of the query heads that share each KV head, so r = n_kv_heads x d_head, the OV
    map's rank (128 of 896 for Qwen2.5-0.5B). Projections through the factors cost r/d
    of the full map's. When r >= d: ``(layer_ov, identity)``."""
    attn = model.blocks[layer].attn
    W_V = attn.W_V.detach().float()  # [n_kv, d, d_head]
    W_O = attn.W_O.detach().float()  # [H, d_head, d]
    n_kv, d = W_V.shape[0], W_V.shape[1]
    group = W_O.shape[0] // n_kv
    if n_kv * W_V.shape[2] >= d:
        ov = layer_ov(model, layer)
        return ov, torch.eye(d, device=ov.device)
    ln1 = model.blocks[layer].ln1
    g = wrapped(ln1).weight.detach().float()
    A = torch.cat([g[:, None] * W_V[kv] for kv in range(n_kv)], 1)
    B = torch.cat([W_O[kv * group : (kv + 1) * group].sum(0) for kv in range(n_kv)], 0)
    return A, B


@torch.no_grad()
def shallow_concept_counts(
    model,
    tokenizer,
    head_layer: int,
    k: int = 50,
    concepts: Mapping[int, str] | None = None,
    cap: int | None = None,
    seed: int = 0,
    progress: bool = True,
) -> pd.DataFrame:
    """Table 8 / 17 candidates (Yu Sec. 4.4): every FFN neuron of layers 0..head_layer-1,
    its value vector carried through the OV map (value-output matrices of all heads,
    ln1 weight folded in, :func:`layer_ov`) of every attention layer j that can read it,
    l < j <= head_layer (attention j runs before MLP j in a block, so attention l cannot
    read MLP l; Yu: neurons of layers 0-15, attention layers "0-16", key head in 17),
    each projection put on the vocabulary through the final norm's weight and W_U
    (:func:`vocab_logits`), and the number of distinct number/operation concepts
    (:func:`concept_of`) among its top-``k`` tokens counted. A neuron's ``n_concepts``
    is the largest count over those layers (it qualifies at M when ANY projection
    holds >= M concepts); ``ov_layer`` the first layer reaching it (-1: no concept).

    Fast: the OV maps through their rank-r factors (:func:`layer_ov_factors`), every
    neuron of a source layer in one matrix product per attention layer, the top-k over
    the vocabulary in chunks with pruning (:func:`concept_counts`: a neuron is scanned
    through layer j only while it can still beat its best count so far). ``cap``: a
    neuron that reached ``cap`` concepts is not scanned again (its n_concepts is then
    >= cap, exact below it). Rows: layer, neuron, n_concepts, ov_layer."""
    if head_layer < 1:
        raise ValueError("the key head is in layer 0: there are no shallower FFN layers")
    if head_layer >= int(model.cfg.n_layers):
        raise ValueError(f"head_layer {head_layer} is not a layer of this {int(model.cfg.n_layers)}-layer model")
    concepts = concept_tokens(tokenizer, model.cfg.d_vocab) if concepts is None else concepts
    norm = final_norm(model)
    W_U, _ = unembedding(model)
    values = [w_out(model, layer).to(W_U.device) for layer in range(head_layer)]
    factors = [layer_ov_factors(model, j) for j in range(1, head_layer + 1)]
    best, best_j = ov_concept_counts(
        values, factors, norm.weight, W_U, concepts, k=k, cap=cap, seed=seed, progress=progress
    )
    K = model.cfg.d_mlp
    idx = torch.arange(len(best))
    return pd.DataFrame(
        {
            "layer": (idx // K).numpy(),
            "neuron": (idx % K).numpy(),
            "n_concepts": best.numpy(),
            "ov_layer": best_j.numpy(),
        }
    )


@torch.no_grad()
def ov_concept_counts(
    values: Sequence[torch.Tensor],
    factors: Sequence[tuple[torch.Tensor, torch.Tensor]],
    norm_weight: torch.Tensor,
    W_U: torch.Tensor,
    concepts: Mapping[int, str],
    k: int = 50,
    cap: int | None = None,
    seed: int = 0,
    progress: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The computation of :func:`shallow_concept_counts` on tensors: ``values[l]`` [K, d]
    are the value vectors of MLP layer l (l = 0..H-1), ``factors[j - 1] = (A_j, B_j)``
    the OV map of attention layer j (j = 1..H) as A_j @ B_j. For each neuron of layer l
    the largest count, over j = l+1..H, of distinct concepts among the top-``k`` tokens
    of ((v A_j B_j) * ``norm_weight``) @ ``W_U``, and the first j reaching it (-1 when
    0). Returns (counts [H*K], layers [H*K]), rows layer-major."""
    H = len(values)
    if len(factors) != H:
        raise ValueError(f"{len(factors)} OV maps for {H} source layers: need attention layers 1..{H}")
    n_names = len(set(concepts.values()))
    stacked = torch.cat(list(values))
    sizes = [v.shape[0] for v in values]
    best = torch.zeros(stacked.shape[0], dtype=torch.long)
    best_j = torch.full((stacked.shape[0],), -1, dtype=torch.long)
    for j in tqdm(range(1, H + 1), desc="shallow OV projections", disable=not progress, leave=False):
        rows = sum(sizes[:j])  # neurons of MLP layers 0..j-1, which attention layer j reads
        A, B = factors[j - 1]
        W = (B.to(W_U.device) * norm_weight) @ W_U
        need = best[:rows] + 1
        if cap is not None:
            need = torch.where(best[:rows] >= cap, torch.full_like(need, n_names + 1), need)
        c = concept_counts(stacked[:rows] @ A.to(stacked.device), W, concepts, k=k, min_count=need, seed=seed)
        better = c > best[:rows]
        best[:rows] = torch.where(better, c, best[:rows])
        best_j[:rows] = torch.where(better, torch.full_like(c, j), best_j[:rows])
    return best, best_j


def hidden_interpretable_table(
    model,
    prompts: PromptSet,
    counts: pd.DataFrame,
    ms: Sequence[int] = (0, 1, 2, 3),
    *,
    seed: int = 0,
    n_seeds: int = N_RANDOM_SEEDS,
    control_ms: Sequence[int] | None = None,
    batch_size: int = 32,
    targets: torch.Tensor | None = None,
    progress: bool = True,
) -> pd.DataFrame:
    """Table 8 / 17 on every case of ``prompts``: for each M, zero (at every position) all
    shallow neurons whose projection holds >= M concepts (``counts``:
    :func:`shallow_concept_counts`), and, ``n_seeds`` times, as many neurons drawn at
    random from the same shallow layers (``n_seeds`` draws at the M of ``control_ms``,
    default every M; one draw, as Yu's Table 8, at the others: each draw is a forward
    pass of every prompt); accuracy decrease (%) on ``prompts``.

    One row per (M, set, seed; seed NaN for the hidden-interpretable set): n_neurons,
    share_of_shallow, n_shallow, n_more_than_m (neurons with > M concepts: Table 8's
    M = 0 row, 51,980 of 176,128, cannot be ">= 0", so the paper may count "> M"),
    paper_n and paper_share (Table 8's neuron count at M and its share of 176,128),
    accuracy, accuracy_decrease, base_accuracy, n_cases and per-case correctness
    (``correct_by_prompt``). A neuron set equal to one already run (at M = 0 every set
    is every shallow neuron) is run once; the runs share passes (:func:`run_conditions`)."""
    if n_seeds < 1:
        raise ValueError(f"n_seeds must be >= 1 (random controls), got {n_seeds}")
    pool = list(zip(counts.layer.tolist(), counts.neuron.tolist()))
    plan = []  # (M, kind, seed, neuron set)
    for m in ms:
        chosen = counts[counts.n_concepts >= m]
        neurons = list(zip(chosen.layer.tolist(), chosen.neuron.tolist()))
        plan.append((m, "hidden-interpretable", None, neurons))
        for s in range(n_seeds if control_ms is None or m in control_ms else 1):
            rng = np.random.default_rng(control_seed(seed, s, m, 4))
            pick = rng.choice(len(pool), size=len(neurons), replace=False) if neurons else []
            plan.append((m, "random", s, [pool[i] for i in pick]))
    distinct = list(dict.fromkeys(frozenset(ns) for *_, ns in plan if ns))
    runs = run_conditions(
        model,
        prompts,
        {"base": None, **{str(j): zero_neurons_hooks(sorted(key)) for j, key in enumerate(distinct)}},
        capture=(),
        targets=targets,
        batch_size=batch_size,
        progress=progress,
        desc="M sweep",
    )
    base = runs["base"].accuracy
    run_of = {frozenset(): runs["base"], **{key: runs[str(j)] for j, key in enumerate(distinct)}}
    paper_n, total = YU_CNA_TABLES["M_neurons"], YU_CNA_TABLES["shallow_total"]
    rows = []
    for m, kind, s, ns in plan:
        run = run_of[frozenset(ns)]
        acc = run.accuracy
        rows.append(
            {
                "M": m,
                "set": kind,
                "seed": float("nan") if s is None else s,
                "n_neurons": len(ns),
                "share_of_shallow": len(ns) / max(1, len(pool)),
                "n_shallow": len(pool),
                "n_more_than_m": int((counts.n_concepts > m).sum()),
                "paper_n": paper_n.get(m, float("nan")),
                "paper_share": paper_n[m] / total if m in paper_n else float("nan"),
                "accuracy": acc,
                "accuracy_decrease": 100 * (base - acc) / base if base > 0 else float("nan"),
                "base_accuracy": base,
                "n_cases": len(prompts),
                "correct_by_prompt": encode_correct(run.correct.cpu().numpy()),
            }
        )
    return pd.DataFrame(rows)


@torch.no_grad()
def operand_positions(prompts: PromptSet, i: int) -> dict[str, int]:
    """Positions of operand A and B of 1-token-operand case ``i`` in its query (the last
    occurrences, B after A), found from the decoded tokens. An operand that is not one
    token (a 2-digit operand under a per-digit tokenizer such as Qwen's:
    :func:`arithlib.core.prompt_sets.require_single_token_operands`) or not a token of its
    own in the prompt (number words) raises a ValueError naming the prompt."""
    rec = prompts.records[i]
    texts = [prompts.tokenizer.decode([t]).strip() for t in prompts.input_ids[i]]

    def last(name: str, value: int, end: int) -> int:
        hits = [j for j, t in enumerate(texts[:end]) if t == str(value)]
        if not hits:
            require_single_token_operands(prompts.subset([i]))
            raise ValueError(
                f"operand {name} = {value} of case {i} ({rec.text!r}) is not a token of its own in the "
                f"prompt{' before operand B' if end < len(texts) else ''} (tokens {texts[-12:]} at the "
                "end): operand_positions needs operands written in digits, one token each; use "
                "1-digit prompts (e.g. yu_prompts(n_digits=1, numerals='digits'))"
            )
        return hits[-1]

    pos_b = last("B", rec.b, len(texts))
    return {"A": last("A", rec.a, pos_b), "B": pos_b}


@torch.no_grad()
def shallow_neuron_examples(
    model, prompts: PromptSet, case: int, key: torch.Tensor, head_layer: int, n: int = 5, n_tokens: int = 10
) -> pd.DataFrame:
    """Table 7: the shallow neurons (layers < ``head_layer``) on the operand positions of
    case ``case`` whose sub-value, carried by attention layer ``head_layer``'s OV map,
    has the largest inner product with ``key`` (the PE-DAG root's effective key):
    score = m_k(pos) (OV fc2_k) . key / rms(x_pos). With each neuron's top tokens before
    (E_u fc2_k) and after (E_u OV fc2_k) the transformation, and the same for the
    operand tokens' word embeddings."""
    tok = prompts.tokenizer
    device = input_device(model)
    pos = operand_positions(prompts, case)
    store = {}

    def grab(name):
        def fn(act, hook):
            store[name] = act[0].detach().float()
            return act

        return fn

    tokens = torch.tensor([prompts.input_ids[case]], device=device)
    hooks = [(f"blocks.{l}.mlp.hook_post", grab(l)) for l in range(head_layer)]
    hooks.append((f"blocks.{head_layer}.hook_resid_pre", grab("resid")))
    with model.hooks(fwd_hooks=hooks):
        forward(model, tokens, keep=1)
    ov = layer_ov(model, head_layer)
    u = ov @ key.float().to(ov.device)  # score of a source vector x: (x OV) . key = x . u
    rows = []
    for name, p in pos.items():
        rms = store["resid"][p].pow(2).mean().sqrt()
        for layer in range(head_layer):
            s = store[layer][p] * (w_out(model, layer) @ u) / rms
            for j in s.topk(min(n, s.numel())).indices.tolist():
                rows.append(
                    {
                        "operand": name,
                        "position": p,
                        "layer": layer,
                        "neuron": j,
                        "name": f"{layer}_{j}",
                        "coef": float(store[layer][p, j]),
                        "score": float(s[j]),
                    }
                )
    frame = pd.DataFrame(rows).sort_values("score", ascending=False).head(n).reset_index(drop=True)
    vecs = value_vectors(model, list(zip(frame.layer, frame.neuron)))
    frame["tokens_before"] = [", ".join(t) for t in top_tokens(model, tok, vecs, n_tokens)]
    frame["tokens_after_attention"] = [", ".join(t) for t in top_tokens(model, tok, vecs @ ov, n_tokens)]
    emb_rows = []
    W_E = model.W_E.detach().float()
    for name, p in pos.items():
        tid = prompts.input_ids[case][p]
        e = W_E[tid][None]
        emb_rows.append(
            {
                "operand": name,
                "position": p,
                "layer": -1,
                "neuron": -1,
                "name": f"word {tok.decode([tid]).strip()!r}",
                "coef": float("nan"),
                "score": float(((e @ ov) @ key.float().to(ov.device)).item() / store["resid"][p].pow(2).mean().sqrt()),
                "tokens_before": ", ".join(top_tokens(model, tok, e, n_tokens)[0]),
                "tokens_after_attention": ", ".join(top_tokens(model, tok, e @ ov, n_tokens)[0]),
            }
        )
    return pd.concat([frame, pd.DataFrame(emb_rows)], ignore_index=True)
