"""cp_ext: exact context parallelism for long-sequence MoE training on megatron-core."""

from cp_ext import megatron_version as _megatron_version
from cp_ext import moved_modules as _moved_modules

__version__ = "0.1.0"

MEGATRON_CORE_VERSION = _megatron_version.installed()
"""The installed megatron-core's version (None where it is absent): the startup line and meta.json name it."""

_problem = _megatron_version.megatron_core_problem(MEGATRON_CORE_VERSION, __version__)
if _problem:
    raise ImportError(_problem)

_moved_modules.install()  # the old import paths of moved modules (cp_ext/moved_modules.py)
