"""What the methods name and intervene on: one definition each, imported everywhere.

A head is ``(layer, head)``, an FFN neuron ``(layer, neuron index)`` and a hook a
TransformerLens ``(hook name, function)`` pair, as ``run_with_hooks`` takes them.
"""

from __future__ import annotations

from typing import Callable

#: An attention head: (layer, head index within the layer).
Head = tuple[int, int]
#: An FFN (MLP) neuron: (layer, neuron index within the layer's hidden units).
Neuron = tuple[int, int]
#: A TransformerLens forward hook: (hook point name, function(activation, hook)).
Hook = tuple[str, Callable]
