"""DeepSeek-V4's attention flags, Megatron-LM's spelling and meaning (`cp_ext.transformer.compressed_attention`).

``--experimental-attention-variant dsv4_hybrid`` with ``--multi-latent-attention`` makes every attention layer
V4's: one K=V head of ``--v-head-dim`` (V4: 512), its last ``--qk-pos-emb-head-dim`` (64) rotated, queries from
q-LoRA (``--q-lora-rank``, with ``--qk-layernorm``), a per-head sink logit (``--csa-no-attention-sink`` drops
it) and a grouped output projection (``--o-groups`` groups of heads, each to ``--o-lora-rank``). Each layer
reads the raw tokens of a sliding window of ``--csa-window-size`` and, by ``--csa-compress-ratios`` (one
value per layer, then one per MTP layer as Megatron-LM's V4 scripts pass them, a list expression such as
DeepSeek-V4-Flash's ``([0,0]+[4,128]*20+[4,0])``: 43 layers and the MTP layer):

* 0: the window alone (a sliding layer, RoPE base ``--rotary-base``);
* ``--csa-compress-ratio-for-c`` (4): compressed sparse attention (CSA): one entry per 4 tokens, overlapping,
  and a lightning indexer (``--dsa-indexer-n-heads`` heads of ``--dsa-indexer-head-dim``) keeps each query's
  ``--dsa-indexer-topk`` entries (``--csa-dense-mode``: all of them, no indexer);
* ``--csa-compress-ratio-for-h`` (128): heavily compressed attention (HCA): one entry per 128 tokens, all read.

The compressed layers rotate with ``--csa-compress-rotary-base`` (Megatron-LM's default 40000; V4: 160000),
YaRN-scaled under ``--rope-type yarn`` (``--rotary-scaling-factor``, ``--yarn-original-max-position-embeddings``),
the sliding ones with ``--rotary-base``. The head dims follow Megatron-LM: ``--qk-head-dim`` and
``--kv-lora-rank`` are derived (``--v-head-dim`` minus the RoPE part, and ``--v-head-dim``).
"""

from cp_ext.flag_types import POSITIVE, list_expression, number

V4_FLAGS = ("csa_compress_ratios", "csa_no_attention_sink", "csa_dense_mode")
V4_SIZES = {"o_groups": ("--o-groups", 8), "o_lora_rank": ("--o-lora-rank", 1024),
            "csa_window_size": ("--csa-window-size", 128), "csa_compress_ratio_for_c": ("--csa-compress-ratio-for-c", 4),
            "csa_compress_ratio_for_h": ("--csa-compress-ratio-for-h", 128),
            "csa_compress_rotary_base": ("--csa-compress-rotary-base", 40000.0)}


def compress_ratios_type(text):
    """Megatron-LM's ``--csa-compress-ratios``: a list expression of non-negative integers, e.g. ([0,0]+[4,128]*20)."""
    import argparse

    value = list_expression(text, "([0,0]+[4,128]*2)")
    if any(x < 0 for x in value):
        raise argparse.ArgumentTypeError(f"expected a list expression of non-negative integers such as "
                                         f"([0,0]+[4,128]*2), got {value!r}")
    return value


def add_deepseek_v4_args(g):
    g.add_argument("--csa-compress-ratios", type=compress_ratios_type, default=None,
                   help="dsv4_hybrid: each layer's compress ratio, then each MTP layer's, a list expression (0: "
                        "sliding window only; --csa-compress-ratio-for-c: CSA; --csa-compress-ratio-for-h: HCA), "
                        "e.g. ([0,0]+[4,128]*20+[4,0]) for DeepSeek-V4-Flash with --mtp-num-layers 1")
    g.add_argument("--csa-window-size", type=POSITIVE, default=128,
                   help="dsv4_hybrid: the sliding window every layer reads, in tokens (default 128)")
    g.add_argument("--csa-compress-ratio-for-c", type=POSITIVE, default=4,
                   help="dsv4_hybrid: the ratio that marks a CSA layer in --csa-compress-ratios (default 4)")
    g.add_argument("--csa-compress-ratio-for-h", type=POSITIVE, default=128,
                   help="dsv4_hybrid: the ratio that marks an HCA layer in --csa-compress-ratios (default 128)")
    g.add_argument("--csa-compress-rotary-base", type=number(float, 0, above=True), default=40000.0,
                   help="dsv4_hybrid: RoPE base of the CSA and HCA layers (default 40000; DeepSeek-V4: 160000)")
    g.add_argument("--csa-no-attention-sink", action="store_true",
                   help="dsv4_hybrid: no per-head sink logit in the softmax")
    g.add_argument("--csa-dense-mode", action="store_true",
                   help="dsv4_hybrid: CSA layers read every complete entry (no indexer)")
    g.add_argument("--o-groups", type=POSITIVE, default=8,
                   help="dsv4_hybrid: groups of heads of the grouped output projection (default 8)")
    g.add_argument("--o-lora-rank", type=POSITIVE, default=1024,
                   help="dsv4_hybrid: each group's projection rank in the grouped output projection (default 1024)")


def layer_kinds(args):
    """Each layer's V4 attention: "sliding", "csa" or "hca" (from --csa-compress-ratios), or None where a ratio is
    neither 0 nor one of the two marks."""
    marks = {0: "sliding", args.csa_compress_ratio_for_c: "csa", args.csa_compress_ratio_for_h: "hca"}
    return [marks.get(r) for r in args.csa_compress_ratios or []]


def _power_of_two(n):
    return n >= 1 and n & (n - 1) == 0


def _given_without_v4(args):
    flags = [f"--{d.replace('_', '-')}" for d in V4_FLAGS if getattr(args, d) not in (None, False)]
    flags += [flag for dest, (flag, default) in V4_SIZES.items() if getattr(args, dest) != default]
    return [f"{flag} applies to DeepSeek-V4's attention; add --experimental-attention-variant dsv4_hybrid or drop it"
            for flag in flags]


def deepseek_v4_problems(args):
    """Configuration errors of the V4 flags, naming the flag and the fix."""
    if args.experimental_attention_variant != "dsv4_hybrid":
        return _given_without_v4(args)
    variant = "--experimental-attention-variant dsv4_hybrid"
    p = []
    for dest in ("csa_compress_ratio_for_c", "csa_compress_ratio_for_h"):
        value, flag = getattr(args, dest), V4_SIZES[dest][0]
        if not _power_of_two(value):
            p.append(f"{flag} {value} is not a positive power of two: a block of tokens must tile the sequence's "
                     f"power-of-two lengths (DeepSeek-V4: 4 and 128)")
    if args.csa_compress_ratio_for_c == args.csa_compress_ratio_for_h:
        p.append(f"--csa-compress-ratio-for-c and --csa-compress-ratio-for-h are both {args.csa_compress_ratio_for_c}; "
                 f"CSA and HCA layers need different ratios (DeepSeek-V4: 4 and 128)")
    if not args.multi_latent_attention:
        p.append(f"{variant} is DeepSeek-V4's attention, configured through MLA's flags; add --multi-latent-attention")
    elif args.q_lora_rank is None:
        p.append(f"{variant} needs --q-lora-rank: V4's queries come from a low-rank projection (DeepSeek-V4: 1024)")
    if not args.qk_layernorm:
        p.append(f"{variant} normalizes the compressed query and the K/V head; add --qk-layernorm")
    ratios = args.csa_compress_ratios
    if ratios is None:
        p.append(f"{variant} needs --csa-compress-ratios: each layer's kind (0 sliding, "
                 f"{args.csa_compress_ratio_for_c} CSA, {args.csa_compress_ratio_for_h} HCA), e.g. "
                 f"([0,0]+[4,128]*20+[4,0])")
        return p
    layers = args.num_layers + (args.mtp_num_layers or 0)  # Megatron-LM's V4 scripts: the MTP layers' after
    if len(ratios) != layers and not args.mtp_num_layers:
        p.append(f"--csa-compress-ratios lists {len(ratios)} layers but --num-layers is {args.num_layers}; give one "
                 f"ratio per layer")
    elif len(ratios) != layers:
        p.append(f"--csa-compress-ratios lists {len(ratios)} layers but --num-layers {args.num_layers} and "
                 f"--mtp-num-layers {args.mtp_num_layers} make {layers}; give one ratio per layer, the MTP layers' "
                 f"last (DeepSeek-V4-Flash: ([0,0]+[4,128]*20+[4,0]))")
    bad = sorted({r for r, kind in zip(ratios, layer_kinds(args)) if kind is None})
    if bad:
        p.append(f"--csa-compress-ratios holds {bad}, which mark no layer kind: use 0 (sliding), "
                 f"{args.csa_compress_ratio_for_c} (--csa-compress-ratio-for-c, CSA) or {args.csa_compress_ratio_for_h} "
                 f"(--csa-compress-ratio-for-h, HCA)")
    indexer = (("dsa_indexer_n_heads", "--dsa-indexer-n-heads"), ("dsa_indexer_head_dim", "--dsa-indexer-head-dim"),
               ("dsa_indexer_topk", "--dsa-indexer-topk"))
    given = [flag for dest, flag in indexer if getattr(args, dest) is not None]
    kinds_known = args.csa_compress_ratio_for_c != args.csa_compress_ratio_for_h  # (equal ones: said above)
    if given and kinds_known and ("csa" not in layer_kinds(args) or args.csa_dense_mode):
        p.append(f"{', '.join(given)} size the CSA layers' indexer, which this model builds none of "
                 f"({'--csa-dense-mode' if args.csa_dense_mode else 'no CSA layer in --csa-compress-ratios'}); "
                 f"drop them")
    if "csa" in layer_kinds(args) and not args.csa_dense_mode:
        missing = [flag for dest, flag in indexer if getattr(args, dest) is None]
        if missing:
            p.append(f"the CSA layers of --csa-compress-ratios need their lightning indexer's {', '.join(missing)} "
                     f"(DeepSeek-V4: --dsa-indexer-n-heads 64 --dsa-indexer-head-dim 128 --dsa-indexer-topk 512), or "
                     f"--csa-dense-mode")
        elif args.multi_latent_attention and args.dsa_indexer_head_dim < args.qk_pos_emb_head_dim:
            p.append(f"--dsa-indexer-head-dim {args.dsa_indexer_head_dim} is smaller than the RoPE part it rotates "
                     f"(--qk-pos-emb-head-dim {args.qk_pos_emb_head_dim})")
    if args.v_head_dim <= args.qk_pos_emb_head_dim:
        p.append(f"--v-head-dim {args.v_head_dim} is V4's whole head, its last --qk-pos-emb-head-dim "
                 f"{args.qk_pos_emb_head_dim} rotated: it must be larger (DeepSeek-V4: 512 and 64)")
    heads, tp = args.num_attention_heads, args.tensor_model_parallel_size
    if heads % args.o_groups:
        p.append(f"--num-attention-heads {heads} is not a multiple of --o-groups {args.o_groups}: each output "
                 f"group takes whole heads")
    elif args.o_groups % tp:
        p.append(f"--o-groups {args.o_groups} is not divisible by --tensor-model-parallel-size {tp}: each TP rank "
                 f"projects whole groups")
    if args.reset_attention_mask and not args.reset_position_ids:
        p.append(f"{variant} with --reset-attention-mask treats each document as a sequence of its own (its windows, "
                 f"blocks and RoPE positions start at the document): add --reset-position-ids")
    return p + _unsupported(args, variant)


def _unsupported(args, variant):
    """What V4's attention does not take (yet), one message each with the way that works."""
    p = []
    off = [(args.dsa_indexer_loss_coeff, "--dsa-indexer-loss-coeff (the indexer's KL loss)"),
           (args.dsa_indexer_use_sparse_loss, "--dsa-indexer-use-sparse-loss"),
           (args.dsa_dense_warmup, "--dsa-dense-warmup"),
           (args.window_size is not None, "--window-size (V4's window is --csa-window-size)"),
           (args.softmax_type != "vanilla", f"--softmax-type {args.softmax_type} (V4's sink is on by default; "
                                            f"--csa-no-attention-sink drops it)")]
    for on, flag in off:
        if on:
            p.append(f"{flag} is not supported with {variant} yet; drop it")
    return p
