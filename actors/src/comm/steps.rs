//! `StepBeacon`: across CUDA nodes, how many collective steps the other nodes' ranks began, so
//! that an idle rank follows a busy rank of another node as it follows one of its own
//! (`experts::lockstep`: every MoE layer is a collective of every EP rank of every node).
//!
//! Owns: a listener on this node's peer address (`[cluster] expert_listen`, told to the others
//! by the bootstrap), one connection to each other node, a thread sending this node's count
//! (`wire::StepCount`: the most steps a rank of this node began, sent each time a rank leads
//! a step no rank heard of had begun) and one thread per other node reading theirs.
//! Ordering: counts only grow; each connection carries one node's counts in order, coalesced
//! to the latest, and the most heard from any node is kept. A lead step is announced as it
//! begins, before its first collective, so a peer's idle rank joins that collective after one
//! message and one poll of its thread (`FOLLOW_POLL`); nothing else waits on the counts (NCCL
//! pairs the collectives by order, the all-gathered headers check it).
//! Live EPLB across nodes (`experts::device`) sends its messages over the same connections
//! (`wire::NodeEplb`, in order with the counts: `send_eplb`) and hears the others' through a
//! `NodeInbox` (`deliver_to`; messages that arrive before one is set wait for it). Each
//! connection opens with a count of 0, so the reading side knows its peer's node at once.
//! Failure: a peer that closes its connection, sends another session's counts or a malformed
//! frame is logged and no longer heard; a peer that cannot be written to is logged and dropped;
//! either way the inbox hears that the node is lost (`NodeInbox::lost`, naming it and why).
//! Without live EPLB its ranks stop joining collectives, which fail at the NCCL transport's
//! timeout (`[cluster] exchange_timeout_ms`) and stop the engine (the supervisor's rule 3). A
//! reading thread ends when its peer closes the connection (the peer's process ends or drops
//! its beacon); closing or dropping the beacon stops the listener and closes this node's
//! connections, both ways, as its process ending would.

use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak, mpsc};
use std::thread;
use std::time::Duration;

use super::wire::{NodeEplb, NodeEplbFrame, PeerFrame, StepCount};
use super::{EpError, accept_until_stopped};
use crate::experts::lockstep::NodePeers;

/// What live EPLB across nodes hears from the other nodes (`experts::device::DeviceExperts`).
pub trait NodeInbox: Send + Sync {
    /// Node `from` sent `message`.
    fn receive(&self, from: u16, message: NodeEplb);
    /// Node `node` is no longer heard, or can no longer be written to (`why`).
    fn lost(&self, node: u16, why: String);
}

enum Heard {
    Message(u16, NodeEplb),
    Lost(u16, String),
}

/// Where the reading threads hand what they hear: the inbox once set, a queue until then.
#[derive(Default)]
struct Inbox {
    handler: Option<Weak<dyn NodeInbox>>,
    queued: Vec<Heard>,
}

fn deliver(inbox: &Mutex<Inbox>, heard: Heard) {
    let mut inbox = inbox.lock().unwrap_or_else(|p| p.into_inner());
    match &inbox.handler {
        // Delivered under the lock, so each node's messages arrive in order.
        Some(handler) => {
            if let Some(handler) = handler.upgrade() {
                dispatch(&*handler, heard);
            }
        }
        None => inbox.queued.push(heard),
    }
}

fn dispatch(handler: &dyn NodeInbox, heard: Heard) {
    match heard {
        Heard::Message(from, message) => handler.receive(from, message),
        Heard::Lost(node, why) => handler.lost(node, why),
    }
}

/// What the sending thread sends, in order.
enum Out {
    Count(u64),
    Eplb(u16, NodeEplb),
    Close,
}

/// This node's side of the step counts of a deployment over several nodes.
pub struct StepBeacon {
    node: u16,
    nodes: u16,
    /// The most steps a rank of another node began, as heard.
    heard: Arc<AtomicU64>,
    /// This node's counts and messages, to the sending thread.
    outbox: mpsc::Sender<Out>,
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    inbox: Arc<Mutex<Inbox>>,
    /// The connections the other nodes opened to this one (shut on `close`).
    incoming: Arc<Mutex<Vec<TcpStream>>>,
}

impl std::fmt::Debug for StepBeacon {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StepBeacon")
            .field("node", &self.node)
            .field("nodes", &self.nodes)
            .field("addr", &self.addr)
            .finish_non_exhaustive()
    }
}

fn locked<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}

impl StepBeacon {
    /// Node `node` of deployment `session`: hears the other nodes on `listener` (bound before
    /// the bootstrap, so that they can connect at once) and connects to each of them at its
    /// address in `peers` (by node index, this node's own skipped), within `timeout`.
    pub fn start(
        listener: TcpListener,
        session: u64,
        node: u16,
        peers: &[SocketAddr],
        timeout: Duration,
    ) -> Result<Arc<StepBeacon>, EpError> {
        let failed = |what: String| EpError::Bootstrap(format!("node {node} step counts: {what}"));
        let addr = listener
            .local_addr()
            .map_err(|e| failed(format!("listener address: {e}")))?;
        let mut conns = Vec::with_capacity(peers.len().saturating_sub(1));
        for (peer, &peer_addr) in peers.iter().enumerate() {
            if peer == usize::from(node) {
                continue;
            }
            let conn = TcpStream::connect_timeout(&peer_addr, timeout)
                .and_then(|conn| {
                    conn.set_nodelay(true)?;
                    conn.set_write_timeout(Some(timeout))?;
                    Ok(conn)
                })
                .map_err(|e| failed(format!("connecting to node {peer} at {peer_addr}: {e}")))?;
            conns.push((peer as u16, peer_addr, conn));
        }
        let heard = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let inbox = Arc::new(Mutex::new(Inbox::default()));
        let incoming = Arc::new(Mutex::new(Vec::new()));
        let (outbox, out) = mpsc::channel();
        // Every connection opens with a count of 0: the peer learns which node it hears.
        let _ = outbox.send(Out::Count(0));
        let sender = Sender {
            session,
            node,
            inbox: inbox.clone(),
            stop: stop.clone(),
        };
        thread::Builder::new()
            .name("step-counts-out".into())
            .spawn(move || sender.run(conns, out))
            .map_err(|e| failed(format!("sending thread: {e}")))?;
        let (hearing, stopping, delivering, accepted) =
            (heard.clone(), stop.clone(), inbox.clone(), incoming.clone());
        accept_until_stopped("step-counts-in", listener, stop.clone(), move |conn| {
            if let Ok(clone) = conn.try_clone() {
                locked(&accepted).push(clone);
            }
            let reader = Reader {
                session,
                node,
                heard: hearing.clone(),
                inbox: delivering.clone(),
                stop: stopping.clone(),
            };
            let _ = thread::Builder::new()
                .name("step-counts-peer".into())
                .spawn(move || reader.run(conn));
        })
        .map_err(|e| failed(format!("listening thread: {e}")))?;
        Ok(Arc::new(StepBeacon {
            node,
            nodes: peers.len() as u16,
            heard,
            outbox,
            addr,
            stop,
            inbox,
            incoming,
        }))
    }

    /// This node's index.
    pub fn node(&self) -> u16 {
        self.node
    }

    /// Nodes of the deployment.
    pub fn nodes(&self) -> u16 {
        self.nodes
    }

    /// Sends `message` to node `to`, after every count and message sent before it (never
    /// blocks; a node that cannot be written to is reported lost to the inbox).
    pub fn send_eplb(&self, to: u16, message: NodeEplb) {
        if self.outbox.send(Out::Eplb(to, message)).is_err() {
            tracing::warn!(
                node = self.node,
                to,
                "EPLB message: the sending thread is gone"
            );
        }
    }

    /// Hands what the other nodes send (and which are lost) to `handler`, those heard so far
    /// first.
    pub fn deliver_to(&self, handler: Weak<dyn NodeInbox>) {
        let mut inbox = locked(&self.inbox);
        if let Some(live) = handler.upgrade() {
            for heard in inbox.queued.drain(..) {
                dispatch(&*live, heard);
            }
        }
        inbox.handler = Some(handler);
    }

    /// Stops hearing and closes every connection, both ways, as this node's process ending
    /// would: the other nodes see this node lost.
    pub fn close(&self) {
        if self.stop.swap(true, Ordering::SeqCst) {
            return;
        }
        let _ = self.outbox.send(Out::Close);
        for conn in locked(&self.incoming).drain(..) {
            let _ = conn.shutdown(Shutdown::Both);
        }
        // Wakes the accept loop so it sees the flag.
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_secs(1));
    }
}

impl NodePeers for StepBeacon {
    fn began(&self) -> u64 {
        self.heard.load(Ordering::SeqCst)
    }

    fn announce(&self, steps: u64) {
        // The sending thread runs until the beacon is closed.
        if self.outbox.send(Out::Count(steps)).is_err() {
            tracing::warn!(
                node = self.node,
                steps,
                "step counts: the sending thread is gone"
            );
        }
    }
}

impl Drop for StepBeacon {
    fn drop(&mut self) {
        self.close();
    }
}

/// The sending thread's side.
struct Sender {
    session: u64,
    node: u16,
    inbox: Arc<Mutex<Inbox>>,
    stop: Arc<AtomicBool>,
}

impl Sender {
    /// Sends this node's counts (the latest of those waiting in a row) and messages to the
    /// peers, in order, until the beacon closes.
    fn run(self, mut conns: Vec<(u16, SocketAddr, TcpStream)>, out: mpsc::Receiver<Out>) {
        let node = self.node;
        while let Ok(first) = out.recv() {
            let mut pending = vec![first];
            pending.extend(out.try_iter());
            let mut batch: Vec<Out> = Vec::with_capacity(pending.len());
            for item in pending {
                match (batch.last_mut(), item) {
                    (Some(Out::Count(began)), Out::Count(later)) => *began = (*began).max(later),
                    (_, item) => batch.push(item),
                }
            }
            for item in batch {
                match item {
                    Out::Count(began) => {
                        let count = PeerFrame::Count(StepCount {
                            session: self.session,
                            node,
                            began,
                        });
                        conns
                            .retain_mut(|(peer, addr, conn)| self.write(&count, *peer, addr, conn));
                    }
                    Out::Eplb(to, message) => {
                        let frame = PeerFrame::Eplb(NodeEplbFrame {
                            session: self.session,
                            node,
                            message,
                        });
                        match conns.iter().position(|(peer, ..)| *peer == to) {
                            Some(i) => {
                                let (peer, addr, conn) = &mut conns[i];
                                if !self.write(&frame, *peer, addr, conn) {
                                    conns.remove(i);
                                }
                            }
                            None => self.lost(to, "not connected (dropped earlier)".into()),
                        }
                    }
                    Out::Close => {
                        for (_, _, conn) in &conns {
                            let _ = conn.shutdown(Shutdown::Both);
                        }
                        return;
                    }
                }
            }
        }
    }

    /// Writes `frame` to `peer`; `false` (logged, reported lost): it is dropped.
    fn write(&self, frame: &PeerFrame, peer: u16, addr: &SocketAddr, conn: &mut TcpStream) -> bool {
        match frame.send(conn) {
            Ok(()) => true,
            Err(error) => {
                tracing::warn!(node = self.node, peer, %addr, %error, "step counts: peer dropped");
                self.lost(peer, format!("writing to it at {addr} failed: {error}"));
                false
            }
        }
    }

    fn lost(&self, peer: u16, why: String) {
        if !self.stop.load(Ordering::SeqCst) {
            deliver(&self.inbox, Heard::Lost(peer, why));
        }
    }
}

/// One reading thread's side: one other node's connection.
struct Reader {
    session: u64,
    node: u16,
    heard: Arc<AtomicU64>,
    inbox: Arc<Mutex<Inbox>>,
    stop: Arc<AtomicBool>,
}

impl Reader {
    /// Keeps the most steps `conn`'s node says its ranks began and hands its EPLB messages to
    /// the inbox, until it closes the connection.
    fn run(self, mut conn: TcpStream) {
        let node = self.node;
        let _ = conn.set_nodelay(true);
        let mut peer: Option<u16> = None;
        let why = loop {
            match PeerFrame::receive(&mut conn) {
                Ok(Some(frame)) => {
                    let (session, from) = match &frame {
                        PeerFrame::Count(count) => (count.session, count.node),
                        PeerFrame::Eplb(eplb) => (eplb.session, eplb.node),
                    };
                    if session != self.session {
                        tracing::warn!(
                            node,
                            peer = from,
                            session,
                            expected = self.session,
                            "step counts of another deployment ignored; peer no longer heard"
                        );
                        return;
                    }
                    peer = Some(from);
                    match frame {
                        PeerFrame::Count(count) => {
                            self.heard.fetch_max(count.began, Ordering::SeqCst);
                        }
                        PeerFrame::Eplb(eplb) => {
                            deliver(&self.inbox, Heard::Message(from, eplb.message));
                        }
                    }
                }
                Ok(None) => break "it closed its connection".to_string(),
                Err(error) => {
                    tracing::warn!(node, ?peer, %error, "step counts: peer no longer heard");
                    break format!("its connection failed: {error}");
                }
            }
        };
        if let Some(peer) = peer
            && !self.stop.load(Ordering::SeqCst)
        {
            deliver(&self.inbox, Heard::Lost(peer, why));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    fn listeners(count: usize) -> (Vec<TcpListener>, Vec<SocketAddr>) {
        let listeners: Vec<TcpListener> = (0..count)
            .map(|_| TcpListener::bind("127.0.0.1:0").expect("a port"))
            .collect();
        let addrs = listeners
            .iter()
            .map(|l| l.local_addr().expect("address"))
            .collect();
        (listeners, addrs)
    }

    /// `count` beacons of session 5 linked over loopback, node `i` the `i`-th.
    fn beacons(count: usize) -> Vec<Arc<StepBeacon>> {
        let (listeners, addrs) = listeners(count);
        listeners
            .into_iter()
            .enumerate()
            .map(|(node, listener)| {
                StepBeacon::start(listener, 5, node as u16, &addrs, Duration::from_secs(5))
                    .expect("beacon")
            })
            .collect()
    }

    fn eventually(what: &str, cond: impl Fn() -> bool) {
        let started = Instant::now();
        while !cond() {
            assert!(started.elapsed() < Duration::from_secs(10), "{what}");
            thread::sleep(Duration::from_millis(1));
        }
    }

    /// Three nodes: each one's announced counts reach both others, which keep the most heard;
    /// a node never hears its own.
    #[test]
    fn every_node_hears_the_most_steps_the_others_began() {
        let beacons = beacons(3);
        beacons[0].announce(3);
        beacons[0].announce(7);
        eventually("nodes 1 and 2 hear 7", || {
            beacons[1].began() == 7 && beacons[2].began() == 7
        });
        assert_eq!(beacons[0].began(), 0);
        beacons[2].announce(9);
        beacons[1].announce(8);
        eventually("node 0 hears 9", || beacons[0].began() == 9);
        eventually("node 1 hears 9", || beacons[1].began() == 9);
        eventually("node 2 hears 8", || beacons[2].began() == 8);
    }

    /// Counts of another session are not heard.
    #[test]
    fn another_deployments_counts_are_ignored() {
        let (listeners, addrs) = listeners(2);
        let mut listeners = listeners.into_iter();
        let ours = StepBeacon::start(
            listeners.next().expect("listener"),
            5,
            0,
            &addrs,
            Duration::from_secs(5),
        )
        .expect("node 0");
        let theirs = StepBeacon::start(
            listeners.next().expect("listener"),
            6,
            1,
            &addrs,
            Duration::from_secs(5),
        )
        .expect("node 1");
        theirs.announce(4);
        ours.announce(2);
        thread::sleep(Duration::from_millis(300));
        assert_eq!((ours.began(), theirs.began()), (0, 0));
    }

    /// What an inbox heard.
    #[derive(Default)]
    struct Heard(Mutex<Vec<String>>);

    impl NodeInbox for Heard {
        fn receive(&self, from: u16, message: NodeEplb) {
            locked(&self.0).push(format!("{from}: {message:?}"));
        }
        fn lost(&self, node: u16, why: String) {
            locked(&self.0).push(format!("lost {node}: {why}"));
        }
    }

    /// EPLB messages reach the node they are sent to, in order (those heard before an inbox is
    /// set wait for it); a node that closes its beacon is heard lost, named.
    #[test]
    fn eplb_messages_reach_their_node_and_a_closed_node_is_lost() {
        let beacons = beacons(2);
        assert_eq!((beacons[1].node(), beacons[1].nodes()), (1, 2));
        beacons[0].send_eplb(1, NodeEplb::TakeLoads { round: 1 });
        beacons[0].announce(4);
        beacons[0].send_eplb(1, NodeEplb::Propose { epoch: 1, step: 7 });
        eventually("node 1 hears 4", || beacons[1].began() == 4);
        thread::sleep(Duration::from_millis(50));
        let heard = Arc::new(Heard::default());
        let weak: Weak<dyn NodeInbox> = Arc::downgrade(&heard) as Weak<dyn NodeInbox>;
        beacons[1].deliver_to(weak);
        eventually("node 1 hears both", || locked(&heard.0).len() == 2);
        assert_eq!(
            *locked(&heard.0),
            vec![
                "0: TakeLoads { round: 1 }".to_string(),
                "0: Propose { epoch: 1, step: 7 }".to_string()
            ]
        );
        beacons[0].close();
        eventually("node 1 hears node 0 lost", || locked(&heard.0).len() == 3);
        assert!(
            locked(&heard.0)[2].starts_with("lost 0: "),
            "{:?}",
            locked(&heard.0)
        );
    }
}
