"""Rebalancer's wire format, the one both sides import: the messages between a training
hook and the backend, their limits and codec (``rebalancer_wire.protocol``: hello,
metrics, placement, ...; the ranges every number crossing the boundary is checked
against; the share rules), and the device keys that name a card the same way everywhere
(``rebalancer_wire.devices``).

Standard library only (orjson, where installed, only speeds up parsing): the hook (with torch) and the backend (without it) both depend on
it, and on nothing of each other (tests/test_layers.py holds that). docs/protocol.md is
the wire's reference.
"""
