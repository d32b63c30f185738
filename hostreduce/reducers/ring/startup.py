"""Bringing a ring up: the gRPC mesh, the data path every rank agrees on, and on one
host the shared memory and named pipes.

Every rank connects to every other (``grpc_mesh.py``), then sends rank 0 a ``Join``
with its settings, host and process (and, unless told to use gRPC for data, the port of
its data listener, ``tcp_links.py``); rank 0 answers every rank with one ``Welcome``
(``negotiation.decide_data_path``): the data path (with every rank's data port), or an
error naming the setting on which the ranks disagree, so that every rank fails with the
same message. On the ``tcp`` path every rank then connects to every peer's listener. On one host
rank 0 first removes what killed jobs left in /dev/shm, records the job's owners
(``_stale.py``) and creates the shared control segment and the pipes, so that all exist
before any peer learns their names. Two shared-memory barriers follow (every rank reads
its own pipe before anyone writes to it; every rank has opened everything), after
which rank 0 removes the names: the open ends stay valid, and nothing is left behind.
"""
from __future__ import annotations

import functools
import logging
import os
import queue
import socket
import time
from dataclasses import dataclass
from typing import Any, Callable

from ...config import Config
from ...errors import ConfigError, PeerLostError
from .grpc_mesh import CTL, GrpcMesh, RingLink
from .liveness import Liveness
from .local_ctl import LocalControl
from .messages import Join, Welcome, encode
from .negotiation import decide_data_path
from .shm import ShmGroup
from .tcp_links import TcpLinks

__all__ = ["Paths", "Startup"]

log = logging.getLogger("hostreduce.ring")


@dataclass
class Paths:
    """What the start-up made, filled in as it is made (so that a start-up that fails
    closes what exists). ``transport`` is the data path: "local" (one rank), "grpc",
    "tcp" or "shm"."""

    transport: str = "local"
    mesh: GrpcMesh | None = None
    data: TcpLinks | None = None        # the data connections (``tcp``), once listening
    link: RingLink | None = None
    shm: ShmGroup | None = None
    local: LocalControl | None = None   # the control pipes, on one host
    token: str | None = None            # names the job's entries in /dev/shm (one host)
    owns_fifos: bool = False

    def send(self, dst: int, payload: bytes, atomic: bool = True) -> None:
        """A control message to ``dst``: through the pipes on one host, else over gRPC.
        ``atomic`` messages (to a pipe with several writers) must be short."""
        if self.local is not None:
            self.local.send(dst, payload, atomic=atomic)
        else:
            assert self.mesh is not None
            self.mesh.send(dst, CTL, 0, payload)


class Startup:
    """The start-up of one rank. Messages for it (``Join``, ``Welcome``) and the job's
    error, if it fails meanwhile, come through ``deliver``."""

    def __init__(self, rank: int, size: int, addresses: tuple[str, ...], config: Config, paths: Paths,
                 live: Liveness, *, on_message: Callable[[int, memoryview], None],
                 on_local: Callable[[bytes], None], on_peer_lost: Callable[[int, str], None],
                 on_departed: Callable[[int], None], failed: Callable[[], BaseException | None]) -> None:
        self._rank, self._size, self._addresses, self._config = rank, size, addresses, config
        self._paths, self._live = paths, live
        self._on_message, self._on_local = on_message, on_local
        self._on_peer_lost, self._on_departed, self._failed = on_peer_lost, on_departed, failed
        self._inbox: "queue.SimpleQueue[Join | Welcome | BaseException]" = queue.SimpleQueue()

    def deliver(self, msg: Join | Welcome | BaseException) -> None:
        self._inbox.put(msg)

    def _get(self) -> Any:
        try:
            msg = self._inbox.get(timeout=self._config.connect_timeout_s)
        except queue.Empty:
            raise PeerLostError(f"Rank {self._rank}: the ring did not finish its start-up handshake within "
                                f"connect_timeout_s={self._config.connect_timeout_s}") from None
        if isinstance(msg, BaseException):
            raise msg
        return msg

    def run(self) -> None:
        cfg, paths, rank = self._config, self._paths, self._rank
        mesh = paths.mesh = GrpcMesh(rank, self._addresses, cfg.secret or "", bind_host=cfg.bind_host,
                                     timeout_s=cfg.timeout_s, on_message=self._on_message,
                                     on_peer_lost=self._on_peer_lost, on_departed=self._on_departed)
        self._live.attach(mesh)
        mesh.start(cfg.connect_timeout_s)
        deadline = time.monotonic() + cfg.connect_timeout_s
        from ._stale import start_time

        port = 0
        if cfg.transport in ("auto", "tcp"):   # the data path between hosts (tcp_links.py)
            paths.data = mesh.data_links(functools.partial(TcpLinks, rank, self._addresses, cfg.secret or "",
                                                           bind_host=cfg.bind_host, timeout_s=cfg.timeout_s,
                                                           failed=self._failed))
            port = self._telling_peers(mesh, paths.data.listen)
        hello = Join(rank, cfg.transport, cfg.chunk_bytes, cfg.fast_lane, cfg.single_copy, socket.gethostname(),
                     os.getpid(), start_time(os.getpid()), port)
        if rank == 0:
            joins = [hello]
            while len(joins) < self._size:
                joins.append(self._get())
            welcome = decide_data_path(joins)
            if welcome.transport == "shm":
                from ._stale import sweep, write_owners

                sweep()  # entries that jobs killed earlier on this host left behind
                joins.sort(key=lambda j: j.rank)
                paths.token = welcome.token
                write_owners(welcome.token, [j.pid for j in joins], [j.start for j in joins])
                # Shared resources exist before any peer learns their names.
                self._open_local_paths(welcome.token, create=True)
            payload = encode(welcome)
            for peer in range(1, self._size):
                mesh.send(peer, CTL, 0, payload)
        else:
            mesh.send(0, CTL, 0, encode(hello))
            welcome = self._get()
        if welcome.error:
            raise ConfigError(welcome.error)
        paths.transport = welcome.transport
        if paths.data is not None:
            if paths.transport == "tcp":
                self._telling_peers(mesh, lambda: paths.data.connect(welcome.ports, deadline))
                mesh.use_data_links(paths.data)
            else:
                paths.data.close()
                paths.data = None
        if paths.transport == "shm":
            if rank != 0:
                paths.token = welcome.token
                self._open_local_paths(welcome.token, create=False)
            assert paths.shm is not None and paths.local is not None
            paths.shm.barrier()  # every rank reads its own pipe before anyone writes
            paths.local.connect()
            paths.shm.barrier()  # every rank has mapped and opened everything by name
            if rank == 0:
                paths.shm.control.release_name()
                paths.local.release_names()
        paths.link = RingLink(mesh, (rank + 1) % self._size, (rank - 1) % self._size, cfg.timeout_s)
        log.info("rank %d/%d: ring up, data path %s", rank, self._size, paths.transport)

    @staticmethod
    def _telling_peers(mesh: GrpcMesh, step: Callable[[], Any]) -> Any:
        """``step()``; if it fails, every peer learns why before this rank stops."""
        try:
            return step()
        except Exception as e:
            mesh.broadcast_failure(f"{type(e).__name__}: {e}")
            raise

    def _open_local_paths(self, token: str, create: bool) -> None:
        """Shared memory and named pipes of a one-host job (rank 0 creates them)."""
        from .local_ctl import create_fifos
        from .shm_sync import ControlBlock

        cfg, paths = self._config, self._paths
        if create:
            create_fifos(token, self._size)
            paths.owns_fifos = True
        block = ControlBlock(self._rank, self._size, token, cfg.timeout_s, self._failed,
                             not_answering=self._live.silent_peer_error)
        paths.shm = ShmGroup(block, token, use_cma=cfg.single_copy)
        paths.local = LocalControl(self._rank, self._size, token, self._on_local, cfg.timeout_s)
