"""uvicorn's h11 protocol with a request-head timeout for ``cxlalloc serve`` (``--header-timeout``)."""

from __future__ import annotations

import json


def header_timeout_protocol(seconds: float):
    """uvicorn's h11 protocol class with a header timeout: a connection that has
    not sent a whole request head ``seconds`` after it opened (or after its last
    response) gets ``408 Request Timeout`` and is closed, so slow or stalled
    clients (slowloris) cannot hold connections open.  uvicorn has only an idle
    keep-alive timeout, disarmed by the first byte of a request."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeaderTimeoutH11Protocol(H11Protocol):
        _header_timer = None
        _head_bytes = 0

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()  # a connection that never sends a request head is closed too (silently)

        def data_received(self, data: bytes) -> None:
            if self.cycle is None or self.cycle.response_complete:  # bytes of a next request head
                self._head_bytes += len(data)
                if self._header_timer is None:
                    self._arm()
            super().data_received(data)

        def on_response_complete(self) -> None:
            self._disarm()  # idle between requests: uvicorn's keep-alive timeout applies
            self._head_bytes = 0
            super().on_response_complete()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._header_timer = self.loop.call_later(seconds, self._timed_out, self.cycle)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _timed_out(self, cycle_when_armed) -> None:
            self._header_timer = None
            if self.transport.is_closing() or self.cycle is not cycle_when_armed:
                return  # closed, or a request head arrived since
            if self._head_bytes:
                # OpenAI's error form, like every other 4xx of the server (the openai client reads it)
                body = json.dumps({"error": {
                    "message": f"no complete request head within {seconds:g} s (--header-timeout)",
                    "type": "invalid_request_error", "param": None, "code": "request_timeout"}}).encode()
                self.transport.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                                     b"connection: close\r\ncontent-length: " + str(len(body)).encode()
                                     + b"\r\n\r\n" + body)
            self.transport.close()

    return HeaderTimeoutH11Protocol

