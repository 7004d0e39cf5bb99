"""A load's checkpoint pages: what was mapped before it (read cheaply from /proc/self/maps) and what it dropped after."""

from __future__ import annotations

import mmap
from pathlib import Path

import pytest

from pytest_transformers_opt.engine import measure

pytestmark = pytest.mark.skipif(not Path("/proc/self/smaps").is_file(), reason="needs Linux's /proc/self/smaps")
MIB = 2**20


def test_the_cheap_before_names_the_same_mappings_as_smaps(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"w" * MIB)
    with path.open("rb") as handle, mmap.mmap(handle.fileno(), 0, prot=mmap.PROT_READ) as mapped:
        assert set(measure.file_mappings()) == measure.mapped_files()
        assert any(key[2] == str(path) for key in measure.mapped_files())
        assert mapped[:1] == b"w"


def test_pages_mapped_after_the_before_are_dropped_and_a_written_copy_is_left_alone(tmp_path):
    read_only, written = tmp_path / "read.bin", tmp_path / "written.bin"
    read_only.write_bytes(b"r" * (4 * MIB))
    written.write_bytes(b"w" * (4 * MIB))
    with read_only.open("rb") as untouched:
        early = mmap.mmap(untouched.fileno(), 0, prot=mmap.PROT_READ)  # mapped before: not the load's
        assert early[:] == b"r" * (4 * MIB)
        before = measure.mapped_files()
        with read_only.open("rb") as a, written.open("rb") as b:
            read = mmap.mmap(a.fileno(), 0, prot=mmap.PROT_READ)
            copied = mmap.mmap(b.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            assert read[:] == b"r" * (4 * MIB)
            copied[0:1] = b"x"  # one private page: the mapping holds a write
            copied[:]

            released = measure.release_file_pages(before)

            after = {key[2]: value for key, value in measure.file_mappings().items() if key not in before}
            assert released >= 4 * MIB - 64 * 1024  # the read mapping's pages, all of them
            assert after[str(read_only)][0] == 0
            assert after[str(written)][0] >= 4 * MIB - 64 * 1024 and after[str(written)][1] > 0
            assert copied[:1] == b"x"  # the write survived
            read.close()
            copied.close()
        kept = {key[2]: value for key, value in measure.file_mappings().items() if key in before}
        assert kept[str(read_only)][0] >= 4 * MIB - 64 * 1024  # what was mapped before the load stays resident
        early.close()
