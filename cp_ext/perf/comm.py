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
