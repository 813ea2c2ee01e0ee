"""The floors of the house (docs/architecture.md §1): bench → service → engine → kernels, no arrow running back up,
and no import circle inside `service/` (imports under `if TYPE_CHECKING:` included: a reader follows those too)."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FLOORS = ["bench", "service", "engine", "sluice_kernels"]  # each may import only the floors after it


def _imports(path: Path) -> set[str]:
    """Top-level project modules `path` imports (`service.ws`, `engine`, ...), at any depth of the file."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)  # `from service import ws`
    return {n for n in names if n.split(".")[0] in FLOORS}


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_no_floor_imports_one_above_it() -> None:
    bad = []
    for i, floor in enumerate(FLOORS):
        above = set(FLOORS[:i])
        for path in sorted((ROOT / floor).rglob("*.py")):
            bad += [f"{_module(path)} imports {name}" for name in _imports(path) if name.split(".")[0] in above]
    assert not bad, bad


def test_service_modules_form_no_circle() -> None:
    modules = {_module(p): p for p in (ROOT / "service").glob("*.py")}
    graph = {m: {n for n in _imports(p) if n in modules and n != m} for m, p in modules.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for n in sorted(graph[m]):
            assert state.get(n) != 1, " -> ".join([*path, m, n])
            if n not in state:
                visit(n, [*path, m])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [])
    # the shared state and the protocol are read by every handler and know none of them
    handlers = {"service.app", "service.ws", "service.ws_session", "service.openai_api"}
    assert not graph["service.state"] & handlers and not graph["service.protocol"] & handlers
