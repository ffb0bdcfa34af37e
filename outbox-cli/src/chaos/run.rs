//! One combination run: servers and proxies up, producers, relay and consumer processes, the
//! fault schedule and the bad inputs under load; then faults stop, everything drains, the audit
//! group counts what the broker offered, and the checker reads durable state.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use outbox::core::DeadLetterReason;
use outbox::core::rng::SplitMix64;
use outbox::{Broker, ConsumerGroup, Destination, Error, ErrorKind, Event, EventId, Result};
use tokio::task::JoinSet;
use tokio_util::task::AbortOnDropHandle;

use super::env::Env;
use super::procs::{Fleet, Kind};
use super::report::{self, BadInput, ComboReport, Durable, FaultRecord, ProducerStats, WindowStat};
use super::schedule::{self, Bad, Family, Fault, Schedule};
use super::site::{CONSUMER, RowTimes, Site, now_ms};
use super::{Combo, Settings};

/// Events per producer transaction.
const BATCH: usize = 10;
/// Producer tasks.
const PRODUCERS: u32 = 2;
/// Keys the events are spread over.
const KEYS: u64 = 300;
/// Bound on one producer commit (a black-holed connection answers nothing).
const COMMIT_TIMEOUT: Duration = Duration::from_secs(15);
/// Bound on one read of the checker or the drain's polls.
const READ_TIMEOUT: Duration = Duration::from_secs(20);
/// How long a scheduled kill waits for a process of its kind to be running.
const KILL_PATIENCE: Duration = Duration::from_secs(15);
/// How much longer the drain waits for the poison event's and the foreign message's dead
/// letters once everything else has drained.
const BAD_INPUT_GRACE: Duration = Duration::from_secs(30);
/// Size of the oversized header value.
const OVERSIZED: usize = 10 * 1024 * 1024;

/// Which signal interrupted the run, once one has ([`super::interrupted`]).
pub(crate) type Signals = tokio::sync::watch::Receiver<Option<&'static str>>;

/// Run one combination; errors end up in the report, never as a panic. A signal on `signals`
/// ends it early: its tasks are aborted and its processes and servers stopped.
pub(crate) async fn run_combo(combo: Combo, settings: &Settings, seed: u64, signals: Signals) -> ComboReport {
    let started = Instant::now();
    let cseed = schedule::combo_seed(seed, combo.name);
    let schedule = schedule::build(cseed, settings.window, combo.has_pg(), settings.relays, settings.consumers);
    let mut report = ComboReport {
        name: combo.name.to_string(),
        seed: cseed,
        schedule: schedule::digest(&schedule),
        events: settings.events,
        ..ComboReport::default()
    };
    println!(
        "{}: schedule {} (combination seed {cseed}): {} faults, {} events over {:?}, {} relays, {} consumers",
        combo.name,
        report.schedule,
        schedule.faults.len(),
        settings.events,
        settings.window,
        settings.relays,
        settings.consumers
    );
    let dir = match tempfile::Builder::new().prefix(&format!("outbox-chaos-{}-", combo.name)).tempdir() {
        Ok(d) => d,
        Err(e) => {
            report.error = Some(format!("cannot create a temporary directory: {e}"));
            return report;
        }
    };
    if let Err(e) = play(combo, settings, &schedule, dir.path(), &mut report, signals).await {
        report.error = Some(e.to_string().replace(['\n', '\r'], " "));
    }
    report.duration = started.elapsed();
    if settings.keep || !report.passed() {
        let path = dir.keep();
        report.logs = Some(path.display().to_string());
    }
    report
}

async fn play(
    combo: Combo,
    settings: &Settings,
    schedule: &Schedule,
    dir: &Path,
    report: &mut ComboReport,
    mut signals: Signals,
) -> Result<()> {
    let stopped_by = |name: &str| Error::permanent(ErrorKind::Rejected, "chaos", format!("interrupted by {name}"));
    let env = tokio::select! {
        env = Env::start(combo, dir) => Arc::new(env?),
        name = super::interrupted(&mut signals) => return Err(stopped_by(name)),
    };
    // The run's future is dropped on a signal (its tasks abort with it); the cleanup of what it
    // declared on a shared server runs either way.
    let outcome = tokio::select! {
        r = play_in(combo, settings, schedule, dir, report, &env) => r,
        name = super::interrupted(&mut signals) => Err(stopped_by(name)),
    };
    env.cleanup().await;
    outcome
}

/// A spawned task aborted when its handle is dropped, so that a run dropped on a signal leaves
/// no task holding its servers or its fleet.
fn scoped<F>(task: F) -> AbortOnDropHandle<F::Output>
where
    F: std::future::Future + Send + 'static,
    F::Output: Send + 'static,
{
    AbortOnDropHandle::new(tokio::spawn(task))
}

async fn play_in(
    combo: Combo,
    settings: &Settings,
    schedule: &Schedule,
    dir: &Path,
    report: &mut ComboReport,
    env: &Arc<Env>,
) -> Result<()> {
    let site = Site::open(&env.store_url).await?;
    site.prepare().await?;

    let run_id = format!("{:08x}", SplitMix64::new(now_ms() as u64 ^ u64::from(std::process::id())).next_u64() as u32);
    let destination = Destination::new(format!("chaos-{run_id}"))?;
    let group = ConsumerGroup::new(format!("chaos-{run_id}"))?;
    let audit = ConsumerGroup::new(format!("chaos-audit-{run_id}"))?;
    let broker = outbox::broker_from_url(&env.broker_url).await?;
    // Both groups exist before the first publish: the audit group sees every offer.
    broker.declare(&destination, &[group.clone(), audit.clone()]).await?;
    env.register_destination(&destination, &[group.clone(), audit.clone()]);

    let mut bad = BadInput {
        poison_id: format!("poison-{run_id}"),
        oversized_id: format!("oversized-{run_id}"),
        malformed_supported: DeadLetterReason::parse("malformed").is_some(),
        ..BadInput::default()
    };
    let s = |v: &str| v.to_string();
    let lease = format!("{}ms", settings.lease.as_millis());
    let mut relay_args = vec![
        s("--store"),
        env.store_url.clone(),
        s("--broker"),
        env.broker_url.clone(),
        s("--lease"),
        lease,
        s("--batch"),
        s("50"),
        s("--idle-poll"),
        s("200ms"),
        s("--max-attempts"),
        s("1000"),
    ];
    if let Some(age) = settings.retain_published {
        relay_args.extend([
            s("--retain-published"),
            format!("{}ms", age.as_millis()),
            s("--retain-interval"),
            format!("{}ms", RETAIN_INTERVAL.as_millis()),
        ]);
    }
    let consumer_args = vec![
        s("--store"),
        env.store_url.clone(),
        s("--broker"),
        env.consumer_broker_url.clone(),
        s("--destination"),
        destination.to_string(),
        s("--group"),
        group.to_string(),
        s("--poison"),
        bad.poison_id.clone(),
    ];
    let mut consumer_args = consumer_args;
    if let Some(age) = settings.retain_markers {
        consumer_args.extend([
            s("--marker-retention"),
            format!("{}ms", age.as_millis()),
            s("--max-redelivery"),
            format!("{}ms", MAX_REDELIVERY.as_millis()),
        ]);
    }
    let logs = dir.join("logs");
    std::fs::create_dir_all(&logs)
        .map_err(|e| Error::permanent(ErrorKind::Config, "chaos", format!("cannot create {}: {e}", logs.display())))?;
    let fleet = Fleet::new(&logs, settings.relays, settings.consumers, relay_args, consumer_args)?;
    fleet.tick()?;

    let stop = Arc::new(AtomicBool::new(false));
    let supervisor = {
        let (fleet, stop) = (fleet.clone(), stop.clone());
        scoped(async move {
            while !stop.load(Ordering::SeqCst) {
                fleet.tick()?;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Ok::<_, Error>(())
        })
    };

    let start = Instant::now();
    let log: Arc<Mutex<Vec<FaultRecord>>> = Arc::default();
    let deadline = start + settings.window + settings.drain + Duration::from_secs(60);

    let mut producers = JoinSet::new();
    let per = settings.events / u64::from(PRODUCERS);
    for p in 0..PRODUCERS {
        let count = if p == 0 { settings.events - per * u64::from(PRODUCERS - 1) } else { per };
        let job = Producer {
            site: site.clone(),
            index: p,
            count,
            destination: destination.clone(),
            window: settings.window,
            start,
            seed: schedule.producer_seed ^ u64::from(p),
            deadline,
        };
        producers.spawn(job.run());
    }
    let faults = scoped(execute_faults(schedule.faults.clone(), env.clone(), fleet.clone(), log.clone(), start));
    // Healing goes on until the audit group has read the destination, after the drain.
    let heal_stop = Arc::new(AtomicBool::new(false));
    let watcher = scoped(watch_broker(env.clone(), fleet.clone(), heal_stop.clone(), start, combo.name));
    let sampler = settings.stats_window.map(|w| scoped(sample(site.clone(), w, stop.clone())));
    // With retention on, relays delete published rows: keep what the judge needs of them.
    let kept: Arc<Mutex<BTreeMap<String, RowTimes>>> = Arc::default();
    let keeper = settings.retain_published.map(|_| scoped(keep_rows(site.clone(), kept.clone(), stop.clone())));

    // Bad inputs, at their times, from here.
    for (at, kind) in &schedule.bad {
        tokio::time::sleep_until((start + *at).into()).await;
        match kind {
            Bad::Poison => {
                let e =
                    Event::new(EventId::new(bad.poison_id.clone())?, destination.clone(), "poison".as_bytes().to_vec())
                        .with_key("poison");
                commit_retrying(&site, 9, &[e], deadline, &mut ProducerStats::default()).await?;
            }
            Bad::Foreign => {
                bad.foreign_written = retry(deadline, "the foreign message", || {
                    super::inject::foreign(combo.broker, &env.broker_url, &destination)
                })
                .await
                .is_ok()
            }
            Bad::Oversized => oversized(&site, &destination, &mut bad, deadline).await?,
        }
    }

    let mut totals = ProducerStats::default();
    while let Some(r) = producers.join_next().await {
        let r = r.map_err(join_error)??;
        totals.committed += r.committed;
        totals.retries += r.retries;
        totals.unknown_committed += r.unknown_committed;
    }
    report.producers = totals;
    faults.await.map_err(join_error)??;
    report.faults = log.lock().unwrap_or_else(|p| p.into_inner()).clone();
    println!(
        "{}: workload done in {:.1?}: {} events committed ({} retries, {} commits of unknown outcome found committed), {} faults",
        combo.name,
        start.elapsed(),
        totals.committed,
        totals.retries,
        totals.unknown_committed,
        report.faults.len()
    );

    // Faults are over: every process up, then drain.
    fleet.start_all_now();
    let drain_deadline = Instant::now() + settings.drain;
    let drained = drain(&site, &bad, drain_deadline).await;
    let mut committed_past = None;
    if !drained {
        // Ask the broker where the missing effects are while the fleet still runs.
        match tokio::time::timeout(READ_TIMEOUT * 3, unapplied_explained(&site, combo, env, &destination, &group)).await
        {
            Ok(Ok(0)) => {}
            Ok(Ok(n)) => {
                committed_past =
                    Some(format!("the consumer group committed past {n} deliveries it never applied: lost"));
            }
            Ok(Err(e)) => println!("{}: cannot tell where the missing effects are: {e}", combo.name),
            Err(_) => println!("{}: cannot tell where the missing effects are: the broker did not answer", combo.name),
        }
        super::stuck::print_log_tails(combo.name, &logs, env.broker_log().as_deref());
    }
    stop.store(true, Ordering::SeqCst);
    if let Some(s) = sampler {
        report.windows = s.await.map_err(join_error)?;
    }
    supervisor.await.map_err(join_error)??;
    report.fleet = fleet.stats();
    let f2 = fleet.clone();
    let killed = tokio::task::spawn_blocking(move || f2.stop(Duration::from_secs(15))).await.map_err(join_error)?;
    if killed > 0 {
        println!("{}: {killed} processes did not stop within 15s of SIGTERM and were killed", combo.name);
    }
    println!("{}: drain {} after {:.1?}", combo.name, if drained { "complete" } else { "INCOMPLETE" }, start.elapsed());

    if let Some(k) = keeper {
        k.await.map_err(join_error)?;
    }

    // Read durable state; rows purged by retention come from the keeper's snapshots.
    let mut rows = read(site.rows()).await?;
    if settings.retain_published.is_some() {
        let kept = std::mem::take(&mut *kept.lock().unwrap_or_else(std::sync::PoisonError::into_inner));
        let present = rows.len();
        for (id, row) in kept {
            rows.entry(id).or_insert(row);
        }
        report.purged = (rows.len() - present) as u64;
        println!(
            "{}: retention: {} published rows purged by the relays (judged from the runner's snapshots), {present} left",
            combo.name, report.purged
        );
    }
    let published = rows.values().filter(|r| r.published_ms.is_some()).count() as u64;
    let audited = audit_offers(broker.as_ref(), &destination, &audit, published, settings.drain).await;
    heal_stop.store(true, Ordering::SeqCst);
    report.broker_heals = watcher.await.map_err(join_error)?;
    let (offers, foreign) = audited?;
    bad.foreign_offers = foreign;
    let admin = site.inbox_admin();
    let dead = read(admin.dead_letters(CONSUMER)).await?;
    let dead_letters: Vec<(String, String, String)> =
        dead.iter().map(|d| (d.event.id.to_string(), d.reason.as_str().to_string(), d.error.clone())).collect();
    bad.poison_dead_letter =
        dead_letters.iter().find(|(id, _, _)| *id == bad.poison_id).map(|(_, r, e)| (r.clone(), e.clone()));
    bad.foreign_dead_letters = dead_letters.iter().filter(|(_, r, _)| r == "malformed").count() as u64;
    bad.oversized_parked = rows.get(&bad.oversized_id).and_then(|r| r.parked.clone());
    let durable = Durable {
        orders: read(site.orders()).await?,
        effects: read(site.effects()).await?,
        markers: read(admin.markers(CONSUMER)).await?.len() as u64,
        dead_letters,
        offers,
        rows,
    };
    let (figures, families, problems) =
        report::judge(&durable, &report.faults, &schedule::plans(combo.has_pg()), &bad, drained);
    report.figures = figures;
    report.families = families;
    report.problems = problems;
    report.problems.extend(committed_past);
    report.bad = bad;
    site.close().await;
    Ok(())
}

/// The published events that are neither parked, dead-lettered nor applied, explained by the
/// broker ([`super::stuck::explain`]); how many lie behind the group's committed position.
async fn unapplied_explained(
    site: &Site,
    combo: Combo,
    env: &Env,
    destination: &Destination,
    group: &ConsumerGroup,
) -> Result<u64> {
    // Read by `explain` after the group's positions (see there).
    let unapplied = async {
        let rows = site.rows().await?;
        let effects = site.effects().await?;
        let dead: std::collections::BTreeSet<String> =
            site.inbox_admin().dead_letters(CONSUMER).await?.iter().map(|d| d.event.id.to_string()).collect();
        Ok(rows
            .iter()
            .filter(|(id, r)| {
                r.published_ms.is_some() && r.parked.is_none() && !dead.contains(*id) && !effects.contains_key(*id)
            })
            .map(|(id, _)| id.clone())
            .collect())
    };
    super::stuck::explain(combo.name, env.kafka(), destination, group, unapplied).await
}

async fn read<T>(f: impl std::future::Future<Output = Result<T>>) -> Result<T> {
    tokio::time::timeout(READ_TIMEOUT, f).await.map_err(|_| {
        Error::transient(
            ErrorKind::Timeout,
            "chaos",
            format!("reading durable state took longer than {READ_TIMEOUT:?}"),
        )
    })?
}

fn join_error(e: tokio::task::JoinError) -> Error {
    Error::permanent(ErrorKind::Rejected, "chaos", format!("a task failed: {e}"))
}

/// Retry `op` until it succeeds or `deadline` passes (faults may be in progress).
async fn retry<F, Fut>(deadline: Instant, what: &str, mut op: F) -> Result<()>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<()>>,
{
    loop {
        let e = match tokio::time::timeout(COMMIT_TIMEOUT, op()).await {
            Ok(Ok(())) => return Ok(()),
            Ok(Err(e)) => e.to_string(),
            Err(_) => format!("no answer within {COMMIT_TIMEOUT:?}"),
        };
        if Instant::now() >= deadline {
            return Err(Error::transient(ErrorKind::Timeout, "chaos", format!("{what}: gave up: {e}")));
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

// ---------------------------------------------------------------------------------------------
// Producers.

struct Producer {
    site: Site,
    index: u32,
    count: u64,
    destination: Destination,
    window: Duration,
    start: Instant,
    seed: u64,
    deadline: Instant,
}

impl Producer {
    /// Commit `count` events with their orders, paced evenly over the window.
    async fn run(self) -> Result<ProducerStats> {
        let mut rng = SplitMix64::new(self.seed);
        let mut stats = ProducerStats::default();
        let batches = self.count.div_ceil(BATCH as u64).max(1);
        let interval = self.window.mul_f64(0.95) / batches as u32;
        let mut seq = 0u64;
        for j in 0..batches {
            tokio::time::sleep_until((self.start + interval * j as u32).into()).await;
            let n = (self.count - seq).min(BATCH as u64);
            let mut events = Vec::with_capacity(n as usize);
            for _ in 0..n {
                let id = format!("ev-{}-{seq:06}", self.index);
                let mut payload = format!("order {id} ").into_bytes();
                payload.extend((0..32).map(|_| rng.below(256) as u8));
                events.push(
                    Event::new(EventId::new(id)?, self.destination.clone(), payload)
                        .with_key(format!("k{:03}", rng.below(KEYS)))
                        .with_header("producer", self.index.to_string().into_bytes()),
                );
                seq += 1;
            }
            commit_retrying(&self.site, self.index, &events, self.deadline, &mut stats).await?;
            stats.committed += n;
        }
        Ok(stats)
    }
}

/// Commit `events` with their orders, retrying with the same ids. After an error or a timeout
/// the outcome is looked up by id: one transaction commits all of them or none.
async fn commit_retrying(
    site: &Site,
    producer: u32,
    events: &[Event],
    deadline: Instant,
    stats: &mut ProducerStats,
) -> Result<()> {
    let ids: Vec<String> = events.iter().map(|e| e.id.to_string()).collect();
    let mut attempt = 0u32;
    loop {
        let error = match tokio::time::timeout(COMMIT_TIMEOUT, site.commit(producer, events)).await {
            Ok(Ok(())) => return Ok(()),
            Ok(Err(e)) if matches!(e.kind(), ErrorKind::InvalidInput | ErrorKind::TooLarge) => return Err(e),
            Ok(Err(e)) => e.to_string(),
            Err(_) => format!("no answer within {COMMIT_TIMEOUT:?}"),
        };
        attempt += 1;
        stats.retries += 1;
        // Did it commit after all?
        loop {
            if Instant::now() >= deadline {
                return Err(Error::transient(
                    ErrorKind::Timeout,
                    "chaos",
                    format!("producer {producer} could not commit {} within the run's deadline: {error}", ids[0]),
                ));
            }
            match tokio::time::timeout(READ_TIMEOUT, site.committed(&ids)).await {
                Ok(Ok(n)) if n == ids.len() => {
                    stats.unknown_committed += 1;
                    return Ok(());
                }
                Ok(Ok(0)) => break,
                Ok(Ok(n)) => {
                    return Err(Error::permanent(
                        ErrorKind::Corrupt,
                        "chaos",
                        format!("{n} of {} events of one transaction are committed", ids.len()),
                    ));
                }
                _ => tokio::time::sleep(Duration::from_millis(200)).await,
            }
        }
        tokio::time::sleep(Duration::from_millis(50 * u64::from(attempt.min(20)))).await;
    }
}

/// The 10 MB header: enqueue must refuse it and commit nothing; then the same row goes in with
/// plain SQL, for the relay to park.
async fn oversized(site: &Site, destination: &Destination, bad: &mut BadInput, deadline: Instant) -> Result<()> {
    let event = Event::new(EventId::new(bad.oversized_id.clone())?, destination.clone(), b"oversized".to_vec())
        .with_key("oversized")
        .with_header("blob", vec![b'x'; OVERSIZED]);
    let mut stats = ProducerStats::default();
    match commit_retrying(site, 8, std::slice::from_ref(&event), deadline, &mut stats).await {
        Ok(()) => bad.oversized_refused = None,
        Err(e) => bad.oversized_refused = Some((format!("{:?}", e.kind()), e.to_string())),
    }
    let ids = [bad.oversized_id.clone()];
    let committed = loop {
        match tokio::time::timeout(READ_TIMEOUT, site.committed(&ids)).await {
            Ok(Ok(n)) => break n,
            _ if Instant::now() >= deadline => break 0,
            _ => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    };
    bad.oversized_committed_by_enqueue = committed > 0;
    if committed > 0 {
        return Ok(());
    }
    // Retried until it is in (an unknown outcome is looked up, as for the producers).
    loop {
        match tokio::time::timeout(COMMIT_TIMEOUT, site.insert_unchecked(&event)).await {
            Ok(Ok(())) => {
                bad.oversized_inserted = true;
                return Ok(());
            }
            _ if Instant::now() >= deadline => return Ok(()),
            _ => {
                tokio::time::sleep(Duration::from_millis(300)).await;
                if let Ok(Ok(1)) = tokio::time::timeout(READ_TIMEOUT, site.committed(&ids)).await {
                    bad.oversized_inserted = true;
                    return Ok(());
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Faults.

async fn execute_faults(
    faults: Vec<Fault>,
    env: Arc<Env>,
    fleet: Fleet,
    log: Arc<Mutex<Vec<FaultRecord>>>,
    start: Instant,
) -> Result<()> {
    let record = |log: &Arc<Mutex<Vec<FaultRecord>>>, family, at_ms, offset, target: String, detail: String| {
        log.lock().unwrap_or_else(|p| p.into_inner()).push(FaultRecord { family, at_ms, offset, target, detail });
    };
    let mut restarts = JoinSet::new();
    let mut longest_hold = Duration::ZERO;
    for f in faults {
        tokio::time::sleep_until((start + f.at).into()).await;
        let (at_ms, offset) = (now_ms(), start.elapsed());
        match f.family {
            Family::RelayKill | Family::ConsumerKill => {
                let kind = if f.family == Family::RelayKill { Kind::Relay } else { Kind::Consumer };
                let (fleet, log) = (fleet.clone(), log.clone());
                // When none of that kind runs right now (all restarting, or exited while a server
                // was down), the kill waits for one to be back: the family's count must be met.
                restarts.spawn(async move {
                    let give_up = Instant::now() + KILL_PATIENCE;
                    loop {
                        let (at_ms, offset) = (now_ms(), start.elapsed());
                        if let Some(who) = fleet.kill(kind, f.index, f.hold) {
                            record(
                                &log,
                                f.family,
                                at_ms,
                                offset,
                                who,
                                format!("SIGKILL, restarted after {:?}", f.hold),
                            );
                            return Ok(());
                        }
                        if Instant::now() >= give_up {
                            eprintln!(
                                "outbox chaos: no {} process was running for {KILL_PATIENCE:?}; one {} skipped",
                                f.family, f.family
                            );
                            return Ok(());
                        }
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                });
            }
            Family::BrokerRestart | Family::PgRestart => {
                let (env, log) = (env.clone(), log.clone());
                restarts.spawn(async move {
                    let pg = f.family == Family::PgRestart;
                    let _one_at_a_time = if pg { env.pg_lock.lock().await } else { env.broker_lock.lock().await };
                    // A broker must keep every record it acknowledged across a restart; on Kafka
                    // a log end that went back is seen here, where it happened.
                    let before = if pg { None } else { env.kafka_positions(LOG_END_PATIENCE).await };
                    let (at_ms, offset) = (now_ms(), start.elapsed());
                    let (name, down) = if pg { env.restart_pg().await? } else { env.restart_broker().await? };
                    let after = if pg { None } else { env.kafka_positions(LOG_END_PATIENCE).await };
                    let lost = went_back(before.as_deref(), after.as_deref());
                    if !lost.is_empty() {
                        println!("{name} restart at {offset:.1?}: {lost}");
                    }
                    record(&log, f.family, at_ms, offset, name, format!("down {down:.1?}{lost}"));
                    Ok::<_, Error>(())
                });
            }
            Family::ProxyCut | Family::ProxyStall | Family::ProxyBlackhole => {
                let Some(proxy) = env.proxy(f.proxy) else { continue };
                let detail = match f.family {
                    Family::ProxyCut => format!("{} connections closed", proxy.cut()),
                    Family::ProxyStall => {
                        proxy.stall(f.hold);
                        format!("stalled {:?}", f.hold)
                    }
                    _ => {
                        proxy.blackhole(f.hold);
                        format!("black hole {:?}", f.hold)
                    }
                };
                longest_hold = longest_hold.max(f.hold);
                record(&log, f.family, at_ms, offset, format!("proxy {}", proxy.name()), detail);
            }
        }
    }
    while let Some(r) = restarts.join_next().await {
        r.map_err(join_error)??;
    }
    // Let the last stall or black hole end by itself before the drain starts.
    tokio::time::sleep(longest_hold.min(Duration::from_secs(5))).await;
    Ok(())
}

/// How long a broker restart waits for the broker's log ends, before and after.
const LOG_END_PATIENCE: Duration = Duration::from_secs(10);

/// `"; [1] log end 1200 -> 1180 (records the broker lost), …"` for every partition whose log end
/// is lower after a restart than before it, and `"[2] committed 950 past the log end 900"` for
/// every one whose end is now below the group's committed offset; empty when neither happened
/// (or a side could not be read).
fn went_back(
    before: Option<&[outbox::kafka::GroupPosition]>,
    after: Option<&[outbox::kafka::GroupPosition]>,
) -> String {
    let (Some(before), Some(after)) = (before, after) else { return String::new() };
    let mut out = Vec::new();
    for a in after {
        if let Some(b) = before.iter().find(|b| b.partition == a.partition)
            && a.high < b.high
        {
            out.push(format!("[{}] log end {} -> {} (records the broker lost)", a.partition, b.high, a.high));
        }
        if let Some(c) = a.committed.filter(|c| *c > a.high) {
            out.push(format!("[{}] committed {c} past the log end {}", a.partition, a.high));
        }
    }
    if out.is_empty() { String::new() } else { format!("; {}", out.join(", ")) }
}

// ---------------------------------------------------------------------------------------------
// Drain and audit.

/// How many times one combination restarts a broker that failed inside (see [`heal_broker`]).
const MAX_BROKER_HEALS: usize = 20;

/// How often the window's watcher asks whether the broker failed inside.
const HEAL_CHECK: Duration = Duration::from_secs(1);

/// Restart a broker that failed inside and stopped serving, with every relay, as an operator
/// would. Each heal is printed and recorded in `heals` ([`watch_broker`] returns them: the
/// report's `broker_heals`), so a pass that needed one says so; after [`MAX_BROKER_HEALS`] it stops
/// healing and the run judges what the broken broker left.
///
/// The case it exists for: tansu 0.6's SQLite storage panics ("more or less than one row") on
/// a produce whose producer epoch it never handed out, and its storage task is gone until a
/// restart. librdkafka's idempotent producer bumps its own epoch after messages time out in
/// flight or after a gap in sequence numbers (KIP-360, `rdkafka_idempotence.c`: "the idempotent
/// producer can bump its own epoch"), which a Kafka broker accepts; tansu does not. The bumped
/// producer lives in the relay, so a restarted tansu meets it again at once: the relays are
/// restarted too (SIGKILL; new processes are new producers). Killing a relay is a fault the
/// contract survives anyway: its leases expire and other relays claim the rows again.
async fn heal_broker(env: &Env, fleet: &Fleet, heals: &mut Vec<String>, when: &str, combo: &str) {
    if heals.len() >= MAX_BROKER_HEALS || env.broker_failed_internally().is_none() {
        return;
    }
    let _one_at_a_time = env.broker_lock.lock().await;
    // A scheduled restart may have run while this waited for the lock.
    let Some(why) = env.broker_failed_internally() else { return };
    let outcome = match env.restart_broker().await {
        Ok((name, down)) => format!("{name} restarted in {down:.1?}"),
        Err(e) => format!("restart failed: {e}"),
    };
    let relays = fleet.restart_all(Kind::Relay);
    let heal = format!("{when}: the broker failed inside ({why}); {outcome}, and {relays} relays with it");
    println!(
        "{combo}: {heal} (a broker bug, not the contract's; heal {} of at most {MAX_BROKER_HEALS})",
        heals.len() + 1
    );
    heals.push(heal);
}

/// Heal the broker whenever it fails inside (see [`heal_broker`]), from the window's start
/// until `stop` (after the drain and the audit group's read).
async fn watch_broker(
    env: Arc<Env>,
    fleet: Fleet,
    stop: Arc<AtomicBool>,
    start: Instant,
    combo: &'static str,
) -> Vec<String> {
    let mut heals = Vec::new();
    loop {
        tokio::time::sleep(HEAL_CHECK).await;
        if stop.load(Ordering::SeqCst) {
            return heals;
        }
        heal_broker(&env, &fleet, &mut heals, &format!("at {:.0?}", start.elapsed()), combo).await;
    }
}

/// Wait until no row is pending or leased and every row that is neither parked nor
/// dead-lettered has its effect, and (for at most [`BAD_INPUT_GRACE`] more) until the poison
/// event and the foreign message have their dead letters; `false` at `deadline`. (The window's
/// watcher, [`watch_broker`], keeps healing the broker meanwhile.)
async fn drain(site: &Site, bad: &BadInput, deadline: Instant) -> bool {
    let admin = site.inbox_admin();
    let mut last: String;
    let mut bad_deadline: Option<Instant> = None;
    loop {
        let check = async {
            let rows = site.rows().await?;
            let open = rows.values().filter(|r| r.published_ms.is_none() && r.parked.is_none()).count();
            let dead = admin.dead_letters(CONSUMER).await?;
            let effected = site.effected().await?;
            let dead_ids: std::collections::BTreeSet<String> = dead.iter().map(|d| d.event.id.to_string()).collect();
            let parked = rows.values().filter(|r| r.parked.is_some()).count() as u64;
            let dead_rows = rows.keys().filter(|id| dead_ids.contains(*id)).count() as u64;
            let expected = (rows.len() as u64).saturating_sub(parked + dead_rows);
            let poison_done = dead_ids.contains(&bad.poison_id);
            let foreign_done = !bad.malformed_supported
                || !bad.foreign_written
                || dead.iter().any(|d| d.reason.as_str() == "malformed");
            let flowing = open == 0 && effected >= expected;
            // The bad inputs get a little longer once the rest has drained; the judge names
            // whatever is still missing then.
            let done = flowing
                && (poison_done && foreign_done
                    || Instant::now() >= *bad_deadline.get_or_insert(Instant::now() + BAD_INPUT_GRACE));
            let state = format!(
                "{open} rows neither published nor parked, {effected}/{expected} effected, poison dead-lettered: {poison_done}, foreign recorded: {foreign_done}"
            );
            Ok::<_, Error>((done, flowing, state))
        };
        match tokio::time::timeout(READ_TIMEOUT, check).await {
            Ok(Ok((true, _, _))) => return true,
            Ok(Ok((false, flowing, state))) => {
                if !flowing {
                    bad_deadline = None;
                }
                last = state;
            }
            Ok(Err(e)) => last = format!("reading failed: {e}"),
            Err(_) => last = "reading timed out".into(),
        }
        if Instant::now() >= deadline {
            eprintln!("outbox chaos: the drain did not finish: {last}");
            return false;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Read the destination through the audit group, which was declared before the first publish
/// and never consumed: offers per event id, and how many foreign messages it met. Complete once
/// every published row was seen and nothing more arrives for a moment.
async fn audit_offers(
    broker: &dyn Broker,
    destination: &Destination,
    group: &ConsumerGroup,
    published: u64,
    limit: Duration,
) -> Result<(BTreeMap<String, u64>, u64)> {
    let deadline = Instant::now() + limit;
    let mut subscription = loop {
        match tokio::time::timeout(READ_TIMEOUT, broker.subscribe(destination, group)).await {
            Ok(Ok(s)) => break s,
            _ if Instant::now() < deadline => tokio::time::sleep(Duration::from_millis(300)).await,
            Ok(Err(e)) => return Err(e),
            Err(_) => {
                return Err(Error::transient(ErrorKind::Timeout, "chaos", "subscribing the audit group timed out"));
            }
        }
    };
    let mut offers: BTreeMap<String, u64> = BTreeMap::new();
    let mut foreign = 0;
    // Receive errors are retried until the deadline; the count and the last one say why a
    // short read was short.
    let (mut errors, mut last_error) = (0u64, String::new());
    loop {
        let caught_up = offers.len() as u64 >= published;
        if Instant::now() >= deadline {
            let why = if errors == 0 {
                "no receive error".to_string()
            } else {
                format!("{errors} receive errors, the last: {last_error}")
            };
            eprintln!(
                "outbox chaos: the audit group read {} distinct events of {published} published ({why})",
                offers.len()
            );
            return Ok((offers, foreign));
        }
        let wait = if caught_up { Duration::from_millis(1500) } else { Duration::from_millis(500) };
        let failure = match tokio::time::timeout(READ_TIMEOUT, subscription.next(wait)).await {
            Ok(Ok(Some(d))) => {
                *offers.entry(d.event.id.to_string()).or_default() += 1;
                let _ = d.ack().await;
                continue;
            }
            Ok(Ok(None)) if caught_up => return Ok((offers, foreign)),
            Ok(Ok(None)) => continue,
            Ok(Err(e)) if e.kind() == ErrorKind::Corrupt => {
                foreign += 1;
                continue;
            }
            Ok(Err(e)) => e.to_string(),
            Err(_) => format!("no answer within {READ_TIMEOUT:?}"),
        };
        (errors, last_error) = (errors + 1, failure);
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

// ---------------------------------------------------------------------------------------------
// Long profile: retention, table sizes and throughput per window.

/// Time between two retention rounds of the relays (`--retain-interval`).
const RETAIN_INTERVAL: Duration = Duration::from_secs(5);

/// The longest a chaos delivery can come back after its first delivery: a killed consumer's
/// deliveries return within seconds, a relay's duplicate after its 3 s lease; the drain after a
/// broker restart is the longest (bounded by the profile's drain). Marker retention must
/// outlive it ([`outbox::consumer::Retention`] refuses less).
const MAX_REDELIVERY: Duration = Duration::from_secs(60);

/// Time between two snapshots of the row keeper: well under the retention, so a row is seen
/// published at least once before a relay may purge it (a snapshot that fails is retried at
/// the next tick; a gap longer than the retention would show as orders without a row).
const KEEP_EVERY: Duration = Duration::from_secs(10);

/// Snapshot every row until `stop`, so the judge sees rows the relays' retention deleted. A
/// published row never changes again, so its last snapshot is what the final read would have
/// shown.
async fn keep_rows(site: Site, kept: Arc<Mutex<BTreeMap<String, RowTimes>>>, stop: Arc<AtomicBool>) {
    while !stop.load(Ordering::SeqCst) {
        if let Ok(Ok(rows)) = tokio::time::timeout(READ_TIMEOUT, site.rows()).await {
            let mut kept = kept.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            for (id, row) in rows {
                kept.insert(id, row);
            }
        }
        let next = Instant::now() + KEEP_EVERY;
        while Instant::now() < next && !stop.load(Ordering::SeqCst) {
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

async fn sample(site: Site, length: Duration, stop: Arc<AtomicBool>) -> Vec<WindowStat> {
    let mut out = Vec::new();
    let mut prev = tokio::time::timeout(READ_TIMEOUT, site.sizes()).await.ok().and_then(|r| r.ok()).unwrap_or_default();
    let mut began = Instant::now();
    loop {
        let end = began + length;
        while Instant::now() < end && !stop.load(Ordering::SeqCst) {
            tokio::time::sleep(Duration::from_millis(200).min(end.saturating_duration_since(Instant::now()))).await;
        }
        let stopping = stop.load(Ordering::SeqCst);
        let elapsed = began.elapsed();
        // A last partial window counts only when it is a sizeable part of one.
        if stopping && elapsed < length / 2 {
            return out;
        }
        let Some(now) = tokio::time::timeout(READ_TIMEOUT, site.sizes()).await.ok().and_then(|r| r.ok()) else {
            if stopping {
                return out;
            }
            continue;
        };
        // Rows committed in the window: the row-id high-water mark moved (rows deleted by
        // retention don't hide them); every row that disappeared was published and purged.
        let committed = now.inserted.saturating_sub(prev.inserted);
        let purged = (prev.outbox_rows + committed).saturating_sub(now.outbox_rows);
        out.push(WindowStat {
            index: out.len() as u32,
            length: elapsed,
            committed,
            published: (now.published + purged).saturating_sub(prev.published),
            effects: now.effects.saturating_sub(prev.effects),
            outbox_rows: now.outbox_rows,
            markers: now.markers,
            bytes: now.bytes,
        });
        prev = now;
        began = Instant::now();
        if stopping {
            return out;
        }
    }
}

#[cfg(test)]
mod tests {
    use outbox::kafka::GroupPosition;

    use super::went_back;

    fn at(partition: i32, high: i64, committed: Option<i64>) -> GroupPosition {
        GroupPosition { partition, low: 0, high, committed }
    }

    #[test]
    fn a_log_end_that_went_back_and_a_commit_past_the_end_are_named() {
        let before = [at(0, 1200, Some(1150)), at(1, 900, Some(900))];
        let after = [at(0, 1180, Some(1150)), at(1, 900, Some(950))];
        assert_eq!(
            went_back(Some(&before), Some(&after)),
            "; [0] log end 1200 -> 1180 (records the broker lost), [1] committed 950 past the log end 900"
        );
    }

    #[test]
    fn growth_or_an_unread_side_says_nothing() {
        let before = [at(0, 10, None)];
        assert_eq!(went_back(Some(&before), Some(&[at(0, 12, Some(12))])), "");
        assert_eq!(went_back(None, Some(&before)), "");
        assert_eq!(went_back(Some(&before), None), "");
    }
}
