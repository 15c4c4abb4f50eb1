"""megatron's Multi-Latent Attention with its RoPE at cp_ext's CP positions, and the latent exchange.

``MLASelfAttention`` (DeepSeek-V2/V3) builds its own rotary module for the shared RoPE key
(``qk_pos_emb_head_dim``, rope or YaRN with mscale) and lets it slice the table with megatron's
fixed zigzag-over-CP layout. cp_ext's layout depends on the Ulysses x ring split (and on
``--cp-load-balance``), so this subclass wraps that module (`cp_ext.transformer.rope.
RotaryAtContextParallelPositions`): every rank rotates its tokens at their true global
positions. The core attention seat is cp_ext's `CoreAttention`, which takes MLA's q/k and v head
dims (192 / 128 at DeepSeek-V3 size) on every CP type.

``--cp-mla-exchange`` (``config.cp_mla_exchange``): with ``kv`` megatron up-projects every token's
latent to per-head K/V on its own rank, and the ring or all-gather moves those; with ``latent``
this module hands the core attention q and the latent ``[c | k_pe]`` (kv_layernorm'd c, roped
k_pe) instead, and the ring or all-gather moves the latent and up-projects each block where it is
used (`cp_ext.attention.cp.kv_message.LatentKV`): ``kv_lora_rank + qk_pos_emb_head_dim`` values per
token instead of ``heads x (qk_head_dim + qk_pos_emb_head_dim + v_head_dim)``. ``auto`` takes the
latent wherever it is exchanged and smaller: CP > 1 on the ring or all-gather (Ulysses exchanges
heads, which the latent has not), tensor parallelism 1.

NoPE (``--no-rope-freq``, megatron-core's ``config.no_rope_freq``, which megatron's softmax attention reads and its
MLA does not): on a layer it marks, this module leaves q_pe and the shared key part k_pe unrotated, so they are
plain, position-free dims of the query and the key (Kimi-Linear's MLA layers, transformers'
``KimiLinearAttention``); everything else, the latent exchange included, is unchanged.
"""

import weakref

import torch
from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
from megatron.core.tensor_parallel.layers import ColumnParallelLinear
from megatron.core.tensor_parallel.random import CheckpointWithoutOutput
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region, gather_from_sequence_parallel_region, gather_from_tensor_model_parallel_region,
    scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.multi_latent_attention import MLASelfAttention

from cp_ext import parallel_state as cp_state
from cp_ext.arguments.attention import MLA_EXCHANGES
from cp_ext.megatron_compat import MLA_ROPE_KWARGS
from cp_ext.transformer.rope import RotaryAtContextParallelPositions
from cp_ext.transformer.attention import CoreAttention
from cp_ext.transformer.dsa import DSACoreAttention
from cp_ext.transformer.dynamic_cp import DynamicCPParams


def _decoding_position(core_attention):
    """In generation's decode steps, the position of the token being decoded (RoPE's row); else None."""
    cache = core_attention.kv_cache
    return cache.position if cache is not None and cache.decoding else None


def latent_possible(cp: int, all_gather: bool, ulysses: int, tp: int) -> bool:
    """Whether a layer can exchange the latent: CP > 1 on the ring or all-gather, TP 1."""
    return cp > 1 and (all_gather or ulysses == 1) and tp == 1


def takes_latent(exchange: str, possible: bool, config, heads: int) -> bool:
    """``--cp-mla-exchange`` resolved: latent when asked, or (auto) where possible and smaller (values
    per token: kv_lora_rank + p against the heads' K/V)."""
    smaller = (config.kv_lora_rank + config.qk_pos_emb_head_dim
               < heads * (config.qk_head_dim + config.qk_pos_emb_head_dim + config.v_head_dim))
    return possible and (exchange == "latent" or (exchange == "auto" and smaller))


class ContextParallelMLASelfAttention(MLASelfAttention):
    def __init__(self, config, submodules, layer_number, attn_mask_type=AttnMaskType.padding, **kwargs):
        # kwargs: whatever this release's TransformerLayer passes (cp_comm_type, pg_collection; from 0.18
        # also pp_layer_offset and name), handed on unchanged
        super().__init__(config, submodules, layer_number, attn_mask_type=attn_mask_type, **kwargs)
        self.rotary_pos_emb = RotaryAtContextParallelPositions(self.rotary_pos_emb,
                                                               layout=getattr(config, "cp_layout", "zigzag"))
        self.exchange = getattr(config, "cp_mla_exchange", "auto")
        if self.exchange not in MLA_EXCHANGES:
            raise ValueError(f"cp_mla_exchange {self.exchange!r} is not one of {MLA_EXCHANGES}")
        self.core_attention.latent_source = weakref.ref(self)  # where the core finds W_up (not a submodule)
        core = self.core_attention
        self.rotary_pos_emb.decode_position = lambda: _decoding_position(core)
        pattern = config.no_rope_freq or []  # megatron's list by now (its config expands an int N)
        self.no_rope = bool(pattern[layer_number - 1]) if layer_number - 1 < len(pattern) else False

    def _resolve_qk_norm_config(self, submodules):
        """megatron-core 0.19's choice of the q/kv norms and projections (it has no such step before 0.19).

        With ``--qk-layernorm`` and no q-LoRA (DeepSeek-V2-Lite) 0.19 wants ``linear_q_proj`` fused with a
        norm of the layer's input, which only TransformerEngine provides; 0.16.1 and Hugging Face's
        DeepSeek-V2 have no query norm there (the norm belongs to q-LoRA's compressed query). cp_ext keeps
        that model on every release: a plain ``linear_q_proj`` (`cp_ext.megatron_compat`, row 6)."""
        layers = super()._resolve_qk_norm_config(submodules)
        if self.config.q_lora_rank is None:
            layers["linear_q_proj"] = submodules.linear_q_proj
        return layers

    def latent_exchange(self) -> bool:
        """Whether this forward exchanges the latent (`--cp-mla-exchange`, resolved on the run's groups);
        DSA always attends over the latent (MLA's MQA mode, `cp_ext.transformer.dsa`)."""
        if isinstance(self.core_attention, DSACoreAttention):
            return True
        if self.exchange == "kv":
            return False
        cp = self.pg_collection.cp.size()
        possible = (latent_possible(cp, self.core_attention.cp_comm_type == "all_gather",
                                    cp_state.get_ulysses_world_size(), self.pg_collection.tp.size())
                    and isinstance(self.linear_kv_up_proj, ColumnParallelLinear)
                    and isinstance(self.core_attention, CoreAttention))
        if self.exchange == "latent" and not possible and cp > 1:
            raise ValueError("--cp-mla-exchange latent runs on the ring (--cp-comm-type p2p) and all_gather at "
                             "tensor-parallel size 1 with megatron's local linear_kv_up_proj and cp_ext's CoreAttention; "
                             "use --cp-mla-exchange kv")
        return takes_latent(self.exchange, possible, self.config, self.num_attention_heads_per_partition)

    def get_query_key_value_tensors(self, hidden_states, key_value_states=None, position_ids=None,
                                    packed_seq_params=None, inference_context=None, *, inference_params=None):
        """megatron's, except under the latent exchange (key: the latent, value None), at TP > 1, where
        megatron-core 0.16.1 loses gradient, and on a NoPE layer (megatron's MLA always rotates): `_projections`."""
        dynamic = packed_seq_params if isinstance(packed_seq_params, DynamicCPParams) else None
        own = (packed_seq_params is None or dynamic is not None) and inference_context is None and inference_params is None
        latent = own and self.latent_exchange()
        if self.no_rope and not own:
            raise NotImplementedError("--no-rope-freq on a multi-latent attention layer runs without megatron's "
                                      "packed sequences (THD) and inference context")
        if not latent and not self.no_rope and not (own and (self.pg_collection.tp.size() > 1 or dynamic is not None)):
            return super().get_query_key_value_tensors(hidden_states, key_value_states, position_ids,
                                                       packed_seq_params, inference_context)
        out = self._projections(hidden_states, latent, dynamic)
        if isinstance(self.core_attention, DSACoreAttention):  # the indexer reads the layer input and q's latent
            self.core_attention.take_inputs(hidden_states, out[3])
        return out

    def _projections(self, hidden_states, latent, dynamic=None):
        """megatron's MLA projections and RoPE (``get_query_key_value_tensors``, no packing, no inference
        context), with one fix: at TP > 1 the shared RoPE key ``k_pe`` is gathered from the TP ranks'
        column slices and every rank's heads use it, but megatron sends back only the local heads' share
        of its gradient (the gather's backward keeps this rank's columns of its own partial gradient), so
        ``linear_kv_down_proj``'s k_pe rows lose the other ranks' heads (tests/training/
        test_grid_equivalence.py, TP2: 3e-4 of the gradient's scale off, the size of that gradient).
        Here ``k_pe`` passes megatron's ``copy_to_tensor_model_parallel_region``, which all-reduces its
        gradient over TP. Returns (query, key, value, q_compressed, kv_compressed); with ``latent`` key is
        ``[c | k_pe]`` [s, b, r + p] and value None. The latent exchange runs at TP = 1; DSA also at TP > 1,
        where every rank's heads read the whole latent, so its gradient is summed over TP as k_pe's is.
        ``dynamic`` (dynamic CP's `DynamicCPParams`): RoPE at each token's position in its document. A NoPE layer
        (``self.no_rope``) rotates nothing."""
        cfg, tp = self.config, self.pg_collection.tp.size()
        r, p = cfg.kv_lora_rank, cfg.qk_pos_emb_head_dim
        if self.no_rope:
            rows = None
        elif dynamic is not None:  # [s_local, b, 1, dim] rows, as the model's own RoPE under --reset-position-ids
            rows = self.rotary_pos_emb.at_positions(dynamic.position_ids.t(), dynamic.max_seqlen_q)
        else:
            rows = self.rotary_pos_emb(self.rotary_pos_emb.get_rotary_seq_len(None, None, hidden_states, cfg, None))
        emb, mscale = (rows, 1.0) if cfg.rope_type == "rope" or rows is None else rows
        q_compressed = hidden_states  # without q-LoRA the query projects the layer input (megatron's naming)
        if cfg.q_lora_rank is not None:
            q_compressed = self.linear_q_down_proj(hidden_states)[0]
            if q_compressed.size(-1) != cfg.q_lora_rank:  # a column-parallel down projection: gather it
                q_compressed = gather_from_tensor_model_parallel_region(q_compressed)
                if cfg.sequence_parallel:
                    q_compressed = scatter_to_sequence_parallel_region(q_compressed)
            q_compressed = self.q_layernorm(q_compressed)
        kv_combined = self.linear_kv_down_proj(hidden_states)[0]
        column_parallel = kv_combined.size(-1) != r + p
        if column_parallel:
            c, k_pe = gather_from_tensor_model_parallel_region(kv_combined).split([r, p], dim=-1)
            if latent and tp > 1:  # DSA: every rank's heads read the whole latent; sum their gradients, as k_pe's
                c = copy_to_tensor_model_parallel_region(c)
            elif cfg.sequence_parallel:
                c = scatter_to_sequence_parallel_region(c)
            k_pe = copy_to_tensor_model_parallel_region(k_pe)  # the fix: every rank's heads' gradient
        else:
            c, k_pe = kv_combined.split([r, p], dim=-1)
            if tp > 1 and cfg.sequence_parallel:
                k_pe = gather_from_sequence_parallel_region(k_pe, group=self.tp_group)
        c = self.kv_layernorm(c)
        if latent and tp > 1 and not column_parallel:  # a duplicated down projection: the latent of this SP shard
            c = (gather_from_sequence_parallel_region(c, group=self.tp_group) if cfg.sequence_parallel
                 else copy_to_tensor_model_parallel_region(c))

        def up_projections_and_rope(q_input, c, k_pe, emb):
            return self._up_projections_and_rope(q_input, c, k_pe, emb, mscale, latent)

        if self.recompute_up_proj:
            # --recompute-modules mla_up_proj: megatron's output-discarding checkpoint. The up projections'
            # outputs (query; per-head K/V or the latent key) are freed once the core attention has saved
            # them, and recomputed from the kept inputs when the attention output's gradient arrives (megatron's
            # forward calls discard_output_and_register_recompute). Nothing CP exchanges is inside: the ring or
            # all-gather moves the same bytes as without it (at TP > 1 with SP the column-parallel up projections
            # gather their input again, as megatron's do). fp8=None: megatron's "no quantization" (False means on).
            self.qkv_up_checkpoint = CheckpointWithoutOutput(fp8=None)
            out = self.qkv_up_checkpoint.checkpoint(up_projections_and_rope, q_compressed, c, k_pe, emb)
        else:
            out = up_projections_and_rope(q_compressed, c, k_pe, emb)
        if latent:
            return out[0], out[1], None, q_compressed, c
        return (*out, q_compressed, c)

    def _up_projections_and_rope(self, q_input, c, k_pe, emb, mscale, latent):
        """The local part of MLA's projections: the query's up projection (or the whole query projection
        without q-LoRA), RoPE on q_pe and k_pe (none on a NoPE layer: ``emb`` None) and, without the latent
        exchange, the K/V up projection. Returns (query, latent key) under the latent exchange, else
        (query, key, value)."""
        cfg, p = self.config, self.config.qk_pos_emb_head_dim
        q = (self.linear_q_up_proj if cfg.q_lora_rank is not None else self.linear_q_proj)(q_input)[0]
        q = q.view(*q.shape[:2], self.num_attention_heads_per_partition, self.q_head_dim)
        q_nope, q_pe = q.split([cfg.qk_head_dim, p], dim=-1)
        k_pe = k_pe.unsqueeze(-2)  # [s, b, 1, p]
        if emb is not None:
            emb = emb[: q.shape[0]]
            # megatron's MLA rotates interleaved pairs (MLA_ROPE_KWARGS says so where the release needs telling)
            rope = dict(config=cfg, mscale=mscale, cp_group=self.pg_collection.cp, **MLA_ROPE_KWARGS)
            q_pe = apply_rotary_pos_emb(q_pe, emb, **rope)
            k_pe = apply_rotary_pos_emb(k_pe, emb, **rope)
        query = torch.cat([q_nope, q_pe], dim=-1)
        if latent:
            return query, torch.cat([c, k_pe.squeeze(-2)], dim=-1)
        kv = self.linear_kv_up_proj(c)[0]
        kv = kv.view(*kv.shape[:2], self.num_attention_heads_per_partition, cfg.qk_head_dim + cfg.v_head_dim)
        k_nope, value = kv.split([cfg.qk_head_dim, cfg.v_head_dim], dim=-1)
        key = torch.cat([k_nope, k_pe.expand(-1, -1, self.num_attention_heads_per_partition, -1)], dim=-1)
        return query.contiguous(), key.contiguous(), value.contiguous()
