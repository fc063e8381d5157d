"""The OpenAPI 3.1 document of the route table (admin/routes.py): generated, never kept by hand.
Bodies' schemas are their pydantic models' (Tenant's without `keys`, which are made apart)."""

from __future__ import annotations

import copy
import re
from collections.abc import Sequence
from typing import Any

from pydantic.json_schema import models_json_schema

from admin.routes import Route

REF = "#/components/schemas/{model}"
ERROR_REF = REF.format(model="Error")
ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}
LIST = {
    "type": "object",
    "required": ["object", "data", "has_more", "last_id"],
    "properties": {
        "object": {"const": "list"},
        "data": {"type": "array", "items": {"type": "object"}},
        "has_more": {"type": "boolean"},
        "last_id": {"type": ["string", "null"]},
    },
}


def document(routes: Sequence[Route], version: str = "1") -> dict[str, Any]:
    schemas = _body_schemas(routes)
    schemas |= {"Error": ERROR, "List": LIST}
    paths: dict[str, dict[str, Any]] = {}
    for route in routes:
        paths.setdefault(route.path, {})[route.method.lower()] = _operation(route)
    return {
        "openapi": "3.1.0",
        "info": {"title": "llmgw admin API", "version": version},
        "paths": paths,
        "components": {
            "schemas": schemas,
            "securitySchemes": {"adminToken": {"type": "http", "scheme": "bearer"}},
            "responses": {
                "Error": {
                    "description": "OpenAI's error shape",
                    "content": {"application/json": {"schema": {"$ref": ERROR_REF}}},
                }
            },
        },
    }


def _operation(route: Route) -> dict[str, Any]:
    params = [
        {"name": name, "in": "path", "required": True, "schema": {"type": "string"}}
        for name in re.findall(r"{(\w+)}", route.path)
    ]
    params += [
        {"name": p.name, "in": "query", "description": p.description, "schema": p.schema}
        for p in route.query
    ]
    answer: dict[str, Any] = {"type": "object"}
    if route.lists:
        answer = {"$ref": REF.format(model="List")}
    content_type = "text/plain" if route.operation == "metrics" else "application/json"
    op: dict[str, Any] = {
        "operationId": route.operation,
        "summary": route.summary,
        "parameters": params,
        "security": [{"adminToken": []}] if route.auth else [],
        "responses": {
            "200": {"description": "OK", "content": {content_type: {"schema": answer}}},
            "4XX": {"$ref": "#/components/responses/Error"},
            "5XX": {"$ref": "#/components/responses/Error"},
        },
    }
    if route.body is not None:
        name = route.body.__name__ + ("Patch" if route.partial else "")
        op["requestBody"] = {
            "required": not route.partial,
            "content": {"application/json": {"schema": {"$ref": REF.format(model=name)}}},
        }
    return op


def _body_schemas(routes: Sequence[Route]) -> dict[str, Any]:
    models = list({r.body for r in routes if r.body is not None})
    _, top = models_json_schema([(m, "validation") for m in models], ref_template=REF)
    schemas: dict[str, Any] = top.get("$defs", {})
    tenant = schemas.get("Tenant")
    if tenant is not None:
        tenant["properties"].pop("keys", None)  # keys are made apart, never sent in a tenant
        schemas.pop("ApiKey", None)
        patch = copy.deepcopy(tenant)
        patch.pop("required", None)
        patch["title"] = "TenantPatch"
        schemas["TenantPatch"] = patch
    return schemas
