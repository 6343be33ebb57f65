"""The structured-output tests serve through the frontend tests' engine client."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "frontend"))  # local_client
