//! Tests of the TCP sender end.

use super::*;
use crate::memory::{PoolGeometry, Scrub};
use kvwire_proto::auth::AuthChannel;
use kvwire_proto::wire::TransferId;

/// A sender over a loopback TCP connection, from a pool of `pages` one-buffer pages of
/// `page_bytes`, and the connection's other end.
async fn connected_sender(page_bytes: u32, pages: u32) -> (TcpSender, TcpStream) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (a, b) = tokio::join!(TcpStream::connect(addr), listener.accept());
    let pool = Arc::new(
        PagePool::new(
            PoolGeometry {
                tokens_per_page: 1,
                buffer_page_bytes: vec![page_bytes],
                pages,
            },
            Scrub::None,
        )
        .unwrap(),
    );
    let (sealer, opener) = AuthChannel::off().split();
    (
        TcpSender::new(a.unwrap(), sealer, opener, pool),
        b.unwrap().0,
    )
}

/// SPEC §9.1: a TCP access descriptor is exactly 4 bytes; a sender given any other
/// length writes nothing for the reservation and reports every page write failed. So is one
/// that asks for pull records (5 bytes, the last 1) on a connection without them (§9.3).
#[tokio::test(flavor = "current_thread")]
async fn a_tcp_access_descriptor_of_the_wrong_length_fails_the_writes() {
    let (mut s, _peer) = connected_sender(8, 4).await;
    let t = TransferRef {
        transfer_id: TransferId(1),
        nonce: 9,
    };
    let writes = [
        PageWrite {
            ordinal: 0,
            src_page: 0,
            dst_page: 0,
        },
        PageWrite {
            ordinal: 1,
            src_page: 1,
            dst_page: 1,
        },
    ];
    for access in [
        &[1u8, 0, 0][..],
        &[1, 0, 0, 0, 0][..],
        &[1, 0, 0, 0, 1][..],
        &[][..],
    ] {
        let access: Arc<[u8]> = access.into();
        s.post_writes(Instant::now(), t, &access, &writes);
        let mut cx = Context::from_waker(std::task::Waker::noop());
        match s.poll_event(&mut cx, Instant::now()) {
            Poll::Ready(TransportEvent::WritesDone {
                transfer,
                pages: 2,
                ok: false,
            }) => assert_eq!(transfer, t),
            other => panic!("descriptor of {} bytes: {other:?}", access.len()),
        }
    }
    assert_eq!(s.stats().records, 0, "a data record was written");
    assert_eq!(s.data_queued, 0);
}

fn data(page: u32) -> Out {
    Out::Data {
        header: [0; crate::transport::tcp::DATA_HEADER_LEN],
        transfer: TransferRef {
            transfer_id: TransferId(1),
            nonce: 1,
        },
        src_page: page,
        slot: None,
    }
}

/// One vectored write carries at most `MAX_IOV` slices and `MAX_WRITE_PAGE_BYTES` of
/// page bytes (so its pages are still in cache when the sender digests them after it),
/// and always the front item, however large.
#[test]
fn a_write_carries_at_most_a_mebibyte_of_page_bytes_and_always_its_front_item() {
    let records = |n: u32| (0..n).map(data).collect::<VecDeque<_>>();
    assert_eq!(items_per_write(&records(12), 2, 256 << 10), 4);
    assert_eq!(items_per_write(&records(2), 1, 4 << 20), 1);
    assert_eq!(items_per_write(&records(100), 1, 4 << 10), MAX_IOV / 2);
    let mut mixed = records(12);
    mixed.push_front(Out::Frame(vec![0; 64]));
    assert_eq!(items_per_write(&mixed, 1, 256 << 10), 5);
    assert_eq!(items_per_write(&VecDeque::new(), 1, 1), 0);
}

/// A poll that wrote a mebibyte of page bytes reports their records before it writes
/// more, so the sender digests those pages before the next write's copy evicts them.
#[tokio::test(flavor = "current_thread")]
async fn written_records_are_reported_after_each_mebibyte() {
    let (mut s, peer) = connected_sender(256 << 10, 16).await;
    let peer = peer.into_std().unwrap();
    peer.set_nonblocking(false).unwrap();
    let drain = std::thread::spawn(move || std::io::copy(&mut &peer, &mut std::io::sink()));
    let t = TransferRef {
        transfer_id: TransferId(1),
        nonce: 9,
    };
    let writes: Vec<PageWrite> = (0..16)
        .map(|i| PageWrite {
            ordinal: i,
            src_page: i,
            dst_page: i,
        })
        .collect();
    let access: Arc<[u8]> = [1u8, 0, 0, 0][..].into();
    s.post_writes(Instant::now(), t, &access, &writes);
    let mut reported = 0;
    while reported < 16 {
        let event = std::future::poll_fn(|cx| s.poll_event(cx, Instant::now())).await;
        let TransportEvent::WritesDone {
            pages, ok: true, ..
        } = event
        else {
            panic!("{event:?}");
        };
        reported += pages;
        // What one poll wrote: under 1 MiB when it began, at most 1 MiB more in its
        // last write.
        assert_eq!(
            s.stats().records,
            u64::from(reported),
            "records written unreported"
        );
        assert!(pages <= 8, "{pages} records (256 KiB each) in one report");
    }
    assert_eq!(s.stats().records, 16);
    drop(s);
    drain.join().unwrap().unwrap();
}

/// SPEC §8.3: frames held unsent for a peer are bounded; at the bound the connection
/// ends as unresponsive (a peer that asks for answers and reads none of them), and the
/// queue is dropped.
#[tokio::test(flavor = "current_thread")]
async fn frames_held_unsent_are_bounded_and_the_connection_ends_at_the_bound() {
    let (mut s, _peer) = connected_sender(8, 4).await; // the peer never reads
    let now = Instant::now();
    for i in 0..super::super::MAX_UNSENT_FRAMES as u64 - 1 {
        s.send_frame(now, &Frame::Pong(i));
    }
    assert!(!s.closed, "closed before the bound");
    s.send_frame(now, &Frame::Pong(u64::MAX));
    assert!(s.closed);
    assert!(s.out.is_empty(), "the queue is dropped");
    let ev = std::future::poll_fn(|cx| s.poll_event(cx, now)).await;
    assert!(
        matches!(ev, TransportEvent::Closed(Closed::Unresponsive { .. })),
        "{ev:?}"
    );
}

/// SPEC §9.3: with pulls, a reservation whose descriptor asks for them gets one pull record per
/// page (`KVPL`, the data header, the address of each buffer's slot of the source page), and
/// no page bytes; one with a 4-byte descriptor still gets data records.
#[tokio::test(flavor = "current_thread")]
async fn a_pull_descriptor_gets_pull_records_naming_the_source_pages() {
    use tokio::io::AsyncReadExt;
    let (s, mut peer) = connected_sender(8, 4).await;
    let mut s = s.with_pulls();
    let t = TransferRef {
        transfer_id: TransferId(3),
        nonce: 5,
    };
    let write = [PageWrite {
        ordinal: 0,
        src_page: 2,
        dst_page: 1,
    }];
    let pull: Arc<[u8]> = (&[7u8, 0, 0, 0, super::super::PULL_FLAG][..]).into();
    s.post_writes(Instant::now(), t, &pull, &write);
    let mut cx = Context::from_waker(std::task::Waker::noop());
    match s.poll_event(&mut cx, Instant::now()) {
        Poll::Ready(TransportEvent::WritesDone {
            pages: 1, ok: true, ..
        }) => {}
        other => panic!("{other:?}"),
    }
    let mut record = [0u8; super::super::DATA_HEADER_LEN + 8];
    peer.read_exact(&mut record).await.unwrap();
    assert_eq!(&record[..4], b"KVPL");
    assert_eq!(&record[20..24], &[7, 0, 0, 0], "the access key");
    let (base, _) = s.pool.memory().region(0).unwrap();
    let want = base.as_ptr() as u64 + s.pool.memory().range(2, 0).start as u64;
    assert_eq!(
        record[36..44],
        want.to_le_bytes(),
        "buffer 0's slot of source page 2"
    );
    assert_eq!((s.stats().pulls, s.stats().bytes), (1, 0));
    let bytes: Arc<[u8]> = (&[7u8, 0, 0, 0][..]).into();
    s.post_writes(Instant::now(), t, &bytes, &write);
    let _ = s.poll_event(&mut cx, Instant::now());
    let mut head = [0u8; 4];
    peer.read_exact(&mut head).await.unwrap();
    assert_eq!(&head, b"KVDT");
}
