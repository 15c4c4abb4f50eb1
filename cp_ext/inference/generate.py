"""Generation with context parallelism: prefill with the training layout, decode on the sharded cache.

    gen = Generator(model)                        # this rank's model chunk: `build_model_stack`'s (weights
                                                  # from `load_model_weights`), or a trainer's
    result = gen.generate(prompt_ids, max_new_tokens=32, sampling=Sampling())

1. **Prefill**: the longest prefix of the prompt the CP layout can split (a multiple of 2C
   tokens for the zigzag ring, C for contiguous) goes through the model exactly as a training
   forward would: each rank its shard, attention by ring / Ulysses / hybrid, RoPE at global
   positions. Every layer's core attention keeps its k, v share in the `ShardedKVCache`.
2. **The rest of the prompt** (fewer than 2C tokens) is fed one token at a time through the
   decode path: exact, no padding, nothing masked.
3. **Decode**: each new token runs through the model on every CP rank (the same hidden state),
   its attention against the sharded cache (`cp_ext.inference.kv_cache`), RoPE at its global
   position; a linear-attention layer continues from its state and conv tail, the same on every
   rank (`cp_ext.linear_attention.generation_state`); a DeepSeek-V4 layer reads its window and
   compressed entries, sharded over the CP group (`cp_ext.inference.compressed_cache`). Every
   rank computes the same logits, so every rank samples the same token.

Pipeline stages pass the prompt's (then each token's) hidden states on with send/recv (under
hyper-connections, each token's residual streams); the last stage picks the token and
broadcasts it over the pipeline group. Tensor parallelism: heads (and
so the cache) split over TP as in training; the vocabulary-parallel logits are gathered. Under
sequence parallelism (required for MoE with TP) a decode step feeds one identical copy of the
token per TP rank, so megatron's sequence scatter/gather have something to split.
"""

import math
import time
from dataclasses import dataclass, field
from typing import List, Optional

import torch
import torch.distributed as dist

from megatron.core import parallel_state, tensor_parallel
from megatron.core.models.gpt import GPTModel

from cp_ext import parallel_state as cp_state
from cp_ext.inference.kv_cache import ShardedKVCache
from cp_ext.models.mtp import decoder_output
from cp_ext.transformer.attention import CoreAttention
from cp_ext.transformer.compressed_attention import CompressedAttention
from cp_ext.transformer.dsa import DSACoreAttention
from cp_ext.transformer.linear_mixer import LinearMixer


@dataclass
class Sampling:
    """Greedy when ``temperature`` is 0 (the default); else softmax(logits / T) cut to the
    ``top_k`` most likely (0: all) and to the smallest set holding ``top_p`` of the mass."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 1234


@dataclass
class Generation:
    prompt_ids: List[int]
    new_ids: List[int] = field(default_factory=list)
    logits: List[torch.Tensor] = field(default_factory=list)  # [vocab] fp32 per generated token (last PP stage)
    prefilled: int = 0  # prompt tokens that went through the CP prefill (the rest were decoded)
    cache_bytes: int = 0  # KV cache bytes this rank held at the end
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0  # over `decode_steps` tokens through the decode path (prompt tail included)
    decode_steps: int = 0
    # with ``logprobs``: each prompt token's log-probability given the tokens before it (None for the first:
    # nothing predicts it), vLLM's prompt_logprobs; and each generated token's. Known on every rank.
    prompt_logprobs: Optional[List[Optional[float]]] = None
    new_logprobs: Optional[List[float]] = None


def prefill_length(prompt_length: int, cp_size: int, layout: str, sp_size: int = 1) -> int:
    """The longest prefix the CP layout splits: a multiple of 2C (zigzag) or C (contiguous), and
    with sequence parallelism over ``sp_size`` TP ranks each CP shard a multiple of sp_size too."""
    unit = 2 * cp_size if (layout == "zigzag" and cp_size > 1) else cp_size
    unit = math.lcm(unit, cp_size * sp_size)
    return prompt_length // unit * unit


def pick_token(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator) -> int:
    """One token id from [vocab] logits (identical on every rank, so the pick is too)."""
    if sampling.temperature == 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.double() / sampling.temperature, dim=-1)
    if sampling.top_k:
        cut = torch.topk(probs, min(sampling.top_k, probs.numel())).values[-1]
        probs = torch.where(probs >= cut, probs, torch.zeros_like(probs))
    if sampling.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_probs, 0) - sorted_probs < sampling.top_p * sorted_probs.sum()
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_probs[keep])
    return int(torch.multinomial(probs / probs.sum(), 1, generator=generator))


class Generator:
    def __init__(self, model):
        """``model``: this rank's chunk as built (`cp_ext.models.factory.ModelStack.chunks[0]`) or as trained
        (under megatron's DDP); the GPTModel is taken out of DDP and Float16Module (bf16)."""
        while not isinstance(model, GPTModel):
            model = model.module
        self.model, self.config = model, model.config
        self.device = next(model.parameters()).device
        self.model.eval()
        # every layer that keeps something for the next token: the softmax layers' core attention (their KV
        # cache share), DeepSeek-V4's layers (window, entries, open block) and the linear-attention layers
        # (their state and conv tail)
        self.attention = [m for m in self.model.modules()
                          if isinstance(m, (CoreAttention, DSACoreAttention, CompressedAttention, LinearMixer))]
        self.layout = self.config.cp_layout
        self.cp_size = parallel_state.get_context_parallel_world_size()
        self.pp_size = parallel_state.get_pipeline_model_parallel_world_size()
        self.first_stage = parallel_state.is_pipeline_first_stage()
        self.last_stage = parallel_state.is_pipeline_last_stage()
        self.tp_size = parallel_state.get_tensor_model_parallel_world_size()
        # Sequence parallelism splits every sequence over TP, a single token too: a decode step feeds
        # one copy of the token per TP rank (identical copies, so any copy's result is the token's).
        self.sp_size = self.tp_size if self.config.sequence_parallel else 1

    def _cache(self, room: int) -> ShardedKVCache:
        cache = ShardedKVCache(self.config.num_layers, ulysses_group=cp_state.get_ulysses_group(),
                               ring_group=cp_state.get_ring_group(), room=room, kernel=self.config.attention_kernel,
                               layout=self.layout)
        for layer in self.attention:
            layer.kv_cache = cache
        return cache

    def _release(self):
        for layer in self.attention:
            layer.kv_cache = None
        if not self.first_stage:  # megatron sizes RoPE by a set input tensor: leave none behind
            self.model.decoder.set_input_tensor(None)

    # Pipeline stages hand hidden states [s, b, hidden] on, one prompt or one token at a time.
    def _from_previous_stage(self, tokens: int) -> torch.Tensor:
        # under hyper-connections a token travels as its residual streams, one row each (token-major)
        if getattr(self.config, "enable_hyper_connections", False):
            tokens *= self.config.num_residual_streams
        hidden = torch.empty(tokens, 1, self.config.hidden_size, dtype=self.config.pipeline_dtype, device=self.device)
        dist.recv(hidden, parallel_state.get_pipeline_model_parallel_prev_rank())
        return hidden

    def _to_next_stage(self, hidden: torch.Tensor) -> None:
        dist.send(hidden.contiguous(), parallel_state.get_pipeline_model_parallel_next_rank())

    @torch.no_grad()
    def _prefill(self, ids: torch.Tensor, scores: Optional[torch.Tensor] = None,
                 prompt: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        """The prompt prefix through the model with the training CP layout; [vocab] logits of its last
        token on the last pipeline stage (None on the others). With ``scores`` (the [prompt - 1] log-probs
        being filled): each prefix position's log-prob of the next ``prompt`` token, added at its place."""
        length = ids.numel()
        positions = cp_state.get_context_parallel_positions(length, self.layout, device=self.device)
        if not self.first_stage:
            self.model.set_input_tensor(self._from_previous_stage(positions.numel() // self.sp_size))
            self.model.route_by_token_ids(ids[positions][None])  # hash MoE (the first stage's forward does it)
        out = self.model(ids[positions][None] if self.first_stage else None, positions[None], None)
        if not self.last_stage:
            self._to_next_stage(out)  # [s_local / SP, 1, hidden]
            return None
        if scores is not None:  # every position this rank holds predicts the prompt's next token
            here = positions[positions + 1 < prompt.numel()]
            rows = torch.log_softmax(self._vocab(out[0]).float(), dim=-1)[(positions + 1 < prompt.numel()).nonzero()[:, 0]]
            local = torch.zeros_like(scores)
            local[here] = rows.gather(1, prompt[here + 1][:, None])[:, 0]
            if self.cp_size > 1:  # each position on one CP rank, zeros elsewhere: the sum is exact
                dist.all_reduce(local, group=parallel_state.get_context_parallel_group())
            scores += local
        # The rank holding the last position contributes its row; the others add zeros (exact).
        last = torch.zeros(self._vocab(out[0, :1]).shape[-1], dtype=torch.float32, device=self.device)
        here = (positions == length - 1).nonzero()
        if here.numel():
            last += self._vocab(out[0, int(here[0])]).float()
        if self.cp_size > 1:
            dist.all_reduce(last, group=parallel_state.get_context_parallel_group())
        return last

    @torch.no_grad()
    def _decode(self, token: int, position: int, cache: ShardedKVCache) -> Optional[torch.Tensor]:
        """One token at global ``position`` through this stage's layers against the cache; [vocab] logits
        on the last pipeline stage (None on the others)."""
        model = self.model
        cache.position = position  # what a sliding window of the cache measures from
        ids = torch.full((1, self.sp_size), token, device=self.device)
        model.route_by_token_ids(ids)  # hash MoE: the forward would, but a decode step runs the parts itself
        if self.first_stage:
            hidden = model.embedding(input_ids=ids, position_ids=torch.full_like(ids, position))  # [1, 1, hidden]
        else:
            hidden = self._from_previous_stage(1)
            model.decoder.set_input_tensor(hidden)  # what a stage without the embedding reads
        # the full table's row (MLA's layers rotate their own key at cache.position: cp_ext.transformer.mla)
        rotary = getattr(model, "rotary_pos_emb", None)  # None: MLA, learned or no positions
        rope = None if rotary is None else rotary.at_positions(torch.tensor([position]), position + 1)
        rope = rope[0] if isinstance(rope, tuple) else rope  # YaRN: mscale dropped, as GPTModel._preprocess drops it
        hidden = model.decoder(hidden_states=hidden, attention_mask=None, rotary_pos_emb=rope)
        cache.finish_token()
        if not self.last_stage:
            self._to_next_stage(hidden)
            return None
        hidden = decoder_output(model, hidden)  # V4's streams with MTP: collapsed here
        weight = model.shared_embedding_or_output_weight() if model.share_embeddings_and_output_weights else None
        logits, _ = model.output_layer(hidden, weight=weight)  # [SP copies, 1, vocab / TP]
        return self._vocab(logits[0, 0]).float()

    def _vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits over this TP rank's vocabulary slice -> over the whole vocabulary."""
        if self.tp_size == 1:
            return logits
        return tensor_parallel.gather_from_tensor_model_parallel_region(logits.contiguous())

    def _pick(self, logits, sampling, generator) -> int:
        """The next token: picked on the last stage, then known to every stage."""
        token = pick_token(logits, sampling, generator) if self.last_stage else 0
        if self.pp_size > 1:
            sent = torch.tensor([token], device=self.device)
            dist.broadcast(sent, parallel_state.get_pipeline_model_parallel_last_rank(),
                           group=parallel_state.get_pipeline_model_parallel_group())
            token = int(sent)
        return token

    def _known_everywhere(self, values: torch.Tensor) -> List[float]:
        """Values computed on the last pipeline stage, as a list on every stage."""
        if self.pp_size > 1:
            dist.broadcast(values, parallel_state.get_pipeline_model_parallel_last_rank(),
                           group=parallel_state.get_pipeline_model_parallel_group())
        return values.tolist()

    def generate(self, prompt_ids: List[int], max_new_tokens: int, sampling: Sampling = Sampling(),
                 stop_ids=(), logprobs: bool = False) -> Generation:
        """Greedy or sampled tokens after the prompt; with ``logprobs`` also the prompt's and the generated
        tokens' log-probabilities (log-softmax of the fp32 logits over the model's padded vocabulary, as
        its training loss sees them)."""
        result = Generation(list(prompt_ids))
        ids = torch.tensor(prompt_ids, dtype=torch.long, device=self.device)
        prefilled = prefill_length(len(prompt_ids), self.cp_size, self.layout, self.sp_size)
        cache = self._cache(room=len(prompt_ids) - prefilled + max_new_tokens)
        generator = torch.Generator().manual_seed(sampling.seed)
        start = time.perf_counter()
        try:
            scores = torch.zeros(max(len(prompt_ids) - 1, 0), device=self.device) if logprobs else None
            if prefilled:
                logits = self._prefill(ids[:prefilled], scores, ids)
            else:
                cache.start_empty()
            cache.decoding = True
            result.prefill_seconds = time.perf_counter() - start
            start = time.perf_counter()
            for position in range(prefilled, len(prompt_ids)):  # the prompt's tail: teacher-forced decode steps
                if scores is not None and logits is not None and position > 0:  # what predicted this token
                    scores[position - 1] = torch.log_softmax(logits, dim=-1)[ids[position]]
                logits = self._decode(int(ids[position]), position, cache)
            position = len(prompt_ids)
            while len(result.new_ids) < max_new_tokens:
                token = self._pick(logits, sampling, generator)
                result.new_ids.append(token)
                if logits is not None:
                    result.logits.append(logits)
                if token in stop_ids or len(result.new_ids) == max_new_tokens:
                    break
                logits = self._decode(token, position, cache)
                position += 1
            if scores is not None:
                result.prompt_logprobs = [None] + self._known_everywhere(scores)
                new = torch.tensor([float(torch.log_softmax(g, dim=-1)[t]) for g, t in zip(result.logits, result.new_ids)]
                                   if self.last_stage else [0.0] * len(result.new_ids), device=self.device)
                result.new_logprobs = self._known_everywhere(new)
            result.decode_seconds = time.perf_counter() - start
            result.decode_steps = position - prefilled
            result.prefilled, result.cache_bytes = prefilled, cache.bytes_held()
        finally:
            self._release()
        return result
