"""Who wrote a control message or a metrics record: Ed25519 signatures in the records' headers.

Kafka's ACLs decide which principal may write to a topic, not what it may say there: instances must
write to `<pipeline>.control` (their `Released`, `Acquired`, `TrackDone`) and to `<pipeline>.metrics`
(their heartbeats and batch records), so Kafka alone cannot stop an instance from publishing an
assignment or another instance's heartbeat. Signatures can (decision 0064):

- every writer signs what it writes with its own key: the controller (and an administrator's `fluxjoin
  move` or `budget`) as `controller`, each instance (its process and its Spark workers) under its name;
- every reader, once trust is on, takes a record only when it is signed by the one writer that may
  say it (`may_say`): assignments, snapshots, move requests and budgets by the controller, an
  instance's acknowledgements, heartbeats and batch records by that instance. Anything else is
  dropped with a warning.

The settings come from the environment, like the Kafka credentials (`pipeline.kafka_client`), because
every process and every Spark worker inherits it:
- `FLUXJOIN_SIGNING_KEY_FILE`: this process's private key (PEM, as `fluxjoin keys` writes it);
- `FLUXJOIN_TRUST_DIR`: the public keys, `<name>.pub` per writer. Set, it turns checking on.

The signature covers the topic, the writer's name and the record's value, so a record cannot be moved
to another topic or pipeline, or claimed by another writer. A copy of a signed record appended again
(a replay) carries a valid signature: the control log's fold ignores stale and repeated messages, and
the controller drops a heartbeat not newer than the last one it took of its incarnation (`fresh`).
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

log = logging.getLogger(__name__)

SIGNER_HEADER = "fluxjoin-signer"
SIGNATURE_HEADER = "fluxjoin-signature"
KEY_ENV = "FLUXJOIN_SIGNING_KEY_FILE"
TRUST_ENV = "FLUXJOIN_TRUST_DIR"

Headers = list[tuple[str, str | bytes | None]]


class SigningError(ValueError):
    """The signing settings in the environment are incomplete or contradict each other."""


def _signed_bytes(topic: str, name: str, value: bytes) -> bytes:
    return b"\0".join((topic.encode(), name.encode(), value))


@dataclass(frozen=True, slots=True)
class Signer:
    """This process's key and the name its public key has in the trust directory."""

    name: str
    key: Ed25519PrivateKey

    def headers(self, topic: str, value: bytes) -> Headers:
        signature = self.key.sign(_signed_bytes(topic, self.name, value))
        return [(SIGNER_HEADER, self.name.encode()), (SIGNATURE_HEADER, signature)]


class Trust:
    """The writers' public keys, `<directory>/<name>.pub`. A name whose key is missing is looked up
    again at its next record, so an instance added later (a scale-up) is trusted once its key is there."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._keys: dict[str, Ed25519PublicKey] = {}

    def key(self, name: str) -> Ed25519PublicKey | None:
        if name not in self._keys:
            path = self.directory / f"{name}.pub"
            if "/" in name or not path.is_file():
                return None
            loaded = serialization.load_pem_public_key(path.read_bytes())
            if not isinstance(loaded, Ed25519PublicKey):
                raise SigningError(f"{path}: not an Ed25519 public key")
            self._keys[name] = loaded
        return self._keys[name]

    def signer(
        self, topic: str, value: bytes, headers: Sequence[tuple[str, bytes | str | None]] | None
    ) -> str | None:
        """The name of the writer whose valid signature `headers` carry for `value` on `topic`; None
        when they carry none, name a writer without a key, or the signature does not check out."""
        found = {k: v for k, v in headers or () if isinstance(v, bytes)}
        name_bytes, signature = found.get(SIGNER_HEADER), found.get(SIGNATURE_HEADER)
        if name_bytes is None or signature is None:
            return None
        name = name_bytes.decode(errors="replace")
        key = self.key(name)
        if key is None:
            return None
        try:
            key.verify(signature, _signed_bytes(topic, name, value))
        except InvalidSignature:
            return None
        return name


def create_keys(directory: Path, names: Iterable[str]) -> list[Path]:
    """A key pair per name: `<name>.key` (private, mode 0600) and `public/<name>.pub` (the trust
    directory). An existing pair is kept. Returns the private keys' paths."""
    public = directory / "public"
    public.mkdir(parents=True, exist_ok=True)
    written = []
    for name in names:
        private, pub = directory / f"{name}.key", public / f"{name}.pub"
        if not private.exists():
            key = Ed25519PrivateKey.generate()
            private.touch(mode=0o600)
            private.write_bytes(
                key.private_bytes(
                    serialization.Encoding.PEM,
                    serialization.PrivateFormat.PKCS8,
                    serialization.NoEncryption(),
                )
            )
            pub.write_bytes(
                key.public_key().public_bytes(
                    serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
                )
            )
        written.append(private)
    return written


def load_signer(key_file: Path, trust: Trust) -> Signer:
    """The signer of `key_file`, named by the trust directory's public key that matches it."""
    loaded = serialization.load_pem_private_key(key_file.read_bytes(), password=None)
    if not isinstance(loaded, Ed25519PrivateKey):
        raise SigningError(
            f"{KEY_ENV}={key_file}: not an Ed25519 private key (make one with `fluxjoin keys`)"
        )
    raw = loaded.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    for pub in sorted(trust.directory.glob("*.pub")):
        key = trust.key(pub.stem)
        if (
            key is not None
            and key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw) == raw
        ):
            return Signer(pub.stem, loaded)
    raise SigningError(f"{KEY_ENV}={key_file}: its public key is not in {TRUST_ENV}={trust.directory}")


@functools.cache
def trust() -> Trust | None:
    """This process's trust directory, or None: checking is off."""
    directory = os.environ.get(TRUST_ENV)
    if not directory:
        if os.environ.get(KEY_ENV):
            raise SigningError(f"{KEY_ENV} is set but {TRUST_ENV} is not: set both, or neither")
        return None
    if not Path(directory).is_dir():
        raise SigningError(f"{TRUST_ENV}={directory}: no such directory")
    return Trust(Path(directory))


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
    process at its start, so a mistake stops it there rather than in a Spark worker."""
    signer()


def sign(topic: str, value: bytes) -> Headers | None:
    """The headers that sign `value` on `topic` as this process, or None when it has no key."""
    own = signer()
    return own.headers(topic, value) if own is not None else None


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


def fresh(seq: int, last_seq: int | None) -> bool:
    """Whether a heartbeat numbered `seq` by its incarnation is newer than the last one taken from that
    incarnation (`last_seq`): a copy of an old heartbeat appended again must not keep a dead instance
    alive. Numbers, not the writer's clock: a clock stepped back would make a live instance's
    heartbeats look old."""
    return last_seq is None or seq > last_seq
