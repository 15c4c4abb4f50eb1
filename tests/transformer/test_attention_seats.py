"""CoreAttention in megatron's seats: MLA's head dims, ``softmax_offset`` and per-layer windows (CP = 1).

One process of its own (`run_code`): megatron's own ``MLASelfAttention`` built with cp_ext's
CoreAttention as its core attention (it passes ``k_channels`` / ``v_channels``); the sink under
megatron's name and shape for ``softmax_type`` off-by-one and learnable; ``window_size`` on the
layers ``is_layer_window_attention`` selects. Every output is checked against explicit float64
attention with the same mask and sink (tests/attention/masks/test_masked_attention.py's reference).
"""

import textwrap

import pytest

from tests.launch import one_rank_megatron, run_code


@pytest.mark.quick
def test_mla_sink_and_window_seats(tmp_path):
    code = one_rank_megatron(tmp_path) + textwrap.dedent("""
        from megatron.core.transformer.enums import AttnMaskType
        from megatron.core.transformer.transformer_config import MLATransformerConfig
        from megatron.core.transformer.multi_latent_attention import MLASelfAttention
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from cp_ext.config import ContextParallelTransformerConfig
        from cp_ext.transformer.attention import CoreAttention
        from tests.attention.reference import explicit_attention
        g = torch.Generator().manual_seed(0)
        s, b, h = 24, 2, 4
        def mask(window):
            i, j = torch.arange(s)[:, None], torch.arange(s)[None, :]
            m = j <= i
            if window is not None:
                m &= j >= i - window[0]
            return m.expand(b, s, s)

        # 1. MLA: megatron's MLASelfAttention builds cp_ext's CoreAttention with k_channels / v_channels
        spec = get_gpt_layer_local_spec(multi_latent_attention=True).submodules.self_attention
        spec.submodules.core_attention = CoreAttention
        mla_cfg = MLATransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=h, q_lora_rank=None,
                                       kv_lora_rank=16, qk_head_dim=12, qk_pos_emb_head_dim=6, v_head_dim=10,
                                       rope_type="rope", normalization="RMSNorm", params_dtype=torch.float64,
                                       attention_dropout=0.0)
        mla = MLASelfAttention(mla_cfg, spec.submodules, layer_number=1, attn_mask_type=AttnMaskType.causal)
        core = mla.core_attention
        assert isinstance(core, CoreAttention)  # built with MLA's k_channels=18, v_channels=10
        x = torch.randn(s, b, 32, generator=g, dtype=torch.float64)
        out, _ = mla.double()(x, attention_mask=None)
        assert out.shape == (s, b, 32) and torch.isfinite(out).all()
        q = torch.randn(s, b, h, 18, generator=g, dtype=torch.float64)
        k = torch.randn(s, b, h, 18, generator=g, dtype=torch.float64)
        v = torch.randn(s, b, h, 10, generator=g, dtype=torch.float64)
        got = core(q, k, v, attention_mask=None)
        want = explicit_attention(q, k, v, None, mask(None), core.softmax_scale or 18 ** -0.5).reshape(s, b, -1)
        assert got.shape == (s, b, h * 10) and (got - want).abs().max() < 1e-12, (got - want).abs().max()

        # 2. sinks under megatron's name and shape; 3. windows on the layers megatron selects
        def cfg(**kw):
            return ContextParallelTransformerConfig(num_layers=4, hidden_size=32, num_attention_heads=h,
                                                    num_query_groups=2, attention_dropout=0.0,
                                                    params_dtype=torch.float64, **kw)
        q = torch.randn(s, b, h, 8, generator=g, dtype=torch.float64)
        k, v = (torch.randn(s, b, 2, 8, generator=g, dtype=torch.float64) for _ in range(2))
        vanilla = CoreAttention(cfg(), 1, AttnMaskType.causal, "self")(q, k, v, attention_mask=None)
        for kind in ("off-by-one", "learnable"):
            attn = CoreAttention(cfg(softmax_type=kind), 1, AttnMaskType.causal, "self")
            off = attn.softmax_offset
            assert off.shape == (h,) and (isinstance(off, torch.nn.Parameter) == (kind == "learnable"))
            assert ("softmax_offset" in dict(attn.named_parameters())) == (kind == "learnable")
            assert ("softmax_offset" in attn.state_dict()) == (kind == "learnable")  # megatron keeps only the learned one
            if kind == "off-by-one":
                assert (off == 0).all()
            xs = [t.clone().requires_grad_() for t in (q, k, v)]
            got = attn(*xs, attention_mask=None)
            want = explicit_attention(q, k, v, off.detach(), mask(None), 8 ** -0.5).reshape(s, b, -1)
            assert (got - want).abs().max() < 1e-12 and (got - vanilla).abs().max() > 1e-3, kind
            got.sum().backward()
            if kind == "learnable":
                assert off.grad is not None and off.grad.abs().min() > 0
        for layer, windowed in ((1, True), (2, False), (3, True), (4, False)):
            attn = CoreAttention(cfg(window_size=(5, 0), window_attn_skip_freq=2), layer, AttnMaskType.causal, "self")
            assert attn.window_size == ((5, 0) if windowed else None), (layer, attn.window_size)
            got = attn(q, k, v, attention_mask=None)
            want = explicit_attention(q, k, v, None, mask((5, 0) if windowed else None), 8 ** -0.5).reshape(s, b, -1)
            assert (got - want).abs().max() < 1e-12, layer
        attn = CoreAttention(cfg(window_size=(5, 0), window_attn_skip_freq=[1, 0, 0, 1]), 4, AttnMaskType.causal, "self")
        assert attn.window_size == (5, 0)
        print("SEATS OK")
    """)
    assert "SEATS OK" in run_code(code).stdout
