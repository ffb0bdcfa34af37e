//! `publish_batch`: publisher confirms over a window, with `basic.return` attributed exactly.
//!
//! A single publish keeps one message in flight per channel because lapin hands a return to
//! whichever confirm it resolves next (see `broker.rs`). A batch keeps many in flight and still
//! tells each message whether it was returned, from facts of the protocol rather than lapin's
//! pairing:
//!
//! * RabbitMQ sends the `basic.return` of a mandatory message before the `basic.ack` that
//!   confirms it, and every ack resolves one pending confirm (lapin attaches at most one waiting
//!   return to each). So once every confirm of a window has resolved, every return of the window
//!   has been handed out, attached to *some* confirm of the window (never to one of another
//!   window: a window owns its channel).
//! * A return carries the message's own properties, so its `message_id` (the event id) names the
//!   message that was returned. A window never holds two messages with the same event id.
//!
//! A missing exchange is found before the batch is sent, by a passive declaration (each exchange
//! once per broker, until a publish to it fails with 404). Sent into a window, a message to a
//! missing exchange makes the server close the channel while later messages of the window may
//! still sit in lapin's send queue; lapin (4.12) sends them after its `channel.close-ok`, and the
//! server answers a frame on a closed channel by closing the whole connection (504
//! CHANNEL_ERROR), failing every other window in flight.
//!
//! Per-key order: every event of one key on one exchange goes through one channel, in slice
//! order, and a channel is processed in order by the server.

use std::collections::{HashMap, HashSet};

use lapin::Confirmation;
use lapin::options::BasicPublishOptions;
use outbox_core::broker::skipped;
use outbox_core::{Error, ErrorKind, Event, Result};
use tracing::warn;

use crate::broker::{Inner, NO_ROUTE, Prepared, close};
use crate::error::{BACKEND, Op, from_lapin};

/// Most messages awaiting their confirm on one channel.
const WINDOW: usize = 1024;

/// The events of one channel: indices into the batch and their messages, in slice order.
struct Bucket {
    exchange: String,
    events: Vec<(usize, Prepared)>,
}

impl Inner {
    pub(crate) async fn publish_batch(&self, events: &[Event]) -> Vec<Result<()>> {
        let mut out: Vec<Option<Result<()>>> = (0..events.len()).map(|_| None).collect();
        if events.is_empty() {
            return Vec::new();
        }
        // Lane of each event: its key's, or its own for an event without a key.
        let mut keys: HashMap<&str, usize> = HashMap::new();
        let lanes: Vec<usize> = events
            .iter()
            .enumerate()
            .map(|(i, e)| match e.key.as_deref() {
                None => events.len() + i,
                Some(k) => {
                    let next = keys.len();
                    *keys.entry(k).or_insert(next)
                }
            })
            .collect();
        // Invalid events, and events to an exchange that does not exist, fail alone before
        // anything is sent; their later same-key events are not sent either.
        let frame_max = match self.connection(&self.publisher).await {
            Ok(conn) => conn.configuration().frame_max(),
            Err(e) => return events.iter().map(|_| Err(e.clone())).collect(),
        };
        let checked: Vec<Result<Prepared>> = events.iter().map(|event| self.prepare(event, frame_max)).collect();
        let missing = self.missing_exchanges(checked.iter().flatten().map(|p| p.exchange.as_str()).collect()).await;
        let mut failed_lane: HashMap<usize, String> = HashMap::new();
        let mut prepared: Vec<Option<Prepared>> = Vec::with_capacity(events.len());
        for (i, p) in checked.into_iter().enumerate() {
            if let Some(first) = failed_lane.get(&lanes[i]) {
                out[i] = Some(Err(skipped(BACKEND, first)));
                prepared.push(None);
                continue;
            }
            match p.and_then(|p| match missing.get(&p.exchange) {
                Some(e) => Err(e.clone()),
                None => Ok(p),
            }) {
                Ok(p) => prepared.push(Some(p)),
                Err(e) => {
                    out[i] = Some(Err(e));
                    failed_lane.insert(lanes[i], events[i].id.to_string());
                    prepared.push(None);
                }
            }
        }
        // Channels: per exchange, lanes spread over up to `batch_channels / exchanges`.
        let exchanges: HashSet<&str> = prepared.iter().flatten().map(|p| p.exchange.as_str()).collect();
        let per_exchange = (self.config.batch_channels() / exchanges.len().max(1)).max(1);
        let mut buckets: Vec<Bucket> = Vec::new();
        let mut bucket_of_event: Vec<usize> = Vec::with_capacity(events.len());
        {
            let mut bucket_of: HashMap<(&str, usize), usize> = HashMap::new();
            let mut lanes_of_exchange: HashMap<&str, usize> = HashMap::new();
            let mut slot_of_lane: HashMap<(&str, usize), usize> = HashMap::new();
            for (i, p) in prepared.iter().enumerate() {
                let Some(p) = p else {
                    bucket_of_event.push(usize::MAX);
                    continue;
                };
                let exchange = p.exchange.as_str();
                let slot = *slot_of_lane.entry((exchange, lanes[i])).or_insert_with(|| {
                    let n = lanes_of_exchange.entry(exchange).or_default();
                    *n += 1;
                    (*n - 1) % per_exchange
                });
                bucket_of_event.push(*bucket_of.entry((exchange, slot)).or_insert_with(|| {
                    buckets.push(Bucket { exchange: exchange.to_string(), events: Vec::new() });
                    buckets.len() - 1
                }));
            }
        }
        // Each message moves into its bucket: sent as prepared, never copied.
        for (i, p) in prepared.into_iter().enumerate() {
            if let Some(p) = p {
                buckets[bucket_of_event[i]].events.push((i, p));
            }
        }
        let done =
            futures::future::join_all(buckets.into_iter().map(|bucket| self.publish_bucket(events, &lanes, bucket)))
                .await;
        for (i, r) in done.into_iter().flatten() {
            out[i] = Some(r);
        }
        // A key stops at its first failure: later events of the key are reported `Skipped`, also
        // when they were sent in the same window (the relay re-offers them after the failed one).
        let mut first_failure: HashMap<usize, String> = HashMap::new();
        for (i, r) in out.iter_mut().enumerate() {
            let lane = lanes[i];
            if lane >= events.len() {
                continue;
            }
            if let Some(first) = first_failure.get(&lane) {
                if !matches!(r, Some(Err(e)) if e.kind() == ErrorKind::Skipped) {
                    *r = Some(Err(skipped(BACKEND, first)));
                }
            } else if matches!(r, Some(Err(_)) | None) {
                first_failure.insert(lane, events[i].id.to_string());
            }
        }
        out.into_iter().map(|r| r.unwrap_or_else(|| Err(skipped(BACKEND, "?")))).collect()
    }

    /// Publish the events of one bucket on one channel, window after window; a window ends
    /// early before an event id it already holds.
    async fn publish_bucket(&self, events: &[Event], lanes: &[usize], bucket: Bucket) -> Vec<(usize, Result<()>)> {
        let mut results = Vec::with_capacity(bucket.events.len());
        let mut failed: HashMap<usize, String> = HashMap::new();
        let mut rest = bucket.events.into_iter().peekable();
        while rest.peek().is_some() {
            let mut ids = HashSet::new();
            let mut window = Vec::new();
            while let Some((i, _)) = rest.peek() {
                if window.len() == WINDOW || !ids.insert(events[*i].id.as_str()) {
                    break;
                }
                let Some((i, p)) = rest.next() else { break };
                if let Some(first) = failed.get(&lanes[i]) {
                    results.push((i, Err(skipped(BACKEND, first))));
                } else {
                    window.push((i, p));
                }
            }
            if window.is_empty() {
                continue;
            }
            for (i, r) in self.publish_window(events, &bucket.exchange, window).await {
                if r.is_err() {
                    failed.entry(lanes[i]).or_insert_with(|| events[i].id.to_string());
                }
                results.push((i, r));
            }
        }
        results
    }

    /// Publish `window` (distinct event ids) on one channel, then await every confirm.
    async fn publish_window(
        &self,
        events: &[Event],
        exchange: &str,
        window: Vec<(usize, Prepared)>,
    ) -> Vec<(usize, Result<()>)> {
        let all = |e: Error| window.iter().map(|(i, _)| (*i, Err(e.clone()))).collect::<Vec<_>>();
        let Ok(_permit) = self.window.acquire().await else {
            return all(Error::transient(ErrorKind::Closed, BACKEND, "the broker was closed"));
        };
        let channel = match self.publish_channel().await {
            Ok(c) => c,
            Err(e) => return all(e),
        };
        let mut confirms = Vec::with_capacity(window.len());
        // Index and routing key of each message sent, in the order of `confirms`.
        let mut sent: Vec<(usize, String)> = Vec::with_capacity(window.len());
        let mut results: Vec<(usize, Result<()>)> = Vec::new();
        let mut trusted = true;
        let mut unsent: Vec<usize> = Vec::new();
        let mut unsent_error: Option<Error> = None;
        let mut window = window.into_iter();
        while let Some((i, p)) = window.next() {
            let event = &events[i];
            match channel
                .basic_publish(
                    exchange.into(),
                    p.routing_key.as_str().into(),
                    BasicPublishOptions { mandatory: true, immediate: false },
                    &event.payload,
                    p.properties,
                )
                .await
            {
                Ok(confirm) => {
                    confirms.push(confirm);
                    sent.push((i, p.routing_key));
                }
                Err(e) => {
                    // Nothing of this message reached the server, nor will any later one on this
                    // channel: the rest of the window is not sent.
                    unsent = std::iter::once(i).chain(window.by_ref().map(|(j, _)| j)).collect();
                    unsent_error = Some(from_lapin(e, Op::Publish, &format!("event {} to {exchange}", event.id)));
                    trusted = false;
                    break;
                }
            }
        }
        let waited = tokio::time::timeout(self.config.confirm_timeout(), futures::future::join_all(confirms)).await;
        let Ok(outcomes) = waited else {
            close(channel);
            if let Some(err) = unsent_error {
                results.extend(unsent.into_iter().map(|i| (i, Err(err.clone()))));
            }
            for (i, _) in sent {
                results.push((
                    i,
                    Err(Error::outcome_unknown(
                        ErrorKind::Timeout,
                        BACKEND,
                        format!(
                            "no publisher confirm for event {} on exchange {exchange} within {:?}; it may or may not \
                             have been routed",
                            events[i].id,
                            self.config.confirm_timeout()
                        ),
                    )),
                ));
            }
            return results;
        };
        // The messages not sent because the server closed the channel under the window: they
        // go to the same exchange as the message that made it close, so they share its error
        // (a missing exchange: `Unroutable`); else the error of sending.
        if let Some(err) = unsent_error {
            let cause = outcomes.iter().find_map(|o| o.as_ref().err()).cloned();
            let err = match cause {
                Some(e) => {
                    from_lapin(e, Op::Confirm, &format!("a message to {exchange}; the rest of the window was not sent"))
                }
                None => err,
            };
            results.extend(unsent.iter().map(|&i| (i, Err(err.clone()))));
        }
        // Every return of the window, by the event id it carries.
        let mut returned: HashMap<String, (u16, String)> = HashMap::new();
        for outcome in &outcomes {
            match outcome {
                Ok(Confirmation::Ack(Some(r)) | Confirmation::Nack(Some(r))) => {
                    let id = r.properties.message_id().as_ref().map(|s| s.as_str().to_string()).unwrap_or_default();
                    returned.insert(id, (r.reply_code, r.reply_text.as_str().to_string()));
                }
                Ok(Confirmation::NotRequested) | Err(_) => trusted = false,
                Ok(_) => {}
            }
        }
        for ((i, routing_key), outcome) in sent.into_iter().zip(outcomes) {
            let event = &events[i];
            let r = match (returned.get(event.id.as_str()), outcome) {
                (_, Err(e)) => {
                    let err = from_lapin(e, Op::Confirm, &format!("event {} to {exchange}", event.id));
                    if err.kind() == ErrorKind::Unroutable {
                        // The exchange was deleted after it was checked: check it again next time.
                        self.forget_exchange(exchange);
                    }
                    warn!(target: "outbox.amqp", event_id = %event.id, error = %err, "publish failed");
                    Err(err)
                }
                (_, Ok(Confirmation::NotRequested)) => Err(Error::outcome_unknown(
                    ErrorKind::Rejected,
                    BACKEND,
                    format!("publish of event {} got no confirm: the channel is not in confirm mode", event.id),
                )),
                (Some((code, text)), Ok(_)) if *code == NO_ROUTE => Err(Error::transient(
                    ErrorKind::Unroutable,
                    BACKEND,
                    format!(
                        "event {} is unroutable: exchange {exchange} has no queue bound for routing key \
                         {routing_key:?} (the broker returned it: {code} {text})",
                        event.id
                    ),
                )),
                (Some((code, text)), Ok(_)) => Err(Error::transient(
                    ErrorKind::Rejected,
                    BACKEND,
                    format!("event {} was returned by exchange {exchange}: {code} {text}", event.id),
                )),
                (None, Ok(Confirmation::Nack(None))) => Err(Error::transient(
                    ErrorKind::Rejected,
                    BACKEND,
                    format!("the broker refused event {} (publisher nack from exchange {exchange})", event.id),
                )),
                (None, Ok(_)) => Ok(()),
            };
            results.push((i, r));
        }
        if trusted {
            self.recycle(channel);
        } else {
            // A failed or unsure channel may still deliver a late return: never reuse it.
            close(channel);
        }
        results
    }
}
