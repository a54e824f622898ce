//! The sans-IO data plane: DERP bytes in, DERP bytes out, TCP streams in between.
//!
//! Inbound: DERP frames -> RecvPacket -> the sender's `Tunn` -> AllowedIPs source check ->
//! TSMP/filter -> queue. `poll(now)` feeds the queue to smoltcp, runs WireGuard timers and
//! smoltcp egress, encrypts what the stack sent (route by longest prefix over AllowedIPs ->
//! peer -> its home DERP region) and returns per-region write buffers, events and the
//! next deadline.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::net::{IpAddr, SocketAddr};

use boringtun::noise::TunnResult;

use crate::derp::{self, Decoder, Frame, KEY_LEN};
use crate::filter::{parse_packet, Filter, PacketInfo, Rule, RuleSpec, Verdict, PROTO_TCP, PROTO_TSMP};
use crate::recovery::Recovery;
use crate::route::Prefix;
use crate::stack::{Stack, StackError, SynDisposition, TcpEvent};
use crate::wg::{NodeKey, Peer, PeerSpec, Peers};

/// Disco packets ride DERP next to WireGuard and start with this magic ("TS💬").
pub const DISCO_MAGIC: &[u8] = b"TS\xf0\x9f\x92\xac";
/// boringtun timers want a tick every 100-250 ms.
pub const WG_TIMER_INTERVAL: f64 = 0.25;
/// Inbound packets buffered between derp_feed and poll.
pub const INBOUND_QUEUE_MAX: usize = 16384;
/// Largest IP packet we encrypt (DERP's 64 KiB limit minus WireGuard overhead).
const MAX_PACKET: usize = 65535;

/// Everything the data plane reports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    Tcp(TcpEvent),
    DerpPeerGone {
        region: u32,
        key: NodeKey,
        reason: u8,
    },
    DerpPeerPresent {
        region: u32,
        key: NodeKey,
    },
    DerpHealth {
        region: u32,
        message: String,
    },
    DerpRestarting {
        region: u32,
        reconnect_in_ms: u32,
        try_for_ms: u32,
    },
    /// A disco message relayed by DERP from the peer `key` (sealed; Python opens it).
    DiscoDerp {
        region: u32,
        key: NodeKey,
        payload: Vec<u8>,
    },
    /// A disco message that arrived on the UDP socket from `src`.
    DiscoUdp {
        src: SocketAddr,
        payload: Vec<u8>,
    },
    /// A STUN message (a DERP node's answer to a binding request) from `src`.
    StunUdp {
        src: SocketAddr,
        payload: Vec<u8>,
    },
    /// A frame the data plane does not handle itself (ServerKey, ServerInfo, unknown types).
    DerpFrame {
        region: u32,
        frame_type: u8,
        payload: Vec<u8>,
    },
}

macro_rules! counters {
    ($($name:ident),* $(,)?) => {
        /// Cumulative counters; `drop_*` are packets dropped by reason.
        #[derive(Debug, Default, Clone)]
        pub struct Counters { $(pub $name: u64),* }
        impl Counters {
            pub fn items(&self) -> Vec<(&'static str, u64)> {
                vec![$((stringify!($name), self.$name)),*]
            }
        }
    };
}

counters!(
    packets_in,
    bytes_in,
    packets_out,
    bytes_out,
    derp_frames_in,
    derp_bytes_in,
    derp_bytes_out,
    wg_handshake_packets,
    drop_unknown_peer,
    drop_wireguard,
    drop_spoofed_source,
    drop_tsmp,
    drop_filtered,
    drop_not_for_us,
    drop_malformed,
    drop_no_route,
    drop_queue_full,
    drop_backlog_full,
    disco_in,
    udp_packets_in,
    udp_bytes_in,
    udp_packets_out,
    udp_bytes_out,
    tcp_fast_resends,
    tcp_probe_resends,
);

#[derive(Debug)]
pub enum Error {
    InvalidKey(String),
    InvalidArgument(String),
    Stack(StackError),
    DerpCorrupt { region: u32, reason: String },
}

impl std::fmt::Display for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Error::InvalidKey(m) | Error::InvalidArgument(m) => f.write_str(m),
            Error::Stack(e) => write!(f, "{e}"),
            Error::DerpCorrupt { region, reason } => write!(f, "DERP region {region}: {reason}"),
        }
    }
}

impl From<StackError> for Error {
    fn from(e: StackError) -> Self {
        Error::Stack(e)
    }
}

pub fn parse_key(bytes: &[u8], what: &str) -> Result<NodeKey, Error> {
    bytes
        .try_into()
        .map_err(|_| Error::InvalidKey(format!("{what} must be 32 bytes, got {}", bytes.len())))
}

/// What `poll` hands back.
#[derive(Debug, Default)]
pub struct PollOutput {
    pub derp_writes: Vec<(u32, Vec<u8>)>,
    /// Datagrams queued for the UDP socket (WireGuard to peers with a direct path); taken with
    /// `udp_queue`.
    pub udp_pending: usize,
    pub events: Vec<Event>,
    pub next_deadline: Option<f64>,
}

pub struct DataPlane {
    peers: Peers,
    stack: Stack,
    filter: Filter,
    derp_in: HashMap<u32, Decoder>,
    out: Outbox,
    /// Source addresses of WireGuard over UDP, learned from disco, to the peer they belong to.
    udp_sources: HashMap<SocketAddr, NodeKey>,
    inbound: VecDeque<(Vec<u8>, PacketInfo)>,
    events: Vec<Event>,
    counters: Counters,
    now: f64,
    last_timers: f64,
    scratch: Vec<u8>,
    recovery: Recovery,
    resends: Vec<Vec<u8>>,
}

/// Where WireGuard datagrams go out: one DERP buffer per region, and UDP datagrams.
#[derive(Default)]
struct Outbox {
    derp: BTreeMap<u32, Vec<u8>>,
    udp: VecDeque<(SocketAddr, Vec<u8>)>,
}

/// UDP datagrams queued at most while the socket is not writable; more are dropped (TCP
/// resends what mattered).
pub const UDP_QUEUE_MAX: usize = 8192;

/// Queues a WireGuard datagram for `peer`: over its direct UDP path if disco confirmed one,
/// else as a SendPacket frame for its home DERP region.
fn queue_to_peer(out: &mut Outbox, counters: &mut Counters, peer: &Peer, datagram: &[u8]) {
    if let Some(addr) = peer.direct {
        if out.udp.len() >= UDP_QUEUE_MAX {
            counters.drop_queue_full += 1;
            return;
        }
        counters.udp_packets_out += 1;
        counters.udp_bytes_out += datagram.len() as u64;
        out.udp.push_back((addr, datagram.to_vec()));
        return;
    }
    out.queue_derp(counters, peer.derp_region, &peer.key, datagram);
}

impl Outbox {
    /// Appends a SendPacket frame for `key` to `region`'s write buffer.
    fn queue_derp(&mut self, counters: &mut Counters, region: u32, key: &NodeKey, payload: &[u8]) {
        let buf = self.derp.entry(region).or_default();
        let before = buf.len();
        derp::encode_send_packet(buf, key, payload);
        counters.derp_bytes_out += (buf.len() - before) as u64;
    }
}

/// STUN (RFC 5389): two zero bits, then the magic cookie at bytes 4..8. WireGuard messages
/// start with type 1-4 and three zero bytes, so they never match.
fn looks_like_stun(datagram: &[u8]) -> bool {
    datagram.len() >= 20 && datagram[0] & 0xc0 == 0 && datagram[4..8] == [0x21, 0x12, 0xa4, 0x42]
}

/// Learned UDP source addresses kept at most (a flood of pings cannot grow it without bound).
const MAX_UDP_SOURCES: usize = 4096;

impl DataPlane {
    pub fn new(private_key: &[u8], tcp_buffer: usize) -> Result<Self, Error> {
        let key = parse_key(private_key, "private_key")?;
        if tcp_buffer < 4096 {
            return Err(Error::InvalidArgument(format!(
                "tcp_buffer_size {tcp_buffer} is below 4096"
            )));
        }
        Ok(DataPlane {
            peers: Peers::new(key),
            stack: Stack::new(tcp_buffer, 0.0),
            filter: Filter::new(),
            derp_in: HashMap::new(),
            out: Outbox::default(),
            udp_sources: HashMap::new(),
            inbound: VecDeque::new(),
            events: Vec::new(),
            counters: Counters::default(),
            now: 0.0,
            last_timers: f64::NEG_INFINITY,
            scratch: vec![0u8; MAX_PACKET + 256],
            recovery: Recovery::new(),
            resends: Vec::new(),
        })
    }

    pub fn public_key(&self) -> NodeKey {
        self.peers.public_key()
    }

    /// Switches to a new node private key (control rotated it). TCP connections stay; the
    /// WireGuard sessions restart with the new key; DERP connections must be re-made with it.
    pub fn set_private_key(&mut self, private_key: &[u8]) -> Result<(), Error> {
        let key = parse_key(private_key, "private_key")?;
        self.peers.set_private(key);
        Ok(())
    }

    pub fn counters(&self) -> &Counters {
        &self.counters
    }

    pub fn set_self(&mut self, addresses: &[String]) -> Result<(), Error> {
        self.stack.set_addresses(&host_prefixes(addresses)?)?;
        Ok(())
    }

    /// Shared host addresses answered as the node's own (`Stack::set_shared`).
    pub fn set_shared(&mut self, addresses: &[String]) -> Result<(), Error> {
        self.stack.set_shared(&host_prefixes(addresses)?)?;
        Ok(())
    }

    /// Replaces the peer set; a prefix two peers claim routes to the earlier in `peers`.
    pub fn set_peers(&mut self, peers: Vec<(NodeKey, Vec<String>, u32)>) -> Result<(), Error> {
        let ranked = peers
            .into_iter()
            .zip(0u64..)
            .map(|((key, ips, region), rank)| (rank, key, ips, region));
        let specs = parse_specs(ranked)?;
        self.peers.set(specs);
        Ok(())
    }

    /// Adds or updates the peers `(rank, key, AllowedIPs, region)`; every other peer, its
    /// session and its routes stay as they are. A prefix two peers claim routes to the lower
    /// rank. Nothing changes when one of them does not parse.
    pub fn upsert_peers(&mut self, peers: Vec<(u64, NodeKey, Vec<String>, u32)>) -> Result<(), Error> {
        for spec in parse_specs(peers.into_iter())? {
            self.peers.upsert(spec);
        }
        Ok(())
    }

    /// Removes the peers with these keys (unknown ones are ignored).
    pub fn remove_peers(&mut self, keys: &[NodeKey]) {
        self.peers.remove(keys);
    }

    pub fn set_filter(&mut self, rules: &[RuleSpec]) -> Result<(), Error> {
        let compiled = rules
            .iter()
            .enumerate()
            .map(|(i, r)| Rule::compile(r).map_err(|e| Error::InvalidArgument(format!("filter rule {i}: {e}"))))
            .collect::<Result<Vec<_>, _>>()?;
        self.filter.set_rules(compiled);
        Ok(())
    }

    /// Parses DERP bytes from `region`'s relay connection and handles every whole frame.
    pub fn derp_feed(&mut self, region: u32, chunk: &[u8]) -> Result<(), Error> {
        self.counters.derp_bytes_in += chunk.len() as u64;
        let mut decoder = self.derp_in.remove(&region).unwrap_or_default();
        decoder.push(chunk);
        let result = loop {
            match decoder.next_frame() {
                Ok(Some(frame)) => self.handle_frame(region, frame),
                Ok(None) => break Ok(()),
                Err(e) => {
                    decoder.reset();
                    break Err(Error::DerpCorrupt {
                        region,
                        reason: e.to_string(),
                    });
                }
            }
        };
        self.derp_in.insert(region, decoder);
        result
    }

    /// Forgets buffered partial frames of a region (call when its connection is replaced).
    pub fn derp_reset(&mut self, region: u32) {
        self.derp_in.remove(&region);
    }

    fn handle_frame(&mut self, region: u32, frame: Frame<'_>) {
        self.counters.derp_frames_in += 1;
        match frame {
            Frame::RecvPacket { src, packet } if packet.starts_with(DISCO_MAGIC) => {
                self.counters.disco_in += 1;
                self.events.push(Event::DiscoDerp {
                    region,
                    key: src,
                    payload: packet.to_vec(),
                });
            }
            Frame::RecvPacket { src, packet } => self.handle_datagram(src, packet),
            Frame::Ping(data) => derp::encode_pong(self.out.derp.entry(region).or_default(), &data),
            Frame::KeepAlive | Frame::Pong(_) => {}
            Frame::PeerGone { key, reason } => self.events.push(Event::DerpPeerGone { region, key, reason }),
            Frame::PeerPresent { key } => self.events.push(Event::DerpPeerPresent { region, key }),
            Frame::Health(msg) => self.events.push(Event::DerpHealth {
                region,
                message: String::from_utf8_lossy(msg).into_owned(),
            }),
            Frame::Restarting {
                reconnect_in_ms,
                try_for_ms,
            } => self.events.push(Event::DerpRestarting {
                region,
                reconnect_in_ms,
                try_for_ms,
            }),
            Frame::Other { frame_type, payload } => self.events.push(Event::DerpFrame {
                region,
                frame_type,
                payload: payload.to_vec(),
            }),
        }
    }

    /// A datagram from the UDP socket: disco goes to Python; WireGuard is matched to its peer
    /// by the source address disco learned, else by the receiver index it carries.
    pub fn udp_feed(&mut self, src: SocketAddr, datagram: &[u8]) {
        if datagram.starts_with(DISCO_MAGIC) {
            self.counters.disco_in += 1;
            self.events.push(Event::DiscoUdp {
                src,
                payload: datagram.to_vec(),
            });
            return;
        }
        if looks_like_stun(datagram) {
            self.events.push(Event::StunUdp {
                src,
                payload: datagram.to_vec(),
            });
            return;
        }
        self.counters.udp_packets_in += 1;
        self.counters.udp_bytes_in += datagram.len() as u64;
        let key = self
            .udp_sources
            .get(&src)
            .copied()
            .or_else(|| self.peers.by_receiver_index(datagram));
        match key {
            Some(key) => self.handle_datagram(key, datagram),
            None => self.counters.drop_unknown_peer += 1,
        }
    }

    /// Sends WireGuard for `key` over UDP to `addr` (a path disco confirmed), or through DERP
    /// again with None. Returns false for an unknown peer.
    pub fn set_peer_direct(&mut self, key: &NodeKey, addr: Option<SocketAddr>) -> bool {
        match self.peers.get_mut(key) {
            Some(peer) => {
                peer.direct = addr;
                true
            }
            None => false,
        }
    }

    /// Peers an IP packet was sent to at or after `since` (the ones worth a direct path).
    pub fn active_peers(&self, since: f64) -> Vec<NodeKey> {
        self.peers
            .iter()
            .filter(|p| p.last_sent >= since)
            .map(|p| p.key)
            .collect()
    }

    /// Datagrams waiting for the UDP socket, oldest first (the caller sends and pops them).
    pub fn udp_queue(&mut self) -> &mut VecDeque<(SocketAddr, Vec<u8>)> {
        &mut self.out.udp
    }

    /// Remembers that UDP datagrams from `addr` come from the peer `key` (disco heard it there).
    pub fn note_udp_source(&mut self, addr: SocketAddr, key: NodeKey) {
        if self.udp_sources.len() >= MAX_UDP_SOURCES && !self.udp_sources.contains_key(&addr) {
            self.udp_sources.clear();
        }
        self.udp_sources.insert(addr, key);
    }

    /// Queues raw bytes (a sealed disco message) for `key` through DERP `region`.
    pub fn derp_send(&mut self, region: u32, key: &NodeKey, payload: &[u8]) {
        self.out.queue_derp(&mut self.counters, region, key, payload);
    }

    /// A WireGuard datagram from the peer `src`: decrypt it with that peer's session.
    fn handle_datagram(&mut self, src: [u8; KEY_LEN], datagram: &[u8]) {
        let Self {
            peers,
            scratch,
            out: outbox,
            counters,
            inbound,
            filter,
            stack,
            now,
            ..
        } = self;
        let Some(peer) = peers.get_mut(&src) else {
            counters.drop_unknown_peer += 1;
            return;
        };
        let mut input = datagram;
        loop {
            match peer.tunn.decapsulate(None, input, scratch) {
                TunnResult::Done => break,
                TunnResult::Err(_) => {
                    counters.drop_wireguard += 1;
                    break;
                }
                TunnResult::WriteToNetwork(out) => {
                    counters.wg_handshake_packets += 1;
                    queue_to_peer(outbox, counters, peer, out);
                    // Flush packets queued while the handshake was in flight.
                    input = &[];
                    continue;
                }
                TunnResult::WriteToTunnelV4(pkt, _) | TunnResult::WriteToTunnelV6(pkt, _) => {
                    deliver(peer, pkt, counters, filter, stack, inbound, *now);
                    break;
                }
            }
        }
    }

    /// Encrypts one outbound IP packet and queues it for the owning peer's DERP region; TCP data
    /// is also kept for fast loss recovery.
    fn egress(&mut self, pkt: &[u8]) {
        let Some(info) = parse_packet(pkt) else {
            self.counters.drop_malformed += 1;
            return;
        };
        if pkt.len() > MAX_PACKET {
            self.counters.drop_malformed += 1;
            return;
        }
        let Some(key) = self.peers.route(info.dst) else {
            self.counters.drop_no_route += 1;
            return;
        };
        self.filter.note_outbound(&info, self.now);
        if info.proto == PROTO_TCP {
            self.recovery.on_outbound(pkt, &info, self.now);
        }
        self.seal(&key, pkt);
    }

    /// Encrypts `pkt` with the session of the peer `key` and queues it for its DERP region.
    fn seal(&mut self, key: &NodeKey, pkt: &[u8]) {
        let Self {
            peers,
            scratch,
            out: outbox,
            counters,
            now,
            ..
        } = self;
        let Some(peer) = peers.get_mut(key) else { return };
        peer.last_sent = *now;
        counters.packets_out += 1;
        counters.bytes_out += pkt.len() as u64;
        match peer.tunn.encapsulate(pkt, scratch) {
            TunnResult::WriteToNetwork(out) => {
                queue_to_peer(outbox, counters, peer, out);
            }
            TunnResult::Err(_) => counters.drop_wireguard += 1,
            // Queued until the handshake completes.
            _ => {}
        }
    }

    /// Sends the copies fast loss recovery released (routed again: the peer set may have changed).
    fn send_resends(&mut self) {
        for pkt in std::mem::take(&mut self.resends) {
            if let Some(key) = parse_packet(&pkt).and_then(|info| self.peers.route(info.dst)) {
                self.seal(&key, &pkt);
            }
        }
        self.counters.tcp_fast_resends = self.recovery.fast_resends;
        self.counters.tcp_probe_resends = self.recovery.probe_resends;
    }

    /// Sends raw IP packets into the tunnel (routed like stack traffic).
    pub fn send_ip_packets(&mut self, packets: &[&[u8]]) {
        for p in packets {
            self.egress(p);
        }
    }

    fn run_wg_timers(&mut self) {
        let Self {
            peers,
            scratch,
            out: outbox,
            counters,
            ..
        } = self;
        for peer in peers.iter_mut() {
            if let TunnResult::WriteToNetwork(out) = peer.tunn.update_timers(scratch) {
                counters.wg_handshake_packets += 1;
                queue_to_peer(outbox, counters, peer, out);
            }
        }
    }

    pub fn poll(&mut self, now: f64) -> PollOutput {
        self.now = now;
        self.stack.set_now(now);
        if now - self.last_timers >= WG_TIMER_INTERVAL || now < self.last_timers {
            self.last_timers = now;
            self.run_wg_timers();
        }
        while let Some((pkt, info)) = self.inbound.pop_front() {
            if info.is_tcp_syn() && self.stack.prepare_syn(&info) == SynDisposition::BacklogFull {
                self.counters.drop_backlog_full += 1;
                continue;
            }
            if info.proto == PROTO_TCP {
                self.recovery.on_inbound(&pkt, &info, now, &mut self.resends);
            }
            self.stack.ingress(pkt);
        }
        self.recovery.poll(now, &mut self.resends);
        self.send_resends();
        self.stack.poll(now);
        while let Some(pkt) = self.stack.device.tx.pop_front() {
            self.egress(&pkt);
        }
        let mut events = std::mem::take(&mut self.events);
        events.extend(self.stack.take_events().into_iter().map(Event::Tcp));
        let wg_deadline = (!self.peers.is_empty()).then_some(self.last_timers + WG_TIMER_INTERVAL);
        let next_deadline = [
            self.stack.next_deadline(now),
            wg_deadline,
            self.recovery.next_deadline(),
        ]
        .into_iter()
        .flatten()
        .reduce(f64::min);
        let derp_writes = std::mem::take(&mut self.out.derp)
            .into_iter()
            .filter(|(_, b)| !b.is_empty())
            .collect();
        PollOutput {
            derp_writes,
            udp_pending: self.out.udp.len(),
            events,
            next_deadline,
        }
    }

    pub fn tcp_connect(&mut self, dst: SocketAddr, timeout: f64) -> u64 {
        let failure = match self.peers.route(dst.ip()) {
            Some(_) => None,
            None => Some(format!("no route to {}: no peer's AllowedIPs cover it", dst.ip())),
        };
        self.stack.connect(dst, timeout, failure)
    }

    pub fn stack(&mut self) -> &mut Stack {
        &mut self.stack
    }
}

/// Peer specs from `(rank, key, AllowedIPs, region)`; the first prefix that does not parse fails them all.
fn parse_specs(peers: impl Iterator<Item = (u64, NodeKey, Vec<String>, u32)>) -> Result<Vec<PeerSpec>, Error> {
    peers
        .map(|(rank, key, ips, derp_region)| -> Result<PeerSpec, Error> {
            let allowed_ips = ips
                .iter()
                .map(|s| s.parse::<Prefix>().map_err(Error::InvalidArgument))
                .collect::<Result<Vec<_>, _>>()?;
            Ok(PeerSpec {
                key,
                allowed_ips,
                derp_region,
                rank,
            })
        })
        .collect()
}

/// Checks a decrypted packet and queues it for the stack.
fn deliver(
    peer: &Peer,
    pkt: &[u8],
    counters: &mut Counters,
    filter: &mut Filter,
    stack: &Stack,
    inbound: &mut VecDeque<(Vec<u8>, PacketInfo)>,
    now: f64,
) {
    if pkt.is_empty() {
        return; // keepalive
    }
    let Some(info) = parse_packet(pkt) else {
        counters.drop_malformed += 1;
        return;
    };
    if !peer.allows_source(info.src) {
        counters.drop_spoofed_source += 1;
        return;
    }
    if info.proto == PROTO_TSMP {
        counters.drop_tsmp += 1;
        return;
    }
    match filter.check_inbound(&info, |ip: IpAddr| stack.is_local(ip), now) {
        Verdict::Accept => {}
        Verdict::Tsmp => {
            counters.drop_tsmp += 1;
            return;
        }
        Verdict::NotForUs => {
            counters.drop_not_for_us += 1;
            return;
        }
        Verdict::Denied => {
            counters.drop_filtered += 1;
            return;
        }
    }
    if inbound.len() >= INBOUND_QUEUE_MAX {
        counters.drop_queue_full += 1;
        return;
    }
    counters.packets_in += 1;
    counters.bytes_in += pkt.len() as u64;
    inbound.push_back((pkt.to_vec(), info));
}

/// Parses addresses as host prefixes, whatever length is written (`100.64.0.5/32`, `100.64.0.5`).
fn host_prefixes(addresses: &[String]) -> Result<Vec<Prefix>, Error> {
    addresses
        .iter()
        .map(|a| {
            a.parse::<Prefix>()
                .map(|p| Prefix::host(p.addr()))
                .map_err(Error::InvalidArgument)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::filter::tests::ipv4;
    use crate::filter::{PROTO_TCP, PROTO_UDP};

    const A_IP: &str = "100.64.0.1";
    const B_IP: &str = "100.64.0.2";

    fn allow_all() -> Vec<RuleSpec> {
        vec![(vec!["*".into()], vec![("*".into(), 0, 65535)], vec![])]
    }

    /// Two planes wired back to back through one in-memory "relay".
    fn pair() -> (DataPlane, DataPlane) {
        let mut a = DataPlane::new(&[1u8; 32], 256 * 1024).unwrap();
        let mut b = DataPlane::new(&[2u8; 32], 256 * 1024).unwrap();
        a.set_self(&[format!("{A_IP}/32"), "fd7a:115c:a1e0::1/128".into()])
            .unwrap();
        b.set_self(&[format!("{B_IP}/32"), "fd7a:115c:a1e0::2/128".into()])
            .unwrap();
        a.set_peers(vec![(
            b.public_key(),
            vec![format!("{B_IP}/32"), "fd7a:115c:a1e0::2/128".into()],
            1,
        )])
        .unwrap();
        b.set_peers(vec![(
            a.public_key(),
            vec![format!("{A_IP}/32"), "fd7a:115c:a1e0::1/128".into()],
            1,
        )])
        .unwrap();
        a.set_filter(&allow_all()).unwrap();
        b.set_filter(&allow_all()).unwrap();
        (a, b)
    }

    /// The relay turns SendPacket(dst) into RecvPacket(src).
    fn relay(from: &DataPlane, writes: Vec<(u32, Vec<u8>)>, to: &mut DataPlane) {
        let mut dec = Decoder::new();
        for (_, buf) in writes {
            dec.push(&buf);
            let mut out = Vec::new();
            while let Some(Frame::Other {
                frame_type: derp::FRAME_SEND_PACKET,
                payload,
            }) = dec.next_frame().unwrap()
            {
                derp::encode_frame(
                    &mut out,
                    derp::FRAME_RECV_PACKET,
                    &[&from.public_key(), &payload[KEY_LEN..]],
                );
            }
            to.derp_feed(1, &out).unwrap();
        }
    }

    /// Like `relay`, but drops the data-carrying frames (larger than 300 bytes: more than a
    /// handshake or an ACK with SACK blocks) whose 1-based count is in `lost`.
    fn relay_losing(
        from: &DataPlane,
        writes: Vec<(u32, Vec<u8>)>,
        to: &mut DataPlane,
        lost: &std::ops::RangeInclusive<usize>,
        seen: &mut usize,
    ) {
        let mut dec = Decoder::new();
        let mut out = Vec::new();
        for (_, buf) in writes {
            dec.push(&buf);
            while let Some(Frame::Other { payload, .. }) = dec.next_frame().unwrap() {
                if payload.len() > 300 {
                    *seen += 1;
                    if lost.contains(seen) {
                        continue;
                    }
                }
                derp::encode_frame(
                    &mut out,
                    derp::FRAME_RECV_PACKET,
                    &[&from.public_key(), &payload[KEY_LEN..]],
                );
            }
        }
        to.derp_feed(1, &out).unwrap();
    }

    /// Sends `size` bytes from A to B while the relay drops the data frames numbered `lost`;
    /// returns the virtual time it took, A's resend count and the data frames relayed.
    fn transfer_with_losses(size: usize, lost: std::ops::RangeInclusive<usize>) -> (f64, u64, usize) {
        let (mut a, mut b) = pair();
        b.stack().listen(80).unwrap();
        let ha = a.tcp_connect(format!("{B_IP}:80").parse().unwrap(), 30.0);
        let payload: Vec<u8> = (0..size).map(|i| (i % 253) as u8).collect();
        let (mut sent, mut got, mut hb, mut seen) = (0, Vec::new(), None, 0);
        let mut now = 0.0;
        while got.len() < size && now < 30.0 {
            now += 0.001;
            let out = a.poll(now);
            relay_losing(&a, out.derp_writes, &mut b, &lost, &mut seen);
            let out = b.poll(now);
            relay(&b, out.derp_writes, &mut a);
            for e in out.events {
                if let Event::Tcp(TcpEvent::Accepted { handle, .. }) = e {
                    hb = Some(handle);
                }
            }
            if sent < size {
                sent += a.stack().send(ha, &payload[sent..]).unwrap_or(0);
            }
            if let Some(hb) = hb {
                got.extend(b.stack().recv(hb, 1 << 20).unwrap());
            }
        }
        assert!(
            got == payload,
            "B got {} of {size} bytes (or wrong bytes) by t={now:.3}",
            got.len()
        );
        let c = a.counters();
        (now, c.tcp_fast_resends + c.tcp_probe_resends, seen)
    }

    fn step(a: &mut DataPlane, b: &mut DataPlane, now: f64, ev: &mut Vec<(char, Event)>) {
        let out = a.poll(now);
        ev.extend(out.events.into_iter().map(|e| ('a', e)));
        relay(a, out.derp_writes, b);
        let out = b.poll(now);
        ev.extend(out.events.into_iter().map(|e| ('b', e)));
        relay(b, out.derp_writes, a);
    }

    #[test]
    fn tcp_back_to_back_with_half_close() {
        let (mut a, mut b) = pair();
        let listener = b.stack().listen(80).unwrap();
        let ha = a.tcp_connect(format!("{B_IP}:80").parse().unwrap(), 30.0);
        let mut ev = Vec::new();
        let mut hb = None;
        let mut got_b = Vec::new();
        let mut got_a = Vec::new();
        let payload: Vec<u8> = (0..3_000_000u32).map(|i| (i % 251) as u8).collect();
        let mut sent = 0;
        let mut shut = false;
        let mut replied = false;
        let mut a_eof = false;
        for i in 0..20_000 {
            step(&mut a, &mut b, f64::from(i) * 0.001, &mut ev);
            for (side, e) in ev.drain(..) {
                match (side, e) {
                    (
                        'b',
                        Event::Tcp(TcpEvent::Accepted {
                            listener: l,
                            handle,
                            remote,
                        }),
                    ) => {
                        assert_eq!(l, listener);
                        assert_eq!(remote.ip().to_string(), A_IP);
                        hb = Some(handle);
                    }
                    ('a', Event::Tcp(TcpEvent::Readable(h))) if h == ha => {
                        got_a.extend(a.stack().recv(ha, 1 << 20).unwrap());
                    }
                    ('a', Event::Tcp(TcpEvent::PeerClosed(h))) if h == ha => a_eof = true,
                    (_, Event::Tcp(TcpEvent::DialFailed { reason, .. })) => panic!("dial failed: {reason}"),
                    (_, Event::Tcp(TcpEvent::Reset(_))) => panic!("reset"),
                    _ => {}
                }
            }
            if sent < payload.len() {
                sent += a.stack().send(ha, &payload[sent..]).unwrap();
            } else if !shut {
                a.stack().shutdown_write(ha).unwrap();
                shut = true;
            }
            if let Some(hb) = hb {
                got_b.extend(b.stack().recv(hb, 1 << 20).unwrap());
                if got_b.len() == payload.len() && !replied {
                    assert_eq!(b.stack().send(hb, b"reply after EOF").unwrap(), 15);
                    b.stack().shutdown_write(hb).unwrap();
                    replied = true;
                }
            }
            if a_eof {
                break;
            }
        }
        assert!(got_b == payload, "B got {} of {} bytes", got_b.len(), payload.len());
        assert_eq!(got_a, b"reply after EOF");
        assert!(a_eof);
        assert_eq!(b.counters().drop_filtered, 0);
    }

    /// B answers on a shared address (an HA route A sends to B) as on its own; what B dials
    /// keeps B's own address as its source, and a second shared IPv4 address is refused.
    #[test]
    fn a_shared_address_is_answered_and_never_the_source_of_a_dial() {
        const SHARED: &str = "198.18.5.10";
        let (mut a, mut b) = pair();
        b.set_shared(&[SHARED.into()]).unwrap();
        a.set_peers(vec![(
            b.public_key(),
            vec![format!("{B_IP}/32"), format!("{SHARED}/32")],
            1,
        )])
        .unwrap();
        assert!(b.set_shared(&[SHARED.into(), "198.18.5.11".into()]).is_err());
        b.stack().listen(80).unwrap();
        a.stack().listen(81).unwrap();
        let ha = a.tcp_connect(format!("{SHARED}:80").parse().unwrap(), 30.0);
        let hb = b.tcp_connect(format!("{A_IP}:81").parse().unwrap(), 30.0);
        let (mut b_accepted, mut a_accepted) = (None, None);
        let mut ev = Vec::new();
        for i in 1..5_000 {
            step(&mut a, &mut b, f64::from(i) * 0.001, &mut ev);
            for (side, e) in ev.drain(..) {
                match (side, e) {
                    ('b', Event::Tcp(TcpEvent::Accepted { handle, .. })) => b_accepted = Some(handle),
                    ('a', Event::Tcp(TcpEvent::Accepted { handle, remote, .. })) => a_accepted = Some((handle, remote)),
                    (_, Event::Tcp(TcpEvent::DialFailed { reason, .. })) => panic!("dial failed: {reason}"),
                    _ => {}
                }
            }
            if b_accepted.is_some() && a_accepted.is_some() {
                break;
            }
        }
        let b_handle = b_accepted.expect("B never accepted on its shared address");
        let (local, _) = b.stack().endpoints(b_handle).unwrap();
        assert_eq!(local.unwrap().ip().to_string(), SHARED);
        let (_, remote) = a_accepted.expect("A never accepted B's dial");
        assert_eq!(remote.ip().to_string(), B_IP, "B dialled from its shared address");
        let _ = (ha, hb);
    }

    /// Connects A to B and steps until B accepted; returns (A's handle, B's handle, now).
    fn connected(a: &mut DataPlane, b: &mut DataPlane) -> (u64, u64, f64) {
        b.stack().listen(80).unwrap();
        let ha = a.tcp_connect(format!("{B_IP}:80").parse().unwrap(), 30.0);
        let mut ev = Vec::new();
        for i in 1..5_000 {
            let now = f64::from(i) * 0.001;
            step(a, b, now, &mut ev);
            for (side, e) in ev.drain(..) {
                if let ('b', Event::Tcp(TcpEvent::Accepted { handle, .. })) = (side, e) {
                    return (ha, handle, now);
                }
            }
        }
        panic!("B never accepted");
    }

    /// The egress half-close: A (the agent) half-closes, B answers with data and FIN, so A's
    /// socket enters TIME-WAIT with the reply unread; A reads only 15 s later, after smoltcp's
    /// 10 s TIME-WAIT reset the socket. A must still get every byte, then the EOF.
    #[test]
    fn a_reply_unread_through_time_wait_is_delivered_to_a_slow_reader() {
        let (mut a, mut b) = pair();
        let (ha, hb, mut now) = connected(&mut a, &mut b);
        a.stack().shutdown_write(ha).unwrap();
        let reply: Vec<u8> = (0..200_000u32).map(|i| (i % 249) as u8).collect();
        let (mut sent, mut ev, mut a_eof) = (0, Vec::new(), false);
        let (mut got, mut time_wait_seen) = (Vec::new(), false);
        while now < 40.0 && !a_eof {
            now += if now < 2.0 { 0.001 } else { 0.05 };
            step(&mut a, &mut b, now, &mut ev);
            for (side, e) in ev.drain(..) {
                match (side, e) {
                    ('a', Event::Tcp(TcpEvent::PeerClosed(h))) if h == ha => a_eof = true,
                    (_, Event::Tcp(TcpEvent::Reset(_))) => panic!("reset"),
                    _ => {}
                }
            }
            if sent < reply.len() {
                sent += b.stack().send(hb, &reply[sent..]).unwrap();
                if sent == reply.len() {
                    b.stack().shutdown_write(hb).unwrap();
                }
            }
            time_wait_seen |= a.stack().state_of(ha) == Some(smoltcp::socket::tcp::State::TimeWait);
            if now >= 15.0 && !a_eof {
                got.extend(a.stack().recv(ha, 1 << 20).unwrap());
            }
        }
        assert!(
            time_wait_seen,
            "A's socket never entered TIME-WAIT: the test does not test the case"
        );
        assert!(a_eof, "no EOF by t={now:.1}");
        assert!(
            got == reply,
            "A read {} of {} bytes before a clean EOF",
            got.len(),
            reply.len()
        );
    }

    /// Steps until A's dial `ha` is connected and B accepted it; the virtual time it took.
    fn until_accepted(a: &mut DataPlane, b: &mut DataPlane, ha: u64, mut now: f64, limit: f64) -> (Option<u64>, f64) {
        let started = now;
        let (mut ev, mut accepted, mut connected) = (Vec::new(), None, false);
        while now - started < limit && !(connected && accepted.is_some()) {
            now += 0.001;
            step(a, b, now, &mut ev);
            for (side, e) in ev.drain(..) {
                match (side, e) {
                    ('b', Event::Tcp(TcpEvent::Accepted { handle, .. })) => accepted = Some(handle),
                    ('a', Event::Tcp(TcpEvent::Connected(h))) if h == ha => connected = true,
                    (_, Event::Tcp(TcpEvent::DialFailed { reason, .. })) => panic!("dial failed: {reason}"),
                    _ => {}
                }
            }
        }
        (accepted.filter(|_| connected), now - started)
    }

    /// Steps `seconds` of virtual time, 1 ms at a time; returns the events.
    fn run(a: &mut DataPlane, b: &mut DataPlane, now: &mut f64, seconds: f64) -> Vec<(char, Event)> {
        let (mut ev, end) = (Vec::new(), *now + seconds);
        while *now < end {
            *now += 0.001;
            step(a, b, *now, &mut ev);
        }
        ev
    }

    /// B (the agent, in front of a backend that closes first) closes a connection first, so its
    /// socket stays in TIME-WAIT for 10 s; A (a tailscaled laptop's netstack picks source ports
    /// at random) dials again from the same port. smoltcp gave that SYN to the TIME-WAIT socket,
    /// which drops a segment without an ACK, so the dial and its retransmissions were lost until
    /// TIME-WAIT ran out: requests hung past their deadline about once every few hundred. The
    /// new connection must be accepted at once.
    #[test]
    fn a_dial_reusing_the_port_of_a_connection_b_closed_first_is_accepted_at_once() {
        let (mut a, mut b) = pair();
        let (ha, hb, mut now) = connected(&mut a, &mut b);
        let port = a.stack().endpoints(ha).unwrap().0.unwrap().port();
        assert_eq!(b.stack().send(hb, b"hello").unwrap(), 5);
        b.stack().close(hb);
        run(&mut a, &mut b, &mut now, 0.2);
        assert_eq!(a.stack().recv(ha, 100).unwrap(), b"hello");
        assert_eq!(a.stack().state_of(ha), Some(smoltcp::socket::tcp::State::CloseWait));
        a.stack().close(ha);
        run(&mut a, &mut b, &mut now, 0.5);

        a.stack().set_next_port(port);
        let again = a.tcp_connect(format!("{B_IP}:80").parse().unwrap(), 30.0);
        assert_eq!(
            a.stack().endpoints(again).unwrap().0.unwrap().port(),
            port,
            "not the same port"
        );
        let (accepted, took) = until_accepted(&mut a, &mut b, again, now, 12.0);
        assert!(accepted.is_some(), "the dial from the reused port was never accepted");
        assert!(
            took < 0.1,
            "the dial from the reused port took {took:.3} s (TIME-WAIT lasts 10 s)"
        );
    }

    /// The same with B's side of the old connection still open in the application: B half-closed,
    /// A answered with data and FIN, and B has not read it (its socket in TIME-WAIT, the bytes
    /// unread). The new dial is accepted at once and B still reads every byte, then the EOF.
    #[test]
    fn a_reused_port_takes_the_time_wait_socket_of_an_unread_connection_and_keeps_its_bytes() {
        let (mut a, mut b) = pair();
        let (ha, hb, mut now) = connected(&mut a, &mut b);
        let port = a.stack().endpoints(ha).unwrap().0.unwrap().port();
        b.stack().shutdown_write(hb).unwrap();
        run(&mut a, &mut b, &mut now, 0.2);
        assert_eq!(a.stack().send(ha, b"unread reply").unwrap(), 12);
        a.stack().close(ha);
        run(&mut a, &mut b, &mut now, 0.5);
        assert_eq!(b.stack().state_of(hb), Some(smoltcp::socket::tcp::State::TimeWait));

        a.stack().set_next_port(port);
        let again = a.tcp_connect(format!("{B_IP}:80").parse().unwrap(), 30.0);
        let (accepted, took) = until_accepted(&mut a, &mut b, again, now, 12.0);
        assert!(
            accepted.is_some() && took < 0.1,
            "the dial from the reused port took {took:.3} s"
        );
        assert_eq!(b.stack().recv(hb, 100).unwrap(), b"unread reply");
        let events = run(&mut a, &mut b, &mut now, 0.1);
        assert!(
            events
                .iter()
                .any(|(side, e)| *side == 'b' && matches!(e, Event::Tcp(TcpEvent::PeerClosed(h)) if *h == hb)),
            "no EOF after the held bytes"
        );
    }

    /// B reads 2 kB a second; A queues 600 kB and closes (releases its handle) once the last
    /// byte is queued, with about 500 kB (its send buffer and B's receive buffer) still to go,
    /// so 60 s after the close A still holds unsent bytes: the stack used to drop such a
    /// connection then. Every byte must arrive, then the EOF.
    #[test]
    fn a_closed_connection_finishes_sending_to_a_peer_slower_than_the_linger() {
        let (mut a, mut b) = pair();
        let (ha, hb, mut now) = connected(&mut a, &mut b);
        let payload: Vec<u8> = (0..600_000u32).map(|i| (i % 247) as u8).collect();
        let (mut sent, mut ev, mut got) = (0, Vec::new(), Vec::new());
        let (mut closed_at, mut b_eof, mut next_read) = (None, false, now);
        while now < 500.0 && !b_eof {
            now += 0.02;
            step(&mut a, &mut b, now, &mut ev);
            for (side, e) in ev.drain(..) {
                match (side, e) {
                    ('b', Event::Tcp(TcpEvent::PeerClosed(h))) if h == hb => b_eof = true,
                    (_, Event::Tcp(TcpEvent::Reset(h))) => {
                        panic!(
                            "connection {h} reset at t={now:.1} after {} of {} bytes",
                            got.len(),
                            payload.len()
                        )
                    }
                    _ => {}
                }
            }
            if closed_at.is_none() {
                sent += a.stack().send(ha, &payload[sent..]).unwrap();
                if sent == payload.len() {
                    a.stack().shutdown_write(ha).unwrap();
                    a.stack().close(ha);
                    closed_at = Some(now);
                }
            }
            if now >= next_read {
                got.extend(b.stack().recv(hb, 2_000).unwrap());
                next_read = now + 1.0;
            }
        }
        let closed_at = closed_at.expect("A never queued the whole payload");
        assert!(
            now - closed_at > 60.0,
            "the transfer took {:.1} s after the close: not slower than the linger",
            now - closed_at
        );
        assert!(b_eof, "no EOF by t={now:.1}");
        assert!(got == payload, "B got {} of {} bytes", got.len(), payload.len());
    }

    /// The last two segments of a transfer are lost: no duplicate ACK follows, so the stack
    /// alone would wait out its one-second retransmission timeout; the tail-loss probe and the
    /// partial ACK after it repair both within tens of milliseconds.
    #[test]
    fn lost_tail_segments_are_repaired_without_the_stack_timeout() {
        let size = 8 * 1240;
        let (_, _, frames) = transfer_with_losses(size, 0..=0);
        let (took, resends, _) = transfer_with_losses(size, frames - 1..=frames);
        assert!(resends >= 2, "resent {resends}");
        assert!(took < 0.2, "took {took:.3} s of virtual time");
    }

    /// A run of five data frames lost mid-stream (what a full DERP queue dropping its oldest
    /// packets does): the holes are resent within round trips; the stack alone needs its
    /// one-second timeout here, since every ACK changes the window and so none counts as a
    /// duplicate for smoltcp.
    #[test]
    fn a_run_of_lost_segments_is_repaired_within_round_trips() {
        let (took, resends, _) = transfer_with_losses(300_000, 20..=24);
        assert!(resends >= 5, "resent {resends}");
        assert!(took < 0.3, "took {took:.3} s of virtual time");
    }

    #[test]
    fn connections_on_an_address_the_node_lost_are_reset() {
        let (mut a, mut b) = pair();
        b.stack().listen(80).unwrap();
        let ha = a.tcp_connect(format!("{B_IP}:80").parse().unwrap(), 30.0);
        let mut ev = Vec::new();
        let mut now = 0.0;
        while !ev.iter().any(|(_, e)| *e == Event::Tcp(TcpEvent::Connected(ha))) {
            now += 0.001;
            step(&mut a, &mut b, now, &mut ev);
            assert!(now < 1.0, "no connection");
        }
        a.set_self(&["100.64.0.9/32".into()]).unwrap();
        ev.clear();
        step(&mut a, &mut b, now + 0.001, &mut ev);
        assert!(ev.contains(&('a', Event::Tcp(TcpEvent::Reset(ha)))), "{ev:?}");
    }

    /// Moves queued UDP datagrams from `from` (at address `src`) into `to`.
    fn udp_carry(from: &mut DataPlane, src: SocketAddr, to: &mut DataPlane) {
        for (_, datagram) in from.udp_queue().drain(..).collect::<Vec<_>>() {
            to.udp_feed(src, &datagram);
        }
    }

    #[test]
    fn tcp_over_a_direct_udp_path() {
        let (mut a, mut b) = pair();
        let (a_addr, b_addr): (SocketAddr, SocketAddr) =
            ("192.0.2.1:41641".parse().unwrap(), "192.0.2.2:41641".parse().unwrap());
        assert!(a.set_peer_direct(&b.public_key(), Some(b_addr)));
        assert!(b.set_peer_direct(&a.public_key(), Some(a_addr)));
        // B learned A's address from disco; A finds B's packets by their receiver index.
        b.note_udp_source(a_addr, a.public_key());
        b.stack().listen(80).unwrap();
        let ha = a.tcp_connect(format!("{B_IP}:80").parse().unwrap(), 30.0);
        let payload = vec![5u8; 500_000];
        let (mut sent, mut got, mut hb) = (0, 0, None);
        let mut now = 0.0;
        while got < payload.len() && now < 5.0 {
            now += 0.001;
            let out = a.poll(now);
            assert!(out.derp_writes.is_empty(), "nothing goes through DERP");
            udp_carry(&mut a, a_addr, &mut b);
            let out = b.poll(now);
            assert!(out.derp_writes.is_empty(), "nothing goes through DERP");
            for e in out.events {
                if let Event::Tcp(TcpEvent::Accepted { handle, .. }) = e {
                    hb = Some(handle);
                }
            }
            udp_carry(&mut b, b_addr, &mut a);
            if sent < payload.len() {
                sent += a.stack().send(ha, &payload[sent..]).unwrap_or(0);
            }
            if let Some(hb) = hb {
                got += b.stack().recv(hb, 1 << 20).unwrap().len();
            }
        }
        assert_eq!(got, payload.len());
        assert!(a.counters().udp_packets_out > 300 && b.counters().udp_packets_in > 300);
        assert_eq!(a.counters().drop_unknown_peer, 0);
        assert_eq!(a.active_peers(now - 0.5), vec![b.public_key()]);
        assert!(a.active_peers(now + 1.0).is_empty());
        // Back to DERP.
        assert!(a.set_peer_direct(&b.public_key(), None));
        a.stack().send(ha, b"x").unwrap();
        assert!(!a.poll(now + 0.001).derp_writes.is_empty());
        assert!(!a.set_peer_direct(&[9u8; 32], None), "unknown peer");
    }

    #[test]
    fn disco_arrives_as_events_from_derp_and_udp() {
        let (mut a, mut b) = pair();
        let mut disco = DISCO_MAGIC.to_vec();
        disco.extend([1u8; 40]);
        a.derp_send(1, &b.public_key(), &disco);
        let out = a.poll(0.0);
        relay(&a, out.derp_writes, &mut b);
        let src: SocketAddr = "192.0.2.1:1".parse().unwrap();
        b.udp_feed(src, &disco);
        b.udp_feed(src, &[4, 0, 0, 0, 1, 2, 3, 4, 0, 0, 0, 0]);
        let mut stun = vec![1, 1, 0, 0, 0x21, 0x12, 0xa4, 0x42];
        stun.extend([7u8; 12]);
        b.udp_feed(src, &stun);
        let events = b.poll(0.0).events;
        assert!(events.contains(&Event::DiscoDerp {
            region: 1,
            key: a.public_key(),
            payload: disco.clone()
        }));
        assert!(events.contains(&Event::DiscoUdp { src, payload: disco }));
        assert!(events.contains(&Event::StunUdp { src, payload: stun }));
        assert_eq!(b.counters().disco_in, 2);
        assert_eq!(
            b.counters().drop_unknown_peer,
            1,
            "WireGuard from an unknown address and index"
        );
    }

    #[test]
    fn spoofed_tsmp_and_filtered_packets_are_dropped() {
        let (mut a, mut b) = pair();
        b.set_filter(&[]).unwrap();
        let mut ev = Vec::new();
        let spoofed = ipv4(PROTO_UDP, [100, 64, 0, 9], [100, 64, 0, 2], 1, 2, 0);
        let tsmp = ipv4(PROTO_TSMP, [100, 64, 0, 1], [100, 64, 0, 2], 0, 0, 0);
        let syn = ipv4(PROTO_TCP, [100, 64, 0, 1], [100, 64, 0, 2], 1234, 80, 0x02);
        a.send_ip_packets(&[&spoofed, &tsmp, &syn]);
        for i in 0..10 {
            step(&mut a, &mut b, f64::from(i) * 0.01, &mut ev);
        }
        let c = b.counters();
        assert_eq!((c.drop_spoofed_source, c.drop_tsmp, c.drop_filtered), (1, 1, 1));
        assert_eq!(c.packets_in, 0);
    }

    /// A's view of B changes (a subnet added, then replaced) while a connection is open: no new
    /// handshake, the bytes still arrive; once B is removed, nothing routes to it.
    #[test]
    fn upserting_a_peer_keeps_its_session_and_removing_it_drops_its_routes() {
        let (mut a, mut b) = pair();
        let (ha, hb, mut now) = connected(&mut a, &mut b);
        let handshakes = a.counters().wg_handshake_packets + b.counters().wg_handshake_packets;
        let other = DataPlane::new(&[3u8; 32], 256 * 1024).unwrap().public_key();
        let b_ips = |extra: &str| vec![format!("{B_IP}/32"), "fd7a:115c:a1e0::2/128".into(), extra.to_string()];
        a.upsert_peers(vec![
            (2, b.public_key(), b_ips("10.9.0.0/16"), 1),
            (3, other, vec!["100.64.0.3/32".into()], 1),
        ])
        .unwrap();
        a.upsert_peers(vec![(2, b.public_key(), b_ips("10.8.0.0/16"), 1)])
            .unwrap();
        assert!(a.peers.route("10.9.1.1".parse().unwrap()).is_none());
        assert_eq!(a.peers.route("10.8.1.1".parse().unwrap()), Some(b.public_key()));
        assert!(a
            .upsert_peers(vec![(2, b.public_key(), vec!["nonsense".into()], 1)])
            .is_err());
        assert_eq!(
            a.peers.route("10.8.1.1".parse().unwrap()),
            Some(b.public_key()),
            "unchanged"
        );
        a.stack().send(ha, b"still here").unwrap();
        let (mut got, mut ev) = (Vec::new(), Vec::new());
        while got != b"still here" {
            now += 0.001;
            assert!(now < 5.0, "the bytes never arrived");
            step(&mut a, &mut b, now, &mut ev);
            got.extend(b.stack().recv(hb, 1 << 20).unwrap());
        }
        assert_eq!(
            a.counters().wg_handshake_packets + b.counters().wg_handshake_packets,
            handshakes
        );

        a.remove_peers(&[b.public_key()]);
        assert_eq!(a.peers.len(), 1);
        assert!(a.peers.route(B_IP.parse().unwrap()).is_none());
        assert_eq!(a.peers.route("100.64.0.3".parse().unwrap()), Some(other));
    }

    #[test]
    fn dial_without_route_fails() {
        let (mut a, _) = pair();
        let h = a.tcp_connect("100.64.0.77:80".parse().unwrap(), 30.0);
        let out = a.poll(0.0);
        assert!(out.events.iter().any(|e| matches!(e,
            Event::Tcp(TcpEvent::DialFailed { handle, reason }) if *handle == h && reason.contains("no route to 100.64.0.77"))));
    }
}
