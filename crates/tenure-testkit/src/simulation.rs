//! A deterministic simulation of the lease protocol, for many seeds at low cost.
//!
//! The pieces that decide safety run for real: the ownership state machine ([`OwnershipState`]),
//! the leader's lease table ([`LeaseTable`]), placement and the fencing rule ([`FenceTable`]).
//! The worker's belief is the library's own [`Belief`], fed with the worker's drifting clock, so
//! the model cannot drift from the library: a partition is believed until `t_send + ttl - margin`,
//! an announced grant only after a heartbeat sent later confirms it, a grant given up never
//! comes back, and a release, leave or drop withdraws belief before anything is sent.
//! Around them everything that takes time is simulated from one seed, on one event queue: Raft
//! (a proposal commits after a short delay if its leader is still in office; a crashed leader's
//! uncommitted proposals are lost, a new one is elected after an election delay and starts its
//! lease table as a server does, [`LeaseTable::for_new_term`], sometimes with other flags than
//! the cluster was created with), the network (each message is delayed or lost; a worker's link
//! to the coordinator can be cut while its link to storage stays up; a write can sit in a buffer
//! for seconds), and the workers, whose clocks drift. Workers raise the fence before they work
//! (fence-before-resume), release when revoked, and also do what applications do on their own:
//! release a partition of their own accord, leave gracefully, get dropped, crash and come back
//! under the same name, freeze. After the run, two more replicas replay the committed log (one of
//! them through a snapshot in the real format, midway), and the final table is read from one of
//! them, not from the state that produced the log.
//!
//! The run records the same [`History`] as the nemesis and is judged by the same checker.
//! Everything derives from the seed, so a failing seed replays exactly. What is *not* simulated
//! is the code between these pieces: gRPC, openraft and the worker library's tasks; the nemesis
//! (`crate::nemesis`) runs those for real.

use crate::fence::FenceTable;
use crate::history::{self, Fault, History, Resumed, StoreRecord, WorkerOp, WorkerRecord};
use crate::ids::{FencingToken, PartitionId, SessionId};
use crate::lease::LeaseTable;
use crate::ownership::{Command, Event, OwnershipState, PartitionRecord, Response};
use crate::worker::{Belief, Change, End};
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
    /// A deliberate bug for the checker to catch (the library's order before it was fixed): a
    /// release is sent first and belief withdrawn only when its answer arrives.
    pub release_before_withdraw: bool,
    /// A deliberate bug for the checker to catch: a new leader ignores an unsettled lease TTL
    /// change and starts every lease by the current TTL, shorter than the one workers were told.
    pub forget_ttl_ceiling: bool,
    /// A deliberate bug for the checker to catch (leaders before partition rows marked moves):
    /// a new leader counts no move in motion, so it may revoke past the budget while the moves
    /// of its predecessor are still unconfirmed.
    pub forget_moves_in_motion: bool,
    /// The cluster's revoke budget (odd seeds have one of 1 to 3 partitions, so a sweep covers
    /// moves in waves).
    pub max_revoking: Option<u32>,
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
            release_before_withdraw: false,
            forget_ttl_ceiling: false,
            forget_moves_in_motion: false,
            max_revoking: (seed % 2 == 1).then_some(1 + (seed / 2 % 3) as u32),
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
/// How many kinds of fault [`Sim::inject`] knows.
const FAULT_KINDS: u32 = 9;

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
    /// The answer to a release: the library marks the release settled (and, under the planted
    /// `release_before_withdraw` bug, only now withdraws belief).
    ReleaseReply {
        w: usize,
        session: SessionId,
        partitions: Vec<PartitionId>,
        tokens: Vec<FencingToken>,
    },
    /// The worker's heartbeat task, kicked by an announcement: it sends a heartbeat just after.
    Kick {
        w: usize,
        session: SessionId,
    },
    HeartbeatReply {
        w: usize,
        session: SessionId,
        sent_local: Micros,
        renewed: Vec<(PartitionId, FencingToken)>,
        /// The TTL the leader renewed the lease by, as every answer says.
        ttl: Duration,
    },
    /// The end of a TTL change fault: an operator sets the cluster's TTL back, retrying until
    /// it is applied.
    RestoreTtl,
    SessionGone {
        w: usize,
        session: SessionId,
    },
    Stream {
        w: usize,
        session: SessionId,
        event: Event,
    },
    /// The worker (re)opens its ownership stream, which starts with a snapshot of what the
    /// session owns, read by the leader when the request arrives (as the server's watch does).
    WatchOpen {
        w: usize,
        session: SessionId,
    },
    StreamSnapshot {
        w: usize,
        session: SessionId,
        grants: Vec<(PartitionId, FencingToken, bool)>,
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

struct SimWorker {
    name: String,
    rate: f64,
    session: Option<SessionId>,
    /// The library's belief, on this worker's clock.
    belief: Belief,
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
    /// The hash of this incarnation's secret, as its commands carry it.
    fn secret(&self) -> tenure_coordinator::ownership::SecretHash {
        tenure_coordinator::ownership::SecretHash::of(&format!("{}-{}", self.name, self.life))
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
    /// The TTL the next elected leader was started with (its flags), which may differ from the
    /// cluster's.
    next_leader_ttl: Duration,
    /// The committed commands, for the replicas that replay them after the run.
    log: Vec<(u64, Command)>,
    /// A placement decision is on its way to commit: the next is made on the table it leaves.
    placing: bool,
    /// Something placement reads changed since the last decision. As the server's leader, the
    /// model decides again only then: after an entry that emitted events, after its own
    /// decision landed, and on taking over.
    replan: bool,
    // Workers and store.
    workers: Vec<SimWorker>,
    fences: FenceTable,
    history: History,
    store_seq: u64,
    budget: BudgetTruth,
}

/// The revoke budget judged from outside the leader, across leader changes: what is in motion
/// by the definition the budget is stated in, kept by the model rather than by any one
/// leader's lease table, which a leader change replaces.
struct BudgetTruth {
    /// Partitions revoked and since let go, whose next grant ends a move.
    let_go: BTreeSet<PartitionId>,
    /// Grants that ended a move and that no renewal of their owner, arriving at a leader after
    /// the grant was applied, has confirmed yet: owner and when the grant was applied.
    unconfirmed: BTreeMap<PartitionId, (SessionId, Micros)>,
    verdict: history::Verdict,
}

impl BudgetTruth {
    fn new() -> BudgetTruth {
        BudgetTruth {
            let_go: BTreeSet::new(),
            unconfirmed: BTreeMap::new(),
            verdict: history::Verdict::new("revoke budget"),
        }
    }

    fn observe(&mut self, now: Micros, events: &[Event]) {
        for event in events {
            match *event {
                Event::Revoking { partition, .. } => {
                    // Counted as revoking from now on, not twice.
                    self.unconfirmed.remove(&partition);
                    self.let_go.insert(partition);
                }
                Event::Released { partition, .. } | Event::Lost { partition, .. } => {
                    self.unconfirmed.remove(&partition);
                }
                Event::Granted { partition, session, .. } if self.let_go.remove(&partition) => {
                    self.unconfirmed.insert(partition, (session, now));
                }
                Event::SessionEnded { session } => self.unconfirmed.retain(|_, (owner, _)| *owner != session),
                _ => {}
            }
        }
    }

    /// A renewal of `session` that arrived at `received` and that a leader answered.
    fn renewed(&mut self, session: SessionId, received: Micros) {
        self.unconfirmed.retain(|_, (owner, granted)| *owner != session || *granted >= received);
    }

    /// Judges a committed decision before it is applied to `state`: the moves in motion and the
    /// revokes it adds must fit the budget.
    fn judge(&mut self, index: u64, state: &OwnershipState, command: &Command) {
        let Command::Place { revokes, .. } = command else { return };
        let Some(budget) = state.config().and_then(|c| c.max_revoking) else { return };
        let (revoking, unconfirmed) = (state.revoking_count(), self.unconfirmed.len());
        if !revokes.is_empty() && revoking + unconfirmed + revokes.len() > budget as usize {
            self.verdict.violation(format!(
                "entry {index} revokes {} with {revoking} revoking and {unconfirmed} moved but \
                 unconfirmed, over a budget of {budget}",
                revokes.len()
            ));
        }
    }
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

    /// Worker `w`'s monotonic clock at true time `t`, as [`Belief`] takes instants.
    fn clock(&self, w: usize, t: Micros) -> Instant {
        self.base + Duration::from_micros(self.workers[w].local(t))
    }

    /// The first true time at which worker `w`'s clock reads `at`.
    fn true_at(&self, w: usize, at: Instant) -> Micros {
        self.workers[w].true_of(at.duration_since(self.base).as_micros() as Micros)
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
            max_revoking: self.config.max_revoking,
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
            let kind = self.rng.random_range(0..FAULT_KINDS);
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
        let joined = self.workers[w].alive && !self.workers[w].frozen && self.workers[w].session.is_some();
        let what = match kind {
            0 if self.workers[w].alive && !self.workers[w].frozen => {
                self.workers[w].frozen = true;
                self.at(length, Ev::Thaw { w });
                format!("freeze {} for {} ms", self.workers[w].name, length / MS)
            }
            1 if self.workers[w].alive => {
                self.stop_worker(w, length);
                format!(
                    "crash {} for {} ms, then restart it under the same name",
                    self.workers[w].name,
                    length / MS
                )
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
            4 if self.leader_up => {
                // The next leader runs on flags other than the cluster's: a quarter to four
                // times its TTL.
                let ttl_ms = self.config.lease_ttl_ms;
                let flag_ms = self.rng.random_range(ttl_ms / 4..=ttl_ms * 4);
                self.next_leader_ttl = Duration::from_millis(flag_ms);
                self.at(0, Ev::LeaderCrash);
                format!("leader crash; the next leader runs with other flags (a {flag_ms} ms lease TTL)")
            }
            5 if joined => {
                // Of its own accord, not after a revoke: one or two believed partitions.
                let now = self.clock(w, self.now);
                let believed: Vec<PartitionId> =
                    self.workers[w].belief.believed_at(now).map(|(p, _)| p).collect();
                if believed.is_empty() {
                    return;
                }
                let n = self.rng.random_range(1..=believed.len().min(2));
                let first = self.rng.random_range(0..=believed.len() - n);
                let chosen = believed[first..first + n].to_vec();
                self.release(w, &chosen);
                format!("{} releases {:?} of its own accord", self.workers[w].name, chosen)
            }
            6 if joined => {
                self.leave(w, true, length);
                format!("{} leaves gracefully and comes back after {} ms", self.workers[w].name, length / MS)
            }
            7 if joined => {
                // Dropped: belief ends at once; the leave it spawns may never be sent.
                let sent = self.rng.random_bool(0.5);
                self.leave(w, sent, length);
                format!(
                    "{} is dropped (its leave {}sent) and comes back after {} ms",
                    self.workers[w].name,
                    if sent { "" } else { "never " },
                    length / MS
                )
            }
            8 if self.leader_up => {
                // An operator shortens the TTL to a fifth to a half of the cluster's, and sets
                // it back when the fault heals. A leader that took over meanwhile must still wait
                // out the longer TTL that earlier renewals were granted under.
                let ttl_ms = self.config.lease_ttl_ms;
                let short_ms = self.rng.random_range(ttl_ms / 5..=ttl_ms / 2);
                self.propose_now(Command::SetLeaseTtl { lease_ttl_ms: short_ms });
                self.at(length, Ev::RestoreTtl);
                let what =
                    format!("the lease TTL is set to {short_ms} ms, then back after {} ms", length / MS);
                if self.workers[w].cut || !self.rng.random_bool(0.5) {
                    what
                } else {
                    // The hard case: a worker last renewed under the longer TTL is cut off at
                    // once, and the leader crashes just after the change commits.
                    self.workers[w].cut = true;
                    self.at(length, Ev::Heal { w });
                    let crash = self.rng.random_range(10 * MS..100 * MS);
                    self.at(crash, Ev::LeaderCrash);
                    format!(
                        "{what}; {} is cut from the coordinator and the leader crashes",
                        self.workers[w].name
                    )
                }
            }
            _ => return,
        };
        self.history.faults.push(Fault { what, start_ns, healed_ns: (self.now + length) * 1000 });
    }

    /// Worker `w` opens its ownership stream again, if it has a session.
    fn reopen_watch(&mut self, w: usize) {
        if let (true, Some(session)) = (self.workers[w].alive, self.workers[w].session) {
            self.send(w, Ev::WatchOpen { w, session });
        }
    }

    /// The process stops (a crash, or an exit after leaving) and starts again after `length`.
    fn stop_worker(&mut self, w: usize, length: Micros) {
        let worker = &mut self.workers[w];
        worker.alive = false;
        worker.frozen = false;
        worker.inbox.clear();
        worker.life += 1;
        self.at(length, Ev::Restart { w });
    }

    /// The library's release: belief in `partitions` ends first (their handles are cancelled,
    /// `Released` reported), then the coordinator is told, naming each grant's token.
    fn release(&mut self, w: usize, partitions: &[PartitionId]) {
        let Some(session) = self.workers[w].session else { return };
        let secret = self.workers[w].secret();
        let (partitions, tokens): (Vec<PartitionId>, Vec<FencingToken>) =
            if self.config.release_before_withdraw {
                let held: BTreeMap<PartitionId, FencingToken> =
                    self.workers[w].belief.held().map(|(p, h)| (p, h.token)).collect();
                partitions.iter().filter_map(|p| held.get(p).map(|t| (*p, *t))).unzip()
            } else {
                let now = self.clock(w, self.now);
                let (withdrawn, changes) = self.workers[w].belief.withdraw(Some(partitions), now);
                self.changes(w, changes);
                withdrawn.into_iter().unzip()
            };
        if partitions.is_empty() {
            return;
        }
        self.send(
            w,
            Ev::Propose { command: Command::Release { session, secret, partitions, tokens }, from: Some(w) },
        );
    }

    /// A graceful leave (or a drop, whose leave may never be sent): belief in everything ends,
    /// the session is left and its partitions released, and the process exits; it comes back
    /// under the same name after `length`.
    fn leave(&mut self, w: usize, tell: bool, length: Micros) {
        let Some(session) = self.workers[w].session else { return };
        let now = self.clock(w, self.now);
        let (_, changes) = self.workers[w].belief.withdraw(None, now);
        self.changes(w, changes);
        if tell {
            // The release of everything follows once the leave is answered (see `commit`).
            let leave = Command::Leave { session, secret: self.workers[w].secret() };
            self.send(w, Ev::Propose { command: leave, from: Some(w) });
        }
        self.stop_worker(w, length);
    }

    /// Acts on what a step of the worker's belief changed, as the library and an application
    /// on top of it do, and records it.
    fn changes(&mut self, w: usize, changes: Vec<Change>) {
        let session = self.workers[w].session.unwrap_or(SessionId(0));
        for change in changes {
            match change {
                Change::Announced { .. } => {
                    // The library's heartbeat task is kicked and sends one just after, which
                    // may confirm it (one sent at the very instant of the announcement may not).
                    self.at(10, Ev::Kick { w, session });
                }
                Change::Granted { partition, token, valid_until } => {
                    // Fence before resume, then work.
                    let believed = Some(self.true_at(w, valid_until));
                    self.record(w, partition, token, WorkerOp::Acquired, self.now, believed);
                    self.store_send(w, session, partition, token, believed);
                }
                Change::Revoking { partition, token } => {
                    self.record(w, partition, token, WorkerOp::Revoked, self.now, None);
                    // The application finishes at once and releases.
                    self.release(w, &[partition]);
                }
                Change::Ended { partition, token, end } => {
                    let op = if end == End::Released { WorkerOp::Released } else { WorkerOp::Lost };
                    self.record(w, partition, token, op, self.now, None);
                }
                Change::Unreleased { partition, token } => {
                    // As the library does: the release is sent again.
                    let secret = self.workers[w].secret();
                    let command = Command::Release {
                        session,
                        secret,
                        partitions: vec![partition],
                        tokens: vec![token],
                    };
                    self.send(w, Ev::Propose { command, from: Some(w) });
                }
            }
        }
    }

    /// As the server's duty loop: with no decision in flight, decide on the applied table and
    /// propose. Leaders of odd and even terms run different placement rules (another ring
    /// seed), as the two versions of a rolling upgrade would; the log carries their decisions.
    fn place(&mut self) {
        if !self.leader_up || self.placing || !self.replan {
            return;
        }
        self.replan = false;
        let rules = tenure_coordinator::planner::Rules { ring_seed: self.epoch % 2 };
        // Moves granted but not yet confirmed by their new owner count toward the budget.
        let unconfirmed = self.leases.unconfirmed_moves();
        let plan = tenure_coordinator::planner::plan_all_in_motion(&self.state, &rules, unconfirmed);
        if let Some(command) = plan.into_iter().next() {
            self.placing = true;
            self.propose_now(command);
        }
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
            | Ev::ReleaseReply { w, .. }
            | Ev::Kick { w, .. }
            | Ev::HeartbeatReply { w, .. }
            | Ev::SessionGone { w, .. }
            | Ev::Stream { w, .. }
            | Ev::StreamSnapshot { w, .. } => Some(*w),
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
                let unconfirmed = self.leases.unconfirmed_moves();
                let ttl = match self.leases.renew(session, at) {
                    Some(ttl) if self.state.session(session).is_some() => ttl,
                    _ => {
                        self.send(w, Ev::SessionGone { w, session });
                        return;
                    }
                };
                self.budget.renewed(session, received);
                let renewed: Vec<(PartitionId, FencingToken)> = self
                    .state
                    .owned_by(session)
                    .into_iter()
                    .filter(|(_, r)| !r.revoking)
                    .map(|(p, r)| (p, r.token))
                    .collect();
                self.send(w, Ev::HeartbeatReply { w, session, sent_local, renewed, ttl });
                // As the server's leader: a confirmed move frees budget, so decide again.
                if self.leases.unconfirmed_moves() < unconfirmed {
                    self.replan = true;
                    self.place();
                }
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
                if let Some(changed_at) = due.settle {
                    self.propose_now(Command::SettleLeaseTtl { changed_at });
                }
            }
            Ev::RestoreTtl => {
                let want = self.config.lease_ttl_ms;
                if self.state.config().is_some_and(|c| c.lease_ttl_ms != want) {
                    if self.leader_up {
                        self.propose_now(Command::SetLeaseTtl { lease_ttl_ms: want });
                    }
                    self.at(100 * MS, Ev::RestoreTtl);
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
                // As a server taking over does, whatever its own flags say.
                let now = self.instant(self.now);
                self.leases = if self.config.forget_ttl_ceiling {
                    // The planted bug: a new leader that judges leases by the current TTL alone,
                    // as if every TTL change were settled.
                    let mut view = self.state.clone();
                    if let Some(change) = view.config().and_then(|c| c.ttl_change) {
                        view.apply(0, &Command::SettleLeaseTtl { changed_at: change.changed_at });
                    }
                    LeaseTable::for_new_term(now, &view, self.next_leader_ttl)
                } else if self.config.forget_moves_in_motion {
                    // The planted bug: a new leader that knows nothing of the moves in flight.
                    let unmarked =
                        self.state.partitions().iter().map(|r| PartitionRecord { moved: false, ..*r });
                    let view = OwnershipState::from_parts(
                        self.state.config(),
                        unmarked.collect(),
                        self.state.sessions().clone(),
                        self.state.next_session(),
                    )
                    .with_settings(self.state.settings().clone());
                    LeaseTable::for_new_term(now, &view, self.next_leader_ttl)
                } else {
                    LeaseTable::for_new_term(now, &self.state, self.next_leader_ttl)
                };
                self.next_leader_ttl = Duration::from_millis(self.config.lease_ttl_ms);
                // The old leader's decision in flight died with it.
                self.placing = false;
                self.replan = true;
                self.place();
                // Every worker's stream moves to the new leader.
                for w in 0..self.workers.len() {
                    self.reopen_watch(w);
                }
            }
            Ev::Restart { w } => {
                let worker = &mut self.workers[w];
                worker.alive = true;
                worker.session = None;
                worker.belief = Belief::new(worker.belief.ttl(), worker.belief.margin());
                worker.joining_since = self.now;
                let (name, secret) = (worker.name.clone(), worker.secret());
                self.send(
                    w,
                    Ev::Propose { command: Command::Join { name, weight: 1, secret }, from: Some(w) },
                );
                // The tick chain of this life: heartbeats once joined, a retried join if not.
                let life = self.workers[w].life;
                let every = self.workers[w].belief.ttl().as_micros() as Micros / 4;
                self.at(every, Ev::Tick { w, life });
            }
            Ev::Thaw { w } => {
                let worker = &mut self.workers[w];
                worker.frozen = false;
                // Awake, with the tokens it had: one write each, without a look at the lease.
                let held: Vec<(PartitionId, FencingToken)> =
                    worker.belief.held().map(|(p, h)| (p, h.token)).collect();
                let session = worker.session.unwrap_or(SessionId(0));
                for (p, token) in held {
                    self.store_send(w, session, p, token, None);
                }
                for ev in std::mem::take(&mut self.workers[w].inbox) {
                    self.handle(ev);
                }
            }
            Ev::Heal { w } => {
                self.workers[w].cut = false;
                self.reopen_watch(w);
            }
            Ev::JoinReply { w, session, life } => {
                let worker = &mut self.workers[w];
                if worker.life == life && worker.session.is_none() {
                    worker.session = Some(session);
                    self.at(0, Ev::WriteTick { w, life });
                    self.reopen_watch(w);
                }
            }
            Ev::ReleaseReply { w, session, partitions, tokens } => {
                if self.workers[w].session == Some(session) {
                    let now = self.clock(w, self.now);
                    if self.config.release_before_withdraw {
                        // The old order: belief in the grants released ends only now.
                        let held: Vec<PartitionId> = partitions
                            .iter()
                            .zip(&tokens)
                            .filter(|(p, t)| {
                                self.workers[w].belief.held().any(|(q, h)| q == **p && h.token == **t)
                            })
                            .map(|(p, _)| *p)
                            .collect();
                        let (_, changes) = self.workers[w].belief.withdraw(Some(&held), now);
                        self.changes(w, changes);
                    }
                    self.workers[w].belief.release_settled(&partitions, now);
                }
            }
            Ev::Kick { w, session } => {
                if self.workers[w].session == Some(session) {
                    let sent_local = self.workers[w].local(self.now);
                    self.send(w, Ev::HeartbeatArrives { w, session, sent_local });
                }
            }
            Ev::Tick { w, life } => self.tick(w, life),
            Ev::WriteTick { w, life } => self.write_tick(w, life),
            Ev::HeartbeatReply { w, session, sent_local, renewed, ttl } => {
                if self.workers[w].session != Some(session) {
                    return;
                }
                // As the library does: the lease runs by the TTL the answer names, less the
                // default margin of a fifth of it, and so does the heartbeat pace from now on.
                if ttl != self.workers[w].belief.ttl() {
                    self.workers[w].belief.retime(ttl, ttl / 5);
                }
                let now = self.clock(w, self.now);
                let sent = if self.config.lease_from_reply {
                    now
                } else {
                    self.base + Duration::from_micros(sent_local)
                };
                let changes = self.workers[w].belief.renewed(sent, now, renewed);
                self.changes(w, changes);
            }
            Ev::SessionGone { w, session } => {
                if self.workers[w].session == Some(session) {
                    let now = self.clock(w, self.now);
                    let changes = self.workers[w].belief.end_session(now);
                    self.changes(w, changes);
                    // Start a new session, as a worker does when its session ended.
                    self.workers[w].life += 1;
                    self.at(0, Ev::Restart { w });
                }
            }
            Ev::Stream { w, session, event } => self.stream(w, session, event),
            Ev::WatchOpen { w, session } => {
                if self.leader_up {
                    let grants = self
                        .state
                        .owned_by(session)
                        .into_iter()
                        .map(|(p, r)| (p, r.token, r.revoking))
                        .collect();
                    self.send(w, Ev::StreamSnapshot { w, session, grants });
                }
            }
            Ev::StreamSnapshot { w, session, grants } => {
                // As the server's watch: a revoking grant is sent as revoking only.
                for (partition, token, revoking) in grants {
                    let event = if revoking {
                        Event::Revoking { partition, session, token }
                    } else {
                        Event::Granted { partition, session, token }
                    };
                    self.stream(w, session, event);
                }
            }
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
                if !accepted && self.workers[w].alive && self.workers[w].session == Some(session) {
                    let now = self.clock(w, self.now);
                    let changes = self.workers[w].belief.fenced(p, token, now);
                    self.changes(w, changes);
                }
            }
        }
    }

    fn commit(&mut self, epoch: u64, command: Command, from: Option<usize>) {
        if !self.leader_up || epoch != self.epoch {
            return; // the leader that proposed it is gone before it committed
        }
        self.index += 1;
        self.budget.judge(self.index, &self.state, &command);
        let (response, events) = self.state.apply(self.index, &command);
        self.budget.observe(self.now, &events);
        self.log.push((self.index, command.clone()));
        if matches!(command, Command::Place { .. }) {
            self.placing = false;
            self.replan = true;
        }
        if !events.is_empty() {
            self.replan = true;
        }
        let now = self.instant(self.now);
        // As the server's leader does after each applied entry: the lease table follows it,
        // and only then is the next decision made (it reads the moves still unconfirmed).
        self.leases.follow(self.state.config());
        self.leases.observe(now, &events);
        self.place();
        let decisions = crate::recording::committed(1, self.index, self.now * 1000, &events);
        self.history.coordinator.extend(decisions);
        for event in &events {
            let Some((_, session, _, _)) = crate::recording::decision(event) else { continue };
            // The ownership stream of the session's worker.
            if let Some(w) = self.workers.iter().position(|x| x.session == Some(session)) {
                self.send(w, Ev::Stream { w, session, event: event.clone() });
            }
        }
        match (from, &response, command) {
            (Some(w), Response::Joined { session, .. }, _) => {
                let life = self.workers[w].life;
                self.send(w, Ev::JoinReply { w, session: *session, life });
            }
            (Some(w), Response::Released { .. }, Command::Release { session, partitions, tokens, .. }) => {
                self.send(w, Ev::ReleaseReply { w, session, partitions, tokens });
            }
            (Some(w), Response::Left, Command::Leave { session, secret }) => {
                // As the library's leave: everything is released once the leave is answered.
                let command = Command::ReleaseAll { session, secret };
                self.send(w, Ev::Propose { command, from: Some(w) });
            }
            _ => {}
        }
    }

    fn tick(&mut self, w: usize, life: u64) {
        if self.workers[w].life != life {
            return;
        }
        // A quarter of the TTL the last renewal named, on the worker's drifting clock.
        let every = self.workers[w].belief.ttl().as_micros() as Micros / 4;
        let interval = every as f64 / self.workers[w].rate;
        self.at(interval as Micros, Ev::Tick { w, life });
        let worker = &self.workers[w];
        let Some(session) = worker.session else {
            // Still joining: ask again if the join or its reply seems lost.
            if self.now.saturating_sub(worker.joining_since) > JOIN_RETRY {
                let (name, secret) = (worker.name.clone(), worker.secret());
                self.workers[w].joining_since = self.now;
                self.send(
                    w,
                    Ev::Propose { command: Command::Join { name, weight: 1, secret }, from: Some(w) },
                );
            }
            return;
        };
        // Drop what the local clock says has run out.
        let now = self.clock(w, self.now);
        let changes = self.workers[w].belief.expire(now);
        self.changes(w, changes);
        let sent_local = self.workers[w].local(self.now);
        self.send(w, Ev::HeartbeatArrives { w, session, sent_local });
    }

    fn write_tick(&mut self, w: usize, life: u64) {
        if self.workers[w].life != life {
            return;
        }
        self.at(WRITE_EVERY, Ev::WriteTick { w, life });
        let Some(session) = self.workers[w].session else { return };
        let now = self.clock(w, self.now);
        let believed: Vec<(PartitionId, FencingToken, Instant)> = self.workers[w]
            .belief
            .believed_at(now)
            .map(|(p, h)| (p, h.token, h.valid_until.expect("believed")))
            .collect();
        for (p, token, until) in believed {
            let until = self.true_at(w, until);
            self.store_send(w, session, p, token, Some(until));
        }
    }

    /// A write on its way to the store: usually quick, sometimes stuck in a buffer (or behind
    /// long work after the check) for seconds.
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
        let now = self.clock(w, self.now);
        let belief = &mut self.workers[w].belief;
        let changes = match event {
            Event::Granted { partition, token, .. } => belief.announced(partition, token, now),
            Event::Revoking { partition, token, .. } => belief.revoking(partition, token),
            Event::Lost { partition, token, .. } => belief.lost(partition, token, now),
            Event::Released { partition, token, .. } => belief.released(partition, token, now),
            Event::Configured { .. }
            | Event::SessionStarted { .. }
            | Event::SessionLeaving { .. }
            | Event::SessionEnded { .. }
            | Event::MaintenanceChanged { .. }
            | Event::WeightChanged { .. }
            | Event::Pinned { .. }
            | Event::LeaseTtlChanged { .. }
            | Event::LeaseTtlSettled { .. }
            | Event::RevokeBudgetChanged { .. }
            | Event::NamespaceDeleted => Vec::new(),
        };
        self.changes(w, changes);
    }

    /// Every partition owned by a live worker's session, nothing revoking, every worker
    /// believing exactly its rows.
    fn fully_owned(&self) -> bool {
        // A decision in flight, or one the leader has still to make (a join that has not been
        // placed yet), is a table still moving; so is a move not yet confirmed, which may hold
        // the next decision back (the revoke budget).
        if self.placing || self.leases.unconfirmed_moves() > 0 {
            return false;
        }
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
        self.workers.iter().enumerate().all(|(i, w)| {
            let now = self.clock(i, self.now);
            let believed: BTreeSet<PartitionId> = w.belief.believed_at(now).map(|(p, _)| p).collect();
            let rows: BTreeSet<PartitionId> = w
                .session
                .map(|s| self.state.owned_by(s).into_iter().map(|(p, _)| p).collect())
                .unwrap_or_default();
            believed == rows
        })
    }

    /// Two more replicas apply the committed log after the run, as followers would: node 2
    /// entry by entry, node 3 up to the middle, then through a snapshot in the stored format,
    /// then the rest. Their decisions join the history (without times: they are read back, not
    /// watched), and the final table is node 2's.
    fn replay_on_followers(&mut self) -> OwnershipState {
        let mut follower = OwnershipState::default();
        let mut lagging = OwnershipState::default();
        let middle = self.log.len() / 2;
        for (i, (index, command)) in self.log.iter().enumerate() {
            if i == middle {
                let data = crate::store::encode_table_snapshot(&lagging);
                lagging = crate::store::decode_table_snapshot(&data).expect("the snapshot format reads back");
                let installed = self.log[..i].last().map_or(0, |(index, _)| *index);
                let after = crate::recording::highest_index(&self.history.coordinator, 3);
                self.history.resumed.push(Resumed { node: 3, index: installed, after });
            }
            for (node, state) in [(2, &mut follower), (3, &mut lagging)] {
                let (_, events) = state.apply(*index, command);
                self.history.coordinator.extend(crate::recording::committed(node, *index, 0, &events));
            }
        }
        follower
    }

    fn finish(mut self, recovered_ms: Option<u64>, events: u64) -> SimOutcome {
        let follower = self.replay_on_followers();
        self.history.final_table = crate::recording::final_table(&follower);
        self.history.live_sessions =
            self.workers.iter().filter_map(|w| w.session.map(|s| (w.name.clone(), s))).collect();
        self.history.recovered_after_ms = recovered_ms;
        self.history.liveness_bound_ms = self.config.liveness_bound_ms();
        let mut report = history::check(&self.history);
        report.verdicts.push(self.budget.verdict);
        SimOutcome { history: self.history, report, events }
    }
}

/// Runs one seed.
pub fn simulate(config: &SimConfig) -> SimOutcome {
    let mut rng = StdRng::seed_from_u64(config.seed);
    let ttl = Duration::from_millis(config.lease_ttl_ms);
    let workers = (0..config.workers)
        .map(|i| SimWorker {
            name: format!("w{}", i + 1),
            rate: 1.0 + rng.random_range(-config.drift..=config.drift),
            session: None,
            belief: Belief::new(ttl, ttl / 5),
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
        leases: LeaseTable::new(ttl),
        next_leader_ttl: ttl,
        placing: false,
        replan: true,
        log: Vec::new(),
        workers,
        fences: FenceTable::default(),
        history: History::new(config.partition_count, config.lease_ttl_ms),
        store_seq: 0,
        budget: BudgetTruth::new(),
    };
    sim.run()
}
