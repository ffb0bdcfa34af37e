//! Settings, parsed once from a URL, a bootstrap list or the environment.
//!
//! Credentials travel inside the librdkafka option map (`sasl.password`, ...), so `Debug` and
//! `Display` redact by option name rather than by field: a secret added through
//! [`KafkaConfig::option`] is hidden the same way as one given in the URL.

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use outbox_core::config::{ConnectionUrl, REDACTED, UrlSpec, env_var, is_secret_param};
use outbox_core::{Capabilities, Error, Result};

use crate::BACKEND;

/// Environment variable holding a full `kafka://` URL (takes precedence).
pub const ENV_URL: &str = "OUTBOX_KAFKA_URL";
/// Environment variable holding a comma-separated bootstrap list (`host:port,host:port`).
pub const ENV_BOOTSTRAP: &str = "OUTBOX_KAFKA_BOOTSTRAP";

/// The URLs [`KafkaConfig::from_url`] accepts.
const URL_SPEC: UrlSpec = UrlSpec::new(BACKEND, &["kafka", "kafka+ssl"]).multi_host();

/// What else a Kafka URL's query may hold, for the unknown-parameter error.
const DRIVER_PARAMS: &str = "or a librdkafka property, any name with a dot, such as linger.ms";

/// Connection and behaviour settings of a [`KafkaBroker`](crate::KafkaBroker).
///
/// Build it with [`KafkaConfig::new`] and the `with_*` methods, from a URL with
/// [`KafkaConfig::from_url`] (or `str::parse`), or from the environment with
/// [`KafkaConfig::from_env`].
///
/// ```
/// use outbox_broker_kafka::KafkaConfig;
///
/// let config: KafkaConfig =
///     "kafka://app:s3cret@k1:9092,k2:9092?outbox_partitions=6&linger.ms=5".parse().unwrap();
/// assert_eq!(config.bootstrap_servers, ["k1:9092", "k2:9092"]);
/// assert_eq!(config.partitions, 6);
/// assert_eq!(config.options["linger.ms"], "5");
/// assert!(!config.to_string().contains("s3cret"));
/// assert!(!format!("{config:?}").contains("s3cret"));
/// ```
#[derive(Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct KafkaConfig {
    /// `host:port` of the brokers to bootstrap from (`bootstrap.servers`).
    pub bootstrap_servers: Vec<String>,
    /// `client.id` sent to the brokers (default `outbox`).
    pub client_id: String,
    /// Partitions of a topic created by [`declare`](outbox_core::Broker::declare) (default 1).
    pub partitions: i32,
    /// Replication factor of a topic created by `declare` (default 1).
    pub replication_factor: i32,
    /// How long librdkafka may try to deliver one message before the publish fails with an
    /// outcome-unknown timeout (`delivery.timeout.ms`, default 30 s). Keep it below the relay's
    /// lease.
    pub delivery_timeout: Duration,
    /// Consumer group session timeout (`session.timeout.ms`, default 10 s): how long a member
    /// that stopped heartbeating keeps its partitions before the group takes them back.
    pub session_timeout: Duration,
    /// Bound on admin requests, metadata look-ups, offset commits and the reachability check of
    /// [`KafkaBroker::connect`](crate::KafkaBroker::connect) (default 10 s).
    pub operation_timeout: Duration,
    /// Further librdkafka properties, applied to every client (producer, consumer, admin);
    /// librdkafka ignores, with a warning, a property meant for another kind of client. They
    /// override the settings above, except the ones the delivery guarantees depend on
    /// (`enable.idempotence`, `acks`, `enable.auto.commit`, `enable.auto.offset.store`), which
    /// are rejected here.
    pub options: BTreeMap<String, String>,
}

/// librdkafka properties the adapter's guarantees depend on; they cannot be overridden.
const FIXED_OPTIONS: &[&str] = &[
    "enable.idempotence",
    "acks",
    "request.required.acks",
    "enable.auto.commit",
    "enable.auto.offset.store",
    "auto.offset.reset",
    "group.id",
    "bootstrap.servers",
];

impl KafkaConfig {
    /// Settings for the given bootstrap servers, everything else at its default.
    pub fn new<S: Into<String>>(bootstrap_servers: impl IntoIterator<Item = S>) -> Self {
        Self {
            bootstrap_servers: bootstrap_servers.into_iter().map(Into::into).collect(),
            client_id: "outbox".to_string(),
            partitions: 1,
            replication_factor: 1,
            delivery_timeout: Duration::from_secs(30),
            session_timeout: Duration::from_secs(10),
            operation_timeout: Duration::from_secs(10),
            options: BTreeMap::new(),
        }
    }

    /// Parse a comma-separated bootstrap list (`host:port,host:port`).
    ///
    /// # Errors
    /// [`ErrorKind::Config`](outbox_core::ErrorKind::Config) for an empty list or an entry
    /// without a port.
    pub fn from_bootstrap(list: &str) -> Result<Self> {
        Ok(Self::new(parse_hosts(list)?))
    }

    /// Parse `kafka://[user:password@]host:port[,host:port...][?key=value&...]`.
    ///
    /// The scheme `kafka+ssl` selects TLS (`security.protocol=SSL`, or `SASL_SSL` with
    /// credentials). Credentials set `sasl.username` / `sasl.password` (percent-decoded), with
    /// `sasl.mechanism=PLAIN` and `security.protocol=SASL_PLAINTEXT` unless the query says
    /// otherwise. Query keys: `outbox_partitions`, `outbox_replication_factor`,
    /// `outbox_client_id`, `outbox_delivery_timeout_ms`, `outbox_session_timeout_ms`,
    /// `outbox_operation_timeout_ms`; any key containing a dot is a librdkafka property (e.g.
    /// `linger.ms=5`).
    ///
    /// # Errors
    /// [`ErrorKind::Config`](outbox_core::ErrorKind::Config) for another scheme, no host, a host
    /// without a port, a path, a bad number, an unknown key, or a property that cannot be
    /// overridden. The message shows the URL with the password redacted.
    pub fn from_url(url: &str) -> Result<Self> {
        let mut url = ConnectionUrl::parse(&URL_SPEC, url)?;
        if !matches!(url.raw_path(), "" | "/") {
            return Err(url.error("a kafka URL has no path"));
        }
        if url.hosts().is_empty() {
            return Err(url.error("it names no bootstrap server"));
        }
        let mut hosts = Vec::new();
        for host in url.hosts() {
            if host.port().is_none_or(|p| p == 0) {
                return Err(url.error(format!("bootstrap server {host} needs a port (host:port)")));
            }
            hosts.push(host.to_string());
        }
        let mut config = Self::new(hosts);
        if let Some(user) = url.user() {
            config.options.insert("sasl.username".into(), user.to_string());
            config.options.insert("sasl.password".into(), url.password().unwrap_or_default().to_string());
            config.options.insert("sasl.mechanism".into(), "PLAIN".into());
        }
        let protocol = match (url.scheme() == "kafka+ssl", url.user().is_some()) {
            (false, false) => None,
            (false, true) => Some("SASL_PLAINTEXT"),
            (true, false) => Some("SSL"),
            (true, true) => Some("SASL_SSL"),
        };
        if let Some(protocol) = protocol {
            config.options.insert("security.protocol".into(), protocol.into());
        }
        if let Some(partitions) = url.outbox_number("outbox_partitions")? {
            config.partitions = partitions;
        }
        if let Some(factor) = url.outbox_number("outbox_replication_factor")? {
            config.replication_factor = factor;
        }
        if let Some(client_id) = url.outbox_str("outbox_client_id") {
            config.client_id = client_id;
        }
        if let Some(timeout) = url.outbox_duration_ms("outbox_delivery_timeout_ms")? {
            config.delivery_timeout = timeout;
        }
        if let Some(timeout) = url.outbox_duration_ms("outbox_session_timeout_ms")? {
            config.session_timeout = timeout;
        }
        if let Some(timeout) = url.outbox_duration_ms("outbox_operation_timeout_ms")? {
            config.operation_timeout = timeout;
        }
        url.finish()?;
        for (key, value) in url.params() {
            if !key.contains('.') {
                return Err(url.unknown_param_error(key, DRIVER_PARAMS));
            }
            config.options.insert(key.clone(), value.clone());
        }
        config.validate()?;
        Ok(config)
    }

    /// Settings from the environment: [`ENV_URL`] (`OUTBOX_KAFKA_URL`) if set, else
    /// [`ENV_BOOTSTRAP`] (`OUTBOX_KAFKA_BOOTSTRAP`). There is no default server.
    ///
    /// # Errors
    /// [`ErrorKind::Config`](outbox_core::ErrorKind::Config) when neither variable is set (or
    /// both are blank), when one is not valid Unicode, and as for [`from_url`](Self::from_url)
    /// and [`from_bootstrap`](Self::from_bootstrap).
    pub fn from_env() -> Result<Self> {
        if let Some(url) = env_var(ENV_URL, BACKEND)? {
            return Self::from_url(&url);
        }
        if let Some(list) = env_var(ENV_BOOTSTRAP, BACKEND)? {
            return Self::from_bootstrap(&list);
        }
        Err(config_error(format!(
            "neither {ENV_URL} nor {ENV_BOOTSTRAP} is set: {ENV_URL} must hold the kafka connection URL \
             (kafka://host:port,...), or {ENV_BOOTSTRAP} a host:port list (there is no default server)"
        )))
    }

    /// Set the client id.
    #[must_use]
    pub fn with_client_id(mut self, client_id: impl Into<String>) -> Self {
        self.client_id = client_id.into();
        self
    }

    /// Set the partition count of declared topics.
    #[must_use]
    pub fn with_partitions(mut self, partitions: i32) -> Self {
        self.partitions = partitions;
        self
    }

    /// Set the replication factor of declared topics.
    #[must_use]
    pub fn with_replication_factor(mut self, replication_factor: i32) -> Self {
        self.replication_factor = replication_factor;
        self
    }

    /// Set the delivery timeout.
    #[must_use]
    pub fn with_delivery_timeout(mut self, timeout: Duration) -> Self {
        self.delivery_timeout = timeout;
        self
    }

    /// Set the consumer session timeout.
    #[must_use]
    pub fn with_session_timeout(mut self, timeout: Duration) -> Self {
        self.session_timeout = timeout;
        self
    }

    /// Set the bound on admin, metadata and commit requests.
    #[must_use]
    pub fn with_operation_timeout(mut self, timeout: Duration) -> Self {
        self.operation_timeout = timeout;
        self
    }

    /// Set one librdkafka property (see [`options`](Self::options)).
    #[must_use]
    pub fn option(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.options.insert(key.into(), value.into());
        self
    }

    /// What a [`KafkaBroker`](crate::KafkaBroker) built from these settings reports from
    /// [`Broker::capabilities`](outbox_core::Broker::capabilities).
    pub fn capabilities(&self) -> Capabilities {
        // Unroutable: topics are not auto-created, an unknown topic fails the publish. No
        // delivery count, and a record re-read by a new member after a rebalance is that
        // member's first delivery of it, so no reliable redelivered flag. The event key is the
        // record key: one partition, one member, publish order. The size limit is librdkafka's
        // and the broker's (`message.max.bytes`), not the adapter's.
        Capabilities::none().with_detects_unroutable(true).with_nack_redelivers(true).with_per_key_ordering(true)
    }

    /// Check the values a client would reject later, so that a bad setting fails at
    /// construction with a clear message.
    ///
    /// # Errors
    /// [`ErrorKind::Config`](outbox_core::ErrorKind::Config).
    pub fn validate(&self) -> Result<()> {
        if self.bootstrap_servers.is_empty() {
            return Err(config_error("no bootstrap servers".to_string()));
        }
        if self.partitions < 1 {
            return Err(config_error(format!("partitions must be at least 1, not {}", self.partitions)));
        }
        if self.replication_factor < 1 {
            return Err(config_error(format!(
                "replication_factor must be at least 1, not {}",
                self.replication_factor
            )));
        }
        for (what, d) in [
            ("delivery_timeout", self.delivery_timeout),
            ("session_timeout", self.session_timeout),
            ("operation_timeout", self.operation_timeout),
        ] {
            if d < Duration::from_millis(1) || d.as_millis() > i32::MAX as u128 {
                return Err(config_error(format!("{what} must be between 1 ms and {} ms", i32::MAX)));
            }
        }
        if let Some(key) = self.options.keys().find(|k| FIXED_OPTIONS.contains(&k.as_str())) {
            return Err(config_error(format!(
                "librdkafka property {key:?} is set by the adapter and cannot be overridden"
            )));
        }
        Ok(())
    }

    /// A librdkafka configuration: bootstrap and client id, then the adapter's `defaults` for
    /// this kind of client, then the user's options, then the `fixed` properties the guarantees
    /// depend on.
    pub(crate) fn client_config(&self, defaults: &[(&str, String)], fixed: &[(&str, &str)]) -> rdkafka::ClientConfig {
        let mut c = rdkafka::ClientConfig::new();
        c.set("bootstrap.servers", self.bootstrap_servers.join(","));
        c.set("client.id", &self.client_id);
        c.set("socket.timeout.ms", millis(self.operation_timeout).to_string());
        for (k, v) in defaults {
            c.set(*k, v);
        }
        for (k, v) in &self.options {
            c.set(k, v);
        }
        for (k, v) in fixed {
            c.set(*k, *v);
        }
        c
    }

    pub(crate) fn delivery_timeout_ms(&self) -> String {
        millis(self.delivery_timeout).to_string()
    }

    /// How long a producer waits for a topic it does not see to appear before failing its
    /// messages as unknown-topic: well inside the delivery timeout, so that a missing topic is
    /// reported as unroutable rather than as a timed-out (outcome unknown) delivery.
    pub(crate) fn topic_propagation_ms(&self) -> String {
        (millis(self.delivery_timeout) / 2).min(5000).to_string()
    }

    pub(crate) fn session_timeout_ms(&self) -> String {
        millis(self.session_timeout).to_string()
    }

    pub(crate) fn heartbeat_interval_ms(&self) -> String {
        (millis(self.session_timeout) / 3).clamp(1, 3000).to_string()
    }
}

fn millis(d: Duration) -> u128 {
    d.as_millis().max(1)
}

/// Whether the value of a librdkafka property must not be shown: every `sasl.*` property
/// besides the names that mark a secret on any backend.
pub(crate) fn is_secret(key: &str) -> bool {
    is_secret_param(key) || key.to_ascii_lowercase().contains("sasl")
}

fn redacted_options(options: &BTreeMap<String, String>) -> BTreeMap<&str, &str> {
    options.iter().map(|(k, v)| (k.as_str(), if is_secret(k) { REDACTED } else { v.as_str() })).collect()
}

impl fmt::Debug for KafkaConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KafkaConfig")
            .field("bootstrap_servers", &self.bootstrap_servers)
            .field("client_id", &self.client_id)
            .field("partitions", &self.partitions)
            .field("replication_factor", &self.replication_factor)
            .field("delivery_timeout", &self.delivery_timeout)
            .field("session_timeout", &self.session_timeout)
            .field("operation_timeout", &self.operation_timeout)
            .field("options", &redacted_options(&self.options))
            .finish()
    }
}

/// The URL form, secrets replaced by `***`.
impl fmt::Display for KafkaConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "kafka://{}", self.bootstrap_servers.join(","))?;
        let mut query = url::form_urlencoded::Serializer::new(String::new());
        query
            .append_pair("outbox_client_id", &self.client_id)
            .append_pair("outbox_partitions", &self.partitions.to_string())
            .append_pair("outbox_replication_factor", &self.replication_factor.to_string())
            .append_pair("outbox_delivery_timeout_ms", &self.delivery_timeout.as_millis().to_string())
            .append_pair("outbox_session_timeout_ms", &self.session_timeout.as_millis().to_string())
            .append_pair("outbox_operation_timeout_ms", &self.operation_timeout.as_millis().to_string());
        for (k, v) in redacted_options(&self.options) {
            query.append_pair(k, v);
        }
        write!(f, "?{}", query.finish())
    }
}

impl std::str::FromStr for KafkaConfig {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        Self::from_url(s)
    }
}

fn config_error(message: String) -> Error {
    Error::config(BACKEND, message)
}

fn parse_hosts(list: &str) -> Result<Vec<String>> {
    let hosts: Vec<String> = list.split(',').map(str::trim).filter(|h| !h.is_empty()).map(String::from).collect();
    if hosts.is_empty() {
        return Err(config_error("no bootstrap servers given".to_string()));
    }
    for h in &hosts {
        let port = h.rsplit_once(':').map(|(_, p)| p);
        if !port.is_some_and(|p| p.parse::<u16>().is_ok_and(|p| p > 0)) {
            return Err(config_error(format!("bootstrap server {h:?} needs a port (host:port)")));
        }
    }
    Ok(hosts)
}

#[cfg(test)]
mod tests {
    use super::*;
    use outbox_core::ErrorKind;

    #[test]
    fn parses_url_with_hosts_query_and_credentials() {
        let c = KafkaConfig::from_url(
            "kafka://me:p%40ss@a:9092,b:9093/?outbox_partitions=3&outbox_replication_factor=2\
             &outbox_client_id=relay-1&outbox_delivery_timeout_ms=1500&outbox_session_timeout_ms=6000\
             &outbox_operation_timeout_ms=700&linger.ms=5&sasl.mechanism=SCRAM-SHA-256",
        )
        .unwrap();
        assert_eq!(c.bootstrap_servers, ["a:9092", "b:9093"]);
        assert_eq!((c.partitions, c.replication_factor), (3, 2));
        assert_eq!(c.client_id, "relay-1");
        assert_eq!(c.delivery_timeout, Duration::from_millis(1500));
        assert_eq!(c.session_timeout, Duration::from_secs(6));
        assert_eq!(c.operation_timeout, Duration::from_millis(700));
        assert_eq!(c.options["linger.ms"], "5");
        assert_eq!(c.options["sasl.username"], "me");
        assert_eq!(c.options["sasl.password"], "p@ss");
        assert_eq!(c.options["security.protocol"], "SASL_PLAINTEXT");
        // The query overrides what the credentials imply.
        assert_eq!(c.options["sasl.mechanism"], "SCRAM-SHA-256");
    }

    #[test]
    fn percent_decoded_credentials_and_ipv6_hosts() {
        let c = KafkaConfig::from_url("kafka+ssl://app%40corp:p%40ss%3Aw%25rd@[::1]:9093,k2:9094").unwrap();
        assert_eq!(c.bootstrap_servers, ["[::1]:9093", "k2:9094"]);
        assert_eq!(c.options["sasl.username"], "app@corp");
        assert_eq!(c.options["sasl.password"], "p@ss:w%rd");
        assert_eq!(c.options["security.protocol"], "SASL_SSL");
        for shown in [format!("{c:?}"), c.to_string()] {
            assert!(!shown.contains("p@ss") && !shown.contains("p%40ss") && !shown.contains("w%rd"), "{shown}");
        }
    }

    #[test]
    fn defaults() {
        let c = KafkaConfig::from_url("kafka://127.0.0.1:9092").unwrap();
        assert_eq!(c, KafkaConfig::new(["127.0.0.1:9092"]));
        assert_eq!(c.partitions, 1);
        assert_eq!(c.replication_factor, 1);
        assert!(c.options.is_empty());
        let tls = KafkaConfig::from_url("kafka+ssl://h:9093").unwrap();
        assert_eq!(tls.options["security.protocol"], "SSL");
    }

    #[test]
    fn rejects_bad_settings() {
        for bad in [
            "http://h:1",
            "kafka://",
            "kafka://h",
            "kafka://h:1/path",
            "kafka://h:0",
            "kafka://h:1,,g:2",
            "kafka://h:1?outbox_partitions=0",
            "kafka://h:1?outbox_partitions=x",
            "kafka://h:1?outbox_partitions=2147483648",
            "kafka://h:1?nope=1",
            "kafka://h:1?partitions=3",
            "kafka://h:1?outbox_partitons=3",
            "kafka://h:1?enable.idempotence=false",
            "kafka://h:1?enable.auto.commit=true",
            "kafka://h:1?outbox_delivery_timeout_ms=0",
            "kafka://u:p%zz@h:1",
        ] {
            let e = KafkaConfig::from_url(bad).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Config, "{bad}: {e}");
            assert!(e.is_permanent());
        }
        let e = KafkaConfig::from_url("kafka://u:hunter2@h:1?partitions=3").unwrap_err();
        let text = e.to_string();
        assert!(text.contains("\"partitions\"") && text.contains("outbox_partitions"), "{text}");
        assert!(text.contains("librdkafka property"), "{text}");
        assert!(!text.contains("hunter2"), "{text}");
    }

    #[test]
    fn bootstrap_list() {
        let c = KafkaConfig::from_bootstrap(" a:1 , b:2 ").unwrap();
        assert_eq!(c.bootstrap_servers, ["a:1", "b:2"]);
        assert!(KafkaConfig::from_bootstrap("").is_err());
        assert!(KafkaConfig::from_bootstrap("a").is_err());
    }

    #[test]
    fn debug_and_display_hide_secrets() {
        let c = KafkaConfig::from_url("kafka://user:hunter2@h:9092?ssl.key.password=kp-secret-1&linger.ms=7")
            .unwrap()
            .option("sasl.oauthbearer.client.secret", "oauth-secret-2")
            .option("my.api.token", "tok-3");
        for shown in [format!("{c:?}"), c.to_string(), format!("{c:#?}")] {
            for secret in ["hunter2", "kp-secret-1", "oauth-secret-2", "tok-3"] {
                assert!(!shown.contains(secret), "{secret} leaked in {shown}");
            }
            assert!(shown.contains("linger.ms"), "{shown}");
            assert!(shown.contains("***"), "{shown}");
        }
        for bad in
            ["ftp://user:hunter2@h:1", "kafka://user:hunter2@h", "user:hunter2@h:1", "kafka://user:hunter2@h:1/x"]
        {
            let e = KafkaConfig::from_url(bad).unwrap_err();
            assert!(!format!("{e} {e:?}").contains("hunter2"), "{e}");
        }
        let e = KafkaConfig::from_url("kafka://h:1?sasl.password=hunter2&enable.idempotence=false").unwrap_err();
        assert!(!format!("{e} {e:?}").contains("hunter2"), "{e}");
    }

    #[test]
    fn display_round_trips_without_secrets() {
        let c = KafkaConfig::new(["h:1", "g:2"]).with_partitions(4).option("linger.ms", "3");
        let back = KafkaConfig::from_url(&c.to_string()).unwrap();
        assert_eq!(back, c);
    }
}
