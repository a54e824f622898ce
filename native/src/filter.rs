//! Inbound packet filter (compiled Tailscale FilterRules) and minimal IP header parsing.
//!
//! Semantics follow tailscale `wgengine/filter` `runIn`: the destination must be one of our
//! addresses; TCP packets other than a bare SYN pass (they belong to existing flows, and
//! smoltcp answers strays with RST); a SYN, a new UDP flow or an ICMP echo request needs a
//! rule whose sources contain the packet's source and whose destinations contain the
//! destination IP and port. UDP replies to flows we opened pass through a flow cache.

use std::collections::HashMap;
use std::net::IpAddr;

use crate::route::Prefix;

pub const PROTO_ICMP: u8 = 1;
pub const PROTO_TCP: u8 = 6;
pub const PROTO_UDP: u8 = 17;
pub const PROTO_ICMPV6: u8 = 58;
/// Tailscale's TSMP (disco-like messages inside the tunnel); always dropped.
pub const PROTO_TSMP: u8 = 99;

const TCP_FIN: u8 = 0x01;
const TCP_SYN: u8 = 0x02;
const TCP_RST: u8 = 0x04;
const TCP_ACK: u8 = 0x10;

/// The parts of an IP packet the data plane looks at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PacketInfo {
    pub src: IpAddr,
    pub dst: IpAddr,
    /// Transport protocol (after IPv6 extension headers we understand).
    pub proto: u8,
    pub src_port: u16,
    pub dst_port: u16,
    pub tcp_flags: u8,
    /// ICMP / ICMPv6 type.
    pub icmp_type: u8,
    /// True for non-first IPv4 fragments (no transport header).
    pub fragment: bool,
    /// Where the transport header and payload are: `pkt[l4_start..l4_end]` (bounded by the IP
    /// header's length field).
    pub l4_start: usize,
    pub l4_end: usize,
}

impl PacketInfo {
    /// A TCP segment opening a connection (SYN without ACK).
    pub fn is_tcp_syn(&self) -> bool {
        self.proto == PROTO_TCP && self.tcp_flags & (TCP_SYN | TCP_ACK | TCP_RST) == TCP_SYN
    }

    pub fn is_tcp_fin_or_rst(&self) -> bool {
        self.proto == PROTO_TCP && self.tcp_flags & (TCP_FIN | TCP_RST) != 0
    }

    fn is_icmp_echo_request(&self) -> bool {
        (self.proto == PROTO_ICMP && self.icmp_type == 8) || (self.proto == PROTO_ICMPV6 && self.icmp_type == 128)
    }
}

fn ports(l4: &[u8]) -> (u16, u16) {
    match l4.get(..4) {
        Some(p) => (u16::from_be_bytes([p[0], p[1]]), u16::from_be_bytes([p[2], p[3]])),
        None => (0, 0),
    }
}

/// Parses the IPv4/IPv6 header and the start of the transport header.
/// Returns `None` for packets too short or of an unknown IP version.
pub fn parse_packet(pkt: &[u8]) -> Option<PacketInfo> {
    let version = pkt.first()? >> 4;
    let (src, dst, mut proto, mut l4, fragment, ip_end) = match version {
        4 => {
            let ihl = usize::from(pkt[0] & 0x0f) * 4;
            if ihl < 20 || pkt.len() < ihl {
                return None;
            }
            let src: [u8; 4] = pkt[12..16].try_into().ok()?;
            let dst: [u8; 4] = pkt[16..20].try_into().ok()?;
            let frag_offset = u16::from_be_bytes([pkt[6], pkt[7]]) & 0x1fff;
            let total = usize::from(u16::from_be_bytes([pkt[2], pkt[3]]));
            (
                IpAddr::from(src),
                IpAddr::from(dst),
                pkt[9],
                &pkt[ihl..],
                frag_offset != 0,
                total.min(pkt.len()),
            )
        }
        6 => {
            if pkt.len() < 40 {
                return None;
            }
            let src: [u8; 16] = pkt[8..24].try_into().ok()?;
            let dst: [u8; 16] = pkt[24..40].try_into().ok()?;
            let payload = usize::from(u16::from_be_bytes([pkt[4], pkt[5]]));
            (
                IpAddr::from(src),
                IpAddr::from(dst),
                pkt[6],
                &pkt[40..],
                false,
                (40 + payload).min(pkt.len()),
            )
        }
        _ => return None,
    };
    let mut fragment = fragment;
    if version == 6 {
        // Skip hop-by-hop, routing, destination options and fragment headers.
        for _ in 0..8 {
            match proto {
                0 | 43 | 60 => {
                    let hdr = l4.get(..2)?;
                    let len = (usize::from(hdr[1]) + 1) * 8;
                    proto = hdr[0];
                    l4 = l4.get(len..)?;
                }
                44 => {
                    let hdr = l4.get(..8)?;
                    let offset = u16::from_be_bytes([hdr[2], hdr[3]]) >> 3;
                    fragment = offset != 0;
                    proto = hdr[0];
                    l4 = &l4[8..];
                }
                _ => break,
            }
        }
    }
    // `l4` is a subslice of `pkt`; its offset is where the transport header starts.
    let l4_start = l4.as_ptr() as usize - pkt.as_ptr() as usize;
    let mut info = PacketInfo {
        src,
        dst,
        proto,
        src_port: 0,
        dst_port: 0,
        tcp_flags: 0,
        icmp_type: 0,
        fragment,
        l4_start,
        l4_end: ip_end.max(l4_start),
    };
    if fragment {
        return Some(info);
    }
    match proto {
        PROTO_TCP => {
            (info.src_port, info.dst_port) = ports(l4);
            info.tcp_flags = l4.get(13).copied().unwrap_or(0);
        }
        PROTO_UDP => (info.src_port, info.dst_port) = ports(l4),
        PROTO_ICMP | PROTO_ICMPV6 => info.icmp_type = l4.first().copied().unwrap_or(0),
        _ => {}
    }
    Some(info)
}

/// An inclusive range of addresses of one family.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IpRange {
    v4: bool,
    lo: u128,
    hi: u128,
}

fn bits(ip: IpAddr) -> u128 {
    match ip {
        IpAddr::V4(a) => u128::from(u32::from(a)),
        IpAddr::V6(a) => u128::from(a),
    }
}

impl IpRange {
    fn contains(&self, ip: IpAddr) -> bool {
        ip.is_ipv4() == self.v4 && (self.lo..=self.hi).contains(&bits(ip))
    }

    fn from_prefix(p: Prefix) -> Self {
        let (lo, hi) = p.bounds();
        IpRange {
            v4: p.is_ipv4(),
            lo,
            hi,
        }
    }

    /// Parses an address set as Tailscale writes it: `"*"`, an IP, a CIDR, or `"a-b"`.
    /// `"*"` expands to both families.
    pub fn parse_set(s: &str) -> Result<Vec<IpRange>, String> {
        let s = s.trim();
        if s == "*" {
            return Ok(vec![
                IpRange::from_prefix(Prefix::new([0u8; 4].into(), 0)?),
                IpRange::from_prefix(Prefix::new([0u8; 16].into(), 0)?),
            ]);
        }
        if let Some((a, b)) = s.split_once('-') {
            let parse = |x: &str| {
                x.trim()
                    .parse::<IpAddr>()
                    .map_err(|_| format!("invalid IP range {s:?}"))
            };
            let (a, b) = (parse(a)?, parse(b)?);
            if a.is_ipv4() != b.is_ipv4() || bits(a) > bits(b) {
                return Err(format!("invalid IP range {s:?}: ends differ in family or are reversed"));
            }
            return Ok(vec![IpRange {
                v4: a.is_ipv4(),
                lo: bits(a),
                hi: bits(b),
            }]);
        }
        Ok(vec![IpRange::from_prefix(s.parse::<Prefix>()?)])
    }
}

/// A destination: addresses and an inclusive port range.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DstPorts {
    pub ips: Vec<IpRange>,
    pub first: u16,
    pub last: u16,
}

/// One compiled FilterRule.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rule {
    pub srcs: Vec<IpRange>,
    pub dsts: Vec<DstPorts>,
    /// Empty means TCP, UDP, ICMP and ICMPv6.
    pub protos: Vec<u8>,
}

/// Rule input as given from Python: (source sets, [(destination set, first port, last port)],
/// IP protocol numbers).
pub type RuleSpec = (Vec<String>, Vec<(String, u16, u16)>, Vec<u8>);

impl Rule {
    /// Compiles one rule; `cap:` sources are ignored (they are capability grants).
    pub fn compile(spec: &RuleSpec) -> Result<Rule, String> {
        let (srcs, dsts, protos) = spec;
        let mut rule = Rule {
            srcs: Vec::new(),
            dsts: Vec::new(),
            protos: protos.clone(),
        };
        for s in srcs {
            if s.starts_with("cap:") {
                continue;
            }
            rule.srcs.extend(IpRange::parse_set(s)?);
        }
        for (d, first, last) in dsts {
            if first > last {
                return Err(format!("invalid port range {first}-{last} for destination {d:?}"));
            }
            rule.dsts.push(DstPorts {
                ips: IpRange::parse_set(d)?,
                first: *first,
                last: *last,
            });
        }
        Ok(rule)
    }

    fn allows_proto(&self, proto: u8) -> bool {
        if self.protos.is_empty() {
            matches!(proto, PROTO_TCP | PROTO_UDP | PROTO_ICMP | PROTO_ICMPV6)
        } else {
            self.protos.contains(&proto)
        }
    }

    fn matches(&self, info: &PacketInfo, any_port: bool) -> bool {
        self.allows_proto(info.proto)
            && self.srcs.iter().any(|r| r.contains(info.src))
            && self.dsts.iter().any(|d| {
                d.ips.iter().any(|r| r.contains(info.dst)) && (any_port || (d.first..=d.last).contains(&info.dst_port))
            })
    }
}

/// Why a packet was dropped by the filter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    Accept,
    /// Destination is not one of our addresses.
    NotForUs,
    /// No rule allows this new flow.
    Denied,
    /// TSMP (IP protocol 99).
    Tsmp,
}

/// UDP flow key as seen from our side: (our addr, our port, their addr, their port).
type Flow = (IpAddr, u16, IpAddr, u16);

/// The filter: compiled rules and a UDP flow cache.
#[derive(Debug, Default)]
pub struct Filter {
    rules: Vec<Rule>,
    /// Flow -> last-seen time (seconds) for UDP flows we sent or accepted.
    udp_flows: HashMap<Flow, f64>,
}

/// UDP flows idle longer than this are forgotten.
pub const UDP_FLOW_IDLE_SECS: f64 = 120.0;
const UDP_FLOW_MAX: usize = 4096;

impl Filter {
    /// A filter with no rules: every new inbound flow is denied.
    pub fn new() -> Self {
        Self::default()
    }

    pub fn set_rules(&mut self, rules: Vec<Rule>) {
        self.rules = rules;
        self.udp_flows.clear();
    }

    pub fn rule_count(&self) -> usize {
        self.rules.len()
    }

    /// Records an outbound packet so that UDP replies are admitted.
    pub fn note_outbound(&mut self, info: &PacketInfo, now: f64) {
        if info.proto == PROTO_UDP && !info.fragment {
            self.remember((info.src, info.src_port, info.dst, info.dst_port), now);
        }
    }

    fn remember(&mut self, flow: Flow, now: f64) {
        if self.udp_flows.len() >= UDP_FLOW_MAX && !self.udp_flows.contains_key(&flow) {
            self.udp_flows.retain(|_, seen| now - *seen < UDP_FLOW_IDLE_SECS);
            if self.udp_flows.len() >= UDP_FLOW_MAX {
                return;
            }
        }
        self.udp_flows.insert(flow, now);
    }

    /// Decides on an inbound packet that came out of the tunnel.
    pub fn check_inbound(&mut self, info: &PacketInfo, is_local: impl Fn(IpAddr) -> bool, now: f64) -> Verdict {
        if info.proto == PROTO_TSMP {
            return Verdict::Tsmp;
        }
        if !is_local(info.dst) {
            return Verdict::NotForUs;
        }
        match info.proto {
            PROTO_TCP if !info.is_tcp_syn() => Verdict::Accept,
            PROTO_UDP if !info.fragment => {
                let flow = (info.dst, info.dst_port, info.src, info.src_port);
                let known = self
                    .udp_flows
                    .get(&flow)
                    .is_some_and(|seen| now - *seen < UDP_FLOW_IDLE_SECS);
                if known || self.rules.iter().any(|r| r.matches(info, false)) {
                    self.remember(flow, now);
                    Verdict::Accept
                } else {
                    Verdict::Denied
                }
            }
            PROTO_ICMP | PROTO_ICMPV6 if info.is_icmp_echo_request() => {
                if self.rules.iter().any(|r| r.matches(info, true)) {
                    Verdict::Accept
                } else {
                    Verdict::Denied
                }
            }
            PROTO_ICMP | PROTO_ICMPV6 => Verdict::Accept,
            _ if info.fragment => Verdict::Accept,
            _ => {
                if self.rules.iter().any(|r| r.matches(info, false)) {
                    Verdict::Accept
                } else {
                    Verdict::Denied
                }
            }
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Builds a minimal IPv4 packet with a TCP/UDP/ICMP header stub.
    pub(crate) fn ipv4(proto: u8, src: [u8; 4], dst: [u8; 4], sport: u16, dport: u16, flags: u8) -> Vec<u8> {
        let mut p = vec![0u8; 40];
        p[0] = 0x45;
        p[2..4].copy_from_slice(&40u16.to_be_bytes());
        p[8] = 64;
        p[9] = proto;
        p[12..16].copy_from_slice(&src);
        p[16..20].copy_from_slice(&dst);
        p[20..22].copy_from_slice(&sport.to_be_bytes());
        p[22..24].copy_from_slice(&dport.to_be_bytes());
        p[33] = flags;
        if proto == PROTO_ICMP {
            p[20] = sport as u8;
        }
        p
    }

    fn spec(srcs: &[&str], dsts: &[(&str, u16, u16)], protos: &[u8]) -> RuleSpec {
        (
            srcs.iter().map(|s| s.to_string()).collect(),
            dsts.iter().map(|(d, a, b)| (d.to_string(), *a, *b)).collect(),
            protos.to_vec(),
        )
    }

    const ME: [u8; 4] = [100, 64, 0, 5];
    const PEER: [u8; 4] = [100, 64, 0, 6];
    const OTHER: [u8; 4] = [100, 64, 0, 7];

    fn local(ip: IpAddr) -> bool {
        ip == IpAddr::from(ME)
    }

    fn check(f: &mut Filter, pkt: &[u8]) -> Verdict {
        f.check_inbound(&parse_packet(pkt).unwrap(), local, 0.0)
    }

    #[test]
    fn parses_ipv4_tcp() {
        let info = parse_packet(&ipv4(PROTO_TCP, PEER, ME, 40000, 80, TCP_SYN)).unwrap();
        assert_eq!(info.src, IpAddr::from(PEER));
        assert_eq!(info.dst_port, 80);
        assert!(info.is_tcp_syn());
        assert!(parse_packet(&[0x45, 0, 0]).is_none());
        assert!(parse_packet(&[0x10; 40]).is_none());
    }

    #[test]
    fn parses_ipv6_udp_after_extension_header() {
        let mut p = vec![0u8; 40 + 8 + 8];
        p[0] = 0x60;
        p[6] = 60; // destination options
        p[8..24].copy_from_slice(&"fd7a::6".parse::<std::net::Ipv6Addr>().unwrap().octets());
        p[24..40].copy_from_slice(&"fd7a::5".parse::<std::net::Ipv6Addr>().unwrap().octets());
        p[40] = PROTO_UDP;
        p[41] = 0;
        p[48..50].copy_from_slice(&53u16.to_be_bytes());
        p[50..52].copy_from_slice(&5353u16.to_be_bytes());
        let info = parse_packet(&p).unwrap();
        assert_eq!(info.proto, PROTO_UDP);
        assert_eq!((info.src_port, info.dst_port), (53, 5353));
    }

    #[test]
    fn default_denies_new_flows_but_passes_established_tcp() {
        let mut f = Filter::new();
        assert_eq!(
            check(&mut f, &ipv4(PROTO_TCP, PEER, ME, 1, 80, TCP_SYN)),
            Verdict::Denied
        );
        assert_eq!(
            check(&mut f, &ipv4(PROTO_TCP, PEER, ME, 1, 80, TCP_SYN | TCP_ACK)),
            Verdict::Accept
        );
        assert_eq!(
            check(&mut f, &ipv4(PROTO_TCP, PEER, ME, 1, 80, TCP_ACK)),
            Verdict::Accept
        );
        assert_eq!(check(&mut f, &ipv4(PROTO_UDP, PEER, ME, 1, 53, 0)), Verdict::Denied);
    }

    #[test]
    fn rules_match_source_destination_port_and_proto() {
        let mut f = Filter::new();
        f.set_rules(vec![
            Rule::compile(&spec(&["100.64.0.6/32", "cap:ignored"], &[("100.64.0.5", 80, 90)], &[])).unwrap(),
            Rule::compile(&spec(&["*"], &[("*", 5353, 5353)], &[PROTO_UDP])).unwrap(),
            Rule::compile(&spec(
                &["100.64.0.7-100.64.0.9"],
                &[("100.64.0.0/10", 22, 22)],
                &[PROTO_TCP],
            ))
            .unwrap(),
        ]);
        let syn = |src, port| ipv4(PROTO_TCP, src, ME, 1000, port, TCP_SYN);
        assert_eq!(check(&mut f, &syn(PEER, 80)), Verdict::Accept);
        assert_eq!(check(&mut f, &syn(PEER, 90)), Verdict::Accept);
        assert_eq!(check(&mut f, &syn(PEER, 91)), Verdict::Denied);
        assert_eq!(check(&mut f, &syn(OTHER, 80)), Verdict::Denied);
        assert_eq!(check(&mut f, &syn(OTHER, 22)), Verdict::Accept);
        assert_eq!(check(&mut f, &syn([100, 64, 0, 10], 22)), Verdict::Denied);
        assert_eq!(check(&mut f, &ipv4(PROTO_UDP, OTHER, ME, 9, 5353, 0)), Verdict::Accept);
        assert_eq!(check(&mut f, &ipv4(PROTO_UDP, OTHER, ME, 9, 5354, 0)), Verdict::Denied);
        // Only TCP for rule 3, so UDP to 22 is denied.
        assert_eq!(check(&mut f, &ipv4(PROTO_UDP, OTHER, ME, 9, 22, 0)), Verdict::Denied);
        // ICMP echo request needs any open port; echo reply always passes.
        assert_eq!(check(&mut f, &ipv4(PROTO_ICMP, PEER, ME, 8, 0, 0)), Verdict::Accept);
        assert_eq!(
            check(&mut f, &ipv4(PROTO_ICMP, [100, 64, 0, 10], ME, 8, 0, 0)),
            Verdict::Denied
        );
        assert_eq!(
            check(&mut f, &ipv4(PROTO_ICMP, [100, 64, 0, 10], ME, 0, 0, 0)),
            Verdict::Accept
        );
    }

    #[test]
    fn udp_replies_pass_via_flow_cache() {
        let mut f = Filter::new();
        let out = parse_packet(&ipv4(PROTO_UDP, ME, PEER, 4000, 53, 0)).unwrap();
        f.note_outbound(&out, 10.0);
        let reply = parse_packet(&ipv4(PROTO_UDP, PEER, ME, 53, 4000, 0)).unwrap();
        assert_eq!(f.check_inbound(&reply, local, 11.0), Verdict::Accept);
        assert_eq!(
            f.check_inbound(&reply, local, 10.0 + UDP_FLOW_IDLE_SECS + 200.0),
            Verdict::Denied
        );
    }

    #[test]
    fn tsmp_and_foreign_destinations_are_dropped() {
        let mut f = Filter::new();
        f.set_rules(vec![Rule::compile(&spec(&["*"], &[("*", 0, 65535)], &[])).unwrap()]);
        assert_eq!(check(&mut f, &ipv4(PROTO_TSMP, PEER, ME, 0, 0, 0)), Verdict::Tsmp);
        assert_eq!(
            check(&mut f, &ipv4(PROTO_TCP, PEER, OTHER, 1, 80, TCP_SYN)),
            Verdict::NotForUs
        );
    }

    #[test]
    fn bad_rules_are_rejected() {
        assert!(Rule::compile(&spec(&["1.2.3.4-1.2.3.1"], &[], &[])).is_err());
        assert!(Rule::compile(&spec(&["1.2.3.4-::1"], &[], &[])).is_err());
        assert!(Rule::compile(&spec(&["*"], &[("*", 9, 8)], &[])).is_err());
        assert!(Rule::compile(&spec(&["bogus"], &[], &[])).is_err());
    }
}
