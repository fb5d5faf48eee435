"""The core every method stands on: models (loading, devices, the toy model and its weights),
the model's components, the prompt sets and where their tokens sit, evaluation, metrics,
statistics, the model's readout and the three papers' published numbers (:mod:`.papers`).

Modules are imported by name (``from arithlib.core import datasets``); this package imports
none of them, so importing one module loads only what it needs."""
