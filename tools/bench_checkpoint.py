"""Checkpoint cost as training sees it, measured side by side in one run: how long a synchronous save, an
asynchronous one (--async-save) and a non-persistent local one hold training up; the bytes each rank
writes with fully parallel save and without it; and save and load seconds for the plain and the
distributed optimizer (`cp_ext.bench.checkpoint`).

Launches the real Trainer under torchrun once (default: the demo model of configs/cpu_demo.yaml at DP4,
i.e. CP1, EP2; give a larger model, e.g. --hidden-size 512 --num-layers 8, where a save should dominate
an iteration).

    python tools/bench_checkpoint.py --nproc 4 --repeats 3 -- --config configs/cpu_demo.yaml \\
        --context-parallel-size 1
"""

import argparse
import sys


def _worker(argv):
    import warnings

    warnings.simplefilter("ignore")
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--repeats", type=int, required=True)
    p.add_argument("--only", default="saves,optimizers")
    known, flags = p.parse_known_args(argv)
    from cp_ext.bench.checkpoint import worker

    worker([f for f in flags if f != "--"], known.repeats, known.out, known.only.split(","))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--only", choices=("saves", "optimizers"), default=None,
                   help="measure one of the two (default: both): the stall per kind of save, or the optimizer kinds")
    known, flags = p.parse_known_args()
    if not flags:
        flags = ["--config", "configs/cpu_demo.yaml", "--context-parallel-size", "1"]
    from cp_ext.bench.checkpoint import report
    from cp_ext.bench.workers import WorkerError, run_workers

    try:
        only = ["--only", known.only] if known.only else []
        ranks = run_workers(__file__, known.nproc, ["--repeats", known.repeats, *only, *flags], timeout=None)
    except WorkerError as e:
        sys.exit(f"bench_checkpoint: the run failed: {e}")
    print(f"checkpoint of {' '.join(flags)} on {known.nproc} ranks, median of {known.repeats} "
          f"(each figure the slowest rank's):")
    print(report(ranks, known.repeats))
    print("adam writes the fp32 weights and Adam's two moments; distributed-adam also its fp32 main params "
          "(megatron's model-space format keeps them even when they equal the fp32 weights)")


if __name__ == "__main__":
    if "--worker" in sys.argv:
        sys.argv.remove("--worker")
        _worker(sys.argv[1:])
    else:
        main()
