"""The browser page: `GET /` (chat and completions) and `GET /dashboard` (live
charts of /metrics) serve one static page, `GET /ui/NAME` its files. The files
live in `ui/` next to this module and ship in the wheel; there is no build step.

The page loads only its own files: every answer carries a Content-Security-Policy
that allows scripts, styles and fetches from this origin alone (no inline code, no
other host), and the page writes model text with `textContent` only. Every URL in
the page is relative, so it works unchanged behind a path prefix (`--root-path`).
The page holds no API key: it asks for one when the server answers 401 and keeps
it in the tab's sessionStorage."""

from __future__ import annotations

from pathlib import Path

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

UI_DIR = Path(__file__).parent / "ui"
# the paths the browser loads before it has a key (the API itself stays locked)
UI_PATHS = frozenset({"/", "/dashboard"})
UI_PREFIX = "/ui/"
CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
    "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".svg": "image/svg+xml",
}
_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def is_ui_path(path: str) -> bool:
    """Whether `path` (without the root path) is one of the page's own files."""
    return path in UI_PATHS or path.startswith(UI_PREFIX)


def ui_files() -> dict[str, tuple[bytes, str]]:
    """Every file of the page by name: (content, media type). Read once, at startup."""
    files = {}
    for path in sorted(UI_DIR.iterdir()):
        if path.is_file() and path.suffix in _TYPES:
            files[path.name] = (path.read_bytes(), _TYPES[path.suffix])
    if "index.html" not in files:
        raise FileNotFoundError(f"the page's index.html is missing from {UI_DIR}")
    return files


def ui_routes() -> list[Route]:
    """The routes of the page: `/`, `/dashboard` and `/ui/{name}`."""
    files = ui_files()
    page, page_type = files["index.html"]

    async def index(request: Request) -> Response:
        return Response(page, media_type=page_type, headers=_HEADERS)

    async def static(request: Request) -> Response:
        found = files.get(request.path_params["name"])
        if found is None:
            raise HTTPException(404, "no such file in the page")
        content, media_type = found
        return Response(content, media_type=media_type, headers=_HEADERS)

    return [
        Route("/", index, methods=["GET", "HEAD"]),
        Route("/dashboard", index, methods=["GET", "HEAD"]),
        Route(UI_PREFIX + "{name}", static, methods=["GET", "HEAD"]),
    ]
