"""How a front-end dials the leader's internal port: mutual TLS with the front-end's
credentials, trusting only the certificate that names the scheduler, or plaintext to a
scheduler on loopback (common/link_auth.scheduler_channel)."""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from common.credentials import Credentials
from common.link_auth import PlaintextRefused, scheduler_channel

__all__ = ["LinkTls", "PlaintextRefused"]


@dataclass(slots=True, frozen=True)
class LinkTls:
    credentials: Credentials | None = None

    @property
    def on(self) -> bool:
        return self.credentials is not None

    def channel(self, address: str, options: list | None = None) -> grpc.aio.Channel:
        """An aio channel to the leader; PlaintextRefused for one beyond loopback in clear."""
        return scheduler_channel(address, self.credentials, options, aio=True)
