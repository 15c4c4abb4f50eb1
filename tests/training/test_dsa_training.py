"""DeepSeek-V3.2's sparse attention (``--experimental-attention-variant dsa``) trains the same model on every
CP layout it runs on: the whole model, through the trainer, against CP = 1 (fp32, 2 iterations).

The model is test_grid_equivalence's small MoE GPT with its MLA (q-LoRA, latent norms, YaRN) made DSA:
a 4-head indexer of dim 8 picks each query's top 8 of up to 32 keys, and the indexer loss (coefficient
0.1, dense over every causal key, or sparse over the selected keys) trains the indexer. Weights are drawn
with std 0.2 so the attention is far from uniform and the indexer loss is not ~0 (about 0.015;
at std 0.3 the model is so ill-conditioned that TP2 rounds gradients 1e-5 apart).
Compared, as in test_grid_equivalence (`_assert_same`): lm loss, load-balancing loss, indexer loss and
grad norm of both iterations to 1e-5 relative, and every parameter's gradient (the indexer's projections
and key norm included) after iteration 1. Iteration 2 runs on weights the indexer loss has moved, so its
selection is the trained indexer's.

At CP = 1 the worker also records, for every DSA forward, the smallest relative gap between a query's
k-th and (k+1)-th indexer scores: the test asserts it exceeds 1e-4, so CP = N selecting CP = 1's keys is
not luck (a gap below it fails the test: the MTP model takes 2 layers and seed 14 for that, on
0.16.1 and 0.19.2 alike). Layouts: CP2 ring (zigzag, contiguous), all-gather, CP4 ring, CP4 all-gather,
PP2 x CP2, TP2+SP and TP2+SP x CP2 (the latent read whole by every TP rank's heads, the indexer loss's
target summed over TP), with the dense and the sparse loss, and with MTP. Launches: 1, 2 and 4 ranks.
"""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.launch import worker_args, write_results  # noqa: E402
from tests.training.test_grid_equivalence import MLA_FLAGS, MODEL, _assert_same, _train, launch_layouts  # noqa: E402

STD = ["--init-method-std", "0.2"]
DSA_FLAGS = ["--experimental-attention-variant", "dsa", "--dsa-indexer-n-heads", "4", "--dsa-indexer-head-dim", "8",
             "--dsa-indexer-topk", "8", "--dsa-indexer-loss-coeff", "0.1"]
WARMUP = ["--dsa-dense-warmup"]
SPARSE = ["--dsa-indexer-use-sparse-loss"]
CP2, CP4 = ["--context-parallel-size", "2"], ["--context-parallel-size", "4"]
ALL_GATHER = ["--cp-comm-type", "all_gather"]
TP2SP = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
UP_PROJ = ["--recompute-granularity", "selective", "--recompute-modules", "mla_up_proj"]
MTP = ["--mtp-num-layers", "1", "--num-layers", "2", "--seed", "14"]  # two layers, a seed: separated top-k boundaries
RUNS = {  # name: (ranks, flags, the CP = 1 run it equals)
    "cp1": (1, [], None),
    "cp1_sparse": (1, SPARSE, None),
    "cp1_mtp": (1, MTP, None),
    "cp2_ring": (2, CP2, "cp1"),
    "cp2_ring_contiguous": (2, CP2 + ["--cp-load-balance", "none"], "cp1"),
    "cp2_all_gather": (2, CP2 + ALL_GATHER, "cp1"),
    "cp2_ring_sparse": (2, CP2 + SPARSE, "cp1_sparse"),
    "cp2_ring_mtp": (2, CP2 + MTP, "cp1_mtp"),
    "cp4_ring": (4, CP4, "cp1"),
    "cp4_all_gather_sparse": (4, CP4 + ALL_GATHER + SPARSE, "cp1_sparse"),
    "pp2_cp2": (4, CP2 + ["--pipeline-model-parallel-size", "2"], "cp1"),
    "tp2sp": (2, TP2SP, "cp1"),
    "tp2sp_cp2": (4, TP2SP + CP2, "cp1"),
    "tp2sp_cp2_sparse": (4, TP2SP + CP2 + SPARSE, "cp1_sparse"),
    "cp2_ring_up_proj": (2, CP2 + UP_PROJ, "cp1"),
}
# --recompute-modules mla_up_proj: the query and the latent key dropped after the forward and recomputed in the
# backward; bit-identical to the same grid without it
UP_PROJ_TWINS = {"cp2_ring_up_proj": "cp2_ring"}  # TP2 + SP x CP2: tests/training/test_recompute.py
# V3.2's dense warm-up (--dsa-dense-warmup): dense attention, only the indexer trains; against CP = 1's warm-up,
# and its first forward against the same model without DSA (MLA alone: the same weights but the indexer's,
# which layout-invariant init draws by name), which dense attention must equal.
WARMUPS = {
    "cp1_warmup": (1, WARMUP, None),
    "cp1_mla": (1, [], None),  # no DSA flags (`_flags`)
    "cp2_ring_warmup": (2, CP2 + WARMUP, "cp1_warmup"),
    "cp2_all_gather_warmup": (2, CP2 + ALL_GATHER + WARMUP, "cp1_warmup"),
    "tp2sp_cp2_warmup": (4, TP2SP + CP2 + WARMUP, "cp1_warmup"),
}
RUNS.update(WARMUPS)
# The two stages in sequence: 2 warm-up iterations saved, then sparse training loaded from them (CP2 ring).
STAGES = "cp2_ring_warmup_then_sparse"
RUNS[STAGES] = (2, CP2, None)


def _flags(name):
    return MODEL + MLA_FLAGS + STD + ([] if name == "cp1_mla" else DSA_FLAGS) + RUNS[name][1]
QUICK = ("cp2_ring",)


def _min_topk_gap(record):
    """`indexer_topk` that also records the smallest relative gap between each query's k-th and (k+1)-th
    scores (where it has k + 1 causal keys) into ``record``; its selection is unchanged. Scores of exactly 0
    (every head's ReLU off) are exact in every layout and summation order, so ties among them are real
    and the lower position wins everywhere: they are not gaps."""
    import torch

    from cp_ext.attention.dsa import indexer as dsa_indexer

    original = dsa_indexer.indexer_topk

    def topk_and_gap(q, w, k, *, topk, **kw):
        positions, scores = original(q, w, k, topk=topk + 1, **kw)
        kth, next_ = scores[..., topk - 1], scores[..., topk]
        has = torch.isfinite(next_) & (kth != 0)  # both 0 (ReLU): an exact tie, lower position wins everywhere
        if has.any():
            gap = ((kth - next_).abs() / torch.maximum(kth.abs(), next_.abs()))[has].min().item()
            record.append(gap)
        return positions[..., :topk], scores[..., :topk]

    return original, topk_and_gap


def _weights(trainer):
    return {name: p.detach().clone() for name, p in trainer.model[0].module.named_parameters()}


def _stages(name, results_dir):
    """2 warm-up iterations saved, then a sparse run loading them (--no-load-optim): where it starts, which
    weights moved in the warm-up, and that the sparse run trains every parameter."""
    from cp_ext.arguments import parse_args
    from cp_ext.training.trainer import Trainer

    save = str(Path(results_dir, "stages_ckpt"))
    warm = Trainer(parse_args(_flags(name) + WARMUP + ["--save", save, "--train-iters", "2"]))
    before = _weights(warm)
    for _ in range(2):
        warm.train_step()
    warm.checkpointer.save(save)
    after = _weights(warm)
    warm.shutdown(keep_process_group=True)
    moved = sorted({n.split(".indexer.")[-1] if ".indexer." in n else "main" for n in before
                    if not torch.equal(before[n], after[n])})
    sparse = Trainer(parse_args(_flags(name) + ["--load", save, "--no-load-optim", "--train-iters", "3"]))
    loaded = _weights(sparse)
    same = all(torch.equal(loaded[n], after[n]) for n in after)
    start = sparse.iteration
    metrics = sparse.train_step()
    trained = _weights(sparse)
    main_moved = any(not torch.equal(trained[n], loaded[n]) for n in trained if ".indexer." not in n)
    sparse.shutdown(keep_process_group=True)
    return dict(moved=moved, loaded_equal=same, start=start, main_moved=main_moved,
                indexer_loss=metrics["indexer loss"]), {}


# ----------------------------------------------------------------------------- worker
def worker():
    import os

    import torch
    import torch.distributed as dist

    from cp_ext.attention.dsa import indexer as dsa_indexer

    opts = worker_args(sys.argv[1:], required=["--layouts"])
    results = {"results_dir": opts.results_dir}
    for name in opts.layouts.split(","):
        gaps = []
        original, recording = _min_topk_gap(gaps)
        if RUNS[name][0] == 1:
            dsa_indexer.indexer_topk = recording
        try:
            if name == STAGES:
                results[name], grads = _stages(name, opts.results_dir)
            else:
                results[name], grads = _train(name, _flags(name))
        finally:
            dsa_indexer.indexer_topk = original
        results[name]["min topk gap"] = min(gaps) if gaps else None
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
            wanted = [name] if quick else [n for n, (size, _, _) in RUNS.items() if size == world]
            done.update(launch_layouts(__file__, world, wanted, timeout=900))
        return done[name]

    return get


@pytest.mark.parametrize("layout", [pytest.param(n, marks=[pytest.mark.quick] if n in QUICK else [])
                                    for n, (_, _, ref) in RUNS.items() if ref and n not in WARMUPS])
def test_dsa_matches_cp1(layout, runs):
    reference = runs(RUNS[layout][2])
    assert reference[0]["min topk gap"] > 1e-4, reference[0]["min topk gap"]
    result = runs(layout)
    assert result[0]["indexer loss"][0] > 1e-3  # the loss is there, and not ~0
    indexer = [u for u in reference[1] if ".indexer." in u]
    assert {u.split(".indexer.")[1].split(".")[0] for u in indexer} == {"linear_wq_b", "linear_wk", "k_norm",
                                                                         "linear_weights_proj"}
    assert all(reference[1][u].abs().max() > 0 for u in indexer), "every indexer parameter learns"
    _assert_same(result, reference)


@pytest.mark.parametrize("layout", list(UP_PROJ_TWINS))
def test_mla_up_proj_recompute_is_bit_identical(layout, runs):
    (run, grads), (ref, ref_grads) = runs(layout), runs(UP_PROJ_TWINS[layout])
    assert run["up proj recompute"] == [True] and ref["up proj recompute"] == [False]
    for key in ("lm loss", "indexer loss", "grad norm"):
        assert run[key] == ref[key], (key, run[key], ref[key])
    assert grads.keys() == ref_grads.keys()
    for unit, g in ref_grads.items():
        assert torch.equal(grads[unit], g), unit


@pytest.mark.parametrize("layout", [n for n, (_, _, ref) in WARMUPS.items() if ref])
def test_dense_warmup_matches_cp1(layout, runs):
    """The warm-up at CP2 ring, all-gather and TP2+SP x CP2 equals CP = 1's: losses, indexer loss, grad norm
    and the indexer's gradients within 1e-5; every other parameter has no gradient (frozen)."""
    (run, grads), (ref, ref_grads) = runs(layout), runs(RUNS[layout][2])
    for key in ("lm loss", "indexer loss", "grad norm"):
        for a, b in zip(run[key], ref[key]):
            assert abs(a - b) <= 1e-5 * abs(b), f"{key} {a} vs CP = 1's {b}"
    indexer = [u for u in ref_grads if ".indexer." in u]
    assert indexer and all(ref_grads[u].abs().max() > 0 for u in indexer)
    assert all(ref_grads[u].abs().max() == 0 and grads[u].abs().max() == 0 for u in ref_grads if u not in indexer)
    for unit in indexer:
        err, scale = (grads[unit] - ref_grads[unit]).abs().max().item(), ref_grads[unit].abs().max().item()
        assert err <= 1e-5 * scale, f"{unit}: {err:.3e} vs max {scale:.3e}"


def test_dense_warmup_attends_densely(runs):
    """The warm-up's first LM loss is MLA's without DSA (the same weights): its attention is dense."""
    warm, mla = runs("cp1_warmup")[0]["lm loss"][0], runs("cp1_mla")[0]["lm loss"][0]
    assert abs(warm - mla) <= 1e-6 * abs(mla), (warm, mla)
    sparse = runs("cp1")[0]["lm loss"][0]
    assert abs(sparse - mla) > 1e-4 * abs(mla), "top-8 of 32 keys must differ from dense attention"


def test_warmup_checkpoint_continues_into_sparse_training(runs):
    """2 warm-up iterations move the indexer's weights only; the sparse run loads every weight, starts at
    iteration 2, and trains every parameter."""
    result = runs(STAGES)[0]
    assert result["moved"] == ["k_norm.bias", "k_norm.weight", "linear_weights_proj.weight", "linear_wk.weight",
                               "linear_wq_b.weight"], result["moved"]
    assert result["loaded_equal"] and result["start"] == 2 and result["main_moved"]
    assert result["indexer_loss"] > 0


def test_sparse_loss_changes_the_indexer_loss(runs):
    """--dsa-indexer-use-sparse-loss has an effect: the loss over the selected keys is not the dense one."""
    dense, sparse = runs("cp1")[0]["indexer loss"][0], runs("cp1_sparse")[0]["indexer loss"][0]
    assert abs(dense - sparse) > 1e-3 * dense, (dense, sparse)


if __name__ == "__main__":
    worker()
