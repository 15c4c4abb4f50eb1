"""Version tuples of torch and the optional packages."""

from typing import Tuple


def version(v) -> Tuple[int, int]:
    """(major, minor) of a version string such as ``2.13.0+cu128`` or ``2.9.0a0``."""
    if isinstance(v, tuple):
        return v[:2]
    major, minor = (str(v).split("+")[0].split(".") + ["0"])[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)
