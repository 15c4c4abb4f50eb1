"""Plain PyTorch attention: any device, dtype, head dims and mask (what the others are checked against)."""

import torch

from cp_ext.attention.kernels.base import AttnKernel, Limits


class UnfusedKernel(AttnKernel):
    """Plain PyTorch: scores = scale * q k^T, LSE = logsumexp(scores), out = exp(scores - LSE) v.

    Any device and float dtype (math in fp32, fp64 for fp64), any head dim, at the cost of
    materializing the ``[b, h, s_q, s_k]`` scores. Megatron's ``unfused`` / ``local``, and auto's
    last resort on CUDA (fp64, or a head dim no fused kernel takes). The backward recomputes P
    from the global LSE: dV = P^T dO, dS = P (dO V^T - rowsum(dO * O)), dQ = scale dS K, dK = scale dS^T Q.
    """

    name = "unfused"
    native_gqa = False
    limits = Limits(device=None, dtypes=None, align=1, masks=True, distinct_v=True)

    @staticmethod
    def _scores(q, k, causal, scale, mask):
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        scores = torch.matmul(q.to(acc), k.to(acc).transpose(-1, -2)) * scale
        if causal:
            sq, sk = scores.shape[-2:]
            scores.masked_fill_(torch.ones(sq, sk, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
        if mask is not None:
            scores.masked_fill_(~mask, float("-inf"))
        return scores

    def _forward(self, q, k, v, causal, scale, mask):
        scores = self._scores(q, k, causal, scale, mask)
        lse = torch.logsumexp(scores, dim=-1)
        out = torch.matmul(torch.exp(scores - lse.unsqueeze(-1)).nan_to_num_(0.0), v.to(scores.dtype))
        return out.to(q.dtype), lse

    def _backward(self, dout, q, k, v, out, lse, causal, scale, mask):
        scores = self._scores(q, k, causal, scale, mask)
        acc = scores.dtype
        p = torch.exp(scores - lse.to(acc).unsqueeze(-1))
        do = dout.to(acc)
        dv = torch.matmul(p.transpose(-1, -2), do)
        ds = p * (torch.matmul(do, v.to(acc).transpose(-1, -2)) - (do * out.to(acc)).sum(-1, keepdim=True))
        dq = torch.matmul(ds, k.to(acc)) * scale
        dk = torch.matmul(ds.transpose(-1, -2), q.to(acc)) * scale
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
