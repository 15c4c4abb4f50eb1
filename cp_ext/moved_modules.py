"""Where modules moved: the old import paths keep working, with a DeprecationWarning naming the new one.

`MOVED` is the whole table (old module -> new module). `install()` (called once by ``cp_ext/__init__.py``)
puts a finder at the front of ``sys.meta_path`` that answers only for the old names: importing one imports
the new module and binds the old name to that same module object, so classes, functions and module state
are shared (a monkeypatch through either name reaches the same module). Nothing else is imported early.
"""

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings

MOVED = {
    "cp_ext.attention.dispatch": "cp_ext.attention.cp.context_parallel",
    "cp_ext.attention.ring": "cp_ext.attention.cp.ring",
    "cp_ext.attention.ulysses": "cp_ext.attention.cp.ulysses",
    "cp_ext.attention.all_gather": "cp_ext.attention.cp.all_gather",
    "cp_ext.attention.kv_message": "cp_ext.attention.cp.kv_message",
    "cp_ext.attention.utils": "cp_ext.attention.cp.primitives",
    "cp_ext.attention.documents": "cp_ext.attention.masks.documents",
    "cp_ext.attention.dsa_indexer": "cp_ext.attention.dsa.indexer",
    "cp_ext.attention.sparse": "cp_ext.attention.dsa.sparse_attention",
    "cp_ext.attention.dsa_loss": "cp_ext.attention.dsa.indexer_loss",
    "cp_ext.attention.key_blocks": "cp_ext.attention.dsa.key_block_ring",
    "cp_ext.attention.bench": "cp_ext.bench.attention",
    "cp_ext.attention.bench_dsa": "cp_ext.bench.dsa",
    "cp_ext.attention.balance": "cp_ext.bench.attention_balance",
    "cp_ext.perf.workers": "cp_ext.bench.workers",
    "cp_ext.perf.dynamic_cp": "cp_ext.bench.dynamic_cp",
    "cp_ext.perf.plan": "cp_ext.perf.parallelism_planner",
    "cp_ext.training.memory_measure": "cp_ext.bench.memory_measure",
    "cp_ext.training.loss_curves": "cp_ext.compare.curves",
    "cp_ext.training.loss_report": "cp_ext.compare.report",
    "cp_ext.training.setup": "cp_ext.training.model_from_flags",
    "cp_ext.layout": "cp_ext.token_partition",
    "cp_ext.models.layout": "cp_ext.models.parameter_slices",
    "cp_ext.checkpoint.layout": "cp_ext.checkpoint.disk_format",
    "cp_ext.cli.plan": "cp_ext.cli.plan_parallelism",
}
"""Old module -> new module. ``cp_ext.attention.masks`` needs no entry: it is now a package that
re-exports what the module exported."""

RENAMED = {
    ("cp_ext.compare.curves", "Band"): "ToleranceBand",
    ("cp_ext.attention.dsa.key_block_ring", "KeyPlan"): "KeyRingSchedule",
}
"""(module, old name) -> new name: classes renamed in place, still importable under the old spelling
through the module's ``__getattr__``, which calls `renamed`."""


def renamed(module: str, name: str):
    """The object ``name`` used to name in ``module`` (a DeprecationWarning), or AttributeError."""
    new = RENAMED.get((module, name))
    if new is None:
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    warnings.warn(f"{module}.{name} is now {module}.{new}", DeprecationWarning, stacklevel=3)
    return getattr(sys.modules[module], new)


class _Alias(importlib.abc.Loader):
    def __init__(self, new: str):
        self.new = new

    def create_module(self, spec):
        module = importlib.import_module(self.new)
        self.own = module.__spec__, module.__loader__
        return module

    def exec_module(self, module):
        # The import system stamped the old spec onto the shared module between create_module and here;
        # give the module its own back, so importlib.reload, pickling and tracebacks keep the real file.
        module.__spec__, module.__loader__ = self.own


class MovedModuleFinder(importlib.abc.MetaPathFinder):
    """Answers for the old names in `MOVED` only; every other import goes on to the next finder."""

    def find_spec(self, fullname, path=None, target=None):
        new = MOVED.get(fullname)
        if new is None:
            return None
        warnings.warn(f"{fullname} moved to {new}; import it from there (the old path will be removed)",
                      DeprecationWarning, stacklevel=2)
        return importlib.machinery.ModuleSpec(fullname, _Alias(new))


def install() -> None:
    if not any(isinstance(f, MovedModuleFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, MovedModuleFinder())
