//! IP prefixes and a longest-prefix-match table (destination -> peer).

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::net::IpAddr;
use std::str::FromStr;

/// An IP prefix (CIDR). The address is stored masked to the prefix length.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Prefix {
    addr: IpAddr,
    len: u8,
}

fn addr_bits(addr: IpAddr) -> (u128, u8) {
    match addr {
        IpAddr::V4(a) => (u128::from(u32::from(a)), 32),
        IpAddr::V6(a) => (u128::from(a), 128),
    }
}

/// Keeps the top `len` bits of a `width`-bit address.
fn mask(bits: u128, width: u8, len: u8) -> u128 {
    if len == 0 {
        return 0;
    }
    let host = u32::from(width - len);
    let full = if width == 128 { u128::MAX } else { (1u128 << width) - 1 };
    bits & ((full >> host) << host)
}

fn from_bits(bits: u128, v4: bool) -> IpAddr {
    if v4 {
        // Truncation is intended: v4 values always fit in 32 bits.
        IpAddr::from((bits as u32).to_be_bytes())
    } else {
        IpAddr::from(bits.to_be_bytes())
    }
}

impl Prefix {
    /// Builds a prefix, masking host bits. Fails if `len` exceeds the address width.
    pub fn new(addr: IpAddr, len: u8) -> Result<Self, String> {
        let (bits, width) = addr_bits(addr);
        if len > width {
            return Err(format!("prefix length /{len} is too long for {addr}"));
        }
        Ok(Prefix {
            addr: from_bits(mask(bits, width, len), addr.is_ipv4()),
            len,
        })
    }

    /// A single-address prefix (/32 or /128).
    pub fn host(addr: IpAddr) -> Self {
        let len = if addr.is_ipv4() { 32 } else { 128 };
        Prefix { addr, len }
    }

    pub fn addr(&self) -> IpAddr {
        self.addr
    }

    pub fn prefix_len(&self) -> u8 {
        self.len
    }

    pub fn is_ipv4(&self) -> bool {
        self.addr.is_ipv4()
    }

    pub fn contains(&self, ip: IpAddr) -> bool {
        if ip.is_ipv4() != self.addr.is_ipv4() {
            return false;
        }
        let (bits, width) = addr_bits(ip);
        mask(bits, width, self.len) == addr_bits(self.addr).0
    }

    /// The first and last address covered, as integers.
    pub fn bounds(&self) -> (u128, u128) {
        let (bits, width) = addr_bits(self.addr);
        let host_mask = mask(u128::MAX, width, width) & !mask(u128::MAX, width, self.len);
        (bits, bits | host_mask)
    }
}

impl FromStr for Prefix {
    type Err = String;

    /// Parses `"100.64.0.5/32"`, `"fd7a:115c:a1e0::/48"` or a bare address (host prefix).
    fn from_str(s: &str) -> Result<Self, String> {
        let s = s.trim();
        match s.split_once('/') {
            Some((addr, len)) => {
                let addr: IpAddr = addr
                    .parse()
                    .map_err(|_| format!("invalid IP prefix {s:?}: bad address"))?;
                let len: u8 = len
                    .parse()
                    .map_err(|_| format!("invalid IP prefix {s:?}: bad length"))?;
                Prefix::new(addr, len).map_err(|e| format!("invalid IP prefix {s:?}: {e}"))
            }
            None => s
                .parse::<IpAddr>()
                .map(Prefix::host)
                .map_err(|_| format!("invalid IP prefix {s:?}")),
        }
    }
}

impl fmt::Display for Prefix {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.addr, self.len)
    }
}

/// Longest-prefix-match table. Lookups cost one hash probe per distinct prefix length
/// present in the table (longest first), so they stay cheap with many peers.
#[derive(Debug)]
pub struct RouteTable<T> {
    v4: BTreeMap<u8, HashMap<u128, T>>,
    v6: BTreeMap<u8, HashMap<u128, T>>,
}

impl<T> Default for RouteTable<T> {
    fn default() -> Self {
        RouteTable {
            v4: BTreeMap::new(),
            v6: BTreeMap::new(),
        }
    }
}

impl<T: Copy> RouteTable<T> {
    pub fn new() -> Self {
        Self::default()
    }

    /// Inserts a route; an existing identical prefix keeps its first owner.
    /// Returns false when the prefix was already present.
    pub fn insert(&mut self, prefix: Prefix, value: T) -> bool {
        let table = if prefix.is_ipv4() { &mut self.v4 } else { &mut self.v6 };
        let slot = table.entry(prefix.prefix_len()).or_default();
        let key = addr_bits(prefix.addr()).0;
        if slot.contains_key(&key) {
            return false;
        }
        slot.insert(key, value);
        true
    }

    /// Routes `prefix` to `value`, replacing its owner if it had one.
    pub fn set(&mut self, prefix: Prefix, value: T) {
        let table = if prefix.is_ipv4() { &mut self.v4 } else { &mut self.v6 };
        let key = addr_bits(prefix.addr()).0;
        table.entry(prefix.prefix_len()).or_default().insert(key, value);
    }

    /// Removes the route of `prefix`; a prefix length left without routes costs lookups no probe.
    pub fn remove(&mut self, prefix: Prefix) -> Option<T> {
        let table = if prefix.is_ipv4() { &mut self.v4 } else { &mut self.v6 };
        let slot = table.get_mut(&prefix.prefix_len())?;
        let removed = slot.remove(&addr_bits(prefix.addr()).0);
        if slot.is_empty() {
            table.remove(&prefix.prefix_len());
        }
        removed
    }

    /// Routes held, over both families.
    pub fn len(&self) -> usize {
        self.v4.values().chain(self.v6.values()).map(HashMap::len).sum()
    }

    pub fn lookup(&self, ip: IpAddr) -> Option<T> {
        let (bits, width) = addr_bits(ip);
        let table = if ip.is_ipv4() { &self.v4 } else { &self.v6 };
        table
            .iter()
            .rev()
            .find_map(|(&len, entries)| entries.get(&mask(bits, width, len)).copied())
    }

    pub fn is_empty(&self) -> bool {
        self.v4.is_empty() && self.v6.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(s: &str) -> Prefix {
        s.parse().unwrap()
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn parse_and_mask() {
        assert_eq!(p("10.1.2.3/8").to_string(), "10.0.0.0/8");
        assert_eq!(p("100.64.0.5").to_string(), "100.64.0.5/32");
        assert_eq!(p("fd7a:115c:a1e0::5/48").to_string(), "fd7a:115c:a1e0::/48");
        assert_eq!(p("0.0.0.0/0").to_string(), "0.0.0.0/0");
        assert_eq!(p("::/0").to_string(), "::/0");
        assert!("10.0.0.0/33".parse::<Prefix>().is_err());
        assert!("nonsense".parse::<Prefix>().is_err());
        assert!("1.2.3.4/x".parse::<Prefix>().is_err());
    }

    #[test]
    fn contains_and_bounds() {
        assert!(p("100.64.0.0/10").contains(ip("100.127.255.255")));
        assert!(!p("100.64.0.0/10").contains(ip("100.128.0.0")));
        assert!(!p("100.64.0.0/10").contains(ip("::1")));
        assert!(p("::/0").contains(ip("fd7a::1")));
        assert_eq!(p("10.0.0.0/24").bounds(), (0x0a00_0000, 0x0a00_00ff));
        assert_eq!(p("0.0.0.0/0").bounds(), (0, 0xffff_ffff));
        assert_eq!(p("::/0").bounds(), (0, u128::MAX));
        assert_eq!(p("::1/128").bounds(), (1, 1));
    }

    #[test]
    fn longest_prefix_wins() {
        let mut t = RouteTable::new();
        assert!(t.insert(p("0.0.0.0/0"), 1));
        assert!(t.insert(p("10.0.0.0/8"), 2));
        assert!(t.insert(p("10.1.0.0/16"), 3));
        assert!(t.insert(p("10.1.2.3/32"), 4));
        assert!(t.insert(p("fd7a:115c:a1e0::/48"), 5));
        assert!(!t.insert(p("10.0.0.0/8"), 9));
        assert_eq!(t.lookup(ip("10.1.2.3")), Some(4));
        assert_eq!(t.lookup(ip("10.1.2.4")), Some(3));
        assert_eq!(t.lookup(ip("10.2.0.1")), Some(2));
        assert_eq!(t.lookup(ip("192.168.1.1")), Some(1));
        assert_eq!(t.lookup(ip("fd7a:115c:a1e0::7")), Some(5));
        assert_eq!(t.lookup(ip("fd7b::1")), None);
    }

    #[test]
    fn set_replaces_and_remove_falls_back_to_a_shorter_prefix() {
        let mut t = RouteTable::new();
        t.insert(p("10.0.0.0/8"), 1);
        t.insert(p("10.1.0.0/16"), 2);
        t.set(p("10.1.0.0/16"), 3);
        assert_eq!(t.lookup(ip("10.1.2.3")), Some(3));
        assert_eq!(t.remove(p("10.1.0.0/16")), Some(3));
        assert_eq!(t.lookup(ip("10.1.2.3")), Some(1));
        assert_eq!(t.remove(p("10.1.0.0/16")), None);
        assert_eq!(t.len(), 1);
        assert_eq!(t.v4.len(), 1, "no empty /16 bucket is left to probe");
        assert_eq!(t.remove(p("10.0.0.0/8")), Some(1));
        assert!(t.is_empty());
    }

    #[test]
    fn empty_table_has_no_route() {
        let t: RouteTable<u32> = RouteTable::new();
        assert!(t.is_empty());
        assert_eq!(t.lookup(ip("100.64.0.1")), None);
    }
}
