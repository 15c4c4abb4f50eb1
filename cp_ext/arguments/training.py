"""Training flags (Megatron-LM's spelling): batch sizes, iterations, the LR schedule, Adam, and
activation recompute with its rules."""

import argparse

from cp_ext.flag_types import FRACTION, NON_NEGATIVE, POSITIVE, number


def add_training_args(parser):
    g = parser.add_argument_group("training")
    g.add_argument("--seq-length", type=POSITIVE, default=128)
    g.add_argument("--micro-batch-size", type=POSITIVE, default=1)
    g.add_argument("--global-batch-size", type=POSITIVE, default=None, help="defaults to micro batch x DP")
    g.add_argument("--train-iters", type=POSITIVE, default=20)
    g.add_argument("--lr", type=number(float, 0), default=3e-4)
    g.add_argument("--min-lr", type=number(float, 0), default=0.0)
    g.add_argument("--lr-warmup-iters", type=NON_NEGATIVE, default=0)
    g.add_argument("--lr-decay-iters", type=POSITIVE, default=None, help="defaults to --train-iters")
    g.add_argument("--lr-decay-style", choices=["cosine", "linear", "constant"], default="cosine")
    g.add_argument("--weight-decay", type=number(float, 0), default=0.1)
    g.add_argument("--adam-beta1", type=FRACTION, default=0.9)
    g.add_argument("--adam-beta2", type=FRACTION, default=0.95)
    g.add_argument("--adam-eps", type=number(float, 0, above=True), default=1e-8)
    g.add_argument("--clip-grad", type=number(float, 0), default=1.0)
    g.add_argument("--seed", type=NON_NEGATIVE, default=1234)
    g.add_argument("--log-interval", type=POSITIVE, default=1)
    g.add_argument("--data-seed", type=NON_NEGATIVE, default=None, help="defaults to --seed")


# megatron-core 0.16.1's TransformerConfig.recompute_modules names.
RECOMPUTE_MODULES = ["core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe", "shared_experts"]


def add_recompute_args(parser):
    g = parser.add_argument_group("activation recompute (Megatron-LM's flags)")
    g.add_argument("--recompute-granularity", choices=["full", "selective"], default=None,
                   help="full: checkpoint whole transformer layers and re-run their forward in backward; "
                        "selective: re-run only --recompute-modules")
    g.add_argument("--recompute-activations", action="store_true",
                   help="Megatron-LM's shorthand for --recompute-granularity selective")
    g.add_argument("--recompute-method", choices=["uniform", "block"], default=None,
                   help="with full granularity: uniform = checkpoint every chunk of --recompute-num-layers "
                        "layers; block = checkpoint only the first --recompute-num-layers layers of each stage")
    g.add_argument("--recompute-num-layers", type=POSITIVE, default=None,
                   help="uniform: layers per checkpointed chunk; block: layers recomputed per pipeline stage")
    g.add_argument("--recompute-modules", nargs="*", choices=RECOMPUTE_MODULES, default=None,
                   help="with selective granularity: the submodules to recompute (default core_attn)")
    g.add_argument("--distribute-saved-activations", action="store_true",
                   help="with full granularity: split each checkpointed layer input over the TP group "
                        "(needs TP > 1 without --sequence-parallel)")
    g.add_argument("--cp-aware-recompute", action=argparse.BooleanOptionalAction, default=None,
                   help="with --recompute-granularity full (on by default there): keep each layer's attention "
                        "output and log-sum-exp from the first forward, so the recompute does not re-run the "
                        "ring, all-to-all or attention kernel; --no-cp-aware-recompute is Megatron's plain full "
                        "recompute")


def _recompute_problems(args):
    """Megatron-LM's rules for the recompute flags, plus what cp_ext's model cannot honour.

    Every accepted flag must change something: a flag that would be silently ignored
    (a method without full granularity, a module this model does not have) is an error.
    """
    p = []
    granularity, method, n = args.recompute_granularity, args.recompute_method, args.recompute_num_layers
    if args.recompute_activations and granularity != "selective":
        p.append(f"--recompute-activations means --recompute-granularity selective, which contradicts "
                 f"--recompute-granularity {granularity}; give one of them")
    if args.moe_layer_recompute and granularity == "full":
        p.append("--moe-layer-recompute (selective recompute of the MoE layers) with --recompute-granularity full: "
                 "megatron-core refuses the pair; drop --moe-layer-recompute (full recompute covers the MoE layers)")
    stage_layers = args.num_layers // args.pipeline_model_parallel_size
    if granularity == "full":
        if method is None:
            p.append("--recompute-granularity full needs --recompute-method uniform (checkpoint every chunk of "
                     "--recompute-num-layers layers) or block (only the first --recompute-num-layers of each stage)")
        if n is None:
            p.append(f"--recompute-granularity full needs --recompute-num-layers N, 1 <= N <= {stage_layers} "
                     f"(the layers of one pipeline stage); 1 recomputes layer by layer")
        elif not 1 <= n <= stage_layers:
            p.append(f"--recompute-num-layers {n} must be between 1 and the {stage_layers} layers of a pipeline stage "
                     f"(--num-layers {args.num_layers} / --pipeline-model-parallel-size "
                     f"{args.pipeline_model_parallel_size})")
        elif method == "uniform" and stage_layers % n:
            p.append(f"--recompute-method uniform checkpoints chunks of --recompute-num-layers {n} layers, which "
                     f"must divide the {stage_layers} layers of a pipeline stage; choose N dividing {stage_layers}")
    else:
        if method is not None:
            p.append(f"--recompute-method {method} is only read with --recompute-granularity full "
                     f"(megatron recomputes whole layers only then); add --recompute-granularity full or drop it")
        if n is not None:
            p.append(f"--recompute-num-layers {n} is only read with --recompute-granularity full; drop it")
        if args.distribute_saved_activations:
            p.append("--distribute-saved-activations is only read with --recompute-granularity full; drop it")
        if args.cp_aware_recompute is not None:
            flag = "--cp-aware-recompute" if args.cp_aware_recompute else "--no-cp-aware-recompute"
            p.append(f"{flag} is only read with --recompute-granularity full; drop it")
    if granularity == "selective":
        modules = ["core_attn"] if args.recompute_modules is None else args.recompute_modules
        if not modules:
            p.append("--recompute-modules with no module recomputes nothing; name modules or drop "
                     "--recompute-granularity selective")
        moe = args.num_experts is not None
        from cp_ext.arguments.moe import moe_layer_pattern

        dense_layers = not moe or 0 in moe_layer_pattern(args)
        why_not = {
            "moe_act": "needs megatron's grouped-GEMM experts (moe_grouped_gemm, TransformerEngine); cp_ext's "
                       "local spec uses SequentialMLP experts. Use moe to recompute the whole MoE layer",
            "mla_up_proj": (None if args.multi_latent_attention else
                            "recomputes multi-latent attention's up projections and RoPE, and this model has no "
                            "--multi-latent-attention; use core_attn"),
            "shared_experts": (None if moe and args.moe_shared_expert_intermediate_size else
                               "applies to MoE shared experts (--moe-shared-expert-intermediate-size), which this "
                               "model does not have"),
            "mlp": None if dense_layers else "recomputes dense MLP layers; every layer here is MoE, use moe",
            "moe": None if moe else "recomputes MoE layers; this model is dense (no --num-experts), use mlp",
        }
        for module in modules:
            if why_not.get(module):
                p.append(f"--recompute-modules {module}: {why_not[module]}")
    elif args.recompute_modules is not None:
        p.append("--recompute-modules is only read with --recompute-granularity selective; add it or drop the modules")
    if granularity == "full" and args.distribute_saved_activations:
        if args.sequence_parallel:
            p.append("--distribute-saved-activations cannot be combined with --sequence-parallel (the checkpointed "
                     "input is already split over TP); drop one of them")
        elif args.tensor_model_parallel_size == 1:
            p.append("--distribute-saved-activations splits checkpointed inputs over the TP group and does nothing "
                     "with --tensor-model-parallel-size 1; drop it")
    if granularity == "full" and args.cp_aware_recompute is not False and args.attention_dropout:
        p.append(f"--attention-dropout {args.attention_dropout} cannot be kept across the recompute by "
                 f"--cp-aware-recompute (the attention output is reused, not redrawn); set --attention-dropout 0 "
                 f"or add --no-cp-aware-recompute")
    return p



def fill_training_defaults(args):
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    args.data_seed = args.seed if args.data_seed is None else args.data_seed
    if args.global_batch_size is None and args.data_parallel_size:
        args.global_batch_size = args.micro_batch_size * args.data_parallel_size
    if args.moe_layer_recompute:  # Megatron-LM's deprecated spelling of recomputing the MoE layers
        if args.recompute_granularity is None and not args.recompute_activations:
            args.recompute_granularity = "selective"
        if args.recompute_granularity == "selective" or args.recompute_activations:
            args.recompute_modules = list(args.recompute_modules or ["core_attn"]) + ["moe"]
    if args.recompute_activations and args.recompute_granularity is None:
        args.recompute_granularity = "selective"  # as in Megatron-LM


def schedule_problems(args):
    p = []
    if args.lr_warmup_iters > args.train_iters:
        p.append(f"--lr-warmup-iters {args.lr_warmup_iters} exceeds --train-iters {args.train_iters}")
    elif args.lr_warmup_iters >= args.lr_decay_iters:  # megatron's scheduler asserts warmup < decay
        p.append(f"--lr-warmup-iters {args.lr_warmup_iters} must be below --lr-decay-iters {args.lr_decay_iters} "
                 f"(which defaults to --train-iters); lower the warm-up or raise the decay iterations")
    if args.min_lr > args.lr:
        p.append(f"--min-lr {args.min_lr} exceeds --lr {args.lr}")
    return p


def training_problems(args):
    return _recompute_problems(args) + schedule_problems(args)
