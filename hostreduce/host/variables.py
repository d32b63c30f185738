"""One set of variables shared by every trace of ``model_fn``, placed on the host.

``model_fn`` builds its Keras layers and optimizer each time it is called (once per
mode, and again whenever ``tf.function`` retraces). Inside :meth:`VariableStore.scope`
every variable creation is answered with the variable created by the first call that
asked for the same thing, so all modes and traces train one model. A request is
identified by its name scope with Keras/TensorFlow uniquifying suffixes removed
(``dense_3`` -> ``dense``), its shape and dtype, and how many identical requests came
before it in the same call.

A layer above may take over the creation of some variables (:meth:`VariableStore.set_factory`):
with parameter servers, a table the ps shard by rows is created as a row cache
(``hostreduce.ps_training.rowcache``) that holds the rows of the batch only.
"""
from __future__ import annotations

import contextlib
import re
from typing import Any, Callable, ContextManager, Iterator, Protocol

from ..errors import SpecError

__all__ = ["VariableStore", "VariableFactory", "Deferred", "canonical_name", "requested_shape", "LOCAL_COLLECTIONS"]

# tf.compat.v1.GraphKeys.LOCAL_VARIABLES and METRIC_VARIABLES.
LOCAL_COLLECTIONS = {"local_variables", "metric_variables"}
# Uniquifying counters: ``dense_3`` -> ``dense``, ``sequential_1_dense_2_kernel`` ->
# ``sequential_dense_kernel`` (Keras names optimizer slots after the variable's path).
_SUFFIX = re.compile(r"(_\d+)+(?=/|_|$)")


def canonical_name(name: str) -> str:
    """``name`` without its ``:0`` output index and uniquifying suffixes."""
    name = name.split(":")[0]
    return _SUFFIX.sub("", name)


class Deferred:
    """An initial value not computed yet: ``shape``/``dtype`` known, ``()`` computes it."""

    def __init__(self, compute: Callable[[], Any], shape: Any, dtype: Any) -> None:
        self.compute, self.shape, self.dtype = compute, shape, dtype

    def __call__(self) -> Any:
        return self.compute()


class VariableFactory(Protocol):
    """Creates some of a store's variables itself (see :meth:`VariableStore.set_factory`)."""

    def scope(self) -> ContextManager[Any]:
        """Entered around every :meth:`VariableStore.scope`."""

    def create(self, key: str, kwargs: dict[str, Any]) -> tuple[Any, list[Any]] | None:
        """``(variable, helper variables)`` for the creation request ``kwargs`` (the
        arguments of ``tf.Variable``) of ``key``, or None to let the store create it."""


class VariableStore:
    """Variables keyed by canonical name, shared across calls of ``model_fn``.

    Args:
        on_host: create new variables on ``/CPU:0`` (the ops that read them still run
            on the default device).
    """

    def __init__(self, on_host: bool = True) -> None:
        self.on_host = on_host
        self._vars: dict[str, Any] = {}
        self._order: list[str] = []
        self._counts: dict[str, int] = {}
        self._synced: set[str] = set()
        self._local: set[str] = set()
        self._internal: set[int] = set()  # ids of helper variables (a row cache's keys)
        self._factory: VariableFactory | None = None
        self._made: set[str] = set()
        self._reader: tuple[tuple[Any, ...], Any] | None = None  # (variables' ids, a function reading them)

    def set_factory(self, factory: VariableFactory | None) -> None:
        """Let ``factory`` create the new variables it wants to (the others are created
        as usual)."""
        self._factory = factory

    def made_by_factory(self) -> dict[str, Any]:
        """The variables the factory created, by key, in creation order."""
        return {k: v for k, v in self.items() if k in self._made}

    def __len__(self) -> int:
        return len(self._order)

    def items(self) -> list[tuple[str, Any]]:
        """(key, tf.Variable) pairs in creation order."""
        return [(k, self._vars[k]) for k in self._order]

    def values(self, keys: list[str]) -> list[Any]:
        """The values of the variables ``keys`` as NumPy arrays (see :meth:`tensors`)."""
        return [t.numpy() for t in self.tensors(keys)]

    def tensors(self, keys: list[str]) -> list[Any]:
        """The values of the variables ``keys``, read in one call (reading them one by
        one costs a dispatch each: a millisecond for a small model's dozens on a busy
        host, in the step of every checkpoint), as tensors. A tensor read from a
        variable keeps the value it was read with: TensorFlow copies a variable's buffer
        before an update while a tensor read from it lives."""
        import tensorflow as tf

        variables = [self._vars[k] for k in keys]
        if not variables:
            return []
        ids = tuple(id(v) for v in variables)  # (the cache holds them: no id is reused meanwhile)
        if self._reader is None or self._reader[0] != ids:
            # The first read of a set goes one by one: tracing the function costs more
            # than one read (tens of ms), which only a second read of the same set repays.
            self._reader = (ids, variables)
            return [v.read_value() for v in variables]
        if isinstance(self._reader[1], list):
            self._reader = (ids, tf.function(lambda: [v.read_value() for v in variables], autograph=False))
        return list(self._reader[1]())

    def key_of(self, variable: Any) -> str | None:
        target = getattr(variable, "_value", variable)
        for key in self._order:
            if self._vars[key] is target:
                return key
        return None

    def adopt(self, variables: Any) -> None:
        """Track variables created outside :meth:`scope` (e.g. a Keras model built before
        ``model_fn`` runs) so they are broadcast and checkpointed too."""
        known = {id(v) for v in self._vars.values()}
        for variable in variables:
            variable = getattr(variable, "_value", variable)
            if id(variable) in known or id(variable) in self._internal:
                continue
            base = "external/" + canonical_name(getattr(variable, "name", "Variable"))
            key, index = base, 0
            while key in self._vars:
                index += 1
                key = f"{base}#{index}"
            self._vars[key] = variable
            self._order.append(key)
            known.add(id(variable))

    def local_keys(self) -> set[str]:
        """Keys of local variables (TF1 ``tf.compat.v1.metrics`` state, anything created
        in the ``local_variables`` collection): per-worker, neither broadcast nor saved."""
        return set(self._local)

    def unsynced(self) -> list[tuple[str, Any]]:
        """Variables created since the last :meth:`mark_synced` (creation order)."""
        return [(k, self._vars[k]) for k in self._order if k not in self._synced]

    def mark_synced(self, keys: Any) -> None:
        self._synced.update(keys)

    @contextlib.contextmanager
    def scope(self) -> Iterator["VariableStore"]:
        """Route every ``tf.Variable`` creation in this block through the store."""
        import tensorflow as tf

        self._counts = {}
        with contextlib.ExitStack() as stack:
            if self._factory is not None:
                stack.enter_context(self._factory.scope())
            stack.enter_context(tf.variable_creator_scope(self._creator))
            yield self

    def _creator(self, next_creator: Any, **kwargs: Any) -> Any:
        import tensorflow as tf

        scope = tf.get_current_name_scope()
        name = kwargs.get("name") or "Variable"
        base = canonical_name(f"{scope}/{name}" if scope else str(name))
        index = self._counts.get(base, 0)
        self._counts[base] = index + 1
        key = base if index == 0 else f"{base}#{index}"
        existing = self._vars.get(key)
        if existing is not None:
            shape = requested_shape(kwargs)
            if shape is not None and not shape.is_compatible_with(existing.shape):
                raise SpecError(
                    f"`model_fn` must create the same variables in every call. Variable {key!r} was created "
                    f"with shape {existing.shape} and is now requested with shape {shape}"
                )
            return existing
        made = None if self._factory is None else self._factory.create(key, kwargs)
        if made is not None:
            variable, helpers = made
            self._vars[key] = variable
            self._order.append(key)
            self._made.add(key)
            self._internal.update(id(h) for h in helpers)
            return variable
        if self.on_host:
            with tf.device("/CPU:0"):
                variable = next_creator(**kwargs)
        else:
            variable = next_creator(**kwargs)
        self._vars[key] = variable
        self._order.append(key)
        if set(kwargs.get("collections") or ()) & LOCAL_COLLECTIONS:
            self._local.add(key)
        return variable


def requested_shape(kwargs: dict[str, Any]) -> Any:
    """The ``tf.TensorShape`` a ``tf.Variable`` creation request asks for, or None."""
    import tensorflow as tf

    shape = kwargs.get("shape")
    if shape is None:
        value = kwargs.get("initial_value")
        shape = getattr(value, "shape", None) if not callable(value) or isinstance(value, Deferred) else None
    return None if shape is None else tf.TensorShape(shape)
