"""One set of variables shared by every trace of ``model_fn``, placed on the host.

``model_fn`` builds its Keras layers and optimizer each time it is called (once per
mode, and again whenever ``tf.function`` retraces). Inside :meth:`VariableStore.scope`
every variable creation is answered with the variable created by the first call that
asked for the same thing, so all modes and traces train one model. A request is
identified by its name scope with Keras/TensorFlow uniquifying suffixes removed
(``dense_3`` -> ``dense``), its shape and dtype, and how many identical requests came
before it in the same call.

With parameter servers (:meth:`VariableStore.shard_tables`) a table the ps will shard by
rows is created as a :class:`~hostreduce.ps_training.rowcache.RowCache` instead: the worker
holds the rows of its batch only, and the table's initial value stays uncomputed until
the chief registers it on the ps.
"""
from __future__ import annotations

import contextlib
import re
from typing import Any, Iterator

from ..errors import SpecError

__all__ = ["VariableStore"]

# tf.compat.v1.GraphKeys.LOCAL_VARIABLES and METRIC_VARIABLES.
_LOCAL_COLLECTIONS = {"local_variables", "metric_variables"}
# Uniquifying counters: ``dense_3`` -> ``dense``, ``sequential_1_dense_2_kernel`` ->
# ``sequential_dense_kernel`` (Keras names optimizer slots after the variable's path).
_SUFFIX = re.compile(r"(_\d+)+(?=/|_|$)")


def _canonical(name: str) -> str:
    name = name.split(":")[0]
    return _SUFFIX.sub("", name)


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
        self._shard: tuple[int, int] | None = None

    def shard_tables(self, num_ps: int, shard_bytes: int) -> None:
        """Create every new variable the ps would shard over ``num_ps`` (``shard_bytes``,
        see ``hostreduce.ps.placement``) as a row cache."""
        self._shard = (num_ps, shard_bytes)

    def row_caches(self) -> dict[str, Any]:
        """The row caches by key (tables the ps hold; this process has only some rows)."""
        from ..ps_training.rowcache import is_row_cache

        return {k: v for k, v in self.items() if is_row_cache(v)}

    def __len__(self) -> int:
        return len(self._order)

    def items(self) -> list[tuple[str, Any]]:
        """(key, tf.Variable) pairs in creation order."""
        return [(k, self._vars[k]) for k in self._order]

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
            base = "external/" + _canonical(getattr(variable, "name", "Variable"))
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
            if self._shard is not None:
                from ..ps_training.rowcache import deferred_keras_init

                stack.enter_context(deferred_keras_init())
            stack.enter_context(tf.variable_creator_scope(self._creator))
            yield self

    def _creator(self, next_creator: Any, **kwargs: Any) -> Any:
        import tensorflow as tf

        scope = tf.get_current_name_scope()
        name = kwargs.get("name") or "Variable"
        base = _canonical(f"{scope}/{name}" if scope else str(name))
        index = self._counts.get(base, 0)
        self._counts[base] = index + 1
        key = base if index == 0 else f"{base}#{index}"
        existing = self._vars.get(key)
        if existing is not None:
            shape = _requested_shape(kwargs)
            if shape is not None and not shape.is_compatible_with(existing.shape):
                raise SpecError(
                    f"`model_fn` must create the same variables in every call. Variable {key!r} was created "
                    f"with shape {existing.shape} and is now requested with shape {shape}"
                )
            return existing
        cache = self._maybe_row_cache(key, kwargs)
        if cache is not None:
            self._vars[key] = cache
            self._order.append(key)
            self._internal.add(id(cache.keys))
            return cache
        if self.on_host:
            with tf.device("/CPU:0"):
                variable = next_creator(**kwargs)
        else:
            variable = next_creator(**kwargs)
        self._vars[key] = variable
        self._order.append(key)
        if set(kwargs.get("collections") or ()) & _LOCAL_COLLECTIONS:
            self._local.add(key)
        return variable


    def _maybe_row_cache(self, key: str, kwargs: dict[str, Any]) -> Any:
        """A row cache for a table the ps will shard, else None."""
        import tensorflow as tf

        from ..ps.placement import is_sharded
        from ..ps_training.rowcache import row_cache

        # Only trained variables are on the ps; a frozen table stays whole on the worker.
        if (self._shard is None or kwargs.get("trainable") is False
                or set(kwargs.get("collections") or ()) & _LOCAL_COLLECTIONS):
            return None
        shape = _requested_shape(kwargs)
        value = kwargs.get("initial_value")
        dtype = kwargs.get("dtype") or getattr(value, "dtype", None)
        if shape is None or not shape.is_fully_defined() or dtype is None:
            return None
        dtype = tf.as_dtype(dtype)
        if not dtype.is_floating or not is_sharded(shape.as_list(), dtype.size, *self._shard):
            return None
        # A callable initial value (Keras's Deferred, tf_keras's and tf.compat.v1's
        # initializers) is computed later, on the chief only.
        return row_cache(tuple(shape.as_list()), dtype.base_dtype, value, key.replace("/", "_"))


def _requested_shape(kwargs: dict[str, Any]) -> Any:
    import tensorflow as tf

    from ..ps_training.rowcache import Deferred

    shape = kwargs.get("shape")
    if shape is None:
        value = kwargs.get("initial_value")
        shape = getattr(value, "shape", None) if not callable(value) or isinstance(value, Deferred) else None
    return None if shape is None else tf.TensorShape(shape)
