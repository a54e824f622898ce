//! The userspace TCP/IP stack: a smoltcp IP-medium interface, TCP sockets behind stable
//! handles, per-connection listener sockets (smoltcp has no accept queue) and readiness
//! events.

use std::collections::{HashMap, HashSet, VecDeque};
use std::net::{IpAddr, SocketAddr};

use smoltcp::iface::{Config, Interface, SocketHandle, SocketSet};
use smoltcp::phy::{Checksum, ChecksumCapabilities, Device, DeviceCapabilities, Medium};
use smoltcp::socket::tcp;
use smoltcp::time::{Duration, Instant};
use smoltcp::wire::{HardwareAddress, IpAddress, IpCidr, IpEndpoint};

use crate::filter::PacketInfo;
use crate::route::Prefix;

/// Tailscale's safe TUN MTU (`net/tstun/mtu.go`).
pub const MTU: usize = 1280;
/// Default socket buffer size (each of RX and TX) per TCP connection.
pub const DEFAULT_TCP_BUFFER: usize = 512 * 1024;
/// Half-open connections allowed per listener.
pub const LISTEN_BACKLOG: usize = 128;
/// How long a closed-by-us connection may linger without progress (no queued byte
/// acknowledged, or the FIN exchange not finished) before it is aborted.
const ORPHAN_LINGER_SECS: f64 = 60.0;
const EPHEMERAL_FIRST: u16 = 49152;

/// Events reported by the stack (DERP events are added by the data plane).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TcpEvent {
    Connected(u64),
    Readable(u64),
    Writable(u64),
    PeerClosed(u64),
    Closed(u64),
    Reset(u64),
    Accepted {
        listener: u64,
        handle: u64,
        remote: SocketAddr,
    },
    DialFailed {
        handle: u64,
        reason: String,
    },
}

#[derive(Debug)]
pub enum StackError {
    UnknownHandle(u64),
    UnknownListener(u64),
    InvalidPort(u16),
    PortInUse(u16),
    WriteClosed(u64),
    NoLocalAddress(IpAddr),
    TooManyAddresses(usize),
}

impl std::fmt::Display for StackError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StackError::UnknownHandle(h) => write!(f, "unknown TCP handle {h} (closed or never opened)"),
            StackError::UnknownListener(l) => write!(f, "unknown listener {l}"),
            StackError::InvalidPort(p) => write!(f, "invalid port {p}"),
            StackError::PortInUse(p) => write!(f, "already listening on port {p}"),
            StackError::WriteClosed(h) => write!(f, "TCP handle {h}: the write side is closed"),
            StackError::NoLocalAddress(ip) => write!(f, "no local address of the family of {ip}"),
            StackError::TooManyAddresses(n) => {
                write!(
                    f,
                    "{n} addresses given; at most one IPv4 and one IPv6 address are supported"
                )
            }
        }
    }
}

/// In-memory IP device: packets in (from WireGuard) and out (to WireGuard).
#[derive(Default)]
pub struct VirtualDevice {
    pub rx: VecDeque<Vec<u8>>,
    pub tx: VecDeque<Vec<u8>>,
}

pub struct RxToken(Vec<u8>);
pub struct TxToken<'a>(&'a mut VecDeque<Vec<u8>>);

impl smoltcp::phy::RxToken for RxToken {
    fn consume<R, F: FnOnce(&[u8]) -> R>(self, f: F) -> R {
        f(&self.0)
    }
}

impl smoltcp::phy::TxToken for TxToken<'_> {
    fn consume<R, F: FnOnce(&mut [u8]) -> R>(self, len: usize, f: F) -> R {
        let mut buf = vec![0u8; len];
        let r = f(&mut buf);
        self.0.push_back(buf);
        r
    }
}

impl Device for VirtualDevice {
    type RxToken<'a> = RxToken;
    type TxToken<'a> = TxToken<'a>;

    fn receive(&mut self, _now: Instant) -> Option<(RxToken, TxToken<'_>)> {
        let pkt = self.rx.pop_front()?;
        Some((RxToken(pkt), TxToken(&mut self.tx)))
    }

    fn transmit(&mut self, _now: Instant) -> Option<TxToken<'_>> {
        Some(TxToken(&mut self.tx))
    }

    fn capabilities(&self) -> DeviceCapabilities {
        let mut caps = DeviceCapabilities::default();
        caps.medium = Medium::Ip;
        caps.max_transmission_unit = MTU;
        // Inbound packets were authenticated by WireGuard, so checksums are only computed
        // on transmit, not verified on receive.
        let mut sums = ChecksumCapabilities::default();
        sums.ipv4 = Checksum::Tx;
        sums.tcp = Checksum::Tx;
        sums.udp = Checksum::Tx;
        sums.icmpv4 = Checksum::Tx;
        sums.icmpv6 = Checksum::Tx;
        caps.checksum = sums;
        caps
    }
}

#[derive(Debug)]
struct Conn {
    socket: SocketHandle,
    /// Connected (or Accepted) has been reported.
    connected: bool,
    /// Dial timeout; the deadline is set from the first poll's clock after connect.
    dial_timeout: Option<f64>,
    /// Dial deadline (seconds) while connecting.
    deadline: Option<f64>,
    /// A Readable event is outstanding (cleared by `recv`).
    readable_sent: bool,
    /// The last `send` was short; report Writable when space frees up.
    want_writable: bool,
    peer_closed_sent: bool,
    /// `shutdown_write` was called before the connection was established.
    shutdown_pending: bool,
    last_state: tcp::State,
    /// The peer's FIN arrived (sticky: the socket may be reset to Closed after TIME-WAIT).
    fin_seen: bool,
    /// Received bytes not yet read, taken out of a socket in TIME-WAIT: smoltcp resets the
    /// socket when TIME-WAIT ends, which clears its receive buffer.
    held: VecDeque<u8>,
}

impl Conn {
    fn new(socket: SocketHandle, state: tcp::State) -> Self {
        Conn {
            socket,
            connected: false,
            dial_timeout: None,
            deadline: None,
            readable_sent: false,
            want_writable: false,
            peer_closed_sent: false,
            shutdown_pending: false,
            last_state: state,
            fin_seen: false,
            held: VecDeque::new(),
        }
    }
}

#[derive(Debug)]
struct Listener {
    port: u16,
    /// Sockets created for incoming SYNs that have not completed the handshake.
    half_open: Vec<SocketHandle>,
}

/// What the stack says about an inbound SYN before it reaches smoltcp.
#[derive(Debug, PartialEq, Eq)]
pub enum SynDisposition {
    /// Feed it (a listener socket is ready, or smoltcp will answer with RST).
    Feed,
    /// The listener's backlog is full; drop.
    BacklogFull,
}

fn to_instant(now: f64) -> Instant {
    // Seconds (float) to smoltcp's microsecond clock.
    Instant::from_micros((now * 1e6) as i64)
}

/// Moves every byte of `s`'s receive buffer not read yet to `held`, where `recv` finds it first:
/// for a socket that is about to lose its buffer (TIME-WAIT's end, or a SYN ending it).
fn take_unread(s: &mut tcp::Socket, held: &mut VecDeque<u8>) {
    while s
        .recv(|b| {
            held.extend(b.iter());
            (b.len(), b.len())
        })
        .is_ok_and(|n| n > 0)
    {}
}

fn state_has_remote_fin(s: tcp::State) -> bool {
    matches!(
        s,
        tcp::State::CloseWait | tcp::State::LastAck | tcp::State::Closing | tcp::State::TimeWait
    )
}

/// A socket whose handle was released, finishing a graceful close.
#[derive(Debug, Clone, Copy)]
struct Orphan {
    socket: SocketHandle,
    /// When it last made progress (released, or a queued byte acknowledged).
    since: f64,
    send_queue: usize,
}

impl Orphan {
    fn new(socket: SocketHandle, now: f64) -> Self {
        Orphan {
            socket,
            since: now,
            send_queue: usize::MAX,
        }
    }
}

fn check_one_per_family(addrs: &[Prefix]) -> Result<(), StackError> {
    let v4 = addrs.iter().filter(|p| p.is_ipv4()).count();
    if v4 > 1 || addrs.len() - v4 > 1 {
        return Err(StackError::TooManyAddresses(addrs.len()));
    }
    Ok(())
}

pub struct Stack {
    iface: Interface,
    pub device: VirtualDevice,
    sockets: SocketSet<'static>,
    buffer_size: usize,
    conns: HashMap<u64, Conn>,
    listeners: HashMap<u64, Listener>,
    listener_by_port: HashMap<u16, u64>,
    /// Sockets whose handle was released but which still finish a graceful close, with the
    /// time of their last progress and their send queue then.
    orphans: Vec<Orphan>,
    next_id: u64,
    next_port: u16,
    events: Vec<TcpEvent>,
    now: f64,
    /// The node's own tailnet addresses (at most one per family), first on the interface so
    /// that they are the source of every connection the node opens.
    own: Vec<Prefix>,
    /// Shared host addresses the node answers as its own (`set_shared`), after `own`.
    shared: Vec<Prefix>,
}

impl Stack {
    pub fn new(buffer_size: usize, now: f64) -> Self {
        let mut device = VirtualDevice::default();
        let mut config = Config::new(HardwareAddress::Ip);
        config.random_seed = random_seed();
        let iface = Interface::new(config, &mut device, to_instant(now));
        Stack {
            iface,
            device,
            sockets: SocketSet::new(Vec::new()),
            buffer_size,
            conns: HashMap::new(),
            listeners: HashMap::new(),
            listener_by_port: HashMap::new(),
            orphans: Vec::new(),
            next_id: 1,
            next_port: EPHEMERAL_FIRST + (random_seed() % 16384) as u16,
            events: Vec::new(),
            now,
            own: Vec::new(),
            shared: Vec::new(),
        }
    }

    /// Sets the node's addresses (at most one IPv4 and one IPv6) and default routes via them.
    /// Connections bound to an address the node no longer has are reset (the node re-joined
    /// with new addresses; nothing would reach them again).
    pub fn set_addresses(&mut self, addrs: &[Prefix]) -> Result<(), StackError> {
        check_one_per_family(addrs)?;
        self.own = addrs.to_vec();
        self.apply_addresses();
        let routes = self.iface.routes_mut();
        routes.remove_default_ipv4_route();
        routes.remove_default_ipv6_route();
        for p in addrs {
            // The table holds two routes; one per family fits.
            let _ = match p.addr() {
                IpAddr::V4(a) => routes.add_default_ipv4_route(a).map(|_| ()),
                IpAddr::V6(a) => routes.add_default_ipv6_route(a).map(|_| ()),
            };
        }
        self.abort_unbound();
        Ok(())
    }

    /// Sets the shared host addresses (at most one IPv4 and one IPv6) this node answers as its
    /// own besides its tailnet addresses: an address several nodes advertise as a route, which
    /// control sends to one of them at a time. Listeners accept on them; connections the node
    /// opens keep its own addresses as their source. Connections to a removed one are reset.
    pub fn set_shared(&mut self, addrs: &[Prefix]) -> Result<(), StackError> {
        check_one_per_family(addrs)?;
        self.shared = addrs.to_vec();
        self.apply_addresses();
        self.abort_unbound();
        Ok(())
    }

    fn apply_addresses(&mut self) {
        let all: Vec<Prefix> = self.own.iter().chain(self.shared.iter()).copied().collect();
        self.iface.update_ip_addrs(|a| {
            a.clear();
            for p in &all {
                // Capacity is 4 (Cargo.toml) and each list has at most one address per family.
                let _ = a.push(IpCidr::new(IpAddress::from(p.addr()), p.prefix_len()));
            }
        });
    }

    /// Resets the connections bound to an address the interface no longer has.
    fn abort_unbound(&mut self) {
        for conn in self.conns.values() {
            let s = self.sockets.get_mut::<tcp::Socket>(conn.socket);
            if let Some(local) = s.local_endpoint() {
                let ip = IpAddr::from(local.addr);
                if !self.own.iter().chain(self.shared.iter()).any(|p| p.addr() == ip) {
                    s.abort();
                }
            }
        }
    }

    pub fn is_local(&self, ip: IpAddr) -> bool {
        self.iface.ip_addrs().iter().any(|c| IpAddr::from(c.address()) == ip)
    }

    fn new_socket(&self) -> tcp::Socket<'static> {
        let mut s = tcp::Socket::new(
            tcp::SocketBuffer::new(vec![0u8; self.buffer_size]),
            tcp::SocketBuffer::new(vec![0u8; self.buffer_size]),
        );
        s.set_nagle_enabled(false);
        // Without congestion control smoltcp sends the whole window at once; a DERP server
        // queues only 32 packets per client and drops the rest, so the sender must ramp up.
        s.set_congestion_control(tcp::CongestionControl::Cubic);
        s.set_keep_alive(Some(Duration::from_secs(25)));
        // Received segments past a hole are kept in up to RECEIVE_HOLES ranges (Cargo.toml's
        // assembler feature); a segment that would need one more is dropped and must be sent again.
        // Drop connections whose peer stops acknowledging for this long.
        s.set_timeout(Some(Duration::from_secs(120)));
        s
    }

    fn alloc_id(&mut self) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        id
    }

    fn ports_in_use(&self) -> HashSet<u16> {
        self.sockets
            .iter()
            .filter_map(|(_, s)| match s {
                smoltcp::socket::Socket::Tcp(t) => t.local_endpoint().map(|e| e.port),
                #[allow(unreachable_patterns)]
                _ => None,
            })
            .collect()
    }

    /// The port the next dial tries first (tests: a dial that reuses an earlier one's port).
    #[cfg(test)]
    pub(crate) fn set_next_port(&mut self, port: u16) {
        self.next_port = port;
    }

    fn ephemeral_port(&mut self) -> Option<u16> {
        let used = self.ports_in_use();
        let span = u32::from(u16::MAX - EPHEMERAL_FIRST) + 1;
        for _ in 0..span {
            let p = self.next_port;
            self.next_port = if p == u16::MAX { EPHEMERAL_FIRST } else { p + 1 };
            if !used.contains(&p) && !self.listener_by_port.contains_key(&p) {
                return Some(p);
            }
        }
        None
    }

    /// Starts a connection. Failures are reported as a DialFailed event on the next poll,
    /// so the caller always gets a handle. `failure` pre-fails the dial (e.g. no route).
    pub fn connect(&mut self, dst: SocketAddr, timeout: f64, failure: Option<String>) -> u64 {
        let id = self.alloc_id();
        let fail = |stack: &mut Stack, reason: String| {
            stack.events.push(TcpEvent::DialFailed { handle: id, reason });
            id
        };
        if let Some(reason) = failure {
            return fail(self, reason);
        }
        if dst.port() == 0 || dst.ip().is_unspecified() {
            return fail(self, format!("invalid destination {dst}"));
        }
        let has_family = self
            .iface
            .ip_addrs()
            .iter()
            .any(|c| IpAddr::from(c.address()).is_ipv4() == dst.is_ipv4());
        if !has_family {
            return fail(self, StackError::NoLocalAddress(dst.ip()).to_string());
        }
        let Some(port) = self.ephemeral_port() else {
            return fail(self, "no free ephemeral port".to_string());
        };
        let mut socket = self.new_socket();
        let remote = IpEndpoint::new(IpAddress::from(dst.ip()), dst.port());
        if let Err(e) = socket.connect(self.iface.context(), remote, port) {
            return fail(self, format!("connect to {dst} failed: {e}"));
        }
        let state = socket.state();
        let handle = self.sockets.add(socket);
        let mut conn = Conn::new(handle, state);
        conn.dial_timeout = Some(timeout);
        self.conns.insert(id, conn);
        id
    }

    pub fn listen(&mut self, port: u16) -> Result<u64, StackError> {
        if port == 0 {
            return Err(StackError::InvalidPort(port));
        }
        if self.listener_by_port.contains_key(&port) {
            return Err(StackError::PortInUse(port));
        }
        let id = self.alloc_id();
        self.listeners.insert(
            id,
            Listener {
                port,
                half_open: Vec::new(),
            },
        );
        self.listener_by_port.insert(port, id);
        Ok(id)
    }

    /// Stops listening; half-open connections are reset, accepted ones are unaffected.
    pub fn unlisten(&mut self, listener: u64) -> Result<(), StackError> {
        let l = self
            .listeners
            .remove(&listener)
            .ok_or(StackError::UnknownListener(listener))?;
        self.listener_by_port.remove(&l.port);
        for s in l.half_open {
            self.sockets.get_mut::<tcp::Socket>(s).abort();
            self.orphans.push(Orphan::new(s, self.now));
        }
        Ok(())
    }

    /// Called for each inbound SYN just before it is fed to smoltcp: makes sure a
    /// listening socket is there to take it.
    pub fn prepare_syn(&mut self, info: &PacketInfo) -> SynDisposition {
        let Some(&lid) = self.listener_by_port.get(&info.dst_port) else {
            return SynDisposition::Feed;
        };
        let remote = IpEndpoint::new(IpAddress::from(info.src), info.src_port);
        let local = IpEndpoint::new(IpAddress::from(info.dst), info.dst_port);
        self.end_time_wait(local, remote);
        let listener = &self.listeners[&lid];
        let retransmit = listener.half_open.iter().any(|&h| {
            let s = self.sockets.get::<tcp::Socket>(h);
            s.is_listening() || s.remote_endpoint() == Some(remote)
        });
        if retransmit {
            return SynDisposition::Feed;
        }
        if listener.half_open.len() >= LISTEN_BACKLOG {
            return SynDisposition::BacklogFull;
        }
        let mut socket = self.new_socket();
        let port = listener.port;
        if socket.listen(port).is_err() {
            return SynDisposition::Feed;
        }
        let handle = self.sockets.add(socket);
        if let Some(l) = self.listeners.get_mut(&lid) {
            l.half_open.push(handle);
        }
        SynDisposition::Feed
    }

    /// A SYN has come for `local`/`remote` while a socket of an earlier connection between them
    /// is in TIME-WAIT: the peer reuses a source port this stack closed first (a backend that
    /// closes first makes every accepted connection end here, for 10 s). smoltcp hands the SYN to
    /// the first socket whose 4-tuple matches and a socket in TIME-WAIT drops a segment without
    /// an ACK, so the peer's SYN and its retransmissions (1 s, 3 s: a userspace tailscaled's
    /// netstack picks its ports at random) were lost until TIME-WAIT ran out: a new connection
    /// hung for seconds about once every few hundred at 50 a second.
    ///
    /// The old connection is over on both sides (its FINs were exchanged and acknowledged; a
    /// socket still holding unread bytes keeps them in its `Conn`), so, as RFC 1122 4.2.2.13 and
    /// RFC 6191 let a TIME-WAIT accept a new SYN, the socket is dropped without a segment and the
    /// listener takes the SYN. What TIME-WAIT guards against, a delayed duplicate of the old
    /// connection, cannot be told apart by sequence number here, but cannot reach us through
    /// WireGuard's replay window either, and a delayed old SYN cannot arrive after that
    /// connection's FINs.
    fn end_time_wait(&mut self, local: IpEndpoint, remote: IpEndpoint) {
        let matches = |s: &tcp::Socket| {
            s.state() == tcp::State::TimeWait
                && s.local_endpoint() == Some(local)
                && s.remote_endpoint() == Some(remote)
        };
        if let Some(i) = self
            .orphans
            .iter()
            .position(|o| matches(self.sockets.get::<tcp::Socket>(o.socket)))
        {
            let orphan = self.orphans.swap_remove(i);
            self.sockets.remove(orphan.socket);
            return;
        }
        let held = self
            .conns
            .values()
            .find(|c| matches(self.sockets.get::<tcp::Socket>(c.socket)))
            .map(|c| c.socket);
        if let Some(old) = held {
            // A connection whose reader has not taken everything yet: its bytes are in `held`
            // and its FIN in `fin_seen`; it goes on with a socket that never opens (no buffers).
            let fresh = self.sockets.add(tcp::Socket::new(
                tcp::SocketBuffer::new(Vec::new()),
                tcp::SocketBuffer::new(Vec::new()),
            ));
            let s = self.sockets.get_mut::<tcp::Socket>(old);
            if let Some(conn) = self.conns.values_mut().find(|c| c.socket == old) {
                take_unread(s, &mut conn.held);
                conn.fin_seen = true;
                conn.socket = fresh;
            }
            self.sockets.remove(old);
        }
    }

    /// Feeds one inbound IP packet to smoltcp right away.
    pub fn ingress(&mut self, packet: Vec<u8>) {
        self.device.rx.push_back(packet);
        let now = to_instant(self.now);
        while self.device.rx.front().is_some() {
            self.iface.poll_ingress_single(now, &mut self.device, &mut self.sockets);
        }
    }

    /// Drops a listener socket that was created for a SYN smoltcp did not take.
    fn reap_idle_listeners(&mut self) {
        for l in self.listeners.values_mut() {
            let sockets = &mut self.sockets;
            l.half_open.retain(|&h| {
                let s = sockets.get::<tcp::Socket>(h);
                if s.is_listening() || s.state() == tcp::State::Closed {
                    sockets.remove(h);
                    false
                } else {
                    true
                }
            });
        }
    }

    /// Sets the clock; call before ingress for the current batch.
    pub fn set_now(&mut self, now: f64) {
        self.now = now;
    }

    /// Runs egress (and timers) and scans sockets for events.
    pub fn poll(&mut self, now: f64) {
        self.now = now;
        let instant = to_instant(now);
        self.iface.poll_maintenance(instant);
        self.iface.poll(instant, &mut self.device, &mut self.sockets);
        self.reap_idle_listeners();
        self.scan(now);
    }

    fn scan(&mut self, now: f64) {
        // Half-open sockets that completed the handshake become accepted connections.
        let mut accepted = Vec::new();
        for (&lid, l) in self.listeners.iter_mut() {
            let sockets = &self.sockets;
            l.half_open.retain(|&h| {
                let s = sockets.get::<tcp::Socket>(h);
                let done = !matches!(
                    s.state(),
                    tcp::State::Listen | tcp::State::SynReceived | tcp::State::Closed
                );
                if done {
                    accepted.push((lid, h));
                }
                !done
            });
        }
        for (lid, h) in accepted {
            let id = self.alloc_id();
            let s = self.sockets.get::<tcp::Socket>(h);
            let remote = s
                .remote_endpoint()
                .map(|e| SocketAddr::new(IpAddr::from(e.addr), e.port))
                .unwrap_or_else(|| SocketAddr::new(IpAddr::from([0, 0, 0, 0]), 0));
            let mut conn = Conn::new(h, s.state());
            conn.connected = true;
            self.conns.insert(id, conn);
            self.events.push(TcpEvent::Accepted {
                listener: lid,
                handle: id,
                remote,
            });
        }

        let mut released = Vec::new();
        for (&id, conn) in self.conns.iter_mut() {
            let s = self.sockets.get_mut::<tcp::Socket>(conn.socket);
            let state = s.state();
            if !conn.connected {
                if conn.deadline.is_none() {
                    conn.deadline = conn.dial_timeout.map(|t| now + t);
                }
                match state {
                    tcp::State::SynSent | tcp::State::SynReceived => {
                        if conn.deadline.is_some_and(|d| now >= d) {
                            s.abort();
                            self.events.push(TcpEvent::DialFailed {
                                handle: id,
                                reason: "connection timed out".to_string(),
                            });
                            released.push(id);
                        }
                        continue;
                    }
                    tcp::State::Closed => {
                        self.events.push(TcpEvent::DialFailed {
                            handle: id,
                            reason: "connection refused (reset by peer)".to_string(),
                        });
                        released.push(id);
                        continue;
                    }
                    _ => {
                        conn.connected = true;
                        conn.deadline = None;
                        if conn.shutdown_pending {
                            s.close();
                        }
                        self.events.push(TcpEvent::Connected(id));
                    }
                }
            }
            let state = s.state();
            conn.fin_seen |=
                state_has_remote_fin(state) || (state == tcp::State::Closed && state_has_remote_fin(conn.last_state));
            if state == tcp::State::TimeWait && s.recv_queue() > 0 {
                // smoltcp resets the socket when TIME-WAIT ends (10 s), clearing what was not
                // read yet: keep it for `recv`, so a slow reader still gets every byte.
                take_unread(s, &mut conn.held);
            }
            let rx_pending = s.recv_queue() > 0 || !conn.held.is_empty();
            if rx_pending && !conn.readable_sent {
                conn.readable_sent = true;
                self.events.push(TcpEvent::Readable(id));
            }
            if conn.want_writable && s.may_send() {
                let free = s.send_capacity() - s.send_queue();
                if free >= s.send_capacity() / 4 {
                    conn.want_writable = false;
                    self.events.push(TcpEvent::Writable(id));
                }
            }
            let remote_fin = conn.fin_seen;
            if state == tcp::State::Closed && !remote_fin && !matches!(conn.last_state, tcp::State::Closed) {
                // Closed without the peer's FIN: reset (or keep-alive/ACK timeout).
                self.events.push(TcpEvent::Reset(id));
                released.push(id);
                continue;
            }
            if remote_fin && !rx_pending && !conn.peer_closed_sent {
                conn.peer_closed_sent = true;
                self.events.push(TcpEvent::PeerClosed(id));
            }
            if matches!(state, tcp::State::TimeWait | tcp::State::Closed) && conn.peer_closed_sent {
                self.events.push(TcpEvent::Closed(id));
                released.push(id);
                continue;
            }
            conn.last_state = state;
        }
        for id in released {
            if let Some(conn) = self.conns.remove(&id) {
                self.orphans.push(Orphan::new(conn.socket, now));
            }
        }
        // Orphans: discard data that still arrives, abort them after a linger without
        // progress (a peer slower than the linger still gets every byte), drop them once closed.
        let sockets = &mut self.sockets;
        self.orphans.retain_mut(|o| {
            let s = sockets.get_mut::<tcp::Socket>(o.socket);
            while s.recv(|b| (b.len(), ())).is_ok_and(|()| s.recv_queue() > 0) {}
            if s.send_queue() < o.send_queue {
                if o.send_queue != usize::MAX {
                    o.since = now;
                }
                o.send_queue = s.send_queue();
            }
            if now - o.since > ORPHAN_LINGER_SECS && s.state() != tcp::State::Closed {
                s.abort();
                o.since = now; // removed after the next poll, which sends the RST
            }
            if s.state() == tcp::State::Closed && o.since < now {
                sockets.remove(o.socket);
                false
            } else {
                true
            }
        });
    }

    pub fn take_events(&mut self) -> Vec<TcpEvent> {
        std::mem::take(&mut self.events)
    }

    fn conn(&mut self, id: u64) -> Result<(&mut Conn, &mut tcp::Socket<'static>), StackError> {
        let conn = self.conns.get_mut(&id).ok_or(StackError::UnknownHandle(id))?;
        let s = self.sockets.get_mut::<tcp::Socket>(conn.socket);
        Ok((conn, s))
    }

    /// Queues bytes; returns how many were accepted (0 while connecting or when full).
    pub fn send(&mut self, id: u64, data: &[u8]) -> Result<usize, StackError> {
        let (conn, s) = self.conn(id)?;
        if conn.shutdown_pending || (conn.connected && !s.may_send()) {
            return Err(StackError::WriteClosed(id));
        }
        let n = if s.may_send() {
            s.send_slice(data).unwrap_or(0)
        } else {
            0
        };
        if n < data.len() {
            conn.want_writable = true;
        }
        Ok(n)
    }

    /// Reads up to `max` bytes; empty when nothing is buffered (see PeerClosed for EOF).
    pub fn recv(&mut self, id: u64, max: usize) -> Result<Vec<u8>, StackError> {
        let (conn, s) = self.conn(id)?;
        conn.readable_sent = false;
        let held = max.min(conn.held.len());
        let mut out: Vec<u8> = conn.held.drain(..held).collect();
        if held == max || !s.may_recv() {
            return Ok(out);
        }
        let want = held + (max - held).min(s.recv_queue());
        out.resize(want, 0);
        let mut got = held;
        while got < want {
            match s.recv_slice(&mut out[got..]) {
                Ok(0) | Err(_) => break,
                Ok(n) => got += n,
            }
        }
        out.truncate(got);
        Ok(out)
    }

    /// Half-close: sends FIN after queued data; reading continues.
    pub fn shutdown_write(&mut self, id: u64) -> Result<(), StackError> {
        let (conn, s) = self.conn(id)?;
        if conn.connected {
            s.close();
            conn.last_state = s.state();
        } else {
            conn.shutdown_pending = true;
        }
        Ok(())
    }

    /// Releases the handle. Sends FIN (graceful) if all received data was read,
    /// otherwise RST like a kernel does. Unknown handles are ignored.
    pub fn close(&mut self, id: u64) {
        if let Some(conn) = self.conns.remove(&id) {
            let s = self.sockets.get_mut::<tcp::Socket>(conn.socket);
            if s.recv_queue() > 0 || !conn.held.is_empty() || !conn.connected {
                s.abort();
            } else {
                s.close();
            }
            self.orphans.push(Orphan::new(conn.socket, self.now));
        }
    }

    /// Releases the handle and resets the connection. Unknown handles are ignored.
    pub fn abort(&mut self, id: u64) {
        if let Some(conn) = self.conns.remove(&id) {
            self.sockets.get_mut::<tcp::Socket>(conn.socket).abort();
            self.orphans.push(Orphan::new(conn.socket, self.now));
        }
    }

    /// Earliest time smoltcp or a dial deadline needs a poll.
    pub fn next_deadline(&mut self, now: f64) -> Option<f64> {
        let smol = self
            .iface
            .poll_at(to_instant(now), &self.sockets)
            .map(|at| (at.total_micros() as f64 / 1e6).max(now));
        let dial = self.conns.values().filter_map(|c| c.deadline).reduce(f64::min);
        let linger = self
            .orphans
            .iter()
            .map(|o| o.since + ORPHAN_LINGER_SECS)
            .reduce(f64::min);
        [smol, dial, linger].into_iter().flatten().reduce(f64::min)
    }

    /// The TCP state of a connection (None: unknown handle); for tests and diagnostics.
    pub fn state_of(&self, id: u64) -> Option<tcp::State> {
        let conn = self.conns.get(&id)?;
        Some(self.sockets.get::<tcp::Socket>(conn.socket).state())
    }

    pub fn connection_count(&self) -> usize {
        self.conns.len()
    }

    /// Local and remote address of a connection.
    pub fn endpoints(&mut self, id: u64) -> Result<(Option<SocketAddr>, Option<SocketAddr>), StackError> {
        let (_, s) = self.conn(id)?;
        let conv = |e: IpEndpoint| SocketAddr::new(IpAddr::from(e.addr), e.port);
        Ok((s.local_endpoint().map(conv), s.remote_endpoint().map(conv)))
    }
}

fn random_seed() -> u64 {
    use std::hash::{BuildHasher, RandomState};
    RandomState::new().hash_one(std::time::SystemTime::now())
}

/// Holes the receive side of a connection can hold data past (smoltcp's assembler, sized by the
/// `assembler-max-segment-count-32` feature). A DERP relay that overflows its 32-packet queue
/// drops runs of a burst, each run a hole. With smoltcp's default of 4, segments past the fourth
/// hole were dropped on arrival, and a sender that recovers one hole per timeout (the gVisor
/// stack of tailscale 1.80) slowed to a few packets a minute (e2e/test_interop.py, DERP path).
pub const RECEIVE_HOLES: usize = 32;

#[cfg(test)]
mod tests {
    use super::RECEIVE_HOLES;
    use smoltcp::storage::Assembler;

    #[test]
    fn received_data_is_kept_past_as_many_holes_as_a_derp_queue_can_cause() {
        let mut assembler = Assembler::new();
        // Every other segment of a burst lost: a hole before each one that arrived.
        for i in 0..RECEIVE_HOLES {
            assembler.add(2 * i + 1, 1).expect("room for this hole");
        }
        assert!(
            assembler.add(2 * RECEIVE_HOLES + 1, 1).is_err(),
            "one more hole than RECEIVE_HOLES"
        );
        // Resending the holes in order delivers everything: each fills one hole and releases the
        // segment after it.
        for _ in 0..RECEIVE_HOLES {
            assert_eq!(assembler.add_then_remove_front(0, 1).expect("the front always fits"), 2);
        }
        assert!(assembler.is_empty());
    }
}
