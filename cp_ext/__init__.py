"""cp_ext: exact context parallelism for long-sequence MoE training on megatron-core."""

import os

__version__ = "0.1.0"

MEGATRON_CORE_VERSION = "0.16.1"
"""The megatron-core cp_ext is written against (pyproject.toml pins it): `cp_ext.platform` and
the checkpoint code mend specific lines of this version, and another one may move them."""


def megatron_core_problem(installed):
    """Why the installed megatron-core (a version string, or None if absent) cannot be used, or None."""
    if installed is None or installed == MEGATRON_CORE_VERSION:
        return None  # absent: the attention package works alone; megatron's own import error says the rest
    if os.environ.get("CP_EXT_ALLOW_MEGATRON_CORE") == installed:
        return None
    return (f"cp_ext {__version__} needs megatron-core=={MEGATRON_CORE_VERSION}, but {installed} is installed: "
            f"pip install megatron-core=={MEGATRON_CORE_VERSION} (or pip install -e . in the cp_ext checkout). "
            f"To try {installed} anyway, at your own risk: CP_EXT_ALLOW_MEGATRON_CORE={installed}")


def _installed_megatron_core():
    from importlib import metadata

    try:
        return metadata.version("megatron-core")
    except metadata.PackageNotFoundError:
        return None


_problem = megatron_core_problem(_installed_megatron_core())
if _problem:
    raise ImportError(_problem)
