"""Checkpoints of Keras ``fit`` and GradientTape training on hostreduce, with the
optimizer's state on the host (``variables_on_host=True``) or not.

A first job trains half the steps on N ring workers and checkpoints on rank 0; a new
job, in new processes, resumes and trains the rest. Checked, on Keras 3 at 1 and 2
workers and on tf_keras (``TF_USE_LEGACY_KERAS=1``) at 2:

* ``hvd.load_model`` gives back the model and every optimizer variable (iteration
  count, Adam's moments) bit for bit, the optimizer wrapped again, and
  ``keras.models.load_model`` alone the plain optimizer class with the same state;
* every rank starts the resumed training from the saved state, whether each rank
  restored ``tf.train.Checkpoint`` itself or rank 0 alone loaded the ``.keras`` file
  written by ``ModelCheckpoint`` and ``BroadcastGlobalVariablesCallback`` handed it on;
* the resumed training ends with the weights of the same training run without a
  break, on every rank; so does a GradientTape loop resumed from its
  ``CheckpointManager``'s latest checkpoint;
* where one rank's model is built only by its first batch, every rank broadcasts after
  that batch (as Horovod does) instead of waiting at different points.

On a machine without an accelerator every variable is in host memory whatever the
placement, so there the device checks cannot tell ``variables_on_host`` apart; the
wrapper's own record of it is checked as well.

Each configuration runs its two jobs once (module-scoped), shared by the tests.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest

HERE = Path(__file__).resolve().parent
from tests.keras_workers import checkpoint_workers as workers  # noqa: E402
from tests.weights_check import check_training, rel_err  # noqa: E402

pytestmark = [pytest.mark.tf, pytest.mark.slow]

# (Keras, world size, the variables_on_host cases of the fit runs)
RUNS = (("keras3", 1, (False, True)), ("keras3", 2, (False, True)), ("tf_keras", 2, (True,)))
RUN_IDS = [f"{keras}-{size}" for keras, size, _ in RUNS]
ROUTES = ("keras_file", "tf_checkpoint")
STEPS = workers.STEPS_PER_EPOCH * workers.EPOCHS
TOLERANCE = 1e-6


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> Callable[[tuple], tuple[list, list]]:
    """The two jobs of a run (each rank's results), run on first use."""
    from hostreduce.testing import run_ranks

    done: dict[tuple, tuple[list, list]] = {}

    def get(run: tuple) -> tuple[list, list]:
        if run not in done:
            keras, size, cases = run
            out_dir = str(tmp_path_factory.mktemp(f"{keras}-{size}"))
            env = {"TF_USE_LEGACY_KERAS": "1" if keras == "tf_keras" else None}
            first = run_ranks(workers.first_job, size, args=(out_dir, cases), timeout=240, env=env)
            second = run_ranks(workers.second_job, size, args=(out_dir, cases), timeout=240, env=env)
            done[run] = first, second
        return done[run]

    return get


def _assert_same(actual: list[np.ndarray], expected: list[np.ndarray], what: str) -> None:
    assert len(actual) == len(expected), f"{what}: {len(actual)} arrays, expected {len(expected)}"
    for i, (a, e) in enumerate(zip(actual, expected)):
        assert np.array_equal(a, e), f"{what}: array {i} differs (rel. error {rel_err(a, e):.3g})"


def _assert_on_host(state: dict, what: str) -> None:
    assert state["on_host"], f"{what}: the optimizer does not keep its variables on the host"
    away = [d for d in state["devices"] if "CPU" not in d.upper()]
    assert not away, f"{what}: variables away from the host: {away}"


def _optimizer_variable_count(keras: str) -> int:
    # Adam's two moments per weight (two Dense layers: 4), the iteration count, and in
    # Keras 3 the learning rate.
    return 4 * 2 + (2 if keras == "keras3" else 1)


@pytest.mark.parametrize("run", RUNS, ids=RUN_IDS)
def test_first_job_leaves_complete_checkpoints_and_no_partial_parts(jobs: Any, run: tuple) -> None:
    _, second = jobs(run)
    expected = sorted(
        [f"variables_on_host={c}/epoch1.keras" for c in run[2]]
        + [f"variables_on_host={c}/tf/{name}" for c in run[2]
           for name in ("checkpoint", "ckpt-1.data-00000-of-00001", "ckpt-1.index")]
        + [f"tape/{name}" for name in ("checkpoint", "ckpt-1.data-00000-of-00001", "ckpt-1.index",
                                       "ckpt-2.data-00000-of-00001", "ckpt-2.index")])
    # No "<prefix>_temp" part left: TensorFlow writes the parts aside and renames them.
    assert second[0]["files"] == expected


@pytest.mark.parametrize("run", RUNS, ids=RUN_IDS)
def test_load_model_restores_the_model_and_every_optimizer_variable(jobs: Any, run: tuple) -> None:
    first, second = jobs(run)
    for on_host in run[2]:
        saved, loaded = first[0][on_host]["saved"], second[0][on_host]["keras_file"]["loaded"]
        what = f"{run[0]}, variables_on_host={on_host}, hvd.load_model"
        assert len(saved["optimizer"]) == _optimizer_variable_count(run[0]), saved["optimizer"]
        assert int(saved["optimizer"][0]) == workers.STEPS_PER_EPOCH  # the iteration count
        _assert_same(loaded["weights"], saved["weights"], f"{what}: weights")
        _assert_same(loaded["optimizer"], saved["optimizer"], f"{what}: optimizer variables")
        assert loaded["class"] == saved["class"] and loaded["wrapped"], (loaded["class"], loaded["wrapped"])
        assert loaded["on_host"] == on_host
        if on_host:
            _assert_on_host(loaded, what)


@pytest.mark.parametrize("run", RUNS, ids=RUN_IDS)
def test_keras_load_model_alone_gives_the_plain_optimizer_class_with_its_state(jobs: Any, run: tuple) -> None:
    first, second = jobs(run)
    for on_host in run[2]:
        saved, plain = first[0][on_host]["saved"], second[0][on_host]["plain_load"]
        what = f"{run[0]}, variables_on_host={on_host}, keras load_model"
        assert plain["class"] == saved["class"] and not plain["wrapped"], (plain["class"], plain["wrapped"])
        _assert_same(plain["weights"], saved["weights"], f"{what}: weights")
        _assert_same(plain["optimizer"], saved["optimizer"], f"{what}: optimizer variables")


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("run", RUNS, ids=RUN_IDS)
def test_every_rank_starts_the_resumed_training_from_the_saved_state(jobs: Any, run: tuple, route: str) -> None:
    first, second = jobs(run)
    for on_host in run[2]:
        saved = first[0][on_host]["saved"]
        for rank, result in enumerate(second):
            begin = result[on_host][route]["begin"]
            what = f"{run[0]}, variables_on_host={on_host}, {route}, rank {rank}"
            _assert_same(begin["weights"], saved["weights"], f"{what}: weights")
            _assert_same(begin["optimizer"], saved["optimizer"], f"{what}: optimizer variables")
            assert begin["wrapped"] and begin["on_host"] == on_host
            if on_host:
                _assert_on_host(begin, what)


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("run", RUNS, ids=RUN_IDS)
def test_resumed_fit_ends_where_the_straight_fit_does(jobs: Any, run: tuple, route: str) -> None:
    first, second = jobs(run)
    for on_host in run[2]:
        straight = first[0][on_host]["straight"]
        what = f"{run[0]} on {run[1]} workers, variables_on_host={on_host}, resumed from {route}"
        ends = [result[on_host][route]["end"] for result in second]
        check_training([end["weights"] for end in ends], straight["weights"], what, tolerance=TOLERANCE)
        check_training([end["optimizer"] for end in ends], straight["optimizer"], f"{what} (optimizer)",
                       tolerance=TOLERANCE)
        assert int(ends[0]["optimizer"][0]) == STEPS


@pytest.mark.parametrize("run", RUNS, ids=RUN_IDS)
def test_gradient_tape_loop_resumes_from_the_checkpoint_managers_latest(jobs: Any, run: tuple) -> None:
    first, second = jobs(run)
    assert [r["tape"]["latest"] for r in second] == ["ckpt-2"] * run[1]
    assert [r["tape"]["resumed_at"] for r in second] == [workers.TAPE_STEPS // 2] * run[1]
    what = f"GradientTape loop, {run[0]} on {run[1]} workers"
    ends = [r["tape"]["end"] for r in second]
    check_training([end["weights"] for end in ends], first[0]["tape"]["straight"]["weights"], what,
                   tolerance=TOLERANCE)
    check_training([end["optimizer"] for end in ends], first[0]["tape"]["straight"]["optimizer"],
                   f"{what} (optimizer)", tolerance=TOLERANCE)
    for rank, end in enumerate(ends):
        _assert_on_host(end, f"{what}, rank {rank}")


def test_load_model_names_the_argument_it_refuses(jobs: Any) -> None:
    _, second = jobs(RUNS[0])
    assert second[0]["errors"] == [
        "ConfigError: `custom_optimizers` must be a list of optimizer classes. Received: custom_optimizers='Adam'",
        "ConfigError: `custom_objects` must be a dict of names to objects. Received: custom_objects=['Adam']",
        "ConfigError: `compression` must be Compression.none, Compression.fp16, Compression.bf16 or an object with "
        "compress() and decompress(). Received: compression='fp8'",
    ]


@pytest.mark.parametrize("run", [r for r in RUNS if False in r[2]], ids=lambda r: f"{r[0]}-{r[1]}")
def test_broadcast_waits_for_the_first_batch_on_every_rank_when_one_model_is_unbuilt(jobs: Any, run: tuple) -> None:
    _, second = jobs(run)
    ends = [r[False]["unbuilt"] for r in second]
    for rank, end in enumerate(ends):
        assert len(end) == 4 and all(np.isfinite(w).all() for w in end), rank
        _assert_same(end, ends[0], f"rank {rank} after resuming beside an unbuilt model")
