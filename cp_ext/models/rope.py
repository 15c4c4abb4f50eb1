"""RoPE for the tokens a context-parallel rank actually holds.

megatron's `RotaryEmbedding` slices its table for CP with its own fixed layout
(zigzag over the whole CP group, `rope_utils.get_pos_emb_on_this_cp_rank`). cp_ext's
layout depends on the Ulysses x ring split, so this subclass takes the rows of the
full table at this rank's global positions, from the same function that shards the data.
"""

from functools import lru_cache

from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

from cp_ext import parallel_state as cp_state


class ContextParallelRotaryEmbedding(RotaryEmbedding):
    def __init__(self, *args, layout: str = "zigzag", **kwargs):
        super().__init__(*args, **kwargs)
        self.layout = layout

    @lru_cache(maxsize=32)
    def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False, cp_group=None):
        """[positions held here, 1, 1, dim] for a sequence of ``max_seq_len`` (the full length)."""
        if packed_seq:
            raise NotImplementedError("cp_ext does not support packed sequences")
        emb = self.get_emb(max_seq_len, offset)
        positions = cp_state.get_context_parallel_positions(max_seq_len, self.layout, device=emb.device)
        return emb.index_select(0, positions)
