"""A device-like compute for the benchmarks' training steps: a model whose every layer
takes, forward and backward, the time a profile says it would take on an accelerator,
without using the host's CPU, and yields gradients of the profiled shapes.

Each layer is one op in the traced step for its forward pass and one for its backward
pass (``tf.custom_gradient``): ``DeviceWait`` (``device_wait.cc``), an asynchronous
kernel that hands its inputs back after the layer's time from a timer thread, holding no
host thread and no GIL meanwhile, as a kernel queued on an accelerator. The backward op
hands back the layer's weight gradients, tensors made once, as a device's gradients
appear in host-visible memory. The layers are chained, so the backward ops run one
after another in reverse order and every gradient appears when its layer's backward
pass ends: what the reduction can overlap is the rest of the backward pass.

The kernel is compiled against the installed TensorFlow on first use (a C++ compiler
and TensorFlow's headers, ~20 s) and kept in ``~/.cache/hostreduce-benchmarks``; where
it cannot be built, the ops are ``tf.numpy_function`` sleeps instead (they hold a
TensorFlow thread and need the GIL to start and end), and :func:`wait_kernel` says so.

Profiles (``benchmarks/profiles/*.json``, written by ``make_profiles.py``) give each
layer's tensors and forward FLOPs per example and the device's rule for time.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.harness.jobs import REPO_ROOT

__all__ = ["PROFILES", "load_profile", "layer_times_ms", "compute_ms", "update_ms", "tensor_shapes",
           "device_model", "device_model_fn", "wait_kernel", "build_wait_kernel"]

PROFILES = REPO_ROOT / "benchmarks" / "profiles"
KERNEL_SOURCE = Path(__file__).resolve().parent / "device_wait.cc"
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "hostreduce-benchmarks"


def load_profile(name: str) -> dict:
    """The profile ``name`` (a stem of ``benchmarks/profiles``, e.g. ``resnet50``, or a
    path to a profile file)."""
    path = Path(name) if name.endswith(".json") else PROFILES / f"{name}.json"
    if not path.is_file():
        known = sorted(p.stem for p in PROFILES.glob("*.json"))
        raise ValueError(f"`profile` must be one of {known} or a profile file. Received: {name!r}")
    profile = json.loads(path.read_text())
    for key in ("layers", "device", "batch"):
        if key not in profile:
            raise ValueError(f"profile {path} has no {key!r}")
    profile["stem"] = path.stem
    return profile


def layer_times_ms(profile: dict, batch: int | None = None) -> list[tuple[float, float]]:
    """(forward ms, backward ms) of each layer on the profile's device at ``batch``
    examples per worker (default: the profile's)."""
    dev = profile["device"]
    batch = batch or profile["batch"]
    out = []
    for layer in profile["layers"]:
        fwd = layer["forward_flops"] * batch / (dev["tflops"] * 1e12) * 1e3
        out.append((fwd, dev["backward_factor"] * fwd))
    return out


def compute_ms(profile: dict, batch: int | None = None) -> float:
    """The forward and backward pass of one step on the device."""
    return sum(f + b for f, b in layer_times_ms(profile, batch))


def tensor_shapes(profile: dict) -> list[tuple[int, ...]]:
    """Every trainable tensor's shape, in forward order."""
    return [tuple(s) for layer in profile["layers"] for s in layer["tensors"]]


def update_ms(profile: dict) -> float:
    """Adam's update of every parameter on the device (float32: parameter, gradient and
    two moments read, parameter and moments written)."""
    params = sum(math.prod(s) for s in tensor_shapes(profile))
    return params * 28 / (profile["device"]["memory_gbps"] * 1e9) * 1e3


def _kernel_path() -> Path:
    import tensorflow as tf

    key = hashlib.sha256(KERNEL_SOURCE.read_bytes() + tf.__version__.encode() + sys.version.encode()).hexdigest()[:16]
    return CACHE / f"device_wait-{key}.so"


def build_wait_kernel() -> tuple[Path | None, str]:
    """Compile ``DeviceWait`` for the installed TensorFlow (once; cached). Returns the
    library's path, or None and why not."""
    import tensorflow as tf

    path = _kernel_path()
    if path.is_file():
        return path, "cached"
    CACHE.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    argv = ["g++", "-std=c++17", "-O2", "-shared", "-fPIC", "-w", str(KERNEL_SOURCE), "-o", str(tmp),
            *tf.sysconfig.get_compile_flags(), *tf.sysconfig.get_link_flags()]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"{type(exc).__name__}: {exc}"
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        return None, f"g++ failed: {proc.stderr.strip()[-500:]}"
    os.replace(tmp, path)  # whole or absent, for workers that load it at the same time
    return path, "built"


_KERNEL: list = []


def wait_kernel() -> tuple[Any, str]:
    """``(wait, kind)``: ``wait(tensors, ms)`` returns ``tensors`` after ``ms`` on the
    modelled device; ``kind`` says how (``DeviceWait kernel`` or the sleep fallback)."""
    if not _KERNEL:
        import tensorflow as tf

        path, why = build_wait_kernel()
        if path is not None:
            op = tf.load_op_library(str(path)).device_wait

            def wait(tensors: list, ms: float) -> list:
                return op(inputs=tensors, micros=int(round(ms * 1e3)))

            _KERNEL.append((wait, "DeviceWait kernel (asynchronous, timer thread)"))
        else:
            def wait(tensors: list, ms: float) -> list:
                outs = tf.numpy_function(_sleep_then(ms), tensors, [t.dtype for t in tensors], stateful=False)
                for out, like in zip(outs, tensors):
                    out.set_shape(like.shape)
                return outs

            _KERNEL.append((wait, f"tf.numpy_function sleep (GIL, holds a TensorFlow thread): {why}"))
    return _KERNEL[0]


def _sleep_then(ms: float) -> Any:
    seconds = ms / 1e3

    def run(*xs: Any) -> list:
        if seconds > 0:
            time.sleep(seconds)
        return list(xs)

    return run


def device_model(profile: dict, batch: int | None = None) -> Any:
    """A Keras model of the profile's layers whose passes take the device's time."""
    import keras
    import numpy as np
    import tensorflow as tf

    wait, _ = wait_kernel()

    class DeviceLayer(keras.layers.Layer):
        def __init__(self, shapes: list[list[int]], forward_ms: float, backward_ms: float, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.shapes, self.forward_ms, self.backward_ms = shapes, forward_ms, backward_ms
            # The layer's gradients as the device leaves them: small constants, made once,
            # outside any traced function (a step captures them, it does not copy them).
            with tf.init_scope():
                self.grads = [tf.constant(np.full(s, 1e-3, np.float32)) for s in shapes]

        def build(self, input_shape: Any) -> None:
            self.ws = [self.add_weight(shape=tuple(s), initializer="zeros", name=f"w{i}")
                       for i, s in enumerate(self.shapes)]

        def call(self, x: Any) -> Any:
            forward_ms, backward_ms, grads = self.forward_ms, self.backward_ms, self.grads

            @tf.custom_gradient
            def run(x: Any, *ws: Any) -> Any:
                y = wait([x], forward_ms)[0]

                def grad(dy: Any) -> list:
                    # Takes the layer's output too, as a backward pass takes its
                    # activations: it starts after the whole forward pass.
                    outs = wait([dy, y, *grads], backward_ms)
                    return [outs[0], *outs[2:]]

                return y, grad

            return run(x, *[tf.convert_to_tensor(w) for w in self.ws])

    times = layer_times_ms(profile, batch)
    layers = [DeviceLayer(layer["tensors"], f, b, name=f"device{i}")
              for i, (layer, (f, b)) in enumerate(zip(profile["layers"], times))]
    return keras.Sequential(layers)


def device_model_fn(features: Any, labels: Any, mode: str, params: dict) -> Any:
    """A ``model_fn`` for hostreduce's Estimator over :func:`device_model`
    (``params["profile"]``, ``params["batch"]``): the forward pass, the gradients as the
    device's backward pass yields them, Adam applied on the host to the reduced ones."""
    import keras
    import tensorflow as tf

    from hostreduce.estimator import EstimatorSpec, compute_gradients

    model = device_model(params["profile"], params.get("batch"))
    loss = tf.reduce_sum(model(features))
    optimizer = keras.optimizers.Adam(1e-4)
    grads = compute_gradients(loss, model.trainable_variables)

    def host_apply(*reduced: Any) -> None:
        optimizer.apply_gradients(zip(reduced, model.trainable_variables))

    return EstimatorSpec(mode, loss=loss, train_op=tf.identity(loss), host_call=(host_apply, grads))
