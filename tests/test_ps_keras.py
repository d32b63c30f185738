"""Keras 3 ``model.fit`` on parameter servers (``ParameterServerStrategy.keras_optimizer``),
every task its own process started by hand: sync training of a model with an embedding
split over 2 ps and dense layers equals one process training on the global batch, with
the model built as usual (every variable pulled whole each step) or in
``strategy.scope()`` (the table a row cache of the batch's rows on each worker), and
every process exits 0; async training runs to its end. (The ps tasks run a light server
here; ``tests/test_examples_recommender.py`` runs a Keras script in every task, where
the ps serve at ``keras_optimizer``.)"""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from tests.script_jobs import base_env, run_ps_by_hand, run_reference

pytestmark = [pytest.mark.tf, pytest.mark.slow, pytest.mark.timeout(300)]

SCRIPT = Path(__file__).resolve().parent / "ps_scripts" / "keras_fit_ps.py"
PS_SCRIPT = Path(__file__).resolve().parent / "ps_scripts" / "serve_ps.py"  # a ps without TensorFlow


def _output(tasks: dict) -> str:
    return "\n".join(f"--- {name} (exit {w.returncode}) ---\n{w.output}" for name, w in tasks.items())


@pytest.mark.parametrize("optimizer, scope", [("sgd", False), ("adam", True)])
def test_sync_fit_equals_one_process_on_the_global_batch(tmp_path: Path, optimizer: str, scope: bool) -> None:
    args = ["--optimizer", optimizer, "--out", str(tmp_path)]
    ref = run_reference(SCRIPT, [*args, "--reference"], timeout=200)
    assert ref.returncode == 0, ref.stdout[-3000:] + ref.stderr[-3000:]
    tasks = run_ps_by_hand(SCRIPT, args + ["--scope"] * scope, timeout=240, env=base_env(HOSTREDUCE_TIMEOUT_S="60"),
                           ps_script=PS_SCRIPT)
    output = _output(tasks)
    assert {n: w.returncode for n, w in tasks.items()} == dict.fromkeys(tasks, 0), output
    for name in ("chief", "worker1") if scope else ():
        cached = re.search(r"CACHED (\d+) of 500 rows", tasks[name].output)
        assert cached and int(cached.group(1)) <= 16 * 4 + 1, output  # a batch's distinct ids and the spare
    want = np.load(tmp_path / "ref.npz")
    for rank in (0, 1):
        got = np.load(tmp_path / f"{rank}.npz")
        assert sorted(got.files) == sorted(want.files) and len(want.files) == 5, (got.files, want.files)
        for name in want.files:
            err = np.max(np.abs(got[name] - want[name])) / max(np.max(np.abs(want[name])), 1e-12)
            assert err <= 1e-5, (rank, name, err)


def test_async_fit_runs_to_its_end(tmp_path: Path) -> None:
    tasks = run_ps_by_hand(SCRIPT, ["--async", "--steps", "10", "--out", str(tmp_path)], timeout=240,
                           env=base_env(HOSTREDUCE_TIMEOUT_S="60", TEST_PS_MODE="async"), ps_script=PS_SCRIPT)
    output = _output(tasks)
    assert {n: w.returncode for n, w in tasks.items()} == dict.fromkeys(tasks, 0), output
    for rank in (0, 1):
        assert f"DONE rank {rank}" in tasks["chief" if rank == 0 else "worker1"].output, output
        assert all(np.isfinite(v).all() for v in np.load(tmp_path / f"{rank}.npz").values())


@pytest.mark.parametrize("legacy", [pytest.param("0", id="keras3"), pytest.param("1", id="tf_keras")])
def test_fit_inside_the_scope_with_a_legacy_optimizer_equals_one_process(legacy: str) -> None:
    """Built (and called on a sample batch), compiled (``tf.keras.optimizers.legacy.Adam``,
    ``SGD`` with momentum; a model subclassed in the script with ``"sgd"``) and trained
    inside ``strategy.scope()``, a model whose table is a row cache trains as the same
    Keras does in one process (tf_keras: its legacy kernels, momentum updating only the
    looked-up rows), within 1e-5; a table looked up twice in a step is refused with a
    ``SpecError`` naming it, on tf_keras too."""
    import json
    import subprocess
    import sys

    script = Path(__file__).resolve().parent / "ps_scripts" / "fit_in_scope_ps.py"
    done = subprocess.run([sys.executable, str(script)], env=base_env(TF_USE_LEGACY_KERAS=legacy),
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    errors = json.loads(done.stdout.split("ERRORS", 1)[1].splitlines()[0])
    assert sorted(errors) == ["Adam", "SGD momentum", "subclassed, 'sgd'"] and max(errors.values()) <= 1e-5, errors
    refused = done.stdout.split("REFUSED", 1)[1]
    assert "SpecError: The table 'twice" in refused or refused.lstrip().startswith("The table 'twice"), refused
    assert "is looked up 2 times in one training step" in refused, refused


@pytest.mark.timeout(120)
def test_a_table_looked_up_twice_in_a_step_is_refused_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """In ``strategy.scope()`` a split table is a cache of one lookup's rows per step: a
    model that looks it up twice gets a SpecError naming the table, not wrong rows."""
    import json

    import keras
    import tensorflow as tf

    import hostreduce
    from hostreduce.errors import SpecError
    from hostreduce.ps_training.keras import release_lookups
    from tests.ps_helpers import LocalCluster

    ps = LocalCluster(2, 1)
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": {"chief": ["127.0.0.1:1"], "ps": ps.addresses},
                                                "task": {"type": "chief", "index": 0}}))
    monkeypatch.setenv("HOSTREDUCE_SECRET", ps.secret)
    strategy = hostreduce.ParameterServerStrategy(shard_bytes=1_000)
    try:
        with strategy.scope():
            ids = keras.Input((2,), dtype="int32")
            emb = keras.layers.Embedding(100, 4, name="twice")
            model = keras.Model(ids, keras.layers.Dense(1)(keras.layers.Flatten()(emb(ids) + emb(ids + 1))))
        model.compile(optimizer=strategy.keras_optimizer(keras.optimizers.SGD(0.1)), loss="mse", jit_compile=False)
        data = tf.data.Dataset.from_tensor_slices((np.zeros((4, 2), np.int32), np.zeros((4, 1), np.float32)))
        with pytest.raises(SpecError, match=r"'twice/embeddings' .* looked up 2 times in one training step"):
            model.fit(data.batch(2), epochs=1, verbose=0, shuffle=False)
    finally:
        strategy.job.end("test over")
        release_lookups(strategy)  # the lookup route this process kept for its Keras steps
        ps.stop()
