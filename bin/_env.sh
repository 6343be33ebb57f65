# Sourced by bin/shoal and bin/test: make .venv with shoal installed, once per pyproject change.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${SHOAL_VENV:-$ROOT/.venv}"
# torch first, pinned: an unpinned requirement would pull a multi-GB CUDA build where a CPU
# wheel is at hand. On a GPU machine set SHOAL_TORCH_SPEC=torch (or a CUDA index's build).
TORCH_SPEC="${SHOAL_TORCH_SPEC:-torch==2.13.0}"

shoal_bootstrap() {
  local extras="$1"
  local stamp="$VENV/.shoal-$(cat "$ROOT/pyproject.toml" | sha1sum | cut -c1-12)-$extras"
  [ -f "$stamp" ] && return 0
  echo "shoal: setting up $VENV (first use)..." >&2
  [ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip >&2
  "$VENV/bin/python" -c "import torch" 2>/dev/null || "$VENV/bin/python" -m pip install -q "$TORCH_SPEC" >&2
  "$VENV/bin/python" -m pip install -q -e "$ROOT${extras:+[$extras]}" >&2
  touch "$stamp"
}
