"""A generation request's JSON body, read and validated as a FastAPI body parameter is.

The generation routes are plain Starlette routes: FastAPI's per-request machinery
(dependency solving, its handler's wrappers) cost 0.01-0.46 ms of a request's TTFT at low
load (docs/serving.md). The errors stay FastAPI's own (RequestValidationError, locations
from "body"), so the app answers them with the same 400s.
"""

from __future__ import annotations

import contextlib
import json
from typing import Any, TypeVar

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import Request

M = TypeVar("M", bound=BaseModel)


def _is_json(content_type: str | None) -> bool:
    """application/json or application/*+json; a body without a Content-Type is not parsed
    as JSON (FastAPI's strict content type: a guard against cross-site requests)."""
    if not content_type:
        return False
    main, _, sub = content_type.split(";", 1)[0].strip().lower().partition("/")
    return main == "application" and (sub == "json" or sub.endswith("+json"))


async def parse_body(request: Request, model: type[M]) -> M:
    """`model` from the request's body; an empty, malformed or invalid body raises
    RequestValidationError, one that cannot be read or decoded at all a 400 HTTPException.

    A JSON body is validated straight from its bytes first (one pass, no dicts in between:
    0.07 against 0.11 ms for a short completion request at low load, where the code runs
    cold); a body that fails it is taken again the long way, for FastAPI's own errors.
    """
    try:
        raw = await request.body()
        is_json = bool(raw) and _is_json(request.headers.get("content-type"))
        if is_json:
            with contextlib.suppress(ValidationError):
                return model.model_validate_json(raw)
        data: Any = json.loads(raw) if is_json else raw
    except json.JSONDecodeError as e:
        error = {
            "type": "json_invalid",
            "loc": ("body", e.pos),
            "msg": "JSON decode error",
            "input": {},
            "ctx": {"error": e.msg},
        }
        raise RequestValidationError([error]) from None
    except HTTPException:  # the body over its size limit
        raise
    except Exception:  # not text, nested too deep, the client gone: as FastAPI answers
        raise HTTPException(400, "There was an error parsing the body") from None
    if not raw:
        missing = {"type": "missing", "loc": ("body",), "msg": "Field required", "input": None}
        raise RequestValidationError([missing])
    try:
        return model.model_validate(data, from_attributes=True)  # as FastAPI validates bodies
    except ValidationError as e:
        errors = [{**error, "loc": ("body", *error["loc"])} for error in e.errors()]
        raise RequestValidationError(errors) from None
