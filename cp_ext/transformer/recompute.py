"""CP-aware full recompute: keep each layer's attention output and LSE, never re-run the ring.

``--recompute-granularity full`` makes megatron checkpoint whole layers
(`TransformerBlock._checkpointed_forward` -> `tensor_parallel.checkpoint`): the first forward
runs under ``no_grad`` and keeps only the layer input; the backward re-runs the layer's forward
with grad enabled and backpropagates through it. Under context parallelism that re-run would send
every KV block around the ring again and recompute every attention tile. But attention's
backward needs only q, k, v (cheap to recompute: projections and RoPE), the output and the
log-sum-exp, so the first forward keeps (out, LSE), s/C x b x h x d + s/C x b x h floats per
rank, and the recompute replays them (LoongTrain's "selective checkpoint++")::

    first forward  (is_checkpointing, no grad)   out, lse, plan = cp_attention_forward(q, k, v)
                                                 kept.append((out, lse, plan))      -> out
    recompute      (is_checkpointing, grad on)   out, lse, plan = kept.popleft()
                                                 ReplayAttention(q, k, v; out, lse) -> out
    backward       (ReplayAttention.backward)    cp_attention_backward(dout, q, k, v, out, lse, plan)

(``plan``: the kernel and, for packed documents, the segments / ring schedule / all-gather
tiles, made once in the first forward.)

Nothing travels the ring in the recompute; the backward is the ring/Ulysses/hybrid backward
unchanged, so the ring bytes of an iteration equal those without recompute. Layers outside a
checkpoint (``--recompute-method block``) run the normal path.

One FIFO per attention module is enough: megatron recomputes the microbatches of a step in the
order it ran their forwards (one at a time without PP; 1F1B's backwards are FIFO too), and each
layer's recompute happens exactly once, in that microbatch's backward.
"""

from collections import deque

import torch
from megatron.core.tensor_parallel.random import is_checkpointing

from cp_ext.attention.cp.context_parallel import cp_attention_backward, cp_attention_forward


class ReplayAttention(torch.autograd.Function):
    """Returns the kept output of the first forward; its backward is the CP attention backward."""

    @staticmethod
    def forward(ctx, q, k, v, softmax_offset, out, lse, plan, up_weight=None):
        ctx.save_for_backward(q, k, v, out, lse, softmax_offset, up_weight)
        ctx.plan = plan  # the forward's mask, groups and kernel: all the backward needs besides the tensors
        return out.detach()

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, softmax_offset, up_weight = ctx.saved_tensors
        dq, dk, dv, d_offset, d_weight = cp_attention_backward(dout, q, k, v, out, lse, ctx.plan,
                                                               softmax_offset=softmax_offset, up_weight=up_weight)
        return dq, dk, dv, d_offset, None, None, None, d_weight


class KeptAttention:
    """The (out, LSE) pairs one attention module kept for the recompute of its layer, oldest first."""

    live_bytes = 0
    """Bytes kept by every instance in this process (read by `cp_ext.bench.memory_measure`)."""

    def __init__(self):
        self._kept = deque()
        self.replayed = 0  # recomputes served from kept outputs (tests read it)

    def __len__(self):
        return len(self._kept)

    def forward(self, q, k, v, **attn_kwargs):
        """Attention over the CP groups; inside megatron's checkpoint, keep or replay its output."""
        if not is_checkpointing():
            return None  # not a checkpointed layer: the caller's normal (autograd) path
        # parameters: autograd inputs of the replay (the sink; MLA's up-projection under the latent exchange)
        offset, up_weight = attn_kwargs.pop("softmax_offset", None), attn_kwargs.pop("up_weight", None)
        if not torch.is_grad_enabled():  # the first forward of a checkpointed layer
            out, lse, plan = cp_attention_forward(q, k, v, softmax_offset=offset, up_weight=up_weight, **attn_kwargs)
            self._kept.append((out, lse, plan))
            KeptAttention.live_bytes += out.nbytes + lse.nbytes
            return out
        if not self._kept:
            raise RuntimeError("CP-aware recompute: a layer is recomputed whose first forward kept no attention "
                               "output (recompute out of order); run with --no-cp-aware-recompute and report this")
        out, lse, plan = self._kept.popleft()
        KeptAttention.live_bytes -= out.nbytes + lse.nbytes
        self.replayed += 1
        if out.shape != q.shape[:-1] + (plan.message.d_v,) or out.device != q.device:
            raise RuntimeError(f"CP-aware recompute: kept attention output {tuple(out.shape)} does not match the "
                               f"recomputed query {tuple(q.shape)}")
        return ReplayAttention.apply(q, k, v, offset, out, lse, plan, up_weight)

    def clear(self):
        while self._kept:
            out, lse, _ = self._kept.popleft()
            KeptAttention.live_bytes -= out.nbytes + lse.nbytes
