"""What the ring and the all-gather move per token: the K/V pair itself, or MLA's latent.

A *message* is this rank's KV block as it travels, in kernel layout (sequence on dim -2), and
the rule that turns it into a block's k and v (``unpack``) and a block's dK/dV back into the
message's gradient (``add_grad``). The ring (`cp_ext.attention.cp.ring`) and the all-gather
(`cp_ext.attention.cp.all_gather`) move messages and message gradients and never look inside.

`PairedKV` is k and v: stacked ``[2, b, hk, s, d]``, or side by side ``[b, hk, s, d_qk + d_v]``
when their head dims differ (MLA with ``--cp-mla-exchange kv``).

`LatentKV` is Multi-Latent Attention's latent (``--cp-mla-exchange latent``). DeepSeek-V2/V3
compute every head's key and value from one per-token vector (megatron's `MLASelfAttention`)::

    c    = kv_layernorm(W_dkv x)[:r]          kv_lora_rank r        (512 at DeepSeek-V3 size)
    k_pe = RoPE((W_dkv x)[r:])                qk_pos_emb_head_dim p (64), shared by the heads
    [k_nope_h | v_h] = c W_up_h^T            W_up = linear_kv_up_proj.weight [h (d_nope + d_v), r]
    k_h = [k_nope_h | k_pe]                   d_nope 128 + p 64 = 192;  d_v 128

so the message is ``[b, 1, s, r + p]`` (``[c | k_pe]``): 576 values per token where the K/V of
128 heads are 128 x (192 + 128) = 40,960. Each rank up-projects the block it computes with;
the backward contracts the block's dK/dV into the latent's gradient (which travels home in
place of dK/dV) and adds that block's share of W_up's gradient on this rank::

    dkv_h = [dk_h[:d_nope] | dv_h]   d c += sum_h dkv_h W_up_h   d k_pe += sum_h dk_h[d_nope:]
    d W_up_h += dkv_h^T c            (over the block's tokens)

Every rank's share of d W_up is over the (query, key) tiles it computed, and the tiles of all
ranks are the whole mask once, so the shares sum to the gradient; the DP x CP gradient
reduction adds them, as it adds every replicated parameter's. The up-projection is recomputed
per block in the backward, which costs ``2 s r h (d_nope + d_v)`` flops per block and direction.
"""

import torch

from cp_ext.attention.cp.primitives import accum_dtype


class PairedKV:
    """k and v as they are: one message per block."""

    def __init__(self, d_qk: int, d_v: int):
        self.d_qk, self.d_v = d_qk, d_v

    def pack(self, k, v):
        return torch.stack([k, v]) if k.shape == v.shape else torch.cat([k, v], dim=-1)

    def unpack(self, msg, cols=slice(None)):
        """(k, v) of the block's key rows ``cols``, views of ``msg``."""
        if msg.dim() == 5:
            return msg[0][:, :, cols], msg[1][:, :, cols]
        return msg[:, :, cols, : self.d_qk], msg[:, :, cols, self.d_qk:]

    def add_grad(self, dmsg, cols, dk, dv, msg):
        dk_acc, dv_acc = self.unpack(dmsg, cols)
        dk_acc.add_(dk)
        dv_acc.add_(dv)

    def grads(self, dmsg, k, v):
        """(dk, dv) in k's and v's dtypes from the finished message gradient."""
        dk, dv = self.unpack(dmsg)
        return dk.to(k.dtype), dv.to(v.dtype)


class LatentKV:
    """MLA's ``[c | k_pe]`` latent as the message; ``weight`` is ``linear_kv_up_proj.weight``
    (this TP rank's heads), ``heads`` the query heads it serves, ``d_qk = d_nope + p``."""

    def __init__(self, weight: torch.Tensor, heads: int, d_qk: int, latent_dim: int):
        if weight.dim() != 2 or weight.shape[0] % heads or latent_dim <= weight.shape[1]:
            raise ValueError(f"latent exchange: linear_kv_up_proj weight {tuple(weight.shape)} must be "
                             f"[heads x (d_nope + d_v), kv_lora_rank] for {heads} heads, and the latent "
                             f"({latent_dim} wide) kv_lora_rank + qk_pos_emb_head_dim")
        self.weight, self.heads, self.rank = weight.detach(), heads, weight.shape[1]
        self.pos_dim = latent_dim - self.rank
        self.d_nope = d_qk - self.pos_dim
        self.d_v = weight.shape[0] // heads - self.d_nope
        if self.d_nope <= 0 or self.d_v <= 0:
            raise ValueError(f"latent exchange: q head dim {d_qk}, qk_pos_emb_head_dim {self.pos_dim} and "
                             f"linear_kv_up_proj rows {weight.shape[0]} for {heads} heads leave no key / value dims")
        self.weight_grad = None  # this rank's share of d W_up (accumulated by add_grad)

    def pack(self, latent, v=None):
        return latent.contiguous()  # [b, 1, s, r + p]: what the ring sends and the receive buffers copy

    def unpack(self, msg, cols=slice(None)):
        """The block's per-head (k [b, h, n, d_qk], v [b, h, n, d_v]) from its latent rows ``cols``."""
        lat = msg[:, 0, cols]  # [b, n, r + p]
        b, n = lat.shape[:2]
        kv = torch.matmul(lat[..., : self.rank], self.weight.t().to(lat.dtype))  # [b, n, h (d_nope + d_v)]
        kv = kv.view(b, n, self.heads, self.d_nope + self.d_v).transpose(1, 2)
        k_pe = lat[:, None, :, self.rank:].expand(b, self.heads, n, self.pos_dim)
        return torch.cat([kv[..., : self.d_nope], k_pe], dim=-1), kv[..., self.d_nope:]

    def add_grad(self, dmsg, cols, dk, dv, msg):
        lat = msg[:, 0, cols]
        b, n = lat.shape[:2]
        acc = accum_dtype(lat.dtype)
        dkv = torch.cat([dk[..., : self.d_nope], dv], dim=-1).to(acc)  # [b, h, n, d_nope + d_v]
        dkv = dkv.transpose(1, 2).reshape(b * n, -1)  # [tokens, h (d_nope + d_v)]: W_up's output layout
        c = lat[..., : self.rank].reshape(b * n, self.rank).to(acc)
        share = dkv.t() @ c
        self.weight_grad = share if self.weight_grad is None else self.weight_grad.add_(share)
        d_lat = dmsg[:, 0, cols]
        d_lat[..., : self.rank] += (dkv @ self.weight.to(acc)).view(b, n, self.rank)
        d_lat[..., self.rank:] += dk[..., self.d_nope:].sum(1)

    def grads(self, dmsg, latent, v=None):
        return dmsg.to(latent.dtype), None

    # Decoding against a cache of latents (`cp_ext.inference.kv_cache`): the up-projection is absorbed
    # into the query and the output instead of applied to every cached token (DeepSeek-V2's trick):
    #   q_h . k_j = (q_nope_h W_uk_h) . c_j + q_pe_h . k_pe_j        out_h = (sum_j p_hj c_j) W_uv_h^T
    # so one decode step attends [q_nope W_uk | q_pe] (r + p wide) to the cached [c | k_pe] with c as
    # the value, one KV head for all query heads, and up-projects only the [b, h, 1, r] result.
    def absorb_query(self, q):
        """q [b, h, n, d_qk] -> [b, h, n, r + p], the query in the latent's space."""
        w_uk = self.weight.view(self.heads, self.d_nope + self.d_v, self.rank)[:, : self.d_nope].to(q.dtype)
        return torch.cat([torch.einsum("bhnd,hdr->bhnr", q[..., : self.d_nope], w_uk), q[..., self.d_nope:]], dim=-1)

    def up_project_output(self, out):
        """The attention output in the latent's space [b, h, n, r] -> [b, h, n, d_v]."""
        w_uv = self.weight.view(self.heads, self.d_nope + self.d_v, self.rank)[:, self.d_nope:].to(out.dtype)
        return torch.einsum("bhnr,hvr->bhnv", out, w_uv)
