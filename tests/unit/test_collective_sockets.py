"""The connections opened while process groups are made are found, and half-closed without the listener."""

from __future__ import annotations

import socket
import sys

import pytest

from elastictrain.compat.torch_dist.collective_sockets import CollectiveSockets

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def test_connections_made_while_recording_are_half_closed_and_the_peer_reads_end_of_file():
    before = socket.create_server(("127.0.0.1", 0))  # a server that existed before: not recorded
    old_client = socket.create_connection(before.getsockname())
    old_conn, _ = before.accept()
    sockets = CollectiveSockets()
    sockets.start()
    server = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(server.getsockname())
    conn, _ = server.accept()
    late = socket.create_connection(before.getsockname())  # outbound in the window: recorded too
    late_conn, _ = before.accept()  # accepted by a server that existed before (Ray's kind): not
    sockets.stop()
    try:
        assert sockets.half_close() == 3  # client, conn and late; not the new listener, not late_conn
        conn.settimeout(5)
        client.settimeout(5)
        assert conn.recv(1) == b"" and client.recv(1) == b""  # each end saw the other's half-close
        late_conn.sendall(b"x")
        late.settimeout(5)
        assert late.recv(1) == b"x"  # late_conn was left open for writing
        assert sockets.half_close() == 0  # once
    finally:
        for s in (before, old_client, old_conn, server, client, conn, late, late_conn):
            s.close()


def _sysctl(path: str) -> list[int]:
    with open(path) as f:
        return [int(v) for v in f.read().split()]


def test_recorded_connections_get_the_largest_send_buffer_where_it_beats_tcps_own_tuning():
    wmem_max = _sysctl("/proc/sys/net/core/wmem_max")[0]
    tuned_max = _sysctl("/proc/sys/net/ipv4/tcp_wmem")[2]
    before = socket.create_server(("127.0.0.1", 0))
    old_client = socket.create_connection(before.getsockname())
    sockets = CollectiveSockets()
    sockets.start()
    server = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(server.getsockname())
    conn, _ = server.accept()
    sockets.stop()
    try:
        untouched = old_client.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
        widened = sockets.widen_send_buffers()
        if 2 * wmem_max >= tuned_max:
            assert widened == 2 * wmem_max  # the kernel doubles what it is given
            for s in (client, conn):
                assert s.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) == widened
        else:  # a fixed buffer would be smaller than the tuning may reach: left to it
            assert widened == 0
        assert old_client.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) == untouched  # not recorded
    finally:
        for s in (before, old_client, server, client, conn):
            s.close()
