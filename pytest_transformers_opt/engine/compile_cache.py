"""``--opt-compile-cache=DIR``: torch's compile caches in a folder that CI keeps between runs.

A fresh CI runner pays every compilation again; with this folder restored (``actions/cache``) the
second run loads inductor's compiled graphs instead. Layout, one subfolder per key::

    DIR/<torch>_<transformers>_<device>_<hash>/
        manifest.json      what the key is made of, written by the plugin
        inductor/          TORCHINDUCTOR_CACHE_DIR: FX graph, AOTAutograd, autotune and Triton caches
        inductor/precompiled_headers/   inductor's precompiled C++ headers (torch's default: /tmp)
        artifacts/<process>.bin   torch.compiler.save_cache_artifacts() of the last session (where torch has it)

The key is the torch and transformers versions and the device (CUDA name and compute capability, or
the CPU architecture), so a change of any of them starts an empty subfolder instead of loading a
stale entry; inductor keys every graph by its code and the model's shapes on top of that.

Whether a test compiled warm or cold is read from torch's own cache counters (hits and misses of the
FX graph and AOTAutograd caches during the test), not guessed from the folder: a warm state means
every lookup hit. Everything in the folder is loaded with pickle by torch, so it must be trusted as
the inductor cache itself is (a CI cache of this repository's own runs).

A damaged entry is a miss, never a failure: torch recompiles a graph entry it cannot read, but reuses a
compiled ``.so`` or ``.o`` it finds (it links the objects it finds), and a truncated one (a cache
restore cut short) failed a test in the field with a C++ error naming the compiler. Each shared object
or object file shorter than its own ELF headers say is removed with its source at install, and
compiled again.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import struct
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..compat import (enable_compile_caches, load_compile_artifacts, package_version, save_compile_artifacts,
                      set_precompiled_header_dir)
from ..errors import OptConfigError
from ..files import read_json, write_atomic
from .progress import say

if TYPE_CHECKING:
    from .hardware import HardwareInfo

MANIFEST = "manifest.json"
MANIFEST_FORMAT = 1
MAX_MANIFEST_BYTES = 64 * 1024
MAX_ARTIFACT_BYTES = 2 * 2**30  # a compiled 8B model's artifacts are tens of MB; more means a broken file
# what the plugin sets while a session runs (restored after): the caches' folder, and the FX graph cache
# switched on for processes it starts (tensor-parallel workers); this one's config is set directly
CACHE_VARIABLES = ("TORCHINDUCTOR_CACHE_DIR", "TORCHINDUCTOR_FX_GRAPH_CACHE", "TORCHINDUCTOR_AUTOGRAD_CACHE")
COMPILE_CACHE_STATES = ("warm", "cold", "partial")


@dataclass(frozen=True)
class CacheKey:
    """What a compiled graph depends on beyond its own code: a change of any of these misses."""

    torch: str | None
    transformers: str | None
    device: str  # "NVIDIA H200 (sm 9.0)" or "cpu (x86_64)"

    def folder_name(self) -> str:
        """Readable, file-name safe, and unique (a hash of the whole key ends it)."""
        readable = f"torch-{self.torch}_transformers-{self.transformers}_{self.device}"
        digest = hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:12]
        return re.sub(r"[^A-Za-z0-9.+-]+", "-", readable).strip("-")[:120] + "_" + digest


def cache_key(hardware: HardwareInfo) -> CacheKey:
    if hardware.is_cuda:
        cc = hardware.compute_capability
        device = f"{hardware.name} (sm {cc[0]}.{cc[1]})" if cc else hardware.name or "cuda"
    else:
        device = f"cpu ({platform.machine() or 'unknown'})"
    return CacheKey(torch=package_version("torch"), transformers=package_version("transformers"), device=device)


def check_cache_dir(path: str, source: str) -> None:
    """A folder the cache can live in: an existing writable folder, or one that can be created (its
    nearest existing parent is a writable folder). ``OptConfigError`` naming ``source`` otherwise."""
    target = Path(path)
    if target.exists() and not target.is_dir():
        raise OptConfigError(f"{source}: {path!r} is not a folder; give the folder the compile cache lives in")
    existing = target
    while not existing.exists():
        if existing.is_symlink():  # a link to nothing (or a loop): mkdir would fail on it at the first test
            raise OptConfigError(
                f"{source}: {str(existing)!r} is a symbolic link to {os.readlink(existing)!r}, which does not exist "
                f"(a dangling link); create its target folder, remove the link, or give another folder")
        existing = existing.parent
    if not existing.is_dir():
        raise OptConfigError(f"{source}: {str(existing)!r} is not a folder, so {path!r} cannot be created")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise OptConfigError(f"{source}: the folder {str(existing)!r} is not writable")


def truncated_shared_object(path: Path) -> bool:
    """True for a compiled ``.so`` or ``.o`` that cannot be whole: not an ELF file, or shorter than the
    program and section header tables its own ELF header places (the section table ends the file, so a
    cut copy always fails this). Only on Linux, where inductor writes ELF; elsewhere nothing is judged damaged."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        with path.open("rb") as file:
            header = file.read(64)
            size = os.fstat(file.fileno()).st_size
    except OSError:
        return True
    if len(header) < 52 or header[:4] != b"\x7fELF" or header[4] not in (1, 2) or header[5] not in (1, 2):
        return True
    order = "<" if header[5] == 1 else ">"
    if header[4] == 2:  # 64-bit
        if len(header) < 64:
            return True
        (program_at, sections_at), sizes = struct.unpack(order + "QQ", header[32:48]), header[54:62]
    else:
        (program_at, sections_at), sizes = struct.unpack(order + "II", header[28:36]), header[42:50]
    program_entry, program_count, section_entry, section_count = struct.unpack(order + "HHHH", sizes)
    end = max(int(program_at) + int(program_entry) * int(program_count),
              int(sections_at) + int(section_entry) * int(section_count))
    return end > size


def remove_damaged_entries(inductor_dir: Path) -> list[Path]:
    """Remove every truncated compiled ``.so`` (and ``.o``, which inductor links into one) under
    ``inductor_dir`` with its C++ source (a cut source would fail to compile again), so inductor rebuilds
    them: the entries removed."""
    removed = []
    for library in sorted([*inductor_dir.rglob("*.so"), *inductor_dir.rglob("*.o")]):
        if library.is_file() and not library.is_symlink() and truncated_shared_object(library):
            for path in (library, library.with_suffix(".cpp")):
                try:
                    path.unlink()
                except FileNotFoundError:
                    pass
            removed.append(library)
    return removed


def compile_cache_state(hits: int, misses: int) -> str | None:
    """A test's compilation from its cache lookups: warm (all hit), cold (all missed), partial, or None
    (it compiled nothing)."""
    if hits <= 0 and misses <= 0:
        return None
    if misses <= 0:
        return "warm"
    return "cold" if hits <= 0 else "partial"


class CompileCache:
    """One session's use of the cache folder: ``install`` before torch compiles anything, ``save`` and
    ``uninstall`` at the session's end."""

    def __init__(self, root: str, key: CacheKey, process: str = "main") -> None:
        self.root = Path(root)
        self.key = key
        self.folder = self.root / key.folder_name()
        self.process = re.sub(r"[^A-Za-z0-9_-]+", "-", process) or "main"
        self.stale = False  # the subfolder's manifest did not match its key (broken or edited): emptied
        self.removed: list[Path] = []  # damaged compiled entries removed at install (each compiles again)
        self._previous: dict[str, str | None] = {}
        self._previous_headers: str | None = None

    @property
    def inductor_dir(self) -> Path:
        return self.folder / "inductor"

    @property
    def artifacts_dir(self) -> Path:
        return self.folder / "artifacts"

    @property
    def headers_dir(self) -> Path:
        return self.inductor_dir / "precompiled_headers"

    def install(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        self._check_manifest()
        self.inductor_dir.mkdir(exist_ok=True)
        self.artifacts_dir.mkdir(exist_ok=True)
        self.removed = remove_damaged_entries(self.inductor_dir)
        if self.removed:
            shown = ", ".join(str(path.relative_to(self.inductor_dir)) for path in self.removed[:3])
            more = f" and {len(self.removed) - 3} more" if len(self.removed) > 3 else ""
            say(f"compile cache {self.folder}: removed {len(self.removed)} damaged compiled "
                f"entr{'y' if len(self.removed) == 1 else 'ies'} (truncated: {shown}{more}); they compile again")
        values = {"TORCHINDUCTOR_CACHE_DIR": str(self.inductor_dir), "TORCHINDUCTOR_FX_GRAPH_CACHE": "1",
                  "TORCHINDUCTOR_AUTOGRAD_CACHE": "1"}
        for name in CACHE_VARIABLES:
            self._previous[name] = os.environ.get(name)
            os.environ[name] = values[name]
        enable_compile_caches()
        self._previous_headers = set_precompiled_header_dir(str(self.headers_dir))
        for path in sorted(self.artifacts_dir.glob("*.bin")):  # each xdist worker saved its own
            if path.is_file() and path.stat().st_size <= MAX_ARTIFACT_BYTES:
                load_compile_artifacts(path.read_bytes())  # one torch cannot read is skipped

    def _check_manifest(self) -> None:
        """The subfolder is the key's: its manifest says so, or it is new. One that says otherwise (or
        cannot be read) is emptied rather than trusted."""
        path = self.folder / MANIFEST
        expected = {"format": MANIFEST_FORMAT, "key": asdict(self.key)}
        if path.exists():
            try:
                manifest = read_json(path, what="the compile cache manifest", max_bytes=MAX_MANIFEST_BYTES,
                                     max_depth=4, max_items=64)
            except OptConfigError:
                manifest = None
            if isinstance(manifest, dict) and {k: manifest.get(k) for k in expected} == expected:
                return
            self.stale = True
            self._empty()
        write_atomic(path, json.dumps({**expected, "written_by": "pytest-transformers-opt"}, indent=2) + "\n")

    def _empty(self) -> None:
        import shutil

        for child in self.folder.iterdir():
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child)
            else:
                child.unlink()

    def save(self) -> Path | None:
        """Write this process's portable artifacts (every graph it compiled or loaded); None when torch
        has no such API or nothing was compiled, and the earlier file is kept."""
        data = save_compile_artifacts()
        if not data:
            return None
        path = self.artifacts_dir / f"{self.process}.bin"
        try:
            write_atomic(path, data)
        except OSError as exc:  # a full disk must not end the session: the inductor folder holds the graphs too
            sys.stderr.write(f"transformers-opt: could not save the compile cache artifacts to {path}: {exc}\n")
            return None
        return path

    def uninstall(self) -> None:
        """The variables as they were before ``install`` (an in-process pytest run must not leak them)."""
        for name, value in self._previous.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        self._previous = {}
        if self._previous_headers is not None:
            set_precompiled_header_dir(self._previous_headers)
            self._previous_headers = None
