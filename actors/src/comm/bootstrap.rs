//! How the `deepinfer-node` processes of one deployment find each other (the design NCCL's
//! unique-id bootstrap follows): node 0 listens on `[cluster] bootstrap`; every other node
//! connects to it (retrying until node 0 is up) and says `Hello` (its index, the node count, a
//! fingerprint of what all must agree on, its expert server's address); once all nodes joined,
//! node 0 draws the session id (the unique id) and answers each with `Welcome` (the session id
//! and every node's expert address, by node index). A node that disagrees (another fingerprint
//! or node count, an index taken twice) is refused and node 0 fails; a node that does not come
//! within `[cluster] bootstrap_timeout_seconds` fails the start of every waiting node.

use std::collections::hash_map::RandomState;
use std::hash::BuildHasher;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::thread;
use std::time::{Duration, Instant};

use super::EpError;
use super::wire::{Hello, Welcome};

/// What the bootstrap hands every node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Joined {
    /// The deployment's session id (in every expert frame).
    pub session: u64,
    /// Every node's expert server address, by node index.
    pub experts: Vec<SocketAddr>,
}

/// This node's part in the bootstrap.
#[derive(Debug, Clone, Copy)]
pub struct Member {
    pub node: u16,
    pub nodes: u16,
    pub fingerprint: u64,
    /// Where this node's expert server listens.
    pub expert_addr: SocketAddr,
}

/// Joins the deployment whose node 0 listens on `bootstrap`, within `timeout`.
pub fn join(bootstrap: SocketAddr, me: Member, timeout: Duration) -> Result<Joined, EpError> {
    let deadline = Instant::now() + timeout;
    if me.node == 0 {
        lead(bootstrap, me, deadline)
    } else {
        follow(bootstrap, me, deadline)
    }
}

fn failed(message: String) -> EpError {
    EpError::Bootstrap(message)
}

/// Node 0: waits for every other node's `Hello`, then answers them all.
fn lead(bootstrap: SocketAddr, me: Member, deadline: Instant) -> Result<Joined, EpError> {
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
    let welcome = Welcome::Joined {
        session,
        experts: experts.iter().map(ToString::to_string).collect(),
    };
    for mut conn in joined {
        welcome
            .send(&mut conn)
            .map_err(|e| failed(format!("answering a joined node: {e}")))?;
    }
    Ok(Joined { session, experts })
}

/// Node k > 0: connects to node 0 (retrying until it listens), says hello, waits for the table.
fn follow(bootstrap: SocketAddr, me: Member, deadline: Instant) -> Result<Joined, EpError> {
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
        Welcome::Joined { session, experts } => {
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
            Ok(Joined { session, experts })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::free_loopback;

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
        let second = thread::spawn(move || join(boot, member(1, 7, 2002), Duration::from_secs(20)));
        thread::sleep(Duration::from_millis(200));
        let first = join(boot, member(0, 7, 2001), Duration::from_secs(20)).expect("node 0");
        let second = second.join().expect("thread").expect("node 1");
        assert_eq!(first, second);
        assert_eq!(first.experts[1].port(), 2002);

        let boot = free_loopback();
        let other = thread::spawn(move || join(boot, member(1, 8, 2002), Duration::from_secs(20)));
        let lead = join(boot, member(0, 7, 2001), Duration::from_secs(20));
        let err = lead.expect_err("another fingerprint").to_string();
        assert!(err.contains("another model or topology"), "{err}");
        let err = other
            .join()
            .expect("thread")
            .expect_err("refused")
            .to_string();
        assert!(err.contains("node 0 refused node 1"), "{err}");

        let boot = free_loopback();
        let started = Instant::now();
        let err = join(boot, member(0, 7, 2001), Duration::from_millis(300))
            .expect_err("nobody joins")
            .to_string();
        assert!(err.contains("nodes [1] did not join"), "{err}");
        assert!(started.elapsed() < Duration::from_secs(5));
    }
}
