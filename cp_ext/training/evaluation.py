"""Validation and test loss under every parallel layout, as Megatron-LM reports it.

    --eval-interval N   evaluate the valid split every N iterations; at the end of training
                        the test split ("validation loss at iteration N on test set")
    --eval-iters K      K global batches per evaluation: samples [0, K x GBS) of the split,
                        the same ones every time and at every grid, so values compare
    --skip-train        evaluate both splits once (with --load: the checkpoint) and exit

The forward runs through megatron's schedule with ``forward_only=True`` (1F1B when PP > 1),
in eval mode and without grad; each CP rank computes the loss of its shard of every sample and
the loss is summed over the global token count exactly as in training (`Trainer.lm_loss_sums`),
so CP=N gives CP=1's value; with --mtp-num-layers each depth's loss too (``mtp_1 loss value``). Training is not disturbed: no RNG is drawn (eval mode has no
dropout), the data position is training's own, and the MoE aux-loss tracker is cleared after.
"""

import math

import torch
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func

from cp_ext.megatron_compat import zero_moe_loss_tracker
from cp_ext.models.mtp import MTPLosses
from cp_ext.training.batches import microbatches
from cp_ext.console import print_rank_0
from cp_ext.training.steps import forward_step
from cp_ext.transformer.hyper_connections import pipeline_seq_length

SPLIT_NAMES = {"valid": "validation", "test": "test"}


def evaluate(trainer, dataset, eval_iters):
    """Token-weighted mean LM loss over `eval_iters` global batches of `dataset` (collective)."""
    return evaluate_losses(trainer, dataset, eval_iters)["lm loss"]


def evaluate_losses(trainer, dataset, eval_iters):
    """``{"lm loss": ..., "mtp_1 loss": ...}`` (with --mtp-num-layers: each depth's too), each the token-weighted
    mean over `eval_iters` global batches of `dataset` (collective)."""
    args = trainer.args
    MTPLosses.take(trainer.config.mtp_num_layers or 0, trainer.device)  # only this evaluation's microbatches
    overlap = args.use_distributed_optimizer and args.overlap_param_gather
    for chunk in trainer.model:
        if overlap:  # as Megatron-LM: gather the parameters now, no prefetch hooks during evaluation
            chunk.disable_forward_pre_hook()
        chunk.eval()
    total = torch.zeros(2, dtype=torch.float64, device=trainer.device)
    with torch.no_grad():
        for k in range(eval_iters):
            data = microbatches(
                dataset, consumed_samples=k * args.global_batch_size, global_batch_size=args.global_batch_size,
                micro_batch_size=args.micro_batch_size, dp_rank=trainer.dp_rank, dp_size=trainer.dp_size,
                device=trainer.device, positions=trainer.cp_positions,
                first_stage=trainer.reads_tokens, last_stage=parallel_state.is_pipeline_last_stage(),
                reset_position_ids=args.reset_position_ids, reset_attention_mask=args.reset_attention_mask,
            )
            reports = get_forward_backward_func()(
                forward_step_func=forward_step, data_iterator=data, model=trainer.model,
                num_microbatches=trainer.num_microbatches, seq_length=pipeline_seq_length(args),
                micro_batch_size=args.micro_batch_size, forward_only=True,
            )
            total += trainer.lm_loss_sums(reports)
    for chunk in trainer.model:
        chunk.train()
        if overlap:
            chunk.enable_forward_pre_hook()
    zero_moe_loss_tracker()
    mtp = trainer.mtp_losses()  # what the MTP heads recorded in these forwards, reduced as in training
    torch.distributed.all_reduce(total)
    return {"lm loss": (total[0] / total[1].clamp(min=1)).item(), **mtp}


def validation_block(prefix, loss, others=None):
    """Megatron-LM's `evaluate_and_print_results` lines, framed by dashes: a value and a PPL per loss
    (``others``: the MTP depths' ``mtp_1 loss``, ...)."""
    losses = {"lm loss": loss, **(others or {})}
    line = f" validation loss at {prefix} | " + "".join(
        f"{name} value: {value:.6E} | {name} PPL: {math.exp(min(20.0, value)):.6E} | " for name, value in losses.items())
    rule = "-" * (len(line) + 1)
    return f"{rule}\n{line}\n{rule}"


def evaluate_and_report(trainer, split, prefix):
    """Evaluate `split`, print Megatron's block on rank 0, log ``<split>/lm_loss(_ppl)`` and each MTP depth's
    ``<split>/mtp_N_loss`` (and TensorBoard's ``lm loss validation``); returns the loss."""
    losses = evaluate_losses(trainer, trainer.eval_datasets[split], trainer.args.eval_iters)
    loss = losses.pop("lm loss")
    print_rank_0(validation_block(prefix, loss, losses))
    trainer.metrics.log_evaluation(trainer.iteration, trainer.consumed_samples, split, loss, losses)
    return loss
