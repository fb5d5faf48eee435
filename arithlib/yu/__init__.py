"""Yu & Ananiadou 2024, "Interpreting Arithmetic Mechanism in Large Language Models through
Comparative Neuron Analysis": the head sweep (:mod:`.head_sweep`, :mod:`.head_specificity`),
Comparative Neuron Analysis (:mod:`.cna`, :mod:`.cna_norm`), mask / keep (:mod:`.mask_keep`),
the PE-DAG (:mod:`.pe_dag`), shallow neurons (:mod:`.shallow_neurons`), LoRA per layer
(:mod:`.lora`), pruning (:mod:`.pruning`) and gender-bias editing (:mod:`.bias`)."""
