"""The loss and accuracy of fine-tuning, on the answer tokens only: teacher-forced logits
at the answer positions under a shared few-shot prefix (run once per batch, with
gradients), the answer-token cross-entropy, and teacher-forced accuracy (every answer
token the argmax after its predecessors, the next token not continuing the number)."""

from collections.abc import Sequence

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from ..core.evaluate import continues_number
from ..core.prompt_sets import PromptSet
from ..engine import (
    LayerInputs,
    common_prefix,
    module_device,
    rows_on_prefixes,
)
from ..engine import (
    hf_module as _hf,
)
from .finetune_data import _prefix_key, answer_batches

# --------------------------------------------------------------------------- answer-position forward


def _row_prefix_lengths(
    prompts: PromptSet, index: Sequence[int], seqs: Sequence[Sequence[int]], starts: Sequence[int]
) -> list[int]:
    """Tokens of each row shared as a prefix in :func:`teacher_forced_logits`: rows of one
    few-shot prefix group (:func:`_prefix_key`) share the tokens common to all of them;
    a row alone in its group runs its whole prompt but the last token there. Never past
    a row's ``start`` (the position predicting its first answer token)."""
    groups: dict[tuple, list[int]] = {}
    for row, i in enumerate(index):
        groups.setdefault(_prefix_key(prompts.records[i]), []).append(row)
    lengths = [0] * len(index)
    for rows in groups.values():
        p = min(common_prefix([seqs[r] for r in rows]), min(starts[r] for r in rows))
        for r in rows:
            lengths[r] = p
    return lengths


def teacher_forced_logits(
    model,
    prompts: PromptSet,
    index: Sequence[int],
    extra: int = 0,
    share_prefix: bool = True,
    inputs: LayerInputs | None = None,
    same_below: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher-forced logits at the answer positions of prompts ``index``: row i reads
    prompt + answer and gives the logits predicting each answer token (and, with
    ``extra=1``, the token after the answer). Returns ``(logits [B, A, vocab] float32,
    mask [B, A] bool)``, A = longest answer + extra. Differentiable.

    With ``share_prefix`` the rows run packed (:func:`arithlib.engine.rows_on_prefixes`):
    the distinct prefixes (:func:`_row_prefix_lengths`: a few-shot group's common tokens,
    once per group) and every row's remaining tokens in one sequence, without padding,
    each row's tokens attending to its prefix and to themselves, at the positions of the
    unpadded text. A batch that spans several groups thus computes each group's prefix
    once instead of every row's whole prompt, and the prefixes' tokens join the rows' in
    every matrix product. Only the answer positions are unembedded. Equal to one plain
    forward per row up to float rounding (tested).

    ``inputs`` (:class:`arithlib.engine.LayerInputs` of this prompt set) with
    ``same_below`` = L, the first block in which ``model`` differs from the reference
    model of ``inputs``: both passes start at the highest layer <= L recorded for this
    batch, and record the layers of ``inputs`` up to L they compute (bit-identical to
    the full pass; Llama-style decoders only, others run in full)."""
    hf = _hf(model)
    unembed = hf.get_output_embeddings()
    seqs = [prompts.input_ids[i] + prompts.answer_ids[i] for i in index]
    starts = [len(prompts.input_ids[i]) - 1 for i in index]  # position predicting answer token 0
    n_keep = [len(prompts.answer_ids[i]) + extra for i in index]  # the token after the answer is
    B = len(seqs)  # predicted at the last answer token
    plen = _row_prefix_lengths(prompts, index, seqs, starts) if share_prefix else [0] * B
    hidden = rows_on_prefixes(
        hf, seqs, plen, inputs=inputs, key=(tuple(index), extra, share_prefix), same_below=same_below
    )
    A = max(n_keep)
    gather = torch.zeros(B, A, dtype=torch.long)
    mask = torch.zeros(B, A, dtype=torch.bool)
    for row, (s, p, k) in enumerate(zip(starts, plen, n_keep)):
        gather[row, :k] = torch.arange(s - p, s - p + k)
        mask[row, :k] = True
    gather = gather.to(hidden.device)
    picked = hidden.gather(1, gather[:, :, None].expand(B, A, hidden.shape[-1]))
    logits = unembed(picked.to(module_device(hf, unembed))).float()  # fp32 for the loss and log-probs
    return logits, mask.to(logits.device)


def _answer_targets(prompts: PromptSet, index: Sequence[int], A: int, device) -> torch.Tensor:
    t = torch.full((len(index), A), -100, dtype=torch.long)
    for row, i in enumerate(index):
        ans = prompts.answer_ids[i]
        t[row, : len(ans)] = torch.tensor(ans)
    return t.to(device)


def answer_loss(
    model,
    prompts: PromptSet,
    index: Sequence[int],
    share_prefix: bool = True,
    inputs: LayerInputs | None = None,
    same_below: int = 0,
) -> torch.Tensor:
    """Mean cross-entropy over the answer tokens of prompts ``index`` (teacher forcing;
    prompt tokens carry no loss). ``inputs``, ``same_below``: as in :func:`teacher_forced_logits`
    (the blocks below ``same_below`` must have no trainable parameter)."""
    logits, _ = teacher_forced_logits(
        model, prompts, index, extra=0, share_prefix=share_prefix, inputs=inputs, same_below=same_below
    )
    targets = _answer_targets(prompts, index, logits.shape[1], logits.device)
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)


@torch.no_grad()
def answer_accuracy(
    model,
    prompts: PromptSet,
    batch_size: int = 32,
    progress: bool = False,
    desc: str = "accuracy",
    share_prefix: bool = True,
    inputs: LayerInputs | None = None,
    same_below: int = 0,
) -> pd.DataFrame:
    """Per-prompt teacher-forced evaluation: ``correct_first`` (first answer token is the
    argmax), ``correct_full`` (every answer token is the argmax after its predecessors
    and the next token does not continue the number: greedy decoding's verdict),
    ``answer_logprob`` (log p of the whole answer) and ``first_logprob``; with the
    prompt's fields (``op``, ``template_id``, ``a``, ``b``, ``answer``, ``family``).
    ``share_prefix``, ``inputs`` and ``same_below``: as in :func:`teacher_forced_logits`."""
    hf = _hf(model)
    was_training = hf.training
    hf.eval()
    tok = prompts.tokenizer
    n = len(prompts)
    first = np.zeros(n, dtype=bool)
    full = np.zeros(n, dtype=bool)
    logprob = np.zeros(n)
    first_lp = np.zeros(n)
    for index in tqdm(answer_batches(prompts, batch_size), desc=desc, disable=not progress, leave=False):
        logits, mask = teacher_forced_logits(
            hf, prompts, index, extra=1, share_prefix=share_prefix, inputs=inputs, same_below=same_below
        )
        answers = [prompts.answer_ids[i] for i in index]
        target = torch.zeros(mask.shape, dtype=torch.long)  # answer ids, padded with 0 (masked out below)
        is_answer = torch.zeros(mask.shape, dtype=torch.bool)
        for row, ans in enumerate(answers):
            target[row, : len(ans)] = torch.tensor(ans)
            is_answer[row, : len(ans)] = True
        # one gather and one device-to-host copy per batch (a GPU syncs once, not per row)
        tok_lp = logits.log_softmax(-1).gather(-1, target.to(logits.device)[..., None])[..., 0].cpu()
        pred = logits.argmax(-1).cpu()
        hit = (pred == target) | ~is_answer
        for row, (i, ans) in enumerate(zip(index, answers)):
            k = len(ans)
            first[i] = bool(hit[row, 0])
            full[i] = bool(hit[row].all()) and not continues_number(tok, int(pred[row, k]))
            logprob[i] = float(tok_lp[row, :k].sum())
            first_lp[i] = float(tok_lp[row, 0])
    hf.train(was_training)
    recs = prompts.records
    return pd.DataFrame(
        {
            "family": [r.family for r in recs],
            "op": [r.op for r in recs],
            "template_id": [r.template_id for r in recs],
            "a": [r.a for r in recs],
            "b": [r.b for r in recs],
            "answer": [r.answer for r in recs],
            "negative": [r.answer < 0 for r in recs],
            "correct_first": first,
            "correct_full": full,
            "answer_logprob": logprob,
            "first_logprob": first_lp,
        }
    )
