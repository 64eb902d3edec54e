"""Bearer-token auth for mutating endpoints and the request body size limit.

Tokens come from AUTOPAR_API_TOKENS (comma-separated). With none set the service is open,
which `autopar serve` only allows on loopback (or with --insecure). Nothing from a request is
executed, imported or unpickled: bodies are JSON validated by pydantic; model code comes only
from the zoo.
"""

from __future__ import annotations

import json
import secrets

from fastapi import HTTPException, Request


def require_token(request: Request) -> None:
    tokens = request.app.state.settings.tokens
    if not tokens:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token:
        raise HTTPException(
            401,
            "missing bearer token: send 'Authorization: Bearer <token>'",
            headers={"WWW-Authenticate": "Bearer"},
        )
    if not any(secrets.compare_digest(token.strip(), t) for t in tokens):
        raise HTTPException(403, "the bearer token is not valid for this service")


class BodySizeLimit:
    """Pure ASGI middleware: 413 for a declared or streamed body over `max_bytes`."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None:
            try:
                too_big = int(declared) > self.max_bytes
            except ValueError:
                too_big = False
            if too_big:
                return await self._reject(send)
        seen = 0

        async def limited_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise _TooLarge
            return message

        try:
            await self.app(scope, limited_receive, send)
        except _TooLarge:
            await self._reject(send)

    async def _reject(self, send) -> None:
        body = json.dumps(
            {"detail": f"request body larger than the limit of {self.max_bytes} bytes"}
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})


class _TooLarge(Exception):
    pass
