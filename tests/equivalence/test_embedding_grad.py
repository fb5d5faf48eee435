"""The embeddings' gradients added into buffers kept for a training
(:func:`arithlib.engine.kept_gradients`: the input embedding's rows, the unembedding's
product) against torch's own backward, the literal reference: the same gradients and the
same full-SFT weights up to the order in which a repeated token's rows are summed, and
no vocabulary-sized embedding backward per step."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import arithlib.methods.finetune as ft
import arithlib.methods.finetune_data as fd
import arithlib.methods.model_weights as mw
import arithlib.zhang.sft as SFT
from arithlib.core.models import load_model
from arithlib.core.prompt_sets import PromptSet
from arithlib.core.random_models import random_model_dir
from arithlib.engine import KeptGradients, counting, kept_gradients, wrapped
from arithlib.methods.answer_loss import answer_loss

pytestmark = pytest.mark.usefixtures("one_thread")

CFG = ft.TrainConfig(lr=1e-2, epochs=1, batch_size=8, seed=0)


class _DenseEmbeddingBackwards(TorchDispatchMode):
    """Counts torch's dense embedding backward (a new vocabulary-sized matrix each call)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._overloadpacket is torch.ops.aten.embedding_dense_backward:
            self.calls += 1
        return func(*args, **kwargs or {})


def _graph_nodes(fn) -> set[str]:
    """The class names of the autograd nodes ``fn`` reaches."""
    seen, names, todo = set(), set(), [fn]
    while todo:
        f = todo.pop()
        if f is None or id(f) in seen:
            continue
        seen.add(id(f))
        names.add(type(f).__name__)
        todo += [g for g, _ in f.next_functions]
    return names


@contextmanager
def _dense(model, trained):
    """The literal reference: no weight chosen, torch's own backward for both embeddings."""
    yield KeptGradients()


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def model(request):
    """Tiny random models: Qwen2's ties its input and output embeddings, Llama's does not."""
    return load_model(str(random_model_dir(request.param)))


@pytest.fixture(scope="module")
def train(model):
    splits = fd.yu_lora_data(n_train=24, n_test=8, n_val=8, seed=0, fewshot=2)
    return PromptSet.build(splits["train"], model.tokenizer)


def test_kept_gradients_equal_torch_backward(model, train):
    hf = ft.shared_hf_model(model.bridge)
    params = list({p.data_ptr(): p for p in hf.parameters()}.values())
    emb = hf.get_input_embeddings().weight
    head = hf.get_output_embeddings().weight
    with mw.training_state(hf), torch.enable_grad():
        for p in params:
            p.requires_grad_(True)
        index = list(range(8))
        for p in params:
            p.grad = None
        answer_loss(hf, train, index).backward()
        dense = {id(p): p.grad.clone() for p in params}
        for p in params:
            p.grad = None
        with kept_gradients(hf, params) as rows:
            kept = {id(w) for w in rows.weights}
            assert kept == {id(emb), id(head)}  # one buffer for a tied pair
            assert all(m.sparse for m in hf.get_input_embeddings().modules() if isinstance(m, torch.nn.Embedding))
            rows.zero_()
            loss = answer_loss(hf, train, index)
            assert "_LinearIntoBufferBackward" in _graph_nodes(loss.grad_fn)  # the unembedding's product goes in place
            loss.backward()
        assert not any(m.sparse for m in hf.get_input_embeddings().modules() if isinstance(m, torch.nn.Embedding))
        assert "forward" not in vars(wrapped(hf.get_output_embeddings()))  # the class's forward again
        for p in params:
            assert p.grad.layout == torch.strided
            torch.testing.assert_close(p.grad, dense[id(p)], rtol=1e-5, atol=1e-7)


def test_full_sft_with_kept_gradients_equals_the_dense_backward_and_runs_none(model, train, monkeypatch):
    counted = _DenseEmbeddingBackwards()
    with counted:
        fast = SFT.full_sft(model.bridge, train, CFG, progress=False)
    assert counted.calls == 0  # torch's backward runs one per step
    monkeypatch.setattr(ft, "kept_gradients", _dense)
    literal_count = _DenseEmbeddingBackwards()
    with literal_count:
        literal = SFT.full_sft(model.bridge, train, CFG, progress=False)
    assert literal_count.calls == len(fast.history)
    assert set(fast.weights) == set(literal.weights)
    for name in literal.weights:
        torch.testing.assert_close(fast.weights[name], literal.weights[name], rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(
        torch.tensor(fast.history["loss"].to_numpy()),
        torch.tensor(literal.history["loss"].to_numpy()),
        rtol=1e-5,
        atol=1e-6,
    )


def test_no_buffers_for_a_pass_that_starts_above_the_embeddings(model, train):
    """Precise SFT trains block weights only: no embedding is chosen, and a trained
    embedding that is not passed (the caller's passes start above it) is left alone."""
    hf = ft.shared_hf_model(model.bridge)
    block_weights = [p for n, p in mw.params_by_clean_name(hf).items() if ".layers." in n]
    with kept_gradients(hf, block_weights) as rows:
        assert rows.weights == []
    with kept_gradients(hf, ()) as rows:
        rows.zero_()
        assert rows.weights == []


def test_kept_gradients_count_the_same_arithmetic(model, train):
    """The run's floor reads the FLOPs a training dispatched: the unembedding's product into
    its buffer counts as torch's own backward's does."""
    counts = []
    for way in (kept_gradients, _dense):
        hf = ft.shared_hf_model(model.bridge)
        params = list({p.data_ptr(): p for p in hf.parameters()}.values())
        with mw.training_state(hf), torch.enable_grad(), way(hf, params) as kept, counting() as c:
            for p in params:
                p.requires_grad_(True)
                p.grad = None
            kept.zero_()
            answer_loss(hf, train, list(range(8))).backward()
            counts.append(c.flops)
    assert counts[0] == counts[1] > 0
