"""A request's structured output (OpenAI's response_format, vLLM's structured_outputs and its older guided_*
fields) as the one GrammarSpec the grammar engine takes: each field's forms and the errors naming what is wrong."""

from __future__ import annotations

import json

from coordinator.http.fields import Unsupported
from tandem.params import GrammarSpec

STRUCTURED_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                     "guided_grammar")
# vLLM's StructuredOutputsParams keys Tandem implements; the others (structural_tag, whitespace options) are a 400
STRUCTURED_KEYS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
                   "json_object": "json_object"}


def _schema_text(schema, field: str) -> str:
    if isinstance(schema, str):
        return schema
    if not isinstance(schema, (dict, bool)):
        raise Unsupported(field, f"`{field}`: a JSON schema is an object", "invalid_value")
    return json.dumps(schema)


def grammar_spec(request, field: str) -> GrammarSpec | None:
    """The GrammarSpec of a request's structured-output field; Unsupported naming what is wrong."""
    value = getattr(request, field)
    if field == "response_format":
        kind = value.get("type")
        if kind == "json_object":
            return GrammarSpec(kind="json_object")
        if kind != "json_schema":
            raise Unsupported(field, f"`response_format` type {kind!r}: send \"text\", \"json_object\" or "
                              "\"json_schema\"", "invalid_value")
        inner = value.get("json_schema")
        if not isinstance(inner, dict) or "schema" not in inner:
            raise Unsupported(field, "`response_format` json_schema needs `json_schema.schema`", "invalid_value")
        return GrammarSpec(kind="json_schema", value=_schema_text(inner["schema"], "response_format"))
    if field == "structured_outputs":
        asked = {k: v for k, v in value.items() if v is not None and v is not False}
        unknown = sorted(set(asked) - set(STRUCTURED_KEYS))
        if unknown:
            raise Unsupported(field, f"`structured_outputs.{unknown[0]}` is not supported; give one of "
                              f"{', '.join(STRUCTURED_KEYS)}", "unsupported_parameter")
        if len(asked) != 1:
            raise Unsupported(field, f"`structured_outputs` gives one of {', '.join(STRUCTURED_KEYS)}, got "
                              f"{sorted(asked) or 'none'}", "invalid_value")
        ((key, inner),) = asked.items()
        kind = STRUCTURED_KEYS[key]
    else:
        kind, inner = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice",
                       "guided_grammar": "grammar"}[field], value
    if kind == "json_object":
        return GrammarSpec(kind="json_object")
    if kind == "json_schema":
        return GrammarSpec(kind="json_schema", value=_schema_text(inner, field))
    if kind == "choice":
        if not isinstance(inner, list) or not inner or not all(isinstance(c, str) and c for c in inner):
            raise Unsupported(field, f"`{field}`: a choice is a non-empty list of non-empty strings", "invalid_value")
        return GrammarSpec(kind="choice", value=json.dumps(inner))
    if not isinstance(inner, str) or not inner:
        raise Unsupported(field, f"`{field}`: a {kind} is a non-empty string", "invalid_value")
    return GrammarSpec(kind=kind, value=inner)
