"""Logit lens and direct logit attribution at the answer position.

Both read the activations that :func:`arithlib.zhang.answer_cache.cache_answer_position` keeps
(the last token only), so no position other than the answer's is ever unembedded.

* :func:`logit_lens_answer`: rank and probability of the correct first answer token
  when the residual stream after each layer is read through the model's final norm and
  unembedding (nostalgebraist's logit lens). It uses TransformerLens's
  ``tools.analysis.logit_lens.logit_readout`` (which works on a ``TransformerBridge``:
  it applies the bridge's own ``ln_final`` with recomputed statistics, ``W_U`` and
  ``b_U``). TransformerLens's ``logit_lens`` itself is not called: it runs
  ``run_with_cache`` and unembeds every position of the prompt to check its readout;
  here only the answer position is needed, and it is already cached.
* :func:`direct_logit_attribution_answer`: the direct contribution of the embedding,
  each attention sublayer and each MLP to the answer logit, with the final norm's scale
  frozen at its value on the prompt (the usual DLA linearisation). Written here
  because TransformerLens's ``direct_logit_attribution`` refuses a bridge that is not in
  compatibility mode with the final norm folded into W_U (``enable_compatibility_mode``
  rewrites the weights of the shared bridge every other analysis uses), and it runs
  ``run_with_cache`` over all positions. The components here sum exactly to the model's
  answer logit (tested).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd
import torch

from ..core.prompt_sets import PromptSet
from ..core.readout import final_norm, unembedding
from .answer_cache import AnswerCache


def _meta(prompts: PromptSet) -> pd.DataFrame:
    recs = prompts.records
    return pd.DataFrame(
        {
            "prompt": np.arange(len(recs)),
            "op": [r.op for r in recs],
            "template_id": [r.template_id for r in recs],
            "answer": [r.answer for r in recs],
        }
    )


def lens_stack(cache: AnswerCache) -> tuple[torch.Tensor, list[int]]:
    """The residual stream at the answer position before the first block (the
    embedding, layer -1) and after every block: [N, 1 + n_layers, d_model], with layers."""
    for kind in ("resid_pre", "resid_post"):
        if kind not in cache.acts:
            raise ValueError(f"the logit lens needs {kind!r} in the cache")
    stack = torch.cat([cache.acts["resid_pre"][:, :1], cache.acts["resid_post"]], dim=1)
    return stack, list(range(-1, cache.n_layers))


def logit_lens_answer(bridge, cache: AnswerCache, prompts: PromptSet, chunk_size: int = 64) -> pd.DataFrame:
    """Logit lens at the answer position: for every prompt and every layer (-1 = the
    embedding), the log-probability, probability and rank (0 = top prediction, over
    the full vocabulary) of the first answer token when the residual stream there is
    read through the final norm and unembedding. The last layer reproduces the model's
    own output. Columns ``prompt, op, template_id, answer, layer, logprob, prob, rank``.
    """
    from transformer_lens.tools.analysis.logit_lens import logit_readout

    if len(cache) != len(prompts):
        raise ValueError(f"cache has {len(cache)} rows, prompts {len(prompts)}")
    stack, layers = lens_stack(cache)
    param = next(bridge.parameters())
    targets = prompts.first_answer_ids[:, None].to(param.device)
    readout = logit_readout(
        bridge,
        stack.to(device=param.device, dtype=param.dtype),
        targets=targets,
        return_type="log_probs",
        chunk_size=chunk_size,
    )
    logprob = readout.values[..., 0].float().cpu()  # [N, L+1]
    rank = readout.target_ranks[..., 0].cpu()
    n, m = logprob.shape
    frame = pd.DataFrame(
        {
            "prompt": np.repeat(np.arange(n), m),
            "layer": np.tile(layers, n),
            "logprob": logprob.reshape(-1).numpy(),
            "rank": rank.reshape(-1).numpy(),
        }
    )
    frame["prob"] = np.exp(frame["logprob"])
    return frame.merge(_meta(prompts), on="prompt")[
        ["prompt", "op", "template_id", "answer", "layer", "logprob", "prob", "rank"]
    ]


def direct_logit_attribution_answer(bridge, cache: AnswerCache, prompts: PromptSet) -> pd.DataFrame:
    """Direct logit attribution to the first answer token at the answer position.

    The final residual stream is the sum of the embedding, every attention output and
    every MLP output; with the final norm's scale s frozen at its value on the prompt,
    component c contributes ``(w * center(c) / s) . W_U[:, C]`` to the answer logit
    (``center`` subtracts the mean for LayerNorm, is the identity for RMSNorm; w is the
    norm's weight). The ``bias`` row holds what no component writes (the norm's bias
    through W_U and ``b_U``), so each prompt's contributions sum to its logit.
    Columns ``prompt, op, template_id, answer, layer, component, dla`` with component
    in {"embed", "attn", "mlp", "bias"} (embed and bias at layer -1).
    """
    for kind in ("resid_pre", "attn_out", "mlp_out"):
        if kind not in cache.acts:
            raise ValueError(f"direct logit attribution needs {kind!r} in the cache")
    if len(cache) != len(prompts):
        raise ValueError(f"cache has {len(cache)} rows, prompts {len(prompts)}")
    norm = final_norm(bridge)
    w = norm.weight.cpu()
    b = norm.bias.cpu() if norm.bias is not None else None
    W_U, b_U = (x.cpu() for x in unembedding(bridge))
    t = prompts.first_answer_ids
    directions = W_U[:, t].T * w[None, :]  # [N, d]
    s = cache.final_scale[:, None]  # [N, 1]

    def contrib(x: torch.Tensor) -> torch.Tensor:  # x [N, ..., d]
        if norm.kind == "layer":
            x = x - x.mean(-1, keepdim=True)
        shape = (x.shape[0],) + (1,) * (x.ndim - 2) + (x.shape[-1],)
        return ((x / s.reshape((x.shape[0],) + (1,) * (x.ndim - 1))) * directions.reshape(shape)).sum(-1)

    embed = contrib(cache.acts["resid_pre"][:, 0])  # [N]
    attn = contrib(cache.acts["attn_out"])  # [N, L]
    mlp = contrib(cache.acts["mlp_out"])
    bias = b_U[t]
    if b is not None:
        bias = bias + W_U[:, t].T @ b
    n, n_layers = attn.shape
    parts = [
        pd.DataFrame({"prompt": np.arange(n), "layer": -1, "component": "embed", "dla": embed.numpy()}),
        pd.DataFrame(
            {"prompt": np.arange(n), "layer": -1, "component": "bias", "dla": torch.as_tensor(bias).float().numpy()}
        ),
        pd.DataFrame(
            {
                "prompt": np.repeat(np.arange(n), n_layers),
                "layer": np.tile(np.arange(n_layers), n),
                "component": "attn",
                "dla": attn.reshape(-1).numpy(),
            }
        ),
        pd.DataFrame(
            {
                "prompt": np.repeat(np.arange(n), n_layers),
                "layer": np.tile(np.arange(n_layers), n),
                "component": "mlp",
                "dla": mlp.reshape(-1).numpy(),
            }
        ),
    ]
    frame = pd.concat(parts, ignore_index=True)
    return frame.merge(_meta(prompts), on="prompt")[
        ["prompt", "op", "template_id", "answer", "layer", "component", "dla"]
    ]


def dla_reconstruction_error(dla: pd.DataFrame, cache: AnswerCache) -> float:
    """Largest |sum of a prompt's DLA contributions - its answer logit| (should be ~0)."""
    total = dla.groupby("prompt")["dla"].sum().sort_index().to_numpy()
    return float(np.abs(total - cache.answer_logit.numpy()[: len(total)]).max())


def lens_summary(lens: pd.DataFrame, by: Sequence[str] = ("layer",)) -> pd.DataFrame:
    """Per layer: mean and median rank of the answer, share of prompts where it is the
    top prediction (rank 0) or in the top 10, and mean probability."""
    g = lens.groupby(list(by))
    out = g.agg(
        mean_rank=("rank", "mean"), median_rank=("rank", "median"), mean_prob=("prob", "mean"), n=("rank", "size")
    ).reset_index()
    out["top1"] = g["rank"].apply(lambda r: float((r == 0).mean())).to_numpy()
    out["top10"] = g["rank"].apply(lambda r: float((r < 10).mean())).to_numpy()
    return out


def first_layer_reaching(summary: pd.DataFrame, column: str, threshold: float) -> int | None:
    """First layer (of a :func:`lens_summary`-like frame sorted by layer) whose
    ``column`` is at least ``threshold`` and stays so to the last layer; None if never."""
    s = summary.sort_values("layer")
    layers, vals = s["layer"].tolist(), s[column].to_numpy()
    first = None
    for layer, v in zip(reversed(layers), vals[::-1]):
        if v >= threshold:
            first = int(layer)
        else:
            break
    return first
