"""basetrainer.callbacks.reachability: the probe a tracker runs before handing its URL to MLflow or
W&B. Only servers on 127.0.0.1 made here: one that answers, one that refuses (a closed port),
one that accepts and never answers, one that accepts and hangs up; an HTTP proxy. What must hold:
a server that answers anything passes, and one that does not fails within the timeout with a
message naming the address (and the proxy in between)."""
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
    error, _ = _timed(f"http://user:secret@127.0.0.1:{server.port}/api/2.0")
    assert error is None and server.accepted == 1   # a 404 is an answer: someone is there
    error, _ = _timed(f"https://127.0.0.1:{server.port}")   # not TLS: a TLS error is an answer too
    assert error is None and server.accepted == 2


def test_a_closed_port_fails_at_once_and_a_silent_one_after_the_timeout(servers):
    port = free_port()
    error, took = _timed(f"http://127.0.0.1:{port}")
    assert error.startswith(f"the store at 127.0.0.1:{port} gave no answer within 1 s (") and took < 1
    assert "Connection refused" in error
    error, took = _timed(f"postgresql+psycopg2://u:p@127.0.0.1:{port}/db")   # a database: a TCP connection
    assert error.startswith(f"the store at 127.0.0.1:{port} gave no answer") and "refused" in error and took < 1
    silent = servers()
    for scheme in ("http", "https"):   # https: the TLS handshake is never answered
        error, took = _timed(f"{scheme}://127.0.0.1:{silent.port}", timeout=0.5)
        assert error.startswith(f"the store at 127.0.0.1:{silent.port} gave no answer within 0.5 s (") and \
            error.endswith("timed out)"), (scheme, error)
        assert 0.4 < took < 3, took
    hang_up = servers(hang_up=True)
    error, took = _timed(f"http://127.0.0.1:{hang_up.port}")
    assert error.startswith(f"the store at 127.0.0.1:{hang_up.port} gave no answer") and took < 1, error


def test_urls_without_a_server_are_not_probed():
    for url in ("sqlite:////tmp/x/mlflow.db", "file:///tmp/mlruns", "/tmp/mlruns", "databricks", "mlruns",
                "postgresql:///db_on_a_local_socket"):
        assert _timed(url) == (None, pytest.approx(0, abs=0.5))


def test_through_a_proxy_the_request_goes_to_the_proxy_and_its_address_is_named(servers, monkeypatch):
    proxy = servers(answer=True)   # answers for the target, which is never contacted directly
    closed = free_port()
    monkeypatch.setenv("HTTP_PROXY", f"http://127.0.0.1:{proxy.port}")
    assert _timed(f"http://127.0.0.1:{closed}")[0] is None and proxy.accepted == 1
    dead_proxy = free_port()
    monkeypatch.setenv("HTTP_PROXY", f"http://127.0.0.1:{dead_proxy}")
    error, _ = _timed(f"http://127.0.0.1:{closed}")
    assert error.startswith(f"the store at 127.0.0.1:{closed} (through the proxy http://127.0.0.1:{dead_proxy}) "
                            f"gave no answer"), error
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")   # bypassed: the target itself
    error, _ = _timed(f"http://127.0.0.1:{closed}")
    assert error.startswith(f"the store at 127.0.0.1:{closed} gave no answer") and "refused" in error
