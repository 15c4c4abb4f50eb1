"""What a rank says when a collective fails because of another rank: it timed out, or a peer is gone.

gloo and NCCL raise ``RuntimeError`` (``DistBackendError``) with the transport's text. Two kinds reach a
surviving rank when another rank or its node fails:
- the peer stopped answering (a stopped process, a partitioned or frozen node): the collective waits
  ``--distributed-timeout-minutes`` and reports a timeout;
- the peer's process died (its node crashed, a kill, an out-of-memory kill): its sockets close, and the
  next read or write on them fails at once, "Connection reset by peer" / "closed by peer" / "Broken pipe",
  naming the peer's address as ``[ADDRESS]:PORT``.
Both end the run on every rank that meets them, with one line each, and no traceback: the rank exits 1 at
once (a teardown would wait on the same missing peer), and the job resumes from the last checkpoint.
"""

import re
import socket

_LOST = ("connection reset by peer", "connection closed by peer", "broken pipe", "connection refused",
         "socket closed", "end of file")
_ADDRESS = re.compile(r"\[([0-9a-fA-F.:]+)\]:(\d+)")


def lost_peer(error):
    """``(address, host name or None)`` of the peer whose connection ``error`` reports lost; ``("?", None)``
    when the message names none; None when ``error`` is not a lost connection."""
    text = str(error)
    if not isinstance(error, RuntimeError) or not any(kind in text.lower() for kind in _LOST):
        return None
    found = _ADDRESS.search(text)
    if found is None:
        return "?", None
    address = found.group(1)
    try:
        host = socket.gethostbyaddr(address)[0]
    except (OSError, UnicodeError):
        host = None
    return address, host


def is_collective_timeout(error):
    """gloo's and NCCL's timeout errors (DistBackendError / RuntimeError, by their message)."""
    text = str(error).lower()
    return isinstance(error, RuntimeError) and ("timed out" in text or "timeout" in text)


def failure_message(error, rank, timeout_minutes):
    """The line a rank prints when ``error`` is another rank's failure; None for any other error."""
    first = str(error).splitlines()[0][:200] if str(error) else type(error).__name__
    peer = lost_peer(error)
    if peer is not None:
        address, host = peer
        where = f"{address} ({host})" if host and host != address else address
        return (f"rank {rank}: lost the connection to the rank at {where}: its process or node died (a crash, a "
                f"kill, out of memory, a node failure). Exiting; resume from the last checkpoint with --load. "
                f"({first})")
    if is_collective_timeout(error):
        return (f"rank {rank}: a collective waited longer than --distributed-timeout-minutes {timeout_minutes}: "
                f"another rank stopped, crashed or hangs (its node, its network, a debugger, a SIGSTOP). Exiting; "
                f"resume from the last checkpoint with --load. ({first})")
    return None
