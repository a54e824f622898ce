"""Sans-IO Noise IK initiator and record codec of the TS2021 control protocol.

Checked against ``control/controlbase/{handshake.go,messages.go,conn.go}`` of tailscale v1.98:

* ``Noise_IK_25519_ChaChaPoly_BLAKE2s``; the prologue is ``"Tailscale Control Protocol v<version>"``
  where the version is the client's capability version, also sent in the initiation header.
* Initiation (101 bytes): ``version u16 BE | type 1 | len u16 BE = 96 | e.pub | enc(machine pub) (48) | tag (16)``.
* Response (51 bytes): ``type 2 | len u16 BE = 48 | e.pub | tag``. Type 3 is a cleartext error.
* Handshake AEAD: each derived key is used once with an all-zero nonce and ``h`` as associated data.
* Transport records: ``type 4 | len u16 BE | ciphertext``, at most 4096 bytes in all; ChaCha20-Poly1305
  with empty associated data and a nonce of 4 zero bytes followed by a **big-endian** u64 counter
  (the Noise spec says little-endian; standard Noise libraries break from the second record on).

Nothing here does I/O: the handshake turns bytes into a :class:`NoiseTransport`, which turns
plaintext into records and records into plaintext.
"""

from __future__ import annotations

import hashlib
import hmac
import struct

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

from .errors import HandshakeRefused, NoiseError, ProtocolViolation
from .keys import MACHINE_PUBLIC_PREFIX, PrivateKey

PROTOCOL_NAME = b"Noise_IK_25519_ChaChaPoly_BLAKE2s"
PROLOGUE_PREFIX = b"Tailscale Control Protocol v"

MSG_INITIATION = 1
MSG_RESPONSE = 2
MSG_ERROR = 3
MSG_RECORD = 4

HEADER_LEN = 3
INITIATION_HEADER_LEN = 5
INITIATION_LEN = 101
RESPONSE_LEN = 51
TAG_LEN = 16
MAX_MESSAGE_SIZE = 4096
MAX_CIPHERTEXT_SIZE = MAX_MESSAGE_SIZE - HEADER_LEN
MAX_PLAINTEXT_SIZE = MAX_CIPHERTEXT_SIZE - TAG_LEN
_MAX_NONCE = 2**64 - 1  # controlbase treats ^uint64(0) as invalid: the cipher is exhausted


def _blake2s(*parts: bytes) -> bytes:
    h = hashlib.blake2s()
    for part in parts:
        h.update(part)
    return h.digest()


def _hmac(key: bytes, data: bytes) -> bytes:
    return hmac.new(key, data, hashlib.blake2s).digest()


def hkdf2(chaining_key: bytes, input_key_material: bytes) -> tuple[bytes, bytes]:
    """Noise's HKDF with two outputs: RFC 5869 with HMAC-BLAKE2s, salt=ck and empty info
    (what Go's ``hkdf.New(blake2s, ikm, ck, nil)`` yields)."""
    prk = _hmac(chaining_key, input_key_material)
    out1 = _hmac(prk, b"\x01")
    out2 = _hmac(prk, out1 + b"\x02")
    return out1, out2


def transport_nonce(counter: int) -> bytes:
    """The 12-byte record nonce: 4 zero bytes, then the counter as u64 big-endian."""
    return b"\x00\x00\x00\x00" + counter.to_bytes(8, "big")


def prologue(version: int) -> bytes:
    return PROLOGUE_PREFIX + str(version).encode()


class SymmetricState:
    """Noise's ``h`` and ``ck`` during a handshake; shared by the initiator and the test responder."""

    def __init__(self) -> None:
        self.h = _blake2s(PROTOCOL_NAME)  # the name is longer than 32 bytes, so it is hashed
        self.ck = self.h

    def mix_hash(self, data: bytes) -> None:
        self.h = _blake2s(self.h, data)

    def mix_dh(self, private: PrivateKey, public: bytes) -> bytes:
        """MixKey(DH(private, public)); returns the single-use key ``k``."""
        try:
            shared = private.exchange(public)
        except ValueError as exc:  # low-order point: X25519 result is all zeros
            raise NoiseError("invalid X25519 public key in handshake") from exc
        self.ck, k = hkdf2(self.ck, shared)
        return k

    def encrypt_and_hash(self, k: bytes, plaintext: bytes) -> bytes:
        ciphertext = ChaCha20Poly1305(k).encrypt(bytes(12), plaintext, self.h)
        self.mix_hash(ciphertext)
        return ciphertext

    def decrypt_and_hash(self, k: bytes, ciphertext: bytes) -> bytes:
        try:
            plaintext = ChaCha20Poly1305(k).decrypt(bytes(12), ciphertext, self.h)
        except InvalidTag as exc:
            raise NoiseError("handshake message failed authentication") from exc
        self.mix_hash(ciphertext)
        return plaintext

    def split(self) -> tuple[bytes, bytes]:
        """(k1, k2): k1 encrypts initiator→responder, k2 responder→initiator."""
        return hkdf2(self.ck, b"")


class CipherState:
    """One direction of a transport: a ChaCha20-Poly1305 key and its message counter."""

    def __init__(self, key: bytes) -> None:
        self._aead = ChaCha20Poly1305(key)
        self.counter = 0
        self._broken = False

    def _next_nonce(self) -> bytes:
        if self._broken:
            raise NoiseError("cipher state is unusable after a failed decryption")
        if self.counter >= _MAX_NONCE:
            raise NoiseError("cipher exhausted: 2^64-1 messages")
        nonce = transport_nonce(self.counter)
        self.counter += 1
        return nonce

    def seal(self, plaintext: bytes) -> bytes:
        return self._aead.encrypt(self._next_nonce(), plaintext, None)

    def open(self, ciphertext: bytes) -> bytes:
        nonce = self._next_nonce()
        try:
            return self._aead.decrypt(nonce, ciphertext, None)
        except InvalidTag as exc:
            self._broken = True  # as controlbase does: the stream is out of sync for good
            raise NoiseError("record failed authentication") from exc


class NoiseTransport:
    """The record codec after a handshake: ``encrypt`` frames plaintext into records (split at
    ``MAX_PLAINTEXT_SIZE``), ``receive_data`` buffers wire bytes and returns the plaintext of every
    complete record."""

    def __init__(self, *, tx_key: bytes, rx_key: bytes, handshake_hash: bytes) -> None:
        self.tx = CipherState(tx_key)
        self.rx = CipherState(rx_key)
        self.handshake_hash = handshake_hash
        self._buffer = bytearray()

    def encrypt(self, plaintext: bytes) -> bytes:
        out = bytearray()
        for start in range(0, len(plaintext), MAX_PLAINTEXT_SIZE):
            ciphertext = self.tx.seal(plaintext[start:start + MAX_PLAINTEXT_SIZE])
            out += struct.pack(">BH", MSG_RECORD, len(ciphertext)) + ciphertext
        return bytes(out)

    def receive_data(self, data: bytes) -> bytes:
        self._buffer += data
        out = bytearray()
        while len(self._buffer) >= HEADER_LEN:
            msg_type, length = struct.unpack_from(">BH", self._buffer)
            if msg_type != MSG_RECORD:
                raise ProtocolViolation(f"received message type {msg_type}, want {MSG_RECORD}")
            if HEADER_LEN + length > MAX_MESSAGE_SIZE:
                raise ProtocolViolation(f"record of {HEADER_LEN + length} bytes exceeds {MAX_MESSAGE_SIZE}")
            if len(self._buffer) < HEADER_LEN + length:
                break
            ciphertext = bytes(self._buffer[HEADER_LEN:HEADER_LEN + length])
            del self._buffer[:HEADER_LEN + length]
            out += self.rx.open(ciphertext)
        return bytes(out)


class ClientHandshake:
    """The initiator side of TS2021's Noise IK: ``initiation`` is the 101-byte first message
    (sent in the ``X-Tailscale-Handshake`` header); ``receive_data`` consumes the server's answer.

    ``ephemeral`` is for known-answer tests only; None (the default) generates a fresh key.
    """

    def __init__(self, machine_key: PrivateKey, control_key: bytes, version: int, *,
                 ephemeral: PrivateKey | None = None) -> None:
        if not 0 < version < 2**16:
            raise ValueError("the protocol version is a u16")
        self.version = version
        self._machine = machine_key
        self._ephemeral = ephemeral or PrivateKey.generate(MACHINE_PUBLIC_PREFIX)
        self._buffer = bytearray()
        self._done = False
        s = self._state = SymmetricState()
        s.mix_hash(prologue(version))
        s.mix_hash(control_key)
        # -> e, es, s, ss
        e_pub = self._ephemeral.public.raw
        s.mix_hash(e_pub)
        k = s.mix_dh(self._ephemeral, control_key)
        enc_machine = s.encrypt_and_hash(k, machine_key.public.raw)
        k = s.mix_dh(machine_key, control_key)
        tag = s.encrypt_and_hash(k, b"")
        header = struct.pack(">HBH", version, MSG_INITIATION, INITIATION_LEN - INITIATION_HEADER_LEN)
        self.initiation = header + e_pub + enc_machine + tag
        assert len(self.initiation) == INITIATION_LEN

    def receive_data(self, data: bytes) -> tuple[NoiseTransport, bytes] | None:
        """Feed bytes from the server. Returns None until the whole response is in, then the
        transport plus the bytes that followed the response (the first records)."""
        if self._done:
            raise ProtocolViolation("handshake already finished")
        self._buffer += data
        if len(self._buffer) < HEADER_LEN:
            return None
        msg_type, length = struct.unpack_from(">BH", self._buffer)
        if msg_type == MSG_ERROR:
            if len(self._buffer) < HEADER_LEN + length:
                return None
            text = bytes(self._buffer[HEADER_LEN:HEADER_LEN + length]).decode(errors="replace")
            raise HandshakeRefused(f"server error: {text!r}")
        if msg_type != MSG_RESPONSE:
            raise ProtocolViolation(f"unexpected handshake message type {msg_type}")
        if length != RESPONSE_LEN - HEADER_LEN:
            raise ProtocolViolation(f"wrong length {length} for handshake response")
        if len(self._buffer) < RESPONSE_LEN:
            return None
        response = bytes(self._buffer[:RESPONSE_LEN])
        leftover = bytes(self._buffer[RESPONSE_LEN:])
        self._done = True
        self._buffer.clear()
        return self._finish(response), leftover

    def _finish(self, response: bytes) -> NoiseTransport:
        s = self._state
        server_ephemeral = response[HEADER_LEN:HEADER_LEN + 32]
        # <- e, ee, se
        s.mix_hash(server_ephemeral)
        s.mix_dh(self._ephemeral, server_ephemeral)
        k = s.mix_dh(self._machine, server_ephemeral)
        s.decrypt_and_hash(k, response[HEADER_LEN + 32:])
        k1, k2 = s.split()
        return NoiseTransport(tx_key=k1, rx_key=k2, handshake_hash=s.h)
