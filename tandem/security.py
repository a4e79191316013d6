"""TLS for every gRPC port and channel of Tandem, in one place.

  a service's port    server_credentials / add_port: TLS with --tls-cert and --tls-key; the target and
                      the draft with --tls-ca as well take only clients holding a certificate of that CA
  a channel           channel: plain, TLS (a CA to check the server by) or mutual TLS (a certificate of
                      its own as well); the coordinator's to its services, the clients', the tools'
  one host's CA       make_throwaway_ca: what `tandem serve --tls on` hands its three children, and
                      `tandem make-certs` writes for a deployment's secrets

No torch here: the coordinator and the clients use it. `cryptography` only for the throwaway CA.
"""

from __future__ import annotations

import datetime
import ipaddress
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

log = logging.getLogger("tandem")

# The client side's TLS files from the environment, for the tools and the Python client.
CA_ENV = "TANDEM_TLS_CA"
# A throwaway CA lives as long as the `tandem serve` that made it; a day leaves room for clock skew.
THROWAWAY_DAYS = 1
# `tandem make-certs`, for a deployment's secrets: a year, then make new ones (the CA's key is gone).
CERTS_DAYS = 365


@dataclass(frozen=True)
class ChannelTls:
    """How a channel checks its server (`ca`: PEM file; None: the system's roots) and, for mutual TLS,
    the certificate it presents. `server_name`: the name the server's certificate must carry, where
    the address is not it (the coordinator reaches its services on 127.0.0.1 inside a pod)."""

    ca: Path | None = None
    cert: Path | None = None
    key: Path | None = None
    server_name: str | None = None

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=_read(self.ca), private_key=_read(self.key),
                                            certificate_chain=_read(self.cert))


def channel(address: str, options: Sequence[tuple] = (), tls: ChannelTls | None = None) -> grpc.Channel:
    """A channel to `address`: plain without `tls`, else TLS (mutual where `tls` has a certificate)."""
    if tls is None:
        return grpc.insecure_channel(address, options=list(options))
    if tls.server_name is not None:
        options = [*options, ("grpc.ssl_target_name_override", tls.server_name)]
    return grpc.secure_channel(address, tls.credentials(), options=list(options))


def client_tls(ca: str | Path | None = None) -> ChannelTls | None:
    """A client's TLS: `ca` or $TANDEM_TLS_CA, the CA of the coordinator's certificate; none: plain."""
    ca = ca or os.environ.get(CA_ENV)
    return ChannelTls(ca=Path(ca)) if ca else None


def services_tls(settings) -> ChannelTls | None:
    """The coordinator's channels to the target and the draft (CoordinatorSettings): their CA, and its
    client certificate (its own front's unless one is named apart)."""
    if settings.tls_ca is None:
        return None
    return ChannelTls(ca=settings.tls_ca, cert=settings.tls_client_cert or settings.tls_cert,
                      key=settings.tls_client_key or settings.tls_key, server_name=settings.tls_server_name)


def server_credentials(settings) -> grpc.ServerCredentials | None:
    """A service's (ServiceSettings) credentials; None without a certificate. Mutual where the settings
    verify clients (the target and the draft) and name a CA."""
    if settings.tls_cert is None:
        return None
    mutual = settings.verifies_clients and settings.tls_ca is not None
    return grpc.ssl_server_credentials([(_read(settings.tls_key), _read(settings.tls_cert))],
                                       root_certificates=_read(settings.tls_ca) if mutual else None,
                                       require_client_auth=mutual)


def add_port(server: grpc.Server, address: str, settings) -> int:
    """Bind `address`, with TLS where the settings give a certificate; 0 when it cannot bind."""
    credentials = server_credentials(settings)
    if credentials is None:
        if not is_loopback(address.rsplit(":", 1)[0]):
            log.warning("%s is reachable from other hosts without TLS: give --tls-cert, --tls-key and --tls-ca", address)
        return server.add_insecure_port(address)
    return server.add_secure_port(address, credentials)


def is_loopback(host: str) -> bool:
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _read(path: Path | None) -> bytes | None:
    return Path(path).read_bytes() if path is not None else None


@dataclass(frozen=True)
class ThrowawayCa:
    ca: Path  # the CA's certificate: what clients check the coordinator by
    cert: Path  # one certificate for the three services, for server and client authentication alike
    key: Path


def make_throwaway_ca(directory: Path, hosts: Sequence[str] = (), days: int = THROWAWAY_DAYS) -> ThrowawayCa:
    """A CA made now for this host, and one certificate it signs for localhost, 127.0.0.1, ::1 and
    `hosts`; the CA's key is dropped, so nothing else can ever be signed by it. Files in `directory`."""
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
    except ImportError:
        raise RuntimeError("--tls on needs the cryptography package: pip install cryptography") from None

    now = datetime.datetime.now(datetime.timezone.utc)
    expires = now + datetime.timedelta(days=days)
    ca_key, leaf_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "tandem serve throwaway CA")])
    ca_cert = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
               .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(expires)
               .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
               .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                            content_commitment=False, key_encipherment=False, data_encipherment=False,
                                            key_agreement=False, encipher_only=False, decipher_only=False),
                              critical=True)
               .sign(ca_key, hashes.SHA256()))
    names: list[x509.GeneralName] = [x509.DNSName("localhost")]
    for host in ["127.0.0.1", "::1", *hosts]:
        host = host.strip("[]")
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    leaf = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])).issuer_name(ca_name)
            .public_key(leaf_key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(expires)
            .add_extension(x509.SubjectAlternativeName(list(dict.fromkeys(names))), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    pem = serialization.Encoding.PEM
    out = ThrowawayCa(directory / "ca.pem", directory / "cert.pem", directory / "key.pem")
    out.ca.write_bytes(ca_cert.public_bytes(pem))
    out.cert.write_bytes(leaf.public_bytes(pem))
    out.key.touch(mode=0o600)
    out.key.write_bytes(leaf_key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    return out


def cmd_make_certs(args) -> int:
    """`tandem make-certs DIR [HOST ...]`: the files compose's and Kubernetes' secrets are made from."""
    directory = Path(args.dir)
    directory.mkdir(parents=True, exist_ok=True)
    made = make_throwaway_ca(directory, args.hosts, days=CERTS_DAYS)
    print(f"wrote {made.ca}, {made.cert}, {made.key} (for localhost, 127.0.0.1, ::1{''.join(', ' + h for h in args.hosts)})")
    return 0
