//! Every store × broker combination, end to end: {postgres, sqlite} × {kafka, amqp, redis}, each
//! with the real store (outbox and inbox) AND the real broker — the pairs users deploy, which the
//! per-adapter runs (each adapter with an in-memory counterpart) never exercise together.
//!
//! Every adapter ships its half of the suite behind its `conformance` feature; the suite's
//! `Combined` pairs two halves into one harness. One named test per case per combination
//! (`postgres+kafka::f1_send_crash_expire_resend`), then one summary row per combination:
//! passed / failed / skipped and time.
//!
//! What runs: the failure-class cases (`f…`, the F-table) and the sampled permutations. The
//! per-adapter runs already cover the broker-only and store-only cases with an in-memory
//! counterpart; what only the matrix can catch is an interaction between two real backends on
//! the scenarios of the design. `OUTBOX_MATRIX_ALL=1` runs the suite's whole case list instead.
//! The permutations are sampled with a smaller budget than the adapters' own runs
//! ([`iterations`]; `OUTBOX_TEST_ITERATIONS` overrides, `OUTBOX_TEST_SEED` replays). Cases run
//! eight at a time, as in every suite run (`outbox_conformance_tests::DEFAULT_TEST_THREADS`;
//! `--test-threads` changes it): the six combinations took 51 s on two cores, 259 s two at a
//! time. The broker halves are trait objects, so the suite is compiled once per store.
//!
//! A server that is down skips its combinations loudly outside CI (a `SKIPPED` line naming the
//! service and the command that starts it; the tests show as ignored) and fails them under
//! `CI=true`.

use std::collections::BTreeMap;
use std::process::ExitCode;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use libtest_mimic::{Failed, Trial};
use outbox_broker_amqp::conformance::AmqpBrokerHarness;
use outbox_broker_kafka::conformance::KafkaBrokerHarness;
use outbox_broker_redis::RedisConfig;
use outbox_broker_redis::conformance::RedisBrokerHarness;
use outbox_conformance_tests::{
    BrokerHarness, Case, CaseResult, Combined, Harness, StoreHarness, all_cases, amqp_url, kafka_url, pg_url,
    redis_url, require_service, run_case, service_addr,
};
use outbox_store_postgres::PgConfig;
use outbox_store_postgres::conformance::PgStoreHarness;
use outbox_store_sqlite::conformance::SqliteStoreHarness;

/// Sampled permutation paths per combination: about a third of the broker's own budget (its
/// per-adapter run samples the full one against the in-memory store).
fn iterations(broker: &str) -> u32 {
    match broker {
        "kafka" => 4,
        "amqp" => 16,
        _ => 12,
    }
}

/// Whether the matrix runs `case`.
fn selected(case: &Case) -> bool {
    std::env::var_os("OUTBOX_MATRIX_ALL").is_some() || case.class.starts_with('F') || case.name == "permutations"
}

/// One combination's results.
#[derive(Default)]
struct Tally {
    passed: u32,
    failed: u32,
    skipped: u32,
    /// Sum of the cases' times.
    busy: Duration,
    /// First case started, last case finished.
    span: Option<(Instant, Instant)>,
}

type Tallies = Arc<Mutex<BTreeMap<String, Tally>>>;

fn record(tallies: &Tallies, combo: &str, f: impl FnOnce(&mut Tally)) {
    f(tallies.lock().unwrap_or_else(PoisonError::into_inner).entry(combo.to_string()).or_default());
}

/// Whether a service is reachable: `Ok(true)`, `Ok(false)` (skipped loudly, outside CI), or
/// `Err(message)` under CI.
fn service(name: &str, script: &str, url: &str) -> Result<bool, String> {
    let addr = service_addr(url);
    std::panic::catch_unwind(|| require_service(name, script, &addr)).map_err(|p| {
        p.downcast_ref::<String>()
            .cloned()
            .or_else(|| p.downcast_ref::<&str>().map(|s| (*s).to_string()))
            .unwrap_or_default()
    })
}

/// Why a combination cannot run.
enum Unavailable {
    /// Outside CI: every case ignored.
    Skip(String),
    /// Under CI: every case fails with this.
    Fail(String),
}

fn trials<S: StoreHarness, B: BrokerHarness>(
    combo: &str,
    build: impl FnOnce() -> Result<Combined<S, B>, String>,
    unavailable: Option<Unavailable>,
    tallies: &Tallies,
) -> Vec<Trial> {
    let cases: Vec<Case> = all_cases().into_iter().filter(selected).collect();
    let harness = match unavailable {
        None => build().map(Arc::new),
        Some(Unavailable::Fail(why)) => Err(why),
        Some(Unavailable::Skip(why)) => {
            eprintln!("SKIPPED {combo}: {why}");
            record(tallies, combo, |t| t.skipped += u32::try_from(cases.len()).unwrap_or(u32::MAX));
            return cases
                .into_iter()
                .map(|c| {
                    Trial::test(format!("{combo}::{}", c.name), || Ok(())).with_kind(c.class).with_ignored_flag(true)
                })
                .collect();
        }
    };
    let caps = harness.as_ref().ok().map(|h| h.capabilities());
    cases
        .into_iter()
        .map(|case| {
            let name = format!("{combo}::{}", case.name);
            let missing = caps.as_ref().and_then(|caps| case.needs.iter().copied().find(|c| !caps.has(*c)));
            if let Some(cap) = missing {
                eprintln!("SKIPPED {name}: the broker lacks the capability `{cap}`");
                record(tallies, combo, |t| t.skipped += 1);
            }
            let (harness, tallies, combo, class) = (harness.clone(), tallies.clone(), combo.to_string(), case.class);
            Trial::test(name, move || {
                let started = Instant::now();
                let result = match &harness {
                    Ok(h) => run_trial(h.as_ref(), &case),
                    Err(why) => Err(Failed::from(why.as_str())),
                };
                let ended = Instant::now();
                record(&tallies, &combo, |t| {
                    if result.is_ok() {
                        t.passed += 1
                    } else {
                        t.failed += 1
                    }
                    t.busy += ended - started;
                    t.span = Some(t.span.map_or((started, ended), |(s, e)| (s.min(started), e.max(ended))));
                });
                result
            })
            .with_kind(class)
            .with_ignored_flag(missing.is_some())
        })
        .collect()
}

fn run_trial<H: Harness>(harness: &H, case: &Case) -> Result<(), Failed> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| format!("cannot build a tokio runtime: {e}"))?;
    let started = Instant::now();
    match runtime.block_on(run_case(harness, case)) {
        Ok(CaseResult::Passed(note)) => {
            eprintln!("{} on {} passed in {:.2?}: {note}", case.name, harness.name(), started.elapsed());
            Ok(())
        }
        Ok(CaseResult::Failed(c)) => Err(format!("{}\nproperty: {}\n{c}", case.class, case.property).into()),
        Ok(CaseResult::Skipped(cap)) => Err(format!("skipped: the broker lacks the capability `{cap}`").into()),
        Err(e) => Err(format!("{}: setup failed: {e}", case.name).into()),
    }
}

/// A broker half as the trait object the matrix pairs with each store.
fn boxed(broker: impl BrokerHarness) -> Box<dyn BrokerHarness> {
    Box::new(broker)
}

fn main() -> ExitCode {
    let args = outbox_conformance_tests::arguments();
    let tallies = Tallies::default();
    let check = |name: &str, script: &str, url: String| match service(name, script, &url) {
        Ok(true) => None,
        Ok(false) => Some(Unavailable::Skip(format!("{name} is not reachable"))),
        Err(why) => Some(Unavailable::Fail(why)),
    };
    let pg = || check("PostgreSQL", "postgres", pg_url());
    let kafka = || check("Kafka-protocol broker (tansu)", "kafka", kafka_url());
    let amqp = || check("RabbitMQ", "rabbitmq", amqp_url());
    let redis = || check("Redis", "redis", redis_url());
    let either = |a: Option<Unavailable>, b: Option<Unavailable>| a.or(b);

    let pg_store = || PgConfig::from_url(&pg_url()).map(PgStoreHarness::new).map_err(|e| e.to_string());
    let sqlite_store = || SqliteStoreHarness::temporary().map_err(|e| e.to_string());
    // Broker halves as trait objects: the suite is compiled once per store, not once per pair.
    let kafka_broker = || KafkaBrokerHarness::from_url(&kafka_url()).map(boxed).map_err(|e| e.to_string());
    let amqp_broker = || AmqpBrokerHarness::from_url(&amqp_url()).map(boxed).map_err(|e| e.to_string());
    let redis_broker =
        || RedisConfig::from_url(&redis_url()).map(|c| boxed(RedisBrokerHarness::new(c))).map_err(|e| e.to_string());

    let mut all = Vec::new();
    all.extend(trials(
        "postgres+kafka",
        || Ok(Combined::new(pg_store()?, kafka_broker()?).with_sampled_iterations(iterations("kafka"))),
        either(pg(), kafka()),
        &tallies,
    ));
    all.extend(trials(
        "postgres+amqp",
        || Ok(Combined::new(pg_store()?, amqp_broker()?).with_sampled_iterations(iterations("amqp"))),
        either(pg(), amqp()),
        &tallies,
    ));
    all.extend(trials(
        "postgres+redis",
        || Ok(Combined::new(pg_store()?, redis_broker()?).with_sampled_iterations(iterations("redis"))),
        either(pg(), redis()),
        &tallies,
    ));
    all.extend(trials(
        "sqlite+kafka",
        || Ok(Combined::new(sqlite_store()?, kafka_broker()?).with_sampled_iterations(iterations("kafka"))),
        kafka(),
        &tallies,
    ));
    all.extend(trials(
        "sqlite+amqp",
        || Ok(Combined::new(sqlite_store()?, amqp_broker()?).with_sampled_iterations(iterations("amqp"))),
        amqp(),
        &tallies,
    ));
    all.extend(trials(
        "sqlite+redis",
        || Ok(Combined::new(sqlite_store()?, redis_broker()?).with_sampled_iterations(iterations("redis"))),
        redis(),
        &tallies,
    ));

    let started = Instant::now();
    let conclusion = libtest_mimic::run(&args, all);
    if !args.list {
        let tallies = tallies.lock().unwrap_or_else(PoisonError::into_inner);
        println!("\nstore × broker matrix ({:.1?} in all)", started.elapsed());
        println!(
            "{:<16} {:>6} {:>6} {:>7} {:>9} {:>9}  verdict",
            "combination", "passed", "failed", "skipped", "wall", "busy"
        );
        for (combo, t) in tallies.iter() {
            let wall = t.span.map_or(Duration::ZERO, |(s, e)| e - s);
            let verdict = match (t.failed, t.passed) {
                (0, 0) => "not run",
                (0, _) if t.skipped > 0 => "pass (some skipped)",
                (0, _) => "pass",
                _ => "FAIL",
            };
            println!(
                "{combo:<16} {:>6} {:>6} {:>7} {:>8.1}s {:>8.1}s  {verdict}",
                t.passed,
                t.failed,
                t.skipped,
                wall.as_secs_f64(),
                t.busy.as_secs_f64()
            );
        }
    }
    conclusion.exit_code()
}
