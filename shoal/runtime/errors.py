"""Typed errors the runtime raises to its callers."""

from __future__ import annotations


class RuntimePlaneError(Exception):
    """Base of every error the distributed runtime raises."""


class WorkerLostError(RuntimePlaneError):
    """The worker serving a stream died or became unreachable before the stream ended.

    The request may be retried on another instance (request migration).
    """

    def __init__(self, address: str, reason: str) -> None:
        super().__init__(f"worker at {address} lost: {reason}")
        self.address = address
        self.reason = reason


class StreamTimeoutError(WorkerLostError):
    """No response came on a stream within its next-response deadline; it was cancelled.

    The worker may be alive (its connection stays open), but this request made no progress:
    like any WorkerLostError, the request may move to another instance.
    """


class RemoteError(RuntimePlaneError):
    """The worker answered a stream with an error; `code` says which kind."""

    code = "handler"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class HandlerError(RemoteError):
    """The endpoint's handler raised an exception."""

    code = "handler"


class EndpointNotFoundError(RemoteError):
    """The worker does not serve the requested endpoint."""

    code = "no_endpoint"


class BadRequestError(RemoteError):
    """The worker could not decode the request as the endpoint's request type."""

    code = "bad_request"


class OverloadedError(RemoteError):
    """The worker already runs its maximum number of concurrent streams."""

    code = "overloaded"


class UnauthorizedError(RemoteError):
    """The worker refused a message that did not carry a valid MAC of the plane secret."""

    code = "unauthorized"


class InstanceUnavailableError(RuntimePlaneError):
    """Raised by a handler whose instance can serve nothing more (say, its engine died).

    The server ends the stream as it does on shutdown, so the client sees WorkerLostError
    and the request may move to another instance.
    """


class NoInstancesError(RuntimePlaneError):
    """No instance of an endpoint is known (or appeared in time)."""


_REMOTE_ERRORS: dict[str, type[RemoteError]] = {
    cls.code: cls
    for cls in (
        HandlerError,
        EndpointNotFoundError,
        BadRequestError,
        OverloadedError,
        UnauthorizedError,
    )
}


# The code a server sends when it stops streams because it is shutting down; the client turns
# it into WorkerLostError so the request can move to another instance.
SHUTDOWN_CODE = "shutdown"


def remote_error(address: str, code: str, message: str) -> RuntimePlaneError:
    """The exception for a StreamError from the worker at `address`."""
    if code == SHUTDOWN_CODE:
        return WorkerLostError(address, message)
    return _REMOTE_ERRORS.get(code, HandlerError)(message)


class DiscoveryError(RuntimePlaneError):
    """A discovery backend refused an operation (e.g. etcd answered with an error)."""
