"""fla's Triton kernels (flash-linear-attention, CUDA only) for the gated delta rule and a segment's summary.

Owns whether fla can run a call (`fla_problem`), the choice the rule's ``kernel`` keyword makes (`use_fla`:
"auto" is fla on CUDA tensors when fla imports, else the torch rule; "torch"; "fla", which raises when fla
cannot run the call), and the two calls (`fla_rule`, `fla_summary`). The rule's meaning is
`cp_ext.linear_attention.gated_delta`'s; fla computes the same thing, with its own rounding:

* ops: ``fla.ops.gated_delta_rule.chunk_gated_delta_rule`` for a per-head g [b, s, h] (Gated DeltaNet) and
  ``fla.ops.kda.chunk_kda`` for a per-channel g [b, s, h, K] (KDA: it came with Kimi-Linear's release, late
  2025; read here from fla-core 0.6.0, which has both). Each is imported on the first CUDA call and looked
  for by name, not by version: an fla without chunk_kda still runs Gated DeltaNet.
* layout: fla takes q, k, v, g, beta as [b, s, h, ...], the layout the rule is called with, and keeps its
  state as [N, h, K, V] (``state_v_first`` off, its default): the same S as here, no transposition. Its
  recurrence is this one (S <- exp(g_t) S, the delta rule, o_t = S_t^T q_t after token t's write).
* g: natural-log decays in both; fla switches to log2 inside. It is handed fp32 (fla's own layers do; a
  bf16 g would lose bits in fla's running sums that the torch rule keeps).
* beta: handed in v's dtype, as fla's own layers and tests pass it.
* scale: always passed (fla's default is also K**-0.5, but it must not depend on that).
* qk_l2norm: fla's ``use_qk_l2norm_in_kernel`` computes x / sqrt(sum x^2 + 1e-6), `gated_delta.l2norm`'s
  formula and eps; fla normalizes in fp32 and stores the result in the input dtype.
* grouped value heads: q and k are repeated per value head here (``repeat_interleave``, as the torch rule
  does). fla 0.6 reads grouped heads by itself (head i // (h_v / h_k), the same map), older releases do not.
* chunk size: fla's 64. The torch rule's ``chunk_size`` only blocks the same sums and is not passed on.
* precision: fla's products run in the input dtype (fp32 ones in TF32 where Triton's default allows it),
  the state in fp32; outputs come back in the input dtype, final states in fp32.

Packed documents. fla's ``cu_seqlens`` runs each listed sequence from its own ``initial_state[n]``, which is
not the rule's document start: there the state before the token is dropped (A_t = 0), whatever the run
started from. So the batch is flattened into one row and cut at every row start and every document start;
a sequence that opens a row gets that row's initial state (zero if its first token itself starts a
document, ``previous_document_id``), every sequence that opens at a document start gets zeros. Handing
each sequence the row's initial state instead would be wrong, most visibly for the summary: [0 | I] after a
document start would carry the identity past the reset and give a nonzero M where the segment's map is 0.
Finding the cuts reads the ids on the host (one synchronization), as fla's own varlen path does.

The summary in one call (`fla_summary`). The rule is linear in (S, v) column by column, every column
seeing the same A_t. With v widened by K zero columns and the initial state [0 | I] (K x (V + K)):

    final state = [E | M]  (E = the zero-state run's final state, M = A_s ... A_1: S_out = M S_in + E)
    outputs     = [o0 | Qtilde]  (row t of Qtilde is q_t^T M_t, so o = o0 + Qtilde S_in)

In fla's [K, V] layout, state column V + j is M's column j, so M comes out as [K, K] with no transpose.
"""

import functools
import importlib
from typing import Optional, Tuple

import torch

KERNEL_CHOICES = ("auto", "torch", "fla")
FLA_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_KEY_DIM = 256  # fla's chunked kernels keep a K x BV state tile in registers: K <= 256 (chunk_kda asserts it)
_OPS = {False: ("fla.ops.gated_delta_rule", "chunk_gated_delta_rule"), True: ("fla.ops.kda", "chunk_kda")}


@functools.lru_cache(maxsize=None)
def _import(per_channel: bool):
    """(fla's op for the decay, None) or (None, why it cannot be imported)."""
    module, name = _OPS[per_channel]
    try:
        op = getattr(importlib.import_module(module), name)
    except Exception as e:  # not installed, no Triton, or an import that probes a GPU this machine lacks
        return None, (f"fla's {name} does not import ({type(e).__name__}: {e}); "
                      f"pip install flash-linear-attention (a release from late 2025 on has KDA's chunk_kda)")
    return op, None


def _op(per_channel: bool):
    op, why = _import(per_channel)
    if op is None:
        raise ImportError(why)
    return op


def fla_problem(device_type: str, dtypes, key_dim: int, per_channel: bool) -> Optional[str]:
    """None if fla can run a call on ``device_type`` tensors of ``dtypes`` (q, k, v) with key dim ``key_dim``
    and a per-channel (KDA) or per-head g; else why not. Imports fla (once) only for a CUDA call."""
    kinds = "/".join(str(d).replace("torch.", "") for d in FLA_DTYPES)
    if device_type != "cuda":
        return f"fla's kernels run on CUDA tensors only, not {device_type}"
    if len(set(dtypes)) != 1 or dtypes[0] not in FLA_DTYPES:
        return f"fla's kernels take q, k, v of one dtype among {kinds}, not {', '.join(map(str, dtypes))}"
    if key_dim > MAX_KEY_DIM:
        return f"fla's kernels take a key head dim of at most {MAX_KEY_DIM}, not {key_dim}"
    return _import(per_channel)[1]


def use_fla(kernel: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor) -> bool:
    """The rule's ``kernel`` keyword: True to run fla, False for the torch rule. "fla" that cannot run raises."""
    if kernel not in KERNEL_CHOICES:
        raise ValueError(f"the gated delta rule's kernel is one of {KERNEL_CHOICES}, not {kernel!r}")
    if kernel == "torch":
        return False
    problem = fla_problem(q.device.type, (q.dtype, k.dtype, v.dtype), k.shape[-1], g.dim() == 4)
    if problem is not None and kernel == "fla":
        raise ValueError(f"kernel='fla' cannot run this call: {problem}; kernel='auto' falls back to the torch rule")
    return problem is None


def _state_dtype(dtype: torch.dtype) -> torch.dtype:
    """fla's state dtype, fp32 (float64 only for the CPU tests' stand-in op, which fla_problem never lets fla see)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _run(per_channel: bool, q, k, v, g, beta, state, resets, scale: float,
         qk_l2norm: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """fla over the [b, s] rows: (o [b, s, h_v, W] in v's dtype, final state [b, h_v, K, W]) from the rows'
    initial states ``state`` [b, h_v, K, W] (None: zeros) with the document starts ``resets`` [b, s] (None:
    none), W = v's last dim."""
    op = _op(per_channel)
    b, s, hk, _ = k.shape
    hv = v.shape[2]
    if hv != hk:
        q, k = q.repeat_interleave(hv // hk, dim=2), k.repeat_interleave(hv // hk, dim=2)
    g = g.to(_state_dtype(g.dtype))
    beta = beta.to(v.dtype)
    kw = dict(scale=scale, output_final_state=True, use_qk_l2norm_in_kernel=qk_l2norm)
    if resets is None:  # every row one sequence from its own initial state: fla's batch as it is
        return op(q, k, v, g, beta, initial_state=state, **kw)

    # Packed documents: one flat row cut at every row start and every document start (module docstring).
    opens = resets.clone()
    opens[:, 0] = True
    flat = opens.reshape(-1)
    starts = flat.nonzero().squeeze(1)  # the host synchronization: fla needs the cuts before it launches
    cu_seqlens = torch.cat([starts, starts.new_tensor([b * s])])
    sequence = (flat.long().cumsum(0) - 1).view(b, s)  # each token's sequence in the flat row
    first, last = sequence[:, 0], sequence[:, -1]
    if state is not None:  # a row's first sequence continues its state unless its first token starts a document
        kept = state * (~resets[:, 0]).to(state.dtype)[:, None, None, None]
        state = state.new_zeros((starts.numel(),) + state.shape[1:]).index_copy(0, first, kept)
    flat_in = [x.reshape((1, b * s) + x.shape[2:]) for x in (q, k, v, g, beta)]
    o, final = op(*flat_in, initial_state=state, cu_seqlens=cu_seqlens, **kw)
    return o.reshape((b, s) + o.shape[2:]), final.index_select(0, last)


def fla_rule(q, k, v, g, beta, *, initial_state=None, resets=None, scale: float,
             qk_l2norm: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """`gated_delta.gated_delta_rule` by fla: (o [b, s, h_v, V] in v's dtype, final state [b, h_v, K, V] fp32).
    ``initial_state`` [b, h_v, K, V] (checked by the caller); ``resets`` [b, s]: `gated_delta.document_resets`."""
    state = None if initial_state is None else initial_state.to(_state_dtype(v.dtype))
    o, final = _run(g.dim() == 4, q, k, v, g, beta, state, resets, scale, qk_l2norm)
    return o.to(v.dtype), final.to(_state_dtype(v.dtype))


def fla_summary(q, k, v, g, beta, *, resets=None, scale: float,
                qk_l2norm: bool = False) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`gated_delta.segment_summary`'s (o0, Qtilde, M, E) by one fla call on v widened by K zero columns from
    the state [0 | I] (module docstring), all in fp32: o0 [b, s, h_v, V], Qtilde [b, s, h_v, K], M [b, h_v, K, K],
    E [b, h_v, K, V]. o0 and Qtilde carry the rounding of fla's outputs in the input dtype."""
    b, s, hv, vd = v.shape
    kd = k.shape[-1]
    acc = _state_dtype(v.dtype)
    widened = torch.cat([v, v.new_zeros(b, s, hv, kd)], dim=-1)
    eye = torch.eye(kd, dtype=acc, device=v.device).expand(b, hv, kd, kd)
    state = torch.cat([torch.zeros(b, hv, kd, vd, dtype=acc, device=v.device), eye], dim=-1)
    o, final = _run(g.dim() == 4, q, k, widened, g, beta, state, resets, scale, qk_l2norm)
    o, final = o.to(acc), final.to(acc)
    return o[..., :vd], o[..., vd:], final[..., vd:], final[..., :vd]
