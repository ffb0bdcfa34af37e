//! Wake-up signals: how a store tells idle relays in the same process that rows were enqueued.
//!
//! Without a signal an idle relay finds new rows only when its poll timer fires, so commit →
//! publish takes up to a whole poll interval. With one, it claims as soon as the enqueue is
//! visible. A signal is a hint, never a source of truth: a relay that wakes and finds nothing
//! claimable simply waits again, and the poll stays as the safety net for what no signal covers
//! (rows written by another process without notifications, retry times coming due, expired
//! leases, a notification connection that is down).
//!
//! The hard part is not losing a signal sent between a relay's last claim and its wait. Each
//! [`Wakeup`] therefore remembers the last signal it has seen (a counter in a
//! `tokio::sync::watch` channel, hidden here so that stores and relays depend only on this
//! crate): the relay marks signals seen *before* it claims, so a signal sent while it was
//! claiming makes its next wait return at once, and one sent before the claim is covered by the
//! claim itself.

use std::fmt;
use std::sync::Arc;

use tokio::sync::watch;

/// The sending side of a wake-up signal, kept by a store.
///
/// Cheap to clone; clones signal the same subscribers. Sending never blocks and never fails,
/// with or without subscribers.
#[derive(Clone)]
pub struct WakeupSender {
    tx: Arc<watch::Sender<u64>>,
}

impl WakeupSender {
    /// A signal without subscribers yet.
    pub fn new() -> Self {
        let (tx, _) = watch::channel(0);
        Self { tx: Arc::new(tx) }
    }

    /// Tell every current subscriber that rows may have become claimable.
    ///
    /// Signals coalesce: a subscriber that has not waited yet sees several signals as one.
    pub fn notify(&self) {
        self.tx.send_modify(|n| *n = n.wrapping_add(1));
    }

    /// A new subscriber. It has seen every signal sent so far: its first
    /// [`wait`](Wakeup::wait) returns on the next [`notify`](WakeupSender::notify).
    pub fn subscribe(&self) -> Wakeup {
        Wakeup { rx: self.tx.subscribe() }
    }

    /// How many subscribers exist (for tests and diagnostics).
    pub fn subscribers(&self) -> usize {
        self.tx.receiver_count()
    }
}

impl Default for WakeupSender {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Debug for WakeupSender {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WakeupSender").field("subscribers", &self.subscribers()).finish()
    }
}

/// One relay's subscription to a store's wake-up signal; see
/// [`OutboxStore::wakeup`](crate::OutboxStore::wakeup).
///
/// The intended loop: [`mark_seen`](Wakeup::mark_seen), claim; if nothing was claimable, wait
/// for the first of [`wait`](Wakeup::wait), the poll timer and shutdown.
pub struct Wakeup {
    rx: watch::Receiver<u64>,
}

impl Wakeup {
    /// Forget the signals sent so far. Call it right before looking for work: whatever they
    /// announced is visible to that look.
    pub fn mark_seen(&mut self) {
        self.rx.borrow_and_update();
    }

    /// Whether a signal was sent since the subscription, the last [`mark_seen`](Wakeup::mark_seen)
    /// or the last completed [`wait`](Wakeup::wait). `false` once the sender is gone.
    pub fn is_signaled(&self) -> bool {
        self.rx.has_changed().unwrap_or(false)
    }

    /// Wait until a signal is sent after the subscription, the last
    /// [`mark_seen`](Wakeup::mark_seen) or the last completed `wait`; returns at once if one was
    /// sent already. Cancel safe.
    ///
    /// When the sending store is gone this never returns (so a caller racing it against a timer
    /// falls back to the timer instead of spinning).
    pub async fn wait(&mut self) {
        if self.rx.changed().await.is_err() {
            std::future::pending::<()>().await;
        }
    }
}

impl fmt::Debug for Wakeup {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Wakeup").field("signaled", &self.is_signaled()).finish()
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    async fn woke(w: &mut Wakeup) -> bool {
        tokio::time::timeout(Duration::from_secs(5), w.wait()).await.is_ok()
    }

    #[tokio::test]
    async fn a_signal_sent_before_the_wait_is_not_lost() {
        let tx = WakeupSender::new();
        let mut w = tx.subscribe();
        assert!(!w.is_signaled());
        tx.notify();
        assert!(w.is_signaled());
        assert!(woke(&mut w).await, "a signal sent before the wait must end it");
        assert!(!w.is_signaled());
    }

    #[tokio::test(start_paused = true)]
    async fn signals_before_subscribing_or_marking_seen_do_not_count() {
        let tx = WakeupSender::new();
        tx.notify();
        let mut w = tx.subscribe();
        assert!(!w.is_signaled());
        tx.notify();
        tx.notify();
        w.mark_seen();
        assert!(!w.is_signaled());
        // Paused time: the timeout elapses only because nothing else can happen.
        assert!(!woke(&mut w).await, "no signal after mark_seen, yet the wait returned");
    }

    #[tokio::test(start_paused = true)]
    async fn a_dropped_sender_never_wakes() {
        let tx = WakeupSender::new();
        let mut w = tx.subscribe();
        drop(tx);
        assert!(!w.is_signaled());
        assert!(!woke(&mut w).await, "a wait on a dropped sender must not return");
    }

    #[tokio::test]
    async fn every_subscriber_is_woken() {
        let tx = WakeupSender::new();
        let mut a = tx.subscribe();
        let mut b = tx.clone().subscribe();
        assert_eq!(tx.subscribers(), 2);
        tx.notify();
        assert!(woke(&mut a).await);
        assert!(woke(&mut b).await);
    }
}
