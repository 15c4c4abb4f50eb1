"""How one microbatch of dynamic context parallelism reaches the layers: megatron's ``PackedSeqParams`` seat.

megatron-core 0.16-0.19 carry a per-microbatch CP group in ``PackedSeqParams.cp_group`` (with
``local_cp_size``), passed by ``GPTModel.forward`` to RoPE and every layer's attention, and captured by
megatron's activation recompute with the rest of the forward's arguments; TE's attention rebinds its CP
group from it. cp_ext's layers read the same seat: `DynamicCPParams` is a ``PackedSeqParams`` in the
``sbhd`` format (megatron's THD paths stay off) that also carries the microbatch's `DocumentZigzag`
layout (which positions of the group's documents this rank holds). ``local_cp_size`` stays None: megatron's
MLA asserts it is (0.16-0.19, "hybrid_context_parallel is not supported with MLA yet"), and cp_ext's MLA
runs on ``cp_group`` and the layout, with its RoPE at ``position_ids`` (`cp_ext.transformer.mla`).
``max_seqlen_q``/``kv`` are the longest document, which RoPE's table must cover (``get_rotary_seq_len``).

The MoE routers' load-balancing statistics are per microbatch too (`DynamicRouting`): each group's pack of
documents balances over the group's ranks, as a static CP group balances over megatron's ``tp_cp`` group,
and padding is left out of them (megatron's ``padding_mask``).
"""

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.packed_seq_params import PackedSeqParams

from cp_ext.token_partition import DocumentZigzag
from cp_ext.megatron_compat import ROUTER_SCALES_AUX_LOSS_BY_TP_CP


@dataclass
class DynamicCPParams(PackedSeqParams):
    """``layout``: the group's documents and this rank's share; ``router_group``: the group's ranks x TP (where
    the routers reduce); ``padding_mask``: [1, this rank's tokens], True at padding; ``valid_tokens``: the
    group's tokens that are not padding (0: an idle rank's padding microbatch); ``position_ids``: [1, this
    rank's tokens], each token's position in its document (RoPE's row for layers that build their own: MLA)."""

    layout: Optional[DocumentZigzag] = None
    router_group: Optional[dist.ProcessGroup] = None
    padding_mask: Optional[torch.Tensor] = None
    valid_tokens: int = 0
    position_ids: Optional[torch.Tensor] = None

    @classmethod
    def for_group(cls, group: Optional[dist.ProcessGroup], layout: DocumentZigzag, router_group=None,
                  padding_mask=None, valid_tokens: int = 0, position_ids=None) -> "DynamicCPParams":
        longest = max(layout.lengths)
        return cls(qkv_format="sbhd", max_seqlen_q=longest, max_seqlen_kv=longest, cp_group=group, layout=layout,
                   router_group=router_group, padding_mask=padding_mask, valid_tokens=valid_tokens,
                   position_ids=position_ids)

    @property
    def size(self) -> int:
        return self.layout.size

    def positions(self, device=None):
        """The positions (in the group's sequence) this rank holds."""
        rank = dist.get_rank(self.cp_group) if self.cp_group is not None else 0
        return self.layout.positions(rank, device=device)


def dynamic_params(packed_seq_params) -> Optional[DynamicCPParams]:
    """``packed_seq_params`` when it is dynamic CP's; None when absent; NotImplementedError for any other
    (cp_ext's attention runs no THD packing: packed documents are ``--reset-attention-mask``'s ids)."""
    if packed_seq_params is None or isinstance(packed_seq_params, DynamicCPParams):
        return packed_seq_params
    raise NotImplementedError("cp_ext attention takes packed documents as document ids (--reset-attention-mask), "
                              "not megatron's THD PackedSeqParams")


class DynamicRouting:
    """Points every MoE router of ``model`` at this microbatch's group, with its loss strengths.

    megatron's router reduces its expert counts over ``tp_cp_group``; here that is the microbatch's block of
    ranks x TP (`cp_ext.parallel_state.get_dynamic_router_group`), so a group's pack balances its experts as one
    process running that pack does. Under the per-token loss the router then weights each rank's partial loss
    by a token count (times the group's size from 0.19), and the coefficients undo what that does beyond one
    process's weighting (measured against it, tests/training/test_dynamic_cp.py):

    * aux loss: with megatron's ``padding_mask`` the count it uses is the group's valid tokens (the expert
      counts are all-reduced in place before they are summed, moe_utils.get_tokens_per_expert_and_token_count),
      already one process's count: coefficient x 1, or / the group's size on 0.19;
    * z loss, a plain sum over tokens: its coefficient is divided by the group's size and the count is the
      rank's own, as under static CP: x the group's size (`cp_ext.config.aux_loss_layout_factor`), 1 on 0.19.

    A padding microbatch adds neither loss; a rank whose share of a group is all padding adds no z loss
    (megatron's mean over no tokens). The settings stay until the next microbatch's forward, so a full recompute
    in this microbatch's backward sees them too (full recompute is refused under pipelining, which
    runs later forwards first)."""

    def __init__(self, model, config):
        from megatron.core.transformer.moe.router import TopKRouter

        self.config = config
        self.routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
        self.aux, self.z = config.moe_aux_loss_coeff, config.moe_z_loss_coeff  # the flags' values

    def apply(self, params: DynamicCPParams):
        if not self.routers:
            return
        group_size = params.router_group.size()
        aux_factor, z_factor = (1 / group_size, 1) if ROUTER_SCALES_AUX_LOSS_BY_TP_CP else (1, group_size)
        if params.valid_tokens == 0:  # a padding microbatch (its group: this rank's TP ranks, idle together)
            aux_factor = 0
        if self.local_valid_tokens(params.padding_mask) == 0:  # the aux loss still runs: its all-reduce
            z_factor = None
        self.config.moe_aux_loss_coeff = _scaled(self.aux, aux_factor)
        self.config.moe_z_loss_coeff = None if self.z is None or z_factor is None else self.z * z_factor
        for router in self.routers:
            router.tp_cp_group = params.router_group

    def local_valid_tokens(self, padding_mask) -> int:
        """The valid tokens this rank's routers see: its share, or with sequence parallelism its TP rank's
        contiguous slice of it (megatron's ``scatter_to_sequence_parallel_region``)."""
        mask = padding_mask.reshape(-1)
        if self.config.sequence_parallel:
            tp, rank = parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_rank()
            step = mask.numel() // tp
            mask = mask[rank * step:(rank + 1) * step]
        return int((~mask).sum())


def _scaled(coeff, factor):
    if isinstance(coeff, (list, tuple)):  # one per --moe-router-load-balancing-type
        return type(coeff)(c * factor for c in coeff)
    return coeff * factor
