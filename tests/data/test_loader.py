"""The loader on real indexed files and real process groups (4 gloo ranks, one launch, many grids).

For each grid (DP4; CP2 zigzag x DP2; CP2 Ulysses x DP2; CP4 = U2 x ring 2; TP2 x CP2
contiguous; PP2 x CP2; PP4; TP2 x PP2), every rank runs `microbatches` for 3 global batches
of a 2-file weighted blend (GPTDataset through BlendedMegatronDatasetBuilder) and records
what it holds. Checked here:
  * every token of every sample lands on exactly one CP rank of its DP replica, once, at its
    global position id, and `context_parallel_unshard` gives the dataset's sample back;
  * DP ranks hold disjoint samples whose union is the global batch;
  * the global batches (ids and tokens) are the same for every DP/CP/TP/PP grid;
  * consecutive global batches cover samples 0..3G-1 once, and starting from a
    consumed-samples count reproduces the later batches (resume);
  * pipeline stages read only what they need (middle stages of PP4: nothing).
The worker also builds the embedded corpus (a small slice) from 4 ranks at once without
a process group, i.e. 4 racing builders, which must all end up with one valid dataset.
"""

import sys
from pathlib import Path

import numpy as np
import pytest

from tests.launch import launch, worker_args, write_results

SEQ, GBS, ITERS, VOCAB = 32, 8, 3, 300
# name: (tp, pp, cp, ulysses, layout, micro batch size)
GRIDS = {
    "dp4": (1, 1, 1, 1, "zigzag", 1),
    "cp2_zigzag_dp2": (1, 1, 2, 1, "zigzag", 2),
    "cp2_ulysses_dp2": (1, 1, 2, 2, "zigzag", 1),
    "cp4_u2_ring2": (1, 1, 4, 2, "zigzag", 2),
    "tp2_cp2_contiguous": (2, 1, 2, 1, "contiguous", 1),
    "pp2_cp2": (1, 2, 2, 1, "zigzag", 2),
    "pp4": (1, 4, 1, 1, "zigzag", 1),
    "tp2_pp2": (2, 2, 1, 1, "zigzag", 4),
}


def _write_corpus(directory):
    from cp_ext.data.indexed import write_indexed_dataset

    rng = np.random.default_rng(0)
    prefixes = []
    for name, count in (("a", 120), ("b", 80)):
        docs = [rng.integers(0, VOCAB - 1, size=int(rng.integers(3, 90))) for _ in range(count)]
        prefixes.append(str(directory / name))
        write_indexed_dataset(prefixes[-1], docs, VOCAB)
    return prefixes


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    directory = tmp_path_factory.mktemp("loader")
    a, b = _write_corpus(directory)
    results = launch(__file__, 4, "--data-path", "0.6", a, "0.4", b, "--data-cache-path", directory / "cache",
                     timeout=600)
    return results


def _records(runs, grid):
    return [r for rank in sorted(runs) for r in runs[rank]["grids"][grid]]


@pytest.mark.parametrize("grid", list(GRIDS))
def test_every_token_once_on_one_cp_rank(runs, grid):
    reference = runs[0]["reference"]
    for key in ("tokens", "labels", "loss_mask"):  # first PP stage: tokens; last: labels, loss mask
        pieces = {}
        for r in _records(runs, grid):
            assert r["position_ids"] == r["positions"], "position ids must be the global positions this rank holds"
            assert r["unsharded_ok"], "context_parallel_unshard did not give the original sample back"
            if r[key] is not None and r["tp"] == 0:
                pieces.setdefault((r["iteration"], r["dp"], r["sample"]), []).append(r)
        assert len(pieces) == ITERS * GBS
        for (it, dp, sample), parts in pieces.items():
            positions = sorted(p for part in parts for p in part["positions"])
            assert positions == list(range(SEQ)), f"{key} of sample {sample} (iteration {it}) at positions {positions}"
            full = reference[str(sample)][key]
            for part in parts:
                assert part[key] == [full[p] for p in part["positions"]], f"{key} of sample {sample} differ"


@pytest.mark.parametrize("grid", list(GRIDS))
def test_dp_disjoint_and_same_global_batches_on_every_grid(runs, grid):
    expected = [list(range(it * GBS, (it + 1) * GBS)) for it in range(ITERS)]
    for it in range(ITERS):
        by_dp = {}
        for r in _records(runs, grid):
            if r["iteration"] == it:
                by_dp.setdefault(r["dp"], set()).add(r["sample"])
        ids = [s for dp in sorted(by_dp) for s in sorted(by_dp[dp])]
        assert len(ids) == len(set(ids)), f"DP ranks share samples: {by_dp}"
        assert sorted(ids) == expected[it], f"global batch {it} is {sorted(ids)}"  # no repeat, no skip
    tensors = {}
    for r in _records(runs, grid):
        if r["tokens"] is not None:
            tensors.setdefault((r["sample"], tuple(r["positions"])), r["tokens"])
    baseline = {}
    for r in _records(runs, "dp4"):
        baseline[r["sample"]] = r["tokens"]
    for (sample, positions), tokens in tensors.items():
        assert tokens == [baseline[sample][p] for p in positions]


@pytest.mark.quick
def test_resume_from_consumed_samples(runs):
    for rank, result in runs.items():
        assert result["resume_ok"], f"rank {rank}: resuming from consumed samples gave other batches"


def test_only_stages_that_need_data_read_it(runs):
    for r in _records(runs, "pp4"):
        stage = r["pp"]
        assert (r["tokens"] is not None) == (stage == 0), f"stage {stage} tokens"
        assert (r["labels"] is not None) == (stage == 3), f"stage {stage} labels"
    assert runs[1]["pp4_built"] is False and runs[2]["pp4_built"] is False  # middle stages: no dataset


def test_embedded_corpus_built_once_by_racing_ranks(runs):
    prefixes = {result["embedded_prefix"] for result in runs.values()}
    assert len(prefixes) == 1
    assert len({result["embedded_docs"] for result in runs.values()}) == 1 and runs[0]["embedded_docs"] >= 1
    assert not [p for p in Path(prefixes.pop()).parent.parent.iterdir() if p.name.startswith(".building-")]


def worker():
    import warnings

    warnings.simplefilter("ignore")
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    from cp_ext import parallel_state as cp_state
    from cp_ext.arguments import parse_args
    from cp_ext.data.datasets import build_train_dataset
    from cp_ext.data.embedded import embedded_prefix
    from cp_ext.token_partition import context_parallel_unshard
    from cp_ext.platform import setup_platform
    from cp_ext.training.batches import microbatches

    opts = worker_args(sys.argv[1:])
    cache = opts.extra[opts.extra.index("--data-cache-path") + 1]
    out = {}
    # 4 racing builders (no process group yet): each gets the same, complete dataset.
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    out["embedded_prefix"] = embedded_prefix(cache, max_bytes=200_000)
    out["embedded_docs"] = len(IndexedDataset(out["embedded_prefix"]))

    device = setup_platform("cpu")
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    out["grids"], out["reference"] = {}, {}
    for name, (tp, pp, cp, u, layout, mbs) in GRIDS.items():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                                 context_parallel_size=cp)
        cp_state.initialize_context_parallel(u)
        args = parse_args([*opts.extra, "--seq-length", str(SEQ), "--global-batch-size", str(GBS),
                           "--micro-batch-size", str(mbs), "--train-iters", str(ITERS), "--position-embedding-type", "rope", "--disable-bias-linear", "--swiglu", "--normalization", "RMSNorm", "--num-layers", "4",
                           "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
                           "--context-parallel-size", str(cp), "--ulysses-size", str(u), "--vocab-size", str(VOCAB),
                           *(["--cp-load-balance", "none"] if layout == "contiguous" else [])], world_size=4)
        dataset = build_train_dataset(args)
        if name == "pp4":
            out["pp4_built"] = dataset.samples is not None
        positions = cp_state.get_context_parallel_positions(SEQ, layout)
        dp, dp_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
        first, last = parallel_state.is_pipeline_first_stage(), parallel_state.is_pipeline_last_stage()
        cp_group = parallel_state.get_context_parallel_group()
        records, batches = [], []

        def run(consumed):
            return list(microbatches(dataset, consumed_samples=consumed, global_batch_size=GBS, micro_batch_size=mbs,
                                     dp_rank=dp, dp_size=dp_size, device=device, positions=positions,
                                     first_stage=first, last_stage=last))

        for it in range(ITERS):
            batches.append(run(it * GBS))
            for mb in batches[-1]:
                for row, sample in enumerate(mb.sample_ids.tolist()):
                    record = {"iteration": it, "dp": dp, "tp": parallel_state.get_tensor_model_parallel_rank(),
                              "pp": parallel_state.get_pipeline_model_parallel_rank(), "sample": sample,
                              "positions": positions.tolist(), "position_ids": mb.position_ids[row].tolist()}
                    for key in ("tokens", "labels", "loss_mask"):
                        value = getattr(mb, key)
                        record[key] = None if value is None else value[row].tolist()
                    if first and last:
                        full = dataset[sample]
                        record["unsharded_ok"] = all(
                            torch.equal(context_parallel_unshard(getattr(mb, key)[row:row + 1], 1, positions, cp_group)[0],
                                        full[key].to(getattr(mb, key).dtype))
                            for key in ("tokens", "labels", "loss_mask", "position_ids"))
                    else:
                        record["unsharded_ok"] = True
                    records.append(record)
            if rank == 0 and name == "dp4":  # the samples themselves, read straight from the dataset
                for sample in range(it * GBS, (it + 1) * GBS):
                    out["reference"][str(sample)] = {k: dataset[sample][k].tolist() for k in ("tokens", "labels", "loss_mask")}
        if name == "cp2_zigzag_dp2":  # resume: a fresh start from consumed samples continues exactly
            resumed = [run(it * GBS) for it in range(1, ITERS)]
            out["resume_ok"] = all(torch.equal(a.tokens, b.tokens) and (a.sample_ids == b.sample_ids).all()
                                   for x, y in zip(resumed, batches[1:]) for a, b in zip(x, y))
        out["grids"][name] = records
        cp_state.destroy_grid()
    write_results(opts.results_dir, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    worker()
