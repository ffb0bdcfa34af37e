//! A consumer on a group's queue, with manual acknowledgement.
//!
//! Each subscription has a channel of its own, so that closing it is exactly "this consumer went
//! away": RabbitMQ requeues every delivery the channel holds unacknowledged, and they go to the
//! other members of the group with the `redelivered` flag set.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use futures::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicCancelOptions, BasicConsumeOptions, BasicNackOptions, BasicQosOptions, BasicRejectOptions,
};
use lapin::types::FieldTable;
use lapin::{Acker, Channel, ChannelStatus, Consumer};
use outbox_core::{
    Acknowledge, ConsumerGroup, Delivery, Destination, Error, ErrorKind, ForeignDelivery, Received, Result,
    Subscription,
};
use tracing::{debug, warn};

use crate::broker::Inner;
use crate::codec;
use crate::error::{BACKEND, Op, from_lapin};

/// A member of a consumer group: a consumer on the group's queue, on a channel of its own.
///
/// Dropping it cancels the consumer and closes the channel (in the background), which makes
/// RabbitMQ requeue everything it left unacknowledged. After the channel or connection broke,
/// [`next`](Subscription::next) returns one [`ErrorKind::Connection`] error and the following
/// call consumes again on a new channel.
pub struct AmqpSubscription {
    inner: Arc<Inner>,
    destination: Destination,
    group: ConsumerGroup,
    queue: String,
    active: Option<Active>,
}

/// The channel being consumed on, and a flag its deliveries check before they settle.
struct Active {
    channel: Channel,
    consumer: Consumer,
    closed: Arc<AtomicBool>,
}

impl AmqpSubscription {
    pub(crate) fn new(inner: Arc<Inner>, destination: Destination, group: ConsumerGroup) -> Result<Self> {
        let queue = inner.config.queue_name(&destination, &group)?;
        Ok(Self { inner, destination, group, queue, active: None })
    }

    /// The queue this subscription consumes from.
    pub fn queue(&self) -> &str {
        &self.queue
    }

    /// Declare (or check) the topology and start consuming.
    pub(crate) async fn start(&mut self) -> Result<()> {
        self.inner.declare(&self.destination, std::slice::from_ref(&self.group)).await?;
        let channel = self.inner.consumer_channel().await?;
        let qos = channel.basic_qos(self.inner.config.prefetch(), BasicQosOptions { global: false });
        if let Err(e) =
            self.inner.rpc(&self.inner.consumer, "basic.qos", qos, |e| from_lapin(e, Op::Consume, "basic.qos")).await
        {
            crate::broker::close(channel);
            return Err(e);
        }
        let what = format!("queue {}", self.queue);
        let consume = channel.basic_consume(
            self.queue.as_str().into(),
            "".into(),
            BasicConsumeOptions { no_ack: false, ..Default::default() },
            FieldTable::default(),
        );
        let consumer =
            match self.inner.rpc(&self.inner.consumer, &what, consume, |e| from_lapin(e, Op::Consume, &what)).await {
                Ok(consumer) => consumer,
                Err(e) => {
                    crate::broker::close(channel);
                    return Err(e);
                }
            };
        self.active = Some(Active { channel, consumer, closed: Arc::new(AtomicBool::new(false)) });
        Ok(())
    }

    fn stop(&mut self) {
        if let Some(Active { channel, consumer, closed }) = self.active.take() {
            // From now on this member's deliveries belong to the group again: refuse to settle
            // them, even before the channel's close has reached the server.
            closed.store(true, Ordering::SeqCst);
            cancel_then_close(channel, consumer);
        }
    }

    fn deliver(&self, delivery: lapin::message::Delivery, active: (ChannelStatus, Arc<AtomicBool>)) -> Received {
        let lapin::message::Delivery { delivery_tag, redelivered, properties, data, acker, .. } = delivery;
        let ack = Box::new(AmqpAck { acker, queue: self.queue.clone(), status: active.0, closed: active.1 });
        match codec::decode(&self.destination, &properties, data) {
            Ok(event) => {
                let attempt = codec::attempt(self.inner.config.queue_type(), &properties, redelivered);
                Received::Event(Delivery::new(event, redelivered, attempt, ack))
            }
            Err((problem, detail, data)) => {
                // Not an outbox event: handed out unacknowledged like one, so the consumer records
                // it first; `reject` (for callers that want events only) sends it to the queue's
                // dead-letter exchange, if one is configured.
                debug!(target: "outbox.amqp", queue = %self.queue, %problem, %detail, "message is not an outbox event");
                let position = format!("{}#{delivery_tag}", self.queue);
                let raw = codec::raw(&self.destination, position, &properties, data);
                Received::Foreign(ForeignDelivery::new(raw, problem, detail, redelivered, ack))
            }
        }
    }
}

#[async_trait]
impl Subscription for AmqpSubscription {
    async fn receive(&mut self, wait: Duration) -> Result<Option<Received>> {
        if self.active.is_none() {
            debug!(target: "outbox.amqp", queue = %self.queue, "consuming again after a broken channel");
            self.start().await?;
        }
        let Some(active) = self.active.as_mut() else {
            return Err(Error::transient(ErrorKind::Closed, BACKEND, "subscription is not consuming"));
        };
        let settle = (active.channel.status().clone(), active.closed.clone());
        match tokio::time::timeout(wait, active.consumer.next()).await {
            Err(_) => Ok(None),
            Ok(Some(Ok(delivery))) => Ok(Some(self.deliver(delivery, settle))),
            Ok(Some(Err(e))) => {
                self.stop();
                Err(from_lapin(e, Op::Consume, &format!("queue {}", self.queue)))
            }
            Ok(None) => {
                self.stop();
                Err(Error::transient(
                    ErrorKind::Connection,
                    BACKEND,
                    format!("the consumer on queue {} was cancelled (channel closed or queue deleted)", self.queue),
                ))
            }
        }
    }
}

/// Cancel the consumer, then close its channel, in that order, in the background.
///
/// Dropping a lapin `Consumer` sends `basic.cancel` from lapin's own task, so a channel closed
/// straight after races with it, and losing that race breaks the whole consuming connection,
/// with every other subscription on it: a `basic.cancel` that reaches RabbitMQ after the channel
/// closed is a connection error (504 `CHANNEL_ERROR`, "expected 'channel.open'"), and one that
/// lapin finds the channel already closing for is recorded as a connection error on the client.
/// Cancelling here first, and closing once the server confirmed, keeps the two in order; the
/// close is what requeues the unacknowledged deliveries.
fn cancel_then_close(channel: Channel, consumer: Consumer) {
    let Ok(handle) = tokio::runtime::Handle::try_current() else {
        // Dropped outside a runtime (its connection is going away with it): leave the cancel
        // and the close to lapin's drop handlers.
        drop(consumer);
        drop(channel);
        return;
    };
    handle.spawn(async move {
        if channel.status().connected() {
            // Marks the consumer as cancelling, so dropping it afterwards sends nothing more.
            let _ = channel.basic_cancel(consumer.tag(), BasicCancelOptions::default()).await;
        }
        drop(consumer);
        let _ = channel.close(200, "OK".into()).await;
    });
}

impl Drop for AmqpSubscription {
    fn drop(&mut self) {
        self.stop();
    }
}

impl fmt::Debug for AmqpSubscription {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AmqpSubscription")
            .field("destination", &self.destination)
            .field("group", &self.group)
            .field("queue", &self.queue)
            .field("consuming", &self.active.is_some())
            .finish()
    }
}

struct AmqpAck {
    acker: Acker,
    queue: String,
    status: ChannelStatus,
    closed: Arc<AtomicBool>,
}

impl AmqpAck {
    /// The channel is gone or going, and with it the delivery, which RabbitMQ requeues. A
    /// `basic.ack` sent now would be ignored by the server, so don't report it as done.
    fn gone(&self, what: &str) -> Error {
        Error::transient(
            ErrorKind::Closed,
            BACKEND,
            format!("cannot {what}: the channel of queue {} closed; the message will be redelivered", self.queue),
        )
    }

    fn usable(&self) -> bool {
        !self.closed.load(Ordering::SeqCst) && self.status.connected()
    }

    fn settled(&self, sent: std::result::Result<bool, lapin::Error>, what: &str) -> Result<()> {
        match sent {
            Ok(true) => Ok(()),
            // lapin did not send it: the channel closed meanwhile.
            Ok(false) => Err(self.gone(what)),
            Err(e) => Err(from_lapin(e, Op::Ack, &format!("{what} on queue {}", self.queue))),
        }
    }
}

#[async_trait]
impl Acknowledge for AmqpAck {
    async fn ack(self: Box<Self>) -> Result<()> {
        if !self.usable() {
            return Err(self.gone("ack"));
        }
        let sent = self.acker.ack(BasicAckOptions { multiple: false }).await;
        self.settled(sent, "ack")
    }

    async fn nack(self: Box<Self>) -> Result<()> {
        if !self.usable() {
            return Err(self.gone("nack"));
        }
        let sent = self.acker.nack(BasicNackOptions { multiple: false, requeue: true }).await;
        self.settled(sent, "nack")
    }

    /// `basic.reject` without requeue: to the queue's dead-letter exchange if one is configured,
    /// else dropped by RabbitMQ.
    async fn reject(self: Box<Self>) -> Result<()> {
        if !self.usable() {
            return Err(self.gone("reject"));
        }
        warn!(target: "outbox.amqp", queue = %self.queue, "rejecting a message that is not an outbox event (to the dead-letter exchange, if any)");
        let sent = self.acker.reject(BasicRejectOptions { requeue: false }).await;
        self.settled(sent, "reject")
    }
}
