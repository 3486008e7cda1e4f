//! [`KeyList`]: a sequence's append-only list of key rows (its compressed KV entries or its index
//! keys), with a slot where a device backend keeps its own copy of the rows' addresses between
//! steps ([`KeyMirror`]): a step then sends only what was appended since, not every row again.

use std::any::Any;
use std::fmt;
use std::ops::Deref;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use super::Tensor;

/// Rows appended one group at a time and dropped only from the end. Reads go through `Deref` to
/// `[Tensor]`; every change goes through the methods, which keep the mirror's claim true.
pub struct KeyList {
    rows: Vec<Tensor>,
    mirror: Mutex<KeyMirror>,
}

/// A backend's record of a [`KeyList`]: `device` (the backend's own type) holds the addresses
/// of the list's first `covers` rows, in order. The list lowers `covers` when rows it counted
/// are dropped; only the backend that stored `device` reads it.
#[derive(Default)]
pub struct KeyMirror {
    pub covers: usize,
    pub device: Option<Arc<dyn Any + Send + Sync>>,
}

/// The list of no rows (for a layer without a compressed cache).
pub static NO_KEYS: KeyList = KeyList::new();

impl KeyList {
    pub const fn new() -> KeyList {
        KeyList {
            rows: Vec::new(),
            mirror: Mutex::new(KeyMirror {
                covers: 0,
                device: None,
            }),
        }
    }

    /// Appends a row (a mirror of the earlier rows stays true).
    pub fn push(&mut self, row: Tensor) {
        self.rows.push(row);
    }

    /// Appends rows (a mirror of the earlier rows stays true).
    pub fn extend(&mut self, rows: impl IntoIterator<Item = Tensor>) {
        self.rows.extend(rows);
    }

    /// Keeps the first `len` rows; a mirror then covers at most those.
    pub fn truncate(&mut self, len: usize) {
        self.rows.truncate(len);
        let mirror = self
            .mirror
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner);
        mirror.covers = mirror.covers.min(len);
    }

    /// The rows.
    pub fn rows(&self) -> &[Tensor] {
        &self.rows
    }

    /// The backend's mirror of this list, locked for reading and updating.
    pub fn mirror(&self) -> MutexGuard<'_, KeyMirror> {
        self.mirror.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Default for KeyList {
    fn default() -> KeyList {
        KeyList::new()
    }
}

impl Deref for KeyList {
    type Target = [Tensor];

    fn deref(&self) -> &[Tensor] {
        &self.rows
    }
}

/// A copy holds the same rows and no mirror (a backend's copy belongs to one list).
impl Clone for KeyList {
    fn clone(&self) -> KeyList {
        KeyList::from(self.rows.clone())
    }
}

impl From<Vec<Tensor>> for KeyList {
    fn from(rows: Vec<Tensor>) -> KeyList {
        KeyList {
            rows,
            mirror: Mutex::default(),
        }
    }
}

/// Equal rows, whatever the mirrors hold.
impl PartialEq for KeyList {
    fn eq(&self, other: &KeyList) -> bool {
        self.rows == other.rows
    }
}

impl fmt::Debug for KeyList {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(&self.rows).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn list(n: usize) -> KeyList {
        KeyList::from(
            (0..n)
                .map(|i| Tensor::from(vec![i as f32]))
                .collect::<Vec<_>>(),
        )
    }

    #[test]
    fn a_truncation_below_the_mirror_lowers_what_it_covers() {
        let mut keys = list(6);
        keys.mirror().covers = 5;
        keys.push(Tensor::from(vec![6.0]));
        keys.extend([Tensor::from(vec![7.0])]);
        assert_eq!(keys.mirror().covers, 5, "appending keeps the mirror");
        keys.truncate(7);
        assert_eq!(keys.mirror().covers, 5, "dropping rows past it keeps it");
        keys.truncate(3);
        assert_eq!(keys.mirror().covers, 3);
        assert_eq!(keys.len(), 3);
        assert_eq!(keys[2], Tensor::from(vec![2.0]));
    }

    #[test]
    fn a_copy_has_the_rows_and_no_mirror() {
        let keys = list(4);
        {
            let mut mirror = keys.mirror();
            mirror.covers = 4;
            mirror.device = Some(Arc::new(7u32));
        }
        let copy = keys.clone();
        assert_eq!(copy, keys);
        assert_eq!(copy.mirror().covers, 0);
        assert!(copy.mirror().device.is_none());
    }
}
