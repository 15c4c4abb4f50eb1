"""What the whole suite shares: temporary files, the fork server's lifetime, data fixtures, ``quick``.

``pytest -m quick`` is the edit-run loop (a few minutes): at least one test of every module,
among them the parse-time errors, one ring and one Ulysses exactness case and a 2-rank training
step. A module whose tests share one launch marks its quick cases (`tests.launch.case_params`)
and, under ``-m quick`` (the `quick` fixture), launches only those (``launch(..., cases=...)``).
``pytest tests`` (CI) runs everything.

Temporary files: the session makes one directory and points TMPDIR (and `tempfile`) at it, so
everything the tests and their subprocesses write there (pytest's tmp_path, torchrun's and wandb's
scratch, the launches' results) goes when the session ends; ``CP_EXT_KEEP_TEST_TMP=1`` keeps it.
"""

import os
import shutil
import tempfile

import pytest

from tests import launch

_OWNED = []


def pytest_configure(config):
    config.addinivalue_line("markers", "quick: in the quick subset (pytest -m quick), the edit-run loop")
    config.addinivalue_line("markers", "gpu: the GPU check's tests (tests/gpu; run by tools/gpu_check.sh, "
                                       "left out of `pytest tests`: see tests/gpu/conftest.py)")
    config.addinivalue_line("markers", "multinode: runs on a SLURM cluster of several nodes built from Linux namespaces on this "
                                       "machine (tests/scripts/multinode_cluster.py; root; skips where it cannot be built)")
    config.addinivalue_line("markers", "ci_leg(python): checks what the launcher, SLURM, the kernel or the network do, the same "
                                       "on every megatron-core: CI runs it on that Python's leg only (CP_EXT_CI_LEG, set by "
                                       ".ci/run), a plain `pytest tests` everywhere; ci_leg(\"none\"): a plain `pytest tests` only")
    if not _OWNED:
        root = tempfile.mkdtemp(prefix="cp_ext_suite_")
        _OWNED.append(root)
        os.environ["TMPDIR"] = tempfile.tempdir = root


def pytest_collection_modifyitems(config, items):
    """Under CI (CP_EXT_CI_LEG=3.11 / 3.12) a ``ci_leg`` test runs on its own leg only: the two legs differ
    in Python and megatron-core, which such a test does not reach, and each leg must stay under 20 minutes."""
    leg = os.environ.get("CP_EXT_CI_LEG")
    if not leg:
        return
    elsewhere = [item for item in items if (mark := item.get_closest_marker("ci_leg")) and mark.args[0] != leg]
    if elsewhere:
        config.hook.pytest_deselected(items=elsewhere)
        items[:] = [item for item in items if item not in elsewhere]


def pytest_collection_finish(session):
    """A module with a ``start_early()`` (a run that mostly waits, e.g. for a timeout) starts it now,
    so its waiting overlaps the rest of the session; its test then checks what it saw."""
    for module in dict.fromkeys(item.module for item in session.items if hasattr(item, "module")):
        if hasattr(module, "start_early") and not session.config.option.collectonly:
            module.start_early()


def pytest_sessionfinish(session, exitstatus):
    launch.shutdown()  # the fork server and every launch's temp directory
    for root in _OWNED:
        if os.environ.get("CP_EXT_KEEP_TEST_TMP"):
            print(f"\nkept the test session's temporary files in {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)


def write_short_documents(prefix, num_documents=300, seed=5):
    """An indexed dataset (ByteTokenizer ids) of documents of 1-12 tokens, each ending with EOD:
    shorter than a CP4 zigzag chunk, single-token ones, and ones spanning several ranks of a
    32-token sample."""
    import numpy as np

    from cp_ext.data.indexed import IndexedDatasetWriter
    from cp_ext.data.tokenizers import build_tokenizer

    eod = build_tokenizer("ByteTokenizer", None).eod
    rng = np.random.default_rng(seed)
    writer = IndexedDatasetWriter(str(prefix), np.uint16)
    for _ in range(num_documents):
        writer.add(np.append(rng.integers(32, 127, rng.integers(0, 12)), eod))
    writer.finalize()
    writer.commit()
    return str(prefix)


def quick_session(config) -> bool:
    """True under ``pytest -m quick``: launch fixtures then run only the cases quick tests read."""
    return (config.option.markexpr or "").strip() == "quick"


@pytest.fixture(scope="session")
def quick(request):
    """`quick_session` as a fixture: a launch fixture passes ``cases=QUICK if quick else None``."""
    return quick_session(request.config)


@pytest.fixture(scope="session")
def short_documents(tmp_path_factory):
    """`write_short_documents` once per session (the grid, recompute and evaluation tests share it)."""
    return write_short_documents(tmp_path_factory.mktemp("short_docs") / "docs")


def _crafted_checkpoint(root, iteration):
    """A checkpoint directory as parse-time checks read it (tracker, meta.json, metadata.json)."""
    import json

    root.mkdir(parents=True, exist_ok=True)
    (root / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    it = root / f"iter_{iteration:07d}"
    it.mkdir(exist_ok=True)
    (it / "metadata.json").write_text("{}")
    (it / "meta.json").write_text(json.dumps({"iteration": iteration, "format": "torch_dist"}))
    return root


@pytest.fixture(scope="session")
def crafted_checkpoint():
    """``crafted_checkpoint(root, iteration)``: a checkpoint directory with only what parse-time checks read."""
    return _crafted_checkpoint
