"""DeepSeek-V4's attention flags (`cp_ext.arguments.deepseek_v4`): Megatron-LM's spelling and list expressions
(--csa-compress-ratios), what reaches cp_ext's config (each layer's kind, the window, the sink, the grouped output
projection, the compressed layers' RoPE base), and the early, clear errors: each bad input is one message naming
the flag, a V4 flag without --experimental-attention-variant dsv4_hybrid is refused, and a bad flag ends the run
with exit status 2 and the message printed once."""

import argparse

import pytest

from cp_ext.arguments import parse_args, parse_args_or_exit
from cp_ext.arguments.deepseek_v4 import compress_ratios_type
from cp_ext.flag_types import layer_freq_type
from tests.arguments.common import _error

# A small V4: layers sliding, CSA (ratio 4), HCA (ratio 8), CSA; heads of 16 with 4 rotated; 2 output groups.
V4 = ["--num-layers", "4", "--num-attention-heads", "4", "--multi-latent-attention", "--qk-layernorm",
      "--q-lora-rank", "12", "--v-head-dim", "16", "--qk-pos-emb-head-dim", "4",
      "--experimental-attention-variant", "dsv4_hybrid", "--csa-compress-ratios", "[0,4,8,4]",
      "--csa-compress-ratio-for-h", "8", "--csa-window-size", "8", "--csa-compress-rotary-base", "160000",
      "--dsa-indexer-n-heads", "4", "--dsa-indexer-head-dim", "8", "--dsa-indexer-topk", "2",
      "--o-groups", "2", "--o-lora-rank", "8"]
INDEXER = ("--dsa-indexer-n-heads", "--dsa-indexer-head-dim", "--dsa-indexer-topk")


def _set(flag, value, argv=V4):
    """argv with flag's value replaced."""
    i = argv.index(flag)
    return argv[:i + 1] + [value] + argv[i + 2:]


def _drop(*flags, argv=V4):
    """argv without flags (each with its value, or alone where the next token is a flag)."""
    argv = list(argv)
    for flag in flags:
        i = argv.index(flag)
        del argv[i:i + (1 if i + 1 == len(argv) or argv[i + 1].startswith("--") else 2)]
    return argv


def _config(argv):
    from cp_ext.config import transformer_config_from_args

    return transformer_config_from_args(parse_args(argv, world_size=1))


@pytest.mark.quick
def test_v4_flags_reach_the_config():
    """Each layer's kind from --csa-compress-ratios, and the V4 sizes on cp_ext's config; the sink is on by default."""
    cfg = _config(V4)
    assert cfg.dsv4_layer_kinds == ["sliding", "csa", "hca", "csa"]
    assert cfg.csa_attention_sink and not cfg.csa_dense_mode
    assert (cfg.csa_window_size, cfg.o_groups, cfg.o_lora_rank) == (8, 2, 8)
    assert (cfg.csa_compress_ratio_for_c, cfg.csa_compress_ratio_for_h, cfg.csa_compress_rotary_base) == (4, 8, 160000)
    assert not _config(V4 + ["--csa-no-attention-sink"]).csa_attention_sink
    assert _config(["--num-layers", "4"]).dsv4_layer_kinds is None  # no V4: no kinds


@pytest.mark.quick
def test_megatron_list_expression_of_ratios():
    """Megatron-LM's list expression with the default ratios (CSA 4, HCA 128), one value per layer."""
    argv = _set("--csa-compress-ratios", "([0,0]+[4,128]*1)", _drop("--csa-compress-ratio-for-h"))
    assert parse_args(argv, world_size=1).csa_compress_ratios == [0, 0, 4, 128]
    assert _config(argv).dsv4_layer_kinds == ["sliding", "sliding", "csa", "hca"]


@pytest.mark.quick
def test_dense_mode_needs_no_indexer():
    """--csa-dense-mode: the CSA layers read every entry, so the indexer's sizes may be left out."""
    cfg = _config(_drop(*INDEXER) + ["--csa-dense-mode"])
    assert cfg.csa_dense_mode and cfg.dsv4_layer_kinds == ["sliding", "csa", "hca", "csa"]


@pytest.mark.quick
def test_packed_documents_with_position_ids_parse():
    parse_args(V4 + ["--reset-attention-mask", "--reset-position-ids"], world_size=1)


@pytest.mark.quick
@pytest.mark.parametrize("text, value", [
    ("[0,4,128,4]", [0, 4, 128, 4]), ("[0,4]*2", [0, 4, 0, 4]), (" ( [0] + [4]*3 ) ", [0, 4, 4, 4]), ("[]", []),
])
def test_compress_ratios_type_reads_list_expressions(text, value):
    assert compress_ratios_type(text) == value


@pytest.mark.quick
@pytest.mark.parametrize("text", ["[0,-4]", "abc", "4", "(0,4)", "[[0],4]", "[0,4", "__import__('os')", "[0.5]",
                                  "9**9**9", "[0]*10**9", "[0]*1000000000", "[0]*100000*100000", "[1]+2"])
def test_compress_ratios_type_refuses_other_text(text):
    """Anything but a list expression of non-negative integers; a power, or a list past 100,000 entries, is refused
    before it is built (``[0]*1000000000`` would take 8 GB, ``9**9**9`` would never return)."""
    with pytest.raises(argparse.ArgumentTypeError):
        compress_ratios_type(text)


@pytest.mark.quick
@pytest.mark.parametrize("text", ["9**9**9", "[0]*1000000000", "[1]*100000*100000", "[1]+2", "[[1]]", "[2]", "[1,1"])
def test_layer_patterns_read_list_expressions_the_same_way(text):
    """--moe-layer-freq and the other 0/1 layer patterns share the reader (`cp_ext.flag_types.list_expression`)."""
    with pytest.raises(argparse.ArgumentTypeError):
        layer_freq_type(text)
    assert layer_freq_type("([0]+[1]*3)*2") == [0, 1, 1, 1] * 2


NO_MLA = _drop("--multi-latent-attention", "--q-lora-rank", "--v-head-dim", "--qk-pos-emb-head-dim")


@pytest.mark.quick
@pytest.mark.parametrize(
    "argv, world, must_name",
    [
        (_set("--csa-compress-ratios", "[0,6,8,6]") + ["--csa-compress-ratio-for-c", "6"], 1,
         ["--csa-compress-ratio-for-c 6 is not a positive power of two"]),
        (_set("--csa-compress-ratio-for-h", "12", _set("--csa-compress-ratios", "[0,4,12,4]")), 1,
         ["--csa-compress-ratio-for-h 12 is not a positive power of two"]),
        (_set("--csa-compress-ratio-for-h", "4", _set("--csa-compress-ratios", "[0,4,4,4]")), 1,
         ["--csa-compress-ratio-for-c and --csa-compress-ratio-for-h are both 4"]),
        (_set("--csa-compress-ratios", "[0,4,8]"), 1,
         ["--csa-compress-ratios lists 3 layers but --num-layers is 4"]),
        (_set("--csa-compress-ratios", "[0,4,16,4]"), 1,
         ["--csa-compress-ratios holds [16], which mark no layer kind", "--csa-compress-ratio-for-c",
          "--csa-compress-ratio-for-h"]),
        (_set("--csa-compress-ratios", "[0,-4,8,4]"), 1, ["--csa-compress-ratios: expected a list expression"]),
        (_set("--csa-compress-ratios", "4"), 1, ["--csa-compress-ratios: not a list; expected a list expression"]),
        (_set("--csa-window-size", "0"), 1, ["--csa-window-size: must be an integer >= 1 (got 0)"]),
        (_set("--dsa-indexer-topk", "0"), 1, ["--dsa-indexer-topk: must be an integer >= 1 (got 0)"]),
        (_drop("--csa-compress-ratios"), 1, ["dsv4_hybrid needs --csa-compress-ratios"]),
        (_drop(*INDEXER), 1, ["need their lightning indexer's --dsa-indexer-n-heads, --dsa-indexer-head-dim, "
                              "--dsa-indexer-topk", "or --csa-dense-mode"]),
        (_drop("--dsa-indexer-topk"), 1, ["lightning indexer's --dsa-indexer-topk ("]),
        (_set("--dsa-indexer-head-dim", "2"), 1, ["--dsa-indexer-head-dim 2 is smaller than the RoPE part"]),
        (_drop("--multi-latent-attention", "--q-lora-rank", "--v-head-dim", "--qk-pos-emb-head-dim",
               "--dsa-indexer-n-heads", "--dsa-indexer-head-dim", "--dsa-indexer-topk") + ["--csa-dense-mode"], 1, ["dsv4_hybrid is DeepSeek-V4's attention", "add --multi-latent-attention"]),
        (_drop("--qk-layernorm"), 1, ["dsv4_hybrid normalizes the compressed query", "add --qk-layernorm"]),
        (_drop("--q-lora-rank"), 1, ["dsv4_hybrid needs --q-lora-rank"]),
        (_set("--v-head-dim", "4"), 1, ["--v-head-dim 4 is V4's whole head", "--qk-pos-emb-head-dim 4",
                                        "it must be larger"]),
        (_set("--o-groups", "3"), 1, ["--num-attention-heads 4 is not a multiple of --o-groups 3"]),
        (_set("--o-groups", "1") + ["--tensor-model-parallel-size", "2", "--sequence-parallel"], 2,
         ["--o-groups 1 is not divisible by --tensor-model-parallel-size 2"]),
        (V4 + ["--reset-attention-mask"], 1, ["with --reset-attention-mask", "add --reset-position-ids"]),
        (V4 + ["--mtp-num-layers", "1"], 1, ["--csa-compress-ratios lists 4 layers but --num-layers 4 and "
                                             "--mtp-num-layers 1 make 5", "the MTP layers' last"]),
        (V4 + ["--dsa-indexer-loss-coeff", "0.1"], 1, ["--dsa-indexer-loss-coeff (the indexer's KL loss) is not "
                                                       "supported"]),
        (V4 + ["--window-size", "8,0"], 1, ["--window-size (V4's window is --csa-window-size) is not supported"]),
        (V4 + ["--softmax-type", "learnable"], 1, ["--softmax-type learnable", "--csa-no-attention-sink drops it"]),
        (V4 + ["--enable-hyper-connections", "--hidden-dropout", "0.1"], 1,
         ["--hidden-dropout 0.1 is not supported with it; set 0"]),
        (V4 + ["--enable-hyper-connections", "--recompute-granularity", "selective"], 1,
         ["--recompute-granularity selective is not supported with --enable-hyper-connections"]),
        (V4 + ["--num-residual-streams", "2"], 1, ["--num-residual-streams is only read with --enable-hyper-connections"]),
    ],
    ids=["c-not-power-of-two", "h-not-power-of-two", "c-equals-h", "ratios-length", "ratio-marks-no-kind",
         "negative-ratio", "ratios-not-a-list", "window-zero", "topk-zero", "ratios-missing", "indexer-missing",
         "topk-missing", "indexer-head-below-rope", "without-mla", "without-qk-layernorm", "without-q-lora",
         "v-head-not-above-rope", "heads-over-o-groups", "o-groups-over-tp", "packed-without-position-ids",
         "mtp-without-its-ratio",
         "indexer-loss", "window-size", "softmax-type", "streams-with-hidden-dropout", "streams-with-selective-recompute",
         "streams-without-hyper-connections"],
)
def test_bad_v4_flags_name_the_flag(argv, world, must_name):
    """One problem, one message (nothing else reported), naming the flag and the fix."""
    message = _error(argv, world)
    assert len(message.splitlines()) == 1, message
    for text in must_name:
        assert text in message, f"{text!r} missing from: {message}"


DSA = ["--multi-latent-attention", "--q-lora-rank", "12", "--experimental-attention-variant", "dsa",
       "--dsa-indexer-n-heads", "4", "--dsa-indexer-head-dim", "64", "--dsa-indexer-topk", "8"]


@pytest.mark.quick
@pytest.mark.parametrize("argv, flag", [
    (["--csa-window-size", "64"], "--csa-window-size"),
    (["--csa-dense-mode"], "--csa-dense-mode"),
    (["--o-groups", "4"], "--o-groups"),
    (["--o-lora-rank", "8"], "--o-lora-rank"),
    (["--csa-compress-ratios", "[0,4,128,4]", "--num-layers", "4"], "--csa-compress-ratios"),
    (["--csa-no-attention-sink"], "--csa-no-attention-sink"),
    (["--csa-compress-ratio-for-c", "8"], "--csa-compress-ratio-for-c"),
    (["--csa-compress-ratio-for-h", "64"], "--csa-compress-ratio-for-h"),
    (["--csa-compress-rotary-base", "160000"], "--csa-compress-rotary-base"),
    (DSA + ["--csa-window-size", "64"], "--csa-window-size"),
], ids=["window", "dense-mode", "o-groups", "o-lora-rank", "ratios", "no-sink", "ratio-c", "ratio-h", "rotary-base",
        "window-with-dsa"])
def test_v4_flag_without_v4_is_refused(argv, flag):
    message = _error(argv, 1)
    assert len(message.splitlines()) == 1, message
    assert f"{flag} applies to DeepSeek-V4's attention; add --experimental-attention-variant dsv4_hybrid" in message


@pytest.mark.quick
@pytest.mark.parametrize("argv, must_name", [
    (_set("--csa-compress-ratios", "[0,4,8]"), "--csa-compress-ratios lists 3 layers but --num-layers is 4"),
    (_set("--csa-window-size", "0"), "--csa-window-size: must be an integer >= 1"),
], ids=["validation", "argparse"])
def test_bad_v4_flag_exits_2_with_one_message(monkeypatch, capsys, argv, must_name):
    """The launch path (`parse_args_or_exit`): exit status 2, the message once on rank 0's stderr."""
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit) as info:
        parse_args_or_exit(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("pretrain_moe.py: configuration error") == 1, err
    assert err.count(must_name) == 1, err


@pytest.mark.quick
@pytest.mark.parametrize("extra, why", [(["--csa-dense-mode"], "--csa-dense-mode"),
                                        (["--csa-compress-ratios", "[0,8,8,0]"], "no CSA layer")])
def test_indexer_flags_without_an_indexer_are_refused(extra, why):
    """The indexer's sizes with nothing to size (dense mode, or no CSA layer): one message, drop them."""
    message = _error(V4 + extra, 1)
    assert "--dsa-indexer-n-heads, --dsa-indexer-head-dim, --dsa-indexer-topk size the CSA layers' indexer" in message
    assert why in message


@pytest.mark.quick
def test_checkpoint_without_the_hash_table_is_refused(tmp_path, crafted_checkpoint):
    """V4's parts are model flags: a checkpoint saved without hash layers (no tid2eid table), another window or
    without hyper-connections is refused at parse time, naming each flag, the run's value and the checkpoint's."""
    import json

    ckpt = crafted_checkpoint(tmp_path / "ckpt", 5)
    meta = ckpt / "iter_0000005" / "meta.json"
    saved = {"moe_n_hash_layers": 0, "csa_window_size": 16, "csa_compress_ratios": [0, 4, 8, 4]}
    meta.write_text(json.dumps({**json.loads(meta.read_text()), "model": saved}))
    argv = V4 + ["--num-experts", "4", "--moe-router-score-function", "sqrtsoftplus", "--moe-n-hash-layers", "1",
                 "--moe-router-load-balancing-type", "none", "--load", str(ckpt), "--train-iters", "10"]
    message = _error(argv, 1)
    assert "the checkpoint is of another model" in message
    assert "--moe-n-hash-layers 1 (checkpoint: 0)" in message and "--csa-window-size 8 (checkpoint: 16)" in message
    assert "--csa-compress-ratios" not in message  # the same layers: not named


@pytest.mark.quick
@pytest.mark.parametrize("enable, streams", [("--enable-hyper-connections", "--num-residual-streams"),
                                             ("--enable-mhc-connections", "--mhc-num-residual-streams")])
def test_hyper_connection_flags_in_either_megatron_spelling(enable, streams):
    """Megatron-LM main's --enable-mhc-connections / --mhc-num-residual-streams and the DeepSeek-V4 branch's
    --enable-hyper-connections / --num-residual-streams set the same fields."""
    cfg = _config(V4 + [enable, streams, "2", "--mhc-sinkhorn-iterations", "7"])
    assert (cfg.enable_hyper_connections, cfg.num_residual_streams, cfg.mhc_sinkhorn_iterations) == (True, 2, 7)
    assert not _config(V4).enable_hyper_connections


@pytest.mark.quick
def test_mtp_layers_take_the_ratios_after_the_decoders():
    """Megatron-LM's V4 scripts: --csa-compress-ratios lists the decoder's layers, then the MTP layers'."""
    cfg = _config(_set("--csa-compress-ratios", "[0,4,8,4,0]") + ["--mtp-num-layers", "1"])
    assert cfg.dsv4_layer_kinds == ["sliding", "csa", "hca", "csa", "sliding"] and cfg.mtp_num_layers == 1


@pytest.mark.quick
def test_startup_line_names_the_kinds():
    import torch

    from cp_ext.training.report import attention_kernel_line

    line = attention_kernel_line(_config(_set("--csa-compress-ratios", "[0,4,8,4,0]") + ["--mtp-num-layers", "1"]),
                                 torch.device("cpu"))
    assert "1 sliding, 2 CSA, 1 HCA; MTP: sliding" in line and "window 8" in line, line
