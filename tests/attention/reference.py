"""The single-process reference every context-parallel attention test measures against.

`measure` draws seeded full-sequence q, k, v, dout (float64), runs float64 and in-dtype
`F.scaled_dot_product_attention` on the whole sequence, runs the variant under test on this
rank's tokens, and returns max abs errors per tensor. Used by test_ring, test_ulysses and
test_hybrid (on CPU), and by tools/gpu_check.py's NCCL worker (``device="cuda:<local rank>"``).
"""

import zlib

TENSORS = ("out", "dq", "dk", "dv")


def measure(case, attn, positions, on_forward=None, device="cpu"):
    """Run ``attn(q, k, v)`` on this rank's shard (tokens ``positions``) of seeded full tensors.

    Returns the max abs errors of (out, dq, dk, dv) against float64 full-sequence SDPA
    (``err``), the single-device error in the case's dtype (``ref_err``) and max|truth|.
    ``on_forward()`` is called between the forward and the backward. Everything (the float64
    truth, the in-dtype reference and the shards ``attn`` gets) lives on ``device``; the seeded
    draw is on the CPU, so every rank and device sees the same numbers.
    """
    import torch
    import torch.nn.functional as F

    dtype = {"fp64": torch.float64, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[case["dtype"]]
    b, h, hk, s, d = 2, case["h"], case["hk"], case["s"], case["d"]
    gen = torch.Generator().manual_seed(zlib.crc32(case["name"].encode()))
    q, dout = (torch.randn(s, b, h, d, generator=gen, dtype=torch.float64).to(device) for _ in range(2))
    k, v = (torch.randn(s, b, hk, d, generator=gen, dtype=torch.float64).to(device) for _ in range(2))
    positions = positions.to(device)

    def full_sdpa(dt):  # single-process SDPA on the whole sequence, in dtype dt
        xs = [x.to(dt).permute(1, 2, 0, 3).detach().requires_grad_() for x in (q, k, v)]
        o = F.scaled_dot_product_attention(*xs, is_causal=case["causal"], enable_gqa=True)
        o.backward(dout.to(dt).permute(1, 2, 0, 3))
        return [t.permute(2, 0, 1, 3).double() for t in (o.detach(), xs[0].grad, xs[1].grad, xs[2].grad)]

    truth, ref = full_sdpa(torch.float64), full_sdpa(dtype)
    sh = lambda x: x.index_select(0, positions)  # a new tensor: this rank's tokens, in local order
    ql, kl, vl = (sh(x).to(dtype).detach().requires_grad_() for x in (q, k, v))
    out = attn(ql, kl, vl)
    if on_forward is not None:
        on_forward()
    out.backward(sh(dout).to(dtype))
    got = [out.detach(), ql.grad, kl.grad, vl.grad]
    return {
        "max_truth": {n: t.abs().max().item() for n, t in zip(TENSORS, truth)},
        "ref_err": {n: (a - t).abs().max().item() for n, a, t in zip(TENSORS, ref, truth)},
        "err": {n: (g.double() - sh(t)).abs().max().item() for n, g, t in zip(TENSORS, got, truth)},
        "dtypes_ok": all(g.dtype == dtype and g.shape == x.shape for g, x in zip(got, (ql, ql, kl, vl))),
    }


def init_four_ranks():
    """Worker setup shared by the 4-rank attention tests: gloo, one thread per rank, and
    the groups {2: this rank's pair ([0, 1] or [2, 3]), 4: the world}. Returns (rank, groups)."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates both, in order
    return rank, {2: pairs[rank // 2], 4: dist.group.WORLD}
