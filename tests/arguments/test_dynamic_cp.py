"""Dynamic context parallelism's flags (`cp_ext.arguments.dynamic_cp`): Megatron-LM's spelling, defaults and
meaning, and one clear error per mistake, naming the flag and the fix."""

import pytest

from cp_ext.arguments import parse_args
from tests.arguments.common import _error

DYNAMIC = ["--dynamic-context-parallel", "--calculate-per-token-loss", "--seq-length", "64",
           "--max-seqlen-per-dp-cp-rank", "16"]


@pytest.mark.quick
@pytest.mark.parametrize(
    "argv, world, must_name",
    [
        (DYNAMIC[:1] + DYNAMIC[2:], 4, ["needs --calculate-per-token-loss", "add it"]),
        (DYNAMIC[:-2], 4, ["needs --max-seqlen-per-dp-cp-rank", "--seq-length / --context-parallel-size = 64"]),
        (DYNAMIC[:-1] + ["8"], 4, ["--max-seqlen-per-dp-cp-rank 8 x 4 DP x CP ranks = 32 tokens cannot hold",
                                   "raise it to at least 16"]),
        (DYNAMIC + ["--sequence-packing-scheduler", "dp_balanced"], 4, ["dp_balanced is static CP's packing"]),
        (DYNAMIC + ["--min-dynamic-context-parallel-size", "3"], 4, ["--min-dynamic-context-parallel-size 3 must "
                                                                      "divide the 4 DP x CP ranks"]),
        (["--sequence-packing-scheduler", "balanced"], 1, ["--sequence-packing-scheduler balanced", "add it"]),
        (["--max-seqlen-per-dp-cp-rank", "16"], 1, ["take effect with --dynamic-context-parallel only"]),
        (DYNAMIC + ["--pipeline-model-parallel-size", "2", "--num-layers", "2", "--tensor-model-parallel-size", "2",
                    "--sequence-parallel"], 4, ["--pipeline-model-parallel-size > 1 with TP", "use PP 1 or TP 1"]),
        (DYNAMIC + ["--context-parallel-size", "2", "--cp-comm-type", "a2a"], 4, ["Ulysses", "use p2p"]),
        (DYNAMIC + ["--synthetic-task", "passkey"], 4, ["--synthetic-task passkey", "--data-path"]),
        (DYNAMIC + ["--num-experts", "4", "--expert-model-parallel-size", "2"], 4,
         ["--moe-token-dispatcher-type allgather", "use --moe-token-dispatcher-type alltoall"]),
        (DYNAMIC + ["--num-experts", "4", "--pipeline-model-parallel-size", "2", "--num-layers", "2"], 4,
         ["--pipeline-model-parallel-size > 1 and --moe-token-dispatcher-type allgather", "alltoall"]),
        (DYNAMIC + ["--pipeline-model-parallel-size", "2", "--num-layers", "2", "--recompute-granularity", "full",
                    "--recompute-method", "uniform", "--recompute-num-layers", "1"], 4,
         ["--pipeline-model-parallel-size > 1 and --recompute-granularity full", "use PP 1 or no full recompute"]),
    ],
    ids=["without-per-token-loss", "budget-missing", "budget-too-small", "dp-balanced", "min-size-not-dividing",
         "scheduler-without-dynamic", "budget-without-dynamic", "pipeline", "ulysses", "synthetic",
         "ep-allgather", "pp-allgather", "pp-full-recompute"],
)
def test_bad_dynamic_cp_flags_name_the_flag(argv, world, must_name):
    message = _error(argv, world)
    for text in must_name:
        assert text in message, f"{text!r} missing from: {message}"


def test_an_unknown_scheduler_is_refused_by_name():
    message = _error(DYNAMIC + ["--sequence-packing-scheduler", "fastest"], 4)
    assert "--sequence-packing-scheduler: invalid choice: 'fastest'" in message and "balanced" in message


def test_megatron_core_0_16_to_0_19_name_turns_it_on_with_megatrons_scheduler():
    args = parse_args(["--hybrid-context-parallel"] + DYNAMIC[1:], world_size=4)
    assert args.dynamic_context_parallel and args.sequence_packing_scheduler == "default_dynamic_cp"
    assert args.min_dynamic_context_parallel_size == 1
    assert parse_args(DYNAMIC + ["--sequence-packing-scheduler", "balanced"], world_size=4).sequence_packing_scheduler \
        == "balanced"


def test_mtp_with_router_losses_needs_megatron_core_0_18():
    """Before 0.18 megatron's MTP layers take no padding mask, so their routers would count padding."""
    from cp_ext.megatron_version import at_least, installed

    argv = DYNAMIC + ["--num-experts", "4", "--mtp-num-layers", "1"]
    if at_least(installed(), "0.18"):
        assert parse_args(argv, world_size=4).mtp_num_layers == 1
    else:
        assert "use megatron-core 0.18+, or --moe-aux-loss-coeff 0" in _error(argv, 4)
    assert parse_args(argv + ["--moe-aux-loss-coeff", "0"], world_size=4).mtp_num_layers == 1
