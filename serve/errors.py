"""OpenAI error bodies: `{"error": {"message", "type", "param", "code"}}`, and the mapping of our
exceptions (pydantic's ValidationError, the engine's ValueError) onto them."""
from __future__ import annotations

import re

from pydantic import ValidationError
from starlette.responses import JSONResponse

from serve.protocol import ErrorInfo, ErrorResponse

_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
          405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
          500: "server_error", 503: "server_error"}


class APIError(Exception):
    """An error answered with OpenAI's error body."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or _TYPES.get(status, "invalid_request_error")
        self.headers = headers

    def response(self) -> JSONResponse:
        body = ErrorResponse(error=ErrorInfo(message=self.message, type=self.type, param=self.param,
                                             code=self.code))
        return JSONResponse(body.model_dump(), status_code=self.status, headers=self.headers)


def from_validation_error(e: ValidationError) -> APIError:
    errs = e.errors(include_url=False)
    field = str(errs[0]["loc"][0]) if errs and errs[0]["loc"] else None
    if field == "prompt" and len(errs) > 1:  # one error per member of the union: say it once
        return APIError(400, "prompt must be a string, a list of strings, a list of token ids or a list "
                             "of token-id lists", param="prompt")
    first = errs[0]
    loc = ".".join(str(p) for p in first["loc"])
    msg = first["msg"]
    if first["type"] == "missing":
        msg = "field required"
    return APIError(400, f"{loc}: {msg}" if loc else msg, param=field)


_FIELD = re.compile(r"SamplingParams\.(\w+) ")


def from_value_error(e: ValueError, prompt_param: str = "prompt") -> APIError:
    """The engine's and SamplingParams' ValueErrors name what is wrong; keep the message, find the param."""
    msg = str(e)
    m = _FIELD.match(msg)
    if m:
        return APIError(400, msg.replace("SamplingParams.", "", 1), param=m.group(1))
    if "max_model_len" in msg:
        param = "max_tokens" if "max_tokens" in msg else prompt_param
        return APIError(400, msg, param=param, code="context_length_exceeded")
    if "logprobs" in msg:
        return APIError(400, msg, param="logprobs")
    if "prompt" in msg:
        return APIError(400, msg, param=prompt_param)
    return APIError(400, msg)
