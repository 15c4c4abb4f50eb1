"""megatron's Multi-Latent Attention under every CP type equals CP = 1 (fp64, module level).

Worker (4 gloo ranks, one launch): `ContextParallelMLASelfAttention` (megatron's MLASelfAttention
with cp_ext's CoreAttention in its core-attention seat and its RoPE at cp_ext's positions) is
built at CP = 1 (every rank the full sequence), then at CP = 4 with the same weights as a ring
(zigzag and contiguous), Ulysses 4, Ulysses 2 x ring 2 and all-gather, for rope and YaRN (with
mscale), with and without q-LoRA. Each rank runs its shard of the same hidden states; its output
and input gradient must equal the CP = 1 rows at its positions, and every weight gradient summed
over the CP group must equal CP = 1's, all to 1e-10 (fp64). On the Ulysses x ring layout megatron's
own slicing of MLA's RoPE (zigzag over all C ranks) would rotate other tokens than most ranks hold,
which is why the seat exists (megatron's slicing itself pins memory, so it cannot run on CPU).
The ``_latent`` grids run the ring and all-gather with ``--cp-mla-exchange latent`` (and ``auto``):
the same 1e-10 against CP = 1, and the bytes they send are the K/V grids' times
(kv_lora_rank + qk_pos_emb_head_dim) / (heads x (qk_head_dim + qk_pos_emb_head_dim + v_head_dim)).
"""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.launch import launch, selected, worker_args, write_results  # noqa: E402

GRIDS = {  # name: (ulysses size, layout, per-layer comm type, --cp-mla-exchange)
    "ring_zigzag": (1, "zigzag", None, "kv"),
    "ring_contiguous": (1, "contiguous", None, "kv"),
    "ulysses4": (4, "zigzag", None, "auto"),  # auto: K/V (Ulysses exchanges heads)
    "u2r2": (2, "zigzag", None, "kv"),
    "all_gather": (1, "zigzag", "all_gather", "kv"),
    "ring_zigzag_latent": (1, "zigzag", None, "auto"),  # auto: the latent (4 heads x 28 values vs 22)
    "ring_contiguous_latent": (1, "contiguous", None, "latent"),
    "all_gather_latent": (1, "zigzag", "all_gather", "latent"),
}
LATENT_RATIO = (16 + 6) / (4 * (12 + 6 + 10))  # (kv_lora_rank + p) / (heads (qk_head_dim + p + v_head_dim))
ROPES = {"rope_qlora": dict(rope_type="rope", q_lora_rank=12),
         "yarn": dict(rope_type="yarn", q_lora_rank=None, rotary_scaling_factor=4.0, mscale=1.0, mscale_all_dim=1.0,
                      original_max_position_embeddings=16)}
CASES = [f"{r}-{g}" for r in ROPES for g in GRIDS]
# Generation (cp_ext.inference.kv_cache): prefill 24 tokens at CP = 4, then decode 8 one by one.
DECODES = {"decode_kv": ("ring_zigzag", {}), "decode_latent": ("ring_zigzag_latent", {}),
           "decode_latent_window_sink": ("ring_contiguous_latent", dict(window_size=(5, 0), softmax_type="learnable")),
           "decode_all_gather_latent": ("all_gather_latent", {})}
CASES += [f"{r}-{d}" for r, d in (("yarn", "decode_kv"), ("yarn", "decode_latent"), ("rope_qlora", "decode_latent"),
                                  ("rope_qlora", "decode_latent_window_sink"), ("yarn", "decode_all_gather_latent"))]
PREFILL = 24


def _build(rope, layout, comm_type, exchange="auto", extra=None):
    import torch
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    from cp_ext.transformer.attention import CoreAttention
    from cp_ext.transformer.mla import ContextParallelMLASelfAttention

    spec = get_gpt_layer_local_spec(multi_latent_attention=True).submodules.self_attention
    spec.submodules.core_attention = CoreAttention
    config = MLATransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, kv_lora_rank=16,
                                  qk_head_dim=12, qk_pos_emb_head_dim=6, v_head_dim=10, normalization="RMSNorm",
                                  params_dtype=torch.float64, attention_dropout=0.0,
                                  context_parallel_size=torch.distributed.get_world_size() if layout else 1,
                                  **ROPES[rope], **(extra or {}))
    config.cp_layout = layout or "zigzag"
    config.cp_comm_types = [comm_type] if comm_type else None
    config.cp_mla_exchange = exchange
    return ContextParallelMLASelfAttention(config, spec.submodules, layer_number=1,
                                           attn_mask_type=AttnMaskType.causal).double()


def _run(module, x, dout):
    x = x.detach().clone().requires_grad_()
    module.zero_grad(set_to_none=True)
    out, _ = module(x, attention_mask=None)
    out.backward(dout)
    grads = {n: p.grad.detach().clone() for n, p in module.named_parameters() if p.grad is not None}
    return out.detach(), x.grad.detach(), grads


def _grid(ulysses):
    from megatron.core import parallel_state as mpu

    import cp_ext.parallel_state as ps

    ps.destroy_grid()
    import torch.distributed as dist

    mpu.initialize_model_parallel(context_parallel_size=dist.get_world_size() if ulysses else 1)
    ps.initialize_context_parallel(ulysses_size=ulysses or 1)


def main():
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from cp_ext import parallel_state as ps
    from cp_ext.perf.counter import count_comm
    from cp_ext.platform import setup_platform

    setup_platform("cpu")
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    args = worker_args()
    s, b = 32, 2
    g = torch.Generator().manual_seed(0)
    x = torch.randn(s, b, 32, generator=g, dtype=torch.float64)
    dout = torch.randn(s, b, 32, generator=g, dtype=torch.float64)
    results = {}
    for case in selected(CASES, args):
        rope, grid = case.split("-")
        if grid in DECODES:
            results[case] = _decode(rope, *DECODES[grid], x)
            continue
        ulysses, layout, comm_type, exchange = GRIDS[grid]
        _grid(None)  # CP = 1 (DP = 4): every rank the whole sequence
        model_parallel_cuda_manual_seed(1)
        ref_module = _build(rope, None, None)
        ref = _run(ref_module, x, dout)
        _grid(ulysses)
        module = _build(rope, layout, comm_type, exchange)
        module.load_state_dict(ref_module.state_dict())
        pos = ps.get_context_parallel_positions(s, layout)
        with count_comm() as comm:
            out, dx, grads = _run(module, x.index_select(0, pos), dout.index_select(0, pos))
        sent = sum(n for k, n in comm.bytes.items() if k in ("ring_p2p", "all_gather_kv", "reduce_scatter_dkv"))
        cp = mpu.get_context_parallel_group()
        err = {"out": (out - ref[0].index_select(0, pos)).abs().max().item(),
               "dx": (dx - ref[1].index_select(0, pos)).abs().max().item()}
        for name, grad in grads.items():
            dist.all_reduce(grad, group=cp)
            err[f"grad {name}"] = (grad - ref[2][name]).abs().max().item()
        res = {"err": err, "grads": sorted(grads), "ref_grads": sorted(ref[2]), "bytes": sent,
               "latent": module.latent_exchange()}
        if grid == "u2r2":  # megatron's own slicing (get_pos_emb_on_this_cp_rank: zigzag over all C ranks)
            from cp_ext.token_partition import context_parallel_positions

            megatrons = context_parallel_positions(s, ring_rank=mpu.get_context_parallel_rank(),
                                                   ring_size=mpu.get_context_parallel_world_size())
            res["megatron_positions_differ"] = not torch.equal(megatrons, pos)
        results[case] = res
    ps.destroy_grid()
    write_results(args.results_dir, results)
    dist.destroy_process_group()


def _decode(rope, grid, extra, x):
    """A prefill at CP = 4 and decode steps against the sharded cache, against CP = 1's forward."""
    import torch
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from cp_ext import parallel_state as ps
    from cp_ext.inference.kv_cache import ShardedKVCache

    ulysses, layout, comm_type, exchange = GRIDS[grid]
    _grid(None)
    model_parallel_cuda_manual_seed(1)
    ref_module = _build(rope, None, None, extra=extra).eval()
    if extra.get("softmax_type") == "learnable":  # a sink that matters: logits near the scores'
        torch.nn.init.normal_(ref_module.core_attention.softmax_offset, 1.0, 0.5)
    with torch.no_grad():
        ref = ref_module(x, attention_mask=None)[0]
        if extra:  # the window and the sink each change the result
            plain = _build(rope, None, None).eval()
            plain.load_state_dict(ref_module.state_dict(), strict=False)
            changed = (plain(x, attention_mask=None)[0] - ref).abs().max().item()
    _grid(ulysses)
    module = _build(rope, layout, comm_type, exchange, extra=extra).eval()
    module.load_state_dict(ref_module.state_dict())
    cache = ShardedKVCache(1, ulysses_group=ps.get_ulysses_group(), ring_group=ps.get_ring_group(),
                           room=x.shape[0] - PREFILL, layout=layout)
    module.core_attention.kv_cache = cache
    pos = ps.get_context_parallel_positions(PREFILL, layout)
    err = {}
    with torch.no_grad():
        err["prefill"] = (module(x.index_select(0, pos), attention_mask=None)[0] - ref.index_select(0, pos)).abs().max().item()
        cache.decoding = True
        for t in range(PREFILL, x.shape[0]):
            cache.position = t
            err[f"decode {t}"] = (module(x[t:t + 1], attention_mask=None)[0] - ref[t:t + 1]).abs().max().item()
            cache.finish_token()
    return {"err": err, "latent": module.latent_exchange(), "cache_bytes": cache.bytes_held(),
            "cached": sum(c.length for c in cache.layers), "changed": changed if extra else None}


QUICK = ["yarn-u2r2", "rope_qlora-ring_zigzag", "rope_qlora-ring_zigzag_latent", "yarn-decode_latent"]


@pytest.fixture(scope="module")
def results(quick):
    return launch(__file__, 4, cases=QUICK if quick else None)


@pytest.mark.parametrize("case", [pytest.param(c, marks=[pytest.mark.quick] if c in QUICK else [])
                                  for c in CASES if c.split("-")[1] in GRIDS])
def test_mla_cp_equals_cp1(results, case):
    for rank, res in results.items():
        r = res[case]
        assert r["grads"] == r["ref_grads"] and len(r["grads"]) >= 4, r["grads"]  # every projection
        bad = {k: v for k, v in r["err"].items() if not v <= 1e-10}
        assert not bad, (rank, bad)
    rope, grid = case.split("-")
    assert res[case]["latent"] == grid.endswith("_latent"), res[case]["latent"]
    if grid.endswith("_latent"):  # the same exchange, carrying the latent instead of per-head K/V
        for res in results.values():
            assert res[case]["bytes"] == res[f"{rope}-{grid[:-7]}"]["bytes"] * LATENT_RATIO > 0
    if case.endswith("u2r2"):  # megatron's fixed slicing would rotate other tokens than most ranks hold
        assert sum(res[case]["megatron_positions_differ"] for res in results.values()) >= 3


@pytest.mark.parametrize("case", [pytest.param(c, marks=[pytest.mark.quick] if c in QUICK else [])
                                  for c in CASES if c.split("-")[1] in DECODES])
def test_mla_generation_equals_cp1(results, case):
    """Every prefill row and decode step equals CP = 1's forward; the latent cache holds
    (kv_lora_rank + p) values per token where the K/V cache holds heads x (d_qk + d_v)."""
    rope, decode = case.split("-")
    for rank, res in results.items():
        r = res[case]
        bad = {k: v for k, v in r["err"].items() if not v <= 1e-10}
        assert not bad and len(r["err"]) == 9, (rank, bad)
        assert r["latent"] == ("latent" in decode)
        per_token = 2 * 8 * ((16 + 6) if r["latent"] else 4 * (12 + 6 + 10))  # batch 2, fp64
        assert r["cache_bytes"] == r["cached"] * per_token and r["cached"] > 0, r
        if r["changed"] is not None:
            assert r["changed"] > 1e-3, r["changed"]
    assert sum(res[case]["cached"] for res in results.values()) == 32  # every token cached once


if __name__ == "__main__":
    main()
