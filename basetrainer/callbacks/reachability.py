"""Is a tracker's server answering? A probe of a URL's server, bounded in time, run before the URL
is handed to a tracker's client: MLflow's and W&B's clients retry a server that is down for
minutes (MLflow: 7 retries with growing back-off, 120 s per request; W&B: 90 s), and under DDP
every other rank waits in its first collective that long. The probe turns that into one
warning within seconds (see :mod:`basetrainer.callbacks.trackers`).
"""
import socket
import ssl
import time
import urllib.parse
import urllib.request
from typing import Optional, Tuple

# the port a URL without one means, by scheme (a database URL's scheme may name a driver: "mysql+pymysql")
DEFAULT_PORTS = {"http": 80, "https": 443, "postgresql": 5432, "postgres": 5432, "mysql": 3306, "mssql": 1433}


def server_of(url: str) -> Optional[Tuple[str, str, int]]:
    """``(scheme, host, port)`` of a URL that names a server (http(s), a database), or None for
    one that does not (``sqlite:///...``, ``file:...``, a path, ``databricks``).

    Raises:
        ValueError: the port is not a number in 1..65535, or an http(s) URL has no host.
    """
    parts = urllib.parse.urlsplit(url)
    scheme = parts.scheme.lower().split("+", 1)[0]
    if scheme not in DEFAULT_PORTS:
        return None
    try:
        port = parts.port
    except ValueError:
        raise ValueError(f"{url!r}: the port is not a number in 1..65535 (write scheme://host:port)") from None
    if not parts.hostname:
        if scheme in ("http", "https"):
            raise ValueError(f"{url!r} names no host (write {scheme}://host:port)")
        return None   # a database on a local socket
    return scheme, parts.hostname, port or DEFAULT_PORTS[scheme]


def _proxy_for(scheme: str, host: str) -> Optional[Tuple[str, int]]:
    """The ``(host, port)`` of the proxy an HTTP client takes to ``host`` (``HTTP(S)_PROXY``,
    unless ``NO_PROXY`` bypasses it), else None."""
    if scheme not in ("http", "https"):
        return None
    proxy = urllib.request.getproxies().get(scheme) or urllib.request.getproxies().get("all")
    if not proxy or urllib.request.proxy_bypass(host):
        return None
    parts = urllib.parse.urlsplit(proxy if "://" in proxy else f"http://{proxy}")
    if not parts.hostname:
        return None
    try:
        return parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        return None


def probe(url: str, timeout: float, what: str = "the server") -> None:
    """Return when the server of ``url`` answers within ``timeout`` seconds; raise otherwise.

    http(s): a TCP connection, for https a TLS handshake (certificates are not checked here:
    the tracker's client checks them), then the first byte of the answer to a ``HEAD /``.
    A database URL: a TCP connection. Through a proxy (``HTTP(S)_PROXY`` not bypassed by
    ``NO_PROXY``): a TCP connection to the proxy. A URL that names no server is not probed.

    Raises:
        ConnectionError: the server refused, did not answer in time, or closed the connection
            without an answer; the message names ``what``, the address and why.
    """
    server = server_of(url)
    if server is None:
        return
    scheme, host, port = server
    via = _proxy_for(scheme, host)
    address = via or (host, port)
    shown = f"{address[0]}:{address[1]}" + (f" (the proxy to {host}:{port})" if via else "")
    deadline = time.monotonic() + timeout

    def left() -> float:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise socket.timeout("timed out")
        return remaining

    try:
        sock = socket.create_connection(address, timeout=left())
        try:
            if via is None and scheme in ("http", "https"):
                if scheme == "https":
                    context = ssl.create_default_context()
                    context.check_hostname = False
                    context.verify_mode = ssl.CERT_NONE
                    sock.settimeout(left())
                    sock = context.wrap_socket(sock, server_hostname=host)
                sock.settimeout(left())
                sock.sendall(f"HEAD / HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode("ascii"))
                sock.settimeout(left())
                if not sock.recv(1):
                    raise ConnectionError("it closed the connection without an answer")
        finally:
            sock.close()
    except socket.timeout:
        raise ConnectionError(f"{what} at {shown} did not answer within {timeout:g} s") from None
    except (OSError, ssl.SSLError) as e:
        reason = e.strerror or str(e) if isinstance(e, OSError) else str(e)
        raise ConnectionError(f"{what} at {shown} cannot be reached ({reason})") from None
