"""cp_ext's Ulysses against the two Ulysses designs people use, side by side in one run.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 tools/bench_ulysses_peers.py \
        --seq-length 4096 --heads 8 --head-dim 64 --reps 15

Every variant is forward + backward of causal attention over the sequence sharded across the C
ranks ([s/C, b, h, d] per rank in, the same out), with torch's own CPU/CUDA SDPA kernel inside:

* ``cp_ext``: `cp_ext.attention.ulysses_attention` (the dispatcher's a2a core, its own backward);
* ``deepspeed``: DeepSpeed-Ulysses' classic ``_SeqAllToAll`` (``tensor_split`` into per-rank
  chunks, list ``all_to_all``, ``cat``) around ``F.scaled_dot_product_attention`` with autograd;
* ``yunchang``: yunchang's ``all_to_all_4D`` layout (one reshape/transpose copy, one
  ``all_to_all_single``) on [b, s, h, d], around the same SDPA.

The peers are written here from their published algorithms (no dependency on either package).
Variants are interleaved per repetition after a barrier, a repetition's time is the slowest
rank's, and cp_ext's ratio to each peer is the median of the per-repetition ratios. All three
outputs are checked equal (1e-5) before timing.
"""

import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from cp_ext.attention import ulysses_attention


class _ListAllToAll(torch.autograd.Function):
    """DeepSpeed's classic exchange: split along scatter_dim, list all_to_all, cat along gather_dim."""

    @staticmethod
    def forward(ctx, x, scatter_dim, gather_dim):
        ctx.dims = (scatter_dim, gather_dim)
        size = dist.get_world_size()
        inputs = [t.contiguous() for t in torch.tensor_split(x, size, scatter_dim)]
        outputs = [torch.empty_like(inputs[0]) for _ in range(size)]
        dist.all_to_all(outputs, inputs)
        return torch.cat(outputs, dim=gather_dim).contiguous()

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim = ctx.dims
        return _ListAllToAll.apply(grad, gather_dim, scatter_dim), None, None


def deepspeed_ulysses(q, k, v):
    """[s/C, b, h, d] -> heads -> SDPA -> back (DeepSpeed's DistributedAttention, scatter 2, gather 0)."""
    qh, kh, vh = (_ListAllToAll.apply(x, 2, 0) for x in (q, k, v))  # [s, b, h/C, d]
    out = F.scaled_dot_product_attention(*(x.permute(1, 2, 0, 3) for x in (qh, kh, vh)), is_causal=True)
    return _ListAllToAll.apply(out.permute(2, 0, 1, 3), 0, 2)


class _AllToAll4D(torch.autograd.Function):
    """yunchang's all_to_all_4D on [b, s, h, d]: scatter heads/gather sequence (to_heads) or back."""

    @staticmethod
    def forward(ctx, x, to_heads):
        ctx.to_heads = to_heads
        return _a2a_4d(x, to_heads)

    @staticmethod
    def backward(ctx, grad):
        return _a2a_4d(grad, not ctx.to_heads), None


def _a2a_4d(x, to_heads):
    p = dist.get_world_size()
    b = x.shape[0]
    if to_heads:  # [b, s/P, h, d] -> [b, s, h/P, d]
        _, s_local, h, d = x.shape
        send = x.reshape(b, s_local, p, h // p, d).transpose(0, 2).contiguous()  # [P, s/P, b, h/P, d]
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send)
        return recv.reshape(s_local * p, b, h // p, d).transpose(0, 1).contiguous()
    _, s, h_local, d = x.shape  # [b, s, h/P, d] -> [b, s/P, h, d]
    send = x.reshape(b, p, s // p, h_local, d).transpose(0, 3).transpose(0, 1).contiguous()  # [P, h/P, s/P, b, d]
    send = send.reshape(p, h_local, s // p, b, d)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send)
    return recv.reshape(p * h_local, s // p, b, d).transpose(0, 2).contiguous()  # [b, s/P, h, d]


def yunchang_ulysses(q, k, v):
    """[s/C, b, h, d] -> yunchang's [b, s/P, h, d] layout -> heads -> SDPA -> back."""
    qh, kh, vh = (_AllToAll4D.apply(x.transpose(0, 1), True) for x in (q, k, v))  # [b, s, h/P, d]
    out = F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (qh, kh, vh)), is_causal=True)
    return _AllToAll4D.apply(out.transpose(1, 2), False).transpose(0, 1)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-length", type=int, default=4096)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--warmup", type=int, default=3)
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    C, me = dist.get_world_size(), dist.get_rank()
    s, b, h, d = args.seq_length, args.batch, args.heads, args.head_dim
    gen = torch.Generator().manual_seed(1 + me)
    q, k, v, dout = (torch.randn(s // C, b, h, d, generator=gen) for _ in range(4))
    variants = {"cp_ext": lambda q_, k_, v_: ulysses_attention(q_, k_, v_, causal=True, group=dist.group.WORLD),
                "deepspeed": deepspeed_ulysses, "yunchang": yunchang_ulysses}

    def run(fn):
        xs = [x.clone().requires_grad_() for x in (q, k, v)]
        out = fn(*xs)
        out.backward(dout)
        return out.detach()

    outs = {n: run(fn) for n, fn in variants.items()}
    for n in ("deepspeed", "yunchang"):
        diff = (outs[n] - outs["cp_ext"]).abs().max().item()
        if diff > 1e-5:
            raise SystemExit(f"{n}'s output differs from cp_ext's by {diff:.3g}: the comparison is void")
    times = {n: [] for n in variants}
    for rep in range(args.warmup + args.reps):
        for n, fn in variants.items():
            dist.barrier()
            t0 = time.perf_counter()
            run(fn)
            dt = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)  # the slowest rank's
            if rep >= args.warmup:
                times[n].append(dt.item())
    if me == 0:
        load = open("/proc/loadavg").read().split()[:3]
        print(f"bench_ulysses_peers: C={C} (gloo), b={b} s={s} h={h} d={d} fp32 causal fwd+bwd, {args.reps} "
              f"interleaved reps (+{args.warmup} warmup), slowest rank per rep; load avg {' '.join(load)}")
        for n, ts in times.items():
            print(f"  {n:10s} median {statistics.median(ts) * 1e3:8.1f} ms")
        for n in ("deepspeed", "yunchang"):
            ratios = [a / b_ for a, b_ in zip(times["cp_ext"], times[n])]
            print(f"  cp_ext / {n:9s} = {statistics.median(ratios):.3f} (median of {len(ratios)} paired reps; "
                  f"range {min(ratios):.3f}-{max(ratios):.3f})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
