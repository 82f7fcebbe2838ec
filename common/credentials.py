"""The cluster's credentials: one certificate authority, and a certificate per role.

Every internal link is mutual TLS under the cluster's CA (docs/security.md). A certificate
names its role as `splitserve-<role>`, in its common name (etcd takes that as the user name)
and in a DNS name (what peers verify): a worker's certificate opens the WorkerLink and nothing
else, a front-end's the FrontendLink, and only the scheduler's certificate answers to the name
`splitserve-scheduler` that workers and front-ends check before they send anything.

A role's credentials are a directory holding `ca.crt`, `tls.crt` and `tls.key`: the layout of a
Kubernetes TLS Secret as cert-manager writes it, so a mounted Secret is such a directory.
`create_cluster(directory)` writes a whole cluster's (`splitserve up` on first start, under its
state directory; `splitserve credentials DIR` for compose and hosts of one's own): the CA under
`ca/`, each role under its name. Files are mode 0600, directories 0700.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROLES = ("scheduler", "worker", "frontend", "etcd", "root")
PREFIX = "splitserve-"
SCHEDULER_NAME = PREFIX + "scheduler"  # the name workers and front-ends verify
ETCD_NAME = PREFIX + "etcd"  # the name etcd's clients verify
CA_FILE, CERT_FILE, KEY_FILE = "ca.crt", "tls.crt", "tls.key"
CA_DAYS = 3650
LEAF_DAYS = 825
RENEW_BEFORE = datetime.timedelta(days=30)
# etcd's members dial each other by these names on Kubernetes (deploy/kubernetes/base/etcd.yaml)
ETCD_EXTRA_NAMES = (
    "localhost",
    "splitserve-etcd.splitserve.svc",
    "*.splitserve-etcd-peer",
    "*.splitserve-etcd-peer.splitserve.svc",
    "*.splitserve-etcd-peer.splitserve.svc.cluster.local",
)


class CredentialsError(ValueError):
    """Credentials missing, unreadable or not what the role needs; the message says which."""


def role_name(role: str) -> str:
    return PREFIX + role


@dataclass(slots=True, frozen=True)
class Credentials:
    """One role's CA, certificate and key, read once (a renewed file is read at the next
    start: processes restart to pick up rotated certificates)."""

    directory: Path
    ca: bytes
    cert: bytes
    key: bytes
    role: str

    @classmethod
    def load(cls, directory: str | os.PathLike[str], role: str | None = None) -> Credentials:
        """Reads DIR/ca.crt, tls.crt, tls.key. With `role`, the certificate must be that
        role's (a worker started with the front-end's directory fails here, not at the peer)."""
        path = Path(directory).expanduser()
        files = {}
        for name in (CA_FILE, CERT_FILE, KEY_FILE):
            try:
                files[name] = (path / name).read_bytes()
            except OSError as exc:
                raise CredentialsError(
                    f"credentials directory {path}: cannot read {name} ({exc.strerror}); it must "
                    f"hold {CA_FILE}, {CERT_FILE} and {KEY_FILE} (`splitserve credentials DIR` "
                    "writes them)"
                ) from exc
        found = certificate_role(files[CERT_FILE])
        if found is None:
            raise CredentialsError(
                f"{path / CERT_FILE} names no splitserve role: its common name or a DNS name must "
                f"be one of {', '.join(role_name(r) for r in ROLES)}"
            )
        if role is not None and found != role:
            raise CredentialsError(
                f"{path / CERT_FILE} is a {found}'s certificate; this process is a {role} "
                f"(use the {role} directory of the cluster's credentials)"
            )
        return cls(path, files[CA_FILE], files[CERT_FILE], files[KEY_FILE], found)

    def server_credentials(self):
        """TLS for a server whose every client must show a certificate of the cluster's CA."""
        import grpc

        return grpc.ssl_server_credentials(
            [(self.key, self.cert)], root_certificates=self.ca, require_client_auth=True
        )

    def channel_credentials(self):
        """TLS for a client: trusts only the cluster's CA, shows this role's certificate."""
        import grpc

        return grpc.ssl_channel_credentials(
            root_certificates=self.ca, private_key=self.key, certificate_chain=self.cert
        )


def certificate_role(pem: bytes) -> str | None:
    """The role a certificate names (common name, else a DNS name `splitserve-<role>`)."""
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    try:
        cert = x509.load_pem_x509_certificate(pem)
    except ValueError:
        return None
    names = [a.value for a in cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)]
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        names += san.get_values_for_type(x509.DNSName)
    except x509.ExtensionNotFound:
        pass
    for name in names:
        if isinstance(name, str) and name.startswith(PREFIX) and name[len(PREFIX) :] in ROLES:
            return name[len(PREFIX) :]
    return None


def default_state_dir() -> Path:
    """`$SPLITSERVE_STATE_DIR`, else `$XDG_STATE_HOME/splitserve` (~/.local/state/splitserve)."""
    env = os.environ.get("SPLITSERVE_STATE_DIR")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_STATE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".local" / "state"
    return base / "splitserve"


def create_cluster(directory: str | os.PathLike[str]) -> Path:
    """The cluster's credentials in `directory`: kept when present and valid for another 30
    days, else (re)issued. Safe to run from several processes at once: each role's directory
    appears whole or not at all. Returns the directory."""
    root = Path(directory).expanduser()
    _private_dir(root)
    ca_dir = root / "ca"
    if not _valid(ca_dir / CA_FILE):
        key, cert = _new_ca()
        _publish(ca_dir, {CA_FILE: _cert_pem(cert), "ca.key": _key_pem(key)})
    ca_key, ca_cert = _load_ca(ca_dir)
    ca_pem = (ca_dir / CA_FILE).read_bytes()
    for role in ROLES:
        role_dir = root / role
        if _valid(role_dir / CERT_FILE) and _read(role_dir / CA_FILE) == ca_pem:
            continue
        key, cert = _issue(ca_key, ca_cert, role)
        _publish(role_dir, {CA_FILE: ca_pem, CERT_FILE: _cert_pem(cert), KEY_FILE: _key_pem(key)})
    return root


def _private_dir(path: Path) -> None:
    path.mkdir(parents=True, exist_ok=True)
    path.chmod(0o700)


def write_private(path: Path, data: bytes) -> None:
    """`data` into `path`, mode 0600 from its first byte, swapped in whole: a reader sees the
    old file or the new one, never half of one."""
    tmp = path.with_name(f".{path.name}.new")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    tmp.chmod(0o600)  # a leftover of a crash keeps its old mode through O_CREAT
    os.replace(tmp, path)


def _publish(directory: Path, files: dict[str, bytes]) -> None:
    """Write the files into a fresh directory beside `directory`, then swap it in."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}-", dir=directory.parent))
    for name, data in files.items():
        write_private(tmp / name, data)
    tmp.chmod(0o700)
    if directory.exists():  # an expiring set: the old one goes
        old = directory.with_name(f".{directory.name}-old-{os.getpid()}")
        os.replace(directory, old)
        shutil.rmtree(old, ignore_errors=True)
    try:
        os.rename(tmp, directory)
    except OSError:  # another process published it first: theirs stands
        shutil.rmtree(tmp, ignore_errors=True)


def _read(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except OSError:
        return None


def _valid(cert_path: Path) -> bool:
    from cryptography import x509

    try:
        cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
    except (OSError, ValueError):
        return False
    return cert.not_valid_after_utc - RENEW_BEFORE > datetime.datetime.now(datetime.UTC)


def _name(common_name: str):
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "splitserve"),
            x509.NameAttribute(NameOID.COMMON_NAME, common_name),
        ]
    )


def _new_ca():
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    name = _name("splitserve cluster CA")
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=CA_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), False)
        .sign(key, hashes.SHA256())
    )
    return key, cert


def _issue(ca_key, ca_cert, role: str):
    """A leaf for `role`: usable as a server and as a client (a scheduler serves workers and is
    etcd's client; etcd members are each other's clients)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID

    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    names: list[x509.GeneralName] = [x509.DNSName(role_name(role))]
    if role == "etcd":
        names += [x509.DNSName(n) for n in ETCD_EXTRA_NAMES]
        names += [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(role_name(role)))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=LEAF_DAYS))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), False
        )
        .sign(ca_key, hashes.SHA256())
    )
    return key, cert


def _load_ca(ca_dir: Path):
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    cert = x509.load_pem_x509_certificate((ca_dir / CA_FILE).read_bytes())
    key = serialization.load_pem_private_key((ca_dir / "ca.key").read_bytes(), password=None)
    return key, cert


def _cert_pem(cert) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return cert.public_bytes(serialization.Encoding.PEM)


def _key_pem(key) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
