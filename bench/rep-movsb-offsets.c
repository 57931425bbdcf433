// How fast `rep movsb` copies (what the Linux kernel uses to copy data in and out of socket
// buffers on CPUs with fast strings, `erms`/`fsrm` in /proc/cpuinfo) by where the destination
// starts relative to the source within 4 KiB. Each copy is CHUNK bytes from a 128 MiB source
// (walked through, so it comes from memory as a socket writer's pages do) into a destination
// that stays in cache (as a socket buffer's pages do); for each distance
// d = (dst - src) mod 4096 it prints the best of three passes in GB/s and marks the slow ones.
//
//   cc -O2 -o target/rep-movsb-offsets bench/rep-movsb-offsets.c
//   target/rep-movsb-offsets [CHUNK=32768] [SRC_OFFSET=100]
//
// On the 2-vCPU AMD EPYC guest of docs/BENCHMARKS.md ("Which offsets are slow"), d in 1..15
// copied at 3.2 GB/s and d in 16..31 at 8.6 GB/s, every other d at 17-20 GB/s.
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

static inline void movsb(void *d, const void *s, size_t n) {
#if defined(__x86_64__)
    __asm__ volatile("rep movsb" : "+D"(d), "+S"(s), "+c"(n) : : "memory");
#else
    memcpy(d, s, n);
#endif
}

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(int argc, char **argv) {
    size_t region = 128u << 20;
    size_t chunk = argc > 1 ? strtoul(argv[1], 0, 0) : 32768;
    size_t src_off = argc > 2 ? strtoul(argv[2], 0, 0) % 4096 : 100;
    if (chunk == 0 || chunk > (1u << 20)) {
        fprintf(stderr, "CHUNK must be 1 .. 1048576\n");
        return 2;
    }
    char *src = mmap(0, region + 8192, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    char *dst = mmap(0, (1u << 20) + 8192, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (src == MAP_FAILED || dst == MAP_FAILED) {
        perror("mmap");
        return 1;
    }
    memset(src, 1, region + 8192);
    memset(dst, 2, (1u << 20) + 8192);
    printf("chunk %zu B, source at %zu within 4 KiB\n", chunk, src_off);
    printf("d = (dst - src) mod 4096, GB/s (slow: under 0.6x the fastest)\n");
    int ds[64], n = 0;
    double gbs[64];
    for (int d = -64; d <= 96 && n < 64; d += (d >= -2 && d < 34) ? 1 : 8) {
        size_t dst_off = (size_t)(((long)src_off + d) % 4096 + 4096) % 4096;
        double best = 0;
        for (int pass = 0; pass < 3; pass++) {
            double t = now();
            size_t moved = 0;
            for (size_t p = 0; p + chunk + src_off <= region; p += chunk) {
                movsb(dst + dst_off, src + p + src_off, chunk);
                moved += chunk;
            }
            double gb = moved / (now() - t) / 1e9;
            if (gb > best) best = gb;
        }
        ds[n] = d;
        gbs[n++] = best;
    }
    double fastest = 0;
    for (int i = 0; i < n; i++)
        if (gbs[i] > fastest) fastest = gbs[i];
    for (int i = 0; i < n; i++)
        printf("d=%5d %7.2f%s\n", ds[i], gbs[i], gbs[i] < 0.6 * fastest ? "  slow" : "");
    return 0;
}
