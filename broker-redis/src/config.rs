//! Connection and behaviour settings.
//!
//! Everything that changes what the adapter promises (trimming, the dedupe window, the claim idle
//! time) is a field here with a safe default, so the defaults are the honest contract and every
//! departure from it is written down where the broker is built.

use std::fmt;
use std::time::Duration;

use outbox_core::config::{ConnectionUrl, UrlSpec, env_url, redact};
use outbox_core::event::DEFAULT_MAX_PAYLOAD;
use outbox_core::{Capabilities, Error, Result};

use crate::BACKEND;

/// Environment variable [`RedisConfig::from_env`] reads the URL from.
pub const ENV_URL: &str = "OUTBOX_REDIS_URL";
/// Default stream key prefix: the stream of destination `orders` is `outbox:orders`.
pub const DEFAULT_PREFIX: &str = "outbox:";
/// Default time an entry must stay unacknowledged before another consumer may reclaim it.
pub const DEFAULT_CLAIM_IDLE: Duration = Duration::from_secs(30);
/// Default longest single blocking read.
pub const DEFAULT_BLOCK: Duration = Duration::from_secs(1);
/// Default time to establish a connection.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Default time to wait for a reply (a blocking read waits its block time on top of it).
pub const DEFAULT_RESPONSE_TIMEOUT: Duration = Duration::from_secs(5);

/// The URLs [`RedisConfig::from_url`] accepts.
const URL_SPEC: UrlSpec = UrlSpec::new(BACKEND, &["redis", "rediss"]);

/// Settings of a [`RedisBroker`](crate::RedisBroker).
///
/// Build it with [`from_url`](Self::from_url) or [`from_env`](Self::from_env), then adjust the
/// public fields or use the `with_*` methods. The URL may carry every setting as an `outbox_*`
/// parameter:
///
/// | parameter | field |
/// |---|---|
/// | `outbox_prefix` | [`prefix`](Self::prefix) |
/// | `outbox_consumer_name` | [`consumer_name`](Self::consumer_name) |
/// | `outbox_claim_idle_ms` | [`claim_idle`](Self::claim_idle) |
/// | `outbox_block_ms` | [`block`](Self::block) |
/// | `outbox_read_count` | [`read_count`](Self::read_count) |
/// | `outbox_max_len` | [`max_len`](Self::max_len) |
/// | `outbox_dedupe_window_ms` | [`dedupe_window`](Self::dedupe_window) |
/// | `outbox_max_payload` | [`max_payload`](Self::max_payload) |
/// | `outbox_connect_timeout_ms` | [`connect_timeout`](Self::connect_timeout) |
/// | `outbox_response_timeout_ms` | [`response_timeout`](Self::response_timeout) |
///
/// An unknown `outbox_*` parameter is an error; the other parameters are the redis crate's.
/// `Debug` and `Display` never show the password.
#[derive(Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct RedisConfig {
    /// The driver URL, `redis://[user][:password@]host[:port][/db]` or `rediss://…` (TLS),
    /// without `outbox_*` parameters.
    pub url: String,
    /// Prepended to the destination name to form the stream key (default [`DEFAULT_PREFIX`]).
    pub prefix: String,
    /// Base consumer name, unique among the live processes of a group (default
    /// `<hostname>-<pid>`). Each subscription appends its own suffix to it, see
    /// [`RedisBroker::subscribe_as`](crate::RedisBroker::subscribe_as).
    pub consumer_name: String,
    /// An entry delivered to a consumer and left unacknowledged this long is reclaimed by another
    /// member of the group (`XAUTOCLAIM`). It must exceed the longest time a handler takes
    /// (default [`DEFAULT_CLAIM_IDLE`]).
    pub claim_idle: Duration,
    /// Longest single `XREADGROUP … BLOCK` (default [`DEFAULT_BLOCK`]); longer waits are split.
    pub block: Duration,
    /// Entries fetched per read (default 1). Entries fetched but not yet handed out are held by
    /// this subscription like delivered ones, so a larger value trades fairness for round trips.
    pub read_count: usize,
    /// Keep at most this many entries per stream, but never delete an entry some group has not
    /// acknowledged (see the README). `None` (the default) never trims.
    pub max_len: Option<u64>,
    /// Suppress a second publish of an event id to the same destination within this window
    /// (`None`, the default, keeps every publish). Helps within the window only.
    pub dedupe_window: Option<Duration>,
    /// Largest accepted payload (default 1 MiB).
    pub max_payload: usize,
    /// Time to establish a connection (default [`DEFAULT_CONNECT_TIMEOUT`]).
    pub connect_timeout: Duration,
    /// Time to wait for a reply (default [`DEFAULT_RESPONSE_TIMEOUT`]).
    pub response_timeout: Duration,
}

impl RedisConfig {
    /// Settings for `url`: the `outbox_*` parameters it carries, every other field at its
    /// default.
    ///
    /// # Errors
    /// [`ErrorKind::Config`](outbox_core::ErrorKind::Config) when the URL does not parse, its
    /// scheme is not `redis` or `rediss`, it has no host, the redis crate rejects it, or an
    /// `outbox_*` parameter is unknown or invalid. The message never contains the password.
    pub fn from_url(url: &str) -> Result<Self> {
        let mut url = ConnectionUrl::parse(&URL_SPEC, url)?;
        url.require_host()?;
        let config = Self {
            url: url.driver_url(),
            prefix: url.outbox_str("outbox_prefix").unwrap_or_else(|| DEFAULT_PREFIX.to_string()),
            consumer_name: url.outbox_str("outbox_consumer_name").unwrap_or_else(default_consumer_name),
            claim_idle: url.outbox_duration_ms("outbox_claim_idle_ms")?.unwrap_or(DEFAULT_CLAIM_IDLE),
            block: url.outbox_duration_ms("outbox_block_ms")?.unwrap_or(DEFAULT_BLOCK),
            read_count: url.outbox_usize("outbox_read_count")?.unwrap_or(1),
            max_len: url.outbox_u64("outbox_max_len")?,
            dedupe_window: url.outbox_duration_ms("outbox_dedupe_window_ms")?,
            max_payload: url.outbox_usize("outbox_max_payload")?.unwrap_or(DEFAULT_MAX_PAYLOAD),
            connect_timeout: url.outbox_duration_ms("outbox_connect_timeout_ms")?.unwrap_or(DEFAULT_CONNECT_TIMEOUT),
            response_timeout: url.outbox_duration_ms("outbox_response_timeout_ms")?.unwrap_or(DEFAULT_RESPONSE_TIMEOUT),
        };
        url.finish()?;
        config.validate()?;
        Ok(config)
    }

    /// Settings from the URL in the environment variable [`ENV_URL`] (`OUTBOX_REDIS_URL`).
    /// There is no default server.
    ///
    /// # Errors
    /// [`ErrorKind::Config`](outbox_core::ErrorKind::Config) when the variable is unset, blank
    /// or not valid Unicode, or as for [`from_url`](Self::from_url).
    pub fn from_env() -> Result<Self> {
        Self::from_url(&env_url(ENV_URL, BACKEND)?)
    }

    /// Set the stream key prefix.
    #[must_use]
    pub fn with_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// Set the base consumer name.
    #[must_use]
    pub fn with_consumer_name(mut self, name: impl Into<String>) -> Self {
        self.consumer_name = name.into();
        self
    }

    /// Set the claim idle time.
    #[must_use]
    pub fn with_claim_idle(mut self, idle: Duration) -> Self {
        self.claim_idle = idle;
        self
    }

    /// Set the longest single blocking read.
    #[must_use]
    pub fn with_block(mut self, block: Duration) -> Self {
        self.block = block;
        self
    }

    /// Set the entries fetched per read.
    #[must_use]
    pub fn with_read_count(mut self, count: usize) -> Self {
        self.read_count = count;
        self
    }

    /// Enable safe trimming to at most `max_len` entries per stream.
    #[must_use]
    pub fn with_max_len(mut self, max_len: u64) -> Self {
        self.max_len = Some(max_len);
        self
    }

    /// Enable the publish dedupe window.
    #[must_use]
    pub fn with_dedupe_window(mut self, window: Duration) -> Self {
        self.dedupe_window = Some(window);
        self
    }

    /// Set the largest accepted payload.
    #[must_use]
    pub fn with_max_payload(mut self, bytes: usize) -> Self {
        self.max_payload = bytes;
        self
    }

    /// Set the connect and response timeouts.
    #[must_use]
    pub fn with_timeouts(mut self, connect: Duration, response: Duration) -> Self {
        self.connect_timeout = connect;
        self.response_timeout = response;
        self
    }

    /// What a [`RedisBroker`](crate::RedisBroker) built from these settings reports from
    /// [`Broker::capabilities`](outbox_core::Broker::capabilities).
    pub fn capabilities(&self) -> Capabilities {
        // Not unroutable: an XADD to a stream nobody declared creates it. The group's pending
        // list counts deliveries; a nack makes the entry reclaimable at once. Several members
        // read one stream in turns, so one key's entries can be handled out of order.
        Capabilities::none()
            .with_delivery_count(true)
            .with_redelivery_flag(true)
            .with_nack_redelivers(true)
            .with_max_payload(Some(self.max_payload))
    }

    /// The URL with its password replaced by `***`.
    pub fn redacted_url(&self) -> String {
        redact(&self.url)
    }

    /// Check every field; [`RedisBroker::connect`](crate::RedisBroker::connect) calls it.
    ///
    /// # Errors
    /// [`ErrorKind::Config`](outbox_core::ErrorKind::Config) naming the bad field.
    pub fn validate(&self) -> Result<()> {
        validate_url(&self.url)?;
        let bad = |m: String| Err(Error::config(BACKEND, m));
        if self.consumer_name.is_empty() {
            return bad("consumer_name is empty".into());
        }
        if self.claim_idle < Duration::from_millis(1) {
            return bad(format!("claim_idle is {:?}; it must be at least 1ms", self.claim_idle));
        }
        if self.block < Duration::from_millis(1) {
            return bad(format!("block is {:?}; it must be at least 1ms", self.block));
        }
        if self.read_count == 0 {
            return bad("read_count is 0; it must be at least 1".into());
        }
        if self.max_len == Some(0) {
            return bad("max_len is 0: a stream that may keep no entry would have to delete entries its groups \
                 have not acknowledged yet; use at least 1, or None to never trim"
                .into());
        }
        if let Some(w) = self.dedupe_window
            && w < Duration::from_millis(1)
        {
            return bad(format!("dedupe_window is {w:?}; it must be at least 1ms (or None for off)"));
        }
        if self.connect_timeout.is_zero() || self.response_timeout.is_zero() {
            return bad("connect_timeout and response_timeout must be positive".into());
        }
        Ok(())
    }
}

impl fmt::Debug for RedisConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisConfig")
            .field("url", &self.redacted_url())
            .field("prefix", &self.prefix)
            .field("consumer_name", &self.consumer_name)
            .field("claim_idle", &self.claim_idle)
            .field("block", &self.block)
            .field("read_count", &self.read_count)
            .field("max_len", &self.max_len)
            .field("dedupe_window", &self.dedupe_window)
            .field("max_payload", &self.max_payload)
            .field("connect_timeout", &self.connect_timeout)
            .field("response_timeout", &self.response_timeout)
            .finish()
    }
}

impl fmt::Display for RedisConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} (prefix {:?}, consumer {:?})", self.redacted_url(), self.prefix, self.consumer_name)
    }
}

/// Check a driver URL (the [`url`](RedisConfig::url) field may have been set by hand).
fn validate_url(raw: &str) -> Result<()> {
    let url = ConnectionUrl::parse(&URL_SPEC, raw)?;
    url.require_host()?;
    if let Some((name, _)) = url.outbox_params().first() {
        return Err(url.error(format!(
            "the url field is the driver's URL and cannot carry {name}; parse the URL with RedisConfig::from_url"
        )));
    }
    // The redis crate has its own rules (db number, protocol query); ask it too.
    redis::Client::open(raw)
        .map_err(|e| url.error(format!("the redis client does not accept it ({})", e.category())))?;
    Ok(())
}

/// `<hostname>-<pid>`, restricted to `[A-Za-z0-9._-]`.
fn default_consumer_name() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .map(|h| h.trim().to_string())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "outbox".to_string());
    let host: String =
        host.chars().map(|c| if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') { c } else { '_' }).collect();
    format!("{host}-{}", std::process::id())
}

#[cfg(test)]
mod tests {
    use super::*;
    use outbox_core::ErrorKind;

    #[test]
    fn parses_user_password_db_and_tls_urls() {
        for url in [
            "redis://127.0.0.1:6379",
            "redis://127.0.0.1:6379/3",
            "redis://:secret@localhost/0",
            "redis://alice:secret@localhost:6380/2",
            "rediss://alice:secret@redis.example.com:6380/1",
        ] {
            let c = RedisConfig::from_url(url).unwrap_or_else(|e| panic!("{url}: {e}"));
            assert_eq!(c.url, url);
            assert_eq!(c.prefix, DEFAULT_PREFIX);
            assert_eq!(c.claim_idle, DEFAULT_CLAIM_IDLE);
            assert_eq!(c.max_len, None);
            assert_eq!(c.dedupe_window, None);
            assert_eq!(c.max_payload, DEFAULT_MAX_PAYLOAD);
            c.validate().unwrap();
        }
    }

    #[test]
    fn outbox_parameters_set_the_fields_and_stay_out_of_the_driver_url() {
        let c = RedisConfig::from_url(
            "redis://alice:p%40ss@h:6380/2?outbox_prefix=app:&outbox_consumer_name=relay-1&outbox_claim_idle_ms=1500\
             &outbox_block_ms=200&outbox_read_count=8&outbox_max_len=1000&outbox_dedupe_window_ms=60000\
             &outbox_max_payload=512&outbox_connect_timeout_ms=700&outbox_response_timeout_ms=900&protocol=resp3",
        )
        .unwrap();
        assert_eq!(c.url, "redis://alice:p%40ss@h:6380/2?protocol=resp3");
        assert_eq!((c.prefix.as_str(), c.consumer_name.as_str()), ("app:", "relay-1"));
        assert_eq!((c.claim_idle, c.block), (Duration::from_millis(1500), Duration::from_millis(200)));
        assert_eq!((c.read_count, c.max_len, c.max_payload), (8, Some(1000), 512));
        assert_eq!(c.dedupe_window, Some(Duration::from_secs(60)));
        assert_eq!((c.connect_timeout, c.response_timeout), (Duration::from_millis(700), Duration::from_millis(900)));
        c.validate().unwrap();
        let shown = format!("{c} {c:?}");
        assert!(!shown.contains("p%40ss") && !shown.contains("p@ss"), "{shown}");
    }

    #[test]
    fn unknown_or_invalid_outbox_parameters_are_errors() {
        for (url, needle) in [
            ("redis://:hunter2@h?outbox_prefx=a", "outbox_prefix"),
            ("redis://:hunter2@h?outbox_read_count=0", "read_count"),
            ("redis://:hunter2@h?outbox_read_count=x", "outbox_read_count=\"x\""),
            ("redis://:hunter2@h?outbox_max_len=0", "max_len"),
            ("redis://:hunter2@h?outbox_claim_idle_ms=1s", "outbox_claim_idle_ms=\"1s\""),
        ] {
            let err = RedisConfig::from_url(url).unwrap_err();
            assert_eq!(err.kind(), ErrorKind::Config, "{url}");
            let text = format!("{err} {err:?}");
            assert!(text.contains(needle), "{text}");
            assert!(!text.contains("hunter2"), "{text}");
        }
        // The url field is the driver's: outbox parameters set by hand there are refused.
        let mut c = RedisConfig::from_url("redis://:hunter2@h").unwrap();
        c.url = "redis://:hunter2@h?outbox_prefix=x".into();
        let err = c.validate().unwrap_err();
        assert!(err.to_string().contains("outbox_prefix") && !err.to_string().contains("hunter2"), "{err}");
    }

    #[test]
    fn rejects_bad_urls_without_leaking_the_password() {
        for url in [
            "http://u:hunter2@host/",
            "not a url",
            "redis://u:hunter2@host/notadb",
            "unix:///tmp/sock",
            "redis://u:hunter2@",
            "redis://u:hunter2%@host",
            "redis://u:hunter2@h1,h2",
        ] {
            let err = RedisConfig::from_url(url).unwrap_err();
            assert_eq!(err.kind(), ErrorKind::Config, "{url}");
            assert!(!err.to_string().contains("hunter2"), "{err}");
        }
    }

    #[test]
    fn debug_and_display_hide_the_password() {
        let c = RedisConfig::from_url("redis://alice:hunter2@localhost:6379/1").unwrap();
        let debug = format!("{c:?}");
        let display = c.to_string();
        for text in [&debug, &display] {
            assert!(!text.contains("hunter2"), "{text}");
            assert!(text.contains("alice:***@localhost:6379/1"), "{text}");
        }
        // A password-only URL too.
        let c = RedisConfig::from_url("redis://:hunter2@localhost").unwrap();
        assert!(!format!("{c:?} {c}").contains("hunter2"));
        // A URL set by hand that does not parse is hidden whole.
        let mut c = c;
        c.url = "redis://alice:hunter2@[bad".into();
        assert!(!format!("{c:?} {c}").contains("hunter2"));
    }

    #[test]
    fn unsafe_or_meaningless_settings_are_config_errors() {
        let base = RedisConfig::from_url("redis://127.0.0.1:6379").unwrap();
        let cases = [
            base.clone().with_max_len(0),
            base.clone().with_read_count(0),
            base.clone().with_claim_idle(Duration::ZERO),
            base.clone().with_dedupe_window(Duration::ZERO),
            base.clone().with_consumer_name(""),
        ];
        for c in cases {
            assert_eq!(c.validate().unwrap_err().kind(), ErrorKind::Config, "{c:?}");
        }
        base.with_max_len(1).with_dedupe_window(Duration::from_secs(1)).validate().unwrap();
    }

    #[test]
    fn default_consumer_name_is_stable_and_plain() {
        let a = default_consumer_name();
        assert_eq!(a, default_consumer_name());
        assert!(a.ends_with(&format!("-{}", std::process::id())));
        assert!(a.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')), "{a}");
    }
}
