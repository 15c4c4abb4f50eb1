"""Which samples each rank trains on, and their tensors.

Sample order is a property of the *global* batch, never of the layout: global batch
``t`` is the samples ``shuffled[t*G : (t+1)*G]`` of a seeded permutation. Within it,
Megatron's sampler order applies: microbatch ``m`` of data-parallel rank ``d`` holds
``mbs`` samples starting at ``(m * DP + d) * mbs``. So any DP/TP/PP layout trains on
the same samples per iteration, and each DP rank's share is disjoint.
"""

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class Microbatch:
    tokens: torch.Tensor  # [b, s] input ids
    labels: torch.Tensor  # [b, s] next-token targets
    loss_mask: torch.Tensor  # [b, s] float, 1 where the token counts
    position_ids: torch.Tensor  # [b, s] global positions


def global_batch_sample_ids(iteration: int, global_batch_size: int, num_samples: int, seed: int) -> np.ndarray:
    """Dataset indices of global batch `iteration` (0-based), epoch after epoch."""
    start = iteration * global_batch_size
    ids = np.empty(global_batch_size, dtype=np.int64)
    for i, position in enumerate(range(start, start + global_batch_size)):
        epoch, offset = divmod(position, num_samples)
        ids[i] = _epoch_permutation(num_samples, seed + epoch)[offset]
    return ids


_PERMUTATIONS = {}


def _epoch_permutation(num_samples: int, seed: int) -> np.ndarray:
    key = (num_samples, seed)
    if key not in _PERMUTATIONS:
        _PERMUTATIONS.clear()
        _PERMUTATIONS[key] = np.random.default_rng(seed).permutation(num_samples)
    return _PERMUTATIONS[key]


def microbatches(dataset, iteration, *, global_batch_size, micro_batch_size, dp_rank, dp_size, seed, device,
                 positions=None):
    """The microbatches this DP rank runs in `iteration`, in schedule order.

    `positions` (global token positions, from the CP layout) selects this CP rank's shard
    of every sample; the whole sample when None.
    """
    ids = global_batch_sample_ids(iteration, global_batch_size, len(dataset), seed)
    num_micro = global_batch_size // (micro_batch_size * dp_size)
    for m in range(num_micro):
        start = (m * dp_size + dp_rank) * micro_batch_size
        samples = np.stack([dataset[int(i)] for i in ids[start : start + micro_batch_size]])
        text = torch.from_numpy(samples)
        tokens, labels = text[:, :-1], text[:, 1:]
        seq = tokens.shape[1]
        if positions is None:
            positions = torch.arange(seq)
        positions = positions.cpu()
        tokens, labels = tokens[:, positions], labels[:, positions]
        yield Microbatch(
            tokens=tokens.to(device),
            labels=labels.to(device),
            loss_mask=torch.ones(tokens.shape, dtype=torch.float32, device=device),
            position_ids=positions.expand_as(tokens).contiguous().to(device),
        )
