"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with an HTTP status."""

from __future__ import annotations

import logging

import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

log = logging.getLogger(__name__)


class APIError(Exception):
    """An error the API reports to the client; raised anywhere below a route."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> Response:
        return Response(
            msgspec.json.encode(self.body()),
            status_code=self.status,
            media_type="application/json",
        )


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def model_not_found(model: str) -> APIError:
    return APIError(
        404, f"The model '{model}' does not exist", param="model", code="model_not_found"
    )


def request_too_large(limit: int) -> APIError:
    return APIError(
        413,
        f"The request body is larger than this server's limit of {limit} bytes",
        code="request_too_large",
    )


class BodyTooLarge(StarletteHTTPException):
    """Raised while a body is read past the limit; FastAPI passes HTTPExceptions through."""

    def __init__(self, limit: int) -> None:
        super().__init__(413)
        self.error = request_too_large(limit)


def unauthorized() -> APIError:
    return APIError(401, "Incorrect or missing API key", code="invalid_api_key")


def too_many_requests(limit: int) -> APIError:
    return APIError(
        429,
        f"The server is at its limit of {limit} concurrent requests; retry later",
        type="rate_limit_error",
        code="rate_limit_exceeded",
    )


RETRY_AFTER_S = 1  # the Retry-After a client gets while no worker can take its request


class RetryLater(APIError):
    """An APIError whose answer carries a Retry-After header (503, 429)."""

    def response(self) -> Response:
        answer = super().response()
        answer.headers["Retry-After"] = str(RETRY_AFTER_S)
        return answer


def no_worker(model: str) -> APIError:
    """A model the frontend knows has no worker that can take a request now."""
    return RetryLater(
        503,
        f"No worker is serving the model '{model}' right now",
        type="service_unavailable_error",
        code="no_worker_available",
    )


def queue_full(model: str) -> APIError:
    """Every worker of the model stayed at its limit (shoal.frontend.engine_client.QueueFull)."""
    return RetryLater(
        429,
        f"Every worker of the model '{model}' is at its limit; retry later",
        type="rate_limit_error",
        code="queue_full",
    )


def worker_failed(message: str) -> APIError:
    return APIError(502, f"The worker failed: {message}", type="server_error", code="worker_failed")


def internal_error() -> APIError:
    return APIError(500, "Internal server error", type="server_error", code="internal_error")


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict"})


def _param(loc: tuple) -> str | None:
    """Dotted field path of a pydantic error location ('messages.0.role').

    The leading 'body' goes, and so does everything from the first union-member tag on
    (pydantic writes e.g. ('body', 'prompt', 'list[str]', 0) for a union field).
    """
    parts = []
    for p in loc[1:] if loc[:1] == ("body",) else loc:
        if isinstance(p, str) and (not p.isidentifier() or p in _TYPE_TAGS):
            break
        parts.append(str(p))
    return ".".join(parts) or None


def validation_error(exc: RequestValidationError) -> APIError:
    """The first invalid field as a 400 naming it.

    A union field fails once per member; the member that got deepest into the value is the
    one the client meant (a list of content parts, not a string), so its problem is told.
    """
    errors = exc.errors()
    if not errors:
        return bad_request("Invalid request")
    first = errors[0]
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        return bad_request(f"Invalid JSON body: {detail}".rstrip(": "))
    param = _param(tuple(first.get("loc", ())))
    same_field = [e for e in errors if _param(tuple(e.get("loc", ()))) == param]
    deepest = max(same_field, key=lambda e: len(e.get("loc", ())))
    message = deepest.get("msg", "Invalid value")
    return bad_request(f"{param or 'request body'}: {message}", param=param)


def error_response(exc: Exception, path: str) -> Response:
    """The answer to an exception raised while serving `path`, in OpenAI's JSON shape
    (validation errors as 400, not 422); an unexpected one is logged and answered 500."""
    if isinstance(exc, APIError):
        return exc.response()
    if isinstance(exc, RequestValidationError):
        return validation_error(exc).response()
    if isinstance(exc, BodyTooLarge):
        return exc.error.response()
    if isinstance(exc, StarletteHTTPException):
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return APIError(exc.status_code, str(exc.detail), type=kind).response()
    log.exception("unhandled error on %s", path, exc_info=exc)
    return internal_error().response()


def install_error_handlers(app: FastAPI) -> None:
    """Every error leaves the app as error_response answers it."""

    async def on_error(request: Request, exc: Exception) -> Response:
        return error_response(exc, request.url.path)

    for kind in (APIError, RequestValidationError, StarletteHTTPException, Exception):
        app.add_exception_handler(kind, on_error)
