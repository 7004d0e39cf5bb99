"""The documentation site: `mkdocs build --strict` is green, its Reference comes from the code, every link
resolves, the pages render in headless Chromium, and every example on the pages and in the README is run or
validated (tests/doc_examples.py says how each block is classified)."""

from __future__ import annotations

import ast
import configparser
import functools
import http.server
import json
import os
import re
import subprocess
import sys
import threading
import time
from collections import Counter
from html.parser import HTMLParser
from pathlib import Path
from typing import Any, Iterator
from urllib.parse import unquote, urljoin, urlsplit

import pytest
import yaml

from browser import CHROMIUM, NEEDS_CHROMIUM
from doc_examples import DOCS, ROOT, SYNTAX_ONLY, Block, ExampleError, all_blocks, blocks_of, reference_hook
from test_workflows import PROJECT_ACTIONLINT_CONFIG, _actionlint

from pytest_transformers_opt.options import OPTIONS
from pytest_transformers_opt.verdict.budgets import BUDGETS, parse_budget

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

pytest.importorskip("mkdocs", reason="needs the docs tools: pip install -e '.[test]' (or '.[docs]')")
pytest.importorskip("material", reason="needs mkdocs-material: pip install -e '.[test]' (or '.[docs]')")

REFERENCE = DOCS / "reference"


# --------------------------------------------------------------------------- the build


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site, built once for this module with --strict (any warning fails the build)."""
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # mkdocs-material's banner about its successor
    built = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
                            str(ROOT / "mkdocs.yml"), "--site-dir", str(out)],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert built.returncode == 0, built.stderr[-4000:]
    assert "WARNING" not in built.stderr, built.stderr[-4000:]
    return out


def _nav_pages() -> list[str]:
    """Every page named in mkdocs.yml's nav."""
    config = yaml.load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"), Loader=yaml.BaseLoader)
    found: list[str] = []

    def walk(entry: Any) -> None:
        if isinstance(entry, str):
            found.append(entry)
        elif isinstance(entry, list):
            for item in entry:
                walk(item)
        elif isinstance(entry, dict):
            for value in entry.values():
                walk(value)

    walk(config["nav"])
    return found


def _built(site: Path, page: str) -> Path:
    """Where mkdocs writes ``page`` (directory URLs: a/b.md -> a/b/index.html, a/index.md -> a/index.html)."""
    stem = page.removesuffix(".md")
    return site / (stem[: -len("index")] if stem.endswith("index") else stem + "/") / "index.html"


def test_every_page_is_in_the_nav_and_built_with_content(site: Path) -> None:
    nav = _nav_pages()
    on_disk = sorted(str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md") if "hooks" not in p.relative_to(DOCS).parts)
    assert sorted(nav) == on_disk  # no page left out of the navigation, no nav entry without a page
    for page in nav:
        html = _built(site, page).read_text(encoding="utf-8")
        article = re.search(r'<article class="md-content__inner[^"]*">(.*?)</article>', html, re.S)
        assert article, page
        assert len(re.sub(r"<[^>]+>", "", article.group(1)).split()) > 40, page  # a page, not a stub
    assert "<!-- reference:" not in "".join(p.read_text() for p in site.rglob("*.html"))  # all generated


def test_the_reference_is_generated_from_the_code(site: Path) -> None:
    """Every option, ini key, variable, budget, technique and schema definition is on its page, and none of
    the tables is typed into the page's source."""
    from pytest_transformers_opt.hookspecs import pytest_opt_register_techniques, pytest_opt_report_extra
    from pytest_transformers_opt.markers import MARKERS
    from pytest_transformers_opt.report.schema import load_schema
    from pytest_transformers_opt.techniques.catalogue import BUILTIN_TECHNIQUES

    def page(name: str) -> str:
        return _built(site, f"reference/{name}.md").read_text(encoding="utf-8")

    options = page("options")
    for option in OPTIONS:
        assert f"<code>{option.flag}" in options, option.flag
        for twin in (option.ini, option.env):
            if twin:
                assert f"<code>{twin}</code>" in options, twin
    for name in BUDGETS:
        assert f"<code>opt_{name}</code>" in options and f"<code>{name}</code>" in page("budgets"), name
    for name in MARKERS:
        assert f"@pytest.mark.{name}(" in page("markers"), name
    for hook in (pytest_opt_register_techniques, pytest_opt_report_extra):
        assert hook.__name__ in page("hooks")
    assert "<code>opt_bench</code>" in page("fixtures") and "<code>opt_hardware</code>" in page("fixtures")
    for technique in BUILTIN_TECHNIQUES:
        assert f"<code>{technique.name}</code>" in page("techniques"), technique.name
    schema = page("report-schema")
    for definition in load_schema()["$defs"]:
        assert f'id="{definition}"' in schema, definition
    assert "usage: pytest-opt" in page("cli")
    for source in REFERENCE.glob("*.md"):
        text = source.read_text(encoding="utf-8")
        assert "| ---" not in text or source.name == "index.md", f"{source.name}: a table typed by hand"
        assert "--opt-report-json" not in text, f"{source.name}: option names typed by hand"


def test_an_unknown_reference_table_fails_the_build() -> None:
    reference = reference_hook()
    assert "`--opt-rounds=N|MIN..MAX|auto`" in reference.render("<!-- reference: options -->")
    with pytest.raises(ValueError, match="unknown reference table 'optoins'; known: options, "):
        reference.render("text\n<!-- reference: optoins -->\n", "page.md")
    with pytest.raises(ValueError, match="no technique of family 'atention'"):
        reference.render("<!-- reference: techniques family=atention -->")


# --------------------------------------------------------------------------- links


class _Links(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.links: list[str] = []
        self.ids: set[str] = set()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        for name, value in attrs:
            if name == "id" and value:
                self.ids.add(value)
            if value and ((name == "href" and tag in ("a", "link")) or (name == "src" and tag in ("img", "script"))):
                self.links.append(value)


@functools.lru_cache(maxsize=None)
def _parsed(path: Path) -> _Links:
    parser = _Links()
    parser.feed(path.read_text(encoding="utf-8"))
    return parser


def _target(site: Path, page: Path, href: str) -> tuple[Path, str] | None:
    """The built file and fragment an internal link points at; None for an external one."""
    parts = urlsplit(href)
    if parts.scheme or parts.netloc or href.startswith(("mailto:", "javascript:")):
        return None
    base = "/" + str(page.relative_to(site))
    resolved = urlsplit(urljoin(base, parts.path)).path if parts.path else base
    target = site / unquote(resolved).lstrip("/")
    if resolved.endswith("/") or target.is_dir():
        target = target / "index.html"
    return target, parts.fragment


def test_every_internal_link_and_anchor_resolves(site: Path) -> None:
    pages = sorted(site.rglob("*.html"))
    assert len(pages) > 40
    broken, checked = [], 0
    for page in pages:
        for href in _parsed(page).links:
            found = _target(site, page, href)
            if found is None:
                continue
            target, fragment = found
            checked += 1
            if not target.is_file():
                broken.append(f"{page.relative_to(site)}: {href} (no {target.relative_to(site)})")
            elif fragment and target.suffix == ".html" and unquote(fragment) not in _parsed(target).ids:
                broken.append(f"{page.relative_to(site)}: {href} (no id {fragment!r})")
    assert checked > 1000  # every page's navigation, at least
    assert not broken, "\n".join(broken)


# --------------------------------------------------------------------------- Chromium

# One Chromium run: a driver page on the same server opens a few pages in a frame, reads each one's main
# content and every navigation link, asks the server for each link, and writes what it found into its DOM.
DRIVER = """<!doctype html><meta charset="utf-8"><title>docs check</title><iframe id="f" width="1200" height="900"></iframe>
<pre id="out">running</pre><script>
const pages = %s;
const frame = document.getElementById("f");
function load(url) { return new Promise(r => { frame.onload = () => setTimeout(r, 300); frame.src = url; }); }
(async () => {
  const result = {pages: {}, links: {}};
  for (const url of pages) {
    await load(url);
    const doc = frame.contentDocument;
    const main = doc.querySelector("article.md-content__inner");
    const nav = [...doc.querySelectorAll("nav.md-nav a.md-nav__link[href]")].map(a => a.href.split("#")[0]);
    result.pages[url] = {title: doc.title, words: main ? main.innerText.split(/\\s+/).length : 0,
                         nav: nav.length, search: !!doc.querySelector("input.md-search__input")};
    for (const href of nav) if (href.startsWith(location.origin)) result.links[href] = null;
  }
  for (const href of Object.keys(result.links)) {
    const response = await fetch(href);
    const text = await response.text();
    result.links[href] = response.ok && text.includes('class="md-content__inner') ? "ok" : "status " + response.status;
  }
  document.getElementById("out").textContent = JSON.stringify(result);
})().catch(e => { document.getElementById("out").textContent = "error " + e; });
</script>"""
CHECKED_PAGES = ["", "getting-started/", "techniques/attention/", "reports/window/", "reference/options/"]


@pytest.fixture()
def served(site: Path) -> Iterator[str]:
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002  (argparse's name)
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(site)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


@NEEDS_CHROMIUM
def test_pages_render_and_navigate_in_chromium_without_console_errors(site: Path, served: str,
                                                                     tmp_path: Path) -> None:
    (site / "_docs_check.html").write_text(DRIVER % json.dumps([served + page for page in CHECKED_PAGES]),
                                           encoding="utf-8")
    command = [str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
               "--disable-background-networking", "--disable-component-update", "--disable-sync",
               "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",  # nothing outside this server
               "--enable-logging=stderr", "--v=0", "--virtual-time-budget=60000",
               f"--user-data-dir={tmp_path / 'profile'}", "--dump-dom", served + "_docs_check.html"]
    dumped = subprocess.run(command, capture_output=True, text=True, timeout=180, check=False)
    assert dumped.returncode == 0, dumped.stderr[-3000:]
    console = [line for line in dumped.stderr.splitlines() if ":CONSOLE" in line]
    assert not console, "\n".join(console)  # no script error, no failed request, no console message
    out = re.search(r'<pre id="out">(.*?)</pre>', dumped.stdout, re.S)
    assert out and out.group(1).startswith("{"), dumped.stdout[-2000:]
    result = json.loads(out.group(1).replace("&amp;", "&").replace("&lt;", "<").replace("&gt;", ">"))
    for page, seen in result["pages"].items():
        assert seen["words"] > 40 and seen["nav"] > 30 and seen["search"], (page, seen)
        assert seen["title"].endswith("pytest-transformers-opt"), (page, seen)
    assert len(result["links"]) == len(_nav_pages())  # the navigation reaches every page
    assert set(result["links"].values()) == {"ok"}, {k: v for k, v in result["links"].items() if v != "ok"}


# --------------------------------------------------------------------------- examples


def _tests_of(block: Block) -> list[str]:
    return [node.name for node in ast.parse(block.text).body
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")]


def test_every_block_is_of_a_known_kind(capsys: pytest.CaptureFixture[str]) -> None:
    blocks = all_blocks()
    kinds = Counter(block.kind for block in blocks)
    run = kinds["test"] + kinds["conftest"]
    syntax = sum(kinds[kind] for kind in SYNTAX_ONLY)
    validated = sum(kinds[kind] for kind in ("ini", "toml", "yaml", "json"))
    shown = kinds["shown"] + kinds["outline"]
    assert run + syntax + validated + shown == len(blocks)
    assert run >= 15 and validated >= 10 and syntax >= 5  # the pages teach by example
    with capsys.disabled():
        print(f"\ndocs examples: {len(blocks)} blocks: {run} run ({kinds['test']} test files, {kinds['conftest']} "
              f"conftests), {validated} validated ({kinds['ini']} ini, {kinds['toml']} TOML, {kinds['yaml']} YAML, "
              f"{kinds['json']} JSON), {syntax} syntax-only ("
              + ", ".join(f"{kinds[k]} {k}" for k in SYNTAX_ONLY) + f"), {shown} shown (output, commands, outlines)")


@pytest.mark.parametrize("page, problem", [
    ("```rust\nfn main() {}\n```\n", "a block of unknown kind ('rust')"),
    ("<!-- example: needs-tpu -->\n```python\ndef test_x(): pass\n```\n", "unknown Python example kind 'needs-tpu'"),
    ("```python\nprint('hi')\n```\n", "a Python block with no test function"),
    ("<!-- example needs-gpu -->\n```python\ndef test_x(): pass\n```\n", "malformed example comment"),
    ("<!-- example: outline -->\n```ini\n[pytest]\n```\n", "a ini block marked 'outline'"),
    ("<!-- example: test expect=crashed -->\n```python\ndef test_x(): pass\n```\n", "expect='crashed'"),
])
def test_a_block_of_unknown_kind_is_refused_with_its_line(tmp_path: Path, page: str, problem: str) -> None:
    path = tmp_path / "page.md"
    path.write_text("# A page\n\nText.\n\n" + page, encoding="utf-8")
    with pytest.raises(ExampleError) as raised:
        blocks_of(path)
    assert f"page.md:{5 if page.startswith('`') else 6}: " in str(raised.value)
    assert problem in str(raised.value)


def test_every_python_example_runs_on_the_builtin_models(pytester: pytest.Pytester) -> None:
    """One pytest session: each runnable example in a folder of its own (with its conftest), run for real
    with one timed round and no warm-up; the syntax-only ones beside them, compiled, collected and deselected."""
    blocks = [b for b in all_blocks() if b.kind in ("test", "conftest", *SYNTAX_ONLY)]
    paired = {id(b.conftest) for b in blocks if b.conftest is not None}
    expected: dict[str, tuple[str, str]] = {}  # node id -> (expected outcome, where)
    deselect, syntax_only = [], {}
    for block in blocks:
        compile(block.text, block.where, "exec")  # a syntax error names the page and line
        folder = pytester.path / f"ex_{block.slug}"
        if block.kind == "conftest":
            if id(block) not in paired:  # a conftest with no test after it: loaded when pytest collects its folder
                folder.mkdir()
                (folder / "conftest.py").write_text(block.text, encoding="utf-8")
            continue
        folder.mkdir()
        if block.conftest is not None:
            (folder / "conftest.py").write_text(block.conftest.text, encoding="utf-8")
        module = folder / f"test_{block.slug}.py"
        module.write_text(block.text, encoding="utf-8")
        nodeids = [f"{folder.name}/{module.name}::{name}" for name in _tests_of(block)]
        if block.kind in SYNTAX_ONLY:
            deselect += ["--deselect", folder.name + "/"]
            syntax_only.update({nodeid: block.where for nodeid in nodeids})
        else:
            expected.update({nodeid: (block.expect, block.where) for nodeid in nodeids})
    started = time.perf_counter()
    result = pytester.runpytest("-p", "no:cacheprovider", "--opt-rounds=1", "--opt-warmup=0",
                                "--opt-report-json=report.json", *deselect)
    seconds = time.perf_counter() - started
    outcomes: dict[str, str] = {}
    for report in result.reprec.getreports("pytest_runtest_logreport"):  # type: ignore[attr-defined]
        if report.failed or report.skipped or report.when == "call":
            outcomes.setdefault(report.nodeid, report.outcome)
    wrong = {nodeid: f"{where}: expected {want}, got {outcomes.get(nodeid, 'not run')}"
             for nodeid, (want, where) in expected.items() if outcomes.get(nodeid) != want}
    assert not wrong, "\n".join(wrong.values()) + "\n" + "\n".join(result.outlines[-60:])
    assert set(outcomes) == set(expected)  # no test that no page shows
    deselected = {item.nodeid for call in result.reprec.getcalls("pytest_deselected")  # type: ignore[attr-defined]
                  for item in call.items}
    assert deselected == set(syntax_only), "collection of the syntax-only examples:\n" + "\n".join(result.outlines[-40:])
    report = json.loads((pytester.path / "report.json").read_text())
    ran = {row["nodeid"] for row in report["tests"] if row["outcome"] == "passed"}
    assert ran == {n for n, (want, _) in expected.items() if want == "passed"}  # measured, in the report
    print(f"{len(expected)} example tests run in {seconds:.1f} s")


def _check_ini_key(key: str, value: str, where: str) -> None:
    """An ``opt_*`` key is one the plugin reads, and its value one that key's own parser accepts."""
    if not key.startswith("opt_"):
        return  # pytest's own keys and other plugins'
    by_ini = {option.ini: option for option in OPTIONS if option.ini}
    if key in by_ini:
        by_ini[key].parse(value)
    elif key.removeprefix("opt_") in BUDGETS:
        parse_budget(key.removeprefix("opt_"), value, where)
    elif key != "opt_baseline":
        pytest.fail(f"{where}: {key} is not an ini key of the plugin; known: {', '.join(sorted(by_ini))}, "
                    f"opt_baseline and opt_<budget>")


def _workflow_of(block: Block, data: Any) -> dict[str, Any] | None:
    """A workflow to lint: the block itself, or its list of steps in a job of their own."""
    if isinstance(data, dict) and "jobs" in data:
        return data
    if isinstance(data, list) and data and all(isinstance(s, dict) and ("uses" in s or "run" in s) for s in data):
        job: dict[str, Any] = {"runs-on": "ubuntu-latest", "steps": data}
        matrix = sorted(set(re.findall(r"matrix\.([A-Za-z_][\w-]*)", block.text)))
        if matrix:
            job["strategy"] = {"matrix": {key: ["1"] for key in matrix}}
        return {"name": "docs example", "on": "push", "jobs": {"example": job}}
    return None


def test_every_config_example_is_valid(tmp_path: Path) -> None:
    """ini and TOML parse, with every opt_* key read and its value accepted by the plugin's own parser; YAML
    workflows (and lists of steps) pass actionlint; JSON loads."""
    workflows: dict[Path, Block] = {}
    counts: Counter[str] = Counter()
    for block in all_blocks():
        if block.kind == "ini":
            parser = configparser.ConfigParser(interpolation=None)
            parser.read_string(block.text, source=block.where)
            assert parser.sections() in (["pytest"], ["tool:pytest"]), f"{block.where}: {parser.sections()}"
            for key, value in parser.items(parser.sections()[0]):
                _check_ini_key(key, value, block.where)
        elif block.kind == "toml":
            data = tomllib.loads(block.text)
            section = data.get("tool", {}).get("pytest", {}).get("ini_options")
            assert section, f"{block.where}: no [tool.pytest.ini_options]"
            for key, value in section.items():
                _check_ini_key(key, str(value), block.where)
        elif block.kind == "yaml":
            data = yaml.safe_load(block.text)
            workflow = _workflow_of(block, data)
            if workflow is not None:
                path = tmp_path / f"{block.slug}.yml"
                path.write_text(block.text if workflow is data else yaml.safe_dump(workflow, sort_keys=False),
                                encoding="utf-8")
                workflows[path] = block
        elif block.kind == "json":
            json.loads(block.text)
        counts[block.kind] += 1
    assert counts["ini"] >= 3 and counts["toml"] >= 2 and len(workflows) >= 6
    linted = subprocess.run([_actionlint(), "-no-color", "-oneline", "-config-file", str(PROJECT_ACTIONLINT_CONFIG),
                             *map(str, workflows)], capture_output=True, text=True, timeout=120, check=False)
    problems = [line for line in linted.stdout.splitlines() if line.strip()]
    named = [f"{workflows[Path(line.split(':', 1)[0])].where}: {line}" for line in problems]
    assert linted.returncode == 0 and not problems, "\n".join(named) or linted.stderr


def test_every_option_named_on_a_page_exists() -> None:
    """A `--opt-*` flag in any page or the README, prose or block, is one the plugin has."""
    flags = {option.flag for option in OPTIONS}
    unknown = []
    for page in [*sorted(DOCS.rglob("*.md")), ROOT / "README.md"]:
        for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
            for flag in re.findall(r"(?<![\w-])--opt-[a-z0-9-]*[a-z0-9]", line):
                if flag not in flags:
                    unknown.append(f"{page.relative_to(ROOT)}:{number}: {flag}")
    assert not unknown, "\n".join(unknown)


def test_every_pytest_opt_command_on_a_page_parses(capsys: pytest.CaptureFixture[str]) -> None:
    """Each `$ pytest-opt ...` line of a shown block is accepted by the command's own argument parser."""
    import shlex

    from pytest_transformers_opt.cli import build_parser

    commands, refused = 0, []
    for block in all_blocks():
        if block.kind != "shown":
            continue
        for line in block.text.splitlines():
            match = re.match(r"\s*\$ pytest-opt (.*)", line)
            if not match:
                continue
            for command in match.group(1).split("  #")[0].split("&&")[:1]:  # what follows && is another command
                commands += 1
                try:
                    build_parser().parse_args(shlex.split(command))
                except SystemExit:
                    refused.append(f"{block.where}: pytest-opt {command}: {capsys.readouterr().err.strip()}")
    assert commands >= 6
    assert not refused, "\n".join(refused)
