"""The GPU check on two or more GPUs (torchrun, NCCL, one rank per GPU), and the rows read from each run.

* NCCL attention (`nccl_attention_rows`; this file is the torchrun worker): ring (C = all GPUs),
  Ulysses (U = all, when the 8 heads split) and the hybrid (U2 x R(n/2), n >= 4 even) on ~4096
  tokens, bf16 and fp32, against float64 truth (`tests.attention.reference.measure` on the GPU),
  judged by `tests.gpu.rows.judge` on the worst rank;
* a 30-iteration ``--bf16`` demo run whose loss must fall (`demo_row`);
* tools/bench_attention.py, whose counted bytes must equal `cp_ext.perf.comm`'s formula (`bench_row`);
* the model grid-equivalence test's CP2 ring and Ulysses cases (fp32, losses and every gradient
  within 1e-5 of one GPU; `grid_row`).
"""

import argparse
import json
import math
import os
import sys
from pathlib import Path

from tests.gpu import runs
from tests.gpu.rows import FAIL, MULTI_GPU, NOT_COVERED, PASS, judge, row

NCCL = dict(h=8, hk=2, d=64, tokens=4096)


def nccl_cases(n):
    """The ring, Ulysses and hybrid cases for ``n`` GPUs; and the variants that cannot run on n."""
    s = 2 * n * (NCCL["tokens"] // (2 * n))  # ~4096 tokens in 2n equal zigzag chunks
    cases, missing = [], []
    for dtype in ("bf16", "fp32"):
        variants = [("ring", 1, n, True), ("ring", 1, n, False)]
        if NCCL["h"] % n == 0:
            variants.append(("ulysses", n, 1, True))
        else:
            missing.append(f"Ulysses U{n}: {NCCL['h']} heads do not split over {n} GPUs")
        if n >= 4 and n % 2 == 0:
            variants.append(("hybrid", 2, n // 2, True))
        else:
            missing.append(f"hybrid U2 x R{n // 2}: needs an even number >= 4 of GPUs, not {n}")
        for via, u, r, causal in variants:
            name = (f"nccl {via} U{u}xR{r} {'causal' if causal else 'full'} {dtype} s{s} "
                    f"h{NCCL['h']}/kv{NCCL['hk']}")
            cases.append(dict(name=name, via=via, U=u, R=r, causal=causal, dtype=dtype, s=s,
                              h=NCCL["h"], hk=NCCL["hk"], d=NCCL["d"]))
    return cases, sorted(set(missing))


def nccl_attention_rows(out, n, timeout):
    cases, missing = nccl_cases(n)
    log, path = out / "attention.log", out / "attention.json"
    path.unlink(missing_ok=True)  # a stale result must not pass for this run's
    rc = runs.run_logged(runs.torchrun(n) + [Path(__file__), "--out", out], log, timeout)
    if rc != 0 or not path.exists():
        return [runs.failed_run("multi", MULTI_GPU[0], rc, log)]
    ranks = json.loads(path.read_text())
    rows = [row("multi", f"NCCL {m}", NOT_COVERED, "cannot run on this GPU count") for m in missing]
    for case in cases:
        got = [r.get(case["name"]) for r in ranks]
        if len(got) != n or None in got:
            rows.append(row("multi", case["name"], FAIL, f"results from {len(got) - got.count(None)} of {n} ranks"))
            continue
        mx = lambda key: {t: max(g[key][t] for g in got) for t in got[0][key]}  # noqa: E731  worst rank
        rows.append(judge("multi", case["name"], case["dtype"], mx("err"), mx("ref_err"), mx("max_truth"),
                          all(g["dtypes_ok"] for g in got)))
    return rows


def demo_flags(n):
    """Grid flags that make configs/cpu_demo.yaml (CP2 x DP2, EP2 on 4 ranks) valid on ``n`` GPUs."""
    cp = 2 if n % 2 == 0 else 1
    dp = n // cp
    ep = 2 if n >= 4 and n % 2 == 0 else 1  # experts fold into DP x CP; 2 ranks keep them whole
    return ["--context-parallel-size", cp, "--expert-model-parallel-size", ep,
            "--micro-batch-size", 4, "--global-batch-size", 4 * dp * max(1, 4 // dp)]


def demo_row(out, n, timeout, iters=30):
    check = MULTI_GPU[1]
    log, run_dir = out / "demo.log", out / "demo"
    metrics = run_dir / "metrics.jsonl"
    metrics.unlink(missing_ok=True)
    rc = runs.run_logged(runs.torchrun(n) + ["pretrain_moe.py", "--config", "configs/cpu_demo.yaml", "--device", "cuda",
                                             "--bf16", "--train-iters", iters, "--log-interval", 5, "--log-dir", run_dir]
                         + demo_flags(n), log, timeout)
    if rc != 0 or not metrics.exists():
        return runs.failed_run("multi", check, rc, log)
    lines = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    loss = [r.get("train/lm_loss", math.nan) for r in lines]
    ok = len(loss) == iters and all(map(math.isfinite, loss)) and loss[-1] < loss[0]
    return row("multi", check, PASS if ok else FAIL, f"lm loss {loss[0]:.3f} -> {loss[-1]:.3f} ({len(loss)} it)"
               if loss else "no loss logged", f"finite, {iters} it, last < first", loss=loss, flags=demo_flags(n))


def bench_row(out, n, timeout):
    """tools/bench_attention.py on every GPU: each collective's counted bytes == cp_ext.perf.comm's formula."""
    from cp_ext.perf import comm as comm_formula

    check = MULTI_GPU[2]
    s, h, hk, d = 2 * n * (4096 // n), 8, 2, 64
    log, path = out / "bench.log", out / "bench.json"
    path.unlink(missing_ok=True)
    rc = runs.run_logged(runs.torchrun(n) + ["tools/bench_attention.py", "--device", "cuda", "--seq-length", s,
                                             "--heads", h, "--kv-heads", hk, "--head-dim", d, "--dtype", "bf16",
                                             "--reps", 3, "--warmup", 1, "--json", path], log, timeout)
    if rc != 0 or not path.exists():
        return runs.failed_run("multi", check, rc, log)
    res = json.loads(path.read_text())
    u_of = {"ring": 1, "ulysses": n, "hybrid": 2}
    bad, total = [], 0
    for variant, colls in res.get("bytes", {}).items():  # and the formula recomputed here, not only the bench's copy
        formula = comm_formula.cp_attention_bytes(b=1, h=h, hk=hk, s=s, d=d, cp=n, ulysses=u_of[variant], dtype="bf16")
        for coll, c in colls.items():
            total += 1
            want = (formula[coll]["fwd"], formula[coll]["bwd"])
            if not (c["fwd"] > 0 and (c["fwd"], c["bwd"]) == (c["formula_fwd"], c["formula_bwd"]) == want):
                bad.append(f"{variant}/{coll}")
    ok = total > 0 and "ring" in res.get("bytes", {}) and not bad and res.get("bytes_match") is True
    ratios = {k: v["ratio_to_ideal"] for k, v in res.get("variants", {}).items()}
    return row("multi", check, PASS if ok else FAIL, f"{total - len(bad)}/{total} collectives match",
               "counted == formula, ranks agree", mismatched=bad, ratio_to_ideal=ratios, overlap=res.get("overlap"))


def grid_row(out, timeout):
    """The whole model at CP2 (ring, Ulysses) over NCCL against one GPU: losses, grad norms and
    every parameter gradient within 1e-5 (tests/training/test_grid_equivalence.py, fp32)."""
    return runs.pytest_row("multi", MULTI_GPU[3], out, "grid_equivalence",
                           ["tests/training/test_grid_equivalence.py", "-k", "cp2_ring or cp2_ulysses"], timeout)


def main():
    """One rank of the NCCL attention check (under torchrun); rank 0 writes every rank's errors."""
    import torch
    import torch.distributed as dist

    from cp_ext.attention import hybrid_attention, ring_attention, ulysses_attention
    from cp_ext.token_partition import context_parallel_positions
    from tests.attention.reference import measure

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    out = parser.parse_args().out
    torch.set_float32_matmul_precision("highest")
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    n, rank, world = dist.get_world_size(), dist.get_rank(), dist.group.WORLD
    ulysses_group = ring_group = None
    if n >= 4 and n % 2 == 0:  # hybrid groups as in test_hybrid: Ulysses rank = rank % 2, ring rank = rank // 2
        for i in range(0, n, 2):  # Ulysses pairs [i, i+1]; every rank creates every group, in order
            g = dist.new_group([i, i + 1])
            ulysses_group = g if rank // 2 == i // 2 else ulysses_group
        for j in range(2):  # rings [j, j+2, ...]
            g = dist.new_group(list(range(j, n, 2)))
            ring_group = g if rank % 2 == j else ring_group
    results = {}
    for case in nccl_cases(n)[0]:
        kw = dict(causal=case["causal"])
        if case["via"] == "ring":
            pos = context_parallel_positions(case["s"], ring_rank=rank, ring_size=n)
            attn = lambda q, k, v: ring_attention(q, k, v, group=world, **kw)  # noqa: E731
        elif case["via"] == "ulysses":
            pos = context_parallel_positions(case["s"], ring_rank=0, ring_size=1, ulysses_rank=rank, ulysses_size=n)
            attn = lambda q, k, v: ulysses_attention(q, k, v, group=world, **kw)  # noqa: E731
        else:
            pos = context_parallel_positions(case["s"], ring_rank=dist.get_rank(ring_group), ring_size=case["R"],
                                             ulysses_rank=dist.get_rank(ulysses_group), ulysses_size=case["U"])
            attn = lambda q, k, v: hybrid_attention(q, k, v, ulysses_group=ulysses_group,  # noqa: E731
                                                    ring_group=ring_group, **kw)
        results[case["name"]] = measure(case, attn, pos, device=device)
    gathered = [None] * n
    dist.all_gather_object(gathered, results)
    if rank == 0:
        (out / "attention.json").write_text(json.dumps(gathered, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
