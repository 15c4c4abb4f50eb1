"""MLA's YaRN takes the YaRN flags common attention has: --yarn-original-max-position-embeddings,
--yarn-beta-fast and --yarn-beta-slow become megatron's MLATransformerConfig fields; what MLA cannot take is one
message naming the flag."""

import pytest

from cp_ext.arguments import parse_args
from tests.arguments.common import _error

MLA = ["--multi-latent-attention", "--kv-lora-rank", "16", "--qk-head-dim", "8", "--qk-pos-emb-head-dim", "4",
       "--v-head-dim", "6", "--rotary-scaling-factor", "4"]
YARN = ["--yarn-original-max-position-embeddings", "32", "--yarn-beta-fast", "16", "--yarn-beta-slow", "2"]


def test_mla_yarn_flags_reach_megatrons_config():
    """The fields megatron's MLA builds its YarnRotaryEmbedding from (their effect, end to end: a DeepSeek-V3 whose
    YaRN starts from 32 positions scores as transformers does, tests/hf/test_convert.py)."""
    from cp_ext.config import transformer_config_from_args

    cfg = transformer_config_from_args(parse_args(MLA + YARN, world_size=1))
    assert (cfg.original_max_position_embeddings, cfg.beta_fast, cfg.beta_slow) == (32, 16.0, 2.0)
    plain = transformer_config_from_args(parse_args(MLA, world_size=1))
    assert (plain.original_max_position_embeddings, plain.beta_fast, plain.beta_slow) == (4096, 32, 1)



@pytest.mark.parametrize("argv, must_name", [
    (MLA + ["--rope-type", "rope", "--yarn-beta-fast", "16"],
     ["--yarn-beta-fast: they configure YaRN, and --rope-type rope runs plain RoPE"]),
    (MLA + ["--no-yarn-correction-range-round-to-int"],
     ["--no-yarn-correction-range-round-to-int: megatron's multi-latent attention always rounds"]),
    (["--yarn-beta-fast", "16"], ["they configure --position-embedding-type yarn"]),
], ids=["yarn-flags-with-rope", "no-rounding", "without-yarn"])
def test_bad_mla_yarn_flags_name_the_flag(argv, must_name):
    message = _error(argv, 1)
    for text in must_name:
        assert text in message, message
