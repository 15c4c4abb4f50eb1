"""Flags, YAML configs and the early, clear errors for a bad grid."""

import os

import pytest

from cp_ext.arguments import ConfigError, parse_args
from tests.launch import REPO_ROOT, run_script

MOE = ["--num-experts", "4", "--position-embedding-type", "rope", "--disable-bias-linear", "--swiglu", "--normalization", "RMSNorm", "--num-layers", "4", "--num-attention-heads", "4", "--hidden-size", "64"]


def _error(argv, world_size):
    with pytest.raises(ConfigError) as info:
        parse_args(argv, world_size=world_size)
    return str(info.value)


@pytest.mark.quick
@pytest.mark.parametrize(
    "argv, world, must_name",
    [
        (["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"], 6,
         ["world size 6", "--tensor-model-parallel-size", "--pipeline-model-parallel-size"]),
        (["--tensor-model-parallel-size", "3", "--num-attention-heads", "4", "--hidden-size", "48"], 3,
         ["--num-attention-heads 4", "--tensor-model-parallel-size 3"]),
        (["--tensor-model-parallel-size", "2", "--num-attention-heads", "4", "--group-query-attention", "--num-query-groups", "1"], 2,
         ["--num-query-groups 1"]),
        (["--position-embedding-type", "rope", "--disable-bias-linear", "--swiglu", "--normalization", "RMSNorm", "--num-layers", "3", "--pipeline-model-parallel-size", "2"], 2, ["--num-layers 3", "--pipeline-model-parallel-size 2"]),
        (["--global-batch-size", "6", "--micro-batch-size", "2"], 2, ["--global-batch-size 6", "--micro-batch-size 2"]),
        (MOE + ["--num-experts", "6", "--expert-model-parallel-size", "4"], 4, ["--num-experts 6", "--expert-model-parallel-size 4"]),
        (MOE + ["--tensor-model-parallel-size", "2"], 2, ["--sequence-parallel"]),
        (["--context-parallel-size", "2", "--seq-length", "30"], 2, ["--seq-length 30", "--context-parallel-size"]),
        (["--context-parallel-size", "4", "--ulysses-size", "3"], 4, ["--ulysses-size 3", "--context-parallel-size 4"]),
        (["--context-parallel-size", "2", "--cp-comm-type", "a2a+p2p"], 2, ["--hierarchical-context-parallel-sizes"]),
        (["--context-parallel-size", "2", "--cp-comm-type", "p2p", "--ulysses-size", "2"], 2, ["contradicts --cp-comm-type p2p"]),
        (["--context-parallel-size", "4", "--ulysses-size", "4", "--num-attention-heads", "6", "--hidden-size", "48",
          "--seq-length", "32"], 4, ["--ulysses-size 4", "6 query heads"]),
        (["--context-parallel-size", "2", "--attention-dropout", "0.1"], 2, ["--attention-dropout 0"]),
        (["--save-interval", "5"], 1, ["--save-interval 5 needs --save"]),
        (["--tensorboard-dir", str(REPO_ROOT / "README.md")], 1,
         [f"--tensorboard-dir {REPO_ROOT / 'README.md'}: is a file, not a directory"]),
        (["--tensorboard-dir", str(REPO_ROOT / "README.md" / "tb")], 1,
         [f"cannot be created: {REPO_ROOT / 'README.md'} is a file"]),
        (["--log-timers-to-tensorboard", "--log-validation-ppl-to-tensorboard"], 1,
         ["--log-validation-ppl-to-tensorboard and --log-timers-to-tensorboard need --tensorboard-dir DIR"]),
        (["--tensorboard-dir", "tb", "--tensorboard-log-interval", "0"], 1,
         ["--tensorboard-log-interval: must be an integer >= 1 (got 0)"]),
        (["--tensor-model-parallel-size", "2", "--make-vocab-size-divisible-by", "7"], 2,
         ["--make-vocab-size-divisible-by 7", "--tensor-model-parallel-size 2"]),
        (["--context-parallel-size", "2", "--position-embedding-type", "rope", "--disable-bias-linear", "--swiglu", "--normalization", "RMSNorm", "--num-layers", "4", "--cp-comm-type", "p2p", "all_gather"], 2,
         ["--cp-comm-type lists 2 types", "--num-layers 4"]),
        (["--context-parallel-size", "2", "--position-embedding-type", "rope", "--disable-bias-linear", "--swiglu", "--normalization", "RMSNorm", "--num-layers", "2", "--cp-comm-type", "p2p", "a2a"], 2,
         ["--cp-comm-type mixes a2a and p2p", "all_gather with one other type"]),
        (["--context-parallel-size", "2", "--cp-comm-type", "allgather"], 2, ["--cp-comm-type", "all_gather"]),
        (["--context-parallel-size", "2", "--cp-comm-type", "all_gather", "--ulysses-size", "2"], 2,
         ["--ulysses-size contradicts --cp-comm-type all_gather", "give one of them"]),
        (["--mtp-num-layers", "0"], 1, ["--mtp-num-layers", "an integer >= 1", "got 0"]),
        (["--mtp-num-layers", "1", "--mtp-loss-scaling-factor", "-0.1"], 1, ["--mtp-loss-scaling-factor", ">= 0"]),
        (["--mtp-loss-scaling-factor", "0.3"], 1, ["--mtp-loss-scaling-factor 0.3 is only read with --mtp-num-layers"]),
        (["--num-layers", "4", "--mtp-num-layers", "1", "--pipeline-model-parallel-size", "2"], 2,
         ["--mtp-num-layers with --pipeline-model-parallel-size 2 needs RoPE or no position embedding",
          "learned_absolute"]),
        (["--mtp-num-layers", "1", "--recompute-granularity", "full", "--recompute-method", "block",
          "--recompute-num-layers", "1"], 1, ["--mtp-num-layers with --recompute-granularity full needs "
                                              "--recompute-method uniform --recompute-num-layers 1",
                                              "--recompute-method block"]),
    ],
    ids=["world-vs-grid", "heads-vs-tp", "groups-vs-tp", "layers-vs-pp", "batch-vs-dp", "experts-vs-ep", "moe-tp-needs-sp",
         "seq-vs-cp", "ulysses-vs-cp", "hierarchical-missing", "comm-type-contradiction", "heads-vs-ulysses",
         "cp-dropout", "save-interval-without-save", "tensorboard-dir-is-a-file",
         "tensorboard-dir-under-a-file", "tensorboard-switches-without-dir", "tensorboard-interval-0",
         "vocab-padding-vs-tp",
         "comm-type-list-length", "comm-type-list-mixes-two-layouts", "comm-type-misspelt",
         "all-gather-contradicts-ulysses", "mtp-layers-0", "mtp-scale-negative", "mtp-scale-without-mtp",
         "mtp-pp-learned-positions", "mtp-with-full-recompute"],
)
def test_bad_grid_names_the_flags(argv, world, must_name):
    message = _error(argv, world)
    for text in must_name:
        assert text in message, f"{text!r} missing from: {message}"


def test_cp_comm_type_maps_onto_ulysses_size():
    base = ["--seq-length", "64"]
    assert parse_args(base + ["--context-parallel-size", "4", "--cp-comm-type", "a2a"], world_size=4).ulysses_size == 4
    assert parse_args(base + ["--context-parallel-size", "4", "--cp-comm-type", "p2p"], world_size=4).ulysses_size == 1
    args = parse_args(base + ["--context-parallel-size", "4", "--cp-comm-type", "a2a+p2p",
                              "--hierarchical-context-parallel-sizes", "2", "2"], world_size=4)
    assert args.ulysses_size == 2
    assert parse_args(base + ["--context-parallel-size", "4", "--ulysses-size", "2"], world_size=4).ulysses_size == 2


def test_cp_comm_type_per_layer_lists():
    """Megatron's per-layer form: all_gather layers on the layout of the run's one other type."""
    base = ["--seq-length", "64", "--position-embedding-type", "rope", "--disable-bias-linear", "--swiglu", "--normalization", "RMSNorm", "--num-layers", "4", "--context-parallel-size", "4"]
    args = parse_args(base + ["--cp-comm-type", "all_gather"], world_size=4)
    assert args.ulysses_size == 1 and args.cp_comm_types == ["all_gather"] * 4
    args = parse_args(base + ["--cp-comm-type", "a2a+p2p", "all_gather", "a2a+p2p", "all_gather",
                              "--hierarchical-context-parallel-sizes", "2", "2"], world_size=4)
    assert args.ulysses_size == 2 and args.cp_comm_types == ["a2a+p2p", "all_gather", "a2a+p2p", "all_gather"]
    args = parse_args(base + ["--cp-comm-type", "a2a", "a2a", "a2a", "a2a"], world_size=4)
    assert args.ulysses_size == 4 and args.cp_comm_types is None  # no all_gather layer: the groups decide


def test_all_problems_reported_together():
    message = _error(["--position-embedding-type", "rope", "--disable-bias-linear", "--swiglu", "--normalization", "RMSNorm", "--num-layers", "3", "--pipeline-model-parallel-size", "2", "--num-experts", "3",
                      "--expert-model-parallel-size", "2"], 2)
    assert "--num-layers 3" in message and "--num-experts 3" in message


def test_good_grid_derives_dp_and_batch():
    args = parse_args(MOE + ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--expert-model-parallel-size", "2"], world_size=8)
    assert args.data_parallel_size == 4 and args.global_batch_size == 4 and args.expert_tensor_parallel_size == 2


def test_yaml_supplies_defaults_and_flags_override(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("num-layers: 6\nhidden_size: 96\nnum-attention-heads: 4\nlr: 0.01\n")
    args = parse_args(["--config", str(cfg), "--position-embedding-type", "rope", "--disable-bias-linear", "--swiglu", "--normalization", "RMSNorm", "--num-layers", "2"], world_size=1)
    assert (args.num_layers, args.hidden_size, args.lr) == (2, 96, 0.01)


@pytest.mark.quick
def test_yaml_unknown_key_is_an_error(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("num-layer: 6\n")
    assert "unknown key 'num-layer'" in _error(["--config", str(cfg)], 1)


# Each bundled config and the world size it is written for.
BUNDLED = {"cpu_demo.yaml": 4, "cpu_passkey.yaml": 2, "cpu_long_64k.yaml": 4, "mixtral_8x7b_32k_2x8gpu.yaml": 16,
           "mixtral_8x7b_128k_4x8gpu.yaml": 32, "deepseek_v3_128k_32x8gpu.yaml": 256,
           "qwen3_30b_a3b_128k_8x8gpu.yaml": 64, "gpt_oss_120b_128k_8x8gpu.yaml": 64}


@pytest.mark.quick
def test_bundled_configs_parse(monkeypatch):
    # The GPU configs say device: cuda, which this host may lack: validate them as on a CUDA host.
    monkeypatch.setattr("cp_ext.platform.cuda_unusable_reason", lambda: None)
    found = sorted(n for n in os.listdir(REPO_ROOT / "configs") if n.endswith(".yaml"))
    assert found == sorted(BUNDLED), "add new configs to BUNDLED with their world size"
    for name, world in BUNDLED.items():
        parse_args(["--config", str(REPO_ROOT / "configs" / name)], world_size=world)


def test_bad_flags_fail_once_on_rank_0_before_any_work():
    """Two ranks, a bad grid: exit status 2 on every rank, one message, no hang."""
    proc = run_script(2, REPO_ROOT / "pretrain_moe.py", "--position-embedding-type", "rope", "--disable-bias-linear", "--swiglu", "--normalization", "RMSNorm", "--num-layers", "3", "--pipeline-model-parallel-size", "2",
                      torchrun=True, check=False, timeout=120)
    assert proc.returncode != 0
    assert proc.stderr.count("--num-layers 3 is not divisible by --pipeline-model-parallel-size 2") == 1, proc.stderr
    assert "Traceback" not in proc.stderr.split("configuration error")[0]


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


# ----------------------------------------------------------------------------- attention kernel, device, overlap

CUDA = ["--device", "cuda"]


@pytest.fixture
def cuda_host(monkeypatch):
    """Validate as on a host where CUDA is usable (the device check itself is tested below)."""
    monkeypatch.setattr("cp_ext.platform.cuda_unusable_reason", lambda: None)


@pytest.mark.parametrize(
    "argv, must_name",
    [
        (CUDA + ["--attention-backend", "flash"], ["--attention-backend flash", "fp16/bf16 only, not fp32", "--bf16"]),
        (CUDA + ["--attention-backend", "flash", "--bf16", "--kv-channels", "100"],
         ["--attention-backend flash", "a multiple of 8", "--kv-channels 100"]),
        (CUDA + ["--attention-backend", "flash", "--bf16", "--hidden-size", "1088", "--num-attention-heads", "4"],
         ["at most 256", "--hidden-size 1088 / --num-attention-heads 4 = 272"]),
        (CUDA + ["--attention-backend", "fused", "--bf16", "--kv-channels", "192"],
         ["--attention-backend fused (cp_ext's cudnn kernel)", "at most 128"]),
        (CUDA + ["--attention-backend", "efficient", "--kv-channels", "30"], ["a multiple of 4 for fp32", "not 30"]),
        (CUDA + ["--attention-backend", "cpu"], ["--attention-backend cpu", "CPU tensors only"]),
        (["--device", "cpu", "--attention-backend", "flash", "--bf16"], ["CUDA tensors only", "--device cpu"]),
        (CUDA + ["--attention-backend", "efficient", "--attention-dropout", "0.1"],
         ["--attention-dropout 0.1", "--attention-backend auto or unfused"]),
        (["--overlap-param-gather", "--overlap-grad-reduce"], ["--overlap-param-gather needs --use-distributed-optimizer"]),
        (["--overlap-param-gather", "--use-distributed-optimizer"], ["--overlap-param-gather needs --overlap-grad-reduce"]),
    ],
    ids=["flash-fp32", "flash-head-dim-align", "flash-head-dim-max", "fused-head-dim", "efficient-fp32-align",
         "cpu-kernel-on-cuda", "flash-on-cpu", "kernel-without-dropout", "param-gather-needs-distopt",
         "param-gather-needs-grad-overlap"],
)
def test_bad_attention_and_overlap_flags_name_the_limit(cuda_host, argv, must_name):
    message = _error(argv, 2)
    for text in must_name:
        assert text in message, f"{text!r} missing from: {message}"


def test_optional_kernel_package_missing(cuda_host):
    import importlib.util

    if importlib.util.find_spec("flash_attn") is None:
        assert "needs the flash-attn package" in _error(CUDA + ["--attention-backend", "flash_attn", "--bf16"], 1)


def test_attention_backend_maps_megatron_names_onto_kernels(cuda_host):
    from cp_ext.arguments import ATTENTION_BACKENDS
    from cp_ext.attention.kernels import KERNELS
    from cp_ext.config import transformer_config_from_args

    assert set(ATTENTION_BACKENDS.values()) == set(KERNELS) | {"auto"}
    expected = {"auto": "auto", "flash": "flash", "fused": "cudnn", "unfused": "unfused", "local": "unfused"}
    for backend, kernel in expected.items():
        args = parse_args(CUDA + ["--bf16", "--attention-backend", backend], world_size=1)
        assert args.attention_kernel == kernel
        assert transformer_config_from_args(args).attention_kernel == kernel
    # fp32 on CUDA and any dtype on CPU: the kernels that take them
    assert parse_args(CUDA + ["--attention-backend", "efficient"], world_size=1).attention_kernel == "efficient"
    assert parse_args(["--device", "cpu", "--attention-backend", "local"], world_size=1).attention_kernel == "unfused"
    assert parse_args(["--device", "cpu", "--attention-backend", "cpu"], world_size=1).attention_kernel == "cpu"


def test_env_override_is_the_default_and_validated(monkeypatch):
    monkeypatch.setenv("CP_EXT_ATTN_KERNEL", "unfused")
    assert parse_args(["--device", "cpu"], world_size=1).attention_kernel == "unfused"
    assert parse_args(["--device", "cpu", "--attention-backend", "auto"], world_size=1).attention_kernel == "auto"
    monkeypatch.setenv("CP_EXT_ATTN_KERNEL", "flash")
    assert "CUDA tensors only" in _error(["--device", "cpu"], 1)
    monkeypatch.setenv("CP_EXT_ATTN_KERNEL", "flsh")
    assert "CP_EXT_ATTN_KERNEL" in _error(["--device", "cpu"], 1)


def test_device_cuda_without_cuda_is_an_error():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this host has CUDA")
    message = _error(["--device", "cuda"], 1)
    assert "--device cuda" in message and "--device cpu" in message
    assert ("built without CUDA" if torch.version.cuda is None else "is_available() is False") in message


def test_overlap_flags_parse(cuda_host):
    args = parse_args(["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"], world_size=2)
    assert args.overlap_grad_reduce and args.overlap_param_gather
    assert not parse_args([], world_size=2).overlap_grad_reduce


@pytest.mark.parametrize(
    "argv, must_name",
    [
        (["--eval-interval", "0"], ["--eval-interval: must be an integer >= 1 (got 0)"]),
        (["--eval-interval", "5", "--eval-iters", "-1"], ["--eval-iters: must be an integer >= 0 (got -1)"]),
        (["--eval-interval", "5", "--split", "100,0,0"], ["--eval-interval needs validation data", "--valid-data-path"]),
        (["--eval-interval", "5", "--split", "abc"], ["--split abc: expected up to three"]),
        (["--skip-train", "--split", "1"], ["--eval-interval needs validation data"]),
        (["--eval-interval", "5", "--valid-data-path", "/nonexistent/prefix"], ["/nonexistent/prefix"]),
    ],
    ids=["interval-0", "iters-negative", "no-valid-split", "split-malformed", "skip-train-without-valid",
         "missing-valid-data"],
)
def test_bad_evaluation_flags_name_the_flag(argv, must_name):
    message = _error(argv, 1)
    for text in must_name:
        assert text in message, f"{text!r} missing from: {message}"


def test_evaluation_splits():
    from cp_ext.arguments import evaluation_splits, parse_args

    assert evaluation_splits(parse_args(["--eval-interval", "5"], world_size=1)) == ["valid", "test"]
    assert evaluation_splits(parse_args(["--eval-interval", "5", "--split", "9,1,0"], world_size=1)) == ["valid"]
    assert evaluation_splits(parse_args(["--eval-interval", "5", "--eval-iters", "0"], world_size=1)) == []
    assert evaluation_splits(parse_args([], world_size=1)) == []  # off unless asked for, unlike Megatron-LM


# ----------------------------------------------------------------------------- windows and sinks
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


MLA = ["--multi-latent-attention", "--kv-lora-rank", "16", "--qk-head-dim", "8", "--qk-pos-emb-head-dim", "4",
       "--v-head-dim", "6"]


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
