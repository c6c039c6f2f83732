"""The TCP connections of an attempt's gloo process groups in this process, and how to release them.

A rank that leaves a broken attempt must close its gloo connections at once: a peer blocked in a
collective waiting for data from it only fails when they close (or after the collective timeout,
minutes). Destroying the process group does not close them while anything still holds the group (a
ZeRO-3 parameter, a traceback's frame), and gloo's `abort()` does not close them either (both
measured: the peers waited for the timeout). Half-closing the sockets (shutdown for writing) does: the
peers read end-of-file and their collective raises "Connection closed by peer", while this process's
own gloo threads see nothing they cannot handle (a full shutdown makes gloo's listener thread abort the
process). The sockets are found as those this process opened while the attempt's groups were made,
minus the ones a server that existed before accepted (Ray's own connections).
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator

_LISTEN = "0A"  # the state /proc/net/tcp gives a listening socket


def _socket_inodes() -> dict[int, int]:
    """This process's socket file descriptors -> their inodes."""
    out: dict[int, int] = {}
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:  # no /proc (not Linux): nothing is recorded, and leaving falls back to the timeout
        return out
    for name in names:
        with contextlib.suppress(OSError, ValueError):
            link = os.readlink(f"/proc/self/fd/{name}")
            if link.startswith("socket:["):
                out[int(name)] = int(link[8:-1])
    return out


def _read_ints(path: str) -> list[int]:
    try:
        with open(path) as f:
            return [int(v) for v in f.read().split()]
    except (OSError, ValueError):
        return []


def _tcp_table() -> dict[int, tuple[int, str]]:
    """Every TCP socket of this network namespace: inode -> (local port, state)."""
    table: dict[int, tuple[int, str]] = {}
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(path) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if len(fields) > 9:
                    table[int(fields[9])] = (int(fields[1].rsplit(":", 1)[1], 16), fields[3])
    return table


class CollectiveSockets:
    """Record the connections made while process groups are created; half-close them on leaving."""

    def __init__(self) -> None:
        self._sockets: dict[int, int] = {}  # fd -> inode
        self._before: set[int] = set()
        self._servers: set[int] = set()  # local ports this process listened on before

    def start(self) -> None:
        """Before the attempt's process groups are made."""
        self._before = set(_socket_inodes().values())
        table = _tcp_table()
        listening = {ino for ino, (_, state) in table.items() if state == _LISTEN}
        self._servers = {table[ino][0] for ino in self._before & listening}

    def stop(self) -> None:
        """Once they are made (DeepSpeed makes its own groups while building the engine)."""
        table = _tcp_table()
        self._sockets = {
            fd: ino
            for fd, ino in _socket_inodes().items()
            if ino not in self._before and ino in table and table[ino][0] not in self._servers
        }

    def _connections(self) -> Iterator[socket.socket]:
        """Each recorded connection still open under its number (not a listener): a socket object on
        gloo's descriptor, detached again after (the descriptor stays gloo's to close)."""
        for fd, ino in self._sockets.items():
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/self/fd/{fd}") != f"socket:[{ino}]":
                    continue  # closed since, and the number reused: not ours any more
                s = socket.socket(fileno=fd)
                try:
                    listening = s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
                    if s.type == socket.SOCK_STREAM and not listening:
                        yield s
                finally:
                    s.detach()

    def widen_send_buffers(self) -> int:
        """Give each recorded connection the largest send buffer the kernel allows a process
        (`net.core.wmem_max`, which the kernel doubles), where that beats what TCP's own tuning may
        reach (`net.ipv4.tcp_wmem`'s maximum; a fixed size turns that tuning off). Returns the smallest
        send buffer the connections now have, or 0 where they were left to the tuning.

        A send the kernel takes whole cannot be left half-written by a peer's death
        (compat/torch_dist/gloo_gather.py).
        """
        wmem_max, tuned = _read_ints("/proc/sys/net/core/wmem_max"), _read_ints("/proc/sys/net/ipv4/tcp_wmem")
        if not wmem_max or len(tuned) != 3 or 2 * wmem_max[0] < tuned[2]:
            return 0
        sizes = []
        for s in self._connections():
            with contextlib.suppress(OSError):
                s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, wmem_max[0])
                sizes.append(s.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF))
        return min(sizes, default=0)

    def half_close(self) -> int:
        """Shut every recorded connection for writing (not listeners, not reused descriptors); how many."""
        closed = 0
        for s in self._connections():
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_WR)
                closed += 1
        self._sockets = {}
        return closed
