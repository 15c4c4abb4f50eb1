"""The one command a GPU user runs first: does cp_ext compute exact attention and train on this node?

    bash tools/gpu_check.sh [--out DIR]          # every GPU of the node, <= 9 minutes
    python3 tools/gpu_check.py --device cpu      # what a CPU can run: tests the check itself

Every check is one row of the summary: PASS, FAIL, or "not covered" (not run here, e.g. the
multi-GPU part on a one-GPU node; it never counts as a pass). The table is printed and
written with the environment to ``DIR/summary.json`` (default gpu_check_out/).

The checks are the pytest tests of tests/gpu (marker ``gpu``; tests/gpu/__init__.py lists them and
how to run them directly). This script checks that CUDA is usable, runs them with
``CP_EXT_GPU_CHECK_DEVICE``, ``_OUT`` and ``_DEADLINE`` set (pytest's output: ``DIR/pytest.log``;
each test appends its rows to ``DIR/rows.jsonl``, `tests.gpu.conftest`), and prints their rows.

1. Preflight: torch, CUDA, the GPUs. No usable CUDA: exit 2 (unless ``--device cpu``).
2. One device (tests/gpu/test_one_device.py, test_masks.py, test_one_gpu.py): the library's ring
   (`cp_ext.attention.cp.ring`) on C = 4 ranks of this device over gloo, zigzag, s = 200 tokens =
   8 chunks of 25, so every step after the first is a half tile of 25 rows; every kernel of
   `KERNELS` that can run here x fp64/fp32/bf16/fp16 x causal/full x MHA/GQA: out, LSE, dq, dk, dv
   against float64 truth. Packed documents through every kernel's segments and through the ring;
   windows, sinks and MLA's 192/128 head dims through every kernel; then
   ``pytest tests/attention/kernels/test_cuda_kernels.py`` (one GPU), and Megatron-LM's five MoE scripts'
   flags (tests/families, shrunk in sizes, bf16) training 3 iterations on one GPU.
3. Two or more GPUs (tests/gpu/test_multi_gpu.py; torchrun, NCCL, one rank per GPU): ring,
   Ulysses and the hybrid on ~4096 tokens, bf16 and fp32, against float64 truth; a 30-iteration
   ``--bf16`` demo run whose loss must fall; tools/bench_attention.py whose counted bytes must
   equal `cp_ext.perf.comm`'s formula; the model grid-equivalence test's CP2 ring and Ulysses cases.
4. Linear attention (tests/gpu/test_linear_attention.py, `tests.gpu.linear_attention`): fla's Triton
   kernels (`cp_ext.linear_attention.fla_kernels`) against cp_ext's torch rule, the gated delta rule and
   the segment summary, Gated DeltaNet and KDA, fp32 and bf16, outputs and gradients (one "not covered"
   row without fla); the state-passing CP op at CP2 over gloo on this device against the single-device
   rule. Measure rms(error) / rms(truth) against float64; bound 2 x the torch rule's + fla's own test
   tolerance (x 8 in bf16); the rows state both.
5. DeepSeek-V4's attention (tests/gpu/test_deepseek_v4.py): the sliding, CSA and HCA layers on this device, fp32
   and bf16, with packed documents, output and every gradient against the float64 reference.

Bounds, per tensor, on max |error| against float64 truth, relative to the same attention on one
device in the dtype ("ref"): `tests.attention.bounds` (fp32 <= 2 x ref and <= 1e-4; fp64; bf16/fp16
<= 2 x ref + 2**-8 x max|truth| and <= 2**-5 x max|truth|), with the reasons.

Exit status: 0 when every row that ran passed and the ring on one device ran; 1 on any FAIL
(an exception, a timeout or a missing result is a FAIL); 2 when CUDA is not usable.
Each step is time-boxed and the whole run keeps to ``--budget`` seconds (default 540).
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
# In the order of the summary table.
TESTS = ("tests/gpu/test_one_device.py", "tests/gpu/test_masks.py", "tests/gpu/test_one_gpu.py",
         "tests/gpu/test_multi_gpu.py", "tests/gpu/test_linear_attention.py", "tests/gpu/test_deepseek_v4.py")
GRACE_S = 60  # past the budget, for the last time-boxed step to end; then the tests are stopped


def run_checks(device, out, seconds):
    """Run tests/gpu on ``device`` within ``seconds``: (rows, kernels skipped by what, (exit status, final line))."""
    rows_file, log = out / "rows.jsonl", out / "pytest.log"
    rows_file.unlink(missing_ok=True)  # a stale run's rows must not pass for this one
    env = dict(os.environ, CP_EXT_GPU_CHECK_DEVICE=device.type, CP_EXT_GPU_CHECK_OUT=str(out),
               CP_EXT_GPU_CHECK_DEADLINE=str(time.time() + seconds))
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "pytest", *TESTS, "-q", "-p", "no:cacheprovider"], cwd=ROOT,
                                env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=seconds + GRACE_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # pytest hung outside its steps (each one ends by the deadline)
            proc.wait()
            rc = None
    entries = [json.loads(line) for line in rows_file.read_text().splitlines()] if rows_file.exists() else []
    rows = [e["row"] for e in entries if "row" in e]
    skipped = {}
    for e in entries:
        if "skipped" in e:
            skipped.setdefault(e["skipped"]["what"], []).append(e["skipped"])
    verdicts = [e["verdict"] for e in entries if "verdict" in e]
    if verdicts:
        return rows, skipped, tuple(verdicts[-1])
    why = f"timed out after {seconds + GRACE_S:.0f} s" if rc is None else f"pytest exited {rc} before its verdict"
    rows.append(dict(part="single", check="pytest tests/gpu", status="FAIL", figure=f"{why}; see {log}", bound="",
                     detail=dict(log=str(log))))
    return rows, skipped, (1, f"gpu_check: FAILED: the checks did not finish ({why}; see {log})")


def by_kernel(skipped):
    """The ring's kernel x dtype skips, one entry per (kernel, reason) with its dtypes in order."""
    grouped = {}
    for s in skipped:
        dtypes = grouped.setdefault((s["kernel"], s["reason"]), [])
        if s["dtype"] not in dtypes:
            dtypes.append(s["dtype"])
    return [dict(kernel=k, dtypes=d, reason=r) for (k, r), d in grouped.items()]


def print_table(rows):
    w = max((len(r["check"]) for r in rows), default=5)
    print(f"\n{'check':{w}s}  {'figure measured':34s} {'bound':34s} status")
    for r in rows:
        print(f"{r['check']:{w}s}  {r['figure'][:34]:34s} {r['bound'][:34]:34s} {r['status']}")
    for r in rows:
        if r["status"] == "FAIL":
            print(f"FAIL {r['check']}: {r['figure']} {r['detail'].get('tail', '')}".rstrip())


def environment(device):
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if device.type == "cuda" else []
    return dict(date=time.strftime("%Y-%m-%d %H:%M:%S %Z"), torch=torch.__version__, cuda=torch.version.cuda,
                cudnn=torch.backends.cudnn.version() if device.type == "cuda" else None, device=device.type,
                gpu_count=len(gpus), gpus=gpus, python=sys.version.split()[0])


def preflight(args):
    """The device to check on, or exit 2 with the reason CUDA (or pytest, which runs the checks) is not usable."""
    import importlib.util

    if importlib.util.find_spec("pytest") is None:
        print("gpu_check: pytest is not installed; the checks are pytest tests (tests/gpu): "
              "pip install pytest (on a machine without an index: carry its wheel)", file=sys.stderr)
        sys.exit(2)
    if args.device == "cpu":
        return torch.device("cpu")
    from cp_ext.platform import cuda_unusable_reason

    reason = cuda_unusable_reason()
    if reason is None:
        try:  # a driver or architecture mismatch shows up at the first kernel, not in is_available()
            torch.ones(1, device="cuda").add_(1).item()
        except Exception as e:
            reason = f"a first CUDA op failed: {type(e).__name__}: {e}"
    if reason:
        print(f"gpu_check: CUDA is not usable: {reason}. This check needs an NVIDIA GPU; "
              f"`--device cpu` checks only the script's own logic on the CPU.", file=sys.stderr)
        sys.exit(2)
    return torch.device("cuda", 0)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="cpu: the ring on 4 CPU ranks with the CPU kernels (tests this script)")
    p.add_argument("--out", default="gpu_check_out", help="directory for summary.json and the logs")
    p.add_argument("--budget", type=float, default=540, help="seconds for the whole check (each step is time-boxed)")
    args = p.parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    device = preflight(args)
    env = environment(device)
    print(f"gpu_check: torch {env['torch']}, CUDA {env['cuda']}, cuDNN {env['cudnn']}, {env['gpu_count']} GPU(s)"
          f"{': ' + ', '.join(env['gpus']) if env['gpus'] else ''}; checking on {device.type}; output in {out}",
          flush=True)

    rows, skipped, (code, line) = run_checks(device, out, args.budget - (time.monotonic() - start))
    ring_skipped = by_kernel(skipped.get("ring", []))
    for s in ring_skipped:
        print(f"  not run here: {s['kernel']} {'/'.join(s['dtypes'])}: {s['reason']}")
    for s in skipped.get("masks", []):
        print(f"  masks, not run here: {s['kernel']} {s['dtype']}: {s['reason']}")
    print_table(rows)
    summary = dict(environment=env, seconds=round(time.monotonic() - start, 1), exit_status=code, verdict=line,
                   rows=rows, skipped=ring_skipped)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"\n{line}\n(summary: {out / 'summary.json'}, {summary['seconds']} s)")
    return code


if __name__ == "__main__":
    sys.exit(main())
