"""The launch scripts: scripts/torchrun_single_node.sh's real 2-rank CPU run and usage error;
every script's numeric environment values checked before shell arithmetic (no command runs
from a value, exit 2 with the variable named), their defaults, and the SLURM scripts'
--distributed-timeout-minutes (the flag, DISTRIBUTED_TIMEOUT_MINUTES, the config)."""

import json
import os
import re
import socket
import subprocess

import pytest

from tests.launch import REPO_ROOT

SCRIPT = REPO_ROOT / "scripts" / "torchrun_single_node.sh"


def test_torchrun_single_node_trains(tmp_path):
    env = dict(os.environ, NPROC_PER_NODE="2", OMP_NUM_THREADS="1")
    proc = subprocess.run([str(SCRIPT), "configs/cpu_demo.yaml", "--tensor-model-parallel-size", "1",
                           "--position-embedding-type", "rope", "--disable-bias-linear", "--swiglu", "--normalization", "RMSNorm", "--num-layers", "2", "--train-iters", "2", "--lr-warmup-iters", "1", "--log-interval", "1",
                           "--log-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)  # any cwd works
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert "training: world 2 = TP 1 x PP 1 x CP 2 (Ulysses 1 x ring 2) x DP 1" in proc.stdout
    assert re.findall(r"^ iteration +(\d+)/ +2 \|", proc.stdout, re.M) == ["1", "2"]
    assert "training done:" in proc.stdout
    assert [json.loads(line)["iteration"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2]


@pytest.mark.quick
def test_torchrun_single_node_needs_a_config():
    proc = subprocess.run([str(SCRIPT), "--train-iters", "2"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "usage:" in proc.stderr


# --- Numbers from the environment are data (scripts/env_checks.sh) ------------------------------
#
# Bash evaluates a variable's value as an arithmetic expression in $(( )) and [[ -gt ]], and
# `HOME[$(cmd)]` there runs cmd. Every launch script must check its numeric environment values
# (and CP, and --distributed-timeout-minutes) before any arithmetic: a bad value exits 2 with a
# message naming the variable, before anything is launched. These run the real scripts with a
# recording stand-in for the launcher, through the knobs the scripts already have (TORCHRUN,
# PYTHON) and, for SLURM, `srun` on PATH (no allocation needed: the sbatch file runs under bash
# with the SLURM_* variables a one-node CPU job would have). Nothing trains; each run takes ms.

SCRIPTS = REPO_ROOT / "scripts"
# (script, its arguments, the variable the launcher reads through)
LAUNCHERS = {
    "torchrun_single_node.sh": (["configs/cpu_demo.yaml", "--train-iters", "2"], {"TORCHRUN": "FAKE"}),
    "run_cpu_demo.sh": (["--train-iters", "2"], {"TORCHRUN": "FAKE"}),
    "compare_cp.sh": (["configs/cpu_demo.yaml", "2", "--train-iters", "2"], {"PYTHON": "FAKE"}),
    "slurm_single_node.sbatch": (["configs/cpu_demo.yaml", "--train-iters", "2"], {"TORCHRUN": "FAKE"}),
    "slurm_multi_node.sbatch": (["configs/cpu_demo.yaml", "--train-iters", "2"], {"TORCHRUN": "FAKE"}),
}
HOST = socket.gethostname()  # the batch host: the job's first node, whose address MASTER_ADDR must be
SLURM_JOB = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NUM_NODES": "1", "SLURM_JOB_NODELIST": HOST,
             "MASTER_ADDR": HOST, "SLURM_SUBMIT_DIR": str(REPO_ROOT), "SLURM_CPUS_PER_TASK": "2",
             "SLURM_CPUS_ON_NODE": "2", "CP_EXT_CPU": "1"}
# Every numeric variable each script reads (what must be checked).
NUMERIC = [
    ("torchrun_single_node.sh", "NPROC_PER_NODE"),
    ("torchrun_single_node.sh", "DISTRIBUTED_TIMEOUT_MINUTES"),
    ("run_cpu_demo.sh", "NPROC"),
    ("compare_cp.sh", "NPROC"),
    ("slurm_single_node.sbatch", "NPROC_PER_NODE"),
    ("slurm_single_node.sbatch", "MASTER_PORT"),
    ("slurm_single_node.sbatch", "DISTRIBUTED_TIMEOUT_MINUTES"),
    ("slurm_single_node.sbatch", "SLURM_JOB_ID"),
    ("slurm_single_node.sbatch", "SLURM_JOB_NUM_NODES"),
    ("slurm_single_node.sbatch", "SLURM_CPUS_PER_TASK"),
    ("slurm_single_node.sbatch", "SLURM_CPUS_ON_NODE"),
    ("slurm_single_node.sbatch", "SLURM_GPUS_ON_NODE"),
    ("slurm_single_node.sbatch", "RENDEZVOUS_CHECK_SECONDS"),
    ("slurm_multi_node.sbatch", "NPROC_PER_NODE"),
    ("slurm_multi_node.sbatch", "MASTER_PORT"),
]
# {marker} is replaced by a path the value would create if bash evaluated it.
INJECTIONS = ["HOME[$(touch {marker})]", "a[$(touch {marker})]", "1+HOME[`touch {marker}`]",
              "$(touch {marker})", "x[$(touch {marker})]+1"]
NOT_NUMBERS = ["-1", "abc", "1.5", " 2", "2 ", "0x10", "1e3", "+3", "9999999999", "2;true"]


def launch_script(tmp_path, script, args=None, env=None, drop=()):
    """Run scripts/<script> with a recording launcher; return (proc, launcher calls)."""
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir(exist_ok=True)
    log = tmp_path / "launched.log"
    log.unlink(missing_ok=True)
    fake = fake_bin / "fake-launcher"
    fake.write_text('#!/usr/bin/env bash\nprintf "%s" "$(basename "$0") WORLD_SIZE=${WORLD_SIZE:-}" >> "$CP_EXT_FAKE_LOG"\n'
                    'printf " %s" "$@" >> "$CP_EXT_FAKE_LOG"\necho >> "$CP_EXT_FAKE_LOG"\n')
    fake.chmod(0o755)
    for name in ("srun", "scontrol"):
        if not (fake_bin / name).exists():
            (fake_bin / name).symlink_to(fake)
    (fake_bin / "nvidia-smi").write_text("#!/bin/sh\nexit 0\n")  # no GPUs: the CPU defaults
    (fake_bin / "nvidia-smi").chmod(0o755)

    default_args, hooks = LAUNCHERS[script]
    run_env = {k: v for k, v in os.environ.items()
               if not k.startswith("SLURM_") and k not in {"NPROC_PER_NODE", "NPROC", "MASTER_PORT", "MASTER_ADDR",
                                                           "DISTRIBUTED_TIMEOUT_MINUTES", "CONFIG", "CP_EXT_CPU", "RENDEZVOUS_CHECK_SECONDS",
                                                           "CP_EXT_ROOT", "TORCHRUN", "PYTHON", "OUT_DIR"}}
    run_env.update(PATH=f"{fake_bin}:{os.environ['PATH']}", CP_EXT_FAKE_LOG=str(log), OMP_NUM_THREADS="1",
                   OUT_DIR=str(tmp_path / "out"), PLOT="0")
    run_env.update({k: str(fake) for k in hooks})
    if script.endswith(".sbatch"):
        run_env.update(SLURM_JOB)
    run_env.update(env or {})
    for k in drop:
        run_env.pop(k, None)
    proc = subprocess.run(["bash", str(SCRIPTS / script), *(default_args if args is None else args)],
                          capture_output=True, text=True, timeout=60, env=run_env, cwd=REPO_ROOT)
    calls = log.read_text().splitlines() if log.exists() else []
    return proc, calls


def assert_rejected(proc, calls, label, marker=None):
    out = f"exit {proc.returncode}\n--- stdout ---\n{proc.stdout}\n--- stderr ---\n{proc.stderr}\n--- launched ---\n{calls}"
    if marker is not None:
        assert not marker.exists(), "the value was evaluated as shell arithmetic (it ran a command)\n" + out
    assert proc.returncode == 2, out
    assert f"error: {label} must be an integer" in proc.stderr, out
    assert calls == [], "nothing may be launched after a bad value\n" + out


def launcher_line(calls, word):
    lines = [c for c in calls if word in c.split()]
    assert len(lines) >= 1, calls
    return lines[-1].split()


def flag_value(argv, flag):
    return [argv[i + 1] for i, a in enumerate(argv) if a == flag]


@pytest.mark.parametrize("script, var", NUMERIC)
@pytest.mark.parametrize("injection", INJECTIONS)
def test_injected_value_is_not_evaluated(tmp_path, script, var, injection):
    marker = tmp_path / "pwned"
    proc, calls = launch_script(tmp_path, script, env={var: injection.format(marker=marker)})
    assert_rejected(proc, calls, var, marker)
    assert injection.format(marker=marker) in proc.stderr  # the value as given, not evaluated


@pytest.mark.quick
@pytest.mark.parametrize("script, var, value", [
    (script, var, value) for script, var in NUMERIC for value in ["0", *NOT_NUMBERS]
    # valid: no GPUs (CPU jobs; see test_slurm_gpu_mode_without_gpus), no rendezvous check
    if (var, value) not in {("SLURM_GPUS_ON_NODE", "0"), ("RENDEZVOUS_CHECK_SECONDS", "0")}
])
def test_bad_number_exits_2_naming_the_variable(tmp_path, script, var, value):
    proc, calls = launch_script(tmp_path, script, env={var: value})
    assert_rejected(proc, calls, var)
    assert f"got '{value}'" in proc.stderr


@pytest.mark.parametrize("port", ["0", "65536", "100000"])
def test_slurm_master_port_out_of_range(tmp_path, port):
    proc, calls = launch_script(tmp_path, "slurm_single_node.sbatch", env={"MASTER_PORT": port})
    assert_rejected(proc, calls, "MASTER_PORT")
    assert "from 1 to 65535" in proc.stderr and "MASTER_PORT=29500" in proc.stderr


def test_slurm_gpu_mode_without_gpus(tmp_path):
    """GPU mode on a node with SLURM_GPUS_ON_NODE=0 and no NPROC_PER_NODE: no 0-rank torchrun."""
    proc, calls = launch_script(tmp_path, "slurm_single_node.sbatch", env={"SLURM_GPUS_ON_NODE": "0"}, drop=["CP_EXT_CPU"])
    assert_rejected(proc, calls, "NPROC_PER_NODE")
    assert "got '0', the default" in proc.stderr and "--gpus-per-node" in proc.stderr


@pytest.mark.parametrize("value", ["HOME[$(touch {marker})]", "0", "-5", "abc", ""])
@pytest.mark.parametrize("script", ["torchrun_single_node.sh", "slurm_single_node.sbatch"])
@pytest.mark.parametrize("form", ["separate", "equals"])
def test_bad_distributed_timeout_flag(tmp_path, script, value, form):
    marker = tmp_path / "pwned"
    value = value.format(marker=marker)
    flag = ["--distributed-timeout-minutes", value] if form == "separate" else [f"--distributed-timeout-minutes={value}"]
    proc, calls = launch_script(tmp_path, script, args=["configs/cpu_demo.yaml", *flag])
    assert_rejected(proc, calls, "--distributed-timeout-minutes", marker)


@pytest.mark.parametrize("value", ["HOME[$(touch {marker})]", "1", "0", "-1", "abc", "", "2 "])
def test_compare_cp_bad_cp_argument(tmp_path, value):
    marker = tmp_path / "pwned"
    value = value.format(marker=marker)
    proc, calls = launch_script(tmp_path, "compare_cp.sh", args=["configs/cpu_demo.yaml", value])
    assert_rejected(proc, calls, "CP", marker)
    assert "CP must be an integer >= 2" in proc.stderr
    assert not (tmp_path / "out").exists()


# Unset and empty mean the default; a valid value (leading zeros too) reaches the launcher as a plain number.
@pytest.mark.parametrize("setting, expected", [(None, "4"), ("", "4"), ("3", "3"), ("08", "8"), ("1", "1")])
@pytest.mark.parametrize("script, var", [("torchrun_single_node.sh", "NPROC_PER_NODE"), ("run_cpu_demo.sh", "NPROC"),
                                         ("compare_cp.sh", "NPROC")])
def test_rank_count_default_and_value(tmp_path, script, var, setting, expected):
    env = {} if setting is None else {var: setting}
    proc, calls = launch_script(tmp_path, script, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    runs = [c.split() for c in calls if "--nproc-per-node" in c.split()]
    assert runs and all(flag_value(r, "--nproc-per-node") == [expected] for r in runs), calls
    if script == "compare_cp.sh":  # two runs, and both grid checks saw the same world size
        assert len(runs) == 2 and sum(f"WORLD_SIZE={expected}" in c for c in calls) == 2, calls


@pytest.mark.parametrize("setting, expected", [(None, "2"), ("", "2"), ("1", "1"), ("03", "3")])
def test_slurm_rank_count_default_and_value(tmp_path, setting, expected):
    env = {} if setting is None else {"NPROC_PER_NODE": setting}
    proc, calls = launch_script(tmp_path, "slurm_single_node.sbatch", env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    srun = launcher_line(calls, "--rdzv-backend")
    assert srun[0] == "srun" and flag_value(srun, "--nproc-per-node") == [expected], calls
    assert f", {expected} ranks/node," in proc.stdout


@pytest.mark.parametrize("setting, expected", [(None, "24242"), ("", "24242"), ("29500", "29500"), ("65535", "65535")])
def test_slurm_master_port_default_and_value(tmp_path, setting, expected):
    env = {} if setting is None else {"MASTER_PORT": setting}
    proc, calls = launch_script(tmp_path, "slurm_single_node.sbatch", env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert flag_value(launcher_line(calls, "--rdzv-backend"), "--rdzv-endpoint") == [f"{HOST}:{expected}"]


# MASTER_ADDR: torchrun hosts the rendezvous store only on the node MASTER_ADDR names (the batch host).
@pytest.mark.parametrize("script", ["slurm_single_node.sbatch", "slurm_multi_node.sbatch"])
@pytest.mark.parametrize("addr, says", [
    ("no-such-host.invalid", "error: MASTER_ADDR=no-such-host.invalid does not resolve on the job's first node"),
    ("198.51.100.7", "error: MASTER_ADDR=198.51.100.7 (198.51.100.7) is not an address of the job's first node"),
])
def test_slurm_master_addr_not_this_node(tmp_path, script, addr, says):
    """A stale or wrong MASTER_ADDR: torchrun would wait 60 s for a store no node hosts, then print a traceback."""
    proc, calls = launch_script(tmp_path, script, env={"MASTER_ADDR": addr})
    out = f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}\n{calls}"
    assert proc.returncode == 2 and proc.stderr.count("error: ") == 1 and says in proc.stderr, out
    assert "unset MASTER_ADDR (the first host of SLURM_JOB_NODELIST) or export it as an address of" in proc.stderr, out
    assert calls == [], out


@pytest.mark.parametrize("addr", ["localhost", "127.0.0.1", HOST,
                                  *subprocess.run(["hostname", "-I"], capture_output=True, text=True).stdout.split()[:1]])
def test_slurm_master_addr_of_this_node_launches(tmp_path, addr):
    proc, calls = launch_script(tmp_path, "slurm_multi_node.sbatch", env={"MASTER_ADDR": addr})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert flag_value(launcher_line(calls, "--rdzv-backend"), "--rdzv-endpoint") == [f"{addr}:24242"]


# --distributed-timeout-minutes: one number for the process groups and torchrun's rendezvous join.
@pytest.mark.parametrize("script", ["slurm_single_node.sbatch", "slurm_multi_node.sbatch"])
@pytest.mark.parametrize("env, flags, minutes, added", [
    ({}, [], 10, False),                                                        # pretrain_moe.py's default
    ({"DISTRIBUTED_TIMEOUT_MINUTES": ""}, [], 10, False),                       # empty = unset
    ({"DISTRIBUTED_TIMEOUT_MINUTES": "30"}, [], 30, True),                      # env -> the flag
    ({"DISTRIBUTED_TIMEOUT_MINUTES": "030"}, [], 30, True),
    ({}, ["--distributed-timeout-minutes", "3"], 3, False),                     # the user's flag
    ({}, ["--distributed-timeout-minutes=4"], 4, False),
    ({"DISTRIBUTED_TIMEOUT_MINUTES": "30"}, ["--distributed-timeout-minutes", "5"], 5, False),  # flag wins
    ({}, ["--distributed-timeout-minutes", "7", "--distributed-timeout-minutes", "8"], 8, False),  # last wins
])
def test_slurm_distributed_timeout(tmp_path, script, env, flags, minutes, added):
    proc, calls = launch_script(tmp_path, script, args=["configs/cpu_demo.yaml", *flags, "--train-iters", "2"], env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    argv = launcher_line(calls, "--rdzv-backend")
    assert flag_value(argv, "--rdzv-conf") == [f"join_timeout={minutes * 60}"], argv
    trainer = argv[argv.index("pretrain_moe.py"):]
    ours = ["--distributed-timeout-minutes", str(minutes)] if added else []
    # what the script adds comes before the user's flags, so the user's last flag is what pretrain_moe.py reads
    assert trainer[trainer.index("--exit-signal-handler") + 1:] == [*ours, *flags, "--train-iters", "2"], argv
    assert f"distributed timeout {minutes} min" in proc.stdout


def test_bad_distributed_timeout_env_is_an_error_even_where_a_flag_wins(tmp_path):
    proc, calls = launch_script(tmp_path, "slurm_single_node.sbatch", env={"DISTRIBUTED_TIMEOUT_MINUTES": "ten"},
                                args=["configs/cpu_demo.yaml", "--distributed-timeout-minutes", "5"])
    assert_rejected(proc, calls, "DISTRIBUTED_TIMEOUT_MINUTES")


def test_slurm_distributed_timeout_from_the_config(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text((REPO_ROOT / "configs" / "cpu_demo.yaml").read_text()
                      + "distributed-timeout-minutes: 25  # slow filesystem\n")
    proc, calls = launch_script(tmp_path, "slurm_single_node.sbatch", args=[str(config)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    argv = launcher_line(calls, "--rdzv-backend")
    assert flag_value(argv, "--rdzv-conf") == ["join_timeout=1500"] and "--distributed-timeout-minutes" not in argv
    marker = tmp_path / "pwned"
    config.write_text(f"distributed-timeout-minutes: HOME[$(touch {marker})]\n")
    proc, calls = launch_script(tmp_path, "slurm_single_node.sbatch", args=[str(config)])
    assert_rejected(proc, calls, f"distributed-timeout-minutes in {config}", marker)


def test_torchrun_single_node_distributed_timeout_env(tmp_path):
    proc, calls = launch_script(tmp_path, "torchrun_single_node.sh", env={"DISTRIBUTED_TIMEOUT_MINUTES": "12"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    argv = calls[0].split()
    config = str(REPO_ROOT / "configs" / "cpu_demo.yaml")  # the script passes the config's real path
    assert argv[argv.index("pretrain_moe.py"):] == ["pretrain_moe.py", "--config", config,
                                                  "--distributed-timeout-minutes", "12", "--train-iters", "2"]
