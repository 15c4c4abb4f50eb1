"""Kimi-Linear's flags: ``--experimental-attention-variant kda`` (`cp_ext.arguments.linear_attention`) and
``--no-rope-freq`` (`cp_ext.arguments.network`), Megatron-LM's spelling and meaning, what reaches megatron's config,
and the early, clear errors."""

import pytest

from cp_ext.arguments import parse_args
from tests.arguments.common import MLA, MOE, _error

KDA = ["--experimental-attention-variant", "kda", "--linear-attention-freq", "2", "--num-layers", "4",
       "--linear-num-key-heads", "2", "--linear-num-value-heads", "2", "--linear-key-head-dim", "8",
       "--linear-value-head-dim", "8"]


@pytest.mark.quick
@pytest.mark.parametrize(
    "argv, world, must_name",
    [
        (KDA[:2] + KDA[4:], 1, ["--experimental-attention-variant kda needs --linear-attention-freq"]),
        (KDA[:-5] + ["4"] + KDA[-4:], 1,
         ["--experimental-attention-variant kda has no grouped value heads: --linear-num-value-heads 4 must equal "
          "--linear-num-key-heads 2"]),
        (KDA[:8] + KDA[10:], 1, ["--linear-num-value-heads 32 must equal --linear-num-key-heads 2"]),
        (KDA + ["--tensor-model-parallel-size", "4", "--sequence-parallel"], 4,
         ["--linear-num-key-heads 2 is not divisible by --tensor-model-parallel-size 4"]),
        (KDA + ["--context-parallel-size", "4", "--ulysses-size", "4"], 4,
         ["--linear-num-key-heads 2 / --tensor-model-parallel-size 1 is not divisible by the Ulysses size 4"]),
        (MOE + ["--no-rope-freq", "3"], 1, ["--no-rope-freq 3 does not divide --num-layers 4"]),
        (MOE + ["--no-rope-freq", "[0,1]"], 1, ["--no-rope-freq lists 2 layers but --num-layers is 4"]),
        (["--no-rope-freq", "2"], 1, ["--no-rope-freq skips RoPE on some layers, but --position-embedding-type "
                                      "learned_absolute rotates none"]),
        (MOE + MLA + ["--no-rope-freq", "1", "--experimental-attention-variant", "dsa", "--dsa-indexer-n-heads", "2",
                      "--dsa-indexer-head-dim", "8", "--dsa-indexer-topk", "4"], 1,
         ["--no-rope-freq is not supported with --experimental-attention-variant dsa"]),
    ],
    ids=["no-pattern", "grouped-value-heads", "default-value-heads", "heads-over-tp", "ulysses", "freq-not-dividing",
         "pattern-length", "nothing-to-skip", "dsa"],
)
def test_bad_kimi_linear_flags_name_the_flag(argv, world, must_name):
    message = _error(argv, world)
    for text in must_name:
        assert text in message, f"{text!r} missing from: {message}"


@pytest.mark.quick
def test_kimi_linear_flags_reach_megatrons_config():
    """kda picks cp_ext's KDA module (megatron's experimental_attention_variant stays None, as for Gated DeltaNet);
    --no-rope-freq lands on megatron-core's no_rope_freq, which its config expands to one 0/1 per layer."""
    from cp_ext.config import transformer_config_from_args

    argv = MOE + MLA + KDA[:3] + ["([1]+[0])*2"] + KDA[4:] + ["--linear-conv-kernel-dim", "3", "--no-rope-freq", "1",
                                                              "--moe-router-score-function", "sigmoid",
                                                              "--moe-router-enable-expert-bias"]
    cfg = transformer_config_from_args(parse_args(argv, world_size=1))
    assert cfg.linear_attention_variant == "kda" and cfg.experimental_attention_variant is None
    assert cfg.linear_attention_freq == [1, 0, 1, 0] and cfg.linear_conv_kernel_dim == 3
    assert (cfg.linear_num_key_heads, cfg.linear_num_value_heads) == (2, 2)
    assert cfg.no_rope_freq == [1, 1, 1, 1] and cfg.multi_latent_attention
    llama4 = transformer_config_from_args(parse_args(MOE + ["--no-rope-freq", "4"], world_size=1))
    assert llama4.no_rope_freq == [0, 0, 0, 1]
    assert transformer_config_from_args(parse_args([], world_size=1)).no_rope_freq is None
