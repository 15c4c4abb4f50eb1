"""The import layers in pyproject.toml hold (import-linter's ``lint-imports``), and a broken one fails.

The contracts: every cp_ext package imports only the layers below it (no import circles, no upward
arrows), what parse time reads imports neither torch nor megatron-core, and the training path imports
no measuring tool (cp_ext.bench) and no loss-curve comparison (cp_ext.compare) (docs/architecture.md)."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _lint_imports(root):
    """lint-imports on the package under ``root`` with the repository's contracts: (exit code, output)."""
    pytest.importorskip("importlinter", reason="import-linter is a dev dependency: pip install -e '.[dev]'")
    code = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"
    proc = subprocess.run([sys.executable, "-c", code, "--config", str(REPO / "pyproject.toml")], cwd=root,
                          env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"}, capture_output=True, text=True,
                          timeout=120)
    return proc.returncode, proc.stdout + proc.stderr


@pytest.mark.quick
def test_the_layers_hold():
    code, out = _lint_imports(REPO)
    assert code == 0, out
    assert "Contracts: 3 kept, 0 broken" in out, out


def test_an_upward_import_breaks_them(tmp_path):
    """The same check on a copy where the attention layer imports the trainer fails, naming the arrow."""
    shutil.copytree(REPO / "cp_ext", tmp_path / "cp_ext", ignore=shutil.ignore_patterns("__pycache__"))
    ring = tmp_path / "cp_ext" / "attention" / "cp" / "ring.py"
    ring.write_text(ring.read_text() + "\n\ndef _upward():\n    from cp_ext.training.trainer import Trainer  # noqa\n")
    code, out = _lint_imports(tmp_path)
    assert code != 0, out
    assert "cp_ext.attention.cp.ring -> cp_ext.training.trainer" in out, out


def test_training_importing_a_benchmark_breaks_them(tmp_path):
    """A trainer that imports a measuring tool (even a lazy, in-function import) breaks the third contract."""
    shutil.copytree(REPO / "cp_ext", tmp_path / "cp_ext", ignore=shutil.ignore_patterns("__pycache__"))
    steps = tmp_path / "cp_ext" / "training" / "steps.py"
    steps.write_text(steps.read_text() + "\n\ndef _measured():\n    from cp_ext.bench import workers  # noqa\n")
    code, out = _lint_imports(tmp_path)
    assert code != 0, out
    assert "The training path imports no measuring tool and no loss-curve comparison BROKEN" in out, out
    assert "cp_ext.training.steps -> cp_ext.bench.workers" in out, out


TOOL_LINES = 250  # a tool is a front end: argument parsing and printing over the package


def test_tools_are_thin_front_ends():
    """Every tools/*.py stays a front end: at most ~250 lines, no sys.path edits; nothing in cp_ext/ or
    tests/ imports a tool module or loads a tools/ file by path (tests run the tools as commands)."""
    too_long = {p.name: n for p in (REPO / "tools").glob("*.py") if (n := len(p.read_text().splitlines())) > TOOL_LINES}
    assert not too_long, f"tools over {TOOL_LINES} lines (move the logic into cp_ext/): {too_long}"
    patched = [p.name for p in (REPO / "tools").glob("*.py") if "sys.path.insert" in p.read_text()]
    assert not patched, f"tools editing sys.path (cp_ext is installed): {patched}"
    loaders = [str(p.relative_to(REPO)) for root in ("cp_ext", "tests") for p in (REPO / root).rglob("*.py")
               if p.name != "test_layers.py" and any(s in p.read_text() for s in (
                   "spec_from_file_location", "from tools", "import tools", 'str(REPO_ROOT / "tools")'))]
    assert not loaders, f"files loading tools/ as modules: {loaders}"


def test_console_scripts_are_the_tools():
    """pyproject's console scripts name package functions, and `python tools/X.py` runs the same one."""
    import importlib
    import re
    import tomllib

    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert set(scripts) == {"cp-ext-convert-hf", "cp-ext-plan", "cp-ext-compare"}, scripts
    tools = {"cp-ext-convert-hf": "convert_hf.py", "cp-ext-plan": "plan_parallelism.py",
             "cp-ext-compare": "compare_loss_curves.py"}
    for name, target in scripts.items():
        module, function = target.split(":")
        assert callable(getattr(importlib.import_module(module), function)), target
        tool = (REPO / "tools" / tools[name]).read_text()
        assert re.search(rf"^from {re.escape(module)} import {function}\b", tool, re.M), (name, tools[name])
