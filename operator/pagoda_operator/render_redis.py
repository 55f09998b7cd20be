"""How replicas and routers reach Redis: the `--redis-url` argument and its env.

A password never appears in a rendered object. With `spec.redis.passwordSecretRef`, the
container gets `PAGODA_REDIS_PASSWORD` from the Secret and the URL carries
`$(PAGODA_REDIS_PASSWORD)`, which the kubelet expands in `command`/`args`.
"""

from __future__ import annotations

from typing import Any

from pagoda_operator.spec import LLMService

PASSWORD_ENV = "PAGODA_REDIS_PASSWORD"


def redis_url_arg(svc: LLMService) -> str:
    """The Redis URL as passed on a command line (password as an env reference)."""
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
