//! The suite against the in-memory reference backends: the model every real backend is compared
//! with, and the worked example of a harness.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use outbox_core::memory::{MemoryBroker, MemoryInbox, MemoryOutbox, MemoryTx};
use outbox_core::{Destination, Error, ErrorKind, EventId, ManualClock, ParkedHead, Result};

use crate::harness::{Capabilities, Capability, EffectRow, EffectTable, Fixture, Harness};

/// Encode an effect row for an in-memory table.
pub fn encode_effect(row: &EffectRow) -> Vec<u8> {
    format!("{}\t{}\t{}\t{}", row.consumer, row.event_id, row.subject, row.value).into_bytes()
}

/// Decode [`encode_effect`].
///
/// # Errors
/// [`ErrorKind::Corrupt`] on anything else.
pub fn decode_effect(bytes: &[u8]) -> Result<EffectRow> {
    let bad = || Error::permanent(ErrorKind::Corrupt, "memory", "bad effect row");
    let text = std::str::from_utf8(bytes).map_err(|_| bad())?;
    let mut p = text.split('\t');
    let (Some(c), Some(id), Some(s), Some(v)) = (p.next(), p.next(), p.next(), p.next()) else { return Err(bad()) };
    Ok(EffectRow {
        consumer: c.into(),
        event_id: EventId::new(id)?,
        subject: s.into(),
        value: v.parse().map_err(|_| bad())?,
    })
}

/// The effect table on a [`MemoryInbox`]: rows appended in the inbox transaction.
pub struct MemoryEffects(pub MemoryInbox);

#[async_trait]
impl EffectTable<MemoryInbox> for MemoryEffects {
    async fn insert(&self, tx: &mut MemoryTx, row: &EffectRow) -> Result<()> {
        tx.insert("effects", encode_effect(row));
        Ok(())
    }

    async fn rows(&self) -> Result<Vec<EffectRow>> {
        self.0.table("effects").iter().map(|r| decode_effect(r)).collect()
    }
}

/// Harness over [`MemoryOutbox`], [`MemoryBroker`] and [`MemoryInbox`].
#[derive(Debug, Clone, Copy, Default)]
pub struct MemoryHarness;

/// The capabilities of the in-memory broker.
pub fn memory_capabilities() -> Capabilities {
    Capabilities {
        present: {
            let mut present =
                Capability::present_in(&outbox_core::Broker::capabilities(&outbox_core::memory::MemoryBroker::new()));
            // The memory harnesses write raw entries with `MemoryBroker::publish_raw`.
            present.push(Capability::ForeignMessages);
            // A delivery stays with its subscription until settled or the subscription drops.
            present.push(Capability::HeldWhileLive);
            present
        },
        delivery_wait: Duration::ZERO,
        sampled_iterations: 200,
        exhaustive: true,
    }
}

#[async_trait]
impl Harness for MemoryHarness {
    type Inbox = MemoryInbox;

    fn name(&self) -> String {
        "memory store + memory broker + memory inbox".into()
    }

    fn capabilities(&self) -> Capabilities {
        let mut caps = memory_capabilities();
        caps.present.push(Capability::ParkedHeadSkip);
        caps
    }

    async fn fixture(&self, case: &str, clock: ManualClock) -> Result<Fixture<MemoryInbox>> {
        self.fixture_with_parked_head(case, clock, ParkedHead::Block).await
    }

    async fn fixture_with_parked_head(
        &self,
        _case: &str,
        clock: ManualClock,
        parked_head: ParkedHead,
    ) -> Result<Fixture<MemoryInbox>> {
        let inbox = MemoryInbox::new(Arc::new(clock.clone()));
        let broker = MemoryBroker::new();
        let mut fx = Fixture::new(
            Arc::new(MemoryOutbox::new(Arc::new(clock)).with_parked_head(parked_head)),
            Arc::new(broker.clone()),
            inbox.clone(),
            Arc::new(MemoryEffects(inbox)),
            Destination::new("suite")?,
        );
        fx.foreign = Some(Arc::new(crate::harness::MemoryForeign(broker)));
        Ok(fx)
    }
}
