"""The end-of-run report of a job (docs/api.md, "End-of-run report").

- ``GET /api/v1/jobs/{job}/report`` (viewer): JSON; ``?format=html`` for one self-contained
  HTML page (plotly.js inlined, opens offline); ``?compare=OTHER`` for two runs side by side.
  A job with ranks still connected gets a report built now; a finished one its stored report.
- ``POST /api/v1/jobs/{job}/report`` (operator): build and store the report now.
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Any, Literal

from fastapi import APIRouter, HTTPException, Query, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response

from backend.api.deps import OperatorDep, PartsDep, ViewerDep
from backend.api.forwarding import from_owner
from backend.api.routes.pages import report_csp
from backend.parts import Parts
from backend.report.collect import ON_DEMAND
from backend.report.html import render, render_compare

__all__ = ["router"]

router = APIRouter(prefix="/api/v1/jobs", tags=["jobs"])


async def _report(parts: Parts, job: str) -> dict[str, Any]:
    view = parts.live.view(job)
    running = view is not None and view.connected_ranks > 0
    found = None if running else await parts.reports.stored(job)
    if found is None:
        found = await parts.reports.build(job, reason=ON_DEMAND, finished=False)
    if found is None:
        raise HTTPException(404, f"Job '{job}' not found.")
    return found


# Both media types of the answer, so the OpenAPI document says what ``?format=html`` returns.
_REPORT_CONTENT: dict[int | str, dict[str, Any]] = {200: {
    "description": "The report as JSON (two of them, `{data, count}`, with `compare`), or with "
                   "`format=html` one self-contained HTML page.",
    "content": {"application/json": {"schema": {"type": "object"}},
                "text/html": {"schema": {"type": "string"}}},
}}


@router.get("/{job}/report", summary="End-of-run report of a job", responses=_REPORT_CONTENT)
async def get_report(
    job: str, _actor: ViewerDep, parts: PartsDep, request: Request,
    format: Annotated[Literal["json", "html"], Query(description="json, or html: one offline page")] = "json",
    compare: Annotated[str | None, Query(min_length=1, max_length=128,
                                         description="another job: both runs side by side")] = None,
) -> Response:
    if (owners := await from_owner(request, parts, job)) is not None:
        return owners  # a job another replica controls: its report, from live state there
    a = await _report(parts, job)
    if compare is None:
        if format == "html":
            return HTMLResponse(await asyncio.to_thread(render, a), headers={"Content-Security-Policy": report_csp()})
        return JSONResponse(a)
    b = await _report(parts, compare)
    if format == "html":
        return HTMLResponse(await asyncio.to_thread(render_compare, a, b), headers={"Content-Security-Policy": report_csp()})
    return JSONResponse({"data": [a, b], "count": 2})


@router.post("/{job}/report", summary="Store the job's report now", response_model=dict[str, Any])
async def store_report(job: str, _actor: OperatorDep, parts: PartsDep, request: Request) -> dict[str, Any] | Response:
    if (owners := await from_owner(request, parts, job)) is not None:
        return owners
    view = parts.live.view(job)
    finished = view is not None and view.connected_ranks == 0
    found = await parts.store_report(job, reason=ON_DEMAND, finished=finished)
    if found is None:
        raise HTTPException(404, f"Job '{job}' not found.")
    return found
