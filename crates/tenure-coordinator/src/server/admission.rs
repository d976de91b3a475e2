//! Admission of joins on the leader: a cap on the workers with a session, and a rate.
//!
//! Every join is a log entry, a session row in every replica and a placement pass, so a client
//! that joins in a loop (a bug, or a stolen worker certificate) must not be able to grow the
//! table without bound or crowd out the renewals that keep every other worker's leases. Both
//! limits are the leader's own and are checked before anything is proposed: a refused join
//! never becomes a log entry. They are admission control, not safety: nothing in the state
//! machine depends on them, which is why they are node settings and not replicated state.
//!
//! The invariants kept here: the workers with a live session, plus the joins admitted and not
//! yet applied, never exceed `max_sessions` (a join under a name that already has a session
//! replaces it and is always admitted); and over any interval `t`, at most
//! `join_burst + joins_per_second * t` joins are admitted.

use super::CoordinatorError;
use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// The leader's limits on joins (see the module documentation).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct JoinLimits {
    /// Most worker names with a live session, cluster-wide.
    pub max_sessions: usize,
    /// Joins admitted per second, sustained.
    pub joins_per_second: u32,
    /// Joins admitted at once after a quiet spell (a fleet starting up).
    pub join_burst: u32,
}

impl Default for JoinLimits {
    fn default() -> Self {
        JoinLimits { max_sessions: 100_000, joins_per_second: 2_000, join_burst: 10_000 }
    }
}

/// A token bucket: `burst` tokens at most, refilled at `per_second`. Time is passed in, so the
/// arithmetic is tested without a clock.
#[derive(Debug)]
struct Bucket {
    tokens: f64,
    last: Instant,
}

impl Bucket {
    fn full(burst: u32, now: Instant) -> Bucket {
        Bucket { tokens: f64::from(burst), last: now }
    }

    /// Takes one token if there is one at `now`.
    fn take(&mut self, now: Instant, per_second: u32, burst: u32) -> bool {
        let elapsed = now.saturating_duration_since(self.last);
        self.last = self.last.max(now);
        self.tokens = (self.tokens + elapsed.as_secs_f64() * f64::from(per_second)).min(f64::from(burst));
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            true
        } else {
            false
        }
    }
}

/// The leader's admission state: the bucket and the names of joins admitted but not yet
/// applied.
#[derive(Debug)]
pub(crate) struct Admission {
    limits: JoinLimits,
    bucket: Mutex<Bucket>,
    pending: Arc<Mutex<BTreeSet<String>>>,
}

/// A join admitted and in flight; its place under the session cap is released when dropped
/// (the join applied, or failed).
#[derive(Debug)]
pub(crate) struct Admitted {
    name: Option<String>,
    pending: Arc<Mutex<BTreeSet<String>>>,
}

impl Drop for Admitted {
    fn drop(&mut self) {
        if let Some(name) = self.name.take() {
            self.pending.lock().expect("admission lock poisoned").remove(&name);
        }
    }
}

impl Admission {
    pub(crate) fn new(limits: JoinLimits) -> Admission {
        Admission {
            limits,
            bucket: Mutex::new(Bucket::full(limits.join_burst, Instant::now())),
            pending: Arc::default(),
        }
    }

    /// Admits a join under `name` at `now`, given whether the name already has a live session
    /// and how many names do (read from the applied table). The session cap is checked first,
    /// so a refused join spends no token.
    pub(crate) fn admit(
        &self,
        name: &str,
        has_session: bool,
        live_names: usize,
        now: Instant,
    ) -> Result<Admitted, CoordinatorError> {
        let limit = self.limits.max_sessions;
        let mut pending = self.pending.lock().expect("admission lock poisoned");
        let new_name = !has_session && !pending.contains(name);
        if new_name && live_names + pending.len() >= limit {
            return Err(CoordinatorError::TooManySessions { limit });
        }
        let (rate, burst) = (self.limits.joins_per_second, self.limits.join_burst);
        if !self.bucket.lock().expect("admission lock poisoned").take(now, rate, burst) {
            return Err(CoordinatorError::TooManyJoins { per_second: rate });
        }
        let name = new_name.then(|| {
            pending.insert(name.to_string());
            name.to_string()
        });
        Ok(Admitted { name, pending: self.pending.clone() })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn the_bucket_admits_a_burst_then_the_rate() {
        let start = Instant::now();
        let mut bucket = Bucket::full(3, start);
        let taken = (0..10).filter(|_| bucket.take(start, 10, 3)).count();
        assert_eq!(taken, 3, "the burst, then nothing at the same instant");
        // A tenth of a second later, at 10 per second: one more.
        let later = start + Duration::from_millis(100);
        assert!(bucket.take(later, 10, 3));
        assert!(!bucket.take(later, 10, 3));
        // A long quiet spell refills to the burst, not beyond.
        let much_later = later + Duration::from_secs(60);
        assert_eq!((0..10).filter(|_| bucket.take(much_later, 10, 3)).count(), 3);
        // A clock reading from before the last one takes nothing extra.
        assert!(!bucket.take(start, 10, 3));
    }

    #[test]
    fn the_session_cap_counts_joins_in_flight_and_lets_a_name_rejoin() {
        let limits = JoinLimits { max_sessions: 2, joins_per_second: 1000, join_burst: 1000 };
        let admission = Admission::new(limits);
        let now = Instant::now();
        let a = admission.admit("a", false, 0, now).expect("room for a");
        let b = admission.admit("b", false, 0, now).expect("room for b");
        // Two joins in flight fill the cap, though neither has applied yet.
        let refused = admission.admit("c", false, 0, now).unwrap_err();
        assert_eq!(refused, CoordinatorError::TooManySessions { limit: 2 });
        // A name that already has a session replaces it: always admitted.
        admission.admit("a", true, 2, now).expect("a rejoins");
        // A join applied (its ticket dropped) is counted by the table from then on.
        drop(a);
        assert!(admission.admit("c", false, 2, now).is_err());
        drop(b);
        admission.admit("c", false, 1, now).expect("b's session ended: room for c");
    }

    #[test]
    fn a_join_refused_by_the_cap_spends_no_token() {
        let limits = JoinLimits { max_sessions: 1, joins_per_second: 1, join_burst: 1 };
        let admission = Admission::new(limits);
        let now = Instant::now();
        assert!(admission.admit("x", false, 1, now).is_err(), "the cap is full");
        let admitted = admission.admit("x", true, 1, now).expect("the token is still there");
        drop(admitted);
        let refused = admission.admit("x", true, 1, now).unwrap_err();
        assert_eq!(refused, CoordinatorError::TooManyJoins { per_second: 1 });
    }
}
