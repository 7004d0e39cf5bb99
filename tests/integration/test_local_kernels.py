"""``techniques.kernels(local=..., layers=...)``: a kernel build from a folder, on CPU, with no network.

Each test writes a small pure-PyTorch kernel repository (``build/torch-cpu/metadata.json`` plus the package
``get_local_kernel`` imports, whose ``layers`` module holds the layer class) and runs a user's test file on
the built-in ``tiny-random-llama``.

The tests that load a kernel need the ``kernels`` package, in the version window of the installed
transformers: transformers 5.25+ installs kernels 0.19 (whose modules live under ``kernels._internals``), so
they run in the main environment, and again in the second one (transformers 5.20-5.22 with kernels 0.17.2,
``scripts/kernels_env.sh``), the older API; they skip, for that reason only, where ``kernels`` is not
installed. The config errors and the version-window skip need no kernels and run everywhere.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from pytest_transformers_opt import techniques
from pytest_transformers_opt.errors import OptConfigError
from pytest_transformers_opt.engine.hardware import HardwareInfo
from pytest_transformers_opt.techniques import ProbeContext, RunEvidence, build_registry, layer_kernels

# An RMSNorm written another way than LlamaRMSNorm (torch's fused rms_norm); a module-level counter shows it ran.
RMS_NORM = """
    import torch
    from torch import nn

    CALLS = [0]


    class RMSNorm(nn.Module):
        def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
            CALLS[0] += 1
            dtype = hidden_states.dtype
            out = torch.nn.functional.rms_norm(hidden_states.float(), (hidden_states.shape[-1],),
                                               self.weight.float(), self.variance_epsilon)
            return out.to(dtype)
"""

RAISES = """
    import torch
    from torch import nn


    class RMSNorm(nn.Module):
        def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("local kernel exploded")
"""

GARBAGE = """
    import torch
    from torch import nn


    class RMSNorm(nn.Module):
        def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
            return hidden_states * 3.0  # forgets to normalize
"""


def write_kernel(root: Path, layers_source: str = RMS_NORM, variant: str = "torch-cpu") -> str:
    """A local kernel repository at ``root``; returns the module name the kernel is imported as."""
    name = "local-rms-norm"
    kernel_id = f"_local_rms_norm_{abs(hash(str(root))):x}"  # unique: kernels imports each build under its id
    package = root / "build" / variant / name.replace("-", "_")
    package.mkdir(parents=True)
    (package.parent / "metadata.json").write_text(json.dumps({
        "id": kernel_id, "name": name, "version": 1, "license": "Apache-2.0", "python-depends": [],
        "backend": {"type": "cpu" if "cpu" in variant else "cuda"},
    }))
    (package / "__init__.py").write_text("from . import layers\n\n__all__ = ['layers']\n")
    (package / "layers.py").write_text(textwrap.dedent(layers_source))
    return kernel_id


def user_test(root: Path, body: str = "    opt_bench()\n", layers: str = "{'RMSNorm': 'RMSNorm'}",
              budgets: str = "", fixtures: str = "opt_bench") -> str:
    return (
        "import sys\nimport pytest\nfrom pytest_transformers_opt import techniques\n\n"
        f"@pytest.mark.optimization(techniques.kernels(local={str(root)!r}, layers={layers}){budgets})\n"
        f"def test_local_kernel({fixtures}):\n{body}"
    )


@pytest.fixture
def kernels_package() -> object:
    """The kernels package, imported here so that it outlives the inner pytest runs (see conftest)."""
    return pytest.importorskip("kernels", reason="kernels is not installed; the local-kernel tests that load a kernel "
                                                 "run in the kernels environment (scripts/kernels_env.sh)")


# -- the local kernel runs, matches the baseline, and the proof sees it -----------------------------
def test_local_cpu_kernel_passes_and_is_proven(run_user, tmp_path: Path, kernels_package: object) -> None:
    kernel_id = write_kernel(tmp_path / "rms-norm")
    body = (
        "    result = opt_bench()\n"
        f"    calls = sys.modules[{kernel_id + '.layers'!r}].CALLS[0]\n"
        "    norm = opt_model.model.model.norm\n"
        "    assert norm.forward.__func__.__module__.endswith('.layers'), norm.forward\n"
        "    assert calls > 0\n"
        "    print('KERNEL-CALLS', calls, 'KL', result.similarity.kl_mean)\n"
    )
    run = run_user(user_test(tmp_path / "rms-norm", body, budgets=", max_kl=1e-5", fixtures="opt_bench, opt_model"),
                   "-s", "--opt-report")
    run.result.assert_outcomes(passed=1)
    entry = run.test("test_local_kernel")
    assert entry["outcome"] == "passed"
    assert entry["techniques"] == [f"kernels(layers={{'RMSNorm': 'RMSNorm'}}, local={str(tmp_path / 'rms-norm')!r})"]
    assert entry["similarity"]["kl_mean"] <= 1e-5 and entry["similarity"]["token_match"] == 1.0
    assert {b["name"]: b["ok"] for b in entry["budgets"]} == {"min_token_match": True, "max_kl": True}
    run.result.stdout.fnmatch_lines(["*KERNEL-CALLS *", "*optimization report*", "*test_local_kernel*kernels(*passed*"])


# -- broken is not unsupported: a kernel that fails or lies fails the test --------------------------
def test_kernel_that_raises_fails_the_test(run_user, tmp_path: Path, kernels_package: object) -> None:
    write_kernel(tmp_path / "k", RAISES)
    run = run_user(user_test(tmp_path / "k"))
    # the kernel is swapped in at load, so it first runs in the load's forward pass: a load error
    run.result.assert_outcomes(errors=1)
    run.result.stdout.fnmatch_lines(["*loading tiny-random-llama with [[]eager, kernels(*)] on cpu failed: "
                                     "RuntimeError: local kernel exploded*"])
    assert run.test("test_local_kernel")["outcome"] == "error"


def test_kernel_that_returns_garbage_fails_its_budgets(run_user, tmp_path: Path, kernels_package: object) -> None:
    write_kernel(tmp_path / "k", GARBAGE)
    run = run_user(user_test(tmp_path / "k"))
    run.result.assert_outcomes(failed=1)
    assert "max_kl" in run.test("test_local_kernel")["failed_budgets"]


def test_silent_fallback_after_load_fails(run_user, tmp_path: Path, kernels_package: object) -> None:
    write_kernel(tmp_path / "k")
    body = (
        "    from types import MethodType\n"
        "    for module in opt_model.model.modules():  # something puts the original forward back\n"
        "        if type(module).__name__ == 'LlamaRMSNorm':\n"
        "            module.forward = MethodType(type(module).forward, module)\n"
        "    opt_bench()\n"
    )
    run = run_user(user_test(tmp_path / "k", body, fixtures="opt_bench, opt_model"))
    run.result.assert_outcomes(failed=1)
    run.result.stdout.fnmatch_lines(["*silent fallback: kernels(local=*do not run the kernel's forward: "
                                     "RMSNorm (5 of 5 layers run LlamaRMSNorm.forward)"])


# -- what the user got wrong is a config error; what this machine lacks is a skip -----------------
def test_missing_folder_is_an_error_naming_the_option(run_user, tmp_path: Path) -> None:
    run = run_user(user_test(tmp_path / "nowhere"))
    run.result.assert_outcomes(errors=1)
    run.result.stdout.fnmatch_lines([f"*technique kernels: local={str(tmp_path / 'nowhere')!r} does not exist*"])


def test_folder_without_a_build_is_an_error(run_user, tmp_path: Path) -> None:
    (tmp_path / "k" / "build" / "torch-cpu").mkdir(parents=True)  # no metadata.json
    run = run_user(user_test(tmp_path / "k"))
    run.result.assert_outcomes(errors=1)
    run.result.stdout.fnmatch_lines(["*holds no kernel build: expected build/<variant>/metadata.json*found: build/ "
                                     "holds torch-cpu without a metadata.json*"])


def test_folder_without_a_cpu_build_skips_naming_what_was_found(run_user, tmp_path: Path,
                                                                 kernels_package: object) -> None:
    write_kernel(tmp_path / "k", variant="torch-cuda")
    run = run_user(user_test(tmp_path / "k"), "-rs", "--opt-device=cpu")
    run.result.assert_outcomes(skipped=1)
    reason = run.test("test_local_kernel")["skip_reason"]
    assert reason.startswith(f"kernels(local={str(tmp_path / 'k')!r}) needs a torch-cpu (or torch-universal) build "
                             f"of the local kernel; found: torch-cuda"), reason
    assert run.test("test_local_kernel")["optimized"] is None  # probed before any load


def test_layer_missing_from_the_kernel_is_an_error(run_user, tmp_path: Path, kernels_package: object) -> None:
    write_kernel(tmp_path / "k")
    run = run_user(user_test(tmp_path / "k", layers="{'RMSNorm': 'FastRMSNorm'}"))
    run.result.assert_outcomes(errors=1)
    run.result.stdout.fnmatch_lines(["*has no layer 'FastRMSNorm' in its `layers` module; found: RMSNorm*"])


def test_layer_the_model_does_not_register_is_an_error(run_user, tmp_path: Path, kernels_package: object) -> None:
    write_kernel(tmp_path / "k")
    run = run_user(user_test(tmp_path / "k", layers="{'LayerNorm': 'RMSNorm'}"))
    run.result.assert_outcomes(errors=1)
    run.result.stdout.fnmatch_lines(["*layers names 'LayerNorm', which no layer of LlamaForCausalLM registers; "
                                     "registered: *RMSNorm*"])


def test_version_window_skip(run_user, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Outside the window transformers demands, a local kernel skips too, naming the window and what was found.

    Where the environment is outside it (transformers 5.24 with no kernels) this is the real thing; where
    kernels is in the window (transformers 5.25+, or the kernels environment) the window is narrowed so that the
    installed kernels falls outside it.
    """
    write_kernel(tmp_path / "k")
    real = layer_kernels.kernels_problem()
    if real is None:
        monkeypatch.setattr(layer_kernels, "kernels_window", lambda: ">=0.18.2,<0.19")
    run = run_user(user_test(tmp_path / "k"), "-rs")
    run.result.assert_outcomes(skipped=1)
    reason = run.test("test_local_kernel")["skip_reason"]
    window = layer_kernels.kernels_window()
    assert reason.startswith(f"kernels(local={str(tmp_path / 'k')!r}) needs "), reason
    assert window in reason and "transformers " in reason, reason
    assert reason.endswith("found: not installed") or "found: kernels " in reason, reason


# -- parameters --------------------------------------------------------------------------------------
def test_parameters_are_checked_at_setup(tmp_path: Path) -> None:
    registry = build_registry()
    write_kernel(tmp_path / "k")
    spec = techniques.kernels(local=tmp_path / "k", layers="RMSNorm")  # a Path and a single name are accepted
    technique = registry.resolve(spec)
    assert dict(spec.params)["local"] == str(tmp_path / "k")
    assert technique.label() == f"kernels(layers='RMSNorm', local={str(tmp_path / 'k')!r})"
    assert registry.resolve(techniques.kernels()).label() == "kernels"  # the hub form is unchanged
    with pytest.raises(OptConfigError, match=r"local= needs layers="):
        registry.resolve(techniques.kernels(local=tmp_path / "k"))
    with pytest.raises(OptConfigError, match=r"layers= names layers of a local kernel; give local= too"):
        registry.resolve(techniques.kernels(layers={"RMSNorm": "RMSNorm"}))
    with pytest.raises(OptConfigError, match=r"layers=\{'RMSNorm': 3\} is not accepted"):
        registry.resolve(techniques.kernels(local=tmp_path / "k", layers={"RMSNorm": 3}))


# -- the probe and the proof, directly ------------------------------------------------------------
def _local(root: Path) -> layer_kernels.Kernels:
    technique = build_registry().resolve(techniques.kernels(local=root, layers={"RMSNorm": "RMSNorm"}))
    assert isinstance(technique, layer_kernels.Kernels)
    return technique


def test_probe_drops_the_cuda_requirement_for_a_cpu_build(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          kernels_package: object) -> None:
    write_kernel(tmp_path / "k")
    ctx = ProbeContext(hardware=HardwareInfo(), model_config=None)
    technique = _local(tmp_path / "k")
    assert technique.probe(ctx) is None
    assert "needs a CUDA GPU" in layer_kernels.Kernels().probe(ctx)  # the hub form still needs one
    monkeypatch.setenv("USE_HUB_KERNELS", "0")  # transformers then marks no layer for kernels
    assert technique.probe(ctx) == (f"kernels(local={str(tmp_path / 'k')!r}) needs transformers' kernel layers "
                                    f"enabled (USE_HUB_KERNELS unset or 1); found: USE_HUB_KERNELS=0")


def test_proof_needs_the_kernel_to_run(tmp_path: Path, kernels_package: object) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from pytest_transformers_opt.engine import tiny_models

    write_kernel(tmp_path / "k")
    model = AutoModelForCausalLM.from_pretrained(tiny_models.ensure_tiny_model("tiny-random-llama")).eval()
    technique = _local(tmp_path / "k")
    assert technique.verify_run(model, RunEvidence()) is not None  # not kernelized: no proof
    assert technique.verify_loaded(model) == f"kernels(local={str(tmp_path / 'k')!r}): the loaded model was not kernelized"
    technique.after_load(model)
    assert technique.verify_loaded(model) is None
    idle = RunEvidence()
    with technique.observe(model, idle):
        pass  # nothing ran
    assert technique.verify_run(model, idle) == (
        f"kernels(local={str(tmp_path / 'k')!r}): the kernel's layers (RMSNorm) never ran during generation")
    ran = RunEvidence()
    with technique.observe(model, ran):
        model(input_ids=torch.ones((1, 3), dtype=torch.long))
    assert ran.kernel_forward_calls > 0
    assert technique.verify_run(model, ran) is None
    assert type(model.model.norm).forward is not model.model.norm.forward.__func__  # restored to the kernel's


def test_missing_python_dependency_skips(tmp_path: Path, kernels_package: object) -> None:
    write_kernel(tmp_path / "k")
    metadata = tmp_path / "k" / "build" / "torch-cpu" / "metadata.json"
    metadata.write_text(json.dumps({**json.loads(metadata.read_text()), "python-depends": ["no-such-dependency"]}))
    reason = _local(tmp_path / "k").probe(ProbeContext(hardware=HardwareInfo(), model_config=None))
    assert reason is not None and "needs the kernel's Python dependencies; found: " in reason, reason
    assert "no-such-dependency" in reason, reason
