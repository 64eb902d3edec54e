"""Error bodies: every error is JSON naming what was wrong; 422s keep FastAPI's shape
(`detail` a list of {loc, msg, type}) so one schema describes all validation errors."""

from __future__ import annotations

import sys
import traceback

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from api.service.schemas import ErrorMessage
from planner.errors import AutoparError, InputError

ERRORS = {404: {"model": ErrorMessage, "description": "not found"}}
AUTH_ERRORS = {
    400: {"model": ErrorMessage, "description": "the body is not JSON"},
    401: {"model": ErrorMessage, "description": "bearer token missing (tokens configured)"},
    403: {"model": ErrorMessage, "description": "bearer token not valid"},
    413: {"model": ErrorMessage, "description": "request body too large"},
    503: {"model": ErrorMessage, "description": "too many large bodies at once; retry later"},
}
MUTATING_ERRORS = {**AUTH_ERRORS, 409: {"model": ErrorMessage, "description": "conflict"}}
QUEUE_ERRORS = {
    429: {"model": ErrorMessage, "description": "queue full; retry after Retry-After seconds"},
    409: {"model": ErrorMessage, "description": "Idempotency-Key sent before with another request"},
}


def validation_body(field: str, message: str) -> dict:
    return {"detail": [{"loc": field.split("."), "msg": message, "type": "value_error"}]}


def _plain(errors: list[dict]) -> list[dict]:
    """FastAPI's validation errors without `input` and `ctx`: those echo the request's values,
    which may be NaN or a lone surrogate that JSON cannot carry (a 500 instead of a 422)."""
    out = []
    for e in errors:
        loc = [p if isinstance(p, int) else _text(p) for p in e.get("loc", ())]
        out.append({"loc": loc, "msg": _text(e.get("msg", "")), "type": e.get("type", "")})
    return out


def _text(value: object) -> str:
    return str(value).encode("utf-8", "backslashreplace").decode("utf-8")


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _validation_error(_request: Request, err: RequestValidationError) -> JSONResponse:
        return JSONResponse({"detail": _plain(err.errors())}, status_code=422)

    @app.exception_handler(InputError)
    async def _input_error(_request: Request, err: InputError) -> JSONResponse:
        message = err.problem + (f" (expected {err.expected})" if err.expected else "")
        return JSONResponse(validation_body(_text(err.field), _text(message)), status_code=422)

    @app.exception_handler(AutoparError)
    async def _autopar_error(_request: Request, err: AutoparError) -> JSONResponse:
        return JSONResponse(validation_body("body", _text(err)), status_code=422)

    @app.exception_handler(Exception)
    async def _unexpected(_request: Request, err: Exception) -> JSONResponse:
        traceback.print_exception(err, file=sys.stderr)
        return JSONResponse(
            {"detail": f"internal error ({type(err).__name__}); the server log has details"},
            status_code=500,
        )
