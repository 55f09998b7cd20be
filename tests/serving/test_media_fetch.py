"""``http(s)`` image URLs: fetched only from allow-listed hosts, within size and time limits
(``serving.media_fetch``), against local HTTP and HTTPS servers on 127.0.0.1 (listed explicitly;
the HTTPS one with a self-signed certificate made by ``openssl``), name resolution included."""

from __future__ import annotations

import shutil
import socket
import ssl
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from pagoda.serving.dialects.media import image_url_bytes
from pagoda.serving.media_fetch import MediaFetcher, make_fetcher

IMAGE = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4  # the fetcher does not look inside: the engine does


class Handler(BaseHTTPRequestHandler):
    routes: dict = {}

    def do_GET(self):  # noqa: N802 - http.server's name
        status, headers, body = self.routes.get(self.path, (404, {}, b"no"))
        if callable(body):
            body = body()
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        if "Content-Length" not in headers and status != 299:
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    port = httpd.server_address[1]
    base = f"http://127.0.0.1:{port}"
    Handler.routes = {
        "/cat.png": (200, {"Content-Type": "image/png"}, IMAGE),
        "/big.png": (200, {"Content-Length": str(10**9)}, b""),
        "/stream.png": (299, {}, b"x" * 5000),  # 299: no Content-Length (read until the limit)
        "/slow.png": (200, {}, lambda: time.sleep(0.6) or IMAGE),
        "/hop": (302, {"Location": "/cat.png"}, b""),
        "/off": (302, {"Location": "http://example.com/cat.png"}, b""),
        "/loop": (302, {"Location": "/loop"}, b""),
    }
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield base
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=5)


def test_an_allow_listed_address_is_fetched_and_redirects_on_it_followed(server):
    fetcher = MediaFetcher(["127.0.0.1"], max_bytes=4096, timeout_s=2)
    assert fetcher.fetch(server + "/cat.png", "u") == IMAGE
    assert fetcher.fetch(server + "/hop", "u") == IMAGE
    assert image_url_bytes(server + "/cat.png", "messages[0].content[0].image_url.url", fetcher) == IMAGE


@pytest.mark.parametrize("path, fetcher_args, message", [
    ("/off", {}, "u: the host 'example.com' is not on this server's allow-list"),
    ("/loop", {}, "u: more than 3 redirects"),
    ("/big.png", {}, "u: the image is 1000000000 bytes; at most 4096"),
    ("/stream.png", {}, "u: the image is over 4096 bytes"),
    ("/slow.png", {"timeout_s": 0.2}, "u: fetching the image took over 0.2 s"),
    ("/missing.png", {}, "u: fetching http://127.0.0.1"),
])
def test_refusals_name_the_field_and_the_rule(server, path, fetcher_args, message):
    fetcher = MediaFetcher(["127.0.0.1"], **{"max_bytes": 4096, "timeout_s": 2, **fetcher_args})
    with pytest.raises(ValueError, match=message.replace(".", r"\.").replace("(", r"\(")):
        fetcher.fetch(server + path, "u")


def test_hosts_off_the_list_and_names_resolving_to_private_addresses_are_refused(server):
    port = server.rsplit(":", 1)[1]
    with pytest.raises(ValueError, match="'127.0.0.1' is not on this server's allow-list"):
        MediaFetcher(["images.example.com"]).fetch(server + "/cat.png", "u")
    with pytest.raises(ValueError, match="'localhost' resolves to a non-public address"):
        MediaFetcher(["localhost"]).fetch(f"http://localhost:{port}/cat.png", "u")  # listed by name, not address
    with pytest.raises(ValueError, match="unsupported image URL scheme 'file'"):
        image_url_bytes("file:///etc/passwd", "u", MediaFetcher(["127.0.0.1"]))
    with pytest.raises(ValueError, match="u: http\\(s\\) image URLs are not fetched: this server was started without"):
        image_url_bytes(server + "/cat.png", "u", None)  # no fetcher: off


def test_the_flag_makes_a_fetcher_only_when_it_names_hosts():
    assert make_fetcher(None) is None and make_fetcher(" ,") is None
    fetcher = make_fetcher("a.example.com, 127.0.0.1", max_bytes=10, timeout_s=1.5)
    assert fetcher.allowed == {"a.example.com", "127.0.0.1"} and fetcher.max_bytes == 10


def test_name_resolution_is_inside_the_time_limit(monkeypatch):
    def stuck(*args, **kwargs):  # a resolver that does not answer in time
        time.sleep(1.0)
        raise OSError("gave up")

    monkeypatch.setattr(socket, "getaddrinfo", stuck)
    fetcher = MediaFetcher(["images.example"], timeout_s=0.2)
    start = time.monotonic()
    with pytest.raises(ValueError, match=r"^u: resolving the host 'images\.example' took over 0\.2 s"):
        fetcher.fetch("https://images.example/cat.png", "u")
    assert time.monotonic() - start < 0.8  # refused at the limit, not when the lookup gave up


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory):
    """An https server on 127.0.0.1 with a self-signed certificate for that address."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command makes the test certificate")
    folder = tmp_path_factory.mktemp("tls")
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True, timeout=60)
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    httpd.socket = context.wrap_socket(httpd.socket, server_side=True)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"https://127.0.0.1:{httpd.server_address[1]}", str(cert)
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=5)


def test_https_verifies_the_certificate_on_the_pinned_connection(server, tls_server, monkeypatch):
    base, cert = tls_server
    untrusted = MediaFetcher(["127.0.0.1"], max_bytes=4096, timeout_s=2)  # the system's CAs only
    with pytest.raises(ValueError, match=r"^u: fetching the image failed \(SSLCertVerificationError"):
        untrusted.fetch(base + "/cat.png", "u")
    monkeypatch.setenv("SSL_CERT_FILE", cert)  # trusted: OpenSSL's default verify paths read it
    trusted = MediaFetcher(["127.0.0.1"], max_bytes=4096, timeout_s=2)
    assert trusted.fetch(base + "/cat.png", "u") == IMAGE
    assert trusted.fetch(base + "/hop", "u") == IMAGE  # a relative redirect stays on https
