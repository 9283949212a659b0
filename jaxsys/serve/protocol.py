"""The HTTP server's requests (OpenAI's completions and chat completions, with vLLM's extensions
top_k, min_p and repetition_penalty) as pydantic models, and the OpenAI shapes of what it answers.

Every bound is checked here, before anything reaches the engine: integers outside int32 (seed,
top_k, n, max_tokens, logprobs), NaN and infinite floats, wrong types (strict: no "5" for 5, no
true for 1), unknown fields. `parse(model, body)` raises `ApiError` (400) naming the field.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
MAX_LOGPROBS = 20  # top alternatives per token (the engine's Sampling.logprobs bound)
MAX_N = 128  # choices per prompt (OpenAI's bound)
MAX_STOP = 16  # stop strings per request
MAX_CHOICES = 256  # prompts x n per request
MAX_LOGIT_BIAS = 300  # biased tokens per request (OpenAI's bound; the engine's Sampling bound)

Int32 = Annotated[int, Field(ge=INT32_MIN, le=INT32_MAX)]
Count = Annotated[int, Field(ge=0, le=INT32_MAX)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]


class ApiError(Exception):
    """An answer other than 200: status, message, OpenAI's error type and the field at fault."""

    TYPES = {
        400: "invalid_request_error",
        401: "authentication_error",
        404: "not_found_error",
        413: "invalid_request_error",
        429: "rate_limit_error",
        500: "server_error",
        503: "server_error",
    }

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        kind = self.TYPES.get(self.status, "invalid_request_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampled(_Strict):
    """The fields both endpoints share."""

    model: str | None = None
    max_tokens: Count | None = None
    temperature: Annotated[float, Field(ge=0.0)] = 0.0  # greedy unless asked (OpenAI: 1.0)
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Field(ge=-1, le=INT32_MAX)] = 0  # vLLM's extension; 0 and -1: no limit
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    seed: Int32 | None = None
    stop: str | list[str] | None = None
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    repetition_penalty: Annotated[float, Field(gt=0.0, le=100.0)] = 1.0  # vLLM's extension
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] = 0.0  # vLLM's extension; 0: off
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None  # {"token id": bias}
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted, not used

    @field_validator("stop")
    @classmethod
    def _stop(cls, value):
        stops = [value] if isinstance(value, str) else list(value or [])
        if len(stops) > MAX_STOP or any(not s for s in stops):
            raise ValueError(f"give at most {MAX_STOP} non-empty stop strings")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, value):
        if value is None:
            return value
        if len(value) > MAX_LOGIT_BIAS:
            raise ValueError(f"give at most {MAX_LOGIT_BIAS} token ids")
        bad = [key for key in value if not key.isdigit() or not 0 <= int(key) <= INT32_MAX]
        if bad:
            raise ValueError(f"keys must be token ids (decimal strings); got {bad[:3]}")
        return value

    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    def biases(self) -> tuple[tuple[int, float], ...]:
        """logit_bias as ((token id, bias), ...) in id order."""
        return tuple(sorted((int(key), float(bias)) for key, bias in (self.logit_bias or {}).items()))


class CompletionRequest(_Sampled):
    """POST /v1/completions. `prompt`: a string, a list of strings, a list of token ids, or a list
    of lists of token ids (one choice group per prompt)."""

    prompt: Any
    echo: bool = False
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    best_of: Annotated[int, Field(ge=1, le=MAX_N)] | None = None  # only best_of == n (no reranking)
    suffix: str | None = None  # only none

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, value):
        ids = lambda v: isinstance(v, list) and all(type(t) is int for t in v)
        if isinstance(value, str) or ids(value):
            return value
        if isinstance(value, list) and value and all(isinstance(p, str) for p in value):
            return value
        if isinstance(value, list) and value and all(ids(p) for p in value):
            return value
        raise ValueError("must be a string, a list of strings, a list of token ids or a list of lists of token ids")

    def prompts(self) -> list:
        """The prompts, each a string or a list of token ids."""
        p = self.prompt
        return [p] if isinstance(p, str) or not p or isinstance(p[0], int) else list(p)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class Message(_Strict):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatRequest(_Sampled):
    """POST /v1/chat/completions."""

    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: Count | None = None  # OpenAI's newer name for max_tokens
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None


RANGES = {
    "temperature": "temperature >= 0",
    "top_p": "0 < top_p <= 1",
    "top_k": f"-1 <= top_k <= {INT32_MAX} (0 and -1: no limit)",
    "n": f"1 <= n <= {MAX_N}",
    "best_of": f"1 <= best_of <= {MAX_N}",
    "seed": f"{INT32_MIN} <= seed <= {INT32_MAX} (int32)",
    "max_tokens": f"0 <= max_tokens <= {INT32_MAX}",
    "max_completion_tokens": f"0 <= max_completion_tokens <= {INT32_MAX}",
    "logprobs": f"0 <= logprobs <= {MAX_LOGPROBS}",
    "top_logprobs": f"0 <= top_logprobs <= {MAX_LOGPROBS}",
    "presence_penalty": "-2 <= presence_penalty <= 2",
    "frequency_penalty": "-2 <= frequency_penalty <= 2",
    "repetition_penalty": "0 < repetition_penalty <= 100",
    "min_p": "0 <= min_p <= 1",
    "logit_bias": "-100 <= bias <= 100",
}
TYPES = {
    "int_type": "int",
    "int_parsing": "int",
    "int_from_float": "int",
    "float_type": "a number",
    "float_parsing": "a number",
    "bool_type": "a boolean",
    "bool_parsing": "a boolean",
    "string_type": "a string",
    "list_type": "a list",
    "dict_type": "an object",
    "model_type": "an object",
    "model_attributes_type": "an object",
}
BOUNDS = ("greater_than", "greater_than_equal", "less_than", "less_than_equal")


def parse(model: type[_Strict], body: bytes):
    """The request `body` (UTF-8 JSON) as `model`; ApiError(400) naming the field at fault."""
    try:
        body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ApiError(400, f"the request body is not UTF-8 (byte {e.start}): send JSON encoded as UTF-8") from None
    try:
        return model.model_validate_json(body or b"{}")
    except ValidationError as e:
        raise ApiError(400, *_message(model, e.errors()[0])) from None


def _message(model, error: dict) -> tuple[str, str | None]:
    kind, loc = error["type"], error["loc"]
    if kind == "json_invalid":
        return f"the request body is not JSON: {error['msg']}", None
    if not loc:
        return "the request body must be a JSON object", None
    field = ".".join(str(x) for x in loc)
    name = str(loc[0])
    value = error.get("input")
    if kind == "extra_forbidden":
        return f"{field}: unknown field (this endpoint takes {', '.join(sorted(model.model_fields))})", field
    if kind == "missing":
        return f"{field}: this field is required", field
    if kind in BOUNDS:
        return f"{field}={value!r} is out of range: {RANGES.get(name, error['msg'])}", field
    if kind == "finite_number":
        return f"{field} must be a finite number (NaN and Infinity are refused)", field
    if kind in TYPES and len(loc) == 1:
        return f"{field} must be {TYPES[kind]}; got {value!r}", field
    return f"{field}: {error['msg'].removeprefix('Value error, ')}", field


# -- what the server answers


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion_logprobs(tokens: list[str], logprobs: list, tops: list, offset0: int = 0) -> dict:
    """OpenAI's completions logprobs: tokens, token_logprobs, top_logprobs ({token: logprob}, or
    None where there is none, as for the first prompt token) and text_offset."""
    offsets, at = [], offset0
    for t in tokens:
        offsets.append(at)
        at += 0 if t.startswith("token_id:") else len(t)
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets}


def chat_logprob(token: str, logprob: float, top: list[tuple[str, float]]) -> dict:
    """One entry of chat's logprobs.content."""
    as_bytes = lambda s: None if s.startswith("token_id:") else list(s.encode("utf-8"))
    return {
        "token": token,
        "logprob": logprob,
        "bytes": as_bytes(token),
        "top_logprobs": [{"token": t, "logprob": lp, "bytes": as_bytes(t)} for t, lp in top],
    }


class TokenizeRequest(_Strict):
    """POST /tokenize (vLLM's): a prompt's token ids, or a conversation's under the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = None
    add_special_tokens: bool = False  # accepted; the tokenizer's encode decides


class DetokenizeRequest(_Strict):
    """POST /detokenize (vLLM's)."""

    model: str | None = None
    tokens: list[int]
