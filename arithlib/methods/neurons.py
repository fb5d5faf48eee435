"""Neuron-level analysis of the answer position (Nikankin et al. 2025, ICLR, Sec. 3-4).

What is here, and the paper's counterpart:

* :class:`arithlib.engine.AnswerPositionRunner` (the engine's): runs every prompt's
  prefix once (KV cache) and then re-runs only the answer (last) position under
  interventions. All of Nikankin's
  neuron-level interventions act on the MLP neurons at the last position, and in a
  causal model nothing at earlier positions depends on the last one, so this is
  exact (tested against a full forward pass) and about ``prompt length`` times
  cheaper than re-running whole prompts. TransformerLens's patching helpers run
  one full forward pass per patched component, which is why this exists.
  :meth:`AnswerPositionRunner.logits_many` runs several interventions in one pass
  (one block of rows each), as every ablation table of notebook 03 does.
* :func:`neuron_attribution`: attribution patching of every neuron of the chosen
  layers at once (gradient x activation difference, Syed et al. 2023), against the
  mean activation (mean ablation) or a counterfactual prompt's activation; the
  linear approximation of Nikankin's neuron-level activation patching (Sec. 3).
  :func:`exact_neuron_effects` measures the real effect of mean-ablating single
  neurons, to check the approximation.
* :func:`neuron_circuit_faithfulness` / :func:`faithfulness_curve`: faithfulness
  (Eq. 2) of a neuron circuit under mean ablation: every neuron of the chosen MLP
  layers outside the circuit is mean-ablated at the answer position; the score is
  the correct-token logit divided by the maximum logit, scaled between the model
  with all those neurons mean-ablated (0) and the full model (1). Fig. 4b is the
  curve over the number of neurons kept per layer.
* :func:`collect_last_position`, :func:`operand_grid`: neuron activations over the
  operand grid op1 x op2 (Fig. 1, 5).
* :func:`neuron_logit_lens`: the logit lens of a neuron's value vector (row k of
  W_out, through the final norm's gain, times W_U) on the number tokens: which
  results the neuron promotes (Sec. 4.1, "direct heuristics").
* :func:`neuron_logit_contributions`: each neuron's direct contribution to the
  correct answer's logit on each prompt (Sec. 4.3).
* :func:`masked_mean_hooks`: mean-ablate a different set of neurons for each prompt
  of a batch (Sec. 4.2's per-prompt ablations); ``arithlib.methods.ablation`` ablates one set
  for the whole batch.

Conventions: ``layers`` is the ordered list of analysed MLP layers (default: the
second half of the model, Nikankin's "middle and late MLPs"); per-layer tensors are
indexed by position in ``layers``. A neuron is ``(layer, index)``. ``means`` is a
``[len(layers), d_mlp]`` tensor of answer-position mean activations.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import pandas as pd
import torch
from tqdm.auto import tqdm

from ..core.components import Hook, Neuron, post_hook
from ..core.prompt_sets import PromptSet, single_token_numbers
from ..core.readout import final_norm, unembedding
from ..engine import AnswerPositionRunner, HookFactory, input_device, last_position_logits
from .ablation import mean_neurons_hooks


def default_layers(n_layers: int) -> list[int]:
    """Nikankin's "middle and late MLPs": the second half of the layers, ``n//2 .. n-1``."""
    if n_layers < 1:
        raise ValueError("n_layers must be positive")
    return list(range(n_layers // 2, n_layers))


def _check_layers(model, layers: Sequence[int]) -> list[int]:
    n = model.cfg.n_layers if hasattr(model, "cfg") else None
    layers = [int(x) for x in layers]
    if not layers:
        raise ValueError("layers is empty")
    if len(set(layers)) != len(layers):
        raise ValueError(f"layers has duplicates: {layers}")
    if n is not None and any(not 0 <= x < n for x in layers):
        raise ValueError(f"layers {layers} out of range for a {n}-layer model")
    return layers


# --------------------------------------------------------------------------- runner


@torch.no_grad()
def collect_last_position(
    model, prompts: PromptSet, hook_names: Sequence[str], batch_size: int = 256, progress: bool = False
) -> dict[str, torch.Tensor]:
    """Answer-position activations of ``hook_names`` from plain forward passes
    ({name: [N, ...]} plus ``"logits"`` [N, vocab]); no KV cache is kept, so this suits
    large operand grids that are read once."""
    device = input_device(model)
    store: dict[str, torch.Tensor] = {}
    current = {}

    def rec(name):
        def fn(act, hook):
            current[name] = act[:, -1].detach().float().cpu()
            return act

        return fn

    hooks = [(h, rec(h)) for h in hook_names]
    for batch in tqdm(list(prompts.batches(batch_size, device)), desc="activations", disable=not progress, leave=False):
        with model.hooks(fwd_hooks=hooks):
            logits = last_position_logits(model, batch.tokens).cpu()
        for name, value in list(current.items()) + [("logits", logits)]:
            if name not in store:
                store[name] = torch.empty((len(prompts),) + tuple(value.shape[1:]))
            store[name][batch.index] = value
    return store


def neuron_activations(
    model, prompts: PromptSet, layers: Sequence[int], batch_size: int = 256, progress: bool = False
) -> torch.Tensor:
    """MLP neuron activations (``hook_post``) at the answer position, [N, len(layers), d_mlp]."""
    layers = _check_layers(model, layers)
    acts = collect_last_position(model, prompts, [post_hook(x) for x in layers], batch_size, progress)
    return torch.stack([acts[post_hook(x)] for x in layers], 1)


def last_position_means(acts: torch.Tensor) -> torch.Tensor:
    """Mean answer-position activation of each neuron over a reference set:
    ``acts`` [N, L, d_mlp] -> [L, d_mlp] (the value mean ablation writes in)."""
    if acts.ndim != 3 or acts.shape[0] == 0:
        raise ValueError("acts must be [N > 0, layers, d_mlp]")
    return acts.mean(0)


def runner_means(means: torch.Tensor, layers: Sequence[int]) -> dict[str, dict[int, torch.Tensor]]:
    """``means`` [L, d_mlp] as the per-length cache that ``arithlib.methods.ablation``'s mean
    hooks read, keyed by length 1: the runner's single-token passes."""
    return {post_hook(x): {1: means[i][None].clone()} for i, x in enumerate(layers)}


# --------------------------------------------------------------------------- metrics


def number_token_ids(tokenizer, max_number: int) -> torch.Tensor:
    """Token id of each integer 0..max_number written alone (the candidate results),
    as a tensor; raises if one is not a single token (:func:`arithlib.core.prompt_sets.single_token_numbers`
    skips those)."""
    ids = single_token_numbers(tokenizer, max_number) if max_number >= 0 else {}
    missing = next((n for n in range(max_number + 1) if n not in ids), None)
    if missing is not None:
        raise ValueError(f"{missing} is not a single token for this tokenizer; lower max_number")
    return torch.tensor([ids[n] for n in range(max_number + 1)], dtype=torch.long)


def answer_margin(logits: torch.Tensor, answers: torch.Tensor, candidates: torch.Tensor | None = None) -> torch.Tensor:
    """Correct-answer logit minus the mean logit of the candidate tokens (all tokens when
    None), per prompt. Shift-invariant and unsaturated: the metric attribution
    patching differentiates."""
    correct = logits.gather(1, answers.to(logits.device)[:, None]).squeeze(1)
    pool = logits if candidates is None else logits[:, candidates.to(logits.device)]
    return correct - pool.mean(-1)


def normalised_logit(logits: torch.Tensor, answers: torch.Tensor) -> torch.Tensor:
    """Nikankin's per-prompt score: the correct-token logit divided by the maximum logit."""
    correct = logits.gather(1, answers.to(logits.device)[:, None]).squeeze(1)
    return correct / logits.max(-1).values


def normalised_logit_faithfulness(
    circuit_logits: torch.Tensor, full_logits: torch.Tensor, ablated_logits: torch.Tensor, answers: torch.Tensor
) -> dict[str, float]:
    """Faithfulness (Nikankin Eq. 2) of a circuit from three runs' answer-position logits.

    With y = correct logit / max logit per prompt: ``faithfulness`` = (mean y_circuit -
    mean y_ablated) / (mean y_full - mean y_ablated), means over prompts first (as
    ``arithlib.core.metrics.faithfulness``; NaN when the full and the ablated runs score the
    same); ``faithfulness_per_prompt`` = the mean over prompts of the per-prompt ratio
    (prompts whose full and ablated y are equal are dropped; unstable when a denominator is
    small) and its median. ``accuracy``: the circuit's first-token accuracy.
    """
    yc, yf, ya = (normalised_logit(x, answers).double() for x in (circuit_logits, full_logits, ablated_logits))
    denom = yf - ya
    ok = denom.abs() > 1e-6
    per_prompt = (yc - ya)[ok] / denom[ok]
    pooled = float((yc - ya).mean() / denom.mean()) if denom.mean().abs() > 1e-12 else float("nan")
    return {
        "faithfulness": pooled,
        "faithfulness_per_prompt": float(per_prompt.mean()) if ok.any() else float("nan"),
        "faithfulness_per_prompt_median": float(per_prompt.median()) if ok.any() else float("nan"),
        "accuracy": float((circuit_logits.argmax(-1) == answers).float().mean()),
        "n_prompts": int(len(answers)),
        "n_prompts_changed": int(ok.sum()),
    }


# --------------------------------------------------------------------------- attribution


def neuron_attribution(
    runner: AnswerPositionRunner,
    layers: Sequence[int],
    means: torch.Tensor | None = None,
    baseline_acts: torch.Tensor | None = None,
    candidates: torch.Tensor | None = None,
    progress: bool = False,
) -> torch.Tensor:
    """Attribution patching of every neuron of ``layers`` at the answer position.

    attr[p, l, k] = (a[p, l, k] - a_base[p, l, k]) * d margin_p / d a[p, l, k], the first-order
    estimate of how much the answer margin (:func:`answer_margin`) drops when neuron
    (l, k) takes its baseline value on prompt p. Baseline: ``means`` [L, d_mlp] (mean
    ablation) or ``baseline_acts`` [N, L, d_mlp] (a counterfactual prompt's activations,
    Nikankin's patching). One forward and backward pass per batch gives every neuron,
    whatever the parameters' ``requires_grad``. Returns [N, L, d_mlp] (float32, CPU).
    """
    layers = _check_layers(runner.model, layers)
    if (means is None) == (baseline_acts is None):
        raise ValueError("give exactly one of means (mean ablation) and baseline_acts (counterfactual)")
    out = None
    names = [post_hook(x) for x in layers]
    captured: dict[str, torch.Tensor] = {}

    def cap(name):
        def fn(act, hook):
            if not act.requires_grad:  # frozen weights upstream: start the graph here (same gradient)
                act = act.detach().requires_grad_(True)
            captured[name] = act
            return act

        return fn

    hooks = [(n, cap(n)) for n in names]
    for index, logits in runner.passes(hooks, grad=True, progress=progress, desc="attribution"):
        metric = answer_margin(logits, runner.answers[index], candidates).sum()
        acts = [captured[n] for n in names]
        grads = torch.autograd.grad(metric, acts)
        a = torch.stack([x[:, -1].detach().float().cpu() for x in acts], 1)
        g = torch.stack([x[:, -1].float().cpu() for x in grads], 1)
        base = means[None] if means is not None else baseline_acts[index]
        if out is None:
            out = torch.empty((len(runner),) + tuple(a.shape[1:]))
        out[index] = (a - base) * g
        captured.clear()
    return out


def neuron_scores(attr: torch.Tensor) -> torch.Tensor:
    """Importance of each neuron: mean over prompts of |attribution| ([N, L, d] -> [L, d]).
    Absolute values, because a neuron matters for faithfulness whether it helps or
    hurts a prompt, and heuristic neurons act on some prompts only."""
    return attr.abs().mean(0)


def top_neurons_per_layer(scores: torch.Tensor, layers: Sequence[int], k: int) -> list[Neuron]:
    """The ``k`` highest-scoring neurons of each layer (``scores`` [L, d_mlp])."""
    if not 0 <= k <= scores.shape[-1]:
        raise ValueError(f"k must be in 0..{scores.shape[-1]}, got {k}")
    if scores.shape[0] != len(layers):
        raise ValueError("scores has one row per layer in layers")
    out = []
    for i, layer in enumerate(layers):
        idx = torch.argsort(scores[i], descending=True, stable=True)[:k]
        out += [(int(layer), int(j)) for j in sorted(idx.tolist())]
    return out


def exact_neuron_effects(
    runner: AnswerPositionRunner,
    neurons: Sequence[Neuron],
    layers: Sequence[int],
    means: torch.Tensor,
    candidates: torch.Tensor | None = None,
    progress: bool = False,
) -> pd.DataFrame:
    """Mean-ablate each neuron alone at the answer position and measure the drop of the
    answer margin per prompt (exact activation patching; one single-token pass per
    neuron, several per :meth:`AnswerPositionRunner.logits_many` pass). Columns: layer,
    neuron, effect (mean drop over prompts), abs_effect (mean |drop|)."""
    cache = runner_means(means, layers)
    neurons = list(neurons)
    full, *each = runner.logits_many(
        [None] + [mean_neurons_hooks([(layer, k)], cache, position=-1) for layer, k in neurons], progress=progress
    )
    full = answer_margin(full, runner.answers, candidates)
    rows = []
    for (layer, k), logits in zip(neurons, each):
        drop = full - answer_margin(logits, runner.answers, candidates)
        rows.append(
            {
                "layer": int(layer),
                "neuron": int(k),
                "effect": float(drop.mean()),
                "abs_effect": float(drop.abs().mean()),
            }
        )
    return pd.DataFrame(rows)


# --------------------------------------------------------------------------- circuits


def complement(neurons: Iterable[Neuron], layers: Sequence[int], d_mlp: int) -> list[Neuron]:
    """Every neuron of ``layers`` not in ``neurons``."""
    keep = {(int(a), int(b)) for a, b in neurons}
    return [(int(x), k) for x in layers for k in range(d_mlp) if (int(x), k) not in keep]


def neuron_circuit_faithfulness(
    runner: AnswerPositionRunner,
    circuit: Iterable[Neuron],
    layers: Sequence[int],
    means: torch.Tensor,
    full_logits: torch.Tensor | None = None,
    ablated_logits: torch.Tensor | None = None,
) -> dict[str, float]:
    """Faithfulness (Nikankin Eq. 2) of the neuron circuit ``circuit``: every other neuron of
    ``layers`` is mean-ablated at the answer position (:func:`normalised_logit_faithfulness`).
    Pass ``full_logits`` / ``ablated_logits`` to reuse the two reference runs."""
    layers = _check_layers(runner.model, layers)
    d_mlp = means.shape[-1]
    cache = runner_means(means, layers)
    circuit = list(circuit)
    rest = complement(circuit, layers, d_mlp)
    todo: dict[str, list[Hook]] = {}  # the runs not given, one pass for all
    if full_logits is None:
        todo["full"] = []
    if ablated_logits is None:
        todo["ablated"] = mean_neurons_hooks(complement([], layers, d_mlp), cache, position=-1)
    if circuit and rest:
        todo["circuit"] = mean_neurons_hooks(rest, cache, position=-1)
    got = dict(zip(todo, runner.logits_many(list(todo.values())))) if todo else {}
    full_logits = got.get("full", full_logits)
    ablated_logits = got.get("ablated", ablated_logits)
    circuit_logits = got["circuit"] if "circuit" in got else (ablated_logits if not circuit else full_logits)
    out = normalised_logit_faithfulness(circuit_logits, full_logits, ablated_logits, runner.answers)
    out["n_neurons"] = len(circuit)
    return out


def share_grid(
    d_mlp: int, shares: Sequence[float] = (0, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
) -> list[int]:
    """Neurons per layer for each share of the layer (0..1), rounded, distinct, sorted."""
    if any(not 0 <= s <= 1 for s in shares):
        raise ValueError("shares must lie in [0, 1]")
    return sorted({int(round(s * d_mlp)) for s in shares})


def faithfulness_curve(
    runner: AnswerPositionRunner,
    scores: torch.Tensor,
    layers: Sequence[int],
    means: torch.Tensor,
    ks: Sequence[int],
    progress: bool = False,
) -> pd.DataFrame:
    """Faithfulness of the top-``k``-per-layer circuit (by ``scores``) for each k in ``ks``
    (Nikankin Fig. 4b). Columns: k_per_layer, share_per_layer, n_neurons, faithfulness,
    faithfulness_per_prompt(_median), accuracy, n_prompts, n_prompts_changed."""
    layers = _check_layers(runner.model, layers)
    d_mlp = means.shape[-1]
    cache = runner_means(means, layers)
    ks = [int(k) for k in ks]
    circuits = [top_neurons_per_layer(scores, layers, k) for k in ks]
    rests = [complement(c, layers, d_mlp) for c in circuits]
    run = [i for i, (c, r) in enumerate(zip(circuits, rests)) if c and r]  # others are the two references
    conditions = [None, mean_neurons_hooks(complement([], layers, d_mlp), cache, position=-1)]
    full, ablated, *ran = runner.logits_many(
        conditions + [mean_neurons_hooks(rests[i], cache, position=-1) for i in run], progress=progress
    )
    per_k = [ablated if not c else full for c in circuits]
    for i, logits in zip(run, ran):
        per_k[i] = logits
    rows = []
    for k, circuit, logits in zip(ks, circuits, per_k):
        res = normalised_logit_faithfulness(logits, full, ablated, runner.answers)
        rows.append({"k_per_layer": k, "share_per_layer": k / d_mlp, **res, "n_neurons": len(circuit)})
    return pd.DataFrame(rows)


def smallest_faithful_k(curve: pd.DataFrame, target: float = 0.9, column: str = "faithfulness") -> int:
    """The smallest k_per_layer of a curve (one or several operators, averaged over those
    where it is defined) whose faithfulness reaches ``target``; the largest k tested when
    none does."""
    mean = curve.groupby("k_per_layer")[column].mean().sort_index()
    hit = mean[mean >= target]
    return int(hit.index[0]) if len(hit) else int(mean.index[-1])


# --------------------------------------------------------------------------- per-prompt ablation


def masked_mean_hooks(masks: dict[int, torch.Tensor], means: torch.Tensor, layers: Sequence[int]) -> HookFactory:
    """A hook factory for :class:`arithlib.engine.AnswerPositionRunner` that mean-ablates, at the answer
    position, a different set of neurons for each prompt: ``masks[layer]`` is a bool
    [N, d_mlp] over the runner's prompts (True = ablate)."""
    pos = {int(x): i for i, x in enumerate(layers)}

    def factory(index: torch.Tensor) -> list[Hook]:
        hooks = []
        for layer, mask in masks.items():

            def fn(act, hook, m=mask[index], mean=means[pos[int(layer)]]):
                m = m.to(act.device)
                act[:, -1] = torch.where(m, mean.to(act.device, act.dtype), act[:, -1])
                return act

            hooks.append((post_hook(int(layer)), fn))
        return hooks

    return factory


def prompt_neuron_masks(
    per_prompt: Sequence[Iterable[Neuron]], layers: Sequence[int], d_mlp: int
) -> dict[int, torch.Tensor]:
    """Bool masks {layer: [N, d_mlp]} from a list (one entry per prompt) of neuron sets
    (True on each prompt's neurons; every neuron's layer must be one of ``layers``)."""
    masks = {int(x): torch.zeros(len(per_prompt), d_mlp, dtype=torch.bool) for x in layers}
    # each layer's (prompt, neuron) pairs, then one indexed write per layer: a write per
    # neuron costs a dispatch each (most of a mask / keep section's time under flop counting)
    pairs: dict[int, tuple[list[int], list[int]]] = {}
    for i, neurons in enumerate(per_prompt):
        for layer, k in neurons:
            rows, cols = pairs.setdefault(int(layer), ([], []))
            rows.append(i)
            cols.append(int(k))
    for layer, (rows, cols) in pairs.items():
        masks[layer][rows, cols] = True
    return masks


def correct_first(logits: torch.Tensor, answers: torch.Tensor) -> torch.Tensor:
    """Per prompt: is the first answer token the argmax? (bool [N])."""
    return logits.argmax(-1) == answers.to(logits.device)


# --------------------------------------------------------------------------- logit lens


def w_out(model, layer: int) -> torch.Tensor:
    """W_out of one layer, [d_mlp, d_model] (row k: neuron k's value vector); read per
    layer, because the bridge's stacked ``W_out`` copies every layer."""
    return model.blocks[int(layer)].mlp.W_out.detach().float()


def value_vectors(model, neurons: Sequence[Neuron], cache: dict[int, torch.Tensor] | None = None) -> torch.Tensor:
    """Each neuron's value vector (row k of W_out of its layer), [n, d_model], in the order
    of ``neurons``: gathered layer by layer, each layer's W_out read once (``cache``: a
    dict ``{layer: W_out}`` kept across calls)."""
    if not neurons:
        return torch.empty(0, model.cfg.d_model)
    cache = {} if cache is None else cache
    layer = torch.tensor([int(l) for l, _ in neurons])
    index = torch.tensor([int(k) for _, k in neurons])
    out = None
    for l in layer.unique().tolist():
        if l not in cache:
            cache[l] = w_out(model, l)
        w = cache[l]
        out = torch.empty(len(neurons), w.shape[1], device=w.device) if out is None else out
        sel = (layer == l).nonzero().flatten()
        out[sel.to(out.device)] = w[index[sel].to(w.device)].to(out.device)
    return out


def logit_directions(model, vectors: torch.Tensor, token_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Logit lens of residual-stream directions: through the final norm's gain (centred
    first for LayerNorm; the input scale is left out) and the unembedding, restricted to
    ``token_ids``. [n, d_model] -> [n, len(token_ids)]."""
    norm = final_norm(model)
    v = vectors.float()
    if norm.kind == "layer":  # LayerNorm: the mean is removed
        v = v - v.mean(-1, keepdim=True)
    v = v * norm.weight
    w_u = unembedding(model)[0]
    if token_ids is not None:
        w_u = w_u[:, token_ids]
    return v @ w_u


def neuron_logit_lens(
    model, neurons: Sequence[Neuron], token_ids: torch.Tensor, values: Sequence[int] | None = None
) -> pd.DataFrame:
    """Nikankin's logit lens of each neuron's value vector on the number tokens: one row
    per (neuron, value) with the logit it adds per unit activation (``lens``) and its
    z-score among the number tokens (``lens_z``)."""
    values = list(range(len(token_ids))) if values is None else list(values)
    lens = logit_directions(model, value_vectors(model, neurons), token_ids)
    z = (lens - lens.mean(-1, keepdim=True)) / lens.std(-1, keepdim=True).clamp_min(1e-9)
    rows = []
    for i, (layer, k) in enumerate(neurons):
        for j, v in enumerate(values):
            rows.append(
                {
                    "layer": int(layer),
                    "neuron": int(k),
                    "value": int(v),
                    "lens": float(lens[i, j]),
                    "lens_z": float(z[i, j]),
                }
            )
    return pd.DataFrame(rows)


def final_norm_scale(acts: dict[str, torch.Tensor], model) -> torch.Tensor:
    """Per-prompt scale of the final norm at the answer position ([N]) from a collection
    that recorded ``ln_final.hook_scale``."""
    if "ln_final.hook_scale" not in acts:
        raise KeyError("collect 'ln_final.hook_scale' with the activations")
    return acts["ln_final.hook_scale"].reshape(len(acts["ln_final.hook_scale"]), -1)[:, 0]


def neuron_logit_contributions(
    model,
    acts: torch.Tensor,
    layers: Sequence[int],
    answers: torch.Tensor,
    scale: torch.Tensor | None = None,
    means: torch.Tensor | None = None,
) -> torch.Tensor:
    """Direct contribution of each neuron of ``layers`` to the correct answer's logit on
    each prompt: (a[p, l, k] - mean) * lens(W_out[l, k])[answer_p] / scale_p, [N, L, d_mlp].
    ``acts`` [N, L, d_mlp]; ``scale`` the final norm's per-prompt scale (1 if None);
    ``means`` subtracts the mean activation (contribution relative to mean ablation)."""
    layers = list(layers)
    out = torch.empty_like(acts)
    uniq = torch.unique(answers)
    for i, layer in enumerate(layers):
        lens = logit_directions(model, w_out(model, layer), uniq)  # [d_mlp, U]
        col = torch.searchsorted(uniq, answers)
        per_prompt = lens.T[col].to(acts.device)  # [N, d_mlp], where the activations are
        a = acts[:, i] - (means[i][None] if means is not None else 0)
        out[:, i] = a * per_prompt
    if scale is not None:
        out = out / scale[:, None, None]
    return out


# --------------------------------------------------------------------------- grids


def operand_grid(frame: pd.DataFrame, values: np.ndarray | torch.Tensor, name: str = "activation") -> pd.DataFrame:
    """Pivot one value per prompt into the op1 x op2 grid (rows a, columns b; NaN where
    no prompt); ``frame`` has columns a and b in prompt order."""
    df = pd.DataFrame({"a": frame["a"].to_numpy(), "b": frame["b"].to_numpy(), name: np.asarray(values, dtype=float)})
    return df.pivot_table(index="a", columns="b", values=name, aggfunc="mean")
