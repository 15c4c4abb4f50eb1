"""Linear-attention hybrids (Qwen3-Next, Qwen3.5-MoE; Kimi-Linear): megatron-core's Gated DeltaNet flags,
Megatron-LM's spelling and meaning (megatron-core's ``TransformerConfig`` fields of the same names, 0.16.1 through
0.19.x).

``--experimental-attention-variant gated_delta_net`` with ``--linear-attention-freq N`` makes layer i a Gated
DeltaNet layer unless (i + 1) % N == 0, where it keeps softmax attention (N = 4: three linear layers to one
softmax layer, Qwen3-Next); a list such as ``([1]*3+[0])*12`` gives the pattern itself (1: linear).
The GDN layer's sizes: ``--linear-num-key-heads`` query/key heads of ``--linear-key-head-dim`` and
``--linear-num-value-heads`` value heads of ``--linear-value-head-dim`` (megatron's defaults: 16 of 128 and 32
of 128), and a causal depthwise conv of ``--linear-conv-kernel-dim`` taps (4). The softmax layers of those
families gate their output (``--attention-output-gate``) and the shared expert is gated
(``--moe-shared-expert-gate``): megatron-core's own modules read both.

``--experimental-attention-variant kda`` (Megatron-LM's name for Kimi Delta Attention) puts Kimi-Linear's KDA
(`cp_ext.transformer.kimi_delta_attention`) on the same layers with the same size flags: its decay is per key
channel, it has no grouped value heads (``--linear-num-value-heads`` equals ``--linear-num-key-heads``; Kimi-Linear:
32 of 128), and its low-rank gates have the head dim as rank.

Under context parallelism the linear layers keep the softmax layers' token partition and pass states
(`cp_ext.transformer.gated_delta_net`, `cp_ext.transformer.kimi_delta_attention`); megatron-core's own GDN splits
heads instead and refuses CP on 0.16.1.
"""

from cp_ext.flag_types import POSITIVE, layer_freq_type

# dest: (flag, megatron-core's default, Qwen3-Next-80B-A3B's value)
LINEAR_SIZE_FLAGS = {
    "linear_conv_kernel_dim": ("--linear-conv-kernel-dim", 4, 4),
    "linear_key_head_dim": ("--linear-key-head-dim", 128, 128),
    "linear_value_head_dim": ("--linear-value-head-dim", 128, 128),
    "linear_num_key_heads": ("--linear-num-key-heads", 16, 16),
    "linear_num_value_heads": ("--linear-num-value-heads", 32, 32),
}
LINEAR_VARIANTS = ("gated_delta_net", "kda")


def add_linear_attention_args(g):
    g.add_argument("--linear-attention-freq", type=layer_freq_type, default=None,
                   help="with --experimental-attention-variant gated_delta_net or kda: N = every N-th layer keeps "
                        "softmax attention, the others are linear (Qwen3-Next, Kimi-Linear: 4), or a 0/1 list per "
                        "layer such as ([1]*3+[0])*12 (1: linear)")
    g.add_argument("--linear-conv-kernel-dim", type=POSITIVE, default=4,
                   help="Gated DeltaNet, KDA: taps of the causal depthwise conv over q, k, v (default 4)")
    g.add_argument("--linear-key-head-dim", type=POSITIVE, default=128,
                   help="Gated DeltaNet, KDA: query/key head dim (default 128)")
    g.add_argument("--linear-value-head-dim", type=POSITIVE, default=128,
                   help="Gated DeltaNet, KDA: value/gate head dim (default 128)")
    g.add_argument("--linear-num-key-heads", type=POSITIVE, default=16,
                   help="Gated DeltaNet, KDA: query/key heads (default 16)")
    g.add_argument("--linear-num-value-heads", type=POSITIVE, default=32,
                   help="Gated DeltaNet: value/gate heads, a multiple of the key heads (default 32); KDA: equal to "
                        "the key heads")
    g.add_argument("--attention-output-gate", action="store_true",
                   help="softmax attention's output times sigmoid(gate), the gate projected with q (Qwen3-Next, "
                        "Qwen3.5: megatron-core's attention_output_gate)")


def linear_attention_pattern(args):
    """Megatron's per-layer pattern (1: linear attention, 0: softmax attention; `get_linear_attention_pattern`)."""
    freq = args.linear_attention_freq
    if freq is None:
        return [0] * args.num_layers
    if isinstance(freq, int):
        return [0 if (i + 1) % freq == 0 else 1 for i in range(args.num_layers)]
    return list(freq)


def _given_without_variant(args):
    flags = [flag for dest, (flag, default, _) in LINEAR_SIZE_FLAGS.items() if getattr(args, dest) != default]
    flags += ["--linear-attention-freq"] if args.linear_attention_freq is not None else []
    return [f"{flag} applies to linear attention layers; add --experimental-attention-variant gated_delta_net "
            f"or kda (and --linear-attention-freq) or drop it" for flag in flags]


def _cp_problems(args, variant):
    """Under a Ulysses level the linear layers split their heads over it, as the softmax layers do."""
    p = []
    ulysses = args.ulysses_size or 1
    if args.context_parallel_size > 1 and ulysses > 1:  # Ulysses splits the linear layers' heads too
        tp = args.tensor_model_parallel_size  # (`cp_ext.linear_attention.head_parallel`)
        for dest, flag in (("linear_num_key_heads", "--linear-num-key-heads"),
                           ("linear_num_value_heads", "--linear-num-value-heads")):
            heads = getattr(args, dest)
            if heads % tp == 0 and (heads // tp) % ulysses:
                p.append(f"{flag} {heads} / --tensor-model-parallel-size {tp} is not divisible by the Ulysses "
                         f"size {ulysses}: the linear layers split their heads over it; use a smaller Ulysses "
                         f"size, or --cp-comm-type p2p (state passing on the ring has no such limit)")
    return p


def linear_attention_problems(args):
    """Configuration errors of the linear-attention flags, naming the flag and the fix."""
    p = []
    if args.multi_latent_attention and args.attention_output_gate:
        p.append("--attention-output-gate is not supported with --multi-latent-attention (megatron-core's rule); "
                 "drop one of them")
    if args.experimental_attention_variant not in LINEAR_VARIANTS:
        return p + (_given_without_variant(args) if args.experimental_attention_variant is None else [])
    variant = f"--experimental-attention-variant {args.experimental_attention_variant}"
    pattern = linear_attention_pattern(args)
    if args.linear_attention_freq is None:
        p.append(f"{variant} needs --linear-attention-freq: which layers are linear (Qwen3-Next: 4, every fourth "
                 f"layer softmax attention)")
    elif len(pattern) != args.num_layers:
        p.append(f"--linear-attention-freq lists {len(pattern)} layers but --num-layers is {args.num_layers}; give one "
                 f"0/1 per layer (1: linear attention), e.g. ([1]*3+[0])*{max(args.num_layers // 4, 1)}")
    elif not any(pattern):
        p.append(f"--linear-attention-freq {args.linear_attention_freq} makes no layer linear; drop {variant} for "
                 f"softmax attention only")
    tp = args.tensor_model_parallel_size
    for dest in ("linear_num_key_heads", "linear_num_value_heads"):
        heads, flag = getattr(args, dest), LINEAR_SIZE_FLAGS[dest][0]
        if heads % tp:
            p.append(f"{flag} {heads} is not divisible by --tensor-model-parallel-size {tp}: each TP rank holds "
                     f"whole heads; pick a TP size that divides it")
    if args.experimental_attention_variant == "kda":
        if args.linear_num_value_heads != args.linear_num_key_heads:
            p.append(f"{variant} has no grouped value heads: --linear-num-value-heads {args.linear_num_value_heads} "
                     f"must equal --linear-num-key-heads {args.linear_num_key_heads} (Kimi-Linear: 32 and 32); give "
                     f"both the same")
    elif args.linear_num_value_heads % args.linear_num_key_heads:
        p.append(f"--linear-num-value-heads {args.linear_num_value_heads} must be a multiple of "
                 f"--linear-num-key-heads {args.linear_num_key_heads}: each key head serves a group of value heads")
    return p + _cp_problems(args, variant)
