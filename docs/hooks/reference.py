"""MkDocs hook: the Reference pages, generated from the code's own tables at build time.

A page asks for a table with a comment on a line of its own, ``<!-- reference: NAME -->`` (``NAME`` one of
``GENERATORS``, with ``key=value`` arguments for some). The hook replaces it with Markdown built from the
table the plugin itself reads: ``options.OPTIONS``, ``verdict.budgets.BUDGETS`` and ``default_similarity``,
``markers.MARKERS``, the fixtures in ``fixtures.py``, ``hookspecs.py``, the technique catalogue, the
built-in models, ``cli.build_parser()`` and ``report/report_schema.json``. Nothing there is typed by hand,
so the pages cannot drift from the code; an unknown name fails the build.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import json
import os
import re
import shlex
import sys
import textwrap
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # a build from a checkout where the package is not installed
    sys.path.insert(0, str(ROOT))

PLACEHOLDER = re.compile(r"^<!-- reference: ([a-z-]+)((?: [a-z_]+=[^ ]+)*) -->$", re.M)


def _cell(text: Any) -> str:
    """One Markdown table cell: line breaks folded, pipes escaped outside code spans (inside one, the tables
    extension keeps a pipe as it is, and would show a backslash)."""
    parts = " ".join(str(text).split()).split("`")
    return "`".join(part if index % 2 else part.replace("|", "\\|") for index, part in enumerate(parts))


def _code(text: Any) -> str:
    return f"`{text}`" if text not in (None, "") else ""


def _table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


# -- options ---------------------------------------------------------------------------------------


def options() -> str:
    from pytest_transformers_opt.options import OPTIONS

    rows = []
    for option in OPTIONS:
        flag = option.flag if option.is_flag else f"{option.flag}={option.metavar}"
        default = "" if option.is_flag or option.default in (None, ()) else _code(_default_text(option.default))
        rows.append([_code(flag), _code(option.ini), _code(option.env), default, option.help])
    return _table(["option", "ini key", "environment variable", "default", "meaning"], rows)


def _default_text(value: Any) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    text = getattr(value, "text", None)  # a rounds rule keeps the form it was given in
    return str(text) if text else str(value)


def ini_budgets() -> str:
    from pytest_transformers_opt.verdict.budgets import BUDGETS

    rows = [[_code(f"opt_{name}"), f"default budget {name} for every test: {budget.help}"]
            for name, budget in BUDGETS.items()]
    rows.append([_code("opt_baseline"), "default baseline techniques, comma-separated (default: eager)"])
    return _table(["ini key", "meaning"], rows)


# -- budgets ---------------------------------------------------------------------------------------


def budgets() -> str:
    from pytest_transformers_opt.verdict.budgets import BUDGETS, SIMILARITY_BUDGETS, SPEED_BUDGETS

    rows = []
    for name, budget in BUDGETS.items():
        kind = ("speed" if name in SPEED_BUDGETS else "similarity" if name in SIMILARITY_BUDGETS
                else "memory" if "memory" in name else "other")
        rows.append([_code(name), "at most" if budget.kind == "max" else "at least", kind, budget.help])
    return _table(["budget", "limit", "kind", "measured as: accepted forms"], rows)


def similarity_defaults() -> str:
    from pytest_transformers_opt.techniques.base import QUALITY_ORDER
    from pytest_transformers_opt.verdict.budgets import default_similarity

    def show(budgets: dict[str, float]) -> str:
        return ", ".join(f"`{name}={limit:g}`" for name, limit in budgets.items())

    rows = []
    for quality in QUALITY_ORDER:
        rows.append([_code(quality), show(default_similarity(quality, "float32")),
                     show(default_similarity(quality, "bfloat16")),
                     show(default_similarity(quality, "float32", distributions=False))])
    return _table(["quality class", "float32", "bfloat16 / float16", "tokens only (continuous batching), float32"],
                  rows)


# -- markers, fixtures, hooks ----------------------------------------------------------------------


def markers() -> str:
    from pytest_transformers_opt.markers import MARKERS, marker_help

    parts = []
    for name, function in MARKERS.items():
        signature = marker_help(name).split(":", 1)[0]
        parts.append(f"### `{name}`\n\n```text\n@pytest.mark.{signature}\n```\n\n{inspect.getdoc(function)}\n")
    return "\n".join(parts)


def fixtures() -> str:
    """Read from the source (``ast``): every ``@pytest.fixture`` function of fixtures.py, its scope and docstring."""
    source = (ROOT / "pytest_transformers_opt" / "fixtures.py").read_text(encoding="utf-8")
    rows = []
    for node in ast.parse(source).body:
        if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
            continue
        scope = None
        for decorator in node.decorator_list:
            call = decorator if isinstance(decorator, ast.Call) else None
            target = call.func if call else decorator
            if ast.unparse(target) != "pytest.fixture":
                continue
            scope = "function"
            for keyword in call.keywords if call else []:
                if keyword.arg == "scope" and isinstance(keyword.value, ast.Constant):
                    scope = str(keyword.value.value)
        if scope is None:
            continue
        uses = [a.arg for a in node.args.args if a.arg != "request"]
        doc = (ast.get_docstring(node) or "").replace("``", "`")
        rows.append([_code(node.name), scope, ", ".join(_code(u) for u in uses), doc])
    return _table(["fixture", "scope", "uses", "gives"], rows)


def hooks() -> str:
    from pytest_transformers_opt import hookspecs

    parts = []
    for name, function in inspect.getmembers(hookspecs, inspect.isfunction):
        if not name.startswith("pytest_"):
            continue
        signature = str(inspect.signature(function)).replace("'", "")
        parts.append(f"### `{name}`\n\n```text\n{name}{signature}\n```\n\n{_rst_to_markdown(inspect.getdoc(function) or '')}\n")
    return "\n".join(parts)


def _rst_to_markdown(doc: str) -> str:
    """A docstring's ``code`` and ``Example::`` blocks as Markdown."""
    out: list[str] = []
    lines = doc.splitlines()
    index = 0
    while index < len(lines):
        line = lines[index]
        if line.rstrip().endswith("::"):
            out.append(line.rstrip()[:-1].replace("``", "`"))
            block: list[str] = []
            index += 1
            while index < len(lines) and (not lines[index].strip() or lines[index].startswith("    ")):
                block.append(lines[index])
                index += 1
            # the suite runs every example of the site (tests/doc_examples.py): a conftest's is loaded as one
            kind = "conftest" if "conftest" in line else "test"
            out += ["", f"<!-- example: {kind} -->", "```python", textwrap.dedent("\n".join(block)).strip("\n"),
                    "```", ""]
            continue
        out.append(line.replace("``", "`"))
        index += 1
    return "\n".join(out)


# -- techniques and models -------------------------------------------------------------------------


def techniques(family: str | None = None) -> str:
    """The catalogue; with ``family``, that family's techniques in fewer columns (a family's own page)."""
    from pytest_transformers_opt.techniques.catalogue import BUILTIN_TECHNIQUES

    rows = []
    for technique in BUILTIN_TECHNIQUES:
        if family is not None and technique.family != family:
            continue
        params = "; ".join(f"`{k}`: {v}" for k, v in technique.accepted_params.items()) or "none"
        when = "load" if technique.load_time else "generation"
        if family is None:
            rows.append([_code(technique.name), technique.family, technique.summary, technique.requirement,
                         _code(technique.quality), when, params, f"[docs]({technique.docs})"])
        else:
            rows.append([f"[`{technique.name}`]({technique.docs})", technique.summary, technique.requirement,
                         _code(technique.quality), params])
    if not rows:
        raise ValueError(f"no technique of family {family!r} in the catalogue")
    if family is None:
        return _table(["name", "family", "what it sets", "needs", "quality class", "applied at", "parameters",
                       "documentation"], rows)
    return _table(["name (its documentation)", "what it sets", "needs", "quality class", "parameters"], rows)


def models() -> str:
    from pytest_transformers_opt.engine.real_models import REAL_MODELS
    from pytest_transformers_opt.engine.tiny_models import TINY_MODELS

    rows = []
    for spec in TINY_MODELS.values():
        shape = (f"{spec.model_type}, hidden {spec.hidden_size}, {spec.num_hidden_layers} layers, "
                 f"{spec.num_attention_heads} heads / {spec.num_key_value_heads} KV heads, vocab {spec.vocab_size}")
        rows.append([_code(spec.name), spec.description, shape, "none"])
    for real in REAL_MODELS.values():
        rows.append([_code(real.name), real.description, f"GGUF `{real.gguf_file}`", _code(real.install)])
    return _table(["name", "what it is", "shape", "install"], rows)


# -- the pytest-opt command ------------------------------------------------------------------------


def cli() -> str:
    from pytest_transformers_opt.cli import build_parser

    parser = build_parser()
    parts = [f"```text\n{_help(parser)}\n```\n"]
    for action in parser._actions:  # argparse keeps its subcommands only here
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                parts.append(f"### `{parser.prog} {name}`\n\n```text\n{_help(sub)}\n```\n")
    return "\n".join(parts)


def _help(parser: argparse.ArgumentParser) -> str:
    columns = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "100"  # argparse wraps at the terminal's width: the same page on every machine
    try:
        return parser.format_help().rstrip()
    finally:
        if columns is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = columns


# -- the report's JSON schema ----------------------------------------------------------------------


def report_schema() -> str:
    from pytest_transformers_opt.report.schema import REPORT_SCHEMA, REPORT_SCHEMA_VERSION, load_schema

    schema = load_schema()
    parts = [f"Schema id `{REPORT_SCHEMA}`, `schema_version` {REPORT_SCHEMA_VERSION}. {schema.get('description', '')}"]
    parts += _object_sections("The report", "report", {**schema, "description": None})
    for name, definition in schema.get("$defs", {}).items():
        parts += _object_sections(f"`{name}`", name, definition)
    return "\n".join(parts)


def _object_sections(title: str, anchor: str, definition: dict[str, Any]) -> list[str]:
    """A heading with an explicit id, the description, the field table, then a section per inline object."""
    parts = ["", f"### {title} {{#{anchor}}}", ""]
    if definition.get("description"):
        parts += [_cell(definition["description"]), ""]
    if "properties" not in definition:
        return parts + [f"Type: {_type_of(definition)}"]
    required = set(definition.get("required", ()))
    rows, nested = [], []
    for field, spec in definition["properties"].items():
        inner = spec.get("items") if spec.get("type") == "array" else spec
        if isinstance(inner, dict) and "properties" in inner and "$ref" not in inner:
            child = f"{anchor}.{field}"
            kind = f"[{child}](#{child})"
            rows.append([_code(field), f"array of {kind}" if inner is not spec else kind,
                         "yes" if field in required else "", spec.get("description", "")])
            nested.append((child, inner))
        else:
            rows.append([_code(field), _type_of(spec), "yes" if field in required else "", spec.get("description", "")])
    parts.append(_table(["field", "type", "required", "meaning"], rows))
    for child, inner in nested:
        parts += _object_sections(f"`{child}`", child, inner)
    return parts


def _type_of(spec: dict[str, Any]) -> str:
    if "$ref" in spec:  # "#/$defs/NAME", "#/$defs/NAME/properties/FIELD" or "#/properties/FIELD"
        parts = [p for p in spec["$ref"].lstrip("#/").split("/") if p != "properties"]
        if parts[0] == "$defs":
            label, anchor = ".".join(parts[1:]), parts[1]
        else:
            label, anchor = "report." + ".".join(parts), "report"
        return f"[{label}](#{anchor})"
    if "const" in spec:
        return f"`{json.dumps(spec['const'])}`"
    if "enum" in spec:
        return "one of " + ", ".join(f"`{json.dumps(v)}`" for v in spec["enum"])
    kinds = spec.get("type")
    if isinstance(kinds, list):
        return " or ".join(kinds)
    if kinds == "array" and isinstance(spec.get("items"), dict):
        return f"array of {_type_of(spec['items'])}"
    if "anyOf" in spec or "oneOf" in spec:
        return " or ".join(_type_of(s) for s in spec.get("anyOf", spec.get("oneOf", [])))
    return str(kinds or "any")


GENERATORS: dict[str, Callable[..., str]] = {
    "options": options,
    "ini-budgets": ini_budgets,
    "budgets": budgets,
    "similarity-defaults": similarity_defaults,
    "markers": markers,
    "fixtures": fixtures,
    "hooks": hooks,
    "techniques": techniques,
    "models": models,
    "cli": cli,
    "report-schema": report_schema,
}


def render(markdown: str, where: str = "a page") -> str:
    """``markdown`` with every ``<!-- reference: NAME -->`` line replaced by its generated Markdown."""

    def replace(match: re.Match[str]) -> str:
        name, raw = match.group(1), match.group(2)
        if name not in GENERATORS:
            raise ValueError(f"{where}: unknown reference table {name!r}; known: {', '.join(GENERATORS)}")
        arguments = dict(item.split("=", 1) for item in shlex.split(raw))
        return GENERATORS[name](**arguments)

    return PLACEHOLDER.sub(replace, markdown)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    from mkdocs.exceptions import PluginError

    try:
        return render(markdown, page.file.src_uri)
    except (ValueError, TypeError) as exc:
        raise PluginError(str(exc)) from exc
