//! The ownership table and the pure `apply` that changes it.

use super::command::{Command, Event, Grant, LostReason, Rejection, Response, Revoke};
use super::secret::SecretHash;
use crate::ids::{FencingToken, PartitionId, SessionId};
use crate::keyspace::KeySpace;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};

/// Longest worker name accepted, in bytes.
pub const MAX_NAME_BYTES: usize = 256;
/// Highest weight a member may have; it bounds the leader's placement ring.
pub const MAX_WEIGHT: u32 = 1000;
/// Shortest lease TTL a cluster may have, in milliseconds.
pub const MIN_LEASE_TTL_MS: u64 = 100;
/// Longest lease TTL a cluster may have, in milliseconds (a day): far beyond any use, and it
/// keeps every deadline a leader computes from it representable.
pub const MAX_LEASE_TTL_MS: u64 = 24 * 60 * 60 * 1000;

/// Set by the first `Configure`. The partition count never changes; the lease TTL and the
/// revoke budget may, through `SetLeaseTtl` and `SetRevokeBudget`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Config {
    pub partition_count: u32,
    /// The TTL renewals are granted under from now on: what a worker is told with each renewal.
    pub lease_ttl_ms: u64,
    /// The blast-radius budget: most partitions the leader keeps revoking at once (`None`: no
    /// limit). Apply does not enforce it (a decision is checked against the table, not against
    /// policy); the leader's planner does, from this replicated value.
    pub max_revoking: Option<u32>,
    /// Set by a TTL change until the leader has seen every lease granted under an earlier TTL
    /// run out (see [`TtlChange`]); `None` when every lease a worker may still believe in was
    /// granted under `lease_ttl_ms`.
    pub ttl_change: Option<TtlChange>,
}

/// A lease TTL change not yet settled. Workers renewed before the change were told an older
/// TTL, possibly a longer one, and may believe in their leases that long: a leader taking over
/// while a change is unsettled starts every lease `ceiling_ms` from its start, not
/// `lease_ttl_ms`. The leader settles the change (`SettleLeaseTtl`) once it has led for
/// `ceiling_ms` since both its term began and it applied the change.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TtlChange {
    /// The longest TTL any worker may still hold a lease under: the current TTL or one before.
    pub ceiling_ms: u64,
    /// The log index of the change, so that settling it cannot settle a later one.
    pub changed_at: u64,
}

impl Config {
    /// The longest TTL a worker may still believe one of its leases under: what a new leader
    /// must wait out before it may expire anything.
    pub fn ttl_ceiling_ms(&self) -> u64 {
        self.ttl_change.map_or(self.lease_ttl_ms, |c| c.ceiling_ms.max(self.lease_ttl_ms))
    }
}

/// One partition's row. `token` is the token of the current grant, or of the last one when the
/// partition is unowned (0 if it was never granted). `next` is set only while the partition is
/// revoking: the member the leader chose to receive it once the owner lets go.
///
/// `moved` says that the partition was last let go while revoking: its current grant (or, while
/// unowned, its next one) ends a move. A leader counts such a grant in motion, toward the revoke
/// budget, until the new owner's heartbeat confirms it; whether it was confirmed is known only
/// to the leader that saw the heartbeat, so a new leader counts every moved grant until its
/// owner renews with it (see [`crate::lease::LeaseTable::reset`]). Without the mark a leader
/// change would forget the moves still in flight and revoke past the budget.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PartitionRecord {
    pub owner: Option<SessionId>,
    pub token: FencingToken,
    pub revoking: bool,
    pub next: Option<SessionId>,
    pub moved: bool,
}

/// What operators change at run time, replicated like the table.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Settings {
    /// Maintenance mode: the leader grants unowned partitions (nobody works on them) but takes
    /// none from a live owner, so a rolling deployment of workers moves nothing it does not
    /// have to. Leaves, drains and restarts still revoke: the worker asked for those.
    pub maintenance: bool,
    /// Weights an operator set by worker name. They outlive the sessions they were set on: a
    /// worker that joins again under that name gets this weight, whatever its join asked for.
    pub weights: BTreeMap<String, u32>,
    /// Partitions an operator pinned to a worker name. The leader places a pinned partition
    /// with a live session of that name whenever there is one (moving it gracefully, within the
    /// revoke budget and not in maintenance), and by the usual rules while there is none; the
    /// rest of the table balances around it. Like weights, pins outlive sessions.
    pub pins: BTreeMap<PartitionId, String>,
}

/// One live session.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SessionRecord {
    pub name: String,
    pub weight: u32,
    /// The hash of the secret the leader gave the session; the secret itself is kept nowhere.
    pub secret: SecretHash,
    /// Leaving (or superseded by a newer session of the same name): owns only revoking partitions
    /// and ends when it owns none.
    pub leaving: bool,
}

/// Keys touched since the store last drained them, so it persists only what changed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Changes {
    pub partitions: BTreeSet<u32>,
    pub sessions: BTreeSet<SessionId>,
    pub meta: bool,
}

/// The replicated table. See the module docs of [`crate::ownership`].
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(from = "StateData")]
pub struct OwnershipState {
    config: Option<Config>,
    partitions: Vec<PartitionRecord>,
    sessions: BTreeMap<SessionId, SessionRecord>,
    next_session: u64,
    settings: Settings,
    #[serde(skip)]
    changes: Changes,
    /// Partitions per owner, derived from `partitions` (never persisted, rebuilt on load), so a
    /// heartbeat costs what the session owns rather than the size of the table.
    #[serde(skip)]
    owned: BTreeMap<SessionId, BTreeSet<u32>>,
    /// How many partitions have no owner, and how many are revoking; derived like `owned`, so
    /// the leader can tell a settled table without a pass over it.
    #[serde(skip)]
    unowned: usize,
    /// Sessions per worker name, derived from `sessions` like `owned`, so finding a name's
    /// sessions (a join's predecessor, a gauge per worker) costs that name's sessions, not every
    /// session's.
    #[serde(skip)]
    named: BTreeMap<String, BTreeSet<SessionId>>,
    #[serde(skip)]
    revoking: usize,
}

/// What a snapshot carries; the derived index is rebuilt from it.
#[derive(Deserialize)]
struct StateData {
    config: Option<Config>,
    partitions: Vec<PartitionRecord>,
    sessions: BTreeMap<SessionId, SessionRecord>,
    next_session: u64,
    settings: Settings,
}

impl From<StateData> for OwnershipState {
    fn from(d: StateData) -> Self {
        OwnershipState::from_parts(d.config, d.partitions, d.sessions, d.next_session)
            .with_settings(d.settings)
    }
}

impl OwnershipState {
    /// Rebuilds a state from persisted parts (the store's load path).
    pub fn from_parts(
        config: Option<Config>,
        partitions: Vec<PartitionRecord>,
        sessions: BTreeMap<SessionId, SessionRecord>,
        next_session: u64,
    ) -> Self {
        let mut owned: BTreeMap<SessionId, BTreeSet<u32>> = BTreeMap::new();
        for (p, record) in partitions.iter().enumerate() {
            if let Some(owner) = record.owner {
                owned.entry(owner).or_default().insert(p as u32);
            }
        }
        let mut named: BTreeMap<String, BTreeSet<SessionId>> = BTreeMap::new();
        for (session, record) in &sessions {
            named.entry(record.name.clone()).or_default().insert(*session);
        }
        let unowned = partitions.iter().filter(|r| r.owner.is_none()).count();
        let revoking = partitions.iter().filter(|r| r.revoking).count();
        OwnershipState {
            config,
            partitions,
            sessions,
            next_session,
            settings: Settings::default(),
            changes: Changes::default(),
            owned,
            unowned,
            named,
            revoking,
        }
    }

    /// The state with these operator settings (the store's load path).
    pub fn with_settings(mut self, settings: Settings) -> Self {
        self.settings = settings;
        self
    }

    pub fn config(&self) -> Option<Config> {
        self.config
    }
    pub fn settings(&self) -> &Settings {
        &self.settings
    }
    /// Whether the leader may take partitions from live owners (see [`Settings::maintenance`]).
    pub fn maintenance(&self) -> bool {
        self.settings.maintenance
    }
    pub fn keyspace(&self) -> Option<KeySpace> {
        self.config.and_then(|c| KeySpace::new(c.partition_count).ok())
    }
    pub fn partitions(&self) -> &[PartitionRecord] {
        &self.partitions
    }
    pub fn partition(&self, p: PartitionId) -> Option<&PartitionRecord> {
        self.partitions.get(p.0 as usize)
    }
    pub fn sessions(&self) -> &BTreeMap<SessionId, SessionRecord> {
        &self.sessions
    }
    pub fn session(&self, s: SessionId) -> Option<&SessionRecord> {
        self.sessions.get(&s)
    }
    pub fn next_session(&self) -> u64 {
        self.next_session
    }

    /// The live sessions of worker `name` that are not leaving: the one a worker runs, or none
    /// (a restart supersedes the older session, which is then leaving).
    pub fn live_sessions_named<'a>(&'a self, name: &'a str) -> impl Iterator<Item = SessionId> + 'a {
        self.sessions_named(name).filter(|s| self.sessions.get(s).is_some_and(|r| !r.leaving))
    }

    /// Every session of worker `name`, leaving ones included, in session order.
    pub fn sessions_named<'a>(&'a self, name: &str) -> impl Iterator<Item = SessionId> + 'a {
        self.named.get(name).into_iter().flatten().copied()
    }

    /// What a `SetWeight` of `name` to `weight` must satisfy, apply and the server alike (so a
    /// refused one never becomes an entry): the sessions it would change.
    pub fn check_set_weight(&self, name: &str, weight: u32) -> Result<Vec<SessionId>, Rejection> {
        self.require_config()?;
        check_join(name, weight)?;
        let sessions: Vec<SessionId> = self.live_sessions_named(name).collect();
        if sessions.is_empty() {
            return Err(Rejection::UnknownWorker(name.to_string()));
        }
        Ok(sessions)
    }

    /// What a `Pin` must satisfy, apply and the server alike: a partition in range and, to pin,
    /// a valid name with a live session (a typo must not linger); unpinning always may.
    pub fn check_pin(&self, partition: PartitionId, name: Option<&str>) -> Result<(), Rejection> {
        let config = self.require_config()?;
        if partition.0 >= config.partition_count {
            return Err(Rejection::PartitionOutOfRange {
                partition: partition.0,
                count: config.partition_count,
            });
        }
        if let Some(name) = name {
            check_join(name, 1)?;
            if self.live_sessions_named(name).next().is_none() {
                return Err(Rejection::UnknownWorker(name.to_string()));
            }
        }
        Ok(())
    }

    /// Checks a session's secret against the table; used by the server for heartbeats.
    pub fn authenticate(&self, session: SessionId, secret: &str) -> Result<&SessionRecord, Rejection> {
        self.authenticate_hash(session, &SecretHash::of(secret))
    }

    /// [`OwnershipState::authenticate`] with the secret already hashed (as commands carry it).
    pub fn authenticate_hash(
        &self,
        session: SessionId,
        secret: &SecretHash,
    ) -> Result<&SessionRecord, Rejection> {
        let record = self.sessions.get(&session).ok_or(Rejection::UnknownSession(session))?;
        if !record.secret.matches(secret) {
            return Err(Rejection::WrongSecret(session));
        }
        Ok(record)
    }

    /// Partitions a session owns, with their tokens and revoking flags.
    pub fn owned_by(&self, session: SessionId) -> Vec<(PartitionId, PartitionRecord)> {
        self.owned
            .get(&session)
            .into_iter()
            .flatten()
            .map(|p| (PartitionId(*p), self.partitions[*p as usize]))
            .collect()
    }

    /// How many partitions a session owns (revoking ones included).
    pub fn owned_count(&self, session: SessionId) -> usize {
        self.owned.get(&session).map_or(0, BTreeSet::len)
    }

    /// Partitions without an owner.
    pub fn unowned_count(&self) -> usize {
        self.unowned
    }

    /// Partitions being revoked.
    pub fn revoking_count(&self) -> usize {
        self.revoking
    }

    /// Takes the set of keys changed since the last call.
    pub fn take_changes(&mut self) -> Changes {
        std::mem::take(&mut self.changes)
    }

    /// Applies one committed command at log index `index`. Deterministic: same state, index and
    /// command give the same result on every replica. A rejection leaves the state unchanged.
    pub fn apply(&mut self, index: u64, command: &Command) -> (Response, Vec<Event>) {
        let mut events = Vec::new();
        let response = match self.apply_inner(index, command, &mut events) {
            Ok(response) => response,
            Err(rejection) => {
                debug_assert!(events.is_empty(), "a rejected command must not emit events");
                Response::Rejected(rejection)
            }
        };
        (response, events)
    }

    fn apply_inner(
        &mut self,
        index: u64,
        command: &Command,
        events: &mut Vec<Event>,
    ) -> Result<Response, Rejection> {
        match command {
            Command::Configure { partition_count, lease_ttl_ms, max_revoking } => self.configure(
                Config {
                    partition_count: *partition_count,
                    lease_ttl_ms: *lease_ttl_ms,
                    max_revoking: *max_revoking,
                    ttl_change: None,
                },
                events,
            ),
            Command::Join { name, weight, secret } => self.join(name, *weight, secret, events),
            Command::Release { session, secret, partitions, tokens } => {
                if !tokens.is_empty() && tokens.len() != partitions.len() {
                    return Err(Rejection::TokensMismatch {
                        partitions: partitions.len(),
                        tokens: tokens.len(),
                    });
                }
                self.release(index, *session, secret, partitions, tokens, events)
            }
            Command::ReleaseAll { session, secret } => {
                self.authenticate_hash(*session, secret)?;
                self.require_config()?;
                let mine: Vec<PartitionId> = self.owned_by(*session).into_iter().map(|(p, _)| p).collect();
                self.release(index, *session, secret, &mine, &[], events)
            }
            Command::Leave { session, secret } => {
                self.authenticate_hash(*session, secret)?;
                self.require_config()?;
                self.mark_leaving(*session, events);
                self.end_if_idle(*session, events);
                Ok(Response::Left)
            }
            Command::Expire { sessions } => {
                self.require_config()?;
                let mut lost = 0;
                for &session in sessions {
                    if !self.sessions.contains_key(&session) {
                        continue;
                    }
                    lost += self.lose_all(index, session, LostReason::SessionExpired, events);
                    self.end_session(session, events);
                }
                Ok(Response::Expired { partitions: lost })
            }
            Command::ExpireRevoking { partitions } => {
                self.require_config()?;
                let mut lost = 0;
                for &(p, session, token) in partitions {
                    let Some(record) = self.partitions.get(p.0 as usize).copied() else {
                        continue;
                    };
                    if record.owner == Some(session) && record.token == token && record.revoking {
                        self.set_partition(p, let_go(record));
                        events.push(Event::Lost {
                            partition: p,
                            session,
                            token: record.token,
                            reason: LostReason::RevokeExpired,
                        });
                        self.hand_over(index, p, record, events);
                        self.end_if_idle(session, events);
                        lost += 1;
                    }
                }
                Ok(Response::Expired { partitions: lost })
            }
            Command::Place { grants, revokes } => self.place(index, grants, revokes, events),
            Command::SetMaintenance { on } => {
                self.require_config()?;
                let was = self.settings.maintenance;
                if was != *on {
                    self.settings.maintenance = *on;
                    self.changes.meta = true;
                    events.push(Event::MaintenanceChanged { on: *on });
                }
                Ok(Response::MaintenanceSet { was })
            }
            Command::SetWeight { name, weight } => self.set_weight(name, *weight, events),
            Command::SetLeaseTtl { lease_ttl_ms } => self.set_lease_ttl(index, *lease_ttl_ms, events),
            Command::SettleLeaseTtl { changed_at } => {
                let mut config = self.require_config()?;
                let settled = config.ttl_change.is_some_and(|c| c.changed_at == *changed_at);
                if settled {
                    config.ttl_change = None;
                    self.config = Some(config);
                    self.changes.meta = true;
                    events.push(Event::LeaseTtlSettled { changed_at: *changed_at });
                }
                Ok(Response::LeaseTtlSettled { settled })
            }
            Command::SetRevokeBudget { max_revoking } => {
                let mut config = self.require_config()?;
                check_revoke_budget(*max_revoking)?;
                let was = config.max_revoking;
                if was != *max_revoking {
                    config.max_revoking = *max_revoking;
                    self.config = Some(config);
                    self.changes.meta = true;
                    events.push(Event::RevokeBudgetChanged { max_revoking: *max_revoking });
                }
                Ok(Response::RevokeBudgetSet { was })
            }
            Command::Pin { partition, name } => {
                self.check_pin(*partition, name.as_deref())?;
                let was = match name {
                    Some(name) => self.settings.pins.insert(*partition, name.clone()),
                    None => self.settings.pins.remove(partition),
                };
                self.changes.meta = true;
                events.push(Event::Pinned { partition: *partition, name: name.clone() });
                Ok(Response::Pinned { was })
            }
        }
    }

    /// An operator changes the lease TTL. Renewals from now on are granted under the new TTL;
    /// leases granted before keep theirs, so the change stays unsettled (the ceiling is the
    /// longest TTL a worker may still believe in) until the leader settles it.
    fn set_lease_ttl(
        &mut self,
        index: u64,
        lease_ttl_ms: u64,
        events: &mut Vec<Event>,
    ) -> Result<Response, Rejection> {
        let mut config = self.require_config()?;
        check_lease_ttl(lease_ttl_ms)?;
        let was_ms = config.lease_ttl_ms;
        if was_ms != lease_ttl_ms {
            let ceiling_ms = config.ttl_ceiling_ms().max(lease_ttl_ms);
            config.lease_ttl_ms = lease_ttl_ms;
            config.ttl_change = Some(TtlChange { ceiling_ms, changed_at: index });
            self.config = Some(config);
            self.changes.meta = true;
            events.push(Event::LeaseTtlChanged { lease_ttl_ms, ceiling_ms, changed_at: index });
        }
        Ok(Response::LeaseTtlSet { was_ms })
    }

    /// An operator's weight for a worker name: kept for the name, and given to its live
    /// sessions now. A name with no live session is refused (a typo must not linger).
    fn set_weight(
        &mut self,
        name: &str,
        weight: u32,
        events: &mut Vec<Event>,
    ) -> Result<Response, Rejection> {
        let sessions = self.check_set_weight(name, weight)?;
        self.settings.weights.insert(name.to_string(), weight);
        self.changes.meta = true;
        for &session in &sessions {
            let mut record = self.sessions[&session].clone();
            if record.weight != weight {
                record.weight = weight;
                self.put_session(session, record);
                events.push(Event::WeightChanged { session, weight });
            }
        }
        Ok(Response::WeightSet { sessions })
    }

    /// Applies the leader's decision, all of it or none: every move is checked against this
    /// table before anything changes.
    fn place(
        &mut self,
        index: u64,
        grants: &[Grant],
        revokes: &[Revoke],
        events: &mut Vec<Event>,
    ) -> Result<Response, Rejection> {
        let config = self.require_config()?;
        let mut named = BTreeSet::new();
        let mut row = |p: PartitionId| {
            let record = self
                .partitions
                .get(p.0 as usize)
                .ok_or(Rejection::PartitionOutOfRange { partition: p.0, count: config.partition_count })?;
            if !named.insert(p) {
                return Err(Rejection::DuplicateMove(p));
            }
            Ok(*record)
        };
        for g in grants {
            let record = row(g.partition)?;
            self.require_eligible(g.session)?;
            if record.owner.is_some() {
                return Err(Rejection::StalePlacement(g.partition));
            }
        }
        for r in revokes {
            let record = row(r.partition)?;
            self.require_eligible(r.next)?;
            let current = record.owner == Some(r.session) && record.token == r.token && !record.revoking;
            if !current || r.next == r.session {
                return Err(Rejection::StalePlacement(r.partition));
            }
        }
        for g in grants {
            self.grant(index, g.partition, g.session, events);
        }
        for r in revokes {
            let record = self.partitions[r.partition.0 as usize];
            self.set_partition(r.partition, PartitionRecord { revoking: true, next: Some(r.next), ..record });
            events.push(Event::Revoking { partition: r.partition, session: r.session, token: record.token });
        }
        Ok(Response::Placed { granted: grants.len() as u32, revoking: revokes.len() as u32 })
    }

    /// A session that may be given partitions: live and not leaving.
    fn eligible(&self, session: SessionId) -> bool {
        self.sessions.get(&session).is_some_and(|r| !r.leaving)
    }

    fn require_eligible(&self, session: SessionId) -> Result<(), Rejection> {
        if self.eligible(session) {
            Ok(())
        } else {
            Err(Rejection::NotEligible(session))
        }
    }

    /// Grants an unowned partition under the token `index`, the entry's log index.
    fn grant(&mut self, index: u64, partition: PartitionId, session: SessionId, events: &mut Vec<Event>) {
        let record = self.partitions[partition.0 as usize];
        debug_assert!(record.owner.is_none(), "{partition} granted while owned");
        let token = FencingToken(index);
        assert!(token > record.token, "token for {partition} would not grow: {} -> {token}", record.token);
        self.set_partition(
            partition,
            PartitionRecord { owner: Some(session), token, revoking: false, next: None, moved: record.moved },
        );
        events.push(Event::Granted { partition, session, token });
    }

    /// A revoking partition that has just been let go goes to the member the leader chose for
    /// it, in the same entry, if that member can still take it; otherwise it stays unowned and
    /// the leader places it again.
    fn hand_over(
        &mut self,
        index: u64,
        partition: PartitionId,
        was: PartitionRecord,
        events: &mut Vec<Event>,
    ) {
        if let Some(next) = was.next.filter(|n| self.eligible(*n)) {
            self.grant(index, partition, next, events);
        }
    }

    /// Ends a leaving session once it owns nothing.
    fn end_if_idle(&mut self, session: SessionId, events: &mut Vec<Event>) {
        let leaving = self.sessions.get(&session).is_some_and(|r| r.leaving);
        if leaving && self.owned_count(session) == 0 {
            self.end_session(session, events);
        }
    }

    fn require_config(&self) -> Result<Config, Rejection> {
        self.config.ok_or(Rejection::NotConfigured)
    }

    fn configure(&mut self, want: Config, events: &mut Vec<Event>) -> Result<Response, Rejection> {
        if let Some(have) = self.config {
            if have == want {
                return Ok(Response::Configured);
            }
            return Err(Rejection::ConfigMismatch { have, want });
        }
        KeySpace::new(want.partition_count).map_err(|e| Rejection::InvalidConfig(e.to_string()))?;
        check_lease_ttl(want.lease_ttl_ms)?;
        check_revoke_budget(want.max_revoking)?;
        self.config = Some(want);
        self.partitions = vec![PartitionRecord::default(); want.partition_count as usize];
        self.owned.clear();
        self.unowned = self.partitions.len();
        self.revoking = 0;
        self.changes.meta = true;
        events.push(Event::Configured { config: want });
        Ok(Response::Configured)
    }

    fn join(
        &mut self,
        name: &str,
        weight: u32,
        secret: &SecretHash,
        events: &mut Vec<Event>,
    ) -> Result<Response, Rejection> {
        self.require_config()?;
        check_join(name, weight)?;
        // A restarted worker is recognised by its name: the older incarnation is superseded and
        // gives its partitions up the graceful way (revoke, then release or lease expiry), because
        // it may still be alive and believing in its leases.
        let superseded = self.live_sessions_named(name).next();
        if let Some(old) = superseded {
            self.mark_leaving(old, events);
            self.end_if_idle(old, events);
        }
        self.next_session += 1;
        let session = SessionId(self.next_session);
        self.changes.meta = true;
        let weight = self.settings.weights.get(name).copied().unwrap_or(weight);
        self.put_session(
            session,
            SessionRecord { name: name.to_string(), weight, secret: *secret, leaving: false },
        );
        events.push(Event::SessionStarted { session, name: name.to_string() });
        Ok(Response::Joined { session, superseded })
    }

    fn release(
        &mut self,
        index: u64,
        session: SessionId,
        secret: &SecretHash,
        partitions: &[PartitionId],
        tokens: &[FencingToken],
        events: &mut Vec<Event>,
    ) -> Result<Response, Rejection> {
        self.authenticate_hash(session, secret)?;
        let config = self.require_config()?;
        // Validate everything before changing anything.
        for &p in partitions {
            let record = self
                .partitions
                .get(p.0 as usize)
                .ok_or(Rejection::PartitionOutOfRange { partition: p.0, count: config.partition_count })?;
            if record.owner != Some(session) {
                return Err(Rejection::NotOwner { partition: p, session });
            }
        }
        let mut released = Vec::new();
        for (i, &p) in partitions.iter().enumerate() {
            let record = self.partitions[p.0 as usize];
            if record.owner != Some(session) {
                continue; // listed twice
            }
            if tokens.get(i).is_some_and(|t| *t != record.token) {
                continue; // granted to this session again since: the newer grant stays
            }
            self.set_partition(p, let_go(record));
            events.push(Event::Released { partition: p, session, token: record.token });
            self.hand_over(index, p, record, events);
            released.push(p);
        }
        self.end_if_idle(session, events);
        Ok(Response::Released { partitions: released })
    }

    fn mark_leaving(&mut self, session: SessionId, events: &mut Vec<Event>) {
        if let Some(record) = self.sessions.get(&session) {
            if !record.leaving {
                let mut record = record.clone();
                record.leaving = true;
                self.put_session(session, record);
                events.push(Event::SessionLeaving { session });
            }
        }
    }

    /// Takes every partition a session owns (from the owner index: the cost is what it owns).
    fn lose_all(
        &mut self,
        index: u64,
        session: SessionId,
        reason: LostReason,
        events: &mut Vec<Event>,
    ) -> u32 {
        let mine: Vec<u32> = self.owned.get(&session).into_iter().flatten().copied().collect();
        for &p in &mine {
            let partition = PartitionId(p);
            let record = self.partitions[p as usize];
            self.set_partition(partition, let_go(record));
            events.push(Event::Lost { partition, session, token: record.token, reason });
            self.hand_over(index, partition, record, events);
        }
        mine.len() as u32
    }

    fn end_session(&mut self, session: SessionId, events: &mut Vec<Event>) {
        if let Some(record) = self.sessions.remove(&session) {
            self.unname(session, &record.name);
            self.changes.sessions.insert(session);
            events.push(Event::SessionEnded { session });
        }
    }

    fn put_session(&mut self, session: SessionId, record: SessionRecord) {
        self.named.entry(record.name.clone()).or_default().insert(session);
        if let Some(old) = self.sessions.insert(session, record) {
            if self.sessions[&session].name != old.name {
                self.unname(session, &old.name);
            }
        }
        self.changes.sessions.insert(session);
    }

    /// Drops `session` from the name index under `name`.
    fn unname(&mut self, session: SessionId, name: &str) {
        if let Some(set) = self.named.get_mut(name) {
            set.remove(&session);
            if set.is_empty() {
                self.named.remove(name);
            }
        }
    }

    /// Every change to a partition row goes through here, which keeps the owner index true.
    fn set_partition(&mut self, p: PartitionId, record: PartitionRecord) {
        let old = std::mem::replace(&mut self.partitions[p.0 as usize], record);
        self.unowned = self.unowned + usize::from(record.owner.is_none()) - usize::from(old.owner.is_none());
        self.revoking = self.revoking + usize::from(record.revoking) - usize::from(old.revoking);
        if old.owner != record.owner {
            if let Some(owner) = old.owner {
                let emptied = self.owned.get_mut(&owner).is_some_and(|set| {
                    set.remove(&p.0);
                    set.is_empty()
                });
                if emptied {
                    self.owned.remove(&owner);
                }
            }
            if let Some(owner) = record.owner {
                self.owned.entry(owner).or_default().insert(p.0);
            }
        }
        self.changes.partitions.insert(p.0);
    }
}

/// The row of a partition its owner has just let go (released, or lost): unowned, keeping the
/// last grant's token, and marked moved when it was let go while revoking.
fn let_go(record: PartitionRecord) -> PartitionRecord {
    PartitionRecord { token: record.token, moved: record.revoking, ..Default::default() }
}

/// A lease TTL a cluster may have: from [`MIN_LEASE_TTL_MS`] to [`MAX_LEASE_TTL_MS`].
pub fn check_lease_ttl(lease_ttl_ms: u64) -> Result<(), Rejection> {
    if !(MIN_LEASE_TTL_MS..=MAX_LEASE_TTL_MS).contains(&lease_ttl_ms) {
        return Err(Rejection::InvalidConfig(format!(
            "a lease TTL of {lease_ttl_ms} ms is outside {MIN_LEASE_TTL_MS} ms to {MAX_LEASE_TTL_MS} ms"
        )));
    }
    Ok(())
}

/// A revoke budget a cluster may have: none, or at least one partition.
pub fn check_revoke_budget(max_revoking: Option<u32>) -> Result<(), Rejection> {
    if max_revoking == Some(0) {
        return Err(Rejection::InvalidConfig("the revoke budget must be at least 1 partition".into()));
    }
    Ok(())
}

/// What a join must satisfy whatever the table holds: a name of 1 to [`MAX_NAME_BYTES`] bytes
/// without control characters, and a weight from 1 to [`MAX_WEIGHT`]. Apply checks
/// it, and so does the server before proposing, so a join that would be refused never becomes a
/// log entry.
pub fn check_join(name: &str, weight: u32) -> Result<(), Rejection> {
    if name.is_empty() || name.len() > MAX_NAME_BYTES || name.chars().any(char::is_control) {
        return Err(Rejection::InvalidName(format!(
            "must be 1 to {MAX_NAME_BYTES} bytes without control characters"
        )));
    }
    if weight == 0 || weight > MAX_WEIGHT {
        return Err(Rejection::InvalidWeight(weight));
    }
    Ok(())
}
