"""The model's readout, read in one place for every method: the final norm as a formula
(:class:`FinalNorm`) and the unembedding ``(W_U, b_U)``, both float32. CNA's importance,
the gender-bias edit, direct logit attribution, the neurons' logit lens and the probes'
cosines all unembed through these."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..engine import wrapped


@dataclass(frozen=True)
class FinalNorm:
    """The final normalisation as a formula: ``kind`` "rms" (x / sqrt(mean x^2 + eps) * weight)
    or "layer" ((x - mean) / sqrt(var + eps) * weight + bias)."""

    kind: str
    weight: torch.Tensor
    bias: torch.Tensor | None
    eps: float

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        if self.kind == "layer":
            x = x - x.mean(-1, keepdim=True)
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight
        return y + self.bias if self.bias is not None else y


def final_norm(model) -> FinalNorm:
    """The model's final norm (``ln_final``) read from its module: RMSNorm (with Gemma's
    1 + weight offset when the config says so) or LayerNorm; anything else raises. The
    epsilon is the module's own (``variance_epsilon``: Qwen2, Llama, Mistral RMSNorm;
    ``eps``: Gemma RMSNorm, torch LayerNorm of GPT-2, GPT-J, Pythia); a module with
    neither raises rather than assume one."""
    module = model.ln_final
    comp = wrapped(module)
    weight = comp.weight.detach().float()
    eps = next((getattr(comp, a) for a in ("variance_epsilon", "eps") if getattr(comp, a, None) is not None), None)
    if eps is None:
        raise NotImplementedError(
            f"final norm {type(comp).__name__} has no epsilon attribute (variance_epsilon or "
            "eps): add the name of its epsilon attribute to arithlib.core.readout.final_norm"
        )
    name = type(comp).__name__.lower()
    if "rms" in name:
        if getattr(model.cfg, "rmsnorm_uses_offset", False):
            weight = 1.0 + weight
        return FinalNorm("rms", weight, None, float(eps))
    if isinstance(comp, torch.nn.LayerNorm) or "layernorm" in name:
        bias = comp.bias.detach().float() if getattr(comp, "bias", None) is not None else None
        return FinalNorm("layer", weight, bias, float(eps))
    raise NotImplementedError(f"final norm {type(comp).__name__} is neither RMSNorm nor LayerNorm")


def unembedding(model) -> tuple[torch.Tensor, torch.Tensor]:
    """``(W_U [d_model, vocab], b_U [vocab])`` as applied after the final norm (float32).
    Qwen2.5-Coder-0.5B as packaged here does NOT tie W_U to W_E; this reads the
    unembedding the model actually uses either way."""
    W_U = model.W_U.detach().float()
    try:
        b_U = model.b_U.detach().float()
    except (AttributeError, RuntimeError):
        b_U = torch.zeros(W_U.shape[1], device=W_U.device)
    return W_U, b_U


def vocab_logits(model, vectors: torch.Tensor) -> torch.Tensor:
    """Projection of residual-space vectors [n, d] on the vocabulary, E_u v, through the
    final norm's weight (scale-free: the norm's 1/rms does not change the ranking)."""
    norm = final_norm(model)
    W_U, _ = unembedding(model)
    return (vectors.float().to(W_U.device) * norm.weight) @ W_U


def top_tokens(model, tokenizer, vectors: torch.Tensor, k: int = 10) -> list[list[str]]:
    """The ``k`` top tokens of softmax(E_u v) for each vector (Geva et al. 2022; Yu Table 4)."""
    idx = vocab_logits(model, vectors).topk(k, dim=-1).indices.cpu().tolist()
    return [[tokenizer.decode([i]).strip() or repr(tokenizer.decode([i])) for i in row] for row in idx]
