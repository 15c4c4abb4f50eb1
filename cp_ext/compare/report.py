"""The report of a loss-curve comparison (`cp_ext.compare.curves`): the summary lines, which
metric moved first and what that points at, the PASS/FAIL verdict with its exit status, and the PNG
plot. No torch; matplotlib is imported only when a plot is asked for.
"""

import importlib
import math
from pathlib import Path

from cp_ext.compare.curves import InputError, ranges
from cp_ext.training.metric_names import AUX_KEY, LM_KEY  # the names the trainer logs under

EXIT_AGREE, EXIT_DISAGREE, EXIT_BAD_INPUT = 0, 1, 2


def pct(x):
    return f"{100 * x:.3g}%"


def tolerance_text(tolerance, atol):
    """How a point agrees, as the report and the verdict say it."""
    return f"rel tolerance {tolerance:g}" + (f" or abs tolerance {atol:g}" if atol is not None else "")


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
    bound = tolerance_text(tolerance, atol)
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
    bound = tolerance_text(tolerance, atol)
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
    try:  # imported, not just looked up: a matplotlib that is present but broken is refused here too
        importlib.import_module("matplotlib")
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
