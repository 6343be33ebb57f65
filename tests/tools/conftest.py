"""The tool tests serve through the frontend tests' engine client and check arguments with
the structured-output tests' schema checker."""

from __future__ import annotations

import sys
from pathlib import Path

TESTS = Path(__file__).parents[1]
sys.path.insert(0, str(TESTS / "frontend"))  # local_client
sys.path.insert(0, str(TESTS / "structured"))  # schema_check
