"""Generation with context parallelism: prefill with the training layout, decode on the sharded cache.

    gen = Generator(trainer)                      # a Trainer built with the run's flags (--load: weights)
    result = gen.generate(prompt_ids, max_new_tokens=32, sampling=Sampling())

1. **Prefill**: the longest prefix of the prompt the CP layout can split (a multiple of 2C
   tokens for the zigzag ring, C for contiguous) goes through the model exactly as a training
   forward would: each rank its shard, attention by ring / Ulysses / hybrid, RoPE at global
   positions. Every layer's core attention keeps its k, v share in the `ShardedKVCache`.
2. **The rest of the prompt** (fewer than 2C tokens) is fed one token at a time through the
   decode path: exact, no padding, nothing masked.
3. **Decode**: each new token runs through the model on every CP rank (the same hidden state),
   its attention against the sharded cache (`cp_ext.inference.kv_cache`), RoPE at its global
   position. Every rank computes the same logits, so every rank samples the same token.

Only TP = PP = 1 here: tensor- and pipeline-parallel decoding need the sequence-parallel and
stage-to-stage paths of megatron's inference engine, which assumes CP = 1.
"""

import time
from dataclasses import dataclass, field
from typing import List

import torch
import torch.distributed as dist

from megatron.core import parallel_state

from cp_ext import parallel_state as cp_state
from cp_ext.inference.kv_cache import ShardedKVCache
from cp_ext.transformer.attention import CoreAttention


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
    logits: List[torch.Tensor] = field(default_factory=list)  # [vocab] fp32 per generated token
    prefilled: int = 0  # prompt tokens that went through the CP prefill (the rest were decoded)
    cache_bytes: int = 0  # KV cache bytes this rank held at the end
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0  # over `decode_steps` tokens through the decode path (prompt tail included)
    decode_steps: int = 0


def prefill_length(prompt_length: int, cp_size: int, layout: str) -> int:
    """The longest prefix the CP layout splits: a multiple of 2C (zigzag) or C (contiguous)."""
    unit = 2 * cp_size if (layout == "zigzag" and cp_size > 1) else cp_size
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
    def __init__(self, trainer):
        self.args, self.device, self.config = trainer.args, trainer.device, trainer.config
        if self.args.tensor_model_parallel_size > 1 or self.args.pipeline_model_parallel_size > 1:
            raise ValueError("generation runs with --tensor-model-parallel-size 1 and --pipeline-model-parallel-size 1 "
                             "(any CP, EP and DP); load the checkpoint at such a grid: checkpoints reshard")
        model = trainer.model[0].module
        self.model = getattr(model, "module", model)  # under Float16Module (bf16): the GPTModel inside
        self.model.eval()
        self.attention = [m for m in self.model.modules() if isinstance(m, CoreAttention)]
        self.layout = self.config.cp_layout
        self.cp_size = parallel_state.get_context_parallel_world_size()

    def _cache(self, room: int) -> ShardedKVCache:
        cache = ShardedKVCache(self.config.num_layers, ulysses_group=cp_state.get_ulysses_group(),
                               ring_group=cp_state.get_ring_group(), room=room, kernel=self.config.attention_kernel)
        for layer in self.attention:
            layer.kv_cache = cache
        return cache

    def _release(self):
        for layer in self.attention:
            layer.kv_cache = None

    @torch.no_grad()
    def _prefill(self, ids: torch.Tensor) -> torch.Tensor:
        """The prompt prefix through the model with the training CP layout; [vocab] logits of its last token."""
        length = ids.numel()
        positions = cp_state.get_context_parallel_positions(length, self.layout, device=self.device)
        logits = self.model(ids[positions][None], positions[None], None)  # [1, s_local, vocab]
        # The rank holding the last position contributes its row; the others add zeros (exact).
        last = torch.zeros(logits.shape[-1], dtype=torch.float32, device=self.device)
        here = (positions == length - 1).nonzero()
        if here.numel():
            last += logits[0, int(here[0])].float()
        if self.cp_size > 1:
            dist.all_reduce(last, group=parallel_state.get_context_parallel_group())
        return last

    @torch.no_grad()
    def _decode(self, token: int, position: int, cache: ShardedKVCache) -> torch.Tensor:
        """One token at global ``position`` through the model against the cache; [vocab] logits."""
        model = self.model
        ids = torch.tensor([[token]], device=self.device)
        hidden = model.embedding(input_ids=ids, position_ids=torch.tensor([[position]], device=self.device))
        rope = model.rotary_pos_emb.get_emb(position + 1)[position:position + 1]  # the full table's row
        hidden = model.decoder(hidden_states=hidden, attention_mask=None, rotary_pos_emb=rope)
        weight = model.shared_embedding_or_output_weight() if model.share_embeddings_and_output_weights else None
        logits, _ = model.output_layer(hidden, weight=weight)
        cache.finish_token()
        return logits[0, 0].float()

    def generate(self, prompt_ids: List[int], max_new_tokens: int, sampling: Sampling = Sampling(),
                 stop_ids=()) -> Generation:
        result = Generation(list(prompt_ids))
        ids = torch.tensor(prompt_ids, dtype=torch.long, device=self.device)
        prefilled = prefill_length(len(prompt_ids), self.cp_size, self.layout)
        cache = self._cache(room=len(prompt_ids) - prefilled + max_new_tokens)
        generator = torch.Generator().manual_seed(sampling.seed)
        start = time.perf_counter()
        try:
            if prefilled:
                logits = self._prefill(ids[:prefilled])
            else:
                cache.start_empty(self.config, self.device)
            cache.decoding = True
            result.prefill_seconds = time.perf_counter() - start
            start = time.perf_counter()
            for position in range(prefilled, len(prompt_ids)):  # the prompt's tail: teacher-forced decode steps
                logits = self._decode(int(ids[position]), position, cache)
            position = len(prompt_ids)
            while len(result.new_ids) < max_new_tokens:
                token = pick_token(logits, sampling, generator)
                result.new_ids.append(token)
                result.logits.append(logits)
                if token in stop_ids or len(result.new_ids) == max_new_tokens:
                    break
                logits = self._decode(token, position, cache)
                position += 1
            result.decode_seconds = time.perf_counter() - start
            result.decode_steps = position - prefilled
            result.prefilled, result.cache_bytes = prefilled, cache.bytes_held()
        finally:
            self._release()
        return result
