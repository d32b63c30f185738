"""A ``ps`` task without TensorFlow: serves its shard (sync, gradients averaged, the
settings of ``ParameterServerStrategy(sync=True)``; ``TEST_PS_MODE=async``: those of
``sync=False``) until the chief ends the job; exits 1 with ``JobFailedError`` when the
job failed. Starts in well under a second, so tests that start many ps need not pay
TensorFlow's import each time."""
import os

from hostreduce.ps.serve import serve_from_env

serve_from_env(mode=os.environ.get("TEST_PS_MODE", "sync"), reduce="mean")
