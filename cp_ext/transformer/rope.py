"""RoPE for the tokens a context-parallel rank actually holds.

megatron's rotary modules (``RotaryEmbedding``, ``YarnRotaryEmbedding``) slice their table for CP
with megatron's own fixed layout (zigzag over the whole CP group,
`rope_utils.get_pos_emb_on_this_cp_rank`). cp_ext's layout depends on the Ulysses x ring split,
so `RotaryAtContextParallelPositions` wraps the module megatron built (with every RoPE option it
was given: --rotary-percent, --rotary-interleaved, interpolation, Llama-3 scaling, YaRN) and returns
the rows of its full table at this rank's global positions, from the same function that shards
the data.

With --reset-position-ids (packed documents) positions restart at 0 after every EOD, so the rows
depend on the batch, not only on the layout: the model (`cp_ext.models.gpt_moe.ContextParallelGPTModel`)
hands each forward's ``position_ids`` to the wrapper, which then returns ``emb[position_ids]`` laid
out [s_local, b, 1, dim] (megatron's ``apply_rotary_pos_emb`` broadcasts it over the heads). RoPE is
computed once per forward in ``_preprocess``, outside checkpointed layers, so activation recompute
reuses it; pipeline middle stages get position ids too.
"""

import torch

from cp_ext import parallel_state as cp_state


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
        self.position_ids = None  # [b, s_local] for one forward only (set by the model, see the module doc)

    def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False, cp_group=None):
        if packed_seq:
            raise NotImplementedError("cp_ext does not support packed (thd) sequences")
        position = self.decode_position()
        if position is not None:
            return self.at_positions(torch.tensor([position]), position + 1)
        if self.position_ids is not None:  # [s_local, b, 1, dim]: per token of the batch
            return self.at_positions(self.position_ids.t(), max_seq_len, offset)
        positions = cp_state.get_context_parallel_positions(max_seq_len, self.layout)
        return self.at_positions(positions, max_seq_len, offset)

    def at_positions(self, positions: torch.Tensor, table_length: int, offset: int = 0):
        """The full table's rows at global `positions` (any shape P: [*P, 1, dim] per row), with whatever
        else the module returns (YaRN's mscale) unchanged."""
        out = self.inner(table_length, offset, packed_seq=True)  # the whole table, unsliced
        emb, rest = (out[0], out[1:]) if isinstance(out, tuple) else (out, None)
        emb = emb[:, 0, 0][positions.to(emb.device)].unsqueeze(-2)
        if positions.dim() == 1:
            emb = emb.unsqueeze(1)  # [s, 1, 1, dim], as megatron's own
        return emb if rest is None else (emb, *rest)

    def get_rotary_seq_len(self, *args, **kwargs):
        return self.inner.get_rotary_seq_len(*args, **kwargs)

    def get_cached_cos_sin(self, *args, **kwargs):
        raise NotImplementedError("RoPE fusion (--apply-rope-fusion) is not supported with cp_ext's CP layouts")
