//! Access scopes: the fence primitive of the in-process and TCP transports.
//!
//! A reservation opens an [`AccessScope`] over exactly its pages; a write is accepted only if
//! it carries the scope's key and targets one of those pages. Closing the scope
//! ([`ScopeTable::close`]) is the fence: once it returns, no write for that transfer can land.
//! RDMA implements the same guarantee at the NIC with memory windows.

use kvwire_proto::wire::TransferId;
use std::collections::HashMap;

use kvwire_proto::wire::{DigestAlgorithm, TransferRef};

/// The key a sender presents with each write; carried in RESERVE's access descriptor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct AccessKey(pub u32);

impl AccessKey {
    /// The access descriptor bytes for RESERVE (the key, little-endian).
    pub fn to_descriptor(self) -> Vec<u8> {
        self.0.to_le_bytes().to_vec()
    }

    /// Parses an access descriptor; `None` if it is not exactly four bytes.
    pub fn from_descriptor(bytes: &[u8]) -> Option<Self> {
        let b: [u8; 4] = bytes.try_into().ok()?;
        Some(Self(u32::from_le_bytes(b)))
    }
}

/// Why a write was refused at the receiver.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum AccessError {
    /// No open scope has this key: never opened, or fenced.
    #[error("no open access scope with key {0:?} (never opened or fenced)")]
    NoScope(AccessKey),
    /// The page is outside the scope.
    #[error("page {page} is outside the scope of key {key:?}")]
    OutOfScope {
        /// The key.
        key: AccessKey,
        /// The page written.
        page: u32,
    },
}

/// Remote access granted for one transfer's pages.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AccessScope {
    /// The reservation it serves.
    pub transfer: TransferRef,
    /// Its pages, sorted.
    pages: Vec<u32>,
    /// Its pages in ordinal order (as reserved).
    by_ordinal: Vec<u32>,
    /// The algorithm the transport digests each landing page under as its bytes land
    /// (SPEC §6, digests at landing), if the receiver asked for that.
    landing_digest: Option<DigestAlgorithm>,
}

impl AccessScope {
    /// Whether `page` is in scope.
    pub fn contains(&self, page: u32) -> bool {
        self.pages.binary_search(&page).is_ok()
    }

    /// The page reserved at `ordinal`, if the reservation has that many pages.
    pub fn page_at(&self, ordinal: u32) -> Option<u32> {
        self.by_ordinal.get(ordinal as usize).copied()
    }

    /// The algorithm to digest each landing page under as its bytes land, if the receiver
    /// asked for that ([`ScopeTable::digest_landings`]).
    pub fn landing_digest(&self) -> Option<DigestAlgorithm> {
        self.landing_digest
    }
}

/// The receiver's table of open scopes. Keys are never reused within a table's lifetime
/// (until 2^32 scopes), so a fenced key stays dead.
#[derive(Debug, Default)]
pub struct ScopeTable {
    next_key: u32,
    /// Keys advance by this much (0 reads as 1): the tables of one connection's lanes issue
    /// disjoint keys ([`ScopeTable::with_key_space`]).
    key_step: u32,
    open: HashMap<AccessKey, AccessScope>,
    by_transfer: HashMap<TransferId, AccessKey>,
}

impl ScopeTable {
    /// The table of lane `lane` of a connection with `lanes` lanes (several TCP streams): it
    /// issues the keys `lane + lanes`, `lane + 2 * lanes`, ..., so no two lanes' tables issue
    /// the same key and a key names one scope on the whole connection.
    pub fn with_key_space(lane: u32, lanes: u32) -> Self {
        Self {
            next_key: lane,
            key_step: lanes.max(1),
            ..Self::default()
        }
    }

    /// Opens a scope over `pages` for a transfer, returning its key.
    pub fn open(&mut self, transfer_id: TransferId, pages: &[u32]) -> AccessKey {
        self.next_key = self.next_key.wrapping_add(self.key_step.max(1));
        let key = AccessKey(self.next_key);
        let mut sorted = pages.to_vec();
        sorted.sort_unstable();
        self.open.insert(
            key,
            AccessScope {
                transfer: TransferRef {
                    transfer_id,
                    nonce: 0,
                },
                pages: sorted,
                by_ordinal: pages.to_vec(),
                landing_digest: None,
            },
        );
        if let Some(old) = self.by_transfer.insert(transfer_id, key) {
            self.open.remove(&old);
        }
        key
    }

    /// Binds the scope of a transfer to its reservation's nonce once known.
    pub fn bind(&mut self, transfer: TransferRef) {
        if let Some(scope) = self
            .by_transfer
            .get(&transfer.transfer_id)
            .and_then(|k| self.open.get_mut(k))
        {
            scope.transfer = transfer;
        }
    }

    /// Asks the transport to digest each page of `transfer_id`'s open scope under `alg` as
    /// the page's bytes land (SPEC §6, digests at landing), and to report the digests with
    /// the landing.
    pub fn digest_landings(&mut self, transfer_id: TransferId, alg: DigestAlgorithm) {
        if let Some(scope) = self
            .by_transfer
            .get(&transfer_id)
            .and_then(|k| self.open.get_mut(k))
        {
            scope.landing_digest = Some(alg);
        }
    }

    /// Checks a write of `page` under `key`, returning the transfer it belongs to.
    pub fn check(&self, key: AccessKey, page: u32) -> Result<TransferRef, AccessError> {
        let scope = self.open.get(&key).ok_or(AccessError::NoScope(key))?;
        if scope.contains(page) {
            Ok(scope.transfer)
        } else {
            Err(AccessError::OutOfScope { key, page })
        }
    }

    /// The open scope with this key, if any.
    pub fn get(&self, key: AccessKey) -> Option<&AccessScope> {
        self.open.get(&key)
    }

    /// Fences a transfer: after this returns, no write for it is accepted. Returns whether a
    /// scope was open.
    pub fn close(&mut self, transfer_id: TransferId) -> bool {
        match self.by_transfer.remove(&transfer_id) {
            Some(key) => self.open.remove(&key).is_some(),
            None => false,
        }
    }

    /// Open scopes.
    pub fn open_scopes(&self) -> usize {
        self.open.len()
    }
}
