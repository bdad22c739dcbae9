"""The tenant comes from the credential: credentials match by digest, a request may only narrow
its tenant, and every admin method needs the admin role."""

from __future__ import annotations

from typing import Any

import pytest

from scheduler_svc.errors import (
    ConfigError,
    PermissionDeniedError,
    UnauthenticatedError,
)
from scheduler_svc.serving import auth
from scheduler_svc.serving.auth import Credentials, Principal
from scheduler_svc.serving.fronts.guard import Identity, role_for

# -- the tenant comes from the credential ---------------------------------------------------


def test_a_request_may_only_narrow_its_credentials_tenant() -> None:
    team = Principal("team-a", "team-a", frozenset({auth.CLIENT}))
    assert team.tenant_for("") == "team-a"
    assert team.tenant_for("team-a/batch-jobs") == "team-a/batch-jobs"
    with pytest.raises(PermissionDeniedError, match="may only narrow"):
        team.tenant_for("team-b")
    with pytest.raises(PermissionDeniedError):
        team.tenant_for("team-ab")


def test_credentials_match_by_digest_and_never_keep_the_token(tmp_path: Any) -> None:
    token = "s3cret-token-of-team-a"
    path = tmp_path / "credentials.yaml"
    path.write_text(
        "tokens:\n"
        f"  - {{name: a, token: {token}, tenant: team-a, roles: [client]}}\n"
        f"  - {{name: ops, token_sha256: {auth.digest('ops-token-0123456789').hex()}, "
        "tenant: '', roles: [client, admin]}\n"
        "identities:\n  - {name: cert-ops, identity: ops.internal, roles: [admin]}\n"
    )
    creds = Credentials.load(path)
    assert creds.by_token(token) == Principal("a", "team-a", frozenset({"client"}))
    # No tenant key: the credential's own name, never any tenant (a forgotten key fails closed).
    cert_ops = creds.by_identity(["ops.internal"])
    assert cert_ops is not None and cert_ops.tenant == "cert-ops"
    with pytest.raises(PermissionDeniedError, match="may only narrow"):
        cert_ops.tenant_for("team-a")
    # Anonymous beside credentials: a tenant of its own, which it may only narrow.
    anonymous = auth.ANONYMOUS_BESIDE_CREDENTIALS
    assert anonymous.tenant_for("") == "anonymous"
    assert anonymous.tenant_for("anonymous/x") == "anonymous/x"
    with pytest.raises(PermissionDeniedError):
        anonymous.tenant_for("team-a")
    ops = creds.by_token("ops-token-0123456789")
    assert ops is not None and auth.ADMIN in ops.roles
    assert creds.by_token(token[:-1]) is None and creds.by_token("") is None
    assert creds.by_identity(["nobody", "ops.internal"]) is not None
    assert token not in repr(creds.__dict__)
    for bad in (
        "tokens: [{name: a, token: short, roles: [client]}]",
        "tokens: [{name: a, token: long-enough-token-1, roles: [root]}]",
        "tokens: [{name: a, token_sha256: abc, roles: [client]}]",
        "identities: [{name: a, roles: [client]}]",
    ):
        path.write_text(bad)
        with pytest.raises(ConfigError, match="credentials"):
            Credentials.load(path)


def test_an_authorization_value_means_nothing_without_credentials(tmp_path: Any) -> None:
    nobody = Identity(None, auth.ANONYMOUS_CLIENT)
    for value in (None, "Bearer sk-anything", "Basic dXNlcjpwdw==", "garbage"):
        assert nobody.identify_by(value, list) == auth.ANONYMOUS_CLIENT
    path = tmp_path / "credentials.yaml"
    path.write_text("tokens: [{name: a, token: long-enough-token-1, roles: [client]}]")
    strict = Identity(Credentials.load(path), auth.NOBODY)
    with pytest.raises(UnauthenticatedError, match="expected 'Bearer <token>'"):
        strict.identify_by("Basic dXNlcjpwdw==", list)
    with pytest.raises(UnauthenticatedError, match="not valid"):
        strict.identify_by("Bearer wrong-token-000000", list)
    found = strict.identify_by("Bearer long-enough-token-1", list)
    assert found.name == "a"


def test_every_admin_method_needs_the_admin_role() -> None:
    for method in ("Drain", "Resume", "UpdatePolicy", "LoadModel", "UnloadModel", "GetStats"):
        assert role_for(f"/scheduler.v1.Admin/{method}") == auth.ADMIN
    assert role_for("/scheduler.v1.Scheduler/Generate") == auth.CLIENT
    assert role_for("/inference.GRPCInferenceService/ModelInfer") == auth.CLIENT
    assert role_for("/inference.GRPCInferenceService/RepositoryModelLoad") == auth.ADMIN
    assert role_for("/inference.GRPCInferenceService/LogSettings") == auth.ADMIN
    assert role_for("/inference.GRPCInferenceService/RepositoryIndex") == auth.CLIENT  # reading
    assert role_for("/grpc.health.v1.Health/Check") == ""
    assert role_for("/some.Unknown/Method") == auth.ADMIN  # unlisted: the strictest
