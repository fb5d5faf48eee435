"""Zhang et al. 2024, "Interpreting and Improving Large Language Models in Arithmetic
Calculation": path patching (:mod:`.path_patching`), the transfer prompt sets
(:mod:`.transfer_sets`), MLP probing (:mod:`.probing`) with the logit lens (:mod:`.lens`),
and precise SFT of the key heads (:mod:`.sft`). Their knockouts are shared with Yu's head
sweep: :mod:`arithlib.methods.knockouts`."""
