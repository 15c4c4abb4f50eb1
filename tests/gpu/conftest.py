"""What the GPU check's tests share: the device, the time budget, where logs go, and their rows.

* Device: ``CP_EXT_GPU_CHECK_DEVICE`` (cuda or cpu; default cuda where it is available). On the
  CPU the CUDA-only checks are "not covered" rows (skipped, with the reason).
* Selection: `pytest tests` leaves these tests out (tests/tools/test_gpu_check.py runs their CPU
  mode through tools/gpu_check.py, so the default suite does not run them twice). They run when
  asked for: ``CP_EXT_GPU_CHECK_DEVICE`` set, ``-m`` naming ``gpu``, or tests/gpu given as a path.
* Rows: each test reports its summary rows through the ``report`` fixture (`Report`); an exception
  after `Report.start` is a FAIL row for that check. With ``CP_EXT_GPU_CHECK_OUT=DIR`` (the tool
  sets it) every row, every kernel skipped and, at the end, `tests.gpu.rows.verdict` are appended
  to ``DIR/rows.jsonl`` as they happen, and the logs go to DIR.
* Budget: ``CP_EXT_GPU_CHECK_DEADLINE`` (seconds since the epoch): `Budget.left` time-boxes each
  step; past it a check is a FAIL "not run: time budget spent".
"""

import json
import os
import time
from pathlib import Path

import pytest
import torch

from tests.gpu.rows import FAIL, NOT_COVERED, row, verdict

_ROWS = "gpu_check_rows"
_SESSION_ROWS = []


def _asked_for(config):
    if os.environ.get("CP_EXT_GPU_CHECK_DEVICE") or "gpu" in (config.option.markexpr or ""):
        return True
    here = Path(__file__).parent.resolve()
    for arg in config.args:
        path = Path(config.invocation_params.dir, arg.split("::")[0]).resolve()
        if path == here or here in path.parents:
            return True
    return False


def pytest_collection_modifyitems(config, items):
    if _asked_for(config):
        return
    gpu = [item for item in items if item.get_closest_marker("gpu")]
    if gpu:
        config.hook.pytest_deselected(items=gpu)
        items[:] = [item for item in items if not item.get_closest_marker("gpu")]


@pytest.fixture(scope="session")
def device():
    name = os.environ.get("CP_EXT_GPU_CHECK_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device("cuda", 0) if name == "cuda" else torch.device("cpu")


@pytest.fixture(scope="session", autouse=True)
def _precision(device):
    """fp32 means fp32 (no TF32); on the CPU one thread each (the ring's four ranks share the cores)."""
    precision, threads = torch.get_float32_matmul_precision(), torch.get_num_threads()
    torch.set_float32_matmul_precision("highest")
    if device.type == "cpu":
        torch.set_num_threads(1)
    yield
    torch.set_float32_matmul_precision(precision)
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def gpu_count(device):
    return torch.cuda.device_count() if device.type == "cuda" else 0


@pytest.fixture(scope="session")
def out_dir(tmp_path_factory):
    """Where the subprocesses' logs go: the tool's --out, else a temporary directory."""
    out = os.environ.get("CP_EXT_GPU_CHECK_OUT")
    return Path(out) if out else tmp_path_factory.mktemp("gpu_check")


class Budget:
    def __init__(self, deadline):
        self.deadline = deadline

    def left(self, cap):
        """Seconds for a step that may take up to ``cap``; fails the check when the budget is spent."""
        left = min(cap, self.deadline - time.time())
        if left <= 0:
            pytest.fail("not run: time budget spent", pytrace=False)
        return left


@pytest.fixture(scope="session")
def budget():
    return Budget(float(os.environ.get("CP_EXT_GPU_CHECK_DEADLINE", "inf")))


class Report:
    """A test's summary rows, and the kernels it could not run here."""

    def __init__(self):
        self.check, self.rows, self.skipped = None, [], []

    def start(self, part, check):
        """Name the check this test runs: an exception from here on is its FAIL row."""
        self.check = (part, check)

    def add(self, r):
        self.rows.append(r)
        return r

    def not_covered(self, why):
        """The started check cannot run here: a "not covered" row, and the test skips."""
        self.add(row(*self.check, NOT_COVERED, why))
        pytest.skip(why)

    def not_run_here(self, kernel, dtype, reason, what):
        """``kernel`` cannot run ``dtype`` here (``what``: "ring", "docs" or "masks"): no row; the tool
        lists it under "not run here"."""
        self.skipped.append(dict(kernel=kernel, dtype=dtype, reason=reason, what=what))
        pytest.skip(f"not run here: {kernel} {dtype}: {reason}")

    def failed(self, excinfo, nodeid):
        """The FAIL row of an exception: the started check's (the test's own name before it started one),
        unless a FAIL row already says why."""
        if any(r["status"] == FAIL for r in self.rows):
            return
        e = excinfo.value
        figure = str(e) if isinstance(e, pytest.fail.Exception) else f"{type(e).__name__}: {e}"
        self.add(row(*(self.check or ("single", nodeid)), FAIL, figure[:300]))


def _report_of(item):
    if not hasattr(item, _ROWS):
        setattr(item, _ROWS, Report())
    return getattr(item, _ROWS)


@pytest.fixture
def report(request):
    return _report_of(request.node)


def _append(entry):
    out = os.environ.get("CP_EXT_GPU_CHECK_OUT")
    if out:
        with open(Path(out) / "rows.jsonl", "a") as f:
            f.write(json.dumps(entry) + "\n")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """Every failure of a test of tests/gpu is a FAIL row, whether or not it used ``report``: the
    verdict never passes what pytest failed."""
    report = yield
    if item.get_closest_marker("gpu") is None:
        return report
    r = _report_of(item)
    if call.excinfo is not None and not call.excinfo.errisinstance(pytest.skip.Exception):
        r.failed(call.excinfo, item.nodeid)
    if call.when == "teardown":
        for x in r.rows:
            _SESSION_ROWS.append(x)
            _append({"row": x})
        for x in r.skipped:
            _append({"skipped": x})
    return report


def pytest_collectreport(report):
    if report.failed:  # a test module that cannot even be collected is a failed check
        x = row("single", f"collect {report.nodeid}", FAIL, str(report.longrepr)[-300:])
        _SESSION_ROWS.append(x)
        _append({"row": x})


def pytest_sessionfinish(session, exitstatus):
    if os.environ.get("CP_EXT_GPU_CHECK_OUT"):
        _append({"verdict": verdict(_SESSION_ROWS)})
