/*
 * kvwire from C: one KV transfer between two processes over TCP loopback, authenticated
 * by a pre-shared key, between two engines that own their KV memory.
 *
 *   transfer decode ADDR_FILE   listens on 127.0.0.1 (any port), writes the address bound
 *                               to ADDR_FILE, reserves scattered pages of its own cache for
 *                               request 42, waits for the verified KV, checks every byte
 *                               and the aux record, releases the pages
 *   transfer prefill ADDR       connects to ADDR, sends request 42 from its own pages in
 *                               two chunks, the second with the aux record
 *
 * Both read the key from KVWIRE_PSK (hex; `kvwire gen-psk` makes one). Exit status 0 only
 * if everything checked out. Build (see capi/README.md):
 *
 *   cargo build -p kvwire-capi
 *   cc -Wall -Wextra -Werror -Icapi/include capi/examples/transfer.c \
 *      -Ltarget/debug -lkvwire_capi -Wl,-rpath,$PWD/target/debug -o transfer
 */
#define _POSIX_C_SOURCE 200809L

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kvwire.h"

#define BUFFERS 2          /* e.g. K and V of one layer */
#define PAGES 64           /* pages per buffer */
#define PAGE_BYTES 4096    /* bytes per page, in each buffer */
#define TOKENS_PER_PAGE 16
#define CONTEXT 1024       /* tokens the engines serve: PAGES x TOKENS_PER_PAGE holds it */
#define ROOM 42            /* the request id both engines know */
#define TOKENS 100         /* -> 7 pages */
#define NPAGES 7
#define FIRST_CHUNK 4
#define UNTOUCHED 0xAA     /* the decode cache's bytes before the transfer */

static const char AUX[] = "first-token:1234";

/* The decode engine's allocator chose these pages (scattered); the prefill's, its own. */
static const uint32_t DST[NPAGES] = {57, 3, 21, 40, 9, 33, 12};
static const uint32_t SRC[NPAGES] = {5, 6, 7, 20, 21, 22, 23};

/* The KV of ordinal `o` of the request, in buffer `b`, byte `i`. */
static uint8_t kv(unsigned o, unsigned b, unsigned i) {
  return (uint8_t)(ROOM * 31u + o * 17u + b * 7u + i / 5u);
}

static int check(int rc, const char *what) {
  if (rc != KVWIRE_OK) {
    fprintf(stderr, "%s failed: %s (%d): %s\n", what, kvwire_error_name(rc), rc,
            kvwire_last_error());
    exit(1);
  }
  return rc;
}

static void fail_transfer(const char *who, int state, const kvwire_failure_t *f,
                          const char *message) {
  fprintf(stderr, "%s: transfer ended in state %d: %s (code %d, wire code %d, %s): %s\n", who,
          state, kvwire_error_name(f->code), f->code, f->wire_code,
          f->retryable ? "retryable" : "not retryable", message);
  exit(1);
}

static void sleep_ms(long ms) {
  struct timespec t = {ms / 1000, (ms % 1000) * 1000000L};
  nanosleep(&t, NULL);
}

/* The engine's KV cache: one allocation per buffer, filled with `fill`. */
static void cache(uint8_t *mem[BUFFERS], kvwire_buffer_t bufs[BUFFERS], int fill) {
  for (unsigned b = 0; b < BUFFERS; b++) {
    mem[b] = malloc((size_t)PAGES * PAGE_BYTES);
    if (!mem[b]) {
      fprintf(stderr, "out of memory\n");
      exit(1);
    }
    memset(mem[b], fill, (size_t)PAGES * PAGE_BYTES);
    bufs[b].ptr = mem[b];
    bufs[b].len = (size_t)PAGES * PAGE_BYTES;
    bufs[b].page_bytes = PAGE_BYTES;
  }
}

static kvwire_manager_t *manager(int role, const kvwire_buffer_t bufs[BUFFERS]) {
  const char *psk = getenv("KVWIRE_PSK");
  if (!psk || !*psk) {
    fprintf(stderr, "set KVWIRE_PSK to a pre-shared key (hex; `kvwire gen-psk`)\n");
    exit(2);
  }
  kvwire_config_t cfg;
  check(kvwire_config_init(&cfg), "kvwire_config_init");
  cfg.role = role;
  cfg.tokens_per_page = TOKENS_PER_PAGE;
  cfg.max_context_tokens = CONTEXT;
  cfg.fingerprint = "example-model/tp0";
  cfg.psk_hex = psk;
  /* KVWIRE_RDMA_DEVICE=rxe0: RDMA instead of TCP (a library built with --features rdma;
     the SoftRoCE lane runs this example so). Unset: TCP. */
  cfg.rdma_device = getenv("KVWIRE_RDMA_DEVICE");
  kvwire_manager_t *m = NULL;
  check(kvwire_manager_new(&cfg, bufs, BUFFERS, &m), "kvwire_manager_new");
  return m;
}

static int decode(const char *addr_file) {
  uint8_t *mem[BUFFERS];
  kvwire_buffer_t bufs[BUFFERS];
  cache(mem, bufs, UNTOUCHED);
  kvwire_manager_t *m = manager(KVWIRE_ROLE_DECODE, bufs);

  /* Listen, and tell the prefill where (written whole, then renamed into place). */
  char bound[KVWIRE_ADDR_MAX];
  check(kvwire_manager_listen(m, "127.0.0.1:0", bound, sizeof bound), "kvwire_manager_listen");
  char tmp[4096];
  snprintf(tmp, sizeof tmp, "%s.tmp", addr_file);
  FILE *f = fopen(tmp, "w");
  if (!f || fprintf(f, "%s\n", bound) < 0 || fclose(f) != 0 || rename(tmp, addr_file) != 0) {
    perror("writing the address file");
    return 1;
  }
  printf("decode: listening on %s\n", bound);
  check(kvwire_manager_wait_peers(m, 1, 30000), "kvwire_manager_wait_peers");

  /* Reserve exactly the pages the engine chose. */
  kvwire_receiver_t *r = NULL;
  check(kvwire_receiver_new(m, ROOM, 0, &r), "kvwire_receiver_new");
  check(kvwire_receiver_init(r, DST, NPAGES, TOKENS, 30000), "kvwire_receiver_init");

  /* The scheduler loop: poll never blocks. */
  int state = KVWIRE_POLL_BOOTSTRAPPING;
  for (int i = 0; i < 30000; i++) {
    check(kvwire_receiver_poll(r, &state), "kvwire_receiver_poll");
    if (state == KVWIRE_POLL_SUCCESS || state == KVWIRE_POLL_FAILED) break;
    sleep_ms(1);
  }
  if (state != KVWIRE_POLL_SUCCESS) {
    kvwire_failure_t fail;
    char message[512];
    check(kvwire_receiver_failure(r, &fail, message, sizeof message), "kvwire_receiver_failure");
    fail_transfer("decode", state, &fail, message);
  }

  /* What arrived: the pages reserved, in order, and the verified aux record. */
  uint32_t pages[PAGES];
  size_t npages = 0;
  check(kvwire_receiver_page_indices(r, pages, PAGES, &npages), "kvwire_receiver_page_indices");
  if (npages != NPAGES || memcmp(pages, DST, sizeof DST) != 0) {
    fprintf(stderr, "decode: the verified pages are not the pages reserved\n");
    return 1;
  }
  uint8_t aux[256];
  size_t aux_len = 0;
  check(kvwire_receiver_aux(r, aux, sizeof aux, &aux_len), "kvwire_receiver_aux");
  if (aux_len != strlen(AUX) || memcmp(aux, AUX, aux_len) != 0) {
    fprintf(stderr, "decode: aux record %.*s, expected %s\n", (int)aux_len, (const char *)aux,
            AUX);
    return 1;
  }

  /* Every byte, read from the engine's own memory; every other page untouched. The
   * negative control (KVWIRE_EXAMPLE_CORRUPT_CHECK=1) expects one wrong byte, to show that
   * this check fails when the bytes differ. */
  const int corrupt = getenv("KVWIRE_EXAMPLE_CORRUPT_CHECK") != NULL;
  size_t checked = 0, bad = 0;
  for (unsigned b = 0; b < BUFFERS; b++) {
    for (unsigned p = 0; p < PAGES; p++) {
      int o = -1;
      for (unsigned k = 0; k < NPAGES; k++)
        if (DST[k] == p) o = (int)k;
      const uint8_t *page = mem[b] + (size_t)p * PAGE_BYTES;
      for (unsigned i = 0; i < PAGE_BYTES; i++) {
        uint8_t want = o < 0 ? UNTOUCHED : kv((unsigned)o, b, i);
        if (corrupt && o == 3 && b == 1 && i == 100) want ^= 1;
        if (page[i] != want) {
          if (bad++ < 5)
            fprintf(stderr, "decode: buffer %u page %u byte %u is %u, expected %u\n", b, p, i,
                    page[i], want);
        }
        checked += o >= 0;
      }
    }
  }
  if (bad) {
    fprintf(stderr, "decode: %zu bytes differ\n", bad);
    return 1;
  }

  /* Give the pages back; only then may the engine's allocator reuse them. */
  check(kvwire_receiver_release(r), "kvwire_receiver_release");
  check(kvwire_manager_check_free(m, DST, NPAGES), "kvwire_manager_check_free");
  kvwire_receiver_free(r);
  /* kvwire touches none of the buffers once this returned: they may be freed. */
  check(kvwire_manager_shutdown(m, 30000), "kvwire_manager_shutdown");
  kvwire_manager_free(m);
  for (unsigned b = 0; b < BUFFERS; b++) free(mem[b]);
  printf("decode: verified %d pages x %d buffers (%zu bytes, every one checked) and the aux "
         "record \"%s\"\n",
         NPAGES, BUFFERS, checked, AUX);
  return 0;
}

static int prefill(const char *addr) {
  uint8_t *mem[BUFFERS];
  kvwire_buffer_t bufs[BUFFERS];
  cache(mem, bufs, 0);
  kvwire_manager_t *m = manager(KVWIRE_ROLE_PREFILL, bufs);

  /* The prefill computed the request's KV into its own pages. */
  for (unsigned b = 0; b < BUFFERS; b++)
    for (unsigned o = 0; o < NPAGES; o++)
      for (unsigned i = 0; i < PAGE_BYTES; i++)
        mem[b][(size_t)SRC[o] * PAGE_BYTES + i] = kv(o, b, i);

  uint64_t peer = 0;
  check(kvwire_manager_connect(m, addr, &peer), "kvwire_manager_connect");
  printf("prefill: connected to node %llu at %s\n", (unsigned long long)peer, addr);

  kvwire_sender_t *s = NULL;
  check(kvwire_sender_new(m, ROOM, 0, &s), "kvwire_sender_new");
  check(kvwire_sender_init(s, NPAGES, TOKENS), "kvwire_sender_init");
  /* The request goes to the decode that reserves it: Bootstrapping until it did, then
     WaitingForInput (the scheduler starts sending then); Failed if that decode refused it. */
  int state = KVWIRE_POLL_BOOTSTRAPPING;
  for (int i = 0; i < 30000 && state == KVWIRE_POLL_BOOTSTRAPPING; i++) {
    check(kvwire_sender_poll(s, &state), "kvwire_sender_poll");
    if (state == KVWIRE_POLL_BOOTSTRAPPING) sleep_ms(1);
  }
  if (state != KVWIRE_POLL_WAITING_FOR_INPUT) {
    kvwire_failure_t fail;
    char message[512];
    check(kvwire_sender_failure(s, &fail, message, sizeof message), "kvwire_sender_failure");
    fail_transfer("prefill", state, &fail, message);
  }
  /* Chunked prefill: the first chunk, then the rest with the aux record. */
  check(kvwire_sender_send(s, SRC, FIRST_CHUNK, NULL, 0), "kvwire_sender_send (first chunk)");
  check(kvwire_sender_send(s, SRC + FIRST_CHUNK, NPAGES - FIRST_CHUNK, (const uint8_t *)AUX,
                           strlen(AUX)),
        "kvwire_sender_send (final chunk)");
  check(kvwire_sender_wait(s, 30000, &state), "kvwire_sender_wait");
  if (state != KVWIRE_POLL_SUCCESS) {
    kvwire_failure_t fail;
    char message[512];
    check(kvwire_sender_failure(s, &fail, message, sizeof message), "kvwire_sender_failure");
    fail_transfer("prefill", state, &fail, message);
  }
  check(kvwire_sender_clear(s), "kvwire_sender_clear");
  check(kvwire_manager_check_free(m, SRC, NPAGES), "kvwire_manager_check_free");
  kvwire_sender_free(s);
  /* kvwire touches none of the buffers once this returned: they may be freed. */
  check(kvwire_manager_shutdown(m, 30000), "kvwire_manager_shutdown");
  kvwire_manager_free(m);
  for (unsigned b = 0; b < BUFFERS; b++) free(mem[b]);
  printf("prefill: request %d verified by the decode node (kvwire %s)\n", ROOM,
         kvwire_version());
  return 0;
}

int main(int argc, char **argv) {
  if (argc == 3 && strcmp(argv[1], "decode") == 0) return decode(argv[2]);
  if (argc == 3 && strcmp(argv[1], "prefill") == 0) return prefill(argv[2]);
  fprintf(stderr, "usage: %s decode ADDR_FILE | prefill HOST:PORT\n", argv[0]);
  return 2;
}
