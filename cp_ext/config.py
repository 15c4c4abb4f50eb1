"""Map parsed arguments onto megatron-core's `TransformerConfig`, the one config every module reads."""

import torch
import torch.nn.functional as F

from megatron.core.transformer.transformer_config import TransformerConfig


def padded_vocab_size(vocab_size, divisible_by, tp_size):
    """Megatron-LM's padding: a multiple of divisible_by x TP so the vocab splits evenly."""
    multiple = divisible_by * tp_size
    return ((vocab_size + multiple - 1) // multiple) * multiple


def transformer_config_from_args(args) -> TransformerConfig:
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    return TransformerConfig(
        # shape
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups,
        kv_channels=args.kv_channels,
        normalization=args.normalization,
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
        moe_aux_loss_coeff=args.moe_aux_loss_coeff,
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
        # cp_ext draws weights itself, layout-invariantly (cp_ext.models.gpt_moe).
        perform_initialization=False,
        # fused kernels that exist only with apex/TE/CUDA
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
    )
