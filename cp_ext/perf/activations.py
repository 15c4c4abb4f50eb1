"""What one layer saves for backward, per token, by part: the count `cp_ext.perf.memory` sums.

Counted from the unique storages autograd holds (tools/measure_memory.py; attributed to modules
with forward hooks), for megatron-core's GPT layer with cp_ext's core attention and
SequentialMLP experts, on the five families of tests/families at CP1 and CP2, fp32 and bf16.
Per token, ``e`` the activation dtype, fp32 where noted, ``d`` the q/k head dim, ``d_v`` the v
head dim:

    norm (x2)   input h and normalized h in fp32 (torch's norm upcasts; apex is absent), rstd fp32,
                its output h (saved by the next linear)
    GQA         mixed QKV (a + 2g) d (v is a view of it); RoPE'd q a d and k g d; RoPE cos/sin 4 d
                qk-norm, fp32: q input + normalized 2 a d, k normalized g d (+ its input g d in bf16,
                a view of the mixed QKV in fp32); rstd a + g
    MLA         kv_down out r + p in fp32 training, or c upcast r in bf16, kv_layernorm's normalized
                r and rstd (fp32); q-LoRA: q_layernorm's input and normalized 2 r_q + rstd (fp32),
                q_up's input r_q; RoPE cos/sin 4 p
                per-head exchange: kv_up input r; q, k a (d_qk + p) each; v a d_v; RoPE'd q_pe a p
                latent exchange (`cp_ext.transformer.mla.takes_latent`): q a (d_qk + p), [c | k_pe] r + p
    core        output a d_v, LSE a fp32; its [s, b, h] copy for linear_proj a d_v except in a
                full-attention GQA layer at CP1 (there the kernel's output is already that layout)
    MLP         gated: fc1 output 2f, two intermediates 2f, fc2 input f (quick-GeGLU with GPT-OSS's
                clamp and offset: one more f); plain: 3f
    MoE         per routed copy (top-k): the permuted input h, the expert MLP as above and one more
                f_e, the routing prob (fp32); shared experts: one MLP of f_s (one f_s fewer with
                --moe-shared-expert-overlap)
                routing, bytes: map E bool + E probs (fp32 with --moe-router-dtype fp32) + k int64,
                the router's scores (`router_saved_bytes`)

Sequence parallelism divides what is in [s, b, h] layout (norms, residual, router) by TP, the
attention and MLP parts are per head / per column and divide by TP too. The MLA latent and
q-LoRA ranks are taken as replicated over TP (counted /SP), an estimate: the latent runs at TP1.
"""

from typing import Dict

from cp_ext.perf.compressed_layers import compressed_attention_elems, hyper_connection_elems
from cp_ext.perf.model_shape import ModelShape


def mla_takes_latent(m: ModelShape, *, tp: int = 1, cp: int = 1, ulysses: int = 1, all_gather: bool = False,
                     exchange: str = "auto") -> bool:
    """`cp_ext.transformer.mla`'s choice (latent_possible + takes_latent), without importing torch."""
    if not m.multi_latent_attention or m.compressed is not None:  # V4's layers exchange their own rows
        return False
    possible = cp > 1 and (all_gather or ulysses == 1) and tp == 1
    smaller = m.kv_lora_rank + m.qk_pos_emb_head_dim < (m.heads // tp) * (m.head_dim + m.v_head_dim)
    return possible and (exchange == "latent" or (exchange == "auto" and smaller))


def mlp_elems(m: ModelShape, f: int) -> int:
    """One MLP of intermediate size f, after its input."""
    if not m.swiglu:
        return 3 * f
    return (6 if m.quick_geglu else 5) * f


def router_saved_bytes(m: ModelShape, e: int = 2) -> int:
    """The router's and dispatcher's saved bytes per token (int64 indices, fp32 scores, a bool map),
    by scoring: measured on the families (Mixtral / Qwen3 softmax + aux loss, GPT-OSS without aux
    loss, DeepSeek-V2 pre-softmax + sequence aux loss, DeepSeek-V3 sigmoid + groups + expert bias).
    The dispatcher's probs are fp32 with --moe-router-dtype fp32, else in the activation dtype ``e``."""
    k, E = m.topk, m.experts
    elementwise = m.moe_router_score_function in ("sigmoid", "sqrtsoftplus")  # a score per expert, kept
    scores = 4 * E if (m.moe_router_pre_softmax or elementwise) else 4 * k
    out = 8 * k + scores + (8 * k + 4 * E if m.moe_aux_loss else 0)
    if m.moe_router_num_groups:
        out += 8 * k * m.moe_router_num_groups + 8 * (m.moe_router_group_topk or 1) + E
    if elementwise:
        out += 4 * k + 8
    probs = 4 if m.moe_router_fp32 else e
    return out + E * (1 + probs) + 8 * k  # the dispatcher's routing map, probs and permutation indices


def attention_elems(m: ModelShape, i: int, *, tp: int, sp: int, cp: int, latent: bool, e: int,
                    up_proj_recompute: bool = False, s: int = 0) -> Dict[str, float]:
    """Attention's saved elements per token (after the first norm's output), by dtype. The norms
    (torch's, without apex) save their input and the normalized tensor in fp32: in bf16 an fp32
    copy of their input, in fp32 the input itself (a view of a saved projection where it is one).

    ``up_proj_recompute`` (``--recompute-modules mla_up_proj``): MLA's up projections' outputs (q and
    per-head K/V, or q and the latent key) are discarded after the forward; their inputs stay (the
    normed latent c, and k_pe, a view of the kv_down output's storage). 'restored' is what the
    recompute brings back for one layer in its backward."""
    if m.compressed is not None:  # DeepSeek-V4's layers (``s``: the sequence, for the tiles' entry masks)
        out = compressed_attention_elems(m.compressed, m.compressed.kind(i), h=m.hidden, a=m.heads, d=m.v_head_dim,
                                         q_rank=m.q_lora_rank, rope=m.qk_pos_emb_head_dim, tp=tp, sp=sp, cp=cp, s=s)
        return dict(out, restored=0.0)
    a, dv = m.heads / tp, m.v_dim
    upcast = e != 4
    act, fp32, restored = 0.0, a, 0.0  # the LSE
    if m.multi_latent_attention:
        r, p, qd = m.kv_lora_rank, m.qk_pos_emb_head_dim, m.head_dim
        act += 4 * p  # RoPE cos / sin
        if m.qk_layernorm:  # kv_layernorm: its input (the kv_down output [c | k_pe] in fp32, c upcast in bf16)
            fp32 += (r + 1 + (r if upcast else 0)) / sp
            act += (0 if upcast else r + p) / sp
        if m.q_lora_rank:
            if m.qk_layernorm:  # q_layernorm's input and normalized r_q (fp32), rstd; q_up's input r_q
                fp32 += (2 * m.q_lora_rank + 1) / sp
            act += m.q_lora_rank / sp
        if up_proj_recompute:
            # kept: c (the norm's output) and k_pe, a view of the kv_down output, whose storage the norm
            # already keeps in fp32 training; without the norm c and k_pe are both views of that storage
            act += (r + (r + p if upcast else 0) if m.qk_layernorm else r + p) / sp
            restored = a * qd + (r + p) if latent else 2 * a * qd + a * dv + a * p
        elif latent:
            act += a * qd + (r + p)
        else:  # kv_up's input (the norm's output, or a view of the kv_down output), per-head q, k, v
            act += (r if m.qk_layernorm else r + p) / sp + 2 * a * qd + a * dv + a * p
        copy = True
    else:
        d, g = m.head_dim, m.kv_heads / tp
        act += (a + 2 * g) * d + a * d + g * d + 4 * d
        if m.qk_layernorm:  # q: an fp32 copy and the normalized; k: the normalized (+ the fp32 copy in bf16)
            fp32 += 2 * a * d + g * d + (g * d if upcast else 0) + a + g
        copy = cp > 1 or m.is_window_layer(min(i, m.layers - 1))
    act += a * dv + (a * dv if copy else 0)  # core output, linear_proj's [s, b, h] copy
    return {"act": act, "fp32": fp32, "copy": a * dv if copy else 0.0, "restored": restored}


def layer_activation_elems(m: ModelShape, i: int = 0, *, tp: int = 1, cp: int = 1, sequence_parallel: bool = True,
                           latent: bool = False, dtype: str = "bf16", up_proj_recompute: bool = False, s: int = 0
                           ) -> Dict[str, float]:
    """Per token, layer i: elements in the activation dtype ('act'), fp32 elements, dtype-free bytes;
    'post_*': the part saved after the attention call (linear_proj's copy, the second norm, the
    MLP / MoE), freed by the time the backward reaches that attention."""
    h, e = m.hidden, 4 if dtype == "fp32" else 2
    sp = tp if sequence_parallel else 1
    attn = attention_elems(m, i, tp=tp, sp=sp, cp=cp, latent=latent, e=e, up_proj_recompute=up_proj_recompute, s=s)
    hc = hyper_connection_elems(m.residual_streams, h=h, sp=sp, iterations=m.mhc_iterations, last=i == m.layers - 1,
                                upcast=e != 4)
    # a norm: its input and the normalized tensor in fp32 (+ rstd), its output (the next linear's input)
    norm, norm_fp32 = h / sp, (2 * h + 1) / sp
    if m.is_moe_layer(min(i, m.layers - 1)):  # an MTP layer (i >= layers) is built like the last layer
        fe = m.expert_ffn
        mlp = m.topk * (h + mlp_elems(m, fe) + fe) / tp
        if m.shared_expert_ffn:  # overlapped with the dispatch, one intermediate fewer is saved (measured)
            mlp += (mlp_elems(m, m.shared_expert_ffn) - (m.shared_expert_ffn if m.shared_expert_overlap else 0)) / tp
        mlp_fp32, mlp_bytes = m.topk / tp, router_saved_bytes(m, e) / sp
    else:
        mlp, mlp_fp32, mlp_bytes = mlp_elems(m, m.ffn) / tp, 0.0, 0.0
    attn_bytes = attn.get("bytes", 0.0)  # V4's tiles: masks and the selection, kept for their recompute
    return {"act": 2 * norm + attn["act"] + mlp + hc["act"], "fp32": 2 * norm_fp32 + attn["fp32"] + mlp_fp32 + hc["fp32"],
            "bytes": mlp_bytes + attn_bytes, "post_act": norm + attn["copy"] + mlp + hc["act"] / 2,
            "post_fp32": norm_fp32 + mlp_fp32 + hc["fp32"] / 2, "post_bytes": mlp_bytes,
            "restored_act": attn["restored"]}


def outside_layers_bytes(m: ModelShape, *, e: int, tp: int = 1, sp: int = 1) -> float:
    """Per token, outside the layers: the final norm (input and normalized in fp32, rstd; its output),
    the fp32 logits (V / TP), the token ids and labels (int64), the loss mask (bool), the per-token loss."""
    return (2 * m.hidden * 4 + 4 + m.hidden * e) / sp + m.vocab / tp * 4 + 8 + 8 + 1 + 4


__all__ = ["attention_elems", "layer_activation_elems", "mla_takes_latent", "mlp_elems", "outside_layers_bytes",
           "router_saved_bytes"]
