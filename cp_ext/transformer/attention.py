"""The core-attention seat of megatron's `SelfAttention`: softmax(QK^T)V on local tensors.

It keeps the interface of megatron-core's `DotProductAttention` (same constructor,
``forward(query, key, value, attention_mask, attn_mask_type, attention_bias,
packed_seq_params)`` on ``[s, b, heads, head_dim]``, output ``[s, b, heads * head_dim]``)
so it slots into a layer spec unchanged. GQA is handled by the kernel
(``enable_gqa``), never by materializing repeated KV heads.

With context parallelism (``config.context_parallel_size`` > 1) this module is where
attention stops being local: q, k, v hold this rank's tokens (see
`cp_ext.parallel_state.get_context_parallel_positions`), and the ring / Ulysses / hybrid
algorithm of `cp_ext.attention` picked by the CP sub-group sizes exchanges them, so the
result equals attention over the whole sequence.

Packed documents (``--reset-attention-mask``): where megatron passes a boolean
``[b, 1, s, s]`` mask, cp_ext passes the *document ids* ``[b, s_local]`` (an integer tensor,
O(s) instead of O(s^2); `cp_ext.attention.masks.documents`): a token attends only within its
document, on every CP path and at CP = 1. A ``None`` mask is the plain causal (or full) mask.

``--cp-comm-type`` may name one type per layer (Megatron's list form); a layer whose type is
``all_gather`` all-gathers K/V over the CP group (`cp_ext.attention.cp.all_gather`) on the same
sequence layout as the others.

Under ``--recompute-granularity full`` with CP-aware recompute (the default there), the
attention of a checkpointed layer is computed once: `cp_ext.transformer.recompute` keeps its
output and LSE for the recompute instead of re-running the ring.

The local kernel is ``config.attention_kernel`` (``--attention-backend``, see
`cp_ext.attention.kernels`): every CP path passes it down as ``kernel=``. At CP = 1, ``auto``
and ``unfused`` keep torch's ``F.scaled_dot_product_attention`` (which supports dropout;
``unfused`` restricted to its math backend), and any other kernel runs through that kernel.
"""

import contextlib
from typing import Optional

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from megatron.core import parallel_state, tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import is_layer_window_attention, make_sharded_tensors_for_checkpoint

from cp_ext.transformer.dynamic_cp import dynamic_params
from cp_ext.transformer.recompute import KeptAttention


class CoreAttention(MegatronModule):
    """Causal (or full) scaled-dot-product attention with megatron's DotProductAttention API."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection=None,
        k_channels: Optional[int] = None,
        v_channels: Optional[int] = None,
    ):
        super().__init__(config=config)
        self.layer_number = max(1, layer_number)
        # k_channels / v_channels: what MLASelfAttention passes (its q/k and v head dims, 192 / 128 at
        # DeepSeek-V3 size); the attention reads both off the tensors it is given, except under MLA's
        # latent exchange, where value is None and key the latent (cp_ext.transformer.mla), and
        # latent_source (set by the MLA module, a weak reference) gives linear_kv_up_proj.
        self.v_channels, self.latent_source = v_channels, None
        # --window-size on the layers megatron's is_layer_window_attention selects (1-based global layer
        # numbers, --window-attn-skip-freq: every N-th layer, or a 0/1 list, keeps full attention).
        self.window_size = None
        if is_layer_window_attention(getattr(config, "window_size", None), getattr(config, "window_attn_skip_freq", None),
                                     layer_number):
            self.window_size = tuple(config.window_size)
        # --softmax-type: megatron's softmax_offset, one sink logit per attention head of this TP rank.
        heads = config.num_attention_heads // config.tensor_model_parallel_size
        softmax_type = getattr(config, "softmax_type", "vanilla")
        if softmax_type == "vanilla":
            self.softmax_offset = None
        elif softmax_type == "off-by-one":  # a fixed 0 logit: softmax's denominator gains 1 (a buffer: it
            # follows the module's device, and is no checkpoint state, as megatron's plain tensor is not)
            self.register_buffer("softmax_offset", torch.zeros(heads, dtype=config.params_dtype), persistent=False)
        elif softmax_type == "learnable":
            self.softmax_offset = torch.nn.Parameter(torch.empty(heads, dtype=config.params_dtype))
            if config.perform_initialization:
                config.init_method(self.softmax_offset)
        else:
            raise ValueError(f"softmax_type {softmax_type!r} is not one of 'vanilla', 'off-by-one', 'learnable'")
        self.attn_mask_type = attn_mask_type
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        self.softmax_scale = softmax_scale
        self.cp_layout = getattr(config, "cp_layout", "zigzag")
        # This layer's --cp-comm-type when the flag lists one per layer (None: the run's groups decide).
        comm_types = getattr(config, "cp_comm_types", None)
        # An MTP layer (number > --num-layers) is built from the last layer's spec and takes its type too.
        self.cp_comm_type = comm_types[min(self.layer_number, len(comm_types)) - 1] if comm_types else None
        # cp_ext kernel name, or "auto" (picked per call by dtype and head dim).
        self.kernel = getattr(config, "attention_kernel", "auto")
        # Under full recompute: the (out, LSE) kept for this layer's recompute (cp_ext.transformer.recompute).
        self.kept = KeptAttention()
        # Generation (cp_ext.inference.generate): the sharded KV cache this layer fills at prefill
        # and attends to at decode; None while training.
        self.kv_cache = None

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata: Optional[dict] = None):
        """megatron's map for the learnable sink: ``softmax_offset`` sharded over heads (TP axis 0),
        as `DotProductAttention` gives it (checkpoints, layout-invariant init and gradient checks)."""
        state_dict = self.state_dict(prefix="", keep_vars=True) if isinstance(self.softmax_offset, torch.nn.Parameter) else {}
        return make_sharded_tensors_for_checkpoint(
            state_dict, prefix, {"softmax_offset": 0}, sharded_offsets,
            tp_group=parallel_state.get_tensor_model_parallel_group(),
            dp_cp_group=(metadata or {}).get("dp_cp_group") or parallel_state.get_data_parallel_group(with_context_parallel=True))

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[torch.Tensor] = None,
        packed_seq_params: Optional[PackedSeqParams] = None,
    ) -> torch.Tensor:
        if attention_bias is not None:
            raise NotImplementedError("cp_ext attention does not support attention_bias")
        dynamic = dynamic_params(packed_seq_params)  # dynamic CP: this microbatch's group and layout
        mask_type = attn_mask_type or self.attn_mask_type
        if mask_type not in (AttnMaskType.causal, AttnMaskType.no_mask):
            raise NotImplementedError(f"cp_ext attention supports causal and no_mask, not {mask_type}")
        causal = mask_type == AttnMaskType.causal
        seq, batch, heads, head_dim = query.shape
        up_weight = None if value is not None else self.latent_source().linear_kv_up_proj.weight
        out_dim = heads * (self.v_channels if value is None else value.shape[-1])  # v's head dim (MLA: v_head_dim)
        window, offset = self.window_size, self.softmax_offset
        scale = head_dim ** -0.5 if self.softmax_scale is None else float(self.softmax_scale)
        document_ids = _document_ids(attention_mask, batch, seq, query.device)
        if self.kv_cache is not None:
            if document_ids is not None:
                raise NotImplementedError("generation attends over one document; call the model without document ids")
            layer = self.layer_number - 1
            if self.kv_cache.decoding:  # one new token against the CP-sharded cache
                return self.kv_cache.attend(layer, query, key, value, scale, window_size=window,
                                            softmax_offset=offset, up_weight=up_weight).reshape(seq, batch, out_dim)
            self.kv_cache.store_prefill(layer, key, value, num_heads=heads)  # then attend as in training
        if dynamic is not None and dynamic.size > 1:
            return self._dynamic(dynamic, query, key, value, causal, scale, document_ids, window, offset,
                                 up_weight).reshape(seq, batch, out_dim)
        if getattr(self.config, "cp_aware_recompute", False) and self.training and dynamic is None:
            from cp_ext import parallel_state as cp_state

            out = self.kept.forward(
                query, key, value, causal=causal, layout=self.cp_layout,
                softmax_scale=scale, ulysses_group=cp_state.get_ulysses_group(), ring_group=cp_state.get_ring_group(),
                kernel=self.kernel, document_ids=document_ids, comm_type=self.cp_comm_type,
                window_size=window, softmax_offset=offset, up_weight=up_weight,
            )
            if out is not None:
                return out.reshape(seq, batch, out_dim)
        if parallel_state.get_context_parallel_world_size() > 1 and dynamic is None:
            from cp_ext.attention.cp.context_parallel import context_parallel_attention

            if self.dropout_p and self.training:
                raise NotImplementedError("attention dropout is not supported with context parallelism")
            out = context_parallel_attention(
                query, key, value, causal=causal, softmax_scale=scale, layout=self.cp_layout,
                kernel=self.kernel, document_ids=document_ids, comm_type=self.cp_comm_type,
                window_size=window, softmax_offset=offset, up_weight=up_weight,
            )
            return out.reshape(seq, batch, out_dim)
        dropout_p = self.dropout_p if self.training else 0.0
        # An explicitly chosen kernel, packed documents (one kernel call per document), a window, a sink
        # or MLA's head dims: cp_ext's own local path (the same kernels and masks as CP > 1), no dropout.
        if (self.kernel not in ("auto", "unfused") or document_ids is not None or window is not None
                or offset is not None or value is None or value.shape[-1] != head_dim):
            from cp_ext.attention.cp.context_parallel import local_attention

            if dropout_p:
                raise NotImplementedError(f"attention dropout is not supported by the {self.kernel} kernel"
                                          + (" with document masks, windows or sinks"
                                             if self.kernel in ("auto", "unfused") else ""))
            out = local_attention(query, key, value, causal=causal, softmax_scale=scale,
                                  kernel=None if self.kernel == "auto" else self.kernel, document_ids=document_ids,
                                  window_size=window, softmax_offset=offset, up_weight=up_weight)
            return out.reshape(seq, batch, out_dim)
        # "unfused" is torch's plain math; "auto" lets torch pick its fused kernel.
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, h, s, d]: what torch's SDPA takes
        math_only = sdpa_kernel(SDPBackend.MATH) if self.kernel == "unfused" else contextlib.nullcontext()
        # Dropout inside attention acts on head-sharded data: use the TP-rank stream.
        with tensor_parallel.get_cuda_rng_tracker().fork(), math_only:
            out = F.scaled_dot_product_attention(
                q, k, v, dropout_p=dropout_p, is_causal=causal, scale=self.softmax_scale,
                enable_gqa=k.shape[1] != q.shape[1],
            )
        return out.permute(2, 0, 1, 3).reshape(seq, batch, out_dim)

    def _dynamic(self, dynamic, query, key, value, causal, scale, document_ids, window, offset, up_weight):
        """Dynamic CP: the ring (or, for an ``all_gather`` layer, the all-gather) over this microbatch's group,
        on its per-document zigzag (`cp_ext.transformer.dynamic_cp`)."""
        from cp_ext.attention.cp.context_parallel import NO_GROUP, all_gather_attention, hybrid_attention

        if self.dropout_p and self.training:
            raise NotImplementedError("attention dropout is not supported with context parallelism")
        kw = dict(causal=causal, softmax_scale=scale, kernel=self.kernel, document_ids=document_ids,
                  window_size=window, softmax_offset=offset, up_weight=up_weight)
        if self.cp_comm_type == "all_gather":
            return all_gather_attention(query, key, value, group=dynamic.cp_group, positions=dynamic.positions(), **kw)
        if getattr(self.config, "cp_aware_recompute", False) and self.training:
            out = self.kept.forward(query, key, value, layout=dynamic.layout, ulysses_group=NO_GROUP,
                                    ring_group=dynamic.cp_group, comm_type=None, **kw)
            if out is not None:
                return out
        return hybrid_attention(query, key, value, ulysses_group=NO_GROUP, ring_group=dynamic.cp_group,
                                layout=dynamic.layout, **kw)


def _document_ids(attention_mask, batch, seq, device):
    """The document ids [b, s_local] that cp_ext passes in megatron's attention_mask seat, or None."""
    if attention_mask is None:
        return None
    from cp_ext.attention.masks.documents import check_document_ids

    if attention_mask.dtype == torch.bool or attention_mask.dtype.is_floating_point:
        raise NotImplementedError(
            f"cp_ext attention takes document ids (an integer [b, s_local] tensor, from --reset-attention-mask) "
            f"where megatron passes a mask, not a {attention_mask.dtype} mask of shape {tuple(attention_mask.shape)}")
    check_document_ids(attention_mask, batch, seq, device, name="attention_mask (document ids)")
    return attention_mask
