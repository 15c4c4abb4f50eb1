"""Per-rank memory of one training iteration, at CP=1 and CP=N, measured.

For one config (trainer flags, as `pretrain_moe.py` takes them) this launches the real
`cp_ext.training.trainer.Trainer` twice under torchrun: once on 1 rank with
``--context-parallel-size 1`` and once on N ranks with ``--context-parallel-size N``
(everything else the same), runs one iteration and reports per rank:

* activation bytes: the peak, over the iteration, of the *unique storages* autograd holds
  for backward (`torch.autograd.graph.saved_tensors_hooks`; a storage counts from the moment
  it is saved until autograd drops it), excluding the parameters' own storages (weights saved
  by linear layers are not activations), plus the attention outputs that CP-aware recompute
  keeps outside autograd. Without recompute the peak is at the end of the forward; with full
  recompute it is the checkpointed layer inputs (+ kept outputs) and one recomputed layer;
* peak memory: the CUDA allocator's peak on GPU, peak RSS on CPU (`cp_ext.platform.memory_bytes`),
  and on CPU the RSS growth over the iteration (peak RSS minus RSS before it);
* with ``--cp-comm-types all_gather`` (every layer's CP attention all-gathers K/V, as
  ``--cp-comm-type all_gather`` does): the transient of the all-gather calls, which autograd
  never saves: every storage an op allocates inside a call (a `TorchDispatchMode` around
  `all_gather_attn_forward` / `_backward`), while it lives. It is reported as the most one
  call held, next to the planner's `all_gather_transient_bytes` (gathered K/V; in the
  backward also the fp32 dK/dV), and added to the saved bytes of its moment: the activation
  peak of an all_gather run is the larger of the two peaks.

PP = 1, so the whole forward is alive at once. One microbatch is measured: a training run's
flags with --global-batch-size above --micro-batch-size x DP are measured at --global-batch-size
= --micro-batch-size x DP, and the output says so (at PP 1 megatron runs each microbatch's forward
and backward before the next, so an iteration's activation peak is one microbatch's). A flag the
trainer refuses is one ``configuration error`` message and exit status 2, whether the tool or a
rank finds it (then without torchrun's report).

    python tools/measure_memory.py --cp 2                      # the attention-heavy preset
    python tools/measure_memory.py --cp 2 --ulysses-size 2     # same, Ulysses
    python tools/measure_memory.py --cp 2 -- --config configs/cpu_demo.yaml --tensor-model-parallel-size 1 ...
    python tools/measure_memory.py --cp 4 --modes none full full-cp-aware --seq-lengths 16384 32768 \
        --planner-tolerance 0.15 -- <trainer flags>          # recompute modes side by side, with the planner
    python tools/measure_memory.py --cp 2 --modes none --cp-comm-types default all_gather \
        --planner-tolerance 0.15                             # ring vs all-gather attention, with the planner

Prints one line per rank (or, with --modes/--seq-lengths, one row per length and mode with the
planner's estimate next to each measurement) and the ratio (per-rank activation bytes at CP=N)
/ (CP=1); the exit status is 1 when that ratio exceeds ``--max-ratio`` x 1/N (default 1.15),
or the planner is off by more than ``--planner-tolerance``.
"""

import argparse
import json
import sys
from pathlib import Path

from cp_ext.errors import ConfigError
from cp_ext.bench.workers import WorkerConfigError
from cp_ext.bench.memory_measure import (COMM_TYPES, MODES, compare, measure_table, one_microbatch_notes, peak,
                                            within_bounds)

# Attention-heavy CPU config: long sequence, small hidden, dense MLP, fp32, one microbatch.
ATTN_HEAVY = [
    "--device", "cpu", "--position-embedding-type", "rope", "--disable-bias-linear", "--swiglu", "--normalization", "RMSNorm", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--ffn-hidden-size", "128", "--seq-length", "4096", "--micro-batch-size", "1",
    "--make-vocab-size-divisible-by", "128", "--train-iters", "1",
    "--lr", "1e-4",
]


def _mib(n):
    return f"{n / 2**20:10.2f} MiB"


def table(cp, flags, modes, seq_lengths, ulysses_size=None, max_ratio=1.15, planner_tolerance=None, verbose=False,
          comm_types=("default",)):
    """Measure every (sequence length, mode, comm type) at CP=1 and CP=cp; print a table; return (rows, ok).

    One CP=1 run per (length, mode) serves every comm type. The CP=N columns are the peak with
    the all-gather transient (equal to the saved activations for the default attention); the
    transient columns are the most one all-gather call held, measured and modelled.
    """
    rows, ok = [], True
    print(f"config: {' '.join(flags)}")
    print(f"{'seq':>7s} {'recompute':>14s} {'cp comm':>10s} | {'CP=1 act':>12s} {'planner':>12s} | "
          f"{'CP=' + str(cp) + ' act/rank':>14s} {'planner':>12s} | {'transient':>12s} {'model':>12s} | "
          f"{'ratio x N':>9s} | {'CP=1 RSS':>12s} {'CP=' + str(cp) + ' RSS':>12s} | "
          f"{'CP=1 s/it':>9s} {'CP=' + str(cp) + ' s/it':>9s}")
    for row in measure_table(cp, flags, modes, seq_lengths, ulysses_size, comm_types):
        rows.append(row)
        ok &= within_bounds(row, cp, max_ratio, planner_tolerance)
        base, split = [row["cp1"]], row["cpN"]
        worst = max(split, key=peak)
        print(f"{row['seq_length']:>7d} {row['mode']:>14s} {row['comm_type']:>10s} | {_mib(peak(base[0]))} "
              f"{_mib(row['planner_cp1'])} | {_mib(peak(worst)):>14s} {_mib(row['planner_cpN'])} | "
              f"{_mib(row['transient'])} {_mib(row['planner_transient'])} | {row['ratio'] * cp:9.3f} | "
              f"{_mib(base[0]['peak_bytes'])} {_mib(max(r['peak_bytes'] for r in split))} | "
              f"{base[0]['iteration_seconds']:9.2f} {max(r['iteration_seconds'] for r in split):9.2f}", flush=True)
        if verbose:
            for r in base + split:
                print(f"    CP={r['cp']} rank {r['rank']} ({r.get('cp_comm_type')}): kept attention "
                      f"{_mib(r['kept_attention_bytes'])}, all-gather transient at the peak "
                      f"{_mib(r.get('transient_at_peak_bytes', 0))}")
                for n, shape, dt in r["largest"]:
                    print(f"           {n:>12d} B {dt:8s} {shape}")
    print(f"ratio x N: per-rank activation bytes at CP={cp} over CP=1, times {cp} (1.00 = a perfect split; "
          f"bound {max_ratio}){'' if planner_tolerance is None else f'; planner within {planner_tolerance:.0%}'}: "
          f"{'OK' if ok else 'EXCEEDED'}")
    if "all_gather" in comm_types:
        print("transient: the most one all-gather attention call held (gathered K/V; in the backward also the fp32 "
              "dK/dV), measured by hooking the call's allocations, next to "
              "cp_ext.perf.memory.all_gather_transient_bytes; act/rank includes it where it raised the peak")
    return rows, ok


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cp", type=int, default=2, help="N: the CP size compared with CP=1 (N ranks)")
    p.add_argument("--ulysses-size", type=int, default=None, help="U for the CP=N run (default 1: ring)")
    p.add_argument("--max-ratio", type=float, default=1.15, help="fail when ratio > this / N")
    p.add_argument("--modes", nargs="+", choices=list(MODES), default=None,
                   help="recompute modes to measure side by side (none; full = Megatron's plain full recompute; "
                        "full-cp-aware = full keeping attention out + LSE); default: the trainer flags as given")
    p.add_argument("--seq-lengths", nargs="+", type=int, default=None, help="measure each (overrides --seq-length)")
    p.add_argument("--planner-tolerance", type=float, default=None,
                   help="with --modes: also fail when the planner's estimate is off by more than this (e.g. 0.15)")
    p.add_argument("--cp-comm-types", nargs="+", choices=list(COMM_TYPES), default=["default"],
                   help="CP attention of the CP=N runs, side by side: default (what the CP groups pick: ring, or "
                        "Ulysses/hybrid with --ulysses-size) and/or all_gather (every layer all-gathers K/V)")
    p.add_argument("--json", default=None, help="also write all records here")
    p.add_argument("--verbose", action="store_true", help="print each rank's largest saved storages")
    p.add_argument("trainer_flags", nargs=argparse.REMAINDER,
                   help="after --: trainer flags (default: the attention-heavy preset)")
    args = p.parse_args(argv)
    flags = [f for f in args.trainer_flags if f != "--"] or ATTN_HEAVY
    try:
        return _measure_and_report(args, flags)
    except (ConfigError, WorkerConfigError) as e:  # the tool's check or a rank's: one message, no traceback
        from cp_ext.console import exit_with_config_error

        exit_with_config_error("measure_memory.py", e)


def _measure_and_report(args, flags):
    for note in one_microbatch_notes(args.cp, flags, args.ulysses_size, args.cp_comm_types):
        print(note, flush=True)
    if args.modes or args.seq_lengths:
        rows, ok = table(args.cp, flags, args.modes or ["none"], args.seq_lengths or [None], args.ulysses_size,
                         args.max_ratio, args.planner_tolerance, args.verbose, args.cp_comm_types)
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1))
        return 0 if ok else 1
    base, results = None, {}
    for comm_type in args.cp_comm_types:
        base, split, ratio = compare(args.cp, flags, args.ulysses_size, comm_type, base)
        results[comm_type] = (split, ratio)
    print(f"config: {' '.join(flags)}")
    print(f"{'run':>8s} {'cp comm':>10s} {'rank':>4s} {'tokens':>7s} {'activations saved':>18s} "
          f"{'+ all-gather':>14s} {'one call held':>14s} {'peak (' + base[0]['peak_kind'] + ')':>26s} "
          f"{'RSS growth':>15s}")
    for comm_type, r in [("-", r) for r in base] + [(c, r) for c, (split, _) in results.items() for r in split]:
        growth = _mib(r["rss_growth_bytes"]) if r["rss_growth_bytes"] is not None else "-"
        print(f"{'CP=' + str(r['cp']):>8s} {comm_type:>10s} {r['rank']:>4d} {r['tokens']:>7d} "
              f"{_mib(r['activation_bytes']):>18s} {_mib(peak(r)):>14s} {_mib(r.get('transient_peak_bytes', 0)):>14s} "
              f"{_mib(r['peak_bytes']):>26s} {growth:>15s}")
        if args.verbose:
            for n, shape, dt in r["largest"]:
                print(f"           {n:>12d} B {dt:8s} {shape}")
    bound = args.max_ratio / args.cp
    ok = True
    for comm_type, (split, ratio) in results.items():
        ok &= ratio <= bound
        print(f"{comm_type}: per-rank activation bytes, CP={args.cp} / CP=1 = {ratio:.4f} (1/N = {1 / args.cp:.4f}; "
              f"bound {args.max_ratio}/N = {bound:.4f}: {'OK' if ratio <= bound else 'EXCEEDED'})")
    if args.json:
        first = next(iter(results))
        Path(args.json).write_text(json.dumps({"cp1": base, "cpN": results[first][0], "ratio": results[first][1],
                                               "by_comm_type": {c: {"cpN": sp, "ratio": ra} for c, (sp, ra) in
                                                                results.items()}}, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
