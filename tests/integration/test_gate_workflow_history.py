"""The GPU gate's history of main's runs, run as GitHub would run it: main records, a pull request only reads.

Each job of ``.github/workflows/gpu-gate.yml`` (both variants) and of the workflow ``pytest-opt init`` writes
is run step by step (``run_job``): its ``run:`` steps under bash as the runner runs them, its ``${{ }}``
expressions and ``if:`` conditions evaluated, and ``actions/cache`` played by ``FakeCache``, which keeps
GitHub's rules: a restore reads the run's own branch, then the default branch; ``key`` must match exactly,
each of ``restore-keys`` is a prefix matched by the newest entry; an entry is saved under the run's branch
and never replaced. ``pytest`` is a stand-in that keeps the plugin's folder contract (checked against the
real plugin at the end of this file): ``--opt-history=DIR`` records one run file in DIR, ``--opt-compare``
naming a missing path that is not this run's history folder is a usage error. The checks read the folders
and the cache's entries.
"""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import pytest
import yaml

from pytest_transformers_opt.report.history import NAME_PATTERN
from pytest_transformers_opt.scaffold.templates import gpu_gate_workflow

ROOT = Path(__file__).resolve().parents[2]
GATE_YML = ROOT / ".github" / "workflows" / "gpu-gate.yml"
CACHES_MD = ROOT / "docs" / "ci" / "caches.md"
REPOSITORY = "team/project"
MAIN = "refs/heads/main"
HISTORY = ".opt-history-main"


# --------------------------------------------------------------------------- GitHub's expressions


_TOKEN = re.compile(r"\s*(?:(?P<string>'(?:[^']|'')*')|(?P<number>\d+(?:\.\d+)?)|(?P<op>==|!=|&&|\|\||[!().,\[\]])"
                    r"|(?P<name>[A-Za-z_][A-Za-z0-9_-]*))")


class Expression:
    """The part of GitHub's expression language these workflows use: names (``a.b.c``, ``a['b']``), string and
    number literals, ``== != && || !``, parentheses and the status functions. Loose equality as GitHub's:
    strings compare case-insensitively, a boolean compares as ``true``/``false``."""

    def __init__(self, text: str, context: dict[str, Any], status: dict[str, bool]) -> None:
        self.tokens: list[tuple[str, str]] = []
        position = 0
        text = text.strip()
        while position < len(text):
            match = _TOKEN.match(text, position)
            assert match and match.end() > position, f"cannot read the expression {text!r} at {position}"
            kind = match.lastgroup
            assert kind is not None
            self.tokens.append((kind, match.group(kind)))
            position = match.end()
        self.index = 0
        self.context = context
        self.status = status

    def value(self) -> Any:
        result = self._or()
        assert self.index == len(self.tokens), f"unread tokens in {self.tokens}"
        return result

    def _peek(self) -> str | None:
        return self.tokens[self.index][1] if self.index < len(self.tokens) else None

    def _take(self, expected: str | None = None) -> tuple[str, str]:
        token = self.tokens[self.index]
        assert expected is None or token[1] == expected, (token, expected)
        self.index += 1
        return token

    def _or(self) -> Any:
        left = self._and()
        while self._peek() == "||":
            self._take()
            right = self._and()
            left = left if _truthy(left) else right
        return left

    def _and(self) -> Any:
        left = self._unary()
        while self._peek() == "&&":
            self._take()
            right = self._unary()
            left = right if _truthy(left) else left
        return left

    def _unary(self) -> Any:
        if self._peek() == "!":
            self._take()
            return not _truthy(self._unary())
        left = self._primary()
        if self._peek() in ("==", "!="):
            operator = self._take()[1]
            same = _text(left).lower() == _text(self._primary()).lower()
            return same if operator == "==" else not same
        return left

    def _primary(self) -> Any:
        kind, token = self._take()
        if token == "(":
            inner = self._or()
            self._take(")")
            return inner
        if kind == "string":
            return token[1:-1].replace("''", "'")
        if kind == "number":
            return token
        assert kind == "name", token
        if token in ("true", "false"):
            return token == "true"
        if self._peek() == "(":
            self._take("(")
            args = []
            while self._peek() != ")":
                args.append(self._or())
                if self._peek() == ",":
                    self._take()
            self._take(")")
            return self._call(token, args)
        value: Any = self.context.get(token)
        while self._peek() in (".", "["):
            if self._take()[1] == ".":
                key = self._take()[1]
            else:
                key = str(self._or())
                self._take("]")
            value = value.get(key) if isinstance(value, dict) else None
        return value

    def _call(self, name: str, args: list[Any]) -> Any:
        if name in self.status:
            return self.status[name]
        if name == "hashFiles":
            return "f" * 64  # the tests' files do not change between the runs here
        if name == "fromJSON":
            return json.loads(args[0])
        raise AssertionError(f"the function {name}() is not played by this test")


def _truthy(value: Any) -> bool:
    return value not in (None, False, "", 0)


def _text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return "" if value is None else str(value)


def evaluate(text: str, context: dict[str, Any], status: dict[str, bool] | None = None) -> Any:
    """An ``if:`` condition (with or without ``${{ }}``)."""
    text = text.strip()
    if text.startswith("${{") and text.endswith("}}"):
        text = text[3:-2]
    return Expression(text, context, status or {}).value()


def interpolate(text: str, context: dict[str, Any]) -> str:
    """A value with ``${{ ... }}`` parts, as the runner substitutes them."""
    return re.sub(r"\$\{\{(.*?)\}\}", lambda match: _text(Expression(match.group(1), context, {}).value()), text)


# --------------------------------------------------------------------------- actions/cache


@dataclass
class CacheEntry:
    key: str
    scope: str  # the ref of the run that saved it
    files: dict[str, bytes]
    order: int


@dataclass
class FakeCache:
    """The repository's Actions cache, as actions/cache/restore and actions/cache/save see it."""

    default_branch: str = MAIN
    entries: list[CacheEntry] = field(default_factory=list)

    def restore(self, ref: str, key: str, restore_keys: list[str]) -> CacheEntry | None:
        scopes = [ref] + ([self.default_branch] if ref != self.default_branch else [])
        for scope in scopes:
            exact = [entry for entry in self.entries if entry.scope == scope and entry.key == key]
            if exact:
                return exact[-1]
        for prefix in restore_keys:
            for scope in scopes:
                matching = [entry for entry in self.entries if entry.scope == scope and entry.key.startswith(prefix)]
                if matching:
                    return max(matching, key=lambda entry: entry.order)
        return None

    def save(self, ref: str, key: str, folder: Path) -> None:
        assert not any(entry.scope == ref and entry.key == key for entry in self.entries), \
            f"a cache entry {key!r} exists on {ref}: an entry is never replaced, so this save would be lost"
        files = {path.relative_to(folder).as_posix(): path.read_bytes()
                 for path in sorted(folder.rglob("*")) if path.is_file()} if folder.is_dir() else {}
        self.entries.append(CacheEntry(key, ref, files, len(self.entries)))

    def history(self, scope: str | None = None) -> list[CacheEntry]:
        """The entries of run histories (the compile cache's are saved beside them), of one ref or all."""
        return [entry for entry in self.entries
                if entry.key.startswith("opt-history") and scope in (None, entry.scope)]


# --------------------------------------------------------------------------- the runner


@dataclass
class Event:
    """What triggered a run: the event, the ref, and for a pull request the repository its head comes from."""

    name: str
    ref: str
    run_id: int
    head_repository: str = REPOSITORY

    @classmethod
    def push_to_main(cls, run_id: int) -> Event:
        return cls("push", MAIN, run_id)

    @classmethod
    def pull_request(cls, run_id: int, number: int = 7, head_repository: str = REPOSITORY) -> Event:
        return cls("pull_request", f"refs/pull/{number}/merge", run_id, head_repository)


@dataclass
class StepRun:
    name: str
    ran: bool
    status: int = 0
    stdout: str = ""
    stderr: str = ""


@dataclass
class JobRun:
    steps: list[StepRun]
    outputs: dict[str, dict[str, str]]

    def step(self, words: str) -> StepRun:
        (found,) = [step for step in self.steps if words in step.name]
        return found

    @property
    def failed(self) -> bool:
        return any(step.status != 0 for step in self.steps)


def _step_name(step: dict[str, Any]) -> str:
    return str(step.get("name") or step.get("uses") or step.get("run", "").splitlines()[0])


def _fake_bin(folder: Path) -> Path:
    """Stand-ins for what a GPU runner has and this machine may not: python (pip, versions), nvidia-smi, pytest."""
    bin_dir = folder / "bin"
    bin_dir.mkdir(exist_ok=True)
    fakes = {
        "python": "#!/bin/sh\necho 0.0\n",  # pip installs nothing here; a version read prints 0.0
        "nvidia-smi": "#!/bin/sh\necho 'NVIDIA H100 80GB HBM3'\n",
        "pytest": f"#!{sys.executable}\n{FAKE_PYTEST}",
        "pytest-opt": "#!/bin/sh\nexit 0\n",
    }
    for name, body in fakes.items():
        path = bin_dir / name
        path.write_text(body, encoding="utf-8")
        path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return bin_dir


# The plugin's folder contract (checked against the real plugin by the last tests of this file), plus a log.
FAKE_PYTEST = r'''
import datetime, json, os, sys
args = sys.argv[1:]
def value(option):
    found = [arg.split("=", 1)[1] for arg in args if arg.startswith(option + "=")]
    return found[-1] if found else None
history, compare = value("--opt-history"), value("--opt-compare")
seen = sorted(os.listdir(compare)) if compare and os.path.isdir(compare) else None
with open(os.environ["PYTEST_LOG"], "a") as log:
    log.write(json.dumps({"args": args, "cwd": os.getcwd(), "compare_files": seen}) + "\n")
if compare and not os.path.isdir(compare) and not (history and os.path.abspath(history) == os.path.abspath(compare)):
    print(f"ERROR: --opt-compare: cannot read the report {compare!r}: No such file or directory")
    sys.exit(4)
if history:
    os.makedirs(history, exist_ok=True)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    name = f"{stamp}_{len(os.listdir(history)) + 1}-{os.environ['FAKE_COMMIT']}.json"
    with open(os.path.join(history, name), "w") as recorded:
        json.dump({"run": os.environ["FAKE_RUN"]}, recorded)
sys.exit(int(os.environ.get("FAKE_PYTEST_STATUS", "0")))
'''


def run_job(workflow: dict[str, Any], job_name: str, event: Event, cache: FakeCache, tmp_path: Path, *,
            matrix: dict[str, Any] | None = None, variables: dict[str, str] | None = None,
            pytest_status: int = 0, prepare: Callable[[Path], None] | None = None) -> JobRun | None:
    """One job of ``workflow`` in a fresh workspace, as the runner runs it for ``event``; None when its ``if:``
    leaves it out. ``prepare`` fills the checkout."""
    job = workflow["jobs"][job_name]
    run_dir = tmp_path / f"run-{event.run_id}-{job_name}-{'-'.join(map(str, (matrix or {}).values()))}"
    workspace = run_dir / "workspace"
    workspace.mkdir(parents=True)
    if prepare is not None:
        prepare(workspace)
    pull_request = {"head": {"repo": {"full_name": event.head_repository}}} if event.name == "pull_request" else None
    context: dict[str, Any] = {
        "github": {"event_name": event.name, "ref": event.ref, "ref_name": event.ref.removeprefix("refs/heads/")
                   .removeprefix("refs/"), "run_id": str(event.run_id), "run_attempt": "1",
                   "repository": REPOSITORY, "workspace": str(workspace), "event": {"pull_request": pull_request}},
        "vars": {"OPT_GATE_GPUS": "", **(variables or {})},
        "matrix": matrix or {},
        "runner": {"os": "Linux", "temp": str(run_dir / "temp")},
        "steps": {},
        "env": {},
    }
    if "if" in job and not _truthy(evaluate(str(job["if"]), context, {"always": True, "success": True,
                                                                          "failure": False, "cancelled": False})):
        return None
    context["env"] = {name: interpolate(str(value), context) for name, value in (job.get("env") or {}).items()}
    bin_dir = _fake_bin(run_dir)
    base_env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "HOME": str(run_dir), "LANG": "C.UTF-8",
                "GITHUB_EVENT_NAME": event.name, "GITHUB_REF": event.ref, "GITHUB_WORKSPACE": str(workspace),
                "GITHUB_REPOSITORY": REPOSITORY, "GITHUB_RUN_ID": str(event.run_id),
                "GITHUB_STEP_SUMMARY": str(run_dir / "summary.md"), "PYTEST_LOG": str(run_dir / "pytest.log"),
                "FAKE_RUN": f"{event.name}-{event.run_id}", "FAKE_COMMIT": f"{event.run_id:07x}",
                "FAKE_PYTEST_STATUS": str(pytest_status)}
    steps: list[StepRun] = []
    for index, step in enumerate(job["steps"]):
        name = _step_name(step)
        status = {"always": True, "success": not any(s.status for s in steps),
                  "failure": any(s.status for s in steps), "cancelled": False}
        if not _truthy(evaluate(str(step.get("if", "success()")), context, status)):
            steps.append(StepRun(name, ran=False))
            continue
        outputs: dict[str, str] = {}
        uses = str(step.get("uses", ""))
        inputs = {key: interpolate(str(value), context) for key, value in (step.get("with") or {}).items()}
        if uses.startswith("actions/cache/restore@"):
            restore_keys = [line.strip() for line in inputs.get("restore-keys", "").splitlines() if line.strip()]
            found = cache.restore(event.ref, inputs["key"], restore_keys)
            target = workspace / inputs["path"]
            if found is not None:
                for relative, data in found.files.items():
                    (target / relative).parent.mkdir(parents=True, exist_ok=True)
                    (target / relative).write_bytes(data)
            outputs = {"cache-hit": _text(found is not None and found.key == inputs["key"]),
                       "cache-primary-key": inputs["key"], "cache-matched-key": found.key if found else ""}
            result = StepRun(name, ran=True)
        elif uses.startswith("actions/cache/save@"):
            cache.save(event.ref, inputs["key"], workspace / inputs["path"])
            result = StepRun(name, ran=True)
        elif uses:  # checkout (the workspace is filled), artifacts, setup-python: nothing to play here
            result = StepRun(name, ran=True)
        else:
            env = {**base_env, **context["env"],
                   **{key: interpolate(str(value), context) for key, value in (step.get("env") or {}).items()}}
            output_file = run_dir / f"output-{index}"
            output_file.write_text("", encoding="utf-8")
            env["GITHUB_OUTPUT"] = str(output_file)
            script = run_dir / f"step-{index}.sh"
            script.write_text(interpolate(str(step["run"]), context), encoding="utf-8")
            shell = ["bash", "--noprofile", "--norc", "-eo", "pipefail"] if step.get("shell") == "bash" else ["bash", "-e"]
            cwd = workspace / interpolate(str(step.get("working-directory", ".")), context)
            done = subprocess.run([*shell, str(script)], cwd=cwd, env=env, capture_output=True, text=True,
                                  timeout=60, check=False)
            for line in output_file.read_text(encoding="utf-8").splitlines():
                key, _, value = line.partition("=")
                outputs[key] = value
            result = StepRun(name, ran=True, status=done.returncode, stdout=done.stdout, stderr=done.stderr)
        if "id" in step:
            context["steps"][step["id"]] = {"outputs": outputs}
        steps.append(result)
    return JobRun(steps, {key: value["outputs"] for key, value in context["steps"].items()})


def pytest_calls(tmp_path: Path, event: Event, job_name: str, matrix: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    run_dir = tmp_path / f"run-{event.run_id}-{job_name}-{'-'.join(map(str, (matrix or {}).values()))}"
    log = run_dir / "pytest.log"
    return [json.loads(line) for line in log.read_text(encoding="utf-8").splitlines()] if log.exists() else []


# --------------------------------------------------------------------------- the workflows under test


@dataclass(frozen=True)
class Gate:
    """A job that runs the gate: its workflow, its job, its matrix cell, the folder its tests run in."""

    name: str
    load: Callable[[], dict[str, Any]]
    job: str
    matrix: dict[str, Any] | None
    variables: dict[str, str] | None
    project: str  # where the tests live in the checkout ("." for the repository's root)


def _load_yaml(text: str) -> dict[str, Any]:
    data = yaml.safe_load(text)
    if True in data:  # YAML 1.1 reads the key `on` as a boolean
        data["on"] = data.pop(True)
    return dict(data)


GATES = [
    Gate("gpu-gate", lambda: _load_yaml(GATE_YML.read_text(encoding="utf-8")), "gpu-gate", None, None,
         "example_project"),
    Gate("gpu-gate shard", lambda: _load_yaml(GATE_YML.read_text(encoding="utf-8")), "shard",
         {"gpu": "h100", "shard": 2}, {"OPT_GATE_GPUS": '["h100"]'}, "example_project"),
    Gate("init", lambda: _load_yaml(gpu_gate_workflow(["sdpa", "compile"], "1.2.3")), "gpu-gate", None, None, "."),
]


def _prepare(gate: Gate) -> Callable[[Path], None]:
    def fill(workspace: Path) -> None:
        tests = workspace / gate.project / "tests"
        tests.mkdir(parents=True, exist_ok=True)
        for name in ("test_a.py", "test_b.py", "test_c.py"):  # the shard's fallback selection finds files
            (tests / name).write_text("def test_x():\n    pass\n", encoding="utf-8")
    return fill


def _run(gate: Gate, event: Event, cache: FakeCache, tmp_path: Path, pytest_status: int = 0) -> JobRun:
    job = run_job(gate.load(), gate.job, event, cache, tmp_path, matrix=gate.matrix, variables=gate.variables,
                  pytest_status=pytest_status, prepare=_prepare(gate))
    assert job is not None, f"{gate.name} did not run for {event}"
    return job


def _history_args(call: dict[str, Any]) -> dict[str, str]:
    return {arg.split("=", 1)[0]: arg.split("=", 1)[1] for arg in call["args"]
            if arg.startswith(("--opt-history", "--opt-compare"))}


def _recorded_runs(entry: CacheEntry) -> list[str]:
    """The runs an entry holds, oldest first (each file as the stand-in pytest wrote it)."""
    assert all(NAME_PATTERN.fullmatch(name) for name in entry.files), list(entry.files)  # --opt-history's names
    return [json.loads(entry.files[name])["run"] for name in sorted(entry.files)]


# --------------------------------------------------------------------------- the tests


@pytest.mark.parametrize("gate", GATES, ids=[gate.name for gate in GATES])
def test_main_records_its_runs_and_a_pull_request_is_judged_against_them(tmp_path: Path, gate: Gate) -> None:
    cache = FakeCache()
    # 1. the first run on main of a fresh repository: nothing to restore, an empty folder, one run recorded
    first = _run(gate, Event.push_to_main(101), cache, tmp_path)
    assert not first.failed, [(s.name, s.stdout, s.stderr) for s in first.steps if s.status]
    (call,) = pytest_calls(tmp_path, Event.push_to_main(101), gate.job, gate.matrix)
    folder = str(tmp_path / f"run-101-{gate.job}-{'-'.join(map(str, (gate.matrix or {}).values()))}" / "workspace"
                 / HISTORY)
    assert _history_args(call) == {"--opt-history": folder, "--opt-compare": folder, "--opt-compare-fail":
                                   "latency:10%,peak_memory:5%,kl_mean:0.01", "--opt-compare-confirm": "1"}
    assert call["compare_files"] == []  # the folder exists, empty: the plugin reads it as a history not begun
    (saved,) = cache.history(MAIN)
    assert _recorded_runs(saved) == ["push-101"]

    # 2. a pull request restores main's history, is compared with it, and neither records nor saves
    pull = _run(gate, Event.pull_request(202), cache, tmp_path)
    assert not pull.failed
    assert pull.outputs["history-cache"]["cache-matched-key"] == saved.key
    (call,) = pytest_calls(tmp_path, Event.pull_request(202), gate.job, gate.matrix)
    assert "--opt-history" not in _history_args(call)
    assert _history_args(call)["--opt-compare"].endswith(f"/workspace/{HISTORY}")
    assert call["compare_files"] == list(saved.files)  # main's recorded run, read
    assert not pull.step("Save main's run history").ran
    assert cache.history(Event.pull_request(202).ref) == [] and cache.history(MAIN) == [saved]  # main's history as it was

    # 3. main's next run restores the newest entry, records after it, and saves both runs under a new key
    _run(gate, Event.push_to_main(303), cache, tmp_path)
    newest = max(cache.history(MAIN), key=lambda entry: entry.order)
    assert newest.key != saved.key
    assert _recorded_runs(newest) == ["push-101", "push-303"]

    # 4. the next pull request reads both
    _run(gate, Event.pull_request(404, number=8), cache, tmp_path)
    (call,) = pytest_calls(tmp_path, Event.pull_request(404, number=8), gate.job, gate.matrix)
    assert call["compare_files"] == sorted(newest.files)
    assert len(cache.history(MAIN)) == 2 and cache.history("refs/pull/8/merge") == []


@pytest.mark.parametrize("gate", GATES, ids=[gate.name for gate in GATES])
def test_a_pull_request_before_any_run_on_main_compares_with_an_empty_folder(tmp_path: Path, gate: Gate) -> None:
    """The stand-in fails, as the plugin does, on an --opt-compare folder that is missing: the step makes it."""
    cache = FakeCache()
    pull = _run(gate, Event.pull_request(11), cache, tmp_path)
    assert not pull.failed, [(s.name, s.stdout, s.stderr) for s in pull.steps if s.status]
    (call,) = pytest_calls(tmp_path, Event.pull_request(11), gate.job, gate.matrix)
    assert call["compare_files"] == [] and "--opt-history" not in _history_args(call)
    assert cache.history() == []


@pytest.mark.parametrize("gate", GATES, ids=[gate.name for gate in GATES])
def test_a_run_on_main_that_fails_the_gate_is_recorded_too(tmp_path: Path, gate: Gate) -> None:
    cache = FakeCache()
    failed = _run(gate, Event.push_to_main(21), cache, tmp_path, pytest_status=1)
    assert failed.failed and failed.step("optimization tests").status == 1
    assert failed.step("Save main's run history").ran
    (saved,) = cache.history(MAIN)
    assert _recorded_runs(saved) == ["push-21"]


@pytest.mark.parametrize("gate", GATES, ids=[gate.name for gate in GATES])
def test_a_manual_run_of_another_branch_reads_main_s_history_and_records_nothing(tmp_path: Path, gate: Gate) -> None:
    cache = FakeCache()
    _run(gate, Event.push_to_main(31), cache, tmp_path)
    manual = Event("workflow_dispatch", "refs/heads/feature", 32)
    job = _run(gate, manual, cache, tmp_path)
    (call,) = pytest_calls(tmp_path, manual, gate.job, gate.matrix)
    assert "--opt-history" not in _history_args(call) and len(call["compare_files"]) == 1
    assert not job.step("Save main's run history").ran and len(cache.history()) == 1


@pytest.mark.parametrize("gate", GATES, ids=[gate.name for gate in GATES])
def test_the_gate_does_not_run_for_a_pull_request_from_a_fork(tmp_path: Path, gate: Gate) -> None:
    fork = Event.pull_request(41, head_repository="someone/project")
    assert run_job(gate.load(), gate.job, fork, FakeCache(), tmp_path, matrix=gate.matrix,
                   variables=gate.variables, prepare=_prepare(gate)) is None
    assert run_job(gate.load(), gate.job, Event.pull_request(42), FakeCache(), tmp_path, matrix=gate.matrix,
                   variables=gate.variables, prepare=_prepare(gate)) is not None


def test_the_two_variants_keep_separate_histories(tmp_path: Path) -> None:
    """A repository that switches variants never reads the other's history (one folder per shard there)."""
    single, shard = GATES[0], GATES[1]
    cache = FakeCache()
    _run(shard, Event.push_to_main(51), cache, tmp_path)
    _run(single, Event.pull_request(52), cache, tmp_path)
    (call,) = pytest_calls(tmp_path, Event.pull_request(52), single.job)
    assert call["compare_files"] == []


def test_the_recipe_red_team_hit_never_reaches_a_pull_request(tmp_path: Path) -> None:
    """The runner above keeps GitHub's cache rules: the old recipe, keyed by the branch's name, restores nothing
    on a pull request (``7/merge``), and every test was "new" there."""
    old = _load_yaml("""
jobs:
  gate:
    runs-on: [self-hosted, gpu]
    steps:
      - uses: actions/cache/restore@v5
        with:
          path: .opt-history
          key: opt-history-${{ github.ref_name }}-${{ github.run_id }}
          restore-keys: opt-history-${{ github.ref_name }}-
      - run: pytest --opt-history=.opt-history --opt-compare=.opt-history
      - if: always()
        uses: actions/cache/save@v5
        with:
          path: .opt-history
          key: opt-history-${{ github.ref_name }}-${{ github.run_id }}
""")
    cache = FakeCache()
    run_job(old, "gate", Event.push_to_main(61), cache, tmp_path)
    pull = run_job(old, "gate", Event.pull_request(62), cache, tmp_path)
    assert pull is not None
    (call,) = pytest_calls(tmp_path, Event.pull_request(62), "gate")
    assert call["compare_files"] is None  # main's history never reached the pull request
    assert {entry.scope for entry in cache.history()} == {MAIN, "refs/pull/7/merge"}  # and the PR saved its own


def _documented_history_recipe() -> dict[str, Any]:
    """The YAML block under "## The history" in docs/ci/caches.md, as the steps of one job."""
    text = CACHES_MD.read_text(encoding="utf-8")
    section = text[text.index("## The history"):]
    block = re.search(r"```yaml\n(.*?)```", section, re.DOTALL)
    assert block is not None, "docs/ci/caches.md: no YAML block under ## The history"
    steps = yaml.safe_load(block.group(1))
    return {"jobs": {"gate": {"runs-on": "ubuntu-latest", "steps": steps}}}


def test_the_documented_history_recipe_records_on_main_and_reaches_a_pull_request(tmp_path: Path) -> None:
    recipe = _documented_history_recipe()
    cache = FakeCache()
    main_run = run_job(recipe, "gate", Event.push_to_main(71), cache, tmp_path)
    assert main_run is not None and not main_run.failed, [(s.name, s.stdout, s.stderr) for s in main_run.steps]
    (saved,) = cache.history(MAIN)
    assert _recorded_runs(saved) == ["push-71"]
    pull = run_job(recipe, "gate", Event.pull_request(72), cache, tmp_path)
    assert pull is not None and not pull.failed
    (call,) = pytest_calls(tmp_path, Event.pull_request(72), "gate")
    assert call["compare_files"] == list(saved.files) and "--opt-history" not in _history_args(call)
    assert cache.history() == [saved]


# --------------------------------------------------------------------------- the stand-in against the plugin

SLEEPY_TEST = '''
import pytest

@pytest.mark.optimization("sleepy")
def test_sleepy(opt_bench):
    opt_bench(prompts=["The cat sees"], max_new_tokens=3)
'''
GATE_ARGS = ("--opt-compare-fail=latency:10%", "--opt-compare-confirm=1")


def test_the_plugin_keeps_the_folder_contract_the_stand_in_plays(run_user: Any, pytester: pytest.Pytester) -> None:
    """What the runs above rely on: an --opt-compare folder that is missing (and not the run's history) is a
    usage error, one that exists and is empty is a history not begun (the run passes, nothing is written in
    it); --opt-history records one run named as history names it; a run that only compares never writes."""
    from slowdown import sleepy_conftest  # tests/ is on sys.path

    conftest = sleepy_conftest("import os\n", "0.02")
    folder = pytester.path / HISTORY
    missing = pytester.runpytest("-p", "no:cacheprovider", f"--opt-compare={folder}", *GATE_ARGS)
    assert missing.ret == pytest.ExitCode.USAGE_ERROR
    assert "--opt-compare" in missing.stderr.str() and not folder.exists()

    folder.mkdir()
    pull = run_user(SLEEPY_TEST, "-q", f"--opt-compare={folder}", *GATE_ARGS, conftest=conftest)
    assert pull.result.ret == pytest.ExitCode.OK, pull.result.stdout.str()
    assert list(folder.iterdir()) == []

    main_run = run_user(SLEEPY_TEST, "-q", f"--opt-history={folder}", f"--opt-compare={folder}", *GATE_ARGS)
    assert main_run.result.ret == pytest.ExitCode.OK, main_run.result.stdout.str()
    (recorded,) = folder.iterdir()
    assert NAME_PATTERN.fullmatch(recorded.name)
    assert [row["nodeid"].rsplit("::", 1)[1] for row in json.loads(recorded.read_text())["tests"]] == ["test_sleepy"]

    again = run_user(SLEEPY_TEST, "-q", f"--opt-compare={folder}", *GATE_ARGS)
    assert again.result.ret == pytest.ExitCode.OK, again.result.stdout.str()
    assert list(folder.iterdir()) == [recorded]  # read, not written
