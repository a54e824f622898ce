//! Batched sends and receives on the caller's UDP socket.
//!
//! WireGuard datagrams to one peer are mostly the same size (full-MTU data packets). With
//! UDP generic segmentation offload (Linux `UDP_SEGMENT`), a run of them to one address goes
//! to the kernel in one `sendmsg` that names the segment size: one syscall and one pass through
//! the UDP stack instead of one per datagram, as tailscaled does. Where the kernel refuses
//! GSO, sends fall back to one `sendto` per datagram for the rest of the socket's life.
//!
//! Receiving is the mirror image: with `UDP_GRO` enabled on the socket (the caller does that),
//! one `recvmsg` may return several datagrams of one sender coalesced, with their segment size
//! in a control message; [`receive`] splits them again.

use std::collections::VecDeque;
use std::io;
use std::mem;
use std::net::SocketAddr;

/// Segments per GSO send (the kernel allows 64).
pub const MAX_SEGMENTS: usize = 64;
/// Bytes per GSO send: the largest UDP payload.
const MAX_GSO_BYTES: usize = 65_507;
const UDP_SEGMENT: libc::c_int = 103;
const UDP_GRO: libc::c_int = 104;
/// Receive buffer: the largest coalesced read.
pub const RECV_BUFFER: usize = 65_536;

/// What a batch of sends did.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Sent {
    /// Datagrams handed to the kernel.
    pub datagrams: usize,
    /// Syscalls used.
    pub calls: usize,
}

fn sockaddr(addr: &SocketAddr) -> (libc::sockaddr_storage, libc::socklen_t) {
    // SAFETY: sockaddr_storage is plain old data, valid when zeroed, and large enough for
    // either address family; the family-specific views below stay within it.
    let mut storage: libc::sockaddr_storage = unsafe { mem::zeroed() };
    let len = match addr {
        SocketAddr::V4(v4) => {
            let sin = unsafe { &mut *(&mut storage as *mut _ as *mut libc::sockaddr_in) };
            sin.sin_family = libc::AF_INET as libc::sa_family_t;
            sin.sin_port = v4.port().to_be();
            sin.sin_addr = libc::in_addr {
                s_addr: u32::from_ne_bytes(v4.ip().octets()),
            };
            mem::size_of::<libc::sockaddr_in>()
        }
        SocketAddr::V6(v6) => {
            let sin6 = unsafe { &mut *(&mut storage as *mut _ as *mut libc::sockaddr_in6) };
            sin6.sin6_family = libc::AF_INET6 as libc::sa_family_t;
            sin6.sin6_port = v6.port().to_be();
            sin6.sin6_addr = libc::in6_addr {
                s6_addr: v6.ip().octets(),
            };
            sin6.sin6_flowinfo = v6.flowinfo();
            sin6.sin6_scope_id = v6.scope_id();
            mem::size_of::<libc::sockaddr_in6>()
        }
    };
    (storage, len as libc::socklen_t)
}

fn socket_addr(storage: &libc::sockaddr_storage) -> Option<SocketAddr> {
    match storage.ss_family as libc::c_int {
        libc::AF_INET => {
            // SAFETY: the kernel wrote a sockaddr_in for AF_INET.
            let sin = unsafe { &*(storage as *const _ as *const libc::sockaddr_in) };
            let ip = std::net::Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr));
            Some(SocketAddr::new(ip.into(), u16::from_be(sin.sin_port)))
        }
        libc::AF_INET6 => {
            // SAFETY: the kernel wrote a sockaddr_in6 for AF_INET6.
            let sin6 = unsafe { &*(storage as *const _ as *const libc::sockaddr_in6) };
            let ip = std::net::Ipv6Addr::from(sin6.sin6_addr.s6_addr);
            let ip = ip
                .to_ipv4_mapped()
                .map_or(std::net::IpAddr::V6(ip), std::net::IpAddr::V4);
            Some(SocketAddr::new(ip, u16::from_be(sin6.sin6_port)))
        }
        _ => None,
    }
}

/// Reads up to `max` `recvmsg`s from the non-blocking socket `fd` into `buf` (at least
/// [`RECV_BUFFER`] bytes), calling `feed` once per datagram (coalesced reads split by their GRO
/// segment size). Returns the datagrams fed. Errors other than "would block" end the batch;
/// ICMP errors reported for earlier sends are skipped.
pub fn receive(fd: i32, buf: &mut [u8], max: usize, mut feed: impl FnMut(SocketAddr, &[u8])) -> usize {
    let mut fed = 0;
    for _ in 0..max {
        // SAFETY: as in send_msg: plain old data, pointers into locals that outlive the call.
        let mut addr: libc::sockaddr_storage = unsafe { mem::zeroed() };
        let mut iov = libc::iovec {
            iov_base: buf.as_mut_ptr() as *mut libc::c_void,
            iov_len: buf.len(),
        };
        let mut control = [0u64; 8];
        let mut msg: libc::msghdr = unsafe { mem::zeroed() };
        msg.msg_name = &mut addr as *mut _ as *mut libc::c_void;
        msg.msg_namelen = mem::size_of::<libc::sockaddr_storage>() as libc::socklen_t;
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = control.as_mut_ptr() as *mut libc::c_void;
        msg.msg_controllen = mem::size_of_val(&control) as _;
        let n = unsafe { libc::recvmsg(fd, &mut msg, 0) };
        if n < 0 {
            let e = io::Error::last_os_error();
            match e.kind() {
                io::ErrorKind::Interrupted => continue,
                io::ErrorKind::WouldBlock => break,
                _ if e.raw_os_error() == Some(libc::ECONNREFUSED) => continue,
                _ => break,
            }
        }
        let len = n as usize;
        let Some(src) = socket_addr(&addr) else { continue };
        let mut segment = len;
        // SAFETY: walking the control messages the kernel wrote into `control`.
        unsafe {
            let mut cmsg = libc::CMSG_FIRSTHDR(&msg);
            while !cmsg.is_null() {
                if (*cmsg).cmsg_level == libc::SOL_UDP && (*cmsg).cmsg_type == UDP_GRO {
                    let size = std::ptr::read_unaligned(libc::CMSG_DATA(cmsg) as *const libc::c_int);
                    if size > 0 {
                        segment = size as usize;
                    }
                }
                cmsg = libc::CMSG_NXTHDR(&msg, cmsg);
            }
        }
        for datagram in buf[..len].chunks(segment.max(1)) {
            feed(src, datagram);
            fed += 1;
        }
    }
    fed
}

/// The address family of the socket `fd` (`AF_INET`, or `AF_INET6` for a dual-stack one).
fn socket_family(fd: i32) -> libc::c_int {
    let mut family: libc::c_int = libc::AF_INET;
    let mut len = mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: SO_DOMAIN writes one c_int into `family`, whose size `len` gives.
    unsafe {
        libc::getsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_DOMAIN,
            &mut family as *mut _ as *mut libc::c_void,
            &mut len,
        );
    }
    family
}

/// `dst` as a socket of `family` names it: an IPv4 address is IPv4-mapped on a dual-stack
/// (`AF_INET6`) socket, which refuses a `sockaddr_in`.
fn on_family(dst: &SocketAddr, family: libc::c_int) -> SocketAddr {
    match dst {
        SocketAddr::V4(v4) if family == libc::AF_INET6 => SocketAddr::new(v4.ip().to_ipv6_mapped().into(), v4.port()),
        _ => *dst,
    }
}

/// One `sendmsg` of `datagrams` to `dst`; with `segment` set, as GSO segments of that size.
fn send_msg(fd: i32, dst: &SocketAddr, datagrams: &[&[u8]], segment: Option<u16>) -> io::Result<()> {
    let (mut addr, addr_len) = sockaddr(dst);
    let mut iov: Vec<libc::iovec> = datagrams
        .iter()
        .map(|d| libc::iovec {
            iov_base: d.as_ptr() as *mut libc::c_void,
            iov_len: d.len(),
        })
        .collect();
    // Room for one cmsghdr carrying a u16, aligned as CMSG_SPACE requires.
    let mut control = [0u64; 4];
    // SAFETY: msghdr is plain old data; every pointer in it refers to locals that outlive the
    // sendmsg call, with lengths that match.
    let mut msg: libc::msghdr = unsafe { mem::zeroed() };
    msg.msg_name = &mut addr as *mut _ as *mut libc::c_void;
    msg.msg_namelen = addr_len;
    msg.msg_iov = iov.as_mut_ptr();
    msg.msg_iovlen = iov.len() as _;
    if let Some(size) = segment {
        unsafe {
            let space = libc::CMSG_SPACE(mem::size_of::<u16>() as u32) as usize;
            msg.msg_control = control.as_mut_ptr() as *mut libc::c_void;
            msg.msg_controllen = space as _;
            let cmsg = libc::CMSG_FIRSTHDR(&msg);
            (*cmsg).cmsg_level = libc::SOL_UDP;
            (*cmsg).cmsg_type = UDP_SEGMENT;
            (*cmsg).cmsg_len = libc::CMSG_LEN(mem::size_of::<u16>() as u32) as _;
            std::ptr::write_unaligned(libc::CMSG_DATA(cmsg) as *mut u16, size);
        }
    }
    // SAFETY: fd is the caller's open socket; msg is fully initialised above.
    let n = unsafe { libc::sendmsg(fd, &msg, 0) };
    if n < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// How many datagrams from the front of `queue` can go in one GSO send: same address, same
/// size, except that the last may be shorter.
fn gso_run(queue: &VecDeque<(SocketAddr, Vec<u8>)>) -> usize {
    let Some((dst, first)) = queue.front() else { return 0 };
    let size = first.len();
    let (mut n, mut total) = (0, 0);
    for (d, p) in queue {
        if d != dst || p.len() > size || n == MAX_SEGMENTS || total + p.len() > MAX_GSO_BYTES {
            break;
        }
        n += 1;
        total += p.len();
        if p.len() < size {
            break;
        }
    }
    n
}

fn gso_unsupported(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EIO | libc::EINVAL | libc::ENOPROTOOPT | libc::EOPNOTSUPP)
    )
}

/// Sends from the front of `queue` until it is empty or the socket would block. `gso` is
/// cleared when the kernel refuses segmentation offload. Other send errors (an unreachable
/// address) lose those datagrams only.
pub fn send_queue(fd: i32, queue: &mut VecDeque<(SocketAddr, Vec<u8>)>, gso: &mut bool) -> Sent {
    let mut sent = Sent::default();
    let family = socket_family(fd);
    while let Some((dst, first)) = queue.front() {
        let run = if *gso { gso_run(queue) } else { 1 };
        let dst = on_family(dst, family);
        let result = if run > 1 {
            let datagrams: Vec<&[u8]> = queue.iter().take(run).map(|(_, p)| p.as_slice()).collect();
            send_msg(fd, &dst, &datagrams, Some(first.len() as u16))
        } else {
            send_msg(fd, &dst, &[first.as_slice()], None)
        };
        sent.calls += 1;
        match result {
            Ok(()) => sent.datagrams += run,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) if run > 1 && gso_unsupported(&e) => {
                *gso = false;
                continue;
            }
            Err(_) => {}
        }
        queue.drain(..run);
    }
    sent
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::UdpSocket;
    use std::os::fd::AsRawFd;

    #[test]
    fn coalesced_receives_are_split_into_the_datagrams_sent() {
        let rx = UdpSocket::bind("127.0.0.1:0").unwrap();
        rx.set_nonblocking(true).unwrap();
        let one: libc::c_int = 1;
        // SAFETY: setsockopt with a pointer to a live c_int of the right length.
        let gro = unsafe {
            libc::setsockopt(
                rx.as_raw_fd(),
                libc::SOL_UDP,
                UDP_GRO,
                &one as *const _ as *const libc::c_void,
                4,
            )
        };
        let tx = UdpSocket::bind("127.0.0.1:0").unwrap();
        let dst = rx.local_addr().unwrap();
        let sizes = [1312, 1312, 1312, 500];
        let mut q: VecDeque<_> = sizes
            .iter()
            .enumerate()
            .map(|(i, &n)| (dst, vec![i as u8; n]))
            .collect();
        send_queue(tx.as_raw_fd(), &mut q, &mut true);
        let mut buf = vec![0u8; RECV_BUFFER];
        let mut got = Vec::new();
        let from = tx.local_addr().unwrap();
        let fed = receive(rx.as_raw_fd(), &mut buf, 16, |src, d| {
            assert_eq!(src, from);
            got.push(d.to_vec());
        });
        assert_eq!(fed, sizes.len(), "GRO enabled: {}", gro == 0);
        for (i, d) in got.iter().enumerate() {
            assert_eq!(d.len(), sizes[i]);
            assert!(d.iter().all(|&b| b == i as u8));
        }
        assert_eq!(
            receive(rx.as_raw_fd(), &mut buf, 16, |_, _| {}),
            0,
            "nothing left; would block"
        );
    }

    #[test]
    fn runs_group_same_size_datagrams_to_one_address() {
        let a: SocketAddr = "127.0.0.1:1".parse().unwrap();
        let b: SocketAddr = "127.0.0.1:2".parse().unwrap();
        let q: VecDeque<_> = [
            (a, vec![0; 100]),
            (a, vec![0; 100]),
            (a, vec![0; 40]),
            (a, vec![0; 100]),
        ]
        .into();
        assert_eq!(gso_run(&q), 3, "a shorter datagram ends the run");
        let q: VecDeque<_> = [(a, vec![0; 100]), (b, vec![0; 100])].into();
        assert_eq!(gso_run(&q), 1);
        let q: VecDeque<_> = [(a, vec![0; 10]), (a, vec![0; 100])].into();
        assert_eq!(gso_run(&q), 1, "a longer datagram cannot follow");
        let q: VecDeque<_> = (0..100).map(|_| (a, vec![0; 1312])).collect();
        assert_eq!(gso_run(&q), 49, "at most 64 KiB per send");
    }

    #[test]
    fn every_datagram_arrives_whole_with_or_without_gso() {
        for mut gso in [true, false] {
            let rx = UdpSocket::bind("127.0.0.1:0").unwrap();
            let tx = UdpSocket::bind("127.0.0.1:0").unwrap();
            let dst = rx.local_addr().unwrap();
            let sizes = [1312, 1312, 1312, 1312, 700, 1312, 90];
            let mut q: VecDeque<_> = sizes
                .iter()
                .enumerate()
                .map(|(i, &n)| (dst, vec![i as u8; n]))
                .collect();
            let sent = send_queue(tx.as_raw_fd(), &mut q, &mut gso);
            assert!(q.is_empty());
            assert_eq!(sent.datagrams, sizes.len());
            let mut buf = [0u8; 2000];
            for (i, &n) in sizes.iter().enumerate() {
                let (len, _) = rx.recv_from(&mut buf).unwrap();
                assert_eq!(len, n, "datagram {i}");
                assert!(buf[..len].iter().all(|&b| b == i as u8));
            }
            if gso {
                assert_eq!(sent.calls, 2, "two GSO runs, each ended by a shorter datagram");
            }
        }
    }

    #[test]
    fn a_dual_stack_socket_sends_to_and_hears_from_both_families() {
        let dual = UdpSocket::bind("[::]:0").unwrap();
        dual.set_nonblocking(true).unwrap();
        let port = dual.local_addr().unwrap().port();
        let v4 = UdpSocket::bind("127.0.0.1:0").unwrap();
        let v6 = UdpSocket::bind("[::1]:0").unwrap();
        for peer in [&v4, &v6] {
            peer.set_read_timeout(Some(std::time::Duration::from_secs(5))).unwrap();
            let mut queue = VecDeque::from([(peer.local_addr().unwrap(), b"ping".to_vec())]);
            let mut gso = true;
            assert_eq!(send_queue(dual.as_raw_fd(), &mut queue, &mut gso).datagrams, 1);
            let mut buf = [0u8; 16];
            let (n, _) = peer.recv_from(&mut buf).unwrap();
            assert_eq!(&buf[..n], b"ping");
            let back: SocketAddr = if peer.local_addr().unwrap().is_ipv4() {
                format!("127.0.0.1:{port}").parse().unwrap()
            } else {
                format!("[::1]:{port}").parse().unwrap()
            };
            peer.send_to(b"pong", back).unwrap();
            let mut from = Vec::new();
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
            while from.is_empty() && std::time::Instant::now() < deadline {
                let mut rbuf = vec![0u8; RECV_BUFFER];
                receive(dual.as_raw_fd(), &mut rbuf, 4, |src, d| from.push((src, d.to_vec())));
            }
            // An IPv4 sender is seen as IPv4, not as its IPv4-mapped IPv6 form.
            assert_eq!(from, vec![(peer.local_addr().unwrap(), b"pong".to_vec())]);
        }
    }
}
