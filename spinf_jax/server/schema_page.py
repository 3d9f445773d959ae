"""GET /schema: the API's routes as a page that needs nothing from the network. Litestar's viewers (Swagger,
Redoc, ...) load their scripts from a CDN, which left the page blank on a machine offline; this one is HTML
written here from the OpenAPI document, each route with its summary and a link to the document itself
(/schema/openapi.json, /schema/openapi.yaml), which tools and viewers read."""

import html
from typing import Any

from litestar import Request
from litestar.openapi.plugins import JsonRenderPlugin, OpenAPIRenderPlugin, YamlRenderPlugin

METHODS = ("get", "post", "put", "patch", "delete")


class RoutesPage(OpenAPIRenderPlugin):
    def __init__(self) -> None:
        super().__init__(path="/")

    def render(self, request: Request, openapi_schema: dict[str, Any]) -> bytes:
        info = openapi_schema.get("info", {})
        rows = []
        for path, item in openapi_schema.get("paths", {}).items():
            for method in METHODS:
                if method in item:
                    op = item[method]
                    what = op.get("summary") or (op.get("description") or "").split("\n")[0]
                    rows.append(
                        f"<tr><td><code>{method.upper()}</code></td><td><code>{html.escape(path)}</code></td>"
                        f"<td>{html.escape(what)}</td></tr>"
                    )
        title = html.escape(f"{info.get('title', 'API')} {info.get('version', '')}")
        page = (
            f"<!doctype html><html><head><meta charset='utf-8'><title>{title}</title></head><body>"
            f"<h1>{title}</h1><p>The OpenAPI document: <a href='openapi.json'>openapi.json</a>, "
            "<a href='openapi.yaml'>openapi.yaml</a> (any OpenAPI viewer reads it). docs/api.md says what "
            "each field means.</p><table><tr><th>method</th><th>route</th><th>what</th></tr>"
            + "".join(rows)
            + "</table></body></html>"
        )
        return page.encode()


def schema_plugins() -> list[OpenAPIRenderPlugin]:
    return [RoutesPage(), JsonRenderPlugin(path="/openapi.json"), YamlRenderPlugin(path="/openapi.yaml")]
