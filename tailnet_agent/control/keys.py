"""Curve25519 keys of a tailnet node and their text forms.

A node holds three key pairs (``types/key/*.go`` in tailscale):

* the **machine key** is the Noise static key towards control (``mkey:<hex>``);
* the **node key** is the WireGuard static key and DERP identity (``nodekey:<hex>``);
* the **disco key** authenticates disco pings over DERP/UDP (``discokey:<hex>``).

Private keys print as ``privkey:<hex>`` in Tailscale's text form; that form is only used to
persist the machine key, and ``repr`` never shows a private key. The agent is ephemeral by
design, so keys live in memory; only the machine key may optionally be kept in a file.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey

KEY_LEN = 32
MACHINE_PUBLIC_PREFIX = "mkey:"
NODE_PUBLIC_PREFIX = "nodekey:"
DISCO_PUBLIC_PREFIX = "discokey:"
PRIVATE_PREFIX = "privkey:"


def _clamp(raw: bytes) -> bytes:
    """Curve25519 clamping, as ``key.NewNode`` does (DERP's NaCl box needs clamped keys)."""
    b = bytearray(raw)
    b[0] &= 248
    b[31] = (b[31] & 127) | 64
    return bytes(b)


def _parse_hex(text: str, prefix: str) -> bytes:
    if not text.startswith(prefix):
        raise ValueError(f"key text must start with {prefix!r}")
    digits = text[len(prefix):]
    if len(digits) != 2 * KEY_LEN:
        raise ValueError(f"key text must have {2 * KEY_LEN} hex digits after {prefix!r}")
    return bytes.fromhex(digits)


@dataclass(frozen=True, slots=True)
class PublicKey:
    """A raw 32-byte Curve25519 public key plus the prefix of its text form."""

    raw: bytes
    prefix: str

    def __post_init__(self) -> None:
        if len(self.raw) != KEY_LEN:
            raise ValueError(f"a public key has {KEY_LEN} bytes, not {len(self.raw)}")

    def __str__(self) -> str:
        return self.prefix + self.raw.hex()

    def short(self) -> str:
        """The first 5 hex digits in brackets, as Tailscale's ``ShortString`` logs keys."""
        return f"[{self.raw.hex()[:5]}]"

    @classmethod
    def parse(cls, text: str, prefix: str) -> Self:
        return cls(_parse_hex(text, prefix), prefix)


@dataclass(frozen=True, slots=True)
class PrivateKey:
    """A raw 32-byte clamped Curve25519 private key; ``repr`` hides it."""

    raw: bytes = field(repr=False)
    public_prefix: str

    def __post_init__(self) -> None:
        if len(self.raw) != KEY_LEN:
            raise ValueError(f"a private key has {KEY_LEN} bytes")

    @classmethod
    def generate(cls, public_prefix: str) -> Self:
        return cls(_clamp(os.urandom(KEY_LEN)), public_prefix)

    @property
    def public(self) -> PublicKey:
        pub = X25519PrivateKey.from_private_bytes(self.raw).public_key().public_bytes_raw()
        return PublicKey(pub, self.public_prefix)

    def exchange(self, peer: bytes) -> bytes:
        """X25519(self, peer); raises ValueError for a low-order peer key (all-zero result)."""
        return X25519PrivateKey.from_private_bytes(self.raw).exchange(X25519PublicKey.from_public_bytes(peer))

    def private_text(self) -> str:
        """``privkey:<hex>``: only for persisting to a file, never for logs."""
        return PRIVATE_PREFIX + self.raw.hex()


def machine_public(text: str) -> PublicKey:
    """Parse ``mkey:<hex>`` (the control server's Noise key, from ``/key``)."""
    return PublicKey.parse(text, MACHINE_PUBLIC_PREFIX)


@dataclass(frozen=True, slots=True)
class NodeKeys:
    """The three private keys of one node."""

    machine: PrivateKey
    node: PrivateKey
    disco: PrivateKey

    @classmethod
    def generate(cls, *, machine_key_file: Path | None = None) -> Self:
        """Fresh keys; the machine key is read from (or written to, mode 0600) ``machine_key_file``
        when one is given, so a restarted agent keeps its machine identity. None keeps all in memory."""
        machine = load_or_create_machine_key(machine_key_file) if machine_key_file else PrivateKey.generate(
            MACHINE_PUBLIC_PREFIX)
        return cls(machine=machine, node=PrivateKey.generate(NODE_PUBLIC_PREFIX),
                   disco=PrivateKey.generate(DISCO_PUBLIC_PREFIX))

    def with_new_node_key(self) -> Self:
        """The same machine and disco keys with a fresh node key (after node key expiry)."""
        return type(self)(machine=self.machine, node=PrivateKey.generate(NODE_PUBLIC_PREFIX), disco=self.disco)


def load_or_create_machine_key(path: Path) -> PrivateKey:
    """Read ``privkey:<hex>`` from ``path``, or create the file with a new key."""
    if path.exists():
        return PrivateKey(_parse_hex(path.read_text().strip(), PRIVATE_PREFIX), MACHINE_PUBLIC_PREFIX)
    key = PrivateKey.generate(MACHINE_PUBLIC_PREFIX)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key.private_text() + "\n")
    return key
