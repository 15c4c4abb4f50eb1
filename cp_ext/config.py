"""cp_ext's options on megatron-core's `TransformerConfig`, and the map from parsed arguments."""

from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.nn.functional as F

from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig


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
    CP group, `cp_ext.attention.all_gather`), else None: every layer uses the groups above.
    Not megatron's ``cp_comm_type``, which only TransformerEngine's attention reads."""

    cp_mla_exchange: str = "auto"
    """``--cp-mla-exchange``: what multi-latent attention's ring and all-gather send, "kv" or the
    "latent" (`cp_ext.transformer.mla`); "auto" takes the latent wherever it can travel."""

    attention_kernel: str = "auto"
    """The local attention kernel (`cp_ext.attention.kernels.KERNELS`), or "auto": picked per
    call by device, dtype and head dim. From ``--attention-backend``, Megatron's names mapped
    (`cp_ext.arguments.ATTENTION_BACKENDS`). megatron's own ``attention_backend`` field is left
    at auto: it only steers TransformerEngine's attention (NVTE_* variables), which cp_ext's
    core attention replaces."""


@dataclass
class ContextParallelMLATransformerConfig(ContextParallelTransformerConfig, MLATransformerConfig):
    """The same with megatron's multi-latent attention fields (``--multi-latent-attention``)."""


def _mla_fields(args):
    """MLATransformerConfig's fields from the MLA flags (Megatron-LM's names; rope_type None: MLA's yarn)."""
    if not args.multi_latent_attention:
        return {}
    return dict(multi_latent_attention=True, q_lora_rank=args.q_lora_rank, kv_lora_rank=args.kv_lora_rank,
                qk_head_dim=args.qk_head_dim, qk_pos_emb_head_dim=args.qk_pos_emb_head_dim, v_head_dim=args.v_head_dim,
                rope_type=args.rope_type or "yarn", rotary_base=args.rotary_base,
                rotary_scaling_factor=args.rotary_scaling_factor, mscale=args.mscale, mscale_all_dim=args.mscale_all_dim)


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
    """Undo megatron-core's layout-dependent MoE aux-loss strength under per-token loss.

    With ``calculate_per_token_loss`` the router multiplies each rank's partial aux loss by
    its *local* token count (moe/router.py, `attach_and_log_load_balancing_loss`), and
    `finalize_model_grads` divides by the global count. The partial losses of the TP x CP
    ranks sum to the whole microbatch's loss, but each is weighted by only 1/(TP x CP) of
    the microbatch's tokens, so the aux-loss gradient shrinks by TP x CP (with sequence
    parallelism; CP alone without it). Scaling the coefficient back makes the gradient
    equal to the single-rank one; the logged aux loss divides the coefficient out and is
    unaffected. Measured: router gradients 50% off at TP2+SP without this, 4e-7 with it.
    """
    tp = args.tensor_model_parallel_size if args.sequence_parallel else 1
    return tp * args.context_parallel_size


def transformer_config_from_args(args) -> ContextParallelTransformerConfig:
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    config_class = ContextParallelMLATransformerConfig if args.multi_latent_attention else ContextParallelTransformerConfig
    return config_class(
        **_mla_fields(args),
        ulysses_size=args.ulysses_size,
        cp_layout="zigzag" if args.cp_load_balance == "zigzag" else "contiguous",
        cp_aware_recompute=args.recompute_granularity == "full" and args.cp_aware_recompute is not False,
        attention_kernel=args.attention_kernel,
        cp_comm_types=args.cp_comm_types,
        cp_mla_exchange=args.cp_mla_exchange,
        # activation recompute: megatron's own checkpointed forward does the work
        recompute_granularity=args.recompute_granularity,
        recompute_method=args.recompute_method,
        recompute_num_layers=args.recompute_num_layers,
        recompute_modules=args.recompute_modules,
        distribute_saved_activations=args.distribute_saved_activations,
        # shape
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups,
        kv_channels=args.kv_channels,
        # attention variants (cp_ext.attention_flags): megatron's fields, applied by CoreAttention
        window_size=None if args.window_size is None else tuple(args.window_size),
        window_attn_skip_freq=args.window_attn_skip_freq,
        softmax_type=args.softmax_type,
        normalization=args.normalization,
        qk_layernorm=args.qk_layernorm,
        layernorm_epsilon=args.norm_epsilon,
        gated_linear_unit=args.swiglu,
        activation_func=F.silu if args.swiglu else F.gelu,
        add_bias_linear=False,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        init_method_std=args.init_method_std,
        # MoE
        num_moe_experts=args.num_experts,
        moe_router_topk=args.moe_router_topk,
        moe_ffn_hidden_size=args.moe_ffn_hidden_size if args.num_experts else None,
        moe_token_dispatcher_type=args.moe_token_dispatcher_type,
        moe_router_load_balancing_type=args.moe_router_load_balancing_type,
        moe_aux_loss_coeff=args.moe_aux_loss_coeff * aux_loss_layout_factor(args),
        # megatron divides the z-loss coefficient by TP x CP and weights it by local tokens: the same
        # layout factor makes its gradient the single-rank one (tests/training/test_router_flags.py).
        moe_z_loss_coeff=None if args.moe_z_loss_coeff is None else args.moe_z_loss_coeff * aux_loss_layout_factor(args),
        moe_router_pre_softmax=args.moe_router_pre_softmax,
        moe_router_score_function=args.moe_router_score_function,
        moe_router_topk_scaling_factor=args.moe_router_topk_scaling_factor,
        moe_router_num_groups=args.moe_router_num_groups,
        moe_router_group_topk=args.moe_router_group_topk,
        moe_router_enable_expert_bias=args.moe_router_enable_expert_bias,
        moe_router_bias_update_rate=args.moe_router_bias_update_rate,
        moe_router_dtype=args.moe_router_dtype,
        moe_expert_capacity_factor=args.moe_expert_capacity_factor,
        moe_token_drop_policy=args.moe_token_drop_policy,
        # parallelism
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        context_parallel_size=args.context_parallel_size,
        expert_model_parallel_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=args.expert_tensor_parallel_size,
        sequence_parallel=args.sequence_parallel,
        # precision
        bf16=args.bf16,
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
        # fused kernels that exist only with apex/TE/CUDA
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
    )
