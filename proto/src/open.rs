//! The open transfers of a session, by id.

use crate::wire::{TransferId, TransferIdMap};
use std::fmt;
use std::ops::{Deref, DerefMut};

/// Open transfers by id. A hash map, because every frame takes its transfer out and puts it
/// back (each state is consumed on transition), which in a B-tree moves the neighbouring
/// entries every time; shown (`Debug`) and drained in id order, so that a session stays
/// deterministic (the model checker fingerprints sessions by their `Debug` form).
#[derive(Clone)]
pub(crate) struct OpenTransfers<T>(TransferIdMap<T>);

impl<T> Default for OpenTransfers<T> {
    fn default() -> Self {
        Self(TransferIdMap::default())
    }
}

impl<T> OpenTransfers<T> {
    /// Takes every transfer out, in id order.
    pub(crate) fn drain_in_order(&mut self) -> Vec<(TransferId, T)> {
        let mut open: Vec<_> = self.0.drain().collect();
        open.sort_unstable_by_key(|(id, _)| *id);
        open
    }
}

impl<T> Deref for OpenTransfers<T> {
    type Target = TransferIdMap<T>;
    fn deref(&self) -> &Self::Target {
        &self.0
    }
}

impl<T> DerefMut for OpenTransfers<T> {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.0
    }
}

impl<T: fmt::Debug> fmt::Debug for OpenTransfers<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut entries: Vec<_> = self.0.iter().collect();
        entries.sort_unstable_by_key(|(id, _)| **id);
        f.debug_map().entries(entries).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shown_and_drained_in_id_order_whatever_the_insertion_order() {
        let mut a = OpenTransfers::default();
        let mut b = OpenTransfers::default();
        for id in [5u64, 1, 9, 3] {
            a.insert(TransferId(id), id);
        }
        for id in [3u64, 9, 1, 5] {
            b.insert(TransferId(id), id);
        }
        assert_eq!(format!("{a:?}"), format!("{b:?}"));
        assert!(format!("{a:?}").starts_with("{TransferId(1): 1, TransferId(3): 3"));
        let ids: Vec<u64> = a.drain_in_order().into_iter().map(|(id, _)| id.0).collect();
        assert_eq!(ids, [1, 3, 5, 9]);
        assert!(a.is_empty());
    }
}
