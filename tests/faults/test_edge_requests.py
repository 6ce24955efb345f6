"""The HTTP edge in process (backend.api.edge, issue 26 items 1 and 3-6): the token before
the body, 413 for bodies over the limit, HEAD as GET, NUL refused on SQLite, the last admin
token, hook tokens for job names the protocol refuses."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from backend.api.edge import NUL_SENTENCE, too_large
from backend.settings import Settings
from tests.backend._app import make_app

ADMIN = "admin-secret-0123456789"
LIMIT = 4096
AUTH = {"Authorization": f"Bearer {ADMIN}"}


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    tmp: Path = tmp_path_factory.mktemp("edge")
    with TestClient(make_app(tmp, admin_token=ADMIN, max_body_bytes=LIMIT)) as c:
        yield c


def _viewer(client: TestClient) -> str:
    r = client.post("/api/v1/tokens", json={"role": "viewer", "name": "v"}, headers=AUTH)
    assert r.status_code == 201, r.text
    return str(r.json()["secret"])


def test_a_body_without_a_token_is_401_before_validation(client: TestClient) -> None:
    # an invalid body (422 once parsed) and a huge one: the token comes first, both get 401
    r = client.post("/api/v1/tokens", json={"role": "nobody"})
    assert (r.status_code, r.json()) == (401, {"detail": "Missing or invalid bearer token."})
    r = client.post("/api/v1/tokens", content=b"x" * (LIMIT * 4), headers={"Content-Type": "application/json"})
    assert r.status_code == 401


def test_a_body_with_a_low_role_is_403_before_validation(client: TestClient) -> None:
    viewer = _viewer(client)
    r = client.post("/api/v1/tokens", content=b"{" * (LIMIT * 4),
                    headers={"Authorization": f"Bearer {viewer}", "Content-Type": "application/json"})
    assert (r.status_code, r.json()) == (403, {"detail": "This action needs the admin role."})


def test_a_body_over_the_limit_is_413(client: TestClient) -> None:
    body = b'{"role": "viewer", "name": "' + b"a" * LIMIT + b'"}'
    r = client.post("/api/v1/tokens", content=body, headers={**AUTH, "Content-Type": "application/json"})
    assert (r.status_code, r.json()) == (413, {"detail": too_large(LIMIT)})


def test_a_chunked_body_over_the_limit_is_413(client: TestClient) -> None:
    def chunks() -> Iterator[bytes]:
        for _ in range(8):
            yield b" " * 1024

    r = client.post("/api/v1/tokens", content=chunks(), headers={**AUTH, "Content-Type": "application/json"})
    assert (r.status_code, r.json()) == (413, {"detail": too_large(LIMIT)})


def test_a_body_under_the_limit_passes(client: TestClient) -> None:
    r = client.post("/api/v1/tokens", json={"role": "viewer", "name": "b" * 100}, headers=AUTH)
    assert r.status_code == 201, r.text


def test_the_body_limit_is_range_checked() -> None:
    with pytest.raises(ValueError, match="max_body_bytes"):
        Settings(max_body_bytes=10)
    with pytest.raises(ValueError, match="max_body_bytes"):
        Settings(max_body_bytes=1 << 40)


@pytest.mark.parametrize("path", ["/healthz", "/api/v1/jobs", "/api/v1/tokens", "/metrics", "/", "/job/x",
                                  "/openapi.json", "/static/css/app.css"])
def test_head_answers_as_get_without_a_body(client: TestClient, path: str) -> None:
    get = client.get(path, headers=AUTH)
    head = client.head(path, headers=AUTH)
    assert head.status_code == get.status_code == 200, (path, head.status_code, get.status_code)
    assert head.content == b""
    assert head.headers.get("content-type") == get.headers.get("content-type")


@pytest.mark.parametrize("body", [
    {"role": "viewer", "name": "a\u0000"},
    {"role": "viewer", "name": "ok", "reason": "x\u0000y"},
])
def test_nul_in_a_body_is_422_on_sqlite(client: TestClient, body: dict[str, str]) -> None:
    r = client.post("/api/v1/tokens", json=body, headers=AUTH)
    assert (r.status_code, r.json()) == (422, {"detail": NUL_SENTENCE})
    names = [t["name"] for t in client.get("/api/v1/tokens", headers=AUTH).json()["data"]]
    assert not any("\x00" in n for n in names)


def test_nul_in_a_path_or_query_is_422_on_sqlite(client: TestClient) -> None:
    assert client.get("/api/v1/jobs/a%00b", headers=AUTH).json() == {"detail": NUL_SENTENCE}
    r = client.delete("/api/v1/tokens/1?reason=a%00", headers=AUTH)
    assert (r.status_code, r.json()) == (422, {"detail": NUL_SENTENCE})


def _request_strings(doc: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(where, schema) of every string a request may carry: parameters and request bodies,
    through their ``$ref``s (schemas with an enum name their values)."""
    comps = doc["components"]["schemas"]

    def walk(node: Any, where: str, seen: frozenset[str]) -> Iterator[tuple[str, dict[str, Any]]]:
        if isinstance(node, list):
            for i, item in enumerate(node):
                yield from walk(item, f"{where}[{i}]", seen)
        elif isinstance(node, dict):
            ref = node.get("$ref", "")
            if ref.startswith("#/components/schemas/") and ref not in seen:
                yield from walk(comps[ref.rsplit("/", 1)[1]], ref, seen | {ref})
            if node.get("type") == "string" and "enum" not in node:
                yield where, node
            for key, value in node.items():
                if key not in ("enum", "default"):
                    yield from walk(value, f"{where}.{key}", seen)

    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            for p in op.get("parameters", ()):
                yield from walk(p["schema"], f"{method} {path} {p['in']} {p['name']}", frozenset())
            yield from walk(op.get("requestBody"), f"{method} {path} body", frozenset())


def test_the_document_refuses_nul_in_every_request_string(client: TestClient) -> None:
    # A NUL in a string the document allowed got 422: schemathesis's positive-data check holds
    # a schema-valid request to anything but 422 (issue 38).
    doc = client.get("/openapi.json").json()
    strings = list(_request_strings(doc))
    assert len(strings) >= 20, strings
    loose = [where for where, schema in strings if re.search(schema.get("pattern", ""), "a\x00b")]
    assert loose == [], loose
    assert all(re.search(schema["pattern"], "a name, ok") for _, schema in strings)
    free_keys = doc["components"]["schemas"]["PolicyIn"]["properties"]["custom_weights"]["anyOf"][0]
    assert not re.search(free_keys["propertyNames"]["pattern"], "a\x00")


def test_an_escaped_backslash_u0000_is_no_nul(client: TestClient) -> None:
    r = client.post("/api/v1/tokens", json={"role": "viewer", "name": "\\u0000"}, headers=AUTH)
    assert r.status_code == 201, r.text


def test_a_hook_token_for_a_name_the_protocol_refuses_is_422(client: TestClient) -> None:
    r = client.post("/api/v1/tokens", json={"role": "hook", "job": "../x"}, headers=AUTH)
    assert (r.status_code, r.json()) == (
        422, {"detail": "'job' may not contain '/', '?', '#', '\\' or surrounding spaces, got '../x'."})
    assert client.post("/api/v1/tokens", json={"role": "hook", "job": "ok-1"}, headers=AUTH).status_code == 201


def test_the_last_admin_token_cannot_be_revoked(tmp_path: Path) -> None:
    with TestClient(make_app(tmp_path, admin_token=ADMIN)) as c:
        (me,) = [t for t in c.get("/api/v1/tokens", headers=AUTH).json()["data"] if t["role"] == "admin"]
        r = c.delete(f"/api/v1/tokens/{me['id']}", headers=AUTH)
        assert r.status_code == 409
        assert r.json()["detail"].startswith("This is the last admin token")
        assert "Create another admin token first" in r.json()["detail"]
        other = c.post("/api/v1/tokens", json={"role": "admin", "name": "second"}, headers=AUTH).json()
        assert c.delete(f"/api/v1/tokens/{me['id']}", headers=AUTH).status_code == 200
        r = c.delete(f"/api/v1/tokens/{other['id']}", headers={"Authorization": f"Bearer {other['secret']}"})
        assert r.status_code == 409


@pytest.mark.parametrize("path", ["/", "/job/x", "/healthz", "/api/v1/jobs"])
def test_every_answer_carries_the_security_headers(client: TestClient, path: str) -> None:
    h = client.get(path, headers=AUTH).headers
    assert h["x-frame-options"] == "DENY"
    assert h["x-content-type-options"] == "nosniff"
    assert h["referrer-policy"] == "no-referrer"
    csp = h["content-security-policy"]
    assert "frame-ancestors 'none'" in csp
    assert "script-src 'self'" in csp and "'unsafe-inline'" not in csp.split("script-src")[1].split(";")[0]
