"""How a front-end dials the leader's internal port: mutual TLS with the front-end's
credentials, trusting only the certificate that names the scheduler (common/link_auth.py), or
plaintext to a scheduler on loopback."""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from common.credentials import Credentials
from common.link_auth import channel_options, is_loopback, target_host


class PlaintextRefused(ConnectionError):
    """A leader beyond loopback, and no credentials to reach it with."""


@dataclass(slots=True, frozen=True)
class LinkTls:
    credentials: Credentials | None = None

    @property
    def on(self) -> bool:
        return self.credentials is not None

    def channel(self, address: str, options: list | None = None) -> grpc.aio.Channel:
        """An aio channel to the leader; PlaintextRefused for one beyond loopback in clear."""
        options = list(options or [])
        if self.credentials is not None:
            return grpc.aio.secure_channel(
                address,
                self.credentials.channel_credentials(),
                options=options + channel_options(self.credentials),
            )
        if not is_loopback(target_host(address)):
            raise PlaintextRefused(
                f"the leader at {address} is beyond loopback and this front-end has no "
                "--credentials: requests would travel in clear"
            )
        return grpc.aio.insecure_channel(address, options=options)
