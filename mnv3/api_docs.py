"""/docs (Swagger UI) and /redoc (ReDoc) that render with no request leaving the host.

FastAPI's own pages load Swagger UI and ReDoc from a CDN (and ReDoc its fonts from Google), so on an
offline or locked-down host they stay blank. Here the same FastAPI page functions point at copies
served by this app from the `fastapi-standalone-docs` package (PyPI; it ships the npm builds of
swagger-ui-dist and redoc, with ReDoc's CDN logo rewritten to a file beside it), so upgrading them is
a pip upgrade, not files copied by hand. The app must be built with `docs_url=None, redoc_url=None`.
"""

from importlib.resources import files
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

from mnv3.page import FAVICON_PATH

ASSETS = Path(str(files("fastapi_standalone_docs") / "static"))
SWAGGER_URL = "/docs"
REDOC_URL = "/redoc"  # the ReDoc build loads its logo from <page path>/logo-mini.svg: keep the assets under it

docs_router = APIRouter(include_in_schema=False)
docs_router.mount(SWAGGER_URL, StaticFiles(directory=ASSETS / "swagger"), name="swagger_assets")
docs_router.mount(REDOC_URL, StaticFiles(directory=ASSETS / "redoc"), name="redoc_assets")


def _root(request: Request) -> str:
    # Behind a proxy that serves the app under a prefix, every URL on the page needs it too.
    return request.scope.get("root_path", "").rstrip("/")


@docs_router.get(SWAGGER_URL)
async def swagger_ui(request: Request) -> HTMLResponse:
    root = _root(request)
    return get_swagger_ui_html(
        openapi_url=root + request.app.openapi_url,
        title=f"{request.app.title} - Swagger UI",
        swagger_js_url=f"{root}{SWAGGER_URL}/swagger-ui-bundle.js",
        swagger_css_url=f"{root}{SWAGGER_URL}/swagger-ui.css",
        swagger_favicon_url=root + FAVICON_PATH,
    )


@docs_router.get(REDOC_URL)
async def redoc(request: Request) -> HTMLResponse:
    root = _root(request)
    return get_redoc_html(
        openapi_url=root + request.app.openapi_url,
        title=f"{request.app.title} - ReDoc",
        redoc_js_url=f"{root}{REDOC_URL}/redoc.standalone.js",
        redoc_favicon_url=root + FAVICON_PATH,
        with_google_fonts=False,
    )


def without_validation_errors(schema: dict) -> dict:
    """`schema` (the app's OpenAPI document) without FastAPI's 422 answers. FastAPI lists one for every
    operation with a parameter, but every parameter here is a string the handlers read themselves, so no
    request gets one: a generated client would expect a shape (`detail` as a list) that no answer has."""
    for operations in schema["paths"].values():
        for operation in operations.values():
            operation.get("responses", {}).pop("422", None)
    for unused in ("HTTPValidationError", "ValidationError"):
        schema.get("components", {}).get("schemas", {}).pop(unused, None)
    return schema
