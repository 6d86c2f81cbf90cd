"""uvicorn's h11 protocol with a header read deadline and a per-client connection bound (`protocol`).

A connection must send a request's whole header within `header_timeout` seconds of its first byte (or of
the connection opening): else it is closed (a slow sender cannot hold a connection open as long as it
likes). A client (by IP address) may hold at most `max_per_client` connections at once; a further one is
closed as soon as it opens. The body's deadline is `read_json`'s (serve/body.py).
"""
from __future__ import annotations

import collections
import logging

from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("jaxpaged.serve")


def protocol(header_timeout: float | None, max_per_client: int | None) -> type[H11Protocol]:
    """The protocol class to give uvicorn (`Config(http=...)`); None disables a bound."""
    held: collections.Counter = collections.Counter()  # client IP -> connections open

    class Protocol(H11Protocol):
        _deadline = None  # asyncio.TimerHandle of the header deadline, while one runs
        _counted = False

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            ip = self.client[0] if self.client else None
            if max_per_client is not None and ip is not None:
                if held[ip] >= max_per_client:
                    log.info("%s: connection refused: %d connections open (--max-connections-per-client)",
                             ip, held[ip])
                    transport.close()
                    return
                held[ip] += 1
                self._counted = True
            self._watch_header()

        def connection_lost(self, exc) -> None:
            self._stop_watch()
            if self._counted:
                ip = self.client[0]
                held[ip] -= 1
                if not held[ip]:
                    del held[ip]
                self._counted = False
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self._watch_header()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._stop_watch()  # idle until the next request: uvicorn's keep-alive timeout

        def _waiting_for_header(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def _watch_header(self) -> None:
            if header_timeout is None or self.transport.is_closing():
                return
            if not self._waiting_for_header():
                self._stop_watch()
            elif self._deadline is None:
                self._deadline = self.loop.call_later(header_timeout, self._header_late)

        def _stop_watch(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _header_late(self) -> None:
            self._deadline = None
            if self._waiting_for_header() and not self.transport.is_closing():
                log.info("%s: connection closed: no complete request header within %gs (--request-header-timeout)",
                         self.client[0] if self.client else "?", header_timeout)
                self.transport.close()

    return Protocol
