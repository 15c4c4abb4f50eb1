"""Validation loss under context parallelism equals CP=1's, and evaluation leaves training alone.

One 4-rank gloo launch. Every grid trains 2 iterations from the same seed and evaluates the
validation split (--eval-iters 2: the same 8 samples everywhere) through megatron's
forward-only schedule; the values must equal the CP=1 (DP4) run's within 1e-5 relative in fp32,
for CP2 ring, CP4 = Ulysses 2 x ring 2, PP2 x CP2 and TP2 x CP2 + SP with EP2, and with a
contiguous CP2 layout whose second rank holds a fully loss-masked shard. A run that evaluates
every iteration trains with the same losses as one that never does. A checkpoint saved at CP=1
and evaluated with --skip-train at CP4 gives the CP=1 value.
"""

import sys
from pathlib import Path

import pytest

from tests.launch import launch, worker_args, write_results

BASE = ["--num-experts", "4", "--position-embedding-type", "rope", "--disable-bias-linear", "--swiglu", "--normalization", "RMSNorm", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "64", "--global-batch-size", "4", "--train-iters", "4", "--lr", "1e-3",
        "--lr-warmup-iters", "1", "--seed", "7", "--log-interval", "1", "--device", "cpu",
        "--eval-interval", "1", "--eval-iters", "2", "--split", "90,10,0"]
GRIDS = {
    "cp1": [],
    "cp2_ring": ["--context-parallel-size", "2"],
    "cp4_u2r2": ["--context-parallel-size", "4", "--ulysses-size", "2"],
    "pp2_cp2": ["--pipeline-model-parallel-size", "2", "--context-parallel-size", "2"],
    "tp2_sp_cp2_ep2": ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--context-parallel-size", "2",
                       "--expert-model-parallel-size", "2"],
}
MASKED = {"cp1_masked": [], "cp2_contiguous_masked": ["--context-parallel-size", "2", "--cp-load-balance", "none"]}


@pytest.fixture(scope="module")
def results():
    return launch(Path(__file__), 4, timeout=900)[0]


@pytest.mark.parametrize("grid", [g for g in GRIDS if g != "cp1"])
def test_validation_loss_equals_cp1(results, grid):
    want, got = results["cp1"]["valid"], results[grid]["valid"]
    assert abs(got - want) <= 1e-5 * abs(want), f"{grid}: {got} vs CP=1 {want}"
    assert results[grid]["train"] == pytest.approx(results["cp1"]["train"], rel=1e-5)


def test_fully_masked_cp_shard(results):
    want, got = results["cp1_masked"]["valid"], results["cp2_contiguous_masked"]["valid"]
    assert abs(got - want) <= 1e-5 * abs(want), (got, want)
    assert abs(want - results["cp1"]["valid"]) > 1e-3, "the mask must change the value, or the case proves nothing"


def test_evaluation_does_not_disturb_training(results):
    assert results["cp2_ring"]["train_with_eval"] == results["cp2_ring"]["train_without_eval"]


def test_skip_train_at_another_cp_size_gives_the_same_value(results):
    want, got = results["cp1"]["valid"], results["skip_train_cp4"]
    assert abs(got["valid"] - want) <= 1e-5 * abs(want), (got, want)
    assert got["iteration"] == 2


def test_a_split_too_small_for_eval_iters_is_one_clear_error(tmp_path):
    """Known only once the data is open: still before training, one message from rank 0, exit 2 per rank."""
    from tests.launch import REPO_ROOT, run_script

    proc = run_script(2, REPO_ROOT / "pretrain_moe.py", *BASE, "--eval-iters", "100000", "--log-dir", tmp_path,
                      torchrun=True, check=False, timeout=300)  # torchrun's own report names each rank's exit 2
    assert proc.returncode != 0 and "training:" not in proc.stdout
    assert proc.stderr.count("--eval-iters 100000 x --global-batch-size 4 = 400000 valid samples") == 1, proc.stderr[-3000:]
    assert "exitcode  : 2" in proc.stderr and "[rank0]: Traceback" not in proc.stderr


def _run(tmp_path, name, *flags):
    import json

    from tests.launch import REPO_ROOT, run_script

    log_dir = tmp_path / name
    proc = run_script(2, REPO_ROOT / "pretrain_moe.py", *BASE, "--eval-interval", "2", "--context-parallel-size", "2",
                      "--log-dir", log_dir, *flags, timeout=300)
    lines = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    return proc.stdout, {(r["iteration"], k): v for r in lines for k, v in r.items() if k.startswith(("valid/", "test/"))}


@pytest.mark.quick
def test_the_training_loop_evaluates_every_interval_and_the_test_split_at_the_end(tmp_path):
    """--eval-interval 2 over 4 iterations: Megatron's block at 2 and 4, the test split at the end,
    each value in metrics.jsonl; --valid-data-path / --test-data-path replace --split's shares."""
    import math

    from cp_ext.data.embedded import default_cache_dir, embedded_prefix

    stdout, values = _run(tmp_path, "split", "--split", "80,10,10")
    assert stdout.count(" validation loss at iteration 2 | lm loss value: ") == 1
    assert stdout.count(" validation loss at iteration 4 | lm loss value: ") == 1
    assert stdout.count(" validation loss at iteration 4 on test set | lm loss value: ") == 1
    assert sorted(values) == [(2, "valid/lm_loss"), (2, "valid/lm_loss_ppl"), (4, "test/lm_loss"),
                              (4, "test/lm_loss_ppl"), (4, "valid/lm_loss"), (4, "valid/lm_loss_ppl")]
    assert values[(4, "valid/lm_loss_ppl")] == pytest.approx(math.exp(values[(4, "valid/lm_loss")]))
    assert values[(4, "valid/lm_loss")] != values[(4, "test/lm_loss")]  # other documents

    whole = embedded_prefix(default_cache_dir())  # the whole embedded corpus as each split's own data
    _, own = _run(tmp_path, "own", "--split", "80,10,10", "--valid-data-path", whole, "--test-data-path", whole)
    assert own[(4, "valid/lm_loss")] == pytest.approx(own[(4, "test/lm_loss")], rel=1e-12)  # same data
    assert own[(4, "valid/lm_loss")] != values[(4, "valid/lm_loss")]  # not --split's valid share


def _trainer(flags):
    from cp_ext.arguments import parse_args
    from cp_ext.training.trainer import Trainer

    return Trainer(parse_args(BASE + flags))


def _mask_second_half(seq):
    """Loss mask 0 on the second half of every validation sample (contiguous CP2: rank 1's whole shard)."""
    import cp_ext.training.evaluation as evaluation

    real = evaluation.microbatches

    def masked(*args, **kwargs):
        for mb in real(*args, **kwargs):
            if mb.loss_mask is not None:
                mb.loss_mask[mb.position_ids >= seq // 2] = 0.0
            yield mb

    evaluation.microbatches = masked
    return lambda: setattr(evaluation, "microbatches", real)


def worker():
    import warnings

    from cp_ext.training.evaluation import evaluate

    warnings.simplefilter("ignore")
    opts = worker_args(sys.argv[1:])
    out = {}
    save = Path(opts.results_dir) / "ck"  # one directory every rank sees (one host)
    for name, flags in {**GRIDS, **MASKED}.items():
        trainer = _trainer(flags)
        train = [trainer.train_step()["lm loss"] for _ in range(2)]
        restore = _mask_second_half(trainer.args.seq_length) if name in MASKED else None
        valid = evaluate(trainer, trainer.eval_datasets["valid"], trainer.args.eval_iters)
        if restore:
            restore()
        out[name] = {"train": train, "valid": valid}
        if name == "cp1":
            trainer.checkpointer.save(save)
        if name == "cp2_ring":  # two more iterations with an evaluation between every one, then without
            with_eval = []
            for _ in range(2):
                with_eval.append(trainer.train_step()["lm loss"])
                evaluate(trainer, trainer.eval_datasets["valid"], trainer.args.eval_iters)
            out[name]["train_with_eval"] = with_eval
        if name == "cp2_ring":
            trainer = _trainer(flags)
            out[name]["train_without_eval"] = [trainer.train_step()["lm loss"] for _ in range(4)][2:]
    trainer = _trainer(GRIDS["cp4_u2r2"] + ["--load", str(save), "--skip-train", "--log-dir", str(save.parent / "log")])
    values = trainer.evaluate_only()
    out["skip_train_cp4"] = {"valid": values["valid"], "iteration": trainer.iteration}
    write_results(opts.results_dir, out)


if __name__ == "__main__":
    worker()
