"""--overlap-grad-reduce / --overlap-param-gather reach megatron's DDP and change nothing but timing.

One launch of 2 gloo ranks (DP2) trains the same small MoE GPT for 3 iterations (fp32, 4
microbatches per iteration) four times on the same process groups:

    dp2                   plain DDP (one synchronous all-reduce per iteration, after the backward)
    dp2_overlap           --overlap-grad-reduce: all-reduce bucket by bucket from the backward hooks
    dp2_distopt           --use-distributed-optimizer (synchronous reduce-scatter / all-gather)
    dp2_distopt_overlap   + --overlap-grad-reduce --overlap-param-gather: reduce-scatter from the
                          backward hooks, parameter all-gather from the next forward's pre-hooks

Small DDP buckets (`BUCKET`) give several buckets, so the overlapped runs really dispatch
collectives during the backward / forward; the worker counts those dispatches. Each overlapped run
is compared with its synchronous twin: the lm loss, load-balancing loss and grad norm of every
iteration, the parameters after the last step and (without the distributed optimizer, where every
rank holds the whole reduced gradient) every parameter's gradient, within 1e-6 relative.
"""

import sys

import pytest

from tests.launch import launch, worker_args, write_results

MODEL = [
    "--position-embedding-type", "rope", "--disable-bias-linear", "--swiglu", "--normalization", "RMSNorm", "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--group-query-attention", "--num-query-groups", "2",
    "--ffn-hidden-size", "64", "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "48",
    "--seq-length", "32", "--micro-batch-size", "1", "--global-batch-size", "8", "--train-iters", "3",
    "--lr", "1e-3", "--lr-warmup-iters", "1", "--seed", "11", "--clip-grad", "1.0", "--device", "cpu",
]
CASES = {
    "dp2": [],
    "dp2_overlap": ["--overlap-grad-reduce"],
    "dp2_distopt": ["--use-distributed-optimizer"],
    "dp2_distopt_overlap": ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"],
}
PAIRS = [("dp2_overlap", "dp2"), ("dp2_distopt_overlap", "dp2_distopt")]
BUCKET = 4000  # parameters per DDP bucket (megatron's default, 40M, would make one bucket)
TOLERANCE = 1e-6


@pytest.fixture(scope="module")
def results():
    return launch(__file__, 2, *MODEL, timeout=600)


@pytest.mark.parametrize("run, ref", PAIRS, ids=[run for run, _ in PAIRS])
def test_overlap_equals_synchronous(results, run, ref):
    for rank, records in results.items():
        got, want = records[run], records[ref]
        for key in ("lm loss", "load balancing loss", "grad norm"):
            for it, (a, b) in enumerate(zip(got[key], want[key])):
                assert abs(a - b) <= TOLERANCE * abs(b), f"rank {rank} iteration {it + 1}: {key} {a} vs {b}"
        assert got["param_rel_err"] <= TOLERANCE, (rank, got["param_worst"], got["param_rel_err"])
        if "grad_rel_err" in got:
            assert got["grad_rel_err"] <= TOLERANCE, (rank, got["grad_worst"], got["grad_rel_err"])


@pytest.mark.quick
def test_overlap_really_overlapped(results):
    """The overlapped runs dispatched collectives from the hooks; the synchronous ones never did."""
    for records in results.values():
        for name in CASES:
            r = records[name]
            overlapped = "overlap" in name
            assert r["bucket_groups"] > (1 if overlapped else 0), (name, r["bucket_groups"])
            # iteration 1 learns which grads each bucket waits for; from iteration 2 the hooks dispatch
            assert (r["hook_grad_dispatches"][1:] == [r["bucket_groups"]] * 2) if overlapped else \
                not any(r["hook_grad_dispatches"]), (name, r["hook_grad_dispatches"])
            assert (r["async_param_gathers"] > 0) == (name == "dp2_distopt_overlap"), (name, r["async_param_gathers"])


# ----------------------------------------------------------------------------- worker


def _rel_err(tensors, ref):
    """max |a - b| / max(|b|, 1e-3 max |ref|), over a dict of tensors, and where it is largest."""
    worst, where = 0.0, None
    largest = max(t.abs().max().item() for t in ref.values())
    for name, b in ref.items():
        err = (tensors[name] - b).abs().max().item() / max(b.abs().max().item(), 1e-3 * largest)
        if err > worst:
            worst, where = err, name
    return worst, where


def _counting_collectives():
    """Wrap megatron's bucket-group sync calls to count the dispatches overlap makes.

    A grad sync started outside ``finish_grad_sync`` came from a backward hook; a param sync
    started asynchronously (not ``force_sync``) with overlap on came from a forward pre-hook.
    """
    from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBucketGroup as Group

    counts = {"hook_grad": 0, "async_param": 0, "in_finish": False}
    start_grad, finish_grad, start_param = Group.start_grad_sync, Group.finish_grad_sync, Group.start_param_sync

    def start_grad_sync(self, *args, **kwargs):
        counts["hook_grad"] += not counts["in_finish"]
        return start_grad(self, *args, **kwargs)

    def finish_grad_sync(self, *args, **kwargs):
        counts["in_finish"] = True
        try:
            return finish_grad(self, *args, **kwargs)
        finally:
            counts["in_finish"] = False

    def start_param_sync(self, force_sync=False):
        counts["async_param"] += bool(self.ddp_config.overlap_param_gather and not force_sync)
        return start_param(self, force_sync=force_sync)

    Group.start_grad_sync, Group.finish_grad_sync, Group.start_param_sync = (
        start_grad_sync, finish_grad_sync, start_param_sync)
    return counts


def _run_case(flags, counts):
    import functools

    import cp_ext.training.trainer as trainer_module

    from cp_ext.arguments import parse_args

    real_config = trainer_module.DistributedDataParallelConfig
    trainer_module.DistributedDataParallelConfig = functools.partial(real_config, bucket_size=BUCKET)
    try:
        trainer = trainer_module.Trainer(parse_args(flags))
    finally:
        trainer_module.DistributedDataParallelConfig = real_config
    ddp = trainer.model[0]
    assert ddp.ddp_config.overlap_grad_reduce == ("--overlap-grad-reduce" in flags)
    assert ddp.ddp_config.overlap_param_gather == ("--overlap-param-gather" in flags)
    record = {"lm loss": [], "load balancing loss": [], "grad norm": [], "hook_grad_dispatches": [],
              "bucket_groups": len(ddp.bucket_groups) + len(ddp.expert_parallel_bucket_groups)}
    counts["async_param"] = 0
    for _ in range(3):
        counts["hook_grad"] = 0
        metrics = trainer.train_step()
        record["hook_grad_dispatches"].append(counts["hook_grad"])
        for key in ("lm loss", "load balancing loss", "grad norm"):
            record[key].append(metrics.get(key, 0.0))
    record["async_param_gathers"] = counts["async_param"]
    grads = {name: p.main_grad.detach().clone() for name, p in ddp.module.named_parameters()}
    if ddp.ddp_config.use_distributed_optimizer:
        ddp.start_param_sync(force_sync=True)  # with overlap, the last step's all-gather waits for a next forward
    params = {name: p.detach().clone() for name, p in ddp.module.named_parameters()}
    return record, grads, params


def worker():
    import warnings

    warnings.simplefilter("ignore")
    opts = worker_args(sys.argv[1:])
    counts = _counting_collectives()
    records, grads, params = {}, {}, {}
    for name, flags in CASES.items():
        records[name], grads[name], params[name] = _run_case(list(opts.extra) + flags, counts)
    for run, ref in PAIRS:
        records[run]["param_rel_err"], records[run]["param_worst"] = _rel_err(params[run], params[ref])
        if "--use-distributed-optimizer" not in CASES[run]:  # distopt: each rank holds only its shard reduced
            records[run]["grad_rel_err"], records[run]["grad_worst"] = _rel_err(grads[run], grads[ref])
    write_results(opts.results_dir, records)


if __name__ == "__main__":
    worker()
