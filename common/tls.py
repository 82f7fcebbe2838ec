"""TLS credentials for the client API and mutual TLS for worker links (files in PEM)."""

from __future__ import annotations

from pathlib import Path

import grpc


def _read(path: str | None) -> bytes | None:
    return Path(path).read_bytes() if path else None


def server_credentials(cert_file: str, key_file: str, client_ca_file: str | None = None):
    """TLS for a server; with client_ca_file, clients must show a certificate it signed."""
    if not cert_file or not key_file:
        raise ValueError("TLS needs both a certificate and a key file")
    return grpc.ssl_server_credentials(
        [(_read(key_file), _read(cert_file))],
        root_certificates=_read(client_ca_file),
        require_client_auth=bool(client_ca_file),
    )


def channel_credentials(
    ca_file: str | None, cert_file: str | None = None, key_file: str | None = None
):
    """TLS for a client: trust ca_file (system roots if None); cert/key for mutual TLS."""
    if bool(cert_file) != bool(key_file):
        raise ValueError("a client certificate needs both --tls-cert-file and --tls-key-file")
    return grpc.ssl_channel_credentials(
        root_certificates=_read(ca_file),
        private_key=_read(key_file),
        certificate_chain=_read(cert_file),
    )


def add_port(server, address: str, cert_file: str, key_file: str, ca_file: str = "") -> int:
    if cert_file or key_file:
        return server.add_secure_port(address, server_credentials(cert_file, key_file, ca_file))
    if ca_file:
        raise ValueError("a client CA file only makes sense with a server certificate and key")
    return server.add_insecure_port(address)


def open_channel(
    target: str,
    options: list,
    tls: bool,
    ca_file: str | None = None,
    cert_file: str | None = None,
    key_file: str | None = None,
    server_name: str | None = None,
    aio: bool = False,
):
    module = grpc.aio if aio else grpc
    if not tls:
        return module.insecure_channel(target, options=options)
    if server_name:
        options = [*options, ("grpc.ssl_target_name_override", server_name)]
    creds = channel_credentials(ca_file, cert_file, key_file)
    return module.secure_channel(target, creds, options=options)
