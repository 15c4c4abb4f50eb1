"""Kernel choice without a GPU (kernels/registry.py): each kernel's dtype / head-dim / device /
torch-version limits and the reason it names, auto's pick, torch version parsing, and that the
optional backends (flash-attn, Transformer Engine) are imported only when asked for."""

import subprocess
import sys

import pytest
import torch

from cp_ext.attention.kernels import PREFERENCE, UnfusedKernel, choose_kernel, get_kernel, supported
from cp_ext.attention.kernels.version import version as _version
from tests.attention.kernels.common import DTYPES

HALF, ALL_FLOATS = (torch.float16, torch.bfloat16), list(DTYPES.values())


def test_kernel_selection_and_optional_backends_are_import_guarded():
    code = (
        "import sys, torch, cp_ext.attention as a\n"
        "assert type(a.get_kernel('cpu', torch.bfloat16)).__name__ == 'CpuSdpaKernel'\n"
        "bad = [m for m in sys.modules if m.startswith(('flash_attn', 'transformer_engine'))]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
    with pytest.raises(ValueError, match="unknown attention kernel"):
        get_kernel("cpu", torch.float32, "nope")
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError):
            get_kernel("cuda", torch.bfloat16, "flash_attn")



@pytest.mark.parametrize(
    "device, dtype, head_dim, expected",
    [
        ("cuda", torch.bfloat16, 128, "flash"), ("cuda", torch.float16, 64, "flash"), ("cuda", torch.bfloat16, 256, "flash"),
        ("cuda", torch.bfloat16, 80, "flash"), ("cuda", torch.bfloat16, 8, "flash"),
        ("cuda", torch.bfloat16, 288, "efficient"),  # > 256: no flash, but 288 % 8 == 0
        ("cuda", torch.float16, 100, "unfused"),  # 100 % 8 != 0: neither flash nor half-precision efficient
        ("cuda", torch.float32, 128, "efficient"), ("cuda", torch.float32, 100, "efficient"),  # fp32: % 4
        ("cuda", torch.float32, 30, "unfused"), ("cuda", torch.float64, 64, "unfused"),
        ("cpu", torch.float64, 64, "cpu"), ("cpu", torch.float32, 30, "cpu"), ("cpu", torch.bfloat16, 300, "cpu"),
        ("cpu", torch.float16, 7, "cpu"), ("meta", torch.float32, 64, "unfused"),
    ],
)
def test_auto_picks_the_first_kernel_that_fits(device, dtype, head_dim, expected):
    assert choose_kernel(device, dtype, head_dim) == expected


def test_auto_choice_is_first_supported_for_every_combination():
    """Over every dtype x head dim 1..320 x device x torch version: auto's pick is supported and
    every kernel it prefers over it is not; it never picks a CUDA kernel for fp32-only/fp64 limits."""
    for device in ("cuda", "cpu"):
        for dtype in ALL_FLOATS:
            for head_dim in range(1, 321):
                for version in ("2.4.0", "2.8.1", "2.9.0", "2.13.0+cu128"):
                    pick = choose_kernel(device, dtype, head_dim, version)
                    assert supported(pick, dtype, head_dim, device, version) is None
                    order = PREFERENCE[device]
                    assert all(supported(n, dtype, head_dim, device, version) for n in order[: order.index(pick)])
                    if pick == "flash":
                        assert dtype in HALF and head_dim % 8 == 0 and head_dim <= 256
                    if pick == "efficient":
                        assert dtype != torch.float64 and head_dim % (8 if dtype in HALF else 4) == 0


@pytest.mark.quick
@pytest.mark.parametrize(
    "name, dtype, head_dim, device, version, must_say",
    [
        ("flash", torch.float32, 64, "cuda", None, "fp16/bf16 only, not fp32"),
        ("flash", torch.bfloat16, 260, "cuda", None, "at most 256"),
        ("flash", torch.bfloat16, 68, "cuda", None, "a multiple of 8"),
        ("flash_attn", torch.float16, 264, "cuda", None, "at most 256"),
        ("te", torch.float32, 64, "cuda", None, "fp16/bf16 only"),
        ("efficient", torch.float64, 64, "cuda", None, "fp32/fp16/bf16 only, not fp64"),
        ("efficient", torch.float32, 6, "cuda", None, "a multiple of 4 for fp32"),
        ("efficient", torch.bfloat16, 36, "cuda", None, "a multiple of 8 for bf16"),
        ("cudnn", torch.bfloat16, 192, "cuda", None, "at most 128"),
        ("cudnn", torch.bfloat16, 128, "cuda", "2.4.1", "torch >= 2.5"),
        ("cudnn", torch.float32, 128, "cuda", None, "fp16/bf16 only"),
        ("cpu", torch.bfloat16, 64, "cuda", None, "CPU tensors only"),
        ("flash", torch.bfloat16, 64, "cpu", None, "CUDA tensors only"),
        ("nope", torch.float32, 64, "cpu", None, "unknown attention kernel"),
    ],
)
def test_kernel_limits_name_the_limit(name, dtype, head_dim, device, version, must_say):
    reason = supported(name, dtype, head_dim, device, version)
    assert reason is not None and must_say in reason, reason


@pytest.mark.parametrize(
    "name, dtype, head_dim, device, version",
    [
        ("flash", torch.bfloat16, 256, "cuda", None), ("flash", torch.float16, 72, "cuda", None),
        ("efficient", torch.float32, 4, "cuda", None), ("efficient", torch.float16, 512, "cuda", None),
        ("cudnn", torch.bfloat16, 128, "cuda", "2.5.0"), ("te", torch.bfloat16, 128, "cuda", None),
        ("unfused", torch.float64, 7, "cuda", None), ("unfused", torch.float32, 3, "cpu", None),
        ("cpu", torch.float64, 5, "cpu", None),
    ],
)
def test_kernel_limits_accept(name, dtype, head_dim, device, version):
    assert supported(name, dtype, head_dim, device, version) is None


def test_named_kernel_that_cannot_run_raises_with_its_limit():
    with pytest.raises(ValueError, match="fp16/bf16 only, not fp32"):
        get_kernel("cuda", torch.float32, "flash", head_dim=64)
    with pytest.raises(ValueError, match="a multiple of 8"):
        get_kernel("cuda", torch.bfloat16, "flash", head_dim=100)
    with pytest.raises(ValueError, match="CPU tensors only"):
        get_kernel("cuda", torch.float32, "cpu", head_dim=64)
    assert isinstance(get_kernel("cuda", torch.float64, "auto", head_dim=64), UnfusedKernel)


def test_version_parsing_is_numeric():
    assert _version("2.10.0a0+git1234") == (2, 10) > _version("2.9.1") == (2, 9) > _version("2.8.0+cu126")

