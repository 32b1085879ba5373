"""Inbound API keys, with vLLM's semantics, and the check on where a server listens.

vLLM started with ``--api-key`` (or ``VLLM_API_KEY``) requires ``Authorization: Bearer <key>`` on
every path that starts with ``/v1``; ``/health``, ``/metrics``, ``/tokenize``, ``/detokenize`` and
``OPTIONS`` requests stay open, and a refusal is HTTP 401 with the body ``{"error": "Unauthorized"}``.
:class:`ApiKeyMiddleware` does the same, so a client written against a key-protected vLLM works
against ours unchanged. Keys are compared as SHA-256 digests in constant time, as vLLM does.
"""

from __future__ import annotations

import hashlib
import ipaddress
import os
import secrets
from typing import TYPE_CHECKING

from pydantic import SecretStr

if TYPE_CHECKING:
    from starlette.types import ASGIApp, Receive, Scope, Send


#: The environment variable ``gym-bridge serve`` reads its inbound key from when ``--api-key`` is not given
#: (vLLM's own name, so one variable protects either server).
INBOUND_API_KEY_ENV = "VLLM_API_KEY"

_UNAUTHORIZED = b'{"error":"Unauthorized"}'


def inbound_api_key(value: str | SecretStr | None, environ: dict[str, str] | None = None) -> SecretStr | None:
    """The key a server requires: ``value`` when given, else ``$VLLM_API_KEY``; None (no key) when both are empty."""
    if isinstance(value, SecretStr):
        value = value.get_secret_value()
    if not value:
        value = (os.environ if environ is None else environ).get(INBOUND_API_KEY_ENV, "")
    return SecretStr(value) if value else None


def is_loopback(host: str) -> bool:
    """True when ``host`` is reachable from this machine only (127.0.0.0/8, ::1, ``localhost``)."""
    if host.strip("[]").lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name: it may resolve to any interface
        return False


def open_port_warning(host: str, port: int, api_key: SecretStr | None) -> str | None:
    """The one line said when a server listens beyond loopback without a key; None when there is nothing to say."""
    if api_key is not None or is_loopback(host):
        return None
    return (
        f"listening on {host}:{port} without an API key: anyone who can reach this port can use the model "
        f"(set --api-key or ${INBOUND_API_KEY_ENV} to require one)"
    )


class ApiKeyMiddleware:
    """A pure ASGI wrapper: requests to ``/v1...`` need ``Authorization: Bearer <api_key>``, else 401."""

    def __init__(self, app: ASGIApp, api_key: SecretStr) -> None:
        self.app = app
        self._digest = hashlib.sha256(api_key.get_secret_value().encode()).digest()

    def authorized(self, headers: list[tuple[bytes, bytes]]) -> bool:
        """Whether the ``Authorization`` header carries the key with the ``Bearer`` scheme (any case)."""
        value = next((v for k, v in headers if k.lower() == b"authorization"), None)
        if value is None:
            return False
        scheme, _, token = value.decode("latin-1").partition(" ")
        if scheme.lower() != "bearer":
            return False
        return secrets.compare_digest(hashlib.sha256(token.encode()).digest(), self._digest)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] == "OPTIONS":
            await self.app(scope, receive, send)
            return
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        if path.startswith("/v1") and not self.authorized(scope["headers"]):
            await send(
                {
                    "type": "http.response.start",
                    "status": 401,
                    "headers": [
                        (b"content-type", b"application/json"),
                        (b"content-length", b"%d" % len(_UNAUTHORIZED)),
                    ],
                }
            )
            await send({"type": "http.response.body", "body": _UNAUTHORIZED})
            return
        await self.app(scope, receive, send)
