"""Free loopback ports for test servers and torchrun rendezvous (one helper, the product's)."""

from __future__ import annotations

from rebalancer_wire.ports import free_port

__all__ = ["free_port"]
