"""Bytes sent per rank by each collective, by formula (one place for the benchmark and the planner).

All functions return bytes *sent by one rank* (what leaves it), split into forward and
backward, for one attention call (CP) or one transformer layer (TP, EP). Notation: b batch,
h query heads, hk KV heads, d head dim, ``s_local`` the tokens one rank holds (s / C),
``e`` bytes per element of the activations, ``acc`` bytes per element of the fp32 (fp64
for fp64) accumulators.

Ring (`cp_ext.attention.cp.ring`), R ranks, KV block = one ``[2, b, hk, s_local, d]`` message:

    forward : (R-1) x KV                     KV  = 2 b hk s_local d e
    backward: (R-1) x KV + R x dKV           dKV = 2 b hk s_local d acc  (fp32 accumulator;
                                             R hops: the last one brings each block home)

Ulysses (`cp_ext.attention.cp.ulysses`), U ranks: every exchange is an all-to-all of the local
tensor, of which (U-1)/U leaves the rank; KV heads are replicated to hk' = hk x U/gcd(hk, U)
when hk < U (none otherwise):

    forward : (U-1)/U x (q + k + v + out)    q = out = b h s_local d e, k = v = b hk' s_local d e
    backward: (U-1)/U x (dout + dq + dk + dv) = the forward's bytes

Hybrid (`cp_ext.attention.cp.context_parallel`), C = U x R: Ulysses on the s/C-token shard, then the ring
over R ranks on s/R tokens with h/U query heads and hk'/U KV heads.

All-gather (`cp_ext.attention.cp.all_gather`), C ranks: K/V all-gathered in the forward and again
in the backward (each rank sends its block to the C-1 others), then the full-sequence dK/dV
(fp32 accumulator) reduce-scattered, each rank sending the C-1 blocks it does not own:

    all_gather_kv     : forward (C-1) x KV, backward (C-1) x KV       KV  = 2 b hk s_local d e
    reduce_scatter_dkv: backward (C-1) x dKV                          dKV = 2 b hk s_local d acc

(counted at the call sites as a ring implementation of the collective sends them; packed
documents change none of it: every rank still needs every block).

Multi-latent attention (`cp_ext.transformer.mla`), ``--cp-mla-exchange``: the ring's and the
all-gather's message per token is ``h (d_qk + d_v)`` values with ``kv`` (k and v side by side,
d_qk = qk_head_dim + qk_pos_emb_head_dim) and ``kv_lora_rank + qk_pos_emb_head_dim`` with
``latent``; the same hops and accumulators as above carry it (`mla_exchange_bytes`).

Tensor parallelism, t ranks, per layer (activations [s/C, b, hidden]): with sequence
parallelism 2 all-gathers + 2 reduce-scatters forward and the same backward, each sends
(t-1)/t x s/C b hidden e; without it 2 all-reduces forward and 2 backward, each 2(t-1)/t of that.

Expert parallelism (alltoall dispatcher, uniform routing), EP ranks, per MoE layer: dispatch
and combine forward, the same backward, each sends (EP-1)/EP x tokens x topk x hidden x e, with
tokens = s/C x b / t the tokens one rank routes (after sequence parallelism).

Linear attention, the gated delta rule (`cp_ext.linear_attention`), one layer on C ranks; counted by
collective (all_gather, reduce_scatter, all_to_all, p2p) as `cp_ext.perf.sent_bytes` records a run's calls.
h the value heads, K / V the key / value head dims, per = 2 segments a rank (zigzag) or 1 (contiguous),
acc the fp32 (fp64) state, e the activations, ids 8-byte document ids (only with packed documents):

    state passing, all-gather:  all_gather fwd (C-1) per b h K (K + V) acc  (+ (C-1) per b 2 ids)
                                reduce_scatter bwd (C-1) per b h K (K + V) acc
    state passing, ring:        p2p fwd n_r (b h K V acc (+ b ids)), bwd n'_r b h K V acc; n_r (n'_r): rank r's
                                segments whose successor (predecessor) another rank holds; at most 2
    head parallel (all-to-all): all_to_all fwd (C-1)/C (q + k + v + g + beta + out), bwd the same
                                (+ all_gather fwd (C-1) b s/C ids); q = k = b s/C h_k K e, v = out = b s/C h V e,
                                g = b s/C h e (x K per channel), beta = b s/C h e
    hybrid U x R:               head parallel over U on the s/C shard, then state passing over R with h/U heads
    conv halo, kernel w:        all_gather fwd (C-1) per b min(w-1, L) d e  (+ ids), reduce_scatter bwd the
                                same without ids; d the conv channels, L = s/C/per the segment length

megatron-core's GDN layer (the all-to-all method) moves the pre-conv q, k, v (the conv then runs locally,
no halo), the output gate z (b s/C h V e), beta, the decay's input and the gated output:
`gated_delta_layer_bytes` adds the gate to its all-to-all and the conv halo to state passing.
"""

import math
from typing import Dict, Optional

DTYPE_BYTES = {"fp64": 8, "fp32": 4, "bf16": 2, "fp16": 2}


def acc_bytes(dtype: str) -> int:
    """Bytes per element of the ring's accumulators (fp32, fp64 for fp64 inputs)."""
    return 8 if dtype == "fp64" else 4


def kv_replicas(h: int, hk: int, u: int) -> int:
    """KV head replication before the Ulysses exchange (as `cp_ext.attention.cp.ulysses.kv_replicas`)."""
    return u // math.gcd(hk, u)


def ring_bytes(*, b: int, hk: int, s_local: int, d: int, ring: int, dtype: str) -> Dict[str, int]:
    """Ring P2P bytes sent per rank for one attention call on a ring of ``ring`` ranks."""
    if ring <= 1:
        return {"fwd": 0, "bwd": 0}
    kv = 2 * b * hk * s_local * d * DTYPE_BYTES[dtype]
    dkv = 2 * b * hk * s_local * d * acc_bytes(dtype)
    return {"fwd": (ring - 1) * kv, "bwd": (ring - 1) * kv + ring * dkv}


def ulysses_bytes(*, b: int, h: int, hk: int, s_local: int, d: int, ulysses: int, dtype: str) -> Dict[str, int]:
    """Ulysses all-to-all bytes sent per rank for one attention call on ``ulysses`` ranks."""
    u = ulysses
    if u <= 1:
        return {"fwd": 0, "bwd": 0}
    e = DTYPE_BYTES[dtype]
    hk_rep = hk * kv_replicas(h, hk, u)
    q = b * h * s_local * d * e
    kv = b * hk_rep * s_local * d * e
    one = lambda n: n * (u - 1) // u  # noqa: E731  (what the call site counts per exchange)
    fwd = one(q) + 2 * one(kv) + one(q)
    return {"fwd": fwd, "bwd": fwd}


def all_gather_bytes(*, b: int, hk: int, s_local: int, d: int, cp: int, dtype: str) -> Dict[str, Dict[str, int]]:
    """All-gather attention bytes sent per rank for one call on ``cp`` ranks, by collective."""
    if cp <= 1:
        return {"all_gather_kv": {"fwd": 0, "bwd": 0}, "reduce_scatter_dkv": {"fwd": 0, "bwd": 0}}
    kv = 2 * b * hk * s_local * d * DTYPE_BYTES[dtype]
    dkv = 2 * b * hk * s_local * d * acc_bytes(dtype)
    return {"all_gather_kv": {"fwd": (cp - 1) * kv, "bwd": (cp - 1) * kv},
            "reduce_scatter_dkv": {"fwd": 0, "bwd": (cp - 1) * dkv}}


def cp_attention_bytes(*, b: int, h: int, hk: int, s: int, d: int, cp: int, ulysses: int, dtype: str,
                       comm_type: Optional[str] = None) -> Dict[str, Dict[str, int]]:
    """Bytes per rank by collective for one CP attention call (ring, Ulysses or the hybrid; with
    ``comm_type="all_gather"`` the all-gather attention over all ``cp`` ranks, ``ulysses`` unused).

    ``s`` is the global sequence length; C = cp = ulysses x ring. Every collective is a key,
    zero where the variant does not use it.
    """
    none = {"fwd": 0, "bwd": 0}
    if comm_type == "all_gather":
        return {"ring_p2p": dict(none), "ulysses_a2a": dict(none),
                **all_gather_bytes(b=b, hk=hk, s_local=s // cp, d=d, cp=cp, dtype=dtype)}
    if cp % ulysses:
        raise ValueError(f"ulysses size {ulysses} does not divide CP size {cp}")
    ring = cp // ulysses
    s_local = s // cp
    a2a = ulysses_bytes(b=b, h=h, hk=hk, s_local=s_local, d=d, ulysses=ulysses, dtype=dtype)
    hk_ring = hk * kv_replicas(h, hk, ulysses) // ulysses if ulysses > 1 else hk
    p2p = ring_bytes(b=b, hk=hk_ring, s_local=s // ring, d=d, ring=ring, dtype=dtype)
    return {"ring_p2p": p2p, "ulysses_a2a": a2a, "all_gather_kv": dict(none), "reduce_scatter_dkv": dict(none)}


def mla_exchange_bytes(*, b: int, h: int, s_local: int, qk_head_dim: int, qk_pos_emb_head_dim: int, v_head_dim: int,
                       kv_lora_rank: int, cp: int, dtype: str, exchange: str,
                       comm_type: Optional[str] = None) -> Dict[str, Dict[str, int]]:
    """Bytes per rank by collective of one MLA attention call on a ring (or ``comm_type="all_gather"``)
    of ``cp`` ranks, with ``exchange`` "kv" or "latent"."""
    per_token = (h * (qk_head_dim + qk_pos_emb_head_dim + v_head_dim) if exchange == "kv"
                 else kv_lora_rank + qk_pos_emb_head_dim)
    e, acc = DTYPE_BYTES[dtype], acc_bytes(dtype)
    msg, grad = b * s_local * per_token * e, b * s_local * per_token * acc
    none = {"fwd": 0, "bwd": 0}
    if cp <= 1:
        return {"ring_p2p": none, "all_gather_kv": dict(none), "reduce_scatter_dkv": dict(none)}
    if comm_type == "all_gather":
        return {"ring_p2p": none, "all_gather_kv": {"fwd": (cp - 1) * msg, "bwd": (cp - 1) * msg},
                "reduce_scatter_dkv": {"fwd": 0, "bwd": (cp - 1) * grad}}
    return {"ring_p2p": {"fwd": (cp - 1) * msg, "bwd": (cp - 1) * msg + cp * grad},
            "all_gather_kv": dict(none), "reduce_scatter_dkv": dict(none)}


def tp_layer_bytes(*, b: int, s: int, hidden: int, tp: int, cp: int = 1, sequence_parallel: bool = True,
                   dtype: str = "bf16") -> Dict[str, int]:
    """TP bytes sent per rank for one transformer layer (attention + MLP), forward and backward."""
    if tp <= 1:
        return {"fwd": 0, "bwd": 0}
    act = (s // cp) * b * hidden * DTYPE_BYTES[dtype]
    per = act * (tp - 1) // tp
    fwd = 4 * per if sequence_parallel else 2 * 2 * per
    return {"fwd": fwd, "bwd": fwd}


def ep_layer_bytes(*, b: int, s: int, hidden: int, topk: int, ep: int, tp: int = 1, cp: int = 1,
                   dtype: str = "bf16") -> Dict[str, int]:
    """EP all-to-all bytes sent per rank for one MoE layer (dispatch + combine), uniform routing."""
    if ep <= 1:
        return {"fwd": 0, "bwd": 0}
    tokens = (s // cp) * b // tp
    one = tokens * topk * hidden * DTYPE_BYTES[dtype] * (ep - 1) // ep
    return {"fwd": 2 * one, "bwd": 2 * one}



LINEAR_COLLECTIVES = ("all_gather", "reduce_scatter", "all_to_all", "p2p")
ID_BYTES = 8  # document ids: int64


def _by_collective(**used) -> Dict[str, Dict[str, int]]:
    return {c: dict(used.get(c, {"fwd": 0, "bwd": 0})) for c in LINEAR_COLLECTIVES}


def _add(*parts) -> Dict[str, Dict[str, int]]:
    return {c: {d: sum(p[c][d] for p in parts) for d in ("fwd", "bwd")} for c in LINEAR_COLLECTIVES}


def segments_per_rank(layout: str) -> int:
    """2 for zigzag (chunks r and 2C-1-r), 1 for contiguous (`cp_ext.linear_attention.segments`)."""
    return {"zigzag": 2, "contiguous": 1}[layout]


def segment_owners(cp: int, layout: str):
    """The rank holding each global segment, in sequence order."""
    if layout == "zigzag":
        return [j if j < cp else 2 * cp - 1 - j for j in range(2 * cp)]
    return list(range(cp))


def _ring_hops(cp: int, layout: str, rank: int):
    """(sends forward, sends backward) of ``rank`` in the ring exchange: a segment's S_out goes to the owner
    of the next segment, its dS_in to the owner of the previous one, unless that is the same rank."""
    owners = segment_owners(cp, layout)
    mine = [j for j, r in enumerate(owners) if r == rank]
    fwd = sum(1 for j in mine if j + 1 < len(owners) and owners[j + 1] != rank)
    bwd = sum(1 for j in mine if j > 0 and owners[j - 1] != rank)
    return fwd, bwd


def linear_state_passing_bytes(*, b: int, h: int, k_dim: int, v_dim: int, cp: int, layout: str = "zigzag",
                               dtype: str = "fp32", exchange: str = "all_gather", documents: bool = False,
                               rank: Optional[int] = None) -> Dict[str, Dict[str, int]]:
    """Bytes one rank sends in state passing's exchange (`cp_ext.linear_attention.state_passing`), by
    collective. The ring's depend on the rank (``rank``; None: the most any rank sends)."""
    if cp <= 1:
        return _by_collective()
    per, acc = segments_per_rank(layout), acc_bytes(dtype)
    if exchange == "all_gather":
        summary = per * b * h * k_dim * (k_dim + v_dim) * acc
        ids = per * b * 2 * ID_BYTES if documents else 0
        return _by_collective(all_gather={"fwd": (cp - 1) * (summary + ids), "bwd": 0},
                              reduce_scatter={"fwd": 0, "bwd": (cp - 1) * summary})
    if exchange != "ring":
        raise ValueError(f"unknown exchange {exchange!r}")
    state = b * h * k_dim * v_dim * acc
    hops = [_ring_hops(cp, layout, r) for r in (range(cp) if rank is None else [rank])]
    fwd, bwd = max(f for f, _ in hops), max(w for _, w in hops)
    return _by_collective(p2p={"fwd": fwd * (state + (b * ID_BYTES if documents else 0)), "bwd": bwd * state})


def linear_head_parallel_bytes(*, b: int, s: int, hk: int, h: int, k_dim: int, v_dim: int, cp: int,
                               dtype: str = "fp32", per_channel: bool = False, documents: bool = False,
                               gate: bool = False) -> Dict[str, Dict[str, int]]:
    """Bytes one rank sends in head-parallel CP (`cp_ext.linear_attention.head_parallel`) of an ``s``-token
    sequence: q, k, v, g, beta to head shards and the output back, the backward the reverse; ``gate``:
    also megatron's output gate z (its layer moves it with the inputs)."""
    if cp <= 1:
        return _by_collective()
    e, s_local = DTYPE_BYTES[dtype], s // cp
    qk, vo = b * s_local * hk * k_dim * e, b * s_local * h * v_dim * e
    g, beta = b * s_local * h * (k_dim if per_channel else 1) * e, b * s_local * h * e
    one = lambda n: n * (cp - 1) // cp  # noqa: E731  (what leaves the rank per all-to-all)
    moved = sum(one(n) for n in (qk, qk, vo, g, beta, vo)) + (one(vo) if gate else 0)
    ids = (cp - 1) * b * s_local * ID_BYTES if documents else 0
    return _by_collective(all_to_all={"fwd": moved, "bwd": moved}, all_gather={"fwd": ids, "bwd": 0})


def linear_hybrid_bytes(*, b: int, s: int, hk: int, h: int, k_dim: int, v_dim: int, cp: int, ulysses: int,
                        layout: str = "zigzag", dtype: str = "fp32", exchange: str = "all_gather",
                        per_channel: bool = False, documents: bool = False,
                        ring_rank: Optional[int] = None) -> Dict[str, Dict[str, int]]:
    """The Ulysses x state-passing hybrid (`cp_ext.linear_attention.head_parallel.ulysses_state_passing`):
    the all-to-all over U on this rank's s/C tokens, then state passing over R = C/U with h/U heads."""
    ring = cp // ulysses
    a2a = linear_head_parallel_bytes(b=b, s=s // ring, hk=hk, h=h, k_dim=k_dim, v_dim=v_dim, cp=ulysses,
                                     dtype=dtype, per_channel=per_channel, documents=documents)
    passing = linear_state_passing_bytes(b=b, h=h // ulysses, k_dim=k_dim, v_dim=v_dim, cp=ring, layout=layout,
                                         dtype=dtype, exchange=exchange, documents=documents, rank=ring_rank)
    return _add(a2a, passing)


def conv_halo_bytes(*, b: int, channels: int, kernel_size: int, s_local: int, cp: int, layout: str = "zigzag",
                    dtype: str = "fp32", documents: bool = False) -> Dict[str, Dict[str, int]]:
    """Bytes one rank sends for the causal conv's halo (`cp_ext.linear_attention.conv`): each segment's last
    min(w-1, L) tokens all-gathered (their ids too, with documents), their gradient reduce-scattered back."""
    per = segments_per_rank(layout)
    tail = min(kernel_size - 1, s_local // per)
    if cp <= 1 or tail == 0:
        return _by_collective()
    x = per * b * tail * channels * DTYPE_BYTES[dtype]
    ids = per * b * tail * ID_BYTES if documents else 0
    return _by_collective(all_gather={"fwd": (cp - 1) * (x + ids), "bwd": 0},
                          reduce_scatter={"fwd": 0, "bwd": (cp - 1) * x})


def gated_delta_layer_bytes(*, method: str, b: int, s: int, hk: int, h: int, k_dim: int, v_dim: int, cp: int,
                            ulysses: int = 1, layout: str = "zigzag", dtype: str = "bf16", exchange: str = "all_gather",
                            kernel_size: int = 4, per_channel: bool = False,
                            documents: bool = False) -> Dict[str, Dict[str, int]]:
    """One Gated DeltaNet / KDA layer's CP bytes per rank (the most any rank sends), by collective.

    ``method="state_passing"``: the conv halo of the q, k, v channels (before the rule) plus the exchange
    (``ulysses`` > 1: the hybrid, its halo over the ring on h/U heads' channels after the all-to-all);
    ``"all_to_all"``: megatron-core's, its all-to-alls with the output gate, no halo."""
    if method == "all_to_all":
        return linear_head_parallel_bytes(b=b, s=s, hk=hk, h=h, k_dim=k_dim, v_dim=v_dim, cp=cp, dtype=dtype,
                                          per_channel=per_channel, documents=documents, gate=True)
    ring = cp // ulysses
    channels = (2 * hk * k_dim + h * v_dim) // ulysses
    halo = conv_halo_bytes(b=b, channels=channels, kernel_size=kernel_size, s_local=s // ring, cp=ring, layout=layout,
                           dtype=dtype, documents=documents)
    if ulysses > 1:
        exchange_bytes = linear_hybrid_bytes(b=b, s=s, hk=hk, h=h, k_dim=k_dim, v_dim=v_dim, cp=cp, ulysses=ulysses,
                                             layout=layout, dtype=dtype, exchange=exchange, per_channel=per_channel,
                                             documents=documents)
    else:
        exchange_bytes = linear_state_passing_bytes(b=b, h=h, k_dim=k_dim, v_dim=v_dim, cp=cp, layout=layout,
                                                    dtype=dtype, exchange=exchange, documents=documents)
    return _add(halo, exchange_bytes)
