"""The float64 reference of DeepSeek-V4's attention (`reference.py`) and cp_ext's path at CP = 1 against
transformers' own ``DeepseekV4Attention`` (5.25), one layer of each type, float64, random weights (the
sinks and position biases too, which transformers initialises to 0).

The reference takes per-token tensors; this test makes them with the transformers module's own
projections, norms and RoPE, and finishes with its inverse RoPE and grouped output projection, so what is
compared is the layer's output. Random indexer inputs leave no exact tie at the top-k boundary (the test
asserts the gap), so transformers' ``topk`` and the reference's earliest-first rule select alike.
"""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from tests.attention.compressed import reference as ref  # noqa: E402
from tests.attention.compressed.test_context_parallel import TOPK, run_layer  # noqa: E402

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.deepseek_v4")

S, WINDOW = 37, 8
# transformers computes RoPE's cos/sin and the compressor's softmax in fp32 even in a float64 module: its
# float64 output is fp32-accurate there (measured 1.6e-7 at CSA; 0 at the sliding layer, which has neither)
TOLERANCE = 1e-6
KINDS = {"sliding": "sliding_attention", "csa": "compressed_sparse_attention", "hca": "heavily_compressed_attention"}


def hf_layer(kind):
    from transformers import DeepseekV4Config
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Attention, DeepseekV4RotaryEmbedding

    config = DeepseekV4Config(
        vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=ref.HEADS, head_dim=ref.D,
        partial_rotary_factor=ref.ROPE / ref.D, q_lora_rank=12, o_groups=2, o_lora_rank=8, index_n_heads=ref.IDX_HEADS,
        index_head_dim=ref.DI, index_topk=TOPK, sliding_window=WINDOW, layer_types=[KINDS[kind]],
        compress_rates={"compressed_sparse_attention": ref.RATES["csa"], "heavily_compressed_attention": ref.RATES["hca"]},
        mlp_layer_types=["moe"], n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, rms_norm_eps=ref.EPS)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    layer = DeepseekV4Attention(config, 0).double()
    with torch.no_grad():
        for name, p in layer.named_parameters():
            p.normal_(0, 0.3 if "bias" in name or "sinks" in name else 0.2)
            if name.endswith("norm.weight"):
                p.add_(1.0)
    return config, layer, DeepseekV4RotaryEmbedding(config).double()


def per_token_inputs(layer, rotary, hidden, kind, rotate=True):
    """The reference's inputs from transformers' modules: q, kv (normed, RoPE unless not ``rotate``), the
    compressors' rows."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import apply_rotary_pos_emb as hf_rope

    def apply_rotary_pos_emb(x, cos, sin):  # unrotated for cp_ext's layer path: compressed_attention rotates
        return hf_rope(x, cos, sin) if rotate else x

    positions = torch.arange(S).unsqueeze(0)
    rope_type = "main" if kind == "sliding" else "compress"
    cos, sin = rotary(hidden, positions, layer_type=rope_type)
    q_res = layer.q_a_norm(layer.q_a_proj(hidden))
    q = layer.q_b_norm(layer.q_b_proj(q_res).view(1, S, -1, ref.D).transpose(1, 2))
    q = apply_rotary_pos_emb(q, cos, sin).transpose(1, 2)[0]
    kv = apply_rotary_pos_emb(layer.kv_norm(layer.kv_proj(hidden)).view(1, S, 1, ref.D).transpose(1, 2), cos, sin)[0, 0]
    t = {"q": q, "kv": kv, "sinks": layer.sinks}
    if kind != "sliding":
        c = layer.compressor
        t.update(comp_rows=torch.cat([c.kv_proj(hidden), c.gate_proj(hidden)], -1)[0], comp_bias=c.position_bias,
                 comp_norm=c.kv_norm.weight)
    if kind == "csa":
        ix = layer.compressor.indexer
        cos_c, sin_c = rotary(hidden, positions, layer_type="compress")
        q_idx = ix.q_b_proj(q_res).view(1, S, -1, ref.DI).transpose(1, 2)
        t.update(idx_rows=torch.cat([ix.kv_proj(hidden), ix.gate_proj(hidden)], -1)[0], idx_bias=ix.position_bias,
                 idx_norm=ix.kv_norm.weight, idx_q=apply_rotary_pos_emb(q_idx, cos_c, sin_c).transpose(1, 2)[0],
                 idx_w=ix.scorer.weights_proj(hidden)[0] * ix.scorer.weights_scaling * ix.scorer.softmax_scale)
    return t, cos, sin


def finish(layer, out, cos, sin):
    """transformers' inverse RoPE at the query and grouped output projection, on out [S, H, D]."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import apply_rotary_pos_emb

    out = apply_rotary_pos_emb(out.unsqueeze(0), cos, -sin, unsqueeze_dim=2)
    return layer.o_b_proj(layer.o_a_proj(out.reshape(1, S, layer.config.o_groups, -1)).flatten(2))[0]


@pytest.mark.parametrize("kind", list(KINDS))
def test_reference_is_transformers(kind):
    config, layer, rotary = hf_layer(kind)
    hidden = torch.randn(1, S, config.hidden_size, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    i = torch.arange(S)
    allowed = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - WINDOW)
    mask = torch.zeros(1, 1, S, S, dtype=torch.float64).masked_fill(~allowed, float("-inf"))
    embeddings = {name: rotary(hidden, i.unsqueeze(0), layer_type=name) for name in ("main", "compress")}
    with torch.no_grad():
        want, _ = layer(hidden, embeddings, i.unsqueeze(0), mask)
        t, cos, sin = per_token_inputs(layer, rotary, hidden, kind)
        got_reference = finish(layer, ref.reference(t, kind, WINDOW, TOPK, [S]), cos, sin)
        case = dict(kind=kind, window=WINDOW, s=S)
        got_cp_ext = finish(layer, run_layer(t, case, torch.arange(S), None), cos, sin)
        # the layer's path: unrotated inputs, compressed_attention rotates (and rotates the output back)
        raw, _, _ = per_token_inputs(layer, rotary, hidden, kind, rotate=False)
        freq = rotary.main_inv_freq if kind == "sliding" else rotary.compress_inv_freq
        rotating = run_layer(raw, case, torch.arange(S), None, rope_inv_freq=freq.double())
        got_rotating = layer.o_b_proj(layer.o_a_proj(rotating.reshape(1, S, config.o_groups, -1)).flatten(2))[0]
    assert (got_reference - want[0]).abs().max().item() < TOLERANCE
    assert (got_cp_ext - want[0]).abs().max().item() < TOLERANCE
    assert (got_rotating - want[0]).abs().max().item() < TOLERANCE
    if kind == "csa":
        ties, gap = ref.selection_gaps(t, "csa", TOPK, [S])
        assert ties == 0 and 1e-6 < gap < 1, (ties, gap)
