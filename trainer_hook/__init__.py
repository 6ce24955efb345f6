"""Rebalancer's training hook: measures each rank and applies placements in lockstep."""
