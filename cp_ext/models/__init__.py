"""cp_ext's GPT/MoE model: megatron-core's GPTModel built from a cp_ext layer spec."""

from cp_ext.models.gpt_moe import build_model, get_decoder_block_spec, init_weights_layout_invariant

__all__ = ["build_model", "get_decoder_block_spec", "init_weights_layout_invariant"]
