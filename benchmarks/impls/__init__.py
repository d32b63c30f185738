"""What the peers run inside the benchmarks' worker processes, where two benchmarks
share it (``collectives``: the all-reduce of each peer, for ``allreduce.py`` and
``scale.py``)."""
