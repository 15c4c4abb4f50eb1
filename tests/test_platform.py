"""cp_ext.platform: megatron-core's CUDA assumptions met on CPU, and undone cleanly.

Each test runs in a process of its own (`run_code`) so the process-wide mode never leaks into
other tests.
"""

import pytest

from tests.launch import run_code


def _run(code):
    return run_code(code).stdout


@pytest.mark.quick
def test_cuda_requests_land_on_cpu():
    out = _run("""
        import torch
        from cp_ext.platform import setup_platform, platform_is_cpu
        assert setup_platform("cpu") == torch.device("cpu") and platform_is_cpu()
        assert torch.zeros(2, device="cuda").device.type == "cpu"
        assert torch.tensor([1.0], device=torch.cuda.current_device()).device.type == "cpu"
        assert torch.ones(2, device=torch.device("cuda", 0)).device.type == "cpu"
        x = torch.ones(3)
        assert x.cuda() is x and x.to("cuda").device.type == "cpu"
        # megatron's dtype checks spell CUDA type names; conversions still work
        assert x.type() == "torch.cuda.FloatTensor" and x.bfloat16().type() == "torch.cuda.BFloat16Tensor"
        assert x.type(torch.float64).dtype == torch.float64
        torch.cuda.synchronize()
        print("ok")
    """)
    assert out.strip() == "ok"


def test_rng_tracker_forks_cpu_streams():
    out = _run("""
        import torch
        from cp_ext.platform import setup_platform
        setup_platform("cpu")
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
        tracker = get_cuda_rng_tracker()
        tracker.add("stream-a", 17)
        torch.manual_seed(0)
        before = torch.get_rng_state()
        with tracker.fork("stream-a"):
            a1 = torch.rand(4)
        assert torch.equal(torch.get_rng_state(), before), "fork must restore the default stream"
        with tracker.fork("stream-a"):
            a2 = torch.rand(4)
        torch.manual_seed(17); expect = torch.rand(8)
        assert torch.equal(torch.cat([a1, a2]), expect), "the named stream must continue where it stopped"
        print("ok")
    """)
    assert out.strip() == "ok"


def test_megatron_gaps_filled_and_teardown_restores():
    out = _run("""
        import torch
        original = torch.cuda.current_device
        from cp_ext.platform import setup_platform, teardown_platform, platform_is_cpu
        setup_platform("cpu")
        from megatron.core.transformer.moe import moe_utils
        assert moe_utils.te_general_gemm is None
        teardown_platform()
        assert not platform_is_cpu() and torch.cuda.current_device is original
        assert torch.ones(1).type() == "torch.FloatTensor"
        print("ok")
    """)
    assert out.strip() == "ok"


def test_megatrons_fusions_run_eagerly_on_cpu():
    """``@jit_fuser`` is torch.compile, bound at megatron's import: on CPU its functions run as plain torch (no
    frame reaches dynamo, the value is eager torch's), and teardown gives dynamo back."""
    out = _run("""
        import torch
        import torch._dynamo.utils as dynamo_utils
        from megatron.core.activations import quick_gelu  # GPT-OSS's, decorated before cp_ext runs
        from cp_ext.platform import setup_platform, teardown_platform
        setup_platform("cpu")
        x = torch.randn(64)
        assert torch.equal(quick_gelu(x), x * torch.sigmoid(1.702 * x))
        assert not dynamo_utils.counters["frames"], dict(dynamo_utils.counters["frames"])
        teardown_platform()
        assert torch._dynamo.config.disable is False
        print("ok")
    """)
    assert out.strip() == "ok"


def test_clip_grad_runs_on_cpu():
    # megatron's clip_grad_by_total_norm_fp32 asserts CUDA float grads
    out = _run("""
        import torch
        from cp_ext.platform import setup_platform
        setup_platform("cpu")
        from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32
        p = torch.nn.Parameter(torch.ones(4)); p.grad = torch.full((4,), 2.0)
        clip_grad_by_total_norm_fp32([p], max_norm=1.0, total_norm=4.0)
        assert torch.allclose(p.grad, torch.full((4,), 0.5), atol=1e-5), p.grad
        print("ok")
    """)
    assert out.strip() == "ok"


def test_cpu_uses_torch_optimizer_and_local_multi_tensor_even_with_te_or_apex():
    """On a GPU host with TE/apex, megatron binds FusedAdam and CUDA multi-tensor kernels at import;
    CPU setup rebinds them to its torch/local path, and teardown restores what it found."""
    out = _run("""
        import torch
        from megatron.core import optimizer as opt, utils
        from megatron.core.optimizer import clip_grads, distrib_optimizer, optimizer as opt_mod
        from megatron.core.transformer.moe import moe_utils
        te = object()  # stands in for what megatron bound when TE/apex imported
        found = [(opt, "Adam"), (opt, "SGD"), (opt_mod, "multi_tensor_applier"), (opt_mod, "multi_tensor_scale_impl"),
                 (clip_grads, "multi_tensor_applier"), (clip_grads, "l2_norm_impl"), (clip_grads, "multi_tensor_scale_impl"),
                 (distrib_optimizer, "Adam"), (moe_utils, "te_general_gemm")]
        for mod, name in found:
            setattr(mod, name, te)
        opt.USING_PYTORCH_OPTIMIZER = False
        distrib_optimizer.HAVE_APEX_OR_TE = distrib_optimizer.USING_TE_OPTIMIZER = True
        from cp_ext.platform import setup_platform, teardown_platform
        setup_platform("cpu")
        assert opt.Adam is torch.optim.AdamW and opt.SGD is torch.optim.SGD and opt.USING_PYTORCH_OPTIMIZER
        assert opt_mod.multi_tensor_applier is utils.local_multi_tensor_applier
        assert opt_mod.multi_tensor_scale_impl is utils.local_multi_tensor_scale
        assert clip_grads.multi_tensor_applier is utils.local_multi_tensor_applier
        assert clip_grads.l2_norm_impl is utils.local_multi_tensor_l2_norm
        assert clip_grads.multi_tensor_scale_impl is utils.local_multi_tensor_scale
        assert distrib_optimizer.Adam is torch.optim.Adam
        assert not (distrib_optimizer.HAVE_APEX_OR_TE or distrib_optimizer.USING_TE_OPTIMIZER
                    or distrib_optimizer.USING_APEX_OPTIMIZER)
        assert moe_utils.te_general_gemm is None
        teardown_platform()
        assert all(getattr(mod, name) is te for mod, name in found)
        assert distrib_optimizer.HAVE_APEX_OR_TE and not opt.USING_PYTORCH_OPTIMIZER
        print("ok")
    """)
    assert out.strip() == "ok"


def test_device_cuda_never_falls_back_to_cpu():
    out = _run("""
        import torch
        from cp_ext.platform import cuda_unusable_reason, setup_platform
        if torch.cuda.is_available():
            print("ok")
        else:
            reason = cuda_unusable_reason()
            assert reason, reason
            try:
                setup_platform("cuda")
            except RuntimeError as e:
                assert "--device cuda" in str(e) and reason in str(e), e
                print("ok")
    """)
    assert out.strip() == "ok"
