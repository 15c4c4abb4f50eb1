"""Checkpoint cost as training sees it: how long each kind of save holds training up, side by side in one
run (tools/bench_checkpoint.py is the front end).

Each rank builds the real Trainer once per mode, trains, and saves ``repeats`` times. Per save:

- **held**: the time the save call keeps the training loop waiting (Megatron-LM's "save-checkpoint" timer):
  the whole write for a synchronous save; for ``--async-save``, building the state and forking the writer;
- **next iteration**: the iteration trained while a background write runs, against a plain one (the
  fork's copy-on-write pages and the writer share the cores with training);
- **rest of the write**: what `Checkpointer.finish` still waits for after that iteration;
- the bytes each rank's files hold, for fully parallel save and without it.

The optimizer kinds (the distributed optimizer against megatron's plain one) are compared as before:
save and load seconds, and bytes per rank.
"""

import json
import os
import shutil
import statistics
import time
from pathlib import Path

# mode: the flags it adds, and how its save is called
SAVE_MODES = {
    "synchronous": ([], "save"),
    "async (--async-save)": (["--async-save"], "save"),
    "async, constant structure": (["--async-save", "--ckpt-assume-constant-structure"], "save"),
    "sync, not fully parallel": (["--no-ckpt-fully-parallel-save"], "save"),
    "non-persistent local": (["--non-persistent-ckpt-type", "local", "--non-persistent-save-interval", "1000000",
                              "--non-persistent-local-ckpt-dir", "{local}"], "local"),
    "non-persistent local, async": (["--non-persistent-ckpt-type", "local", "--non-persistent-save-interval",
                                     "1000000", "--non-persistent-local-ckpt-dir", "{local}", "--async-save"], "local"),
}
OPTIMIZER_KINDS = {"adam": [], "distributed-adam": ["--use-distributed-optimizer"]}


def _timed(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _rank_bytes(directory, rank):
    """What ``rank`` wrote into the newest checkpoint under ``directory`` (or into ``directory`` itself)."""
    iterations = sorted(Path(directory).glob("iter_[0-9]*[0-9]"))
    newest = iterations[-1] if iterations else Path(directory)
    return sum(f.stat().st_size for f in newest.glob(f"__{rank}_*.distcp"))


def measure_saves(flags, repeats, root, rank):
    """{mode: per-save figures} on this rank (collective: every rank runs the same modes)."""
    import torch.distributed as dist

    from cp_ext.arguments import parse_args
    from cp_ext.training.trainer import Trainer

    results = {}
    for mode, (extra, call) in SAVE_MODES.items():
        local = Path(root) / "local"
        save = Path(root) / mode.replace(" ", "_").replace(",", "").replace("(", "").replace(")", "")
        mode_flags = [f.format(local=local) for f in extra]
        trainer = Trainer(parse_args(flags + mode_flags + ["--save", str(save)]))
        plain = [_timed(trainer.train_step) for _ in range(2)]  # the first one warms up
        figures = {"held_s": [], "next_iteration_s": [], "rest_of_write_s": [], "plain_iteration_s": plain[-1]}
        for _ in range(repeats):
            dist.barrier()
            if call == "local":
                held = _timed(trainer.checkpointer.save_local)
            else:
                held = _timed(lambda: trainer.checkpointer.save(save, wait=False))
            figures["held_s"].append(held)
            figures["next_iteration_s"].append(_timed(trainer.train_step))
            figures["rest_of_write_s"].append(_timed(trainer.checkpointer.finish))
            figures["plain_iteration_s"] = min(figures["plain_iteration_s"], _timed(trainer.train_step))
        dist.barrier()
        figures["rank_bytes"] = (_rank_bytes(save, rank) if call == "save"
                                 else sum(f.stat().st_size for f in (local / str(rank)).glob("*.pt")))
        results[mode] = figures
        dist.barrier()
        if rank == 0:
            shutil.rmtree(save, ignore_errors=True)
            shutil.rmtree(local, ignore_errors=True)
    return results


def measure_optimizer_kinds(flags, repeats, root, rank):
    """{kind: save and load seconds, bytes} for the plain and the distributed optimizer."""
    import torch.distributed as dist

    from cp_ext.arguments import parse_args
    from cp_ext.training.trainer import Trainer

    def build(kind, *extra):
        return Trainer(parse_args(flags + OPTIMIZER_KINDS[kind] + list(extra)))

    results = {kind: {"save_s": [], "load_s": []} for kind in OPTIMIZER_KINDS}
    for repeat in range(repeats):
        for kind in (OPTIMIZER_KINDS if repeat % 2 == 0 else reversed(list(OPTIMIZER_KINDS))):
            trainer = build(kind)
            trainer.train_step()  # Adam's state exists
            directory = Path(root) / f"{kind}-{repeat}"
            dist.barrier()
            results[kind]["save_s"].append(_timed(lambda: trainer.checkpointer.save(directory)))
            dist.barrier()
            start = time.perf_counter()
            build(kind, "--load", str(directory))
            built_and_loaded = time.perf_counter() - start
            dist.barrier()
            # the same build without loading: subtracted, leaving the load itself
            results[kind]["load_s"].append(built_and_loaded - _timed(lambda: build(kind)))
            iteration = next(directory.glob("iter_*"))
            results[kind]["rank_bytes"] = _rank_bytes(iteration, rank)
            results[kind]["total_bytes"] = sum(f.stat().st_size for f in iteration.rglob("*") if f.is_file())
            dist.barrier()
            if rank == 0:
                shutil.rmtree(directory, ignore_errors=True)
    return results


def worker(flags, repeats, out, parts=("saves", "optimizers")):
    """One rank of the benchmark: both measurements, written to ``out/rank<r>.json``. The checkpoints go
    under ``out`` too (the ranks share this machine's disk)."""
    import torch

    from cp_ext.arguments.checkpointing import has_local_checkpoints

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    if not has_local_checkpoints():  # the local modes need nvidia-resiliency-ext
        for mode in [m for m, (extra, _) in SAVE_MODES.items() if "local" in extra]:
            del SAVE_MODES[mode]
    root = Path(out, "checkpoints")
    measures = {"saves": measure_saves, "optimizers": measure_optimizer_kinds}
    results = {part: measures[part](flags, repeats, root, rank) for part in parts}
    Path(out, f"rank{rank}.json").write_text(json.dumps(results))


def report(ranks, repeats):
    """The tables, from every rank's figures (the slowest rank sets each figure, as it holds the others)."""
    lines = []
    if "saves" in ranks[0]:
        lines += _saves_table([r["saves"] for r in ranks], repeats)
    if "optimizers" in ranks[0]:
        lines += _optimizers_table([r["optimizers"] for r in ranks], repeats)
    return "\n".join(lines)


def _saves_table(saves, repeats):
    lines = []
    sync_held = statistics.median(max(s["synchronous"]["held_s"][i] for s in saves) for i in range(repeats))
    lines.append(f"{'save':<30}{'held s':>8}{'÷ sync':>8}{'iteration s':>13}{'next it. s':>12}{'rest s':>8}"
                 f"{'cost ÷ sync':>13}  MiB per rank")
    for mode in saves[0]:
        held = statistics.median(max(s[mode]["held_s"][i] for s in saves) for i in range(repeats))
        following = statistics.median(max(s[mode]["next_iteration_s"][i] for s in saves) for i in range(repeats))
        rest = statistics.median(max(s[mode]["rest_of_write_s"][i] for s in saves) for i in range(repeats))
        plain = max(s[mode]["plain_iteration_s"] for s in saves)
        per_rank = " ".join(f"{s[mode]['rank_bytes'] / 2**20:.1f}" for s in saves)
        cost = held + max(0.0, following - plain) + rest  # what training lost to this save, all told
        lines.append(f"{mode:<30}{held:>8.3f}{held / sync_held:>8.3f}{plain:>13.3f}{following:>12.3f}{rest:>8.3f}"
                     f"{cost / sync_held:>13.3f}  {per_rank}")
    if len(saves[0]) < len(SAVE_MODES):
        lines.append("(the non-persistent local modes need nvidia-resiliency-ext: pip install nvidia-resiliency-ext)")
    lines.append("held: the save call's time (the loop waits); iteration: a plain one; next it.: the one trained "
                 "while the background write runs; rest: what the write still took after it; cost: held + the next "
                 "iteration's slowdown + rest")
    return lines


def _optimizers_table(kinds, repeats):
    lines = [""]
    lines.append(f"{'optimizer':<18}{'save s':>8}{'load s':>8}{'total MiB':>11}  bytes per rank (MiB; share)")
    for kind in OPTIMIZER_KINDS:
        save = statistics.median(max(k[kind]["save_s"][i] for k in kinds) for i in range(repeats))
        load = statistics.median(max(k[kind]["load_s"][i] for k in kinds) for i in range(repeats))
        total = kinds[0][kind]["total_bytes"]
        shares = " ".join(f"{k[kind]['rank_bytes'] / 2**20:.2f} ({k[kind]['rank_bytes'] / total:.2f})" for k in kinds)
        lines.append(f"{kind:<18}{save:>8.2f}{load:>8.2f}{total / 2**20:>11.2f}  {shares}")
    return lines
