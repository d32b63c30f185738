"""``model.fit`` inside a hostreduce strategy's ``scope()``: a deep MLP on global batches
of a made-up regression, then each worker saves its weights (``OUT/weights-rank<R>.npz``)
and what ``evaluate`` and ``predict`` return on the whole data (``OUT/outputs-rank<R>.npz``). The model is built with a seed that differs per worker, so
equal weights at the end also show that the scope starts every worker from rank 0's.

Run: ``hostreduce run -np 2 -- python fit_worker.py ring|mpi SGD|Adam OUT [fused|keras]``
(``mpi``: ``HorovodStrategy`` under ``mpirun``; ``keras``: ``fused_apply=False``).
"""
import json
import os
import sys

import numpy as np

import hostreduce
from tests.tfd_workers.fit_model import EPOCHS, build, data

ENGINE, OPTIMIZER, OUT = sys.argv[1], sys.argv[2], sys.argv[3]
FUSED = (sys.argv[4] if len(sys.argv) > 4 else "fused") == "fused"
strategy = (hostreduce.MultiWorkerStrategy(fused_apply=FUSED) if ENGINE == "ring"
            else hostreduce.HorovodStrategy(reducer=ENGINE, fused_apply=FUSED))

with strategy.scope():
    model = build(OPTIMIZER, seed=100 + strategy.rank)
history = model.fit(data(), epochs=EPOCHS, verbose=0)
np.savez(os.path.join(OUT, f"weights-rank{strategy.rank}.npz"), *model.get_weights())
# evaluate and predict in the scope: the whole input on every worker, as one process
evaluated = model.evaluate(data(), verbose=0)
predicted = model.predict(data().map(lambda x, y: x), verbose=0)
np.savez(os.path.join(OUT, f"outputs-rank{strategy.rank}.npz"), loss=np.asarray(evaluated), predicted=predicted)
print("LOSSES", json.dumps(history.history["loss"]), flush=True)
