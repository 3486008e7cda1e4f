//! The byte format of the messages between `deepinfer-node` processes (little-endian, one frame
//! per message, every length bounds-checked before anything is allocated).
//!
//! Every frame starts with `MAGIC` and a kind byte. Expert traffic: `Dispatch` (a DP rank's rows
//! of one layer for one EP rank: the count first, then per row its local slot and routing
//! weight, then the rows) answered by `Combine` (the output rows, same count and order) or
//! `Failure` (why the EP rank could not serve them). Start-up: `Hello` (a node joining) answered
//! by `Welcome` (the session id and every node's expert address) or `Failure`. Live EPLB: node
//! 0's `Control` requests (take the loads, stage a placement, commit or abort an epoch) to the
//! other nodes' expert servers, answered by `ControlReply`. An expert server reads either kind of
//! request on a connection (`Request`). Start-up frames carry `BOOTSTRAP_VERSION` (nodes of
//! another build are refused by name), and `Welcome` carries node 0's opaque unique id when the
//! deployment has one (NCCL's 128 bytes, for CUDA ranks across nodes: `UNIQUE_ID_BYTES`, length
//! checked). Across CUDA nodes, each node tells the others how many collective steps its ranks
//! began (`StepCount`, `comm::steps`), and live EPLB of CUDA ranks agrees its placements over
//! the same connections (`NodeEplb`, `experts::device`: node 0's requests and the other nodes'
//! answers; each frame carries `NODE_EPLB_VERSION` and its body's length, both checked before
//! the body is read, and a body that does not parse to exactly that length is refused by name).

use std::io::{self, Read, Write};

use deepinfer_topology::{EplbPolicy, ExpertId, ExpertPlacement, LayerPlacement};

/// "DIEP": the first bytes of every frame.
const MAGIC: u32 = 0x5045_4944;
/// Most rows in one frame.
const MAX_ROWS: u32 = 1 << 22;
/// Widest row (f32 values).
const MAX_DIM: u32 = 1 << 16;
/// Most f32 values in one frame (1 GiB).
const MAX_VALUES: u32 = 1 << 28;
/// Longest text (an address, a failure message) or node table.
const MAX_TEXT: u32 = 1 << 16;

const DISPATCH: u8 = 1;
const COMBINE: u8 = 2;
const FAILURE: u8 = 3;
const HELLO: u8 = 4;
const WELCOME: u8 = 5;
const CONTROL: u8 = 6;
const LOADS: u8 = 7;
const STAGED: u8 = 8;
const DONE: u8 = 9;
const STEPS: u8 = 10;
const NODE_EPLB: u8 = 11;
/// The layout of `NodeEplb` frames.
pub const NODE_EPLB_VERSION: u16 = 1;
/// Longest `NodeEplb` body (a placement of 64 layers x 65536 slots fits).
const MAX_NODE_EPLB_BYTES: u32 = 1 << 28;
/// The layout of `Hello` and `Welcome` (2: `Welcome` carries a unique id).
pub const BOOTSTRAP_VERSION: u16 = 2;
/// Bytes of the unique id `Welcome` may carry (NCCL's `ncclUniqueId`).
pub const UNIQUE_ID_BYTES: usize = 128;
/// The opaque id node 0 hands every node (NCCL's unique id, for CUDA ranks across nodes).
pub type UniqueId = [u8; UNIQUE_ID_BYTES];
/// Most layers, slots, EP ranks or replicas in a placement or a load table.
const MAX_TABLE: u32 = 1 << 20;

/// Which exchange a frame belongs to: the session, the sender's step, the layer and epoch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameTag {
    /// The deployment's session id (node 0 draws it at the bootstrap).
    pub session: u64,
    /// The sending DP rank's step.
    pub step: u64,
    pub layer: u32,
    pub epoch: u32,
}

/// A DP rank's rows of one layer for one EP rank.
#[derive(Debug, Clone, PartialEq)]
pub struct Dispatch {
    pub tag: FrameTag,
    /// The EP rank that is to serve them.
    pub rank: u16,
    pub dim: u32,
    /// Per row: the EP rank's local slot (the replica of the row's expert).
    pub slots: Vec<u32>,
    /// Per row: the routing weight.
    pub weights: Vec<f32>,
    /// `[slots.len(), dim]`.
    pub rows: Vec<f32>,
}

/// An answer to a `Dispatch`.
#[derive(Debug, Clone, PartialEq)]
pub enum Reply {
    /// The output rows (`[count, dim]`, in the dispatch's row order).
    Combine {
        tag: FrameTag,
        outputs: Vec<f32>,
    },
    Failure(String),
}

/// A node joining the deployment.
#[derive(Debug, Clone, PartialEq)]
pub struct Hello {
    pub node: u16,
    pub nodes: u16,
    /// What every node must agree on (model and topology), hashed.
    pub fingerprint: u64,
    /// Where this node's expert server listens.
    pub expert_addr: String,
}

/// Node 0's answer to a `Hello` once every node joined.
#[derive(Debug, Clone, PartialEq)]
pub enum Welcome {
    Joined {
        session: u64,
        /// Every node's expert address, by node index.
        experts: Vec<String>,
        /// The unique id node 0 created for the deployment (`None`: it has none, the CPU).
        unique_id: Option<UniqueId>,
    },
    Failure(String),
}

/// Across CUDA nodes: the most collective steps a rank of node `node` has begun
/// (`experts::lockstep`), sent to every other node each time it grows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepCount {
    pub session: u64,
    pub node: u16,
    pub began: u64,
}

/// Live EPLB of CUDA ranks across nodes (`experts::device`): what node 0, which runs the EPLB,
/// and the other nodes tell each other over their step-count connections.
#[derive(Debug, Clone, PartialEq)]
pub enum NodeEplb {
    /// Node 0 to the others: read and reset your ranks' load counters, answer `Loads`.
    TakeLoads { round: u64 },
    /// Per EP rank of the node, in rank order: its epoch and `[layer][local slot]` picks.
    Loads { round: u64, ranks: RankLoads },
    /// Node 0 to the others: build your ranks' experts of `placement` as `epoch`.
    Stage {
        epoch: u32,
        placement: ExpertPlacement,
    },
    /// Every rank of the node built `epoch` (`copied`: experts uploaded).
    Staged { epoch: u32, copied: u64 },
    /// Node 0 to the others: hold your ranks before `step` if none has begun it.
    Propose { epoch: u32, step: u64 },
    /// No rank of the node has begun `step`; they are held before it.
    Ready { epoch: u32, step: u64 },
    /// A rank of the node has begun `step` already: `began` steps.
    Late { epoch: u32, step: u64, began: u64 },
    /// Node 0 to the others: every step from `step` on runs on `epoch`.
    Commit { epoch: u32, step: u64 },
    /// `epoch` is dropped and the placement in use stays (node 0 to the others; or a node that
    /// cannot stage, to node 0).
    Abort { epoch: u32, reason: String },
}

/// A `NodeEplb` message of deployment `session` from node `node`.
#[derive(Debug, Clone, PartialEq)]
pub struct NodeEplbFrame {
    pub session: u64,
    pub node: u16,
    pub message: NodeEplb,
}

/// What one node sends another over its step-count connection.
#[derive(Debug, Clone, PartialEq)]
pub enum PeerFrame {
    Count(StepCount),
    Eplb(NodeEplbFrame),
}

/// What node 0's EPLB asks another node's expert server (one request per connection).
#[derive(Debug, Clone, PartialEq)]
pub enum Control {
    /// Read and reset the load counters of the node's EP ranks.
    TakeLoads,
    /// Build the node's shards of `placement` as `epoch` (experts it lacks read from its own
    /// checkpoint), kept staged: served to rows of that epoch, not yet adopted by its steps.
    Stage {
        epoch: u32,
        placement: ExpertPlacement,
    },
    /// The staged `epoch` becomes the one the node's steps adopt from their next boundary.
    Commit { epoch: u32 },
    /// Drop the staged `epoch`.
    Abort { epoch: u32 },
}

/// A `Control` request of deployment `session`.
#[derive(Debug, Clone, PartialEq)]
pub struct ControlRequest {
    pub session: u64,
    pub control: Control,
}

/// An expert server's answer to a `ControlRequest`.
#[derive(Debug, Clone, PartialEq)]
pub enum ControlReply {
    /// Per EP rank of the node, in rank order: its shard's epoch and `[layer][local slot]` picks.
    Loads(RankLoads),
    /// The placement is staged; `copied` expert slots were read in.
    Staged {
        copied: u64,
    },
    /// Committed or aborted.
    Done,
    Failure(String),
}

/// What an expert server reads on a connection.
#[derive(Debug, Clone, PartialEq)]
pub enum Request {
    Dispatch(Dispatch),
    Control(ControlRequest),
}

#[derive(Default)]
struct Frame(Vec<u8>);

impl Frame {
    fn new(kind: u8) -> Frame {
        let mut frame = Frame(Vec::new());
        frame.u32(MAGIC);
        frame.0.push(kind);
        frame
    }
    fn u16(&mut self, v: u16) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn u32(&mut self, v: u32) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn f32s(&mut self, values: &[f32]) {
        for v in values {
            self.0.extend_from_slice(&v.to_le_bytes());
        }
    }
    fn text(&mut self, text: &str) {
        // Cut at a character boundary, so a long message stays UTF-8.
        let end = (0..=text.len().min(MAX_TEXT as usize))
            .rev()
            .find(|&i| text.is_char_boundary(i))
            .unwrap_or(0);
        let bytes = &text.as_bytes()[..end];
        self.u32(bytes.len() as u32);
        self.0.extend_from_slice(bytes);
    }
    fn tag(&mut self, tag: FrameTag) {
        self.u64(tag.session);
        self.u64(tag.step);
        self.u32(tag.layer);
        self.u32(tag.epoch);
    }
    /// A `FAILURE` frame carrying `message`.
    fn failure(message: &str) -> Frame {
        let mut frame = Frame::new(FAILURE);
        frame.text(message);
        frame
    }
    fn send(self, w: &mut impl Write) -> io::Result<()> {
        w.write_all(&self.0)?;
        w.flush()
    }
}

fn bad(message: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, message)
}

fn u8_of(r: &mut impl Read) -> io::Result<u8> {
    let mut b = [0u8; 1];
    r.read_exact(&mut b)?;
    Ok(b[0])
}
fn u16_of(r: &mut impl Read) -> io::Result<u16> {
    let mut b = [0u8; 2];
    r.read_exact(&mut b)?;
    Ok(u16::from_le_bytes(b))
}
fn u32_of(r: &mut impl Read) -> io::Result<u32> {
    let mut b = [0u8; 4];
    r.read_exact(&mut b)?;
    Ok(u32::from_le_bytes(b))
}
fn u64_of(r: &mut impl Read) -> io::Result<u64> {
    let mut b = [0u8; 8];
    r.read_exact(&mut b)?;
    Ok(u64::from_le_bytes(b))
}
fn bounded(value: u32, max: u32, what: &str) -> io::Result<usize> {
    if value > max {
        return Err(bad(format!("{what} {value} is over the limit {max}")));
    }
    Ok(value as usize)
}
fn f32s_of(r: &mut impl Read, count: usize) -> io::Result<Vec<f32>> {
    let mut bytes = vec![0u8; count * 4];
    r.read_exact(&mut bytes)?;
    Ok(bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect())
}
fn text_of(r: &mut impl Read) -> io::Result<String> {
    let len = bounded(u32_of(r)?, MAX_TEXT, "text length")?;
    let mut bytes = vec![0u8; len];
    r.read_exact(&mut bytes)?;
    String::from_utf8(bytes).map_err(|_| bad("text is not UTF-8".into()))
}
fn tag_of(r: &mut impl Read) -> io::Result<FrameTag> {
    Ok(FrameTag {
        session: u64_of(r)?,
        step: u64_of(r)?,
        layer: u32_of(r)?,
        epoch: u32_of(r)?,
    })
}
/// Reads the magic and the kind byte (`None`: the peer closed the connection between frames).
fn kind_of(r: &mut impl Read) -> io::Result<Option<u8>> {
    let mut b = [0u8; 4];
    match r.read_exact(&mut b) {
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(None),
        other => other?,
    }
    if u32::from_le_bytes(b) != MAGIC {
        return Err(bad("not a deepinfer frame (wrong magic)".into()));
    }
    Ok(Some(u8_of(r)?))
}
fn expect_kind(r: &mut impl Read, kinds: &[u8]) -> io::Result<u8> {
    match kind_of(r)? {
        Some(kind) if kinds.contains(&kind) => Ok(kind),
        Some(kind) => Err(bad(format!("unexpected frame kind {kind}"))),
        None => Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            "the peer closed the connection",
        )),
    }
}

/// Per EP rank of a node, in rank order: its shard's epoch and `[layer][local slot]` picks (the
/// loads of [`ControlReply::Loads`] and [`NodeEplb::Loads`]).
pub type RankLoads = Vec<(u32, Vec<Vec<u64>>)>;

impl Frame {
    fn rank_loads(&mut self, ranks: &RankLoads) {
        self.u32(ranks.len() as u32);
        for (epoch, per_slot) in ranks {
            self.u32(*epoch);
            self.u32(per_slot.len() as u32);
            for layer in per_slot {
                self.u32(layer.len() as u32);
                for &count in layer {
                    self.u64(count);
                }
            }
        }
    }

    fn placement(&mut self, placement: &ExpertPlacement) {
        self.0.push(match placement.policy {
            EplbPolicy::Hierarchical => 0,
            EplbPolicy::Global => 1,
        });
        self.u32(placement.slots_per_gpu as u32);
        self.u32(placement.layers.len() as u32);
        for layer in &placement.layers {
            self.u32(layer.phy2log.len() as u32);
            for expert in &layer.phy2log {
                self.u16(expert.get());
            }
            self.u32(layer.log2phy.len() as u32);
            for replicas in &layer.log2phy {
                self.u32(replicas.len() as u32);
                for &slot in replicas {
                    self.u32(slot);
                }
            }
        }
    }
}

fn table_len(r: &mut impl Read, what: &str) -> io::Result<usize> {
    bounded(u32_of(r)?, MAX_TABLE, what)
}

/// A table: its length (at most `MAX_TABLE`, else an error naming `what`), then each item.
fn table_of<R: Read, T>(
    r: &mut R,
    what: &str,
    mut item: impl FnMut(&mut R) -> io::Result<T>,
) -> io::Result<Vec<T>> {
    let len = table_len(r, what)?;
    (0..len).map(|_| item(r)).collect()
}

fn rank_loads_of(r: &mut impl Read) -> io::Result<RankLoads> {
    table_of(r, "EP ranks", |r| {
        let epoch = u32_of(r)?;
        let per_slot = table_of(r, "load layers", |r| table_of(r, "load slots", u64_of))?;
        Ok((epoch, per_slot))
    })
}

fn placement_of(r: &mut impl Read) -> io::Result<ExpertPlacement> {
    let policy = match u8_of(r)? {
        0 => EplbPolicy::Hierarchical,
        1 => EplbPolicy::Global,
        other => return Err(bad(format!("placement policy {other} is not 0 or 1"))),
    };
    let slots_per_gpu = table_len(r, "slots per EP rank")?;
    let layers = table_of(r, "placement layers", |r| {
        let phy2log = table_of(r, "physical slots", |r| u16_of(r).map(ExpertId))?;
        let log2phy = table_of(r, "logical experts", |r| table_of(r, "replicas", u32_of))?;
        Ok(LayerPlacement { phy2log, log2phy })
    })?;
    Ok(ExpertPlacement {
        policy,
        slots_per_gpu,
        layers,
    })
}

impl Request {
    /// The next request on a connection (`None`: the peer closed it between frames).
    pub fn receive(r: &mut impl Read) -> io::Result<Option<Request>> {
        match kind_of(r)? {
            None => Ok(None),
            Some(DISPATCH) => Dispatch::body(r).map(|d| Some(Request::Dispatch(d))),
            Some(CONTROL) => ControlRequest::body(r).map(|c| Some(Request::Control(c))),
            Some(kind) => Err(bad(format!("expected a request, got frame kind {kind}"))),
        }
    }
}

impl ControlRequest {
    pub fn send(&self, w: &mut impl Write) -> io::Result<()> {
        let mut f = Frame::new(CONTROL);
        f.u64(self.session);
        match &self.control {
            Control::TakeLoads => f.0.push(0),
            Control::Stage { epoch, placement } => {
                f.0.push(1);
                f.u32(*epoch);
                f.placement(placement);
            }
            Control::Commit { epoch } => {
                f.0.push(2);
                f.u32(*epoch);
            }
            Control::Abort { epoch } => {
                f.0.push(3);
                f.u32(*epoch);
            }
        }
        f.send(w)
    }

    fn body(r: &mut impl Read) -> io::Result<ControlRequest> {
        let session = u64_of(r)?;
        let control = match u8_of(r)? {
            0 => Control::TakeLoads,
            1 => Control::Stage {
                epoch: u32_of(r)?,
                placement: placement_of(r)?,
            },
            2 => Control::Commit { epoch: u32_of(r)? },
            3 => Control::Abort { epoch: u32_of(r)? },
            other => return Err(bad(format!("control request {other} is not 0 to 3"))),
        };
        Ok(ControlRequest { session, control })
    }
}

impl ControlReply {
    pub fn send(&self, w: &mut impl Write) -> io::Result<()> {
        let mut f;
        match self {
            ControlReply::Loads(ranks) => {
                f = Frame::new(LOADS);
                f.rank_loads(ranks);
            }
            ControlReply::Staged { copied } => {
                f = Frame::new(STAGED);
                f.u64(*copied);
            }
            ControlReply::Done => f = Frame::new(DONE),
            ControlReply::Failure(message) => f = Frame::failure(message),
        }
        f.send(w)
    }

    pub fn receive(r: &mut impl Read) -> io::Result<ControlReply> {
        Ok(match expect_kind(r, &[LOADS, STAGED, DONE, FAILURE])? {
            LOADS => ControlReply::Loads(rank_loads_of(r)?),
            STAGED => ControlReply::Staged { copied: u64_of(r)? },
            DONE => ControlReply::Done,
            _ => ControlReply::Failure(text_of(r)?),
        })
    }
}

impl Dispatch {
    pub fn send(&self, w: &mut impl Write) -> io::Result<()> {
        let mut f = Frame::new(DISPATCH);
        f.tag(self.tag);
        f.u16(self.rank);
        f.u32(self.slots.len() as u32);
        f.u32(self.dim);
        for (&slot, &weight) in self.slots.iter().zip(&self.weights) {
            f.u32(slot);
            f.f32s(&[weight]);
        }
        f.f32s(&self.rows);
        f.send(w)
    }

    /// A dispatch's fields after its kind byte.
    fn body(r: &mut impl Read) -> io::Result<Dispatch> {
        let tag = tag_of(r)?;
        let rank = u16_of(r)?;
        let count = bounded(u32_of(r)?, MAX_ROWS, "row count")?;
        let dim = bounded(u32_of(r)?, MAX_DIM, "row width")?;
        bounded(
            u32::try_from(count * dim).unwrap_or(u32::MAX),
            MAX_VALUES,
            "rows x width",
        )?;
        let mut slots = Vec::with_capacity(count);
        let mut weights = Vec::with_capacity(count);
        for _ in 0..count {
            slots.push(u32_of(r)?);
            weights.push(f32s_of(r, 1)?[0]);
        }
        let rows = f32s_of(r, count * dim)?;
        Ok(Dispatch {
            tag,
            rank,
            dim: dim as u32,
            slots,
            weights,
            rows,
        })
    }
}

impl Reply {
    pub fn send(&self, w: &mut impl Write) -> io::Result<()> {
        match self {
            Reply::Combine { tag, outputs } => {
                let mut f = Frame::new(COMBINE);
                f.tag(*tag);
                f.u32(outputs.len() as u32);
                f.f32s(outputs);
                f.send(w)
            }
            Reply::Failure(message) => Frame::failure(message).send(w),
        }
    }

    pub fn receive(r: &mut impl Read) -> io::Result<Reply> {
        match expect_kind(r, &[COMBINE, FAILURE])? {
            COMBINE => {
                let tag = tag_of(r)?;
                let values = bounded(u32_of(r)?, MAX_VALUES, "output values")?;
                Ok(Reply::Combine {
                    tag,
                    outputs: f32s_of(r, values)?,
                })
            }
            _ => Ok(Reply::Failure(text_of(r)?)),
        }
    }
}

/// Reads a start-up frame's version: another build's frame is an error naming both versions.
fn version_of(r: &mut impl Read, frame: &str) -> io::Result<()> {
    let version = u16_of(r)?;
    if version != BOOTSTRAP_VERSION {
        return Err(bad(format!(
            "{frame} of bootstrap version {version}, this node speaks version \
             {BOOTSTRAP_VERSION} (every node must run the same deepinfer build)"
        )));
    }
    Ok(())
}

/// Reads `Welcome`'s unique id: its length (0: none, or `UNIQUE_ID_BYTES`), then the bytes.
fn unique_id_of(r: &mut impl Read) -> io::Result<Option<UniqueId>> {
    let len = u32_of(r).map_err(|e| cut_short("the unique id's length", e))?;
    match len as usize {
        0 => Ok(None),
        UNIQUE_ID_BYTES => {
            let mut id = [0u8; UNIQUE_ID_BYTES];
            r.read_exact(&mut id)
                .map_err(|e| cut_short("the unique id (128 bytes)", e))?;
            Ok(Some(id))
        }
        other => Err(bad(format!(
            "the unique id is {other} bytes long, expected 0 (none) or {UNIQUE_ID_BYTES}"
        ))),
    }
}

/// A frame that ends before `what`: the same error kind, naming what was missing.
fn cut_short(what: &str, e: io::Error) -> io::Error {
    io::Error::new(e.kind(), format!("the frame was cut short in {what}: {e}"))
}

impl Hello {
    pub fn send(&self, w: &mut impl Write) -> io::Result<()> {
        let mut f = Frame::new(HELLO);
        f.u16(BOOTSTRAP_VERSION);
        f.u16(self.node);
        f.u16(self.nodes);
        f.u64(self.fingerprint);
        f.text(&self.expert_addr);
        f.send(w)
    }

    pub fn receive(r: &mut impl Read) -> io::Result<Hello> {
        expect_kind(r, &[HELLO])?;
        version_of(r, "Hello")?;
        Ok(Hello {
            node: u16_of(r)?,
            nodes: u16_of(r)?,
            fingerprint: u64_of(r)?,
            expert_addr: text_of(r)?,
        })
    }
}

impl Welcome {
    pub fn send(&self, w: &mut impl Write) -> io::Result<()> {
        match self {
            Welcome::Joined {
                session,
                experts,
                unique_id,
            } => {
                let mut f = Frame::new(WELCOME);
                f.u16(BOOTSTRAP_VERSION);
                f.u64(*session);
                f.u32(experts.len() as u32);
                for addr in experts {
                    f.text(addr);
                }
                match unique_id {
                    None => f.u32(0),
                    Some(id) => {
                        f.u32(UNIQUE_ID_BYTES as u32);
                        f.0.extend_from_slice(id);
                    }
                }
                f.send(w)
            }
            Welcome::Failure(message) => Frame::failure(message).send(w),
        }
    }

    pub fn receive(r: &mut impl Read) -> io::Result<Welcome> {
        match expect_kind(r, &[WELCOME, FAILURE])? {
            WELCOME => {
                version_of(r, "Welcome")?;
                let session = u64_of(r)?;
                let nodes = bounded(u32_of(r)?, u32::from(u16::MAX), "node count")?;
                let experts = (0..nodes).map(|_| text_of(r)).collect::<io::Result<_>>()?;
                let unique_id = unique_id_of(r)?;
                Ok(Welcome::Joined {
                    session,
                    experts,
                    unique_id,
                })
            }
            _ => Ok(Welcome::Failure(text_of(r)?)),
        }
    }
}

impl StepCount {
    pub fn send(&self, w: &mut impl Write) -> io::Result<()> {
        let mut f = Frame::new(STEPS);
        f.u64(self.session);
        f.u16(self.node);
        f.u64(self.began);
        f.send(w)
    }

    /// The next count on a connection (`None`: the peer closed it between frames).
    pub fn receive(r: &mut impl Read) -> io::Result<Option<StepCount>> {
        match kind_of(r)? {
            None => Ok(None),
            Some(STEPS) => Ok(Some(StepCount::after_kind(r)?)),
            Some(kind) => Err(bad(format!("expected a step count, got frame kind {kind}"))),
        }
    }

    fn after_kind(r: &mut impl Read) -> io::Result<StepCount> {
        Ok(StepCount {
            session: u64_of(r)?,
            node: u16_of(r)?,
            began: u64_of(r)?,
        })
    }
}

impl NodeEplb {
    fn body(&self) -> Frame {
        let mut f = Frame(Vec::new());
        match self {
            NodeEplb::TakeLoads { round } => {
                f.0.push(0);
                f.u64(*round);
            }
            NodeEplb::Loads { round, ranks } => {
                f.0.push(1);
                f.u64(*round);
                f.rank_loads(ranks);
            }
            NodeEplb::Stage { epoch, placement } => {
                f.0.push(2);
                f.u32(*epoch);
                f.placement(placement);
            }
            NodeEplb::Staged { epoch, copied } => {
                f.0.push(3);
                f.u32(*epoch);
                f.u64(*copied);
            }
            NodeEplb::Propose { epoch, step } => {
                f.0.push(4);
                f.u32(*epoch);
                f.u64(*step);
            }
            NodeEplb::Ready { epoch, step } => {
                f.0.push(5);
                f.u32(*epoch);
                f.u64(*step);
            }
            NodeEplb::Late { epoch, step, began } => {
                f.0.push(6);
                f.u32(*epoch);
                f.u64(*step);
                f.u64(*began);
            }
            NodeEplb::Commit { epoch, step } => {
                f.0.push(7);
                f.u32(*epoch);
                f.u64(*step);
            }
            NodeEplb::Abort { epoch, reason } => {
                f.0.push(8);
                f.u32(*epoch);
                f.text(reason);
            }
        }
        f
    }

    fn of(r: &mut impl Read) -> io::Result<NodeEplb> {
        Ok(match u8_of(r)? {
            0 => NodeEplb::TakeLoads { round: u64_of(r)? },
            1 => NodeEplb::Loads {
                round: u64_of(r)?,
                ranks: rank_loads_of(r)?,
            },
            2 => NodeEplb::Stage {
                epoch: u32_of(r)?,
                placement: placement_of(r)?,
            },
            3 => NodeEplb::Staged {
                epoch: u32_of(r)?,
                copied: u64_of(r)?,
            },
            4 => NodeEplb::Propose {
                epoch: u32_of(r)?,
                step: u64_of(r)?,
            },
            5 => NodeEplb::Ready {
                epoch: u32_of(r)?,
                step: u64_of(r)?,
            },
            6 => NodeEplb::Late {
                epoch: u32_of(r)?,
                step: u64_of(r)?,
                began: u64_of(r)?,
            },
            7 => NodeEplb::Commit {
                epoch: u32_of(r)?,
                step: u64_of(r)?,
            },
            8 => NodeEplb::Abort {
                epoch: u32_of(r)?,
                reason: text_of(r)?,
            },
            other => return Err(bad(format!("EPLB message {other} is not 0 to 8"))),
        })
    }
}

impl NodeEplbFrame {
    /// The frame: magic, kind, `NODE_EPLB_VERSION`, session, node, the body's length, the body.
    pub fn send(&self, w: &mut impl Write) -> io::Result<()> {
        let body = self.message.body().0;
        let len = u32::try_from(body.len())
            .ok()
            .filter(|&len| len <= MAX_NODE_EPLB_BYTES)
            .ok_or_else(|| {
                bad(format!(
                    "an EPLB message of {} bytes is over the limit {MAX_NODE_EPLB_BYTES}",
                    body.len()
                ))
            })?;
        let mut f = Frame::new(NODE_EPLB);
        f.u16(NODE_EPLB_VERSION);
        f.u64(self.session);
        f.u16(self.node);
        f.u32(len);
        f.0.extend_from_slice(&body);
        f.send(w)
    }

    /// A frame's fields after its kind byte: the version and length are checked before the
    /// body is read, and the body must parse to exactly its length.
    fn after_kind(r: &mut impl Read) -> io::Result<NodeEplbFrame> {
        let version = u16_of(r).map_err(|e| cut_short("an EPLB frame's version", e))?;
        if version != NODE_EPLB_VERSION {
            return Err(bad(format!(
                "an EPLB frame of version {version}, this node speaks version \
                 {NODE_EPLB_VERSION} (every node must run the same deepinfer build)"
            )));
        }
        let session = u64_of(r).map_err(|e| cut_short("an EPLB frame's session", e))?;
        let node = u16_of(r).map_err(|e| cut_short("an EPLB frame's node", e))?;
        let len = bounded(
            u32_of(r).map_err(|e| cut_short("an EPLB frame's length", e))?,
            MAX_NODE_EPLB_BYTES,
            "EPLB frame length",
        )?;
        let mut body = Vec::new();
        r.take(len as u64).read_to_end(&mut body)?;
        if body.len() != len {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!(
                    "the frame was cut short in an EPLB message from node {node}: {} of {len} \
                     bytes",
                    body.len()
                ),
            ));
        }
        let mut rest = body.as_slice();
        let message = NodeEplb::of(&mut rest)
            .map_err(|e| bad(format!("a malformed EPLB message from node {node}: {e}")))?;
        if !rest.is_empty() {
            return Err(bad(format!(
                "an EPLB message from node {node} has {} bytes past its end (length {len})",
                rest.len()
            )));
        }
        Ok(NodeEplbFrame {
            session,
            node,
            message,
        })
    }
}

impl PeerFrame {
    pub fn send(&self, w: &mut impl Write) -> io::Result<()> {
        match self {
            PeerFrame::Count(count) => count.send(w),
            PeerFrame::Eplb(frame) => frame.send(w),
        }
    }

    /// The next frame on a step-count connection (`None`: the peer closed it between frames).
    pub fn receive(r: &mut impl Read) -> io::Result<Option<PeerFrame>> {
        match kind_of(r)? {
            None => Ok(None),
            Some(STEPS) => Ok(Some(PeerFrame::Count(StepCount::after_kind(r)?))),
            Some(NODE_EPLB) => Ok(Some(PeerFrame::Eplb(NodeEplbFrame::after_kind(r)?))),
            Some(kind) => Err(bad(format!(
                "expected a step count or an EPLB message, got frame kind {kind}"
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_round_trip_and_bad_bytes_are_errors() {
        let tag = FrameTag {
            session: 7,
            step: 3,
            layer: 2,
            epoch: 1,
        };
        let dispatch = Dispatch {
            tag,
            rank: 1,
            dim: 2,
            slots: vec![0, 3],
            weights: vec![0.5, -1.25],
            rows: vec![1.0, 2.0, f32::MIN_POSITIVE, -0.0],
        };
        let mut bytes = Vec::new();
        dispatch.send(&mut bytes).expect("written");
        let back = Request::receive(&mut bytes.as_slice()).expect("read");
        assert_eq!(back, Some(Request::Dispatch(dispatch)));
        assert_eq!(Request::receive(&mut &[][..]).expect("closed"), None);

        let reply = Reply::Combine {
            tag,
            outputs: vec![3.0, 4.0],
        };
        let mut bytes = Vec::new();
        reply.send(&mut bytes).expect("written");
        assert_eq!(Reply::receive(&mut bytes.as_slice()).expect("read"), reply);

        for unique_id in [None, Some(std::array::from_fn(|i| (i * 7 + 3) as u8))] {
            let welcome = Welcome::Joined {
                session: 9,
                experts: vec!["127.0.0.1:1".into(), "127.0.0.1:2".into()],
                unique_id,
            };
            let mut bytes = Vec::new();
            welcome.send(&mut bytes).expect("written");
            assert_eq!(
                Welcome::receive(&mut bytes.as_slice()).expect("read"),
                welcome
            );
        }
        let count = StepCount {
            session: 9,
            node: 1,
            began: 1 << 40,
        };
        let mut bytes = Vec::new();
        count.send(&mut bytes).expect("written");
        count.send(&mut bytes).expect("written");
        let mut r = bytes.as_slice();
        assert_eq!(StepCount::receive(&mut r).expect("read"), Some(count));
        assert_eq!(StepCount::receive(&mut r).expect("read"), Some(count));
        assert_eq!(StepCount::receive(&mut r).expect("closed"), None);

        // A wrong magic, a truncated frame and an oversized count are errors, not panics.
        assert!(Hello::receive(&mut &b"GET / HTTP/1.1\r\n"[..]).is_err());
        let mut bytes = Vec::new();
        Hello {
            node: 1,
            nodes: 2,
            fingerprint: 5,
            expert_addr: "127.0.0.1:3".into(),
        }
        .send(&mut bytes)
        .expect("written");
        assert!(Hello::receive(&mut &bytes[..bytes.len() - 1]).is_err());
        let mut huge = Frame::new(DISPATCH);
        huge.tag(tag);
        huge.u16(0);
        huge.u32(u32::MAX);
        let err = Request::receive(&mut huge.0.as_slice()).expect_err("too many rows");
        assert!(err.to_string().contains("row count"), "{err}");
        let mut wide = Frame::new(DISPATCH);
        wide.tag(tag);
        wide.u16(0);
        wide.u32(MAX_ROWS);
        wide.u32(MAX_DIM);
        let err = Request::receive(&mut wide.0.as_slice()).expect_err("too many values");
        assert!(err.to_string().contains("rows x width"), "{err}");
    }

    /// A rebalanced placement of 8 experts over two nodes of two ranks, three layers.
    fn two_node_placement() -> ExpertPlacement {
        let shape = deepinfer_topology::PlacementShape {
            num_replicas: 10,
            num_groups: 1,
            num_nodes: 2,
            num_gpus: 2,
        };
        let loads = vec![vec![9.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 5.0]; 3];
        deepinfer_topology::rebalance_experts(&loads, shape).expect("solved")
    }

    /// Node 1's `Hello` of a two-node deployment, as written.
    fn hello_frame() -> Vec<u8> {
        let mut hello = Vec::new();
        Hello {
            node: 1,
            nodes: 2,
            fingerprint: 5,
            expert_addr: "127.0.0.1:3".into(),
        }
        .send(&mut hello)
        .expect("written");
        hello
    }

    /// `Welcome` with its table, then `id_len` and `id`, as a node 0 might send it.
    fn welcome_frame(version: u16, id_len: u32, id: &[u8]) -> Vec<u8> {
        let mut f = Frame::new(WELCOME);
        f.u16(version);
        f.u64(9);
        f.u32(1);
        f.text("127.0.0.1:1");
        f.u32(id_len);
        f.0.extend_from_slice(id);
        f.0
    }

    /// A unique id cut short, of a length other than 0 or 128, or a frame of another bootstrap
    /// version is refused naming what is wrong, never read as a shorter or padded id.
    #[test]
    fn a_malformed_unique_id_or_version_is_refused_naming_it() {
        let id = [5u8; UNIQUE_ID_BYTES];
        let whole = welcome_frame(BOOTSTRAP_VERSION, 128, &id);
        match Welcome::receive(&mut whole.as_slice()).expect("read") {
            Welcome::Joined { unique_id, .. } => assert_eq!(unique_id, Some(id)),
            other => panic!("{other:?}"),
        }
        let short = welcome_frame(BOOTSTRAP_VERSION, 128, &id[..100]);
        let err = Welcome::receive(&mut short.as_slice()).expect_err("cut short");
        assert_eq!(err.kind(), io::ErrorKind::UnexpectedEof);
        assert!(
            err.to_string()
                .contains("cut short in the unique id (128 bytes)"),
            "{err}"
        );
        let no_length = &whole[..whole.len() - UNIQUE_ID_BYTES - 2];
        let err = Welcome::receive(&mut &no_length[..]).expect_err("no length");
        assert!(err.to_string().contains("the unique id's length"), "{err}");
        for len in [1, 64, 127, 129, u32::MAX] {
            let odd = welcome_frame(BOOTSTRAP_VERSION, len, &id);
            let err = Welcome::receive(&mut odd.as_slice()).expect_err("odd length");
            assert_eq!(err.kind(), io::ErrorKind::InvalidData);
            assert!(
                err.to_string()
                    .contains(&format!("the unique id is {len} bytes long, expected 0")),
                "{err}"
            );
        }
        let old = welcome_frame(1, 128, &id);
        let err = Welcome::receive(&mut old.as_slice()).expect_err("another version");
        assert!(
            err.to_string()
                .contains("Welcome of bootstrap version 1, this node speaks version 2"),
            "{err}"
        );
        let mut hello = hello_frame();
        hello[5] = 7; // the version's low byte
        let err = Hello::receive(&mut hello.as_slice()).expect_err("another version");
        assert!(
            err.to_string().contains("Hello of bootstrap version 7"),
            "{err}"
        );
    }

    #[test]
    fn control_frames_round_trip_and_bad_bytes_are_errors() {
        let placement = two_node_placement();
        let requests = [
            Control::TakeLoads,
            Control::Stage {
                epoch: 4,
                placement,
            },
            Control::Commit { epoch: 4 },
            Control::Abort { epoch: 5 },
        ];
        for control in requests {
            let request = ControlRequest {
                session: 11,
                control,
            };
            let mut bytes = Vec::new();
            request.send(&mut bytes).expect("written");
            let back = Request::receive(&mut bytes.as_slice()).expect("read");
            assert_eq!(back, Some(Request::Control(request)));
        }
        let replies = [
            ControlReply::Loads(vec![(3, vec![vec![1, 2], vec![0, 7]]), (3, vec![])]),
            ControlReply::Staged { copied: 6 },
            ControlReply::Done,
            ControlReply::Failure("no".into()),
        ];
        for reply in replies {
            let mut bytes = Vec::new();
            reply.send(&mut bytes).expect("written");
            assert_eq!(
                ControlReply::receive(&mut bytes.as_slice()).expect("read"),
                reply
            );
        }
        let mut unknown = Frame::new(CONTROL);
        unknown.u64(11);
        unknown.0.push(9);
        let err = Request::receive(&mut unknown.0.as_slice()).expect_err("unknown request");
        assert!(err.to_string().contains("control request 9"), "{err}");
        let mut huge = Frame::new(CONTROL);
        huge.u64(11);
        huge.0.push(1);
        huge.u32(1);
        huge.0.push(0);
        huge.u32(5);
        huge.u32(u32::MAX);
        let err = Request::receive(&mut huge.0.as_slice()).expect_err("too many layers");
        assert!(err.to_string().contains("placement layers"), "{err}");
    }

    /// Every live-EPLB message between CUDA nodes round-trips on a step-count connection, among
    /// the counts, in order.
    #[test]
    fn node_eplb_frames_round_trip_among_the_counts() {
        let placement = two_node_placement();
        let messages = [
            NodeEplb::TakeLoads { round: 3 },
            NodeEplb::Loads {
                round: 3,
                ranks: vec![(2, vec![vec![1, 2], vec![0, 7]]), (2, vec![])],
            },
            NodeEplb::Stage {
                epoch: 4,
                placement,
            },
            NodeEplb::Staged {
                epoch: 4,
                copied: 6,
            },
            NodeEplb::Propose { epoch: 4, step: 90 },
            NodeEplb::Ready { epoch: 4, step: 90 },
            NodeEplb::Late {
                epoch: 4,
                step: 90,
                began: 92,
            },
            NodeEplb::Commit { epoch: 4, step: 93 },
            NodeEplb::Abort {
                epoch: 5,
                reason: "out of device memory".into(),
            },
        ];
        let mut bytes = Vec::new();
        let mut sent = Vec::new();
        for (i, message) in messages.into_iter().enumerate() {
            let frame = PeerFrame::Eplb(NodeEplbFrame {
                session: 11,
                node: 1,
                message,
            });
            frame.send(&mut bytes).expect("written");
            sent.push(frame);
            let count = PeerFrame::Count(StepCount {
                session: 11,
                node: 1,
                began: i as u64,
            });
            count.send(&mut bytes).expect("written");
            sent.push(count);
        }
        let mut r = bytes.as_slice();
        for frame in sent {
            assert_eq!(PeerFrame::receive(&mut r).expect("read"), Some(frame));
        }
        assert_eq!(PeerFrame::receive(&mut r).expect("closed"), None);
    }

    fn propose_frame() -> Vec<u8> {
        let mut bytes = Vec::new();
        NodeEplbFrame {
            session: 11,
            node: 1,
            message: NodeEplb::Propose { epoch: 4, step: 90 },
        }
        .send(&mut bytes)
        .expect("written");
        bytes
    }

    /// A corrupted EPLB frame is refused naming what is wrong: another version, a length over
    /// the limit, a body cut short, bytes past the body's end, an unknown message, another
    /// frame kind.
    #[test]
    fn corrupted_node_eplb_frames_are_refused_naming_what() {
        // magic (4), kind (1), version (2), session (8), node (2), length (4), body.
        let (version, length, body) = (5, 5 + 2 + 8 + 2, 5 + 2 + 8 + 2 + 4);
        let assert_refused = |bytes: &[u8], why: &str| {
            let error = PeerFrame::receive(&mut &bytes[..])
                .expect_err("refused")
                .to_string();
            assert!(error.contains(why), "{error}");
        };
        let mut other = propose_frame();
        other[version] = 9;
        assert_refused(
            &other,
            "an EPLB frame of version 9, this node speaks version 1",
        );
        let mut huge = propose_frame();
        huge[length..length + 4].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_refused(&huge, "EPLB frame length");
        let whole = propose_frame();
        let short = &whole[..whole.len() - 3];
        assert_refused(
            short,
            "cut short in an EPLB message from node 1: 10 of 13 bytes",
        );
        let mut longer = propose_frame();
        longer[length..length + 4].copy_from_slice(&14u32.to_le_bytes());
        longer.push(0);
        assert_refused(&longer, "1 bytes past its end");
        let mut unknown = propose_frame();
        unknown[body] = 42;
        assert_refused(
            &unknown,
            "malformed EPLB message from node 1: EPLB message 42",
        );
        let mut cut = propose_frame();
        cut[length..length + 4].copy_from_slice(&5u32.to_le_bytes());
        cut.truncate(body + 5);
        assert_refused(&cut, "malformed EPLB message from node 1");
        let hello = hello_frame();
        assert_refused(
            &hello,
            "expected a step count or an EPLB message, got frame kind 4",
        );
    }
}
