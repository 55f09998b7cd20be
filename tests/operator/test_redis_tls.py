"""Redis over TLS with AUTH, as the chart and the operator configure it (a real redis-server
with a test CA made by openssl): the fleet client (publisher, router) and the operator's
store connect with the rendered ``rediss://...?ssl_ca_certs=`` URL and the password; without
the CA or with a wrong password they are refused."""

from __future__ import annotations

import asyncio
import shutil
import socket
import subprocess
import time

import pytest

pytest.importorskip("redis")

from pagoda_operator.load import RedisFleetStore  # noqa: E402
from pagoda_operator.render_redis import CA_MOUNT, redis_url_arg  # noqa: E402
from pagoda_operator.spec import parse_llmservice  # noqa: E402

PASSWORD = "tls-s3cret"


def _openssl(*args: str, cwd) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def tls_redis(tmp_path_factory):
    redis_server, openssl = shutil.which("redis-server"), shutil.which("openssl")
    if not redis_server or not openssl:
        pytest.skip("needs redis-server and openssl")
    d = tmp_path_factory.mktemp("redis-tls")
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt", "-days", "1",
             "-subj", "/CN=pagoda-test-ca", cwd=d)
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "tls.key", "-out", "tls.csr", "-subj", "/CN=localhost",
             cwd=d)
    (d / "ext.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    _openssl("x509", "-req", "-in", "tls.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
             "-out", "tls.crt", "-days", "1", "-extfile", "ext.cnf", cwd=d)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([redis_server, "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1",
                             "--tls-cert-file", "tls.crt", "--tls-key-file", "tls.key", "--tls-ca-cert-file", "ca.crt",
                             "--tls-auth-clients", "no", "--requirepass", PASSWORD, "--save", "", "--appendonly", "no"],
                            cwd=d, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            if proc.poll() is not None:
                pytest.skip("this redis-server has no TLS support")
            assert time.monotonic() < deadline, "redis-server (TLS) did not start"
            time.sleep(0.05)
    yield port, d / "ca.crt"
    proc.kill()
    proc.wait(10)


def rendered_url(port: int, ca_file, monkeypatch_env: dict) -> str:
    """The URL the operator renders for replicas/routers, with the kubelet's expansion of
    $(PAGODA_REDIS_PASSWORD) and the CA mount path pointed at the test CA."""
    svc = parse_llmservice({"metadata": {"name": "c", "namespace": "n"},
                            "spec": {"image": "p:1", "model": {"name": "c", "storageUri": "pvc://m"},
                                     "redis": {"url": f"rediss://127.0.0.1:{port}/0",
                                               "passwordSecretRef": {"name": "auth"},
                                               "caSecretRef": {"name": "ca"}}}})
    url = redis_url_arg(svc)
    assert url.endswith(f"?ssl_ca_certs={CA_MOUNT}/ca.crt")
    return url.replace("$(PAGODA_REDIS_PASSWORD)", monkeypatch_env["PAGODA_REDIS_PASSWORD"]) \
              .replace(f"{CA_MOUNT}/ca.crt", str(ca_file))


def test_fleet_client_connects_with_tls_and_auth(tls_redis):
    from pagoda.fleet.index.prefix_index import make_redis_client
    from pagoda.fleet.service import resolve_redis_url

    port, ca_file = tls_redis
    url = rendered_url(port, ca_file, {"PAGODA_REDIS_PASSWORD": PASSWORD})
    client = make_redis_client(url, socket_timeout_s=5, connect_timeout_s=5)
    assert client.ping() and client.set("k", "v") and client.get("k") == b"v"
    client.close()
    # The router expands the kubelet-style reference itself when it is still in the URL.
    raw = url.replace(PASSWORD, "$(PAGODA_REDIS_PASSWORD)")
    assert resolve_redis_url(raw, {"PAGODA_REDIS_PASSWORD": PASSWORD}) == url
    import redis

    for bad in (url.replace(f"?ssl_ca_certs={ca_file}", ""), url.replace(PASSWORD, "wrong")):
        with pytest.raises(redis.exceptions.RedisError):
            make_redis_client(bad, socket_timeout_s=5, connect_timeout_s=5).ping()


def test_operator_store_connects_with_tls_and_a_password_from_the_secret(tls_redis):
    port, ca_file = tls_redis
    url = f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={ca_file}"

    async def read():
        store = RedisFleetStore.from_url(url, PASSWORD)
        await store.client.hset("pagoda:m:replica:r1", mapping={"ts": time.time(), "waiting": 3})
        loads = await store.read_loads("m", {"r1": None})
        await store.client.aclose()
        return loads

    loads = asyncio.run(read())
    assert loads["r1"].waiting == 3
