"""The linear-attention hybrids' flags (`cp_ext.arguments.linear_attention`): Megatron-LM's spelling and meaning,
what reaches megatron's config, and the early, clear errors."""

import pytest

from cp_ext.arguments import parse_args
from tests.arguments.common import _error

GDN = ["--experimental-attention-variant", "gated_delta_net", "--linear-attention-freq", "2", "--num-layers", "4",
       "--linear-num-key-heads", "2", "--linear-num-value-heads", "4", "--linear-key-head-dim", "8",
       "--linear-value-head-dim", "8"]


@pytest.mark.quick
@pytest.mark.parametrize(
    "argv, world, must_name",
    [
        (["--linear-attention-freq", "4", "--linear-num-key-heads", "8"], 1,
         ["--linear-num-key-heads applies to linear attention layers", "--linear-attention-freq applies",
          "add --experimental-attention-variant gated_delta_net"]),
        (["--experimental-attention-variant", "gated_delta_net", "--num-layers", "4"], 1,
         ["gated_delta_net needs --linear-attention-freq", "Qwen3-Next: 4"]),
        (GDN[:3] + ["[1,1,1,0]*2"] + GDN[4:], 1, ["--linear-attention-freq lists 8 layers but --num-layers is 4"]),
        (GDN[:3] + ["[0,0,0,0]"] + GDN[4:], 1, ["makes no layer linear"]),
        (GDN + ["--tensor-model-parallel-size", "4", "--sequence-parallel"], 4,
         ["--linear-num-key-heads 2 is not divisible by --tensor-model-parallel-size 4"]),
        (GDN[:-7] + ["3"] + GDN[-6:], 1, ["--linear-num-value-heads 4 must be a multiple of --linear-num-key-heads 3"]),
        (GDN + ["--linear-conv-kernel-dim", "0"], 1, ["--linear-conv-kernel-dim"]),
        (GDN + ["--context-parallel-size", "4", "--ulysses-size", "4"], 4,
         ["--linear-num-key-heads 2 / --tensor-model-parallel-size 1 is not divisible by the Ulysses size 4",
          "--cp-comm-type p2p (state passing on the ring has no such limit)"]),
        (["--moe-shared-expert-gate", "--num-experts", "4"], 1,
         ["--moe-shared-expert-gate gates the shared experts: add --moe-shared-expert-intermediate-size"]),
        (["--multi-latent-attention", "--attention-output-gate"], 1,
         ["--attention-output-gate is not supported with --multi-latent-attention"]),
    ],
    ids=["sizes-without-variant", "no-pattern", "pattern-length", "no-linear-layer", "heads-over-tp",
         "value-heads-multiple", "conv-kernel-zero", "ulysses", "shared-gate-without-shared-experts", "gate-with-mla"],
)
def test_bad_linear_attention_flags_name_the_flag(argv, world, must_name):
    message = _error(argv, world)
    for text in must_name:
        assert text in message, f"{text!r} missing from: {message}"


@pytest.mark.quick
def test_qwen3_next_flags_reach_megatrons_config():
    """Megatron-LM's flags land on megatron-core's own TransformerConfig fields; megatron's
    experimental_attention_variant stays None (cp_ext's linear_attention_variant picks the module)."""
    from cp_ext.config import transformer_config_from_args

    argv = GDN[:3] + ["([1]*3+[0])*1"] + GDN[4:] + [
        "--linear-conv-kernel-dim", "3", "--attention-output-gate", "--apply-layernorm-1p", "--num-experts", "4",
        "--moe-shared-expert-intermediate-size", "32", "--moe-shared-expert-gate"]
    cfg = transformer_config_from_args(parse_args(argv, world_size=1))
    assert cfg.linear_attention_variant == "gated_delta_net" and cfg.experimental_attention_variant is None
    assert cfg.linear_attention_freq == [1, 1, 1, 0] and cfg.linear_conv_kernel_dim == 3
    assert (cfg.linear_num_key_heads, cfg.linear_num_value_heads) == (2, 4)
    assert (cfg.linear_key_head_dim, cfg.linear_value_head_dim) == (8, 8)
    assert cfg.attention_output_gate and cfg.layernorm_zero_centered_gamma and cfg.moe_shared_expert_gate
    plain = transformer_config_from_args(parse_args([], world_size=1))
    assert plain.linear_attention_variant is None and plain.linear_attention_freq is None
    assert not (plain.attention_output_gate or plain.layernorm_zero_centered_gamma)


@pytest.mark.quick
def test_checkpoint_of_other_linear_sizes_is_refused(tmp_path, crafted_checkpoint):
    """The linear layers' sizes are model flags: a checkpoint saved with others is refused at parse time, naming
    the flag, the run's value and the checkpoint's (`cp_ext.perf.model_shape.SHAPE_FLAGS`)."""
    import json

    ckpt = crafted_checkpoint(tmp_path / "ckpt", 5)
    meta = ckpt / "iter_0000005" / "meta.json"
    saved = {"experimental_attention_variant": "gated_delta_net", "linear_num_key_heads": 4, "linear_attention_freq": 2}
    meta.write_text(json.dumps({**json.loads(meta.read_text()), "model": saved}))
    message = _error(GDN + ["--load", str(ckpt), "--train-iters", "10"], 1)
    assert "the checkpoint is of another model" in message
    assert "--linear-num-key-heads 2 (checkpoint: 4)" in message
    assert "--linear-attention-freq" not in message  # the same pattern: not named
