"""The fenced blocks of the documentation (docs/**/*.md and README.md), each with what the suite does with it.

A block's kind comes from its fence's language and, for the cases a language cannot tell, from a comment
on the line before it (blank lines between are allowed), ``<!-- example: KIND -->``:

- Python: ``test`` (the default: a test file, run for real through pytester on the built-in models),
  ``conftest`` (the ``conftest.py`` of the next test block on the same page), or one of ``SYNTAX_ONLY``
  (needs a GPU, the Hub, the reader's own files, or minutes of CPU: compiled and collected, never run);
- ``ini`` and ``toml``: parsed, and every ``opt_*`` key checked against the plugin's own parsers;
- ``yaml``: a workflow, or a list of workflow steps (wrapped in a job), goes through actionlint; other
  YAML through ``yaml.safe_load``; ``--8<-- "path"`` lines are expanded as the site's snippets extension
  expands them;
- ``json``: ``json.loads``, unless marked ``outline`` (a sketch of a layout, not a document);
- ``text``, ``console`` and a fence without a language: shown output or commands, not parsed.

Anything else is an unknown kind, which the suite refuses.
"""

from __future__ import annotations

import functools
import re
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

from benchmark_scripts import load_module_file  # this folder, tests/, is on sys.path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


@functools.lru_cache(maxsize=1)
def reference_hook() -> ModuleType:
    """docs/hooks/reference.py, the Reference generator mkdocs runs, under a name of its own."""
    return load_module_file("docs_reference_hook", DOCS / "hooks" / "reference.py")

SYNTAX_ONLY = {
    "needs-gpu": "needs a CUDA GPU",
    "needs-hub": "downloads a model from the Hugging Face Hub",
    "needs-files": "uses files of the reader's own project (a GGUF file, a vendored kernel)",
    "slow": "runs for minutes on a CPU (compilation, torchrun processes)",
}
PYTHON_KINDS = {"test", "conftest", *SYNTAX_ONLY}
SHOWN_LANGUAGES = {"", "text", "console"}
LANGUAGES = {"python": "python", "py": "python", "ini": "ini", "toml": "toml", "yaml": "yaml", "yml": "yaml",
             "json": "json", **{shown: "shown" for shown in SHOWN_LANGUAGES}}
EXPECTED = {"passed", "failed", "skipped"}

FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<lang>[^\s`]*)[^`]*$")
ANNOTATION = re.compile(r"^\s*<!--\s*example:\s*(?P<kind>[a-z-]+)(?P<options>(?:\s+[a-z]+=[a-z]+)*)\s*-->\s*$")
SNIPPET = re.compile(r"""^\s*--8<--\s+["']?(?P<path>[^"'\s]+)["']?\s*$""")


class ExampleError(ValueError):
    """A block the suite cannot classify: its page, line and what is accepted."""


@dataclass
class Block:
    source: str  # the page as the suite names it: docs/x.md, or docs/x.md (generated NAME) for a Reference table
    line: int  # the fence's line, 1-based (in the generated text, for a generated block)
    language: str  # as written after the fence
    kind: str  # python: test, conftest, or a SYNTAX_ONLY key; else ini, toml, workflow, steps, yaml, json, outline, shown
    text: str
    expect: str = "passed"
    conftest: "Block | None" = None  # for a test block: the conftest block before it
    options: dict[str, str] = field(default_factory=dict)

    @property
    def where(self) -> str:
        return f"{self.source}:{self.line}"

    @property
    def slug(self) -> str:
        """A name unique over the site, usable as a Python module name."""
        stem = re.sub(r"[^a-z0-9]+", "_", self.source.replace(".md", "").lower()).strip("_")
        return f"{stem}_l{self.line}"


def _shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def pages() -> list[Path]:
    """Every Markdown file of the site, and the README."""
    found = sorted(p for p in DOCS.rglob("*.md") if "hooks" not in p.relative_to(DOCS).parts)
    return [*found, ROOT / "README.md"]


def _expand_snippets(text: str, where: str) -> str:
    lines = []
    for line in text.splitlines():
        match = SNIPPET.match(line)
        if match:
            included = ROOT / match.group("path")
            if not included.is_file():
                raise ExampleError(f"{where}: the snippet {match.group('path')!r} is not a file of the repository")
            lines.append(included.read_text(encoding="utf-8").rstrip("\n"))
        else:
            lines.append(line)
    return "\n".join(lines) + "\n"


def blocks_of(path: Path) -> list[Block]:
    """The fenced blocks of one page, and of the Reference tables it asks for (docs/hooks/reference.py generates
    them at build time), classified; a block of unknown kind raises ``ExampleError``."""
    text = path.read_text(encoding="utf-8")
    found = blocks_in(text, _shown(path))
    if path.is_relative_to(DOCS):
        hook = reference_hook()
        for match in hook.PLACEHOLDER.finditer(text):
            if match.group(1) in hook.GENERATORS:  # an unknown one fails the build, and test_docs says so
                found += blocks_in(hook.render(match.group(0)), f"{_shown(path)} (generated {match.group(1)})")
    return found


def blocks_in(text: str, source: str) -> list[Block]:
    """The fenced blocks of one Markdown text, ``source`` naming it in messages."""
    lines = text.splitlines()
    found: list[Block] = []
    index = 0
    while index < len(lines):
        opening = FENCE.match(lines[index])
        if not opening:
            index += 1
            continue
        indent, fence, language = opening.group("indent"), opening.group("fence"), opening.group("lang").lower()
        start = index
        body: list[str] = []
        index += 1
        while index < len(lines) and not (lines[index].strip().startswith(fence[0] * len(fence))
                                           and not lines[index].strip().strip(fence[0])):
            body.append(lines[index][len(indent):] if lines[index].startswith(indent) else lines[index].lstrip())
            index += 1
        index += 1  # the closing fence
        where = f"{source}:{start + 1}"
        annotation = None
        before = start - 1
        while before >= 0 and not lines[before].strip():
            before -= 1
        if before >= 0:
            annotation = ANNOTATION.match(lines[before])
            if annotation is None and "<!-- example" in lines[before]:
                raise ExampleError(f"{where}: malformed example comment {lines[before].strip()!r}; accepted: "
                                   f"<!-- example: KIND [expect=passed|failed|skipped] -->")
        text = _expand_snippets(textwrap.dedent("\n".join(body)), where)
        found.append(_classify(source, start + 1, language, text, annotation, where))
    _pair_conftests(found)
    return found


def _classify(source: str, line: int, language: str, text: str, annotation: re.Match[str] | None,
              where: str) -> Block:
    if language not in LANGUAGES:
        raise ExampleError(f"{where}: a block of unknown kind ({language!r}); accepted languages: "
                           f"{', '.join(sorted(k for k in LANGUAGES if k))} or none")
    family = LANGUAGES[language]
    marked = annotation.group("kind") if annotation else None
    options = dict(item.split("=", 1) for item in (annotation.group("options").split() if annotation else []))
    expect = options.get("expect", "passed")
    if expect not in EXPECTED:
        raise ExampleError(f"{where}: expect={expect!r}; accepted: {', '.join(sorted(EXPECTED))}")
    if family == "python":
        kind = marked or "test"
        if kind not in PYTHON_KINDS:
            raise ExampleError(f"{where}: unknown Python example kind {kind!r}; accepted: {', '.join(sorted(PYTHON_KINDS))}")
        if kind != "conftest" and not re.search(r"^def test_", text, re.M):
            raise ExampleError(f"{where}: a Python block with no test function; write it as a test file, or mark "
                               f"it <!-- example: conftest --> before a test block")
    elif family == "json":
        if marked not in (None, "outline"):
            raise ExampleError(f"{where}: a JSON block can be marked only 'outline'; got {marked!r}")
        kind = marked or "json"
    elif family == "yaml":
        kind = "yaml"  # refined to workflow or steps once parsed
    else:
        if marked not in (None, family):
            raise ExampleError(f"{where}: a {language or 'plain'} block marked {marked!r}; only Python blocks take a kind")
        kind = family
    return Block(source, line, language, kind, text, expect=expect, options=options)


def _pair_conftests(found: list[Block]) -> None:
    """A conftest block is the conftest.py of the next test block on its page; one with none after it is loaded
    on its own (pytest imports it when it collects its folder)."""
    pending: Block | None = None
    for block in found:
        if block.kind == "conftest":
            pending = block
        elif block.kind == "test" and pending is not None:
            block.conftest, pending = pending, None


def all_blocks() -> list[Block]:
    return [block for page in pages() for block in blocks_of(page)]
