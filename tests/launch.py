"""Run the suite's multi-rank workers and scripts, and collect what every rank measured.

Multi-rank tests are split in two halves that live in the same file:

* the worker (`if __name__ == "__main__": ...`) runs once per rank, builds its process groups
  once, runs *all* the cases of the file (or of one world size) and writes the numbers it
  measured (max errors, losses, ...) with `write_results`;
* the pytest functions launch that worker once per world size (a module-scoped fixture) and
  assert on the numbers, so one failing case reads as one failing test.

Starting Python and importing megatron-core costs 8.8 s per rank on a 2-core machine (a tiny
model's 3 training iterations cost 1 s), so ranks are forked from one pre-imported process
(`tests.forkserver`) rather than started by torchrun, and cases share launches. Scripts run the
same way (`run_script`, `start_script`: ``python script.py`` or torchrun's environment), except
where what torchrun itself does is under test (``torchrun=True``: its messages, its signals).
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
TORCHRUN_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
                "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS")
_SESSION = {}  # the session's temp directory and fork server, made on first use


def session_dir() -> Path:
    """A temp directory for this test session's runs; `shutdown` removes it."""
    if "dir" not in _SESSION:
        _SESSION["dir"] = Path(tempfile.mkdtemp(prefix="cp_ext_tests_"))
    return _SESSION["dir"]


class ForkServer:
    """The client side of `tests.forkserver`: started once, runs every forked run of the session.

    Thread-safe (a test may watch a run from a thread while others start): one reader thread
    files the server's replies, start requests are serialized, waits block on a condition.
    """

    def __init__(self):
        self.log_path = session_dir() / "forkserver.log"
        self._log = open(self.log_path, "w")
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", "1")
        env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")])
        for name in TORCHRUN_ENV:
            env.pop(name, None)
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.forkserver"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._log, cwd=REPO_ROOT, env=env,
                                     start_new_session=True)
        self._changed, self._requests = threading.Condition(), threading.Lock()
        self._ready, self._dead, self._started, self._exits = False, False, [], {}
        threading.Thread(target=self._read_replies, daemon=True, name="forkserver-replies").start()
        with self._changed:
            self._changed.wait_for(lambda: self._ready or self._dead, timeout=300)
        if not self._ready:
            raise RuntimeError(f"the test fork server did not start:\n{self._log_tail()}")

    def _log_tail(self):
        self._log.flush()
        return self.log_path.read_text()[-4000:]

    def _read_replies(self):
        for line in self.proc.stdout:  # {"ready": pid} once, {"pid": p} per start, {"pid": p, "exit": c}
            reply = json.loads(line)
            with self._changed:
                if "ready" in reply:
                    self._ready = True
                elif "exit" in reply:
                    self._exits[reply["pid"]] = reply["exit"]
                else:
                    self._started.append(reply["pid"])
                self._changed.notify_all()
        with self._changed:
            self._dead = True
            self._changed.notify_all()

    def start(self, request):
        """Start a run; returns its leader's pid (a process group: ``killpg`` ends the whole run)."""
        with self._requests:  # the server answers start requests in order
            self.proc.stdin.write((json.dumps(request) + "\n").encode())
            self.proc.stdin.flush()
            with self._changed:
                if not self._changed.wait_for(lambda: self._started or self._dead, timeout=60):
                    raise RuntimeError("the test fork server did not answer a start request within 60 s")
                if not self._started:
                    raise RuntimeError(f"the test fork server died:\n{self._log_tail()}")
                return self._started.pop(0)

    def wait(self, pid, timeout):
        """The run's exit code, or None if it is still running after ``timeout`` seconds."""
        with self._changed:
            self._changed.wait_for(lambda: pid in self._exits or self._dead, timeout=timeout)
            if pid not in self._exits and self._dead:
                raise RuntimeError(f"the test fork server died:\n{self._log_tail()}")
            return self._exits.pop(pid, None)

    def close(self):
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()


_STARTING = threading.Lock()


def _server() -> ForkServer:
    with _STARTING:
        if "server" not in _SESSION:
            _SESSION["server"] = ForkServer()
    return _SESSION["server"]


def shutdown():
    """End the fork server and remove the session's temp directory (tests/conftest.py, at session end)."""
    server = _SESSION.pop("server", None)
    if server is not None:
        server.close()
    directory = _SESSION.pop("dir", None)
    if directory is not None:
        shutil.rmtree(directory, ignore_errors=True)


class Run:
    """A script or worker running on forked ranks: `tests.forkserver`'s job, seen from the test."""

    def __init__(self, script, nproc, args, env=None, unset=(), cwd=REPO_ROOT, log_dir=None):
        self.nproc, self.what = nproc, f"{Path(script).name} on {nproc or 'no torchrun,'} rank(s) {' '.join(map(str, args))[:300]}"
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="run_", dir=session_dir()))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.pid = _server().start(dict(script=str(script), nproc=nproc, args=list(map(str, args)), env=env or {},
                                        unset=list(unset), cwd=str(cwd), log_dir=str(self.log_dir)))
        self.returncode = None

    def rank_pids(self, timeout=30):
        """{rank: pid} of the running ranks."""
        path, deadline = self.log_dir / "pids.json", time.monotonic() + timeout
        while not path.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        return {int(r): pid for r, pid in json.loads(path.read_text()).items()}

    def wait(self, timeout):
        """Exit code (torchrun's: 1 when any rank failed), or None after ``timeout`` (still running)."""
        if self.returncode is None:
            self.returncode = _server().wait(self.pid, timeout)
        return self.returncode

    def poll(self):
        return self.wait(0)

    def kill(self, dump_stacks=False):
        """End every rank (first dumping each rank's stacks into its log, if asked)."""
        for sig, pause in ([(signal.SIGUSR1, 2.0)] if dump_stacks else []) + [(signal.SIGKILL, 0)]:
            try:
                os.killpg(self.pid, sig)
            except ProcessLookupError:
                break
            time.sleep(pause)
        return self.wait(60)

    def output(self, stream):
        """Every rank's ``stream`` ("out" or "err"), rank after rank."""
        parts = []
        for rank in range(max(self.nproc, 1)):
            path = self.log_dir / f"rank{rank}.{stream}"
            parts.append(path.read_text(errors="replace") if path.exists() else "")
        return "".join(parts)

    def logs(self, lines=40):
        """The last ``lines`` lines each rank wrote, labelled by rank; after a stack dump, the innermost
        frames of that dump (where the rank was) instead."""
        parts = []
        for rank in range(max(self.nproc, 1)):
            text = []
            for path in (self.log_dir / f"rank{rank}.out", self.log_dir / f"rank{rank}.err"):
                text += path.read_text(errors="replace").splitlines() if path.exists() else []
            dumps = [i for i, line in enumerate(text) if "most recent call first" in line]
            shown = text[dumps[-1]:dumps[-1] + lines] if dumps else text[-lines:]
            label = "stack when killed, innermost first" if dumps else f"last {len(shown)} lines"
            parts.append(f"--- rank {rank} ({label}) ---\n" + "\n".join(shown))
        return "\n".join(parts)

    def finish(self, timeout):
        """Wait for the end; a run past ``timeout`` is killed (stacks dumped) and AssertionError raised."""
        code = self.wait(timeout)
        if code is None:
            self.kill(dump_stacks=True)
            raise AssertionError(f"timed out after {timeout} s and was killed: {self.what}\n{self.logs()}")
        return subprocess.CompletedProcess(self.what, code, self.output("out"), self.output("err"))


def launch(script, nproc, *args, cases=None, timeout=900, env=None):
    """Run the worker `script` on `nproc` gloo ranks; return {rank: results} as written by each rank.

    ``cases``: names of the only cases the worker runs (`selected`), e.g. the quick subset's;
    None runs them all.

    A failed launch raises AssertionError with every rank's last lines, and a launch that runs
    past ``timeout`` seconds is killed and reported with each rank's stack at that moment (so a
    hang names the collective it hangs in). The results directory lives until the session ends.
    """
    out_dir = Path(tempfile.mkdtemp(prefix="launch_", dir=session_dir()))
    if cases is not None:
        args = (*args, "--cases", ",".join(cases))
    run = Run(script, nproc, ["--results-dir", out_dir, *args], env=env, log_dir=out_dir / "logs")
    proc = run.finish(timeout)
    if proc.returncode != 0:
        raise AssertionError(f"exited {proc.returncode}: {run.what}\n{run.logs(lines=80)}")
    results = {}
    for path in sorted(out_dir.glob("rank*.json")):
        results[int(path.stem[4:])] = json.loads(path.read_text())
    assert len(results) == nproc, f"expected results from {nproc} ranks, got {sorted(results)}:\n{run.logs()}"
    return results


def _script_env(env):
    return dict({"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}, **(env or {}))


def start_script(nproc, script, *args, env=None, unset=(), cwd=REPO_ROOT):
    """Start a repository script on ``nproc`` forked ranks with torchrun's environment (``nproc`` 0:
    ``python script.py``, no torchrun variables), ``env`` added and ``unset`` removed. Returns the `Run`."""
    return Run(script, nproc, args, env=_script_env(env), unset=TORCHRUN_ENV + tuple(unset), cwd=cwd)


def run_script(nproc, script, *args, check=True, timeout=600, env=None, unset=(), torchrun=False, cwd=REPO_ROOT):
    """A repository script run to the end: a CompletedProcess with its exit code (torchrun's: 1 when a
    rank failed), every rank's stdout and stderr. Asserts exit 0 unless ``check=False``.

    ``torchrun=True`` runs it under torchrun itself (or plain ``python`` when ``nproc`` is 0), as
    a user types it: for tests of what the launcher adds (its messages, its exit codes, signals).
    """
    if torchrun:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"] if nproc else [sys.executable]
        run_env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_ENV + tuple(unset)}
        run_env.update(_script_env(env))
        proc = subprocess.run([*launcher, str(script), *map(str, args)], capture_output=True, text=True, env=run_env,
                              cwd=cwd, timeout=timeout)
    else:
        proc = start_script(nproc, script, *args, env=env, unset=unset, cwd=cwd).finish(timeout)
    if check:
        assert proc.returncode == 0, proc.stderr[-6000:]
    return proc


def run_code(code, *args, check=True, timeout=300, env=None, unset=()):
    """Python source run as a script of its own (`run_script` with ``nproc`` 0: forked from the
    pre-imported server, a fresh process for whatever the code changes): a CompletedProcess."""
    import textwrap

    path = Path(tempfile.mkstemp(prefix="code_", suffix=".py", dir=session_dir())[1])
    path.write_text(textwrap.dedent(code))
    return run_script(0, path, *args, check=check, timeout=timeout, env=env, unset=unset)


def one_rank_megatron(tmp_path, cp_ext_groups=False) -> str:
    """The opening of a `run_code` script that builds megatron modules on one CPU rank: the platform
    shims, a one-rank gloo group, megatron's parallel state (and cp_ext's CP groups) and its RNG streams."""
    return f"""
import torch, torch.distributed as dist
from cp_ext.platform import setup_platform
setup_platform("cpu")
dist.init_process_group("gloo", init_method="file://{tmp_path}/store", rank=0, world_size=1)
from megatron.core import parallel_state
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
parallel_state.initialize_model_parallel()
{"from cp_ext import parallel_state as cp_state; cp_state.initialize_context_parallel(1)" if cp_ext_groups else ""}
model_parallel_cuda_manual_seed(1)
"""


def fork_workers(script, nproc, args, timeout=600, env=None):
    """`cp_ext.bench.workers.run_workers` on forked ranks: a tool's ``script --worker --out DIR args``
    (or a package module's, ``script`` its dotted name) on ``nproc`` ranks, each rank's
    ``DIR/rank{r}.json`` in rank order. For tests of what a tool measures;
    tests/bench/test_generate.py runs a tool under torchrun itself."""
    from cp_ext.bench.workers import WorkerConfigError, is_module_name, read_config_error

    out = Path(tempfile.mkdtemp(prefix="workers_", dir=session_dir()))
    if is_module_name(script):  # the fork server runs files: one that runs the module as ``python -m`` does
        runner = Path(tempfile.mkstemp(prefix="module_", suffix=".py", dir=session_dir())[1])
        runner.write_text(f"import runpy\nrunpy.run_module({script!r}, run_name='__main__', alter_sys=True)\n")
        script = runner
    proc = run_script(nproc, script, "--worker", "--out", out, *args, timeout=timeout, env=env, check=False)
    if proc.returncode != 0 and read_config_error(out) is not None:  # as run_workers: the rank's message
        raise WorkerConfigError(read_config_error(out))
    assert proc.returncode == 0, proc.stderr[-6000:]
    return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(nproc)]


def worker_args(argv=None, required=()):
    """Parse the arguments `launch` passes to a worker: --results-dir, --cases, the ``required`` options
    (e.g. "--docs": ``args.docs``) and free-form extras (``args.extra``)."""
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--results-dir", required=True)
    parser.add_argument("--cases", type=lambda names: names.split(","), default=None)
    for option in required:
        parser.add_argument(option, required=True)
    args, args.extra = parser.parse_known_args(argv)
    return args


def selected(cases, args):
    """The cases the worker was asked for (``--cases``; all without it): cases are names, or dicts
    with a "name"; a dict of cases gives its names."""
    if args.cases is None:
        return list(cases)
    names = [case["name"] if isinstance(case, dict) else case for case in cases]
    missing = set(args.cases) - set(names)
    assert not missing, f"no such cases: {sorted(missing)}"
    return [case for case, name in zip(cases, names) if name in args.cases]


def case_params(cases, quick=()):
    """pytest params of ``cases`` (dicts with a "name", id'd by it); those named in ``quick`` are
    also in the quick subset (``pytest -m quick``)."""
    import pytest

    return [pytest.param(case, id=case["name"], marks=[pytest.mark.quick] if case["name"] in quick else [])
            for case in cases]


def write_results(results_dir, results):
    """Write this rank's results (a JSON-able dict) where `launch` collects them."""
    rank = int(os.environ.get("RANK", "0"))
    Path(results_dir, f"rank{rank}.json").write_text(json.dumps(results, indent=1, sort_keys=True))


def lm_losses(run_dir):
    """[(iteration, lm loss)] of a run's metrics.jsonl, in the order written."""
    records = map(json.loads, (Path(run_dir) / "metrics.jsonl").read_text().splitlines())
    return [(r["iteration"], r["train/lm_loss"]) for r in records]
