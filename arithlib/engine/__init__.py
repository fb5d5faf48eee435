"""The one engine: every forward pass arithlib's methods run, and the only code that
touches the internals of transformers and TransformerLens (key/value caches, causal
masks, decoder blocks called on their own, the HF model under a bridge, devices of a
split model).

Two facts make the notebooks' passes cheap, and the engine exploits them for every
method: the few-shot prefix is shared by the rows of a batch (its keys and values are
computed once), and an intervention at position p or block L leaves every earlier
position and every lower block as it was (a pass starts there from what a clean run
recorded). The methods hold what the engine returns (logits, hidden states, recorded
runs) and never a cache they build or edit themselves.

The runs, each tested equal to the plain full pass (``tests/equivalence/``, and the
methods' fast-versus-literal tests in ``tests/unit/``):

* :func:`forward`, :func:`last_position_logits`: the plain pass, which shares nothing:
  the reference (every method, every equivalence test);
* :class:`PrefixRunner`: each distinct few-shot prefix once, gathered per row; greedy
  and teacher-forced accuracy (evaluate, probing);
* :func:`shared_prefix_logits`: the rows' common prefix once; correct-answer masks
  (answer_runs);
* :class:`AnswerPositionRunner`: every position but the last, kept per batch, with
  conditions stacked; Nikankin's neuron ablations (neurons, heuristics);
* :func:`condition_pass`, :func:`answer_pass`: the common prefix per condition, or all
  but the last position, with conditions stacked; runs under many conditions
  (answer_runs, for cna, mask_keep, shallow_neurons, bias, lora, pruning);
* :func:`clean_run` + :func:`resume`: positions before the edit and blocks below it,
  from a recorded clean run; path patching, knockouts, activation patching (patching);
  :func:`resume_rows`, each row from its own block: per-prompt neuron zeroing
  (neuron_zeroing, for mask_keep);
* :func:`keys_values_from`, :func:`cache_of`, :func:`run_from`: an ablated prefix's keys
  and values, once per head; the exact head sweep (head_sweep);
* :func:`rows_on_prefixes`: each distinct prefix and the rows on it packed into one
  sequence, and the blocks below a change (:class:`LayerInputs`), with gradients; LoRA,
  precise SFT, pruning (finetune);
* :func:`variant_passes`: weight variants that each change one block, stacked, each
  joining the pass at its block from a recorded clean run; the LoRA models (lora);
* :func:`greedy_tokens`: the growing sequence; word-problem accuracy (general_ability).

Modules:

* :mod:`.adapter`: the library internals (cache layouts, argument names, devices);
* :mod:`.passes`: whole passes, passes on a cached prefix, passes from a block, greedy decoding;
* :mod:`.prefix`: the shared-prefix batching plan, the greedy/teacher-forced runner, and
  the differentiable run of rows on their prefixes;
* :mod:`.answer`: passes that re-read the answer position on the prompts' cached
  earlier positions, several interventions stacked in one batch;
* :mod:`.recorded`: a clean run recorded (keys, values, every block's input) and the
  passes that resume from it at a position and a block (the patching fast path);
* :mod:`.streams`: residual streams recorded per batch for later passes;
* :mod:`.variants`: weight variants of one block each, run together from a clean run;
* :mod:`.gradients`: the vocabulary-sized weights' gradients (input and output embeddings) added into buffers kept for a training (full SFT);
* :mod:`.flops`: the floating-point operations a block of code dispatches, counted (a run's floor).

Methods import from ``arithlib.engine`` only what ``__all__`` lists (the cache-level
helpers stay in the submodules, for the engine and its tests);
``tests/project/test_engine_boundary.py`` fails when a module outside the engine reaches
into the libraries' internals or handles a key/value cache.
"""

from .adapter import (
    clean_param_name,
    decoder_layers,
    hf_module,
    input_device,
    layer_device,
    mlp_activation,
    module_device,
    output_device,
    shared_hf_model,
    wrapped,
)
from .answer import AnswerPositionRunner, HookFactory, answer_pass, condition_pass, shared_prefix_cache, stacked_hooks
from .flops import counted_flops, counting
from .gradients import KeptGradients, kept_gradients
from .passes import (
    cache_of,
    can_start_late,
    decoder_norm,
    forward,
    greedy_tokens,
    keys_values_from,
    last_position_logits,
    n_blocks,
    resumable,
    run_from,
    shared_prefix_logits,
)
from .prefix import PrefixRunner, common_prefix, hooks_attached, prefix_batches, rows_on_prefixes
from .recorded import (
    CleanRun,
    RunCache,
    capture_hooks,
    clean_run,
    grouped_clean_run,
    prefix_groups,
    resume,
    resume_rows,
)
from .streams import LayerInputs
from .variants import check_variants, variant_passes

__all__ = [
    "AnswerPositionRunner",
    "CleanRun",
    "HookFactory",
    "LayerInputs",
    "PrefixRunner",
    "KeptGradients",
    "RunCache",
    "answer_pass",
    "cache_of",
    "can_start_late",
    "capture_hooks",
    "check_variants",
    "clean_param_name",
    "clean_run",
    "common_prefix",
    "condition_pass",
    "counted_flops",
    "counting",
    "decoder_layers",
    "decoder_norm",
    "forward",
    "greedy_tokens",
    "grouped_clean_run",
    "hf_module",
    "kept_gradients",
    "hooks_attached",
    "input_device",
    "keys_values_from",
    "last_position_logits",
    "layer_device",
    "mlp_activation",
    "module_device",
    "n_blocks",
    "output_device",
    "prefix_batches",
    "prefix_groups",
    "resumable",
    "resume",
    "resume_rows",
    "rows_on_prefixes",
    "run_from",
    "shared_hf_model",
    "shared_prefix_cache",
    "shared_prefix_logits",
    "stacked_hooks",
    "variant_passes",
    "wrapped",
]
