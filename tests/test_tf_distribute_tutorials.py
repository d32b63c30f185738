"""TensorFlow's multi-worker tutorials with the strategy line swapped for a hostreduce
strategy (``tests/tfd_workers/``: same calls, same order, local data), on 2 workers under
``hostreduce run`` and by hand with ``TF_CONFIG``, on Keras 3 and under
``TF_USE_LEGACY_KERAS=1``: every worker exits 0, the loss falls, every worker ends with
the same weights. And ``fit`` in a strategy's scope equals one process training on the
global batch, with each gradient's reduction started while the backward pass runs.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from tests.mpi_workers.mpi_launch import mpi_skip_reason
from tests.script_jobs import Worker, base_env, run_by_hand, run_launcher, run_mpirun, run_ps_by_hand

pytestmark = [pytest.mark.tf, pytest.mark.slow]

WORKERS = Path(__file__).resolve().parent / "tfd_workers"
TIMEOUT = 240.0
_DIGEST = re.compile(r"RESULT rank (\d)/2: weights=([0-9a-f]+)")
_MPI_SKIP = mpi_skip_reason()
KERASES = [pytest.param("0", id="keras3"), pytest.param("1", id="tf_keras")]


def _env(legacy: str, **extra: str) -> dict[str, str]:
    return base_env(TF_USE_LEGACY_KERAS=legacy, **extra)


def _same_weights(output: str) -> None:
    digests = dict(_DIGEST.findall(output))
    assert sorted(digests) == ["0", "1"] and digests["0"] == digests["1"], output[-4000:]


def _values(output: str, tag: str) -> list:
    return [json.loads(line.split(tag, 1)[1]) for line in output.splitlines() if tag in line]


def _launched(worker: Worker) -> str:
    assert worker.returncode == 0, worker.output[-6000:]
    return worker.output


def _by_hand(workers: list[Worker]) -> str:
    for rank, worker in enumerate(workers):
        assert worker.returncode == 0, f"worker {rank}:\n{worker.output[-6000:]}"
    return "".join(w.output for w in workers)


@pytest.mark.parametrize("legacy", KERASES)
def test_keras_tutorial(tmp_path: Path, legacy: str) -> None:
    """``fit`` on the global batch in the scope, saving the model and a checkpoint the
    tutorial's way (non-chief workers to temporary paths), restoring, ``fit`` again, then
    ``BackupAndRestore`` (the chief alone writes the backup)."""
    output = _launched(run_launcher(WORKERS / "keras_main.py", ["2", "12", str(tmp_path)], env=_env(legacy),
                                    timeout=TIMEOUT))
    _same_weights(output)
    losses = _values(output, "LOSSES")
    assert len(losses) == 2 and all(run[-1] < run[0] for run in losses), losses
    saved = tmp_path / ("keras-model" if legacy == "1" else "keras-model.keras")
    assert saved.exists() and (tmp_path / "ckpt" / "checkpoint").exists()
    assert not (tmp_path / "backup").exists() or not any((tmp_path / "backup").iterdir())  # removed at the end


@pytest.mark.parametrize("legacy", KERASES)
def test_keras_tutorial_by_hand(tmp_path: Path, legacy: str) -> None:
    output = _by_hand(run_by_hand(WORKERS / "keras_main.py", ["1", "12", str(tmp_path)], env=_env(legacy),
                                  timeout=TIMEOUT))
    _same_weights(output)
    assert len(_values(output, "LOSSES")) == 2


@pytest.mark.parametrize("legacy", KERASES)
def test_custom_loop_tutorial(tmp_path: Path, legacy: str) -> None:
    """``distribute_datasets_from_function``, ``strategy.run``, ``strategy.reduce`` and the
    tutorial's checkpoints: the chief's in ``ckpt``, the other worker's written to a
    temporary directory and removed."""
    output = _launched(run_launcher(WORKERS / "ctl_main.py", ["2", "8", str(tmp_path)], env=_env(legacy),
                                    timeout=TIMEOUT))
    _same_weights(output)
    losses = _values(output, "LOSSES")
    assert len(losses) == 2 and losses[0] == losses[1] and losses[0][-1] < losses[0][0], losses  # a global sum
    import tensorflow as tf

    latest = tf.train.latest_checkpoint(str(tmp_path / "ckpt"))
    assert latest is not None and int(tf.train.load_checkpoint(latest).get_tensor("epoch/.ATTRIBUTES/VARIABLE_VALUE")) == 1
    assert not list(tmp_path.glob("workertemp_*/ckpt"))


@pytest.mark.parametrize("legacy", KERASES)
def test_custom_loop_tutorial_by_hand(tmp_path: Path, legacy: str) -> None:
    output = _by_hand(run_by_hand(WORKERS / "ctl_main.py", ["2", "6", str(tmp_path)], env=_env(legacy),
                                  timeout=TIMEOUT))
    _same_weights(output)
    assert all(run[-1] < run[0] for run in _values(output, "LOSSES"))


@pytest.mark.parametrize("legacy", KERASES)
def test_estimator_tutorial(tmp_path: Path, legacy: str) -> None:
    """TF1 graph mode, ``GradientDescentOptimizer.minimize(loss, get_or_create_global_step())``
    inside ``model_fn``: the gradients are averaged over the workers and applied on the
    host; the data ends after one pass on each worker (12 batches of 64 of 750 rows)."""
    output = _launched(run_launcher(WORKERS / "estimator_main.py", [str(tmp_path / "model"), "40", "0.1"],
                                    env=_env(legacy), timeout=TIMEOUT))
    _same_weights(output)
    evals = _values(output, "EVAL")
    assert len(evals) == 2 and evals[0] == evals[1], evals
    assert evals[0]["global_step"] == 12 and evals[0]["loss"] < 2.0, evals  # untrained: about ln 10 = 2.3


@pytest.mark.parametrize("legacy", KERASES)
def test_estimator_tutorial_by_hand(tmp_path: Path, legacy: str) -> None:
    output = _by_hand(run_by_hand(WORKERS / "estimator_main.py", [str(tmp_path / "model"), "40", "0.1"],
                                  env=_env(legacy), timeout=TIMEOUT))
    _same_weights(output)
    assert all(e["global_step"] == 12 and e["loss"] < 2.0 for e in _values(output, "EVAL"))


def _reference(optimizer: str, through: str) -> tuple[list[np.ndarray], float, np.ndarray]:
    """One process on the global batch: plain Keras (``through="keras"``), or the same
    model in ``hostreduce.SingleProcessStrategy().scope()`` (``"scope"``: the fused
    kernels' arithmetic, without any other process)."""
    import contextlib

    import hostreduce
    from tests.tfd_workers.fit_model import EPOCHS, build, data

    scope = hostreduce.SingleProcessStrategy().scope() if through == "scope" else contextlib.nullcontext()
    with scope:
        model = build(optimizer, seed=100)  # rank 0's seed: the scope starts every worker from rank 0's weights
    model.fit(data(), epochs=EPOCHS, verbose=0)
    return (model.get_weights(), float(model.evaluate(data(), verbose=0)),
            model.predict(data().map(lambda x, y: x), verbose=0))


def _check_fit(out: Path, optimizer: str, through: str) -> None:
    reference, loss, predicted = _reference(optimizer, through)
    for rank in range(2):  # evaluate and predict: the whole data on every worker
        outputs = np.load(out / f"outputs-rank{rank}.npz")
        assert outputs["predicted"].shape == predicted.shape
        np.testing.assert_allclose(outputs["predicted"], predicted, rtol=1e-4, atol=1e-5)
        assert float(outputs["loss"]) == pytest.approx(loss, rel=1e-4)
    ranks = [np.load(out / f"weights-rank{r}.npz") for r in range(2)]
    errors = []
    for i, expected in enumerate(reference):
        got = [rank[f"arr_{i}"] for rank in ranks]
        np.testing.assert_array_equal(got[0], got[1])
        # relative to the tensor's largest value (the sums run in another order than
        # one process's, and Adam's normalized step grows rounding in near-zero entries)
        errors.append(float(np.abs(got[0] - expected).max()) / float(np.abs(expected).max()))
    # Adam's normalized step grows the rounding of the other summation order, and that
    # rounding depends on the CPU's kernels: 1.3e-5 for both Adam rows on an AMD EPYC
    # without AVX-512 (TensorFlow's AVX2 kernels), under 1e-5 on the machines of earlier
    # runs; SGD stays under 1e-5.
    bound = 1e-5 if optimizer == "SGD" else 2e-5
    assert max(errors) <= bound, f"relative differences {[f'{e:.1e}' for e in errors]} (bound {bound:g})"


# (optimizer, its update, the one-process reference): SGD's fused kernel rounds as
# Keras's update does; the fused Adam differs from Keras's by rounding, which Adam's
# normalized step grows to a few 1e-5 over these steps, so it is held against one
# process with the same kernel, and Keras's own Adam (fused_apply=False) against Keras.
FITS = [("SGD", "fused", "keras"), ("Adam", "fused", "scope"), ("Adam", "keras", "keras")]


@pytest.mark.parametrize("optimizer,update,reference", FITS, ids=["SGD", "Adam-fused", "Adam-keras"])
def test_fit_in_scope_equals_one_process_on_the_global_batch_and_streams(tmp_path: Path, optimizer: str, update: str,
                                                                       reference: str) -> None:
    worker = run_launcher(WORKERS / "fit_worker.py", ["ring", optimizer, str(tmp_path), update],
                          env=base_env(HOSTREDUCE_TIMELINE=str(tmp_path)), timeout=TIMEOUT)
    _launched(worker)
    _check_fit(tmp_path, optimizer, reference)
    # Streaming: in every training step, the first reduction starts before the last
    # gradient (the first layer's) is handed off, i.e. while the backward pass runs.
    for rank in range(2):
        events = json.loads((tmp_path / f"timeline-rank{rank}.json").read_text())["traceEvents"]
        spans = [e for e in events if e.get("ph") == "X" and ".allreduce." in e["name"] and ".eager." not in e["name"]]
        handoffs = sorted((e for e in spans if e["cat"] == "handoff"), key=lambda e: e["ts"])
        reductions = sorted((e for e in spans if e["cat"] == "reduce"), key=lambda e: e["ts"])
        per_step = 2 * 7  # kernel and bias of 7 layers
        assert len(handoffs) >= 8 * per_step, len(handoffs)
        overlapped = 0
        for k in range(len(handoffs) // per_step):
            group = handoffs[k * per_step:(k + 1) * per_step]
            first_reduction = min((r["ts"] for r in reductions if r["ts"] >= group[0]["ts"]), default=None)
            overlapped += first_reduction is not None and first_reduction < group[-1]["ts"]
        assert overlapped >= len(handoffs) // per_step - 1, f"rank {rank}: {overlapped} steps overlapped"


def test_fit_evaluate_and_predict_in_scope_on_tf_keras(tmp_path: Path) -> None:
    """The same job on tf_keras (``TF_USE_LEGACY_KERAS=1``): equal weights on both ranks,
    and ``evaluate``/``predict`` over the whole data on each."""
    _launched(run_launcher(WORKERS / "fit_worker.py", ["ring", "Adam", str(tmp_path)], env=_env("1"), timeout=TIMEOUT))
    ranks = [np.load(tmp_path / f"weights-rank{r}.npz") for r in range(2)]
    assert len(ranks[0].files) == 14
    for name in ranks[0].files:
        np.testing.assert_array_equal(ranks[0][name], ranks[1][name])
    outputs = [np.load(tmp_path / f"outputs-rank{r}.npz") for r in range(2)]
    assert outputs[0]["predicted"].shape == (256, 1)
    np.testing.assert_array_equal(outputs[0]["predicted"], outputs[1]["predicted"])
    assert float(outputs[0]["loss"]) == float(outputs[1]["loss"])


@pytest.mark.mpi
@pytest.mark.skipif(_MPI_SKIP is not None, reason=_MPI_SKIP or "")
def test_fit_in_scope_under_mpirun(tmp_path: Path) -> None:
    """The same with ``hostreduce.HorovodStrategy()`` under ``mpirun`` (the MPI engine)."""
    _launched(run_mpirun(WORKERS / "fit_worker.py", ["mpi", "Adam", str(tmp_path)], timeout=TIMEOUT))
    _check_fit(tmp_path, "Adam", "scope")


@pytest.mark.parametrize("legacy", KERASES)
def test_parameter_server_tutorial_fit(tmp_path: Path, legacy: str) -> None:
    """The tutorial's ``fit`` on ``hostreduce.ParameterServerStrategy`` (2 ps, 2 workers):
    compiled in the scope, the optimizer's state lives on the ps; TensorBoard,
    ``ModelCheckpoint`` and ``BackupAndRestore`` as the tutorial writes them (the chief
    alone writes the files); every task exits 0 (the launcher's status: the ps tasks'
    too)."""
    output = _launched(run_launcher(WORKERS / "ps_main.py", ["3", "10", str(tmp_path)], env=_env(legacy),
                                    timeout=TIMEOUT, extra=["--ps", "2"]))
    _same_weights(output)
    losses = _values(output, "LOSSES")
    assert len(losses) == 2 and all(run[-1] < run[0] for run in losses), losses
    assert (tmp_path / ("ckpt" if legacy == "1" else "ckpt.keras")).exists()
    assert any((tmp_path / "log").rglob("*tfevents*"))
    assert not any(p.is_file() for p in (tmp_path / "backup").rglob("*"))  # removed once fit ended


@pytest.mark.parametrize("legacy", KERASES)
def test_parameter_server_tutorial_fit_by_hand(tmp_path: Path, legacy: str) -> None:
    """The same, one process per task with its own ``TF_CONFIG`` (a chief, a worker, 2 ps)."""
    tasks = run_ps_by_hand(WORKERS / "ps_main.py", ["3", "10", str(tmp_path)], env=_env(legacy), timeout=TIMEOUT)
    for name, task in tasks.items():
        assert task.returncode == 0, f"{name}:\n{task.output[-4000:]}"
    output = "".join(tasks[name].output for name in ("chief", "worker1"))
    _same_weights(output)
    assert all(run[-1] < run[0] for run in _values(output, "LOSSES"))


def _check_ps_ctl(output: str) -> None:
    _same_weights(output)
    accuracies, losses = _values(output, "ACCURACIES"), _values(output, "FINAL_LOSS")
    assert len(accuracies) == len(losses) == 2, output[-4000:]
    # the label is whether "avenger" is among 3 of 7 names: 0.57 for a constant guess
    assert all(run[-1] > 0.9 for run in accuracies) and all(loss < 0.3 for loss in losses), (accuracies, losses)


@pytest.mark.parametrize("legacy", KERASES)
def test_parameter_server_tutorial_custom_loop(tmp_path: Path, legacy: str) -> None:
    """The tutorial's custom loop on ``hostreduce.ParameterServerStrategy`` (2 ps, 2
    workers): ``tf.distribute.coordinator.ClusterCoordinator(strategy)``,
    ``create_per_worker_dataset``, ``schedule``/``join``/``fetch``, ``strategy.run`` and
    ``reduce``, RMSprop made in the scope applying on the ps; every task exits 0, the
    model learns the tutorial's rule and the workers end with the same weights."""
    _check_ps_ctl(_launched(run_launcher(WORKERS / "ps_ctl_main.py", [], env=_env(legacy), timeout=TIMEOUT,
                                         extra=["--ps", "2"])))


@pytest.mark.parametrize("legacy", KERASES)
def test_parameter_server_tutorial_custom_loop_by_hand(tmp_path: Path, legacy: str) -> None:
    """The same, one process per task with its own ``TF_CONFIG``."""
    tasks = run_ps_by_hand(WORKERS / "ps_ctl_main.py", [], env=_env(legacy), timeout=TIMEOUT)
    for name, task in tasks.items():
        assert task.returncode == 0, f"{name}:\n{task.output[-4000:]}"
    _check_ps_ctl("".join(tasks[name].output for name in ("chief", "worker1")))


def test_a_worker_that_raises_in_fit_ends_every_worker_by_hand(tmp_path: Path) -> None:
    """No ``close()`` in the script: worker 1 raises in ``fit``; both workers exit non-zero
    and worker 0 names worker 1's error (started by hand, so no launcher stops anyone)."""
    workers = run_by_hand(WORKERS / "fit_fails.py", env=_env("0"), timeout=TIMEOUT)
    assert all(w.returncode not in (0, None) for w in workers), [w.returncode for w in workers]
    assert "worker 1 failed on purpose" in workers[1].output
    assert "rank 1" in workers[0].output and "worker 1 failed on purpose" in workers[0].output, workers[0].output[-3000:]
    assert "finished" not in workers[0].output + workers[1].output
