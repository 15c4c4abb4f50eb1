"""Which local kernel runs a call: the registry of kernels by name, what each supports
(`supported`: pure, from the kernels' `Limits`), auto's order of preference (`PREFERENCE`,
`choose_kernel`) and the cached instance a call gets (`get_kernel`).

The package's docstring (`cp_ext.attention.kernels`) has the table of kernels and their limits, and how
Megatron-LM's ``--attention-backend`` names map onto them.
"""

import importlib.util
from typing import Optional

import torch

from cp_ext.attention.kernels.base import AttnKernel
from cp_ext.attention.kernels.cpu import CpuSdpaKernel
from cp_ext.attention.kernels.flash_attn import FlashAttnKernel
from cp_ext.attention.kernels.sdpa_cuda import CudaCudnnSdpaKernel, CudaEfficientSdpaKernel, CudaFlashSdpaKernel
from cp_ext.attention.kernels.te import TransformerEngineKernel
from cp_ext.attention.kernels.unfused import UnfusedKernel
from cp_ext.attention.kernels.version import version as _version

KERNELS = {
    "cpu": CpuSdpaKernel,
    "flash": CudaFlashSdpaKernel,
    "efficient": CudaEfficientSdpaKernel,
    "cudnn": CudaCudnnSdpaKernel,
    "flash_attn": FlashAttnKernel,
    "te": TransformerEngineKernel,
    "unfused": UnfusedKernel,
}
_CACHE = {}

# auto's order of preference per device type; the last entry runs everything.
PREFERENCE = {"cuda": ("flash", "efficient", "unfused"), "cpu": ("cpu", "unfused")}


def dtype_name(dtype: torch.dtype) -> str:
    return {torch.float64: "fp64", torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(
        dtype, str(dtype).replace("torch.", ""))


def supported(name: str, dtype: torch.dtype, head_dim: Optional[int], device_type: str,
              torch_version=None, *, v_head_dim: Optional[int] = None, window: bool = False) -> Optional[str]:
    """None if kernel ``name`` runs ``dtype`` with ``head_dim`` (q/k; ``v_head_dim`` for v, None: the
    same) on ``device_type``, with a sliding window when ``window``; else why not.

    Pure (looks at nothing installed): the reason names the kernel's limit. ``head_dim`` None
    skips the head-dim rules; ``torch_version`` (default: the installed one) matters for cudnn.
    """
    if name not in KERNELS:
        return f"unknown attention kernel {name!r}; choose one of {sorted(KERNELS)}"
    lim = KERNELS[name].limits
    if lim.device is not None and device_type != lim.device:
        return f"the {name} kernel runs on {lim.device.upper()} tensors only, not {device_type}"
    if not dtype.is_floating_point or (lim.dtypes is not None and dtype not in lim.dtypes):
        kinds = "/".join(map(dtype_name, lim.dtypes)) if lim.dtypes else "floating-point"
        return f"the {name} kernel takes {kinds} only, not {dtype_name(dtype)}"
    torch_version = torch_version or torch.__version__
    if name == "cudnn" and _version(torch_version) < (2, 5):
        return f"the cudnn kernel needs torch >= 2.5 (the op signature cp_ext calls), not {torch_version}"
    if window and not lim.masks:
        masked = sorted(n for n, k in KERNELS.items() if k.limits.masks)
        return (f"the {name} kernel cannot apply a sliding window (--window-size); the kernels that can: "
                f"{', '.join(masked)} (--attention-backend auto picks one)")
    if head_dim is None:
        return None
    v_head_dim = v_head_dim or head_dim
    padded = not lim.distinct_v and v_head_dim != head_dim  # both run at the larger head dim
    dims = [max(head_dim, v_head_dim)] if padded else sorted({head_dim, v_head_dim})
    align, limit = lim.alignment(dtype), lim.max_head_dim
    for d in dims:
        if d < 1 or d % align or (limit and d > limit):
            rule = " and ".join(r for r in (f"a multiple of {align}" if align > 1 else "",
                                            f"at most {limit}" if limit else "") if r) or "at least 1"
            what = f"head dim (q/k {head_dim} and v {v_head_dim} run padded to {d})" if padded else "head dim"
            return f"the {name} kernel needs a {what} that is {rule} for {dtype_name(dtype)}, not {d}"
    return None


def kernel_problem(name: str, dtype: torch.dtype, head_dim: Optional[int], device_type: str, *,
                   v_head_dim: Optional[int] = None, window: bool = False) -> Optional[str]:
    """`supported`, plus whether an optional package the kernel needs is installed (not imported)."""
    reason = supported(name, dtype, head_dim, device_type, v_head_dim=v_head_dim, window=window)
    package = KERNELS[name].limits.package if name in KERNELS else None
    if reason is None and package and importlib.util.find_spec(package[0]) is None:
        reason = f"the {name} kernel needs the {package[1]} package, which is not installed"
    return reason


def choose_kernel(device_type: str, dtype: torch.dtype, head_dim: Optional[int] = None, torch_version=None, *,
                  v_head_dim: Optional[int] = None, window: bool = False) -> str:
    """auto's pick: the first kernel of ``PREFERENCE[device_type]`` that `supported` accepts."""
    for name in PREFERENCE.get(device_type, ("unfused",)):
        if supported(name, dtype, head_dim, device_type, torch_version, v_head_dim=v_head_dim, window=window) is None:
            return name
    raise ValueError(f"no attention kernel runs {dtype_name(dtype)} with head dim {head_dim} on {device_type}")


def get_kernel(device: torch.device, dtype: torch.dtype, name: Optional[str] = None,
               head_dim: Optional[int] = None, *, v_head_dim: Optional[int] = None, window: bool = False) -> AttnKernel:
    """The local kernel for tensors on ``device`` of ``dtype`` and head dims, with a window or not.

    ``name`` None or ``"auto"`` picks with `choose_kernel`; a named kernel that cannot run
    the call raises ValueError with its limit. An optional backend that is not installed
    raises ImportError.
    """
    device = torch.device(device)
    if name in (None, "auto"):
        name = choose_kernel(device.type, dtype, head_dim, v_head_dim=v_head_dim, window=window)
    elif name not in KERNELS:
        raise ValueError(f"unknown attention kernel {name!r}; choose one of {sorted(KERNELS)}")
    else:
        reason = supported(name, dtype, head_dim, device.type, v_head_dim=v_head_dim, window=window)
        if reason is not None:
            raise ValueError(f"attention kernel {name!r} cannot run this call: {reason}; "
                             f"use --attention-backend auto, which picks a kernel that fits")
    if name not in _CACHE:
        _CACHE[name] = KERNELS[name]()
    return _CACHE[name]
