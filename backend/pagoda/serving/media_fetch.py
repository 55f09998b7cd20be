"""Fetching ``http(s)`` image URLs for the doors: an allow-list, a size and a time limit.

Off by default: a door fetches only with a ``MediaFetcher`` made from
``--allowed-media-domains`` (vLLM's flag name), because a request that makes the server
fetch would otherwise let any client reach any address the server can (an internal
service, a cloud metadata endpoint). ``MediaFetcher.fetch(url, where)`` refuses with a
``ValueError`` naming ``where`` unless every rule holds:

1. the scheme is ``http`` or ``https`` and the URL's host is on the allow-list (exact,
   case-insensitive; the port is not part of the match);
2. every address the host resolves to is public, unless the URL's host is itself an IP
   address literal on the allow-list: a name on the list that resolves to a private,
   loopback, link-local or reserved address is refused (so a DNS answer cannot point an
   allowed name at an internal address), and ``127.0.0.1`` must be listed as such to be
   fetched from. The connection goes to the address that was checked (not to a second
   resolution), with the URL's host as ``Host`` and, for https, as the TLS server name
   (certificates verified);
3. redirects (301, 302, 303, 307, 308) are followed at most ``max_redirects`` times, each
   target checked by rules 1-2 again: a redirect off the allow-list is refused;
4. the body is at most ``max_bytes`` (a larger ``Content-Length`` is refused before reading;
   a body without one is read to ``max_bytes + 1`` and refused if it gets there);
5. the whole fetch, redirects included, ends within ``timeout_s`` (name resolution waits at
   most the time left, in a resolver thread; a socket timeout of the time left on every
   connect and read);
6. the answer is ``200``.

Whether the bytes are an image, and the image limits, are the engine's checks.
"""

from __future__ import annotations

import http.client
import ipaddress
import socket
import ssl
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as ResolveTimeout
from typing import Iterable, Optional
from urllib.parse import urljoin, urlsplit

REDIRECTS = (301, 302, 303, 307, 308)
# getaddrinfo cannot be interrupted: it runs here and the fetch stops waiting when its time is
# up (a stuck lookup then ends on the resolver's own timeout, holding one of these threads).
_RESOLVER = ThreadPoolExecutor(max_workers=4, thread_name_prefix="pagoda-media-dns")


class MediaFetcher:
    """Args:
    allowed_domains: the hosts image URLs may name (module docstring, rules 1-2).
    max_bytes: the largest body fetched.
    timeout_s: the whole fetch's time limit.
    max_redirects: redirects followed.
    """

    def __init__(self, allowed_domains: Iterable[str], max_bytes: int = 20 * 2**20, timeout_s: float = 5.0,
                 max_redirects: int = 3) -> None:
        self.allowed = {d.strip().lower().strip("[]") for d in allowed_domains if d.strip()}
        if not self.allowed:
            raise ValueError("allowed_media_domains: give at least one host")
        if max_bytes < 1 or timeout_s <= 0:
            raise ValueError("media fetching: max_bytes and timeout_s must be positive")
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s
        self.max_redirects = max_redirects
        self._tls = ssl.create_default_context()

    def fetch(self, url: str, where: str) -> bytes:
        """The body ``url`` answers with (module docstring). Raises ValueError naming ``where``."""
        deadline = time.monotonic() + self.timeout_s
        for _ in range(self.max_redirects + 1):
            parts = urlsplit(url)
            address = self._checked_address(parts, where, deadline)
            status, location, body = self._get(parts, address, deadline, where)
            if status not in REDIRECTS:
                if status != 200:
                    raise ValueError(f"{where}: fetching {_shown(url)} answered HTTP {status}")
                return body
            if not location:
                raise ValueError(f"{where}: {_shown(url)} redirected without a Location")
            url = urljoin(url, location)
        raise ValueError(f"{where}: more than {self.max_redirects} redirects")

    def _checked_address(self, parts, where: str, deadline: float) -> str:
        """The address to connect to for ``parts``'s host (rules 1-2)."""
        scheme, host = parts.scheme.lower(), (parts.hostname or "").lower()
        if scheme not in ("http", "https"):
            raise ValueError(f"{where}: redirected to an unsupported scheme {scheme!r}")
        if host not in self.allowed:
            raise ValueError(f"{where}: the host {host!r} is not on this server's allow-list of media hosts "
                             "(--allowed-media-domains)")
        literal = _ip(host)
        if literal is not None:  # listed as an address: that address, even a private one
            return str(literal)
        lookup = _RESOLVER.submit(socket.getaddrinfo, host, parts.port or (443 if scheme == "https" else 80),
                                  type=socket.SOCK_STREAM)
        try:
            infos = lookup.result(timeout=_left(deadline, where))
        except ResolveTimeout:
            raise ValueError(f"{where}: resolving the host {host!r} took over {self.timeout_s} s") from None
        except (OSError, UnicodeError) as exc:
            raise ValueError(f"{where}: the host {host!r} does not resolve ({exc})") from None
        addresses = [info[4][0] for info in infos]
        private = [a for a in addresses if not ipaddress.ip_address(a.split("%")[0]).is_global]
        if private or not addresses:
            raise ValueError(f"{where}: the host {host!r} resolves to a non-public address ({', '.join(private)}); "
                             "list the address itself in --allowed-media-domains to fetch from it")
        return addresses[0]

    def _get(self, parts, address: str, deadline: float, where: str) -> tuple[int, Optional[str], bytes]:
        """(status, Location, body) of one GET to ``address`` (rules 4-5)."""
        https = parts.scheme.lower() == "https"
        port = parts.port or (443 if https else 80)
        connection = _Pinned(parts.hostname, port, address, _left(deadline, where), self._tls if https else None)
        try:
            path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
            connection.request("GET", path, headers={"Accept": "image/*", "User-Agent": "pagoda-media-fetch"})
            sock = connection.sock  # the response may take it over (a closing answer) and clear the connection's
            response = connection.getresponse()
            if response.status in REDIRECTS:
                return response.status, response.getheader("Location"), b""
            length = response.getheader("Content-Length")
            if length is not None and length.isdigit() and int(length) > self.max_bytes:
                raise ValueError(f"{where}: the image is {length} bytes; at most {self.max_bytes} are fetched")
            chunks, size = [], 0
            while size <= self.max_bytes:
                sock.settimeout(_left(deadline, where))
                chunk = response.read1(65536) if hasattr(response, "read1") else response.read(65536)
                if not chunk:
                    break
                chunks.append(chunk)
                size += len(chunk)
            if size > self.max_bytes:
                raise ValueError(f"{where}: the image is over {self.max_bytes} bytes; at most {self.max_bytes} "
                                 "are fetched")
            return response.status, None, b"".join(chunks)
        except (socket.timeout, TimeoutError):
            raise ValueError(f"{where}: fetching the image took over {self.timeout_s} s") from None
        except (OSError, http.client.HTTPException) as exc:
            raise ValueError(f"{where}: fetching the image failed ({type(exc).__name__}: {exc})") from None
        finally:
            connection.close()


class _Pinned(http.client.HTTPSConnection):
    """A connection to a checked ``address``, speaking to ``host`` (its Host header, its TLS name)."""

    def __init__(self, host: str, port: int, address: str, timeout: float, tls: Optional[ssl.SSLContext]) -> None:
        super().__init__(host, port, timeout=timeout, context=tls or ssl.create_default_context())
        self._address = address
        self._is_tls = tls is not None

    def connect(self) -> None:
        sock = socket.create_connection((self._address, self.port), self.timeout)
        self.sock = self._context.wrap_socket(sock, server_hostname=self.host) if self._is_tls else sock


def _ip(host: str) -> Optional[ipaddress._BaseAddress]:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


def _left(deadline: float, where: str) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise ValueError(f"{where}: fetching the image ran out of time")
    return left


def _shown(url: str) -> str:
    return url if len(url) <= 80 else url[:77] + "..."


def make_fetcher(allowed_domains: Optional[str], max_bytes: int = 20 * 2**20,
                 timeout_s: float = 5.0) -> Optional[MediaFetcher]:
    """A fetcher from the flag's comma-separated hosts; None (no fetching) when it is empty."""
    hosts = [h for h in (allowed_domains or "").split(",") if h.strip()]
    return MediaFetcher(hosts, max_bytes, timeout_s) if hosts else None


ENV_DOMAINS, ENV_TIMEOUT, ENV_MAX_BYTES = "PAGODA_ALLOWED_MEDIA_DOMAINS", "PAGODA_MEDIA_FETCH_TIMEOUT_S", \
    "PAGODA_MAX_MEDIA_BYTES"


def media_env(allowed_domains: Optional[str], timeout_s: float, max_bytes: int) -> dict[str, str]:
    """The environment ``fetcher_from_env`` reads (``pagoda serve`` -> the LLM-API front model's stub)."""
    if not allowed_domains:
        return {}
    return {ENV_DOMAINS: allowed_domains, ENV_TIMEOUT: str(timeout_s), ENV_MAX_BYTES: str(max_bytes)}


def fetcher_from_env(environ: Optional[dict] = None) -> Optional[MediaFetcher]:
    """The fetcher ``media_env`` describes; None when it names no host."""
    import os

    environ = os.environ if environ is None else environ
    return make_fetcher(environ.get(ENV_DOMAINS), int(environ.get(ENV_MAX_BYTES, 20 * 2**20)),
                        float(environ.get(ENV_TIMEOUT, 5.0)))


def media_flags(parser) -> None:
    """``--allowed-media-domains``, ``--media-fetch-timeout``, ``--max-media-bytes`` (pagoda serve and router)."""
    parser.add_argument("--allowed-media-domains", metavar="HOST[,HOST...]",
                        help="fetch http(s) image URLs from these hosts only (exact names, or IP addresses: a name "
                             "resolving to a private or loopback address is refused; list the address itself to "
                             "allow one); default: http(s) image URLs are refused")
    parser.add_argument("--media-fetch-timeout", type=float, default=5.0, metavar="SECONDS",
                        help="longest an image fetch may take, redirects included (default 5)")
    parser.add_argument("--max-media-bytes", type=int, default=20 * 2**20, metavar="BYTES",
                        help="largest image fetched (default 20 MiB)")
