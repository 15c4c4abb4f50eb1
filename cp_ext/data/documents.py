"""Packed documents: which document each token of a sample belongs to.

A sample of --seq-length tokens is cut from a stream of documents, each ended by the
tokenizer's EOD token. Megatron's boundary rule (megatron.core.datasets.gpt_dataset,
`_get_ltor_masks_and_position_ids`): the EOD belongs to the document it ends, and the
token after it starts the next one::

    tokens        a  b  EOD  c  EOD  EOD  d
    document id   0  0  0    1  1    2    3     (EODs before the token)
    position id   0  1  2    0  1    0    0     (--reset-position-ids, from GPTDataset)

Document ids are computed on the FULL sample, before context-parallel sharding, and then
sharded with the tokens: a CP rank cannot tell from its shard alone how many EODs came
before it. With --reset-attention-mask a token attends only to tokens of its own id.
"""

import torch


def document_ids(tokens: torch.Tensor, eod: int) -> torch.Tensor:
    """Document id of every token of ``tokens`` ([..., s]): the number of EOD tokens before it (int64)."""
    is_eod = (tokens == eod).long()
    return torch.cumsum(is_eod, dim=-1) - is_eod
