"""Nikankin et al. 2025, "Arithmetic Without Algorithms: Language Models Solve Math with a Bag
of Heuristics": the circuit by activation patching (:mod:`.activation_patching`) and its
faithfulness checks (:mod:`.faithfulness_checks`), the heuristic neurons (:mod:`.heuristics`,
with their grids, nulls and training dynamics), found per operator (:mod:`.operator_analysis`),
their ablation (:mod:`.heuristic_ablation`) and the prompt-level knockouts
(:mod:`.prompt_knockout`). The neuron-level runs they build on are shared with Yu's CNA:
:mod:`arithlib.methods.neurons`."""
