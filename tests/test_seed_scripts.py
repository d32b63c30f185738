"""Scripts in the shape of the IPU Estimator examples (TF1 optimizer and
``compute_gradients``, ``tf.compat.v1.metrics``, ``EvalSpec`` without ``steps``, device
settings in ``RunConfig``, no ``close()``), run as users run them: workers started by
hand with ``TF_CONFIG``, under ``hostreduce run``, and under ``mpirun``; on Keras 3 and
on legacy Keras (``TF_USE_LEGACY_KERAS=1``). Each job must train, print its result and
end by itself on every worker; a worker that fails must end every worker non-zero (how
soon: the ``perf`` tests)."""
from __future__ import annotations

import random
import re
from pathlib import Path

import pytest

from tests.script_jobs import base_env, run_by_hand, run_launcher, run_mpirun

pytestmark = [pytest.mark.tf, pytest.mark.slow]

SEEDS = Path(__file__).resolve().parent / "seed_workers"
TF_CONFIG_SCRIPT = SEEDS / "estimator_tf_config.py"
HOROVOD_SCRIPT = SEEDS / "estimator_horovod.py"
STEPS = "200"
EXIT_WITHIN_S = 10.0  # the perf tests: from a worker's result line to its exit
TIMEOUT_S = 8  # HOSTREDUCE_TIMEOUT_S of the failure tests
_RESULT = re.compile(r"RESULT rank (\d+): accuracy=([0-9.]+) keras_accuracy=([0-9.]+) loss=([0-9.]+) step=(\d+)")


def _results(output: str) -> dict[int, tuple[float, float]]:
    return {int(m[1]): (float(m[2]), float(m[3])) for m in _RESULT.finditer(output)}


def _check_trained(results: dict[int, tuple[float, float]], output: str) -> None:
    assert sorted(results) == [0, 1], output
    for accuracy, keras_accuracy in results.values():
        # The TF1 metric pair equals Keras's metric over the same batches of both workers.
        assert accuracy == pytest.approx(keras_accuracy, abs=1e-6), output
        assert accuracy >= 0.9, output
    assert results[0] == results[1], output  # every worker reports the combined result


def _printed_then_exited(worker) -> float:
    """Seconds from the worker's result line to its exit."""
    printed = worker.first("RESULT rank")
    assert printed is not None, worker.output
    return worker.ended_at - printed


def _by_hand(optimizer: str) -> list:
    workers = run_by_hand(TF_CONFIG_SCRIPT, ["--num-steps", STEPS], env=base_env(SEED_OPTIMIZER=optimizer))
    output = "\n".join(w.output for w in workers)
    assert [w.returncode for w in workers] == [0, 0], output
    _check_trained({**_results(workers[0].output), **_results(workers[1].output)}, output)
    assert "Saving dict for global step 200" in workers[0].output, workers[0].output
    for worker in workers:
        assert worker.first("RESULT rank") is not None, output
    return workers


@pytest.mark.parametrize("optimizer", ["tf1", "keras"])
def test_tf_config_script_by_hand(optimizer: str) -> None:
    _by_hand(optimizer)


@pytest.mark.perf
@pytest.mark.parametrize("optimizer", ["tf1", "keras"])
def test_tf_config_script_by_hand_exits_promptly(optimizer: str) -> None:
    for worker in _by_hand(optimizer):
        assert _printed_then_exited(worker) < EXIT_WITHIN_S, worker.output


def _legacy_keras_under_launcher():
    worker = run_launcher(TF_CONFIG_SCRIPT, ["--num-steps", STEPS], env=base_env(TF_USE_LEGACY_KERAS="1"))
    assert worker.returncode == 0, worker.output
    _check_trained(_results(worker.output), worker.output)
    assert worker.first("RESULT rank") is not None, worker.output
    return worker


def test_tf_config_script_legacy_keras_under_launcher() -> None:
    _legacy_keras_under_launcher()


@pytest.mark.perf
def test_tf_config_script_legacy_keras_under_launcher_exits_promptly() -> None:
    worker = _legacy_keras_under_launcher()
    assert _printed_then_exited(worker) < EXIT_WITHIN_S, worker.output


def _horovod_under_mpirun(optimizer: str):
    worker = run_mpirun(HOROVOD_SCRIPT, ["--num-steps", STEPS], env=base_env(SEED_OPTIMIZER=optimizer))
    assert worker.returncode == 0, worker.output
    assert sorted(re.findall(r"RESULT rank (\d)/2: step=200", worker.output)) == ["0", "1"], worker.output
    assert "Loss for final step" in worker.output, worker.output
    return worker


@pytest.mark.mpi
@pytest.mark.parametrize("optimizer", ["tf1", "keras"])
def test_horovod_script_under_mpirun(optimizer: str) -> None:
    _horovod_under_mpirun(optimizer)


@pytest.mark.mpi
@pytest.mark.perf
@pytest.mark.parametrize("optimizer", ["tf1", "keras"])
def test_horovod_script_under_mpirun_exits_promptly(optimizer: str) -> None:
    worker = _horovod_under_mpirun(optimizer)
    assert _printed_then_exited(worker) < EXIT_WITHIN_S, worker.output


def _failing_env() -> dict[str, str]:
    # Rank 1's data raises after a random number of examples: a random step of the first epoch.
    return base_env(SEED_FAIL_RANK="1", SEED_FAIL_AFTER=str(random.randint(150, 1500)),
                    HOSTREDUCE_TIMEOUT_S=str(TIMEOUT_S))


def _failing_by_hand() -> tuple[list, str]:
    env = _failing_env()
    workers = run_by_hand(TF_CONFIG_SCRIPT, ["--num-steps", "100000"], env=env, timeout=120)
    output = f"SEED_FAIL_AFTER={env['SEED_FAIL_AFTER']}\n" + "\n".join(w.output for w in workers)
    assert workers[1].returncode not in (0, None) and "corrupt example" in workers[1].output, output
    assert workers[0].returncode not in (0, None), output
    assert "PeerLostError" in workers[0].output and "rank 1" in workers[0].output, output
    return workers, output


def test_failing_worker_ends_every_worker_by_hand() -> None:
    _failing_by_hand()


@pytest.mark.perf
def test_failing_worker_ends_every_worker_by_hand_within_timeout_s() -> None:
    workers, output = _failing_by_hand()
    failed_at = workers[1].first("corrupt example")
    assert failed_at is not None and workers[0].ended_at - failed_at < TIMEOUT_S + 5, output


def _failing_under_mpirun():
    env = _failing_env()
    worker = run_mpirun(HOROVOD_SCRIPT, ["--num-steps", "100000"], env=env, timeout=120)
    output = f"SEED_FAIL_AFTER={env['SEED_FAIL_AFTER']}\n{worker.output}"
    assert worker.returncode != 0 and "corrupt example" in worker.output, output
    return worker, output


@pytest.mark.mpi
def test_failing_worker_ends_every_worker_under_mpirun() -> None:
    _failing_under_mpirun()


@pytest.mark.mpi
@pytest.mark.perf
def test_failing_worker_ends_every_worker_under_mpirun_within_timeout_s() -> None:
    worker, output = _failing_under_mpirun()
    failed_at = worker.first("corrupt example")
    assert failed_at is not None and worker.ended_at - failed_at < TIMEOUT_S + 5, output
