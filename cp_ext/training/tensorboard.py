"""TensorBoard event files with Megatron-LM's scalar names (--tensorboard-dir).

Training, every --tensorboard-log-interval iterations (`training_log` in Megatron-LM's
megatron/training/training.py), each also as ``<name> vs samples`` with the consumed samples as step:

    lm loss              the iteration's token-weighted mean LM loss (metrics.jsonl's train/lm_loss)
    learning-rate        the rate the step used
    batch-size           the global batch size (micro batch x DP x microbatches)
    loss-scale           the optimizer's loss scale (1.0 without fp16, as Megatron writes it)
    grad-norm            when the step computed one
    load_balancing_loss  and every other MoE loss the router tracks (z_loss, seq_load_balancing_loss),
                         under the tracker's names, as megatron's `track_moe_metrics` writes them
    iteration-time       with --log-timers-to-tensorboard: seconds per iteration, averaged over the
                         iterations since the last --log-interval line, written with that line

Evaluation (Megatron-LM's `evaluate_and_print_results`, its ``validation loss at ...`` block):

    lm loss validation       (and ``... vs samples``) at the training iteration
    lm loss validation ppl   with --log-validation-ppl-to-tensorboard: exp(min(20, loss))
    lm loss test (ppl)       the test split at the end of training. Megatron-LM writes the test set
                             under the validation tag, at the same step as the last validation
                             point; apart, neither curve gets a second value at one step.

Written by rank 0, the rank that writes metrics.jsonl and wandb: the trainer all-reduces the last
pipeline stage's loss and the MoE losses to every rank, so rank 0 knows every value (Megatron-LM
writes on the last rank because its loss is known only there); one rank keeps the three records
equal, and the tests compare them. --skip-train writes no events, as in Megatron-LM (a checkpoint's
evaluation is not a point of a training curve); metrics.jsonl still gets its values.

A run starting at iteration 0 moves a previous run's event files to ``previous-<time>/`` (as
metrics.jsonl does; TensorBoard shows that folder as a run of its own). A resumed run appends a new
event file, as Megatron-LM's does: iterations a crashed run logged after its last checkpoint appear twice.
"""

import math
import os
import time
from pathlib import Path

from cp_ext.console import is_rank_0, print_rank_0

# The trainer's metric names that are not MoE losses, and their Megatron-LM TensorBoard names.
TRAIN_SCALARS = {"lm loss": "lm loss", "learning rate": "learning-rate", "loss scale": "loss-scale",
                 "grad norm": "grad-norm"}
EVENT_FILE_PREFIX = "events.out.tfevents."


def scalar_name(metric):
    """The TensorBoard name of a trainer metric: Megatron-LM's for the fixed ones, the MoE tracker's
    for the router's losses (``load balancing loss`` -> ``load_balancing_loss``); None otherwise."""
    if metric in TRAIN_SCALARS:
        return TRAIN_SCALARS[metric]
    return metric.replace(" ", "_") if metric.endswith(" loss") else None


def split_scalar(split):
    """``lm loss validation`` for the valid split, ``lm loss test`` for the test split."""
    return "lm loss validation" if split == "valid" else f"lm loss {split}"


class TensorBoardWriter:
    """Rank 0's SummaryWriter for --tensorboard-dir; every method is a no-op elsewhere or without it."""

    def __init__(self, args, start_iteration=0):
        self.args = args
        self.writer = None
        self.elapsed, self.timed = 0.0, 0
        if not args.tensorboard_dir or not is_rank_0():
            return
        if args.skip_train:
            print_rank_0(f"note: --skip-train writes no TensorBoard events to {args.tensorboard_dir} (as Megatron-LM: "
                         f"an evaluation of a checkpoint is not part of its training curves); the values go to "
                         f"{args.log_dir}/metrics.jsonl")
            return
        from torch.utils.tensorboard import SummaryWriter

        directory = Path(args.tensorboard_dir)
        directory.mkdir(parents=True, exist_ok=True)
        if start_iteration == 0:
            _move_aside_previous_events(directory)
        self.writer = SummaryWriter(log_dir=str(directory), max_queue=args.tensorboard_queue_size)

    def log_train(self, iteration, consumed_samples, metrics, iteration_time_s):
        """One training iteration's scalars (the trainer's metric dict, as metrics.jsonl gets it)."""
        if self.writer is None:
            return
        args = self.args
        if iteration % args.tensorboard_log_interval == 0:
            values = {"batch-size": args.global_batch_size}
            for metric, value in metrics.items():
                name = scalar_name(metric)
                if name is not None and value is not None:
                    values[name] = float(value)
            for name, value in values.items():
                self._add(name, value, iteration, consumed_samples)
        if args.log_timers_to_tensorboard:
            # Megatron-LM writes its timers with the --log-interval line: the mean since the last one.
            self.elapsed += iteration_time_s
            self.timed += 1
            if iteration % args.log_interval == 0 or iteration == args.train_iters:
                self.writer.add_scalar("iteration-time", self.elapsed / self.timed, iteration)
                self.elapsed, self.timed = 0.0, 0

    def log_evaluation(self, iteration, consumed_samples, split, loss):
        """An evaluation's LM loss (and, with --log-validation-ppl-to-tensorboard, its perplexity)."""
        if self.writer is None:
            return
        name = split_scalar(split)
        self._add(name, loss, iteration, consumed_samples)
        if self.args.log_validation_ppl_to_tensorboard:
            self._add(f"{name} ppl", math.exp(min(20.0, loss)), iteration, consumed_samples)
        self.writer.flush()  # evaluations are rare and costly: never lose one to a later crash

    def _add(self, name, value, iteration, consumed_samples):
        self.writer.add_scalar(name, value, iteration)
        self.writer.add_scalar(f"{name} vs samples", value, consumed_samples)

    def close(self):
        """Flush every queued event and close the file (also after an error: `Trainer.train`'s finally)."""
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def _move_aside_previous_events(directory):
    """A run starting at iteration 0 does not mix its curves with another run's in one TensorBoard run."""
    previous = sorted(p for p in directory.iterdir() if p.name.startswith(EVENT_FILE_PREFIX) and p.is_file())
    if not previous:
        return
    aside = directory / time.strftime("previous-%Y%m%d-%H%M%S")
    aside.mkdir(exist_ok=True)
    for path in previous:
        os.replace(path, aside / path.name)
    print_rank_0(f"note: --tensorboard-dir {directory} held another run's event files (this run starts at "
                 f"iteration 0); moved them to {aside}/")
