"""The history's commit where git is not installed: read from .git's own files, through limits."""

from __future__ import annotations

from pathlib import Path

import pytest

from pytest_transformers_opt.report import history

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def no_git(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(args: object, cwd: object) -> str:
        raise FileNotFoundError(2, "No such file or directory: 'git'")

    monkeypatch.setattr(history, "_git", missing)


def _checkout(root: Path, head: str) -> Path:
    (root / ".git" / "refs" / "heads").mkdir(parents=True)
    (root / ".git" / "HEAD").write_text(head)
    (root / "sub").mkdir()
    return root / "sub"


def test_a_branch_a_packed_ref_and_a_detached_head(tmp_path: Path, no_git: None) -> None:
    inside = _checkout(tmp_path / "a", "ref: refs/heads/main\n")
    (tmp_path / "a" / ".git" / "refs" / "heads" / "main").write_text(COMMIT + "\n")
    assert history.git_commit(inside) == (COMMIT[:7], False)  # found from a folder below the checkout
    packed = _checkout(tmp_path / "b", "ref: refs/heads/dev\n")
    (tmp_path / "b" / ".git" / "packed-refs").write_text(f"# pack-refs with: peeled\n{COMMIT} refs/heads/dev\n")
    assert history.git_commit(packed) == (COMMIT[:7], False)
    detached = _checkout(tmp_path / "c", COMMIT + "\n")
    assert history.git_commit(detached) == (COMMIT[:7], False)
    unborn = _checkout(tmp_path / "d", "ref: refs/heads/main\n")
    assert history.git_commit(unborn) == (None, False)


def test_crafted_git_files_give_no_commit(tmp_path: Path, no_git: None) -> None:
    huge = _checkout(tmp_path / "a", "ref: refs/heads/main\n" + "x" * (history.GIT_FILE_BYTES + 1))
    assert history.git_commit(huge) == (None, False)  # over the limit: not read whole
    not_hex = _checkout(tmp_path / "b", "not a commit\n")
    assert history.git_commit(not_hex) == (None, False)
    binary = _checkout(tmp_path / "c", "ref: refs/heads/main\n")
    (tmp_path / "c" / ".git" / "refs" / "heads" / "main").write_bytes(b"\xff\xfe" * 10)
    assert history.git_commit(binary) == (None, False)
    assert history.git_commit(tmp_path) == (None, False)  # outside any checkout


def test_a_future_dated_run_written_within_the_second_of_an_earlier_run_is_ordered_before_the_later_one(
        tmp_path: Path) -> None:
    """Names say the second, a file's mtime says the microsecond: a future-dated file written at 12:00:00.8, after
    ``...120000Z.json`` and before ``...120000Z_2.json`` (both named in that second), sits between them (CI found
    it after ``_2``: the name's 12:00:00.000 came before the mtime's 12:00:00.8)."""
    import datetime as dt
    import os

    now = dt.datetime.now(dt.timezone.utc).replace(microsecond=0) - dt.timedelta(seconds=30)
    stamp = now.strftime("%Y%m%dT%H%M%SZ")
    first, later, future = f"{stamp}.json", f"{stamp}_2.json", "20990105T100000Z.json"
    for name in (first, later, future):
        (tmp_path / name).write_text("{}")
    for name, after_us in ((first, 200_000), (future, 800_000), (later, 900_000)):  # as each was written
        written = (now + dt.timedelta(microseconds=after_us)).timestamp()
        os.utime(tmp_path / name, (written, written))
    assert [name.name for name in history.run_names(tmp_path)] == [first, future, later]
    assert [name.future for name in history.run_names(tmp_path)] == [False, True, False]


def test_within_one_second_a_future_dated_file_written_first_comes_first(tmp_path: Path) -> None:
    """A future-dated file written at 12:00:00.3, then a run named ``...120000Z.json`` written at 12:00:00.6: the
    name's second ties with the future file's, and the write times decide (the name alone put it first)."""
    import datetime as dt
    import os

    now = dt.datetime.now(dt.timezone.utc).replace(microsecond=0) - dt.timedelta(seconds=30)
    named, future = f"{now.strftime('%Y%m%dT%H%M%SZ')}.json", "20990105T100000Z.json"
    for name, after_us in ((future, 300_000), (named, 600_000)):
        (tmp_path / name).write_text("{}")
        written = (now + dt.timedelta(microseconds=after_us)).timestamp()
        os.utime(tmp_path / name, (written, written))
    assert [name.name for name in history.run_names(tmp_path)] == [future, named]
