"""The attention kernel, device and overlap flags (`cp_ext.arguments.attention`): limits named at parse time,
Megatron-LM's --attention-backend names, the device check."""

import pytest

from cp_ext.arguments import parse_args
from tests.arguments.common import CUDA, _error


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
