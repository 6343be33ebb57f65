"""An EngineRequest's prompt is a packed array of u32 and crosses the request plane as one bin."""

from __future__ import annotations

import struct
from array import array

import msgspec
import pytest

from shoal.protocol import EngineRequest, SamplingParams, pack_token_ids
from shoal.runtime.codec import ENCODER, decoder

IDS = [0, 1, 2**16 + 3, 151_935, 2**32 - 1]


def _request(ids) -> EngineRequest:
    return EngineRequest(request_id="r", prompt_token_ids=ids, sampling=SamplingParams())


def test_a_list_is_packed_on_construction_and_an_array_kept() -> None:
    request = _request(IDS)
    assert type(request.prompt_token_ids) is array and request.prompt_token_ids.typecode == "I"
    assert request.prompt_token_ids.tolist() == IDS
    packed = pack_token_ids(IDS)
    assert _request(packed).prompt_token_ids is packed


def test_the_prompt_travels_as_one_bin_of_little_endian_u32() -> None:
    wire = ENCODER.encode(_request(IDS))
    data = struct.pack(f"<{len(IDS)}I", *IDS)
    assert b"\xc4" + bytes([len(data)]) + data in wire  # msgpack bin 8: marker, length, bytes
    back = decoder(EngineRequest).decode(wire)
    assert back.prompt_token_ids.tolist() == IDS


def test_a_sender_that_writes_integers_is_understood() -> None:
    wire = msgspec.msgpack.encode({"request_id": "r", "prompt_token_ids": IDS, "sampling": {}})
    assert decoder(EngineRequest).decode(wire).prompt_token_ids.tolist() == IDS


@pytest.mark.parametrize(
    "ids, message",
    [
        ([-1], "token ids must be integers"),
        ([2**32], "token ids must be integers"),
        (["7"], "token ids must be integers"),
        ("7", "expected token ids"),
        (b"\x00\x01\x02", "whole number of 4-byte values"),
    ],
)
def test_ids_that_do_not_pack_are_a_validation_error(ids, message: str) -> None:
    wire = msgspec.msgpack.encode({"request_id": "r", "prompt_token_ids": ids, "sampling": {}})
    with pytest.raises(msgspec.ValidationError, match=message) as error:
        decoder(EngineRequest).decode(wire)
    assert "$.prompt_token_ids" in str(error.value)


def test_building_a_request_with_ids_that_do_not_pack_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="token ids must be integers"):
        _request([5, -2])
