"""Cluster resolution: explicit arguments, ``TF_CONFIG`` or the mpirun environment,
resolved into one immutable :class:`ClusterSpec`; and the ``TF_CONFIG`` of a worker
that a launcher starts."""
from .spec import ClusterSpec
from .resolve import cluster_from_resolver, resolve_cluster
from .tf_config import TF_CONFIG, format_tf_config

__all__ = ["ClusterSpec", "resolve_cluster", "cluster_from_resolver", "TF_CONFIG", "format_tf_config"]
