//! Where the server is and how destinations and groups map onto exchanges and queues.
//!
//! One value, parsed from one URL, so that a command-line program can choose the broker from a
//! string and a test can isolate itself with a prefix. The password lives only inside it and is
//! never printed.

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use lapin::uri::{AMQPAuthority, AMQPQueryString, AMQPScheme, AMQPUri, AMQPUserInfo};
use outbox_core::config::{ConnectionUrl, UrlSpec, env_url};
use outbox_core::event::DEFAULT_MAX_PAYLOAD;
use outbox_core::{Capabilities, ConsumerGroup, Destination, Error, ErrorKind, Event, Result};

use crate::error::BACKEND;

/// Environment variable read by [`AmqpConfig::from_env`].
pub const ENV_URL: &str = "OUTBOX_AMQP_URL";

/// The URLs [`AmqpConfig::from_url`] accepts.
const URL_SPEC: UrlSpec = UrlSpec::new(BACKEND, &["amqp", "amqps"]);

/// The AMQP handshake parameters the URL may carry besides the `outbox_*` ones.
const DRIVER_PARAMS: &str = "or the AMQP handshake parameters heartbeat, frame_max, channel_max, auth_mechanism";

/// Default [`AmqpConfig::prefetch`].
pub const DEFAULT_PREFETCH: u16 = 32;

/// Default [`AmqpConfig::confirm_timeout`].
pub const DEFAULT_CONFIRM_TIMEOUT: Duration = Duration::from_secs(10);

/// Default [`AmqpConfig::connect_timeout`].
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// Batches a relay keeps at RabbitMQ at once unless its config sets a depth
/// ([`Broker::preferred_pipeline_depth`](outbox_core::Broker::preferred_pipeline_depth)).
/// RabbitMQ confirms persistent messages after a disk sync, in groups, so a relay is bound by
/// how many messages wait for confirms: one relay (PostgreSQL, batch 100, 1,000 keys, 2 cores)
/// published 8.7k–8.9k events/s at depth 2, 9.3k–9.5k at 4, 10.0k–10.7k at 8 and 9.1k–9.8k at
/// 16 and 32, where its claims became the limit (`outbox bench --only P2 --seed 7
/// --pipeline-depth D`, two runs each, 2026-12-07; raw publish 12.9k–14.0k in the same runs).
pub const PREFERRED_PIPELINE_DEPTH: usize = 8;

/// Default [`AmqpConfig::publish_channels`].
pub const DEFAULT_PUBLISH_CHANNELS: usize = 16;

/// Longest exchange, queue or routing-key name AMQP 0-9-1 can carry (a `shortstr`).
pub const MAX_NAME_LEN: usize = 255;

/// Between destination and group in a queue name: a character no destination or group name
/// has, so that the name identifies the pair ([`AmqpConfig::queue_name`]).
pub(crate) const QUEUE_NAME_SEPARATOR: char = ':';

/// The type of the queue declared for each consumer group.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum QueueType {
    /// A classic queue. RabbitMQ does not count deliveries, so
    /// [`Delivery::attempt`](outbox_core::Delivery::attempt) is `None`; only the `redelivered`
    /// flag says a message came back.
    #[default]
    Classic,
    /// A quorum queue (`x-queue-type: quorum`): replicated, and it counts deliveries, which
    /// surface as [`Delivery::attempt`](outbox_core::Delivery::attempt).
    Quorum,
}

impl QueueType {
    /// The URL form and the `x-queue-type` value (`classic`, `quorum`).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Classic => "classic",
            Self::Quorum => "quorum",
        }
    }
}

impl FromStr for QueueType {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "classic" => Ok(Self::Classic),
            "quorum" => Ok(Self::Quorum),
            _ => Err(Error::config(BACKEND, format!("expected `classic` or `quorum` for queue_type, not {s:?}"))),
        }
    }
}

impl fmt::Display for QueueType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What a message's routing key is.
///
/// Each group's queue is bound with `#` and so receives everything either way; the routing key
/// matters only to bindings someone adds by hand (a topic pattern on a key, say).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum RoutingKey {
    /// The destination name: always a valid routing key (at most 200 bytes).
    #[default]
    Destination,
    /// The event key, or the destination name for an event without one. A key longer than
    /// [`MAX_NAME_LEN`] bytes cannot be a routing key and is rejected as invalid input.
    EventKey,
}

impl RoutingKey {
    /// The URL form (`destination`, `key`).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Destination => "destination",
            Self::EventKey => "key",
        }
    }
}

impl FromStr for RoutingKey {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "destination" => Ok(Self::Destination),
            "key" | "event_key" => Ok(Self::EventKey),
            _ => Err(Error::config(BACKEND, format!("expected `destination` or `key` for routing_key, not {s:?}"))),
        }
    }
}

impl fmt::Display for RoutingKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Settings of an [`AmqpBroker`](crate::AmqpBroker).
///
/// Built from a URL ([`from_url`](Self::from_url), [`from_env`](Self::from_env)) and adjusted with
/// the `with_*` methods. The URL is `amqp://` or `amqps://`, `user:password@host:port/vhost` as
/// RabbitMQ defines it (the vhost percent-encoded: `/%2f` is the default vhost `/`; no path at all
/// also means `/`), followed by optional query parameters:
///
/// | parameter | meaning | default |
/// |---|---|---|
/// | `outbox_exchange_prefix` | prepended to the destination to name its exchange | empty |
/// | `outbox_queue_prefix` | prepended to `<destination>:<group>` to name a group's queue | empty |
/// | `outbox_queue_type` | `classic` or `quorum` | `classic` |
/// | `outbox_routing_key` | `destination` or `key` (see [`RoutingKey`]) | `destination` |
/// | `outbox_prefetch` | unacknowledged deliveries per subscription | 32 |
/// | `outbox_confirm_timeout_ms` | wait for a publisher confirm | 10000 |
/// | `outbox_connect_timeout_ms` | wait for a connection | 10000 |
/// | `outbox_publish_channels` | publishes in flight at once | 16 |
/// | `outbox_batch_channels` | channels one batch publishes on at most | 1 |
/// | `outbox_declare_topology` | declare exchanges and queues (`true`/`false`) | `true` |
/// | `outbox_max_payload` | largest payload accepted, in bytes | 1048576 |
/// | `outbox_connection_name` | name shown in the management UI | `outbox` |
/// | `heartbeat`, `frame_max`, `channel_max`, `auth_mechanism` | passed to the AMQP handshake | server's |
///
/// User name, password and vhost are percent-decoded (`p%40ss` is `p@ss`). An unknown
/// parameter is a configuration error that lists the known ones, so a typo cannot silently fall
/// back to a default.
///
/// `Debug` and `Display` show the URL with the password replaced by `***`.
#[derive(Clone)]
pub struct AmqpConfig {
    /// The URL as given, password redacted.
    redacted_url: String,
    uri: AMQPUri,
    exchange_prefix: String,
    exchanges: BTreeMap<Destination, String>,
    queue_prefix: String,
    queue_type: QueueType,
    routing_key: RoutingKey,
    prefetch: u16,
    confirm_timeout: Duration,
    connect_timeout: Duration,
    publish_channels: usize,
    batch_channels: usize,
    declare_topology: bool,
    max_payload: usize,
    connection_name: String,
}

impl AmqpConfig {
    /// Parse a URL (see the type's documentation for the form and the parameters).
    ///
    /// # Errors
    /// [`ErrorKind::Config`] (permanent) for a malformed URL, a scheme other than `amqp` or
    /// `amqps`, or an unknown or invalid parameter. The message never contains the password.
    pub fn from_url(url: &str) -> Result<Self> {
        let mut url = ConnectionUrl::parse(&URL_SPEC, url)?;
        let scheme = if url.scheme() == "amqps" { AMQPScheme::AMQPS } else { AMQPScheme::AMQP };
        let host = url.require_host()?;
        let (host, port) = (host.host().to_string(), host.port_or(scheme.default_port()));
        let default_user = AMQPUserInfo::default();
        let username = match url.user() {
            None | Some("") => default_user.username,
            Some(u) => u.to_string(),
        };
        let password = url.password().map_or(default_user.password, str::to_string);
        // RabbitMQ's URI spec: no path is the default vhost "/", "/" alone is the vhost "".
        let vhost = match url.path() {
            "" => "/".to_string(),
            p => p.strip_prefix('/').unwrap_or(p).to_string(),
        };

        let mut config = Self {
            uri: AMQPUri {
                scheme,
                authority: AMQPAuthority { userinfo: AMQPUserInfo { username, password }, host, port },
                vhost,
                query: AMQPQueryString::default(),
            },
            redacted_url: url.redacted().to_string(),
            exchange_prefix: String::new(),
            exchanges: BTreeMap::new(),
            queue_prefix: String::new(),
            queue_type: QueueType::default(),
            routing_key: RoutingKey::default(),
            prefetch: DEFAULT_PREFETCH,
            confirm_timeout: DEFAULT_CONFIRM_TIMEOUT,
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            publish_channels: DEFAULT_PUBLISH_CHANNELS,
            batch_channels: 1,
            declare_topology: true,
            max_payload: DEFAULT_MAX_PAYLOAD,
            connection_name: "outbox".to_string(),
        };
        if let Some(prefix) = url.outbox_str("outbox_exchange_prefix") {
            config = config.with_exchange_prefix(prefix)?;
        }
        if let Some(prefix) = url.outbox_str("outbox_queue_prefix") {
            config = config.with_queue_prefix(prefix)?;
        }
        if let Some(queue_type) = url.outbox_parse("outbox_queue_type")? {
            config.queue_type = queue_type;
        }
        if let Some(routing_key) = url.outbox_parse("outbox_routing_key")? {
            config.routing_key = routing_key;
        }
        if let Some(prefetch) = url.outbox_number("outbox_prefetch")? {
            config = config.with_prefetch(prefetch)?;
        }
        if let Some(timeout) = url.outbox_duration_ms("outbox_confirm_timeout_ms")? {
            config = config.with_confirm_timeout(timeout)?;
        }
        if let Some(timeout) = url.outbox_duration_ms("outbox_connect_timeout_ms")? {
            config = config.with_connect_timeout(timeout)?;
        }
        if let Some(channels) = url.outbox_usize("outbox_publish_channels")? {
            config = config.with_publish_channels(channels)?;
        }
        if let Some(channels) = url.outbox_usize("outbox_batch_channels")? {
            config = config.with_batch_channels(channels)?;
        }
        if let Some(declare) = url.outbox_bool("outbox_declare_topology")? {
            config.declare_topology = declare;
        }
        if let Some(bytes) = url.outbox_usize("outbox_max_payload")? {
            config.max_payload = bytes;
        }
        if let Some(name) = url.outbox_str("outbox_connection_name") {
            config.connection_name = name;
        }
        url.finish()?;
        for (name, value) in url.params() {
            let query = &mut config.uri.query;
            match name.as_str() {
                "heartbeat" => query.heartbeat = Some(driver_number(&url, name, value)?),
                "frame_max" => query.frame_max = Some(driver_number(&url, name, value)?),
                "channel_max" => query.channel_max = Some(driver_number(&url, name, value)?),
                "auth_mechanism" => {
                    query.auth_mechanism = Some(value.parse().map_err(|e: String| url.param_error(name, value, e))?);
                }
                _ => return Err(url.unknown_param_error(name, DRIVER_PARAMS)),
            }
        }
        Ok(config)
    }

    /// Parse the URL in the environment variable [`ENV_URL`] (`OUTBOX_AMQP_URL`). There is no
    /// default server.
    ///
    /// # Errors
    /// [`ErrorKind::Config`] when the variable is unset, blank or not valid Unicode, or as
    /// [`from_url`](Self::from_url).
    pub fn from_env() -> Result<Self> {
        Self::from_url(&env_url(ENV_URL, BACKEND)?)
    }

    /// Prefix of every exchange name: the exchange of destination `d` is `<prefix><d>` unless
    /// [`with_exchange`](Self::with_exchange) maps `d` explicitly.
    ///
    /// # Errors
    /// [`ErrorKind::Config`] unless the prefix is at most 50 bytes of `[A-Za-z0-9._:-]`.
    pub fn with_exchange_prefix(mut self, prefix: impl Into<String>) -> Result<Self> {
        self.exchange_prefix = prefix_name("exchange_prefix", prefix.into())?;
        Ok(self)
    }

    /// Publish `destination` to the exchange `exchange` (an existing one such as `amq.topic`,
    /// typically with [`with_declare_topology(false)`](Self::with_declare_topology)).
    ///
    /// # Errors
    /// [`ErrorKind::Config`] for an empty name or one longer than [`MAX_NAME_LEN`] bytes.
    pub fn with_exchange(mut self, destination: Destination, exchange: impl Into<String>) -> Result<Self> {
        let exchange = exchange.into();
        if exchange.is_empty() || exchange.len() > MAX_NAME_LEN {
            return Err(Error::config(
                BACKEND,
                format!("exchange name for {destination} must be 1 to {MAX_NAME_LEN} bytes"),
            ));
        }
        self.exchanges.insert(destination, exchange);
        Ok(self)
    }

    /// Prefix of every queue name: the queue of group `g` on destination `d` is
    /// `<prefix><d>:<g>` (see [`queue_name`](Self::queue_name)).
    ///
    /// # Errors
    /// As [`with_exchange_prefix`](Self::with_exchange_prefix).
    pub fn with_queue_prefix(mut self, prefix: impl Into<String>) -> Result<Self> {
        self.queue_prefix = prefix_name("queue_prefix", prefix.into())?;
        Ok(self)
    }

    /// The type of queue declared for each group.
    #[must_use]
    pub fn with_queue_type(mut self, queue_type: QueueType) -> Self {
        self.queue_type = queue_type;
        self
    }

    /// What the routing key of a published message is.
    #[must_use]
    pub fn with_routing_key(mut self, routing_key: RoutingKey) -> Self {
        self.routing_key = routing_key;
        self
    }

    /// Unacknowledged deliveries a subscription holds at most (`basic.qos`).
    ///
    /// # Errors
    /// [`ErrorKind::Config`] for 0 (which AMQP reads as "unlimited").
    pub fn with_prefetch(mut self, prefetch: u16) -> Result<Self> {
        if prefetch == 0 {
            return Err(Error::config(BACKEND, "prefetch must be at least 1 (0 means unlimited in AMQP)"));
        }
        self.prefetch = prefetch;
        Ok(self)
    }

    /// How long a publish waits for the broker's confirm before it reports
    /// [`Retry::OutcomeUnknown`](outbox_core::Retry::OutcomeUnknown).
    ///
    /// # Errors
    /// [`ErrorKind::Config`] for zero.
    pub fn with_confirm_timeout(mut self, timeout: Duration) -> Result<Self> {
        self.confirm_timeout = non_zero("confirm timeout", timeout)?;
        Ok(self)
    }

    /// How long opening a connection may take.
    ///
    /// # Errors
    /// [`ErrorKind::Config`] for zero.
    pub fn with_connect_timeout(mut self, timeout: Duration) -> Result<Self> {
        self.connect_timeout = non_zero("connect timeout", timeout)?;
        Ok(self)
    }

    /// Publishes in flight at once: the size of the confirm window. Each is on a channel of its
    /// own (see the crate documentation for why).
    ///
    /// # Errors
    /// [`ErrorKind::Config`] unless between 1 and 1024.
    pub fn with_publish_channels(mut self, channels: usize) -> Result<Self> {
        if !(1..=1024).contains(&channels) {
            return Err(Error::config(BACKEND, format!("publish_channels={channels}: expected 1 to 1024")));
        }
        self.publish_channels = channels;
        Ok(self)
    }

    /// Channels one [`publish_batch`](outbox_core::Broker::publish_batch) spreads its keys over,
    /// at most (never more than [`publish_channels`](Self::publish_channels)). Default: 1.
    ///
    /// A batch spread over many channels takes that many of the `publish_channels` windows, and
    /// the next batch a relay has in flight waits for them; with one channel per batch, a relay at
    /// pipeline depth `d` has `d` batches outstanding, each on its own channel. Measured with
    /// `outbox bench --only P2` on 2 cores: at pipeline depth 4 and 8 the relay published 5.1k–6.4k
    /// events/s with one channel per batch against 4.6k–5.4k spread over 2, 4 or 16; at depth 2
    /// the same within the spread. More channels spread one large batch's confirms over more of
    /// RabbitMQ's schedulers, for a caller that publishes large batches by itself on a machine
    /// with cores to spare.
    ///
    /// # Errors
    /// [`ErrorKind::Config`] unless between 1 and 1024.
    pub fn with_batch_channels(mut self, channels: usize) -> Result<Self> {
        if !(1..=1024).contains(&channels) {
            return Err(Error::config(BACKEND, format!("batch_channels={channels}: expected 1 to 1024")));
        }
        self.batch_channels = channels;
        Ok(self)
    }

    /// Whether [`declare`](outbox_core::Broker::declare) and
    /// [`subscribe`](outbox_core::Broker::subscribe) create exchanges, queues and bindings
    /// (`true`), or only check that they exist (`false`, for topology managed elsewhere).
    #[must_use]
    pub fn with_declare_topology(mut self, declare: bool) -> Self {
        self.declare_topology = declare;
        self
    }

    /// Largest payload a publish accepts ([`ErrorKind::TooLarge`], permanent, beyond it).
    #[must_use]
    pub fn with_max_payload(mut self, bytes: usize) -> Self {
        self.max_payload = bytes;
        self
    }

    /// The connection name RabbitMQ shows (`rabbitmqctl list_connections client_properties`);
    /// the broker appends ` publish` or ` consume` for its two connections.
    #[must_use]
    pub fn with_connection_name(mut self, name: impl Into<String>) -> Self {
        self.connection_name = name.into();
        self
    }

    /// What an [`AmqpBroker`](crate::AmqpBroker) built from these settings reports from
    /// [`Broker::capabilities`](outbox_core::Broker::capabilities).
    pub fn capabilities(&self) -> Capabilities {
        // Unroutable: a missing exchange is a 404, an unbound one a `mandatory` return. The
        // `redelivered` flag is always set; only quorum queues count deliveries. Several
        // consumers of one queue take turns, so one key's messages can be handled out of order.
        Capabilities::none()
            .with_detects_unroutable(true)
            .with_delivery_count(self.queue_type == QueueType::Quorum)
            .with_redelivery_flag(true)
            .with_nack_redelivers(true)
            .with_max_payload(Some(self.max_payload))
    }

    /// The URL with the password replaced by `***`.
    pub fn redacted_url(&self) -> String {
        self.redacted_url.clone()
    }

    /// See [`with_exchange_prefix`](Self::with_exchange_prefix).
    pub fn exchange_prefix(&self) -> &str {
        &self.exchange_prefix
    }

    /// See [`with_queue_prefix`](Self::with_queue_prefix).
    pub fn queue_prefix(&self) -> &str {
        &self.queue_prefix
    }

    /// See [`with_queue_type`](Self::with_queue_type).
    pub fn queue_type(&self) -> QueueType {
        self.queue_type
    }

    /// See [`with_routing_key`](Self::with_routing_key).
    pub fn routing_key(&self) -> RoutingKey {
        self.routing_key
    }

    /// See [`with_prefetch`](Self::with_prefetch).
    pub fn prefetch(&self) -> u16 {
        self.prefetch
    }

    /// See [`with_confirm_timeout`](Self::with_confirm_timeout).
    pub fn confirm_timeout(&self) -> Duration {
        self.confirm_timeout
    }

    /// See [`with_connect_timeout`](Self::with_connect_timeout).
    pub fn connect_timeout(&self) -> Duration {
        self.connect_timeout
    }

    /// See [`with_publish_channels`](Self::with_publish_channels).
    pub fn publish_channels(&self) -> usize {
        self.publish_channels
    }

    /// See [`with_batch_channels`](Self::with_batch_channels): the cap in effect.
    pub fn batch_channels(&self) -> usize {
        self.batch_channels.min(self.publish_channels)
    }

    /// See [`with_declare_topology`](Self::with_declare_topology).
    pub fn declare_topology(&self) -> bool {
        self.declare_topology
    }

    /// See [`with_max_payload`](Self::with_max_payload).
    pub fn max_payload(&self) -> usize {
        self.max_payload
    }

    /// See [`with_connection_name`](Self::with_connection_name).
    pub fn connection_name(&self) -> &str {
        &self.connection_name
    }

    /// The exchange `destination` is published to.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidInput`] when prefix and name together exceed [`MAX_NAME_LEN`] bytes.
    pub fn exchange_name(&self, destination: &Destination) -> Result<String> {
        if let Some(name) = self.exchanges.get(destination) {
            return Ok(name.clone());
        }
        checked_len("exchange", format!("{}{destination}", self.exchange_prefix))
    }

    /// The queue of `group` on `destination`: `<queue_prefix><destination>:<group>`.
    ///
    /// One queue per pair, never shared: destination and group names are `[A-Za-z0-9._-]`, so
    /// the `:` between them is the only one after the prefix and the pair can be read back from
    /// the name. (Joined with `.`, `(orders.eu, billing)` and `(orders, eu.billing)` would both
    /// be `orders.eu.billing`, and one destination's events would reach the other's group.)
    ///
    /// The whole name must fit AMQP's [`MAX_NAME_LEN`] (255) bytes: prefix, destination, `:` and
    /// group together. A longer one is refused, never shortened (a shortened name could be
    /// another pair's).
    ///
    /// # Errors
    /// [`ErrorKind::InvalidInput`] when the name exceeds [`MAX_NAME_LEN`] bytes.
    pub fn queue_name(&self, destination: &Destination, group: &ConsumerGroup) -> Result<String> {
        checked_len("queue", format!("{}{destination}{QUEUE_NAME_SEPARATOR}{group}", self.queue_prefix))
    }

    /// The routing key `event` is published with.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidInput`] for an event key longer than [`MAX_NAME_LEN`] bytes under
    /// [`RoutingKey::EventKey`].
    pub fn routing_key_for(&self, event: &Event) -> Result<String> {
        match (self.routing_key, &event.key) {
            (RoutingKey::EventKey, Some(key)) => checked_len("routing key", key.clone()),
            _ => Ok(event.destination.to_string()),
        }
    }

    pub(crate) fn amqp_uri(&self) -> AMQPUri {
        self.uri.clone()
    }
}

impl fmt::Display for AmqpConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.redacted_url())
    }
}

impl fmt::Debug for AmqpConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AmqpConfig")
            .field("url", &self.redacted_url())
            .field("vhost", &self.uri.vhost)
            .field("exchange_prefix", &self.exchange_prefix)
            .field("exchanges", &self.exchanges)
            .field("queue_prefix", &self.queue_prefix)
            .field("queue_type", &self.queue_type)
            .field("routing_key", &self.routing_key)
            .field("prefetch", &self.prefetch)
            .field("confirm_timeout", &self.confirm_timeout)
            .field("connect_timeout", &self.connect_timeout)
            .field("publish_channels", &self.publish_channels)
            .field("batch_channels", &self.batch_channels())
            .field("declare_topology", &self.declare_topology)
            .field("max_payload", &self.max_payload)
            .field("connection_name", &self.connection_name)
            .finish()
    }
}

impl FromStr for AmqpConfig {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        Self::from_url(s)
    }
}

fn driver_number<T: FromStr>(url: &ConnectionUrl, name: &str, value: &str) -> Result<T>
where
    T::Err: fmt::Display,
{
    value.parse().map_err(|e| url.param_error(name, value, e))
}

fn non_zero(what: &str, d: Duration) -> Result<Duration> {
    if d.is_zero() {
        return Err(Error::config(BACKEND, format!("{what} must be greater than zero")));
    }
    Ok(d)
}

fn prefix_name(what: &str, prefix: String) -> Result<String> {
    if prefix.len() > 50 || !prefix.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-' | ':')) {
        return Err(Error::config(BACKEND, format!("{what} {prefix:?}: expected at most 50 bytes of [A-Za-z0-9._:-]")));
    }
    Ok(prefix)
}

fn checked_len(what: &str, name: String) -> Result<String> {
    if name.len() > MAX_NAME_LEN {
        return Err(Error::new(
            ErrorKind::InvalidInput,
            outbox_core::Retry::Permanent,
            BACKEND,
            format!("{what} name {name:?} is {} bytes, longer than AMQP's limit of {MAX_NAME_LEN}", name.len()),
        ));
    }
    Ok(name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_url_and_parameters() {
        let c = AmqpConfig::from_url(
            "amqps://alice:s%3Acret@10.1.2.3:5999/prod?outbox_queue_type=quorum&outbox_prefetch=7\
             &outbox_confirm_timeout_ms=250&outbox_exchange_prefix=t1.&outbox_queue_prefix=q.\
             &outbox_routing_key=key&outbox_declare_topology=false&outbox_publish_channels=3&heartbeat=5&outbox_batch_channels=2\
             &outbox_connect_timeout_ms=400&outbox_max_payload=99&outbox_connection_name=relay%20a&frame_max=8192",
        )
        .unwrap();
        let uri = c.amqp_uri();
        assert_eq!(uri.scheme, AMQPScheme::AMQPS);
        assert_eq!(uri.authority.host, "10.1.2.3");
        assert_eq!(uri.authority.port, 5999);
        assert_eq!(uri.authority.userinfo.username, "alice");
        assert_eq!(uri.authority.userinfo.password, "s:cret");
        assert_eq!(uri.vhost, "prod");
        assert_eq!(uri.query.heartbeat, Some(5));
        assert_eq!(c.queue_type(), QueueType::Quorum);
        assert_eq!(c.prefetch(), 7);
        assert_eq!(c.confirm_timeout(), Duration::from_millis(250));
        assert_eq!(c.routing_key(), RoutingKey::EventKey);
        assert!(!c.declare_topology());
        assert_eq!(c.publish_channels(), 3);
        assert_eq!(c.batch_channels(), 2);
        assert_eq!(c.clone().with_batch_channels(8).unwrap().batch_channels(), 3, "never more than publish_channels");
        assert!(c.clone().with_batch_channels(0).is_err());
        assert_eq!(AmqpConfig::from_url("amqp://h").unwrap().batch_channels(), 1, "one channel per batch by default");
        assert_eq!(c.connect_timeout(), Duration::from_millis(400));
        assert_eq!(c.max_payload(), 99);
        assert_eq!(c.connection_name(), "relay a");
        assert_eq!(uri.query.frame_max, Some(8192));
        let d = Destination::new("orders").unwrap();
        let g = ConsumerGroup::new("billing").unwrap();
        assert_eq!(c.exchange_name(&d).unwrap(), "t1.orders");
        assert_eq!(c.queue_name(&d, &g).unwrap(), "q.orders:billing");
    }

    #[test]
    fn queue_names_identify_the_destination_and_group_pair() {
        let c = AmqpConfig::from_url("amqp://127.0.0.1").unwrap().with_queue_prefix("p.").unwrap();
        let q = |d: &str, g: &str| c.queue_name(&Destination::new(d).unwrap(), &ConsumerGroup::new(g).unwrap());
        // Joined with '.', these pairs would share one queue.
        assert_eq!(q("orders.eu", "billing").unwrap(), "p.orders.eu:billing");
        assert_eq!(q("orders", "eu.billing").unwrap(), "p.orders:eu.billing");
        let names = ["a", "a.b", "a.b.c", "b", "b.c", "a-b", "a_b", "a..b", "..."];
        let mut seen = std::collections::BTreeMap::new();
        for d in names {
            for g in names {
                let name = q(d, g).unwrap();
                // The pair reads back from the name.
                let rest = name.strip_prefix("p.").unwrap();
                assert_eq!(rest.split_once(QUEUE_NAME_SEPARATOR), Some((d, g)), "{name}");
                if let Some(other) = seen.insert(name.clone(), (d, g)) {
                    panic!("({d}, {g}) and {other:?} share the queue {name}");
                }
            }
        }
        // The limit covers prefix, destination, separator and group: 2 + 200 + 1 + 52 = 255.
        let d = Destination::new("d".repeat(200)).unwrap();
        assert_eq!(c.queue_name(&d, &ConsumerGroup::new("g".repeat(52)).unwrap()).unwrap().len(), MAX_NAME_LEN);
        let err = c.queue_name(&d, &ConsumerGroup::new("g".repeat(53)).unwrap()).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::InvalidInput);
        assert!(err.to_string().contains("longer than AMQP's limit of 255"), "{err}");
    }

    #[test]
    fn vhost_follows_rabbitmq_uri_spec() {
        let vhost = |u: &str| AmqpConfig::from_url(u).unwrap().amqp_uri().vhost;
        assert_eq!(vhost("amqp://h"), "/");
        assert_eq!(vhost("amqp://h:5672"), "/");
        assert_eq!(vhost("amqp://h/%2f"), "/");
        assert_eq!(vhost("amqp://h/"), "");
        assert_eq!(vhost("amqp://h/a%2Fb"), "a/b");
        let c = AmqpConfig::from_url("amqp://[::1]:5673").unwrap();
        assert_eq!(c.amqp_uri().authority.host, "::1");
        assert_eq!(c.amqp_uri().authority.userinfo, AMQPUserInfo::default());
    }

    #[test]
    fn rejects_bad_urls_without_echoing_secrets() {
        for bad in [
            "http://u:topsecret@h/",
            "amqp://u:topsecret@h/?outbox_prefetch=0",
            "amqp://u:topsecret@h/?outbox_prefetch=x",
            "amqp://u:topsecret@h/?outbox_prefetch=65536",
            "amqp://u:topsecret@h/?bogus=1",
            "amqp://u:topsecret@h/?outbox_bogus=1",
            "amqp://u:topsecret@h/?prefetch=4",
            "amqp://u:topsecret@h/?outbox_queue_type=stream",
            "amqp://u:topsecret@h/?outbox_exchange_prefix=a%20b",
            "amqp://u:topsecret@h/?outbox_declare_topology=perhaps",
            "amqp://u:topsecret@h/?heartbeat=often",
            "amqp://u:topsecret@h/?auth_mechanism=magic",
            "amqp://u:topsecret@/",
            "amqp://u:topsecret%zz@h/",
            "amqp://u:topsecret@h1,h2/",
            "not a url",
        ] {
            let err = AmqpConfig::from_url(bad).unwrap_err();
            assert_eq!(err.kind(), ErrorKind::Config, "{bad}");
            assert!(err.is_permanent());
            assert!(!err.to_string().contains("topsecret"), "{err}");
        }
    }

    #[test]
    fn errors_name_the_parameter_and_list_the_known_ones() {
        let err = AmqpConfig::from_url("amqp://u:topsecret@h/?queue_type=quorum").unwrap_err();
        let text = err.to_string();
        assert!(text.starts_with("amqp: unknown URL parameter \"queue_type\""), "{text}");
        assert!(text.contains("outbox_queue_type") && text.contains("heartbeat"), "{text}");
        let err = AmqpConfig::from_url("amqp://u:topsecret@h/?outbox_queue_type=stream").unwrap_err();
        assert!(err.to_string().contains("outbox_queue_type=\"stream\""), "{err}");
    }

    #[test]
    fn percent_encoded_credentials_are_decoded() {
        let c = AmqpConfig::from_url("amqp://app%40corp:p%40ss%3Aw%25rd@h/v%2Fh").unwrap();
        let uri = c.amqp_uri();
        assert_eq!(uri.authority.userinfo.username, "app@corp");
        assert_eq!(uri.authority.userinfo.password, "p@ss:w%rd");
        assert_eq!(uri.vhost, "v/h");
        let shown = format!("{c} {c:?}");
        assert!(!shown.contains("p%40ss") && !shown.contains("w%25rd") && !shown.contains("p@ss"), "{shown}");
    }

    #[test]
    fn debug_and_display_redact_the_password() {
        let c = AmqpConfig::from_url("amqp://guest:hunter2@127.0.0.1:5672/%2f").unwrap();
        let shown = format!("{c} {c:?}");
        assert!(!shown.contains("hunter2"), "{shown}");
        assert!(shown.contains("guest:***@127.0.0.1"), "{shown}");
        let no_password = AmqpConfig::from_url("amqp://127.0.0.1").unwrap();
        assert_eq!(no_password.to_string(), "amqp://127.0.0.1");
    }

    #[test]
    fn names_are_checked_against_amqp_limits() {
        let c = AmqpConfig::from_url("amqp://guest:guest@127.0.0.1:5672/%2f")
            .unwrap()
            .with_routing_key(RoutingKey::EventKey);
        let d = Destination::new("d".repeat(200)).unwrap();
        let g = ConsumerGroup::new("g".repeat(60)).unwrap();
        assert_eq!(c.queue_name(&d, &g).unwrap_err().kind(), ErrorKind::InvalidInput);
        let e = Event::new(outbox_core::EventId::new("a").unwrap(), Destination::new("x").unwrap(), b"".to_vec());
        assert_eq!(c.routing_key_for(&e).unwrap(), "x");
        assert_eq!(c.routing_key_for(&e.clone().with_key("k.1")).unwrap(), "k.1");
        assert_eq!(c.routing_key_for(&e.with_key("k".repeat(256))).unwrap_err().kind(), ErrorKind::InvalidInput);
        let mapped = c.with_exchange(Destination::new("x").unwrap(), "amq.topic").unwrap();
        assert_eq!(mapped.exchange_name(&Destination::new("x").unwrap()).unwrap(), "amq.topic");
    }
}
