"""Stored baselines: a baseline's reference run, kept as JSON so later runs can be judged against it.

``--opt-update-baselines`` writes, under ``--opt-baselines`` (default ``.opt-baselines/``), one file
per (model, revision, dtype, baseline configuration, workload): the baseline's greedy tokens, the
top-k log-probabilities of every step (enough for KL and top-1 against a later run), its
measurements, and the hardware fingerprint they were taken on. A run without the flag compares
similarity against the stored tokens and distributions (so a 4-bit test on a small GPU can be judged
against a baseline captured on a large one) and reuses the stored measurements for speed and memory
ratios only when the fingerprint matches.

Files are plain JSON (never pickle), written atomically (temporary file + ``os.replace``) under an
inter-process lock, so two pytest-xdist workers writing the same key never interleave. A file that is
not JSON, not a baseline, of another schema version, or ill-formed is a clear ``OptConfigError``
naming the file, and is never overwritten without ``--opt-update-baselines``.

KL from a stored baseline is an estimate: the k stored tokens are compared one by one and all the
other tokens as one bucket ("the rest"). By the log-sum inequality that is a lower bound of the exact
KL(baseline || optimized); it equals the exact value when the top-k holds all the mass.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import hashlib
import json
import math
import os
import re
import shlex
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Sequence

from ..errors import OptConfigError
from ..files import JsonProblem, parse_json, read_limited, write_atomic
from .similarity import (PREFIX_ONLY_NOTE, Similarity, common_prefix, compare_runs, diverged, is_near_tie,
                         near_tie_gap, pair_gap_move, set_agreement)

if sys.platform != "win32":  # POSIX; on Windows writes are still atomic, only not serialised between processes
    import fcntl

if TYPE_CHECKING:
    from .results import SideMetrics

SCHEMA = "pytest-transformers-opt/baseline"
SCHEMA_VERSION = 1
DEFAULT_TOP_K = 20
# A rest mass below this is not stored (``rest_logprob`` null): it cannot move KL by more than ~1e-10.
NEGLIGIBLE_REST_MASS = 1e-12
# SideMetrics fields a stored baseline keeps (numbers only).
MEASUREMENT_FIELDS = ("ttft_s", "tpot_s", "latency_s", "throughput_tok_s", "peak_memory_bytes", "load_time_s",
                      "tokens_generated", "rounds")
# What a hardware fingerprint is made of: (label, environment key).
FINGERPRINT_FIELDS = (("device", "device"), ("gpu", "gpu_name"), ("cc", "compute_capability"), ("torch", "torch"),
                      ("transformers", "transformers"), ("cuda", "cuda"), ("machine", "machine"),
                      ("cpus", "cpu_count"), ("tf32", "tf32"))
_MACHINES = ("x86_64", "amd64", "aarch64", "arm64", "ppc64le", "s390x", "riscv64", "i686", "i386")
MAX_TOKEN_ID = 2**31  # beyond any vocabulary; int32 is what tokenizers hand out
_KEY_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_REPLACE_HINT = "rerun with --opt-update-baselines to replace it"
_NO_DISTRIBUTIONS = "no per-step distributions on one side (continuous batching returns tokens only)"


# --------------------------------------------------------------------------------------------- keys


def _workload_identity(workload: Any) -> dict[str, Any]:
    """The parts of a workload that decide the baseline's tokens: prompts, max_new_tokens, batch_size.

    Accepts a mapping (``Workload.to_dict()`` or a plain dict) or a ``Workload``; rounds and warm-up
    are ignored, as in ``Workload.key()``.
    """
    get: Callable[[str], Any] = (workload.get if isinstance(workload, Mapping)
                                 else (lambda name: getattr(workload, name, None)))
    prompts, max_new_tokens, batch_size = get("prompts"), get("max_new_tokens"), get("batch_size")
    if (not isinstance(prompts, (list, tuple)) or not prompts or not all(isinstance(p, str) for p in prompts)
            or not _is_int(max_new_tokens) or not _is_int(batch_size)):
        raise OptConfigError("a baseline workload needs prompts (a non-empty list of strings), max_new_tokens and "
                             f"batch_size (ints); got {workload!r}")
    return {"prompts": list(prompts), "max_new_tokens": int(max_new_tokens), "batch_size": int(batch_size)}


def _slug(text: str, limit: int = 64) -> str:
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", text.replace("\\", "/").strip("/").replace("/", "--"))
    slug = slug[-limit:].strip("-._")  # the tail of a long path is the informative part
    return slug or "model"


def baseline_key(model: str, revision: str | None, dtype: str | None, baseline_techniques: Sequence[str],
                 workload: Mapping[str, Any] | Any, extra: Mapping[str, Any] | None = None) -> str:
    """A stable, readable file stem: ``<model slug>-<dtype>-<16 hex of sha256>``.

    The hash covers the canonical JSON of every part (model, revision, dtype, baseline techniques in
    their order, the workload's prompts / max_new_tokens / batch_size, and ``extra`` when given, e.g.
    from_pretrained kwargs that change outputs), so any change of any part gives another file.
    """
    identity: dict[str, Any] = {
        "model": str(model), "revision": revision, "dtype": dtype,
        "baseline_techniques": [str(t) for t in baseline_techniques], "workload": _workload_identity(workload),
    }
    if extra:
        identity["extra"] = dict(extra)
    try:
        canonical = json.dumps(identity, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise OptConfigError(f"baseline key parts must be JSON values: {exc}") from exc
    digest = hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:16]
    return f"{_slug(str(model))}-{_slug(str(dtype or 'auto'), 16)}-{digest}"


def _machine(environment: Mapping[str, Any]) -> str | None:
    if environment.get("machine"):
        return str(environment["machine"])
    text = str(environment.get("platform") or "")
    for machine in _MACHINES:
        if re.search(rf"(^|[-_ ]){machine}($|[-_ ])", text):
            return machine
    return text or None  # unknown: the whole platform string (stricter, never looser)


def hardware_fingerprint(environment: Mapping[str, Any]) -> str:
    """Readable and canonical: ``device=cuda; gpu=NVIDIA H200; cc=9.0; torch=...; ...``.

    ``environment`` is ``HardwareInfo.as_environment()`` (optionally with ``machine``, else it is read
    from ``platform``). Device indices are dropped (``cuda:1`` measures like ``cuda:0``); GPU name,
    compute capability, torch / transformers / CUDA versions, CPU architecture and count and TF32 are
    kept, so measurements are reused only on the same hardware and software.
    """
    values = {
        "device": str(environment.get("device") or "").split(":")[0] or None,
        "machine": _machine(environment),
    }
    parts = []
    for label, key in FINGERPRINT_FIELDS:
        value = values[label] if label in values else environment.get(key)
        text = "-" if value is None or value == "" else str(value).replace(";", ",").strip()
        parts.append(f"{label}={text}")
    return "; ".join(parts)


def _fingerprint_parts(fingerprint: str) -> dict[str, str] | None:
    parts = {}
    for item in fingerprint.split("; "):
        label, sep, value = item.partition("=")
        if not sep:
            return None
        parts[label] = value
    return parts


def measurements_usable(stored: "StoredBaseline", fingerprint: str) -> tuple[bool, str]:
    """Whether the stored measurements may stand in for a live baseline run on this machine.

    ``(True, "")`` when the fingerprints match (and something was measured), else ``(False, reason)``
    with a reason for the report naming what differs.
    """
    if not any(stored.measurements.get(name) is not None for name in ("latency_s", "peak_memory_bytes")):
        return False, (f"stored baseline {stored.key} holds no speed or memory measurements: "
                       "speed and memory ratios measured live")
    if stored.fingerprint == fingerprint:
        return True, ""
    then, now = _fingerprint_parts(stored.fingerprint), _fingerprint_parts(fingerprint)
    if then is not None and now is not None:
        differ = [label for label in dict.fromkeys([*then, *now]) if then.get(label) != now.get(label)]
        then_text = ", ".join(f"{label}={then.get(label, '-')}" for label in differ)
        now_text = ", ".join(f"{label}={now.get(label, '-')}" for label in differ)
    else:
        then_text, now_text = stored.fingerprint, fingerprint
    return False, f"stored baseline measured on {then_text}, this run on {now_text}: speed and memory ratios measured live"


# ------------------------------------------------------------------------------------------ capture


def capture(tokens: Sequence[Sequence[int]], logprobs: Sequence[Any] | None,
            k: int = DEFAULT_TOP_K) -> tuple[list[list[int]], list[list[dict[str, Any]]] | None]:
    """Tokens and per-step top-k of a ``GenerationRun`` (``run.tokens``, ``run.logprobs``).

    Every step keeps the ``k`` most likely ids, their log-probabilities, and ``rest_logprob``: the log
    of the mass of all other tokens (``logsumexp`` of the others, exact even when it is tiny), or
    None when that mass is below ``NEGLIGIBLE_REST_MASS``. ``logprobs`` None (continuous batching)
    gives ``topk`` None.
    """
    import torch

    if k < 1:
        raise ValueError(f"capture(k=...) must be >= 1; got {k}")
    toks = [[int(t) for t in seq] for seq in tokens]
    if logprobs is None:
        return toks, None
    if len(logprobs) != len(toks):
        raise ValueError(f"{len(toks)} token sequences but {len(logprobs)} log-probability tensors")
    negligible = math.log(NEGLIGIBLE_REST_MASS)
    topk: list[list[dict[str, Any]]] = []
    for index, (seq, lp) in enumerate(zip(toks, logprobs)):
        lp = torch.as_tensor(lp).detach().to("cpu", torch.float64)
        if lp.ndim != 2 or lp.shape[0] != len(seq):
            raise ValueError(f"prompt {index}: log-probabilities of shape {tuple(lp.shape)} for {len(seq)} tokens; "
                             "expected [steps, vocab] with one step per token")
        values, ids = torch.topk(lp, min(k, lp.shape[-1]), dim=-1)
        rest = torch.logsumexp(lp.scatter(-1, ids, float("-inf")), dim=-1)
        steps = []
        for step_ids, step_values, step_rest in zip(ids.tolist(), values.tolist(), rest.tolist()):
            rest_logprob = None if step_rest < negligible else step_rest  # NaN stays NaN (NaN < x is False)
            steps.append({"ids": step_ids, "logprobs": step_values, "rest_logprob": rest_logprob})
        topk.append(steps)
    return toks, topk


# ----------------------------------------------------------------------------------------- the file


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_token_id(value: Any) -> bool:
    """A vocabulary index: ids of 10**30 are a crafted file, not a tokenizer (torch would overflow)."""
    return _is_int(value) and 0 <= value < MAX_TOKEN_ID


def _encode_float(value: float) -> float | str:
    """Strict JSON has no NaN or infinity: those are written as the strings "nan", "inf", "-inf"."""
    if math.isfinite(value):
        return value
    return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")


def _decode_float(value: Any) -> float | None:
    """A stored log-probability: a number or "nan" / "inf" / "-inf"; None when it is neither."""
    if _is_number(value):
        return float(value)
    if value in ("nan", "inf", "-inf"):
        return float(value)
    return None


def _clean_measurement(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def measurements_from_side(side: "SideMetrics") -> dict[str, float | int | None]:
    """The numbers of a ``SideMetrics`` that a stored baseline keeps (non-finite become None)."""
    return {name: _clean_measurement(getattr(side, name, None)) for name in MEASUREMENT_FIELDS}


def _compact_container(value: Any) -> bool:
    """One line for lists of scalars and for dicts that hold such lists (a top-k step, a workload)."""
    def scalar(v: Any) -> bool:
        return not isinstance(v, (dict, list))

    if isinstance(value, list):
        return all(scalar(v) for v in value)
    if isinstance(value, dict):
        return (any(isinstance(v, list) for v in value.values())
                and all(scalar(v) or (isinstance(v, list) and all(scalar(x) for x in v)) for v in value.values()))
    return False


def _dumps(value: Any, level: int = 0) -> str:
    """JSON, indented, with long leaf lists (tokens, top-k steps) kept on one line each."""
    if not isinstance(value, (dict, list)) or not value or _compact_container(value):
        return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(", ", ": "))
    pad, inner = "  " * level, "  " * (level + 1)
    if isinstance(value, dict):
        items = [f"{inner}{json.dumps(str(k), ensure_ascii=False)}: {_dumps(v, level + 1)}" for k, v in value.items()]
        return "{\n" + ",\n".join(items) + "\n" + pad + "}"
    items = [f"{inner}{_dumps(v, level + 1)}" for v in value]
    return "[\n" + ",\n".join(items) + "\n" + pad + "]"


@dataclass
class StoredBaseline:
    """One stored baseline (see the module docstring). ``to_json`` / ``from_json`` round-trip it."""

    key: str
    model: str
    revision: str | None
    dtype: str | None
    baseline_techniques: list[str]
    workload: dict[str, Any]  # prompts, max_new_tokens, batch_size
    tokens: list[list[int]]
    topk: list[list[dict[str, Any]]] | None  # per prompt, per step: ids, logprobs, rest_logprob
    measurements: dict[str, float | int | None]
    fingerprint: str
    environment: dict[str, Any]
    created: str
    k: int = DEFAULT_TOP_K
    texts: list[str] = field(default_factory=list)
    schema: str = SCHEMA
    schema_version: int = SCHEMA_VERSION

    @classmethod
    def build(cls, *, model: str, revision: str | None, dtype: str | None, baseline_techniques: Sequence[str],
              workload: Mapping[str, Any] | Any, tokens: Sequence[Sequence[int]], logprobs: Sequence[Any] | None,
              measurements: Mapping[str, Any] | "SideMetrics", environment: Mapping[str, Any],
              texts: Sequence[str] = (), k: int = DEFAULT_TOP_K, extra: Mapping[str, Any] | None = None,
              created: str | None = None) -> "StoredBaseline":
        """From a baseline's reference run: computes the key, the top-k, the fingerprint and the time."""
        toks, topk = capture(tokens, logprobs, k)
        if not isinstance(measurements, Mapping):
            measurements = measurements_from_side(measurements)
        return cls(
            key=baseline_key(model, revision, dtype, baseline_techniques, workload, extra),
            model=str(model), revision=revision, dtype=dtype, baseline_techniques=[str(t) for t in baseline_techniques],
            workload=_workload_identity(workload), tokens=toks, topk=topk,
            measurements={str(n): _clean_measurement(v) for n, v in measurements.items()},
            fingerprint=hardware_fingerprint(environment), environment=dict(environment),
            created=created or _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            k=k, texts=list(texts),
        )

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        ordered = {"schema": data.pop("schema"), "schema_version": data.pop("schema_version"), **data}
        if self.topk is not None:
            ordered["topk"] = [[{"ids": [int(i) for i in step["ids"]],
                                 "logprobs": [_encode_float(float(v)) for v in step["logprobs"]],
                                 "rest_logprob": (None if step["rest_logprob"] is None
                                                  else _encode_float(float(step["rest_logprob"])))}
                                for step in steps] for steps in self.topk]
        ordered["measurements"] = {n: _clean_measurement(v) for n, v in self.measurements.items()}
        ordered["environment"] = _json_safe(self.environment)
        return ordered

    def to_json(self) -> str:
        return _dumps(self.to_dict()) + "\n"

    def identity_key(self, extra: Mapping[str, Any] | None = None) -> str:
        """The key recomputed from the stored identity (equals ``key`` for an intact file without extra)."""
        return baseline_key(self.model, self.revision, self.dtype, self.baseline_techniques, self.workload, extra)

    def side_metrics(self) -> "SideMetrics":
        """The stored measurements and texts as a ``SideMetrics`` (for ``OptResult.baseline``)."""
        from .results import SideMetrics

        known: dict[str, Any] = {n: v for n, v in self.measurements.items() if n in MEASUREMENT_FIELDS and v is not None}
        for name in ("peak_memory_bytes", "tokens_generated", "rounds"):
            if name in known:
                known[name] = int(known[name])
        return SideMetrics(texts=list(self.texts), memory_method="stored baseline", **known)

    @classmethod
    def from_json(cls, text: str, path: str | os.PathLike[str] | None = None) -> "StoredBaseline":
        """Parse and validate; anything else is an ``OptConfigError`` that names ``path``."""
        where = str(path) if path is not None else "<baseline>"

        def bad(problem: str) -> OptConfigError:
            return OptConfigError(f"stored baseline {where}: {problem}; {_REPLACE_HINT}")

        try:
            data = parse_json(text)
        except JsonProblem as exc:
            raise OptConfigError(f"stored baseline {where} {exc}; {_REPLACE_HINT}") from None
        if not isinstance(data, dict) or "schema" not in data:
            raise bad(f"not a pytest-transformers-opt baseline file (no \"schema\": {SCHEMA!r})")
        if data["schema"] != SCHEMA:
            raise bad(f"not a baseline file: schema {data['schema']!r}, expected {SCHEMA!r}")
        if data.get("schema_version") != SCHEMA_VERSION:
            raise bad(f"schema_version {data.get('schema_version')!r}; this version of pytest-transformers-opt "
                      f"reads {SCHEMA_VERSION}")
        return cls(**_validated(data, bad))


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)


def _validated(data: dict[str, Any], bad: Any) -> dict[str, Any]:
    """Check every field's type; return the constructor arguments (top-k floats decoded)."""
    def need(name: str, ok: bool, expected: str) -> None:
        if not ok:
            shown = repr(data.get(name, "<missing>"))
            raise bad(f"field {name!r} must be {expected}; got {shown[:120]}")

    def optional_str(v: Any) -> bool:
        return v is None or isinstance(v, str)

    for name in ("key", "model", "fingerprint", "created"):
        need(name, isinstance(data.get(name), str), "a string")
    need("revision", "revision" in data and optional_str(data["revision"]), "a string or null")
    need("dtype", "dtype" in data and optional_str(data["dtype"]), "a string or null")
    # each field is unchecked JSON (Any) until need() has vouched for it
    techniques: Any = data.get("baseline_techniques")
    need("baseline_techniques", isinstance(techniques, list) and all(isinstance(t, str) for t in techniques),
         "a list of strings")
    try:
        workload = _workload_identity(data.get("workload")) if isinstance(data.get("workload"), dict) else None
    except OptConfigError:
        workload = None
    need("workload", workload is not None, "an object with prompts, max_new_tokens and batch_size")
    assert workload is not None  # need() raised otherwise
    tokens: Any = data.get("tokens")
    need("tokens", isinstance(tokens, list) and all(isinstance(s, list) and all(_is_token_id(t) for t in s)
                                                    for s in tokens),
         f"a list (one per prompt) of lists of token ids (0 <= id < {MAX_TOKEN_ID})")
    need("tokens", len(tokens) == len(workload["prompts"]), f"one list per prompt ({len(workload['prompts'])})")
    k = data.get("k", DEFAULT_TOP_K)
    need("k", _is_int(k) and k >= 1, "an int >= 1")
    need("topk", "topk" in data, "a list (one per prompt) of per-step top-k entries, or null")
    topk = _validated_topk(data["topk"], tokens, k, bad)
    measurements: Any = data.get("measurements")
    need("measurements", isinstance(measurements, dict)
         and all(v is None or _is_number(v) for v in measurements.values()), "an object of numbers (or nulls)")
    need("environment", isinstance(data.get("environment"), dict), "an object")
    texts: Any = data.get("texts", [])
    need("texts", isinstance(texts, list) and all(isinstance(t, str) for t in texts), "a list of strings")
    return {
        "key": data["key"], "model": data["model"], "revision": data["revision"], "dtype": data["dtype"],
        "baseline_techniques": list(techniques), "workload": workload, "tokens": tokens, "topk": topk,
        "measurements": dict(measurements), "fingerprint": data["fingerprint"], "environment": data["environment"],
        "created": data["created"], "k": k, "texts": list(texts),
    }


def _validated_topk(topk: Any, tokens: list[list[int]], k: int, bad: Any) -> list[list[dict[str, Any]]] | None:
    if topk is None:
        return None
    if not isinstance(topk, list) or len(topk) != len(tokens):
        raise bad(f"field 'topk' must be null or a list with one entry per prompt ({len(tokens)})")
    decoded: list[list[dict[str, Any]]] = []
    for index, (steps, seq) in enumerate(zip(topk, tokens)):
        if not isinstance(steps, list) or len(steps) != len(seq):
            raise bad(f"topk[{index}] must be a list with one step per generated token ({len(seq)})")
        out = []
        for n, step in enumerate(steps):
            ids = step.get("ids") if isinstance(step, dict) else None
            values = [_decode_float(v) for v in step.get("logprobs", [])] if isinstance(step, dict) else []
            rest = step.get("rest_logprob", "missing") if isinstance(step, dict) else "missing"
            rest_value = None if rest is None else _decode_float(rest)
            if (not isinstance(ids, list) or not ids or len(ids) > k or not all(_is_token_id(i) for i in ids)
                    or len(values) != len(ids) or any(v is None for v in values)
                    or (rest is not None and rest_value is None)):
                raise bad(f"topk[{index}][{n}] must be {{\"ids\": [<= {k} token ids], \"logprobs\": [as many numbers], "
                          f"\"rest_logprob\": number or null}}; got {str(step)[:120]}")
            out.append({"ids": list(ids), "logprobs": values, "rest_logprob": rest_value})
        decoded.append(out)
    return decoded


# ---------------------------------------------------------------------------------------- the store


class BaselineStore:
    """The ``--opt-baselines`` folder: one ``<key>.json`` per baseline."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory).expanduser()

    def path_for(self, key: str) -> Path:
        if not isinstance(key, str) or not _KEY_RE.fullmatch(key):
            raise OptConfigError(f"baseline key {key!r} is not a file stem made of letters, digits, '.', '_', '-'")
        return self.directory / f"{key}.json"

    def load(self, key: str) -> StoredBaseline | None:
        """The stored baseline, None when there is none; ``OptConfigError`` for a corrupt or foreign file."""
        path = self.path_for(key)
        try:
            text = read_limited(path)  # regular files only, size-limited: a FIFO never hangs the run
        except FileNotFoundError:
            return None
        except JsonProblem as exc:
            raise OptConfigError(f"stored baseline {path} {exc}; {_REPLACE_HINT}") from None
        except OSError as exc:
            reason = exc.strerror if exc.strerror and exc.errno else str(exc)
            raise OptConfigError(f"stored baseline {path} cannot be read ({reason}); {_REPLACE_HINT}") from None
        stored = StoredBaseline.from_json(text, path)
        if stored.key != key:
            raise OptConfigError(f"stored baseline {path} holds key {stored.key!r}, not {key!r} (copied or renamed "
                                 f"from another baseline?); {_REPLACE_HINT}")
        return stored

    def save(self, baseline: StoredBaseline, *, update: bool) -> Path:
        """Write ``baseline`` atomically, under a lock shared by every process writing that key.

        ``update=True`` (``--opt-update-baselines``) replaces whatever is there. ``update=False`` only
        creates: an existing valid baseline is kept as it is, an existing corrupt or foreign file is an
        ``OptConfigError`` and stays untouched.
        """
        path = self.path_for(baseline.key)
        text = baseline.to_json()
        StoredBaseline.from_json(text, f"{path} (about to be written)")  # never write what cannot be read back
        try:
            self._make_directory()
            with self._locked(path):
                if not update and path.exists():
                    try:
                        self.load(baseline.key)
                    except OptConfigError as exc:
                        raise OptConfigError(f"refusing to overwrite {path}: {exc}") from None
                    return path
                write_atomic(path, text)  # a shared file: the usual permissions, not mkstemp's 0600
        except OSError as exc:
            raise OptConfigError(f"cannot write stored baseline {path} ({exc}); check --opt-baselines") from None
        return path

    def missing_message(self, key: str, nodeid: str) -> str:
        """What the report says when a test has no stored baseline."""
        path = self.path_for(key)
        return (f"no stored baseline for {nodeid} (expected {path}); create it with "
                f"`pytest {shlex.quote(nodeid)} --opt-baselines={shlex.quote(str(self.directory))} "
                f"--opt-update-baselines` on the machine whose baseline you trust, and commit {self.directory}/")

    def lock_path(self, path: Path) -> Path:
        return path.with_name(f".{path.name}.lock")

    @contextlib.contextmanager
    def _locked(self, path: Path) -> Iterator[None]:
        """An exclusive ``flock`` on ``.<file>.lock`` (kept: deleting a lock file races with its waiters)."""
        if sys.platform == "win32":  # pragma: no cover - no fcntl
            yield
            return
        fd = os.open(self.lock_path(path), os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the lock

    def _make_directory(self) -> None:
        """Create the folder; a new one gets a .gitignore for the lock and temporary files."""
        if self.directory.is_dir():
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(self.directory / ".gitignore", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        except FileExistsError:
            return
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write("# created by pytest-transformers-opt: commit the baselines, not the locks\n.*.lock\n.*.tmp\n")


# ----------------------------------------------------------------------------------- the comparison


def similarity_against_stored(stored: StoredBaseline, optimized_tokens: list[list[int]],
                              optimized_logprobs: list[Any] | None, requested: int,
                              forced_logprobs: list[Any] | None = None) -> Similarity:
    """``compare_runs`` with the baseline side read from a stored baseline.

    ``forced_logprobs`` (the optimized configuration decoding the stored tokens) replace
    ``optimized_logprobs`` for KL and top-1, at every stored position, as in ``compare_runs``.

    ``token_match`` is exactly ``compare_runs``'. KL(baseline || optimized) is estimated from the
    stored top-k: the k ids one by one plus the rest as one bucket (the optimized rest is the mass of
    all its other tokens), a lower bound of the exact KL by the log-sum inequality. ``top1`` compares
    the stored top id with the optimized argmax. Near-ties (of top-1 flips and of divergences) follow
    ``compare_runs``' rule with the stored baseline's dtype, reading the baseline's two log-probabilities
    from the stored top-k (no tie when the optimized token is outside it). Any NaN makes ``kl_mean``,
    ``kl_max`` and ``top1`` NaN.
    """
    import torch

    result = compare_runs(stored.tokens, optimized_tokens, requested, dtype=stored.dtype)  # token_match; raises on a count mismatch
    result.note = None
    if stored.topk is None or optimized_logprobs is None:
        result.note = _NO_DISTRIBUTIONS if stored.topk is not None else "stored baseline holds tokens only (no per-step distributions)"
        return result
    if len(optimized_logprobs) != len(optimized_tokens):
        raise ValueError(f"{len(optimized_tokens)} optimized sequences but {len(optimized_logprobs)} log-probability tensors")
    forced = forced_logprobs is not None
    if forced_logprobs is not None and len(forced_logprobs) != len(stored.tokens):
        raise ValueError(f"{len(stored.tokens)} stored sequences but {len(forced_logprobs)} forced log-probability tensors")
    source = forced_logprobs if forced_logprobs is not None else optimized_logprobs
    gap = near_tie_gap(stored.dtype)

    def near_tie(step: Mapping[str, Any], opt_step: Any, base_tok: int, opt_tok: int) -> bool:
        by_id = dict(zip(step["ids"], step["logprobs"]))
        return base_tok in by_id and opt_tok in by_id and is_near_tie(
            pair_gap_move(by_id[base_tok], by_id[opt_tok], float(opt_step[base_tok]), float(opt_step[opt_tok])), gap)

    kls: list[float] = []
    flips = near_tie_flips = 0
    ties: list[bool] = []
    saw_nan = False
    for index, (base_seq, opt_seq) in enumerate(zip(stored.tokens, optimized_tokens)):
        prefix = common_prefix(base_seq, opt_seq)
        stored_steps = stored.topk[index]
        opt_lp = torch.as_tensor(source[index]).detach().to("cpu", torch.float64)
        # forced: every stored position has the stored context; free: up to the first divergent step
        steps = min(len(stored_steps) if forced else prefix + 1, len(stored_steps), opt_lp.shape[0])
        if steps == 0:
            continue
        width = max(len(s["ids"]) for s in stored_steps[:steps])
        if any(len(s["ids"]) != width for s in stored_steps[:steps]):
            raise ValueError(f"stored baseline {stored.key}: top-k widths differ between steps")
        ids = torch.tensor([s["ids"] for s in stored_steps[:steps]], dtype=torch.long)
        base = torch.tensor([s["logprobs"] for s in stored_steps[:steps]], dtype=torch.float64)
        base_rest = torch.tensor([-math.inf if s["rest_logprob"] is None else s["rest_logprob"]
                                  for s in stored_steps[:steps]], dtype=torch.float64)
        opt = opt_lp[:steps]
        if int(ids.max()) >= opt.shape[-1]:
            raise ValueError(f"stored baseline {stored.key} has token ids up to {int(ids.max())}, but the "
                             f"optimized vocabulary has {opt.shape[-1]} entries (another tokenizer?)")
        opt_top = opt.gather(-1, ids)
        opt_rest = torch.logsumexp(opt.scatter(-1, ids, float("-inf")), dim=-1)
        p_base, p_rest = base.exp(), base_rest.exp()
        zero = torch.zeros((), dtype=torch.float64)
        per_id = torch.where(p_base > 0, p_base * (base - opt_top), zero).sum(dim=-1)
        rest = torch.where(p_rest > 0, p_rest * (base_rest - opt_rest), zero)
        kl = (per_id + rest).clamp_min(0.0)  # KL >= 0; rounding can dip below
        nan_rows = base.isnan().any(-1) | opt.isnan().any(-1) | base_rest.isnan()
        saw_nan = saw_nan or bool(nan_rows.any())
        kls.extend(torch.where(nan_rows, torch.full_like(kl, math.nan), kl).tolist())
        opt_argmax = opt.argmax(-1)
        for step in (ids[:, 0] != opt_argmax).nonzero().flatten().tolist():
            flips += 1
            near_tie_flips += near_tie(stored_steps[step], opt[step], int(ids[step, 0]), int(opt_argmax[step]))
        if prefix < min(len(base_seq), len(opt_seq)):
            ties.append(prefix < min(len(stored_steps), opt_lp.shape[0])
                        and near_tie(stored_steps[prefix], opt_lp[prefix], base_seq[prefix], opt_seq[prefix]))
    set_agreement(result, kls, flips, near_tie_flips, saw_nan, ties)
    result.note = (f"KL estimated from stored top-k (k={stored.k}), a lower bound; baseline tokens and "
                   f"distributions from stored baseline {stored.key}")
    if not forced and diverged(stored.tokens, optimized_tokens):
        result.note += f"; {PREFIX_ONLY_NOTE}"
    return result
