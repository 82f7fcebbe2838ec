"""How a front-end dials the leader's internal port: plaintext (the default), TLS, or mutual
TLS with a certificate of its own. These are the worker's options (worker_svc/link.py,
`--tls*`), named `--scheduler-tls*` on the front-end, whose `--tls-*` flags serve its own client
API as the scheduler's do."""

from __future__ import annotations

from dataclasses import dataclass

from common.tls import channel_credentials, open_channel


@dataclass(slots=True, frozen=True)
class LinkTls:
    enabled: bool = False  # TLS without a CA file: the system's roots
    ca_file: str = ""  # the CA that signed the scheduler's certificate (implies TLS)
    cert_file: str = ""  # this front-end's certificate, for mutual TLS (implies TLS)
    key_file: str = ""
    server_name: str = ""  # the name expected in the scheduler's certificate

    @property
    def on(self) -> bool:
        return self.enabled or bool(self.ca_file or self.cert_file or self.key_file)

    def check(self) -> None:
        """Reads the files once: a missing file or a lone certificate fails at startup rather
        than on every reconnect."""
        if self.on:
            channel_credentials(self.ca_file or None, self.cert_file or None, self.key_file or None)
        elif self.server_name:
            raise ValueError("--scheduler-tls-server-name needs TLS (--scheduler-tls)")

    def channel(self, address: str, options: list | None = None):
        """An aio channel to the leader (the files are read again each time: a renewed
        certificate is used from the next connection on)."""
        return open_channel(
            address,
            list(options or []),
            self.on,
            self.ca_file or None,
            self.cert_file or None,
            self.key_file or None,
            self.server_name or None,
            aio=True,
        )
