//! `ReplayMsg`, the protocol of the `ReplayActor` (decoder bounded replay and the rewind bound).
//!
//! Admission answers (an error is the caller's to report, never swallowed); `Written`,
//! `Rewind`, `Commit` and `Finish` are one-way, sent by the scheduler in the order the rank
//! applied them (a refusal is logged and counted in [`ReplayStats::refused`]).

use deepinfer_topology::RequestId;
use ractor::RpcReplyPort;

use crate::replay::state::ReplayStats;
use crate::replay::suffix::{DecoderSuffix, ReplayError};

/// Messages of `ReplayActor`.
#[derive(Debug)]
pub enum ReplayMsg {
    /// Plan the decoder suffix of a new request with a `prompt_len`-token prompt.
    Admit {
        id: RequestId,
        prompt_len: u32,
        reply: RpcReplyPort<Result<DecoderSuffix, ReplayError>>,
    },
    /// `count` positions were written past the prompt (decode or verify).
    Written {
        id: RequestId,
        count: u32,
    },
    /// The first `len` positions are accepted for good.
    Commit {
        id: RequestId,
        len: u32,
    },
    /// Rewind to `to` positions after a rejected draft.
    Rewind {
        id: RequestId,
        to: u32,
    },
    /// The request ended (finished, aborted, failed): free its suffix.
    Finish(RequestId),
    Stats(RpcReplyPort<ReplayStats>),
}
