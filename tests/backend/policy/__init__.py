"""Tests of backend/policy: pure functions, property tests, the simulator."""
