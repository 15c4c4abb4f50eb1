"""Checkpoints never lose data and resume as Megatron-LM does.

Parse-time checks on checkpoint directories laid out on disk (no process group needed):
``--save`` holding a newer checkpoint than the run starts from (a wrong ``--load``) is an
error, never a tracker rolled back; ``--load`` at one iteration's directory names its parent;
a changed LR schedule without ``--override-opt_param-scheduler`` or
``--use-checkpoint-opt_param-scheduler`` is an error naming both. Files load with
``weights_only=True``: a crafted pickle is refused, a truncated file is named.
Then real 2-rank runs of pretrain_moe.py (ranks forked with torchrun's environment, `tests.launch`):
the two scheduler flags, ``--no-load-optim`` and ``--finetune``, SIGTERM, the save lock.
"""

import json
import os
import subprocess

import pytest
import torch

from cp_ext.arguments import ConfigError, parse_args
from cp_ext.checkpoint.disk_format import META, MODEL_FLAGS, SCHEDULE_FLAGS, TRACKER
from tests.launch import REPO_ROOT, run_script, start_script
from tests.scripts.slurm_cluster import free_port

FLAGS = ["--num-experts", "4", "--position-embedding-type", "rope", "--disable-bias-linear", "--swiglu", "--normalization", "RMSNorm", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "32", "--global-batch-size", "4", "--train-iters", "8", "--lr", "1e-3",
         "--lr-warmup-iters", "2", "--seed", "5", "--log-interval", "1", "--device", "cpu"]


def _fake_checkpoint(root, iteration, model_changes=None, **schedule_changes):
    """What parse-time checks read of a checkpoint directory (meta.json + tracker)."""
    args = parse_args(FLAGS, world_size=1)
    schedule = {name: getattr(args, name) for name in SCHEDULE_FLAGS}
    schedule.update(schedule_changes)
    model = {name: getattr(args, name) for name in MODEL_FLAGS}
    model.update(model_changes or {})
    directory = root / f"iter_{iteration:07d}"
    directory.mkdir(parents=True)
    meta = {"iteration": iteration, "format": "torch_dist", "schedule": schedule, "model": model}
    (directory / META).write_text(json.dumps(meta))
    (root / TRACKER).write_text(f"{iteration}\n")
    return root


def _error(argv):
    with pytest.raises(ConfigError) as info:
        parse_args(FLAGS + argv, world_size=1)
    return str(info.value)


def test_save_never_rolls_back_a_newer_checkpoint(tmp_path):
    ckpt = _fake_checkpoint(tmp_path / "ck", 5)
    wrong = tmp_path / "elsewhere"
    wrong.mkdir()
    message = _error(["--save", str(ckpt), "--load", str(wrong)])
    assert f"--save {ckpt} already holds a checkpoint of iteration 5" in message and f"--load {ckpt}" in message
    assert "already holds a checkpoint of iteration 5" in _error(["--save", str(ckpt)])
    parse_args(FLAGS + ["--save", str(ckpt), "--load", str(ckpt)], world_size=1)  # resuming it: fine


def test_load_at_an_iteration_directory_names_its_parent(tmp_path):
    ckpt = _fake_checkpoint(tmp_path / "ck", 5)
    message = _error(["--load", str(ckpt / "iter_0000005")])
    assert "one iteration's directory" in message and f"--load {ckpt}" in message


@pytest.mark.quick
def test_save_must_be_a_directory(tmp_path):
    path = tmp_path / "file"
    path.write_text("x")
    assert f"--save {path} is a file" in _error(["--save", str(path)])
    assert "--finetune needs --load" in _error(["--finetune"])


@pytest.mark.quick
def test_changed_schedule_needs_one_of_megatrons_flags(tmp_path):
    ckpt = _fake_checkpoint(tmp_path / "ck", 4, lr=3e-4, lr_decay_style="linear")
    message = _error(["--load", str(ckpt)])
    assert "--lr 0.001 (checkpoint: 0.0003)" in message and "--lr-decay-style cosine (checkpoint: linear)" in message
    assert "--override-opt_param-scheduler" in message and "--use-checkpoint-opt_param-scheduler" in message
    for flag in ("--override-opt_param-scheduler", "--use-checkpoint-opt_param-scheduler", "--no-load-optim",
                 "--finetune"):
        parse_args(FLAGS + ["--load", str(ckpt), flag], world_size=1)
    assert "contradict" in _error(["--load", str(ckpt), "--override-opt_param-scheduler",
                                   "--use-checkpoint-opt_param-scheduler"])


def test_save_warns_when_the_disk_is_short(tmp_path, capsys):
    import shutil

    from cp_ext.checkpoint.checks import checkpoint_bytes_estimate

    big = ["--position-embedding-type", "rope", "--disable-bias-linear", "--swiglu", "--normalization", "RMSNorm", "--num-layers", "32", "--hidden-size", "4096", "--num-attention-heads", "32", "--vocab-size", "32000"]
    args = parse_args(FLAGS + big + ["--save", str(tmp_path / "ck")], world_size=1)
    need = checkpoint_bytes_estimate(args)
    assert 25e9 * 12 < need < 30e9 * 12  # ~28B parameters (32 layers of 4096, 4 experts of 16384) x 12 B
    if shutil.disk_usage(tmp_path).free < need:
        assert "one checkpoint needs about" in capsys.readouterr().err
    small = parse_args(FLAGS + ["--save", str(tmp_path / "ck2")], world_size=1)
    assert checkpoint_bytes_estimate(small) < 1e8 and "warning" not in capsys.readouterr().err


def test_another_models_checkpoint_is_refused_at_startup(tmp_path):
    ckpt = _fake_checkpoint(tmp_path / "ck", 4, model_changes={"hidden_size": 64, "num_experts": 8})
    message = _error(["--load", str(ckpt)])
    assert "another model" in message and "--hidden-size 32 (checkpoint: 64)" in message
    assert "--num-experts 4 (checkpoint: 8)" in message


def test_a_checkpoint_without_mtp_layers_is_refused_for_mtp(tmp_path):
    """--mtp-num-layers adds parameters (mtp.layers.*): a checkpoint of another depth count is another model."""
    ckpt = _fake_checkpoint(tmp_path / "ck", 4)
    assert "--mtp-num-layers 2 (checkpoint: None)" in _error(["--load", str(ckpt), "--mtp-num-layers", "2"])
    ckpt = _fake_checkpoint(tmp_path / "ck2", 4, model_changes={"mtp_num_layers": 1})
    assert "--mtp-num-layers 2 (checkpoint: 1)" in _error(["--load", str(ckpt), "--mtp-num-layers", "2"])
    parse_args(FLAGS + ["--load", str(ckpt), "--mtp-num-layers", "1"], world_size=1)


def test_a_checkpoint_of_the_old_per_rank_format_is_named(tmp_path):
    ckpt = _fake_checkpoint(tmp_path / "ck", 4)
    meta = ckpt / "iter_0000004" / META
    meta.write_text(json.dumps({k: v for k, v in json.loads(meta.read_text()).items() if k != "format"}))
    assert "written by an earlier cp_ext in per-rank files" in _error(["--load", str(ckpt)])


# ----------------------------------------------------------------------------- real runs


def _run(*args, fails=False, env=None):
    """pretrain_moe.py on 2 ranks (EP2), torchrun's environment (`tests.launch.run_script`)."""
    proc = run_script(2, REPO_ROOT / "pretrain_moe.py", *FLAGS, "--expert-model-parallel-size", "2", *args,
                      check=False, env=env)
    assert (proc.returncode != 0) == fails, proc.stderr[-6000:]  # like torchrun, a rank's exit 2 reads as 1
    return proc


def _metrics(log_dir):
    return {r["iteration"]: r for r in map(json.loads, (log_dir / "metrics.jsonl").read_text().splitlines())}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("saved")
    _run("--save", root / "ck", "--save-interval", "2", "--exit-interval", "4", "--log-dir", root / "first")
    return root / "ck", _metrics(root / "first")


class _RunsCode:
    def __reduce__(self):
        return (os.system, ("echo pwned > " + os.environ.get("PWNED_FILE", "/dev/null"),))


def test_crafted_and_truncated_checkpoints_are_refused_by_name(saved, tmp_path):
    """A crafted common.pt does not run (weights_only=True) and is named; a truncated tensor file is
    named with the hint; --ckpt-fallback then loads the previous complete checkpoint."""
    import shutil

    ckpt, first = saved
    crafted = tmp_path / "crafted"
    shutil.copytree(ckpt, crafted)
    torch.save({"iteration": 4, "args": _RunsCode()}, crafted / "iter_0000004" / "common.pt")
    pwned = tmp_path / "pwned"
    refused = _run("--load", crafted, "--log-dir", tmp_path / "a", fails=True, env={"PWNED_FILE": str(pwned)})
    assert not pwned.exists(), "a crafted checkpoint ran code"
    assert refused.stderr.count(f"{crafted / 'iter_0000004'}: refused to load") == 1, refused.stderr[-3000:]
    assert "[rank0]: Traceback" not in refused.stderr and "weights_only=True" in refused.stderr

    truncated = tmp_path / "truncated"
    shutil.copytree(ckpt, truncated)
    shard = sorted((truncated / "iter_0000004").glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[:200])
    broken = _run("--load", truncated, "--log-dir", tmp_path / "b", fails=True)
    assert broken.stderr.count(f"{truncated / 'iter_0000004'}: unreadable checkpoint") == 1, broken.stderr[-3000:]
    assert "--ckpt-fallback" in broken.stderr and "[rank0]: Traceback" not in broken.stderr
    fell_back = _run("--load", truncated, "--ckpt-fallback", "--save", truncated, "--save-interval", "2",
                     "--log-dir", tmp_path / "c")
    assert "trying iteration 2" in fell_back.stdout and "loaded checkpoint of iteration 2" in fell_back.stdout
    # its save of iteration 4 keeps the unreadable one beside it, never deletes it
    assert len(list(truncated.glob("iter_0000004.replaced-*"))) == 1 and (truncated / TRACKER).read_text() == "8\n"
    resumed = _metrics(tmp_path / "c")
    assert sorted(resumed) == [3, 4, 5, 6, 7, 8]
    for it in (3, 4):
        assert resumed[it]["train/lm_loss"] == pytest.approx(first[it]["train/lm_loss"], rel=1e-6)


def test_resume_with_a_new_lr_follows_the_flag(saved, tmp_path):
    ckpt, first = saved
    refused = _run("--load", ckpt, "--lr", "5e-4", "--log-dir", tmp_path / "refused", fails=True)
    assert refused.stderr.count("--override-opt_param-scheduler") == 1, refused.stderr[-3000:]
    _run("--load", ckpt, "--lr", "5e-4", "--override-opt_param-scheduler", "--log-dir", tmp_path / "new")
    _run("--load", ckpt, "--lr", "5e-4", "--use-checkpoint-opt_param-scheduler", "--log-dir", tmp_path / "old")
    new, old = _metrics(tmp_path / "new"), _metrics(tmp_path / "old")
    assert sorted(new) == sorted(old) == [5, 6, 7, 8]
    # cosine from max LR at iteration 2 to 0 at 8: the two runs differ exactly by the max LR's ratio
    assert new[5]["train/learning_rate"] == pytest.approx(0.5 * old[5]["train/learning_rate"], rel=1e-9)
    assert old[5]["train/learning_rate"] > 0


def test_finetune_starts_at_iteration_0_from_the_weights(saved, tmp_path):
    ckpt, first = saved
    _run("--load", ckpt, "--finetune", "--train-iters", "3", "--log-dir", tmp_path / "ft")
    ft = _metrics(tmp_path / "ft")
    assert sorted(ft) == [1, 2, 3]
    # same data as the first run's iteration 1, but trained weights: a clearly lower loss
    assert ft[1]["train/lm_loss"] < first[1]["train/lm_loss"] - 0.05, (ft[1], first[1])
    _run("--load", ckpt, "--no-load-optim", "--no-load-rng", "--log-dir", tmp_path / "fresh")
    assert sorted(_metrics(tmp_path / "fresh")) == [5, 6, 7, 8]


def test_sigterm_saves_and_exits_0_then_resumes(tmp_path):
    """--exit-signal-handler: SIGTERM to the training processes (as SLURM delivers it to a job's tasks)
    finishes the iteration, saves, exits 0; resuming continues the same loss curve."""
    import signal
    import time

    save, log_dir = tmp_path / "ck", tmp_path / "run"
    run = start_script(2, REPO_ROOT / "pretrain_moe.py", *FLAGS, "--expert-model-parallel-size", "2", "--train-iters",
                       "40", "--lr-decay-iters", "40", "--exit-signal-handler", "--save", save, "--log-dir", log_dir)
    metrics = log_dir / "metrics.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and run.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 3:
            break
        time.sleep(0.05)
    workers = run.rank_pids()
    assert len(workers) == 2, workers
    for pid in workers.values():
        os.kill(pid, signal.SIGTERM)
    proc = run.finish(300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "received SIGTERM (--exit-signal-handler): saving and exiting after iteration" in proc.stdout
    stopped = int((save / TRACKER).read_text())
    assert 3 <= stopped < 40 and max(_metrics(log_dir)) == stopped

    _run("--train-iters", "40", "--lr-decay-iters", "40", "--load", save, "--save", save, "--exit-interval",
         str(stopped + 2), "--log-dir", log_dir)
    resumed = _metrics(log_dir)
    assert sorted(resumed) == list(range(1, stopped + 3))
    straight = tmp_path / "straight"
    _run("--train-iters", "40", "--lr-decay-iters", "40", "--exit-interval", str(stopped + 2), "--log-dir", straight)
    assert {i: r["train/lm_loss"] for i, r in resumed.items()} == {i: r["train/lm_loss"] for i, r in _metrics(straight).items()}


def test_exit_duration_saves_and_stops_every_rank_together(tmp_path):
    """Megatron-LM's --exit-duration-in-mins: after the iteration that ends past the duration (counted from
    the run's start), every rank agrees, the run saves there and exits 0; nothing trains after it."""
    save, log_dir = tmp_path / "ck", tmp_path / "run"
    proc = _run("--train-iters", "100000", "--lr-decay-iters", "100000", "--exit-duration-in-mins", "0.1",
                "--save", save, "--log-dir", log_dir)
    stopped = int((save / TRACKER).read_text())
    assert f"(--exit-duration-in-mins 0.1) at iteration {stopped}" in proc.stdout, proc.stdout[-2000:]
    assert proc.stdout.count("exiting program after") == 1 and sorted(_metrics(log_dir)) == list(range(1, stopped + 1))


def test_one_job_per_save_directory(tmp_path):
    import socket

    save = tmp_path / "ck"
    save.mkdir()
    lock = save / ".cp_ext_save.lock"
    lock.write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid()}))  # a live job: this one
    refused = _run("--save", save, "--train-iters", "3", "--log-dir", tmp_path / "a", fails=True)
    message = f"another job is saving there (host {socket.gethostname()}, pid {os.getpid()}"
    assert refused.stderr.count(message) == 1, refused.stderr[-3000:]
    assert not (save / TRACKER).exists()

    dead = subprocess.Popen(["true"])
    dead.wait()
    lock.write_text(json.dumps({"host": socket.gethostname(), "pid": dead.pid}))  # a killed job's lock
    _run("--save", save, "--train-iters", "3", "--log-dir", tmp_path / "b")
    assert (save / TRACKER).read_text().strip() == "3" and not lock.exists(), "stale lock taken over, then released"


def test_save_lock_is_keyed_by_the_slurm_job(tmp_path):
    """Under SLURM the job holds the lock: a requeued job (same SLURM_JOB_ID, rank 0 now on another host) takes
    its earlier run's lock over; another job whose state cannot be asked (squeue answers no controller here, or
    is absent) is refused, named by its job id."""
    save = tmp_path / "ck"
    save.mkdir()
    lock = save / ".cp_ext_save.lock"
    earlier = {"host": "node-that-died", "pid": 1, "slurm_job_id": "4242", "slurm_restart_count": 0}
    lock.write_text(json.dumps(earlier))
    # a cluster whose controller is not there: squeue and scontrol fail at once with MessageTimeout=1 (SLURM's
    # default 10 s retries for 18 s; a SLURM_CONF naming no file takes 59 s here, a configless DNS lookup)
    conf = tmp_path / "no-controller.conf"
    conf.write_text(f"ClusterName=none\nSlurmctldHost=localhost\nSlurmctldPort={free_port()}\nMessageTimeout=1\n")
    other_job = {"SLURM_JOB_ID": "4243", "SLURM_CONF": str(conf)}
    refused = _run("--save", save, "--train-iters", "3", "--log-dir", tmp_path / "a", fails=True, env=other_job)
    message = "another job is saving there (SLURM job 4242, host node-that-died, pid 1"
    assert refused.stderr.count(message) == 1, refused.stderr[-3000:]
    assert json.loads(lock.read_text()) == earlier and not (save / TRACKER).exists()

    requeued = {"SLURM_JOB_ID": "4242", "SLURM_RESTART_COUNT": "1"}
    _run("--save", save, "--load", save, "--train-iters", "3", "--log-dir", tmp_path / "b", env=requeued)
    assert (save / TRACKER).read_text().strip() == "3" and not lock.exists(), "own job's lock taken over, released"
