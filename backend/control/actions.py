"""Operator actions (``OperatorActions``; the REST routes call these): approve, reject, manual
placements, rollback, mode, policy settings and overrides. Each checks and records the
operator's request; a placement it makes goes through ``Rollout`` (``apply``, ``issue``),
and a change the policy should see marks the job for the scheduler."""

from __future__ import annotations

import logging
import math
from typing import Any

from sqlalchemy.orm import Session

from backend.control import inputs, records
from backend.control.core import MODES, ActorLike, JobStore
from backend.control.errors import ConflictError, InvalidError, NotFoundError, StateError
from backend.control.models import check_policy_changes
from backend.control.read_model import ReadModel
from backend.control.rollout import Rollout
from backend.control.scheduling import PolicyScheduler
from backend.storage import control as db
from rebalancer_wire.protocol import ProtocolError, check_job_name, check_shares

__all__ = ["OperatorActions"]

log = logging.getLogger("backend.control.controller")


class OperatorActions:
    """What an operator may do to a job, checked, recorded and audited."""

    def __init__(self, *, store: JobStore, rollout: Rollout, schedule: PolicyScheduler,
                 reads: ReadModel):
        self.store = store
        self.rollout = rollout
        self.schedule = schedule
        self.reads = reads

    async def approve(self, job: str, proposal_id: int, *, actor: ActorLike,
                      reason: str | None = None) -> dict[str, Any]:
        """Send exactly the reviewed shares as the next placement version."""
        await self.store.refuse_if_elsewhere(job)
        st = await self.store.require(job)
        async with st.lock:
            return await self.rollout.apply(st, proposal_id, actor=actor, reason=reason)

    async def reject(self, job: str, proposal_id: int, *, actor: ActorLike,
                     reason: str | None = None) -> dict[str, Any]:
        await self.store.refuse_if_elsewhere(job)
        st = await self.store.require(job)
        async with st.lock:
            def work(s: Session) -> dict[str, Any]:
                prop = records.proposal_to_decide(s, job, proposal_id, "rejected")
                records.reject(s, prop, actor=actor, reason=reason, at=self.store.wall())
                self.store.fence(s, st)
                s.commit()
                self.store.read_facts(s, st)
                return prop.public()

            out = await self.store.sql(work)
            st.status, st.status_detail = "imbalanced", f"proposal {proposal_id} was rejected"
            self.store.publish(st)
            return out

    async def submit_manual(self, job: str, shares: Any, *, actor: ActorLike, reason: str | None = None,
                            apply: bool = False, force: bool = False,
                            length_sq_weight: float | None = None) -> dict[str, Any]:
        """An operator's own placement: validated, stored as a proposal, applied if asked.

        A placement whose predicted peak memory breaks a rank's memory cap is refused with
        the predicted peak and the cap, unless ``force`` (audited as ``placement.memory_force``).
        ``length_sq_weight`` (k of ``L + k*L^2``, checked by the route) goes with the shares
        (the proposal's ``explanation.length_sq_weight``); None keeps the k in force.
        """
        await self.store.refuse_if_elsewhere(job)
        st = await self.store.require(job)
        async with st.lock:
            if isinstance(shares, list):  # JSON Schema's integers include 12.0
                shares = [int(x) if isinstance(x, float) and x.is_integer() and abs(x) < 2**53 else x
                          for x in shares]
            well_formed = isinstance(shares, list) and all(
                isinstance(x, int) and not isinstance(x, bool) for x in shares)
            try:
                shares = check_shares(shares, world_size=st.world_size, global_batch_size=st.global_batch_size)
            except ValueError as exc:
                # integers that do not fit this job (count, sum, range) are the job's refusal
                error = StateError if well_formed else InvalidError
                raise error(f"Invalid placement: {exc}{st.replicas_sentence()}") from None
            self.store.check_overrides(st, shares)
            if (pipe := self.store.live.pipelines.shape(job)) is not None:
                from backend.policy.pipeline import floor_problem  # numpy: imported where used

                if low := floor_problem(pipe.min_microbatches, pipe.schedule, shares, pipe.pp_size):
                    raise StateError(f"Invalid placement: {low}")
            problems, expl = self.store.memory_problems(st, shares)
            if problems and not force:
                raise StateError(f"Placement breaks memory caps: {'; '.join(problems)}. "
                                   "Send force=true to submit it anyway.")
            if problems:
                expl["memory_forced"] = problems
            if length_sq_weight is not None:
                expl["length_sq_weight"] = float(length_sq_weight)
            costs = self.store.costs(st)
            # A pipelined job's step is no per-sample cost times a share: the stage model's.
            steps = [(p or {}).get("predicted_step_ms") for p in (
                inputs.pipeline_prediction(self.store.live, job, st.shares),
                inputs.pipeline_prediction(self.store.live, job, shares))]
            before, after = (steps[0], steps[1]) if None not in steps else (None, None)
            gain = (before - after) / before if before and after is not None else None

            def work(s: Session) -> tuple[int, dict[str, Any]]:
                self.store.refuse_if_ended(job)
                self.store.close_pending(s, job, "superseded", "an operator submitted a placement")
                prop = self.store.add_proposal(s, st, shares, source="manual", strategy="manual", actor=actor,
                                          reason=reason or "manual placement", costs=costs,
                                          explanation=expl, before=before, after=after, gain=gain)
                records.audit_manual(s, prop, apply=apply, force=force, problems=problems,
                                     actor=actor, reason=reason)
                self.store.fence(s, st)
                s.commit()
                self.store.read_facts(s, st)
                return prop.id, prop.public()

            pid, out = await self.store.sql(work)
            self.store.publish(st)
            if apply:
                return await self.rollout.apply(st, pid, actor=actor, reason=reason)
            return out

    async def rollback(self, job: str, *, actor: ActorLike, reason: str | None = None) -> dict[str, Any]:
        """Go back to exactly the shares in force before the current placement."""
        await self.store.refuse_if_elsewhere(job)
        st = await self.store.require(job)
        async with st.lock:
            def read(s: Session) -> tuple[list[int], int | None]:
                cur = db.latest_placement(s, job)
                if cur is None or cur.previous_shares is None:
                    raise ConflictError(f"Job '{job}' has no previous placement to roll back to.")
                return list(cur.previous_shares), cur.previous_version

            shares, prev_version = await self.store.sql(read)
            if len(shares) != st.world_size:
                raise ConflictError(f"The previous placement of job '{job}' has another world size; it cannot return.")
            return await self.rollout.issue(st, shares, source="rollback", actor=actor,
                                     reason=reason or f"rollback to the shares of version {prev_version}",
                                     action="placement.rollback", params={"to_version": prev_version})

    async def set_mode(self, job: str, mode: str, *, actor: ActorLike, reason: str | None = None) -> dict[str, Any]:
        """The job's mode; for a job not seen yet, a preset its first hello applies."""
        await self.store.refuse_if_elsewhere(job)
        if mode not in MODES:
            raise InvalidError(f"Mode must be one of observe, approve, auto; got {mode!r}.")
        try:
            st = await self.store.require(job)
        except NotFoundError:
            preset = await self._preset_mode(job, mode, actor=actor, reason=reason)
            if preset is not None:
                return preset
            st = await self.store.require(job)  # its first hello came in meanwhile
        async with st.lock:
            def work(s: Session) -> None:
                records.set_mode(s, job, mode, actor=actor, reason=reason, at=self.store.wall())
                self.store.fence(s, st)
                s.commit()

            await self.store.sql(work)
            st.mode, st.last_run = mode, -math.inf
            self.schedule.mark_dirty(job)
            self.store.publish(st)
        return self.reads.job_control(job)

    async def _preset_mode(self, job: str, mode: str, *, actor: ActorLike, reason: str | None) -> dict[str, Any] | None:
        """Store ``mode`` for a job not seen yet; None if the job exists by now."""
        try:
            check_job_name(job)
        except ProtocolError as exc:
            raise InvalidError(f"Cannot preset the mode of job {job[:140]!r}: {exc}") from None

        def work(s: Session) -> bool:
            if db.get_settings(s, job) is not None:
                return False
            records.preset_mode(s, job, mode, actor=actor, reason=reason)
            s.commit()
            return True

        if not await self.store.sql(work):
            return None
        return {"job": job, "mode": mode, "preset": True,
                "detail": f"Job '{job}' has not started yet: mode {mode} is stored as a preset and applies "
                          "when its first rank connects."}

    async def set_policy(self, job: str, changes: dict[str, Any], *, actor: ActorLike,
                         reason: str | None = None) -> dict[str, Any]:
        """Merge ``changes`` into the job's policy settings (None removes a stored value)."""
        await self.store.refuse_if_elsewhere(job)
        st = await self.store.require(job)
        check_policy_changes(changes)
        async with st.lock:
            policy = dict(st.policy)
            for k, v in changes.items():
                if v is None:
                    policy.pop(k, None)
                else:
                    policy[k] = v
            # Each value may be in range and the whole still unusable (window below min_steps):
            # every policy run after it would fail, so refuse it before it is stored.
            from backend.policy.engine import check_config

            try:
                check_config(inputs.policy_config(policy, st.mode, self.store.settings))
            except ValueError as exc:
                raise StateError(str(exc)) from None

            def work(s: Session) -> None:
                records.set_policy(s, job, policy, changes=changes, actor=actor, reason=reason,
                                   at=self.store.wall())
                self.store.fence(s, st)
                s.commit()

            await self.store.sql(work)
            st.policy, st.last_run, st.static_checked = policy, -math.inf, False
            self.schedule.mark_dirty(job)
            self.store.publish(st)
            return inputs.policy_settings(st.policy, st.mode, self.store.settings)

    async def set_overrides(self, job: str, overrides: dict[str, Any], *, actor: ActorLike,
                            reason: str | None = None) -> dict[str, Any]:
        """Replace the job's overrides; when the placement in force breaks them, propose one
        that respects them (applied right away in auto mode)."""
        from backend.policy import InfeasibleError, solve

        await self.store.refuse_if_elsewhere(job)
        st = await self.store.require(job)
        try:
            ov = inputs.validate_overrides(overrides, world_size=st.world_size,
                                           global_batch_size=st.global_batch_size)
        except (InvalidError, StateError) as exc:
            if st.mesh is None:
                raise
            raise type(exc)(f"{exc.detail}{st.replicas_sentence()}") from None
        async with st.lock:
            costs = self.store.costs(st)
            try:
                # Memory caps too: the proposal that respects the overrides must fit the cards.
                target = list(solve([0.0] * st.world_size, costs or [1.0] * st.world_size,
                                    st.global_batch_size, self.store.memory_constraints(st, ov)))
            except InfeasibleError as exc:
                raise StateError(f"The overrides admit no placement: {exc}") from None
            broken: str | None = None
            try:
                inputs.check_overrides(ov, st.shares, global_batch_size=st.global_batch_size)
            except InvalidError as exc:
                broken = exc.detail

            def work(s: Session) -> int | None:
                records.store_overrides(s, job, ov, actor=actor, reason=reason, at=self.store.wall())
                pid = None
                if broken is not None:
                    self.store.close_pending(s, job, "superseded", "the overrides changed")
                    prop = self.store.add_proposal(s, st, target, source="override", strategy="override",
                                              actor=actor, reason=f"respect the new overrides: {broken}",
                                              costs=costs)
                    pid = prop.id
                self.store.fence(s, st)
                s.commit()
                self.store.read_facts(s, st)
                return pid

            pid = await self.store.sql(work)
            st.overrides, st.last_run = ov, -math.inf
            self.schedule.mark_dirty(job)
            self.store.publish(st)
            if pid is not None and st.mode == "auto":
                await self.rollout.apply(st, pid, actor="auto", reason="auto mode: overrides changed", auto=True)
            return {**ov, "proposal_id": pid}
