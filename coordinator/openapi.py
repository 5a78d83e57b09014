"""GET /openapi.json: the coordinator's API as OpenAPI 3.1, generated from the protocol models.

Request bodies are the pydantic models the routes parse (their JSON Schema
is what pydantic generates, so the document cannot drift from the code);
answers are described by status: 200 (the endpoint's model where there is
one), 4xx/5xx the one error body.  Property-based tests (schemathesis) fuzz
the coordinator from this document.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from services.protocol.generate import GenerateRequest
from services.protocol.openai import ChatCompletionRequest, CompletionRequest
from services.protocol.openai_responses import ChatCompletionResponse, CompletionResponse, ErrorResponse, ModelList

REF = "#/components/schemas/{model}"
# (method, path, summary, request model, 200 model)
OPERATIONS: list[tuple[str, str, str, type[BaseModel] | None, type[BaseModel] | None]] = [
    ("post", "/v1/chat/completions", "OpenAI chat completion (stream: server-sent events)",
     ChatCompletionRequest, ChatCompletionResponse),
    ("post", "/v1/completions", "OpenAI completion (one prompt)", CompletionRequest, CompletionResponse),
    ("post", "/inference/v1/generate", "Token-in generation over the whole pipeline", GenerateRequest, None),
    ("get", "/v1/models", "The served model", None, ModelList),
    ("get", "/cluster", "Role instances with a fresh health probe", None, None),
    ("get", "/health", "Liveness, with the instances taking work per role", None, None),
    ("get", "/ready", "Readiness: 503 while a role has no ready instance or while draining; names this instance",
     None, None),
]


def _schema(model: type[BaseModel], components: dict[str, Any]) -> dict[str, Any]:
    schema = model.model_json_schema(ref_template=REF)
    components.update(schema.pop("$defs", {}))
    components[model.__name__] = schema
    return {"$ref": REF.format(model=model.__name__)}


def _json(schema: dict[str, Any]) -> dict[str, Any]:
    return {"application/json": {"schema": schema}}


def _operation(summary: str, body: type[BaseModel] | None, answer: type[BaseModel] | None,
               components: dict[str, Any]) -> dict[str, Any]:
    error = {"description": "Error", "content": _json({"$ref": REF.format(model="ErrorResponse")})}
    ok_schema = _schema(answer, components) if answer is not None else {"type": "object"}
    op: dict[str, Any] = {"summary": summary, "responses": {
        "200": {"description": "OK", "content": _json(ok_schema)},
        "4XX": error, "5XX": error}}
    if body is not None:
        op["requestBody"] = {"required": True, "content": _json(_schema(body, components))}
    return op


def build_openapi(title: str, version: str) -> dict[str, Any]:
    components: dict[str, Any] = {}
    _schema(ErrorResponse, components)
    paths: dict[str, dict[str, Any]] = {}
    for method, path, summary, body, answer in OPERATIONS:
        paths.setdefault(path, {})[method] = _operation(summary, body, answer, components)
    return {"openapi": "3.1.0", "info": {"title": title, "version": version}, "paths": paths,
            "components": {"schemas": components}}


class OpenApiRoute:
    """Builds the document once, on first request."""

    def __init__(self, title: str, version: str = "1") -> None:
        self.title, self.version = title, version
        self._doc: dict[str, Any] | None = None

    async def serve(self, _: Request) -> Response:
        if self._doc is None:
            self._doc = build_openapi(self.title, self.version)
        return JSONResponse(self._doc)
