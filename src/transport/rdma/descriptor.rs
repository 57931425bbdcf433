//! The access descriptor a reservation carries over RDMA (`proto/SPEC.md` §9.2).
//!
//! The receiver covers each run of consecutive reserved pages with one memory window per
//! buffer and sends, per run, the window rkeys; the sender finds the run of each destination
//! page and writes to `base[buffer] + page * page_bytes[buffer]` with that run's rkey.
//! Encoding (little-endian, like every frame field):
//!
//! ```text
//! u8  kind            1 = per-reservation memory windows, 2 = region rkeys (no NIC fence),
//!                     3 and 4 = the same, striped over several lanes
//! u8  buffers B       1..=255
//! u64 base[B]         remote address of page 0 of each buffer
//! u16 runs R          1..
//! R x { u32 first_page; u32 pages (>= 1); [u16 lane, kinds 3 and 4]; u32 rkey[B] }
//!                     sorted, non-overlapping
//! ```
//!
//! A striped descriptor names, per run, the lane (queue pair) its windows were bound on: the
//! sender writes that run's pages through that lane (SPEC §9.2, striping a transfer over
//! lanes). Decoding never panics and checks every invariant the sender relies on: runs sorted
//! and disjoint, no empty run, no address arithmetic that overflows, nothing after the last
//! run.

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
    /// [`Self::WINDOWS`] striped over several lanes: each run names the lane its windows
    /// were bound on.
    pub const STRIPED_WINDOWS: Self = Self(3);
    /// [`Self::REGION`] striped over several lanes: each run names the lane (and so the
    /// rail) whose region rkeys it carries.
    pub const STRIPED_REGION: Self = Self(4);

    /// Whether every run names its lane.
    pub fn is_striped(self) -> bool {
        self == Self::STRIPED_WINDOWS || self == Self::STRIPED_REGION
    }

    /// Whether the NIC fences the scope (memory windows).
    pub fn has_windows(self) -> bool {
        self == Self::WINDOWS || self == Self::STRIPED_WINDOWS
    }

    /// This kind striped over several lanes (`striped`) or not.
    pub fn striped(self, striped: bool) -> Self {
        match (self.has_windows(), striped) {
            (true, false) => Self::WINDOWS,
            (false, false) => Self::REGION,
            (true, true) => Self::STRIPED_WINDOWS,
            (false, true) => Self::STRIPED_REGION,
        }
    }
}

/// One run of consecutive destination pages and its rkey per buffer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AccessRun {
    /// First page of the run.
    pub first_page: u32,
    /// Pages in the run (at least 1).
    pub pages: u32,
    /// The lane the run's windows were bound on: `Some` in a striped descriptor (every run
    /// names one), `None` in an unstriped one (every page goes on the reservation's lane).
    pub lane: Option<u16>,
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

/// Pages per stripe below which a reservation is not striped further, unless the engine
/// sets it (`TransportConfig::Rdma::stripe_pages`): a reservation of `P` pages is striped
/// over `min(P / 16, live lanes)` lanes.
pub const DEFAULT_STRIPE_PAGES: u32 = 16;

/// How a receiver stripes a reservation of `pages` (in ordinal order) over `lanes`, the live
/// lanes in the order it takes them (its round robin, from the next one) with each one's
/// rail (SPEC §9.2, striping a transfer over lanes): over `min(pages / stripe_pages, lanes)`
/// lanes (at least one; `stripe_pages = 0` never stripes), lanes of rails not yet used taken
/// before a second lane of any rail, and the pages split in that many consecutive ordinal
/// ranges of equal size (the first ones one page longer where they do not divide). Each
/// entry is a lane and its pages; the first is the reservation's own lane, which carries its
/// RESERVE and COMMIT.
pub fn plan_stripes(
    pages: &[u32],
    lanes: &[(usize, usize)],
    stripe_pages: u32,
) -> Vec<(usize, Vec<u32>)> {
    let mut order: Vec<usize> = Vec::with_capacity(lanes.len());
    let mut rails: Vec<usize> = Vec::new();
    for &(lane, rail) in lanes {
        if !rails.contains(&rail) {
            rails.push(rail);
            order.push(lane);
        }
    }
    for &(lane, _) in lanes {
        if !order.contains(&lane) {
            order.push(lane);
        }
    }
    let wanted = match stripe_pages {
        0 => 1,
        n => pages.len() / n as usize,
    };
    let k = wanted.clamp(1, order.len().max(1)).min(pages.len().max(1));
    let n = pages.len();
    // Ranges of n / k pages, the first n % k of them one page longer.
    let start = |j: usize| j * (n / k) + j.min(n % k);
    order
        .into_iter()
        .take(k)
        .enumerate()
        .map(|(j, lane)| (lane, pages[start(j)..start(j + 1)].to_vec()))
        .collect()
}

/// The lanes a receiver reserves and stripes over, out of `lanes` (live lanes with their
/// rails, in its round-robin order), given which rails are **near** its KV memory
/// (`near[rail]`: the rail's NIC sits on the memory's NUMA node; SPEC §9.2, striping): the
/// lanes of near rails while one of them lives, else every lane given. With no rail near
/// (the topology unknown, or no NIC on the memory's node) every lane is taken.
pub fn prefer_near_rails(lanes: &[(usize, usize)], near: &[bool]) -> Vec<(usize, usize)> {
    let close: Vec<(usize, usize)> = lanes
        .iter()
        .copied()
        .filter(|&(_, rail)| near.get(rail).copied().unwrap_or(false))
        .collect();
    if close.is_empty() {
        lanes.to_vec()
    } else {
        close
    }
}

/// Per rail, whether its NIC is near the KV memory: its NUMA node (`device_nodes[rail]`) is
/// the memory's. All false unless both are known.
pub fn near_rails(memory_node: Option<u32>, device_nodes: &[Option<u32>]) -> Vec<bool> {
    device_nodes
        .iter()
        .map(|d| memory_node.is_some() && *d == memory_node)
        .collect()
}

/// Encoded size of a descriptor with `buffers` buffers and `runs` runs, `striped` (each run
/// names its lane) or not.
pub fn encoded_len(buffers: usize, runs: usize, striped: bool) -> usize {
    2 + 8 * buffers + 2 + runs * (8 + 2 * usize::from(striped) + 4 * buffers)
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
        let striped = self.kind.is_striped();
        if self.runs.iter().any(|r| r.lane.is_some() != striped) {
            return Err(DescriptorError::Malformed(
                "a striped descriptor names every run's lane, another none",
            ));
        }
        let len = encoded_len(b, self.runs.len(), striped);
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
            if let Some(lane) = r.lane {
                out.extend_from_slice(&lane.to_le_bytes());
            }
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
        if !(1..=4).contains(&kind.0) {
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
            let lane = if kind.is_striped() {
                Some(u16::from_le_bytes(
                    take(2, "lane")?.try_into().unwrap_or([0; 2]),
                ))
            } else {
                None
            };
            let mut rkeys = Vec::with_capacity(b);
            for _ in 0..b {
                rkeys.push(u32::from_le_bytes(
                    take(4, "rkey")?.try_into().unwrap_or([0; 4]),
                ));
            }
            runs.push(AccessRun {
                first_page,
                pages,
                lane,
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

    /// The lanes a striped descriptor's runs name (sorted, each once); empty when unstriped.
    pub fn lanes(&self) -> Vec<u16> {
        let mut lanes: Vec<u16> = self.runs.iter().filter_map(|r| r.lane).collect();
        lanes.sort_unstable();
        lanes.dedup();
        lanes
    }

    /// The lane destination page `page` is written through: its run's (striped), `None` for
    /// the reservation's own lane (unstriped). Refuses pages outside every run.
    pub fn lane_of(&self, page: u32) -> Result<Option<u16>, DescriptorError> {
        Ok(self.run_of(page)?.lane)
    }

    fn run_of(&self, page: u32) -> Result<&AccessRun, DescriptorError> {
        let i = self
            .runs
            .partition_point(|r| r.span().end <= u64::from(page));
        self.runs
            .get(i)
            .filter(|r| r.span().contains(&u64::from(page)))
            .ok_or(DescriptorError::PageOutsideScope(page))
    }

    /// The rkey and remote address for buffer `b` of destination page `page`, whose pages in
    /// that buffer are `page_bytes` long. Refuses pages outside every run.
    pub fn locate(
        &self,
        page: u32,
        b: usize,
        page_bytes: u32,
    ) -> Result<(u32, u64), DescriptorError> {
        let run = self.run_of(page)?;
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
                    lane: None,
                    rkeys: vec![0x11, 0x12],
                },
                AccessRun {
                    first_page: 9,
                    pages: 1,
                    lane: None,
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
        assert_eq!(bytes.len(), encoded_len(2, 2, false));
        assert_eq!(AccessDescriptor::decode(&bytes, 2).unwrap(), sample());
    }

    fn striped() -> AccessDescriptor {
        let mut d = sample();
        d.kind = AccessKind::STRIPED_WINDOWS;
        d.runs[0].lane = Some(1);
        d.runs[1].lane = Some(0);
        d
    }

    /// SPEC §9.2, striping: kinds 3 and 4 carry each run's lane after its page count.
    #[test]
    fn a_striped_descriptor_names_each_runs_lane() {
        let bytes = striped().encode().unwrap();
        let want: Vec<u8> = [
            &[3u8, 2][..],
            &0x1000u64.to_le_bytes(),
            &0x20_0000u64.to_le_bytes(),
            &2u16.to_le_bytes(),
            &3u32.to_le_bytes(),
            &2u32.to_le_bytes(),
            &1u16.to_le_bytes(),
            &0x11u32.to_le_bytes(),
            &0x12u32.to_le_bytes(),
            &9u32.to_le_bytes(),
            &1u32.to_le_bytes(),
            &0u16.to_le_bytes(),
            &0x21u32.to_le_bytes(),
            &0x22u32.to_le_bytes(),
        ]
        .concat();
        assert_eq!(bytes, want);
        assert_eq!(bytes.len(), encoded_len(2, 2, true));
        let d = AccessDescriptor::decode(&bytes, 2).unwrap();
        assert_eq!(d, striped());
        assert_eq!(d.lanes(), vec![0, 1]);
        assert_eq!(d.lane_of(4), Ok(Some(1)));
        assert_eq!(d.lane_of(9), Ok(Some(0)));
        assert_eq!(d.lane_of(5), Err(DescriptorError::PageOutsideScope(5)));
        assert_eq!(d.locate(4, 1, 8192), Ok((0x12, 0x20_0000 + 4 * 8192)));
        // Unstriped: no lane per run, every page on the reservation's lane.
        assert_eq!(sample().lane_of(3), Ok(None));
        assert!(sample().lanes().is_empty());
        // The region kind striped.
        let mut region = striped();
        region.kind = AccessKind::STRIPED_REGION;
        let bytes = region.encode().unwrap();
        assert_eq!(bytes[0], 4);
        assert_eq!(AccessDescriptor::decode(&bytes, 2).unwrap(), region);
        // A kind and its runs' lanes must agree to encode.
        let mut mixed = striped();
        mixed.runs[1].lane = None;
        assert!(matches!(mixed.encode(), Err(DescriptorError::Malformed(_))));
        let mut unnamed = sample();
        unnamed.runs[0].lane = Some(0);
        assert!(matches!(
            unnamed.encode(),
            Err(DescriptorError::Malformed(_))
        ));
        // Every truncation of a striped descriptor is refused.
        let good = striped().encode().unwrap();
        for n in 0..good.len() {
            assert!(
                AccessDescriptor::decode(&good[..n], 2).is_err(),
                "prefix {n}"
            );
        }
        assert_eq!(
            AccessKind::WINDOWS.striped(true),
            AccessKind::STRIPED_WINDOWS
        );
        assert_eq!(
            AccessKind::STRIPED_REGION.striped(false),
            AccessKind::REGION
        );
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
        for unknown in [0u8, 5, 7, 255] {
            let mut kind = good.clone();
            kind[0] = unknown;
            assert_eq!(
                AccessDescriptor::decode(&kind, 2),
                Err(DescriptorError::UnknownKind(unknown))
            );
        }
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
    fn stripes_take_each_rail_once_before_any_twice_and_split_the_pages_in_order() {
        let pages: Vec<u32> = (100..164).rev().collect(); // 64 pages, ordinal order
                                                          // Lanes 1, 2, 3, 0 (the round robin from lane 1) on rails 1, 0, 1, 0.
        let lanes = [(1, 1), (2, 0), (3, 1), (0, 0)];
        let plan = plan_stripes(&pages, &lanes, 16);
        assert_eq!(
            plan.iter().map(|(l, p)| (*l, p.len())).collect::<Vec<_>>(),
            vec![(1, 16), (2, 16), (3, 16), (0, 16)]
        );
        assert_eq!(
            plan.iter().flat_map(|(_, p)| p.clone()).collect::<Vec<_>>(),
            pages
        );
        // Two stripes' worth: the two rails, not two lanes of one rail.
        let plan = plan_stripes(&pages[..40], &lanes, 16);
        assert_eq!(
            plan.iter().map(|(l, p)| (*l, p.len())).collect::<Vec<_>>(),
            vec![(1, 20), (2, 20)]
        );
        // Uneven: 7 pages over 2 lanes, in order, the first range the longer; 10 over 4.
        let plan = plan_stripes(&pages[..7], &lanes, 3);
        assert_eq!(plan[0], (1, pages[..4].to_vec()));
        assert_eq!(plan[1], (2, pages[4..7].to_vec()));
        let plan = plan_stripes(&pages[..10], &lanes, 2);
        assert_eq!(
            plan.iter().map(|(_, p)| p.len()).collect::<Vec<_>>(),
            vec![3, 3, 2, 2]
        );
        // Not striped: too few pages, striping off, one lane.
        for (n, stripe, lanes) in [
            (15, 16, &lanes[..]),
            (64, 0, &lanes[..]),
            (64, 1, &lanes[..1]),
            (1, 1, &lanes[..]),
        ] {
            assert_eq!(
                plan_stripes(&pages[..n], lanes, stripe),
                vec![(1, pages[..n].to_vec())],
                "{n} pages, stripe {stripe}"
            );
        }
        assert!(plan_stripes(&pages, &[], 16).is_empty());
        // One rail, two lanes: its lanes.
        let plan = plan_stripes(&pages[..4], &[(0, 0), (1, 0)], 1);
        assert_eq!(
            plan,
            vec![(0, pages[..2].to_vec()), (1, pages[2..4].to_vec())]
        );
    }

    /// Rail affinity: the near rails' lanes while one lives, every lane otherwise.
    #[test]
    fn near_rails_are_taken_while_one_lives() {
        // Lanes 0..4 on rails 0, 1, 2, 3; rails 1 and 3 near the memory.
        let lanes = [(0, 0), (1, 1), (2, 2), (3, 3)];
        let near = [false, true, false, true];
        assert_eq!(prefer_near_rails(&lanes, &near), vec![(1, 1), (3, 3)]);
        // Rail 1's lane dead: rail 3 alone.
        assert_eq!(
            prefer_near_rails(&[(0, 0), (2, 2), (3, 3)], &near),
            vec![(3, 3)]
        );
        // Every near rail dead: the far ones.
        assert_eq!(
            prefer_near_rails(&[(0, 0), (2, 2)], &near),
            vec![(0, 0), (2, 2)]
        );
        assert_eq!(
            near_rails(Some(1), &[Some(0), Some(1), None, Some(1)]),
            near
        );
        assert_eq!(near_rails(None, &[Some(0), None]), [false, false]);
        // Nothing known (or nothing near), or a rail beyond the table: every lane.
        assert_eq!(prefer_near_rails(&lanes, &[]), lanes.to_vec());
        assert_eq!(prefer_near_rails(&lanes, &[false; 4]), lanes.to_vec());
        // Striping then spreads over the near rails only.
        let pages: Vec<u32> = (0..64).collect();
        let plan = plan_stripes(&pages, &prefer_near_rails(&lanes, &near), 16);
        assert_eq!(
            plan.iter().map(|(l, p)| (*l, p.len())).collect::<Vec<_>>(),
            vec![(1, 32), (3, 32)]
        );
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
                lane: None,
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
