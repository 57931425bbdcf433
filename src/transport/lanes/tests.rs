//! LaneSet: scopes, fences, the lane map, per-lane heartbeats.

use super::*;
use crate::memory::{PagePool, PoolGeometry, Scrub};
use crate::transport::loopback;

fn pool() -> Arc<PagePool> {
    Arc::new(
        PagePool::new(
            PoolGeometry {
                tokens_per_page: 1,
                buffer_page_bytes: vec![8],
                pages: 8,
            },
            Scrub::None,
        )
        .unwrap(),
    )
}

/// Reservations take the lanes round robin; a transfer reserved again on another lane
/// has its old scope closed there first (as one table would); the fence reaches the lane
/// that holds the scope, however the reservations went round.
#[test]
fn scopes_go_round_robin_and_a_fence_reaches_the_scopes_lane() {
    let (a, b) = (pool(), pool());
    let lanes: Vec<_> = (0..3)
        .map(|_| loopback::connect(a.clone(), b.clone(), std::time::Duration::ZERO).1)
        .collect();
    let mut r = LaneSet::receiver(lanes).with_first_lane(1);
    let t = |id| TransferRef {
        transfer_id: TransferId(id),
        nonce: 1,
    };
    r.open_scope(TransferId(1), &[0]).unwrap();
    r.open_scope(TransferId(2), &[1]).unwrap();
    let per_lane = |r: &LaneSet<_>| -> Vec<usize> {
        r.lanes()
            .iter()
            .map(ReceiverTransport::open_scopes)
            .collect()
    };
    assert_eq!(per_lane(&r), vec![0, 1, 1]);
    // Transfer 1 again: lane 0 now; its scope on lane 1 is closed first.
    r.open_scope(TransferId(1), &[2]).unwrap();
    assert_eq!(per_lane(&r), vec![1, 0, 1]);
    assert_eq!(r.fence(t(1)), Fence::Done);
    assert_eq!(r.fence(t(2)), Fence::Done);
    assert_eq!(per_lane(&r), vec![0, 0, 0]);
    assert_eq!(r.open_scopes(), 0);
}

/// Regression (review): full, the map evicted the lowest transfer id, so with random ids
/// (SGLang's rooms) a new transfer lost its lane while still sending. It evicts in
/// arrival order: the latest `LANE_MAP_CAPACITY` transfers keep theirs, whatever their ids.
#[test]
fn a_full_lane_map_forgets_the_oldest_transfer_not_the_lowest_id() {
    let mut m = LaneMap::default();
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let mut ids = Vec::new();
    for _ in 0..LANE_MAP_CAPACITY + 1000 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        ids.push(TransferId(x));
        m.set(TransferId(x), 1 + (x % 3) as usize);
    }
    // Small ids arriving late keep their lane.
    m.set(TransferId(1), 2);
    assert_eq!(m.get(TransferId(1)), 2);
    for &id in &ids[ids.len() - LANE_MAP_CAPACITY + 1..] {
        assert_eq!(m.get(id), 1 + (id.0 % 3) as usize, "{id:?} lost its lane");
    }
    assert_eq!(m.get(ids[0]), 0, "the oldest is forgotten");
    assert!(m.lanes.len() <= LANE_MAP_CAPACITY);
    // Setting one transfer over and over does not grow the order without bound.
    for _ in 0..3 * LANE_MAP_CAPACITY {
        m.set(TransferId(1), 1);
    }
    assert!(m.order.len() <= 2 * LANE_MAP_CAPACITY);
    assert_eq!(m.get(TransferId(1)), 1);
}

/// Three loopback lanes: the senders alone, and the receivers as one [`LaneSet`].
fn three_lanes() -> (
    Vec<loopback::LoopbackSender>,
    LaneSet<loopback::LoopbackReceiver>,
) {
    let (a, b) = (pool(), pool());
    let (senders, receivers): (Vec<_>, Vec<_>) = (0..3)
        .map(|_| loopback::connect(a.clone(), b.clone(), Duration::ZERO))
        .unzip();
    (senders, LaneSet::receiver(receivers))
}

/// Every event `t` has ready at `now`.
fn drain<T: Transport>(t: &mut T, now: Instant) -> Vec<TransportEvent> {
    let mut cx = Context::from_waker(std::task::Waker::noop());
    let mut got = Vec::new();
    while let Poll::Ready(e) = t.poll_event(&mut cx, now) {
        let closed = matches!(e, TransportEvent::Closed(_));
        got.push(e);
        if closed {
            break;
        }
    }
    got
}

/// A PING goes out on every lane; each PONG goes back on the lane its PING came in on, in
/// the order the PINGs arrived (SPEC §9.1, several streams).
#[test]
fn a_ping_goes_on_every_lane_and_each_pong_on_the_lane_of_its_ping() {
    let (mut senders, mut r) = three_lanes();
    let now = Instant::now();
    r.send_frame(now, &Frame::Ping(9));
    for (i, s) in senders.iter_mut().enumerate() {
        let got = drain(s, now);
        assert!(
            matches!(&got[..], [TransportEvent::Frame(Frame::Ping(9))]),
            "lane {i}: {got:?}"
        );
    }
    senders[2].send_frame(now, &Frame::Ping(1));
    senders[1].send_frame(now, &Frame::Ping(2));
    let tokens: Vec<u64> = drain(&mut r, now)
        .into_iter()
        .map(|e| match e {
            TransportEvent::Frame(Frame::Ping(t)) => t,
            other => panic!("{other:?}"),
        })
        .collect();
    assert_eq!(tokens.len(), 2, "{tokens:?}");
    // The driver answers in the order it got them.
    for &t in &tokens {
        r.send_frame(now, &Frame::Pong(t));
    }
    assert!(
        drain(&mut senders[0], now).is_empty(),
        "no PING came on lane 0"
    );
    for (lane, token) in [(1, 2), (2, 1)] {
        let got = drain(&mut senders[lane], now);
        assert!(
            matches!(&got[..], [TransportEvent::Frame(Frame::Pong(t))] if *t == token),
            "lane {lane}: {got:?}"
        );
    }
}

/// A lane the peer is silent on while the others are heard closes the connection as
/// unresponsive once it has been silent for the limit, not before; without a limit, never.
#[test]
fn a_lane_silent_while_the_others_are_heard_ends_the_connection_as_unresponsive() {
    let limit = Duration::from_millis(100);
    for judged in [true, false] {
        let (mut senders, r) = three_lanes();
        let mut r = if judged {
            r.with_silence_limit(limit)
        } else {
            r
        };
        let t0 = Instant::now();
        let mut closed_at = None;
        for k in 0..12u32 {
            let now = t0 + k * Duration::from_millis(20);
            // Lanes 0 and 1 carry the peer's heartbeats; lane 2 went silent.
            for s in &mut senders[..2] {
                s.send_frame(now, &Frame::Ping(u64::from(k)));
            }
            let got = drain(&mut r, now);
            if let Some(TransportEvent::Closed(why)) = got.last() {
                assert!(
                    matches!(why, Closed::Unresponsive { silent_for } if *silent_for >= limit),
                    "{why:?}"
                );
                closed_at = Some(now - t0);
                break;
            }
        }
        if judged {
            let at = closed_at.expect("the silent lane was never found");
            assert!(
                at >= limit && at <= limit + Duration::from_millis(40),
                "{at:?}"
            );
        } else {
            assert_eq!(closed_at, None, "no limit, no verdict");
        }
    }
}

/// A pass that comes long after the one before (this node did not run) restarts every
/// lane's count: what the peer sent may still be waiting on the silent-looking lane.
#[test]
fn a_local_stall_restarts_the_lanes_counts() {
    let limit = Duration::from_millis(100);
    let (mut senders, r) = three_lanes();
    let mut r = r.with_silence_limit(limit);
    let t0 = Instant::now();
    assert!(drain(&mut r, t0).is_empty());
    // 500 ms later, only lane 0 had anything read yet.
    let late = t0 + Duration::from_millis(500);
    senders[0].send_frame(late, &Frame::Ping(1));
    let got = drain(&mut r, late);
    assert!(
        !got.iter().any(|e| matches!(e, TransportEvent::Closed(_))),
        "{got:?}"
    );
    // Lanes 1 and 2 then speak too: nothing is closed.
    let next = late + Duration::from_millis(20);
    senders[1].send_frame(next, &Frame::Ping(2));
    senders[2].send_frame(next, &Frame::Ping(3));
    let got = drain(&mut r, next);
    assert_eq!(got.len(), 2, "{got:?}");
}
