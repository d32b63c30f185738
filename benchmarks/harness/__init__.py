"""The benchmarks' one harness: how a benchmark starts its worker processes, where
they run, and how its results are written.

* :mod:`~benchmarks.harness.jobs`: jobs of N worker processes (environment,
  ``PYTHONPATH``, per-rank JSON-lines records, timeouts, killing the process tree), and
  the worker side of a job;
* :mod:`~benchmarks.harness.placement`: loopback, network namespaces with shaped links
  (``netcluster.py``), ``mpirun``; the one import of the project's process helpers;
* :mod:`~benchmarks.harness.peers`: the systems measured, each behind one interface
  (``peers.run(peer, placement, n, ...)``);
* :mod:`~benchmarks.harness.report`: the environment record, JSON and PNG files, the
  end of ``main()`` every benchmark shares;
* :mod:`~benchmarks.harness.cli`: the shared command-line options;
* :mod:`~benchmarks.harness.measure`: sizes, timing, repetition counts (also imported by
  the workers).

Submodules are imported by name (``from benchmarks.harness import jobs``); importing
the package itself imports none of them.
"""
