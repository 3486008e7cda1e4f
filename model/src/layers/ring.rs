//! What the state of both families shares around its rows: the rollback budget
//! [`MAX_BACKTRACK`] the rings ([`crate::backend::PositionRing`]) keep beyond what the next token
//! needs, the packing of an append-only cache's rows ([`pack_rows`]), and the rollback errors.

use crate::backend::{Backend, KeyList, Pinned, Tensor};
use crate::error::ModelError;

/// How many most recent tokens a rollback may drop (anchor + 5 drafts of DSpark).
pub const MAX_BACKTRACK: usize = 6;

/// Entries an append-only cache (compressed KV, index keys) gathers at once ([`pack_rows`]): few
/// enough that what a cache pins beyond what it holds stays small, many enough that a sequence
/// of a batched decode copies its entries once every `PACK_ENTRIES` of them.
pub(crate) const PACK_ENTRIES: usize = 32;

/// Copies the rows of `list` from `from` on into one buffer of their own when they pin more
/// than they hold: views of buffers that also hold rows the list does not keep (a batched step's
/// buffer shares the other sequences' rows, which would stay alive as long as this list; a
/// rollback drops rows of a buffer). Rows that are the whole of their buffers (a sequence's
/// chunk, host rows) are left as they are. The values never change; the rows replaced leave the
/// list's mirror (dropped and appended again, [`KeyList`]'s two changes).
pub(crate) fn pack_rows(list: &mut KeyList, from: usize, backend: &dyn Backend) {
    let Some(rows) = list.get(from..) else {
        return;
    };
    let Some(width) = rows.first().map(Tensor::len) else {
        return;
    };
    let mut pinned = Pinned::default();
    pinned.add_tensors(rows);
    if pinned.bytes() <= tensor_bytes(rows) || rows.iter().any(|r| r.len() != width) {
        return;
    }
    let pieces: Vec<(&Tensor, usize)> = rows.iter().map(|row| (row, 0)).collect();
    let own = backend.gather(&pieces, width).split_rows(width);
    list.truncate(from);
    list.extend(own);
}

/// Bytes of the f32 values of `rows`.
pub(crate) fn tensor_bytes<'a>(rows: impl IntoIterator<Item = &'a Tensor>) -> u64 {
    rows.into_iter().map(|row| row.len() as u64 * 4).sum()
}

/// The error of a rollback to `len` tokens of a sequence that holds only `held`.
pub(crate) fn past_end(len: usize, held: usize) -> ModelError {
    ModelError::Sequence {
        message: format!("cannot roll back to {len} tokens: the sequence holds only {held}"),
    }
}

/// The error of a rollback from `current` to `len` tokens that the rings no longer allow.
pub(crate) fn too_far(len: usize, current: usize) -> ModelError {
    ModelError::Sequence {
        message: format!(
            "cannot roll back from {current} to {len} tokens: only the last {MAX_BACKTRACK} tokens can be dropped"
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pack_rows_copies_rows_out_of_shared_buffers_only() {
        use crate::backend::CpuBackend;
        use crate::backend::tensor::HostDeviceBuffer;
        let pinned = |rows: &[Tensor]| {
            let mut pinned = Pinned::default();
            pinned.add_tensors(rows);
            pinned.bytes()
        };
        // A sequence's own chunk: every row of the buffer is kept, nothing is copied.
        let chunk = HostDeviceBuffer::tensor((0..12).map(|v| v as f32).collect());
        let mut own = KeyList::from(chunk.split_rows(3));
        pack_rows(&mut own, 0, &CpuBackend::new());
        assert!(own.iter().all(|row| row.device_view().is_some()));
        assert_eq!(pinned(&own), 12 * 4);
        // Then four batched steps, each buffer shared with two other sequences' rows.
        own.extend((0..4).map(|s| {
            let values = (0..9).map(|v| (100 + 9 * s + v) as f32).collect();
            HostDeviceBuffer::tensor(values).rows(1..2, 3)
        }));
        own.mirror().covers = 6;
        assert_eq!(pinned(&own[4..]), 4 * 9 * 4);
        pack_rows(&mut own, 4, &CpuBackend::new());
        assert_eq!(pinned(&own), tensor_bytes(own.iter()));
        assert_eq!(
            own[6].to_vec(),
            vec![121.0, 122.0, 123.0],
            "the same values"
        );
        assert!(own[3].device_view().is_some(), "rows before `from` stay");
        assert_eq!(own.mirror().covers, 4, "the replaced rows leave the mirror");
    }
}
