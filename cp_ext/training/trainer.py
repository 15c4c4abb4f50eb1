"""The training loop: megatron-core's schedules, DDP, optimizer and LR scheduler, wired once.

    Trainer(args)            platform + process groups + model + optimizer + data
      .train_step(it)        one global batch: forward/backward over all microbatches
                             (1F1B when PP > 1), finalize grads, clip, step, LR step;
                             each CP rank trains on its shard of every sample
      .train()               the loop, logging Megatron-style iteration lines

Nothing here branches on the device: `cp_ext.platform` makes CPU look like what
megatron-core expects, so the GPU path is this same code with NCCL. --overlap-grad-reduce and
--overlap-param-gather go to megatron's DDP config as in Megatron-LM (its hooks do the overlap;
exact on CPU/gloo too: tests/training/test_overlap.py).
"""

import time
import weakref
from functools import partial

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.pipeline_parallel import get_forward_backward_func

from cp_ext import __version__
from cp_ext import parallel_state as cp_state
from cp_ext.arguments import ConfigError, evaluation_splits, model_args
from cp_ext.arguments.implementations import implementation_note
from cp_ext.checkpoint.checkpointer import Checkpointer
from cp_ext.checkpoint.disk_format import meta_to_load
from cp_ext.checkpoint.disk_format import non_persistent_dir, remove_staging_debris
from cp_ext.checkpoint.lock import acquire_save_lock, release_save_lock
from cp_ext.config import transformer_config_from_args
from cp_ext.console import print_rank_0
from cp_ext.data.datasets import build_eval_dataset, build_train_dataset, data_vocab_size
from cp_ext.grid import initialize_distributed
from cp_ext.megatron_version import versions_line
from cp_ext.megatron_compat import local_moe_losses, reduced_moe_losses, zero_moe_loss_tracker
from cp_ext.models.factory import build_model_stack, padded_vocab
from cp_ext.models.mtp import MTPLosses
from cp_ext.platform import memory_bytes, platform_is_cpu, setup_platform
from cp_ext.training.batches import microbatches
from cp_ext.training.evaluation import SPLIT_NAMES, evaluate_and_report
from cp_ext.training.logging import IterationLog
from cp_ext.training.metrics import MetricsLogger
from cp_ext.training.optimizer import build_optimizer
from cp_ext.training.report import attention_kernel_line, training_line
from cp_ext.transformer.dsa import INDEXER_LOSSES
from cp_ext.training.signals import ExitConditions
from cp_ext.training.model_from_flags import leave_distributed
from cp_ext.training.steps import forward_step
from cp_ext.transformer.hyper_connections import pipeline_seq_length


def train_samples(args):
    """How many samples the train dataset is built for: the whole run, and on resume

    * never fewer than the run still needs (consumed + remaining iterations x --global-batch-size),
      so a changed --train-iters or --global-batch-size never wraps around to sample 0;
    * the saving run's own count when that suffices, so the sample order is the one it trained on.
    """
    needed = args.train_iters * args.global_batch_size
    found = meta_to_load(args.load, args.ckpt_fallback) if args.load and not args.finetune else None
    saved = found[1] if found and found[1] else {}
    if "consumed_samples" not in saved:
        return needed
    needed = max(needed, saved["consumed_samples"] + (args.train_iters - saved["iteration"]) * args.global_batch_size)
    if saved["train_samples"] >= needed:
        return saved["train_samples"]
    print_rank_0(f"note: this run needs {needed} train samples, more than the {saved['train_samples']} the checkpoint's "
                 f"run ordered (--train-iters or --global-batch-size grew): megatron's GPTDataset keeps the sample "
                 f"order while the number of passes over the data stays the same and reshuffles when it grows, so "
                 f"samples after the {saved['consumed_samples']} consumed ones may then repeat earlier ones")
    return needed


class Trainer:
    def __init__(self, args):
        self.args = args
        self.started = time.time()  # --exit-duration-in-mins counts from here (Megatron-LM: pretrain()'s start)
        self.device = setup_platform(None if args.device == "auto" else args.device)
        self.grid = initialize_distributed(args, self.device)
        # Held weakly: the registry must not be what keeps a finished trainer alive.
        cp_state.on_grid_destroy(partial(_release_if_alive, weakref.ref(self)))
        print_rank_0(versions_line(__version__))
        if args.save:
            acquire_save_lock(args.save)  # before any heavy work: a second job saving there stops here
            if dist.get_rank() == 0 and (debris := remove_staging_debris(args.save)):
                print_rank_0(f"--save {args.save}: removed what an unfinished save left: {', '.join(debris)}")
        np_root = non_persistent_dir(args, args.save) if args.non_persistent_ckpt_type == "global" else None
        if np_root is not None and np_root.exists() and dist.get_rank() == 0 and (debris := remove_staging_debris(np_root)):
            print_rank_0(f"{np_root}: removed what an unfinished non-persistent save left: {', '.join(debris)}")
        self.dataset = build_train_dataset(args, train_samples(args))
        self.eval_datasets = {}
        for split in evaluation_splits(args):
            try:
                self.eval_datasets[split] = build_eval_dataset(args, split)
            except ValueError as e:  # an empty split, or one too small for --eval-iters
                if split == "valid":
                    raise ConfigError(f"  - --eval-interval: {e}") from None
                print_rank_0(f"note: no evaluation on the {split} split: {e}")
        vocab = padded_vocab(args, data_vocab_size(args), self.grid.tp)  # refused before the model is built
        self.config = transformer_config_from_args(args)
        print_rank_0(attention_kernel_line(self.config, self.device))
        note = implementation_note(args, on_cpu=self.device.type == "cpu")
        if note:  # flags naming an implementation that does not run here, and what runs instead
            print_rank_0(f"implementations: {note}")
        stack = build_model_stack(args, self.grid, vocab_size=vocab, device=self.device, config=self.config)
        self.padded_vocab_size, model = stack.padded_vocab_size, stack.chunks[0]
        MTPLosses.take(0, self.device)
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=args.overlap_grad_reduce,
            overlap_param_gather=args.overlap_param_gather,
            use_distributed_optimizer=args.use_distributed_optimizer,
        )
        self.model = [DistributedDataParallel(self.config, ddp_config, model)]
        self.optimizer, self.scheduler = build_optimizer(args, self.config, self.model)
        self.config.no_sync_func = self.model[0].no_sync
        self.config.grad_scale_func = self.optimizer.scale_loss
        self.config.finalize_model_grads_func = finalize_model_grads
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.dp_size = parallel_state.get_data_parallel_world_size()
        self.num_microbatches = args.global_batch_size // (args.micro_batch_size * self.dp_size)
        # Dynamic CP (--dynamic-context-parallel): every document on a group of the DP x CP ranks sized by its length;
        # the microbatches come from the step's schedule (`cp_ext.training.dynamic_batches`).
        self.dynamic = None
        if args.dynamic_context_parallel:
            from datetime import timedelta

            from cp_ext.training.dynamic_batches import DynamicCP

            self.dynamic = DynamicCP.from_args(args, world=self.dp_size * args.context_parallel_size)
            cp_state.initialize_dynamic_context_parallel(self.dynamic.sizes,
                                                         timeout=timedelta(minutes=args.distributed_timeout_minutes))
        # The tokens of every sample this CP rank holds (all of them when CP = 1).
        self.cp_positions = cp_state.get_context_parallel_positions(args.seq_length, self.config.cp_layout)
        # The stages that read tokens: the first (it embeds them) and, with MTP, the last (megatron builds the
        # MTP layers there, with a copy of the embedding, and they embed the shifted ids).
        self.reads_tokens = parallel_state.is_pipeline_first_stage() or (
            bool(self.config.mtp_num_layers) and parallel_state.is_pipeline_last_stage())
        self.iteration = 0
        self.consumed_samples = 0
        self.checkpointer = Checkpointer(self, model_args(args))
        if args.load:
            self.checkpointer.load(args.load)

    def train_step(self):
        """One optimizer step on global batch `self.iteration`; returns its metrics."""
        args = self.args
        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        data, num_microbatches = self._step_data()
        reports = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=data,
            model=self.model,
            num_microbatches=num_microbatches,
            seq_length=pipeline_seq_length(args),
            micro_batch_size=args.micro_batch_size,
            forward_only=False,
        )
        lr = self.optimizer.param_groups[0]["lr"]  # the rate this step uses
        update_successful, grad_norm, _ = self.optimizer.step()
        self.scheduler.step(increment=1)
        self.iteration += 1
        self.consumed_samples += args.global_batch_size
        metrics = {"lm loss": self._global_lm_loss(reports), "grad norm": grad_norm,
                   "learning rate": lr, "loss scale": self.optimizer.get_loss_scale().item(),
                   "skipped": not update_successful}
        metrics.update(self._aux_losses(num_microbatches))
        metrics.update(self.mtp_losses())
        metrics.update(INDEXER_LOSSES.take(self.config, num_microbatches, self.device))
        if self.dynamic is not None:
            metrics.update(self.dynamic_plan.metrics(self.dynamic, args.context_parallel_size))
        return metrics

    def _step_data(self):
        """This step's microbatches (an iterator) and how many there are."""
        args = self.args
        if self.dynamic is not None:
            from cp_ext.training.dynamic_batches import dynamic_microbatches, plan_step

            self.dynamic_plan = plan_step(self.dataset, self.consumed_samples, args.global_batch_size, self.dynamic)
            data = dynamic_microbatches(
                self.dataset, self.dynamic_plan, rank=cp_state.get_dynamic_rank(), device=self.device,
                tp_multiple=args.tensor_model_parallel_size if args.sequence_parallel else 1,
                first_stage=self.reads_tokens, last_stage=parallel_state.is_pipeline_last_stage())
            return iter(data), len(data)
        data = microbatches(
            self.dataset, consumed_samples=self.consumed_samples, global_batch_size=args.global_batch_size,
            micro_batch_size=args.micro_batch_size, dp_rank=self.dp_rank, dp_size=self.dp_size,
            device=self.device, positions=self.cp_positions,
            first_stage=self.reads_tokens, last_stage=parallel_state.is_pipeline_last_stage(),
            reset_position_ids=args.reset_position_ids, reset_attention_mask=args.reset_attention_mask,
        )
        return data, self.num_microbatches

    def lm_loss_sums(self, reports):
        """This rank's (loss sum, token count) of the microbatches it ran.

        Only last-stage, TP-rank-0 ranks contribute (TP ranks hold replicas of the same
        loss); CP and DP ranks hold disjoint tokens, so a world sum is the global sum.
        """
        total = torch.zeros(2, dtype=torch.float64, device=self.device)
        if parallel_state.is_pipeline_last_stage() and parallel_state.get_tensor_model_parallel_rank() == 0:
            for report in reports:
                total += report["lm loss"].to(torch.float64)
        return total

    def mtp_losses(self):
        """Megatron-LM's ``mtp_1 loss``, ... of the microbatches run since the last call: each depth's
        token-weighted mean over the global batch (`cp_ext.models.mtp.MTPLosses`), known on every rank."""
        depths = self.config.mtp_num_layers
        if not depths:
            return {}
        sums = MTPLosses.take(depths, self.device)
        if not (parallel_state.is_pipeline_last_stage() and parallel_state.get_tensor_model_parallel_rank() == 0):
            sums.zero_()  # TP ranks hold replicas of the same losses (as in `lm_loss_sums`)
        dist.all_reduce(sums)
        return {f"mtp_{k + 1} loss": (sums[k, 0] / sums[k, 1].clamp(min=1)).item() for k in range(depths)}

    def _global_lm_loss(self, reports):
        """Token-weighted mean loss of the whole global batch, known on every rank."""
        total = self.lm_loss_sums(reports)
        dist.all_reduce(total)
        return (total[0] / total[1].clamp(min=1)).item()

    def _aux_losses(self, num_microbatches):
        """Per-layer-averaged MoE aux losses, as megatron's `track_moe_metrics` reports them."""
        # megatron logs rank 0's z loss only; the mean over all ranks is the layout-free value
        everyone = parallel_state.get_tensor_and_data_parallel_group(with_context_parallel=True)
        if self.dynamic is not None:
            tracked, num_microbatches = self._dynamic_moe_losses(everyone)
        else:
            tracked = reduced_moe_losses(average_over={"z_loss": everyone})
        if not tracked:
            return {}
        # megatron's count: the MoE layers of --moe-layer-freq (dense-first layers log no aux loss), plus MTP's
        freq, layers = self.config.moe_layer_freq, self.config.num_layers
        num_moe_layers = sum(freq) if isinstance(freq, list) else sum(1 for i in range(layers) if i % freq == 0)
        num_moe_layers += self.config.mtp_num_layers or 0
        out = {}
        for name, values in tracked.items():
            out[name.replace("_", " ")] = (values.float().sum() / num_microbatches / num_moe_layers).item()
        zero_moe_loss_tracker()
        return out

    def _dynamic_moe_losses(self, everyone):
        """Under dynamic CP the routers reduced over each microbatch's group (`cp_ext.transformer.dynamic_cp`):
        a group's ranks' partial aux losses sum to its pack's, so the per-pack mean is the sum over all ranks
        over the packs of the step. The z loss is each rank's own mean over its tokens, averaged over ranks and
        microbatches (megatron's record keeps no token count to weight it by). Returns (values, divisor)."""
        tracked = local_moe_losses()
        packs = sum(len(mb.groups) for mb in self.dynamic_plan.schedule.microbatches)
        out = {}
        for name, values in tracked.items():
            values = values.clone()
            dist.all_reduce(values, group=everyone)
            dist.all_reduce(values, group=parallel_state.get_pipeline_model_parallel_group())  # each stage its layers
            if name == "z_loss":
                values *= packs / (everyone.size() * len(self.dynamic_plan.schedule.microbatches))
            out[name] = values
        return out, packs

    def train(self):
        args = self.args
        tokens_per_iteration = args.global_batch_size * args.seq_length
        log = IterationLog(args, tokens_per_iteration=tokens_per_iteration)
        self.open_metrics()
        ended = False
        try:
            history = self._train_loop(log, tokens_per_iteration)
            ended = True
        except BaseException:
            self.checkpointer.abort()  # a background write in flight is never published now: stop it
            raise
        finally:  # an error too: what metrics.jsonl, wandb and TensorBoard hold reaches the disk
            self.metrics.close(failed=not ended)
        if history:
            first = self.iteration - len(history) + 1
            print_rank_0(
                f"training done: lm loss {history[0]['lm loss']:.4f} (iteration {first}) -> "
                f"{history[-1]['lm loss']:.4f} (iteration {self.iteration}); metrics in {args.log_dir}/metrics.jsonl"
            )
        self.report_peak_memory()
        return history

    def _train_loop(self, log, tokens_per_iteration):
        args = self.args
        print_rank_0(training_line(args, dist.get_world_size(), self.dp_size, self.num_microbatches, self.device,
                                   sum(p.numel() for p in self.model[0].parameters())))
        history = []
        if self.iteration >= args.train_iters:
            print_rank_0(f"nothing to train: the loaded checkpoint is at iteration {self.iteration} = --train-iters "
                         f"{args.train_iters}; raise --train-iters to train on")
        exits = ExitConditions(args, self.device, self.started)
        while self.iteration < args.train_iters:
            self.checkpointer.poll()  # --async-save: publish a background save that every rank finished
            start = time.perf_counter()
            metrics = self.train_step()
            elapsed = time.perf_counter() - start
            history.append(metrics)
            log.record(self.iteration, self.consumed_samples, elapsed, metrics)
            self.metrics.log(self.iteration, metrics, tokens_per_iteration / elapsed, elapsed, self.consumed_samples)
            stop = exits.reason(self.iteration)  # collective: every rank stops at the same iteration
            if stop:
                print_rank_0(stop)
            if args.eval_interval and self.iteration % args.eval_interval == 0 and "valid" in self.eval_datasets:
                evaluate_and_report(self, "valid", f"iteration {self.iteration}")
            self._maybe_save(stop)
            if stop:
                break
        self.checkpointer.finish()  # --async-save: the last save is written and published before the run ends
        exits.restore()
        if args.overlap_param_gather:  # the last step's parameter all-gather waits for a next forward: run it now
            for chunk in self.model:
                chunk.start_param_sync(force_sync=True)
        if args.eval_interval and "test" in self.eval_datasets and history:
            evaluate_and_report(self, "test", f"iteration {self.iteration} on test set")
        return history

    def _maybe_save(self, stop):
        """A persistent checkpoint at --save-interval, the last iteration or a stop; else a non-persistent one
        at --non-persistent-save-interval (Megatron-LM's order)."""
        args, it = self.args, self.iteration
        if args.save and (it == args.train_iters or stop or (args.save_interval and it % args.save_interval == 0)):
            self.checkpointer.save(args.save, wait=False)
        elif args.non_persistent_save_interval and it % args.non_persistent_save_interval == 0:
            if args.non_persistent_ckpt_type == "local":
                self.checkpointer.save_local()
            else:
                self.checkpointer.save(non_persistent_dir(args, args.save), wait=False, non_persistent=True)

    def open_metrics(self):
        self.metrics = MetricsLogger(self.args, start_iteration=self.iteration)

    def evaluate_only(self):
        """--skip-train: the valid and test splits once, at the loaded iteration (Megatron's wording)."""
        self.open_metrics()
        ended = False
        try:
            results = {split: evaluate_and_report(self, split, f"iteration {self.iteration} on {SPLIT_NAMES[split]} set")
                       for split in self.eval_datasets}
            ended = True
            return results
        finally:
            self.metrics.close(failed=not ended)

    def report_peak_memory(self):
        """Rank 0 prints every rank's peak memory (metrics.jsonl holds rank 0's only)."""
        peak = torch.tensor([float(memory_bytes())], dtype=torch.float64, device=self.device)
        peaks = [torch.zeros_like(peak) for _ in range(dist.get_world_size())]
        dist.all_gather(peaks, peak)
        kind = "peak RSS" if platform_is_cpu() else "CUDA max allocated"
        print_rank_0(f"{kind} per rank (MiB): " + " ".join(f"{p.item() / 2**20:.0f}" for p in peaks))

    def shutdown(self, keep_process_group=False):
        """Leave the process groups cleanly so torchrun sees every rank exit 0.

        ``keep_process_group``: leave the grid in place, so the same ranks can build another
        Trainer (on this grid, reusing its groups, or on another; `initialize_distributed`)."""
        dist.barrier()
        if self.args.save:
            release_save_lock(self.args.save)
        self._release_model()
        if not keep_process_group:
            leave_distributed(barrier=False)

    def _release_model(self):
        """Break the cycles through C++ that would keep this model, and the process groups it holds,
        alive after the Trainer is dropped (`_release_step_graphs`). Run by `shutdown`, and when the
        grid is left (`cp_state.on_grid_destroy`), so a trainer nobody shut down is freed too."""
        model, config = getattr(self, "model", None), getattr(self, "config", None)
        if model is not None:
            _release_step_graphs(model)
            for chunk in model:
                chunk.grad_accs.clear()
        if config is not None:
            # The optimizer's bound method on the model's config closes the other cycle through C++: the
            # distributed optimizer's fp32 shards are views of the weights, with their autograd graph.
            config.grad_scale_func = config.no_sync_func = None


def _release_if_alive(trainer_ref):
    trainer = trainer_ref()
    if trainer is not None:
        trainer._release_model()


def _release_step_graphs(model_chunks):
    """Drop the autograd graphs megatron's modules keep from the last step, so a finished model can be freed
    (`Trainer.shutdown`).

    megatron's MoE token dispatchers keep the last step's routing tensors as attributes, with their
    autograd graph. That graph reaches the parameters' gradient accumulators, whose hooks (megatron's
    DDP) hold the model: a cycle through C++ that Python's garbage collector cannot see. Such a model,
    and every process group it holds (each with gloo threads that poll), would live as long as the
    process: a test or tool building trainers on 30 grids ended with 1,300 threads per rank and a load
    average of 600 on 2 cores. Nothing of it is read after the step (the next forward sets them anew)."""
    for chunk in model_chunks:
        for module in chunk.modules():
            holders = [module] + [v for v in vars(module).values()
                                  if hasattr(v, "__dict__") and not isinstance(v, (torch.nn.Module, torch.Tensor, type))]
            for holder in holders:
                for name, value in list(vars(holder).items()):
                    if isinstance(value, torch.Tensor) and value.grad_fn is not None:
                        setattr(holder, name, None)
