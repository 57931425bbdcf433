/*
 * kvwire GPU digest kernels: the page and buffer digests of proto/SPEC.md section 6
 * (normative text also in src/checksum/mod.rs), computed where the KV pages live.
 *
 * One source, two compilers:
 *
 *  - NVRTC (defines __CUDACC_RTC__) compiles it for the GPU at run time
 *    (src/gpu/cuda.rs). NVRTC has no standard headers, so nothing is included.
 *  - Any C11 or C++ host compiler compiles it as plain code; the block-level programs then
 *    run on the CPU, one "thread" after another (the kvwd_cpu_* functions at the end).
 *    tests/gpu_kernel_cpu.rs does exactly that and compares every digest with
 *    kvwire::checksum.
 *
 * Execution model. Every thread block of KVWD_THREADS threads runs one JOB (one page, or one
 * buffer's digest input) as a sequence of STEPS: every thread runs kvwd_step(job, step, t),
 * then the block synchronises, and the next step follows while kvwd_step returned 1 (the
 * value is the same for every thread of the block). Data passes between steps only through
 * the block's KvShared. On the GPU the loop is kvwd_run_block (__syncthreads between
 * steps); on the CPU it is kvwd_cpu_run_block (all threads of a step, in a chosen order,
 * before the next step). Everything but those two loops and the three __global__ entry
 * points is shared code.
 *
 * Layout (KVWD_THREADS = 128 threads per page; one launch covers every page of a transfer):
 *
 *  - XXH3-64, pages longer than 240 bytes. XXH3's long loop is: per 1 KiB block, 16
 *    stripes of 64 bytes add into 8 accumulator lanes, then a scramble. The adds commute,
 *    so a block's contribution S_k (per lane) is independent of the accumulators: 32 groups
 *    of 4 threads (thread t: group t/4, lanes 2(t%4) and 2(t%4)+1) each sum one block's 16
 *    stripes, 16 bytes per thread per stripe, 32 blocks (32 KiB) per round; then 8 threads
 *    (one per lane) run the cheap sequential chain acc = scramble(acc + S_k) over those 32
 *    blocks. The partial last block and XXH3's overlapping last stripe are the (nb_blocks)th
 *    "block", added without a scramble. Thread 0 merges the lanes into the digest.
 *  - XXH3-64, pages of 0..240 bytes: thread 0 alone (no loop worth splitting).
 *  - CRC-32: the page is cut into 128 chunks, right-aligned so that chunks 1..127 have the
 *    same length c (a multiple of 16) and chunk 0 takes the rest. Each thread runs
 *    slicing-by-8 over its chunk (chunk 0 from the initial register 0xFFFFFFFF, the others
 *    from 0), then a 7-level tree combines neighbours: reg(A||B) = reg(A) * x^(8|B|) mod P
 *    xor reg(B), where every right-hand part at level l has 2^l * c bytes, so each level
 *    needs one operator x^(8c 2^l) mod P (computed in step 0).
 *  - Buffer digests (second, small launch, one block per buffer): XXH3-128 of the SPEC's
 *    byte string "KVWD" || alg || transfer_id || nonce || b || (i || page digest i)*, read
 *    straight from the page-digest array (KvSrc.virt), through the same long loop (or the
 *    scalar short paths up to 240 bytes), merged with both XXH3-128 merges; 0 maps to 1.
 *
 * Loads: 8-byte loads where the address is 8-byte aligned, bytes otherwise, so any page
 * size and base works. Device memory is read only; each block writes only its own output
 * words.
 */

#ifdef __CUDACC_RTC__
#define KV_DEV static __device__
#define KV_CONST __constant__
#define KV_UNROLL _Pragma("unroll")
#else
#define KV_DEV static
#define KV_CONST static const
#define KV_UNROLL
#endif

typedef unsigned char kv_u8;
typedef unsigned int kv_u32;
typedef unsigned long long kv_u64;

#ifndef __CUDACC_RTC__
/* Host build: the aligned 8-byte loads below assume a little-endian machine, like the GPU. */
typedef char kv_check_u64_size[(sizeof(kv_u64) == 8 && sizeof(kv_u32) == 4) ? 1 : -1];
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the CPU path of the kvwire digest kernel needs a little-endian host"
#endif
#endif

/* Threads per block (a power of two: the CRC tree has log2 levels) and XXH3 groups. */
#define KVWD_THREADS 128
#define KVWD_GROUPS 32
#define KVWD_CRC_LEVELS 7

/* DigestAlgorithm codes (SPEC.md section 3, digest algorithms). */
#define KVWD_ALG_XXH3_64 1
#define KVWD_ALG_CRC32 2

/* Job kinds. */
#define KVWD_JOB_XXH3_64 0
#define KVWD_JOB_CRC32 1
#define KVWD_JOB_XXH3_128 2

/* The CRC slicing tables: 8 x 256 words, filled once by kvwd_crc_tables. */
#define KVWD_CRC_TABLE_WORDS 2048
#define KVWD_CRC_POLY 0xEDB88320u

#define KV_P32_1 0x9E3779B1ULL
#define KV_P32_2 0x85EBCA77ULL
#define KV_P32_3 0xC2B2AE3DULL
#define KV_P64_1 0x9E3779B185EBCA87ULL
#define KV_P64_2 0xC2B2AE3D27D4EB4FULL
#define KV_P64_3 0x165667B19E3779F9ULL
#define KV_P64_4 0x85EBCA77C2B2AE63ULL
#define KV_P64_5 0x27D4EB2F165667C5ULL
#define KV_PRIME_MX1 0x165667919E3779F9ULL
#define KV_PRIME_MX2 0x9FB21C651E98DF25ULL

#define KV_STRIPE 64
#define KV_BLOCK 1024 /* 16 stripes: the default secret's block length */
#define KV_STRIPES_PER_BLOCK 16
#define KV_SECRET_SIZE 192
#define KV_MID_SIZE_MAX 240

/* XXH3's default secret (kSecret). */
KV_CONST kv_u8 KV_SECRET[KV_SECRET_SIZE] = {
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c,
    0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f,
    0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21,
    0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c,
    0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3,
    0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8,
    0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d,
    0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64,
    0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb,
    0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e,
    0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce,
    0x45, 0xcb, 0x3a, 0x8f, 0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e,
};

/* XXH3's initial accumulators (XXH3_INIT_ACC). */
KV_CONST kv_u64 KV_INIT_ACC[8] = {
    KV_P32_3, KV_P64_1, KV_P64_2, KV_P64_3, KV_P64_4, KV_P32_2, KV_P64_5, KV_P32_1,
};

/* One buffer of a transfer, as the host passes it: page p of this buffer is the
 * page_bytes bytes at base + p * page_bytes. */
typedef struct {
    kv_u64 base;
    kv_u64 page_bytes;
} KvwdBuffer;

/* The bytes a job hashes: a page in memory, or (virt) the buffer-digest input of
 * SPEC.md section 6, produced on the fly from a header and the page digests. */
typedef struct {
    const kv_u8* bytes;    /* !virt: the page */
    const kv_u64* digests; /* virt: this buffer's page digests, ordinal order */
    kv_u64 len;
    kv_u32 virt;
    kv_u8 head[25]; /* virt: "KVWD" alg transfer_id nonce buffer */
} KvSrc;

typedef struct {
    KvSrc src;
    kv_u32 kind;          /* KVWD_JOB_* */
    kv_u32 nonzero;       /* map a 128-bit result of 0 to 1 (buffer digests) */
    kv_u64* out;          /* 1 word (64-bit digests) or 2 words (low, high) */
    const kv_u32* crc_tab; /* KVWD_CRC_TABLE_WORDS words, for KVWD_JOB_CRC32 */
} KvJob;

/* Per-block state that lives across steps (shared memory on the GPU, about 3 KiB). */
typedef struct {
    kv_u64 secret[KV_SECRET_SIZE / 8]; /* the secret as little-endian words */
    kv_u64 lastkey[8];                 /* secret + 121: the last stripe's key (unaligned) */
    kv_u64 acc[8];
    kv_u64 sums[KVWD_GROUPS][8]; /* per-block stripe sums of the current round */
    kv_u32 crc[KVWD_THREADS];    /* CRC registers of the chunks, then of the tree nodes */
    kv_u32 op[KVWD_CRC_LEVELS];  /* x^(8 c 2^l) mod P */
} KvShared;

/* ---------------------------------------------------------------------------------------
 * Scalar helpers (portable: the 64x64->128 multiply is the same code on GPU and CPU). */

KV_DEV kv_u64 kv_rotl64(kv_u64 v, kv_u32 r) { return (v << r) | (v >> (64 - r)); }
KV_DEV kv_u32 kv_rotl32(kv_u32 v, kv_u32 r) { return (v << r) | (v >> (32 - r)); }

KV_DEV kv_u64 kv_swap64(kv_u64 v) {
    v = ((v << 8) & 0xFF00FF00FF00FF00ULL) | ((v >> 8) & 0x00FF00FF00FF00FFULL);
    v = ((v << 16) & 0xFFFF0000FFFF0000ULL) | ((v >> 16) & 0x0000FFFF0000FFFFULL);
    return (v << 32) | (v >> 32);
}

KV_DEV kv_u32 kv_swap32(kv_u32 v) {
    return (v << 24) | ((v << 8) & 0x00FF0000u) | ((v >> 8) & 0x0000FF00u) | (v >> 24);
}

/* Full 128-bit product of a and b: returns the low 64 bits, *hi the high 64 bits. */
KV_DEV kv_u64 kv_mul128(kv_u64 a, kv_u64 b, kv_u64* hi) {
    kv_u64 lo_lo = (a & 0xFFFFFFFFULL) * (b & 0xFFFFFFFFULL);
    kv_u64 hi_lo = (a >> 32) * (b & 0xFFFFFFFFULL);
    kv_u64 lo_hi = (a & 0xFFFFFFFFULL) * (b >> 32);
    kv_u64 hi_hi = (a >> 32) * (b >> 32);
    kv_u64 cross = (lo_lo >> 32) + (hi_lo & 0xFFFFFFFFULL) + lo_hi;
    *hi = (hi_lo >> 32) + (cross >> 32) + hi_hi;
    return (cross << 32) | (lo_lo & 0xFFFFFFFFULL);
}

KV_DEV kv_u64 kv_fold64(kv_u64 a, kv_u64 b) {
    kv_u64 hi;
    kv_u64 lo = kv_mul128(a, b, &hi);
    return lo ^ hi;
}

/* XXH64's avalanche. */
KV_DEV kv_u64 kv_avalanche64(kv_u64 h) {
    h ^= h >> 33;
    h *= KV_P64_2;
    h ^= h >> 29;
    h *= KV_P64_3;
    h ^= h >> 32;
    return h;
}

/* XXH3's avalanche. */
KV_DEV kv_u64 kv_avalanche3(kv_u64 h) {
    h ^= h >> 37;
    h *= KV_PRIME_MX1;
    h ^= h >> 32;
    return h;
}

KV_DEV kv_u64 kv_rrmxmx(kv_u64 h, kv_u64 len) {
    h ^= kv_rotl64(h, 49) ^ kv_rotl64(h, 24);
    h *= KV_PRIME_MX2;
    h ^= (h >> 35) + len;
    h *= KV_PRIME_MX2;
    h ^= h >> 28;
    return h;
}

KV_DEV kv_u64 kv_sec64(kv_u32 off) {
    kv_u64 v = 0;
    for (kv_u32 i = 0; i < 8; i++) v |= (kv_u64)KV_SECRET[off + i] << (8 * i);
    return v;
}

KV_DEV kv_u64 kv_sec32(kv_u32 off) {
    kv_u64 v = 0;
    for (kv_u32 i = 0; i < 4; i++) v |= (kv_u64)KV_SECRET[off + i] << (8 * i);
    return v;
}

/* ---------------------------------------------------------------------------------------
 * Reading a source. */

KV_DEV kv_u32 kv_byte(const KvSrc* s, kv_u64 o) {
    if (!s->virt) return s->bytes[o];
    if (o < 25) return s->head[o];
    o -= 25;
    kv_u64 rec = o / 12;
    kv_u32 k = (kv_u32)(o - rec * 12);
    if (k < 4) return (kv_u32)(rec >> (8 * k)) & 0xFFu; /* ordinal, u32 LE */
    return (kv_u32)(s->digests[rec] >> (8 * (k - 4))) & 0xFFu; /* page digest, u64 LE */
}

KV_DEV kv_u64 kv_rd64(const KvSrc* s, kv_u64 o) {
    if (!s->virt) {
        const kv_u8* p = s->bytes + o;
        if ((((kv_u64)p) & 7) == 0) return *(const kv_u64*)p;
    }
    kv_u64 v = 0;
    for (kv_u32 i = 0; i < 8; i++) v |= (kv_u64)kv_byte(s, o + i) << (8 * i);
    return v;
}

KV_DEV kv_u64 kv_rd32(const KvSrc* s, kv_u64 o) {
    kv_u64 v = 0;
    for (kv_u32 i = 0; i < 4; i++) v |= (kv_u64)kv_byte(s, o + i) << (8 * i);
    return v;
}

/* ---------------------------------------------------------------------------------------
 * XXH3, inputs of 0..240 bytes, seed 0 (one thread). */

KV_DEV kv_u64 kv_mix16(const KvSrc* s, kv_u64 off, kv_u32 soff) {
    kv_u64 lo = kv_rd64(s, off) ^ kv_sec64(soff);
    kv_u64 hi = kv_rd64(s, off + 8) ^ kv_sec64(soff + 8);
    return kv_fold64(lo, hi);
}

KV_DEV kv_u64 kv_xxh3_64_short(const KvSrc* s) {
    kv_u64 len = s->len;
    if (len <= 16) {
        if (len > 8) {
            kv_u64 flip1 = kv_sec64(24) ^ kv_sec64(32);
            kv_u64 flip2 = kv_sec64(40) ^ kv_sec64(48);
            kv_u64 lo = kv_rd64(s, 0) ^ flip1;
            kv_u64 hi = kv_rd64(s, len - 8) ^ flip2;
            kv_u64 acc = len + kv_swap64(lo) + hi + kv_fold64(lo, hi);
            return kv_avalanche3(acc);
        }
        if (len >= 4) {
            kv_u64 in1 = kv_rd32(s, 0);
            kv_u64 in2 = kv_rd32(s, len - 4);
            kv_u64 flip = kv_sec64(8) ^ kv_sec64(16);
            kv_u64 keyed = (in2 + (in1 << 32)) ^ flip;
            return kv_rrmxmx(keyed, len);
        }
        if (len > 0) {
            kv_u32 c1 = kv_byte(s, 0), c2 = kv_byte(s, len >> 1), c3 = kv_byte(s, len - 1);
            kv_u32 combo = (c1 << 16) | (c2 << 24) | c3 | ((kv_u32)len << 8);
            kv_u64 flip = kv_sec32(0) ^ kv_sec32(4);
            return kv_avalanche64((kv_u64)combo ^ flip);
        }
        return kv_avalanche64(kv_sec64(56) ^ kv_sec64(64));
    }
    kv_u64 acc = len * KV_P64_1;
    if (len <= 128) {
        if (len > 32) {
            if (len > 64) {
                if (len > 96) {
                    acc += kv_mix16(s, 48, 96);
                    acc += kv_mix16(s, len - 64, 112);
                }
                acc += kv_mix16(s, 32, 64);
                acc += kv_mix16(s, len - 48, 80);
            }
            acc += kv_mix16(s, 16, 32);
            acc += kv_mix16(s, len - 32, 48);
        }
        acc += kv_mix16(s, 0, 0);
        acc += kv_mix16(s, len - 16, 16);
        return kv_avalanche3(acc);
    }
    /* 129..240 */
    kv_u32 rounds = (kv_u32)(len / 16);
    for (kv_u32 i = 0; i < 8; i++) acc += kv_mix16(s, 16 * i, 16 * i);
    acc = kv_avalanche3(acc);
    for (kv_u32 i = 8; i < rounds; i++) acc += kv_mix16(s, 16 * i, 16 * (i - 8) + 3);
    acc += kv_mix16(s, len - 16, 136 - 17);
    return kv_avalanche3(acc);
}

KV_DEV void kv_mix32(kv_u64* a0, kv_u64* a1, const KvSrc* s, kv_u64 o1, kv_u64 o2, kv_u32 soff) {
    *a0 += kv_mix16(s, o1, soff);
    *a0 ^= kv_rd64(s, o2) + kv_rd64(s, o2 + 8);
    *a1 += kv_mix16(s, o2, soff + 16);
    *a1 ^= kv_rd64(s, o1) + kv_rd64(s, o1 + 8);
}

/* Low 64 bits returned, high 64 bits in *hi. */
KV_DEV kv_u64 kv_xxh3_128_short(const KvSrc* s, kv_u64* hi) {
    kv_u64 len = s->len;
    if (len <= 16) {
        if (len > 8) {
            kv_u64 flip_lo = kv_sec64(32) ^ kv_sec64(40);
            kv_u64 flip_hi = kv_sec64(48) ^ kv_sec64(56);
            kv_u64 in_lo = kv_rd64(s, 0);
            kv_u64 in_hi = kv_rd64(s, len - 8);
            kv_u64 m_hi;
            kv_u64 m_lo = kv_mul128(in_lo ^ in_hi ^ flip_lo, KV_P64_1, &m_hi);
            m_lo += (len - 1) << 54;
            in_hi ^= flip_hi;
            m_hi += in_hi + (in_hi & 0xFFFFFFFFULL) * (KV_P32_2 - 1);
            m_lo ^= kv_swap64(m_hi);
            kv_u64 r_hi;
            kv_u64 r_lo = kv_mul128(m_lo, KV_P64_2, &r_hi);
            r_hi += m_hi * KV_P64_2;
            *hi = kv_avalanche3(r_hi);
            return kv_avalanche3(r_lo);
        }
        if (len >= 4) {
            kv_u64 in_lo = kv_rd32(s, 0);
            kv_u64 in_hi = kv_rd32(s, len - 4);
            kv_u64 flip = kv_sec64(16) ^ kv_sec64(24);
            kv_u64 keyed = (in_lo + (in_hi << 32)) ^ flip;
            kv_u64 m_hi;
            kv_u64 m_lo = kv_mul128(keyed, KV_P64_1 + (len << 2), &m_hi);
            m_hi += m_lo << 1;
            m_lo ^= m_hi >> 3;
            m_lo ^= m_lo >> 35;
            m_lo *= KV_PRIME_MX2;
            m_lo ^= m_lo >> 28;
            *hi = kv_avalanche3(m_hi);
            return m_lo;
        }
        if (len > 0) {
            kv_u32 c1 = kv_byte(s, 0), c2 = kv_byte(s, len >> 1), c3 = kv_byte(s, len - 1);
            kv_u32 in_lo = (c1 << 16) | (c2 << 24) | c3 | ((kv_u32)len << 8);
            kv_u32 in_hi = kv_rotl32(kv_swap32(in_lo), 13);
            kv_u64 flip_lo = kv_sec32(0) ^ kv_sec32(4);
            kv_u64 flip_hi = kv_sec32(8) ^ kv_sec32(12);
            *hi = kv_avalanche64((kv_u64)in_hi ^ flip_hi);
            return kv_avalanche64((kv_u64)in_lo ^ flip_lo);
        }
        *hi = kv_avalanche64(kv_sec64(80) ^ kv_sec64(88));
        return kv_avalanche64(kv_sec64(64) ^ kv_sec64(72));
    }
    kv_u64 a0 = len * KV_P64_1, a1 = 0;
    if (len <= 128) {
        if (len > 32) {
            if (len > 64) {
                if (len > 96) kv_mix32(&a0, &a1, s, 48, len - 64, 96);
                kv_mix32(&a0, &a1, s, 32, len - 48, 64);
            }
            kv_mix32(&a0, &a1, s, 16, len - 32, 32);
        }
        kv_mix32(&a0, &a1, s, 0, len - 16, 0);
    } else {
        /* 129..240 */
        kv_u32 rounds = (kv_u32)(len / 32);
        for (kv_u32 i = 0; i < 4; i++) kv_mix32(&a0, &a1, s, 32 * i, 32 * i + 16, 32 * i);
        a0 = kv_avalanche3(a0);
        a1 = kv_avalanche3(a1);
        for (kv_u32 i = 4; i < rounds; i++)
            kv_mix32(&a0, &a1, s, 32 * i, 32 * i + 16, 3 + 32 * (i - 4));
        kv_mix32(&a0, &a1, s, len - 16, len - 32, 136 - 17 - 16);
    }
    kv_u64 r_lo = a0 + a1;
    kv_u64 r_hi = a0 * KV_P64_1 + a1 * KV_P64_4 + len * KV_P64_2;
    *hi = 0 - kv_avalanche3(r_hi);
    return kv_avalanche3(r_lo);
}

/* ---------------------------------------------------------------------------------------
 * XXH3 long inputs (> 240 bytes): the block-parallel loop. */

/* The sums of lanes 2j and 2j+1 over one stripe at byte `off`, with key words k0, k1. */
KV_DEV void kv_stripe_pair(const KvSrc* s, kv_u64 off, kv_u64 k0, kv_u64 k1, kv_u64* s0, kv_u64* s1) {
    kv_u64 d0 = kv_rd64(s, off);
    kv_u64 d1 = kv_rd64(s, off + 8);
    kv_u64 x0 = d0 ^ k0;
    kv_u64 x1 = d1 ^ k1;
    /* XXH3_accumulate_512: acc[i ^ 1] += data[i]; acc[i] += lo32(key_i) * hi32(key_i). */
    *s0 += d1 + (x0 & 0xFFFFFFFFULL) * (x0 >> 32);
    *s1 += d0 + (x1 & 0xFFFFFFFFULL) * (x1 >> 32);
}

KV_DEV kv_u64 kv_merge_accs(const kv_u64* acc, kv_u32 soff, kv_u64 start) {
    kv_u64 r = start;
    for (kv_u32 i = 0; i < 4; i++)
        r += kv_fold64(acc[2 * i] ^ kv_sec64(soff + 16 * i), acc[2 * i + 1] ^ kv_sec64(soff + 16 * i + 8));
    return kv_avalanche3(r);
}

KV_DEV void kv_write128(const KvJob* job, kv_u64 lo, kv_u64 hi) {
    if (job->nonzero && lo == 0 && hi == 0) lo = 1;
    job->out[0] = lo;
    job->out[1] = hi;
}

KV_DEV kv_u32 kv_xxh_step(const KvJob* job, kv_u32 step, kv_u32 t, KvShared* sh) {
    const KvSrc* s = &job->src;
    kv_u64 len = s->len;
    if (len <= KV_MID_SIZE_MAX) {
        if (t == 0) {
            if (job->kind == KVWD_JOB_XXH3_64) {
                job->out[0] = kv_xxh3_64_short(s);
            } else {
                kv_u64 hi;
                kv_u64 lo = kv_xxh3_128_short(s, &hi);
                kv_write128(job, lo, hi);
            }
        }
        return 0;
    }
    kv_u64 nb_blocks = (len - 1) / KV_BLOCK;
    kv_u32 last_stripes = (kv_u32)(((len - 1) - nb_blocks * KV_BLOCK) / KV_STRIPE);
    kv_u64 rounds = nb_blocks / KVWD_GROUPS + 1; /* virtual blocks 0..=nb_blocks */
    if (step == 0) {
        if (t < KV_SECRET_SIZE / 8) sh->secret[t] = kv_sec64(8 * t);
        if (t < 8) {
            sh->lastkey[t] = kv_sec64(KV_SECRET_SIZE - KV_STRIPE - 7 + 8 * t);
            sh->acc[t] = KV_INIT_ACC[t];
        }
        return 1;
    }
    kv_u64 r = (kv_u64)(step - 1) / 2;
    if (r < rounds) {
        if ((step - 1) % 2 == 0) {
            /* Load: group g sums virtual block vb; 16 bytes (lanes 2j, 2j+1) per stripe. */
            kv_u32 g = t / 4, j = t % 4;
            kv_u64 vb = r * KVWD_GROUPS + g;
            kv_u64 s0 = 0, s1 = 0;
            if (vb <= nb_blocks) {
                kv_u64 base = vb * KV_BLOCK + 16 * j;
                if (vb < nb_blocks) {
                    KV_UNROLL
                    for (kv_u32 k = 0; k < KV_STRIPES_PER_BLOCK; k++)
                        kv_stripe_pair(s, base + KV_STRIPE * k, sh->secret[k + 2 * j], sh->secret[k + 2 * j + 1], &s0, &s1);
                } else {
                    for (kv_u32 k = 0; k < last_stripes; k++)
                        kv_stripe_pair(s, base + KV_STRIPE * k, sh->secret[k + 2 * j], sh->secret[k + 2 * j + 1], &s0, &s1);
                    kv_stripe_pair(s, len - KV_STRIPE + 16 * j, sh->lastkey[2 * j], sh->lastkey[2 * j + 1], &s0, &s1);
                }
            }
            sh->sums[g][2 * j] = s0;
            sh->sums[g][2 * j + 1] = s1;
        } else if (t < 8) {
            /* Chain: lane t, acc = scramble(acc + S_k) for the round's full blocks. */
            kv_u64 a = sh->acc[t];
            for (kv_u32 i = 0; i < KVWD_GROUPS; i++) {
                kv_u64 vb = r * KVWD_GROUPS + i;
                if (vb > nb_blocks) break;
                a += sh->sums[i][t];
                if (vb < nb_blocks) {
                    a ^= a >> 47;
                    a ^= sh->secret[(KV_SECRET_SIZE - KV_STRIPE) / 8 + t];
                    a *= KV_P32_1;
                }
            }
            sh->acc[t] = a;
        }
        return 1;
    }
    /* Merge. */
    if (t == 0) {
        kv_u64 lo = kv_merge_accs(sh->acc, 11, len * KV_P64_1);
        if (job->kind == KVWD_JOB_XXH3_64) {
            job->out[0] = lo;
        } else {
            kv_u64 hi = kv_merge_accs(sh->acc, KV_SECRET_SIZE - 64 - 11, ~(len * KV_P64_2));
            kv_write128(job, lo, hi);
        }
    }
    return 0;
}

/* ---------------------------------------------------------------------------------------
 * CRC-32/ISO-HDLC (reflected, polynomial 0xEDB88320, init and xorout 0xFFFFFFFF). */

/* a * b mod P in the reflected representation (zlib's multmodp, bounded loop). */
KV_DEV kv_u32 kv_multmodp(kv_u32 a, kv_u32 b) {
    kv_u32 p = 0;
    for (kv_u32 i = 0; i < 32; i++) {
        if (a & (0x80000000u >> i)) p ^= b;
        b = (b & 1) ? (b >> 1) ^ KVWD_CRC_POLY : b >> 1;
    }
    return p;
}

/* x^(8 n) mod P: the operator that appends n zero bytes to a CRC register. */
KV_DEV kv_u32 kv_x8nmodp(kv_u64 n) {
    kv_u32 p = 0x80000000u;  /* x^0 */
    kv_u32 sq = 0x00800000u; /* x^8 */
    while (n) {
        if (n & 1) p = kv_multmodp(sq, p);
        sq = kv_multmodp(sq, sq);
        n >>= 1;
    }
    return p;
}

/* Entry e = 256 k + i of the slicing tables: byte i pushed through 8 (k + 1) zero bits. */
KV_DEV kv_u32 kv_crc_table_entry(kv_u32 e) {
    kv_u32 r = e & 0xFFu;
    kv_u32 bits = 8 * ((e >> 8) + 1);
    for (kv_u32 i = 0; i < bits; i++) r = (r & 1) ? (r >> 1) ^ KVWD_CRC_POLY : r >> 1;
    return r;
}

KV_DEV kv_u32 kv_crc_run(const kv_u32* tab, kv_u32 r, const kv_u8* p, kv_u64 n) {
    kv_u64 o = 0;
    while (o < n && (((kv_u64)(p + o)) & 7) != 0) {
        r = tab[(r ^ p[o]) & 0xFFu] ^ (r >> 8);
        o++;
    }
    for (; o + 8 <= n; o += 8) {
        kv_u64 w = *(const kv_u64*)(p + o);
        kv_u32 lo = r ^ (kv_u32)w;
        kv_u32 hi = (kv_u32)(w >> 32);
        r = tab[7 * 256 + (lo & 0xFFu)] ^ tab[6 * 256 + ((lo >> 8) & 0xFFu)] ^
            tab[5 * 256 + ((lo >> 16) & 0xFFu)] ^ tab[4 * 256 + (lo >> 24)] ^
            tab[3 * 256 + (hi & 0xFFu)] ^ tab[2 * 256 + ((hi >> 8) & 0xFFu)] ^
            tab[1 * 256 + ((hi >> 16) & 0xFFu)] ^ tab[hi >> 24];
    }
    for (; o < n; o++) r = tab[(r ^ p[o]) & 0xFFu] ^ (r >> 8);
    return r;
}

KV_DEV kv_u32 kv_crc_step(const KvJob* job, kv_u32 step, kv_u32 t, KvShared* sh) {
    kv_u64 len = job->src.len;
    kv_u64 c = (len / KVWD_THREADS) & ~(kv_u64)15;
    kv_u64 first = len - (KVWD_THREADS - 1) * c; /* chunk 0: [0, first) */
    if (step == 0) {
        kv_u64 start = t == 0 ? 0 : first + (t - 1) * c;
        kv_u64 n = t == 0 ? first : c;
        sh->crc[t] = kv_crc_run(job->crc_tab, t == 0 ? 0xFFFFFFFFu : 0u, job->src.bytes + start, n);
        if (t < KVWD_CRC_LEVELS) sh->op[t] = kv_x8nmodp(c << t);
        return 1;
    }
    kv_u32 level = step - 1; /* 0 .. KVWD_CRC_LEVELS-1 */
    kv_u32 stride = 1u << level;
    if (t % (2 * stride) == 0) sh->crc[t] = kv_multmodp(sh->op[level], sh->crc[t]) ^ sh->crc[t + stride];
    if (level + 1 < KVWD_CRC_LEVELS) return 1;
    if (t == 0) job->out[0] = (kv_u64)(sh->crc[0] ^ 0xFFFFFFFFu);
    return 0;
}

/* ---------------------------------------------------------------------------------------
 * Jobs and steps. */

/* One step of the block program; returns 1 while another step follows (same value for every
 * thread of the block). */
KV_DEV kv_u32 kvwd_step(const KvJob* job, kv_u32 step, kv_u32 t, KvShared* sh) {
    if (job->kind == KVWD_JOB_CRC32) return kv_crc_step(job, step, t, sh);
    return kv_xxh_step(job, step, t, sh);
}

/* Block `block` of the page launch: page ordinal i of buffer b, block = b * npages + i. */
KV_DEV void kvwd_page_job(const KvwdBuffer* bufs, kv_u32 npages, kv_u32 alg, const kv_u32* pages,
                          const kv_u32* crc_tab, kv_u64* out, kv_u64 block, KvJob* job) {
    kv_u64 b = block / npages;
    kv_u64 i = block - b * npages;
    job->src.virt = 0;
    job->src.digests = 0;
    job->src.len = bufs[b].page_bytes;
    job->src.bytes = (const kv_u8*)(bufs[b].base + (kv_u64)pages[i] * bufs[b].page_bytes);
    job->kind = alg == KVWD_ALG_CRC32 ? KVWD_JOB_CRC32 : KVWD_JOB_XXH3_64;
    job->nonzero = 0;
    job->out = out + block;
    job->crc_tab = crc_tab;
}

/* Block `b` of the buffer launch: the buffer digest of buffer b. */
KV_DEV void kvwd_buffer_job(const kv_u64* page_digests, kv_u32 npages, kv_u32 alg,
                            kv_u64 transfer_id, kv_u64 nonce, kv_u64* out, kv_u32 b, KvJob* job) {
    job->src.virt = 1;
    job->src.bytes = 0;
    job->src.digests = page_digests + (kv_u64)b * npages;
    job->src.len = 25 + 12 * (kv_u64)npages;
    job->src.head[0] = 'K';
    job->src.head[1] = 'V';
    job->src.head[2] = 'W';
    job->src.head[3] = 'D';
    job->src.head[4] = (kv_u8)alg;
    for (kv_u32 k = 0; k < 8; k++) {
        job->src.head[5 + k] = (kv_u8)(transfer_id >> (8 * k));
        job->src.head[13 + k] = (kv_u8)(nonce >> (8 * k));
    }
    for (kv_u32 k = 0; k < 4; k++) job->src.head[21 + k] = (kv_u8)(b >> (8 * k));
    job->kind = KVWD_JOB_XXH3_128;
    job->nonzero = 1;
    job->out = out + 2 * (kv_u64)b;
    job->crc_tab = 0;
}

#ifdef __CUDACC_RTC__
/* ---------------------------------------------------------------------------------------
 * GPU entry points (blockDim.x must be KVWD_THREADS). */

static __device__ void kvwd_run_block(const KvJob* job, KvShared* sh) {
    for (kv_u32 step = 0;; ++step) {
        kv_u32 more = kvwd_step(job, step, threadIdx.x, sh);
        __syncthreads();
        if (!more) break;
    }
}

/* grid: KVWD_CRC_TABLE_WORDS / KVWD_THREADS blocks. */
extern "C" __global__ void __launch_bounds__(KVWD_THREADS) kvwd_crc_tables(kv_u32* tab) {
    kv_u32 e = blockIdx.x * KVWD_THREADS + threadIdx.x;
    if (e < KVWD_CRC_TABLE_WORDS) tab[e] = kv_crc_table_entry(e);
}

/* grid: nbufs * npages blocks; out: nbufs * npages page digests, buffer-major. */
extern "C" __global__ void __launch_bounds__(KVWD_THREADS)
    kvwd_page_digests(const KvwdBuffer* bufs, kv_u32 npages, kv_u32 alg, const kv_u32* pages,
                      const kv_u32* crc_tab, kv_u64* out) {
    __shared__ KvShared sh;
    KvJob job;
    kvwd_page_job(bufs, npages, alg, pages, crc_tab, out, blockIdx.x, &job);
    kvwd_run_block(&job, &sh);
}

/* grid: nbufs blocks; out: 2 words (low, high) per buffer. */
extern "C" __global__ void __launch_bounds__(KVWD_THREADS)
    kvwd_buffer_digests(const kv_u64* page_digests, kv_u32 npages, kv_u32 alg,
                        kv_u64 transfer_id, kv_u64 nonce, kv_u64* out) {
    __shared__ KvShared sh;
    KvJob job;
    kvwd_buffer_job(page_digests, npages, alg, transfer_id, nonce, out, blockIdx.x, &job);
    kvwd_run_block(&job, &sh);
}

#else
/* ---------------------------------------------------------------------------------------
 * CPU path: the same block programs, threads run one after another within each step.
 * kvwd_cpu_order picks the order (0 forward, 1 backward, 2 a stride permutation): a
 * result that depends on it means two threads touch the same shared state in one step. */

int kvwd_cpu_order = 0;

static kv_u32 kvwd_cpu_thread(kv_u32 i) {
    switch (kvwd_cpu_order) {
    case 1: return KVWD_THREADS - 1 - i;
    case 2: return (i * 37u) % KVWD_THREADS;
    default: return i;
    }
}

/* Runs one block; returns 0, or -1 if the threads disagreed on whether a step follows. */
static int kvwd_cpu_run_block(const KvJob* job) {
    KvShared sh;
    /* Shared memory starts as garbage on the GPU: poison it so a read before write shows. */
    unsigned char* raw = (unsigned char*)&sh;
    for (unsigned long k = 0; k < sizeof sh; k++) raw[k] = (unsigned char)(0xA5 ^ k ^ kvwd_cpu_order);
    for (kv_u32 step = 0;; ++step) {
        kv_u32 more = kvwd_step(job, step, kvwd_cpu_thread(0), &sh);
        for (kv_u32 i = 1; i < KVWD_THREADS; i++)
            if (kvwd_step(job, step, kvwd_cpu_thread(i), &sh) != more) return -1;
        if (!more) return 0;
    }
}

void kvwd_cpu_crc_tables(kv_u32* tab) {
    for (kv_u32 e = 0; e < KVWD_CRC_TABLE_WORDS; e++) tab[e] = kv_crc_table_entry(e);
}

int kvwd_cpu_page_digests(const KvwdBuffer* bufs, kv_u32 nbufs, kv_u32 npages, kv_u32 alg,
                          const kv_u32* pages, const kv_u32* crc_tab, kv_u64* out) {
    kv_u64 blocks = (kv_u64)nbufs * npages;
    for (kv_u64 block = 0; block < blocks; block++) {
        KvJob job;
        kvwd_page_job(bufs, npages, alg, pages, crc_tab, out, block, &job);
        if (kvwd_cpu_run_block(&job) != 0) return -1;
    }
    return 0;
}

int kvwd_cpu_buffer_digests(const kv_u64* page_digests, kv_u32 nbufs, kv_u32 npages, kv_u32 alg,
                            kv_u64 transfer_id, kv_u64 nonce, kv_u64* out) {
    for (kv_u32 b = 0; b < nbufs; b++) {
        KvJob job;
        kvwd_buffer_job(page_digests, npages, alg, transfer_id, nonce, out, b, &job);
        if (kvwd_cpu_run_block(&job) != 0) return -1;
    }
    return 0;
}

/* One block program over plain bytes: kind KVWD_JOB_*; out[0] (and out[1] for XXH3-128). */
int kvwd_cpu_hash(kv_u32 kind, const kv_u8* bytes, kv_u64 len, const kv_u32* crc_tab, kv_u64* out) {
    KvJob job;
    job.src.virt = 0;
    job.src.bytes = bytes;
    job.src.digests = 0;
    job.src.len = len;
    job.kind = kind;
    job.nonzero = 0;
    job.out = out;
    job.crc_tab = crc_tab;
    return kvwd_cpu_run_block(&job);
}
#endif
