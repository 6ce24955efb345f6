"""Placements rolled out (``Rollout``): the one part that makes a new placement
version in force (an approved proposal, a rollback, a cost-model change), sends it to the
job's ranks, records their acks, and sends the placement in force again after a take-over.

Versions themselves are numbered in one place, ``records.next_version`` (docs/design.md,
"Who numbers placements"); this object is the only caller that adds a placement to a job
already running here (``records.create_job`` and ``records.reshape`` add its first)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

from sqlalchemy.orm import Session

from backend.control import effect, inputs, records
from backend.control.core import ActorLike, JobState, JobStore
from backend.control.errors import ConflictError, ControlError, InvalidError, error_detail
from backend.peers.connections import HookConnections
from backend.storage import control as db
from rebalancer_wire.protocol import Placement, check_shares

__all__ = ["Rollout"]

log = logging.getLogger("backend.control.controller")


class Rollout:
    """Makes placements the ones in force (recorded, fenced, then sent) and follows their acks."""

    def __init__(self, *, store: JobStore, connections: HookConnections):
        self.store = store
        self.connections = connections
        self._resends: set[asyncio.Task[None]] = set()  # placements sent after a take-over

    def message(self, st: JobState, *, proposal_id: int | None = None, reason: str = "") -> Placement:
        """The placement in force, as the hooks receive it."""
        return _placement(st, proposal_id, reason)

    def hello_reply(self, st: JobState) -> Placement:
        """The placement in force for a rank's hello: the same object for every rank while the
        placement stays (a check of the shares, not a copy), so that its frame is encoded once
        per job (``HookConnections.text``), not once per rank."""
        m = st.hello_reply
        if (m is None or m.version != st.version or m.epoch != (st.epoch or 0)
                or m.global_batch_size != st.global_batch_size or m.length_sq_weight != st.length_sq_weight
                or m.shares != st.shares):
            m = st.hello_reply = _placement(st, None, "")
        return m

    async def send(self, job: str, msg: Placement) -> None:
        if not self.store.controls(job):  # the lease went while we wrote: its owner sends (fenced)
            log.warning("placement %s of job %s not sent: this replica no longer controls the job", msg.version, job)
            return
        try:
            await self.connections.send(job, msg)
        except Exception:  # a dead socket must not undo a recorded decision; hello resyncs
            log.exception("sending placement %s of job %s failed", msg.version, job)

    def _mint(self, s: Session, st: JobState, shares: Sequence[int], *, source: str,
              actor: ActorLike, reason: str, proposal_id: int | None = None,
              current: db.PlacementRow | None | bool = True,
              predicted_step_ms: float | None = None, auto: bool = False) -> db.PlacementRow:
        """Add the next placement version and make it the one in force here (the caller
        commits, then sends it). A pipelined job's placement carries the stage model's
        prediction made now, from the pipelines' times in force, whatever proposed it; its
        step is the placement's ``predicted_step_ms`` (the one the effect is measured against)."""
        prediction = inputs.pipeline_prediction(self.store.live, st.job, shares)
        if prediction is not None and prediction["predicted_step_ms"] is not None:
            predicted_step_ms = prediction["predicted_step_ms"]
        row = records.new_placement(
            s, st.job, shares, source=source, actor=actor, reason=reason, at=self.store.wall(),
            proposal_id=proposal_id, current=current, predicted_step_ms=predicted_step_ms, auto=auto,
            prediction=prediction)
        st.version, st.shares = row.version, list(shares)
        st.pipeline_prediction = prediction
        return row

    @staticmethod
    def _reset_applied(st: JobState) -> None:
        st.applied, st.effective, st.measured = False, None, False

    async def apply(self, st: JobState, proposal_id: int, *, actor: ActorLike, reason: str | None,
                    auto: bool = False) -> dict[str, Any]:
        """Make proposal ``proposal_id`` the next placement version and send it (the caller
        holds the job's lock): what an approval, auto mode and ``apply=true`` come to."""
        store, job = self.store, st.job

        def work(s: Session) -> tuple[dict[str, Any], float | None]:
            prop = records.proposal_to_decide(s, job, proposal_id, "approved")
            store.refuse_if_ended(job)
            if st.mode == "observe":
                raise ConflictError(f"Job '{job}' is in observe mode; set the mode to approve or auto to apply proposals.")
            if prop.base_version != st.version:
                records.decide(prop, "expired", f"placement version {st.version} came into force", store.wall())
                store.fence(s, st)
                s.commit()
                store.read_facts(s, st)
                raise ConflictError(
                    f"Proposal {proposal_id} was computed against placement version {prop.base_version} "
                    f"but version {st.version} is in force; refresh.")
            if prop.expires_at is not None and store.wall() > prop.expires_at:
                records.decide(prop, "expired", "older than its TTL", store.wall())
                store.fence(s, st)
                s.commit()
                store.read_facts(s, st)
                raise ConflictError(f"Proposal {proposal_id} expired; refresh.")
            shares = list(prop.shares)
            try:
                check_shares(shares, world_size=st.world_size, global_batch_size=st.global_batch_size)
                store.check_overrides(st, shares)
            except (ValueError, InvalidError) as exc:
                raise ConflictError(f"Proposal {proposal_id} no longer fits: {error_detail(exc)} Refresh.") from None
            row = self._mint(
                s, st, shares, source="auto" if auto else prop.source, actor=actor,
                reason=reason or prop.reason, proposal_id=prop.id, auto=auto,
                predicted_step_ms=prop.predicted_step_ms_after)
            records.approve(s, prop, row, actor=actor, reason=reason, auto=auto, at=store.wall())
            k = (prop.explanation or {}).get("length_sq_weight")
            if k is not None:  # an operator's cost model
                records.audit_cost_model(s, prop, row, length_sq_weight=k, previous=st.length_sq_weight,
                                         actor=actor, reason=reason)
            store.fence(s, st)
            s.commit()
            store.read_facts(s, st)
            return prop.public(), k

        try:
            out, k = await store.sql(work)
        except ControlError:
            store.publish(st)
            raise
        if k is not None:
            st.length_sq_weight = float(k)  # the message carries it
        self._reset_applied(st)
        st.status, st.status_detail = "proposal_pending", st.waiting_detail()
        store.publish(st)
        await self.send(job, self.message(st, proposal_id=proposal_id, reason=out["reason"]))
        return out

    async def issue(self, st: JobState, shares: list[int], *, source: str, actor: ActorLike,
                    reason: str, action: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        """Record and send a placement that no proposal stands behind (rollback, cost model)."""
        store = self.store

        # Pending proposals stay: approving one now answers 409 (computed against an older
        # version), and the next policy run supersedes it.
        def work(s: Session) -> dict[str, Any]:
            store.refuse_if_ended(st.job)
            old = db.latest_placement(s, st.job)
            row = self._mint(s, st, shares, source=source, actor=actor, reason=reason, current=old)
            records.issued(s, row, old, source=source, actor=actor, action=action, params=params,
                           reason=reason)
            store.fence(s, st)
            s.commit()
            store.read_facts(s, st)
            return row.public()

        out = await store.sql(work)
        self._reset_applied(st)
        store.publish(st)
        await self.send(st.job, self.message(st, reason=reason))
        return out

    def record_acks(self, s: Session, st: JobState, row: db.PlacementRow, new: dict[int, int]) -> None:
        """Merge ranks' acks (rank -> batch index) into ``row`` (gateway thread); once every
        rank acked the placement in force, the job follows it (applied, effective)."""
        live = self.store.live
        w = int(self.store.knob(st, "effect_window_steps"))

        def step_ms_before(e: int) -> float | None:
            lo, hi = effect.before_window(e, w)
            return effect.window_step_ms(live, st.job, lo=lo, hi=hi)

        records.record_acks(s, row, new, world_size=st.world_size, at=self.store.wall(),
                            step_ms_before=step_ms_before)
        if row.version == st.version and row.applied_at is not None:
            st.follow(row)

    async def acks_from_metrics(self, st: JobState) -> None:
        """Acks lost on the way (say, sent while the backend restarted): every rank's steps
        show the version in force, so take the first batch index each trained under it."""
        if st.applied or st.version == 0:
            return
        first = effect.first_batches_under(self.store.live, st.job, st.world_size, st.version)
        if first is None:
            return  # not every rank shows it yet; or the switch fell out of the buffers
        store = self.store

        def work(s: Session) -> None:
            row = db.get_placement(s, st.job, st.version)
            if row is not None:
                missing = {r: k for r, k in first.items() if str(r) not in (row.acks or {})}
                self.record_acks(s, st, row, missing)
                s.commit()
                store.read_facts(s, st)

        await store.sql(work)

    def take_over(self, job: str) -> None:
        """This replica just took ``job``'s lease: its state reloads from the store of record
        (``JobStore.reload``), and ranks connected here get the placement in force there."""
        self.store.reload(job)
        if self.connections.ranks(job):
            task = asyncio.get_running_loop().create_task(self._resend(job), name=f"rebalancer-resend-{job}")
            self._resends.add(task)
            task.add_done_callback(self._resends.discard)

    async def _resend(self, job: str) -> None:
        """After a take-over: the placement in force (read again from the store of record,
        under our new epoch) to the ranks connected here; one they already run is a no-op."""
        try:
            st = await self.store.load(job)
            if st is None or st.epoch is None:
                return
            async with st.lock:
                await self.send(job, self.message(st))
        except Exception as exc:  # the next hello answers it too
            log.warning("sending job %s's placement in force after the take-over failed: %s", job, exc)


def _placement(st: JobState, proposal_id: int | None, reason: str) -> Placement:
    return Placement(job=st.job, version=st.version, shares=list(st.shares),
                     global_batch_size=st.global_batch_size, proposal_id=proposal_id,
                     reason=reason, length_sq_weight=st.length_sq_weight, epoch=st.epoch or 0)
