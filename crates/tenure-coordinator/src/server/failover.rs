//! A follower stands for election as soon as its leader has been silent for longer than the
//! other voters can still trust it, instead of waiting that long and then a randomised election
//! timeout on top.
//!
//! openraft 0.9 has a follower of a committed leader wait its leader lease (the election
//! timeout's upper bound) after the leader's last message, and then its own election timeout,
//! before it stands: 1.5 to 2 times the upper bound in all. Until then every worker's renewals
//! go unanswered, and at a short TTL their local leases run out together. Here a follower that
//! has heard nothing for the lease and a little more asks openraft to campaign at once; the
//! other voters, whose leases on the silent leader ran out at about the same moment, can grant
//! the vote. Followers go in the order of their ids, one Raft heartbeat interval apart, so two of
//! them rarely split the vote; the first goes one interval after the lease, leaving a leader's
//! planned handover (whose successor campaigns right after the lease) to go first.
//!
//! Nothing safe depends on this timing. Raft's election rules (one vote per term, a log at least
//! as long as the voter's) hold whenever a campaign starts, and a voter that still hears its
//! leader refuses the vote (its leader lease). Leases do not lean on the election either: the
//! old leader confirmed each batch of renewals through a quorum after they arrived, so any later
//! election follows those arrivals, and a new leader starts every lease at its election plus a
//! TTL. An early campaign can only cost a needless election when a follower alone loses its
//! link, as openraft's own timer would a little later.

use crate::ids::NodeId;
use crate::raft::Raft;
use openraft::ServerState;
use std::time::Duration;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// How long to wait, and how often to look.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Timing {
    /// How long the other voters trust a silent leader: openraft's leader lease (the election
    /// timeout's upper bound) and one Raft heartbeat interval of margin.
    pub lease: Duration,
    /// The Raft heartbeat interval: the gap between followers' campaigns, and half of it how
    /// often silence is checked.
    pub step: Duration,
    /// After a campaign that did not make a leader, openraft's own timers take over; this
    /// node campaigns early again only once this long has passed.
    pub retry_after: Duration,
}

impl Timing {
    /// How long the follower ranked `rank` (0 for the smallest id but the leader's) waits
    /// after the leader's last message.
    fn wait(&self, rank: usize) -> Duration {
        self.lease + self.step * (rank as u32 + 1)
    }
}

/// Watches the leader's silence on this node until `stop`, and campaigns when it lasts; never
/// while the node drains (a stopping node must not take leadership back).
///
/// Silence is read from openraft's own record, the instant this node's vote last changed or a
/// leader's message was last accepted, so a node that has just learnt of a newer leader (a
/// deposed leader waking from a freeze, say) counts from that moment and does not campaign
/// against it.
pub(crate) async fn stand_when_silent(
    raft: Raft,
    me: NodeId,
    timing: Timing,
    draining: CancellationToken,
    stop: CancellationToken,
) {
    let mut ticks = tokio::time::interval((timing.step / 2).max(Duration::from_millis(1)));
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut last_campaign: Option<Instant> = None;
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = ticks.tick() => {}
        }
        if draining.is_cancelled() {
            continue;
        }
        let rank = {
            let metrics = raft.metrics();
            let m = metrics.borrow();
            match m.current_leader {
                Some(leader) if m.state == ServerState::Follower && leader != me => {
                    let mut others = m.membership_config.membership().voter_ids().filter(|v| *v != leader);
                    others.position(|v| v == me)
                }
                _ => None,
            }
        };
        // A learner, a candidate or the leader itself: nothing to do here.
        let Some(rank) = rank else { continue };
        // Only a committed vote (an established leader) and a known instant count.
        let heard = raft
            .with_raft_state(|s| {
                let committed = s.server_state == ServerState::Follower && s.vote_ref().is_committed();
                s.vote_last_modified().filter(|_| committed)
            })
            .await;
        let silent = match heard {
            Ok(Some(at)) => at.elapsed(),
            Ok(None) => continue,
            Err(_) => return,
        };
        if silent < timing.wait(rank) || last_campaign.is_some_and(|t| t.elapsed() < timing.retry_after) {
            continue;
        }
        last_campaign = Some(Instant::now());
        tracing::info!(
            node = me,
            silent_ms = silent.as_millis() as u64,
            "the leader is silent: standing for election"
        );
        if let Err(e) = raft.trigger().elect().await {
            tracing::warn!(error = %e, "could not stand for election");
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn followers_go_one_step_apart_after_the_lease() {
        let timing = Timing {
            lease: Duration::from_millis(350),
            step: Duration::from_millis(50),
            retry_after: Duration::from_millis(300),
        };
        assert_eq!(timing.wait(0), Duration::from_millis(400));
        assert_eq!(timing.wait(1), Duration::from_millis(450));
    }
}
