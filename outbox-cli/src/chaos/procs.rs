//! The relay and consumer OS processes of a run: started from this same binary, SIGKILLed on the
//! schedule, started again after a delay, and started again too when one exits on its own (which
//! is counted and shown, not hidden).

use std::fs::OpenOptions;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use outbox::{Error, ErrorKind, Result};

/// Relays or consumers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    /// `outbox relay`.
    Relay,
    /// `outbox chaos-worker consume`.
    Consumer,
}

struct Slot {
    kind: Kind,
    index: usize,
    child: Option<Child>,
    generation: u32,
    /// When a stopped slot starts again.
    restart_at: Option<Instant>,
}

impl Slot {
    /// SIGKILL and reap the slot's process if it is running, and have it start again at
    /// `restart_at`; the process killed. One that already exited is left for
    /// [`Fleet::tick`] to count.
    fn kill_running(&mut self, restart_at: Instant) -> Option<Child> {
        let mut child = self.child.take()?;
        if child.try_wait().ok().flatten().is_some() {
            self.child = Some(child);
            return None;
        }
        let _ = child.kill();
        let _ = child.wait();
        self.restart_at = Some(restart_at);
        Some(child)
    }
}

/// What the fleet did, for the report.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct FleetStats {
    /// Processes started (first starts and restarts).
    pub(crate) started: u64,
    /// Relays that exited without being killed.
    pub(crate) relay_exits: u64,
    /// Consumers that exited without being killed.
    pub(crate) consumer_exits: u64,
}

struct Inner {
    slots: Vec<Slot>,
    stats: FleetStats,
    stopping: bool,
    /// Last: released after [`Drop`] killed the processes.
    _live: super::Live,
}

/// Every relay and consumer process of one combination run.
#[derive(Clone)]
pub(crate) struct Fleet {
    exe: PathBuf,
    logs: PathBuf,
    relay_args: Arc<Vec<String>>,
    consumer_args: Arc<Vec<String>>,
    inner: Arc<Mutex<Inner>>,
}

/// Delay before a process that exited on its own starts again.
const EXIT_RESTART: Duration = Duration::from_millis(500);

impl Fleet {
    /// A fleet of `relays` relays and `consumers` consumers; nothing starts until [`tick`](Self::tick).
    pub(crate) fn new(
        logs: &Path,
        relays: usize,
        consumers: usize,
        relay_args: Vec<String>,
        consumer_args: Vec<String>,
    ) -> Result<Self> {
        let exe = std::env::current_exe().map_err(|e| {
            Error::permanent(ErrorKind::Config, "chaos", format!("cannot find this program's own binary: {e}"))
        })?;
        let now = Instant::now();
        let slot = |kind, index| Slot { kind, index, child: None, generation: 0, restart_at: Some(now) };
        let slots =
            (0..relays).map(|i| slot(Kind::Relay, i)).chain((0..consumers).map(|i| slot(Kind::Consumer, i))).collect();
        Ok(Self {
            exe,
            logs: logs.to_path_buf(),
            relay_args: Arc::new(relay_args),
            consumer_args: Arc::new(consumer_args),
            inner: Arc::new(Mutex::new(Inner {
                slots,
                stats: FleetStats::default(),
                stopping: false,
                _live: super::Live::new(),
            })),
        })
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Start what is due, notice what exited on its own. Call often.
    pub(crate) fn tick(&self) -> Result<()> {
        let mut inner = self.lock();
        if inner.stopping {
            return Ok(());
        }
        let now = Instant::now();
        let Inner { slots, stats, .. } = &mut *inner;
        for slot in slots.iter_mut() {
            if let Some(child) = slot.child.as_mut()
                && child.try_wait().ok().flatten().is_some()
            {
                slot.child = None;
                slot.restart_at = Some(now + EXIT_RESTART);
                match slot.kind {
                    Kind::Relay => stats.relay_exits += 1,
                    Kind::Consumer => stats.consumer_exits += 1,
                }
            }
            if slot.child.is_none() && slot.restart_at.is_some_and(|t| t <= now) {
                slot.generation += 1;
                slot.child = Some(self.spawn(slot)?);
                slot.restart_at = None;
                stats.started += 1;
            }
        }
        Ok(())
    }

    fn spawn(&self, slot: &Slot) -> Result<Child> {
        let (name, mut args) = match slot.kind {
            Kind::Relay => {
                let name = format!("relay-{}", slot.index);
                let mut a = vec!["relay".to_string()];
                a.extend(self.relay_args.iter().cloned());
                a.extend(["--owner".to_string(), format!("chaos-{name}-g{}", slot.generation)]);
                (name, a)
            }
            Kind::Consumer => {
                let name = format!("consumer-{}", slot.index);
                let mut a = vec!["chaos-worker".to_string(), "consume".to_string()];
                a.extend(self.consumer_args.iter().cloned());
                a.extend(["--worker".to_string(), format!("{name}-g{}", slot.generation)]);
                (name, a)
            }
        };
        // Warnings and errors, and the Kafka adapter's assignment changes (info): what an
        // incomplete drain prints from these logs (`stuck::print_log_tails`).
        args.extend(["--log".to_string(), "warn,outbox.kafka=info".to_string()]);
        let log_path = self.logs.join(format!("{name}.log"));
        let log =
            OpenOptions::new().create(true).append(true).open(&log_path).map_err(|e| io("opening", &log_path, e))?;
        Command::new(&self.exe)
            .args(&args)
            .env_remove("OUTBOX_STORE_URL")
            .env_remove("OUTBOX_BROKER_URL")
            .env_remove("OUTBOX_INBOX_URL")
            .env_remove("OUTBOX_LOG")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .map_err(|e| Error::permanent(ErrorKind::Config, "chaos", format!("cannot start {name}: {e}")))
    }

    /// SIGKILL one running process of `kind` (the `index`-th, or the next running one), and
    /// start it again after `restart_after`. Returns the process killed, or `None` when none of
    /// that kind was running.
    pub(crate) fn kill(&self, kind: Kind, index: usize, restart_after: Duration) -> Option<String> {
        let mut inner = self.lock();
        let slots: Vec<usize> =
            inner.slots.iter().enumerate().filter(|(_, s)| s.kind == kind).map(|(i, _)| i).collect();
        if slots.is_empty() {
            return None;
        }
        for k in 0..slots.len() {
            let slot = &mut inner.slots[slots[(index + k) % slots.len()]];
            let Some(child) = slot.kill_running(Instant::now() + restart_after) else { continue };
            let what = match kind {
                Kind::Relay => "relay",
                Kind::Consumer => "consumer",
            };
            return Some(format!("{what}-{} (pid {}, generation {})", slot.index, child.id(), slot.generation));
        }
        None
    }

    /// SIGKILL every running process of `kind` and start each one again at once; how many were
    /// killed. For a broker that holds a client's state against it (see `run::heal_broker`): a
    /// new process is a new client.
    pub(crate) fn restart_all(&self, kind: Kind) -> usize {
        let now = Instant::now();
        self.lock().slots.iter_mut().filter(|s| s.kind == kind).filter_map(|s| s.kill_running(now)).count()
    }

    /// Make every slot start again as soon as possible (after the faults stop).
    pub(crate) fn start_all_now(&self) {
        let now = Instant::now();
        for slot in self.lock().slots.iter_mut() {
            if slot.child.is_none() {
                slot.restart_at = Some(now);
            }
        }
    }

    /// Counts so far.
    pub(crate) fn stats(&self) -> FleetStats {
        self.lock().stats
    }

    /// SIGTERM every process, wait up to `grace` for all, then SIGKILL what is left. Returns
    /// how many had to be killed.
    pub(crate) fn stop(&self, grace: Duration) -> usize {
        let mut inner = self.lock();
        inner.stopping = true;
        let mut children: Vec<Child> = inner.slots.iter_mut().filter_map(|s| s.child.take()).collect();
        drop(inner);
        for c in &children {
            let _ = Command::new("kill").args(["-TERM", &c.id().to_string()]).stderr(Stdio::null()).status();
        }
        let deadline = Instant::now() + grace;
        let mut killed = 0;
        while !children.is_empty() {
            children.retain_mut(|c| c.try_wait().ok().flatten().is_none());
            if Instant::now() >= deadline {
                for c in &mut children {
                    let _ = c.kill();
                    let _ = c.wait();
                    killed += 1;
                }
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        killed
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        // Never leave a process behind, whatever happened to the run.
        for s in &mut self.slots {
            if let Some(mut c) = s.child.take() {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
    }
}

fn io(what: &str, path: &Path, e: std::io::Error) -> Error {
    Error::permanent(ErrorKind::Config, "chaos", format!("{what} {}: {e}", path.display()))
}
