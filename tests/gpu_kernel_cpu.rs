//! The GPU digest kernel (`src/gpu/kernel.cu`, `kvwire::gpu::KERNEL_SOURCE`), compiled as
//! plain C by the host C compiler and run on the CPU, must compute exactly the digests of
//! `kvwire::checksum` (SPEC.md §6). No GPU and no CUDA needed: only `cc` (or `$CC`).
//!
//! `tests/gpu_kernel_cpu/harness.c` includes the kernel source and runs its block programs
//! (every step for all 128 "threads", in three different thread orders whose results must
//! agree) over records this test writes: whole transfers (pools of page slots and a page
//! list, exactly like the GPU launch), raw byte strings (XXH3-64, CRC-32, XXH3-128 of plain
//! bytes) and buffer digests over given page digests. It is built with AddressSanitizer and
//! UBSan when the compiler has them, so a read past the end of a page shows.
//!
//! Covered: the project's golden digest vectors (xxHash's sanity vectors for XXH3-64 and
//! XXH3-128, the CRC-32 check values, every golden buffer digest of `src/checksum/tests.rs`
//! and SPEC.md §6), every XXH3 length class and its boundaries, CRC chunk shapes, multi-round
//! long loops for pages and for buffer-digest inputs, odd page sizes (unaligned pages),
//! shuffled page lists, several buffers per transfer.

use kvwire::TransferId;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::OnceLock;

use kvwire::checksum::{digest_transfer, Digest128, DigestAlgorithm, DigestBinding};
use kvwire::gpu::KERNEL_SOURCE;
use xxhash_rust::xxh3::{xxh3_128, xxh3_64};

const HARNESS_C: &str = include_str!("gpu_kernel_cpu/harness.c");
const CUDA_STUBS_H: &str = include_str!("gpu_kernel_cpu/cuda_stubs.h");

const XXH: DigestAlgorithm = DigestAlgorithm::XXH3_64;
const CRC: DigestAlgorithm = DigestAlgorithm::CRC32;
const ALGS: [DigestAlgorithm; 2] = [XXH, CRC];

/// Raw-hash kinds of the harness (`KVWD_JOB_*`).
const KIND_XXH3_64: u32 = 0;
const KIND_CRC32: u32 = 1;
const KIND_XXH3_128: u32 = 2;

// ---------------------------------------------------------------------------------------
// Building and running the harness.

fn work_dir() -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("gpu_kernel_cpu");
    std::fs::create_dir_all(&dir).expect("create the work directory");
    dir
}

fn c_compiler() -> String {
    std::env::var("CC").unwrap_or_else(|_| "cc".into())
}

/// The C compiler's flags; `SANITIZE` is added when the compiler has the sanitizers.
const CFLAGS: &[&str] = &[
    "-std=c11",
    "-O1",
    "-g",
    "-Wall",
    "-Wextra",
    "-pedantic",
    "-Werror",
    // The kernel reads 8-byte words from byte buffers, as the GPU does.
    "-fno-strict-aliasing",
];
const SANITIZE: &[&str] = &[
    "-fsanitize=address,undefined",
    "-fno-sanitize-recover=all",
    "-fno-omit-frame-pointer",
];

/// Compiles the harness (with the kernel source), once per content: the binary is named by
/// a hash of the sources, the compiler and the flags, and reused by later runs.
fn harness() -> &'static Path {
    static EXE: OnceLock<PathBuf> = OnceLock::new();
    EXE.get_or_init(|| {
        let dir = work_dir();
        let key = xxh3_64(
            format!(
                "{KERNEL_SOURCE}\0{HARNESS_C}\0{}\0{CFLAGS:?}{SANITIZE:?}",
                c_compiler()
            )
            .as_bytes(),
        );
        let exe = dir.join(format!("harness-{key:016x}"));
        if exe.exists() {
            return exe;
        }
        let pid = std::process::id();
        let src_dir = dir.join(format!("src-{key:016x}-{pid}"));
        std::fs::create_dir_all(&src_dir).unwrap();
        std::fs::write(src_dir.join("kvwd_kernel.cu"), KERNEL_SOURCE).unwrap();
        std::fs::write(src_dir.join("harness.c"), HARNESS_C).unwrap();
        let tmp = dir.join(format!("harness-{key:016x}.tmp-{pid}"));
        let compile = |sanitize: bool| {
            let mut cmd = Command::new(c_compiler());
            cmd.args(CFLAGS);
            if sanitize {
                cmd.args(SANITIZE);
            }
            cmd.arg("-o")
                .arg(&tmp)
                .arg(src_dir.join("harness.c"))
                .output()
                .unwrap_or_else(|e| panic!("cannot run the C compiler {}: {e}", c_compiler()))
        };
        let out = compile(true);
        if !out.status.success() {
            let sanitized = String::from_utf8_lossy(&out.stderr).into_owned();
            let out = compile(false);
            assert!(
                out.status.success(),
                "the kernel does not compile as C:\n{}",
                String::from_utf8_lossy(&out.stderr)
            );
            eprintln!(
                "note: built the harness without sanitizers (the compiler refused them):\n\
                 {sanitized}"
            );
        }
        std::fs::rename(&tmp, &exe).unwrap();
        let _ = std::fs::remove_dir_all(&src_dir);
        exe
    })
}

struct Pool {
    page_bytes: u32,
    slots: u32,
    bytes: Vec<u8>,
}

impl Pool {
    fn page(&self, slot: u32) -> &[u8] {
        let pb = self.page_bytes as usize;
        &self.bytes[slot as usize * pb..(slot as usize + 1) * pb]
    }
}

enum Record<'a> {
    Transfer {
        alg: DigestAlgorithm,
        binding: DigestBinding,
        pools: &'a [Pool],
        pages: &'a [u32],
    },
    Raw {
        kind: u32,
        bytes: &'a [u8],
    },
    Fold {
        alg: DigestAlgorithm,
        binding: DigestBinding,
        nbufs: u32,
        npages: u32,
        page_digests: &'a [u64],
    },
}

#[derive(Debug, PartialEq)]
enum Output {
    /// Buffer digests, then page digests (buffer-major).
    Transfer(Vec<Digest128>, Vec<u64>),
    Raw(u128),
    Fold(Vec<Digest128>),
}

fn put32(v: &mut Vec<u8>, x: u32) {
    v.extend_from_slice(&x.to_le_bytes());
}

fn put64(v: &mut Vec<u8>, x: u64) {
    v.extend_from_slice(&x.to_le_bytes());
}

/// Runs the records through the kernel on the CPU.
fn run(records: &[Record<'_>]) -> Vec<Output> {
    static SEQ: AtomicU32 = AtomicU32::new(0);
    let mut input = Vec::new();
    for r in records {
        match r {
            Record::Transfer {
                alg,
                binding,
                pools,
                pages,
            } => {
                put32(&mut input, 1);
                put32(&mut input, u32::from(alg.0));
                put64(&mut input, binding.transfer_id.0);
                put64(&mut input, binding.nonce);
                put32(&mut input, pools.len() as u32);
                put32(&mut input, pages.len() as u32);
                for p in pools.iter() {
                    assert_eq!(p.bytes.len(), p.page_bytes as usize * p.slots as usize);
                    put32(&mut input, p.page_bytes);
                    put32(&mut input, p.slots);
                    input.extend_from_slice(&p.bytes);
                }
                for &p in pages.iter() {
                    put32(&mut input, p);
                }
            }
            Record::Raw { kind, bytes } => {
                put32(&mut input, 2);
                put32(&mut input, *kind);
                put64(&mut input, bytes.len() as u64);
                input.extend_from_slice(bytes);
            }
            Record::Fold {
                alg,
                binding,
                nbufs,
                npages,
                page_digests,
            } => {
                assert_eq!(page_digests.len(), (*nbufs * *npages) as usize);
                put32(&mut input, 3);
                put32(&mut input, u32::from(alg.0));
                put64(&mut input, binding.transfer_id.0);
                put64(&mut input, binding.nonce);
                put32(&mut input, *nbufs);
                put32(&mut input, *npages);
                for &d in page_digests.iter() {
                    put64(&mut input, d);
                }
            }
        }
    }
    let dir = work_dir();
    let name = format!(
        "case-{}-{}",
        std::process::id(),
        SEQ.fetch_add(1, Ordering::Relaxed)
    );
    let (in_path, out_path) = (
        dir.join(format!("{name}.in")),
        dir.join(format!("{name}.out")),
    );
    std::fs::write(&in_path, &input).unwrap();
    let status = Command::new(harness())
        .arg(&in_path)
        .arg(&out_path)
        // LeakSanitizer needs ptrace, which containers often forbid; leaks are not the point.
        .env("ASAN_OPTIONS", "detect_leaks=0:abort_on_error=0")
        .status()
        .expect("run the harness");
    assert!(status.success(), "harness failed ({status}) on {name}.in");
    let out = std::fs::read(&out_path).unwrap();
    let _ = std::fs::remove_file(&in_path);
    let _ = std::fs::remove_file(&out_path);

    let mut words = out
        .chunks_exact(8)
        .map(|c| u64::from_le_bytes(c.try_into().unwrap()));
    let d128 = |words: &mut dyn Iterator<Item = u64>| {
        let lo = words.next().expect("short output");
        let hi = words.next().expect("short output");
        u128::from(lo) | (u128::from(hi) << 64)
    };
    let outputs = records
        .iter()
        .map(|r| match r {
            Record::Transfer { pools, pages, .. } => {
                let buffers = (0..pools.len())
                    .map(|_| Digest128::from_u128(d128(&mut words)))
                    .collect();
                let pages = (0..pools.len() * pages.len())
                    .map(|_| words.next().expect("short output"))
                    .collect();
                Output::Transfer(buffers, pages)
            }
            Record::Raw { .. } => Output::Raw(d128(&mut words)),
            Record::Fold { nbufs, .. } => Output::Fold(
                (0..*nbufs)
                    .map(|_| Digest128::from_u128(d128(&mut words)))
                    .collect(),
            ),
        })
        .collect();
    assert!(words.next().is_none(), "harness wrote more than expected");
    outputs
}

/// `kvwire::checksum::digest_transfer` over the same pools and page list.
fn cpu_transfer(
    alg: DigestAlgorithm,
    binding: DigestBinding,
    pools: &[Pool],
    pages: &[u32],
) -> Output {
    let d = digest_transfer(alg, binding, pools.len(), pages.len(), true, |b, i| {
        pools[b].page(pages[i])
    })
    .unwrap();
    Output::Transfer(d.buffers, d.pages)
}

// ---------------------------------------------------------------------------------------
// Test data.

/// The project's test page content (src/checksum/tests.rs, SPEC.md §6): byte `j` of page `i`
/// of buffer `b` is `(j*131 + i*17 + b*29 + 7) % 251`.
fn pat(b: usize, i: usize, len: usize) -> Vec<u8> {
    (0..len)
        .map(|j| ((j * 131 + i * 17 + b * 29 + 7) % 251) as u8)
        .collect()
}

/// xxHash's sanity-test buffer (cli/xsum_sanity_check.c, `XSUM_fillTestBuffer`).
fn xxhash_sanity_buffer(len: usize) -> Vec<u8> {
    const PRIME32: u64 = 2_654_435_761;
    const PRIME64: u64 = 11_400_714_785_074_694_797;
    let mut gen = PRIME32;
    (0..len)
        .map(|_| {
            let byte = (gen >> 56) as u8;
            gen = gen.wrapping_mul(PRIME64);
            byte
        })
        .collect()
}

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    fn bytes(&mut self, len: usize) -> Vec<u8> {
        (0..len).map(|_| self.next() as u8).collect()
    }

    fn shuffle(&mut self, v: &mut [u32]) {
        for i in (1..v.len()).rev() {
            v.swap(i, self.below(i as u64 + 1) as usize);
        }
    }
}

/// Page lengths: every XXH3 length class and its edges (0, 1-3, 4-8, 9-16, 17-128 with its
/// 32/64/96 steps, 129-240, > 240), the long loop's block and round edges (1 KiB blocks, 32
/// blocks per round), CRC chunk edges (16 * 128 = 2048), and odd sizes.
const LENGTHS: &[u32] = &[
    0, 1, 2, 3, 4, 5, 7, 8, 9, 12, 15, 16, 17, 31, 32, 33, 63, 64, 65, 95, 96, 97, 127, 128, 129,
    130, 144, 159, 160, 200, 239, 240, 241, 242, 255, 256, 257, 319, 320, 1000, 1023, 1024, 1025,
    1026, 1087, 1088, 1089, 2047, 2048, 2049, 2063, 2064, 4095, 4096, 4097, 8191, 12_345, 32_767,
    32_768, 32_769, 33_793, 65_535, 65_536, 65_537, 100_003, 1_048_579,
];

// ---------------------------------------------------------------------------------------
// The project's golden vectors.

/// `XSUM_XXH3_testdata` and `XSUM_XXH128_testdata` (seed 0), as in src/checksum/tests.rs,
/// plus the CRC-32/ISO-HDLC check values: through the kernel's block programs.
#[test]
fn golden_primitive_vectors() {
    const XXH3_64: &[(usize, u64)] = &[
        (0, 0x2D06_8005_38D3_94C2),
        (1, 0xC44B_DFF4_074E_ECDB),
        (6, 0x27B5_6A84_CD2D_7325),
        (12, 0xA713_DAF0_DFBB_77E7),
        (24, 0xA3FE_70BF_9D35_10EB),
        (48, 0x397D_A259_ECBA_1F11),
        (80, 0xBCDE_FBBB_2C47_C90A),
        (195, 0xCD94_217E_E362_EC3A),
        (403, 0xCDEB_804D_65C6_DEA4),
        (512, 0x617E_4959_9013_CB6B),
        (2048, 0xDD59_E2C3_A5F0_38E0),
        (2240, 0x6E73_A905_39CF_2948),
        (2367, 0xCB37_AEB9_E5D3_61ED),
    ];
    const XXH3_128: &[(usize, u64, u64)] = &[
        (0, 0x6001_C324_468D_497F, 0x99AA_06D3_0147_98D8),
        (1, 0xC44B_DFF4_074E_ECDB, 0xA6CD_5E93_9200_0F6A),
        (6, 0x3E70_39BD_DA43_CFC6, 0x082A_FE0B_8162_D12A),
        (12, 0x061A_1927_13F6_9AD9, 0x6E3E_FD8F_C780_2B18),
        (24, 0x1E70_44D2_8B1B_901D, 0x0CE9_66E4_678D_3761),
        (48, 0xF942_219A_ED80_F67B, 0xA002_AC4E_5478_227E),
        (81, 0x5E8B_AFB9_F95F_B803, 0x4952_F581_81AB_0042),
        (222, 0xF1AE_BD59_7CEC_6B3A, 0x337E_0964_1B94_8717),
        (403, 0xCDEB_804D_65C6_DEA4, 0x1B6D_E21E_332D_D73D),
        (512, 0x617E_4959_9013_CB6B, 0x18D2_D110_DCC9_BCA1),
        (2048, 0xDD59_E2C3_A5F0_38E0, 0xF736_557F_D470_73A5),
        (2240, 0x6E73_A905_39CF_2948, 0xCCB1_34FB_FA7C_E49D),
        (2367, 0xCB37_AEB9_E5D3_61ED, 0xE89C_0F6F_F369_B427),
    ];
    const CRC32: &[(&[u8], u32)] = &[
        (b"123456789", 0xCBF4_3926),
        (b"", 0),
        (b"The quick brown fox jumps over the lazy dog", 0x414F_A339),
    ];
    let buf = xxhash_sanity_buffer(4096 + 64 + 1);
    let mut records = Vec::new();
    for &(len, _) in XXH3_64 {
        records.push(Record::Raw {
            kind: KIND_XXH3_64,
            bytes: &buf[..len],
        });
    }
    for &(len, _, _) in XXH3_128 {
        records.push(Record::Raw {
            kind: KIND_XXH3_128,
            bytes: &buf[..len],
        });
    }
    for &(bytes, _) in CRC32 {
        records.push(Record::Raw {
            kind: KIND_CRC32,
            bytes,
        });
    }
    let got = run(&records);
    let want = XXH3_64
        .iter()
        .map(|&(_, h)| Output::Raw(u128::from(h)))
        .chain(
            XXH3_128
                .iter()
                .map(|&(_, lo, hi)| Output::Raw(u128::from(lo) | (u128::from(hi) << 64))),
        )
        .chain(CRC32.iter().map(|&(_, c)| Output::Raw(u128::from(c))));
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert_eq!(g, &w, "vector {i}");
    }
}

/// Every golden buffer digest of src/checksum/tests.rs (and SPEC.md §6's table).
#[test]
fn golden_buffer_digests() {
    const T: u64 = 0x0123_4567_89AB_CDEF;
    const N: u64 = 0xFEDC_BA98_7654_3210;
    let bind = DigestBinding {
        transfer_id: TransferId(T),
        nonce: N,
    };
    let d = Digest128::from_u128;

    // Empty buffer (P = 0), both algorithms.
    let one_slot = [Pool {
        page_bytes: 4096,
        slots: 1,
        bytes: vec![0; 4096],
    }];
    for (alg, want) in [
        (XXH, 0xc2a2c6af6b3c47e122bff5b8a5394288),
        (CRC, 0xfd978dd67157fef9e9aa94bb30c63331),
    ] {
        let got = run(&[Record::Transfer {
            alg,
            binding: bind,
            pools: &one_slot,
            pages: &[],
        }]);
        assert_eq!(got, [Output::Transfer(vec![d(want)], vec![])], "{alg}");
    }

    // Buffer 3 of a transfer, three 4 KiB test pages.
    let pools: Vec<Pool> = (0..4)
        .map(|b| Pool {
            page_bytes: 4096,
            slots: 3,
            bytes: (0..3).flat_map(|i| pat(b, i, 4096)).collect(),
        })
        .collect();
    for (alg, pages, buffer) in [
        (
            XXH,
            [0x719ee87b4d856707, 0x8a5019b50a3d3259, 0x29ec9c85fa5a55f8],
            0x6186d9b8aec70e560eb1914b5d5cebea,
        ),
        (
            CRC,
            [0x2bed56cf, 0x285ae0ae, 0xebe44ef9],
            0x8f20a49d05f3d22b94ab80a10f62fdd0,
        ),
    ] {
        let got = run(&[Record::Transfer {
            alg,
            binding: bind,
            pools: &pools,
            pages: &[0, 1, 2],
        }]);
        let Output::Transfer(buffers, page_digests) = &got[0] else {
            unreachable!()
        };
        assert_eq!(buffers[3], d(buffer), "{alg}");
        assert_eq!(page_digests[9..12], pages, "{alg}");
    }

    // Mixed page lengths 0, 1, 240, 241, 65536 in one buffer (buffer 1, binding (7, 42)):
    // page digests through the page programs, the buffer digest through the buffer program.
    let bind = DigestBinding {
        transfer_id: TransferId(7),
        nonce: 42,
    };
    let pages: Vec<Vec<u8>> = [0usize, 1, 240, 241, 65536]
        .iter()
        .enumerate()
        .map(|(i, &n)| pat(1, i, n))
        .collect();
    for (alg, kind, page_digests, buffer) in [
        (
            XXH,
            KIND_XXH3_64,
            [
                0x2d06800538d394c2u64,
                0xdedb980100c87e72,
                0x427d384b82b86797,
                0x0355cf309a0de96b,
                0xd939f145270f1223,
            ],
            0xe3079d1c57ef000daa4765624d8ea0aa,
        ),
        (
            CRC,
            KIND_CRC32,
            [0x0, 0x84b12bae, 0x3585308e, 0xa0ecb62d, 0x93515326],
            0xb07ca6e0c0b813115cf051d9a930eb57,
        ),
    ] {
        let raw: Vec<Record<'_>> = pages
            .iter()
            .map(|p| Record::Raw { kind, bytes: p })
            .collect();
        let got: Vec<Output> = run(&raw);
        let want: Vec<Output> = page_digests
            .iter()
            .map(|&p| Output::Raw(u128::from(p)))
            .collect();
        assert_eq!(got, want, "{alg}");
        // Buffer 0 gets arbitrary digests; buffer 1 the golden ones.
        let mut two = vec![0x1111u64; 5];
        two.extend_from_slice(&page_digests);
        let got = run(&[Record::Fold {
            alg,
            binding: bind,
            nbufs: 2,
            npages: 5,
            page_digests: &two,
        }]);
        let Output::Fold(buffers) = &got[0] else {
            unreachable!()
        };
        assert_eq!(buffers[1], d(buffer), "{alg}");
    }

    // digest_transfer: 2 buffers x 3 pages x 1000 bytes, binding (1, 2).
    let bind = DigestBinding {
        transfer_id: TransferId(1),
        nonce: 2,
    };
    let pools: Vec<Pool> = (0..2)
        .map(|b| Pool {
            page_bytes: 1000,
            slots: 3,
            bytes: (0..3).flat_map(|i| pat(b, i, 1000)).collect(),
        })
        .collect();
    let golden = [
        (
            XXH,
            [
                0x3fef5235feb8b4b59348192cdb5b3f9a,
                0x883057f56cf9203a223c8663e7634e66,
            ],
            vec![
                0x7b7c853ec74de9cd,
                0xd51dc26d93a2b622,
                0x0f6c8df7e9e869c1,
                0x1bf8a3cfb0b6a517,
                0x8e6d5745f03d69e8,
                0xbb67ab5bf2feb870,
            ],
        ),
        (
            CRC,
            [
                0xd839ae571165b80b23d27da4bf5612e6,
                0x5be2e49329be7e514a8b2b0e7e5cbb21,
            ],
            vec![
                0x77e57f86, 0x08217863, 0xfc139944, 0x10166c16, 0x8ee3109d, 0xec1122e5,
            ],
        ),
    ];
    for (alg, buffers, pages) in golden {
        let got = run(&[Record::Transfer {
            alg,
            binding: bind,
            pools: &pools,
            pages: &[0, 1, 2],
        }]);
        assert_eq!(
            got,
            [Output::Transfer(
                buffers.iter().map(|&b| d(b)).collect(),
                pages
            )],
            "{alg}"
        );
    }
}

// ---------------------------------------------------------------------------------------
// Random data against the CPU implementation.

/// XXH3-64, XXH3-128 and CRC-32 of every length 0..=600 and of every length in [`LENGTHS`],
/// through the block programs, against xxhash-rust and crc32fast.
#[test]
fn raw_hashes_equal_reference_implementations() {
    let mut rng = Rng(0x0DDB_1A5E_5BAD_5EED);
    let lengths: Vec<usize> = (0..=600)
        .chain(LENGTHS.iter().map(|&n| n as usize))
        .collect();
    let inputs: Vec<Vec<u8>> = lengths.iter().map(|&n| rng.bytes(n)).collect();
    let mut records = Vec::new();
    for bytes in &inputs {
        for kind in [KIND_XXH3_64, KIND_CRC32, KIND_XXH3_128] {
            records.push(Record::Raw { kind, bytes });
        }
    }
    let got = run(&records);
    let mut got = got.iter();
    for bytes in &inputs {
        let len = bytes.len();
        let want = [
            u128::from(xxh3_64(bytes)),
            u128::from(crc32fast::hash(bytes)),
            xxh3_128(bytes),
        ];
        for (name, w) in ["XXH3-64", "CRC-32", "XXH3-128"].iter().zip(want) {
            assert_eq!(
                got.next().unwrap(),
                &Output::Raw(w),
                "{name} of {len} bytes"
            );
        }
    }
}

/// Whole transfers (several buffers of different page sizes, random page slots, page lists
/// in random order) for both algorithms, against `digest_transfer`.
#[test]
fn transfers_equal_digest_transfer() {
    let mut rng = Rng(0xC0FF_EE00_1234_5678);
    // Buffers of every page length in LENGTHS, 3 or 4 per transfer.
    let mut transfers: Vec<(Vec<Pool>, Vec<u32>)> = Vec::new();
    for group in LENGTHS.chunks(4) {
        let slots = if group.iter().any(|&n| n > 100_000) {
            3
        } else {
            1 + rng.below(6) as u32
        };
        let pools: Vec<Pool> = group
            .iter()
            .map(|&page_bytes| Pool {
                page_bytes,
                slots,
                bytes: rng.bytes(page_bytes as usize * slots as usize),
            })
            .collect();
        // A random non-empty selection of slots (always including the last slot, so a read
        // past a page's end runs off the allocation), in random order.
        let mut pages: Vec<u32> = (0..slots).collect();
        rng.shuffle(&mut pages);
        let keep = 1 + rng.below(u64::from(slots)) as usize;
        pages.truncate(keep);
        if !pages.contains(&(slots - 1)) {
            pages[0] = slots - 1;
        }
        transfers.push((pools, pages));
    }
    for alg in ALGS {
        let bindings: Vec<DigestBinding> = transfers
            .iter()
            .map(|_| DigestBinding {
                transfer_id: TransferId(rng.next()),
                nonce: rng.next(),
            })
            .collect();
        let records: Vec<Record<'_>> = transfers
            .iter()
            .zip(&bindings)
            .map(|((pools, pages), &binding)| Record::Transfer {
                alg,
                binding,
                pools,
                pages,
            })
            .collect();
        let got = run(&records);
        for (((pools, pages), &binding), got) in transfers.iter().zip(&bindings).zip(&got) {
            let sizes: Vec<u32> = pools.iter().map(|p| p.page_bytes).collect();
            assert_eq!(
                got,
                &cpu_transfer(alg, binding, pools, pages),
                "{alg}, page sizes {sizes:?}, pages {pages:?}"
            );
        }
    }
}

/// Buffer-digest inputs of every length class: 25 + 12 P bytes for P = 0..=20 (short paths,
/// the 128- and 240-byte edges at P = 8/9 and 17/18), then long inputs up to several rounds
/// of the long loop (P = 2731 gives 32 797 bytes: 33 blocks, two rounds).
#[test]
fn buffer_digest_inputs_of_every_length() {
    let mut rng = Rng(0xFEED_FACE_CAFE_BEEF);
    let page_counts: Vec<u32> = (0..=20)
        .chain([85, 86, 100, 170, 171, 2730, 2731, 3000])
        .collect();
    for alg in ALGS {
        let cases: Vec<(Vec<Pool>, Vec<u32>, DigestBinding)> = page_counts
            .iter()
            .map(|&p| {
                let slots = p.max(1);
                // Small pages keep the many-page cases cheap; two buffers per transfer.
                let pools = [5u32, 16]
                    .iter()
                    .map(|&page_bytes| Pool {
                        page_bytes,
                        slots,
                        bytes: rng.bytes(page_bytes as usize * slots as usize),
                    })
                    .collect();
                let mut pages: Vec<u32> = (0..slots).collect();
                rng.shuffle(&mut pages);
                pages.truncate(p as usize);
                let binding = DigestBinding {
                    transfer_id: TransferId(rng.next()),
                    nonce: rng.next(),
                };
                (pools, pages, binding)
            })
            .collect();
        let records: Vec<Record<'_>> = cases
            .iter()
            .map(|(pools, pages, binding)| Record::Transfer {
                alg,
                binding: *binding,
                pools,
                pages,
            })
            .collect();
        let got = run(&records);
        for ((pools, pages, binding), got) in cases.iter().zip(&got) {
            assert_eq!(
                got,
                &cpu_transfer(alg, *binding, pools, pages),
                "{alg}, {} pages",
                pages.len()
            );
        }
    }
}

// ---------------------------------------------------------------------------------------
// The GPU-only part of the source.

/// The part of the source only NVRTC compiles (the `__global__` entry points and the barrier
/// loop) is valid C++ with the CUDA keywords stubbed out (`tests/gpu_kernel_cpu/cuda_stubs.h`).
/// Needs a C++ compiler (`$CXX` or `c++`); skips without one unless `KVWIRE_REQUIRE_CXX=1`.
#[test]
fn gpu_branch_is_valid_cxx() {
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
    let require = std::env::var("KVWIRE_REQUIRE_CXX").is_ok_and(|v| v == "1");
    let dir = work_dir().join(format!("cxx-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("kvwd_kernel.cu"), KERNEL_SOURCE).unwrap();
    std::fs::write(dir.join("cuda_stubs.h"), CUDA_STUBS_H).unwrap();
    let out = Command::new(&cxx)
        .args([
            "-std=c++17",
            "-fsyntax-only",
            "-Wall",
            "-Wextra",
            "-Werror",
            "-Wno-unknown-pragmas",
            "-x",
            "c++",
            "-include",
        ])
        .arg(dir.join("cuda_stubs.h"))
        .arg(dir.join("kvwd_kernel.cu"))
        .output();
    let _ = std::fs::remove_dir_all(&dir);
    match out {
        Ok(out) if out.status.success() => {}
        Ok(out) if String::from_utf8_lossy(&out.stderr).contains("cc1plus") && !require => {
            println!("SKIPPED: {cxx} cannot compile C++ (no cc1plus)");
        }
        Ok(out) => panic!(
            "the GPU branch of the kernel is not valid C++:\n{}",
            String::from_utf8_lossy(&out.stderr)
        ),
        Err(e) if !require => println!("SKIPPED: no C++ compiler {cxx}: {e}"),
        Err(e) => panic!("KVWIRE_REQUIRE_CXX=1 but {cxx} cannot run: {e}"),
    }
}
