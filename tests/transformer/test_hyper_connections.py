"""DeepSeek-V4's hyper-connections (`cp_ext.transformer.hyper_connections`) against transformers'
``DeepseekV4HyperConnection`` / ``DeepseekV4HyperHead`` and its decoder layer's mixing, float64, random weights
(transformers initialises the biases to 0 and the scales to 1; here all are random, so every term counts).

The whole model's hyper-connections under every grid: tests/training/test_deepseek_v4_training.py.
"""

import pytest
import torch

pytest.importorskip("transformers.models.deepseek_v4")

N, HIDDEN, ITERATIONS = 4, 8, 20
TOLERANCE = 1e-6  # transformers mixes in fp32 (``.float()``) even in a float64 module; cp_ext in float64 here


def _config():
    from cp_ext.config import ContextParallelTransformerConfig

    return ContextParallelTransformerConfig(num_layers=2, hidden_size=HIDDEN, num_attention_heads=2,
                                            enable_hyper_connections=True, num_residual_streams=N,
                                            mhc_sinkhorn_iterations=ITERATIONS, use_cpu_initialization=True,
                                            layernorm_epsilon=1e-6)


def _hf_config():
    from transformers import DeepseekV4Config

    return DeepseekV4Config(hidden_size=HIDDEN, hc_mult=N, hc_sinkhorn_iters=ITERATIONS, hc_eps=1e-6, rms_norm_eps=1e-6,
                            num_hidden_layers=1, vocab_size=16)


def _randomize(*modules):
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for module in modules:
            for p in module.parameters():
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.5)


def _pair(ours_class, theirs_class, names):
    """cp_ext's module with random weights and transformers' with the same (``names``: theirs for mix_weight,
    mix_bias, mix_scale), both float64."""
    ours, theirs = ours_class(_config()).double(), theirs_class(_hf_config()).double()
    _randomize(ours)
    with torch.no_grad():
        for mine, their in zip(("mix_weight", "mix_bias", "mix_scale"), names):
            getattr(theirs, their).copy_(getattr(ours, mine))
    return ours, theirs


def test_mixings_are_transformers():
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HyperConnection

    from cp_ext.transformer.hyper_connections import HyperConnection, mix_back

    ours, theirs = _pair(HyperConnection, DeepseekV4HyperConnection, ("fn", "base", "scale"))
    streams = torch.randn(2, 5, N, HIDDEN, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    block = torch.randn(2, 5, HIDDEN, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    post, comb, collapsed = ours(streams)
    want_post, want_comb, want_collapsed = theirs(streams)
    for got, want in ((post, want_post), (comb, want_comb), (collapsed, want_collapsed)):
        assert (got - want).abs().max().item() < TOLERANCE
    # Sinkhorn, columns last (each normalization adds eps to the sum)
    assert (comb.sum(-1) - 1).abs().max().item() < 1e-3 and (comb.sum(-2) - 1).abs().max().item() < 1e-4
    # transformers' DeepseekV4DecoderLayer: post * output + comb^T @ streams
    want = want_post.unsqueeze(-1) * block.unsqueeze(-2) + torch.matmul(want_comb.transpose(-1, -2), streams)
    assert (mix_back(streams, block, post, comb) - want).abs().max().item() < TOLERANCE


def test_head_is_transformers():
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HyperHead

    from cp_ext.transformer.hyper_connections import HyperHead

    ours, theirs = _pair(HyperHead, DeepseekV4HyperHead, ("hc_fn", "hc_base", "hc_scale"))
    streams = torch.randn(3, 2, N, HIDDEN, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    assert (ours(streams) - theirs(streams)).abs().max().item() < TOLERANCE


def test_sinkhorn_iterations_take_effect():
    """--mhc-sinkhorn-iterations changes the mixing (1 normalizes the columns only)."""
    from cp_ext.transformer.hyper_connections import HyperConnection

    config = _config()
    many = HyperConnection(config).double()
    config.mhc_sinkhorn_iterations = 1
    one = HyperConnection(config).double()
    _randomize(many)
    one.load_state_dict(many.state_dict())
    streams = torch.randn(4, N, HIDDEN, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    _, comb_many, _ = many(streams)
    _, comb_one, _ = one(streams)
    assert (comb_one.sum(-2) - 1).abs().max().item() < 1e-4
    assert (comb_many - comb_one).abs().max().item() > 1e-3


@pytest.mark.parametrize("normalization, zero_centered", [("RMSNorm", False), ("LayerNorm", False),
                                                          ("RMSNorm", True), ("LayerNorm", True)])
def test_streams_final_norm_is_the_usual_norm_applied_later(normalization, zero_centered):
    """With MTP the final-norm seat hands the streams on (forward is the identity) and `normalize` is the norm the seat
    holds otherwise (`SequenceParallelNorm`): the same parameter names and, with the same values, the same output."""
    from cp_ext.transformer.hyper_connections import StreamsFinalNorm
    from cp_ext.transformer.norms import SequenceParallelNorm

    config = _config()
    config.normalization, config.layernorm_zero_centered_gamma = normalization, zero_centered
    usual, deferred = SequenceParallelNorm(config, HIDDEN, eps=1e-6), StreamsFinalNorm(config, HIDDEN, eps=1e-6)
    assert sorted(dict(usual.named_parameters())) == sorted(dict(deferred.named_parameters()))
    assert torch.equal(usual.weight, deferred.weight)  # the same initial gain (0 when zero-centered)
    _randomize(usual)
    deferred.load_state_dict(usual.state_dict())
    x = torch.randn(5, 2, HIDDEN, generator=torch.Generator().manual_seed(8))
    assert deferred(x) is x
    assert torch.equal(deferred.normalize(x), usual(x))
