"""The MoE GPT: megatron-core's `GPTModel` from megatron's own decoder block spec, cp_ext's parts in its seats.

`get_gpt_decoder_block_spec` (megatron's local, non-TE modules) decides each layer from the config:
MoE or dense by ``moe_layer_freq`` (dense-first layers), shared experts, MLA, qk-norm, biases,
the activation. cp_ext then fills the seats it owns, in every layer spec:

    TransformerLayer
      input_layernorm    -> cp_ext SequenceParallelNorm        (SP without apex/TE)
      self_attention     -> megatron SelfAttention (RoPE, GQA), or with --multi-latent-attention
                            cp_ext ContextParallelMLASelfAttention (megatron's MLA: its RoPE at
                            this rank's positions, the latent exchange)
        q/k(v)_layernorm -> cp_ext SequenceParallelNorm        (--qk-layernorm; megatron's refuses SP)
        core_attention   -> cp_ext CoreAttention               (every CP type, windows, sinks), or with
                            --experimental-attention-variant dsa cp_ext DSACoreAttention (megatron's
                            DSA seat: indexer + sparse attention, `cp_ext.transformer.dsa`)
      pre_mlp_layernorm  -> cp_ext SequenceParallelNorm
      mlp                -> megatron MoELayer (TopKRouter, SequentialMLP experts, shared experts) or MLP
        experts.linear_fc1 -> cp_ext ExpertColumnParallelLinear (expert-TP != TP: reduced over expert-DP)
        experts.linear_fc2 -> cp_ext ExpertRowParallelLinear    (that, and biased experts: GPT-OSS)
      self_attention with --experimental-attention-variant dsv4_hybrid -> cp_ext CompressedAttention
                         (DeepSeek-V4's sliding, CSA or HCA layer by --csa-compress-ratios, every CP type:
                         `cp_ext.transformer.compressed_attention`)
      self_attention on the layers --linear-attention-freq marks linear (--experimental-attention-variant
                         gated_delta_net) -> cp_ext GatedDeltaNet (megatron 0.19's parameters, CP by state
                         passing: `cp_ext.transformer.gated_delta_net`), or (kda) cp_ext KimiDeltaAttention
                         (Kimi-Linear, `cp_ext.transformer.kimi_delta_attention`), in a copy of that layer's spec
    (--enable-hyper-connections: each layer cp_ext HyperConnectionTransformerLayer, megatron's layer with the mHC
                            stream mixings in place of its residual adds: `cp_ext.transformer.hyper_connections`)
    final_layernorm      -> cp_ext SequenceParallelNorm (with hyper-connections and MTP: StreamsFinalNorm, applied
                            after the MTP layers have read the streams)
    mtp.layers (--mtp-num-layers) -> cp_ext ContextParallelMTPLayer (megatron's, its shifts across CP
                            shards), its norms SequenceParallelNorm, its layer the last one's seats
                            (`cp_ext.models.mtp`); with hyper-connections HyperConnectionMTPLayer (DeepSeek-V4's:
                            per stream, its own head); V4's MTP layers of the kinds --csa-compress-ratios gives them

`ContextParallelGPTModel` is megatron's GPTModel whose RoPE (rope or YaRN, with every option
megatron built it with) returns the rows at this CP rank's global positions, or at the batch's
per-document positions with --reset-position-ids (`cp_ext.transformer.rope`). Learned absolute
positions need nothing: the batch already carries each token's global position id.

Weights are initialized *layout-invariantly*: each parameter's full (unsharded)
tensor is drawn from a generator seeded by (seed, the parameter's global checkpoint
key), and each rank keeps its slice. The global key and the slice come from
megatron's own `sharded_state_dict()`, the same map its checkpoints use, so the same
``--seed`` builds the same model on any TP x PP x EP x CP grid.
"""

import copy
import hashlib
import math

import torch

from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group

from cp_ext.megatron_compat import quiet_gpt_model_deprecation, spec_parts
from cp_ext.models.parameter_slices import iter_global_slices
from cp_ext.models.mtp import get_mtp_block_spec, postprocess_with_mtp
from cp_ext.transformer.rope import RotaryAtContextParallelPositions
from cp_ext.transformer.attention import CoreAttention
from cp_ext.transformer.compressed_attention import CompressedAttention
from cp_ext.transformer.hyper_connections import HyperConnectionTransformerLayer, StreamsFinalNorm
from cp_ext.transformer.router import DeepSeekV4Router
from cp_ext.transformer.dsa import dsa_core_attention_spec
from cp_ext.transformer.dynamic_cp import DynamicCPParams, DynamicRouting
from cp_ext.transformer.gated_delta_net import GatedDeltaNet
from cp_ext.transformer.kimi_delta_attention import KimiDeltaAttention, dt_bias_init
from cp_ext.transformer.experts import ExpertColumnParallelLinear, ExpertRowParallelLinear
from cp_ext.transformer.mla import ContextParallelMLASelfAttention
from cp_ext.transformer.norms import SequenceParallelNorm

quiet_gpt_model_deprecation()  # megatron 0.19's notice; cp_ext builds GPTModel on purpose (megatron_compat, row 10)


def fill_seats(layer: ModuleSpec, config: TransformerConfig) -> ModuleSpec:
    """cp_ext's norms and attention in the seats of one of megatron's layer specs (in place)."""
    mla = getattr(config, "multi_latent_attention", False)
    submodules = layer.submodules
    submodules.input_layernorm = SequenceParallelNorm
    submodules.pre_mlp_layernorm = SequenceParallelNorm
    attention = submodules.self_attention.submodules
    if config.qk_layernorm:  # megatron's local norm refuses SP; finalize_model_grads sums these over TP
        if mla:
            attention.kv_layernorm = SequenceParallelNorm
            # MLA normalizes the compressed query, which only q-LoRA has (DeepSeek-V2-Lite has none):
            # 0.16.1 never builds a q norm without it, and 0.19's norm resolver refuses one.
            attention.q_layernorm = SequenceParallelNorm if config.q_lora_rank is not None else IdentityOp
        else:
            attention.q_layernorm = attention.k_layernorm = SequenceParallelNorm
    if mla:
        submodules.self_attention.module = ContextParallelMLASelfAttention
    attention.core_attention = dsa_core_attention_spec() if getattr(config, "dsa", False) else CoreAttention
    _, mlp = spec_parts(submodules.mlp)
    experts_class, experts = spec_parts(getattr(mlp, "experts", None))  # MoE layers only
    if getattr(config, "router_score_function", "softmax") == "sqrtsoftplus" or getattr(config, "moe_n_hash_layers", 0):
        if mlp is not None and hasattr(mlp, "router"):  # MoE layers: DeepSeek-V4's score and hash routing
            mlp.router = DeepSeekV4Router
    if experts_class is SequentialMLP:
        # biased experts add their bias once, in place; expert-TP != TP reduces over expert-DP on every release
        experts.linear_fc1, experts.linear_fc2 = ExpertColumnParallelLinear, ExpertRowParallelLinear
    return layer


def get_decoder_block_spec(config: TransformerConfig, linear_layers: bool = True) -> TransformerBlockSubmodules:
    """This pipeline stage's layers and final norm: megatron's decoder block spec with cp_ext's seats, and
    Gated DeltaNet on the layers the linear-attention pattern marks (``linear_layers``; the MTP block takes
    its layer from the block without them: its attention is softmax attention)."""
    block = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization=config.normalization)
    for layer in {id(spec): spec for spec in block.layer_specs}.values():  # the dense and the MoE spec
        fill_seats(layer, config)
    block.layer_norm = SequenceParallelNorm
    if linear_layers and getattr(config, "linear_attention_variant", None):
        block.layer_specs = with_linear_attention(block.layer_specs, config)
    if getattr(config, "dsv4_layer_kinds", None):
        block.layer_specs = with_compressed_attention(block.layer_specs, config)
    if getattr(config, "enable_hyper_connections", False):
        block.layer_specs = [_with_module(spec, HyperConnectionTransformerLayer) for spec in block.layer_specs]
        if config.mtp_num_layers:  # the streams go on to MTP; the model collapses and norms them after it
            block.layer_norm = StreamsFinalNorm
    return block


def _with_module(spec: ModuleSpec, module) -> ModuleSpec:
    spec = copy.copy(spec)
    spec.module = module
    return spec


def with_compressed_attention(local_specs, config: TransformerConfig):
    """This stage's layer specs with DeepSeek-V4's attention (`cp_ext.transformer.compressed_attention`) in every
    self-attention seat, each layer of its kind in ``config.dsv4_layer_kinds`` (sliding, CSA, HCA)."""
    offset = get_transformer_layer_offset(config)
    out = []
    for local, spec in enumerate(local_specs):
        spec = copy.copy(spec)
        spec.submodules = copy.copy(spec.submodules)
        spec.submodules.self_attention = ModuleSpec(module=CompressedAttention,
                                                    params={"kind": config.dsv4_layer_kinds[offset + local]})
        out.append(spec)
    return out


LINEAR_ATTENTION_MODULES = {"gated_delta_net": GatedDeltaNet, "kda": KimiDeltaAttention}


def with_linear_attention(local_specs, config: TransformerConfig):
    """This stage's layer specs with ``config.linear_attention_variant``'s module (`LINEAR_ATTENTION_MODULES`) in the
    self-attention seat of the linear layers (megatron's `get_linear_attention_pattern`: ``linear_attention_freq`` N
    makes layer i linear unless (i + 1) % N == 0; a list marks them 1). Each linear layer gets its own copy of the
    spec, the MLP seat (MoE or dense) shared."""
    module = LINEAR_ATTENTION_MODULES[config.linear_attention_variant]
    freq, layers = config.linear_attention_freq, config.num_layers
    pattern = [0 if (i + 1) % freq == 0 else 1 for i in range(layers)] if isinstance(freq, int) else list(freq)
    offset = get_transformer_layer_offset(config)
    out = []
    for local, spec in enumerate(local_specs):
        if pattern[offset + local]:
            spec = copy.copy(spec)
            spec.submodules = copy.copy(spec.submodules)
            spec.submodules.self_attention = ModuleSpec(module=module)
        out.append(spec)
    return out


class ContextParallelGPTModel(GPTModel):
    """megatron's GPTModel with RoPE at the positions this CP rank holds (see the module doc).

    ``batch_position_ids``: RoPE at each forward's ``position_ids`` (--reset-position-ids) instead of
    the layout's global positions."""

    def __init__(self, config: TransformerConfig, *, cp_layout: str, batch_position_ids: bool = False, **kwargs):
        super().__init__(config, **kwargs)
        self.batch_position_ids = batch_position_ids
        self._dynamic_routing = None  # built at the first dynamic-CP microbatch (`cp_ext.transformer.dynamic_cp`)
        if self.mtp_process and self.post_process and not self.pre_process and self.share_embeddings_and_output_weights:
            # The MTP stage's output head reads the tied weight from its copy of the embedding
            # (`shared_embedding_or_output_weight`), so megatron-core 0.16.1 allocates an output weight that
            # nothing uses, and its sharded_state_dict then asserts there is none: drop it, as megatron
            # does on a stage that embeds.
            self.output_layer.weight = None
        if hasattr(self, "rotary_pos_emb"):  # rope or yarn (MLA's layers rotate their own key)
            self.rotary_pos_emb = RotaryAtContextParallelPositions(self.rotary_pos_emb, layout=cp_layout)

    def forward(self, input_ids, position_ids, attention_mask, *args, **kwargs):
        dynamic = kwargs.get("packed_seq_params")
        if isinstance(dynamic, DynamicCPParams):  # dynamic CP: the routers balance over this microbatch's group
            if self._dynamic_routing is None:
                self._dynamic_routing = DynamicRouting(self, self.config)
            self._dynamic_routing.apply(dynamic)
            kwargs["padding_mask"] = dynamic.padding_mask
        self.route_by_token_ids(input_ids)
        rotary = getattr(self, "rotary_pos_emb", None)
        if rotary is None or not self.batch_position_ids:
            return super().forward(input_ids, position_ids, attention_mask, *args, **kwargs)
        rotary.position_ids = position_ids
        try:
            return super().forward(input_ids, position_ids, attention_mask, *args, **kwargs)
        finally:
            rotary.position_ids = None  # nothing outside a forward sees stale ones

    def route_by_token_ids(self, input_ids) -> None:
        """Hand this stage's hash-routed MoE layers (DeepSeek-V4's) the ids [b, s] of the tokens it runs: the forward
        does it; a generator's decode step, which calls the embedding and the decoder itself, does it too."""
        if not hasattr(self, "_hash_routers"):
            self._hash_routers = [m for m in self.modules() if isinstance(m, DeepSeekV4Router) and m.is_hash]
        for router in self._hash_routers:
            router.set_token_ids(input_ids)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None):
        # megatron-core 0.16.1's GPTModel reads metadata["dp_cp_group"] on an MTP stage that does not embed
        # (PP > 1) where only its parent fills the default in: fill it first, as every caller may pass none.
        return super().sharded_state_dict(prefix, sharded_offsets, ensure_metadata_has_dp_cp_group(metadata))

    def _postprocess(self, hidden_states, **kwargs):
        if self.config.mtp_num_layers is None:
            return super()._postprocess(hidden_states, **kwargs)
        return postprocess_with_mtp(self, hidden_states, **kwargs)  # the label / mask shift across CP shards


def build_model(config: TransformerConfig, args, padded_vocab_size: int, pre_process=None, post_process=None,
                initialize=True) -> GPTModel:
    """This rank's stage of the GPT, initialized from ``args.seed`` independent of the grid (``initialize``;
    a model built on the meta device for its checkpoint map, `cp_ext.hf.streaming`, skips it)."""
    if pre_process is None:
        pre_process = parallel_state.is_pipeline_first_stage()
    if post_process is None:
        post_process = parallel_state.is_pipeline_last_stage()
    config.padded_vocab_size = padded_vocab_size  # the hash routers' token range
    decoder_block = get_decoder_block_spec(config)
    model = ContextParallelGPTModel(
        config=config,
        cp_layout=config.cp_layout,
        # packed documents, and dynamic CP's documents: RoPE at per-document positions
        batch_position_ids=args.reset_position_ids or getattr(args, "dynamic_context_parallel", False),
        transformer_layer_spec=decoder_block,
        # None without --mtp-num-layers; its layer is the last decoder layer's with softmax attention
        mtp_block_spec=get_mtp_block_spec(config, get_decoder_block_spec(config, linear_layers=False), fill_seats),
        vocab_size=padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base,
        rope_scaling=args.use_rope_scaling,
        rope_scaling_factor=args.rope_scaling_factor,
        seq_len_interpolation_factor=args.rotary_seq_len_interpolation_factor,
    )
    if initialize:
        init_weights_layout_invariant(model, seed=args.seed, init_method_std=config.init_method_std,
                                      num_layers=config.num_layers,
                                      zero_centered_norms=config.layernorm_zero_centered_gamma,
                                      linear_attention_variant=getattr(config, "linear_attention_variant", None))
    return model


def _key_seed(seed: int, key: str) -> int:
    digest = hashlib.sha256(f"{seed}:{key}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _init_full_tensor(key: str, unit: str, shape, seed: int, std: float, num_layers: int,
                      zero_centered_norms: bool = False, linear_attention_variant=None) -> torch.Tensor:
    """The full tensor of one unit (see cp_ext.models.parameter_slices), drawn as megatron's default init would.

    `key` (the checkpoint key) decides the distribution; `unit` seeds the generator. Norm weights start at
    1, or 0 where the norm scales by 1 + weight (``zero_centered_norms``, --apply-layernorm-1p). Gated
    DeltaNet's as megatron's GDN: ``dt_bias`` 1, ``A_log`` = log U(1, 16), the depthwise conv torch's default
    U(-1/sqrt(taps), 1/sqrt(taps)). Kimi Delta Attention's (``linear_attention_variant`` "kda") as FLA's and
    Megatron-LM's: ``A_log`` the same, ``dt_bias`` per head and key channel softplus^-1 of a log-uniform step in
    [1e-3, 0.1] (`cp_ext.transformer.kimi_delta_attention.dt_bias_init`).
    """
    name = key.rsplit(".", 1)[-1]
    if "norm" in name and name.endswith("weight") or key.endswith("norm.weight"):
        return torch.zeros(shape) if zero_centered_norms else torch.ones(shape)
    generator = torch.Generator().manual_seed(_key_seed(seed, unit))
    if name == "dt_bias" and linear_attention_variant == "kda":
        return dt_bias_init(torch.rand(shape, generator=generator))
    if name == "mix_scale":  # hyper-connections' scales start at 1 (transformers' DeepSeek-V4)
        return torch.ones(shape)
    if name.endswith("bias") or name == "dt_bias":
        return torch.ones(shape) if name == "dt_bias" else torch.zeros(shape)
    if name == "A_log":
        return torch.empty(shape).uniform_(1, 16, generator=generator).log()
    if ".conv1d.weight" in key:
        bound = 1 / math.sqrt(shape[-1])  # fan-in of a depthwise conv: its taps
        return torch.empty(shape).uniform_(-bound, bound, generator=generator)
    if key.endswith(("linear_proj.weight", "linear_fc2.weight", "out_proj.weight")):
        std = std / math.sqrt(2.0 * num_layers)  # megatron's scaled output-layer init
    return torch.randn(shape, generator=generator) * std


@torch.no_grad()
def init_weights_layout_invariant(model: torch.nn.Module, seed: int, init_method_std: float, num_layers: int,
                                  zero_centered_norms: bool = False, linear_attention_variant=None) -> None:
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
            last_full = _init_full_tensor(piece.key, piece.unit, piece.unit_shape, seed, init_method_std, num_layers,
                                          zero_centered_norms, linear_attention_variant)
        piece.local.copy_(last_full[piece.index].to(piece.local.dtype))
        base = piece.local._base if piece.local._base is not None else piece.local
        covered.update((id(base), id(piece.local)))
    missing = [name for pid, name in params.items() if pid not in covered]
    if missing:
        raise RuntimeError(f"layout-invariant init does not cover parameters: {missing}")
