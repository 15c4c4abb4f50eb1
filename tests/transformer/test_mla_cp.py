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
"""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.launch import launch, selected, worker_args, write_results  # noqa: E402

GRIDS = {  # name: (ulysses size, layout, per-layer comm type)
    "ring_zigzag": (1, "zigzag", None),
    "ring_contiguous": (1, "contiguous", None),
    "ulysses4": (4, "zigzag", None),
    "u2r2": (2, "zigzag", None),
    "all_gather": (1, "zigzag", "all_gather"),
}
ROPES = {"rope_qlora": dict(rope_type="rope", q_lora_rank=12),
         "yarn": dict(rope_type="yarn", q_lora_rank=None, rotary_scaling_factor=4.0, mscale=1.0, mscale_all_dim=1.0,
                      original_max_position_embeddings=16)}
CASES = [f"{r}-{g}" for r in ROPES for g in GRIDS]


def _build(rope, layout, comm_type):
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
                                  **ROPES[rope])
    config.cp_layout = layout or "zigzag"
    config.cp_comm_types = [comm_type] if comm_type else None
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
        ulysses, layout, comm_type = GRIDS[grid]
        _grid(None)  # CP = 1 (DP = 4): every rank the whole sequence
        model_parallel_cuda_manual_seed(1)
        ref_module = _build(rope, None, None)
        ref = _run(ref_module, x, dout)
        _grid(ulysses)
        module = _build(rope, layout, comm_type)
        module.load_state_dict(ref_module.state_dict())
        pos = ps.get_context_parallel_positions(s, layout)
        out, dx, grads = _run(module, x.index_select(0, pos), dout.index_select(0, pos))
        cp = mpu.get_context_parallel_group()
        err = {"out": (out - ref[0].index_select(0, pos)).abs().max().item(),
               "dx": (dx - ref[1].index_select(0, pos)).abs().max().item()}
        for name, grad in grads.items():
            dist.all_reduce(grad, group=cp)
            err[f"grad {name}"] = (grad - ref[2][name]).abs().max().item()
        res = {"err": err, "grads": sorted(grads), "ref_grads": sorted(ref[2])}
        if grid == "u2r2":  # megatron's own slicing (get_pos_emb_on_this_cp_rank: zigzag over all C ranks)
            from cp_ext.data.sharding import context_parallel_positions

            megatrons = context_parallel_positions(s, ring_rank=mpu.get_context_parallel_rank(),
                                                   ring_size=mpu.get_context_parallel_world_size())
            res["megatron_positions_differ"] = not torch.equal(megatrons, pos)
        results[case] = res
    ps.destroy_grid()
    write_results(args.results_dir, results)
    dist.destroy_process_group()


QUICK = ["yarn-u2r2"]


@pytest.fixture(scope="module")
def results(quick):
    return launch(__file__, 4, cases=QUICK if quick else None)


@pytest.mark.parametrize("case", [pytest.param(c, marks=[pytest.mark.quick] if c in QUICK else []) for c in CASES])
def test_mla_cp_equals_cp1(results, case):
    for rank, res in results.items():
        r = res[case]
        assert r["grads"] == r["ref_grads"] and len(r["grads"]) >= 4, r["grads"]  # every projection
        bad = {k: v for k, v in r["err"].items() if not v <= 1e-10}
        assert not bad, (rank, bad)
    if case.endswith("u2r2"):  # megatron's fixed slicing would rotate other tokens than most ranks hold
        assert sum(res[case]["megatron_positions_differ"] for res in results.values()) >= 3


if __name__ == "__main__":
    main()
