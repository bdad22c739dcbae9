"""Who a caller is: credentials (bearer tokens, mTLS client identities) mapped to a principal.

A principal has a name (for logs, never the secret), a tenant and roles. `client` may generate;
`admin` may drain, resume, reconfigure and manage Triton's models. The credentials file (YAML,
named by `auth.credentials_file`, reloaded on SIGHUP):

    tokens:
      - name: team-a                 # shown in logs
        token_sha256: 9f86d0...      # or `token: <the secret>` (a file mounted from a Secret)
        tenant: team-a               # left out: the name; '' (explicit): any tenant
        roles: [client]
    identities:                      # mTLS: a client certificate's common name or a SAN
      - name: ops
        identity: ops.example.internal
        tenant: ops
        roles: [client, admin]

Tokens are kept only as SHA-256 digests and compared in constant time against every entry, so
neither the time a check takes nor the log shows which entry, or how much of one, matched.
"""

from __future__ import annotations

import hashlib
import hmac
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from scheduler_svc.errors import ConfigError, PermissionDeniedError, clip

CLIENT = "client"
ADMIN = "admin"
ROLES = frozenset({CLIENT, ADMIN})
MAX_TOKEN_BYTES = 4096
MAX_TENANT_CHARS = 128


@dataclass(frozen=True)
class Principal:
    name: str
    tenant: str
    roles: frozenset[str]

    def tenant_for(self, asked: str) -> str:
        """The tenant a request runs as: the credential's, or one it narrows to (the
        credential's tenant followed by `/`); anything else is refused."""
        if not asked or asked == self.tenant or not self.tenant:
            return asked or self.tenant
        if asked.startswith(self.tenant + "/"):
            return asked
        raise PermissionDeniedError(
            f"tenant {clip(asked)}: the credential '{self.name}' is for tenant "
            f"{clip(self.tenant)} (a request may only narrow it, as '{self.tenant}/...')"
        )


# A caller without a credential where no credentials exist: the tenant is whatever the request
# names (a label a trusted gateway sets; there is no identity it could take over).
ANONYMOUS_CLIENT = Principal("anonymous", "", frozenset({CLIENT}))
# ... and where credentials exist (`auth.anonymous: client` beside a credentials file): a tenant
# of its own, `anonymous`, which it may narrow; it can never act as a credential's tenant.
ANONYMOUS_TENANT = "anonymous"
ANONYMOUS_BESIDE_CREDENTIALS = Principal("anonymous", ANONYMOUS_TENANT, frozenset({CLIENT}))
LOCAL_ADMIN = Principal("local-admin", "", frozenset({CLIENT, ADMIN}))
NOBODY = Principal("anonymous", "", frozenset())


def digest(token: str | bytes) -> bytes:
    raw = token.encode() if isinstance(token, str) else token
    return hashlib.sha256(raw).digest()


@dataclass(frozen=True)
class _Token:
    digest: bytes
    principal: Principal


class Credentials:
    """The loaded credentials file."""

    def __init__(self, tokens: list[_Token], identities: dict[str, Principal]) -> None:
        self._tokens = tokens
        self._identities = identities

    @property
    def size(self) -> int:
        return len(self._tokens) + len(self._identities)

    def by_token(self, token: str) -> Principal | None:
        if not token or len(token) > MAX_TOKEN_BYTES:
            return None
        presented = digest(token)
        found = None
        for entry in self._tokens:  # every entry, always: the time does not tell which matched
            if hmac.compare_digest(presented, entry.digest):
                found = entry.principal
        return found

    def by_identity(self, names: list[str]) -> Principal | None:
        for name in names:
            if name in self._identities:
                return self._identities[name]
        return None

    @classmethod
    def load(cls, path: str | Path) -> Credentials:
        try:
            data = yaml.safe_load(Path(path).read_text())
        except OSError as exc:
            raise ConfigError(f"cannot read credentials {path}: {exc.strerror}") from None
        except yaml.YAMLError:
            raise ConfigError(f"credentials {path} are not valid YAML") from None
        data = data or {}
        if not isinstance(data, dict) or set(data) - {"tokens", "identities"}:
            raise ConfigError(f"credentials {path}: a mapping with `tokens` and `identities`")
        tokens = [
            _Token(_token_digest(entry, f"tokens[{i}]"), _principal(entry, f"tokens[{i}]"))
            for i, entry in enumerate(_entries(data, "tokens"))
        ]
        identities: dict[str, Principal] = {}
        for i, entry in enumerate(_entries(data, "identities")):
            where = f"identities[{i}]"
            identity = entry.get("identity")
            if not isinstance(identity, str) or not identity:
                raise ConfigError(f"credentials {where}.identity: a certificate name")
            identities[identity] = _principal(entry, where)
        return cls(tokens, identities)


def _entries(data: dict[str, Any], key: str) -> list[dict[str, Any]]:
    entries = data.get(key) or []
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise ConfigError(f"credentials {key}: a list of mappings")
    return entries


def _token_digest(entry: dict[str, Any], where: str) -> bytes:
    token, hexed = entry.get("token"), entry.get("token_sha256")
    if (token is None) == (hexed is None):
        raise ConfigError(f"credentials {where}: give exactly one of token, token_sha256")
    if token is not None:
        if not isinstance(token, str) or len(token) < 16 or len(token) > MAX_TOKEN_BYTES:
            raise ConfigError(f"credentials {where}.token: 16..{MAX_TOKEN_BYTES} characters")
        return digest(token)
    try:
        raw = bytes.fromhex(str(hexed))
    except ValueError:
        raw = b""
    if len(raw) != 32:
        raise ConfigError(f"credentials {where}.token_sha256: 64 hex digits")
    return raw


def _principal(entry: dict[str, Any], where: str) -> Principal:
    known = {"name", "token", "token_sha256", "identity", "tenant", "roles"}
    unknown = sorted(set(entry) - known)
    if unknown:
        raise ConfigError(f"credentials {where}: unknown keys {unknown}")
    name, tenant, roles = entry.get("name"), entry.get("tenant"), entry.get("roles")
    if not isinstance(name, str) or not 1 <= len(name) <= 64:
        raise ConfigError(f"credentials {where}.name: 1..64 characters")
    # A credential without a tenant runs as a tenant of its own name: a forgotten key must not
    # let it act as any tenant. Only an explicit `tenant: ''` does (a trusted gateway's).
    tenant = name if tenant is None else tenant
    if not isinstance(tenant, str) or len(tenant) > MAX_TENANT_CHARS:
        raise ConfigError(f"credentials {where}.tenant: at most {MAX_TENANT_CHARS} characters")
    if not isinstance(roles, list) or not roles or not set(roles) <= ROLES:
        raise ConfigError(f"credentials {where}.roles: a list of {sorted(ROLES)}")
    return Principal(name, tenant, frozenset(roles))


# The principal of the call being handled (set by the server's guard; tests and direct callers
# of the service are anonymous clients).
CURRENT: ContextVar[Principal] = ContextVar("principal", default=ANONYMOUS_CLIENT)
