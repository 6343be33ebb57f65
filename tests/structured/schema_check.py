"""A JSON-schema conformance check for the keywords the structured tests use (no jsonschema
package here): type, properties, required, additionalProperties, enum, const, items,
minItems, maxItems, minimum, maximum, minLength, maxLength, anyOf."""

from __future__ import annotations

TYPES = {
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
}


def violations(value, schema: dict, path: str = "$") -> list[str]:
    """Every way `value` breaks `schema` (empty when it conforms)."""
    out: list[str] = []
    if "anyOf" in schema:
        if all(violations(value, s, path) for s in schema["anyOf"]):
            out.append(f"{path}: matches no anyOf branch")
        return out
    kind = schema.get("type")
    if kind is not None and not TYPES[kind](value):
        return [f"{path}: {value!r} is not {kind}"]
    if "enum" in schema and value not in schema["enum"]:
        out.append(f"{path}: {value!r} not in enum")
    if "const" in schema and value != schema["const"]:
        out.append(f"{path}: {value!r} is not the const")
    if isinstance(value, dict):
        props = schema.get("properties", {})
        out += [f"{path}: missing {k}" for k in schema.get("required", []) if k not in value]
        for k, v in value.items():
            if k in props:
                out += violations(v, props[k], f"{path}.{k}")
            elif schema.get("additionalProperties", True) is False:
                out.append(f"{path}: extra property {k}")
    if isinstance(value, list):
        if len(value) < schema.get("minItems", 0):
            out.append(f"{path}: fewer than minItems")
        if len(value) > schema.get("maxItems", len(value)):
            out.append(f"{path}: more than maxItems")
        out += [
            e
            for i, v in enumerate(value)
            for e in violations(v, schema.get("items", {}), f"{path}[{i}]")
        ]
    low, high = schema.get("minLength", 0), schema.get("maxLength")
    if isinstance(value, str) and not low <= len(value) <= (len(value) if high is None else high):
        out.append(f"{path}: length {len(value)} out of bounds")
    low, high = schema.get("minimum"), schema.get("maximum")
    if TYPES["number"](value) and (
        (low is not None and value < low) or (high is not None and value > high)
    ):
        out.append(f"{path}: {value} out of range")
    return out
