"""Megatron-LM's attention-variant flags: --window-size, --window-attn-skip-freq, --softmax-type.

Spelled and parsed as Megatron-LM's ``arguments.py`` does (``tuple_type`` for the window,
``moe_freq_type`` for the skip frequency), carried into `TransformerConfig` under megatron's
field names, and applied by `cp_ext.transformer.attention.CoreAttention` on every CP path:

* ``--window-size L,R``: query i sees key j iff ``i - L <= j <= i + R`` (-1: unbounded); the
  GPT model is causal, so R must be 0 (or -1).
* ``--window-attn-skip-freq N`` or ``"[1,1,0]*2"``: which layers keep full attention
  (megatron's ``is_layer_window_attention``: with N every N-th layer; a list names each layer,
  1 = windowed). Without it every layer is windowed.
* ``--softmax-type vanilla|off-by-one|learnable``: attention sinks (megatron's
  ``softmax_offset``, one logit per head). Every kernel takes them: cp_ext adds the sink in the
  finish step after the LSE merge, not inside the kernel.

And one of cp_ext's own (Megatron-LM has no such flag):

* ``--cp-mla-exchange auto|kv|latent``: what multi-latent attention's ring and all-gather move,
  per-head K/V or the latent they are computed from (`cp_ext.transformer.mla`); exact either way.
"""

import argparse

SOFTMAX_TYPES = ("vanilla", "off-by-one", "learnable")
MLA_EXCHANGES = ("auto", "kv", "latent")  # --cp-mla-exchange, read by cp_ext.transformer.mla


def window_type(text):
    """Megatron's ``tuple_type``: "128,0" or "(128,0)" -> (128, 0)."""
    try:
        values = tuple(int(x) for x in str(text).strip("()").split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected two integers L,R such as 128,0, got {text!r}") from None
    if len(values) != 2 or min(values) < -1:
        raise argparse.ArgumentTypeError(f"expected L,R with integers >= -1 (-1: unbounded), such as 128,0; "
                                         f"got {text!r}")
    return values


def layer_freq_type(text):
    """Megatron's ``moe_freq_type``: an int N, or a Python list expression such as "[1,1,0]*2"."""
    text = str(text).strip()
    if "[" not in text:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer or a list expression such as [1,1,0]*2, "
                                             f"got {text!r}") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
        return value
    if any(c not in "0123456789[],*+ ()" for c in text):
        raise argparse.ArgumentTypeError(f"expected a list expression of 0/1 such as [1,1,0]*2, got {text!r}")
    try:
        value = eval(text, {"__builtins__": {}}, {})  # digits, brackets, * and +: a list expression only
    except Exception:
        raise argparse.ArgumentTypeError(f"cannot evaluate {text!r} as a list expression such as [1,1,0]*2") from None
    if not isinstance(value, list) or any(x not in (0, 1) for x in value):
        raise argparse.ArgumentTypeError(f"expected a list of 0 and 1 (1: windowed layer), got {value!r}")
    return value


def add_attention_args(g):
    g.add_argument("--window-size", type=window_type, default=None,
                   help="sliding-window attention L,R (Megatron-LM's): query i sees keys i-L .. i+R, -1 unbounded; "
                        "the model is causal, so R is 0; exact on every CP type (the ring sends a block only as far "
                        "as the window reaches); kernels: cpu, efficient, unfused (auto picks one)")
    g.add_argument("--window-attn-skip-freq", type=layer_freq_type, default=None,
                   help="which layers keep full attention under --window-size: N (every N-th layer) or a list "
                        "expression of 0/1 per layer such as [1,1,1,0]*3 (1: windowed); default: every layer windowed")
    g.add_argument("--softmax-type", choices=SOFTMAX_TYPES, default="vanilla",
                   help="attention sinks (Megatron-LM's): off-by-one adds a fixed 0 logit per head, learnable a "
                        "learned one (megatron's softmax_offset); every kernel takes them (added after the LSE merge)")
    g.add_argument("--cp-mla-exchange", choices=MLA_EXCHANGES, default="auto",
                   help="multi-latent attention under CP: what the ring and all-gather send per token, 'kv' (every "
                        "head's K/V) or 'latent' (kv_lora_rank + qk_pos_emb_head_dim values, up-projected where "
                        "used; 71x fewer bytes at DeepSeek-V3 size); auto: the latent wherever it is exchanged "
                        "(ring or all_gather, TP 1), else kv")


def attention_flag_problems(args):
    """Configuration errors of the window flags, naming the flag and the fix."""
    p = []
    if args.window_size is not None and args.window_size[1] not in (0, -1):
        left, right = args.window_size
        p.append(f"--window-size {left},{right} looks {right} tokens ahead, but the GPT model is causal; "
                 f"use --window-size {left},0")
    freq = args.window_attn_skip_freq
    if freq is not None and args.window_size is None:
        p.append("--window-attn-skip-freq is only read with --window-size; add --window-size L,0 or drop it")
    if isinstance(freq, list) and len(freq) != args.num_layers:
        p.append(f"--window-attn-skip-freq lists {len(freq)} layers but --num-layers is {args.num_layers}; "
                 f"give one 0/1 per layer")
    if getattr(args, "attention_dropout", 0) and (args.window_size is not None or args.softmax_type != "vanilla"):
        what = " and ".join(f for f, on in (("--window-size", args.window_size is not None),
                                            ("--softmax-type " + args.softmax_type, args.softmax_type != "vanilla")) if on)
        p.append(f"--attention-dropout {args.attention_dropout} is not supported with {what} (cp_ext's kernels run "
                 f"without dropout); set --attention-dropout 0")
    p.extend(_mla_exchange_problems(args))
    kernel = getattr(args, "attention_kernel", None)
    if args.window_size is None or kernel in (None, "auto"):
        return p
    from cp_ext.attention.kernels import KERNELS  # torch: only when a kernel is named

    if args.window_size is not None and tuple(args.window_size) != (-1, 0) and kernel in KERNELS \
            and not KERNELS[kernel].limits.masks:
        able = ", ".join(sorted(n for n, k in KERNELS.items() if k.limits.masks))
        p.append(f"--window-size needs a kernel that applies a window, and --attention-backend "
                 f"{args.attention_backend} ({kernel}) cannot; use --attention-backend auto (picks one) or one of "
                 f"{able}")
    return p


def _mla_exchange_problems(args):
    """--cp-mla-exchange latent where the latent cannot travel."""
    if getattr(args, "cp_mla_exchange", "auto") != "latent":
        return []
    if not getattr(args, "multi_latent_attention", False):
        return ["--cp-mla-exchange latent applies to multi-latent attention (--multi-latent-attention), which this "
                "model does not use; drop --cp-mla-exchange"]
    p = []
    if getattr(args, "ulysses_size", 1) > 1 and set(getattr(args, "cp_comm_types", None) or ["a2a"]) != {"all_gather"}:
        p.append(f"--cp-mla-exchange latent runs on the ring and all_gather, but this run's CP groups use Ulysses "
                 f"(U = {args.ulysses_size}), which exchanges heads and the latent has none; use --cp-comm-type p2p "
                 f"or all_gather, or --cp-mla-exchange kv")
    if getattr(args, "tensor_model_parallel_size", 1) > 1:
        p.append("--cp-mla-exchange latent runs at --tensor-model-parallel-size 1 only (the latent's TP gradient "
                 "reduction is not built); use --cp-mla-exchange kv or auto")
    return p
