//! `outbox chaos --profile ci` as a process, with a hard deadline: relays and consumers
//! SIGKILLed, every server restarted, connections cut, stalled and black-holed, bad inputs mixed
//! in; then the figures it wrote (durable state only) must show nothing lost, nothing
//! unexpected, no duplicate effect, every fault family at its minimum and every bad input
//! accounted for.

// `common` re-exports the service helpers other tests use; the runner checks its own servers.
#[allow(unused_imports)]
mod common;

use std::time::Duration;

use common::*;
use serde_json::Value;

/// The CI profile takes about five minutes on two cores; anything past this is a hang.
const LIMIT: Duration = Duration::from_secs(20 * 60);

const COMBOS: [&str; 4] = ["pg-kafka", "pg-amqp", "pg-redis", "sqlite-redis"];

fn num(v: &Value, path: &str) -> u64 {
    v.pointer(path).and_then(Value::as_u64).unwrap_or_else(|| panic!("{path} missing or not a number in {v}"))
}

#[test]
fn chaos_ci_profile_loses_nothing_and_duplicates_no_effect() {
    let ci = std::env::var("CI").is_ok_and(|v| v == "true");
    let dir = tempfile::tempdir().unwrap();
    let json_path = dir.path().join("chaos.json");
    let json_arg = json_path.to_str().unwrap();
    let seed = std::env::var("OUTBOX_CHAOS_SEED").unwrap_or_else(|_| "20261201".to_string());
    let out = run(&["chaos", "--profile", "ci", "--seed", &seed, "--json", json_arg], LIMIT);
    let (stdout, stderr) = text(&out);
    println!("{stdout}");
    assert_eq!(out.status.code(), Some(0), "outbox chaos failed (seed {seed})\nstdout:\n{stdout}\nstderr:\n{stderr}");
    assert!(stdout.contains(&format!("seed {seed}")), "the seed is printed: {stdout}");

    let figures: Value =
        serde_json::from_str(&std::fs::read_to_string(&json_path).expect("the JSON file")).expect("valid JSON");
    assert_eq!(figures["seed"].as_u64(), seed.parse().ok(), "{figures}");
    assert_eq!(figures["passed"], Value::Bool(true), "{figures}");
    let combos = figures["combos"].as_array().expect("combos");
    let names: Vec<&str> = combos.iter().filter_map(|c| c["name"].as_str()).collect();
    assert_eq!(names, COMBOS, "every combination is reported");

    for c in combos {
        let name = c["name"].as_str().unwrap();
        if let Some(why) = c["skipped"].as_str() {
            assert!(!ci, "{name} was skipped under CI=true: {why}");
            eprintln!("SKIPPED {name}: {why} — outside CI a missing server skips loudly");
            continue;
        }
        assert_eq!(c["passed"], Value::Bool(true), "{name}: {c}");
        assert_eq!(c["figures"]["drained"], Value::Bool(true), "{name} drained: {c}");
        for field in ["lost", "unexpected", "duplicate_effects", "unoffered", "ghost_offers", "stale_completions"] {
            assert_eq!(num(c, &format!("/figures/{field}")), 0, "{name}: {field} must be 0: {}", c["figures"]);
        }
        assert_eq!(num(c, "/figures/orders"), num(c, "/figures/rows"), "{name}: one order per outbox row");
        assert!(num(c, "/figures/rows") >= 5_000, "{name}: at least 5,000 events");
        assert!(num(c, "/figures/offers") >= num(c, "/figures/published"), "{name}: every published row offered");

        // The minimums, per combination run.
        let mut minimums = vec![("relay-kill", 20), ("consumer-kill", 10), ("broker-restart", 5)];
        if name.starts_with("pg-") {
            minimums.push(("postgres-restart", 5));
        }
        let families = c["families"].as_array().expect("families");
        for (family, minimum) in minimums {
            let row =
                families.iter().find(|f| f["family"] == family).unwrap_or_else(|| panic!("{name}: no {family} row"));
            assert!(num(row, "/faults") >= minimum, "{name}: {family}: {row}");
        }
        for family in ["proxy-cut", "proxy-stall", "proxy-blackhole"] {
            let row = families.iter().find(|f| f["family"] == family).unwrap();
            assert!(num(row, "/faults") >= 1, "{name}: {family}: {row}");
        }
        assert!(
            c["faults"].as_array().unwrap().iter().all(|f| f["at_ms"].as_i64().is_some_and(|t| t > 0)),
            "{name}: every fault recorded with its time"
        );

        // Bad input: dead-lettered or parked with a clear reason, the rest kept flowing.
        let bad = &c["bad_input"];
        assert_eq!(bad["poison"]["dead_letter_reason"], "handler_failed", "{name}: {bad}");
        assert_eq!(bad["foreign"]["written"], Value::Bool(true), "{name}: {bad}");
        assert!(num(bad, "/foreign/offered_to_audit") >= 1, "{name}: {bad}");
        assert!(num(bad, "/foreign/malformed_dead_letters") >= 1, "{name}: {bad}");
        assert_eq!(bad["oversized"]["enqueue_error_kind"], "TooLarge", "{name}: {bad}");
        assert_eq!(bad["oversized"]["enqueue_committed"], Value::Bool(false), "{name}: {bad}");
        assert_eq!(bad["oversized"]["parked"], Value::Bool(true), "{name}: {bad}");
        assert!(!bad["oversized"]["parked_reason"].as_str().unwrap_or_default().is_empty(), "{name}: {bad}");
        assert_eq!(num(c, "/figures/parked"), 1, "{name}: only the oversized row is parked");
    }
}

/// Every live process whose environment holds `OUTBOX_TEST_TAG=tag` (the runner's children
/// inherit it), or that works in `dir` or names it on its command line (PostgreSQL and Redis
/// overwrite their environment with their process titles; the runner starts them in their
/// directories under `dir`): pid and command line. Zombies are left out: they run nothing.
fn started_by(tag: &str, dir: &str) -> Vec<(u32, String)> {
    let needle = format!("OUTBOX_TEST_TAG={tag}");
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").expect("/proc").flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else { continue };
        let environ = std::fs::read(entry.path().join("environ")).unwrap_or_default();
        let cmdline = std::fs::read(entry.path().join("cmdline")).unwrap_or_default();
        let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ").trim().to_string();
        let cwd = std::fs::read_link(entry.path().join("cwd")).unwrap_or_default();
        if !environ.split(|b| *b == 0).any(|var| var == needle.as_bytes())
            && !cmdline.contains(dir)
            && !cwd.starts_with(dir)
        {
            continue;
        }
        let state = std::fs::read_to_string(entry.path().join("stat")).unwrap_or_default();
        if state.rsplit_once(')').is_some_and(|(_, rest)| rest.trim_start().starts_with('Z')) {
            continue;
        }
        found.push((pid, cmdline));
    }
    found
}

/// SIGTERM to `outbox chaos` mid-run stops what it started: relays, consumers, its Redis and its
/// own PostgreSQL (daemonized by `pg_ctl`, so not a child) — none is left running after it exits.
#[test]
fn sigterm_stops_every_process_and_server_the_run_started() {
    use std::os::unix::fs::PermissionsExt;
    let ci = std::env::var("CI").is_ok_and(|v| v == "true");
    let tag = format!("chaos-sigterm-{}", std::process::id());
    // The runner's temporary directories go here, so its servers can be told from another run's.
    let tmp = tempfile::tempdir().unwrap();
    // Its PostgreSQL runs as the `postgres` user when the runner is root: it must get through.
    std::fs::set_permissions(tmp.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let dir = tmp.path().to_str().unwrap().to_string();
    let mut child = outbox()
        .args(["chaos", "--profile", "ci", "--combos", "pg-redis", "--seed", "7"])
        .env("OUTBOX_TEST_TAG", &tag)
        .env("TMPDIR", &dir)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("the outbox binary starts");
    let pid = child.id();
    // Wait (bounded) until the run has its servers and its workers.
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    let running = loop {
        let procs: Vec<(u32, String)> = started_by(&tag, &dir).into_iter().filter(|(p, _)| *p != pid).collect();
        let has = |what: &str| procs.iter().any(|(_, c)| c.contains(what));
        if has(&format!("postgres -D {dir}")) && has("redis-server") && has(" relay ") && has("chaos-worker consume") {
            break procs;
        }
        if child.try_wait().expect("try_wait").is_some() {
            let out = wait_output(child, Duration::from_secs(10), "outbox chaos");
            let (stdout, stderr) = text(&out);
            if !ci && stderr.contains("SKIPPING") {
                eprintln!("SKIPPED: a server is missing outside CI:\n{stderr}");
                return;
            }
            panic!("the run ended before SIGTERM ({:?})\nstdout:\n{stdout}\nstderr:\n{stderr}", out.status);
        }
        if std::time::Instant::now() > deadline {
            sigterm(&child);
            let out = wait_output(child, Duration::from_secs(120), "outbox chaos");
            let (stdout, stderr) = text(&out);
            panic!("the run never had PostgreSQL, Redis, relays and consumers up: {procs:?}\n{stdout}\n{stderr}");
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    sigterm(&child);
    let out = wait_output(child, Duration::from_secs(120), "outbox chaos after SIGTERM");
    let (stdout, stderr) = text(&out);
    let left = started_by(&tag, &dir);
    assert!(
        left.is_empty(),
        "left running after SIGTERM: {left:?}\n(running before it: {running:?})\nstdout:\n{stdout}\nstderr:\n{stderr}"
    );
    assert_eq!(out.status.code(), Some(1), "an interrupted run is an error\nstdout:\n{stdout}\nstderr:\n{stderr}");
    assert!(
        stdout.contains("pg-redis: interrupted by SIGTERM: every process and server the run started is stopped"),
        "stdout:\n{stdout}\nstderr:\n{stderr}"
    );
    assert!(stdout.contains("verdict: INTERRUPTED"), "stdout:\n{stdout}");
    assert!(stderr.contains("interrupted by SIGTERM"), "the error names the signal: {stderr}");
}
