"""What the argument tests share: a small MoE model's flags, the CUDA device flag, and the ConfigError text."""

import pytest

from cp_ext.arguments import ConfigError, parse_args

MOE = ["--num-experts", "4", "--position-embedding-type", "rope", "--disable-bias-linear", "--swiglu", "--normalization", "RMSNorm", "--num-layers", "4", "--num-attention-heads", "4", "--hidden-size", "64"]

CUDA = ["--device", "cuda"]
MLA = ["--multi-latent-attention", "--kv-lora-rank", "16", "--qk-head-dim", "8", "--qk-pos-emb-head-dim", "4",
       "--v-head-dim", "6"]


def _error(argv, world_size):
    with pytest.raises(ConfigError) as info:
        parse_args(argv, world_size=world_size)
    return str(info.value)
