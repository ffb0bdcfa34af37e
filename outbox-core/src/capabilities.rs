//! What a broker can tell and guarantee, asked at run time instead of read from a README.
//!
//! Brokers differ in ways a relay, a consumer or a test suite must plan around: RabbitMQ knows
//! that a message has no route and Redis cannot; Redis and RabbitMQ quorum queues count
//! deliveries and Kafka does not. Code that depends on such a property asks
//! [`Broker::capabilities`](crate::Broker::capabilities) and decides, instead of hard-coding
//! backend names. The README's capability table is checked against these values by a test, so
//! the two cannot drift apart.
//!
//! The struct is `#[non_exhaustive]`: a new property is a new field (defaulting to "not
//! promised"), which breaks no user. Build one with [`Capabilities::none`] and the `with_*`
//! setters.

/// What a broker promises. Every flag defaults to `false` ("not promised"), so a broker that
/// does not override [`Broker::capabilities`](crate::Broker::capabilities) promises nothing
/// beyond the trait's contract.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub struct Capabilities {
    /// A publish to a destination nothing can receive fails with
    /// [`ErrorKind::Unroutable`](crate::ErrorKind::Unroutable) instead of succeeding.
    pub detects_unroutable: bool,
    /// [`Delivery::attempt`](crate::Delivery::attempt) carries the broker's delivery count.
    pub delivery_count: bool,
    /// [`Delivery::redelivered`](crate::Delivery::redelivered) is set on every redelivery,
    /// including one to another member of the group.
    pub redelivery_flag: bool,
    /// [`Delivery::nack`](crate::Delivery::nack) makes the message come back to the group.
    pub nack_redelivers: bool,
    /// Events with the same key reach the group's members in publish order even with several
    /// members (redeliveries aside).
    pub per_key_ordering: bool,
    /// Largest payload a publish accepts, in bytes, where the adapter knows it (its configured
    /// limit); larger ones fail with [`ErrorKind::TooLarge`](crate::ErrorKind::TooLarge).
    pub max_payload: Option<usize>,
}

impl Capabilities {
    /// Nothing promised (the same as `Default`).
    pub const fn none() -> Self {
        Self {
            detects_unroutable: false,
            delivery_count: false,
            redelivery_flag: false,
            nack_redelivers: false,
            per_key_ordering: false,
            max_payload: None,
        }
    }

    /// Set [`detects_unroutable`](Self::detects_unroutable).
    #[must_use]
    pub const fn with_detects_unroutable(mut self, yes: bool) -> Self {
        self.detects_unroutable = yes;
        self
    }

    /// Set [`delivery_count`](Self::delivery_count).
    #[must_use]
    pub const fn with_delivery_count(mut self, yes: bool) -> Self {
        self.delivery_count = yes;
        self
    }

    /// Set [`redelivery_flag`](Self::redelivery_flag).
    #[must_use]
    pub const fn with_redelivery_flag(mut self, yes: bool) -> Self {
        self.redelivery_flag = yes;
        self
    }

    /// Set [`nack_redelivers`](Self::nack_redelivers).
    #[must_use]
    pub const fn with_nack_redelivers(mut self, yes: bool) -> Self {
        self.nack_redelivers = yes;
        self
    }

    /// Set [`per_key_ordering`](Self::per_key_ordering).
    #[must_use]
    pub const fn with_per_key_ordering(mut self, yes: bool) -> Self {
        self.per_key_ordering = yes;
        self
    }

    /// Set [`max_payload`](Self::max_payload).
    #[must_use]
    pub const fn with_max_payload(mut self, bytes: Option<usize>) -> Self {
        self.max_payload = bytes;
        self
    }

    /// `true` when the broker reports redeliveries in some form (a delivery count or a
    /// redelivered flag): what the conformance suite's `RedeliveryInfo` capability means.
    pub const fn reports_redelivery(&self) -> bool {
        self.delivery_count || self.redelivery_flag
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_promises_nothing_and_setters_set() {
        assert_eq!(Capabilities::default(), Capabilities::none());
        let c = Capabilities::none().with_delivery_count(true).with_max_payload(Some(10));
        assert!(c.delivery_count && c.reports_redelivery());
        assert_eq!(c.max_payload, Some(10));
        assert!(!Capabilities::none().reports_redelivery());
    }
}
