"""One policy run for a job (``PolicyLoop.run``, under the job's lock): hand the policy its
inputs, record its proposal, apply it in auto mode (through ``Rollout``), and measure the
effect of the placement in force. When runs happen is scheduling.py's."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from typing import TYPE_CHECKING, Any

from sqlalchemy.orm import Session

from backend.control import effect, inputs, records
from backend.control.errors import (
    ConflictError,
)
from backend.storage import control as db

if TYPE_CHECKING:
    from backend.policy.types import Decision, Explanation

from backend.control.core import SYSTEM, JobState, JobStore
from backend.control.policy_runs import PolicyRunner
from backend.control.rollout import Rollout

__all__ = ["PolicyLoop"]

log = logging.getLogger("backend.control.controller")


class PolicyLoop:
    """Runs the policy for one job at a time and acts on its decision."""

    def __init__(self, *, store: JobStore, rollout: Rollout, runner: PolicyRunner):
        self.store = store
        self.rollout = rollout
        self.runner = runner  # where decide() runs (a process of its own at scale)
        self.runs = 0

    def warm(self) -> None:
        """A job's first decisions are near: start the policy worker now."""
        self.runner.start()

    def close(self) -> None:
        self.runner.close()

    def _settled(self, st: JobState) -> bool:
        """True once every rank trains under the placement in force (acked or seen in metrics)."""
        if st.applied or st.version == 0:  # version 0 is every hook's starting split
            return True
        view = self.store.live.view(st.job)
        if view is None or len(view.ranks) < st.world_size:
            return False
        return all(r.placement_version is not None and r.placement_version >= st.version
                   for r in view.ranks)

    async def run(self, st: JobState) -> None:
        if self.store.live.ended(st.job):
            return  # the run ended: nothing it is sent would take effect (run_ended)
        if not self.store.controls(st.job):
            return  # another replica holds the job's lease (or Redis is down): it decides
        self.runs += 1
        await self.rollout.acks_from_metrics(st)
        await self._measure_effect(st)
        from backend.policy import InfeasibleError, Rollback, replaces_pending
        from backend.policy.types import Proposal as PolicyProposal

        if not self._settled(st):
            st.status, st.status_detail = "proposal_pending", st.waiting_detail()
            self.store.publish(st)
            return
        pending = st.pending
        if pending is not None and pending["source"] != "policy":
            return  # an operator's own proposal is not replaced by the policy
        cfg = self.store.config(st)
        constraints = inputs.constraints_from(st.overrides)
        version = st.version
        started = time.perf_counter()
        # The observation's rows are copied from live state on a worker thread (at thousands
        # of ranks it takes long enough to delay every websocket); its objects are built and
        # the decision made in the runner (a process of its own at scale).
        obs = await asyncio.to_thread(
            inputs.observation_rows, self.store.live, st.job, world_size=st.world_size,
            global_batch_size=st.global_batch_size, shares=list(st.shares), version=st.version,
            effective=st.effective, window_steps=cfg.window_steps, length_sq_weight=st.length_sq_weight,
            # The policy does not retry a rolled-back direction until the cost changed.
            rollbacks=[Rollback(k, tuple(before), tuple(after)) for k, before, after in st.rollbacks])
        if obs is None:
            return  # no data yet
        # A run's cost, which spaces the job's runs: copying the rows here plus the decision
        # where it ran (not a policy worker's start-up, nor the wait for a busy one).
        rows_s = time.perf_counter() - started
        try:
            decision, cost_s = await self.runner.decide_timed(obs, cfg, constraints)
        except InfeasibleError as exc:
            st.think_s = time.perf_counter() - started
            st.status, st.status_detail = "imbalanced", f"the overrides admit no placement: {exc}"
            self.store.publish(st)
            return
        st.think_s = rows_s + cost_s
        expl = decision.explanation
        if expl is not None and len(expl.ranks) == st.world_size:
            ranks = sorted(expl.ranks, key=lambda r: r.rank)
            st.cost_fit = (tuple(r.a_ms for r in ranks), tuple(r.c_ms for r in ranks))
        if decision.cost_model is not None:
            st.cost_model = decision.cost_model.as_dict()
        if st.version != version:
            return  # the placement changed while the policy was thinking
        if await self._follow_cost_model(st, decision):
            return  # the next run proposes against the placement with the new cost model
        if not isinstance(decision, PolicyProposal):
            st.status = ("warming_up" if decision.status in ("warming_up", "no_data")
                         else "imbalanced" if decision.status == "infeasible" else "balanced")
            st.status_detail = decision.detail
            self.store.publish(st)
            return
        # The policy capped the move already (auto mode: max_move_fraction, memory caps).
        shares = list(decision.shares)
        if shares == st.shares:
            st.status, st.status_detail = "balanced", "the policy's split equals the placement in force"
            self.store.publish(st)
            return
        if pending is not None and list(pending["shares"]) == shares and pending["base_version"] == st.version:
            # Already on the table (say, shown before the mode became auto).
            if st.mode == "auto" and pending["status"] == "proposed":
                await self._apply_auto(st, pending["id"])
            return
        assert expl is not None  # a Proposal always explains itself
        why = f"placement version {st.version} came into force"
        if pending is not None and pending["status"] == "proposed" and pending["base_version"] == st.version:
            # The one on screen stays until a new one is clearly better and it has been up
            # long enough to be read: noise alone must not replace it (issue 39).
            if not replaces_pending(expl, pending["shares"], age_s=self.store.wall() - pending["created_at"],
                                    margin=float(self.store.knob(st, "proposal_margin")),
                                    min_age_s=float(self.store.knob(st, "proposal_min_age_s"))):
                return
            why = "a clearly better split"

        def work(s: Session) -> int | str:
            if self.store.live.ended(st.job):
                return "the job ended (every rank said goodbye) while the policy was deciding"
            blocked = records.refused_before(s, st.job, st.version, shares)
            if blocked:
                return blocked
            prop = self.store.add_proposal(
                s, st, shares, source="policy", strategy=expl.strategy, actor=SYSTEM,
                reason=decision.reason, explanation=_explanation_dict(expl),
                before=expl.step_ms_before, after=expl.step_ms_after, gain=expl.gain)
            records.supersede(s, st.job, prop, why)
            self.store.fence(s, st)
            s.commit()
            self.store.read_facts(s, st)
            return prop.id

        got = await self.store.sql(work)
        if isinstance(got, str):
            st.status, st.status_detail = "imbalanced", got
            self.store.publish(st)
            return
        st.status, st.status_detail = "proposal_pending", decision.reason
        self.store.publish(st)
        if st.mode == "auto":
            await self._apply_auto(st, got)

    async def _follow_cost_model(self, st: JobState, decision: Decision) -> bool:
        """Send a placement with the fitted cost model (same shares, new version, k of L +
        k*L^2) when it moved from the one the hooks split by; not in observe mode, nor
        during a cooldown. Which samples a rank gets changes, never its share of the work,
        so no operator needs to approve it; it is recorded like any placement."""
        from backend.policy import NoProposal, cost_model_moved

        model = decision.cost_model
        if model is None or st.mode == "observe":
            return False
        if isinstance(decision, NoProposal) and decision.status == "cooldown":
            return False
        if not cost_model_moved(st.length_sq_weight, model):
            return False
        before, k = st.length_sq_weight, model.length_sq_weight
        reason = (f"cost model: {model.model}, a sample of length L costs L + {k:.3g}*L^2 "
                  f"(R^2 {model.r2:.3f} against {model.r2_linear:.3f} for the length alone)"
                  if k > 0 else f"cost model: {model.model} ({model.detail})")
        st.length_sq_weight = k  # the placement message Rollout.issue sends carries it
        try:
            await self.rollout.issue(st, list(st.shares), source="cost_model", actor=SYSTEM, reason=reason,
                              action="placement.cost_model",
                              params={"length_sq_weight": k, "previous_length_sq_weight": before})
        except Exception as exc:
            st.length_sq_weight = before
            if isinstance(exc, ConflictError) and self.store.live.ended(st.job):
                return False  # the job ended meanwhile: nothing to send it to
            raise
        return True

    async def _apply_auto(self, st: JobState, proposal_id: int) -> None:
        """Auto mode applies the policy's proposal; a job that ended meanwhile keeps it unapplied."""
        try:
            await self.rollout.apply(st, proposal_id, actor="auto", reason="auto mode", auto=True)
        except ConflictError as exc:
            if not self.store.live.ended(st.job):
                raise
            st.status, st.status_detail = "balanced", exc.detail
            self.store.publish(st)

    async def _measure_effect(self, st: JobState) -> None:
        if not st.applied or st.effective is None or st.measured:
            return
        w = int(self.store.knob(st, "effect_window_steps"))
        lo, hi = effect.after_window(st.effective, w)
        view = self.store.live.view(st.job)
        if view is None or view.batch_index is None or view.batch_index < hi:
            return
        after = effect.window_step_ms(self.store.live, st.job, lo=lo, hi=hi, need=max(1, w // 2))
        if after is None:
            return
        may_auto = st.mode == "auto"
        threshold = float(self.store.knob(st, "rollback_threshold"))

        def work(s: Session) -> tuple[list[int], str] | None:
            row = db.get_placement(s, st.job, st.version)
            if row is None:
                return None
            if row.prediction is not None:  # a pipelined job: its stage model's prediction, checked
                checked = inputs.pipeline_check(self.store.live, st.job, row.prediction, batches=(lo, hi),
                                                step_ms=after)
                records.record_prediction(s, row, checked, actor=SYSTEM)
                st.pipeline_prediction = checked
                if checked["missed"]:
                    log.warning("job %s placement %d: the stage model's prediction %s", st.job, row.version,
                                checked["note"])
            factor = 1.0
            if row.previous_shares is not None and st.effective is not None:
                was = effect.before_window(st.effective, w)
                factor = effect.speed_factor(
                    self.store.live, st.job, shares=row.previous_shares, before=was, after=(lo, hi))
                factor *= effect.work_factor(self.store.live, st.job, world_size=st.world_size, before=was,
                                             after=(lo, hi), length_sq_weight=st.length_sq_weight)
            verdict = effect.judge_effect(
                version=row.version, step_ms_before=row.step_ms_before, step_ms_after=after,
                rollback_threshold=threshold,
                may_roll_back=row.auto and may_auto and row.previous_shares is not None,
                speed_factor=factor)
            rollback = records.record_effect(row, verdict)
            self.store.fence(s, st)
            st.measured = True
            st.last_effect = effect.effect_record(row)
            s.commit()
            return rollback

        rollback = await self.store.sql(work)
        if rollback is not None:
            await self.rollout.issue(st, rollback[0], source="rollback", actor=SYSTEM, reason=rollback[1],
                              action="placement.auto_rollback")
        self.store.publish(st)


def _explanation_dict(expl: Explanation) -> dict[str, Any]:
    # JSON round trip: evidence may hold tuples or numbers numpy produced.
    out: dict[str, Any] = json.loads(json.dumps(dataclasses.asdict(expl), default=_json_default))
    return out


def _json_default(o: Any) -> Any:
    if hasattr(o, "item"):
        return o.item()
    if isinstance(o, (set, frozenset)):
        return sorted(o)
    return str(o)
