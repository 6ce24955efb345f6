"""The control loop: modes, proposal lifecycle, guardrails, rollback and measured effect.

The policy (``backend.policy``) only decides; this module acts on its decisions. The event
loop owns each job's control state (``_JobState``); SQL (``backend.storage.control``) holds
the truth, so a restarted backend resumes where it stopped, and is reached only through the
``SqlGateway`` thread. Each change publishes a snapshot of the job's control state
(``job_control``), which the jobs routes, the dashboard hub and ``/metrics`` read without
touching SQL. One job's actions run one at a time (a lock per job).

Policy runs are scheduled like the hub's ticks: ``on_metrics`` adds the job to a dirty set
and a ticker starts a run for each dirty job that is due (every frame while it warms up,
then at most every ``policy_min_interval_s`` and never faster than five times the last
run's cost); the decision itself runs in the ``PolicyRunner`` (a process of its own).

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

from backend.control.actions import OperatorActions
from backend.control.core import MODES
from backend.control.errors import ConflictError, ControlError, InvalidError, NotFoundError
from backend.control.hook_events import HookEvents
from backend.control.policy_loop import PolicyLoop
from backend.control.read_model import ReadModel
from backend.control.scheduling import Scheduling

__all__ = ["Controller", "ControlError", "NotFoundError", "ConflictError", "InvalidError", "MODES"]


class Controller(HookEvents, Scheduling, PolicyLoop, OperatorActions, ReadModel):
    """Runs the control loop of every job. ``notify(job)`` tells the dashboard a job changed.

    Its parts, each in its own module: the shared state and writes (``core``), hook events,
    scheduling, policy runs (``policy_loop``), operator actions and the read model."""
