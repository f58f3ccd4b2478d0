"""Closing connections whose request does not arrive in time (slow or stalled clients).

uvicorn's h11 protocol waits forever for a request that arrives byte by byte, or for a connection
that never sends one: each holds a file descriptor (and, once its headers are in, an ASGI task). With
``--host 0.0.0.0`` a few hundred such sockets exhaust the server's descriptors.
`request_timeout_protocol` returns an h11 protocol class that closes a connection when a whole request
(headers and body) has not arrived within ``request_timeout_s`` of the connection opening or of the
previous response; a request that has arrived is never cut, however long the search takes.
"""

from __future__ import annotations

import asyncio
import logging

logger = logging.getLogger("stratarl.server")

DEFAULT_REQUEST_TIMEOUT_S = 5.0


def check_request_timeout(request_timeout_s: float) -> float:
    """``request_timeout_s`` when it is a positive number of seconds, else `ValueError` saying so."""
    if (
        isinstance(request_timeout_s, bool)
        or not isinstance(request_timeout_s, (int, float))
        or not request_timeout_s > 0
    ):
        raise ValueError(
            f"--request-timeout {request_timeout_s!r}: must be a positive number of seconds. Fix: use e.g. "
            f"{DEFAULT_REQUEST_TIMEOUT_S:g}"
        )
    return float(request_timeout_s)


def request_timeout_protocol(request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S):
    """An ``asyncio.Protocol`` class for ``uvicorn.Config(http=...)``: uvicorn's H11Protocol plus the
    request timeout (`check_request_timeout`)."""
    import h11  # here: `import stratarl.retrieval` does not load the HTTP server's modules
    from uvicorn.protocols.http.h11_impl import H11Protocol  # here: uvicorn loads only when a server starts

    request_timeout_s = check_request_timeout(request_timeout_s)
    received = (h11.DONE, h11.MUST_CLOSE, h11.CLOSED, h11.ERROR)

    class RequestTimeoutH11Protocol(H11Protocol):
        timeout_s = request_timeout_s
        _request_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm_request_timer()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm_request_timer()  # the next request on this keep-alive connection gets its own time

        def data_received(self, data: bytes) -> None:
            self._partial = True
            super().data_received(data)

        def connection_lost(self, exc) -> None:
            self._cancel_request_timer()
            super().connection_lost(exc)

        def _arm_request_timer(self) -> None:
            self._cancel_request_timer()
            self._partial = False
            if not self.transport.is_closing():
                self._request_timer = self.loop.call_later(self.timeout_s, self._request_timed_out)

        def _cancel_request_timer(self) -> None:
            timer = getattr(self, "_request_timer", None)
            if timer is not None:
                timer.cancel()
                self._request_timer = None

        def _request_timed_out(self) -> None:
            self._request_timer = None
            if self.transport.is_closing() or self.conn.their_state in received:
                return  # the request is in (being answered), or the connection is going anyway
            if self._partial:  # an idle connection (never spoke, or kept alive after a response) goes quietly
                who = f"{self.client[0]}:{self.client[1]}" if self.client else "a client"
                logger.warning(
                    "%s sent no whole request within %g s (--request-timeout); connection closed", who, self.timeout_s
                )
            self.transport.close()

    return RequestTimeoutH11Protocol
