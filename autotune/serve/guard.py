"""The service's gate: every request's Host, bearer token and body size, checked before the
application sees it (ASGI middleware)."""

from __future__ import annotations

import hmac
import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

#: Paths that answer without the token.
OPEN_PATHS = ("/healthz",)

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]


class Guard:
    """ASGI middleware: the Host header (a name of the service's address, or one allowed), the bearer
    token (constant-time comparison) and the body size limit, checked before the application sees the
    request."""

    def __init__(self, app: Any, *, token: str | None, max_body: int, hosts: frozenset[str] | None = None):
        self.app = app
        self.token = token.encode() if token else None
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
        if self.token is not None and scope.get("path") not in OPEN_PATHS and \
                not authorised(self.token, headers.get(b"authorization", b"")):
            await _send(send, 401, "missing or wrong bearer token: send Authorization: Bearer <the token in the "
                                   "service's --token-file>", [(b"www-authenticate", b"Bearer")])
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



def authorised(token: bytes, header: bytes) -> bool:
    """Does an Authorization header carry ``token`` (``Bearer <token>``, compared in constant time)?"""
    scheme, _, given = header.partition(b" ")
    return scheme.lower() == b"bearer" and hmac.compare_digest(given.strip(), token)


def host_name(header: bytes) -> str:
    """The name in a Host header, without the port: ``127.0.0.1``, ``::1``, ``localhost``."""
    text = header.decode("latin-1").strip().lower()
    if text.startswith("["):
        return text[1:].partition("]")[0]
    return text.rpartition(":")[0] if text.count(":") == 1 else text


async def _send(send: Send, status: int, detail: str, headers: list[tuple[bytes, bytes]] | None = None) -> None:
    payload = json.dumps({"detail": detail}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
                            *(headers or [])]})
    await send({"type": "http.response.body", "body": payload})
