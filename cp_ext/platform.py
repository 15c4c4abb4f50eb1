"""Run megatron-core's CUDA-only code paths on a CPU host, unchanged.

This module owns every CPU accommodation cp_ext makes, and nothing else may branch
on the device. `setup_platform()` is a no-op when CUDA is present: GPU runs execute
megatron-core exactly as shipped. Without CUDA (or with `--device cpu`) it meets
the few CUDA assumptions megatron-core makes on the paths cp_ext uses, the same on every supported
release, 0.16.1 through 0.19.x (each found by running those paths on CPU; tests/test_platform.py
covers them; what else differs between the releases is `cp_ext.megatron_compat`'s):

=========================================  ====================================================
megatron-core assumes                      on CPU we provide
=========================================  ====================================================
``torch.cuda.current_device()``            the CPU device (layers, mappings, p2p, DDP buffers)
``device="cuda"`` in factories             a TorchFunctionMode that maps cuda -> cpu
(optimizer scalars, schedules' counters)
``tensor.cuda()``                          identity
``param.type() == 'torch.cuda.*Tensor'``   CPU tensors report their CUDA type name (clip_grads,
(clip_grads, (distrib/fp16) optimizer)      the fp16/bf16 and distributed optimizers)
CUDA RNG tracker (`fork`/`add`)            a tracker that saves/restores the CPU generator
CUDA RNG get/set around recompute          the CPU generator's state
(``tensor_parallel.checkpoint``)
``moe_utils.te_general_gemm`` (NameError   defined as ``None`` (megatron 0.16 bug: unguarded name;
without TE)                                 fixed on GPU without TE too; 0.17+ define it)
``CheckpointWithoutOutput`` FP8 flag        forced off without TE (megatron bug; GPU too)
distributed optimizer loading a model-     states the checkpoint lacks (torch Adam's step;
space checkpoint needs every state          fp32 main params) keep their values (any device)
``@jit_fuser`` (torch.compile) fusions     run as plain torch (`_fusions_run_eagerly`)
``torch.cuda.synchronize()``/streams       no-ops / the current (only) stream, always complete
/events (alltoall dispatcher)               events (`cp_ext.platform_alltoall`)
alltoall dispatcher's host split sizes,    host arrays as on GPU; padded equal-size gloo
uneven expert-TP gather/scatter             collectives (`cp_ext.platform_alltoall`)
TE/apex FusedAdam and multi-tensor         torch's Adam/AdamW/SGD and megatron's local
kernels when TE or apex is importable      multi-tensor functions; the router GEMM in torch
(``--device cpu`` on a GPU host)           (`_cpu_optimizer_and_router`)
=========================================  ====================================================

``--device cuda`` never falls back to CPU: `cuda_unusable_reason` says why CUDA cannot be
used (the argument parser reports it at parse time; `setup_platform` raises).

Everything here is idempotent and process-wide: call `setup_platform()` once, before
building models. `teardown_platform()` exists for tests.
"""

import contextlib
import os

import torch
from torch.overrides import TorchFunctionMode

_ACTIVE_MODE = None
_SAVED = {}

# Tensor.type() names that megatron-core compares against, keyed by dtype.
_CUDA_TYPE_NAMES = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
    torch.float64: "torch.cuda.DoubleTensor",
    torch.int64: "torch.cuda.LongTensor",
    torch.int32: "torch.cuda.IntTensor",
    torch.uint8: "torch.cuda.ByteTensor",
    torch.bool: "torch.cuda.BoolTensor",
}


def _is_cuda_device(device):
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return False


class _CudaToCpuMode(TorchFunctionMode):
    """Maps CUDA device requests to CPU inside any torch call.

    Only four things are rewritten: a ``device=`` keyword naming cuda, ``Tensor.cuda()``
    and ``Tensor.to("cuda")``, the no-argument ``Tensor.type()`` (which megatron uses
    as a dtype check spelled with CUDA type names), and ``pin_memory=True``, which needs an
    accelerator and only speeds up host-to-device copies (megatron's RoPE CP slicing,
    ``get_pos_emb_on_this_cp_rank``, pins its two chunk indices).
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            tensor = args[0]
            if tensor.device.type == "cpu" and tensor.dtype in _CUDA_TYPE_NAMES:
                return _CUDA_TYPE_NAMES[tensor.dtype]
        elif func is torch.Tensor.cuda:
            return args[0]
        elif func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], torch.device("cpu"), *args[2:])
        if _is_cuda_device(kwargs.get("device")):
            kwargs = dict(kwargs, device=torch.device("cpu"))
        if kwargs.get("pin_memory"):
            kwargs = dict(kwargs, pin_memory=False)
        return func(*args, **kwargs)


def _make_cpu_rng_tracker_class():
    from megatron.core.tensor_parallel import random as mcore_random

    class CpuRNGStatesTracker(mcore_random.CudaRNGStatesTracker):
        """Megatron's named RNG streams, kept as CPU generator states.

        Same contract as `CudaRNGStatesTracker`: `add(name, seed)` registers a stream and
        `fork(name)` runs a block with that stream, restoring the default one after.
        """

        def add(self, name, seed):
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            self.seeds_.add(seed)
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            saved = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(saved)

        @contextlib.contextmanager
        def fork(self, name=mcore_random._MODEL_PARALLEL_RNG_TRACKER_NAME):
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            saved = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(saved)

    return CpuRNGStatesTracker


def _patch(obj, name, value):
    _SAVED.setdefault((obj, name), getattr(obj, name, None))
    setattr(obj, name, value)


def cuda_is_usable(device=None):
    """True when this process should run on CUDA: `device` ('cuda'/'cpu'/None=auto)."""
    if device == "cpu":
        return False
    return torch.cuda.is_available()


def cuda_unusable_reason():
    """None when this process can run on CUDA, else why not (a CPU build of torch, no GPU visible,
    or fewer GPUs than ``LOCAL_RANK`` needs)."""
    if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
        return f"torch {torch.__version__} is built without CUDA (a CPU wheel: install torch's CUDA build)"
    if not torch.cuda.is_available():
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        where = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
        return f"torch.cuda.is_available() is False: no usable GPU or driver{where}"
    local_rank, count = int(os.environ.get("LOCAL_RANK", "0")), torch.cuda.device_count()
    if local_rank >= count:
        return f"LOCAL_RANK {local_rank} needs GPU {local_rank}, but only {count} GPU(s) are visible"
    return None


def _without_transformer_engine():
    """Three megatron-core bugs met on any device when TransformerEngine is not installed.

    * 0.16 only: ``moe_utils.te_general_gemm`` is imported only with TE but read unguarded by the
      router's GEMM (NameError at the first MoE forward); ``None`` selects its torch.mm path.
      0.17 and later define it as None themselves, and nothing is patched there.
    * every release (0.19.2 too): ``CheckpointWithoutOutput(fp8=False)`` sets ``self.fp8 = fp8 is not
      None``, i.e. True, and then calls TE's FP8GlobalStateManager: ``--recompute-modules layernorm``
      fails with a NameError. Without TE there is no FP8, so the flag is forced off.
    * 0.16 only: ``multi_latent_attention`` sets ``HAVE_TE = True`` with MagicMock stand-ins when TE's
      import fails, then ``isinstance(self.linear_proj, TELinear)`` raises TypeError: MLA cannot be
      built. Without TE, ``HAVE_TE`` is False there, as the module's other checks expect. 0.17 and
      later import TE's own ``HAVE_TE`` (False without TE), and nothing is patched there.
    """
    try:
        import transformer_engine  # noqa: F401

        return
    except ImportError:
        pass
    from megatron.core.tensor_parallel import random as mcore_random
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        _patch(moe_utils, "te_general_gemm", None)
    from megatron.core.transformer import multi_latent_attention

    if multi_latent_attention.HAVE_TE:
        _patch(multi_latent_attention, "HAVE_TE", False)
    cls = mcore_random.CheckpointWithoutOutput
    if not getattr(cls.__init__, "_cp_ext_no_te", False):
        original_init = cls.__init__

        def __init__(self, fp8=False):
            original_init(self, fp8)
            self.fp8 = False

        __init__._cp_ext_no_te = True
        _patch(cls, "__init__", __init__)


def _distributed_optimizer_loads_partial_state():
    """megatron-core 0.16.1's distributed optimizer, loading a model-space (``fully_reshardable``)
    checkpoint, copies *every* per-parameter state of the inner optimizer from what it read
    (`_set_main_param_and_optimizer_states`). torch's Adam (no apex/TE, so CPU always) keeps a
    per-parameter ``step``, which megatron saves in the param groups instead: KeyError 'step'
    on every load. And a checkpoint of megatron's fp32 optimizer holds no main parameters (the
    fp32 weights are their own). States the checkpoint does not hold keep their current values:
    the step megatron's `load_state_dict` just set from the param groups, and main parameters
    that are views of the weights just loaded. (megatron's `load_state_dict` also hands one step
    tensor to every parameter, which torch's Adam then increments once per parameter per step:
    each parameter gets its own copy.)
    """
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = DistributedOptimizer._set_main_param_and_optimizer_states
    if getattr(original, "_cp_ext_partial", False):
        return

    def _set_main_param_and_optimizer_states(self, model_param, tensors):
        if not self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            group_index, group_order = self.model_param_group_index_map[model_param]
            main = self.optimizer.param_groups[group_index]["params"][group_order]
            state = self.optimizer.state[main]
            if "step" in state:  # `load_state_dict` gave every parameter the *same* step tensor, which
                state["step"] = state["step"].clone()  # torch's Adam increments in place, once per parameter
            tensors = {"param": main, **state, **tensors}
        return original(self, model_param, tensors)

    _set_main_param_and_optimizer_states._cp_ext_partial = True
    _patch(DistributedOptimizer, "_set_main_param_and_optimizer_states", _set_main_param_and_optimizer_states)


def _cpu_optimizer_and_router():
    """On CPU, megatron's torch optimizer and local multi-tensor path, even when TE or apex imports.

    megatron-core 0.16.1 chooses at import time: ``optimizer/__init__.py`` takes TE's (else
    apex's) ``FusedAdam``/``FusedSGD`` as ``Adam``/``SGD`` and sets ``USING_PYTORCH_OPTIMIZER``;
    ``optimizer/optimizer.py`` and ``optimizer/clip_grads.py`` take TE's (else apex's)
    ``multi_tensor_applier`` / ``multi_tensor_scale`` / ``multi_tensor_l2norm`` (CUDA kernels);
    ``optimizer/distrib_optimizer.py`` takes ``FusedAdam`` and sets ``HAVE_APEX_OR_TE`` /
    ``USING_TE_OPTIMIZER`` / ``USING_APEX_OPTIMIZER``; ``moe_utils.te_general_gemm`` runs the
    router GEMM through TE. Those module attributes are read at call time, so rebinding them
    to the values megatron picks when neither package is installed gives its CPU-capable path.
    """
    import torch.optim
    from megatron.core import optimizer as mcore_optimizer
    from megatron.core import utils as mcore_utils
    from megatron.core.optimizer import clip_grads, distrib_optimizer
    from megatron.core.optimizer import optimizer as mcore_optimizer_module
    from megatron.core.transformer.moe import moe_utils

    _patch(mcore_optimizer, "Adam", torch.optim.AdamW)
    _patch(mcore_optimizer, "SGD", torch.optim.SGD)
    _patch(mcore_optimizer, "USING_PYTORCH_OPTIMIZER", True)
    _patch(mcore_optimizer_module, "multi_tensor_applier", mcore_utils.local_multi_tensor_applier)
    _patch(mcore_optimizer_module, "multi_tensor_scale_impl", mcore_utils.local_multi_tensor_scale)
    _patch(clip_grads, "multi_tensor_applier", mcore_utils.local_multi_tensor_applier)
    _patch(clip_grads, "l2_norm_impl", mcore_utils.local_multi_tensor_l2_norm)
    _patch(clip_grads, "multi_tensor_scale_impl", mcore_utils.local_multi_tensor_scale)
    _patch(distrib_optimizer, "Adam", torch.optim.Adam)
    _patch(distrib_optimizer, "HAVE_APEX_OR_TE", False)
    _patch(distrib_optimizer, "USING_TE_OPTIMIZER", False)
    _patch(distrib_optimizer, "USING_APEX_OPTIMIZER", False)
    _patch(moe_utils, "te_general_gemm", None)  # None selects torch.mm / addmm


def setup_platform(device=None):
    """Prepare megatron-core for this host. Returns the torch.device that models live on.

    With CUDA (and `device` not 'cpu') only `_without_transformer_engine`'s two fixes apply
    (when TE is absent), and `cuda:LOCAL_RANK` is returned. ``device="cuda"`` without a usable
    CUDA raises RuntimeError (never a silent CPU run).
    """
    global _ACTIVE_MODE
    if device == "cuda" and cuda_unusable_reason():
        raise RuntimeError(f"--device cuda: {cuda_unusable_reason()}")
    _without_transformer_engine()
    _distributed_optimizer_loads_partial_state()
    if cuda_is_usable(device):
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    if _ACTIVE_MODE is not None:
        return torch.device("cpu")

    cpu = torch.device("cpu")
    _patch(torch.cuda, "current_device", lambda: cpu)
    _patch(torch.cuda, "synchronize", lambda device=None: None)
    _patch(torch.cuda, "get_rng_state", lambda device="cuda": torch.get_rng_state())
    _patch(torch.cuda, "set_rng_state", lambda state, device="cuda": torch.set_rng_state(state))
    _patch(torch.cuda, "manual_seed", lambda seed: None)  # the CPU seed is set by the caller
    _patch(torch.cuda, "empty_cache", lambda: None)
    from cp_ext.platform_alltoall import install as install_alltoall_on_cpu

    install_alltoall_on_cpu(_patch)  # megatron's alltoall dispatcher: streams, host counts, uneven gathers

    from megatron.core.tensor_parallel import random as mcore_random

    # Activation recompute (tensor_parallel.checkpoint) saves and restores the "CUDA" generator
    # around the re-run forward: here that generator is the CPU one.
    _patch(mcore_random, "_get_cuda_rng_state", lambda device="cuda", clone=False, graph_safe=False: torch.get_rng_state())
    _patch(mcore_random, "_set_cuda_rng_state", lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(new_state))
    tracker_class = _make_cpu_rng_tracker_class()
    _patch(mcore_random, "CudaRNGStatesTracker", tracker_class)
    # Drop any tracker built before setup so the next getter builds a CPU one.
    mcore_random.initialize_rng_tracker(force_reset=True)

    _cpu_optimizer_and_router()
    _fusions_run_eagerly()

    _ACTIVE_MODE = _CudaToCpuMode()
    _ACTIVE_MODE.__enter__()
    return cpu


def _fusions_run_eagerly():
    """megatron's fused functions (``@jit_fuser``: torch.compile, e.g. GPT-OSS's quick_gelu, the bias/SwiGLU
    fusions) run as plain torch on CPU. Inductor's CPU code generation costs seconds per function in every
    process (GPT-OSS's clamped GLU: 18 s of a 27 s `tools/generate.py` run; 6 s a run with its cache warm) and
    needs a C++ toolchain, for kernels that exist to fuse GPU memory traffic. megatron's own off switch,
    ``disable_jit_fuser()``, comes too late: ``jit_fuser`` is bound when each module is imported, and
    ``import megatron.core`` imports some of them. Dynamo's switch reaches the functions already wrapped."""
    import torch._dynamo

    _patch(torch._dynamo.config, "disable", True)


def teardown_platform():
    """Undo `setup_platform` (tests only)."""
    global _ACTIVE_MODE
    if _ACTIVE_MODE is not None:
        _ACTIVE_MODE.__exit__(None, None, None)
        _ACTIVE_MODE = None
    for (obj, name), value in reversed(list(_SAVED.items())):
        if value is None:
            with contextlib.suppress(AttributeError):
                delattr(obj, name)
        else:
            setattr(obj, name, value)
    _SAVED.clear()


def platform_is_cpu():
    """True while the CPU accommodations are active."""
    return _ACTIVE_MODE is not None


def distributed_backend(device):
    """NCCL for CUDA devices, gloo for CPU."""
    return "nccl" if device.type == "cuda" else "gloo"


def memory_bytes():
    """Peak memory of this process: CUDA allocator peak on GPU, peak RSS on CPU."""
    if torch.cuda.is_available() and not platform_is_cpu():
        return int(torch.cuda.max_memory_allocated())
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB
