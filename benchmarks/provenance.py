"""Which code a benchmark record came from: the commit, and whether the tree differed from it.

Every script that appends to benchmarks/results/ stamps its records with `provenance()`:

- in a git checkout, `commit` is HEAD's short sha and `dirty` says whether `git status`
  shows changes to tracked files outside benchmarks/results/; a dirty run is labelled
  "<sha>+dirty", never as the commit alone, and `commit_source` is "git";
- SHOAL_COMMIT, where given in a checkout, must name HEAD and the tree must be clean, or
  the run stops with an error naming the variable;
- on a machine without git (the GPU machine gets a copy of the tree, not the repository),
  SHOAL_COMMIT is trusted as given and recorded with `commit_source` "env" (a label ending
  in "+dirty" records `dirty` true); without it the commit is "unknown".

    .venv/bin/python benchmarks/provenance.py   # the label a run from this tree gets
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENV = "SHOAL_COMMIT"
RESULTS_PREFIX = "benchmarks/results/"
DIRTY = "+dirty"


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


def main() -> int:
    """Print this tree's provenance as JSON; exit 1 when SHOAL_COMMIT is refused."""
    try:
        print(json.dumps(provenance()))
    except ProvenanceError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
