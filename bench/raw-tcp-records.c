/* kvwire's TCP sending pattern with no kvwire: does the pattern itself cost CPU?
 *
 *   cc -O2 -o target/raw-tcp-records bench/raw-tcp-records.c
 *   target/raw-tcp-records MODE SLICE RECORDS MIB PORT
 *
 * Requests of RECORDS records, each record a 36-byte header (kvwire's data-record header,
 * proto/SPEC.md §9.1) and 4 slices of SLICE bytes (four buffers' page) at pseudo-random
 * SLICE-sized slots of 1 GiB on transparent huge pages; one request in flight: the receiver
 * (a forked process, blocking readv straight into the slots) acknowledges each request with one
 * byte once it read all of it. The sender hands a request's iovecs to writev, 64 per call at
 * most (kvwire's MAX_IOV): MODE 0 blocking, MODE 1 non-blocking with poll() on EAGAIN (as an event loop
 * does). MIB mebibytes in all over one TCP connection on 127.0.0.1:PORT (TCP_NODELAY). Prints
 * GB/s (10^9) and the sender's CPU seconds per 10^9 bytes (getrusage).
 * docs/BENCHMARKS.md, "Where 1 MiB pages at one in flight lose".
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define HEADER 36
#define BUFFERS 4

static double cpu(void) {
  struct rusage r;
  getrusage(RUSAGE_SELF, &r);
  return r.ru_utime.tv_sec + r.ru_utime.tv_usec * 1e-6 + r.ru_stime.tv_sec +
         r.ru_stime.tv_usec * 1e-6;
}

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

/* Allocated and written through in the process that uses it, on huge pages. */
static char *region(size_t mem) {
  char *b = aligned_alloc((size_t)2 << 20, mem);
  if (!b) return NULL;
  madvise(b, mem, MADV_HUGEPAGE);
  memset(b, 0x5a, mem);
  return b;
}

static int read_all(int s, char *p, size_t n) {
  while (n) {
    ssize_t r = recv(s, p, n, 0);
    if (r <= 0) return -1;
    p += r;
    n -= (size_t)r;
  }
  return 0;
}

/* Drops `w` bytes from the front of the iovec array `*vp` of `*n` entries. */
static void advance(struct iovec **vp, int *n, size_t w) {
  while (*n && w >= (*vp)->iov_len) {
    w -= (*vp)->iov_len;
    (*vp)++;
    (*n)--;
  }
  if (*n) {
    (*vp)->iov_base = (char *)(*vp)->iov_base + w;
    (*vp)->iov_len -= w;
  }
}

int main(int argc, char **argv) {
  if (argc != 6) {
    fprintf(stderr, "usage: %s MODE(0|1) SLICE RECORDS MIB PORT\n", argv[0]);
    return 2;
  }
  int mode = atoi(argv[1]), records = atoi(argv[3]), port = atoi(argv[5]);
  size_t slice = (size_t)atol(argv[2]), total = (size_t)atol(argv[4]) << 20;
  size_t mem = (size_t)1 << 30;
  if (slice == 0 || slice > mem / BUFFERS || records < 1 || records > 4096) {
    fprintf(stderr, "SLICE 1 byte to 256 MiB, RECORDS 1 to 4096\n");
    return 2;
  }
  size_t slots = mem / slice, request = (size_t)records * BUFFERS * slice;
  size_t requests = total / request;
  if (requests == 0) {
    fprintf(stderr, "MIB is less than one request\n");
    return 2;
  }
  int one = 1, ls = socket(AF_INET, SOCK_STREAM, 0);
  setsockopt(ls, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  struct sockaddr_in a = {0};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  a.sin_addr.s_addr = htonl(0x7f000001);
  if (bind(ls, (void *)&a, sizeof a) || listen(ls, 1)) {
    perror("bind/listen");
    return 1;
  }
  char ack = 1;
  pid_t child = fork();
  if (child == 0) {
    char *buf = region(mem), header[HEADER];
    if (!buf) return 1;
    int s = accept(ls, 0, 0);
    if (s < 0 || send(s, &ack, 1, MSG_NOSIGNAL) != 1) return 1; /* ready */
    unsigned long k = 0;
    for (size_t q = 0; q < requests; q++) {
      for (int i = 0; i < records; i++) {
        if (read_all(s, header, HEADER)) return 1;
        struct iovec v[BUFFERS], *vp = v;
        int n = BUFFERS;
        for (int b = 0; b < BUFFERS; b++) {
          v[b].iov_base = buf + (k++ * 2654435761ul % slots) * slice;
          v[b].iov_len = slice;
        }
        for (size_t left = BUFFERS * slice; left;) {
          ssize_t r = readv(s, vp, n);
          if (r <= 0) return 1;
          left -= (size_t)r;
          advance(&vp, &n, (size_t)r);
        }
      }
      if (send(s, &ack, 1, MSG_NOSIGNAL) != 1) return 1;
    }
    return 0;
  }
  char *buf = region(mem), header[HEADER] = {0};
  if (!buf) return 1;
  int s = socket(AF_INET, SOCK_STREAM, 0);
  setsockopt(s, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  if (connect(s, (void *)&a, sizeof a) || recv(s, &ack, 1, MSG_WAITALL) != 1) {
    perror("connect/ready");
    return 1;
  }
  if (mode == 1) fcntl(s, F_SETFL, O_NONBLOCK);
  struct iovec *v = malloc(sizeof *v * (size_t)records * (BUFFERS + 1));
  if (!v) return 1;
  double t0 = now(), c0 = cpu();
  unsigned long k = 0;
  for (size_t q = 0; q < requests; q++) {
    int n = 0;
    for (int i = 0; i < records; i++) {
      v[n].iov_base = header;
      v[n++].iov_len = HEADER;
      for (int b = 0; b < BUFFERS; b++) {
        v[n].iov_base = buf + (k++ * 40503ul % slots) * slice;
        v[n++].iov_len = slice;
      }
    }
    struct iovec *vp = v;
    for (size_t left = request + (size_t)HEADER * records; left;) {
      ssize_t w = writev(s, vp, n > 64 ? 64 : n);
      if (w < 0 && errno == EAGAIN) {
        struct pollfd p = {s, POLLOUT, 0};
        poll(&p, 1, -1);
        continue;
      }
      if (w <= 0) return 1;
      left -= (size_t)w;
      advance(&vp, &n, (size_t)w);
    }
    for (;;) { /* the request's acknowledgement */
      ssize_t g = recv(s, &ack, 1, 0);
      if (g == 1) break;
      if (g < 0 && errno == EAGAIN) {
        struct pollfd p = {s, POLLIN, 0};
        poll(&p, 1, -1);
        continue;
      }
      return 1;
    }
  }
  double sender_cpu = cpu() - c0;
  int status = 0;
  waitpid(child, &status, 0);
  double moved = (double)(requests * request);
  printf("mode=%d slice=%zu records=%d GB/s=%.3f sender_cpu_s_per_gb=%.3f\n", mode, slice,
         records, moved / (now() - t0) / 1e9, sender_cpu / (moved / 1e9));
  return WIFEXITED(status) && WEXITSTATUS(status) == 0 ? 0 : 1;
}
