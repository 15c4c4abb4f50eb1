"""Run a test module's worker under torchrun and collect what every rank measured.

Multi-rank tests are split in two halves that live in the same file:

* the worker (`if __name__ == "__main__": ...`) runs once per rank under torchrun,
  builds its process groups once, runs *all* the cases of the file and writes the
  numbers it measured (max errors, losses, ...) with `write_results`;
* the pytest functions launch that worker once per configuration (module-scoped
  fixture) and assert on the numbers, so one failing case reads as one failing test.

Starting Python and importing megatron-core costs seconds per rank on a 2-core
machine, so sharing one launch across many cases is what keeps the suite fast.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def launch(script, nproc, *args, timeout=900, env=None):
    """Run `script` on `nproc` gloo ranks; return {rank: results} as written by each rank.

    Raises AssertionError with the workers' output when the job fails, so a broken
    worker shows its traceback in the pytest report instead of a bare exit code.
    """
    import tempfile

    out_dir = Path(tempfile.mkdtemp(prefix="cp_ext_test_"))
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={nproc}", str(script), "--results-dir", str(out_dir), *map(str, args),
    ]
    run_env = dict(os.environ)
    run_env.setdefault("OMP_NUM_THREADS", "1")
    run_env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), run_env.get("PYTHONPATH", "")])
    run_env.update(env or {})
    proc = run_process_group(cmd, timeout=timeout, env=run_env, cwd=REPO_ROOT)
    if proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} exited {proc.returncode}\n--- stdout ---\n{proc.stdout[-8000:]}"
            f"\n--- stderr ---\n{proc.stderr[-8000:]}"
        )
    results = {}
    for path in sorted(out_dir.glob("rank*.json")):
        results[int(path.stem[4:])] = json.loads(path.read_text())
    assert len(results) == nproc, f"expected results from {nproc} ranks, got {sorted(results)}:\n{proc.stderr[-4000:]}"
    return results


def run_script(nproc, script, *args, check=True, timeout=600):
    """A repository script as a user runs it: under torchrun with `nproc` ranks, or plain ``python``
    (one rank, no torchrun environment) when `nproc` is 0. Asserts exit 0 unless ``check=False``."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"] if nproc else [sys.executable]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO_ROOT))
    proc = subprocess.run([*launcher, str(script), *map(str, args)], capture_output=True, text=True, env=env,
                          cwd=REPO_ROOT, timeout=timeout)
    if check:
        assert proc.returncode == 0, proc.stderr[-6000:]
    return proc


def run_process_group(cmd, timeout, **kwargs):
    """subprocess.run in a session of its own; on timeout the whole group is killed.

    Killing only torchrun would orphan its ranks, which then wait forever in a collective.
    """
    import signal

    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, **kwargs)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        raise AssertionError(f"{' '.join(map(str, cmd))} timed out after {timeout} s\n{stderr[-4000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def worker_args(argv=None):
    """Parse the arguments `launch` passes to a worker: --results-dir plus free-form extras."""
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--results-dir", required=True)
    args, args.extra = parser.parse_known_args(argv)
    return args


def write_results(results_dir, results):
    """Write this rank's results (a JSON-able dict) where `launch` collects them."""
    rank = int(os.environ.get("RANK", "0"))
    Path(results_dir, f"rank{rank}.json").write_text(json.dumps(results, indent=1, sort_keys=True))
