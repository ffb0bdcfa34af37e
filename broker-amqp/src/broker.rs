//! The broker: publishing with confirms and `mandatory`, topology, and the connections.
//!
//! **One publish in flight per channel.** lapin hands a `basic.return` to whichever confirm it
//! resolves next on that channel, not to the message that was returned (RabbitMQ's acks may come
//! out of order or cover several messages at once). With several publishes in flight on one
//! channel, an unroutable message could be reported as routed, and the relay would mark a row
//! published that nobody received. So each publish owns a channel until its confirm arrives,
//! and the confirm window is a pool of channels ([`AmqpConfig::publish_channels`]): RabbitMQ sends
//! the return before the ack of the same message, so on a channel with one message in flight
//! the pairing is exact. A channel whose publish ended in an error or a timeout is thrown away,
//! so a late return cannot be paired with the next message.
//!
//! A batch ([`Broker::publish_batch`], `batch.rs`) keeps many messages in flight per channel
//! and attributes returns by the event id they carry instead.
//!
//! **Two connections**, one for publishing and one for consuming, as RabbitMQ recommends: when
//! the server blocks publishers (memory or disk alarm) the consumers' acknowledgements still flow.
//! Each is rebuilt on the next operation after it broke.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use async_trait::async_trait;
use lapin::options::{
    BasicPublishOptions, ConfirmSelectOptions, ExchangeDeclareOptions, ExchangeDeleteOptions, QueueBindOptions,
    QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{Channel, Confirmation, Connection, ConnectionProperties, ExchangeKind};
use outbox_core::{Broker, ConsumerGroup, Destination, Error, ErrorKind, Event, Result, Subscription};
use tokio::sync::Semaphore;
use tracing::{debug, warn};

use crate::codec;
use crate::config::{AmqpConfig, QueueType};
use crate::error::{BACKEND, Op, from_lapin};
use crate::subscription::AmqpSubscription;

/// AMQP reply code of a `basic.return` for a message no queue is bound to receive.
pub(crate) const NO_ROUTE: u16 = 312;
/// Binding key that makes a topic exchange deliver everything to the queue.
const BIND_ALL: &str = "#";

/// A RabbitMQ [`Broker`]. Cheap to clone: clones share the connections and the channel pool.
///
/// Nothing is connected until the first operation; a broken connection is reopened by the next
/// one.
#[derive(Clone)]
pub struct AmqpBroker {
    pub(crate) inner: Arc<Inner>,
}

pub(crate) struct Inner {
    pub(crate) config: AmqpConfig,
    pub(crate) publisher: Slot,
    pub(crate) consumer: Slot,
    idle: Mutex<Vec<Channel>>,
    pub(crate) window: Semaphore,
    /// Exchanges seen to exist (declared or checked) on the publishing connection; a batch
    /// checks the others before it sends anything to them (see `batch.rs`).
    exchanges: Mutex<HashSet<String>>,
}

/// What `publish` sends for one event, after every check passed.
pub(crate) struct Prepared {
    pub(crate) exchange: String,
    pub(crate) routing_key: String,
    pub(crate) properties: lapin::BasicProperties,
}

/// One lazily (re)opened connection.
pub(crate) struct Slot {
    role: &'static str,
    connection: tokio::sync::Mutex<Option<Arc<Connection>>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl AmqpBroker {
    /// A broker for `config`. Does not connect yet.
    pub fn new(config: AmqpConfig) -> Self {
        let window = Semaphore::new(config.publish_channels());
        Self {
            inner: Arc::new(Inner {
                publisher: Slot::new("publish"),
                consumer: Slot::new("consume"),
                idle: Mutex::new(Vec::new()),
                window,
                exchanges: Mutex::new(HashSet::new()),
                config,
            }),
        }
    }

    /// A broker for the URL in `OUTBOX_AMQP_URL` ([`AmqpConfig::from_env`]).
    ///
    /// # Errors
    /// As [`AmqpConfig::from_env`].
    pub fn from_env() -> Result<Self> {
        Ok(Self::new(AmqpConfig::from_env()?))
    }

    /// The configuration.
    pub fn config(&self) -> &AmqpConfig {
        &self.inner.config
    }

    /// Open both connections now (and check the credentials), instead of on first use.
    ///
    /// # Errors
    /// [`ErrorKind::Connection`] (transient) when the server cannot be reached.
    pub async fn connect(&self) -> Result<()> {
        self.inner.connection(&self.inner.publisher).await?;
        self.inner.connection(&self.inner.consumer).await?;
        Ok(())
    }

    /// [`Broker::subscribe`] with the concrete type (which can tell its queue name).
    ///
    /// # Errors
    /// As [`Broker::subscribe`].
    pub async fn subscription(&self, destination: &Destination, group: &ConsumerGroup) -> Result<AmqpSubscription> {
        let mut subscription = AmqpSubscription::new(self.inner.clone(), destination.clone(), group.clone())?;
        subscription.start().await?;
        Ok(subscription)
    }

    /// Messages ready in the queue of `group` on `destination` (not counting deliveries that are
    /// in flight to a consumer). For tests and operators.
    ///
    /// # Errors
    /// [`ErrorKind::Config`] (transient) when the queue does not exist; connection errors.
    pub async fn queue_depth(&self, destination: &Destination, group: &ConsumerGroup) -> Result<u32> {
        let queue = self.inner.config.queue_name(destination, group)?;
        let channel = self.inner.topology_channel().await?;
        let what = format!("queue {queue}");
        let declared = self
            .inner
            .rpc(
                &self.inner.publisher,
                &what,
                channel.queue_declare(
                    queue.as_str().into(),
                    QueueDeclareOptions { passive: true, ..Default::default() },
                    empty(),
                ),
                |e| from_lapin(e, Op::Topology, &what),
            )
            .await?;
        close(channel);
        Ok(declared.message_count())
    }

    /// Delete the queues of `groups` on `destination`, then its exchange (with every message in
    /// them). Deleting what does not exist is not an error. For tests and operators.
    ///
    /// # Errors
    /// Connection errors; [`ErrorKind::Config`] when the server refuses (permissions).
    pub async fn delete(&self, destination: &Destination, groups: &[ConsumerGroup]) -> Result<()> {
        for group in groups {
            let queue = self.inner.config.queue_name(destination, group)?;
            let channel = self.inner.topology_channel().await?;
            let what = format!("deleting queue {queue}");
            self.inner
                .rpc(
                    &self.inner.publisher,
                    &what,
                    channel.queue_delete(queue.as_str().into(), QueueDeleteOptions::default()),
                    |e| from_lapin(e, Op::Topology, &what),
                )
                .await?;
            close(channel);
        }
        let exchange = self.inner.config.exchange_name(destination)?;
        self.inner.forget_exchange(&exchange);
        let channel = self.inner.topology_channel().await?;
        let what = format!("deleting exchange {exchange}");
        self.inner
            .rpc(
                &self.inner.publisher,
                &what,
                channel.exchange_delete(exchange.as_str().into(), ExchangeDeleteOptions::default()),
                |e| from_lapin(e, Op::Topology, &what),
            )
            .await?;
        close(channel);
        Ok(())
    }

    /// Close both connections (publishes and subscriptions in flight fail). Dropping the last
    /// clone and every subscription closes them too.
    ///
    /// Each connection's close handshake waits at most the connect timeout: on a connection that
    /// died silently the handshake never completes, and closing must not hang a shutdown.
    pub async fn close(&self) {
        let limit = self.inner.config.connect_timeout();
        for slot in [&self.inner.publisher, &self.inner.consumer] {
            if let Some(conn) = slot.connection.lock().await.take()
                && tokio::time::timeout(limit, conn.close(200, "OK".into())).await.is_err()
            {
                warn!(target: "outbox.amqp", role = slot.role, ?limit, "no reply to connection.close; dropped the connection");
            }
        }
        lock(&self.inner.idle).clear();
    }
}

impl fmt::Debug for AmqpBroker {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AmqpBroker").field("config", &self.inner.config).finish_non_exhaustive()
    }
}

impl Slot {
    fn new(role: &'static str) -> Self {
        Self { role, connection: tokio::sync::Mutex::new(None) }
    }
}

fn empty() -> FieldTable {
    FieldTable::default()
}

/// Close a connection given up on, in the background (its close waits for a reply too).
fn close_connection(conn: Arc<Connection>) {
    if let Ok(handle) = tokio::runtime::Handle::try_current() {
        handle.spawn(async move {
            let _ = tokio::time::timeout(BACKGROUND_CLOSE_LIMIT, conn.close(320, "no reply".into())).await;
        });
    }
}

/// Close a channel in the background (a channel also closes when its last handle drops; this
/// only makes it prompt and explicit).
pub(crate) fn close(channel: Channel) {
    if let Ok(handle) = tokio::runtime::Handle::try_current() {
        handle.spawn(async move {
            // Bounded: on a dead connection the reply never comes (the connection's own reopening
            // is decided elsewhere).
            let _ = tokio::time::timeout(BACKGROUND_CLOSE_LIMIT, channel.close(200, "OK".into())).await;
        });
    }
}

/// Longest wait for the reply to a background `connection.close` or `channel.close`.
const BACKGROUND_CLOSE_LIMIT: std::time::Duration = std::time::Duration::from_secs(5);

/// Checked before anything is sent: an oversized content header is a connection-level
/// FRAME_ERROR that would take down every channel sharing the connection.
fn fits_frame(event: &Event, frame_max: u32) -> Result<()> {
    let header_bytes = codec::content_header_frame_bytes(event);
    if frame_max != 0 && header_bytes > frame_max as usize {
        return Err(Error::permanent(
            ErrorKind::TooLarge,
            BACKEND,
            format!(
                "event {}: its properties and headers need a {header_bytes}-byte content-header frame, larger than \
                 the connection's negotiated frame_max of {frame_max}; not sent",
                event.id
            ),
        ));
    }
    Ok(())
}

impl Inner {
    /// The slot's connection, reopened if it is missing or broken.
    pub(crate) async fn connection(&self, slot: &Slot) -> Result<Arc<Connection>> {
        let mut guard = slot.connection.lock().await;
        if let Some(conn) = guard.as_ref() {
            if conn.status().connected() {
                return Ok(conn.clone());
            }
            debug!(target: "outbox.amqp", role = slot.role, status = ?conn.status(), "connection lost; reconnecting");
        }
        *guard = None;
        let config = &self.config;
        let properties = ConnectionProperties::default()
            .with_connection_name(format!("{} {}", config.connection_name(), slot.role).into());
        let connect = Connection::connect_uri(config.amqp_uri(), properties);
        let conn = match tokio::time::timeout(config.connect_timeout(), connect).await {
            Ok(Ok(conn)) => conn,
            Ok(Err(e)) => return Err(from_lapin(e, Op::Connect, &config.redacted_url())),
            Err(_) => {
                return Err(Error::transient(
                    ErrorKind::Connection,
                    BACKEND,
                    format!("connecting to {} timed out after {:?}", config.redacted_url(), config.connect_timeout()),
                ));
            }
        };
        let conn = Arc::new(conn);
        *guard = Some(conn.clone());
        Ok(conn)
    }

    async fn channel(&self, slot: &Slot) -> Result<Channel> {
        let conn = self.connection(slot).await?;
        // A connection that died silently (no heartbeat yet) can leave the open hanging.
        match tokio::time::timeout(self.config.connect_timeout(), conn.create_channel()).await {
            Ok(channel) => channel.map_err(|e| from_lapin(e, Op::Channel, slot.role)),
            Err(_) => {
                self.forget_connection(slot).await;
                Err(Error::transient(
                    ErrorKind::Connection,
                    BACKEND,
                    format!("opening a {} channel timed out after {:?}", slot.role, self.config.connect_timeout()),
                ))
            }
        }
    }

    /// After a method got no reply: drop the slot's connection, so that the next use connects
    /// afresh instead of opening channels on a connection that no longer answers.
    async fn forget_connection(&self, slot: &Slot) {
        if let Some(conn) = slot.connection.lock().await.take() {
            warn!(target: "outbox.amqp", role = slot.role, "a method got no reply; reconnecting");
            close_connection(conn);
        }
    }

    /// Wait at most the connect timeout for the server's reply to an AMQP method on `slot`'s
    /// connection. A connection that died silently (a black-holed network, before a heartbeat
    /// is missed) never answers, and an unbounded wait would hang a relay's batch or a
    /// consumer's `receive` past every deadline of its caller; on no reply the connection is
    /// given up, so the next use reconnects.
    pub(crate) async fn rpc<T>(
        &self,
        slot: &Slot,
        what: &str,
        reply: impl std::future::Future<Output = lapin::Result<T>>,
        error: impl FnOnce(lapin::Error) -> Error,
    ) -> Result<T> {
        let limit = self.config.connect_timeout();
        match tokio::time::timeout(limit, reply).await {
            Ok(r) => r.map_err(error),
            Err(_) => {
                self.forget_connection(slot).await;
                Err(Error::transient(
                    ErrorKind::Timeout,
                    BACKEND,
                    format!("{what}: no reply from the server within {limit:?}; the connection is given up"),
                ))
            }
        }
    }

    /// A fresh channel for topology work: a failed declaration closes its channel, so these are
    /// never shared.
    async fn topology_channel(&self) -> Result<Channel> {
        self.channel(&self.publisher).await
    }

    pub(crate) async fn consumer_channel(&self) -> Result<Channel> {
        self.channel(&self.consumer).await
    }

    /// An idle publishing channel in confirm mode, or a new one.
    pub(crate) async fn publish_channel(&self) -> Result<Channel> {
        loop {
            let Some(channel) = lock(&self.idle).pop() else { break };
            if channel.status().connected() {
                return Ok(channel);
            }
        }
        let channel = self.channel(&self.publisher).await?;
        self.rpc(&self.publisher, "confirm.select", channel.confirm_select(ConfirmSelectOptions::default()), |e| {
            from_lapin(e, Op::Channel, "confirm.select")
        })
        .await?;
        Ok(channel)
    }

    pub(crate) fn recycle(&self, channel: Channel) {
        if channel.status().connected() {
            lock(&self.idle).push(channel);
        }
    }

    /// Declare (or, with `declare_topology` off, check) the exchange of `destination` and the
    /// queue of each group, bound to receive everything.
    pub(crate) async fn declare(&self, destination: &Destination, groups: &[ConsumerGroup]) -> Result<()> {
        let exchange = self.config.exchange_name(destination)?;
        let queues = groups.iter().map(|g| self.config.queue_name(destination, g)).collect::<Result<Vec<_>>>()?;
        let channel = self.topology_channel().await?;
        let passive = !self.config.declare_topology();
        let missing = |what: String| {
            move |e: lapin::Error| {
                let err = from_lapin(e, Op::Topology, &what);
                if passive && err.kind() == ErrorKind::Config && err.is_transient() {
                    Error::transient(
                        ErrorKind::Config,
                        BACKEND,
                        format!("{what} does not exist and declare_topology is off; create it first"),
                    )
                } else {
                    err
                }
            }
        };
        let what = format!("exchange {exchange}");
        self.rpc(
            &self.publisher,
            &what,
            channel.exchange_declare(
                exchange.as_str().into(),
                ExchangeKind::Topic,
                ExchangeDeclareOptions { passive, durable: true, ..Default::default() },
                empty(),
            ),
            missing(what.clone()),
        )
        .await?;
        for queue in &queues {
            let mut arguments = empty();
            if self.config.queue_type() == QueueType::Quorum {
                arguments.insert("x-queue-type".into(), AMQPValue::LongString(LongString::from("quorum")));
            }
            let what = format!("queue {queue}");
            self.rpc(
                &self.publisher,
                &what,
                channel.queue_declare(
                    queue.as_str().into(),
                    QueueDeclareOptions { passive, durable: true, ..Default::default() },
                    arguments,
                ),
                missing(what.clone()),
            )
            .await?;
            if !passive {
                let what = format!("binding {queue} to {exchange}");
                self.rpc(
                    &self.publisher,
                    &what,
                    channel.queue_bind(
                        queue.as_str().into(),
                        exchange.as_str().into(),
                        BIND_ALL.into(),
                        QueueBindOptions::default(),
                        empty(),
                    ),
                    |e| from_lapin(e, Op::Topology, &what),
                )
                .await?;
            }
        }
        close(channel);
        lock(&self.exchanges).insert(exchange);
        Ok(())
    }

    /// Of `names`, the exchanges that do not exist, each with the error to report for the
    /// events sent to it. Each exchange not yet seen is checked with a passive declaration on its
    /// own channel, all at once; one that exists is remembered. Only a definite 404 counts: when
    /// the check itself fails (a refused permission, a broken connection), the batch is sent as
    /// it would have been without the check, and the publish reports what happens.
    pub(crate) async fn missing_exchanges(&self, names: HashSet<&str>) -> HashMap<String, Error> {
        let unknown: Vec<&str> = {
            let known = lock(&self.exchanges);
            names.into_iter().filter(|n| !known.contains(*n)).collect()
        };
        let checks = unknown.into_iter().map(|name| async move { (name, self.check_exchange(name).await) });
        futures::future::join_all(checks)
            .await
            .into_iter()
            .filter_map(|(name, r)| match r {
                Err(e) if e.kind() == ErrorKind::Unroutable => Some((name.to_string(), e)),
                Err(e) => {
                    debug!(target: "outbox.amqp", exchange = name, error = %e, "could not check the exchange; publishing");
                    None
                }
                Ok(()) => None,
            })
            .collect()
    }

    async fn check_exchange(&self, name: &str) -> Result<()> {
        let channel = self.topology_channel().await?;
        let what = format!("exchange {name}");
        let checked = self
            .rpc(
                &self.publisher,
                &what,
                channel.exchange_declare(
                    name.into(),
                    ExchangeKind::Topic,
                    ExchangeDeclareOptions { passive: true, ..Default::default() },
                    empty(),
                ),
                |e| from_lapin(e, Op::Publish, &what),
            )
            .await;
        // After a 404 the server has closed the channel already (closing it again sends nothing).
        close(channel);
        match checked {
            Ok(()) => {
                lock(&self.exchanges).insert(name.to_string());
                Ok(())
            }
            Err(e) if e.kind() == ErrorKind::Unroutable => Err(Error::transient(
                ErrorKind::Unroutable,
                BACKEND,
                format!("exchange {name} does not exist (checked before publishing): nothing was sent to it"),
            )),
            Err(e) => Err(e),
        }
    }

    /// After a window to `exchange` failed with a 404: check it again before the next batch.
    pub(crate) fn forget_exchange(&self, exchange: &str) {
        lock(&self.exchanges).remove(exchange);
    }

    /// Everything `publish` checks before sending, and the message to send.
    pub(crate) fn prepare(&self, event: &Event, frame_max: u32) -> Result<Prepared> {
        let prepared = self.message(event)?;
        fits_frame(event, frame_max)?;
        Ok(prepared)
    }

    /// The checks that need no connection, and the message to send.
    fn message(&self, event: &Event) -> Result<Prepared> {
        event.validate(self.config.max_payload())?;
        let exchange = self.config.exchange_name(&event.destination)?;
        let routing_key = self.config.routing_key_for(event)?;
        let properties = codec::encode(event)?;
        Ok(Prepared { exchange, routing_key, properties })
    }

    async fn publish(&self, event: &Event) -> Result<()> {
        let Prepared { exchange, routing_key, properties } = self.message(event)?;
        fits_frame(event, self.connection(&self.publisher).await?.configuration().frame_max())?;
        let _permit = self
            .window
            .acquire()
            .await
            .map_err(|_| Error::transient(ErrorKind::Closed, BACKEND, "the broker was closed"))?;
        let channel = self.publish_channel().await?;
        let confirm = match channel
            .basic_publish(
                exchange.as_str().into(),
                routing_key.as_str().into(),
                BasicPublishOptions { mandatory: true, immediate: false },
                &event.payload,
                properties,
            )
            .await
        {
            Ok(confirm) => confirm,
            Err(e) => return Err(from_lapin(e, Op::Publish, &format!("event {} to {exchange}", event.id))),
        };
        let outcome = match tokio::time::timeout(self.config.confirm_timeout(), confirm).await {
            Ok(outcome) => outcome,
            Err(_) => {
                // A late confirm or return must not be paired with the next message: drop it.
                close(channel);
                return Err(Error::outcome_unknown(
                    ErrorKind::Timeout,
                    BACKEND,
                    format!(
                        "no publisher confirm for event {} on exchange {exchange} within {:?}; it may or may not have \
                         been routed",
                        event.id,
                        self.config.confirm_timeout()
                    ),
                ));
            }
        };
        match outcome {
            Ok(Confirmation::Ack(None)) => {
                self.recycle(channel);
                Ok(())
            }
            Ok(Confirmation::Ack(Some(returned)) | Confirmation::Nack(Some(returned))) => {
                self.recycle(channel);
                let code = returned.reply_code;
                let text = returned.reply_text.as_str().to_string();
                if code == NO_ROUTE {
                    Err(Error::transient(
                        ErrorKind::Unroutable,
                        BACKEND,
                        format!(
                            "event {} is unroutable: exchange {exchange} has no queue bound for routing key \
                             {routing_key:?} (the broker returned it: {code} {text})",
                            event.id
                        ),
                    ))
                } else {
                    Err(Error::transient(
                        ErrorKind::Rejected,
                        BACKEND,
                        format!("event {} was returned by exchange {exchange}: {code} {text}", event.id),
                    ))
                }
            }
            Ok(Confirmation::Nack(None)) => {
                self.recycle(channel);
                Err(Error::transient(
                    ErrorKind::Rejected,
                    BACKEND,
                    format!("the broker refused event {} (publisher nack from exchange {exchange})", event.id),
                ))
            }
            Ok(Confirmation::NotRequested) => {
                // Cannot happen on a channel in confirm mode; don't trust this channel again.
                close(channel);
                Err(Error::outcome_unknown(
                    ErrorKind::Rejected,
                    BACKEND,
                    format!("publish of event {} got no confirm: the channel is not in confirm mode", event.id),
                ))
            }
            Err(e) => {
                let err = from_lapin(e, Op::Confirm, &format!("event {} to {exchange}", event.id));
                warn!(target: "outbox.amqp", event_id = %event.id, error = %err, "publish failed");
                if err.kind() == ErrorKind::Unroutable {
                    self.forget_exchange(&exchange);
                }
                close(channel);
                Err(err)
            }
        }
    }
}

#[async_trait]
impl Broker for AmqpBroker {
    fn backend(&self) -> &'static str {
        BACKEND
    }

    /// [`AmqpConfig::capabilities`]: delivery count on quorum queues only.
    fn capabilities(&self) -> outbox_core::Capabilities {
        self.config().capabilities()
    }

    /// [`PREFERRED_PIPELINE_DEPTH`](crate::config::PREFERRED_PIPELINE_DEPTH): 8 batches, since
    /// RabbitMQ confirms after a disk sync and one relay at the default 2 leaves it waiting.
    fn preferred_pipeline_depth(&self) -> Option<usize> {
        Some(crate::config::PREFERRED_PIPELINE_DEPTH)
    }

    /// Declare a durable topic exchange for `destination` and, for each group, a durable queue
    /// bound with `#`. With `declare_topology` off, only check that they exist.
    async fn declare(&self, destination: &Destination, groups: &[ConsumerGroup]) -> Result<()> {
        self.inner.declare(destination, groups).await
    }

    async fn publish(&self, event: &Event) -> Result<()> {
        self.inner.publish(event).await
    }

    /// Publisher confirms over a window: each channel carries many messages at once, and each
    /// message is told exactly whether it was returned (see the crate documentation,
    /// "Batching").
    async fn publish_batch(&self, events: &[Event]) -> Vec<Result<()>> {
        self.inner.publish_batch(events).await
    }

    async fn subscribe(&self, destination: &Destination, group: &ConsumerGroup) -> Result<Box<dyn Subscription>> {
        Ok(Box::new(self.subscription(destination, group).await?))
    }
}
