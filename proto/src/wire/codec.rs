//! A small little-endian reader and writer for frame payloads.
//!
//! The reader never panics: every read checks the remaining length and reports the field
//! it was reading when the input ran out.

use super::error::DecodeError;

/// Reads little-endian fields from a byte slice.
pub(crate) struct Reader<'a> {
    buf: &'a [u8],
}

impl<'a> Reader<'a> {
    pub(crate) fn new(buf: &'a [u8]) -> Self {
        Self { buf }
    }

    pub(crate) fn remaining(&self) -> usize {
        self.buf.len()
    }

    pub(crate) fn bytes(&mut self, n: usize, field: &'static str) -> Result<&'a [u8], DecodeError> {
        if self.buf.len() < n {
            return Err(DecodeError::Truncated { field });
        }
        let (head, tail) = self.buf.split_at(n);
        self.buf = tail;
        Ok(head)
    }

    fn array<const N: usize>(&mut self, field: &'static str) -> Result<[u8; N], DecodeError> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.bytes(N, field)?);
        Ok(out)
    }

    pub(crate) fn u8(&mut self, field: &'static str) -> Result<u8, DecodeError> {
        Ok(self.array::<1>(field)?[0])
    }

    pub(crate) fn u16(&mut self, field: &'static str) -> Result<u16, DecodeError> {
        self.array(field).map(u16::from_le_bytes)
    }

    pub(crate) fn u32(&mut self, field: &'static str) -> Result<u32, DecodeError> {
        self.array(field).map(u32::from_le_bytes)
    }

    pub(crate) fn u64(&mut self, field: &'static str) -> Result<u64, DecodeError> {
        self.array(field).map(u64::from_le_bytes)
    }

    pub(crate) fn array16(&mut self, field: &'static str) -> Result<[u8; 16], DecodeError> {
        self.array(field)
    }

    /// A count prefix that is checked against a maximum and against the bytes left (each
    /// element needs at least `elem_size` bytes), so a forged count cannot make the decoder
    /// reserve memory it will never fill.
    pub(crate) fn count(
        &mut self,
        raw: u64,
        max: usize,
        elem_size: usize,
        field: &'static str,
    ) -> Result<usize, DecodeError> {
        if raw > max as u64 {
            return Err(DecodeError::TooMany {
                field,
                count: raw,
                max: max as u64,
            });
        }
        let n = raw as usize;
        if n.saturating_mul(elem_size) > self.remaining() {
            return Err(DecodeError::Truncated { field });
        }
        Ok(n)
    }

    /// A UTF-8 string with a u16 length prefix.
    pub(crate) fn string(
        &mut self,
        max: usize,
        field: &'static str,
    ) -> Result<String, DecodeError> {
        let len = self.u16(field)?;
        let n = self.count(u64::from(len), max, 1, field)?;
        let raw = self.bytes(n, field)?;
        core::str::from_utf8(raw)
            .map(str::to_owned)
            .map_err(|_| DecodeError::InvalidUtf8 { field })
    }

    /// Opaque bytes with a length prefix of the given width read by `len`.
    pub(crate) fn blob(
        &mut self,
        len: u64,
        max: usize,
        field: &'static str,
    ) -> Result<Vec<u8>, DecodeError> {
        let n = self.count(len, max, 1, field)?;
        Ok(self.bytes(n, field)?.to_vec())
    }
}

/// Appends little-endian fields to a vector.
pub(crate) struct Writer<'a> {
    pub(crate) out: &'a mut Vec<u8>,
}

impl Writer<'_> {
    pub(crate) fn u8(&mut self, v: u8) {
        self.out.push(v);
    }
    pub(crate) fn u16(&mut self, v: u16) {
        self.out.extend_from_slice(&v.to_le_bytes());
    }
    pub(crate) fn u32(&mut self, v: u32) {
        self.out.extend_from_slice(&v.to_le_bytes());
    }
    pub(crate) fn u64(&mut self, v: u64) {
        self.out.extend_from_slice(&v.to_le_bytes());
    }
    pub(crate) fn bytes(&mut self, v: &[u8]) {
        self.out.extend_from_slice(v);
    }
}
