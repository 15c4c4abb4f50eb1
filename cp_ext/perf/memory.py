"""Per-rank memory formulas: parameters, weights/grads/optimizer states, activations, KV state.

Model shape: `cp_ext.perf.model_shape.ModelShape` (one description, read from the trainer's
arguments by `ModelShape.from_args`; its parameters per layer exactly as megatron builds them).
Grid: TP t (with sequence parallelism), PP p, CP c, DP, EP, ETP.

Bytes per parameter (megatron-core mixed precision, as `cp_ext.training.trainer` sets it:
bf16 weights, fp32 gradient buffer, fp32 main params + Adam m, v):

    without distributed optimizer: 2 (weight) + 4 (grad) + 4 + 4 + 4 (main, m, v) = 18
    with it:                       2 + 4 + 12 / D,   D = the DP x CP ranks that shard it
    fp32 training:                 4 + 4 + 8 (no main copy) = 16;  4 + 4 + 8 / D

Weights are those of the heaviest pipeline stage (dense-first layers make stages differ).
Activations saved for backward, per token and layer: `cp_ext.perf.activations` (norms, GQA or
MLA with its per-head or latent CP exchange, qk-norm, dense or MoE MLP, shared experts, the
router), summed over the first stage's layers. Measured against `tools/measure_memory.py`
(saved-tensor hooks): within 2% on every family of tests/families, fp32 and bf16, CP1 and CP2,
with and without CP-aware full recompute (tests/bench/test_memory_measure_families.py).

This is Korthikanti et al., "Reducing Activation Recomputation in Large Transformer
Models" (2022), eq. (2): ``sbh (34 + 5 a s / h)`` bytes per layer in fp16 with dropout, with
the 5as/h term (the s x s softmax and its dropout mask) gone under flash attention and the
dropout masks gone at dropout 0; `korthikanti_layer_bytes` gives the paper's figure for
reference. Sequence parallelism divides everything by t, CP divides the tokens by c. With full
recompute only each layer's input (h per token, /t with SP) stays, plus one layer's full
activations while it is recomputed; CP-aware full recompute (cp_ext's default) also keeps each
layer's attention output and LSE (h + a fp32 per token, /t). Measured with tools/measure_memory.py
--modes none full full-cp-aware. Under 1F1B the first pipeline stage holds p microbatches
of L/p layers, i.e. L layers' worth.

All-gather attention (``cp_comm_type="all_gather"``, `cp_ext.attention.cp.all_gather`) holds,
inside each attention call only, the whole sequence's K/V on every rank (``[2, b, g/t, s, d]``
in the activation dtype) in the forward, and in the backward that gathered K/V again plus the
full-sequence dK/dV in fp32 before the reduce-scatter (``all_gather_transient_bytes``). It is
never saved for backward and is freed when the call returns, so it adds to the peak once, not
per layer, and only by what exceeds the saved activations freed before the last layer's
attention backward runs (the logits' activations and that layer's post-attention part:
linear_proj input, second norm, MLP/MoE)::

    peak = max(peak without it, saved at the last attention backward + transient)

Measured with tools/measure_memory.py --cp-comm-types default all_gather (the call's own
allocations, hooked, next to this model; 2 layers, hidden 512, MHA, s 2048, CP2, fp32): the
call holds 24 MiB against 22 MiB modelled (the rest is one chunk-sized tile's temporaries), and
the per-rank peak is 71.33 MiB measured against 71.32 MiB planned.

Attention (KV) state: K and V of every layer, ``2 L g d s`` elements per sequence
(fp16/bf16: 2 bytes), split by t (KV heads) and c (tokens); the LSE is ``L a s`` fp32.
7B (MHA, L=32, h=4096) at 128K: 2 x 32 x 4096 x 131072 x 2 B = 64 GiB; 70B taken as MHA
(L=80, h=8192): 320 GiB (with its real 8 KV heads: 40 GiB).
"""

from dataclasses import replace
from typing import Dict, Optional

from cp_ext.grid import GRID_FLAGS, Grid  # re-exported: the planner's grid is cp_ext's one Grid
from cp_ext.perf.model_shape import (  # noqa: F401  (re-exported: the planner's one model description)
    PRESETS, ModelShape, active_params, layer_params, mlp_matrices, mtp_layer_params, mtp_weight_layers, params_per_layer, total_params,
)

from cp_ext.perf.activations import layer_activation_elems, mla_takes_latent, outside_layers_bytes

GiB = 2 ** 30


def bytes_per_param(dtype: str, distributed_optimizer: bool, shards: int) -> Dict[str, float]:
    """Weight / grad / optimizer bytes per parameter (see the module docstring)."""
    if dtype == "fp32":
        w, g, opt = 4, 4, 8
    else:
        w, g, opt = 2, 4, 12
    return {"weights": w, "grads": g, "optimizer": opt / shards if distributed_optimizer else opt}


def korthikanti_layer_bytes(m: ModelShape, s: int, b: int = 1, flash: bool = True) -> float:
    """The paper's per-layer activation bytes sbh(34 + 5as/h) (fp16, dropout on); flash drops 5as/h."""
    return s * b * m.hidden * (34 + (0 if flash else 5 * m.heads * s / m.hidden))


RECOMPUTE_MODES = (None, "full", "full_cp_aware", "mla_up_proj")
# Megatron's --cp-comm-type names; None is cp_ext's default (the attention the CP groups pick:
# ring, Ulysses or the hybrid). Only all_gather holds more than its shard.
CP_COMM_TYPES = (None, "p2p", "a2a", "a2a+p2p", "all_gather")


def all_gather_transient_bytes(m: ModelShape, *, s: int, b: int = 1, tp: int = 1, cp: int = 1,
                               dtype: str = "bf16", latent: bool = False) -> Dict[str, float]:
    """Bytes one all-gather attention call holds on a rank while it runs (0 at CP = 1).

    forward: the gathered K/V ``[b, g/t, s, d + d_v]`` (MLA's latent: ``[b, 1, s, r + p]``) in the
    activation dtype; backward: the same again plus its full-sequence gradient in fp32 before the
    reduce-scatter, and the call's fp32 results (this rank's 1/cp of that gradient, dQ). ``peak``
    is the larger. Only the GQA/MHA case is measured (tests/bench/test_memory_measure.py).
    """
    if cp <= 1:
        return {"fwd": 0.0, "bwd": 0.0, "peak": 0.0}
    e = 4 if dtype == "fp32" else 2
    if latent:
        kv = b * s * (m.kv_lora_rank + m.qk_pos_emb_head_dim)
    else:
        kv = b * max(1, m.kv_heads // tp) * s * (m.head_dim + m.v_dim)
    q_local = b * max(1, m.heads // tp) * s / cp * m.head_dim
    fwd, bwd = kv * e, kv * e + kv * 4 * (1 + 1 / cp) + q_local * 4
    return {"fwd": float(fwd), "bwd": float(bwd), "peak": float(max(fwd, bwd))}


def activation_bytes(m: ModelShape, *, s: int, b: int = 1, tp: int = 1, cp: int = 1, pp: int = 1,
                     dtype: str = "bf16", recompute=None, sequence_parallel: bool = True,
                     microbatches_in_flight: Optional[int] = None, cp_comm_type: Optional[str] = None,
                     ulysses: int = 1, mla_exchange: str = "auto") -> Dict[str, float]:
    """Per-rank activation bytes of one training step (first pipeline stage, the largest).

    ``recompute``: None (keep everything), ``"full"`` (megatron's full recompute, one layer per
    checkpoint), ``"full_cp_aware"`` (full, keeping each layer's attention output and LSE:
    cp_ext's default under full recompute) or ``"mla_up_proj"`` (selective: MLA's up projections'
    outputs dropped after the forward). ``True`` means ``"full_cp_aware"``.
    ``cp_comm_type``: None (today's ring / Ulysses / hybrid) or a `CP_COMM_TYPES` name;
    ``"all_gather"`` adds its transient K/V where it raises the peak (module docstring);
    ``"attention_transient"`` is what one call holds. ``ulysses`` and ``mla_exchange``
    (``--cp-mla-exchange``) decide whether MLA's CP attention takes the latent.
    """
    if recompute is True:
        recompute = "full_cp_aware"
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(f"recompute must be one of {RECOMPUTE_MODES}, got {recompute!r}")
    if cp_comm_type not in CP_COMM_TYPES:
        raise ValueError(f"cp_comm_type must be one of {CP_COMM_TYPES}, got {cp_comm_type!r}")
    all_gather = cp_comm_type == "all_gather"
    latent = mla_takes_latent(m, tp=tp, cp=cp, ulysses=1 if all_gather else ulysses, all_gather=all_gather,
                              exchange=mla_exchange)
    transient = (all_gather_transient_bytes(m, s=s, b=b, tp=tp, cp=cp, dtype=dtype, latent=latent)["peak"]
                 if all_gather else 0.0)
    e = 4 if dtype == "fp32" else 2
    tokens = s * b / cp
    sp = tp if sequence_parallel else 1
    stage_layers = m.layers // pp
    in_flight = pp if microbatches_in_flight is None else microbatches_in_flight
    up_proj = recompute == "mla_up_proj" and m.multi_latent_attention
    per = [layer_activation_elems(m, i, tp=tp, cp=cp, sequence_parallel=sequence_parallel, latent=latent, dtype=dtype,
                                  up_proj_recompute=up_proj, s=s) for i in range(stage_layers)]
    layer_bytes = [tokens * (x["act"] * e + x["fp32"] * 4 + x["bytes"]) for x in per]
    vocab_part = tokens * outside_layers_bytes(m, e=e, tp=tp, sp=sp)
    # MTP layers (pp = 1: on this stage): one more layer like the last (V4: of its own kind) and its own logits each,
    # and their enorm / hnorm and eh_proj's input (per stream with mHC)
    mtp = 0.0
    if pp == 1:
        rows = max(1, m.residual_streams)
        mtp_norms = rows * (2 * (2 * m.hidden + 1) * 4 + 2 * m.hidden * e) / sp
        for depth in range(m.mtp_layers):
            x = layer_activation_elems(m, m.layers + depth, tp=tp, cp=cp, sequence_parallel=sequence_parallel,
                                       latent=latent, dtype=dtype, up_proj_recompute=up_proj, s=s)
            mtp += tokens * (x["act"] * e + x["fp32"] * 4 + x["bytes"] + mtp_norms) + vocab_part
    # saved after the last layer's attention call: freed before the backward reaches that attention
    last = per[-1]
    post_attention = tokens * (last["post_act"] * e + last["post_fp32"] * 4 + last["post_bytes"])
    if recompute in (None, "mla_up_proj"):
        layers_bytes = in_flight * sum(layer_bytes) + mtp
        # the transient peaks in the last layer's attention backward: the logits are freed by then; so do
        # the up projections' outputs that --recompute-modules mla_up_proj brings back for that layer
        restored = tokens * last["restored_act"] * e
        total = max(layers_bytes + vocab_part, layers_bytes - post_attention + transient + restored)
        return {"layers": layers_bytes, "embedding+logits": vocab_part, "attention_transient": transient,
                "total": total}
    # Full recompute keeps each layer's input (the checkpoint) and, CP-aware, its attention
    # output (a d_v / t, activation dtype) and LSE (a / t, fp32). The layers' other activations exist
    # one layer at a time, while that layer is recomputed in backward; by then the logits'
    # activations are freed, so the peak is the larger of the two working sets. The recomputed
    # layer's input is the checkpoint itself (same storage), and with CP-aware recompute its
    # attention output and LSE are the kept ones: hence the subtractions.
    layer_input = tokens * m.hidden * max(1, m.residual_streams) * e / sp  # with mHC: the n streams
    # V4's layers are recomputed whole (their output is not cp_ext's CP attention's, kept by CP-aware recompute)
    cp_aware = recompute == "full_cp_aware" and m.compressed is None
    kept = tokens * (m.heads * m.v_dim * e + m.heads * 4) / tp if cp_aware else 0.0
    held = (stage_layers + (m.mtp_layers if pp == 1 else 0)) * in_flight * (layer_input + kept)
    if m.residual_streams and m.mtp_layers and pp == 1:
        # mHC with MTP (measured): each MTP layer's collapse outside its checkpoint (the streams' fp32 norm and gates)
        # and its output streams stay while the decoder's layers are recomputed, and its checkpoint also keeps the
        # next tokens' embedding
        n, h = m.residual_streams, m.hidden
        collapse = ((2 if e != 4 else 1) * n * h + 1 + n) * 4
        held += tokens * in_flight * m.mtp_layers * (collapse + n * h * e + h * e) / sp
    recomputed = max(layer_bytes) - layer_input - kept
    last_recomputed = layer_bytes[-1] - layer_input - kept
    # the transient peaks in the recomputed layer's attention backward, on top of its pre-attention part
    working = max(recomputed, vocab_part, last_recomputed - post_attention + transient)
    return {"layers": held + recomputed, "embedding+logits": vocab_part, "attention_transient": transient,
            "total": held + working}


def kv_state_bytes(m: ModelShape, *, s: int, b: int = 1, tp: int = 1, cp: int = 1, dtype: str = "bf16",
                   mha: bool = False, latent: bool = False) -> Dict[str, float]:
    """K, V of every layer (the attention state CP splits) and the fp32 LSE, per rank. MLA: per-head
    K (d_qk + p) and V (d_v), or with ``latent`` (`cp_ext.perf.activations.mla_takes_latent`) the
    ``r + p`` values per token its CP attention holds and exchanges instead. Linear-attention layers hold
    none (their state does not grow with s)."""
    e = 4 if dtype == "fp32" else 2
    layers = sum(1 for i in range(m.layers) if not m.is_linear_layer(i))
    if m.compressed is not None:  # V4: one K=V head of d per token and each layer's entries (CSA with its index key)
        c = m.compressed
        per_layer = [m.v_head_dim + (0 if c.kind(i) == "sliding" else
                                     (m.v_head_dim + (c.index_head_dim if c.indexed(c.kind(i)) else 0))
                                     / c.rate(c.kind(i))) for i in range(m.layers)]
        kv = sum(per_layer) * s * b * e / cp
        lse = m.layers * m.heads * s * b * 4 / (tp * cp)
        return {"kv": kv, "lse": lse, "total": kv + lse}
    g = m.heads if mha else m.kv_heads
    per_token = m.kv_lora_rank + m.qk_pos_emb_head_dim if latent else g * (m.head_dim + m.v_dim) / tp
    kv = layers * per_token * s * b * e / cp
    lse = layers * m.heads * s * b * 4 / (tp * cp)
    return {"kv": kv, "lse": lse, "total": kv + lse}


def stage_params(m: ModelShape, pp: int, stage: int) -> Dict[str, float]:
    """Unsharded parameters of one pipeline stage: its layers (dense-first layers make the stages
    differ), the embedding on the first, the output layer (a copy when tied and PP > 1), final norm
    and MTP layers on the last. PP = 1: all of it."""
    per_stage = m.layers // pp
    parts = [layer_params(m, i) for i in range(stage * per_stage, (stage + 1) * per_stage)]
    dense = sum(p["dense"] for p in parts)
    expert = sum(p["expert"] for p in parts)
    emb = m.vocab * m.hidden
    if stage == 0:
        dense += emb + m.learned_positions * m.hidden
    if stage == pp - 1:
        dense += (0 if m.tied_embeddings and pp == 1 else emb) + m.hidden
        for depth in range(mtp_weight_layers(m)):
            mtp = mtp_layer_params(m, depth)
            dense, expert = dense + mtp["dense"], expert + mtp["expert"]
    return {"dense": dense, "expert": expert}


def weight_bytes(m: ModelShape, grid: Grid, *, dtype: str = "bf16", distributed_optimizer: bool = True) -> Dict[str, float]:
    """Weights, grads and optimizer states per rank (the heaviest pipeline stage): dense parameters
    sharded by TP, optimizer state over DP x CP; experts by EP x ETP, over the expert-DP ranks."""
    dense_shards = grid.dp * grid.cp
    expert_shards = max(1, grid.dp * grid.cp * grid.tp // (grid.ep * grid.etp))
    bd = bytes_per_param(dtype, distributed_optimizer, dense_shards)
    be = bytes_per_param(dtype, distributed_optimizer, expert_shards)
    best = None
    for stage in range(grid.pp):
        p = stage_params(m, grid.pp, stage)
        dense, expert = p["dense"] / grid.tp, p["expert"] / (grid.ep * grid.etp)
        out = {k: dense * bd[k] + expert * be[k] for k in ("weights", "grads", "optimizer")}
        out["params"] = dense + expert
        if best is None or sum(out[k] for k in ("weights", "grads", "optimizer")) > \
                sum(best[k] for k in ("weights", "grads", "optimizer")):
            best = out
    return best


def rank_memory(m: ModelShape, grid: Grid, *, s: int, b: int = 1, dtype: str = "bf16", distributed_optimizer: bool = True,
                recompute=None, microbatches: int = 1, cp_comm_type: Optional[str] = None) -> Dict[str, float]:
    """The per-rank estimate: weights, grads, optimizer, activations, attention state and total bytes
    (``cp_comm_type`` as in `activation_bytes`; the all-gather transient is inside "activations")."""
    w = weight_bytes(m, grid, dtype=dtype, distributed_optimizer=distributed_optimizer)
    act = activation_bytes(m, s=s, b=b, tp=grid.tp, cp=grid.cp, pp=grid.pp, dtype=dtype, recompute=recompute,
                           microbatches_in_flight=min(grid.pp, microbatches), cp_comm_type=cp_comm_type,
                           ulysses=grid.ulysses)
    latent = mla_takes_latent(m, tp=grid.tp, cp=grid.cp, ulysses=grid.ulysses, all_gather=cp_comm_type == "all_gather")
    kv = kv_state_bytes(m, s=s, b=b, tp=grid.tp, cp=grid.cp, dtype=dtype, latent=latent)
    out = {"params": w["params"], "weights": w["weights"], "grads": w["grads"], "optimizer": w["optimizer"],
           "activations": act["total"], "kv_state": kv["total"], "attention_transient": act["attention_transient"]}
    # The KV state is part of the saved activations (K, V and LSE are saved for backward): not added again.
    out["total"] = out["weights"] + out["grads"] + out["optimizer"] + out["activations"]
    return out


__all__ = ["CP_COMM_TYPES", "GRID_FLAGS", "GiB", "Grid", "ModelShape", "PRESETS", "activation_bytes", "active_params", "all_gather_transient_bytes",
           "bytes_per_param", "korthikanti_layer_bytes", "mlp_matrices", "mtp_layer_params",
           "kv_state_bytes", "layer_activation_elems", "layer_params", "params_per_layer", "rank_memory", "replace",
           "stage_params", "total_params", "weight_bytes"]
