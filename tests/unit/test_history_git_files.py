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
