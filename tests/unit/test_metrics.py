"""The papers' metrics on hand-computed examples."""

from __future__ import annotations

import math

import pytest
import torch

import arithlib.core.metrics as M


def test_relative_logit_change_is_zhangs_ratio():
    clean = torch.tensor([10.0, 20.0])
    patched = torch.tensor([[9.0, 20.0], [12.0, 15.0]])
    out = M.relative_logit_change(patched, clean)
    assert torch.allclose(out, torch.tensor([[-0.1, 0.0], [0.2, -0.25]]))
    with pytest.raises(ValueError, match="positive"):
        M.relative_logit_change(patched, torch.tensor([10.0, -1.0]))
    lax = M.relative_logit_change(patched, torch.tensor([10.0, -1.0]), strict=False)
    assert torch.isnan(lax[:, 1]).all() and torch.allclose(lax[:, 0], torch.tensor([-0.1, 0.2]))


def test_answer_logit_broadcasts_over_variants():
    logits = torch.arange(24.0).reshape(2, 3, 4)  # [variant, prompt, vocab]
    ids = torch.tensor([0, 3, 1])
    assert M.answer_logit(logits, ids).tolist() == [[0.0, 7.0, 9.0], [12.0, 19.0, 21.0]]


def test_indirect_effect_matches_stolfo_formula():
    clean = torch.log(torch.tensor([[0.6, 0.3, 0.1]]))
    patched = torch.log(torch.tensor([[[0.2, 0.7, 0.1]], [[0.6, 0.3, 0.1]]]))
    r, r_cf = torch.tensor([0]), torch.tensor([1])
    ie = M.indirect_effect(clean, patched, r, r_cf)
    expected = 0.5 * ((0.7 - 0.3) / 0.3 + (0.6 - 0.2) / 0.2)
    assert ie.shape == (2, 1)
    assert math.isclose(float(ie[0, 0]), expected, rel_tol=1e-5)
    assert abs(float(ie[1, 0])) < 1e-6  # no change, no effect


def test_normalized_logit_and_faithfulness():
    logits = torch.tensor([[2.0, 4.0, 1.0], [3.0, 1.0, 0.5]])
    nl = M.normalized_logit_from_logits(logits, torch.tensor([0, 0]))
    assert torch.allclose(nl, torch.tensor([0.5, 1.0]))
    assert M.normalized_logit(torch.tensor(1.0), torch.tensor(4.0)) == 0.25
    assert math.isclose(M.faithfulness(0.8, 1.0, 0.2), 0.75)
    assert M.faithfulness(torch.tensor([0.7, 0.9]), torch.tensor([1.0]), 0.2) == pytest.approx(0.75, rel=1e-6)
    assert M.faithfulness(1.0, 1.0, 0.2) == 1.0 and M.faithfulness(0.2, 1.0, 0.2) == 0.0
    with pytest.raises(ValueError, match="undefined"):
        M.faithfulness(0.5, 0.3, 0.3)


def test_accuracy():
    logits = torch.tensor([[[1.0, 2.0], [3.0, 0.0]], [[0.0, 1.0], [0.0, 1.0]]])
    ids = torch.tensor([1, 0])
    assert M.accuracy_from_logits(logits, ids).tolist() == [1.0, 0.5]
    assert M.top1_accuracy(torch.tensor([1, 1, 0]), torch.tensor([1, 0, 0])).item() == pytest.approx(2 / 3)
