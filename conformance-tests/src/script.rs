//! Actions of the interpreter and their text form.
//!
//! A path is a list of actions; its text form (`claim(A) send(A) crash(A) expire ...`) is what
//! a counterexample prints and what [`crate::replay`] reads back, so any failure can be re-run
//! exactly.

use std::fmt;
use std::str::FromStr;

/// One of the two relays of a scenario.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum RelayId {
    /// Relay A.
    A,
    /// Relay B.
    B,
}

impl RelayId {
    /// Both relays.
    pub const ALL: [RelayId; 2] = [RelayId::A, RelayId::B];

    pub(crate) fn index(self) -> usize {
        match self {
            Self::A => 0,
            Self::B => 1,
        }
    }
}

/// A durable-state assertion checked in the middle of a script.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Check {
    /// Committed effect rows for the event at this index.
    Effects(usize, usize),
    /// Whether the consumer's inbox marker for the event at this index is committed.
    Marker(usize, bool),
    /// The last completion of this relay was `published` (true) or fenced (false).
    Completed(RelayId, bool),
}

/// One step of a scenario.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// The relay claims a batch (up to 2 rows).
    Claim(RelayId),
    /// The relay publishes its next unsent row.
    Send(RelayId),
    /// The relay completes every sent row of its batch.
    Complete(RelayId),
    /// The relay publishes its next row, but the broker's acknowledgement is lost: the relay
    /// records a failure (the message is on the broker nonetheless).
    LoseConfirm(RelayId),
    /// The relay crashes: it runs no further steps; its leases stay until they expire.
    CrashRelay(RelayId),
    /// Time passes beyond every lease (the manual clock moves).
    Expire,
    /// The consumer receives the next delivery.
    Receive,
    /// The consumer opens its transaction and applies the guard (marker / version).
    Guard,
    /// The consumer runs the effect in that transaction.
    Apply,
    /// `Receive`, `Guard` and `Apply` in one step (used by the exploration).
    Consume,
    /// The consumer commits marker and effect.
    Commit,
    /// The consumer acknowledges the delivery.
    Ack,
    /// The consumer's acknowledgement is lost: the delivery stays unacknowledged.
    LoseAck,
    /// The consumer crashes: open transaction rolled back, unacknowledged deliveries return.
    CrashConsumer,
    /// Publish the event at this index straight to the broker, bypassing the outbox (a
    /// duplicate or foreign producer); with `Some(payload)` a different payload under the same id.
    Inject(usize, Option<String>),
    /// Check durable state now.
    Check(Check),
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Claim(r) => write!(f, "claim({r:?})"),
            Self::Send(r) => write!(f, "send({r:?})"),
            Self::Complete(r) => write!(f, "complete({r:?})"),
            Self::LoseConfirm(r) => write!(f, "lose-confirm({r:?})"),
            Self::CrashRelay(r) => write!(f, "crash({r:?})"),
            Self::Expire => f.write_str("expire"),
            Self::Receive => f.write_str("receive"),
            Self::Guard => f.write_str("guard"),
            Self::Apply => f.write_str("apply"),
            Self::Consume => f.write_str("consume"),
            Self::Commit => f.write_str("commit"),
            Self::Ack => f.write_str("ack"),
            Self::LoseAck => f.write_str("lose-ack"),
            Self::CrashConsumer => f.write_str("crash(C)"),
            Self::Inject(i, None) => write!(f, "inject({i})"),
            Self::Inject(i, Some(p)) => write!(f, "inject({i},{p})"),
            Self::Check(Check::Effects(i, n)) => write!(f, "check-effects({i},{n})"),
            Self::Check(Check::Marker(i, b)) => write!(f, "check-marker({i},{b})"),
            Self::Check(Check::Completed(r, b)) => write!(f, "check-completed({r:?},{b})"),
        }
    }
}

/// Text form of a path: actions separated by spaces.
pub fn path_to_string(path: &[Action]) -> String {
    path.iter().map(ToString::to_string).collect::<Vec<_>>().join(" ")
}

fn relay(s: &str) -> Result<RelayId, String> {
    match s {
        "A" => Ok(RelayId::A),
        "B" => Ok(RelayId::B),
        _ => Err(format!("unknown relay {s:?} (A or B)")),
    }
}

impl FromStr for Action {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let (name, args) = match s.split_once('(') {
            Some((n, rest)) => (n, rest.strip_suffix(')').ok_or_else(|| format!("missing ')' in {s:?}"))?),
            None => (s, ""),
        };
        let num = |a: &str| a.parse::<usize>().map_err(|e| format!("{s:?}: {e}"));
        let flag = |a: &str| a.parse::<bool>().map_err(|e| format!("{s:?}: {e}"));
        let two = || args.split_once(',').ok_or_else(|| format!("{s:?} needs two arguments"));
        Ok(match name {
            "claim" => Self::Claim(relay(args)?),
            "send" => Self::Send(relay(args)?),
            "complete" => Self::Complete(relay(args)?),
            "lose-confirm" => Self::LoseConfirm(relay(args)?),
            "crash" if args == "C" => Self::CrashConsumer,
            "crash" => Self::CrashRelay(relay(args)?),
            "expire" => Self::Expire,
            "receive" => Self::Receive,
            "guard" => Self::Guard,
            "apply" => Self::Apply,
            "consume" => Self::Consume,
            "commit" => Self::Commit,
            "ack" => Self::Ack,
            "lose-ack" => Self::LoseAck,
            "inject" => match args.split_once(',') {
                Some((i, p)) => Self::Inject(num(i)?, Some(p.to_string())),
                None => Self::Inject(num(args)?, None),
            },
            "check-effects" => {
                let (i, n) = two()?;
                Self::Check(Check::Effects(num(i)?, num(n)?))
            }
            "check-marker" => {
                let (i, b) = two()?;
                Self::Check(Check::Marker(num(i)?, flag(b)?))
            }
            "check-completed" => {
                let (r, b) = two()?;
                Self::Check(Check::Completed(relay(r)?, flag(b)?))
            }
            _ => return Err(format!("unknown action {s:?}")),
        })
    }
}

/// Parse the text form of a path.
///
/// # Errors
/// The first action that does not parse.
pub fn parse_path(text: &str) -> Result<Vec<Action>, String> {
    text.split_whitespace().map(str::parse).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_form_round_trips() {
        let path = vec![
            Action::Claim(RelayId::A),
            Action::LoseConfirm(RelayId::B),
            Action::CrashConsumer,
            Action::CrashRelay(RelayId::A),
            Action::Inject(2, Some("credit:x:9".into())),
            Action::Check(Check::Completed(RelayId::A, false)),
            Action::Check(Check::Marker(0, true)),
            Action::LoseAck,
        ];
        assert_eq!(parse_path(&path_to_string(&path)).unwrap(), path);
        assert!(parse_path("claim(C)").is_err());
    }
}
