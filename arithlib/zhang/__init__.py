"""Zhang et al. 2024, "Interpreting and Improving Large Language Models in Arithmetic
Calculation": path patching (:mod:`.path_patching`), the transfer prompt sets
(:mod:`.transfer_sets`), the MLPs read through the unembedding (:mod:`.mlp_curves`, on the
answer-position cache of :mod:`.answer_cache`) with the logit lens (:mod:`.lens`) and linear
probes (:mod:`.probing`), and precise SFT of the key heads (:mod:`.sft`). Their knockouts
are shared with Yu's head sweep: :mod:`arithlib.methods.knockouts`."""
