"""cp_ext's options on megatron-core's `TransformerConfig`, and the map from parsed arguments."""

from dataclasses import dataclass
from typing import List, Optional

import dataclasses

import torch
import torch.nn.functional as F
from megatron.core.fusions.fused_bias_geglu import quick_gelu

from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

from cp_ext.arguments.deepseek_v4 import layer_kinds
from cp_ext.arguments.linear_attention import LINEAR_VARIANTS
from cp_ext.arguments.network import GPT_OSS_YARN
from cp_ext.megatron_compat import ROUTER_SCALES_AUX_LOSS_BY_TP_CP


@dataclass
class ContextParallelTransformerConfig(TransformerConfig):
    """megatron's TransformerConfig plus how cp_ext splits the sequence.

    ``context_parallel_size`` (megatron's own field) is C; the CP group is split into
    Ulysses groups of ``ulysses_size`` ranks and rings of C / ``ulysses_size`` ranks.
    """

    ulysses_size: int = 1
    """Ranks per Ulysses (all-to-all) group; 1 = pure ring, C = pure Ulysses."""

    cp_layout: str = "zigzag"
    """How the ring shards the sequence: "zigzag" (causal load balance) or "contiguous"."""

    cp_aware_recompute: bool = False
    """Under ``recompute_granularity == "full"``: keep each layer's attention output and LSE
    from the first forward so megatron's recompute does not re-run the ring, the all-to-all
    or the attention kernel (`cp_ext.transformer.recompute`)."""

    cp_comm_types: Optional[List[str]] = None
    """``--cp-comm-type`` per layer when some layer is ``all_gather`` (K/V all-gathered over the
    CP group, `cp_ext.attention.cp.all_gather`), else None: every layer uses the groups above.
    Not megatron's ``cp_comm_type``, which only TransformerEngine's attention reads."""

    cp_mla_exchange: str = "auto"
    """``--cp-mla-exchange``: what multi-latent attention's ring and all-gather send, "kv" or the
    "latent" (`cp_ext.transformer.mla`); "auto" takes the latent wherever it can travel."""

    dsa: bool = False
    """``--experimental-attention-variant dsa``: MLA's core attention is DeepSeek-V3.2's sparse attention
    (`cp_ext.transformer.dsa`). megatron's own ``experimental_attention_variant`` stays None: 0.16.1's
    config refuses it with CP > 1, and 0.19's spec builders swap in modules of their own when it is set."""

    linear_attention_variant: Optional[str] = None
    """``--experimental-attention-variant gated_delta_net`` (or ``kda``): the layers ``linear_attention_freq`` marks are
    Gated DeltaNet (`cp_ext.transformer.gated_delta_net`; Kimi Delta Attention, `cp_ext.transformer.
    kimi_delta_attention`), exact under CP by state passing. megatron's own
    ``experimental_attention_variant`` stays None, as for DSA: 0.16.1's config refuses GDN under CP, 0.19's
    requires the heads to split over TP x CP, and its spec builders would put megatron's GDN in the seat."""

    dsa_dense_warmup: bool = False
    """``--dsa-dense-warmup``: V3.2's first stage, dense attention and only the indexer trained."""

    dsv4_layer_kinds: Optional[List[str]] = None
    """``--experimental-attention-variant dsv4_hybrid``: each layer's DeepSeek-V4 attention, "sliding", "csa" or
    "hca" (from ``--csa-compress-ratios``; `cp_ext.transformer.compressed_attention`); None: not V4."""

    csa_window_size: int = 128
    """V4: the sliding window every layer reads."""

    csa_compress_ratio_for_c: int = 4
    """V4: CSA's block of tokens per entry."""

    csa_compress_ratio_for_h: int = 128
    """V4: HCA's block of tokens per entry."""

    csa_compress_rotary_base: float = 40000.0
    """V4: the RoPE base of the CSA and HCA layers (the sliding layers use ``rotary_base``)."""

    csa_attention_sink: bool = True
    """V4: a per-head sink logit in the softmax (``--csa-no-attention-sink``: none)."""

    csa_dense_mode: bool = False
    """V4: CSA layers read every complete entry, with no indexer."""

    o_groups: int = 8
    """V4: groups of heads of the grouped output projection."""

    o_lora_rank: int = 1024
    """V4: each group's rank in the grouped output projection."""

    enable_hyper_connections: bool = False
    """``--enable-hyper-connections``: ``num_residual_streams`` residual streams per token, mixed around every block
    (`cp_ext.transformer.hyper_connections`)."""

    num_residual_streams: int = 4
    """Hyper-connections: streams per token."""

    mhc_sinkhorn_iterations: int = 20
    """Hyper-connections: Sinkhorn normalizations of the stream mixing."""

    router_score_function: str = "softmax"
    """``--moe-router-score-function`` as given. With "sqrtsoftplus" (DeepSeek-V4) cp_ext's router scores
    (`cp_ext.transformer.router`) and megatron's own ``moe_router_score_function`` reads "sigmoid": megatron-core
    0.16.1 knows no sqrtsoftplus and allows the expert bias with sigmoid only (megatron_compat row)."""

    moe_n_hash_layers: int = 0
    """``--moe-n-hash-layers``: the first N MoE layers route by a frozen token -> experts table."""

    padded_vocab_size: Optional[int] = None
    """The embedding's rows (set where the model is built): the hash table's token range."""

    attention_kernel: str = "auto"
    """The local attention kernel (`cp_ext.attention.kernels.KERNELS`), or "auto": picked per
    call by device, dtype and head dim. From ``--attention-backend``, Megatron's names mapped
    (`cp_ext.arguments.ATTENTION_BACKENDS`). megatron's own ``attention_backend`` field is left
    at auto: it only steers TransformerEngine's attention (NVTE_* variables), which cp_ext's
    core attention replaces."""

    def __post_init__(self):
        # megatron asserts expert-TP 1 for biased experts, because its experts add the fc2 bias to every expert-TP
        # partial sum; cp_ext's expert seat adds it once (`cp_ext.transformer.experts`). The check runs at
        # expert-TP 1 and the run's size is put back (nothing else in the config derives from it there).
        expert_tp = self.expert_tensor_parallel_size or self.tensor_model_parallel_size
        biased_expert_tp = self.num_moe_experts is not None and self.add_bias_linear and expert_tp > 1
        if biased_expert_tp:
            self.expert_tensor_parallel_size = 1
        super().__post_init__()
        if biased_expert_tp:
            self.expert_tensor_parallel_size = expert_tp


@dataclass
class ContextParallelMLATransformerConfig(ContextParallelTransformerConfig, MLATransformerConfig):
    """The same with megatron's multi-latent attention fields (``--multi-latent-attention``)."""


def padded_vocab_size(vocab_size, divisible_by, tp_size):
    """The vocabulary padded to a multiple of ``divisible_by``, the same on every grid.

    Megatron-LM pads to a multiple of divisible_by x TP, so the padded logits (which take
    part in the softmax) and the embedding shape change with TP, and a TP2 run is not the
    TP1 model. cp_ext pads independently of TP and only requires TP to divide the result.
    """
    padded = ((vocab_size + divisible_by - 1) // divisible_by) * divisible_by
    if padded % tp_size:
        raise ValueError(
            f"the padded vocabulary ({vocab_size} -> {padded}, --make-vocab-size-divisible-by {divisible_by}) "
            f"is not divisible by --tensor-model-parallel-size {tp_size}; use a --make-vocab-size-divisible-by "
            f"that is a multiple of {tp_size}"
        )
    return padded


def aux_loss_layout_factor(args):
    """Undo megatron-core's layout-dependent MoE aux- and z-loss strength under per-token loss (0.16-0.18).

    With ``calculate_per_token_loss`` megatron-core before 0.19 multiplies each rank's partial aux loss
    by its *local* token count (moe/router.py, `attach_and_log_load_balancing_loss`), and
    `finalize_model_grads` divides by the global count. The partial losses of the TP x CP ranks sum
    to the whole microbatch's loss, but each is weighted by only 1/(TP x CP) of the microbatch's
    tokens, so the aux-loss gradient shrinks by TP x CP (with sequence parallelism; CP alone without
    it). Scaling the coefficient back makes the gradient equal to the single-rank one; the logged aux
    loss divides the coefficient out and is unaffected. Measured: router gradients 50% off at TP2+SP
    without this, 4e-7 with it. From 0.19 the router multiplies by the TP x CP size itself
    (`cp_ext.megatron_compat.ROUTER_SCALES_AUX_LOSS_BY_TP_CP`), and scaling again would double it.
    """
    if ROUTER_SCALES_AUX_LOSS_BY_TP_CP or getattr(args, "dynamic_context_parallel", False):
        return 1  # dynamic CP: per microbatch, from its group (`cp_ext.transformer.dynamic_cp.DynamicRouting`)
    tp = args.tensor_model_parallel_size if args.sequence_parallel else 1
    return tp * args.context_parallel_size


# Flags whose dest is a TransformerConfig field but whose value cp_ext sets itself (below), or that
# steer an implementation cp_ext replaces: megatron's own attention backend and TE's CP types (cp_ext's
# core attention runs instead), TE's grouped GEMM (SequentialMLP experts run), the deprecated MoE
# recompute flag (folded into recompute_modules), and the softmax precision of megatron's attention.
_NOT_COPIED = {"attention_backend", "cp_comm_type", "hierarchical_context_parallel_sizes", "moe_grouped_gemm",
               "moe_layer_recompute", "transformer_impl", "attention_softmax_in_fp32", "rope_type", "window_size",
               "moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_ffn_hidden_size", "cp_aware_recompute",
               "experimental_attention_variant",
               # dynamic CP runs on cp_ext's schedule and groups (`cp_ext.training.dynamic_batches`): megatron's config
               # must not see it, or its schedule would switch to megatron-core 0.16-0.19's hybrid-CP loop
               "hybrid_context_parallel", "dynamic_context_parallel", "max_seqlen_per_dp_cp_rank",
               "min_dynamic_context_parallel_size", "sequence_packing_scheduler", "calculate_per_token_loss"}


def _one_to_one_fields(config_class, args):
    """Every flag whose dest is a field of `config_class`, copied as is (Megatron-LM's own names)."""
    names = {f.name for f in dataclasses.fields(config_class)} - _NOT_COPIED
    return {name: value for name, value in vars(args).items() if name in names}


def _activation(args):
    if args.quick_geglu:
        return dict(activation_func=quick_gelu, gated_linear_unit=True)
    return dict(activation_func=F.silu if args.swiglu else F.gelu, gated_linear_unit=args.swiglu)


def _mla_rope(args):
    """MLA's RoPE (yarn by default, as Megatron-LM) and its YaRN's window and betas from the YaRN flags common
    attention has (megatron's MLATransformerConfig names them without the yarn_ prefix; unset: its defaults)."""
    out = dict(rope_type=args.rope_type or "yarn")
    for field, value in (("original_max_position_embeddings", args.yarn_original_max_position_embeddings),
                         ("beta_fast", args.yarn_beta_fast), ("beta_slow", args.yarn_beta_slow)):
        if value is not None:
            out[field] = value
    return out


def transformer_config_from_args(args) -> ContextParallelTransformerConfig:
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    config_class = ContextParallelMLATransformerConfig if args.multi_latent_attention else ContextParallelTransformerConfig
    fields = _one_to_one_fields(config_class, args)
    if args.moe_router_score_function == "sqrtsoftplus":  # megatron's validation; cp_ext's router scores
        fields["moe_router_score_function"] = "sigmoid"  # (`router_score_function`'s doc)
    config = config_class(
        **fields,
        **_activation(args),
        **(_mla_rope(args) if args.multi_latent_attention else {}),
        cp_layout="zigzag" if args.cp_load_balance == "zigzag" else "contiguous",
        dsa=args.experimental_attention_variant == "dsa",
        dsv4_layer_kinds=layer_kinds(args) if args.experimental_attention_variant == "dsv4_hybrid" else None,
        csa_attention_sink=not args.csa_no_attention_sink,
        router_score_function=args.moe_router_score_function,
        linear_attention_variant=(args.experimental_attention_variant
                                  if args.experimental_attention_variant in LINEAR_VARIANTS else None),
        layernorm_zero_centered_gamma=args.apply_layernorm_1p,
        cp_aware_recompute=args.recompute_granularity == "full" and args.cp_aware_recompute is not False,
        window_size=None if args.window_size is None else tuple(args.window_size),
        layernorm_epsilon=args.norm_epsilon,
        moe_ffn_hidden_size=args.moe_ffn_hidden_size if args.num_experts else None,
        num_moe_experts=args.num_experts,
        moe_aux_loss_coeff=args.moe_aux_loss_coeff * aux_loss_layout_factor(args),
        # megatron divides the z-loss coefficient by TP x CP and weights it by local tokens: the same
        # layout factor makes its gradient the single-rank one (tests/training/test_router_flags.py).
        moe_z_loss_coeff=None if args.moe_z_loss_coeff is None else args.moe_z_loss_coeff * aux_loss_layout_factor(args),
        # precision
        params_dtype=dtype,
        pipeline_dtype=dtype,
        # The per-token loss is summed and divided by the token count of the whole
        # global batch (DP x CP x microbatches), so every layout averages the same tokens.
        calculate_per_token_loss=True,
        # cp_ext overwrites every weight layout-invariantly (cp_ext.models.gpt_moe), but
        # megatron's init must still run: it is what tags TP-sharded parameters with
        # `tensor_model_parallel` (tensor_parallel/layers.py), which the grad-norm and
        # clipping code reads. Without the tags TP ranks > 0 drop out of the grad norm.
        perform_initialization=True,
        # fused kernels that exist only with apex/TE/CUDA (--no-*-fusion are accepted for that reason)
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        # dynamic CP's microbatches differ in length: a pipeline sends each one's shape ahead of it
        variable_seq_lengths=bool(getattr(args, "dynamic_context_parallel", False))
        and args.pipeline_model_parallel_size > 1,
    )
    if config.dsv4_layer_kinds or config.enable_hyper_connections or config.moe_n_hash_layers:
        # layers of different kinds (V4's attention, a hash router, the last layer's stream collapse): megatron's
        # checkpoint keys each layer on its own (decoder.layers.<i>.<name>) instead of stacking unequal ones
        config.hetereogenous_dist_checkpoint = True
    if config.dsv4_layer_kinds:  # V4's one K=V head: Megatron-LM derives MLA's head dims from --v-head-dim
        config.qk_head_dim = args.v_head_dim - args.qk_pos_emb_head_dim
        config.kv_lora_rank = args.v_head_dim
    if args.position_embedding_type == "yarn" and not args.multi_latent_attention:
        # megatron-core's GPTModel reads its YaRN from yarn_* attributes that only some configs carry; these
        # are Megatron-LM's values (megatron/training/argument_utils.py), or with --enable-gpt-oss those of its
        # post-training builder. (MLA's config has YaRN fields of its own, copied above.)
        yarn = GPT_OSS_YARN if args.enable_gpt_oss else dict(
            yarn_rotary_scaling_factor=args.rotary_scaling_factor,
            yarn_original_max_position_embeddings=args.yarn_original_max_position_embeddings or 4096,
            yarn_beta_fast=32.0 if args.yarn_beta_fast is None else args.yarn_beta_fast,
            yarn_beta_slow=1.0 if args.yarn_beta_slow is None else args.yarn_beta_slow,
            yarn_mscale=args.mscale, yarn_mscale_all_dim=args.mscale_all_dim,
            yarn_correction_range_round_to_int=args.yarn_correction_range_round_to_int is not False)
        for name, value in yarn.items():
            setattr(config, name, value)
    return config
