"""Write layout-NN-COMMIT.json: one report per layout of report_schema.json in the git history (schema_version 1).

Each fixture is a report written by today's plugin (``python make_layouts.py CURRENT.json``, a run of one
measured test under sequential rounds and one skipped test), cut down to what the schema of that commit
allowed and renamed as it named it, then checked against that commit's schema: what a run of that commit
wrote, as far as its readers could tell. Run from the repository root; needs git and jsonschema.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import jsonschema

SCHEMA_PATHS = ("pytest_transformers_opt/report/report_schema.json", "pytest_transformers_opt/report_schema.json")
HERE = Path(__file__).parent


def schema_commits() -> list[str]:
    out = subprocess.run(["git", "log", "--follow", "--format=%h", "--", SCHEMA_PATHS[0]], check=True,
                         capture_output=True, text=True).stdout.split()
    return out[::-1]  # oldest first


def schema_at(commit: str) -> dict | None:
    for path in SCHEMA_PATHS:
        shown = subprocess.run(["git", "show", f"{commit}:{path}"], capture_output=True, text=True)
        if shown.returncode == 0:
            return json.loads(shown.stdout)
    return None


def earlier_names(report: dict, schema: dict) -> None:
    """Fields that an earlier layout named otherwise: rounds_decision's one error_rate (65ae13e)."""
    text = json.dumps(schema)
    if '"error_rate"' in text:
        for test in report["tests"]:
            decision = test.get("rounds_decision")
            if isinstance(decision, dict):
                decision["error_rate"] = decision.pop("false_alarm_rate")
                decision.pop("miss_rate")


def cut(report: dict, schema: dict) -> dict:
    report = copy.deepcopy(report)
    earlier_names(report, schema)
    validator = jsonschema.Draft202012Validator(schema)
    for _ in range(5):
        errors = list(validator.iter_errors(report))
        if not errors:
            return report
        for error in errors:
            if error.validator == "additionalProperties":
                container = report
                for part in error.absolute_path:
                    container = container[part]
                for key in [k for k in container if k not in error.schema.get("properties", {})]:
                    del container[key]
    problems = [f"{list(e.absolute_path)}: {e.message}" for e in validator.iter_errors(report)]
    raise SystemExit(f"cannot cut the report to this layout: {problems}")


def main(current: str) -> None:
    report = json.loads(Path(current).read_text())
    previous = None
    index = 0
    for commit in schema_commits():
        schema = schema_at(commit)
        if schema is None or schema == previous:
            continue
        previous = schema
        index += 1
        target = HERE / f"layout-{index:02d}-{commit}.json"
        if target.exists():  # kept as made: a fixture is what that layout's readers were shown
            continue
        layout = cut(report, schema)
        jsonschema.Draft202012Validator(schema).validate(layout)
        target.write_text(json.dumps(layout, indent=2) + "\n")
        print(target.name)


if __name__ == "__main__":
    main(sys.argv[1])
