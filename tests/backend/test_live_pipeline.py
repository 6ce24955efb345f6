"""Live state's book of pipelined jobs (backend.live.pipeline): the shape each job's leaders
said, each pipeline's stage times averaged over its newest steps at the micro-batch count in
force, the fields a /ranks row adds, and a new shape starting the book afresh."""

from __future__ import annotations

import dataclasses

import pytest

from backend.live.pipeline import PipelineBook, same_pipeline
from rebalancer_wire.protocol import Hello, Metrics
from tests.helpers.pipeline import shape, steps


def _hello(rank: int, **kw: object) -> Hello:
    return Hello(job="pp", rank=rank, world_size=2, global_batch_size=16, micro_batches=True, pipeline=shape(rank, **kw))


def test_the_means_are_over_the_newest_steps_at_the_count_in_force() -> None:
    book = PipelineBook(window_steps=20)
    for rank in (0, 1):
        book.register(_hello(rank), new_run=rank == 0)
    assert book.observation("pp") is not None and book.observation("pp").pipelines == (None, None)  # type: ignore[union-attr]
    # pipeline 1: 10 steps at 8 micro-batches, then 5 at 4 (a new placement): only the 4s count
    book.add(Metrics(job="pp", rank=1, steps=steps(1, 0, 10, [8, 8], 0) + steps(1, 10, 5, [12, 4], 1)), _hello(1))
    po = book.observation("pp")
    assert po is not None and po.pipelines[0] is None
    t = po.pipelines[1]
    assert t is not None and (t.n_steps, t.n_microbatches) == (5, 4)
    assert t.stage_ms == pytest.approx((8.0, 16.0)) and t.compute_ms == pytest.approx(24 + 3 * 16)
    assert t.recv_wait_ms == pytest.approx((0.0, 0.5)) and t.rel_noise == 0.0
    assert t.layer_ms == (4.0, 4.0, 4.0, 12.0)
    assert book.rank_fields("pp", 1) == {"pp_stage": 0, "pp_size": 2, "bubble_ms": pytest.approx(
        (10 * 40.0 + 5 * (72 - 32 + 72 - 64) / 2) / 15), "bottleneck_stage": 1}
    assert book.rank_fields("other", 0) == {}


def test_a_new_shape_or_run_starts_afresh_and_a_plain_hello_is_ignored() -> None:
    book = PipelineBook()
    book.register(_hello(0), new_run=True)
    book.add(Metrics(job="pp", rank=0, steps=steps(0, 0, 3, [8, 8], 0)), _hello(0))
    assert book.observation("pp").pipelines[0] is not None  # type: ignore[union-attr]
    book.register(_hello(1), new_run=False)  # the other leader, same shape: kept
    assert book.observation("pp").pipelines[0] is not None  # type: ignore[union-attr]
    book.register(_hello(0, schedule="gpipe"), new_run=False)  # another shape (no leader left): afresh
    assert book.shape("pp").schedule == "gpipe" and book.observation("pp").pipelines == (None, None)  # type: ignore[union-attr]
    plain = dataclasses.replace(_hello(0), pipeline=None)
    book.add(Metrics(job="pp", rank=0, steps=steps(0, 3, 3, [8, 8], 0)), plain)  # not a leader's: ignored
    assert book.observation("pp").pipelines == (None, None)  # type: ignore[union-attr]
    book.register(plain, new_run=True)
    assert book.shape("pp") is None
    assert same_pipeline(shape(0), shape(1, pp_stage=1)) and not same_pipeline(shape(0), None)
