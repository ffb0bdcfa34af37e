//! `outbox bench` as a process on a tiny backlog: it runs the subjects asked for, prints the
//! table with the seed, and writes a JSON file whose rows carry positive rates for the subject
//! and its baseline. No timing is asserted: the figures of a 300-event run on a shared machine
//! mean nothing; that the command measures, checks and reports is what this test is for.

mod common;

use std::time::Duration;

use common::*;
use serde_json::Value;

/// A few seconds normally; anything past this is a hang.
const LIMIT: Duration = Duration::from_secs(180);

/// `outbox bench` with `args` and `--json`: its stdout and the JSON file, after checking it
/// exited 0.
fn bench_with_json(args: &[&str]) -> (String, Value) {
    let dir = tempfile::tempdir().unwrap();
    let json_path = dir.path().join("bench.json");
    let mut all = vec!["bench", "--json", json_path.to_str().unwrap()];
    all.extend_from_slice(args);
    let out = run(&all, LIMIT);
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(0), "outbox bench failed\nstdout:\n{stdout}\nstderr:\n{stderr}");
    let json = std::fs::read_to_string(&json_path).expect("the JSON file");
    (stdout, serde_json::from_str(&json).expect("valid JSON"))
}

#[test]
fn bench_p4_p5_p9_reports_their_rows_with_positive_rates_over_two_runs() {
    let pg = service::pg_url();
    if !service::require_service("PostgreSQL", "postgres", &service::service_addr(&pg)) {
        return;
    }
    let (stdout, figures) = bench_with_json(&["--events", "300", "--only", "P4,P5,P9", "--seed", "7", "--repeat", "2"]);
    println!("{stdout}");
    assert!(stdout.contains("seed 7"), "the seed is printed: {stdout}");
    assert!(stdout.contains("| P | subject | baseline |"), "the table is printed: {stdout}");

    assert_eq!(figures["seed"].as_u64(), Some(7), "{figures}");
    assert_eq!(figures["settings"]["events"].as_u64(), Some(300), "{figures}");
    assert_eq!(figures["settings"]["repeat"].as_u64(), Some(2), "{figures}");
    let subjects = figures["subjects"].as_array().expect("subjects");
    let ran: Vec<(&str, &str)> =
        subjects.iter().map(|s| (s["subject"].as_str().unwrap(), s["status"].as_str().unwrap())).collect();
    assert_eq!(ran, [("P4", "ran"), ("P5", "ran"), ("P9", "ran")], "{figures}");
    let rows = figures["rows"].as_array().expect("rows");
    let ids: Vec<&str> = rows.iter().filter_map(|r| r["id"].as_str()).collect();
    assert_eq!(ids, ["P4", "P5", "P9"], "only the subjects asked for: {figures}");
    for row in rows {
        let id = row["id"].as_str().unwrap();
        for field in ["measured_eps", "baseline_eps", "ratio"] {
            let v = row[field].as_f64().unwrap_or_else(|| panic!("{id}: {field} missing: {row}"));
            assert!(v > 0.0 && v.is_finite(), "{id}: {field} must be a positive rate: {row}");
        }
        assert!(row["goal"].as_f64().is_some_and(|g| g > 0.0), "{id}: a goal: {row}");
        assert!(row["pass"].is_boolean(), "{id}: a verdict: {row}");
        assert_eq!(row["seed"].as_u64(), Some(7), "{id}: {row}");
        assert!(!row["configuration"].as_str().unwrap_or_default().is_empty(), "{id}: a configuration: {row}");
        let runs: Vec<f64> =
            row["run_ratios"].as_array().expect("run_ratios").iter().filter_map(Value::as_f64).collect();
        assert_eq!(runs.len(), 2, "{id}: one ratio per run: {row}");
        let ratio = row["ratio"].as_f64().unwrap();
        assert_eq!(ratio, runs.iter().copied().fold(f64::INFINITY, f64::min), "{id}: of two runs, the lower: {row}");
    }

    // P4 named its schema before measuring, once per run; each must be gone (every subject
    // cleans up).
    let schemas: Vec<String> = stdout
        .split_whitespace()
        .filter(|w| w.starts_with("bench_p4_"))
        .map(|w| w.trim_end_matches([';', ',']).to_string())
        .collect();
    assert_eq!(schemas.len(), 2, "P4 prints its schema once per run: {stdout}");
    assert_ne!(schemas[0], schemas[1], "each run in a schema of its own");
    let left: i64 = tokio::runtime::Runtime::new().unwrap().block_on(async {
        use outbox::postgres::sqlx::{self, Connection};
        let mut conn = sqlx::PgConnection::connect(&pg).await.expect("PostgreSQL");
        sqlx::query_scalar("SELECT count(*) FROM information_schema.schemata WHERE schema_name = ANY($1)")
            .bind(&schemas)
            .fetch_one(&mut conn)
            .await
            .unwrap()
    });
    assert_eq!(left, 0, "schemas {schemas:?} were dropped after P4");
}

#[test]
fn bench_rejects_an_unknown_subject_as_a_usage_error() {
    let out = run(&["bench", "--only", "P10"], Duration::from_secs(30));
    assert_eq!(out.status.code(), Some(2), "{:?}", text(&out));
}

/// `--p7-broker-latency`: every P7 row names the broker's latency, the JSON carries it, and the
/// drains behind the rows passed P7's own check (every row published exactly once, or the
/// command fails); a latency without a unit is a usage error.
#[test]
fn bench_p7_with_a_broker_latency_names_it_in_every_row() {
    let pg = service::pg_url();
    if !service::require_service("PostgreSQL", "postgres", &service::service_addr(&pg)) {
        return;
    }
    let (stdout, figures) =
        bench_with_json(&["--events", "300", "--only", "P7", "--seed", "7", "--p7-broker-latency", "5ms"]);
    assert!(stdout.contains("P7 broker that answers each batch after 5ms"), "the header names it: {stdout}");
    assert_eq!(figures["settings"]["p7_broker_latency_ms"].as_u64(), Some(5), "{figures}");
    let rows = figures["rows"].as_array().expect("rows");
    let ids: Vec<&str> = rows.iter().filter_map(|r| r["id"].as_str()).collect();
    assert_eq!(ids, ["P7/1", "P7/2", "P7/4", "P7/8"], "{figures}");
    for row in rows {
        let subject = row["subject"].as_str().unwrap_or_default();
        assert!(subject.ends_with("broker answering after 5ms"), "{subject}: {row}");
        assert!(row["measured_eps"].as_f64().is_some_and(|v| v > 0.0 && v.is_finite()), "{row}");
    }

    let out = run(&["bench", "--only", "P7", "--p7-broker-latency", "5"], Duration::from_secs(30));
    assert_eq!(out.status.code(), Some(2), "{:?}", text(&out));
}
