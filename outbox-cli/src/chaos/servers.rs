//! Servers the chaos runner owns, so that it may kill and restart them.
//!
//! The contract's promises are about crashes: a relay or consumer that dies, a broker or a
//! database that goes away and comes back with what it acknowledged. Testing that against the
//! machine's shared servers would disturb every other test and could not kill them brutally, so
//! the runner starts its own Redis, tansu and PostgreSQL on free loopback ports with their data in
//! temporary directories, and restarts them the hardest way each one's durability settings are
//! meant to survive (SIGKILL with `appendfsync always` / a SQLite WAL; PostgreSQL's immediate
//! shutdown, which is a crash followed by WAL recovery). RabbitMQ is the exception: a second node
//! would need its own Erlang distribution setup, so the machine's node is restarted with
//! `rabbitmqctl stop_app` / `start_app`, and a guard makes sure it is started again whatever
//! happens to the runner short of being killed itself.
//!
//! Every wait is bounded and fails with a message that names the server and ends with the tail
//! of its log.
#![allow(dead_code)]

use std::ffi::OsString;
use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener as StdListener};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use outbox_store_postgres::sqlx::{Connection, PgConnection};
use tempfile::TempDir;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::proxy::FaultProxy;

/// How long Redis may take to answer `PING` after a (re)start.
const REDIS_READY: Duration = Duration::from_secs(30);
/// How long tansu may take to answer an `ApiVersions` request after a (re)start.
const TANSU_READY: Duration = Duration::from_secs(60);
/// How long PostgreSQL may take to accept a connection after a (re)start (crash recovery
/// included).
const PG_READY: Duration = Duration::from_secs(60);
/// How long RabbitMQ may take to answer the AMQP handshake after `start_app`.
const RABBIT_READY: Duration = Duration::from_secs(60);
/// How long one `rabbitmqctl stop_app` / `start_app` may run.
const RABBITMQCTL_LIMIT: Duration = Duration::from_secs(120);
/// One readiness probe (connect + request + answer).
const PROBE_LIMIT: Duration = Duration::from_secs(2);
/// Pause between readiness probes.
const PROBE_PAUSE: Duration = Duration::from_millis(50);

/// The machine's RabbitMQ (`scripts/services ensure rabbitmq`).
const RABBIT_ADDR: SocketAddr = SocketAddr::new(std::net::IpAddr::V4(Ipv4Addr::LOCALHOST), 5672);
/// The database every PostgreSQL node creates for the workload (the `CREATE DATABASE` in
/// [`PgNode::start`] spells it too).
pub(crate) const PG_DATABASE: &str = "chaos";

/// A server the runner can restart. Object-safe: the runner keeps `Box<dyn Server>`.
#[async_trait]
pub(crate) trait Server: Send + Sync {
    /// `"postgres"`, `"redis"`, `"kafka"` or `"rabbitmq"`.
    fn name(&self) -> &str;

    /// Where the real server listens (the upstream of its [`FaultProxy`]).
    fn addr(&self) -> SocketAddr;

    /// The URL a client uses to reach this server at `addr` (normally its proxy's address).
    fn url_at(&self, addr: SocketAddr) -> String;

    /// Stop the server the hardest way its durability settings survive, start it again with the
    /// same data on the same address, and wait until it serves.
    ///
    /// # Behavior
    /// - Redis and tansu: SIGKILL, then start; PostgreSQL: `pg_ctl restart`, alternating
    ///   `-m immediate` (crash + WAL recovery) and `-m fast`; RabbitMQ: `rabbitmqctl stop_app`
    ///   then `start_app`;
    /// - returns the downtime: from the stop to the first successful readiness probe;
    /// - every wait is bounded; a server that does not come back is an error naming it, with
    ///   the tail of its log;
    /// - not meant to be called concurrently for the same server (calls are serialized where
    ///   the server needs it).
    async fn restart(&self) -> Result<Duration, String>;

    /// Whether the server, though it still answers, failed inside since its last start: the
    /// line that says so.
    ///
    /// # Behavior
    /// - tansu: a panicked task in its log since the last start (after its storage task
    ///   panics, tansu 0.6 keeps its port open and answers every produce and fetch with an
    ///   error, until restarted);
    /// - the others: never (`None`).
    fn failed_internally(&self) -> Option<String> {
        None
    }

    /// The server's own log file, when the runner started the server and it logs something
    /// worth reading after a run that does not drain.
    ///
    /// # Behavior
    /// - tansu: its log, with its consumer group coordinator at `info` (members that missed
    ///   their heartbeat, new group leaders);
    /// - the others: `None`.
    fn log_file(&self) -> Option<PathBuf> {
        None
    }
}

/// The lowest port [`free_port`] hands out.
const LOWEST_PORT: u32 = 10_000;

/// A free TCP port on 127.0.0.1 for a server the runner starts, below the kernel's ephemeral
/// range (bound and released, then left to the server).
///
/// Below the range, because a port the kernel picked for `bind(0)` is an ephemeral one, which
/// the kernel also gives to outgoing connections: in a CI run full of clients, one took the
/// port between its release and tansu's bind, and tansu exited (its listener's error unwrapped
/// in a task) before it answered, failing the run. Ports below the range are never given out
/// by the kernel; this process hands them out one after another from a random start, so two
/// servers of one run never get the same one. Falls back to `bind(0)` where the range starts
/// too low to leave room.
pub(crate) fn free_port() -> Result<u16, String> {
    use std::sync::OnceLock;
    use std::sync::atomic::AtomicU32;
    static START: OnceLock<u32> = OnceLock::new();
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let high = ephemeral_low().unwrap_or(32_768);
    if high > LOWEST_PORT + 1_000 {
        let span = high - LOWEST_PORT;
        // A randomly keyed hasher's output is a random number: no dependency for one.
        let start = *START.get_or_init(|| {
            use std::hash::{BuildHasher, Hasher};
            (std::collections::hash_map::RandomState::new().build_hasher().finish() % u64::from(span)) as u32
        });
        for _ in 0..1_000 {
            let port = LOWEST_PORT + (start + NEXT.fetch_add(1, Ordering::Relaxed)) % span;
            let port = u16::try_from(port).map_err(|_| format!("port {port} out of range"))?;
            if StdListener::bind((Ipv4Addr::LOCALHOST, port)).is_ok() {
                return Ok(port);
            }
        }
    }
    StdListener::bind((Ipv4Addr::LOCALHOST, 0))
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|e| format!("cannot find a free port on 127.0.0.1: {e}"))
}

/// The first port of the kernel's ephemeral range (`/proc/sys/net/ipv4/ip_local_port_range`);
/// `None` where it cannot be read.
fn ephemeral_low() -> Option<u32> {
    let range = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range").ok()?;
    range.split_whitespace().next()?.parse().ok()
}

fn loopback(port: u16) -> SocketAddr {
    SocketAddr::from((Ipv4Addr::LOCALHOST, port))
}

/// The error for a binary that is not installed.
fn missing(binary: &str, service: &str) -> String {
    format!("`{binary}` not found (PATH and the usual places); install it with `scripts/services ensure {service}`")
}

/// `name` in `extra` directories (first) or on `PATH`.
fn find_binary(name: &str, service: &str, extra: &[PathBuf]) -> Result<PathBuf, String> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    extra
        .iter()
        .cloned()
        .chain(std::env::split_paths(&path))
        .map(|dir| dir.join(name))
        .find(|p| p.is_file())
        .ok_or_else(|| missing(name, service))
}

/// The last lines of a log file, for error messages.
fn log_tail(path: &Path) -> String {
    // A panic's message sits above its backtrace, which alone can fill the last lines.
    let panic = panic_in_log(path, last_start_in_log(path))
        .map(|p| format!("panic since the last start: {p}\n"))
        .unwrap_or_default();
    match log_lines(path, 15, |_| true) {
        Ok(lines) => format!("{panic}last lines of {}:\n{}", path.display(), lines.join("\n")),
        Err(_) => format!("(no log at {})", path.display()),
    }
}

/// The last `n` lines of the log at `path` that `keep` accepts, without terminal colours
/// (invalid UTF-8 replaced, not an error).
pub(crate) fn log_lines(path: &Path, n: usize, keep: impl Fn(&str) -> bool) -> std::io::Result<Vec<String>> {
    let text = String::from_utf8_lossy(&std::fs::read(path)?).into_owned();
    let mut kept: Vec<String> = text.lines().map(strip_ansi).filter(|l| keep(l)).collect();
    kept.drain(..kept.len().saturating_sub(n));
    Ok(kept)
}

/// The first Rust panic in `path` after byte `from`: its `panicked at` line and the message on
/// the line after, without terminal colours. `None` when there is none (or no log).
fn panic_in_log(path: &Path, from: u64) -> Option<String> {
    use std::io::{Seek, SeekFrom};
    let mut file = File::open(path).ok()?;
    file.seek(SeekFrom::Start(from)).ok()?;
    let mut bytes = Vec::new();
    file.read_to_end(&mut bytes).ok()?;
    let text = String::from_utf8_lossy(&bytes);
    let mut lines = text.lines();
    let at = lines.by_ref().find(|l| l.contains("panicked at"))?;
    let message = lines.next().unwrap_or_default();
    Some(format!("{}: {}", strip_ansi(at).trim(), strip_ansi(message).trim()))
}

/// The byte offset in the log at `path` where its process last started (after the runner's
/// last start line; 0 without one), for [`panic_in_log`].
fn last_start_in_log(path: &Path) -> u64 {
    let text = std::fs::read(path).unwrap_or_default();
    let marker = START_LINE.as_bytes();
    text.windows(marker.len()).rposition(|w| w == marker).map_or(0, |at| at as u64)
}

/// `line` without terminal colours (ANSI escapes: ESC `[` … letter), as the workers' and the
/// servers' logs are read back into the run's output.
pub(crate) fn strip_ansi(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

fn temp_dir(name: &str) -> Result<TempDir, String> {
    tempfile::Builder::new()
        .prefix(&format!("outbox-chaos-{name}-"))
        .tempdir()
        .map_err(|e| format!("{name}: cannot create a temporary directory: {e}"))
}

/// Run a command to completion under coreutils `timeout` (SIGTERM at `limit`, SIGKILL 5 s
/// later), off the async threads; its stdout on success, else an error with its stderr.
async fn run(what: &str, program: &Path, args: &[OsString], cwd: &Path, limit: Duration) -> Result<String, String> {
    let mut cmd = Command::new("timeout");
    cmd.arg("-k").arg("5").arg(format!("{}", limit.as_secs().max(1))).arg(program).args(args).current_dir(cwd);
    cmd.stdin(Stdio::null());
    let what_owned = what.to_string();
    let output = tokio::task::spawn_blocking(move || cmd.output())
        .await
        .map_err(|e| format!("{what_owned}: {e}"))?
        .map_err(|e| format!("{what}: cannot run {}: {e}", program.display()))?;
    if output.status.success() {
        return Ok(String::from_utf8_lossy(&output.stdout).into_owned());
    }
    let timed_out = output.status.code() == Some(124) || output.status.code() == Some(137);
    Err(format!(
        "{what}: {} {}{}\nstderr: {}\nstdout: {}",
        program.display(),
        output.status,
        if timed_out { format!(" (gave up after {limit:?})") } else { String::new() },
        String::from_utf8_lossy(&output.stderr).trim(),
        String::from_utf8_lossy(&output.stdout).trim(),
    ))
}

/// The blocking form of [`run`], for `Drop`.
fn run_blocking(program: &Path, args: &[OsString], cwd: &Path, limit: Duration) -> Result<(), String> {
    let status = Command::new("timeout")
        .arg("-k")
        .arg("5")
        .arg(format!("{}", limit.as_secs().max(1)))
        .arg(program)
        .args(args)
        .current_dir(cwd)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .map_err(|e| format!("cannot run {}: {e}", program.display()))?;
    if status.success() { Ok(()) } else { Err(format!("{} {status}", program.display())) }
}

fn os(args: &[&str]) -> Vec<OsString> {
    args.iter().map(OsString::from).collect()
}

/// What a readiness probe asks.
#[derive(Debug, Clone)]
enum Probe {
    /// `PING` answered `+PONG` (not `-LOADING`).
    Redis,
    /// A Kafka `ApiVersions` request answered.
    Kafka,
    /// The AMQP 0-9-1 header answered with `Connection.Start`.
    Amqp,
    /// A PostgreSQL connection (login included) to this URL succeeds.
    Postgres(String),
}

impl Probe {
    async fn once(&self, addr: SocketAddr) -> Result<(), String> {
        match tokio::time::timeout(PROBE_LIMIT, self.ask(addr)).await {
            Ok(r) => r,
            Err(_) => Err(format!("no answer within {PROBE_LIMIT:?}")),
        }
    }

    async fn ask(&self, addr: SocketAddr) -> Result<(), String> {
        if let Probe::Postgres(url) = self {
            let conn = PgConnection::connect(url).await.map_err(|e| e.to_string())?;
            let _ = conn.close().await;
            return Ok(());
        }
        let mut s = TcpStream::connect(addr).await.map_err(|e| e.to_string())?;
        match self {
            Probe::Redis => {
                s.write_all(b"*1\r\n$4\r\nPING\r\n").await.map_err(|e| e.to_string())?;
                let mut buf = [0u8; 64];
                let n = s.read(&mut buf).await.map_err(|e| e.to_string())?;
                let answer = String::from_utf8_lossy(&buf[..n]);
                if answer.starts_with("+PONG") { Ok(()) } else { Err(format!("PING answered {:?}", answer.trim())) }
            }
            Probe::Kafka => {
                // ApiVersions v0, correlation id 7, client id "chaos" (every broker answers v0).
                let req: &[u8] = &[0, 0, 0, 15, 0, 18, 0, 0, 0, 0, 0, 7, 0, 5, b'c', b'h', b'a', b'o', b's'];
                s.write_all(req).await.map_err(|e| e.to_string())?;
                let mut head = [0u8; 8];
                s.read_exact(&mut head).await.map_err(|e| e.to_string())?;
                if head[4..8] == [0, 0, 0, 7] { Ok(()) } else { Err(format!("unexpected ApiVersions answer {head:?}")) }
            }
            Probe::Amqp => {
                s.write_all(b"AMQP\x00\x00\x09\x01").await.map_err(|e| e.to_string())?;
                let mut head = [0u8; 11];
                s.read_exact(&mut head).await.map_err(|e| e.to_string())?;
                // Method frame on channel 0, class 10 (connection), method 10 (start).
                if head[0] == 1 && head[7..11] == [0, 10, 0, 10] {
                    Ok(())
                } else {
                    Err(format!("unexpected AMQP answer {head:?}"))
                }
            }
            Probe::Postgres(_) => unreachable!("handled above"),
        }
    }
}

/// How the runner's line before each start of a server in its log begins.
const START_LINE: &str = "---- chaos runner: starting";

/// Why a server did not come up: its message, and whether its process exited before it
/// answered (a start that may succeed on another port) rather than not answering in time.
#[derive(Debug)]
struct NotReady {
    exited: bool,
    message: String,
}

impl From<String> for NotReady {
    fn from(message: String) -> Self {
        NotReady { exited: false, message }
    }
}

impl From<NotReady> for String {
    fn from(e: NotReady) -> Self {
        e.message
    }
}

/// Starts of tansu tried before its error is the run's: one that exits before it answers (its
/// listener's error unwrapped in a task, e.g. a port taken between [`free_port`] and its bind)
/// is tried again on another port.
const TANSU_STARTS: usize = 3;

/// Probe until the server answers, `limit` passes, or `exited` reports the process died.
async fn wait_ready(
    name: &str,
    addr: SocketAddr,
    probe: &Probe,
    limit: Duration,
    exited: impl Fn() -> Option<String>,
    log: &Path,
) -> Result<(), NotReady> {
    let deadline = Instant::now() + limit;
    loop {
        let last = match probe.once(addr).await {
            Ok(()) => return Ok(()),
            Err(e) => e,
        };
        if let Some(status) = exited() {
            let message = format!("{name} on {addr} exited ({status}) before it answered: {last}\n{}", log_tail(log));
            return Err(NotReady { exited: true, message });
        }
        if Instant::now() >= deadline {
            return Err(format!("{name} on {addr} did not answer within {limit:?}: {last}\n{}", log_tail(log)).into());
        }
        tokio::time::sleep(PROBE_PAUSE).await;
    }
}

/// A server process the runner started and owns: its data directory, log and child.
struct OwnedProcess {
    name: &'static str,
    launch: Launch,
    addr: SocketAddr,
    probe: Probe,
    ready_limit: Duration,
    log: PathBuf,
    /// Length of the log when the process last started: what it wrote since is after it.
    log_start: AtomicU64,
    child: Mutex<Option<Child>>,
    /// Serializes restarts.
    restarting: tokio::sync::Mutex<()>,
    /// Removed (with everything in it) when the process is dropped, after the kill.
    dir: TempDir,
}

/// What an [`OwnedProcess`] runs, at its start and at every restart.
struct Launch {
    program: PathBuf,
    args: Vec<OsString>,
    /// Environment variables set on the process, besides the runner's own.
    env: &'static [(&'static str, &'static str)],
}

impl OwnedProcess {
    async fn start(
        name: &'static str,
        launch: Launch,
        addr: SocketAddr,
        probe: Probe,
        ready_limit: Duration,
        dir: TempDir,
    ) -> Result<OwnedProcess, NotReady> {
        let log = dir.path().join(format!("{name}.log"));
        let p = OwnedProcess {
            name,
            launch,
            addr,
            probe,
            ready_limit,
            log,
            log_start: AtomicU64::new(0),
            child: Mutex::new(None),
            restarting: tokio::sync::Mutex::new(()),
            dir,
        };
        p.spawn()?;
        p.wait_ready().await?;
        Ok(p)
    }

    fn spawn(&self) -> Result<(), String> {
        let log = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .map_err(|e| format!("{}: cannot open {}: {e}", self.name, self.log.display()))?;
        let _ = writeln!(&log, "{START_LINE} {} ----", self.name);
        self.log_start.store(log.metadata().map(|m| m.len()).unwrap_or(0), Ordering::SeqCst);
        let err = log.try_clone().map_err(|e| format!("{}: {e}", self.name))?;
        let child = Command::new(&self.launch.program)
            .args(&self.launch.args)
            .envs(self.launch.env.iter().copied())
            .current_dir(self.dir.path())
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(err)
            .spawn()
            .map_err(|e| format!("{}: cannot start {}: {e}", self.name, self.launch.program.display()))?;
        *self.child.lock().unwrap_or_else(PoisonError::into_inner) = Some(child);
        Ok(())
    }

    /// SIGKILL and reap (immediate: the process cannot block SIGKILL).
    fn kill(&self) {
        if let Some(mut child) = self.child.lock().unwrap_or_else(PoisonError::into_inner).take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    fn exited(&self) -> Option<String> {
        let mut guard = self.child.lock().unwrap_or_else(PoisonError::into_inner);
        match guard.as_mut().map(Child::try_wait) {
            None => Some("not running".into()),
            Some(Ok(Some(status))) => Some(status.to_string()),
            Some(Ok(None)) => None,
            Some(Err(e)) => Some(e.to_string()),
        }
    }

    async fn wait_ready(&self) -> Result<(), NotReady> {
        wait_ready(self.name, self.addr, &self.probe, self.ready_limit, || self.exited(), &self.log).await
    }

    /// The first panic the process logged since its last start (see [`panic_in_log`]).
    fn panic_since_start(&self) -> Option<String> {
        panic_in_log(&self.log, self.log_start.load(Ordering::SeqCst))
    }

    async fn restart(&self) -> Result<Duration, String> {
        let _one = self.restarting.lock().await;
        let t0 = Instant::now();
        self.kill();
        self.spawn()?;
        self.wait_ready().await?;
        Ok(t0.elapsed())
    }
}

impl Drop for OwnedProcess {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A Redis the runner owns: `redis-server` on a free port, data in a temporary directory,
/// every write fsynced to the append-only file before it is acknowledged (`appendfsync always`),
/// so SIGKILL loses nothing acknowledged.
pub(crate) struct RedisNode {
    proc: OwnedProcess,
}

impl RedisNode {
    /// Start it and wait until it answers `PING` (bounded).
    pub(crate) async fn start() -> Result<RedisNode, String> {
        let program = find_binary("redis-server", "redis", &[])?;
        let dir = temp_dir("redis")?;
        let port = free_port()?;
        let args = vec![
            OsString::from("--port"),
            port.to_string().into(),
            "--bind".into(),
            "127.0.0.1".into(),
            "--appendonly".into(),
            "yes".into(),
            "--appendfsync".into(),
            "always".into(),
            "--save".into(),
            "".into(),
            "--dir".into(),
            dir.path().into(),
            "--daemonize".into(),
            "no".into(),
            "--protected-mode".into(),
            "yes".into(),
        ];
        let proc = OwnedProcess::start(
            "redis",
            Launch { program, args, env: &[] },
            loopback(port),
            Probe::Redis,
            REDIS_READY,
            dir,
        )
        .await?;
        Ok(RedisNode { proc })
    }

    /// `redis://<addr>` (this node at its own address).
    pub(crate) fn url(&self) -> String {
        self.url_at(self.proc.addr)
    }
}

#[async_trait]
impl Server for RedisNode {
    fn name(&self) -> &str {
        "redis"
    }

    fn addr(&self) -> SocketAddr {
        self.proc.addr
    }

    fn url_at(&self, addr: SocketAddr) -> String {
        format!("redis://{addr}")
    }

    /// SIGKILL, start on the same port and directory, wait for `PING` (after the AOF is loaded).
    async fn restart(&self) -> Result<Duration, String> {
        self.proc.restart().await
    }
}

/// A tansu (Kafka-protocol broker) the runner owns, with the SQLite storage engine
/// (`sqlite://tansu.db`, WAL journal) in a temporary directory: topics, records and committed
/// offsets survive SIGKILL, unlike `memory://`.
///
/// tansu tells clients, in metadata, where to reach it: the advertised listener. It is the
/// Kafka [`FaultProxy`]'s address, so that clients keep going through the proxy after the
/// bootstrap; create the proxy first (see [`start_behind`](Self::start_behind)).
pub(crate) struct TansuNode {
    proc: OwnedProcess,
    advertised: SocketAddr,
}

impl TansuNode {
    /// The tansu binary: `tansu` on `PATH`, else `~/.cargo/bin/tansu`.
    pub(crate) fn binary() -> Result<PathBuf, String> {
        let cargo_bin =
            std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cargo/bin")).into_iter().collect::<Vec<_>>();
        let path = std::env::var_os("PATH").unwrap_or_default();
        std::env::split_paths(&path)
            .chain(cargo_bin)
            .map(|d| d.join("tansu"))
            .find(|p| p.is_file())
            .ok_or_else(|| missing("tansu", "kafka"))
    }

    /// Start tansu on a free port, advertising `advertised`, and wait until it answers
    /// `ApiVersions` (bounded).
    pub(crate) async fn start(advertised: SocketAddr) -> Result<TansuNode, String> {
        Self::start_on(advertised, free_port).await
    }

    /// [`start`](Self::start) on the ports `port` hands out, one per start: a start whose
    /// process exits before it answers is tried again on the next, up to [`TANSU_STARTS`].
    async fn start_on(
        advertised: SocketAddr,
        mut port: impl FnMut() -> Result<u16, String>,
    ) -> Result<TansuNode, String> {
        if !advertised.ip().is_loopback() {
            return Err(format!("tansu: advertised address {advertised} is not a loopback address"));
        }
        let mut attempt = 1;
        loop {
            match Self::start_once(advertised, port()?).await {
                Ok(node) => return Ok(node),
                Err(e) if e.exited && attempt < TANSU_STARTS => {
                    eprintln!(
                        "chaos: tansu start {attempt} of {TANSU_STARTS} failed, trying another port: {}",
                        e.message
                    );
                    attempt += 1;
                }
                Err(e) => return Err(e.message),
            }
        }
    }

    /// One start of tansu on `port`, in a new directory.
    async fn start_once(advertised: SocketAddr, port: u16) -> Result<TansuNode, NotReady> {
        let program = Self::binary()?;
        let dir = temp_dir("tansu")?;
        let args = vec![
            OsString::from("broker"),
            "--cluster-id".into(),
            "chaos".into(),
            "--listener-url".into(),
            format!("tcp://127.0.0.1:{port}").into(),
            "--advertised-listener-url".into(),
            format!("tcp://{advertised}").into(),
            // Relative to the working directory (the temporary directory): tansu resolves the
            // URL's host + path under its current directory.
            "--storage-engine".into(),
            "sqlite://tansu.db".into(),
        ];
        let proc = OwnedProcess::start(
            "kafka",
            Launch { program, args, env: TANSU_ENV },
            loopback(port),
            Probe::Kafka,
            TANSU_READY,
            dir,
        )
        .await?;
        let node = TansuNode { proc, advertised };
        index_tansu_headers(&node.storage_file())?;
        Ok(node)
    }

    /// Start tansu advertising `proxy`'s address, and point the proxy at it.
    pub(crate) async fn start_behind(proxy: &FaultProxy) -> Result<TansuNode, String> {
        let node = Self::start(proxy.addr()).await?;
        proxy.set_upstream(node.addr()).map_err(|e| e.to_string())?;
        Ok(node)
    }

    /// The address tansu advertises to clients.
    pub(crate) fn advertised(&self) -> SocketAddr {
        self.advertised
    }

    /// The database file (for inspection).
    pub(crate) fn storage_file(&self) -> PathBuf {
        self.proc.dir.path().join("tansu.db")
    }
}

#[async_trait]
impl Server for TansuNode {
    fn name(&self) -> &str {
        "kafka"
    }

    fn addr(&self) -> SocketAddr {
        self.proc.addr
    }

    fn url_at(&self, addr: SocketAddr) -> String {
        format!("kafka://{addr}")
    }

    /// SIGKILL, start with the same storage, wait for `ApiVersions`.
    async fn restart(&self) -> Result<Duration, String> {
        self.proc.restart().await
    }

    fn failed_internally(&self) -> Option<String> {
        self.proc.panic_since_start()
    }

    fn log_file(&self) -> Option<PathBuf> {
        Some(self.proc.log.clone())
    }
}

/// tansu logs nothing by default; its group coordinator's `info` lines (a member evicted for a
/// missed heartbeat, a new leader) are few, and what to read when a consumer group stops
/// consuming (see [`Server::log_file`]).
const TANSU_ENV: &[(&str, &str)] = &[("RUST_LOG", "tansu_broker::coordinator::group=info")];

/// Name of the index [`index_tansu_headers`] adds to tansu's database.
pub(crate) const TANSU_HEADER_INDEX: &str = "outbox_chaos_header_record";

/// Add the index tansu's fetch needs and its SQLite schema lacks, once, after tansu first
/// created its tables.
///
/// tansu 0.6 reads each fetched record's headers with a query that joins `header` on
/// `(topition, offset_id)`, and its schema (`ddl/040-header.sql`) has no index there: every
/// record fetched scans every header stored. A fetch's cost grows with the whole topic's size,
/// not with what it returns. A consumer group that starts at the beginning of a long run's topic
/// (the audit group, 72,000 events) gets one fetch of up to 5 MB of records; tansu takes longer
/// than librdkafka's 60 s socket timeout to answer, librdkafka drops the connection and asks
/// again, and the group reads nothing, ever. Measured on tansu alone: 72,000 events read by a
/// fresh group, none in 300 s without the index, all in 42 s with it. The live consumers pay
/// the same scan per record, a little more every minute of a long run.
///
/// It is the broker's missing index, not a fault the run injects, and it stays out of the
/// Kafka adapter: a real Kafka broker has no such table. tansu creates its tables with
/// `create table if not exists` at every start, so the index, in the database file, survives
/// its restarts (the SIGKILL test below checks the plan after one).
fn index_tansu_headers(db: &Path) -> Result<(), String> {
    use outbox_store_sqlite::rusqlite::{Connection, OpenFlags};
    let failed = |e: outbox_store_sqlite::rusqlite::Error| {
        format!("kafka (tansu): indexing the header table of {}: {e}", db.display())
    };
    let conn = Connection::open_with_flags(db, OpenFlags::SQLITE_OPEN_READ_WRITE).map_err(failed)?;
    conn.busy_timeout(Duration::from_secs(30)).map_err(failed)?;
    conn.execute_batch(&format!("CREATE INDEX IF NOT EXISTS {TANSU_HEADER_INDEX} ON header (topition, offset_id)"))
        .map_err(failed)
}

/// How [`PgNode::restart_with`] stops PostgreSQL.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PgStop {
    /// `pg_ctl -m immediate`: processes quit without a checkpoint; the start is a crash
    /// recovery from the WAL.
    Immediate,
    /// `pg_ctl -m fast`: connections are terminated, a checkpoint is written.
    Fast,
}

impl PgStop {
    fn as_str(self) -> &'static str {
        match self {
            PgStop::Immediate => "immediate",
            PgStop::Fast => "fast",
        }
    }
}

/// A PostgreSQL cluster the runner owns: `initdb` in a temporary directory, listening on
/// 127.0.0.1 on a free port (its Unix socket in the same directory), trust authentication,
/// database [`PG_DATABASE`]. PostgreSQL refuses to run as root, so as root the cluster belongs
/// to the `postgres` OS user and `initdb` / `pg_ctl` run through `runuser`.
pub(crate) struct PgNode {
    bin: PathBuf,
    dir: TempDir,
    data: PathBuf,
    log: PathBuf,
    port: u16,
    as_postgres_user: bool,
    /// Whether `pg_ctl start` ran (so that drop knows to stop it).
    started: AtomicBool,
    restarts: AtomicU64,
    restarting: tokio::sync::Mutex<()>,
}

impl PgNode {
    /// Directory of `initdb`, `pg_ctl` and `postgres`: the newest `/usr/lib/postgresql/*/bin`
    /// that has all three, else `PATH`.
    pub(crate) fn bin_dir() -> Result<PathBuf, String> {
        let mut versions: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| Some((e.file_name().to_str()?.parse::<u32>().ok()?, e.path().join("bin"))))
            .filter(|(_, bin)| ["initdb", "pg_ctl", "postgres"].iter().all(|b| bin.join(b).is_file()))
            .collect();
        versions.sort();
        if let Some((_, bin)) = versions.pop() {
            return Ok(bin);
        }
        let pg_ctl = find_binary("pg_ctl", "postgres", &[])?;
        for b in ["initdb", "postgres"] {
            find_binary(b, "postgres", &[])?;
        }
        Ok(pg_ctl.parent().map(Path::to_path_buf).unwrap_or_default())
    }

    /// `initdb`, start, create [`PG_DATABASE`]; waits (bounded) until it accepts connections.
    pub(crate) async fn start() -> Result<PgNode, String> {
        let bin = Self::bin_dir()?;
        let dir = temp_dir("pg")?;
        let as_postgres_user = std::fs::metadata(dir.path()).map_err(|e| format!("postgres: {e}"))?.uid() == 0;
        if as_postgres_user {
            let chown = find_binary("chown", "postgres", &[])?;
            run(
                "postgres: chown of the temporary directory to the postgres user",
                &chown,
                &[OsString::from("-R"), "postgres:postgres".into(), dir.path().into()],
                dir.path(),
                Duration::from_secs(30),
            )
            .await?;
        }
        let data = dir.path().join("data");
        let log = dir.path().join("postgres.log");
        let port = free_port()?;
        let node = PgNode {
            bin,
            data,
            log,
            port,
            as_postgres_user,
            started: AtomicBool::new(false),
            restarts: AtomicU64::new(0),
            restarting: Default::default(),
            dir,
        };
        let mut initdb_args = vec![OsString::from("-D"), node.data.clone().into()];
        initdb_args.extend(os(&["-A", "trust", "-U", "postgres", "-E", "UTF8", "--locale=C", "--no-sync"]));
        node.tool("postgres: initdb", "initdb", initdb_args, Duration::from_secs(120)).await?;
        let conf = format!(
            "\n# chaos runner\nlisten_addresses = '127.0.0.1'\nport = {port}\nunix_socket_directories = '{}'\n\
             max_connections = 300\nfsync = on\nsynchronous_commit = on\nfull_page_writes = on\n",
            node.dir.path().display()
        );
        OpenOptions::new()
            .append(true)
            .open(node.data.join("postgresql.conf"))
            .and_then(|mut f| f.write_all(conf.as_bytes()))
            .map_err(|e| format!("postgres: cannot write postgresql.conf: {e}"))?;
        let mut start = node.pg_ctl_args("start");
        start.extend(os(&["-t", "60"]));
        node.started.store(true, Ordering::SeqCst);
        node.tool("postgres: pg_ctl start", "pg_ctl", start, PG_READY + Duration::from_secs(10)).await?;
        wait_ready("postgres", node.addr(), &Probe::Postgres(node.url_db("postgres")), PG_READY, || None, &node.log)
            .await?;
        let mut conn = PgConnection::connect(&node.url_db("postgres")).await.map_err(|e| format!("postgres: {e}"))?;
        outbox_store_postgres::sqlx::query("CREATE DATABASE chaos")
            .execute(&mut conn)
            .await
            .map_err(|e| format!("postgres: CREATE DATABASE {PG_DATABASE}: {e}"))?;
        let _ = conn.close().await;
        Ok(node)
    }

    fn url_db(&self, db: &str) -> String {
        format!("postgres://postgres:postgres@127.0.0.1:{}/{db}", self.port)
    }

    /// The URL of [`PG_DATABASE`] at the node's own address.
    pub(crate) fn url(&self) -> String {
        self.url_db(PG_DATABASE)
    }

    /// `pg_ctl <action> -D data -l log -w`.
    fn pg_ctl_args(&self, action: &str) -> Vec<OsString> {
        vec![
            OsString::from(action),
            "-D".into(),
            self.data.clone().into(),
            "-l".into(),
            self.log.clone().into(),
            "-w".into(),
        ]
    }

    /// Program and arguments of a PostgreSQL tool, through `runuser -u postgres --` as root.
    fn tool_command(&self, tool: &str, args: Vec<OsString>) -> (PathBuf, Vec<OsString>) {
        let program = self.bin.join(tool);
        if self.as_postgres_user {
            let mut a = os(&["-u", "postgres", "--"]);
            a.push(program.into());
            a.extend(args);
            (PathBuf::from("runuser"), a)
        } else {
            (program, args)
        }
    }

    async fn tool(&self, what: &str, tool: &str, args: Vec<OsString>, limit: Duration) -> Result<String, String> {
        let (program, args) = self.tool_command(tool, args);
        run(what, &program, &args, self.dir.path(), limit).await.map_err(|e| format!("{e}\n{}", log_tail(&self.log)))
    }

    /// Restart with the given stop mode; returns the downtime (until a connection succeeds).
    pub(crate) async fn restart_with(&self, mode: PgStop) -> Result<Duration, String> {
        let _one = self.restarting.lock().await;
        let t0 = Instant::now();
        let mut args = self.pg_ctl_args("restart");
        args.extend(os(&["-m", mode.as_str(), "-t", "60"]));
        self.tool(
            &format!("postgres: pg_ctl restart -m {}", mode.as_str()),
            "pg_ctl",
            args,
            PG_READY + Duration::from_secs(10),
        )
        .await?;
        wait_ready("postgres", self.addr(), &Probe::Postgres(self.url()), PG_READY, || None, &self.log).await?;
        Ok(t0.elapsed())
    }

    /// The mode the next [`Server::restart`] uses (immediate first, then alternating).
    pub(crate) fn next_stop(&self) -> PgStop {
        if self.restarts.load(Ordering::Relaxed).is_multiple_of(2) { PgStop::Immediate } else { PgStop::Fast }
    }
}

#[async_trait]
impl Server for PgNode {
    fn name(&self) -> &str {
        "postgres"
    }

    fn addr(&self) -> SocketAddr {
        loopback(self.port)
    }

    fn url_at(&self, addr: SocketAddr) -> String {
        format!("postgres://postgres:postgres@{addr}/{PG_DATABASE}")
    }

    /// `pg_ctl restart`, `-m immediate` and `-m fast` in turn, then wait for a connection.
    async fn restart(&self) -> Result<Duration, String> {
        let mode = if self.restarts.fetch_add(1, Ordering::Relaxed).is_multiple_of(2) {
            PgStop::Immediate
        } else {
            PgStop::Fast
        };
        self.restart_with(mode).await
    }
}

impl Drop for PgNode {
    fn drop(&mut self) {
        if !self.started.load(Ordering::SeqCst) {
            return;
        }
        let mut args = self.pg_ctl_args("stop");
        args.extend(os(&["-m", "immediate", "-t", "30"]));
        let (program, args) = self.tool_command("pg_ctl", args);
        if let Err(e) = run_blocking(&program, &args, self.dir.path(), Duration::from_secs(40)) {
            // The directory goes away anyway; a server left running would hold its port.
            eprintln!("chaos: stopping the runner's PostgreSQL failed: {e}");
        }
    }
}

/// The machine's RabbitMQ node (`scripts/services ensure rabbitmq`, AMQP on 127.0.0.1:5672),
/// restarted with `rabbitmqctl stop_app` / `start_app`: durable queues and persistent,
/// confirmed messages survive it.
///
/// While the application is stopped a guard is armed: if the restart is abandoned (its future
/// dropped, a panic) or the node is dropped, `rabbitmqctl start_app` runs, so a failing runner
/// does not leave the machine without RabbitMQ.
pub(crate) struct RabbitNode {
    ctl: PathBuf,
    app_stopped: Arc<AtomicBool>,
    restarting: tokio::sync::Mutex<()>,
}

/// Runs `rabbitmqctl start_app` on drop while the application is marked stopped.
struct StartAppGuard {
    ctl: PathBuf,
    app_stopped: Arc<AtomicBool>,
}

impl StartAppGuard {
    fn restore(&self) {
        if self.app_stopped.load(Ordering::SeqCst) {
            match run_blocking(&self.ctl, &os(&["start_app"]), Path::new("/"), RABBITMQCTL_LIMIT) {
                Ok(()) => self.app_stopped.store(false, Ordering::SeqCst),
                Err(e) => eprintln!("chaos: `rabbitmqctl start_app` failed, RabbitMQ may be stopped: {e}"),
            }
        }
    }
}

impl Drop for StartAppGuard {
    fn drop(&mut self) {
        self.restore();
    }
}

impl RabbitNode {
    /// Find `rabbitmqctl` and check that the node answers AMQP on 127.0.0.1:5672 (bounded).
    pub(crate) async fn connect() -> Result<RabbitNode, String> {
        let ctl = find_binary(
            "rabbitmqctl",
            "rabbitmq",
            &[PathBuf::from("/usr/sbin"), PathBuf::from("/usr/lib/rabbitmq/bin")],
        )?;
        Probe::Amqp.once(RABBIT_ADDR).await.map_err(|e| {
            format!("rabbitmq: nothing answers AMQP on {RABBIT_ADDR} ({e}); start it with `scripts/services ensure rabbitmq`")
        })?;
        Ok(RabbitNode { ctl, app_stopped: Arc::new(AtomicBool::new(false)), restarting: Default::default() })
    }

    /// `amqp://guest:guest@127.0.0.1:5672/%2f`.
    pub(crate) fn url(&self) -> String {
        self.url_at(RABBIT_ADDR)
    }
}

#[async_trait]
impl Server for RabbitNode {
    fn name(&self) -> &str {
        "rabbitmq"
    }

    fn addr(&self) -> SocketAddr {
        RABBIT_ADDR
    }

    fn url_at(&self, addr: SocketAddr) -> String {
        format!("amqp://guest:guest@{addr}/%2f")
    }

    /// `rabbitmqctl stop_app`, `start_app`, then wait for the AMQP handshake.
    async fn restart(&self) -> Result<Duration, String> {
        let _one = self.restarting.lock().await;
        let guard = StartAppGuard { ctl: self.ctl.clone(), app_stopped: Arc::clone(&self.app_stopped) };
        let t0 = Instant::now();
        self.app_stopped.store(true, Ordering::SeqCst);
        let stopped =
            run("rabbitmq: rabbitmqctl stop_app", &self.ctl, &os(&["stop_app"]), Path::new("/"), RABBITMQCTL_LIMIT)
                .await;
        run("rabbitmq: rabbitmqctl start_app", &self.ctl, &os(&["start_app"]), Path::new("/"), RABBITMQCTL_LIMIT)
            .await?;
        self.app_stopped.store(false, Ordering::SeqCst);
        drop(guard);
        stopped?;
        let log = PathBuf::from("/var/log/rabbitmq");
        wait_ready("rabbitmq", RABBIT_ADDR, &Probe::Amqp, RABBIT_READY, || None, &log).await?;
        Ok(t0.elapsed())
    }
}

impl Drop for RabbitNode {
    fn drop(&mut self) {
        StartAppGuard { ctl: self.ctl.clone(), app_stopped: Arc::clone(&self.app_stopped) }.restore();
    }
}

#[cfg(test)]
mod tests {
    use std::io::{BufRead, BufReader};

    use outbox_core::{Broker, ConsumerGroup, Destination, Event, EventId};
    use outbox_store_postgres::sqlx;

    use super::*;

    /// tansu 0.6's storage task panicked in a 30-minute run (its log, colours and all): the
    /// panic is found after the start it followed, and not before it.
    #[test]
    fn a_panic_in_the_log_since_the_last_start_is_found() {
        let dir = temp_dir("panic-log").unwrap();
        let log = dir.path().join("kafka.log");
        let before = "---- chaos runner: starting kafka ----\nthread 'x' panicked at old.rs:1:1:\nold\n";
        std::fs::write(&log, before).unwrap();
        let start = before.len() as u64;
        assert_eq!(panic_in_log(&log, start), None, "an earlier run's panic counts");
        let mut f = OpenOptions::new().append(true).open(&log).unwrap();
        write!(
            f,
            "\u{1b}[2m2026-12-02T05:00:00Z\u{1b}[0m \u{1b}[31mERROR\u{1b}[0m tansu_storage::lite: err=Api(DuplicateSequenceNumber)\n\n\
             thread 'tokio-rt-worker' (22893) panicked at tansu-storage-0.6.0/src/lite.rs:503:13:\n\
             more or less than one row\nstack backtrace:\n"
        )
        .unwrap();
        assert_eq!(
            panic_in_log(&log, start).as_deref(),
            Some(
                "thread 'tokio-rt-worker' (22893) panicked at tansu-storage-0.6.0/src/lite.rs:503:13:: more or less than \
                 one row"
            )
        );
        assert_eq!(panic_in_log(&dir.path().join("none.log"), 0), None);
    }

    /// Ports for the runner's servers: below the kernel's ephemeral range (where no outgoing
    /// connection can take one between the check and the server's bind), and never the same
    /// twice in one process.
    #[test]
    fn free_ports_are_below_the_ephemeral_range_and_never_repeat() {
        let high = ephemeral_low().expect("Linux names its ephemeral range");
        let ports: Vec<u16> = (0..50).map(|_| free_port().unwrap()).collect();
        let distinct: std::collections::BTreeSet<u16> = ports.iter().copied().collect();
        assert_eq!(distinct.len(), ports.len(), "a port handed out twice: {ports:?}");
        for port in ports {
            assert!(u32::from(port) >= LOWEST_PORT && u32::from(port) < high, "{port} outside [{LOWEST_PORT}, {high})");
        }
    }

    /// A server that panics at its start (tansu unwraps its listener's error in a task) prints a
    /// backtrace that fills the last lines of its log: the start's error names the panic of that
    /// start, not an earlier one's.
    #[test]
    fn a_start_error_names_the_panic_above_its_backtrace() {
        let dir = temp_dir("panic-tail").unwrap();
        let log = dir.path().join("kafka.log");
        let mut text = String::from(
            "---- chaos runner: starting kafka ----\nthread 'x' panicked at old.rs:1:1:\nan earlier start's\n\
             ---- chaos runner: starting kafka ----\n\
             thread 'tokio-rt-worker' panicked at tansu-broker-0.6.0/src/broker.rs:137:18:\n\
             called `Result::unwrap()` on an `Err` value: Io(Os { code: 98, kind: AddrInUse })\nstack backtrace:\n",
        );
        for i in 0..30 {
            text.push_str(&format!("  {i}: frame\n"));
        }
        std::fs::write(&log, text).unwrap();
        let tail = log_tail(&log);
        assert!(
            tail.starts_with(
                "panic since the last start: thread 'tokio-rt-worker' panicked at tansu-broker-0.6.0/src/broker.rs:137:18:: \
                 called `Result::unwrap()` on an `Err` value: Io(Os { code: 98, kind: AddrInUse })\nlast lines of"
            ),
            "{tail}"
        );
        assert!(tail.ends_with("29: frame"), "{tail}");
        std::fs::write(
            &log,
            "---- chaos runner: starting kafka ----\nthread 'x' panicked at old.rs:1:1:\nold\n\
                              ---- chaos runner: starting kafka ----\nready\n",
        )
        .unwrap();
        assert!(log_tail(&log).starts_with("last lines of"), "an earlier start's panic is not this start's");
    }

    /// A reply of a Redis command, flattened to text (`+OK`, `:3`, `$id`, `*2[...]`).
    fn resp_read(r: &mut impl BufRead) -> String {
        let mut line = String::new();
        r.read_line(&mut line).unwrap();
        let line = line.trim_end().to_string();
        let (kind, rest) = line.split_at(1);
        match kind {
            "$" if rest == "-1" => "nil".into(),
            "$" => {
                let n: usize = rest.parse().unwrap();
                let mut buf = vec![0u8; n + 2];
                r.read_exact(&mut buf).unwrap();
                String::from_utf8_lossy(&buf[..n]).into_owned()
            }
            "*" => {
                let n: i64 = rest.parse().unwrap();
                let items: Vec<String> = (0..n.max(0)).map(|_| resp_read(r)).collect();
                format!("[{}]", items.join(","))
            }
            _ => line,
        }
    }

    /// One Redis command over a fresh connection (blocking; 5 s timeouts).
    fn redis(addr: SocketAddr, args: &[&str]) -> String {
        let s = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(5)).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut cmd = format!("*{}\r\n", args.len());
        for a in args {
            cmd.push_str(&format!("${}\r\n{a}\r\n", a.len()));
        }
        (&s).write_all(cmd.as_bytes()).unwrap();
        resp_read(&mut BufReader::new(s))
    }

    #[test]
    fn a_missing_binary_names_the_install_command() {
        let err = find_binary("surely-not-a-binary-xyz", "redis", &[]).unwrap_err();
        assert!(err.contains("surely-not-a-binary-xyz") && err.contains("scripts/services ensure redis"), "{err}");
    }

    #[tokio::test]
    async fn redis_keeps_an_acknowledged_xadd_across_sigkill() {
        let node = RedisNode::start().await.unwrap();
        let addr = node.addr();
        let dir = node.proc.dir.path().to_path_buf();
        let id = redis(addr, &["XADD", "chaos-stream", "*", "k", "v1"]);
        assert!(id.contains('-'), "XADD answered {id}");
        let downtime = node.restart().await.unwrap();
        eprintln!("redis restart downtime: {downtime:?}");
        assert_eq!(redis(addr, &["XLEN", "chaos-stream"]), ":1");
        assert_eq!(redis(addr, &["XRANGE", "chaos-stream", "-", "+"]), format!("[[{id},[k,v1]]]"));
        drop(node);
        assert!(!dir.exists(), "temporary directory left behind");
        assert!(std::net::TcpStream::connect(addr).is_err(), "redis still listening after drop");
    }

    #[tokio::test]
    async fn postgres_keeps_a_committed_row_across_an_immediate_restart() {
        let node = PgNode::start().await.unwrap();
        let dir = node.dir.path().to_path_buf();
        let mut conn = PgConnection::connect(&node.url()).await.unwrap();
        sqlx::query("CREATE TABLE chaos_t (v text)").execute(&mut conn).await.unwrap();
        sqlx::query("INSERT INTO chaos_t VALUES ('committed')").execute(&mut conn).await.unwrap();
        drop(conn);
        assert_eq!(node.next_stop(), PgStop::Immediate);
        let immediate = node.restart().await.unwrap();
        assert_eq!(node.next_stop(), PgStop::Fast);
        let mut conn = PgConnection::connect(&node.url()).await.unwrap();
        let v: String = sqlx::query_scalar("SELECT v FROM chaos_t").fetch_one(&mut conn).await.unwrap();
        assert_eq!(v, "committed");
        drop(conn);
        let fast = node.restart().await.unwrap();
        eprintln!("postgres restart downtime: immediate {immediate:?}, fast {fast:?}");
        let mut conn = PgConnection::connect(&node.url()).await.unwrap();
        let n: i64 = sqlx::query_scalar("SELECT count(*) FROM chaos_t").fetch_one(&mut conn).await.unwrap();
        assert_eq!(n, 1);
        drop(conn);
        let addr = node.addr();
        drop(node);
        assert!(!dir.exists(), "temporary directory left behind");
        assert!(std::net::TcpStream::connect(addr).is_err(), "postgres still listening after drop");
    }

    fn event(dest: &Destination, id: &str) -> Event {
        Event::new(EventId::new(id).unwrap(), dest.clone(), format!("payload {id}").into_bytes()).with_key("k")
    }

    async fn next_event(sub: &mut Box<dyn outbox_core::Subscription>, what: &str) -> outbox_core::Delivery {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(d) = sub.next(Duration::from_secs(1)).await.unwrap() {
                return d;
            }
            assert!(Instant::now() < deadline, "{what}: nothing delivered within 30 s");
        }
    }

    #[tokio::test]
    async fn rabbitmq_keeps_a_confirmed_message_across_stop_app_start_app() {
        use outbox_broker_amqp::{AmqpBroker, AmqpConfig};
        let node = match RabbitNode::connect().await {
            Ok(n) => n,
            Err(e) if std::env::var("CI").as_deref() != Ok("true") => {
                eprintln!("SKIPPED: {e}");
                return;
            }
            Err(e) => panic!("{e}"),
        };
        let suffix = std::process::id();
        let dest = Destination::new(format!("chaos-restart-{suffix}")).unwrap();
        let group = ConsumerGroup::new("g").unwrap();
        let broker = AmqpBroker::new(AmqpConfig::from_url(&node.url()).unwrap());
        broker.declare(&dest, std::slice::from_ref(&group)).await.unwrap();
        broker.publish(&event(&dest, "survivor-1")).await.unwrap();
        broker.close().await;
        drop(broker);

        let downtime = node.restart().await.unwrap();
        eprintln!("rabbitmq restart downtime: {downtime:?}");

        let broker = AmqpBroker::new(AmqpConfig::from_url(&node.url()).unwrap());
        let mut sub = broker.subscribe(&dest, &group).await.unwrap();
        let d = next_event(&mut sub, "rabbitmq after restart").await;
        assert_eq!(d.event.id.as_str(), "survivor-1");
        d.ack().await.unwrap();
        drop(sub);
        broker.delete(&dest, &[group]).await.unwrap();
        broker.close().await;
    }

    /// Whether tansu is installed; without it a test skips loudly, and under `CI=true` fails.
    fn tansu_installed() -> bool {
        let Err(e) = TansuNode::binary() else { return true };
        assert!(std::env::var("CI").as_deref() != Ok("true"), "{e}");
        eprintln!("SKIPPED: {e}");
        false
    }

    /// A tansu whose port another process took between [`free_port`] and its bind exits before
    /// it answers (its listener's error unwrapped in a task): the start is tried again on the
    /// next port, and the node that comes up answers there, while the port's holder keeps it.
    #[tokio::test]
    async fn a_tansu_start_on_a_taken_port_is_tried_again_on_another() {
        if !tansu_installed() {
            return;
        }
        let taken = StdListener::bind((Ipv4Addr::LOCALHOST, free_port().unwrap())).unwrap();
        let taken_port = taken.local_addr().unwrap().port();
        let mut handed = Vec::new();
        let mut ports = [taken_port, free_port().unwrap()].into_iter();
        let advertised = loopback(free_port().unwrap());
        let node = TansuNode::start_on(advertised, || {
            let port = ports.next().ok_or("a third port asked for")?;
            handed.push(port);
            Ok(port)
        })
        .await
        .unwrap();
        assert_eq!(handed.len(), 2, "ports handed out: {handed:?}");
        assert_eq!(node.addr().port(), handed[1], "the node is not on the second port");
        Probe::Kafka.once(node.addr()).await.unwrap();
        assert_eq!(taken.local_addr().unwrap().port(), taken_port);

        // One port, and it is taken: the start's error says the process exited before it
        // answered, and names its panic.
        let err = TansuNode::start_on(advertised, || Ok(taken_port)).await.err().expect("a start on a taken port");
        assert!(err.contains("exited") && err.contains("before it answered"), "{err}");
        assert!(err.contains("panic since the last start"), "{err}");
        drop(taken);
    }

    #[tokio::test]
    async fn tansu_keeps_topics_records_and_committed_offsets_across_sigkill() {
        use outbox_broker_kafka::{KafkaBroker, KafkaConfig};
        if !tansu_installed() {
            return;
        }
        // The proxy first: tansu advertises its address.
        let placeholder = loopback(free_port().unwrap());
        let proxy = FaultProxy::start("kafka", placeholder).await.unwrap();
        let node = TansuNode::start_behind(&proxy).await.unwrap();
        assert_eq!(proxy.upstream(), node.addr());
        assert!(node.storage_file().exists(), "no SQLite file at {}", node.storage_file().display());
        let url = node.url_at(proxy.addr());

        let dest = Destination::new("chaos-durable").unwrap();
        let group = ConsumerGroup::new("g").unwrap();
        let broker = KafkaBroker::connect(KafkaConfig::from_url(&url).unwrap()).await.unwrap();
        broker.declare(&dest, std::slice::from_ref(&group)).await.unwrap();
        for i in 1..=3 {
            broker.publish(&event(&dest, &format!("e{i}"))).await.unwrap();
        }
        // A member that lives through the restart (as the runner's consumers do).
        let mut sub = broker.subscribe(&dest, &group).await.unwrap();
        let d = next_event(&mut sub, "kafka before restart").await;
        assert_eq!(d.event.id.as_str(), "e1");
        d.ack().await.unwrap();

        let downtime = node.restart().await.unwrap();
        eprintln!("tansu restart downtime: {downtime:?}");

        // Durable state, read from the storage engine itself: the topic, the 3 records and the
        // group's committed offset (past e1); and tansu's header lookup (its `header_fetch.sql`)
        // goes through the runner's index, added at the first start, instead of scanning every
        // header.
        {
            use outbox_store_sqlite::rusqlite::{Connection, OpenFlags};
            let db = Connection::open_with_flags(node.storage_file(), OpenFlags::SQLITE_OPEN_READ_ONLY).unwrap();
            db.busy_timeout(Duration::from_secs(10)).unwrap();
            let topic: String = db.query_row("select name from topic", [], |r| r.get(0)).unwrap();
            let records: i64 = db.query_row("select count(*) from record", [], |r| r.get(0)).unwrap();
            let committed: i64 =
                db.query_row("select committed_offset from consumer_offset", [], |r| r.get(0)).unwrap();
            assert_eq!((topic.as_str(), records, committed), ("chaos-durable", 3, 1), "tansu storage after restart");
            let plan: Vec<String> = db
                .prepare(
                    "explain query plan select h.k, h.v from header h \
                     join record r on h.topition = r.topition and h.offset_id = r.offset_id \
                     join topition tp on tp.id = r.topition join topic t on tp.topic = t.id \
                     join cluster c on t.cluster = c.id \
                     where c.name = 'chaos' and t.name = 'chaos-durable' and tp.partition = 0 and r.offset_id = 1",
                )
                .unwrap()
                .query_map([], |r| r.get::<_, String>(3))
                .unwrap()
                .collect::<Result<_, _>>()
                .unwrap();
            assert!(
                plan.iter().any(|step| step.contains(&format!("SEARCH h USING INDEX {TANSU_HEADER_INDEX}"))),
                "tansu's header lookup does not use the index: {plan:?}"
            );
        }
        // And through the protocol: the member goes on with e2, e3.
        let d = next_event(&mut sub, "kafka after restart").await;
        assert_eq!(d.event.id.as_str(), "e2", "the group resumes after its committed offset");
        d.ack().await.unwrap();
        let d = next_event(&mut sub, "kafka after restart").await;
        assert_eq!(d.event.id.as_str(), "e3");
        d.ack().await.unwrap();
        assert!(proxy.stats().accepted > 0, "clients went around the proxy");
    }
}
