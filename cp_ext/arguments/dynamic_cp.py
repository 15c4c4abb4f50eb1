"""Dynamic context parallelism's flags, as Megatron-LM spells them, and their rules.

    --dynamic-context-parallel         each document on a CP group of its own size over the DP x CP ranks
    --hybrid-context-parallel          megatron-core 0.16-0.19's name for it (Megatron-LM dev deprecated it)
    --max-seqlen-per-dp-cp-rank M      the tokens one rank may hold in a microbatch (required, as in 0.16-0.19)
    --min-dynamic-context-parallel-size  the smallest group (default 1: short documents run alone, no CP)
    --sequence-packing-scheduler       default_dynamic_cp (Megatron-LM's algorithm: powers of two, the default),
                                       balanced (cp_ext's: any size that divides DP x CP, the linear work and the
                                       exchange in the cost); dp_balanced is static CP's (refused with dynamic CP,
                                       as Megatron-LM refuses it)
    --calculate-per-token-loss         Megatron-LM requires it with dynamic CP, and so does cp_ext; cp_ext's loss
                                       is always the per-token mean over the global batch (`cp_ext.training.steps`)

A sample is then one whole document (`cp_ext.data.variable_length`), cut at --seq-length.
"""

from cp_ext.flag_types import POSITIVE
from cp_ext.megatron_version import at_least, installed

SCHEDULERS = ("dp_balanced", "default_dynamic_cp", "balanced")


def add_dynamic_cp_args(g):
    g.add_argument("--dynamic-context-parallel", action="store_true",
                   help="dynamic context parallelism: a sample is one document, run on a CP group of the DP x CP "
                        "ranks sized by its length (Megatron-LM's flag)")
    g.add_argument("--hybrid-context-parallel", action="store_true",
                   help="megatron-core 0.16-0.19's name for --dynamic-context-parallel")
    g.add_argument("--max-seqlen-per-dp-cp-rank", type=POSITIVE, default=None,
                   help="with --dynamic-context-parallel: the most tokens one rank holds in a microbatch; a "
                        "document of L tokens runs on at least L / this many ranks")
    g.add_argument("--min-dynamic-context-parallel-size", type=POSITIVE, default=1,
                   help="the smallest dynamic CP group (1: a short document runs on one rank, with no exchange)")
    g.add_argument("--sequence-packing-scheduler", choices=SCHEDULERS, default=None,
                   help="default_dynamic_cp (default with --dynamic-context-parallel): Megatron-LM's scheduler, "
                        "power-of-two groups, cost L^2 / c; balanced: cp_ext's, groups of any size dividing DP x CP, "
                        "cost = causal pairs + linear work + exchange")
    g.add_argument("--calculate-per-token-loss", action="store_true",
                   help="the loss is the mean over every token of the global batch (cp_ext always computes it so; "
                        "required with --dynamic-context-parallel, as in Megatron-LM)")


def fill_dynamic_cp_defaults(args):
    """--hybrid-context-parallel turns dynamic CP on; its scheduler defaults to Megatron-LM's."""
    if getattr(args, "hybrid_context_parallel", False):
        args.dynamic_context_parallel = True
    if args.dynamic_context_parallel and args.sequence_packing_scheduler is None:
        args.sequence_packing_scheduler = "default_dynamic_cp"


def dynamic_cp_problems(args) -> list:
    if not args.dynamic_context_parallel:
        p = []
        if args.sequence_packing_scheduler is not None:
            p.append(f"--sequence-packing-scheduler {args.sequence_packing_scheduler} packs variable-length samples, "
                     f"which cp_ext runs with --dynamic-context-parallel only; add it, or drop the scheduler")
        if args.max_seqlen_per_dp_cp_rank is not None or args.min_dynamic_context_parallel_size != 1:
            p.append("--max-seqlen-per-dp-cp-rank and --min-dynamic-context-parallel-size take effect with "
                     "--dynamic-context-parallel only; add it, or drop them")
        return p
    p = []
    dp_cp = args.world_size // (args.tensor_model_parallel_size * args.pipeline_model_parallel_size)
    if not args.calculate_per_token_loss:
        p.append("--dynamic-context-parallel needs --calculate-per-token-loss (as in Megatron-LM: documents of "
                 "different lengths on different CP sizes average over tokens, not microbatches); add it")
    if args.sequence_packing_scheduler == "dp_balanced":
        p.append("--sequence-packing-scheduler dp_balanced is static CP's packing; with --dynamic-context-parallel "
                 "use default_dynamic_cp (Megatron-LM's) or balanced (cp_ext's)")
    if args.max_seqlen_per_dp_cp_rank is None:
        p.append(f"--dynamic-context-parallel needs --max-seqlen-per-dp-cp-rank (the tokens one rank holds in a "
                 f"microbatch); a start: --seq-length / --context-parallel-size = "
                 f"{-(-args.seq_length // args.context_parallel_size)}")
    elif args.max_seqlen_per_dp_cp_rank * dp_cp < args.seq_length:
        p.append(f"--max-seqlen-per-dp-cp-rank {args.max_seqlen_per_dp_cp_rank} x {dp_cp} DP x CP ranks = "
                 f"{args.max_seqlen_per_dp_cp_rank * dp_cp} tokens cannot hold a document of --seq-length "
                 f"{args.seq_length} tokens (the longest a sample gets); raise it to at least "
                 f"{-(-args.seq_length // dp_cp)} or lower --seq-length")
    if args.min_dynamic_context_parallel_size > dp_cp or dp_cp % args.min_dynamic_context_parallel_size:
        p.append(f"--min-dynamic-context-parallel-size {args.min_dynamic_context_parallel_size} must divide the "
                 f"{dp_cp} DP x CP ranks (a group is an aligned block of them)")
    p += [f"--dynamic-context-parallel with {what}: {why}" for what, why in _unsupported(args)]
    return p


def _unsupported(args):
    """The combinations dynamic CP does not run yet, each with the reason."""
    out = []
    routers_recomputed = args.recompute_granularity == "full" or (
        args.recompute_granularity == "selective" and "moe" in (args.recompute_modules or []))
    if args.pipeline_model_parallel_size > 1 and routers_recomputed:
        out.append(("--pipeline-model-parallel-size > 1 and --recompute-granularity full (or --recompute-modules moe)",
                    "not yet (the pipeline runs "
                    "a later microbatch's forward before an earlier one's recompute, and the routers' group is set "
                    "per forward); use PP 1 or no full recompute"))
    if args.pipeline_model_parallel_size > 1 and args.tensor_model_parallel_size > 1 and args.sequence_parallel:
        out.append(("--pipeline-model-parallel-size > 1 with TP and --sequence-parallel", "not yet (megatron scatters "
                    "the routers' padding mask over TP on the first stage only); use PP 1 or TP 1"))
    if (args.ulysses_size or 1) > 1 or (args.cp_comm_type and {"a2a", "a2a+p2p"} & set(args.cp_comm_type)):
        out.append(("Ulysses (--cp-comm-type a2a / a2a+p2p)", "a dynamic group runs the ring or all_gather; use p2p"))
    if args.expert_model_parallel_size > 1 and args.num_experts and args.moe_token_dispatcher_type == "allgather":
        out.append(("--expert-model-parallel-size > 1 and --moe-token-dispatcher-type allgather", "the allgather "
                    "dispatcher needs the same token count on every EP rank, and a rank's tokens vary with its "
                    "group; use --moe-token-dispatcher-type alltoall"))
    elif args.pipeline_model_parallel_size > 1 and args.num_experts and args.moe_token_dispatcher_type == "allgather":
        out.append(("--pipeline-model-parallel-size > 1 and --moe-token-dispatcher-type allgather", "the pipeline "
                    "sends microbatches of varying length, which megatron-core's allgather dispatcher refuses; use "
                    "--moe-token-dispatcher-type alltoall"))
    version = installed()
    if args.mtp_num_layers and args.num_experts and (args.moe_aux_loss_coeff or args.moe_z_loss_coeff) and \
            version is not None and not at_least(version, "0.18"):
        out.append((f"--mtp-num-layers and the MoE aux or z loss on megatron-core {version}", "its MTP layers take "
                    "no padding mask before 0.18, so their routers would count padding; use megatron-core 0.18+, or "
                    "--moe-aux-loss-coeff 0 and no --moe-z-loss-coeff"))
    if getattr(args, "experimental_attention_variant", None) == "dsa":
        out.append(("--experimental-attention-variant dsa", "not yet"))
    if args.synthetic_task:
        out.append((f"--synthetic-task {args.synthetic_task}", "dynamic CP reads documents from --data-path (or the "
                    "embedded corpus)"))
    if args.data_path and len(args.data_path) > 1 and _weighted(args.data_path):
        out.append(("a weighted --data-path blend", "not yet: give the prefixes without weights"))
    return out


def _weighted(paths):
    try:
        float(paths[0])
        return True
    except ValueError:
        return False
