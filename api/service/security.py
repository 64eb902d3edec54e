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
    # Compared as UTF-8 bytes: compare_digest refuses str with non-ASCII characters (a
    # TypeError, once a 500 for `Bearer \xe9`); Starlette decodes headers as Latin-1.
    given = token.strip().encode("utf-8", "surrogateescape")
    if not any(secrets.compare_digest(given, t.encode("utf-8")) for t in tokens):
        raise HTTPException(403, "the bearer token is not valid for this service")


class BodySizeLimit:
    """Pure ASGI middleware bounding request bodies as a reverse proxy would: 413 for a body
    over `max_bytes` (declared or streamed), 408 for one not received within `timeout_s`,
    503 when the bodies being read would together hold more than `memory_bytes` beyond their
    first `small_bytes` each (a plan request is a few hundred bytes: stalled uploads that
    fill the budget must not turn ordinary requests away).

    The body is read here, up to the limit, before the app sees it (an error raised while
    the app reads would reach FastAPI's body parser and come back as a 400). Without the
    deadline and the shared budget, 40 clients each sending 8 MiB less one byte and then
    nothing held 395 MB for as long as they kept their connections. Bodies over
    `large_bytes` are parsed a few at a time (`max_large` at once, 503 past that), which
    bounds the memory that parsing big graphs can take."""

    def __init__(
        self,
        app,
        max_bytes: int,
        memory_bytes: int = 32 << 20,
        timeout_s: float = 30.0,
        large_bytes: int = 1 << 20,
        max_large: int = 2,
        small_bytes: int = 64 << 10,
    ):
        self.app, self.max_bytes, self.large_bytes = app, max_bytes, large_bytes
        self.memory_bytes, self.timeout_s, self.small_bytes = memory_bytes, timeout_s, small_bytes
        self.in_flight = 0  # bytes of bodies being read now (one event loop: no lock needed)
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
        held = [0]
        try:
            async with asyncio.timeout(self.timeout_s):
                body = await self._read(receive, send, held)
        except TimeoutError:
            return await _reply(
                send, 408, f"request body not received within {self.timeout_s:g} s", close=True
            )
        finally:
            self.in_flight -= held[0]
        if body is None:
            return  # answered already, or the client went away
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

    async def _read(self, receive, send, held: list[int]) -> bytes | None:
        """The whole body, counting what it holds in `held` and `in_flight`; None when an
        answer was sent instead (413, 503) or the client went away."""
        chunks, seen = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return None
            chunk = message.get("body", b"")
            if seen + len(chunk) > self.max_bytes:
                await _reply(send, 413, f"request body larger than {self.max_bytes} bytes")
                return None
            seen += len(chunk)
            counted = max(0, seen - self.small_bytes) - held[0]  # what the budget takes now
            if counted and self.in_flight + counted > self.memory_bytes:
                await _reply(
                    send,
                    503,
                    "too many request bodies being received at once; retry later",
                    retry_after=5,
                    close=True,
                )
                return None
            held[0] += counted
            self.in_flight += counted
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


# Pages load only the service's own scripts and styles (the viewer and docs assets are
# vendored under /static); inline style attributes are the viewer's bars and colours. The
# docs page's one inline script is allowed by its hash (routes_service.docs).
CONTENT_SECURITY_POLICY = (
    "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
    "img-src 'self' data:; font-src 'self' data:; worker-src 'self' blob:; "
    "connect-src 'self'; object-src 'none'; base-uri 'none'; frame-ancestors 'none'; "
    "form-action 'self'"
)


class SecurityHeaders:
    """Pure ASGI middleware: every response says nosniff and carries the content security
    policy above unless the route set its own."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def with_headers(message):
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                names = {k.lower() for k, _ in headers}
                headers.append((b"x-content-type-options", b"nosniff"))
                headers.append((b"referrer-policy", b"no-referrer"))
                if b"content-security-policy" not in names:
                    headers.append((b"content-security-policy", CONTENT_SECURITY_POLICY.encode()))
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, with_headers)


async def _reply(
    send, status: int, detail: str, retry_after: int | None = None, close: bool = False
) -> None:
    body = json.dumps({"detail": detail}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if retry_after is not None:
        headers.append((b"retry-after", str(retry_after).encode()))
    if close:  # the rest of the body is never read: the connection cannot be reused
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
