//! The socket transport between `deepinfer-node` processes: `RemoteRanks` (a DP rank's side:
//! one connection per remote EP rank, a request and its answer per layer) and `ExpertServer`
//! (an EP rank's side: answers every peer's rows with this process's shards).
//!
//! Every wait has the exchange timeout (`[cluster] exchange_timeout_ms`), every frame carries the
//! deployment's session id, the step, layer and placement epoch, and an answer for another
//! exchange is refused. A peer that fails or times out stays failed: later calls fail at once
//! (the engine stops anyway, the supervisor's rule 3).
//! The server needs no step lockstep between nodes: it serves whichever DP rank asks, at any
//! time, with the placement epoch the rows name: the current one, the staged one (a peer that
//! adopted it first) or the one before (a peer that has not adopted the current yet); any
//! other is refused. It also runs node 0's EPLB requests (`wire::Control`) on this node's
//! `EplbActor`; `RemoteRanks::control_all` is node 0's side.

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::thread;
use std::time::Duration;

use deepinfer_topology::{EpRank, PlacementEpoch};

use super::wire::{Control, ControlReply, ControlRequest, Dispatch, FrameTag, Reply, Request};
use super::{Comm, EpError, LayerAt, accept_until_stopped};
use crate::experts::parallel::ExpertParallel;

/// One remote EP rank: its node, address and connection.
#[derive(Debug)]
struct Peer {
    node: usize,
    addr: SocketAddr,
    /// The open connection (`None` before the first exchange); `Err` once it failed.
    conn: Mutex<Result<Option<TcpStream>, String>>,
}

/// How long a node waits for another.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timeouts {
    /// One layer's exchange, and node 0's EPLB requests but staging (`[cluster]
    /// exchange_timeout_ms`).
    pub exchange: Duration,
    /// Node 0's EPLB waiting for a node to stage a placement (it reads weights:
    /// `[cluster] bootstrap_timeout_seconds`).
    pub staging: Duration,
}

/// The EP ranks of the other nodes, as seen from this one.
#[derive(Debug)]
pub struct RemoteRanks {
    session: u64,
    timeout: Duration,
    staging_timeout: Duration,
    local: Range<usize>,
    /// Per EP rank: `None` for this node's ranks.
    peers: Vec<Option<Peer>>,
}

impl RemoteRanks {
    /// Node `node` of `experts.len()` nodes (each holding `ranks_per_node` contiguous EP ranks,
    /// its expert server at `experts[n]`), in deployment `session`.
    pub fn new(
        session: u64,
        timeouts: Timeouts,
        node: usize,
        ranks_per_node: usize,
        experts: &[SocketAddr],
    ) -> RemoteRanks {
        let peers = (0..experts.len() * ranks_per_node)
            .map(|rank| {
                let owner = rank / ranks_per_node;
                (owner != node).then(|| Peer {
                    node: owner,
                    addr: experts[owner],
                    conn: Mutex::new(Ok(None)),
                })
            })
            .collect();
        RemoteRanks {
            session,
            timeout: timeouts.exchange,
            staging_timeout: timeouts.staging,
            local: node * ranks_per_node..(node + 1) * ranks_per_node,
            peers,
        }
    }

    /// Every EP rank of the deployment.
    pub fn ranks(&self) -> usize {
        self.peers.len()
    }

    /// This node's EP ranks.
    pub fn local_ranks(&self) -> Range<usize> {
        self.local.clone()
    }

    /// Sends the rows of one layer to remote EP rank `rank` and waits for its outputs (the
    /// `wire::Dispatch` / `wire::Reply` exchange): `[slots.len(), dim]` in the rows' order.
    #[allow(clippy::too_many_arguments)]
    pub fn serve(
        &self,
        at: LayerAt,
        epoch: PlacementEpoch,
        rank: usize,
        slots: &[u32],
        weights: &[f32],
        rows: &[f32],
        dim: usize,
    ) -> Result<Vec<f32>, EpError> {
        let Some(Some(peer)) = self.peers.get(rank) else {
            return Err(EpError::Layer {
                layer: at.layer,
                message: format!("EP rank {rank} is not a remote rank of this deployment"),
            });
        };
        let fail = |reason: String| EpError::PeerFailed {
            at,
            rank: EpRank(rank as u16),
            node: peer.node,
            addr: peer.addr.to_string(),
            reason,
        };
        let mut conn = peer.conn.lock().unwrap_or_else(|p| p.into_inner());
        let stream = match &mut *conn {
            Err(earlier) => return Err(fail(format!("failed earlier: {earlier}"))),
            Ok(Some(stream)) => stream,
            Ok(slot @ None) => match self.connect(peer.addr) {
                Ok(stream) => slot.insert(stream),
                Err(e) => {
                    let error = fail(format!("cannot connect: {e}"));
                    *conn = Err(error.to_string());
                    return Err(error);
                }
            },
        };
        let tag = FrameTag {
            session: self.session,
            step: at.step,
            layer: at.layer as u32,
            epoch: epoch.get(),
        };
        let dispatch = Dispatch {
            tag,
            rank: rank as u16,
            dim: dim as u32,
            slots: slots.to_vec(),
            weights: weights.to_vec(),
            rows: rows.to_vec(),
        };
        let answer = dispatch.send(stream).and_then(|()| Reply::receive(stream));
        let result = match answer {
            Ok(Reply::Combine { tag: got, outputs }) if got == tag => {
                if outputs.len() == rows.len() {
                    Ok(outputs)
                } else {
                    Err(fail(format!(
                        "answered {} values for {} rows of {dim}",
                        outputs.len(),
                        slots.len()
                    )))
                }
            }
            Ok(Reply::Combine { tag: got, .. }) => Err(fail(format!(
                "answered the exchange of step {} layer {} epoch {} (session {:x})",
                got.step, got.layer, got.epoch, got.session
            ))),
            Ok(Reply::Failure(reason)) => Err(fail(reason)),
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                Err(EpError::Timeout {
                    at,
                    rank: EpRank(rank as u16),
                    node: peer.node,
                    addr: peer.addr.to_string(),
                    waited_ms: self.timeout.as_millis(),
                })
            }
            Err(e) => Err(fail(e.to_string())),
        };
        if let Err(error) = &result {
            *conn = Err(error.to_string());
        }
        result
    }

    fn connect(&self, addr: SocketAddr) -> std::io::Result<TcpStream> {
        connect(addr, self.timeout)
    }

    /// The other nodes, in node order: (node, expert server address).
    pub fn other_nodes(&self) -> Vec<(usize, SocketAddr)> {
        let mut nodes: Vec<(usize, SocketAddr)> = self
            .peers
            .iter()
            .flatten()
            .map(|peer| (peer.node, peer.addr))
            .collect();
        nodes.dedup();
        nodes
    }

    /// Sends `control` (node 0's EPLB) to every other node in node order, each on a connection
    /// of its own, and returns their answers; the first node that refuses, fails or does not
    /// answer in time (staging: the staging timeout) ends it with an error naming the node.
    pub fn control_all(&self, control: &Control) -> Result<Vec<ControlReply>, EpError> {
        let wait = match control {
            Control::Stage { .. } => self.staging_timeout,
            _ => self.timeout,
        };
        let request = ControlRequest {
            session: self.session,
            control: control.clone(),
        };
        self.other_nodes()
            .into_iter()
            .map(|(node, addr)| {
                let fail = |reason: String| EpError::Control {
                    node,
                    addr: addr.to_string(),
                    reason,
                };
                let answer = connect(addr, wait).and_then(|mut stream| {
                    request.send(&mut stream)?;
                    ControlReply::receive(&mut stream)
                });
                match answer {
                    Ok(ControlReply::Failure(reason)) => Err(fail(reason)),
                    Ok(reply) => Ok(reply),
                    Err(e)
                        if matches!(
                            e.kind(),
                            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                        ) =>
                    {
                        Err(fail(format!(
                            "did not answer within {} ms",
                            wait.as_millis()
                        )))
                    }
                    Err(e) => Err(fail(e.to_string())),
                }
            })
            .collect()
    }
}

fn connect(addr: SocketAddr, timeout: Duration) -> std::io::Result<TcpStream> {
    let stream = TcpStream::connect_timeout(&addr, timeout)?;
    stream.set_read_timeout(Some(timeout))?;
    stream.set_write_timeout(Some(timeout))?;
    stream.set_nodelay(true)?;
    Ok(stream)
}

/// This node's expert server: answers the rows other nodes send its EP ranks, with the
/// committed shards of `ExpertParallel` (one thread per connection). Stops accepting when
/// dropped; a connection's thread ends when its peer closes it or the engine is gone.
#[derive(Debug)]
pub struct ExpertServer {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
}

impl ExpertServer {
    /// Serves the connections of `listener` for deployment `session` with `parallel`'s shards.
    pub fn start(
        listener: TcpListener,
        session: u64,
        parallel: Weak<ExpertParallel>,
    ) -> Result<ExpertServer, EpError> {
        let addr = listener
            .local_addr()
            .map_err(|e| EpError::Bootstrap(format!("expert server address: {e}")))?;
        let stop = Arc::new(AtomicBool::new(false));
        accept_until_stopped("expert-server", listener, stop.clone(), move |conn| {
            let parallel = parallel.clone();
            let _ = thread::Builder::new()
                .name("expert-peer".into())
                .spawn(move || serve_peer(conn, session, parallel));
        })
        .map_err(|e| EpError::Bootstrap(format!("expert server thread: {e}")))?;
        Ok(ExpertServer { addr, stop })
    }
}

impl Drop for ExpertServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Wakes the accept loop so it sees the flag.
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_secs(1));
    }
}

/// Answers one peer's requests (dispatches, or node 0's EPLB) until it closes the connection.
fn serve_peer(mut conn: TcpStream, session: u64, parallel: Weak<ExpertParallel>) {
    let _ = conn.set_nodelay(true);
    while let Ok(Some(request)) = Request::receive(&mut conn) {
        let sent = match request {
            Request::Dispatch(dispatch) => match answer(&dispatch, session, &parallel) {
                Ok(outputs) => Reply::Combine {
                    tag: dispatch.tag,
                    outputs,
                },
                Err(reason) => Reply::Failure(reason),
            }
            .send(&mut conn),
            Request::Control(request) => follow(request, session, &parallel).send(&mut conn),
        };
        if sent.is_err() {
            return;
        }
    }
}

/// Node 0's EPLB request, run by this node's `EplbActor`.
fn follow(request: ControlRequest, session: u64, parallel: &Weak<ExpertParallel>) -> ControlReply {
    if request.session != session {
        return ControlReply::Failure(format!(
            "an EPLB request of session {:x}, this deployment is {session:x}",
            request.session
        ));
    }
    match parallel.upgrade() {
        Some(parallel) => parallel.follow(request.control),
        None => ControlReply::Failure("the engine of this node has stopped".into()),
    }
}

fn answer(
    dispatch: &Dispatch,
    session: u64,
    parallel: &Weak<ExpertParallel>,
) -> Result<Vec<f32>, String> {
    let tag = dispatch.tag;
    if tag.session != session {
        return Err(format!(
            "rows of session {:x}, this deployment is {session:x}",
            tag.session
        ));
    }
    let parallel = parallel
        .upgrade()
        .ok_or("the engine of this node has stopped")?;
    let comm = parallel.comm_of(PlacementEpoch(tag.epoch)).ok_or_else(|| {
        format!(
            "rows of placement epoch {}, this node serves {} (and no staged or previous \
                 placement of that epoch)",
            tag.epoch,
            parallel.current().epoch()
        )
    })?;
    comm.serve_rows(
        usize::from(dispatch.rank),
        tag.layer as usize,
        &dispatch.slots,
        &dispatch.weights,
        &dispatch.rows,
    )
    .map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::free_loopback;
    use crate::comm::{Comm, StepExperts};
    use crate::experts::parallel::{EpSettings, EplbSchedule};
    use crate::experts::shard::ExpertShard;
    use crate::experts::tiny_test_model;
    use deepinfer_model::error::ModelError;
    use deepinfer_model::expert_dispatch::RoutedExperts;
    use deepinfer_model::{EntryOutput, LogitsWanted, Model, StepEntry, StepOptions};
    use deepinfer_topology::{ClusterConfig, DpRank};
    use std::time::Instant;

    /// Every logits row of `tokens` as a fresh sequence's one-entry step, the routed experts
    /// run by `experts` when given.
    fn all_logits(
        model: &Model,
        tokens: &[u32],
        experts: Option<&dyn RoutedExperts>,
    ) -> Result<Vec<f32>, ModelError> {
        let mut seq = model.new_sequence();
        let options = StepOptions {
            experts,
            ..StepOptions::default()
        };
        let entry = StepEntry::new(&mut seq, tokens, LogitsWanted::All);
        model
            .forward_step(&mut [entry], options)
            .and_then(EntryOutput::one_entry_logits)
    }

    fn bits(values: &[f32]) -> Vec<u32> {
        values.iter().map(|v| v.to_bits()).collect()
    }

    /// Nodes 0 and 1 of two in this process, joined over loopback sockets, with `ep_ranks` EP
    /// ranks and `redundant` redundant slots per layer over `model`.
    fn two_nodes(
        model: &Arc<deepinfer_model::Model>,
        ep_ranks: usize,
        redundant: usize,
    ) -> (Arc<ExpertParallel>, Arc<ExpertParallel>) {
        let settings = EpSettings {
            ep_ranks,
            redundant_experts: redundant,
            num_groups: 1,
            num_nodes: 2,
            eplb: EplbSchedule {
                enabled: false,
                window_steps: 1,
                interval_steps: 1,
            },
        };
        let bootstrap = Some(free_loopback());
        let cluster = move |node: u16| ClusterConfig {
            node,
            bootstrap,
            expert_listen: "127.0.0.1:0".parse().expect("address"),
            exchange_timeout: Duration::from_secs(20),
            bootstrap_timeout: Duration::from_secs(20),
        };
        let other = {
            let model = model.clone();
            thread::spawn(move || ExpertParallel::on_node(model, settings, &cluster(1)))
        };
        let first = ExpertParallel::on_node(model.clone(), settings, &cluster(0)).expect("node 0");
        let second = other.join().expect("thread").expect("node 1");
        (first, second)
    }

    /// Two nodes in one process over real loopback sockets (ep = 4, two EP ranks each): each
    /// node's forward through its `LocalComm` (half the experts here, half over the socket) gives
    /// the model's own logits bit for bit, and both nodes' shards served picks.
    #[test]
    fn two_nodes_over_sockets_give_the_model_bits() {
        let (_dir, model) = tiny_test_model();
        let (first, second) = two_nodes(&model, 4, 4);
        assert_eq!(first.current().shards().len(), 2);
        assert_eq!(second.current().shards()[0].rank(), EpRank(2));

        let tokens = [5u32, 9, 300, 41, 41, 7, 7, 200, 13];
        let expected = all_logits(&model, &tokens, None).expect("forward");
        for (dp, node) in [&first, &second].into_iter().enumerate() {
            let comm = node.current();
            let step = StepExperts::new(comm.as_ref(), DpRank(dp as u16), 0);
            let got = all_logits(&model, &tokens, Some(&step)).expect("forward with experts");
            assert_eq!(step.failure(), None);
            assert_eq!(bits(&got), bits(&expected), "node {dp}");
            assert_eq!(comm.ep_ranks(), 4);
        }
        for node in [&first, &second] {
            for shard in node.current().shards() {
                let served: u64 = shard.take_loads().iter().flatten().sum();
                assert!(served > 0, "{} served nothing", shard.rank());
            }
        }
    }

    /// Across an EPLB commit, a node serves rows of its staged epoch (a peer adopted it first)
    /// and of the epoch before its current one (a peer has not adopted it yet), with the model's
    /// bits; rows of any other epoch are refused, naming it.
    #[test]
    fn a_node_serves_its_staged_current_and_previous_epochs_only() {
        let (_dir, model) = tiny_test_model();
        let (first, second) = two_nodes(&model, 2, 2);
        assert!(second.follower() && !first.follower());

        let layers = model.config().n_layers;
        let loads = vec![vec![40.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 20.0]; layers];
        let placement = Arc::new(
            deepinfer_topology::rebalance_experts(&loads, second.shape()).expect("solved"),
        );
        let next = |node: &ExpertParallel, epoch: u32| {
            let current = node.current();
            let shards = current
                .shards()
                .iter()
                .map(|shard| {
                    let (built, _) = ExpertShard::build(
                        node.source(),
                        &placement,
                        shard.rank(),
                        PlacementEpoch(epoch),
                        Some(shard),
                    )
                    .expect("shard");
                    Arc::new(built)
                })
                .collect();
            Arc::new(
                current
                    .next_epoch(PlacementEpoch(epoch), placement.clone(), shards)
                    .expect("next epoch"),
            )
        };
        let tokens = [5u32, 9, 300, 41, 7, 200];
        let expected = all_logits(&model, &tokens, None).expect("forward");
        let run = |comm: &dyn Comm| {
            let step = StepExperts::new(comm, DpRank(0), 0);
            let got = all_logits(&model, &tokens, Some(&step)).expect("forward with experts");
            (bits(&got), step.failure())
        };
        let epoch0 = first.current();
        let epoch1 = next(&first, 1);
        // Node 1 staged epoch 1: node 0's rows of epoch 1 (it adopted it first) are served.
        let served = |comm: &dyn Comm| {
            let (got, failure) = run(comm);
            assert_eq!(failure, None);
            assert!(got == bits(&expected), "the bits differ from the model's");
        };
        second.stage(next(&second, 1));
        served(epoch1.as_ref());
        // Node 1 committed it: rows of epoch 0 (node 0 not yet adopted) are still served.
        let staged = second.comm_of(PlacementEpoch(1)).expect("staged");
        second.commit(staged);
        assert_eq!(second.current().epoch(), PlacementEpoch(1));
        served(epoch0.as_ref());
        // An epoch node 1 neither runs, staged nor ran last is refused by name.
        let (_, failure) = run(next(&first, 5).as_ref());
        let failure = failure.expect("refused").to_string();
        assert!(failure.contains("placement epoch 5"), "{failure}");
    }

    /// The expert addresses of three nodes as node 0 sees them: its own (unused), node 1's (a
    /// listener that accepts but never answers: kept open by the returned listener) and node
    /// 2's (nothing listens).
    fn silent_and_gone() -> (TcpListener, [SocketAddr; 3]) {
        let silent = TcpListener::bind("127.0.0.1:0").expect("listener");
        let experts = [
            "127.0.0.1:1".parse().expect("address"),
            silent.local_addr().expect("address"),
            free_loopback(),
        ];
        (silent, experts)
    }

    /// A peer that accepts but never answers: the exchange fails after the timeout with an error
    /// naming the DP rank, step, layer and EP rank; the next call fails at once. A peer that is
    /// gone (connection refused) fails at once too.
    #[test]
    fn a_silent_or_gone_peer_fails_the_exchange_by_name_without_a_hang() {
        let (silent, experts) = silent_and_gone();
        // The timeout is long against scheduling noise on a loaded machine, so "at once" (below
        // half of it) and "after the timeout" cannot be confused.
        let timeout = Duration::from_secs(2);
        let timeouts = Timeouts {
            exchange: timeout,
            staging: timeout,
        };
        let remote = RemoteRanks::new(9, timeouts, 0, 1, &experts);
        assert_eq!((remote.ranks(), remote.local_ranks()), (3, 0..1));
        let at = LayerAt {
            dp: deepinfer_topology::DpRank(0),
            step: 12,
            layer: 3,
        };
        let started = Instant::now();
        let err = remote
            .serve(at, PlacementEpoch(0), 1, &[0], &[1.0], &[0.5; 4], 4)
            .expect_err("silent peer");
        assert!(started.elapsed() >= timeout);
        assert!(started.elapsed() < 10 * timeout);
        assert!(matches!(err, EpError::Timeout { .. }), "{err}");
        let text = err.to_string();
        for part in ["DP rank 0", "step 12", "layer 3", "EP rank 1", "node 1"] {
            assert!(text.contains(part), "{text} lacks {part}");
        }
        let again = Instant::now();
        let err = remote
            .serve(at, PlacementEpoch(0), 1, &[0], &[1.0], &[0.5; 4], 4)
            .expect_err("stays failed");
        assert!(err.to_string().contains("failed earlier"), "{err}");
        assert!(again.elapsed() < timeout / 2);
        let err = remote
            .serve(at, PlacementEpoch(0), 2, &[0], &[1.0], &[0.5; 4], 4)
            .expect_err("gone peer");
        assert!(matches!(err, EpError::PeerFailed { .. }), "{err}");
        assert!(err.to_string().contains("EP rank 2 on node 2"), "{err}");
        drop(silent);
    }

    /// Node 0's EPLB request to a node that accepts but never answers fails naming the node
    /// after the timeout (staging: the staging timeout), one to a gone node at once, and the
    /// nodes are asked in node order (the first failure ends the round).
    #[test]
    fn an_eplb_request_to_a_silent_or_gone_node_fails_naming_it() {
        let (silent, experts) = silent_and_gone();
        let gone = experts[2];
        let timeouts = Timeouts {
            exchange: Duration::from_millis(300),
            staging: Duration::from_secs(2),
        };
        let remote = RemoteRanks::new(9, timeouts, 0, 1, &experts);
        assert_eq!(remote.other_nodes(), vec![(1, experts[1]), (2, experts[2])]);
        let started = Instant::now();
        let err = remote
            .control_all(&Control::Commit { epoch: 3 })
            .expect_err("silent node");
        assert!(started.elapsed() >= timeouts.exchange);
        assert!(started.elapsed() < timeouts.staging);
        let text = err.to_string();
        assert!(
            text.contains("node 1") && text.contains("did not answer within 300 ms"),
            "{text}"
        );
        let placement = deepinfer_topology::ExpertPlacement::uniform(
            2,
            4,
            deepinfer_topology::PlacementShape {
                num_replicas: 6,
                num_groups: 1,
                num_nodes: 3,
                num_gpus: 3,
            },
        )
        .expect("placement");
        let started = Instant::now();
        let err = remote
            .control_all(&Control::Stage {
                epoch: 3,
                placement,
            })
            .expect_err("silent node");
        assert!(
            started.elapsed() >= timeouts.staging,
            "{:?}",
            started.elapsed()
        );
        assert!(err.to_string().contains("within 2000 ms"), "{err}");
        drop(silent);
        let gone_only = RemoteRanks::new(9, timeouts, 0, 1, &[experts[0], gone]);
        let started = Instant::now();
        let err = gone_only
            .control_all(&Control::TakeLoads)
            .expect_err("gone node");
        assert!(started.elapsed() < timeouts.exchange);
        assert!(matches!(err, EpError::Control { node: 1, .. }), "{err}");
    }
}
