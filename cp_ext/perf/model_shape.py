"""One model description for the planner, the checkpoint estimate and the memory measurement.

`ModelShape.from_args` reads it from parsed `pretrain_moe.py` arguments (Megatron-LM's names),
so the three callers (tools/plan_parallelism.py --config, tools/measure_memory.py,
`cp_ext.checkpoint.checks`) describe the model exactly as the trainer builds it.
`layer_params` counts one layer's parameters the way megatron-core builds that layer
(cp_ext's decoder block spec: local linear layers, separate norms, SequentialMLP experts);
`total_params` equals ``sum(p.numel())`` of the built model for every family in tests/families
(tests/perf/test_model_shape.py). What a layer holds:

    attention   GQA: linear_qkv [(a + 2g) d, h] (+ bias with --add-bias-linear / --add-qkv-bias),
                linear_proj [h, a d] (+ bias h), q/k layernorm d each (--qk-layernorm),
                d = --kv-channels (or h / a)
                MLA: linear_q_proj [a (d_qk + p), h] or, with --q-lora-rank r_q,
                linear_q_down_proj [r_q, h] + q_layernorm r_q + linear_q_up_proj [a (d_qk + p), r_q];
                linear_kv_down_proj [r + p, h], kv_layernorm r (both norms with --qk-layernorm),
                linear_kv_up_proj [a (d_qk + d_v), r], linear_proj [h, a d_v]
                sinks (--softmax-type learnable): a
    norms       input_layernorm, pre_mlp_layernorm: h each (x 2 with LayerNorm's bias)
    MLP         dense layers (--moe-layer-freq 0, or no experts): fc1 [2f or f, h], fc2 [h, f] (+ biases)
    MoE         router [E, h] (+ bias E), E experts of f_e, shared experts of f_s (--moe-shared-
                expert-intermediate-size) as one MLP, their gate h (--moe-shared-expert-gate)
                --attention-output-gate: linear_qkv a d rows more (the gate, projected with q)
    linear      Gated DeltaNet (the layers --linear-attention-freq marks, `cp_ext.transformer.gated_delta_net`):
                in_proj [2 H_k K + 2 H_v V + 2 H_v, h], conv1d (2 H_k K + H_v V) w, dt_bias and A_log H_v each,
                out_norm V, out_proj [h, H_v V]
                Kimi Delta Attention (--experimental-attention-variant kda, `cp_ext.transformer.kimi_delta_attention`;
                H = H_k = H_v heads): in_proj [2 H K + H V, h], conv1d (2 H K + H V) w, f_a_proj [K, h], f_b_proj
                [H K, K], beta_proj [H, h], g_a_proj [V, h], g_b_proj [H V, V], dt_bias H K, A_log H, out_norm V,
                out_proj [h, H V] (the gates' ranks: K and V, as Kimi-Linear)
    DeepSeek-V4 (--experimental-attention-variant dsv4_hybrid, --enable-hyper-connections): each layer's sliding,
                CSA or HCA attention and its mHC mixings, `cp_ext.perf.compressed_layers`
    MTP         (--mtp-num-layers, megatron's MultiTokenPredictionLayer): enorm, hnorm h each,
                eh_proj [h, 2h], one transformer layer of the last decoder layer's kind (with
                softmax attention), its final norm h; embedding and output layer shared with the main model. cp_ext does
                not build MTP yet: checked against megatron's own GPTModel with an MTP block.
"""

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

from cp_ext.perf.compressed_layers import CompressedLayers, compressed_attention_params, hyper_connection_params

# The flags `ModelShape.from_args` reads that decide a parameter's shape: what a checkpoint records
# of its model and refuses to load into another (`cp_ext.checkpoint.checkpointer.MODEL_FLAGS`).
SHAPE_FLAGS = {name: "--" + name.replace("_", "-") for name in (
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
    "num_experts", "moe_ffn_hidden_size", "moe_layer_freq", "moe_shared_expert_intermediate_size", "normalization",
    "swiglu", "quick_geglu", "add_bias_linear", "add_qkv_bias", "qk_layernorm", "softmax_type",
    "untie_embeddings_and_output_weights", "vocab_size", "make_vocab_size_divisible_by", "padded_vocab_size",
    "multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim",
    "position_embedding_type", "mtp_num_layers", "mtp_use_repeated_layer", "experimental_attention_variant",
    "linear_attention_freq", "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
    "linear_num_key_heads", "linear_num_value_heads", "attention_output_gate", "moe_shared_expert_gate")}
SHAPE_FLAGS["add_bias_linear"] = "--disable-bias-linear: add_bias_linear"  # the flag sets it False

PatternLike = Optional[object]  # int (every N-th layer) or a 0/1 list per layer, as Megatron-LM parses them
LINEAR_MIXERS = {"gated_delta_net": "Gated DeltaNet", "kda": "Kimi Delta Attention"}  # the linear mixers counted


@dataclass(frozen=True)
class ModelShape:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    experts: int = 0
    topk: int = 1
    moe_ffn: Optional[int] = None
    swiglu: bool = True  # any gated MLP (SwiGLU, quick-GeGLU): fc1 is twice as wide
    quick_geglu: bool = False  # GPT-OSS's gated activation: one more intermediate saved (activations only)
    tied_embeddings: bool = True
    kv_channels: Optional[int] = None  # head dim when it is not hidden / heads (Qwen3, GPT-OSS)
    qk_layernorm: bool = False
    add_bias_linear: bool = False
    add_qkv_bias: bool = False
    layernorm: bool = False  # LayerNorm (weight + bias) instead of RMSNorm (weight)
    moe_layer_freq: PatternLike = 1  # Megatron's: 1 every layer MoE; [0, 1, 1] dense-first
    shared_expert_ffn: Optional[int] = None
    shared_expert_overlap: bool = False  # --moe-shared-expert-overlap: saves one intermediate fewer (measured)
    softmax_type: str = "vanilla"  # "learnable": a sink per head and layer (GPT-OSS)
    window_size: Optional[Tuple[int, int]] = None
    window_attn_skip_freq: PatternLike = None
    multi_latent_attention: bool = False
    q_lora_rank: Optional[int] = None
    kv_lora_rank: int = 0
    qk_head_dim: int = 0
    qk_pos_emb_head_dim: int = 0
    v_head_dim: int = 0
    mtp_layers: int = 0
    mtp_repeated: bool = False  # --mtp-use-repeated-layer: one MTP layer's weights serve every depth
    # the router's scoring (what it saves for backward: `cp_ext.perf.activations.router_saved_bytes`)
    moe_router_score_function: str = "softmax"
    moe_router_pre_softmax: bool = False
    moe_aux_loss: bool = True  # a load-balancing loss with a coefficient > 0
    moe_router_num_groups: Optional[int] = None
    moe_router_group_topk: Optional[int] = None
    moe_router_fp32: bool = False  # --moe-router-dtype fp32: the dispatcher's probs in fp32
    learned_positions: int = 0  # --position-embedding-type learned_absolute: max_position_embeddings rows
    attention_output_gate: bool = False
    shared_expert_gate: bool = False
    # linear attention (--experimental-attention-variant gated_delta_net or kda): which layers, which mixer, sizes
    linear_attention_freq: PatternLike = None
    linear_variant: str = "gated_delta_net"
    linear_conv_kernel: int = 4
    linear_key_heads: int = 16
    linear_value_heads: int = 32
    linear_key_dim: int = 128
    linear_value_dim: int = 128
    # DeepSeek-V4 (`cp_ext.perf.compressed_layers`): its attention layers, the mHC streams (0: none)
    compressed: Optional[CompressedLayers] = None
    residual_streams: int = 0
    mhc_iterations: int = 20

    @property
    def head_dim(self) -> int:
        """The q/k head dim (MLA: the non-RoPE part plus the RoPE part)."""
        if self.multi_latent_attention:
            return self.qk_head_dim + self.qk_pos_emb_head_dim
        return self.kv_channels or self.hidden // self.heads

    @property
    def v_dim(self) -> int:
        return self.v_head_dim if self.multi_latent_attention else self.head_dim

    @property
    def expert_ffn(self) -> int:
        return self.moe_ffn or self.ffn

    def is_moe_layer(self, i: int) -> bool:
        """Layer i (0-based) is MoE: megatron's moe_layer_freq (int: i % N == 0; list: its 1s)."""
        if not self.experts:
            return False
        freq = self.moe_layer_freq
        return bool(freq[i]) if isinstance(freq, (list, tuple)) else i % freq == 0

    def is_linear_layer(self, i: int) -> bool:
        """Layer i (0-based) is linear attention: megatron's linear_attention_freq (int N: unless (i + 1) % N
        == 0; list: its 1s)."""
        freq = self.linear_attention_freq
        if freq is None:
            return False
        return bool(freq[i]) if isinstance(freq, (list, tuple)) else (i + 1) % freq != 0

    def is_window_layer(self, i: int) -> bool:
        """megatron's is_layer_window_attention (layer number i + 1)."""
        if self.window_size is None:
            return False
        freq = self.window_attn_skip_freq
        if freq is None:
            return True
        return bool(freq[i]) if isinstance(freq, (list, tuple)) else (i + 1) % freq != 0

    @classmethod
    def from_args(cls, args, vocab: Optional[int] = None) -> "ModelShape":
        """The shape `pretrain_moe.py` builds from ``args`` (`cp_ext.arguments.parse_args`'s namespace).

        ``vocab``: the padded vocabulary when known (the trainer pads the tokenizer's, read only at
        run time); else --padded-vocab-size, or --vocab-size (32000 without it) padded as the trainer does.
        """
        if vocab is None:  # cp_ext.config.padded_vocab_size's padding, without importing torch
            step = args.make_vocab_size_divisible_by
            vocab = args.padded_vocab_size or -(-(args.vocab_size or 32000) // step) * step
        mla = bool(args.multi_latent_attention)
        freq = args.moe_layer_freq
        return cls(
            layers=args.num_layers, hidden=args.hidden_size, heads=args.num_attention_heads,
            kv_heads=args.num_attention_heads if mla else args.num_query_groups, ffn=args.ffn_hidden_size,
            vocab=vocab, experts=args.num_experts or 0, topk=args.moe_router_topk if args.num_experts else 1,
            moe_ffn=args.moe_ffn_hidden_size, swiglu=bool(args.swiglu or args.quick_geglu),
            quick_geglu=bool(args.quick_geglu),
            tied_embeddings=not args.untie_embeddings_and_output_weights,
            kv_channels=None if mla else args.kv_channels, qk_layernorm=bool(args.qk_layernorm),
            add_bias_linear=bool(args.add_bias_linear), add_qkv_bias=bool(args.add_qkv_bias),
            layernorm=args.normalization == "LayerNorm",
            moe_layer_freq=tuple(freq) if isinstance(freq, list) else freq,
            shared_expert_ffn=args.moe_shared_expert_intermediate_size,
            shared_expert_overlap=bool(args.moe_shared_expert_overlap), softmax_type=args.softmax_type,
            window_size=None if args.window_size is None else tuple(args.window_size),
            window_attn_skip_freq=(tuple(args.window_attn_skip_freq) if isinstance(args.window_attn_skip_freq, list)
                                   else args.window_attn_skip_freq),
            multi_latent_attention=mla, q_lora_rank=args.q_lora_rank if mla else None,
            kv_lora_rank=args.kv_lora_rank if mla else 0, qk_head_dim=args.qk_head_dim if mla else 0,
            qk_pos_emb_head_dim=args.qk_pos_emb_head_dim if mla else 0, v_head_dim=args.v_head_dim if mla else 0,
            mtp_layers=getattr(args, "mtp_num_layers", None) or 0,
            mtp_repeated=bool(getattr(args, "mtp_use_repeated_layer", False)),
            moe_router_score_function=args.moe_router_score_function,
            moe_router_pre_softmax=bool(args.moe_router_pre_softmax),
            moe_aux_loss=bool(args.moe_aux_loss_coeff) and args.moe_router_load_balancing_type != "none",
            moe_router_num_groups=args.moe_router_num_groups, moe_router_group_topk=args.moe_router_group_topk,
            moe_router_fp32=args.moe_router_dtype == "fp32",
            learned_positions=(args.max_position_embeddings if args.position_embedding_type == "learned_absolute"
                               else 0),
            attention_output_gate=bool(getattr(args, "attention_output_gate", False)),
            shared_expert_gate=bool(getattr(args, "moe_shared_expert_gate", False)),
            compressed=CompressedLayers.from_args(args),
            residual_streams=args.num_residual_streams if getattr(args, "enable_hyper_connections", False) else 0,
            mhc_iterations=getattr(args, "mhc_sinkhorn_iterations", 20),
            **_linear_fields(args),
        )


def _linear_fields(args) -> dict:
    """The linear-attention layers' pattern and sizes, where --experimental-attention-variant makes them."""
    variant = getattr(args, "experimental_attention_variant", None)
    if variant not in LINEAR_MIXERS:
        return {}
    freq = args.linear_attention_freq
    return dict(linear_attention_freq=tuple(freq) if isinstance(freq, list) else freq, linear_variant=variant,
                linear_conv_kernel=args.linear_conv_kernel_dim, linear_key_heads=args.linear_num_key_heads,
                linear_value_heads=args.linear_num_value_heads, linear_key_dim=args.linear_key_head_dim,
                linear_value_dim=args.linear_value_head_dim)


PRESETS: Dict[str, ModelShape] = {
    "llama2-7b": ModelShape(layers=32, hidden=4096, heads=32, kv_heads=32, ffn=11008, vocab=32000, tied_embeddings=False),
    "llama2-13b": ModelShape(layers=40, hidden=5120, heads=40, kv_heads=40, ffn=13824, vocab=32000, tied_embeddings=False),
    "llama2-70b": ModelShape(layers=80, hidden=8192, heads=64, kv_heads=8, ffn=28672, vocab=32000, tied_embeddings=False),
    "mixtral-8x7b": ModelShape(layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab=32000, experts=8,
                               topk=2, tied_embeddings=False),
    "cpu-tiny": ModelShape(layers=2, hidden=64, heads=4, kv_heads=4, ffn=128, vocab=384),
    # docs/families/deepseek_v4.md's command (tests/perf/test_compressed_layers.py holds them equal): 284 B and the
    # MTP layer
    "deepseek-v4-flash": ModelShape(
        layers=43, hidden=4096, heads=64, kv_heads=64, ffn=16384, vocab=129280, experts=256, topk=6, moe_ffn=2048,
        tied_embeddings=False, qk_layernorm=True, shared_expert_ffn=2048, multi_latent_attention=True,
        q_lora_rank=1024, kv_lora_rank=32, qk_head_dim=128, qk_pos_emb_head_dim=64, v_head_dim=512,
        moe_router_score_function="sqrtsoftplus", moe_aux_loss=False, moe_router_fp32=True,
        compressed=CompressedLayers(ratios=(0, 0) + (4, 128) * 20 + (4, 0)), residual_streams=4, mtp_layers=1),
}


def mlp_matrices(m: ModelShape) -> int:
    return 3 if m.swiglu else 2


def _mlp_params(m: ModelShape, f: int) -> int:
    """One MLP of intermediate size f: fc1 (2f wide when gated), fc2, and their biases."""
    bias = ((2 if m.swiglu else 1) * f + m.hidden) if m.add_bias_linear else 0
    return mlp_matrices(m) * m.hidden * f + bias


def attention_params(m: ModelShape) -> int:
    h, a, norm = m.hidden, m.heads, 2 if m.layernorm else 1
    sinks = a if m.softmax_type == "learnable" else 0
    out_bias = h if m.add_bias_linear else 0
    if m.multi_latent_attention:
        # MLA with biases is not counted (no family uses it)
        qd, r, p = m.qk_head_dim + m.qk_pos_emb_head_dim, m.kv_lora_rank, m.qk_pos_emb_head_dim
        if m.q_lora_rank:
            q = h * m.q_lora_rank + m.q_lora_rank * a * qd + (norm * m.q_lora_rank if m.qk_layernorm else 0)
        else:
            q = h * a * qd
        kv = h * (r + p) + r * a * (m.qk_head_dim + m.v_head_dim) + (norm * r if m.qk_layernorm else 0)
        return q + kv + a * m.v_head_dim * h + out_bias + sinks
    d, g = m.head_dim, m.kv_heads
    qkv_out = (a + 2 * g) * d + (a * d if m.attention_output_gate else 0)
    qkv = h * qkv_out + (qkv_out if m.add_bias_linear or m.add_qkv_bias else 0)
    qk_norm = 2 * norm * d if m.qk_layernorm else 0
    return qkv + a * d * h + out_bias + qk_norm + sinks


def linear_attention_params(m: ModelShape) -> int:
    """One linear-attention mixer: Gated DeltaNet (megatron-core 0.19's parameters) or Kimi Delta Attention
    (cp_ext's, Megatron-LM's low-rank layout); no biases."""
    qk, v, hv = m.linear_key_heads * m.linear_key_dim, m.linear_value_heads * m.linear_value_dim, m.linear_value_heads
    if m.linear_variant == "kda":
        k, vd = m.linear_key_dim, m.linear_value_dim
        projections = m.hidden * (2 * qk + v) + (k * m.hidden + qk * k) + hv * m.hidden + (vd * m.hidden + v * vd)
        return projections + (2 * qk + v) * m.linear_conv_kernel + qk + hv + vd + v * m.hidden
    in_proj = m.hidden * (2 * qk + 2 * v + 2 * hv)
    return in_proj + (2 * qk + v) * m.linear_conv_kernel + 2 * hv + m.linear_value_dim + v * m.hidden


def layer_params(m: ModelShape, i: int, softmax_attention: bool = False) -> Dict[str, int]:
    """Parameters of layer i: attention, norms, dense MLP, router and shared experts ('dense',
    sharded by TP) and the routed experts ('expert', sharded by EP x ETP). ``softmax_attention``: the
    layer's kind with softmax attention even where the pattern makes it linear (the MTP layer's)."""
    linear = not softmax_attention and m.is_linear_layer(i)
    if m.compressed is not None:
        attention = compressed_attention_params(m.compressed, m.compressed.kind(i), h=m.hidden, a=m.heads,
                                                d=m.v_head_dim, q_rank=m.q_lora_rank)
    else:
        attention = linear_attention_params(m) if linear else attention_params(m)
    dense = (attention + 2 * m.hidden * (2 if m.layernorm else 1)  # (an MTP layer, i >= layers, has a stream head)
             + hyper_connection_params(m.residual_streams, m.hidden, last=i >= m.layers - 1))
    if not m.is_moe_layer(min(i, m.layers - 1)):  # an MTP layer's MLP is the last layer's
        return {"dense": dense + _mlp_params(m, m.ffn), "expert": 0}
    router = m.hidden * m.experts + (m.experts if m.add_bias_linear else 0)
    shared = (_mlp_params(m, m.shared_expert_ffn) + (m.hidden if m.shared_expert_gate else 0)
              if m.shared_expert_ffn else 0)
    return {"dense": dense + router + shared, "expert": m.experts * _mlp_params(m, m.expert_ffn)}


def mtp_layer_params(m: ModelShape, depth: int = 0) -> Dict[str, int]:
    """One MTP layer: enorm, hnorm, eh_proj, a layer like the last decoder layer, its final norm (DeepSeek-V4: its
    attention of the kind --csa-compress-ratios gives it after the decoder's, and its own stream head)."""
    per = layer_params(m, m.layers + depth, softmax_attention=True)
    norm = 2 if m.layernorm else 1
    return {"dense": per["dense"] + 3 * norm * m.hidden + 2 * m.hidden * m.hidden, "expert": per["expert"]}


def mtp_weight_layers(m: ModelShape) -> int:
    """How many MTP layers hold weights: every depth its own, or one for all (--mtp-use-repeated-layer)."""
    return min(m.mtp_layers, 1) if m.mtp_repeated else m.mtp_layers


def params_per_layer(m: ModelShape) -> Dict[str, int]:
    """The mean layer's parameters (layers differ with --moe-layer-freq); `layer_params` gives each."""
    per = [layer_params(m, i) for i in range(m.layers)]
    return {k: sum(p[k] for p in per) // m.layers for k in ("dense", "expert")}


def outside_layers_params(m: ModelShape) -> int:
    """Embedding (+ learned positions), output layer unless tied, final norm."""
    return (m.vocab * m.hidden * (1 if m.tied_embeddings else 2) + m.learned_positions * m.hidden
            + m.hidden * (2 if m.layernorm else 1))


def total_params(m: ModelShape) -> int:
    layers = sum(sum(layer_params(m, i).values()) for i in range(m.layers))
    mtp = sum(sum(mtp_layer_params(m, depth).values()) for depth in range(mtp_weight_layers(m)))
    return layers + mtp + outside_layers_params(m)


def describe(m: ModelShape) -> str:
    """One line: what the planner took the model to be."""
    dense = sum(1 for i in range(m.layers) if not m.is_moe_layer(i))
    parts = [f"{m.layers} layers" + (f" ({dense} dense)" if m.experts and dense else ""), f"hidden {m.hidden}"]
    if m.compressed is not None:
        c = m.compressed
        kinds = [c.kind(i) for i in range(m.layers)]
        parts.append(f"{m.heads} heads of {m.v_head_dim} over one K=V head, q-LoRA {m.q_lora_rank}: "
                     f"{kinds.count('sliding')} sliding, {kinds.count('csa')} CSA (1/{c.csa_ratio}"
                     + ("" if c.dense_csa else f", top-{c.index_topk}") + f"), {kinds.count('hca')} HCA "
                     f"(1/{c.hca_ratio}) layers, window {c.window}")
    elif m.multi_latent_attention:
        parts.append(f"{m.heads} heads MLA (latent {m.kv_lora_rank} + {m.qk_pos_emb_head_dim}"
                     + (f", q-LoRA {m.q_lora_rank}" if m.q_lora_rank else "") + f", q/k {m.head_dim}, v {m.v_dim})")
    else:
        parts.append(f"{m.heads} heads / {m.kv_heads} KV of {m.head_dim}" + (" + qk-norm" if m.qk_layernorm else ""))
    linear = sum(1 for i in range(m.layers) if m.is_linear_layer(i))
    if linear:
        parts.append(f"{linear} {LINEAR_MIXERS[m.linear_variant]} layers ({m.linear_key_heads} key / "
                     f"{m.linear_value_heads} value heads of {m.linear_key_dim} / {m.linear_value_dim}, "
                     f"conv {m.linear_conv_kernel})")
    if m.window_size is not None:
        windowed = sum(1 for i in range(m.layers) if m.is_window_layer(i))
        parts.append(f"window {m.window_size[0]} on {windowed} layers")
    if m.residual_streams:
        parts.append(f"{m.residual_streams} residual streams (mHC)")
    if m.experts:
        parts.append(f"{m.experts} experts top-{m.topk} of {m.expert_ffn}"
                     + (f" + shared {m.shared_expert_ffn}" if m.shared_expert_ffn else ""))
    parts.append(f"ffn {m.ffn}" if not m.experts or dense else "")
    parts.append(f"vocab {m.vocab}")
    return ", ".join(p for p in parts if p) + (f"; {m.mtp_layers} MTP layers" if m.mtp_layers else "")


def active_params(m: ModelShape) -> int:
    """Parameters one token uses: every dense part, top-k of the routed experts."""
    routed = sum(layer_params(m, i)["expert"] for i in range(m.layers) if m.is_moe_layer(i))
    return total_params(m) - routed + routed * m.topk // max(1, m.experts)


__all__ = ["ModelShape", "PRESETS", "SHAPE_FLAGS", "active_params", "attention_params", "describe", "layer_params",
           "linear_attention_params", "mlp_matrices",
           "mtp_layer_params", "mtp_weight_layers", "outside_layers_params", "params_per_layer", "total_params"]
