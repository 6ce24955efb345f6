"""Imports run downward: nothing below the routes and the wiring imports them, and the hook
never imports the backend; the two share only the wire (rebalancer_wire, standard library
only). Read from the source (AST), type-only and function-level imports
included. KNOWN_UPWARD lists the arrows that still point up (issue 22's redesign removes
them); the test fails on any new one, and on a listed one that is gone (drop it from the list)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The top layers: they may import anything in the backend.
TOP = ("backend/main.py", "backend/parts.py", "backend/cli.py", "backend/demo.py",
       "backend/run_cmd.py", "backend/client_types.py", "backend/__main__.py", "backend/api/")
UPPER = ("backend.api", "backend.parts", "backend.main", "backend.cli", "backend.demo", "backend.run_cmd")
KNOWN_UPWARD: set[tuple[str, str]] = set()


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


def _modules(package: str) -> list[Path]:
    return sorted(p for p in (ROOT / package).rglob("*.py") if "migrations/versions" not in p.as_posix())


def test_nothing_below_the_routes_and_the_wiring_imports_them():
    upward = set()
    for path in _modules("backend"):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith(TOP):
            continue
        for name in _imports(path):
            if any(name == u or name.startswith(u + ".") for u in UPPER):
                upward.add((rel, name))
    assert upward - KNOWN_UPWARD == set(), "new imports that point up a layer"
    assert KNOWN_UPWARD - upward == set(), "gone: remove them from KNOWN_UPWARD"


# The backend's layers, bottom first: a module imports only from its own layer or those below.
# The middle (peers, control, dashboard, cluster, ingest) has an order of its own: control sends
# through peers; the dashboard folds what control decided; cluster copies dashboards between
# replicas; ingest, the hooks' conversation, drives all of them.
LAYERS: list[tuple[str, ...]] = [
    ("backend", "backend.modes", "backend.assets", "backend.heap", "backend.redact",
     "backend.metrics_contract", "backend.process", "backend.tasks"),
    ("backend.policy",),
    ("backend.settings",),
    ("backend.live",),
    ("backend.storage",),
    ("backend.auth",),
    ("backend.peers",),
    ("backend.control",),
    ("backend.dashboard",),
    ("backend.cluster",),
    ("backend.ingest",),
    ("backend.report",),
    ("backend.metrics_export",),
    ("backend.loops",),
    ("backend.parts",),
    ("backend.api",),
    ("backend.main",),
    ("backend.client", "backend.demo", "backend.run_cmd", "backend.client_types"),
    ("backend.cli", "backend.__main__"),
]
_LAYER_OF = {unit: i for i, units in enumerate(LAYERS) for unit in units}


def _unit(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2])


def _upward(path: Path, root: Path = ROOT) -> list[str]:
    parts = path.relative_to(root).with_suffix("").parts
    own = _unit(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return [name for name in sorted(_imports(path)) if name.split(".")[0] == "backend"
            and _LAYER_OF[_unit(name)] > _LAYER_OF[own]]


def test_every_backend_module_has_a_layer():
    units = set()
    for path in _modules("backend"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        units.add(_unit(".".join(parts[:-1] if parts[-1] == "__init__" else parts)))
    assert sorted(units - set(_LAYER_OF)) == [], "give these a place in LAYERS"
    assert sorted(set(_LAYER_OF) - units) == [], "gone: remove them from LAYERS"


def test_no_import_runs_back_up_a_layer():
    """Type-only and function-level imports count too: an arrow up is one whatever its reason."""
    upward = {path.relative_to(ROOT).as_posix(): names for path in _modules("backend")
              if (names := _upward(path))}
    assert upward == {}, "imports that run back up the layers (move the shared piece down)"


def test_the_layer_rule_sees_an_upward_import(tmp_path: Path):
    bad = tmp_path / "backend" / "settings.py"
    bad.parent.mkdir()
    bad.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from backend.control.core import X\n"
                   "from backend.policy import decide\n")
    assert _upward(bad, root=tmp_path) == ["backend.control.core"]


def test_the_wiring_imports_no_route():
    names = _imports(ROOT / "backend/parts.py")
    assert not [n for n in names if n.startswith("backend.api")]


def test_the_hook_never_imports_the_backend():
    for path in _modules("trainer_hook"):
        bad = [n for n in _imports(path) if n.split(".")[0] in ("backend", "frontend")]
        assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


def test_the_wire_is_the_standard_library_only():
    """rebalancer_wire (messages, limits, codec, shares, device keys) is what the hook and the
    backend share: it imports the standard library and itself (orjson optionally, inside
    a try, to parse faster), nothing of either side and no third-party package."""
    for path in _modules("rebalancer_wire"):
        bad = [n for n in _imports(path) if n.split(".")[0] not in sys.stdlib_module_names
               and n.split(".")[0] not in ("rebalancer_wire", "orjson")]
        assert not bad, f"{path.relative_to(ROOT)} imports {bad}"
    source = (ROOT / "rebalancer_wire/protocol.py").read_text()
    assert "    from orjson import loads as _fast_loads\nexcept ImportError:" in source


def test_the_backend_and_the_hook_share_only_the_wire():
    """Neither side imports the other: the backend reaches the hook's messages through
    rebalancer_wire alone, and the hook never imports the backend (or the frontend)."""
    for path in _modules("backend"):
        if path.relative_to(ROOT).as_posix() in HOOK_LAUNCHERS:
            continue
        bad = [n for n in _imports(path) if n.split(".")[0] == "trainer_hook"]
        assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


# The backend modules that launch training (not the server): they need the hook package.
HOOK_LAUNCHERS = {
    "backend/run_cmd.py": "`rebalancer run` puts the hook's sitecustomize (trainer_hook/_site) on the "
                          "training script's PYTHONPATH",
}


def test_the_policy_imports_only_itself_and_the_wire():
    """backend/policy decides from data alone (pure functions, testable without a server or
    torch): the standard library, numpy, itself and the wire (protocol, device keys)."""
    allowed = {"backend.policy", "numpy", "rebalancer_wire.protocol", "rebalancer_wire.devices"}
    for path in _modules("backend/policy"):
        bad = [n for n in _imports(path) if n.split(".")[0] not in sys.stdlib_module_names
               and not any(n == a or n.startswith(a + ".") for a in allowed)]
        assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


def test_the_client_imports_nothing_of_the_server():
    """backend/client (the REST client and its commands) runs where only plain ``rebalancer``
    is installed: the standard library, itself, the one mode list, and websockets for watch."""
    allowed = {"backend.client", "backend.modes", "websockets"}
    for path in _modules("backend/client"):
        bad = [n for n in _imports(path) if n.split(".")[0] not in sys.stdlib_module_names
               and not any(n == a or n.startswith(a + ".") for a in allowed)]
        assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


def test_the_frontend_package_is_data_only():
    """The top-level ``frontend`` package is the dashboard's files as package data: its one
    module imports nothing, and no module imports it (routes/pages.py finds its folder with
    importlib.resources)."""
    modules = _modules("frontend")
    assert [p.relative_to(ROOT).as_posix() for p in modules] == ["frontend/__init__.py"]
    assert _imports(modules[0]) == set()
    for package in ("backend", "trainer_hook"):
        for path in _modules(package):
            bad = [n for n in _imports(path) if n.split(".")[0] == "frontend"]
            assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


# No backend product module grows past this many lines; the ones listed are bigger with a reason.
LINE_CAP = 700
OVER_CAP: dict[str, str] = {}


def _over_cap(package: str) -> dict[str, int]:
    lines = {p.relative_to(ROOT).as_posix(): len(p.read_text().splitlines()) for p in _modules(package)}
    return {rel: n for rel, n in lines.items() if n > LINE_CAP}


def test_no_backend_module_is_over_the_line_cap():
    over = _over_cap("backend")
    assert set(over) - set(OVER_CAP) == set(), f"over {LINE_CAP} lines: {over}; split the module by owner"
    assert set(OVER_CAP) - set(over) == set(), "under the cap now: remove them from OVER_CAP"


# The hook and the wire packages keep the same cap; the wire format is one module on purpose
# (both ends validate every message with it, and docs/protocol.md is checked against it).
HOOK_OVER_CAP: dict[str, str] = {
    "rebalancer_wire/protocol.py": "every wire message, its bounds and its codec in one module",
}


def test_no_hook_or_wire_module_is_over_the_line_cap():
    over = _over_cap("trainer_hook") | _over_cap("rebalancer_wire")
    assert set(over) - set(HOOK_OVER_CAP) == set(), f"over {LINE_CAP} lines: {over}; split the module by owner"
    assert set(HOOK_OVER_CAP) - set(over) == set(), "under the cap now: remove them from HOOK_OVER_CAP"


def _module_imports(path: Path, modules: set[str]) -> set[str]:
    """The modules of ``modules`` that ``path`` imports: module level, inside functions and
    under ``if TYPE_CHECKING`` (``from pkg import sub`` is an arrow to sub)."""
    found: set[str] = set()

    def owner(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    stack: list[ast.AST] = [ast.parse(path.read_text())]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Import):
            found.update(m for a in node.names if (m := owner(a.name)))
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                m = sub if sub in modules else owner(node.module)
                if m:
                    found.add(m)
        stack.extend(ast.iter_child_nodes(node))
    return found


def test_no_import_cycle():
    """0 cycles among the modules of backend, trainer_hook and rebalancer_wire (Tarjan's
    strongly connected components over every import, type-only ones included)."""
    paths = {}
    for package in ("backend", "trainer_hook", "rebalancer_wire"):
        for path in _modules(package):
            parts = path.relative_to(ROOT).with_suffix("").parts
            paths[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {m: _module_imports(p, set(paths)) - {m} for m, p in paths.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []
    for start in graph:  # iterative Tarjan
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        while work:
            v, edges = work[-1]
            w = next(edges, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    cycles.append(sorted(comp))
    assert cycles == [], f"import cycles: {cycles}"
    assert graph["backend.parts"] and graph["trainer_hook.hook"], "the graph was read"


def test_routes_name_the_parts_they_use():
    """A route that only reads parts of the wiring object (``parts.live``, ``parts.sql``)
    declares those parts (``LiveDep``, ``SqlDep``: backend/api/deps.py); ``PartsDep`` is left
    to the routes that hand the whole object on."""
    wide = []
    for path in _modules("backend/api/routes"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            args = node.args.args + node.args.kwonlyargs
            if not any(a.arg == "parts" and a.annotation is not None and ast.unparse(a.annotation) == "PartsDep"
                       for a in args):
                continue
            uses = [n for n in ast.walk(node) if isinstance(n, ast.Name) and n.id == "parts"]
            reads = [n for n in ast.walk(node) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
                     and n.value.id == "parts"]
            if len(uses) == len(reads):  # never handed on: it could name its parts
                wide.append(f"{path.relative_to(ROOT).as_posix()}:{node.name}")
    assert not wide, f"routes that take the whole wiring object only to read parts of it: {wide}"


WHY_CAP = 400  # over it, a module says at its top why it stays one module


def test_a_module_over_400_lines_says_why_at_its_top():
    unexplained = []
    for package in ("backend", "trainer_hook", "rebalancer_wire"):
        for path in _modules(package):
            text = path.read_text()
            if len(text.splitlines()) > WHY_CAP:
                doc = ast.get_docstring(ast.parse(text)) or ""
                if "One module, over 400 lines on purpose: " not in doc:
                    unexplained.append(path.relative_to(ROOT).as_posix())
    assert not unexplained, f"over {WHY_CAP} lines without saying why at the top: {unexplained}"


# backend/control writes its tables (backend.storage.control) only in records.py; elsewhere the
# controller reads rows and sets its own in-memory state: itself (self) and a JobState (st).
IN_MEMORY = {"self", "st"}
SESSION_READS = {"get", "scalar", "scalars", "commit", "rollback"}


def _control_writes(rel: str, source: str) -> list[str]:
    tree = ast.parse(source, filename=rel)
    found = []

    def where(node: ast.AST) -> str:
        return f"{rel}:{getattr(node, 'lineno', '?')}"

    sessions = {"s", "session"} | {
        a.arg for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        for a in node.args.args + node.args.kwonlyargs
        if a.annotation is not None and ast.unparse(a.annotation).endswith("Session")}
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = list(node.targets)
        while targets:
            target = targets.pop()
            if isinstance(target, (ast.Tuple, ast.List)):
                targets += target.elts
                continue
            if isinstance(target, ast.Starred):
                targets.append(target.value)
                continue
            base, attribute = target, False
            while isinstance(base, (ast.Attribute, ast.Subscript)):
                attribute |= isinstance(base, ast.Attribute)
                base = base.value
            if attribute and not (isinstance(base, ast.Name) and base.id in IN_MEMORY):
                found.append(f"{where(node)} sets {ast.unparse(target)}")
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            if name == "record_audit" or name.endswith("Row") or name == "setattr":
                found.append(f"{where(node)} calls {ast.unparse(f)}")
            if (isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id in sessions
                    and f.attr not in SESSION_READS):
                found.append(f"{where(node)} calls {ast.unparse(f)}")
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("sqlalchemy"):
            found += [f"{where(node)} imports {a.name}" for a in node.names
                      if a.name in ("insert", "update", "delete", "text")]
    return found


def test_every_control_table_write_is_in_records():
    found = []
    for path in _modules("backend/control"):
        rel = path.relative_to(ROOT).as_posix()
        if rel != "backend/control/records.py":
            found += _control_writes(rel, path.read_text())
    assert found == [], "control-table writes outside backend/control/records.py (move them there)"


def _control_row_names() -> set[str]:
    tree = ast.parse((ROOT / "backend/storage/control.py").read_text())
    return {n.name for n in tree.body if isinstance(n, ast.ClassDef) and n.name.endswith("Row")}


def _audit_or_row_calls(rel: str, source: str, rows: set[str]) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source, filename=rel)):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            if name == "record_audit" or name in rows:
                found.append(f"{rel}:{node.lineno} calls {ast.unparse(f)}")
    return found


def test_no_module_outside_records_adds_audit_or_control_rows():
    """Routes, auth and the rest add audit rows (token changes included) and control-table rows
    through backend/control/records.py only; storage defines them."""
    rows, found = _control_row_names(), []
    for path in _modules("backend"):
        rel = path.relative_to(ROOT).as_posix()
        if rel != "backend/control/records.py" and not rel.startswith("backend/storage/"):
            found += _audit_or_row_calls(rel, path.read_text(), rows)
    assert found == [], "audit or control-table rows added outside backend/control/records.py"


def test_the_audit_rule_sees_calls():
    rows = _control_row_names()
    assert {"AuditRow", "PlacementRow"} <= rows
    bad = "def f(s):\n    record_audit(s, actor='a', action='b', job=None)\n    s.add(db.AuditRow())\n"
    assert [f.split(" ", 1)[1] for f in _audit_or_row_calls("x.py", bad, rows)] == [
        "calls record_audit", "calls db.AuditRow"]


def test_the_control_write_rule_sees_writes():
    bad = ("def work(s: Session, row):\n    row.failed = True\n    row.acks[1] = 2\n"
           "    db.record_audit(s, actor='x', action='y', job=None)\n    s.add(db.PlacementRow())\n"
           "    s.execute(update(db.PlacementRow))\n    st.version = 3\n    self._dirty.add('j')\n")
    found = _control_writes("x.py", bad)
    assert sorted(f.split(" ", 1)[1] for f in found) == [
        "calls db.PlacementRow", "calls db.record_audit", "calls s.add", "calls s.execute",
        "sets row.acks[1]", "sets row.failed"]


def test_access_is_decided_in_auth_access():
    """Who may do what is backend.auth.access.allows: no module outside backend/auth compares
    a role or calls role_allows (the REST dependencies, /metrics and both websockets ask allows)."""
    found = []
    for path in _modules("backend"):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith("backend/auth/"):
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=rel)):
            if isinstance(node, ast.Compare) and any(
                    isinstance(x, ast.Attribute) and x.attr == "role" for x in [node.left, *node.comparators]):
                found.append(f"{rel}:{node.lineno} {ast.unparse(node)}")
            if isinstance(node, ast.Call) and ast.unparse(node.func).endswith("role_allows"):
                found.append(f"{rel}:{node.lineno} {ast.unparse(node)}")
    assert found == [], "access decisions outside backend/auth/access.py"


def test_no_class_in_control_inherits_behaviour_from_another():
    """Compose, do not stack (issue 37): the controller's parts are objects wired by
    constructor, not mixins sharing one ``self``. A class in control/ (or the background
    loops) may name only a typing or pydantic base; the errors form an exception hierarchy."""
    allowed = {"Protocol", "NamedTuple", "BaseModel", "Exception"}
    stacked = []
    for path in [*_modules("backend/control"), ROOT / "backend/loops.py"]:
        if path.name == "errors.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                stacked += [f"{path.relative_to(ROOT).as_posix()}:{node.name}({ast.unparse(b)})"
                            for b in node.bases if ast.unparse(b) not in allowed]
    assert stacked == [], "classes that inherit behaviour: give the part to them as an argument"


# The hook is composed, not stacked (issue 37): no class in trainer_hook inherits behaviour
# from another class of trainer_hook (a Protocol is a type, not behaviour). Each exception
# says why it stays a subclass.
HOOK_SUBCLASSES = {
    ("trainer_hook/integrations/lightning.py", "_LightningEpochView", "EpochView"):
        "Lightning leaves a loader alone only when its sampler is a DistributedSampler: a view "
        "of the hook's sampler that is one",
    ("trainer_hook/integrations/lightning.py", "_ResumableLoader", "HookDataLoader"):
        "the hook's loader with the state_dict Lightning asks of a loader that resumes by itself",
}


def _hook_class_bases(root: Path = ROOT) -> dict[tuple[str, str, str], bool]:
    """(file, class, base) for each base that is a class of trainer_hook -> whether it is a Protocol."""
    classes: dict[str, list[str]] = {}
    trees = {}
    for path in sorted((root / "trainer_hook").rglob("*.py")):
        tree = ast.parse(path.read_text())
        trees[path.relative_to(root).as_posix()] = tree
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                classes[node.name] = [ast.unparse(b).rpartition(".")[2] for b in node.bases]
    found = {}
    for rel, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                for base in node.bases:
                    name = ast.unparse(base).rpartition(".")[2]
                    if name in classes:
                        found[(rel, node.name, name)] = "Protocol" in classes[name]
    return found


def test_no_hook_class_inherits_behaviour_from_another():
    stacked = {k for k, protocol in _hook_class_bases().items() if not protocol}
    assert stacked - set(HOOK_SUBCLASSES) == set(), "compose instead: hold the other object, take it as an argument"
    assert set(HOOK_SUBCLASSES) - stacked == set(), "gone: remove them from HOOK_SUBCLASSES"


def test_the_composition_rule_sees_a_mixin(tmp_path: Path):
    (tmp_path / "trainer_hook").mkdir()
    (tmp_path / "trainer_hook" / "a.py").write_text(
        "from typing import Protocol\nclass Base:\n    pass\nclass Typed(Protocol):\n    pass\n")
    (tmp_path / "trainer_hook" / "b.py").write_text(
        "from trainer_hook.a import Base, Typed\nclass Hook(Base):\n    pass\nclass Impl(Typed):\n    pass\n")
    assert _hook_class_bases(tmp_path) == {("trainer_hook/b.py", "Hook", "Base"): False,
                                           ("trainer_hook/b.py", "Impl", "Typed"): True}


def test_the_pipeline_component_stands_alone():
    """trainer_hook.pipeline (PP x DP, docs/pipelines.md) and its clock are components the hook
    holds, not parts of it: they import torch, the wire and the hook's leaf modules
    (gradients, mesh), never the facade or the step loop, so the hook can be rebuilt around them."""
    allowed = {"rebalancer_wire.protocol", "trainer_hook.gradients", "trainer_hook.mesh",
               "trainer_hook._stage_clock"}
    for rel in ("trainer_hook/pipeline.py", "trainer_hook/_stage_clock.py"):
        bad = [n for n in _imports(ROOT / rel) if n.split(".")[0] not in sys.stdlib_module_names
               and n.split(".")[0] != "torch" and n not in allowed]
        assert not bad, f"{rel} imports {bad}"
