//! The seeded schedule: every fault, bad input and producer choice of a run follows from the seed,
//! so a failing run can be replayed with `--seed`. Only the timing of real processes and servers
//! varies between two runs of the same seed.

use std::fmt;
use std::time::Duration;

use outbox::core::rng::SplitMix64;

/// A kind of fault the runner injects. Each has its own row in the table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) enum Family {
    /// SIGKILL of an `outbox relay` process, restarted after a short delay.
    RelayKill,
    /// SIGKILL of a consumer process, restarted after a short delay.
    ConsumerKill,
    /// Restart of the broker server (Redis, tansu, RabbitMQ).
    BrokerRestart,
    /// Restart of the PostgreSQL server.
    PgRestart,
    /// Every open connection through one fault proxy closed at once.
    ProxyCut,
    /// One fault proxy forwards nothing for a while; connections stay open.
    ProxyStall,
    /// One fault proxy accepts but answers nothing for a while, then closes what it held.
    ProxyBlackhole,
}

impl Family {
    /// Stable name (table, JSON).
    pub(crate) fn name(self) -> &'static str {
        match self {
            Family::RelayKill => "relay-kill",
            Family::ConsumerKill => "consumer-kill",
            Family::BrokerRestart => "broker-restart",
            Family::PgRestart => "postgres-restart",
            Family::ProxyCut => "proxy-cut",
            Family::ProxyStall => "proxy-stall",
            Family::ProxyBlackhole => "proxy-blackhole",
        }
    }
}

impl fmt::Display for Family {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// How many faults of each family a run schedules: at least the minimum, more on a long window.
#[derive(Debug, Clone, Copy)]
pub(crate) struct FamilyPlan {
    /// The family.
    pub(crate) family: Family,
    /// The minimum per combination run (a run below it fails).
    pub(crate) minimum: u32,
    /// One fault per this much of the window, when that gives more than the minimum.
    pub(crate) every: Duration,
}

/// The families' plans; PostgreSQL restarts only where PostgreSQL is the store.
pub(crate) fn plans(has_pg: bool) -> Vec<FamilyPlan> {
    let p = |family, minimum, every_s: u64| FamilyPlan { family, minimum, every: Duration::from_secs(every_s) };
    let mut out = vec![
        p(Family::RelayKill, 20, 20),
        p(Family::ConsumerKill, 10, 40),
        p(Family::BrokerRestart, 5, 120),
        p(Family::ProxyCut, 4, 45),
        p(Family::ProxyStall, 3, 60),
        p(Family::ProxyBlackhole, 3, 90),
    ];
    if has_pg {
        out.insert(3, p(Family::PgRestart, 5, 120));
    }
    out
}

/// Which proxy a proxy fault hits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ProxyTarget {
    /// The broker's proxy.
    Broker,
    /// PostgreSQL's proxy.
    Postgres,
}

/// One scheduled fault.
#[derive(Debug, Clone)]
pub(crate) struct Fault {
    /// Offset from the start of the window.
    pub(crate) at: Duration,
    /// Family.
    pub(crate) family: Family,
    /// Relay or consumer index for kills.
    pub(crate) index: usize,
    /// Proxy for proxy faults.
    pub(crate) proxy: ProxyTarget,
    /// Restart delay after a kill; stall or black-hole length.
    pub(crate) hold: Duration,
}

/// A bad input mixed into the stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Bad {
    /// An event whose handler always fails.
    Poison,
    /// A message with no event id, written to the broker with its driver.
    Foreign,
    /// A 10 MB header value: refused by enqueue, then inserted behind validation's back.
    Oversized,
}

/// The whole schedule of one combination run.
#[derive(Debug, Clone)]
pub(crate) struct Schedule {
    /// Faults in time order.
    pub(crate) faults: Vec<Fault>,
    /// Bad inputs and when they go in.
    pub(crate) bad: Vec<(Duration, Bad)>,
    /// The seed the producers draw keys from.
    pub(crate) producer_seed: u64,
}

/// The schedule for `seed` (already mixed with the combination), `window` long.
pub(crate) fn build(seed: u64, window: Duration, has_pg: bool, relays: usize, consumers: usize) -> Schedule {
    let mut rng = SplitMix64::new(seed);
    let ms = |d: Duration| d.as_millis() as u64;
    let span = |rng: &mut SplitMix64, lo: u64, hi: u64| Duration::from_millis(lo + rng.below(hi - lo + 1));
    // Faults go into the first 90% of the window; the producers still run after the last one.
    let usable = ms(window) * 9 / 10;
    let lead = ms(window) / 20;
    let mut faults = Vec::new();
    for plan in plans(has_pg) {
        let by_rate = (ms(window) / ms(plan.every).max(1)) as u32;
        let n = plan.minimum.max(by_rate) as u64;
        // Evenly spread slots, each fault at a random point inside its slot.
        for i in 0..n {
            let slot = usable.saturating_sub(lead) / n;
            let at = lead + i * slot + slot / 10 + rng.below((slot * 8 / 10).max(1));
            let proxy = if has_pg && rng.below(2) == 0 { ProxyTarget::Postgres } else { ProxyTarget::Broker };
            let (index, hold) = match plan.family {
                Family::RelayKill => (rng.below(relays as u64) as usize, span(&mut rng, 200, 1500)),
                Family::ConsumerKill => (rng.below(consumers as u64) as usize, span(&mut rng, 200, 1500)),
                Family::ProxyStall => (0, span(&mut rng, 500, 2500)),
                Family::ProxyBlackhole => (0, span(&mut rng, 1000, 3000)),
                _ => (0, Duration::ZERO),
            };
            faults.push(Fault { at: Duration::from_millis(at), family: plan.family, index, proxy, hold });
        }
    }
    faults.sort_by_key(|f| (f.at, f.family));
    // Bad inputs in the middle half of the window, when everything is under load.
    let mut bad: Vec<(Duration, Bad)> = [Bad::Poison, Bad::Foreign, Bad::Oversized]
        .into_iter()
        .map(|b| (Duration::from_millis(ms(window) / 4 + rng.below(ms(window) / 2 + 1)), b))
        .collect();
    bad.sort_by_key(|(at, _)| *at);
    Schedule { faults, bad, producer_seed: rng.next_u64() }
}

/// Mix a run seed with a combination name, so each combination has its own schedule and a run
/// of one combination replays exactly as it ran among all four.
pub(crate) fn combo_seed(seed: u64, combo: &str) -> u64 {
    let mut h = seed ^ 0x9e37_79b9_7f4a_7c15;
    for b in combo.bytes() {
        h = SplitMix64::new(h ^ u64::from(b)).next_u64();
    }
    h
}

/// A short fingerprint of a schedule, printed so that two runs can be compared at a glance.
pub(crate) fn digest(s: &Schedule) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |v: u64| {
        for b in v.to_le_bytes() {
            h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
    };
    for f in &s.faults {
        eat(f.at.as_millis() as u64);
        eat(f.family as u64);
        eat(f.index as u64);
        eat(f.hold.as_millis() as u64);
        eat(f.proxy as u64);
    }
    for (at, b) in &s.bad {
        eat(at.as_millis() as u64);
        eat(*b as u64);
    }
    eat(s.producer_seed);
    format!("{h:016x}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_same_schedule_and_minimums_met() {
        let w = Duration::from_secs(40);
        let a = build(7, w, true, 3, 2);
        let b = build(7, w, true, 3, 2);
        assert_eq!(digest(&a), digest(&b));
        assert_ne!(digest(&a), digest(&build(8, w, true, 3, 2)));
        for plan in plans(true) {
            let n = a.faults.iter().filter(|f| f.family == plan.family).count() as u32;
            assert!(n >= plan.minimum, "{}: {n}", plan.family);
        }
        assert!(a.faults.iter().all(|f| f.at < w));
        assert!(!build(7, w, false, 3, 2).faults.iter().any(|f| f.family == Family::PgRestart));
        assert_ne!(combo_seed(1, "pg-redis"), combo_seed(1, "pg-amqp"));
    }

    #[test]
    fn long_windows_scale_up() {
        let s = build(1, Duration::from_secs(1800), true, 3, 2);
        assert_eq!(s.faults.iter().filter(|f| f.family == Family::RelayKill).count(), 90);
        assert!(s.faults.iter().all(|f| f.at < Duration::from_secs(1800)));
    }
}
