//! The leader's lease table: one monotonic deadline per session and per revoking partition.
//!
//! Leases are judged only here, on the leader's monotonic clock, and never inside the replicated
//! state machine. The table itself takes `now` as an argument and does no I/O, so it is tested
//! with made-up instants; the server owns the clock and proposes the expiries it reports.
//!
//! Invariants kept here:
//! - A renewal that arrived at `t_recv` extends its session to `t_recv + ttl`, never backwards.
//! - Once a session has been reported due for expiry it is never renewed again, so a heartbeat
//!   racing an expiry cannot be acknowledged after the expiry was decided.
//! - A revoking partition keeps the deadline its session had when the revoke was applied; later
//!   heartbeats do not extend it.
//! - A new leader starts every lease at the moment it took over plus `ttl` ([`LeaseTable::reset`]),
//!   so it never expires a lease earlier than the old leader could have.
//! - `ttl` is the cluster's replicated TTL, never a node's own setting, and a renewal is answered
//!   with the TTL its deadline was computed from ([`LeaseTable::renew`]), so what a worker is
//!   told and what the leader enforces cannot differ. Following a TTL change
//!   ([`LeaseTable::follow`]) never moves a deadline earlier.
//! - While a TTL change is unsettled, a new term starts every lease the change's ceiling from
//!   now (the longest TTL a worker may still believe in); the table reports the change due for
//!   settling ([`Due::settle`]) only once it has run for that ceiling since both its term began
//!   and it saw the change.
//! - A partition granted at the end of a move (after a revoke) counts as in motion
//!   ([`LeaseTable::unconfirmed_moves`]) until a renewal of its new owner that arrived after the
//!   grant was applied confirms it, or the grant ends. A new term counts every grant the table
//!   marks as the end of a move until its owner's first renewal in that term, since only the
//!   leader that saw a confirmation knows of it.
//! - A TTL change this table sees only after its term began (a new leader applies the entries
//!   its predecessor committed a little later) moves every pending deadline to at least the
//!   change's ceiling from the term's start: the predecessor may have told workers the new TTL.
//! - A new term expires and settles nothing until its node has applied the log as far as it
//!   reached when the term began ([`LeaseTable::hold_until_applied`]).
//! - An expiry of a revoking partition names the grant (its token) it was computed for, so it
//!   cannot take away a later revoke of the same partition from the same session.

use crate::ids::{FencingToken, PartitionId, SessionId};
use crate::ownership::{Event, OwnershipState};
use std::collections::HashMap;
use std::time::Duration;
use tokio::time::Instant;

#[derive(Clone, Copy, Debug)]
struct SessionLease {
    deadline: Instant,
    expiring: bool,
}

#[derive(Clone, Copy, Debug)]
struct RevokingLease {
    session: SessionId,
    /// The grant being revoked.
    token: FencingToken,
    deadline: Instant,
    /// When the revoke was applied, for the move latency.
    since: Instant,
    phase: RevokePhase,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum RevokePhase {
    /// The owner may still release it.
    Pending,
    /// Its deadline passed and an expiry was reported.
    Expiring,
    /// Released or lost; waiting to be granted again.
    Gone,
}

/// Expiries that are due, to be proposed by the leader.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Due {
    pub sessions: Vec<SessionId>,
    /// Each revoking grant whose lease ran out: partition, owner, and the grant's token.
    pub revoking: Vec<(PartitionId, SessionId, FencingToken)>,
    /// The TTL change (its log index) that no lease granted before it can outlive any more.
    pub settle: Option<u64>,
}

impl Due {
    pub fn is_empty(&self) -> bool {
        self.sessions.is_empty() && self.revoking.is_empty() && self.settle.is_none()
    }
}

/// An unsettled TTL change as this table follows it: once `safe_at` has passed, no worker can
/// believe a lease granted under a TTL before the change.
#[derive(Clone, Copy, Debug)]
struct Unsettled {
    changed_at: u64,
    safe_at: Instant,
}

/// See the module docs.
#[derive(Debug)]
pub struct LeaseTable {
    ttl: Duration,
    /// Whether `ttl` is the cluster's replicated TTL yet (false only on a leader that took over
    /// before the cluster's configuration was applied).
    configured: bool,
    unsettled: Option<Unsettled>,
    /// When this table last started over ([`LeaseTable::reset`]): every renewal another leader
    /// answered came before it.
    started: Option<Instant>,
    /// The log index this term must have applied before anything is due (see
    /// [`LeaseTable::hold_until_applied`]); `None` once it has.
    held_until: Option<u64>,
    sessions: HashMap<SessionId, SessionLease>,
    revoking: HashMap<PartitionId, RevokingLease>,
    /// Moved partitions not yet confirmed, by new owner: partition and when the grant was seen.
    unconfirmed: HashMap<SessionId, Vec<(PartitionId, Instant)>>,
    /// How many partitions `unconfirmed` holds.
    unconfirmed_count: usize,
}

impl LeaseTable {
    pub fn new(ttl: Duration) -> Self {
        LeaseTable {
            ttl,
            configured: true,
            unsettled: None,
            started: None,
            held_until: None,
            sessions: HashMap::new(),
            revoking: HashMap::new(),
            unconfirmed: HashMap::new(),
            unconfirmed_count: 0,
        }
    }

    /// The table a node starts a term of leadership with, at `now`: every lease one TTL from
    /// now, judged by the cluster's replicated TTL. Before the cluster is configured (there are
    /// no sessions yet) it starts from `proposed`, the value this node proposes, until
    /// [`LeaseTable::adopt`] sees the configuration applied. A node's own setting never judges
    /// a lease a worker was told about.
    pub fn for_new_term(now: Instant, state: &OwnershipState, proposed: Duration) -> LeaseTable {
        let config = state.config();
        let mut table = LeaseTable::new(config.map_or(proposed, |c| Duration::from_millis(c.lease_ttl_ms)));
        table.configured = config.is_some();
        table.reset(now, state);
        table
    }

    /// Follows the cluster's TTL in its applied configuration (which may be applied after the
    /// table was built, or change at run time); returns whether the TTL changed. Only renewals
    /// and sessions from now on use it: a deadline already set is never moved earlier, since a
    /// worker may have been told it.
    pub fn follow(&mut self, config: Option<crate::ownership::Config>) -> bool {
        let Some(config) = config else { return false };
        let ttl = Duration::from_millis(config.lease_ttl_ms);
        let changed = !self.configured || ttl != self.ttl;
        self.ttl = ttl;
        self.configured = true;
        changed
    }

    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    /// Starts over on taking leadership (or after missing applied events): every lease runs
    /// until `now` plus the longest TTL a worker may believe in, the ceiling of an unsettled TTL
    /// change if there is one, and an unsettled change becomes safe to settle a ceiling from now.
    /// Every grant marked as the end of a move counts as unconfirmed from now.
    pub fn reset(&mut self, now: Instant, state: &OwnershipState) {
        self.sessions.clear();
        self.revoking.clear();
        self.unconfirmed.clear();
        self.unconfirmed_count = 0;
        let ceiling = state.config().map_or(self.ttl, |c| Duration::from_millis(c.ttl_ceiling_ms()));
        let deadline = now + ceiling.max(self.ttl);
        self.started = Some(now);
        self.unsettled = state
            .config()
            .and_then(|c| c.ttl_change)
            .map(|c| Unsettled { changed_at: c.changed_at, safe_at: deadline });
        for session in state.sessions().keys() {
            self.sessions.insert(*session, SessionLease { deadline, expiring: false });
        }
        for (p, record) in state.partitions().iter().enumerate() {
            let partition = PartitionId(p as u32);
            match (record.owner, record.revoking) {
                (Some(session), true) => {
                    let lease = RevokingLease {
                        session,
                        token: record.token,
                        deadline,
                        since: now,
                        phase: RevokePhase::Pending,
                    };
                    self.revoking.insert(partition, lease);
                }
                // Which moves an earlier leader saw confirmed is not known here: every grant
                // that ended a move stays in motion until its owner renews with this table.
                (Some(session), false) if record.moved => {
                    self.unconfirmed.entry(session).or_default().push((partition, now));
                    self.unconfirmed_count += 1;
                }
                _ => {}
            }
        }
    }

    /// Moves every lease still pending to at least `deadline`.
    fn extend_all_to(&mut self, deadline: Instant) {
        for lease in self.sessions.values_mut().filter(|l| !l.expiring) {
            lease.deadline = lease.deadline.max(deadline);
        }
        for lease in self.revoking.values_mut().filter(|l| l.phase == RevokePhase::Pending) {
            lease.deadline = lease.deadline.max(deadline);
        }
    }

    /// Forgets everything (on losing leadership).
    pub fn clear(&mut self) {
        self.sessions.clear();
        self.revoking.clear();
        self.unconfirmed.clear();
        self.unconfirmed_count = 0;
    }

    /// Moved partitions granted to their new owner and not yet confirmed by its heartbeat: in
    /// motion still, so they count toward the revoke budget.
    pub fn unconfirmed_moves(&self) -> usize {
        self.unconfirmed_count
    }

    /// Keeps only the unconfirmed moves to `session` that `keep` accepts (partition, when the
    /// grant was seen), and the count true.
    fn retain_unconfirmed(&mut self, session: SessionId, keep: impl Fn(PartitionId, Instant) -> bool) {
        if let Some(list) = self.unconfirmed.get_mut(&session) {
            let before = list.len();
            list.retain(|(p, at)| keep(*p, *at));
            self.unconfirmed_count -= before - list.len();
            if list.is_empty() {
                self.unconfirmed.remove(&session);
            }
        }
    }

    /// Follows applied events. Idempotent, so events already reflected by `reset` are harmless.
    /// Returns, for each partition granted after a revoke, how long it had no usable owner.
    pub fn observe(&mut self, now: Instant, events: &[Event]) -> Vec<Duration> {
        let mut moves = Vec::new();
        for event in events {
            match event {
                Event::SessionStarted { session, .. } => {
                    self.sessions
                        .entry(*session)
                        .or_insert(SessionLease { deadline: now + self.ttl, expiring: false });
                }
                Event::SessionEnded { session } => {
                    self.sessions.remove(session);
                    self.retain_unconfirmed(*session, |_, _| false);
                }
                Event::Revoking { partition, session, token } => {
                    let deadline = self.sessions.get(session).map(|l| l.deadline).unwrap_or(now + self.ttl);
                    self.revoking.entry(*partition).or_insert(RevokingLease {
                        session: *session,
                        token: *token,
                        deadline,
                        since: now,
                        phase: RevokePhase::Pending,
                    });
                }
                Event::Released { partition, session, .. } | Event::Lost { partition, session, .. } => {
                    if let Some(lease) = self.revoking.get_mut(partition) {
                        lease.phase = RevokePhase::Gone;
                    }
                    self.retain_unconfirmed(*session, |p, _| p != *partition);
                }
                Event::Granted { partition, session, .. } => {
                    if let Some(lease) = self.revoking.remove(partition) {
                        moves.push(now.saturating_duration_since(lease.since));
                        self.unconfirmed.entry(*session).or_default().push((*partition, now));
                        self.unconfirmed_count += 1;
                    }
                }
                Event::LeaseTtlChanged { lease_ttl_ms, ceiling_ms, changed_at } => {
                    self.ttl = Duration::from_millis(*lease_ttl_ms);
                    self.configured = true;
                    let ceiling = Duration::from_millis(*ceiling_ms);
                    // A leader may take over before it has applied every committed entry: a
                    // change the previous leader applied (and told workers of) can reach this
                    // table only now. Every lease then runs at least the ceiling from this
                    // table's start, as if the change had been applied when it started.
                    if let Some(started) = self.started {
                        self.extend_all_to(started + ceiling);
                    }
                    let safe_at = now + ceiling;
                    // A table that started its term after this change already waits out the
                    // ceiling from its start; never earlier than that.
                    let safe_at = self
                        .unsettled
                        .filter(|u| u.changed_at == *changed_at)
                        .map_or(safe_at, |u| u.safe_at.max(safe_at));
                    self.unsettled = Some(Unsettled { changed_at: *changed_at, safe_at });
                }
                Event::LeaseTtlSettled { changed_at } => {
                    if self.unsettled.is_some_and(|u| u.changed_at == *changed_at) {
                        self.unsettled = None;
                    }
                }
                // A leaving session keeps its lease until its partitions are revoked and
                // released; the configuration reaches the table through `follow`.
                Event::SessionLeaving { .. }
                | Event::RevokeBudgetChanged { .. }
                | Event::Configured { .. }
                | Event::MaintenanceChanged { .. }
                | Event::WeightChanged { .. }
                | Event::Pinned { .. }
                | Event::NamespaceDeleted => {}
            }
        }
        moves
    }

    /// Records a renewal that arrived at `received` for a session the replicated state holds,
    /// and returns the TTL its new deadline was computed from: what the worker must be told.
    /// `None` when the session is already due for expiry: the renewal must then be refused.
    ///
    /// A session the table has not heard of has started (the caller found it in the state)
    /// but its start has not been observed here yet: the first heartbeat of a new worker can
    /// overtake the applied events, all the more when the entry that started it also granted
    /// a large table. It starts now, as observing its start would have.
    pub fn renew(&mut self, session: SessionId, received: Instant) -> Option<Duration> {
        let ttl = self.ttl;
        let lease = self
            .sessions
            .entry(session)
            .or_insert(SessionLease { deadline: received + ttl, expiring: false });
        if lease.expiring {
            return None;
        }
        lease.deadline = lease.deadline.max(received + ttl);
        // Its answer renews every grant the session holds: moves granted before this renewal
        // arrived are confirmed.
        self.retain_unconfirmed(session, |_, granted| granted >= received);
        Some(ttl)
    }

    /// Whether a renewal for `session` could still succeed (used before the quorum round). A
    /// session not heard of yet could (see [`LeaseTable::renew`]).
    pub fn renewable(&self, session: SessionId, now: Instant) -> bool {
        self.sessions.get(&session).is_none_or(|l| !l.expiring && l.deadline > now)
    }

    /// Holds every expiry and settlement until the table's node has applied the log as far as
    /// `index` ([`LeaseTable::applied`]): a new leader passes the last index of its log when it
    /// took over. An entry its predecessor committed, and told workers of, may reach this node's
    /// state only after its term began (a TTL change above all: the table learns of a longer TTL
    /// only by applying it), and nothing may be expired on a table that has not seen it.
    pub fn hold_until_applied(&mut self, index: u64) {
        self.held_until = Some(index);
    }

    /// The node has applied the log up to `index`.
    pub fn applied(&mut self, index: u64) {
        if self.held_until.is_some_and(|held| index >= held) {
            self.held_until = None;
        }
    }

    /// Reports the leases whose deadline has passed. Each is reported until the expiry is applied
    /// (so a failed proposal is retried), and is never renewed again. Nothing is due while the
    /// table is held ([`LeaseTable::hold_until_applied`]).
    pub fn due(&mut self, now: Instant) -> Due {
        let mut due = Due::default();
        if self.held_until.is_some() {
            return due;
        }
        for (session, lease) in self.sessions.iter_mut() {
            if lease.expiring || lease.deadline <= now {
                lease.expiring = true;
                due.sessions.push(*session);
            }
        }
        for (partition, lease) in self.revoking.iter_mut() {
            if lease.phase != RevokePhase::Gone && lease.deadline <= now {
                lease.phase = RevokePhase::Expiring;
                due.revoking.push((*partition, lease.session, lease.token));
            }
        }
        due.sessions.sort();
        due.revoking.sort();
        due.settle = self.unsettled.filter(|u| u.safe_at <= now).map(|u| u.changed_at);
        due
    }

    /// Time left at `now` on `session`'s lease (zero once it is due), or `None` for a session
    /// the table has not heard of. What `tenure ctl` shows; nothing is decided on it.
    pub fn session_remaining(&self, session: SessionId, now: Instant) -> Option<Duration> {
        self.sessions.get(&session).map(|l| {
            if l.expiring {
                Duration::ZERO
            } else {
                l.deadline.saturating_duration_since(now)
            }
        })
    }

    /// Time left at `now` before the leader may expire the revoke of `partition` (zero once it
    /// is due), or `None` if the partition is not revoking here.
    pub fn revoke_remaining(&self, partition: PartitionId, now: Instant) -> Option<Duration> {
        self.revoking.get(&partition).and_then(|l| match l.phase {
            RevokePhase::Pending => Some(l.deadline.saturating_duration_since(now)),
            RevokePhase::Expiring => Some(Duration::ZERO),
            RevokePhase::Gone => None,
        })
    }

    /// The earliest deadline still pending, so the caller knows when to look again.
    pub fn next_deadline(&self) -> Option<Instant> {
        let s = self.sessions.values().filter(|l| !l.expiring).map(|l| l.deadline);
        let r = self.revoking.values().filter(|l| l.phase == RevokePhase::Pending).map(|l| l.deadline);
        let settle = self.unsettled.map(|u| u.safe_at);
        s.chain(r).chain(settle).min()
    }
}
