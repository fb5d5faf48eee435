"""CNA importance, the math (Yu & Ananiadou 2024, Sec. 4.1 and App. B): the log-probability
change of the predicted token when a neuron's value vector is added to the residual
stream after its layer's attention, read through the final norm, for every neuron of
a layer at once: per-layer statistics, the first-order screen, the exact importance
(with the log-partition of every neuron's logits), and the loop over layers."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..core.readout import FinalNorm, final_norm, unembedding
from ..methods.neurons import w_out

# --------------------------------------------------------------------------- importance: the math

#: Columns of the unembedding per step of the vocabulary passes. The products
#: ``rows @ W_U[:, chunk]`` run fastest at 512-2,048 columns: on the 2-core reference
#: machine (one torch thread, Qwen-0.5B's W_U, 4,864 rows) 74-84 GFLOP/s there, 49 at
#: 3,449 columns and 62-67 at 8,192-16,384 (``benchmarks/vocab_chunk.py``). The chunk only
#: changes the order of the online log-sum-exp's additions.
VOCAB_CHUNK = 1024

#: Values per block of the element-wise passes over logits (gather, scale, shift, exp,
#: sums): 2**20 float32 (4 MB) stay in the caches from one pass to the next, where blocks
#: of 2**24 (64 MB) stream from memory on every pass. Each (row, neuron)'s logits are
#: reduced over its vocabulary chunk only, so the block size does not change a value
#: (``benchmarks/element_blocks.py`` times both and checks the results are bit-identical).
ELEMENT_BLOCK = 2**20


def _centre(x: torch.Tensor, norm: FinalNorm) -> torch.Tensor:
    return x - x.mean(-1, keepdim=True) if norm.kind == "layer" else x


def _beta(norm: FinalNorm, W_U: torch.Tensor, b_U: torch.Tensor) -> torch.Tensor:
    return b_U + norm.bias @ W_U if norm.bias is not None else b_U


class _Scratch:
    """Reusable blocks for the logits chunks of :func:`layer_stats` and :func:`exact_importance`: one flat buffer
    per slot, grown when needed, viewed at each chunk's shape. Allocating a fresh block
    per chunk (tens of MB, each mapped and zeroed anew by the OS) took several times
    longer than the arithmetic on it; the values are the same."""

    def __init__(self, device: torch.device | str):
        self.device = device
        self.flat: dict[int, torch.Tensor] = {}

    def get(self, slot: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        n = math.prod(shape)
        buf = self.flat.get(slot)
        if buf is None or buf.numel() < n or buf.dtype != dtype:
            buf = self.flat[slot] = torch.empty(n, device=self.device, dtype=dtype)
        return buf[:n].view(shape)


@dataclass
class LayerStats:
    """Per-row baseline quantities of one layer: sigma0 (norm scale of r), A_w (target
    logit before scaling), lse0 (log-partition of the baseline logits), pA (= p . A)
    and q (= W_U p, the expected unembedding), with p = softmax(logits(r))."""

    sigma0: torch.Tensor
    A_w: torch.Tensor
    lse0: torch.Tensor
    pA: torch.Tensor
    q: torch.Tensor


def layer_stats(
    resid: torch.Tensor,
    targets: torch.Tensor,
    norm: FinalNorm,
    W_U: torch.Tensor,
    b_U: torch.Tensor,
    vocab_chunk: int = VOCAB_CHUNK,
    scale: torch.Tensor | None = None,
    element_block: int = ELEMENT_BLOCK,
) -> tuple[LayerStats, torch.Tensor]:
    """Baseline statistics of rows ``resid`` [R, d] (one pass over the vocabulary with an
    online softmax) and log p(target | resid) [R]. ``scale`` [R]: the fixed norm scale of
    each row ("final" reading); None: each row's own RMS ("own").

    Per vocabulary chunk: logits ``z = (g r) W_U[:, c] / sigma0 + beta``, running max ``m``,
    ``e = exp(z - m)``, and the running sums ``s = sum e``, ``pA = sum e A`` and
    ``q = e W_U[:, c]^T``, each rescaled by ``exp(m_old - m)``. The products take every row
    at once; the element-wise passes run on reused buffers, ``element_block`` values
    (:data:`ELEMENT_BLOCK`) of rows at a time, so they stay in the caches and no fresh
    block is mapped per operation: each value is computed by the same operations as
    with whole fresh tensors, bit for bit (tested against that literal form)."""
    r = _centre(resid.float(), norm)
    d = r.shape[-1]
    gr = r * norm.weight
    sigma0 = torch.sqrt(r.pow(2).sum(-1) / d + norm.eps) if scale is None else scale.float().to(r.device)
    beta = _beta(norm, W_U, b_U)
    R = r.shape[0]
    m = torch.full((R,), -torch.inf, device=r.device)
    s = torch.zeros(R, device=r.device)
    pA = torch.zeros(R, device=r.device)
    q = torch.zeros(R, d, device=r.device)
    scratch = _Scratch(r.device)
    inv = sigma0[:, None]
    for v0 in range(0, W_U.shape[1], vocab_chunk):
        Wc = W_U[:, v0 : v0 + vocab_chunk]
        C = Wc.shape[1]
        A = torch.mm(gr, Wc, out=scratch.get(0, (R, C), gr.dtype))
        e = scratch.get(1, (R, C), gr.dtype)  # z, then exp(z - m_new) in place
        bc = beta[v0 : v0 + vocab_chunk]
        zmax, esum, eAsum = (torch.empty(R, device=r.device) for _ in range(3))
        rows = max(1, element_block // max(C, 1))
        for r0 in range(0, R, rows):
            sl = slice(r0, r0 + rows)
            torch.div(A[sl], inv[sl], out=e[sl]).add_(bc)
            torch.amax(e[sl], -1, out=zmax[sl])
        m_new = torch.maximum(m, zmax)
        carry = torch.exp(m - m_new)  # the online softmax's rescaling of the sums so far
        for r0 in range(0, R, rows):
            sl = slice(r0, r0 + rows)
            blk = e[sl].sub_(m_new[sl, None]).exp_()
            torch.sum(blk, -1, out=esum[sl])
            eA = scratch.get(2, tuple(blk.shape), blk.dtype)
            torch.sum(torch.mul(blk, A[sl], out=eA), -1, out=eAsum[sl])
        s = s * carry + esum
        pA = pA * carry + eAsum
        q.mul_(carry[:, None]).add_(torch.mm(e, Wc.T, out=scratch.get(3, (R, d), gr.dtype)))
        m = m_new
    pA, q = pA / s, q / s[:, None]
    lse0 = m + torch.log(s)
    A_w = (gr * W_U[:, targets.to(W_U.device)].T).sum(-1)
    base = A_w / sigma0 + beta[targets] - lse0
    return LayerStats(sigma0, A_w, lse0, pA, q), base


def layer_stats_stacked(
    resid_by_layer: Sequence[torch.Tensor],
    targets: torch.Tensor,
    norm: FinalNorm,
    W_U: torch.Tensor,
    b_U: torch.Tensor,
    vocab_chunk: int = VOCAB_CHUNK,
    scale: torch.Tensor | None = None,
    max_rows: int = 4096,
) -> list[tuple[LayerStats, torch.Tensor]]:
    """:func:`layer_stats` of several layers' rows (``resid_by_layer``, each [R, d] with the
    same ``targets`` [R] and ``scale`` [R]) in one pass over the vocabulary per group of
    at most ``max_rows`` rows. Every quantity is per row, so this is :func:`layer_stats`
    of each layer; stacking makes the products a few hundred rows tall instead of R (a
    product 24 rows tall runs at about half the rate of one 500 rows tall)."""
    R = len(targets)
    per_group = max(1, max_rows // max(R, 1))
    out: list[tuple[LayerStats, torch.Tensor]] = []
    for g0 in range(0, len(resid_by_layer), per_group):
        group = resid_by_layer[g0 : g0 + per_group]
        n = len(group)
        stats, base = layer_stats(
            torch.cat(list(group)),
            targets.repeat(n),
            norm,
            W_U,
            b_U,
            vocab_chunk=vocab_chunk,
            scale=None if scale is None else scale.repeat(n),
        )
        for i in range(n):
            rows = slice(i * R, (i + 1) * R)
            out.append(
                (
                    LayerStats(stats.sigma0[rows], stats.A_w[rows], stats.lse0[rows], stats.pA[rows], stats.q[rows]),
                    base[rows],
                )
            )
    return out


def _pair_terms(
    resid: torch.Tensor, coef: torch.Tensor, values: torch.Tensor, norm: FinalNorm, scale: torch.Tensor | None = None
):
    """Centred r and v and the norm scale sigma [R, K] of r + m v: its own RMS, or the
    row's fixed ``scale`` [R] for every neuron ("final" reading)."""
    r = _centre(resid.float(), norm)
    v = _centre(values.float(), norm)
    m = coef.float()
    if scale is not None:
        return r, v, scale.float().to(r.device)[:, None].expand(m.shape)
    d = r.shape[-1]
    rv = r @ v.T
    rr = r.pow(2).sum(-1)
    vv = v.pow(2).sum(-1)
    sigma = torch.sqrt((rr[:, None] + 2 * m * rv + m.pow(2) * vv[None]) / d + norm.eps)
    return r, v, sigma


def first_order_importance(
    resid: torch.Tensor,
    coef: torch.Tensor,
    values: torch.Tensor,
    targets: torch.Tensor,
    norm: FinalNorm,
    W_U: torch.Tensor,
    stats: LayerStats,
    scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Stage 1 of the two-stage mode, [R, K]: the importance with the logit change dz
    exact (norm rescaling included) and the log-partition linearised at p:
    ``imp1 = dz_w - p . dz = (A_w - p.A)(1/sigma - 1/sigma0) + m (g v).(W_U[:, w] - q) / sigma``
    (with a fixed ``scale``, sigma = sigma0 and the first term vanishes; ``stats`` must
    come from :func:`layer_stats` with the same ``scale``)."""
    r, v, sigma = _pair_terms(resid, coef, values, norm, scale)
    gv = v * norm.weight
    w_cols = W_U[:, targets.to(W_U.device)].T  # [R, d]
    term_v = (w_cols - stats.q) @ gv.T  # [R, K]
    return (stats.A_w - stats.pA)[:, None] * (1 / sigma - 1 / stats.sigma0[:, None]) + coef.float() * term_v / sigma


def exact_importance(
    resid: torch.Tensor,
    coef: torch.Tensor,
    values: torch.Tensor,
    targets: torch.Tensor,
    norm: FinalNorm,
    W_U: torch.Tensor,
    b_U: torch.Tensor,
    pairs: tuple[torch.Tensor, torch.Tensor] | None = None,
    base_logprob: torch.Tensor | None = None,
    vocab_chunk: int = VOCAB_CHUNK,
    block_elems: int = 2**24,
    scale: torch.Tensor | None = None,
    element_block: int = ELEMENT_BLOCK,
) -> torch.Tensor:
    """Exact CNA importance (Sec. 4.1) of neurons with values ``values`` [K, d] and
    coefficients ``coef`` [R, K] for rows ``resid`` [R, d] and target tokens [R].

    ``pairs=None``: every (row, neuron), returns [R, K]. ``pairs=(rows, cols)``: only those
    (row, neuron) pairs, returns [P]. The vocabulary is processed in chunks with an
    online logsumexp; the value projections (g v) W_U are computed once per chunk for
    the neurons involved and shared by all rows. ``block_elems`` bounds the size of the
    logits block (memory; with every pair, also the vocabulary chunk:
    :func:`log_partition_all`), ``element_block`` that of the element-wise passes over it
    (:data:`ELEMENT_BLOCK`). ``scale`` [R]: each row's fixed norm scale ("final" reading;
    None: each vector's own RMS)."""
    device = W_U.device
    targets = targets.to(device)
    if base_logprob is None:
        _, base_logprob = layer_stats(resid, targets, norm, W_U, b_U, scale=scale)
    r, v, sigma = _pair_terms(resid, coef, values, norm, scale)
    gr, gv = r * norm.weight, v * norm.weight
    beta = _beta(norm, W_U, b_U)
    R, K = coef.shape
    if pairs is None:
        return _exact_importance_all(
            gr,
            gv,
            coef.float(),
            sigma,
            targets,
            W_U,
            beta,
            base_logprob.to(device),
            vocab_chunk,
            block_elems,
            element_block,
        )
    rows, cols = (p.to(device) for p in pairs)
    used, inverse = torch.unique(cols, return_inverse=True)  # neurons involved
    P = rows.numel()
    m_pair = coef.float()[rows, cols]
    inv_sigma = 1.0 / sigma[rows, cols]
    # exact target logit
    w_cols = W_U[:, targets].T  # [R, d]
    Aw = (gr * w_cols).sum(-1)
    Bw = gv[used] @ w_cols.T  # [U, R]
    z_w = (Aw[rows] + m_pair * Bw[inverse, rows]) * inv_sigma + beta[targets][rows]
    run_max = torch.full((P,), -torch.inf, device=device)
    run_sum = torch.zeros(P, device=device)
    pair_chunk = max(1, min(block_elems, element_block) // vocab_chunk)
    gv_used = gv[used]
    row_used = torch.unique(rows)
    row_pos = torch.full((R,), -1, dtype=torch.long, device=device)
    row_pos[row_used] = torch.arange(len(row_used), device=device)
    rows_c = row_pos[rows]
    gr_used = gr[row_used]
    scratch = _Scratch(device)
    for v0 in range(0, W_U.shape[1], vocab_chunk):
        Wc = W_U[:, v0 : v0 + vocab_chunk]
        A = gr_used @ Wc  # [rows with pairs, C]
        B = gv_used @ Wc  # [neurons with pairs, C]
        bc = beta[v0 : v0 + vocab_chunk]
        for p0 in range(0, P, pair_chunk):
            sl = slice(p0, p0 + pair_chunk)
            n = min(pair_chunk, P - p0)
            z, other = scratch.get(0, (n, Wc.shape[1]), A.dtype), scratch.get(1, (n, Wc.shape[1]), B.dtype)
            torch.index_select(A, 0, rows_c[sl], out=z)
            torch.index_select(B, 0, inverse[sl], out=other)
            z.addcmul_(other, m_pair[sl, None])
            z.mul_(inv_sigma[sl, None]).add_(bc)
            new = torch.maximum(run_max[sl], z.amax(-1))
            run_sum[sl] = run_sum[sl] * torch.exp(run_max[sl] - new) + z.sub_(new[:, None]).exp_().sum(-1)
            run_max[sl] = new
    return z_w - (run_max + torch.log(run_sum)) - base_logprob.to(device)[rows]


def _exact_importance_all(
    gr: torch.Tensor,
    gv: torch.Tensor,
    m: torch.Tensor,
    sigma: torch.Tensor,
    targets: torch.Tensor,
    W_U: torch.Tensor,
    beta: torch.Tensor,
    base_logprob: torch.Tensor,
    vocab_chunk: int,
    block_elems: int,
    element_block: int = ELEMENT_BLOCK,
) -> torch.Tensor:
    """:func:`exact_importance` for every (row, neuron): logits blocks [rows, K, chunk] by
    broadcasting (no gathers), online logsumexp over vocabulary chunks. [R, K]. A block
    holds at most ``block_elems`` values: the vocabulary chunk shrinks below
    ``vocab_chunk`` when one row's [K, chunk] block would exceed it (a layer of many neurons)."""
    w_cols = W_U[:, targets].T  # [R, d]
    z_w = ((gr * w_cols).sum(-1)[:, None] + m * (w_cols @ gv.T)) * (1.0 / sigma) + beta[targets][:, None]
    lse = log_partition_all(gr, gv, m, sigma, W_U, beta, vocab_chunk, block_elems, element_block)
    return z_w - lse - base_logprob[:, None]


def log_partition_all(
    gr: torch.Tensor,
    gv: torch.Tensor,
    m: torch.Tensor,
    sigma: torch.Tensor,
    W_U: torch.Tensor,
    beta: torch.Tensor,
    vocab_chunk: int = VOCAB_CHUNK,
    block_elems: int = 2**24,
    element_block: int = ELEMENT_BLOCK,
) -> torch.Tensor:
    """log sum_v exp(logits_v(r + m_k v_k)) for every row r and neuron k, [R, K]: the part
    of the exact importance that needs a pass over the vocabulary (``gr``, ``gv``: the
    centred rows and values times the norm weight; ``sigma`` [R, K]: the norm scale of
    r + m_k v_k; ``beta``: the logit offset). It does not depend on the target token, so
    several targets of one row share it (:func:`arithlib.yu.bias_cna.shared_input_importance`).
    ``block_elems`` sets the vocabulary chunk of the products (at most ``block_elems / K``
    columns), ``element_block`` the blocks of rows and neurons the element-wise passes take
    at a time (:data:`ELEMENT_BLOCK`)."""
    R, K = m.shape
    device = W_U.device
    inv_sigma = 1.0 / sigma
    run_max = torch.full((R, K), -torch.inf, device=device)
    run_sum = torch.zeros(R, K, device=device)
    chunk = max(1, min(vocab_chunk, W_U.shape[1], block_elems // K))
    if chunk < vocab_chunk and chunk > 256:
        chunk -= chunk % 256  # a multiple of 256 columns: odd widths slow the product (VOCAB_CHUNK)
    block = min(block_elems, element_block)
    row_block = max(1, block // (K * chunk))  # rows and neurons per element-wise block
    k_block = min(K, max(1, block // (row_block * chunk)))
    scratch = _Scratch(device)
    for v0 in range(0, W_U.shape[1], chunk):
        Wc = W_U[:, v0 : v0 + chunk]
        A = gr @ Wc  # [R, C]
        B = gv @ Wc  # [K, C]
        bc = beta[v0 : v0 + chunk]
        dtype = torch.promote_types(torch.promote_types(A.dtype, m.dtype), B.dtype)
        for r0 in range(0, R, row_block):
            rs = slice(r0, r0 + row_block)
            for k0 in range(0, K, k_block):
                ks = slice(k0, k0 + k_block)
                z = torch.addcmul(
                    A[rs, None, :],
                    m[rs, ks, None],
                    B[None, ks],
                    out=scratch.get(0, (min(row_block, R - r0), min(k_block, K - k0), Wc.shape[1]), dtype),
                )  # [r, k, C]
                z.mul_(inv_sigma[rs, ks, None]).add_(bc)
                new = torch.maximum(run_max[rs, ks], z.amax(-1))
                run_sum[rs, ks] = run_sum[rs, ks] * torch.exp(run_max[rs, ks] - new) + z.sub_(
                    new[..., None]
                ).exp_().sum(-1)
                run_max[rs, ks] = new
    return run_max + torch.log(run_sum)


@torch.no_grad()
def importance_loop(
    model,
    resid: torch.Tensor,
    coef: torch.Tensor,
    layer: int,
    targets: torch.Tensor,
    neurons: Sequence[int] | None = None,
    scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference implementation, one neuron at a time: for each neuron k add m_k fc2_k to
    resid_mid, read it through the final norm and the unembedding, and take the change
    of log p(target). [R, len(neurons)]. ``scale=None`` ("own" reading): the model's own
    ``ln_final`` module; ``scale`` [R] ("final" reading): x / s times the norm's weight
    (plus its bias; x centred for a LayerNorm), as the authors' ``get_bsvalues``. The
    baseline of the benchmark."""
    W_U, b_U = unembedding(model)
    values = w_out(model, layer)
    neurons = range(values.shape[0]) if neurons is None else neurons
    dtype = next(model.parameters()).dtype
    t = targets.to(W_U.device)
    norm = final_norm(model)

    def logprob(x):
        if scale is None:
            y = model.ln_final(x.to(dtype)[:, None, :])[:, 0].float()
        else:
            y = _centre(x.float(), norm) / scale.float()[:, None] * norm.weight
            y = y + norm.bias if norm.bias is not None else y
        return (y @ W_U + b_U).log_softmax(-1).gather(1, t[:, None])[:, 0]

    base = logprob(resid)
    out = [logprob(resid + coef[:, k, None] * values[k]) - base for k in neurons]
    return torch.stack(out, 1)
