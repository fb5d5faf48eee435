"""arithlib.core.readout: the final norm as a formula and the unembedding reproduce the
model's own logits, for RMSNorm and LayerNorm models and each architecture's epsilon;
every method that unembeds reads them from here."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from arithlib.core.models import load_model
from arithlib.core.random_models import RANDOM_ARCHS, random_model_dir
from arithlib.core.readout import final_norm, unembedding


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def tiny(request):
    return load_model(str(random_model_dir(request.param)))


def test_final_norm_and_unembedding_reproduce_logits(tiny):
    b = tiny.bridge
    tokens = torch.tensor([[2, 5, 6, 7, 8, 9]])
    store = {}

    def grab(x, hook):
        store["x"] = x.clone()
        return x

    hooks = [(f"blocks.{tiny.info.n_layers - 1}.hook_resid_post", grab)]
    with torch.no_grad(), b.hooks(fwd_hooks=hooks):
        logits = b(tokens)
    W_U, b_U = unembedding(b)
    norm = final_norm(b)
    assert torch.allclose(norm(store["x"]) @ W_U + b_U, logits, atol=1e-4)
    with torch.no_grad():
        assert torch.allclose(norm(store["x"]), b.ln_final(store["x"]).float(), atol=1e-5)


def test_layernorm_final_norm(tmp_path):
    m = load_model(str(random_model_dir("gpt2")))
    norm = final_norm(m.bridge)
    assert norm.kind == "layer"
    x = torch.randn(3, m.info.d_model)
    with torch.no_grad():
        assert torch.allclose(norm(x), m.bridge.ln_final(x[:, None])[:, 0].float(), atol=1e-5)


@pytest.mark.parametrize("arch", RANDOM_ARCHS)
def test_final_norm_reads_each_architectures_epsilon(arch):
    m = load_model(str(random_model_dir(arch)))
    cfg = m.bridge.original_model.config
    eps = next(getattr(cfg, a) for a in ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon") if hasattr(cfg, a))
    norm = final_norm(m.bridge)
    assert norm.eps == eps
    x = torch.randn(3, m.info.d_model)
    with torch.no_grad():
        assert torch.allclose(norm(x), m.bridge.ln_final(x[:, None])[:, 0].float(), atol=1e-5)


def test_final_norm_without_an_epsilon_raises():
    class OddRMSNorm(torch.nn.Module):  # an RMSNorm whose epsilon is under an unknown name
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(4))
            self.epsilon = 1e-6

    with pytest.raises(NotImplementedError, match="OddRMSNorm has no epsilon attribute"):
        final_norm(SimpleNamespace(ln_final=OddRMSNorm(), cfg=SimpleNamespace()))
