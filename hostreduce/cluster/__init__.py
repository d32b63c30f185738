"""Cluster resolution: explicit arguments, ``TF_CONFIG`` or the mpirun environment,
resolved into one immutable :class:`ClusterSpec`."""
from .spec import ClusterSpec
from .resolve import cluster_from_resolver, resolve_cluster

__all__ = ["ClusterSpec", "resolve_cluster", "cluster_from_resolver"]
