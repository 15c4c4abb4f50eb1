"""tools/compare_loss_curves.py on runs written here: metrics.jsonl files and a real offline wandb run.

The CLI is run as a subprocess (exit status is its contract: 0 agree, 1 differ, 2 bad input);
pure helpers are imported. The real CP=2 vs CP=1 training pair is in tests/scripts/test_compare_cp.py.
"""

import importlib.util
import json
import math
import os
import subprocess
import sys
import textwrap

import pytest

from tests.launch import REPO_ROOT

TOOL = REPO_ROOT / "tools" / "compare_loss_curves.py"

spec = importlib.util.spec_from_file_location("compare_loss_curves", TOOL)
clc = importlib.util.module_from_spec(spec)
spec.loader.exec_module(clc)


def curve(n=20, scale=1.0, offset=0.0):
    """A plausible falling loss curve, iterations 1..n."""
    return {i: (5.5 * math.exp(-i / 15.0) + 1.5) * scale + offset for i in range(1, n + 1)}


def write_jsonl(path, losses, **extra_keys):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for it, loss in sorted(losses.items()):
            record = {"iteration": it, "train/lm_loss": loss, "train/grad_norm": 1.0 + it / 10}
            record.update({k: v(it) for k, v in extra_keys.items()})
            f.write(json.dumps(record) + "\n")
    return path


def run_tool(*args):
    return subprocess.run([sys.executable, str(TOOL), *map(str, args)], capture_output=True, text=True,
                          timeout=300, cwd=REPO_ROOT)


def test_agreeing_curves_pass(tmp_path):
    a = write_jsonl(tmp_path / "a" / "metrics.jsonl", curve())
    b = write_jsonl(tmp_path / "b" / "metrics.jsonl", curve(scale=1 + 3e-7))  # fp32-rounding-sized
    proc = run_tool(a, b, "--tolerance", "1e-5")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "aligned iterations: 20 (1-20)" in out
    assert "only in A: none" in out and "only in B: none" in out
    for label in ("max abs diff:", "mean abs diff:", "max rel diff:", "mean rel diff:"):
        assert label in out
    max_rel = float(out.split("max rel diff:")[1].split()[0])
    assert max_rel == pytest.approx(3e-7, rel=1e-2)
    assert out.strip().splitlines()[-1].startswith("PASS")


def test_run_directories_are_read_through_their_metrics_jsonl(tmp_path):
    write_jsonl(tmp_path / "a" / "metrics.jsonl", curve())
    write_jsonl(tmp_path / "b" / "metrics.jsonl", curve())
    proc = run_tool(tmp_path / "a", tmp_path / "b")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "max abs diff:  0.000000e+00" in proc.stdout


def test_disagreeing_curves_fail_and_name_the_iterations(tmp_path):
    losses = curve()
    drifted = {i: v * (1 + 1e-3) if i >= 12 else v for i, v in losses.items()}
    a = write_jsonl(tmp_path / "a.jsonl", losses)
    b = write_jsonl(tmp_path / "b.jsonl", drifted)
    proc = run_tool(a, b, "--tolerance", "1e-5")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("FAIL") and "9 of 20 iterations" in last and "first at iteration 12" in last
    assert "failing: 12-20" in last
    # the same pair passes at a tolerance above the drift, or with an absolute bound
    assert run_tool(a, b, "--tolerance", "2e-3").returncode == 0
    assert run_tool(a, b, "--atol", "1e-2").returncode == 0


def test_other_key(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", curve())
    b = write_jsonl(tmp_path / "b.jsonl", curve(), **{"train/grad_norm": lambda it: 5.0})
    assert run_tool(a, b).returncode == 0  # lm loss agrees
    proc = run_tool(a, b, "--key", "train/grad_norm")
    assert proc.returncode == 1 and "key: train/grad_norm" in proc.stdout


def test_different_iteration_ranges_fail_unless_partial_is_allowed(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", curve(20))
    b = write_jsonl(tmp_path / "b.jsonl", {i: v for i, v in curve(20).items() if i <= 14 and i != 5})
    proc = run_tool(a, b)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "aligned iterations: 13 (1-4, 6-14)" in proc.stdout
    assert "only in A: 5, 15-20" in proc.stdout and "only in B: none" in proc.stdout
    assert "cover different iterations" in proc.stdout
    proc = run_tool(a, b, "--allow-partial")
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_nan_fails(tmp_path):
    losses = curve()
    a = write_jsonl(tmp_path / "a.jsonl", losses)
    b = write_jsonl(tmp_path / "b.jsonl", {**losses, 7: float("nan")})
    proc = run_tool(a, b)
    assert proc.returncode == 1
    assert "non-finite values (NaN/inf) at iterations: 7" in proc.stdout


@pytest.mark.parametrize("problem", ["missing", "bad_json", "unknown_key", "no_overlap", "ambiguous_dir", "empty_dir"])
def test_bad_input_exits_2_with_a_message(tmp_path, problem):
    good = write_jsonl(tmp_path / "good.jsonl", curve())
    args = [good, tmp_path / "missing" / "metrics.jsonl"]
    if problem == "bad_json":
        bad = tmp_path / "bad.jsonl"
        bad.write_text('{"iteration": 1, "train/lm_loss": 5.0}\nnot json\n{"iteration": 3, "train/lm_loss": 4.0}\n')
        args = [good, bad]
    elif problem == "unknown_key":
        args = [good, good, "--key", "train/nope"]
    elif problem == "no_overlap":
        args = [good, write_jsonl(tmp_path / "late.jsonl", {i + 100: v for i, v in curve().items()})]
    elif problem == "ambiguous_dir":
        for name in ("offline-run-1-aaa", "offline-run-2-bbb"):
            (tmp_path / "runs" / "wandb" / name).mkdir(parents=True)
            (tmp_path / "runs" / "wandb" / name / f"run-{name[-3:]}.wandb").write_bytes(b"")
        args = [good, tmp_path / "runs"]
    elif problem == "empty_dir":
        (tmp_path / "empty").mkdir()
        args = [good, tmp_path / "empty"]
    proc = run_tool(*args)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    message = proc.stderr
    assert message.startswith("compare_loss_curves.py: error:"), message
    expected = {"missing": "no such file", "bad_json": ":2: not valid JSON", "unknown_key": "no values for --key train/nope",
                "no_overlap": "share no iteration", "ambiguous_dir": "holds 2 wandb runs",
                "empty_dir": "no metrics.jsonl and no wandb run"}[problem]
    assert expected in message, message
    if problem == "unknown_key":
        assert "train/grad_norm" in message and "train/lm_loss" in message  # lists what is there


def test_truncated_last_line_is_ignored(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", curve(5))
    b = write_jsonl(tmp_path / "b.jsonl", curve(5))
    with open(b, "a") as f:
        f.write('{"iteration": 6, "train/lm_')  # a run killed mid-write
    proc = run_tool(a, b)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "truncated last line" in proc.stderr


def test_plot_png_written(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", curve())
    b = write_jsonl(tmp_path / "b.jsonl", curve(offset=1e-3))
    out = tmp_path / "plots" / "curves.png"
    proc = run_tool(a, b, "--plot", out)
    assert proc.returncode == 1, proc.stdout + proc.stderr  # the plot is written for failing pairs too
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert out.stat().st_size > 10_000  # two panels with curves, not an empty canvas


def test_plot_without_matplotlib_is_a_clear_error(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", curve())
    blocker = tmp_path / "no_mpl"
    blocker.mkdir()
    (blocker / "matplotlib.py").write_text("raise ImportError('matplotlib hidden by the test')\n")
    env = dict(os.environ, PYTHONPATH=str(blocker))
    proc = subprocess.run([sys.executable, str(TOOL), str(a), str(a), "--plot", str(tmp_path / "x.png")],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2
    assert "--plot needs the matplotlib package" in proc.stderr and "pip install matplotlib" in proc.stderr


WANDB_WRITER = textwrap.dedent("""
    import json, sys
    import wandb
    out_dir, losses = sys.argv[1], json.loads(sys.argv[2])
    run = wandb.init(mode="offline", dir=out_dir, project="cp_ext-test", name="compare-test")
    for it, loss in losses:
        # what cp_ext's MetricsLogger does: the iteration is wandb's step
        run.log({"train/lm_loss": loss, "train/grad_norm": 1.0}, step=it)
    run.finish()
""")


@pytest.fixture(scope="module")
def offline_wandb_run(tmp_path_factory):
    """A real offline wandb run (wandb.init(mode="offline") + wandb.log), in a subprocess."""
    root = tmp_path_factory.mktemp("wandb_run")
    losses = curve(12)
    env = dict(os.environ, WANDB_SILENT="true", WANDB_MODE="offline")
    env.pop("WANDB_DISABLED", None)
    proc = subprocess.run([sys.executable, "-c", WANDB_WRITER, str(root), json.dumps(sorted(losses.items()))],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    runs = list((root / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, list(root.rglob("*"))
    return root, runs[0], losses


def test_offline_wandb_run_matches_its_metrics_jsonl(tmp_path, offline_wandb_run):
    root, run_dir, losses = offline_wandb_run
    jsonl = write_jsonl(tmp_path / "metrics.jsonl", losses)
    log_file = next(run_dir.glob("run-*.wandb"))
    proc = run_tool(run_dir, jsonl, "--tolerance", "0")  # the same floats, exactly
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "[wandb-offline: " in proc.stdout and "aligned iterations: 12 (1-12)" in proc.stdout
    assert "max abs diff:  0.000000e+00" in proc.stdout
    # the .wandb file itself and the directory above wandb/ (a --wandb-save-dir) resolve to the same log
    for spec in (log_file, root):
        proc = run_tool(spec, jsonl, "--tolerance", "0")
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert str(log_file.name) in proc.stdout


def test_offline_wandb_run_against_a_different_curve_fails(tmp_path, offline_wandb_run):
    _, run_dir, losses = offline_wandb_run
    other = write_jsonl(tmp_path / "metrics.jsonl", {i: v + 0.01 for i, v in losses.items()})
    proc = run_tool(other, run_dir)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "FAIL" in proc.stdout


def test_wandb_run_path_parsing():
    assert clc.wandb_run_path("my-team/cp_ext/abc123") == "my-team/cp_ext/abc123"
    assert clc.wandb_run_path("wandb:my-team/cp_ext/abc123") == "my-team/cp_ext/abc123"
    assert clc.wandb_run_path("https://wandb.ai/my-team/cp_ext/runs/abc123?nw=x") == "my-team/cp_ext/abc123"
    assert clc.wandb_run_path("runs/cp2") is None
    with pytest.raises(clc.InputError):
        clc.wandb_run_path("wandb:not-a-run")


def test_missing_local_path_is_not_mistaken_for_a_wandb_run(tmp_path):
    # three components like entity/project/run_id, but clearly a file: no network attempt
    proc = run_tool(write_jsonl(tmp_path / "a.jsonl", curve()), "runs/cp2/metrics.jsonl")
    assert proc.returncode == 2 and "no such file or directory" in proc.stderr


def test_ranges():
    assert clc.ranges([]) == "none"
    assert clc.ranges([1, 2, 3, 7, 9, 10]) == "1-3, 7, 9-10"


def test_online_reader_maps_steps_and_values(monkeypatch):
    """Online runs need network; this pins only our side of wandb.Api (a stand-in run object)."""
    import wandb

    class FakeRun:
        summary = {"train/lm_loss": 1.0, "_step": 3}

        def scan_history(self, keys):
            assert keys == ["_step", "train/lm_loss"]
            return iter([{"_step": 1, "train/lm_loss": 5.0}, {"_step": 2, "train/lm_loss": 4.5}])

    class FakeApi:
        def __init__(self, timeout=None):
            pass

        def run(self, path):
            assert path == "team/proj/abc123"
            return FakeRun()

    monkeypatch.setattr(wandb, "Api", FakeApi)
    c = clc.load_curve("https://wandb.ai/team/proj/runs/abc123", "train/lm_loss")
    assert (c.kind, c.values) == ("wandb-online", {1: 5.0, 2: 4.5})


def test_validation_curves_with_metric(tmp_path):
    """--metric valid/lm_loss reads the evaluation lines metrics.jsonl holds between training lines."""
    def with_valid(path, shift):
        write_jsonl(path, curve())
        with open(path, "a") as f:
            for it in (5, 10, 15):
                f.write(json.dumps({"iteration": it, "valid/lm_loss": 3.0 + shift - it / 100}) + "\n")
        return path

    a, b = with_valid(tmp_path / "a.jsonl", 0.0), with_valid(tmp_path / "b.jsonl", 0.0)
    proc = run_tool(a, b, "--metric", "valid/lm_loss")
    assert proc.returncode == 0 and "valid/lm_loss" in proc.stdout, proc.stdout + proc.stderr
    c = with_valid(tmp_path / "c.jsonl", 0.01)
    assert run_tool(a, c).returncode == 0  # train loss agrees
    assert run_tool(a, c, "--metric", "valid/lm_loss").returncode == 1
