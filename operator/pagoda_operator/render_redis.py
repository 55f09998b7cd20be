"""How replicas and routers reach Redis: the `--redis-url` argument, its env and volumes.

A password never appears in a rendered object. With `spec.redis.passwordSecretRef`, the
container gets `PAGODA_REDIS_PASSWORD` from the Secret and the URL carries
`$(PAGODA_REDIS_PASSWORD)`, which the kubelet expands in `command`/`args`.

TLS: a `rediss://` URL. With `spec.redis.caSecretRef`, the CA certificate is mounted
read-only at `CA_MOUNT` and the URL gains `ssl_ca_certs=<file>`, a query argument every
component's client (redis-py's `from_url`) passes on to its TLS connection.
"""

from __future__ import annotations

from typing import Any

from pagoda_operator.spec import LLMService

PASSWORD_ENV = "PAGODA_REDIS_PASSWORD"
CA_MOUNT = "/etc/pagoda/redis-tls"
CA_VOLUME = "redis-ca"


def redis_url_arg(svc: LLMService) -> str:
    """The Redis URL as passed on a command line (password as an env reference, the CA
    file as ``ssl_ca_certs``)."""
    return with_ca_file(svc, _with_password(svc))


def with_ca_file(svc: LLMService, url: str) -> str:
    """``url`` plus ``ssl_ca_certs=<mounted CA>`` when the spec names a CA Secret. The
    operator uses it with the spec's URL too: its chart mounts the CA at the same path."""
    if not svc.spec.redis.ca_secret_name:
        return url
    return url + ("&" if "?" in url else "?") + f"ssl_ca_certs={CA_MOUNT}/{svc.spec.redis.ca_secret_key}"


def _with_password(svc: LLMService) -> str:
    url = svc.spec.redis.url
    if not svc.spec.redis.password_secret_name:
        return url
    scheme, rest = url.split("://", 1)
    if "@" in rest.split("/", 1)[0]:  # user info present, keep the user name
        user = rest.split("@", 1)[0].split(":", 1)[0]
        rest = rest.split("@", 1)[1]
        return f"{scheme}://{user}:$({PASSWORD_ENV})@{rest}"
    return f"{scheme}://:$({PASSWORD_ENV})@{rest}"


def redis_env(svc: LLMService) -> list[dict[str, Any]]:
    """Env entries a container needs for `redis_url_arg` (empty without a password)."""
    if not svc.spec.redis.password_secret_name:
        return []
    return [{
        "name": PASSWORD_ENV,
        "valueFrom": {"secretKeyRef": {"name": svc.spec.redis.password_secret_name,
                                       "key": svc.spec.redis.password_secret_key}},
    }]


def redis_ca_volume(svc: LLMService) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(volumes, mounts) for the Redis CA certificate (none without `caSecretRef`)."""
    if not svc.spec.redis.ca_secret_name:
        return [], []
    volumes = [{"name": CA_VOLUME, "secret": {"secretName": svc.spec.redis.ca_secret_name,
                                              "items": [{"key": svc.spec.redis.ca_secret_key,
                                                         "path": svc.spec.redis.ca_secret_key}]}}]
    return volumes, [{"name": CA_VOLUME, "mountPath": CA_MOUNT, "readOnly": True}]
