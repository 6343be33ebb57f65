"""Shared-secret authentication of plane messages: an HMAC-SHA256 frame after the others.

With a secret, every message a plane sends carries one more frame: the HMAC-SHA256, keyed
by the secret, of the message's other frames (each prefixed by its length). A receiver with
the same secret checks it before decoding anything. It proves the sender knows the secret;
it does not encrypt, and it does not stop a recorded message from being replayed.
"""

from __future__ import annotations

import hashlib
import hmac

MAC_SIZE = 32


class FrameSigner:
    """Signs and checks the frames of a message with one shared secret."""

    __slots__ = ("_key",)

    def __init__(self, secret: str | bytes) -> None:
        key = secret.encode() if isinstance(secret, str) else bytes(secret)
        if not key:
            raise ValueError("the plane secret must not be empty")
        self._key = key

    def mac(self, frames: list[bytes]) -> bytes:
        """The MAC of `frames`."""
        digest = hmac.new(self._key, digestmod=hashlib.sha256)
        for frame in frames:
            digest.update(len(frame).to_bytes(8, "little"))
            digest.update(frame)
        return digest.digest()

    def sign(self, frames: list[bytes]) -> list[bytes]:
        """`frames` with their MAC appended."""
        return [*frames, self.mac(frames)]

    def verify(self, frames: list[bytes]) -> list[bytes] | None:
        """The frames before a valid trailing MAC, or None if the MAC is missing or wrong."""
        if len(frames) < 2 or len(frames[-1]) != MAC_SIZE:
            return None
        body = frames[:-1]
        return body if hmac.compare_digest(self.mac(body), frames[-1]) else None


def make_signer(secret: str | bytes | None) -> FrameSigner | None:
    """A FrameSigner for `secret`, or None when no secret is set (authentication off)."""
    return None if secret is None or secret in ("", b"") else FrameSigner(secret)
