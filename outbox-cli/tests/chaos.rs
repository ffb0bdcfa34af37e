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
