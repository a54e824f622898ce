"""A minimal Noise IK *responder* for tests: the server side of TS2021's handshake.

It reuses :class:`SymmetricState` from the initiator, so on its own it only proves the two sides
agree; the Go-generated vectors in ``test_noise.py`` are what tie both to controlbase.
"""

from __future__ import annotations

import struct

from tailnet_agent.control.keys import MACHINE_PUBLIC_PREFIX, PrivateKey
from tailnet_agent.control.noise import (
    HEADER_LEN,
    INITIATION_HEADER_LEN,
    MSG_RESPONSE,
    NoiseTransport,
    SymmetricState,
    prologue,
)


def respond(control_key: PrivateKey, initiation: bytes, *,
            ephemeral: PrivateKey | None = None) -> tuple[bytes, NoiseTransport, bytes]:
    """Returns (response message, server transport, client's machine public key)."""
    version = struct.unpack_from(">H", initiation)[0]
    s = SymmetricState()
    s.mix_hash(prologue(version))
    s.mix_hash(control_key.public.raw)
    body = initiation[INITIATION_HEADER_LEN:]
    client_e = body[:32]
    s.mix_hash(client_e)
    k = s.mix_dh(control_key, client_e)
    machine = s.decrypt_and_hash(k, body[32:80])
    k = s.mix_dh(control_key, machine)
    s.decrypt_and_hash(k, body[80:])
    e = ephemeral or PrivateKey.generate(MACHINE_PUBLIC_PREFIX)
    s.mix_hash(e.public.raw)
    s.mix_dh(e, client_e)
    k = s.mix_dh(e, machine)
    tag = s.encrypt_and_hash(k, b"")
    k1, k2 = s.split()
    response = struct.pack(">BH", MSG_RESPONSE, 48) + e.public.raw + tag
    assert len(response) == HEADER_LEN + 48
    return response, NoiseTransport(tx_key=k2, rx_key=k1, handshake_hash=s.h), machine
