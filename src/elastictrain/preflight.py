"""Checks made before a run folder or an actor exists, so a bad input fails at once and clearly."""

from __future__ import annotations

import socket


class PreflightError(Exception):
    """A problem found before starting; the message names the input and what would be valid."""


def check_ray_address(target: str | None, timeout_s: float = 5.0) -> None:
    """Fail now when nothing listens at a Ray address (ray.init would retry for minutes)."""
    if not target or target in ("auto", "local"):
        return
    where = target.removeprefix("ray://")
    host, sep, port = where.rpartition(":")
    if "://" in where or not sep or not host or not port.isdigit():
        raise PreflightError(
            f"Ray address {target!r}: expected host:port of a Ray head (e.g. 10.0.0.5:6379), "
            "ray://host:10001 for Ray Client, or auto"
        )
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as e:
        reason = e.strerror or type(e).__name__
        raise PreflightError(
            f"Ray address {target}: no Ray cluster answers there ({reason}). Start one with "
            f"`ray start --head --port={port}`, give the host:port of a running head (--address, ray.address "
            "or RAY_ADDRESS), or set none of them to start a local cluster"
        ) from None
