"""What every linear-attention mixer shares (Gated DeltaNet, `cp_ext.transformer.gated_delta_net`; Kimi Delta
Attention, `cp_ext.transformer.kimi_delta_attention`): the conv over [q | k | v] and the gated delta rule on every
CP path, the checkpoint map, generation, and the gated output.

A mixer projects its input (`_project`) into the conv's inputs [b, s, q | k | v], the decay's inputs and the output
gate's input; `_decay` turns the decay's inputs into the rule's g (per head, or per key channel) and beta; `_gate`
shapes the output gate. Everything else is here, one path per CP situation:

* CP = 1: the conv with zero padding and the plain rule;
* the ring (zigzag or contiguous): the conv's halo from the ranks before and the rule by state passing
  (`cp_ext.linear_attention`), the same token partition as the softmax layers;
* a Ulysses level: the all-to-all before the conv, then the ring's path on h/U heads (`ulysses_conv_and_rule`);
* dynamic CP: unit by unit over the microbatch's group (`_dynamic`);
* CP-aware full recompute: the first forward's gathers replayed in the recompute (`KeptExchanges`);
* generation: a prefill keeps the state after its last token and the conv's last inputs, a decode step continues
  from them with no exchange (`cp_ext.linear_attention.generation_state`).

Packed documents come as document ids [b, s_local] in ``attention_mask``'s seat (as `cp_ext.transformer.attention.
CoreAttention` takes them) or ``document_ids=``: the conv and the state restart at every document start.
"""

import contextlib
from typing import Optional

import torch
import torch.nn.functional as F

from megatron.core import parallel_state, tensor_parallel
from megatron.core.tensor_parallel.random import is_checkpointing
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.utils import (ensure_metadata_has_dp_cp_group, make_sharded_tensors_for_checkpoint,
                                             sharded_state_dict_default)

from cp_ext.linear_attention import (causal_conv1d, context_parallel_causal_conv1d, context_parallel_gated_delta,
                                     gated_delta_rule)
from cp_ext.linear_attention.generation_state import LinearLayerState, conv_tail
from cp_ext.linear_attention.head_parallel import ulysses_conv_and_rule
from cp_ext.linear_attention.segments import KeptExchanges
from cp_ext.transformer.attention import _document_ids
from cp_ext.transformer.dynamic_cp import dynamic_params
from cp_ext.transformer.sections import sections_factory


def cp_groups(config):
    """(ring group, layout, Ulysses group) of a linear layer's CP: (None, None, None) at CP = 1; the Ulysses group
    None without a Ulysses level. Without cp_ext's sub-groups megatron's CP group is the ring."""
    if parallel_state.get_context_parallel_world_size() == 1:
        return None, None, None
    from cp_ext import parallel_state as cp_state

    layout = getattr(config, "cp_layout", "zigzag")
    try:
        ulysses = cp_state.get_ulysses_world_size()
    except RuntimeError:  # cp_ext's sub-groups not built
        return parallel_state.get_context_parallel_group(), layout, None
    return cp_state.get_ring_group(), layout, (cp_state.get_ulysses_group() if ulysses > 1 else None)


class LinearMixer(MegatronModule):
    """The shared forward of the linear-attention mixers (see the module docstring). A subclass sets the sizes
    (``conv_kernel_dim``, ``key_heads_local``, ``value_heads_local``, ``key_head_dim``, ``value_head_dim``,
    ``qk_dim_local``, ``v_dim_local``, ``layer_number``), the modules ``in_proj``, ``conv1d``, ``out_norm``,
    ``out_proj``, the parameters ``A_log`` and ``dt_bias``, ``in_proj_split_sections`` with ``IN_PROJ_NAMES``
    (the checkpoint's section names), calls `_init_state`, and implements `_project`, `_decay` and `_gate`."""

    IN_PROJ_NAMES = ()

    def _init_state(self):
        self.kept_exchanges = KeptExchanges()  # under CP-aware full recompute (`_exchanges`)
        # Generation (cp_ext.inference.generate): the cache whose state and conv tail this layer keeps; None in training
        self.kv_cache = None

    # ------------------------------------------------------------------ the subclass's parts
    def _project(self, hidden_states):
        """[s, b, hidden] -> (the conv's inputs [b, s, q | k | v], the decay's inputs (a tuple of [b, s, ...]),
        the output gate's input [b, s, ...]), this TP rank's heads."""
        raise NotImplementedError

    def _decay(self, *decay_inputs):
        """-> (g [b, s, h_v] or [b, s, h_v, K] in fp32, beta [b, s, h_v])."""
        raise NotImplementedError

    def _gate(self, gate_input):
        """-> the output gate [b, s, h_v, V] the gated norm reads."""
        raise NotImplementedError

    # ------------------------------------------------------------------ the checkpoint
    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None):
        """megatron's map for its GDN (and Megatron-LM's KDA): ``A_log``, ``dt_bias`` and ``conv1d.weight``
        TP-sharded on dim 0, ``in_proj.weight`` and ``conv1d.weight`` split into their sections first (each TP rank
        holds a slice of every section), the rest as their modules map themselves."""
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
            out[f"{prefix}in_proj.weight"], list(self.in_proj_split_sections), list(self.IN_PROJ_NAMES), 0)
        out[f"{prefix}conv1d.weight"] = sections_factory(
            out[f"{prefix}conv1d.weight"], [self.qk_dim_local, self.qk_dim_local, self.v_dim_local],
            ["query", "key", "value"], 0)
        return out

    # ------------------------------------------------------------------ forward
    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor] = None, *,
                document_ids: Optional[torch.Tensor] = None, inference_context=None, packed_seq_params=None,
                **kwargs):
        """[s_local, b, hidden] -> (output [s_local, b, hidden], None); ``kwargs``: what megatron's
        TransformerLayer passes its self-attention (rotary embeddings and the like), unused."""
        if inference_context is not None or kwargs.get("inference_params") is not None:
            raise NotImplementedError("cp_ext's linear-attention layers keep their generation state in cp_ext's "
                                      "cache (cp_ext.inference.generate), not megatron's inference context")
        dynamic = dynamic_params(packed_seq_params)  # dynamic CP: this microbatch's group and documents
        cache = self.kv_cache
        raw_qkv, decay_inputs, gate_input = self._project(hidden_states)
        b, s = raw_qkv.shape[:2]
        if document_ids is None:
            document_ids = _document_ids(attention_mask, b, s, raw_qkv.device)
        if cache is not None and document_ids is not None:
            raise NotImplementedError("generation runs one document; call the model without document ids")
        if cache is not None and cache.decoding:
            return self._decode_step(raw_qkv, decay_inputs, gate_input, cache)
        if dynamic is not None:
            return self._output(self._dynamic(raw_qkv, decay_inputs, dynamic, document_ids), gate_input)
        group, layout, ulysses_group = cp_groups(self.config)
        if ulysses_group is not None:  # Ulysses (x ring): the all-to-all before the conv, on whole heads
            if cache is not None:
                raise NotImplementedError("generation with linear-attention layers runs on the CP ring; drop the "
                                          "Ulysses level (--ulysses-size 1, --cp-comm-type p2p)")
            o = ulysses_conv_and_rule(*self._heads(raw_qkv), *self._decay(*decay_inputs), self.conv1d.weight,
                                      ulysses_group=ulysses_group, ring_group=group, layout=layout,
                                      document_ids=document_ids, qk_l2norm=True)
            return self._output(o, gate_input)
        with self._exchanges(group, cache):
            o, final = self._conv_and_rule(raw_qkv, decay_inputs, group, layout, document_ids, cache)
        if cache is not None:
            cache.linear[self.layer_number - 1] = LinearLayerState(
                final, conv_tail(raw_qkv, self.conv_kernel_dim, group=group, layout=layout or "zigzag"))
        return self._output(o, gate_input)

    def _heads(self, qkv):
        """[b, s, q | k | v] -> q, k [b, s, h_k, K], v [b, s, h_v, V]."""
        q, k, v = torch.split(qkv, [self.qk_dim_local, self.qk_dim_local, self.v_dim_local], dim=-1)
        return (q.unflatten(-1, (self.key_heads_local, self.key_head_dim)),
                k.unflatten(-1, (self.key_heads_local, self.key_head_dim)),
                v.unflatten(-1, (self.value_heads_local, self.value_head_dim)))

    def _output(self, o, gate_input):
        """The gated norm and out_proj of the rule's output o [b, s, h_v, V]: (output [s, b, hidden], bias)."""
        b, s = o.shape[:2]
        # out_norm's weight is replicated over TP but each rank normalizes its own heads: the copy's backward
        # sums its gradient over TP, so every TP rank holds the whole gradient (with or without SP).
        norm_weight = self.out_norm.weight
        if self.config.tensor_model_parallel_size > 1:
            norm_weight = tensor_parallel.copy_to_tensor_model_parallel_region(norm_weight)
        o = self.out_norm(o, self._gate(gate_input), norm_weight)
        return self.out_proj(o.reshape(b, s, self.v_dim_local).transpose(0, 1))

    def _exchanges(self, group, cache):
        """Under CP-aware full recompute, inside megatron's checkpoint: keep this forward's gathers (the first
        forward) or replay them (the recompute), so the recompute exchanges nothing (`KeptExchanges`)."""
        if (group is None or cache is not None or not self.training or not is_checkpointing()
                or not getattr(self.config, "cp_aware_recompute", False)):
            return contextlib.nullcontext()
        return self.kept_exchanges.replay() if torch.is_grad_enabled() else self.kept_exchanges.record()

    def _conv(self, raw_qkv, group, layout, document_ids):
        """The causal conv with SiLU: zero-padded on one rank, its halo over ``group`` under CP."""
        if group is None:
            w = self.conv_kernel_dim
            ids = None if document_ids is None else F.pad(document_ids, (w - 1, 0), value=-1)
            return causal_conv1d(F.pad(raw_qkv, (0, 0, w - 1, 0)), self.conv1d.weight, self.conv1d.bias,
                                 document_ids=ids, activation="silu")
        return context_parallel_causal_conv1d(raw_qkv, self.conv1d.weight, self.conv1d.bias, group=group,
                                              layout=layout, document_ids=document_ids, activation="silu")

    def _conv_and_rule(self, raw_qkv, decay_inputs, group, layout, document_ids, cache=None):
        """The conv and the rule on this rank's tokens: (o, the state after the last token where generation needs
        it, else None)."""
        rule = (*self._heads(self._conv(raw_qkv, group, layout, document_ids)), *self._decay(*decay_inputs))
        if group is None:
            return gated_delta_rule(*rule, document_ids=document_ids, qk_l2norm=True)
        if cache is not None:  # a prefill: the state after the prompt's last token too
            return context_parallel_gated_delta(*rule, group=group, layout=layout, qk_l2norm=True,
                                                output_final_state=True)
        return context_parallel_gated_delta(*rule, group=group, layout=layout, document_ids=document_ids,
                                            qk_l2norm=True), None

    def _dynamic(self, raw_qkv, decay_inputs, dynamic, document_ids):
        """Dynamic CP (`cp_ext.token_partition.DocumentZigzag`): each of the microbatch's units is zigzagged over
        the group on its own, so this rank's share of unit d is that unit's zigzag shard, next to the others'
        in order. Nothing crosses units (each is whole documents), so the conv and the rule run unit by unit:
        by state passing over the group, or on one rank the plain rule. Returns o [b, s_local, h_v, V]."""
        size = dynamic.size
        group = dynamic.cp_group if size > 1 else None
        outs, start = [], 0
        for length in dynamic.layout.lengths:
            piece = slice(start, start + length // size)
            start = piece.stop
            ids = None if document_ids is None else document_ids[:, piece]
            o, _ = self._conv_and_rule(raw_qkv[:, piece], tuple(x[:, piece] for x in decay_inputs), group,
                                       "zigzag", ids)
            outs.append(o)
        return torch.cat(outs, dim=1)

    def _decode_step(self, raw_qkv, decay_inputs, gate_input, cache):
        """One new token (``raw_qkv`` [b, copies, .]: under sequence parallelism one identical copy per TP rank)
        through the conv window and one step of the rule, from this layer's cached state; the same on every CP
        rank, so nothing is exchanged."""
        copies = raw_qkv.shape[1]
        token = raw_qkv[:, :1]
        layer = self.layer_number - 1
        state = cache.linear.get(layer)
        if state is None:  # a prompt too short for a CP prefill: the first token starts from nothing
            state = LinearLayerState(None, token.new_zeros(token.shape[0], self.conv_kernel_dim - 1, token.shape[-1]))
        window = torch.cat([state.conv_tail, token], dim=1)  # [b, w, channels]: the conv needs no padding
        qkv = causal_conv1d(window, self.conv1d.weight, self.conv1d.bias, activation="silu")[:, -1:]
        rule = (*self._heads(qkv), *self._decay(*(x[:, :1] for x in decay_inputs)))
        o, final = gated_delta_rule(*rule, initial_state=state.state, qk_l2norm=True)
        cache.linear[layer] = LinearLayerState(final, window[:, 1:])
        return self._output(o.expand(-1, copies, -1, -1), gate_input)  # SP: out_proj reduce-scatters the copies
