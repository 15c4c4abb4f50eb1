"""Parallelism flags (Megatron-LM's spelling): the TP x PP x CP x DP (x EP) grid, how the CP group
splits into Ulysses x ring (--cp-comm-type, --ulysses-size), the device, and the grid's rules."""

from cp_ext.arguments.dynamic_cp import add_dynamic_cp_args
from cp_ext.flag_types import POSITIVE
from cp_ext.grid import Grid


CP_COMM_TYPES = ["p2p", "a2a", "a2a+p2p", "all_gather"]  # Megatron-LM / TransformerEngine spelling


def add_parallel_args(parser):
    g = parser.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=POSITIVE, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=POSITIVE, default=1)
    g.add_argument("--context-parallel-size", type=POSITIVE, default=1)
    g.add_argument("--expert-model-parallel-size", type=POSITIVE, default=1)
    g.add_argument("--expert-tensor-parallel-size", type=POSITIVE, default=None,
                   help="defaults to --tensor-model-parallel-size, as in Megatron-LM")
    g.add_argument("--ulysses-size", type=POSITIVE, default=None,
                   help="Ulysses (all-to-all) sub-group size U inside the CP group; C/U ranks form the ring. "
                        "1 (default) is a pure ring, U = C pure Ulysses")
    g.add_argument("--cp-load-balance", choices=["zigzag", "none"], default="zigzag",
                   help="causal load balance of the ring's sequence shards")
    g.add_argument("--cp-comm-type", choices=CP_COMM_TYPES, nargs="+", default=None,
                   help="Megatron-LM spelling: p2p = ring, a2a = Ulysses, a2a+p2p = hybrid (sizes from "
                        "--hierarchical-context-parallel-sizes), all_gather = K/V all-gathered over the CP group. "
                        "One type for every layer, or one per layer (--num-layers of them); the layers share one "
                        "sequence layout, so a list may mix all_gather with one other type only")
    g.add_argument("--hierarchical-context-parallel-sizes", type=POSITIVE, nargs="+", default=None,
                   help="with --cp-comm-type a2a+p2p: [a2a size, p2p size], i.e. [U, C/U]")
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--use-distributed-optimizer", action="store_true")
    g.add_argument("--overlap-grad-reduce", action="store_true",
                   help="overlap the DP gradient all-reduce / reduce-scatter with the backward (bucket by bucket), "
                        "as in Megatron-LM")
    g.add_argument("--overlap-param-gather", action="store_true",
                   help="overlap the distributed optimizer's parameter all-gather with the next forward "
                        "(needs --use-distributed-optimizer and --overlap-grad-reduce, as in Megatron-LM)")
    g.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="auto: CUDA+NCCL when a GPU is visible, else CPU+gloo; cuda: an error at parse time when "
                        "CUDA is not usable; cpu: also on a GPU host (torch's optimizer, no TE/apex kernels)")
    g.add_argument("--distributed-timeout-minutes", type=POSITIVE, default=10)
    add_dynamic_cp_args(g)


def _resolve_cp_comm_types(args):
    """--cp-comm-type (one type, or one per layer) -> (the type that sets the groups, per-layer list).

    The per-layer list is None unless some layer is ``all_gather`` (the only type that changes
    what a layer does on the run's groups). All other layers must share one type: they share
    the sequence layout it implies. Problems are left for `validate_args` (returns base None).
    """
    given = args.cp_comm_type
    if not given:
        return None, None
    per_layer = given * args.num_layers if len(given) == 1 else list(given)
    base = sorted({t for t in per_layer if t != "all_gather"})
    if len(per_layer) != args.num_layers or len(base) > 1:
        return "invalid", None
    return (base[0] if base else "p2p"), (per_layer if "all_gather" in per_layer else None)


def _cp_comm_type_problems(args):
    given = args.cp_comm_type or []
    if args.cp_comm_base != "invalid":
        return []
    if len(given) not in (1, args.num_layers):
        return [f"--cp-comm-type lists {len(given)} types; give one (for every layer) or one per layer "
                f"(--num-layers {args.num_layers})"]
    others = sorted({t for t in given if t != "all_gather"})
    return [f"--cp-comm-type mixes {' and '.join(others)}: the layers share one sequence layout, so a per-layer "
            f"list may combine all_gather with one other type only (e.g. {others[0]} and all_gather)"]


def _resolve_ulysses_size(args):
    """Megatron's --cp-comm-type spelling mapped onto cp_ext's one knob, the Ulysses size U.

    Inconsistent combinations are left for `validate_args` to report (returns None).
    """
    cp, given = args.context_parallel_size, args.ulysses_size
    base = args.cp_comm_base
    if base == "invalid":
        return given or 1
    implied = {None: given or 1, "p2p": 1, "a2a": cp}.get(base)
    if base == "a2a+p2p":
        sizes = args.hierarchical_context_parallel_sizes
        implied = sizes[0] if sizes and len(sizes) == 2 and sizes[0] * sizes[1] == cp else None
    if implied is None or (given is not None and given != implied):
        return None
    return implied


def _context_parallel_problems(args):
    p = []
    cp, tp, u = args.context_parallel_size, args.tensor_model_parallel_size, args.ulysses_size
    if u is None:
        if args.cp_comm_base == "a2a+p2p":
            p.append(f"--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes U R with U x R = "
                     f"--context-parallel-size {cp} (got {args.hierarchical_context_parallel_sizes})")
        else:
            p.append(f"--ulysses-size contradicts --cp-comm-type {' '.join(args.cp_comm_type)} "
                     f"(p2p and all_gather mean U=1, a2a means U=C={cp}); give one of them")
        return p
    if u < 1 or cp % u:
        p.append(f"--ulysses-size {u} must divide --context-parallel-size {cp}")
        return p
    if args.hierarchical_context_parallel_sizes and args.cp_comm_base != "a2a+p2p":
        p.append("--hierarchical-context-parallel-sizes is only read with --cp-comm-type a2a+p2p")
    # KV heads need no rule: Ulysses replicates them as needed (cp_ext.attention.cp.ulysses.kv_replicas).
    heads = args.num_attention_heads // max(tp, 1)
    if u > 1 and heads % u:
        p.append(f"--num-attention-heads {args.num_attention_heads} / TP {tp} = {heads} query heads per TP rank "
                 f"are not divisible by --ulysses-size {u}; Ulysses shards heads, choose U dividing {heads}")
    if cp > 1 and args.attention_dropout:
        p.append(f"--attention-dropout {args.attention_dropout} is not supported with --context-parallel-size {cp}; "
                 f"set --attention-dropout 0")
    chunks = 2 * cp if args.cp_load_balance == "zigzag" else cp
    if cp > 1 and args.seq_length % chunks:
        p.append(f"--seq-length {args.seq_length} is not divisible by {chunks} = "
                 f"{'2 x ' if args.cp_load_balance == 'zigzag' else ''}--context-parallel-size {cp}"
                 f"{' (with --cp-load-balance zigzag each CP rank holds two chunks)' if args.cp_load_balance == 'zigzag' else ''}"
                 f"; use a multiple of {chunks}")
    elif args.sequence_parallel and (args.seq_length // cp) % tp:
        p.append(f"--seq-length {args.seq_length} / --context-parallel-size {cp} is not divisible by "
                 f"--tensor-model-parallel-size {tp} (required by --sequence-parallel)")
    return p


def runs_on_cpu(args):
    if args.device != "auto":
        return args.device == "cpu"
    import torch

    return not torch.cuda.is_available()


def _device_problems(args):
    """``--device cuda`` must be usable: never fall back to CPU silently."""
    if args.device != "cuda":
        return []
    from cp_ext.platform import cuda_unusable_reason

    reason = cuda_unusable_reason()
    return [f"--device cuda: {reason}; fix that, or use --device cpu (gloo)"] if reason else []



def grid_problems(args):
    """The world size against the grid, and the sizes each parallelism must divide."""
    p = Grid.problems_of(args)
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    if args.num_attention_heads % tp:
        p.append(f"--num-attention-heads {args.num_attention_heads} is not divisible by "
                 f"--tensor-model-parallel-size {tp}; choose a TP size that divides the head count")
    if args.num_query_groups % tp:
        p.append(f"--num-query-groups {args.num_query_groups} is not divisible by --tensor-model-parallel-size {tp}; "
                 f"use at least {tp} query groups or a smaller TP size")
    if args.make_vocab_size_divisible_by % tp:
        p.append(f"--make-vocab-size-divisible-by {args.make_vocab_size_divisible_by} is not a multiple of "
                 f"--tensor-model-parallel-size {tp}; the padded vocabulary must split over TP (cp_ext pads "
                 f"independently of TP so every grid builds the same model)")
    if args.num_layers % pp:
        p.append(f"--num-layers {args.num_layers} is not divisible by --pipeline-model-parallel-size {pp}; "
                 f"choose a PP size that divides the layer count")
    dp = args.data_parallel_size
    if dp and args.global_batch_size % (args.micro_batch_size * dp):
        p.append(f"--global-batch-size {args.global_batch_size} is not divisible by --micro-batch-size "
                 f"{args.micro_batch_size} x data-parallel size {dp}; use a multiple of "
                 f"{args.micro_batch_size * dp}")
    if args.overlap_param_gather and not args.use_distributed_optimizer:
        p.append("--overlap-param-gather needs --use-distributed-optimizer (it overlaps the distributed optimizer's "
                 "parameter all-gather with the next forward; as in Megatron-LM); add it or drop the flag")
    if args.overlap_param_gather and not args.overlap_grad_reduce:
        p.append("--overlap-param-gather needs --overlap-grad-reduce (as in Megatron-LM); add it")
    return p


def fill_parallel_defaults(args):
    if args.expert_tensor_parallel_size is None:
        args.expert_tensor_parallel_size = args.tensor_model_parallel_size
    model_parallel = args.tensor_model_parallel_size * args.pipeline_model_parallel_size * args.context_parallel_size
    args.data_parallel_size = args.world_size // model_parallel if args.world_size % model_parallel == 0 else None
    args.cp_comm_base, args.cp_comm_types = _resolve_cp_comm_types(args)
    args.ulysses_size = _resolve_ulysses_size(args)
    if args.tensor_model_parallel_size == 1:
        args.sequence_parallel = False  # as in Megatron-LM: SP needs TP to split over


def parallel_problems(args):
    return grid_problems(args) + _device_problems(args) + _cp_comm_type_problems(args) + _context_parallel_problems(args)
