"""Multi-token prediction (DeepSeek-V3's MTP, Megatron-LM's --mtp-num-layers) under cp_ext's CP layouts.

megatron-core's MTP (transformer/multi_token_prediction.py) shifts four [b, s] tensors left by one
position per depth with `roll_tensor`: the input ids and position ids (before the MTP layer embeds
them), and the labels and loss mask (before each depth's loss). Under CP a rank holds only some
global positions, so "the token after mine" is often on another rank; megatron's CP roll assumes
its own fixed zigzag split into 2 x CP chunks and is wrong for cp_ext's contiguous layout and its
Ulysses x ring split (Megatron-LM #1661, #4495; `megatron_roll_error` measures by how much).

What is rolled, and how:

* Only those [b, s] integer/mask tensors. megatron rolls the *ids* and embeds them afterwards, so
  the [s, b, h] embeddings never cross ranks: each rank embeds the ids it was handed, which is
  exactly the rolled embedding (word and learned position rows are per token; SP scatters after).
* The roll gathers the whole [b, s] sequence over megatron's CP group (one all-gather; b x s values
  in all, 1 MiB of int64 at s = 128K, b = 1, where one layer's K/V ring moves s x 2 x kv_heads x
  head_dim values) and re-indexes it at this rank's global positions + 1
  (`cp_ext.parallel_state.get_context_parallel_positions`, the formula the data, RoPE and attention
  share), with 0 past the end as torch.roll + fill does at CP=1. Any layout, any U x R, one code
  path. Per microbatch: one all-gather per MTP layer (ids and position ids stacked), and one each
  for the labels and the loss mask, gathered once and shifted for every depth locally. (Sending only
  each shard's boundary tokens would move less, but a zigzag or Ulysses shard has up to 2 x R
  boundaries whose neighbours sit on different ranks; the whole [b, s] tensor is small enough.)
* `roll_left` is also differentiable (an autograd Function whose backward is the same exchange
  shifted the other way: d out[p] / d in[p+1] = 1), so a float tensor (an MTP variant rolling
  hidden states) gets exact gradients; the unit test checks both directions.

The losses: megatron adds each depth's masked loss to the main loss through `MTPLossAutoScaler`
(scaled by --mtp-loss-scaling-factor / D, summed per token: cp_ext always sets
calculate_per_token_loss, so finalize_model_grads divides by the global main-loss token count at
every layout alike). For logging megatron averages each rank's local per-token mean over DP x CP,
which depends on the split (the last position is masked on one rank only). cp_ext records each
depth's (loss sum, token count) here instead; the trainer sums them over the world, giving
Megatron-LM's ``mtp_1 loss`` as the global per-token mean, equal at every layout.

Under PP megatron builds every MTP layer on the last stage, with a copy of the embedding; the trainer
hands that stage the tokens too (`Trainer.reads_tokens`).
"""

import copy
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import TransformerLayer
from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler, MultiTokenPredictionLayer
from megatron.core.utils import make_viewless_tensor

from cp_ext import parallel_state as cp_state
from cp_ext.megatron_compat import MTP_EMBEDDINGS_CARRY_PADDING_MASK, MTP_INNER_LAYER_FIELD, model_layer_number
from cp_ext.token_partition import context_parallel_positions
from cp_ext.transformer.compressed_attention import CompressedAttention
from cp_ext.transformer.dynamic_cp import dynamic_params
from cp_ext.transformer.hyper_connections import HyperHead, StreamsFinalNorm, collapse
from cp_ext.transformer.norms import SequenceParallelNorm
from cp_ext.transformer.router import DeepSeekV4Router


# ---------------------------------------------------------------- the roll across CP shards

def _cp_size():
    return mpu.get_context_parallel_world_size() if mpu.model_parallel_is_initialized() else 1


def group_positions(seq_len: int, layout: str) -> torch.Tensor:
    """[C, s/C]: the global positions of every CP rank's tokens, in megatron's CP group rank order.

    cp_ext's sub-groups slice megatron's CP rank list ``cp`` (`cp_ext.parallel_state`): entry i is
    Ulysses rank i % U of ring rank i // U. Computed, not gathered: no collective per call."""
    u = cp_state.get_ulysses_world_size()
    cp_ranks = list(mpu.get_context_parallel_global_ranks())
    rows = []
    for rank in dist.get_process_group_ranks(mpu.get_context_parallel_group()):
        i = cp_ranks.index(rank)
        rows.append(context_parallel_positions(seq_len, ring_rank=i // u, ring_size=len(cp_ranks) // u,
                                               ulysses_rank=i % u, ulysses_size=u, layout=layout))
    return torch.stack(rows)


class GlobalSequence:
    """A [.., s/C] tensor (positions on ``dim``) made whole over the CP group, in global order.

    ``shifted(k)`` is this rank's shard of the whole sequence shifted left by k: at global
    position p the value at p + k, 0 where p + k is past the end (torch.roll with megatron's fill).
    ``dynamic`` (dynamic CP's `DynamicCPParams`): over the microbatch's group instead, whose sequence is its
    documents one after another (each padded, `cp_ext.token_partition.DocumentZigzag`), each shifted on its own, as
    megatron rolls each sequence of a packed (THD) batch: past a document's padded end is past the end."""

    def __init__(self, local: torch.Tensor, layout: str, dim: int = -1, dynamic=None):
        self.dim = dim % local.dim()
        self.segments = None
        if dynamic is not None:
            self.seq_len, self.mine = dynamic.layout.seq_len, dynamic.positions(device=local.device)
            ends = torch.tensor(dynamic.layout.lengths, device=local.device).cumsum(0)
            segment = torch.searchsorted(ends, self.mine, right=True)
            self.segments = (ends[segment] - torch.tensor(dynamic.layout.lengths, device=local.device)[segment],
                             ends[segment])  # [start, end) of each of my positions' document
            if dynamic.size == 1:
                self.full = local
                return
            group = dynamic.cp_group
            positions = torch.stack([dynamic.layout.positions(r) for r in range(dynamic.size)]).to(local.device)
        else:
            self.seq_len = local.shape[self.dim] * _cp_size()
            self.mine = cp_state.get_context_parallel_positions(self.seq_len, layout, device=local.device)
            if _cp_size() == 1:
                self.full = local
                return
            group = mpu.get_context_parallel_group()
            positions = group_positions(self.seq_len, layout).to(local.device)
        assert torch.equal(positions[dist.get_rank(group)], self.mine)  # the same formula
        shards = [torch.empty_like(local) for _ in range(positions.shape[0])]
        dist.all_gather(shards, local.contiguous(), group=group)
        order = torch.empty_like(positions.view(-1))
        order[positions.view(-1)] = torch.arange(self.seq_len, device=local.device)  # position -> gathered index
        self.full = torch.cat(shards, dim=self.dim).index_select(self.dim, order)

    def shifted(self, k: int, fill=0) -> torch.Tensor:
        target = self.mine + k
        start, end = (0, self.seq_len) if self.segments is None else self.segments
        inside = (target >= start) & (target < end)
        out = self.full.index_select(self.dim, target.clamp(0, self.seq_len - 1))
        shape = [1] * out.dim()
        shape[self.dim] = -1
        return torch.where(inside.view(shape), out, torch.full((), fill, dtype=out.dtype, device=out.device))


class _RollLeft(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, layout, dim, dynamic):
        ctx.layout, ctx.dim, ctx.dynamic = layout, dim, dynamic
        return GlobalSequence(tensor, layout, dim, dynamic).shifted(1)

    @staticmethod
    def backward(ctx, grad):
        # out[p] = in[p + 1], so d in[q] = d out[q - 1] (0 at q = 0): the same exchange, shifted right.
        return GlobalSequence(grad, ctx.layout, ctx.dim, ctx.dynamic).shifted(-1), None, None, None


def roll_left(tensor: torch.Tensor, layout: str, dim: int = -1, dynamic=None, fill=0) -> torch.Tensor:
    """megatron's ``roll_tensor(tensor, shifts=-1)[0]`` over the whole CP-sharded sequence (see the
    module doc), for this rank's shard: value at global position p + 1, ``fill`` at the last position.
    ``dynamic``: over dynamic CP's group of this microbatch, each document on its own (`GlobalSequence`)."""
    if tensor.requires_grad:
        return _RollLeft.apply(tensor, layout, dim, dynamic)
    return GlobalSequence(tensor, layout, dim, dynamic).shifted(1, fill)


def megatron_roll_error(tensor: torch.Tensor, layout: str, dim: int = -1) -> int:
    """How many entries of megatron's own CP roll (`roll_tensor`) differ from the exact roll on this rank."""
    from megatron.core.transformer.multi_token_prediction import roll_tensor

    theirs, _ = roll_tensor(tensor, shifts=-1, dims=dim, cp_group=mpu.get_context_parallel_group())
    return int((theirs != roll_left(tensor, layout, dim)).sum())


# ---------------------------------------------------------------- the MTP layer and its spec

class ContextParallelMTPLayer(MultiTokenPredictionLayer):
    """megatron's MTP layer whose shift of the input and position ids crosses cp_ext's CP shards. DeepSeek-V4's
    routers in it are numbered after the decoder's layers on every megatron-core (0.19 numbers the MTP layer's own
    layer from 1), so that hash routing (the first --moe-n-hash-layers layers) never takes an MTP layer."""

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        for module in self.modules():
            router = getattr(getattr(module, "mlp", None), "router", None)
            if isinstance(module, TransformerLayer) and isinstance(router, DeepSeekV4Router):
                router.set_layer_number(model_layer_number(module))

    def _get_embeddings(self, input_ids, position_ids, embedding, hidden_states, packed_seq_params=None,
                        padding_mask=None):
        dynamic = dynamic_params(packed_seq_params)  # dynamic CP: the roll crosses this microbatch's group
        layout = getattr(self.config, "cp_layout", "zigzag")
        if position_ids.shape == input_ids.shape and position_ids.dtype == input_ids.dtype:  # one gather
            both = roll_left(torch.stack([input_ids, position_ids]), layout, dynamic=dynamic)
            input_ids, position_ids = both.unbind(0)
        else:
            input_ids, position_ids = roll_left(input_ids, layout, dynamic=dynamic), roll_left(position_ids, layout,
                                                                                               dynamic=dynamic)
        decoder_input = embedding(input_ids=input_ids, position_ids=position_ids)
        hidden_states = make_viewless_tensor(inp=hidden_states, requires_grad=True, keep_graph=True)
        if not MTP_EMBEDDINGS_CARRY_PADDING_MASK:  # 0.16, 0.17
            return input_ids, position_ids, decoder_input, hidden_states
        if padding_mask is not None:  # dynamic CP: past a document's end is padding (its routers leave it out)
            padding_mask = roll_left(padding_mask, layout, dynamic=dynamic, fill=dynamic is not None)
        return input_ids, position_ids, padding_mask, decoder_input, hidden_states


class HyperConnectionMTPLayer(ContextParallelMTPLayer):
    """DeepSeek-V4's MTP layer under hyper-connections: it reads the previous depth's streams (token-major
    [s * n, b, h]) and, per stream, ``eh_proj([enorm(e); hnorm(x_k)])`` (DeepSeek's ``e_proj(e) + h_proj(x_k)``, the
    two halves of megatron's eh_proj), runs its V4 layer on the streams and hands them on; the model collapses them
    with this layer's ``hc_head`` and final norm for its loss (`cp_ext.transformer.hyper_connections.collapse`)."""

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        self.hc_head = HyperHead(config)

    def _get_embeddings(self, *args, **kwargs):
        out = super()._get_embeddings(*args, **kwargs)
        n = self.config.num_residual_streams
        decoder_input = out[-2]  # the next tokens' embedding [s, b, h], the same for every stream
        streams = decoder_input.unsqueeze(1).expand(-1, n, -1, -1).flatten(0, 1)
        return (*out[:-2], streams, out[-1])


def get_mtp_block_spec(config, decoder_block, fill_seats):
    """megatron's MTP block spec (its layer: the decoder's last layer spec) with cp_ext's seats:
    the layer above, SP-capable norms for enorm / hnorm / the final norm, cp_ext's attention in
    the transformer layer (`fill_seats`, as in the decoder). None without --mtp-num-layers, and on
    every pipeline stage but the last (megatron builds all MTP layers there). With hyper-connections, DeepSeek-V4's
    layer (`HyperConnectionMTPLayer`); V4's attention of the kind --csa-compress-ratios gives the MTP layer (its
    entries after the decoder's, as Megatron-LM's V4 scripts pass them)."""
    if not config.mtp_num_layers:
        return None
    block = get_gpt_mtp_block_spec(config, decoder_block, use_transformer_engine=False)
    if block is None:
        return None
    streams = getattr(config, "enable_hyper_connections", False)
    kinds = getattr(config, "dsv4_layer_kinds", None)
    if kinds:  # one spec per depth: each MTP layer's attention of its own kind
        block.layer_specs = [_with_inner_attention(spec, kinds[config.num_layers + depth])
                             for depth, spec in enumerate(block.layer_specs)]
    for layer in {id(spec): spec for spec in block.layer_specs}.values():
        layer.module = HyperConnectionMTPLayer if streams else ContextParallelMTPLayer
        layer.submodules.enorm = layer.submodules.hnorm = SequenceParallelNorm
        layer.submodules.layer_norm = StreamsFinalNorm if streams else SequenceParallelNorm
        if not kinds:  # (V4's inner layers keep the decoder's seats, filled already)
            fill_seats(getattr(layer.submodules, MTP_INNER_LAYER_FIELD), config)
    return block


def _with_inner_attention(spec, kind):
    """A copy of an MTP layer spec whose transformer layer has DeepSeek-V4's attention of ``kind`` (its mask causal,
    as megatron's MTP layer checks)."""
    spec, inner = copy.copy(spec), copy.copy(getattr(spec.submodules, MTP_INNER_LAYER_FIELD))
    spec.submodules = copy.copy(spec.submodules)
    inner.submodules = copy.copy(inner.submodules)
    inner.submodules.self_attention = ModuleSpec(module=CompressedAttention,
                                                 params={"attn_mask_type": AttnMaskType.causal, "kind": kind})
    setattr(spec.submodules, MTP_INNER_LAYER_FIELD, inner)
    return spec


# ---------------------------------------------------------------- the losses

class MTPLosses:
    """Each depth's (masked loss sum, token count) of the microbatches run since the last `take`."""

    sums: Optional[torch.Tensor] = None

    @classmethod
    def record(cls, depth, num_depths, loss_sum, count):
        if cls.sums is None or cls.sums.shape[0] != num_depths:
            cls.sums = torch.zeros(num_depths, 2, dtype=torch.float64, device=loss_sum.device)
        cls.sums[depth, 0] += loss_sum.detach().to(torch.float64)
        cls.sums[depth, 1] += count.detach().to(torch.float64)

    @classmethod
    def take(cls, num_depths, device):
        sums = cls.sums if cls.sums is not None and cls.sums.shape[0] == num_depths else None
        cls.sums = None
        return torch.zeros(num_depths, 2, dtype=torch.float64, device=device) if sums is None else sums.to(device)


def decoder_output(model, hidden_states):
    """The decoder's output as the output layer reads it: under hyper-connections with MTP the decoder hands its
    streams on (`StreamsFinalNorm`), and here its last layer's head and the final norm collapse them."""
    if isinstance(model.decoder.final_layernorm, StreamsFinalNorm):
        return collapse(hidden_states, model.decoder.layers[-1].hc_head, model.decoder.final_layernorm)
    return hidden_states


def postprocess_with_mtp(model, hidden_states, *, input_ids, position_ids, labels, rotary_pos_emb, rotary_pos_cos,
                         rotary_pos_sin, mtp_in_postprocess=None, loss_mask=None, attention_mask=None,
                         inference_params=None, packed_seq_params=None, sequence_len_offset=None,
                         runtime_gather_output=None, extra_block_kwargs=None, inference_context=None,
                         padding_mask=None, **_):
    """`GPTModel._postprocess` with MTP (training and evaluation), its rolls CP-aware.

    megatron's MTP part of `_postprocess`, with `roll_left` for labels and loss mask, the
    per-token loss path only, and the (sum, count) recorded for logging. Without labels (logits:
    generation) the MTP layers are skipped: their outputs only feed the MTP losses, and megatron's
    own path would fail there (it clones the absent labels)."""
    if inference_context is not None:
        raise NotImplementedError("cp_ext's MTP does not support megatron's inference contexts")
    dynamic = dynamic_params(packed_seq_params)  # None, or dynamic CP's microbatch (THD packing is refused)
    output_weight = model.shared_embedding_or_output_weight() if model.share_embeddings_and_output_weights else None
    depths = model.config.mtp_num_layers
    if mtp_in_postprocess and labels is not None:
        hidden_states = model.mtp(
            input_ids=input_ids, position_ids=position_ids, hidden_states=hidden_states, attention_mask=attention_mask,
            inference_params=inference_params, rotary_pos_emb=rotary_pos_emb, rotary_pos_cos=rotary_pos_cos,
            rotary_pos_sin=rotary_pos_sin, packed_seq_params=packed_seq_params,
            sequence_len_offset=sequence_len_offset, embedding=model.embedding, **(extra_block_kwargs or {}),
            # 0.18+: the MTP layers' routers leave padding out too (dynamic CP passes the mask)
            **({"padding_mask": padding_mask} if padding_mask is not None else {}))
    if not model.post_process:
        return hidden_states
    if labels is None:
        logits, _ = model.output_layer(decoder_output(model, hidden_states), weight=output_weight,
                                       runtime_gather_output=runtime_gather_output)
        return logits.transpose(0, 1).contiguous()
    assert model.config.calculate_per_token_loss, "cp_ext sums the loss per token (cp_ext.config)"
    chunks = list(torch.chunk(hidden_states, 1 + depths, dim=0))
    if getattr(model.config, "enable_hyper_connections", False):  # each MTP layer's streams: its own head and norm
        chunks = [decoder_output(model, chunks[0])] + [collapse(x, layer.hc_head, layer.final_layernorm)
                                                       for x, layer in zip(chunks[1:], model.mtp.layers)]
    hidden_states = chunks[0]
    layout = getattr(model.config, "cp_layout", "zigzag")
    mask = torch.ones_like(labels, dtype=torch.float32) if loss_mask is None else loss_mask
    all_labels = GlobalSequence(labels, layout, dynamic=dynamic)  # one gather each
    all_mask = GlobalSequence(mask, layout, dynamic=dynamic)
    scale = model.config.mtp_loss_scaling_factor / depths
    for depth in range(depths):
        logits, _ = model.output_layer(chunks[depth + 1], weight=output_weight,
                                       runtime_gather_output=runtime_gather_output)
        depth_mask = all_mask.shifted(depth + 1)
        loss = model.compute_language_model_loss(all_labels.shifted(depth + 1), logits) * depth_mask
        MTPLosses.record(depth, depths, loss.sum(), depth_mask.sum())
        hidden_states = MTPLossAutoScaler.apply(hidden_states, scale * loss)
    logits, _ = model.output_layer(hidden_states, weight=output_weight, runtime_gather_output=runtime_gather_output)
    return model.compute_language_model_loss(labels, logits)
