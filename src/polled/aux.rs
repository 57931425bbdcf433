//! The engine's aux buffers: small per-request records (e.g. the first output token), one
//! slot of `item_len` bytes per aux index in each buffer (SGLang's `aux_data_ptrs`,
//! `aux_data_lens`, `aux_item_lens`). The record a sender sends with its final chunk is the
//! concatenation of its slot in every buffer; a receiver writes the verified record back the
//! same way.

use super::{Error, ErrorKind};

/// One of the engine's aux buffers, by pointer: SGLang's `aux_data_ptrs[i]`,
/// `aux_data_lens[i]`, `aux_item_lens[i]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AuxBuffer {
    /// The buffer's first byte.
    pub ptr: *mut u8,
    /// Its length in bytes.
    pub len: usize,
    /// Bytes per slot (one slot per aux index).
    pub item_len: usize,
}

/// The registered aux buffers (addresses, so that the description is `Send`).
#[derive(Debug, Default)]
pub(super) struct AuxBuffers {
    /// (base address, length, item length) per buffer.
    buffers: Vec<(usize, usize, usize)>,
}

impl AuxBuffers {
    pub(super) fn new(buffers: &[AuxBuffer]) -> Result<Self, Error> {
        let mut out = Vec::with_capacity(buffers.len());
        for (i, b) in buffers.iter().enumerate() {
            if b.ptr.is_null() && b.len > 0 {
                return Err(Error::invalid(format!("aux buffer {i}: null pointer")));
            }
            out.push((b.ptr as usize, b.len, b.item_len));
        }
        let aux = Self { buffers: out };
        if aux.record_len() > kvwire_proto::wire::MAX_AUX {
            return Err(Error::invalid(format!(
                "an aux record of {} bytes exceeds kvwire's limit of {}",
                aux.record_len(),
                kvwire_proto::wire::MAX_AUX
            )));
        }
        Ok(aux)
    }

    /// Bytes of one record (a slot in every buffer).
    pub(super) fn record_len(&self) -> usize {
        self.buffers.iter().map(|b| b.2).sum()
    }

    /// Whether slot `index` lies inside every buffer.
    pub(super) fn check_index(&self, index: usize) -> Result<(), Error> {
        if self.buffers.is_empty() {
            return Err(Error::invalid(format!(
                "aux index {index}: no aux buffers were registered"
            )));
        }
        for (b, &(_, len, item)) in self.buffers.iter().enumerate() {
            let end = index.checked_add(1).and_then(|n| n.checked_mul(item));
            if end.is_none_or(|end| end > len) {
                return Err(Error::new(
                    ErrorKind::InvalidRequest,
                    format!(
                        "aux index {index} out of range of aux buffer {b} ({len} bytes, {item} per item)"
                    ),
                ));
            }
        }
        Ok(())
    }

    /// The record at `index` (a copy of a few bytes).
    pub(super) fn read(&self, index: usize) -> Result<Vec<u8>, Error> {
        self.check_index(index)?;
        let mut out = Vec::with_capacity(self.record_len());
        for &(base, _, item) in &self.buffers {
            // SAFETY: `check_index` put [index*item, index*item+item) inside the buffer, and
            // the engine promised (`Manager::with_aux`) that each aux buffer is valid for
            // reads and writes of its length while the manager lives. The engine writes the
            // record before `send` of the final chunk and not while it is read.
            let bytes =
                unsafe { std::slice::from_raw_parts((base + index * item) as *const u8, item) };
            out.extend_from_slice(bytes);
        }
        Ok(out)
    }

    /// Writes `record` into slot `index` (a shorter record leaves the rest of the slot
    /// zeroed).
    pub(super) fn write(&self, index: usize, record: &[u8]) -> Result<(), Error> {
        self.check_index(index)?;
        if record.len() > self.record_len() {
            return Err(Error::new(
                ErrorKind::AuxTooLarge,
                format!(
                    "the verified aux record has {} bytes, the aux slot {}",
                    record.len(),
                    self.record_len()
                ),
            ));
        }
        let mut rest = record;
        for &(base, _, item) in &self.buffers {
            let (now, later) = rest.split_at(rest.len().min(item));
            rest = later;
            // SAFETY: in bounds as in `read`; the engine reads this slot only after `poll`
            // reported Success (the transfer's state lock orders this write before it), and
            // writes it only for a request it is not receiving.
            let slot =
                unsafe { std::slice::from_raw_parts_mut((base + index * item) as *mut u8, item) };
            slot[..now.len()].copy_from_slice(now);
            slot[now.len()..].fill(0);
        }
        Ok(())
    }
}
