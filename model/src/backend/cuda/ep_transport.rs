//! How routed rows move between EP ranks ([`RowTransport`]), and the transport of ranks that
//! share one device ([`SharedDevice`]); NCCL between devices is `nccl.rs`.
//!
//! One call is one all-to-all of f32 rows: this rank's rows for rank `d` are `counts[d]`
//! consecutive rows of its buffer (destination-major) with their per-row metadata (the
//! receiver's local expert ids and route weights, on the host: a few bytes per row); what comes
//! back is one buffer on this rank's device holding every rank's rows for it, in increasing
//! source rank (each source's rows in its order), with their counts and metadata. The buffers a
//! rank offers stay alive until [`RowTransport::finish`] (the end of the layer).

use std::sync::Arc;
use std::time::Duration;

use deepinfer_kernels::ops::key_table::key_row_address;

use super::*;
use crate::expert_exchange::{Exchange, ExchangeError, ExchangePhase, ExchangeTag};

/// Per-row metadata that travels with dispatched rows (empty for the combine's outputs).
#[derive(Debug, Clone, Default)]
pub struct RowMeta {
    /// The receiving rank's local expert of each row.
    pub experts: Vec<u32>,
    /// Each row's route weight.
    pub weights: Vec<f32>,
}

/// One all-to-all of this rank's rows (the module doc): as EP rank `rank` at `tag`, `counts[d]`
/// consecutive `width`-wide rows of `rows` (destination-major) for rank `d`, with `meta[d]`.
#[derive(Debug)]
pub struct RowExchange<'a> {
    pub rank: usize,
    pub tag: ExchangeTag,
    pub rows: Option<&'a CudaSlice<f32>>,
    pub width: usize,
    pub counts: &'a [usize],
    pub meta: Vec<RowMeta>,
}

/// What one all-to-all delivered to this rank.
#[derive(Debug)]
pub struct Delivered {
    /// `[Σ counts, width]` on this rank's device (`None` when nothing came).
    pub rows: Option<CudaSlice<f32>>,
    /// Rows from each source rank.
    pub counts: Vec<usize>,
    /// Each source's metadata.
    pub meta: Vec<RowMeta>,
}

/// The collectives of expert parallelism between the EP ranks of one deployment.
pub trait RowTransport: Send + Sync + std::fmt::Debug {
    /// EP ranks it connects.
    fn ranks(&self) -> usize;

    /// The all-to-all `exchange` of the module doc, by `backend`; its rows were written on
    /// `backend`'s stream.
    fn all_to_all_rows(
        &self,
        backend: &CudaBackend,
        exchange: RowExchange<'_>,
    ) -> Result<Delivered, CudaBackendError>;

    /// The layer is done on this rank: once every rank says so, offered buffers may be freed.
    fn finish(&self, rank: usize, tag: ExchangeTag) -> Result<(), CudaBackendError>;

    /// This rank failed: every peer's collective fails at once instead of waiting.
    fn abort(&self, rank: usize, reason: &str);
}

const OP: &str = "expert all-to-all";

fn exchange_err(source: ExchangeError) -> CudaBackendError {
    CudaBackendError::Exchange { op: OP, source }
}

/// What a rank offers another on one device: `rows` rows from `addr` (the offering rank's
/// memory, valid until the layer's `finish`), and their metadata.
#[derive(Debug, Default)]
pub struct Offer {
    addr: u64,
    rows: usize,
    meta: RowMeta,
}

/// EP ranks that share one device (one process, the same primary context): the exchange
/// carries counts, addresses and metadata; each receiver copies its rows device to device with
/// one gather.
#[derive(Debug)]
pub struct SharedDevice {
    exchange: Exchange<Offer>,
}

impl SharedDevice {
    /// `ranks` EP ranks whose every wait lasts at most `timeout`.
    pub fn new(ranks: usize, timeout: Duration) -> Arc<SharedDevice> {
        Arc::new(SharedDevice {
            exchange: Exchange::new(ranks, timeout),
        })
    }
}

impl RowTransport for SharedDevice {
    fn ranks(&self) -> usize {
        self.exchange.ranks()
    }

    fn all_to_all_rows(
        &self,
        backend: &CudaBackend,
        exchange: RowExchange<'_>,
    ) -> Result<Delivered, CudaBackendError> {
        let (rank, tag, width) = (exchange.rank, exchange.tag, exchange.width);
        let row_bytes = (width * std::mem::size_of::<f32>()) as u64;
        let base = match exchange.rows {
            Some(rows) => key_row_address(&backend.rt, rows, 0, width).map_err(op_err(OP))?,
            None => 0,
        };
        let mut offset = 0u64;
        let offers = exchange
            .counts
            .iter()
            .zip(exchange.meta)
            .map(|(&n, meta)| {
                let offer = Offer {
                    addr: base + offset * row_bytes,
                    rows: n,
                    meta,
                };
                offset += n as u64;
                offer
            })
            .collect();
        // The peers read `rows` from their own streams: it must be written first.
        backend.rt.synchronize().map_err(op_err(OP))?;
        let received = self
            .exchange
            .all_to_all(rank, tag, offers)
            .map_err(exchange_err)?;
        let addresses: Vec<u64> = received
            .iter()
            .flat_map(|o| (0..o.rows as u64).map(move |i| o.addr + i * row_bytes))
            .collect();
        let rows = backend.gathered(OP, &addresses, width)?;
        // The offers are read: the senders may reuse them after `finish`.
        backend.rt.synchronize().map_err(op_err(OP))?;
        Ok(Delivered {
            rows,
            counts: received.iter().map(|o| o.rows).collect(),
            meta: received.into_iter().map(|o| o.meta).collect(),
        })
    }

    fn finish(&self, rank: usize, tag: ExchangeTag) -> Result<(), CudaBackendError> {
        let done = ExchangeTag {
            phase: ExchangePhase::Done,
            ..tag
        };
        self.exchange.barrier(rank, done).map_err(exchange_err)
    }

    fn abort(&self, rank: usize, reason: &str) {
        self.exchange.abort(rank, reason);
    }
}
