"""Stored baselines (pytest_transformers_opt.verdict.baselines): keys, files, top-k KL, errors, concurrency.

Fast and model-free: distributions are random tensors. torch is imported inside the tests so the
processes spawned by the concurrency tests start quickly.
"""

from __future__ import annotations

import json
import math
import multiprocessing
import os
import re
from pathlib import Path
from typing import Any

import pytest

from pytest_transformers_opt.verdict.baselines import (SCHEMA, SCHEMA_VERSION, BaselineStore, StoredBaseline, baseline_key,
                                               capture, hardware_fingerprint, measurements_usable,
                                               similarity_against_stored)
from pytest_transformers_opt.errors import OptConfigError
from pytest_transformers_opt.engine.hardware import HardwareInfo
from pytest_transformers_opt.verdict.results import SideMetrics, Workload
from pytest_transformers_opt.verdict.similarity import NEAR_TIE_LOGPROB_GAP, compare_runs

WORKLOAD = {"prompts": ["Explain gravity in one sentence.", "The cat sees"], "max_new_tokens": 6, "batch_size": 2}
KEY_ARGS: dict[str, Any] = dict(model="Qwen/Qwen3-0.6B", revision="c1899de", dtype="bfloat16",
                                baseline_techniques=["eager", "dynamic_cache"], workload=WORKLOAD)

GPU_ENV = HardwareInfo(device="cuda:0", device_type="cuda", name="NVIDIA H200", compute_capability=(9, 0),
                       cuda_version="12.4", cpu_count=16, tf32=False,
                       platform="Linux-5.15.0-1057-aws-x86_64-with-glibc2.31",
                       versions={"torch": "2.5.1", "transformers": "5.20.0"}).as_environment()


def _logprobs(steps: int, vocab: int, scale: float, seed: int) -> Any:
    import torch

    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(steps, vocab, generator=generator, dtype=torch.float64) * scale).log_softmax(-1).float()


def _baseline(tokens: list[list[int]] | None = None, logprobs: list[Any] | None = None, k: int = 20,
              latency: float = 0.5, environment: dict[str, Any] | None = None) -> StoredBaseline:
    if logprobs is None:
        logprobs = [_logprobs(6, 50, 3.0, seed) for seed in (1, 2)]
    if tokens is None:
        tokens = [lp.argmax(-1).tolist() for lp in logprobs]
    side = SideMetrics(ttft_s=0.01, tpot_s=0.002, latency_s=latency, throughput_tok_s=24.0, peak_memory_bytes=2 ** 30,
                       tokens_generated=12, rounds=3, texts=["a", "b"])
    return StoredBaseline.build(**KEY_ARGS, tokens=tokens, logprobs=logprobs, measurements=side,
                                environment=environment or GPU_ENV, texts=side.texts, k=k)


def _strict_json(text: str) -> Any:
    def refuse(constant: str) -> Any:
        raise AssertionError(f"non-standard JSON constant {constant}")

    return json.loads(text, parse_constant=refuse)


def _leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.endswith(".tmp"))


# ------------------------------------------------------------------------------------------- keys


def test_key_is_stable_readable_and_ignores_rounds() -> None:
    key = baseline_key(**KEY_ARGS)
    assert key == baseline_key(**KEY_ARGS)
    assert re.fullmatch(r"Qwen--Qwen3-0\.6B-bfloat16-[0-9a-f]{16}", key), key
    with_rounds = dict(WORKLOAD, rounds=9, warmup=4, input_tokens=7, num_prompts=2)
    assert baseline_key(**{**KEY_ARGS, "workload": with_rounds}) == key
    workload = Workload(prompts=list(WORKLOAD["prompts"]), max_new_tokens=6, batch_size=2, rounds=5, warmup=1)
    assert baseline_key(**{**KEY_ARGS, "workload": workload}) == key
    assert baseline_key(**{**KEY_ARGS, "workload": workload.to_dict()}) == key
    local = baseline_key(**{**KEY_ARGS, "model": "/home/me/models/tiny llama!"})
    assert re.fullmatch(r"home--me--models--tiny-llama-bfloat16-[0-9a-f]{16}", local), local


@pytest.mark.parametrize("change", [
    {"model": "Qwen/Qwen3-1.7B"}, {"revision": None}, {"revision": "main"}, {"dtype": "float16"},
    {"baseline_techniques": ["sdpa"]}, {"baseline_techniques": ["dynamic_cache", "eager"]},
    {"workload": dict(WORKLOAD, prompts=["The cat sees", "Explain gravity in one sentence."])},
    {"workload": dict(WORKLOAD, max_new_tokens=7)}, {"workload": dict(WORKLOAD, batch_size=1)},
    {"extra": {"trust_remote_code": True}},
])
def test_every_part_changes_the_key(change: dict[str, Any]) -> None:
    assert baseline_key(**{**KEY_ARGS, **change}) != baseline_key(**KEY_ARGS)


def test_bad_workload_is_a_config_error() -> None:
    with pytest.raises(OptConfigError, match="prompts"):
        baseline_key(**{**KEY_ARGS, "workload": {"prompts": [], "max_new_tokens": 6, "batch_size": 1}})
    with pytest.raises(OptConfigError, match="max_new_tokens"):
        baseline_key(**{**KEY_ARGS, "workload": {"prompts": ["x"], "batch_size": 1}})


# --------------------------------------------------------------------------------- capture, files


def test_capture_keeps_top_k_and_the_exact_rest_mass() -> None:
    import torch

    lp = _logprobs(4, 100, 1.0, 3)
    tokens, topk = capture([lp.argmax(-1).tolist()], [lp], k=5)
    assert tokens == [lp.argmax(-1).tolist()] and len(topk) == 1 and len(topk[0]) == 4
    for step, row in zip(topk[0], lp.double()):
        values, ids = torch.topk(row, 5)
        assert step["ids"] == ids.tolist() and step["logprobs"] == values.tolist()
        others = row.clone()
        others[ids] = -math.inf
        assert step["rest_logprob"] == pytest.approx(float(torch.logsumexp(others, 0)), abs=1e-12)
    _, whole = capture([[0, 1]], [_logprobs(2, 8, 1.0, 4)], k=20)  # k >= vocab: nothing left over
    assert all(len(s["ids"]) == 8 and s["rest_logprob"] is None for s in whole[0])
    assert capture([[1, 2]], None) == ([[1, 2]], None)
    with pytest.raises(ValueError, match="one step per token"):
        capture([[1, 2, 3]], [_logprobs(2, 8, 1.0, 4)])


def test_save_and_load_round_trip(tmp_path: Path) -> None:
    store = BaselineStore(tmp_path / "baselines")
    baseline = _baseline()
    path = store.save(baseline, update=False)
    assert path == store.path_for(baseline.key) == tmp_path / "baselines" / f"{baseline.key}.json"
    data = _strict_json(path.read_text())
    assert data["schema"] == SCHEMA and data["schema_version"] == SCHEMA_VERSION
    assert data["fingerprint"] == hardware_fingerprint(GPU_ENV)
    assert data["measurements"]["latency_s"] == 0.5 and data["measurements"]["peak_memory_bytes"] == 2 ** 30
    assert len(data["topk"][0][0]["ids"]) == 20 and data["workload"] == WORKLOAD
    loaded = store.load(baseline.key)
    assert loaded == baseline
    assert loaded.identity_key() == loaded.key
    side = loaded.side_metrics()
    assert side.latency_s == 0.5 and side.peak_memory_bytes == 2 ** 30 and side.texts == ["a", "b"]
    assert store.load(baseline_key(**{**KEY_ARGS, "dtype": "float32"})) is None  # missing: None
    assert (tmp_path / "baselines" / ".gitignore").read_text().count(".lock") == 1
    assert _leftovers(tmp_path / "baselines") == []
    # similarity against the stored copy equals similarity against the captured one
    opt = [_logprobs(6, 50, 3.0, seed) for seed in (11, 12)]
    tokens = [lp.argmax(-1).tolist() for lp in opt]
    assert similarity_against_stored(loaded, tokens, opt, 6) == similarity_against_stored(baseline, tokens, opt, 6)


def test_non_finite_values_are_strict_json_and_make_similarity_nan(tmp_path: Path) -> None:
    import torch

    lp = [_logprobs(6, 50, 3.0, seed) for seed in (1, 2)]
    tokens = [row.argmax(-1).tolist() for row in lp]
    lp[1][2] = math.nan  # a broken step in the baseline
    baseline = _baseline(tokens=tokens, logprobs=lp)
    store = BaselineStore(tmp_path)
    loaded = store.load(store.save(baseline, update=True).stem)
    assert _strict_json(store.path_for(baseline.key).read_text())["topk"][1][2]["logprobs"][0] == "nan"
    assert math.isnan(loaded.topk[1][2]["logprobs"][0])
    result = similarity_against_stored(loaded, tokens, [row.clone() for row in lp], 6)
    assert math.isnan(result.kl_mean) and math.isnan(result.kl_max) and math.isnan(result.top1)
    clean = _baseline(tokens=tokens, logprobs=[_logprobs(6, 50, 3.0, seed) for seed in (1, 2)])
    opt = [_logprobs(6, 50, 3.0, 1), torch.full((6, 50), math.nan)]
    result = similarity_against_stored(clean, tokens, opt, 6)
    assert math.isnan(result.kl_mean) and math.isnan(result.top1)


# ------------------------------------------------------------------------------------ similarity


@pytest.mark.parametrize("scale", [0.5, 1.0, 3.0])
def test_top_k_kl_is_a_lower_bound_of_the_exact_kl(scale: float) -> None:
    import torch

    for seed in range(8):
        base = [_logprobs(5, 300, scale, 100 + seed + 10 * i) for i in range(2)]
        opt = [(b.double() + 0.3 * torch.randn(b.shape, generator=torch.Generator().manual_seed(seed + i),
                                                dtype=torch.float64)).log_softmax(-1).float()
               for i, b in enumerate(base)]
        tokens = [[0] * 5, [1] * 5]  # identical on both sides: every step is compared
        exact = compare_runs(tokens, tokens, 5, base, opt)
        estimate = similarity_against_stored(_baseline(tokens=tokens, logprobs=base), tokens, opt, 5)
        assert estimate.compared_steps == exact.compared_steps == 10
        assert estimate.kl_mean <= exact.kl_mean + 1e-9 and estimate.kl_max <= exact.kl_max + 1e-9
        assert 0.0 <= estimate.kl_mean
        assert estimate.note and "estimated from stored top-k (k=20), a lower bound" in estimate.note
        if scale == 0.5:  # flat: most of the mass is outside the top-20, the bound is loose
            assert estimate.kl_mean < 0.5 * exact.kl_mean


def test_top_k_kl_is_close_when_the_top_k_holds_almost_all_mass() -> None:
    import torch

    for seed in range(5):
        base_logits = torch.randn(6, 1000, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        base_logits[:, :8] += 25.0  # 8 tokens hold all but ~1e-7 of the mass
        base = [base_logits.log_softmax(-1).float()]
        noise = 0.2 * torch.randn(6, 1000, generator=torch.Generator().manual_seed(50 + seed), dtype=torch.float64)
        opt = [(base_logits + noise).log_softmax(-1).float()]
        tokens = [[3] * 6]
        exact = compare_runs(tokens, tokens, 6, base, opt)
        estimate = similarity_against_stored(_baseline(tokens=tokens * 2, logprobs=base * 2), tokens * 2, opt * 2, 6)
        assert estimate.kl_mean <= exact.kl_mean + 1e-9
        assert estimate.kl_mean == pytest.approx(exact.kl_mean, rel=1e-4, abs=1e-9)
        assert estimate.kl_max == pytest.approx(exact.kl_max, rel=1e-4, abs=1e-9)


def test_token_match_top1_and_near_tie_equal_compare_runs() -> None:
    import torch

    vocab, steps = 40, 8
    base = [_logprobs(steps, vocab, 2.0, seed) for seed in (21, 22, 23)]
    base_tokens = [lp.argmax(-1).tolist() for lp in base]
    # prompt 0 diverges at step 3 on a near-tie; prompt 1 at step 5 on a clear winner; prompt 2 never
    logits = base[0].double().clone()
    first, second = torch.topk(logits[3], 2).indices.tolist()
    logits[3, second] = logits[3, first] - NEAR_TIE_LOGPROB_GAP / 2
    base[0] = logits.log_softmax(-1).float()
    base_tokens[0] = base[0].argmax(-1).tolist()
    opt_tokens = [list(t) for t in base_tokens]
    opt_tokens[0][3:] = [second] * (steps - 3)
    worst = int(base[1][5].argmin())  # surely outside the stored top-k
    opt_tokens[1][5:] = [worst] * (steps - 5)
    noise = torch.Generator().manual_seed(7)
    opt = [(lp.double() + 0.5 * torch.randn(lp.shape, generator=noise, dtype=torch.float64)).log_softmax(-1).float()
           for lp in base]
    # at prompt 0's divergence the optimized side picked `second` by a hair too, as rounding would: a near-tie
    tied = opt[0].double().clone()
    tied[3, first] = tied[3].max() + 1.0
    tied[3, second] = tied[3, first] + NEAR_TIE_LOGPROB_GAP / 4
    opt[0] = tied.log_softmax(-1).float()
    stored = _baseline(tokens=base_tokens, logprobs=base)

    def both(optimized_tokens: list[list[int]], requested: int = steps) -> tuple[Any, Any]:
        return (compare_runs(base_tokens, optimized_tokens, requested, base, opt),
                similarity_against_stored(stored, optimized_tokens, opt, requested))

    exact, estimate = both(opt_tokens)
    assert estimate.token_match == exact.token_match == pytest.approx((3 / 8 + 5 / 8 + 1) / 3)
    assert estimate.top1 == exact.top1 and estimate.compared_steps == exact.compared_steps
    assert (estimate.top1_flips, estimate.near_tie_flips) == (exact.top1_flips, exact.near_tie_flips)
    assert estimate.near_tie is exact.near_tie is False  # prompt 1 is a real divergence
    assert (estimate.divergences, estimate.near_tie_divergences) == (exact.divergences, exact.near_tie_divergences) == (2, 1)
    only_tie = [opt_tokens[0], base_tokens[1], base_tokens[2]]
    exact, estimate = both(only_tie, requested=6)
    assert estimate.token_match == exact.token_match and estimate.top1 == exact.top1
    assert estimate.near_tie is exact.near_tie is True
    only_outside = [base_tokens[0], opt_tokens[1], base_tokens[2]]
    exact, estimate = both(only_outside)
    assert estimate.near_tie is exact.near_tie is False
    # without distributions on one side: token_match only, as compare_runs
    plain = similarity_against_stored(stored, opt_tokens, None, steps)
    assert plain.token_match == compare_runs(base_tokens, opt_tokens, steps).token_match
    assert plain.kl_mean is None and plain.top1 is None and plain.note
    with pytest.raises(ValueError):
        similarity_against_stored(stored, opt_tokens[:2], opt[:2], steps)


# --------------------------------------------------------------------------------- bad files


def _bad_files() -> dict[str, bytes]:
    good = json.loads(_baseline().to_json())
    return {
        "not JSON": b"\x00\x01 binary \xff",
        "truncated": _baseline().to_json().encode()[:200],
        "a report": json.dumps({"schema": "pytest-transformers-opt/report", "schema_version": 1}).encode(),
        "a list": b"[1, 2, 3]",
        "no schema": json.dumps({"tokens": [[1]]}).encode(),
        "other schema_version": json.dumps({**good, "schema_version": 2}).encode(),
        "ill-typed tokens": json.dumps({**good, "tokens": "1 2 3"}).encode(),
        "missing fingerprint": json.dumps({k: v for k, v in good.items() if k != "fingerprint"}).encode(),
        "short top-k": json.dumps({**good, "topk": [good["topk"][0][:2], good["topk"][1]]}).encode(),
        "copied from another key": json.dumps({**good, "key": "other-model-bfloat16-0123456789abcdef"}).encode(),
    }


BAD_CASES = ["not JSON", "truncated", "a report", "a list", "no schema", "other schema_version", "ill-typed tokens",
             "missing fingerprint", "short top-k", "copied from another key"]


def test_every_bad_case_is_listed() -> None:
    assert list(_bad_files()) == BAD_CASES


@pytest.mark.parametrize("case", BAD_CASES)
def test_a_bad_file_is_a_clear_error_and_never_overwritten_without_update(tmp_path: Path, case: str) -> None:
    store = BaselineStore(tmp_path)
    baseline = _baseline()
    path = store.path_for(baseline.key)
    content = _bad_files()[case]
    path.write_bytes(content)
    with pytest.raises(OptConfigError) as error:
        store.load(baseline.key)
    assert str(path) in str(error.value) and "--opt-update-baselines" in str(error.value)
    with pytest.raises(OptConfigError, match="refusing to overwrite"):
        store.save(baseline, update=False)
    assert path.read_bytes() == content
    store.save(baseline, update=True)
    assert store.load(baseline.key) == baseline
    assert _leftovers(tmp_path) == []


@pytest.mark.parametrize("case", ["not JSON", "a report", "other schema_version", "ill-typed tokens"])
def test_from_json_names_the_path(case: str) -> None:
    with pytest.raises(OptConfigError, match=re.escape("/somewhere/x.json")):
        StoredBaseline.from_json(_bad_files()[case].decode("utf-8", "replace"), "/somewhere/x.json")


def test_save_without_update_keeps_an_existing_baseline(tmp_path: Path) -> None:
    store = BaselineStore(tmp_path)
    first = _baseline(latency=0.5)
    path = store.save(first, update=False)
    before = path.read_bytes()
    store.save(_baseline(latency=0.9), update=False)
    assert path.read_bytes() == before
    store.save(_baseline(latency=0.9), update=True)
    assert store.load(first.key).measurements["latency_s"] == 0.9


def test_a_failed_write_leaves_the_old_file_and_no_temporary_file(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    store = BaselineStore(tmp_path)
    path = store.save(_baseline(latency=0.5), update=True)
    before = path.read_bytes()

    def fail(*_: Any) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OptConfigError, match="disk full"):
        store.save(_baseline(latency=0.9), update=True)
    assert path.read_bytes() == before and _leftovers(tmp_path) == []


def test_missing_message_says_how_to_create_it(tmp_path: Path) -> None:
    store = BaselineStore(tmp_path / "bl")
    key = baseline_key(**KEY_ARGS)
    message = store.missing_message(key, "tests/test_x.py::test_4bit[a b]")
    assert "--opt-update-baselines" in message and f"--opt-baselines={tmp_path / 'bl'}" in message
    assert "'tests/test_x.py::test_4bit[a b]'" in message and f"{key}.json" in message
    with pytest.raises(OptConfigError):
        store.path_for("../escape")


# ------------------------------------------------------------------------------------- processes


# The workers get the baseline as JSON text: they need neither torch nor a model, so they start fast.
def _save_many(directory: str, text: str, times: int) -> None:
    store = BaselineStore(directory)
    for _ in range(times):
        store.save(StoredBaseline.from_json(text), update=True)


def _save_after_signal(directory: str, text: str, ready: Any) -> None:
    ready.set()
    BaselineStore(directory).save(StoredBaseline.from_json(text), update=True)


def test_two_processes_saving_one_key_leave_a_valid_file(tmp_path: Path) -> None:
    context = multiprocessing.get_context("spawn")
    workers = [context.Process(target=_save_many, args=(str(tmp_path), _baseline(latency=latency).to_json(), 15))
               for latency in (0.25, 0.75)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(60)
    assert [w.exitcode for w in workers] == [0, 0]
    stored = BaselineStore(tmp_path).load(baseline_key(**KEY_ARGS))
    assert stored is not None and stored.measurements["latency_s"] in (0.25, 0.75)
    assert _leftovers(tmp_path) == []


def test_a_writer_waits_for_the_lock(tmp_path: Path) -> None:
    store = BaselineStore(tmp_path)
    path = store.path_for(baseline_key(**KEY_ARGS))
    context = multiprocessing.get_context("spawn")
    ready = context.Event()
    writer = context.Process(target=_save_after_signal, args=(str(tmp_path), _baseline(latency=0.7).to_json(), ready))
    with store._locked(path):
        writer.start()
        assert ready.wait(60)
        writer.join(1.0)  # it cannot finish while this process holds the lock
        assert writer.is_alive() and not path.exists()
    writer.join(60)
    assert writer.exitcode == 0 and store.load(path.stem).measurements["latency_s"] == 0.7


# ----------------------------------------------------------------------------------- fingerprints


def test_fingerprints_match_and_mismatch() -> None:
    same = hardware_fingerprint(dict(GPU_ENV, device="cuda:1", driver="999.1", gpu_memory_bytes=1))
    assert same == hardware_fingerprint(GPU_ENV)
    assert "gpu=NVIDIA H200" in same and "cc=9.0" in same and "machine=x86_64" in same
    stored = _baseline()
    assert measurements_usable(stored, hardware_fingerprint(GPU_ENV)) == (True, "")
    small = dict(GPU_ENV, gpu_name="Tesla T4", compute_capability="7.5")
    ok, reason = measurements_usable(stored, hardware_fingerprint(small))
    assert not ok
    assert reason == ("stored baseline measured on gpu=NVIDIA H200, cc=9.0, this run on gpu=Tesla T4, cc=7.5: "
                      "speed and memory ratios measured live")
    for change in ({"torch": "2.6.0"}, {"transformers": "5.21.0"}, {"cuda": "12.8"}, {"cpu_count": 8},
                   {"platform": "Linux-6.1-aarch64-with-glibc2.36"}, {"device": "cpu"}, {"tf32": True}):
        assert hardware_fingerprint(dict(GPU_ENV, **change)) != hardware_fingerprint(GPU_ENV), change
    cpu = HardwareInfo(versions={"torch": "2.5.1"}).as_environment()
    assert hardware_fingerprint(cpu).startswith("device=cpu; gpu=-; cc=-;")
    empty = _baseline()
    empty.measurements = {"tokens_generated": 12}
    ok, reason = measurements_usable(empty, hardware_fingerprint(GPU_ENV))
    assert not ok and "no speed or memory measurements" in reason
