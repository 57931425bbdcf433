//! Randomised interleavings: many concurrent transfers, each with a random fault, random
//! aborts from either side at random steps, rejected requests mixed in, reservations sent
//! before or after the request, and occasionally a crash. After every run the same
//! invariants as the fault matrix must hold, and every transfer the receiver reserved must
//! have ended (verified or failed with a typed reason).

mod common;

use kvwire::TransferId;
use std::time::Duration;

use common::{assert_invariants, try_reserve, try_send};
use kvwire::proto::wire::FrameType;
use kvwire::testkit::{Fault, FaultRule, Side, Step};
use kvwire::testkit::{Pair, PairConfig};
use proptest::prelude::*;

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        Just(Step::FirstWrite),
        prop::sample::select(vec![
            FrameType::RESERVE,
            FrameType::REJECT,
            FrameType::COMMIT,
            FrameType::VERIFIED,
            FrameType::NACK,
            FrameType::ABORT,
            FrameType::ABORT_ACK,
        ])
        .prop_map(Step::Frame),
    ]
}

fn frame_type() -> impl Strategy<Value = FrameType> {
    prop::sample::select(vec![
        FrameType::RESERVE,
        FrameType::COMMIT,
        FrameType::VERIFIED,
        FrameType::NACK,
        FrameType::ABORT,
        FrameType::ABORT_ACK,
    ])
}

fn side() -> impl Strategy<Value = Side> {
    prop_oneof![Just(Side::Sender), Just(Side::Receiver)]
}

/// Faults that leave the connection up (crashes and corruption are tested separately, since
/// one of them ends every transfer at once).
fn fault() -> impl Strategy<Value = Option<Fault>> {
    prop_oneof![
        3 => Just(None),
        1 => (0u32..6).prop_map(|ordinal| Some(Fault::DropWrite { ordinal })),
        1 => (0u32..6, 0usize..3, 0usize..256).prop_map(|(ordinal, buffer, offset)| Some(Fault::CorruptByte { ordinal, buffer, offset })),
        1 => (0u32..6, 0usize..300).prop_map(|(ordinal, keep)| Some(Fault::TruncateWrite { ordinal, keep })),
        1 => (0u32..6).prop_map(|ordinal| Some(Fault::DuplicateWrite { ordinal })),
        1 => Just(Some(Fault::CommitBeforeData)),
        1 => Just(Some(Fault::LateWrites)),
        1 => frame_type().prop_map(|t| Some(Fault::DropFrame(t))),
        1 => frame_type().prop_map(|t| Some(Fault::DuplicateFrame(t))),
        1 => (frame_type(), 0u64..4000).prop_map(|(t, ms)| Some(Fault::DelayFrame(t, Duration::from_millis(ms)))),
        2 => (side(), step()).prop_map(|(s, st)| Some(Fault::Abort(s, st))),
    ]
}

#[derive(Clone, Debug)]
struct Plan {
    tokens: u32,
    rejected: bool,
    reserve_first: bool,
    fault: Option<Fault>,
}

fn plan() -> impl Strategy<Value = Plan> {
    (1u32..200, prop::bool::weighted(0.1), any::<bool>(), fault()).prop_map(
        |(tokens, rejected, reserve_first, fault)| Plan {
            tokens,
            rejected,
            reserve_first,
            fault,
        },
    )
}

fn run(
    plans: &[Plan],
    connection_fault: Option<(u64, Fault)>,
    mid_aborts: &[(u64, Side, u32)],
) -> Pair {
    let mut cfg = PairConfig::small();
    cfg.sender_pool.pages = 128;
    cfg.receiver_pool.pages = 128;
    cfg.sender_engine.max_context_tokens = 1024;
    cfg.receiver_engine.max_context_tokens = 1024;
    let mut pair = Pair::new(cfg).unwrap();
    for (i, p) in plans.iter().enumerate() {
        let id = i as u64 + 1;
        if let Some(f) = &p.fault {
            pair.fault(FaultRule::on(TransferId(id), f.clone()));
        }
    }
    if let Some((id, f)) = connection_fault {
        pair.fault(FaultRule::on(TransferId(id), f));
    }
    let mut reserved = Vec::new();
    for (i, p) in plans.iter().enumerate() {
        let id = i as u64 + 1;
        // Rejected requests ask for more than the context length allows.
        let tokens = if p.rejected {
            5000
        } else {
            u64::from(p.tokens)
        };
        let rx_tokens = p.tokens;
        // Both pools have room for every plan (<= 13 pages each, <= 8 plans).
        // A start refused because the connection is already gone is fine; anything else is not.
        let ok = if p.reserve_first {
            let ok = try_reserve(&mut pair, id, rx_tokens).is_ok();
            let _ = try_send(&mut pair, id, tokens);
            ok
        } else {
            let _ = try_send(&mut pair, id, tokens);
            try_reserve(&mut pair, id, rx_tokens).is_ok()
        };
        assert!(
            ok || pair.closed,
            "reservation {id} refused on a live connection"
        );
        if ok {
            reserved.push(id);
        }
        // Interleave: let a few events happen between starts.
        for _ in 0..(i % 3) * 5 {
            pair.step();
        }
    }
    for &(id, side, after_steps) in mid_aborts {
        for _ in 0..after_steps {
            pair.step();
        }
        let now = pair.now;
        match side {
            Side::Sender => pair.sender.abort(
                now,
                TransferId(id),
                kvwire::proto::wire::ErrorCode::CANCELLED,
            ),
            Side::Receiver => pair.receiver.abort(
                now,
                TransferId(id),
                kvwire::proto::wire::ErrorCode::CANCELLED,
            ),
        };
    }
    pair.drive();
    if pair.crashed != Some(Side::Receiver) {
        for id in reserved {
            let ended = pair.verified.contains(&TransferId(id))
                || pair.receiver_failure(TransferId(id)).is_some();
            assert!(ended, "transfer {id} never ended at the receiver");
        }
    }
    pair
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn concurrent_transfers_with_random_faults_keep_the_invariants(
        plans in prop::collection::vec(plan(), 1..8),
        aborts in prop::collection::vec((1u64..8, side(), 0u32..40), 0..3),
    ) {
        let pair = run(&plans, None, &aborts);
        assert_invariants(&pair);
    }

    #[test]
    fn crashes_and_corruption_mid_run_keep_the_invariants(
        plans in prop::collection::vec(plan(), 1..6),
        victim in 1u64..6,
        crash in prop_oneof![
            (side(), step()).prop_map(|(s, st)| Fault::Crash(s, st)),
            frame_type().prop_map(Fault::CorruptFrame),
        ],
    ) {
        let pair = run(&plans, Some((victim, crash)), &[]);
        assert_invariants(&pair);
    }
}
