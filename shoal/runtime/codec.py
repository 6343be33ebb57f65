"""Shared msgpack encoder and cached typed decoders (msgspec; never pickle).

Beyond msgspec's own types they carry packed token ids (array.array of u32, a field typed
`array`) as one msgpack bin: shoal.protocol.pack_token_ids.
"""

from __future__ import annotations

import functools
from array import array
from typing import Any

import msgspec

from shoal.protocol import is_packed, token_ids_from_wire, token_ids_to_wire


def _encode(obj: Any) -> Any:
    if is_packed(obj):
        return token_ids_to_wire(obj)
    raise NotImplementedError(f"cannot encode {type(obj).__name__}")


def _decode(kind: type, obj: Any) -> Any:
    if kind is array:
        return token_ids_from_wire(obj)
    raise NotImplementedError(f"cannot decode {kind.__name__}")


ENCODER = msgspec.msgpack.Encoder(enc_hook=_encode)


@functools.cache
def decoder(message_type: Any) -> msgspec.msgpack.Decoder:
    """The msgpack decoder for `message_type`, built once per type."""
    return msgspec.msgpack.Decoder(message_type, dec_hook=_decode)
