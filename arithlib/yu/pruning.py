"""Pruning the deep FFN layers to the neurons CNA finds, Yu & Ananiadou 2024 (EMNLP),
Sec. 6.1, Table 11.

The paper's recipe: CNA between the original Llama-7B and its LoRA model of layer 9
on every 1D+, 1D-, 1D* and 1D/ case; the union of each case's top-500 neurons is kept
in the deep FFN layers 17-31 (about 5 % of their neurons), every other neuron of those
layers is pruned; LoRA is added on layer 9 of the pruned model and fine-tuned on the
2-digit training set. Table 11: original 62.9 %, LoRA9 89.3 %, LoRA9 on the pruned
model 82.3 %, LoRA9 on a randomly pruned model with as many neurons 17.1 %.

Pieces
------
* **Selection** (:func:`lora_cna_scores`, :func:`union_ranking`): the CNA change
  imp_LoRA - imp_orig (Sec. 4.1, ``arithlib.yu.cna``) of every deep neuron for every
  case; a neuron's *best rank* is its best position in any case's ranking, so the
  union of every case's top-K is exactly the set of neurons with best rank <= K, and
  ordering neurons by best rank (ties: mean rank over cases) gives one nested order
  whose prefixes are those unions. A share of neurons to keep (the paper's 5 %, or a
  sweep) is a prefix of that order; :func:`union_size_curve` gives the union size per
  K. In the two-stage mode of ``arithlib.yu.cna`` only each case's ``n_candidates``
  neurons have an exact score; the rest of that case's ranking follows the stage-1
  (first-order) change, after the exact ones.
* **Real pruning** (:func:`prune_ffn`): a new HF model whose pruned layers have
  smaller MLP matrices (rows of gate/up or fc_in, columns of down or fc_out; biases
  of the input projections sliced); every other tensor is shared with the original
  (no copy). Layers keep different intermediate sizes, which HF's Llama/Qwen2/GPT
  modules execute as they are (the config's ``intermediate_size`` is only read at
  construction). A TransformerBridge booted on such a model runs and its hooks fire
  (each ``hook_post`` has its layer's width), but its stacked weight views
  (``W_in``, ``W_out``) and ``cfg.d_mlp`` assume one width, so ``arithlib.yu.cna``'s
  weight-reading functions do not apply to it; the pruned model is therefore kept as a
  plain HF model and evaluated and fine-tuned through ``arithlib.methods.finetune``
  (``answer_accuracy``, ``train_lora``), the same functions that score the unpruned
  models.
* **Masking form** (:func:`mask_weights`): the same neurons removed by zeroing their
  output columns in the full-size model (for ``model_weights.use_weights``); equal in
  function to the pruned model (tested), equal in size and speed to the original.
* **Cost** (:func:`parameter_counts`, :func:`forward_seconds`): parameter counts
  (total, FFN, deep FFN) and the wall time of a forward pass.
"""

from __future__ import annotations

import copy
import hashlib
import itertools
import math
import statistics
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from tqdm.auto import tqdm

from ..core.datasets import PromptSet
from ..core.papers import YU_DEEP_NEURONS, YU_TABLE11, YU_TOP_K
from ..engine import LayerInputs, decoder_layers, forward, hf_module, input_device, shared_hf_model
from ..methods import finetune as FT
from ..methods import model_weights as MW
from ..methods.answer_runs import run_last_position
from . import cna as C
from . import lora as LO

Keep = Mapping[int, Sequence[int] | torch.Tensor]  # pruned layer -> indices of the neurons kept

#: Shares of the deep FFN neurons kept in the sweep.
DEFAULT_SHARES: tuple[float, ...] = (0.01, 0.02, 0.05, 0.1, 0.2)

#: Sizes of notebook 06 per scale (the data and LoRA settings are notebook 05's,
#: ``scales.FINETUNE_SCALES``). ``cases_per_op``: 1D cases per operator for CNA (None: all 336);
#: ``n_candidates``: exact CNA scores per case in two-stage mode; ``random_seeds``: random
#: prunings at the main share (LoRA-tuned); ``sweep_seeds``: random prunings per share
#: in the sweep; ``sweep_lora``: fine-tune LoRA at every share of the sweep (else the
#: sweep reports the pruned models before fine-tuning, and LoRA only at the main share);
#: ``lr_search``: choose the pruned models' lr from Yu's grid on the validation split
#: (else notebook 05's lr at the reference layer); ``timing_batch`` prompts of one
#: length per timed forward pass, ``timing_repeats`` passes (median). "paper": Yu's
#: setting (all 336 1D cases, lr grid, LoRA at every share), for a GPU. "cpu" (the
#: judged CPU scale, notebook 05's default there): 12 cases per operator, 3 random seeds
#: at 5 % (the report's interval resamples them), the sweep before fine-tuning only (one
#: random seed per share): about 20 evaluations on notebook 05's 385 test sentences and 4
#: LoRA trainings of 32 steps (512 sentences) from the reference layer's recorded stream
#: (the README gives the measured time per model). "quick": a smoke test of every section
#: (seconds on the toy model), never judged.
PRUNING_SCALES: dict[str, dict] = {
    "paper": dict(
        cases_per_op=None,
        n_candidates=1000,
        random_seeds=3,
        sweep_seeds=3,
        sweep_lora=True,
        lr_search=True,
        timing_batch=32,
        timing_repeats=10,
    ),
    "cpu": dict(
        cases_per_op=12,
        n_candidates=300,
        random_seeds=3,
        sweep_seeds=1,
        sweep_lora=False,
        lr_search=False,
        timing_batch=4,
        timing_repeats=5,
    ),
    "quick": dict(
        cases_per_op=8,
        n_candidates=50,
        random_seeds=2,
        sweep_seeds=1,
        sweep_lora=True,
        lr_search=False,
        timing_batch=8,
        timing_repeats=3,
    ),
}
PRUNING_SCALES["cpu-bands"] = PRUNING_SCALES["cpu"]  # 06 trains LoRA on the reference layer only either way


def pruning_scale(scale: str) -> dict:
    """Notebook 06's sizes for a resolved scale name (``scales.scale_settings(...)["scale"]``)."""
    if scale not in PRUNING_SCALES:
        raise ValueError(f"scale must be one of {sorted(PRUNING_SCALES)}, got {scale!r}")
    return dict(PRUNING_SCALES[scale], scale=scale)


def scaled_top_k(n_deep_neurons: int, k: int = YU_TOP_K, reference: int = YU_DEEP_NEURONS) -> int:
    """Yu's per-case top-``k`` scaled to a model with ``n_deep_neurons`` deep FFN neurons
    (the same share of the deep neurons per case: 500 / 165,120 = 0.30 %)."""
    return max(1, int(round(k * n_deep_neurons / reference)))


# --------------------------------------------------------------------------- MLP layouts


@dataclass(frozen=True)
class FFNLayout:
    """Where an architecture keeps an MLP's neurons: ``inputs`` are the projections whose
    output units are the neurons (gate/up, fc_in), ``output`` the one whose input
    units are (down, fc_out); paths relative to the block."""

    inputs: tuple[str, ...]
    output: str


FFN_LAYOUTS: dict[str, FFNLayout] = {
    **{
        arch: FFNLayout(("mlp.gate_proj", "mlp.up_proj"), "mlp.down_proj")
        for arch in ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "olmo", "olmo2", "granite")
    },
    "gptj": FFNLayout(("mlp.fc_in",), "mlp.fc_out"),
    "gpt_neox": FFNLayout(("mlp.dense_h_to_4h",), "mlp.dense_4h_to_h"),
    "gpt2": FFNLayout(("mlp.c_fc",), "mlp.c_proj"),
}


def ffn_layout(model) -> FFNLayout:
    """The :class:`FFNLayout` of an HF model (or a bridge's)."""
    arch = str(hf_module(model).config.model_type)
    if arch not in FFN_LAYOUTS:
        raise NotImplementedError(f"no FFN layout known for {arch!r} (known: {sorted(FFN_LAYOUTS)})")
    return FFN_LAYOUTS[arch]


def _neuron_dim(module: torch.nn.Module, role: str) -> int:
    """The weight dimension indexed by neurons: nn.Linear stores [out, in], GPT-2's
    Conv1D [in, out]."""
    conv1d = type(module).__name__ == "Conv1D"
    if role == "input":
        return 1 if conv1d else 0
    return 0 if conv1d else 1


def ffn_width(model, layer: int) -> int:
    """Number of FFN neurons of block ``layer`` (read from its weights)."""
    hf = shared_hf_model(model)
    lay = ffn_layout(hf)
    mod = MW.submodule(decoder_layers(hf)[layer], lay.output)
    return int(mod.weight.shape[_neuron_dim(mod, "output")])


def ffn_widths(model) -> list[int]:
    """FFN neurons per block."""
    hf = shared_hf_model(model)
    return [ffn_width(hf, l) for l in range(len(decoder_layers(hf)))]


def _as_index(idx, width: int) -> torch.Tensor:
    t = torch.as_tensor(list(idx) if not isinstance(idx, torch.Tensor) else idx, dtype=torch.long).flatten()
    t = torch.unique(t)  # sorted, no repeats
    if t.numel() and (t.min() < 0 or t.max() >= width):
        raise IndexError(f"neuron index out of range 0..{width - 1}")
    return t


def keep_digest(keep: Keep) -> str:
    """A short hash of a keep set (layer -> kept neuron indices)."""
    h = hashlib.sha256()
    for layer in sorted(keep):
        h.update(f"{int(layer)}:".encode())
        h.update(
            np.asarray(
                sorted(int(i) for i in torch.as_tensor(keep[layer]).flatten().tolist()), dtype=np.int64
            ).tobytes()
        )
    return h.hexdigest()[:16]


def _sliced(module: torch.nn.Module, idx: torch.Tensor, role: str) -> torch.nn.Module:
    """Projection ``module`` (nn.Linear, or GPT-2's Conv1D) keeping neurons ``idx``, as a
    new nn.Linear (a Conv1D becomes the equivalent nn.Linear, which, unlike Conv1D,
    also runs with no neurons at all)."""
    dim = _neuron_dim(module, role)
    w = module.weight.detach().index_select(dim, idx.to(module.weight.device))
    if type(module).__name__ == "Conv1D":
        w = w.T
    bias = getattr(module, "bias", None)
    if bias is not None and role == "input":
        bias = bias.detach().index_select(0, idx.to(bias.device))
    with warnings.catch_warnings():  # "initializing zero-element tensors is a no-op" (a layer with none kept)
        warnings.simplefilter("ignore", UserWarning)
        new = torch.nn.Linear(w.shape[1], w.shape[0], bias=bias is not None, device="meta")
    new.weight = torch.nn.Parameter(w.contiguous().clone(), requires_grad=False)
    if bias is not None:
        new.bias = torch.nn.Parameter(bias.detach().clone(), requires_grad=False)
    return new


def prune_ffn(model, keep: Keep, share_weights: bool = True) -> torch.nn.Module:
    """Yu Sec. 6.1's pruned model: a plain HF model in which every layer named in ``keep``
    has only the FFN neurons ``keep[layer]`` (possibly none); the neurons' weights are
    removed, not zeroed (smaller gate/up/down or fc_in/fc_out matrices). Layers not in
    ``keep`` are untouched.

    ``share_weights`` (default): every unchanged tensor is the original's (the module
    tree is copied, the parameters are not), so a pruned copy of a 0.5B model costs
    only its new MLP matrices; ``lora.train_lora`` leaves base weights untouched,
    and the shared tensors keep their ``requires_grad`` (the copy's own are frozen).
    ``False``: a fully independent copy. The config records the widths and a digest
    of the keep set (``config.arithlib_pruned_ffn``), so ``finetune``'s cache keys
    tell pruned models apart."""
    hf = shared_hf_model(model)
    lay = ffn_layout(hf)
    n_layers = len(decoder_layers(hf))
    bad = [l for l in keep if not 0 <= int(l) < n_layers]
    if bad:
        raise ValueError(f"layers {bad} out of range 0..{n_layers - 1}")
    memo = {}
    if share_weights:
        memo = {id(t): t for t in itertools.chain(hf.parameters(), hf.buffers())}
    pruned = copy.deepcopy(hf, memo)
    blocks = decoder_layers(pruned)
    widths = {}
    for layer, idx in keep.items():
        block = blocks[int(layer)]
        width = ffn_width(hf, int(layer))
        index = _as_index(idx, width)
        for path, role in [*[(p, "input") for p in lay.inputs], (lay.output, "output")]:
            parent_path, _, leaf = path.rpartition(".")
            parent = MW.submodule(block, parent_path) if parent_path else block
            setattr(parent, leaf, _sliced(getattr(parent, leaf), index, role))
        widths[int(layer)] = int(index.numel())
    pruned.config.arithlib_pruned_ffn = {
        "widths": {str(l): w for l, w in sorted(widths.items())},
        "keep_digest": keep_digest(keep),
    }
    for p in pruned.parameters():
        if id(p) not in memo:  # a shared tensor is the original's: its flag is the original model's to keep
            p.requires_grad_(False)
    pruned.eval()
    return pruned


def mask_weights(model, keep: Keep) -> dict[str, torch.Tensor]:
    """The masking form of :func:`prune_ffn`: for each layer in ``keep``, the output
    projection's weight (clean HF name) with the columns of every neuron NOT kept set
    to zero; pass to ``model_weights.use_weights``. The model keeps its size; each removed
    neuron still computes its coefficient but writes nothing."""
    hf = shared_hf_model(model)
    lay = ffn_layout(hf)
    out = {}
    for layer, idx in keep.items():
        prefix = MW.layer_prefix(hf, int(layer))
        mod = MW.submodule(decoder_layers(hf)[int(layer)], lay.output)
        dim = _neuron_dim(mod, "output")
        width = mod.weight.shape[dim]
        drop = torch.ones(width, dtype=torch.bool)
        drop[_as_index(idx, width)] = False
        w = mod.weight.detach().clone()
        shape = [1, 1]
        shape[dim] = width
        w.masked_fill_(drop.view(shape).to(w.device), 0.0)
        out[f"{prefix}{lay.output}.weight"] = w.cpu()
    return out


def keep_pairs(keep: Keep) -> list[tuple[int, int]]:
    """(layer, neuron) pairs of a keep set (for ``ablation.keep_neurons_hooks``)."""
    return [(int(l), int(i)) for l, idx in sorted(keep.items()) for i in torch.as_tensor(idx).flatten().tolist()]


# --------------------------------------------------------------------------- cost


def parameter_counts(model, layers: Sequence[int]) -> dict[str, int]:
    """``n_params`` (distinct entries, tied counted once), ``n_ffn_params`` (all MLP
    weights and biases) and ``n_deep_ffn_params`` (those of ``layers``), and
    ``n_deep_neurons`` (FFN width summed over ``layers``)."""
    hf = shared_hf_model(model)
    blocks = decoder_layers(hf)
    lay = ffn_layout(hf)

    def mlp_params(block) -> int:
        return sum(
            MW.submodule(block, p).weight.numel()
            + (MW.submodule(block, p).bias.numel() if getattr(MW.submodule(block, p), "bias", None) is not None else 0)
            for p in (*lay.inputs, lay.output)
        )

    return {
        "n_params": MW.count_parameters(hf),
        "n_ffn_params": sum(mlp_params(b) for b in blocks),
        "n_deep_ffn_params": sum(mlp_params(blocks[l]) for l in layers),
        "n_deep_neurons": sum(ffn_width(hf, l) for l in layers),
    }


def timing_tokens(prompts: PromptSet, n: int = 8) -> torch.Tensor:
    """A [B, T] block of prompt tokens for timing: up to ``n`` prompts of the most common
    length (no padding)."""
    groups = prompts.length_groups()
    if not groups:
        raise ValueError("no prompts to time")
    length = max(groups, key=lambda k: (len(groups[k]), k))
    idx = groups[length][:n]
    return torch.tensor([prompts.input_ids[i] for i in idx], dtype=torch.long)


@torch.no_grad()
def forward_seconds(model, tokens: torch.Tensor, repeats: int = 5, warmup: int = 1) -> dict[str, float]:
    """Wall time of one forward pass over ``tokens`` [B, T] (no KV cache, logits of the
    last position only, as in generation's prefill): median and minimum of ``repeats``
    passes after ``warmup`` untimed ones, in seconds. Comparisons use the minimum
    (``timeit``'s advice): other work on the machine (run_all.sh runs two notebooks at
    a time) can only slow a pass down."""
    hf = shared_hf_model(model)
    dev = input_device(hf)
    tokens = tokens.to(dev)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    for _ in range(warmup):
        forward(hf, tokens, keep=1)
    times = []
    for _ in range(max(1, repeats)):
        sync()
        t0 = time.perf_counter()
        forward(hf, tokens, keep=1)
        sync()
        times.append(time.perf_counter() - t0)
    return {
        "forward_s": statistics.median(times),
        "forward_min_s": min(times),
        "timing_repeats": len(times),
        "timing_tokens": int(tokens.numel()),
    }


# --------------------------------------------------------------------------- selection by CNA


def yu_1d_cases(
    tokenizer, ops: Sequence[str] = ("+", "-", "*", "/"), fewshot: int = 2, per_op: int | None = None, seed: int = 0
) -> PromptSet:
    """Yu Sec. 6.1's cases: every 1D case of each operator in the symbolic template
    "n1 + n2 =" (Table 14's last) with the few-shot prefix: + and * with operands 0..9,
    - with a >= b (1D results are non-negative, as in Sec. 4), / as "72/8=" (divisor
    and quotient 1..9, ``cna.yu_division_1d``). ``per_op``: a random subset of that
    many per operator (``seed``), for CPU runs."""
    from ..core import datasets as ds

    rng = np.random.default_rng(seed)
    records = []
    for op in ops:
        recs = (
            C.yu_division_1d(fewshot=fewshot)
            if op == "/"
            else ds.yu_prompts(ops=[op], n_digits=1, n_per_template=None, templates=[3], fewshot=fewshot, seed=seed)
        )
        if per_op is not None and len(recs) > per_op:
            recs = [recs[i] for i in sorted(rng.choice(len(recs), per_op, replace=False).tolist())]
        records.extend(recs)
    return PromptSet.build(records, tokenizer)


@dataclass
class CNAScores:
    """CNA between a LoRA model and the original on ``cases``, restricted to ``layers``:
    ``change`` [N, len(layers), d_mlp] is imp_LoRA - imp_orig where exact (NaN where
    two-stage mode did not score the neuron), ``approx_change`` the stage-1 change of
    every neuron; first-token accuracy of each model on the cases, and per case whether
    the target is each model's top prediction."""

    change: torch.Tensor
    approx_change: torch.Tensor
    layers: list[int]
    mode: str
    n_candidates: int | None
    accuracy_original: float
    accuracy_lora: float
    targets: torch.Tensor
    correct_original: torch.Tensor | None = None
    correct_lora: torch.Tensor | None = None


@torch.no_grad()
def lora_cna_scores(
    bridge,
    cases: PromptSet,
    lora_weights: Mapping[str, torch.Tensor],
    layers: Sequence[int],
    *,
    mode: str = "auto",
    n_candidates: int = 300,
    batch_size: int = 32,
    progress: bool = True,
    norm_reading: str = "final",
) -> CNAScores:
    """Yu Sec. 6.1: CNA (Sec. 4.1) between the LoRA model (``lora_weights`` swapped into
    ``bridge``) and the original on ``cases``, target = each case's correct first answer
    token, for every FFN neuron of ``layers``. LoRA in attention leaves the FFN values,
    final norm and unembedding unchanged, so one importance formula serves both
    models (checked: the weights may not touch MLPs, norms or the unembedding); with
    ``norm_reading`` "final" both are read with the original run's final norm scale."""
    names = LO._mlp_weight_names(bridge)
    touched = set(lora_weights) & set(names)
    if touched:
        raise ValueError(f"the LoRA weights change FFN/norm/unembedding weights ({sorted(touched)[:3]})")
    layers = sorted(int(l) for l in layers)
    targets = cases.first_answer_ids
    mode = C.resolve_mode(bridge, mode)
    run_o = run_last_position(
        bridge, cases, None, targets=targets, batch_size=batch_size, progress=progress, desc="original"
    )
    with MW.use_weights(bridge, lora_weights):
        run_l = run_last_position(
            bridge, cases, None, targets=targets, batch_size=batch_size, progress=progress, desc="LoRA"
        )
    out = C.importance_from_runs(
        bridge,
        [run_l, run_o],
        targets,
        mode=mode,
        n_candidates=n_candidates,
        select="change",
        layers=layers,
        progress=progress,
        norm_reading=norm_reading,
        scale_from=1,
    )  # "final": both read with the original's final scale
    imp, approx = out["importance"][:, :, layers], out["approx"][:, :, layers]
    return CNAScores(
        change=imp[0] - imp[1],
        approx_change=approx[0] - approx[1],
        layers=layers,
        mode=mode,
        n_candidates=None if mode == "exact" else n_candidates,
        accuracy_original=run_o.accuracy,
        accuracy_lora=run_l.accuracy,
        targets=targets,
        correct_original=run_o.correct,
        correct_lora=run_l.correct,
    )


def case_ranks(change: torch.Tensor, approx_change: torch.Tensor | None = None) -> torch.Tensor:
    """Each case's rank (0 = best) of every neuron, [N, M] from scores [N, M]: neurons
    with an exact ``change`` first, by it, then the others by ``approx_change``
    (two-stage mode), then any left (NaN) in index order. Ties keep index order."""
    finite = torch.isfinite(change)
    value = torch.where(
        finite, change, approx_change if approx_change is not None else torch.full_like(change, torch.nan)
    )
    value = torch.nan_to_num(value.float(), nan=-torch.inf)
    tier = torch.where(finite, 0, torch.where(torch.isfinite(value), 1, 2)).to(torch.int8)
    order = torch.argsort(-value, dim=1, stable=True)
    order = order.gather(1, torch.argsort(tier.gather(1, order), dim=1, stable=True))
    N, M = change.shape
    ranks = torch.empty_like(order)
    ranks.scatter_(1, order, torch.arange(M).expand(N, M).contiguous())
    return ranks


def union_ranking(scores: CNAScores) -> pd.DataFrame:
    """Every deep neuron in the order of Yu's union rule: by ``best_rank`` (1-based, its
    best position in any case's CNA ranking; the union of all cases' top-K is exactly
    the neurons with best_rank <= K), ties broken by the mean rank over cases. Columns:
    order (1-based), layer, neuron, best_rank, mean_rank, best_case, change (exact
    change in the best case, NaN if not scored), exact (scored exactly there)."""
    N, Ld, K = scores.change.shape
    change = scores.change.reshape(N, Ld * K)
    approx = scores.approx_change.reshape(N, Ld * K)
    ranks = case_ranks(change, approx)
    best, best_case = ranks.min(0)
    mean = ranks.float().mean(0)
    order = np.lexsort((mean.numpy(), best.numpy()))
    flat = torch.as_tensor(order)
    at_best = change[best_case[flat], flat]
    layers = torch.tensor(scores.layers)
    return pd.DataFrame(
        {
            "order": np.arange(1, len(order) + 1),
            "layer": layers[flat // K].numpy(),
            "neuron": (flat % K).numpy(),
            "best_rank": best[flat].numpy() + 1,
            "mean_rank": mean[flat].numpy() + 1,
            "best_case": best_case[flat].numpy(),
            "change": at_best.numpy(),
            "exact": torch.isfinite(at_best).numpy(),
        }
    )


def union_top_k(ranking: pd.DataFrame, k: int) -> pd.DataFrame:
    """The union of every case's top-``k`` (Yu's rule): the rows with best_rank <= k."""
    return ranking[ranking.best_rank <= k]


def union_size_curve(ranking: pd.DataFrame, ks: Sequence[int] | None = None) -> pd.DataFrame:
    """Size of the union of every case's top-K, and its share of the deep neurons, for
    each K (default: 1..max best rank on a log-spaced grid)."""
    best = np.sort(ranking.best_rank.to_numpy())
    if ks is None:
        ks = sorted(set(np.unique(np.round(np.logspace(0, math.log10(max(2, best.max())), 60)).astype(int)).tolist()))
    sizes = np.searchsorted(best, np.asarray(ks), side="right")
    return pd.DataFrame({"k": list(ks), "union_size": sizes, "share": sizes / len(ranking)})


def n_for_share(share: float, n_pool: int) -> int:
    """Neurons kept for ``share`` of a pool of ``n_pool`` (at least 1)."""
    if not 0 < share <= 1:
        raise ValueError("share must be in (0, 1]")
    return max(1, min(n_pool, int(round(share * n_pool))))


def keep_from_ranking(ranking: pd.DataFrame, n: int, layers: Sequence[int]) -> dict[int, torch.Tensor]:
    """The first ``n`` neurons of ``ranking`` as a keep set over ``layers`` (a layer with
    none kept maps to an empty index: it is pruned entirely)."""
    top = ranking.iloc[:n]
    return {int(l): torch.as_tensor(sorted(top.neuron[top.layer == l].tolist()), dtype=torch.long) for l in layers}


def k_of_prefix(ranking: pd.DataFrame, n: int) -> int:
    """The per-case top-K whose union the first ``n`` neurons of ``ranking`` complete
    (best rank of the n-th neuron): the first n neurons contain the union of top-(K-1)
    and part of the union of top-K."""
    return int(ranking.best_rank.iloc[n - 1])


def random_keep(
    layers: Sequence[int],
    widths: Mapping[int, int] | int,
    n: int,
    seed: int,
    layer_counts: Mapping[int, int] | None = None,
) -> dict[int, torch.Tensor]:
    """Yu's control (LoRA9-r): ``n`` neurons drawn uniformly at random from all neurons of
    ``layers`` (``widths``: per-layer width or one for all); with ``layer_counts`` the
    same number per layer as given instead (layer-matched)."""
    rng = np.random.default_rng(seed)
    width = {int(l): int(widths if isinstance(widths, int) else widths[l]) for l in layers}
    if layer_counts is not None:
        return {
            l: torch.as_tensor(
                np.sort(rng.choice(width[l], int(layer_counts.get(l, 0)), replace=False)), dtype=torch.long
            )
            for l in width
        }
    pool = np.array([(l, i) for l in width for i in range(width[l])], dtype=np.int64)
    pick = pool[rng.choice(len(pool), min(n, len(pool)), replace=False)]
    return {l: torch.as_tensor(np.sort(pick[pick[:, 0] == l, 1]), dtype=torch.long) for l in width}


def kept_by_layer(keeps: Mapping[str, Keep], widths: Mapping[int, int]) -> pd.DataFrame:
    """Neurons kept per layer for named keep sets: selection, layer, n_kept, width, share."""
    rows = []
    for name, keep in keeps.items():
        for l, idx in sorted(keep.items()):
            n = int(torch.as_tensor(idx).numel())
            rows.append(
                {
                    "selection": name,
                    "layer": int(l),
                    "n_kept": n,
                    "width": int(widths[l]),
                    "share": n / max(1, int(widths[l])),
                }
            )
    return pd.DataFrame(rows)


# --------------------------------------------------------------------------- prune, fine-tune, evaluate


def evaluate_row(
    model,
    weights: Mapping[str, torch.Tensor] | None,
    test_set: PromptSet,
    layers: Sequence[int],
    *,
    tokens: torch.Tensor | None = None,
    repeats: int = 3,
    batch_size: int = 32,
    inputs: Mapping[str, LayerInputs] | None = None,
    unchanged_below: int | None = None,
) -> dict:
    """One row of Table 11 for ``model`` (a bridge or an HF model, pruned or not) with
    ``weights`` swapped in (None: as it is): accuracy on ``test_set`` (whole answer,
    ``answer_loss.answer_accuracy``'s ``correct_full``; also first token, negative /
    non-negative results), parameter counts, and, with ``tokens``, the forward time.
    ``inputs`` / ``unchanged_below``: the original's recorded streams (``"test"``: on
    ``test_set``) and the first block in which ``model`` differs from it
    (``finetune.evaluate_weights``)."""
    hf = shared_hf_model(model)
    frame = FT.evaluate_weights(
        hf, weights, {"test": test_set}, batch_size, inputs=inputs, unchanged_below=unchanged_below
    )
    row = FT.accuracy_row(frame)
    row.update(parameter_counts(hf, layers))
    if tokens is not None:
        with MW.use_weights(hf, weights):
            row.update(forward_seconds(hf, tokens, repeats=repeats))
    return row


def lora_on(
    model,
    layer: int,
    train_set: PromptSet,
    config: FT.TrainConfig,
    *,
    val_set: PromptSet | None = None,
    lrs: Sequence[float] = (),
    lora: LO.LoraSpec = LO.LoraSpec(),
    cache_dir: str | Path | None = None,
    progress: bool = False,
    inputs: LayerInputs | None = None,
    unchanged_below: int | None = None,
) -> FT.FineTuned:
    """Yu Sec. 6.1's last step: LoRA on attention layer ``layer`` of ``model`` (a pruned
    HF model or the original), trained on ``train_set`` with ``config`` (its lr), or
    with the lr of ``lrs`` that scores best on ``val_set`` (Yu's grid) when more than
    one is given. ``lora.train_lora``; cached under ``cache_dir``; ``inputs`` and
    ``unchanged_below`` as there."""

    def fit(lr: float) -> FT.FineTuned:
        return LO.train_lora(
            model,
            layer,
            train_set,
            replace(config, lr=lr),
            val_set,
            lora,
            progress=progress,
            cache_dir=cache_dir,
            inputs=inputs,
            unchanged_below=unchanged_below,
        )

    search = len(lrs) > 1 and val_set is not None and len(val_set) > 0
    return FT.choose_lr(model, fit, list(lrs) if search else [config.lr], val_set, config.eval_batch_size)[0]


def prune_and_finetune(
    model,
    keep: Keep,
    layer: int,
    train_set: PromptSet,
    test_set: PromptSet,
    config: FT.TrainConfig,
    *,
    fine_tune: bool = True,
    val_set: PromptSet | None = None,
    lrs: Sequence[float] = (),
    lora: LO.LoraSpec = LO.LoraSpec(),
    cache_dir: str | Path | None = None,
    tokens: torch.Tensor | None = None,
    repeats: int = 3,
    batch_size: int = 32,
    progress: bool = False,
    return_model: bool = False,
    inputs: Mapping[str, LayerInputs] | None = None,
):
    """Prune ``model``'s FFN to ``keep`` (:func:`prune_ffn`), evaluate it before
    fine-tuning, add LoRA on ``layer`` and train it (``fine_tune``), evaluate again.
    ``inputs``: ``model``'s recorded streams on ``"train"`` and ``"test"`` (see
    :func:`table11`); the pruned model equals ``model`` below its first pruned layer.
    Returns one row: n_kept, accuracy_pruned (before LoRA), accuracy / accuracy_first /
    ... after LoRA (NaN without fine-tuning), parameter counts of the pruned model,
    n_lora (trainable LoRA entries), lr, train_seconds, forward time (with ``tokens``);
    with ``return_model`` also the pruned model and the FineTuned (None without
    fine-tuning): ``(row, pruned, fine_tuned)``."""
    layers = sorted(int(l) for l in keep)
    pruned = prune_ffn(model, keep)
    same = dict(inputs=inputs, unchanged_below=min(layers, default=None))  # evaluate_weights reads "test"
    before = FT.accuracy_row(FT.evaluate_weights(pruned, None, {"test": test_set}, batch_size, **same))
    row = {
        "n_kept": sum(int(torch.as_tensor(v).numel()) for v in keep.values()),
        "keep_digest": keep_digest(keep),
        "accuracy_pruned": before["accuracy"],
        "accuracy_first_pruned": before["accuracy_first"],
    }
    row.update(parameter_counts(pruned, layers))
    if tokens is not None:
        row.update(forward_seconds(pruned, tokens, repeats=repeats))
    ft = None
    if fine_tune:
        ft = lora_on(
            pruned,
            layer,
            train_set,
            config,
            val_set=val_set,
            lrs=lrs,
            lora=lora,
            cache_dir=cache_dir,
            progress=progress,
            inputs=(inputs or {}).get("train"),
            unchanged_below=same["unchanged_below"],
        )
        after = FT.accuracy_row(FT.evaluate_weights(pruned, ft.weights, {"test": test_set}, batch_size, **same))
        row.update(after)
        row.update(n_lora=ft.n_trainable, lr=ft.config.lr, train_seconds=ft.train_seconds)
    else:
        row.update(
            {
                k: float("nan")
                for k in (
                    "accuracy",
                    "accuracy_first",
                    "accuracy_negative",
                    "accuracy_nonnegative",
                    "mean_answer_logprob",
                )
            }
        )
        row.update(n_test=len(test_set), n_lora=0, lr=float("nan"), train_seconds=float("nan"))
    if return_model:
        return row, pruned, ft
    return row


def recorded_streams(lora_layer: int, layers: Sequence[int]) -> dict[str, LayerInputs]:
    """Empty :class:`~arithlib.engine.LayerInputs` for the training and test sets
    of :func:`table11` / :func:`share_sweep`: the stream entering the LoRA layer (both)
    and the first pruned layer (test: the pruned models before LoRA)."""
    return {"train": LayerInputs([lora_layer]), "test": LayerInputs([lora_layer, min(layers)])}


def table11(
    model,
    ranking: pd.DataFrame,
    share: float,
    layers: Sequence[int],
    lora_layer: int,
    lora_weights: Mapping[str, torch.Tensor],
    train_set: PromptSet,
    test_set: PromptSet,
    config: FT.TrainConfig,
    *,
    random_seeds: Sequence[int] = (0, 1, 2),
    lrs: Sequence[float] = (),
    val_set: PromptSet | None = None,
    lora: LO.LoraSpec = LO.LoraSpec(),
    cache_dir: str | Path | None = None,
    tokens: torch.Tensor | None = None,
    repeats: int = 3,
    batch_size: int = 32,
    n_lora_reference: int = 0,
    progress: bool = True,
    inputs: Mapping[str, LayerInputs] | None = None,
) -> tuple[pd.DataFrame, dict[str, dict[int, torch.Tensor]]]:
    """Yu Table 11 with costs: rows "original", "LoRA" (``lora_weights`` on the unpruned
    model), "LoRA on CNA-pruned" (the first ``share`` of the deep neurons in
    ``ranking``'s union order kept, really pruned, LoRA added on ``lora_layer`` and
    trained), "LoRA on CNA-masked" (the same neurons and LoRA weights in the full-size
    model with the others' output columns zeroed: equal accuracy, no savings) and
    "LoRA on random-pruned" once per seed of ``random_seeds`` (as many neurons drawn
    uniformly from ``layers``). Columns: model, selection, seed, share, n_kept, k,
    accuracy (whole answer), accuracy_first, accuracy_pruned (the pruned model before
    LoRA), parameter counts, n_lora, forward_s / forward_min_s (timed for all but the
    random seeds after the first: same shapes), speedup (the original's fastest pass over
    the model's), paper (Yu's %). Also returns the keep sets by name.

    Every model here equals ``model`` below ``lora_layer`` or below the first pruned
    layer, so each evaluation and training pass starts at one of those blocks from the
    stream recorded by the first pass that computes it (``inputs``: a
    :class:`~arithlib.engine.LayerInputs` for ``"train"`` and ``"test"``, made
    here when None); the numbers are those of full passes."""
    widths = {int(l): ffn_width(model, l) for l in layers}
    pool = sum(widths.values())
    n = n_for_share(share, pool)
    k = k_of_prefix(ranking, n)
    inputs = inputs if inputs is not None else recorded_streams(lora_layer, layers)
    common = dict(
        val_set=val_set, lrs=lrs, lora=lora, cache_dir=cache_dir, repeats=repeats, batch_size=batch_size, inputs=inputs
    )
    rows = []
    jobs = ["original", "LoRA", "cna", *[("random", int(s)) for s in random_seeds]]
    keeps: dict[str, dict[int, torch.Tensor]] = {}
    for job in tqdm(jobs, desc="Table 11", disable=not progress):
        if job in ("original", "LoRA"):
            w = None if job == "original" else lora_weights
            row = evaluate_row(
                model, w, test_set, layers, tokens=tokens, repeats=repeats, batch_size=batch_size, inputs=inputs
            )
            rows.append(
                {
                    "model": job,
                    "selection": "none",
                    "seed": -1,
                    "share": 1.0,
                    "n_kept": pool,
                    "k": np.nan,
                    "accuracy_pruned": np.nan,
                    "n_lora": n_lora_reference if w else 0,
                    **row,
                    "paper": YU_TABLE11[job],
                }
            )
        elif job == "cna":
            keep = keep_from_ranking(ranking, n, layers)
            keeps["cna"] = keep
            row, pruned, ft = prune_and_finetune(
                model, keep, lora_layer, train_set, test_set, config, tokens=tokens, return_model=True, **common
            )
            rows.append(
                {
                    "model": "LoRA on CNA-pruned",
                    "selection": "cna",
                    "seed": -1,
                    "share": share,
                    "k": k,
                    **row,
                    "paper": YU_TABLE11["LoRA on CNA-pruned"],
                }
            )
            masked = {**mask_weights(model, keep), **ft.weights}
            mrow = evaluate_row(
                model, masked, test_set, layers, tokens=tokens, repeats=repeats, batch_size=batch_size, inputs=inputs
            )
            mrow["n_deep_neurons"] = row["n_deep_neurons"]  # zeroed neurons are not neurons any more
            rows.append(
                {
                    "model": "LoRA on CNA-masked",
                    "selection": "cna (masked)",
                    "seed": -1,
                    "share": share,
                    "n_kept": row["n_kept"],
                    "k": k,
                    "accuracy_pruned": row["accuracy_pruned"],
                    "n_lora": row["n_lora"],
                    "lr": row["lr"],
                    **mrow,
                    "paper": np.nan,
                }
            )
            del pruned
        else:
            seed = job[1]
            keep = random_keep(layers, widths, n, seed=seed)
            keeps[f"random seed {seed}"] = keep
            first = seed == int(random_seeds[0])
            row = prune_and_finetune(
                model, keep, lora_layer, train_set, test_set, config, tokens=tokens if first else None, **common
            )
            rows.append(
                {
                    "model": "LoRA on random-pruned",
                    "selection": "random",
                    "seed": seed,
                    "share": share,
                    "k": np.nan,
                    **row,
                    "paper": YU_TABLE11["LoRA on random-pruned"],
                }
            )
    table = pd.DataFrame(rows)
    base = table.loc[table.model == "original"].iloc[0]
    table["deep_ffn_share"] = table.n_deep_ffn_params / base.n_deep_ffn_params
    table["params_share"] = table.n_params / base.n_params
    table["lora_share"] = table.n_lora / base.n_params
    if "forward_min_s" in table:  # the fastest pass: the one least slowed by other work on the machine
        table["speedup"] = base.forward_min_s / table.forward_min_s
    return table, keeps


def share_sweep(
    model,
    ranking: pd.DataFrame,
    shares: Sequence[float],
    layers: Sequence[int],
    lora_layer: int,
    train_set: PromptSet,
    test_set: PromptSet,
    config: FT.TrainConfig,
    *,
    random_seeds: Sequence[int] = (0,),
    fine_tune: bool | Sequence[float] = True,
    lrs: Sequence[float] = (),
    val_set: PromptSet | None = None,
    lora: LO.LoraSpec = LO.LoraSpec(),
    cache_dir: str | Path | None = None,
    batch_size: int = 32,
    progress: bool = True,
    inputs: Mapping[str, LayerInputs] | None = None,
) -> tuple[pd.DataFrame, dict[tuple, dict[int, torch.Tensor]]]:
    """Table 11 and its sweep: for each share of the deep neurons kept, the CNA union
    prefix of that size (:func:`keep_from_ranking`) and, for each of ``random_seeds``,
    as many neurons drawn uniformly from the same layers (:func:`random_keep`); each
    pruned (:func:`prune_ffn`), evaluated, LoRA-tuned on ``lora_layer`` and evaluated
    (``fine_tune`` True / False, or the shares at which to tune). Rows: selection
    ("cna" / "random"), seed, share, n_kept, k (CNA: the per-case top-K the prefix
    reaches) and :func:`prune_and_finetune`'s columns. Also returns the keep sets by
    (selection, share, seed). ``inputs``: as in :func:`table11`."""
    widths = {l: ffn_width(model, l) for l in layers}
    inputs = inputs if inputs is not None else recorded_streams(lora_layer, layers)
    pool = sum(widths.values())
    rows, keeps = [], {}
    jobs = []
    for share in shares:
        n = n_for_share(share, pool)
        jobs.append(("cna", share, -1, keep_from_ranking(ranking, n, layers), k_of_prefix(ranking, n)))
        for s in random_seeds:
            jobs.append(("random", share, int(s), random_keep(layers, widths, n, seed=int(s)), np.nan))
    tune_at = set(shares) if fine_tune is True else set() if fine_tune is False else set(fine_tune)
    for selection, share, seed, keep, k in tqdm(jobs, desc="prune + LoRA", disable=not progress):
        keeps[(selection, share, seed)] = keep
        row = prune_and_finetune(
            model,
            keep,
            lora_layer,
            train_set,
            test_set,
            config,
            fine_tune=share in tune_at,
            val_set=val_set,
            lrs=lrs,
            lora=lora,
            cache_dir=cache_dir,
            batch_size=batch_size,
            inputs=inputs,
        )
        rows.append({"selection": selection, "seed": seed, "share": share, "k": k, **row})
    return pd.DataFrame(rows), keeps


def summarize_sweep(sweep: pd.DataFrame) -> pd.DataFrame:
    """Mean, standard deviation and count over seeds of the accuracies, per selection and share."""
    g = sweep.groupby(["selection", "share"])
    out = g.agg(
        n_kept=("n_kept", "first"),
        n_seeds=("seed", "count"),
        accuracy_pruned=("accuracy_pruned", "mean"),
        accuracy_pruned_sd=("accuracy_pruned", "std"),
        accuracy=("accuracy", "mean"),
        accuracy_sd=("accuracy", "std"),
        n_params=("n_params", "first"),
        n_deep_ffn_params=("n_deep_ffn_params", "first"),
    ).reset_index()
    return out.sort_values(["selection", "share"]).reset_index(drop=True)
