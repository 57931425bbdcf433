//! Unit tests of the page pool (its free list, slot table and counters).
use super::*;
use crate::memory::RawLease;
use proptest::prelude::*;

fn geometry(pages: u32) -> PoolGeometry {
    PoolGeometry {
        tokens_per_page: 4,
        buffer_page_bytes: vec![8, 3],
        pages,
    }
}

fn pool(pages: u32, scrub: Scrub) -> PagePool {
    PagePool::new(geometry(pages), scrub).unwrap()
}

#[test]
fn new_pool_is_zeroed_free_and_hands_out_page_zero_first() {
    let p = pool(3, Scrub::None);
    p.assert_invariants();
    assert_ne!(p.id(), 0);
    for page in 0..3 {
        assert_eq!(&*p.raw_page(page, 0).unwrap(), &[0u8; 8][..]);
        assert_eq!(&*p.raw_page(page, 1).unwrap(), &[0u8; 3][..]);
    }
    assert!(p.raw_page(0, 2).is_none());
    assert_eq!((p.free_pages(), p.capacity_pages()), (3, 3));
    assert_eq!(p.capacity_tokens(), 12);
    let l = p.allocate(1).unwrap();
    assert_eq!(
        (l[0].page(), l[0].generation(), l[0].pool_id()),
        (0, 0, p.id())
    );
    p.release(l.into_iter().next().unwrap()).unwrap();
}

#[test]
fn pool_ids_are_unique() {
    let a = pool(1, Scrub::None);
    let b = pool(1, Scrub::None);
    assert_ne!(a.id(), b.id());
}

#[test]
fn slots_do_not_overlap() {
    let p = pool(3, Scrub::None);
    for page in 0..3u32 {
        for buffer in 0..2 {
            let fill = (page * 10) as u8 + buffer as u8 + 1;
            p.raw_page_mut(page, buffer).unwrap().fill(fill);
        }
    }
    for page in 0..3u32 {
        for buffer in 0..2 {
            let fill = (page * 10) as u8 + buffer as u8 + 1;
            let bytes = p.raw_page(page, buffer).unwrap();
            assert_eq!(bytes.len(), [8, 3][buffer]);
            assert!(bytes.iter().all(|&b| b == fill));
        }
    }
    assert!(p.raw_page(3, 0).is_none());
    assert!(p.raw_page(0, 2).is_none());
    assert!(p.raw_page_mut(3, 0).is_none());
}

#[test]
fn release_bumps_generation_and_frees_only_once() {
    let p = pool(1, Scrub::None);
    let lease = p.allocate(1).unwrap().pop().unwrap();
    let raw = RawLease {
        pool_id: lease.pool_id(),
        page: lease.page(),
        generation: lease.generation(),
        holder: lease.holder(),
    };
    assert!(p.holds(0, 0));
    p.release(lease).unwrap();
    assert_eq!(p.state(0), Some(PageState::Free));
    assert!(!p.holds(0, 0));
    assert_eq!(
        p.release(PageLease::from_raw(raw)),
        Err(PoolError::NotLeased { page: 0 })
    );
    p.assert_invariants();
    let again = p.allocate(1).unwrap().pop().unwrap();
    assert_eq!(again.generation(), 1);
    assert_eq!(
        p.release(PageLease::from_raw(raw)),
        Err(PoolError::StaleLease {
            page: 0,
            lease_generation: 0,
            current_generation: 1
        })
    );
    p.assert_invariants();
    assert_eq!(p.stats().stale_release_errors, 2);
    p.release(again).unwrap();
}

#[test]
fn generation_wraps() {
    let p = pool(1, Scrub::None);
    p.table().slots[0].generation = u32::MAX;
    let lease = p.allocate(1).unwrap().pop().unwrap();
    assert_eq!(lease.generation(), u32::MAX);
    p.release(lease).unwrap();
    assert_eq!(p.allocate(1).unwrap()[0].generation(), 0);
}

#[test]
fn quarantined_page_is_not_usable_through_its_lease() {
    let p = pool(2, Scrub::None);
    let lease = p.allocate(1).unwrap().pop().unwrap();
    p.quarantine(&lease).unwrap();
    assert_eq!(
        p.page(&lease, 0).map(|_| ()),
        Err(PoolError::Quarantined { page: 0 })
    );
    assert_eq!(
        p.page_mut(&lease, 0).map(|_| ()),
        Err(PoolError::Quarantined { page: 0 })
    );
    assert_eq!(
        p.check_lease(&lease),
        Ok(PageState::Quarantined { generation: 0 })
    );
    assert!(p.holds(0, 0));
    p.release(lease).unwrap();
    p.assert_invariants();
}

#[test]
fn buffer_out_of_range() {
    let p = pool(1, Scrub::None);
    let lease = p.allocate(1).unwrap().pop().unwrap();
    assert_eq!(
        p.page(&lease, 2).map(|_| ()),
        Err(PoolError::BufferOutOfRange {
            buffer: 2,
            buffers: 2
        })
    );
    assert!(p.page_mut(&lease, 5).is_err());
    p.release(lease).unwrap();
}

#[test]
fn forged_out_of_range_lease_is_refused() {
    let p = pool(2, Scrub::None);
    let forged = PageLease::from_raw(RawLease {
        pool_id: p.id(),
        page: 2,
        generation: 0,
        holder: Holder::Caller,
    });
    assert_eq!(
        p.page(&forged, 0).map(|_| ()),
        Err(PoolError::PageOutOfRange { page: 2, pages: 2 })
    );
    assert_eq!(
        p.quarantine(&forged),
        Err(PoolError::PageOutOfRange { page: 2, pages: 2 })
    );
    assert_eq!(
        p.release(forged),
        Err(PoolError::PageOutOfRange { page: 2, pages: 2 })
    );
    assert_eq!(p.state(2), None);
    assert!(!p.holds(2, 0));
    p.assert_invariants();
}

#[test]
fn huge_geometry_fails_cleanly() {
    // Addressable on paper (fits isize), but far more than any machine has.
    let g = PoolGeometry {
        tokens_per_page: 1,
        buffer_page_bytes: vec![u32::MAX],
        pages: u32::MAX / 4,
    };
    match PagePool::new(g, Scrub::None) {
        Err(PoolError::OutOfMemory { .. } | PoolError::BadGeometry(_)) => {}
        other => panic!("expected an allocation error, got {other:?}"),
    }
}

#[derive(Clone, Debug)]
enum Op {
    Allocate(u32),
    Quarantine(usize),
    Release(usize),
    Replay(usize),
    Forge(u32, u32),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (0u32..5).prop_map(Op::Allocate),
        any::<usize>().prop_map(Op::Quarantine),
        any::<usize>().prop_map(Op::Release),
        any::<usize>().prop_map(Op::Replay),
        (0u32..10, 0u32..4).prop_map(|(p, g)| Op::Forge(p, g)),
    ]
}

proptest! {
    /// Whatever the sequence of operations, including replayed and forged leases, the
    /// free list, slot table and counters stay consistent.
    #[test]
    fn invariants_hold_under_any_sequence(ops in proptest::collection::vec(op(), 0..80)) {
        let p = pool(8, Scrub::Poison);
        let mut held: Vec<PageLease> = Vec::new();
        let mut released: Vec<RawLease> = Vec::new();
        for op in ops {
            match op {
                Op::Allocate(n) => {
                    if let Ok(leases) = p.allocate(n) {
                        held.extend(leases);
                    }
                }
                Op::Quarantine(i) if !held.is_empty() => {
                    let i = i % held.len();
                    p.quarantine(&held[i]).unwrap();
                }
                Op::Release(i) if !held.is_empty() => {
                    let lease = held.swap_remove(i % held.len());
                    released.push(RawLease { pool_id: lease.pool_id(), page: lease.page(), generation: lease.generation(), holder: lease.holder() });
                    p.release(lease).unwrap();
                }
                Op::Replay(i) if !released.is_empty() => {
                    let raw = released[i % released.len()];
                    prop_assert!(p.release(PageLease::from_raw(raw)).is_err());
                }
                Op::Forge(page, generation) => {
                    let current = held.iter().any(|l| l.page() == page && l.generation() == generation);
                    let forged = PageLease::from_raw(RawLease { pool_id: p.id(), page, generation, holder: Holder::Caller });
                    if !current {
                        prop_assert!(p.release(forged).is_err());
                    }
                }
                _ => {}
            }
            p.assert_invariants();
        }
    }
}
