"""`ModelShape.from_args` counts the parameters megatron-core builds, exactly, for every family of
tests/families (MLA with and without q-LoRA, dense-first layers, shared experts, qk-norm,
kv_channels != hidden / heads, biases, sinks, Qwen3.5's Gated DeltaNet layers and gates), for Kimi-Linear's Kimi Delta
Attention hybrid (with and without q-LoRA), for DeepSeek-V4 (sliding, CSA and HCA layers, hyper-connections, CSA's
dense mode, no sinks) and for variants of the flags the scripts do not use
(LayerNorm, a QKV-only bias, learned positions, an integer --moe-layer-freq): per layer and in total.
All models are built in one process (one megatron import)."""

import json
import sys

import pytest

from cp_ext.arguments import parse_args
from cp_ext.perf.model_shape import ModelShape, layer_params, mtp_layer_params, total_params
from tests.families import FAMILIES, LINEAR_FAMILIES, tiny
from tests.training.test_deepseek_v4_training import V4
from tests.training.test_grid_equivalence import MODEL
from tests.launch import one_rank_megatron, run_code

VOCAB = 384  # what the trainer pads the byte tokenizer's 257 to (--make-vocab-size-divisible-by 128)
KIMI_LINEAR = [
    "--num-layers", "4", "--hidden-size", "32", "--ffn-hidden-size", "48", "--normalization", "RMSNorm", "--swiglu",
    "--disable-bias-linear", "--untie-embeddings-and-output-weights", "--seq-length", "64",
    "--max-position-embeddings", "64", "--micro-batch-size", "1", "--global-batch-size", "2",
    "--num-attention-heads", "4", "--multi-latent-attention", "--kv-lora-rank", "16", "--qk-head-dim", "8",
    "--qk-pos-emb-head-dim", "4", "--v-head-dim", "8", "--qk-layernorm", "--position-embedding-type", "none",
    "--rope-type", "rope", "--no-rope-freq", "1", "--experimental-attention-variant", "kda",
    "--linear-attention-freq", "[1,1,0,1]", "--linear-num-key-heads", "2", "--linear-num-value-heads", "2",
    "--linear-key-head-dim", "8", "--linear-value-head-dim", "8", "--linear-conv-kernel-dim", "4",
    "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "16", "--moe-layer-freq", "[0,1,1,1]",
    "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
    "--moe-shared-expert-intermediate-size", "16"]
def _drop(flags, *names):
    """``flags`` without the flags ``names`` and their values."""
    out, skipping = [], False
    for token in flags:
        if token.startswith("--"):
            skipping = token in names
        if not skipping:
            out.append(token)
    return out


# DeepSeek-V4: sliding, CSA, HCA, CSA layers with hyper-connections, hash MoE (tests/training's tiny V4); CSA in dense
# mode without sinks; without hyper-connections
DEEPSEEK_V4 = MODEL + V4
CASES = {family: tiny(family) for family in FAMILIES + LINEAR_FAMILIES}
CASES.update({
    "mixtral_layernorm_qkv_bias": tiny("mixtral_8x7b", "--normalization", "LayerNorm", "--add-qkv-bias"),
    "qwen3_learned_positions_moe_every_2nd": tiny("qwen3_30b_a3b", "--position-embedding-type", "learned_absolute",
                                                  "--moe-layer-freq", "2"),
    "deepseek_v2_lite_no_qk_layernorm": [t for t in tiny("deepseek_v2_lite") if t != "--qk-layernorm"],
    # the last layer linear (its MTP layer still softmax attention), a list pattern, a 3-tap conv, no gates
    "qwen3_5_last_layer_linear": [t for t in tiny("qwen3_5_397b_a17b", "--linear-attention-freq", "[1,0,1,1]",
                                                  "--linear-conv-kernel-dim", "3")
                                  if t not in ("--attention-output-gate", "--moe-shared-expert-gate")],
    # Kimi-Linear: Kimi Delta Attention layers beside NoPE MLA ones (the flags an import of the release gives, at toy
    # sizes), a dense first layer, shared experts; and with q-LoRA and a value head dim unlike the key's
    "kimi_linear": KIMI_LINEAR,
    "kimi_linear_q_lora_wide_values": KIMI_LINEAR + ["--q-lora-rank", "12", "--linear-value-head-dim", "12",
                                                     "--linear-attention-freq", "[0,1,1,1]", "--moe-layer-freq", "1"],
    "deepseek_v4": DEEPSEEK_V4,
    "deepseek_v4_dense_csa_no_sink_shared_expert": _drop(DEEPSEEK_V4, "--dsa-indexer-n-heads", "--dsa-indexer-head-dim",
                                                         "--dsa-indexer-topk")
    + ["--csa-dense-mode", "--csa-no-attention-sink", "--moe-shared-expert-intermediate-size", "24"],
    "deepseek_v4_no_hyper_connections": _drop(DEEPSEEK_V4, "--enable-hyper-connections", "--num-residual-streams",
                                              "--mhc-sinkhorn-iterations"),
})


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("shape")
    (tmp / "cases.json").write_text(json.dumps(CASES))
    code = one_rank_megatron(tmp, cp_ext_groups=True) + f"""
import json
from cp_ext.arguments import parse_args
from cp_ext.config import transformer_config_from_args
from cp_ext.models.gpt_moe import build_model
out = {{}}
for name, flags in json.loads(open("{tmp}/cases.json").read()).items():
    args = parse_args(flags)
    model = build_model(transformer_config_from_args(args), args, {VOCAB})
    layers = [sum(p.numel() for p in layer.parameters()) for layer in model.decoder.layers]
    out[name] = dict(total=sum(p.numel() for p in model.parameters()), layers=layers)
print("RESULT " + json.dumps(out))
"""
    proc = run_code(code, timeout=300)
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


@pytest.mark.parametrize("name", sorted(CASES))
def test_parameter_count_equals_the_built_model(name, built):
    shape = ModelShape.from_args(parse_args(CASES[name]), vocab=VOCAB)
    got = built[name]
    per_layer = [sum(layer_params(shape, i).values()) for i in range(shape.layers)]
    assert per_layer == got["layers"], (name, per_layer, got["layers"])
    assert total_params(shape) == got["total"], (name, total_params(shape), got["total"])


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))


def test_mtp_layers_counted_as_megatrons_gpt_model_builds_them(tmp_path):
    """cp_ext does not build MTP yet: megatron's own GPTModel with an MTP block (local spec), dense and
    MoE, against `mtp_layer_params` (enorm, hnorm, eh_proj, a layer like the last, its final norm)."""
    code = one_rank_megatron(tmp_path) + """
import json, torch.nn.functional as F
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_gpt_mtp_block_spec
from megatron.core.transformer.transformer_config import TransformerConfig
out = {}
for experts in (0, 4):
    cfg = TransformerConfig(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, num_query_groups=2,
                            num_moe_experts=experts or None, moe_ffn_hidden_size=16 if experts else None,
                            moe_router_topk=2, add_bias_linear=False, gated_linear_unit=True, activation_func=F.silu,
                            normalization="RMSNorm", mtp_num_layers=1, params_dtype=torch.float32,
                            moe_token_dispatcher_type="alltoall")
    spec = get_gpt_layer_local_spec(num_experts=experts or None, normalization="RMSNorm")
    model = GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=384, max_sequence_length=64,
                     mtp_block_spec=get_gpt_mtp_block_spec(cfg, spec, use_transformer_engine=False),
                     position_embedding_type="rope", share_embeddings_and_output_weights=False)
    out[experts] = dict(total=sum(p.numel() for p in model.parameters()),
                        mtp=sum(p.numel() for n, p in model.named_parameters() if n.startswith("mtp.")))
print("RESULT " + json.dumps(out))
"""
    proc = run_code(code, timeout=300)
    built = json.loads(next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))[len("RESULT "):])
    for experts, got in built.items():
        shape = ModelShape(layers=2, hidden=32, heads=4, kv_heads=2, ffn=64, vocab=384, experts=int(experts), topk=2,
                           moe_ffn=16 if int(experts) else None, tied_embeddings=False, mtp_layers=1)
        assert sum(mtp_layer_params(shape).values()) == got["mtp"], (experts, got)
        assert total_params(shape) == got["total"], (experts, got)


# Published totals (B parameters) and the tokenizer's vocabulary each script's launcher brings.
PUBLISHED = {"mixtral_8x7b": (46.7, 32000), "qwen3_30b_a3b": (30.5, 151936), "deepseek_v2_lite": (15.7, 102400),
             "deepseek_r1": (671.0, 129280), "gpt_oss_20b": (20.9, 201088)}


@pytest.mark.quick
@pytest.mark.parametrize("family", FAMILIES)
def test_full_size_scripts_have_their_published_parameter_counts(family, tmp_path, monkeypatch):
    from tests.families import _flags
    from tests.test_families import _full_size

    monkeypatch.setattr("cp_ext.platform.cuda_unusable_reason", lambda: None)
    billions, vocab = PUBLISHED[family]
    script = _full_size(family)
    grid, world = dict(_flags(script)), 1
    for flag in ("--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--expert-model-parallel-size"):
        world *= int(grid.get(flag, ["1"])[0])
    args = parse_args(script + ["--save", str(tmp_path), "--vocab-size", str(vocab)], world_size=world)
    assert round(total_params(ModelShape.from_args(args)) / 1e9, 1) == billions
