"""The fence of each job's control (``job_owners``): the lease epoch of the replica that owns
the job, as the store of record knows it.

A replica that takes a job installs its epoch (``take_epoch``: only a higher one replaces the
row's); every control write checks, in its own transaction and as its last statement before
the commit, that the row still holds that epoch (``check_epoch``). A replica that lost the
lease, paused or stalled while another took the job, therefore never commits: the new owner
installed a higher epoch first, or its installation waited for this commit and then read it.
"""

from __future__ import annotations

import time

from sqlalchemy import Float, String, select, text, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Mapped, Session, mapped_column

from backend.storage.base import Base

__all__ = ["JobOwnerRow", "take_epoch", "check_epoch", "epoch_of"]


class JobOwnerRow(Base):
    """Who controls a job and under which lease epoch (it only rises)."""

    __tablename__ = "job_owners"
    job: Mapped[str] = mapped_column(String(128), primary_key=True)
    epoch: Mapped[int]
    replica: Mapped[str] = mapped_column(String(64))
    updated_at: Mapped[float] = mapped_column(Float, default=time.time)


def epoch_of(s: Session, job: str) -> tuple[int, str] | None:
    """(epoch, replica) of the job's row; None when no replica ever controlled it."""
    row = s.execute(select(JobOwnerRow.epoch, JobOwnerRow.replica).where(JobOwnerRow.job == job)).first()
    return None if row is None else (int(row[0]), str(row[1]))


def take_epoch(s: Session, job: str, replica: str, epoch: int | None) -> int | None:
    """Install ``epoch`` for ``replica`` unless the row holds a higher one (None: refused).
    ``epoch`` None (one replica, no lease service): the row's epoch plus one. The caller commits."""
    for _ in range(3):
        held = epoch_of(s, job)
        want = epoch if epoch is not None else (held[0] + 1 if held is not None else 1)
        if held is None:
            try:
                with s.begin_nested():
                    s.add(JobOwnerRow(job=job, epoch=want, replica=replica, updated_at=time.time()))
                return want
            except IntegrityError:
                continue  # another replica's row came first: compare with it
        if held[0] > want or (held[0] == want and held[1] != replica):
            return None
        done = s.execute(update(JobOwnerRow).where(JobOwnerRow.job == job, JobOwnerRow.epoch <= want)
                         .values(epoch=want, replica=replica, updated_at=time.time()))
        if done.rowcount == 1:  # type: ignore[attr-defined]
            return want
    return None


def check_epoch(s: Session, job: str, replica: str, epoch: int, *, idle_limit_s: float) -> tuple[int, str] | None:
    """The fence of one control write: None when ``replica`` still holds ``epoch`` for
    ``job`` (the row stays locked until the caller's commit), else the (epoch, replica) that
    holds it now. Run it last, just before the commit: a stall before it ends in a refusal,
    not in a write. On PostgreSQL a session paused between this check and its commit is
    ended by the server after ``idle_limit_s`` (its write is lost, nobody waits on its lock)."""
    if s.get_bind().dialect.name == "postgresql":
        s.execute(text(f"SET LOCAL idle_in_transaction_session_timeout = {max(1, int(idle_limit_s * 1000))}"))
    done = s.execute(update(JobOwnerRow).where(JobOwnerRow.job == job, JobOwnerRow.epoch == epoch,
                                               JobOwnerRow.replica == replica)
                     .values(updated_at=time.time()))
    if done.rowcount == 1:  # type: ignore[attr-defined]
        return None
    return epoch_of(s, job) or (0, "")
