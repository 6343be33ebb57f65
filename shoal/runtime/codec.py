"""Shared msgpack encoder and cached typed decoders (msgspec; never pickle)."""

from __future__ import annotations

import functools
from typing import Any

import msgspec

ENCODER = msgspec.msgpack.Encoder()


@functools.cache
def decoder(message_type: Any) -> msgspec.msgpack.Decoder:
    """The msgpack decoder for `message_type`, built once per type."""
    return msgspec.msgpack.Decoder(message_type)
