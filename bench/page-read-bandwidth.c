// How fast one core reads KV pages from memory: 1 GiB on transparent huge pages, written
// once, then every PAGE-byte page read once in a random order (as kvwire's engine workload
// sends them), one load per cache line (MODE 0) or every byte with AVX2 loads (MODE 1); or
// (MODE 2) each page first copied with `rep movsb` (as the kernel copies it into a socket)
// into a page-sized buffer, then read with AVX2 loads: whether the copy leaves it in cache.
// The sender's page digest reads each page this way before the kernel copies it; this is its
// floor (docs/BENCHMARKS.md, "Where the verified CPU goes").
//
//   cc -O2 -mavx2 -o target/page-read-bandwidth bench/page-read-bandwidth.c
//   target/page-read-bandwidth PAGE MODE
#define _GNU_SOURCE
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: %s PAGE MODE(0: a load per line, 1: AVX2 over every byte, 2: copy, then 1)\n",
                argv[0]);
        return 2;
    }
    size_t region = (size_t)1 << 30, page = strtoul(argv[1], 0, 0);
    int mode = atoi(argv[2]);
    if (page < 64 || page > region || region % page) {
        fprintf(stderr, "PAGE must divide 1 GiB and be at least 64\n");
        return 2;
    }
    char *m = aligned_alloc((size_t)2 << 20, region);
    uint32_t *order = malloc(region / page * sizeof *order);
    if (!m || !order) {
        perror("alloc");
        return 1;
    }
    madvise(m, region, MADV_HUGEPAGE);
    memset(m, 1, region);
    size_t n = region / page;
    for (size_t i = 0; i < n; i++) order[i] = (uint32_t)i;
    uint64_t x = 88172645463325252ull;
    for (size_t i = n - 1; i > 0; i--) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        size_t j = x % (i + 1);
        uint32_t t = order[i];
        order[i] = order[j], order[j] = t;
    }
    char *copy = aligned_alloc(4096, page + 4096);
    if (!copy) {
        perror("alloc");
        return 1;
    }
    memset(copy, 0, page + 4096);
    volatile uint64_t sink = 0;
    double copying = 0, t = now();
    for (size_t k = 0; k < n; k++) {
        const char *p = m + (size_t)order[k] * page;
        if (mode == 0) {
            uint64_t s = 0;
            for (size_t i = 0; i < page; i += 64) s += (unsigned char)p[i];
            sink += s;
        } else {
            if (mode == 2) {
                double c = now();
                void *d = copy + 36, *src = (void *)p; /* 36: a data record's header before it */
                size_t len = page;
                __asm__ volatile("rep movsb" : "+D"(d), "+S"(src), "+c"(len) : : "memory");
                copying += now() - c;
            }
            __m256i acc = _mm256_setzero_si256();
            for (size_t i = 0; i < page; i += 32)
                acc = _mm256_add_epi64(acc, _mm256_loadu_si256((const __m256i *)(p + i)));
            sink += (uint64_t)_mm256_extract_epi64(acc, 0);
        }
    }
    double all = now() - t;
    if (mode == 2)
        printf("page %zu, mode 2: copy %.1f GB/s, then read %.1f GB/s\n", page, region / copying / 1e9,
               region / (all - copying) / 1e9);
    else
        printf("page %zu, mode %d: %.1f GB/s\n", page, mode, region / all / 1e9);
    return 0;
}
