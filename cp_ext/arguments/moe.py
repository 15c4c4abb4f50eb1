"""Mixture-of-experts flags (Megatron-LM's spelling and meaning): experts, which layers are MoE
(--moe-layer-freq: dense-first layers), shared experts, the router, the token dispatcher, and the
rules megatron-core 0.16.1 asserts, said at parse time instead."""

import argparse

from cp_ext.flag_types import NON_NEGATIVE, POSITIVE, flags_off_default, layer_freq_type, number


def add_moe_args(parser):
    g = parser.add_argument_group("mixture of experts")
    g.add_argument("--num-experts", type=POSITIVE, default=None, help="MoE experts per layer (None: dense MLP)")
    g.add_argument("--moe-router-topk", type=POSITIVE, default=2)
    g.add_argument("--moe-ffn-hidden-size", type=POSITIVE, default=None, help="defaults to --ffn-hidden-size")
    g.add_argument("--moe-token-dispatcher-type", choices=["allgather", "alltoall", "flex"], default="allgather",
                   help="megatron-core's token dispatchers; flex (DeepEP) needs CUDA and DeepEP")
    g.add_argument("--moe-router-load-balancing-type", choices=["aux_loss", "seq_aux_loss", "none"],
                   default="aux_loss",
                   help="aux_loss: GShard/Switch's, per microbatch; seq_aux_loss: DeepSeek-V2/V3's, per sample; "
                        "none. megatron's sinkhorn and global_aux_loss are not offered: sinkhorn normalises over each "
                        "rank's tokens and global_aux_loss averages over the microbatches seen so far, so both would "
                        "train a different model on another CP/DP layout")
    g.add_argument("--moe-aux-loss-coeff", type=number(float, 0), default=1e-2)
    g.add_argument("--moe-z-loss-coeff", type=number(float, 0, above=True), default=None,
                   help="ST-MoE's router z-loss coefficient (1e-3 is a good start); logged as z loss")
    g.add_argument("--moe-router-pre-softmax", action="store_true",
                   help="softmax (or sigmoid) before the top-k instead of after it; required with "
                        "--moe-router-topk 1 and the softmax score function (Switch), as in Megatron-LM")
    g.add_argument("--moe-router-score-function", choices=["softmax", "sigmoid", "sqrtsoftplus"], default="softmax",
                   help="sigmoid: DeepSeek-V3's scores; sqrtsoftplus: DeepSeek-V4's, sqrt(softplus(logits)) "
                        "(cp_ext's router, `cp_ext.transformer.router`)")
    g.add_argument("--moe-n-hash-layers", type=NON_NEGATIVE, default=0,
                   help="DeepSeek-V4's hash MoE: the first N MoE layers route each token by a frozen token -> experts "
                        "table (tid2eid, in the checkpoint) instead of the top-k (default 0)")
    g.add_argument("--moe-router-topk-scaling-factor", type=number(float, 0, above=True), default=None,
                   help="scale the top-k routing weights (DeepSeek-V3: 2.5); with --moe-router-pre-softmax or "
                        "--moe-router-score-function sigmoid")
    g.add_argument("--moe-router-num-groups", type=POSITIVE, default=None,
                   help="group-limited routing: experts in this many groups (DeepSeek: devices or nodes)")
    g.add_argument("--moe-router-group-topk", type=POSITIVE, default=None,
                   help="group-limited routing: the groups each token may pick experts from")
    g.add_argument("--moe-router-enable-expert-bias", action="store_true",
                   help="aux-loss-free load balancing (DeepSeek-V3): a per-expert bias on the routing scores, "
                        "updated from the global batch's expert loads; needs --moe-router-score-function sigmoid")
    g.add_argument("--moe-router-bias-update-rate", type=number(float, 0), default=1e-3,
                   help="with --moe-router-enable-expert-bias: the bias step per iteration")
    g.add_argument("--moe-router-dtype", choices=["fp32", "fp64"], default=None,
                   help="the router's logits and routing weights in this dtype (default: the model's)")
    g.add_argument("--moe-expert-capacity-factor", type=number(float, 0, above=True), default=None,
                   help="token dropping: each expert takes at most factor x (its share of) the tokens of a rank; "
                        "Megatron's meaning, per rank, so with CP or TP+SP which tokens drop depends on the layout")
    g.add_argument("--moe-token-drop-policy", choices=["probs", "position"], default="probs",
                   help="with --moe-expert-capacity-factor: drop the lowest-probability tokens (probs) or the last "
                        "ones of the batch (position)")
    g.add_argument("--moe-layer-freq", type=layer_freq_type, default=1,
                   help="which layers are MoE: N (every N-th, from layer 0) or a list expression of 0/1 per layer "
                        "such as ([0]+[1]*26) or [0]*3+[1]*58 (DeepSeek: dense first layers); 1 = every layer")
    g.add_argument("--moe-shared-expert-intermediate-size", type=POSITIVE, default=None,
                   help="shared experts (DeepSeek, Qwen2-MoE): one dense MLP of this width beside the routed experts, "
                        "on every token")
    g.add_argument("--moe-shared-expert-gate", action="store_true",
                   help="the shared experts' output times sigmoid(x . w), a learned per-token gate (Qwen2-MoE, "
                        "Qwen3-Next, Qwen3.5: megatron-core's moe_shared_expert_gate)")
    g.add_argument("--moe-shared-expert-overlap", action="store_true",
                   help="overlap the shared experts with the alltoall dispatcher's communication (megatron's; "
                        "numerically the same)")
    g.add_argument("--moe-grouped-gemm", action="store_true",
                   help="grouped-GEMM experts (TransformerEngine / grouped_gemm): the same numbers as the "
                        "SequentialMLP experts that run without them; the startup line names which runs")
    g.add_argument("--moe-layer-recompute", action="store_true",
                   help="deprecated (Megatron-LM's): --recompute-granularity selective --recompute-modules moe")


# The router flags, refused on a dense model when set off their defaults (the parser's).
_ROUTER_DESTS = ("moe_z_loss_coeff", "moe_router_pre_softmax", "moe_router_score_function", "moe_n_hash_layers",
                 "moe_router_topk_scaling_factor", "moe_router_num_groups", "moe_router_group_topk",
                 "moe_router_enable_expert_bias", "moe_router_dtype", "moe_expert_capacity_factor",
                 "moe_layer_freq", "moe_shared_expert_intermediate_size", "moe_shared_expert_overlap", "moe_shared_expert_gate",
                 "moe_grouped_gemm", "moe_layer_recompute")


def _moe_flags_given(args):
    parser = argparse.ArgumentParser(add_help=False)
    add_moe_args(parser)
    return flags_off_default(args, parser, _ROUTER_DESTS)


def fill_moe_defaults(args):
    if args.moe_ffn_hidden_size is None:
        args.moe_ffn_hidden_size = args.ffn_hidden_size


def moe_layer_pattern(args):
    """Megatron's pattern of MoE (1) and dense (0) layers (`get_gpt_decoder_layer_specs`)."""
    freq = args.moe_layer_freq
    if isinstance(freq, int):
        return [1 if i % freq == 0 else 0 for i in range(args.num_layers)]
    return list(freq)


def _router_problems(args):
    """megatron-core 0.16.1's router rules (TransformerConfig.__post_init__), said before anything is built."""
    p = []
    topk, experts = args.moe_router_topk, args.num_experts
    if topk == 1 and args.moe_router_score_function == "softmax" and not args.moe_router_pre_softmax:
        p.append("--moe-router-topk 1 with the softmax score function needs --moe-router-pre-softmax (a softmax over "
                 "the one chosen expert is 1 and gives the router no gradient); add it (Switch Transformer's routing)")
    if args.moe_router_topk_scaling_factor is not None and not (
            args.moe_router_pre_softmax or args.moe_router_score_function in ("sigmoid", "sqrtsoftplus")):
        p.append("--moe-router-topk-scaling-factor is only read with --moe-router-pre-softmax or "
                 "--moe-router-score-function sigmoid or sqrtsoftplus; add one of them or drop it")
    if args.moe_router_enable_expert_bias and args.moe_router_score_function not in ("sigmoid", "sqrtsoftplus"):
        p.append("--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid or sqrtsoftplus (megatron's "
                 "aux-loss-free balancing is defined on those scores); add one")
    groups, group_topk = args.moe_router_num_groups, args.moe_router_group_topk
    if (groups is None) != (group_topk is None):
        p.append("group-limited routing needs both --moe-router-num-groups and --moe-router-group-topk; give both or "
                 "neither")
    elif groups is not None:
        if experts % groups:
            p.append(f"--num-experts {experts} is not divisible by --moe-router-num-groups {groups}")
        elif group_topk > groups:
            p.append(f"--moe-router-group-topk {group_topk} exceeds --moe-router-num-groups {groups}")
        elif topk > group_topk * (experts // groups):
            p.append(f"--moe-router-topk {topk} exceeds the {group_topk * (experts // groups)} experts of "
                     f"--moe-router-group-topk {group_topk} groups of {experts // groups}; pick more groups per token")
    p += _v4_router_problems(args)
    if args.moe_token_drop_policy != "probs" and args.moe_expert_capacity_factor is None:
        p.append(f"--moe-token-drop-policy {args.moe_token_drop_policy} is only read with "
                 f"--moe-expert-capacity-factor; add it or drop the policy")
    return p


def uses_v4_router(args) -> bool:
    """cp_ext's router (`cp_ext.transformer.router`) routes: DeepSeek-V4's score function or hash layers."""
    return args.moe_router_score_function == "sqrtsoftplus" or args.moe_n_hash_layers > 0


def _v4_router_problems(args):
    if not uses_v4_router(args):
        return []
    what = ("--moe-n-hash-layers" if args.moe_n_hash_layers else "--moe-router-score-function sqrtsoftplus")
    p = [f"{flag} is not supported with {what} (cp_ext's DeepSeek-V4 router balances by the expert bias only, as V4 "
         f"trains); drop it" for on, flag in (
             (args.moe_router_load_balancing_type != "none",
              f"--moe-router-load-balancing-type {args.moe_router_load_balancing_type} (use none)"),
             (args.moe_expert_capacity_factor is not None, "--moe-expert-capacity-factor"),
             (args.moe_z_loss_coeff is not None, "--moe-z-loss-coeff"),
             (args.moe_router_num_groups is not None, "--moe-router-num-groups"),
             (args.moe_router_pre_softmax, "--moe-router-pre-softmax")) if on]
    moe_layers = sum(moe_layer_pattern(args))
    if args.moe_n_hash_layers > moe_layers:
        p.append(f"--moe-n-hash-layers {args.moe_n_hash_layers} exceeds the model's {moe_layers} MoE layers")
    if args.moe_n_hash_layers and args.recompute_granularity == "full" and args.pipeline_model_parallel_size > 1:
        p.append("--moe-n-hash-layers with --recompute-granularity full and --pipeline-model-parallel-size > 1 is not "
                 "supported: a layer recomputed after later microbatches' forwards would route by their token ids; "
                 "use selective recompute or one pipeline stage")
    return p


def moe_problems(args):
    p = []
    ep, tp = args.expert_model_parallel_size, args.tensor_model_parallel_size
    if args.num_experts is None:
        if ep > 1:
            p.append(f"--expert-model-parallel-size {ep} needs --num-experts")
        else:
            p.extend(f"{flag} needs --num-experts (it configures the MoE layers); add --num-experts or drop it"
                     for flag in _moe_flags_given(args))
        return p
    if args.num_experts % ep:
        p.append(f"--num-experts {args.num_experts} is not divisible by --expert-model-parallel-size {ep}")
    if args.moe_router_topk > args.num_experts:
        p.append(f"--moe-router-topk {args.moe_router_topk} exceeds --num-experts {args.num_experts}")
    p.extend(_router_problems(args))
    if args.moe_token_dispatcher_type == "flex":
        p.append("--moe-token-dispatcher-type flex is megatron's DeepEP dispatcher: it needs CUDA and the deep_ep "
                 "package (pip install deep_ep on a GPU machine); use alltoall (the same routing) or allgather")
    if tp > 1 and not args.sequence_parallel:
        p.append(f"MoE with --tensor-model-parallel-size {tp} requires --sequence-parallel "
                 f"(megatron-core's MoE layer needs it); add --sequence-parallel")
    pattern = moe_layer_pattern(args)
    if len(pattern) != args.num_layers:
        p.append(f"--moe-layer-freq lists {len(pattern)} layers but --num-layers is {args.num_layers}; give one 0/1 "
                 f"per layer (1: MoE), e.g. [0]*1+[1]*{args.num_layers - 1}")
    elif not any(pattern):
        p.append("--moe-layer-freq makes every layer dense; drop --num-experts for a dense model, or mark MoE layers 1")
    if args.moe_shared_expert_gate and args.moe_shared_expert_intermediate_size is None:
        p.append("--moe-shared-expert-gate gates the shared experts: add --moe-shared-expert-intermediate-size")
    if args.moe_shared_expert_overlap:
        if args.moe_shared_expert_intermediate_size is None:
            p.append("--moe-shared-expert-overlap needs shared experts (--moe-shared-expert-intermediate-size)")
        if args.moe_token_dispatcher_type != "alltoall":
            p.append(f"--moe-shared-expert-overlap works with the alltoall dispatcher only (megatron-core's rule); "
                     f"use --moe-token-dispatcher-type alltoall (it is {args.moe_token_dispatcher_type})")
    return p
