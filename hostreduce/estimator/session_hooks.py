"""TensorFlow ``SessionRunHook`` objects (``tf.compat.v1.train.LoggingTensorHook``,
``hvd.BroadcastGlobalVariablesHook``, ...) in :meth:`Estimator.train`.

A hook expects a TF1 graph holding the model, where it builds its ops in ``begin()``,
and a session that runs what it fetches. The Estimator's training step is a
``tf.function``, which runs every stateful op traced into it at every step, so hooks
get a graph of their own: ``model_fn`` traced once more in training mode as a TF1-style
graph, in which nothing runs unless it is fetched (``ProgramBase.hook_graph``). Its
``GLOBAL_VARIABLES`` collection holds the Estimator's variables (model, optimizer,
``global_step``; not evaluation metrics) and ``GLOBAL_STEP`` the step (the
``global_step`` variable's value where ``model_fn`` made one, else the Estimator's own
count), as a ``tf.estimator`` graph did. :class:`HookSession` runs fetches of that
graph by pruning it to them.

The calls come in ``tf.estimator``'s order, each with the hook graph as the default
graph: ``begin()`` once the variables exist and hold their restored values;
``after_create_session(session, coord)`` (``coord`` is None); per step
``before_run(run_context)`` then ``after_run(run_context, run_values)``; ``end(session)``
when training ends. What the hooks fetch in ``before_run`` is computed on the step's
batch with the variables as they are before the step's update (as in one TF1
``session.run`` with the train op), by one run of the hook graph: a forward pass of its
own where a fetch needs the batch, only on the steps where a hook fetches something.
``run_context.request_stop()`` ends training after the step; with several workers,
when any worker's hooks ask.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from ..errors import ConfigError, SpecError

__all__ = ["HookSession", "SessionHooks", "is_session_hook", "split_hooks"]

_METHODS = ("begin", "after_create_session", "before_run", "after_run", "end")


def is_session_hook(hook: Any) -> bool:
    """Whether ``hook`` is a ``SessionRunHook``-like object (it has the five methods)."""
    return all(callable(getattr(hook, m, None)) for m in _METHODS)


def split_hooks(hooks: Any) -> tuple[list[Any], list[Any]]:
    """``(callables, session hooks)`` of ``train(hooks=...)``."""
    if hooks is None:
        return [], []
    if not isinstance(hooks, (list, tuple)):
        raise ConfigError(f"`hooks` must be a list of hooks or None. Received: hooks of type {type(hooks).__name__}")
    plain, session = [], []
    for i, hook in enumerate(hooks):
        if is_session_hook(hook):
            session.append(hook)
        elif callable(hook):
            plain.append(hook)
        else:
            raise ConfigError(
                "`hooks` must hold SessionRunHook objects (begin, after_create_session, before_run, after_run, "
                f"end) or callables hook(global_step, loss). Received: hooks[{i}]={hook!r:.100}"
            )
    return plain, session


class HookSession:
    """What hooks get as ``session``: ``run(fetches)`` over the hook graph.

    Args:
        wrapped: the hook graph (``tf.compat.v1.wrap_function``).
        inputs: its input placeholders (the batch, flattened).
        batch: the batch fed by ``run`` outside a step: the flattened inputs.
    """

    def __init__(self, wrapped: Any, inputs: Sequence[Any], batch: Sequence[Any]) -> None:
        self._wrapped = wrapped
        self._inputs = list(inputs)
        self._pruned: dict[tuple[str, ...], Any] = {}
        self._reads: dict[int, Any] = {}
        self.batch = list(batch)

    @property
    def graph(self) -> Any:
        return self._wrapped.graph

    def run(self, fetches: Any, feed_dict: Any = None, options: Any = None, run_metadata: Any = None) -> Any:
        """Run ``fetches`` (tensors, ops or their names, variables, in any nest of lists,
        tuples and dicts) of the hook graph on the current batch; ops give None."""
        if feed_dict:
            raise SpecError("Hooks in hostreduce's Estimator cannot feed tensors: the batch comes from `input_fn`. "
                            f"Received: feed_dict with {len(feed_dict)} entries")
        return self.fetch(fetches, self.batch)

    def fetch(self, fetches: Any, batch: Sequence[Any]) -> Any:
        import tensorflow as tf

        flat = [self._element(f) for f in tf.nest.flatten(fetches)]
        if not flat:
            return fetches
        key = tuple(e.name for e in flat)
        with tf.init_scope():  # run eagerly, also when a hook calls with the hook graph as default
            pruned = self._pruned.get(key)
            if pruned is None:
                pruned = self._pruned[key] = self._wrapped.prune(feeds=self._inputs, fetches=flat)
            values = pruned(*batch)
        values = [None if v is None else v.numpy() for v in values]
        return tf.nest.pack_sequence_as(fetches, values)


    def _element(self, fetch: Any) -> Any:
        """The hook graph's tensor or op for ``fetch``; a variable (made outside the
        graph) is read in it."""
        import tensorflow as tf

        graph = self.graph
        if isinstance(fetch, tf.Variable) or hasattr(fetch, "read_value") and not isinstance(fetch, str):
            read = self._reads.get(id(fetch))
            if read is None:
                with graph.as_default():
                    read = self._reads[id(fetch)] = tf.identity(fetch.read_value())
            return read
        return graph.as_graph_element(fetch)


class SessionHooks:
    """The ``SessionRunHook`` objects of one ``train`` call, called in their order.

    Args:
        hooks: the hooks.
        program: the training program (``hook_graph``, ``flat_inputs``, ``empty_batch``).
        variables: the Estimator's variables (the hook graph's global variables).
        global_step: the ``global_step`` variable, or None.
        step: the Estimator's step count (the global step without that variable).
    """

    def __init__(self, hooks: Sequence[Any], program: Any, variables: Sequence[Any], global_step: Any,
                 step: Callable[[], int]) -> None:
        import tensorflow as tf

        self.hooks = list(hooks)
        self._program = program

        def begin(graph: Any) -> None:
            keys = tf.compat.v1.GraphKeys
            del graph.get_collection_ref(keys.GLOBAL_VARIABLES)[:]
            for variable in variables:
                graph.add_to_collection(keys.GLOBAL_VARIABLES, variable)
            if not graph.get_collection(keys.GLOBAL_STEP):
                # Its value read in this graph: TensorFlow's hooks build ops on the
                # collection's entry (``training_util``), which a variable made outside
                # the graph cannot give them. Without a ``global_step`` variable, the
                # Estimator's own count.
                if global_step is not None:
                    value = tf.identity(global_step.read_value(), name="global_step")
                else:
                    value = tf.numpy_function(lambda: np.int64(step()), [], tf.int64, stateful=True,
                                              name="global_step")
                    value.set_shape([])
                graph.add_to_collection(keys.GLOBAL_STEP, value)
            for hook in self.hooks:
                hook.begin()

        wrapped, inputs = program.hook_graph(begin)
        self.session = HookSession(wrapped, inputs, program.flat_inputs(*program.empty_batch()))
        with self.session.graph.as_default():
            for hook in self.hooks:
                hook.after_create_session(self.session, None)

    def before_run(self, features: Any, labels: Any) -> tuple[Any, list[Any]]:
        """Ask every hook for its fetches and compute them on this batch, before the step."""
        import tensorflow as tf

        train = tf.compat.v1.train
        context = train.SessionRunContext(original_args=train.SessionRunArgs(None), session=self.session)
        self.session.batch = self._program.flat_inputs(features, labels)
        asked: dict[int, Any] = {}
        with self.session.graph.as_default():
            for i, hook in enumerate(self.hooks):
                args = hook.before_run(context)
                if args is None or args.fetches is None:
                    continue
                if args.feed_dict:
                    raise SpecError("Hooks in hostreduce's Estimator cannot feed tensors: the batch comes from "
                                    f"`input_fn`. Received: {type(hook).__name__}.before_run returned a feed_dict")
                asked[i] = args.fetches
            fetched = self.session.fetch(asked, self.session.batch) if asked else {}  # one run for all hooks
        return context, [fetched.get(i) for i in range(len(self.hooks))]

    def after_run(self, context: Any, results: list[Any]) -> bool:
        """Give every hook its results; whether one asked to stop."""
        import tensorflow as tf

        with self.session.graph.as_default():
            for hook, result in zip(self.hooks, results):
                values = tf.compat.v1.train.SessionRunValues(results=result, options=tf.compat.v1.RunOptions(),
                                                             run_metadata=tf.compat.v1.RunMetadata())
                hook.after_run(context, values)
        return bool(context.stop_requested)

    def end(self) -> None:
        with self.session.graph.as_default():
            for hook in self.hooks:
                hook.end(self.session)
