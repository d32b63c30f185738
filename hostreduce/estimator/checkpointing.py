"""The checkpoint side of an Estimator's training: when to save, what every worker
contributes (its input position), and restoring variables and positions on resume.

The files themselves (format, atomic writes, names) are ``checkpoint.py``'s; this
module decides the collectives around them. Every worker takes the same decisions at
the same steps, the chief's settings and clock deciding, so a worker without a
``model_dir`` still takes part in every save.

The chief writes in the background: a save reads the variables' values (a consistent
snapshot of the step, taken with every worker's input position at the same step: the
tensors read keep their values while training updates the variables) and returns, and
a writer thread writes the files while training goes on. The positions
travel to the chief beside training too: each worker serializes its iterator's state at
the step and starts an all-gather, which the chief's writer waits for and every worker
waits for at its next save or flush, so the step does not wait for the gather's round
trip (collectives queue behind it as behind any other). A save waits for the previous
write first, so at most one write is in flight and a checkpoint is on disk at the latest
when the next save starts. :meth:`Checkpointing.flush` waits for the write in flight:
``train()`` calls it before it returns (its last checkpoint is then on disk), as do
``close()`` and the readers of checkpoints. A write that fails raises
``CheckpointError`` at the next save or flush, and one still running after
``WRITE_TIMEOUT_S`` raises it there too; a gather that fails raises the reducer's error
there on every worker, and the chief writes that checkpoint without positions (with a
warning). A chief killed while a write is in flight loses that checkpoint only: the
write is atomic (``checkpoint.py``), so no part of it is ever taken for a checkpoint,
and a resumed run starts from the newest whole one. The writer thread is not a daemon: a
process that ends normally, even by an exception, finishes the write first (if the job's
reducer closed before the positions arrived, without them). With parameter servers the
chief's save stays synchronous, since their shards are written at the same point as the
chief's files.
"""
from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Mapping

import numpy as np

from ..errors import CheckpointError
from ..progress import logger, progress
from .checkpoint import CheckpointManager
from .input_state import InputNotCheckpointable, broadcast, pack, restore_iterator, save_iterator, start_gather, unpack

__all__ = ["Checkpointing", "with_ps_tables", "WRITE_TIMEOUT_S"]

Positions = dict[int, dict[str, bytes]]  # each rank's input position: {rank: {file suffix: contents}}

WRITE_TIMEOUT_S = 600.0  # the longest wait for a checkpoint being written before it counts as failed


def with_ps_tables(files: CheckpointManager, step: int, arrays: dict[str, np.ndarray], keys: list[str]
                   ) -> dict[str, np.ndarray]:
    """``arrays`` (a checkpoint's) and, for ``keys`` it lacks, the tables the ps shard by
    rows, read whole from the ps shards of ``step`` beside it (an evaluator, a job run
    without parameter servers from a ps job's checkpoint)."""
    from ..ps.checkpoint import load_tables
    from .ps_program import PS_DIR

    missing = [k for k in keys if k not in arrays]
    return {**arrays, **load_tables(os.path.join(files.model_dir, PS_DIR), step, missing)} if missing else arrays


class Checkpointing:
    """Saving and restoring for one Estimator.

    Args:
        strategy: the Estimator's strategy (rank, size, reducer).
        checkpoints: the chief's checkpoint files (None without a ``model_dir``).
        save_steps, save_secs: this worker's ``RunConfig`` settings (the chief's count).
    """

    def __init__(self, strategy: Any, checkpoints: CheckpointManager | None, save_steps: int | None,
                 save_secs: float | None) -> None:
        self._strategy = strategy
        self.files = checkpoints
        self._save_steps, self._save_secs = save_steps, save_secs
        self.chief_saves = False  # whether the chief writes checkpoints in this train() call
        self.iterator: Any = None  # train()'s input while it runs: checkpoints save its position
        self.ps: Any = None  # with parameter servers: saves their shards around the chief's checkpoint
        self._last_save = time.monotonic()
        self._input_warned = False
        self._writer: _Writer | None = None
        self._saved_step: int | None = None  # the step of this train()'s last save (policy() starts a train())
        self._gathering: Callable[[], Any] | None = None  # the last save's gather of input positions, until waited for

    # -- variables -----------------------------------------------------------------
    def restore_latest(self, variables: list[tuple[str, Any]]) -> int | None:
        """Assign ``variables`` their values in the latest checkpoint, where it has them
        (no collective); return its step, or None without a checkpoint."""
        self.flush()
        latest = self.files.latest() if self.files is not None else None
        if latest is None:
            return None
        if self._strategy.rank == 0 and self.files.repair_index():  # type: ignore[union-attr]
            logger.warning("TensorFlow's checkpoint index in %s named an older checkpoint than %s "
                           "(a crash between its write and the index's): it now names %s",
                           self.files.model_dir, latest[1], latest[1])  # type: ignore[union-attr]
        step, arrays, _ = self.files.load(latest[1])  # type: ignore[union-attr]
        arrays = with_ps_tables(self.files, step, arrays, [k for k, _ in variables])  # type: ignore[arg-type]
        restored = 0
        for key, var in variables:
            if key in arrays:
                var.assign(arrays[key])
                restored += 1
        if restored:
            progress("Restored %d variables from %s (step %d)", restored, latest[1], step)
        return step

    # -- when ----------------------------------------------------------------------
    def policy(self) -> tuple[int | None, float | None]:
        """The chief's ``(save_checkpoints_steps, save_checkpoints_secs)`` on every worker,
        and whether it checkpoints at all (``self.chief_saves``)."""
        strategy = self._strategy
        policy = np.array([self.files is not None, self._save_steps or 0, self._save_secs or 0], np.float64)
        if strategy.size > 1:
            policy = strategy.reducer.broadcast("hostreduce.ckpt.policy", policy, root=0)
        self.chief_saves = bool(policy[0])
        self._saved_step = None
        return int(policy[1]) or None, float(policy[2]) or None

    def due(self, step: int, save_every: int | None, save_secs: float | None) -> bool:
        if not self.chief_saves:
            return False
        if save_every and step % save_every == 0:
            return True
        if save_secs is None:
            return False
        due = time.monotonic() - self._last_save >= save_secs
        if self._strategy.size > 1:  # the chief's clock decides, for every worker
            due = bool(self._strategy.reducer.broadcast("hostreduce.ckpt.due", np.array([due], np.int32), root=0)[0])
        return due

    # -- saving --------------------------------------------------------------------
    def save(self, step: int, variables: Callable[[], Mapping[str, Any]], input_ended: bool = False) -> None:
        """Checkpoint ``step``: the chief writes ``variables()`` (tensors read from the
        variables, or NumPy arrays) and every worker's input position. Every worker
        calls this at the same steps (the positions are gathered to the chief, beside
        training: the previous save's gather is waited for here);
        ``input_ended``: the data ran out, so no position is saved and the next
        ``train`` starts ``input_fn``'s data anew."""
        if not self.chief_saves or step == self._saved_step:
            return  # (the end of train() right after a periodic save: every worker knows)
        self._last_save, self._saved_step = time.monotonic(), step
        self._wait_for_gather()
        self._gathering, inputs = self._start_gather(input_ended)
        if not self._strategy.is_chief:
            return
        files = self.files
        assert files is not None
        writer = self._writer
        if (writer is not None and writer.step == step) or files.find(step) is not None:
            # Written already (the end of train() at a step a periodic save wrote): the
            # files of a step are never rewritten, so neither are the ps shards beside
            # them, which must stay the same point as the chief's variables.
            return
        size, ended = self._strategy.size, input_ended

        def write(values: Mapping[str, np.ndarray], prune: bool) -> str:
            try:
                positions = inputs()
                state = "saved" if positions else ("ended" if ended else "not checkpointable")
            except Exception as exc:  # noqa: BLE001 - every rank's own wait raises it too
                # (the job failing, or ending by an exception, while the positions
                # travelled: the variables are still worth keeping)
                logger.warning("The input positions of step %d did not reach the chief (%s: %s): its checkpoint holds "
                               "the variables only, and a run resumed from it starts input_fn's data from its "
                               "beginning", step, type(exc).__name__, exc)
                positions, state = None, "not gathered"
            meta = {"world_size": size, "input": state}
            return files.save(step, values, meta, positions, prune=prune)

        if self.ps is not None:
            self.flush()
            self.ps.before_save(step)
            path = write(variables(), True)
            self.ps.after_save(step)
            progress("Saved checkpoint for step %d to %s", step, path)
            return
        # Tensors read from the variables keep the step's values (TensorFlow copies a
        # variable before updating it while such a tensor lives); arrays are copied.
        snapshot = {name: value if _is_tensor(value) else np.array(value, copy=True)
                    for name, value in variables().items()}
        if writer is None:
            writer = self._writer = _Writer()
        writer.submit(step, lambda: write(snapshot, False), files.prune)

    def flush(self) -> None:
        """Wait until the checkpoint being written is on disk and the old ones it
        pushed out are removed, and for this worker's part in the last save's gather
        of input positions; raise the write's error (``CheckpointError``) or the
        gather's."""
        if self._writer is not None:
            self._writer.wait(cleaned=True)
        self._wait_for_gather()

    def _wait_for_gather(self) -> None:
        gathering, self._gathering = self._gathering, None
        if gathering is not None:
            gathering()

    def _start_gather(self, input_ended: bool) -> tuple[Callable[[], Any], Callable[[], Positions | None]]:
        """Start gathering every worker's input position to the chief; return a function
        that waits for the gather (raising its error), and one that also returns the
        positions (None unless every worker has one; on the chief)."""
        blob = None
        if not input_ended and self.iterator is not None:
            try:
                blob = pack(save_iterator(self.iterator))
            except InputNotCheckpointable as exc:
                if not self._input_warned:
                    self._input_warned = True
                    logger.warning(
                        "The input of train() cannot be checkpointed (%s): checkpoints hold the variables only, and "
                        "a run resumed from them starts input_fn's data from its beginning. Datasets built with "
                        "from_generator, py_function or numpy_function keep their state outside TensorFlow", exc)
        strategy = self._strategy
        if strategy.size == 1:
            blobs: Callable[[], list[bytes | None]] = lambda: [blob]  # noqa: E731
        else:
            blobs = start_gather(strategy.reducer, blob, "hostreduce.ckpt.input")
        is_chief = strategy.is_chief

        def positions() -> Positions | None:
            found = blobs()
            if not is_chief or any(b is None for b in found):
                return None
            return {rank: unpack(b) for rank, b in enumerate(found)}  # type: ignore[arg-type]

        return blobs, positions

    # -- restoring the input ---------------------------------------------------------
    def restore_input(self, dataset: Any, iterator: Any, step: int) -> Any:
        """Each worker's iterator moved to its position in the checkpoint of ``step``,
        when that checkpoint holds every worker's position (else ``iterator``)."""
        strategy = self._strategy
        blobs: list[bytes | None] | None = None
        path = None
        if strategy.is_chief and self.chief_saves:
            path = self.files.find(step)  # type: ignore[union-attr]
            saved = self.files.load_inputs(path) if path else {}  # type: ignore[union-attr]
            if saved and sorted(saved) != list(range(strategy.size)):
                logger.warning("Checkpoint %s holds the input positions of ranks %s, not of this job's %d workers: "
                               "input_fn's data starts from its beginning", path, sorted(saved), strategy.size)
            elif saved:
                blobs = [pack(saved[rank]) for rank in range(strategy.size)]
        if strategy.size > 1 and self.chief_saves:
            blobs = broadcast(strategy.reducer, (blobs or [None] * strategy.size) if strategy.is_chief else None,
                              "hostreduce.ckpt.restore")
        own = blobs[strategy.rank] if blobs else None
        if own is None:
            return iterator
        try:
            restore_iterator(iterator, unpack(own))
        except Exception as exc:  # a different pipeline than the one saved
            logger.warning("The input position saved at step %d does not fit this input_fn's dataset (%s: %s): its "
                           "data starts from the beginning", step, type(exc).__name__,
                           str(exc).strip().splitlines()[0] if str(exc).strip() else "")
            return iter(dataset)
        if strategy.is_chief:
            progress("Restored the input position of %d worker(s) from %s", len(blobs or ()), path)
        return iterator


def _is_tensor(value: Any) -> bool:
    import tensorflow as tf

    return isinstance(value, tf.Tensor)


class _Writer:
    """One background thread writing checkpoints, one at a time (the same thread for
    every write: starting one per save cost the step up to a millisecond on a busy
    host). ``step`` is the step of the write in flight or last submitted. A write is
    done once its checkpoint is published (whole and indexed); the old checkpoints it
    pushes out are removed after that, beside the next write, and :meth:`wait` waits for
    that only with ``cleaned``. Like any thread's work, a write in flight when the
    script returns is finished before the process exits."""

    def __init__(self) -> None:
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="hostreduce-checkpoint")
        self.step: int | None = None
        self._done = threading.Event()
        self._done.set()
        self._cleaning: list[threading.Event] = []  # one per write whose clean-up may still run
        self._error: BaseException | None = None
        self._started = 0.0

    def submit(self, step: int, write: Callable[[], str], clean: Callable[[], None]) -> None:
        """Start ``write()`` and then ``clean()`` once the previous write is done
        (raising its error)."""
        self.wait()
        done, cleaned = threading.Event(), threading.Event()
        self.step, self._error, self._started, self._done = step, None, time.monotonic(), done
        self._cleaning = [e for e in self._cleaning if not e.is_set()] + [cleaned]
        self._thread.submit(self._run, step, write, clean, done, cleaned)

    def _run(self, step: int, write: Callable[[], str], clean: Callable[[], None], done: threading.Event,
             cleaned: threading.Event) -> None:
        try:
            try:
                path = write()
                progress("Saved checkpoint for step %d to %s (written in %.0f ms beside training)", step, path,
                         (time.monotonic() - self._started) * 1e3)
            except BaseException as exc:  # noqa: BLE001 - raised by the next save or flush
                self._error = exc
                return
            finally:
                done.set()
            try:
                clean()
            except Exception as exc:  # noqa: BLE001 - old checkpoints are left; a later save removes them
                logger.warning("Removing old checkpoints failed: %s: %s", type(exc).__name__, exc)
        finally:
            cleaned.set()

    def wait(self, cleaned: bool = False, timeout_s: float | None = None) -> None:
        """Wait for the write in flight (at most ``timeout_s``, default
        ``WRITE_TIMEOUT_S``), and with ``cleaned`` for the removal of old checkpoints
        after it; raise the write's error as ``CheckpointError``."""
        timeout_s = WRITE_TIMEOUT_S if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        ended = self._done.wait(timeout_s)
        if ended and cleaned:
            ended = all(e.wait(max(deadline - time.monotonic(), 0.0)) for e in self._cleaning)
        if not ended:
            raise CheckpointError(f"The checkpoint of step {self.step} is still being written after "
                                  f"{time.monotonic() - self._started:.0f} s (the limit is {timeout_s:g} s): is "
                                  "model_dir's filesystem stuck, or a worker's input position late?")
        error, self._error = self._error, None
        if error is not None:
            if isinstance(error, CheckpointError):
                raise error
            raise CheckpointError(f"Writing the checkpoint of step {self.step} failed: "
                                  f"{type(error).__name__}: {error}") from error
