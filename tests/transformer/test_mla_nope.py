"""Multi-latent attention without RoPE (``--no-rope-freq``, megatron-core's ``no_rope_freq``) is transformers 5.25's
``KimiLinearAttention``: Kimi-Linear's MLA layers, whose shared key part (``qk_rope_head_dim``) stays unrotated.

One process (`run_code`), both megatron releases, fp32: cp_ext's `ContextParallelMLASelfAttention` with the seats
`cp_ext.models.gpt_moe.fill_seats` gives it (kv norm, no q-LoRA, cp_ext's core attention) and transformers' weights
(``q_proj``, ``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``, ``o_proj``: megatron's per-head layouts are
transformers' own) equals transformers' layer with a causal mask: output, input gradient and every weight gradient
to 1e-5 of the largest reference value (in fp64 the two agree to 1e-15). The same layer with RoPE on
(``no_rope_freq`` [0]) does not. transformers builds ``kv_a_layernorm`` with its RMSNorm's default eps, 1e-6, whatever
``rms_norm_eps`` says (Kimi-Linear's is 1e-5), and megatron has one ``--norm-epsilon``: the test uses 1e-6 for both.
Whole models under CP: tests/training/test_kimi_linear_training.py.
"""

import json
import textwrap

import pytest

from tests.launch import one_rank_megatron, run_code

SINGLE = """
import json
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.transformer_config import MLATransformerConfig
from transformers import KimiLinearConfig
from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearAttention
from cp_ext.transformer.attention import CoreAttention
from cp_ext.transformer.mla import ContextParallelMLASelfAttention
from cp_ext.transformer.norms import SequenceParallelNorm
torch.set_num_threads(1)
HIDDEN, HEADS, NOPE, ROPE, V, RANK, EPS = 32, 4, 12, 6, 10, 16, 1e-6
hf_config = KimiLinearConfig(hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=HEADS,
                             num_hidden_layers=1, q_lora_rank=None, kv_lora_rank=RANK, qk_nope_head_dim=NOPE,
                             qk_rope_head_dim=ROPE, v_head_dim=V, rms_norm_eps=EPS, layer_types=["full_attention"])
hf_config._attn_implementation = "eager"
torch.manual_seed(0)
hf = KimiLinearAttention(hf_config, 0)
with torch.no_grad():
    hf.kv_a_layernorm.weight.normal_(1.0, 0.2)
names = {"linear_q_proj.weight": "q_proj.weight", "linear_kv_down_proj.weight": "kv_a_proj_with_mqa.weight",
         "kv_layernorm.weight": "kv_a_layernorm.weight", "linear_kv_up_proj.weight": "kv_b_proj.weight",
         "linear_proj.weight": "o_proj.weight"}

def build(no_rope):
    spec = get_gpt_layer_local_spec(multi_latent_attention=True).submodules.self_attention
    spec.submodules.core_attention = CoreAttention
    spec.submodules.kv_layernorm, spec.submodules.q_layernorm = SequenceParallelNorm, IdentityOp
    config = MLATransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=HEADS, kv_lora_rank=RANK,
                                  qk_head_dim=NOPE, qk_pos_emb_head_dim=ROPE, v_head_dim=V, q_lora_rank=None,
                                  normalization="RMSNorm", layernorm_epsilon=EPS, qk_layernorm=True,
                                  add_bias_linear=False, attention_dropout=0.0, rope_type="rope",
                                  rotary_scaling_factor=1.0, mscale=1.0, mscale_all_dim=0.0, no_rope_freq=[no_rope])
    config.cp_layout, config.cp_comm_types, config.cp_mla_exchange = "zigzag", None, "auto"
    module = ContextParallelMLASelfAttention(config, spec.submodules, layer_number=1,
                                             attn_mask_type=AttnMaskType.causal)
    state = module.state_dict()
    module.load_state_dict({**state, **{k: hf.state_dict()[names[k]] for k in names}}, strict=True)
    return module

b, s = 2, 24
x = torch.randn(b, s, HIDDEN)
dy = torch.randn(b, s, HIDDEN)
mask = torch.full((s, s), float("-inf")).triu(1).expand(b, 1, s, s)
x_hf = x.clone().requires_grad_()
y_hf, _ = hf(x_hf, mask)
y_hf.backward(dy)
def rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp(min=1)).item()
results = {}
for no_rope in (1, 0):
    module = build(no_rope)
    x_meg = x.transpose(0, 1).clone().requires_grad_()
    y, _ = module(x_meg, attention_mask=None)
    y.backward(dy.transpose(0, 1))
    err = {"out": rel(y.transpose(0, 1), y_hf), "dx": rel(x_meg.grad.transpose(0, 1), x_hf.grad)}
    params = dict(module.named_parameters())
    err.update({f"grad {k}": rel(params[k].grad, dict(hf.named_parameters())[v].grad) for k, v in names.items()})
    results["nope" if no_rope else "rope"] = err
print("RESULTS " + json.dumps(results))
"""


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mla_nope")
    proc = run_code(one_rank_megatron(tmp, cp_ext_groups=True) + textwrap.dedent(SINGLE))
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS ")][-1]
    return json.loads(line[len("RESULTS "):])


@pytest.mark.quick
def test_nope_mla_equals_transformers_kimi_linear_attention(single):
    bad = {k: v for k, v in single["nope"].items() if not v <= 1e-5}
    assert not bad and len(single["nope"]) == 7, (bad, single["nope"])


def test_rope_layer_differs(single):
    """The comparison sees the rotation: the same weights with RoPE on are not transformers' NoPE layer."""
    assert single["rope"]["out"] > 1e-3, single["rope"]
