//! How the `deepinfer-node` processes of one deployment find each other (the design NCCL's
//! unique-id bootstrap follows): node 0 listens on `[cluster] bootstrap`; every other node
//! connects to it (retrying until node 0 is up) and says `Hello` (its index, the node count, a
//! fingerprint of what all must agree on, the address it listens on for its peers: its expert
//! server on the CPU, its step counts with CUDA ranks, `comm::steps`); once all nodes joined,
//! node 0 draws the session id and, for a deployment whose ranks share one NCCL communicator
//! (CUDA ranks across nodes, [`join`] with a source), creates the unique id from its
//! [`UniqueIdSource`] (`ncclGetUniqueId`; tests pass a fake: the bootstrap only carries the
//! bytes and needs no CUDA), then answers each with `Welcome` (the session id, every node's
//! address by node index, the unique id). A node that disagrees (another fingerprint or node
//! count, an index taken twice, a unique id where it expects none or none where it expects
//! one) is refused and node 0 fails; a node that does not come within `[cluster]
//! bootstrap_timeout_seconds` fails the start of every waiting node; node 0 failing to create
//! the unique id fails every node's start with its reason; a malformed or another build's
//! frame (`wire`: version and unique id length checked) is an error naming what.

use std::collections::hash_map::RandomState;
use std::hash::BuildHasher;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::thread;
use std::time::{Duration, Instant};

use super::EpError;
use super::wire::{Hello, Welcome};
pub use super::wire::{UNIQUE_ID_BYTES, UniqueId};

/// What the bootstrap hands every node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Joined {
    /// The deployment's session id (in every expert frame).
    pub session: u64,
    /// Every node's peer address (its expert server, or its step counts), by node index.
    pub experts: Vec<SocketAddr>,
    /// The unique id node 0 created (`Some` exactly when [`join`] had a source).
    pub unique_id: Option<UniqueId>,
}

/// This node's part in the bootstrap.
#[derive(Debug, Clone, Copy)]
pub struct Member {
    pub node: u16,
    pub nodes: u16,
    pub fingerprint: u64,
    /// Where this node listens for its peers: its expert server (CPU), or its step counts
    /// (CUDA ranks across nodes, `comm::steps`).
    pub expert_addr: SocketAddr,
}

/// Where node 0 gets the opaque id it hands every node: NCCL's unique id (`ncclGetUniqueId`)
/// for CUDA ranks across nodes; a closure returning fixed bytes in tests. Called once, on node
/// 0, after every node joined and before any is answered; its error (e.g. no `libnccl.so`)
/// fails every node's start.
pub trait UniqueIdSource: Sync {
    fn create(&self) -> Result<UniqueId, String>;
}

impl<F: Fn() -> Result<UniqueId, String> + Sync> UniqueIdSource for F {
    fn create(&self) -> Result<UniqueId, String> {
        self()
    }
}

/// Joins the deployment whose node 0 listens on `bootstrap`, within `timeout`. With a `source`
/// (a deployment whose ranks share one NCCL communicator) node 0 creates the unique id from it
/// and every node gets it (`Joined::unique_id`); every node then passes one (only node 0's is
/// called), and a node that gets no id is refused. Without (the CPU's socket transport), no id.
pub fn join(
    bootstrap: SocketAddr,
    me: Member,
    timeout: Duration,
    source: Option<&dyn UniqueIdSource>,
) -> Result<Joined, EpError> {
    let deadline = Instant::now() + timeout;
    if me.node == 0 {
        lead(bootstrap, me, deadline, source)
    } else {
        follow(bootstrap, me, deadline, source.is_some())
    }
}

fn failed(message: String) -> EpError {
    EpError::Bootstrap(message)
}

/// Node 0: waits for every other node's `Hello`, then creates the unique id (if any) and
/// answers them all.
fn lead(
    bootstrap: SocketAddr,
    me: Member,
    deadline: Instant,
    source: Option<&dyn UniqueIdSource>,
) -> Result<Joined, EpError> {
    let listener = TcpListener::bind(bootstrap)
        .and_then(|l| l.set_nonblocking(true).map(|()| l))
        .map_err(|e| failed(format!("node 0 cannot listen on {bootstrap}: {e}")))?;
    let nodes = usize::from(me.nodes);
    let mut experts: Vec<Option<SocketAddr>> = vec![None; nodes];
    experts[0] = Some(me.expert_addr);
    let mut joined: Vec<TcpStream> = Vec::new();
    while experts.iter().any(Option::is_none) {
        let now = Instant::now();
        if now >= deadline {
            let missing: Vec<usize> = (0..nodes).filter(|&n| experts[n].is_none()).collect();
            return Err(failed(format!(
                "nodes {missing:?} did not join {bootstrap} in time"
            )));
        }
        let mut conn = match listener.accept() {
            Ok((conn, _)) => conn,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                thread::sleep(Duration::from_millis(20));
                continue;
            }
            Err(e) => return Err(failed(format!("accepting on {bootstrap}: {e}"))),
        };
        let hello = conn
            .set_nonblocking(false)
            .and_then(|()| conn.set_read_timeout(Some(deadline - now)))
            .and_then(|()| Hello::receive(&mut conn))
            .map_err(|e| failed(format!("a node joining {bootstrap}: {e}")))?;
        let addr = hello.expert_addr.parse::<SocketAddr>().ok();
        let problem = if hello.nodes != me.nodes {
            Some(format!(
                "node {} counts {} nodes, node 0 {}",
                hello.node, hello.nodes, me.nodes
            ))
        } else if hello.fingerprint != me.fingerprint {
            Some(format!(
                "node {} runs another model or topology (fingerprint {:x}, node 0 {:x})",
                hello.node, hello.fingerprint, me.fingerprint
            ))
        } else if hello.node == 0 || usize::from(hello.node) >= nodes {
            Some(format!("node index {} is not in 1..{nodes}", hello.node))
        } else if experts[usize::from(hello.node)].is_some() {
            Some(format!("node {} joined twice", hello.node))
        } else if addr.is_none() {
            Some(format!(
                "node {} sent expert address {:?}",
                hello.node, hello.expert_addr
            ))
        } else {
            None
        };
        if let Some(problem) = problem {
            let _ = Welcome::Failure(problem.clone()).send(&mut conn);
            return Err(failed(problem));
        }
        experts[usize::from(hello.node)] = addr;
        joined.push(conn);
    }
    let experts: Vec<SocketAddr> = experts.into_iter().flatten().collect();
    let session = RandomState::new().hash_one(Instant::now());
    let unique_id = match source.map(UniqueIdSource::create).transpose() {
        Ok(id) => id,
        Err(reason) => {
            let problem = format!("node 0 could not create the unique id: {reason}");
            for mut conn in joined {
                let _ = Welcome::Failure(problem.clone()).send(&mut conn);
            }
            return Err(failed(problem));
        }
    };
    let welcome = Welcome::Joined {
        session,
        experts: experts.iter().map(ToString::to_string).collect(),
        unique_id,
    };
    for mut conn in joined {
        welcome
            .send(&mut conn)
            .map_err(|e| failed(format!("answering a joined node: {e}")))?;
    }
    Ok(Joined {
        session,
        experts,
        unique_id,
    })
}

/// Node k > 0: connects to node 0 (retrying until it listens), says hello, waits for the table
/// (and the unique id when `wants_id`).
fn follow(
    bootstrap: SocketAddr,
    me: Member,
    deadline: Instant,
    wants_id: bool,
) -> Result<Joined, EpError> {
    let mut conn = loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(failed(format!(
                "node {}: node 0 did not answer on {bootstrap} in time",
                me.node
            )));
        }
        match TcpStream::connect_timeout(&bootstrap, left) {
            Ok(conn) => break conn,
            Err(_) => thread::sleep(Duration::from_millis(100).min(left)),
        }
    };
    let left = deadline.saturating_duration_since(Instant::now());
    let io =
        |e: std::io::Error| failed(format!("node {} with node 0 at {bootstrap}: {e}", me.node));
    conn.set_read_timeout(Some(left.max(Duration::from_millis(1))))
        .map_err(io)?;
    Hello {
        node: me.node,
        nodes: me.nodes,
        fingerprint: me.fingerprint,
        expert_addr: me.expert_addr.to_string(),
    }
    .send(&mut conn)
    .map_err(io)?;
    match Welcome::receive(&mut conn).map_err(io)? {
        Welcome::Failure(reason) => {
            Err(failed(format!("node 0 refused node {}: {reason}", me.node)))
        }
        Welcome::Joined {
            session,
            experts,
            unique_id,
        } => {
            if unique_id.is_some() != wants_id {
                return Err(failed(format!(
                    "node {} expects {} unique id from node 0, which sent {} (the nodes run \
                     different backends?)",
                    me.node,
                    if wants_id { "a" } else { "no" },
                    if unique_id.is_some() { "one" } else { "none" },
                )));
            }
            let experts = experts
                .iter()
                .map(|a| a.parse::<SocketAddr>())
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| failed(format!("node 0 sent a bad address: {e}")))?;
            if experts.len() != usize::from(me.nodes) {
                return Err(failed(format!(
                    "node 0 sent {} addresses for {} nodes",
                    experts.len(),
                    me.nodes
                )));
            }
            Ok(Joined {
                session,
                experts,
                unique_id,
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::free_loopback;

    /// `join` within 20 s.
    fn join_in_time(
        bootstrap: SocketAddr,
        me: Member,
        source: Option<&dyn UniqueIdSource>,
    ) -> Result<Joined, EpError> {
        join(bootstrap, me, Duration::from_secs(20), source)
    }

    /// The error a node's join thread ended with (`expected`: what the join should fail with).
    fn join_error(node: thread::JoinHandle<Result<Joined, EpError>>, expected: &str) -> String {
        node.join()
            .expect("thread")
            .expect_err(expected)
            .to_string()
    }

    fn member(node: u16, fingerprint: u64, port: u16) -> Member {
        Member {
            node,
            nodes: 2,
            fingerprint,
            expert_addr: SocketAddr::from(([127, 0, 0, 1], port)),
        }
    }

    /// Node 1 may start before node 0; both get the same session and table. Another fingerprint
    /// is refused by name, and a node that never comes is a timeout naming it.
    #[test]
    fn nodes_join_or_fail_with_a_reason() {
        let boot = free_loopback();
        let second = thread::spawn(move || join_in_time(boot, member(1, 7, 2002), None));
        thread::sleep(Duration::from_millis(200));
        let first = join_in_time(boot, member(0, 7, 2001), None).expect("node 0");
        let second = second.join().expect("thread").expect("node 1");
        assert_eq!(first, second);
        assert_eq!(first.experts[1].port(), 2002);

        let boot = free_loopback();
        let other = thread::spawn(move || join_in_time(boot, member(1, 8, 2002), None));
        let lead = join_in_time(boot, member(0, 7, 2001), None);
        let err = lead.expect_err("another fingerprint").to_string();
        assert!(err.contains("another model or topology"), "{err}");
        let err = join_error(other, "refused");
        assert!(err.contains("node 0 refused node 1"), "{err}");

        let boot = free_loopback();
        let started = Instant::now();
        let err = join(boot, member(0, 7, 2001), Duration::from_millis(300), None)
            .expect_err("nobody joins")
            .to_string();
        assert!(err.contains("nodes [1] did not join"), "{err}");
        assert!(started.elapsed() < Duration::from_secs(5));
    }

    /// Node 0's fake unique id: distinct bytes, so that a byte moved or dropped shows.
    fn node0_id() -> Result<UniqueId, String> {
        Ok(std::array::from_fn(|i| (i * 37 + 11) as u8))
    }

    /// What the other nodes' sources would give: never called (only node 0 creates the id).
    fn other_id() -> Result<UniqueId, String> {
        Ok([0xee; UNIQUE_ID_BYTES])
    }

    /// Three nodes, the followers started first: every node gets node 0's unique id byte for
    /// byte, with the same session and address table.
    #[test]
    fn the_unique_id_of_node_0_reaches_every_node_unchanged() {
        let boot = free_loopback();
        let followers: Vec<_> = [1u16, 2]
            .into_iter()
            .map(|node| {
                thread::spawn(move || {
                    let me = Member {
                        nodes: 3,
                        ..member(node, 7, 2000 + node)
                    };
                    join_in_time(boot, me, Some(&other_id))
                })
            })
            .collect();
        thread::sleep(Duration::from_millis(200));
        let me = Member {
            nodes: 3,
            ..member(0, 7, 2000)
        };
        let lead = join_in_time(boot, me, Some(&node0_id)).expect("node 0");
        assert_eq!(lead.unique_id, Some(node0_id().expect("an id")));
        for follower in followers {
            let joined = follower.join().expect("thread").expect("a follower");
            assert_eq!(joined, lead);
        }
        let ports: Vec<u16> = lead.experts.iter().map(SocketAddr::port).collect();
        assert_eq!(ports, vec![2000, 2001, 2002]);
    }

    /// Node 0 that cannot create the unique id fails every node with its reason; a node that
    /// expects an id from a node 0 that sends none (or the reverse) is refused by name.
    #[test]
    fn a_missing_unique_id_fails_the_start_naming_why() {
        let boot = free_loopback();
        let other = thread::spawn(move || join_in_time(boot, member(1, 7, 2002), Some(&other_id)));
        let no_nccl = || -> Result<UniqueId, String> { Err("libnccl.so did not load".into()) };
        let err = join_in_time(boot, member(0, 7, 2001), Some(&no_nccl))
            .expect_err("no id")
            .to_string();
        assert!(
            err.contains("node 0 could not create the unique id: libnccl.so did not load"),
            "{err}"
        );
        let err = join_error(other, "refused");
        assert!(err.contains("node 0 refused node 1"), "{err}");
        assert!(err.contains("libnccl.so did not load"), "{err}");

        for follower_wants_id in [true, false] {
            let boot = free_loopback();
            let other = thread::spawn(move || {
                let me = member(1, 7, 2002);
                if follower_wants_id {
                    join_in_time(boot, me, Some(&other_id))
                } else {
                    join_in_time(boot, me, None)
                }
            });
            let me = member(0, 7, 2001);
            let lead = if follower_wants_id {
                join_in_time(boot, me, None)
            } else {
                join_in_time(boot, me, Some(&node0_id))
            };
            lead.expect("node 0 answered");
            let err = join_error(other, "a mismatch");
            let expected = if follower_wants_id {
                "node 1 expects a unique id from node 0, which sent none"
            } else {
                "node 1 expects no unique id from node 0, which sent one"
            };
            assert!(err.contains(expected), "{err}");
        }
    }

    /// A node 0 (here a stand-in on a socket) whose `Welcome` carries a unique id cut short, or
    /// one of another length: the joining node fails naming the unique id, never runs with a
    /// partial one.
    #[test]
    fn a_corrupted_unique_id_frame_is_refused_naming_it() {
        let welcome = Welcome::Joined {
            session: 3,
            experts: vec!["127.0.0.1:2001".into(), "127.0.0.1:2002".into()],
            unique_id: node0_id().ok(),
        };
        let mut whole = Vec::new();
        welcome.send(&mut whole).expect("encoded");
        let short = whole[..whole.len() - 40].to_vec();
        let mut long = whole.clone();
        let at = whole.len() - UNIQUE_ID_BYTES - 4;
        long[at..at + 4].copy_from_slice(&129u32.to_le_bytes());
        for (sent, expected) in [
            (short, "cut short in the unique id (128 bytes)"),
            (
                long,
                "the unique id is 129 bytes long, expected 0 (none) or 128",
            ),
        ] {
            let listener = TcpListener::bind("127.0.0.1:0").expect("a port");
            let boot = listener.local_addr().expect("address");
            let stand_in = thread::spawn(move || {
                let (mut conn, _) = listener.accept().expect("node 1 connects");
                let hello = Hello::receive(&mut conn).expect("node 1's hello");
                std::io::Write::write_all(&mut conn, &sent).expect("sent");
                hello
            });
            let err = join_in_time(boot, member(1, 7, 2002), Some(&other_id))
                .expect_err("a malformed welcome")
                .to_string();
            assert_eq!(stand_in.join().expect("stand-in").node, 1);
            assert!(
                err.contains(&format!("node 1 with node 0 at {boot}")),
                "{err}"
            );
            assert!(err.contains(expected), "{err}");
        }
    }
}
