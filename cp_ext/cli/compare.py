"""``cp-ext-compare RUN_A RUN_B [--tolerance 1e-5] [--band 0.01] [--plot out.png]``: compare two
training runs' loss curves iteration by iteration; pass or fail on a tolerance.

The same command as ``python tools/compare_loss_curves.py`` (its docstring gives the full usage).
RUN_A and RUN_B are each a metrics.jsonl (or a run directory holding one), an offline wandb run, or an
online wandb run path entity/project/run_id. Exit status: 0 the curves agree (or stay within
--band), 1 they do not, 2 bad input (one ``compare_loss_curves.py: error:`` line on stderr).
"""

import argparse
import math
import sys

from cp_ext.compare.curves import (DEFAULT_KEY, InputError, band_check, compare, compare_metrics,
                                         load_curve, ranges)
from cp_ext.compare.report import EXIT_BAD_INPUT, plot, report, require_matplotlib

# Every usage and error line starts with the tool's name, also under cp-ext-compare: scripts and
# tests match "compare_loss_curves.py: error:".
PROG = "compare_loss_curves.py"


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
        prog=PROG,
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
    """Exit status: 0 agree (or within --band), 1 differ, 2 bad input (argparse exits 2 itself)."""
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
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print("\n".join(lines + [verdict]), flush=True)
    return status
