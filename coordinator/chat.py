"""Chat messages -> prompt text, rendered with the target checkpoint's chat template the way
transformers' `apply_chat_template` renders it: a sandboxed jinja2 environment with trim_blocks and
lstrip_blocks, `raise_exception`, `strftime_now`, a `tojson` that does not escape HTML, the special
tokens (bos_token, eos_token, ...) and `add_generation_prompt`. The coordinator has no transformers:
the template and the special tokens come from the target (TargetInfo)."""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache

import jinja2
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from tandem.errors import InvalidRequest


class _Generation(Extension):
    """`{% generation %}...{% endgeneration %}` (templates that mark assistant turns for training):
    rendered as its body, as transformers does when it is not tracking them."""

    tags = frozenset({"generation"})

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=8)
def compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def message_text(content, where: str = "content") -> str:
    """A message's content as text: a string, or the text parts of a list of parts (vLLM's "string"
    content format); None (an assistant turn with tool calls only) is empty."""
    if content is None or isinstance(content, str):
        return content or ""
    kinds = {part.get("type") for part in content} - {"text"}
    if kinds:
        raise InvalidRequest(f"only text content parts are supported, got {sorted(map(str, kinds))}")
    for i, part in enumerate(content):
        if not isinstance(part.get("text"), str):
            raise InvalidRequest(f"{where}[{i}] is a text part without a `text` string")
    return "\n".join(part["text"] for part in content)


# Marks the end of the message to continue (transformers' tag): the rendering is cut where it appears.
CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def render_chat(template: str, messages: list[dict], special_tokens: dict[str, str],
                add_generation_prompt: bool = True, continue_final_message: bool = False,
                documents: list[dict] | None = None, template_kwargs: dict | None = None,
                tools: list[dict] | None = None) -> str:
    """The prompt text; InvalidRequest when the model has no template, a keyword clashes with what the
    renderer passes, or the template refuses the conversation (its raise_exception: e.g. roles out of
    order). `continue_final_message`: the last message left open for the model to continue, cut as
    transformers' apply_chat_template(continue_final_message=True) cuts it."""
    if not template:
        raise InvalidRequest("the model has no chat template: give the coordinator one (--chat-template), or use "
                             "/v1/completions with the prompt as text")
    if continue_final_message and add_generation_prompt:
        raise InvalidRequest("continue_final_message and add_generation_prompt cannot both be true")
    given = {"messages": messages, "add_generation_prompt": add_generation_prompt, **special_tokens,
             **({"documents": documents} if documents is not None else {}),
             **({"tools": tools} if tools else {})}
    kwargs = template_kwargs or {}
    passed = {*given, *compile_template(template).globals}  # raise_exception and the like too
    clash = sorted(set(kwargs) & passed)
    if clash:
        raise InvalidRequest(f"chat_template_kwargs {clash} clash with what the renderer passes the template "
                             f"({', '.join(sorted(passed))})")
    messages = [{**m, "content": message_text(m.get("content"), f"messages[{i}].content")}
                for i, m in enumerate(messages)]
    if continue_final_message:
        final = messages[-1]["content"]
        messages[-1] = {**messages[-1], "content": final + CONTINUE_TAG}
    try:
        text = compile_template(template).render(**{**given, "messages": messages}, **kwargs)
    except jinja2.exceptions.TemplateError as exc:
        raise InvalidRequest(f"the chat template refused the messages: {exc}") from None
    except (TypeError, ValueError, KeyError, AttributeError, IndexError, OverflowError) as exc:
        # a template that fails on what the request sent (a number where it joins strings, ...) fails that request
        raise InvalidRequest(f"the chat template failed on the request: {type(exc).__name__}: {exc}") from None
    if not continue_final_message:
        return text
    at = text.rfind(CONTINUE_TAG.strip())
    if at < 0 or final.strip() not in text:
        raise InvalidRequest("continue_final_message: the final message does not appear in the rendered chat "
                             "(the template drops part of it)")
    if text[at : at + len(CONTINUE_TAG)] == CONTINUE_TAG:
        return text[:at]  # the template kept the message's spacing
    return text[:at].rstrip()  # it trimmed the message: so the tag's space, and the message's own
