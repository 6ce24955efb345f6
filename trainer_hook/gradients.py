"""Gradient weighting: each rank's gradient counts in proportion to its share of B.

With uneven local batches, DDP's default hook (sum, then divide by world size) no longer
gives the global-batch mean. The comm hook here multiplies each bucket by this rank's
weight (``shares[rank] / B`` for the batch being trained) and all-reduces with SUM, so
the result is the global-batch mean whatever the split (docs/design.md, invariant 1). The
same hook in C++ (``_native_comm_hook``) takes DDP's CPU buckets where it can be built,
without a call into Python per bucket; this module's hook is its fallback. It also
timestamps each bucket hand-off and each reduction's completion, which is how compute
time is told apart from the wait inside synchronisation (invariant 4). FSDP also waits
for its peers before computing, inside the all-gathers that unshard parameters (forward,
and backward when parameters are resharded after forward): ``register_unshard_timer``
brackets those, and the bracketed time counts as sync wait too.

Where a comm hook cannot be used (another library owns DDP's hook), the loss-scaling
path gives the same math: multiply the local mean loss by ``world_size * weight`` and
let the default averaging all-reduce divide by world size again.

Which wrapper a model is, and the set-ups refused, is ``trainer_hook._wrappers``
(``check_data_parallel`` and ``check_mesh`` are re-exported here).

One module, over 400 lines on purpose: one rule, each rank's gradient weighted by
shares[rank] / B, applied the same way for every wrapper (the DDP comm hook, FSDP1, FSDP2,
loss scaling) with its timing events; recognising the wrapper is _wrappers.py's."""

from __future__ import annotations

import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_leaves

from trainer_hook._wrappers import (  # re-exported: check_* are this module's public API
    _SUPPORTED,
    _compiled_inner,
    _fsdp2_modules,
    _is_ddp,
    _is_fsdp1,
    check_data_parallel,
    check_mesh,
)

__all__ = [
    "GradientState", "weighted_allreduce_hook", "register_comm_hook", "register_grad_timer",
    "register_gradient_weighting", "register_unshard_timer", "check_data_parallel", "check_mesh", "timing_event",
]


class GradientState:
    """Per-step state the comm hook reads (weight) and writes (timestamps).

    The hook sets ``weight`` at the start of every step and calls ``reset()``. On CPU
    the timestamps are ``time.perf_counter()`` values; on a device torch offers timing
    events for (``timing_event``: CUDA, XPU, MPS) the hook records events (read a step
    later, never synchronising) in ``grad_event``/``done_event``, and ``events`` holds
    their class once the first one is recorded.

    Communication of the step: ``comm_bytes``, the bytes handed to gradient collectives
    (DDP's bucket buffers; FSDP's reduce-scatter inputs) and FSDP2's parameter all-gathers
    (their outputs), and ``comm_s``, the host seconds
    with one of them in flight (each counted from its hand-off or the previous one's
    completion, whichever is later); None where not measured (``comm_s`` with timing
    events).

    Waits for peers before the local gradients are ready (FSDP's unshard all-gathers, a
    blocking reduction that was not the step's last) go between ``begin_wait`` and
    ``end_wait``: summed in ``wait_s`` (host seconds) or, with events, kept as pairs of
    events on the compute stream in ``wait_events``.
    """

    __slots__ = (
        "process_group", "_weight", "_natives", "_pg", "_opts", "last_bucket_t", "last_done_t", "buckets_seen",
        "repeated_bucket", "grad_event", "done_event", "events", "_done_cb", "_cb_refs", "_futs", "_prev_futs",
        "wait_s", "wait_events", "_wait_t0", "_wait_ev0", "comm_bytes", "comm_s", "_ready", "_n_done",
    )

    def __init__(self, process_group: Any = None) -> None:
        self.process_group = process_group
        self._pg: Any = None
        self._opts: Any = None
        # The C++ hook's state (_native_comm_hook), one per DDP module it runs on (an
        # interleaved pipeline rank attaches one module per model stage).
        self._natives: list[Any] = []
        self._weight = 1.0
        self.events: Any = None  # the device's timing event class (timing_event), once seen
        self._done_cb = self._mark_done  # bound once, not per bucket
        self._cb_refs = sys.getrefcount(self._done_cb)  # references with no future holding it
        # The futures the Python hook handed DDP this step and the last (see release_callbacks).
        self._futs: list[Any] = []
        self._prev_futs: list[Any] = []
        self._ready: list[float | None] = []  # hand-off time of each bucket of the step, in order
        self.reset()

    def reset(self) -> None:
        self.last_bucket_t: float | None = None
        self.last_done_t: float | None = None
        # Bit i set: bucket i was all-reduced in this step (an int, so a reset allocates nothing).
        self.buckets_seen = 0
        self.repeated_bucket = False
        self.grad_event: Any = None
        self.done_event: Any = None
        self.wait_s = 0.0
        self.wait_events: list[tuple[Any, Any]] | None = None  # made on the first event-timed wait only
        self._wait_t0: float | None = None
        self._wait_ev0: Any = None
        self.comm_bytes = 0
        self.comm_s: float | None = 0.0
        self._ready.clear()
        self._n_done = 0
        for native in self._natives:
            native.reset()
        futs = self._futs
        if futs:  # the Python hook ran: its futures are kept one step more, the older ones dropped
            prev = self._prev_futs
            prev.clear()
            self._prev_futs, self._futs = futs, prev

    @property
    def weight(self) -> float:
        """This rank's gradient weight for the step: its share of the batch over B."""
        return self._weight

    @weight.setter
    def weight(self, value: float) -> None:
        self._weight = value
        for native in self._natives:
            native.weight = value

    @property
    def native(self) -> bool:
        """Whether DDP's buckets go through the C++ comm hook (else the Python one)."""
        return bool(self._natives)

    def collect(self) -> None:
        """Copy what the C++ hook recorded this step into the attributes the step reads."""
        natives = self._natives
        if len(natives) == 1:
            t_bucket, t_done, self.repeated_bucket, self.comm_bytes, self.comm_s = natives[0].times()
            self.last_bucket_t = None if t_bucket != t_bucket else t_bucket  # NaN: no bucket
            self.last_done_t = None if t_done != t_done else t_done
        elif natives:  # several modules: the newest bucket and reduction, the sums of the rest
            got = [n.times() for n in natives]
            buckets = [t[0] for t in got if t[0] == t[0]]
            dones = [t[1] for t in got if t[1] == t[1]]
            self.last_bucket_t = max(buckets) if buckets else None
            self.last_done_t = max(dones) if dones else None
            self.repeated_bucket = any(t[2] for t in got)
            self.comm_bytes = sum(t[3] for t in got)
            self.comm_s = sum(t[4] for t in got)

    def begin_wait(self, events: Any) -> None:
        """A wait for peers starts (with ``events``, the device's ``timing_event`` class:
        where the compute stream is now; None: a host timestamp)."""
        if events is not None:
            self.events = events
            self._wait_ev0 = _recorded_event(events)
        else:
            self._wait_t0 = _now()

    def end_wait(self, events: Any) -> None:
        """The wait begun last ends (with events: once the compute stream may go on)."""
        if events is not None:
            start = self._wait_ev0
            if start is None:
                return
            self._wait_ev0 = None
            ev = _recorded_event(events)
            if self.wait_events is None:
                self.wait_events = [(start, ev)]
            else:
                self.wait_events.append((start, ev))
        else:
            t0 = self._wait_t0
            if t0 is not None:
                self._wait_t0 = None
                self.wait_s += _now() - t0

    # Called on the gloo/NCCL completion thread (or inline when the reduction is already
    # complete): it holds the GIL the training thread wants, so it does as little as it can.
    def release_callbacks(self, timeout_s: float = 5.0) -> bool:
        """Wait until no communication thread still holds the completion callback.

        ``Future.then`` wraps the Python callback in a guard that the backend's worker
        thread (gloo's) destroys after running it, taking the GIL to do so. A thread that
        asks for the GIL once the interpreter is finalising is ended by
        ``pthread_exit`` inside that C++ destructor, and the process aborts with
        ``terminate called without an active exception``. After the last step the main
        thread may hold the GIL all the way to exit, so the hook waits here (the GIL
        released) until the reference count of the callback is back to its resting
        value. Returns False if ``timeout_s`` passed first.

        The same thread then drops its reference to the future ``then`` made, whose value
        is a Python object (DDP requires one from a Python hook): were that the last
        reference, freeing the value would take the GIL once more, after this wait. So
        the state keeps the futures of the current and the previous step (a
        communication thread is never further behind: it gets the GIL in every backward)
        until it is itself freed, on the thread that holds the GIL.
        """
        deadline = time.monotonic() + timeout_s
        while sys.getrefcount(self._done_cb) > self._cb_refs:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.001)
        return True

    def _mark_done(self, fut: torch.futures.Future[Any]) -> torch.Tensor:
        events = self.events
        if events is not None:
            self.done_event = _recorded_event(events)
            self.comm_s = None  # the device's stream, not the host, does the work: not timed
        else:
            t = _now()
            i = self._n_done
            self._n_done = i + 1
            ready = self._ready
            t_ready = ready[i] if i < len(ready) else None
            comm = self.comm_s
            if t_ready is not None and comm is not None:
                prev = self.last_done_t
                start = t_ready if prev is None or prev < t_ready else prev
                if t > start:
                    self.comm_s = comm + (t - start)
            self.last_done_t = t
        return fut.value()[0]  # type: ignore[no-any-return]


_now = time.perf_counter


def timing_event(device_type: str) -> Any:
    """The timing event class torch offers for a device type (``torch.device.type``), or
    None where the hook takes host timestamps instead (CPU, and devices without one).

    CUDA (and ROCm, which answers through ``torch.cuda``), Intel XPU and Apple MPS: each
    records on the device's current stream and is read a step later with ``query()`` and
    ``elapsed_time()`` (milliseconds), never synchronising.
    """
    if device_type == "cuda":
        return torch.cuda.Event
    if device_type == "xpu":
        return torch.xpu.Event
    if device_type == "mps":
        return torch.mps.event.Event
    return None


def _tensor_event(t: torch.Tensor) -> Any:
    """``timing_event`` of the device ``t`` lives on (``is_cpu`` first: a CPU tensor's
    ``device`` costs a few hundred nanoseconds, on every bucket)."""
    return None if t.is_cpu else timing_event(t.device.type)


def _recorded_event(events: Any) -> Any:
    """A timing event of class ``events`` recorded on the device's current stream now
    (read later, never synchronising)."""
    ev = events(enable_timing=True)
    ev.record()
    return ev


# No annotations: DDP compares them with the real classes, and this module's
# ``from __future__ import annotations`` turns them into strings it rejects.
def weighted_allreduce_hook(state, bucket):  # type: ignore[no-untyped-def]
    """DDP comm hook: ``bucket *= weight``, all-reduce SUM asynchronously, return the future.

    ``state`` is a GradientState, ``bucket`` a ``dist.GradBucket``; returns a
    ``torch.futures.Future[torch.Tensor]``.
    """
    return _weighted_allreduce(state, bucket, 1 << bucket.index())


def _module_hook(index: int) -> Any:
    """``weighted_allreduce_hook`` for the ``index``-th DDP module of a rank (an interleaved
    pipeline's model stages): its buckets get bits of their own in ``buckets_seen``."""
    shift = 1024 * index

    def hook(state, bucket):  # type: ignore[no-untyped-def]
        return _weighted_allreduce(state, bucket, 1 << (bucket.index() + shift))
    return hook


def _weighted_allreduce(state, bucket, bit):  # type: ignore[no-untyped-def]
    seen = state.buckets_seen
    if seen & bit:
        # A second all-reduce of the same bucket inside one step means gradient
        # accumulation without no_sync(); the step's exit reports it.
        state.repeated_bucket = True
    state.buckets_seen = seen | bit
    buf = bucket.buffer()
    _mark_ready(state, buf)
    state.comm_bytes += buf.nbytes
    state._ready.append(state.last_bucket_t if state.events is None else None)
    buf.mul_(state._weight)
    pg = state._pg
    if pg is None:
        # Straight to the ProcessGroup: dist.all_reduce's Python checks and logging cost
        # more than the reduction launch itself on the hot path.
        pg = state._pg = state.process_group if state.process_group is not None else dist.group.WORLD
        opts = state._opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM
    fut = pg.allreduce([buf], state._opts).get_future().then(state._done_cb)
    state._futs.append(fut)  # freed by this thread, never last by gloo's (release_callbacks)
    return fut


def register_gradient_weighting(
    model: torch.nn.Module, state: GradientState, world_size: int, *, dp_mesh: Any = None, pipelined: bool = False,
    index: int = 0,
) -> str:
    """Weight each rank's gradient by its share of the global batch, the way the wrapper
    allows; returns the mechanism: ``"ddp_comm_hook"``, ``"fsdp2_reduce_scatter"``,
    ``"fsdp1_comm_hook"`` or ``"local"`` (one process, nothing to weight). ``index``: which
    of this rank's modules ``model`` is (an interleaved pipeline rank weights one per model
    stage, all with the same ``state``)."""
    model = _compiled_inner(model)
    check_data_parallel(model, world_size, dp_mesh=dp_mesh, pipelined=pipelined)
    if _is_ddp(model):
        if dp_mesh is not None:  # DDP over the dp sub-group: reduce over it, not the world
            state.process_group = model.process_group
        register_comm_hook(model, state, index=index)
        return "ddp_comm_hook"
    fsdp2 = _fsdp2_modules(model)
    if fsdp2:
        comm = WeightedReduceScatter(state)
        for m in fsdp2:
            # SUM of weighted inputs is the global-batch mean: no division by world size.
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)
            m.set_custom_reduce_scatter(comm)
        return "fsdp2_reduce_scatter"
    if _is_fsdp1(model):
        state.process_group = getattr(model, "process_group", None)
        try:
            model.register_comm_hook(state, _fsdp1_weighted_hook)  # type: ignore[operator]
        except (AssertionError, RuntimeError) as exc:
            raise RuntimeError(
                "FullyShardedDataParallel would not take the rebalancer's communication hook (FSDP1 "
                "takes one, on the root, before the first forward). Call hook.attach(model) right "
                f"after wrapping, or use gradients='loss_scale' with hook.loss_weight(). (FSDP said: {exc})"
            ) from None
        return "fsdp1_comm_hook"
    if world_size > 1:
        raise ValueError(
            f"attach() cannot weight the gradients of {type(model).__name__} with {world_size} ranks: "
            "it is not DistributedDataParallel, FSDP2 (fully_shard) or FSDP1. If something else "
            "averages gradients over all ranks, call hook.attach(model, gradients='loss_scale') and "
            "back-propagate loss * hook.loss_weight() inside hook.step(). " + _SUPPORTED
        )
    return "local"


def _mark_ready(state: GradientState, t: torch.Tensor) -> None:
    events = _tensor_event(t)
    if events is not None:
        state.events = events
        state.grad_event = _recorded_event(events)
    else:
        state.last_bucket_t = _now()


def _mark_reduced(state: GradientState, t: torch.Tensor) -> None:
    events = _tensor_event(t)
    if events is not None:
        state.done_event = _recorded_event(events)
    else:
        state.last_done_t = _now()


def _mark_reduced_blocking(state: GradientState, t: torch.Tensor) -> None:
    """``_mark_reduced`` for a reduction that blocked the training thread since its
    ``_mark_ready``: all that time was inside the collective."""
    _mark_reduced(state, t)
    done, ready, comm = state.last_done_t, state.last_bucket_t, state.comm_s
    if done is not None and ready is not None and comm is not None and done > ready:
        state.comm_s = comm + (done - ready)
    elif done is None:
        state.comm_s = None  # timed with events: not on the host


def _mark_ready_blocking(state: GradientState, t: torch.Tensor) -> None:
    """``_mark_ready`` for a reduction that blocks the training thread (gloo, on CPU): the
    previous one of this step was not the last, so all its time was spent waiting."""
    if _tensor_event(t) is None:
        done, ready = state.last_done_t, state.last_bucket_t
        if done is not None and ready is not None:
            state.wait_s += done - ready
    _mark_ready(state, t)


class WeightedReduceScatter:
    """FSDP2 custom reduce-scatter: ``input *= weight``, then SUM (no divide factor)."""

    def __init__(self, state: GradientState) -> None:
        self.state = state

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any, async_op: bool = False
    ) -> Any:
        state = self.state
        if async_op:
            _mark_ready(state, input_tensor)
            state.comm_s = None  # completes out of the hook's sight
        else:
            _mark_ready_blocking(state, input_tensor)
        state.comm_bytes += input_tensor.nbytes
        input_tensor.mul_(state.weight)
        work = dist.reduce_scatter_tensor(output_tensor, input_tensor, op=dist.ReduceOp.SUM, group=group, async_op=async_op)
        if not async_op:
            _mark_reduced_blocking(state, output_tensor)
        return work


def _fsdp1_weighted_hook(state, grad, output=None):  # type: ignore[no-untyped-def]
    """FSDP1 comm hook (FSDP skips its own pre/post division when one is registered)."""
    _mark_ready_blocking(state, grad)
    state.comm_bytes += grad.nbytes
    grad.mul_(state.weight)
    if output is None:  # NO_SHARD: an all-reduce in place
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=state.process_group)
        _mark_reduced_blocking(state, grad)
    else:
        dist.reduce_scatter_tensor(output, grad, op=dist.ReduceOp.SUM, group=state.process_group)
        _mark_reduced_blocking(state, output)


def register_comm_hook(model: Any, state: GradientState, *, index: int = 0) -> None:
    """Install the weighted hook on a DDP model; clear errors for setups it cannot keep exact."""
    name = type(model).__name__
    if not _is_ddp(model):
        raise ValueError(
            f"attach() expected a torch.nn.parallel.DistributedDataParallel model, got {name}. "
            "Wrap the model in DDP first, or use attach(model, gradients='loss_scale') and multiply "
            "your loss by hook.loss_weight() if something else averages gradients across ranks."
        )
    try:
        if not _register_native(model, state):
            model.register_comm_hook(state, weighted_allreduce_hook if index == 0 else _module_hook(index))
    except RuntimeError as exc:
        raise RuntimeError(
            "This DDP model already has a communication hook registered, and DDP allows only one. "
            "The rebalancer's hook must weight every bucket by the rank's share of the global batch, "
            "otherwise uneven batches change the math. Remove the other register_comm_hook() call, "
            "or use attach(model, gradients='loss_scale') with hook.loss_weight()."
            f" (DDP said: {exc})"
        ) from None


def _register_native(model: Any, state: GradientState) -> bool:
    """The C++ comm hook on DDP's reducer, where it can run (CPU buckets, DDP's C++
    reducer, the extension built); False: the caller registers the Python hook."""
    if model._use_python_reducer or any(p.device.type != "cpu" for p in model.parameters()):
        return False
    from trainer_hook import _native_comm_hook

    ext = _native_comm_hook.load()
    if ext is None:
        return False
    native = ext.WeightState()
    native.weight = state._weight
    group = state.process_group if state.process_group is not None else dist.group.WORLD
    ext.register_hook(model.reducer, group, native)
    if model.logger is not None:  # DDP's usage log names the hook, as its register_comm_hook does
        model.logger._set_comm_hook_name("rebalancer_native_weighted_allreduce")
    state._natives.append(native)
    return True


def register_grad_timer(model: torch.nn.Module, state: GradientState, *, count: int = 4) -> list[Any]:
    """Timestamp compute and sync without a comm hook (the loss-scaling path, one process).

    Backward produces the first parameters' gradients last, so hooks on the first few
    parameters mark when local gradients are ready (the end of compute); cheaper than
    hooking every one. The end of the backward pass, after the framework's own gradient
    synchronisation (DDP's reducer waits for its all-reduces in a final callback of the
    autograd engine), marks when the reduction is done: the wait for slower ranks lands
    between the two, as sync wait.
    """
    engine = torch.autograd.Variable._execution_engine
    # A gradient of the backward pass under way, once its end-of-backward mark is queued.
    pending: list[torch.Tensor | None] = [None]

    def reduced() -> None:
        grad, pending[0] = pending[0], None
        assert grad is not None
        _mark_reduced(state, grad)

    def after_framework() -> None:
        # Queued from a final callback, so it runs after every callback queued before it,
        # DDP's finalize_backward included (that one is queued when its last bucket is
        # ready, which is after the parameter hook below ran).
        engine.queue_callback(reduced)

    def mark(p: torch.Tensor) -> None:
        # On an accelerator an event (read a step later, never synchronising), as the comm hook does.
        _mark_ready(state, p)
        if pending[0] is None:
            pending[0] = p
            engine.queue_callback(after_framework)

    handles = []
    for p in list(model.parameters())[:count]:
        if p.requires_grad:
            handles.append(p.register_post_accumulate_grad_hook(mark))
    return handles


class _TimedMethod:
    """Times one object's method as a wait for peers: an instance attribute over the class's
    method, so every caller (FSDP's own prefetches included) goes through it.

    ``all_gather``: the method is an FSDP2 parameter group's ``unshard``; where a call starts
    an all-gather, its output's bytes (the unsharded parameters: nccl-tests' size of an
    all-gather) go into ``comm_bytes`` and, on a host clock, the call's seconds (gloo's
    all-gather blocks there) into ``comm_s``. ``wait=False`` counts only that (on a device
    the all-gather runs on a stream of its own; the wait is timed in ``wait_for_unshard``)."""

    __slots__ = ("obj", "name")

    def __init__(self, obj: Any, name: str, state: GradientState, events: Any, *,
                 all_gather: bool = False, wait: bool = True) -> None:
        self.obj, self.name = obj, name
        fn = getattr(type(obj), name)  # the class's, so attaching twice never stacks wrappers
        begin, end = (state.begin_wait, state.end_wait) if wait else (_no_wait, _no_wait)

        def timed(*args: Any, **kwargs: Any) -> Any:
            begin(events)
            try:
                return fn(obj, *args, **kwargs)
            finally:
                end(events)

        def timed_all_gather(*args: Any, **kwargs: Any) -> Any:
            pending = getattr(obj, "_all_gather_result", None)
            waited = state.wait_s
            try:
                return timed(*args, **kwargs)
            finally:
                got = getattr(obj, "_all_gather_result", None)
                if pending is None and got is not None and getattr(got, "all_gather_input_split_sizes", None):  # [] on 1 rank
                    out = got.all_gather_output
                    state.comm_bytes += out.numel() * out.element_size()
                    if state.comm_s is not None and events is None:
                        # Gloo's all-gather blocks inside the wait just timed: its time is that
                        # wait, from the same clock readings (readings of its own would count a
                        # thread switch after the wait as communication, not as waiting).
                        state.comm_s += max(0.0, state.wait_s - waited)

        setattr(obj, name, timed_all_gather if all_gather else timed)

    def remove(self) -> None:
        self.obj.__dict__.pop(self.name, None)


def _no_wait(_events: Any) -> None:
    return None


def _on_grad_outputs(output: Any, fn: Any) -> None:
    """Register the tensor hook ``fn`` on every output that will receive a gradient."""
    if not torch.is_grad_enabled():
        return
    leaves = (output,) if isinstance(output, torch.Tensor) else tree_leaves(output)
    for t in leaves:
        if isinstance(t, torch.Tensor) and t.requires_grad:
            t.register_hook(fn)


def _fsdp1_unshard_timer(model: Any, state: GradientState) -> list[Any]:
    from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy

    events = timing_event(model.compute_device.type)

    def begin(*_: Any) -> None:
        state.begin_wait(events)

    def end(*_: Any) -> None:
        state.end_wait(events)

    def begin_backward(_module: Any, _args: Any, output: Any) -> None:
        _on_grad_outputs(output, begin)

    def end_backward(_module: Any, _args: Any, output: Any) -> None:
        _on_grad_outputs(output, end)

    handles = []
    for m in FullyShardedDataParallel.fsdp_modules(model):
        inner = m._fsdp_wrapped_module
        # FullyShardedDataParallel.forward unshards (all-gather, then on a GPU the compute
        # stream waits for it) between its own pre-hooks and its inner module's.
        handles.append(m.register_forward_pre_hook(begin, prepend=True))
        handles.append(inner.register_forward_pre_hook(end, prepend=True))
        if m._handle is not None and m.sharding_strategy == ShardingStrategy.FULL_SHARD:
            # Backward unshards in a tensor hook FSDP puts on the outputs after the inner
            # module's forward hooks ran and before its own: hooks on one tensor run in the
            # order they were registered.
            handles.append(inner.register_forward_hook(begin_backward, prepend=True))
            handles.append(m.register_forward_hook(end_backward))
    return handles


def register_unshard_timer(model: torch.nn.Module, state: GradientState) -> list[Any]:
    """Time FSDP's unshards (the parameter all-gathers, where a fast rank waits for a slow
    one before it can compute) as waits in ``state``; returns removable handles ([] for a
    model that is not FSDP).

    FSDP2: each parameter group's ``unshard`` and ``wait_for_unshard``, whoever calls them
    (forward, backward, prefetches). On CPU (gloo) the all-gather blocks in ``unshard``;
    on a device with timing events (CUDA, XPU) only ``wait_for_unshard`` holds the compute
    stream (it waits there for the all-gather stream), so only it is timed, with events.
    Each FSDP2 all-gather's bytes (its output: the unsharded parameters) count in
    ``comm_bytes``, and on CPU its seconds in ``comm_s``.
    FSDP1: its forward between the FSDP module's pre-hooks and the wrapped module's, and
    in backward the output tensor hooks around FSDP's own pre-backward hook.
    """
    model = _compiled_inner(model)
    if _is_fsdp1(model):
        return _fsdp1_unshard_timer(model, state)
    handles: list[Any] = []
    seen: set[int] = set()
    for m in _fsdp2_modules(model):
        for group in m._get_fsdp_state()._fsdp_param_groups:
            if id(group) in seen:  # fully_shard([a, b]): one state for several modules
                continue
            seen.add(id(group))
            events = timing_event(group.device.type)
            # On a host clock gloo's all-gather blocks in unshard: a wait, and its bytes and
            # time. On a device only wait_for_unshard holds the compute stream: unshard then
            # counts the all-gather's bytes alone.
            handles.append(_TimedMethod(group, "unshard", state, events, all_gather=True, wait=events is None))
            handles.append(_TimedMethod(group, "wait_for_unshard", state, events))
    return handles
