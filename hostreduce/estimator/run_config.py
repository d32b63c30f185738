"""``RunConfig``: where an Estimator keeps its state and how it distributes training.

Scripts ported from ``tf.estimator``, Graphcore's ``ipu_run_config.RunConfig`` and
Huawei's ``NPURunConfig`` pass settings that only tuned a TF1 session or a device
(``session_config``, ``ipu_run_config``, ``iterations_per_loop``, ``precision_mode``,
...). Those are accepted and ignored with one warning per setting and process, so the
script runs unchanged; any other unknown keyword is a ``ConfigError`` (a typo must not
be ignored silently).
"""
from __future__ import annotations

import dataclasses
import threading
import warnings
from typing import Any, Mapping

from ..errors import ConfigError

__all__ = ["RunConfig", "IGNORED_SETTINGS", "set_random_seed"]

# Settings of tf.estimator.RunConfig, the IPU RunConfig and NPURunConfig that have no
# meaning here: name -> why (shown in the warning).
_TF1_SESSION = "it configured a TF1 session; hostreduce runs TensorFlow 2 functions"
_DEVICE = "it tuned the IPU/NPU device; hostreduce runs on whatever device TensorFlow uses"
_ONE_PROCESS = "hostreduce takes the cluster from the strategy (TF_CONFIG or mpirun)"
IGNORED_SETTINGS: Mapping[str, str] = {
    # tf.estimator.RunConfig
    "session_config": _TF1_SESSION,
    "session_creation_timeout_secs": _TF1_SESSION,
    "checkpoint_save_graph_def": "checkpoints hold variables only",
    "keep_checkpoint_every_n_hours": "only the newest `keep_checkpoint_max` checkpoints are kept",
    "device_fn": "variables are placed by `variables_on_host` of the strategy",
    "protocol": "the ring uses its own authenticated gRPC connections",
    "eval_distribute": "evaluation uses `train_distribute`",
    "experimental_distribute": _ONE_PROCESS,
    "experimental_max_worker_delay_secs": "workers start together and agree every step",
    # Graphcore IPU RunConfig
    "ipu_run_config": _DEVICE,
    "master": _ONE_PROCESS,
    "evaluation_master": _ONE_PROCESS,
    "cluster": _ONE_PROCESS,
    # Huawei NPURunConfig
    "iterations_per_loop": "every step runs one batch (there is no device loop to unroll)",
    "profiling_config": _DEVICE,
    "distribute": _ONE_PROCESS,
    "enable_data_pre_proc": _DEVICE,
    "precision_mode": _DEVICE,
    "precision_mode_v2": _DEVICE,
    "enable_reduce_precision": _DEVICE,
    "variable_format_optimize": _DEVICE,
    "mix_compile_mode": _DEVICE,
    "hcom_parallel": "gradients are always reduced while the backward pass runs",
    "graph_memory_max_size": _DEVICE,
    "variable_memory_max_size": _DEVICE,
    "auto_tune_mode": _DEVICE,
    "dump_config": _DEVICE,
    "stream_max_parallel_num": _DEVICE,
    "is_tailing_optimization": _DEVICE,
    "horovod_mode": _ONE_PROCESS,
    "graph_run_mode": _DEVICE,
    "op_debug_level": _DEVICE,
    "enable_scope_fusion_passes": _DEVICE,
    "enable_exception_dump": _DEVICE,
    "op_select_implmode": _DEVICE,
    "optypelist_for_implmode": _DEVICE,
    "dynamic_input_config": _DEVICE,
    "mstune_mode": _DEVICE,
    "work_path": _DEVICE,
    "buffer_optimize": _DEVICE,
    "enable_small_channel": _DEVICE,
    "fusion_switch_file": _DEVICE,
    "enable_compress_weight": _DEVICE,
    "compress_weight_conf": _DEVICE,
    "op_compiler_cache_mode": _DEVICE,
    "op_compiler_cache_dir": _DEVICE,
    "debug_dir": _DEVICE,
    "hcom_multi_mode": _DEVICE,
    "dynamic_input": _DEVICE,
    "dynamic_graph_execute_mode": _DEVICE,
    "dynamic_inputs_shape_range": _DEVICE,
    "local_rank_id": _ONE_PROCESS,
    "local_device_list": _ONE_PROCESS,
    "session_device_id": _DEVICE,
    "distribute_config": _ONE_PROCESS,
    "modify_mixlist": _DEVICE,
    "op_precision_mode": _DEVICE,
    "device_type": _DEVICE,
    "soc_config": _DEVICE,
    "hccl_timeout": "set HOSTREDUCE_TIMEOUT_S for the reduction's timeout",
    "op_wait_timeout": _DEVICE,
    "op_execute_timeout": _DEVICE,
    "HCCL_algorithm": "the reduction engine is chosen by the strategy",
    "customize_dtypes": _DEVICE,
    "op_debug_config": _DEVICE,
    "memory_config": _DEVICE,
    "experimental_config": _DEVICE,
    "topo_sorting_mode": _DEVICE,
    "aoe_config_file": _DEVICE,
    "insert_op_file": _DEVICE,
    "stream_sync_timeout": _DEVICE,
    "event_sync_timeout": _DEVICE,
    "external_weight": _DEVICE,
    "es_cluster_config": _ONE_PROCESS,
    "deterministic": _DEVICE,
    "frozen_variable": _DEVICE,
    "variable_placement": "variables are placed by `variables_on_host` of the strategy",
    "jit_compile": _DEVICE,
    "graph_slice": _DEVICE,
}

_warned: set[str] = set()
_warned_lock = threading.Lock()


def _warn_ignored(name: str) -> None:
    with _warned_lock:
        if name in _warned:
            return
        _warned.add(name)
    warnings.warn(f"RunConfig: `{name}` is accepted for compatibility and ignored: {IGNORED_SETTINGS[name]}.",
                  UserWarning, stacklevel=3)


def _positive_int_or_none(name: str, value: Any) -> None:
    if value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"`{name}` must be an integer >= 1 or None. Received: {name}={value!r}")


HOST_APPLY_MODES = ("per_gradient", "once")


@dataclasses.dataclass(frozen=True)
class _Settings:
    train_distribute: Any = None
    model_dir: str | None = None
    save_checkpoints_steps: int | None = None
    keep_checkpoint_max: int = 5
    log_step_count_steps: int | None = 100
    timeline_dir: str | None = None
    collective_timeout_s: float | None = None
    fused_apply: bool = True
    stream_gradients: bool = True
    save_checkpoints_secs: float | None = None
    tf_random_seed: int | None = None
    save_summary_steps: int | None = 100
    host_apply: str = "per_gradient"


class RunConfig(_Settings):
    """Settings of an :class:`Estimator` run.

    Attributes:
        train_distribute: a strategy (``MultiWorkerStrategy``, ``HorovodStrategy``);
            None trains in this process alone. Also used by ``evaluate``.
        model_dir: directory for checkpoints (written by the chief, rank 0).
        save_checkpoints_steps: save every this many steps (and always at the end of
            ``train``); None saves only at the end.
        keep_checkpoint_max: number of most recent checkpoints kept.
        log_step_count_steps: the chief logs step, loss and examples/s this often.
        timeline_dir: write a Chrome-trace timeline per rank here (default: the
            ``HOSTREDUCE_TIMELINE`` variable; unset writes none).
        collective_timeout_s: longest wait for a step's reductions before failing.
        fused_apply: run Keras SGD/Adam updates in ``host_call`` through fused kernels.
        stream_gradients: hand each gradient to the reducer the moment the backward
            pass produces it, so reductions overlap the rest of the backward pass
            (default). False copies the gradients to the host as they come but starts
            the reductions only after the whole backward pass, all at once: the
            sequential schedule, useful to measure what the overlap gains.
        save_checkpoints_secs: the chief also saves when this many seconds passed
            since its last save (checked after each step).
        tf_random_seed: seeds Python's, NumPy's, TensorFlow's and Keras's generators
            (as ``keras.utils.set_random_seed``) once, before ``model_fn`` is first
            traced, so initial weights and random ops repeat from run to run.
        host_apply: ``"per_gradient"`` (default): the host program waits for each
            reduction in its own op, so each variable's update (its ``host_call``
            ``apply_gradients``) runs as soon as its gradient is reduced, while the
            other reductions continue; the iteration counter still advances once per
            step. ``"once"``: wait for every reduction, then run ``host_call`` once.
        save_summary_steps: with a ``model_dir``, the chief writes TensorBoard scalars
            every this many steps: ``loss`` (the chief's batch), ``global_step/sec``
            and ``examples/sec`` in ``model_dir``, and each ``evaluate`` result in
            ``model_dir/eval``; None or 0 writes none.

    Settings that only tuned a TF1 session or an IPU/NPU device (see
    ``IGNORED_SETTINGS``) are accepted with one warning each; other unknown keywords
    raise ``ConfigError``.
    """

    device_options: Mapping[str, Any]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        known = {f.name for f in dataclasses.fields(_Settings)}
        extra = {k: kwargs.pop(k) for k in list(kwargs) if k not in known}
        unknown = sorted(k for k in extra if k not in IGNORED_SETTINGS)
        if unknown:
            raise ConfigError(
                f"RunConfig got unknown argument(s) {unknown}. Known: {sorted(known)}; accepted and ignored for "
                f"compatibility: session_config, ipu_run_config, iterations_per_loop, precision_mode and other "
                f"device or TF1 session settings (hostreduce.estimator.run_config.IGNORED_SETTINGS)"
            )
        for name in extra:
            _warn_ignored(name)
        super().__init__(*args, **kwargs)
        object.__setattr__(self, "device_options", dict(extra))
        self._validate()

    def _validate(self) -> None:
        _positive_int_or_none("save_checkpoints_steps", self.save_checkpoints_steps)
        _positive_int_or_none("log_step_count_steps", self.log_step_count_steps)
        if self.save_summary_steps == 0:
            object.__setattr__(self, "save_summary_steps", None)
        _positive_int_or_none("save_summary_steps", self.save_summary_steps)
        if not isinstance(self.keep_checkpoint_max, int) or self.keep_checkpoint_max < 1:
            raise ConfigError(
                f"`keep_checkpoint_max` must be an integer >= 1. Received: keep_checkpoint_max={self.keep_checkpoint_max!r}"
            )
        secs = self.save_checkpoints_secs
        if secs is not None and (isinstance(secs, bool) or not isinstance(secs, (int, float)) or secs <= 0):
            raise ConfigError(f"`save_checkpoints_secs` must be a number > 0 or None. Received: save_checkpoints_secs={secs!r}")
        seed = self.tf_random_seed
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ConfigError(f"`tf_random_seed` must be an integer or None. Received: tf_random_seed={seed!r}")
        if self.model_dir is not None and not isinstance(self.model_dir, str):
            object.__setattr__(self, "model_dir", str(self.model_dir))
        if self.timeline_dir is not None and not isinstance(self.timeline_dir, str):
            object.__setattr__(self, "timeline_dir", str(self.timeline_dir))
        if self.host_apply not in HOST_APPLY_MODES:
            raise ConfigError(f"`host_apply` must be one of {HOST_APPLY_MODES}. Received: host_apply={self.host_apply!r}")
        if not isinstance(self.stream_gradients, bool):
            raise ConfigError(
                f"`stream_gradients` must be a bool. Received: stream_gradients={self.stream_gradients!r}"
            )
        value = self.train_distribute
        if value is not None and not hasattr(type(value), "reducer"):
            raise ConfigError(
                "`train_distribute` must be a hostreduce strategy (MultiWorkerStrategy, HorovodStrategy) or None. "
                f"Received: train_distribute={value!r}"
            )

    def replace(self, **changes: Any) -> "RunConfig":
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(_Settings)}
        values.update(changes)
        return RunConfig(**values, **self.device_options)


def set_random_seed(seed: int) -> None:
    """Seed everything that chooses initial weights and random ops: Python's and NumPy's
    generators, TensorFlow's global seed, and Keras (3 and/or tf_keras) as
    ``keras.utils.set_random_seed`` does."""
    import importlib
    import importlib.util
    import random

    import numpy as np
    import tensorflow as tf

    from ..host.kerases import loaded_kerases

    # Load the Keras behind tf.keras (tf_keras under TF_USE_LEGACY_KERAS=1) and Keras 3
    # now: importing one later would draw from the generators seeded here.
    tf.keras.utils  # noqa: B018
    if importlib.util.find_spec("keras") is not None:
        importlib.import_module("keras")
    random.seed(seed)
    np.random.seed(seed)
    tf.random.set_seed(seed)
    for keras in loaded_kerases():
        keras.utils.set_random_seed(seed)
