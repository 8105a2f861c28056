"""Lease owners: the name under which a process that runs jobs holds their leases, `host:pid:nonce`, and
whether the process behind a name is gone. The ledger stores owners as opaque names; naming processes and
probing them is the farm's business, and the farm hands its probe to `ledger.claim_job`.
"""

from __future__ import annotations

import os
import secrets
import socket

_host = socket.gethostname()


def process_owner() -> str:
    """A lease owner name unique to this process: host, pid, and a nonce against pid reuse."""
    return f"{_host}:{os.getpid()}:{secrets.token_hex(4)}"


def owner_prefix_of_pid(pid: int) -> str:
    """What every lease owner name of process `pid` on this host starts with."""
    return f"{_host}:{pid}:"


def owner_is_dead(owner: str) -> bool:
    """True when `owner` was a process on this host that no longer exists (a killed worker child): its job
    is claimed again at once rather than when its lease expires. Owners on other hosts are never judged
    dead: only their lease expiry frees their jobs."""
    host, _, rest = owner.partition(":")
    pid_text = rest.partition(":")[0]
    if host != _host or not pid_text.isdigit():
        return False
    try:
        os.kill(int(pid_text), 0)  # signal 0 is not sent: the call only says whether the pid exists
    except ProcessLookupError:
        return True
    except PermissionError:  # it exists, under another user
        return False
    return False
