"""The compiled programs of one Estimator: ``model_fn`` traced into a ``tf.function``
per mode, plus the host step that runs ``host_call``.

``model_fn`` runs only while ``tf.function`` traces (once per mode for a fixed input
signature; the batch dimension is left free). Variables are shared between modes and
traces through the :class:`~hostreduce.host.variables.VariableStore`.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable

import numpy as np

from ..errors import SpecError
from ..host.apply import fused_optimizer_scope
from ..host.gradients import gradient_labels, recording
from ..host.tf1 import HOST_CALL, MODEL_FN, tf1_optimizer_scope
from ..host.variables import VariableStore
from ..streaming.handoff import HostCallExchange
from ..timeline import Timeline, now_us
from .inputs import call_model_fn
from .mode_keys import ModeKeys
from .spec import EstimatorSpec, check_host_call

__all__ = ["TrainProgram", "EvalProgram", "PredictProgram", "relaxed_signature"]


def relaxed_signature(element_spec: Any) -> tuple[Any, Any]:
    """(features_spec, labels_spec) with the batch dimension left unknown."""
    import tensorflow as tf

    def relax(spec: Any) -> Any:
        if isinstance(spec, tf.TensorSpec) and spec.shape.rank:
            return tf.TensorSpec([None] + spec.shape.as_list()[1:], spec.dtype, spec.name)
        return spec

    if isinstance(element_spec, tuple) and len(element_spec) == 2:
        features, labels = element_spec
    else:
        features, labels = element_spec, None
    return tf.nest.map_structure(relax, features), (
        None if labels is None else tf.nest.map_structure(relax, labels))


def _as_spec(value: Any, mode: str) -> EstimatorSpec:
    if isinstance(value, EstimatorSpec):
        spec = value
    elif hasattr(value, "_fields") and hasattr(value, "mode"):  # a look-alike namedtuple
        spec = EstimatorSpec(**{f: getattr(value, f) for f in EstimatorSpec._fields if hasattr(value, f)})
    else:
        raise SpecError(f"`model_fn` must return an EstimatorSpec. Received: {type(value).__name__}")
    if spec.mode != mode:
        raise SpecError(f"`model_fn` was called in mode {mode!r} but returned an EstimatorSpec with mode={spec.mode!r}")
    return spec.validate()


class _Marker:
    """In-graph timestamps: a stateless op that records when its inputs became ready."""

    def __init__(self) -> None:
        self.times: dict[str, float] = {}

    def attach(self, name: str, tensors: list[Any]) -> Any:
        import tensorflow as tf

        def mark(*_: Any) -> np.ndarray:
            self.times[name] = now_us()
            return np.int32(0)

        return tf.numpy_function(mark, tensors, tf.int32, stateful=False, name=f"hostreduce_mark_{name}")

    def seed(self, name: str, loss: Any) -> Any:
        """Ones like ``loss``, made by an op that marks ``name`` when ``loss`` is ready
        (a gradient seed that no graph optimization can fold into a constant)."""
        import tensorflow as tf

        def mark(value: np.ndarray) -> np.ndarray:
            self.times[name] = now_us()
            return np.ones_like(value)

        ones = tf.numpy_function(mark, [loss], loss.dtype, stateful=False, name=f"hostreduce_mark_{name}")
        ones.set_shape(loss.shape)
        return ones


class ProgramBase:
    mode: str = ""

    def __init__(self, model_fn: Callable[..., Any], params: Any, config: Any, store: VariableStore,
                 element_spec: Any, timeline: Timeline) -> None:
        self.model_fn, self.params, self.config, self.store = model_fn, params, config, store
        self.timeline = timeline
        self.signature = relaxed_signature(element_spec)
        self.has_labels = self.signature[1] is not None
        self.spec: EstimatorSpec | None = None
        self.feeder: Callable[..., None] | None = None  # with ps: fills the row caches a batch reads
        self._concrete_step: tuple[Any, Any] | None = None  # (self.function, its concrete function)
        self._lookups: Callable[..., Any] | None = None

    def _call_model_fn(self, features: Any, labels: Any) -> EstimatorSpec:
        strategy = getattr(self, "strategy", None)
        with tf1_optimizer_scope(MODEL_FN, workers=strategy.size if strategy is not None else 1) as seen:
            value = call_model_fn(self.model_fn, features, labels, self.mode, self.params, self.config)
        spec = _as_spec(value, self.mode)
        if seen.host_call is not None and spec.host_call is None:
            # model_fn's own minimize/apply_gradients, with several workers: run on the host
            spec = spec._replace(host_call=seen.host_call)
        self.spec = spec
        return spec

    def _trace(self, fn: Callable[..., Any]) -> Any:
        import tensorflow as tf

        if self.has_labels:
            function = tf.function(fn, input_signature=list(self.signature), autograph=False)
        else:
            function = tf.function(lambda features: fn(features, None), input_signature=[self.signature[0]],
                                   autograph=False)
        concrete = function.get_concrete_function()  # traces model_fn, creates and initializes variables
        self.store.adopt(concrete.variables)
        return function

    def call(self, features: Any, labels: Any) -> Any:
        if self.feeder is not None:
            self.feeder(self, features, labels)
        # The one concrete function of the input signature, called directly: the
        # tf.function's dispatch costs about as much again per step.
        step = self._concrete_step
        if step is None or step[0] is not self.function:
            step = self._concrete_step = (self.function, self.function.get_concrete_function())
        return step[1](features, labels) if self.has_labels else step[1](features)

    def lookups(self, caches: list[Any]) -> Callable[..., Any]:
        """A function of a batch (``features`` then ``labels``, flattened) to the global ids
        this mode's ``model_fn`` looks up in each of ``caches`` (``lookups<j>``). Traced
        as a TF1-style graph and pruned to those ids, so nothing else of the step runs
        (``tf.function`` would run every variable update in it, metrics' included)."""
        if self._lookups is None:
            import tensorflow as tf

            def lookups(features: Any, labels: Any = None) -> dict[str, Any]:
                for cache in caches:
                    cache.looked_up = []
                spec = self.spec
                with self.store.scope():
                    self._call_model_fn(features, labels)
                self.spec = spec  # the metrics of the step's own trace stay the ones read
                return {f"lookups{j}": tf.concat([tf.reshape(i, [-1]) for i in c.looked_up], axis=0)
                        if c.looked_up else tf.zeros([0], tf.int64) for j, c in enumerate(caches)}

            signature = list(self.signature) if self.has_labels else [self.signature[0]]
            wrapped = tf.compat.v1.wrap_function(lookups, signature=signature)
            feeds = wrapped.inputs[:len(tf.nest.flatten(signature))]
            pruned = wrapped.prune(feeds=feeds, fetches=wrapped.structured_outputs)
            self._lookups = lambda features, labels: pruned(
                *tf.nest.flatten([features, labels] if self.has_labels else [features]))
        return self._lookups


    def hook_graph(self, begin: Callable[[Any], None]) -> tuple[Any, list[Any]]:
        """``model_fn`` traced once more, as a TF1-style graph (``tf.compat.v1.wrap_function``)
        where nothing runs unless it is fetched, for ``SessionRunHook`` objects: they build
        their ops there (``begin(graph)`` is called at the end of the trace, the graph
        the default one) and fetch what they like of it. Returns the wrapped function
        (``prune`` it to fetches) and its inputs: ``features`` then ``labels``, flattened."""
        import tensorflow as tf

        def trace(features: Any, labels: Any = None) -> dict[str, Any]:
            spec = self.spec
            with self.store.scope(), tf.GradientTape() as tape, recording(tape):
                self._call_model_fn(features, labels)
            self.spec = spec  # the step's own trace stays the one read
            begin(tf.compat.v1.get_default_graph())
            return {}

        signature = list(self.signature) if self.has_labels else [self.signature[0]]
        wrapped = tf.compat.v1.wrap_function(trace, signature=signature)
        return wrapped, list(wrapped.inputs[:len(tf.nest.flatten(signature))])

    def flat_inputs(self, features: Any, labels: Any) -> list[Any]:
        """A batch as :meth:`hook_graph`'s inputs take it."""
        import tensorflow as tf

        return tf.nest.flatten([features, labels] if self.has_labels else [features])

    def empty_batch(self) -> tuple[Any, Any]:
        """(features, labels) with zero examples (the batch dimension 0)."""
        import tensorflow as tf

        def empty(spec: Any) -> Any:
            return tf.zeros([0 if d is None else d for d in spec.shape.as_list()], spec.dtype)

        features = tf.nest.map_structure(empty, self.signature[0])
        labels = None if self.signature[1] is None else tf.nest.map_structure(empty, self.signature[1])
        return features, labels


class TrainProgram(ProgramBase):
    """Forward and backward on the device with streaming hand-off; then the host step.

    Args:
        strategy: supplies the reducer and the submission-order requirement.
        fused_apply: route Keras SGD/Adam updates inside ``host_call`` to fused kernels.
        stream_gradients: start each reduction as its gradient is produced (False:
            all of them after the backward pass).
        host_apply: ``"per_gradient"``: the host program waits for each reduction in
            its own op, so each variable's update runs as soon as its gradient is
            reduced, while the other reductions go on; ``"once"``: wait for all, then
            run ``host_call`` once.
    """

    mode = ModeKeys.TRAIN

    def __init__(self, *args: Any, strategy: Any, fused_apply: bool = True, stream_gradients: bool = True,
                 host_apply: str = "per_gradient") -> None:
        super().__init__(*args)
        self.strategy = strategy
        self.fused_apply = fused_apply
        self.stream_gradients = stream_gradients
        self.per_gradient = host_apply == "per_gradient"
        self.exchange: HostCallExchange | None = None
        self.host_function: Any = None
        self._host_concrete: Any = None
        self._host_fn: Callable[..., Any] | None = None
        self._marker = _Marker()
        self.function = self._trace(self._step)
        if self.exchange is not None:
            self.host_function = self._trace_host()

    def _step(self, features: Any, labels: Any) -> dict[str, Any]:
        import tensorflow as tf

        outputs: dict[str, Any] = {}
        timed = self.timeline.enabled
        if timed:
            outputs["mark_start"] = self._marker.attach("start", tf.nest.flatten(features)[:1])
        marked: list[Any] = []

        def loss_ready(loss: Any) -> Any:
            marked.append(self._marker.seed("forward", tf.convert_to_tensor(loss)))
            return marked[-1]

        with self.store.scope(), tf.GradientTape() as tape, recording(tape, loss_ready if timed else None):
            spec = self._call_model_fn(features, labels)
            labels_by_id = gradient_labels()
        outputs["loss"] = tf.convert_to_tensor(spec.loss)
        if spec.train_op is not None:
            outputs["train_op"] = as_output(spec.train_op)
        if timed and not marked:  # gradients from the model_fn's own tape: mark the loss alone
            outputs["mark_forward"] = self._marker.attach("forward", [outputs["loss"]])
        if spec.host_call is None:
            if self.strategy.size > 1:
                raise SpecError(
                    "EstimatorSpec in mode 'train' needs `host_call` when training with several workers, "
                    "so the gradients can be averaged across them. Received: host_call=None"
                )
            return outputs
        fn, tensors = check_host_call(spec.host_call)
        tensors = [tf.convert_to_tensor(t) for t in tensors]
        self._host_fn = fn
        if self.exchange is None:
            self.exchange = HostCallExchange(
                "hostreduce.grad", [(tuple(t.shape.as_list()), t.dtype.as_numpy_dtype) for t in tensors],
                lambda: self.strategy.reducer, ordered=self.strategy.ordered_submission, timeline=self.timeline,
                labels=[labels_by_id.get(id(t), f"tensor{i}") for i, t in enumerate(tensors)],
                defer=not self.stream_gradients,
            )
        elif len(self.exchange) != len(tensors):
            raise SpecError(f"`host_call` changed from {len(self.exchange)} to {len(tensors)} tensors between traces")
        for t in tensors:
            if not t.shape.is_fully_defined():
                raise SpecError(f"`host_call` tensors must have a fully defined shape. Received: shape {t.shape}")
        outputs["handoff"] = self.exchange.attach(tensors)
        if timed:
            outputs["mark_backward"] = self._marker.attach("backward", tensors)
        return outputs

    def _trace_host(self) -> Any:
        import tensorflow as tf

        assert self.exchange is not None
        exchange = self.exchange
        specs = [tf.TensorSpec(b.shape, tf.as_dtype(b.dtype)) for b in exchange.buffers]
        device = tf.device("/CPU:0") if self.strategy.variables_on_host else contextlib.nullcontext()

        def host_step(*tensors: Any) -> Any:
            if self.per_gradient:
                tensors = tuple(exchange.wait_ops())
            with device, self.store.scope(), fused_optimizer_scope(self.fused_apply), tf1_optimizer_scope(HOST_CALL):
                self._host_fn(*tensors)  # type: ignore[misc]
            return tf.constant(0)

        function = tf.function(host_step, input_signature=[] if self.per_gradient else specs, autograph=False)
        concrete = function.get_concrete_function()
        self.store.adopt(concrete.variables)
        self._host_concrete = concrete  # called directly, without the tf.function's dispatch
        return function

    def run(self, features: Any, labels: Any, timeout: float | None = None) -> float:
        """One training step; returns this worker's loss."""
        timeline = self.timeline
        start = now_us()
        outputs = self.call(features, labels)
        end_device = now_us()
        if timeline.enabled:
            times = self._marker.times
            t0 = times.get("start", start)
            timeline.span("forward", t0, times.get("forward", end_device), "compute")
            timeline.span("backward", times.get("forward", end_device), times.get("backward", end_device), "compute")
        exchange = self.exchange
        if exchange is not None and self.per_gradient:
            exchange.start_deferred()
            exchange.timeout, exchange.failure = timeout, None
            with timeline.scope("wait and apply (per gradient)", "apply"):
                try:
                    self._host_concrete()
                except Exception:
                    if exchange.failure is not None:  # the hostreduce error, not TensorFlow's wrapper
                        raise exchange.failure from None
                    raise
        elif exchange is not None:
            with timeline.scope("wait for reductions", "reduce"):
                buffers = exchange.wait(timeout)
            with timeline.scope("host apply", "apply"):
                self._host_concrete(*buffers)
        return float(outputs["loss"])


class EvalProgram(ProgramBase):
    """Loss and metrics of one batch; Keras metric objects accumulate in their state."""

    mode = ModeKeys.EVAL

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.function = self._trace(self._step)

    def _step(self, features: Any, labels: Any) -> dict[str, Any]:
        import tensorflow as tf

        with self.store.scope():
            spec = self._call_model_fn(features, labels)
        outputs = {"loss": tf.convert_to_tensor(spec.loss)}
        for name, metric in (spec.eval_metric_ops or {}).items():
            if _is_keras_metric(metric):
                continue
            if isinstance(metric, (tuple, list)):  # TF1 (value, update_op): value after the update
                with tf.control_dependencies([metric[1]]):
                    outputs[f"metric/{name}"] = tf.identity(metric[0])
            else:
                outputs[f"metric/{name}"] = tf.convert_to_tensor(metric)
        return outputs

    def keras_metrics(self) -> dict[str, Any]:
        ops = (self.spec.eval_metric_ops or {}) if self.spec is not None else {}
        return {k: m for k, m in ops.items() if _is_keras_metric(m)}

    def tensor_metric_names(self) -> list[str]:
        ops = (self.spec.eval_metric_ops or {}) if self.spec is not None else {}
        return [k for k, m in ops.items() if not _is_keras_metric(m)]

    def streaming_metric_names(self) -> list[str]:
        """Names of TF1 ``(value, update_op)`` metrics: their value is a function of
        state accumulated over the evaluation, not a per-batch number to average."""
        ops = (self.spec.eval_metric_ops or {}) if self.spec is not None else {}
        return [k for k, m in ops.items() if not _is_keras_metric(m) and isinstance(m, (tuple, list))]



class PredictProgram(ProgramBase):
    mode = ModeKeys.PREDICT

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.function = self._trace(self._step)

    def _step(self, features: Any, labels: Any) -> Any:
        with self.store.scope():
            spec = self._call_model_fn(features, labels)
        return spec.predictions


def as_output(value: Any) -> Any:
    """A tensor that ``tf.function`` can return and that runs ``value`` (an op or tensor)."""
    import tensorflow as tf

    if isinstance(value, tf.Operation):
        with tf.control_dependencies([value]):
            return tf.constant(0)
    return value


def _is_keras_metric(value: Any) -> bool:
    return hasattr(value, "update_state") and hasattr(value, "result") and hasattr(value, "reset_state")
