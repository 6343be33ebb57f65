"""Helpers shared with the KV tier and disaggregation tests."""

from __future__ import annotations

import sys
from pathlib import Path

TESTS = Path(__file__).parents[1]
sys.path.insert(0, str(TESTS / "kv_tiers"))  # tier_helpers
sys.path.insert(0, str(TESTS / "disagg"))  # transfer_helpers
