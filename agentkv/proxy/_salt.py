"""Per-principal ``cache_salt``: no API key's requests hit another key's prefix cache.

vLLM's prefix cache answers a prompt whose prefix it has seen faster: a client that measures its
first token can learn whether someone else sent that prefix (a system prompt, a document). vLLM
keys cached blocks by ``cache_salt`` too, so the proxy gives each principal its own:
HMAC-SHA256 of the principal under a secret, drawn per process unless the config sets one (then
replicas share each principal's cache). Clients cannot set ``cache_salt`` themselves
(``_request``), and nobody can compute another principal's salt without the secret.

>>> salts = CacheSalts("s3cret")
>>> salts.salt("alice") == salts.salt("alice") != salts.salt("bob")
True
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

__all__ = ["CacheSalts"]


class CacheSalts:
    def __init__(self, secret: str | None = None) -> None:
        self._key = (secret or secrets.token_hex(32)).encode()
        self._cache: dict[str, str] = {}

    def salt(self, principal: str) -> str:
        salt = self._cache.get(principal)
        if salt is None:
            salt = hmac.new(self._key, principal.encode(), hashlib.sha256).hexdigest()[:32]
            if len(self._cache) < 100_000:  # principals are few; a flood of keys is not cached
                self._cache[principal] = salt
        return salt
