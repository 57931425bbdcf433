//! The stream parser against splits, stray magic and records that break their scope.

use super::*;
use crate::memory::{PoolGeometry, Scrub};
use kvwire_proto::wire::{TransferId, TransferRef};

/// Feeds `bytes` to the reader as a stream would, collecting whole records.
fn feed(
    reader: &mut StreamReader,
    pool: &PagePool,
    scopes: &ScopeTable,
    bytes: &[u8],
) -> Result<Vec<Record>, StreamError> {
    feed_in_reads_of(reader, pool, scopes, bytes, usize::MAX)
}

/// [`feed`], with no read returning more than `step` bytes (a stream splits anywhere).
fn feed_in_reads_of(
    reader: &mut StreamReader,
    pool: &PagePool,
    scopes: &ScopeTable,
    mut bytes: &[u8],
    step: usize,
) -> Result<Vec<Record>, StreamError> {
    let mut out = Vec::new();
    loop {
        while let Some(r) = reader.next_buffered(pool, scopes)? {
            out.push(r);
        }
        if bytes.is_empty() {
            return Ok(out);
        }
        let n = {
            let mut target = reader.target(pool, scopes);
            let mut slices = target.slices();
            let mut n = 0;
            for s in slices.iter_mut() {
                let k = s.len().min(bytes.len() - n).min(step - n);
                s[..k].copy_from_slice(&bytes[n..n + k]);
                n += k;
                if n == bytes.len() || n == step {
                    break;
                }
            }
            n
        };
        assert!(n > 0, "the reader offered nothing to read into");
        bytes = &bytes[n..];
        if let Some(r) = reader.advance(n, pool, scopes) {
            out.push(r);
        }
    }
}

/// SPEC §7.2 / §9.1: a record with neither magic ends the connection, its bytes named
/// as hex and ASCII.
#[test]
fn an_unknown_record_magic_is_named_in_hex_and_ascii() {
    let pool = PagePool::new(
        PoolGeometry {
            tokens_per_page: 1,
            buffer_page_bytes: vec![8],
            pages: 1,
        },
        Scrub::None,
    )
    .unwrap();
    let mut reader = StreamReader::new(&[8]);
    let e = feed(
        &mut reader,
        &pool,
        &ScopeTable::default(),
        b"GET / HTTP/1.0\r\n",
    )
    .unwrap_err();
    let text = e.to_string();
    assert!(text.contains(r#"47 45 54 20 "GET ""#), "{text}");
    assert!(text.contains(r#"4b 56 44 54 "KVDT""#), "{text}");
}

/// A pool of 8 one-buffer pages of 8 bytes, and a scope table with one reservation (transfer 7,
/// nonce 0x1234, pages 5 and 2) open under `key`.
fn one_open_scope() -> (PagePool, ScopeTable, TransferRef, crate::memory::AccessKey) {
    let pool = PagePool::new(
        PoolGeometry {
            tokens_per_page: 1,
            buffer_page_bytes: vec![8],
            pages: 8,
        },
        Scrub::None,
    )
    .unwrap();
    let t = TransferRef {
        transfer_id: TransferId(7),
        nonce: 0x1234,
    };
    let mut scopes = ScopeTable::default();
    let key = scopes.open(t.transfer_id, &[5, 2]);
    scopes.bind(t);
    (pool, scopes, t, key)
}

/// SPEC §9.1: under an open scope a data record MUST be that reservation's (transfer id
/// and nonce) and write the page reserved at its ordinal; one that is not is a protocol
/// violation that ends the connection, before any of its bytes lands. A record under a
/// closed (fenced) key is discarded.
#[test]
fn a_record_that_does_not_match_its_scopes_reservation_ends_the_connection() {
    let (pool, mut scopes, t, key) = one_open_scope();
    let record = |transfer, ordinal, dst_page| {
        let mut b = DataHeader {
            transfer,
            key,
            ordinal,
            dst_page,
            len: 8,
        }
        .encode()
        .to_vec();
        b.extend_from_slice(&[0xAB; 8]);
        b
    };
    // The reservation's own record lands.
    let mut reader = StreamReader::new(&[8]);
    let got = feed(&mut reader, &pool, &scopes, &record(t, 1, 2)).unwrap();
    assert!(matches!(&got[..], [Record::Landed(h, None)] if h.dst_page == 2));
    for (transfer, ordinal, dst_page) in [
        (TransferRef { nonce: 0x9999, ..t }, 1, 2),
        (
            TransferRef {
                transfer_id: TransferId(8),
                ..t
            },
            1,
            2,
        ),
        (t, 0, 2), // a page of the scope, but not the one reserved at ordinal 0
        (t, 2, 2), // an ordinal beyond the reservation
        (t, 0, 6), // a page outside the scope
    ] {
        let mut reader = StreamReader::new(&[8]);
        let e = feed(
            &mut reader,
            &pool,
            &scopes,
            &record(transfer, ordinal, dst_page),
        )
        .unwrap_err();
        assert!(
            matches!(e, StreamError::RecordMismatch { scope, .. } if scope == t),
            "{e}"
        );
    }
    // After the fence the key is dead: a late record is discarded, not an error.
    scopes.close(t.transfer_id);
    let mut reader = StreamReader::new(&[8]);
    let got = feed(&mut reader, &pool, &scopes, &record(t, 0, 5)).unwrap();
    assert!(matches!(&got[..], [Record::Refused(_)]));
}

/// The reader lands the same bytes and hands out the same records however the stream
/// splits into reads (one byte at a time, odd sizes, everything at once), for layouts of
/// small records (read ahead many at a time, then copied) and large ones (vectored reads
/// straight into every buffer's page): frames, landed records, a record refused because
/// its scope is closed, and a frame longer than the read-ahead buffer. Where the scope asks
/// for digests at landing, every large record lands with the page digests of exactly the
/// bytes it left in each buffer's slot (SPEC §6), whatever the splits.
#[test]
fn records_land_alike_however_the_stream_splits_into_reads() {
    use kvwire_proto::wire::Frame;
    let layouts = [
        (vec![8u32, 24], None),
        (vec![3000], Some(DigestAlgorithm::XXH3_64)),
        (vec![40 * 1024, 8 * 1024, 1], None),
        (vec![40 * 1024, 8 * 1024, 1], Some(DigestAlgorithm::XXH3_64)),
        (vec![40 * 1024, 8 * 1024, 1], Some(DigestAlgorithm::CRC32)),
        // Slots longer than a digested read's piece, one of them not a multiple of it.
        (
            vec![300 * 1024, 3, 600 * 1024],
            Some(DigestAlgorithm::XXH3_64),
        ),
    ];
    for (buffer_page_bytes, landing_digest) in layouts {
        let pages = 6u32;
        let geometry = PoolGeometry {
            tokens_per_page: 1,
            buffer_page_bytes: buffer_page_bytes.clone(),
            pages,
        };
        let record_len: usize = buffer_page_bytes.iter().map(|&b| b as usize).sum();
        let t = TransferRef {
            transfer_id: TransferId(3),
            nonce: 0x77,
        };
        let dead = TransferRef {
            transfer_id: TransferId(4),
            nonce: 0x78,
        };
        let mut scopes = ScopeTable::default();
        let key = scopes.open(t.transfer_id, &[4, 1, 5]);
        scopes.bind(t);
        if let Some(alg) = landing_digest {
            scopes.digest_landings(t.transfer_id, alg);
        }
        let digested = landing_digest.is_some() && record_len > SMALL_RECORD;
        let dead_key = scopes.open(dead.transfer_id, &[0]);
        scopes.bind(dead);
        scopes.close(dead.transfer_id);
        let (mut sealer, _) = AuthChannel::off().split();
        let mut stream = Vec::new();
        let mut expected = Vec::new();
        let record = |stream: &mut Vec<u8>, transfer, key, ordinal: u32, dst_page, fill: u8| {
            stream.extend_from_slice(
                &DataHeader {
                    transfer,
                    key,
                    ordinal,
                    dst_page,
                    len: record_len as u32,
                }
                .encode(),
            );
            stream.extend((0..record_len).map(|i| fill ^ (i as u8)));
        };
        stream.extend(sealer.seal_to_vec(&Frame::Ping(1)).unwrap());
        expected.push("frame");
        for (ordinal, page) in [(0u32, 4u32), (1, 1)] {
            record(&mut stream, t, key, ordinal, page, 0x10 + ordinal as u8);
            expected.push("landed");
        }
        record(&mut stream, dead, dead_key, 0, 0, 0xEE);
        expected.push("refused");
        // A frame longer than the read-ahead buffer (a large COMMIT-sized payload).
        let big = Frame::HelloReject(kvwire_proto::wire::HelloReject {
            code: kvwire_proto::wire::ErrorCode::VERSION_MISMATCH,
            detail: "x".repeat(100 * 1024),
        });
        stream.extend(sealer.seal_to_vec(&big).unwrap());
        expected.push("frame");
        record(&mut stream, t, key, 2, 5, 0x12);
        expected.push("landed");
        stream.extend(sealer.seal_to_vec(&Frame::Pong(2)).unwrap());
        expected.push("frame");
        let steps: &[usize] = if record_len > 100_000 {
            &[4096, 5000, 70 * 1024, 300 * 1024 + 1, usize::MAX]
        } else {
            &[1, 7, 36, 4096, 5000, 70 * 1024, usize::MAX]
        };
        for &step in steps {
            let pool = PagePool::new(geometry.clone(), Scrub::None).unwrap();
            let mut reader = StreamReader::new(&buffer_page_bytes);
            let got = feed_in_reads_of(&mut reader, &pool, &scopes, &stream, step).unwrap();
            let kinds: Vec<&str> = got
                .iter()
                .map(|r| match r {
                    Record::Frame(_) => "frame",
                    Record::Landed(h, digests) => {
                        // Digests taken at landing are those of the page as it holds now.
                        let want = digested.then(|| LandingDigests {
                            algorithm: landing_digest.unwrap(),
                            per_buffer: (0..buffer_page_bytes.len())
                                .map(|b| {
                                    crate::checksum::page_digest(
                                        landing_digest.unwrap(),
                                        &pool.raw_page(h.dst_page, b).unwrap(),
                                    )
                                    .unwrap()
                                })
                                .collect(),
                        });
                        assert_eq!(
                            digests, &want,
                            "layout {buffer_page_bytes:?}, reads of {step}, page {}",
                            h.dst_page
                        );
                        "landed"
                    }
                    Record::Refused(_) => "refused",
                    Record::Staged(..) => "staged",
                    Record::Pull { .. } => "pull",
                })
                .collect();
            assert_eq!(
                kinds, expected,
                "layout {buffer_page_bytes:?}, reads of {step}"
            );
            for (ordinal, page) in [(0u32, 4u32), (1, 1), (2, 5)] {
                let mut i = 0usize;
                for b in 0..buffer_page_bytes.len() {
                    let bytes = pool.raw_page(page, b).unwrap();
                    for (j, &x) in bytes.iter().enumerate() {
                        assert_eq!(
                            x,
                            (0x10 + ordinal as u8) ^ ((i + j) as u8),
                            "layout {buffer_page_bytes:?}, reads of {step}: page {page} buffer {b} byte {j}"
                        );
                    }
                    i += bytes.len();
                }
            }
            // The refused record's page was not written.
            assert!(pool.raw_page(0, 0).unwrap().iter().all(|&x| x == 0));
            assert_eq!(reader.stats.writes_landed, 3);
            assert_eq!(reader.stats.writes_refused, 1);
            assert_eq!(
                reader.stats.digested_at_landing,
                if digested { 3 } else { 0 }
            );
            if step == usize::MAX && record_len > SMALL_RECORD {
                // Large records land mostly by reads straight into their pages.
                assert!(
                    reader.stats.bytes_copied <= 3 * LARGE_AHEAD as u64,
                    "{} bytes copied",
                    reader.stats.bytes_copied
                );
            }
        }
    }
}

/// SPEC §6 rule 2 and §9.1: a record whose scope closes part-way (a fence) covers nothing and
/// brings no digests, whatever it fed before; the next record into the same page, under a new
/// scope, lands with the digests of exactly its own bytes.
#[test]
fn a_record_cut_by_a_fence_drops_its_partial_digests() {
    let page_bytes = [96 * 1024u32, 32 * 1024];
    let record_len: usize = page_bytes.iter().map(|&b| b as usize).sum();
    let pool = PagePool::new(
        PoolGeometry {
            tokens_per_page: 1,
            buffer_page_bytes: page_bytes.to_vec(),
            pages: 4,
        },
        Scrub::None,
    )
    .unwrap();
    let alg = DigestAlgorithm::XXH3_64;
    let record = |transfer: TransferRef, key, fill: u8| {
        let mut b = DataHeader {
            transfer,
            key,
            ordinal: 0,
            dst_page: 3,
            len: record_len as u32,
        }
        .encode()
        .to_vec();
        b.extend((0..record_len).map(|i| fill ^ (i as u8)));
        b
    };
    let first = TransferRef {
        transfer_id: TransferId(1),
        nonce: 1,
    };
    let mut scopes = ScopeTable::default();
    let key = scopes.open(first.transfer_id, &[3]);
    scopes.bind(first);
    scopes.digest_landings(first.transfer_id, alg);
    let mut reader = StreamReader::new(&page_bytes);
    let cut = record(first, key, 0x11);
    // Half the record lands and is digested; then the fence.
    let got = feed_in_reads_of(&mut reader, &pool, &scopes, &cut[..cut.len() / 2], 10_000).unwrap();
    assert!(got.is_empty());
    scopes.close(first.transfer_id);
    let got = feed(&mut reader, &pool, &scopes, &cut[cut.len() / 2..]).unwrap();
    assert!(matches!(&got[..], [Record::Refused(_)]), "{got:?}");
    assert_eq!(reader.stats.digested_at_landing, 0);
    // The page now holds half of the cut record; a new reservation's record replaces it all.
    let second = TransferRef {
        transfer_id: TransferId(2),
        nonce: 2,
    };
    let key = scopes.open(second.transfer_id, &[3]);
    scopes.bind(second);
    scopes.digest_landings(second.transfer_id, alg);
    let got = feed_in_reads_of(
        &mut reader,
        &pool,
        &scopes,
        &record(second, key, 0x22),
        10_000,
    )
    .unwrap();
    let [Record::Landed(h, Some(d))] = &got[..] else {
        panic!("{got:?}");
    };
    assert_eq!(h.transfer, second);
    let want: Vec<u64> = (0..page_bytes.len())
        .map(|b| crate::checksum::page_digest(alg, &pool.raw_page(3, b).unwrap()).unwrap())
        .collect();
    assert_eq!((d.algorithm, &d.per_buffer[..]), (alg, &want[..]));
    assert_eq!(reader.stats.digested_at_landing, 1);
}

/// SPEC §9.1 (records and magics; Q26): on an established stream a record is a frame
/// (`KVWR`) or a data record (`KVDT`), classified by its first 4 bytes; anything else — a
/// join record (`KVJN`) included, which only ever starts a newly accepted stream — ends the
/// connection. The frame decoder itself knows one magic, so during the handshake a data
/// record is a `BadMagic` too (§3.3).
#[test]
fn an_established_stream_reads_frames_and_data_records_and_nothing_else() {
    use kvwire_proto::wire::{DecodeError, Frame};
    let pool = PagePool::new(
        PoolGeometry {
            tokens_per_page: 1,
            buffer_page_bytes: vec![8],
            pages: 2,
        },
        Scrub::None,
    )
    .unwrap();
    let scopes = ScopeTable::default();
    let data = {
        let mut b = DataHeader {
            transfer: TransferRef {
                transfer_id: TransferId(1),
                nonce: 2,
            },
            key: crate::memory::AccessKey(99),
            ordinal: 0,
            dst_page: 0,
            len: 8,
        }
        .encode()
        .to_vec();
        b.extend_from_slice(&[0xAB; 8]);
        b
    };
    let mut stream = Frame::Ping(1).to_bytes().unwrap();
    stream.extend_from_slice(&data);
    let mut reader = StreamReader::new(&[8]);
    let got = feed(&mut reader, &pool, &scopes, &stream).unwrap();
    assert!(matches!(
        &got[..],
        [Record::Frame(Frame::Ping(1)), Record::Refused(_)]
    ));
    // Three bytes of a join record: not yet a record's magic (the reader waits for four).
    let mut join = b"KVJN".to_vec();
    join.extend_from_slice(&1u16.to_le_bytes());
    join.extend_from_slice(&2u16.to_le_bytes());
    join.extend_from_slice(&[0x5a; 16]);
    assert!(feed(&mut reader, &pool, &scopes, &join[..3])
        .unwrap()
        .is_empty());
    let e = feed(&mut reader, &pool, &scopes, &join[3..]).unwrap_err();
    assert!(
        matches!(e, StreamError::BadMagic(m) if m == *b"KVJN"),
        "{e}"
    );
    assert!(e.to_string().contains(r#""KVJN""#), "{e}");
    // Where only a frame may come (the handshake), a data record is not one.
    assert_eq!(Frame::decode(&data), Err(DecodeError::BadMagic(*b"KVDT")));
}

/// SPEC §9.1 (Q26): a data record's length is checked at its header before its access key:
/// a length other than the layout's bytes per page index ends the connection whether the key
/// names an open scope, a record that mismatches it, or no scope at all (never a discard:
/// the length is what says where the next record starts). With the right length a record
/// under a key that names no open scope is read and discarded.
#[test]
fn a_data_records_length_is_checked_before_its_key() {
    let (pool, scopes, t, key) = one_open_scope();
    let record = |transfer, key, ordinal, dst_page, len: u32| {
        let mut b = DataHeader {
            transfer,
            key,
            ordinal,
            dst_page,
            len,
        }
        .encode()
        .to_vec();
        b.extend(std::iter::repeat_n(0xAB, len as usize));
        b
    };
    let stranger = TransferRef { nonce: 0x9999, ..t };
    let never_issued = crate::memory::AccessKey(key.0 ^ 0x4000_0000);
    assert!(scopes.get(never_issued).is_none());
    for (transfer, key, ordinal, dst_page, len) in [
        (t, key, 0, 5, 7),                 // the reservation's own record, one byte short
        (stranger, key, 0, 5, 16),         // mismatching its open scope, and too long
        (stranger, never_issued, 0, 0, 9), // under no scope, and too long
    ] {
        let mut reader = StreamReader::new(&[8]);
        let e = feed(
            &mut reader,
            &pool,
            &scopes,
            &record(transfer, key, ordinal, dst_page, len),
        )
        .unwrap_err();
        assert!(
            matches!(e, StreamError::BadDataLength { got, expected: 8 } if got == len),
            "{e}"
        );
    }
    let mut reader = StreamReader::new(&[8]);
    let got = feed(
        &mut reader,
        &pool,
        &scopes,
        &record(stranger, never_issued, 0, 0, 8),
    )
    .unwrap();
    assert!(matches!(&got[..], [Record::Refused(_)]));
}

/// SPEC §9.1, transport parameters (Q26): `pages = 0` is well formed (in either form), not
/// malformed; a receiver that advertises it has no page a reservation may name, so a sender
/// limited by it (§5.3.1 #7) refuses every RESERVE with BAD_RESERVATION and writes nothing.
#[test]
fn tcp_params_with_zero_pages_are_well_formed_and_every_reservation_is_refused() {
    use crate::transport::tcp::TcpParams;
    use kvwire_proto::handshake::Established;
    use kvwire_proto::sender::{SenderAction, SenderConfig, SenderSession};
    use kvwire_proto::wire::{ErrorCode, Frame, Hello, KvLayout, Reserve, Role};
    assert_eq!(
        TcpParams::parse(&[2, 0, 4, 0, 0, 0, 0, 0]),
        Ok(TcpParams::one_stream(0))
    );
    let long = TcpParams {
        pages: 0,
        streams: 2,
        token: [1; 16],
        same_host: None,
    };
    assert_eq!(TcpParams::parse(&long.encode()), Ok(long));

    let hello = |role, pages: u32| Hello {
        node_id: 1,
        role,
        layout: KvLayout {
            tokens_per_page: 16,
            buffer_page_bytes: vec![4096],
            fingerprint: b"m".to_vec(),
        },
        digests: vec![DigestAlgorithm::XXH3_64],
        transport_params: TcpParams::one_stream(pages).encode(),
        max_aux: 0,
    };
    let est = Established {
        local: hello(Role::SENDER, 64),
        peer: hello(Role::RECEIVER, 0),
        digests: vec![DigestAlgorithm::XXH3_64],
    };
    let now = std::time::Instant::now();
    let mut s = SenderSession::new(&est, SenderConfig::default());
    let peer = TcpParams::parse(&est.peer.transport_params).unwrap();
    s.limit_destination_pages(peer.pages);
    let admitted = kvwire_proto::admission::AdmissionPolicy {
        tokens_per_page: 16,
        pool_pages: 64,
        max_context_tokens: 1024,
    }
    .admit(kvwire_proto::admission::Request {
        transfer_id: TransferId(1),
        tokens: 16,
    })
    .unwrap();
    s.submit(now, admitted, vec![0]).unwrap();
    let e = s
        .handle_frame(
            now,
            Frame::Reserve(Reserve {
                transfer_id: TransferId(1),
                nonce: 9,
                tokens: 16,
                digest: DigestAlgorithm::XXH3_64,
                page_digests: false,
                deadline_ms: 1000,
                pages: vec![0],
                access: vec![0; 4],
            }),
        )
        .unwrap_err();
    assert_eq!(e.scope, kvwire_proto::Scope::Transfer);
    let frames: Vec<_> = std::iter::from_fn(|| s.poll_transmit()).collect();
    assert!(
        matches!(&frames[..], [Frame::Reject(r)] if r.code == ErrorCode::BAD_RESERVATION),
        "{frames:?}"
    );
    assert!(!std::iter::from_fn(|| s.poll_action())
        .any(|a| matches!(a, SenderAction::PostWrites { .. })));
}

/// A pull record (SPEC §9.3) of `header`, naming `sources` (one address per buffer).
fn pull_record(header: DataHeader, sources: &[u64]) -> Vec<u8> {
    let mut b = header.encode().to_vec();
    b[..4].copy_from_slice(&super::super::PULL_MAGIC);
    for a in sources {
        b.extend_from_slice(&a.to_le_bytes());
    }
    b
}

/// SPEC §9.3: under an open scope a pull record copies each buffer's slot out of the named
/// process's memory (this one here), with its digests at landing; after the fence (a closed
/// scope) the same record copies nothing; an address outside the process's mappings fails the
/// pull (the page is not covered, the stream goes on); a pull record that mismatches its
/// reservation ends the connection as a data record does; and a reader that did not ask for
/// pulls takes `KVPL` as an unknown magic.
#[test]
fn pull_records_copy_under_an_open_scope_only() {
    let (pool, mut scopes, t, key) = one_open_scope();
    scopes.digest_landings(t.transfer_id, DigestAlgorithm::XXH3_64);
    let source: Vec<u8> = b"pulled!!".to_vec();
    let header = DataHeader {
        transfer: t,
        key,
        ordinal: 1,
        dst_page: 2,
        len: 8,
    };
    let record = pull_record(header, &[source.as_ptr() as u64]);
    let slot = |pool: &PagePool| pool.raw_page(2, 0).unwrap().to_vec();

    // Without pulls: an unknown magic.
    let mut plain = StreamReader::new(&[8]);
    let e = feed(&mut plain, &pool, &scopes, &record).unwrap_err();
    assert!(
        matches!(e, StreamError::BadMagic(m) if m == *b"KVPL"),
        "{e}"
    );

    let mut reader = StreamReader::new(&[8]);
    reader.puller = Some(Puller::new(std::process::id()));
    // Split anywhere, the record copies the source into page 2, digested as it lands.
    let got = feed_in_reads_of(&mut reader, &pool, &scopes, &record, 5).unwrap();
    match got.as_slice() {
        [Record::Landed(h, Some(d))] => {
            assert_eq!(*h, header);
            let kind = crate::checksum::Kind::new(DigestAlgorithm::XXH3_64).unwrap();
            assert_eq!(*d.per_buffer, [kind.page_digest(&source)]);
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(slot(&pool), source);
    assert_eq!((reader.stats.pulled, reader.stats.writes_landed), (1, 1));

    // An address this process does not map: the pull fails, nothing covered, stream on.
    let bad = pull_record(header, &[8]);
    let got = feed(&mut reader, &pool, &scopes, &bad).unwrap();
    assert!(matches!(got.as_slice(), [Record::Refused(_)]), "{got:?}");
    assert_eq!(reader.stats.pulls_failed, 1);

    // The record's reservation must match its key's (another page at ordinal 1).
    let wrong = pull_record(
        DataHeader {
            dst_page: 5,
            ..header
        },
        &[source.as_ptr() as u64],
    );
    let mut strict = StreamReader::new(&[8]);
    strict.puller = reader.puller;
    assert!(matches!(
        feed(&mut strict, &pool, &scopes, &wrong),
        Err(StreamError::RecordMismatch { .. })
    ));

    // After the fence, the same record copies nothing.
    scopes.close(t.transfer_id);
    let other = b"late!!!!".to_vec();
    let late = pull_record(header, &[other.as_ptr() as u64]);
    let got = feed(&mut reader, &pool, &scopes, &late).unwrap();
    assert!(matches!(got.as_slice(), [Record::Refused(_)]), "{got:?}");
    assert_eq!(
        slot(&pool),
        source,
        "no byte of a pull after the fence lands"
    );
    assert_eq!(reader.stats.pulled, 1);
}
