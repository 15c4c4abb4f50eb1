"""RoPE for the tokens a context-parallel rank actually holds.

megatron's `RotaryEmbedding` slices its table for CP with its own fixed layout
(zigzag over the whole CP group, `rope_utils.get_pos_emb_on_this_cp_rank`). cp_ext's
layout depends on the Ulysses x ring split, so this subclass takes the rows of the
full table at this rank's global positions, from the same function that shards the data.

With --reset-position-ids (packed documents) positions restart at 0 after every EOD, so
the rows depend on the batch, not only on the layout. megatron's GPTModel never hands
position ids to RoPE (``self.rotary_pos_emb(rotary_seq_len, ...)`` in ``_preprocess``), so
`use_batch_position_ids` hooks the model: each forward hands its ``position_ids`` argument
to the rotary module, which then returns ``emb[position_ids]`` laid out [s_local, b, 1, dim]
(megatron's ``apply_rotary_pos_emb`` broadcasts it over the heads of [s, b, heads, dim]).
RoPE is computed once per forward in ``_preprocess``, outside checkpointed layers, so
activation recompute reuses it; pipeline middle stages get position ids too.
"""

from functools import lru_cache

import torch
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

from cp_ext import parallel_state as cp_state


class ContextParallelRotaryEmbedding(RotaryEmbedding):
    def __init__(self, *args, layout: str = "zigzag", **kwargs):
        super().__init__(*args, **kwargs)
        self.layout = layout
        self.position_ids = None  # [b, s_local] for this forward only (see use_batch_position_ids)

    def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False, cp_group=None):
        """[s_local, 1, 1, dim] at this rank's global positions of a ``max_seq_len`` sequence (the full
        length); [s_local, b, 1, dim] at the per-token ``self.position_ids`` when a hook set them."""
        if packed_seq:
            raise NotImplementedError("cp_ext does not support packed sequences")
        if self.position_ids is None:
            return self._at_global_positions(max_seq_len, offset)
        emb = self.get_emb(max_seq_len, offset)[:, 0, 0]  # [max_seq_len, dim]
        return emb[self.position_ids.t()].unsqueeze(2)

    @lru_cache(maxsize=32)
    def _at_global_positions(self, max_seq_len: int, offset: int):
        emb = self.get_emb(max_seq_len, offset)
        positions = cp_state.get_context_parallel_positions(max_seq_len, self.layout, device=emb.device)
        return emb.index_select(0, positions)


def use_batch_position_ids(model: torch.nn.Module) -> None:
    """RoPE of `model` (a GPTModel) at the position ids of each forward call instead of the global ones.

    The ids are the forward's second positional argument or its ``position_ids`` keyword; they
    are dropped again when the forward ends, so nothing outside a forward sees stale ones."""
    rotary = model.rotary_pos_emb

    def hand_over(module, args, kwargs):
        rotary.position_ids = args[1] if len(args) > 1 else kwargs.get("position_ids")

    def drop(module, args, kwargs, output):
        rotary.position_ids = None

    model.register_forward_pre_hook(hand_over, with_kwargs=True)
    model.register_forward_hook(drop, with_kwargs=True, always_call=True)


class RotaryAtContextParallelPositions(torch.nn.Module):
    """Any megatron rotary module (``RotaryEmbedding``, ``YarnRotaryEmbedding``) at this rank's positions.

    Modules that build their own RoPE (megatron's ``MLASelfAttention`` makes one for its 64-dim
    RoPE head, rope or YaRN) slice it with megatron's fixed CP layout. Wrapped, the module returns
    the rows of its full table (megatron does not slice for ``packed_seq``) at the global positions
    `cp_ext.parallel_state.get_context_parallel_positions` gives this rank, with whatever else it
    returns (YaRN's mscale) unchanged.

    ``decode_position``: a callable giving the global position of the token being decoded (the
    generation's cache, `cp_ext.inference.kv_cache`), or None while not decoding; then the row of
    that position is returned, whatever length the one-token forward asks for.
    """

    def __init__(self, inner: torch.nn.Module, layout: str = "zigzag"):
        super().__init__()
        self.inner, self.layout = inner, layout
        self.decode_position = lambda: None

    def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False, cp_group=None):
        if packed_seq:
            raise NotImplementedError("cp_ext does not support packed (thd) sequences")
        position = self.decode_position()
        length = max_seq_len if position is None else position + 1
        out = self.inner(length, offset, packed_seq=True)  # the whole table, unsliced
        emb, rest = (out[0], out[1:]) if isinstance(out, tuple) else (out, None)
        if position is None:
            positions = cp_state.get_context_parallel_positions(max_seq_len, self.layout, device=emb.device)
        else:
            positions = torch.tensor([position], device=emb.device)
        emb = emb.index_select(0, positions)
        return emb if rest is None else (emb, *rest)

    def get_rotary_seq_len(self, *args, **kwargs):
        return self.inner.get_rotary_seq_len(*args, **kwargs)

    def get_cached_cos_sin(self, *args, **kwargs):
        raise NotImplementedError("RoPE fusion (--apply-rope-fusion) is not supported with cp_ext's CP layouts")
