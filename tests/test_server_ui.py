"""The browser page of `asyncllm serve` over plain HTTP (no browser): `/` and
`/dashboard` answer the page with a strict Content-Security-Policy, open without the
API key while the API stays locked; its files have the right content types and
reference no other host and no absolute path (so a path prefix works); `--root-path`
is honoured; `--no-ui` leaves the page out. The page in a real browser:
test_server_ui_browser.py."""

from __future__ import annotations

import re
import urllib.request

import pytest

from asyncllm.errors import ConfigError
from asyncllm.server.config import ServerConfig
from asyncllm.server.ui_routes import CONTENT_SECURITY_POLICY, UI_DIR
from server_process import Server, http_status, post

pytestmark = pytest.mark.timeout(120)

API_KEY = "sk-ui-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
UI_FILES = sorted(p.name for p in UI_DIR.iterdir() if p.is_file())
TYPES = {"html": "text/html", "css": "text/css", "js": "text/javascript"}


def fetch(url: str) -> tuple[int, dict[str, str], bytes]:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return resp.status, dict(resp.headers), resp.read()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The shipped model behind a key, as a proxy serving it under /llm would run it."""
    tmp = tmp_path_factory.mktemp("ui")
    srv = Server(tmp / "server.log", "--api-key", API_KEY, "--root-path", "/llm")
    yield srv
    assert srv.stop() == 0, srv.log.read_text()[-3000:]


@pytest.mark.parametrize("path", ["/", "/dashboard"])
def test_page_is_served_with_a_strict_csp_and_no_key(server, path):
    status, headers, body = fetch(server.url + path)
    assert status == 200
    assert headers["content-type"].startswith("text/html")
    assert headers["content-security-policy"] == CONTENT_SECURITY_POLICY
    assert "default-src 'none'" in CONTENT_SECURITY_POLICY
    assert "unsafe-inline" not in CONTENT_SECURITY_POLICY
    assert headers["x-content-type-options"] == "nosniff"
    assert body == (UI_DIR / "index.html").read_bytes()
    assert b'src="ui/app.js"' in body


def test_the_api_still_needs_the_key(server):
    assert http_status(server.url + "/v1/models") == 401
    assert http_status(server.url + "/metrics") == 401
    assert http_status(server.url + "/v1/models", AUTH) == 200


@pytest.mark.parametrize("name", UI_FILES)
def test_static_files_have_their_content_type(server, name):
    status, headers, body = fetch(f"{server.url}/ui/{name}")
    assert status == 200
    assert headers["content-type"].startswith(TYPES[name.rsplit(".", 1)[1]])
    assert headers["content-security-policy"] == CONTENT_SECURITY_POLICY
    assert body == (UI_DIR / name).read_bytes()


def test_unknown_files_are_not_found(server):
    assert http_status(server.url + "/ui/nope.js") == 404
    assert http_status(server.url + "/ui/..%2Fui_routes.py") == 404


@pytest.mark.parametrize("name", UI_FILES)
def test_files_reference_no_other_host_and_no_absolute_path(name):
    text = (UI_DIR / name).read_text(encoding="utf-8")
    assert not re.search(r"(https?:)?//[a-z0-9.-]+\.[a-z]{2,}", text, re.I), name
    # src/href and fetched paths are relative: a leading "/" would skip a path prefix
    assert not re.search(r"""(src|href)=["']/""", text), name
    assert not re.search(r"""(apiFetch|streamJSON|fetch)\(\s*["'`]/""", text), name
    assert not re.search(r"<script>|<style>|\son[a-z]+=", text), name  # nothing inline


def test_scripts_never_write_html():
    for path in UI_DIR.glob("*.js"):
        text = path.read_text(encoding="utf-8")
        assert not re.search(r"innerHTML|outerHTML|insertAdjacentHTML|document\.write", text)


def test_root_path_is_stripped_before_routing(server):
    """uvicorn puts --root-path in front of the path; the key check and the error
    shape (Anthropic's for /v1/messages) read the path without it."""
    status, body = post(server.url + "/v1/messages", {})
    assert status == 401
    assert body["type"] == "error" and body["error"]["type"] == "authentication_error"
    assert http_status(server.url + "/health") == 200  # open without the key


def test_no_ui_leaves_the_page_out(tmp_path):
    srv = Server(tmp_path / "server.log", "--no-ui")
    try:
        for path in ["/", "/dashboard", "/ui/app.js"]:
            assert http_status(srv.url + path) == 404, path
        assert http_status(srv.url + "/v1/models") == 200
    finally:
        assert srv.stop() == 0, srv.log.read_text()[-3000:]


@pytest.mark.parametrize("bad", ["llm", "/llm/", "llm/"])
def test_root_path_must_be_a_clean_prefix(bad):
    with pytest.raises(ConfigError, match="--root-path"):
        ServerConfig(served_model_names=["m"], root_path=bad)
