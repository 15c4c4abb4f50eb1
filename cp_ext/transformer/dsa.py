"""DeepSeek-V3.2's sparse attention (DSA) in megatron's DSA seat, under every CP layout cp_ext runs it on.

megatron-core's DSA is MLA whose core attention is a `DSAttention` with a lightning indexer
(`DSAIndexer`: ``linear_wq_b``, ``linear_wk``, ``k_norm``, ``linear_weights_proj``). cp_ext keeps that
seat and those parameter names (so checkpoints are megatron's), and replaces what is O(s^2) or CP-blind:

    MLA (cp_ext.transformer.mla.ContextParallelMLASelfAttention: RoPE at this rank's positions)
      core_attention -> DSACoreAttention
        indexer      -> ContextParallelDSAIndexer (megatron's DSAIndexer's parameters; its scores tiled,
                        `cp_ext.attention.dsa.indexer.indexer_topk`, on the ring or all-gathered)
        the sparse core: MLA's MQA mode over the latent (`cp_ext.attention.dsa.sparse_attention`), the indexer loss
                        (`cp_ext.attention.dsa.indexer_loss`), both on the same ring / all-gather

**What differs from megatron-core, on purpose.**
* The indexer's RoPE: DeepSeek's release (and megatron-core 0.19) rotates the first
  ``qk_pos_emb_head_dim`` values of each indexer head, non-interleaved; megatron-core 0.16.1 rotates the
  last ones, MLA-interleaved. cp_ext does the release's on every megatron-core, so a checkpoint means the
  same model everywhere.
* No Hadamard rotation (megatron's ``rotate_activation``, which needs the fast_hadamard_transform
  package and bf16): it is orthogonal and applied to both q and k, so it leaves every q . k, and so
  every score, unchanged.
* megatron's ``experimental_attention_variant`` stays None on the TransformerConfig: 0.16.1's refuses it
  with CP > 1, and 0.19's layer-spec and norm builders swap in their own modules when it is set. The
  choice is cp_ext's ``config.dsa`` (``--experimental-attention-variant dsa``), and the MLA module hands
  the core the layer's input and compressed query (`DSACoreAttention.take_inputs`), which megatron passes
  as ``x`` and ``qr`` only when its own field is set.
* The indexer loss is attached as megatron does (`DSAIndexerLossAutoScaler`), as the sum of this rank's
  queries' KL times the coefficient: under the per-token loss cp_ext trains with (``calculate_per_token_loss``)
  megatron divides every gradient by the global batch's token count, as megatron-core 0.19 does for DSA.
"""

import math

import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from megatron.core.transformer.experimental_attention_variant.dsa import (
    DSAIndexer, DSAIndexerLossAutoScaler, DSAIndexerSubmodules, DSAttentionSubmodules,
)
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module

from cp_ext.transformer.rope import RotaryAtContextParallelPositions


def _decoding_position(core):
    """While a generation decodes, the global position of the token being decoded; else None."""
    cache = core.kv_cache
    return cache.position if cache is not None and cache.decoding else None


class DuplicatedLinear(torch.nn.Module):
    """A linear layer every TP rank holds whole (megatron's ``parallel_mode="duplicated"``), with the
    signature megatron's specs build linears with; returns (output, None) like megatron's linears.
    megatron's local backend has none (only TransformerEngine's ``TELinear``)."""

    def __init__(self, input_size, output_size, *, config, init_method, bias=False, skip_bias_add=False,
                 skip_weight_param_allocation=False, parallel_mode="duplicated", **_):
        super().__init__()
        if bias or parallel_mode != "duplicated" or skip_weight_param_allocation:
            raise ValueError("DuplicatedLinear is a bias-free linear that every TP rank holds whole")
        self.weight = torch.nn.Parameter(torch.empty(output_size, input_size, dtype=config.params_dtype))
        if config.perform_initialization:
            init_method(self.weight)

    def forward(self, x):
        return torch.nn.functional.linear(x, self.weight), None


class IndexerKeyNorm:
    """The indexer key's LayerNorm (megatron builds it as LayerNorm whatever ``--normalization`` says), a
    class because megatron's build_module hands functions back uncalled. Not marked sequence-parallel:
    every TP rank normalises the whole (gathered) sequence, so its gradient is whole on each."""

    def __new__(cls, config, hidden_size, eps=1e-5):
        return torch.nn.LayerNorm(hidden_size, eps=eps, dtype=config.params_dtype)


def _rotate(x, emb, mscale):
    """Non-interleaved RoPE of ``x`` [s, b, *, p] by ``emb`` [s, 1, 1, p] (rotate-half, YaRN's mscale)."""
    cos, sin = (torch.cos(emb) * mscale).to(x.dtype), (torch.sin(emb) * mscale).to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class ContextParallelDSAIndexer(DSAIndexer):
    """megatron's indexer parameters; `index_inputs` is its projection at this rank's positions."""

    def __init__(self, config, submodules, pg_collection=None):
        super().__init__(config, submodules, pg_collection=pg_collection)
        self.rotary_pos_emb = RotaryAtContextParallelPositions(self.rotary_pos_emb,
                                                               layout=getattr(config, "cp_layout", "zigzag"))

    def _rope(self, x, emb, mscale):
        """The release's indexer RoPE: the first ``qk_pos_emb_head_dim`` values of each head rotated."""
        p = self.qk_pos_emb_head_dim
        return torch.cat([_rotate(x[..., :p], emb, mscale), x[..., p:]], dim=-1)

    def index_inputs(self, x, qr, gather=True):
        """(q [s, b, H, D], weights [s, b, H] with megatron's H**-0.5 * D**-0.5, k [s, b, D]) of this rank's
        tokens, from the layer input ``x`` [s, b, hidden] and the compressed query ``qr`` [s, b, q_lora_rank]
        (detached: the indexer learns from its own loss only). ``gather``: under sequence parallelism, gather
        the sequence first (a decode step's one token is not split: False)."""
        x, qr = x.detach(), qr.detach()
        # megatron's rule, on the layer's input as it comes (an SP shard): x (TP under SP) x CP
        seq_len = self.rotary_pos_emb.get_rotary_seq_len(None, None, x, self.config, None)
        if gather and self.config.sequence_parallel and self.pg_collection.tp.size() > 1:
            x = gather_from_sequence_parallel_region(x, group=self.pg_collection.tp)
            qr = gather_from_sequence_parallel_region(qr, group=self.pg_collection.tp)
        s, b = x.shape[:2]
        out = self.rotary_pos_emb(seq_len)
        emb, mscale = (out, 1.0) if self.config.rope_type == "rope" else out
        emb = emb[:s]
        q = self._rope(self.linear_wq_b(qr)[0].view(s, b, self.index_n_heads, self.index_head_dim), emb, mscale)
        k = self._rope(self.k_norm(self.linear_wk(x)[0]).unsqueeze(2), emb, mscale).squeeze(2)
        weights = self.linear_weights_proj(x)[0] * (self.index_n_heads ** -0.5 * self.softmax_scale)
        return q, weights, k


class DSACoreAttention(MegatronModule):
    """The DSA seat's core attention: the indexer's top-k, then MLA's MQA-mode attention over the selected
    latents, on this rank's CP ring or all-gather; in training the indexer loss rides on the output."""

    def __init__(self, config, submodules: DSAttentionSubmodules, layer_number, attn_mask_type, attention_type,
                 attention_dropout=None, softmax_scale=None, k_channels=None, v_channels=None, cp_comm_type=None,
                 pg_collection=None, **_):
        super().__init__(config=config)
        self.layer_number = max(1, layer_number)
        self.indexer = build_module(submodules.indexer, config=config, pg_collection=pg_collection)
        # megatron's Attention builds a first core without MLA's scale, then MLA builds the real one with it
        channels = k_channels or getattr(config, "kv_channels", None)
        self.softmax_scale = softmax_scale if softmax_scale is not None or not channels else 1.0 / math.sqrt(channels)
        self.latent_source = None  # the MLA module (a weak reference), which holds linear_kv_up_proj
        self.inputs = None  # (x, qr) of the current forward, handed over by the MLA module
        comm_types = getattr(config, "cp_comm_types", None)
        self.comm_type = comm_types[min(self.layer_number, len(comm_types)) - 1] if comm_types else None
        self.mode = "all_gather" if self.comm_type == "all_gather" else "ring"
        self.cp_layout = getattr(config, "cp_layout", "zigzag")
        # Generation (cp_ext.inference.generate): the CP-sharded cache of [latent | indexer key] rows; None
        # while training. While it decodes, the indexer's RoPE rotates the one new token at its position.
        self.kv_cache = None
        self.indexer.rotary_pos_emb.decode_position = lambda: _decoding_position(self)

    def take_inputs(self, x, qr):
        self.inputs = (x, qr)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, x=None, qr=None):
        from cp_ext.attention.dsa.indexer import indexer_topk
        from cp_ext.attention.dsa.indexer_loss import indexer_loss
        from cp_ext.attention.dsa.sparse_attention import absorb_query, sparse_attention, up_project_output

        if value is not None or attention_mask is not None or packed_seq_params is not None:
            raise NotImplementedError("DSA runs on MLA's latent (cp_ext's MLA hands it over), without documents or "
                                      "packed sequences")
        if x is None:
            (x, qr), self.inputs = self.inputs, None
        cfg = self.config
        up_weight = self.latent_source().linear_kv_up_proj.weight
        q_nope, q_pe = query.split([cfg.qk_head_dim, cfg.qk_pos_emb_head_dim], dim=-1)
        q = absorb_query(q_nope, q_pe, up_weight)
        if self.kv_cache is not None and self.kv_cache.decoding:
            return self._decode(q, key, x, qr, up_weight)
        cp_group = parallel_state.get_context_parallel_group() if cfg.context_parallel_size > 1 else None
        positions = None
        if cp_group is not None:
            from cp_ext import parallel_state as cp_state

            positions = cp_state.get_context_parallel_positions(query.shape[0] * cfg.context_parallel_size,
                                                                self.cp_layout, device=query.device)
        walk = dict(group=cp_group, layout=self.cp_layout, mode=self.mode)
        where = dict(walk, positions=positions)
        iq, iw, ik = self.indexer.index_inputs(x, qr)
        if self.kv_cache is not None:  # a generation's prefill: keep [latent | indexer key], then attend as in training
            self.kv_cache.store_prefill(self.layer_number - 1, torch.cat([key, ik], dim=-1), None, num_heads=q.shape[2])
        selected = None
        if getattr(cfg, "dsa_dense_warmup", False):  # V3.2's first stage: dense attention, the indexer learns
            out = self._dense(query, key, up_weight, cp_group is not None)
        else:
            q_positions = torch.arange(query.shape[0], device=query.device) if positions is None else positions
            selected, _ = indexer_topk(iq, iw, ik, topk=cfg.dsa_indexer_topk, q_positions=q_positions, **walk)
            latent = sparse_attention(q, key, selected, softmax_scale=self.softmax_scale,
                                      v_head_dim=cfg.kv_lora_rank, **where)
            out = up_project_output(latent, up_weight, cfg.qk_head_dim)
        coeff = cfg.dsa_indexer_loss_coeff or 0.0
        if self.training and torch.is_grad_enabled() and coeff > 0:
            share = indexer_loss(q.detach(), key.detach(), iq, iw, ik, softmax_scale=self.softmax_scale,
                                 loss_coeff=coeff, selected=selected if cfg.dsa_indexer_use_sparse_loss else None,
                                 tp_group=self.indexer.pg_collection.tp, **where)
            INDEXER_LOSSES.add(share.detach())
            # the sum over this rank's queries, as the per-token LM loss is a sum (module docstring)
            rows = query.shape[1] * query.shape[0] * cfg.context_parallel_size  # b x the whole sequence
            out = DSAIndexerLossAutoScaler.apply(out, share * rows)
        return out.reshape(*out.shape[:2], -1)

    def _decode(self, q, latent, x, qr, up_weight):
        """One new token (under SP one identical copy per TP rank) against the cache
        (`cp_ext.inference.dsa_decode`, through the cache's ``attend_sparse``, as CoreAttention calls ``attend``)."""
        from cp_ext.attention.dsa.sparse_attention import up_project_output

        cfg, copies = self.config, q.shape[0]
        iq, iw, ik = self.indexer.index_inputs(x[:1], qr[:1], gather=False)
        out = self.kv_cache.attend_sparse(self.layer_number - 1, q[:1], torch.cat([latent[:1], ik], dim=-1), iq, iw,
                                          topk=cfg.dsa_indexer_topk, softmax_scale=self.softmax_scale,
                                          latent_width=latent.shape[-1], value_width=cfg.kv_lora_rank)
        out = up_project_output(out, up_weight, cfg.qk_head_dim)
        return out.expand(copies, -1, -1, -1).reshape(copies, out.shape[1], -1)

    def _dense(self, query, latent, up_weight, context_parallel):
        """Dense causal MLA over every key, on the latent (the kernels and CP paths cp_ext's MLA runs)."""
        from cp_ext.attention.cp.context_parallel import context_parallel_attention, local_attention

        kernel = getattr(self.config, "attention_kernel", "auto")
        if context_parallel:
            return context_parallel_attention(query, latent, None, causal=True, softmax_scale=self.softmax_scale,
                                              layout=self.cp_layout, kernel=kernel, comm_type=self.comm_type,
                                              up_weight=up_weight)
        return local_attention(query, latent, None, causal=True, softmax_scale=self.softmax_scale,
                               kernel=None if kernel == "auto" else kernel, up_weight=up_weight)


def freeze_all_but_indexer(model: torch.nn.Module) -> None:
    """V3.2's dense warm-up trains the indexer only: every other parameter is frozen before megatron's DDP
    and optimizer see the model (both take only parameters that require a gradient)."""
    for name, param in model.named_parameters():
        param.requires_grad_(".indexer." in name)


class IndexerLossTracker:
    """Each layer's indexer loss share (`cp_ext.attention.dsa.indexer_loss`: this rank's part of the mean over the
    sequence), summed over the layers and microbatches of a step until `take`."""

    def __init__(self):
        self.total = 0.0

    def add(self, share):
        self.total = self.total + share.to(torch.float64)

    def take(self, config, num_microbatches, device):
        """Megatron-LM's ``indexer loss`` of the step: the loss (coefficient included) averaged over the DSA
        layers (MTP's too), the microbatches and the data-parallel ranks, known on every rank; {} when the
        run trains no indexer loss."""
        total, self.total = self.total, 0.0
        if not (getattr(config, "dsa", False) and config.dsa_indexer_loss_coeff):
            return {}
        total = torch.as_tensor(total, dtype=torch.float64, device=device).reshape(())
        if parallel_state.get_tensor_model_parallel_rank() != 0:
            total = torch.zeros_like(total)  # TP ranks hold the same loss
        torch.distributed.all_reduce(total)  # the CP shares add up; PP stages hold different layers
        layers = config.num_layers + (config.mtp_num_layers or 0)
        dp = parallel_state.get_data_parallel_world_size()
        return {"indexer loss": (total / (dp * num_microbatches * layers)).item()}


INDEXER_LOSSES = IndexerLossTracker()


def dsa_core_attention_spec() -> ModuleSpec:
    """The DSA seat filled with cp_ext's modules (megatron's `get_dsa_module_spec_for_backend` shape)."""
    indexer = ModuleSpec(module=ContextParallelDSAIndexer,
                         submodules=DSAIndexerSubmodules(linear_wq_b=DuplicatedLinear, linear_wk=DuplicatedLinear,
                                                         k_norm=IndexerKeyNorm,
                                                         linear_weights_proj=DuplicatedLinear))
    return ModuleSpec(module=DSACoreAttention, submodules=DSAttentionSubmodules(indexer=indexer))

