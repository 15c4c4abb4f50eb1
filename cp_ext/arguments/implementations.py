"""Flags that choose among numerically equal implementations, and flags that are not training flags.

Megatron-LM's scripts pass kernel and fusion switches (``--no-rope-fusion``, ``--moe-grouped-gemm``,
``--transformer-impl``, ...). Where cp_ext runs the implementation they name, they take effect (e.g.
``--use-flash-attn`` picks the flash kernel on CUDA); where it does not, they are accepted, since
the numbers are the same, and `implementation_note` says on the startup line what runs instead.
Post-training (modelopt) flags configure export and quantization, not training: refused by name.
"""

# Fusions cp_ext never runs (they need apex/TE/CUDA kernels); the unfused ops compute the same.
FUSION_FLAGS = ("--no-masked-softmax-fusion", "--no-bias-gelu-fusion", "--no-bias-swiglu-fusion",
                "--no-bias-dropout-fusion", "--no-rope-fusion", "--no-gradient-accumulation-fusion",
                "--no-persist-layer-norm")
TRANSFORMER_IMPLS = ("local", "transformer_engine")
# Megatron-LM's examples/post_training/modelopt flags (megatron/post_training/arguments.py).
MODELOPT_PREFIXES = ("--export-", "--finetune-hf-dataset", "--finetune-data-", "--qad-", "--freeze-base-for-mtp",
                     "--modelopt-enabled", "--trust-remote-code")


def add_implementation_args(parser):
    g = parser.add_argument_group("implementations (numerically equal choices; the startup line names what runs)")
    g.add_argument("--use-mcore-models", action="store_true", help="accepted: the model is always megatron-core's")
    g.add_argument("--transformer-impl", choices=TRANSFORMER_IMPLS, default="transformer_engine",
                   help="megatron's layer modules: cp_ext builds megatron-core's local modules with its own norms and "
                        "attention in their seats either way (TransformerEngine's linear layers are not used)")
    for flag in FUSION_FLAGS:
        g.add_argument(flag, action="store_true", help="accepted: cp_ext runs these ops unfused anyway")


def modelopt_flags(argv):
    """The post-training flags in `argv` (command line tokens), which are refused with the reason."""
    return sorted({token.split("=", 1)[0] for token in argv
                   if token.startswith("--") and token.split("=", 1)[0].startswith(MODELOPT_PREFIXES)})


def modelopt_problem(flags):
    return (f"{' '.join(flags)}: Megatron-LM's post-training (modelopt) flags configure export and quantization, "
            f"not training; drop {'them' if len(flags) > 1 else 'it'} (pretrain_moe.py trains; "
            f"--enable-gpt-oss, which sets GPT-OSS's YaRN, is accepted)")


def implementation_note(args, on_cpu):
    """What runs where a flag named an implementation cp_ext does not run, for the startup line (or '')."""
    notes = []
    if args.num_experts and args.moe_grouped_gemm:
        notes.append("experts: SequentialMLP (--moe-grouped-gemm needs TransformerEngine's grouped GEMM; the same "
                     "numbers)")
    if args.use_flash_attn and on_cpu:
        notes.append("--use-flash-attn: no flash kernel on CPU, attention runs cp_ext's cpu kernel")
    if args.multi_latent_attention and args.kv_channels is not None:
        notes.append(f"--kv-channels {args.kv_channels} is not read by MLA (its dims: --qk-head-dim, "
                     f"--qk-pos-emb-head-dim, --v-head-dim)")
    return "; ".join(notes)
