//! Fast loss recovery for the TCP data the local stack sends.
//!
//! smoltcp resends a lost segment after three duplicate ACKs that leave the window unchanged,
//! or after its retransmission timeout, which never goes below one second (RFC 6298's floor).
//! A DERP relay keeps 32 packets per destination and drops the oldest when a burst overflows
//! that queue, so a burst loses a run of segments. The receiver says which ones in its SACK
//! blocks, but smoltcp ignores SACK, its duplicate-ACK count is reset by every window change,
//! and each loss costs a one-second stall.
//!
//! [`Recovery`] keeps a copy of every unacknowledged data segment the stack sends and reads the
//! ACKs that come back before the stack does. It resends a copy of a segment when
//!
//! * SACK blocks cover at least [`DUP_THRESH`] segments above it (RFC 6675's loss rule);
//! * without SACK, it is the first unacknowledged segment and [`DUP_THRESH`] duplicate ACKs
//!   arrived, or a partial ACK arrived while recovering (NewReno);
//! * no ACK advanced for a probe timeout (about two smoothed RTTs, 20 ms to 500 ms; at most
//!   [`MAX_PROBES`] times in a row): a tail-loss probe, since a lost last segment draws no
//!   duplicate ACKs; a partial ACK after it resends the next hole, as in NewReno.
//!
//! Resends are ACK-clocked: each ACK releases at most [`RESENDS_PER_ACK`], so a repair does not
//! overflow the queue that caused the loss. A segment is not resent again within a smoothed RTT.
//! The copies are byte-for-byte what the stack sent, so the receiver treats them as the stack's
//! own retransmissions; the stack only sees its cumulative ACK advance. Its own retransmission
//! timer stays as the last resort.

use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;

use crate::filter::{PacketInfo, PROTO_TCP};

/// SACKed segments above a hole (or duplicate ACKs) that mark it lost.
pub const DUP_THRESH: usize = 3;
/// Resends one ACK may release.
pub const RESENDS_PER_ACK: usize = 2;
/// Tail-loss probes in a row before the stack's own timer takes over.
pub const MAX_PROBES: u32 = 3;
const MIN_PROBE_TIMEOUT: f64 = 0.020;
const MAX_PROBE_TIMEOUT: f64 = 0.500;
/// Flows with no packet either way for this long are forgotten (the stack's own timeout is 120 s).
const IDLE_FLOW_SECS: f64 = 180.0;

const TCP_FIN: u8 = 0x01;
const TCP_SYN: u8 = 0x02;
const TCP_RST: u8 = 0x04;
const TCP_ACK: u8 = 0x10;
const OPT_END: u8 = 0;
const OPT_NOP: u8 = 1;
const OPT_SACK: u8 = 5;

/// The fields of a TCP segment this module needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Segment {
    pub src: (IpAddr, u16),
    pub dst: (IpAddr, u16),
    pub seq: u32,
    pub ack: u32,
    pub flags: u8,
    pub window: u16,
    /// Sequence space the segment occupies (payload, plus one for SYN and for FIN).
    pub len: u32,
    pub payload_len: usize,
    pub sack: Vec<(u32, u32)>,
}

/// The TCP fields of a packet the data plane already parsed (`info`); None for other protocols,
/// fragments and truncated headers.
pub fn parse_tcp(pkt: &[u8], info: &PacketInfo) -> Option<Segment> {
    if info.proto != PROTO_TCP || info.fragment {
        return None;
    }
    let l4 = pkt.get(info.l4_start..info.l4_end)?;
    let hdr = l4.get(..20)?;
    let offset = usize::from(hdr[12] >> 4) * 4;
    if offset < 20 || l4.len() < offset {
        return None;
    }
    let flags = hdr[13];
    let payload_len = l4.len() - offset;
    let len = payload_len as u32 + u32::from(flags & TCP_SYN != 0) + u32::from(flags & TCP_FIN != 0);
    Some(Segment {
        src: (info.src, info.src_port),
        dst: (info.dst, info.dst_port),
        seq: u32::from_be_bytes([hdr[4], hdr[5], hdr[6], hdr[7]]),
        ack: u32::from_be_bytes([hdr[8], hdr[9], hdr[10], hdr[11]]),
        flags,
        window: u16::from_be_bytes([hdr[14], hdr[15]]),
        len,
        payload_len,
        sack: sack_blocks(&l4[20..offset]),
    })
}

fn sack_blocks(mut opts: &[u8]) -> Vec<(u32, u32)> {
    let mut out = Vec::new();
    while let Some(&kind) = opts.first() {
        match kind {
            OPT_END => break,
            OPT_NOP => opts = &opts[1..],
            _ => {
                let Some(&len) = opts.get(1) else { break };
                let len = usize::from(len);
                if len < 2 || opts.len() < len {
                    break;
                }
                if kind == OPT_SACK {
                    for block in opts[2..len].chunks_exact(8) {
                        let left = u32::from_be_bytes([block[0], block[1], block[2], block[3]]);
                        let right = u32::from_be_bytes([block[4], block[5], block[6], block[7]]);
                        out.push((left, right));
                    }
                }
                opts = &opts[len..];
            }
        }
    }
    out
}

type Endpoint = (IpAddr, u16);

#[derive(Debug)]
struct Sent {
    packet: Vec<u8>,
    end: u64,
    sent_at: f64,
    resent_at: Option<f64>,
    sacked: bool,
}

/// One connection's unacknowledged data. Sequence numbers are unwrapped to u64 offsets.
#[derive(Debug)]
struct Flow {
    una: u64,
    una_wire: u32,
    max: u64,
    segments: BTreeMap<u64, Sent>,
    sacked: usize,
    srtt: Option<f64>,
    dup_acks: usize,
    /// While recovering without SACK: the highest offset sent when recovery began.
    recover: Option<u64>,
    progress_at: f64,
    probes: u32,
    zero_window: bool,
    seen_at: f64,
}

/// Start of the unwrapped sequence space, so offsets below the first segment stay positive.
const ORIGIN: u64 = 1 << 40;

impl Flow {
    fn new(seq: u32, now: f64) -> Self {
        Flow {
            una: ORIGIN,
            una_wire: seq,
            max: ORIGIN,
            segments: BTreeMap::new(),
            sacked: 0,
            srtt: None,
            dup_acks: 0,
            recover: None,
            progress_at: now,
            probes: 0,
            zero_window: false,
            seen_at: now,
        }
    }

    fn unwrap(&self, wire: u32) -> u64 {
        let delta = i64::from(wire.wrapping_sub(self.una_wire) as i32);
        self.una.saturating_add_signed(delta)
    }

    fn probe_timeout(&self) -> f64 {
        let base = self.srtt.map_or(MAX_PROBE_TIMEOUT, |rtt| {
            (2.0 * rtt).clamp(MIN_PROBE_TIMEOUT, MAX_PROBE_TIMEOUT)
        });
        base * f64::from(1u32 << self.probes.min(8))
    }

    fn probe_deadline(&self) -> Option<f64> {
        (!self.segments.is_empty() && self.probes < MAX_PROBES && !self.zero_window)
            .then(|| self.progress_at + self.probe_timeout())
    }

    fn may_resend(&self, sent: &Sent, now: f64) -> bool {
        let guard = self.srtt.unwrap_or(MIN_PROBE_TIMEOUT).max(0.001);
        !sent.sacked && sent.resent_at.is_none_or(|at| now - at >= guard)
    }

    /// Acknowledges everything below `ack`; returns whether it advanced.
    fn cumulative_ack(&mut self, ack: u64, wire: u32, now: f64) -> bool {
        if ack <= self.una || ack > self.max {
            return false;
        }
        let mut sample = None;
        while let Some(entry) = self.segments.first_entry() {
            if entry.get().end > ack {
                break;
            }
            let sent = entry.remove();
            if sent.sacked {
                self.sacked -= 1;
            }
            if sent.resent_at.is_none() {
                sample = Some(now - sent.sent_at);
            }
        }
        if let Some(rtt) = sample {
            self.srtt = Some(self.srtt.map_or(rtt, |s| 0.875 * s + 0.125 * rtt));
        }
        self.una = ack;
        self.una_wire = wire;
        self.dup_acks = 0;
        self.progress_at = now;
        self.probes = 0;
        true
    }

    fn mark_sacked(&mut self, blocks: &[(u32, u32)]) {
        for &(left, right) in blocks {
            let (left, right) = (self.unwrap(left), self.unwrap(right));
            if right <= left || right > self.max {
                continue;
            }
            for sent in self.segments.range_mut(left..right).map(|(_, s)| s) {
                if sent.end <= right && !sent.sacked {
                    sent.sacked = true;
                    self.sacked += 1;
                }
            }
        }
    }

    /// Segments RFC 6675 deems lost (lowest first): not SACKed, with DUP_THRESH SACKed above.
    fn sack_losses(&self, now: f64, limit: usize) -> Vec<u64> {
        let mut above = 0;
        let mut lost = Vec::new();
        for (&start, sent) in self.segments.iter().rev() {
            if sent.sacked {
                above += 1;
            } else if above >= DUP_THRESH && self.may_resend(sent, now) {
                lost.push(start);
            }
        }
        lost.reverse();
        lost.truncate(limit);
        lost
    }

    fn first_unsacked(&self, now: f64) -> Option<u64> {
        let (&start, sent) = self.segments.iter().find(|(_, s)| !s.sacked)?;
        self.may_resend(sent, now).then_some(start)
    }

    fn resend(&mut self, start: u64, now: f64, out: &mut Vec<Vec<u8>>) {
        if let Some(sent) = self.segments.get_mut(&start) {
            sent.resent_at = Some(now);
            out.push(sent.packet.clone());
        }
    }
}

/// Per-flow copies of unacknowledged segments and the loss rules above.
#[derive(Debug, Default)]
pub struct Recovery {
    flows: HashMap<(Endpoint, Endpoint), Flow>,
    /// Segments resent on SACK or duplicate-ACK evidence.
    pub fast_resends: u64,
    /// Segments resent by the tail-loss probe timer.
    pub probe_resends: u64,
}

impl Recovery {
    pub fn new() -> Self {
        Self::default()
    }

    /// Bytes of segment copies held (for tests and metrics).
    pub fn held_bytes(&self) -> usize {
        self.flows
            .values()
            .flat_map(|f| f.segments.values())
            .map(|s| s.packet.len())
            .sum()
    }

    pub fn flow_count(&self) -> usize {
        self.flows.len()
    }

    /// A packet the local stack sends (`info` from `parse_packet`): data segments are kept until
    /// acknowledged.
    pub fn on_outbound(&mut self, pkt: &[u8], info: &PacketInfo, now: f64) {
        let Some(seg) = parse_tcp(pkt, info) else { return };
        let key = (seg.src, seg.dst);
        if seg.flags & (TCP_RST | TCP_SYN) != 0 {
            self.flows.remove(&key);
            return;
        }
        if seg.len == 0 {
            if let Some(flow) = self.flows.get_mut(&key) {
                flow.seen_at = now;
            }
            return;
        }
        let flow = self.flows.entry(key).or_insert_with(|| Flow::new(seg.seq, now));
        flow.seen_at = now;
        let start = flow.unwrap(seg.seq);
        let end = start + u64::from(seg.len);
        if end <= flow.una {
            return;
        }
        if flow.segments.is_empty() {
            flow.progress_at = now;
        }
        // The stack's own retransmission (same start) restarts the RTT guard; a resend that
        // coalesced several earlier segments replaces them.
        let resent_at = flow.segments.get(&start).map(|_| now);
        let covered: Vec<u64> = flow
            .segments
            .range(start..end)
            .filter(|(_, s)| s.end <= end)
            .map(|(&k, _)| k)
            .collect();
        for k in covered {
            if flow.segments.remove(&k).is_some_and(|s| s.sacked) {
                flow.sacked -= 1;
            }
        }
        flow.segments.insert(
            start,
            Sent {
                packet: pkt.to_vec(),
                end,
                sent_at: now,
                resent_at,
                sacked: false,
            },
        );
        flow.max = flow.max.max(end);
    }

    /// A packet for the local stack (`info` from `parse_packet`): ACK and SACK processing; copies
    /// to resend go to `out`.
    pub fn on_inbound(&mut self, pkt: &[u8], info: &PacketInfo, now: f64, out: &mut Vec<Vec<u8>>) {
        let Some(seg) = parse_tcp(pkt, info) else { return };
        let key = (seg.dst, seg.src);
        if seg.flags & TCP_RST != 0 {
            self.flows.remove(&key);
            return;
        }
        let Some(flow) = self.flows.get_mut(&key) else { return };
        flow.seen_at = now;
        if seg.flags & TCP_ACK == 0 {
            return;
        }
        flow.zero_window = seg.window == 0;
        let ack = flow.unwrap(seg.ack);
        let advanced = flow.cumulative_ack(ack, seg.ack, now);
        flow.mark_sacked(&seg.sack);
        let before = out.len();
        if flow.sacked > 0 {
            for start in flow.sack_losses(now, RESENDS_PER_ACK) {
                flow.resend(start, now, out);
            }
        } else if advanced {
            // NewReno: a partial ACK while recovering points at the next hole.
            if flow.recover.is_some_and(|r| ack < r) {
                if let Some(start) = flow.first_unsacked(now) {
                    flow.resend(start, now, out);
                }
            } else {
                flow.recover = None;
            }
        } else if ack == flow.una && seg.payload_len == 0 && !flow.segments.is_empty() {
            flow.dup_acks += 1;
            if flow.dup_acks >= DUP_THRESH {
                flow.recover.get_or_insert(flow.max);
                if let Some(start) = flow.first_unsacked(now) {
                    flow.resend(start, now, out);
                }
            }
        }
        self.fast_resends += (out.len() - before) as u64;
    }

    /// Tail-loss probes that are due, and forgetting idle flows.
    pub fn poll(&mut self, now: f64, out: &mut Vec<Vec<u8>>) {
        self.flows.retain(|_, f| now - f.seen_at < IDLE_FLOW_SECS);
        for flow in self.flows.values_mut() {
            if flow.probe_deadline().is_some_and(|at| now >= at) {
                flow.probes += 1;
                flow.progress_at = now;
                // What the probe's ACK leaves unacknowledged is lost too (NewReno's partial ACK).
                flow.recover.get_or_insert(flow.max);
                // The probe ignores the RTT guard: nothing came back for two RTTs.
                if let Some((&start, _)) = flow.segments.iter().find(|(_, s)| !s.sacked) {
                    flow.resend(start, now, out);
                    self.probe_resends += 1;
                }
            }
        }
    }

    /// When the next tail-loss probe is due.
    pub fn next_deadline(&self) -> Option<f64> {
        self.flows.values().filter_map(Flow::probe_deadline).reduce(f64::min)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::filter::parse_packet;

    impl Recovery {
        fn sent(&mut self, pkt: &[u8], now: f64) {
            self.on_outbound(pkt, &parse_packet(pkt).unwrap(), now);
        }

        fn acked(&mut self, pkt: &[u8], now: f64, out: &mut Vec<Vec<u8>>) {
            self.on_inbound(pkt, &parse_packet(pkt).unwrap(), now, out);
        }
    }

    fn tcp(pkt: &[u8]) -> Option<Segment> {
        parse_tcp(pkt, &parse_packet(pkt)?)
    }

    const LOCAL: [u8; 4] = [100, 64, 0, 1];
    const REMOTE: [u8; 4] = [100, 64, 0, 2];
    const MSS: u32 = 1000;

    /// An IPv4 TCP segment from LOCAL:40000 to REMOTE:80 (`outbound`) or back.
    fn packet(
        outbound: bool,
        seq: u32,
        ack: u32,
        flags: u8,
        window: u16,
        payload: usize,
        sack: &[(u32, u32)],
    ) -> Vec<u8> {
        let mut opts = Vec::new();
        if !sack.is_empty() {
            opts.extend([OPT_NOP, OPT_NOP, OPT_SACK, (2 + 8 * sack.len()) as u8]);
            for (l, r) in sack {
                opts.extend(l.to_be_bytes());
                opts.extend(r.to_be_bytes());
            }
        }
        let tcp_len = 20 + opts.len();
        let total = 20 + tcp_len + payload;
        let mut p = vec![0u8; total];
        p[0] = 0x45;
        p[2..4].copy_from_slice(&(total as u16).to_be_bytes());
        p[8] = 64;
        p[9] = 6;
        let (src, dst, sport, dport) = if outbound {
            (LOCAL, REMOTE, 40000u16, 80u16)
        } else {
            (REMOTE, LOCAL, 80, 40000)
        };
        p[12..16].copy_from_slice(&src);
        p[16..20].copy_from_slice(&dst);
        let t = &mut p[20..];
        t[0..2].copy_from_slice(&sport.to_be_bytes());
        t[2..4].copy_from_slice(&dport.to_be_bytes());
        t[4..8].copy_from_slice(&seq.to_be_bytes());
        t[8..12].copy_from_slice(&ack.to_be_bytes());
        t[12] = ((tcp_len / 4) as u8) << 4;
        t[13] = flags;
        t[14..16].copy_from_slice(&window.to_be_bytes());
        t[20..20 + opts.len()].copy_from_slice(&opts);
        for (i, b) in t[tcp_len..].iter_mut().enumerate() {
            *b = (seq as usize + i) as u8;
        }
        p
    }

    fn data(seq: u32) -> Vec<u8> {
        packet(true, seq, 1, TCP_ACK, 100, MSS as usize, &[])
    }

    fn ack(ack: u32, sack: &[(u32, u32)]) -> Vec<u8> {
        packet(false, 1, ack, TCP_ACK, 100, 0, sack)
    }

    /// Sends `n` segments from `isn`; returns their packets.
    fn send(r: &mut Recovery, isn: u32, n: u32, now: f64) -> Vec<Vec<u8>> {
        (0..n)
            .map(|i| {
                let p = data(isn.wrapping_add(i * MSS));
                r.sent(&p, now);
                p
            })
            .collect()
    }

    #[test]
    fn parses_sack_blocks_and_lengths() {
        let p = packet(false, 7, 9, TCP_ACK | TCP_FIN, 5, 3, &[(10, 20), (30, 40)]);
        let s = tcp(&p).unwrap();
        assert_eq!((s.seq, s.ack, s.window, s.payload_len, s.len), (7, 9, 5, 3, 4));
        assert_eq!(s.sack, vec![(10, 20), (30, 40)]);
        assert_eq!(s.dst, (IpAddr::from(LOCAL), 40000));
        assert!(tcp(&p[..30]).is_none());
    }

    #[test]
    fn cumulative_ack_releases_copies_and_measures_rtt() {
        let mut r = Recovery::new();
        send(&mut r, 1000, 4, 0.0);
        assert_eq!(r.held_bytes(), 4 * (40 + MSS as usize));
        let mut out = Vec::new();
        r.acked(&ack(1000 + 2 * MSS, &[]), 0.004, &mut out);
        assert_eq!(r.held_bytes(), 2 * (40 + MSS as usize));
        r.acked(&ack(1000 + 4 * MSS, &[]), 0.004, &mut out);
        assert_eq!(r.held_bytes(), 0);
        assert!(out.is_empty());
        let flow = r.flows.values().next().unwrap();
        assert!((flow.srtt.unwrap() - 0.004).abs() < 1e-9);
        assert_eq!(r.next_deadline(), None, "nothing outstanding, no probe");
    }

    #[test]
    fn sack_marks_holes_lost_and_resends_them_ack_clocked() {
        let mut r = Recovery::new();
        let isn = 5000;
        let sent = send(&mut r, isn, 10, 0.0);
        let mut out = Vec::new();
        // Segments 2, 3 and 4 were dropped; 5..=9 arrived.
        let at = |i: u32| isn + i * MSS;
        r.acked(&ack(at(2), &[(at(5), at(6))]), 0.01, &mut out);
        assert!(out.is_empty(), "one SACKed segment is not yet evidence of loss");
        r.acked(&ack(at(2), &[(at(5), at(8))]), 0.01, &mut out);
        assert_eq!(
            out,
            vec![sent[2].clone(), sent[3].clone()],
            "at most two per ACK, lowest first"
        );
        out.clear();
        r.acked(&ack(at(2), &[(at(5), at(9))]), 0.01, &mut out);
        assert_eq!(out, vec![sent[4].clone()], "already resent holes wait an RTT");
        assert_eq!(r.fast_resends, 3);
        out.clear();
        r.acked(&ack(at(10), &[]), 0.02, &mut out);
        assert!(out.is_empty());
        assert_eq!(r.held_bytes(), 0);
    }

    #[test]
    fn duplicate_acks_without_sack_then_partial_acks() {
        let mut r = Recovery::new();
        let sent = send(&mut r, 1, 6, 0.0);
        let mut out = Vec::new();
        r.acked(&ack(1 + MSS, &[]), 0.01, &mut out);
        for _ in 0..DUP_THRESH - 1 {
            r.acked(&ack(1 + MSS, &[]), 0.011, &mut out);
        }
        assert!(out.is_empty());
        r.acked(&ack(1 + MSS, &[]), 0.012, &mut out);
        assert_eq!(out, vec![sent[1].clone()]);
        out.clear();
        // Segment 1 repaired; segment 3 was lost too: the partial ACK resends it at once.
        r.acked(&ack(1 + 3 * MSS, &[]), 0.02, &mut out);
        assert_eq!(out, vec![sent[3].clone()]);
        out.clear();
        r.acked(&ack(1 + 6 * MSS, &[]), 0.03, &mut out);
        assert!(out.is_empty());
    }

    #[test]
    fn tail_loss_probe_backs_off_and_stops() {
        let mut r = Recovery::new();
        let sent = send(&mut r, u32::MAX - 1500, 3, 0.0);
        let mut out = Vec::new();
        r.acked(&ack((u32::MAX - 1500).wrapping_add(2 * MSS), &[]), 0.005, &mut out);
        let first = r.next_deadline().unwrap();
        assert!(
            (first - (0.005 + MIN_PROBE_TIMEOUT)).abs() < 1e-9,
            "2 x srtt, floored: {first}"
        );
        r.poll(first - 0.001, &mut out);
        assert!(out.is_empty());
        r.poll(first, &mut out);
        assert_eq!(out, vec![sent[2].clone()], "sequence numbers wrapped");
        let second = r.next_deadline().unwrap();
        assert!((second - first - 2.0 * MIN_PROBE_TIMEOUT).abs() < 1e-9, "doubled");
        r.poll(second, &mut out);
        r.poll(r.next_deadline().unwrap(), &mut out);
        assert_eq!(out.len(), MAX_PROBES as usize);
        assert_eq!(r.next_deadline(), None, "the stack's own timer takes over");
        assert_eq!(r.probe_resends, u64::from(MAX_PROBES));
    }

    #[test]
    fn zero_window_is_not_probed_and_rst_forgets_the_flow() {
        let mut r = Recovery::new();
        send(&mut r, 1, 2, 0.0);
        let mut out = Vec::new();
        r.acked(&packet(false, 1, 1 + MSS, TCP_ACK, 0, 0, &[]), 0.01, &mut out);
        assert_eq!(r.next_deadline(), None);
        r.acked(&packet(false, 1, 0, TCP_RST, 0, 0, &[]), 0.02, &mut out);
        assert_eq!(r.flow_count(), 0);
        assert!(out.is_empty());
    }

    #[test]
    fn stack_retransmission_that_coalesces_replaces_the_copies() {
        let mut r = Recovery::new();
        send(&mut r, 1, 3, 0.0);
        let big = packet(true, 1, 1, TCP_ACK, 100, 2 * MSS as usize, &[]);
        r.sent(&big, 1.0);
        let flow = r.flows.values().next().unwrap();
        assert_eq!(flow.segments.len(), 2);
        assert_eq!(flow.segments.values().next().unwrap().packet, big);
    }

    #[test]
    fn idle_flows_are_forgotten() {
        let mut r = Recovery::new();
        send(&mut r, 1, 1, 0.0);
        let mut out = Vec::new();
        r.poll(IDLE_FLOW_SECS + 1.0, &mut out);
        assert_eq!(r.flow_count(), 0);
    }
}
