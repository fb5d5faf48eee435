"""MLP keys and the parameter-enhancement DAG of Yu & Ananiadou 2024 (Sec. 4.3, Fig. 5): how
much a shallow neuron's value vector raises a deep neuron's coefficient (its effective
key), per case.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd
import torch
from tqdm.auto import tqdm

from ..core.papers import DAG_EDGE_MIN_ENHANCEMENT
from ..engine import layer_device, mlp_activation, wrapped
from ..methods.neurons import value_vectors, w_out
from .cna import CNAResult
from .mask_keep import N_RANDOM_SEEDS, control_seed


def _mlp_ln(model, layer: int):
    block = model.blocks[layer]
    if getattr(model.cfg, "parallel_attn_mlp", False):
        raise NotImplementedError("MLP keys are defined here for sequential blocks (Llama/Qwen/Mistral/GPT-2)")
    return block.ln2


def mlp_coefficients(model, layer: int, resid_mid: torch.Tensor) -> torch.Tensor:
    """Coefficients m [R, d_mlp] of layer ``layer``'s MLP for residual inputs ``resid_mid``
    [R, d] (its own ln2 and MLP modules, gated or not); differentiable."""
    store = {}

    def grab(act, hook):
        store["m"] = act
        return act

    p = next(model.parameters())
    x = resid_mid.to(device=layer_device(model, layer), dtype=p.dtype)
    with model.hooks(fwd_hooks=[(f"blocks.{layer}.mlp.hook_post", grab)]):
        model.blocks[layer].mlp(_mlp_ln(model, layer)(x[:, None, :]))
    return store["m"][:, 0].float()


def neuron_coefficients(model, layer: int, neurons: Sequence[int], resid_mid: torch.Tensor) -> torch.Tensor:
    """The coefficients [R, n] of ``neurons`` of layer ``layer``'s MLP alone, from their own
    weight rows: with h = ln2(x), m_k = act(h . W_gate[:, k] + b_gate[k]) * (h . W_in[:, k] +
    b_in[k]) for a gated MLP, act(h . W_in[:, k] + b_in[k]) otherwise. Equal to
    ``mlp_coefficients(...)[:, neurons]`` (tested) at 2 d_model multiply-adds per neuron and
    row for the up and gate rows, instead of the whole MLP's 3 d_model d_mlp; differentiable."""
    p = next(model.parameters())
    x = resid_mid.to(device=layer_device(model, layer), dtype=p.dtype)
    h = _mlp_ln(model, layer)(x[:, None, :])[:, 0]
    mlp = model.blocks[layer].mlp
    idx = torch.as_tensor(list(neurons), dtype=torch.long, device=h.device)

    def rows(kind: str) -> torch.Tensor:
        out = h @ getattr(mlp, f"W_{kind}")[:, idx].to(h.device)
        bias = getattr(mlp, f"b_{kind}", None)
        return out + bias[idx].to(h.device) if bias is not None else out

    act = mlp_activation(model, layer)
    up = rows("in")
    m = act(rows("gate")) * up if getattr(model.cfg, "gated_mlp", False) else act(up)
    return m.float()


def effective_key(model, layer: int, neuron: int, resid_mid: torch.Tensor) -> torch.Tensor:
    """The key of a neuron at a given input: d m_k / d x at ``resid_mid`` [d] (through ln2
    and the gate and up projections). For a ReLU/GELU MLP this is sigma'(.) times the
    fc1 row seen through the norm; for SwiGLU it mixes the gate and up rows by the
    current activations, which is why a gated neuron has no single fixed key."""
    x = resid_mid.detach().float().clone().requires_grad_(True)
    with torch.enable_grad():
        m = mlp_coefficients(model, layer, x[None])[0, neuron]
        (grad,) = torch.autograd.grad(m, x)
    return grad.detach()


def static_keys(model, layer: int, neurons: Sequence[int]) -> dict[str, torch.Tensor]:
    """Fixed key vectors [n, d] of ``neurons``: ``"in"`` = ln2 weight * W_in row (the up
    projection, fc1 of a non-gated MLP) and, for gated MLPs, ``"gate"`` = ln2 weight *
    W_gate row."""
    g = _mlp_ln(model, layer)
    g = wrapped(g).weight.detach().float()
    mlp = model.blocks[layer].mlp  # one layer's weights (the bridge's W_in / W_gate stack every layer)
    keys = {"in": (mlp.W_in.detach().float()[:, list(neurons)].T * g)}
    if getattr(model.cfg, "gated_mlp", False):
        keys["gate"] = mlp.W_gate.detach().float()[:, list(neurons)].T * g
    return keys


@torch.no_grad()
def pe_dag(
    model, result: CNAResult, case: int, k: int = 10, min_enhancement: float = DAG_EDGE_MIN_ENHANCEMENT
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The prediction-enhancing DAG among case ``case``'s top-``k`` neurons (Sec. 4.3).

    For each pair lower (layer l1) -> upper (l2 > l1): the inner products of the lower
    value fc2 with the upper neuron's static keys (W_gate and W_in rows times the ln2
    weight; also as a percentile among all neurons of layer l2), and the direct
    enhancement: the relative drop of the upper coefficient when the lower neuron's
    sub-value m fc2 is removed from the upper layer's input, recomputed exactly through
    ln2 and the upper neuron's gate and up rows (:func:`neuron_coefficients`; direct path only). ``edge`` marks enhancement >= ``min_enhancement``.
    Returns (nodes, edges)."""
    top = result.top(case, k)
    change = result.change_of(case)
    nodes = pd.DataFrame(
        [
            {
                "layer": l,
                "neuron": n,
                "name": f"{l}_{n}",
                "imp": float(result.importance_a[case, l, n]),
                "change": float(change[l, n]),
                "coef": float(result.coef_a[case, l, n]),
            }
            for l, n in top
        ]
    )
    edges = []
    resid = result.run_a.resid_mid[case]
    for l2, n2 in top:
        lower = [(l1, n1) for l1, n1 in top if l1 < l2]
        if not lower:
            continue
        x = resid[l2].to(layer_device(model, l2))
        m2 = neuron_coefficients(model, l2, [n2], x[None])[0, 0]
        keys_all = static_keys(model, l2, range(model.cfg.d_mlp))
        for l1, n1 in lower:
            v = w_out(model, l1)[n1].to(x.device)
            m1 = result.coef_a[case, l1, n1].to(v.device)
            m2_without = neuron_coefficients(model, l2, [n2], (x - m1 * v)[None])[0, 0]
            row = {
                "lower": f"{l1}_{n1}",
                "upper": f"{l2}_{n2}",
                "lower_layer": l1,
                "upper_layer": l2,
                "coef_upper": float(m2),
                "coef_upper_without_lower": float(m2_without),
                "enhancement": float(torch.sign(m2) * (m2 - m2_without) / m2.abs().clamp_min(1e-8)),
            }
            for kind, keys in keys_all.items():
                dots = keys @ v
                row[f"dot_{kind}"] = float(dots[n2])
                row[f"dot_{kind}_pct"] = float(100 * (dots.abs() < dots[n2].abs()).float().mean())
            row["edge"] = row["enhancement"] >= min_enhancement
            edges.append(row)
    return nodes, pd.DataFrame(edges)


@torch.no_grad()
def pe_dag_cases(
    model,
    result: CNAResult,
    k: int = 10,
    *,
    min_enhancement: float = DAG_EDGE_MIN_ENHANCEMENT,
    seed: int = 0,
    n_seeds: int = N_RANDOM_SEEDS,
    progress: bool = True,
) -> pd.DataFrame:
    """The PE-DAG test of :func:`pe_dag` on every case of ``result`` (Sec. 4.3 asks
    whether prediction enhancing holds beyond "3+5="): for each case and each pair of
    its top-``k`` neurons lower (layer l1) -> upper (l2 > l1), the direct enhancement
    (relative drop of the upper coefficient when the lower neuron's sub-value m fc2 is
    removed from the upper layer's input, exact through ln2 and the MLP). Control, for
    each of ``n_seeds`` draws: the same with a random neuron of layer l1 that is not
    among the case's top-``k`` (its own coefficient in run a) in place of the lower one.

    One row per (case, draw): case, kind ("top" or "random"), seed, n_pairs, n_edges
    (enhancement >= ``min_enhancement``), share_edges, mean_enhancement."""
    cfg = model.cfg
    rows = []
    values: dict[int, torch.Tensor] = {}  # W_out per lower layer, read once (value_vectors' cache)
    for case in tqdm(range(len(result)), desc="PE-DAG on every case", disable=not progress, leave=False):
        top = result.top(case, k)
        taken = set(top)
        rng = np.random.default_rng(control_seed(seed, case, k, 3))
        resid = result.run_a.resid_mid[case]
        coef = result.coef_a[case]
        enh: dict[str, list[float]] = {"top": [], **{f"random|{s}": [] for s in range(n_seeds)}}
        for l2, n2 in top:
            lower = [(l1, n1) for l1, n1 in top if l1 < l2]
            if not lower:
                continue
            subs = [lower]
            for _ in range(n_seeds):
                draw = []
                for l1, _n in lower:
                    while True:
                        cand = (l1, int(rng.integers(cfg.d_mlp)))
                        if cand not in taken:
                            draw.append(cand)
                            break
                subs.append(draw)
            flat = [nr for draw in subs for nr in draw]
            device = layer_device(model, l2)
            vecs = value_vectors(model, flat, values)
            lay, idx = torch.tensor(flat).T
            vals = (vecs * coef[lay, idx].to(vecs.device)[:, None]).to(device)  # the sub-values m fc2
            x = resid[l2].to(device)
            m = neuron_coefficients(model, l2, [n2], torch.cat([x[None], x[None] - vals]))[:, 0]
            m2, without = m[0], m[1:]
            e = (torch.sign(m2) * (m2 - without) / m2.abs().clamp_min(1e-8)).cpu().view(len(subs), len(lower))
            enh["top"] += e[0].tolist()
            for s in range(n_seeds):
                enh[f"random|{s}"] += e[1 + s].tolist()
        for name, vals_ in enh.items():
            kind, _, s = name.partition("|")
            v = np.asarray(vals_, dtype=float)
            rows.append(
                {
                    "case": case,
                    "kind": kind,
                    "seed": int(s) if s else float("nan"),
                    "n_pairs": len(v),
                    "n_edges": int((v >= min_enhancement).sum()),
                    "share_edges": float((v >= min_enhancement).mean()) if len(v) else float("nan"),
                    "mean_enhancement": float(v.mean()) if len(v) else float("nan"),
                }
            )
    return pd.DataFrame(rows)
