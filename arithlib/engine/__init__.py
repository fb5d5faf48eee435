"""The one engine: every forward pass arithlib's methods run, and the only code that
touches the internals of transformers and TransformerLens (key/value caches, causal
masks, decoder blocks called on their own, the HF model under a bridge, devices of a
split model).

Two facts make the notebooks' passes cheap, and the engine exploits them once for every
method: the few-shot prefix is shared by the rows of a batch (its keys and values are
computed once, :func:`prefix_cache`, :class:`PrefixRunner`), and an intervention at
block L leaves the stream below L as it was (a pass starts at block L from the recorded
stream, :func:`run_blocks`, :class:`LayerInputs`). Each fast pass is tested equal to
the plain full pass (``tests/equivalence/test_engine_*.py`` and the methods' equivalence tests).

Modules:

* :mod:`.adapter`: the library internals (cache layouts, argument names, devices);
* :mod:`.passes`: whole passes, passes on a cached prefix, passes from a block;
* :mod:`.prefix`: the shared-prefix batching plan and the greedy/teacher-forced runner;
* :mod:`.answer`: passes that re-read the answer position on the prompts' cached
  earlier positions, several interventions stacked in one batch;
* :mod:`.recorded`: a clean run recorded (keys, values, every block's input) and the
  passes that resume from it at a position and a block (the patching fast path);
* :mod:`.streams`: residual streams recorded per batch for later passes.

Methods import from ``arithlib.engine`` only what is listed in ``__all__``;
``tests/project/test_engine_boundary.py`` fails when a module outside the engine reaches into
the libraries' internals.
"""

from .adapter import (cache_layers, clean_param_name, decoder_layers, filled_cache_layers, fix_bridge_cache, hf_module, input_device,
                      layer_device, module_device, output_device, repeat_cache, repeat_rows_, select_cache_rows, send,
                      shared_hf_model, truncate_cache, wrapped)
from .answer import (AnswerPositionRunner, HookFactory, answer_pass, condition_pass, shared_prefix_cache,
                     stacked_hooks)
from .passes import (Pass, cache_of, can_start_late, decoder_norm, decoder_pass, empty_cache, forward, greedy_tokens, keys_values_from, last_position_logits,
                     n_blocks, prefix_cache,
                     resumable, run_blocks, run_decoder, run_from, shared_prefix_logits)
from .prefix import MIN_SHARED_PREFIX, PrefixRunner, common_prefix, hooks_attached, padded, prefix_batches, rows_on_prefixes
from .recorded import (MIN_SAVED_POSITIONS, CleanRun, RunCache, capture_hooks, clean_run, grouped_clean_run, prefix_groups,
                       resume)
from .streams import LayerInputs

__all__ = [
    "AnswerPositionRunner", "HookFactory", "answer_pass", "condition_pass", "shared_prefix_cache", "stacked_hooks",
    "CleanRun", "LayerInputs", "MIN_SAVED_POSITIONS", "RunCache", "capture_hooks", "clean_run", "grouped_clean_run",
    "prefix_groups", "resume", "cache_of", "keys_values_from", "run_from", "padded", "rows_on_prefixes", "MIN_SHARED_PREFIX", "Pass", "PrefixRunner", "cache_layers", "can_start_late", "clean_param_name",
    "common_prefix", "decoder_layers", "decoder_norm", "decoder_pass", "empty_cache", "filled_cache_layers", "fix_bridge_cache",
    "forward", "greedy_tokens", "hf_module", "hooks_attached", "input_device", "last_position_logits", "layer_device", "module_device", "n_blocks",
    "output_device", "prefix_batches", "prefix_cache", "repeat_cache", "repeat_rows_", "resumable", "run_blocks", "run_decoder",
    "select_cache_rows", "send", "shared_prefix_logits", "shared_hf_model", "truncate_cache", "wrapped",
]
