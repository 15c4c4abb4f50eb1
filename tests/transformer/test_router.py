"""DeepSeek-V4's router (`cp_ext.transformer.router.DeepSeekV4Router`) against transformers'
``DeepseekV4TopKRouter`` and ``DeepseekV4HashRouter``: the same gate weight, expert bias and hash table give the
same experts and weights (float64, one CPU rank with megatron's parallel state, in a subprocess).

The routers under every grid, each token routed by its own id: tests/training/test_deepseek_v4_training.py.
"""

import json

import pytest

from tests.launch import one_rank_megatron, run_code

pytest.importorskip("transformers.models.deepseek_v4")

CHECK = """
import json
import torch
from transformers import DeepseekV4Config
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HashRouter, DeepseekV4TopKRouter
from megatron.core.process_groups_config import ProcessGroupCollection
from cp_ext.config import ContextParallelTransformerConfig
from cp_ext.transformer.router import DeepSeekV4Router

E, K, H, V, T = 8, 3, 16, 32, 40
config = ContextParallelTransformerConfig(num_layers=2, hidden_size=H, num_attention_heads=2, num_moe_experts=E,
    moe_router_topk=K, moe_router_score_function="sigmoid", router_score_function="sqrtsoftplus",
    moe_router_enable_expert_bias=True, moe_router_topk_scaling_factor=1.5, moe_router_load_balancing_type="none",
    moe_n_hash_layers=1, padded_vocab_size=V, use_cpu_initialization=True, params_dtype=torch.float64,
    moe_router_dtype="fp64", add_bias_linear=False)
hf = DeepseekV4Config(hidden_size=H, n_routed_experts=E, num_experts_per_tok=K, routed_scaling_factor=1.5,
                      scoring_func="sqrtsoftplus", vocab_size=V, num_hidden_layers=1)
g = torch.Generator().manual_seed(0)
x = torch.randn(T, 1, H, dtype=torch.float64, generator=g)
ids = torch.randint(0, V, (1, T), generator=g)
out = {}
for layer, hashed in ((1, True), (2, False)):
    ours = DeepSeekV4Router(config, pg_collection=ProcessGroupCollection.use_mpu_process_groups())
    ours.set_layer_number(layer)
    assert ours.is_hash == hashed
    theirs = (DeepseekV4HashRouter(hf) if hashed else DeepseekV4TopKRouter(hf)).double()
    with torch.no_grad():
        ours.weight.copy_(torch.randn(E, H, dtype=torch.float64, generator=g))
        theirs.weight.copy_(ours.weight)
        if hashed:
            theirs.tid2eid.copy_(ours.tid2eid)
        else:
            ours.expert_bias.copy_(torch.randn(E, generator=g) * 0.3)
            theirs.e_score_correction_bias.copy_(ours.expert_bias)
    ours.train()
    ours.set_token_ids(ids)
    probs, routing_map = ours(x)
    _, weights, experts = theirs(x, ids) if hashed else theirs(x)
    want = torch.zeros(T, E, dtype=torch.float64).scatter(1, experts, weights.double())
    out[str(layer)] = dict(prob_err=(probs.double() - want).abs().max().item(),
                           map_equal=bool(torch.equal(routing_map, want > 0)),
                           distinct=bool((ours.tid2eid.sort(-1).values.diff(dim=-1) > 0).all()) if hashed else True)
print("RESULT", json.dumps(out))
"""


def test_router_is_transformers(tmp_path):
    proc = run_code(one_rank_megatron(tmp_path) + CHECK)
    result = json.loads(proc.stdout.split("RESULT", 1)[1])
    for layer, res in result.items():
        assert res["prob_err"] < 1e-12 and res["map_equal"], (layer, res)
        assert res["distinct"], "a token's hash-routed experts must differ"
