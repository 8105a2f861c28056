"""Lease owner names and the probe the farm gives the ledger: a process of this host that is gone."""

from __future__ import annotations

import os
import socket
import subprocess

from dsocr_workers.farm.owners import owner_is_dead, owner_prefix_of_pid, process_owner


def test_owner_names_are_host_pid_nonce_and_unique_per_call():
    first, second = process_owner(), process_owner()
    assert first.startswith(owner_prefix_of_pid(os.getpid()))
    assert first.startswith(f"{socket.gethostname()}:{os.getpid()}:") and first != second


def test_only_a_gone_process_of_this_host_is_dead():
    finished = subprocess.Popen(["true"])
    finished.wait()
    assert owner_is_dead(owner_prefix_of_pid(finished.pid) + "ab12cd34")
    assert not owner_is_dead(process_owner())  # this process
    assert not owner_is_dead(owner_prefix_of_pid(1) + "x")  # init: alive, whoever owns it
    # Another host's processes are never judged from here, whatever their pid; nor is a name without one.
    assert not owner_is_dead(f"not-{socket.gethostname()}:{finished.pid}:ab12cd34")
    assert not owner_is_dead(f"{socket.gethostname()}:worker:ab12cd34")
