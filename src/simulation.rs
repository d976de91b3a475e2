//! A deterministic simulation of the lease protocol, for many seeds at low cost.
//!
//! The pieces that decide safety run for real: the ownership state machine ([`OwnershipState`]),
//! the leader's lease table ([`LeaseTable`]), placement and the fencing rule ([`FenceTable`]).
//! Around them everything that takes time is simulated from one seed, on one event queue: Raft
//! (a proposal commits after a short delay if its leader is still in office; a crashed leader's
//! uncommitted proposals are lost, a new one is elected after an election delay and restarts every
//! lease), the network (each message is delayed or lost; a worker's link to the coordinator can
//! be cut while its link to storage stays up; a write can sit in a buffer for seconds), and the
//! workers, whose clocks drift. A worker follows the library's rules: it believes a partition
//! until `t_send + ttl - margin` by its own clock, counted from when it sent the heartbeat that
//! confirmed it; it stops believing when it sees a revoke and then releases; it raises the fence
//! before it works (fence-before-resume). Workers freeze, crash and restart; the leader crashes.
//!
//! The run records the same [`History`] as the nemesis and is judged by the same checker.
//! Everything derives from the seed, so a failing seed replays exactly. What is *not* simulated
//! is the code between these pieces: gRPC, openraft and the worker library's tasks; the nemesis
//! (`crate::nemesis`) runs those for real.

use crate::fence::FenceTable;
use crate::history::{self, Committed, Fault, History, StoreRecord, WorkerOp, WorkerRecord};
use crate::ids::{FencingToken, PartitionId, SessionId};
use crate::lease::LeaseTable;
use crate::ownership::{Command, Event, OwnershipState, Response};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;
use tokio::time::Instant;

/// Microseconds of simulated true time.
type Micros = u64;

const MS: Micros = 1000;

/// What a simulated run does.
#[derive(Clone, Debug)]
pub struct SimConfig {
    pub seed: u64,
    pub workers: usize,
    pub partition_count: u32,
    pub lease_ttl_ms: u64,
    /// How long faults are injected, in simulated time.
    pub fault_ms: u64,
    /// Chance that any one message is lost.
    pub loss: f64,
    /// Largest ordinary message delay.
    pub max_delay_ms: u64,
    /// Chance that a message is held up for 200-800 ms (a retransmission, a pause on either
    /// side) instead.
    pub slow: f64,
    /// Largest clock-rate error of a worker (0.02 = 2%); the library's margin (TTL/5) covers it.
    pub drift: f64,
    /// `false` switches the store's check off.
    pub fencing: bool,
    /// A deliberate bug for the checker to catch: count the lease from when the reply arrived
    /// rather than from when the heartbeat was sent.
    pub lease_from_reply: bool,
}

impl SimConfig {
    pub fn new(seed: u64) -> SimConfig {
        SimConfig {
            seed,
            workers: 4,
            partition_count: 8,
            lease_ttl_ms: 1000,
            fault_ms: 20_000,
            loss: 0.05,
            max_delay_ms: 40,
            slow: 0.01,
            drift: 0.02,
            fencing: true,
            lease_from_reply: false,
        }
    }

    fn ttl(&self) -> Micros {
        self.lease_ttl_ms * MS
    }

    /// Owned again after the faults heal within: an election, the new leader's fresh TTL, a
    /// crashed owner's TTL, and a second for the grant and its confirmation.
    pub fn liveness_bound_ms(&self) -> u64 {
        2 * self.lease_ttl_ms + ELECTION_MAX / MS + 1000
    }
}

const ELECTION_MIN: Micros = 300 * MS;
const ELECTION_MAX: Micros = 900 * MS;
const EXPIRY_CHECK: Micros = 20 * MS;
const WRITE_EVERY: Micros = 25 * MS;
/// A join with no answer is sent again after this, as the library's bounded retries do.
const JOIN_RETRY: Micros = 300 * MS;

#[derive(Clone, Debug)]
enum Ev {
    /// Leader side.
    Propose {
        command: Command,
        from: Option<usize>,
    },
    Commit {
        epoch: u64,
        command: Command,
        from: Option<usize>,
    },
    HeartbeatArrives {
        w: usize,
        session: SessionId,
        sent_local: Micros,
    },
    HeartbeatConfirmed {
        w: usize,
        session: SessionId,
        received: Micros,
        sent_local: Micros,
        epoch: u64,
    },
    ExpiryCheck,
    LeaderCrash,
    LeaderElected,
    /// Worker side.
    Tick {
        w: usize,
        life: u64,
    },
    WriteTick {
        w: usize,
        life: u64,
    },
    JoinReply {
        w: usize,
        session: SessionId,
        life: u64,
    },
    HeartbeatReply {
        w: usize,
        session: SessionId,
        sent_local: Micros,
        renewed: Vec<(PartitionId, FencingToken)>,
    },
    SessionGone {
        w: usize,
        session: SessionId,
    },
    Stream {
        w: usize,
        session: SessionId,
        event: Event,
    },
    Restart {
        w: usize,
    },
    Thaw {
        w: usize,
    },
    Heal {
        w: usize,
    },
    /// Store side: a write (or a fence raise) arriving.
    StoreWrite {
        w: usize,
        session: SessionId,
        p: PartitionId,
        token: FencingToken,
        sent: Micros,
        believed: Option<Micros>,
    },
}

#[derive(Clone, Debug)]
struct Held {
    token: FencingToken,
    revoking: bool,
    /// By the worker's own clock; `None` until a heartbeat confirms it.
    valid_until_local: Option<Micros>,
}

struct SimWorker {
    name: String,
    rate: f64,
    session: Option<SessionId>,
    held: BTreeMap<PartitionId, Held>,
    /// Grants it gave up: (token, when by its clock, whether a renewal sent later may bring it
    /// back), as the library keeps them.
    retired: BTreeMap<PartitionId, (FencingToken, Micros, bool)>,
    /// Bumped on every crash, so timers of a previous life are ignored.
    life: u64,
    alive: bool,
    frozen: bool,
    /// Messages that reached a frozen worker, handled when it thaws.
    inbox: Vec<Ev>,
    cut: bool,
    /// When the pending join was sent, so a lost one is retried.
    joining_since: Micros,
}

impl SimWorker {
    fn local(&self, t: Micros) -> Micros {
        (t as f64 * self.rate) as Micros
    }
    /// The first true instant at which the local clock reads `local`.
    fn true_of(&self, local: Micros) -> Micros {
        (local as f64 / self.rate).ceil() as Micros
    }
    /// Stops holding `p`, remembering the grant as the library does.
    fn drop_held(&mut self, p: PartitionId, now_local: Micros, may_return: bool) -> Option<Held> {
        let h = self.held.remove(&p)?;
        self.retired.insert(p, (h.token, now_local, may_return && !h.revoking));
        Some(h)
    }

    fn believes(&self, p: PartitionId, now_local: Micros) -> Option<&Held> {
        self.held.get(&p).filter(|h| !h.revoking && h.valid_until_local.is_some_and(|v| v > now_local))
    }
}

struct Sim {
    config: SimConfig,
    rng: StdRng,
    now: Micros,
    seq: u64,
    queue: BTreeMap<(Micros, u64), Ev>,
    base: Instant,
    // Coordinator.
    state: OwnershipState,
    index: u64,
    epoch: u64,
    leader_up: bool,
    leases: LeaseTable,
    // Workers and store.
    workers: Vec<SimWorker>,
    fences: FenceTable,
    history: History,
    store_seq: u64,
}

/// What a run produced.
pub struct SimOutcome {
    pub history: History,
    pub report: history::Report,
    pub events: u64,
}

impl Sim {
    fn at(&mut self, delay: Micros, ev: Ev) {
        self.seq += 1;
        self.queue.insert((self.now + delay, self.seq), ev);
    }

    /// Usually up to `max_delay_ms`; sometimes (`slow`) held up for up to 800 ms.
    fn delay(&mut self) -> Micros {
        if self.rng.random_bool(self.config.slow) {
            self.rng.random_range(200 * MS..800 * MS)
        } else {
            self.rng.random_range(MS / 2..=self.config.max_delay_ms * MS)
        }
    }

    /// A message over the network to or from worker `w`: lost, or delivered after a delay.
    fn send(&mut self, w: usize, ev: Ev) {
        if self.workers[w].cut || self.rng.random_bool(self.config.loss) {
            return;
        }
        let d = self.delay();
        self.at(d, ev);
    }

    fn instant(&self, t: Micros) -> Instant {
        self.base + Duration::from_micros(t)
    }

    fn record(
        &mut self,
        w: usize,
        p: PartitionId,
        token: FencingToken,
        op: WorkerOp,
        start: Micros,
        believed: Option<Micros>,
    ) {
        let worker = &self.workers[w];
        self.history.workers.push(WorkerRecord {
            worker: worker.name.clone(),
            session: worker.session.unwrap_or(SessionId(0)),
            partition: p,
            token,
            op,
            start_ns: start * 1000,
            end_ns: self.now * 1000,
            believed_until_ns: believed.map(|b| b * 1000),
        });
    }

    fn run(mut self) -> SimOutcome {
        let ttl = self.config.ttl();
        self.propose_now(Command::Configure {
            partition_count: self.config.partition_count,
            lease_ttl_ms: self.config.lease_ttl_ms,
        });
        self.at(0, Ev::ExpiryCheck);
        for w in 0..self.workers.len() {
            let d = self.rng.random_range(0..200 * MS);
            self.at(d, Ev::Restart { w });
        }
        // Faults: one at a time, from the seed.
        let mut t = 2000 * MS;
        let mut faults = Vec::new();
        while t < self.config.fault_ms * MS {
            let w = self.rng.random_range(0..self.workers.len());
            let kind = self.rng.random_range(0..4);
            let length = self.rng.random_range(ttl / 2..=3 * ttl);
            faults.push((t, kind, w, length));
            t += length + self.rng.random_range(300 * MS..1500 * MS);
        }
        let mut events = 0u64;
        let mut next_fault = 0;
        let end_of_faults = t;
        let deadline = end_of_faults + 30 * ttl;
        let mut recovered = None;
        while let Some(((when, _), ev)) = self.queue.pop_first() {
            if when > deadline {
                break;
            }
            // Inject the faults that are due before this event.
            while next_fault < faults.len() && faults[next_fault].0 <= when {
                let (at, kind, w, length) = faults[next_fault];
                self.now = at;
                self.inject(kind, w, length);
                next_fault += 1;
            }
            self.now = when;
            events += 1;
            self.handle(ev);
            if self.now >= end_of_faults && recovered.is_none() && self.fully_owned() {
                recovered = Some(self.now - end_of_faults);
                break;
            }
        }
        self.finish(recovered.map(|r| r / MS), events)
    }

    fn inject(&mut self, kind: u32, w: usize, length: Micros) {
        let start_ns = self.now * 1000;
        let what = match kind {
            0 if self.workers[w].alive && !self.workers[w].frozen => {
                self.workers[w].frozen = true;
                self.at(length, Ev::Thaw { w });
                format!("freeze {} for {} ms", self.workers[w].name, length / MS)
            }
            1 if self.workers[w].alive => {
                let worker = &mut self.workers[w];
                worker.alive = false;
                worker.frozen = false;
                worker.inbox.clear();
                worker.held.clear();
                worker.life += 1;
                self.at(length, Ev::Restart { w });
                format!("crash {} for {} ms", self.workers[w].name, length / MS)
            }
            2 if !self.workers[w].cut => {
                self.workers[w].cut = true;
                self.at(length, Ev::Heal { w });
                format!("cut {} from the coordinator for {} ms", self.workers[w].name, length / MS)
            }
            3 if self.leader_up => {
                self.at(0, Ev::LeaderCrash);
                "leader crash".to_string()
            }
            _ => return,
        };
        self.history.faults.push(Fault { what, start_ns, healed_ns: (self.now + length) * 1000 });
    }

    fn propose_now(&mut self, command: Command) {
        let d = self.rng.random_range(MS..5 * MS);
        self.at(d, Ev::Commit { epoch: self.epoch, command, from: None });
    }

    fn handle(&mut self, ev: Ev) {
        // A frozen worker handles nothing until it thaws.
        let target = match &ev {
            Ev::Tick { w, .. }
            | Ev::WriteTick { w, .. }
            | Ev::JoinReply { w, .. }
            | Ev::HeartbeatReply { w, .. }
            | Ev::SessionGone { w, .. }
            | Ev::Stream { w, .. } => Some(*w),
            _ => None,
        };
        if let Some(w) = target {
            if !self.workers[w].alive {
                return;
            }
            if self.workers[w].frozen {
                self.workers[w].inbox.push(ev);
                return;
            }
        }
        match ev {
            Ev::Propose { command, from } => {
                if self.leader_up {
                    let d = self.rng.random_range(MS..5 * MS);
                    self.at(d, Ev::Commit { epoch: self.epoch, command, from });
                }
            }
            Ev::Commit { epoch, command, from } => self.commit(epoch, command, from),
            Ev::HeartbeatArrives { w, session, sent_local } => {
                if !self.leader_up {
                    return;
                }
                if self.state.session(session).is_none() {
                    self.send(w, Ev::SessionGone { w, session });
                    return;
                }
                let now = self.instant(self.now);
                if self.leases.renewable(session, now) {
                    // One quorum round confirms leadership after the heartbeat arrived.
                    let d = self.rng.random_range(MS / 2..3 * MS);
                    let (received, epoch) = (self.now, self.epoch);
                    self.at(d, Ev::HeartbeatConfirmed { w, session, received, sent_local, epoch });
                }
            }
            Ev::HeartbeatConfirmed { w, session, received, sent_local, epoch } => {
                if !self.leader_up || epoch != self.epoch {
                    return;
                }
                let at = self.instant(received);
                // As the server does: the session must be in the applied state to be renewed.
                if self.state.session(session).is_none() || !self.leases.renew(session, at) {
                    self.send(w, Ev::SessionGone { w, session });
                    return;
                }
                let renewed: Vec<(PartitionId, FencingToken)> = self
                    .state
                    .owned_by(session)
                    .into_iter()
                    .filter(|(_, r)| !r.revoking)
                    .map(|(p, r)| (p, r.token))
                    .collect();
                self.send(w, Ev::HeartbeatReply { w, session, sent_local, renewed });
            }
            Ev::ExpiryCheck => {
                self.at(EXPIRY_CHECK, Ev::ExpiryCheck);
                if !self.leader_up {
                    return;
                }
                let due = self.leases.due(self.instant(self.now));
                if !due.sessions.is_empty() {
                    self.propose_now(Command::Expire { sessions: due.sessions });
                }
                if !due.revoking.is_empty() {
                    self.propose_now(Command::ExpireRevoking { partitions: due.revoking });
                }
            }
            Ev::LeaderCrash => {
                self.leader_up = false;
                self.leases.clear();
                let d = self.rng.random_range(ELECTION_MIN..ELECTION_MAX);
                self.at(d, Ev::LeaderElected);
            }
            Ev::LeaderElected => {
                self.epoch += 1;
                self.leader_up = true;
                let now = self.instant(self.now);
                self.leases.reset(now, &self.state);
            }
            Ev::Restart { w } => {
                let worker = &mut self.workers[w];
                worker.alive = true;
                worker.session = None;
                worker.held.clear();
                worker.retired.clear();
                worker.joining_since = self.now;
                let name = worker.name.clone();
                let secret = format!("{}-{}", name, worker.life);
                self.send(
                    w,
                    Ev::Propose { command: Command::Join { name, weight: 1, secret }, from: Some(w) },
                );
                // The tick chain of this life: heartbeats once joined, a retried join if not.
                let life = self.workers[w].life;
                self.at(self.config.ttl() / 4, Ev::Tick { w, life });
            }
            Ev::Thaw { w } => {
                let worker = &mut self.workers[w];
                worker.frozen = false;
                // Awake, with the tokens it had: one write each, without a look at the lease.
                let held: Vec<(PartitionId, FencingToken)> =
                    worker.held.iter().map(|(p, h)| (*p, h.token)).collect();
                let session = worker.session.unwrap_or(SessionId(0));
                for (p, token) in held {
                    self.store_send(w, session, p, token, None);
                }
                for ev in std::mem::take(&mut self.workers[w].inbox) {
                    self.handle(ev);
                }
            }
            Ev::Heal { w } => self.workers[w].cut = false,
            Ev::JoinReply { w, session, life } => {
                let worker = &mut self.workers[w];
                if worker.life == life && worker.session.is_none() {
                    worker.session = Some(session);
                    self.at(0, Ev::WriteTick { w, life });
                }
            }
            Ev::Tick { w, life } => self.tick(w, life),
            Ev::WriteTick { w, life } => self.write_tick(w, life),
            Ev::HeartbeatReply { w, session, sent_local, renewed } => {
                if self.workers[w].session != Some(session) {
                    return;
                }
                let margin = self.config.ttl() / 5;
                let counted_from =
                    if self.config.lease_from_reply { self.workers[w].local(self.now) } else { sent_local };
                let until_local = counted_from + self.config.ttl() - margin;
                if until_local <= self.workers[w].local(self.now) {
                    return; // it took so long that it confirms nothing any more
                }
                for (p, token) in renewed {
                    let worker = &mut self.workers[w];
                    let first = match worker.held.get_mut(&p) {
                        Some(h) if h.token == token => {
                            if h.revoking {
                                continue;
                            }
                            let first = h.valid_until_local.is_none();
                            h.valid_until_local = Some(h.valid_until_local.unwrap_or(0).max(until_local));
                            first
                        }
                        Some(h) if h.token > token => continue,
                        _ => {
                            if let Some(&(retired, at_local, may_return)) = worker.retired.get(&p) {
                                let comes_back = may_return && retired == token && sent_local > at_local;
                                if token < retired || (token == retired && !comes_back) {
                                    continue; // an answer about a grant it already gave up
                                }
                            }
                            worker.held.insert(
                                p,
                                Held { token, revoking: false, valid_until_local: Some(until_local) },
                            );
                            true
                        }
                    };
                    if first {
                        // Fence before resume, then work.
                        let believed = Some(self.workers[w].true_of(until_local));
                        self.record(w, p, token, WorkerOp::Acquired, self.now, believed);
                        self.store_send(w, session, p, token, believed);
                    }
                }
            }
            Ev::SessionGone { w, session } => {
                if self.workers[w].session == Some(session) {
                    let held: Vec<(PartitionId, Held)> =
                        std::mem::take(&mut self.workers[w].held).into_iter().collect();
                    for (p, h) in held {
                        self.record(w, p, h.token, WorkerOp::Lost, self.now, None);
                    }
                    // Start a new session, as a worker does when its session ended.
                    self.workers[w].life += 1;
                    self.at(0, Ev::Restart { w });
                }
            }
            Ev::Stream { w, session, event } => self.stream(w, session, event),
            Ev::StoreWrite { w, session, p, token, sent, believed } => {
                let accepted = if self.config.fencing { self.fences.admit(p, token).is_ok() } else { true };
                self.history.store.push(StoreRecord { seq: self.store_seq, partition: p, token, accepted });
                self.store_seq += 1;
                self.history.workers.push(WorkerRecord {
                    worker: self.workers[w].name.clone(),
                    session,
                    partition: p,
                    token,
                    op: if accepted { WorkerOp::Wrote } else { WorkerOp::Refused },
                    start_ns: sent * 1000,
                    end_ns: self.now * 1000,
                    believed_until_ns: believed.map(|b| b * 1000),
                });
                if !accepted {
                    let worker = &mut self.workers[w];
                    if worker.session == Some(session)
                        && worker.held.get(&p).is_some_and(|h| h.token <= token)
                    {
                        let now_local = worker.local(self.now);
                        worker.drop_held(p, now_local, false);
                        self.record(w, p, token, WorkerOp::Lost, self.now, None);
                    }
                }
            }
        }
    }

    fn commit(&mut self, epoch: u64, command: Command, from: Option<usize>) {
        if !self.leader_up || epoch != self.epoch {
            return; // the leader that proposed it is gone before it committed
        }
        self.index += 1;
        let (response, events) = self.state.apply(self.index, &command);
        let now = self.instant(self.now);
        self.leases.observe(now, &events);
        for event in &events {
            let Some((partition, session, token, decision)) = event.decision() else { continue };
            self.history.coordinator.push(Committed {
                node: 1,
                index: self.index,
                at_ns: self.now * 1000,
                partition,
                session,
                token,
                decision,
            });
            // The ownership stream of the session's worker.
            if let Some(w) = self.workers.iter().position(|x| x.session == Some(session)) {
                self.send(w, Ev::Stream { w, session, event: event.clone() });
            }
        }
        if let (Some(w), Response::Joined { session, .. }) = (from, &response) {
            let life = self.workers[w].life;
            self.send(w, Ev::JoinReply { w, session: *session, life });
        }
    }

    fn tick(&mut self, w: usize, life: u64) {
        if self.workers[w].life != life {
            return;
        }
        let interval = (self.config.ttl() / 4) as f64 / self.workers[w].rate;
        self.at(interval as Micros, Ev::Tick { w, life });
        let worker = &self.workers[w];
        let Some(session) = worker.session else {
            // Still joining: ask again if the join or its reply seems lost.
            if self.now.saturating_sub(worker.joining_since) > JOIN_RETRY {
                let (name, secret) = (worker.name.clone(), format!("{}-{}", worker.name, worker.life));
                self.workers[w].joining_since = self.now;
                self.send(
                    w,
                    Ev::Propose { command: Command::Join { name, weight: 1, secret }, from: Some(w) },
                );
            }
            return;
        };
        // Drop what the local clock says has run out.
        let now_local = worker.local(self.now);
        let expired: Vec<(PartitionId, FencingToken)> = worker
            .held
            .iter()
            .filter(|(_, h)| h.valid_until_local.is_some_and(|v| v <= now_local))
            .map(|(p, h)| (*p, h.token))
            .collect();
        for (p, token) in expired {
            self.workers[w].drop_held(p, now_local, true);
            self.record(w, p, token, WorkerOp::Lost, self.now, None);
        }
        self.send(w, Ev::HeartbeatArrives { w, session, sent_local: now_local });
    }

    fn write_tick(&mut self, w: usize, life: u64) {
        if self.workers[w].life != life {
            return;
        }
        self.at(WRITE_EVERY, Ev::WriteTick { w, life });
        let worker = &self.workers[w];
        let Some(session) = worker.session else { return };
        let now_local = worker.local(self.now);
        let believed: Vec<(PartitionId, FencingToken, Micros)> = worker
            .held
            .keys()
            .filter_map(|p| {
                worker.believes(*p, now_local).map(|h| (*p, h.token, h.valid_until_local.unwrap_or(0)))
            })
            .collect();
        for (p, token, until_local) in believed {
            let until = self.workers[w].true_of(until_local);
            self.store_send(w, session, p, token, Some(until));
        }
    }

    /// A write on its way to the store: usually quick, sometimes stuck in a buffer for seconds.
    fn store_send(
        &mut self,
        w: usize,
        session: SessionId,
        p: PartitionId,
        token: FencingToken,
        believed: Option<Micros>,
    ) {
        let d = if self.rng.random_bool(0.01) {
            self.rng.random_range(500 * MS..3000 * MS)
        } else {
            self.rng.random_range(100..2 * MS)
        };
        let sent = self.now;
        self.at(d, Ev::StoreWrite { w, session, p, token, sent, believed });
    }

    fn stream(&mut self, w: usize, session: SessionId, event: Event) {
        if self.workers[w].session != Some(session) {
            return;
        }
        match event {
            Event::Granted { partition, token, .. } => {
                let worker = &mut self.workers[w];
                if worker.held.get(&partition).is_none_or(|h| h.token < token) {
                    worker.held.insert(partition, Held { token, revoking: false, valid_until_local: None });
                    // The library sends a heartbeat at once to confirm it.
                    let sent_local = worker.local(self.now);
                    self.send(w, Ev::HeartbeatArrives { w, session, sent_local });
                }
            }
            Event::Revoking { partition, token, .. } => {
                let worker = &mut self.workers[w];
                if let Some(h) = worker.held.get_mut(&partition).filter(|h| h.token == token && !h.revoking) {
                    h.revoking = true;
                    let believed = h.valid_until_local.is_some();
                    if believed {
                        self.record(w, partition, token, WorkerOp::Revoked, self.now, None);
                    }
                    let secret = format!("{}-{}", self.workers[w].name, self.workers[w].life);
                    // As the library does: the release names the grant it gives back.
                    let command = Command::Release {
                        session,
                        secret,
                        partitions: vec![partition],
                        tokens: vec![token],
                    };
                    self.send(w, Ev::Propose { command, from: Some(w) });
                }
            }
            Event::Lost { partition, token, .. } | Event::Released { partition, token, .. } => {
                let worker = &mut self.workers[w];
                if worker.held.get(&partition).is_some_and(|h| h.token == token) {
                    let now_local = worker.local(self.now);
                    worker.drop_held(partition, now_local, false);
                    self.record(w, partition, token, WorkerOp::Lost, self.now, None);
                }
            }
            Event::SessionStarted { .. } | Event::SessionEnded { .. } => {}
        }
    }

    /// Every partition owned by a live worker's session, nothing revoking, every worker
    /// believing exactly its rows.
    fn fully_owned(&self) -> bool {
        if !self.leader_up
            || self.workers.iter().any(|w| !w.alive || w.frozen || w.cut || w.session.is_none())
        {
            return false;
        }
        // A worker may not have heard yet that its session expired: not recovered until it has.
        if self
            .workers
            .iter()
            .any(|w| w.session.and_then(|s| self.state.session(s)).is_none_or(|r| r.leaving))
        {
            return false;
        }
        let live: BTreeSet<SessionId> = self.workers.iter().filter_map(|w| w.session).collect();
        if self.state.partitions().iter().any(|r| r.revoking || !r.owner.is_some_and(|o| live.contains(&o))) {
            return false;
        }
        self.workers.iter().all(|w| {
            let now_local = w.local(self.now);
            let believed: BTreeSet<PartitionId> =
                w.held.keys().filter(|p| w.believes(**p, now_local).is_some()).copied().collect();
            let rows: BTreeSet<PartitionId> = w
                .session
                .map(|s| self.state.owned_by(s).into_iter().map(|(p, _)| p).collect())
                .unwrap_or_default();
            believed == rows
        })
    }

    fn finish(mut self, recovered_ms: Option<u64>, events: u64) -> SimOutcome {
        self.history.final_table = self.state.final_table();
        self.history.live_sessions =
            self.workers.iter().filter_map(|w| w.session.map(|s| (w.name.clone(), s))).collect();
        self.history.recovered_after_ms = recovered_ms;
        self.history.liveness_bound_ms = self.config.liveness_bound_ms();
        let report = history::check(&self.history);
        SimOutcome { history: self.history, report, events }
    }
}

/// Runs one seed.
pub fn simulate(config: &SimConfig) -> SimOutcome {
    let mut rng = StdRng::seed_from_u64(config.seed);
    let workers = (0..config.workers)
        .map(|i| SimWorker {
            name: format!("w{}", i + 1),
            rate: 1.0 + rng.random_range(-config.drift..=config.drift),
            session: None,
            held: BTreeMap::new(),
            retired: BTreeMap::new(),
            life: 0,
            alive: false,
            frozen: false,
            inbox: Vec::new(),
            cut: false,
            joining_since: 0,
        })
        .collect();
    let sim = Sim {
        config: config.clone(),
        rng,
        now: 0,
        seq: 0,
        queue: BTreeMap::new(),
        base: Instant::now(),
        state: OwnershipState::default(),
        index: 0,
        epoch: 1,
        leader_up: true,
        leases: LeaseTable::new(Duration::from_millis(config.lease_ttl_ms)),
        workers,
        fences: FenceTable::default(),
        history: History::new(config.partition_count, config.lease_ttl_ms),
        store_seq: 0,
    };
    sim.run()
}
