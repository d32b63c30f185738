"""The overlap benchmark's device-like compute: its wait op hands back its inputs after
its time, the device model yields each gradient as its layer's backward pass ends (last
layer first), the shipped profiles add up, a device run writes its table, and so does
the variant on the host layers alone (``overlap_engine.py``)."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks import netcluster as NC

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.tf


def _tiny_profile(path: Path, backward_ms: float = 40.0) -> Path:
    """Three layers; the device rule makes each forward pass 10 ms and each backward pass
    ``backward_ms`` at a batch of 1."""
    device = {"name": "test device", "tflops": 1e-9, "memory_gbps": 1.0, "backward_factor": backward_ms / 10.0,
              "rule": "forward ms = forward_flops x batch / (tflops x 1e12) x 1e3"}
    layers = [{"name": f"l{i}", "tensors": shape, "forward_flops": 10.0}
              for i, shape in enumerate([[[64, 32], [32]], [[32, 32], [32]], [[32, 8]]])]
    path.write_text(json.dumps({"model": "tiny", "source": "test", "batch": 1, "batch_unit": "examples",
                                "parameters": 64 * 32 + 32 + 32 * 32 + 32 + 32 * 8, "gradient_tensors": 5,
                                "device": device, "layers": layers}))
    return path


def _rounding(row: dict) -> float:
    """How far a row's hidden fraction (from its unrounded times, rounded to 4 decimals)
    can be from the one its times give, each rounded to the microsecond: the numerator's
    three roundings (1.5 us), and the denominator's (0.5 us), which moves the fraction
    in proportion to its size."""
    return (1.5e-3 + 5e-4 * abs(row["hidden_fraction"])) / row["reduction_ms"] + 1e-4


def test_shipped_profiles_add_up() -> None:
    from benchmarks.impls import device as D

    for stem, params in (("resnet50", 25_583_592), ("bert_base", 109_482_240)):
        prof = D.load_profile(stem)
        shapes = D.tensor_shapes(prof)
        assert sum(math.prod(s) for s in shapes) == prof["parameters"] == params
        assert len(shapes) == prof["gradient_tensors"]
        times = D.layer_times_ms(prof)
        assert all(b == pytest.approx(prof["device"]["backward_factor"] * f) for f, b in times)
        flops = sum(layer["forward_flops"] for layer in prof["layers"]) * prof["batch"]
        assert D.compute_ms(prof) == pytest.approx(
            flops * (1 + prof["device"]["backward_factor"]) / (prof["device"]["tflops"] * 1e12) * 1e3)
    with pytest.raises(ValueError, match="profile"):
        D.load_profile("no_such_model")


def test_wait_hands_back_its_inputs_after_its_time() -> None:
    import numpy as np
    import tensorflow as tf

    from benchmarks.impls import device as D

    wait, kind = D.wait_kernel()
    a, b = tf.constant(np.arange(6, dtype=np.float32).reshape(2, 3)), tf.constant([7], tf.int32)

    @tf.function
    def f(a: tf.Tensor, b: tf.Tensor) -> list:
        return wait([a, b], 30.0)

    f(a, b)
    t0 = time.perf_counter()
    out = f(a, b)
    assert time.perf_counter() - t0 >= 0.03
    np.testing.assert_array_equal(out[0].numpy(), a.numpy())
    np.testing.assert_array_equal(out[1].numpy(), b.numpy())
    assert out[0].shape == (2, 3)
    if subprocess.run(["which", "g++"], capture_output=True).returncode == 0:
        assert kind.startswith("DeviceWait kernel"), kind


def test_device_model_yields_each_gradient_as_its_layer_ends(tmp_path: Path) -> None:
    import tensorflow as tf

    from benchmarks.impls import device as D

    prof = D.load_profile(str(_tiny_profile(tmp_path / "tiny.json")))
    model = D.device_model(prof)
    x = tf.zeros((1, 1))
    model(x)
    variables = model.trainable_variables
    assert [tuple(v.shape) for v in variables] == D.tensor_shapes(prof)
    seen: dict[int, float] = {}

    def stamp(i: int) -> object:
        def run(g: object) -> object:
            seen[i] = time.perf_counter()
            return g
        return run

    @tf.function
    def step() -> list:
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(x))
        grads = tape.gradient(loss, variables)
        # Not stateful: stateful ops of a traced function run in program order.
        return [tf.numpy_function(stamp(i), [g], tf.float32, stateful=False) for i, g in enumerate(grads)]

    step()
    seen.clear()
    t0 = time.perf_counter()
    grads = step()
    assert [tuple(g.shape) for g in grads] == D.tensor_shapes(prof)
    assert all(float(tf.reduce_max(tf.abs(g - 1e-3))) == 0 for g in grads)
    # Variables 0-1 are layer 0's, 2-3 layer 1's, 4 layer 2's: the last layer's gradient
    # appears first, and each earlier layer's at least its backward pass later.
    (forward, backward), = {(f / 1e3, b / 1e3) for f, b in D.layer_times_ms(prof)}
    # The backward pass starts after the whole forward pass.
    assert seen[4] - t0 >= 0.9 * (3 * forward + backward)
    assert seen[4] < seen[2] and seen[4] < seen[3] and seen[2] < seen[0] and seen[3] < seen[1]
    assert min(seen[2], seen[3]) - seen[4] >= 0.9 * backward
    assert min(seen[0], seen[1]) - max(seen[2], seen[3]) >= 0.9 * backward


@pytest.mark.timeout(420)
def test_overlap_device_run_writes_every_system(tmp_path: Path) -> None:
    import importlib.util

    profile = _tiny_profile(tmp_path / "tiny.json", backward_ms=20.0)
    network = "1gbit" if NC.netns_usable()[0] else "loopback"
    systems = ["ring", "mpi"] + (["horovod"] if importlib.util.find_spec("horovod") else [])
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOSTREDUCE_")}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "overlap.py"), "--compute", "device", "--quick",
                           "--profiles", str(profile), "--networks", network, "--systems", ",".join(systems),
                           "--out", str(tmp_path)], cwd=str(ROOT), env=env, capture_output=True, text=True,
                          timeout=400)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    result = json.loads((tmp_path / "overlap.device.json").read_text())
    rows = {(r["system"], r["schedule"]): r for r in result["measurements"]}
    expected = {("ring", "sequential"), ("ring", "apply-once"), ("ring", "streamed"), ("mpi", "streamed")}
    if "horovod" in systems and result["settings"]["systems"][-1] == "horovod":
        expected.add(("horovod", "horovod"))
    assert set(rows) == expected
    for row in rows.values():
        assert row["network"] == network and row["np"] == 2
        assert row["step_ms"] > 0 and row["compute_ms"] > 0 and row["reduction_ms"] > 0
        assert row["hidden_fraction"] == pytest.approx(
            (row["compute_ms"] + row["reduction_ms"] - row["step_ms"]) / row["reduction_ms"], abs=_rounding(row))
        assert row["cpu_ms_per_step"] > 0 and row["bound"]
        # The compute is the profile's: 3 x (10 + 20) ms at least, whatever the machine.
        assert row["compute_ms"] >= 90 * 0.99
    assert rows[("ring", "streamed")]["engine"] != rows[("mpi", "streamed")]["engine"]
    assert rows[("ring", "streamed")]["transport"] == ("tcp" if network != "loopback" else rows[("ring", "streamed")]["transport"])
    assert (tmp_path / "overlap.device.png").stat().st_size > 0
    assert (tmp_path / f"overlap.device.timeline.tiny-{network}-np2.png").stat().st_size > 0
    assert "hidden" in proc.stdout


@pytest.mark.timeout(300)
def test_overlap_engine_run_and_merge(tmp_path: Path) -> None:
    """The host-layers-alone variant (no TensorFlow in its workers): every system's rows,
    the hidden fraction and its bound from the backward pass, and one result merged from
    two parts."""
    profile = _tiny_profile(tmp_path / "tiny.json", backward_ms=20.0)
    network = "1gbit" if NC.netns_usable()[0] else "loopback"
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOSTREDUCE_")}
    script = str(ROOT / "benchmarks" / "overlap_engine.py")
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, script, "--cells", f"{profile}:{network}:2", "--rounds", "1", "--steps", "2",
                           "--out", str(out)], cwd=str(ROOT), env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    result = json.loads((out / "overlap.engine.json").read_text())
    rows = {(r["system"], r["schedule"]): r for r in result["measurements"]}
    assert set(rows) == {("ring", "sequential"), ("ring", "streamed"), ("ring", "overlapped"),
                         ("ring-grpc", "streamed"), ("mpi", "streamed"), ("openmpi", "fused-cycle")}
    if network != "loopback":   # the ring's path between hosts, and gRPC's for comparison
        assert rows[("ring", "streamed")]["transport"] == "tcp"
        assert rows[("ring-grpc", "streamed")]["transport"] == "grpc"
    for row in rows.values():
        assert row["case"] == "tiny" and row["network"] == network and row["np"] == 2
        assert row["hidden_fraction"] == pytest.approx(
            (row["compute_ms"] + row["reduction_ms"] - row["step_ms"]) / row["reduction_ms"], abs=_rounding(row))
        # 3 x (10 + 20) ms of device time; only the 60 ms of backward pass can hide a reduction.
        assert row["compute_ms"] >= 90 * 0.99 and row["backward_nominal_ms"] == pytest.approx(60.0)
        assert row["hideable"] == pytest.approx(min(1.0, 60.0 / row["reduction_ms"]), rel=1e-3, abs=1e-3)
        assert row["gradient_tensors"] == 5 and row["bound"]
    assert "Open MPI" in rows[("openmpi", "fused-cycle")]["engine"]
    assert rows[("ring", "streamed")]["engine"] != rows[("mpi", "streamed")]["engine"]
    for schedule in ("streamed", "overlapped"):
        trace = rows[("ring", schedule)]["trace"]["0"]
        # Each gradient is handed off when its layer's backward pass ends (last layer first),
        # its reduction ends after that, and its update after its wait returned.
        assert trace["ready_ms"][4] < trace["ready_ms"][2] < trace["ready_ms"][0]
        assert all(r <= c <= w <= a for r, c, w, a in zip(trace["ready_ms"], trace["completed_ms"],
                                                          trace["reduced_ms"], trace["applied_ms"]))
    # Applied after the backward pass: no wait returns before the pass is over.
    after = rows[("ring", "streamed")]["trace"]["0"]
    assert min(after["reduced_ms"]) >= after["backward_end_ms"]
    assert (out / "overlap.engine.png").stat().st_size > 0
    assert (out / f"overlap.engine.timeline.tiny-{network}-np2.png").stat().st_size > 0
    assert (out / f"overlap.engine.timeline.tiny-{network}-np2-overlapped.png").stat().st_size > 0
    # Two parts, each with some of the rows, make one result with all of them.
    parts = []
    for i, systems in enumerate((("ring", "ring-grpc"), ("mpi", "openmpi"))):
        part = json.loads(json.dumps(result))
        part["measurements"] = [r for r in part["measurements"] if r["system"] in systems]
        parts.append(tmp_path / f"part{i}.json")
        parts[-1].write_text(json.dumps(part))
    merged_dir = tmp_path / "merged"
    proc = subprocess.run([sys.executable, script, "--merge", ",".join(map(str, parts)), "--out", str(merged_dir),
                           "--no-plot"], cwd=str(ROOT), env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    merged = json.loads((merged_dir / "overlap.engine.json").read_text())
    assert {(r["system"], r["schedule"]) for r in merged["measurements"]} == set(rows)
    assert {(r["system"], r["part"]) for r in merged["measurements"]} == {
        (sys_, str(parts[0] if sys_ in ("ring", "ring-grpc") else parts[1])) for sys_, _ in rows}
    assert [p["file"] for p in merged["environment"]["parts"]] == [str(p) for p in parts]
    assert "wall_s" not in merged["environment"]
