#!/usr/bin/env python
"""Compare two training runs' loss curves iteration by iteration; pass or fail on a tolerance.

    python tools/compare_loss_curves.py RUN_A RUN_B [--tolerance 1e-5] [--band 0.01] [--plot out.png]

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

Where the curves part, the report names the first iteration past the tolerance and compares
every other metric the two runs both log (timing and memory aside) the same way, to say which
one moved first: the MoE load-balancing (aux) loss before the LM loss points at a flipped
top-k routing decision (rounding on the router), the LM loss first at attention or data.

--band REL judges long runs whose curves part by rounding (MoE routing, bf16): from the first
iteration past the tolerance on, an exponential moving average (weight --band-ema, default
0.9) of each curve must stay within REL relative of the other's. The verdict then says
"PASS (by the band, not strictly)" (exit 0) or FAIL (exit 1).

Exit status: 0 the curves agree (or stay within --band), 1 they do not, 2 bad input: a
missing or unreadable run, a malformed metrics.jsonl (invalid JSON before its last line,
non-UTF-8 bytes, an iteration that is not a non-negative integer, a metric value that is not
a number or null), an unknown key, no common iteration, a tolerance that is not a finite
number >= 0, or a --plot that cannot be written. The plot is written before the verdict line.
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

from cp_ext.training.metric_names import AUX_KEY, LM_KEY  # the names the trainer logs under

DEFAULT_KEY = LM_KEY
EXIT_AGREE, EXIT_DISAGREE, EXIT_BAD_INPUT = 0, 1, 2
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
class Band:
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
    return Band(band, weight, start, its, rel, ema_a, ema_b, outside)


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


def pct(x):
    return f"{100 * x:.3g}%"


# ---------------------------------------------------------------- which metric moved first

def _is_aux(key):
    return "load_balancing" in key or "aux_loss" in key


def _is_lr(key):
    return "learning_rate" in key or key.rsplit("/", 1)[-1] == "lr"


def divergence_report(metrics, tolerance, atol):
    """Lines naming each shared metric's first iteration past the tolerance, which one moved
    first, and what that points at. [] when every shared metric agrees everywhere."""
    firsts = {k: c.first_divergence for k, c in metrics.items()}
    # by iteration; metrics leaving at the same iteration, the farthest first
    moved = sorted((i, -metrics[k].at(i)[2] if not math.isnan(metrics[k].at(i)[2]) else -math.inf, k)
                   for k, i in firsts.items() if i is not None)
    moved = [(i, k) for i, _, k in moved]
    if not moved:
        return []
    bound = f"rel tolerance {tolerance:g}" + (f" or abs tolerance {atol:g}" if atol is not None else "")
    width = max(len(k) for k in metrics)
    lines = [f"per metric, first iteration past {bound} ({len(metrics)} metrics both runs log):"]
    for k in [k for _, k in moved] + sorted(k for k, i in firsts.items() if i is None):
        c, i = metrics[k], firsts[k]
        if i is None:
            worst = max((r for r in c.rel_diff if not math.isnan(r)), default=0.0)
            lines.append(f"  {k:<{width}}  never        (max rel diff {worst:.2e})")
        else:
            a, b, r = c.at(i)
            lines.append(f"  {k:<{width}}  iteration {i:<3} rel diff {r:.2e} (A {a:.9g}, B {b:.9g})")
    first = moved[0][0]
    together = [k for i, k in moved if i == first]
    if len(together) == 1:
        lines.append(f"moved first: {together[0]} (iteration {first})")
    else:
        lines.append(f"moved first: {', '.join(together)} together (iteration {first})")
    hint = _hint(metrics, firsts, first)
    if hint:
        lines.append("hint: " + hint)
    return lines


def _hint(metrics, firsts, first):
    lr = [k for k in metrics if _is_lr(k) and firsts[k] == first]
    if lr:
        return (f"{lr[0]} differs (iteration {first}): the runs do not follow the same learning-rate "
                f"schedule (--lr, --min-lr, --lr-warmup-iters, --lr-decay-iters/--train-iters); "
                f"compare runs of one configuration")
    aux = next((k for k in (AUX_KEY, *sorted(metrics)) if k in metrics and _is_aux(k)), None)
    lm = LM_KEY if LM_KEY in metrics else None
    if aux is None or lm is None:
        return None
    i_aux, i_lm = firsts[aux], firsts[lm]
    routing = ("points at a flipped top-k routing decision: a rounding-sized difference in the router's "
               "logits sends a token to another expert, and the runs train on from there as two slightly "
               "different trainings (expected for a MoE model across grids or precisions; judge long runs "
               "with --band)")
    attention = ("points at attention or data: what the tokens see differs (attention masks, the CP "
                 "exchange, sample order or content), not the router")
    if i_aux is not None and (i_lm is None or i_aux < i_lm):
        return f"the aux (load-balancing) loss left tolerance before the LM loss: {routing}"
    if i_lm is not None and (i_aux is None or i_lm < i_aux):
        return f"the LM loss left tolerance before the aux (load-balancing) loss: {attention}"
    if i_aux is None:
        return None
    # the same logged iteration: the one that moved more is the likelier origin
    r_aux, r_lm = metrics[aux].at(i_aux)[2], metrics[lm].at(i_lm)[2]
    if r_aux >= 3 * r_lm:
        return (f"the aux (load-balancing) and LM losses left tolerance at the same iteration {i_aux}, the aux "
                f"loss {r_aux / max(r_lm, 1e-300):.3g}x as far (rel {r_aux:.1e} vs {r_lm:.1e}): this {routing}")
    if r_lm >= 3 * r_aux:
        return (f"the LM and aux (load-balancing) losses left tolerance at the same iteration {i_lm}, the LM "
                f"loss {r_lm / max(r_aux, 1e-300):.3g}x as far (rel {r_lm:.1e} vs {r_aux:.1e}): this {attention}")
    return (f"the LM and aux (load-balancing) losses left tolerance together at iteration {i_lm} by similar "
            f"amounts (rel {r_lm:.1e} and {r_aux:.1e})"
            + (": from the first iteration on, which points at different data, initialisation or configuration"
               if i_lm == min(metrics[lm].iterations) else ""))


# ---------------------------------------------------------------- report

def report(curve_a, curve_b, key, cmp, tolerance, atol, allow_partial, metrics=None, band=None):
    """The report's lines, its verdict line and the exit status (0 agree, 1 not)."""
    lines = []
    for name, c in (("A", curve_a), ("B", curve_b)):
        extra = f", {c.duplicates} repeated iterations (last value kept)" if c.duplicates else ""
        lines.append(f"{name}: {c.source} [{c.kind}: {c.location}] {len(c.values)} iterations{extra}")
    lines.append(f"key: {key}")
    its = cmp.iterations
    lines.append(f"aligned iterations: {len(its)} ({ranges(its)})")
    lines.append(f"only in A: {ranges(cmp.only_a)}")
    lines.append(f"only in B: {ranges(cmp.only_b)}")
    non_finite = set(cmp.non_finite)
    finite = [k for k, i in enumerate(its) if i not in non_finite]
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
    bound = f"rel tolerance {tolerance:g}" + (f" or abs tolerance {atol:g}" if atol is not None else "")
    if cmp.first_divergence is not None:
        i = cmp.first_divergence
        a, b, r = cmp.at(i)
        lines.append(f"first divergence: iteration {i} ({key}: A {a:.9g}, B {b:.9g}, rel diff {r:.2e})")
        if i == its[0] and i <= 1:
            lines.append(f"note: {key} differs at the first iteration, before any update: not drift, the runs "
                         f"differ in data, initialisation or configuration (a band cannot tell that from drift)")
    if metrics:
        detail = divergence_report(metrics, tolerance, atol)
        if detail:
            lines.extend(detail)
        else:
            lines.append(f"other metrics: {', '.join(k for k in metrics if k != key) or 'none'} "
                         f"within {bound} at every aligned iteration")
    if band is not None:
        w, r = band.worst
        lines.append(f"band: EMA weight {band.weight:g} (about {1 / (1 - band.weight):.3g} iterations), "
                     f"relative band {band.band:g} ({pct(band.band)}), judged from iteration {band.start} "
                     f"to {band.iterations[-1]}: max EMA rel diff {r:.3e} ({pct(r)}) at iteration {w}"
                     + (f"; outside the band at {len(band.outside)} iterations ({ranges(band.outside)})"
                        if band.outside else ""))

    reasons = []
    if cmp.failing:
        reasons.append(f"{len(cmp.failing)} of {len(its)} iterations exceed {bound} "
                       f"(first at iteration {cmp.failing[0]}; failing: {ranges(cmp.failing)})")
    if cmp.non_finite:
        reasons.append(f"{len(cmp.non_finite)} non-finite values")
    coverage = (cmp.only_a or cmp.only_b) and not allow_partial
    if coverage:
        reasons.append("the runs cover different iterations (--allow-partial compares the overlap only)")
    if not reasons:
        return lines, f"PASS: {len(its)} iterations agree, max rel diff {max_rel:.3e} <= {bound}", EXIT_AGREE
    if band is not None and not band.outside and not cmp.non_finite and not coverage:
        w, r = band.worst
        return lines, (f"PASS (by the band, not strictly): {reasons[0]}; but from iteration {band.start} on the "
                       f"EMA-smoothed curves stay within the {pct(band.band)} band (max {pct(r)} at iteration {w})"
                       ), EXIT_AGREE
    if band is not None and band.outside:
        w, r = band.worst
        reasons.append(f"outside the {pct(band.band)} band: the EMA-smoothed curves part by {pct(r)} at "
                       f"iteration {w} ({len(band.outside)} of {len(band.iterations)} iterations from "
                       f"{band.start} on, first at iteration {band.outside[0]})")
    return lines, "FAIL: " + "; ".join(reasons), EXIT_DISAGREE


# ---------------------------------------------------------------- plot

def require_matplotlib():
    try:
        import matplotlib  # noqa: F401, PLC0415
    except ImportError:
        raise InputError("--plot needs the matplotlib package, which is not installed "
                         "(pip install matplotlib, or pip install -e '.[dev]')")


def plot(curve_a, curve_b, key, cmp, out, band=None):
    """Write the PNG; any failure is an InputError (exit 2), never a traceback."""
    try:
        _plot(curve_a, curve_b, key, cmp, out, band)
    except ImportError as e:
        raise InputError(f"--plot {out}: matplotlib could not be loaded ({e})")
    except (OSError, ValueError, RuntimeError) as e:
        raise InputError(f"--plot {out}: could not write the plot ({type(e).__name__}: {e})")


def _plot(curve_a, curve_b, key, cmp, out, band):
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
    import matplotlib.ticker  # noqa: PLC0415

    panels = 3 if band is not None else 2
    fig, axes = plt.subplots(panels, 1, figsize=(9, 7 if panels == 2 else 9), sharex=True,
                             gridspec_kw={"height_ratios": [2, 1, 1][:panels]})
    try:
        top, bottom = axes[0], axes[1]
        for c, style, name in ((curve_a, "-", "A"), (curve_b, "--", "B")):
            its = sorted(c.values)
            top.plot(its, [c.values[i] for i in its], style, label=f"{name}: {c.source}")
        if band is not None:
            top.plot(cmp.iterations, band.ema_a, color="tab:blue", alpha=0.45, linewidth=3, label=f"A, EMA {band.weight:g}")
            top.plot(cmp.iterations, band.ema_b, color="tab:orange", alpha=0.45, linewidth=3, label=f"B, EMA {band.weight:g}")
        top.set_ylabel(key)
        top.set_title(f"{key}: A vs B")
        top.grid(alpha=0.3)
        diff = [b - a for a, b in zip(cmp.a, cmp.b)]
        bottom.plot(cmp.iterations, diff, color="tab:red", label="B - A")
        bottom.axhline(0.0, color="black", linewidth=0.5)
        bottom.set_ylabel("B - A")
        bottom.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
        bottom.grid(alpha=0.3)
        first = cmp.first_divergence
        if first is not None:
            for ax in axes:
                ax.axvline(first, color="gray", linestyle=":", linewidth=1)
            top.plot([], [], color="gray", linestyle=":", label=f"first divergence (iteration {first})")
        top.legend(fontsize=8)
        bottom.legend(fontsize=8)
        if band is not None:
            ax = axes[2]
            ax.plot(band.iterations, [100 * r for r in band.rel], color="tab:purple",
                    label=f"|EMA(A) - EMA(B)| / max, from iteration {band.start}")
            ax.axhline(100 * band.band, color="tab:red", linestyle="--", label=f"band {pct(band.band)}")
            ax.set_ylabel("EMA rel diff (%)")
            ax.set_ylim(bottom=0)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        axes[-1].set_xlabel("iteration")
        axes[-1].xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
        fig.tight_layout()
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, dpi=100)
    finally:
        plt.close(fig)


# ---------------------------------------------------------------- CLI

def _float_flag(low=0.0, below=None, text=">= 0"):
    """argparse type: a finite float >= low (and < below); nan, inf and negatives are refused."""
    def parse(raw):
        try:
            value = float(raw)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{raw!r} is not a number")
        if not math.isfinite(value) or value < low or (below is not None and value >= below):
            raise argparse.ArgumentTypeError(f"must be a finite number {text}, got {raw}")
        return value
    return parse


def build_parser():
    p = argparse.ArgumentParser(
        prog="compare_loss_curves.py",
        description="Compare two runs' loss curves by iteration (metrics.jsonl, offline wandb run, or "
                    "online wandb run path entity/project/run_id). Exit 0 agree (or within --band), "
                    "1 differ, 2 bad input.")
    p.add_argument("run_a", metavar="RUN_A")
    p.add_argument("run_b", metavar="RUN_B")
    p.add_argument("--key", "--metric", dest="key", default=DEFAULT_KEY,
                   help=f"metric to compare, e.g. valid/lm_loss for validation curves (default {DEFAULT_KEY})")
    p.add_argument("--tolerance", type=_float_flag(), default=1e-5, metavar="REL",
                   help="max relative difference |a-b|/max(|a|,|b|) per iteration (default 1e-5)")
    p.add_argument("--atol", type=_float_flag(), default=None,
                   help="also accept a point whose absolute difference is at most this")
    p.add_argument("--allow-partial", action="store_true",
                   help="pass when the overlap agrees even if one run has iterations the other lacks")
    p.add_argument("--band", type=_float_flag(), default=None, metavar="REL",
                   help="for long runs that part by rounding: pass (exit 0, 'PASS (by the band, not strictly)') "
                        "when, from the first iteration past --tolerance on, the two curves' exponential moving "
                        "averages stay within REL relative of each other (e.g. 0.01 = 1%%)")
    p.add_argument("--band-ema", type=_float_flag(0.0, 1.0, "in [0, 1)"), default=None, metavar="W",
                   help="EMA weight for --band: s = W s + (1 - W) x, about 1/(1-W) iterations "
                        "(default 0.9; 0 = no smoothing)")
    p.add_argument("--plot", metavar="OUT.png", default=None,
                   help="write a PNG with both curves and their difference (and the band), before the "
                        "verdict line (needs matplotlib)")
    return p


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.band_ema is not None and args.band is None:
        parser.error("--band-ema applies with --band only")
    weight = 0.9 if args.band_ema is None else args.band_ema
    try:
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
        metrics = compare_metrics(*curves, args.tolerance, args.atol)
        band = band_check(cmp, args.band, weight) if args.band is not None else None
        lines, verdict, status = report(*curves, args.key, cmp, args.tolerance, args.atol, args.allow_partial,
                                        metrics, band)
        if args.plot:  # before the verdict: a PASS/FAIL line always comes with its plot written
            plot(*curves, args.key, cmp, args.plot, band)
            lines.append(f"plot: {args.plot}")
    except (InputError, OSError) as e:
        print(f"compare_loss_curves.py: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print("\n".join(lines + [verdict]), flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
