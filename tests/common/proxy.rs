//! A TCP proxy for fault injection: put it between a pool and its server (PostgreSQL,
//! RabbitMQ) and break the network on demand.
//!
//! - [`FaultProxy::cut`]: closes every open connection at once, in both directions —
//!   what a transaction in flight sees when the server or the network goes away;
//! - [`FaultProxy::set_delay`]: holds every chunk forwarded, either way, for a while;
//! - [`FaultProxy::refuse`]: new connections are accepted and closed at once (the pool
//!   sees the server go away during the handshake) until [`FaultProxy::accept`];
//! - [`FaultProxy::redirect`]: new connections go to another server, as a virtual IP or
//!   a DNS name moved to a promoted standby would send them.
//!
//! The proxy runs on the test's tokio runtime and stops when dropped.

#![allow(dead_code, unreachable_pub)]

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::Instant;

#[derive(Debug)]
struct Faults {
    upstream: std::sync::Mutex<SocketAddr>,
    refusing: AtomicBool,
    delay_ms: AtomicU64,
    open: AtomicUsize,
    accepted: AtomicUsize,
    refused: AtomicUsize,
    cuts: AtomicUsize,
}

/// A fault-injecting TCP proxy to one upstream address.
#[derive(Debug)]
pub struct FaultProxy {
    addr: SocketAddr,
    faults: Arc<Faults>,
    /// Bumped by [`cut`](Self::cut); every connection watches it.
    generation: watch::Sender<u64>,
    listener: JoinHandle<()>,
}

impl FaultProxy {
    /// Listens on an ephemeral port of 127.0.0.1 and forwards to `upstream`.
    pub async fn start(upstream: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the proxy");
        let addr = listener.local_addr().expect("proxy address");
        let faults = Arc::new(Faults {
            upstream: std::sync::Mutex::new(upstream),
            refusing: AtomicBool::new(false),
            delay_ms: AtomicU64::new(0),
            open: AtomicUsize::new(0),
            accepted: AtomicUsize::new(0),
            refused: AtomicUsize::new(0),
            cuts: AtomicUsize::new(0),
        });
        let (generation, _) = watch::channel(0u64);
        let task = {
            let faults = Arc::clone(&faults);
            let generation = generation.clone();
            tokio::spawn(async move {
                loop {
                    let Ok((client, _)) = listener.accept().await else {
                        continue;
                    };
                    if faults.refusing.load(Ordering::SeqCst) {
                        faults.refused.fetch_add(1, Ordering::SeqCst);
                        drop(client);
                        continue;
                    }
                    faults.accepted.fetch_add(1, Ordering::SeqCst);
                    let faults = Arc::clone(&faults);
                    let cut = generation.subscribe();
                    tokio::spawn(relay(client, faults, cut));
                }
            })
        };
        Self {
            addr,
            faults,
            generation,
            listener: task,
        }
    }

    /// A proxy in front of the host and port of `url` (`scheme://user@host:port/…`).
    pub async fn in_front_of(url: &str) -> Self {
        let (_, rest) = url.split_once("://").expect("url with a scheme");
        let authority = rest.split('/').next().expect("authority");
        let host_port = authority.rsplit('@').next().expect("host");
        let upstream: SocketAddr = tokio::net::lookup_host(host_port)
            .await
            .expect("resolve upstream")
            .next()
            .expect("an upstream address");
        Self::start(upstream).await
    }

    /// The proxy's own address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `url` with its host and port replaced by the proxy's.
    pub fn url(&self, url: &str) -> String {
        let (scheme, rest) = url.split_once("://").expect("url with a scheme");
        let (authority, path) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
        let userinfo = authority
            .rsplit_once('@')
            .map(|(user, _)| format!("{user}@"))
            .unwrap_or_default();
        format!("{scheme}://{userinfo}{}{path}", self.addr)
    }

    /// Sends new connections to `upstream` from now on (open ones stay where they are:
    /// [`cut`](Self::cut) them).
    pub fn redirect(&self, upstream: SocketAddr) {
        *self
            .faults
            .upstream
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = upstream;
    }

    /// Closes every open connection, both ways, now.
    pub fn cut(&self) {
        self.faults.cuts.fetch_add(1, Ordering::SeqCst);
        self.generation.send_modify(|generation| *generation += 1);
    }

    /// Holds every chunk forwarded for `delay` (zero: none).
    pub fn set_delay(&self, delay: Duration) {
        let ms = u64::try_from(delay.as_millis()).unwrap_or(u64::MAX);
        self.faults.delay_ms.store(ms, Ordering::SeqCst);
    }

    /// From now on, new connections are closed as soon as they are accepted.
    pub fn refuse(&self) {
        self.faults.refusing.store(true, Ordering::SeqCst);
    }

    /// New connections are forwarded again.
    pub fn accept(&self) {
        self.faults.refusing.store(false, Ordering::SeqCst);
    }

    /// Connections open right now.
    pub fn open_connections(&self) -> usize {
        self.faults.open.load(Ordering::SeqCst)
    }

    /// Connections forwarded so far.
    pub fn accepted(&self) -> usize {
        self.faults.accepted.load(Ordering::SeqCst)
    }

    /// Connections refused so far.
    pub fn refused(&self) -> usize {
        self.faults.refused.load(Ordering::SeqCst)
    }

    /// Times [`cut`](Self::cut) was called.
    pub fn cuts(&self) -> usize {
        self.faults.cuts.load(Ordering::SeqCst)
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.listener.abort();
        self.cut();
    }
}

/// Forwards one connection both ways until either side closes or a cut comes.
async fn relay(client: TcpStream, faults: Arc<Faults>, mut cut: watch::Receiver<u64>) {
    let upstream = *faults
        .upstream
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let Ok(server) = TcpStream::connect(upstream).await else {
        return;
    };
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    faults.open.fetch_add(1, Ordering::SeqCst);
    let (client_read, client_write) = client.into_split();
    let (server_read, server_write) = server.into_split();
    let forward = async {
        tokio::select! {
            _ = pump(client_read, server_write, &faults) => {}
            _ = pump(server_read, client_write, &faults) => {}
        }
    };
    tokio::select! {
        _ = forward => {}
        _ = cut.changed() => {}
    }
    // Both halves are dropped here: the sockets close and each side sees EOF or a reset.
    faults.open.fetch_sub(1, Ordering::SeqCst);
}

/// Forwards `from` to `to`. Under a delay, each chunk is held for that long from the moment
/// it was read, while reading goes on: a link's latency, not a cap on its throughput (a
/// stream faster than one buffer per delay does not fall further and further behind).
async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    faults: &Faults,
) {
    let (chunks, mut due) = tokio::sync::mpsc::unbounded_channel::<(Instant, Vec<u8>)>();
    let read = async move {
        let mut buffer = vec![0u8; 16 * 1024];
        loop {
            let n = match from.read(&mut buffer).await {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            let delay = Duration::from_millis(faults.delay_ms.load(Ordering::SeqCst));
            if chunks
                .send((Instant::now() + delay, buffer[..n].to_vec()))
                .is_err()
            {
                return;
            }
        }
    };
    let write = async move {
        while let Some((at, chunk)) = due.recv().await {
            tokio::time::sleep_until(at).await;
            if to.write_all(&chunk).await.is_err() {
                return;
            }
        }
    };
    // The writer drains what was read before the reader's end; a cut drops both.
    let (_, ()) = tokio::join!(read, write);
}
