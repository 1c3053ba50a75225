"""An unreachable hub is found out by one short request, not by minutes of retries per name."""

from __future__ import annotations

import os
import sys

import pytest


@pytest.fixture
def online_env(monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    yield
    os.environ.pop("HF_HUB_OFFLINE", None)  # what the code under test may set


def test_unreachable_hub_switches_to_the_local_cache_once(online_env, monkeypatch, tmp_path, caplog):
    import huggingface_hub.constants

    from shardtune import hub

    asked = []
    monkeypatch.setattr(hub, "reachable", lambda endpoint, timeout=3.0: asked.append(endpoint) or False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_ENDPOINT", "https://hub.example")
    hub.offline_unless_reachable(str(tmp_path), "./local/data.jsonl", None)  # local names: nothing asked
    assert asked == [] and "HF_HUB_OFFLINE" not in os.environ
    hub.offline_unless_reachable("org/model", "org/data")
    assert asked == ["https://hub.example"] and os.environ["HF_HUB_OFFLINE"] == "1"
    assert sys.modules["huggingface_hub.constants"].HF_HUB_OFFLINE is True  # imported already: told too
    assert "org/model, org/data will be read from the local Hugging Face cache only" in caplog.text
    hub.offline_unless_reachable("org/other")  # decided: not asked again
    assert asked == ["https://hub.example"]


def test_a_reachable_hub_changes_nothing(online_env, monkeypatch):
    from shardtune import hub

    asked = []
    monkeypatch.setattr(hub, "reachable", lambda endpoint, timeout=3.0: asked.append(endpoint) or True)
    hub.offline_unless_reachable("org/model")
    assert asked and "HF_HUB_OFFLINE" not in os.environ  # the hub was asked, answered, and nothing changed


def test_reachable_counts_any_answer_and_no_answer_as_down():
    from shardtune.hub import reachable

    assert not reachable("http://127.0.0.1:9", timeout=1.0)  # the discard port: nothing listens
    assert not reachable("not a url")


def test_reachable_counts_an_error_status_as_an_answer():
    import http.server
    import threading

    from shardtune.hub import reachable

    class NotFound(http.server.BaseHTTPRequestHandler):
        def do_HEAD(self):  # noqa: N802 - the stdlib's name
            self.send_response(404)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), NotFound)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        assert reachable(f"http://127.0.0.1:{server.server_port}/", timeout=2.0)
    finally:
        server.shutdown()
