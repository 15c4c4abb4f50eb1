"""Attention flags: the local kernel (--attention-backend), qk-norm, Megatron-LM's attention variants
(--window-size, --window-attn-skip-freq, --softmax-type) and multi-latent attention.

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

Multi-latent attention (DeepSeek-V2/V3), Megatron-LM's ``_add_mla_args`` with its defaults:
``--multi-latent-attention``, ``--q-lora-rank`` (None: q projected directly), ``--kv-lora-rank`` 32,
``--qk-head-dim`` 128, ``--qk-pos-emb-head-dim`` 64, ``--v-head-dim`` 128, and the YaRN RoPE of MLA:
``--rope-type rope|yarn`` (MLA's default yarn), ``--rotary-scaling-factor`` 1.0, ``--mscale`` 1.0,
``--mscale-all-dim`` 0.0; megatron's ``MLATransformerConfig`` fields of the same names, built by
`cp_ext.models.gpt_moe` with `cp_ext.transformer.mla.ContextParallelMLASelfAttention` in the seat.

DeepSeek-V3.2's sparse attention (`cp_ext.arguments.dsa`) and the linear-attention hybrids
(`cp_ext.arguments.linear_attention`, with ``--attention-output-gate``) share
``--experimental-attention-variant``.

And one of cp_ext's own (Megatron-LM has no such flag):

* ``--cp-mla-exchange auto|kv|latent``: what multi-latent attention's ring and all-gather move,
  per-head K/V or the latent they are computed from (`cp_ext.transformer.mla`); exact either way.
"""

import argparse
import os

from cp_ext.arguments.deepseek_v4 import add_deepseek_v4_args, deepseek_v4_problems
from cp_ext.arguments.dsa import add_dsa_args, dsa_problems
from cp_ext.arguments.linear_attention import add_linear_attention_args, linear_attention_problems
from cp_ext.arguments.parallel import runs_on_cpu
from cp_ext.flag_types import layer_freq_type

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


MLA_FLAGS = {"q_lora_rank": "--q-lora-rank", "kv_lora_rank": "--kv-lora-rank", "qk_head_dim": "--qk-head-dim",
             "qk_pos_emb_head_dim": "--qk-pos-emb-head-dim", "v_head_dim": "--v-head-dim",
             "rotary_scaling_factor": "--rotary-scaling-factor", "mscale": "--mscale",
             "mscale_all_dim": "--mscale-all-dim"}
MLA_DEFAULTS = {"q_lora_rank": None, "kv_lora_rank": 32, "qk_head_dim": 128, "qk_pos_emb_head_dim": 64,
                "v_head_dim": 128, "rotary_scaling_factor": 1.0, "mscale": 1.0, "mscale_all_dim": 0.0}


def add_mla_args(g):
    g.add_argument("--multi-latent-attention", action="store_true",
                   help="DeepSeek-V2/V3's multi-latent attention (megatron's MLASelfAttention), exact on every CP type")
    sizes = {"q_lora_rank": "rank of q's low-rank projection (None: q projected directly)",
             "kv_lora_rank": "rank of the K/V latent", "qk_head_dim": "q/k head dim without the RoPE part",
             "qk_pos_emb_head_dim": "the RoPE part of q/k (one key shared by the heads)",
             "v_head_dim": "v head dim"}
    for dest, text in sizes.items():
        g.add_argument(MLA_FLAGS[dest], type=int, default=MLA_DEFAULTS[dest],
                       help=f"with --multi-latent-attention: {text} (default {MLA_DEFAULTS[dest]}, Megatron-LM's)")
    g.add_argument("--rope-type", choices=["rope", "yarn"], default=None,
                   help="MLA's RoPE: rope, or yarn (MLA's default, as Megatron-LM); common attention takes rope only")
    for dest, text in (("rotary_scaling_factor", "YaRN's scaling factor"), ("mscale", "YaRN's mscale"),
                       ("mscale_all_dim", "YaRN's mscale_all_dim")):
        g.add_argument(MLA_FLAGS[dest], type=float, default=MLA_DEFAULTS[dest],
                       help=f"with --multi-latent-attention: {text} (default {MLA_DEFAULTS[dest]})")


def mla_flag_problems(args):
    """The MLA flags: only with --multi-latent-attention, sizes that build, and Megatron-LM's exclusions."""
    if not getattr(args, "multi_latent_attention", False):
        yarn = ("rotary_scaling_factor", "mscale", "mscale_all_dim") if args.position_embedding_type == "yarn" else ()
        given = [flag for dest, flag in MLA_FLAGS.items()  # YaRN's three are common attention's YaRN's too
                 if getattr(args, dest) != MLA_DEFAULTS[dest] and dest not in yarn]
        p = [f"{flag} applies to multi-latent attention; add --multi-latent-attention or drop it" for flag in given]
        if getattr(args, "rope_type", None) == "yarn":
            p.append("--rope-type yarn applies to multi-latent attention (common attention takes rope only, as in "
                     "Megatron-LM); add --multi-latent-attention or drop it")
        return p
    p = [f"{MLA_FLAGS[d]} {getattr(args, d)} must be positive" for d in
         ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "q_lora_rank")
         if getattr(args, d) is not None and getattr(args, d) <= 0]
    if args.qk_pos_emb_head_dim % 2:
        p.append(f"--qk-pos-emb-head-dim {args.qk_pos_emb_head_dim} must be even (RoPE rotates pairs of dims)")
    if getattr(args, "group_query_attention", False) and args.num_query_groups != args.num_attention_heads:
        p.append(f"--num-query-groups {args.num_query_groups} does not apply to multi-latent attention (every head "
                 f"has its own K/V from the latent); drop --group-query-attention and --num-query-groups")
    if getattr(args, "qk_layernorm", False) and args.tensor_model_parallel_size > 1 and not args.sequence_parallel:
        p.append("--qk-layernorm with --multi-latent-attention at --tensor-model-parallel-size > 1 needs "
                 "--sequence-parallel: without it the q-LoRA norm's gradient is the same on every TP rank and "
                 "megatron-core's finalize_model_grads sums it over TP anyway; add --sequence-parallel")
    v4 = args.experimental_attention_variant == "dsv4_hybrid"  # V4's layers rotate at each document's offsets
    if getattr(args, "reset_position_ids", False) and not v4:
        p.append("--reset-position-ids is not supported with --multi-latent-attention yet (MLA's layers build their "
                 "own RoPE, which takes no per-batch positions); drop it")
    return p


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
    p.extend(mla_flag_problems(args))
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
    if getattr(args, "context_parallel_size", 1) == 1:
        p.append("--cp-mla-exchange latent is what context parallelism sends, and --context-parallel-size 1 sends "
                 "nothing; add --context-parallel-size N or drop --cp-mla-exchange")
    if getattr(args, "ulysses_size", 1) > 1 and set(getattr(args, "cp_comm_types", None) or ["a2a"]) != {"all_gather"}:
        p.append(f"--cp-mla-exchange latent runs on the ring and all_gather, but this run's CP groups use Ulysses "
                 f"(U = {args.ulysses_size}), which exchanges heads and the latent has none; use --cp-comm-type p2p "
                 f"or all_gather, or --cp-mla-exchange kv")
    if getattr(args, "tensor_model_parallel_size", 1) > 1:
        p.append("--cp-mla-exchange latent runs at --tensor-model-parallel-size 1 only (the latent's TP gradient "
                 "reduction is not built); use --cp-mla-exchange kv or auto")
    return p


def add_attention_group(parser):
    g = parser.add_argument_group("attention")
    g.add_argument("--qk-layernorm", action="store_true",
                   help="normalize each head's q and k (Qwen3, OLMoE; --normalization's kind), and with "
                        "--multi-latent-attention MLA's q-LoRA and K/V latents (DeepSeek-V2/V3), as Megatron-LM")
    add_attention_args(g)
    add_mla_args(g)
    add_dsa_args(g)
    add_deepseek_v4_args(g)
    add_linear_attention_args(g)
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
    g.add_argument("--use-flash-attn", action="store_true",
                   help="Megatron-LM's legacy spelling of --attention-backend flash where CUDA runs it; on CPU the "
                        "startup line names the kernel that runs instead")
    g.add_argument("--attention-softmax-in-fp32", action="store_true",
                   help="accepted: cp_ext's kernels and LSE merges always compute the softmax in fp32")


# --attention-backend: Megatron-LM's choices (megatron.core.transformer.enums.AttnBackend) and
# cp_ext's kernel names, each mapped onto a kernel of cp_ext.attention.kernels ("auto": per call).
ATTENTION_BACKENDS = {
    "auto": "auto", "flash": "flash", "fused": "cudnn", "unfused": "unfused", "local": "unfused",
    "efficient": "efficient", "cudnn": "cudnn", "flash_attn": "flash_attn", "te": "te", "cpu": "cpu",
}


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
    if kernel == "auto" or args.experimental_attention_variant == "dsv4_hybrid":  # auto always finds a kernel
        return p  # (unfused runs everything); V4's layers run their own torch attention
    mla = args.multi_latent_attention
    if not mla and args.kv_channels is None and args.hidden_size % args.num_attention_heads:
        return p  # the head dim itself is reported by validate_args
    import torch

    from cp_ext.attention.kernels import dtype_name, kernel_problem

    dtype = torch.bfloat16 if args.bf16 else torch.float32
    v_head_dim = args.v_head_dim if mla else None  # MLA's own dims: q/k = qk_head_dim + the RoPE part, v
    head_dim = (args.qk_head_dim + args.qk_pos_emb_head_dim if mla else
                args.kv_channels or args.hidden_size // args.num_attention_heads)
    device = "cpu" if runs_on_cpu(args) else "cuda"
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


def fill_attention_defaults(args):
    args.attention_kernel = ATTENTION_BACKENDS.get(args.attention_backend)  # None: reported by attention_problems


def attention_problems(args):
    return (_attention_problems(args) + attention_flag_problems(args) + dsa_problems(args)
            + linear_attention_problems(args) + deepseek_v4_problems(args))
