"""Rebalancer's backend: ingest, live state, policy, control loop, REST and dashboard."""
