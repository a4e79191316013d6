"""The HTTP front's OpenAPI 3.1 document, written from the request models of coordinator/http/protocol.py
and the routes of coordinator/http/app.py: what `schemathesis` fuzzes the front from (tests/test_fuzz.py),
and what a client generator can read. Every route but the open ones (coordinator/http/auth.py) says it
wants a Bearer key."""

from __future__ import annotations

from pydantic.json_schema import models_json_schema

from coordinator.http.auth import OPEN_ROUTES
from coordinator.http.protocol import ChatRequest, CompletionRequest

BODIES = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatRequest}
ERROR = {"description": "an OpenAI error object", "content": {"application/json": {"schema": {
    "type": "object", "required": ["error"], "properties": {"error": {"type": "object", "required": ["message"]}}}}}}


def openapi_schema(routes) -> dict:
    """`routes`: the front's Starlette routes; a body model for each POST route of BODIES."""
    keys, schema = models_json_schema([(model, "validation") for model in BODIES.values()],
                                      ref_template="#/components/schemas/{model}")
    refs = {model: keys[(model, "validation")] for model in BODIES.values()}
    paths: dict[str, dict] = {}
    for route in routes:
        for method in sorted(route.methods - {"HEAD"}):
            operation: dict = {"operationId": f"{method.lower()}{route.path.replace('/', '_')}",
                               "responses": {"200": {"description": "the answer"}, "default": ERROR}}
            if route.path in BODIES:
                operation["requestBody"] = {"required": True, "content": {
                    "application/json": {"schema": refs[BODIES[route.path]]}}}
            operation["security"] = [] if route.path in OPEN_ROUTES else [{"bearer": []}]
            paths.setdefault(route.path, {})[method.lower()] = operation
    return {
        "openapi": "3.1.0",
        "info": {"title": "Tandem's OpenAI-compatible front", "version": "1"},
        "paths": paths,
        "components": {"schemas": schema.get("$defs", {}),
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
    }
