//! Fuzz targets: property tests over everything that parses bytes from the network.
//!
//! Each target runs `TAILNET_FUZZ_CASES` inputs (default 2000, a few seconds for all of them in
//! `cargo test`); `make fuzz` runs them with 10^6 and prints how many inputs each one ran and how
//! long it took. Inputs mix raw bytes with structured packets and frames that are then truncated
//! or corrupted, so the parsers are driven past their first length checks.
//!
//! The properties: no panic on any input, every offset a parser reports lies inside the input,
//! and what an encoder writes decodes to itself however the stream is cut into chunks.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};

use crate::dataplane::DataPlane;
use crate::derp::{self, Decoder, Frame, KEY_LEN, MAX_FRAME_LEN};
use crate::filter::{parse_packet, Filter, Rule, RuleSpec, Verdict, PROTO_TCP, PROTO_TSMP, PROTO_UDP};

/// Inputs per target: `TAILNET_FUZZ_CASES`, default 2000.
fn cases() -> u32 {
    std::env::var("TAILNET_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2000)
}

/// Runs `test` over `cases()` inputs of `strategy` and prints the count and the time taken.
fn fuzz<S: Strategy>(name: &str, strategy: S, test: impl Fn(S::Value) -> Result<(), TestCaseError>)
where
    S::Value: std::fmt::Debug,
{
    let count = AtomicU64::new(0);
    let config = Config {
        cases: cases(),
        failure_persistence: None,
        max_shrink_iters: 4096,
        ..Config::default()
    };
    let started = Instant::now();
    let mut runner = TestRunner::new(config);
    let result = runner.run(&strategy, |value| {
        count.fetch_add(1, Ordering::Relaxed);
        test(value)
    });
    let elapsed = started.elapsed().as_secs_f64();
    println!("fuzz {name}: {} inputs in {elapsed:.1}s", count.load(Ordering::Relaxed));
    if let Err(e) = result {
        panic!("fuzz target {name} failed: {e}");
    }
}

/// A byte string that is mostly a plausible IPv4 or IPv6 packet, then cut and corrupted.
fn packets() -> impl Strategy<Value = Vec<u8>> {
    let v4 = (
        0u8..16,      // IHL
        any::<u16>(), // total length
        any::<u16>(), // flags + fragment offset
        prop::sample::select(vec![1u8, 6, 17, 58, 99, 0, 255]),
        prop::collection::vec(any::<u8>(), 0..80), // options + transport
    )
        .prop_map(|(ihl, total, frag, proto, rest)| {
            let mut p = vec![0x40 | ihl, 0];
            p.extend_from_slice(&total.to_be_bytes());
            p.extend_from_slice(&[0, 0]);
            p.extend_from_slice(&frag.to_be_bytes());
            p.extend_from_slice(&[64, proto, 0, 0, 100, 64, 0, 2, 100, 64, 0, 1]);
            p.extend_from_slice(&rest);
            p
        });
    let v6 = (
        any::<u16>(),
        prop::sample::select(vec![0u8, 6, 17, 43, 44, 58, 60, 59]),
        prop::collection::vec(any::<u8>(), 0..120),
    )
        .prop_map(|(payload, next, rest)| {
            let mut p = vec![0x60, 0, 0, 0];
            p.extend_from_slice(&payload.to_be_bytes());
            p.extend_from_slice(&[next, 64]);
            p.extend_from_slice(&[0xfd; 16]);
            p.extend_from_slice(&[0xfd; 16]);
            p.extend_from_slice(&rest);
            p
        });
    let raw = prop::collection::vec(any::<u8>(), 0..96);
    (prop_oneof![v4, v6, raw], any::<usize>(), any::<(usize, u8)>()).prop_map(|(mut p, cut, (at, xor))| {
        if !p.is_empty() {
            let i = at % p.len();
            p[i] ^= xor;
            p.truncate(cut % (p.len() + 1));
        }
        p
    })
}

#[test]
fn fuzz_packet_parser() {
    fuzz("packet_parser", packets(), |pkt| {
        if let Some(info) = parse_packet(&pkt) {
            prop_assert!(info.l4_start <= info.l4_end, "{info:?}");
            prop_assert!(info.l4_end <= pkt.len(), "{info:?} of {} bytes", pkt.len());
            prop_assert_eq!(info.src.is_ipv4(), pkt[0] >> 4 == 4);
            prop_assert_eq!(info.src.is_ipv4(), info.dst.is_ipv4());
        }
        Ok(())
    });
}

/// Address sets as Tailscale writes them, and near misses.
fn address_sets() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("*".to_string()),
        any::<[u8; 4]>().prop_map(|a| Ipv4Addr::from(a).to_string()),
        (any::<[u8; 4]>(), 0u8..40).prop_map(|(a, n)| format!("{}/{n}", Ipv4Addr::from(a))),
        (any::<[u8; 16]>(), 0u8..140).prop_map(|(a, n)| format!("{}/{n}", std::net::Ipv6Addr::from(a))),
        (any::<[u8; 4]>(), any::<[u8; 4]>()).prop_map(|(a, b)| format!("{}-{}", Ipv4Addr::from(a), Ipv4Addr::from(b))),
        "[0-9a-f:./* -]{0,24}",
        ".{0,12}",
    ]
}

fn rule_specs() -> impl Strategy<Value = Vec<RuleSpec>> {
    let dst = (address_sets(), any::<u16>(), any::<u16>());
    let rule = (
        prop::collection::vec(address_sets(), 0..3),
        prop::collection::vec(dst, 0..3),
        prop::collection::vec(prop::sample::select(vec![1u8, 6, 17, 58, 99, 0]), 0..3),
    );
    prop::collection::vec(rule, 0..4)
}

#[test]
fn fuzz_filter() {
    let me: IpAddr = Ipv4Addr::new(100, 64, 0, 1).into();
    fuzz(
        "filter",
        (rule_specs(), prop::collection::vec(packets(), 1..4)),
        |(specs, pkts)| {
            let compiled: Vec<Rule> = specs.iter().filter_map(|s| Rule::compile(s).ok()).collect();
            let mut filter = Filter::new();
            filter.set_rules(compiled);
            // The catch-all rule admits every new flow to our address whatever else is there.
            let mut open = Filter::new();
            let mut rules: Vec<Rule> = specs.iter().filter_map(|s| Rule::compile(s).ok()).collect();
            rules.push(Rule::compile(&(vec!["*".into()], vec![("*".into(), 0, 65535)], vec![])).unwrap());
            open.set_rules(rules);
            for (i, pkt) in pkts.iter().enumerate() {
                let Some(info) = parse_packet(pkt) else { continue };
                let now = i as f64;
                filter.note_outbound(&info, now);
                let verdict = filter.check_inbound(&info, |ip| ip == me, now);
                if info.proto == PROTO_TSMP {
                    prop_assert_eq!(verdict, Verdict::Tsmp);
                } else if info.dst != me {
                    prop_assert_eq!(verdict, Verdict::NotForUs);
                }
                let catch_all = open.check_inbound(&info, |ip| ip == me, now);
                if info.dst == me && matches!(info.proto, PROTO_TCP | PROTO_UDP) {
                    prop_assert_eq!(catch_all, Verdict::Accept, "{:?}", info);
                }
            }
            Ok(())
        },
    );
}

/// A stream of well-formed frames (as encoded) followed by arbitrary bytes.
fn derp_frames() -> impl Strategy<Value = Vec<(u8, Vec<u8>)>> {
    let frame = (
        prop::sample::select(vec![0x01u8, 0x03, 0x05, 0x06, 0x08, 0x09, 0x12, 0x13, 0x14, 0x15, 0x7f]),
        prop::collection::vec(any::<u8>(), 0..80),
    );
    prop::collection::vec(frame, 0..6)
}

#[test]
fn fuzz_derp_codec_round_trip() {
    let input = (derp_frames(), prop::collection::vec(1usize..64, 1..8));
    fuzz("derp_codec_round_trip", input, |(frames, cuts)| {
        let mut wire = Vec::new();
        for (t, payload) in &frames {
            derp::encode_frame(&mut wire, *t, &[payload]);
        }
        let mut dec = Decoder::new();
        let mut seen = Vec::new();
        let mut pos = 0;
        let mut i = 0;
        while pos < wire.len() {
            let end = (pos + cuts[i % cuts.len()]).min(wire.len());
            dec.push(&wire[pos..end]);
            pos = end;
            i += 1;
            while let Some(frame) = dec.next_frame().map_err(|e| TestCaseError::fail(e.to_string()))? {
                seen.push(reencode(&frame));
            }
        }
        prop_assert_eq!(dec.pending(), 0);
        prop_assert_eq!(seen.len(), frames.len());
        for ((t, payload), (st, sp)) in frames.iter().zip(&seen) {
            prop_assert_eq!(*t, *st);
            // Fixed-size frames may ignore trailing bytes; everything they keep must match.
            prop_assert!(payload.starts_with(sp), "type {t:#x}: {payload:?} decoded as {sp:?}");
        }
        Ok(())
    });
}

/// The type and payload a decoded frame stands for.
fn reencode(frame: &Frame<'_>) -> (u8, Vec<u8>) {
    match frame {
        Frame::RecvPacket { src, packet } => (derp::FRAME_RECV_PACKET, [&src[..], packet].concat()),
        Frame::KeepAlive => (derp::FRAME_KEEP_ALIVE, Vec::new()),
        Frame::Ping(d) => (derp::FRAME_PING, d.to_vec()),
        Frame::Pong(d) => (derp::FRAME_PONG, d.to_vec()),
        Frame::PeerGone { key, .. } => (derp::FRAME_PEER_GONE, key.to_vec()),
        Frame::PeerPresent { key } => (derp::FRAME_PEER_PRESENT, key.to_vec()),
        Frame::Health(m) => (derp::FRAME_HEALTH, m.to_vec()),
        Frame::Restarting { .. } => (derp::FRAME_RESTARTING, Vec::new()),
        Frame::Other { frame_type, payload } => (*frame_type, payload.to_vec()),
    }
}

#[test]
fn fuzz_derp_decoder_arbitrary_bytes() {
    let input = (
        prop::collection::vec(prop::collection::vec(any::<u8>(), 0..64), 0..8),
        derp_frames(),
        any::<(usize, u8)>(),
    );
    fuzz("derp_decoder", input, |(chunks, frames, (at, xor))| {
        let mut wire = Vec::new();
        for (t, payload) in &frames {
            derp::encode_frame(&mut wire, *t, &[payload]);
        }
        if !wire.is_empty() {
            let i = at % wire.len();
            wire[i] ^= xor;
        }
        let mut dec = Decoder::new();
        for chunk in std::iter::once(&wire).chain(&chunks) {
            dec.push(chunk);
            loop {
                match dec.next_frame() {
                    Ok(Some(Frame::RecvPacket { packet, .. })) => prop_assert!(packet.len() <= MAX_FRAME_LEN - KEY_LEN),
                    Ok(Some(_)) => {}
                    Ok(None) => break,
                    Err(_) => {
                        dec.reset();
                        break;
                    }
                }
            }
        }
        Ok(())
    });
}

/// The data plane's whole receive path: DERP bytes and UDP datagrams from a known peer and from
/// strangers (WireGuard handshake/data/cookie messages by type byte, disco, STUN, garbage).
#[test]
fn fuzz_dataplane_receive() {
    let datagram = prop_oneof![
        (1u8..=4, prop::collection::vec(any::<u8>(), 0..160)).prop_map(|(t, rest)| {
            let mut d = vec![t, 0, 0, 0];
            d.extend_from_slice(&rest);
            d
        }),
        prop::collection::vec(any::<u8>(), 0..64).prop_map(|rest| [&b"TS\xf0\x9f\x92\xac"[..], &rest].concat()),
        prop::collection::vec(any::<u8>(), 0..64),
    ];
    let input = (prop::collection::vec(datagram, 0..4), derp_frames(), any::<bool>());
    fuzz("dataplane_receive", input, |(datagrams, frames, from_peer)| {
        let mut plane = DataPlane::new(&[1u8; 32], 64 * 1024).unwrap();
        let peer = DataPlane::new(&[2u8; 32], 64 * 1024).unwrap().public_key();
        plane.set_self(&["100.64.0.1/32".to_string()]).unwrap();
        plane
            .set_peers(vec![(peer, vec!["100.64.0.2/32".to_string()], 1)])
            .unwrap();
        let src: SocketAddr = "127.0.0.1:41641".parse().unwrap();
        if from_peer {
            plane.note_udp_source(src, peer);
        }
        for d in &datagrams {
            plane.udp_feed(src, d);
        }
        let mut wire = Vec::new();
        for (t, payload) in &frames {
            let body = if *t == derp::FRAME_RECV_PACKET {
                [&peer[..], payload].concat()
            } else {
                payload.clone()
            };
            derp::encode_frame(&mut wire, *t, &[&body]);
        }
        prop_assert!(plane.derp_feed(1, &wire).is_ok());
        let _ = plane.poll(1.0);
        Ok(())
    });
}
