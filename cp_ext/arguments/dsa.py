"""DeepSeek-V3.2's sparse attention flags, Megatron-LM's spelling and meaning (`cp_ext.transformer.dsa`).

``--experimental-attention-variant dsa`` with ``--multi-latent-attention`` makes every attention layer
DSA: a lightning indexer of ``--dsa-indexer-n-heads`` heads of ``--dsa-indexer-head-dim`` picks each
query's ``--dsa-indexer-topk`` keys, and MLA attends to those only. ``--dsa-indexer-loss-coeff`` (None
or 0: off, as in megatron-core) trains the indexer with its KL loss, over every causal key or, with
``--dsa-indexer-use-sparse-loss``, over the selected ones. Megatron-LM's flags carry no defaults for the
sizes (DeepSeek-V3.2: 64 heads of 128, top-2048), so they are required here.

``--dsa-dense-warmup`` is cp_ext's (Megatron-LM has no such flag): V3.2's first stage, in which attention
stays dense, every parameter but the indexer's is frozen, and the indexer learns from its dense loss. Its
checkpoint holds every weight; its optimizer state covers the indexer only, so the sparse stage loads it
with ``--no-load-optim`` (the parse-time check says so).
"""

from cp_ext.flag_types import POSITIVE

VARIANTS = ("dsa", "gated_delta_net", "kda", "dsv4_hybrid")
DSA_SIZE_FLAGS = {"dsa_indexer_n_heads": "--dsa-indexer-n-heads", "dsa_indexer_head_dim": "--dsa-indexer-head-dim",
                  "dsa_indexer_topk": "--dsa-indexer-topk"}
V32_SIZES = {"dsa_indexer_n_heads": 64, "dsa_indexer_head_dim": 128, "dsa_indexer_topk": 2048}


def add_dsa_args(g):
    g.add_argument("--experimental-attention-variant", choices=VARIANTS, default=None,
                   help="dsa: DeepSeek-V3.2's sparse attention (with --multi-latent-attention), exact on the CP ring "
                        "and all-gather; gated_delta_net: Qwen3-Next's linear attention on the layers "
                        "--linear-attention-freq names, exact under CP by state passing; kda: Kimi-Linear's Kimi "
                        "Delta Attention there, the same way; dsv4_hybrid: DeepSeek-V4's sliding-window, CSA and HCA "
                        "layers (with --multi-latent-attention and --csa-compress-ratios)")
    g.add_argument("--dsa-indexer-n-heads", type=POSITIVE, default=None,
                   help="DSA: the lightning indexer's heads (DeepSeek-V3.2: 64)")
    g.add_argument("--dsa-indexer-head-dim", type=POSITIVE, default=None,
                   help="DSA: the indexer's head dim, its first --qk-pos-emb-head-dim values rotated (DeepSeek-V3.2: "
                        "128)")
    g.add_argument("--dsa-indexer-topk", type=POSITIVE, default=None,
                   help="DSA: keys each query attends to, chosen by the indexer over the whole sequence "
                        "(DeepSeek-V3.2: 2048)")
    g.add_argument("--dsa-indexer-loss-coeff", type=float, default=None,
                   help="DSA: weight of the indexer's KL loss against the main attention (default None: off, as "
                        "Megatron-LM); the indexer learns from this loss only")
    g.add_argument("--dsa-indexer-use-sparse-loss", action="store_true",
                   help="DSA: the indexer loss over each query's selected keys instead of every causal key")
    g.add_argument("--dsa-dense-warmup", action="store_true",
                   help="DSA: DeepSeek-V3.2's first training stage: attention stays dense and every parameter but "
                        "the indexer's is frozen, so only the indexer learns (from its loss, over every causal key); "
                        "its checkpoint continues into sparse training with --load ... --no-load-optim")


def _given_without_dsa(args):
    flags = [flag for dest, flag in DSA_SIZE_FLAGS.items() if getattr(args, dest) is not None]
    flags += ["--dsa-indexer-loss-coeff"] if args.dsa_indexer_loss_coeff is not None else []
    flags += ["--dsa-indexer-use-sparse-loss"] if args.dsa_indexer_use_sparse_loss else []
    flags += ["--dsa-dense-warmup"] if args.dsa_dense_warmup else []
    return [f"{flag} applies to DeepSeek sparse attention; add --experimental-attention-variant dsa (or dsv4_hybrid, "
            f"whose CSA layers read the indexer flags) or drop it" for flag in flags]


def _cp_problems(args):
    """DSA runs on the ring and all-gather; Ulysses exchanges heads, and the indexer's key has one."""
    if args.context_parallel_size == 1 or args.ulysses_size in (None, 1):
        return []
    per_layer = args.cp_comm_types or [args.cp_comm_base] * args.num_layers
    if all(t == "all_gather" for t in per_layer):
        return []
    return [f"--experimental-attention-variant dsa runs under context parallelism on the ring (--cp-comm-type p2p) "
            f"and all_gather, not Ulysses or hybrid (this run: Ulysses size {args.ulysses_size}): the all-to-all "
            f"exchanges heads, and DSA's latent and indexer key have one head shared by all; use --cp-comm-type p2p "
            f"or all_gather"]


def dsa_problems(args):
    """Configuration errors of the DSA flags, naming the flag and the fix."""
    variant = args.experimental_attention_variant
    if variant == "dsv4_hybrid":  # V4's CSA layers take the indexer flags (`cp_ext.arguments.deepseek_v4`)
        return []
    if variant != "dsa":
        return _given_without_dsa(args)
    p = []
    if not args.multi_latent_attention:
        p.append("--experimental-attention-variant dsa is DeepSeek-V3.2's sparse MLA; add --multi-latent-attention")
    elif args.q_lora_rank is None:
        p.append("--experimental-attention-variant dsa needs --q-lora-rank: the indexer's queries come from q-LoRA's "
                 "compressed query (DeepSeek-V3.2: --q-lora-rank 1536)")
    missing = [flag for dest, flag in DSA_SIZE_FLAGS.items() if getattr(args, dest) is None]
    if missing:
        example = " ".join(f"{DSA_SIZE_FLAGS[d]} {v}" for d, v in V32_SIZES.items())
        p.append(f"--experimental-attention-variant dsa needs {', '.join(missing)} (DeepSeek-V3.2: {example})")
    head_dim, rope = args.dsa_indexer_head_dim, args.qk_pos_emb_head_dim
    if head_dim is not None and args.multi_latent_attention and head_dim < rope:
        p.append(f"--dsa-indexer-head-dim {head_dim} is smaller than the RoPE part it rotates (--qk-pos-emb-head-dim "
                 f"{rope}); use a head dim of at least {rope}")
    coeff = args.dsa_indexer_loss_coeff
    if coeff is not None and coeff < 0:
        p.append(f"--dsa-indexer-loss-coeff {coeff} must be >= 0 (0 or unset: no indexer loss)")
    if args.dsa_indexer_use_sparse_loss and not coeff:
        p.append("--dsa-indexer-use-sparse-loss shapes the indexer loss, which is off (--dsa-indexer-loss-coeff "
                 "unset or 0); set a coefficient or drop the flag")
    if args.dsa_dense_warmup and not coeff:
        p.append("--dsa-dense-warmup trains the indexer from its loss only, which is off (--dsa-indexer-loss-coeff "
                 "unset or 0); set a coefficient (e.g. 1) or drop --dsa-dense-warmup")
    if args.dsa_dense_warmup and args.dsa_indexer_use_sparse_loss:
        p.append("--dsa-dense-warmup attends densely and learns the indexer over every causal key (V3.2's first "
                 "stage); drop --dsa-indexer-use-sparse-loss, which belongs to the sparse stage")
    p += _cp_problems(args)
    if getattr(args, "cp_mla_exchange", "auto") == "kv":
        p.append("--cp-mla-exchange kv: DSA attends in MLA's MQA mode over the latent, which is what it exchanges; "
                 "drop --cp-mla-exchange")
    unsupported = [(args.reset_attention_mask, "--reset-attention-mask (packed documents)"),
                   (args.window_size is not None, "--window-size"),
                   (args.softmax_type != "vanilla", f"--softmax-type {args.softmax_type}")]
    for on, flag in unsupported:
        if on:
            p.append(f"{flag} is not supported with --experimental-attention-variant dsa (the indexer chooses each "
                     f"query's keys over the whole causal sequence); drop it")
    modules = (args.recompute_modules or ["core_attn"]) if args.recompute_granularity == "selective" else []
    if "core_attn" in modules:
        p.append("--recompute-modules core_attn is not supported with --experimental-attention-variant dsa (megatron's "
                 "recompute calls the core attention without the indexer's inputs); name other modules or use "
                 "--recompute-granularity full")
    return p
