"""Release a rank blocked inside a Gloo collective, and rebuild the process group.

SIGINT cannot interrupt a rank waiting in Gloo (the KeyboardInterrupt lands only when
the collective returns), and ``pg.abort()``/``destroy_process_group()`` from another
thread do not unblock it. Shutting down the rank's own Gloo pair sockets does: the
blocked call raises ``RuntimeError: ... Connection closed by peer`` at once, on this rank
and on the peers it was waiting with. The rendezvous store's connection and
ipyparallel's sockets are left alone (sockets that existed before the process group
was created, or that talk to MASTER_PORT). Then every rank calls :func:`reinit`.
"""

from __future__ import annotations

import os
import socket
import time

from .state import STATE


def _socket_inodes() -> dict[int, int]:
    """inode -> fd for this process's sockets."""
    out = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if target.startswith("socket:["):
            out[int(target[8:-1])] = int(name)
    return out


def _tcp_table() -> dict[int, tuple[int, int, str]]:
    """inode -> (local port, remote port, state) for TCP sockets (v4 and v6)."""
    table = {}
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(path) as f:
                next(f)
                for line in f:
                    parts = line.split()
                    local, remote, state, inode = parts[1], parts[2], parts[3], int(parts[9])
                    table[inode] = (
                        int(local.rsplit(":", 1)[1], 16),
                        int(remote.rsplit(":", 1)[1], 16),
                        state,
                    )
        except OSError:
            continue
    return table


def remember_preexisting_sockets() -> None:
    """Called before the process group exists: these sockets are never ours to close."""
    STATE.extras["preexisting_sockets"] = set(_socket_inodes())


def gloo_socket_fds() -> list[int]:
    keep = STATE.extras.get("preexisting_sockets", set())
    master_port = int(os.environ.get("MASTER_PORT", "0"))
    tcp = _tcp_table()
    fds = []
    for inode, fd in _socket_inodes().items():
        if inode in keep or inode not in tcp:
            continue
        local_port, remote_port, state = tcp[inode]
        if state != "01":  # ESTABLISHED only; listening sockets are left alone
            continue
        if master_port in (local_port, remote_port):
            continue  # the rendezvous store
        fds.append(fd)
    return fds


def abort_collectives() -> int:
    """Shut down this rank's Gloo connections; returns how many were closed."""
    closed = 0
    for fd in gloo_socket_fds():
        try:
            s = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            s.shutdown(socket.SHUT_RDWR)
            closed += 1
        except OSError:
            pass
        finally:
            s.close()
    STATE.extras["aborted_at"] = time.time()
    return closed


def reinit(master_port: int) -> dict:
    """Destroy the (broken) default group and make a fresh one on ``master_port``."""

    from . import bootstrap

    t0 = time.perf_counter()
    bootstrap.destroy_default_group()
    os.environ["MASTER_PORT"] = str(master_port)
    remember_preexisting_sockets()
    bootstrap.init_default_group(
        STATE.backend, STATE.rank, STATE.world_size, STATE.timeout_s or 300, STATE.device
    )
    return {"rank": STATE.rank, "reinit_s": time.perf_counter() - t0}
