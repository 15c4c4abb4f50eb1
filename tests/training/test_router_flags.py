"""Megatron's MoE router flags: each changes training, and CP2 trains what DP2 does with it.

One 2-rank launch builds a Trainer per (router configuration, layout) and runs 3 iterations
of a small MoE GPT (fp32). For every configuration:
  * CP2 (ring) matches DP2 (the same global batch over two replicas; the grid test ties DP
    to the single process): lm loss, every MoE loss megatron's router tracks (load
    balancing, z loss, ...) and grad norm per iteration, every parameter's gradient after the
    first step, and the expert-bias buffers (aux-loss-free balancing) to 1e-5 relative;
  * the flags change something against the baseline router (top-2 softmax, aux loss): a
    flag that was accepted but ignored would leave the numbers equal.
--moe-expert-capacity-factor is Megatron's per-rank capacity, so which tokens drop depends
on the layout: it is checked for its effect only.
"""

import sys

import pytest

from tests.launch import launch, selected, worker_args, write_results

MODEL = [
    "--position-embedding-type", "rope", "--disable-bias-linear", "--swiglu", "--normalization", "RMSNorm", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--ffn-hidden-size", "64",
    "--num-experts", "4", "--moe-ffn-hidden-size", "32", "--seq-length", "32", "--micro-batch-size", "1",
    "--global-batch-size", "2", "--train-iters", "3", "--lr", "1e-2", "--seed", "5",
]

ROUTERS = {
    "baseline": [],
    "top1_pre_softmax": ["--moe-router-topk", "1", "--moe-router-pre-softmax"],
    "z_loss": ["--moe-z-loss-coeff", "0.1"],
    "seq_aux_loss": ["--moe-router-load-balancing-type", "seq_aux_loss", "--moe-aux-loss-coeff", "0.1"],
    "no_aux_loss": ["--moe-router-load-balancing-type", "none"],
    "sigmoid_expert_bias": ["--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
                            "--moe-router-bias-update-rate", "0.1", "--moe-router-topk-scaling-factor", "2.5"],
    "group_limited": ["--moe-router-num-groups", "2", "--moe-router-group-topk", "1"],
    "router_fp64": ["--moe-router-dtype", "fp64"],
    "capacity": ["--moe-expert-capacity-factor", "0.5"],
    "capacity_position": ["--moe-expert-capacity-factor", "0.5", "--moe-token-drop-policy", "position"],
}
LAYOUTS = {"dp2": [], "cp2": ["--context-parallel-size", "2"]}
LAYOUT_DEPENDENT = {"capacity", "capacity_position"}


@pytest.fixture(scope="module")
def runs(quick, short_documents):
    # A corpus of its own, not the embedded default (the running Python's standard library): the
    # same tokens on every Python and megatron-core the suite runs on.
    return launch(__file__, 2, *MODEL, "--data-path", short_documents, cases=["baseline"] if quick else None,
                  timeout=900)[0]


def _rel(a, b):
    return abs(a - b) / max(abs(a), abs(b), 1e-12)


@pytest.mark.parametrize("router", [pytest.param(r, marks=[pytest.mark.quick] if r == "baseline" else [])
                                    for r in ROUTERS if r not in LAYOUT_DEPENDENT])
def test_cp2_matches_dp2(runs, router):
    dp, cp = runs[f"{router}/dp2"], runs[f"{router}/cp2"]
    assert dp["metrics"].keys() == cp["metrics"].keys()
    for key, values in dp["metrics"].items():
        for it, (a, b) in enumerate(zip(values, cp["metrics"][key])):
            assert _rel(a, b) < 1e-5, f"{router}: {key} at iteration {it + 1}: DP2 {a} vs CP2 {b}"
    assert runs[f"{router}/grad_rel_err"] < 1e-5, runs[f"{router}/grad_worst"]
    assert runs[f"{router}/buffer_rel_err"] < 1e-5


@pytest.mark.parametrize("router", [r for r in ROUTERS if r != "baseline"])
def test_flags_change_training(runs, router):
    base, run = runs["baseline/dp2"]["metrics"], runs[f"{router}/dp2"]["metrics"]
    moved = max(_rel(a, b) for key in ("lm loss", "grad norm") for a, b in zip(base[key], run[key]))
    # fp64 routing in an fp32 model changes only the rounding; ignored, it would change nothing (bitwise)
    assert moved > (0 if router == "router_fp64" else 1e-4), f"{router}: the numbers equal the baseline's"


def test_drop_policy_changes_which_tokens_drop(runs):
    probs, position = runs["capacity/dp2"]["metrics"], runs["capacity_position/dp2"]["metrics"]
    assert max(_rel(a, b) for a, b in zip(probs["lm loss"], position["lm loss"])) > 1e-4


def test_expert_bias_moves_by_the_update_rate(runs):
    """megatron steps each bias by +-rate per iteration: after 3 iterations, multiples of 0.1 up to 0.3."""
    steps = [b / 0.1 for b in runs["sigmoid_expert_bias/dp2"]["bias_values"]]
    assert max(abs(x) for x in steps) > 0.5 and all(abs(x - round(x)) < 1e-4 and abs(x) <= 3 + 1e-4 for x in steps)


def test_moe_losses_are_reported(runs):
    assert "z loss" in runs["z_loss/dp2"]["metrics"] and "z loss" not in runs["baseline/dp2"]["metrics"]
    assert "seq load balancing loss" in runs["seq_aux_loss/dp2"]["metrics"]
    assert not any(key.endswith("balancing loss") for key in runs["no_aux_loss/dp2"]["metrics"])
    assert runs["sigmoid_expert_bias/dp2"]["bias_moved"], "--moe-router-enable-expert-bias left the bias at 0"


def _run(flags):
    import torch

    from cp_ext.arguments import parse_args
    from cp_ext.training.trainer import Trainer

    trainer = Trainer(parse_args(flags))
    metrics, module = {}, trainer.model[0].module
    for iteration in range(3):
        for key, value in trainer.train_step().items():
            if key.endswith("loss") or key == "grad norm":
                metrics.setdefault(key, []).append(float(value))
        if iteration == 0:  # later ones differ by the rounding the first step's update carries
            grads = {name: p.main_grad.detach().double().clone() for name, p in module.named_parameters()}
    buffers = {name: b.detach().double().clone() for name, b in module.named_buffers() if "expert_bias" in name}
    torch.distributed.barrier()
    return metrics, grads, buffers


def _max_rel(run, ref):
    worst, where = 0.0, None
    for name, value in ref.items():
        err = ((run[name] - value).abs().max() / value.abs().max().clamp(min=1e-12)).item()
        if err > worst:
            worst, where = err, name
    return worst, where


def worker():
    import warnings

    warnings.simplefilter("ignore")
    opts = worker_args(sys.argv[1:])
    results = {}
    for router in selected(ROUTERS, opts):
        router_flags = ROUTERS[router]
        runs = {layout: _run(list(opts.extra) + router_flags + layout_flags) for layout, layout_flags in LAYOUTS.items()}
        for layout, (metrics, _, buffers) in runs.items():
            results[f"{router}/{layout}"] = {"metrics": metrics,
                                             "bias_moved": any(b.abs().max().item() > 0 for b in buffers.values()),
                                             "bias_values": [x for b in buffers.values() for x in b.flatten().tolist()]}
        results[f"{router}/grad_rel_err"], results[f"{router}/grad_worst"] = _max_rel(runs["cp2"][1], runs["dp2"][1])
        results[f"{router}/buffer_rel_err"] = _max_rel(runs["cp2"][2], runs["dp2"][2])[0]
    write_results(opts.results_dir, results)


if __name__ == "__main__":
    worker()
