/*
 * Runs the GPU digest kernel (src/gpu/kernel.cu, copied next to this file as
 * kvwd_kernel.cu by tests/gpu_kernel_cpu.rs) on the CPU.
 *
 * usage: harness INPUT OUTPUT
 *
 * INPUT is a sequence of records, all integers little-endian:
 *
 *   op 1, transfer: u32 1, u32 alg, u64 transfer_id, u64 nonce, u32 nbufs, u32 npages,
 *        nbufs x { u32 page_bytes, u32 pool_pages, pool_pages * page_bytes bytes },
 *        npages x u32 page index
 *     -> nbufs x (u64 low, u64 high) buffer digests, then nbufs * npages u64 page digests
 *   op 2, raw hash: u32 2, u32 kind (0 XXH3-64, 1 CRC-32, 2 XXH3-128), u64 len, len bytes
 *     -> u64 low, u64 high (0 for the 64-bit kinds)
 *   op 3, buffer digests from given page digests: u32 3, u32 alg, u64 transfer_id,
 *        u64 nonce, u32 nbufs, u32 npages, nbufs * npages u64 page digests
 *     -> nbufs x (u64 low, u64 high)
 *
 * Every record runs once per thread order (kvwd_cpu_order 0, 1, 2); the outputs must agree.
 * Each buffer's pool is its own allocation of exactly pool_pages * page_bytes bytes (and each
 * raw input exactly len bytes), so a sanitizer build catches any read past a page at the end.
 * Exit status: 0 ok, 2 bad input, 3 the thread orders disagree, 4 threads disagreed on a step.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvwd_kernel.cu"

static FILE* in_f;
static FILE* out_f;

static void die(int code, const char* what) {
    fprintf(stderr, "harness: %s\n", what);
    exit(code);
}

static void* xmalloc(size_t n) {
    void* p = malloc(n ? n : 1);
    if (!p) die(2, "out of memory");
    return p;
}

static void rd(void* p, size_t n) {
    if (n && fread(p, 1, n, in_f) != n) die(2, "short input");
}

static kv_u64 rd_le(int bytes) {
    unsigned char b[8];
    kv_u64 v = 0;
    rd(b, (size_t)bytes);
    for (int i = 0; i < bytes; i++) v |= (kv_u64)b[i] << (8 * i);
    return v;
}

static void wr64(kv_u64 v) {
    unsigned char b[8];
    for (int i = 0; i < 8; i++) b[i] = (unsigned char)(v >> (8 * i));
    if (fwrite(b, 1, 8, out_f) != 8) die(2, "write failed");
}

static void check_orders(const kv_u64* first, const kv_u64* other, size_t words) {
    if (memcmp(first, other, words * sizeof(kv_u64)) != 0) die(3, "thread orders disagree");
}

static kv_u32 tab[KVWD_CRC_TABLE_WORDS];

static void op_transfer(void) {
    kv_u32 alg = (kv_u32)rd_le(4);
    kv_u64 tid = rd_le(8), nonce = rd_le(8);
    kv_u32 nbufs = (kv_u32)rd_le(4), npages = (kv_u32)rd_le(4);
    KvwdBuffer* bufs = (KvwdBuffer*)xmalloc(nbufs * sizeof(KvwdBuffer));
    unsigned char** pools = (unsigned char**)xmalloc(nbufs * sizeof(unsigned char*));
    for (kv_u32 b = 0; b < nbufs; b++) {
        kv_u64 page_bytes = rd_le(4), pool_pages = rd_le(4);
        size_t n = (size_t)(page_bytes * pool_pages);
        pools[b] = (unsigned char*)xmalloc(n);
        rd(pools[b], n);
        bufs[b].base = (kv_u64)pools[b];
        bufs[b].page_bytes = page_bytes;
    }
    kv_u32* pages = (kv_u32*)xmalloc(npages * sizeof(kv_u32));
    for (kv_u32 i = 0; i < npages; i++) pages[i] = (kv_u32)rd_le(4);

    size_t np = (size_t)nbufs * npages;
    kv_u64* pd[3];
    kv_u64* bd[3];
    for (int order = 0; order < 3; order++) {
        kvwd_cpu_order = order;
        pd[order] = (kv_u64*)xmalloc(np * sizeof(kv_u64));
        bd[order] = (kv_u64*)xmalloc(2 * nbufs * sizeof(kv_u64));
        if (kvwd_cpu_page_digests(bufs, nbufs, npages, alg, pages, tab, pd[order]) != 0)
            die(4, "threads disagreed on a step (pages)");
        if (kvwd_cpu_buffer_digests(pd[order], nbufs, npages, alg, tid, nonce, bd[order]) != 0)
            die(4, "threads disagreed on a step (buffers)");
        if (order > 0) {
            check_orders(pd[0], pd[order], np);
            check_orders(bd[0], bd[order], 2 * (size_t)nbufs);
        }
    }
    for (size_t k = 0; k < 2 * (size_t)nbufs; k++) wr64(bd[0][k]);
    for (size_t k = 0; k < np; k++) wr64(pd[0][k]);
    for (int order = 0; order < 3; order++) {
        free(pd[order]);
        free(bd[order]);
    }
    for (kv_u32 b = 0; b < nbufs; b++) free(pools[b]);
    free(pools);
    free(bufs);
    free(pages);
}

static void op_raw(void) {
    kv_u32 kind = (kv_u32)rd_le(4);
    kv_u64 len = rd_le(8);
    unsigned char* bytes = (unsigned char*)xmalloc((size_t)len);
    rd(bytes, (size_t)len);
    kv_u64 out[3][2];
    for (int order = 0; order < 3; order++) {
        kvwd_cpu_order = order;
        out[order][0] = 0;
        out[order][1] = 0;
        if (kvwd_cpu_hash(kind, bytes, len, tab, out[order]) != 0) die(4, "threads disagreed on a step (raw)");
        if (order > 0) check_orders(out[0], out[order], 2);
    }
    wr64(out[0][0]);
    wr64(out[0][1]);
    free(bytes);
}

static void op_fold(void) {
    kv_u32 alg = (kv_u32)rd_le(4);
    kv_u64 tid = rd_le(8), nonce = rd_le(8);
    kv_u32 nbufs = (kv_u32)rd_le(4), npages = (kv_u32)rd_le(4);
    size_t np = (size_t)nbufs * npages;
    kv_u64* pd = (kv_u64*)xmalloc(np * sizeof(kv_u64));
    for (size_t k = 0; k < np; k++) pd[k] = rd_le(8);
    kv_u64* bd[3];
    for (int order = 0; order < 3; order++) {
        kvwd_cpu_order = order;
        bd[order] = (kv_u64*)xmalloc(2 * nbufs * sizeof(kv_u64));
        if (kvwd_cpu_buffer_digests(pd, nbufs, npages, alg, tid, nonce, bd[order]) != 0)
            die(4, "threads disagreed on a step (fold)");
        if (order > 0) check_orders(bd[0], bd[order], 2 * (size_t)nbufs);
    }
    for (size_t k = 0; k < 2 * (size_t)nbufs; k++) wr64(bd[0][k]);
    for (int order = 0; order < 3; order++) free(bd[order]);
    free(pd);
}

int main(int argc, char** argv) {
    if (argc != 3) die(2, "usage: harness INPUT OUTPUT");
    in_f = fopen(argv[1], "rb");
    out_f = fopen(argv[2], "wb");
    if (!in_f || !out_f) die(2, "cannot open files");
    kvwd_cpu_crc_tables(tab);
    for (;;) {
        unsigned char b[4];
        size_t got = fread(b, 1, 4, in_f);
        if (got == 0) break;
        if (got != 4) die(2, "short op");
        kv_u32 op = (kv_u32)b[0] | (kv_u32)b[1] << 8 | (kv_u32)b[2] << 16 | (kv_u32)b[3] << 24;
        switch (op) {
        case 1: op_transfer(); break;
        case 2: op_raw(); break;
        case 3: op_fold(); break;
        default: die(2, "unknown op");
        }
    }
    if (fclose(out_f) != 0) die(2, "close failed");
    fclose(in_f);
    return 0;
}
