"""A KV cache sharded the way context parallelism sharded the prompt, and decode attention on it.

A CP group of C = U x R ranks (U Ulysses, R ring) prefills a prompt with the training
layout. Rank (u, r) then keeps, for every layer, what the hybrid attention held at its ring
step: the keys and values of **ring shard r** (its ring's tokens) for the **u-th slice of the
KV heads** (after the GQA replication of `cp_ext.attention.cp.ulysses.kv_replicas`)::

    pure ring (U = 1)     rank r: its sequence shard, all heads
    pure Ulysses (R = 1)  rank u: the whole prompt, heads u*h/U ... (u+1)*h/U
    hybrid                rank (u, r): ring shard r, head slice u

so each rank holds 1/C of the cache and no rank holds all of it unless C = 1. Keys are cached
after RoPE (at their global positions), so their order in the cache does not matter; each cached
token's position is kept beside it, so a sliding window selects the tokens it reaches on every
rank, and a sink enters after the merge of step 4, as in training's finish step.

Decoding one token (the same hidden state on every CP rank; the new token attends to every
cached key, so there is no mask)::

    1. q, k, v of the new token; this rank keeps its head slice u of each
    2. ring rank (t mod R) of every ring appends k, v: new tokens are dealt round robin
    3. local attention of q against this rank's cache            -> (out, lse) partial
    4. all-gather (out, lse) over the ring group, LSE merge       -> out for heads u
       (`cp_ext.attention.cp.primitives.update_out_and_lse`, training's ring merge)
    5. all-gather the head slices over the Ulysses group          -> out for all heads

A multi-latent attention layer under the latent exchange (``--cp-mla-exchange latent``,
`cp_ext.transformer.mla`) caches the latent ``[c | k_pe]`` (kv_lora_rank + qk_pos_emb_head_dim per
token, one "head") instead of every head's K/V, and decodes with the up-projection absorbed into
the query and the output (`cp_ext.attention.cp.kv_message.LatentKV.absorb_query`): 576 values per
token and layer instead of 128 x (192 + 128) = 40,960 at DeepSeek-V3 size.

Per decoded token and layer a rank sends (and receives) (R-1) x b x h/U x (d+1) fp32 values in its
ring and (U-1) x b x h/U x d in its Ulysses group (`decode_bytes_per_token_layer`; counted as
``decode_ring_gather`` / ``decode_ulysses_gather`` by `cp_ext.perf.counter`).
"""

from typing import List, Optional

import torch
import torch.distributed as dist

from cp_ext.attention.kernels import get_kernel
from cp_ext.attention.cp.kv_message import LatentKV
from cp_ext.attention.cp.ulysses import kv_replicas, seq_to_heads
from cp_ext.attention.cp.primitives import accum_dtype, add_sink, update_out_and_lse
from cp_ext.token_partition import context_parallel_positions
from cp_ext.perf.counter import COMM_COUNTER


def decode_bytes_per_token_layer(batch, heads, head_dim, ulysses, ring, itemsize=4):
    """Bytes one rank sends (and receives) per decoded token and layer: its (out, LSE) partial of its
    head slice to the R-1 other ring ranks, then its head slice of the output to the U-1 others."""
    local_heads = heads // ulysses
    return itemsize * batch * local_heads * ((ring - 1) * (head_dim + 1) + (ulysses - 1) * head_dim)


def merge_partials(out: torch.Tensor, lse: torch.Tensor, group, size: int):
    """Every rank's partial attention (out [b, h, 1, d], lse [b, h, 1]: over its own keys) merged over ``group``
    (``size`` ranks): one all-gather of (out, lse), then the LSE merge in group-rank order on every rank, so
    every rank gets the same bits."""
    if size == 1:
        return out, lse
    packed = torch.cat([out, lse.unsqueeze(-1)], dim=-1).contiguous()  # one message: [b, h', 1, d+1]
    parts = [torch.empty_like(packed) for _ in range(size)]
    if COMM_COUNTER.enabled:
        COMM_COUNTER.add("decode_ring_gather", packed.nbytes * (size - 1))
    dist.all_gather(parts, packed, group=group)
    merged_out, merged_lse = parts[0][..., :-1].clone(), parts[0][..., -1].clone()
    for part in parts[1:]:
        update_out_and_lse(merged_out, merged_lse, part[..., :-1], part[..., -1])
    return merged_out, merged_lse


class LayerKVCache:
    """One layer's keys [b, hk', capacity, d] and values [.., d_v] on this rank, filled to ``length``,
    and the global position of each cached token (a sliding window selects by it). Values None: the
    keys are MLA latents [b, 1, capacity, r + p], which serve as values too."""

    def __init__(self, keys: torch.Tensor, values: Optional[torch.Tensor], room: int, positions: torch.Tensor):
        b, hk, s, d = keys.shape
        self.keys = keys.new_empty(b, hk, s + room, d)
        self.values = None if values is None else values.new_empty(b, hk, s + room, values.shape[-1])
        self.positions = torch.empty(s + room, dtype=torch.long, device=keys.device)
        self.keys[:, :, :s], self.positions[:s] = keys, positions
        if values is not None:
            self.values[:, :, :s] = values
        self.length = s

    def append(self, k: torch.Tensor, v: Optional[torch.Tensor], position: int) -> None:
        if self.length == self.keys.shape[2]:
            raise RuntimeError("KV cache full: more tokens than the generation asked room for")
        self.keys[:, :, self.length] = k
        if v is not None:
            self.values[:, :, self.length] = v
        self.positions[self.length] = position
        self.length += 1

    def view(self, since: Optional[int] = None):
        """Keys, values (of the tokens at positions >= ``since``, all without it); values None for latents."""
        keys = self.keys[:, :, :self.length]
        values = None if self.values is None else self.values[:, :, :self.length]
        if since is None:
            return keys, values
        keep = (self.positions[:self.length] >= since).nonzero().squeeze(1)
        return keys.index_select(2, keep), None if values is None else values.index_select(2, keep)

    def bytes_per_token(self) -> int:
        row = self.keys[:, :, :1].nelement() + (0 if self.values is None else self.values[:, :, :1].nelement())
        return row * self.keys.element_size()


class ShardedKVCache:
    """Every layer's cache on this rank, and the CP exchange of a decode step.

    ``room``: decode tokens this rank may have to keep (appends beyond the prompt)."""

    def __init__(self, num_layers: int, *, ulysses_group=None, ring_group=None, room: int, kernel: str = "auto",
                 layout: str = "zigzag"):
        self.layers: List[Optional[LayerKVCache]] = [None] * num_layers
        self.ulysses_group, self.ring_group = ulysses_group, ring_group
        self.ulysses_size = dist.get_world_size(ulysses_group) if dist.is_initialized() else 1
        self.ring_size = dist.get_world_size(ring_group) if dist.is_initialized() else 1
        self.ulysses_rank = dist.get_rank(ulysses_group) if dist.is_initialized() else 0
        self.ring_rank = dist.get_rank(ring_group) if dist.is_initialized() else 0
        self.room, self.kernel, self.layout = room, kernel, layout
        self.decoding = False  # False: the model's attention runs a prefill and stores its k, v here
        self.decoded = 0  # tokens decoded so far: who appends the next one
        # linear-attention layers' states and conv tails, by layer (`cp_ext.linear_attention.generation_state`)
        self.linear = {}
        # DeepSeek-V4's layers' windows, entries and open blocks, by layer (`cp_ext.inference.compressed_cache`)
        self.compressed = {}
        self.position = 0  # the global position of the token being decoded (set by the generator)

    # ------------------------------------------------------------ prefill
    def store_prefill(self, layer: int, key: torch.Tensor, value: Optional[torch.Tensor], num_heads: int) -> None:
        """Keep this rank's share of a prefill's k, v ([s_local, b, hk, d], after RoPE), or of MLA's
        latent (key [s_local, b, r + p], value None; the latent exchange runs with U = 1).

        The Ulysses all-to-all gives this rank its ring shard for its head slice, exactly what
        the attention's own exchange gives it (`cp_ext.attention.cp.context_parallel`, `_CallContext.to_heads`)."""
        if value is None:
            key = key.unsqueeze(2)  # one "head" of latents
        rep = 1 if value is None else kv_replicas(num_heads, key.shape[2], self.ulysses_size)
        if rep > 1:
            key, value = key.repeat_interleave(rep, dim=2), value.repeat_interleave(rep, dim=2)
        to_cache = lambda x: seq_to_heads(x, self.ulysses_group).permute(1, 2, 0, 3)  # -> [b, hk', s_ring, d]
        room = -(-self.room // self.ring_size)  # round robin: at most ceil(room / R) appends on one ring rank
        ring_shard = key.shape[0] * self.ulysses_size
        if self.ring_size == 1:  # the whole prompt, in order (any length: CP = 1 prefills odd lengths too)
            positions = torch.arange(ring_shard, device=key.device)
        else:
            positions = context_parallel_positions(ring_shard * self.ring_size, ring_rank=self.ring_rank,
                                                   ring_size=self.ring_size, layout=self.layout, device=key.device)
        self.layers[layer] = LayerKVCache(to_cache(key).contiguous(),
                                          None if value is None else to_cache(value).contiguous(), room, positions)

    def start_empty(self) -> None:
        """Empty caches, for a prompt too short for any CP prefill (every token is decoded): each
        layer's is made by its first decode step, shaped like what that layer caches."""
        self.layers = [None] * len(self.layers)
        self.linear = {}
        self.compressed = {}

    def _empty_layer(self, k: torch.Tensor, v: Optional[torch.Tensor]) -> LayerKVCache:
        """An empty cache for rows like ``k`` / ``v`` [b, hk', d] (this rank's share of one token)."""
        none = torch.empty(0, dtype=torch.long, device=k.device)
        empty = lambda x: x.new_empty(x.shape[0], x.shape[1], 0, x.shape[2])  # noqa: E731
        return LayerKVCache(empty(k), None if v is None else empty(v), -(-self.room // self.ring_size), none)

    # ------------------------------------------------------------ decode
    def _my_heads(self, x: torch.Tensor, rep: int = 1) -> torch.Tensor:
        """[1, b, heads, d] -> this Ulysses rank's head slice in kernel layout [b, heads', 1, d]."""
        if rep > 1:
            x = x.repeat_interleave(rep, dim=2)
        n = x.shape[2] // self.ulysses_size
        return x[:, :, self.ulysses_rank * n:(self.ulysses_rank + 1) * n].permute(1, 2, 0, 3)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: Optional[torch.Tensor], softmax_scale: float,
               window_size=None, softmax_offset: Optional[torch.Tensor] = None,
               up_weight: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Attention of one new token (q [1, b, h, d], its k/v [1, b, hk, d_v]; under sequence
        parallelism [TP, ...] identical copies) over the whole sequence so far; returns [1, b, h, d_v],
        the same on every rank of the CP group. ``window_size`` (left, right): only the cached tokens
        at positions >= position - left are seen (each rank selects its own); ``softmax_offset`` [h]:
        the sink, added once the ring's partial results are merged, as in training. With
        ``up_weight`` (MLA's latent exchange) k is the token's latent [1, b, r + p] and v None."""
        copies = q.shape[0]  # > 1 only under sequence parallelism: identical copies of the one token
        q, k = q[:1], k[:1].unsqueeze(2) if v is None else k[:1]
        v = None if v is None else v[:1]
        rep = 1 if v is None else kv_replicas(q.shape[2], k.shape[2], self.ulysses_size)
        k_mine, v_mine = self._my_heads(k, rep)[:, :, 0], None if v is None else self._my_heads(v, rep)[:, :, 0]
        if self.layers[layer] is None:  # start_empty: this layer's first token
            self.layers[layer] = self._empty_layer(k_mine, v_mine)
        cache = self.layers[layer]
        if self.decoded % self.ring_size == self.ring_rank:
            cache.append(k_mine, v_mine, self.position)
        q_mine = self._my_heads(q)
        left = None if window_size is None or window_size[0] < 0 else window_size[0]
        keys, values = cache.view(None if left is None else self.position - left)
        latent = None if up_weight is None else LatentKV(up_weight, q_mine.shape[1], q_mine.shape[-1], keys.shape[-1])
        if latent is not None:  # the up-projection absorbed: latents are the keys, their c the values
            q_mine, values = latent.absorb_query(q_mine), keys[..., : latent.rank]
        acc = accum_dtype(q.dtype)
        if keys.shape[2]:
            kernel = get_kernel(q.device, q.dtype, self.kernel, head_dim=q_mine.shape[-1], v_head_dim=values.shape[-1])
            out, lse = kernel.forward(q_mine, keys, values, causal=False, scale=softmax_scale)
        else:  # the window holds none of this rank's tokens
            out = q_mine.new_zeros(q_mine.shape[:3] + values.shape[-1:])
            lse = torch.full(q_mine.shape[:3], float("-inf"), dtype=acc, device=q.device)
        if latent is not None:
            out = latent.up_project_output(out.to(acc))
        out, lse = self._merge_over_ring(out.to(acc), lse.to(acc))
        if softmax_offset is not None:
            n = q.shape[2] // self.ulysses_size
            out, _ = add_sink(out, lse, softmax_offset[self.ulysses_rank * n:(self.ulysses_rank + 1) * n])
        return self._gather_heads(out.to(q.dtype)).expand(copies, -1, -1, -1)

    def attend_sparse(self, layer: int, q, row, index_q, index_w, **settings):
        """DeepSeek sparse attention's decode step on this cache (`cp_ext.inference.dsa_decode.decode_sparse`)."""
        from cp_ext.inference.dsa_decode import decode_sparse

        return decode_sparse(self, layer, q, row, index_q, index_w, **settings)

    def store_compressed(self, layer: int, kept, spec, rate: Optional[int], group) -> None:
        """Keep a DeepSeek-V4 layer's share of a prefill (`cp_ext.inference.compressed_cache`); ``group``: the CP
        group its attention ran over (the whole CP group, under Ulysses too), None for one rank."""
        from cp_ext.inference.compressed_cache import CompressedLayerCache

        self.compressed[layer] = CompressedLayerCache.from_prefill(kept, spec, rate, group)

    def attend_compressed(self, layer: int, q, kv, compressors, sinks, spec, group, index_q=None,
                          index_w=None) -> torch.Tensor:
        """A DeepSeek-V4 layer's decode step on its share (`CompressedLayerCache.step`): q [H, D], kv [D] rotated at
        `position`; ``compressors``: the layer's (then its indexer's), each with the token's rows [copies, 1, F]."""
        from cp_ext.inference.compressed_cache import CompressedLayerCache

        if layer not in self.compressed:  # start_empty: this layer's first token
            self.compressed[layer] = CompressedLayerCache.empty(spec, compressors, group, kv)
        cache = self.compressed[layer]
        turn = self.decoded % cache.size == cache.rank
        return cache.step(q, kv, compressors, sinks, index_q, index_w, self.position, turn)

    def finish_token(self) -> None:
        """Called once per decoded token, after every layer: the next one goes to the next ring rank."""
        self.decoded += 1

    def _merge_over_ring(self, out, lse):
        return merge_partials(out, lse, self.ring_group, self.ring_size)

    def _gather_heads(self, out):
        """[b, h/U, 1, d] head slices of the Ulysses group -> [1, b, h, d]."""
        if self.ulysses_size > 1:
            parts = [torch.empty_like(out) for _ in range(self.ulysses_size)]
            if COMM_COUNTER.enabled:
                COMM_COUNTER.add("decode_ulysses_gather", out.nbytes * (self.ulysses_size - 1))
            dist.all_gather(parts, out.contiguous(), group=self.ulysses_group)
            out = torch.cat(parts, dim=1)
        return out.permute(2, 0, 1, 3)

    def bytes_held(self) -> int:
        """The cache bytes this rank holds (keys and values, or latents; filled part; linear layers' states;
        DeepSeek-V4's windows, entries and open blocks)."""
        return (sum(c.length * c.bytes_per_token() for c in self.layers if c)
                + sum(state.bytes_held() for state in self.linear.values())
                + sum(c.nbytes() for c in self.compressed.values()))
