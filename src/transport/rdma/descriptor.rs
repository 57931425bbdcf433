//! The access descriptor a reservation carries over RDMA (`proto/SPEC.md` §9.2).
//!
//! The receiver covers each run of consecutive reserved pages with one memory window per
//! buffer and sends, per run, the window rkeys; the sender finds the run of each destination
//! page and writes to `base[buffer] + page * page_bytes[buffer]` with that run's rkey.
//! Encoding (little-endian, like every frame field):
//!
//! ```text
//! u8  kind            1 = per-reservation memory windows, 2 = region rkeys (no NIC fence)
//! u8  buffers B       1..=255
//! u64 base[B]         remote address of page 0 of each buffer
//! u16 runs R          1..
//! R x { u32 first_page; u32 pages (>= 1); u32 rkey[B] }   sorted, non-overlapping
//! ```
//!
//! Decoding never panics and checks every invariant the sender relies on: runs sorted and
//! disjoint, no empty run, no address arithmetic that overflows, nothing after the last run.

use std::ops::Range;

use kvwire_proto::wire::MAX_ACCESS;

/// How the receiver scoped remote access.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AccessKind(pub u8);

impl AccessKind {
    /// Type-2 memory windows bound over exactly the reservation's pages; invalidated at the
    /// fence, after which a write fails at the NIC.
    pub const WINDOWS: Self = Self(1);
    /// The memory region's own rkeys (devices without memory windows): the fence is only
    /// the protocol's; a late write can still land. The receiver warns and counts it.
    pub const REGION: Self = Self(2);
}

/// One run of consecutive destination pages and its rkey per buffer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AccessRun {
    /// First page of the run.
    pub first_page: u32,
    /// Pages in the run (at least 1).
    pub pages: u32,
    /// The rkey of each buffer's window over the run.
    pub rkeys: Vec<u32>,
}

impl AccessRun {
    fn span(&self) -> Range<u64> {
        u64::from(self.first_page)..u64::from(self.first_page) + u64::from(self.pages)
    }
}

/// A decoded RDMA access descriptor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AccessDescriptor {
    /// How access is scoped.
    pub kind: AccessKind,
    /// Remote address of page 0 of each buffer.
    pub base: Vec<u64>,
    /// The runs, sorted by first page, disjoint.
    pub runs: Vec<AccessRun>,
}

/// Why an access descriptor was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DescriptorError {
    /// The bytes end early or continue past the last run.
    #[error("access descriptor: {0}")]
    Malformed(&'static str),
    /// The descriptor's buffer count differs from the negotiated layout's.
    #[error("access descriptor names {got} buffers, the layout has {expected}")]
    Buffers {
        /// Buffers in the layout.
        expected: usize,
        /// Buffers in the descriptor.
        got: usize,
    },
    /// Runs overlap, are out of order, or are empty.
    #[error("access descriptor runs are empty, unsorted or overlapping")]
    Runs,
    /// A destination page lies in no run.
    #[error("page {0} is outside the reservation's access descriptor")]
    PageOutsideScope(u32),
    /// An address computed from the descriptor overflows.
    #[error("address of page {0} overflows")]
    Overflow(u32),
    /// The encoding would exceed the frame's limit for access descriptors.
    #[error("{runs} runs do not fit an access descriptor of at most {MAX_ACCESS} bytes")]
    TooManyRuns {
        /// Runs needed.
        runs: usize,
    },
    /// An unknown kind.
    #[error("unknown access kind {0}")]
    UnknownKind(u8),
}

/// Splits `pages` (any order, no duplicates) into runs of consecutive pages, sorted.
pub fn page_runs(pages: &[u32]) -> Vec<(u32, u32)> {
    let mut sorted = pages.to_vec();
    sorted.sort_unstable();
    let mut runs: Vec<(u32, u32)> = Vec::new();
    for p in sorted {
        match runs.last_mut() {
            Some((first, n)) if u64::from(*first) + u64::from(*n) == u64::from(p) => *n += 1,
            _ => runs.push((p, 1)),
        }
    }
    runs
}

/// Encoded size of a descriptor with `buffers` buffers and `runs` runs.
pub fn encoded_len(buffers: usize, runs: usize) -> usize {
    2 + 8 * buffers + 2 + runs * (8 + 4 * buffers)
}

impl AccessDescriptor {
    /// Encodes the descriptor (checked against the frame limit).
    pub fn encode(&self) -> Result<Vec<u8>, DescriptorError> {
        let b = self.base.len();
        if b == 0 || b > 255 || self.runs.iter().any(|r| r.rkeys.len() != b) {
            return Err(DescriptorError::Buffers {
                expected: b,
                got: self.runs.first().map_or(0, |r| r.rkeys.len()),
            });
        }
        let len = encoded_len(b, self.runs.len());
        if len > MAX_ACCESS || self.runs.len() > usize::from(u16::MAX) {
            return Err(DescriptorError::TooManyRuns {
                runs: self.runs.len(),
            });
        }
        let mut out = Vec::with_capacity(len);
        out.push(self.kind.0);
        out.push(b as u8);
        for a in &self.base {
            out.extend_from_slice(&a.to_le_bytes());
        }
        out.extend_from_slice(&(self.runs.len() as u16).to_le_bytes());
        for r in &self.runs {
            out.extend_from_slice(&r.first_page.to_le_bytes());
            out.extend_from_slice(&r.pages.to_le_bytes());
            for k in &r.rkeys {
                out.extend_from_slice(&k.to_le_bytes());
            }
        }
        Ok(out)
    }

    /// Decodes and checks a descriptor for a layout of `buffers` buffers.
    pub fn decode(bytes: &[u8], buffers: usize) -> Result<Self, DescriptorError> {
        let mut r = bytes;
        let mut take = |n: usize, what: &'static str| -> Result<&[u8], DescriptorError> {
            if r.len() < n {
                return Err(DescriptorError::Malformed(what));
            }
            let (h, t) = r.split_at(n);
            r = t;
            Ok(h)
        };
        let kind = AccessKind(take(1, "kind")?[0]);
        if kind != AccessKind::WINDOWS && kind != AccessKind::REGION {
            return Err(DescriptorError::UnknownKind(kind.0));
        }
        let b = usize::from(take(1, "buffers")?[0]);
        if b != buffers {
            return Err(DescriptorError::Buffers {
                expected: buffers,
                got: b,
            });
        }
        let mut base = Vec::with_capacity(b);
        for _ in 0..b {
            base.push(u64::from_le_bytes(
                take(8, "base")?.try_into().unwrap_or([0; 8]),
            ));
        }
        let n = u16::from_le_bytes(take(2, "runs")?.try_into().unwrap_or([0; 2]));
        let mut runs = Vec::with_capacity(usize::from(n).min(MAX_ACCESS));
        for _ in 0..n {
            let first_page =
                u32::from_le_bytes(take(4, "first_page")?.try_into().unwrap_or([0; 4]));
            let pages = u32::from_le_bytes(take(4, "pages")?.try_into().unwrap_or([0; 4]));
            let mut rkeys = Vec::with_capacity(b);
            for _ in 0..b {
                rkeys.push(u32::from_le_bytes(
                    take(4, "rkey")?.try_into().unwrap_or([0; 4]),
                ));
            }
            runs.push(AccessRun {
                first_page,
                pages,
                rkeys,
            });
        }
        if !r.is_empty() {
            return Err(DescriptorError::Malformed("bytes after the last run"));
        }
        if runs.is_empty()
            || runs.iter().any(|x| x.pages == 0)
            || runs.windows(2).any(|w| w[0].span().end > w[1].span().start)
        {
            return Err(DescriptorError::Runs);
        }
        Ok(Self { kind, base, runs })
    }

    /// The rkey and remote address for buffer `b` of destination page `page`, whose pages in
    /// that buffer are `page_bytes` long. Refuses pages outside every run.
    pub fn locate(
        &self,
        page: u32,
        b: usize,
        page_bytes: u32,
    ) -> Result<(u32, u64), DescriptorError> {
        let i = self
            .runs
            .partition_point(|r| r.span().end <= u64::from(page));
        let run = self
            .runs
            .get(i)
            .filter(|r| r.span().contains(&u64::from(page)))
            .ok_or(DescriptorError::PageOutsideScope(page))?;
        let (Some(&rkey), Some(&base)) = (run.rkeys.get(b), self.base.get(b)) else {
            return Err(DescriptorError::Buffers {
                expected: self.base.len(),
                got: b + 1,
            });
        };
        let addr = u64::from(page)
            .checked_mul(u64::from(page_bytes))
            .and_then(|off| base.checked_add(off))
            .ok_or(DescriptorError::Overflow(page))?;
        Ok((rkey, addr))
    }

    /// Checks that every page of `pages` lies in a run, and every address is computable.
    pub fn covers(&self, pages: &[u32], page_bytes: &[u32]) -> Result<(), DescriptorError> {
        for &p in pages {
            for (b, &bytes) in page_bytes.iter().enumerate() {
                self.locate(p, b, bytes)?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> AccessDescriptor {
        AccessDescriptor {
            kind: AccessKind::WINDOWS,
            base: vec![0x1000, 0x20_0000],
            runs: vec![
                AccessRun {
                    first_page: 3,
                    pages: 2,
                    rkeys: vec![0x11, 0x12],
                },
                AccessRun {
                    first_page: 9,
                    pages: 1,
                    rkeys: vec![0x21, 0x22],
                },
            ],
        }
    }

    #[test]
    fn golden_bytes_round_trip() {
        let bytes = sample().encode().unwrap();
        let want: Vec<u8> = [
            &[1u8, 2][..],
            &0x1000u64.to_le_bytes(),
            &0x20_0000u64.to_le_bytes(),
            &2u16.to_le_bytes(),
            &3u32.to_le_bytes(),
            &2u32.to_le_bytes(),
            &0x11u32.to_le_bytes(),
            &0x12u32.to_le_bytes(),
            &9u32.to_le_bytes(),
            &1u32.to_le_bytes(),
            &0x21u32.to_le_bytes(),
            &0x22u32.to_le_bytes(),
        ]
        .concat();
        assert_eq!(bytes, want);
        assert_eq!(bytes.len(), encoded_len(2, 2));
        assert_eq!(AccessDescriptor::decode(&bytes, 2).unwrap(), sample());
    }

    #[test]
    fn locate_finds_the_run_and_refuses_pages_outside() {
        let d = sample();
        assert_eq!(d.locate(3, 0, 4096), Ok((0x11, 0x1000 + 3 * 4096)));
        assert_eq!(d.locate(4, 1, 8192), Ok((0x12, 0x20_0000 + 4 * 8192)));
        assert_eq!(d.locate(9, 1, 8192), Ok((0x22, 0x20_0000 + 9 * 8192)));
        for outside in [0, 2, 5, 8, 10, u32::MAX] {
            assert_eq!(
                d.locate(outside, 0, 4096),
                Err(DescriptorError::PageOutsideScope(outside))
            );
        }
        assert!(d.covers(&[3, 4, 9], &[4096, 8192]).is_ok());
        assert_eq!(
            d.covers(&[3, 5], &[4096, 8192]),
            Err(DescriptorError::PageOutsideScope(5))
        );
    }

    #[test]
    fn overflowing_addresses_are_refused() {
        let mut d = sample();
        d.base[0] = u64::MAX - 10;
        assert_eq!(d.locate(3, 0, 4096), Err(DescriptorError::Overflow(3)));
    }

    #[test]
    fn malformed_descriptors_are_refused_without_panicking() {
        let good = sample().encode().unwrap();
        // Every truncation.
        for n in 0..good.len() {
            assert!(
                AccessDescriptor::decode(&good[..n], 2).is_err(),
                "prefix {n}"
            );
        }
        // Trailing bytes.
        let mut long = good.clone();
        long.push(0);
        assert_eq!(
            AccessDescriptor::decode(&long, 2),
            Err(DescriptorError::Malformed("bytes after the last run"))
        );
        // Wrong buffer count, unknown kind.
        assert!(matches!(
            AccessDescriptor::decode(&good, 3),
            Err(DescriptorError::Buffers {
                expected: 3,
                got: 2
            })
        ));
        let mut kind = good.clone();
        kind[0] = 7;
        assert_eq!(
            AccessDescriptor::decode(&kind, 2),
            Err(DescriptorError::UnknownKind(7))
        );
        // Overlapping, unsorted and empty runs.
        for (first, pages) in [(4u32, 1u32), (1, 1), (9, 0)] {
            let mut d = sample();
            d.runs[1].first_page = first;
            d.runs[1].pages = pages;
            let bytes = d.encode().unwrap();
            assert_eq!(
                AccessDescriptor::decode(&bytes, 2),
                Err(DescriptorError::Runs),
                "run ({first}, {pages})"
            );
        }
        // No runs at all.
        let mut d = sample();
        d.runs.clear();
        assert_eq!(
            AccessDescriptor::decode(&d.encode().unwrap(), 2),
            Err(DescriptorError::Runs)
        );
    }

    #[test]
    fn arbitrary_bytes_never_panic() {
        // A deterministic sweep of pseudo-random descriptors (xorshift).
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for _ in 0..20_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let len = (x % 80) as usize;
            let bytes: Vec<u8> = (0..len).map(|i| (x >> (i % 56)) as u8).collect();
            if let Ok(d) =
                AccessDescriptor::decode(&bytes, usize::from(bytes.get(1).copied().unwrap_or(0)))
            {
                assert_eq!(d.encode().unwrap(), bytes, "decode/encode round trip");
                let _ = d.locate((x >> 3) as u32, 0, 4096);
            }
        }
    }

    #[test]
    fn runs_of_scattered_pages() {
        assert_eq!(
            page_runs(&[7, 3, 4, 5, 9, 10, 1]),
            vec![(1, 1), (3, 3), (7, 1), (9, 2)]
        );
        assert_eq!(page_runs(&[]), Vec::<(u32, u32)>::new());
        assert_eq!(
            page_runs(&[u32::MAX, u32::MAX - 1]),
            vec![(u32::MAX - 1, 2)]
        );
    }

    #[test]
    fn too_many_runs_do_not_encode() {
        let runs = (0..300)
            .map(|i| AccessRun {
                first_page: 2 * i,
                pages: 1,
                rkeys: vec![1, 2, 3],
            })
            .collect();
        let d = AccessDescriptor {
            kind: AccessKind::WINDOWS,
            base: vec![0; 3],
            runs,
        };
        assert_eq!(d.encode(), Err(DescriptorError::TooManyRuns { runs: 300 }));
    }
}
