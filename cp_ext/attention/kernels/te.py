"""TransformerEngine's fused attention as a local kernel (import-guarded: needs CUDA and TE)."""

import torch

from cp_ext.attention.kernels.base import AttnKernel, Limits


class TransformerEngineKernel(AttnKernel):
    """TransformerEngine fused attention (F16 arbitrary-seqlen backend), layout bshd.

    Its softmax statistics (``aux_ctx_tensors[0]``, ``[b, h, s, 1]`` fp32) are the LSE.
    """

    name = "te"
    native_gqa = True
    limits = Limits(max_head_dim=256, package=("transformer_engine", "transformer-engine[pytorch]"))

    def __init__(self):
        import transformer_engine_torch as tex  # import-guarded by get_kernel
        from transformer_engine.pytorch.constants import TE_DType
        from transformer_engine.pytorch.cpp_extensions.fused_attn import fused_attn_bwd, fused_attn_fwd

        self._fwd, self._bwd, self._te_dtype = fused_attn_fwd, fused_attn_bwd, TE_DType
        self._backend = tex.NVTE_Fused_Attn_Backend.NVTE_F16_arbitrary_seqlen

    @staticmethod
    def _cu_seqlens(b, s, device):
        return torch.arange(0, (b + 1) * s, s, dtype=torch.int32, device=device)

    def _forward(self, q, k, v, causal, scale, mask):
        b, _, sq, _ = q.shape
        sk = k.shape[2]
        qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))
        out, aux = self._fwd(
            is_training=True, max_seqlen_q=sq, max_seqlen_kv=sk,
            cu_seqlens_q=self._cu_seqlens(b, sq, q.device), cu_seqlens_kv=self._cu_seqlens(b, sk, q.device),
            q=qt, k=kt, v=vt, fake_dtype=q.dtype, fused_attention_backend=self._backend,
            attn_scale=scale, dropout=0.0, qkv_layout="bshd_bshd_bshd",
            attn_mask_type="causal" if causal else "no_mask",
        )
        self._rng_state = aux[1] if len(aux) > 1 else None
        return out.transpose(1, 2), aux[0].squeeze(-1)

    def _backward(self, dout, q, k, v, out, lse, causal, scale, mask):
        b, _, sq, _ = q.shape
        sk = k.shape[2]
        qt, kt, vt, ot, dot = (x.transpose(1, 2).contiguous() for x in (q, k, v, out, dout))
        aux = [lse.float().unsqueeze(-1).contiguous()]
        if getattr(self, "_rng_state", None) is not None:
            aux.append(self._rng_state)  # dropout is 0: its content is unused
        dq, dk, dv, *_ = self._bwd(
            max_seqlen_q=sq, max_seqlen_kv=sk,
            cu_seqlens_q=self._cu_seqlens(b, sq, q.device), cu_seqlens_kv=self._cu_seqlens(b, sk, q.device),
            q=qt, k=kt, v=vt, o=ot, d_o=dot, fake_dtype=q.dtype, dqkv_dtype=self._te_dtype[q.dtype],
            aux_ctx_tensors=aux, fused_attention_backend=self._backend, attn_scale=scale, dropout=0.0,
            qkv_layout="bshd_bshd_bshd", attn_mask_type="causal" if causal else "no_mask",
        )
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
