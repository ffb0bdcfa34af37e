//! How long inbox markers must live.
//!
//! A marker is what makes a redelivery harmless. Deleting it before the last possible
//! redelivery reopens the effect: if a dead-letter queue keeps messages for a week, markers
//! kept for a day let a replay from that queue credit the account again. So the retention is
//! checked against the declared redelivery horizon when it is configured, and pruning goes
//! through that check.

use std::time::Duration;

use outbox_core::{Error, Result};

/// A marker retention that has been checked against the longest redelivery interval.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Retention {
    markers: Duration,
    horizon: Duration,
}

impl Retention {
    /// Check and build a retention.
    ///
    /// `max_redelivery` is the longest time after a first delivery that the broker may deliver
    /// the message again (visibility / idle / session timeouts, retries); `dead_letter_retention`
    /// is how long a dead-letter queue keeps messages that may be replayed.
    ///
    /// # Errors
    /// [`ErrorKind::Config`](outbox_core::ErrorKind::Config) when
    /// `markers < max_redelivery + dead_letter_retention`; the message names both numbers.
    pub fn new(markers: Duration, max_redelivery: Duration, dead_letter_retention: Duration) -> Result<Self> {
        let horizon = max_redelivery.saturating_add(dead_letter_retention);
        if markers < horizon {
            return Err(Error::config(
                "consumer-inbox",
                format!(
                    "unsafe marker retention: markers kept {} but a message can be redelivered up to {} after its \
                     first delivery (max redelivery interval {} + dead-letter retention {}); deleting markers earlier \
                     would let a redelivery apply its effect again",
                    human(markers),
                    human(horizon),
                    human(max_redelivery),
                    human(dead_letter_retention)
                ),
            ));
        }
        Ok(Self { markers, horizon })
    }

    /// How long markers are kept.
    pub fn markers(&self) -> Duration {
        self.markers
    }

    /// The redelivery horizon it was checked against.
    pub fn horizon(&self) -> Duration {
        self.horizon
    }
}

fn human(d: Duration) -> String {
    let s = d.as_secs();
    if s >= 86_400 && s.is_multiple_of(86_400) {
        format!("{}d ({s}s)", s / 86_400)
    } else if s >= 3600 && s.is_multiple_of(3600) {
        format!("{}h ({s}s)", s / 3600)
    } else {
        format!("{s}s")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DAY: Duration = Duration::from_secs(86_400);

    #[test]
    fn unsafe_retention_is_refused_naming_both_numbers() {
        let err = Retention::new(DAY, Duration::from_secs(3600), 7 * DAY).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("1d (86400s)") && msg.contains("604800s"), "{msg}");
        assert_eq!(err.kind(), outbox_core::ErrorKind::Config);
    }

    #[test]
    fn safe_retention_is_accepted() {
        let r = Retention::new(8 * DAY, Duration::from_secs(3600), 7 * DAY).unwrap();
        assert_eq!(r.markers(), 8 * DAY);
        assert_eq!(r.horizon(), 7 * DAY + Duration::from_secs(3600));
    }
}
