//! Connection settings and table naming, validated before any SQL runs.
//!
//! Table names are spliced into SQL text (PostgreSQL cannot bind identifiers), so the schema and
//! prefix are held to a strict identifier alphabet and a length that keeps every derived name
//! under PostgreSQL's 63-byte limit, where the server would otherwise truncate silently and two
//! prefixes could collide.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use outbox_core::config::{ConnectionUrl, UrlSpec, env_url, redact};
use outbox_core::event::DEFAULT_MAX_PAYLOAD;
use outbox_core::{Error, ParkedHead, Result};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

use crate::error::BACKEND;

/// The environment variable [`PgConfig::from_env`] reads.
pub const URL_ENV: &str = "OUTBOX_PG_URL";

/// The URLs [`PgConfig::from_url`] accepts.
const URL_SPEC: UrlSpec = UrlSpec::new(BACKEND, &["postgres", "postgresql"]);

/// PostgreSQL's identifier limit (`NAMEDATALEN - 1`).
pub const MAX_IDENTIFIER_LEN: usize = 63;

/// Every name this crate derives from the table prefix (tables, indexes, constraints and
/// sequences). The longest one bounds the prefix length.
pub(crate) const DERIVED_SUFFIXES: &[&str] = &[
    "events",
    "events_pkey",
    "events_id_seq",
    "events_event_id_key",
    "events_claimable",
    "events_parked",
    "events_key_open",
    "events_key_held",
    "events_published",
    "schema_version",
    "schema_version_pkey",
    "inbox_markers",
    "inbox_markers_pkey",
    "inbox_markers_at",
    "inbox_versions",
    "inbox_versions_pkey",
    "inbox_ledger",
    "inbox_ledger_pkey",
    "inbox_ledger_state",
    "inbox_failures",
    "inbox_failures_pkey",
    "dead_letters",
    "dead_letters_pkey",
    "dead_letters_id_seq",
    "dead_letters_consumer",
];

const fn longest_suffix() -> usize {
    let mut i = 0;
    let mut max = 0;
    while i < DERIVED_SUFFIXES.len() {
        if DERIVED_SUFFIXES[i].len() > max {
            max = DERIVED_SUFFIXES[i].len();
        }
        i += 1;
    }
    max
}

/// Longest accepted table prefix: the longest derived name (`<prefix>dead_letters_consumer`)
/// must fit in [`MAX_IDENTIFIER_LEN`] bytes.
pub const MAX_PREFIX_LEN: usize = MAX_IDENTIFIER_LEN - longest_suffix();

/// The connect parameters sqlx reads from a `postgres://` URL (sqlx-postgres `options/parse.rs`),
/// besides `options[NAME]`.
const SQLX_PARAMS: &[&str] = &[
    "sslmode",
    "ssl-mode",
    "sslrootcert",
    "ssl-root-cert",
    "ssl-ca",
    "sslcert",
    "ssl-cert",
    "sslkey",
    "ssl-key",
    "statement-cache-capacity",
    "host",
    "hostaddr",
    "port",
    "dbname",
    "user",
    "password",
    "application_name",
    "options",
];

fn is_sqlx_param(name: &str) -> bool {
    SQLX_PARAMS.contains(&name) || (name.starts_with("options[") && name.ends_with(']'))
}

/// Settings of a [`PgStore`](crate::PgStore): where to connect, where the tables live, and the
/// limits applied to every connection.
///
/// Parsed from a `postgres://` URL. Besides the parameters sqlx understands (`sslmode`,
/// `application_name`, ...), the URL may carry the outbox's own settings, which are removed
/// before the URL reaches the driver:
///
/// | parameter | field | default |
/// |---|---|---|
/// | `outbox_schema` | [`schema`](PgConfig::schema) | `public` |
/// | `outbox_table_prefix` | [`table_prefix`](PgConfig::table_prefix) | `outbox_` |
/// | `outbox_pool_size` | [`pool_size`](PgConfig::pool_size) | 10 |
/// | `outbox_kept_connections` | [`kept_connections`](PgConfig::kept_connections) | 2 |
/// | `outbox_statement_timeout_ms` | [`statement_timeout`](PgConfig::statement_timeout) | 5000 |
/// | `outbox_lock_timeout_ms` | [`lock_timeout`](PgConfig::lock_timeout) | 2000 |
/// | `outbox_connect_timeout_ms` | [`connect_timeout`](PgConfig::connect_timeout) | 10000 |
/// | `outbox_max_payload` | [`max_payload`](PgConfig::max_payload) | 1 MiB |
/// | `outbox_parked_head` | [`parked_head`](PgConfig::parked_head) | `block` |
///
/// An `outbox_*` parameter not in this table is an error that lists the known ones, so a typo
/// cannot silently fall back to a default; so is a parameter sqlx does not read (it would only
/// log that it ignores `schema=ops` or a libpq `connect_timeout`). The user name, password and
/// database are percent-decoded (a password `p@ss` is written `p%40ss`).
///
/// `Debug` and `Display` never show the password (neither the one in the user info nor a
/// `password=` parameter).
#[derive(Clone, PartialEq, Eq)]
pub struct PgConfig {
    /// The driver URL, without the `outbox_*` parameters.
    url: String,
    schema: String,
    table_prefix: String,
    pool_size: u32,
    kept_connections: u32,
    statement_timeout: Duration,
    lock_timeout: Duration,
    connect_timeout: Duration,
    max_payload: usize,
    parked_head: ParkedHead,
    application_name: Option<String>,
}

impl PgConfig {
    /// Settings for `url` with every other field at its default.
    ///
    /// # Errors
    /// [`ErrorKind::Config`](outbox_core::ErrorKind::Config) when the URL does not parse, is not
    /// `postgres://` / `postgresql://`, carries an unknown or invalid `outbox_*` parameter, a
    /// parameter sqlx does not read or rejects, or names an invalid schema or prefix. The message
    /// shows the URL with its password redacted.
    pub fn from_url(url: &str) -> Result<Self> {
        let mut url = ConnectionUrl::parse(&URL_SPEC, url)?;
        let config = Self {
            schema: url.outbox_str("outbox_schema").unwrap_or_else(|| "public".into()),
            table_prefix: url.outbox_str("outbox_table_prefix").unwrap_or_else(|| "outbox_".into()),
            pool_size: url.outbox_u32("outbox_pool_size")?.unwrap_or(10),
            kept_connections: url.outbox_u32("outbox_kept_connections")?.unwrap_or(2),
            statement_timeout: url.outbox_duration_ms("outbox_statement_timeout_ms")?.unwrap_or(Duration::from_secs(5)),
            lock_timeout: url.outbox_duration_ms("outbox_lock_timeout_ms")?.unwrap_or(Duration::from_secs(2)),
            connect_timeout: url.outbox_duration_ms("outbox_connect_timeout_ms")?.unwrap_or(Duration::from_secs(10)),
            max_payload: url.outbox_usize("outbox_max_payload")?.unwrap_or(DEFAULT_MAX_PAYLOAD),
            parked_head: url.outbox_parse("outbox_parked_head")?.unwrap_or_default(),
            application_name: None,
            url: url.driver_url(),
        };
        url.finish()?;
        // sqlx ignores a parameter it does not know (a `schema=ops` meant as `outbox_schema`, a
        // libpq `connect_timeout`) with a log line: refuse it here instead.
        url.reject_driver_params_except(
            is_sqlx_param,
            &format!("or a connect parameter of sqlx: {}, options[NAME]", SQLX_PARAMS.join(", ")),
        )?;
        config.validate()?;
        // sqlx has the last word on its own parameters' values (`sslmode`, ...).
        config.connect_options()?;
        Ok(config)
    }

    /// Settings from the URL in [`URL_ENV`] (`OUTBOX_PG_URL`). There is no default server.
    ///
    /// # Errors
    /// [`ErrorKind::Config`](outbox_core::ErrorKind::Config) when the variable is unset, blank
    /// or not valid Unicode, or as [`from_url`](PgConfig::from_url).
    pub fn from_env() -> Result<Self> {
        Self::from_url(&env_url(URL_ENV, BACKEND)?)
    }

    /// Put the tables in `schema` (created by [`PgStore::migrate`](crate::PgStore::migrate) if
    /// missing). Validated when the config is used.
    #[must_use]
    pub fn with_schema(mut self, schema: impl Into<String>) -> Self {
        self.schema = schema.into();
        self
    }

    /// Prefix every table, index and sequence name with `prefix`. Validated when the config is used.
    #[must_use]
    pub fn with_table_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.table_prefix = prefix.into();
        self
    }

    /// Largest number of pooled connections. The store keeps up to
    /// [`kept_connections`](PgConfig::kept_connections) more for a relay's claim and completion,
    /// outside the pool.
    #[must_use]
    pub fn with_pool_size(mut self, connections: u32) -> Self {
        self.pool_size = connections;
        self
    }

    /// How many connections the store keeps outside the pool for a relay's claim and completion
    /// (the crate's "Connections kept for the relay"); 0 runs them on pool connections like
    /// every other statement, so that the store never has more than
    /// [`pool_size`](PgConfig::pool_size) connections besides its `LISTEN` one.
    #[must_use]
    pub fn with_kept_connections(mut self, connections: u32) -> Self {
        self.kept_connections = connections;
        self
    }

    /// `statement_timeout` set on every pooled connection (zero disables it).
    #[must_use]
    pub fn with_statement_timeout(mut self, timeout: Duration) -> Self {
        self.statement_timeout = timeout;
        self
    }

    /// `lock_timeout` set on every pooled connection (zero disables it).
    #[must_use]
    pub fn with_lock_timeout(mut self, timeout: Duration) -> Self {
        self.lock_timeout = timeout;
        self
    }

    /// How long connecting, or waiting for a pooled connection, may take.
    #[must_use]
    pub fn with_connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// Largest payload accepted by enqueue ([`ErrorKind::TooLarge`](outbox_core::ErrorKind::TooLarge) beyond).
    #[must_use]
    pub fn with_max_payload(mut self, bytes: usize) -> Self {
        self.max_payload = bytes;
        self
    }

    /// What a parked row does to the later rows of its key when relays claim
    /// ([`ParkedHead::Block`] by default: the key waits for an operator; see
    /// [`OutboxStore::claim`](outbox_core::OutboxStore::claim)).
    #[must_use]
    pub fn with_parked_head(mut self, parked_head: ParkedHead) -> Self {
        self.parked_head = parked_head;
        self
    }

    /// `application_name` of every connection this config opens (shown in `pg_stat_activity`);
    /// overrides the URL's `application_name` parameter. It is part of
    /// [`connect_options`](PgConfig::connect_options), so it applies to a pool built from them
    /// and to [`PgStore::connect`](crate::PgStore::connect).
    #[must_use]
    pub fn with_application_name(mut self, name: impl Into<String>) -> Self {
        self.application_name = Some(name.into());
        self
    }

    /// The schema holding the tables.
    pub fn schema(&self) -> &str {
        &self.schema
    }

    /// The table-name prefix.
    pub fn table_prefix(&self) -> &str {
        &self.table_prefix
    }

    /// Largest number of pooled connections.
    pub fn pool_size(&self) -> u32 {
        self.pool_size
    }

    /// Connections kept outside the pool for a relay's claim and completion (default 2).
    pub fn kept_connections(&self) -> u32 {
        self.kept_connections
    }

    /// `statement_timeout` of every pooled connection.
    pub fn statement_timeout(&self) -> Duration {
        self.statement_timeout
    }

    /// `lock_timeout` of every pooled connection.
    pub fn lock_timeout(&self) -> Duration {
        self.lock_timeout
    }

    /// Connect / acquire timeout.
    pub fn connect_timeout(&self) -> Duration {
        self.connect_timeout
    }

    /// Largest accepted payload, in bytes.
    pub fn max_payload(&self) -> usize {
        self.max_payload
    }

    /// What a parked row does to the later rows of its key (see
    /// [`with_parked_head`](PgConfig::with_parked_head)).
    pub fn parked_head(&self) -> ParkedHead {
        self.parked_head
    }

    /// The `application_name` set by [`with_application_name`](PgConfig::with_application_name),
    /// if any (a URL's `application_name` parameter is the driver's and is not shown here).
    pub fn application_name(&self) -> Option<&str> {
        self.application_name.as_deref()
    }

    /// The driver URL with the password replaced by `***`.
    pub fn redacted_url(&self) -> String {
        redact(&self.url)
    }

    /// Check the schema and prefix (identifier alphabet and length) and the pool size.
    ///
    /// # Errors
    /// [`ErrorKind::Config`](outbox_core::ErrorKind::Config) naming the bad value.
    pub fn validate(&self) -> Result<()> {
        validate_identifier("schema", &self.schema, MAX_IDENTIFIER_LEN)?;
        if self.schema.starts_with("pg_") {
            return Err(Error::config(
                BACKEND,
                format!("schema {:?}: names starting with pg_ are reserved by PostgreSQL", self.schema),
            ));
        }
        validate_identifier("table prefix", &self.table_prefix, MAX_PREFIX_LEN)?;
        if self.pool_size == 0 {
            return Err(Error::config(BACKEND, "pool size must be at least 1"));
        }
        Ok(())
    }

    /// The driver's connect options: the URL without the `outbox_*` parameters, and the
    /// [`application_name`](PgConfig::with_application_name) when one was set.
    ///
    /// # Errors
    /// [`ErrorKind::Config`](outbox_core::ErrorKind::Config) when sqlx rejects the URL.
    pub fn connect_options(&self) -> Result<PgConnectOptions> {
        let options = PgConnectOptions::from_str(&self.url)
            .map_err(|e| Error::config(BACKEND, format!("invalid PostgreSQL URL {}: {e}", self.redacted_url())))?;
        Ok(match &self.application_name {
            Some(name) => options.application_name(name),
            None => options,
        })
    }

    /// Pool options carrying this config's pool size, connect timeout, and the per-connection
    /// `statement_timeout` / `lock_timeout` (set in `after_connect`). Use them to build a pool
    /// shared with the application and pass it to [`PgStore::from_pool`](crate::PgStore::from_pool).
    pub fn pool_options(&self) -> PgPoolOptions {
        let settings = self.session_settings();
        PgPoolOptions::new().max_connections(self.pool_size).acquire_timeout(self.connect_timeout).after_connect(
            move |conn, _meta| {
                let settings = settings.clone();
                Box::pin(async move { settings.apply(conn).await })
            },
        )
    }

    pub(crate) fn session_settings(&self) -> SessionSettings {
        SessionSettings {
            statement_timeout: self.statement_timeout.as_millis().to_string(),
            lock_timeout: self.lock_timeout.as_millis().to_string(),
        }
    }
}

/// Per-connection settings applied right after connecting.
#[derive(Debug, Clone)]
pub(crate) struct SessionSettings {
    statement_timeout: String,
    lock_timeout: String,
}

impl SessionSettings {
    pub(crate) async fn apply(&self, conn: &mut sqlx::PgConnection) -> std::result::Result<(), sqlx::Error> {
        sqlx::query("SELECT set_config('statement_timeout', $1, false), set_config('lock_timeout', $2, false)")
            .bind(&self.statement_timeout)
            .bind(&self.lock_timeout)
            .execute(conn)
            .await
            .map(drop)
    }
}

impl fmt::Debug for PgConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PgConfig")
            .field("url", &self.redacted_url())
            .field("schema", &self.schema)
            .field("table_prefix", &self.table_prefix)
            .field("pool_size", &self.pool_size)
            .field("kept_connections", &self.kept_connections)
            .field("statement_timeout", &self.statement_timeout)
            .field("lock_timeout", &self.lock_timeout)
            .field("connect_timeout", &self.connect_timeout)
            .field("max_payload", &self.max_payload)
            .field("parked_head", &self.parked_head)
            .field("application_name", &self.application_name)
            .finish()
    }
}

impl fmt::Display for PgConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} (tables \"{}\".\"{}*\")", self.redacted_url(), self.schema, self.table_prefix)
    }
}

impl FromStr for PgConfig {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        Self::from_url(s)
    }
}

/// Check that `value` is `[a-z_][a-z0-9_]*` and at most `max` bytes long.
///
/// # Errors
/// [`ErrorKind::Config`](outbox_core::ErrorKind::Config) naming `what` and the value.
pub fn validate_identifier(what: &str, value: &str, max: usize) -> Result<()> {
    let mut chars = value.chars();
    let first_ok = chars.next().is_some_and(|c| c.is_ascii_lowercase() || c == '_');
    if !first_ok || !chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_') {
        return Err(Error::config(
            BACKEND,
            format!("{what} {value:?} is not an identifier: it must match [a-z_][a-z0-9_]*"),
        ));
    }
    if value.len() > max {
        return Err(Error::config(
            BACKEND,
            format!("{what} {value:?} is {} bytes, longer than the limit of {max}", value.len()),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use outbox_core::ErrorKind;

    /// Parsing only: nothing connects to it.
    const URL: &str = "postgres://postgres:postgres@127.0.0.1:5432/test";

    #[test]
    fn parses_outbox_parameters_and_strips_them() {
        let c = PgConfig::from_url(
            "postgres://u:secret@db:5433/app?sslmode=disable&outbox_schema=ops&outbox_table_prefix=ob_\
             &outbox_pool_size=3&outbox_kept_connections=0&outbox_statement_timeout_ms=700&outbox_lock_timeout_ms=300\
             &outbox_connect_timeout_ms=900&outbox_max_payload=42",
        )
        .unwrap();
        assert_eq!(c.schema(), "ops");
        assert_eq!(c.table_prefix(), "ob_");
        assert_eq!(c.pool_size(), 3);
        assert_eq!(c.kept_connections(), 0);
        assert_eq!(c.statement_timeout(), Duration::from_millis(700));
        assert_eq!(c.lock_timeout(), Duration::from_millis(300));
        assert_eq!(c.connect_timeout(), Duration::from_millis(900));
        assert_eq!(c.max_payload(), 42);
        assert_eq!(c.redacted_url(), "postgres://u:***@db:5433/app?sslmode=disable");
        assert!(c.connect_options().is_ok());
    }

    #[test]
    fn defaults() {
        let c = PgConfig::from_url(URL).unwrap();
        assert_eq!(c.schema(), "public");
        assert_eq!(c.table_prefix(), "outbox_");
        assert_eq!(c.statement_timeout(), Duration::from_secs(5));
        assert_eq!(c.lock_timeout(), Duration::from_secs(2));
        assert_eq!(c.max_payload(), DEFAULT_MAX_PAYLOAD);
        assert_eq!(c.parked_head(), ParkedHead::Block);
    }

    #[test]
    fn parked_head_from_the_url_or_the_builder() {
        let c = PgConfig::from_url(&format!("{URL}?outbox_parked_head=skip")).unwrap();
        assert_eq!(c.parked_head(), ParkedHead::Skip);
        assert_eq!(c.with_parked_head(ParkedHead::Block).parked_head(), ParkedHead::Block);
        let err = PgConfig::from_url(&format!("{URL}?outbox_parked_head=sometimes")).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Config);
        assert!(err.to_string().contains("outbox_parked_head"), "{err}");
    }

    #[test]
    fn debug_and_display_redact_passwords() {
        let c = PgConfig::from_url("postgresql://u:hunter2@h/db?password=hunter3&application_name=x").unwrap();
        for text in [format!("{c:?}"), c.to_string()] {
            assert!(!text.contains("hunter2") && !text.contains("hunter3"), "{text}");
            assert!(text.contains("***"), "{text}");
        }
        let err = PgConfig::from_url("mysql://u:hunter2@h/db").unwrap_err();
        assert!(!err.to_string().contains("hunter2"), "{err}");
        assert_eq!(err.kind(), ErrorKind::Config);
    }

    /// sqlx would only log that it ignores these, and the tables would land in `public`.
    #[test]
    fn a_parameter_sqlx_does_not_read_is_an_error() {
        for (query, name) in [
            ("schema=ops", "schema"),
            ("sslmode=disable&search_path=ops&outbox_pool_size=2", "search_path"),
            ("connect_timeout=5", "connect_timeout"),
            ("options=-c%20search_path%3Dops&currentSchema=ops", "currentSchema"),
        ] {
            let err = PgConfig::from_url(&format!("postgres://u:hunter2@h/db?{query}")).unwrap_err();
            assert_eq!(err.kind(), ErrorKind::Config, "{query}");
            let text = err.to_string();
            assert!(text.contains(&format!("unknown URL parameter {name:?}")), "{query}: {text}");
            assert!(text.contains("outbox_schema") && text.contains("sslmode"), "{query}: {text}");
            assert!(!text.contains("hunter2"), "{text}");
        }
        // Every parameter sqlx reads passes, `options[NAME]` too.
        let c = PgConfig::from_url(&format!(
            "{URL}?sslmode=prefer&ssl-mode=prefer&statement-cache-capacity=50&application_name=relay\
             &options=-c%20work_mem%3D8MB&options[lock_timeout]=100&dbname=test&port=5432&host=127.0.0.1"
        ))
        .unwrap();
        assert!(c.connect_options().is_ok());
    }

    #[test]
    fn unknown_or_bad_outbox_parameters_are_errors() {
        let err = PgConfig::from_url("postgres://u:hunter2@h/db?outbox_pool_sise=3").unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Config);
        let text = err.to_string();
        assert!(text.contains("outbox_pool_sise") && text.contains("outbox_pool_size"), "{text}");
        assert!(!text.contains("hunter2"), "{text}");
        for bad in [
            "postgres://u:hunter2@h/db?outbox_pool_size=ten",
            "postgres://u:hunter2@h/db?outbox_pool_size=4294967296",
            "postgres://u:hunter2@h/db?outbox_pool_size=0",
            "postgres://u:hunter2@h/db?outbox_lock_timeout_ms=1s",
            "postgres://u:hunter2@h/db?sslmode=sometimes",
            "postgres://u:hunter2@h1,h2/db",
            "postgres://u:hunter2%zz@h/db",
        ] {
            let err = PgConfig::from_url(bad).unwrap_err();
            assert_eq!(err.kind(), ErrorKind::Config, "{bad}");
            assert!(!format!("{err} {err:?}").contains("hunter2"), "{bad}: {err}");
        }
    }

    #[test]
    fn percent_encoded_credentials_reach_the_driver_decoded() {
        let c =
            PgConfig::from_url("postgres://app%40corp:p%40ss%3Aw%25rd@db/my%20db?application_name=from-url").unwrap();
        let options = c.connect_options().unwrap();
        assert_eq!(options.get_username(), "app@corp");
        assert_eq!(options.get_database(), Some("my db"));
        assert_eq!(options.get_application_name(), Some("from-url"));
        for text in [format!("{c:?}"), c.to_string(), c.redacted_url()] {
            assert!(!text.contains("p%40ss") && !text.contains("w%25rd"), "{text}");
        }
    }

    #[test]
    fn application_name_is_set_on_the_connect_options() {
        let c = PgConfig::from_url(URL).unwrap();
        assert_eq!(c.connect_options().unwrap().get_application_name(), None);
        let c = c.with_application_name("relay-7");
        assert_eq!(c.application_name(), Some("relay-7"));
        assert_eq!(c.connect_options().unwrap().get_application_name(), Some("relay-7"));
        let c =
            PgConfig::from_url(&format!("{URL}?application_name=from-url")).unwrap().with_application_name("builder");
        assert_eq!(c.connect_options().unwrap().get_application_name(), Some("builder"));
    }

    #[test]
    fn identifiers_are_validated() {
        let base = PgConfig::from_url(URL).unwrap();
        for bad in ["Bad-Name", "x; drop table", "", "1abc", "a\"b", "Upper", "pg_catalog"] {
            let err = base.clone().with_schema(bad).validate().unwrap_err();
            assert_eq!(err.kind(), ErrorKind::Config, "{bad:?}");
            let err = base.clone().with_table_prefix(bad).validate();
            if bad != "pg_catalog" {
                assert_eq!(err.unwrap_err().kind(), ErrorKind::Config, "{bad:?}");
            }
        }
        let longest = "p".repeat(MAX_PREFIX_LEN);
        assert!(base.clone().with_table_prefix(&longest).validate().is_ok());
        let too_long = format!("{longest}p");
        assert_eq!(base.clone().with_table_prefix(too_long).validate().unwrap_err().kind(), ErrorKind::Config);
        for suffix in DERIVED_SUFFIXES {
            assert!(longest.len() + suffix.len() <= MAX_IDENTIFIER_LEN);
        }
        assert!(base.clone().with_schema("s".repeat(64)).validate().is_err());
        assert!(base.clone().with_schema("s".repeat(63)).validate().is_ok());
        let err = PgConfig::from_url("postgres://h/db?outbox_schema=Bad-Name").unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Config);
    }
}
