"""cp_ext.transformer.norms: the SP marking that makes megatron sum norm grads over TP.

The multi-rank half of the check (TP=2 with SP gives TP=1's losses and norm gradients)
runs in tests/training/test_grid_equivalence.py, layout tp2sp_dp2.
"""

import pytest
import torch

from megatron.core.transformer.transformer_config import TransformerConfig

from cp_ext.transformer.norms import SequenceParallelNorm


def _config(**kw):
    base = dict(num_layers=1, hidden_size=16, num_attention_heads=2, normalization="RMSNorm")
    base.update(kw)
    return TransformerConfig(**base)


@pytest.mark.quick
@pytest.mark.parametrize("normalization,cls", [("LayerNorm", torch.nn.LayerNorm), ("RMSNorm", torch.nn.RMSNorm)])
@pytest.mark.parametrize("sp", [False, True])
def test_norm_kind_and_sp_marking(normalization, cls, sp):
    cfg = _config(normalization=normalization, tensor_model_parallel_size=2 if sp else 1, sequence_parallel=sp)
    norm = SequenceParallelNorm(cfg, hidden_size=16, eps=1e-6)
    assert isinstance(norm, cls) and norm.eps == 1e-6
    assert all(getattr(p, "sequence_parallel") is sp for p in norm.parameters())
    x = torch.randn(5, 3, 16)
    ref = cls(16, eps=1e-6)
    assert torch.allclose(norm(x), ref(x))


@pytest.mark.parametrize("normalization,cls", [("LayerNorm", torch.nn.LayerNorm), ("RMSNorm", torch.nn.RMSNorm)])
def test_zero_centered_gamma_scales_by_one_plus_weight(normalization, cls):
    """--apply-layernorm-1p: the weight starts at 0, the gain is 1 + weight (input and weight gradients too)."""
    norm = SequenceParallelNorm(_config(normalization=normalization, layernorm_zero_centered_gamma=True),
                                hidden_size=16, eps=1e-6)
    assert isinstance(norm, cls) and torch.equal(norm.weight, torch.zeros(16))
    with torch.no_grad():
        norm.weight.normal_()
    ref = cls(16, eps=1e-6)
    with torch.no_grad():
        ref.weight.copy_(norm.weight + 1)
    x = torch.randn(5, 3, 16, requires_grad=True)
    out, ref_out = norm(x), ref(x)
    assert torch.allclose(out, ref_out, atol=1e-6)
    grad_x, grad_w = torch.autograd.grad(out.square().sum(), (x, norm.weight))
    ref_x, ref_w = torch.autograd.grad(ref_out.square().sum(), (x, ref.weight))
    assert torch.allclose(grad_x, ref_x, atol=1e-5) and torch.allclose(grad_w, ref_w, atol=1e-5)
