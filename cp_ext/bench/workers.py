"""Run a tool's worker on N ranks under torchrun and read what each rank wrote (tools/ only).

    records = run_workers(script, nproc, [*args], timeout=600)   # [rank 0's JSON, rank 1's, ...]

The worker is ``script --worker --out DIR args``; rank r writes ``DIR/rank{r}.json``. ``script``
is a tool's path, or the dotted name of a package module, run as ``python -m`` runs it (workers
that live in cp_ext: ``run_workers("cp_ext.bench.memory_measure", ...)``). The
directory is a fresh temp directory removed before this returns, whatever happens. torchrun
starts in a session of its own, so a timeout kills torchrun *and* its ranks: no orphan waits
forever in a collective. Failures raise `WorkerError` with the job's last output; a rank that
refused its configuration (`write_config_error`, then exit 2) raises `WorkerConfigError` with
that message alone, for the tool to print once without torchrun's report or a traceback.
"""

import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import List, Optional, Sequence

REPO_ROOT = Path(__file__).resolve().parents[2]


class WorkerError(RuntimeError):
    """The job exited non-zero, timed out, or a rank wrote no record."""


class WorkerConfigError(WorkerError):
    """A rank refused its configuration (a ConfigError, found where the data or the grid is built):
    the message, as the rank wrote it."""


def write_config_error(out_dir, rank, message):
    """A worker's side: leave the configuration error for the tool (each rank its own file, since
    torchrun may end the others before the first rank to fail has written)."""
    Path(out_dir, f"config_error.rank{rank}.txt").write_text(str(message))


def read_config_error(out_dir) -> Optional[str]:
    """The first rank's configuration error in ``out_dir``, if any rank wrote one."""
    found = sorted(Path(out_dir).glob("config_error.rank*.txt"), key=lambda p: int(p.name[17:-4]))
    return found[0].read_text() if found else None


def is_module_name(script) -> bool:
    """Whether a worker ``script`` names a package module (``cp_ext.x.y``) rather than a file."""
    return isinstance(script, str) and not script.endswith(".py") and os.sep not in script and "/" not in script


def run_workers(script, nproc: int, args: Sequence[str], timeout: Optional[float] = 600, env=None) -> List[dict]:
    program = ["-m", script] if is_module_name(script) else [str(Path(script).resolve())]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           *program, "--worker"]
    run_env = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
    run_env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), run_env.get("PYTHONPATH", "")])
    with tempfile.TemporaryDirectory(prefix="cp_ext_workers_") as out:
        full = cmd + ["--out", out, *map(str, args)]
        child = subprocess.Popen(full, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=run_env,
                                 cwd=REPO_ROOT, start_new_session=True)
        try:
            stdout, stderr = child.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            stdout, stderr = child.communicate()
            raise WorkerError(f"{' '.join(full)} did not finish within {timeout} s\n{stderr[-4000:]}") from None
        if child.returncode != 0:
            refused = read_config_error(out)
            if refused is not None:
                raise WorkerConfigError(refused)
            raise WorkerError(f"{' '.join(full)} exited {child.returncode}\n{stdout[-4000:]}\n{stderr[-6000:]}")
        paths = [Path(out, f"rank{r}.json") for r in range(nproc)]
        missing = [p.name for p in paths if not p.exists()]
        if missing:
            raise WorkerError(f"{' '.join(full)}: no record from {missing}\n{stderr[-4000:]}")
        return [json.loads(p.read_text()) for p in paths]
