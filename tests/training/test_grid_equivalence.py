"""Same seed + same data => same model on every TP x PP x CP x DP x EP grid (fp32, 3 iterations).

Each layout trains 3 iterations of one small MoE GPT. Compared against the
single-process run (TP1 PP1 DP1):
  * the global-batch lm loss, MoE load-balancing loss and grad norm of every
    iteration (relative 1e-5);
  * the full gradient of every parameter after iteration 1, reassembled from the
    ranks' slices through megatron's sharded_state_dict map.
The TP2+SP layout also checks the sequence-parallel norms: their gradients are only
right if megatron's finalize_model_grads sums them over TP. The CP layouts cover the
ring, Ulysses and the hybrid through the real model (RoPE at global positions, sharded
tokens and loss mask, the per-token loss over DP x CP), and a CP rank whose whole shard
is masked out.
"""

import math
import sys
from pathlib import Path

import pytest
import torch

from tests.launch import launch, worker_args, write_results

MODEL = [
    "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--num-query-groups", "2",
    "--ffn-hidden-size", "64", "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "48",
    "--seq-length", "32", "--micro-batch-size", "1", "--global-batch-size", "8", "--train-iters", "3",
    "--lr", "1e-3", "--lr-warmup-iters", "1", "--seed", "11", "--clip-grad", "1.0",
]

LAYOUTS = {
    "tp1pp1dp1": (1, []),
    "tp2sp_dp2": (4, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    "pp2_dp2": (4, ["--pipeline-model-parallel-size", "2"]),
    "dp4_distopt": (4, ["--use-distributed-optimizer"]),
    "dp4_ep2": (4, ["--expert-model-parallel-size", "2"]),
    "tp2pp2dp2_ep2": (8, ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                          "--pipeline-model-parallel-size", "2", "--expert-model-parallel-size", "2"]),
    # context parallelism
    "cp2_ring": (2, ["--context-parallel-size", "2"]),
    "cp2_ring_contiguous": (2, ["--context-parallel-size", "2", "--cp-comm-type", "p2p", "--cp-load-balance", "none"]),
    "cp2_ulysses": (2, ["--context-parallel-size", "2", "--ulysses-size", "2"]),
    "cp4_ulysses2_ring2": (4, ["--context-parallel-size", "4", "--cp-comm-type", "a2a+p2p",
                               "--hierarchical-context-parallel-sizes", "2", "2"]),
    "pp2_cp2": (4, ["--pipeline-model-parallel-size", "2", "--context-parallel-size", "2"]),
    "tp2cp2dp2_ep2": (8, ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--context-parallel-size", "2",
                          "--expert-model-parallel-size", "2"]),
}

# Loss mask zero on the second half of every sample: with contiguous CP2, rank 1 holds
# no token that counts, and must neither produce NaN nor skew the average.
MASK_SECOND_HALF = "--test-mask-second-half"
MASKED = {
    "cp1_masked": (1, [MASK_SECOND_HALF]),
    "cp2_contiguous_masked": (2, [MASK_SECOND_HALF, "--context-parallel-size", "2", "--cp-load-balance", "none"]),
}
LAYOUTS.update(MASKED)

# Packed documents (Megatron's --reset-attention-mask --reset-position-ids --eod-mask-loss) on a
# corpus of short documents (1-12 tokens: shorter than a CP4 zigzag chunk of 4, single-token
# ones, and ones spanning several ranks in a 32-token sample), against CP=1 with the same flags.
DOC_FLAGS = ["--reset-attention-mask", "--reset-position-ids", "--eod-mask-loss"]
DOCUMENTS = {
    "cp1_docs": (1, []),
    "cp2_ring_docs": (2, ["--context-parallel-size", "2"]),
    "cp4_ulysses2_ring2_docs": (4, ["--context-parallel-size", "4", "--cp-comm-type", "a2a+p2p",
                                    "--hierarchical-context-parallel-sizes", "2", "2"]),
    "cp2_all_gather_docs": (2, ["--context-parallel-size", "2", "--cp-comm-type", "all_gather"]),
    # per-layer types: the U2 x R2 hybrid and all_gather layers on the same layout
    "cp4_hybrid_and_all_gather_docs": (4, ["--context-parallel-size", "4", "--cp-comm-type", "a2a+p2p",
                                           "all_gather", "a2a+p2p", "all_gather",
                                           "--hierarchical-context-parallel-sizes", "2", "2"]),
    "pp2_cp2_docs": (4, ["--pipeline-model-parallel-size", "2", "--context-parallel-size", "2"]),
    "tp2cp2dp2_ep2_docs": (8, ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--context-parallel-size",
                               "2", "--expert-model-parallel-size", "2"]),
}
LAYOUTS.update({name: (n, flags + DOC_FLAGS) for name, (n, flags) in DOCUMENTS.items()})


def write_short_documents(prefix, num_documents=300, seed=5):
    """An indexed dataset (ByteTokenizer ids) of documents of 1-12 tokens, each ending with EOD."""
    import numpy as np

    from cp_ext.data.indexed import IndexedDatasetWriter
    from cp_ext.data.tokenizers import build_tokenizer

    eod = build_tokenizer("ByteTokenizer", None).eod
    rng = np.random.default_rng(seed)
    writer = IndexedDatasetWriter(str(prefix), np.uint16)
    for _ in range(num_documents):
        writer.add(np.append(rng.integers(32, 127, rng.integers(0, 12)), eod))
    writer.finalize()
    writer.commit()
    return str(prefix)


@pytest.fixture(scope="module")
def short_documents(tmp_path_factory):
    return write_short_documents(tmp_path_factory.mktemp("short_docs") / "docs")


def _run(name, *extra):
    nproc, flags = LAYOUTS[name]
    results = launch(__file__, nproc, *MODEL, *flags, *extra, timeout=600)
    out_dir = Path(results[0]["results_dir"])
    if "--use-distributed-optimizer" in flags:
        # Its reduce-scatter leaves each DP rank only its own shard of the reduced gradient
        # (the rest of the buffer holds local partial sums), so gradients are compared through
        # the grad norm and the losses of the following iterations.
        return results[0], None
    full = {}
    for rank in range(nproc):
        for unit, (shape, index, values) in torch.load(out_dir / f"grads_rank{rank}.pt", weights_only=False).items():
            for idx, val in zip(index, values):
                full.setdefault(unit, torch.zeros(shape, dtype=torch.float64))[idx] = val.double()
    return results[0], full


@pytest.fixture(scope="module")
def reference():
    return _run("tp1pp1dp1")


@pytest.fixture(scope="module")
def masked_reference():
    return _run("cp1_masked")


@pytest.mark.parametrize("layout", [k for k in LAYOUTS if k != "tp1pp1dp1" and k not in MASKED and k not in DOCUMENTS])
def test_layout_matches_single_process(layout, reference):
    _assert_same(_run(layout), reference)


@pytest.fixture(scope="module")
def documents_reference(short_documents):
    return _run("cp1_docs", "--data-path", short_documents)


@pytest.mark.parametrize("layout", [k for k in DOCUMENTS if k != "cp1_docs"])
def test_packed_documents_match_single_process(layout, documents_reference, short_documents):
    _assert_same(_run(layout, "--data-path", short_documents), documents_reference)


def test_packed_documents_change_training(documents_reference, short_documents):
    """Without the flags the same data trains differently: the comparisons above see the masks."""
    nproc, flags = DOCUMENTS["cp1_docs"]
    unmasked = launch(__file__, nproc, *MODEL, *flags, "--data-path", short_documents, timeout=600)[0]
    for a, b in zip(unmasked["lm loss"], documents_reference[0]["lm loss"]):
        assert abs(a - b) > 1e-3 * abs(b), (a, b)


def test_fully_masked_cp_shard(masked_reference):
    result = _run("cp2_contiguous_masked")
    run = result[0]
    assert all(math.isfinite(x) for x in run["lm loss"] + run["grad norm"])
    _assert_same(result, masked_reference)


def _assert_same(result, reference):
    (run, grads), (ref, ref_grads) = result, reference
    for key in ("lm loss", "load balancing loss", "grad norm"):
        for it, (a, b) in enumerate(zip(run[key], ref[key])):
            assert abs(a - b) <= 1e-5 * abs(b), f"iteration {it + 1}: {key} {a} vs single-process {b}"
    if grads is None:
        return
    assert sorted(grads) == sorted(ref_grads), "the layouts disagree on which parameters exist"
    largest = max(g.abs().max().item() for g in ref_grads.values())
    for unit, ref in ref_grads.items():
        err = (grads[unit] - ref).abs().max().item()
        scale = max(ref.abs().max().item(), 1e-3 * largest)
        assert err <= 1e-5 * scale, f"{unit}: max |grad - ref| = {err:.3e}, max |ref| = {scale:.3e}"
    norm_units = [u for u in ref_grads if "norm" in u]
    assert norm_units and all(ref_grads[u].abs().max() > 0 for u in norm_units), "norm grads must be non-trivial"


def _grad_slices(model):
    """{unit: (full shape, [index...], [local grad...])} of this rank, after the last backward."""
    from cp_ext.models.layout import iter_global_slices, parameters_showing_grads

    out = {}
    with parameters_showing_grads(model):
        for piece in iter_global_slices(model):
            entry = out.setdefault(piece.unit, (piece.unit_shape, [], []))
            entry[1].append(piece.index)
            entry[2].append(piece.local.detach().clone())
    return out


def worker():
    import os
    import warnings

    warnings.simplefilter("ignore")
    from cp_ext.arguments import parse_args
    from cp_ext.training.trainer import Trainer

    opts = worker_args(sys.argv[1:])
    mask_second_half = MASK_SECOND_HALF in opts.extra
    trainer = Trainer(parse_args([a for a in opts.extra if a != MASK_SECOND_HALF]))
    if mask_second_half:
        import cp_ext.training.trainer as trainer_module

        real_microbatches = trainer_module.microbatches
        seq = trainer.args.seq_length

        def masked(*args, **kwargs):
            for mb in real_microbatches(*args, **kwargs):
                mb.loss_mask[mb.position_ids >= seq // 2] = 0.0
                yield mb

        trainer_module.microbatches = masked
    history, grads = {"lm loss": [], "load balancing loss": [], "grad norm": []}, None
    for _ in range(3):
        metrics = trainer.train_step()
        for key in history:
            history[key].append(metrics[key])
        if grads is None:
            grads = _grad_slices(trainer.model[0].module)
    torch.save(grads, Path(opts.results_dir, f"grads_rank{os.environ['RANK']}.pt"))
    write_results(opts.results_dir, {**history, "results_dir": opts.results_dir})
    trainer.shutdown()


if __name__ == "__main__":
    worker()
