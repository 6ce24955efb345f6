"""Run a script with a per-rank environment: ``_rank_env.py SCRIPT ARGS...`` sets, on local
rank N, every ``RANK<N>__NAME=value`` of the environment as ``NAME=value``, then runs SCRIPT
as ``__main__`` (before anything imports torch, so an injection sees that environment).
One torchrun job can then give each rank its own case."""

import os
import runpy
import sys

prefix = f"RANK{os.environ.get('LOCAL_RANK', '0')}__"
for key, value in list(os.environ.items()):
    if key.startswith(prefix):
        os.environ[key[len(prefix):]] = value
script = sys.argv[1]
sys.argv = sys.argv[1:]
sys.path[0] = os.path.dirname(os.path.abspath(script))
runpy.run_path(script, run_name="__main__")
