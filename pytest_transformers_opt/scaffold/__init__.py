"""``pytest-opt init``: a starter test file, the plugin's settings and the GPU gate for a user's project.

``starter`` asks the advisor which changes to test (the test file), ``templates`` holds the settings block
and the workflow, ``writer`` plans the files, refuses when any target exists and writes all or none.
"""

from __future__ import annotations

from .starter import STARTER_TESTS, Pick, picks, starter_source
from .templates import STARTER_TEST, WORKFLOW, gpu_gate_workflow, pyproject_section, pytest_ini
from .writer import InitRefused, Planned, init_project, plan_project, write_planned

__all__ = [
    "STARTER_TEST", "STARTER_TESTS", "WORKFLOW", "InitRefused", "Pick", "Planned", "gpu_gate_workflow",
    "init_project", "picks", "plan_project", "pyproject_section", "pytest_ini", "starter_source", "write_planned",
]
