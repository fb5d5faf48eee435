"""What the methods name and intervene on: one definition each, imported everywhere.

A head is ``(layer, head)``, an FFN neuron ``(layer, neuron index)`` and a hook a
TransformerLens ``(hook name, function)`` pair, as ``run_with_hooks`` takes them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

#: An attention head: (layer, head index within the layer).
Head = tuple[int, int]
#: An FFN (MLP) neuron: (layer, neuron index within the layer's hidden units).
Neuron = tuple[int, int]
#: A TransformerLens forward hook: (hook point name, function(activation, hook)).
Hook = tuple[str, Callable]
#: Hooks per batch: a function of the batch's row indices (into the PromptSet) -> hooks.
RowHooks = Callable[["torch.Tensor"], list[Hook]]


def z_hook(layer: int) -> str:
    """The hook of the heads' outputs before W_O (``hook_z``, [B, T, H, d_head])."""
    return f"blocks.{layer}.attn.hook_z"


def post_hook(layer: int) -> str:
    """The hook of the MLP's hidden units after the activation (``hook_post``, [B, T, d_mlp])."""
    return f"blocks.{layer}.mlp.hook_post"


def mlp_out_hook(layer: int) -> str:
    """The hook of the MLP's output (``hook_mlp_out``, [B, T, d_model])."""
    return f"blocks.{layer}.hook_mlp_out"


def attn_out_hook(layer: int) -> str:
    """The hook of the attention block's output (``hook_attn_out``, [B, T, d_model])."""
    return f"blocks.{layer}.hook_attn_out"
