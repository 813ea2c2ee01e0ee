"""The docs live in the repo and stay true to the code: docs/architecture.md and docs/protocol.md.

Checks: nothing cites the old out-of-repo design documents; every relative markdown link (and its
anchor) resolves; every protocol error code, frame tag and frame field is documented in
docs/protocol.md; every `sluice_` metric is documented in docs/architecture.md; every
`docs/<file>.md §N` citation names a section that exists.
"""
from __future__ import annotations

import re
import typing
from pathlib import Path

import msgspec
import pytest

from service import protocol

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
ARCHITECTURE = DOCS / "architecture.md"
PROTOCOL_DOC = DOCS / "protocol.md"

SCANNED = ("README.md", "service", "engine", "sluice_kernels", "web", "bench", "docs", "tests", "Dockerfile", "compose.yaml",
           "compose.gpu.yaml", "models")
SKIP_DIRS = {"__pycache__", ".pytest_cache", "node_modules"}
# References to documents outside the repository (the old seed documents and the folder they sat in).
FORBIDDEN = (
    re.compile(r"shared/"),
    re.compile(r"DESIGN\.md"),
    re.compile(r"PROTOCOL\.md"),
    re.compile(r"STYLE\.md"),
    re.compile(r"\bDESIGN\s*§"),  # "DESIGN §4": the same document without its extension
    re.compile(r"\bPROTOCOL\b"),  # bare "PROTOCOL" (PROTOCOL_VERSION is one word and does not match)
)
MARKDOWN_FILES = [ROOT / "README.md", ROOT / "bench" / "README.md", *sorted(DOCS.glob("*.md"))]


def _text_files() -> list[Path]:
    files: list[Path] = []
    for name in SCANNED:
        top = ROOT / name
        candidates = [top] if top.is_file() else sorted(top.rglob("*"))
        for p in candidates:
            if p.is_file() and p != Path(__file__).resolve() and not SKIP_DIRS.intersection(p.relative_to(ROOT).parts):
                files.append(p)
    return files


def _read_text(p: Path) -> str | None:
    try:
        return p.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None  # binary: images, compiled objects


def test_no_references_to_documents_outside_the_repo() -> None:
    hits = []
    for p in _text_files():
        text = _read_text(p)
        if text is None:
            continue
        for n, line in enumerate(text.splitlines(), 1):
            if any(rx.search(line) for rx in FORBIDDEN):
                hits.append(f"{p.relative_to(ROOT)}:{n}: {line.strip()[:120]}")
    assert not hits, "cite docs/architecture.md or docs/protocol.md instead:\n" + "\n".join(hits)


# ---- links ------------------------------------------------------------------------------------
_FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
_CODE_SPAN = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"!?\[[^\]\n]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.MULTILINE)


def _links(md: str) -> list[str]:
    md = _FENCE.sub("", md)
    md = _CODE_SPAN.sub("code", md)
    return _LINK.findall(md)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`|\[([^\]]*)\]\([^)]*\)", lambda m: m.group(1) or "", heading)
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


def _anchors(md: str) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for h in _HEADING.findall(_FENCE.sub("", md)):
        s = _slug(h)
        n = seen.get(s, 0)
        seen[s] = n + 1
        out.add(s if n == 0 else f"{s}-{n}")
    return out


def test_slug_matches_github() -> None:
    assert _slug("CPU path (native kernels)") == "cpu-path-native-kernels"
    assert _slug("6. Error codes") == "6-error-codes"
    assert _slug("`sluice serve` flags and `SLUICE_*` variables") == "sluice-serve-flags-and-sluice_-variables"


@pytest.mark.parametrize("md_file", MARKDOWN_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(md_file: Path) -> None:
    broken = []
    for target in _links(md_file.read_text(encoding="utf-8")):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):
            continue  # http:, https:, mailto: ...
        path, _, anchor = target.partition("#")
        dest = (md_file.parent / path).resolve() if path else md_file
        if not dest.exists():
            broken.append(f"{target}: no such file {dest}")
            continue
        try:
            dest.relative_to(ROOT)
        except ValueError:
            broken.append(f"{target}: points outside the repository")
            continue
        if anchor and dest.suffix == ".md" and anchor not in _anchors(dest.read_text(encoding="utf-8")):
            broken.append(f"{target}: no heading with anchor #{anchor} in {dest.relative_to(ROOT)}")
    assert not broken, f"{md_file.relative_to(ROOT)}:\n" + "\n".join(broken)


def test_the_docs_exist_and_readme_links_them() -> None:
    links = _links((ROOT / "README.md").read_text(encoding="utf-8"))
    assert "docs/architecture.md" in links and "docs/protocol.md" in links


# ---- the protocol document against service/protocol.py ----------------------------------------
def _tags(union: object) -> dict[str, type[msgspec.Struct]]:
    return {cls.__struct_config__.tag: cls for cls in typing.get_args(union)}


def _fields(cls: type[msgspec.Struct]) -> set[str]:
    names = set(cls.__struct_fields__)
    for f in msgspec.structs.fields(cls):  # nested structs: usage, timing, messages
        for t in (f.type, *typing.get_args(f.type)):
            for inner in (t, *typing.get_args(t)):
                if isinstance(inner, type) and issubclass(inner, msgspec.Struct):
                    names |= set(inner.__struct_fields__)
    return names


def test_every_error_code_is_documented() -> None:
    doc = PROTOCOL_DOC.read_text(encoding="utf-8")
    codes = typing.get_args(protocol.ErrorCode)
    assert codes, "protocol.ErrorCode lost its Literal"
    missing = [c for c in codes if f"`{c}`" not in doc]
    assert not missing, f"error codes missing from docs/protocol.md: {missing}"


@pytest.mark.parametrize("union", ["ClientMessage", "ServerMessage"])
def test_every_frame_type_and_field_is_documented(union: str) -> None:
    doc = PROTOCOL_DOC.read_text(encoding="utf-8")
    frames = _tags(getattr(protocol, union))
    assert frames
    missing = [f"type {tag!r}" for tag in frames if f"`{tag}`" not in doc]
    for tag, cls in frames.items():
        missing += [f"{tag}.{name}" for name in sorted(_fields(cls)) if not re.search(rf"\b{name}\b", doc)]
    assert not missing, f"{union} items missing from docs/protocol.md: {missing}"


# ---- metrics ----------------------------------------------------------------------------------
def test_every_metric_is_documented() -> None:
    from service.metrics import Metrics

    metrics = Metrics(lambda: {"num_steps": 0})  # any non-empty snapshot makes the engine collector report
    names = {family.name for family in metrics.registry.collect()}
    assert names and all(n.startswith("sluice_") for n in names), names
    doc = ARCHITECTURE.read_text(encoding="utf-8")
    missing = sorted(n for n in names if f"`{n}`" not in doc)
    assert not missing, f"metrics missing from docs/architecture.md: {missing}"


# ---- section citations ------------------------------------------------------------------------
_CITATION = re.compile(r"docs/(architecture|protocol)\.md\s*((?:§\s*\d+(?:\s*,\s*)?)+)")


def test_section_citations_name_existing_sections() -> None:
    sections = {
        name: set(re.findall(r"^## (\d+)\. ", (DOCS / f"{name}.md").read_text(encoding="utf-8"), re.MULTILINE))
        for name in ("architecture", "protocol")
    }
    files = _text_files() + sorted((ROOT / "tests").rglob("*.py"))
    bad = []
    for p in files:
        text = _read_text(p)
        if text is None:
            continue
        for m in _CITATION.finditer(text):
            for num in re.findall(r"\d+", m.group(2)):
                if num not in sections[m.group(1)]:
                    bad.append(f"{p.relative_to(ROOT)}: docs/{m.group(1)}.md §{num}")
    assert not bad, "citations of sections that do not exist:\n" + "\n".join(bad)
