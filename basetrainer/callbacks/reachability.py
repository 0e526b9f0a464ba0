"""Is a tracker's server answering? One bounded request, before its client (which retries for minutes) gets it."""
import socket
import ssl
import urllib.request
from urllib.parse import urlsplit

class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """A redirect is the server's answer: not followed (it may lead to a login page elsewhere)."""

    def redirect_request(self, *args: object, **kwargs: object) -> None:
        return None   # urllib then raises the 3xx as an HTTPError


PORTS = {"http": 80, "https": 443, "postgresql": 5432, "postgres": 5432, "mysql": 3306, "mssql": 1433}


def probe(url: str, timeout: float, what: str = "the server") -> None:
    """Return when the server of ``url`` answers (http(s): any answer to ``HEAD /``, a redirect
    too, through the environment's proxy; a database: a TCP connection); else raise
    ConnectionError saying why."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower().split("+", 1)[0]
    if scheme not in PORTS or not parts.hostname:   # a file, sqlite, databricks: no server to ask
        return
    host, port = parts.hostname, parts.port or PORTS[scheme]
    proxy = None if urllib.request.proxy_bypass(host) else urllib.request.getproxies().get(scheme)
    try:
        if scheme.startswith("http"):
            root = f"{scheme}://{parts.netloc.rpartition('@')[2]}/"
            urllib.request.build_opener(_NoRedirect).open(urllib.request.Request(root, method="HEAD"), timeout=timeout).close()
        else:
            socket.create_connection((host, port), timeout=timeout).close()
    except OSError as e:
        why = getattr(e, "reason", e)   # urllib's URLError wraps the socket's error
        if isinstance(e, urllib.error.HTTPError) or isinstance(why, ssl.SSLError):
            return   # an answer (a TLS error too: the tracker's client checks certificates)
        where = f"{host}:{port}" + (f" (through the proxy {proxy})" if proxy else "")
        raise ConnectionError(f"{what} at {where} gave no answer within {timeout:g} s ({why})") from None
