//! Applied entries delivered to the sessions they concern, and to no other.
//!
//! Each open ownership stream follows one session. Handing every applied entry to every stream
//! (a broadcast each stream filters) costs O(sessions) wake-ups per entry: with 10,000 sessions
//! joining, that is 10,000 streams woken for each of 10,000 joins, and a stream that falls
//! behind the shared buffer must reconnect and read its state again, which adds to the load
//! that made it fall behind. Here an entry goes only to the subscribers of the sessions its
//! events name, so an entry costs what it changes.
//!
//! Invariant kept: a subscriber registered before it reads the applied state receives every
//! entry applied after that read (entries are published after their state is written, and the
//! registration comes first), or learns that it missed some: a subscriber whose queue is full,
//! or any subscriber when a snapshot replaces entries, is told [`Delivery::Resync`] or, if even
//! that does not fit, dropped, which its receiver sees as the end of the channel. Nothing is
//! skipped silently.

use super::AppliedEvent;
use crate::ids::SessionId;
use crate::ownership::{Event, Namespace};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use tokio::sync::mpsc;

/// How many entries concerning one session may wait for its stream before it must resynchronise.
const QUEUE: usize = 1024;

/// What a session's subscriber receives.
#[derive(Clone, Debug)]
pub enum Delivery {
    /// An applied entry with at least one event about the session.
    Entry(Arc<AppliedEvent>),
    /// Entries were not delivered (a snapshot replaced them, or the queue was full): read the
    /// state again.
    Resync,
}

/// The session an event is about, if it is about one session's ownership.
fn session_of(event: &Event) -> Option<SessionId> {
    match *event {
        Event::SessionEnded { session } => Some(session),
        _ => event.ownership().map(|(_, session)| session),
    }
}

/// One session's subscribers, each with its registration number.
type Subscribers = Vec<(u64, mpsc::Sender<Delivery>)>;

#[derive(Default)]
struct Registry {
    next_id: u64,
    /// Session numbers are a namespace's own, so a subscriber is found by both.
    subscribers: HashMap<(Namespace, SessionId), Subscribers>,
}

/// The subscribers of each session. Cloning shares it.
#[derive(Clone, Default)]
pub struct SessionFanOut {
    registry: Arc<Mutex<Registry>>,
}

/// One subscription: entries about its session, in order. Dropping it unsubscribes.
pub struct SessionEvents {
    receiver: mpsc::Receiver<Delivery>,
    key: (Namespace, SessionId),
    id: u64,
    registry: Arc<Mutex<Registry>>,
}

impl SessionEvents {
    /// The next delivery; `None` once the subscriber was dropped for falling behind (which
    /// means the same as [`Delivery::Resync`]).
    pub async fn recv(&mut self) -> Option<Delivery> {
        self.receiver.recv().await
    }
}

impl Drop for SessionEvents {
    fn drop(&mut self) {
        let mut registry = self.registry.lock().expect("fan-out lock poisoned");
        if let Some(list) = registry.subscribers.get_mut(&self.key) {
            list.retain(|(id, _)| *id != self.id);
            if list.is_empty() {
                registry.subscribers.remove(&self.key);
            }
        }
    }
}

impl SessionFanOut {
    /// Registers a subscriber for the entries of `session` of `namespace` from now on.
    pub fn subscribe(&self, namespace: &Namespace, session: SessionId) -> SessionEvents {
        let (sender, receiver) = mpsc::channel(QUEUE);
        let mut registry = self.registry.lock().expect("fan-out lock poisoned");
        let id = registry.next_id;
        registry.next_id += 1;
        let key = (namespace.clone(), session);
        registry.subscribers.entry(key.clone()).or_default().push((id, sender));
        SessionEvents { receiver, key, id, registry: self.registry.clone() }
    }

    /// Hands an applied entry to the subscribers of each session its events name, once each.
    pub fn publish(&self, entry: &Arc<AppliedEvent>) {
        let mut registry = self.registry.lock().expect("fan-out lock poisoned");
        if registry.subscribers.is_empty() {
            return;
        }
        let mut named: Vec<SessionId> = entry.events.iter().filter_map(session_of).collect();
        named.sort_unstable();
        named.dedup();
        for session in named {
            let key = (entry.namespace.clone(), session);
            if let Some(list) = registry.subscribers.get_mut(&key) {
                deliver(list, Delivery::Entry(entry.clone()));
                if list.is_empty() {
                    registry.subscribers.remove(&key);
                }
            }
        }
    }

    /// Tells every subscriber to read the state again (a snapshot replaced the entries).
    pub fn resync_all(&self) {
        let mut registry = self.registry.lock().expect("fan-out lock poisoned");
        for list in registry.subscribers.values_mut() {
            deliver(list, Delivery::Resync);
        }
        registry.subscribers.retain(|_, list| !list.is_empty());
    }

    /// Sessions with at least one subscriber (for tests and metrics).
    pub fn sessions_subscribed(&self) -> usize {
        self.registry.lock().expect("fan-out lock poisoned").subscribers.len()
    }
}

/// Sends without waiting; a subscriber that is gone or full is removed. A full one is dropped
/// rather than sent `Resync`: there is no room for it, and the end of its channel says the same.
fn deliver(list: &mut Vec<(u64, mpsc::Sender<Delivery>)>, delivery: Delivery) {
    list.retain(|(_, sender)| sender.try_send(delivery.clone()).is_ok());
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::{FencingToken, PartitionId};

    fn ns(name: &str) -> Namespace {
        Namespace::new(name).expect("a valid name")
    }

    fn granted(index: u64, sessions: &[u64]) -> Arc<AppliedEvent> {
        granted_in(&Namespace::default_namespace(), index, sessions)
    }

    fn granted_in(namespace: &Namespace, index: u64, sessions: &[u64]) -> Arc<AppliedEvent> {
        let events = sessions
            .iter()
            .map(|s| Event::Granted {
                partition: PartitionId(*s as u32),
                session: SessionId(*s),
                token: FencingToken(index),
            })
            .collect();
        Arc::new(AppliedEvent { index, namespace: namespace.clone(), events, snapshot: false })
    }

    fn entry_index(delivery: Option<Delivery>) -> Option<u64> {
        match delivery {
            Some(Delivery::Entry(e)) => Some(e.index),
            _ => None,
        }
    }

    #[tokio::test]
    async fn an_entry_reaches_only_the_sessions_it_names_once_each() {
        let fan_out = SessionFanOut::default();
        let mut one = fan_out.subscribe(&ns("default"), SessionId(1));
        let mut two = fan_out.subscribe(&ns("default"), SessionId(2));
        fan_out.publish(&granted(5, &[1, 1]));
        fan_out.publish(&granted(6, &[2]));
        fan_out.publish(&granted(7, &[1, 2]));
        assert_eq!(entry_index(one.recv().await), Some(5));
        assert_eq!(entry_index(one.recv().await), Some(7));
        assert_eq!(entry_index(two.recv().await), Some(6));
        assert_eq!(entry_index(two.recv().await), Some(7));
        assert!(one.receiver.try_recv().is_err(), "entry 5 named session 1 twice but is delivered once");
        assert!(two.receiver.try_recv().is_err());
    }

    #[tokio::test]
    async fn a_session_number_of_one_namespace_hears_nothing_of_another() {
        let fan_out = SessionFanOut::default();
        let mut billing = fan_out.subscribe(&ns("billing"), SessionId(1));
        let mut search = fan_out.subscribe(&ns("search"), SessionId(1));
        fan_out.publish(&granted_in(&ns("billing"), 4, &[1]));
        fan_out.publish(&granted_in(&ns("search"), 5, &[1]));
        assert_eq!(entry_index(billing.recv().await), Some(4));
        assert_eq!(entry_index(search.recv().await), Some(5));
        assert!(billing.receiver.try_recv().is_err(), "search's session 1 is not billing's");
        assert!(search.receiver.try_recv().is_err());
    }

    #[tokio::test]
    async fn a_dropped_subscription_is_forgotten() {
        let fan_out = SessionFanOut::default();
        let first = fan_out.subscribe(&ns("default"), SessionId(1));
        let mut second = fan_out.subscribe(&ns("default"), SessionId(1));
        drop(first);
        assert_eq!(fan_out.sessions_subscribed(), 1);
        fan_out.publish(&granted(3, &[1]));
        assert_eq!(entry_index(second.recv().await), Some(3));
        drop(second);
        assert_eq!(fan_out.sessions_subscribed(), 0);
    }

    #[tokio::test]
    async fn a_subscriber_that_falls_behind_is_dropped_not_skipped() {
        let fan_out = SessionFanOut::default();
        let mut slow = fan_out.subscribe(&ns("default"), SessionId(1));
        for index in 0..QUEUE as u64 + 5 {
            fan_out.publish(&granted(index, &[1]));
        }
        // Everything that fitted arrives in order; then the channel ends instead of going on
        // after a gap.
        for index in 0..QUEUE as u64 {
            assert_eq!(entry_index(slow.recv().await), Some(index));
        }
        assert!(slow.recv().await.is_none());
        assert_eq!(fan_out.sessions_subscribed(), 0);
    }

    #[tokio::test]
    async fn a_snapshot_tells_every_subscriber_to_resynchronise() {
        let fan_out = SessionFanOut::default();
        let mut one = fan_out.subscribe(&ns("default"), SessionId(1));
        let mut two = fan_out.subscribe(&ns("default"), SessionId(2));
        fan_out.resync_all();
        assert!(matches!(one.recv().await, Some(Delivery::Resync)));
        assert!(matches!(two.recv().await, Some(Delivery::Resync)));
    }
}
