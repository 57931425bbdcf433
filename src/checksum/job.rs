//! Digests computed chunk by chunk: the streaming state of one transfer
//! ([`TransferDigester`]) and one chunk's job over pinned pages ([`DigestJob`]), to run
//! wherever the driver likes (inline, or on a blocking thread).

use kvwire_proto::wire::TransferRef;

use super::{
    aux_digest, placeholder_digests, BufferDigester, DigestAlgorithm, DigestBinding, DigestMode,
    Kind, TransferDigests, UnsupportedAlgorithm,
};
use crate::memory::{DeviceError, SharedPages};

/// The digests of one transfer, fed chunk by chunk in ordinal order and finished once with
/// the aux record: equal to [`super::digest_transfer`] over all the pages plus
/// [`aux_digest`], with each page read exactly once.
///
/// ```
/// use kvwire::checksum::{digest_transfer, DigestAlgorithm, DigestBinding, TransferDigester};
///
/// let binding = DigestBinding { transfer_id: kvwire::TransferId(7), nonce: 42 };
/// let pages = [[1u8; 64], [2; 64], [3; 64]];
/// let mut d = TransferDigester::new(DigestAlgorithm::XXH3_64, binding, 1, true).unwrap();
/// d.update(2, |_, i| &pages[i][..]); // chunk 1: ordinals 0, 1
/// d.update(1, |_, i| &pages[2 + i][..]); // chunk 2: ordinal 2
/// let streamed = d.finish(b"token");
/// let one_shot = digest_transfer(DigestAlgorithm::XXH3_64, binding, 1, 3, true, |_, i| &pages[i][..]).unwrap();
/// assert_eq!(streamed.buffers, one_shot.buffers);
/// assert_eq!(streamed.pages, one_shot.pages);
/// ```
#[derive(Clone, Debug)]
pub struct TransferDigester {
    alg: DigestAlgorithm,
    binding: DigestBinding,
    /// One streaming state per buffer; empty when only counting (placeholder mode).
    buffers: Vec<BufferDigester>,
    buffer_count: usize,
    /// Page digests so far, per buffer, when asked for.
    page_digests: Option<Vec<Vec<u64>>>,
    pages: u32,
}

impl TransferDigester {
    /// Starts the digests of a transfer of `buffers` buffers bound to `binding`, with page
    /// digests when `per_page`.
    ///
    /// # Errors
    ///
    /// [`UnsupportedAlgorithm`] if `alg` is not one of [`super::supported_algorithms`].
    pub fn new(
        alg: DigestAlgorithm,
        binding: DigestBinding,
        buffers: usize,
        per_page: bool,
    ) -> Result<Self, UnsupportedAlgorithm> {
        let kind = Kind::new(alg)?;
        Ok(Self {
            alg,
            binding,
            buffers: (0..buffers)
                .zip(0u32..)
                .map(|(_, b)| BufferDigester::with_kind(kind, alg, binding, b))
                .collect(),
            buffer_count: buffers,
            page_digests: per_page.then(|| vec![Vec::new(); buffers]),
            pages: 0,
        })
    }

    /// A digester that only counts pages and finishes with [`placeholder_digests`]
    /// ([`DigestMode::UnverifiedBenchmarkOnly`]).
    fn counting(
        alg: DigestAlgorithm,
        binding: DigestBinding,
        buffers: usize,
        per_page: bool,
    ) -> Self {
        Self {
            alg,
            binding,
            buffers: Vec::new(),
            buffer_count: buffers,
            page_digests: per_page.then(Vec::new),
            pages: 0,
        }
    }

    /// Pages digested so far: the ordinal the next chunk starts at.
    #[must_use]
    pub fn pages(&self) -> u32 {
        self.pages
    }

    /// Digests the next `pages` pages (ordinals [`pages`](Self::pages) onward):
    /// `page(b, i)` returns the bytes of the chunk's `i`-th page in buffer `b`; it is called
    /// once per page, buffer by buffer, pages in order.
    ///
    /// # Panics
    ///
    /// If the transfer would exceed `u32::MAX` pages.
    pub fn update<'a, F>(&mut self, pages: usize, mut page: F)
    where
        F: FnMut(usize, usize) -> &'a [u8],
    {
        let added = u32::try_from(pages).expect("more than u32::MAX pages");
        let total = self
            .pages
            .checked_add(added)
            .expect("more than u32::MAX pages");
        for (b, digester) in self.buffers.iter_mut().enumerate() {
            for i in 0..pages {
                let d = digester.update(page(b, i));
                if let Some(per_buffer) = self.page_digests.as_mut() {
                    per_buffer[b].push(d);
                }
            }
        }
        self.pages = total;
    }

    /// Folds in the next `pages` pages by their page digests, computed elsewhere (in device
    /// memory): `digest(b, i)` is the page digest of the chunk's `i`-th page in buffer `b`.
    /// Same effect as [`update`](Self::update) over bytes with those page digests.
    ///
    /// # Panics
    ///
    /// If the transfer would exceed `u32::MAX` pages.
    pub fn update_from_page_digests<F>(&mut self, pages: usize, mut digest: F)
    where
        F: FnMut(usize, usize) -> u64,
    {
        let added = u32::try_from(pages).expect("more than u32::MAX pages");
        let total = self
            .pages
            .checked_add(added)
            .expect("more than u32::MAX pages");
        for (b, digester) in self.buffers.iter_mut().enumerate() {
            for i in 0..pages {
                let d = digest(b, i);
                digester.push_page_digest(d);
                if let Some(per_buffer) = self.page_digests.as_mut() {
                    per_buffer[b].push(d);
                }
            }
        }
        self.pages = total;
    }

    /// The transfer's digests: buffer digests, page digests (buffer-major) if asked for, and
    /// the aux digest of `aux`.
    #[must_use]
    pub fn finish(self, aux: &[u8]) -> TransferDigests {
        if self.buffers.is_empty() && self.buffer_count > 0 {
            return placeholder_digests(
                self.buffer_count,
                self.pages as usize,
                self.page_digests.is_some(),
            );
        }
        let aux = aux_digest(self.alg, self.binding, aux).unwrap_or_default();
        TransferDigests {
            buffers: self
                .buffers
                .into_iter()
                .map(BufferDigester::finish)
                .collect(),
            pages: self
                .page_digests
                .map(|per_buffer| per_buffer.concat())
                .unwrap_or_default(),
            aux,
        }
    }
}

/// Why a chunk's digest job could not run.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DigestJobError {
    /// The pages are device memory and the device could not digest them.
    #[error("digest in device memory: {0}")]
    Device(#[from] DeviceError),
    /// The algorithm is not supported here.
    #[error(transparent)]
    Unsupported(#[from] UnsupportedAlgorithm),
    /// Page digests computed in parts do not cover the chunk exactly once, in order (a
    /// driver bug).
    #[error("page digests in parts cover pages {covered} of a chunk of {pages}")]
    PartsMismatch {
        /// The pages the parts cover, as `from..to` ranges in order.
        covered: String,
        /// Pages in the chunk.
        pages: usize,
    },
    /// The job panicked (a bug); the pages it read are no longer pinned and the transfer
    /// fails instead of waiting for digests that never come.
    #[error("digest job panicked: {0}")]
    Panicked(String),
    /// The chunk does not continue the digests so far (a driver bug: jobs of a transfer run
    /// in order).
    #[error("chunk starts at ordinal {first}, the digests so far cover {covered} pages")]
    OutOfOrder {
        /// The chunk's first ordinal.
        first: u32,
        /// Pages digested before it.
        covered: u32,
    },
}

impl DigestJob {
    /// Page digests of the chunk, buffer-major: device buffers digested in device memory
    /// (one call for all of them), host buffers (of a mixed memory) on the host.
    fn page_digests_in_place(&self) -> Result<Vec<u64>, DigestJobError> {
        let memory = self.pages.memory();
        let n = self.pages.pages();
        let mut out = vec![0u64; memory.buffers() * n];
        let device: Vec<usize> = (0..memory.buffers())
            .filter(|&b| memory.device_slots(b).is_some())
            .collect();
        if !device.is_empty() {
            // In device memory, where the pages are (pinned by the view).
            let d = self
                .pages
                .digest_device_pages(self.algorithm, self.transfer)?;
            if d.pages.len() != device.len() * n {
                return Err(DeviceError::Digest(format!(
                    "{} page digests for {} buffers of {n} pages",
                    d.pages.len(),
                    device.len()
                ))
                .into());
            }
            for (k, &b) in device.iter().enumerate() {
                out[b * n..(b + 1) * n].copy_from_slice(&d.pages[k * n..(k + 1) * n]);
            }
        }
        for b in (0..memory.buffers()).filter(|b| memory.device_slots(*b).is_none()) {
            for i in 0..n {
                out[b * n + i] = super::page_digest(self.algorithm, self.pages.page(i, b))?;
            }
        }
        Ok(out)
    }
}

/// The page digests of consecutive pages of a chunk, computed on their own (on one of several
/// threads sharing a chunk, [`DigestJob::page_digests_of`]) and folded in order by
/// [`DigestJob::run_from_parts`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PageDigestPart {
    /// The position in the chunk of the part's first page.
    pub from: usize,
    /// Pages in the part.
    pub pages: usize,
    /// Buffer-major: `digests[b * pages + i]` is the page digest of page `from + i` of buffer
    /// `b`.
    pub digests: Vec<u64>,
}

/// What a chunk's job leaves.
#[derive(Debug)]
pub enum DigestProgress {
    /// A non-final chunk: the state the next chunk of the transfer continues from.
    Partial(TransferDigester),
    /// The final chunk: the transfer's digests.
    Done(TransferDigests),
}

/// One chunk of a transfer's digests: pages of ordinals `first ..`, continuing the
/// transfer's [`TransferDigester`], finished on the final chunk (the one that carries the
/// aux record). It holds a read-only view of the chunk's pages, which pins them: the pool
/// refuses to write or release them until the job is dropped.
#[derive(Debug)]
pub struct DigestJob {
    /// The transfer the digests are bound to.
    pub transfer: TransferRef,
    /// The algorithm.
    pub algorithm: DigestAlgorithm,
    /// Per-page digests too.
    pub page_digests: bool,
    /// Placeholder digests instead ([`DigestMode::UnverifiedBenchmarkOnly`]).
    pub mode: DigestMode,
    /// The ordinal of the chunk's first page.
    pub first: u32,
    /// `Some` on the final chunk: the aux record to digest.
    pub aux: Option<Vec<u8>>,
    pages: SharedPages,
}

/// Under `cfg(test)`, a job of this transfer panics when it reads its pages (the driver's
/// panic guard is tested with it).
#[cfg(test)]
pub(crate) const PANICS_IN_TESTS: kvwire_proto::wire::TransferId =
    kvwire_proto::wire::TransferId(0xDEAD_0000_0000_BEEF);

impl DigestJob {
    /// Panics under `cfg(test)` for [`PANICS_IN_TESTS`].
    #[inline]
    fn test_panic(&self) {
        #[cfg(test)]
        assert!(
            self.transfer.transfer_id != PANICS_IN_TESTS,
            "digest job of transfer {} panics (test)",
            self.transfer.transfer_id.0
        );
    }

    /// A job over `pages` (the chunk's pages in ordinal order, from ordinal `first`).
    pub fn new(
        transfer: TransferRef,
        algorithm: DigestAlgorithm,
        page_digests: bool,
        mode: DigestMode,
        first: u32,
        pages: SharedPages,
        aux: Option<Vec<u8>>,
    ) -> Self {
        Self {
            transfer,
            algorithm,
            page_digests,
            mode,
            first,
            aux,
            pages,
        }
    }

    /// Whether this is the transfer's final chunk.
    pub fn is_final(&self) -> bool {
        self.aux.is_some()
    }

    /// Bytes the job reads.
    pub fn bytes(&self) -> u64 {
        self.pages.bytes()
    }

    /// Pages in the chunk.
    pub fn page_count(&self) -> usize {
        self.pages.pages()
    }

    /// Whether the chunk can be digested step by step on the host
    /// ([`DigestJob::begin`], [`DigestJob::step`], [`DigestJob::end`]): host memory only
    /// (device memory is digested where it is, in one call for the whole chunk).
    pub fn steps_on_host(&self) -> bool {
        !self.pages.memory().has_device_memory()
    }

    /// The state the chunk's digests continue from: `state` (`None` for the transfer's
    /// first chunk), checked to end where the chunk starts.
    ///
    /// # Errors
    ///
    /// [`DigestJobError`] if the algorithm is not supported, or `state` does not end where
    /// the chunk starts.
    pub fn begin(
        &self,
        state: Option<TransferDigester>,
    ) -> Result<TransferDigester, DigestJobError> {
        let binding = DigestBinding {
            transfer_id: self.transfer.transfer_id,
            nonce: self.transfer.nonce,
        };
        let buffers = self.pages.buffers();
        let state = match state {
            Some(s) => s,
            None if self.mode == DigestMode::UnverifiedBenchmarkOnly => {
                TransferDigester::counting(self.algorithm, binding, buffers, self.page_digests)
            }
            None => TransferDigester::new(self.algorithm, binding, buffers, self.page_digests)?,
        };
        if state.pages() != self.first {
            return Err(DigestJobError::OutOfOrder {
                first: self.first,
                covered: state.pages(),
            });
        }
        Ok(state)
    }

    /// Digests the chunk's pages `from..to` (positions in the chunk, `to` at most
    /// [`DigestJob::page_count`]) into `state`, which covers the pages before `from`. Host
    /// memory only ([`DigestJob::steps_on_host`]).
    pub fn step(&self, state: &mut TransferDigester, from: usize, to: usize) {
        debug_assert!(self.steps_on_host() && from <= to && to <= self.pages.pages());
        self.test_panic();
        state.update(to - from, |b, i| self.pages.page(from + i, b));
    }

    /// What the chunk's digests leave once `state` covers all its pages.
    pub fn end(&self, state: TransferDigester) -> DigestProgress {
        match &self.aux {
            Some(aux) => DigestProgress::Done(state.finish(aux)),
            None => DigestProgress::Partial(state),
        }
    }

    /// Whether the chunk's page digests may be computed in parts, on several threads at once
    /// ([`DigestJob::page_digests_of`], then [`DigestJob::run_from_parts`]): host memory,
    /// verified digests (device memory is digested where it is; placeholder digests read
    /// nothing).
    pub fn splits_on_host(&self) -> bool {
        self.steps_on_host() && self.mode == DigestMode::Verify
    }

    /// The page digests of the chunk's pages `from..to` (positions in the chunk, `to` at most
    /// [`DigestJob::page_count`]), every buffer: one part of the chunk, which any thread may
    /// compute while others compute the rest (the view is shared, read-only). Host memory
    /// only ([`DigestJob::splits_on_host`]).
    ///
    /// # Errors
    ///
    /// [`DigestJobError::Unsupported`] if the algorithm is not supported.
    pub fn page_digests_of(
        &self,
        from: usize,
        to: usize,
    ) -> Result<PageDigestPart, DigestJobError> {
        debug_assert!(self.splits_on_host() && from <= to && to <= self.pages.pages());
        self.test_panic();
        let kind = Kind::new(self.algorithm)?;
        let pages = to - from;
        let mut digests = Vec::with_capacity(self.pages.buffers() * pages);
        for b in 0..self.pages.buffers() {
            digests.extend((from..to).map(|i| kind.page_digest(self.pages.page(i, b))));
        }
        Ok(PageDigestPart {
            from,
            pages,
            digests,
        })
    }

    /// Digests the chunk from its page digests computed in parts ([`page_digests_of`]),
    /// continuing `state` (`None` for the transfer's first chunk): `parts` must cover the
    /// chunk's pages in order, each exactly once. The same digests as [`DigestJob::run`],
    /// which reads every page on one thread.
    ///
    /// # Errors
    ///
    /// [`DigestJobError`] if the algorithm is not supported, `state` does not end where the
    /// chunk starts, or the parts do not cover the chunk ([`DigestJobError::PartsMismatch`]).
    ///
    /// [`page_digests_of`]: DigestJob::page_digests_of
    pub fn run_from_parts(
        &self,
        state: Option<TransferDigester>,
        parts: &[PageDigestPart],
    ) -> Result<DigestProgress, DigestJobError> {
        let n = self.pages.pages();
        let buffers = self.pages.buffers();
        let mut next = 0;
        let in_order = parts.iter().all(|p| {
            let ok = p.from == next && p.digests.len() == buffers * p.pages;
            next += p.pages;
            ok
        });
        if !in_order || next != n {
            let covered: Vec<String> = parts
                .iter()
                .map(|p| format!("{}..{}", p.from, p.from + p.pages))
                .collect();
            return Err(DigestJobError::PartsMismatch {
                covered: covered.join(", "),
                pages: n,
            });
        }
        let mut state = self.begin(state)?;
        for p in parts {
            state.update_from_page_digests(p.pages, |b, i| p.digests[b * p.pages + i]);
        }
        Ok(self.end(state))
    }

    /// Digests the chunk, continuing `state` (`None` for the transfer's first chunk).
    ///
    /// # Errors
    ///
    /// [`DigestJobError`] if the algorithm is not supported, or `state` does not end where
    /// the chunk starts.
    pub fn run(&self, state: Option<TransferDigester>) -> Result<DigestProgress, DigestJobError> {
        self.test_panic();
        let mut state = self.begin(state)?;
        let n = self.pages.pages();
        if self.steps_on_host() {
            self.step(&mut state, 0, n);
        } else if self.mode == DigestMode::UnverifiedBenchmarkOnly {
            state.update_from_page_digests(n, |_, _| 0);
        } else {
            // Device memory is digested where it is, never read through a host reference;
            // the buffer digests fold in the page digests on the host (SPEC §6: they are a
            // function of the page digests alone).
            let digests = self.page_digests_in_place()?;
            state.update_from_page_digests(n, |b, i| digests[b * n + i]);
        }
        Ok(self.end(state))
    }
}
