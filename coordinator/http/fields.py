"""How the front reads a request's JSON before its fields are validated (protocol.py), and the fields of
OpenAI's chat and completions APIs and vLLM's extensions that Tandem does not implement.

- An explicit `null` is the field left out: wrappers (LangChain, the SDKs' TypedDicts filled from
  Python keyword arguments) send None for what the caller did not set.
- A field Tandem does not implement is a 400 naming it (code `unsupported_parameter`) unless it holds its
  neutral value (presence_penalty 0, tool_choice "none", echo false, ...): refused, never ignored.

A field in neither this module's tables nor protocol.py's models is in neither API and is ignored, as
vLLM ignores it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


class Unsupported(Exception):
    """A field the front does not implement, set to something other than its neutral value. Not a
    ValueError: pydantic lets it through as it is, with the field's name for the error's `param`."""

    def __init__(self, field: str, message: str, code: str = "unsupported_parameter"):
        super().__init__(message)
        self.field, self.message, self.code = field, message, code


@dataclass(frozen=True)
class Refused:
    neutral: Callable[[object], bool]  # the values that ask for nothing Tandem lacks
    why: str


def _is(*values) -> Callable[[object], bool]:
    return lambda v: any(v == x and type(v) is not bool or v is x for x in values)


def _empty(v) -> bool:
    return v in ({}, [], "")


_never = _is()

TOOLS = "the deprecated function-calling fields are not supported"

# Both endpoints. The penalties, min_p, min_tokens and the structured outputs (response_format,
# structured_outputs, guided_json / guided_regex / guided_choice / guided_grammar) are implemented
# (protocol.py, tandem/constraint.py).
COMMON: dict[str, Refused] = {
    "logit_bias": Refused(_empty, "not supported yet"),
    "allowed_token_ids": Refused(_empty, "not supported yet"),
    "bad_words": Refused(_empty, "not supported yet"),
    "logits_processors": Refused(_empty, "logits processors are not supported"),
    "use_beam_search": Refused(_is(False), "beam search is not supported"),
    "length_penalty": Refused(_is(1), "applies to beam search, which is not supported: send 1"),
    "prompt_logprobs": Refused(_never, "prompt logprobs are not supported yet"),
    "spaces_between_special_tokens": Refused(_is(True), "spaces between special tokens are not supported: send true"),
    "guided_whitespace_pattern": Refused(_never, "a JSON grammar's whitespace is json.dumps' (\", \" and \": \"); "
                                         "another pattern is not supported"),
    "structural_tag": Refused(_never, "structural tags are not supported"),
    "priority": Refused(_is(0), "priority scheduling is not supported: send 0"),
    "kv_transfer_params": Refused(_empty, "disaggregated serving (KV transfer) is not supported"),
    "vllm_xargs": Refused(_empty, "vLLM's custom extensions are not supported"),
    "store": Refused(_is(False), "stored completions are not supported: send false"),
    "metadata": Refused(_empty, "kept with stored completions, which are not supported"),
    "service_tier": Refused(_is("auto", "default"), "one service tier: send \"auto\" or \"default\""),
}

CHAT: dict[str, Refused] = {
    **COMMON,
    "functions": Refused(_empty, f"{TOOLS}: send `tools`"),
    "function_call": Refused(_is("none"), f"{TOOLS}: send `tool_choice`"),
    "audio": Refused(_never, "audio output is not supported"),
    "modalities": Refused(lambda v: v == ["text"], "text is the only modality: send [\"text\"]"),
    "prediction": Refused(_never, "predicted outputs are not supported yet"),
    "reasoning_effort": Refused(_never, "not supported"),
    "include_reasoning": Refused(_is(True), "reasoning is not parsed out of the answer: send true"),
    "verbosity": Refused(_never, "not supported"),
    "web_search_options": Refused(_never, "web search is not supported"),
    "echo": Refused(_is(False), "not supported: send false"),
    "chat_template": Refused(_never, "a request's own chat template is not accepted (vLLM's default): start the "
                             "coordinator with --chat-template"),
    "mm_processor_kwargs": Refused(_empty, "multimodal inputs are not supported"),
    "media_io_kwargs": Refused(_empty, "multimodal inputs are not supported"),
    "moderation": Refused(_never, "moderation is not supported"),
    "prompt_cache_options": Refused(_empty, "no prompt cache is kept between requests"),
    "prompt_cache_retention": Refused(_never, "no prompt cache is kept between requests"),
}

COMPLETION: dict[str, Refused] = {
    **COMMON,
    "echo": Refused(_is(False), "not supported: send false"),
    "prompt_embeds": Refused(_never, "prompt embeddings are not supported"),
}

# Inside stream_options.
STREAM_OPTIONS: dict[str, Refused] = {
    "include_obfuscation": Refused(_is(False), "stream obfuscation is not supported: send false"),
}


def without_nulls(body: dict) -> dict:
    return {key: value for key, value in body.items() if value is not None}


def check(body: dict, refused: dict[str, Refused], where: str = "") -> None:
    """Unsupported for the first refused field that is not neutral."""
    for name, rule in refused.items():
        if name in body and not rule.neutral(body[name]):
            raise Unsupported((where or name).split(".")[0], f"`{where}{name}`: {rule.why}")


def prepare(body: dict, refused: dict[str, Refused]) -> dict:
    """The request's fields as its model validates them: nulls dropped, Unsupported for a refused field that
    asks for something, the neutral ones dropped."""
    body = without_nulls(body)
    options = body.get("stream_options")
    if isinstance(options, dict):
        options = without_nulls(options)
        check(options, STREAM_OPTIONS, "stream_options.")
        body["stream_options"] = {k: v for k, v in options.items() if k not in STREAM_OPTIONS}
    check(body, refused)
    return {key: value for key, value in body.items() if key not in refused}
