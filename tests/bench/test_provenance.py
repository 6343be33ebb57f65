"""benchmarks/provenance.py against a real temporary git repository."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from provenance import (
    ENV,
    TREE_ENV,
    ProvenanceError,
    commit_fingerprint,
    files_fingerprint,
    provenance,
)


def git(repo: Path, *args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=repo, check=True, capture_output=True, text=True
    ).stdout.strip()


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A repository with one commit: a source file and a results file."""
    git(tmp_path, "init", "-q")
    git(tmp_path, "config", "user.email", "t@example.com")
    git(tmp_path, "config", "user.name", "t")
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    (tmp_path / "code.py").write_text("x = 1\n")
    (tmp_path / "benchmarks" / "results" / "r.jsonl").write_text("{}\n")
    git(tmp_path, "add", ".")
    git(tmp_path, "commit", "-q", "-m", "first")
    return tmp_path


def test_clean_tree_is_labelled_with_head(repo: Path) -> None:
    short = git(repo, "rev-parse", "--short", "HEAD")
    assert provenance(repo, {}) == {"commit": short, "dirty": False, "commit_source": "git"}


def test_changed_tracked_file_labels_the_run_dirty(repo: Path) -> None:
    short = git(repo, "rev-parse", "--short", "HEAD")
    (repo / "code.py").write_text("x = 2\n")
    record = provenance(repo, {})
    assert record == {"commit": f"{short}+dirty", "dirty": True, "commit_source": "git"}


def test_staged_change_and_rename_are_dirty(repo: Path) -> None:
    git(repo, "mv", "code.py", "renamed.py")
    assert provenance(repo, {})["dirty"] is True


def test_results_and_untracked_files_do_not_make_it_dirty(repo: Path) -> None:
    (repo / "benchmarks" / "results" / "r.jsonl").write_text('{"new": 1}\n')
    (repo / "scratch.txt").write_text("not tracked\n")
    assert provenance(repo, {})["dirty"] is False


def test_env_commit_matching_head_on_clean_tree_is_accepted(repo: Path) -> None:
    full = git(repo, "rev-parse", "HEAD")
    short = git(repo, "rev-parse", "--short", "HEAD")
    for given in (full, full[:7], full[:10].upper()):
        assert provenance(repo, {ENV: given}) == {
            "commit": short,
            "dirty": False,
            "commit_source": "git",
        }


def test_env_commit_other_than_head_is_an_error(repo: Path) -> None:
    first = git(repo, "rev-parse", "HEAD")
    (repo / "code.py").write_text("x = 3\n")
    git(repo, "commit", "-q", "-am", "second")
    with pytest.raises(ProvenanceError, match=ENV):
        provenance(repo, {ENV: first[:7]})
    with pytest.raises(ProvenanceError, match=ENV):
        provenance(repo, {ENV: "abc"})


def test_env_commit_on_dirty_tree_is_an_error(repo: Path) -> None:
    head = git(repo, "rev-parse", "HEAD")
    (repo / "code.py").write_text("x = 4\n")
    with pytest.raises(ProvenanceError, match=rf"{ENV}=.*code\.py"):
        provenance(repo, {ENV: head})


def test_without_git_env_commit_is_trusted_and_marked(tmp_path: Path) -> None:
    copy = tmp_path / "copy"  # a copy of a tree, as the GPU machine gets it: no .git
    copy.mkdir()
    assert provenance(copy, {ENV: "1234abc"}) == {
        "commit": "1234abc",
        "dirty": False,
        "commit_source": "env",
    }
    assert provenance(copy, {ENV: "1234abc+dirty"})["dirty"] is True
    assert provenance(copy, {}) == {"commit": "unknown", "dirty": None, "commit_source": "none"}


def commit_code_change(repo: Path, text: str) -> str:
    """Commit a change to shoal/mod.py (a code path the fingerprint covers); its sha."""
    (repo / "shoal").mkdir(exist_ok=True)
    (repo / "shoal" / "mod.py").write_text(text)
    git(repo, "add", ".")
    git(repo, "commit", "-q", "-m", text)
    return git(repo, "rev-parse", "HEAD")


def test_the_files_of_a_clean_checkout_have_its_commits_fingerprint(repo: Path) -> None:
    first = commit_code_change(repo, "a = 1\n")
    assert files_fingerprint(repo) == commit_fingerprint(repo)
    commit_code_change(repo, "a = 2\n")
    assert files_fingerprint(repo) == commit_fingerprint(repo) != commit_fingerprint(repo, first)
    (repo / "benchmarks" / "results" / "r.jsonl").write_text('{"run": 1}\n')
    (repo / "code.py").write_text("outside the code paths\n")
    assert files_fingerprint(repo) == commit_fingerprint(repo)


def test_a_copy_whose_repository_is_older_than_its_files_is_labelled_by_its_tree(
    repo: Path,
) -> None:
    """As a GPU machine's copy can be: the last landed commit's .git under newer files."""
    landed = commit_code_change(repo, "a = 1\n")
    newer = commit_code_change(repo, "a = 2\n")
    tree = commit_fingerprint(repo, newer)
    git(repo, "reset", "-q", landed)  # HEAD and index back, the files stay newer's
    (repo / "benchmarks" / "results" / "r.jsonl").write_text('{"run": 1}\n')
    assert provenance(repo, {})["commit"].endswith("+dirty")
    assert provenance(repo, {ENV: newer[:7], TREE_ENV: tree}) == {
        "commit": newer[:7],
        "dirty": False,
        "commit_source": "tree",
    }
    (repo / "shoal" / "mod.py").write_text("a = 3\n")  # not newer's code any more
    with pytest.raises(ProvenanceError, match=TREE_ENV):
        provenance(repo, {ENV: newer[:7], TREE_ENV: tree})
