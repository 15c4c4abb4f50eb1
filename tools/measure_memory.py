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
import os
import sys
import time
import weakref
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from cp_ext.perf.workers import WorkerConfigError, run_workers, write_config_error  # noqa: E402

# Attention-heavy CPU config: long sequence, small hidden, dense MLP, fp32, one microbatch.
ATTN_HEAVY = [
    "--device", "cpu", "--position-embedding-type", "rope", "--disable-bias-linear", "--swiglu", "--normalization", "RMSNorm", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--ffn-hidden-size", "128", "--seq-length", "4096", "--micro-batch-size", "1",
    "--make-vocab-size-divisible-by", "128", "--train-iters", "1",
    "--lr", "1e-4",
]


def _rss_now():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _Held:
    """What the saved-tensor hook hands autograd: the tensor, plus a finalizer when autograd drops it."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor):
        self.tensor = tensor


class LiveSavedBytes:
    """Bytes of the unique storages autograd holds for backward right now, and their peak.

    Each saved tensor is counted while autograd keeps it (a tensor saved twice, or two views
    of one storage, count once); the parameters' own storages are not activations. The
    attention outputs kept by CP-aware recompute (`KeptAttention.live_bytes`) are held
    outside autograd and are added to every sample, so under full recompute the peak is the
    checkpointed layer inputs + kept outputs + the one layer being recomputed.

    ``peak`` is that (saved + kept) peak. ``peak_with_transient`` adds what an all-gather
    attention call holds while it runs (`AttentionTransient`: the gathered K/V, the full
    dK/dV): never saved for backward, so invisible to the hooks above, but it sits on top of
    the saved activations of the moment; 0 for the ring, Ulysses and hybrid.
    """

    def __init__(self, excluded_ptrs):
        self.excluded = excluded_ptrs
        self.live = {}  # storage data_ptr -> [nbytes, references, shape, dtype]
        self.bytes = 0
        self.peak = 0
        self.kept_at_peak = 0
        self.largest = {}
        self.transient = None  # the AttentionTransient of the all-gather call running now, if any
        self.transient_peak = 0  # the most one call held
        self.peak_with_transient = 0
        self.transient_at_peak = 0

    def _release(self, ptr):
        entry = self.live[ptr]
        entry[1] -= 1
        if entry[1] == 0:
            self.bytes -= entry[0]
            del self.live[ptr]

    def sample(self):
        from cp_ext.transformer.recompute import KeptAttention

        total = self.bytes + KeptAttention.live_bytes
        if total > self.peak:
            self.peak, self.kept_at_peak = total, KeptAttention.live_bytes
        extra = self.transient.live_bytes() if self.transient is not None else 0
        self.transient_peak = max(self.transient_peak, extra)
        if total + extra > self.peak_with_transient:
            self.peak_with_transient, self.transient_at_peak = total + extra, extra

    def pack(self, tensor):
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        if not ptr or ptr in self.excluded:
            return tensor
        entry = self.live.get(ptr)
        if entry is None:
            entry = self.live[ptr] = [storage.nbytes(), 0]
            self.bytes += entry[0]
            self.largest.setdefault(ptr, (entry[0], tuple(tensor.shape), str(tensor.dtype).replace("torch.", "")))
        entry[1] += 1
        held = _Held(tensor)
        weakref.finalize(held, self._release, ptr)
        self.sample()
        return held

    @staticmethod
    def unpack(held):
        return held.tensor if isinstance(held, _Held) else held


def _transient_mode():
    """`AttentionTransient`, built on first use (torch is imported in the ranks only)."""
    import torch
    from torch.multiprocessing.reductions import StorageWeakRef
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    class AttentionTransient(TorchDispatchMode):
        """Every storage an op allocates inside one all-gather attention call, while it lives.

        A storage is new when an op returns it and none of the op's inputs holds it (views and
        in-place ops return their input's); it is live until its last tensor dies (a weak
        reference to the storage itself, so views keep it alive as they do in the allocator).
        What survives the call (its output, the LSE) is counted by the saved-tensor hooks
        afterwards, once the call has returned. After every op the sum joins `LiveSavedBytes`'s sample.
        """

        def __init__(self, saved):
            super().__init__()
            self.saved = saved
            self.storages = {}  # data_ptr -> (StorageWeakRef, nbytes)

        def live_bytes(self):
            self.storages = {p: (r, n) for p, (r, n) in self.storages.items() if not r.expired()}
            return sum(n for _, n in self.storages.values())

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                      if isinstance(t, torch.Tensor)}
            for t in tree_flatten(out)[0]:
                if not isinstance(t, torch.Tensor):
                    continue
                storage = t.untyped_storage()
                ptr = storage.data_ptr()
                known = self.storages.get(ptr)
                if ptr and ptr not in inputs and (known is None or known[0].expired()):
                    self.storages[ptr] = (StorageWeakRef(storage), storage.nbytes())
            self.saved.sample()
            return out

    return AttentionTransient


def track_all_gather_transient(saved):
    """Run every all-gather attention call (forward and backward, autograd and CP-aware recompute
    paths) under an `AttentionTransient` that reports into ``saved``."""
    from cp_ext.attention import all_gather, dispatch

    mode = _transient_mode()

    def tracked(fn):
        def call(*a, **kw):
            with mode(saved) as t:
                saved.transient = t
                try:
                    return fn(*a, **kw)
                finally:
                    saved.transient = None
        return call

    for module in (all_gather, dispatch):  # dispatch imported the functions by name
        for name in ("all_gather_attn_forward", "all_gather_attn_backward"):
            setattr(module, name, tracked(getattr(all_gather, name)))


def measure(trainer_flags, world_size):
    """Run one iteration of the Trainer under saved-tensor hooks; returns this rank's record."""
    import torch

    from cp_ext.arguments import parse_args
    from cp_ext.platform import memory_bytes
    from cp_ext.training.trainer import Trainer

    args = parse_args(one_microbatch(trainer_flags, world_size)[0], world_size=world_size)
    trainer = Trainer(args)
    param_ptrs = set()
    for p in trainer.model[0].parameters():
        param_ptrs.add(p.untyped_storage().data_ptr())
        if getattr(p, "main_grad", None) is not None:
            param_ptrs.add(p.main_grad.untyped_storage().data_ptr())
    saved = LiveSavedBytes(param_ptrs)
    track_all_gather_transient(saved)
    on_cuda = trainer.device.type == "cuda"
    if on_cuda:
        torch.cuda.reset_peak_memory_stats()
    rss_before = _rss_now()
    start = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
        metrics = trainer.train_step()
    seconds = time.perf_counter() - start
    peak = memory_bytes()
    import torch.distributed as dist

    from cp_ext import parallel_state as cp_state
    from megatron.core import parallel_state as mpu

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
    del cp_state
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


def _worker(argv):
    p = argparse.ArgumentParser()
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
        sys.exit(2)
    Path(known.out, f"rank{record['rank']}.json").write_text(json.dumps(record))


def run_flags(cp, trainer_flags, ulysses_size=None, comm_type=None):
    """The trainer flags of the run on `cp` ranks with --context-parallel-size cp, one microbatch."""
    flags = list(trainer_flags) + ["--context-parallel-size", str(cp)]
    all_gather = comm_type == "all_gather" and cp > 1
    if all_gather:
        flags += ["--cp-comm-type", "all_gather"]
    elif ulysses_size and cp > 1:
        flags += ["--ulysses-size", str(ulysses_size)]
    return one_microbatch(flags, cp)


def run(cp, trainer_flags, ulysses_size=None, timeout=600, comm_type=None):
    """Launch one measurement on `cp` ranks with --context-parallel-size cp; returns per-rank records.

    ``comm_type``: None (the attention the CP groups pick) or ``"all_gather"`` (``--cp-comm-type
    all_gather``: every layer all-gathers K/V over the CP group, on the ring's layout). The flags are
    checked here first (`one_microbatch`): a ConfigError before any rank starts.
    """
    flags, _ = run_flags(cp, trainer_flags, ulysses_size, comm_type)
    records = run_workers(__file__, cp, flags, timeout=timeout)
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


# Recompute modes by name: the trainer flags each adds.
FULL = ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
MODES = {"none": [], "full": FULL + ["--no-cp-aware-recompute"], "full-cp-aware": FULL}
PLANNER_MODE = {"none": None, "full": "full", "full-cp-aware": "full_cp_aware"}
# --cp-comm-types: "default" is the attention the CP groups pick (ring; Ulysses / hybrid with --ulysses-size)
COMM_TYPES = ("default", "all_gather")


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


def _mib(n):
    return f"{n / 2**20:10.2f} MiB"


def _with_seq_length(flags, seq):
    """The flags with ``--seq-length seq`` (argparse keeps the last value given)."""
    return list(flags) + ([] if seq is None else ["--seq-length", str(seq)])


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
    for seq in seq_lengths:
        for mode in modes:
            mode_flags = _with_seq_length(flags, seq) + MODES[mode]
            base = None
            for comm_type in comm_types:
                base, split, ratio = compare(cp, mode_flags, ulysses_size, comm_type, base)
                worst = max(split, key=peak)
                est1, estn = planner_estimate(base[0], mode_flags, mode), planner_estimate(worst, mode_flags, mode)
                held = max(r.get("transient_peak_bytes", 0) for r in split)
                held_model = planner_estimate(worst, mode_flags, mode, "attention_transient")
                row = {"seq_length": base[0]["seq_length"], "mode": mode, "comm_type": comm_type, "cp1": base[0],
                       "cpN": split, "ratio": ratio, "planner_cp1": est1, "planner_cpN": estn,
                       "transient": held, "planner_transient": held_model}
                rows.append(row)
                ok &= ratio <= max_ratio / cp
                off = max(abs(est1 / peak(base[0]) - 1), abs(estn / peak(worst) - 1))
                row["planner_error"] = off
                if planner_tolerance is not None:
                    ok &= off <= planner_tolerance
                print(f"{row['seq_length']:>7d} {mode:>14s} {comm_type:>10s} | {_mib(peak(base[0]))} {_mib(est1)} | "
                      f"{_mib(peak(worst)):>14s} {_mib(estn)} | {_mib(held)} {_mib(held_model)} | {ratio * cp:9.3f} | "
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
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        return _worker(argv[1:])
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
    from cp_ext.arguments import ConfigError

    try:
        return _measure_and_report(args, flags)
    except (ConfigError, WorkerConfigError) as e:  # the tool's check or a rank's: one message, no traceback
        print(f"measure_memory.py: configuration error:\n{e}", file=sys.stderr, flush=True)
        return 2


def _measure_and_report(args, flags):
    # Both runs' flags checked before the first launch; the one-microbatch note said once.
    notes = {run_flags(n, flags, args.ulysses_size, c)[1] for n in (1, args.cp) for c in args.cp_comm_types}
    for note in sorted(n for n in notes if n):
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
