"""shoal's distributed runtime: endpoint addressing, discovery, request plane and event plane."""

from shoal.runtime.addressing import EndpointAddress
from shoal.runtime.discovery import (
    DirectoryDiscovery,
    Discovery,
    EtcdDiscovery,
    InstanceEvent,
    MemoryDiscovery,
    make_discovery,
)
from shoal.runtime.distributed import DistributedRuntime, ServedEndpoint
from shoal.runtime.endpoint_client import EndpointClient
from shoal.runtime.errors import (
    BadRequestError,
    DiscoveryError,
    EndpointNotFoundError,
    HandlerError,
    InstanceUnavailableError,
    NoInstancesError,
    OverloadedError,
    RemoteError,
    RuntimePlaneError,
    StreamTimeoutError,
    UnauthorizedError,
    WorkerLostError,
)
from shoal.runtime.event_plane import Event, EventPublisher, EventSubscriber
from shoal.runtime.request_client import RequestClient, ResponseStream
from shoal.runtime.request_server import Handler, PushHandler, RequestServer, StreamSink

__all__ = [
    "BadRequestError",
    "DirectoryDiscovery",
    "Discovery",
    "DiscoveryError",
    "DistributedRuntime",
    "EndpointAddress",
    "EndpointClient",
    "EndpointNotFoundError",
    "EtcdDiscovery",
    "Event",
    "EventPublisher",
    "EventSubscriber",
    "Handler",
    "HandlerError",
    "InstanceEvent",
    "InstanceUnavailableError",
    "MemoryDiscovery",
    "NoInstancesError",
    "OverloadedError",
    "PushHandler",
    "RemoteError",
    "RequestClient",
    "RequestServer",
    "ResponseStream",
    "RuntimePlaneError",
    "ServedEndpoint",
    "StreamSink",
    "StreamTimeoutError",
    "UnauthorizedError",
    "WorkerLostError",
    "make_discovery",
]
