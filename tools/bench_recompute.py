"""Iteration time of each activation-recompute mode, measured side by side in one run.

Launches the real Trainer under torchrun once. Every round runs one training iteration per
mode, in a rotating order, on the same model and process groups, so the machine's noise
falls on every mode alike; the first round is warm-up and not counted. Modes:

    none           no recompute (every activation kept)
    full           Megatron's full recompute (--no-cp-aware-recompute): each layer's forward,
                   ring included, runs again in backward
    full-cp-aware  cp_ext's default full recompute: the recompute reuses the kept attention
                   output and LSE, so the ring and the attention kernel run once

The mode is switched between iterations on the model's TransformerConfig (megatron reads
``recompute_granularity``/``recompute_method``/``recompute_num_layers`` at forward time and
cp_ext reads ``cp_aware_recompute``). Prints the median seconds per iteration of each mode
and its ratio to ``none``.

    python tools/bench_recompute.py --nproc 4 --rounds 3 -- --config configs/cpu_long_64k.yaml
"""

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

MODES = {
    "none": dict(recompute_granularity=None, recompute_method=None, recompute_num_layers=None, cp_aware_recompute=False),
    "full": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1, cp_aware_recompute=False),
    "full-cp-aware": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1,
                          cp_aware_recompute=True),
}
# Built with full recompute (so megatron validates it), then switched per iteration.
BUILD_FLAGS = ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]


def _worker(argv):
    import time
    import warnings

    warnings.simplefilter("ignore")
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--rounds", type=int, required=True)
    known, flags = p.parse_known_args(argv)
    import torch
    import torch.distributed as dist

    from cp_ext.arguments import parse_args
    from cp_ext.training.trainer import Trainer

    torch.set_num_threads(1)
    flags = [f for f in flags if f != "--"]
    trainer = Trainer(parse_args(flags + BUILD_FLAGS + ["--train-iters", str(10 ** 6)]))
    names = list(MODES)
    seconds = {name: [] for name in names}
    losses = []
    for rnd in range(known.rounds + 1):
        order = names[rnd % len(names):] + names[:rnd % len(names)]
        for name in order:
            for key, value in MODES[name].items():
                setattr(trainer.config, key, value)
            dist.barrier()
            start = time.perf_counter()
            metrics = trainer.train_step()
            dist.barrier()
            if rnd > 0:
                seconds[name].append(time.perf_counter() - start)
            losses.append((name, metrics["lm loss"]))
    Path(known.out, f"rank{dist.get_rank()}.json").write_text(json.dumps({"seconds": seconds, "losses": losses}))
    trainer.shutdown()


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        return _worker(argv[1:])
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=4, help="ranks (torchrun --nproc-per-node)")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds (one iteration per mode each), after 1 warm-up")
    p.add_argument("--json", default=None, help="also write the timings here")
    p.add_argument("trainer_flags", nargs=argparse.REMAINDER, help="after --: trainer flags (no recompute flags)")
    args = p.parse_args(argv)
    flags = [f for f in args.trainer_flags if f != "--"]
    if any(f.startswith("--recompute") or "cp-aware-recompute" in f for f in flags):
        p.error("give the trainer flags without recompute flags: every mode is run")
    from cp_ext.bench.workers import WorkerError, run_workers

    try:
        result = run_workers(__file__, args.nproc, ["--rounds", args.rounds, *flags],
                             timeout=int(os.environ.get("CP_EXT_BENCH_TIMEOUT", "3600")))[0]  # rank 0's timings
    except WorkerError as e:
        print(e, file=sys.stderr)
        return 1
    base = statistics.median(result["seconds"]["none"])
    print(f"trainer flags: {' '.join(flags)}  ({args.nproc} ranks, {args.rounds} timed rounds)")
    print(f"{'mode':>14s} {'median s/iter':>14s} {'vs none':>8s}   iterations (s)")
    for name, times in result["seconds"].items():
        med = statistics.median(times)
        print(f"{name:>14s} {med:14.2f} {med / base:8.3f}   {' '.join(f'{t:.2f}' for t in times)}")
    print("lm loss by iteration: " + " ".join(f"{loss:.3f}" for _, loss in result["losses"]))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
