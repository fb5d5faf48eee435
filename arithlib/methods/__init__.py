"""Methods shared by two or more papers: ablation and patching, head knockouts, runs at the
answer position under interventions, neuron-level analysis, fine-tuning and the evaluation of
general ability. A method one paper alone uses lives in that paper's package."""
