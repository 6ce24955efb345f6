"""Several backend replicas on Redis: job-ownership leases, live fan-out of dashboards
between replicas and forwarding of operator actions to a job's owner."""

from backend.cluster.fanout import LiveFanout
from backend.cluster.forward import Forwarder, ForwardError, Reply
from backend.cluster.leases import Claim, ClusterStatus, JobLeases

__all__ = ["Claim", "ClusterStatus", "ForwardError", "Forwarder", "JobLeases", "LiveFanout", "Reply"]
