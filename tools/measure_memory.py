"""Per-rank memory of one training iteration, at CP=1 and CP=N, measured.

For one config (trainer flags, as `pretrain_moe.py` takes them) this launches the real
`cp_ext.training.trainer.Trainer` twice under torchrun: once on 1 rank with
``--context-parallel-size 1`` and once on N ranks with ``--context-parallel-size N``
(everything else the same), runs one iteration and reports per rank:

* activation bytes: the sum of the *unique storages* autograd saves for backward during the
  forward (`torch.autograd.graph.saved_tensors_hooks`), excluding the parameters' own
  storages (weights saved by linear layers are not activations);
* peak memory: the CUDA allocator's peak on GPU, peak RSS on CPU (`cp_ext.platform.memory_bytes`),
  and on CPU the RSS growth over the iteration (peak RSS minus RSS before it).

Keep PP = 1 and one microbatch per iteration (the default global batch), so the whole
forward is alive at once and the sum is the activation footprint.

    python tools/measure_memory.py --cp 2                      # the attention-heavy preset
    python tools/measure_memory.py --cp 2 --ulysses-size 2     # same, Ulysses
    python tools/measure_memory.py --cp 2 -- --config configs/cpu_demo.yaml --tensor-model-parallel-size 1 ...

Prints one line per rank and the ratio (per-rank activation bytes at CP=N) / (CP=1); the
exit status is 1 when that ratio exceeds ``--max-ratio`` x 1/N (default 1.15).
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

# Attention-heavy CPU config: long sequence, small hidden, dense MLP, fp32, one microbatch.
ATTN_HEAVY = [
    "--device", "cpu", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--ffn-hidden-size", "128", "--seq-length", "4096", "--micro-batch-size", "1",
    "--make-vocab-size-divisible-by", "128", "--train-iters", "1",
    "--lr", "1e-4",
]


def _rss_now():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure(trainer_flags, world_size):
    """Run one iteration of the Trainer under saved-tensor hooks; returns this rank's record."""
    import torch

    from cp_ext.arguments import parse_args
    from cp_ext.platform import memory_bytes
    from cp_ext.training.trainer import Trainer

    args = parse_args(trainer_flags, world_size=world_size)
    if args.pipeline_model_parallel_size != 1:
        raise SystemExit("measure_memory.py: use --pipeline-model-parallel-size 1 (the sum assumes one live forward)")
    trainer = Trainer(args)
    if trainer.num_microbatches != 1:
        raise SystemExit(f"measure_memory.py: {trainer.num_microbatches} microbatches; set --global-batch-size "
                         f"= --micro-batch-size x DP for one")
    param_ptrs = set()
    for p in trainer.model[0].parameters():
        param_ptrs.add(p.untyped_storage().data_ptr())
        if getattr(p, "main_grad", None) is not None:
            param_ptrs.add(p.main_grad.untyped_storage().data_ptr())
    saved = {}  # storage data_ptr -> (nbytes, shape, dtype) of the first tensor saved from it

    def pack(t):
        st = t.untyped_storage()
        ptr = st.data_ptr()
        if ptr and ptr not in param_ptrs and ptr not in saved:
            saved[ptr] = (st.nbytes(), tuple(t.shape), str(t.dtype).replace("torch.", ""))
        return t

    on_cuda = trainer.device.type == "cuda"
    if on_cuda:
        torch.cuda.reset_peak_memory_stats()
    rss_before = _rss_now()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        metrics = trainer.train_step()
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
        "activation_bytes": sum(v[0] for v in saved.values()),
        "saved_storages": len(saved),
        "peak_bytes": int(peak),
        "peak_kind": "cuda max_memory_allocated" if on_cuda else "peak RSS",
        "rss_growth_bytes": None if on_cuda else max(0, int(peak) - rss_before),
        "lm_loss": metrics["lm loss"],
        "largest": sorted(([n, list(s), dt] for n, s, dt in saved.values()), reverse=True)[:int(os.environ.get("CP_EXT_MEASURE_TOP", "12"))],
    }
    trainer.shutdown()
    del cp_state
    return record


def _worker(argv):
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    known, rest = p.parse_known_args(argv)
    import faulthandler

    import torch

    faulthandler.dump_traceback_later(int(os.environ.get("CP_EXT_MEASURE_TIMEOUT", "540")), exit=True)  # a hang shows where
    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    record = measure(rest, world)
    Path(known.out, f"rank{record['rank']}.json").write_text(json.dumps(record))


def run(cp, trainer_flags, ulysses_size=None, timeout=600):
    """Launch one measurement on `cp` ranks with --context-parallel-size cp; returns per-rank records."""
    out = Path(tempfile.mkdtemp(prefix="cp_ext_mem_"))
    flags = list(trainer_flags) + ["--context-parallel-size", str(cp)]
    if ulysses_size and cp > 1:
        flags += ["--ulysses-size", str(ulysses_size)]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={cp}",
           str(Path(__file__).resolve()), "--worker", "--out", str(out), *flags]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")])
    # A session of its own, so a timeout kills torchrun *and* its ranks (no orphans).
    child = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO_ROOT,
                             start_new_session=True)
    try:
        stdout, stderr = child.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        child.communicate()
        raise RuntimeError(f"{' '.join(cmd)} did not finish within {timeout} s")
    proc = subprocess.CompletedProcess(cmd, child.returncode, stdout, stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}")
    records = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]
    if len(records) != cp:
        raise RuntimeError(f"expected {cp} rank records, got {len(records)}\n{proc.stderr[-4000:]}")
    return sorted(records, key=lambda r: r["rank"])


def compare(cp, trainer_flags, ulysses_size=None):
    """CP=1 and CP=cp records plus the per-rank activation ratio (max over ranks / CP=1)."""
    base = run(1, trainer_flags)
    split = run(cp, trainer_flags, ulysses_size)
    ratio = max(r["activation_bytes"] for r in split) / base[0]["activation_bytes"]
    return base, split, ratio


def _mib(n):
    return f"{n / 2**20:10.2f} MiB"


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        return _worker(argv[1:])
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cp", type=int, default=2, help="N: the CP size compared with CP=1 (N ranks)")
    p.add_argument("--ulysses-size", type=int, default=None, help="U for the CP=N run (default 1: ring)")
    p.add_argument("--max-ratio", type=float, default=1.15, help="fail when ratio > this / N")
    p.add_argument("--json", default=None, help="also write all records here")
    p.add_argument("--verbose", action="store_true", help="print each rank's largest saved storages")
    p.add_argument("trainer_flags", nargs=argparse.REMAINDER,
                   help="after --: trainer flags (default: the attention-heavy preset)")
    args = p.parse_args(argv)
    flags = [f for f in args.trainer_flags if f != "--"] or ATTN_HEAVY
    base, split, ratio = compare(args.cp, flags, args.ulysses_size)
    print(f"config: {' '.join(flags)}")
    print(f"{'run':>8s} {'rank':>4s} {'tokens':>7s} {'activations saved':>18s} {'peak (' + base[0]['peak_kind'] + ')':>26s} {'RSS growth':>15s}")
    for r in base + split:
        growth = _mib(r["rss_growth_bytes"]) if r["rss_growth_bytes"] is not None else "-"
        print(f"{'CP=' + str(r['cp']):>8s} {r['rank']:>4d} {r['tokens']:>7d} {_mib(r['activation_bytes']):>18s} "
              f"{_mib(r['peak_bytes']):>26s} {growth:>15s}")
        if args.verbose:
            for n, shape, dt in r["largest"]:
                print(f"           {n:>12d} B {dt:8s} {shape}")
    bound = args.max_ratio / args.cp
    ok = ratio <= bound
    print(f"per-rank activation bytes, CP={args.cp} / CP=1 = {ratio:.4f} (1/N = {1 / args.cp:.4f}; "
          f"bound {args.max_ratio}/N = {bound:.4f}: {'OK' if ok else 'EXCEEDED'})")
    if args.json:
        Path(args.json).write_text(json.dumps({"cp1": base, "cpN": split, "ratio": ratio}, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
