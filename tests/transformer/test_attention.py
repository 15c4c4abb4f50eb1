"""cp_ext.transformer.attention: the configured kernel reaches the attention (single process, CP = 1).

At CP = 1, ``auto`` and ``unfused`` run torch's ``F.scaled_dot_product_attention`` and a named
kernel runs through `cp_ext.attention.kernels`; all give the same output and gradients. A named
kernel that cannot run the call fails with its limit, not inside the op. (CP > 1 passes the same
``kernel=`` down the ring / Ulysses paths: tests/attention/.) Runs in a process of its own (`run_code`) so the CPU
platform mode and the process group never leak into other tests.
"""

import textwrap
from types import SimpleNamespace

import pytest
import torch

from tests.launch import one_rank_megatron, run_code


def test_configured_kernel_runs_at_cp1(tmp_path):
    code = one_rank_megatron(tmp_path) + textwrap.dedent("""
        from megatron.core.transformer.enums import AttnMaskType
        import cp_ext.attention.cp.context_parallel as ulysses
        from cp_ext.config import ContextParallelTransformerConfig
        from cp_ext.transformer.attention import CoreAttention
        used = []
        real_get_kernel = ulysses.get_kernel
        ulysses.get_kernel = lambda *a, **k: used.append(a[2]) or real_get_kernel(*a, **k)
        g = torch.Generator().manual_seed(0)
        q = torch.randn(24, 2, 4, 8, generator=g, dtype=torch.float64)  # [s, b, h, d], GQA 4 -> 2
        k, v = (torch.randn(24, 2, 2, 8, generator=g, dtype=torch.float64) for _ in range(2))
        dout = torch.randn(24, 2, 32, generator=g, dtype=torch.float64)
        results = {}
        for kernel in ("auto", "unfused", "cpu"):
            config = ContextParallelTransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4,
                                                      num_query_groups=2, attention_kernel=kernel, attention_dropout=0.0)
            attn = CoreAttention(config, 1, AttnMaskType.causal, "self")
            xs = [t.clone().requires_grad_() for t in (q, k, v)]
            out = attn(*xs, attention_mask=None)
            out.backward(dout)
            results[kernel] = [out.detach()] + [x.grad for x in xs]
        assert used == ["cpu"], used  # only the named kernel goes through cp_ext's kernels
        for kernel in ("unfused", "cpu"):
            for a, b in zip(results[kernel], results["auto"]):
                assert a.shape == b.shape and (a - b).abs().max() < 1e-12, (kernel, (a - b).abs().max())
        config = ContextParallelTransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4,
                                                  num_query_groups=2, attention_kernel="flash", attention_dropout=0.0)
        try:
            CoreAttention(config, 1, AttnMaskType.causal, "self")(q, k, v, attention_mask=None)
        except ValueError as e:
            assert "CUDA tensors only" in str(e), e
        else:
            raise AssertionError("the flash kernel ran on CPU tensors")
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
        print("ok")
    """)
    proc = run_code(code, check=False)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-4000:]


@pytest.mark.quick
def test_startup_line_says_what_auto_picked():
    from cp_ext.training.report import attention_kernel_line

    def line(kernel, dtype, cp, device):
        config = SimpleNamespace(attention_kernel=kernel, kv_channels=128, params_dtype=dtype, context_parallel_size=cp)
        return attention_kernel_line(config, torch.device(device))

    expected = "attention: --attention-backend auto picks kernel flash (bf16, head dim 128, cuda)"
    assert line("auto", torch.bfloat16, 2, "cuda") == expected
    assert "picks kernel efficient (fp32" in line("auto", torch.float32, 4, "cuda")
    assert "picks kernel cpu" in line("auto", torch.float32, 1, "cpu") and "F.scaled_dot_product_attention" in line(
        "auto", torch.float32, 1, "cpu")
    assert line("cudnn", torch.bfloat16, 2, "cuda") == "attention: kernel cudnn (bf16, head dim 128, cuda)"
    # a window moves auto off flash (no masks) and names the windowed layers; a sink is named too
    config = SimpleNamespace(attention_kernel="auto", kv_channels=128, params_dtype=torch.bfloat16, context_parallel_size=2,
                             window_size=(128, 0), window_attn_skip_freq=2, num_layers=4, softmax_type="learnable")
    got = attention_kernel_line(config, torch.device("cuda"))
    assert "picks kernel efficient (bf16" in got and "window 128,0 on layers [1, 3]" in got, got
    assert "attention sink learnable" in got, got
    # MLA: its own head dims, and what CP exchanges per layer as the layers resolve --cp-mla-exchange
    mla = dict(attention_kernel="auto", kv_channels=32, params_dtype=torch.float32, multi_latent_attention=True,
               qk_head_dim=128, qk_pos_emb_head_dim=64, v_head_dim=128, kv_lora_rank=512, num_attention_heads=8,
               tensor_model_parallel_size=1, num_layers=2, cp_comm_types=None, cp_mla_exchange="auto")
    ring = attention_kernel_line(SimpleNamespace(**mla, context_parallel_size=2, ulysses_size=1), torch.device("cpu"))
    assert "q/k head dim 192, v 128" in ring and "exchanges the latent on every layer, 576 values" in ring, ring
    assert "instead of 2560" in ring, ring
    mixed = attention_kernel_line(SimpleNamespace(**dict(mla, cp_comm_types=["a2a", "all_gather"]), context_parallel_size=2,
                                                  ulysses_size=2), torch.device("cpu"))
    assert "the latent on layers [2]" in mixed, mixed
    kv = attention_kernel_line(SimpleNamespace(**dict(mla, cp_mla_exchange="kv"), context_parallel_size=2, ulysses_size=1),
                               torch.device("cpu"))
    assert "exchanges per-head K/V, 2560 values" in kv, kv
