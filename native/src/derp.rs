//! DERP frame codec: `type:u8 | len:u32 BE | payload`.
//!
//! The decoder is incremental: feed it arbitrary chunks of the relay's byte stream and it
//! yields whole frames. Handshake frames (ServerKey, ServerInfo) are passed through as
//! `Frame::Other` so the caller can decide what to do with them.

pub const KEY_LEN: usize = 32;
/// Largest payload we accept. DERP packets are at most 64 KiB; the frame adds the key.
pub const MAX_FRAME_LEN: usize = 64 * 1024 + KEY_LEN + 1024;

pub const FRAME_SERVER_KEY: u8 = 0x01;
pub const FRAME_CLIENT_INFO: u8 = 0x02;
pub const FRAME_SERVER_INFO: u8 = 0x03;
pub const FRAME_SEND_PACKET: u8 = 0x04;
pub const FRAME_RECV_PACKET: u8 = 0x05;
pub const FRAME_KEEP_ALIVE: u8 = 0x06;
pub const FRAME_NOTE_PREFERRED: u8 = 0x07;
pub const FRAME_PEER_GONE: u8 = 0x08;
pub const FRAME_PEER_PRESENT: u8 = 0x09;
pub const FRAME_PING: u8 = 0x12;
pub const FRAME_PONG: u8 = 0x13;
pub const FRAME_HEALTH: u8 = 0x14;
pub const FRAME_RESTARTING: u8 = 0x15;

const HEADER_LEN: usize = 5;

/// A decoded frame. Borrowed payloads point into the decoder's buffer.
#[derive(Debug, PartialEq, Eq)]
pub enum Frame<'a> {
    /// A packet relayed from `src` (protocol v2 RecvPacket).
    RecvPacket {
        src: [u8; KEY_LEN],
        packet: &'a [u8],
    },
    KeepAlive,
    Ping([u8; 8]),
    Pong([u8; 8]),
    PeerGone {
        key: [u8; KEY_LEN],
        reason: u8,
    },
    PeerPresent {
        key: [u8; KEY_LEN],
    },
    Health(&'a [u8]),
    /// Server restarting: (reconnect_in_ms, try_for_ms); zero when absent.
    Restarting {
        reconnect_in_ms: u32,
        try_for_ms: u32,
    },
    /// Any other frame type (handshake frames, unknown types, malformed known types).
    Other {
        frame_type: u8,
        payload: &'a [u8],
    },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DecodeError {
    FrameTooLarge { frame_type: u8, len: usize },
}

impl std::fmt::Display for DecodeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DecodeError::FrameTooLarge { frame_type, len } => write!(
                f,
                "DERP frame type {frame_type:#04x} declares {len} bytes (max {MAX_FRAME_LEN}); stream is corrupt"
            ),
        }
    }
}

/// Incremental decoder for one relay connection.
#[derive(Debug, Default)]
pub struct Decoder {
    buf: Vec<u8>,
    pos: usize,
}

fn key(bytes: &[u8]) -> Option<[u8; KEY_LEN]> {
    bytes.get(..KEY_LEN)?.try_into().ok()
}

fn parse(frame_type: u8, payload: &[u8]) -> Frame<'_> {
    let other = Frame::Other { frame_type, payload };
    match frame_type {
        FRAME_RECV_PACKET => match key(payload) {
            Some(src) => Frame::RecvPacket {
                src,
                packet: &payload[KEY_LEN..],
            },
            None => other,
        },
        FRAME_KEEP_ALIVE => Frame::KeepAlive,
        FRAME_PING | FRAME_PONG => match payload.get(..8).and_then(|p| <[u8; 8]>::try_from(p).ok()) {
            Some(data) if frame_type == FRAME_PING => Frame::Ping(data),
            Some(data) => Frame::Pong(data),
            None => other,
        },
        FRAME_PEER_GONE => match key(payload) {
            Some(key) => Frame::PeerGone {
                key,
                reason: payload.get(KEY_LEN).copied().unwrap_or(0),
            },
            None => other,
        },
        FRAME_PEER_PRESENT => match key(payload) {
            Some(key) => Frame::PeerPresent { key },
            None => other,
        },
        FRAME_HEALTH => Frame::Health(payload),
        FRAME_RESTARTING => {
            let word = |i: usize| {
                payload
                    .get(i..i + 4)
                    .map_or(0, |b| u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
            };
            Frame::Restarting {
                reconnect_in_ms: word(0),
                try_for_ms: word(4),
            }
        }
        _ => other,
    }
}

impl Decoder {
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends bytes read from the relay connection.
    pub fn push(&mut self, chunk: &[u8]) {
        if self.pos > 0 && self.pos == self.buf.len() {
            self.buf.clear();
            self.pos = 0;
        }
        self.buf.extend_from_slice(chunk);
    }

    /// Returns the next whole frame, `Ok(None)` when more bytes are needed.
    pub fn next_frame(&mut self) -> Result<Option<Frame<'_>>, DecodeError> {
        let rest = &self.buf[self.pos..];
        if rest.len() < HEADER_LEN {
            self.compact();
            return Ok(None);
        }
        let frame_type = rest[0];
        let len = u32::from_be_bytes([rest[1], rest[2], rest[3], rest[4]]) as usize;
        if len > MAX_FRAME_LEN {
            return Err(DecodeError::FrameTooLarge { frame_type, len });
        }
        if rest.len() < HEADER_LEN + len {
            self.compact();
            return Ok(None);
        }
        let start = self.pos + HEADER_LEN;
        self.pos = start + len;
        Ok(Some(parse(frame_type, &self.buf[start..start + len])))
    }

    /// Bytes buffered but not yet decoded (a partial frame).
    pub fn pending(&self) -> usize {
        self.buf.len() - self.pos
    }

    /// Drops all buffered bytes (for a new connection).
    pub fn reset(&mut self) {
        self.buf.clear();
        self.pos = 0;
    }

    fn compact(&mut self) {
        if self.pos > 0 {
            self.buf.drain(..self.pos);
            self.pos = 0;
        }
    }
}

/// Appends one frame to `out`.
pub fn encode_frame(out: &mut Vec<u8>, frame_type: u8, parts: &[&[u8]]) {
    let len: usize = parts.iter().map(|p| p.len()).sum();
    out.reserve(HEADER_LEN + len);
    out.push(frame_type);
    // Frames we build are bounded by MAX_FRAME_LEN, far below u32::MAX.
    out.extend_from_slice(&(len as u32).to_be_bytes());
    for part in parts {
        out.extend_from_slice(part);
    }
}

/// Appends a SendPacket frame addressed to `dst`.
pub fn encode_send_packet(out: &mut Vec<u8>, dst: &[u8; KEY_LEN], packet: &[u8]) {
    encode_frame(out, FRAME_SEND_PACKET, &[dst, packet]);
}

pub fn encode_pong(out: &mut Vec<u8>, data: &[u8; 8]) {
    encode_frame(out, FRAME_PONG, &[data]);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frames(dec: &mut Decoder) -> Vec<String> {
        let mut out = Vec::new();
        while let Some(f) = dec.next_frame().unwrap() {
            out.push(format!("{f:?}"));
        }
        out
    }

    #[test]
    fn send_packet_round_trips_as_recv_packet() {
        let key = [7u8; 32];
        let mut wire = Vec::new();
        encode_send_packet(&mut wire, &key, b"hello wireguard");
        assert_eq!(wire[0], FRAME_SEND_PACKET);
        assert_eq!(u32::from_be_bytes(wire[1..5].try_into().unwrap()), 32 + 15);
        // A relay rewrites SendPacket(dst) into RecvPacket(src) with the same layout.
        wire[0] = FRAME_RECV_PACKET;
        let mut dec = Decoder::new();
        dec.push(&wire);
        assert_eq!(
            dec.next_frame().unwrap(),
            Some(Frame::RecvPacket {
                src: key,
                packet: b"hello wireguard"
            })
        );
        assert_eq!(dec.next_frame().unwrap(), None);
        assert_eq!(dec.pending(), 0);
    }

    #[test]
    fn partial_frames_byte_by_byte() {
        let mut wire = Vec::new();
        encode_frame(&mut wire, FRAME_RECV_PACKET, &[&[1u8; 32], b"abc"]);
        encode_frame(&mut wire, FRAME_KEEP_ALIVE, &[]);
        encode_frame(&mut wire, FRAME_PING, &[b"12345678"]);
        let mut dec = Decoder::new();
        let mut seen = Vec::new();
        for b in &wire {
            dec.push(std::slice::from_ref(b));
            seen.extend(frames(&mut dec));
        }
        assert_eq!(seen.len(), 3);
        assert!(seen[0].starts_with("RecvPacket"));
        assert_eq!(seen[1], "KeepAlive");
        assert_eq!(seen[2], format!("{:?}", Frame::Ping(*b"12345678")));
        assert_eq!(dec.pending(), 0);
    }

    #[test]
    fn many_frames_in_one_chunk_and_split_header() {
        let mut wire = Vec::new();
        for i in 0..100u8 {
            encode_frame(&mut wire, FRAME_RECV_PACKET, &[&[i; 32], &[i; 100]]);
        }
        let mut dec = Decoder::new();
        let (a, b) = wire.split_at(3 * 137 + 2); // cut inside a header
        dec.push(a);
        assert_eq!(frames(&mut dec).len(), 3);
        assert_eq!(dec.pending(), 2);
        dec.push(b);
        assert_eq!(frames(&mut dec).len(), 97);
    }

    #[test]
    fn control_frames() {
        let mut wire = Vec::new();
        encode_frame(&mut wire, FRAME_PEER_GONE, &[&[9u8; 32], &[1]]);
        encode_frame(&mut wire, FRAME_PEER_PRESENT, &[&[8u8; 32]]);
        encode_frame(&mut wire, FRAME_HEALTH, &[b"degraded"]);
        encode_frame(
            &mut wire,
            FRAME_RESTARTING,
            &[&500u32.to_be_bytes(), &9000u32.to_be_bytes()],
        );
        encode_frame(&mut wire, 0x42, &[b"unknown"]);
        encode_frame(&mut wire, FRAME_RECV_PACKET, &[b"short"]);
        let mut dec = Decoder::new();
        dec.push(&wire);
        let f: Vec<_> = std::iter::from_fn(|| dec.next_frame().unwrap().map(|f| format!("{f:?}"))).collect();
        assert_eq!(
            f[0],
            format!(
                "{:?}",
                Frame::PeerGone {
                    key: [9; 32],
                    reason: 1
                }
            )
        );
        assert_eq!(f[1], format!("{:?}", Frame::PeerPresent { key: [8; 32] }));
        assert_eq!(f[2], format!("{:?}", Frame::Health(b"degraded")));
        assert_eq!(
            f[3],
            format!(
                "{:?}",
                Frame::Restarting {
                    reconnect_in_ms: 500,
                    try_for_ms: 9000
                }
            )
        );
        assert_eq!(
            f[4],
            format!(
                "{:?}",
                Frame::Other {
                    frame_type: 0x42,
                    payload: b"unknown"
                }
            )
        );
        assert_eq!(
            f[5],
            format!(
                "{:?}",
                Frame::Other {
                    frame_type: FRAME_RECV_PACKET,
                    payload: b"short"
                }
            )
        );
    }

    #[test]
    fn pong_and_oversized() {
        let mut out = Vec::new();
        encode_pong(&mut out, b"abcdefgh");
        assert_eq!(out, [&[FRAME_PONG, 0, 0, 0, 8][..], b"abcdefgh"].concat());
        let mut dec = Decoder::new();
        dec.push(&[FRAME_RECV_PACKET, 0xff, 0xff, 0xff, 0xff]);
        assert!(matches!(dec.next_frame(), Err(DecodeError::FrameTooLarge { .. })));
    }
}
