"""tools/compare_loss_curves.py on runs written here: metrics.jsonl files and a real offline wandb run.

The CLI is run as a subprocess (exit status is its contract: 0 agree, 1 differ, 2 bad input);
pure helpers are imported from cp_ext.compare.curves. The real CP=2 vs CP=1 training pair is in
tests/scripts/test_compare_cp.py; the 60-iteration demo pairs that --band is checked on are stored in
tests/compare/data/cpu_demo/.
"""

import json
import math
import os
import re
import subprocess
import sys
import textwrap

import pytest

from cp_ext.compare import curves as clc
from tests.launch import REPO_ROOT

TOOL = REPO_ROOT / "tools" / "compare_loss_curves.py"


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


@pytest.mark.quick
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


@pytest.mark.quick
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


@pytest.mark.quick
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

        def scan_history(self):  # every key: the other metrics are compared too
            return iter([{"_step": 1, "train/lm_loss": 5.0, "train/grad_norm": 2.0, "_runtime": 1.5},
                         {"_step": 2, "train/lm_loss": 4.5, "media": {"_type": "image-file"}},
                         {"_step": 3, "train/grad_norm": 1.0}])

    class FakeApi:
        def __init__(self, timeout=None):
            pass

        def run(self, path):
            assert path == "team/proj/abc123"
            return FakeRun()

    monkeypatch.setattr(wandb, "Api", FakeApi)
    c = clc.load_curve("https://wandb.ai/team/proj/runs/abc123", "train/lm_loss")
    assert (c.kind, c.values) == ("wandb-online", {1: 5.0, 2: 4.5})
    assert c.series["train/grad_norm"] == {1: 2.0, 3: 1.0} and "media" not in c.series  # wandb media: skipped


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


# ---------------------------------------------------------------- malformed input: exit 2, one message

GOOD_LINE = '{"iteration": 1, "train/lm_loss": 5.0, "train/grad_norm": 1.0}'
MALFORMED = {
    # case: (line 2 of the file, what the message must say)
    "string_value": ('{"iteration": 2, "train/lm_loss": "4.5"}', ':2: key "train/lm_loss" must be a number or null, got a string ("4.5")'),
    "list_value": ('{"iteration": 2, "train/lm_loss": [4.5]}', ':2: key "train/lm_loss" must be a number or null, got a list'),
    "dict_value": ('{"iteration": 2, "train/lm_loss": {"v": 4.5}}', ':2: key "train/lm_loss" must be a number or null, got an object'),
    "bool_value": ('{"iteration": 2, "train/lm_loss": true}', ':2: key "train/lm_loss" must be a number or null, got a boolean (true)'),
    "other_key_string": ('{"iteration": 2, "train/lm_loss": 4.5, "train/grad_norm": "big"}',
                         ':2: key "train/grad_norm" must be a number or null, got a string ("big")'),
    "fractional_iteration": ('{"iteration": 1.7, "train/lm_loss": 4.5}', ':2: "iteration" must be a non-negative integer, got 1.7'),
    "string_iteration": ('{"iteration": "3", "train/lm_loss": 4.5}', ':2: "iteration" must be a non-negative integer, got a string ("3")'),
    "bool_iteration": ('{"iteration": true, "train/lm_loss": 4.5}', ':2: "iteration" must be a non-negative integer, got a boolean (true)'),
    "negative_iteration": ('{"iteration": -2, "train/lm_loss": 4.5}', ':2: "iteration" must be a non-negative integer, got -2'),
    "null_iteration": ('{"iteration": null, "train/lm_loss": 4.5}', ':2: "iteration" must be a non-negative integer, got null'),
    "no_iteration": ('{"train/lm_loss": 4.5}', ':2: no "iteration" field'),
    "not_an_object": ('[2, 4.5]', ':2: expected a JSON object per line, got a list'),
    "torn_middle_line": ('{"iteration": 2, "train/lm_', ':2: not valid JSON'),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_metrics_jsonl_exits_2_naming_file_line_and_key(tmp_path, case):
    line, expected = MALFORMED[case]
    bad = tmp_path / "bad" / "metrics.jsonl"
    bad.parent.mkdir()
    bad.write_text(GOOD_LINE + "\n" + line + "\n" + '{"iteration": 3, "train/lm_loss": 4.0}\n')
    good = write_jsonl(tmp_path / "good.jsonl", curve(3))
    for args in ([good, bad], [bad.parent, good]):  # either side, file or run directory
        proc = run_tool(*args)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert proc.stdout == ""
        assert "Traceback" not in proc.stderr
        message = proc.stderr.strip()
        assert message.startswith("compare_loss_curves.py: error:") and len(message.splitlines()) == 1, message
        assert f"{bad}{expected}" in message, message


def test_non_utf8_file_exits_2_naming_the_line(tmp_path):
    good = write_jsonl(tmp_path / "good.jsonl", curve(3))
    bad = tmp_path / "latin1.jsonl"
    bad.write_bytes(GOOD_LINE.encode() + b'\n{"iteration": 2, "train/lm_loss": 4.5, "note": "caf\xe9"}\n')
    proc = run_tool(good, bad)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"{bad}:2: not UTF-8 text (byte 0xe9" in proc.stderr and "Traceback" not in proc.stderr


def test_torn_last_line_is_tolerated_but_only_the_last(tmp_path):
    """A killed run leaves a torn last line (tolerated with a warning); blank lines after it are fine."""
    good = write_jsonl(tmp_path / "good.jsonl", curve(3))
    torn = tmp_path / "torn.jsonl"
    torn.write_text(good.read_text() + '{"iteration": 4, "train/lm_loss": 3.\n\n')
    proc = run_tool(good, torn)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"warning: {torn}:4: ignoring a truncated last line" in proc.stderr
    torn.write_text(good.read_text() + '{"iteration": 4, "train/lm_loss": 3.\n{"iteration": 5, "train/lm_loss": 3.0}\n')
    proc = run_tool(good, torn)
    assert proc.returncode == 2 and f"{torn}:4: not valid JSON" in proc.stderr, proc.stderr


def test_integral_float_iterations_and_null_values_are_accepted(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", curve(3))
    b = tmp_path / "b.jsonl"
    b.write_text("".join(json.dumps({"iteration": float(i), "train/lm_loss": v, "train/load_balancing_loss": None}) + "\n"
                         for i, v in curve(3).items()))
    proc = run_tool(a, b)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "aligned iterations: 3 (1-3)" in proc.stdout


@pytest.mark.parametrize("flags, message", [
    (["--tolerance", "nan"], "argument --tolerance: must be a finite number >= 0, got nan"),
    (["--tolerance", "inf"], "argument --tolerance: must be a finite number >= 0, got inf"),
    (["--tolerance=-1e-5"], "argument --tolerance: must be a finite number >= 0, got -1e-5"),
    (["--tolerance", "-0.5"], "argument --tolerance: must be a finite number >= 0, got -0.5"),
    (["--tolerance", "tight"], "argument --tolerance: 'tight' is not a number"),
    (["--atol", "nan"], "argument --atol: must be a finite number >= 0, got nan"),
    (["--atol=-inf"], "argument --atol: must be a finite number >= 0, got -inf"),
    (["--band", "nan"], "argument --band: must be a finite number >= 0, got nan"),
    (["--band", "-0.01"], "argument --band: must be a finite number >= 0, got -0.01"),
    (["--band", "0.01", "--band-ema", "1"], "argument --band-ema: must be a finite number in [0, 1), got 1"),
    (["--band", "0.01", "--band-ema", "nan"], "argument --band-ema: must be a finite number in [0, 1), got nan"),
    (["--band-ema", "0.9"], "--band-ema applies with --band only"),
])
def test_bad_tolerances_are_refused(tmp_path, flags, message):
    a = write_jsonl(tmp_path / "a.jsonl", curve())
    b = write_jsonl(tmp_path / "b.jsonl", curve(offset=1.0))  # far apart: a NaN tolerance used to pass these
    proc = run_tool(a, b, *flags)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert proc.stdout == ""


# ---------------------------------------------------------------- the plot comes before the verdict

def test_plot_is_written_before_the_verdict_line(tmp_path):
    """Whoever reads the PASS/FAIL line finds the plot already on disk."""
    a = write_jsonl(tmp_path / "a.jsonl", curve())
    b = write_jsonl(tmp_path / "b.jsonl", curve(scale=1.01))
    out = tmp_path / "plots" / "curves.png"
    proc = subprocess.Popen([sys.executable, str(TOOL), str(a), str(b), "--plot", str(out), "--band", "0.05"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO_ROOT)
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if line.startswith(("PASS", "FAIL")):
            assert out.is_file() and out.read_bytes()[:4] == b"\x89PNG", "verdict printed before the plot was written"
    assert proc.wait(timeout=300) == 0, "".join(seen) + proc.stderr.read()
    lines = [line.rstrip("\n") for line in seen]
    assert lines[-2] == f"plot: {out}" and lines[-1].startswith("PASS (by the band, not strictly)")
    assert out.stat().st_size > 10_000


@pytest.mark.parametrize("target", ["proc", "under_a_file", "unknown_format"])
def test_plot_failure_exits_2_without_a_verdict_or_traceback(tmp_path, target):
    a = write_jsonl(tmp_path / "a.jsonl", curve())
    (tmp_path / "file").write_text("")
    out = {"proc": "/proc/x.png", "under_a_file": tmp_path / "file" / "x.png", "unknown_format": tmp_path / "x.notaformat"}[target]
    if target == "proc" and not os.path.isdir("/proc"):
        pytest.skip("no /proc here")
    proc = run_tool(a, a, "--plot", out)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stdout == ""  # no PASS for a run whose plot is missing
    assert f"compare_loss_curves.py: error: --plot {out}: could not write the plot" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


# ---------------------------------------------------------------- which metric moved first

def write_run(path, lm_from=None, aux_from=None, lm_by=1e-3, aux_by=1e-3, lr_scale=1.0, n=30):
    """A MoE-like metrics.jsonl: the LM and aux losses move by a relative amount from an iteration on."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for it, loss in curve(n).items():
            aux = 1.1 + 0.1 * math.sin(it / 3)
            record = {"iteration": it,
                      "train/lm_loss": loss * (1 + lm_by if lm_from is not None and it >= lm_from else 1),
                      "train/load_balancing_loss": aux * (1 + aux_by if aux_from is not None and it >= aux_from else 1),
                      "train/grad_norm": 1.0 + it / 10,
                      "train/learning_rate": lr_scale * 3e-3 * min(1.0, it / 6),
                      "train/tokens_per_second": 5000.0 + 100 * it,  # timing: never compared
                      "train/iteration_time_ms": 700.0 - it}
            f.write(json.dumps(record) + "\n")
    return path


def test_aux_loss_moving_first_points_at_routing(tmp_path):
    a = write_run(tmp_path / "a.jsonl")
    b = write_run(tmp_path / "b.jsonl", lm_from=11, aux_from=8)
    proc = run_tool(a, b)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    out = proc.stdout
    assert "first divergence: iteration 11 (train/lm_loss:" in out
    assert "per metric, first iteration past rel tolerance 1e-05 (4 metrics both runs log):" in out
    assert re.search(r"^  train/load_balancing_loss +iteration 8 ", out, re.M)
    assert re.search(r"^  train/lm_loss +iteration 11 ", out, re.M)
    assert re.search(r"^  train/grad_norm +never ", out, re.M)
    assert "tokens_per_second" not in out and "iteration_time" not in out
    assert "moved first: train/load_balancing_loss (iteration 8)" in out
    assert "hint: the aux (load-balancing) loss left tolerance before the LM loss: points at a flipped top-k routing decision" in out
    assert out.strip().splitlines()[-1].startswith("FAIL: 20 of 30 iterations exceed rel tolerance 1e-05 (first at iteration 11;")


def test_lm_loss_moving_first_points_at_attention_or_data(tmp_path):
    a = write_run(tmp_path / "a.jsonl")
    b = write_run(tmp_path / "b.jsonl", lm_from=6, aux_from=9)
    proc = run_tool(a, b)
    assert proc.returncode == 1
    assert "first divergence: iteration 6 (train/lm_loss:" in proc.stdout
    assert "moved first: train/lm_loss (iteration 6)" in proc.stdout
    assert "hint: the LM loss left tolerance before the aux (load-balancing) loss: points at attention or data" in proc.stdout


def test_same_iteration_the_farther_metric_is_named(tmp_path):
    a = write_run(tmp_path / "a.jsonl")
    b = write_run(tmp_path / "b.jsonl", lm_from=7, aux_from=7, lm_by=3e-5, aux_by=3e-4)  # the fp32 demo's pattern
    out = run_tool(a, b).stdout
    assert "moved first: train/load_balancing_loss, train/lm_loss together (iteration 7)" in out
    assert "the aux loss 10x as far" in out and "flipped top-k routing decision" in out


def test_aux_moving_alone_does_not_fail_the_lm_loss(tmp_path):
    a = write_run(tmp_path / "a.jsonl")
    b = write_run(tmp_path / "b.jsonl", aux_from=20)
    proc = run_tool(a, b)
    assert proc.returncode == 0, proc.stdout + proc.stderr  # the verdict judges --key only
    assert "first divergence" not in proc.stdout
    assert "moved first: train/load_balancing_loss (iteration 20)" in proc.stdout
    b2 = write_run(tmp_path / "b2.jsonl")
    proc = run_tool(a, b2)
    assert "other metrics: train/grad_norm, train/learning_rate, train/load_balancing_loss within rel tolerance 1e-05" in proc.stdout


def test_a_different_learning_rate_is_named(tmp_path):
    a = write_run(tmp_path / "a.jsonl")
    b = write_run(tmp_path / "b.jsonl", lm_from=2, aux_from=2, lr_scale=0.5)
    out = run_tool(a, b).stdout
    assert "moved first: train/learning_rate (iteration 1)" in out
    assert "hint: train/learning_rate differs (iteration 1): the runs do not follow the same learning-rate schedule" in out


# ---------------------------------------------------------------- --band

def test_ema():
    assert clc.ema([1.0, 2.0, 4.0], 0.5) == [1.0, 1.5, 2.75]
    assert clc.ema([1.0, 2.0], 0.0) == [1.0, 2.0]


def test_band_is_judged_from_the_first_divergence(tmp_path):
    """Iterations 1-9 identical, then B is noisy by +-3% around A: outside 1e-5, inside a 1% EMA band."""
    losses = curve(60)
    noisy = {i: v * (1 + (0.03 if i % 2 else -0.03)) if i >= 10 else v for i, v in losses.items()}
    a = write_jsonl(tmp_path / "a.jsonl", losses)
    b = write_jsonl(tmp_path / "b.jsonl", noisy)
    assert run_tool(a, b).returncode == 1
    proc = run_tool(a, b, "--band", "0.01")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.search(r"^band: EMA weight 0.9 \(about 10 iterations\), relative band 0.01 \(1%\), judged from "
                     r"iteration 10 to 60: max EMA rel diff ", proc.stdout, re.M), proc.stdout
    assert proc.stdout.strip().splitlines()[-1].startswith(
        "PASS (by the band, not strictly): 51 of 60 iterations exceed rel tolerance 1e-05 (first at iteration 10;")
    # no smoothing: the raw 3% swings are outside the band
    proc = run_tool(a, b, "--band", "0.01", "--band-ema", "0")
    assert proc.returncode == 1
    assert "outside the 1% band: the EMA-smoothed curves part by 3% at iteration" in proc.stdout
    assert "(51 of 51 iterations from 10 on, first at iteration 10)" in proc.stdout
    # a strict pass stays a strict PASS with --band
    proc = run_tool(a, a, "--band", "0.01")
    assert proc.returncode == 0 and proc.stdout.strip().splitlines()[-1].startswith("PASS: 60 iterations agree")


def test_band_does_not_excuse_nan_or_missing_iterations(tmp_path):
    losses = curve(30)
    a = write_jsonl(tmp_path / "a.jsonl", losses)
    assert run_tool(a, write_jsonl(tmp_path / "nan.jsonl", {**losses, 20: float("nan")}), "--band", "0.5").returncode == 1
    short = write_jsonl(tmp_path / "short.jsonl", {i: v * 1.001 for i, v in losses.items() if i <= 25})
    assert run_tool(a, short, "--band", "0.5").returncode == 1
    assert run_tool(a, short, "--band", "0.5", "--allow-partial").returncode == 0


# ---------------------------------------------------------------- the band on real runs (tests/compare/data)
# tests/compare/data/cpu_demo/README.md says how each metrics.jsonl was made: configs/cpu_demo.yaml, 60 iterations,
# 4 CPU ranks, CP2 x DP2 ("cp2") against DP4 ("cp1"), fp32 unless named bf16.

DATA = REPO_ROOT / "tests" / "compare" / "data" / "cpu_demo"
BAND = ["--band", "0.02", "--band-ema", "0.95"]


def last_line(proc):
    return proc.stdout.strip().splitlines()[-1]


def test_real_fp32_cp2_vs_cp1_parts_by_routing_and_passes_the_band_not_strictly():
    strict = run_tool(DATA / "fp32_cp2.jsonl", DATA / "fp32_cp1.jsonl")
    assert strict.returncode == 1, strict.stdout + strict.stderr
    out = strict.stdout
    assert "first divergence: iteration 7 (train/lm_loss:" in out
    assert "moved first: train/load_balancing_loss, train/grad_norm, train/lm_loss together (iteration 7)" in out
    assert "the aux loss 8.67x as far" in out and "flipped top-k routing decision" in out
    assert "note:" not in out
    proc = run_tool(DATA / "fp32_cp2.jsonl", DATA / "fp32_cp1.jsonl", *BAND)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert last_line(proc).startswith("PASS (by the band, not strictly): 53 of 60 iterations exceed rel tolerance 1e-05")
    assert "within the 2% band (max 0.789% at iteration 59)" in last_line(proc)


def test_real_bf16_cp2_vs_cp1_passes_the_band_not_strictly():
    strict = run_tool(DATA / "bf16_cp2.jsonl", DATA / "bf16_cp1.jsonl")
    assert strict.returncode == 1, strict.stdout + strict.stderr
    assert "first divergence: iteration 3 (train/lm_loss:" in strict.stdout
    assert "hint: the aux (load-balancing) loss left tolerance before the LM loss" in strict.stdout
    proc = run_tool(DATA / "bf16_cp2.jsonl", DATA / "bf16_cp1.jsonl", *BAND)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert last_line(proc).startswith("PASS (by the band, not strictly)")
    # a 10-iteration EMA does not ride out the CP1 run's loss spike at iteration 14 (4.17 vs 3.40)
    proc = run_tool(DATA / "bf16_cp2.jsonl", DATA / "bf16_cp1.jsonl", "--band", "0.02", "--band-ema", "0.9")
    assert proc.returncode == 1 and "outside the 2% band" in last_line(proc), proc.stdout


def test_real_bug_fails_the_band():
    """The CP2 run at half the learning rate (--lr 1.5e-3; a bug that scaled the LR by 1/CP would do this)."""
    proc = run_tool(DATA / "fp32_cp2_half_lr.jsonl", DATA / "fp32_cp1.jsonl", *BAND)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert last_line(proc).startswith("FAIL: 58 of 60 iterations exceed rel tolerance 1e-05 (first at iteration 3;")
    assert "outside the 2% band: the EMA-smoothed curves part by 4.32% at iteration 60" in last_line(proc)
    assert "moved first: train/learning_rate (iteration 2)" in proc.stdout
    assert "hint: train/learning_rate differs (iteration 2)" in proc.stdout


def test_real_data_order_difference_is_named_though_within_the_band():
    """The CP2 run with --data-seed 4321: statistically the same training, so within the band; the report
    still says it differs from iteration 1 with the LM loss ahead (data), which rounding never does."""
    proc = run_tool(DATA / "fp32_cp2_data_seed.jsonl", DATA / "fp32_cp1.jsonl", *BAND)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "note: train/lm_loss differs at the first iteration, before any update: not drift" in proc.stdout
    assert "the LM loss 3.8x as far" in proc.stdout and "points at attention or data" in proc.stdout
