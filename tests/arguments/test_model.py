"""Model flags megatron-core cannot mean or refuses deep in a build, YaRN and RoPE reaching megatron, and the
implementation flags named on the startup line."""

import pytest

from cp_ext.arguments import parse_args
from tests.arguments.common import MLA, MOE, _error


@pytest.mark.quick
@pytest.mark.parametrize(
    "argv, world, must_name",
    [
        (MLA + ["--rotary-interleaved"], 1, ["--rotary-interleaved", "--multi-latent-attention"]),
        (MOE + ["--moe-layer-freq", "[0,1,1]"], 1, ["--moe-layer-freq lists 3 layers", "--num-layers is 4"]),
        (MOE + ["--moe-layer-freq", "[0]*4"], 1, ["--moe-layer-freq makes every layer dense"]),
        (MOE + ["--moe-shared-expert-intermediate-size", "0"], 1, ["--moe-shared-expert-intermediate-size"]),
        (["--qk-head-dim", "8"], 1, ["--qk-head-dim", "--multi-latent-attention"]),
        (["--export-te-mcore-model"], 1, ["--export-te-mcore-model", "post-training (modelopt)", "not training"]),
        (["--trust-remote-code"], 1, ["--trust-remote-code", "post-training (modelopt)"]),
        (["--num-query-groups", "2"], 1, ["--num-query-groups", "--group-query-attention"]),
        (["--yarn-beta-fast", "16"], 1, ["--yarn-beta-fast", "they configure --position-embedding-type yarn"]),
        (["--use-checkpoint-args"], 1, ["--use-checkpoint-args reads the model flags of the --load checkpoint"]),
        (MOE + ["--moe-token-dispatcher-type", "flex"], 1, ["--moe-token-dispatcher-type flex", "deep_ep"]),
        (MOE + ["--moe-shared-expert-intermediate-size", "32", "--moe-shared-expert-overlap"], 1,
         ["--moe-shared-expert-overlap", "--moe-token-dispatcher-type alltoall"]),
        (["--quick-geglu", "--swiglu"], 1, ["--quick-geglu", "--swiglu"]),
        (["--num-experts", "4", "--tensor-model-parallel-size", "1", "--expert-tensor-parallel-size", "2"], 2,
         ["biases in the MoE experts", "--expert-tensor-parallel-size up to --tensor-model-parallel-size 1",
          "--disable-bias-linear"]),
        (["--transformer-impl", "inference_optimized"], 1, ["--transformer-impl"]),
        (MOE + ["--moe-layer-recompute", "--recompute-granularity", "full", "--recompute-method", "uniform"], 1,
         ["--moe-layer-recompute", "megatron-core refuses"]),
    ],
    ids=["mla-rotary-interleaved", "layer-freq-length", "layer-freq-no-moe", "shared-size-zero", "qk-head-dim-without-mla",
         "modelopt-export", "modelopt-remote-code", "groups-without-gqa", "yarn-flags-without-yarn", "checkpoint-args-without-load", "flex-dispatcher",
         "shared-overlap-needs-alltoall", "quick-geglu-and-swiglu", "biased-experts-at-expert-tp-above-tp", "transformer-impl-unknown",
         "moe-layer-recompute-with-full"],
)
def test_bad_model_flags_name_the_flag(argv, world, must_name):
    message = _error(argv, world)
    for text in must_name:
        assert text in message, f"{text!r} missing from: {message}"


@pytest.mark.quick
def test_yarn_flags_reach_megatrons_yarn(tmp_path):
    """Megatron-LM's YaRN for common attention (--position-embedding-type yarn with --rotary-scaling-factor,
    --yarn-*, --mscale): megatron's GPTModel builds its YarnRotaryEmbedding from them (cp_ext's wrapper
    around it), with Megatron-LM's defaults where a flag is not given; --enable-gpt-oss sets GPT-OSS's."""
    from tests.launch import one_rank_megatron, run_code

    code = one_rank_megatron(tmp_path, cp_ext_groups=True) + """
from cp_ext.arguments import parse_args
from cp_ext.config import transformer_config_from_args
from cp_ext.models.gpt_moe import build_model
shape = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "64",
         "--disable-bias-linear", "--position-embedding-type", "yarn"]
def yarn(*flags):
    args = parse_args(shape + list(flags), world_size=1)
    inner = build_model(transformer_config_from_args(args), args, 384).rotary_pos_emb.inner
    return (type(inner).__name__, inner.scaling_factor, inner.original_max_position_embeddings, inner.beta_fast,
            inner.mscale, inner.beta_slow, inner.mscale_all_dim, inner.correction_range_round_to_int)
print(yarn("--rotary-scaling-factor", "4", "--yarn-original-max-position-embeddings", "32", "--yarn-beta-fast", "16",
           "--mscale", "0.8", "--yarn-beta-slow", "2", "--mscale-all-dim", "0.5",
           "--no-yarn-correction-range-round-to-int"))
print(yarn())
print(yarn("--enable-gpt-oss"))
"""
    lines = run_code(code).stdout.strip().splitlines()[-3:]
    assert lines == ["('YarnRotaryEmbedding', 4.0, 32, 16.0, 0.8, 2.0, 0.5, False)",
                     "('YarnRotaryEmbedding', 1.0, 4096, 32.0, 1.0, 1.0, 0.0, True)",
                     "('YarnRotaryEmbedding', 32.0, 131072, 32.0, 1.0, 1.0, 0.0, False)"], lines


@pytest.mark.quick
def test_rope_flags_reach_megatrons_rotary_embedding(tmp_path):
    """Each RoPE flag of Megatron-LM changes the RoPE megatron builds (the wrapper takes rows of that module's
    own table, so at every CP layout the option is megatron's): the rotated dims, the frequencies, the
    interpolation, the interleaving (read by megatron's apply_rotary_pos_emb from the config)."""
    from tests.launch import one_rank_megatron, run_code

    code = one_rank_megatron(tmp_path, cp_ext_groups=True) + """
from cp_ext.arguments import parse_args
from cp_ext.config import transformer_config_from_args
from cp_ext.models.gpt_moe import build_model
shape = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "64",
         "--disable-bias-linear", "--position-embedding-type", "rope"]
def rope(*flags):
    args = parse_args(shape + list(flags), world_size=1)
    config = transformer_config_from_args(args)
    inner = build_model(config, args, 384).rotary_pos_emb.inner
    return (inner.inv_freq.numel(), round(float(inner.inv_freq.sum()), 6), inner.seq_len_interpolation_factor,
            config.rotary_interleaved)
for flags in ([], ["--rotary-percent", "0.5"], ["--rotary-base", "500000"], ["--use-rope-scaling"],
              ["--rotary-seq-len-interpolation-factor", "4"], ["--rotary-interleaved"]):
    print(rope(*flags))
"""
    base, half, base_500k, scaled, interpolated, interleaved = [
        eval(line) for line in run_code(code).stdout.strip().splitlines()[-6:]]
    assert base[0] == 4 and half[0] == 2  # head dim 8: 4 frequencies, --rotary-percent 0.5 rotates half
    assert base_500k[1] < base[1] and scaled[1] < base[1]  # a larger base, Llama 3's scaling: lower frequencies
    assert interpolated[2] == 4 and base[2] is None
    assert interleaved[3] is True and base[3] is False


@pytest.mark.quick
def test_implementation_flags_are_named_on_the_startup_line():
    """Flags naming an implementation that does not run here are accepted, and the note says what runs."""
    from cp_ext.arguments.implementations import implementation_note

    args = parse_args(MOE + ["--moe-grouped-gemm", "--use-flash-attn", "--multi-latent-attention", "--kv-channels",
                             "16", "--no-rope-fusion", "--use-mcore-models"], world_size=1)
    note = implementation_note(args, on_cpu=True)
    assert "experts: SequentialMLP (--moe-grouped-gemm" in note
    assert "--use-flash-attn: no flash kernel on CPU" in note and "--kv-channels 16 is not read by MLA" in note
    assert implementation_note(parse_args(MOE, world_size=1), on_cpu=True) == ""
