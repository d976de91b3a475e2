//! What a worker believes it holds, and until when: the worker's half of "one believer" as one
//! pure type.
//!
//! Every rule of belief lives here, driven by instants passed in and never by a clock read, so
//! the worker library's tasks and the model simulation (`tenure-testkit`) run the very same
//! code and cannot drift apart:
//! - a grant is believed until `sent + ttl - margin`, where `sent` is when the heartbeat that
//!   confirmed it left; a later heartbeat moves that instant forward, never back;
//! - a grant announced by the ownership stream is believed only once a heartbeat *sent after*
//!   the announcement confirms it;
//! - a grant given up (released, revoked, lost, fenced) is never believed again; only a lease
//!   that ran out locally may come back, through a heartbeat sent after it ran out;
//! - a withdrawal (release, leave, drop) ends belief at once, before the caller tells the
//!   coordinator anything.
//!
//! Each call returns the [`Change`]s it made to what the application may believe, in order; the
//! caller turns them into events and cancellations (the library) or history records (the model).

use crate::ids::{FencingToken, PartitionId};
use std::collections::BTreeMap;
use std::time::Duration;
use tokio::time::Instant;

/// Why a partition was lost, as carried by [`crate::worker::WorkerEvent::Lost`].
///
/// ```
/// use tenure_worker::LostReason;
/// fn describe(reason: LostReason) -> &'static str {
///     match reason {
///         LostReason::DeadlineExpired => "no renewal was confirmed in time",
///         LostReason::Expired => "the coordinator expired the lease",
///         LostReason::Fenced => "storage has seen a newer owner",
///         LostReason::SessionEnded => "the session is over",
///     }
/// }
/// assert_eq!(describe(LostReason::Fenced), "storage has seen a newer owner");
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LostReason {
    /// The local lease ran out before a renewal confirmed it (coordinator unreachable, or a
    /// revoking partition not released in time).
    DeadlineExpired,
    /// The coordinator took it away (its lease expired there).
    Expired,
    /// The fenced store saw a newer owner: this worker's token is stale.
    Fenced,
    /// The session itself ended.
    SessionEnded,
}

/// How a believed grant ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum End {
    /// Given back by this worker.
    Released,
    Lost(LostReason),
}

/// A change to what the application may believe. Only grants a heartbeat confirmed are
/// reported, except [`Change::Announced`], which asks for a heartbeat to confirm one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Change {
    /// The stream named a grant not yet believed: a heartbeat sent from now on may confirm it.
    Announced { partition: PartitionId, token: FencingToken },
    /// Confirmed for the first time: believed until `valid_until`.
    Granted { partition: PartitionId, token: FencingToken, valid_until: Instant },
    /// Being moved away: no longer believed; finish and release.
    Revoking { partition: PartitionId, token: FencingToken },
    /// No longer held.
    Ended { partition: PartitionId, token: FencingToken, end: End },
    /// The coordinator still renews a grant this worker withdrew (its release was lost, or
    /// failed): send the release again, or it stays with this session, unused, until the
    /// session ends.
    Unreleased { partition: PartitionId, token: FencingToken },
}

/// A grant this worker has been told about.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Held {
    pub token: FencingToken,
    pub revoking: bool,
    /// `None` until a heartbeat confirms it.
    pub valid_until: Option<Instant>,
    /// When the ownership stream announced it, if that is how it was first heard of.
    announced_at: Option<Instant>,
}

impl Held {
    /// Believed at `now`: confirmed, not revoking, and its local lease still running.
    pub fn believed_at(&self, now: Instant) -> bool {
        !self.revoking && self.valid_until.is_some_and(|v| v > now)
    }
}

/// A grant this worker no longer holds.
#[derive(Clone, Copy, Debug)]
struct Retired {
    token: FencingToken,
    at: Instant,
    /// Only a lease that ran out locally (the coordinator may still count it ours) may come
    /// back. A released, revoked, lost or fenced grant never does: the coordinator may already
    /// have given it to someone else.
    may_return: bool,
    /// Withdrawn by this worker (a release, leave or drop), so a renewal of it means the
    /// coordinator has not applied the release.
    withdrawn: bool,
}

/// One session's belief: what it holds, until when, and what it gave up.
#[derive(Clone, Debug)]
pub struct Belief {
    ttl: Duration,
    margin: Duration,
    held: BTreeMap<PartitionId, Held>,
    /// The last grant of each partition given up, so that an answer already on its way cannot
    /// bring it back.
    retired: BTreeMap<PartitionId, Retired>,
}

impl Belief {
    /// A session's belief under the cluster's `ttl`, less `margin` for clock-rate drift.
    pub fn new(ttl: Duration, margin: Duration) -> Belief {
        Belief { ttl, margin, held: BTreeMap::new(), retired: BTreeMap::new() }
    }

    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    pub fn margin(&self) -> Duration {
        self.margin
    }

    /// The cluster's TTL changed: heartbeats answered from now on give leases by `ttl`, less
    /// `margin`. A lease already given keeps its end (it was granted under the TTL before).
    pub fn retime(&mut self, ttl: Duration, margin: Duration) {
        self.ttl = ttl;
        self.margin = margin;
    }

    /// The lease a heartbeat sent at `sent` gives: `sent + ttl - margin`.
    pub fn lease_from(&self, sent: Instant) -> Instant {
        sent + self.ttl.saturating_sub(self.margin)
    }

    /// Every grant held, believed or not.
    pub fn held(&self) -> impl Iterator<Item = (PartitionId, &Held)> + '_ {
        self.held.iter().map(|(p, h)| (*p, h))
    }

    /// The grants believed at `now`.
    pub fn believed_at(&self, now: Instant) -> impl Iterator<Item = (PartitionId, &Held)> + '_ {
        self.held().filter(move |(_, h)| h.believed_at(now))
    }

    /// Until when grant `token` of `partition` is believed, if it was confirmed and is still held.
    pub fn valid_until(&self, partition: PartitionId, token: FencingToken) -> Option<Instant> {
        self.held.get(&partition).filter(|h| h.token == token).and_then(|h| h.valid_until)
    }

    /// The grants whose local lease still runs at `now` (revoking ones included: their handles
    /// are cancelled, but the lease is not over).
    pub fn owned(&self, now: Instant) -> BTreeMap<PartitionId, FencingToken> {
        self.held
            .iter()
            .filter(|(_, h)| h.valid_until.is_some_and(|v| v > now))
            .map(|(p, h)| (*p, h.token))
            .collect()
    }

    /// The earliest local deadline among held grants.
    pub fn next_deadline(&self) -> Option<Instant> {
        self.held.values().filter_map(|h| h.valid_until).min()
    }

    /// Whether `token` of `partition` was given up and may not be held again.
    fn given_up(&self, partition: PartitionId, token: FencingToken) -> bool {
        self.retired.get(&partition).is_some_and(|r| token < r.token || (token == r.token && !r.may_return))
    }

    /// Removes a held grant, remembers it as retired and reports its end if it was confirmed.
    fn end(&mut self, partition: PartitionId, end: End, now: Instant, changes: &mut Vec<Change>) {
        self.end_or_withdraw(partition, end, false, now, changes)
    }

    fn end_or_withdraw(
        &mut self,
        partition: PartitionId,
        end: End,
        withdrawn: bool,
        now: Instant,
        changes: &mut Vec<Change>,
    ) {
        let Some(h) = self.held.remove(&partition) else { return };
        let may_return = end == End::Lost(LostReason::DeadlineExpired) && !h.revoking;
        self.retired.insert(partition, Retired { token: h.token, at: now, may_return, withdrawn });
        if h.valid_until.is_some() {
            changes.push(Change::Ended { partition, token: h.token, end });
        }
    }

    /// A heartbeat sent at `sent` was answered (taken in at `now`) with the grants it renewed.
    pub fn renewed(
        &mut self,
        sent: Instant,
        now: Instant,
        renewed: impl IntoIterator<Item = (PartitionId, FencingToken)>,
    ) -> Vec<Change> {
        let mut changes = Vec::new();
        let valid_until = self.lease_from(sent);
        if valid_until <= now {
            return changes; // an answer so late (a pause) that it confirms nothing any more
        }
        for (partition, token) in renewed {
            match self.held.get_mut(&partition) {
                Some(h) if h.token == token => {
                    if h.revoking || (h.valid_until.is_none() && h.announced_at.is_some_and(|at| sent <= at))
                    {
                        // Being given back, or announced after this heartbeat left: this answer
                        // confirms nothing about it.
                        continue;
                    }
                    let first = h.valid_until.is_none();
                    let until = h.valid_until.map_or(valid_until, |v| v.max(valid_until));
                    h.valid_until = Some(until);
                    if first {
                        changes.push(Change::Granted { partition, token, valid_until: until });
                    }
                }
                Some(h) if h.token > token => {}
                _ => {
                    if let Some(r) = self.retired.get(&partition) {
                        let comes_back = r.may_return && r.token == token && sent > r.at;
                        if token < r.token || (token == r.token && !comes_back) {
                            // An answer about a grant already given up; if this worker withdrew
                            // it and a heartbeat sent since still renews it, the release did not
                            // get through.
                            if token == r.token && r.withdrawn && sent > r.at {
                                changes.push(Change::Unreleased { partition, token });
                            }
                            continue;
                        }
                    }
                    self.end(partition, End::Lost(LostReason::Expired), now, &mut changes);
                    let held =
                        Held { token, revoking: false, valid_until: Some(valid_until), announced_at: None };
                    self.held.insert(partition, held);
                    changes.push(Change::Granted { partition, token, valid_until });
                }
            }
        }
        changes
    }

    /// The ownership stream announced grant `token` of `partition` at `now`. A stream read before
    /// a release (its opening snapshot, say) may still announce the released grant: a grant given
    /// up is never taken back.
    pub fn announced(&mut self, partition: PartitionId, token: FencingToken, now: Instant) -> Vec<Change> {
        let mut changes = Vec::new();
        let newer = self.held.get(&partition).is_none_or(|h| h.token < token);
        if newer && !self.given_up(partition, token) {
            self.end(partition, End::Lost(LostReason::Expired), now, &mut changes);
            let held = Held { token, revoking: false, valid_until: None, announced_at: Some(now) };
            self.held.insert(partition, held);
            changes.push(Change::Announced { partition, token });
        }
        changes
    }

    /// The stream says grant `token` of `partition` is being revoked.
    pub fn revoking(&mut self, partition: PartitionId, token: FencingToken) -> Vec<Change> {
        match self.held.get_mut(&partition) {
            Some(h) if h.token == token && !h.revoking => {
                h.revoking = true;
                if h.valid_until.is_some() {
                    return vec![Change::Revoking { partition, token }];
                }
                Vec::new()
            }
            _ => Vec::new(),
        }
    }

    /// The coordinator took grant `token` of `partition` (or an older one) away.
    pub fn lost(&mut self, partition: PartitionId, token: FencingToken, now: Instant) -> Vec<Change> {
        self.end_if(partition, |t| t <= token, End::Lost(LostReason::Expired), now)
    }

    /// The fenced store refused `token` for `partition`: a newer owner exists, whatever the lease
    /// says.
    pub fn fenced(&mut self, partition: PartitionId, token: FencingToken, now: Instant) -> Vec<Change> {
        self.end_if(partition, |t| t <= token, End::Lost(LostReason::Fenced), now)
    }

    /// The coordinator applied the release of grant `token`. A later grant of the same partition,
    /// which may have been heard of before the release's answer, is kept.
    pub fn released(&mut self, partition: PartitionId, token: FencingToken, now: Instant) -> Vec<Change> {
        self.end_if(partition, |t| t == token, End::Released, now)
    }

    fn end_if(
        &mut self,
        partition: PartitionId,
        matches: impl Fn(FencingToken) -> bool,
        end: End,
        now: Instant,
    ) -> Vec<Change> {
        let mut changes = Vec::new();
        if self.held.get(&partition).is_some_and(|h| matches(h.token)) {
            self.end(partition, end, now, &mut changes);
        }
        changes
    }

    /// Stops believing in `partitions` (every held one when `None`) before the coordinator is
    /// told they are given up, because the entry that releases them may grant them to the next
    /// owner at once. Returns the grants withdrawn (confirmed or not) and the changes.
    pub fn withdraw(
        &mut self,
        partitions: Option<&[PartitionId]>,
        now: Instant,
    ) -> (BTreeMap<PartitionId, FencingToken>, Vec<Change>) {
        // A set: a partition listed twice is withdrawn once.
        let chosen: std::collections::BTreeSet<PartitionId> = match partitions {
            Some(list) => list.iter().copied().filter(|p| self.held.contains_key(p)).collect(),
            None => self.held.keys().copied().collect(),
        };
        let mut withdrawn = BTreeMap::new();
        let mut changes = Vec::new();
        for partition in chosen {
            withdrawn.insert(partition, self.held[&partition].token);
            self.end_or_withdraw(partition, End::Released, true, now, &mut changes);
        }
        (withdrawn, changes)
    }

    /// The release of withdrawn `partitions` was answered (or failed) at `now`. Only a heartbeat
    /// sent after this that still finds one renewed says the release did not get through; one
    /// sent while the release was in flight says nothing.
    pub fn release_settled(&mut self, partitions: &[PartitionId], now: Instant) {
        for p in partitions {
            if let Some(r) = self.retired.get_mut(p).filter(|r| r.withdrawn) {
                r.at = r.at.max(now);
            }
        }
    }

    /// Drops every grant whose local lease has run out by `now`.
    pub fn expire(&mut self, now: Instant) -> Vec<Change> {
        let due: Vec<PartitionId> = self
            .held
            .iter()
            .filter(|(_, h)| h.valid_until.is_some_and(|v| v <= now))
            .map(|(p, _)| *p)
            .collect();
        let mut changes = Vec::new();
        for partition in due {
            self.end(partition, End::Lost(LostReason::DeadlineExpired), now, &mut changes);
        }
        changes
    }

    /// The session is over: nothing is held any more.
    pub fn end_session(&mut self, now: Instant) -> Vec<Change> {
        let all: Vec<PartitionId> = self.held.keys().copied().collect();
        let mut changes = Vec::new();
        for partition in all {
            self.end(partition, End::Lost(LostReason::SessionEnded), now, &mut changes);
        }
        changes
    }
}

#[cfg(test)]
mod tests {
    //! The rules with made-up instants; the library's own tests (`worker::shared::tests`) drive them
    //! through its tasks' entry points.

    use super::*;

    const P: PartitionId = PartitionId(1);
    const T: FencingToken = FencingToken(5);

    fn at(base: Instant, ms: u64) -> Instant {
        base + Duration::from_millis(ms)
    }

    #[test]
    fn a_heartbeat_sent_while_the_release_is_in_flight_asks_for_no_second_one() {
        let base = Instant::now();
        let mut b = Belief::new(Duration::from_secs(1), Duration::from_millis(200));
        b.renewed(at(base, 0), at(base, 1), [(P, T)]);
        // Listed twice, withdrawn once.
        let (withdrawn, changes) = b.withdraw(Some(&[P, P]), at(base, 10));
        assert_eq!(withdrawn.len(), 1);
        assert_eq!(changes, vec![Change::Ended { partition: P, token: T, end: End::Released }]);
        // The release is answered at 30 ms; a heartbeat sent at 20 ms, while it was in flight,
        // may still list the grant: that asks for nothing.
        b.release_settled(&[P], at(base, 30));
        assert_eq!(b.renewed(at(base, 20), at(base, 40), [(P, T)]), vec![]);
        // One sent after the answer that still finds it renewed: the release did not take.
        assert_eq!(
            b.renewed(at(base, 50), at(base, 60), [(P, T)]),
            vec![Change::Unreleased { partition: P, token: T }]
        );
        // Never believed again either way.
        assert_eq!(b.valid_until(P, T), None);
    }

    #[test]
    fn without_an_answer_the_withdrawal_itself_is_the_mark() {
        // A release that was lost on the way is never answered: a heartbeat sent after the
        // withdrawal that still finds the grant renewed asks for the release again.
        let base = Instant::now();
        let mut b = Belief::new(Duration::from_secs(1), Duration::from_millis(200));
        b.renewed(at(base, 0), at(base, 1), [(P, T)]);
        b.withdraw(Some(&[P]), at(base, 10));
        assert_eq!(b.renewed(at(base, 5), at(base, 20), [(P, T)]), vec![]);
        assert_eq!(
            b.renewed(at(base, 11), at(base, 20), [(P, T)]),
            vec![Change::Unreleased { partition: P, token: T }]
        );
    }
}
