"""Where a run's numbers go: `metrics.jsonl` in its run directory, and wandb when asked.

One JSON object per iteration (``{"iteration": 3, "train/lm_loss": ..., ...}``), written
by rank 0, which holds every reduced metric (the trainer all-reduces the last pipeline
stage's loss to all ranks). wandb gets the same keys with ``step=iteration``, and
--tensorboard-dir the same values under Megatron-LM's names (`cp_ext.training.tensorboard`).

wandb is best-effort by design: ``WANDB_MODE=offline|disabled`` are wandb's own switches;
``WANDB_DISABLED=true`` (the Hugging Face convention, which wandb itself ignores) is
honoured here; and a failing ``wandb.init`` (no API key, no network) prints one warning
and training goes on with metrics.jsonl alone.
"""

import json
import os
import time
from pathlib import Path

import math

import yaml

from cp_ext.console import is_rank_0, print_rank_0
from cp_ext.platform import memory_bytes
from cp_ext.training.metric_names import metric_key
from cp_ext.training.tensorboard import TensorBoardWriter

class MetricsLogger:
    def __init__(self, args, start_iteration=0):
        self.enabled = is_rank_0()
        self.wandb_run = None
        self.tensorboard = None
        if not self.enabled:
            return
        self.dir = Path(args.log_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / "metrics.jsonl"
        if start_iteration == 0:
            self._move_aside_previous_run()
        else:
            self._truncate_after(start_iteration)
        config = {k: v for k, v in sorted(vars(args).items()) if isinstance(v, (int, float, str, bool, list, type(None)))}
        (self.dir / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=True))
        self.file = open(self.path, "a")
        if args.wandb_project:
            self.wandb_run = _init_wandb(args, config, self.dir)
        self.tensorboard = TensorBoardWriter(args, start_iteration)

    def _move_aside_previous_run(self):
        """A run starting at iteration 0 never writes over another run's numbers: a non-empty
        metrics.jsonl (and its config.yaml) moves to ``previous-<time>/`` in the run directory."""
        if not self.path.exists() or self.path.stat().st_size == 0:
            return
        aside = self.dir / time.strftime("previous-%Y%m%d-%H%M%S")
        aside.mkdir(exist_ok=True)
        for name in ("metrics.jsonl", "config.yaml"):
            if (self.dir / name).exists():
                os.replace(self.dir / name, aside / name)
        print_rank_0(f"note: --log-dir {self.dir} held another run's metrics.jsonl (this run starts at iteration 0); "
                     f"moved it to {aside}/")

    def _truncate_after(self, iteration):
        """On resume, drop lines a crashed run wrote past its last checkpoint (no duplicates).

        A torn last line (the run was killed mid-write) is dropped with a note; any other
        line that is not a JSON object with an iteration is kept as it is."""
        if not self.path.exists():
            return
        lines = [line for line in self.path.read_text(encoding="utf-8", errors="replace").splitlines() if line.strip()]
        kept = []
        for number, line in enumerate(lines, 1):
            try:
                record = json.loads(line)
                logged = int(record["iteration"])
            except (ValueError, TypeError, KeyError):
                if number == len(lines):
                    print_rank_0(f"note: {self.path}: dropped a torn last line (the previous run stopped mid-write)")
                else:
                    kept.append(line)
                continue
            if logged <= iteration:
                kept.append(line)
        tmp = self.path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        os.replace(tmp, self.path)

    def log(self, iteration, metrics, tokens_per_second, iteration_time_s, consumed_samples):
        if not self.enabled:
            return
        record = {"iteration": iteration}
        for name, value in metrics.items():
            key = metric_key(name)
            if key is not None and value is not None:
                record[key] = float(value)
        record["train/tokens_per_second"] = tokens_per_second
        record["train/iteration_time_ms"] = iteration_time_s * 1000.0
        record["train/memory_bytes"] = memory_bytes()
        # TensorBoard first (it only queues): a run stopped between the two has in its events every
        # iteration metrics.jsonl holds.
        self.tensorboard.log_train(iteration, consumed_samples, metrics, iteration_time_s)
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.wandb_run is not None:
            self.wandb_run.log({k: v for k, v in record.items() if k != "iteration"}, step=iteration)

    def log_values(self, iteration, values):
        """A line of other values at `iteration` (evaluation: ``valid/lm_loss``, ...), to wandb too."""
        if not self.enabled:
            return
        self.file.write(json.dumps({"iteration": iteration, **values}) + "\n")
        self.file.flush()
        if self.wandb_run is not None:
            self.wandb_run.log(values, step=iteration)

    def log_evaluation(self, iteration, consumed_samples, split, loss, others=None):
        """An evaluation's ``<split>/lm_loss`` and ``<split>/lm_loss_ppl`` (Megatron's exp(min(20, loss))),
        ``others`` (``{"mtp 1 loss": ...}``) as ``<split>/mtp_1_loss``; TensorBoard's ``lm loss validation``
        (`cp_ext.training.tensorboard`)."""
        if not self.enabled:
            return
        values = {f"{split}/lm_loss": loss, f"{split}/lm_loss_ppl": math.exp(min(20.0, loss))}
        values.update({f"{split}/{name.replace(' ', '_')}": value for name, value in (others or {}).items()})
        self.log_values(iteration, values)
        self.tensorboard.log_evaluation(iteration, consumed_samples, split, loss)

    def close(self, failed=False):
        """Idempotent: `Trainer.train` closes on the way out whether training ended or raised
        (``failed``: wandb marks the run failed, not finished)."""
        if not self.enabled or self.file.closed:
            return
        self.file.close()
        self.tensorboard.close()
        if self.wandb_run is not None:
            self.wandb_run.finish(exit_code=1 if failed else 0)


def _init_wandb(args, config, run_dir):
    if os.environ.get("WANDB_DISABLED", "").lower() in ("1", "true", "yes"):
        print_rank_0("wandb: WANDB_DISABLED is set; logging to metrics.jsonl only")
        return None
    try:
        import wandb

        save_dir = Path(args.wandb_save_dir or run_dir)
        save_dir.mkdir(parents=True, exist_ok=True)
        return wandb.init(
            project=args.wandb_project, entity=args.wandb_entity, name=args.wandb_exp_name,
            dir=str(save_dir), config=config,
        )
    except Exception as e:  # no API key, no network, wandb missing: training goes on
        print_rank_0(f"wandb: disabled for this run ({type(e).__name__}: {e}); metrics still go to {run_dir}/metrics.jsonl")
        return None
