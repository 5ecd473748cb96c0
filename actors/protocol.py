"""What the ingress and the engine deployment exchange, beyond `cluster.messages`.

The engine's `generate` stream yields msgpack-encoded lists of `EngineOutput` (every delta
for the request since the consumer last read, so a slow reader gets fewer, larger items).
Exceptions cross the Serve handle intact (Ray re-raises the cause's class), so the ingress
maps them to HTTP status codes: this one and `cluster.errors.EngineOverloadedError` to 503,
`cluster.errors.EngineInternalError` to 500, ValueError to 400.
"""
from __future__ import annotations

import msgspec

from cluster.messages import EngineOutput


class EngineUnavailableError(RuntimeError):
    """The engine cannot serve: a worker died or the step loop failed (HTTP 503). `replica` is
    the engine replica's unique id, so a caller can retry elsewhere (actors/failover.py)."""

    def __init__(self, message: str, replica: str | None = None) -> None:
        super().__init__(message)
        self.replica = replica

    def __reduce__(self):  # keep `replica` across Ray's pickling
        return type(self), (str(self), self.replica)


_encoder = msgspec.msgpack.Encoder()
_batch_decoder = msgspec.msgpack.Decoder(list[EngineOutput])


def encode_outputs(outputs: list[EngineOutput]) -> bytes:
    return _encoder.encode(outputs)


def decode_outputs(data: bytes) -> list[EngineOutput]:
    return _batch_decoder.decode(data)
