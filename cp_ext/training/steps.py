"""One microbatch through the model, and its loss as megatron's schedules want it.

Shared by training (`Trainer.train_step`) and evaluation (`cp_ext.training.evaluation`): the
loss is returned as a sum with its token count, so megatron divides by the global count over
DP x CP and every layout gives the same mean.
"""

from functools import partial

import torch


def loss_func(loss_mask, output_tensor):
    """Sum of masked per-token losses and their count; megatron divides by the global count."""
    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1).float()
    loss_sum = torch.sum(losses * mask)
    num_tokens = mask.sum().to(torch.int)
    report = torch.stack([loss_sum.detach(), mask.sum().detach()])
    return loss_sum, num_tokens, {"lm loss": report}


def forward_step(data_iterator, model):
    batch = next(data_iterator)
    # Document ids (--reset-attention-mask) go where megatron passes its attention mask: cp_ext's core
    # attention reads an integer [b, s/CP] mask as document ids; None is plain causal attention.
    # The loss mask reaches the model for MTP's per-depth losses (megatron shifts it with the labels), as
    # Megatron-LM's pretrain_gpt passes it; without MTP megatron does not read it.
    # Dynamic CP's group and layout ride in megatron's PackedSeqParams seat (`cp_ext.transformer.dynamic_cp`).
    extra = {} if batch.packed_seq_params is None else {"packed_seq_params": batch.packed_seq_params}
    output = model(batch.tokens, batch.position_ids, batch.document_ids, labels=batch.labels, loss_mask=batch.loss_mask,
                   **extra)
    return output, partial(loss_func, batch.loss_mask)
