"""DeepSeek-V4's router in megatron's MoE seat: the ``sqrtsoftplus`` score and hash routing (``--moe-n-hash-layers``).

megatron's `TopKRouter` with its selection replaced where V4 differs (transformers' ``DeepseekV4TopKRouter`` and
``DeepseekV4HashRouter``)::

    scores  = sqrt(softplus(logits))               (or megatron's sigmoid / softmax)
    experts = topk(scores + expert_bias)           or, on the first --moe-n-hash-layers MoE layers, tid2eid[token]
    weights = scores[experts] / sum, x --moe-router-topk-scaling-factor

A hash layer's experts are a frozen table ``tid2eid`` [padded vocabulary, topk] (a persistent buffer: it is in the
checkpoint and Hugging Face's ``tid2eid``); trained from scratch it is drawn once, layout-invariantly (seeded by the
layer), each token's experts distinct. The learned gate still weights the chosen experts. No load-balancing loss or
capacity is applied here (V4 trains with neither and an expert bias instead: the flags say so at parse time).

The token ids reach the routers from the model's forward (`set_token_ids`): each router keeps this microbatch's
ids of the tokens it routes, in megatron's row order (sequence-major, this CP rank's tokens, this TP rank's share
under sequence parallelism), so every layout routes every token by its own id.
"""

from typing import Optional

import torch
import torch.nn.functional as F

from megatron.core import parallel_state
from megatron.core.transformer.moe.router import TopKRouter

SCORES = {"sqrtsoftplus": lambda x: F.softplus(x).sqrt(), "sigmoid": torch.sigmoid,
          "softmax": lambda x: torch.softmax(x, dim=-1)}


def hash_table(vocab: int, experts: int, topk: int, layer_number: int) -> torch.Tensor:
    """A frozen token -> experts table [vocab, topk] for training from scratch: distinct experts per token, drawn from
    a generator seeded by the layer alone (the same table on every rank and grid)."""
    g = torch.Generator().manual_seed(0x5EED + layer_number)
    return torch.rand(vocab, experts, generator=g, device="cpu").argsort(dim=-1)[:, :topk].contiguous()


class DeepSeekV4Router(TopKRouter):
    """megatron's TopKRouter with V4's score function and hash routing (module docstring)."""

    def __init__(self, config, pg_collection=None, **kwargs):
        super().__init__(config=config, pg_collection=pg_collection, **kwargs)  # 0.19 adds is_mtp_layer
        self.v4_score = SCORES[config.router_score_function]
        self.is_hash = False
        self.token_ids: Optional[torch.Tensor] = None

    def set_layer_number(self, layer_number: int):
        super().set_layer_number(layer_number)
        # megatron numbers layers from 1; the first --moe-n-hash-layers (MoE) layers route by the table
        self.is_hash = layer_number <= self.config.moe_n_hash_layers
        if not self.is_hash and hasattr(self, "tid2eid"):  # renumbered (an MTP layer's, `ContextParallelMTPLayer`)
            del self.tid2eid
        if self.is_hash and not hasattr(self, "tid2eid"):
            table = hash_table(self.config.padded_vocab_size, self.config.num_moe_experts, self.topk, layer_number)
            self.register_buffer("tid2eid", table.to(self.weight.device), persistent=True)

    def set_token_ids(self, input_ids: torch.Tensor) -> None:
        """This microbatch's ids [b, s] of this CP rank's tokens -> the rows this router routes ([s, b] flattened,
        this TP rank's share under sequence parallelism)."""
        ids = input_ids.t()
        tp = parallel_state.get_tensor_model_parallel_world_size()
        if self.config.sequence_parallel and tp > 1:
            ids = ids.chunk(tp, dim=0)[parallel_state.get_tensor_model_parallel_rank()]
        self.token_ids = ids.reshape(-1)

    def routing(self, logits: torch.Tensor, padding_mask: Optional[torch.Tensor] = None):
        logits = logits.view(-1, self.config.num_moe_experts)
        scores = self.v4_score(logits.to(torch.float64 if logits.dtype == torch.float64 else torch.float32))
        if self.is_hash:
            if self.token_ids is None or self.token_ids.numel() != logits.shape[0]:
                raise RuntimeError(f"hash-routed layer {self.layer_number} has no token ids for its "
                                   f"{logits.shape[0]} tokens; the model sets them in its forward")
            experts = self.tid2eid[self.token_ids].long()
        else:
            biased = scores if self.expert_bias is None else scores + self.expert_bias.to(scores.dtype)
            experts = biased.topk(self.topk, dim=-1).indices
        weights = scores.gather(1, experts)
        if self.topk > 1:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        if self.config.moe_router_topk_scaling_factor:
            weights = weights * self.config.moe_router_topk_scaling_factor
        probs = torch.zeros_like(scores).scatter(1, experts, weights)
        routing_map = torch.zeros_like(scores, dtype=torch.bool).scatter(1, experts, True)
        if not self.is_hash:  # the expert bias balances the learned selection only
            self._apply_expert_bias(routing_map, padding_mask=padding_mask)
        return probs, routing_map
