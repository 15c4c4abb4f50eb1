"""MLA under CP: the ring (and all-gather) carrying the latent vs per-head K/V, in one run.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 tools/bench_mla_exchange.py \
        --seq-length 8192 --heads 4 --reps 5

DeepSeek-V3's per-head dims by default (qk_head_dim 128 + qk_pos_emb_head_dim 64, v_head_dim 128,
kv_lora_rank 512), fewer heads. Both sides start from the same q, latent ``[c | k_pe]`` and
``linear_kv_up_proj`` weight and end with the same gradients of all three (fwd + bwd):

* ``kv``: megatron's path. Each rank up-projects its own tokens' latent to per-head K/V
  (autograd), then `ring_attention` / `all_gather_attention` moves those.
* ``latent``: ``--cp-mla-exchange latent``. The same call with ``up_weight``: the latent travels,
  every block is up-projected where it is used (`cp_ext.attention.cp.kv_message.LatentKV`).

The two run interleaved, after a barrier each, a repetition's time being the slowest rank's;
the ratio is the median of the per-repetition latent / kv ratios. Bytes are counted at the call
sites (`cp_ext.perf.counter`) and printed beside the formula (`cp_ext.perf.comm.mla_exchange_bytes`),
together with the per-token ratio at ``--report-heads`` (128: DeepSeek-V3), where the bytes
scale with the heads and the latent does not.
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from cp_ext.attention import all_gather_attention, ring_attention
from cp_ext.perf.comm import mla_exchange_bytes
from cp_ext.perf.counter import count_comm

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp64": torch.float64}


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq-length", type=int, default=8192)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--qk-head-dim", type=int, default=128)
    p.add_argument("--qk-pos-emb-head-dim", type=int, default=64)
    p.add_argument("--v-head-dim", type=int, default=128)
    p.add_argument("--kv-lora-rank", type=int, default=512)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--comm-type", choices=["p2p", "all_gather"], default="p2p")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--report-heads", type=int, default=128, help="heads for the per-token byte ratio printed")
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def main(argv=None):
    args = parse(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    C, me = dist.get_world_size(), dist.get_rank()
    b, h, dn, p, dv, r = (args.batch, args.heads, args.qk_head_dim, args.qk_pos_emb_head_dim, args.v_head_dim,
                          args.kv_lora_rank)
    s_local, dtype = args.seq_length // C, DTYPES[args.dtype]
    gen = torch.Generator().manual_seed(1 + me)
    q0 = torch.randn(s_local, b, h, dn + p, generator=gen, dtype=dtype)
    latent0 = torch.randn(s_local, b, r + p, generator=gen, dtype=dtype)
    dout = torch.randn(s_local, b, h, dv, generator=gen, dtype=dtype)
    weight0 = (torch.randn(h * (dn + dv), r, generator=torch.Generator().manual_seed(0)) / r ** 0.5).to(dtype)
    attention = ring_attention if args.comm_type == "p2p" else all_gather_attention

    def run(exchange):
        q, latent, weight = (x.detach().clone().requires_grad_() for x in (q0, latent0, weight0))
        if exchange == "kv":
            kv = (latent[..., :r] @ weight.t()).unflatten(-1, (h, dn + dv))
            k = torch.cat([kv[..., :dn], latent[..., None, r:].expand(-1, -1, h, -1)], -1)
            out = attention(q, k, kv[..., dn:], causal=True, group=dist.group.WORLD)
        else:
            out = attention(q, latent, None, up_weight=weight, causal=True, group=dist.group.WORLD)
        out.backward(dout)
        return q.grad, latent.grad, weight.grad

    def timed(exchange):
        dist.barrier()
        t0 = time.perf_counter()
        run(exchange)
        return time.perf_counter() - t0

    for _ in range(args.warmup):
        timed("kv"), timed("latent")
    times = {"kv": [], "latent": []}
    for _ in range(args.reps):
        for name in times:
            times[name].append(timed(name))
    gathered = [None] * C
    dist.all_gather_object(gathered, times)
    slowest = {n: [max(g[n][i] for g in gathered) for i in range(args.reps)] for n in times}
    # the same gradients on both sides: this rank's q and latent rows, and W_up's summed over the ranks
    # (each side's per-rank share differs: kv's is over this rank's tokens, latent's over its tiles)
    grads = {n: run(n) for n in times}
    for n in grads:
        dist.all_reduce(grads[n][2])
    agree = max((a - b_).abs().max().item() for a, b_ in zip(grads["kv"], grads["latent"]))
    counted = {}
    for name in times:
        with count_comm() as c:
            run(name)
        counted[name] = dict(c.bytes)
    formula = {n: mla_exchange_bytes(b=b, h=h, s_local=s_local, qk_head_dim=dn, qk_pos_emb_head_dim=p, v_head_dim=dv,
                                     kv_lora_rank=r, cp=C, dtype=args.dtype, exchange=n,
                                     comm_type="all_gather" if args.comm_type == "all_gather" else None)
               for n in times}
    if me == 0:
        ratios = [a / b_ for a, b_ in zip(slowest["latent"], slowest["kv"])]
        per_token = {n: r + p if n == "latent" else h * (dn + p + dv) for n in times}
        at_report = (r + p) / (args.report_heads * (dn + p + dv))
        print(f"MLA {args.comm_type}, C={C}, s={args.seq_length}, b={b}, {h} heads x (d_qk {dn}+{p}, d_v {dv}), "
              f"kv_lora_rank {r}, {args.dtype}; fwd + bwd, same gradients (max diff {agree:.2e})")
        for n in times:
            sent = sum(counted[n].values())
            want = sum(x["fwd"] + x["bwd"] for x in formula[n].values())
            print(f"  {n:7s} {statistics.median(slowest[n]) * 1e3:9.1f} ms   values/token/hop {per_token[n]:6d}   "
                  f"bytes/rank {sent} (formula {want})")
        print(f"  latent / kv: time {statistics.median(ratios):.3f} (median of {len(ratios)} paired reps: "
              f"{' '.join(f'{x:.3f}' for x in ratios)}), bytes {sum(counted['latent'].values()) / sum(counted['kv'].values()):.4f}"
              f"; at {args.report_heads} heads the bytes would be {at_report:.4f} = 1/{1 / at_report:.1f}")
        if args.json:
            Path(args.json).write_text(json.dumps({"times": slowest, "ratio": statistics.median(ratios),
                                                   "counted": counted, "formula": formula, "max_grad_diff": agree,
                                                   "bytes_ratio_at_report_heads": at_report}, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
