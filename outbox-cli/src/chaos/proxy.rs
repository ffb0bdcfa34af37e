//! A TCP fault proxy between the workload and one server.
//!
//! Killing a server tests crash recovery, but most production incidents are network-shaped: a
//! load balancer drops every connection, a link pauses for seconds, a half-dead host accepts
//! connections and never answers. Clients (relays, consumers) reach every server only through one
//! of these proxies, so the runner can inject those faults without touching the kernel or the
//! servers. It refuses anything but loopback addresses: the runner must never be a way to send
//! traffic somewhere else or to expose a server beyond the machine.
//!
//! Every fault ends by itself (a stall or a black hole lasts the given duration; a cut is
//! instantaneous), and dropping the proxy aborts every task it started.
#![allow(dead_code)]

use std::collections::HashMap;
use std::fmt;
use std::io;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::runtime::Handle;
use tokio::task::{AbortHandle, JoinHandle};
use tokio::time::Instant;

/// How long a connection to the upstream server may take before the client's connection is
/// closed (the server is down or restarting: the client sees a closed connection, as it would
/// when the server refuses).
const UPSTREAM_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// The longest single stall or black hole; longer requests are clamped so that no fault is
/// unbounded by mistake.
pub(crate) const MAX_FAULT: Duration = Duration::from_secs(600);

/// Size of one forwarding read.
const CHUNK: usize = 16 * 1024;

/// What the proxy has done so far (counters only grow, except `open`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct ProxyStats {
    /// Client connections accepted.
    pub(crate) accepted: u64,
    /// Client connections open now.
    pub(crate) open: u64,
    /// Bytes forwarded from clients to the server.
    pub(crate) bytes_up: u64,
    /// Bytes forwarded from the server to clients.
    pub(crate) bytes_down: u64,
    /// Calls of [`FaultProxy::cut`].
    pub(crate) cuts: u64,
    /// Connections closed by [`FaultProxy::cut`].
    pub(crate) cut_connections: u64,
    /// Calls of [`FaultProxy::stall`].
    pub(crate) stalls: u64,
    /// Calls of [`FaultProxy::blackhole`].
    pub(crate) blackholes: u64,
    /// Connections closed at the end of a black hole.
    pub(crate) blackholed_connections: u64,
    /// Client connections closed because the server did not accept the proxy's connection
    /// (down, restarting) within a few seconds.
    pub(crate) upstream_failures: u64,
}

/// A loopback-only TCP proxy that forwards every connection to one upstream server and can cut,
/// stall or black-hole them on demand.
///
/// Create it inside a tokio runtime; the faults are plain (non-async) calls that take effect at
/// once. Dropping it stops accepting, closes every connection and aborts every task it started.
pub(crate) struct FaultProxy {
    shared: Arc<Shared>,
    addr: SocketAddr,
    accept: JoinHandle<()>,
}

impl fmt::Debug for FaultProxy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FaultProxy")
            .field("name", &self.shared.name)
            .field("addr", &self.addr)
            .field("upstream", &self.shared.lock().upstream)
            .finish_non_exhaustive()
    }
}

/// State shared by the handle, the accept loop and the connection tasks.
struct Shared {
    name: String,
    runtime: Handle,
    state: Mutex<State>,
    next_id: AtomicU64,
    accepted: AtomicU64,
    bytes_up: AtomicU64,
    bytes_down: AtomicU64,
    cuts: AtomicU64,
    cut_connections: AtomicU64,
    stalls: AtomicU64,
    blackholes: AtomicU64,
    blackholed_connections: AtomicU64,
    upstream_failures: AtomicU64,
}

struct State {
    upstream: SocketAddr,
    /// Open connections: id → (accepted at, task).
    conns: HashMap<u64, (Instant, AbortHandle)>,
    /// Forwarding is paused until then (stall).
    stalled_until: Option<Instant>,
    /// Black hole active until then.
    blackhole_until: Option<Instant>,
    /// Timers that end black holes (aborted on drop).
    timers: Vec<AbortHandle>,
}

impl State {
    /// When forwarding may resume, if it is paused now.
    fn gate(&self, now: Instant) -> Option<Instant> {
        [self.stalled_until, self.blackhole_until].into_iter().flatten().filter(|t| *t > now).max()
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Wait while a stall or a black hole is active (each is bounded, so this is too).
    async fn wait_gate(&self) {
        loop {
            let until = self.lock().gate(Instant::now());
            match until {
                Some(t) => tokio::time::sleep_until(t).await,
                None => return,
            }
        }
    }
}

/// Refuse anything that is not a loopback address.
fn require_loopback(what: &str, addr: SocketAddr) -> io::Result<()> {
    if addr.ip().is_loopback() {
        Ok(())
    } else {
        Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "fault proxy: {what} {addr} is not a loopback address; the chaos runner only proxies to 127.0.0.1/::1"
            ),
        ))
    }
}

impl FaultProxy {
    /// Listen on `127.0.0.1:<free port>` and forward every connection to `upstream`.
    ///
    /// # Behavior
    /// - `upstream` must be a loopback address, else `InvalidInput`;
    /// - the upstream need not be listening yet: a client connection is forwarded once the
    ///   proxy's own connection succeeds, and closed when that fails within 5 s;
    /// - must be called inside a tokio runtime.
    pub(crate) async fn start(name: &str, upstream: SocketAddr) -> io::Result<FaultProxy> {
        Self::start_at(name, SocketAddr::from((Ipv4Addr::LOCALHOST, 0)), upstream).await
    }

    /// [`start`](Self::start), listening on `listen` (a loopback address; port 0 picks one).
    pub(crate) async fn start_at(name: &str, listen: SocketAddr, upstream: SocketAddr) -> io::Result<FaultProxy> {
        require_loopback("listen address", listen)?;
        require_loopback("upstream", upstream)?;
        let listener = TcpListener::bind(listen).await?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            name: name.to_string(),
            runtime: Handle::current(),
            state: Mutex::new(State {
                upstream,
                conns: HashMap::new(),
                stalled_until: None,
                blackhole_until: None,
                timers: Vec::new(),
            }),
            next_id: AtomicU64::new(0),
            accepted: AtomicU64::new(0),
            bytes_up: AtomicU64::new(0),
            bytes_down: AtomicU64::new(0),
            cuts: AtomicU64::new(0),
            cut_connections: AtomicU64::new(0),
            stalls: AtomicU64::new(0),
            blackholes: AtomicU64::new(0),
            blackholed_connections: AtomicU64::new(0),
            upstream_failures: AtomicU64::new(0),
        });
        let accept = tokio::spawn(accept_loop(listener, Arc::clone(&shared)));
        Ok(FaultProxy { shared, addr, accept })
    }

    /// The proxy's name (the server it stands for), for logs.
    pub(crate) fn name(&self) -> &str {
        &self.shared.name
    }

    /// Where clients connect.
    pub(crate) fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Where connections are forwarded to.
    pub(crate) fn upstream(&self) -> SocketAddr {
        self.shared.lock().upstream
    }

    /// Forward new connections to `upstream` from now on (existing ones keep their server).
    ///
    /// # Behavior
    /// - refuses (`InvalidInput`) a non-loopback address and keeps the old upstream.
    pub(crate) fn set_upstream(&self, upstream: SocketAddr) -> io::Result<()> {
        require_loopback("upstream", upstream)?;
        self.shared.lock().upstream = upstream;
        Ok(())
    }

    /// Close every open connection at once, both the client's and the server's side; returns how
    /// many were closed. New connections are accepted and forwarded normally right after.
    pub(crate) fn cut(&self) -> usize {
        let drained: Vec<AbortHandle> = self.shared.lock().conns.drain().map(|(_, (_, task))| task).collect();
        for task in &drained {
            task.abort();
        }
        self.shared.cuts.fetch_add(1, Ordering::Relaxed);
        self.shared.cut_connections.fetch_add(drained.len() as u64, Ordering::Relaxed);
        drained.len()
    }

    /// Stop forwarding bytes in both directions for `d` (clamped to [`MAX_FAULT`]).
    ///
    /// # Behavior
    /// - connections stay open; what either side sends is held (in the proxy and the kernel's
    ///   buffers) and delivered in order when the stall ends;
    /// - connections accepted during the stall reach the server when it ends;
    /// - a stall during another one extends it to the later end, never shortens it.
    pub(crate) fn stall(&self, d: Duration) {
        let until = Instant::now() + d.min(MAX_FAULT);
        let mut state = self.shared.lock();
        state.stalled_until = Some(state.stalled_until.map_or(until, |t| t.max(until)));
        drop(state);
        self.shared.stalls.fetch_add(1, Ordering::Relaxed);
    }

    /// For `d` (clamped to [`MAX_FAULT`]): accept connections but connect nothing upstream and
    /// answer nothing; open connections go silent too. When `d` ends, every connection that was
    /// open or opened during it is closed (both sides); later connections work normally.
    ///
    /// # Behavior
    /// - the silence is that of a host that stopped answering: clients see neither data nor a
    ///   close until the end, so only their own timeouts help them;
    /// - a black hole during another one extends it to the later end.
    pub(crate) fn blackhole(&self, d: Duration) {
        let until = Instant::now() + d.min(MAX_FAULT);
        let shared = Arc::clone(&self.shared);
        let mut state = self.shared.lock();
        state.blackhole_until = Some(state.blackhole_until.map_or(until, |t| t.max(until)));
        state.timers.retain(|t| !t.is_finished());
        let timer = self.shared.runtime.spawn(async move {
            tokio::time::sleep_until(until).await;
            let doomed: Vec<AbortHandle> = {
                let mut state = shared.lock();
                if state.blackhole_until.is_some_and(|t| t > until) {
                    return; // extended: the later timer ends it
                }
                state.blackhole_until = None;
                let ids: Vec<u64> = state.conns.iter().filter(|(_, (at, _))| *at <= until).map(|(id, _)| *id).collect();
                ids.iter().filter_map(|id| state.conns.remove(id)).map(|(_, task)| task).collect()
            };
            for task in &doomed {
                task.abort();
            }
            shared.blackholed_connections.fetch_add(doomed.len() as u64, Ordering::Relaxed);
        });
        state.timers.push(timer.abort_handle());
        drop(state);
        self.shared.blackholes.fetch_add(1, Ordering::Relaxed);
    }

    /// Whether a stall or black hole is in effect now.
    pub(crate) fn faulted(&self) -> bool {
        self.shared.lock().gate(Instant::now()).is_some()
    }

    /// The counters so far.
    pub(crate) fn stats(&self) -> ProxyStats {
        let s = &self.shared;
        ProxyStats {
            accepted: s.accepted.load(Ordering::Relaxed),
            open: s.lock().conns.len() as u64,
            bytes_up: s.bytes_up.load(Ordering::Relaxed),
            bytes_down: s.bytes_down.load(Ordering::Relaxed),
            cuts: s.cuts.load(Ordering::Relaxed),
            cut_connections: s.cut_connections.load(Ordering::Relaxed),
            stalls: s.stalls.load(Ordering::Relaxed),
            blackholes: s.blackholes.load(Ordering::Relaxed),
            blackholed_connections: s.blackholed_connections.load(Ordering::Relaxed),
            upstream_failures: s.upstream_failures.load(Ordering::Relaxed),
        }
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.accept.abort();
        let mut state = self.shared.lock();
        for (_, (_, task)) in state.conns.drain() {
            task.abort();
        }
        for timer in state.timers.drain(..) {
            timer.abort();
        }
    }
}

/// Accept clients until the proxy is dropped (the task is aborted then).
async fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    loop {
        let (client, peer) = match listener.accept().await {
            Ok(c) => c,
            Err(e) => {
                // Out of descriptors and the like: back off instead of spinning.
                tracing::warn!(proxy = %shared.name, error = %e, "fault proxy: accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        if !peer.ip().is_loopback() {
            continue; // we listen on loopback only; never serve anyone else
        }
        shared.accepted.fetch_add(1, Ordering::Relaxed);
        let id = shared.next_id.fetch_add(1, Ordering::Relaxed);
        // Register before the task can finish, so that its removal always finds the entry.
        let mut state = shared.lock();
        let task = tokio::spawn(connection(id, client, Arc::clone(&shared)));
        state.conns.insert(id, (Instant::now(), task.abort_handle()));
    }
}

/// Removes a connection from the table when its task ends (normally or aborted).
struct Deregister {
    id: u64,
    shared: Arc<Shared>,
}

impl Drop for Deregister {
    fn drop(&mut self) {
        self.shared.lock().conns.remove(&self.id);
    }
}

/// One client connection: wait out any fault, connect upstream, forward both ways.
async fn connection(id: u64, client: TcpStream, shared: Arc<Shared>) {
    let _deregister = Deregister { id, shared: Arc::clone(&shared) };
    shared.wait_gate().await;
    let upstream = shared.lock().upstream;
    let server = match tokio::time::timeout(UPSTREAM_CONNECT_TIMEOUT, TcpStream::connect(upstream)).await {
        Ok(Ok(s)) => s,
        Ok(Err(_)) | Err(_) => {
            shared.upstream_failures.fetch_add(1, Ordering::Relaxed);
            return; // dropping `client` closes it
        }
    };
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let (client_r, client_w) = client.into_split();
    let (server_r, server_w) = server.into_split();
    let up = pump(client_r, server_w, &shared, &shared.bytes_up);
    let down = pump(server_r, client_w, &shared, &shared.bytes_down);
    // Either side failing ends the connection (both sockets drop); a clean EOF is passed on as
    // a half-close and the other direction goes on.
    let _ = tokio::try_join!(up, down);
}

/// Copy one direction, holding data while a fault is active.
async fn pump(mut from: OwnedReadHalf, mut to: OwnedWriteHalf, shared: &Shared, counter: &AtomicU64) -> io::Result<()> {
    let mut buf = vec![0u8; CHUNK];
    loop {
        let n = from.read(&mut buf).await?;
        shared.wait_gate().await;
        if n == 0 {
            to.shutdown().await?;
            return Ok(());
        }
        to.write_all(&buf[..n]).await?;
        counter.fetch_add(n as u64, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Upper bound for every wait in these tests.
    const WAIT: Duration = Duration::from_secs(10);

    /// An echo server on loopback; returns its address.
    async fn echo_server() -> (SocketAddr, JoinHandle<()>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let task = tokio::spawn(async move {
            loop {
                let Ok((mut s, _)) = listener.accept().await else { return };
                tokio::spawn(async move {
                    let mut buf = [0u8; 4096];
                    loop {
                        match s.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => {
                                if s.write_all(&buf[..n]).await.is_err() {
                                    return;
                                }
                            }
                        }
                    }
                });
            }
        });
        (addr, task)
    }

    async fn read_exact_within(s: &mut TcpStream, n: usize) -> Vec<u8> {
        let mut buf = vec![0u8; n];
        tokio::time::timeout(WAIT, s.read_exact(&mut buf)).await.expect("no echo within 10 s").expect("read failed");
        buf
    }

    /// The connection ends (EOF or reset) within the bound.
    async fn expect_closed(s: &mut TcpStream, what: &str) {
        let mut buf = [0u8; 64];
        match tokio::time::timeout(WAIT, s.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => {}
            Ok(Ok(n)) => panic!("{what}: expected a closed connection, read {n} bytes"),
            Err(_) => panic!("{what}: connection still open after 10 s"),
        }
    }

    async fn until<F: Fn() -> bool>(what: &str, f: F) {
        let deadline = Instant::now() + WAIT;
        while !f() {
            assert!(Instant::now() < deadline, "{what} within 10 s");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    #[tokio::test]
    async fn forwards_bytes_both_ways_and_counts_them() {
        let (up, _server) = echo_server().await;
        let proxy = FaultProxy::start("echo", up).await.unwrap();
        assert!(proxy.addr().ip().is_loopback());
        let mut c = TcpStream::connect(proxy.addr()).await.unwrap();
        let payload: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
        let (mut r, mut w) = c.split();
        let write = async {
            w.write_all(&payload).await.unwrap();
        };
        let read = async {
            let mut got = vec![0u8; payload.len()];
            tokio::time::timeout(WAIT, r.read_exact(&mut got)).await.expect("echo within 10 s").unwrap();
            got
        };
        let ((), got) = tokio::join!(write, read);
        assert_eq!(got, payload);
        let s = proxy.stats();
        assert_eq!((s.accepted, s.open, s.bytes_up, s.bytes_down), (1, 1, 100_000, 100_000));
        drop(c);
        until("connection closed after client EOF", || proxy.stats().open == 0).await;
    }

    #[tokio::test]
    async fn cut_closes_both_sides_and_new_connections_work() {
        // The server side: record when the proxy's upstream connection is closed.
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let up = listener.local_addr().unwrap();
        let proxy = FaultProxy::start("cut", up).await.unwrap();
        let mut c = TcpStream::connect(proxy.addr()).await.unwrap();
        c.write_all(b"ping").await.unwrap();
        let (mut server_side, _) = tokio::time::timeout(WAIT, listener.accept()).await.unwrap().unwrap();
        assert_eq!(read_exact_within(&mut server_side, 4).await, b"ping");
        until("connection registered", || proxy.stats().open == 1).await;

        assert_eq!(proxy.cut(), 1);
        expect_closed(&mut c, "client after cut").await;
        expect_closed(&mut server_side, "server after cut").await;
        let s = proxy.stats();
        assert_eq!((s.cuts, s.cut_connections, s.open), (1, 1, 0));

        let mut c2 = TcpStream::connect(proxy.addr()).await.unwrap();
        c2.write_all(b"again").await.unwrap();
        let (mut s2, _) = tokio::time::timeout(WAIT, listener.accept()).await.unwrap().unwrap();
        assert_eq!(read_exact_within(&mut s2, 5).await, b"again");
    }

    #[tokio::test]
    async fn stall_delays_then_delivers_in_order() {
        let (up, _server) = echo_server().await;
        let proxy = FaultProxy::start("stall", up).await.unwrap();
        let mut c = TcpStream::connect(proxy.addr()).await.unwrap();
        c.write_all(b"before").await.unwrap();
        assert_eq!(read_exact_within(&mut c, 6).await, b"before");

        let d = Duration::from_millis(700);
        let t0 = Instant::now();
        proxy.stall(d);
        assert!(proxy.faulted());
        c.write_all(b"during-1").await.unwrap();
        c.write_all(b"during-2").await.unwrap();
        // Nothing comes back while stalled.
        let mut buf = [0u8; 16];
        let early = tokio::time::timeout(Duration::from_millis(400), c.read(&mut buf)).await;
        assert!(early.is_err(), "data came through a stall: {early:?}");
        assert_eq!(read_exact_within(&mut c, 16).await, b"during-1during-2");
        assert!(t0.elapsed() >= d, "delivered after {:?}, before the stall ended", t0.elapsed());
        assert!(!proxy.faulted());
        assert_eq!(proxy.stats().stalls, 1);
        assert_eq!(proxy.stats().open, 1, "a stall keeps connections open");
    }

    #[tokio::test]
    async fn blackhole_silences_then_closes_and_later_connections_work() {
        let (up, _server) = echo_server().await;
        let proxy = FaultProxy::start("blackhole", up).await.unwrap();
        let mut old = TcpStream::connect(proxy.addr()).await.unwrap();
        old.write_all(b"hi").await.unwrap();
        assert_eq!(read_exact_within(&mut old, 2).await, b"hi");

        let d = Duration::from_millis(800);
        let t0 = Instant::now();
        proxy.blackhole(d);
        // An existing connection goes silent; a new one is accepted but gets nothing.
        old.write_all(b"lost?").await.unwrap();
        let mut new = TcpStream::connect(proxy.addr()).await.unwrap();
        new.write_all(b"hello?").await.unwrap();
        let mut buf = [0u8; 16];
        assert!(tokio::time::timeout(Duration::from_millis(300), old.read(&mut buf)).await.is_err());
        assert!(tokio::time::timeout(Duration::from_millis(100), new.read(&mut buf)).await.is_err());
        until("both connections accepted", || proxy.stats().accepted == 2).await;

        // At the end both are closed, without having received anything.
        expect_closed(&mut old, "old connection after black hole").await;
        expect_closed(&mut new, "new connection after black hole").await;
        assert!(t0.elapsed() >= d, "closed after {:?}, before the black hole ended", t0.elapsed());
        let s = proxy.stats();
        assert_eq!((s.blackholes, s.blackholed_connections, s.open), (1, 2, 0));
        assert_eq!(s.bytes_down, 2, "nothing was answered during the black hole");

        let mut after = TcpStream::connect(proxy.addr()).await.unwrap();
        after.write_all(b"back").await.unwrap();
        assert_eq!(read_exact_within(&mut after, 4).await, b"back");
    }

    #[tokio::test]
    async fn refuses_non_loopback_addresses() {
        let remote: SocketAddr = "10.1.2.3:5432".parse().unwrap();
        let err = FaultProxy::start("remote", remote).await.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidInput);
        assert!(err.to_string().contains("not a loopback address"), "{err}");
        let wildcard: SocketAddr = "0.0.0.0:0".parse().unwrap();
        let local: SocketAddr = "127.0.0.1:1".parse().unwrap();
        assert!(FaultProxy::start_at("wild", wildcard, local).await.is_err(), "listening beyond loopback");

        let (up, _server) = echo_server().await;
        let proxy = FaultProxy::start("echo", up).await.unwrap();
        assert!(proxy.set_upstream(remote).is_err());
        assert_eq!(proxy.upstream(), up, "a refused upstream leaves the old one");
    }

    #[tokio::test]
    async fn set_upstream_moves_new_connections_and_down_upstream_closes_clients() {
        let (a, _sa) = echo_server().await;
        let proxy = FaultProxy::start("move", a).await.unwrap();
        // Nothing listens on a just-freed port: the client is closed, and it is counted.
        let dead = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap()
        };
        proxy.set_upstream(dead).unwrap();
        let mut c = TcpStream::connect(proxy.addr()).await.unwrap();
        expect_closed(&mut c, "client of a dead upstream").await;
        assert_eq!(proxy.stats().upstream_failures, 1);

        let (b, _sb) = echo_server().await;
        proxy.set_upstream(b).unwrap();
        let mut c = TcpStream::connect(proxy.addr()).await.unwrap();
        c.write_all(b"b").await.unwrap();
        assert_eq!(read_exact_within(&mut c, 1).await, b"b");
    }

    #[tokio::test]
    async fn dropping_the_proxy_closes_everything() {
        let (up, _server) = echo_server().await;
        let proxy = FaultProxy::start("drop", up).await.unwrap();
        let addr = proxy.addr();
        let mut c = TcpStream::connect(addr).await.unwrap();
        c.write_all(b"x").await.unwrap();
        assert_eq!(read_exact_within(&mut c, 1).await, b"x");
        proxy.blackhole(Duration::from_secs(60));
        let shared = Arc::downgrade(&proxy.shared);
        drop(proxy);
        expect_closed(&mut c, "client after the proxy was dropped").await;
        // Every task let go of the shared state: nothing leaked.
        until("all proxy tasks gone", || shared.strong_count() == 0).await;
        assert!(TcpStream::connect(addr).await.is_err(), "still listening after drop");
    }
}
