"""Who is asking, and which prefix-cache partition their request may read: API keys,
tenants and cache salts.

Two modes, chosen when the server starts:

* **Open** (no ``--api-key-file``): a request's ``cache_salt`` goes to the engine unchanged,
  exactly as in vLLM, so its block hashes match what other vLLM-compatible components
  compute. Requests without a salt share one cache. ``--api-key`` may still require a
  single shared key; it names no tenant and changes no salt.
* **Tenants** (``--api-key-file FILE``, lines of ``key tenant``): every request must carry a
  known ``Authorization: Bearer <key>``, and the salt the engine sees is
  :func:`tenant_cache_salt` of the key's tenant and the client's salt (or its absence).
  The mapping is injective, so two requests share cache blocks only when they come from
  the same tenant *and* carry the same client salt (or both none). Whatever salt a client
  sends, it cannot land in another tenant's partition, so it cannot probe another tenant's
  prompts by timing.

**Roles.** A tenant (or shared) key may generate; operator endpoints
(``/reset_prefix_cache`` and any later one that acts on every tenant's requests) need the
operator role, checked by :meth:`Authenticator.check_operator`:

* with ``--admin-api-key`` (or ``--admin-api-key-file``), only that key has it, in either
  mode. In open mode it may also generate; in tenant mode it names no tenant, so it may
  not (403): a tenant's requests are sent with a tenant's key;
* without an admin key, in open mode every accepted caller has it (as before roles
  existed); in tenant mode nobody has (403), since any tenant could otherwise abort or
  stall every other tenant's requests.
"""

from __future__ import annotations

import hashlib
import json
import unicodedata
from dataclasses import dataclass
from pathlib import Path

from prefixcache.entrypoints.openai.listen import os_error_reason
from prefixcache.entrypoints.openai.unicode_text import check_unicode

MAX_CACHE_SALT_CHARS = 128


def validate_cache_salt(salt: object) -> str:
    """Return ``salt`` if it is a valid client cache salt, else raise ValueError.

    Valid: a non-empty ``str`` of at most ``MAX_CACHE_SALT_CHARS`` characters with no
    control characters (Unicode category Cc: C0, DEL and C1) and no lone surrogate.
    Control characters are refused because salts end up in logs and in published KV
    events, where they could forge or garble lines; a lone surrogate is not text at all
    (see :mod:`~prefixcache.entrypoints.openai.unicode_text`).
    """
    if not isinstance(salt, str):
        raise ValueError("cache_salt must be a string")
    if not salt:
        raise ValueError("cache_salt must not be empty")
    if len(salt) > MAX_CACHE_SALT_CHARS:
        raise ValueError(
            f"cache_salt must be at most {MAX_CACHE_SALT_CHARS} characters, got {len(salt)}"
        )
    if any(unicodedata.category(char) == "Cc" for char in salt):
        raise ValueError("cache_salt must not contain control characters")
    return check_unicode(salt, "cache_salt")


def tenant_cache_salt(tenant: str, client_salt: str | None) -> str:
    """The engine-side salt of a request from ``tenant`` carrying ``client_salt``.

    Contract: equal outputs if and only if equal ``(tenant, client_salt)`` pairs (up to
    SHA-256 collisions). The pair is serialized as a JSON array before hashing: JSON
    quotes and escapes each string, so ``("a", "b")``, ``("ab", None)`` and ``("a", "b")``
    spelled any other way never share a serialization (naive concatenation would map
    the first two to ``"ab"``). Hashing keeps tenant names and client salts out of the
    KV events that the engine publishes to routers; the ``t1:`` prefix versions the
    scheme. Every salt in tenant mode goes through here, so no client-chosen raw salt can
    equal one of these.
    """
    encoded = json.dumps([tenant, client_salt], ensure_ascii=True, separators=(",", ":"))
    return "t1:" + hashlib.sha256(encoded.encode("utf-8")).hexdigest()


class AuthError(Exception):
    """The request's credentials are missing or unknown (HTTP 401)."""


class ForbiddenError(Exception):
    """The caller is known but may not do this (HTTP 403)."""


@dataclass(frozen=True, slots=True)
class Principal:
    """The authenticated caller: ``tenant`` is None in open mode and for the operator
    key; ``is_operator`` when it presented the admin key."""

    tenant: str | None
    is_operator: bool = False


_OPEN = Principal(tenant=None)
_OPERATOR = Principal(tenant=None, is_operator=True)


def _key_digest(key: str) -> bytes:
    # Keys are looked up by digest so that the lookup's timing depends on a hash of the
    # presented key, not on how many leading characters it shares with a real one.
    return hashlib.sha256(key.encode("utf-8")).digest()


class Authenticator:
    """Maps an ``Authorization`` header to a :class:`Principal` or raises AuthError.

    ``key_to_tenant`` non-empty means tenant mode; ``shared_key`` (``--api-key``) requires
    that one key without naming a tenant. With neither, every request is accepted.
    ``admin_key`` is the operator key (see the module docstring's roles); it must differ
    from every other key.
    """

    def __init__(self, key_to_tenant: dict[str, str] | None = None,
                 shared_key: str | None = None, admin_key: str | None = None) -> None:
        if key_to_tenant and shared_key is not None:
            raise ValueError("use either an API key file (tenants) or one shared API key")
        self._digest_to_tenant = {
            _key_digest(key): tenant for key, tenant in (key_to_tenant or {}).items()
        }
        self._shared_digest = None if shared_key is None else _key_digest(shared_key)
        self._admin_digest = None if admin_key is None else _key_digest(admin_key)
        if self._admin_digest is not None and (
                self._admin_digest == self._shared_digest
                or self._admin_digest in self._digest_to_tenant):
            raise ValueError("the admin API key must differ from every other API key")

    @property
    def tenants(self) -> tuple[str, ...]:
        """Every tenant of the key file, each once, sorted."""
        return tuple(sorted(set(self._digest_to_tenant.values())))

    @property
    def has_tenants(self) -> bool:
        return bool(self._digest_to_tenant)

    @property
    def requires_key(self) -> bool:
        return self.has_tenants or self._shared_digest is not None

    def authenticate(self, authorization: str | None) -> Principal:
        key = _bearer_token(authorization)
        if self._admin_digest is not None and key is not None \
                and _key_digest(key) == self._admin_digest:
            return _OPERATOR
        if not self.requires_key:
            return _OPEN
        if key is None:
            raise AuthError("missing API key: send 'Authorization: Bearer <key>'")
        digest = _key_digest(key)
        if self._shared_digest is not None:
            if digest == self._shared_digest:
                return _OPEN
        else:
            tenant = self._digest_to_tenant.get(digest)
            if tenant is not None:
                return Principal(tenant=tenant)
        raise AuthError("invalid API key")

    def engine_cache_salt(self, principal: Principal, client_salt: str | None) -> str | None:
        """The salt to hand the engine (see the module docstring for the two modes)."""
        if not self.has_tenants:
            return client_salt
        if principal.tenant is None:  # the operator key: it names no tenant
            raise ForbiddenError("the admin API key names no tenant; send requests with "
                                 "a tenant's API key")
        return tenant_cache_salt(principal.tenant, client_salt)

    def check_operator(self, principal: Principal) -> None:
        """Raise ForbiddenError unless ``principal`` may call operator endpoints (see the
        module docstring's roles)."""
        if self._admin_digest is not None:
            if not principal.is_operator:
                raise ForbiddenError("this endpoint needs the admin API key")
        elif self.has_tenants:
            raise ForbiddenError("this endpoint needs the admin API key, and the server "
                                 "has none (--admin-api-key)")


def _bearer_token(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        return None
    return token


def load_api_key_file(path: str | Path) -> dict[str, str]:
    """Parse an API key file into ``{key: tenant}``.

    Format: one ``key tenant`` pair per line, separated by whitespace; blank lines and
    lines starting with ``#`` are ignored. Raises ValueError naming the file for a file
    that cannot be read (missing, a folder, unreadable, not UTF-8) or has no keys at all (a
    server that would refuse everyone is a configuration mistake, not a policy), and
    naming the line for a line without exactly two fields or a repeated key.
    """
    key_to_tenant: dict[str, str] = {}
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"cannot read the API key file {path}: {os_error_reason(exc)}") \
            from exc
    except UnicodeDecodeError as exc:
        raise ValueError(f"the API key file {path} is not UTF-8 text (byte {exc.start} "
                         f"cannot be decoded)") from exc
    for line_number, line in enumerate(text.splitlines(), start=1):
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        fields = stripped.split()
        if len(fields) != 2:
            raise ValueError(f"{path}:{line_number}: expected 'key tenant', got "
                             f"{len(fields)} field(s)")
        key, tenant = fields
        if key in key_to_tenant:
            raise ValueError(f"{path}:{line_number}: duplicate API key")
        key_to_tenant[key] = tenant
    if not key_to_tenant:
        raise ValueError(f"the API key file {path} holds no API keys")
    return key_to_tenant


def load_admin_api_key_file(path: str | Path) -> str:
    """The operator key: the first line of ``path`` that is neither blank nor a ``#``
    comment, stripped. Raises ValueError naming the file when it cannot be read or holds
    no key."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"cannot read the admin API key file {path}: "
                         f"{os_error_reason(exc)}") from exc
    except UnicodeDecodeError as exc:
        raise ValueError(f"the admin API key file {path} is not UTF-8 text") from exc
    for line in text.splitlines():
        stripped = line.strip()
        if stripped and not stripped.startswith("#"):
            return stripped
    raise ValueError(f"the admin API key file {path} holds no key")
