"""A checkpoint saved at one grid loads at any other and training continues exactly.

One 4-rank gloo launch: an uninterrupted 8-iteration run, then for each pair of grids a run
that trains 4 iterations at the first grid and saves (megatron dist_checkpointing, torch_dist),
and a run at the second grid that loads it and trains iterations 5-8. Their fp32 losses must
equal the uninterrupted run's within 1e-5 relative: model weights, Adam moments, Adam's step,
the LR schedule and the data position all moved across TP, PP, EP, CP, DP and the optimizer
kind (``--use-distributed-optimizer`` on or off). Also measured: bytes each rank writes.

Megatron-LM's MoE scripts (tests/families: MLA, dense-first layers, shared experts, q/k
norms, biases and sinks, and Qwen3.5's Gated DeltaNet layers, whose in_proj and conv are saved
as megatron's per-section tensors and resharded over TP) do the same in the same launch: saved
at CP2 x EP2, loaded at TP2+SP x PP2, in fp32.
"""

import sys
from pathlib import Path

import pytest

from tests.families import FAMILIES, LINEAR_FAMILIES, tiny
from tests.launch import launch, selected, worker_args, write_results

BASE = ["--num-experts", "4", "--position-embedding-type", "rope", "--disable-bias-linear", "--swiglu", "--normalization", "RMSNorm", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "32", "--global-batch-size", "4", "--train-iters", "8", "--lr", "1e-3",
        "--lr-warmup-iters", "2", "--seed", "5", "--log-interval", "1", "--device", "cpu"]
DISTOPT = ["--use-distributed-optimizer"]
GRIDS = {
    "dp4_ep2": ["--expert-model-parallel-size", "2"],
    "dp4_ep2_distopt": ["--expert-model-parallel-size", "2", *DISTOPT],
    "tp2_sp_ep2": ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--expert-model-parallel-size", "2"],
    "pp2_ep2": ["--pipeline-model-parallel-size", "2", "--expert-model-parallel-size", "2"],
    "dp4_ep1": [],
    "dp2_cp2_ep2": ["--context-parallel-size", "2", "--expert-model-parallel-size", "2"],
    "tp2_sp_pp2_distopt": ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--pipeline-model-parallel-size", "2",
                           *DISTOPT],
    "cp4_u2r2": ["--context-parallel-size", "4", "--ulysses-size", "2"],
    # MTP: its layers (on the last stage at PP2, beside a copy of the embedding) move to CP4 U2 x R2
    "pp2_cp2_mtp": ["--pipeline-model-parallel-size", "2", "--context-parallel-size", "2", "--mtp-num-layers", "1"],
    "cp4_u2r2_mtp": ["--context-parallel-size", "4", "--ulysses-size", "2", "--mtp-num-layers", "1"],
}
MTP_REFERENCE = ["--mtp-num-layers", "1"]  # the uninterrupted run of the MTP pairs (DP4)
PAIRS = [  # (saving grid, loading grid): every supported reshard, each way
    ("dp4_ep2", "tp2_sp_ep2"), ("tp2_sp_ep2", "dp4_ep2"),
    ("dp4_ep2", "pp2_ep2"), ("pp2_ep2", "dp4_ep2"),
    ("dp4_ep2", "dp4_ep1"), ("dp4_ep1", "dp4_ep2"),
    ("dp4_ep2_distopt", "dp2_cp2_ep2"), ("dp2_cp2_ep2", "dp4_ep2_distopt"),
    ("tp2_sp_pp2_distopt", "cp4_u2r2"),
    ("pp2_cp2_mtp", "cp4_u2r2_mtp"),
]
SAVED_AT = 4
FAMILY_SAVE = ["--context-parallel-size", "2", "--expert-model-parallel-size", "2"]
FAMILY_LOAD = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",  # expert-TP 1 (GPT-OSS's
               "--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "1",  # biased experts), EP2
               "--sequence-parallel"]  # the scripts' own, but for Qwen3.5's, whose launcher's parallel flags add it
FAMILY_ITERS, FAMILY_SAVED_AT = 4, 2


QUICK = "dp4_ep2-to-tp2_sp_ep2"  # the quick subset's pair: the launch then runs only it


@pytest.fixture(scope="module")
def results(quick):
    return launch(Path(__file__), 4, cases=[QUICK] if quick else None, timeout=1200)[0]


@pytest.mark.parametrize("pair", [pytest.param(pair, id=f"{pair[0]}-to-{pair[1]}",
                                               marks=[pytest.mark.quick] if f"{pair[0]}-to-{pair[1]}" == QUICK else [])
                                  for pair in PAIRS])
def test_resumes_at_another_grid_as_if_uninterrupted(results, pair):
    name = f"{pair[0]}-to-{pair[1]}"
    mtp = name.endswith("_mtp")
    ref, resumed = results["uninterrupted_mtp" if mtp else "uninterrupted"], results[name]
    assert resumed["start_iteration"] == SAVED_AT
    assert len(resumed["losses"]) == len(ref) - SAVED_AT
    for it, (got, want) in enumerate(zip(resumed["losses"], ref[SAVED_AT:]), start=SAVED_AT + 1):
        assert abs(got - want) <= 1e-5 * abs(want), f"{name}: iteration {it}: {got} vs uninterrupted {want}"
    if mtp:  # the MTP layer's weights and moments came along: its loss continues too
        for it, (got, want) in enumerate(zip(resumed["mtp_1 losses"], results["uninterrupted_mtp_1"][SAVED_AT:]),
                                         start=SAVED_AT + 1):
            assert abs(got - want) <= 1e-5 * abs(want), f"{name}: iteration {it}: mtp_1 loss {got} vs {want}"


@pytest.mark.parametrize("family", FAMILIES + LINEAR_FAMILIES)
def test_family_resumes_at_another_grid_as_if_uninterrupted(results, family):
    ref, resumed = results[f"{family}-uninterrupted"], results[f"{family}-resumed"]
    assert resumed["start_iteration"] == FAMILY_SAVED_AT and len(resumed["losses"]) == FAMILY_ITERS - FAMILY_SAVED_AT
    for it, (got, want) in enumerate(zip(resumed["losses"], ref[FAMILY_SAVED_AT:]), start=FAMILY_SAVED_AT + 1):
        assert abs(got - want) <= 1e-5 * abs(want), f"{family}: iteration {it}: {got} vs uninterrupted {want}"


def test_a_fresh_optimizer_would_be_caught(results):
    """The same comparison fails when the optimizer state is not carried over (--no-load-optim)."""
    ref, fresh = results["uninterrupted"], results["no-load-optim"]
    assert fresh["losses"][0] == pytest.approx(ref[SAVED_AT], rel=1e-5)  # weights alone: iteration 5 matches
    assert abs(fresh["losses"][1] - ref[SAVED_AT + 1]) > 1e-5 * abs(ref[SAVED_AT + 1])  # moments lost: 6 differs


def test_each_rank_writes_about_a_quarter_at_dp4(results):
    for grid in ("dp4_ep2", "dp4_ep2_distopt"):
        per_rank = results["bytes_per_rank"][grid]
        total = sum(per_rank)
        assert len(per_rank) == 4 and min(per_rank) > 0, per_rank
        assert max(per_rank) <= 0.4 * total, f"{grid}: one rank writes {max(per_rank)} of {total} bytes"


def _trainer(flags, base=BASE):
    from cp_ext.arguments import parse_args
    from cp_ext.training.trainer import Trainer

    return Trainer(parse_args(base + flags))


def _family(family):
    """The script's flags at toy sizes in fp32 (exactness), 4 iterations."""
    return [t for t in tiny(family, "--train-iters", str(FAMILY_ITERS), "--log-interval", "1") if t != "--bf16"]


def _train(trainer, until, key="lm loss", also=None):
    losses = []
    while trainer.iteration < until:
        metrics = trainer.train_step()
        losses.append(metrics[key])
        if also is not None:
            also.append(metrics["mtp_1 loss"])
    return losses


def _bytes_per_rank(directory, world):
    return [sum(f.stat().st_size for f in Path(directory).glob(f"__{rank}_*.distcp")) for rank in range(world)]


def worker():
    import tempfile
    import warnings

    import torch.distributed as dist

    warnings.simplefilter("ignore")
    opts = worker_args(sys.argv[1:])
    out = {"bytes_per_rank": {}}
    trainer = _trainer(GRIDS["dp4_ep2"])
    out["uninterrupted"] = _train(trainer, 8)

    root = Path(tempfile.mkdtemp(prefix="cp_ext_reshard_")) if dist.get_rank() == 0 else None
    holder = [str(root) if root else None]
    dist.broadcast_object_list(holder, src=0)
    root = Path(holder[0])
    saved = {}
    pairs = selected([f"{a}-to-{b}" for a, b in PAIRS], opts)
    if any(name.endswith("_mtp") for name in pairs):
        out["uninterrupted_mtp_1"] = []
        out["uninterrupted_mtp"] = _train(_trainer(MTP_REFERENCE), 8, also=out["uninterrupted_mtp_1"])
    for source, target in [pair for pair in PAIRS if f"{pair[0]}-to-{pair[1]}" in pairs]:
        if source not in saved:
            trainer = _trainer(GRIDS[source])
            _train(trainer, SAVED_AT)
            trainer.checkpointer.save(root / source)
            saved[source] = root / source
            if source.startswith("dp4"):
                out["bytes_per_rank"][source] = _bytes_per_rank(saved[source] / f"iter_{SAVED_AT:07d}", 4)
        trainer = _trainer(GRIDS[target] + ["--load", str(saved[source])])
        start = trainer.iteration
        mtp_losses = [] if target.endswith("_mtp") else None
        out[f"{source}-to-{target}"] = {"start_iteration": start, "losses": _train(trainer, 8, also=mtp_losses),
                                        "mtp_1 losses": mtp_losses}
    if opts.cases is None:  # the whole launch (not the quick subset's one pair)
        trainer = _trainer(GRIDS["dp4_ep2"] + ["--load", str(saved["dp4_ep2"]), "--no-load-optim"])
        out["no-load-optim"] = {"losses": _train(trainer, 8)}
        for family in FAMILIES + LINEAR_FAMILIES:
            out[f"{family}-uninterrupted"] = _train(_trainer(FAMILY_SAVE, _family(family)), FAMILY_ITERS)
            trainer = _trainer(FAMILY_SAVE, _family(family))
            _train(trainer, FAMILY_SAVED_AT)
            trainer.checkpointer.save(root / family)
            trainer = _trainer(FAMILY_LOAD + ["--load", str(root / family)], _family(family))
            out[f"{family}-resumed"] = {"start_iteration": trainer.iteration, "losses": _train(trainer, FAMILY_ITERS)}
    write_results(opts.results_dir, out)


if __name__ == "__main__":
    worker()
