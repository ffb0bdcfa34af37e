//! Validated table names and the SQL built from them, once per store.
//!
//! Every statement takes the store clock as `$1` (a `bigint` of milliseconds, or `NULL` for the
//! database's own clock), so one text serves both modes and the server never sees a different
//! statement shape because of a test clock. Times are stored as `bigint` milliseconds since the
//! Unix epoch: the precision of [`Timestamp`](outbox_core::Timestamp), compared exactly.

use std::fmt;
use std::sync::Arc;

use outbox_core::{Fingerprint, ParkedHead, Result, SharedClock};

use crate::config::PgConfig;

/// The database clock's expression, once for [`NOW`] and [`DB_NOW`] (`concat!` takes literals).
macro_rules! db_now {
    () => {
        "floor(extract(epoch FROM statement_timestamp()) * 1000)::bigint"
    };
}

/// "Now" in milliseconds: the injected clock when `$1` is not null, else the database clock at
/// the start of the statement (`statement_timestamp()` is stable within a statement, so every
/// row of one claim sees the same instant).
const NOW: &str = concat!("COALESCE($1::bigint, ", db_now!(), ")");

/// The database clock alone, in milliseconds: [`NOW`] without the injected clock, for a statement
/// that takes no parameters ([`PgTables::mark_then_begin`]).
const DB_NOW: &str = db_now!();

/// The columns of an outbox row, in the order [`crate::store`] decodes them.
const COLUMNS: [&str; 16] = [
    "id",
    "event_id",
    "destination",
    "key",
    "headers",
    "payload",
    "attempts",
    "token",
    "owner",
    "lease_expires_at",
    "available_at",
    "created_at",
    "published_token",
    "published_at",
    "parked_at",
    "last_error",
];

fn columns(alias: &str) -> String {
    COLUMNS.iter().map(|c| format!("{alias}{c}")).collect::<Vec<_>>().join(", ")
}

/// The newest schema version this crate knows; [`PgStore::migrate`](crate::PgStore::migrate)
/// refuses a database already at a newer one.
///
/// - 1: outbox rows and the inbox tables.
/// - 2: consumer dead letters keep the whole event (`destination`, `key`, `headers`).
/// - 3: an index on `published_at` of published rows, for retention (`purge_published`).
/// - 4: an index on `(key, id)` of unpublished keyed rows, for the claim's key order.
/// - 5: an index on `(key, id)` of unpublished keyed rows that are or were leased, have failed or
///   are parked, so the claim finds the keys held back without probing every candidate.
pub const SCHEMA_VERSION: i32 = 5;

/// Generated statement texts.
#[derive(Debug, Clone)]
pub(crate) struct Sql {
    pub(crate) enqueue: Arc<str>,
    /// The claim statement split at its limit, which is written into the text (see
    /// [`PgTables::claim_statement`]).
    pub(crate) claim: (Arc<str>, Arc<str>),
    pub(crate) complete: Arc<str>,
    pub(crate) complete_many: Arc<str>,
    pub(crate) fail: Arc<str>,
    pub(crate) park: Arc<str>,
    pub(crate) extend: Arc<str>,
    pub(crate) release: Arc<str>,
    pub(crate) list_parked: Arc<str>,
    pub(crate) requeue: Arc<str>,
    pub(crate) purge: Arc<str>,
    pub(crate) stats: Arc<str>,
    pub(crate) inspect: Arc<str>,
    pub(crate) mark_insert: Arc<str>,
    pub(crate) mark_select: Arc<str>,
    /// `INSERT INTO markers … VALUES (` : the head of [`PgTables::mark_then_begin`].
    pub(crate) mark_then_begin: Arc<str>,
    pub(crate) version_insert: Arc<str>,
    pub(crate) version_lock: Arc<str>,
    pub(crate) version_update: Arc<str>,
    pub(crate) ledger_fresh: Arc<str>,
    pub(crate) ledger_lock: Arc<str>,
    pub(crate) ledger_set: Arc<str>,
    pub(crate) dead_letter: Arc<str>,
    pub(crate) record_failure: Arc<str>,
    pub(crate) markers: Arc<str>,
    pub(crate) dead_letters: Arc<str>,
    pub(crate) remove_dead_letters: Arc<str>,
    pub(crate) prune: Arc<str>,
    pub(crate) purge_published: Arc<str>,
    pub(crate) version_table: Arc<str>,
    pub(crate) version_read: Arc<str>,
    pub(crate) version_insert_row: Arc<str>,
    pub(crate) migrations: Vec<(i32, Arc<str>)>,
}

/// Where the tables are and how to talk to them, without a connection: the validated schema and
/// prefix, the generated SQL, the payload limit and the store clock.
///
/// A [`PgStore`](crate::PgStore) holds one; [`enqueue`](crate::enqueue) needs one (or the store).
/// Build one with [`PgTables::new`] to enqueue from an application that has its own pool and no
/// store.
#[derive(Clone)]
pub struct PgTables {
    schema: String,
    prefix: String,
    max_payload: usize,
    clock: Option<SharedClock>,
    parked_head: ParkedHead,
    pub(crate) sql: Sql,
}

impl PgTables {
    /// Validate `config`'s schema and prefix and generate the SQL.
    ///
    /// # Errors
    /// [`ErrorKind::Config`](outbox_core::ErrorKind::Config) for an invalid schema or prefix.
    pub fn new(config: &PgConfig) -> Result<Self> {
        config.validate()?;
        let schema = config.schema().to_string();
        let prefix = config.table_prefix().to_string();
        let parked_head = config.parked_head();
        let sql = Sql::generate(&schema, &prefix, parked_head);
        Ok(Self { schema, prefix, max_payload: config.max_payload(), clock: None, parked_head, sql })
    }

    /// The same tables with the claim treating a parked head row as `parked_head` (see
    /// [`PgConfig::with_parked_head`]).
    #[must_use]
    pub fn with_parked_head(mut self, parked_head: ParkedHead) -> Self {
        self.parked_head = parked_head;
        self.sql = Sql::generate(&self.schema, &self.prefix, parked_head);
        self
    }

    /// What the claim does with a parked head row.
    pub fn parked_head(&self) -> ParkedHead {
        self.parked_head
    }

    /// Use `clock` instead of the database clock for every time this store writes or compares.
    #[must_use]
    pub fn with_clock(mut self, clock: SharedClock) -> Self {
        self.clock = Some(clock);
        self
    }

    /// The schema.
    pub fn schema(&self) -> &str {
        &self.schema
    }

    /// The table prefix.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// Largest accepted payload, in bytes.
    pub fn max_payload(&self) -> usize {
        self.max_payload
    }

    /// The injected clock, if any (`None`: the database clock).
    pub fn clock(&self) -> Option<&SharedClock> {
        self.clock.as_ref()
    }

    /// `"schema"."<prefix>name"`, quoted, for one of this crate's tables or indexes (`events`,
    /// `inbox_markers`, `inbox_versions`, `inbox_ledger`, `inbox_failures`, `dead_letters`,
    /// `schema_version`, `events_claimable`, ...), for operators' and tests' own queries.
    ///
    /// # Errors
    /// [`ErrorKind::Config`](outbox_core::ErrorKind::Config) for a name this crate does not create.
    pub fn table(&self, name: &str) -> Result<String> {
        if !crate::config::DERIVED_SUFFIXES.contains(&name) {
            return Err(outbox_core::Error::config(
                crate::error::BACKEND,
                format!("{name:?} is not one of the outbox's tables or indexes"),
            ));
        }
        Ok(self.own(name))
    }

    /// The qualified name of one of this crate's objects (`name` is a constant of this crate).
    pub(crate) fn own(&self, name: &str) -> String {
        qualified(&self.schema, &format!("{}{name}", self.prefix))
    }

    /// `"schema"."name"`, quoted, for an application table in the same schema (e.g. the
    /// business-effect table of a handler). `name` is validated like the prefix.
    ///
    /// # Errors
    /// [`ErrorKind::Config`](outbox_core::ErrorKind::Config) for a name outside `[a-z_][a-z0-9_]*`
    /// or longer than 63 bytes.
    pub fn app_table(&self, name: &str) -> Result<String> {
        crate::config::validate_identifier("table name", name, crate::config::MAX_IDENTIFIER_LEN)?;
        Ok(qualified(&self.schema, name))
    }

    /// The claim statement of at most `limit` rows, exactly as the store runs it. Parameters: `$1`
    /// now in ms (`NULL`: database clock), `$2` owner, `$3` lease in ms; the limit is in the
    /// text. For `EXPLAIN` in tests and benches: only with the `testkit` feature, not part of
    /// the stable API.
    #[cfg(any(test, feature = "testkit"))]
    pub fn claim_sql(&self, limit: usize) -> String {
        self.claim_statement(limit)
    }

    /// The claim of at most `limit` rows. The limit is written into the text, and the clock is
    /// read in one-row sub-selects, so that no parameter changes the plan: PostgreSQL then
    /// switches each connection's prepared claim to its generic plan after five calls, instead
    /// of planning the statement again at every call (about 1 ms against 5 ms of execution,
    /// measured in `docs/bench.md`). One prepared statement per limit value: the relay's batch
    /// size, and the sizes its batch limit passes through while it shrinks after a fenced batch
    /// and grows back.
    pub(crate) fn claim_statement(&self, limit: usize) -> String {
        let (head, tail) = &self.sql.claim;
        format!("{head}{}{tail}", crate::store::limit_param(limit))
    }

    /// The retention statement ([`purge_published`](outbox_core::OutboxAdmin::purge_published)),
    /// exactly as the store runs it. Parameters: `$1` now in ms (`NULL`: database clock), `$2`
    /// age in ms, `$3` limit. For `EXPLAIN` in tests: only with the `testkit` feature, not part
    /// of the stable API.
    #[cfg(any(test, feature = "testkit"))]
    pub fn purge_published_sql(&self) -> &str {
        &self.sql.purge_published
    }

    /// The statements of each migration, by version. Only with the `testkit` feature, not part
    /// of the stable API.
    #[cfg(any(test, feature = "testkit"))]
    pub fn migration_sql(&self) -> impl Iterator<Item = (i32, &str)> {
        self.sql.migrations.iter().map(|(v, s)| (*v, &**s))
    }

    /// The injected clock's time, or `None` for the database clock: the `$1` of every statement.
    pub(crate) fn now_param(&self) -> Option<i64> {
        self.clock.as_ref().map(|c| c.now().as_millis())
    }

    /// One simple query that inserts the inbox marker and then opens a transaction with it:
    /// `INSERT INTO markers … VALUES (…); BEGIN`, values written as constants (a simple query
    /// takes no parameters). PostgreSQL runs the statements of one simple query in an implicit
    /// transaction, and a `BEGIN` among them turns it into an ordinary open transaction that
    /// holds the insert. When the insert fails (the marker exists: a unique violation), the
    /// rest is skipped and the implicit transaction rolls back: the connection is left idle,
    /// with nothing written. `None` when a value cannot be written as a constant (a NUL
    /// character, which no PostgreSQL text holds): the caller takes the parameterized path.
    pub(crate) fn mark_then_begin(&self, consumer: &str, event_id: &str, fingerprint: &Fingerprint) -> Option<String> {
        let now = self.now_param().map_or_else(|| DB_NOW.to_string(), |ms| ms.to_string());
        Some(format!(
            "{}{}, {}, decode('{}', 'hex'), {now}); BEGIN",
            self.sql.mark_then_begin,
            text_literal(consumer)?,
            text_literal(event_id)?,
            fingerprint.to_hex()
        ))
    }
}

impl AsRef<PgTables> for PgTables {
    fn as_ref(&self) -> &PgTables {
        self
    }
}

impl fmt::Debug for PgTables {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PgTables")
            .field("schema", &self.schema)
            .field("prefix", &self.prefix)
            .field("max_payload", &self.max_payload)
            .field("clock", &self.clock)
            .field("parked_head", &self.parked_head)
            .finish_non_exhaustive()
    }
}

/// `text` as a string constant that reads the same whatever `standard_conforming_strings` is
/// (`E'…'`, with `\` and `'` doubled); `None` for a NUL, which no PostgreSQL text holds.
fn text_literal(text: &str) -> Option<String> {
    if text.contains('\0') {
        return None;
    }
    Some(format!("E'{}'", text.replace('\\', "\\\\").replace('\'', "''")))
}

/// Quote a validated identifier. Validation already excludes `"`, so this cannot be escaped.
fn quote(ident: &str) -> String {
    format!("\"{ident}\"")
}

pub(crate) fn qualified(schema: &str, name: &str) -> String {
    format!("{}.{}", quote(schema), quote(name))
}

impl Sql {
    fn generate(schema: &str, p: &str, parked_head: ParkedHead) -> Self {
        let t = |name: &str| qualified(schema, &format!("{p}{name}"));
        let n = |name: &str| quote(&format!("{p}{name}"));
        let events = t("events");
        let markers = t("inbox_markers");
        let versions = t("inbox_versions");
        let ledger = t("inbox_ledger");
        let failures = t("inbox_failures");
        let dead = t("dead_letters");
        let version = t("schema_version");
        let cols = columns("");
        let tcols = columns("t.");
        let open = "published_at IS NULL AND parked_at IS NULL";
        let fence = format!("id = $2 AND token = $3 AND owner = $4 AND {open}");
        let s = |text: String| -> Arc<str> { text.into() };

        let v1 = format!(
            "CREATE TABLE {events} (
    id bigserial CONSTRAINT {events_pkey} PRIMARY KEY,
    event_id text NOT NULL CONSTRAINT {events_event_id_key} UNIQUE,
    destination text NOT NULL,
    key text,
    headers bytea NOT NULL,
    payload bytea NOT NULL,
    attempts integer NOT NULL DEFAULT 0,
    token bigint NOT NULL DEFAULT 0,
    owner text,
    lease_expires_at bigint,
    available_at bigint NOT NULL,
    created_at bigint NOT NULL,
    published_token bigint,
    published_at bigint,
    parked_at bigint,
    last_error text
);
COMMENT ON TABLE {events} IS 'outbox rows; times are milliseconds since the Unix epoch';
CREATE INDEX {events_claimable} ON {events} (id) WHERE published_at IS NULL AND parked_at IS NULL;
CREATE INDEX {events_parked} ON {events} (id) WHERE parked_at IS NOT NULL;
CREATE TABLE {markers} (
    consumer text NOT NULL,
    event_id text NOT NULL,
    fingerprint bytea NOT NULL,
    at bigint NOT NULL,
    CONSTRAINT {markers_pkey} PRIMARY KEY (consumer, event_id)
);
CREATE INDEX {markers_at} ON {markers} (consumer, at);
CREATE TABLE {versions} (
    consumer text NOT NULL,
    subject text NOT NULL,
    version bigint NOT NULL,
    CONSTRAINT {versions_pkey} PRIMARY KEY (consumer, subject)
);
CREATE TABLE {ledger} (
    consumer text NOT NULL,
    event_id text NOT NULL,
    state text NOT NULL CONSTRAINT {ledger_state} CHECK (state IN ('fresh', 'attempted', 'done')),
    CONSTRAINT {ledger_pkey} PRIMARY KEY (consumer, event_id)
);
CREATE TABLE {failures} (
    consumer text NOT NULL,
    event_id text NOT NULL,
    failures integer NOT NULL,
    CONSTRAINT {failures_pkey} PRIMARY KEY (consumer, event_id)
);
CREATE TABLE {dead} (
    id bigserial CONSTRAINT {dead_pkey} PRIMARY KEY,
    consumer text NOT NULL,
    event_id text NOT NULL,
    reason text NOT NULL,
    error text NOT NULL,
    payload bytea NOT NULL,
    at bigint NOT NULL
);
CREATE INDEX {dead_consumer} ON {dead} (consumer, id);",
            events_pkey = n("events_pkey"),
            events_event_id_key = n("events_event_id_key"),
            events_claimable = n("events_claimable"),
            events_parked = n("events_parked"),
            markers_pkey = n("inbox_markers_pkey"),
            markers_at = n("inbox_markers_at"),
            versions_pkey = n("inbox_versions_pkey"),
            ledger_state = n("inbox_ledger_state"),
            ledger_pkey = n("inbox_ledger_pkey"),
            failures_pkey = n("inbox_failures_pkey"),
            dead_pkey = n("dead_letters_pkey"),
            dead_consumer = n("dead_letters_consumer"),
        );
        // Version 1 kept only a dead letter's event id and payload. Its records get the
        // placeholder destination `UNKNOWN_DESTINATION` (a replay tool asks the operator where to
        // send them), no key, and no headers ('0100000000' is `encode_headers` of none); the
        // defaults only fill existing rows and are dropped, so every write supplies all three.
        let v2 = format!(
            "ALTER TABLE {dead}
    ADD COLUMN destination text NOT NULL DEFAULT '_outbox.unknown-destination',
    ADD COLUMN key text,
    ADD COLUMN headers bytea NOT NULL DEFAULT decode('0100000000', 'hex');
ALTER TABLE {dead} ALTER COLUMN destination DROP DEFAULT, ALTER COLUMN headers DROP DEFAULT;"
        );

        // Retention walks published rows oldest first without touching open ones.
        let v3 = format!(
            "CREATE INDEX {events_published} ON {events} (published_at) WHERE published_at IS NOT NULL;",
            events_published = n("events_published"),
        );

        // The claim's key order looks up a key's unpublished rows by (key, id): parked ones too,
        // which block their key under `ParkedHead::Block`; rows without a key never enter it.
        let v4 = format!(
            "CREATE INDEX {events_key_open} ON {events} (key, id) WHERE published_at IS NULL AND key IS NOT NULL;",
            events_key_open = n("events_key_open"),
        );

        // The claim reads the keys held back from the few rows that can hold one (see `held`),
        // instead of probing each candidate's head and predecessor.
        let v5 = format!(
            "CREATE INDEX {events_key_held} ON {events} (key, id) WHERE {held};",
            events_key_held = n("events_key_held"),
            held = held(""),
        );

        // Notified at commit (never on rollback) to wake relays; see `crate::notify`.
        let channel = crate::notify::channel_name(schema, p);
        Self {
            enqueue: s(format!(
                "WITH input AS (
    SELECT * FROM unnest($2::text[], $3::text[], $4::text[], $5::bytea[], $6::bytea[])
        WITH ORDINALITY AS i(event_id, destination, key, headers, payload, ord)
), dup AS (
    SELECT t.event_id FROM {events} t WHERE t.event_id IN (SELECT event_id FROM input)
), ins AS (
    INSERT INTO {events} (event_id, destination, key, headers, payload, available_at, created_at)
    SELECT event_id, destination, key, headers, payload, {NOW}, {NOW} FROM input
    WHERE NOT EXISTS (SELECT 1 FROM dup)
    ORDER BY ord
    RETURNING id, event_id
), woke AS (
    SELECT pg_notify('{channel}', '') FROM (SELECT 1 FROM ins LIMIT 1) AS any_row
)
SELECT false AS duplicate, event_id, id FROM ins LEFT JOIN woke ON true
UNION ALL
SELECT true AS duplicate, event_id, NULL::bigint AS id FROM dup"
            )),
            claim: {
                let sql = claim_sql(&events, &tcols, parked_head);
                let (head, tail) = sql.split_once(CLAIM_LIMIT).expect("the claim statement has a limit");
                (s(head.to_owned()), s(tail.to_owned()))
            },
            complete: s(format!(
                "UPDATE {events} SET published_token = token, published_at = {NOW}, lease_expires_at = NULL
WHERE {fence} RETURNING id"
            )),
            // One owner per statement ($4), not one per row: see `PgStore::complete_many`.
            complete_many: s(format!(
                "WITH input AS (
    SELECT * FROM unnest($2::bigint[], $3::bigint[]) AS i(id, token)
), l AS (
    SELECT t.id FROM {events} t JOIN input i ON t.id = i.id AND t.token = i.token
    WHERE t.owner = $4 AND t.published_at IS NULL AND t.parked_at IS NULL
    ORDER BY t.id
    FOR UPDATE OF t
)
UPDATE {events} AS t SET published_token = t.token, published_at = {NOW}, lease_expires_at = NULL
FROM input i
WHERE t.id IN (SELECT id FROM l) AND t.id = i.id AND t.token = i.token AND t.owner = $4
  AND t.published_at IS NULL AND t.parked_at IS NULL
RETURNING t.id, t.token"
            )),
            fail: s(format!(
                "UPDATE {events} SET attempts = attempts + 1, owner = NULL, lease_expires_at = NULL,
    available_at = {NOW} + $5, last_error = $6
WHERE {fence} RETURNING id"
            )),
            park: s(format!(
                "UPDATE {events} SET owner = NULL, lease_expires_at = NULL, parked_at = {NOW}, last_error = $5
WHERE {fence} RETURNING id"
            )),
            extend: s(format!("UPDATE {events} SET lease_expires_at = {NOW} + $5 WHERE {fence} RETURNING id")),
            release: s(format!(
                "UPDATE {events} SET owner = NULL, lease_expires_at = NULL, available_at = {NOW}
WHERE {fence} RETURNING id"
            )),
            list_parked: s(format!("SELECT {cols} FROM {events} WHERE parked_at IS NOT NULL ORDER BY id LIMIT $1")),
            requeue: s(format!(
                "UPDATE {events} SET parked_at = NULL, attempts = 0, available_at = {NOW}
WHERE id = ANY($2::bigint[]) AND parked_at IS NOT NULL AND published_at IS NULL"
            )),
            purge: s(format!("DELETE FROM {events} WHERE id = ANY($1::bigint[]) AND parked_at IS NOT NULL")),
            stats: s(format!(
                "SELECT
    count(*) FILTER (WHERE {open} AND (lease_expires_at IS NULL OR lease_expires_at <= {NOW})) AS pending,
    count(*) FILTER (WHERE {open} AND lease_expires_at > {NOW}) AS leased,
    count(*) FILTER (WHERE published_at IS NULL AND parked_at IS NOT NULL) AS parked,
    count(*) FILTER (WHERE published_at IS NOT NULL) AS published,
    min(created_at) FILTER (WHERE {open} AND (lease_expires_at IS NULL OR lease_expires_at <= {NOW})) AS oldest,
    {NOW} AS now
FROM {events}"
            )),
            inspect: s(format!("SELECT {NOW} AS now, {cols} FROM {events} WHERE id > $2 ORDER BY id LIMIT $3")),
            mark_insert: s(format!(
                "INSERT INTO {markers} (consumer, event_id, fingerprint, at) VALUES ($2, $3, $4, {NOW})
ON CONFLICT (consumer, event_id) DO NOTHING RETURNING true"
            )),
            mark_select: s(format!("SELECT fingerprint FROM {markers} WHERE consumer = $1 AND event_id = $2")),
            mark_then_begin: s(format!("INSERT INTO {markers} (consumer, event_id, fingerprint, at) VALUES (")),
            version_insert: s(format!(
                "INSERT INTO {versions} (consumer, subject, version) VALUES ($1, $2, $3)
ON CONFLICT (consumer, subject) DO NOTHING RETURNING true"
            )),
            version_lock: s(format!("SELECT version FROM {versions} WHERE consumer = $1 AND subject = $2 FOR UPDATE")),
            version_update: s(format!("UPDATE {versions} SET version = $3 WHERE consumer = $1 AND subject = $2")),
            ledger_fresh: s(format!(
                "INSERT INTO {ledger} (consumer, event_id, state) VALUES ($1, $2, 'fresh')
ON CONFLICT (consumer, event_id) DO NOTHING"
            )),
            ledger_lock: s(format!("SELECT state FROM {ledger} WHERE consumer = $1 AND event_id = $2 FOR UPDATE")),
            ledger_set: s(format!(
                "INSERT INTO {ledger} (consumer, event_id, state) VALUES ($1, $2, $3)
ON CONFLICT (consumer, event_id) DO UPDATE SET state = EXCLUDED.state"
            )),
            dead_letter: s(format!(
                "INSERT INTO {dead} (consumer, event_id, destination, key, headers, reason, error, payload, at)
VALUES ($2, $3, $4, $5, $6, $7, $8, $9, {NOW})"
            )),
            record_failure: s(format!(
                "INSERT INTO {failures} AS f (consumer, event_id, failures) VALUES ($1, $2, 1)
ON CONFLICT (consumer, event_id) DO UPDATE SET failures = f.failures + 1 RETURNING failures"
            )),
            markers: s(format!(
                "SELECT event_id, fingerprint, at FROM {markers} WHERE consumer = $1 ORDER BY event_id COLLATE \"C\""
            )),
            dead_letters: s(format!(
                "SELECT id, event_id, destination, key, headers, reason, error, payload, at FROM {dead}
WHERE consumer = $1 ORDER BY id"
            )),
            remove_dead_letters: s(format!(
                "WITH gone AS (
    DELETE FROM {dead} WHERE consumer = $1 AND id = ANY($2::bigint[]) RETURNING event_id
), cleared AS (
    DELETE FROM {failures} WHERE consumer = $1 AND event_id IN (SELECT event_id FROM gone)
)
SELECT count(*) FROM gone"
            )),
            prune: s(format!("DELETE FROM {markers} WHERE consumer = $2 AND at < {NOW} - $3")),
            purge_published: s(crate::retention::purge_published_sql(&events, NOW)),
            version_table: s(format!(
                "CREATE TABLE IF NOT EXISTS {version} (
    version integer CONSTRAINT {pkey} PRIMARY KEY,
    applied_at timestamptz NOT NULL DEFAULT now()
)",
                pkey = n("schema_version_pkey")
            )),
            version_read: s(format!("SELECT max(version) FROM {version}")),
            version_insert_row: s(format!("INSERT INTO {version} (version) VALUES ($1)")),
            migrations: vec![(1, s(v1)), (2, s(v2)), (3, s(v3)), (4, s(v4)), (5, s(v5))],
        }
    }
}

/// The rows that may hold back the later rows of their key: unpublished keyed rows that are or
/// were leased, have failed, or are parked (the predicate of `events_key_held`, migration 5, with
/// columns prefixed by `a`). A fresh row is due and unleased, so it never holds a key back; a row
/// that left the index (published) never does either. The index stays as small as the rows in
/// flight plus the failed and parked ones, whatever the backlog.
fn held(a: &str) -> String {
    format!(
        "{a}published_at IS NULL AND {a}key IS NOT NULL \
         AND ({a}lease_expires_at IS NOT NULL OR {a}attempts > 0 OR {a}parked_at IS NOT NULL)"
    )
}

/// Where [`claim_sql`] has its limit, replaced by [`PgTables::claim_statement`].
const CLAIM_LIMIT: &str = "{limit}";

/// The claim statement: `$1` now in ms (`NULL`: database clock), `$2` owner, `$3` lease in ms,
/// and [`CLAIM_LIMIT`] where the limit goes. "Now" is read through `(SELECT …)`, an init plan
/// that runs once per statement: to the planner an unknown value in the custom plan as in the
/// generic one, so the two cost the same and PostgreSQL keeps the generic plan.
///
/// Key order (see [`OutboxStore::claim`](outbox_core::OutboxStore::claim)) in three steps, so that
/// the cost follows the batch and the rows in flight, not a key's backlog:
///
/// 1. `b` lists the keys held back now and, per key, its first holding row: a leased row, a row
///    backing off, and under [`ParkedHead::Block`] a parked row — read from `events_key_held`,
///    which holds only rows in flight, failed or parked, grouped by key in a hash table (a
///    `DISTINCT ON` sorted them by key first: about a tenth of the claim with 1,700 rows in
///    flight, `docs/bench.md`). `bm` turns that list into one `jsonb`
///    object, key to first holding row, and notes the highest of those rows.
/// 2. `c` walks the open rows in id order (the `events_claimable` index) and takes, with
///    `FOR UPDATE SKIP LOCKED`, the first `limit` that are due, unleased, and not held back: a row
///    is held back exactly when its key has a holding row before it, that is when its key's first
///    holding row is lower. A row whose key is not in `b` passes on a hash lookup; a row above
///    every first holding row is dropped on one more comparison; only a row of a held key below
///    that reads its key's first holding row from `bm` (a binary search in the object). No step
///    probes an index per held key or per row, so a claim beside many rows in flight costs little
///    more than one beside none, and when every key's head is in flight (a deep pipeline over few
///    keys) the walk costs a hash lookup and a comparison per row.
/// 3. `ok` keeps a row of `c` only if every earlier unpublished row of its key is in `c` too: per
///    key of the batch, the first unpublished row that is not in `c` (the "gap": a row skipped
///    because another claim holds its lock, or changed since the statement's snapshot) drops the
///    key's rows after it. Rows `c` locked but `ok` dropped are left unchanged and unlocked when
///    the statement ends. This step alone makes the claim correct; the first two only keep
///    held rows from filling the batch.
///
/// Rows without a key skip every check. Under [`ParkedHead::Skip`] parked rows are left out of a
/// key's chain (they neither hold a key back nor count as its head); under `Block` a parked row
/// holds its key back like a leased one. The gap probes of `events_key_open` use row comparisons
/// on `(key, id)` so that only that index can serve them (a plain `key = …` probe may be planned
/// on the primary key, walking every published row).
fn claim_sql(events: &str, tcols: &str, parked_head: ParkedHead) -> String {
    let now = format!("(SELECT {NOW})");
    let (chain, parked_holds) = match parked_head {
        ParkedHead::Block => ("", "h.parked_at IS NOT NULL OR "),
        ParkedHead::Skip => ("AND {a}.parked_at IS NULL", ""),
    };
    let chain = |a: &str| chain.replace("{a}", a);
    let holds_h = format!(
        "{} AND ({parked_holds}h.available_at > {now} OR h.lease_expires_at > {now}) {}",
        held("h."),
        chain("h")
    );
    let chain_e = chain("e");
    format!(
        "WITH b AS MATERIALIZED (
    SELECT h.key, min(h.id) AS id FROM {events} h
    WHERE {holds_h}
    GROUP BY h.key
), bm AS MATERIALIZED (
    SELECT jsonb_object_agg(b.key, b.id) AS first, max(b.id) AS last FROM b
), c AS (
    SELECT t.id, t.key FROM {events} t
    WHERE t.published_at IS NULL AND t.parked_at IS NULL
      AND t.available_at <= {now}
      AND (t.lease_expires_at IS NULL OR t.lease_expires_at <= {now})
      AND (t.key IS NULL OR t.key NOT IN (SELECT key FROM b) OR (
          t.id < (SELECT last FROM bm) AND ((SELECT first FROM bm) ->> t.key)::bigint > t.id
      ))
    ORDER BY t.id
    LIMIT {CLAIM_LIMIT}
    FOR UPDATE SKIP LOCKED
), k AS (
    SELECT DISTINCT key FROM c WHERE key IS NOT NULL
), g AS MATERIALIZED (
    SELECT k.key, x.id AS gap FROM k LEFT JOIN LATERAL (
        SELECT e.key, e.id FROM {events} e
        WHERE (e.key, e.id) > (k.key, 0::bigint) AND e.key IS NOT NULL AND e.published_at IS NULL {chain_e}
          AND e.id NOT IN (SELECT id FROM c)
        ORDER BY e.key, e.id LIMIT 1
    ) x ON x.key = k.key
), ok AS (
    SELECT c.id FROM c LEFT JOIN g ON g.key = c.key WHERE g.gap IS NULL OR c.id < g.gap
), u AS (
    UPDATE {events} AS t
    SET token = t.token + 1, owner = $2, lease_expires_at = {now} + $3
    FROM ok
    WHERE t.id = ok.id
    RETURNING {tcols}
)
SELECT * FROM u ORDER BY id"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_quoted_and_prefixed() {
        let config = PgConfig::from_url("postgres://h/db").unwrap().with_schema("s1").with_table_prefix("ob_");
        let tables = PgTables::new(&config).unwrap();
        assert_eq!(tables.table("events").unwrap(), "\"s1\".\"ob_events\"");
        assert!(tables.table("events\" x").is_err());
        let claim = tables.claim_sql(250);
        assert!(claim.contains("FOR UPDATE SKIP LOCKED"));
        assert!(claim.contains("\"s1\".\"ob_events\""));
        assert!(claim.contains("LIMIT 250\n") && !claim.contains(CLAIM_LIMIT), "{claim}");
        assert!(!claim.contains("$4"), "{claim}");
        assert_eq!(tables.app_table("credits").unwrap(), "\"s1\".\"credits\"");
        assert!(tables.app_table("Credits").is_err());
        let (v, sql) = tables.migration_sql().next().unwrap();
        assert_eq!(v, 1);
        assert!(sql.contains("\"ob_events_claimable\""));
        assert_eq!(tables.migration_sql().last().map(|(v, _)| v), Some(SCHEMA_VERSION));
    }

    #[test]
    fn v2_fills_old_dead_letters_with_the_documented_defaults() {
        let config = PgConfig::from_url("postgres://h/db").unwrap();
        let tables = PgTables::new(&config).unwrap();
        let (v, sql) = tables.migration_sql().find(|(v, _)| *v == 2).unwrap();
        assert_eq!(v, 2);
        // Frozen text; these are what the literals must stay equal to.
        assert!(sql.contains(&format!("'{}'", outbox_core::inbox::UNKNOWN_DESTINATION)));
        let none = outbox_core::event::encode_headers(&outbox_core::Headers::new());
        let hex: String = none.iter().map(|b| format!("{b:02x}")).collect();
        assert!(sql.contains(&format!("decode('{hex}', 'hex')")), "{hex}");
    }

    #[test]
    fn every_named_object_is_listed_in_the_suffixes() {
        let config = PgConfig::from_url("postgres://h/db").unwrap().with_table_prefix("zz_");
        let tables = PgTables::new(&config).unwrap();
        let all: String =
            tables.migration_sql().map(|(_, s)| s.to_string()).collect::<String>() + &tables.sql.version_table;
        for word in all.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')) {
            if let Some(suffix) = word.strip_prefix("zz_") {
                assert!(crate::config::DERIVED_SUFFIXES.contains(&suffix), "{suffix} is not in DERIVED_SUFFIXES");
            }
        }
    }
}
