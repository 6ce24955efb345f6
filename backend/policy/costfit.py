"""A step's compute cost fitted from the batches' lengths: ``t = c + a*sum(L) + b*sum(L^2)``.

Attention makes a sample's cost grow faster than its length, so with lengths the policy
fits, per rank (or per device class), a fixed cost ``c``, a linear term ``a`` per token and a
quadratic term ``b`` per squared token, by least squares over a window of recent steps with
all three non-negative (an exact NNLS: every subset of the three columns is solved and the
best feasible one kept; three columns make eight subsets).

The quadratic term is used only where the data can identify it: the ``sum(L^2)`` column
must not be (nearly) a linear function of ``sum(L)`` over the window (equal lengths in every
batch make it so), and adding it must explain the step times better than the linear fit by
more than noise (an F test of the extra term, F >= ``F_MIN``). Otherwise the fit falls back
to the linear model and says why. Too few steps, or non-finite / negative inputs, give no
fit at all (None, or ``ValueError`` for bad input), never a guess.

The job's k of ``L + k*L^2`` (``b/a``) is fitted once over the ranks that need the quadratic
term, not taken from each rank's own ``b/a`` (``shared_length_sq_weight``): the ranks run one
model on one kind of data, so they share the cost's shape and differ in speed. Each rank's own
linear term is small beside a loaded machine's noise and its ``b/a`` swings by orders of
magnitude from window to window; over all the ranks at once, with the steps the machine
slowed left out, k is steady.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import combinations

import numpy as np

from rebalancer_wire.protocol import MAX_LENGTH_SQ_WEIGHT

__all__ = ["CostFit", "CostModel", "fit_cost", "sample_cost", "cost_model_moved", "shared_length_sq_weight",
           "MIN_STEPS", "F_MIN", "MODEL_SAMPLES", "MODEL_LINEAR", "MODEL_FITTED", "SPLIT_SHIFT"]

MIN_STEPS = 6  # fewer steps than this: no fit
F_MIN = 4.0  # F statistic the quadratic term must reach over the linear fit (about p < 0.05)
COLLINEAR_TOL = 1e-3  # relative residual of sum(L^2) on [1, sum(L)] below this: not identifiable
# A fitted model is sent to the hooks when it moves a rank's share of a batch's work by more
# than this (median relative change over the recent steps): a split that far off costs about
# that much step time, half the policy's default gain threshold.
SPLIT_SHIFT = 0.025

# The shared k is searched on a log grid from K_MIN to the wire's bound, 6 points a decade
# (47% apart; where the levelling-off at L^2 is read, a split that far off in k moves a
# rank's share of work far less than SPLIT_SHIFT), then, around an inner minimum, by
# golden-section search; over at most K_RANKS ranks (more add nothing to one number but
# time), with each rank's TRIM share of steps furthest above its fit left out.
K_MIN = 1e-6
K_GRID = np.append(np.logspace(math.log10(K_MIN), math.log10(MAX_LENGTH_SQ_WEIGHT), 73)[:-1], MAX_LENGTH_SQ_WEIGHT)
K_RANKS = 64
TRIM = 0.3
GOLDEN_STEPS = 18  # narrows the two grid intervals around the minimum (2.2x) to under 0.02%

# The job's cost model, as the job view names it.
MODEL_SAMPLES = "samples"  # no cost: every sample costs 1
MODEL_LINEAR = "work (linear)"  # a cost per sample (sample_cost), or lengths weighed as they are
MODEL_FITTED = "fitted a*L+b*L^2"  # lengths weighed L + k*L^2, k = b/a fitted from the step times


@dataclass(frozen=True, slots=True)
class CostModel:
    """The cost model a job's split uses, and how well it explains the step times.

    ``length_sq_weight`` is k of ``L + k*L^2`` (0 unless fitted); ``r2`` the median over
    the fitted ranks of the share of step-time variance it explains (None without a fit),
    ``r2_linear`` the same for the length alone (with lengths); ``ranks_fitted`` /
    ``ranks_quadratic`` how many ranks had a fit and how many of those count for the
    quadratic term; ``split_shift`` how far this model's k would move a rank's share of a
    batch's work from the k in force (median relative change over the recent steps; None
    without lengths); ``detail`` one sentence for humans."""

    model: str
    length_sq_weight: float = 0.0
    r2: float | None = None
    r2_linear: float | None = None
    ranks_fitted: int = 0
    ranks_quadratic: int = 0
    split_shift: float | None = None
    detail: str = ""

    def as_dict(self) -> dict[str, object]:
        return {"model": self.model, "length_sq_weight": self.length_sq_weight, "r2": self.r2,
                "r2_linear": self.r2_linear, "ranks_fitted": self.ranks_fitted, "ranks_quadratic": self.ranks_quadratic,
                "split_shift": self.split_shift, "detail": self.detail}


def cost_model_moved(in_force: float, model: CostModel) -> bool:
    """Whether the job's cost model is worth a new placement: it moves a rank's share of a
    batch's work by more than ``SPLIT_SHIFT`` from the k in force (``model.split_shift``,
    measured against ``in_force``), and something is fitted or in force (the fitted model
    where the length is, another k, or the length again: ``job_cost_model`` already keeps a
    k in force while at least half the ranks still need the quadratic term). A refit whose k
    moves only where the split does not care (``k*L`` far above 1 for the lengths that carry
    the work: they weigh as ``L^2`` either way) sends nothing."""
    if model.split_shift is None or model.split_shift <= SPLIT_SHIFT:
        return False
    return in_force > 0 or model.length_sq_weight > 0


@dataclass(frozen=True, slots=True)
class CostFit:
    """A fitted cost model. ``model`` is ``"quadratic"`` or ``"linear"`` (then ``b_ms`` is 0);
    ``r2`` is the share of step-time variance it explains; ``note`` says why the linear
    model was kept where the quadratic one was tried."""

    model: str
    c_ms: float  # fixed cost per step
    a_ms: float  # per token (unit of length)
    b_ms: float  # per squared token
    r2: float
    n_steps: int
    note: str = ""

    def step_ms(self, sum_l: float, sum_l2: float) -> float:
        """The predicted compute time of a batch with these sums."""
        return self.c_ms + self.a_ms * sum_l + self.b_ms * sum_l2

    def as_dict(self) -> dict[str, object]:
        return {"model": self.model, "c_ms": self.c_ms, "a_ms_per_token": self.a_ms,
                "b_ms_per_token2": self.b_ms, "r2": self.r2, "n_steps": self.n_steps,
                "note": self.note}


def _nnls(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, float]:
    """Exact non-negative least squares for a few columns: the best feasible subset."""
    k = x.shape[1]
    best_coef, best_sse = np.zeros(k), float(np.dot(y, y))
    for size in range(1, k + 1):
        for cols in combinations(range(k), size):
            sub = x[:, cols]
            coef, *_ = np.linalg.lstsq(sub, y, rcond=None)
            if np.any(coef < 0):
                continue
            sse = float(np.sum((y - sub @ coef) ** 2))
            if sse < best_sse - 1e-12 * max(1.0, best_sse):
                full = np.zeros(k)
                full[list(cols)] = coef
                best_coef, best_sse = full, sse
    return best_coef, best_sse


def _check(name: str, values: Sequence[float]) -> np.ndarray:
    arr = np.asarray(values, dtype=float)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be a flat sequence of numbers")
    if not np.all(np.isfinite(arr)) or np.any(arr < 0):
        raise ValueError(f"{name} must be finite and >= 0; got {arr[~np.isfinite(arr) | (arr < 0)][:3].tolist()}")
    return arr


def fit_cost(sum_l: Sequence[float], sum_l2: Sequence[float], step_ms: Sequence[float],
             window: int = 64) -> CostFit | None:
    """Fit ``step_ms ~ c + a*sum_l + b*sum_l2`` (all >= 0) over the last ``window`` steps.

    One entry per measured step of one rank (or of one device class, steps normalised to a
    common speed): the summed lengths of its local batch, their summed squares and the
    measured compute time. Returns None with fewer than ``MIN_STEPS`` steps or when the
    lengths never vary (nothing to fit against). Raises ``ValueError`` on bad input.
    """
    if window < MIN_STEPS:
        raise ValueError(f"window must be >= {MIN_STEPS} steps; got {window}")
    s1, s2, t = _check("sum_l", sum_l), _check("sum_l2", sum_l2), _check("step_ms", step_ms)
    if not len(s1) == len(s2) == len(t):
        raise ValueError(f"sum_l, sum_l2 and step_ms differ in length ({len(s1)}, {len(s2)}, {len(t)})")
    s1, s2, t = s1[-window:], s2[-window:], t[-window:]
    n = len(t)
    if n < MIN_STEPS or float(np.ptp(s1)) <= 0:
        return None
    sst = float(np.sum((t - t.mean()) ** 2))

    def r2(sse: float) -> float:
        return 1.0 - sse / sst if sst > 0 else 1.0

    ones = np.ones(n)
    lin_coef, lin_sse = _nnls(np.column_stack([ones, s1]), t)
    linear = CostFit("linear", float(lin_coef[0]), float(lin_coef[1]), 0.0, r2(lin_sse), n)

    # Is sum(L^2) identifiable beside [1, sum(L)]? Its residual after regressing on them.
    base = np.column_stack([ones, s1])
    proj, *_ = np.linalg.lstsq(base, s2, rcond=None)
    resid = s2 - base @ proj
    spread = float(np.linalg.norm(s2 - s2.mean()))
    if spread <= 0 or float(np.linalg.norm(resid)) / spread < COLLINEAR_TOL:
        return _with_note(linear, "quadratic term not identifiable: sum(L^2) follows sum(L) in every batch")
    if n < MIN_STEPS + 1:
        return _with_note(linear, "too few steps for the quadratic term")
    q_coef, q_sse = _nnls(np.column_stack([ones, s1, s2]), t)
    if q_coef[2] <= 0:
        return _with_note(linear, "quadratic term fitted as 0")
    dof = n - 3
    f_stat = math.inf if q_sse <= 0 else (lin_sse - q_sse) / (q_sse / dof)
    if f_stat < F_MIN:
        return _with_note(linear, f"quadratic term not significant (F = {f_stat:.1f} < {F_MIN:g})")
    return CostFit("quadratic", float(q_coef[0]), float(q_coef[1]), float(q_coef[2]), r2(q_sse), n)


def shared_length_sq_weight(ranks: Sequence[tuple[Sequence[float], Sequence[float], Sequence[float]]]) -> float:
    """The k of ``L + k*L^2`` that best explains the step times of all these ranks at once.

    One entry per rank: its steps' ``sum(L)``, ``sum(L^2)`` and compute ms (checked as
    ``fit_cost`` checks them). Each rank keeps its own fixed cost and speed: its times are
    fitted as ``c_r + a_r * (sum(L) + k*sum(L^2))`` (both >= 0), and k is the one with the
    least squared error summed over the ranks (the best point of ``K_GRID``, then a
    golden-section search between its neighbours), each rank's ``TRIM`` share of steps
    furthest above its fit left out (a step only ever runs late: a wake-up after a
    sleep, a stall, another process's turn; never early). Where the bound fits as well (within
    the F test's margin), k is the least one from which every k up to the bound does: where
    the samples' cost levels off at ``L^2``. Ranks past ``K_RANKS`` are not read.
    Raises ``ValueError`` without a rank of at least ``MIN_STEPS`` steps.
    """
    rows = []
    for s1, s2, t in ranks[:K_RANKS]:
        a1, a2, at = _check("sum_l", s1), _check("sum_l2", s2), _check("step_ms", t)
        if not len(a1) == len(a2) == len(at):
            raise ValueError(f"sum_l, sum_l2 and step_ms differ in length ({len(a1)}, {len(a2)}, {len(at)})")
        if len(at) >= MIN_STEPS:
            rows.append((a1, a2, at))
    if not rows:
        raise ValueError(f"a shared k needs a rank with at least {MIN_STEPS} steps")
    n = max(len(r[2]) for r in rows)
    s1m, s2m, tm, valid = (np.zeros((len(rows), n)) for _ in range(4))
    for i, (a1, a2, at) in enumerate(rows):
        s1m[i, :len(at)], s2m[i, :len(at)], tm[i, :len(at)], valid[i, :len(at)] = a1, a2, at, 1.0
    dropped = (valid.sum(axis=1) - np.ceil((1.0 - TRIM) * valid.sum(axis=1)))[:, None]  # per rank

    def error(k: float) -> float:
        x = s1m + k * s2m
        c, a = _line(x, tm, valid)
        resid = np.where(valid > 0, tm - c - a * x, -np.inf)
        above = np.argsort(np.argsort(-resid, axis=1), axis=1)  # 0: the step furthest above the fit
        kept = valid * (above >= dropped)
        c, a = _line(x, tm, kept)
        return float(np.sum(kept * (tm - c - a * x) ** 2))

    err = np.array([error(float(k)) for k in K_GRID])
    best = int(np.argmin(err))
    # Past some k every sample weighs as L^2 and the error levels off. Where the data cannot
    # tell the bound from the best k (a per-token term below the noise), k is where that
    # plateau begins: the least curvature they support, not a point at random along it.
    dof = max(1.0, float(np.sum(valid) - np.sum(dropped)) - 2 * len(rows) - 1)
    level = err[best] * (1.0 + F_MIN / dof)
    if err[-1] <= level:
        best = len(err) - 1
        while best > 0 and err[best - 1] <= level:
            best -= 1
        return float(K_GRID[best])
    if best == 0:
        return float(K_GRID[0])
    # A minimum inside the grid: golden-section search between its neighbours, in log k.
    lo, hi = math.log(K_GRID[best - 1]), math.log(K_GRID[min(best + 1, len(K_GRID) - 1)])
    g = (math.sqrt(5.0) - 1.0) / 2.0
    m1, m2 = hi - g * (hi - lo), lo + g * (hi - lo)
    e1, e2 = error(math.exp(m1)), error(math.exp(m2))
    for _ in range(GOLDEN_STEPS):
        if e1 <= e2:
            hi, m2, e2 = m2, m1, e1
            m1 = hi - g * (hi - lo)
            e1 = error(math.exp(m1))
        else:
            lo, m1, e1 = m1, m2, e2
            m2 = lo + g * (hi - lo)
            e2 = error(math.exp(m2))
    return float(min(math.exp((lo + hi) / 2.0), MAX_LENGTH_SQ_WEIGHT))


def _line(x: np.ndarray, t: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row, weighted least squares ``t = c + a*x`` with ``c, a >= 0`` (rows of ``w`` > 0)."""
    sw = np.maximum(w.sum(axis=1, keepdims=True), 1e-300)
    mx, mt = (w * x).sum(axis=1, keepdims=True) / sw, (w * t).sum(axis=1, keepdims=True) / sw
    vx = (w * (x - mx) ** 2).sum(axis=1, keepdims=True)
    a = np.where(vx > 0, (w * (x - mx) * (t - mt)).sum(axis=1, keepdims=True) / np.where(vx > 0, vx, 1.0), 0.0)
    c = mt - a * mx
    flat = a < 0  # time falls with work: the mean alone
    a, c = np.where(flat, 0.0, a), np.where(flat, mt, c)
    xx = (w * x * x).sum(axis=1, keepdims=True)
    through_0 = np.maximum((w * x * t).sum(axis=1, keepdims=True) / np.where(xx > 0, xx, 1.0), 0.0)
    neg = c < 0  # a negative fixed cost: through the origin
    return np.where(neg, 0.0, c), np.where(neg, through_0, a)


def _with_note(fit: CostFit, note: str) -> CostFit:
    return CostFit(fit.model, fit.c_ms, fit.a_ms, fit.b_ms, fit.r2, fit.n_steps, note)


def sample_cost(fit: CostFit | None, length: float) -> float:
    """A sample's cost under the fit, in the fit's linear units (tokens): ``L + (b/a) L^2``,
    so a linear fit (or none) weighs samples by length and the partition is unchanged."""
    if not math.isfinite(length) or length < 0:
        raise ValueError(f"a sample length must be finite and >= 0; got {length!r}")
    if fit is None or fit.model != "quadratic":
        return float(length)
    if fit.a_ms <= 0:
        return float(length) * float(length)
    return float(length) + fit.b_ms / fit.a_ms * float(length) ** 2
