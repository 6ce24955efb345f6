"""Soak jobs only (bench._launch puts this directory on PYTHONPATH): with
REBALANCER_SOAK_FAULTHANDLER=1, every Python process of the job (torchrun's agent, the
ranks, DataLoader workers of any start method) prints all its threads' stacks on SIGUSR1
and keeps running, so a hung job explains itself before it is killed."""

import os

if os.environ.get("REBALANCER_SOAK_FAULTHANDLER") == "1":
    import faulthandler
    import signal
    import sys

    faulthandler.enable(file=sys.stderr, all_threads=True)
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True, chain=False)
