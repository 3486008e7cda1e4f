//! `SupervisorMsg`, the protocol of `NodeSupervisor`.

use std::time::Duration;

use ractor::RpcReplyPort;

use crate::supervisor::policy::EngineHealth;

/// Outcome of a graceful drain.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DrainReport {
    /// True when every rank finished its requests before the timeout.
    pub drained: bool,
}

/// Messages of `NodeSupervisor`.
#[derive(Debug)]
pub enum SupervisorMsg {
    Health(RpcReplyPort<EngineHealth>),
    /// Close admission, wait (at most the timeout) until all requests finished, then stop.
    Drain(Duration, RpcReplyPort<DrainReport>),
}
