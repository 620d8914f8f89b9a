"""The service's gate: every request's Host and body size, checked before the application sees it
(ASGI middleware).

These two are ASGI, not FastAPI dependencies, because they must act before a body is read: FastAPI
reads and parses a request's body before it runs the route's dependencies (the bearer token's among
them, :mod:`autotune.serve.auth`), and a request for another Host is refused whatever its path (no
route, ``/healthz`` included). So a body over the limit is refused as it arrives, never held whole,
and a request for another Host is never read at all.

:func:`protocol` sets a time limit on reading each request: a connection that has not sent its request
whole (headers and body) within ``--read-timeout`` is answered 408 and closed, so slow clients that
trickle bytes cannot hold connections open for ever.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]


class Guard:
    """ASGI middleware: the Host header (a name of the service's address, or one allowed) and the body
    size limit, checked before the application sees the request."""

    def __init__(self, app: Any, *, max_body: int, hosts: frozenset[str] | None = None):
        self.app = app
        self.max_body = max_body
        self.hosts = hosts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.lower(): v for k, v in scope.get("headers", ())}
        if self.hosts is not None and (host := host_name(headers.get(b"host", b""))) not in self.hosts:
            await _send(send, 421, f"Host {host!r} is not a name of this service ({', '.join(sorted(self.hosts))}): "
                                   "ask it by one of those, or start it with --allowed-hosts naming this one")
            return
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body):
            await _send(send, 413, f"request body over {self.max_body} bytes: a plan request is a few hundred")
            return
        body, more = b"", True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.max_body:
                await _send(send, 413, f"request body over {self.max_body} bytes: a plan request is a few hundred")
                return
        sent = False

        async def replay() -> MutableMapping[str, Any]:
            nonlocal sent
            if sent:
                return await receive()
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)



def protocol(read_timeout_s: float) -> type:
    """uvicorn's HTTP/1.1 protocol (h11) with a time limit on reading each request: from a connection's
    start, or from the first byte of the next request on a connection kept alive, until the request's last
    byte. A request late past it is answered 408 (unless its answer has begun) and its connection closed;
    a request that has arrived whole runs as long as it needs."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    reading = (h11.IDLE, h11.SEND_BODY)
    late = json.dumps({"detail": f"the request did not arrive whole within {read_timeout_s:g} s: send its headers "
                                 "and body at once"}).encode()
    answer = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
              b"content-length: " + str(len(late)).encode() + b"\r\n\r\n" + late)

    class Timed(H11Protocol):
        deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self.deadline = self.loop.call_later(read_timeout_s, self.expired)

        def data_received(self, data: bytes) -> None:
            if self.deadline is None and self.conn.their_state in reading:  # the next request on this connection
                self.deadline = self.loop.call_later(read_timeout_s, self.expired)
            super().data_received(data)
            if self.conn.their_state not in reading:  # read whole (or the connection is ending)
                self.disarm()

        def connection_lost(self, exc: Exception | None) -> None:
            self.disarm()
            super().connection_lost(exc)

        def disarm(self) -> None:
            if self.deadline is not None:
                self.deadline.cancel()
                self.deadline = None

        def expired(self) -> None:
            self.deadline = None
            if self.transport.is_closing() or self.conn.their_state not in reading:
                return
            if self.conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):  # nothing answered yet
                self.transport.write(answer)
            self.transport.close()

    return Timed


def host_name(header: bytes) -> str:
    """The name in a Host header, without the port: ``127.0.0.1``, ``::1``, ``localhost``. A header whose
    text after the name is not ``:PORT`` (``localhost:8321@evil.com``) is given whole, so it names no host."""
    text = header.decode("latin-1").strip().lower()
    if text.startswith("["):
        name, _, port = text[1:].partition("]")
    elif text.count(":") == 1:
        name, port = text.split(":")
        port = ":" + port
    else:
        return text
    return name if port == "" or (port[:1] == ":" and port[1:].isdigit() and port.isascii()) else text


async def _send(send: Send, status: int, detail: str) -> None:
    payload = json.dumps({"detail": detail}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]})
    await send({"type": "http.response.body", "body": payload})
