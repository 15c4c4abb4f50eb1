"""Users' imports keep working after the package was re-filed (cp_ext/moved_modules.py): every old
module path imports, warns once with the new path, and is the very module object of the new path;
the renamed classes answer to their old names; what `cp_ext.attention`, `cp_ext.data` and the CLI
exported is still there."""

import importlib
import subprocess
import sys
import warnings

import pytest

from cp_ext.moved_modules import MOVED, RENAMED

pytestmark = pytest.mark.quick


@pytest.mark.parametrize("old,new", sorted(MOVED.items()))
def test_old_module_path_is_the_new_module_with_a_warning(old, new):
    sys.modules.pop(old, None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(old)
    assert module is importlib.import_module(new)
    assert module.__name__ == new and module.__spec__.name == new  # the real module keeps its own identity
    assert [str(w.message) for w in caught if w.category is DeprecationWarning and old in str(w.message)] == [
        f"{old} moved to {new}; import it from there (the old path will be removed)"]


def test_from_parent_import_old_name_works():
    sys.modules.pop("cp_ext.attention.dispatch", None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from cp_ext.attention import dispatch
    from cp_ext.attention.cp import context_parallel
    assert dispatch is context_parallel


@pytest.mark.parametrize("module,old", sorted(RENAMED))
def test_renamed_class_answers_to_its_old_name(module, old):
    new_module = importlib.import_module(module)
    with pytest.warns(DeprecationWarning, match=f"{old} is now"):
        assert getattr(new_module, old) is getattr(new_module, RENAMED[(module, old)])
    with pytest.raises(AttributeError):
        getattr(new_module, "NoSuchName")


def test_old_paths_import_in_a_fresh_interpreter():
    """The finder is installed by importing cp_ext itself, before any new module was imported."""
    code = ("import warnings; warnings.simplefilter('ignore')\n"
            "from cp_ext.layout import context_parallel_positions\n"
            "from cp_ext.attention.masks import Band, plan_tile\n"
            "from cp_ext.attention.ring import RingSchedule\n"
            "from cp_ext.training.loss_curves import Band as OldBand\n"
            "from cp_ext.compare.curves import ToleranceBand\n"
            "assert OldBand is ToleranceBand\n"
            "from cp_ext.cli.plan import main\n"
            "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_package_faces_still_export_what_they_did():
    import cp_ext.attention as attention
    import cp_ext.attention.kernels as kernels
    import cp_ext.data as data

    for name in ["AttnKernel", "CPAttnFunc", "RingComm", "RingSchedule", "add_sink", "all_gather_attention",
                 "all_to_all", "context_parallel_attention", "cp_attention_backward", "cp_attention_forward",
                 "get_kernel", "hybrid_attention", "local_attention", "ring_attention", "ring_attn_backward",
                 "ring_attn_forward", "ulysses_attention", "update_out_and_lse"]:
        assert hasattr(attention, name), name
    assert sorted(attention.__all__) == sorted(set(attention.__all__))
    assert not [name for name in kernels.__all__ if name.startswith("_")]  # a face exports no private names
    for name in kernels.__all__:
        assert hasattr(kernels, name), name
    for name in data.__all__ if hasattr(data, "__all__") else []:
        assert hasattr(data, name), name
