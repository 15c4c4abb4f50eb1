"""Per-rank memory of one training iteration of the real `Trainer`, measured (tools/measure_memory.py).

    base, split, ratio = compare(2, trainer_flags)     # CP=1 and CP=2 records, activation ratio
    planner_estimate(split[0], trainer_flags, "none")   # cp_ext.perf.memory's bytes for that run
    for row in measure_table(cp, flags, modes, seq_lengths, ...): ...   # one row per measurement

Each measurement launches ranks (`cp_ext.bench.workers.run_workers`) that run this module,
``python -m cp_ext.bench.memory_measure --worker --out DIR FLAGS``: a `Trainer` from the flags,
one iteration inside `cp_ext.perf.saved_tensors.track_saved_tensors`, and one JSON record per rank
(`measure`). A rank's `ConfigError` is written for the tool (`write_config_error`), exit 2.
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

from cp_ext.bench.workers import run_workers, write_config_error

# Recompute modes by name: the trainer flags each adds.
FULL = ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
MODES = {"none": [], "full": FULL + ["--no-cp-aware-recompute"], "full-cp-aware": FULL,
         "mla-up-proj": ["--recompute-granularity", "selective", "--recompute-modules", "mla_up_proj"]}
PLANNER_MODE = {"none": None, "full": "full", "full-cp-aware": "full_cp_aware", "mla-up-proj": "mla_up_proj"}
# --cp-comm-types: "default" is the attention the CP groups pick (ring; Ulysses / hybrid with --ulysses-size)
COMM_TYPES = ("default", "all_gather")


def _rss_now():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure(trainer_flags, world_size):
    """Run one iteration of the Trainer under saved-tensor hooks; returns this rank's record."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    from cp_ext.arguments import parse_args
    from cp_ext.perf.saved_tensors import track_saved_tensors
    from cp_ext.platform import memory_bytes
    from cp_ext.training.trainer import Trainer
    from cp_ext.transformer.recompute import KeptAttention

    args = parse_args(one_microbatch(trainer_flags, world_size)[0], world_size=world_size)
    trainer = Trainer(args)
    param_ptrs = set()  # the weights linear layers save are not activations
    for p in trainer.model[0].parameters():
        param_ptrs.add(p.untyped_storage().data_ptr())
        if getattr(p, "main_grad", None) is not None:
            param_ptrs.add(p.main_grad.untyped_storage().data_ptr())
    on_cuda = trainer.device.type == "cuda"
    if on_cuda:
        torch.cuda.reset_peak_memory_stats()
    rss_before = _rss_now()
    start = time.perf_counter()
    with track_saved_tensors(param_ptrs, kept_bytes=lambda: KeptAttention.live_bytes) as saved:
        metrics = trainer.train_step()
    seconds = time.perf_counter() - start
    peak = memory_bytes()
    record = {
        "rank": dist.get_rank(),
        "cp": args.context_parallel_size,
        "ulysses": args.ulysses_size,
        "tp": args.tensor_model_parallel_size,
        "cp_rank": mpu.get_context_parallel_rank(),
        "tokens": int(trainer.cp_positions.numel()),
        "seq_length": args.seq_length,
        "padded_vocab": trainer.padded_vocab_size,
        "recompute": args.recompute_granularity,
        "cp_aware_recompute": trainer.config.cp_aware_recompute,
        "cp_comm_type": "+".join(sorted(set(args.cp_comm_types or ["default"]))),
        "activation_bytes": saved.peak,
        "kept_attention_bytes": saved.kept_at_peak,
        "activation_with_transient_bytes": saved.peak_with_transient,
        "transient_at_peak_bytes": saved.transient_at_peak,
        "transient_peak_bytes": saved.transient_peak,
        "saved_storages": len(saved.largest),
        "peak_bytes": int(peak),
        "peak_kind": "cuda max_memory_allocated" if on_cuda else "peak RSS",
        "rss_growth_bytes": None if on_cuda else max(0, int(peak) - rss_before),
        "iteration_seconds": seconds,
        "lm_loss": metrics["lm loss"],
        "largest": sorted(([n, list(s), dt] for n, s, dt in saved.largest.values()), reverse=True)[:int(os.environ.get("CP_EXT_MEASURE_TOP", "12"))],
    }
    trainer.shutdown()
    return record


def one_microbatch(trainer_flags, world_size):
    """(flags, note): the flags of one run, validated as the trainer would (ConfigError), with
    --global-batch-size set to one microbatch (--micro-batch-size x DP) where it was more, and the
    note saying so (None when the flags already make one microbatch).

    Memory peaks per microbatch are what a run's flags are checked for: at PP 1 megatron's schedule
    runs each microbatch's forward and backward before the next, so more microbatches add time,
    not activations (the gradient buffers are there once either way)."""
    from cp_ext.arguments import ConfigError, parse_args

    args = parse_args(trainer_flags, world_size=world_size)
    if args.pipeline_model_parallel_size != 1:
        raise ConfigError(f"  - --pipeline-model-parallel-size {args.pipeline_model_parallel_size}: measure_memory.py "
                          f"measures PP 1 (its sum assumes one live forward); give --pipeline-model-parallel-size 1")
    one = args.micro_batch_size * args.data_parallel_size
    if args.global_batch_size == one:
        return list(trainer_flags), None
    note = (f"note: --global-batch-size {args.global_batch_size} is {args.global_batch_size // one} microbatches of "
            f"--micro-batch-size {args.micro_batch_size} x DP {args.data_parallel_size} per iteration; measuring one "
            f"(--global-batch-size {one}): at PP 1 each microbatch's forward and backward runs before the next, so "
            f"the per-iteration activation peak is one microbatch's")
    return list(trainer_flags) + ["--global-batch-size", str(one)], note  # argparse keeps the last value


def worker(argv):
    """One rank of a measurement: ``--worker --out DIR FLAGS`` (what `run_workers` passes)."""
    p = argparse.ArgumentParser()
    p.add_argument("--worker", action="store_true")
    p.add_argument("--out", required=True)
    known, rest = p.parse_known_args(argv)
    import faulthandler

    import torch

    from cp_ext.arguments import ConfigError

    faulthandler.dump_traceback_later(int(os.environ.get("CP_EXT_MEASURE_TIMEOUT", "540")), exit=True)  # a hang shows where
    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        record = measure(rest, world)
    except ConfigError as e:  # found once the data is open (a split too small, ...): the tool says it once
        write_config_error(known.out, int(os.environ.get("RANK", "0")), e)
        return 2
    Path(known.out, f"rank{record['rank']}.json").write_text(json.dumps(record))
    return 0


def run_flags(cp, trainer_flags, ulysses_size=None, comm_type=None):
    """The trainer flags of the run on `cp` ranks with --context-parallel-size cp, one microbatch."""
    flags = list(trainer_flags) + ["--context-parallel-size", str(cp)]
    all_gather = comm_type == "all_gather" and cp > 1
    if all_gather:
        flags += ["--cp-comm-type", "all_gather"]
    elif ulysses_size and cp > 1:
        flags += ["--ulysses-size", str(ulysses_size)]
    return one_microbatch(flags, cp)


def one_microbatch_notes(cp, trainer_flags, ulysses_size=None, comm_types=("default",)):
    """Both runs' flags checked (ConfigError) before the first launch; the notes to say, once each."""
    notes = {run_flags(n, trainer_flags, ulysses_size, c)[1] for n in (1, cp) for c in comm_types}
    return sorted(n for n in notes if n)


def run(cp, trainer_flags, ulysses_size=None, timeout=600, comm_type=None):
    """Launch one measurement on `cp` ranks with --context-parallel-size cp; returns per-rank records.

    ``comm_type``: None (the attention the CP groups pick) or ``"all_gather"`` (``--cp-comm-type
    all_gather``: every layer all-gathers K/V over the CP group, on the ring's layout). The flags are
    checked here first (`one_microbatch`): a ConfigError before any rank starts.
    """
    flags, _ = run_flags(cp, trainer_flags, ulysses_size, comm_type)
    records = run_workers(__name__, cp, flags, timeout=timeout)  # its ranks run this module's `worker`
    return sorted(records, key=lambda r: r["rank"])


def compare(cp, trainer_flags, ulysses_size=None, comm_type=None, base=None):
    """CP=1 and CP=cp records plus the per-rank activation ratio (max over ranks / CP=1).

    ``comm_type="all_gather"``: the CP=cp run's attention all-gathers K/V (CP=1 has no CP
    attention, so ``base``, an earlier CP=1 run of the same flags, may be passed to reuse it).
    The ratio is of the saved activations; the all-gather transient is on top (``peak``).
    """
    base = base or run(1, trainer_flags)
    split = run(cp, trainer_flags, ulysses_size, comm_type=comm_type)
    ratio = max(r["activation_bytes"] for r in split) / base[0]["activation_bytes"]
    return base, split, ratio


def peak(record):
    """A rank's activation peak: saved for backward (+ kept), plus an all-gather call's transient where it raises it."""
    return record.get("activation_with_transient_bytes", record["activation_bytes"])


def planner_estimate(record, trainer_flags, mode, part="total"):
    """The planner's per-rank activation bytes (`cp_ext.perf.memory`) for a measured run
    (``part="attention_transient"``: what one all-gather call holds; the run's comm type is read from the record)."""
    from cp_ext.arguments import parse_args
    from cp_ext.perf.memory import ModelShape, activation_bytes

    a = parse_args(list(trainer_flags) + ["--context-parallel-size", str(record["cp"]), "--seq-length",
                                          str(record["seq_length"])], world_size=record["cp"])
    shape = ModelShape.from_args(a, vocab=record["padded_vocab"])
    comm_type = "all_gather" if record.get("cp_comm_type") == "all_gather" else None
    return activation_bytes(shape, s=a.seq_length, b=a.micro_batch_size, tp=a.tensor_model_parallel_size,
                            cp=a.context_parallel_size, dtype="bf16" if a.bf16 else "fp32",
                            recompute=PLANNER_MODE[mode], sequence_parallel=a.sequence_parallel,
                            cp_comm_type=comm_type, ulysses=record.get("ulysses") or 1,
                            mla_exchange=a.cp_mla_exchange)[part]


def with_seq_length(flags, seq):
    """The flags with ``--seq-length seq`` (argparse keeps the last value given)."""
    return list(flags) + ([] if seq is None else ["--seq-length", str(seq)])


def measure_table(cp, flags, modes, seq_lengths, ulysses_size=None, comm_types=("default",)):
    """Measure every (sequence length, mode, comm type) at CP=1 and CP=cp; yield one row per measurement,
    as it is measured, next to the planner's estimates.

    One CP=1 run per (length, mode) serves every comm type. ``planner_error`` compares the peak with
    the all-gather transient (equal to the saved activations for the default attention); the
    transient values are the most one all-gather call held, measured and modelled.
    """
    for seq in seq_lengths:
        for mode in modes:
            mode_flags = with_seq_length(flags, seq) + MODES[mode]
            base = None
            for comm_type in comm_types:
                base, split, ratio = compare(cp, mode_flags, ulysses_size, comm_type, base)
                worst = max(split, key=peak)
                est1, estn = planner_estimate(base[0], mode_flags, mode), planner_estimate(worst, mode_flags, mode)
                row = {"seq_length": base[0]["seq_length"], "mode": mode, "comm_type": comm_type, "cp1": base[0],
                       "cpN": split, "ratio": ratio, "planner_cp1": est1, "planner_cpN": estn,
                       "transient": max(r.get("transient_peak_bytes", 0) for r in split),
                       "planner_transient": planner_estimate(worst, mode_flags, mode, "attention_transient"),
                       "planner_error": max(abs(est1 / peak(base[0]) - 1), abs(estn / peak(worst) - 1))}
                yield row


def within_bounds(row, cp, max_ratio, planner_tolerance=None):
    """A table row's verdict: the activation ratio within ``max_ratio`` / cp, and the planner within its tolerance."""
    return row["ratio"] <= max_ratio / cp and (planner_tolerance is None or row["planner_error"] <= planner_tolerance)


if __name__ == "__main__":
    sys.exit(worker(sys.argv[1:]))
