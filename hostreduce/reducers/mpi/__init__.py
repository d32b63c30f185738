"""The ``mpi`` engine: collectives over mpi4py under ``mpirun`` (``reducer``), the
buffer-level collectives shared with the ``horovod`` engine (``collectives``, ``ops16``,
``p2p``) and the choice of MPI library and launcher (``select``)."""
from .reducer import MPIReducer

__all__ = ["MPIReducer"]
