"""Megatron-style iteration lines, the format users' scripts grep:

 iteration       25/     100 | consumed samples:          100 | elapsed time per iteration (ms): 812.3 |
 learning rate: 2.900000E-03 | global batch size:     4 | lm loss: 5.123456E+00 |
 load balancing loss: 1.012345E+00 | grad norm: 1.234 | tokens per second: 1261.0 | eta: 0:01:02 |

(one line per --log-interval iterations; losses with 7 significant digits, averaged over
the iterations since the last line.)
"""

import sys
from datetime import timedelta

from cp_ext.console import is_rank_0
from cp_ext.training.metric_names import DYNAMIC_CP_PREFIX


class IterationLog:
    """Accumulates per-iteration metrics and prints one line every `log_interval` iterations."""

    FIRST = ("lm loss", "load balancing loss")  # then any other MoE loss the router tracks (z loss, ...)

    def __init__(self, args, tokens_per_iteration, stream=None):
        self.args = args
        self.tokens_per_iteration = tokens_per_iteration
        self.stream = stream or sys.stdout
        self._reset()

    def _reset(self):
        self.sums, self.count, self.elapsed, self.tokens = {}, 0, 0.0, 0

    def record(self, iteration, consumed_samples, elapsed_s, metrics):
        self.count += 1
        self.elapsed += elapsed_s
        # dynamic CP trains on the step's documents, a count of their own (no padding to --seq-length)
        self.tokens += metrics.get(f"{DYNAMIC_CP_PREFIX}tokens", self.tokens_per_iteration)
        for key in metrics:
            if key.endswith(" loss"):
                self.sums[key] = self.sums.get(key, 0.0) + metrics[key]
        if iteration % self.args.log_interval and iteration != self.args.train_iters:
            return None
        line = self.format(iteration, consumed_samples, metrics)
        if is_rank_0():
            print(line, file=self.stream, flush=True)
        self._reset()
        return line

    def format(self, iteration, consumed_samples, metrics):
        args = self.args
        per_iter = self.elapsed / max(self.count, 1)
        parts = [
            f" iteration {iteration:8d}/{args.train_iters:8d}",
            f"consumed samples: {consumed_samples:12d}",
            f"elapsed time per iteration (ms): {per_iter * 1000:.1f}",
            f"learning rate: {metrics['learning rate']:.6E}",
            f"global batch size: {args.global_batch_size:5d}",
        ]
        ordered = [k for k in self.FIRST if k in self.sums] + sorted(k for k in self.sums if k not in self.FIRST)
        for key in ordered:
            parts.append(f"{key}: {self.sums[key] / self.count:.6E}")
        if metrics.get("grad norm") is not None:
            parts.append(f"grad norm: {metrics['grad norm']:.3f}")
        dynamic = {k[len(DYNAMIC_CP_PREFIX):]: v for k, v in metrics.items() if k.startswith(DYNAMIC_CP_PREFIX)}
        if dynamic:  # this iteration's plan (`cp_ext.training.dynamic_batches.StepPlan.metrics`)
            sizes = " ".join(f"{k.rsplit(' ', 1)[1]}:{v}" for k, v in dynamic.items() if k.startswith("documents at size"))
            parts.append(f"dynamic cp documents per size: {sizes}")
            parts.append(f"dynamic cp work max/mean: {dynamic['work max/mean']:.3f}")
            parts.append(f"dynamic cp K/V exchange vs static cp: {dynamic['exchange vs static']:.2f}x")
        if metrics.get("skipped"):
            parts.append("skipped iterations: 1")
        parts.append(f"tokens per second: {self.tokens / max(self.elapsed, 1e-9):.1f}")
        remaining = (args.train_iters - iteration) * per_iter
        parts.append(f"eta: {timedelta(seconds=round(remaining))}")
        return " | ".join(parts) + " |"
