"""Error bodies: every error is JSON naming what was wrong; 422s keep FastAPI's shape
(`detail` a list of {loc, msg, type}) so one schema describes all validation errors."""

from __future__ import annotations

import sys
import traceback

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from api.service.schemas import ErrorMessage
from planner.errors import AutoparError, InputError

ERRORS = {404: {"model": ErrorMessage, "description": "not found"}}
AUTH_ERRORS = {
    400: {"model": ErrorMessage, "description": "the body is not JSON"},
    401: {"model": ErrorMessage, "description": "bearer token missing (tokens configured)"},
    403: {"model": ErrorMessage, "description": "bearer token not valid"},
    413: {"model": ErrorMessage, "description": "request body too large"},
}
MUTATING_ERRORS = {**AUTH_ERRORS, 409: {"model": ErrorMessage, "description": "conflict"}}
QUEUE_ERRORS = {
    429: {"model": ErrorMessage, "description": "queue full; retry after Retry-After seconds"}
}


def validation_body(field: str, message: str) -> dict:
    return {"detail": [{"loc": field.split("."), "msg": message, "type": "value_error"}]}


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(InputError)
    async def _input_error(_request: Request, err: InputError) -> JSONResponse:
        message = err.problem + (f" (expected {err.expected})" if err.expected else "")
        return JSONResponse(validation_body(err.field, message), status_code=422)

    @app.exception_handler(AutoparError)
    async def _autopar_error(_request: Request, err: AutoparError) -> JSONResponse:
        return JSONResponse(validation_body("body", str(err)), status_code=422)

    @app.exception_handler(Exception)
    async def _unexpected(_request: Request, err: Exception) -> JSONResponse:
        traceback.print_exception(err, file=sys.stderr)
        return JSONResponse(
            {"detail": f"internal error ({type(err).__name__}); the server log has details"},
            status_code=500,
        )
