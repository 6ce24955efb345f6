"""The control loop: modes, proposal lifecycle, guardrails, rollback and measured effect.

The policy (``backend.policy``) only decides; this package acts on its decisions. The event
loop owns each job's control state (``JobState``, held by the ``JobStore``); SQL
(``backend.storage.control``) holds the truth, so a restarted backend resumes where it
stopped, and is reached only through the ``SqlGateway`` thread. Each change publishes a snapshot of the job's control state
(``job_control``), which the jobs routes, the dashboard hub and ``/metrics`` read without
touching SQL. One job's actions run one at a time (a lock per job).

Policy runs are scheduled like the hub's ticks: ``on_metrics`` adds the job to a dirty set
and a ticker starts a run for each dirty job that is due (every frame while it warms up,
then at most every ``policy_min_interval_s`` and never faster than five times the last
run's cost); the decision itself runs in the ``PolicyRunner`` (a process of its own).

``Controller`` is the composition root: it builds one object for each job of the control
loop and wires them by constructor, each holding only the collaborators it names (no part
inherits from another; ``tests/test_layers.py`` checks)::

    store       JobStore         each job's state, loaded, fenced, published  (core.py)
    rollout     Rollout          new versions in force, sent; acks followed  (rollout.py)
    policy      PolicyLoop       one policy run and what follows from it     (policy_loop.py)
    schedule    PolicyScheduler  the dirty set, the ticker, proposal expiry  (scheduling.py)
    events      HookEvents       what a rank's frames do                     (hook_events.py)
    reads       ReadModel        snapshots and history for routes/dashboard  (read_model.py)
    actions     OperatorActions  approve, reject, manual, rollback, settings (actions.py)

The arrows run one way: events -> schedule/policy -> rollout -> store; actions -> rollout,
schedule, reads. An approval: ``actions.approve`` -> ``rollout.apply`` (records the version,
fenced) -> ``rollout.send``. A policy placement: ``schedule`` tick -> ``policy.run`` ->
``rollout.apply`` (auto mode) -> ``rollout.send``. The methods assigned after the parts
forward to them, so the routes, ingest and the reports keep one import path.

What the policy is handed and the checks on operator settings are in
``backend.control.inputs``; measured effect and the rollback decision in
``backend.control.effect``; every write to the control tables in ``backend.control.records``;
the status rule in ``backend.control.status``; the errors in
``backend.control.errors`` (re-exported here).

Modes: ``observe`` (proposals are shown, never sent), ``approve`` (they wait for an
operator), ``auto`` (applied under guardrails: the policy's cap on how far one change moves
a rank, its cooldown, and rollback when the measured step time got worse).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from backend.control.actions import OperatorActions
from backend.control.core import MODES, JobStore, Ownership, RunQueue
from backend.control.errors import ConflictError, ControlError, InvalidError, NotFoundError
from backend.control.hook_events import HookEvents
from backend.control.policy_loop import PolicyLoop
from backend.control.policy_runs import PolicyRunner
from backend.control.read_model import ReadModel
from backend.control.rollout import Rollout
from backend.control.scheduling import PolicyScheduler
from backend.live.state import LiveState
from backend.peers.connections import HookConnections
from backend.settings import Settings
from backend.storage.gateway import SqlGateway

__all__ = ["Controller", "ControlError", "NotFoundError", "ConflictError", "InvalidError", "MODES"]


class Controller:
    """Runs the control loop of every job: builds its parts and forwards to them.
    ``notify(job)`` tells the dashboard a job changed."""

    def __init__(self, *, settings: Settings, sql: SqlGateway, live: LiveState,
                 connections: HookConnections, notify: Callable[[str], None],
                 policy: PolicyRunner, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time, ownership: Ownership | None = None):
        queue = RunQueue()
        self.store = JobStore(settings=settings, sql=sql, live=live, notify=notify, queue=queue,
                              wall=wall, ownership=ownership)
        self.rollout = Rollout(store=self.store, connections=connections)
        self.policy = PolicyLoop(store=self.store, rollout=self.rollout, runner=policy)
        self.schedule = PolicyScheduler(store=self.store, policy=self.policy, queue=queue,
                                        settings=settings, clock=clock)
        self.events = HookEvents(store=self.store, rollout=self.rollout, policy=self.policy,
                                 schedule=self.schedule, connections=connections)
        self.reads = ReadModel(store=self.store)
        self.actions = OperatorActions(store=self.store, rollout=self.rollout,
                                       schedule=self.schedule, reads=self.reads)

        # What the rest of the backend calls, forwarded (written once, here).
        # Hooks (ingest): frames, and the end of a run (the reports).
        self.on_hello = self.events.on_hello
        self.on_ack = self.events.on_ack
        self.on_oom = self.events.on_oom
        self.on_reject = self.events.on_reject
        self.run_ended = self.events.run_ended
        self.expect = self.store.expect
        # Scheduling: new metrics, the tickers, one awaited tick (tests, benchmarks).
        self.on_metrics = self.schedule.on_metrics
        self.run_due = self.schedule.run_due
        self.expire_proposals = self.schedule.expire_proposals
        self.start = self.schedule.start
        self.stop = self.schedule.stop
        # Operators (the REST routes).
        self.approve = self.actions.approve
        self.reject = self.actions.reject
        self.submit_manual = self.actions.submit_manual
        self.rollback = self.actions.rollback
        self.set_mode = self.actions.set_mode
        self.set_policy = self.actions.set_policy
        self.set_overrides = self.actions.set_overrides
        # Reads (routes, dashboard hub, /metrics, reports).
        self.job_control = self.reads.job_control
        self.job_status = self.reads.job_status
        self.cost_fit = self.reads.cost_fit
        self.proposal_counts = self.reads.proposal_counts
        self.activity_counts = self.reads.activity_counts
        self.policy_settings = self.reads.policy_settings
        self.overrides = self.reads.overrides
        self.placements = self.reads.placements
        self.proposals = self.reads.proposals
        self.proposal = self.reads.proposal
        self.audit = self.reads.audit
        # Which jobs this replica holds (cluster hand-over, forgetting idle jobs).
        self.controls = self.store.controls
        self.known = self.store.known
        self.jobs = self.store.jobs
        self.forget = self.store.forget
        self.take_over = self.rollout.take_over
