"""Put first on PYTHONPATH by ``rebalancer run`` (trainer_hook.zero_code): in every Python
process of the user's command, once ``torch`` is imported, monitoring starts (it does
nothing more until an optimizer steps). Whatever fails here prints one line and the
process goes on. A ``sitecustomize`` further down the path (the user's own, or the
interpreter's) still runs after this one: Python only imports the first it finds."""

import os
import sys


def _say(msg):
    try:
        sys.stderr.write(f"rebalancer: {msg}\n")
    except Exception:
        pass


def _after_torch_import():
    """Start monitoring when ``import torch`` completes (never import torch ourselves:
    torchrun's agent, pip and the like must not pay for it)."""
    import importlib.util

    class _TorchWatcher:
        def find_spec(self, name, path=None, target=None):
            if name != "torch":
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(name)
            loader = getattr(spec, "loader", None)
            if loader is None or not hasattr(loader, "exec_module"):
                return spec
            original = loader.exec_module

            def exec_module(module):
                original(module)
                try:
                    from trainer_hook import zero_code

                    zero_code.install()
                except Exception as exc:
                    _say(f"monitoring is off ({type(exc).__name__}: {exc}); training goes on unmonitored")

            loader.exec_module = exec_module
            return spec

    if "torch" in sys.modules:
        from trainer_hook import zero_code

        zero_code.install()
    else:
        sys.meta_path.insert(0, _TorchWatcher())


def _chain_next_sitecustomize():
    """Run the next ``sitecustomize`` on sys.path, as if this one were not there."""
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    if os.path.dirname(os.path.abspath(spec.origin or "")) == here:
        return
    ours = sys.modules.get("sitecustomize")
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    try:
        spec.loader.exec_module(module)
    finally:
        if ours is not None:
            sys.modules["sitecustomize"] = ours


if os.environ.get("REBALANCER_MONITOR") == "1":
    try:
        _after_torch_import()
    except Exception as exc:
        _say(f"monitoring is off ({type(exc).__name__}: {exc}); training goes on unmonitored")
try:
    _chain_next_sitecustomize()
except Exception as exc:
    _say(f"the next sitecustomize on the path failed: {type(exc).__name__}: {exc}")
