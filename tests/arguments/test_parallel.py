"""The grid flags (TP, PP, CP, DP, EP, Ulysses, --cp-comm-type) and the early, clear errors for a bad grid
(`cp_ext.arguments.parallel`, `cp_ext.grid`)."""

import pytest

from cp_ext.arguments import parse_args
from tests.arguments.common import MOE, _error
from tests.launch import REPO_ROOT


@pytest.mark.quick
@pytest.mark.parametrize(
    "argv, world, must_name",
    [
        (["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"], 6,
         ["world size 6", "--tensor-model-parallel-size", "--pipeline-model-parallel-size"]),
        (["--tensor-model-parallel-size", "3", "--num-attention-heads", "4", "--hidden-size", "48"], 3,
         ["--num-attention-heads 4", "--tensor-model-parallel-size 3"]),
        (["--tensor-model-parallel-size", "2", "--num-attention-heads", "4", "--group-query-attention", "--num-query-groups", "1"], 2,
         ["--num-query-groups 1"]),
        (["--position-embedding-type", "rope", "--disable-bias-linear", "--swiglu", "--normalization", "RMSNorm", "--num-layers", "3", "--pipeline-model-parallel-size", "2"], 2, ["--num-layers 3", "--pipeline-model-parallel-size 2"]),
        (["--global-batch-size", "6", "--micro-batch-size", "2"], 2, ["--global-batch-size 6", "--micro-batch-size 2"]),
        (MOE + ["--num-experts", "6", "--expert-model-parallel-size", "4"], 4, ["--num-experts 6", "--expert-model-parallel-size 4"]),
        (MOE + ["--tensor-model-parallel-size", "2"], 2, ["--sequence-parallel"]),
        (["--context-parallel-size", "2", "--seq-length", "30"], 2, ["--seq-length 30", "--context-parallel-size"]),
        (["--context-parallel-size", "4", "--ulysses-size", "3"], 4, ["--ulysses-size 3", "--context-parallel-size 4"]),
        (["--context-parallel-size", "2", "--cp-comm-type", "a2a+p2p"], 2, ["--hierarchical-context-parallel-sizes"]),
        (["--context-parallel-size", "2", "--cp-comm-type", "p2p", "--ulysses-size", "2"], 2, ["contradicts --cp-comm-type p2p"]),
        (["--context-parallel-size", "4", "--ulysses-size", "4", "--num-attention-heads", "6", "--hidden-size", "48",
          "--seq-length", "32"], 4, ["--ulysses-size 4", "6 query heads"]),
        (["--context-parallel-size", "2", "--attention-dropout", "0.1"], 2, ["--attention-dropout 0"]),
        (["--save-interval", "5"], 1, ["--save-interval 5 needs --save"]),
        (["--tensorboard-dir", str(REPO_ROOT / "README.md")], 1,
         [f"--tensorboard-dir {REPO_ROOT / 'README.md'}: is a file, not a directory"]),
        (["--tensorboard-dir", str(REPO_ROOT / "README.md" / "tb")], 1,
         [f"cannot be created: {REPO_ROOT / 'README.md'} is a file"]),
        (["--log-timers-to-tensorboard", "--log-validation-ppl-to-tensorboard"], 1,
         ["--log-validation-ppl-to-tensorboard and --log-timers-to-tensorboard need --tensorboard-dir DIR"]),
        (["--tensorboard-dir", "tb", "--tensorboard-log-interval", "0"], 1,
         ["--tensorboard-log-interval: must be an integer >= 1 (got 0)"]),
        (["--tensor-model-parallel-size", "2", "--make-vocab-size-divisible-by", "7"], 2,
         ["--make-vocab-size-divisible-by 7", "--tensor-model-parallel-size 2"]),
        (["--context-parallel-size", "2", "--position-embedding-type", "rope", "--disable-bias-linear", "--swiglu", "--normalization", "RMSNorm", "--num-layers", "4", "--cp-comm-type", "p2p", "all_gather"], 2,
         ["--cp-comm-type lists 2 types", "--num-layers 4"]),
        (["--context-parallel-size", "2", "--position-embedding-type", "rope", "--disable-bias-linear", "--swiglu", "--normalization", "RMSNorm", "--num-layers", "2", "--cp-comm-type", "p2p", "a2a"], 2,
         ["--cp-comm-type mixes a2a and p2p", "all_gather with one other type"]),
        (["--context-parallel-size", "2", "--cp-comm-type", "allgather"], 2, ["--cp-comm-type", "all_gather"]),
        (["--context-parallel-size", "2", "--cp-comm-type", "all_gather", "--ulysses-size", "2"], 2,
         ["--ulysses-size contradicts --cp-comm-type all_gather", "give one of them"]),
        (["--mtp-num-layers", "0"], 1, ["--mtp-num-layers", "an integer >= 1", "got 0"]),
        (["--mtp-num-layers", "1", "--mtp-loss-scaling-factor", "-0.1"], 1, ["--mtp-loss-scaling-factor", ">= 0"]),
        (["--mtp-loss-scaling-factor", "0.3"], 1, ["--mtp-loss-scaling-factor 0.3 is only read with --mtp-num-layers"]),
        (["--num-layers", "4", "--mtp-num-layers", "1", "--pipeline-model-parallel-size", "2"], 2,
         ["--mtp-num-layers with --pipeline-model-parallel-size 2 needs RoPE or no position embedding",
          "learned_absolute"]),
        (["--mtp-num-layers", "1", "--recompute-granularity", "full", "--recompute-method", "block",
          "--recompute-num-layers", "1"], 1, ["--mtp-num-layers with --recompute-granularity full needs "
                                              "--recompute-method uniform --recompute-num-layers 1",
                                              "--recompute-method block"]),
    ],
    ids=["world-vs-grid", "heads-vs-tp", "groups-vs-tp", "layers-vs-pp", "batch-vs-dp", "experts-vs-ep", "moe-tp-needs-sp",
         "seq-vs-cp", "ulysses-vs-cp", "hierarchical-missing", "comm-type-contradiction", "heads-vs-ulysses",
         "cp-dropout", "save-interval-without-save", "tensorboard-dir-is-a-file",
         "tensorboard-dir-under-a-file", "tensorboard-switches-without-dir", "tensorboard-interval-0",
         "vocab-padding-vs-tp",
         "comm-type-list-length", "comm-type-list-mixes-two-layouts", "comm-type-misspelt",
         "all-gather-contradicts-ulysses", "mtp-layers-0", "mtp-scale-negative", "mtp-scale-without-mtp",
         "mtp-pp-learned-positions", "mtp-with-full-recompute"],
)
def test_bad_grid_names_the_flags(argv, world, must_name):
    message = _error(argv, world)
    for text in must_name:
        assert text in message, f"{text!r} missing from: {message}"


def test_cp_comm_type_maps_onto_ulysses_size():
    base = ["--seq-length", "64"]
    assert parse_args(base + ["--context-parallel-size", "4", "--cp-comm-type", "a2a"], world_size=4).ulysses_size == 4
    assert parse_args(base + ["--context-parallel-size", "4", "--cp-comm-type", "p2p"], world_size=4).ulysses_size == 1
    args = parse_args(base + ["--context-parallel-size", "4", "--cp-comm-type", "a2a+p2p",
                              "--hierarchical-context-parallel-sizes", "2", "2"], world_size=4)
    assert args.ulysses_size == 2
    assert parse_args(base + ["--context-parallel-size", "4", "--ulysses-size", "2"], world_size=4).ulysses_size == 2


def test_cp_comm_type_per_layer_lists():
    """Megatron's per-layer form: all_gather layers on the layout of the run's one other type."""
    base = ["--seq-length", "64", "--position-embedding-type", "rope", "--disable-bias-linear", "--swiglu", "--normalization", "RMSNorm", "--num-layers", "4", "--context-parallel-size", "4"]
    args = parse_args(base + ["--cp-comm-type", "all_gather"], world_size=4)
    assert args.ulysses_size == 1 and args.cp_comm_types == ["all_gather"] * 4
    args = parse_args(base + ["--cp-comm-type", "a2a+p2p", "all_gather", "a2a+p2p", "all_gather",
                              "--hierarchical-context-parallel-sizes", "2", "2"], world_size=4)
    assert args.ulysses_size == 2 and args.cp_comm_types == ["a2a+p2p", "all_gather", "a2a+p2p", "all_gather"]
    args = parse_args(base + ["--cp-comm-type", "a2a", "a2a", "a2a", "a2a"], world_size=4)
    assert args.ulysses_size == 4 and args.cp_comm_types is None  # no all_gather layer: the groups decide


def test_all_problems_reported_together():
    message = _error(["--position-embedding-type", "rope", "--disable-bias-linear", "--swiglu", "--normalization", "RMSNorm", "--num-layers", "3", "--pipeline-model-parallel-size", "2", "--num-experts", "3",
                      "--expert-model-parallel-size", "2"], 2)
    assert "--num-layers 3" in message and "--num-experts 3" in message


def test_good_grid_derives_dp_and_batch():
    args = parse_args(MOE + ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--expert-model-parallel-size", "2"], world_size=8)
    assert args.data_parallel_size == 4 and args.global_batch_size == 4 and args.expert_tensor_parallel_size == 2
