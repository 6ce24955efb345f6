"""Several backend replicas on Redis: job-ownership leases and small fan-out messages."""

from backend.cluster.leases import ClusterStatus, JobLeases

__all__ = ["ClusterStatus", "JobLeases"]
