"""Scripts in the shape of Horovod's TensorFlow examples (``tests/hvd_workers/``), ported
by the import line, local data and the renames of TensorFlow 2.16+ and Keras 3, on 2
workers under ``hostreduce run`` (the ring) and ``mpirun`` (the MPI engine; the TF1
scripts also on Horovod's core ops, where Horovod is built): every rank exits 0 and ends
with the same weights (a digest each rank prints).

* ``tensorflow_mnist.py``: a TF1 graph, ``hvd.DistributedOptimizer`` over a TF1
  optimizer, ``hvd.BroadcastGlobalVariablesHook``, ``MonitoredTrainingSession``;
* ``tensorflow_mnist_estimator.py``: ``tf.estimator`` as ``hostreduce.estimator``, with
  ``hvd.DistributedOptimizer(...).minimize`` inside ``model_fn``, ``numpy_input_fn`` and
  TF1 session hooks (``LoggingTensorHook``, ``hvd.BroadcastGlobalVariablesHook``);
* ``tensorflow_keras_mnist.py``: ``model.fit`` on numpy arrays with validation data;
* ``tensorflow2_keras_mnist.py``: ``model.fit`` on a dataset, Horovod's three callbacks;
* the two synthetic benchmarks, on a small Keras application (``MobileNetV3Small``) for
  a couple of steps.

(The TF2 GradientTape MNIST example is in ``test_horovod_api.py``.)
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
from tests.mpi_workers.mpi_launch import horovod_skip_reason, mpi_skip_reason  # noqa: E402
from tests.script_jobs import Worker, base_env, run_launcher, run_mpirun  # noqa: E402

pytestmark = [pytest.mark.tf, pytest.mark.slow]

WORKERS = HERE / "hvd_workers"
_MPI_SKIP = mpi_skip_reason()
needs_mpi = [pytest.mark.mpi, pytest.mark.skipif(_MPI_SKIP is not None, reason=_MPI_SKIP or "")]
TIMEOUT = 150.0
_DIGEST = re.compile(r"RESULT rank (\d)/2: weights=([0-9a-f]+)")
BENCHMARK = ["--no-cuda", "--model", "MobileNetV3Small", "--batch-size", "2", "--num-iters", "2",
             "--num-batches-per-iter", "1"]


def _run(launcher: str, script: str, args: list[str]) -> Worker:
    if launcher == "ring":
        return run_launcher(WORKERS / script, args, env=base_env(), timeout=TIMEOUT)
    if launcher == "horovod" and horovod_skip_reason() is not None:
        pytest.skip(horovod_skip_reason())
    return run_mpirun(WORKERS / script, args, env=base_env(), timeout=TIMEOUT, reducer=launcher)


def _check(worker: Worker) -> None:
    assert worker.returncode == 0, worker.output
    digests = dict(_DIGEST.findall(worker.output))
    assert sorted(digests) == ["0", "1"] and digests["0"] == digests["1"], worker.output


LAUNCHERS = ["ring", pytest.param("mpi", marks=needs_mpi)]
# Also under mpirun on Horovod's core ops (``HOSTREDUCE_REDUCER=horovod``), which pair
# collectives by their position in each rank's sequence; skipped, with the reason, where
# Horovod is not built (``_run``).
WITH_HOROVOD = [*LAUNCHERS, pytest.param("horovod", marks=needs_mpi)]


@pytest.mark.parametrize("launcher", WITH_HOROVOD)
def test_tf1_monitored_session_example(launcher: str, tmp_path: Path) -> None:
    worker = _run(launcher, "tensorflow_mnist.py", ["--steps", "12", "--checkpoint-dir", str(tmp_path / "ckpt")])
    _check(worker)
    assert "loss = " in worker.output and "step = 1" in worker.output, worker.output
    assert list((tmp_path / "ckpt").glob("model.ckpt-6.index")), worker.output


@pytest.mark.parametrize("launcher", WITH_HOROVOD)
def test_tf1_estimator_example(launcher: str, tmp_path: Path) -> None:
    worker = _run(launcher, "tensorflow_mnist_estimator.py",
                  ["--steps", "12", "--model-dir", str(tmp_path / "model"), "--log-every", "4"])
    _check(worker)
    assert "probabilities = [[" in worker.output, worker.output  # the logging hook, on both ranks
    assert re.search(r"\{'loss': [0-9.]+, 'accuracy': [0-9.]+, 'global_step': 6\}", worker.output), worker.output
    # Only rank 0 was given the model directory; it holds the last step's checkpoint.
    assert [p.name for p in (tmp_path / "model").glob("ckpt-*")] == ["ckpt-000000006"], worker.output


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_tf_keras_example(launcher: str, tmp_path: Path) -> None:
    worker = _run(launcher, "tensorflow_keras_mnist.py", ["2", str(tmp_path)])
    _check(worker)
    assert "Test accuracy:" in worker.output, worker.output
    assert (tmp_path / "checkpoint-1.keras").exists(), worker.output


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_tf2_keras_example(launcher: str, tmp_path: Path) -> None:
    worker = _run(launcher, "tensorflow2_keras_mnist.py", ["8", "3", str(tmp_path)])
    _check(worker)
    output = worker.output
    assert "finished gradual learning rate warmup" in output, output
    # Keras's progress bar on rank 0 only (verbose=0 elsewhere), with the averaged metrics.
    assert output.count("Epoch 1/3") == 1 and re.search(r"4/4.*accuracy: [0-9.]+ - loss: [0-9.]+", output), output
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*.keras")) == [
        "checkpoint-1.keras", "checkpoint-2.keras", "checkpoint-3.keras"], output


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_tf2_synthetic_benchmark(launcher: str) -> None:
    worker = _run(launcher, "tensorflow2_synthetic_benchmark.py", [*BENCHMARK, "--num-warmup-batches", "1"])
    _check(worker)
    assert "Total img/sec on 2 CPU(s)" in worker.output, worker.output


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_tf2_keras_synthetic_benchmark(launcher: str) -> None:
    worker = _run(launcher, "tensorflow2_keras_synthetic_benchmark.py", BENCHMARK)
    _check(worker)
    assert "Total img/sec on 2 CPU(s)" in worker.output, worker.output
