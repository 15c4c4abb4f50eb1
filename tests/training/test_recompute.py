"""Activation recompute is exact: every recompute mode gives the run without recompute.

One launch per world size (CP1; CP2 ring; CP4 = U2 x R2, PP2 x CP2 and TP2 x CP2 + SP with EP2) trains the
same small MoE GPT for 2 iterations in fp32 once per recompute mode and grid, on the same
ranks, and compares each mode with the mode-less run of the same grid, rank by rank: the
global lm loss, the MoE load-balancing loss and the grad norm of every iteration, and every
parameter's gradient after iteration 1, within 1e-6 relative.

It also counts the bytes each mode sends (`cp_ext.perf.counter`) in iteration 1: with
CP-aware full recompute the ring traffic equals the run without recompute (the ring runs
forward once and backward once), while Megatron's plain full recompute sends the forward's
KV blocks a second time; and that CP-aware recompute really replayed kept outputs (the CP=1
case included, where the local kernel's output is kept). The CP2 launch adds a dense model
(selective ``mlp``), hidden dropout under full recompute (the recomputed forward must draw the
same masks) and ``--distribute-saved-activations`` on the same 2 ranks re-gridded as TP2 without
SP (megatron's split of each checkpointed input is counted). The CP2, CP4 and PP2 x CP2 grids
also train packed documents (``--reset-attention-mask`` on a corpus of short documents) with and
without CP-aware full recompute, and the CP2 launch the same with ``--cp-comm-type all_gather``.
"""

import sys

import pytest

from tests.launch import launch, worker_args, write_results

DENSE_MODEL = [
    "--position-embedding-type", "rope", "--disable-bias-linear", "--swiglu", "--normalization", "RMSNorm", "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--group-query-attention", "--num-query-groups", "2",
    "--ffn-hidden-size", "64", "--seq-length", "32", "--micro-batch-size", "1", "--global-batch-size", "2",
    "--train-iters", "2", "--lr", "1e-3", "--lr-warmup-iters", "1", "--seed", "11", "--clip-grad", "1.0",
    "--device", "cpu",
]
MODEL = DENSE_MODEL + ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "48"]
FULL = ["--recompute-granularity", "full", "--recompute-method"]
MODES = {
    "none": [],
    "full_uniform": FULL + ["uniform", "--recompute-num-layers", "1"],
    "full_uniform_2layers": FULL + ["uniform", "--recompute-num-layers", "2"],
    "full_block": FULL + ["block", "--recompute-num-layers", "1"],
    "full_uniform_plain": FULL + ["uniform", "--recompute-num-layers", "1", "--no-cp-aware-recompute"],
    "full_block_plain": FULL + ["block", "--recompute-num-layers", "1", "--no-cp-aware-recompute"],
    "selective_core_attn": ["--recompute-granularity", "selective", "--recompute-modules", "core_attn"],
    "selective_layernorm": ["--recompute-granularity", "selective", "--recompute-modules", "layernorm"],
    "selective_moe": ["--recompute-granularity", "selective", "--recompute-modules", "moe"],
}
# Extra pairs (baseline, recompute) on the CP2 launch only: "dense" runs DENSE_MODEL; "dense_tp2"
# re-grids the same 2 ranks as TP2 without sequence parallelism, where megatron's
# --distribute-saved-activations applies.
TP2 = ["--context-parallel-size", "1", "--tensor-model-parallel-size", "2"]
EXTRA = {
    "dense_none": [],
    "dense_selective_mlp": ["--recompute-granularity", "selective", "--recompute-modules", "mlp"],
    "dense_tp2_none": TP2,
    "dense_tp2_full_distributed": TP2 + FULL + ["uniform", "--recompute-num-layers", "1",
                                                "--distribute-saved-activations"],
    "dropout_none": ["--hidden-dropout", "0.2"],
    "dropout_full_uniform": ["--hidden-dropout", "0.2"] + FULL + ["uniform", "--recompute-num-layers", "1"],
}
GRIDS = {
    "cp1": (1, []),  # CP-aware recompute keeps the local kernel's output too
    "cp2_ring": (2, ["--context-parallel-size", "2"]),
    "cp4_ulysses2_ring2": (4, ["--context-parallel-size", "4", "--cp-comm-type", "a2a+p2p",
                               "--hierarchical-context-parallel-sizes", "2", "2"]),
    "pp2_cp2": (4, ["--pipeline-model-parallel-size", "2", "--context-parallel-size", "2", "--global-batch-size", "2"]),
    "tp2cp2_ep2": (4, ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--context-parallel-size", "2",
                       "--expert-model-parallel-size", "2"]),
}
# --recompute-modules mla_up_proj on DeepSeek-V3's attention (tests/training/test_grid_equivalence.py's MLA flags),
# against the same MLA model without it, on the grids of its three paths: CP1's local attention, the CP2 launch's
# latent ring and --cp-mla-exchange kv (megatron's own projections, as under Ulysses), and MLA's TP projections
# (TP2 + SP x CP2); the all-gathered latent takes the ring's projections. The recompute redoes the same ops on the same inputs, so
# the gradients must be bit-identical (tolerance 0), and megatron's recompute hook must have run.
MLA_FLAGS = ["--multi-latent-attention", "--qk-layernorm", "--num-query-groups", "4", "--q-lora-rank", "12",
             "--kv-lora-rank", "16", "--qk-head-dim", "8", "--qk-pos-emb-head-dim", "4", "--v-head-dim", "6",
             "--rotary-scaling-factor", "4", "--mscale-all-dim", "1.0"]
UP_PROJ = ["--recompute-granularity", "selective", "--recompute-modules", "mla_up_proj"]
MLA_RUNS = {"mla_none": [], "mla_up_proj": UP_PROJ}
MLA_EXTRA_RUNS = {"mla_kv_none": ["--cp-mla-exchange", "kv"], "mla_kv_up_proj": ["--cp-mla-exchange", "kv"] + UP_PROJ}
MLA_PAIRS = [("mla_up_proj", "mla_none")]
MLA_GRIDS = ("cp1", "cp2_ring", "tp2cp2_ep2")
MLA_EXTRA_PAIRS = [("mla_kv_up_proj", "mla_kv_none")]

# Packed documents (the document plan is made in the first forward and reused by the replay's
# backward), on every grid; on the CP2 launch also with all_gather attention. Data: short documents.
DOCS = ["--reset-attention-mask", "--reset-position-ids", "--eod-mask-loss"]
DOC_RUNS = {
    "docs_none": DOCS,
    "docs_full_uniform": DOCS + FULL + ["uniform", "--recompute-num-layers", "1"],
}
ALL_GATHER_DOC_RUNS = {
    "docs_all_gather_none": DOCS + ["--cp-comm-type", "all_gather"],
    "docs_all_gather_full_uniform": DOCS + ["--cp-comm-type", "all_gather"] + FULL + ["uniform", "--recompute-num-layers", "1"],
}
DOC_GRIDS = ("cp2_ring", "cp4_ulysses2_ring2", "pp2_cp2")  # the planning paths: ring, Ulysses x ring, stages
PAIRS = [(mode, "none") for mode in MODES if mode != "none"]
DOC_PAIRS = [("docs_full_uniform", "docs_none")]
EXTRA_PAIRS = [("dense_selective_mlp", "dense_none"), ("dropout_full_uniform", "dropout_none"),
               ("dense_tp2_full_distributed", "dense_tp2_none"),
               ("docs_all_gather_full_uniform", "docs_all_gather_none")]
TOLERANCE = 1e-6


@pytest.fixture(scope="module")
def launches(short_documents):
    """{grid: results}, filled one world size at a time: the grids of a size share one launch."""
    done = {}

    def get(grid):
        if grid not in done:
            world = GRIDS[grid][0]
            names = [g for g, (n, _) in GRIDS.items() if n == world]
            results = launch(__file__, world, "--grids", ",".join(names), "--docs", short_documents, timeout=1200)
            done.update({g: {rank: res[g] for rank, res in results.items()} for g in names})
        return done[grid]

    return get


@pytest.fixture(params=[pytest.param(grid, marks=[pytest.mark.quick] if grid == "cp1" else []) for grid in GRIDS])
def grid_results(request, launches):
    return request.param, launches(request.param)


def _check_pair(results, mode, base, tolerance=TOLERANCE):
    for rank, res in results.items():
        run, ref = res[mode], res[base]
        for key in ("lm loss", "load balancing loss", "grad norm"):
            for it, (a, b) in enumerate(zip(run[key], ref[key])):
                assert abs(a - b) <= tolerance * abs(b), f"rank {rank} iteration {it + 1}: {key} {a} vs {b} ({base})"
        assert run["grad_rel_err"] <= tolerance, f"rank {rank}: worst parameter gradient {run['grad_rel_err']:.2e} ({run['grad_worst']})"
        assert run["grads_compared"] > 10


def test_mla_up_proj_recompute_is_bit_identical(grid_results):
    """--recompute-modules mla_up_proj: MLA's up projections and RoPE recomputed in the backward (megatron's
    output-discarding checkpoint) give the very gradients of the run without it, on every exchange."""
    grid, results = grid_results
    if grid not in MLA_GRIDS:
        pytest.skip(f"mla_up_proj runs on {', '.join(MLA_GRIDS)}")
    for mode, base in MLA_PAIRS + (MLA_EXTRA_PAIRS if grid == "cp2_ring" else []):
        _check_pair(results, mode, base, tolerance=0.0)
        for rank, res in results.items():
            # every MLA layer's outputs were recomputed once per microbatch, in iteration 1 and 2
            assert res[mode]["up_proj_recomputes"] == 2 * 4 * res[mode]["microbatches"] // res[mode]["stages"], res[mode]
            assert res[base]["up_proj_recomputes"] == 0


def test_every_recompute_mode_is_exact(grid_results):
    grid, results = grid_results
    for mode, base in PAIRS + (DOC_PAIRS if grid in DOC_GRIDS else []) + (EXTRA_PAIRS if grid == "cp2_ring" else []):
        _check_pair(results, mode, base)
    if grid == "cp2_ring":
        # Dropout is really on (the loss moves), and the recomputed forward drew the same masks
        # (checked above: dropout_full_uniform equals dropout_none to 1e-6).
        assert abs(results[0]["dropout_none"]["lm loss"][0] - results[0]["none"]["lm loss"][0]) > 1e-4
        assert results[0]["dense_none"]["lm loss"] != results[0]["none"]["lm loss"]
        # --distribute-saved-activations split each checkpointed input over TP (megatron's call counted)
        assert all(r["dense_tp2_full_distributed"]["distributed_splits"] > 0 for r in results.values())
        assert all(r["dense_tp2_none"]["distributed_splits"] == 0 for r in results.values())


def test_cp_aware_recompute_replays_and_sends_the_ring_once(grid_results):
    grid, results = grid_results
    for rank, res in results.items():
        # CP-aware full recompute served every checkpointed layer's recompute from the kept outputs
        # (every layer with uniform, the first of each stage with block); plain never did.
        assert res["full_uniform"]["replayed"] > 0 and res["full_block"]["replayed"] > 0
        assert res["full_uniform"]["replayed"] > res["full_block"]["replayed"]  # block: only layer 1 of a stage
        assert res["full_uniform_plain"]["replayed"] == res["none"]["replayed"] == 0
        if grid in DOC_GRIDS:
            assert res["docs_full_uniform"]["replayed"] > 0 and res["docs_none"]["replayed"] == 0
        if grid == "cp2_ring":
            assert res["docs_all_gather_full_uniform"]["replayed"] > 0
            # --cp-comm-type all_gather really all-gathers (and sends nothing around the ring)
            gathered = res["docs_all_gather_none"]["comm"]
            assert gathered.get("all_gather_kv", 0) > 0 and gathered.get("reduce_scatter_dkv", 0) > 0, gathered
            assert "ring_p2p" not in gathered, gathered
        if grid == "cp1":
            assert res["none"]["comm"] == res["full_uniform"]["comm"] == {}, "CP=1 sends nothing"
            continue
        none, aware, plain = res["none"]["comm"], res["full_uniform"]["comm"], res["full_uniform_plain"]["comm"]
        ring = none.get("ring_p2p", 0)
        assert ring > 0, f"rank {rank}: no ring traffic counted"
        assert aware.get("ring_p2p", 0) == ring, f"rank {rank}: CP-aware full recompute sent {aware} vs {none} without"
        assert res["full_block"]["comm"].get("ring_p2p", 0) == ring
        # Megatron's plain full recompute re-runs every layer's ring forward: KV blocks travel again.
        assert plain["ring_p2p"] > ring, f"rank {rank}: plain recompute {plain} vs {none}"
        if "ulysses_a2a" in none:  # the all-to-all of q, k, v and out is rebuilt once, as with plain recompute
            assert aware["ulysses_a2a"] == plain["ulysses_a2a"] > none["ulysses_a2a"]


# ----------------------------------------------------------------------------- worker


def _local_grads(trainer):
    return {name: p.main_grad.detach().clone() for name, p in trainer.model[0].module.named_parameters()}


def _run_mode(base_flags, mode_flags):

    from cp_ext.arguments import parse_args
    from cp_ext.perf.counter import count_comm
    from cp_ext.training.trainer import Trainer

    from megatron.core.tensor_parallel import random as mcore_random

    splits = {"n": 0}
    real_split = mcore_random.split_tensor_into_1d_equal_chunks

    def counted_split(*args, **kwargs):  # what --distribute-saved-activations makes megatron call
        splits["n"] += 1
        return real_split(*args, **kwargs)

    mcore_random.split_tensor_into_1d_equal_chunks = counted_split
    recomputes = {"n": 0}
    real_recompute = mcore_random.CheckpointWithoutOutput._recompute

    def counted_recompute(self, *args):  # the output-discarding checkpoint's hook (mla_up_proj)
        if self.ctx is not None:
            recomputes["n"] += 1
        return real_recompute(self, *args)

    mcore_random.CheckpointWithoutOutput._recompute = counted_recompute
    trainer = Trainer(parse_args(base_flags + mode_flags))
    record = {"lm loss": [], "load balancing loss": [], "grad norm": []}
    grads = None
    for it in range(2):
        if it == 0:
            with count_comm() as counter:
                metrics = trainer.train_step()
            record["comm"] = dict(counter.bytes)
            grads = _local_grads(trainer)
        else:
            metrics = trainer.train_step()
        for key in ("lm loss", "load balancing loss", "grad norm"):
            record[key].append(metrics.get(key, 0.0))
    kept = [m.kept for m in trainer.model[0].modules() if getattr(m, "kept", None) is not None]
    assert kept and all(len(k) == 0 for k in kept), "CP-aware recompute left kept attention outputs behind"
    record["replayed"] = sum(k.replayed for k in kept)
    record["distributed_splits"] = splits["n"]
    mcore_random.split_tensor_into_1d_equal_chunks = real_split
    mcore_random.CheckpointWithoutOutput._recompute = real_recompute
    record["up_proj_recomputes"] = recomputes["n"]
    args = trainer.args
    record["microbatches"] = args.global_batch_size // (args.micro_batch_size * args.data_parallel_size)
    record["stages"] = args.pipeline_model_parallel_size
    return record, grads


def _compare_grads(grads, ref):
    worst, where = 0.0, None
    largest = max(g.abs().max().item() for g in ref.values())
    for name, g in ref.items():
        scale = max(g.abs().max().item(), 1e-3 * largest)
        err = (grads[name] - g).abs().max().item() / scale
        if err > worst:
            worst, where = err, name
    return worst, where


def _grid_records(grid, docs):
    grid_flags = GRIDS[grid][1]
    base, dense = MODEL + grid_flags, DENSE_MODEL + grid_flags
    runs = {name: (base, flags) for name, flags in MODES.items()}
    pairs = list(PAIRS)
    if grid in MLA_GRIDS:
        runs.update({name: (base + MLA_FLAGS, flags) for name, flags in MLA_RUNS.items()})
        pairs += MLA_PAIRS
    if grid in DOC_GRIDS:
        runs.update({name: (base + docs, flags) for name, flags in DOC_RUNS.items()})
        pairs += DOC_PAIRS
    if grid == "cp2_ring":
        runs.update({name: (dense if name.startswith("dense") else base, flags) for name, flags in EXTRA.items()})
        runs.update({name: (base + docs, flags) for name, flags in ALL_GATHER_DOC_RUNS.items()})
        runs.update({name: (base + MLA_FLAGS, flags) for name, flags in MLA_EXTRA_RUNS.items()})
        pairs += EXTRA_PAIRS + MLA_EXTRA_PAIRS
    records, grads = {}, {}
    for name, (flags, mode) in runs.items():
        records[name], grads[name] = _run_mode(list(flags), list(mode))
    for mode, ref in pairs:
        records[mode]["grad_rel_err"], records[mode]["grad_worst"] = _compare_grads(grads[mode], grads[ref])
        records[mode]["grads_compared"] = len(grads[ref])
    return records


def worker():
    import warnings

    warnings.simplefilter("ignore")
    opts = worker_args(sys.argv[1:])
    grids = opts.extra[opts.extra.index("--grids") + 1].split(",")
    docs = ["--data-path", opts.extra[opts.extra.index("--docs") + 1]]
    write_results(opts.results_dir, {grid: _grid_records(grid, docs) for grid in grids})


if __name__ == "__main__":
    worker()
