"""Builders shared by the tests: free ports, a real backend process, torchrun jobs."""
