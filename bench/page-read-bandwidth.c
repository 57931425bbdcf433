// How fast one core reads KV pages from memory: 1 GiB on transparent huge pages, written
// once, then every PAGE-byte page read once in a random order (as kvwire's engine workload
// sends them), one load per cache line (MODE 0) or every byte with AVX2 loads (MODE 1); or
// (MODE 2) each page first copied with `rep movsb` (as the kernel copies it into a socket)
// into a page-sized buffer, then read with AVX2 loads: whether the copy leaves it in cache;
// (MODE 3) BATCH pages at a time first written into a loopback TCP socket with one `writev`
// (the kernel's own copy, as kvwire's sender makes it; another thread drains the socket),
// then read with AVX2 loads; (MODE 4) read first, then written; (MODE 5) only written.
// Modes 3-5 also print the writing thread's CPU seconds: 3 and 4 less 5 is what the read
// costs after the kernel's copy and before it (docs/BENCHMARKS.md, "Where the verified CPU
// goes" and "The sender's digest after the kernel's copy").
//
//   cc -O2 -mavx2 -pthread -o target/page-read-bandwidth bench/page-read-bandwidth.c
//   target/page-read-bandwidth PAGE MODE [BATCH]
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <immintrin.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static double thread_cpu(void) {
    struct rusage u;
    getrusage(RUSAGE_THREAD, &u);
    return u.ru_utime.tv_sec + u.ru_stime.tv_sec + (u.ru_utime.tv_usec + u.ru_stime.tv_usec) * 1e-6;
}

static void *drain(void *fd) {
    static char buf[1 << 20];
    while (read((int)(intptr_t)fd, buf, sizeof buf) > 0) {
    }
    return 0;
}

// A connected loopback TCP socket whose peer end another thread reads and throws away.
static int drained_socket(void) {
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t al = sizeof a;
    int l = socket(AF_INET, SOCK_STREAM, 0), c = socket(AF_INET, SOCK_STREAM, 0), one = 1;
    if (l < 0 || c < 0 || bind(l, (struct sockaddr *)&a, sizeof a) || listen(l, 1) ||
        getsockname(l, (struct sockaddr *)&a, &al) || connect(c, (struct sockaddr *)&a, sizeof a)) {
        perror("socket");
        exit(1);
    }
    int s = accept(l, 0, 0);
    pthread_t t;
    if (s < 0 || pthread_create(&t, 0, drain, (void *)(intptr_t)s)) {
        perror("accept");
        exit(1);
    }
    setsockopt(c, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    return c;
}

// Every byte of a page, with AVX2 loads.
static uint64_t read_page(const char *p, size_t page) {
    __m256i acc = _mm256_setzero_si256();
    for (size_t i = 0; i < page; i += 32) acc = _mm256_add_epi64(acc, _mm256_loadu_si256((const __m256i *)(p + i)));
    return (uint64_t)_mm256_extract_epi64(acc, 0);
}

// `count` pages, in one vectored write (as kvwire's sender hands a batch of records over).
static void write_pages(int fd, const char *m, const uint32_t *pages, size_t count, size_t page) {
    struct iovec v[64];
    for (size_t i = 0; i < count; i++) v[i] = (struct iovec){(void *)(m + (size_t)pages[i] * page), page};
    size_t left = count * page, first = 0;
    while (left) {
        ssize_t w = writev(fd, v + first, (int)(count - first));
        if (w <= 0) {
            perror("writev");
            exit(1);
        }
        left -= (size_t)w;
        while (w > 0 && (size_t)w >= v[first].iov_len) w -= (ssize_t)v[first++].iov_len;
        if (w > 0) v[first].iov_base = (char *)v[first].iov_base + w, v[first].iov_len -= (size_t)w;
    }
}

int main(int argc, char **argv) {
    if (argc != 3 && argc != 4) {
        fprintf(stderr, "usage: %s PAGE MODE(0: a load per line, 1: AVX2 over every byte, 2: copy, then 1, "
                "3: socket write, then 1, 4: 1, then socket write, 5: socket write) [BATCH pages per write, modes 3-5]\n",
                argv[0]);
        return 2;
    }
    size_t region = (size_t)1 << 30, page = strtoul(argv[1], 0, 0);
    int mode = atoi(argv[2]);
    size_t batch = argc == 4 && mode >= 3 ? strtoul(argv[3], 0, 0) : 1;
    if (page < 64 || page > region || region % page || batch < 1 || batch > 64 || (region / page) % batch) {
        fprintf(stderr, "PAGE must divide 1 GiB and be at least 64; BATCH 1-64 must divide the pages\n");
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
    int sock = mode >= 3 ? drained_socket() : -1;
    volatile uint64_t sink = 0;
    double copying = 0, t = now(), cpu0 = thread_cpu();
    for (size_t k = 0; k < n; k += batch) {
        const char *p = m + (size_t)order[k] * page;
        if (mode == 0) {
            uint64_t s = 0;
            for (size_t i = 0; i < page; i += 64) s += (unsigned char)p[i];
            sink += s;
            continue;
        }
        if (mode == 2) {
            double c = now();
            void *d = copy + 36, *src = (void *)p; /* 36: a data record's header before it */
            size_t len = page;
            __asm__ volatile("rep movsb" : "+D"(d), "+S"(src), "+c"(len) : : "memory");
            copying += now() - c;
        } else if (mode == 3 || mode == 5) {
            double c = now();
            write_pages(sock, m, order + k, batch, page);
            copying += now() - c;
        }
        if (mode == 5) continue;
        for (size_t b = 0; b < batch; b++) sink += read_page(m + (size_t)order[k + b] * page, page);
        if (mode == 4) {
            double c = now();
            write_pages(sock, m, order + k, batch, page);
            copying += now() - c;
        }
    }
    double all = now() - t, cpu = thread_cpu() - cpu0;
    if (mode == 2 || mode == 3)
        printf("page %zu, mode %d: %s %.1f GB/s, then read %.1f GB/s\n", page, mode,
               mode == 2 ? "copy" : "socket write", region / copying / 1e9, region / (all - copying) / 1e9);
    else if (mode == 4)
        printf("page %zu, mode 4: read %.1f GB/s, then socket write %.1f GB/s\n", page,
               region / (all - copying) / 1e9, region / copying / 1e9);
    else if (mode == 5)
        printf("page %zu, mode 5: socket write %.1f GB/s\n", page, region / copying / 1e9);
    else
        printf("page %zu, mode %d: %.1f GB/s\n", page, mode, region / all / 1e9);
    if (mode >= 3) printf("  %zu pages per write; writing thread: %.3f CPU s\n", batch, cpu);
    return 0;
}
