"""GET /: a page to classify photos in the browser and watch the server, served by the server itself.

Plain HTML (`mnv3/page.html`, served only at `/`, with its headers), CSS and JavaScript (`mnv3/static/`;
no build step, no framework, no CDN or external font: nothing the page loads comes from another host).
Every URL the page uses is relative, so it also works when the app is served under a path prefix. What
the page does is in `static/page.js`; it talks only to the API every client uses (`/predict`, `/models`,
`/stats`, and `/metrics` when its link is followed with an API key in use), so it adds no work to the
/predict path.
"""

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

STATIC = Path(__file__).parent / "static"
# Not among the static files: served from there too, it would come without PAGE_HEADERS, and its relative URLs
# would point under /static/static/.
PAGE = Path(__file__).with_name("page.html")
FAVICON_PATH = "/static/favicon.svg"

# The page runs its own script and styles and nothing else: no inline script an injected string could become, no
# other host, no framing by another site (it holds a tab's API key); previews are blob: URLs of the photos chosen.
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' blob:; object-src 'none'; base-uri 'none'; "
    "form-action 'self'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
}

page_router = APIRouter(include_in_schema=False)
page_router.mount("/static", StaticFiles(directory=STATIC), name="static")


@page_router.get("/")
async def page() -> FileResponse:
    return FileResponse(PAGE, headers=PAGE_HEADERS)
