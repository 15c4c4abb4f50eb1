"""Which samples each rank trains on, and the part of each sample it keeps.

Sample order is a property of the *global* batch, never of the layout (Megatron's
pretraining sampler): the global batch that starts after ``consumed_samples`` holds
dataset samples ``consumed_samples + [0, G)`` (the dataset is already shuffled by its
seed). Within it, microbatch ``m`` of data-parallel rank ``d`` holds the ``mbs`` samples
starting at ``(m * DP + d) * mbs``. So every DP/CP/TP/PP layout trains on the same
samples per iteration, DP ranks' shares are disjoint, and resuming from a checkpoint's
``consumed_samples`` continues exactly, with no sample repeated or skipped.

Context parallelism: every CP rank of a DP replica reads the same sample and keeps the
tokens at ``positions`` (`cp_ext.parallel_state.get_context_parallel_positions`, the one
layout formula RoPE and attention also use) of tokens, labels, loss_mask and the global
position_ids. Pipeline stages that neither embed tokens nor take the loss read nothing.
"""

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch


@dataclass
class Microbatch:
    tokens: Optional[torch.Tensor]  # [b, s/CP] input ids (None on a stage that reads no data)
    labels: Optional[torch.Tensor]  # [b, s/CP] next-token targets
    loss_mask: Optional[torch.Tensor]  # [b, s/CP] float, 1 where the token counts
    position_ids: torch.Tensor  # [b, s/CP] global positions
    sample_ids: np.ndarray  # [b] dataset indices of the samples


def global_batch_sample_ids(consumed_samples: int, global_batch_size: int, num_samples: int) -> np.ndarray:
    """Dataset indices of the global batch that follows `consumed_samples` samples (wrapping around)."""
    return (consumed_samples + np.arange(global_batch_size, dtype=np.int64)) % num_samples


def microbatches(dataset, *, consumed_samples, global_batch_size, micro_batch_size, dp_rank, dp_size, device,
                 positions=None, first_stage=True, last_stage=True):
    """The microbatches this rank runs in the global batch after `consumed_samples`, in schedule order.

    `positions` (global token positions, from the CP layout) selects this CP rank's shard
    of every sample; the whole sample when None. `first_stage` needs tokens, `last_stage`
    labels and loss_mask; a stage that is neither yields position ids only, reading nothing.
    """
    ids = global_batch_sample_ids(consumed_samples, global_batch_size, len(dataset))
    for m in range(global_batch_size // (micro_batch_size * dp_size)):
        start = (m * dp_size + dp_rank) * micro_batch_size
        mine = ids[start : start + micro_batch_size]
        if not (first_stage or last_stage):
            pos = positions if positions is not None else torch.arange(dataset.seq_length)
            yield Microbatch(None, None, None, pos.expand(len(mine), -1).contiguous().to(device), mine)
            continue
        samples = [dataset[int(i)] for i in mine]
        batch = {key: torch.stack([s[key] for s in samples]) for key in ("tokens", "labels", "loss_mask", "position_ids")}
        if positions is not None:
            batch = {key: value[:, positions.cpu()] for key, value in batch.items()}
        batch = {key: value.contiguous().to(device) for key, value in batch.items()}
        yield Microbatch(
            tokens=batch["tokens"] if first_stage else None,
            labels=batch["labels"] if last_stage else None,
            loss_mask=batch["loss_mask"].float() if last_stage else None,
            position_ids=batch["position_ids"],
            sample_ids=mine,
        )
