"""The import layers in pyproject.toml hold (import-linter's ``lint-imports``), and a broken one fails.

The contracts: every cp_ext package imports only the layers below it (no import circles, no upward
arrows), and what parse time reads imports neither torch nor megatron-core (docs/architecture.md)."""

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
    assert "Contracts: 2 kept, 0 broken" in out, out


def test_an_upward_import_breaks_them(tmp_path):
    """The same check on a copy where the attention layer imports the trainer fails, naming the arrow."""
    shutil.copytree(REPO / "cp_ext", tmp_path / "cp_ext", ignore=shutil.ignore_patterns("__pycache__"))
    ring = tmp_path / "cp_ext" / "attention" / "ring.py"
    ring.write_text(ring.read_text() + "\n\ndef _upward():\n    from cp_ext.training.trainer import Trainer  # noqa\n")
    code, out = _lint_imports(tmp_path)
    assert code != 0, out
    assert "cp_ext.attention.ring -> cp_ext.training.trainer" in out, out
