"""Discovery through etcd v3, spoken over its JSON gateway (HTTP, base64 keys and values).

Each registration is a key `<prefix>namespace/component/endpoint/<instance_id>` holding the
InstanceRecord as JSON, attached to a lease of its own that a background task renews every
ttl/3. A crashed owner stops renewing and etcd deletes the key when the lease expires. If a
renewal finds the lease gone (etcd lost it, or this process was cut off for longer than the
TTL) the task grants a new lease and puts the key again. Watches stream changes from the
revision of an initial range read, and read again after any break, so a watcher that
reconnects after an etcd restart reports what changed meanwhile. A registration made while
etcd is unreachable (a worker started before etcd) is retried with backoff for up to
`register_timeout` seconds before it fails.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import math
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import httpx
import msgspec

from shoal.protocol import InstanceRecord
from shoal.runtime.addressing import EndpointAddress
from shoal.runtime.discovery.base import (
    DEFAULT_LEASE_TTL,
    Discovery,
    InstanceEvent,
    decode_record,
    diff,
    instance_path,
)
from shoal.runtime.errors import DiscoveryError

log = logging.getLogger(__name__)

DEFAULT_PREFIX = "shoal/instances/"
DEFAULT_REGISTER_TIMEOUT = 60.0
MAX_BACKOFF = 5.0
_ERRORS = (httpx.HTTPError, DiscoveryError, msgspec.DecodeError)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _record(kv: dict[str, Any]) -> InstanceRecord | None:
    """The record in an etcd key-value, or None (logged) if it is not one."""
    try:
        return decode_record(base64.b64decode(kv["value"]))
    except (msgspec.DecodeError, KeyError, ValueError) as exc:
        log.warning("ignoring malformed registration %s: %s", kv.get("key"), exc)
        return None


def _prefix_end(prefix: bytes) -> bytes:
    """The smallest key greater than every key starting with `prefix` (etcd's range_end)."""
    trimmed = prefix.rstrip(b"\xff")
    return trimmed[:-1] + bytes([trimmed[-1] + 1])


class _Registration:
    __slots__ = ("key", "lease", "task", "ttl", "value")

    def __init__(self, key: str, value: bytes, ttl: int) -> None:
        self.key = key
        self.value = value
        self.ttl = ttl
        self.lease = 0
        self.task: asyncio.Task[None] | None = None


class EtcdDiscovery(Discovery):
    """Discovery across machines through an etcd cluster (any of `urls` may answer)."""

    def __init__(
        self,
        urls: str | Sequence[str] = "http://127.0.0.1:2379",
        *,
        prefix: str = DEFAULT_PREFIX,
        timeout: float = 2.0,
        retry_interval: float = 0.25,
        register_timeout: float = DEFAULT_REGISTER_TIMEOUT,
    ) -> None:
        self._urls = [u.rstrip("/") for u in ([urls] if isinstance(urls, str) else urls)]
        if not self._urls:
            raise ValueError("EtcdDiscovery needs at least one URL")
        self._url_index = 0
        self.prefix = prefix
        self.retry_interval = retry_interval
        self.register_timeout = register_timeout
        self._timeout = timeout
        self._http = httpx.AsyncClient(timeout=timeout)
        self._own: dict[str, _Registration] = {}

    async def _call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST to the first reachable member; raises DiscoveryError on an etcd error."""
        content = msgspec.json.encode(body)
        error: Exception | None = None
        for _ in range(len(self._urls)):
            url = self._urls[self._url_index]
            try:
                response = await self._http.post(url + path, content=content)
            except httpx.TransportError as exc:
                error = exc
                self._url_index = (self._url_index + 1) % len(self._urls)
                continue
            if response.status_code != 200:
                raise DiscoveryError(f"etcd {path}: HTTP {response.status_code} {response.text}")
            reply = msgspec.json.decode(response.content)
            if "error" in reply:
                raise DiscoveryError(f"etcd {path}: {reply.get('message') or reply['error']}")
            return reply
        assert error is not None
        raise error

    def _key(self, record: InstanceRecord) -> str:
        return self.prefix + instance_path(record)

    async def _grant_and_put(self, reg: _Registration) -> None:
        granted = await self._call("/v3/lease/grant", {"TTL": reg.ttl})
        reg.lease = int(granted["ID"])
        reg.ttl = int(granted.get("TTL", reg.ttl))
        body = {"key": _b64(reg.key.encode()), "value": _b64(reg.value), "lease": reg.lease}
        await self._call("/v3/kv/put", body)

    async def register(self, record: InstanceRecord, ttl: float = DEFAULT_LEASE_TTL) -> None:
        key = self._key(record)
        await self._release(key)
        reg = _Registration(key, msgspec.json.encode(record), max(1, math.ceil(ttl)))
        await self._grant_and_put_retrying(reg)
        reg.task = asyncio.create_task(self._keep_alive(reg), name=f"etcd-keepalive {key}")
        self._own[key] = reg

    async def _grant_and_put_retrying(self, reg: _Registration) -> None:
        """_grant_and_put, retried with exponential backoff for up to register_timeout."""
        deadline = time.monotonic() + self.register_timeout
        delay = self.retry_interval
        attempt = 1
        while True:
            try:
                await self._grant_and_put(reg)
                if attempt > 1:
                    log.info("registered %s in etcd after %d attempts", reg.key, attempt)
                return
            except _ERRORS as exc:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise
                delay = min(delay, left)
                log.warning(
                    "etcd unreachable for registering %s (attempt %d, retrying in %.1fs, "
                    "%.0fs left): %s",
                    reg.key,
                    attempt,
                    delay,
                    left,
                    exc,
                )
                await asyncio.sleep(delay)
                delay = min(delay * 2, MAX_BACKOFF)
                attempt += 1

    async def _keep_alive(self, reg: _Registration) -> None:
        """Renew the lease every ttl/3; while etcd is unreachable, try every retry_interval,
        so that an etcd restarted without its data has the record back at once."""
        failing = False
        while True:
            await asyncio.sleep(self.retry_interval if failing else reg.ttl / 3)
            try:
                reply = await self._call("/v3/lease/keepalive", {"ID": reg.lease})
                if int(reply.get("result", {}).get("TTL", 0)) <= 0:
                    log.warning("etcd lease of %s is gone: registering again", reg.key)
                    await self._grant_and_put(reg)
                failing = False
            except _ERRORS as exc:
                if not failing:
                    log.warning("etcd keep-alive of %s failed (retrying): %s", reg.key, exc)
                failing = True

    async def unregister(self, record: InstanceRecord) -> None:
        await self._release(self._key(record))

    async def _release(self, key: str) -> None:
        reg = self._own.pop(key, None)
        if reg is None:
            return
        if reg.task is not None:
            reg.task.cancel()
            await asyncio.gather(reg.task, return_exceptions=True)
        try:
            await self._call("/v3/lease/revoke", {"ID": reg.lease})
        except _ERRORS as exc:  # the key still goes when the lease expires
            log.warning("etcd revoke of %s failed: %s", key, exc)

    def _range_of(self, endpoint: str | EndpointAddress) -> dict[str, str]:
        prefix = f"{self.prefix}{EndpointAddress.parse(endpoint).path}/".encode()
        return {"key": _b64(prefix), "range_end": _b64(_prefix_end(prefix))}

    async def _read(self, span: dict[str, str]) -> tuple[dict[str, InstanceRecord], int]:
        """Records under `span` by key, and the store revision they were read at."""
        reply = await self._call("/v3/kv/range", span)
        records = {}
        for kv in reply.get("kvs", ()):
            record = _record(kv)
            if record is not None:
                records[base64.b64decode(kv["key"]).decode()] = record
        return records, int(reply["header"]["revision"])

    async def list(self, endpoint: str | EndpointAddress) -> list[InstanceRecord]:
        records, _ = await self._read(self._range_of(endpoint))
        return list(records.values())

    async def watch(self, endpoint: str | EndpointAddress) -> AsyncIterator[InstanceEvent]:
        span = self._range_of(endpoint)
        known: dict[str, InstanceRecord] = {}
        while True:
            try:
                current, revision = await self._read(span)
                for event in diff(known, current):
                    yield event
                async with contextlib.aclosing(self._follow(span, revision + 1, known)) as events:
                    async for event in events:
                        yield event
            except _ERRORS as exc:
                log.info("etcd watch interrupted (reconnecting): %s", exc)
            await asyncio.sleep(self.retry_interval)

    async def _follow(
        self, span: dict[str, str], start: int, known: dict[str, InstanceRecord]
    ) -> AsyncIterator[InstanceEvent]:
        """Events of one watch stream from revision `start`; returns when it must resync."""
        body = msgspec.json.encode({"create_request": {**span, "start_revision": start}})
        url = self._urls[self._url_index] + "/v3/watch"
        timeout = httpx.Timeout(self._timeout, read=None)
        async with self._http.stream("POST", url, content=body, timeout=timeout) as response:
            async for line in response.aiter_lines():
                if not line:
                    continue
                message = msgspec.json.decode(line)
                if "error" in message:
                    raise DiscoveryError(f"etcd watch: {message['error']}")
                result = message.get("result", {})
                if result.get("canceled") or result.get("compact_revision"):
                    return
                for change in result.get("events", ()):
                    kv = change["kv"]
                    key = base64.b64decode(kv["key"]).decode()
                    if change.get("type") == "DELETE":
                        gone = known.pop(key, None)
                        if gone is not None:
                            yield InstanceEvent("removed", gone)
                    else:
                        record = _record(kv)
                        if record is not None and known.get(key) != record:
                            known[key] = record
                            yield InstanceEvent("added", record)

    async def close(self) -> None:
        for key in list(self._own):
            await self._release(key)
        await self._http.aclose()
