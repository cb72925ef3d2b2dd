"""Tools for testing distributed training on one Linux machine: simulated cluster nodes (network namespaces with
their own addresses and hostnames, joined by veth pairs, optionally rate-shaped), used by the cluster test tier
and the layered-SGD benchmark.  Needs root and iproute2; :func:`unavailable_reason` says why not otherwise."""

from lightning_hpc.testing.simulated_nodes import SimNode, SimNodes, remove_stale, unavailable_reason

__all__ = ["SimNode", "SimNodes", "remove_stale", "unavailable_reason"]
