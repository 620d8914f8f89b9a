"""The service's bearer token, as FastAPI's security dependency (``fastapi.security.HTTPBearer``).

Every route but ``/healthz`` depends on a :class:`Bearer` (the API's description names the scheme, and
/docs offers it); the token is compared in constant time (:func:`secrets.compare_digest`). A request
without it is told 401, ``WWW-Authenticate: Bearer`` and one line, and nothing else: what FastAPI
answers before a route's dependencies run (a path that is no route, a method the route does not take,
a body that is not JSON) asks :meth:`Bearer.refuses` first (:func:`autotune.serve.app._refusals`). Only
the Host check (421) and the body-size limit (413) come before the token: they refuse a request before
its body is read (:class:`autotune.serve.guard.Guard`), and a dependency runs after. A path with one
slash too many or too few is redirected (307) to its route, which then asks for the token.
"""

from __future__ import annotations

import secrets

from fastapi import HTTPException, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.requests import HTTPConnection

#: What a request without the token is told.
REFUSED = "missing or wrong bearer token: send Authorization: Bearer <the token in the service's --token-file>"


class Bearer(HTTPBearer):
    """The dependency that lets a request through with ``Authorization: Bearer <token>`` and refuses any
    other (401)."""

    def __init__(self, token: str):
        super().__init__(auto_error=False, scheme_name="bearer",
                         description="the token in the service's --token-file: Authorization: Bearer <token>")
        self._token = token.encode()

    async def __call__(self, request: HTTPConnection) -> HTTPAuthorizationCredentials | None:
        credentials = await super().__call__(request)
        if not self.allows(credentials):
            raise self.make_not_authenticated_error()
        return credentials

    def allows(self, credentials: HTTPAuthorizationCredentials | None) -> bool:
        """Do these credentials carry the token (compared in constant time, as the bytes sent: the header
        was read as latin-1, and the token file as UTF-8)?"""
        return credentials is not None and \
            secrets.compare_digest(credentials.credentials.encode("latin-1"), self._token)

    async def carries(self, request: HTTPConnection) -> bool:
        """Does this request carry the token? (``/healthz`` answers in full when it does.)"""
        return self.allows(await super().__call__(request))

    async def refuses(self, request: Request) -> bool:
        """Would this request have been refused had its route's dependencies run? A request for no route
        needs the token too; one for ``/healthz`` never does."""
        route = request.scope.get("route")
        guarded = route is None or any(d.dependency is self for d in getattr(route, "dependencies", ()))
        return guarded and not await self.carries(request)

    def make_not_authenticated_error(self) -> HTTPException:
        return HTTPException(status_code=401, detail=REFUSED, headers={"WWW-Authenticate": "Bearer"})
