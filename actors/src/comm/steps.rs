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
//! Failure: a peer that closes its connection, sends another session's counts or a malformed
//! frame is logged and no longer heard; a peer that cannot be written to is logged and dropped.
//! Either way its ranks stop joining collectives, which fail at the NCCL transport's timeout
//! (`[cluster] exchange_timeout_ms`) and stop the engine (the supervisor's rule 3). A reading
//! thread ends when its peer closes the connection (the peer's process ends or drops its
//! beacon); dropping the beacon stops the listener and closes this node's connections.

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, mpsc};
use std::thread;
use std::time::Duration;

use super::EpError;
use super::wire::StepCount;
use crate::experts::lockstep::NodePeers;

/// This node's side of the step counts of a deployment over several nodes.
#[derive(Debug)]
pub struct StepBeacon {
    node: u16,
    /// The most steps a rank of another node began, as heard.
    heard: Arc<AtomicU64>,
    /// This node's counts, to the sending thread.
    outbox: mpsc::Sender<u64>,
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
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
            conns.push((peer, peer_addr, conn));
        }
        let heard = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let (outbox, counts) = mpsc::channel();
        thread::Builder::new()
            .name("step-counts-out".into())
            .spawn(move || send_counts(conns, counts, session, node))
            .map_err(|e| failed(format!("sending thread: {e}")))?;
        let (hearing, stopping) = (heard.clone(), stop.clone());
        thread::Builder::new()
            .name("step-counts-in".into())
            .spawn(move || {
                for conn in listener.incoming() {
                    if stopping.load(Ordering::SeqCst) {
                        return;
                    }
                    let Ok(conn) = conn else { continue };
                    let heard = hearing.clone();
                    let _ = thread::Builder::new()
                        .name("step-counts-peer".into())
                        .spawn(move || hear(conn, session, node, heard));
                }
            })
            .map_err(|e| failed(format!("listening thread: {e}")))?;
        Ok(Arc::new(StepBeacon {
            node,
            heard,
            outbox,
            addr,
            stop,
        }))
    }
}

impl NodePeers for StepBeacon {
    fn began(&self) -> u64 {
        self.heard.load(Ordering::SeqCst)
    }

    fn announce(&self, steps: u64) {
        // The sending thread runs until the beacon is dropped.
        if self.outbox.send(steps).is_err() {
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
        self.stop.store(true, Ordering::SeqCst);
        // Wakes the accept loop so it sees the flag.
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_secs(1));
    }
}

/// Sends this node's counts to every peer, the latest of those waiting each time, until the
/// beacon is dropped.
fn send_counts(
    mut conns: Vec<(usize, SocketAddr, TcpStream)>,
    counts: mpsc::Receiver<u64>,
    session: u64,
    node: u16,
) {
    while let Ok(mut began) = counts.recv() {
        while let Ok(later) = counts.try_recv() {
            began = began.max(later);
        }
        let count = StepCount {
            session,
            node,
            began,
        };
        conns.retain_mut(|(peer, addr, conn)| match count.send(conn) {
            Ok(()) => true,
            Err(error) => {
                tracing::warn!(node, peer = *peer, %addr, %error, "step counts: peer dropped");
                false
            }
        });
    }
}

/// Keeps the most steps `conn`'s node says its ranks began, until it closes the connection.
fn hear(mut conn: TcpStream, session: u64, node: u16, heard: Arc<AtomicU64>) {
    let _ = conn.set_nodelay(true);
    loop {
        match StepCount::receive(&mut conn) {
            Ok(Some(count)) if count.session == session => {
                heard.fetch_max(count.began, Ordering::SeqCst);
            }
            Ok(Some(count)) => {
                tracing::warn!(
                    node,
                    peer = count.node,
                    session = count.session,
                    expected = session,
                    "step counts of another deployment ignored; peer no longer heard"
                );
                return;
            }
            Ok(None) => return,
            Err(error) => {
                tracing::warn!(node, %error, "step counts: peer no longer heard");
                return;
            }
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
        let (listeners, addrs) = listeners(3);
        let beacons: Vec<Arc<StepBeacon>> = listeners
            .into_iter()
            .enumerate()
            .map(|(node, listener)| {
                StepBeacon::start(listener, 5, node as u16, &addrs, Duration::from_secs(5))
                    .expect("beacon")
            })
            .collect();
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
}
