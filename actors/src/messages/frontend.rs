//! `FrontendMsg`, the protocol of `FrontendActor`.

use deepinfer_topology::DpRank;
use ractor::RpcReplyPort;

use crate::engine::request::{GenerateRequest, Submission};
use crate::error::EngineError;

/// Messages of `FrontendActor`.
#[derive(Debug)]
pub enum FrontendMsg {
    /// Validate, encode and admit a request; the reply carries the request's event channel.
    Submit(
        Box<GenerateRequest>,
        RpcReplyPort<Result<Submission, EngineError>>,
    ),
    /// A request routed to `dp` with `work_tokens` of work (prompt + max_tokens) ended (its
    /// stream finished or was dropped).
    Released { dp: DpRank, work_tokens: usize },
    /// The supervisor's policy took this rank out of service.
    RankDown(DpRank),
    /// Refuse new requests from now on (graceful shutdown).
    Close(RpcReplyPort<()>),
}
