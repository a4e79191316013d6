"""The OpenAI API's shapes as the front reads and writes them: the requests of /v1/completions and
/v1/chat/completions (their parameters as OpenAI and vLLM define them), the pieces of a response,
and the error object. No I/O here. A structured output's fields are read in structured.py, a response's
logprobs written in logprobs.py.

A request's JSON goes through fields.py first: nulls are fields left out, and a field OpenAI or vLLM
defines that Tandem does not implement is a 400 naming it unless neutral. Unknown fields are ignored
(as vLLM does); a field of the wrong type or out of range is a 400 that names it.

Errors are OpenAI's error object: `type` invalid_request_error (400, 404), rate_limit_error (429),
server_error (5xx); `code` a string, the ones OpenAI sends where it has one (context_length_exceeded,
model_not_found, unsupported_parameter, invalid_value, ...).

Per-request speculative stats: vLLM reports them in a top-level `metrics.speculative_decoding`
object (vLLM PR #48915, `--per-request-spec-decode-metrics`): num_spec_steps, num_draft_tokens,
num_accepted_draft_tokens, mean_acceptance_length, draft_acceptance_rate, acceptance_histogram (index j:
verify steps that accepted exactly j drafts), num_spec_tokens. Tandem always sends it, with
accepted_per_position (rounds in which draft k+1 was accepted) added.
"""

from __future__ import annotations

from typing import ClassVar

import grpc
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)

from coordinator.http import fields, tools
from coordinator.http.fields import Unsupported
from coordinator.http.structured import STRUCTURED_FIELDS, grammar_spec
from tandem.errors import status_of
from tandem.params import MAX_LOGPROBS, GrammarSpec
from tandem.stats import GenerationStats, mean_acceptance_length

# Independent samples per prompt (`n`): each is a generation of its own, and counts against max_sessions.
MAX_N = 128

INVALID = "invalid_request_error"
# gRPC status -> HTTP status, the error's type and its code.
HTTP_STATUS: dict[grpc.StatusCode, tuple[int, str, str]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, INVALID, "invalid_value"),
    grpc.StatusCode.OUT_OF_RANGE: (400, INVALID, "context_length_exceeded"),  # the prompt or max_tokens
    grpc.StatusCode.FAILED_PRECONDITION: (400, INVALID, "failed_precondition"),
    grpc.StatusCode.NOT_FOUND: (404, INVALID, "not_found"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error", "rate_limit_exceeded"),
    grpc.StatusCode.UNAVAILABLE: (503, "server_error", "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "server_error", "timeout"),
}
INTERNAL = (500, "server_error", "internal_error")
# The code of an error raised with an HTTP status only.
STATUS_CODES = {400: "invalid_value", 401: "invalid_api_key", 404: "not_found", 405: "method_not_allowed",
                413: "request_too_large", 429: "rate_limit_exceeded", 500: "internal_error",
                503: "service_unavailable", 504: "timeout"}
# pydantic's error types -> OpenAI's codes for a bad field.
PYDANTIC_CODES = {"missing": "missing_required_parameter", "extra_forbidden": "unknown_parameter"}


def error_body(status: int, kind: str, message: str, param: str | None = None, code: str | None = None) -> dict:
    """The OpenAI error object; `kind` is its type; `code` defaults to the HTTP status's."""
    return {"error": {"message": message, "type": kind, "param": param,
                      "code": code or STATUS_CODES.get(status, "error")}}


def describe(exc: ValidationError) -> tuple[str, str | None, str]:
    """A pydantic error as (message, the first bad field's name, its code)."""
    parts, param, code = [], None, None
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"])
        param = param or (str(err["loc"][0]) if err["loc"] else None)  # the request's field (not a union's member)
        kind = err["type"]
        code = code or PYDANTIC_CODES.get(kind, "invalid_type" if kind.endswith(("_type", "_parsing")) else
                                          "invalid_value")
        parts.append(f"{where + ': ' if where else ''}{err['msg'].removeprefix('Value error, ')}")
    return "; ".join(parts), param, code or "invalid_value"


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, the usage so far on every chunk


class _Sampling(BaseModel):
    """What the two endpoints share. Sampling left unset (None) takes the model's defaults
    (coordinator/model_defaults.py)."""

    model_config = ConfigDict(extra="ignore")
    REFUSED: ClassVar[dict[str, fields.Refused]] = fields.COMMON
    _grammar: GrammarSpec | None = PrivateAttr(None)

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)  # vLLM: -1 or 0 disable it
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = []  # vLLM's extension
    include_stop_str_in_output: bool = False  # vLLM's: the stop string ends the text instead of being cut
    skip_special_tokens: bool = True  # vLLM's: special tokens left out of the text
    n: int = Field(1, ge=1, le=MAX_N)
    best_of: int | None = Field(None, ge=1)  # each choice is its own sample: best_of 1, or n
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # vLLM's extension: generate max_tokens whatever the model says
    # vLLM's: only the prompt's last k tokens (-1: the context's worth)
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    request_id: str | None = Field(None, min_length=1)  # vLLM's: the response's id
    return_tokens_as_token_ids: bool = False  # vLLM's: logprobs' tokens as "token_id:N"
    return_token_ids: bool = False  # vLLM's: the prompt's and the choices' token ids beside the text
    # Identifiers that by their definition change nothing in the answer (abuse monitoring, cache routing)
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    cache_salt: str | None = Field(None, min_length=1)  # no prefix cache is shared between requests
    # Tandem's extensions: K, draft tokens per round, and target-only decoding
    num_draft_tokens: int | None = None
    speculate: bool = True
    # Penalties (OpenAI's presence and frequency, vLLM's repetition; None: the checkpoint's), vLLM's min_p
    # and min_tokens: lossless under speculation (target_server/logits.py)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0)
    min_p: float | None = Field(None, ge=0, le=1)
    min_tokens: int = Field(0, ge=0)
    # Structured outputs (tandem/constraint.py): OpenAI's response_format, vLLM's structured_outputs and
    # its older guided_* fields; at most one of them
    response_format: dict | None = None
    structured_outputs: dict | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _prepare(cls, data):
        return fields.prepare(data, cls.REFUSED) if isinstance(data, dict) else data

    @model_validator(mode="after")
    def _best_of(self):
        if self.best_of not in (None, 1, self.n):
            raise Unsupported("best_of", f"`best_of` {self.best_of}: the best of more samples than are returned is "
                              f"not supported; send 1 or n ({self.n})", "unsupported_value")
        return self

    @model_validator(mode="after")
    def _structured(self):
        given = [name for name in STRUCTURED_FIELDS if getattr(self, name) is not None and
                 not (name == "response_format" and self.response_format.get("type", "text") == "text")]
        if len(given) > 1:
            raise Unsupported(given[1], f"give one structured output, not {' and '.join(f'`{g}`' for g in given)}",
                              "invalid_value")
        if self.guided_decoding_backend not in (None, "auto", "guidance", "llguidance"):
            raise Unsupported("guided_decoding_backend", f"`guided_decoding_backend` {self.guided_decoding_backend!r}:"
                              " the grammar engine is llguidance; send \"auto\" or \"guidance\"", "unsupported_value")
        self._grammar = grammar_spec(self, given[0]) if given else None
        max_new = self.max_tokens if not hasattr(self, "max_completion_tokens") else (
            self.max_completion_tokens or self.max_tokens)
        if max_new is not None and self.min_tokens > max_new:
            raise Unsupported("min_tokens", f"`min_tokens` {self.min_tokens} is more than the {max_new} max_tokens",
                              "invalid_value")
        return self

    @property
    def grammar(self) -> GrammarSpec | None:
        """The structured output asked for (None: free text)."""
        return self._grammar

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _truncate(cls, v: int | None) -> int | None:
        if v == 0:
            raise ValueError("truncate_prompt_tokens is -1 (the context's worth) or >= 1")
        return v

    @property
    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and self.stream_options.continuous_usage_stats


class CompletionRequest(_Sampling):
    REFUSED: ClassVar[dict[str, fields.Refused]] = fields.COMPLETION

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's default for completions
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # alternatives per token
    add_special_tokens: bool = True  # vLLM's: BOS and the like around the prompt's text
    suffix: str | None = None  # fill in the middle, between the prompt and it (tokens.fim_prompt)

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


class Conversation(BaseModel):
    """Messages and how the template renders them (vLLM's extensions): for a chat and a chat /tokenize."""

    model_config = ConfigDict(extra="ignore")

    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool | None = None  # unset: true, unless continue_final_message
    continue_final_message: bool = False  # the last (assistant) message left open, to be continued
    chat_template_kwargs: dict | None = None  # more variables for the template
    documents: list[dict] | None = None  # for templates that render retrieved documents
    tools: list[dict] | None = None  # function tools, rendered by the template (tools.py)
    add_special_tokens: bool = False  # on top of the template's own (it writes BOS itself)

    @model_validator(mode="after")
    def _generation_prompt(self):
        if self.continue_final_message and self.add_generation_prompt:
            raise Unsupported("continue_final_message", "`continue_final_message` and `add_generation_prompt` "
                              "cannot both be true", "invalid_value")
        return self

    @property
    def generation_prompt(self) -> bool:
        if self.add_generation_prompt is None:
            return not self.continue_final_message
        return self.add_generation_prompt


class ChatRequest(Conversation, _Sampling):
    REFUSED: ClassVar[dict[str, fields.Refused]] = fields.CHAT

    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tool_choice: str | dict | None = None  # tools.py
    parallel_tool_calls: bool = True
    _tool_mode: str = PrivateAttr("none")
    _tool_named: str | None = PrivateAttr(None)

    @model_validator(mode="after")
    def _tools(self):
        functions = tools.check_tools(self.tools or [])
        self._tool_mode, self._tool_named = tools.choice_mode(self.tool_choice, functions)
        forced = tools.tool_grammar(self._tool_mode, self._tool_named, functions, self.parallel_tool_calls)
        if forced is not None:
            if self._grammar is not None:
                raise Unsupported("tool_choice", f"`tool_choice` {self._tool_mode} forces the answer's form: it "
                                  "cannot be given with a structured output", "invalid_value")
            self._grammar = forced
        if self.tool_mode != "none" and self.logprobs:
            raise Unsupported("logprobs", "`logprobs` with tool calls is not supported yet", "unsupported_parameter")
        return self

    @property
    def tool_mode(self) -> str:
        """none (text), auto (parsed), required or named (forced by a grammar): tools.py."""
        return self._tool_mode

    @property
    def tool_named(self) -> str | None:
        return self._tool_named

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs(cls, v: int | None, info) -> int | None:
        if v and not info.data.get("logprobs"):
            raise ValueError("when using `top_logprobs`, `logprobs` must be set to true")
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


class HTTPError(Exception):
    def __init__(self, status: int, kind: str, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.body = error_body(status, kind, message, param, code)
        self.status = status


def bad_request(message: str, param: str | None = None, code: str = "invalid_value") -> HTTPError:
    return HTTPError(400, INVALID, message, param, code)


def http_error(exc: BaseException) -> HTTPError:
    """A typed error (tandem/errors.py) as the OpenAI error object with the HTTP status of its gRPC code."""
    if isinstance(exc, HTTPError):
        return exc
    if isinstance(exc, Unsupported):
        return bad_request(exc.message, exc.field, exc.code)
    if isinstance(exc, ValidationError):
        return bad_request(*describe(exc))
    status = status_of(exc)
    if status is None:
        return HTTPError(*INTERNAL[:2], f"{type(exc).__name__}: {exc}", None, INTERNAL[2])
    code, message = status
    http, kind, error_code = HTTP_STATUS.get(code, INTERNAL)
    return HTTPError(http, kind, message, None, error_code)
