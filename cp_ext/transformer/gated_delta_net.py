"""Gated DeltaNet (Qwen3-Next's linear-attention mixer) as a megatron-core module, in megatron-core 0.19's
parameter layout, exact under context parallelism by state passing (`cp_ext.linear_attention`).

The parameters carry megatron-core 0.19's names and shapes (``megatron/core/ssm/gated_delta_net``), so a state
dict moves between this module and megatron's ``GatedDeltaNet`` by name, per TP rank:

=================  ===================================================================================
``in_proj.weight``  [(2 H_k K + 2 H_v V + 2 H_v) / TP, hidden]: megatron's `ColumnParallelLinear`. Each TP
                    rank's rows are its own [q | k | v | z | b | a] (its H_k / TP key heads' q and k, its
                    H_v / TP value heads' v, z, beta logit b and decay input a), heads in order: at TP = 1
                    the whole [q | k | v | z | b | a]; at TP = t, rank r holds rows r/t of each section,
                    concatenated (megatron's ``in_proj_split_sections``, which its distributed checkpoint
                    saves as separate query/key/value/z/beta/alpha tensors).
``conv1d.weight``   [(2 H_k K + H_v V) / TP, 1, w]: the depthwise causal conv over this rank's [q | k | v]
                    channels (kernel ``linear_conv_kernel_dim``, no bias, as megatron's default).
``dt_bias``         [H_v / TP]; ``A_log`` [H_v / TP]: g = -exp(A_log) * softplus(a + dt_bias).
``out_norm.weight`` [V]: the gated RMSNorm over each value head, replicated over TP. Its gain is the weight
                    itself (transformers' ``Qwen3NextRMSNormGated``, megatron's norm without zero-centered
                    gamma); with ``config.layernorm_zero_centered_gamma`` it is 1 + weight, as megatron's
                    TENorm built from that config reads it.
``out_proj.weight`` [hidden, H_v V / TP]: megatron's `RowParallelLinear` (input parallel).
=================  ===================================================================================

There is no input layer norm here: megatron's TE spec fuses the layer's pre-norm into ``in_proj``
(``in_proj.layer_norm_weight``); with the local linear layers it is the layer's ``input_layernorm``.

Forward, on megatron's [s, b, hidden] (this rank's CP shard in cp_ext's layout; the sequence-parallel shard
under ``config.sequence_parallel``, which megatron's linear layers gather and reduce-scatter): in_proj ->
the causal conv of [q | k | v] with SiLU (its halo from the CP ranks before, `context_parallel_causal_conv1d`)
-> q, k L2-normalized in the rule -> g and beta = sigmoid(b) -> the gated delta rule
(`context_parallel_gated_delta` over this layer's CP group; the plain rule at CP = 1) -> the gated RMSNorm
with SiLU(z) -> out_proj. Returns (output, bias) as megatron's attention modules do. Packed documents: the
document ids [b, s_local] in ``attention_mask``'s seat (as `cp_ext.transformer.attention.CoreAttention`
takes them) or ``document_ids=``: the conv and the state reset at every document start.

megatron's GDN applies ``config.activation_func`` in the conv and the output gate (SiLU for Qwen3-Next's
SwiGLU configs); this module applies SiLU whatever the config's MLP activation is. Ring layouts only
(zigzag, contiguous): not Ulysses, not dynamic CP. The sizes are the config's (megatron's ``linear_*`` fields,
on 0.16.1 through 0.19.x), or keyword arguments of the same names.

Checkpoints: `sharded_state_dict` is megatron's GDN's, so a distributed checkpoint reshards over TP and holds
``in_proj.weight`` as its query / key / value / z / beta / alpha parts and ``conv1d.weight`` as query / key /
value, each TP-sharded on its own (the same keys megatron's module writes).
"""

import contextlib
import dataclasses
from typing import Optional

import torch
import torch.nn.functional as F

from megatron.core import parallel_state, tensor_parallel
from megatron.core.tensor_parallel.random import is_checkpointing
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import (ensure_metadata_has_dp_cp_group, make_sharded_tensors_for_checkpoint,
                                             sharded_state_dict_default)
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

from cp_ext.linear_attention.generation_state import LinearLayerState, conv_tail
from cp_ext.linear_attention.head_parallel import ulysses_conv_and_rule
from cp_ext.linear_attention.segments import KeptExchanges
from cp_ext.linear_attention import (causal_conv1d, context_parallel_causal_conv1d, context_parallel_gated_delta,
                                     gated_delta_rule)
from cp_ext.transformer.attention import _document_ids
from cp_ext.transformer.dynamic_cp import dynamic_params


def sections_factory(sharded: ShardedTensor, sections, names, dim: int) -> ShardedTensorFactory:
    """One checkpoint entry ``<key>.<name>`` per section of a TP-sharded tensor whose local rows are this TP rank's
    slice of every section, concatenated (GDN's ``in_proj`` and ``conv1d``): each entry is then an ordinary
    TP-sharded tensor, so the checkpoint reshards over TP. The keys and layout of megatron's own
    ``_split_tensor_factory`` (``megatron/core/ssm``), written here because 0.16.1's copy lives in a module that
    imports triton."""
    assert sum(sections) == sharded.local_shape[dim], (sections, sharded.local_shape)
    template = sharded.without_data()

    @torch.no_grad()
    def build(key, tensor, replica_id, flattened_range):
        whole = dataclasses.replace(template, key=key, data=tensor, dtype=tensor.dtype, replica_id=replica_id,
                                    flattened_range=flattened_range)
        pieces, start = [], 0
        for size, name in zip(sections, names):
            for piece in whole.narrow(dim, start, size):
                piece.key = f"{piece.key}.{name}"
                pieces.append(piece)
            start += size
        return pieces

    def merge(pieces):
        return torch.cat(pieces, dim=dim)

    return ShardedTensorFactory(sharded.key, sharded.data, build, merge, sharded.replica_id)


class GatedRMSNorm(torch.nn.Module):
    """RMSNorm over the last dim times SiLU(gate): megatron's GDN ``out_norm`` followed by its output gate.

    The norm runs in fp32 (fp64 for fp64 inputs), the gain is ``weight`` (1 + ``weight`` when zero-centered),
    and the result returns in x's dtype (transformers' ``Qwen3NextRMSNormGated``, megatron's
    ``_apply_gated_norm``)."""

    def __init__(self, hidden_size: int, eps: float, zero_centered_gamma: bool = False, dtype=None, device=None):
        super().__init__()
        init = torch.zeros if zero_centered_gamma else torch.ones
        self.weight = torch.nn.Parameter(init(hidden_size, dtype=dtype, device=device))
        self.eps, self.zero_centered_gamma = eps, zero_centered_gamma

    def forward(self, x: torch.Tensor, gate: torch.Tensor, weight: Optional[torch.Tensor] = None) -> torch.Tensor:
        weight = self.weight if weight is None else weight  # the TP-reducing view of the weight (see the caller)
        acc = torch.float64 if x.dtype == torch.float64 else torch.float32
        xf = x.to(acc)
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        gain = weight.to(acc) + 1 if self.zero_centered_gamma else weight.to(acc)
        return (normed * gain * F.silu(gate.to(acc))).to(x.dtype)


def _check(config, kernel, key_dim, value_dim, key_heads, value_heads):
    tp = config.tensor_model_parallel_size
    problems = []
    for flag, value in (("--linear-conv-kernel-dim", kernel), ("--linear-key-head-dim", key_dim),
                        ("--linear-value-head-dim", value_dim), ("--linear-num-key-heads", key_heads),
                        ("--linear-num-value-heads", value_heads)):
        if not isinstance(value, int) or value < 1:
            problems.append(f"{flag} must be a positive integer, got {value!r}")
    if problems:
        raise ValueError("; ".join(problems))
    for flag, heads in (("--linear-num-key-heads", key_heads), ("--linear-num-value-heads", value_heads)):
        if heads % tp:
            problems.append(f"{flag} ({heads}) must be divisible by --tensor-model-parallel-size ({tp})")
    if value_heads % key_heads:
        problems.append(f"--linear-num-value-heads ({value_heads}) must be a multiple of --linear-num-key-heads "
                        f"({key_heads}): each key head serves a group of value heads")
    if problems:
        raise ValueError("; ".join(problems))


def _cp_group_and_layout(config):
    """(group, layout) of this layer's CP (None at CP = 1): megatron's CP group, which is cp_ext's ring group
    when cp_ext's sub-groups exist (they must have no Ulysses part: the rule needs a ring layout)."""
    if parallel_state.get_context_parallel_world_size() == 1:
        return None, None
    from cp_ext import parallel_state as cp_state

    group = parallel_state.get_context_parallel_group()
    try:
        ulysses, group = cp_state.get_ulysses_world_size(), cp_state.get_ring_group()
    except RuntimeError:  # cp_ext's sub-groups not built: megatron's CP group is the ring
        ulysses = 1
    if ulysses != 1:
        raise NotImplementedError("Gated DeltaNet under CP passes states along a ring layout (zigzag or contiguous); "
                                  f"it does not support Ulysses (--ulysses-degree {ulysses})")
    return group, getattr(config, "cp_layout", "zigzag")


def _cp_groups(config):
    """(ring group, layout, Ulysses group) of this layer's CP: (None, None, None) at CP = 1; the Ulysses group
    None without a Ulysses level (its conv and rule then run on the ring, `_cp_group_and_layout`'s)."""
    if parallel_state.get_context_parallel_world_size() == 1:
        return None, None, None
    from cp_ext import parallel_state as cp_state

    try:
        ulysses = cp_state.get_ulysses_world_size()
    except RuntimeError:  # cp_ext's sub-groups not built: megatron's CP group is the ring
        return parallel_state.get_context_parallel_group(), getattr(config, "cp_layout", "zigzag"), None
    layout = getattr(config, "cp_layout", "zigzag")
    return cp_state.get_ring_group(), layout, (cp_state.get_ulysses_group() if ulysses > 1 else None)


class GatedDeltaNet(MegatronModule):
    """Qwen3-Next's Gated DeltaNet mixer with megatron-core 0.19's parameters (see the module docstring)."""

    def __init__(self, config: TransformerConfig, *, linear_conv_kernel_dim: Optional[int] = None,
                 linear_key_head_dim: Optional[int] = None, linear_value_head_dim: Optional[int] = None,
                 linear_num_key_heads: Optional[int] = None, linear_num_value_heads: Optional[int] = None,
                 layer_number: int = 1, **spec_kwargs):
        """Sizes not given are the config's fields of the same names; ``spec_kwargs``: what megatron's
        TransformerLayer passes its self-attention (``cp_comm_type``, ``pg_collection``, ``name``), unused."""
        super().__init__(config=config)
        def given_or_config(value, field):
            return getattr(config, field) if value is None else value

        linear_conv_kernel_dim = given_or_config(linear_conv_kernel_dim, "linear_conv_kernel_dim")
        linear_key_head_dim = given_or_config(linear_key_head_dim, "linear_key_head_dim")
        linear_value_head_dim = given_or_config(linear_value_head_dim, "linear_value_head_dim")
        linear_num_key_heads = given_or_config(linear_num_key_heads, "linear_num_key_heads")
        linear_num_value_heads = given_or_config(linear_num_value_heads, "linear_num_value_heads")
        _check(config, linear_conv_kernel_dim, linear_key_head_dim, linear_value_head_dim, linear_num_key_heads,
               linear_num_value_heads)
        tp = config.tensor_model_parallel_size
        self.layer_number = layer_number
        self.conv_kernel_dim = linear_conv_kernel_dim
        self.key_head_dim, self.value_head_dim = linear_key_head_dim, linear_value_head_dim
        self.num_key_heads, self.num_value_heads = linear_num_key_heads, linear_num_value_heads
        self.key_heads_local, self.value_heads_local = linear_num_key_heads // tp, linear_num_value_heads // tp
        qk_dim, v_dim = linear_key_head_dim * linear_num_key_heads, linear_value_head_dim * linear_num_value_heads
        self.qk_dim_local, self.v_dim_local = qk_dim // tp, v_dim // tp
        # megatron's in_proj_split_sections: this TP rank's [q | k | v | z | b | a]
        self.in_proj_split_sections = (self.qk_dim_local, self.qk_dim_local, self.v_dim_local, self.v_dim_local,
                                       self.value_heads_local, self.value_heads_local)
        self.in_proj = tensor_parallel.ColumnParallelLinear(
            config.hidden_size, 2 * qk_dim + 2 * v_dim + 2 * linear_num_value_heads, config=config,
            init_method=config.init_method, gather_output=False, bias=False, skip_bias_add=False, is_expert=False,
            tp_comm_buffer_name="fc1")
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        conv_dim_local = 2 * self.qk_dim_local + self.v_dim_local
        self.conv1d = torch.nn.Conv1d(conv_dim_local, conv_dim_local, kernel_size=linear_conv_kernel_dim,
                                      groups=conv_dim_local, padding=linear_conv_kernel_dim - 1, bias=False,
                                      device=device, dtype=config.params_dtype)
        self.dt_bias = torch.nn.Parameter(torch.ones(self.value_heads_local, dtype=config.params_dtype, device=device))
        self.A_log = torch.nn.Parameter(torch.zeros(self.value_heads_local, dtype=config.params_dtype, device=device))
        for param in (self.conv1d.weight, self.dt_bias, self.A_log):  # split over TP along dim 0, as megatron's
            param.tensor_model_parallel, param.partition_dim, param.partition_stride = True, 0, 1
        self.out_norm = GatedRMSNorm(linear_value_head_dim, config.layernorm_epsilon,
                                     zero_centered_gamma=config.layernorm_zero_centered_gamma,
                                     dtype=config.params_dtype, device=device)
        self.out_proj = tensor_parallel.RowParallelLinear(
            v_dim, config.hidden_size, config=config, init_method=config.output_layer_init_method, bias=False,
            input_is_parallel=True, skip_bias_add=True, is_expert=False, tp_comm_buffer_name="fc2")
        self.kept_exchanges = KeptExchanges()  # under CP-aware full recompute (`_exchanges`)
        # Generation (cp_ext.inference.generate): the cache whose state and conv tail this layer keeps; None in training
        self.kv_cache = None
        if config.perform_initialization:  # megatron's: dt_bias 1, A uniform in [1, 16] on the TP rank's stream
            with tensor_parallel.get_cuda_rng_tracker().fork():
                self.A_log.data.copy_(torch.empty_like(self.A_log).uniform_(1, 16).log())

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None):
        """megatron's GDN checkpoint map: ``A_log``, ``dt_bias`` and ``conv1d.weight`` TP-sharded on dim 0,
        ``in_proj.weight`` and ``conv1d.weight`` split into their sections first (each TP rank holds a slice of
        every section), ``out_norm`` replicated, ``out_proj`` as megatron's row-parallel linear."""
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        tp_group = parallel_state.get_tensor_model_parallel_group()
        own = {}
        self._save_to_state_dict(own, "", keep_vars=True)
        out = make_sharded_tensors_for_checkpoint(own, prefix, {"A_log": 0, "dt_bias": 0}, sharded_offsets,
                                                  tp_group=tp_group, dp_cp_group=metadata["dp_cp_group"])
        for name, module in self.named_children():
            if name == "conv1d":
                out.update(make_sharded_tensors_for_checkpoint(
                    module.state_dict(prefix="", keep_vars=True), f"{prefix}conv1d.", {"weight": 0}, sharded_offsets,
                    tp_group=tp_group, dp_cp_group=metadata["dp_cp_group"]))
            else:
                out.update(sharded_state_dict_default(module, f"{prefix}{name}.", sharded_offsets, metadata,
                                                      tp_group=tp_group))
        out[f"{prefix}in_proj.weight"] = sections_factory(
            out[f"{prefix}in_proj.weight"], list(self.in_proj_split_sections),
            ["query", "key", "value", "z", "beta", "alpha"], 0)
        out[f"{prefix}conv1d.weight"] = sections_factory(
            out[f"{prefix}conv1d.weight"], [self.qk_dim_local, self.qk_dim_local, self.v_dim_local],
            ["query", "key", "value"], 0)
        return out

    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor] = None, *,
                document_ids: Optional[torch.Tensor] = None, inference_context=None, packed_seq_params=None,
                **kwargs):
        """[s_local, b, hidden] -> (output [s_local, b, hidden], None); ``kwargs``: what megatron's
        TransformerLayer passes its self-attention (rotary embeddings and the like), unused.

        Under generation (``self.kv_cache`` set by `cp_ext.inference.generate.Generator`): a prefill also keeps
        the state after the last token and the conv's last inputs (`cp_ext.linear_attention.generation_state`); a decode
        step continues from them, one token, with no communication."""
        if inference_context is not None or kwargs.get("inference_params") is not None:
            raise NotImplementedError("cp_ext's Gated DeltaNet keeps its generation state in cp_ext's cache "
                                      "(cp_ext.inference.generate), not megatron's inference context")
        dynamic = dynamic_params(packed_seq_params)  # dynamic CP: this microbatch's group and documents
        cache = self.kv_cache
        qkvzba, _ = self.in_proj(hidden_states)  # [s, b, this TP rank's sections]
        s, b = qkvzba.shape[:2]
        if document_ids is None:
            document_ids = _document_ids(attention_mask, b, s, qkvzba.device)
        if cache is not None and document_ids is not None:
            raise NotImplementedError("generation runs one document; call the model without document ids")
        if cache is not None and cache.decoding:
            return self._decode_step(qkvzba, cache)
        if dynamic is not None:
            return self._dynamic(qkvzba, dynamic, document_ids)
        qkvzba = qkvzba.transpose(0, 1)  # [b, s, .]
        q, k, v, z, beta_logit, a = torch.split(qkvzba, self.in_proj_split_sections, dim=-1)
        group, layout, ulysses_group = _cp_groups(self.config)
        if ulysses_group is not None:  # Ulysses (x ring): the all-to-all before the conv, on whole heads
            if cache is not None:
                raise NotImplementedError("generation with Gated DeltaNet layers runs on the CP ring; drop the "
                                          "Ulysses level (--ulysses-size 1, --cp-comm-type p2p)")
            o = ulysses_conv_and_rule(
                q.unflatten(-1, (self.key_heads_local, self.key_head_dim)),
                k.unflatten(-1, (self.key_heads_local, self.key_head_dim)),
                v.unflatten(-1, (self.value_heads_local, self.value_head_dim)), *self._decay(a, beta_logit),
                self.conv1d.weight, ulysses_group=ulysses_group, ring_group=group, layout=layout,
                document_ids=document_ids, qk_l2norm=True)
            return self._output(o, z)
        raw_qkv = torch.cat([q, k, v], dim=-1)
        with self._exchanges(group, cache):
            o, final = self._conv_and_rule(raw_qkv, a, beta_logit, group, layout, document_ids, cache)
        if cache is not None:
            cache.linear[self.layer_number - 1] = LinearLayerState(
                final, conv_tail(raw_qkv, self.conv_kernel_dim, group=group, layout=layout or "zigzag"))
        return self._output(o, z)

    def _exchanges(self, group, cache):
        """Under CP-aware full recompute, inside megatron's checkpoint: keep this forward's gathers (the first
        forward) or replay them (the recompute), so the recompute exchanges nothing (`KeptExchanges`)."""
        if (group is None or cache is not None or not self.training or not is_checkpointing()
                or not getattr(self.config, "cp_aware_recompute", False)):
            return contextlib.nullcontext()
        return self.kept_exchanges.replay() if torch.is_grad_enabled() else self.kept_exchanges.record()

    def _conv_and_rule(self, raw_qkv, a, beta_logit, group, layout, document_ids, cache):
        """The conv (its halo over the CP ranks) and the rule (by state passing) on this rank's tokens: (o, the
        state after the last token where generation needs it, else None)."""
        if group is None:
            w = self.conv_kernel_dim
            ids = None if document_ids is None else F.pad(document_ids, (w - 1, 0), value=-1)
            qkv = causal_conv1d(F.pad(raw_qkv, (0, 0, w - 1, 0)), self.conv1d.weight, self.conv1d.bias,
                                document_ids=ids, activation="silu")
        else:
            qkv = context_parallel_causal_conv1d(raw_qkv, self.conv1d.weight, self.conv1d.bias, group=group,
                                                 layout=layout, document_ids=document_ids, activation="silu")
        q, k, v, g, beta = self._rule_inputs(qkv, a, beta_logit)
        if group is None:
            return gated_delta_rule(q, k, v, g, beta, document_ids=document_ids, qk_l2norm=True)
        if cache is not None:  # a prefill: the state after the prompt's last token too
            return context_parallel_gated_delta(q, k, v, g, beta, group=group, layout=layout, qk_l2norm=True,
                                                output_final_state=True)
        return context_parallel_gated_delta(q, k, v, g, beta, group=group, layout=layout,
                                            document_ids=document_ids, qk_l2norm=True), None

    def _dynamic(self, qkvzba, dynamic, document_ids):
        """Dynamic CP (`cp_ext.token_partition.DocumentZigzag`): each of the microbatch's units is zigzagged over
        the group on its own, so this rank's share of unit d is that unit's zigzag shard, next to the others'
        in order. Nothing crosses units (each is whole documents), so the conv and the rule run unit by unit:
        by state passing over the group, or on one rank the plain rule."""
        qkvzba = qkvzba.transpose(0, 1)  # [b, s, .]
        q, k, v, z, beta_logit, a = torch.split(qkvzba, self.in_proj_split_sections, dim=-1)
        raw_qkv = torch.cat([q, k, v], dim=-1)
        size, group, w = dynamic.size, dynamic.cp_group, self.conv_kernel_dim
        outs, start = [], 0
        for length in dynamic.layout.lengths:
            piece = slice(start, start + length // size)
            start = piece.stop
            ids = None if document_ids is None else document_ids[:, piece]
            if size == 1:
                padded = None if ids is None else F.pad(ids, (w - 1, 0), value=-1)
                qkv = causal_conv1d(F.pad(raw_qkv[:, piece], (0, 0, w - 1, 0)), self.conv1d.weight, self.conv1d.bias,
                                    document_ids=padded, activation="silu")
                rule = self._rule_inputs(qkv, a[:, piece], beta_logit[:, piece])
                outs.append(gated_delta_rule(*rule, document_ids=ids, qk_l2norm=True)[0])
            else:
                qkv = context_parallel_causal_conv1d(raw_qkv[:, piece], self.conv1d.weight, self.conv1d.bias,
                                                     group=group, layout="zigzag", document_ids=ids, activation="silu")
                rule = self._rule_inputs(qkv, a[:, piece], beta_logit[:, piece])
                outs.append(context_parallel_gated_delta(*rule, group=group, layout="zigzag", document_ids=ids,
                                                         qk_l2norm=True))
        return self._output(torch.cat(outs, dim=1), z)

    def _rule_inputs(self, qkv, a, beta_logit):
        """The conv's output [b, s, q | k | v] and the decay / beta inputs -> q, k, v by head, g (fp32), beta."""
        b, s = qkv.shape[:2]
        q, k, v = torch.split(qkv, [self.qk_dim_local, self.qk_dim_local, self.v_dim_local], dim=-1)
        q = q.reshape(b, s, self.key_heads_local, self.key_head_dim)
        k = k.reshape(b, s, self.key_heads_local, self.key_head_dim)
        v = v.reshape(b, s, self.value_heads_local, self.value_head_dim)
        return (q, k, v, *self._decay(a, beta_logit))

    def _decay(self, a, beta_logit):
        """g = -exp(A_log) softplus(a + dt_bias) per value head (fp32, as megatron) and beta = sigmoid(b)."""
        acc = torch.float64 if a.dtype == torch.float64 else torch.float32
        return -self.A_log.to(acc).exp() * F.softplus(a.to(acc) + self.dt_bias.to(acc)), beta_logit.sigmoid()

    def _output(self, o, z):
        """The gated norm and out_proj of the rule's output o [b, s, h_v, V]: (output [s, b, hidden], bias)."""
        b, s = o.shape[:2]
        # out_norm's weight is replicated over TP but each rank normalizes its own heads: the copy's backward
        # sums its gradient over TP, so every TP rank holds the whole gradient (with or without SP).
        norm_weight = self.out_norm.weight
        if self.config.tensor_model_parallel_size > 1:
            norm_weight = tensor_parallel.copy_to_tensor_model_parallel_region(norm_weight)
        o = self.out_norm(o, z.reshape(b, s, self.value_heads_local, self.value_head_dim), norm_weight)
        return self.out_proj(o.reshape(b, s, self.v_dim_local).transpose(0, 1))

    def _decode_step(self, qkvzba, cache):
        """One new token (``qkvzba`` [copies, b, .]: under sequence parallelism one identical copy per TP rank)
        through the conv window and one step of the rule, from this layer's cached state; the same on every CP
        rank, so nothing is exchanged."""
        copies = qkvzba.shape[0]
        x = qkvzba[:1].transpose(0, 1)  # [b, 1, .]
        q, k, v, z, beta_logit, a = torch.split(x, self.in_proj_split_sections, dim=-1)
        raw_qkv = torch.cat([q, k, v], dim=-1)
        layer = self.layer_number - 1
        state = cache.linear.get(layer)
        if state is None:  # a prompt too short for a CP prefill: the first token starts from nothing
            b, channels = raw_qkv.shape[0], raw_qkv.shape[-1]
            state = LinearLayerState(None, raw_qkv.new_zeros(b, self.conv_kernel_dim - 1, channels))
        window = torch.cat([state.conv_tail, raw_qkv], dim=1)  # [b, w, channels]: the conv needs no padding
        qkv = causal_conv1d(window, self.conv1d.weight, self.conv1d.bias, activation="silu")[:, -1:]
        q, k, v, g, beta = self._rule_inputs(qkv, a, beta_logit)
        o, final = gated_delta_rule(q, k, v, g, beta, initial_state=state.state, qk_l2norm=True)
        cache.linear[layer] = LinearLayerState(final, window[:, 1:])
        if copies > 1:  # sequence parallelism: out_proj reduce-scatters over the copies
            o, z = o.expand(-1, copies, -1, -1), z.expand(-1, copies, -1)
        return self._output(o, z)
