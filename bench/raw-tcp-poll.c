/* Raw TCP loopback, blocking or polling: how much of a polling engine's lead (NIXL/UCX
 * busy-polls its sockets) is the polling itself, with no protocol at all.
 *
 *   cc -O2 -o target/raw-tcp-poll bench/raw-tcp-poll.c
 *   target/raw-tcp-poll MODE CHUNK MIB PORT [REGION_MIB [OFFSET]]
 *
 * MODE: 0 both ends block; 1 the sender polls; 2 the receiver polls; 3 both poll (polling:
 * MSG_DONTWAIT, and sched_yield after EAGAIN, as UCX's progress loop does). CHUNK bytes per
 * send/recv, each to or from a pseudo-random CHUNK-sized slot of a REGION_MIB region (default
 * 256; on transparent huge pages where the kernel gives them, as kvwire's and the peers' KV
 * memory; a page landing at its slot); MIB mebibytes in all, over one TCP connection on
 * 127.0.0.1:PORT (TCP_NODELAY, default buffers), the receiver a forked process. The region
 * starts OFFSET bytes (default 0) past a 2 MiB boundary: where a buffer starts within 4 KiB
 * changes how fast the kernel copies on some CPUs (docs/BENCHMARKS.md, "Which offsets are
 * slow"; kvwire bench --buffer-offset). Prints GB/s
 * (10^9), the bytes and each end's CPU seconds (getrusage). docs/BENCHMARKS.md, "Does polling
 * explain NIXL's lead"; scripts/peer-compare.sh runs it beside the engines (plain TCP, same run).
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

/* The region, allocated and written through in the process that uses it (after the fork: a
 * region shared copy-on-write would fault on the receiver's first write into each page, inside
 * the clock). */
static char *region(size_t mem, size_t offset) {
  size_t huge = (size_t)2 << 20;
  char *buf = aligned_alloc(huge, (mem + offset + huge - 1) / huge * huge);
  if (!buf) return NULL;
  madvise(buf, mem + offset, MADV_HUGEPAGE); /* before the first touch; where THP is "madvise" */
  memset(buf, 0x5a, mem + offset);
  return buf + offset;
}

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

static double cpu(void) {
  struct rusage r;
  getrusage(RUSAGE_SELF, &r);
  return r.ru_utime.tv_sec + r.ru_utime.tv_usec * 1e-6 + r.ru_stime.tv_sec +
         r.ru_stime.tv_usec * 1e-6;
}

/* Moves `total` bytes over `s` in `chunk`-byte calls, each to or from a pseudo-random slot of
 * `buf` (`mult` spreads the chunk numbers over the slots); polling when `polls`. Returns the
 * bytes moved (less than `total` if the peer closed), or -1 on an error. */
static long long move_bytes(int s, int sending, int polls, char *buf, size_t slots,
                            size_t chunk, size_t total, unsigned long mult) {
  size_t done = 0;
  while (done < total) {
    char *page = buf + ((done / chunk) * mult % slots) * chunk;
    size_t off = done % chunk;
    int flags = polls ? MSG_DONTWAIT : 0;
    ssize_t n = sending ? send(s, page + off, chunk - off, flags | MSG_NOSIGNAL)
                        : recv(s, page + off, chunk - off, flags);
    if (n < 0) {
      if (errno == EAGAIN || errno == EINTR) {
        if (polls) sched_yield();
        continue;
      }
      perror(sending ? "send" : "recv");
      return -1;
    }
    if (n == 0) break;
    done += (size_t)n;
  }
  return (long long)done;
}

int main(int argc, char **argv) {
  if (argc < 5 || argc > 7) {
    fprintf(stderr, "usage: %s MODE(0-3) CHUNK MIB PORT [REGION_MIB [OFFSET]]\n", argv[0]);
    return 2;
  }
  int mode = atoi(argv[1]);
  int send_polls = mode & 1, recv_polls = mode & 2;
  size_t chunk = (size_t)atol(argv[2]);
  size_t total = (size_t)atol(argv[3]) << 20;
  int port = atoi(argv[4]);
  size_t mem = (size_t)(argc >= 6 ? atol(argv[5]) : 256) << 20;
  size_t offset = argc == 7 ? (size_t)atol(argv[6]) % 4096 : 0;
  if (chunk == 0 || chunk > mem) {
    fprintf(stderr, "CHUNK must be 1 to %zu bytes\n", mem);
    return 2;
  }
  size_t slots = mem / chunk;
  int one = 1;
  int ls = socket(AF_INET, SOCK_STREAM, 0);
  setsockopt(ls, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  struct sockaddr_in a = {0};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  a.sin_addr.s_addr = htonl(0x7f000001);
  if (bind(ls, (void *)&a, sizeof a) || listen(ls, 1)) {
    perror("bind/listen");
    return 1;
  }
  pid_t child = fork();
  if (child == 0) {
    char *buf = region(mem, offset);
    if (!buf) return 1;
    int s = accept(ls, 0, 0);
    char ready = 1; /* the sender starts its clock when this arrives */
    if (s < 0 || send(s, &ready, 1, MSG_NOSIGNAL) != 1) {
      perror("accept/ready");
      return 1;
    }
    double c0 = cpu();
    long long got = move_bytes(s, 0, recv_polls, buf, slots, chunk, total, 2654435761ul);
    printf("receiver_cpu_s=%.3f\n", cpu() - c0);
    return got == (long long)total ? 0 : 1;
  }
  char *buf = region(mem, offset);
  if (!buf) return 1;
  int s = socket(AF_INET, SOCK_STREAM, 0);
  setsockopt(s, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  char ready = 0;
  if (connect(s, (void *)&a, sizeof a) || recv(s, &ready, 1, MSG_WAITALL) != 1) {
    perror("connect/ready");
    return 1;
  }
  double t0 = now(), c0 = cpu();
  if (move_bytes(s, 1, send_polls, buf, slots, chunk, total, 40503ul) != (long long)total) return 1;
  double sender_cpu = cpu() - c0;
  int status = 0;
  fflush(stdout);
  waitpid(child, &status, 0);
  double dt = now() - t0;
  printf("mode=%d chunk=%zu bytes=%zu GB/s=%.3f sender_cpu_s=%.3f\n", mode, chunk, total,
         total / dt / 1e9, sender_cpu);
  return WIFEXITED(status) && WEXITSTATUS(status) == 0 ? 0 : 1;
}
