"""Network-size flags, as Megatron-LM spells them and with its defaults: shape, GQA, norms,
activations, biases, position embeddings (learned, RoPE, YaRN) and the vocabulary.

Each maps onto the `TransformerConfig` field of the same meaning (`cp_ext.config`); the
defaults are Megatron-LM's, so a script that omits a flag builds what Megatron-LM builds
(biases on, GeLU, LayerNorm, learned absolute positions). One deliberate difference: dropout
defaults to 0, not 0.1 (cp_ext's CP attention runs without dropout; see --attention-dropout).
"""

from cp_ext.arguments.hyper_connections import add_hyper_connection_args, hyper_connection_problems
from cp_ext.flag_types import FRACTION, POSITIVE, layer_freq_type, number

POSITION_EMBEDDINGS = ("learned_absolute", "rope", "yarn", "none")
# --enable-gpt-oss: the YaRN that Megatron-LM's post-training model builder sets for GPT-OSS
# (megatron/post_training/model_builder.py), on megatron's yarn_* config fields.
GPT_OSS_YARN = dict(yarn_rotary_scaling_factor=32.0, yarn_original_max_position_embeddings=131072,
                    yarn_beta_fast=32.0, yarn_beta_slow=1.0, yarn_mscale=1.0, yarn_mscale_all_dim=0.0,
                    yarn_correction_range_round_to_int=False)


def add_network_args(parser):
    g = parser.add_argument_group("network size")
    g.add_argument("--num-layers", type=POSITIVE, default=2)
    g.add_argument("--hidden-size", type=POSITIVE, default=64)
    g.add_argument("--ffn-hidden-size", type=POSITIVE, default=None, help="defaults to 4 x hidden size")
    g.add_argument("--num-attention-heads", type=POSITIVE, default=4)
    g.add_argument("--group-query-attention", action="store_true",
                   help="grouped-query attention with --num-query-groups K/V heads (Megatron-LM's: without this "
                        "flag --num-query-groups is not read)")
    g.add_argument("--num-query-groups", type=POSITIVE, default=None,
                   help="with --group-query-attention: the K/V heads (Megatron-LM's default 1)")
    g.add_argument("--kv-channels", type=POSITIVE, default=None, help="head dim; defaults to hidden/heads")
    g.add_argument("--normalization", choices=["LayerNorm", "RMSNorm"], default="LayerNorm")
    g.add_argument("--norm-epsilon", type=number(float, 0, above=True), default=1e-5)
    g.add_argument("--apply-layernorm-1p", action="store_true",
                   help="zero-centered norm weights: every norm scales by 1 + weight, the weight starting at 0 "
                        "(megatron's layernorm_zero_centered_gamma; Qwen3-Next, Qwen3.5)")
    g.add_argument("--swiglu", action="store_true", help="gated linear unit with SiLU (default: GeLU MLP)")
    g.add_argument("--quick-geglu", action="store_true",
                   help="gated linear unit with quick-GeLU, x * sigmoid(1.702 x) (GPT-OSS)")
    g.add_argument("--glu-linear-offset", type=number(float), default=0.0,
                   help="gated units: act(x0) * (x1 + offset) (GPT-OSS: 1.0)")
    g.add_argument("--activation-func-clamp-value", type=number(float, 0, above=True), default=None,
                   help="with --quick-geglu: clamp linear_fc1's output to this value (GPT-OSS: 7.0)")
    g.add_argument("--disable-bias-linear", dest="add_bias_linear", action="store_false", default=True,
                   help="no bias in the linear layers (Megatron-LM's default has them)")
    g.add_argument("--add-bias-linear", dest="add_bias_linear", action="store_true",
                   help="biases in every linear layer (the default)")
    g.add_argument("--add-qkv-bias", action="store_true",
                   help="a bias in the QKV projection only (Qwen2); implied by biases in every linear layer")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--init-method-std", type=number(float, 0, above=True), default=0.02)
    g.add_argument("--hidden-dropout", type=FRACTION, default=0.0, help="default 0 (Megatron-LM's: 0.1)")
    g.add_argument("--attention-dropout", type=FRACTION, default=0.0,
                   help="default 0 (Megatron-LM's: 0.1); not supported under context parallelism")
    g.add_argument("--vocab-size", type=POSITIVE, default=None, help="defaults to the tokenizer's")
    g.add_argument("--make-vocab-size-divisible-by", type=POSITIVE, default=128)
    g.add_argument("--padded-vocab-size", type=POSITIVE, default=None,
                   help="the padded vocabulary itself, instead of padding to --make-vocab-size-divisible-by")
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--mtp-num-layers", type=POSITIVE, default=None,
                   help="multi-token prediction (DeepSeek-V3): N extra layers, depth k predicting token i + 1 + k "
                        "(megatron-core's MTP block, its shifts across CP shards: cp_ext.models.mtp)")
    g.add_argument("--mtp-use-repeated-layer", action="store_true",
                   help="with --mtp-num-layers: one MTP layer's weights for every depth (megatron-core 0.17 and later)")
    g.add_argument("--mtp-loss-scaling-factor", type=number(float, 0), default=0.1,
                   help="with --mtp-num-layers: the weight of the MTP losses' mean over the depths in the loss")
    add_hyper_connection_args(g)
    _add_position_embedding_args(g)


def _add_position_embedding_args(g):
    g.add_argument("--position-embedding-type", choices=POSITION_EMBEDDINGS, default="learned_absolute",
                   help="learned_absolute (Megatron-LM's default; a table of --max-position-embeddings rows), rope, "
                        "yarn (YaRN: --rotary-scaling-factor, --yarn-*, --mscale, --mscale-all-dim; MLA takes "
                        "--rope-type), or none (NoPE)")
    g.add_argument("--max-position-embeddings", type=POSITIVE, default=None,
                   help="rows of the learned position table, and RoPE's length; defaults to --seq-length")
    g.add_argument("--no-rope-freq", type=layer_freq_type, default=None,
                   help="layers without RoPE (NoPE; megatron-core's no_rope_freq): N = every N-th layer (Llama 4: 4), "
                        "or a 0/1 list per layer such as ([0]*3+[1])*12 (1: no RoPE). Read by softmax attention "
                        "(megatron's) and by --multi-latent-attention, whose shared key part then stays unrotated "
                        "(Kimi-Linear: 1, every MLA layer)")
    g.add_argument("--use-rotary-position-embeddings", action="store_true",
                   help="deprecated (Megatron-LM's): --position-embedding-type rope")
    g.add_argument("--no-position-embedding", dest="add_position_embedding", action="store_false", default=True,
                   help="deprecated (Megatron-LM's): only with --position-embedding-type rope, where it is a no-op")
    g.add_argument("--rotary-base", type=POSITIVE, default=10000)
    g.add_argument("--rotary-percent", type=number(float, 0, 1, above=True), default=1.0,
                   help="the fraction of each head's dims RoPE rotates")
    g.add_argument("--rotary-interleaved", action="store_true",
                   help="rotate interleaved pairs (x0, x1), (x2, x3), ... instead of the two halves")
    g.add_argument("--rotary-seq-len-interpolation-factor", type=POSITIVE, default=None,
                   help="linear position interpolation: positions divided by this factor")
    g.add_argument("--use-rope-scaling", action="store_true", help="Llama 3.x's RoPE frequency scaling")
    g.add_argument("--rope-scaling-factor", type=number(float, 0, above=True), default=8.0,
                   help="with --use-rope-scaling: Llama 3.x's factor")
    # Megatron-LM's YaRN for common attention (megatron/training/argument_utils.py sets megatron-core's yarn_*
    # config values from these; unset, its defaults: factor --rotary-scaling-factor, original 4096, beta 32/1)
    g.add_argument("--yarn-original-max-position-embeddings", type=POSITIVE, default=None,
                   help="with --position-embedding-type yarn or MLA's YaRN: the positions the model was trained at "
                        "(default 4096)")
    g.add_argument("--yarn-beta-fast", type=number(float, 0, above=True), default=None,
                   help="with --position-embedding-type yarn or MLA's YaRN: YaRN's beta_fast (default 32)")
    g.add_argument("--yarn-beta-slow", type=number(float, 0, above=True), default=None,
                   help="with --position-embedding-type yarn or MLA's YaRN: YaRN's beta_slow (default 1)")
    g.add_argument("--yarn-correction-range-round-to-int", action="store_true", default=None,
                   help="with --position-embedding-type yarn: round the correction range's ends (the default)")
    g.add_argument("--no-yarn-correction-range-round-to-int", action="store_false",
                   dest="yarn_correction_range_round_to_int")
    g.add_argument("--enable-gpt-oss", action="store_true",
                   help="GPT-OSS's YaRN (scaling 32 from 131072 positions, beta 32/1), as Megatron-LM's "
                        "post-training builder sets it: --position-embedding-type yarn with those values")


def fill_network_defaults(args):
    if args.ffn_hidden_size is None:
        args.ffn_hidden_size = 4 * args.hidden_size
    # Megatron-LM: num_query_groups is read only with --group-query-attention (else every head has K/V).
    args.num_query_groups_given = args.num_query_groups
    if not args.group_query_attention:
        args.num_query_groups = args.num_attention_heads
    elif args.num_query_groups is None:
        args.num_query_groups = 1
    if args.use_rotary_position_embeddings:
        args.position_embedding_type = "rope"
    if args.enable_gpt_oss:
        args.position_embedding_type = "yarn"
    if args.add_bias_linear:
        args.add_qkv_bias = True  # as in Megatron-LM: "keep the add-bias args in sync"
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length


def network_problems(args):
    p = []
    if args.num_query_groups_given is not None and not args.group_query_attention \
            and args.num_query_groups_given != args.num_attention_heads and not args.multi_latent_attention:
        p.append(f"--num-query-groups {args.num_query_groups_given} is only read with --group-query-attention "
                 f"(Megatron-LM ignores it otherwise, and every head keeps its own K/V); add --group-query-attention")
    if args.num_attention_heads % args.num_query_groups:
        p.append(f"--num-attention-heads {args.num_attention_heads} is not divisible by --num-query-groups "
                 f"{args.num_query_groups}")
    if args.kv_channels is None and args.hidden_size % args.num_attention_heads and not args.multi_latent_attention:
        p.append(f"--hidden-size {args.hidden_size} is not divisible by --num-attention-heads "
                 f"{args.num_attention_heads}; set --kv-channels or change the sizes")
    if args.swiglu and args.quick_geglu:
        p.append("--swiglu and --quick-geglu choose the MLP's activation; give one")
    if args.glu_linear_offset and not (args.swiglu or args.quick_geglu):
        p.append(f"--glu-linear-offset {args.glu_linear_offset} is only read by a gated unit; add --quick-geglu "
                 f"(GPT-OSS) or --swiglu, or drop it")
    if args.activation_func_clamp_value is not None and not (args.quick_geglu or args.swiglu):
        p.append("--activation-func-clamp-value clamps a gated unit's inputs (megatron-core's GLU: the gate from above, "
                 "the linear part both ways); add --swiglu (DeepSeek-V4) or --quick-geglu (GPT-OSS), or drop the clamp")
    if not args.add_position_embedding and args.position_embedding_type != "rope":
        p.append("--no-position-embedding is deprecated (Megatron-LM refuses it unless RoPE is on); use "
                 "--position-embedding-type none for no position embedding")
    yarn_flags = [flag for flag, value in (
        ("--yarn-original-max-position-embeddings", args.yarn_original_max_position_embeddings),
        ("--yarn-beta-fast", args.yarn_beta_fast), ("--yarn-beta-slow", args.yarn_beta_slow),
        ("--(no-)yarn-correction-range-round-to-int", args.yarn_correction_range_round_to_int)) if value is not None]
    if args.multi_latent_attention:
        p.extend(_mla_yarn_problems(args))
    elif yarn_flags and (args.position_embedding_type != "yarn" or args.enable_gpt_oss):
        why = ("--enable-gpt-oss sets GPT-OSS's values" if args.enable_gpt_oss
               else "they configure --position-embedding-type yarn")
        p.append(f"{', '.join(yarn_flags)}: {why}; drop {'them' if len(yarn_flags) > 1 else 'it'}")
    if args.max_position_embeddings < args.seq_length and args.position_embedding_type == "learned_absolute":
        p.append(f"--seq-length {args.seq_length} exceeds --max-position-embeddings {args.max_position_embeddings}, "
                 f"the rows of the learned position table; raise --max-position-embeddings")
    rope = args.position_embedding_type in ("rope", "yarn")
    for flag, off in (("--rotary-interleaved", args.rotary_interleaved),
                      ("--rotary-seq-len-interpolation-factor", args.rotary_seq_len_interpolation_factor is not None),
                      ("--use-rope-scaling", args.use_rope_scaling), ("--rotary-percent", args.rotary_percent != 1.0)):
        if off and not rope and not args.multi_latent_attention:
            p.append(f"{flag} is only read with RoPE; add --position-embedding-type rope or drop it")
    p.extend(_no_rope_problems(args, rope))
    if args.use_rope_scaling and args.position_embedding_type != "rope":
        p.append("--use-rope-scaling scales plain RoPE's frequencies; it needs --position-embedding-type rope")
    if args.rotary_interleaved and args.multi_latent_attention:
        p.append("--rotary-interleaved is not supported with --multi-latent-attention (megatron-core refuses it); drop it")
    if args.padded_vocab_size is not None and args.padded_vocab_size % args.tensor_model_parallel_size:
        p.append(f"--padded-vocab-size {args.padded_vocab_size} is not divisible by --tensor-model-parallel-size "
                 f"{args.tensor_model_parallel_size}")
    etp, tp = args.expert_tensor_parallel_size, args.tensor_model_parallel_size
    if args.add_bias_linear and args.num_experts is not None and etp > tp:
        # megatron-core 0.16.1's grad norm finds TP duplicates by the dense TP rank (cp_ext.transformer.experts)
        p.append(f"biases in the MoE experts (the default; Megatron-LM's --disable-bias-linear drops them) run at "
                 f"--expert-tensor-parallel-size up to --tensor-model-parallel-size {tp}, and it is {etp}; lower it "
                 f"or add --disable-bias-linear")
    return p + _mtp_problems(args) + hyper_connection_problems(args)


def _no_rope_problems(args, rope):
    """--no-rope-freq: megatron-core's pattern (an int N dividing the layers, or one 0/1 per layer) over layers that
    rotate at all."""
    freq = args.no_rope_freq
    if freq is None:
        return []
    p = []
    if isinstance(freq, int) and args.num_layers % freq:
        p.append(f"--no-rope-freq {freq} does not divide --num-layers {args.num_layers} (megatron-core repeats "
                 f"{freq - 1} RoPE layers and one without); give a 0/1 list per layer (1: no RoPE) instead")
    elif not isinstance(freq, int) and len(freq) != args.num_layers:
        p.append(f"--no-rope-freq lists {len(freq)} layers but --num-layers is {args.num_layers}; give one 0/1 per "
                 f"layer (1: no RoPE)")
    if not rope and not args.multi_latent_attention:
        p.append(f"--no-rope-freq skips RoPE on some layers, but --position-embedding-type "
                 f"{args.position_embedding_type} rotates none; add --position-embedding-type rope or drop it")
    if getattr(args, "experimental_attention_variant", None) == "dsa":
        p.append("--no-rope-freq is not supported with --experimental-attention-variant dsa yet (the indexer rotates "
                 "its own key); drop one of them")
    return p


def _mla_yarn_problems(args):
    """MLA's YaRN (megatron's MLATransformerConfig: original_max_position_embeddings, beta_fast, beta_slow) takes
    the YaRN flags common attention has; it always rounds the correction range (the config has no switch)."""
    given = [flag for flag, value in (
        ("--yarn-original-max-position-embeddings", args.yarn_original_max_position_embeddings),
        ("--yarn-beta-fast", args.yarn_beta_fast), ("--yarn-beta-slow", args.yarn_beta_slow)) if value is not None]
    p = []
    if given and args.rope_type == "rope":
        p.append(f"{', '.join(given)}: they configure YaRN, and --rope-type rope runs plain RoPE; drop "
                 f"{'them' if len(given) > 1 else 'it'} or use --rope-type yarn")
    if args.yarn_correction_range_round_to_int is False:
        p.append("--no-yarn-correction-range-round-to-int: megatron's multi-latent attention always rounds YaRN's "
                 "correction range (its config has no switch); drop it")
    return p


def _mtp_problems(args):
    if args.mtp_num_layers is None:
        if args.mtp_loss_scaling_factor != 0.1 or args.mtp_use_repeated_layer:
            flag = ("--mtp-use-repeated-layer" if args.mtp_use_repeated_layer
                    else f"--mtp-loss-scaling-factor {args.mtp_loss_scaling_factor}")
            return [f"{flag} is only read with --mtp-num-layers; add --mtp-num-layers N or drop it"]
        return []
    p = []
    if args.mtp_use_repeated_layer:
        from cp_ext.megatron_compat import MTP_REPEATED_LAYER, needs_release

        if not MTP_REPEATED_LAYER:
            p.append(needs_release("--mtp-use-repeated-layer", "0.17"))
    if args.pipeline_model_parallel_size > 1 and args.position_embedding_type == "learned_absolute":
        # megatron-core builds the MTP layers on the last stage with a copy of the embedding; it keeps the word
        # embeddings' copies in sync (the embedding group), but the learned position table's only on the first
        # stage (its position-embedding group), so the last stage's copy would drift after the first step.
        p.append(f"--mtp-num-layers with --pipeline-model-parallel-size {args.pipeline_model_parallel_size} needs "
                 f"RoPE or no position embedding (--position-embedding-type rope|yarn|none): megatron-core does not "
                 f"keep the last stage's copy of the learned position table (learned_absolute) in sync for MTP")
    if args.recompute_granularity == "full" and (args.recompute_method, args.recompute_num_layers) != ("uniform", 1):
        # megatron-core's MTP layer checkpoints itself: it asserts --recompute-num-layers 1 under uniform, and
        # under block skips its own recompute with a warning at every forward.
        p.append(f"--mtp-num-layers with --recompute-granularity full needs --recompute-method uniform "
                 f"--recompute-num-layers 1 (megatron-core's MTP layer recomputes only so; got "
                 f"--recompute-method {args.recompute_method} --recompute-num-layers {args.recompute_num_layers})")
    return p
