"""hostreduce's tests, a package so that rank bodies and helpers are imported by name
(``from tests import ring_workers``) in the test process and in every rank it starts;
the repository root must be on ``sys.path`` (pytest's ``pythonpath`` setting, the
``PYTHONPATH`` that ``script_jobs`` and ``mpi_launch`` give their jobs)."""
