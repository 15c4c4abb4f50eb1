"""The gated delta rule on one device, and a segment's summary for CP: Gated DeltaNet (Qwen3-Next, Qwen3.5-MoE)
with a per-head decay, and Kimi Delta Attention (KDA, Kimi-Linear) with a per-key-channel decay.

Owns the arithmetic of one sequence, or one segment of it, in plain torch (CPU or GPU, any float dtype,
exact backward through autograd; no custom kernels). The convention is transformers' (5.25)
``torch_recurrent_gated_delta_rule`` / ``recurrent_kimi_delta_attention`` and FLA's: per batch sample and
head, the state S is K x V and each token

    S <- exp(g_t) S                              (g: log-decay, <= 0; Diag(exp(g_t)) S for KDA's g_t [K])
    S <- S + beta_t k_t (v_t - S^T k_t)^T        (the delta rule: write the part of v_t that S misses)
    o_t = S^T q_t,   q_t already scaled by K**-0.5

so S_t = A_t S_{t-1} + beta_t k_t v_t^T with A_t = (I - beta_t k_t k_t^T) Diag(exp(g_t)), linear in S_{t-1}.
The shape of g picks the decay: [b, s, h] per head, [b, s, h, K] per channel (`cp_ext.linear_attention.kda`).
q and k arrive L2-normalized (megatron-core normalizes them before the rule), or ``qk_l2norm=True``
normalizes them here, after the cast to the accumulation dtype and before the scale (transformers' and
FLA's ``use_qk_l2norm_in_kernel``, which Kimi-Linear uses).
Packed documents reset the state: a new document starts wherever ``document_ids`` changes, and the state
before its first token is dropped (A_t = 0 there). The state and every sum are fp32 (fp64 for fp64 inputs).

`gated_delta_rule` is the chunked (WY / UT) form; `gated_delta_recurrent` the token-by-token reference.
`segment_summary` is what context parallelism (`cp_ext.linear_attention.state_passing`) exchanges: a segment
run from a zero state gives S_out = M S_in + E and o = o0 + Qtilde S_in for whatever S_in really precedes it.

Kernels: both take ``kernel="auto" | "torch" | "fla"``. "torch" is the code below; "fla" runs fla's Triton
kernels on CUDA tensors (`cp_ext.linear_attention.fla_kernels`: the same rule, its rounding); "auto" picks fla
on CUDA when fla imports and the torch rule otherwise, so a CPU call is always the code below.
"""

from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F

from cp_ext.linear_attention.fla_kernels import fla_rule, fla_summary, use_fla
from cp_ext.linear_attention.kda import per_channel_terms


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps) over the last dim (FLA's and transformers' q/k normalization); the rule
    applies it only under ``qk_l2norm=True`` (megatron-core normalizes q and k before it)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def document_resets(document_ids: torch.Tensor, previous_document_id: Optional[torch.Tensor] = None) -> torch.Tensor:
    """[b, s] bool: True where the state is dropped before the token (the id differs from the previous token's).

    The first token resets only if ``previous_document_id`` ([b]: the id of the token before this run,
    e.g. on another CP rank) is given and differs: without it, a run continues its initial state."""
    resets = torch.zeros(document_ids.shape, dtype=torch.bool, device=document_ids.device)
    resets[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    if previous_document_id is not None:
        resets[:, 0] = document_ids[:, 0] != previous_document_id.to(document_ids.device)
    return resets


def _accum_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _check_shapes(q, k, v, g, beta):
    b, s, hk, kd = k.shape
    hv = v.shape[2]
    if (q.shape != k.shape or v.shape[:2] != (b, s) or g.shape not in ((b, s, hv), (b, s, hv, kd))
            or beta.shape != (b, s, hv) or hv % hk):
        raise ValueError(f"gated delta rule shapes: q, k [b, s, h_k, K], v [b, s, h_v, V], g [b, s, h_v] (per head) "
                         f"or [b, s, h_v, K] (per channel), beta [b, s, h_v], with h_k dividing h_v; got "
                         f"q {tuple(q.shape)} k {tuple(k.shape)} v {tuple(v.shape)} g {tuple(g.shape)} "
                         f"beta {tuple(beta.shape)}")


def _resets(document_ids, previous_document_id, b, s, device):
    """`document_resets` of [b, s] ids after checking their shape; all False without ids."""
    if document_ids is None:
        return torch.zeros(b, s, dtype=torch.bool, device=device)
    if document_ids.shape != (b, s):
        raise ValueError(f"document_ids must be [b, s] = {(b, s)}, got {tuple(document_ids.shape)}")
    return document_resets(document_ids, previous_document_id)


def _prepare(q, k, v, g, beta, scale, document_ids, previous_document_id, qk_l2norm=False):
    """The inputs as the loops read them: [b, h, s, d] (g: [b, h, s] or [b, h, s, K], beta: [b, h, s]) in the
    accumulation dtype, q and k normalized if asked, q scaled, q/k heads repeated for grouped value heads
    (as transformers and megatron do), and the resets."""
    _check_shapes(q, k, v, g, beta)
    b, s, hk, kd = k.shape
    hv = v.shape[2]
    if hv != hk:
        q, k = q.repeat_interleave(hv // hk, dim=2), k.repeat_interleave(hv // hk, dim=2)
    acc = _accum_dtype(q.dtype)
    q, k, v, g, beta = (x.transpose(1, 2).to(acc) for x in (q, k, v, g, beta))
    if qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    q = q * (kd ** -0.5 if scale is None else scale)
    return q, k, v, g, beta, _resets(document_ids, previous_document_id, b, s, q.device)


def _initial(state, b, h, kd, vd, like):
    if state is None:
        return like.new_zeros(b, h, kd, vd)
    if state.shape != (b, h, kd, vd):
        raise ValueError(f"initial_state must be [b, h_v, K, V] = {(b, h, kd, vd)}, got {tuple(state.shape)}")
    return state.to(like.dtype)


def _per_head_terms(q, k, k_beta, g, piece, linked):
    """`kda.per_channel_terms` for a per-head g [b, h, n, C] (Gated DeltaNet): the decays are scalars per token
    pair, so the products are plain matmuls; from_start and to_end come back [.., C, 1], through [.., 1, 1]."""
    gamma = g.cumsum(-1)
    # masked to -inf before exp: the pairs a cut or causality removes would otherwise overflow (gamma_j > gamma_i)
    decay = (gamma.unsqueeze(-1) - gamma.unsqueeze(-2)).masked_fill(~linked, float("-inf")).exp()
    from_start = gamma.masked_fill(piece != 0, float("-inf")).exp()
    to_end = (gamma[..., -1:] - gamma).masked_fill(piece != piece[..., -1:], float("-inf")).exp()
    through = gamma[..., -1].masked_fill(piece[..., -1] != 0, float("-inf")).exp()
    lower = (k_beta @ k.transpose(-1, -2)) * decay.tril(-1)
    scores = (q @ k.transpose(-1, -2)) * decay  # diagonal included: o_t reads the state after token t's write
    return lower, scores, from_start.unsqueeze(-1), to_end.unsqueeze(-1), through[..., None, None]


def _chunked(q, k, v, g, beta, resets, state, chunk_size):
    """The chunked rule on prepared [b, h, s, *] tensors: (o [b, h, s, V], final state [b, h, K, V]).

    Within a chunk, with gamma = cumsum(g) (per channel for a per-channel g: then exp(.) below is a diagonal
    matrix) and u_j = beta_j (v_j - (exp(g_j) S_{j-1})^T k_j) the values the state actually receives (FLA's
    "new values"):
        S_i = a_i S0 + sum_{j<=i} L_ij k_j u_j^T,  L_ij = exp(gamma_i - gamma_j),  a_i = exp(gamma_i)
    so (I + A) U = beta V - (beta a k) S0 with A_jl = beta_j k_j^T L_jl k_l (l < j): one unit-triangular
    solve per chunk for both right-hand sides (the UT transform). A document start cuts every decay that
    crosses it: L_ij = 0 across it, a_i = 0 after it, and the chunk passes none of S0 on if one lies in it.
    Only the loop over chunks is sequential; the per-chunk matrices are built for all chunks at once
    (`_per_head_terms`, `kda.per_channel_terms`).
    """
    b, h, s, kd = k.shape
    n = -(-s // chunk_size)
    pad = n * chunk_size - s
    # Padding tokens are inert: beta 0 writes nothing, g 0 decays nothing, so the final state is exact.
    q, k, v = (F.pad(x, (0, 0, 0, pad)).reshape(b, h, n, chunk_size, -1) for x in (q, k, v))
    per_channel = g.dim() == 4
    g = F.pad(g, (0, 0) * per_channel + (0, pad)).reshape(b, h, n, chunk_size, *g.shape[3:])
    beta = F.pad(beta, (0, pad)).reshape(b, h, n, chunk_size)
    # piece: the document starts in its chunk up to and including the token (0: the chunk's incoming state reaches it)
    piece = F.pad(resets.to(torch.int32), (0, pad)).reshape(b, 1, n, chunk_size).cumsum(-1)
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    linked = causal & (piece.unsqueeze(-1) == piece.unsqueeze(-2))
    k_beta = k * beta.unsqueeze(-1)
    terms = per_channel_terms if per_channel else _per_head_terms
    lower, scores, from_start, to_end, through = terms(q, k, k_beta, g, piece, linked)

    # unitriangular=True: the solve reads only the strictly lower part and takes the diagonal as 1 (I + A)
    rhs = torch.cat([v * beta.unsqueeze(-1), k_beta * from_start], dim=-1)
    solved = torch.linalg.solve_triangular(lower, rhs, upper=False, unitriangular=True)
    new_values, k_decayed = solved[..., : v.shape[-1]], solved[..., v.shape[-1]:]
    q_start, k_end = q * from_start, k * to_end

    outs = []
    # unbound once, not indexed per chunk: indexing's backward writes each chunk's gradient into a zero tensor of
    # the whole sequence (O(n) per chunk, O(n^2) in all); unbind's stacks them once
    per_chunk = zip(*(x.unbind(2) for x in (new_values, k_decayed, q_start, scores, through, k_end)))
    for new_v, k_dec, q_st, score, thru, k_e in per_chunk:
        u = new_v - k_dec @ state
        outs.append(q_st @ state + score @ u)
        state = state * thru + k_e.transpose(-1, -2) @ u
    return torch.stack(outs, dim=2).reshape(b, h, n * chunk_size, -1)[:, :, :s], state


def gated_delta_rule(q, k, v, g, beta, *, initial_state=None, chunk_size: int = 64, document_ids=None,
                     previous_document_id=None, scale: Optional[float] = None, qk_l2norm: bool = False,
                     kernel: str = "auto"):
    """The gated delta rule, chunked: (o [b, s, h_v, V] in v's dtype, final state [b, h_v, K, V] fp32/fp64).

    q, k: [b, s, h_k, K]; v: [b, s, h_v, V]; beta: [b, s, h_v]; g (log-decay): [b, s, h_v] (Gated DeltaNet)
    or [b, s, h_v, K] (KDA); ``scale`` defaults to K**-0.5; ``qk_l2norm``: normalize q and k first.
    ``document_ids`` [b, s]: packed documents, the state resets where the id changes (see `document_resets`
    for the first token and ``previous_document_id``). Any s: the last chunk is padded with inert tokens.
    ``kernel``: "auto", "torch" or "fla" (module docstring).
    """
    if use_fla(kernel, q, k, v, g):
        return _by_fla(q, k, v, g, beta, initial_state, document_ids, previous_document_id, scale, qk_l2norm)
    out_dtype = v.dtype
    q, k, v, g, beta, resets = _prepare(q, k, v, g, beta, scale, document_ids, previous_document_id, qk_l2norm)
    b, h, _, kd = k.shape
    o, state = _chunked(q, k, v, g, beta, resets, _initial(initial_state, b, h, kd, v.shape[-1], q), chunk_size)
    return o.transpose(1, 2).to(out_dtype), state


def gated_delta_recurrent(q, k, v, g, beta, *, initial_state=None, document_ids=None, previous_document_id=None,
                          scale: Optional[float] = None, qk_l2norm: bool = False):
    """The same rule token by token (the reference the chunked form is tested against; O(s) small steps)."""
    out_dtype = v.dtype
    q, k, v, g, beta, resets = _prepare(q, k, v, g, beta, scale, document_ids, previous_document_id, qk_l2norm)
    b, h, s, kd = k.shape
    state = _initial(initial_state, b, h, kd, v.shape[-1], q)
    outs = []
    for t in range(s):
        decay = g[:, :, t] if g.dim() == 4 else g[:, :, t, None]  # [b, h, K or 1]: a row of the state each
        keep = decay.exp().masked_fill(resets[:, t, None, None], 0.0)  # a document start drops the state
        state = state * keep[..., None]
        delta = beta[:, :, t, None] * (v[:, :, t] - (state * k[:, :, t, :, None]).sum(-2))
        state = state + k[:, :, t, :, None] * delta[..., None, :]
        outs.append((state * q[:, :, t, :, None]).sum(-2))
    return torch.stack(outs, dim=1).to(out_dtype), state


class SegmentSummary(NamedTuple):
    """A segment run from a zero state, and how its results depend on the state S_in that precedes it:
    o = o0 + Qtilde @ S_in per token and head, S_out = M @ S_in + E (fp32, fp64 for fp64 inputs)."""

    o0: torch.Tensor  # [b, s, h_v, V]: the outputs from a zero state
    qtilde: torch.Tensor  # [b, s, h_v, K]: row t is q_t^T M_t (M_t: the transitions up to token t)
    transition: torch.Tensor  # M [b, h_v, K, K] = A_s ... A_1 (zero from the segment's last document start on)
    contribution: torch.Tensor  # E [b, h_v, K, V]: the final state from a zero state


def segment_summary(q, k, v, g, beta, *, chunk_size: int = 64, document_ids=None, previous_document_id=None,
                    scale: Optional[float] = None, qk_l2norm: bool = False, kernel: str = "auto") -> SegmentSummary:
    """`SegmentSummary` of one segment, exact and differentiable, from one chunked pass.

    The rule is linear in the state column by column, with every column seeing the same A_t. So the
    pass runs with v widened by K zero columns and the initial state [0 | I]: the first V columns are
    the zero-state run (o0, E); the other K carry the identity through the transitions, giving
    M = A_s ... A_1 I as the final state and M_t^T q_t (= Qtilde's rows) as the outputs. Cost: the
    per-chunk products run on V + K columns instead of V. Per-head or per-channel g alike (A_t's decay).
    ``kernel``: "auto", "torch" or "fla" (module docstring); fla runs the same widened pass in one call.
    """
    if use_fla(kernel, q, k, v, g):
        return SegmentSummary(*_by_fla(q, k, v, g, beta, None, document_ids, previous_document_id, scale, qk_l2norm,
                                       summary=True))
    q, k, v, g, beta, resets = _prepare(q, k, v, g, beta, scale, document_ids, previous_document_id, qk_l2norm)
    b, h, s, kd = k.shape
    vd = v.shape[-1]
    widened = torch.cat([v, v.new_zeros(b, h, s, kd)], dim=-1)
    eye = torch.eye(kd, dtype=v.dtype, device=v.device).expand(b, h, kd, kd)
    state = torch.cat([v.new_zeros(b, h, kd, vd), eye], dim=-1)
    o, final = _chunked(q, k, widened, g, beta, resets, state, chunk_size)
    o = o.transpose(1, 2)
    return SegmentSummary(o[..., :vd], o[..., vd:], final[..., vd:], final[..., :vd])


# ------------------------------------------------------------- the fla kernels (cp_ext.linear_attention.fla_kernels)
def _by_fla(q, k, v, g, beta, initial_state, document_ids, previous_document_id, scale, qk_l2norm, summary=False):
    """The rule (or, with ``summary``, the summary's fields) by fla, after the torch path's checks of the inputs."""
    _check_shapes(q, k, v, g, beta)
    b, s, hv, vd = v.shape
    kd = k.shape[-1]
    if initial_state is not None and initial_state.shape != (b, hv, kd, vd):
        raise ValueError(f"initial_state must be [b, h_v, K, V] = {(b, hv, kd, vd)}, got {tuple(initial_state.shape)}")
    # None without ids: fla then runs the batch as it is, with no host synchronization to find document starts
    resets = None if document_ids is None else _resets(document_ids, previous_document_id, b, s, v.device)
    scale = kd ** -0.5 if scale is None else scale
    if summary:
        return fla_summary(q, k, v, g, beta, resets=resets, scale=scale, qk_l2norm=qk_l2norm)
    return fla_rule(q, k, v, g, beta, initial_state=initial_state, resets=resets, scale=scale, qk_l2norm=qk_l2norm)
