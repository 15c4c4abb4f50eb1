"""One pre-imported Python process that forks the ranks of the suite's multi-rank runs.

Measured on the 2-core CI box: a rank spends 8.8 s importing torch, megatron-core and cp_ext,
and a test's training is about 1 s (`Trainer` init plus 3 iterations of the grid-equivalence
model); a 4-rank launch under torchrun took 32 s, 24 s of it imports. So the suite imports once,
here, and forks: every rank is a copy-on-write child of this process with the modules loaded,
running the script as the interpreter would (`runpy` as ``__main__``, its own ``sys.argv``,
torchrun's environment: RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT, with the run's TCPStore
hosted by the job leader on a port the OS picked, as torchrun's agent hosts it; an uncaught exception
goes through ``sys.excepthook``, so torch.distributed's ``[rankN]:`` prefix appears as in a real
run; non-daemon threads are joined and ``atexit`` runs, so wandb and friends finish as they
would), over real torch.distributed (gloo). What torchrun itself does, its own messages and its
signal handling, is tested under torchrun (`tests.launch.run_script(..., torchrun=True)`).

Protocol (JSON lines; requests on stdin, replies on the original stdout, matched by ``pid``):

    {"script", "nproc", "args", "env", "unset", "cwd", "log_dir"}  ->  {"pid": leader}, later {"pid", "exit"}

``nproc`` 0 is ``python script.py`` (one process, no torchrun environment). A job leader (one
fork per run, a session of its own, so the client ends a whole run with one ``killpg``) forks the
ranks, writes their pids to ``log_dir/pids.json``, waits, and, as torchrun does, ends the others
when one fails and exits 1 (0 when all succeed; plain runs keep their exit code). Rank r writes
``log_dir/rank{r}.out`` and ``.err`` and dumps every thread's stack on SIGUSR1 (the timeout
report). Every child dies with its parent (``PR_SET_PDEATHSIG``), and the server exits when its
stdin closes: a killed pytest leaves nothing behind.

Nothing may start a thread before a fork: the preloads below start none (checked at start).
"""

import ctypes
import json
import os
import select
import signal
import sys
import threading
import time

PRELOAD = ("torch", "torch.distributed", "numpy", "megatron.core", "cp_ext.training.trainer", "cp_ext.attention",
           "cp_ext.inference.generate", "megatron.core.dist_checkpointing", "wandb")
GRACE_S = 5  # after one rank fails, the others get SIGTERM, then SIGKILL this much later


def _die_with_parent():
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:  # not Linux/glibc: the session kill still ends every run
        pass


def _exit_code(e):
    """The exit status a ``SystemExit(e.code)`` gives an interpreter (a message: printed, 1)."""
    if e.code is None or isinstance(e.code, int):
        return e.code or 0
    print(e.code, file=sys.stderr)
    return 1


def _run_rank(request, rank, port_pipe):
    """The body of one rank (a forked child): never returns. ``port_pipe``: where the leader writes the
    port of the run's store once it listens (`_lead`)."""
    import atexit
    import faulthandler
    import random
    import runpy

    _die_with_parent()
    code = 1
    try:
        base = os.path.join(request["log_dir"], f"rank{max(rank, 0)}")
        out = os.open(base + ".out", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        err = os.open(base + ".err", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        os.dup2(out, 1)
        os.dup2(err, 2)
        sys.stdout.reconfigure(line_buffering=True)
        faulthandler.register(signal.SIGUSR1, all_threads=True)
        for sig in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for name in request.get("unset", []):
            os.environ.pop(name, None)
        os.environ.update(request.get("env") or {})
        n = request["nproc"]
        if rank >= 0:
            with os.fdopen(port_pipe, "r") as pipe:
                port = pipe.readline().strip()
            if not port:
                raise SystemExit("forkserver: the job leader gave no store port")
            # As under torchrun: the agent (here the leader) hosts the TCPStore and every rank is its client.
            os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(n), LOCAL_WORLD_SIZE=str(n),
                              GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                              TORCHELASTIC_USE_AGENT_STORE="True", TORCHELASTIC_RESTART_COUNT="0")
        if "OMP_NUM_THREADS" in os.environ:
            import torch

            torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
        random.seed()  # a fresh interpreter's entropy, not the server's state
        import numpy as np

        np.random.seed()
        os.chdir(request.get("cwd") or os.getcwd())
        script = request["script"]
        sys.argv = [script, *request["args"]]
        sys.path[0] = os.path.dirname(os.path.abspath(script))
        try:
            runpy.run_path(script, run_name="__main__")
            code = 0
        except SystemExit as e:
            code = _exit_code(e)
        except BaseException:  # noqa: BLE001 - what the interpreter does with an uncaught exception
            kind, value, tb = sys.exc_info()
            while tb is not None and (tb.tb_frame.f_code.co_filename in (__file__, "<frozen runpy>")):
                tb = tb.tb_next  # the traceback starts in the script, as the interpreter's would
            sys.excepthook(kind, value.with_traceback(tb), tb)
            code = 1
        threading._shutdown()  # noqa: SLF001 - as at interpreter exit: join non-daemon threads,
        atexit._run_exitfuncs()  # noqa: SLF001 - then the atexit callbacks
    except SystemExit as e:
        code = _exit_code(e)
    except BaseException:  # noqa: BLE001 - the harness itself failed: say so in the rank's log
        import traceback

        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
    os._exit(code)


def _lead(request):
    """The job leader (a forked child): forks the ranks, waits, ends the rest on a failure."""
    _die_with_parent()
    os.setsid()
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # the client's stack-dump signal is for the ranks
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    plain = request["nproc"] == 0
    ranks, port_pipes = {}, []
    for rank in [-1] if plain else range(request["nproc"]):
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:
            for fd in [write_end, *port_pipes]:
                os.close(fd)
            _run_rank(request, rank, read_end)
        os.close(read_end)
        port_pipes.append(write_end)
        ranks[pid] = max(rank, 0)
    # The run's TCPStore, hosted here as torchrun's agent hosts it: it listens on a port the OS picks
    # (port 0), so no other process can take the port between choosing and binding it (a free port
    # chosen, released and bound again later raced with suites running beside this one: EADDRINUSE).
    # Made only now: the store's threads must not exist when the ranks are forked.
    store = None
    if not plain:
        from torch.distributed import TCPStore

        store = TCPStore("127.0.0.1", 0, world_size=request["nproc"], is_master=True, wait_for_workers=False)
    for fd in port_pipes:
        if store is not None:
            os.write(fd, f"{store.port}\n".encode())
        os.close(fd)
    with open(os.path.join(request["log_dir"], "pids.json"), "w") as f:
        json.dump({str(r): pid for pid, r in ranks.items()}, f)
    codes, failed_at = [None] * max(request["nproc"], 1), None
    while ranks:
        if failed_at is not None and time.monotonic() - failed_at > GRACE_S:
            for pid in ranks:
                os.kill(pid, signal.SIGKILL)
        try:
            pid, status = os.waitpid(-1, os.WNOHANG if failed_at is not None else 0)
        except ChildProcessError:
            break
        if pid == 0:
            time.sleep(0.05)
            continue
        rank = ranks.pop(pid)
        codes[rank] = os.waitstatus_to_exitcode(status)
        if codes[rank] != 0 and failed_at is None and not plain:
            failed_at = time.monotonic()
            for other in ranks:
                os.kill(other, signal.SIGTERM)
    with open(os.path.join(request["log_dir"], "exit.json"), "w") as f:
        json.dump(codes, f)
    if plain:
        code = codes[0]
        os._exit(code if 0 <= code < 256 else 128 - code)  # killed by signal s: -s -> 128 + s
    os._exit(1 if any(codes) else 0)  # torchrun: 1 when any rank failed


def serve():
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything the preloads or runs print goes to stderr, never into the protocol
    import importlib
    import warnings

    warnings.simplefilter("ignore")
    for name in PRELOAD:
        importlib.import_module(name)
    if threading.active_count() != 1:
        raise SystemExit(f"forkserver: the preloads started {threading.active_count() - 1} thread(s); forking is unsafe")
    # The imported modules live as long as every rank: out of the collector's sight, a full collection
    # (destroy_grid runs one per grid) walks only what a run made. Measured on 2 cores: a 4-rank grid's
    # gc.collect went from 0.50 s to 0.16 s, and one small layout of the grid equivalence from 1.95 s to 0.82 s.
    import gc

    gc.collect()
    gc.freeze()
    replies.write(json.dumps({"ready": os.getpid()}) + "\n")
    leaders, pending = set(), b""
    while True:
        ready = select.select([sys.stdin.buffer], [], [], 0.05 if leaders else None)[0]
        if ready:
            chunk = os.read(sys.stdin.fileno(), 65536)
            if not chunk:
                return
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = json.loads(line)
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    _lead(request)
                leaders.add(pid)
                replies.write(json.dumps({"pid": pid}) + "\n")
        for pid in list(leaders):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                leaders.discard(pid)
                replies.write(json.dumps({"pid": pid, "exit": os.waitstatus_to_exitcode(status)}) + "\n")


if __name__ == "__main__":
    serve()
