"""Kimi Delta Attention (KDA, Kimi-Linear): the gated delta rule's within-chunk terms for a per-channel decay.

KDA's state update is transformers' (5.25) ``recurrent_kimi_delta_attention`` and FLA's ``chunk_kda``:
S <- Diag(exp(g_t)) S, then Gated DeltaNet's delta rule unchanged, with g_t [K] one log-decay per key channel
(per row of the K x V state); a g_t constant across channels is Gated DeltaNet's exp(g_t) S. `per_channel_terms`
builds, for every chunk at once, what `cp_ext.linear_attention.gated_delta`'s chunk loop reads (its per-head
twin: `gated_delta._per_head_terms`). With gamma the per-channel cumulative log-decays within the chunk and
D_ij = Diag(exp(gamma_i - gamma_j)):

    lower_ij  = beta_i k_i^T D_ij k_j   (j < i)      the UT transform's strictly lower part
    scores_ij = q_i^T D_ij k_j          (j <= i)     the intra-chunk outputs
    from_start_i = exp(gamma_i),  to_end_j = exp(gamma_last - gamma_j),  through = exp(gamma_last)

Per channel, D_ij does not factor into a row and a column term without exp(-gamma_j), which overflows once a
channel's decay over the chunk passes ~88 (fp32); so these terms build the [C, C, K] pairwise decays, every
exponent <= 0 after masking. Memory: O(b h s C K) against Gated DeltaNet's O(b h s C); a smaller chunk size
shrinks it. A document start cuts every decay that crosses it, per channel exactly as per head.
"""

import torch


def per_channel_terms(q, k, k_beta, g, piece, linked):
    """The chunk loop's terms for chunked [b, h, n, C, K] q, k, k_beta (= beta k) and g [b, h, n, C, K].

    piece [b, 1, n, C]: the document starts in the chunk up to and including the token; linked
    [b, 1, n, C, C]: the causal pairs within one document. Returns (lower [.., C, C], scores [.., C, C],
    from_start [.., C, K], to_end [.., C, K], through [.., K, 1]), each zero where a document start cuts it.
    """
    gamma = g.cumsum(-2)
    # [.., i, j, K]: exp(gamma_i - gamma_j), masked to -inf before exp off the linked pairs (overflow otherwise)
    decay = (gamma.unsqueeze(-2) - gamma.unsqueeze(-3)).masked_fill(~linked.unsqueeze(-1), float("-inf")).exp()
    decayed_keys = decay * k.unsqueeze(-3)  # D_ij k_j
    # both left factors in one batched product per row i: [.., i, j, K] @ [.., i, K, 2] -> [.., i, j, 2]
    both = decayed_keys @ torch.stack([k_beta, q], dim=-1)
    starts = (piece != 0).unsqueeze(-1)
    from_start = gamma.masked_fill(starts, float("-inf")).exp()
    to_end = (gamma[..., -1:, :] - gamma).masked_fill((piece != piece[..., -1:]).unsqueeze(-1), float("-inf")).exp()
    through = gamma[..., -1, :].masked_fill(starts[..., -1, :], float("-inf")).exp()
    # lower: the solve takes the diagonal as 1 and must see zeros above it; scores keep the diagonal
    return both[..., 0].tril(-1), both[..., 1], from_start, to_end, through.unsqueeze(-1)
