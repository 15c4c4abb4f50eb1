"""Checkpoint save and load: seconds and bytes per rank, with and without the distributed
optimizer, measured side by side in one run.

Launches the real Trainer under torchrun once (default: the demo model of configs/cpu_demo.yaml
at DP4, i.e. CP1, EP2). For each optimizer kind it trains one iteration (so Adam's state
exists), then saves and loads the checkpoint ``--repeats`` times, alternating the kinds, and
reports the median seconds and the bytes each rank wrote (its ``__<rank>_*.distcp`` files;
rank 0 also writes the small common.pt and metadata). The optimizer state's share: the
distributed optimizer holds 1/DP of Adam's state per rank; its checkpoint is written in
model space and the replicas' writes are spread over DP (fully parallel save), so each rank
writes about 1/DP of the whole checkpoint either way.

    python tools/bench_checkpoint.py --nproc 4 --repeats 3 -- --config configs/cpu_demo.yaml \\
        --context-parallel-size 1
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

KINDS = {"adam": [], "distributed-adam": ["--use-distributed-optimizer"]}


def _worker(argv):
    import shutil
    import time
    import warnings

    warnings.simplefilter("ignore")
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--repeats", type=int, required=True)
    known, flags = p.parse_known_args(argv)
    import torch
    import torch.distributed as dist

    from cp_ext.arguments import parse_args
    from cp_ext.training.trainer import Trainer

    torch.set_num_threads(1)
    flags = [f for f in flags if f != "--"]
    root = [tempfile.mkdtemp(prefix="cp_ext_bench_ckpt_") if int(os.environ["RANK"]) == 0 else None]

    def build(kind, *extra):
        return Trainer(parse_args(flags + KINDS[kind] + list(extra)))

    results = {kind: {"save_s": [], "load_s": []} for kind in KINDS}
    for repeat in range(known.repeats):
        for kind in (KINDS if repeat % 2 == 0 else reversed(list(KINDS))):
            trainer = build(kind)
            if repeat == 0 and kind == "adam":
                dist.broadcast_object_list(root, src=0)
            trainer.train_step()
            directory = Path(root[0]) / f"{kind}-{repeat}"
            dist.barrier()
            start = time.perf_counter()
            trainer.checkpointer.save(directory)
            results[kind]["save_s"].append(time.perf_counter() - start)
            dist.barrier()
            start = time.perf_counter()
            trainer = build(kind, "--load", str(directory))
            built_and_loaded = time.perf_counter() - start
            dist.barrier()
            start = time.perf_counter()
            build(kind)  # the same build without loading: subtracted, leaving the load itself
            results[kind]["load_s"].append(built_and_loaded - (time.perf_counter() - start))
            iteration = next(directory.glob("iter_*"))
            rank = int(os.environ["RANK"])
            mine = sum(f.stat().st_size for f in iteration.glob(f"__{rank}_*.distcp"))
            results[kind]["rank_bytes"] = mine
            results[kind]["total_bytes"] = sum(f.stat().st_size for f in iteration.rglob("*") if f.is_file())
            dist.barrier()
            if rank == 0 and repeat + 1 < known.repeats:
                shutil.rmtree(directory, ignore_errors=True)
    Path(known.out, f"rank{os.environ['RANK']}.json").write_text(json.dumps(results))
    dist.barrier()
    if int(os.environ["RANK"]) == 0:
        shutil.rmtree(root[0], ignore_errors=True)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    known, flags = p.parse_known_args()
    if not flags:
        flags = ["--config", "configs/cpu_demo.yaml", "--context-parallel-size", "1"]
    from cp_ext.bench.workers import WorkerError, run_workers

    try:
        ranks = run_workers(__file__, known.nproc, ["--repeats", known.repeats, *flags], timeout=None)
    except WorkerError as e:
        sys.exit(f"bench_checkpoint: the run failed: {e}")
    print(f"checkpoint of {' '.join(flags)} on {known.nproc} ranks, median of {known.repeats}:")
    print(f"{'optimizer':<18}{'save s':>8}{'load s':>8}{'total MiB':>11}  bytes per rank (MiB; share of the total)")
    for kind in KINDS:
        save = statistics.median(max(r[kind]["save_s"][i] for r in ranks) for i in range(known.repeats))
        load = statistics.median(max(r[kind]["load_s"][i] for r in ranks) for i in range(known.repeats))
        total = ranks[0][kind]["total_bytes"]
        shares = " ".join(f"{r[kind]['rank_bytes'] / 2**20:.2f} ({r[kind]['rank_bytes'] / total:.2f})" for r in ranks)
        print(f"{kind:<18}{save:>8.2f}{load:>8.2f}{total / 2**20:>11.2f}  {shares}")
    print("adam writes the fp32 weights and Adam's two moments; distributed-adam also its fp32 main params "
          "(megatron's model-space format keeps them even when they equal the fp32 weights)")


if __name__ == "__main__":
    if "--worker" in sys.argv:
        sys.argv.remove("--worker")
        _worker(sys.argv[1:])
    else:
        main()
