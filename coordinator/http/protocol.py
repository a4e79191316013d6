"""The OpenAI API's shapes as the front reads and writes them: the requests of /v1/completions and
/v1/chat/completions (their parameters as OpenAI and vLLM define them), the pieces of a response,
and the error object. No I/O here.

Unknown fields are ignored (as vLLM does); a field of the wrong type or out of range is a 400 that
names it. Fields OpenAI defines that Tandem cannot honour (penalties, logit_bias, echo, tools,
response_format) are a 400 when set to anything but their neutral value, rather than ignored.

Per-request speculative stats: vLLM reports them in a top-level `metrics.speculative_decoding`
object (vLLM PR #48915, `--per-request-spec-decode-metrics`): num_spec_steps, num_draft_tokens,
num_accepted_draft_tokens, mean_acceptance_length, draft_acceptance_rate, acceptance_histogram (index j:
verify steps that accepted exactly j drafts), num_spec_tokens. Tandem always sends it, with
accepted_per_position (rounds in which draft k+1 was accepted) added.
"""

from __future__ import annotations

import grpc
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from tandem.errors import status_of
from tandem.params import MAX_LOGPROBS
from tandem.protocol import TokenLogprob
from tandem.stats import GenerationStats, mean_acceptance_length

# Independent samples per prompt (`n`): each is a generation of its own, and counts against max_sessions.
MAX_N = 128

# gRPC status -> HTTP status and the error's type (vLLM's names).
HTTP_STATUS: dict[grpc.StatusCode, tuple[int, str]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "BadRequestError"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "BadRequestError"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "BadRequestError"),
    grpc.StatusCode.NOT_FOUND: (404, "NotFoundError"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "RateLimitError"),
    grpc.StatusCode.UNAVAILABLE: (503, "ServiceUnavailableError"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "TimeoutError"),
}
INTERNAL = (500, "InternalServerError")


def error_body(status: int, kind: str, message: str, param: str | None = None) -> dict:
    """The OpenAI error object; `code` is the HTTP status, as vLLM sends it."""
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def describe(exc: ValidationError) -> tuple[str, str | None]:
    """A pydantic error as (message, the first bad field's name)."""
    parts, param = [], None
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"])
        param = param or (str(err["loc"][0]) if err["loc"] else None)  # the request's field (not a union's member)
        parts.append(f"{where + ': ' if where else ''}{err['msg'].removeprefix('Value error, ')}")
    return "; ".join(parts), param


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


class _Sampling(BaseModel):
    """What the two endpoints share."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0)  # OpenAI's default: sampling
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=-1)  # vLLM: -1 or 0 disable it
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = []  # vLLM's extension
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # vLLM's extension: generate max_tokens whatever the model says
    user: str | None = None  # ignored
    # Tandem's extensions: K, draft tokens per round, and target-only decoding
    num_draft_tokens: int | None = None
    speculate: bool = True
    # OpenAI's that Tandem does not implement: refused unless neutral
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[str, float] | None = None

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, v: float) -> float:
        if v:
            raise ValueError("penalties are not supported; send 0")
        return v

    @field_validator("repetition_penalty")
    @classmethod
    def _no_repetition_penalty(cls, v: float) -> float:
        if v != 1.0:
            raise ValueError("repetition_penalty is not supported; send 1")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _no_logit_bias(cls, v):
        if v:
            raise ValueError("logit_bias is not supported")
        return v

    @property
    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's default for completions
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # alternatives per token
    echo: bool = False
    suffix: str | None = None

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v: bool) -> bool:
        if v:
            raise ValueError("echo is not supported")
        return v

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v):
        if not v or (isinstance(v, list) and any(not p for p in v if isinstance(p, (str, list)))):
            raise ValueError("the prompt is empty")
        return v

    @property
    def prompts(self) -> list[str | list[int]]:
        """Each prompt of the batch: text, or token ids."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)

    @property
    def top_logprobs(self) -> int | None:
        return self.logprobs


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_call_id, ... reach the template

    role: str
    content: str | list[dict] | None = None


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True  # vLLM's extension
    chat_template_kwargs: dict | None = None  # vLLM's extension: more variables for the template
    tools: list | None = None
    response_format: dict | None = None

    @field_validator("tools")
    @classmethod
    def _no_tools(cls, v):
        if v:
            raise ValueError("tool calling is not supported")
        return v

    @field_validator("response_format")
    @classmethod
    def _text_only(cls, v):
        if v and v.get("type", "text") != "text":
            raise ValueError("only text responses are supported")
        return v

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def wanted_logprobs(self) -> int | None:
        """Alternatives per token the target returns (None: no logprobs)."""
        return (self.top_logprobs or 0) if self.logprobs else None


# -- the pieces of a response -----------------------------------------------------------------------


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def spec_metrics(stats: list[GenerationStats]) -> dict:
    """vLLM's `metrics.speculative_decoding` over the request's generations (one per choice), with
    Tandem's accepted_per_position. A round that verified fewer drafts than K (the K policy) or none
    (target-only) is a step that accepted what it accepted."""
    k = max((len(s.accepted_per_position) for s in stats), default=0)
    steps = sum(s.num_rounds for s in stats)
    drafted = sum(s.num_draft_tokens for s in stats)
    accepted = sum(s.num_accepted_tokens for s in stats)
    per_position = [sum(s.accepted_per_position[j] for s in stats if j < len(s.accepted_per_position))
                    for j in range(k)]
    # accepted drafts form a prefix: steps that accepted at least j = per_position[j - 1]
    at_least = [steps, *per_position, 0]
    return {
        "speculative_decoding": {
            "num_spec_steps": steps,
            "num_draft_tokens": drafted,
            "num_accepted_draft_tokens": accepted,
            "mean_acceptance_length": mean_acceptance_length(accepted, steps),
            "draft_acceptance_rate": accepted / drafted if drafted else 0.0,
            "acceptance_histogram": [at_least[j] - at_least[j + 1] for j in range(k + 1)],
            "num_spec_tokens": k,
            "accepted_per_position": per_position,
        }
    }


class TokenText:
    """Token ids -> the strings logprobs show them as (the token's own decoded text)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token: int) -> str:
        text = self._cache.get(token)
        if text is None:
            if self.tokenizer is None:
                text = f"token_id:{token}"
            else:
                text = self.tokenizer.decode([token], skip_special_tokens=False)
            self._cache[token] = text
        return text


def chat_logprobs(token_ids: list[int], logprobs: list[TokenLogprob], text: TokenText) -> list[dict]:
    """The `content` entries of a chat choice's logprobs."""
    out = []
    for token, lp in zip(token_ids, logprobs, strict=True):
        s = text(token)
        out.append({
            "token": s, "logprob": lp.logprob, "bytes": list(s.encode()),
            "top_logprobs": [{"token": (t := text(i)), "logprob": v, "bytes": list(t.encode())}
                             for i, v in zip(lp.top_ids, lp.top_logprobs, strict=True)],
        })
    return out


class CompletionLogprobs:
    """A completion choice's legacy logprobs object, built up delta by delta."""

    def __init__(self, text: TokenText):
        self.text = text
        self.offset = 0

    def add(self, token_ids: list[int], logprobs: list[TokenLogprob]) -> dict:
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token, lp in zip(token_ids, logprobs, strict=True):
            s = self.text(token)
            out["tokens"].append(s)
            out["token_logprobs"].append(lp.logprob)
            top: dict[str, float] = {}
            for i, v in zip(lp.top_ids, lp.top_logprobs, strict=True):
                top.setdefault(self.text(i), v)  # two tokens may read the same ("\ufffd"): the likelier one
            top.setdefault(s, lp.logprob)  # the sampled token, as vLLM includes it
            out["top_logprobs"].append(top)
            out["text_offset"].append(self.offset)
            self.offset += len(s)
        return out


def merge_completion_logprobs(parts: list[dict]) -> dict:
    return {key: [x for part in parts for x in part[key]]
            for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}


class HTTPError(Exception):
    def __init__(self, status: int, kind: str, message: str, param: str | None = None):
        super().__init__(message)
        self.body = error_body(status, kind, message, param)
        self.status = status


def http_error(exc: BaseException) -> HTTPError:
    """A typed error (tandem/errors.py) as the OpenAI error object with the HTTP status of its gRPC code."""
    if isinstance(exc, HTTPError):
        return exc
    if isinstance(exc, ValidationError):
        message, param = describe(exc)
        return HTTPError(400, "BadRequestError", message, param)
    status = status_of(exc)
    if status is None:
        return HTTPError(*INTERNAL, f"{type(exc).__name__}: {exc}")
    code, message = status
    return HTTPError(*HTTP_STATUS.get(code, INTERNAL), message)
