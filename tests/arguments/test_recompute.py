"""The activation-recompute flags: their errors and what reaches megatron's TransformerConfig."""

import pytest

from cp_ext.arguments import parse_args
from tests.arguments.common import MOE, _error


FULL = ["--recompute-granularity", "full"]


@pytest.mark.quick
@pytest.mark.parametrize(
    "argv, world, must_name",
    [
        (FULL + ["--recompute-num-layers", "1"], 1, ["--recompute-granularity full needs --recompute-method"]),
        (FULL + ["--recompute-method", "uniform"], 1, ["needs --recompute-num-layers N, 1 <= N <= 2"]),
        (FULL + ["--recompute-method", "block", "--recompute-num-layers", "3"], 1, ["--recompute-num-layers 3", "2 layers"]),
        (FULL + ["--recompute-method", "uniform", "--recompute-num-layers", "2", "--position-embedding-type", "rope", "--disable-bias-linear", "--swiglu", "--normalization", "RMSNorm", "--num-layers", "6",
                 "--pipeline-model-parallel-size", "2"], 2, ["--recompute-method uniform", "divide the 3 layers"]),
        (["--recompute-method", "block"], 1, ["--recompute-method block is only read with --recompute-granularity full"]),
        (["--recompute-granularity", "selective", "--recompute-num-layers", "1"], 1,
         ["--recompute-num-layers 1 is only read with --recompute-granularity full"]),
        (["--recompute-modules", "moe"], 1, ["--recompute-modules is only read with --recompute-granularity selective"]),
        (MOE + ["--recompute-granularity", "selective", "--recompute-modules", "moe_act"], 1,
         ["--recompute-modules moe_act", "grouped-GEMM", "Use moe"]),
        (MOE + ["--recompute-granularity", "selective", "--recompute-modules", "mlp"], 1,
         ["--recompute-modules mlp", "every layer here is MoE"]),
        (["--recompute-granularity", "selective", "--recompute-modules", "moe"], 1,
         ["--recompute-modules moe", "this model is dense"]),
        (["--recompute-granularity", "selective", "--recompute-modules", "mla_up_proj"], 1,
         ["--recompute-modules mla_up_proj", "--multi-latent-attention"]),
        (["--recompute-granularity", "selective", "--recompute-modules"], 1, ["recomputes nothing"]),
        (["--no-cp-aware-recompute"], 1, ["--no-cp-aware-recompute is only read with --recompute-granularity full"]),
        (["--recompute-activations", "--recompute-granularity", "full"], 1, ["--recompute-activations", "contradicts"]),
        (FULL + ["--recompute-method", "uniform", "--recompute-num-layers", "1", "--distribute-saved-activations"], 1,
         ["--distribute-saved-activations", "--tensor-model-parallel-size 1"]),
        (MOE + FULL + ["--recompute-method", "uniform", "--recompute-num-layers", "1", "--distribute-saved-activations",
                       "--tensor-model-parallel-size", "2", "--sequence-parallel"], 2,
         ["--distribute-saved-activations cannot be combined with --sequence-parallel"]),
        (FULL + ["--recompute-method", "uniform", "--recompute-num-layers", "1", "--attention-dropout", "0.1"], 1,
         ["--attention-dropout 0.1", "--no-cp-aware-recompute"]),
    ],
    ids=["full-without-method", "full-without-n", "n-above-stage", "uniform-n-not-dividing", "method-without-full",
         "selective-with-n", "modules-without-selective", "moe-act-needs-grouped-gemm", "mlp-on-moe", "moe-on-dense",
         "mla-up-proj", "no-modules", "cp-aware-without-full", "recompute-activations-contradiction",
         "distribute-without-tp", "distribute-with-sp", "attention-dropout-with-cp-aware"],
)
def test_bad_recompute_flags_name_the_flag(argv, world, must_name):
    message = _error(argv, world)
    for text in must_name:
        assert text in message, f"{text!r} missing from: {message}"


def test_recompute_flags_reach_megatrons_config():
    from cp_ext.config import transformer_config_from_args

    full = parse_args(MOE + FULL + ["--recompute-method", "block", "--recompute-num-layers", "2"], world_size=1)
    config = transformer_config_from_args(full)
    assert (config.recompute_granularity, config.recompute_method, config.recompute_num_layers) == ("full", "block", 2)
    assert config.cp_aware_recompute is True
    plain = parse_args(MOE + FULL + ["--recompute-method", "uniform", "--recompute-num-layers", "1",
                                     "--no-cp-aware-recompute"], world_size=1)
    assert transformer_config_from_args(plain).cp_aware_recompute is False
    selective = parse_args(MOE + ["--recompute-activations"], world_size=1)
    config = transformer_config_from_args(selective)
    assert config.recompute_granularity == "selective" and config.recompute_modules == ["core_attn"]
    assert config.cp_aware_recompute is False
    layernorm = parse_args(MOE + ["--recompute-granularity", "selective", "--recompute-modules", "layernorm", "moe"],
                           world_size=1)
    assert transformer_config_from_args(layernorm).recompute_modules == ["layernorm", "moe"]
