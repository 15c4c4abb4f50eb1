"""Megatron-LM's MoE scripts (tests/families) as a user pastes them into pretrain_moe.py.

* At full size, every script's flags parse (with what its launcher adds: --save; the tokenizer
  and data paths are the launcher's) and reach megatron's TransformerConfig with Megatron-LM's
  meaning: the table below names, per family, the fields its flags must set.
* Shrunk only in sizes, each trains at CP2 as the script says it (--bf16, the alltoall dispatcher,
  its recompute), all six in one 2-rank launch: the losses are finite, and the model holds the
  family's own parts (dense-first layers and shared experts for DeepSeek, q/k norms for Qwen3,
  biases and sinks for GPT-OSS, q-LoRA for DeepSeek-V3, Gated DeltaNet layers, the attention's output
  gate and the shared expert's gate for Qwen3.5) and none of the others'.
Exactness of each family against CP=1, at every grid, is tests/training/test_grid_equivalence.py's.
"""

import math
import sys

import pytest

from tests.families import CPU_DISPATCHER, FAMILIES, LINEAR_FAMILIES, _flags, script_args, tiny
from tests.launch import launch, worker_args, write_results

# The fields each full-size script must set (Megatron-LM's meaning of its flags).
FULL_SIZE = {
    "mixtral_8x7b": dict(num_layers=32, num_moe_experts=8, num_query_groups=8, add_bias_linear=False,
                         gated_linear_unit=True, normalization="RMSNorm", moe_router_topk=2, rotary_base=1000000,
                         moe_token_dispatcher_type="alltoall", qk_layernorm=False),
    "qwen3_30b_a3b": dict(num_layers=48, num_moe_experts=128, num_query_groups=4, kv_channels=128, qk_layernorm=True,
                          moe_router_topk=8, moe_ffn_hidden_size=768, add_bias_linear=False),
    "deepseek_v2_lite": dict(multi_latent_attention=True, q_lora_rank=None, kv_lora_rank=512, qk_head_dim=128,
                             qk_pos_emb_head_dim=64, v_head_dim=128, moe_layer_freq=[0] + [1] * 26,
                             moe_shared_expert_intermediate_size=2816, rotary_scaling_factor=40, mscale=0.707,
                             mscale_all_dim=0.707, moe_router_pre_softmax=True, layernorm_epsilon=1e-6),
    "deepseek_r1": dict(multi_latent_attention=True, q_lora_rank=1536, moe_layer_freq=[0] * 3 + [1] * 58,
                        num_moe_experts=256, moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                        moe_router_num_groups=8, moe_router_group_topk=4, moe_router_topk_scaling_factor=2.5,
                        moe_shared_expert_overlap=True, moe_router_load_balancing_type="seq_aux_loss",
                        max_position_embeddings=163840),
    "gpt_oss_20b": dict(add_bias_linear=True, window_size=(127, 0), window_attn_skip_freq=2, softmax_type="learnable",
                        glu_linear_offset=1.0, activation_func_clamp_value=7.0, gated_linear_unit=True,
                        num_query_groups=8, rotary_base=150000, position_embedding_type="yarn"),
    "qwen3_5_397b_a17b": dict(num_layers=60, linear_attention_variant="gated_delta_net", linear_attention_freq=4,
                              linear_num_key_heads=16, linear_num_value_heads=64, linear_key_head_dim=128,
                              linear_value_head_dim=128, linear_conv_kernel_dim=4, attention_output_gate=True,
                              layernorm_zero_centered_gamma=True, rotary_percent=0.25, kv_channels=256,
                              num_query_groups=2, num_moe_experts=512, moe_router_topk=10,
                              moe_shared_expert_gate=True, moe_shared_expert_intermediate_size=1024, mtp_num_layers=1,
                              experimental_attention_variant=None),
}

# Parameter names (substrings) each tiny family's model must hold, and must not.
PARTS = {
    "mixtral_8x7b": (["router", "experts"], ["bias", "q_layernorm", "shared_experts", "softmax_offset", "kv_down"]),
    "qwen3_30b_a3b": (["q_layernorm", "k_layernorm", "experts"], ["bias", "shared_experts", "kv_down"]),
    "deepseek_v2_lite": (["linear_kv_down_proj", "kv_layernorm", "shared_experts", "layers.0.mlp.linear_fc1"],
                         ["linear_q_down_proj", "layers.0.mlp.router", "bias"]),
    "deepseek_r1": (["linear_q_down_proj", "q_layernorm", "shared_experts", "layers.0.mlp.linear_fc1"],
                    ["layers.0.mlp.router", "bias"]),
    "gpt_oss_20b": (["softmax_offset", "linear_qkv.bias", "linear_proj.bias", "experts.local_experts.0.linear_fc1.bias",
                     "router.bias"], ["shared_experts", "q_layernorm"]),
    # Gated DeltaNet on layers 1-3 (in_proj, conv, decay, gated norm), gated softmax attention on layer 4, MTP
    "qwen3_5_397b_a17b": (["layers.0.self_attention.in_proj", "layers.2.self_attention.conv1d", "A_log", "dt_bias",
                           "out_norm", "layers.3.self_attention.linear_qkv", "shared_experts.gate_weight", "mtp"],
                          ["bias.", "layers.3.self_attention.in_proj", "layers.0.self_attention.linear_qkv"]),
}
EVERY_FAMILY = FAMILIES + LINEAR_FAMILIES
CP2 = ["--context-parallel-size", "2"]


def _full_size(family, dispatcher_on_cpu=True):
    """The script's flags with what its launcher adds (--save) and without what cp_ext replaces here
    (its tokenizer: the model reads nothing at parse time) or refuses (modelopt's --export-*), and with
    DeepEP's dispatcher (CUDA only) as alltoall (``dispatcher_on_cpu``)."""
    tokens = []
    for flag, values in _flags(script_args(family)):
        if flag == "--moe-token-dispatcher-type" and dispatcher_on_cpu:
            values = [CPU_DISPATCHER.get(values[0], values[0])]
        if not flag.startswith("--export-") and flag != "--tokenizer-type":
            tokens += [flag, *values]
    return tokens


@pytest.mark.quick
@pytest.mark.parametrize("family", EVERY_FAMILY)
def test_full_size_script_flags_reach_megatrons_config(family, tmp_path):
    from cp_ext.arguments import parse_args
    from cp_ext.config import transformer_config_from_args

    script = _full_size(family)
    grid = dict(_flags(script))
    world = 1
    for flag in ("--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--expert-model-parallel-size"):
        world *= int(grid.get(flag, ["1"])[0])
    args = parse_args(script + ["--save", str(tmp_path)], world_size=world)
    config = transformer_config_from_args(args)
    for field, expected in FULL_SIZE[family].items():
        got = getattr(config, field, getattr(args, field, None))
        assert got == expected, f"{family}: {field} = {got!r}, the script means {expected!r}"


@pytest.fixture(scope="module")
def trained():
    return launch(__file__, 2)[0]


# The aux loss each script asks for, by megatron's tracker name; GPT-OSS's coefficient is 0.
AUX_LOSS = {"mixtral_8x7b": "load balancing loss", "qwen3_30b_a3b": "load balancing loss",
            "deepseek_v2_lite": "seq load balancing loss", "deepseek_r1": "seq load balancing loss", "gpt_oss_20b": None,
            "qwen3_5_397b_a17b": "load balancing loss"}


@pytest.mark.quick
def test_deepep_dispatcher_is_refused_naming_alltoall(tmp_path):
    """Qwen3.5's script asks for --moe-token-dispatcher-type flex (DeepEP): on this machine, one clear message."""
    from cp_ext.arguments import ConfigError, parse_args

    with pytest.raises(ConfigError, match="flex is megatron's DeepEP dispatcher.*use alltoall"):
        parse_args(_full_size("qwen3_5_397b_a17b", dispatcher_on_cpu=False) + ["--save", str(tmp_path)], world_size=1)


@pytest.mark.parametrize("family", EVERY_FAMILY)
def test_script_flags_train_at_cp2(family, trained):
    run = trained[family]
    assert len(run["lm loss"]) == 3 and all(math.isfinite(x) for x in run["lm loss"] + run["grad norm"]), run
    assert run["dtype"] == "torch.bfloat16", run["dtype"]  # the script's --bf16
    assert run["dispatcher"] == "MoEAlltoAllTokenDispatcher", run["dispatcher"]
    # GPT-OSS's --padded-vocab-size (512 here) sets the rows; the others pad 257 bytes to 128's multiple
    assert run["vocab_rows"] == (512 if family == "gpt_oss_20b" else 384), run["vocab_rows"]
    # megatron's normalization (`track_moe_metrics`): about 1 for the near-uniform routing at init, averaged
    # over the MoE layers only (dense-first layers log none: over all 4 layers DeepSeek's would read 0.75)
    losses = sorted(k for k in run if "load balancing loss" in k)
    assert losses == ([AUX_LOSS[family]] if AUX_LOSS[family] else []), losses
    if AUX_LOSS[family]:
        assert all(0.95 < x < 1.3 for x in run[AUX_LOSS[family]]), run[AUX_LOSS[family]]
    present, absent = PARTS[family]
    names = run["parameters"]
    for part in present:
        assert any(part in n for n in names), f"{family}: no parameter {part!r}"
    for part in absent:
        assert not any(part in n for n in names), f"{family}: unexpected {part!r}: {[n for n in names if part in n]}"


def worker():
    import torch.distributed as dist

    from cp_ext.arguments import parse_args
    from cp_ext.training.trainer import Trainer

    opts = worker_args(sys.argv[1:])
    results = {}
    for family in EVERY_FAMILY:
        trainer = Trainer(parse_args(tiny(family, *CP2)))
        history = {}
        for _ in range(3):
            for key, value in trainer.train_step().items():
                history.setdefault(key, []).append(value)
        model = trainer.model[0].module
        layer = next(m for m in model.modules() if hasattr(m, "token_dispatcher"))
        results[family] = dict(history, parameters=[n for n, _ in model.named_parameters()],
                               dtype=str(next(model.parameters()).dtype),
                               vocab_rows=next(p for n, p in model.named_parameters() if "word_embeddings" in n).shape[0],
                               dispatcher=type(layer.token_dispatcher).__name__)
        trainer.shutdown(keep_process_group=True)
    write_results(opts.results_dir, results)
    dist.destroy_process_group()


if __name__ == "__main__":
    worker()
