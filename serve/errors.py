"""OpenAI error bodies: `{"error": {"message", "type", "param", "code"}}`, and the mapping of our
exceptions (pydantic's ValidationError, the engine's ValueError) onto them."""
from __future__ import annotations

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
    """The first error of the first field, as pydantic says it, with its error type as vLLM's messages
    carry it (`max_tokens: Input should be greater than or equal to 0 [type=greater_than_equal]`)."""
    errs = e.errors(include_url=False)
    field = str(errs[0]["loc"][0]) if errs and errs[0]["loc"] else None
    mine = [x for x in errs if x["loc"] and str(x["loc"][0]) == field] or errs
    # of a union's errors, the member of the input's own type speaks (stop: too many strings, not "not a string")
    first = next((x for x in mine if x["type"] == "string_unicode"), None) or next(
        (x for x in mine if not x["type"].endswith("_type")), mine[0])
    # every place that fails the same way is named, as vLLM's (logit_bias {"bad1": .., "bad2": ..}), up to 32
    same = list(dict.fromkeys(_loc(x) for x in mine if x["type"] == first["type"] and x["msg"] == first["msg"]
                              and len(x["loc"]) == len(first["loc"])))
    loc = ", ".join(same[:32]) + (f" and {len(same) - 32} more" if len(same) > 32 else "")
    msg = first["msg"]
    if first["type"] == "string_unicode":
        msg = "must be valid Unicode text (it holds a lone surrogate such as \\ud800)"
    elif field == "prompt" and len(mine) > 1:  # one error per member of the union: say it once
        msg = ("must be a non-empty string, a non-empty list of non-empty strings, a non-empty list of "
               "token ids (integers) or a non-empty list of such lists")
        loc = "prompt"
    msg = f"{msg} [type={first['type']}]"
    return APIError(400, f"{loc}: {msg}" if loc else msg, param=field)


def _loc(err: dict) -> str:
    """An error's place: its fields and indices (pydantic also names union members, e.g. "list[constrained-int]",
    and dict keys' checks, "[key]": those are left out)."""
    return ".".join(str(p) for p in err["loc"] if not (isinstance(p, str) and (
        "[" in p or "-" in p or p in ("str", "int", "float", "bool"))))


def from_value_error(e: ValueError, rename: dict[str, str] | None = None) -> APIError:
    """The engine's and SamplingParams' ValueErrors name what is wrong (InvalidParam: which param; `rename`
    maps engine names to the request's, e.g. prompt -> messages); keep the message."""
    param, code = getattr(e, "param", None), getattr(e, "code", None)
    msg = str(e).replace("SamplingParams.", "", 1)
    if param is not None and rename:
        param = rename.get(param, param)
    return APIError(400, msg, param=param, code=code)
