"""basetrainer.callbacks.reachability: the probe a tracker runs before handing its URL to MLflow or
W&B. Only servers on 127.0.0.1 made here: one that answers, one that refuses (a closed port),
one that accepts and never answers, one that accepts and hangs up; an HTTP proxy."""
import socket
import threading
import time

import pytest

from basetrainer.callbacks import reachability

from conftest import free_port


class Server:
    """A TCP server on 127.0.0.1: ``answer`` = reply to each connection; ``hang_up`` = close it at
    once; neither = accept nothing (connections wait in the kernel's backlog, never read)."""

    def __init__(self, answer=False, hang_up=False):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        if answer or hang_up:
            threading.Thread(target=self._serve, args=(answer,), daemon=True).start()

    def _serve(self, answer):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            with conn:
                if answer:
                    conn.recv(1024)
                    conn.sendall(b"HTTP/1.0 404 Not Found\r\nContent-Length: 0\r\n\r\n")

    def close(self):
        self.sock.close()


@pytest.fixture
def servers():
    made = []

    def make(**kwargs):
        made.append(Server(**kwargs))
        return made[-1]
    yield make
    for s in made:
        s.close()


@pytest.fixture(autouse=True)
def no_proxy(monkeypatch):
    for name in ("http_proxy", "https_proxy", "all_proxy", "no_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY",
                 "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)


def _timed(url, timeout=1.0):
    start = time.monotonic()
    try:
        reachability.probe(url, timeout, "the store")
        error = None
    except ConnectionError as e:
        error = str(e)
    return error, time.monotonic() - start


def test_a_server_that_answers_passes_and_any_answer_counts(servers):
    server = servers(answer=True)
    error, _ = _timed(f"http://127.0.0.1:{server.port}/api")
    assert error is None and server.accepted == 1   # a 404 is an answer: someone is there


def test_a_closed_port_fails_at_once_and_a_silent_one_after_the_timeout(servers):
    port = free_port()
    error, took = _timed(f"http://127.0.0.1:{port}")
    assert error == f"the store at 127.0.0.1:{port} cannot be reached (Connection refused)" and took < 1
    silent = servers()
    for scheme in ("http", "https"):   # https: the TLS handshake is never answered
        error, took = _timed(f"{scheme}://127.0.0.1:{silent.port}", timeout=0.5)
        assert error == f"the store at 127.0.0.1:{silent.port} did not answer within 0.5 s", scheme
        assert 0.4 < took < 3, took
    hang_up = servers(hang_up=True)
    error, took = _timed(f"http://127.0.0.1:{hang_up.port}")
    assert "cannot be reached" in error and ("without an answer" in error or "reset" in error.lower()), error


def test_urls_without_a_server_are_not_probed_and_bad_ports_are_named():
    for url in ("sqlite:////tmp/x/mlflow.db", "file:///tmp/mlruns", "/tmp/mlruns", "databricks", "mlruns"):
        assert reachability.server_of(url) is None
        assert _timed(url)[0] is None
    assert reachability.server_of("https://example.invalid") == ("https", "example.invalid", 443)
    assert reachability.server_of("postgresql+psycopg2://u:p@db.local/x") == ("postgresql", "db.local", 5432)
    with pytest.raises(ValueError, match=r"'http://127.0.0.1:99999': the port is not a number in 1..65535"):
        reachability.server_of("http://127.0.0.1:99999")
    with pytest.raises(ValueError, match=r"'http:///api' names no host"):
        reachability.server_of("http:///api")


def test_through_a_proxy_the_proxy_is_probed(servers, monkeypatch):
    proxy = servers()   # accepts TCP: the proxy is up (the target is never contacted directly)
    closed = free_port()
    monkeypatch.setenv("HTTP_PROXY", f"http://127.0.0.1:{proxy.port}")
    assert _timed(f"http://127.0.0.1:{closed}")[0] is None
    dead_proxy = free_port()
    monkeypatch.setenv("HTTP_PROXY", f"http://127.0.0.1:{dead_proxy}")
    error, _ = _timed(f"http://127.0.0.1:{closed}")
    assert f"127.0.0.1:{dead_proxy} (the proxy to 127.0.0.1:{closed}) cannot be reached" in error
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")   # bypassed: the target itself
    error, _ = _timed(f"http://127.0.0.1:{closed}")
    assert error == f"the store at 127.0.0.1:{closed} cannot be reached (Connection refused)"
