"""The rebalancing policy: pure functions from observations to proposals."""
