"""Sliding windows, attention sinks, MLA (and its latent exchange) and MTP flags: their errors and what reaches
megatron's config."""

import pytest

from cp_ext.arguments import ConfigError, parse_args
from tests.arguments.common import CUDA, MLA, _error


@pytest.mark.quick
@pytest.mark.parametrize(
    "argv, must_name",
    [
        (["--window-size", "8,4"], ["--window-size 8,4 looks 4 tokens ahead", "--window-size 8,0"]),
        (["--window-attn-skip-freq", "2"], ["--window-attn-skip-freq is only read with --window-size"]),
        (["--position-embedding-type", "rope", "--disable-bias-linear", "--swiglu", "--normalization", "RMSNorm", "--num-layers", "4", "--window-size", "8,0", "--window-attn-skip-freq", "[1,0]*3"],
         ["--window-attn-skip-freq lists 6 layers but --num-layers is 4"]),
        (CUDA + ["--bf16", "--attention-backend", "flash", "--window-size", "8,0"],
         ["--window-size needs a kernel that applies a window", "--attention-backend flash",
          "cpu, efficient, unfused"]),
        (["--softmax-type", "learnable", "--attention-dropout", "0.1"],
         ["--attention-dropout 0.1 is not supported with --softmax-type learnable", "--attention-dropout 0"]),
        (["--cp-mla-exchange", "latent"],
         ["--cp-mla-exchange latent applies to multi-latent attention", "drop --cp-mla-exchange"]),
    ],
    ids=["window-looks-ahead", "skip-freq-without-window", "skip-freq-list-length", "window-on-flash",
         "sink-with-dropout", "latent-without-mla"],
)
def test_bad_window_flags_name_the_flag(cuda_host, argv, must_name):
    message = _error(argv, 2)
    for text in must_name:
        assert text in message, f"{text!r} missing from: {message}"


@pytest.mark.quick
def test_window_and_sink_flags_reach_megatrons_config():
    """Megatron-LM's spellings and parsers (tuple_type, moe_freq_type), megatron's config fields."""
    from cp_ext.config import transformer_config_from_args

    argv = ["--window-size", "(16,0)", "--window-attn-skip-freq", "[1,1,0]*2", "--position-embedding-type", "rope", "--disable-bias-linear", "--swiglu", "--normalization", "RMSNorm", "--num-layers", "6",
            "--softmax-type", "learnable"]
    cfg = transformer_config_from_args(parse_args(argv, world_size=1))
    assert cfg.window_size == (16, 0) and cfg.window_attn_skip_freq == [1, 1, 0, 1, 1, 0]
    assert cfg.softmax_type == "learnable" and cfg.cp_mla_exchange == "auto"
    assert transformer_config_from_args(parse_args(["--cp-mla-exchange", "kv"], world_size=1)).cp_mla_exchange == "kv"
    args = parse_args(["--window-size", "16,-1", "--window-attn-skip-freq", "3"], world_size=1)  # -1: causal bounds it
    assert args.window_size == (16, -1) and args.window_attn_skip_freq == 3
    for bad in (["--window-size", "16"], ["--window-size", "a,b"], ["--window-attn-skip-freq", "[2]"],
                ["--softmax-type", "sigmoid"]):
        with pytest.raises((SystemExit, ConfigError)):
            parse_args(bad, world_size=1)


@pytest.mark.quick
def test_latent_exchange_refused_where_the_latent_cannot_travel():
    """With multi-latent attention (the flag comes with the model-families work), --cp-mla-exchange
    latent needs the ring or all_gather and TP 1; auto and kv are always accepted."""
    from argparse import Namespace

    from cp_ext.arguments.attention import _mla_exchange_problems

    mla = dict(multi_latent_attention=True, ulysses_size=1, cp_comm_types=None, tensor_model_parallel_size=1,
               context_parallel_size=2)
    assert _mla_exchange_problems(Namespace(cp_mla_exchange="latent", **mla)) == []
    assert _mla_exchange_problems(Namespace(cp_mla_exchange="latent", **dict(mla, ulysses_size=2,
                                                                              cp_comm_types=["all_gather"]))) == []
    (ulysses,) = _mla_exchange_problems(Namespace(cp_mla_exchange="latent", **dict(mla, ulysses_size=2)))
    assert "U = 2" in ulysses and "--cp-mla-exchange kv" in ulysses
    (tp,) = _mla_exchange_problems(Namespace(cp_mla_exchange="latent", **dict(mla, tensor_model_parallel_size=2)))
    assert "--tensor-model-parallel-size 1" in tp
    (cp1,) = _mla_exchange_problems(Namespace(cp_mla_exchange="latent", **dict(mla, context_parallel_size=1)))
    assert "--context-parallel-size 1 sends nothing" in cp1
    for exchange in ("auto", "kv"):
        assert _mla_exchange_problems(Namespace(cp_mla_exchange=exchange, **dict(mla, ulysses_size=2))) == []




@pytest.mark.quick
@pytest.mark.parametrize(
    "argv, world, must_name",
    [
        (["--q-lora-rank", "12"], 1, ["--q-lora-rank applies to multi-latent attention", "--multi-latent-attention"]),
        (["--rope-type", "yarn"], 1, ["--rope-type yarn applies to multi-latent attention"]),
        (MLA + ["--group-query-attention", "--num-query-groups", "2"], 1, ["--num-query-groups 2 does not apply to multi-latent attention"]),
        (MLA[:6] + ["5"] + MLA[7:], 1, ["--qk-pos-emb-head-dim 5 must be even"]),
        (MLA + ["--reset-position-ids"], 1, ["--reset-position-ids is not supported with --multi-latent-attention"]),
        (MLA + ["--context-parallel-size", "2", "--ulysses-size", "2", "--cp-mla-exchange", "latent"], 2,
         ["--cp-mla-exchange latent runs on the ring and all_gather", "U = 2"]),
        (MLA + ["--qk-layernorm", "--tensor-model-parallel-size", "2"], 2,
         ["--qk-layernorm with --multi-latent-attention at --tensor-model-parallel-size > 1 needs --sequence-parallel"]),
    ],
    ids=["q-lora-without-mla", "yarn-without-mla", "mla-with-gqa", "odd-rope-dim",
         "mla-reset-position-ids", "latent-on-ulysses", "mla-qk-norm-tp-without-sp"],
)
def test_bad_mla_flags_name_the_flag(argv, world, must_name):
    message = _error(argv, world)
    for text in must_name:
        assert text in message, f"{text!r} missing from: {message}"


@pytest.mark.quick
def test_mtp_flags_reach_megatrons_config():
    """Megatron-LM's --mtp-num-layers / --mtp-loss-scaling-factor on the TransformerConfig fields megatron's MTP
    reads (the generic one-to-one copy), with Megatron-LM's defaults: no MTP, factor 0.1."""
    from cp_ext.config import transformer_config_from_args

    cfg = transformer_config_from_args(parse_args(["--mtp-num-layers", "3", "--mtp-loss-scaling-factor", "0.25"], world_size=1))
    assert (cfg.mtp_num_layers, cfg.mtp_loss_scaling_factor) == (3, 0.25)
    cfg = transformer_config_from_args(parse_args([], world_size=1))
    assert (cfg.mtp_num_layers, cfg.mtp_loss_scaling_factor) == (None, 0.1)


def test_mla_flags_reach_megatrons_mla_config():
    """Megatron-LM's MLA flags and defaults become megatron's MLATransformerConfig fields."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    from cp_ext.config import transformer_config_from_args

    cfg = transformer_config_from_args(parse_args(MLA + ["--q-lora-rank", "12", "--rotary-scaling-factor", "4",
                                                         "--mscale-all-dim", "1"], world_size=1))
    assert isinstance(cfg, MLATransformerConfig) and cfg.multi_latent_attention
    assert (cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_head_dim, cfg.qk_pos_emb_head_dim, cfg.v_head_dim) == (12, 16, 8, 4, 6)
    assert (cfg.rope_type, cfg.rotary_scaling_factor, cfg.mscale, cfg.mscale_all_dim) == ("yarn", 4.0, 1.0, 1.0)
    assert transformer_config_from_args(parse_args(MLA + ["--rope-type", "rope"], world_size=1)).rope_type == "rope"
    plain = parse_args([], world_size=1)
    assert (plain.kv_lora_rank, plain.qk_head_dim, plain.qk_pos_emb_head_dim, plain.v_head_dim) == (32, 128, 64, 128)
    assert not getattr(transformer_config_from_args(plain), "multi_latent_attention", False)
    assert not transformer_config_from_args(plain).qk_layernorm
    assert transformer_config_from_args(parse_args(["--qk-layernorm"], world_size=1)).qk_layernorm


@pytest.mark.quick
def test_mla_head_dims_checked_against_the_named_kernel(cuda_host):
    """--attention-backend is checked against MLA's own head dims (q/k 256 + 64, v 128), not hidden / heads."""
    message = _error(CUDA + ["--bf16", "--attention-backend", "flash", "--multi-latent-attention", "--qk-head-dim",
                             "256", "--qk-pos-emb-head-dim", "64", "--v-head-dim", "128"], 1)
    assert "--qk-head-dim 256 + --qk-pos-emb-head-dim 64 = 320, --v-head-dim 128" in message, message
    assert "at most 256" in message, message
    parse_args(CUDA + ["--bf16", "--attention-backend", "flash", "--multi-latent-attention", "--qk-head-dim", "128",
                       "--qk-pos-emb-head-dim", "64", "--v-head-dim", "128"], world_size=1)  # 192 / 128 runs


# Combinations megatron-core 0.16.1 refuses (an assert deep in a build) or cannot mean, and flags of
# Megatron-LM's scripts that only a missing package or another tool can serve: one message at parse
# time naming the flag.
