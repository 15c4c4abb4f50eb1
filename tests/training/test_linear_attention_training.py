"""A Qwen3-Next-shaped hybrid (``--experimental-attention-variant gated_delta_net``) trains the same model on every
grid it runs on: the whole model, through the trainer, against CP = 1 (fp32, 2 iterations).

The model is test_grid_equivalence's small MoE GPT made Qwen3-Next: 4 layers, ``--linear-attention-freq 2`` (layers
1 and 3 Gated DeltaNet, 2 and 4 softmax attention, so each PP2 stage holds both), 2 key / 4 value heads of 8 in the
GDN layers with a 4-tap conv, softmax attention with its output gate and half of each head rotated (``--rotary-percent
0.5``), qk-norm, zero-centered norms (``--apply-layernorm-1p``), and a sigmoid-gated shared
expert. 64 tokens per sample: at CP4 zigzag each rank holds two 8-token segments, so the conv's 3-token halo and
the state cross every segment boundary.

Compared, as in test_grid_equivalence (`_assert_same`): lm loss, load-balancing loss and grad norm of both
iterations to 1e-5 relative, and every parameter's gradient after iteration 1 (the GDN's in_proj sections, conv,
A_log, dt_bias, gated norm and out_proj, the attention's gate rows, the shared expert's gate), reassembled from
the ranks' slices through the checkpoint map. Grids: CP2 ring (zigzag and contiguous), CP2 with all-gather softmax
layers, CP4 ring, CP2 Ulysses and Ulysses 2 x ring 2 (the linear layers' all-to-all before their conv), TP2+SP x
CP2, PP2 x CP2, EP2 x CP2, full recompute, each with packed documents too
(``--reset-attention-mask``: the state and the conv restart at every document), and MTP. Launches: 1, 2 and 4
ranks.
"""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.launch import worker_args, write_results  # noqa: E402
from tests.training.test_grid_equivalence import (DOC_FLAGS, MODEL, LinearLayerWatch, _assert_same, _train,  # noqa: E402
                                                   launch_layouts)  # noqa: E402

QWEN3_NEXT = ["--experimental-attention-variant", "gated_delta_net", "--linear-attention-freq", "2",
              "--linear-num-key-heads", "2", "--linear-num-value-heads", "4", "--linear-key-head-dim", "8",
              "--linear-value-head-dim", "8", "--linear-conv-kernel-dim", "4", "--attention-output-gate",
              "--rotary-percent", "0.5", "--kv-channels", "8", "--qk-layernorm", "--apply-layernorm-1p",
              "--moe-shared-expert-intermediate-size", "32", "--moe-shared-expert-gate", "--seq-length", "64",
              "--max-position-embeddings", "64", "--init-method-std", "0.1"]
CP2, CP4 = ["--context-parallel-size", "2"], ["--context-parallel-size", "4"]
TP2SP = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
PP2 = ["--pipeline-model-parallel-size", "2"]
EP2 = ["--expert-model-parallel-size", "2"]
MTP = ["--mtp-num-layers", "1"]
RECOMPUTE = ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
GRIDS = {  # name: (ranks, flags)
    "cp2_ring": (2, CP2),
    "cp2_ring_contiguous": (2, CP2 + ["--cp-load-balance", "none"]),
    "cp2_all_gather": (2, CP2 + ["--cp-comm-type", "all_gather"]),
    "cp2_recompute": (2, CP2 + RECOMPUTE),
    "cp4_ring": (4, CP4),
    # Ulysses: the linear layers' all-to-all before their conv (pure Ulysses: megatron's head-parallel method),
    # and Ulysses 2 x ring 2 (state passing over the ring on h/2 heads)
    "cp2_ulysses": (2, CP2 + ["--ulysses-size", "2"]),
    "cp4_u2r2": (4, CP4 + ["--cp-comm-type", "a2a+p2p", "--hierarchical-context-parallel-sizes", "2", "2"]),
    "tp2sp_cp2": (4, TP2SP + CP2),
    "pp2_cp2": (4, PP2 + CP2),
    "ep2_cp2": (4, EP2 + CP2),
}
RUNS = {"cp1": (1, [], None), "cp1_docs": (1, DOC_FLAGS, None), "cp1_mtp": (1, MTP, None)}
for _name, (_ranks, _flags) in GRIDS.items():
    RUNS[_name] = (_ranks, _flags, "cp1")
    RUNS[_name + "_docs"] = (_ranks, _flags + DOC_FLAGS, "cp1_docs")
RUNS["cp2_ring_mtp"] = (2, CP2 + MTP, "cp1_mtp")
RUNS["tp2sp_cp2_mtp"] = (4, TP2SP + CP2 + MTP, "cp1_mtp")
QUICK = ("cp2_ring_docs",)
# dt_bias and A_log: each gradient entry sums one head's terms over every token of the batch, terms that largely
# cancel, so the sum's fp32 rounding is relative to the terms, not to the (small) sum; the grids sum in different
# orders (measured: 1.0e-5 of the largest entry at CP2 with documents). The GDN module test uses the same 5e-5.
TOLERANCES = {".dt_bias": 5e-5, ".A_log": 5e-5}


def _flags(name):
    return MODEL + QWEN3_NEXT + RUNS[name][1]


# ----------------------------------------------------------------------------- worker
def worker():
    import os

    import torch
    import torch.distributed as dist

    from cp_ext.transformer.gated_delta_net import GatedDeltaNet

    opts = worker_args(sys.argv[1:], required=["--layouts"])
    results = {"results_dir": opts.results_dir}
    with LinearLayerWatch(GatedDeltaNet) as watch:
        for name in opts.layouts.split(","):
            watch.reset()
            results[name], grads = _train(name, _flags(name))
            results[name].update(watch.record("gdn"))
            torch.save(grads, Path(opts.results_dir, f"grads_{name}_rank{os.environ['RANK']}.pt"))
    write_results(opts.results_dir, results)
    dist.destroy_process_group()


# ----------------------------------------------------------------------------- pytest
@pytest.fixture(scope="module")
def runs(quick):
    """``runs(name)``: (rank 0's metrics, full gradients); one launch per world size."""
    done = {}

    def get(name):
        world = RUNS[name][0]
        if name not in done:
            wanted = [name] if quick and RUNS[name][2] is None else (
                [name] if quick else [n for n, (size, _, _) in RUNS.items() if size == world])
            done.update(launch_layouts(__file__, world, wanted, timeout=1200))
        return done[name]

    return get


@pytest.mark.parametrize("layout", [pytest.param(n, marks=[pytest.mark.quick] if n in QUICK else [])
                                    for n, (_, _, ref) in RUNS.items() if ref])
def test_hybrid_matches_cp1(layout, runs):
    reference, result = runs(RUNS[layout][2]), runs(layout)
    _assert_same(result, reference, TOLERANCES)
    gdn = [u for u in reference[1] if ".self_attention." in u and any(
        p in u for p in ("in_proj", "conv1d", "A_log", "dt_bias", "out_norm", "out_proj"))]
    parts = {u.split(".self_attention.")[1].split(".")[0] for u in gdn}
    assert parts == {"in_proj", "conv1d", "A_log", "dt_bias", "out_norm", "out_proj"}, parts
    assert all(reference[1][u].abs().max() > 0 for u in gdn), "every Gated DeltaNet parameter learns"


def test_pattern_builds_gated_delta_net_on_the_linear_layers(runs):
    """--linear-attention-freq 2: layers 1 and 3 (megatron's 1-based numbers) are Gated DeltaNet, 2 and 4 softmax
    attention; the checkpoint map splits in_proj and conv1d into megatron's sections."""
    run, grads = runs("cp1")
    assert run["gdn layers"] == [1, 3]
    sections = sorted({u.split("in_proj.weight.")[1].split(".")[0] for u in grads if "in_proj.weight." in u})
    assert sections == ["alpha", "beta", "key", "query", "value", "z"], sections
    convs = sorted({u.split("conv1d.weight.")[1].split(".")[0] for u in grads if "conv1d.weight." in u})
    assert convs == ["key", "query", "value"], convs


def test_cp_aware_recompute_replays_the_linear_layers_exchanges(runs):
    """Full recompute at CP2: each Gated DeltaNet layer's recompute replays its first forward's gathers (the
    summaries, the conv halo; the document ids too) instead of exchanging again, and still equals CP1
    (test_hybrid_matches_cp1[cp2_recompute*]). 2 iterations x 4 microbatches x 2 linear layers."""
    assert runs("cp2_recompute")[0]["gdn replayed"] == 16
    assert runs("cp2_recompute_docs")[0]["gdn replayed"] == 16
    assert runs("cp2_ring")[0]["gdn replayed"] == 0


def test_documents_reach_the_linear_layers(runs):
    """With --reset-attention-mask every Gated DeltaNet forward gets the document ids (its state and conv restart
    at each document: tests/transformer/test_gated_delta_net.py); without, none does."""
    assert runs("cp1_docs")[0]["gdn forwards with documents"] == [True]
    assert runs("cp1")[0]["gdn forwards with documents"] == [False]


if __name__ == "__main__":
    worker()
