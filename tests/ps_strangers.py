"""Processes without a ps job's secret, for the hostile-network tests: calls held open
with their request never sent, each on a connection of its own (on every method, the
handshake's included), connections sending random bytes or an HTTP/2 preface and junk,
and calls to unknown methods."""
from __future__ import annotations

import os
import secrets
import socket
import threading
from typing import Any

import grpc

from hostreduce.ps import wire

HELD_PER_PS = 200         # calls whose request never arrives, each on a connection of its own
GARBAGE_PER_PS = 1000     # connections sending random bytes or an HTTP/2 preface and junk


class Strangers:
    """Calls without credentials held open on every ps, and garbage sent to it."""

    def __init__(self, addresses: list[str]) -> None:
        self.release = threading.Event()
        self.channels: list[Any] = []
        self.calls: list[tuple[str, Any]] = []
        self.addresses = addresses

    def _never(self):
        self.release.wait(120)  # the request never arrives while the job runs
        return
        yield

    def hold(self, per_ps: int) -> None:
        methods = ["Push", "PullRows", "Shutdown", "Hello", "Login", "Register"]
        for addr in self.addresses:
            for i in range(per_ps):
                # A connection per call (no subchannel shared between channels).
                channel = grpc.insecure_channel(addr, options=[("grpc.use_local_subchannel_pool", 1)])
                self.channels.append(channel)
                method = f"/{wire.SERVICE}/{methods[i % len(methods)]}"
                metadata = (("hr-session", secrets.token_hex(16)),) if i % 2 else ()
                call = channel.stream_unary(method).future(self._never(), timeout=120, metadata=metadata)
                self.calls.append((method, call))

    def garbage(self, per_ps: int) -> None:
        preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
        for addr in self.addresses:
            host, port = addr.rsplit(":", 1)
            for i in range(per_ps):
                with socket.create_connection((host, int(port)), timeout=10) as s:
                    s.sendall((preface if i % 2 else b"") + os.urandom(512))
        for addr in self.addresses:
            with grpc.insecure_channel(addr) as channel:
                for method in ("/hostreduce.ParameterServer/Nope", "/grpc.health.v1.Health/Check", "/x"):
                    for _ in range(per_ps // 30):
                        try:
                            channel.unary_unary(method)(b"junk", timeout=10)
                        except grpc.RpcError as e:
                            assert e.code() == grpc.StatusCode.UNIMPLEMENTED, e
                        else:
                            raise AssertionError(f"{method} was answered")

    def refused(self) -> None:
        """Wait until the ps has answered every held call, whose request is still held
        back: a ps answers from the method and metadata alone, without the body."""
        for _method, call in self.calls:
            assert call.exception(60) is not None  # a hang guard: an unanswered call fails here

    def close(self) -> dict[str, int]:
        """Let the held requests go; how each held call ended, by status."""
        self.release.set()
        ended: dict[str, int] = {}
        for method, call in self.calls:
            code = call.exception(60).code()  # a hang guard
            ended[f"{method.rsplit('/', 1)[1]} {code.name}"] = ended.get(f"{method.rsplit('/', 1)[1]} {code.name}",
                                                                           0) + 1
        for channel in self.channels:
            channel.close()
        return ended
