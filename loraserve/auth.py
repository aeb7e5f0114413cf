"""The admin token check both services use on their mutating RPCs."""

from __future__ import annotations

import hmac

import grpc

from loraserve.errors import StatusError


def require_admin(context: grpc.aio.ServicerContext, token: str | None) -> None:
    """No token configured: open. Otherwise 'authorization: Bearer <token>' must match."""
    if not token:
        return
    auth = dict(context.invocation_metadata() or ()).get("authorization", "")
    if not auth:
        raise StatusError(grpc.StatusCode.UNAUTHENTICATED, "this RPC needs an admin token: send 'authorization: Bearer <token>'")
    if not hmac.compare_digest(auth.encode(), f"Bearer {token}".encode()):
        raise StatusError(grpc.StatusCode.PERMISSION_DENIED, "the admin token is not valid")
