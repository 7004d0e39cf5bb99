"""The package type-checks: ``mypy`` with the project's configuration (``[tool.mypy]`` in pyproject.toml)
is clean, and every ``type: ignore`` in the package names its error code and says why on its line.
"""

from __future__ import annotations

import importlib.util
import io
import re
import subprocess
import sys
import tokenize
from pathlib import Path


import pytest_transformers_opt

PACKAGE = Path(pytest_transformers_opt.__file__).parent
ROOT = Path(__file__).resolve().parents[2]
# "# type: ignore[code]  # why": an error code, then a comment of its own that gives the reason
_IGNORE = re.compile(r"#\s*type:\s*ignore\b")
_EXPLAINED_IGNORE = re.compile(r"#\s*type:\s*ignore\[[\w\-, ]+\]\s+#\s*\S")


def test_mypy_is_clean_on_the_package() -> None:
    # the test extra installs mypy and these tests run from the checkout: a missing one is a broken setup
    assert importlib.util.find_spec("mypy") is not None, "mypy is not installed: pip install -e .[test]"
    assert (ROOT / "pyproject.toml").is_file() and (ROOT / PACKAGE.name).is_dir(), f"no source checkout at {ROOT}"
    # the configuration names the files, so this is the command a contributor runs: mypy
    done = subprocess.run([sys.executable, "-m", "mypy", "--config-file", "pyproject.toml"], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    output = (done.stdout + done.stderr).strip()
    assert done.returncode == 0, f"mypy found problems (exit status {done.returncode}):\n{output}"
    assert output.startswith("Success: no issues found"), output


def unexplained_ignores(source: str) -> list[tuple[int, str]]:
    """(line, comment) of every ``type: ignore`` comment without an error code and a reason."""
    found = []
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT and _IGNORE.search(token.string) \
                and not _EXPLAINED_IGNORE.search(token.string):
            found.append((token.start[0], token.string))
    return found


def test_unexplained_ignores_are_found() -> None:
    source = ("a = 1  # type: ignore\n"
              "b = 2  # type: ignore[assignment]\n"
              "c = 3  # type: ignore[assignment]  # torch's stubs say int\n"
              "d = '# type: ignore'\n")
    assert [line for line, _ in unexplained_ignores(source)] == [1, 2]


def test_every_type_ignore_in_the_package_gives_its_reason() -> None:
    problems = [f"{path.relative_to(PACKAGE.parent)}:{line}: {comment}"
                for path in sorted(PACKAGE.rglob("*.py"))
                for line, comment in unexplained_ignores(path.read_text(encoding="utf-8"))]
    assert not problems, ("write each as `# type: ignore[code]  # why` (or fix the type):\n"
                          + "\n".join(problems))
