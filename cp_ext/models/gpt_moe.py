"""The MoE GPT: megatron-core's `GPTModel` assembled from a layer spec that cp_ext owns.

The spec is megatron's local (non-TE) GPT layer spec with three seats re-filled:

    TransformerLayer
      input_layernorm    -> cp_ext SequenceParallelNorm        (SP without apex/TE)
      self_attention     -> megatron SelfAttention (RoPE, GQA), or with --multi-latent-attention
                            cp_ext ContextParallelMLASelfAttention (megatron's MLA: its RoPE at
                            this rank's positions, the latent exchange)
        core_attention   -> cp_ext CoreAttention               (local today; CP-aware later)
      pre_mlp_layernorm  -> cp_ext SequenceParallelNorm
      mlp                -> megatron MoELayer (TopKRouter + SequentialMLP experts)
    final_layernorm      -> cp_ext SequenceParallelNorm
    rotary_pos_emb       -> cp_ext ContextParallelRotaryEmbedding (RoPE at global positions;
                            at the batch's per-document positions with --reset-position-ids)

Weights are initialized *layout-invariantly*: each parameter's full (unsharded)
tensor is drawn from a generator seeded by (seed, the parameter's global checkpoint
key), and each rank keeps its slice. The global key and the slice come from
megatron's own `sharded_state_dict()`, the same map its checkpoints use, so the same
``--seed`` builds the same model on any TP x PP x EP x CP grid.
"""

import hashlib
import math

import torch

from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_config import TransformerConfig

from cp_ext.models.layout import iter_global_slices
from cp_ext.models.rope import ContextParallelRotaryEmbedding, use_batch_position_ids
from cp_ext.transformer.attention import CoreAttention
from cp_ext.transformer.norms import SequenceParallelNorm


def get_layer_spec(config: TransformerConfig) -> ModuleSpec:
    """One transformer layer as data: megatron's local spec with cp_ext's norms and attention
    (with ``multi_latent_attention``, megatron's MLA spec with cp_ext's MLA seat: its RoPE at this
    rank's positions and the latent exchange, `cp_ext.transformer.mla`)."""
    mla = getattr(config, "multi_latent_attention", False)
    spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, normalization=config.normalization,
                                    multi_latent_attention=mla, qk_layernorm=config.qk_layernorm)
    layer = spec.submodules
    layer.input_layernorm = SequenceParallelNorm
    layer.pre_mlp_layernorm = SequenceParallelNorm
    if config.qk_layernorm:  # megatron's local norm refuses SP; finalize_model_grads sums these over TP
        attention = layer.self_attention.submodules
        attention.q_layernorm = SequenceParallelNorm
        if mla:
            attention.kv_layernorm = SequenceParallelNorm
        else:
            attention.k_layernorm = SequenceParallelNorm
    if mla:
        from cp_ext.transformer.mla import ContextParallelMLASelfAttention  # (it imports cp_ext.models.rope)

        layer.self_attention.module = ContextParallelMLASelfAttention
    layer.self_attention.submodules.core_attention = CoreAttention
    return spec


def get_block_spec(config: TransformerConfig) -> TransformerBlockSubmodules:
    """The decoder block of this pipeline stage: its layers and the final norm."""
    num_layers = get_num_layers_to_build(config)
    return TransformerBlockSubmodules(layer_specs=[get_layer_spec(config)] * num_layers, layer_norm=SequenceParallelNorm)


def build_model(config: TransformerConfig, args, padded_vocab_size: int, pre_process=None, post_process=None) -> GPTModel:
    """This rank's stage of the GPT, initialized from ``args.seed`` independent of the grid."""
    if pre_process is None:
        pre_process = parallel_state.is_pipeline_first_stage()
    if post_process is None:
        post_process = parallel_state.is_pipeline_last_stage()
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_block_spec(config),
        vocab_size=padded_vocab_size,
        max_sequence_length=args.seq_length,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type="rope",
        rotary_base=args.rotary_base,
    )
    if not config.multi_latent_attention:  # (MLA's layers rotate their own RoPE key, at the same positions)
        # The same RoPE table, sliced at the global positions this CP rank holds.
        model.rotary_pos_emb = ContextParallelRotaryEmbedding(
            kv_channels=config.kv_channels, rotary_percent=1.0, rotary_base=args.rotary_base,
            rotary_interleaved=config.rotary_interleaved, layout=config.cp_layout,
        )
    if args.reset_position_ids:  # packed documents: RoPE at the batch's per-document positions
        use_batch_position_ids(model)
    init_weights_layout_invariant(model, seed=args.seed, init_method_std=config.init_method_std, num_layers=config.num_layers)
    return model


def _key_seed(seed: int, key: str) -> int:
    digest = hashlib.sha256(f"{seed}:{key}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _init_full_tensor(key: str, unit: str, shape, seed: int, std: float, num_layers: int) -> torch.Tensor:
    """The full tensor of one unit (see cp_ext.models.layout), drawn as megatron's default init would.

    `key` (the checkpoint key) decides the distribution; `unit` seeds the generator.
    """
    name = key.rsplit(".", 1)[-1]
    if "norm" in name and name.endswith("weight") or key.endswith("norm.weight"):
        return torch.ones(shape)
    if name.endswith("bias"):
        return torch.zeros(shape)
    generator = torch.Generator().manual_seed(_key_seed(seed, unit))
    if key.endswith(("linear_proj.weight", "linear_fc2.weight")):
        std = std / math.sqrt(2.0 * num_layers)  # megatron's scaled output-layer init
    return torch.randn(shape, generator=generator) * std


@torch.no_grad()
def init_weights_layout_invariant(model: torch.nn.Module, seed: int, init_method_std: float, num_layers: int) -> None:
    """Fill every parameter with its slice of a full tensor seeded by (seed, global key).

    Raises if any parameter is not covered, so a new module type cannot silently keep
    a layout-dependent init.
    """
    params = {id(p): name for name, p in model.named_parameters()}
    covered = set()
    last_unit, last_full = None, None
    for piece in iter_global_slices(model):
        # One layer's (one expert's) tensor is the unit we draw, so no rank ever
        # materializes a whole stack of layers or experts.
        if piece.unit != last_unit:
            last_unit = piece.unit
            last_full = _init_full_tensor(piece.key, piece.unit, piece.unit_shape, seed, init_method_std, num_layers)
        piece.local.copy_(last_full[piece.index].to(piece.local.dtype))
        base = piece.local._base if piece.local._base is not None else piece.local
        covered.update((id(base), id(piece.local)))
    missing = [name for pid, name in params.items() if pid not in covered]
    if missing:
        raise RuntimeError(f"layout-invariant init does not cover parameters: {missing}")
