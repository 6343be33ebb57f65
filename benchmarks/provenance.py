"""Which code a benchmark record came from: the commit, and whether the tree differed from it.

Every script that appends to benchmarks/results/ stamps its records with `provenance()`:

- in a git checkout, `commit` is HEAD's short sha and `dirty` says whether `git status`
  shows changes to tracked files outside benchmarks/results/; a dirty run is labelled
  "<sha>+dirty", never as the commit alone, and `commit_source` is "git";
- SHOAL_COMMIT, where given in a checkout, must name HEAD and the tree must be clean, or
  the run stops with an error naming the variable;
- on a machine without git (the GPU machine gets a copy of the tree, not the repository),
  SHOAL_COMMIT is trusted as given and recorded with `commit_source` "env" (a label ending
  in "+dirty" records `dirty` true); without it the commit is "unknown";
- on a copy whose repository is older than its files (a GPU machine's copy can carry the
  last landed commit's .git under a newer tree), SHOAL_COMMIT is accepted on the dirty
  tree when SHOAL_TREE, given with it, is the fingerprint of the code the files hold: the
  run is labelled SHOAL_COMMIT, not dirty, with `commit_source` "tree". The fingerprint
  covers what a benchmark runs (CODE_PATHS: shoal/, benchmarks/ outside results/,
  pyproject.toml): a hash over each file's path and git blob hash, taken from a commit
  where the commit exists and from the files on disk where it may not.

    .venv/bin/python benchmarks/provenance.py          # the label a run from this tree gets
    .venv/bin/python benchmarks/provenance.py --tree   # SHOAL_COMMIT=... SHOAL_TREE=... of HEAD
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENV = "SHOAL_COMMIT"
TREE_ENV = "SHOAL_TREE"
RESULTS_PREFIX = "benchmarks/results/"
DIRTY = "+dirty"
CODE_PATHS = ("shoal", "benchmarks", "pyproject.toml")  # what the tree fingerprint covers


class ProvenanceError(RuntimeError):
    """SHOAL_COMMIT names another commit than HEAD, or was given on a dirty tree."""


def _git(root: Path, *args: str) -> str | None:
    """The output of `git args` in `root`, or None where git or the repository is missing."""
    try:
        out = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return out.stdout


def changed_files(root: Path) -> list[str]:
    """Tracked files whose content differs from HEAD (staged or not), outside results/."""
    status = _git(root, "status", "--porcelain", "-z", "--untracked-files=no") or ""
    entries = iter(status.split("\0"))
    paths = []
    for entry in entries:
        if not entry:
            continue
        code, path = entry[:2], entry[3:]
        paths.append(path)
        if "R" in code or "C" in code:  # a rename or copy: the source path follows
            paths.append(next(entries, ""))
    return [p for p in paths if p and not p.startswith(RESULTS_PREFIX)]


def _fingerprint(blobs: list[tuple[str, str]]) -> str:
    """A hash over (path, blob hash) pairs of the code paths, results left out."""
    digest = hashlib.sha1()
    for path, blob in sorted(blobs):
        if not path.startswith(RESULTS_PREFIX):
            digest.update(f"{path}\0{blob}\n".encode())
    return digest.hexdigest()


def commit_fingerprint(root: Path, commit: str = "HEAD") -> str:
    """The tree fingerprint of a commit's code (see the module docstring)."""
    listing = _git(root, "ls-tree", "-r", "-z", commit, "--", *CODE_PATHS)
    if listing is None:
        raise ProvenanceError(f"no commit {commit} in {root}")
    blobs = []
    for entry in filter(None, listing.split("\0")):
        meta, path = entry.split("\t", 1)
        blobs.append((path, meta.split()[2]))
    return _fingerprint(blobs)


def files_fingerprint(root: Path) -> str | None:
    """The tree fingerprint of the code on disk: the code paths' files that git tracks or
    does not ignore; None where git is missing."""
    listing = _git(root, "ls-files", "-z", "-c", "-o", "--exclude-standard", "--", *CODE_PATHS)
    if listing is None:
        return None
    paths = sorted({p for p in listing.split("\0") if p and (root / p).is_file()})
    hashed = _git(root, "hash-object", "--no-filters", "--", *paths) if paths else ""
    if hashed is None:
        return None
    return _fingerprint(list(zip(paths, hashed.split(), strict=True)))


def provenance(root: Path = ROOT, env: Mapping[str, str] | None = None) -> dict:
    """`commit`, `dirty` and `commit_source` for a run of the code in `root`."""
    env = os.environ if env is None else env
    given = env.get(ENV, "").strip()
    head = (_git(root, "rev-parse", "HEAD") or "").strip()
    if not head:
        if given:
            return {"commit": given, "dirty": given.endswith(DIRTY), "commit_source": "env"}
        return {"commit": "unknown", "dirty": None, "commit_source": "none"}
    short = (_git(root, "rev-parse", "--short", "HEAD") or head).strip()
    changed = changed_files(root)
    if given:
        tree = env.get(TREE_ENV, "").strip()
        if changed and tree:
            if tree != files_fingerprint(root):
                raise ProvenanceError(
                    f"{TREE_ENV}={tree} is not the fingerprint of the code in {root}: "
                    f"the files are not {given}'s"
                )
            return {"commit": given, "dirty": False, "commit_source": "tree"}
        if changed:
            raise ProvenanceError(
                f"{ENV}={given} given on a tree with uncommitted changes to "
                f"{', '.join(changed[:5])}{' ...' if len(changed) > 5 else ''}: commit them, "
                f"or unset {ENV} to record the run as {short}{DIRTY}"
            )
        if len(given) < 7 or not head.startswith(given.lower()):
            raise ProvenanceError(
                f"{ENV}={given} is not HEAD ({short}): unset it or check out {given}"
            )
    label = short + (DIRTY if changed else "")
    return {"commit": label, "dirty": bool(changed), "commit_source": "git"}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--tree",
        action="store_true",
        help=f"print HEAD's {ENV} and {TREE_ENV}, for a run on a copy of this tree",
    )
    return p


def main() -> int:
    """Print this tree's provenance as JSON (--tree: HEAD's SHOAL_COMMIT and SHOAL_TREE);
    exit 1 when SHOAL_COMMIT is refused."""
    args = build_parser().parse_args()
    try:
        if args.tree:
            short = (_git(ROOT, "rev-parse", "--short", "HEAD") or "").strip()
            print(f"{ENV}={short} {TREE_ENV}={commit_fingerprint(ROOT)}")
            return 0
        print(json.dumps(provenance()))
    except ProvenanceError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
