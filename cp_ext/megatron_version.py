"""Which megatron-core releases cp_ext supports, and the one check made at ``import cp_ext``.

This module is on the floor: it reads the installed version from the package metadata and imports
nothing of megatron-core, so ``import cp_ext`` (and the attention package, which works without
megatron) stays cheap. What differs between the supported releases lives in `cp_ext.megatron_compat`.

    supported      megatron-core >= 0.16.1, < 0.20   (pyproject.toml says the same to pip)
    tested in CI   0.16.1 on Python 3.11, the newest 0.19.x on Python 3.12 (.ci/run)

0.17 and later need Python >= 3.12, so on Python 3.10/3.11 pip resolves the requirement to 0.16.1
and on 3.12 to the newest 0.19.x; an NGC container's preinstalled megatron-core inside the range
is kept as it is.
"""

import os
from importlib import metadata

from packaging.version import InvalidVersion, Version

OLDEST = Version("0.16.1")
"""The oldest release cp_ext runs on."""
NEWEST_TESTED = Version("0.19")
"""The newest minor release tested: any 0.19.x is accepted, 0.20 is not until it has been tried."""
REQUIREMENT = "megatron-core>=0.16.1,<0.20"
ALLOW_ENV = "CP_EXT_ALLOW_MEGATRON_CORE"
"""Set to an installed version outside the range to try it anyway, at the user's own risk."""


def installed():
    """The installed megatron-core's version string, or None if it is not installed."""
    try:
        return metadata.version("megatron-core")
    except metadata.PackageNotFoundError:
        return None


def _release(version_text):
    return Version(Version(version_text).base_version)  # 0.19.0rc1 and 0.19.2.dev3 count as 0.19.x


def in_range(version_text):
    """Whether ``version_text`` is a release cp_ext supports."""
    release = _release(version_text)
    return OLDEST <= release and release.release[:2] <= NEWEST_TESTED.release[:2]


def megatron_core_problem(version_text, cp_ext_version):
    """Why the installed megatron-core (a version string, or None if absent) cannot be used, or None."""
    if version_text is None:
        return None  # absent: the attention package works alone; megatron's own import error says the rest
    if os.environ.get(ALLOW_ENV) == version_text:
        return None
    try:
        if in_range(version_text):
            return None
    except InvalidVersion:
        pass
    below = _below_oldest(version_text)
    fix = (f"pip install '{REQUIREMENT}'" + (" (megatron-core 0.17 and later need Python >= 3.12; on Python 3.10/3.11 "
                                             "that installs 0.16.1)" if below else ""))
    return (f"cp_ext {cp_ext_version} supports megatron-core {OLDEST} through {NEWEST_TESTED}.x, but {version_text} is "
            f"installed: {fix}. To try {version_text} anyway, at your own risk: {ALLOW_ENV}={version_text}")


def _below_oldest(version_text):
    try:
        return _release(version_text) < OLDEST
    except InvalidVersion:
        return False


def at_least(version_text, minimum):
    """Whether megatron-core ``version_text`` is release ``minimum`` or later (pre-releases count as theirs)."""
    return _release(version_text) >= Version(minimum)


def versions_line(cp_ext_version):
    """What runs: ``cp_ext 0.1.0 on megatron-core 0.19.2, torch 2.13.0, Python 3.12.1`` (``--version`` and
    the first line a run prints)."""
    import platform

    try:
        torch_version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch_version = "absent"
    return (f"cp_ext {cp_ext_version} on megatron-core {installed() or 'absent'}, torch {torch_version}, "
            f"Python {platform.python_version()}")
