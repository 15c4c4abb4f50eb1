"""Command line and YAML configuration, in Megatron-LM's flag spellings, and their validation.

Precedence: built-in defaults < ``--config FILE.yaml`` < flags on the command line.
YAML keys are the flag names without the leading dashes, with ``-`` or ``_``
(``num-layers: 4`` or ``num_layers: 4``); an unknown key is an error, not a silent no-op.

`validate_args` checks the whole TP x PP x CP x DP (x EP) grid before any process group
or model exists, and reports every problem at once, each naming the flags and the fix.
"""

import argparse
import math
import os
import sys
import time

import yaml

from cp_ext.attention_flags import add_attention_args, add_mla_args, attention_flag_problems


class ConfigError(ValueError):
    """A bad flag or config value; the message names the flag and the fix."""


def number(kind, low=None, high=None, *, above=False, below=False):
    """An argparse ``type``: an int or a finite float in [low, high] (``above``/``below``: open ends).

    The range is checked where the value is parsed, for the command line and YAML alike, so a
    0 or a NaN never reaches a default (``--ffn-hidden-size 0``) or a division
    (``--num-attention-heads 0``)."""
    what = "an integer" if kind is int else "a number"
    bounds = [f"{'>' if above else '>='} {low}" if low is not None else None,
              f"{'<' if below else '<='} {high}" if high is not None else None]
    expected = f"{what} {' and '.join(b for b in bounds if b)}".strip()

    def parse(text):
        try:
            value = kind(text)
        except (TypeError, ValueError):
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if (kind is float and not math.isfinite(value)) or (low is not None and (value < low or above and value == low)) \
                or (high is not None and (value > high or below and value == high)):
            raise argparse.ArgumentTypeError(f"must be {expected} (got {text})")
        return value

    parse.__name__ = expected  # what argparse's own messages call the type
    return parse


POSITIVE = number(int, 1)
NON_NEGATIVE = number(int, 0)
FRACTION = number(float, 0, 1, below=True)  # dropout, Adam betas


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose errors are ConfigErrors: one message from rank 0, exit 2, on every launch path."""

    def error(self, message):
        hint = " (pretrain_moe.py --help lists the flags)" if message.startswith("unrecognized") else ""
        raise ConfigError(f"  - {message.removeprefix('argument ')}{hint}")


class RunArgs(argparse.Namespace):
    """The run configuration: validated once by `parse_args`, then frozen.

    Components read it and never write it (each keeps what it derives, e.g. the trainer's
    padded vocabulary), so what a run was configured with is what it ran with."""

    def freeze(self):
        self.__class__ = _FrozenRunArgs  # no marker in vars(args): config.yaml and checkpoints stay clean
        return self


class _FrozenRunArgs(RunArgs):
    def __setattr__(self, name, value):
        raise AttributeError(f"the run configuration is frozen after validation; cannot set args.{name} "
                             f"(keep derived values on the component that derives them)")

    def __delattr__(self, name):
        self.__setattr__(name, None)


def _add_parallel_args(parser):
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


def _add_model_args(parser):
    g = parser.add_argument_group("model")
    g.add_argument("--num-layers", type=POSITIVE, default=2)
    g.add_argument("--hidden-size", type=POSITIVE, default=64)
    g.add_argument("--ffn-hidden-size", type=POSITIVE, default=None, help="defaults to 4 x hidden size")
    g.add_argument("--num-attention-heads", type=POSITIVE, default=4)
    g.add_argument("--num-query-groups", type=POSITIVE, default=None, help="GQA groups; defaults to the head count")
    g.add_argument("--kv-channels", type=POSITIVE, default=None, help="head dim; defaults to hidden/heads")
    g.add_argument("--num-experts", type=POSITIVE, default=None, help="MoE experts per layer (None: dense MLP)")
    g.add_argument("--moe-router-topk", type=POSITIVE, default=2)
    g.add_argument("--moe-ffn-hidden-size", type=POSITIVE, default=None, help="defaults to --ffn-hidden-size")
    g.add_argument("--moe-token-dispatcher-type", choices=["allgather", "alltoall"], default="allgather")
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
    g.add_argument("--moe-router-score-function", choices=["softmax", "sigmoid"], default="softmax",
                   help="sigmoid: DeepSeek-V3's scores")
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
    g.add_argument("--normalization", choices=["LayerNorm", "RMSNorm"], default="RMSNorm")
    g.add_argument("--norm-epsilon", type=number(float, 0, above=True), default=1e-5)
    g.add_argument("--qk-layernorm", action="store_true",
                   help="normalize each head's q and k (Qwen3, OLMoE; --normalization's kind), and with "
                        "--multi-latent-attention MLA's q-LoRA and K/V latents (DeepSeek-V2/V3), as Megatron-LM")
    g.add_argument("--swiglu", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--rotary-base", type=POSITIVE, default=10000)
    g.add_argument("--init-method-std", type=number(float, 0, above=True), default=0.02)
    g.add_argument("--hidden-dropout", type=FRACTION, default=0.0)
    g.add_argument("--attention-dropout", type=FRACTION, default=0.0)
    g.add_argument("--vocab-size", type=POSITIVE, default=None, help="defaults to the tokenizer's")
    g.add_argument("--make-vocab-size-divisible-by", type=POSITIVE, default=128)
    g.add_argument("--bf16", action="store_true")
    add_attention_args(g)
    add_mla_args(g)
    g.add_argument("--attention-backend", default=os.environ.get("CP_EXT_ATTN_KERNEL") or "auto",
                   choices=list(ATTENTION_BACKENDS),
                   help="the local attention kernel, Megatron-LM's choices mapped onto cp_ext's kernels: "
                        "auto = per call, the first that fits dtype and head dim (CUDA: flash, else efficient, "
                        "else unfused; CPU: cpu); flash = FlashAttention-2 in torch (fp16/bf16, head dim %% 8 == 0 "
                        "and <= 256); fused = cuDNN fused attention (cudnn: fp16/bf16, head dim %% 8 == 0 and "
                        "<= 128); unfused and local = plain PyTorch math (any dtype and head dim, s x s memory). "
                        "cp_ext's kernels by name: efficient (fp32/fp16/bf16, head dim %% 8 == 0, %% 4 for fp32), "
                        "cudnn, flash_attn and te (packages; fp16/bf16), cpu. Checked at parse time against "
                        "--bf16, the head dim and --device. Default: $CP_EXT_ATTN_KERNEL if set, else auto")


def _add_training_args(parser):
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


# --attention-backend: Megatron-LM's choices (megatron.core.transformer.enums.AttnBackend) and
# cp_ext's kernel names, each mapped onto a kernel of cp_ext.attention.kernels ("auto": per call).
ATTENTION_BACKENDS = {
    "auto": "auto", "flash": "flash", "fused": "cudnn", "unfused": "unfused", "local": "unfused",
    "efficient": "efficient", "cudnn": "cudnn", "flash_attn": "flash_attn", "te": "te", "cpu": "cpu",
}

# megatron-core 0.16.1's TransformerConfig.recompute_modules names.
RECOMPUTE_MODULES = ["core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe", "shared_experts"]


def _add_recompute_args(parser):
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


def _add_logging_args(parser):
    g = parser.add_argument_group("logging")
    g.add_argument("--log-dir", default=None,
                   help="run directory for metrics.jsonl and config.yaml (default runs/<exp name or time>)")
    g.add_argument("--wandb-project", default=None, help="log to wandb (WANDB_MODE=offline/disabled respected)")
    g.add_argument("--wandb-exp-name", default=None, help="wandb run name; also names the default --log-dir")
    g.add_argument("--wandb-save-dir", default=None, help="wandb's directory (default: the run directory)")
    g.add_argument("--wandb-entity", default=None)


def _add_checkpoint_args(parser):
    g = parser.add_argument_group("checkpointing")
    g.add_argument("--save", default=None, help="directory to save checkpoints to")
    g.add_argument("--save-interval", type=POSITIVE, default=None, help="iterations between checkpoints")
    g.add_argument("--load", default=None, help="directory to resume from (its latest checkpoint)")
    g.add_argument("--exit-interval", type=POSITIVE, default=None,
                   help="stop after the iteration that is a multiple of this (saving first if --save)")
    g.add_argument("--exit-signal-handler", action="store_true",
                   help="on SIGTERM (SLURM's time limit or preemption), finish the current iteration, save a "
                        "checkpoint (with --save) and exit 0; resume with --load")
    g.add_argument("--override-opt_param-scheduler", action="store_true",
                   help="on --load, train with this run's LR/WD schedule flags instead of the checkpoint's")
    g.add_argument("--use-checkpoint-opt_param-scheduler", action="store_true",
                   help="on --load, keep the checkpoint's LR/WD schedule (with neither flag, a changed schedule "
                        "is an error, as in Megatron-LM)")
    g.add_argument("--no-load-optim", action="store_true",
                   help="on --load, do not load the optimizer state (fresh Adam moments; this run's schedule)")
    g.add_argument("--no-load-rng", action="store_true", help="on --load, do not restore the RNG states")
    g.add_argument("--ckpt-fallback", action="store_true",
                   help="on --load, if the latest checkpoint cannot be read (truncated or corrupt), load the newest "
                        "earlier complete one instead, saying so")
    g.add_argument("--finetune", action="store_true",
                   help="on --load, load the weights only and start at iteration 0 (no optimizer, RNG, data position)")


def _add_data_args(parser):
    g = parser.add_argument_group("data")
    g.add_argument("--data-path", nargs="+", default=None,
                   help="Megatron indexed dataset prefixes, optionally weighted: [W1] P1 [W2 P2 ...] "
                        "(default: the embedded stdlib corpus)")
    g.add_argument("--split", default="969,30,1",
                   help="train,valid,test weights of --data-path's documents (valid/test are used by --eval-interval)")
    g.add_argument("--valid-data-path", nargs="+", default=None,
                   help="the validation split's own dataset prefixes ([W1] P1 ...), instead of --split's share")
    g.add_argument("--test-data-path", nargs="+", default=None,
                   help="the test split's own dataset prefixes ([W1] P1 ...), instead of --split's share")
    g.add_argument("--eval-interval", type=POSITIVE, default=None,
                   help="validation loss every N iterations (and on the test split at the end of training); "
                        "off when not given")
    g.add_argument("--eval-iters", type=NON_NEGATIVE, default=100,
                   help="global batches per evaluation, the same samples each time (0: no evaluation)")
    g.add_argument("--skip-train", action="store_true",
                   help="no training: evaluate the valid and test splits once (with --load, the checkpoint) and exit")
    g.add_argument("--tokenizer-type", choices=["ByteTokenizer", "HuggingFaceTokenizer"], default="ByteTokenizer")
    g.add_argument("--tokenizer-model", default=None, help="tokenizer.json for HuggingFaceTokenizer")
    g.add_argument("--data-cache-path", default=None,
                   help="where dataset indices (and the embedded corpus) are cached (default ~/.cache/cp_ext "
                        "for the embedded corpus, next to the data otherwise)")
    g.add_argument("--synthetic-task", choices=["passkey"], default=None,
                   help="train on a synthetic task instead: passkey = recall a key seen early (long range)")
    # Megatron-LM's packed-document flags: a sample of --seq-length tokens spans several documents, each
    # ended by the tokenizer's EOD token (the token after an EOD starts the next document).
    g.add_argument("--reset-position-ids", action="store_true",
                   help="position ids (and RoPE) restart at 0 after every EOD token, as in Megatron-LM")
    g.add_argument("--reset-attention-mask", action="store_true",
                   help="a token attends only to its own document (the tokens since the last EOD), as in Megatron-LM")
    g.add_argument("--eod-mask-loss", action="store_true",
                   help="no loss where the input token is an EOD (its target is the next document's first token), "
                        "as in Megatron-LM")


ALL_GROUPS = (_add_parallel_args, _add_model_args, _add_training_args, _add_recompute_args, _add_logging_args,
              _add_checkpoint_args, _add_data_args)


CP_COMM_TYPES = ["p2p", "a2a", "a2a+p2p", "all_gather"]  # Megatron-LM / TransformerEngine spelling


def build_parser():
    parser = ArgumentParser(
        prog="pretrain_moe.py",
        allow_abbrev=False,  # as in Megatron-LM: --num-layer is a typo, not --num-layers
        description="Train a MoE GPT with megatron-core and cp_ext (Megatron-LM flag names).",
    )
    parser.add_argument("--config", default=None, help="YAML file of defaults; flags override it")
    for add in ALL_GROUPS:
        add(parser)
    return parser


def _read_yaml(path):
    try:
        with open(path, encoding="utf-8") as f:
            values = yaml.safe_load(f) or {}
    except OSError as e:
        raise ConfigError(f"  - --config {path}: cannot read it ({e.strerror or e})")
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise ConfigError(f"  - --config {path}: not valid YAML: {e}")
    if not isinstance(values, dict):
        raise ConfigError(f"  - --config {path}: expected a mapping of flag names to values, e.g. num-layers: 4")
    return values


def _yaml_tokens(parser, path, values):
    """YAML keys -> the command-line tokens they stand for, so the same parser types them.

    ``bf16: "false"`` is not a boolean, ``device: gpu`` not a choice, ``seq-length: [128]``
    not an integer: each is the error its flag would give, naming the file and the key. A
    scalar for a list flag is a one-item list (``data-path: /x/prefix``)."""
    actions = {action.dest: action for action in parser._actions}
    tokens = []
    for key, value in values.items():
        dest = str(key).lstrip("-").replace("-", "_")
        action = actions.get(dest)
        if action is None or dest in ("config", "help"):
            raise ConfigError(f"  - --config {path}: unknown key {key!r} (keys are flag names, e.g. num-layers)")
        flag = next(o for o in action.option_strings if o.startswith("--"))
        where = f"--config {path}: {key}: {value!r}"
        if isinstance(action, (argparse._StoreTrueAction, argparse.BooleanOptionalAction)):
            if not isinstance(value, bool):
                raise ConfigError(f"  - {where} is not a boolean; write true or false (unquoted)")
            if isinstance(action, argparse.BooleanOptionalAction):
                tokens.append(flag if value else "--no-" + flag[2:])
            elif value:
                tokens.append(flag)
            continue
        items = value if isinstance(value, list) else [value]
        many = action.nargs in ("+", "*")
        if (not many and isinstance(value, list)) or any(isinstance(v, (list, dict)) for v in items) \
                or isinstance(value, dict):
            raise ConfigError(f"  - {where}: {flag} takes {'a list of values' if many else 'one value'}")
        if any(v is None or isinstance(v, bool) for v in items):
            raise ConfigError(f"  - {where}: give a value (or drop the key for the default)")
        key_tokens = [flag, *map(str, items)] if many else [f"{flag}={items[0]}"]
        try:
            build_parser().parse_args(key_tokens)  # the flag's own type and choices, blamed on the file
        except ConfigError as e:
            raise ConfigError(f"  - --config {path}: {key}: {str(e).strip().removeprefix('- ')}") from None
        tokens.extend(key_tokens)
    return tokens


def parse_args(argv=None, world_size=None):
    """Parse flags (+ YAML), fill derived values and validate; the result is frozen. Raises ConfigError."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    pre, _ = parser.parse_known_args(argv)
    # YAML first, the command line after it: a flag given twice takes its last value.
    tokens = _yaml_tokens(parser, pre.config, _read_yaml(pre.config)) if pre.config else []
    args = parser.parse_args(tokens + argv, namespace=RunArgs())
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    args.world_size = world_size
    _fill_derived(args)
    problems = validate_args(args)
    if problems:
        raise ConfigError("\n".join(f"  - {p}" for p in problems))
    return args.freeze()


def _fill_derived(args):
    # Defaults that depend on other flags (every value here is >= 1 already: `number`).
    if args.ffn_hidden_size is None:
        args.ffn_hidden_size = 4 * args.hidden_size
    if args.num_query_groups is None:
        args.num_query_groups = args.num_attention_heads
    if args.moe_ffn_hidden_size is None:
        args.moe_ffn_hidden_size = args.ffn_hidden_size
    if args.expert_tensor_parallel_size is None:
        args.expert_tensor_parallel_size = args.tensor_model_parallel_size
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    args.data_seed = args.seed if args.data_seed is None else args.data_seed
    model_parallel = args.tensor_model_parallel_size * args.pipeline_model_parallel_size * args.context_parallel_size
    args.data_parallel_size = args.world_size // model_parallel if model_parallel and args.world_size % model_parallel == 0 else None
    args.cp_comm_base, args.cp_comm_types = _resolve_cp_comm_types(args)
    args.ulysses_size = _resolve_ulysses_size(args)
    if args.tensor_model_parallel_size == 1:
        args.sequence_parallel = False  # as in Megatron-LM: SP needs TP to split over
    if args.global_batch_size is None and args.data_parallel_size:
        args.global_batch_size = args.micro_batch_size * args.data_parallel_size
    if args.recompute_activations and args.recompute_granularity is None:
        args.recompute_granularity = "selective"  # as in Megatron-LM
    args.attention_kernel = ATTENTION_BACKENDS.get(args.attention_backend)  # None: reported by validate_args
    if args.log_dir is None:  # read by rank 0 only (metrics.jsonl, config.yaml, wandb)
        args.log_dir = os.path.join("runs", args.wandb_exp_name or time.strftime("run-%Y%m%d-%H%M%S"))


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
    # KV heads need no rule: Ulysses replicates them as needed (cp_ext.attention.ulysses.kv_replicas).
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
        why_not = {
            "moe_act": "needs megatron's grouped-GEMM experts (moe_grouped_gemm, TransformerEngine); cp_ext's "
                       "local spec uses SequentialMLP experts. Use moe to recompute the whole MoE layer",
            "mla_up_proj": "applies to multi-latent attention, which this model does not use",
            "shared_experts": "applies to MoE shared experts, which this model does not have",
            "mlp": "recomputes dense MLP layers; this model is MoE (--num-experts), use moe" if moe else None,
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


# The router flags, refused on a dense model when set off their defaults (the parser's).
_ROUTER_DESTS = ("moe_z_loss_coeff", "moe_router_pre_softmax", "moe_router_score_function",
                 "moe_router_topk_scaling_factor", "moe_router_num_groups", "moe_router_group_topk",
                 "moe_router_enable_expert_bias", "moe_router_dtype", "moe_expert_capacity_factor")


def _router_flags_given(args):
    parser = build_parser()
    return ["--" + dest.replace("_", "-") for dest in _ROUTER_DESTS if getattr(args, dest) != parser.get_default(dest)]


def _router_problems(args):
    """megatron-core 0.16.1's router rules (TransformerConfig.__post_init__), said before anything is built."""
    p = []
    topk, experts = args.moe_router_topk, args.num_experts
    if topk == 1 and args.moe_router_score_function == "softmax" and not args.moe_router_pre_softmax:
        p.append("--moe-router-topk 1 with the softmax score function needs --moe-router-pre-softmax (a softmax over "
                 "the one chosen expert is 1 and gives the router no gradient); add it (Switch Transformer's routing)")
    if args.moe_router_topk_scaling_factor is not None and not (
            args.moe_router_pre_softmax or args.moe_router_score_function == "sigmoid"):
        p.append("--moe-router-topk-scaling-factor is only read with --moe-router-pre-softmax or "
                 "--moe-router-score-function sigmoid; add one of them or drop it")
    if args.moe_router_enable_expert_bias and args.moe_router_score_function != "sigmoid":
        p.append("--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid (megatron's aux-loss-free "
                 "balancing is defined on sigmoid scores); add it")
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
    if args.moe_token_drop_policy != "probs" and args.moe_expert_capacity_factor is None:
        p.append(f"--moe-token-drop-policy {args.moe_token_drop_policy} is only read with "
                 f"--moe-expert-capacity-factor; add it or drop the policy")
    return p


def _runs_on_cpu(args):
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


def _attention_problems(args):
    """The attention kernel against the dtype, head dim and device this run will use."""
    backend, kernel = args.attention_backend, args.attention_kernel
    if kernel is None:
        return [f"--attention-backend {backend!r} (from the command line, --config or $CP_EXT_ATTN_KERNEL) is not "
                f"one of {', '.join(ATTENTION_BACKENDS)}"]
    p = []
    if kernel not in ("auto", "unfused") and args.attention_dropout and args.context_parallel_size == 1:
        p.append(f"--attention-dropout {args.attention_dropout} is not supported by --attention-backend {backend} "
                 f"(cp_ext's kernels run without dropout); use --attention-backend auto or unfused, or set "
                 f"--attention-dropout 0")
    if kernel == "auto":  # auto always finds a kernel: unfused runs everything
        return p
    mla = args.multi_latent_attention
    if not mla and args.kv_channels is None and args.hidden_size % args.num_attention_heads:
        return p  # the head dim itself is reported by validate_args
    import torch

    from cp_ext.attention.kernels import dtype_name, kernel_problem

    dtype = torch.bfloat16 if args.bf16 else torch.float32
    v_head_dim = args.v_head_dim if mla else None  # MLA's own dims: q/k = qk_head_dim + the RoPE part, v
    head_dim = (args.qk_head_dim + args.qk_pos_emb_head_dim if mla else
                args.kv_channels or args.hidden_size // args.num_attention_heads)
    device = "cpu" if _runs_on_cpu(args) else "cuda"
    reason = kernel_problem(kernel, dtype, head_dim, device, v_head_dim=v_head_dim)
    if reason:
        named = backend if kernel == backend else f"{backend} (cp_ext's {kernel} kernel)"
        if mla:
            head = (f"--qk-head-dim {args.qk_head_dim} + --qk-pos-emb-head-dim {args.qk_pos_emb_head_dim} = "
                    f"{head_dim}, --v-head-dim {v_head_dim}")
        else:
            head = (f"--kv-channels {head_dim}" if args.kv_channels else
                    f"--hidden-size {args.hidden_size} / --num-attention-heads {args.num_attention_heads} = {head_dim}")
        p.append(f"--attention-backend {named} cannot run this model: {reason} (dtype {dtype_name(dtype)} "
                 f"{'from --bf16' if args.bf16 else 'without --bf16'}, head dim {head}, device {device} from "
                 f"--device {args.device}); use --attention-backend auto, which picks a kernel that fits, or change "
                 f"the model")
    return p


def split_weights(split):
    """--split "969,30,1" -> [969.0, 30.0, 1.0] (Megatron pads a short list with zeros); ValueError if malformed."""
    try:
        weights = [float(w) for w in split.replace("/", ",").split(",")]
    except ValueError:
        raise ValueError(f"--split {split}: expected up to three comma-separated weights, e.g. 969,30,1") from None
    if not 1 <= len(weights) <= 3 or not all(math.isfinite(w) and w >= 0 for w in weights) or weights[0] <= 0:
        raise ValueError(f"--split {split}: expected up to three weights >= 0 with train's > 0, e.g. 969,30,1")
    return weights + [0.0] * (3 - len(weights))


def evaluation_splits(args):
    """The splits evaluation uses ("valid", "test"): those with data of their own or a --split share."""
    if not (args.eval_interval or args.skip_train) or args.eval_iters == 0:
        return []
    if args.synthetic_task:
        return ["valid", "test"]
    weights = split_weights(args.split)
    return [name for i, name in ((1, "valid"), (2, "test"))
            if getattr(args, f"{name}_data_path") or weights[i] > 0]


def _eval_problems(args):
    p = []
    try:
        splits = evaluation_splits(args)
    except ValueError as e:
        return [str(e)]
    if (args.eval_interval or args.skip_train) and args.eval_iters > 0 and "valid" not in splits:
        p.append(f"--eval-interval needs validation data: --split {args.split} gives the valid split no documents; "
                 f"give it a share (e.g. --split 969,30,1) or --valid-data-path")
    return p


_DOCUMENT_FLAGS = ("--reset-position-ids", "--reset-attention-mask", "--eod-mask-loss")


def document_flags_given(args):
    """Megatron-LM's packed-document flags this run sets; each acts on the EOD tokens of the samples."""
    return [flag for flag in _DOCUMENT_FLAGS if getattr(args, flag[2:].replace("-", "_"), False)]


def _data_problems(args):
    """Data flags; the files they name are opened (cheaply) only when given."""
    if getattr(args, "split", None) is None:  # an args namespace built without the data group
        return []
    eval_problems = _eval_problems(args)
    if eval_problems:
        return eval_problems
    if args.synthetic_task and args.data_path:
        return [f"--synthetic-task {args.synthetic_task} and --data-path are exclusive; give one"]
    if args.synthetic_task:
        flags = document_flags_given(args)
        if flags:
            return [f"{' '.join(flags)}: packed documents need EOD tokens, but --synthetic-task "
                    f"{args.synthetic_task} samples are one sequence each and hold no EOD token; drop "
                    f"{'them' if len(flags) > 1 else 'it'}, or train on --data-path (or the embedded corpus)"]
        return []
    try:
        split_weights(args.split)  # read whenever data comes from --data-path or the embedded corpus
    except ValueError as e:
        return [str(e)]
    if args.tokenizer_type != "ByteTokenizer" and not args.data_path:
        return [f"--tokenizer-type {args.tokenizer_type} needs --data-path (the embedded default corpus is "
                f"byte-tokenized); preprocess your text with tools/preprocess_data.py"]
    if (args.data_path or args.valid_data_path or args.test_data_path or args.tokenizer_model
            or args.vocab_size is not None):
        from cp_ext.data.datasets import data_file_problems

        return data_file_problems(args)
    return []


def validate_args(args):
    """Every problem with the grid and shapes, as messages that name flags and fixes."""
    p = []
    tp, pp, cp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.context_parallel_size
    ep, etp = args.expert_model_parallel_size, args.expert_tensor_parallel_size
    world = args.world_size
    if world % (tp * pp * cp):
        p.append(f"world size {world} is not divisible by --tensor-model-parallel-size ({tp}) x "
                 f"--pipeline-model-parallel-size ({pp}) x --context-parallel-size ({cp}) = {tp * pp * cp}; "
                 f"launch a multiple of {tp * pp * cp} ranks or change the sizes")
    elif world % (etp * ep * pp):
        p.append(f"world size {world} is not divisible by --expert-tensor-parallel-size ({etp}) x "
                 f"--expert-model-parallel-size ({ep}) x --pipeline-model-parallel-size ({pp}); change the expert sizes")
    dp = args.data_parallel_size
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
    if args.num_attention_heads % args.num_query_groups:
        p.append(f"--num-attention-heads {args.num_attention_heads} is not divisible by --num-query-groups "
                 f"{args.num_query_groups}")
    if args.kv_channels is None and args.hidden_size % args.num_attention_heads:
        p.append(f"--hidden-size {args.hidden_size} is not divisible by --num-attention-heads "
                 f"{args.num_attention_heads}; set --kv-channels or change the sizes")
    if args.num_layers % pp:
        p.append(f"--num-layers {args.num_layers} is not divisible by --pipeline-model-parallel-size {pp}; "
                 f"choose a PP size that divides the layer count")
    if dp and args.global_batch_size % (args.micro_batch_size * dp):
        p.append(f"--global-batch-size {args.global_batch_size} is not divisible by --micro-batch-size "
                 f"{args.micro_batch_size} x data-parallel size {dp}; use a multiple of "
                 f"{args.micro_batch_size * dp}")
    if args.num_experts is not None:
        if args.num_experts % ep:
            p.append(f"--num-experts {args.num_experts} is not divisible by --expert-model-parallel-size {ep}")
        if args.moe_router_topk > args.num_experts:
            p.append(f"--moe-router-topk {args.moe_router_topk} exceeds --num-experts {args.num_experts}")
        p.extend(_router_problems(args))
        if args.moe_token_dispatcher_type == "alltoall" and _runs_on_cpu(args):
            p.append("--moe-token-dispatcher-type alltoall needs CUDA (megatron's dispatcher uses CUDA streams); "
                     "use --moe-token-dispatcher-type allgather on CPU")
        if tp > 1 and not args.sequence_parallel:
            p.append(f"MoE with --tensor-model-parallel-size {tp} requires --sequence-parallel "
                     f"(megatron-core's MoE layer needs it); add --sequence-parallel")
    elif ep > 1:
        p.append(f"--expert-model-parallel-size {ep} needs --num-experts")
    else:
        p.extend(f"{flag} needs --num-experts (it configures the MoE router); add --num-experts or drop it"
                 for flag in _router_flags_given(args))
    if args.overlap_param_gather and not args.use_distributed_optimizer:
        p.append("--overlap-param-gather needs --use-distributed-optimizer (it overlaps the distributed optimizer's "
                 "parameter all-gather with the next forward; as in Megatron-LM); add it or drop the flag")
    if args.overlap_param_gather and not args.overlap_grad_reduce:
        p.append("--overlap-param-gather needs --overlap-grad-reduce (as in Megatron-LM); add it")
    p.extend(_device_problems(args))
    p.extend(_attention_problems(args))
    p.extend(attention_flag_problems(args))
    p.extend(_cp_comm_type_problems(args))
    p.extend(_context_parallel_problems(args))
    p.extend(_recompute_problems(args))
    p.extend(_data_problems(args))
    if (args.load or args.save or args.finetune) and not p:
        from cp_ext.training.checkpoint_checks import checkpoint_problems

        p.extend(checkpoint_problems(args))
    if args.lr_warmup_iters > args.train_iters:
        p.append(f"--lr-warmup-iters {args.lr_warmup_iters} exceeds --train-iters {args.train_iters}")
    elif args.lr_warmup_iters >= args.lr_decay_iters:  # megatron's scheduler asserts warmup < decay
        p.append(f"--lr-warmup-iters {args.lr_warmup_iters} must be below --lr-decay-iters {args.lr_decay_iters} "
                 f"(which defaults to --train-iters); lower the warm-up or raise the decay iterations")
    if args.min_lr > args.lr:
        p.append(f"--min-lr {args.min_lr} exceeds --lr {args.lr}")
    if args.save_interval is not None and not args.save:
        p.append(f"--save-interval {args.save_interval} needs --save DIR (where to save); add it or drop the flag")
    return p


def single_process_without_torchrun():
    """``python pretrain_moe.py ...`` (or a tool) runs as one rank, as torchrun --nproc-per-node 1 would."""
    if "RANK" in os.environ or "WORLD_SIZE" in os.environ:
        return
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def exit_with_config_error(prog, error):
    """Print a ConfigError once (rank 0) and exit with status 2 on every rank."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"{prog}: configuration error:\n{error}", file=sys.stderr, flush=True)
    else:
        # torchrun ends every rank once one exits; give rank 0 time to print first.
        time.sleep(5)
    sys.exit(2)


def parse_args_or_exit(argv=None):
    """`parse_args`, but a ConfigError prints once (rank 0) and exits with status 2 on every rank."""
    try:
        return parse_args(argv)
    except ConfigError as e:
        exit_with_config_error("pretrain_moe.py", e)
