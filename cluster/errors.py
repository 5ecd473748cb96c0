"""The engine's error types, by who is at fault.

`ValueError` means the request (or a config value) is wrong: the ingress answers 400 with its
message. Everything below is the server's side, never the client's mistake.
"""
from __future__ import annotations


# Why the engine ended a request with finish_reason "error" (EngineOutput.error_code), where the
# answer is not a 500: the HTTP status the ingress gives each.
QUEUE_TIMEOUT = "queue_timeout"  # waited past max_queue_wait_s before starting: 503, Retry-After
REQUEST_TIMEOUT = "request_timeout"  # ran past request_timeout_s: 408 (or an error event in a stream)


class EngineOverloadedError(RuntimeError):
    """Admission refused: the waiting queue holds `max_waiting` sequences (HTTP 503)."""


class EngineInternalError(RuntimeError):
    """An engine invariant broke (a bug, or a custom processor failing inside a step): the
    request fails with HTTP 500 and the replica stops serving."""
