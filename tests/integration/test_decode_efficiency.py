"""Decode efficiency (an estimate), NVML clocks and bandwidth: unit tests with faked NVML, and a real run."""

from __future__ import annotations

import types

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, MistralConfig

from pytest_transformers_opt.verdict.decode_efficiency import decode_estimates, kv_bytes_read_per_step, weight_bytes_read_per_step
from pytest_transformers_opt.engine.hardware import nvml_facts, nvml_handle, peak_memory_bandwidth
from pytest_transformers_opt.verdict.results import Workload

LLAMA = dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2)


def _nbytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def test_weights_read_per_step_leave_out_an_untied_input_embedding():
    model = LlamaForCausalLM(LlamaConfig(**LLAMA, tie_word_embeddings=False))
    assert weight_bytes_read_per_step(model) == _nbytes(model) - 1000 * 64 * 4
    tied = GPT2LMHeadModel(GPT2Config(vocab_size=1000, n_embd=64, n_layer=2, n_head=4, n_positions=64))
    assert tied.get_output_embeddings().weight is tied.get_input_embeddings().weight
    assert weight_bytes_read_per_step(tied) == _nbytes(tied)  # the shared matrix is the head: read in full
    assert weight_bytes_read_per_step(model.to(torch.bfloat16)) == (_nbytes(model) - 1000 * 64 * 2)


def test_kv_bytes_count_keys_and_values_of_every_layer_capped_by_a_sliding_window():
    config = LlamaConfig(**LLAMA)  # head_dim 64 / 4 = 16, 2 KV heads, 2 layers
    assert kv_bytes_read_per_step(config, batch_size=3, context_tokens=10, element_bytes=2) == 2 * 2 * 2 * 16 * 2 * 10 * 3
    windowed = MistralConfig(**LLAMA, sliding_window=8)
    assert (kv_bytes_read_per_step(windowed, batch_size=1, context_tokens=100, element_bytes=4)
            == kv_bytes_read_per_step(windowed, batch_size=1, context_tokens=8, element_bytes=4))
    gpt2 = GPT2Config(n_embd=64, n_layer=3, n_head=4)  # no KV heads field: one per attention head
    assert kv_bytes_read_per_step(gpt2, batch_size=1, context_tokens=1, element_bytes=4) == 2 * 3 * 4 * 16 * 4


def test_decode_estimates_divide_the_bytes_by_tpot_and_by_the_peak_only_when_known():
    model = LlamaForCausalLM(LlamaConfig(**LLAMA))
    workload = Workload(prompts=["a", "b"], max_new_tokens=9, batch_size=2, rounds=1, warmup=0, input_tokens=6)
    step = weight_bytes_read_per_step(model) + kv_bytes_read_per_step(model.config, batch_size=2, context_tokens=10,
                                                                     element_bytes=4)
    cpu = decode_estimates(model, workload, tpot_s=0.002, peak_bandwidth_bytes_s=None)
    assert cpu == {"decode_bytes_per_step": step, "decode_bandwidth_bytes_s": pytest.approx(step / 0.002)}
    gpu = decode_estimates(model, workload, tpot_s=0.002, peak_bandwidth_bytes_s=4e9)
    assert gpu["decode_bandwidth_fraction_of_peak"] == pytest.approx(step / 0.002 / 4e9)
    quantized = decode_estimates(model, workload, tpot_s=0.002, peak_bandwidth_bytes_s=None, kv_bits=4)
    kv_fp32 = step - weight_bytes_read_per_step(model)
    assert quantized["decode_bytes_per_step"] == pytest.approx(step - kv_fp32 + kv_fp32 / 8)
    assert decode_estimates(model, workload, tpot_s=None, peak_bandwidth_bytes_s=4e9) == {}


def test_peak_bandwidth_from_nvml_figures_matches_published_h100_and_h200_figures():
    assert peak_memory_bandwidth(5120, 2619) == pytest.approx(3.35e12, rel=0.01)  # H100 SXM: 3.35 TB/s
    assert peak_memory_bandwidth(6144, 3201) == pytest.approx(4.8e12, rel=0.03)  # H200: 4.8 TB/s


class FakeNvml:
    NVML_CLOCK_SM, NVML_CLOCK_MEM = 0, 2

    def __init__(self, *, fail_init: bool = False, bus_width: int | None = 6144) -> None:
        self.fail_init, self.bus_width, self.shut = fail_init, bus_width, False
        self.handles: list[tuple[str, object]] = []

    def nvmlInit(self) -> None:
        if self.fail_init:
            raise RuntimeError("NVML Shared Library Not Found")

    def nvmlShutdown(self) -> None:
        self.shut = True

    def nvmlSystemGetDriverVersion(self) -> bytes:
        return b"570.86.15"

    def nvmlDeviceGetHandleByIndex(self, index: int) -> str:
        self.handles.append(("index", index))
        return f"handle{index}"

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> str:
        self.handles.append(("uuid", uuid))
        return uuid

    def nvmlDeviceGetClockInfo(self, handle: str, clock: int) -> int:
        return {0: 1755, 2: 3201}[clock]

    def nvmlDeviceGetMaxClockInfo(self, handle: str, clock: int) -> int:
        return {0: 1980, 2: 3201}[clock]

    def nvmlDeviceGetMemoryBusWidth(self, handle: str) -> int:
        if self.bus_width is None:
            raise AttributeError("nvmlDeviceGetMemoryBusWidth needs a newer driver")
        return self.bus_width


def test_nvml_facts_record_driver_clocks_and_peak_bandwidth():
    nvml = FakeNvml()
    facts = nvml_facts(0, nvml)
    assert facts == {"driver_version": "570.86.15",
                     "clocks_mhz": {"sm": 1755, "sm_max": 1980, "memory": 3201, "memory_max": 3201},
                     "memory_bandwidth_bytes_s": peak_memory_bandwidth(6144, 3201)}
    assert nvml.shut
    old_driver = nvml_facts(0, FakeNvml(bus_width=None))
    assert "memory_bandwidth_bytes_s" not in old_driver and old_driver["clocks_mhz"]["sm"] == 1755
    assert nvml_facts(0, FakeNvml(fail_init=True)) == {}


def test_nvml_finds_a_pinned_gpu_by_uuid_not_by_cuda_index(monkeypatch):
    """Under --opt-gpus-per-worker, CUDA index 0 of worker gw1 is NVML index 1 (or any other)."""
    props = types.SimpleNamespace(uuid="5b1c4a2e-0000-1111-2222-333344445555")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: props)
    nvml = FakeNvml()
    assert nvml_handle(nvml, 0) == "GPU-5b1c4a2e-0000-1111-2222-333344445555"
    monkeypatch.undo()
    nvml = FakeNvml()  # no CUDA here: torch cannot say the UUID, so NVML's index is the fallback
    assert nvml_handle(nvml, 1) == "handle1" and nvml.handles == [("index", 1)]


FAKE_PEAK = '''
import pytest
from pytest_transformers_opt.session import SESSION_KEY

@pytest.hookimpl(trylast=True)
def pytest_configure(config):
    # the peak bandwidth a GPU's NVML would report; this CPU has none
    config.stash[SESSION_KEY].hardware.memory_bandwidth_bytes_s = 50e9
'''


def test_a_run_reports_decode_bandwidth_as_an_estimate(run_user):
    source = '''
import pytest

@pytest.mark.optimization("sdpa")
def test_sdpa(opt_bench):
    opt_bench(max_new_tokens=5)
'''
    run = run_user(source, "--opt-report")
    run.result.assert_outcomes(passed=1)
    entry = run.test("test_sdpa")
    estimates = entry["estimates"]
    assert estimates["decode_bandwidth_bytes_s"] == pytest.approx(estimates["decode_bytes_per_step"]
                                                                  / entry["optimized"]["tpot_s"])
    assert "decode_bandwidth_fraction_of_peak" not in estimates  # no peak known on CPU
    assert "decode_bandwidth_bytes_s" not in entry["optimized"]  # never beside the measured figures
    assert "decode efficiency" not in run.result.stdout.str()

    markdown = run.report_path.with_name("report.md")
    run_user(source, f"--opt-report-md={markdown}")
    assert "| `test_user.py::test_sdpa` | decode bandwidth (those bytes / TPOT) | " in markdown.read_text()

    with_peak = run_user(source, "--opt-report", conftest=FAKE_PEAK)
    entry = with_peak.test("test_sdpa")
    assert entry["estimates"]["decode_bandwidth_fraction_of_peak"] == pytest.approx(
        entry["estimates"]["decode_bandwidth_bytes_s"] / 50e9)
    with_peak.result.stdout.fnmatch_lines(["*decode efficiency (estimate: *46.57 GiB/s peak*",
                                           "  test_sdpa: * per step, * = *% of peak"])
