"""DeepSeek-V4's attention layer in megatron's self-attention seat: sliding window, CSA or HCA, under TP and CP.

One layer of transformers' ``DeepseekV4Attention`` with megatron's parallel linear layers::

    q_res = q_down_norm(linear_q_down_proj(x))                     q-LoRA, replicated   (HF q_a_proj, q_a_norm)
    q     = unweighted per-head RMSNorm(linear_q_up_proj(q_res))   TP splits the heads  (q_b_proj, q_b_norm)
    kv    = RMSNorm(linear_kv_proj(x))                             one K=V head          (kv_proj, kv_norm)
    o     = compressed_attention(q, kv, sinks, window, entries)    `cp_ext.attention.compressed`
    out   = linear_proj(linear_o_group_proj(o))                    grouped, then mixed  (o_a_proj, o_b_proj)

RoPE is V4's: interleaved on the last ``qk_pos_emb_head_dim`` channels, at each token's offset in its document,
with ``rotary_base`` on sliding layers and ``csa_compress_rotary_base`` (YaRN-scaled under ``rope_type`` yarn,
V4's attention factor 1) on CSA and HCA layers; the output is rotated back. A CSA or HCA layer has a
compressor (``compressor.linear_kv``, ``linear_gate``, ``position_bias``, ``kv_layernorm``) and CSA a lightning
indexer (``indexer.linear_q_up_proj`` from q_res, ``indexer.linear_weights``, its own compressor).

Tensor parallelism: the query heads, their sinks and the output groups split over TP; everything with one head
(q-LoRA, the K=V head, the compressors, the indexer) is computed whole on every TP rank from the whole
sequence (gathered first under sequence parallelism), and the gradient that reaches it from each rank's
heads is all-reduced before it does (megatron's ``copy_to_tensor_model_parallel_region``), so those weights'
gradients are whole on every rank and the input's gradient is split back without a sum. The indexer
selects and is not differentiable: its inputs are detached.

Context parallelism: the layer hands this CP rank's tokens, their global positions (cp_ext's layout) and the
packed documents to `compressed_attention` over megatron's whole CP group (the window's halo and the entries
cross ranks; the query heads never do, under Ulysses as well); under dynamic CP, over the microbatch's group with
its per-document zigzag.

Generation (``kv_cache`` set by `cp_ext.inference.Generator`): the prefill is this forward, each rank keeping its
share (`cp_ext.inference.compressed_cache`); a decode step rotates the token's q and K=V row at its position and
attends them to the CP-sharded cache.
"""

from typing import Optional

import torch

from megatron.core import parallel_state, tensor_parallel
from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (_yarn_find_correction_range,
                                                                                _yarn_linear_ramp_mask)
from megatron.core.tensor_parallel.mappings import (copy_to_tensor_model_parallel_region,
                                                    gather_from_sequence_parallel_region)
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.utils import (ensure_metadata_has_dp_cp_group, make_sharded_tensors_for_checkpoint,
                                             sharded_state_dict_default)

from cp_ext import parallel_state as cp_state
from cp_ext.attention.compressed import (CompressedAttentionSpec, Compressor, Indexer, compressed_attention,
                                        interleaved_rope, rms_norm)
from cp_ext.transformer.attention import _document_ids
from cp_ext.transformer.dynamic_cp import dynamic_params


def v4_inv_freq(dim: int, base: float, yarn: Optional[dict] = None) -> torch.Tensor:
    """RoPE's inverse frequencies over ``dim`` channels (``dim / 2`` pairs); ``yarn``: (factor,
    original_max_position_embeddings, beta_fast, beta_slow), blended as transformers' and megatron's YaRN."""
    exponents = torch.arange(0, dim, 2, dtype=torch.float64, device="cpu") / dim  # (also under a meta-device build)
    extrapolation = 1.0 / base ** exponents
    if not yarn or yarn["factor"] == 1:
        return extrapolation.float()
    low, high = _yarn_find_correction_range(yarn["beta_fast"], yarn["beta_slow"], dim, base,
                                            yarn["original_max_position_embeddings"])
    keep = 1 - _yarn_linear_ramp_mask(low, high, dim // 2, torch.device("cpu")).double()
    return (extrapolation / yarn["factor"] * (1 - keep) + extrapolation * keep).float()


class RMSNorm(torch.nn.Module):
    """transformers' ``DeepseekV4RMSNorm``: fp32 (fp64 for fp64 inputs), the result in the input's dtype."""

    def __init__(self, size: int, eps: float, dtype=None, device=None):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(size, dtype=dtype, device=device))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def _linear(config, inputs, outputs, device):
    return torch.nn.Linear(inputs, outputs, bias=False, device=device, dtype=config.params_dtype)


class EntryCompressor(MegatronModule):
    """A compressor's parameters: [C | Z] projections of ``width`` (CSA: twice, the overlap), the position bias
    and the entries' norm (`cp_ext.attention.compressed.compressor`)."""

    def __init__(self, config, rate: int, width: int, overlap: bool, device):
        super().__init__(config=config)
        projected = 2 * width if overlap else width
        self.rate, self.width, self.overlap = rate, width, overlap
        self.linear_kv = _linear(config, config.hidden_size, projected, device)
        self.linear_gate = _linear(config, config.hidden_size, projected, device)
        self.position_bias = torch.nn.Parameter(torch.zeros(rate, projected, dtype=torch.float32, device=device))
        self.kv_layernorm = RMSNorm(width, config.layernorm_epsilon, dtype=torch.float32, device=device)

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.linear_kv(x), self.linear_gate(x)], dim=-1)

    def bundle(self, rows, inv_freq, differentiable: bool) -> Compressor:
        bias, norm = self.position_bias, self.kv_layernorm.weight
        if differentiable and parallel_state.get_tensor_model_parallel_world_size() > 1:
            rows, bias, norm = (copy_to_tensor_model_parallel_region(t) for t in (rows, bias, norm))
        return Compressor(rows, self.rate, self.width, self.overlap, bias, norm, self.kv_layernorm.eps, inv_freq)


class LightningIndexer(MegatronModule):
    """CSA's indexer: queries from q-LoRA's ``q_res``, per-head weights from the input, its own compressor."""

    def __init__(self, config, rate: int, device):
        super().__init__(config=config)
        heads, dim = config.dsa_indexer_n_heads, config.dsa_indexer_head_dim
        self.heads, self.dim = heads, dim
        self.linear_q_up_proj = _linear(config, config.q_lora_rank, heads * dim, device)
        self.linear_weights = _linear(config, config.hidden_size, heads, device)
        self.compressor = EntryCompressor(config, rate, dim, True, device)

    def inputs(self, x, q_res, inv_freq) -> Indexer:
        """Detached: the selection is not differentiable, and no gradient of the main loss reaches the indexer."""
        with torch.no_grad():
            q = self.linear_q_up_proj(q_res).unflatten(-1, (self.heads, self.dim))
            # transformers' weights_scaling (heads ** -0.5) and softmax_scale (dim ** -0.5), folded into the weights
            weights = self.linear_weights(x).float() * (self.heads * self.dim) ** -0.5
            return Indexer(q, weights, self.compressor.bundle(self.compressor.rows(x), inv_freq, False))


class GroupedProjection(MegatronModule):
    """transformers' ``DeepseekV4GroupedLinear``: group g of heads [.., H D / G] -> [.., R] with its own matrix;
    weight [G R, H D / G], its groups split over TP (this rank's heads' groups)."""

    def __init__(self, config, groups: int, rank: int, device):
        super().__init__(config=config)
        tp = parallel_state.get_tensor_model_parallel_world_size()
        self.groups_local, self.rank = groups // tp, rank
        per_group = config.num_attention_heads * config.v_head_dim // groups
        self.weight = torch.nn.Parameter(torch.empty(self.groups_local * rank, per_group, device=device,
                                                     dtype=config.params_dtype))
        torch.nn.init.normal_(self.weight, std=config.init_method_std)
        self.weight.tensor_model_parallel, self.weight.partition_dim, self.weight.partition_stride = True, 0, 1

    def forward(self, x):  # [s, b, H_local D] -> [s, b, G_local R]
        s, b, _ = x.shape
        grouped = x.reshape(s * b, self.groups_local, -1).transpose(0, 1)
        w = self.weight.view(self.groups_local, self.rank, -1).transpose(1, 2)
        return torch.bmm(grouped, w).transpose(0, 1).reshape(s, b, -1)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        return make_sharded_tensors_for_checkpoint(self.state_dict(prefix="", keep_vars=True), prefix, {"weight": 0},
                                                   sharded_offsets, tp_group=parallel_state.get_tensor_model_parallel_group(),
                                                   dp_cp_group=metadata["dp_cp_group"])


class CompressedAttention(MegatronModule):
    """DeepSeek-V4's attention layer of ``kind`` "sliding", "csa" or "hca" (see the module docstring)."""

    def __init__(self, config, submodules=None, layer_number: int = 1, kind: Optional[str] = None, **spec_kwargs):
        super().__init__(config=config)
        self.layer_number = layer_number
        self.kind = kind or config.dsv4_layer_kinds[layer_number - 1]
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        tp = parallel_state.get_tensor_model_parallel_world_size()
        heads, dim, rope = config.num_attention_heads, config.v_head_dim, config.qk_pos_emb_head_dim
        self.heads_local, self.head_dim = heads // tp, dim
        self.linear_q_down_proj = _linear(config, config.hidden_size, config.q_lora_rank, device)
        # not "q_layernorm": megatron's finalize_model_grads sums that name's gradient over TP, and this one is whole
        self.q_down_norm = RMSNorm(config.q_lora_rank, config.layernorm_epsilon, dtype=torch.float32, device=device)
        # whole q_res on every rank, its gradient all-reduced by the layer's own copy region (no sequence split)
        self.linear_q_up_proj = tensor_parallel.ColumnParallelLinear(
            config.q_lora_rank, heads * dim, config=config, init_method=config.init_method, gather_output=False,
            bias=False, skip_bias_add=True, is_expert=False)
        self.linear_q_up_proj.sequence_parallel = False
        self.linear_kv_proj = _linear(config, config.hidden_size, dim, device)
        self.kv_layernorm = RMSNorm(dim, config.layernorm_epsilon, dtype=torch.float32, device=device)
        self.sinks = None
        if config.csa_attention_sink:
            self.sinks = torch.nn.Parameter(torch.zeros(self.heads_local, dtype=torch.float32, device=device))
            self.sinks.tensor_model_parallel, self.sinks.partition_dim, self.sinks.partition_stride = True, 0, 1
        self.linear_o_group_proj = GroupedProjection(config, config.o_groups, config.o_lora_rank, device)
        self.linear_proj = tensor_parallel.RowParallelLinear(
            config.o_groups * config.o_lora_rank, config.hidden_size, config=config,
            init_method=config.output_layer_init_method, bias=False, input_is_parallel=True, skip_bias_add=True,
            is_expert=False)
        rate = {"csa": config.csa_compress_ratio_for_c, "hca": config.csa_compress_ratio_for_h}.get(self.kind)
        self.compressor = None if rate is None else EntryCompressor(config, rate, dim, self.kind == "csa", device)
        self.indexer = (LightningIndexer(config, rate, device) if self.kind == "csa" and not config.csa_dense_mode
                        else None)
        yarn = None
        if getattr(config, "rope_type", "rope") == "yarn":
            yarn = dict(factor=config.rotary_scaling_factor, beta_fast=config.beta_fast, beta_slow=config.beta_slow,
                        original_max_position_embeddings=config.original_max_position_embeddings)
        main = v4_inv_freq(rope, config.rotary_base)
        compress = v4_inv_freq(rope, config.csa_compress_rotary_base, yarn)
        self.register_buffer("inv_freq", main if self.kind == "sliding" else compress, persistent=False)
        self.register_buffer("compress_inv_freq", compress, persistent=False)
        self.spec = CompressedAttentionSpec(self.kind, config.csa_window_size,
                                            dim ** -0.5, index_topk=config.dsa_indexer_topk or 0,
                                            dense=self.indexer is None)
        self.kv_cache = None  # a generation's CP-sharded cache (`cp_ext.inference.kv_cache`), set while it runs

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """The sinks split over TP (dim 0); the children map themselves (replicated where they are whole)."""
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        tp_group = parallel_state.get_tensor_model_parallel_group()
        own = {}
        self._save_to_state_dict(own, "", keep_vars=True)
        out = make_sharded_tensors_for_checkpoint(own, prefix, {"sinks": 0}, sharded_offsets, tp_group=tp_group,
                                                  dp_cp_group=metadata["dp_cp_group"])
        for name, module in self.named_children():
            out.update(sharded_state_dict_default(module, f"{prefix}{name}.", sharded_offsets, metadata,
                                                  tp_group=tp_group))
        return out

    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor] = None, *,
                inference_context=None, packed_seq_params=None, **kwargs):
        """[s, b, hidden] (this CP rank's tokens; its TP share under sequence parallelism) -> (output, None)."""
        if inference_context is not None or kwargs.get("inference_params") is not None:
            raise NotImplementedError("DeepSeek-V4's layers generate with cp_ext.inference.Generator, not with "
                                      "megatron's inference contexts")
        dynamic = dynamic_params(packed_seq_params)  # dynamic CP: this microbatch's group and per-document layout
        tp = parallel_state.get_tensor_model_parallel_world_size()
        x = hidden_states
        if self.config.sequence_parallel and tp > 1:  # every rank's gradient is whole: split back, not summed
            x = gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=False)
        s, b, _ = x.shape
        q_res = self.q_down_norm(self.linear_q_down_proj(x))
        q, _ = self.linear_q_up_proj(q_res)
        q = q.unflatten(-1, (self.heads_local, self.head_dim))
        q = rms_norm(q, None, self.config.layernorm_epsilon)  # per head, unweighted
        kv = self.kv_layernorm(self.linear_kv_proj(x))
        sinks = self.sinks
        if tp > 1:
            kv = copy_to_tensor_model_parallel_region(kv)
        compressor = None if self.compressor is None else self.compressor.bundle(
            self.compressor.rows(x), self.compress_inv_freq, True)
        indexer = None if self.indexer is None else self.indexer.inputs(x, q_res, self.compress_inv_freq)
        if self.kv_cache is not None and self.kv_cache.decoding:
            o = self._decode(q, kv, sinks, compressor, indexer)
            out, _ = self.linear_proj(self.linear_o_group_proj(o.flatten(2)))
            return out, None
        if dynamic is not None:  # the group's documents, each zigzagged over it (their ids in attention_mask)
            group = dynamic.cp_group if dynamic.size > 1 else None
            positions = dynamic.positions(device=x.device) if group is not None else torch.arange(s, device=x.device)
        else:
            cp = parallel_state.get_context_parallel_world_size()
            group = parallel_state.get_context_parallel_group() if cp > 1 else None
            positions = cp_state.get_context_parallel_positions(s * cp, getattr(self.config, "cp_layout", "zigzag"),
                                                                device=x.device)
        keep = None if self.kv_cache is None else []  # a generation's prefill: each rank keeps its share
        o = compressed_attention(q, kv, sinks, self.spec, positions=positions,
                                 document_ids=_document_ids(attention_mask, b, s, x.device), group=group,
                                 compressor=compressor, indexer=indexer, rope_inv_freq=self.inv_freq, keep=keep)
        if keep is not None:
            rate = None if self.compressor is None else self.compressor.rate
            self.kv_cache.store_compressed(self.layer_number - 1, keep[0], self.spec, rate, group)
        out, _ = self.linear_proj(self.linear_o_group_proj(o.flatten(2)))
        return out, None

    def _decode(self, q, kv, sinks, compressor, indexer) -> torch.Tensor:
        """One token against the CP-sharded cache at ``kv_cache.position`` (its copies under sequence parallelism
        identical: the first is computed, the result copied): [copies, 1, H_local, D]."""
        position = torch.tensor([self.kv_cache.position], device=q.device)
        q_t = interleaved_rope(q[:1, 0], position, self.inv_freq)[0]  # [H_local, D]
        kv_t = interleaved_rope(kv[:1, 0], position, self.inv_freq)[0]  # [D]
        compressors = [] if compressor is None else [compressor] + ([indexer.compressor] if indexer else [])
        index_q = index_w = None
        if indexer is not None:
            index_q = interleaved_rope(indexer.q[:1, 0], position, indexer.compressor.inv_freq)[0]
            index_w = indexer.weights[0, 0]
        cp = parallel_state.get_context_parallel_world_size()
        group = parallel_state.get_context_parallel_group() if cp > 1 else None
        o = self.kv_cache.attend_compressed(self.layer_number - 1, q_t, kv_t, compressors, sinks, self.spec, group,
                                            index_q, index_w)
        o = interleaved_rope(o[None], position, self.inv_freq, inverse=True)  # [1, H_local, D]
        return o.unsqueeze(1).expand(q.shape[0], -1, -1, -1)
