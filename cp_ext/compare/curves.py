"""Two training runs' loss curves, read and compared iteration by iteration (the logic behind
``cp-ext-compare`` / ``tools/compare_loss_curves.py``, whose docstring gives the usage).

A curve is read from a ``metrics.jsonl`` (or a run directory holding one), an offline wandb run
(read with wandb's own reader, ``wandb leet inspect --json``) or an online wandb run path
(``wandb.Api``): `load_curve`. Every malformed input is an `InputError` whose message names the file,
line and key (the front end exits 2 on it). `compare` aligns the judged key of two curves on their
common iterations, `compare_metrics` every metric both runs log, and `band_check` judges the
EMA-smoothed curves from the first divergence on. No torch: reading logs stays light.
"""

import json
import math
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from cp_ext.moved_modules import renamed
from cp_ext.training.metric_names import LM_KEY  # the names the trainer logs under

DEFAULT_KEY = LM_KEY
STEP_FIELDS = ("iteration", "_step", "step")
# Not compared across runs: speed and memory differ between grids by design.
NOT_COMPARED = re.compile(r"tokens_per_second|iteration_time|time_ms|memory|throughput|timestamp|runtime", re.I)


class InputError(Exception):
    """Bad input: the message says which argument and why (exit status 2)."""


@dataclass
class Curve:
    source: str                     # what the user passed
    kind: str                       # metrics.jsonl | wandb-offline | wandb-online
    location: str                   # the file / run actually read
    key: str = DEFAULT_KEY          # the metric judged
    series: dict = field(default_factory=dict)   # metric key -> {iteration: value}
    keys: set = field(default_factory=set)       # every metric key seen (for error messages)
    duplicates: int = 0             # iterations of `key` logged more than once (the last one wins)

    @property
    def values(self):
        """iteration -> value of the judged key."""
        return self.series.get(self.key, {})


# ---------------------------------------------------------------- value checks

def describe(value):
    """A short description of a JSON value for an error message."""
    if isinstance(value, bool):
        return f"a boolean ({json.dumps(value)})"
    if isinstance(value, str):
        text = value if len(value) <= 40 else value[:37] + "..."
        return f"a string ({json.dumps(text)})"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    if value is None:
        return "null"
    return repr(value)


def is_number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def as_iteration(raw, where, name):
    """A step field's value as an int: a non-negative integer (3 or 3.0), nothing else."""
    if not is_number(raw) or (isinstance(raw, float) and not raw.is_integer()) or raw < 0:
        raise InputError(f'{where}: "{name}" must be a non-negative integer, got {describe(raw)}')
    return int(raw)


def as_metric(raw, where, name):
    """A metric value as a float (None: not logged at this iteration)."""
    if raw is None:
        return None
    if not is_number(raw):
        raise InputError(f'{where}: key "{name}" must be a number or null, got {describe(raw)}')
    try:
        return float(raw)
    except OverflowError:
        raise InputError(f'{where}: key "{name}": {raw} is too large for a float')


def _add_record(curve, step, record, where, strict):
    """Add one logged record. strict: every metric must be numeric (metrics.jsonl); else (wandb,
    which also logs media and tables) only the judged key must be, others are skipped."""
    for name, raw in record.items():
        if name.startswith("_") or name in STEP_FIELDS:
            continue
        curve.keys.add(name)
        if not strict and name != curve.key and not is_number(raw):
            continue
        value = as_metric(raw, where, name)
        if value is None:
            continue
        points = curve.series.setdefault(name, {})
        if name == curve.key and step in points:
            curve.duplicates += 1
        points[step] = value


# ---------------------------------------------------------------- readers

def read_metrics_jsonl(path, key, source=None):
    """One JSON object per line with an "iteration" (or wandb's "_step") and numeric metric keys."""
    path = Path(path)
    curve = Curve(source or str(path), "metrics.jsonl", str(path), key)
    data = path.read_bytes()
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise InputError(f"{path}:{line}: not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}); "
                         f"a metrics.jsonl is one JSON object per line")
    lines = text.split("\n")
    last = max((n for n, line in enumerate(lines, 1) if line.strip()), default=0)
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            if n == last:  # a run killed mid-write leaves a torn last line
                print(f"warning: {where}: ignoring a truncated last line (not valid JSON: {e.msg})",
                      file=sys.stderr)
                continue
            raise InputError(f"{where}: not valid JSON ({e})")
        if not isinstance(record, dict):
            raise InputError(f"{where}: expected a JSON object per line, got {describe(record)}")
        name = next((f for f in STEP_FIELDS if f in record), None)
        if name is None:
            raise InputError(f'{where}: no "iteration" field')
        _add_record(curve, as_iteration(record[name], where, name), record, where, strict=True)
    return curve


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
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, errors="replace")
    except (OSError, subprocess.TimeoutExpired) as e:
        raise InputError(f"{log}: could not run wandb's log reader ({' '.join(cmd)}): {e}")
    if proc.returncode != 0:
        raise InputError(f"{log}: wandb's log reader failed (exit {proc.returncode}): "
                         f"{(proc.stderr or proc.stdout).strip()[-1000:]}\n"
                         f"(needs wandb >= 0.31 for `wandb leet inspect --json`)")
    curve = Curve(source or str(path), "wandb-offline", str(log), key)
    for n, line in enumerate(proc.stdout.splitlines(), 1):
        if '"history"' not in line:
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise InputError(f"{log}: wandb's log reader printed a line that is not JSON (record {n}: {e})")
        if not isinstance(record, dict) or record.get("type") != "history":
            continue
        history = record.get("history") or {}
        item = history.get("item") or {}
        if not isinstance(item, dict):
            continue
        step = (history.get("step") or {}).get("num", item.get("_step"))
        if step is None:
            continue
        where = f"{log} (history record {n}, step {step})"
        _add_record(curve, as_iteration(step, where, "_step"), item, where, strict=False)
    return curve


def read_wandb_online(run_path, key, source=None):
    """An online run's full (unsampled) history through the public API. Needs network + API key."""
    try:
        import wandb  # noqa: PLC0415 -- only this input kind needs it
    except ImportError as e:
        raise InputError(f"wandb run {run_path}: reading an online run needs the wandb package ({e})")
    try:
        run = wandb.Api(timeout=60).run(run_path)
        rows = list(run.scan_history())  # every row, every key: the other metrics are compared too
        known = [] if rows else [k for k in run.summary.keys() if not k.startswith("_")]
    except Exception as e:  # auth, network, unknown run: all "cannot read this input"
        raise InputError(f"wandb run {run_path}: {type(e).__name__}: {e}")
    curve = Curve(source or run_path, "wandb-online", f"wandb:{run_path}", key)
    curve.keys.update(known)
    for n, row in enumerate(rows, 1):
        if row.get("_step") is None:
            continue
        where = f"wandb run {run_path} (history row {n})"
        _add_record(curve, as_iteration(row["_step"], where, "_step"), row, where, strict=False)
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

    @property
    def first_divergence(self):
        """The first aligned iteration past the tolerance or non-finite (None: none is)."""
        bad = self.failing + self.non_finite
        return min(bad) if bad else None

    def at(self, iteration):
        k = self.iterations.index(iteration)
        return self.a[k], self.b[k], self.rel_diff[k]


def rel_diff(x, y):
    scale = max(abs(x), abs(y))
    return abs(x - y) / scale if scale > 0 else 0.0


def compare_values(values_a, values_b, tolerance, atol=None):
    """Two {iteration: value} maps, aligned on their common iterations."""
    common = sorted(set(values_a) & set(values_b))
    a = [values_a[i] for i in common]
    b = [values_b[i] for i in common]
    abs_diff, rel, non_finite, failing = [], [], [], []
    for i, x, y in zip(common, a, b):
        if not (math.isfinite(x) and math.isfinite(y)):
            non_finite.append(i)
            abs_diff.append(math.nan)
            rel.append(math.nan)
            continue
        d = abs(x - y)
        r = rel_diff(x, y)
        abs_diff.append(d)
        rel.append(r)
        if r > tolerance and not (atol is not None and d <= atol):
            failing.append(i)
    return Comparison(common, a, b, abs_diff, rel,
                      sorted(set(values_a) - set(values_b)),
                      sorted(set(values_b) - set(values_a)), non_finite, failing)


def compare(curve_a, curve_b, tolerance, atol=None):
    """The judged key of two curves."""
    return compare_values(curve_a.values, curve_b.values, tolerance, atol)


def shared_metrics(curve_a, curve_b):
    """Metric keys both runs log at a common iteration, timing and memory aside."""
    return sorted(k for k in set(curve_a.series) & set(curve_b.series)
                  if not NOT_COMPARED.search(k) and set(curve_a.series[k]) & set(curve_b.series[k]))


def compare_metrics(curve_a, curve_b, tolerance, atol=None):
    """{key: Comparison} for every shared metric, the judged key included."""
    return {k: compare_values(curve_a.series[k], curve_b.series[k], tolerance, atol)
            for k in shared_metrics(curve_a, curve_b)}


def ema(values, weight):
    """Exponential moving average s_t = w s_(t-1) + (1 - w) x_t, s_1 = x_1 (weight 0: no smoothing)."""
    out, s = [], None
    for x in values:
        s = x if s is None else weight * s + (1.0 - weight) * x
        out.append(s)
    return out


@dataclass
class ToleranceBand:
    band: float
    weight: float
    start: int                      # first divergence: the band is judged from here on
    iterations: list                # aligned iterations from `start` on
    rel: list                       # relative difference of the two EMAs there
    ema_a: list                     # EMAs over every aligned iteration (for the plot)
    ema_b: list
    outside: list                   # iterations where the EMAs part by more than `band`

    @property
    def worst(self):
        k = max(range(len(self.rel)), key=lambda k: self.rel[k])
        return self.iterations[k], self.rel[k]


def band_check(cmp, band, weight):
    """The smoothed curves from the first divergence on (None when nothing diverged or a value is
    non-finite: the band judges rounding drift, it cannot excuse NaN)."""
    start = cmp.first_divergence
    if start is None or cmp.non_finite:
        return None
    ema_a, ema_b = ema(cmp.a, weight), ema(cmp.b, weight)
    k0 = cmp.iterations.index(start)
    its = cmp.iterations[k0:]
    rel = [rel_diff(x, y) for x, y in zip(ema_a[k0:], ema_b[k0:])]
    outside = [i for i, r in zip(its, rel) if r > band]
    return ToleranceBand(band, weight, start, its, rel, ema_a, ema_b, outside)


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


def __getattr__(name):  # ToleranceBand was called Band
    return renamed(__name__, name)
