//! WireGuard peers: one boringtun `Tunn` per peer, AllowedIPs, DERP region, route table.

use std::collections::{HashMap, HashSet};
use std::net::{IpAddr, SocketAddr};

use boringtun::noise::Tunn;
use boringtun::x25519::{PublicKey, StaticSecret};

use crate::route::{Prefix, RouteTable};

pub type NodeKey = [u8; 32];

/// One peer in the netmap.
pub struct Peer {
    pub key: NodeKey,
    pub allowed_ips: Vec<Prefix>,
    pub derp_region: u32,
    /// Orders peers that claim the same prefix: the lowest rank gets the route.
    pub rank: u64,
    pub tunn: Tunn,
    /// A direct UDP path confirmed by disco; None sends through DERP.
    pub direct: Option<SocketAddr>,
    /// When an IP packet was last sent to this peer (the caller's clock; -inf never).
    pub last_sent: f64,
    /// The index of `tunn`'s sessions (see `Peers::by_index`).
    index: u32,
}

impl Peer {
    /// WireGuard's inbound check: the decrypted packet's source must be in AllowedIPs.
    pub fn allows_source(&self, src: IpAddr) -> bool {
        self.allowed_ips.iter().any(|p| p.contains(src))
    }
}

/// Peer description as given by the netmap: key, AllowedIPs, home DERP region, and the rank
/// that decides which of two peers claiming one prefix routes it (the lower).
pub struct PeerSpec {
    pub key: NodeKey,
    pub allowed_ips: Vec<Prefix>,
    pub derp_region: u32,
    pub rank: u64,
}

/// Peers by key, plus the destination -> peer route table.
pub struct Peers {
    private: StaticSecret,
    by_key: HashMap<NodeKey, Peer>,
    /// Our WireGuard session index (the receiver index of inbound packets, shifted right by 8)
    /// to the peer it belongs to.
    by_index: HashMap<u32, NodeKey>,
    routes: RouteTable<NodeKey>,
    /// Every peer claiming a prefix, by (rank, key): the first one owns its route, and the next
    /// takes over when it leaves, so an update touches only the changed peers' prefixes.
    claims: HashMap<Prefix, Vec<(u64, NodeKey)>>,
    next_index: u32,
}

impl Peers {
    pub fn new(private: [u8; 32]) -> Self {
        Peers {
            private: StaticSecret::from(private),
            by_key: HashMap::new(),
            by_index: HashMap::new(),
            routes: RouteTable::new(),
            claims: HashMap::new(),
            next_index: 1,
        }
    }

    pub fn public_key(&self) -> NodeKey {
        PublicKey::from(&self.private).to_bytes()
    }

    /// Replaces the peer set: peers not in `specs` are removed, the others upserted.
    pub fn set(&mut self, specs: Vec<PeerSpec>) {
        let wanted: HashSet<NodeKey> = specs.iter().map(|s| s.key).collect();
        let gone: Vec<NodeKey> = self.by_key.keys().filter(|k| !wanted.contains(*k)).copied().collect();
        self.remove(&gone);
        for spec in specs {
            self.upsert(spec);
        }
    }

    /// Adds a peer, or updates one with the same key: it keeps its `Tunn` (and so its WireGuard
    /// session and direct path); only the routes of prefixes it gained or lost change.
    pub fn upsert(&mut self, spec: PeerSpec) {
        let PeerSpec {
            key,
            allowed_ips,
            derp_region,
            rank,
        } = spec;
        let old = match self.by_key.get_mut(&key) {
            Some(peer) => {
                peer.derp_region = derp_region;
                if peer.allowed_ips == allowed_ips && peer.rank == rank {
                    return;
                }
                let old_rank = std::mem::replace(&mut peer.rank, rank);
                let old_ips = std::mem::replace(&mut peer.allowed_ips, allowed_ips.clone());
                Some((old_rank, old_ips))
            }
            None => {
                let (tunn, index) = self.new_tunn(key);
                let peer = Peer {
                    key,
                    allowed_ips: allowed_ips.clone(),
                    derp_region,
                    rank,
                    tunn,
                    direct: None,
                    last_sent: f64::NEG_INFINITY,
                    index,
                };
                self.by_key.insert(key, peer);
                None
            }
        };
        match old {
            Some((old_rank, old_ips)) if old_rank == rank => {
                for prefix in old_ips.iter().filter(|p| !allowed_ips.contains(p)) {
                    self.unclaim(*prefix, &key);
                }
                for prefix in allowed_ips.iter().filter(|p| !old_ips.contains(p)) {
                    self.claim(*prefix, rank, key);
                }
            }
            Some((_, old_ips)) => {
                for prefix in old_ips {
                    self.unclaim(prefix, &key);
                }
                for prefix in allowed_ips {
                    self.claim(prefix, rank, key);
                }
            }
            None => {
                for prefix in allowed_ips {
                    self.claim(prefix, rank, key);
                }
            }
        }
    }

    /// Removes peers (unknown keys are ignored): their sessions end and their routes go to the
    /// next peer claiming the same prefix, if any.
    pub fn remove(&mut self, keys: &[NodeKey]) {
        for key in keys {
            let Some(peer) = self.by_key.remove(key) else { continue };
            self.by_index.remove(&peer.index);
            for prefix in peer.allowed_ips {
                self.unclaim(prefix, key);
            }
        }
    }

    /// `key` (of `rank`) claims `prefix`; the route follows the first claim.
    fn claim(&mut self, prefix: Prefix, rank: u64, key: NodeKey) {
        let claims = self.claims.entry(prefix).or_default();
        if claims.iter().any(|(_, k)| *k == key) {
            return;
        }
        let at = claims.partition_point(|c| *c < (rank, key));
        claims.insert(at, (rank, key));
        if at == 0 {
            self.routes.set(prefix, key);
        }
    }

    /// `key` no longer claims `prefix`: its route goes to the next claim, or away.
    fn unclaim(&mut self, prefix: Prefix, key: &NodeKey) {
        let Some(claims) = self.claims.get_mut(&prefix) else {
            return;
        };
        let Some(at) = claims.iter().position(|(_, k)| k == key) else {
            return;
        };
        claims.remove(at);
        match claims.first() {
            None => {
                self.claims.remove(&prefix);
                self.routes.remove(prefix);
            }
            Some((_, next)) if at == 0 => self.routes.set(prefix, *next),
            Some(_) => {}
        }
    }

    /// A WireGuard session for `key` under a fresh index (session ids are `index << 8`; indices
    /// stay unique and within 24 bits).
    fn new_tunn(&mut self, key: NodeKey) -> (Tunn, u32) {
        let index = self.next_index;
        self.next_index = (self.next_index % 0x00ff_ffff) + 1;
        self.by_index.insert(index, key);
        let tunn = Tunn::new(self.private.clone(), PublicKey::from(key), None, None, index, None);
        (tunn, index)
    }

    /// The peer an inbound WireGuard message is for, from its receiver index (responses,
    /// cookies and data carry one; initiations do not).
    pub fn by_receiver_index(&self, datagram: &[u8]) -> Option<NodeKey> {
        let at = match datagram.first()? {
            2 => 8,
            3 | 4 => 4,
            _ => return None,
        };
        let index = u32::from_le_bytes(datagram.get(at..at + 4)?.try_into().ok()?);
        self.by_index.get(&(index >> 8)).copied()
    }

    /// Replaces this node's private key (control rotated the node key): every peer gets a new
    /// `Tunn`, so sessions are re-established with the new key on the next packet.
    pub fn set_private(&mut self, private: [u8; 32]) {
        self.private = StaticSecret::from(private);
        self.by_index.clear();
        let keys: Vec<NodeKey> = self.by_key.keys().copied().collect();
        for key in keys {
            let (tunn, index) = self.new_tunn(key);
            if let Some(peer) = self.by_key.get_mut(&key) {
                peer.tunn = tunn;
                peer.index = index;
            }
        }
    }

    /// Longest-prefix match of a destination over all peers' AllowedIPs.
    pub fn route(&self, dst: IpAddr) -> Option<NodeKey> {
        self.routes.lookup(dst)
    }

    pub fn get_mut(&mut self, key: &NodeKey) -> Option<&mut Peer> {
        self.by_key.get_mut(key)
    }

    pub fn get(&self, key: &NodeKey) -> Option<&Peer> {
        self.by_key.get(key)
    }

    pub fn iter(&self) -> impl Iterator<Item = &Peer> {
        self.by_key.values()
    }

    pub fn iter_mut(&mut self) -> impl Iterator<Item = &mut Peer> {
        self.by_key.values_mut()
    }

    pub fn len(&self) -> usize {
        self.by_key.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_key.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(key: u8, ips: &[&str], region: u32) -> PeerSpec {
        PeerSpec {
            key: PublicKey::from(&StaticSecret::from([key; 32])).to_bytes(),
            allowed_ips: ips.iter().map(|s| s.parse().unwrap()).collect(),
            derp_region: region,
            rank: u64::from(key),
        }
    }

    #[test]
    fn a_new_private_key_keeps_peers_and_routes() {
        let mut peers = Peers::new([1; 32]);
        let s = spec(2, &["100.64.0.6/32"], 999);
        let key = s.key;
        peers.set(vec![s]);
        peers.set_private([3; 32]);
        assert_eq!(
            peers.public_key(),
            PublicKey::from(&StaticSecret::from([3; 32])).to_bytes()
        );
        assert_eq!(peers.route("100.64.0.6".parse().unwrap()), Some(key));
        assert_eq!(peers.get(&key).unwrap().derp_region, 999);
    }

    #[test]
    fn receiver_index_finds_the_peer() {
        let mut peers = Peers::new([1; 32]);
        let s = spec(2, &["100.64.0.6/32"], 999);
        let key = s.key;
        peers.set(vec![s]);
        let index = *peers.by_index.iter().find(|(_, k)| **k == key).unwrap().0;
        let mut data = vec![4u8, 0, 0, 0];
        data.extend(((index << 8) | 3).to_le_bytes());
        assert_eq!(peers.by_receiver_index(&data), Some(key));
        assert_eq!(
            peers.by_receiver_index(&[1, 0, 0, 0, 0, 0, 0, 0]),
            None,
            "initiations carry no receiver"
        );
        peers.set(vec![]);
        assert_eq!(peers.by_receiver_index(&data), None, "gone with the peer");
    }

    #[test]
    fn allowed_ips_source_check() {
        let mut peers = Peers::new([1; 32]);
        let s = spec(2, &["100.64.0.6/32", "10.0.0.0/24"], 999);
        let key = s.key;
        peers.set(vec![s]);
        let p = peers.get(&key).unwrap();
        assert!(p.allows_source("100.64.0.6".parse().unwrap()));
        assert!(p.allows_source("10.0.0.77".parse().unwrap()));
        assert!(!p.allows_source("100.64.0.7".parse().unwrap()));
        assert!(!p.allows_source("fd7a::6".parse().unwrap()));
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    /// Starts a handshake on `key`'s session: a kept `Tunn` then has it in flight (`Done` on the
    /// next packet), a new one starts another (`WriteToNetwork`).
    fn start_handshake(peers: &mut Peers, key: &NodeKey) {
        let mut buf = [0u8; 256];
        let tunn = &mut peers.get_mut(key).unwrap().tunn;
        assert!(matches!(
            tunn.encapsulate(&[0x45; 20], &mut buf),
            boringtun::noise::TunnResult::WriteToNetwork(_)
        ));
    }

    fn handshake_in_flight(peers: &mut Peers, key: &NodeKey) -> bool {
        let mut buf = [0u8; 256];
        let tunn = &mut peers.get_mut(key).unwrap().tunn;
        matches!(
            tunn.encapsulate(&[0x45; 20], &mut buf),
            boringtun::noise::TunnResult::Done
        )
    }

    /// Two peers: `a` (key returned first) with a subnet route beside its address, `b` with its
    /// address only.
    fn two_peers() -> (Peers, NodeKey, NodeKey) {
        let mut peers = Peers::new([1; 32]);
        let (a, b) = (
            spec(2, &["100.64.0.6/32", "10.0.0.0/8"], 1),
            spec(3, &["100.64.0.7/32"], 1),
        );
        let (ka, kb) = (a.key, b.key);
        peers.upsert(a);
        peers.upsert(b);
        (peers, ka, kb)
    }

    #[test]
    fn an_upsert_replaces_one_peers_routes_and_keeps_every_session() {
        let (mut peers, ka, kb) = two_peers();
        start_handshake(&mut peers, &ka);
        start_handshake(&mut peers, &kb);
        peers.get_mut(&kb).unwrap().direct = Some("192.0.2.7:41641".parse().unwrap());

        peers.upsert(spec(2, &["100.64.0.6/32", "10.9.0.0/16"], 4));
        assert_eq!(peers.route(ip("10.1.2.3")), None, "the old subnet is gone");
        assert_eq!(peers.route(ip("10.9.2.3")), Some(ka));
        assert_eq!(peers.route(ip("100.64.0.6")), Some(ka));
        assert_eq!(peers.route(ip("100.64.0.7")), Some(kb));
        assert_eq!(peers.get(&ka).unwrap().derp_region, 4);
        assert!(
            handshake_in_flight(&mut peers, &ka),
            "the changed peer kept its session"
        );
        assert!(
            handshake_in_flight(&mut peers, &kb),
            "the unchanged peer kept its session"
        );
        assert!(peers.get(&kb).unwrap().direct.is_some(), "and its direct path");
        assert_eq!(peers.routes.len(), 3);
    }

    #[test]
    fn a_removed_peer_takes_its_routes_and_session_index_along() {
        let (mut peers, ka, kb) = two_peers();
        start_handshake(&mut peers, &kb);
        peers.remove(&[ka, [9; 32]]);
        assert_eq!(peers.len(), 1);
        assert_eq!(peers.route(ip("10.1.2.3")), None);
        assert_eq!(peers.route(ip("100.64.0.6")), None);
        assert_eq!(peers.route(ip("100.64.0.7")), Some(kb));
        assert!(peers.by_index.values().all(|k| *k == kb));
        assert!(handshake_in_flight(&mut peers, &kb));
        assert_eq!((peers.routes.len(), peers.claims.len()), (1, 1));
    }

    #[test]
    fn a_prefix_two_peers_claim_routes_to_the_lower_rank_whatever_the_order() {
        let mut peers = Peers::new([1; 32]);
        let (low, high) = (spec(2, &["10.0.0.0/8"], 1), spec(3, &["10.0.0.0/8"], 1));
        let (kl, kh) = (low.key, high.key);
        peers.upsert(high);
        assert_eq!(peers.route(ip("10.1.1.1")), Some(kh));
        peers.upsert(low);
        assert_eq!(peers.route(ip("10.1.1.1")), Some(kl), "the lower rank takes it");
        peers.upsert(spec(2, &["100.64.0.6/32"], 1));
        assert_eq!(peers.route(ip("10.1.1.1")), Some(kh), "back to the other claim");
        peers.upsert(spec(2, &["10.0.0.0/8"], 1));
        peers.remove(&[kl]);
        assert_eq!(peers.route(ip("10.1.1.1")), Some(kh));
        peers.remove(&[kh]);
        assert!(peers.routes.is_empty() && peers.claims.is_empty());
    }

    /// The same specs through `set` at once and through upserts and removals one by one give
    /// the same routes.
    #[test]
    fn upserts_and_removals_end_where_a_full_set_does() {
        let steps: Vec<Vec<(u8, Vec<&str>)>> = vec![
            vec![
                (2, vec!["100.64.0.2/32", "10.0.0.0/16"]),
                (3, vec!["100.64.0.3/32", "10.0.0.0/16"]),
            ],
            vec![
                (3, vec!["100.64.0.3/32", "10.0.0.0/16", "10.1.0.0/16"]),
                (4, vec!["100.64.0.4/32"]),
            ],
            vec![
                (2, vec!["100.64.0.2/32", "10.1.0.0/16"]),
                (4, vec!["100.64.0.4/32", "10.0.0.0/16"]),
            ],
        ];
        let mut incremental = Peers::new([1; 32]);
        for step in &steps {
            let wanted: Vec<PeerSpec> = step.iter().map(|(k, ips)| spec(*k, ips, 1)).collect();
            let gone: Vec<NodeKey> = incremental
                .iter()
                .map(|p| p.key)
                .filter(|k| wanted.iter().all(|s| s.key != *k))
                .collect();
            incremental.remove(&gone);
            let mut full = Peers::new([1; 32]);
            full.set(step.iter().map(|(k, ips)| spec(*k, ips, 1)).collect());
            for s in wanted {
                incremental.upsert(s);
            }
            for probe in ["10.0.1.1", "10.1.1.1", "100.64.0.2", "100.64.0.3", "100.64.0.4"] {
                assert_eq!(incremental.route(ip(probe)), full.route(ip(probe)), "{probe}");
            }
            assert_eq!(incremental.routes.len(), full.routes.len());
            assert_eq!(incremental.len(), full.len());
        }
    }

    #[test]
    fn routes_follow_longest_prefix_and_updates_keep_sessions() {
        let mut peers = Peers::new([1; 32]);
        let a = spec(2, &["100.64.0.6/32", "10.0.0.0/8"], 1);
        let b = spec(3, &["100.64.0.7/32", "10.1.0.0/16"], 2);
        let (ka, kb) = (a.key, b.key);
        peers.set(vec![a, b]);
        assert_eq!(peers.route("10.1.2.3".parse().unwrap()), Some(kb));
        assert_eq!(peers.route("10.2.2.3".parse().unwrap()), Some(ka));
        assert_eq!(peers.route("100.64.0.8".parse().unwrap()), None);

        // Mark peer a's Tunn so we can see it survives an update.
        let mut buf = [0u8; 256];
        let before = matches!(
            peers.get_mut(&ka).unwrap().tunn.encapsulate(&[0x45; 20], &mut buf),
            boringtun::noise::TunnResult::WriteToNetwork(_)
        );
        assert!(before, "first packet starts a handshake");
        peers.set(vec![spec(2, &["100.64.0.6/32"], 5)]);
        assert_eq!(peers.len(), 1);
        assert_eq!(peers.get(&ka).unwrap().derp_region, 5);
        assert_eq!(peers.route("10.1.2.3".parse().unwrap()), None);
        // A handshake is already in flight on the kept Tunn, so no new initiation.
        assert!(matches!(
            peers.get_mut(&ka).unwrap().tunn.encapsulate(&[0x45; 20], &mut buf),
            boringtun::noise::TunnResult::Done
        ));
    }
}
