//! `tailnet_agent._native`: the agent's data plane (WireGuard over DERP, packet filter,
//! userspace TCP) as a sans-IO Python extension.
//!
//! Python feeds DERP bytes and the time; Rust returns DERP bytes to write, events and the
//! next deadline. See `tailnet_agent/_native.pyi` for the Python API.

pub mod dataplane;
pub mod derp;
pub mod filter;
#[cfg(test)]
mod fuzz;
pub mod recovery;
pub mod route;
pub mod stack;
pub mod udp;
pub mod wg;

use std::net::{IpAddr, SocketAddr};

use pyo3::buffer::PyBuffer;
use pyo3::exceptions::{PyBrokenPipeError, PyConnectionError, PyOSError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyTuple};

use crate::dataplane::{parse_key, Error, Event};
use crate::filter::RuleSpec;
use crate::stack::{StackError, TcpEvent, DEFAULT_TCP_BUFFER};

const EADDRINUSE: i32 = 98;

fn to_py_err(e: Error) -> PyErr {
    let msg = e.to_string();
    match e {
        Error::InvalidKey(_) | Error::InvalidArgument(_) => PyValueError::new_err(msg),
        Error::DerpCorrupt { .. } => PyConnectionError::new_err(msg),
        Error::Stack(s) => stack_err(s),
    }
}

fn stack_err(e: StackError) -> PyErr {
    let msg = e.to_string();
    match e {
        StackError::WriteClosed(_) => PyBrokenPipeError::new_err(msg),
        StackError::PortInUse(_) => PyOSError::new_err((EADDRINUSE, msg)),
        _ => PyValueError::new_err(msg),
    }
}

/// Declares a frozen event class with read-only fields, `__match_args__` and a repr.
macro_rules! event_class {
    ($(#[doc = $doc:literal])* $name:ident { $($field:ident : $ty:ty),+ $(,)? }) => {
        $(#[doc = $doc])*
        #[pyclass(frozen, get_all, module = "tailnet_agent._native")]
        pub struct $name {
            $(pub $field: $ty),+
        }

        #[pymethods]
        impl $name {
            #[classattr]
            fn __match_args__(py: Python<'_>) -> PyResult<Py<PyTuple>> {
                Ok(PyTuple::new(py, [$(stringify!($field)),+])?.unbind())
            }

            fn __repr__(slf: &Bound<'_, Self>) -> PyResult<String> {
                let mut parts = Vec::new();
                $(parts.push(format!("{}={}", stringify!($field), slf.getattr(stringify!($field))?.repr()?));)+
                Ok(format!("{}({})", stringify!($name), parts.join(", ")))
            }
        }
    };
}

event_class!(
    /// An outbound connection (tcp_connect) completed its handshake.
    Connected { handle: u64 }
);
event_class!(
    /// Data is waiting; re-armed by each tcp_recv call.
    Readable { handle: u64 }
);
event_class!(
    /// Send buffer space freed up after a short tcp_send.
    Writable { handle: u64 }
);
event_class!(
    /// The peer sent FIN and all data before it has been read (EOF). Writing still works.
    PeerClosed { handle: u64 }
);
event_class!(
    /// Both directions closed gracefully; the handle is released.
    Closed { handle: u64 }
);
event_class!(
    /// The connection was reset (RST or timeout); the handle is released.
    Reset { handle: u64 }
);
event_class!(
    /// A listener accepted a connection; `handle` is new.
    Accepted { listener: u64, handle: u64, remote_ip: String, remote_port: u16 }
);
event_class!(
    /// tcp_connect failed; the handle is released.
    DialFailed { handle: u64, reason: String }
);
event_class!(
    /// DERP PeerGone: `key` is no longer connected to the relay.
    DerpPeerGone { region: u32, key: Py<PyBytes>, reason: u8 }
);
event_class!(
    /// DERP PeerPresent.
    DerpPeerPresent { region: u32, key: Py<PyBytes> }
);
event_class!(
    /// DERP Health message (empty means healthy again).
    DerpHealth { region: u32, message: String }
);
event_class!(
    /// The relay is restarting; reconnect after `reconnect_in_ms`, keep trying for `try_for_ms`.
    DerpRestarting { region: u32, reconnect_in_ms: u32, try_for_ms: u32 }
);
event_class!(
    /// A frame the data plane does not handle (ServerKey, ServerInfo, unknown types).
    DerpFrame { region: u32, frame_type: u8, payload: Py<PyBytes> }
);
event_class!(
    /// A sealed disco message relayed by DERP `region` from the peer `key`.
    DiscoDerp { region: u32, key: Py<PyBytes>, payload: Py<PyBytes> }
);
event_class!(
    /// A sealed disco message from the UDP socket.
    DiscoUdp { src_ip: String, src_port: u16, payload: Py<PyBytes> }
);
event_class!(
    /// A STUN message from the UDP socket (a DERP node's binding response).
    StunUdp { src_ip: String, src_port: u16, payload: Py<PyBytes> }
);

fn event_to_py(py: Python<'_>, event: Event) -> PyResult<Py<PyAny>> {
    let bytes = |b: &[u8]| PyBytes::new(py, b).unbind();
    let obj = match event {
        Event::Tcp(TcpEvent::Connected(handle)) => Py::new(py, Connected { handle })?.into_any(),
        Event::Tcp(TcpEvent::Readable(handle)) => Py::new(py, Readable { handle })?.into_any(),
        Event::Tcp(TcpEvent::Writable(handle)) => Py::new(py, Writable { handle })?.into_any(),
        Event::Tcp(TcpEvent::PeerClosed(handle)) => Py::new(py, PeerClosed { handle })?.into_any(),
        Event::Tcp(TcpEvent::Closed(handle)) => Py::new(py, Closed { handle })?.into_any(),
        Event::Tcp(TcpEvent::Reset(handle)) => Py::new(py, Reset { handle })?.into_any(),
        Event::Tcp(TcpEvent::Accepted {
            listener,
            handle,
            remote,
        }) => Py::new(
            py,
            Accepted {
                listener,
                handle,
                remote_ip: remote.ip().to_string(),
                remote_port: remote.port(),
            },
        )?
        .into_any(),
        Event::Tcp(TcpEvent::DialFailed { handle, reason }) => Py::new(py, DialFailed { handle, reason })?.into_any(),
        Event::DerpPeerGone { region, key, reason } => Py::new(
            py,
            DerpPeerGone {
                region,
                key: bytes(&key),
                reason,
            },
        )?
        .into_any(),
        Event::DerpPeerPresent { region, key } => Py::new(
            py,
            DerpPeerPresent {
                region,
                key: bytes(&key),
            },
        )?
        .into_any(),
        Event::DerpHealth { region, message } => Py::new(py, DerpHealth { region, message })?.into_any(),
        Event::DerpRestarting {
            region,
            reconnect_in_ms,
            try_for_ms,
        } => Py::new(
            py,
            DerpRestarting {
                region,
                reconnect_in_ms,
                try_for_ms,
            },
        )?
        .into_any(),
        Event::DiscoDerp { region, key, payload } => Py::new(
            py,
            DiscoDerp {
                region,
                key: bytes(&key),
                payload: bytes(&payload),
            },
        )?
        .into_any(),
        Event::DiscoUdp { src, payload } => Py::new(
            py,
            DiscoUdp {
                src_ip: src.ip().to_string(),
                src_port: src.port(),
                payload: bytes(&payload),
            },
        )?
        .into_any(),
        Event::StunUdp { src, payload } => Py::new(
            py,
            StunUdp {
                src_ip: src.ip().to_string(),
                src_port: src.port(),
                payload: bytes(&payload),
            },
        )?
        .into_any(),
        Event::DerpFrame {
            region,
            frame_type,
            payload,
        } => Py::new(
            py,
            DerpFrame {
                region,
                frame_type,
                payload: bytes(&payload),
            },
        )?
        .into_any(),
    };
    Ok(obj)
}

/// Result of `DataPlane.poll`.
#[pyclass(frozen, get_all, module = "tailnet_agent._native")]
pub struct PollResult {
    /// `[(region, bytes)]`: one batched buffer per DERP region to write to its relay.
    pub derp_writes: Py<PyList>,
    /// Datagrams queued for the UDP socket; `udp_send` sends them.
    pub udp_pending: usize,
    /// Events in the order they happened.
    pub events: Py<PyList>,
    /// Monotonic time (same clock as `now`) by which `poll` must be called again.
    pub next_deadline: Option<f64>,
    /// Cumulative counters (`packets_in`, `bytes_out`, `drop_filtered`, ...).
    pub counters: Py<PyDict>,
}

#[pymethods]
impl PollResult {
    fn __repr__(&self, py: Python<'_>) -> String {
        format!(
            "PollResult(derp_writes={}, events={}, next_deadline={:?})",
            self.derp_writes.bind(py).len(),
            self.events.bind(py).len(),
            self.next_deadline
        )
    }
}

/// The node's data plane. Not thread-safe: use it from one thread (the event loop).
#[pyclass(module = "tailnet_agent._native")]
pub struct DataPlane {
    inner: dataplane::DataPlane,
    /// UDP segmentation offload still believed to work on the UDP socket.
    gso: bool,
    recv_buf: Vec<u8>,
}

fn parse_ip(s: &str) -> PyResult<IpAddr> {
    s.trim()
        .parse()
        .map_err(|_| PyValueError::new_err(format!("invalid IP address {s:?}")))
}

impl DataPlane {
    fn counters_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        for (k, v) in self.inner.counters().items() {
            d.set_item(k, v)?;
        }
        Ok(d)
    }
}

#[pymethods]
impl DataPlane {
    #[new]
    #[pyo3(signature = (private_key, *, tcp_buffer_size = DEFAULT_TCP_BUFFER))]
    fn new(private_key: &[u8], tcp_buffer_size: usize) -> PyResult<Self> {
        let inner = dataplane::DataPlane::new(private_key, tcp_buffer_size).map_err(to_py_err)?;
        Ok(DataPlane {
            inner,
            gso: true,
            recv_buf: vec![0u8; udp::RECV_BUFFER],
        })
    }

    /// The node's X25519 public key (32 bytes).
    #[getter]
    fn public_key<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.inner.public_key())
    }

    /// Switches to a new node private key (32 bytes): WireGuard sessions restart with it,
    /// TCP connections stay.
    fn set_private_key(&mut self, private_key: &[u8]) -> PyResult<()> {
        self.inner.set_private_key(private_key).map_err(to_py_err)
    }

    fn set_self(&mut self, addresses: Vec<String>) -> PyResult<()> {
        self.inner.set_self(&addresses).map_err(to_py_err)
    }

    fn set_shared(&mut self, addresses: Vec<String>) -> PyResult<()> {
        self.inner.set_shared(&addresses).map_err(to_py_err)
    }

    fn set_peers(&mut self, peers: Vec<(Vec<u8>, Vec<String>, u32)>) -> PyResult<()> {
        let mut specs = Vec::with_capacity(peers.len());
        for (key, ips, region) in peers {
            specs.push((parse_key(&key, "peer node key").map_err(to_py_err)?, ips, region));
        }
        self.inner.set_peers(specs).map_err(to_py_err)
    }

    /// Adds or updates peers given as `(rank, (key, AllowedIPs, region))`; the others stay.
    #[allow(clippy::type_complexity)]
    fn upsert_peers(&mut self, peers: Vec<(u64, (Vec<u8>, Vec<String>, u32))>) -> PyResult<()> {
        let mut specs = Vec::with_capacity(peers.len());
        for (rank, (key, ips, region)) in peers {
            specs.push((rank, parse_key(&key, "peer node key").map_err(to_py_err)?, ips, region));
        }
        self.inner.upsert_peers(specs).map_err(to_py_err)
    }

    /// Removes the peers with these node keys.
    fn remove_peers(&mut self, keys: Vec<Vec<u8>>) -> PyResult<()> {
        let keys = keys
            .iter()
            .map(|k| parse_key(k, "peer node key"))
            .collect::<Result<Vec<_>, _>>()
            .map_err(to_py_err)?;
        self.inner.remove_peers(&keys);
        Ok(())
    }

    fn set_filter(&mut self, rules: Vec<RuleSpec>) -> PyResult<()> {
        self.inner.set_filter(&rules).map_err(to_py_err)
    }

    fn derp_feed(&mut self, region: u32, chunk: &[u8]) -> PyResult<()> {
        self.inner.derp_feed(region, chunk).map_err(to_py_err)
    }

    fn derp_reset(&mut self, region: u32) {
        self.inner.derp_reset(region);
    }

    /// Queues `payload` (a sealed disco message) for the peer `key` through DERP `region`.
    fn derp_send(&mut self, region: u32, key: &[u8], payload: &[u8]) -> PyResult<()> {
        let key = parse_key(key, "peer node key").map_err(to_py_err)?;
        self.inner.derp_send(region, &key, payload);
        Ok(())
    }

    /// Feeds one UDP datagram (tests; the agent uses `udp_receive`).
    fn udp_feed(&mut self, src_ip: &str, src_port: u16, datagram: &[u8]) -> PyResult<()> {
        self.inner
            .udp_feed(SocketAddr::new(parse_ip(src_ip)?, src_port), datagram);
        Ok(())
    }

    /// Reads up to `max_reads` batches from the non-blocking UDP socket `fd` (owned by the
    /// caller; GRO-coalesced reads are split) into the data plane; returns the datagrams read.
    /// Call `poll` afterwards.
    #[pyo3(signature = (fd, max_reads = 1024))]
    fn udp_receive(&mut self, fd: i32, max_reads: usize) -> usize {
        let Self { inner, recv_buf, .. } = self;
        udp::receive(fd, recv_buf, max_reads, |src, datagram| inner.udp_feed(src, datagram))
    }

    /// Sends queued datagrams on the non-blocking UDP socket `fd` until it would block, in GSO
    /// batches where the kernel allows; returns how many are still queued (wait for
    /// writability, then call again).
    fn udp_send(&mut self, fd: i32) -> usize {
        let queue = self.inner.udp_queue();
        udp::send_queue(fd, queue, &mut self.gso);
        queue.len()
    }

    /// Sends WireGuard for the peer `key` directly to `addr` = (ip, port), or through DERP again
    /// with None. Returns False for an unknown peer.
    fn set_peer_direct(&mut self, key: &[u8], addr: Option<(String, u16)>) -> PyResult<bool> {
        let key = parse_key(key, "peer node key").map_err(to_py_err)?;
        let addr = match addr {
            Some((ip, port)) => Some(SocketAddr::new(parse_ip(&ip)?, port)),
            None => None,
        };
        Ok(self.inner.set_peer_direct(&key, addr))
    }

    /// Node keys of the peers an IP packet was sent to at or after `since`.
    fn active_peers<'py>(&self, py: Python<'py>, since: f64) -> Vec<Bound<'py, PyBytes>> {
        self.inner
            .active_peers(since)
            .iter()
            .map(|k| PyBytes::new(py, k))
            .collect()
    }

    /// Remembers that UDP datagrams from (ip, port) come from the peer `key`.
    fn note_udp_source(&mut self, ip: &str, port: u16, key: &[u8]) -> PyResult<()> {
        let key = parse_key(key, "peer node key").map_err(to_py_err)?;
        self.inner.note_udp_source(SocketAddr::new(parse_ip(ip)?, port), key);
        Ok(())
    }

    fn poll(&mut self, py: Python<'_>, now: f64) -> PyResult<PollResult> {
        if !now.is_finite() || now < 0.0 {
            return Err(PyValueError::new_err(format!(
                "now must be a non-negative finite time, got {now}"
            )));
        }
        let out = self.inner.poll(now);
        let writes = PyList::empty(py);
        for (region, buf) in out.derp_writes {
            writes.append((region, PyBytes::new(py, &buf)))?;
        }
        let events = PyList::empty(py);
        for e in out.events {
            events.append(event_to_py(py, e)?)?;
        }
        Ok(PollResult {
            derp_writes: writes.unbind(),
            udp_pending: out.udp_pending,
            events: events.unbind(),
            next_deadline: out.next_deadline,
            counters: self.counters_dict(py)?.unbind(),
        })
    }

    fn counters<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        self.counters_dict(py)
    }

    #[pyo3(signature = (dst_ip, dst_port, timeout = 30.0))]
    fn tcp_connect(&mut self, dst_ip: &str, dst_port: u16, timeout: f64) -> PyResult<u64> {
        let ip = parse_ip(dst_ip)?;
        if timeout.is_nan() || timeout <= 0.0 {
            return Err(PyValueError::new_err(format!(
                "timeout must be positive, got {timeout}"
            )));
        }
        Ok(self.inner.tcp_connect(SocketAddr::new(ip, dst_port), timeout))
    }

    fn tcp_listen(&mut self, port: u16) -> PyResult<u64> {
        self.inner.stack().listen(port).map_err(stack_err)
    }

    fn tcp_unlisten(&mut self, listener: u64) -> PyResult<()> {
        self.inner.stack().unlisten(listener).map_err(stack_err)
    }

    /// Queues bytes from any C-contiguous buffer (bytes, bytearray, memoryview) without an
    /// intermediate copy; returns how many the send buffer took.
    fn tcp_send(&mut self, handle: u64, data: &Bound<'_, PyAny>) -> PyResult<usize> {
        if let Ok(bytes) = data.cast::<PyBytes>() {
            return self.inner.stack().send(handle, bytes.as_bytes()).map_err(stack_err);
        }
        let buffer = PyBuffer::<u8>::get(data)?;
        if !buffer.is_c_contiguous() {
            return Err(PyValueError::new_err("tcp_send needs a contiguous buffer"));
        }
        // SAFETY: the buffer is C-contiguous and held (with the GIL) for the whole call; the
        // stack copies out of the slice before returning, and nothing here mutates it.
        let slice = unsafe { std::slice::from_raw_parts(buffer.buf_ptr() as *const u8, buffer.len_bytes()) };
        self.inner.stack().send(handle, slice).map_err(stack_err)
    }

    #[pyo3(signature = (handle, max_bytes = 262144))]
    fn tcp_recv<'py>(&mut self, py: Python<'py>, handle: u64, max_bytes: usize) -> PyResult<Bound<'py, PyBytes>> {
        let data = self.inner.stack().recv(handle, max_bytes).map_err(stack_err)?;
        Ok(PyBytes::new(py, &data))
    }

    fn tcp_shutdown_write(&mut self, handle: u64) -> PyResult<()> {
        self.inner.stack().shutdown_write(handle).map_err(stack_err)
    }

    fn tcp_close(&mut self, handle: u64) {
        self.inner.stack().close(handle);
    }

    fn tcp_abort(&mut self, handle: u64) {
        self.inner.stack().abort(handle);
    }

    /// `((local_ip, local_port) | None, (remote_ip, remote_port) | None)`.
    #[allow(clippy::type_complexity)]
    fn tcp_endpoints(&mut self, handle: u64) -> PyResult<(Option<(String, u16)>, Option<(String, u16)>)> {
        let (l, r) = self.inner.stack().endpoints(handle).map_err(stack_err)?;
        let conv = |a: SocketAddr| (a.ip().to_string(), a.port());
        Ok((l.map(conv), r.map(conv)))
    }

    fn send_ip_packets(&mut self, packets: Vec<Vec<u8>>) {
        let refs: Vec<&[u8]> = packets.iter().map(Vec::as_slice).collect();
        self.inner.send_ip_packets(&refs);
    }
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<DataPlane>()?;
    m.add_class::<PollResult>()?;
    m.add_class::<Connected>()?;
    m.add_class::<Readable>()?;
    m.add_class::<Writable>()?;
    m.add_class::<PeerClosed>()?;
    m.add_class::<Closed>()?;
    m.add_class::<Reset>()?;
    m.add_class::<Accepted>()?;
    m.add_class::<DialFailed>()?;
    m.add_class::<DerpPeerGone>()?;
    m.add_class::<DerpPeerPresent>()?;
    m.add_class::<DerpHealth>()?;
    m.add_class::<DerpRestarting>()?;
    m.add_class::<DerpFrame>()?;
    m.add_class::<DiscoDerp>()?;
    m.add_class::<DiscoUdp>()?;
    m.add_class::<StunUdp>()?;
    m.add("DEFAULT_TCP_BUFFER_SIZE", DEFAULT_TCP_BUFFER)?;
    m.add("MTU", stack::MTU)?;
    Ok(())
}
