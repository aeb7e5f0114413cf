"""TLS for both services and their clients, from PEM files.

A server with `ServerTls(cert, key)` speaks TLS only; with `client_ca` too it is mutual TLS: a
client must present a certificate signed by that CA. A client with `ClientTls(ca)` checks the
server's certificate against `ca` (None: the system's roots), and presents `cert`/`key` when set.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc


def _read(path: str | Path | None, what: str) -> bytes | None:
    if not path:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"{what} {path}: {exc.strerror or exc}") from None


@dataclass(frozen=True)
class ServerTls:
    cert_file: Path
    key_file: Path
    client_ca_file: Path | None = None  # set: mutual TLS, clients need a certificate it signed

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials(
            [(_read(self.key_file, "TLS key"), _read(self.cert_file, "TLS certificate"))],
            root_certificates=_read(self.client_ca_file, "TLS client CA"),
            require_client_auth=self.client_ca_file is not None,
        )


@dataclass(frozen=True)
class ClientTls:
    ca_file: Path | None = None  # None: the system's root certificates
    cert_file: Path | None = None  # the client's own certificate, for servers that require one (mTLS)
    key_file: Path | None = None

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca_file, "TLS CA"),
            private_key=_read(self.key_file, "TLS client key"),
            certificate_chain=_read(self.cert_file, "TLS client certificate"),
        )


def server_tls(cert: str | Path | None, key: str | Path | None, client_ca: str | Path | None) -> ServerTls | None:
    """The server's TLS from flags: None when neither cert nor key is given."""
    if not cert and not key:
        if client_ca:
            raise ValueError("a TLS client CA needs the server's own certificate and key too")
        return None
    if not (cert and key):
        raise ValueError("TLS needs both a certificate and its key")
    return ServerTls(Path(cert), Path(key), Path(client_ca) if client_ca else None)


def client_tls(
    ca: str | Path | None, cert: str | Path | None = None, key: str | Path | None = None, enabled: bool = False
) -> ClientTls | None:
    """The client's TLS from flags: None (plaintext) unless a CA, a client cert or `enabled` is given."""
    if bool(cert) != bool(key):
        raise ValueError("a TLS client certificate needs its key, and the key its certificate")
    if not (ca or cert or enabled):
        return None
    return ClientTls(Path(ca) if ca else None, Path(cert) if cert else None, Path(key) if key else None)


def secure_or_insecure_channel(address: str, tls: ClientTls | None, options=None, aio: bool = False):
    """A grpc (or grpc.aio) channel: TLS when `tls` is set, else plaintext."""
    mod = grpc.aio if aio else grpc
    if tls is None:
        return mod.insecure_channel(address, options=options)
    return mod.secure_channel(address, tls.credentials(), options=options)
