"""Bearer-token auth for mutating endpoints and the request body size limit.

Tokens come from AUTOPAR_API_TOKENS (comma-separated). With none set the service is open,
which `autopar serve` only allows on loopback (or with --insecure). Nothing from a request is
executed, imported or unpickled: bodies are JSON validated by pydantic; model code comes only
from the zoo.
"""

from __future__ import annotations

import asyncio
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
    """Pure ASGI middleware: 413 for a body over `max_bytes`, declared or streamed (chunked).

    The body is read here, up to the limit, before the app sees it (an error raised while
    the app reads would reach FastAPI's body parser and come back as a 400). Bodies over
    `large_bytes` are parsed a few at a time (`max_large` at once, 503 past that), which
    bounds the memory that parsing big graphs can take."""

    def __init__(self, app, max_bytes: int, large_bytes: int = 1 << 20, max_large: int = 2):
        self.app, self.max_bytes, self.large_bytes = app, max_bytes, large_bytes
        self._large = asyncio.Semaphore(max_large)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None:
            try:
                too_big = int(declared) > self.max_bytes
            except ValueError:
                too_big = False
            if too_big:
                return await _reply(send, 413, f"request body larger than {self.max_bytes} bytes")
        chunks, seen = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away
            chunk = message.get("body", b"")
            seen += len(chunk)
            if seen > self.max_bytes:
                return await _reply(send, 413, f"request body larger than {self.max_bytes} bytes")
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        if len(body) <= self.large_bytes:
            return await self.app(scope, replay, send)
        if self._large.locked():
            return await _reply(
                send, 503, "too many large requests at once; retry later", retry_after=5
            )
        async with self._large:
            await self.app(scope, replay, send)


async def _reply(send, status: int, detail: str, retry_after: int | None = None) -> None:
    body = json.dumps({"detail": detail}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if retry_after is not None:
        headers.append((b"retry-after", str(retry_after).encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
