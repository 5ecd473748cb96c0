"""What the ingress and the engine deployment exchange, beyond `cluster.messages`.

The engine's `generate(request, ingress=<id>)` stream yields a `FirstItem` (the request's first
outputs and the replica that serves it), then `MuxMessage`s: one per step for every request of
that ingress on that replica (actors/channel/mux.py). The keywords a call may carry for the
routers, and the key of the routing stats a replica publishes, are named here too, so the
engine and the fleet (actors/fleet/) agree on them without importing each other's code.
Exceptions cross the Serve handle intact (Ray re-raises the cause's class), so the ingress
maps them to HTTP status codes: this one and `cluster.errors.EngineOverloadedError` to 503,
`cluster.errors.EngineInternalError` to 500, ValueError to 400.
"""
from __future__ import annotations

import msgspec

from cluster.messages import EngineOutput, EngineRequest, decode, encode

AVOID_REPLICAS = "avoid_replicas"  # generate() keyword: replica unique ids not to route to
PIN_REPLICA = "pin_replica"  # keyword of any call: the replica unique id it must go to
ROUTING_STATS_KEY = "prefix_cache"  # record_routing_stats(): msgpack PrefixCacheSummary


class EncodedRequest(bytes):
    """A msgpack EngineRequest as `generate` receives it. In the process that encoded it, it also
    holds the request itself (`request`), so the engine routers, which run in that process, read
    its prompt without decoding it again; sent to another process it travels as plain bytes."""

    request: EngineRequest

    def __reduce__(self):
        return bytes, (bytes(self),)


def encode_request(request: EngineRequest) -> EncodedRequest:
    data = EncodedRequest(encode(request))
    data.request = request
    return data


def request_of(data: bytes) -> EngineRequest:
    """The EngineRequest in a `generate` call's payload, decoded only where it was not encoded."""
    request = getattr(data, "request", None)
    return request if request is not None else decode(data, EngineRequest)


class EngineUnavailableError(RuntimeError):
    """The engine cannot serve: a worker died or the step loop failed (HTTP 503). `replica` is
    the engine replica's unique id, so a caller can retry elsewhere (actors/channel/failover.py)."""

    def __init__(self, message: str, replica: str | None = None) -> None:
        super().__init__(message)
        self.replica = replica

    def __reduce__(self):  # keep `replica` across Ray's pickling
        return type(self), (str(self), self.replica)


class FirstItem(msgspec.Struct, array_like=True):
    """A multiplexed `generate` call's first item. `muxed`: the request's later outputs come
    in `MuxMessage`s of this ingress on `replica` (False when these outputs finished it)."""

    outputs: list[EngineOutput]
    replica: str
    muxed: bool


class MuxMessage(msgspec.Struct, array_like=True):
    """New outputs of several requests of one ingress on one replica. `seq` counts the
    messages of that (ingress, replica) pair from 0: they travel on different calls, so the
    ingress puts them back in order."""

    seq: int
    outputs: list[EngineOutput]


_encoder = msgspec.msgpack.Encoder()


def encode_item(item: FirstItem | MuxMessage) -> bytes:
    return _encoder.encode(item)


_first_decoder = msgspec.msgpack.Decoder(FirstItem)
_mux_decoder = msgspec.msgpack.Decoder(MuxMessage)


def decode_first(data: bytes) -> FirstItem:
    return _first_decoder.decode(data)


def decode_mux(data: bytes) -> MuxMessage:
    return _mux_decoder.decode(data)
