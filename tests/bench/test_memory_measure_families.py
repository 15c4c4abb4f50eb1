"""The planner's activation bytes (`cp_ext.perf.memory.activation_bytes` on `ModelShape.from_args`)
within 5% of what tools/measure_memory.py measures, per rank, on every family of tests/families
at toy size (MLA with its latent exchange at CP2, q-LoRA, dense-first layers, shared experts,
qk-norm, kv_channels, biases, sinks, windows, quick-GeGLU) and on DeepSeek-V4 (its three attention
layers, hyper-connections, the sqrtsoftplus and hash routers), in fp32 at CP1, CP2 and CP2 with cp_ext's
CP-aware full recompute, and in bf16 (as the scripts train: norms and logits stay fp32) at CP2.

One 2-rank launch measures all twenty-four runs (CP1 runs as DP2 on the same two ranks): the tool's own
`measure` (`cp_ext.bench.memory_measure`) per run, the process group kept between trainers. The
scripts' recompute flags (--recompute-activations, --moe-layer-recompute) are dropped: the planner
models full recompute only.
"""

import sys

import pytest

from cp_ext.bench import memory_measure
from tests.families import FAMILIES, tiny
from tests.launch import launch, worker_args, write_results

TOLERANCE = 0.05
DROPPED = {"--bf16", "--recompute-activations", "--moe-layer-recompute"}  # fp32 unless asked; no selective recompute
CP2 = ["--context-parallel-size", "2", "--global-batch-size", "1"]
# name: (CP, grid flags, the model / recompute flags the planner reads too, the tool's recompute mode)
RUNS = {"cp1": (1, ["--global-batch-size", "2"], [], "none"), "cp2": (2, CP2, [], "none"),
        "cp2-full-cp-aware": (2, CP2, memory_measure.MODES["full-cp-aware"], "full-cp-aware"),
        "cp2-bf16": (2, CP2, ["--bf16"], "none")}

# DeepSeek-V4 (tests/training's tiny V4: sliding, CSA, HCA, CSA layers, hyper-connections, hash MoE), not a script
V4_FAMILY = "deepseek_v4"
MEASURED = FAMILIES + (V4_FAMILY,)


def flags(family):
    """The family at toy size, fp32, 256 tokens, on CPU (the grid comes from `RUNS`)."""
    if family == V4_FAMILY:
        from tests.training.test_deepseek_v4_training import V4
        from tests.training.test_grid_equivalence import MODEL

        model = MODEL + V4
    else:
        model = tiny(family)
    return [t for t in model if t not in DROPPED] + [
        "--device", "cpu", "--seq-length", "256", "--max-position-embeddings", "256"]


@pytest.fixture(scope="module")
def measured():
    return launch(__file__, 2, timeout=600)


@pytest.mark.parametrize("family", MEASURED)
def test_planner_within_5_percent_of_the_measured_activations(family, measured):
    for run, (cp, _, extra, mode) in RUNS.items():
        for rank, results in measured.items():
            record = results[f"{family}/{run}"]
            assert record["cp"] == cp and record["tokens"] == 256 // cp
            # the CP1 run is DP2: estimated as the one-rank run it is per rank
            est = memory_measure.planner_estimate(record, flags(family) + extra, mode)
            got = record["activation_bytes"]
            assert abs(est / got - 1) <= TOLERANCE, (family, run, rank, est, got, est / got - 1)


def worker():
    import functools

    import torch
    import torch.distributed as dist

    from cp_ext.training.trainer import Trainer

    torch.set_num_threads(1)
    # measure() shuts each trainer down; keep the groups so the same ranks build the next one
    Trainer.shutdown = functools.partialmethod(Trainer.shutdown, keep_process_group=True)
    opts = worker_args(sys.argv[1:])
    results = {}
    for family in MEASURED:
        for run, (_, grid, extra, _) in RUNS.items():
            record = memory_measure.measure(flags(family) + grid + extra, 2)
            record.pop("largest")
            results[f"{family}/{run}"] = record
    write_results(opts.results_dir, results)
    dist.destroy_process_group()


if __name__ == "__main__":
    worker()
