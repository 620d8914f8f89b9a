"""The service's gate: every request's Host and body size, checked before the application sees it
(ASGI middleware).

These two are ASGI, not FastAPI dependencies, because they must act before a body is read: FastAPI
reads and parses a request's body before it runs the route's dependencies (the bearer token's among
them, :mod:`autotune.serve.auth`), and a request for another Host is refused whatever its path (no
route, ``/healthz`` included). So a body over the limit is refused as it arrives, never held whole,
and a request for another Host is never read at all.
"""

from __future__ import annotations

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
