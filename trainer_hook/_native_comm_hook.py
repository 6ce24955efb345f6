"""The DDP comm hook in C++: the same weighting as ``gradients.weighted_allreduce_hook``
without a call into Python, a Python future callback and the GIL per bucket.

Built with ``torch.utils.cpp_extension.load_inline`` on first use (about 20 s of CPU
time, once per machine and torch version; cached under the user's torch extensions dir,
``TORCH_EXTENSIONS_DIR`` or ``~/.cache/torch_extensions``), never inside a DataLoader
worker. ``load()`` returns None when it cannot be built or loaded (no compiler, no
ninja, a torch without the c10d headers) or when ``REBALANCER_NATIVE_COMM_HOOK=0``;
the caller then uses the Python hook, which gives the same numbers.
"""

from __future__ import annotations

import hashlib
import inspect
import logging
import os
import threading
import time
from typing import Any

import torch

__all__ = ["load", "ENV_VAR"]

log = logging.getLogger(__name__)

ENV_VAR = "REBALANCER_NATIVE_COMM_HOOK"
STALE_LOCK_S = 600.0  # a build takes 30 to 105 s on 2 busy cores

# The math is the Python hook's, op for op: ``buf.mul_(weight)`` with a double scalar,
# all-reduce SUM on the process group, the reduced bucket as the result. Timestamps are
# CLOCK_MONOTONIC seconds, the clock time.perf_counter() reads on Linux.
_SOURCE = r"""
#include <torch/csrc/utils/pybind.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/comm.hpp>
#include <torch/csrc/distributed/c10d/reducer.hpp>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <ctime>
#include <mutex>
#include <vector>

namespace {

double now_s() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
}

struct WeightState {
  double weight = 1.0;
  c10::intrusive_ptr<c10d::ProcessGroup> pg;
  double last_bucket_t = NAN;             // the training (autograd) thread
  std::atomic<double> last_done_t{NAN};   // the backend's completion thread
  std::vector<bool> seen;
  bool repeated_bucket = false;
  int64_t comm_bytes = 0;                 // the training thread: bytes handed to all-reduces
  // The completion thread(s): seconds with an all-reduce of this step in flight, each
  // bucket counted from when it was handed over or the previous one completed, whichever
  // is later (the union of the buckets' intervals, which complete in order).
  std::mutex done_mu;
  double comm_s = 0.0;

  void reset() {
    last_bucket_t = NAN;
    last_done_t.store(NAN);
    std::fill(seen.begin(), seen.end(), false);
    repeated_bucket = false;
    comm_bytes = 0;
    std::lock_guard<std::mutex> g(done_mu);
    comm_s = 0.0;
  }

  void done(double t_ready) {
    std::lock_guard<std::mutex> g(done_mu);
    double t = now_s();
    double prev = last_done_t.load();
    double start = (std::isnan(prev) || prev < t_ready) ? t_ready : prev;
    if (t > start) comm_s += t - start;
    last_done_t.store(t);
  }
};

class WeightedHook : public c10d::CommHookInterface {
 public:
  explicit WeightedHook(std::shared_ptr<WeightState> s) : s_(std::move(s)) {}

  c10::intrusive_ptr<c10::ivalue::Future> runHook(c10d::GradBucket& bucket) override {
    WeightState& s = *s_;
    size_t i = bucket.getIndex();
    if (i >= s.seen.size()) s.seen.resize(i + 1, false);
    if (s.seen[i]) s.repeated_bucket = true;
    s.seen[i] = true;
    at::Tensor& buf = bucket.getBufferRef();
    TORCH_CHECK(buf.is_cpu(), "the rebalancer's native comm hook takes CPU buckets only");
    double t_ready = now_s();
    s.last_bucket_t = t_ready;
    s.comm_bytes += static_cast<int64_t>(buf.nbytes());
    buf.mul_(s.weight);
    std::vector<at::Tensor> tensors = {buf};
    c10d::AllreduceOptions opts;
    opts.reduceOp = c10d::ReduceOp::SUM;
    auto fut = s.pg->allreduce(tensors, opts)->getFuture();
    std::shared_ptr<WeightState> keep = s_;
    return fut->then(
        [keep, t_ready](c10::ivalue::Future& f) -> c10::IValue {
          keep->done(t_ready);
          return f.value();
        },
        fut->elementType());
  }

  at::Tensor parseHookResult(const c10::IValue& result) override {
    if (result.isTensor()) return result.toTensor();
    return result.toTensorVector()[0];
  }

 private:
  std::shared_ptr<WeightState> s_;
};

void register_hook(py::handle reducer, py::handle pg, std::shared_ptr<WeightState> state) {
  auto& r = py::cast<c10d::Reducer&>(reducer);
  auto& g = py::cast<c10d::ProcessGroup&>(pg);
  state->pg = c10::intrusive_ptr<c10d::ProcessGroup>::unsafe_reclaim_from_nonowning(&g);
  r.register_comm_hook(std::make_unique<WeightedHook>(std::move(state)));
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<WeightState, std::shared_ptr<WeightState>>(m, "WeightState")
      .def(py::init<>())
      .def_readwrite("weight", &WeightState::weight)
      .def("reset", &WeightState::reset)
      .def("times", [](WeightState& s) {
        double comm_s;
        {
          std::lock_guard<std::mutex> g(s.done_mu);
          comm_s = s.comm_s;
        }
        return py::make_tuple(s.last_bucket_t, s.last_done_t.load(), s.repeated_bucket,
                              s.comm_bytes, comm_s);
      });
  m.def("register_hook", &register_hook);
}
"""

_lock = threading.Lock()
_loaded: list[Any] = []  # [module or None] once tried


def _name() -> str:
    # A new torch (or source) gets a build of its own, never a stale library of another ABI.
    key = f"{torch.__version__}|{torch.version.git_version}|{_SOURCE}".encode()
    return "rebalancer_comm_hook_" + hashlib.sha256(key).hexdigest()[:12]


def load() -> Any:
    """The extension module, building it on first use; None where it cannot be had."""
    if os.environ.get(ENV_VAR, "1") == "0":
        return None
    if torch.utils.data.get_worker_info() is not None:
        return None  # a DataLoader worker trains nothing; never compile there
    with _lock:
        if not _loaded:
            _loaded.append(_build())
        return _loaded[0]


def _stale_lock(name: str) -> bool:
    """A build lock older than any build: an interrupted build left it, and torch would
    wait on it for ever. Left in place (it may be another process's); says how to clear it."""
    from torch.utils.cpp_extension import _get_build_directory

    lock = os.path.join(_get_build_directory(name, False), "lock")
    try:
        age_s = time.time() - os.stat(lock).st_mtime
    except FileNotFoundError:
        return False
    if age_s < STALE_LOCK_S:
        return False  # another process is building it now: wait for that build
    log.warning("the native DDP comm hook is unavailable, using the Python one: a build "
                "interrupted %.0f s ago left its lock %s; delete it to build again", age_s, lock)
    return True


def _build() -> Any:
    from torch.utils.cpp_extension import load_inline

    path = os.environ.get("PATH")
    try:
        # torch runs `ninja` from PATH; pip's ninja lives beside the interpreter, which an
        # unactivated virtual environment leaves off PATH.
        import ninja  # type: ignore[import-untyped]

        os.environ["PATH"] = os.pathsep.join([path, ninja.BIN_DIR]) if path else ninja.BIN_DIR
    except ImportError:
        pass
    try:
        if _stale_lock(_name()):
            return None
        log.info("building the rebalancer's native DDP comm hook (once per torch version, about 20 s of CPU)")
        # The source includes the headers it uses (pybind11's and c10d's), not the whole C++
        # API that load_inline puts first by default (torch/extension.h): 18 s of CPU to
        # compile, not 26, on the path of `make setup-and-hook` and of a first run. A torch
        # without the option includes it anyway (a slower build, the same module).
        quiet = "no_implicit_headers" in inspect.signature(load_inline).parameters
        return load_inline(_name(), cpp_sources=[_SOURCE], extra_cflags=["-O2"], verbose=False,
                           **({"no_implicit_headers": True} if quiet else {}))
    except Exception as exc:  # noqa: BLE001 - any failure to build or load means: use the Python hook
        log.warning("the native DDP comm hook is unavailable, using the Python one (same math, "
                    "about 30 us more per bucket): %s", str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        return None
    finally:
        if path is None:
            os.environ.pop("PATH", None)
        else:
            os.environ["PATH"] = path
