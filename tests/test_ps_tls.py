"""Parameter servers over TLS, with a self-signed certificate made for the test: a
worker that trusts it trains as in plain text; one connecting in plain text, or
trusting another certificate, never reaches the ps; the settings are checked."""
from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hostreduce.config import Config
from hostreduce.errors import AuthenticationError, ClusterError, ConfigError
from hostreduce.processes import free_ports
from hostreduce.ps import Adam
from hostreduce.ps.client import PSClient
from hostreduce.transport.grpc_options import read_pem
from tests.ps_helpers import LocalCluster, assert_same_bits, model_values, worker_grads

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(shutil.which("openssl") is None, reason="makes its certificate with openssl")]

PS_SCRIPT = Path(__file__).resolve().parent / "ps_scripts" / "serve_ps.py"


def _certificate(directory: Path, name: str) -> tuple[Path, Path]:
    cert, key = directory / f"{name}.pem", directory / f"{name}.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=ps",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    return cert, key


def _train(cluster: LocalCluster, tls_ca: bytes | None) -> list:
    c = PSClient(cluster.addresses, 0, 1, cluster.secret, timeout_s=10.0, connect_timeout_s=10.0, tls_ca=tls_ca)
    c.register(model_values(), Adam(0.01), shard_bytes=20_000)
    for step in (1, 2):
        c.push(*worker_grads(0, step), step=step)
    out = cluster.snapshots()
    c.close()
    return out


def test_a_ps_over_tls_serves_workers_that_trust_its_certificate_only(tmp_path):
    cert, key = _certificate(tmp_path, "ps")
    other, _ = _certificate(tmp_path, "other")
    plain = LocalCluster(2, 1)
    try:
        expected = _train(plain, None)
    finally:
        plain.stop_and_join()
    cluster = LocalCluster(2, 1, tls=(cert.read_bytes(), key.read_bytes()))
    try:
        for tls_ca in (None, other.read_bytes()):  # plain text, or another certificate: no handshake at all
            with pytest.raises((ClusterError, AuthenticationError), match="did not answer|handshake"):
                PSClient(cluster.addresses, 0, 1, cluster.secret, timeout_s=2.0, connect_timeout_s=2.0,
                         tls_ca=tls_ca)
        assert_same_bits(_train(cluster, cert.read_bytes()), expected)
    finally:
        cluster.stop_and_join()


def test_serve_from_env_serves_over_tls(tmp_path):
    cert, key = _certificate(tmp_path, "ps")
    ps_addr, worker_addr = [f"127.0.0.1:{p}" for p in free_ports(2)]
    secret = secrets.token_hex(8)
    env = dict(os.environ, TF_CONFIG=json.dumps({"cluster": {"chief": [worker_addr], "ps": [ps_addr]},
                                                 "task": {"type": "ps", "index": 0}}),
               HOSTREDUCE_SECRET=secret, HOSTREDUCE_PS_TLS_CERT=str(cert), HOSTREDUCE_PS_TLS_KEY=str(key),
               PYTHONPATH=str(Path(__file__).resolve().parent.parent))
    proc = subprocess.Popen([sys.executable, str(PS_SCRIPT)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        chief = PSClient([ps_addr], 0, 1, secret, timeout_s=10.0, connect_timeout_s=60.0,
                         tls_ca=read_pem(str(cert), "ps_tls_ca"))
        chief.register(model_values(), Adam(0.01), shard_bytes=20_000)
        chief.push(*worker_grads(0, 1), step=1)
        assert chief.info()["step"] == 1
        chief.shutdown()
        chief.close()
        out, _ = proc.communicate(timeout=60)  # a hang guard
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out


def test_tls_settings_are_checked(tmp_path):
    with pytest.raises(ConfigError, match="`ps_tls_cert` and `ps_tls_key` go together"):
        Config(ps_tls_cert="cert.pem")
    with pytest.raises(ConfigError, match="`ps_tls_ca` must name a readable PEM file"):
        read_pem(str(tmp_path / "missing.pem"), "ps_tls_ca")
    (tmp_path / "junk.pem").write_text("junk")
    with pytest.raises(ConfigError, match="must name a PEM file"):
        read_pem(str(tmp_path / "junk.pem"), "ps_tls_ca")
