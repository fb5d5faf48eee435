"""A clean run recorded for later passes, and the passes that resume from it: the fast
path under every patching method (:mod:`arithlib.methods.patching`).

An intervention at position p leaves positions < p untouched, so the clean run's keys
and values there are reused (:func:`_make_cache`) and only positions p..T-1 are
recomputed; an intervention in block L leaves the stream below L untouched, so a copy of
the batch joins the pass at block L from the recorded residual stream (:func:`resume`,
Llama/Mistral/Qwen2-style models; others start at block 0). :func:`clean_run` records
the run, sharing the rows' few-shot prefix; :func:`grouped_clean_run` does so for a batch
of several prefixes; :class:`RunCache` keeps runs per prompt for later calls. The
interventions themselves (hooks on copies of the batch) are the caller's.
Tested equal to one full pass per intervention (``tests/unit/test_patching.py``,
``tests/unit/test_devices.py``).
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from ..core.components import Hook
from ..core.prompt_sets import PromptSet
from .adapter import cache_with_room, filled_cache_layers, hf_module, input_device, layer_device, repeat_rows_
from .passes import decoder_norm, decoder_pass, empty_cache, resumable, run_blocks
from .prefix import MIN_SHARED_PREFIX, common_prefix


def capture_hooks(store: dict, spec: Mapping[str, Callable | None]) -> list[Hook]:
    """Hooks that store each named activation (reduced by ``spec[name]`` when not None)
    in ``store[name]``, detached and copied; the last call wins."""
    hooks = []
    for name, reduce in spec.items():

        def fn(act, hook, name=name, reduce=reduce):
            store[name] = (reduce(act) if reduce is not None else act).detach().clone()
            return act

        hooks.append((name, fn))
    return hooks


@dataclass
class CleanRun:
    """One clean forward pass kept for the fast path: tokens, every layer's keys and
    values, every block's input (residual stream) at every position (when
    :func:`resumable`), the final-normed hidden state at the last position, and any
    captured activations."""

    tokens: torch.Tensor  # [B, T]
    keys: list[torch.Tensor]  # per layer [B, kv_heads, T, d_head]
    values: list[torch.Tensor]
    resid: torch.Tensor | None  # [n_layers, B, T, d_model]
    final: torch.Tensor  # [B, d_model]
    captured: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]

    @property
    def length(self) -> int:
        return self.tokens.shape[1]


def _is_attention_map(hook_name: str) -> bool:
    """Hooks whose activations are [B, heads, query, key] rather than [B, pos, ...]."""
    return hook_name.endswith(("hook_pattern", "hook_attn_scores"))


@torch.no_grad()
def clean_run(
    model,
    tokens: torch.Tensor,
    capture: Mapping[str, Callable | None] | Iterable[str] = (),
    share_prefix: bool = True,
    last: Iterable[str] = (),
) -> CleanRun:
    """One forward pass of ``tokens`` [B, T] that keeps what :func:`run_variants` needs,
    plus the activations named in ``capture`` (a list of hook names, or a mapping from
    hook name to a function that reduces the activation before it is stored) and, for
    the hooks named in ``last``, their activation at the last position ([B, ...]).

    With ``share_prefix`` the leading tokens common to every row (a few-shot prefix,
    when the batch holds one) run once at batch 1 and the rest on top of their keys and
    values; per-position activations are the
    prefix's (expanded) followed by the rest's, so everything kept equals one full pass
    up to float rounding. An attention map (``hook_pattern``) is then only seen for the
    rest's queries: its reducer must read those (e.g. the last query), and without one
    the prefix is not shared. A batch of several prefixes: :func:`grouped_clean_run`."""
    n_layers = model.cfg.n_layers
    spec = dict(capture) if isinstance(capture, Mapping) else {n: None for n in capture}
    resid_names = {f"blocks.{l}.hook_resid_pre": None for l in range(n_layers)} if resumable(model) else {}
    B, T = tokens.shape
    n = min(common_prefix(tokens.tolist()), T - 1) if share_prefix and B > 1 else 0
    at_last: dict[str, torch.Tensor] = {}
    last_hooks = capture_hooks(at_last, {k: _last_position for k in last})  # the pass holding position T-1
    if n < MIN_SHARED_PREFIX or any(_is_attention_map(k) and r is None for k, r in spec.items()):
        store: dict[str, torch.Tensor] = {}
        internal: dict[str, torch.Tensor] = {}
        with model.hooks(fwd_hooks=capture_hooks(store, spec) + capture_hooks(internal, resid_names) + last_hooks):
            last_hidden, cache = decoder_pass(model, tokens)
        resid = _stack_streams([internal[x] for x in resid_names], model) if resid_names else None
    else:
        raw = {k: None for k in spec if not _is_attention_map(k)} | resid_names
        first: dict[str, torch.Tensor] = {}
        with model.hooks(fwd_hooks=capture_hooks(first, raw)):
            prefix = repeat_rows_(decoder_pass(model, tokens[:1, :n])[1], B)
        rest: dict[str, torch.Tensor] = {}
        maps = {k: r for k, r in spec.items() if _is_attention_map(k)}
        with model.hooks(fwd_hooks=capture_hooks(rest, raw) + capture_hooks(rest, maps) + last_hooks):
            last_hidden, cache = decoder_pass(model, tokens[:, n:], cache=prefix)
        whole = {k: torch.cat([first[k].expand(B, *first[k].shape[1:]), rest[k]], 1) for k in raw}
        store = {
            k: rest[k] if k in maps else (whole[k] if r is None else r(whole[k]).detach().clone())
            for k, r in spec.items()
        }
        resid = _stack_streams([whole[x] for x in resid_names], model) if resid_names else None
    layers = filled_cache_layers(cache)
    keys = [k for k, _ in layers]
    values = [v for _, v in layers]
    return CleanRun(tokens, keys, values, resid, last_hidden[:, -1].clone(), store | at_last)


def _last_position(act: torch.Tensor) -> torch.Tensor:
    return act[:, -1]


def _stack_streams(streams: Sequence[torch.Tensor], model) -> torch.Tensor:
    """Every block's recorded input stream stacked ``[n_layers, ...]`` on the input
    embedding's device (on a split model each was recorded on its own block's device;
    :func:`resume` moves a layer's slice back to that layer's device)."""
    device = input_device(model)
    return torch.stack([x.to(device) for x in streams])


#: A prefix group of a batch runs on its own (:func:`prefix_groups`) when the positions it
#: saves, (rows - 1) x prefix length, reach this: a group adds two passes (its prefix and
#: its rest), and on a CPU a pass with few rows costs about what 32 token positions do
#: (reading every weight once), so smaller savings would make the run slower.
MIN_SAVED_POSITIONS = 64


def prefix_groups(prompts: PromptSet, index: Sequence[int]) -> list[list[int]]:
    """Rows of a batch (positions in ``index``) grouped by few-shot prefix
    (``record.prefix``), for :func:`grouped_clean_run`: a group of its own for each prefix
    whose sharing saves at least :data:`MIN_SAVED_POSITIONS` token positions, the other
    rows together in one group."""
    index = [int(x) for x in index]
    by: dict[str, list[int]] = {}
    for row, i in enumerate(index):
        by.setdefault(prompts.records[i].prefix, []).append(row)

    def saved(rows: list[int]) -> int:
        return (len(rows) - 1) * common_prefix([prompts.input_ids[index[r]] for r in rows])

    shared = [g for g in by.values() if saved(g) >= MIN_SAVED_POSITIONS]
    rest = sorted(r for g in by.values() if saved(g) < MIN_SAVED_POSITIONS for r in g)
    return shared + ([rest] if rest else [])


def _rows(run: CleanRun, rows: torch.Tensor) -> CleanRun:
    """Rows ``rows`` of ``run``, each tensor indexed on its own device (a split model's
    keys and values stay on their layers' devices)."""

    def take(x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        return x.index_select(dim, rows.to(x.device))

    return CleanRun(
        take(run.tokens),
        [take(k) for k in run.keys],
        [take(v) for v in run.values],
        None if run.resid is None else take(run.resid, 1),
        take(run.final),
        {k: take(v) for k, v in run.captured.items()},
    )


def grouped_clean_run(
    model,
    tokens: torch.Tensor,
    groups: Sequence[Sequence[int]] | None,
    capture: Mapping[str, Callable | None] | Iterable[str] = (),
) -> CleanRun:
    """:func:`clean_run` of a same-length batch whose rows hold several few-shot prefixes:
    one run per group of rows (``groups``, e.g. :func:`prefix_groups`), each sharing its
    own prefix, joined back in row order. Batches stay as large as the prompt lengths
    allow (the interventions that follow run on all of them at once) while each prefix
    runs once. ``groups`` None: one group."""
    if groups is None or len(groups) <= 1:
        return clean_run(model, tokens, capture)
    runs = [clean_run(model, tokens[list(g)], capture) for g in groups]
    order = torch.tensor([r for g in groups for r in g])
    joined = CleanRun(
        torch.cat([r.tokens for r in runs]),
        [torch.cat([r.keys[l] for r in runs]) for l in range(len(runs[0].keys))],
        [torch.cat([r.values[l] for r in runs]) for l in range(len(runs[0].values))],
        None if runs[0].resid is None else torch.cat([r.resid for r in runs], 1),
        torch.cat([r.final for r in runs]),
        {k: torch.cat([r.captured[k] for r in runs]) for k in runs[0].captured},
    )
    return _rows(joined, torch.argsort(order).to(joined.final.device))


class RunCache:
    """Clean runs kept per prompt (keyed by its token ids), so that later interventions
    on the same prompts skip the clean forward pass: pass one to :func:`run_interventions`
    (and the functions built on it) and :func:`path_patching`. Holds every layer's keys,
    values and residual stream of each prompt."""

    def __init__(self) -> None:
        self._store: dict[tuple[int, ...], tuple] = {}

    def __len__(self) -> int:
        return len(self._store)

    def add(self, run: CleanRun) -> None:
        """Store every prompt of a batch run."""
        for i, t in enumerate(run.tokens):
            self._store[tuple(t.tolist())] = (
                [k[i : i + 1] for k in run.keys],
                [v[i : i + 1] for v in run.values],
                None if run.resid is None else run.resid[:, i : i + 1],
                run.final[i : i + 1],
            )

    def get(self, model, tokens: torch.Tensor, groups: Sequence[Sequence[int]] | None = None) -> CleanRun:
        """The clean run of a same-length batch, from the cache where possible; rows not
        cached yet run by ``groups`` (:func:`grouped_clean_run`)."""
        keys = [tuple(t.tolist()) for t in tokens]
        missing = [i for i, k in enumerate(keys) if k not in self._store]
        if missing:
            pos = {r: j for j, r in enumerate(missing)}
            todo = None if groups is None else [[pos[r] for r in g if r in pos] for g in groups]
            self.add(grouped_clean_run(model, tokens[missing], [g for g in todo if g] if todo else None))
        parts = [self._store[k] for k in keys]
        n_layers = len(parts[0][0])
        ks = [torch.cat([p[0][l] for p in parts]) for l in range(n_layers)]
        vs = [torch.cat([p[1][l] for p in parts]) for l in range(n_layers)]
        resid = None if parts[0][2] is None else torch.cat([p[2] for p in parts], 1)
        return CleanRun(tokens, ks, vs, resid, torch.cat([p[3] for p in parts]))


def _make_cache(model, run: CleanRun, start: int, rows: torch.Tensor, present: Sequence[int]):
    """KV cache of the clean positions ``< start`` holding, in layer ``l``, the first
    ``present[l]`` of ``rows`` (indices into the batch; layers with none are left empty),
    each layer gathered into buffers with room for the positions ``start..T-1`` that the
    resumed pass adds (:func:`arithlib.engine.adapter.cache_with_room`: no concatenation)."""
    if start == 0:
        return empty_cache(model)
    T = run.tokens.shape[1]
    devices = [layer_device(model, l) for l in range(len(run.keys))]  # a split model's cache: each layer on its own

    def gathered(src: torch.Tensor, n: int, device: torch.device) -> torch.Tensor:
        buf = torch.empty(n, src.shape[1], T, src.shape[3], dtype=src.dtype, device=device)
        if device == src.device:
            torch.index_select(src[:, :, :start], 0, rows[:n].to(src.device), out=buf[:, :, :start])
        else:
            buf[:, :, :start] = src[:, :, :start].index_select(0, rows[:n].to(src.device)).to(device)
        return buf

    return cache_with_room(
        hf_module(model).config,
        (
            None if n == 0 else (gathered(k, n, d), gathered(v, n, d), start)
            for n, k, v, d in zip(present, run.keys, run.values, devices)
        ),
    )


def resume_rows(
    model, run: CleanRun, start: int, rows: Sequence[int] | torch.Tensor, entry: Sequence[int]
) -> torch.Tensor:
    """Final-normed hidden state at the last position for ``len(rows)`` rows, row ``j``
    a copy of batch row ``rows[j]`` recomputed from layer ``entry[j]`` on (non-decreasing)
    over positions ``start..T-1``; until then it is the clean run, so it joins the pass
    at that layer from the clean residual stream (appended after the rows already
    there: at layer ``l`` the pass holds the rows with ``entry <= l``, in order, and a
    hook sees those). Not resumable models recompute every row from layer 0."""
    T = run.tokens.shape[1]
    n_layers = model.cfg.n_layers
    rows = torch.as_tensor(rows, dtype=torch.long)
    entry = [int(e) for e in entry]
    if len(entry) != len(rows) or not len(rows):
        raise ValueError(f"need one entry layer per row and at least one row, got {len(entry)} for {len(rows)}")
    if run.resid is not None:
        if any(a > b for a, b in zip(entry, entry[1:])) or entry[-1] >= n_layers:
            raise ValueError(f"entry layers must be non-decreasing and below {n_layers}, got {entry}")
        first = entry[0]
        present = [bisect_right(entry, l) for l in range(n_layers)]  # rows in the pass at layer l

        def stream(l: int, lo: int, hi: int, device: torch.device) -> torch.Tensor:
            """The clean stream entering block ``l`` of rows ``lo..hi-1``."""
            x = run.resid[l]
            return x.index_select(0, rows[lo:hi].to(x.device))[:, start:].to(device)

        cache = _make_cache(model, run, start, rows, present)
        hidden = stream(first, 0, present[first], layer_device(model, first))
        position_ids = torch.arange(start, T, device=hidden.device).unsqueeze(0)

        def join(l: int, device: torch.device) -> torch.Tensor | None:
            """Rows that join at layer ``l``, from the clean stream."""
            lo = present[l - 1] if l > first else present[l]
            return stream(l, lo, present[l], device) if present[l] > lo else None

        hidden, _ = run_blocks(model, hidden, first=first, position_ids=position_ids, cache=cache, join=join)
        return decoder_norm(model, hidden[:, -1:])[:, 0]
    cache = _make_cache(model, run, start, rows, [len(rows)] * n_layers)
    tokens = run.tokens.index_select(0, rows.to(run.tokens.device))[:, start:]
    hidden, _ = decoder_pass(model, tokens.to(input_device(model)), cache=cache)
    return hidden[:, -1]


def resume(model, run: CleanRun, start: int, entry: Sequence[int]) -> torch.Tensor:
    """Final-normed hidden state at the last position for ``len(entry)`` copies of the
    batch (variant-major), recomputing positions ``start..T-1``. Copy ``j`` is recomputed
    from layer ``entry[j]`` on (non-decreasing): :func:`resume_rows` with every row of
    copy ``j`` entering at ``entry[j]``."""
    B = run.tokens.shape[0]
    rows = torch.arange(B).repeat(len(entry))
    return resume_rows(model, run, start, rows, [e for e in entry for _ in range(B)])
