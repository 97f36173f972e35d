"""The dashboard answers only requests addressed to it (DNS rebinding, issue #28), and serves
behind a proxy with ``--allow-host``."""

from __future__ import annotations

import pytest

from grpolens.errors import UserError
from grpolens.serve import hosts


@pytest.mark.parametrize("header, name", [
    ("localhost", "localhost"), ("LOCALHOST:8050", "localhost"), ("localhost.", "localhost"),
    ("127.0.0.1:8050", "127.0.0.1"), ("[::1]:8050", "::1"), ("[::1]", "::1"), ("::1", "::1"),
    ("dash.example.com", "dash.example.com"),
    ("", None), (None, None), ("a b", None), ("localhost:80a", None), ("[::1", None), ("[evil]:80", None),
    ("localhost..", None), ("x" * 400, None), ("evil.com/", None), ("user@localhost", None),
])
def test_host_name(header, name):
    assert hosts.host_name(header) == name


LOCAL_OK = ["localhost", "localhost:8050", "127.0.0.1:8050", "127.0.0.2", "[::1]:8050", "LocalHost"]
REBINDING = ["evil.example.com", "evil.example.com:8050", "127.0.0.1.evil.example.com", "localhost.evil.com",
             "10.0.0.5:8050", "", None, "localhost:8050 evil.com"]


def test_loopback_policy_answers_loopback_names_only():
    pol = hosts.policy("127.0.0.1")
    assert all(pol.allows(h) for h in LOCAL_OK)
    assert not any(pol.allows(h) for h in REBINDING)
    assert hosts.policy("localhost") == pol and hosts.policy("::1") == pol


def test_allow_host_adds_exactly_that_name():
    pol = hosts.policy("127.0.0.1", ["dash.example.com", "10.0.0.5"])
    assert pol.allows("dash.example.com") and pol.allows("DASH.example.com:443") and pol.allows("10.0.0.5:8050")
    assert not pol.allows("sub.dash.example.com") and not pol.allows("example.com") and not pol.allows("10.0.0.6")
    assert hosts.policy("127.0.0.1", ["*"]).allows("evil.example.com")


def test_non_loopback_bind_answers_addresses_and_its_own_names():
    pol = hosts.policy("0.0.0.0")
    assert pol.allows("10.0.0.5:8050") and pol.allows("[fe80::1]:8050") and pol.allows("localhost")
    assert not pol.allows("evil.example.com")
    named = hosts.policy("gpu-box.lan")
    assert named.allows("gpu-box.lan:8050") and not named.allows("evil.example.com")


@pytest.mark.parametrize("bad", ["a b", "evil.com/x", "", "[::1", "http://x"])
def test_bad_allow_host_is_a_user_error(bad):
    with pytest.raises(UserError, match="--allow-host"):
        hosts.policy("127.0.0.1", [bad])


def test_server_refuses_other_hosts_on_every_route(runset):
    from grpolens.serve.app import create_app

    client = create_app(runset).server.test_client()
    routes = ["/", "/tokens?run=alpha", "/_dash-layout", "/_dash-dependencies", "/csv/runs", "/assets/style.css"]
    for route in routes:
        ok = client.get(route, headers={"Host": "127.0.0.1:8050"})
        assert ok.status_code == 200, route
        bad = client.get(route, headers={"Host": "evil.example.com"})
        assert bad.status_code == 403 and b"--allow-host" in bad.data, route
        # X-Forwarded-Host is whatever the sender says: it cannot stand in for Host
        fwd = client.get(route, headers={"Host": "evil.example.com", "X-Forwarded-Host": "localhost"})
        assert fwd.status_code == 403, route
    r = client.post("/_dash-update-component", json={}, headers={"Host": "evil.example.com"})
    assert r.status_code == 403
    # what completion text the server holds never reaches a refused request
    page = client.get("/csv/completions?run=alpha&step=3", headers={"Host": "evil.example.com"})
    assert page.status_code == 403 and b"completion" not in page.data


def test_proxy_name_is_answered_when_allowed(runset):
    from grpolens.serve.app import create_app

    client = create_app(runset, allow_hosts=["dash.example.com"]).server.test_client()
    assert client.get("/csv/runs", headers={"Host": "dash.example.com"}).status_code == 200
    assert client.get("/csv/runs", headers={"Host": "evil.example.com"}).status_code == 403


def test_request_body_is_bounded(runset):
    from grpolens.serve.app import MAX_REQUEST_BYTES, create_app

    client = create_app(runset).server.test_client()
    body = b'{"x": "' + b"a" * MAX_REQUEST_BYTES + b'"}'
    r = client.post("/_dash-update-component", data=body, content_type="application/json")
    assert r.status_code == 413
