"""The forward passes every method runs: a whole pass, a pass on top of a shared prefix's
keys and values, and a pass that starts at a decoder block from a recorded stream.

Each is the HF model's own computation (its decoder, its blocks, its mask and rotary
embeddings), so bridge hooks attached with ``bridge.hooks(...)`` act in all of them and
a pass that starts late equals the full pass when given the full pass's stream (tested
in ``tests/equivalence/test_engine_*.py``). Why not TransformerLens's ``run_with_cache``: it runs
every prompt from the embeddings and has no pass that starts at a block or reuses a
prefix's keys and values, which is where the CPU time of notebooks 01-08 goes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple

import torch

from .adapter import (
    cache_kwargs,
    cache_layers,
    causal_mask,
    decoder_layers,
    hf_module,
    layer_device,
    module_device,
    new_cache,
    output_cache,
    repeat_rows_,
    run_block,
    send,
)


class Pass(NamedTuple):
    """A forward pass's logits ([B, kept positions, vocab]) and key/value cache (None
    when the pass kept none)."""

    logits: torch.Tensor
    cache: object | None


def n_blocks(model) -> int:
    """The number of decoder blocks of ``model`` (a bridge or an HF model)."""
    return len(decoder_layers(model))


def resumable(model) -> bool:
    """Whether a pass can start at any block from the residual stream entering it:
    Llama-style decoders (``layers``, ``rotary_emb``, ``norm``) with full attention in
    every layer. Others (GPT-2, GPT-J, GPT-NeoX) always run from the embeddings."""
    hf = hf_module(model)
    base = hf.base_model
    cfg = hf.config
    if not all(hasattr(base, a) for a in ("layers", "rotary_emb", "norm")):
        return False
    if getattr(base, "has_sliding_layers", False):
        return False
    types = getattr(cfg, "layer_types", None) or ["full_attention"]
    return all(t == "full_attention" for t in types)


def can_start_late(hf) -> bool:
    """Whether a pass of ``hf`` may start at a recorded block: :func:`resumable`, and its
    blocks deterministic (in training mode no dropout anywhere: a recorded stream
    would otherwise stand for one draw)."""
    if not resumable(hf):
        return False
    if not hf.training:
        return True
    drop = [m.p for m in hf.modules() if isinstance(m, torch.nn.Dropout)]
    return all(p == 0 for p in drop) and not getattr(hf.config, "attention_dropout", 0.0)


# --------------------------------------------------------------------------- whole passes


def forward(
    model, tokens: torch.Tensor, *, cache=None, keep: int | None = None, keep_cache: bool | None = None
) -> Pass:
    """The causal LM on ``tokens`` [B, t] after ``cache``'s positions (which the pass
    extends in place); logits at the last ``keep`` positions (all when None). The
    returned cache is kept when ``keep_cache`` (default: when a cache was given)."""
    use = cache is not None if keep_cache is None else keep_cache
    kwargs = {} if keep is None else {"logits_to_keep": keep}
    out = hf_module(model)(tokens, use_cache=use, **kwargs, **cache_kwargs(cache))
    return Pass(out.logits, output_cache(out) if use else None)


def last_position_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    """Logits at the last position, [B, vocab], in float32, from one pass of ``model``
    (a bridge: its hooks act as in any call of it; or an HF model)."""
    out = model(tokens, logits_to_keep=1)
    logits = out.logits if hasattr(out, "logits") else out
    return logits[:, -1, :].float()


def prefix_cache(model, prefix: torch.Tensor, rows: int):
    """Keys and values of ``prefix`` [P, n] (one pass, bridge hooks active) with each of
    its rows repeated ``rows`` times in a row: rows ``p*rows .. (p+1)*rows - 1`` hold
    prefix row ``p``. A one-row prefix so serves a batch of ``rows`` prompts. The decoder
    only (:func:`decoder_pass`): no logits are wanted, and unembedding even one position
    reads the whole vocabulary matrix (``benchmarks/cache_pass.py``)."""
    return repeat_rows_(decoder_pass(model, prefix)[1], rows)


def greedy_tokens(model, tokens: torch.Tensor) -> Iterator[torch.Tensor]:
    """Greedy decoding of ``tokens`` [B, T]: yields each next token [B] in turn (argmax of
    the logits), feeding it back on the growing KV cache; the caller stops it."""
    out = forward(model, tokens, keep_cache=True)
    past, nxt = out.cache, out.logits[:, -1].argmax(-1)
    while True:
        yield nxt
        out = forward(model, nxt[:, None], cache=past)
        past, nxt = out.cache, out.logits[:, -1].argmax(-1)


def shared_prefix_logits(model, tokens: torch.Tensor, shared: int, keep: int) -> torch.Tensor:
    """Logits at the last ``keep`` positions of ``tokens`` [B, T] whose first ``shared``
    positions are common to every row: those run once at batch 1 and are reused through
    the KV cache (0: one plain pass). Equal to a plain pass up to float rounding."""
    if shared > 0:
        cache = prefix_cache(model, tokens[:1, :shared], tokens.shape[0])
        return forward(model, tokens[:, shared:], cache=cache, keep=keep).logits
    return forward(model, tokens, keep=keep).logits


def empty_cache(model, layers: Sequence[tuple[torch.Tensor, torch.Tensor] | None] = ()):
    """A key/value cache for ``model`` holding ``layers[l]`` = (keys, values) in layer
    ``l`` ([B, kv_heads, T, d_head]; None leaves the layer empty)."""
    return new_cache(hf_module(model).config, layers)


def decoder_pass(model, tokens: torch.Tensor, *, cache=None) -> tuple[torch.Tensor, object]:
    """The decoder (no unembedding) on ``tokens`` [B, t] after ``cache``'s positions:
    the final-normed hidden states [B, t, d_model] and the extended cache."""
    out = hf_module(model).base_model(input_ids=tokens, use_cache=True, **cache_kwargs(cache))
    return out.last_hidden_state, output_cache(out)


# --------------------------------------------------------------------------- passes from a block


def decoder_norm(model, hidden: torch.Tensor) -> torch.Tensor:
    """The decoder's final norm of ``hidden`` (on the norm's device)."""
    hf = hf_module(model)
    norm = hf.get_decoder().norm
    return norm(send(hidden, module_device(hf, norm)))


def run_blocks(
    model,
    hidden: torch.Tensor,
    *,
    first: int,
    position_ids: torch.Tensor,
    cache=None,
    keep_cache: bool = True,
    attention_mask: torch.Tensor | None = None,
    record: Sequence[int] = (),
    join: Callable[[int, torch.device], torch.Tensor | None] | None = None,
) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """Decoder blocks ``first..L-1`` on ``hidden`` [R, t, d] (the stream entering block
    ``first``) at ``position_ids`` after ``cache``'s keys and values (extended in place
    when ``keep_cache``), as the decoder's own forward loops over them: the same rotary
    embeddings, causal mask and block calls. ``join(l, device)`` may return rows that
    join the batch at block ``l`` (appended after the current rows); the mask is
    rebuilt when the row count changes. Returns the last block's output (not normed) and
    the streams entering the blocks in ``record``."""
    hf = hf_module(model)
    decoder = hf.get_decoder()
    captured: dict[int, torch.Tensor] = {}
    pos_emb = decoder.rotary_emb(hidden, position_ids)
    mask, mask_rows = None, -1
    for l in range(first, len(decoder.layers)):
        d = layer_device(hf, l)  # a split model: stream, mask and positions follow the blocks
        hidden, mask, pos_emb, position_ids = send((hidden, mask, pos_emb, position_ids), d)
        extra = join(l, d) if join is not None else None
        if extra is not None:
            hidden = torch.cat([hidden, extra])
        if hidden.shape[0] != mask_rows:
            mask = causal_mask(hf.config, hidden, cache, position_ids, l, attention_mask=attention_mask)
            mask_rows = hidden.shape[0]
        if l in record:
            captured[l] = hidden
        hidden = run_block(
            decoder.layers[l],
            hidden,
            mask=mask,
            position_embeddings=pos_emb,
            position_ids=position_ids,
            cache=cache,
            use_cache=keep_cache,
        )
    return hidden, captured


def run_from(model, hidden: torch.Tensor, first: int, start: int = 0, cache=None) -> torch.Tensor:
    """:func:`run_blocks` from block ``first`` on ``hidden`` [R, t, d] at positions
    ``start..start+t-1`` after ``cache``'s keys and values (which the blocks extend); the
    last block's output."""
    position_ids = torch.arange(start, start + hidden.shape[1], device=hidden.device).unsqueeze(0)
    return run_blocks(model, hidden, first=first, position_ids=position_ids, cache=cache)[0]


def keys_values_from(model, hidden: torch.Tensor, first: int) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
    """Each block's keys and values for ``hidden`` [R, t, d] (positions ``0..t-1``, the
    stream entering block ``first``) run through blocks ``first..L-1``; None below
    ``first``. For :func:`cache_of` (e.g. a prefix computed once under an intervention)."""
    cache = empty_cache(model)
    run_from(model, hidden, first, 0, cache)
    return cache_layers(cache)


def cache_of(
    model, layers: Sequence[tuple[torch.Tensor, torch.Tensor] | None] | None = None, first: int = 0, rows: int = 1
):
    """A KV cache from :func:`keys_values_from`'s ``layers``, each row repeated ``rows``
    times in a row (``repeat_interleave``), layers below ``first`` left empty;
    ``layers`` None: an empty cache of every layer."""
    if layers is None:
        return empty_cache(model, [None] * n_blocks(model))
    return empty_cache(
        model,
        [
            None if l < first or e is None else (e[0].repeat_interleave(rows, 0), e[1].repeat_interleave(rows, 0))
            for l, e in enumerate(layers)
        ],
    )


def run_decoder(
    hf,
    *,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    past=None,
    keep_cache: bool = False,
    start: int = 0,
    hidden: torch.Tensor | None = None,
    record: Sequence[int] = (),
) -> tuple[torch.Tensor, object | None, dict[int, torch.Tensor]]:
    """The HF decoder of ``hf`` on ``input_ids`` [B, T] (arguments as its forward's;
    ``keep_cache`` is its ``use_cache``):
    returns (final-normed hidden states [B, T, d_model], the KV cache, the inputs of the
    blocks in ``record``). With ``start`` > 0 the blocks below ``start`` are skipped:
    ``hidden`` is the stream entering block ``start`` (recorded from a run of these
    tokens), and the cache holds layers >= ``start`` only (``past`` likewise)."""
    decoder = hf.get_decoder()
    if start == 0:
        captured: dict[int, torch.Tensor] = {}
        handles = [
            decoder.layers[l].register_forward_pre_hook(_recorder(captured, l), with_kwargs=True) for l in record
        ]
        try:
            out = decoder(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                use_cache=keep_cache,
                **cache_kwargs(past),
            )
        finally:
            for h in handles:
                h.remove()
        return out.last_hidden_state, output_cache(out) if keep_cache else None, captured

    if hidden is None:
        raise ValueError("a run that starts at a later layer needs the stream entering it (hidden)")
    if keep_cache and past is None:
        past = new_cache(hf.config)
    if position_ids is None:
        seen = past.get_seq_length(start) if past is not None else 0
        position_ids = (torch.arange(hidden.shape[1], device=hidden.device) + seen).unsqueeze(0)
    hidden, captured = run_blocks(
        hf,
        hidden,
        first=start,
        position_ids=position_ids,
        cache=past,
        keep_cache=keep_cache,
        attention_mask=attention_mask,
        record=record,
    )
    return decoder_norm(hf, hidden), past if keep_cache else None, captured


def _recorder(store: dict[int, torch.Tensor], layer: int):
    def hook(module, args, kwargs):
        store[layer] = (args[0] if args else kwargs["hidden_states"]).detach()

    return hook
