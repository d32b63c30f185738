"""Tests of the local launcher: ``python -m hostreduce run -np N COMMAND``."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from hostreduce.launch import run_workers

ROOT = Path(__file__).resolve().parents[1]

WORKER = textwrap.dedent(
    """
    import json, os, signal, subprocess, sys, time

    cfg = json.loads(os.environ["TF_CONFIG"])
    rank = cfg["task"]["index"]
    world = len(cfg["cluster"]["worker"])
    mode, out = sys.argv[1], sys.argv[2]

    def mark(name, pid):
        path = os.path.join(out, f"{name}.{rank}")
        with open(path + ".tmp", "w") as f:
            f.write(str(pid))
        os.replace(path + ".tmp", path)

    def wait_for_all():
        while len([n for n in os.listdir(out) if n.startswith("pid.") and not n.endswith(".tmp")]) < world:
            time.sleep(0.02)

    mark("pid", os.getpid())
    if mode == "info":
        info = {"rank": rank, "tf_config": cfg, "secret": os.environ.get("HOSTREDUCE_SECRET")}
        sys.stdout.write(json.dumps(info) + "\\n")  # one write, so it cannot interleave
        print(f"err from {rank}", file=sys.stderr)
        sys.stdout.write(f"partial {rank}")
        sys.exit(0)
    if mode == "fail":
        if rank == 1:
            wait_for_all()
            sys.exit(3)
    if mode == "stubborn":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if rank == 1:
            wait_for_all()
            sys.exit(5)
    if mode in ("tree", "tree-exit"):
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        mark("child", child.pid)
        if mode == "tree-exit":
            sys.exit(0)
    time.sleep(60)
    """
)
# The workers' processes run for 60 s unless stopped; a job's run is given 40 s: a run
# that ends in time, with every process gone, is one whose launcher stopped them.


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # A zombie still answers kill(0) but is not running.
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _pids(out: Path, name: str) -> list[int]:
    return [int(p.read_text()) for p in sorted(out.glob(f"{name}.*")) if not p.name.endswith(".tmp")]


def _wait_for_files(out: Path, name: str, count: int, timeout: float = 20.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pids = _pids(out, name)
        if len(pids) >= count:
            return pids
        time.sleep(0.02)
    raise AssertionError(f"only {len(_pids(out, name))} of {count} {name} files appeared")


def _assert_all_dead(pids: list[int], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while any(_pid_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not [p for p in pids if _pid_alive(p)], "processes outlived the launcher"


@pytest.fixture
def job(tmp_path: Path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    out = tmp_path / "out"
    out.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOSTREDUCE_") and k != "TF_CONFIG"}
    env["PYTHONPATH"] = str(ROOT)

    def cli(*options: str) -> list[str]:
        return [sys.executable, "-m", "hostreduce", "run", *options]

    def worker(mode: str) -> list[str]:
        return [sys.executable, str(script), mode, str(out)]

    def run(args: list[str], extra_env: dict | None = None, timeout: float = 40) -> subprocess.CompletedProcess:
        return subprocess.run(args, env={**env, **(extra_env or {})}, cwd=str(tmp_path),
                              capture_output=True, timeout=timeout)

    def start(args: list[str]) -> subprocess.Popen:
        # As from an interactive shell: a suite started in the background inherits an
        # ignored SIGINT, which the launcher deliberately keeps ignored (nohup).
        return subprocess.Popen(args, env=env, cwd=str(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))

    class Job:
        pass

    j = Job()
    j.cli, j.worker, j.run, j.start, j.out = cli, worker, run, start, out  # type: ignore[attr-defined]
    return j


@pytest.mark.timeout(60)
def test_prefixed_output_tf_config_and_secret(job) -> None:
    res = job.run(job.cli("-np", "3", "--", *job.worker("info")))
    assert res.returncode == 0, res.stderr
    stdout, stderr = res.stdout.decode(), res.stderr.decode()
    infos = {}
    for line in stdout.splitlines():
        rank_tag, _, text = line.partition(" ")
        assert rank_tag in ("[0]", "[1]", "[2]"), line
        if text.startswith("{"):
            info = json.loads(text)
            assert rank_tag == f"[{info['rank']}]"
            infos[info["rank"]] = info
    assert sorted(infos) == [0, 1, 2]
    for r in range(3):
        assert f"[{r}] partial {r}" in stdout.splitlines()
        assert f"[{r}] err from {r}" in stderr.splitlines()
    workers = infos[0]["tf_config"]["cluster"]["worker"]
    assert len(set(workers)) == 3 and all(a.startswith("127.0.0.1:") for a in workers)
    for r, info in infos.items():
        assert info["tf_config"] == {"cluster": {"worker": workers}, "task": {"type": "worker", "index": r}}
    secrets_seen = {info["secret"] for info in infos.values()}
    assert len(secrets_seen) == 1 and len(secrets_seen.pop()) == 64


@pytest.mark.timeout(60)
def test_user_secret_is_kept_and_no_prefix(job) -> None:
    res = job.run(job.cli("-np", "2", "--no-prefix", *job.worker("info")), {"HOSTREDUCE_SECRET": "s3cret"})
    assert res.returncode == 0, res.stderr
    # Without prefixes the raw streams are passed through, so a partial line may run into
    # the next worker's output.
    infos = [json.loads(line[line.index("{"):]) for line in res.stdout.decode().splitlines() if "{" in line]
    assert sorted(i["rank"] for i in infos) == [0, 1]
    assert {i["secret"] for i in infos} == {"s3cret"}


@pytest.mark.timeout(60)
def test_failing_worker_code_propagates_and_others_die(job) -> None:
    res = job.run(job.cli("-np", "3", *job.worker("fail")))
    assert res.returncode == 3, res.stderr
    assert b"worker 1 exited with code 3" in res.stderr
    pids = _pids(job.out, "pid")
    assert len(pids) == 3
    _assert_all_dead(pids)


@pytest.mark.timeout(60)
def test_worker_ignoring_sigterm_is_killed(job) -> None:
    res = job.run(job.cli("-np", "2", "--grace-period", "1", *job.worker("stubborn")))
    assert res.returncode == 5, res.stderr
    _assert_all_dead(_pids(job.out, "pid"))


@pytest.mark.timeout(60)
def test_worker_killed_by_signal(job) -> None:
    code = "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"
    res = job.run(job.cli("-np", "2", sys.executable, "-c", code))
    assert res.returncode == 128 + signal.SIGKILL
    assert b"SIGKILL" in res.stderr


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_to_launcher_stops_whole_tree(job, sig: int, code: int) -> None:
    launcher = job.start(job.cli("-np", "2", *job.worker("tree")))
    try:
        pids = _wait_for_files(job.out, "pid", 2) + _wait_for_files(job.out, "child", 2)
        assert all(_pid_alive(p) for p in pids)
        launcher.send_signal(sig)
        _, err = launcher.communicate(timeout=20)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    assert launcher.returncode == code, err
    _assert_all_dead(pids)


@pytest.mark.timeout(60)
def test_grandchildren_of_successful_workers_are_stopped(job) -> None:
    res = job.run(job.cli("-np", "2", *job.worker("tree-exit")))
    assert res.returncode == 0, res.stderr
    _assert_all_dead(_pids(job.out, "child"))


@pytest.mark.timeout(60)
def test_timeout_stops_everyone(job) -> None:
    res = job.run(job.cli("-np", "2", "--timeout", "2", *job.worker("tree")))
    assert res.returncode == 124
    assert b"timed out after 2 s" in res.stderr
    _assert_all_dead(_pids(job.out, "pid") + _pids(job.out, "child"))


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "options, needle",
    [
        (["-np", "0", "true"], b"-np '0'"),
        (["-np", "two", "true"], b"-np 'two'"),
        (["-np", "1"], b"COMMAND is required"),
        (["true"], b"-np/--num-workers"),
        (["-np", "1", "--timeout", "0", "true"], b"--timeout '0'"),
    ],
)
def test_bad_arguments(job, options: list[str], needle: bytes) -> None:
    res = job.run(job.cli(*options))
    assert res.returncode == 2
    assert needle in res.stderr, res.stderr


@pytest.mark.timeout(60)
def test_missing_program(job) -> None:
    res = job.run(job.cli("-np", "2", "hostreduce-no-such-program"))
    assert res.returncode == 127
    assert b"hostreduce-no-such-program" in res.stderr


@pytest.mark.timeout(60)
def test_python_api(capfd) -> None:
    code = "import json, os; print('rank', json.loads(os.environ['TF_CONFIG'])['task']['index'])"
    assert run_workers([sys.executable, "-c", code], 2, env={"HOSTREDUCE_SECRET": None}) == 0
    out = capfd.readouterr().out.splitlines()
    assert sorted(out) == ["[0] rank 0", "[1] rank 1"]
    assert run_workers([sys.executable, "-c", "import sys; sys.exit(7)"], 1, prefix=False) == 7
    with pytest.raises(ValueError, match="num_workers=0"):
        run_workers(["true"], 0)
    with pytest.raises(ValueError, match="command="):
        run_workers("true", 1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="timeout=-1"):
        run_workers(["true"], 1, timeout=-1)


HOROVOD_INFO = (
    "import json, os, sys; from hostreduce.cluster import resolve_cluster; "
    "from hostreduce.cluster.mpi_env import spec_from_mpi_env; s = resolve_cluster(roles=True); "
    "sys.stdout.write(json.dumps({'env': {k: v for k, v in os.environ.items() if k.startswith('HOROVOD_')}, "
    "'spec': [s.rank, s.size, s.local_rank, s.local_size, s.source], "
    "'mpirun': spec_from_mpi_env(os.environ) is not None}) + chr(10))"
)


@pytest.mark.timeout(60)
def test_workers_get_the_variables_horovodrun_sets(capfd) -> None:
    # Inherited ones are replaced (or, in a ps job, dropped) so they cannot contradict TF_CONFIG.
    inherited = {"PYTHONPATH": str(ROOT), "HOROVOD_RANK": "7", "HOROVOD_SIZE": "9", "HOROVOD_CROSS_SIZE": "4"}
    assert run_workers([sys.executable, "-c", HOROVOD_INFO], 2, env=inherited) == 0
    infos = {}
    for line in capfd.readouterr().out.splitlines():
        tag, _, text = line.partition(" ")
        infos[tag] = json.loads(text)
    assert sorted(infos) == ["[0]", "[1]"]
    for r in range(2):
        info = infos[f"[{r}]"]
        assert info["env"] == {"HOROVOD_RANK": str(r), "HOROVOD_SIZE": "2", "HOROVOD_LOCAL_RANK": str(r),
                               "HOROVOD_LOCAL_SIZE": "2", "HOROVOD_CROSS_RANK": "0", "HOROVOD_CROSS_SIZE": "1"}
        # A TF_CONFIG worker (the ring), not taken for an mpirun rank.
        assert info["spec"] == [r, 2, r, 2, "TF_CONFIG"] and info["mpirun"] is False
    assert run_workers([sys.executable, "-c", HOROVOD_INFO], 1, env=inherited, num_ps=1) == 0
    for line in capfd.readouterr().out.splitlines():
        assert json.loads(line.partition(" ")[2])["env"] == {}, line


NOTICES = [  # as TensorFlow 2.21 prints them on a machine without a GPU
    "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR",
    "I0000 00:00:1795431387.602419   13492 cudart_stub.cc:31] Could not find cuda drivers on your machine, "
    "GPU will not be used.",
    "E0000 00:00:1795431392.234203   13492 cuda_platform.cc:52] failed call to cuInit: INTERNAL: CUDA error: "
    "Failed call to cuInit: UNKNOWN ERROR (303)",
    "I0000 00:00:1795431387.602419   13492 port.cc:153] oneDNN custom operations are on. You may see slightly "
    "different numerical results due to floating-point round-off errors from different computation orders.",
]
REAL_ERROR = "E0000 00:00:1795431392.234203   13492 op_kernel.cc:1857] OP_REQUIRES failed: a real error"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("verbose", [False, True])
def test_tensorflow_start_up_notices_are_dropped_unless_verbose(job, tmp_path: Path, verbose: bool) -> None:
    script = tmp_path / "noisy.py"
    script.write_text("import sys\n" + "".join(f"sys.stderr.write({line + chr(10)!r})\n"
                                                for line in NOTICES + [REAL_ERROR]))
    res = job.run(job.cli("-np", "2", *(["--verbose"] if verbose else []), sys.executable, str(script)))
    assert res.returncode == 0, res.stderr
    lines = res.stderr.decode().splitlines()
    for rank in (0, 1):
        assert f"[{rank}] {REAL_ERROR}" in lines
        for notice in NOTICES:
            assert (f"[{rank}] {notice}" in lines) == verbose, (notice, lines)


@pytest.mark.timeout(60)
def test_failure_message_names_the_workers_exception(job, tmp_path: Path) -> None:
    script = tmp_path / "bad_config.py"
    script.write_text("import hostreduce\nhostreduce.Config.from_env(no_such_setting=1)\n")
    res = job.run(job.cli("-np", "2", sys.executable, str(script)))
    assert res.returncode == 1
    last = res.stderr.decode().strip().splitlines()[-1]
    assert last.startswith("hostreduce run: worker "), last
    assert "ConfigError" in last and "no_such_setting" in last, last


def test_version(job) -> None:
    from hostreduce import __version__

    res = job.run([sys.executable, "-m", "hostreduce", "--version"])
    assert res.returncode == 0 and res.stdout.decode().strip() == f"hostreduce {__version__}"
