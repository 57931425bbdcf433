//! Integration tests for the page pool and the engine configuration check.

use std::collections::HashSet;

use kvwire::config::*;
use kvwire::memory::*;
use proptest::prelude::*;

fn geometry(pages: u32) -> PoolGeometry {
    PoolGeometry {
        tokens_per_page: 16,
        buffer_page_bytes: vec![8, 4, 12],
        pages,
    }
}

fn pool(pages: u32, scrub: Scrub) -> PagePool {
    PagePool::new(geometry(pages), scrub).expect("valid geometry")
}

fn raw(lease: &PageLease) -> RawLease {
    RawLease {
        pool_id: lease.pool_id(),
        page: lease.page(),
        generation: lease.generation(),
        holder: lease.holder(),
    }
}

fn release_all(pool: &PagePool, leases: Vec<PageLease>) {
    for lease in leases {
        pool.release(lease).expect("release of a live lease");
    }
}

fn counts(pool: &PagePool) -> (u32, u32, u32) {
    (
        pool.free_pages(),
        pool.leased_pages(),
        pool.quarantined_pages(),
    )
}

/// Allocates every free page and asserts that no page comes out twice and all pages are
/// accounted for.
fn drain_and_check_distinct(pool: &mut PagePool) -> Vec<PageLease> {
    let free = pool.free_pages();
    let leases = pool.allocate(free).expect("allocate every free page");
    let pages: HashSet<u32> = leases.iter().map(PageLease::page).collect();
    assert_eq!(pages.len(), leases.len(), "a page was handed out twice");
    assert_eq!(pool.free_pages(), 0);
    assert_eq!(
        pool.allocate(1).unwrap_err(),
        PoolError::Exhausted {
            requested: 1,
            free: 0
        }
    );
    leases
}

#[test]
fn allocate_release_round_trip_restores_free_count() {
    let mut p = pool(10, Scrub::None);
    assert_eq!(counts(&p), (10, 0, 0));
    let leases = p.allocate(4).unwrap();
    assert_eq!(leases.len(), 4);
    assert_eq!(counts(&p), (6, 4, 0));
    for lease in &leases {
        assert_eq!(lease.pool_id(), p.id());
        assert_eq!(
            p.state(lease.page()),
            Some(PageState::Leased {
                generation: lease.generation()
            })
        );
        assert!(p.holds(lease.page(), lease.generation()));
    }
    let pages: Vec<u32> = leases.iter().map(PageLease::page).collect();
    release_all(&p, leases);
    assert_eq!(counts(&p), (10, 0, 0));
    for page in pages {
        assert_eq!(p.state(page), Some(PageState::Free));
    }
    let stats = p.stats();
    assert_eq!((stats.free, stats.leased, stats.quarantined), (10, 0, 0));
    assert_eq!(
        (
            stats.allocations,
            stats.releases,
            stats.stale_release_errors
        ),
        (4, 4, 0)
    );
    // And the whole pool can still be handed out, each page once.
    let all = drain_and_check_distinct(&mut p);
    assert_eq!(all.len(), 10);
    release_all(&p, all);
}

#[test]
fn exhaustion_is_all_or_nothing() {
    let p = pool(5, Scrub::None);
    let first = p.allocate(3).unwrap();
    assert_eq!(
        p.allocate(3).unwrap_err(),
        PoolError::Exhausted {
            requested: 3,
            free: 2
        }
    );
    assert_eq!(counts(&p), (2, 3, 0), "a failed allocation took pages");
    assert_eq!(p.stats().allocations, 3);
    let rest = p.allocate(2).unwrap();
    assert_eq!(rest.len(), 2);
    assert_eq!(p.allocate(0).unwrap(), Vec::new());
    assert_eq!(counts(&p), (0, 5, 0));
    release_all(&p, first);
    release_all(&p, rest);
    assert_eq!(
        p.allocate(6).unwrap_err(),
        PoolError::Exhausted {
            requested: 6,
            free: 5
        }
    );
    assert_eq!(counts(&p), (5, 0, 0));
}

#[test]
fn zero_page_allocation_is_empty_and_free() {
    let p = pool(1, Scrub::None);
    let _all = p.allocate(1).unwrap();
    // Even from an exhausted pool.
    assert_eq!(p.allocate(0), Ok(Vec::new()));
    assert_eq!(counts(&p), (0, 1, 0));
}

#[test]
fn double_release_via_raw_lease_is_refused_and_changes_nothing() {
    let mut p = pool(4, Scrub::None);
    let mut leases = p.allocate(2).unwrap();
    let lease = leases.pop().unwrap();
    let duplicate = PageLease::from_raw(raw(&lease));
    let page = lease.page();
    p.release(lease).unwrap();
    let before = counts(&p);
    assert_eq!(before, (3, 1, 0));

    assert_eq!(p.release(duplicate), Err(PoolError::NotLeased { page }));
    assert_eq!(counts(&p), before, "double release changed the counts");
    assert_eq!(p.state(page), Some(PageState::Free));
    assert_eq!(p.stats().releases, 1);
    assert_eq!(p.stats().stale_release_errors, 1);

    // The free list holds the page once: draining the pool never yields it twice.
    let drained = drain_and_check_distinct(&mut p);
    assert_eq!(drained.len(), 3);
    assert_eq!(drained.iter().filter(|l| l.page() == page).count(), 1);
    release_all(&p, drained);
    release_all(&p, leases);
    assert_eq!(counts(&p), (4, 0, 0));
}

#[test]
fn stale_release_is_refused_and_leaves_the_new_holder_alone() {
    let p = pool(1, Scrub::Poison);
    let old = p.allocate(1).unwrap().pop().unwrap();
    let old_raw = raw(&old);
    p.release(old).unwrap();
    let new = p.allocate(1).unwrap().pop().unwrap();
    assert_eq!(new.page(), old_raw.page);
    assert_ne!(new.generation(), old_raw.generation);
    p.page_mut(&new, 0).unwrap().fill(0x5A);

    assert_eq!(
        p.release(PageLease::from_raw(old_raw)),
        Err(PoolError::StaleLease {
            page: old_raw.page,
            lease_generation: old_raw.generation,
            current_generation: new.generation(),
        })
    );
    assert_eq!(counts(&p), (0, 1, 0));
    assert!(p.holds(new.page(), new.generation()));
    assert!(!p.holds(old_raw.page, old_raw.generation));
    assert!(
        p.page(&new, 0).unwrap().iter().all(|&b| b == 0x5A),
        "stale release scrubbed the new holder's page"
    );
    p.release(new).unwrap();
    assert_eq!(counts(&p), (1, 0, 0));
}

#[test]
fn wrong_pool_is_refused() {
    let a = pool(2, Scrub::None);
    let b = pool(2, Scrub::None);
    assert_ne!(a.id(), b.id());
    let lease = a.allocate(1).unwrap().pop().unwrap();
    // b has a page with the same index and generation, leased too.
    let b_lease = b.allocate(1).unwrap().pop().unwrap();
    assert_eq!(
        (b_lease.page(), b_lease.generation()),
        (lease.page(), lease.generation())
    );
    let wrong = PoolError::WrongPool {
        lease_pool: a.id(),
        pool: b.id(),
    };
    assert_eq!(b.page(&lease, 0), Err(wrong.clone()));
    assert_eq!(b.page_mut(&lease, 0).map(|_| ()), Err(wrong.clone()));
    assert_eq!(b.quarantine(&lease), Err(wrong.clone()));
    let copy = PageLease::from_raw(raw(&lease));
    assert_eq!(b.release(copy), Err(wrong));
    assert_eq!(counts(&b), (1, 1, 0));
    assert!(b.holds(b_lease.page(), b_lease.generation()));
    a.release(lease).unwrap();
    b.release(b_lease).unwrap();
}

#[test]
fn quarantine_counts_and_release_from_quarantine() {
    let p = pool(6, Scrub::None);
    let mut leases = p.allocate(3).unwrap();
    p.quarantine(&leases[0]).unwrap();
    p.quarantine(&leases[1]).unwrap();
    assert_eq!(counts(&p), (3, 1, 2));
    assert_eq!(
        p.state(leases[0].page()),
        Some(PageState::Quarantined {
            generation: leases[0].generation()
        })
    );
    // Quarantined pages are still held (a late write is still attributable to the lease)...
    assert!(p.holds(leases[0].page(), leases[0].generation()));
    // ...but their bytes are not reachable through the lease.
    assert_eq!(
        p.page(&leases[0], 0),
        Err(PoolError::Quarantined {
            page: leases[0].page()
        })
    );
    // Quarantining again is a no-op.
    p.quarantine(&leases[0]).unwrap();
    assert_eq!(counts(&p), (3, 1, 2));
    assert_eq!(p.stats().quarantines, 2);

    let q0 = leases.remove(0);
    let q0_raw = raw(&q0);
    p.release(q0).unwrap();
    assert_eq!(counts(&p), (4, 1, 1));
    // A released lease can no longer be quarantined.
    assert_eq!(
        p.quarantine(&PageLease::from_raw(q0_raw)),
        Err(PoolError::NotLeased { page: q0_raw.page })
    );
    assert_eq!(counts(&p), (4, 1, 1));
    release_all(&p, leases);
    assert_eq!(counts(&p), (6, 0, 0));
    assert_eq!(p.stats().releases, 3);
}

#[test]
fn quarantine_with_stale_lease_is_refused() {
    let p = pool(1, Scrub::None);
    let old = p.allocate(1).unwrap().pop().unwrap();
    let old_raw = raw(&old);
    p.release(old).unwrap();
    let new = p.allocate(1).unwrap().pop().unwrap();
    assert!(matches!(
        p.quarantine(&PageLease::from_raw(old_raw)),
        Err(PoolError::StaleLease { .. })
    ));
    assert_eq!(
        counts(&p),
        (0, 1, 0),
        "stale quarantine moved the new holder's page"
    );
    p.release(new).unwrap();
}

/// Fills every buffer of every page with a per-page, per-buffer pattern via raw access.
fn fill_all(p: &mut PagePool) {
    for page in 0..p.capacity_pages() {
        for buffer in 0..p.buffers() {
            p.raw_page_mut(page, buffer)
                .unwrap()
                .fill(0x10 + (page as u8) * 4 + buffer as u8);
        }
    }
}

fn assert_page(p: &PagePool, page: u32, expect: impl Fn(usize) -> u8, what: &str) {
    for buffer in 0..p.buffers() {
        let bytes = p.raw_page(page, buffer).unwrap();
        assert!(
            bytes.iter().all(|&b| b == expect(buffer)),
            "{what}: page {page} buffer {buffer} = {bytes:02x?}"
        );
    }
}

#[test]
fn scrub_zero_overwrites_all_buffers_on_release() {
    let mut p = pool(3, Scrub::Zero);
    let leases = p.allocate(3).unwrap();
    fill_all(&mut p);
    let mut it = leases.into_iter();
    let (keep, a, q) = (it.next().unwrap(), it.next().unwrap(), it.next().unwrap());
    let (kp, ap, qp) = (keep.page(), a.page(), q.page());
    p.quarantine(&q).unwrap();
    p.release(a).unwrap();
    p.release(q).unwrap();
    assert_page(&p, ap, |_| 0, "zero scrub of a leased page");
    assert_page(&p, qp, |_| 0, "zero scrub of a quarantined page");
    assert_page(&p, kp, |b| 0x10 + (kp as u8) * 4 + b as u8, "neighbour");
    p.release(keep).unwrap();
    assert_page(&p, kp, |_| 0, "zero scrub");
}

#[test]
fn scrub_poison_overwrites_all_buffers_on_release() {
    let mut p = pool(3, Scrub::Poison);
    let leases = p.allocate(3).unwrap();
    fill_all(&mut p);
    let mut it = leases.into_iter();
    let (keep, a, q) = (it.next().unwrap(), it.next().unwrap(), it.next().unwrap());
    let (kp, ap, qp) = (keep.page(), a.page(), q.page());
    p.quarantine(&q).unwrap();
    p.release(a).unwrap();
    p.release(q).unwrap();
    assert_eq!(POISON_BYTE, 0xDB);
    assert_page(&p, ap, |_| POISON_BYTE, "poison scrub of a leased page");
    assert_page(
        &p,
        qp,
        |_| POISON_BYTE,
        "poison scrub of a quarantined page",
    );
    assert_page(&p, kp, |b| 0x10 + (kp as u8) * 4 + b as u8, "neighbour");
    // A re-allocated page shows the poison through its new lease.
    let again = p.allocate(1).unwrap().pop().unwrap();
    for buffer in 0..p.buffers() {
        assert!(p
            .page(&again, buffer)
            .unwrap()
            .iter()
            .all(|&b| b == POISON_BYTE));
    }
    p.release(again).unwrap();
    p.release(keep).unwrap();
}

#[test]
fn scrub_none_leaves_bytes() {
    assert_eq!(Scrub::default(), Scrub::None);
    let mut p = pool(3, Scrub::None);
    let leases = p.allocate(3).unwrap();
    fill_all(&mut p);
    let mut it = leases.into_iter();
    let (keep, a, q) = (it.next().unwrap(), it.next().unwrap(), it.next().unwrap());
    p.quarantine(&q).unwrap();
    p.release(a).unwrap();
    p.release(q).unwrap();
    p.release(keep).unwrap();
    for page in 0..3 {
        assert_page(&p, page, |b| 0x10 + (page as u8) * 4 + b as u8, "no scrub");
    }
}

#[test]
fn failed_release_does_not_scrub() {
    let p = pool(2, Scrub::Zero);
    let lease = p.allocate(1).unwrap().pop().unwrap();
    let page = lease.page();
    let stale = raw(&lease);
    p.release(lease).unwrap();
    p.raw_page_mut(page, 0).unwrap().fill(0xEE);
    assert!(p.release(PageLease::from_raw(stale)).is_err());
    assert!(p.raw_page(page, 0).unwrap().iter().all(|&b| b == 0xEE));
}

#[test]
fn page_access_with_stale_lease_fails() {
    let p = pool(1, Scrub::None);
    let old = p.allocate(1).unwrap().pop().unwrap();
    p.page_mut(&old, 1).unwrap().fill(1);
    let old_raw = raw(&old);
    p.release(old).unwrap();
    let stale = PageLease::from_raw(old_raw);
    // Freed, not yet reused.
    assert_eq!(p.page(&stale, 1), Err(PoolError::NotLeased { page: 0 }));
    let new = p.allocate(1).unwrap().pop().unwrap();
    p.page_mut(&new, 1).unwrap().fill(2);
    let expected = PoolError::StaleLease {
        page: 0,
        lease_generation: old_raw.generation,
        current_generation: new.generation(),
    };
    assert_eq!(p.page(&stale, 1), Err(expected.clone()));
    assert_eq!(p.page_mut(&stale, 1).map(|_| ()), Err(expected));
    assert!(p.page(&new, 1).unwrap().iter().all(|&b| b == 2));
    assert_eq!(p.stats().stale_release_errors, 0, "page() is not a release");
    p.release(new).unwrap();
    // The stale lease is still just data; releasing it is refused.
    assert!(p.release(stale).is_err());
}

#[test]
fn page_views_address_the_leased_slot_in_every_buffer() {
    let p = pool(4, Scrub::None);
    let leases = p.allocate(4).unwrap();
    for (i, lease) in leases.iter().enumerate() {
        for buffer in 0..3 {
            let mut bytes = p.page_mut(lease, buffer).unwrap();
            assert_eq!(bytes.len(), [8, 4, 12][buffer]);
            bytes.fill((i * 3 + buffer) as u8 + 1);
        }
    }
    for (i, lease) in leases.iter().enumerate() {
        for buffer in 0..3 {
            let expect = (i * 3 + buffer) as u8 + 1;
            assert!(p.page(lease, buffer).unwrap().iter().all(|&b| b == expect));
            assert_eq!(
                p.raw_page(lease.page(), buffer).unwrap(),
                p.page(lease, buffer).unwrap()
            );
        }
    }
    let l = &leases[0];
    assert_eq!(
        p.page(l, 3),
        Err(PoolError::BufferOutOfRange {
            buffer: 3,
            buffers: 3
        })
    );
    assert!(p.raw_page(4, 0).is_none());
    assert!(p.raw_page(0, 3).is_none());
    release_all(&p, leases);
}

#[test]
fn forged_leases_are_refused() {
    let p = pool(2, Scrub::None);
    let live = p.allocate(1).unwrap().pop().unwrap();
    let id = p.id();
    let forge = |page, generation| {
        PageLease::from_raw(RawLease {
            pool_id: id,
            page,
            generation,
            holder: Holder::Caller,
        })
    };
    assert_eq!(
        p.release(forge(live.page(), live.generation() + 7)),
        Err(PoolError::StaleLease {
            page: live.page(),
            lease_generation: live.generation() + 7,
            current_generation: live.generation()
        })
    );
    let free_page = 1 - live.page();
    assert_eq!(
        p.release(forge(free_page, 0)),
        Err(PoolError::NotLeased { page: free_page })
    );
    assert_eq!(
        p.release(forge(2, 0)),
        Err(PoolError::PageOutOfRange { page: 2, pages: 2 })
    );
    assert_eq!(
        p.release(forge(u32::MAX, 0)),
        Err(PoolError::PageOutOfRange {
            page: u32::MAX,
            pages: 2
        })
    );
    assert!(matches!(
        p.release(PageLease::from_raw(RawLease {
            pool_id: 0,
            page: 0,
            generation: 0,
            holder: Holder::Caller,
        })),
        Err(PoolError::WrongPool { lease_pool: 0, .. })
    ));
    assert_eq!(counts(&p), (1, 1, 0));
    assert_eq!(p.stats().stale_release_errors, 5);
    assert!(!p.holds(free_page, 0));
    assert!(!p.holds(2, 0));
    p.release(live).unwrap();
}

#[test]
fn geometry_validation() {
    let ok = geometry(3);
    assert!(PagePool::new(ok.clone(), Scrub::None).is_ok());
    let cases = [
        (
            "no buffers",
            PoolGeometry {
                buffer_page_bytes: vec![],
                ..ok.clone()
            },
        ),
        (
            "no pages",
            PoolGeometry {
                pages: 0,
                ..ok.clone()
            },
        ),
        (
            "no tokens per page",
            PoolGeometry {
                tokens_per_page: 0,
                ..ok.clone()
            },
        ),
        (
            "zero-byte page",
            PoolGeometry {
                buffer_page_bytes: vec![8, 0, 12],
                ..ok.clone()
            },
        ),
        (
            "size overflow",
            PoolGeometry {
                buffer_page_bytes: vec![u32::MAX; 8],
                pages: u32::MAX,
                ..ok.clone()
            },
        ),
    ];
    for (what, g) in cases {
        match PagePool::new(g, Scrub::None) {
            Err(PoolError::BadGeometry(msg)) => assert!(!msg.is_empty(), "{what}"),
            other => panic!("{what}: expected BadGeometry, got {other:?}"),
        }
    }
}

#[test]
fn geometry_arithmetic_and_layout() {
    let g = geometry(10);
    assert_eq!(g.capacity_tokens(), 160);
    assert_eq!(g.pages_for_tokens(160), Some(10));
    assert_eq!(g.pages_for_tokens(161), Some(11));
    assert_eq!(g.bytes_per_page_index(), 24);
    assert_eq!(g.total_bytes(), Some(240));
    let layout = g.to_layout(vec![1, 2, 3]);
    assert_eq!(layout.tokens_per_page, 16);
    assert_eq!(layout.buffer_page_bytes, vec![8, 4, 12]);
    assert_eq!(layout.fingerprint, vec![1, 2, 3]);
    let p = PagePool::new(g.clone(), Scrub::None).unwrap();
    assert_eq!(p.geometry(), &g);
    assert_eq!(p.capacity_pages(), 10);
    assert_eq!(p.capacity_tokens(), 160);
    for buffer in 0..3 {
        assert_eq!(
            p.memory().region(buffer).unwrap().1,
            g.buffer_page_bytes[buffer] as usize * 10
        );
        for page in 0..10 {
            let bytes = p.raw_page(page, buffer).unwrap();
            assert_eq!(bytes.len(), g.buffer_page_bytes[buffer] as usize);
            assert!(bytes.iter().all(|&b| b == 0), "pool not zeroed");
        }
    }
}

// ---------------------------------------------------------------------------------------
// Model test
// ---------------------------------------------------------------------------------------

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ModelState {
    Free,
    Leased,
    Quarantined,
}

#[derive(Clone, Debug)]
enum Op {
    Allocate(u32),
    Quarantine(usize),
    Release(usize),
    /// Release again a lease that was already released (double or stale release).
    Replay(usize),
    /// Release a lease built from arbitrary data.
    Forge {
        page: u32,
        generation: u32,
        foreign: bool,
    },
    /// Check that every live, unquarantined lease still sees the bytes it wrote.
    CheckData,
}

fn op_strategy(pages: u32) -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0..=pages + 1).prop_map(Op::Allocate),
        1 => any::<usize>().prop_map(Op::Quarantine),
        3 => any::<usize>().prop_map(Op::Release),
        2 => any::<usize>().prop_map(Op::Replay),
        1 => (0..pages + 2, 0u32..4, any::<bool>())
            .prop_map(|(page, generation, foreign)| Op::Forge { page, generation, foreign }),
        1 => Just(Op::CheckData),
    ]
}

fn pattern(tag: u32, buffer: usize, len: usize) -> Vec<u8> {
    let t = tag.to_le_bytes();
    (0..len)
        .map(|i| t[i % 4] ^ (buffer as u8).wrapping_mul(0x35))
        .collect()
}

/// The error the model predicts for releasing `raw` into a pool in state `model`.
fn expected_error(
    pool: &PagePool,
    model: &[(ModelState, u32)],
    raw: RawLease,
) -> Option<PoolError> {
    if raw.pool_id != pool.id() {
        return Some(PoolError::WrongPool {
            lease_pool: raw.pool_id,
            pool: pool.id(),
        });
    }
    let Some(&(state, generation)) = model.get(raw.page as usize) else {
        return Some(PoolError::PageOutOfRange {
            page: raw.page,
            pages: model.len() as u32,
        });
    };
    if state == ModelState::Free {
        return Some(PoolError::NotLeased { page: raw.page });
    }
    if generation != raw.generation {
        return Some(PoolError::StaleLease {
            page: raw.page,
            lease_generation: raw.generation,
            current_generation: generation,
        });
    }
    None
}

const MODEL_PAGES: u32 = 6;

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn pool_matches_model(ops in proptest::collection::vec(op_strategy(MODEL_PAGES), 0..120)) {
        let mut p = pool(MODEL_PAGES, Scrub::Poison);
        let other = pool(1, Scrub::None);
        // (state, current generation) per page.
        let mut model = vec![(ModelState::Free, 0u32); MODEL_PAGES as usize];
        // Live leases with the tag their pages were filled with.
        let mut held: Vec<(PageLease, u32)> = Vec::new();
        let mut released: Vec<RawLease> = Vec::new();
        let mut next_tag = 1u32;
        let (mut releases, mut refused) = (0u64, 0u64);

        for op in ops {
            match op {
                Op::Allocate(n) => {
                    let free = model.iter().filter(|s| s.0 == ModelState::Free).count() as u32;
                    match p.allocate(n) {
                        Ok(leases) => {
                            prop_assert!(n <= free);
                            prop_assert_eq!(leases.len(), n as usize);
                            for lease in leases {
                                let slot = &mut model[lease.page() as usize];
                                prop_assert_eq!(slot.0, ModelState::Free, "page {} handed out while not free", lease.page());
                                prop_assert_eq!(slot.1, lease.generation());
                                prop_assert_eq!(lease.pool_id(), p.id());
                                slot.0 = ModelState::Leased;
                                for buffer in 0..p.buffers() {
                                    let mut bytes = p.page_mut(&lease, buffer).unwrap();
                                    let len = bytes.len();
                                    bytes.copy_from_slice(&pattern(next_tag, buffer, len));
                                }
                                held.push((lease, next_tag));
                                next_tag += 1;
                            }
                        }
                        Err(e) => {
                            prop_assert!(n > free);
                            prop_assert_eq!(e, PoolError::Exhausted { requested: n, free });
                        }
                    }
                }
                Op::Quarantine(i) => {
                    if held.is_empty() { continue; }
                    let (lease, _) = &held[i % held.len()];
                    p.quarantine(lease).unwrap();
                    model[lease.page() as usize].0 = ModelState::Quarantined;
                }
                Op::Release(i) => {
                    if held.is_empty() { continue; }
                    let (lease, _) = held.swap_remove(i % held.len());
                    let r = raw(&lease);
                    p.release(lease).unwrap();
                    releases += 1;
                    let slot = &mut model[r.page as usize];
                    *slot = (ModelState::Free, slot.1.wrapping_add(1));
                    released.push(r);
                }
                Op::Replay(i) => {
                    if released.is_empty() { continue; }
                    let r = released[i % released.len()];
                    let expected = expected_error(&p, &model, r);
                    prop_assert!(expected.is_some(), "a released lease is current again: {:?}", r);
                    prop_assert_eq!(p.release(PageLease::from_raw(r)).err(), expected);
                    refused += 1;
                }
                Op::Forge { page, generation, foreign } => {
                    let r = RawLease {
                        pool_id: if foreign { other.id() } else { p.id() },
                        page,
                        generation,
                        holder: Holder::Caller,
                    };
                    let Some(expected) = expected_error(&p, &model, r) else {
                        // A copy of a live lease: releasing it would be legitimate.
                        continue;
                    };
                    prop_assert_eq!(p.release(PageLease::from_raw(r)), Err(expected));
                    refused += 1;
                }
                Op::CheckData => {
                    for (lease, tag) in &held {
                        if model[lease.page() as usize].0 != ModelState::Leased { continue; }
                        for buffer in 0..p.buffers() {
                            let bytes = p.page(lease, buffer).unwrap();
                            let expected = pattern(*tag, buffer, bytes.len());
                            prop_assert_eq!(&*bytes, &expected[..],
                                "page {} buffer {} lost its data", lease.page(), buffer);
                        }
                    }
                }
            }

            // Counts agree with the model.
            let count = |s| model.iter().filter(|m| m.0 == s).count() as u32;
            let expect = (count(ModelState::Free), count(ModelState::Leased), count(ModelState::Quarantined));
            prop_assert_eq!(counts(&p), expect);
            let stats = p.stats();
            prop_assert_eq!((stats.free, stats.leased, stats.quarantined), expect);
            prop_assert_eq!((stats.releases, stats.stale_release_errors), (releases, refused));
            // No page is leased twice concurrently, and every live lease is held.
            let pages: HashSet<u32> = held.iter().map(|(l, _)| l.page()).collect();
            prop_assert_eq!(pages.len(), held.len(), "two live leases share a page");
            prop_assert_eq!(held.len() as u32, expect.1 + expect.2);
            for (lease, _) in &held {
                prop_assert!(p.holds(lease.page(), lease.generation()));
            }
            for (page, &(state, generation)) in model.iter().enumerate() {
                let expected = match state {
                    ModelState::Free => PageState::Free,
                    ModelState::Leased => PageState::Leased { generation },
                    ModelState::Quarantined => PageState::Quarantined { generation },
                };
                prop_assert_eq!(p.state(page as u32), Some(expected));
            }
        }

        // Whatever happened, the pool can be drained without handing a page out twice.
        let live: Vec<PageLease> = held.into_iter().map(|(l, _)| l).collect();
        let rest = drain_and_check_distinct(&mut p);
        let mut all: Vec<u32> = live.iter().chain(rest.iter()).map(PageLease::page).collect();
        all.sort_unstable();
        prop_assert_eq!(all, (0..MODEL_PAGES).collect::<Vec<_>>());
        release_all(&p, live);
        release_all(&p, rest);
    }
}

// ---------------------------------------------------------------------------------------
// Engine configuration against the pool as built
// ---------------------------------------------------------------------------------------

fn sized_pool(pages: u32, tokens_per_page: u32) -> PagePool {
    PagePool::new(
        PoolGeometry {
            tokens_per_page,
            buffer_page_bytes: vec![2, 2],
            pages,
        },
        Scrub::None,
    )
    .unwrap()
}

#[test]
fn pool_smaller_than_context_refuses_to_start() {
    let p = sized_pool(500, 16); // 8000 tokens
    let config = {
        let mut c = EngineConfig::new(32768);
        c.allow_undersized_pool = false;
        c
    };
    let err = config.validate(&p).unwrap_err();
    assert!(matches!(
        err,
        ConfigError::PoolSmallerThanContext {
            pool_tokens: 8000,
            context_tokens: 32768,
            pages: 500,
            tokens_per_page: 16
        }
    ));
    let msg = err.to_string();
    assert!(msg.contains("8000"), "{msg}");
    assert!(msg.contains("32768"), "{msg}");
}

#[test]
fn undersized_pool_override_gives_warning() {
    let p = sized_pool(500, 16);
    let config = {
        let mut c = EngineConfig::new(32768);
        c.allow_undersized_pool = true;
        c
    };
    assert_eq!(
        config.validate(&p),
        Ok(vec![ConfigWarning::PoolSmallerThanContext {
            pool_tokens: 8000,
            context_tokens: 32768
        }])
    );
}

#[test]
fn exact_equal_capacity_passes() {
    let p = sized_pool(2048, 16);
    for allow_undersized_pool in [false, true] {
        let mut config = EngineConfig::new(32768);
        config.allow_undersized_pool = allow_undersized_pool;
        assert_eq!(config.validate(&p), Ok(vec![]));
    }
    let one_more = {
        let mut c = EngineConfig::new(32769);
        c.allow_undersized_pool = false;
        c
    };
    assert!(one_more.validate(&p).is_err());
}

#[test]
fn zero_context_refuses_to_start() {
    let p = sized_pool(1, 1);
    let config = {
        let mut c = EngineConfig::new(0);
        c.allow_undersized_pool = true;
        c
    };
    assert_eq!(config.validate(&p), Err(ConfigError::ZeroContext));
}

/// A page a digest job reads (a live `SharedPages` view) cannot be written or released: the
/// pool refuses, changes nothing, and accepts again once the view is gone.
#[test]
fn pages_pinned_by_a_shared_view_are_never_written_or_released() {
    let p = pool(8, Scrub::Poison);
    let mut leases = p.allocate(2).unwrap();
    p.page_mut(&leases[0], 0).unwrap().fill(0x11);
    let view = p
        .share_pages(vec![leases[0].page(), leases[1].page()])
        .unwrap();
    assert!(p.pinned(leases[0].page()));
    assert!(matches!(
        p.page_mut(&leases[0], 0),
        Err(PoolError::Pinned { .. })
    ));
    assert!(p.raw_page_mut(leases[0].page(), 1).is_none());
    let second = leases.pop().unwrap();
    let first = leases.pop().unwrap();
    let (page, generation) = (first.page(), first.generation());
    assert!(matches!(p.release(first), Err(PoolError::Pinned { .. })));
    // Nothing changed: still leased under the same generation, bytes not scrubbed.
    assert!(p.holds(page, generation));
    assert!(view.page(0, 0).iter().all(|&b| b == 0x11));
    // The view crosses threads; dropping it there unpins.
    std::thread::spawn(move || assert!(view.page(0, 0).iter().all(|&b| b == 0x11)))
        .join()
        .unwrap();
    assert!(!p.pinned(page));
    p.release(PageLease::from_raw(RawLease {
        pool_id: p.id(),
        page,
        generation,
        holder: Holder::Caller,
    }))
    .unwrap();
    p.release(second).unwrap();
    assert_eq!(p.free_pages(), 8);
}

#[test]
fn a_shared_view_outlives_its_pool() {
    let p = pool(4, Scrub::None);
    let lease = p.allocate(1).unwrap().pop().unwrap();
    p.page_mut(&lease, 1).unwrap().fill(0x5a);
    let view = p.share_pages(vec![lease.page()]).unwrap();
    drop(p);
    assert!(view.page(0, 1).iter().all(|&b| b == 0x5a));
    drop(lease);
}

#[test]
fn a_pool_over_caller_memory_uses_it_in_place() {
    let g = geometry(4);
    let buffers: Vec<Box<[u8]>> = (0..g.buffers())
        .map(|b| vec![b as u8 + 1; g.buffer_len(b).unwrap()].into_boxed_slice())
        .collect();
    let memory = kvwire::memory::KvMemory::from_buffers(&g, buffers).unwrap();
    let p = PagePool::with_memory(g.clone(), memory, Scrub::None).unwrap();
    let lease = p.allocate(1).unwrap().pop().unwrap();
    assert!(
        p.page(&lease, 1).unwrap().iter().all(|&b| b == 2),
        "not the caller's bytes"
    );
    p.release(lease).unwrap();
    let wrong = kvwire::memory::KvMemory::allocate(&geometry(8)).unwrap();
    assert!(matches!(
        PagePool::with_memory(g, wrong, Scrub::None),
        Err(PoolError::BadGeometry(_))
    ));
}

#[test]
fn engine_chosen_pages_are_leased_exactly_and_never_twice() {
    let p = pool(8, Scrub::None);
    let leases = p.lease_pages(&[5, 2, 7]).unwrap();
    assert_eq!(
        leases.iter().map(PageLease::page).collect::<Vec<_>>(),
        vec![5, 2, 7]
    );
    assert_eq!(counts(&p), (5, 3, 0));
    // A page already leased (by anyone) is refused, and nothing of the request is leased.
    assert_eq!(
        p.lease_pages(&[1, 2]),
        Err(PoolError::AlreadyLeased {
            page: 2,
            holders: vec![Holder::Caller]
        })
    );
    assert_eq!(
        p.lease_pages(&[1, 1]),
        Err(PoolError::DuplicatePage { page: 1 })
    );
    assert_eq!(
        p.lease_pages(&[1, 8]),
        Err(PoolError::PageOutOfRange { page: 8, pages: 8 })
    );
    assert_eq!(counts(&p), (5, 3, 0));
    // The embedded allocator never hands out a page the engine leased.
    let rest = p.allocate(5).unwrap();
    let mut all: Vec<u32> = rest.iter().chain(&leases).map(PageLease::page).collect();
    all.sort_unstable();
    assert_eq!(all, (0..8).collect::<Vec<_>>());
    assert!(p.allocate(1).is_err());
    release_all(&p, rest);
    release_all(&p, leases);
    assert_eq!(counts(&p), (8, 0, 0));
    // Released pages can be chosen again.
    release_all(&p, p.lease_pages(&[2, 5]).unwrap());
}

/// The engine's source pages are read by outgoing transfers: several at once (the same prefix
/// page sent to two peers), never while a reservation holds them, and free only when the last
/// reader is done.
#[test]
fn source_pages_are_shared_by_readers_and_free_after_the_last() {
    use kvwire::TransferId;
    let p = pool(8, Scrub::Poison);
    let (a, b) = (
        Holder::Sending(TransferId(1)),
        Holder::Sending(TransferId(2)),
    );
    let first = p.lease_for_reading(&[3, 4], a).unwrap();
    let second = p.lease_for_reading(&[4, 5], b).unwrap();
    assert_eq!(p.holders(3), vec![a]);
    assert_eq!(p.holders(4), vec![a, b]);
    assert_eq!(
        p.state(4),
        Some(PageState::Reading {
            generation: 0,
            readers: 2
        })
    );
    assert_eq!(p.reading_pages(), 3);
    // Readers read; nobody writes through a shared lease.
    assert!(p.page(&first[1], 0).is_ok());
    assert_eq!(
        p.page_mut(&first[1], 0).unwrap_err(),
        PoolError::SharedLease { page: 4 }
    );
    // A reservation cannot take a page being read, and says who reads it.
    assert_eq!(
        p.lease_pages_for(&[6, 4], Holder::Receiving(TransferId(9))),
        Err(PoolError::AlreadyLeased {
            page: 4,
            holders: vec![a, b]
        })
    );
    assert_eq!(
        p.holders(6),
        vec![],
        "nothing of a refused request is leased"
    );
    // The engine may not free a page in flight.
    assert_eq!(
        p.check_engine_free(&[2, 4]),
        Err(PoolError::HeldByKvwire {
            page: 4,
            holders: vec![a, b]
        })
    );
    for l in first {
        p.release(l).unwrap();
    }
    assert_eq!(p.holders(4), vec![b], "the other reader still holds page 4");
    assert_eq!(p.holders(3), vec![]);
    assert!(p.check_engine_free(&[3]).is_ok());
    assert!(p.check_engine_free(&[4]).is_err());
    for l in second {
        p.release(l).unwrap();
    }
    assert_eq!(p.state(4), Some(PageState::Free));
    assert_eq!(p.reading_pages(), 0);
    assert_eq!(p.free_pages(), 8);
    assert!(p.held_pages().is_empty());
    // Released pages went through the scrub and a new generation.
    assert_eq!(p.raw_page(4, 0).unwrap()[0], POISON_BYTE);
    let again = p
        .lease_pages_for(&[4], Holder::Receiving(TransferId(3)))
        .unwrap();
    assert_eq!(again[0].generation(), 1);
    assert_eq!(
        p.held_pages(),
        vec![(4, vec![Holder::Receiving(TransferId(3))])]
    );
    // A page leased for a reservation cannot be read by a sender either.
    assert!(matches!(
        p.lease_for_reading(&[4], a),
        Err(PoolError::AlreadyLeased { page: 4, .. })
    ));
    p.release(again.into_iter().next().unwrap()).unwrap();
}

/// A shared read lease cannot be quarantined (quarantine is the destination side's), and a
/// reader that releases twice (a forged copy) is refused once the page is free.
#[test]
fn shared_leases_refuse_quarantine_and_double_release() {
    use kvwire::TransferId;
    let p = pool(2, Scrub::None);
    let mut l = p
        .lease_for_reading(&[1], Holder::Sending(TransferId(5)))
        .unwrap();
    let lease = l.pop().unwrap();
    assert_eq!(
        p.quarantine(&lease),
        Err(PoolError::SharedLease { page: 1 })
    );
    let copy = raw(&lease);
    p.release(lease).unwrap();
    assert_eq!(
        p.release(PageLease::from_raw(copy)),
        Err(PoolError::NotLeased { page: 1 })
    );
}
