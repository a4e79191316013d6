"""Tool calling in the chat API: `tools` reach the chat template (as transformers' apply_chat_template(tools=...)
passes them); what the model writes becomes OpenAI's `tool_calls`.

- `tool_choice` "none": the tools are rendered, the answer is text.
- "auto" (the default with tools): the answer is parsed in the template's format, as vLLM's parsers of these
  names parse it: `hermes`, each call a `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Qwen2.5,
  Hermes; the text before the first is the content), or `llama3_json`, the answer one JSON object
  `{"name": ..., "parameters": {...}}` (or several joined by ";"), optionally after `<|python_tag|>`. The
  parser is the one whose marks the chat template writes (`<tool_call>`: hermes; `<|python_tag|>` or
  `ipython`: llama3_json; else hermes). An answer that does not parse is text.
- "required" and a named function: the answer is forced by a JSON schema grammar (tandem/constraint.py), as
  vLLM forces them: a JSON array of {"name", "parameters"} objects, one of the tools each (required), or the
  named function's arguments themselves (named).
"""

from __future__ import annotations

import json
import re
import uuid

from coordinator.http.fields import Unsupported
from tandem.params import GrammarSpec

HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def check_tools(tools: list[dict]) -> dict[str, dict]:
    """{name: its parameters' schema}; Unsupported naming what is wrong."""
    out: dict[str, dict] = {}
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(function, dict):
            raise Unsupported("tools", f"`tools[{i}]` is not a function tool ({{\"type\": \"function\", "
                              "\"function\": {\"name\": ..., \"parameters\": ...}})", "invalid_value")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise Unsupported("tools", f"`tools[{i}].function.name` is missing", "invalid_value")
        parameters = function.get("parameters") or {"type": "object", "properties": {}}
        if not isinstance(parameters, dict):
            raise Unsupported("tools", f"`tools[{i}].function.parameters` is not a JSON schema", "invalid_value")
        out[name] = parameters
    return out


def choice_mode(tool_choice, tools: dict[str, dict]) -> tuple[str, str | None]:
    """("none" | "auto" | "required" | "named", the named function)."""
    if tool_choice is None:
        return ("auto" if tools else "none"), None
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise Unsupported("tool_choice", f"`tool_choice` {tool_choice!r}: send \"none\", \"auto\", \"required\" "
                              "or {\"type\": \"function\", \"function\": {\"name\": ...}}", "invalid_value")
        if tool_choice != "none" and not tools:
            raise Unsupported("tool_choice", f"`tool_choice` {tool_choice!r} needs `tools`", "invalid_value")
        return tool_choice, None
    name = (tool_choice.get("function") or {}).get("name") if isinstance(tool_choice, dict) else None
    if not isinstance(name, str):
        raise Unsupported("tool_choice", "`tool_choice` names a function as {\"type\": \"function\", \"function\": "
                          "{\"name\": ...}}", "invalid_value")
    if name not in tools:
        raise Unsupported("tool_choice", f"`tool_choice` names {name!r}, which is not in `tools`", "invalid_value")
    return "named", name


def tool_grammar(mode: str, named: str | None, tools: dict[str, dict], parallel: bool = True) -> GrammarSpec | None:
    """The grammar that forces `required` (one call, with parallel_tool_calls false) or a named function."""
    if mode == "named":
        return GrammarSpec(kind="json_schema", value=json.dumps(tools[named]))
    if mode != "required":
        return None
    calls = [{"type": "object", "properties": {"name": {"const": name}, "parameters": schema},
              "required": ["name", "parameters"], "additionalProperties": False} for name, schema in tools.items()]
    array = {"type": "array", "minItems": 1, "items": {"anyOf": calls}, **({} if parallel else {"maxItems": 1})}
    return GrammarSpec(kind="json_schema", value=json.dumps(array))


def parser_for(template: str | None) -> str:
    template = template or ""
    if "<tool_call>" in template:
        return "hermes"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3_json"
    return "hermes"


def parse(text: str, mode: str, named: str | None, parser: str, parallel: bool = True
          ) -> tuple[str | None, list[dict]]:
    """The answer's (content, tool calls as OpenAI's `tool_calls` entries)."""
    calls: list[tuple[str, object]] = []
    content: str | None = text
    if mode == "named":
        calls, content = [(named, text)], None
    elif mode == "required":
        try:
            calls, content = [(c["name"], c["parameters"]) for c in json.loads(text)], None
        except (json.JSONDecodeError, KeyError, TypeError):  # cut by max_tokens: no whole call
            calls = []
    elif mode == "auto" and parser == "hermes" and "<tool_call>" in text:
        found = []
        for body in HERMES_CALL.findall(text):
            try:
                call = json.loads(body)
                found.append((call["name"], call.get("arguments", call.get("parameters", {}))))
            except (json.JSONDecodeError, KeyError, TypeError):
                found = []
                break
        if found:
            calls, content = found, text[: text.index("<tool_call>")].strip() or None
    elif mode == "auto" and parser == "llama3_json":
        body = text.strip().removeprefix("<|python_tag|>").strip()
        if body.startswith("{"):
            try:
                objects = [json.loads(part) for part in body.split(";") if part.strip()]
                calls = [(o["name"], o.get("parameters", o.get("arguments", {}))) for o in objects]
                content = None
            except (json.JSONDecodeError, KeyError, TypeError):
                calls = []
    if not parallel:
        calls = calls[:1]
    return content, [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": name, "arguments": args if isinstance(args, str) else json.dumps(args)}}
                     for name, args in calls]


def template_messages(messages: list[dict]) -> list[dict]:
    """Assistant tool calls as templates read them: arguments a mapping, not OpenAI's JSON text (as vLLM and
    transformers hand them to the template)."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if isinstance(calls, list):
            fixed = []
            for call in calls:
                function = dict(call.get("function") or {}) if isinstance(call, dict) else {}
                if isinstance(function.get("arguments"), str):
                    try:
                        function["arguments"] = json.loads(function["arguments"])
                    except json.JSONDecodeError:
                        pass
                fixed.append({**call, "function": function} if isinstance(call, dict) else call)
            m = {**m, "tool_calls": fixed}
        out.append(m)
    return out
