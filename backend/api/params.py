"""Ranges of the REST API's numeric path and query parameters, checked at the edge (a 422
with one sentence) so no number the database cannot hold reaches SQL (issue 15: a proposal
id of 2**64 answered 500)."""

from __future__ import annotations

from typing import Annotated

from fastapi import Path, Query
from pydantic import Field

__all__ = ["INT64_MAX", "RowId", "RankList", "BatchIndex"]

INT64_MAX = 2**63 - 1

RowId = Annotated[int, Path(ge=1, le=INT64_MAX, description="A row id (1 to 2**63-1).")]
RankList = Annotated[list[Annotated[int, Field(ge=0, le=2**31 - 1)]] | None, Query(
    description="Only these ranks (repeat the parameter; 0 to 2**31-1).")]
BatchIndex = Annotated[int | None, Query(ge=0, le=INT64_MAX)]
