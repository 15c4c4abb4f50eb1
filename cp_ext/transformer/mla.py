"""megatron's Multi-Latent Attention with its RoPE at cp_ext's CP positions.

``MLASelfAttention`` (DeepSeek-V2/V3) builds its own rotary module for the shared RoPE key
(``qk_pos_emb_head_dim``, rope or YaRN with mscale) and lets it slice the table with megatron's
fixed zigzag-over-CP layout. cp_ext's layout depends on the Ulysses x ring split (and on
``--cp-load-balance``), so this subclass wraps that module (`cp_ext.models.rope.
RotaryAtContextParallelPositions`): every rank rotates its tokens at their true global
positions. The core attention seat is cp_ext's `CoreAttention`, which takes MLA's q/k and v head
dims (192 / 128 at DeepSeek-V3 size) on every CP type.
"""

from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.multi_latent_attention import MLASelfAttention

from cp_ext.models.rope import RotaryAtContextParallelPositions


class ContextParallelMLASelfAttention(MLASelfAttention):
    def __init__(self, config, submodules, layer_number, attn_mask_type=AttnMaskType.padding, cp_comm_type=None,
                 pg_collection=None):
        super().__init__(config, submodules, layer_number, attn_mask_type=attn_mask_type, cp_comm_type=cp_comm_type,
                         pg_collection=pg_collection)
        self.rotary_pos_emb = RotaryAtContextParallelPositions(self.rotary_pos_emb,
                                                               layout=getattr(config, "cp_layout", "zigzag"))
