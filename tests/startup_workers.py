"""Rank bodies for the start-up fault tests (top-level so that spawned ranks can import
them): a stranger that floods a rank with bad handshakes, and a port that is taken."""
from __future__ import annotations

import collections
import json
import secrets
import socket
import time

import numpy as np

from hostreduce.cluster import resolve_cluster
from hostreduce.config import Config
from hostreduce.reducers import create_reducer

SERVICE = "/hostreduce.Peer"


def bad_handshakes(address: str, claims: list[int], count: int) -> dict[str, int]:
    """``count`` handshakes that must all be refused, in a mix: a valid rank with a
    wrong proof, non-JSON, ``1e999``, nested JSON (small and deep), a huge payload and
    a stream whose metadata is malformed. Returns how many ended with each gRPC status."""
    import grpc

    channel = grpc.insecure_channel(address)
    grpc.channel_ready_future(channel).result(timeout=30)
    hello = channel.unary_unary(f"{SERVICE}/Hello")
    stream = channel.stream_unary(f"{SERVICE}/Stream")
    nonce = secrets.token_hex(16)
    payloads = {
        "not-json": b"{not json",
        "1e999": json.dumps({"rank": 1e999, "nonce": nonce}).encode().replace(b"Infinity", b"1e999"),
        "nested": b'{"rank": ' + b"[" * 400 + b"]" * 400 + b"}",
        "deep": b"[" * 50_000 + b"]" * 50_000,
        "huge": b'{"rank": 0, "nonce": "' + b"a" * (1 << 20) + b'"}',
        "float-rank": json.dumps({"rank": 0.0, "nonce": nonce}).encode(),
    }
    kinds = ["wrong-proof", *payloads, "bad-metadata"]
    seen: collections.Counter = collections.Counter()
    for i in range(count):
        kind = kinds[i % len(kinds)]
        claim = claims[i % len(claims)]
        try:
            if kind == "wrong-proof":
                reply = json.loads(hello(json.dumps({"rank": claim, "nonce": secrets.token_hex(16)}).encode(),
                                         timeout=10))
                stream(iter([b"\x02" + bytes(8) + b"{}"]), timeout=10, metadata=(
                    ("hr-rank", str(claim)), ("hr-nonce", reply["nonce"]), ("hr-proof", "0" * 64)))
            elif kind == "bad-metadata":
                stream(iter([]), timeout=10, metadata=(("hr-rank", "1e999"), ("hr-nonce", "{"), ("hr-proof", "[")))
            else:
                hello(payloads[kind], timeout=10)
            seen[f"{kind}:OK"] += 1
        except grpc.RpcError as e:
            seen[f"{kind}:{e.code().name}"] += 1
    channel.close()
    return dict(seen)


def train_through_a_flood(rank: int, size: int, count: int) -> dict:
    """Rank 0 floods rank 1 with bad handshakes, several claiming to be rank 0, while
    rank 1 waits for it at start-up; then joins. Every rank all-reduces a few steps."""
    cfg = Config.from_env(transport="grpc", connect_timeout_s=60.0)
    cluster = resolve_cluster()
    statuses: dict[str, int] = {}
    if rank == 0:
        statuses = bad_handshakes(cluster.addresses[1], [0, *range(2, size)], count)
    with create_reducer("ring", cluster=cluster, config=cfg) as r:
        sums = [float(r.allreduce(f"g{step}", np.full(1000, rank + step, np.float32))[0]) for step in range(5)]
    return {"statuses": statuses, "sums": sums}


def port_taken(rank: int, size: int, victim: int) -> str:
    """The victim's port is held by another socket before it starts. Returns
    '<error type> after <s>s: <message>' on every rank."""
    cluster = resolve_cluster()
    squatter = None
    if rank == victim:
        host, port = cluster.addresses[rank].rsplit(":", 1)
        squatter = socket.socket()
        squatter.bind((host, int(port)))
        squatter.listen(16)
    else:  # peers come up at different moments (simulated; no order is needed)
        time.sleep(0.3 * rank)
    start = time.monotonic()
    try:
        cfg = Config.from_env(transport="grpc", connect_timeout_s=30.0)
        with create_reducer("ring", cluster=cluster, config=cfg) as r:
            r.allreduce("x", np.ones(4, np.float32))
        return "no error"
    except Exception as e:
        return f"{type(e).__name__} after {time.monotonic() - start:.1f}s: {e}"
    finally:
        if squatter is not None:
            squatter.close()
