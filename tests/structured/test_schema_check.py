"""The tests' own schema checker rejects what it must (so a pass of the constraint tests means
something)."""

from schema_check import violations

SCHEMA = {
    "type": "object",
    "properties": {
        "n": {"type": "integer", "minimum": 0, "maximum": 9},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
        "name": {"type": "string", "maxLength": 3},
    },
    "required": ["n", "tags"],
    "additionalProperties": False,
}


def test_conforming_value_passes():
    assert violations({"n": 3, "tags": ["a"], "name": "xy"}, SCHEMA) == []


def test_each_breach_is_reported():
    bad = [
        {"tags": []},
        {"n": 10, "tags": []},
        {"n": 1.5, "tags": []},
        {"n": 1, "tags": ["c"]},
        {"n": 1, "tags": ["a", "a", "b"]},
        {"n": 1, "tags": [], "name": "long"},
        {"n": 1, "tags": [], "extra": 0},
        ["n"],
    ]
    for value in bad:
        assert violations(value, SCHEMA), value
