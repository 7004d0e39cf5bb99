"""experts(implementation=...): the MoE experts forward (issue 22, item 4), end to end on the built-in MoE models.

One session: batched_mm and grouped_mm pass with their proof against the eager-experts baseline; a reset after
load and a torch without its grouped GEMM (transformers then loops over the experts itself) are silent
fallbacks that fail; a wrong argument is that test's error; a dense model skips naming what it found.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Callable

import pytest
import torch

from pytest_transformers_opt import techniques
from pytest_transformers_opt.engine.hardware import HardwareInfo
from pytest_transformers_opt.engine.tiny_models import tiny_model_config
from pytest_transformers_opt.errors import OptConfigError, OptTechniqueConflict
from pytest_transformers_opt.techniques import (ProbeContext, RunEvidence, TechniqueRegistry, build_registry,
                                                check_stack)
from pytest_transformers_opt.techniques.moe import Experts
from pytest_transformers_opt.verdict.budgets import default_similarity

USER_TESTS = '''
import pytest
from pytest_transformers_opt import techniques

PROMPTS = ["The cat sees", "Name the capital of France."]

@pytest.mark.opt_model("tiny-random-qwen3-moe")
@pytest.mark.optimization(techniques.experts(implementation="batched_mm"))
def test_batched_mm(opt_bench, opt_model, opt_baseline_model):
    opt_bench(prompts=PROMPTS, max_new_tokens=6)
    assert opt_model.model.get_experts_implementation() == {"": "batched_mm"}
    assert opt_baseline_model.model.get_experts_implementation() == {"": "eager"}

@pytest.mark.opt_model("tiny-random-qwen3-moe")
@pytest.mark.optimization(techniques.experts(implementation="batched_mm"))
def test_reset_after_load(opt_bench):
    opt_bench(prompts=PROMPTS, max_new_tokens=6)

@pytest.mark.opt_model("tiny-random-gpt-oss")
@pytest.mark.optimization(techniques.experts(implementation="grouped_mm"))
def test_grouped_mm(opt_bench):
    opt_bench(prompts=PROMPTS, max_new_tokens=6)

@pytest.mark.opt_model("tiny-random-gpt-oss")
@pytest.mark.optimization(techniques.experts(implementation="grouped_mm"))
def test_grouped_mm_without_torch_kernel(opt_bench):
    opt_bench(prompts=PROMPTS, max_new_tokens=6)

@pytest.mark.opt_model("tiny-random-qwen3-moe")
@pytest.mark.optimization(techniques.experts(implementation="fast"))
def test_wrong_implementation(opt_bench):
    opt_bench(prompts=PROMPTS, max_new_tokens=6)

@pytest.mark.optimization(techniques.experts(implementation="batched_mm"))
def test_dense_model(opt_bench):
    opt_bench(prompts=PROMPTS, max_new_tokens=6)
'''

# What a user's conftest could do by accident: put the experts implementation back after load, or run on a
# torch without the grouped GEMM (an older one), where transformers' grouped_mm silently loops over the experts.
CONFTEST = '''
import pytest
import torch

@pytest.fixture(autouse=True)
def _user_setup(request, monkeypatch):
    if request.node.name == "test_reset_after_load":
        request.getfixturevalue("opt_model").model.set_experts_implementation("eager")
    if request.node.name == "test_grouped_mm_without_torch_kernel":
        monkeypatch.delattr(torch.nn.functional, "grouped_mm", raising=False)
        monkeypatch.delattr(torch, "_grouped_mm", raising=False)
'''


def test_experts_implementations_pass_with_their_proof_and_fallbacks_fail(run_user):
    run = run_user(USER_TESTS, "--opt-rounds=1", "--opt-warmup=0", "-rs", conftest=CONFTEST)
    run.result.assert_outcomes(passed=2, failed=2, errors=1, skipped=1)
    lossless = default_similarity("lossless", "float32")
    for name, label in (("test_batched_mm", "experts(implementation='batched_mm')"),
                        ("test_grouped_mm", "experts(implementation='grouped_mm')")):
        entry = run.test(name)
        assert entry["outcome"] == "passed", (name, entry["error"])
        assert entry["techniques"] == [label]
        assert entry["similarity"]["token_match"] == 1.0, name  # float32: the same sums, the same tokens
        assert entry["similarity"]["kl_mean"] < 1e-6, name
        assert {b["name"]: b["limit"] for b in entry["budgets"]} == lossless, name
    run.result.stdout.fnmatch_lines([
        "*silent fallback: experts(implementation='batched_mm') was requested but its experts forward never ran "
        "during generation; found: eager x*",
        "*silent fallback: experts(implementation='grouped_mm'): transformers' grouped_mm experts forward ran (* "
        "calls) but torch's grouped GEMM never did: it fell back to its own loop over the experts (as transformers "
        "does when torch has no grouped GEMM*",
    ])
    assert run.test("test_reset_after_load")["outcome"] == "failed"
    wrong = run.test("test_wrong_implementation")
    assert wrong["outcome"] == "error"
    assert ("implementation='fast' is not an experts implementation; accepted: 'eager', 'batched_mm', 'grouped_mm'"
            in wrong["error"])
    dense = run.test("test_dense_model")
    assert dense["outcome"] == "skipped"
    assert dense["skip_reason"] == ("experts(implementation='batched_mm') needs a mixture-of-experts model; found: "
                                    "llama (LlamaForCausalLM) has no experts (its config sets none of "
                                    "num_local_experts, num_experts, n_routed_experts)")


@pytest.fixture(scope="module")
def registry() -> TechniqueRegistry:
    return build_registry()


@pytest.mark.parametrize("hardware,reason", [
    (HardwareInfo(versions={"torch": "2.8.0"}),
     "experts(implementation='grouped_mm') needs torch >= 2.9 on cpu (torch._grouped_mm has no CPU kernel before; "
     "transformers would loop over the experts instead); found: torch 2.8.0"),
    (HardwareInfo(device="cuda:0", device_type="cuda", name="Tesla T4", compute_capability=(7, 5),
                  versions={"torch": "2.10.0"}),
     "experts(implementation='grouped_mm') needs a CUDA GPU of compute capability >= 8.0; found: cuda:0 (Tesla T4, "
     "compute capability 7.5) with torch 2.10.0"),
    (HardwareInfo(device="cuda:0", device_type="cuda", name="NVIDIA A100", compute_capability=(8, 0),
                  versions={"torch": "2.8.0"}),
     "experts(implementation='grouped_mm') with torch 2.8 needs a Hopper GPU (compute capability 9.x); found: "
     "cuda:0 (NVIDIA A100, compute capability 8.0)"),
    (HardwareInfo(device="cuda:0", device_type="cuda", name="NVIDIA H100", compute_capability=(9, 0),
                  versions={"torch": "2.8.0"}), None),
    (HardwareInfo(versions={"torch": "2.13.0+cpu"}), None),
])
def test_grouped_mm_skip_reason_names_what_the_hardware_lacks(registry: TechniqueRegistry, hardware: HardwareInfo,
                                                              reason: str | None) -> None:
    """grouped_mm runs on this CPU (torch 2.13), so its skip reasons are checked through probe inputs."""
    moe = tiny_model_config("tiny-random-gpt-oss")
    grouped = registry.resolve(techniques.experts("grouped_mm"))
    assert grouped.probe(ProbeContext(hardware=hardware, model_config=moe)) == reason
    # the other implementations need nothing of the hardware
    for implementation in ("eager", "batched_mm"):
        other = registry.resolve(techniques.experts(implementation))
        assert other.probe(ProbeContext(hardware=hardware, model_config=moe)) is None


def test_implementation_is_required(registry: TechniqueRegistry) -> None:
    with pytest.raises(OptConfigError, match=r"technique experts: implementation= is required; accepted: 'eager', "
                                             r"'batched_mm', 'grouped_mm'"):
        registry.resolve("experts")


def _observed(monkeypatch: pytest.MonkeyPatch, device: str, dispatched: list[str]) -> tuple[str | None, list[str]]:
    """experts(implementation='grouped_mm')'s proof over a run whose MoE layers dispatched to ``dispatched`` (stand-in
    forwards; grouped_mm's calls torch's grouped GEMM as transformers' does), on a model on ``device``."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    def forward_of(name: str) -> Callable[..., str]:
        def forward(self: object, *args: object) -> str:
            if name == "grouped_mm":
                torch.nn.functional.grouped_mm(torch.ones(4, 8), torch.ones(2, 8, 4),
                                               offs=torch.tensor([2, 4], dtype=torch.int32))
            return name
        return forward

    for name in ("batched_mm", "grouped_mm"):
        monkeypatch.setitem(ALL_EXPERTS_FUNCTIONS._local_mapping, name, forward_of(name))
    technique = Experts(implementation="grouped_mm")
    evidence, model = RunEvidence(), SimpleNamespace(device=torch.device(device))
    with technique.observe(model, evidence):
        for name in dispatched:  # as each MoE layer asks transformers at each forward
            assert ALL_EXPERTS_FUNCTIONS.get_interface(name, forward_of("eager"))(None) == name
    return technique.verify_run(model, evidence), evidence.notes


def test_grouped_mm_on_a_gpu_decodes_with_batched_mm_and_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers' documented decode switch on a GPU (grouped_mm for prefill, batched_mm for each decoding step)
    is no fallback; on a CPU, where transformers never switches, a batched_mm call is one."""
    run = ["grouped_mm", "grouped_mm", "batched_mm", "batched_mm", "batched_mm", "batched_mm"]
    problem, notes = _observed(monkeypatch, "cuda", run)
    assert problem is None
    assert notes == ["experts: grouped_mm ran 2 times (prefill) and batched_mm 4 times: transformers decodes with "
                     "batched_mm on cuda"]
    problem, notes = _observed(monkeypatch, "cpu", run)
    assert problem == ("experts(implementation='grouped_mm') was requested but other experts forwards ran too; "
                       "found: batched_mm x4, grouped_mm x2")
    problem, _ = _observed(monkeypatch, "cuda", ["batched_mm", "eager"])
    assert problem == ("experts(implementation='grouped_mm') was requested but its experts forward never ran during "
                       "generation; found: batched_mm x1, eager x1")
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    assert "get_interface" not in vars(ALL_EXPERTS_FUNCTIONS)  # the counting dispatch is gone after the run


def test_experts_and_tensor_parallel_conflict(registry: TechniqueRegistry) -> None:
    stack = [registry.resolve(techniques.experts("batched_mm")), registry.resolve(techniques.tensor_parallel(2))]
    with pytest.raises(OptTechniqueConflict, match=r"experts\(implementation='batched_mm'\) and tensor_parallel\("
                                                   r"tp_size=2\) conflict: the torchrun workers load the model"):
        check_stack(stack)
