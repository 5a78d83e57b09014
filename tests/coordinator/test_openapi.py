"""The served OpenAPI document: generated from the protocol models, one operation per route."""

from __future__ import annotations

from coordinator.openapi import OPERATIONS, build_openapi


def test_document_is_openapi_31_with_resolvable_refs():
    doc = build_openapi("epd", "1")
    assert doc["openapi"] == "3.1.0"
    schemas = doc["components"]["schemas"]
    text = str(doc)
    for name in ("ChatCompletionRequest", "CompletionRequest", "GenerateRequest", "ErrorResponse"):
        assert name in schemas
    assert "InstanceAnnouncement" not in schemas  # the admin API's (coordinator/admin.py), not the public one
    import re

    assert {ref for ref in re.findall(r"#/components/schemas/(\w+)", text)} <= set(schemas)


def test_every_coordinator_route_is_documented(coordinator_app):
    app = coordinator_app
    routes = {(m.lower(), r.path) for r in app.routes() for m in (r.methods or ()) if m != "HEAD"}
    documented = {(method, path) for method, path, *_ in OPERATIONS}
    undocumented = routes - documented - {("get", "/metrics"), ("get", "/openapi.json")}
    assert undocumented == set()
    assert documented <= routes
