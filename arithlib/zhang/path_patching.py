"""Zhang et al. 2024's path patching (Alg. 1, App. B): the effect of each head and MLP on the
answer logit through the residual stream at the END position, with every other head
frozen at its clean value and the MLPs recomputed.

:func:`path_patch_full` is the literal method (one full forward pass per sender, with
hooks); :func:`path_patch_answer` / :func:`path_patch_end` compute the same numbers on the
fast path of :mod:`arithlib.methods.patching` (at END the attention outputs above the sender are
the clean ones, so only MLPs and norms are recomputed). :func:`path_patching` runs it over
a prompt set; :func:`key_heads` applies the paper's threshold.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch
from tqdm.auto import tqdm

from ..core.components import attn_out_hook, mlp_out_hook, z_hook
from ..core.metrics import relative_logit_change
from ..core.papers import KEY_HEAD_THRESHOLD
from ..core.prompt_sets import PromptSet
from ..engine import (
    CleanRun,
    RunCache,
    grouped_clean_run,
    input_device,
    layer_device,
    module_device,
    prefix_groups,
    resumable,
)
from ..methods.patching import Component, Edit, Unembed, cache_activations, heads_and_mlps, run_edits_full, run_variants


def _check_senders(senders: Sequence[Component]) -> None:
    for s in senders:
        if s.kind not in ("head", "mlp") or (s.kind == "head" and s.index is None):
            raise ValueError(f"path patching senders are single heads or MLPs, got {s.label}")


@torch.no_grad()
def path_patch_full(
    model,
    tokens: torch.Tensor,
    cf_tokens: torch.Tensor,
    senders: Sequence[Component],
    answer_ids: torch.Tensor,
    progress: bool = False,
) -> torch.Tensor:
    """Reference for Zhang et al.'s path patching (Alg. 1, App. B), one full forward
    pass per sender: the sender's output at the END position is set to its value on
    ``cf_tokens``, every other head is frozen at its clean value (all positions), MLPs
    recompute. Returns the answer-token logits ``[n_senders, B]``."""
    _check_senders(senders)
    n_layers = model.cfg.n_layers
    clean = cache_activations(model, tokens, [z_hook(l) for l in range(n_layers)])
    cf = cache_activations(
        model, cf_tokens, [z_hook(l) for l in range(n_layers)] + [mlp_out_hook(l) for l in range(n_layers)]
    )
    out = []
    T = tokens.shape[1]
    for s in tqdm(senders, desc="path patching (full)", disable=not progress, leave=False):
        edits = []
        for l in range(n_layers):
            for p in range(T):
                z = clean[z_hook(l)][:, p].clone()
                if s.kind == "head" and l == s.layer and p == T - 1:
                    z[:, s.index] = cf[z_hook(l)][:, p, s.index]
                edits.append(Edit(Component("head", l), p, z))
        if s.kind == "mlp":
            edits.append(Edit(Component("mlp", s.layer), T - 1, cf[mlp_out_hook(s.layer)][:, -1]))
        logits = run_edits_full(model, tokens, edits)
        out.append(logits.gather(1, answer_ids[:, None].to(logits.device)).squeeze(1))
    return torch.stack(out)


@torch.no_grad()
def path_patch_answer(
    model,
    clean: CleanRun,
    clean_end: Mapping[str, torch.Tensor],
    cf_end: Mapping[str, torch.Tensor],
    senders: Sequence[Component],
    answer_ids: torch.Tensor,
    unembed: Unembed | None = None,
) -> torch.Tensor:
    """Fast Zhang path patching at the END position: answer-token logits ``[n_senders, B]``.

    ``clean`` is the clean :class:`CleanRun`; ``clean_end`` holds, at the last position,
    ``blocks.L.attn.hook_z`` ``[B, H, d_head]`` and ``blocks.L.hook_attn_out`` ``[B, d]`` of
    every layer; ``cf_end`` ``hook_z`` and ``hook_mlp_out`` of the counterfactual run.
    With all other heads frozen, the attention output at END in every layer is the
    clean one except in the sender's layer, where it is W_O applied to the clean z with
    the sender's slice replaced; so each sender costs only the MLPs (and norms) of the
    layers from its own up, on one token. Models with parallel attention/MLP blocks
    (or not :func:`resumable`) fall back to :func:`run_variants` with explicit
    freezing edits.
    """
    _check_senders(senders)
    cfg = model.cfg
    n_layers = cfg.n_layers
    unembed = unembed or Unembed(model)
    answer_ids = answer_ids.to(unembed.device)
    z_clean = {l: clean_end[z_hook(l)] for l in range(n_layers)}
    z_cf = {l: cf_end[z_hook(l)] for l in range(n_layers)}
    if getattr(cfg, "parallel_attn_mlp", False) or clean.resid is None:
        variants = []
        for s in senders:
            edits = []
            for l in range(s.layer, n_layers):
                z = z_clean[l].clone()
                if s.kind == "head" and l == s.layer:
                    z[:, s.index] = z_cf[l][:, s.index]
                edits.append(Edit(Component("head", l), -1, z))
            if s.kind == "mlp":
                edits.append(Edit(Component("mlp", s.layer), -1, cf_end[mlp_out_hook(s.layer)]))
            variants.append(edits)
        h = run_variants(model, clean, variants)
        return unembed.token_logits(h, answer_ids)

    resid = clean.resid[:, :, -1]  # [L, B, d]
    dev = resid.device

    def stack(xs: Iterable[torch.Tensor]) -> torch.Tensor:
        return torch.stack([x.to(dev) for x in xs])

    return path_patch_end(
        model,
        resid,
        stack(clean_end[attn_out_hook(l)] for l in range(n_layers)),
        stack(z_clean[l] for l in range(n_layers)),
        stack(z_cf[l] for l in range(n_layers)),
        stack(cf_end[mlp_out_hook(l)] for l in range(n_layers)),
        senders,
        answer_ids,
        unembed,
    )


@torch.no_grad()
def path_patch_end(
    model,
    resid: torch.Tensor,
    attn_out: torch.Tensor,
    z_clean: torch.Tensor,
    z_cf: torch.Tensor,
    mlp_cf: torch.Tensor,
    senders: Sequence[Component],
    answer_ids: torch.Tensor,
    unembed: Unembed | None = None,
    max_rows: int = 4096,
) -> torch.Tensor:
    """The MLP-only recomputation of :func:`path_patch_answer` from END vectors alone, so
    prompts of any lengths are processed together: ``resid`` ``[L, N, d]`` (input of each
    block), ``attn_out`` ``[L, N, d]``, ``z_clean`` / ``z_cf`` ``[L, N, H, d_head]``, ``mlp_cf``
    ``[L, N, d]`` (counterfactual MLP outputs), ``answer_ids`` ``[N]``. Sequential-residual
    models only. Returns answer-token logits ``[n_senders, N]``."""
    _check_senders(senders)
    if getattr(model.cfg, "parallel_attn_mlp", False):
        raise ValueError("path_patch_end needs sequential attention -> MLP blocks; use path_patch_answer")
    n_layers = model.cfg.n_layers
    unembed = unembed or Unembed(model)
    N = resid.shape[1]
    out = torch.empty(len(senders), N, device=unembed.device)
    blocks = model.blocks
    devices = [layer_device(model, l) for l in range(n_layers)]  # a split model: x follows the blocks
    final_device = module_device(model, model.ln_final)

    def mlp(l: int, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, 1, x.shape[-1])
        return blocks[l].mlp(blocks[l].ln2(flat)).reshape(x.shape)

    def at(t: torch.Tensor, l: int) -> torch.Tensor:
        return t.to(devices[l])

    by_layer: dict[int, list[int]] = {}
    for i, s in enumerate(senders):
        by_layer.setdefault(s.layer, []).append(i)
    step = max(1, max_rows // max(1, N))
    for layer, idx_all in sorted(by_layer.items()):
        for c0 in range(0, len(idx_all), step):
            idx = idx_all[c0 : c0 + step]
            heads = [i for i in idx if senders[i].kind == "head"]
            mlps = [i for i in idx if senders[i].kind == "mlp"]
            xs = []
            if heads:
                z = at(z_clean[layer], layer).unsqueeze(0).repeat(len(heads), 1, 1, 1)  # [v, N, H, dh]
                for j, i in enumerate(heads):
                    z[j, :, senders[i].index] = at(z_cf[layer][:, senders[i].index], layer)
                attn = blocks[layer].attn.o(z.reshape(len(heads) * N, 1, -1)).reshape(len(heads), N, -1)
                x = at(resid[layer], layer).unsqueeze(0) + attn
                xs.append(x + mlp(layer, x))
            if mlps:
                x = at(resid[layer] + attn_out[layer] + mlp_cf[layer], layer)
                xs.append(x.unsqueeze(0).expand(len(mlps), -1, -1))
            x = torch.cat(xs)
            for l in range(layer + 1, n_layers):
                x = at(x, l) + at(attn_out[l], l)
                x = x + mlp(l, x)
            x = x.to(final_device)
            h = model.ln_final(x.reshape(-1, 1, x.shape[-1])).reshape(x.shape)
            out[heads + mlps] = unembed.token_logits(h, answer_ids)
    return out


def path_end_captures(n_layers: int, attention: bool = False) -> dict[str, Callable]:
    """Capture spec for :func:`arithlib.engine.clean_run` of the clean prompts in path patching: z and
    attention output of every layer at the last position (and the END query's
    attention pattern ``[B, H, T]`` when ``attention``)."""
    spec: dict[str, Callable] = {}
    for l in range(n_layers):
        spec[z_hook(l)] = lambda a: a[:, -1]
        spec[attn_out_hook(l)] = lambda a: a[:, -1]
        if attention:
            spec[f"blocks.{l}.attn.hook_pattern"] = lambda a: a[:, :, -1, :]
    return spec


@dataclass
class PathPatchingResult:
    """What :func:`path_patching` returns.

    ``effects``: one row per prompt and sender (``prompt``, ``op``, ``template_id``,
    ``component``, ``kind``, ``layer``, ``head``, ``clean_logit``, ``patched_logit``,
    ``effect`` = Zhang's relative logit change). ``attention``: per prompt, the END
    query's attention pattern ``[n_layers, n_heads, T]``. ``cf_means``: mean ``hook_z``
    over the counterfactual prompts per prompt length (``{hook: {length: [T, H, d_head]}}``,
    the format of :mod:`arithlib.methods.ablation`), ``cf_counts``: prompts per length.
    """

    effects: pd.DataFrame
    attention: dict[int, torch.Tensor]
    cf_means: dict[str, dict[int, torch.Tensor]]
    cf_counts: dict[int, int]

    def end_means(self) -> dict[int, torch.Tensor]:
        """Mean ``z`` at the END position over all counterfactual prompts, pooled over
        lengths: ``{layer: [H, d_head]}`` (Zhang's knockout value at END)."""
        out = {}
        total = sum(self.cf_counts.values())
        for name, per in self.cf_means.items():
            layer = int(name.split(".")[1])
            out[layer] = sum(per[n][-1] * c for n, c in self.cf_counts.items()) / total
        return out


@torch.no_grad()
def path_patching(
    model,
    prompts: PromptSet,
    senders: Sequence[Component] | None = None,
    method: str = "fast",
    batch_size: int = 16,
    capture_attention: bool = True,
    progress: bool = True,
    cache: RunCache | None = None,
) -> PathPatchingResult:
    """Zhang et al. 2024 Alg. 1: path patching of every sender (default: all heads and
    MLPs) at the END position, reference X_r = ``prompts`` (keep only correctly
    answered ones), counterfactual X_c = their ``counterfactual`` texts.
    ``method="fast"`` uses :func:`path_patch_answer`, ``"full"`` :func:`path_patch_full`.
    The clean runs are added to ``cache`` when one is given.
    """
    if method not in ("fast", "full"):
        raise ValueError("method must be 'fast' or 'full'")
    if not prompts.has_counterfactuals:
        raise ValueError("path patching needs a counterfactual for every prompt")
    if len(prompts) == 0:
        raise ValueError("no prompts to patch")
    senders = list(senders) if senders is not None else heads_and_mlps(model)
    n_layers = model.cfg.n_layers
    unembed = Unembed(model)
    device = input_device(model)
    rows = []
    attention: dict[int, torch.Tensor] = {}
    sums: dict[str, dict[int, torch.Tensor]] = {z_hook(l): {} for l in range(n_layers)}
    counts: dict[int, int] = {}
    batches = list(prompts.batches(batch_size, device))
    fast = method == "fast" and not getattr(model.cfg, "parallel_attn_mlp", False) and resumable(model)
    pooled: dict[str, list[torch.Tensor]] = {k: [] for k in ("resid", "attn", "zc", "zf", "mlpf", "ans", "idx")}
    per_batch: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # (index, clean logit, patched)
    for batch in tqdm(batches, desc="path patching (runs)", disable=not progress, leave=False):
        groups = prefix_groups(prompts, batch.index)
        clean = grouped_clean_run(model, batch.tokens, groups, path_end_captures(n_layers, capture_attention))
        if cache is not None:
            cache.add(clean)
        cf = grouped_clean_run(
            model,
            batch.cf_tokens,
            groups,
            [z_hook(l) for l in range(n_layers)] + [mlp_out_hook(l) for l in range(n_layers)],
        )
        T = batch.tokens.shape[1]
        counts[T] = counts.get(T, 0) + batch.tokens.shape[0]
        for l in range(n_layers):
            s = cf.captured[z_hook(l)].float().sum(0)  # fp32 sums: the means of Zhang's knockout
            sums[z_hook(l)][T] = sums[z_hook(l)][T] + s if T in sums[z_hook(l)] else s
        if capture_attention:
            pat = torch.stack([clean.captured[f"blocks.{l}.attn.hook_pattern"].to(device) for l in range(n_layers)], 1)
            for row, i in enumerate(batch.index.tolist()):
                attention[i] = pat[row].float().cpu().clone()  # its own storage, not a view of the batch
        clean_logit = unembed.token_logits(clean.final, batch.answer_ids)
        cf_end = {k: v[:, -1] for k, v in cf.captured.items()}
        if fast:
            # END vectors of every layer, stacked on the input device (path_patch_end moves each
            # layer's slice to that layer's device)
            pooled["resid"].append(clean.resid[:, :, -1])
            pooled["attn"].append(torch.stack([clean.captured[attn_out_hook(l)].to(device) for l in range(n_layers)]))
            pooled["zc"].append(torch.stack([clean.captured[z_hook(l)].to(device) for l in range(n_layers)]))
            pooled["zf"].append(torch.stack([cf_end[z_hook(l)].to(device) for l in range(n_layers)]))
            pooled["mlpf"].append(torch.stack([cf_end[mlp_out_hook(l)].to(device) for l in range(n_layers)]))
            pooled["ans"].append(batch.answer_ids)
            pooled["idx"].append(batch.index)
            per_batch.append((batch.index, clean_logit, None))
        elif method == "fast":
            patched = path_patch_answer(model, clean, clean.captured, cf_end, senders, batch.answer_ids, unembed)
            per_batch.append((batch.index, clean_logit, patched))
        else:
            patched = path_patch_full(model, batch.tokens, batch.cf_tokens, senders, batch.answer_ids)
            per_batch.append((batch.index, clean_logit, patched))
    if fast:
        cat = {k: torch.cat(v, dim=1 if k in ("resid", "attn", "zc", "zf", "mlpf") else 0) for k, v in pooled.items()}
        patched_all = path_patch_end(
            model, cat["resid"], cat["attn"], cat["zc"], cat["zf"], cat["mlpf"], senders, cat["ans"], unembed
        )
        offsets = np.cumsum([0] + [len(b[0]) for b in per_batch])
        per_batch = [(ix, cl, patched_all[:, offsets[j] : offsets[j + 1]]) for j, (ix, cl, _) in enumerate(per_batch)]
    if any(bool((cl <= 0).any()) for _, cl, _ in per_batch):
        warnings.warn(
            "some prompts have a non-positive clean answer logit; their relative logit change is NaN "
            "(keep only correctly answered prompts in X_r)",
            stacklevel=2,
        )
    for index, clean_logit, patched in per_batch:
        effect = relative_logit_change(patched, clean_logit, strict=False)
        for row, i in enumerate(index.tolist()):
            r = prompts.records[i]
            for j, s in enumerate(senders):
                rows.append(
                    (
                        i,
                        r.op,
                        r.template_id,
                        s.label,
                        s.kind,
                        s.layer,
                        s.index if s.index is not None else -1,
                        float(clean_logit[row]),
                        float(patched[j, row]),
                        float(effect[j, row]),
                    )
                )
    effects = pd.DataFrame(
        rows,
        columns=[
            "prompt",
            "op",
            "template_id",
            "component",
            "kind",
            "layer",
            "head",
            "clean_logit",
            "patched_logit",
            "effect",
        ],
    )
    means = {h: {n: s / counts[n] for n, s in per.items()} for h, per in sums.items()}
    return PathPatchingResult(effects, attention, means, counts)


def mean_effects(effects: pd.DataFrame, by: Sequence[str] = ("op",)) -> pd.DataFrame:
    """Zhang's averaged effect per sender (mean of ``effect`` over prompts), grouped by
    ``by`` columns, with the prompt count and the standard error."""
    keys = list(by) + ["component", "kind", "layer", "head"]
    g = effects.groupby(keys)["effect"]
    out = g.agg(["mean", "std", "count"]).reset_index().rename(columns={"mean": "effect", "count": "n"})
    out["sem"] = out["std"] / np.sqrt(out["n"].clip(lower=1))
    return out.drop(columns="std")


def key_heads(mean_frame: pd.DataFrame, threshold: float = KEY_HEAD_THRESHOLD) -> pd.DataFrame:
    """Zhang's key heads: heads whose mean effect is below ``threshold`` (-5 %),
    sorted by effect (most negative first)."""
    heads = mean_frame[mean_frame["kind"] == "head"]
    return heads[heads["effect"] < threshold].sort_values("effect").reset_index(drop=True)


def stored_key_heads(table: pd.DataFrame, threshold: float = KEY_HEAD_THRESHOLD) -> pd.DataFrame:
    """The key heads notebook 01 reports, read back from its stored table
    (``01_path_patching.csv``: :func:`mean_effects` per operator plus the rows pooled
    over operators, ``op`` "all"; MLP rows have ``kind`` "mlp" and ``head`` -1):
    :func:`key_heads` of the pooled rows. Other notebooks (02) read key heads through
    this, so one rule defines them."""
    missing = {"op", "kind", "layer", "head", "effect"} - set(table.columns)
    if missing:
        raise ValueError(
            f"path-patching table lacks column(s) {sorted(missing)}; expected notebook 01's "
            "01_path_patching.csv (rerun notebook 01 to write it)"
        )
    pooled = table[table["op"].astype(str) == "all"]
    if pooled.empty:
        raise ValueError(
            "path-patching table has no rows pooled over operators (op 'all'); expected notebook "
            "01's 01_path_patching.csv (rerun notebook 01 to write it)"
        )
    return key_heads(pooled, threshold)
