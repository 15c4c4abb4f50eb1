"""A decode step of DeepSeek sparse attention (DSA) on the CP-sharded KV cache, exact over all ranks.

The cache (`cp_ext.inference.kv_cache.ShardedKVCache`) keeps, per DSA layer and cached token, one row
``[c | k_pe | k_I]``: MLA's latent (which serves as key and value in MQA mode, `cp_ext.attention.dsa.sparse_attention`)
and the indexer's key, ``kv_lora_rank + qk_pos_emb_head_dim + index_head_dim`` values. Ring rank r holds its
prefill shard and every R-th decoded token, as for MLA. One new token (the same on every CP rank)::

    1. its row is appended on the ring rank whose turn it is
    2. each rank scores its cached indexer keys (`index_scores`) and keeps its own top-k candidates
       (canonical order: score descending, then position ascending: `RunningTopK`)
    3. all-gather the candidates (k scores and positions per rank) over the ring; every rank merges them
       in the same order: the global top-k, exactly what one rank holding every key would choose
    4. each rank attends the absorbed query to its cached latents among the chosen positions
       -> (out, lse), merged over the ring as MLA's decode merges (`ShardedKVCache._merge_over_ring`)

Per token and layer a rank sends its k candidates (2k values per sample) besides MLA's (out, lse).
"""

import torch
import torch.distributed as dist

from cp_ext.attention.dsa.indexer import RunningTopK, index_scores
from cp_ext.attention.cp.primitives import accum_dtype


def global_topk(state: RunningTopK, group, size: int):
    """Every ring rank's candidates ([b, 1, k] scores and positions) merged into the global top-k positions."""
    values, positions = state.values, state.positions
    if size > 1:
        packed = torch.cat([values, positions.to(values.dtype)], dim=-1).contiguous()
        parts = [torch.empty_like(packed) for _ in range(size)]
        dist.all_gather(parts, packed, group=group)
        k = values.shape[-1]
        values = torch.cat([p[..., :k] for p in parts], dim=-1)
        positions = torch.cat([p[..., k:] for p in parts], dim=-1).to(torch.int64)
    best = RunningTopK._best(values, positions, state.k)
    return positions.gather(-1, best)[:, 0]  # [b, k], -1 where fewer keys exist


def decode_sparse(cache, layer: int, q: torch.Tensor, row: torch.Tensor, index_q: torch.Tensor,
                  index_w: torch.Tensor, *, topk: int, softmax_scale: float, latent_width: int,
                  value_width: int) -> torch.Tensor:
    """One token's DSA over the whole sequence so far: q [1, b, h, latent_width] (absorbed), its cache row
    [1, b, latent_width + D], the indexer's q [1, b, H, D] and weights [1, b, H]. Returns the attention in
    the latent's space [1, b, h, value_width], the same on every rank of the ring."""
    b = q.shape[1]
    mine = row[0].unsqueeze(1)  # [b, 1, w]: one "head" of rows
    if cache.layers[layer] is None:  # start_empty: this layer's first token
        cache.layers[layer] = cache._empty_layer(mine, None)
    stored = cache.layers[layer]
    if cache.decoded % cache.ring_size == cache.ring_rank:
        stored.append(mine, None, cache.position)
    keys = stored.keys[:, 0, :stored.length]  # [b, n, w]
    positions = stored.positions[:stored.length]
    acc = accum_dtype(q.dtype)
    here = torch.tensor([cache.position], device=q.device)
    state = RunningTopK(b, here, topk, acc)
    if keys.shape[1]:
        state.add(index_scores(index_q.transpose(0, 1), index_w.transpose(0, 1), keys[..., latent_width:]), positions)
    chosen = global_topk(state, cache.ring_group, cache.ring_size)  # [b, k]
    picked = (positions.view(1, -1, 1) == chosen.view(b, 1, -1)).any(-1)  # [b, n]: my keys that were chosen
    latents = keys[..., :latent_width].to(acc)
    scores = torch.einsum("bhd,bnd->bhn", q[0].to(acc), latents).mul_(softmax_scale)
    scores.masked_fill_(~picked.unsqueeze(1), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [b, h]; -inf where none of my keys was chosen
    out = torch.einsum("bhn,bnv->bhv", torch.exp(scores - lse.unsqueeze(-1)).nan_to_num_(0.0),
                       latents[..., :value_width])
    out, lse = cache._merge_over_ring(out.unsqueeze(2), lse.unsqueeze(2))  # [b, h, 1, v]
    return out.permute(2, 0, 1, 3).to(q.dtype)
