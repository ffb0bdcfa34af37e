//! Connection settings and table naming, validated before any SQL runs.
//!
//! Table names are spliced into SQL text (PostgreSQL cannot bind identifiers), so the schema and
//! prefix are held to a strict identifier alphabet and a length that keeps every derived name
//! under PostgreSQL's 63-byte limit, where the server would otherwise truncate silently and two
//! prefixes could collide.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use outbox_core::event::DEFAULT_MAX_PAYLOAD;
use outbox_core::{Error, Result};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use url::Url;

use crate::error::BACKEND;

/// The environment variable [`PgConfig::from_env`] reads.
pub const URL_ENV: &str = "OUTBOX_PG_URL";

/// The URL [`PgConfig::from_env`] falls back to when [`URL_ENV`] is unset (the development and
/// test server started by `scripts/services ensure postgres`).
pub const DEFAULT_URL: &str = "postgres://postgres:postgres@127.0.0.1:5432/test";

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
/// | `outbox_statement_timeout_ms` | [`statement_timeout`](PgConfig::statement_timeout) | 5000 |
/// | `outbox_lock_timeout_ms` | [`lock_timeout`](PgConfig::lock_timeout) | 2000 |
/// | `outbox_connect_timeout_ms` | [`connect_timeout`](PgConfig::connect_timeout) | 10000 |
/// | `outbox_max_payload` | [`max_payload`](PgConfig::max_payload) | 1 MiB |
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
    statement_timeout: Duration,
    lock_timeout: Duration,
    connect_timeout: Duration,
    max_payload: usize,
    application_name: Option<String>,
}

impl PgConfig {
    /// Settings for `url` with every other field at its default.
    ///
    /// # Errors
    /// [`ErrorKind::Config`](outbox_core::ErrorKind::Config) when the URL does not parse, is not
    /// `postgres://` / `postgresql://`, or carries an invalid `outbox_*` parameter.
    pub fn from_url(url: &str) -> Result<Self> {
        let mut parsed = Url::parse(url)
            .map_err(|e| Error::config(BACKEND, format!("cannot parse the PostgreSQL URL {}: {e}", redact_str(url))))?;
        if !matches!(parsed.scheme(), "postgres" | "postgresql") {
            return Err(Error::config(
                BACKEND,
                format!("the URL {} is not postgres:// or postgresql://", redact_url(&parsed)),
            ));
        }
        let mut config = Self {
            url: String::new(),
            schema: "public".into(),
            table_prefix: "outbox_".into(),
            pool_size: 10,
            statement_timeout: Duration::from_secs(5),
            lock_timeout: Duration::from_secs(2),
            connect_timeout: Duration::from_secs(10),
            max_payload: DEFAULT_MAX_PAYLOAD,
            application_name: None,
        };
        let mut kept = Vec::new();
        for (key, value) in parsed.query_pairs() {
            let number = |what: &str| {
                value.parse::<u64>().map_err(|_| {
                    Error::config(BACKEND, format!("URL parameter {key}={value:?} must be a whole number of {what}"))
                })
            };
            match &*key {
                "outbox_schema" => config.schema = value.to_string(),
                "outbox_table_prefix" => config.table_prefix = value.to_string(),
                "outbox_pool_size" => {
                    config.pool_size = u32::try_from(number("connections")?)
                        .map_err(|_| Error::config(BACKEND, format!("outbox_pool_size={value} is too large")))?;
                }
                "outbox_statement_timeout_ms" => config.statement_timeout = Duration::from_millis(number("ms")?),
                "outbox_lock_timeout_ms" => config.lock_timeout = Duration::from_millis(number("ms")?),
                "outbox_connect_timeout_ms" => config.connect_timeout = Duration::from_millis(number("ms")?),
                "outbox_max_payload" => {
                    config.max_payload = usize::try_from(number("bytes")?)
                        .map_err(|_| Error::config(BACKEND, format!("outbox_max_payload={value} is too large")))?;
                }
                _ => kept.push((key.into_owned(), value.into_owned())),
            }
        }
        if kept.is_empty() {
            parsed.set_query(None);
        } else {
            parsed.query_pairs_mut().clear().extend_pairs(kept);
        }
        config.url = parsed.into();
        config.validate()?;
        Ok(config)
    }

    /// Settings from the URL in [`URL_ENV`] (`OUTBOX_PG_URL`), or [`DEFAULT_URL`] when it is unset.
    ///
    /// # Errors
    /// As [`from_url`](PgConfig::from_url); also when the variable is not valid Unicode.
    pub fn from_env() -> Result<Self> {
        match std::env::var(URL_ENV) {
            Ok(url) => Self::from_url(&url),
            Err(std::env::VarError::NotPresent) => Self::from_url(DEFAULT_URL),
            Err(e) => Err(Error::config(BACKEND, format!("{URL_ENV}: {e}"))),
        }
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

    /// Largest number of pooled connections.
    #[must_use]
    pub fn with_pool_size(mut self, connections: u32) -> Self {
        self.pool_size = connections;
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

    /// `application_name` of every connection (shown in `pg_stat_activity`); overrides the
    /// URL's `application_name` parameter.
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

    /// The driver URL with the password replaced by `***`.
    pub fn redacted_url(&self) -> String {
        redact_str(&self.url)
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

    /// The driver's connect options (the URL without the `outbox_*` parameters).
    ///
    /// # Errors
    /// [`ErrorKind::Config`](outbox_core::ErrorKind::Config) when sqlx rejects the URL.
    pub fn connect_options(&self) -> Result<PgConnectOptions> {
        PgConnectOptions::from_str(&self.url)
            .map_err(|e| Error::config(BACKEND, format!("invalid PostgreSQL URL {}: {e}", self.redacted_url())))
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
            .field("statement_timeout", &self.statement_timeout)
            .field("lock_timeout", &self.lock_timeout)
            .field("connect_timeout", &self.connect_timeout)
            .field("max_payload", &self.max_payload)
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

fn redact_url(url: &Url) -> String {
    let mut url = url.clone();
    if url.password().is_some() {
        // Only fails for URLs that cannot have a password, which this one has.
        let _ = url.set_password(Some("***"));
    }
    if url.query_pairs().any(|(k, _)| k == "password") {
        let pairs: Vec<(String, String)> = url
            .query_pairs()
            .map(|(k, v)| {
                let v = if k == "password" { "***".to_string() } else { v.into_owned() };
                (k.into_owned(), v)
            })
            .collect();
        url.query_pairs_mut().clear().extend_pairs(pairs);
    }
    url.into()
}

/// Redact a URL given as text; text that does not parse is hidden entirely.
fn redact_str(url: &str) -> String {
    match Url::parse(url) {
        Ok(u) => redact_url(&u),
        Err(_) => "<unparsable URL>".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use outbox_core::ErrorKind;

    #[test]
    fn parses_outbox_parameters_and_strips_them() {
        let c = PgConfig::from_url(
            "postgres://u:secret@db:5433/app?sslmode=disable&outbox_schema=ops&outbox_table_prefix=ob_\
             &outbox_pool_size=3&outbox_statement_timeout_ms=700&outbox_lock_timeout_ms=300\
             &outbox_connect_timeout_ms=900&outbox_max_payload=42",
        )
        .unwrap();
        assert_eq!(c.schema(), "ops");
        assert_eq!(c.table_prefix(), "ob_");
        assert_eq!(c.pool_size(), 3);
        assert_eq!(c.statement_timeout(), Duration::from_millis(700));
        assert_eq!(c.lock_timeout(), Duration::from_millis(300));
        assert_eq!(c.connect_timeout(), Duration::from_millis(900));
        assert_eq!(c.max_payload(), 42);
        assert_eq!(c.redacted_url(), "postgres://u:***@db:5433/app?sslmode=disable");
        assert!(c.connect_options().is_ok());
    }

    #[test]
    fn defaults() {
        let c = PgConfig::from_url(DEFAULT_URL).unwrap();
        assert_eq!(c.schema(), "public");
        assert_eq!(c.table_prefix(), "outbox_");
        assert_eq!(c.statement_timeout(), Duration::from_secs(5));
        assert_eq!(c.lock_timeout(), Duration::from_secs(2));
        assert_eq!(c.max_payload(), DEFAULT_MAX_PAYLOAD);
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

    #[test]
    fn identifiers_are_validated() {
        let base = PgConfig::from_url(DEFAULT_URL).unwrap();
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
