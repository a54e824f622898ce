//! WireGuard peers: one boringtun `Tunn` per peer, AllowedIPs, DERP region, route table.

use std::collections::HashMap;
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
    pub tunn: Tunn,
    /// A direct UDP path confirmed by disco; None sends through DERP.
    pub direct: Option<SocketAddr>,
    /// When an IP packet was last sent to this peer (the caller's clock; -inf never).
    pub last_sent: f64,
}

impl Peer {
    /// WireGuard's inbound check: the decrypted packet's source must be in AllowedIPs.
    pub fn allows_source(&self, src: IpAddr) -> bool {
        self.allowed_ips.iter().any(|p| p.contains(src))
    }
}

/// Peer description as given by the netmap: key, AllowedIPs, home DERP region.
pub struct PeerSpec {
    pub key: NodeKey,
    pub allowed_ips: Vec<Prefix>,
    pub derp_region: u32,
}

/// Peers by key, plus the destination -> peer route table.
pub struct Peers {
    private: StaticSecret,
    by_key: HashMap<NodeKey, Peer>,
    /// Our WireGuard session index (the receiver index of inbound packets, shifted right by 8)
    /// to the peer it belongs to.
    by_index: HashMap<u32, NodeKey>,
    routes: RouteTable<NodeKey>,
    next_index: u32,
}

impl Peers {
    pub fn new(private: [u8; 32]) -> Self {
        Peers {
            private: StaticSecret::from(private),
            by_key: HashMap::new(),
            by_index: HashMap::new(),
            routes: RouteTable::new(),
            next_index: 1,
        }
    }

    pub fn public_key(&self) -> NodeKey {
        PublicKey::from(&self.private).to_bytes()
    }

    /// Replaces the peer set. Peers whose key is unchanged keep their `Tunn` (and so their
    /// WireGuard session); their AllowedIPs and region are updated.
    pub fn set(&mut self, specs: Vec<PeerSpec>) {
        let mut old = std::mem::take(&mut self.by_key);
        let mut routes = RouteTable::new();
        for spec in specs {
            let peer = match old.remove(&spec.key) {
                Some(mut peer) => {
                    peer.allowed_ips = spec.allowed_ips;
                    peer.derp_region = spec.derp_region;
                    peer
                }
                None => Peer {
                    key: spec.key,
                    allowed_ips: spec.allowed_ips,
                    derp_region: spec.derp_region,
                    tunn: self.new_tunn(spec.key),
                    direct: None,
                    last_sent: f64::NEG_INFINITY,
                },
            };
            for prefix in &peer.allowed_ips {
                routes.insert(*prefix, peer.key);
            }
            self.by_key.insert(peer.key, peer);
        }
        self.routes = routes;
        let by_key = &self.by_key;
        self.by_index.retain(|_, key| by_key.contains_key(key));
    }

    /// A WireGuard session for `key` under a fresh index (session ids are `index << 8`; indices
    /// stay unique and within 24 bits).
    fn new_tunn(&mut self, key: NodeKey) -> Tunn {
        let index = self.next_index;
        self.next_index = (self.next_index % 0x00ff_ffff) + 1;
        self.by_index.insert(index, key);
        Tunn::new(self.private.clone(), PublicKey::from(key), None, None, index, None)
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
            let tunn = self.new_tunn(key);
            if let Some(peer) = self.by_key.get_mut(&key) {
                peer.tunn = tunn;
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
