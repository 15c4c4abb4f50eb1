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

Packed documents: with --reset-attention-mask each microbatch also carries document ids
(`cp_ext.data.documents.document_ids`), computed on the full sample before it is sharded.
With --reset-position-ids or --reset-attention-mask every pipeline stage reads the sample,
as RoPE (per-document positions) and the attention (document ids) run on every stage; a
middle stage still gets no tokens, labels or loss mask.
"""

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from cp_ext.data.documents import document_ids


@dataclass
class Microbatch:
    tokens: Optional[torch.Tensor]  # [b, s/CP] input ids (None on a stage that reads no data)
    labels: Optional[torch.Tensor]  # [b, s/CP] next-token targets
    loss_mask: Optional[torch.Tensor]  # [b, s/CP] float, 1 where the token counts
    position_ids: torch.Tensor  # [b, s/CP] global positions (per document with --reset-position-ids)
    sample_ids: np.ndarray  # [b] dataset indices of the samples
    # [b, s/CP] int64, EODs before each token of the full sample; None unless --reset-attention-mask.
    # Passed where megatron passes its attention mask.
    document_ids: Optional[torch.Tensor] = None
    # Dynamic CP (`cp_ext.training.dynamic_batches`): the microbatch's group and layout, in megatron's
    # PackedSeqParams seat; None for static CP.
    packed_seq_params: Optional[object] = None


def global_batch_sample_ids(consumed_samples: int, global_batch_size: int, num_samples: int) -> np.ndarray:
    """Dataset indices of the global batch that follows `consumed_samples` samples (wrapping around)."""
    return (consumed_samples + np.arange(global_batch_size, dtype=np.int64)) % num_samples


def microbatches(dataset, *, consumed_samples, global_batch_size, micro_batch_size, dp_rank, dp_size, device,
                 positions=None, first_stage=True, last_stage=True, reset_position_ids=False,
                 reset_attention_mask=False):
    """The microbatches this rank runs in the global batch after `consumed_samples`, in schedule order.

    `positions` (global token positions, from the CP layout) selects this CP rank's shard
    of every sample; the whole sample when None. `first_stage` needs tokens, `last_stage`
    labels and loss_mask; a stage that is neither yields position ids only, reading nothing,
    unless the run packs documents: `reset_position_ids` (the dataset's position ids restart
    per document) or `reset_attention_mask` (document ids from ``dataset.eod``) are read there too.
    """
    if reset_attention_mask and dataset.eod is None:
        raise ValueError("--reset-attention-mask needs a dataset whose documents end in an EOD token")
    reads = first_stage or last_stage or reset_position_ids or reset_attention_mask
    ids = global_batch_sample_ids(consumed_samples, global_batch_size, len(dataset))
    for m in range(global_batch_size // (micro_batch_size * dp_size)):
        start = (m * dp_size + dp_rank) * micro_batch_size
        mine = ids[start : start + micro_batch_size]
        if not reads:
            pos = positions if positions is not None else torch.arange(dataset.seq_length)
            yield Microbatch(None, None, None, pos.expand(len(mine), -1).contiguous().to(device), mine)
            continue
        samples = [dataset[int(i)] for i in mine]
        batch = {key: torch.stack([s[key] for s in samples]) for key in ("tokens", "labels", "loss_mask", "position_ids")}
        if reset_attention_mask:  # from the full sample: a shard cannot count the EODs before it
            batch["document_ids"] = document_ids(batch["tokens"], dataset.eod)
        if positions is not None:
            batch = {key: value[:, positions.cpu()] for key, value in batch.items()}
        batch = {key: value.contiguous().to(device) for key, value in batch.items()}
        yield Microbatch(
            tokens=batch["tokens"] if first_stage else None,
            labels=batch["labels"] if last_stage else None,
            loss_mask=batch["loss_mask"].float() if last_stage else None,
            position_ids=batch["position_ids"],
            sample_ids=mine,
            document_ids=batch.get("document_ids"),
        )
