#!/usr/bin/env python
"""Compare two training runs' loss curves iteration by iteration; pass or fail on a tolerance.

    python tools/compare_loss_curves.py RUN_A RUN_B [--tolerance 1e-5] [--plot out.png]

RUN_A and RUN_B may be any mix of:

* a ``metrics.jsonl`` file, or a run directory holding one (``--log-dir`` of pretrain_moe.py);
* an offline wandb run: its ``run-*.wandb`` file, its ``offline-run-*`` directory, or a
  directory with exactly one run under ``wandb/`` (read with wandb's own reader,
  ``wandb leet inspect --json``; the tool never parses the binary log itself);
* an online wandb run path ``entity/project/run_id`` (or ``wandb:entity/project/run_id``,
  or its ``https://wandb.ai/entity/project/runs/run_id`` URL), read through ``wandb.Api``.

A run directory holding both ``metrics.jsonl`` and a wandb log is read from metrics.jsonl.

The curves are aligned by iteration (wandb's step). The tool prints the number of aligned
iterations, the iterations only one run has, the max and mean absolute and relative
differences, and one PASS/FAIL line. Relative difference is |a - b| / max(|a|, |b|).
A point agrees when its relative difference is <= --tolerance (or its absolute difference
<= --atol, when given); the curves agree when every aligned point does, no value is NaN/inf,
and both runs cover the same iterations (--allow-partial compares the overlap only).

Exit status: 0 the curves agree, 1 they do not, 2 bad input (missing file, unknown key,
no common iteration, unreadable run, --plot without matplotlib).
"""

import argparse
import json
import math
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_KEY = "train/lm_loss"
EXIT_AGREE, EXIT_DISAGREE, EXIT_BAD_INPUT = 0, 1, 2


class InputError(Exception):
    """Bad input: the message says which argument and why (exit status 2)."""


@dataclass
class Curve:
    source: str                     # what the user passed
    kind: str                       # metrics.jsonl | wandb-offline | wandb-online
    location: str                   # the file / run actually read
    values: dict = field(default_factory=dict)   # iteration -> value
    keys: set = field(default_factory=set)       # every metric key seen (for error messages)
    duplicates: int = 0             # iterations logged more than once (the last one wins)


# ---------------------------------------------------------------- readers

def read_metrics_jsonl(path, key, source=None):
    """One JSON object per line with an "iteration" (or wandb's "_step") and the metric keys."""
    path = Path(path)
    curve = Curve(source or str(path), "metrics.jsonl", str(path))
    lines = path.read_text().splitlines()
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            if n == len(lines):  # a run killed mid-write leaves a torn last line
                print(f"warning: {path}:{n}: ignoring a truncated last line", file=sys.stderr)
                continue
            raise InputError(f"{path}:{n}: not valid JSON ({e})")
        if not isinstance(record, dict):
            raise InputError(f"{path}:{n}: expected a JSON object per line")
        step = record.get("iteration", record.get("_step", record.get("step")))
        if step is None:
            raise InputError(f"{path}:{n}: no \"iteration\" field")
        _add_point(curve, int(step), record, key)
    return curve


def _add_point(curve, step, record, key):
    curve.keys.update(k for k in record if not k.startswith("_") and k not in ("iteration", "step"))
    if key not in record or record[key] is None:
        return
    if step in curve.values:
        curve.duplicates += 1
    curve.values[step] = float(record[key])


def find_wandb_log(path):
    """The run-*.wandb file for a .wandb path, a run dir, or a dir with one run under wandb/."""
    path = Path(path)
    if path.is_file():
        return path
    logs = sorted(path.glob("run-*.wandb"))
    if not logs:
        logs = sorted(path.glob("*run-*/run-*.wandb")) + sorted(path.glob("wandb/*run-*/run-*.wandb"))
    if len(logs) == 1:
        return logs[0]
    if not logs:
        raise InputError(f"{path}: no metrics.jsonl and no wandb run (run-*.wandb) in it")
    listing = "\n  ".join(str(p.parent) for p in logs)
    raise InputError(f"{path}: holds {len(logs)} wandb runs; pass one of them:\n  {listing}")


def read_wandb_offline(path, key, source=None):
    """History records of a .wandb transaction log, read by wandb itself (wandb-core's inspector)."""
    log = find_wandb_log(path)
    cmd = [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(log)]
    # Offline + no error reporting: the reader then never tries to reach a W&B server (telemetry).
    env = dict(os.environ, WANDB_SILENT="true", WANDB_MODE="offline", WANDB_ERROR_REPORTING="false")
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise InputError(f"{log}: could not run wandb's log reader ({' '.join(cmd)}): {e}")
    if proc.returncode != 0:
        raise InputError(f"{log}: wandb's log reader failed (exit {proc.returncode}): "
                         f"{(proc.stderr or proc.stdout).strip()[-1000:]}\n"
                         f"(needs wandb >= 0.31 for `wandb leet inspect --json`)")
    curve = Curve(source or str(path), "wandb-offline", str(log))
    for line in proc.stdout.splitlines():
        if '"history"' not in line:
            continue
        record = json.loads(line)
        if record.get("type") != "history":
            continue
        history = record["history"]
        item = history.get("item", {})
        step = history.get("step", {}).get("num", item.get("_step"))
        if step is None:
            continue
        _add_point(curve, int(step), item, key)
    return curve


def read_wandb_online(run_path, key, source=None):
    """An online run's full (unsampled) history through the public API. Needs network + API key."""
    import wandb  # noqa: PLC0415 -- only this input kind needs it

    try:
        run = wandb.Api(timeout=60).run(run_path)
        rows = list(run.scan_history(keys=["_step", key]))  # only rows that have both keys
        known = [] if rows else [k for k in run.summary.keys() if not k.startswith("_")]
    except Exception as e:  # auth, network, unknown run: all "cannot read this input"
        raise InputError(f"wandb run {run_path}: {type(e).__name__}: {e}")
    curve = Curve(source or run_path, "wandb-online", f"wandb:{run_path}")
    curve.keys.update(known)
    for row in rows:
        _add_point(curve, int(row["_step"]), row, key)
    return curve


_WANDB_URL = re.compile(r"^https?://[^/]+/(?P<entity>[^/]+)/(?P<project>[^/]+)/runs/(?P<run>[^/?#]+)")
_WANDB_PATH = re.compile(r"^(?P<entity>[\w.-]+)/(?P<project>[\w.-]+)/(?:runs/)?(?P<run>[A-Za-z0-9_-]+)$")


def wandb_run_path(spec):
    """`entity/project/run_id` for an online run spec, or None when `spec` is not one."""
    if spec.startswith("wandb:"):
        spec = spec[len("wandb:"):]
        m = _WANDB_PATH.match(spec)
        if not m:
            raise InputError(f"{spec!r}: a wandb run path is entity/project/run_id")
    else:
        m = _WANDB_URL.match(spec) or _WANDB_PATH.match(spec)
    return f"{m['entity']}/{m['project']}/{m['run']}" if m else None


def load_curve(spec, key):
    path = Path(spec)
    if path.exists() and not spec.startswith("wandb:"):
        if path.is_dir():
            if (path / "metrics.jsonl").is_file():
                return read_metrics_jsonl(path / "metrics.jsonl", key, source=spec)
            return read_wandb_offline(path, key, source=spec)
        if path.suffix == ".wandb":
            return read_wandb_offline(path, key, source=spec)
        return read_metrics_jsonl(path, key, source=spec)
    run_path = None if spec.startswith((".", "/", "~")) or spec.endswith((".jsonl", ".wandb")) else wandb_run_path(spec)
    if run_path is None:
        raise InputError(f"{spec}: no such file or directory (and not a wandb run path entity/project/run_id)")
    return read_wandb_online(run_path, key, source=spec)


# ---------------------------------------------------------------- comparison

@dataclass
class Comparison:
    iterations: list
    a: list
    b: list
    abs_diff: list
    rel_diff: list
    only_a: list
    only_b: list
    non_finite: list
    failing: list


def compare(curve_a, curve_b, tolerance, atol=None):
    common = sorted(set(curve_a.values) & set(curve_b.values))
    a = [curve_a.values[i] for i in common]
    b = [curve_b.values[i] for i in common]
    abs_diff, rel_diff, non_finite, failing = [], [], [], []
    for i, x, y in zip(common, a, b):
        if not (math.isfinite(x) and math.isfinite(y)):
            non_finite.append(i)
            abs_diff.append(math.nan)
            rel_diff.append(math.nan)
            continue
        d = abs(x - y)
        scale = max(abs(x), abs(y))
        r = d / scale if scale > 0 else 0.0
        abs_diff.append(d)
        rel_diff.append(r)
        if r > tolerance and not (atol is not None and d <= atol):
            failing.append(i)
    return Comparison(common, a, b, abs_diff, rel_diff,
                      sorted(set(curve_a.values) - set(curve_b.values)),
                      sorted(set(curve_b.values) - set(curve_a.values)), non_finite, failing)


def ranges(iterations):
    """[1, 2, 3, 7, 9, 10] -> '1-3, 7, 9-10'."""
    out, start, prev = [], None, None
    for i in iterations:
        if start is None:
            start = prev = i
        elif i == prev + 1:
            prev = i
        else:
            out.append(f"{start}-{prev}" if prev != start else f"{start}")
            start = prev = i
    if start is not None:
        out.append(f"{start}-{prev}" if prev != start else f"{start}")
    return ", ".join(out) if out else "none"


def report(curve_a, curve_b, key, cmp, tolerance, atol, allow_partial):
    """Print the comparison; return the exit status (0 agree, 1 not)."""
    lines = []
    for name, c in (("A", curve_a), ("B", curve_b)):
        extra = f", {c.duplicates} repeated iterations (last value kept)" if c.duplicates else ""
        lines.append(f"{name}: {c.source} [{c.kind}: {c.location}] {len(c.values)} iterations{extra}")
    lines.append(f"key: {key}")
    its = cmp.iterations
    lines.append(f"aligned iterations: {len(its)} ({ranges(its)})")
    lines.append(f"only in A: {ranges(cmp.only_a)}")
    lines.append(f"only in B: {ranges(cmp.only_b)}")
    finite = [k for k, i in enumerate(its) if i not in set(cmp.non_finite)]
    if finite:
        ka = max(finite, key=lambda k: cmp.abs_diff[k])
        kr = max(finite, key=lambda k: cmp.rel_diff[k])
        mean_abs = sum(cmp.abs_diff[k] for k in finite) / len(finite)
        mean_rel = sum(cmp.rel_diff[k] for k in finite) / len(finite)
        lines.append(f"max abs diff:  {cmp.abs_diff[ka]:.6e} (iteration {its[ka]}: A {cmp.a[ka]:.9g}, B {cmp.b[ka]:.9g})")
        lines.append(f"mean abs diff: {mean_abs:.6e}")
        lines.append(f"max rel diff:  {cmp.rel_diff[kr]:.6e} (iteration {its[kr]}: A {cmp.a[kr]:.9g}, B {cmp.b[kr]:.9g})")
        lines.append(f"mean rel diff: {mean_rel:.6e}")
        max_rel = cmp.rel_diff[kr]
    else:
        max_rel = math.nan
    if cmp.non_finite:
        lines.append(f"non-finite values (NaN/inf) at iterations: {ranges(cmp.non_finite)}")
    reasons = []
    bound = f"rel tolerance {tolerance:g}" + (f" or abs tolerance {atol:g}" if atol is not None else "")
    if cmp.failing:
        reasons.append(f"{len(cmp.failing)} of {len(its)} iterations exceed {bound} "
                       f"(first at iteration {cmp.failing[0]}; failing: {ranges(cmp.failing)})")
    if cmp.non_finite:
        reasons.append(f"{len(cmp.non_finite)} non-finite values")
    if (cmp.only_a or cmp.only_b) and not allow_partial:
        reasons.append("the runs cover different iterations (--allow-partial compares the overlap only)")
    if reasons:
        lines.append("FAIL: " + "; ".join(reasons))
        status = EXIT_DISAGREE
    else:
        lines.append(f"PASS: {len(its)} iterations agree, max rel diff {max_rel:.3e} <= {bound}")
        status = EXIT_AGREE
    print("\n".join(lines), flush=True)
    return status


# ---------------------------------------------------------------- plot

def require_matplotlib():
    try:
        import matplotlib  # noqa: F401, PLC0415
    except ImportError:
        raise InputError("--plot needs the matplotlib package, which is not installed "
                         "(pip install matplotlib, or pip install -e '.[dev]')")


def plot(curve_a, curve_b, key, cmp, out):
    import matplotlib  # noqa: PLC0415
    import matplotlib.ticker  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 7), sharex=True,
                                      gridspec_kw={"height_ratios": [2, 1]})
    for c, style, name in ((curve_a, "-", "A"), (curve_b, "--", "B")):
        its = sorted(c.values)
        top.plot(its, [c.values[i] for i in its], style, label=f"{name}: {c.source}")
    top.set_ylabel(key)
    top.set_title(f"{key}: A vs B")
    top.legend(fontsize=8)
    top.grid(alpha=0.3)
    diff = [b - a for a, b in zip(cmp.a, cmp.b)]
    bottom.plot(cmp.iterations, diff, color="tab:red", label="B - A")
    bottom.axhline(0.0, color="black", linewidth=0.5)
    bottom.set_xlabel("iteration")
    bottom.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    bottom.set_ylabel("B - A")
    bottom.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    bottom.grid(alpha=0.3)
    bottom.legend(fontsize=8)
    fig.tight_layout()
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)


# ---------------------------------------------------------------- CLI

def build_parser():
    p = argparse.ArgumentParser(
        prog="compare_loss_curves.py",
        description="Compare two runs' loss curves by iteration (metrics.jsonl, offline wandb run, or "
                    "online wandb run path entity/project/run_id). Exit 0 agree, 1 differ, 2 bad input.")
    p.add_argument("run_a", metavar="RUN_A")
    p.add_argument("run_b", metavar="RUN_B")
    p.add_argument("--key", "--metric", dest="key", default=DEFAULT_KEY,
                   help=f"metric to compare, e.g. valid/lm_loss for validation curves (default {DEFAULT_KEY})")
    p.add_argument("--tolerance", type=float, default=1e-5, metavar="REL",
                   help="max relative difference |a-b|/max(|a|,|b|) per iteration (default 1e-5)")
    p.add_argument("--atol", type=float, default=None,
                   help="also accept a point whose absolute difference is at most this")
    p.add_argument("--allow-partial", action="store_true",
                   help="pass when the overlap agrees even if one run has iterations the other lacks")
    p.add_argument("--plot", metavar="OUT.png", default=None,
                   help="write a PNG with both curves and their difference (needs matplotlib)")
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    try:
        if args.tolerance < 0 or (args.atol is not None and args.atol < 0):
            raise InputError("--tolerance and --atol must be >= 0")
        if args.plot:
            require_matplotlib()
        curves = [load_curve(spec, args.key) for spec in (args.run_a, args.run_b)]
        for name, c in zip("AB", curves):
            if not c.values:
                known = ", ".join(sorted(c.keys)) or "none"
                raise InputError(f"run {name} ({c.source}) has no values for --key {args.key} (keys: {known})")
        cmp = compare(*curves, args.tolerance, args.atol)
        if not cmp.iterations:
            raise InputError(f"the runs share no iteration (A: {ranges(sorted(curves[0].values))}; "
                             f"B: {ranges(sorted(curves[1].values))})")
    except (InputError, OSError) as e:
        print(f"compare_loss_curves.py: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    status = report(*curves, args.key, cmp, args.tolerance, args.atol, args.allow_partial)
    if args.plot:
        plot(*curves, args.key, cmp, args.plot)
        print(f"plot: {args.plot}")
    return status


if __name__ == "__main__":
    sys.exit(main())
