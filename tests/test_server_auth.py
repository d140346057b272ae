"""API keys over real HTTP, SGLang's rules: probes open; every other route needs the api key; control and weight
routes need the admin key, which the plain key does not replace (and the admin key does not unlock /generate).
The server reads its keys from files (mode 0600), so they never appear on its command line."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from server_fixtures import Server, call, make_model, running_server

pytestmark = pytest.mark.process

KEY, ADMIN = "plain-key-123", "admin-key-456"
OPEN = [("GET", "/health", None), ("GET", "/ready", None), ("GET", "/health_generate", None), ("GET", "/metrics", None)]
NORMAL = [
    ("POST", "/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}}),
    ("GET", "/get_model_info", None),
    ("GET", "/model_info", None),
    ("GET", "/get_server_info", None),
    ("GET", "/server_info", None),
]
ADMIN_ROUTES = [
    ("POST", "/pause_generation", {"mode": "in_place"}),
    ("POST", "/continue_generation", {}),
    ("POST", "/abort_request", {"rid": "nothing"}),
    ("POST", "/flush_cache", None),
    ("POST", "/update_weight_version", {"new_version": "k", "abort_all_requests": False}),
    ("POST", "/weights_checker", {"action": "checksum"}),
    ("POST", "/destroy_weights_update_group", {"group_name": "absent"}),  # 400 once authorised: no such group
]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("auth")
    model = make_model(root / "qwen3")
    for name, key in (("api.key", KEY), ("admin.key", ADMIN)):
        (root / name).write_text(key + "\n")
        (root / name).chmod(0o600)
    with running_server(
        model, root, "--api-key-file", str(root / "api.key"), "--admin-api-key-file", str(root / "admin.key")
    ) as s:
        yield s


def test_keys_are_not_on_the_command_line(server: Server) -> None:
    cmdline = Path(f"/proc/{server.proc.pid}/cmdline").read_bytes().decode(errors="replace")
    assert KEY not in cmdline and ADMIN not in cmdline


@pytest.mark.parametrize("method, path, body", OPEN)
def test_probes_are_open(server: Server, method: str, path: str, body: object) -> None:
    assert call(method, server.url + path, body).status == 200


@pytest.mark.parametrize("method, path, body", NORMAL)
def test_normal_routes_need_the_api_key(server: Server, method: str, path: str, body: object) -> None:
    for key in (None, "wrong", ADMIN, KEY + "x"):
        r = call(method, server.url + path, body, key=key)
        assert r.status == 401 and r.body["error"]["message"] == "Unauthorized", (key, r.text)
    assert call(method, server.url + path, body, key=KEY).status == 200


@pytest.mark.parametrize("method, path, body", ADMIN_ROUTES)
def test_admin_routes_need_the_admin_key(server: Server, method: str, path: str, body: object) -> None:
    for key in (None, "wrong", KEY):
        assert call(method, server.url + path, body, key=key).status == 401, key
    r = call(method, server.url + path, body, key=ADMIN)
    assert r.status == (400 if path == "/destroy_weights_update_group" else 200), r.text


def test_unknown_routes_and_bad_headers_are_401_not_500(server: Server) -> None:
    assert call("GET", server.url + "/nope").status == 401
    assert call("GET", server.url + "/nope", key=KEY).status == 404
    for header in ("Bearer", "Bearer ", "Token " + KEY, KEY, "Bearer  " + "x" * 5000):
        r = call("GET", server.url + "/get_model_info", headers={"Authorization": header})
        assert r.status == 401, header
    assert "Unauthorized" in call("POST", server.url + "/generate", {"input_ids": [1]}).text
    assert call("GET", server.url + "/health_generate").status == 200
