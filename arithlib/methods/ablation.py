"""Ablation hooks: zero or mean-ablate attention heads and MLP neurons.

Each function returns a list of ``(hook_name, hook_fn)`` pairs for
``bridge.hooks(fwd_hooks=...)`` / ``bridge.run_with_hooks``; one hook per layer,
however many heads or neurons of that layer are ablated.

* A head's output is its slice of ``blocks.L.attn.hook_z`` ([batch, pos, head, d_head]),
  the input of W_O: zeroing it equals zeroing the head's slice of W_O, which is
  Yu & Ananiadou's head intervention (Sec. 3.2).
* A neuron's activation is ``blocks.L.mlp.hook_post`` ([batch, pos, d_mlp]), the
  coefficient m_k that scales its value vector (the k-th column of W_out); zeroing
  it removes the neuron's sub-value from the residual (Yu's "mask").
* Mean ablation (Zhang's knockout, Nikankin's faithfulness) replaces the activation
  by its mean over a reference prompt set. Prompts of different lengths have
  different positions, so means are kept per prompt length: evaluation batches
  are same-length (:meth:`PromptSet.batches`) and each hook picks the mean of its
  length. Ablating prompts whose length the reference set lacks raises a KeyError.

``position=None`` ablates every position; ``position=-1`` only the answer position.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence

import torch
from tqdm.auto import tqdm

from ..core.components import Head, Hook, Neuron, post_hook, z_hook
from ..core.prompt_sets import PromptSet
from ..engine import input_device, last_position_logits

MeanCache = dict[str, dict[int, torch.Tensor]]  # hook name -> prompt length -> mean [pos, ...]


def _by_layer(units: Iterable[tuple[int, int]]) -> dict[int, list[int]]:
    grouped: dict[int, list[int]] = defaultdict(list)
    for layer, index in units:
        grouped[int(layer)].append(int(index))
    return dict(sorted(grouped.items()))


def _positions(position: int | None) -> slice | int:
    return slice(None) if position is None else position


def _tagged(fn: Callable, position: int | None) -> Callable:
    """Mark ``fn`` as acting on every position alike (``position=None``): such a hook gives
    the same result when a prompt runs in pieces (a shared prefix, then the rest through
    the KV cache) as in one forward pass (see :func:`is_position_invariant`)."""
    fn.position_invariant = position is None
    return fn


def is_position_invariant(fn: Callable) -> bool:
    """Whether hook function ``fn`` was built here to act on every position alike (zeroing
    or keeping units with ``position=None``). False for any other hook: one at
    ``position=-1`` would also edit a shared prefix's last token, mean ablation looks its
    means up by the sequence length, and a hook of unknown make may do either."""
    return bool(getattr(fn, "position_invariant", False))


class _Index:
    """The unit indices of one hook, copied to a device once and reused: a fresh
    host-to-device copy on every hook call would make a GPU wait for the host
    (one synchronisation per hook per forward pass)."""

    def __init__(self, idx: Sequence[int]):
        self.on_device: dict[torch.device, torch.Tensor] = {}
        self.cpu = torch.tensor(list(idx), dtype=torch.long)

    def on(self, device: torch.device) -> torch.Tensor:
        if device not in self.on_device:
            self.on_device[device] = self.cpu.to(device)
        return self.on_device[device]


def zero_heads_hooks(heads: Iterable[Head], position: int | None = None) -> list[Hook]:
    """Hooks that zero the output (z, the input to W_O) of each head in ``heads``."""
    pos = _positions(position)
    hooks = []
    for layer, idx in _by_layer(heads).items():

        def fn(z, hook, idx=_Index(idx)):
            z[:, pos, idx.on(z.device)] = 0.0
            return z

        hooks.append((z_hook(layer), _tagged(fn, position)))
    return hooks


def zero_neurons_hooks(neurons: Iterable[Neuron], position: int | None = None) -> list[Hook]:
    """Hooks that zero the activation (coefficient m_k) of each MLP neuron in ``neurons``."""
    pos = _positions(position)
    hooks = []
    for layer, idx in _by_layer(neurons).items():

        def fn(act, hook, idx=_Index(idx)):
            act[:, pos, idx.on(act.device)] = 0.0
            return act

        hooks.append((post_hook(layer), _tagged(fn, position)))
    return hooks


def keep_neurons_hooks(keep: Iterable[Neuron], layers: Sequence[int], position: int | None = None) -> list[Hook]:
    """Hooks that zero every neuron of ``layers`` except those in ``keep`` (Yu's "keep")."""
    pos = _positions(position)
    kept = _by_layer(keep)
    hooks = []
    for layer in layers:

        def fn(act, hook, idx=_Index(kept.get(layer, []))):
            mask = torch.zeros(act.shape[-1], dtype=torch.bool, device=act.device)
            mask[idx.on(act.device)] = True
            act[:, pos] = act[:, pos] * mask
            return act

        hooks.append((post_hook(layer), _tagged(fn, position)))
    return hooks


@torch.no_grad()
def mean_activations(
    model, prompts: PromptSet, hook_names: Sequence[str], batch_size: int = 64, progress: bool = False
) -> MeanCache:
    """Mean of each hook's activation over ``prompts``, per prompt length:
    ``{hook: {length: tensor[length, ...]}}`` (float32, on the model's device)."""
    sums: dict[str, dict[int, torch.Tensor]] = {h: {} for h in hook_names}
    counts: dict[int, int] = defaultdict(int)
    device = input_device(model)  # token ids go to the input embedding; sums stay on each layer's device

    def make(name):
        def fn(act, hook):
            length = act.shape[1]
            total = act.float().sum(0)
            sums[name][length] = sums[name][length] + total if length in sums[name] else total
            return act

        return fn

    hooks = [(h, make(h)) for h in hook_names]
    for batch in tqdm(
        list(prompts.batches(batch_size, device)), desc="mean activations", disable=not progress, leave=False
    ):
        with model.hooks(fwd_hooks=hooks):
            last_position_logits(model, batch.tokens)
        counts[batch.tokens.shape[1]] += batch.tokens.shape[0]
    return {h: {length: s / counts[length] for length, s in per.items()} for h, per in sums.items()}


def _mean_for(means: MeanCache, name: str, act: torch.Tensor) -> torch.Tensor:
    try:
        return means[name][act.shape[1]].to(device=act.device, dtype=act.dtype)
    except KeyError:
        raise KeyError(
            f"no mean activation of {name} for prompts of length {act.shape[1]}; "
            "compute the means on a reference set with prompts of the same lengths"
        ) from None


def mean_heads_hooks(heads: Iterable[Head], means: MeanCache, position: int | None = None) -> list[Hook]:
    """Hooks replacing each head's z by its mean over the reference set (Zhang's knockout)."""
    pos = _positions(position)
    hooks = []
    for layer, idx in _by_layer(heads).items():
        name = z_hook(layer)

        def fn(z, hook, idx=_Index(idx), name=name):
            mean = _mean_for(means, name, z)
            i = idx.on(z.device)
            z[:, pos, i] = mean[pos][..., i, :]
            return z

        hooks.append((name, fn))
    return hooks


def mean_neurons_hooks(neurons: Iterable[Neuron], means: MeanCache, position: int | None = None) -> list[Hook]:
    """Hooks replacing each neuron's activation by its mean over the reference set."""
    pos = _positions(position)
    hooks = []
    for layer, idx in _by_layer(neurons).items():
        name = post_hook(layer)

        def fn(act, hook, idx=_Index(idx), name=name):
            mean = _mean_for(means, name, act)
            i = idx.on(act.device)
            act[:, pos, i] = mean[pos][..., i]
            return act

        hooks.append((name, fn))
    return hooks
