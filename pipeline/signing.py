"""Who wrote a control message or a metrics record: Ed25519 signatures in the records' headers.

Kafka's ACLs decide which principal may write to a topic, not what it may say there: instances must
write to `<pipeline>.control` (their `Released`, `Acquired`, `TrackDone`) and to `<pipeline>.metrics`
(their heartbeats and batch records), so Kafka alone cannot stop an instance from publishing an
assignment or another instance's heartbeat. Signatures can (decision 0064):

- the controller (the operator, an administrator's `fluxjoin move` or `budget`) signs with the
  controller's key; every other writer with a key of its own, for which the controller's key has
  issued a certificate naming the writer and its pipeline (`fluxjoin keys`, or the operator for its
  instance pods). A record carries the writer's name, its signature and its certificate;
- every reader, once it trusts a controller key, takes a record only when it is signed by the one
  writer that may say it (`may_say`): assignments, snapshots, move requests and budgets by the
  controller, an instance's acknowledgements, heartbeats, batch records and commit markers by that
  instance. Anything else is dropped with a warning. A reader needs the controller's public key and
  nothing else: an instance added later (a scale-up) is trusted by its certificate.

The settings come from the environment, like the Kafka credentials (`pipeline.kafka_client`), because
every process and every Spark worker inherits it:
- `FLUXJOIN_SIGNING_KEY_FILE`: this process's private key (PEM), its certificate beside it
  (`<name>.cert` for `<name>.key`);
- `FLUXJOIN_CONTROLLER_PUBLIC_KEY_FILE`: the controller's public key (PEM). Set, it turns checking on.

The signature covers the topic, the writer's name and the record's value, so a record cannot be moved
to another topic or pipeline, or claimed by another writer. A copy of a signed record appended again
(a replay) carries a valid signature: the control log's fold ignores stale and repeated messages, and
the controller drops a heartbeat not newer than the last one it took of its incarnation (`fresh`).
"""

from __future__ import annotations

import base64
import functools
import json
import logging
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from pipeline.control_view import CONTROLLER

log = logging.getLogger(__name__)

SIGNER_HEADER = "fluxjoin-signer"
SIGNATURE_HEADER = "fluxjoin-signature"
CERTIFICATE_HEADER = "fluxjoin-certificate"
KEY_ENV = "FLUXJOIN_SIGNING_KEY_FILE"
TRUST_ENV = "FLUXJOIN_CONTROLLER_PUBLIC_KEY_FILE"
ISSUER_ENV = "FLUXJOIN_SIGNING_ISSUER_URL"
"""On Kubernetes: where an instance pod asks the operator for its certificate (`request_certificate`)."""
TOKEN_ENV = "FLUXJOIN_SIGNING_TOKEN_FILE"
"""On Kubernetes: the pod's service account token for the audience `TOKEN_AUDIENCE`, which proves to
the operator which pod asks."""
TOKEN_AUDIENCE = "fluxjoin"

Headers = list[tuple[str, str | bytes | None]]


class SigningError(ValueError):
    """The signing settings in the environment are incomplete or contradict each other."""


def raw_public(key: Ed25519PrivateKey | Ed25519PublicKey) -> bytes:
    public = key.public_key() if isinstance(key, Ed25519PrivateKey) else key
    return public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def private_pem(key: Ed25519PrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def public_pem(key: Ed25519PrivateKey | Ed25519PublicKey) -> bytes:
    public = key.public_key() if isinstance(key, Ed25519PrivateKey) else key
    return public.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)


def read_private(path: Path) -> Ed25519PrivateKey:
    try:
        loaded = serialization.load_pem_private_key(path.read_bytes(), password=None)
    except (ValueError, TypeError) as exc:
        raise SigningError(f"{path}: not a PEM private key ({exc.__class__.__name__})") from None
    if not isinstance(loaded, Ed25519PrivateKey):
        raise SigningError(f"{path}: not an Ed25519 private key (make one with `fluxjoin keys`)")
    return loaded


def read_public(path: Path) -> Ed25519PublicKey:
    """The public key in `path`; a private key's public half (the controller trusts its own key)."""
    text = path.read_bytes()
    if b"PRIVATE KEY" in text:
        return read_private(path).public_key()
    try:
        loaded = serialization.load_pem_public_key(text)
    except ValueError as exc:
        raise SigningError(f"{path}: not a PEM public key ({exc.__class__.__name__})") from None
    if not isinstance(loaded, Ed25519PublicKey):
        raise SigningError(f"{path}: not an Ed25519 public key")
    return loaded


def _signed_bytes(topic: str, name: str, value: bytes) -> bytes:
    return b"\0".join((topic.encode(), name.encode(), value))


@dataclass(frozen=True, slots=True)
class Certificate:
    """The controller's word that `key` (raw Ed25519 public key) is the writer `name` of `pipeline`."""

    pipeline: str
    name: str
    key: bytes
    signature: bytes

    @staticmethod
    def signed_part(pipeline: str, name: str, key: bytes) -> bytes:
        return b"\0".join((b"fluxjoin-certificate", pipeline.encode(), name.encode(), key))

    @classmethod
    def issue(cls, controller: Ed25519PrivateKey, pipeline: str, name: str, key: bytes) -> Certificate:
        return cls(pipeline, name, key, controller.sign(cls.signed_part(pipeline, name, key)))

    def to_bytes(self) -> bytes:
        encoded = {"pipeline": self.pipeline, "name": self.name}
        encoded |= {
            "key": base64.b64encode(self.key).decode(),
            "signature": base64.b64encode(self.signature).decode(),
        }
        return json.dumps(encoded).encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> Certificate | None:
        """The certificate in `raw`, or None when it is not one."""
        try:
            d = json.loads(raw)
            return cls(
                str(d["pipeline"]),
                str(d["name"]),
                base64.b64decode(d["key"]),
                base64.b64decode(d["signature"]),
            )
        except (ValueError, KeyError, TypeError):
            return None


@dataclass(frozen=True, slots=True)
class Signer:
    """This process's key, the name it signs as, and (unless it is the controller) its certificate."""

    name: str
    key: Ed25519PrivateKey
    certificate: bytes | None = None

    def headers(self, topic: str, value: bytes) -> Headers:
        signature = self.key.sign(_signed_bytes(topic, self.name, value))
        signed: Headers = [(SIGNER_HEADER, self.name.encode()), (SIGNATURE_HEADER, signature)]
        return signed + ([(CERTIFICATE_HEADER, self.certificate)] if self.certificate is not None else [])


class Trust:
    """A controller's public key: it signs as the controller, and vouches for every other writer."""

    def __init__(self, controller: Ed25519PublicKey) -> None:
        self.controller = controller
        self._checked: dict[bytes, Certificate | None] = {}  # a certificate's bytes -> it, if valid

    def certificate(self, raw: bytes) -> Certificate | None:
        """The certificate `raw` holds if this controller key issued it, else None."""
        if raw not in self._checked:
            cert = Certificate.from_bytes(raw)
            if cert is not None:
                try:
                    self.controller.verify(
                        cert.signature, Certificate.signed_part(cert.pipeline, cert.name, cert.key)
                    )
                except InvalidSignature:
                    cert = None
            if len(self._checked) > 10_000:
                self._checked.clear()
            self._checked[raw] = cert
        return self._checked[raw]

    def signer(
        self, topic: str, value: bytes, headers: Sequence[tuple[str, bytes | str | None]] | None
    ) -> str | None:
        """The name of the writer whose valid signature `headers` carry for `value` on `topic`; None
        when they carry none, or a certificate this controller did not issue for that writer and the
        topic's pipeline (`<pipeline>.<name>`), or the signature does not check out."""
        found = {k: v for k, v in headers or () if isinstance(v, bytes)}
        name_bytes, signature = found.get(SIGNER_HEADER), found.get(SIGNATURE_HEADER)
        if name_bytes is None or signature is None:
            return None
        name = name_bytes.decode(errors="replace")
        if name == CONTROLLER:
            key = self.controller
        else:
            cert = self.certificate(found.get(CERTIFICATE_HEADER) or b"")
            if cert is None or cert.name != name or cert.pipeline != topic.rpartition(".")[0]:
                return None
            key = Ed25519PublicKey.from_public_bytes(cert.key)
        try:
            key.verify(signature, _signed_bytes(topic, name, value))
        except InvalidSignature:
            return None
        return name


def _write_private(path: Path, key: Ed25519PrivateKey) -> None:
    path.touch(mode=0o600)
    path.write_bytes(private_pem(key))


def create_keys(directory: Path, pipeline: str, names: Iterable[str]) -> list[Path]:
    """The controller's key pair (`controller.key`, mode 0600, and `controller.pub`, the key every
    process trusts) unless it exists, and for every other name a key (`<name>.key`) with a certificate
    for `pipeline` (`<name>.cert`), issued by the controller's key. Existing keys are kept, their
    certificates issued again. Returns the private keys' paths."""
    directory.mkdir(parents=True, exist_ok=True)
    controller_key = directory / f"{CONTROLLER}.key"
    if not controller_key.exists():
        _write_private(controller_key, Ed25519PrivateKey.generate())
    controller = read_private(controller_key)
    (directory / f"{CONTROLLER}.pub").write_bytes(public_pem(controller))
    written = [controller_key]
    for name in names:
        if name == CONTROLLER:
            continue
        if "/" in name or not name:
            raise SigningError(f"{name!r} is not a writer's name")
        private = directory / f"{name}.key"
        if not private.exists():
            _write_private(private, Ed25519PrivateKey.generate())
        cert = Certificate.issue(controller, pipeline, name, raw_public(read_private(private)))
        private.with_suffix(".cert").write_bytes(cert.to_bytes())
        written.append(private)
    return written


def load_signer(key_file: Path, trust: Trust) -> Signer:
    """The signer of `key_file`: the controller if it is the trusted key's pair, else the writer its
    certificate (beside it) names, once the certificate checks out against the trusted key."""
    key = read_private(key_file)
    if raw_public(key) == raw_public(trust.controller):
        return Signer(CONTROLLER, key)
    cert_file = key_file.with_suffix(".cert")
    if not cert_file.is_file():
        raise SigningError(
            f"{KEY_ENV}={key_file}: no certificate {cert_file} beside it (`fluxjoin keys` makes one)"
        )
    raw = cert_file.read_bytes()
    cert = trust.certificate(raw)
    if cert is None or cert.key != raw_public(key):
        raise SigningError(f"{cert_file}: not a certificate of this key issued by the key in {TRUST_ENV}")
    return Signer(cert.name, key, raw)


@functools.cache
def trust() -> Trust | None:
    """The controller key this process trusts, or None: checking is off."""
    path = os.environ.get(TRUST_ENV)
    if not path:
        if os.environ.get(KEY_ENV):
            raise SigningError(f"{KEY_ENV} is set but {TRUST_ENV} is not: set both, or neither")
        return None
    if not Path(path).is_file():
        raise SigningError(f"{TRUST_ENV}={path}: no such file")
    return Trust(read_public(Path(path)))


@functools.cache
def signer() -> Signer | None:
    """This process's signer, or None: it signs nothing (checking off, or a reader such as `status`)."""
    found = trust()
    key_file = os.environ.get(KEY_ENV)
    if found is None or not key_file:
        return None
    if not Path(key_file).is_file():
        raise SigningError(f"{KEY_ENV}={key_file}: no such file")
    return load_signer(Path(key_file), found)


def check_settings() -> None:
    """SigningError, in one line, when the environment's signing settings do not work: called by every
    process at its start, so a mistake stops it there rather than in a Spark worker. Reads them afresh."""
    trust.cache_clear()
    signer.cache_clear()
    signer()


def sign(topic: str, value: bytes) -> Headers | None:
    """The headers that sign `value` on `topic` as this process, or None when it has no key."""
    own = signer()
    return own.headers(topic, value) if own is not None else None


def produce_signed(producer: Any, topic: str, key: str, value: bytes) -> None:
    """Produce one record, signed for `topic` when this process has a key: the one way fluxjoin writes
    a control, metrics or commit record, so that what is signed is what is sent."""
    producer.produce(topic, key=key, value=value, headers=sign(topic, value))


def may_say(author: str, topic: str, value: bytes, headers: Any) -> bool:
    """Whether a record claiming to come from `author` may be taken: always with checking off,
    else only when `author` signed it. A refusal is logged."""
    checking = trust()
    if checking is None:
        return True
    found = checking.signer(topic, value, headers)
    if found == author:
        return True
    said = (topic, author, found)
    if said not in _SAID:  # once per kind: a stream of forgeries does not flood the log
        _SAID.add(said)
        log.warning(
            "dropping records on %s that claim to be from %s: %s",
            topic,
            author,
            "unsigned or signed by an unknown key" if found is None else f"signed by {found}",
        )
    return False


_SAID: set[tuple[str, str, str | None]] = set()


def fresh(seq: tuple[int, int], last_seq: tuple[int, int] | None) -> bool:
    """Whether a heartbeat numbered `seq` (the process's start on its incarnation's directory, then its
    heartbeat) is newer than the last one taken from that incarnation (`last_seq`): a copy of an old
    heartbeat appended again must not keep a dead instance alive. Numbers, not the writer's clock: a
    clock stepped back would make a live instance's heartbeats look old."""
    return last_seq is None or seq > last_seq


def request_certificate(issuer: str, token_file: Path, key_file: Path, timeout_s: float = 300.0) -> Signer:
    """Make a key at `key_file` and have the operator at `issuer` certify it: an instance pod's start
    on Kubernetes, where no file can hold one pod's key and not the others' (a StatefulSet's pods share
    one template). The pod's service account token, bound to the pod, tells the operator which instance
    asks (`controller.k8s.certificates`). Asked again every 2 s while the operator is away or
    refuses, up to `timeout_s`; then RuntimeError with the operator's last answer.

    Sets this process's `FLUXJOIN_SIGNING_KEY_FILE`, so its Spark workers sign with the key too."""
    import time
    import urllib.error
    import urllib.request

    key_file.parent.mkdir(parents=True, exist_ok=True)
    key = Ed25519PrivateKey.generate()
    _write_private(key_file, key)
    body = json.dumps({"key": base64.b64encode(raw_public(key)).decode()}).encode()
    deadline, said = time.monotonic() + timeout_s, ""
    while True:
        request = urllib.request.Request(
            f"{issuer.rstrip('/')}/certificates",
            data=body,
            headers={
                "Authorization": f"Bearer {token_file.read_text().strip()}",
                "Content-Type": "application/json",
            },
            method="POST",
        )
        try:
            with urllib.request.urlopen(request, timeout=10) as answer:
                raw = answer.read()
            break
        except urllib.error.HTTPError as exc:
            why = f"{exc.code} {exc.read().decode(errors='replace').strip()}"
        except OSError as exc:
            why = repr(exc)
        if time.monotonic() > deadline:
            raise RuntimeError(f"no signing certificate from {issuer}: {why}")
        if why != said:
            log.warning("asking %s for a signing certificate: %s; asking again", issuer, why)
            said = why
        time.sleep(2.0)
    key_file.with_suffix(".cert").write_bytes(raw)
    os.environ[KEY_ENV] = str(key_file)
    signer.cache_clear()
    own = signer()
    if own is None:
        raise SigningError(f"{KEY_ENV}={key_file}: a certificate, but no {TRUST_ENV} to check it against")
    return own
