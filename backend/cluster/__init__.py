"""Several backend replicas on Redis: job-ownership leases and small fan-out messages."""

from backend.cluster.leases import Claim, ClusterStatus, JobLeases

__all__ = ["Claim", "ClusterStatus", "JobLeases"]
