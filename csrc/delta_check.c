/* The check half of the native delta codec's unpack (csrc/delta_apply.c runs it over every narrow chunk
 * before the first write; the format: triton_reshard/ops/delta_v2.py): does a narrow chunk's body agree with
 * its header? No write. The common block (offsets, unpatched, 2..8-bit values: nearly every block at a few %
 * changed) is checked inline in a few instructions, its disagreements OR-ed into one flag read at the chunk's
 * end (no branch per condition); any other block by check_block. Why: the check is compute bound and was
 * ~0.16x a copy of the 125M Llama at 1 % changed (~26 cycles per block), a quarter of the whole apply. */
#include "delta_codec.h"

/* Bits set in the n bytes at p, 8 bytes at a time (no popcnt instruction assumed: the portable build has
 * none, and __builtin_popcount then calls libgcc per byte) */
static inline int popcount_bytes(const uint8_t *p, int n) {
    int c = 0;
    for (int q = 0; q < n; q += 8) {
        uint64_t x = 0;
        memcpy(&x, p + q, (size_t)(n - q < 8 ? n - q : 8));
        x -= (x >> 1) & 0x5555555555555555ull;
        x = (x & 0x3333333333333333ull) + ((x >> 2) & 0x3333333333333333ull);
        x = (x + (x >> 4)) & 0x0F0F0F0F0F0F0F0Full;
        c += (int)((x * 0x0101010101010101ull) >> 56);
    }
    return c;
}

/* 0 when the n >= 0 offsets at p ascend strictly, else nonzero; n + 16 bytes readable from p on x86-64 (16
 * pairs per SSE2 compare: baseline, no dispatch), the pairs past n masked off, the disagreements OR-ed (no
 * early exit: at 1 % changed a block holds ~2.5 offsets, one compare, and no branch mispredicted) */
INLINE unsigned not_ascending(const uint8_t *p, int n) {
    unsigned bad = 0;
#if defined(__x86_64__) && defined(__SSE2__)
    for (int j = 0;; j += 16) {
        __m128i lo = _mm_loadu_si128((const __m128i *)(const void *)(p + j));
        __m128i hi = _mm_loadu_si128((const __m128i *)(const void *)(p + j + 1));
        /* bit k: p[j + k + 1] <= p[j + k] (the saturated difference is 0) */
        unsigned down = (unsigned)_mm_movemask_epi8(_mm_cmpeq_epi8(_mm_subs_epu8(hi, lo), _mm_setzero_si128()));
        int pairs = n - 1 - j; /* those left: below 16 the rest are masked off */
        pairs = pairs < 0 ? 0 : pairs > 16 ? 16 : pairs;
        bad |= down & (0xFFFFu >> (16 - pairs));
        if (j + 17 >= n) return bad;
    }
#else
    for (int j = 1; j < n; j++) bad |= p[j] <= p[j - 1];
    return bad;
#endif
}

/* One block of a narrow chunk (its descriptor d, its payload from p with avail bytes readable, blen elements
 * of e bytes): its payload bytes when it agrees with its descriptor, else -1; *cnt its changes */
__attribute__((noinline)) static int64_t check_block(const uint8_t *d, const uint8_t *p, int64_t avail, int blen, int e, int *cnt) {
    int code = d[0] & 0x0F, n = d[1] + 1, mode = pos_mode(d[0] >> 4), nexc = exceptions_of(d[0] >> 4);
    *cnt = 0;
    if (code == 0) return d[0] || d[1] ? -1 : 0;
    int64_t size = block_bytes(d[0], n, blen, e);
    if (size < 0 || size > avail) return -1;
    if (nexc) { /* the exceptions' slots ascending, inside the values */
        const uint8_t *xs = p + size - (int64_t)nexc * (1 + e);
        int nvb = mode == MODE_ALL ? blen : n;
        for (int x = 0; x < nexc; x++)
            if (xs[x] >= nvb || (x && xs[x] <= xs[x - 1])) return -1;
    }
    if (mode == MODE_OFFSETS) {
        if (p[n - 1] >= blen) return -1;
        for (int j = 1; j < n; j++)
            if (p[j] <= p[j - 1]) return -1;
    }
    if (mode == MODE_BITMASK &&
        (popcount_bytes(p, (blen + 7) / 8) != n || ((blen & 7) && (p[blen / 8] >> (blen & 7)))))
        return -1;
    *cnt = n;
    return size;
}

#ifdef HAVE_X86
/* Shift 8 lanes up by k (lane i gets lane i - k, the first k lanes 0) */
#define LANES_UP(v, k) _mm512_alignr_epi64((v), _mm512_setzero_si512(), 8 - (k))

/* check_chunk's run of common blocks 8 at a time on AVX-512 (one at a time ~12 cycles each, its loads, compare
 * and masks: the most of the check at 1 % changed, ~0.08x a copy), while each of the 8 is empty or has
 * descriptor 1 .. maxc and at most 8 offsets, none is the chunk's last, and their payloads (one after another)
 * fit in 63 bytes ending 16 or more before the body's end: their sizes from the 8 descriptors at once, where
 * each starts by a prefix sum, every byte pair of the 64 compared in one mask and each block's offsets' pairs
 * (its first cnt - 1 from its start) tested against it. (A gather of each block's first 8 bytes instead:
 * half the check's time on Zen 4, measured.) Returns the first block not checked (the caller checks the next
 * 8 or more one at a time: fewer, up to the one that stopped the group, was slower at 2 % changed, where most
 * groups hold a block of more than 8); *at, *total and *bad (the disagreements OR-ed) carried on. */
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq"))) static int64_t
check_groups(const uint8_t *in, int64_t nbytes, const uint8_t *desc, int64_t b, int64_t nbk, unsigned maxc,
             int64_t *at, int64_t *total, uint64_t *bad) {
    const __m512i one = _mm512_set1_epi64(1), seven = _mm512_set1_epi64(7), zero = _mm512_setzero_si512();
    const __m512i top = _mm512_set1_epi64(maxc);
    int64_t a = *at;
    uint64_t bd = *bad;
    __m512i t = zero; /* the counts, summed once */
    for (; b + 8 < nbk; b += 8) {
        __m512i dw = _mm512_cvtepu16_epi64(_mm_loadu_si128((const __m128i *)(const void *)(desc + 2 * b)));
        __m512i d0 = _mm512_and_si512(dw, _mm512_set1_epi64(0xFF)), d1 = _mm512_srli_epi64(dw, 8);
        __mmask8 full = _mm512_cmpneq_epi64_mask(d0, zero);
        if (_mm512_cmpgt_epu64_mask(d0, top) | _mm512_mask_cmpgt_epu64_mask(full, d1, seven)) break;
        __m512i cnt = _mm512_maskz_add_epi64(full, d1, one);
        __m512i size = _mm512_add_epi64(cnt, _mm512_srli_epi64(_mm512_add_epi64(_mm512_sllv_epi64(cnt, d0), seven), 3));
        __m512i inc = _mm512_add_epi64(size, LANES_UP(size, 1));
        inc = _mm512_add_epi64(inc, LANES_UP(inc, 2));
        inc = _mm512_add_epi64(inc, LANES_UP(inc, 4));
        __m512i rel = _mm512_sub_epi64(inc, size); /* where each starts, from the first */
        int64_t span = _mm_extract_epi64(_mm512_extracti64x2_epi64(inc, 3), 1); /* lane 7: all 8 */
        if (span > 63 || a + span + 16 > nbytes) break;
        /* bit i: byte a + i + 1 <= byte a + i (the 8 payloads lie one after another, in 64 bytes) */
        __mmask64 m = ((uint64_t)1 << span) - 1;
        uint64_t down = _mm512_cmple_epu8_mask(_mm512_maskz_loadu_epi8(m >> 1, in + a + 1),
                                               _mm512_maskz_loadu_epi8(m, in + a));
        /* block j's pairs: the first cnt - 1 from its start (none when empty) */
        __m512i pairs = _mm512_maskz_sub_epi64(full, _mm512_srli_epi64(_mm512_sllv_epi64(one, cnt), 1), one);
        bd |= _mm512_test_epi64_mask(_mm512_srlv_epi64(_mm512_set1_epi64((long long)down), rel), pairs) |
              _mm512_mask_cmpneq_epi64_mask((__mmask8)~full, d1, zero);
        a += span;
        t = _mm512_add_epi64(t, cnt);
    }
    *at = a, *total += _mm512_reduce_add_epi64(t), *bad = bd;
    return b;
}
#endif

/* Does the body of a narrow chunk (at in: its header's len elements of e bytes, count changes, nbytes bytes)
 * agree with its header? 0: yes. A run of blocks before the last, each empty or with descriptor 1 .. maxc
 * (offsets, unpatched, values of 2 .. 2^maxc bits) and ending 16 bytes or more before the body's end, inline
 * and without a branch per block (an empty block counts 0 changes, 0 bytes: at 1 % changed ~8 % of the
 * blocks, each a mispredicted branch when apart): its offsets ascending (so each inside the block, and no
 * more than it holds). Any other block, and the last, by check_block. */
INLINE int check_chunk(const uint8_t *in, int64_t len, int64_t count, int64_t nbytes, int e) {
    int64_t nbk = (len + BLOCK - 1) / BLOCK, at = 16 + 2 * nbk, total = 0, b = 0;
    const unsigned maxc = e == 1 ? 2 : e == 2 ? 3 : e == 4 ? 4 : 5; /* the narrow codes: (1 << code) < 8 e */
    const uint8_t *desc = in + 16;
    uint64_t bad = 0;
    int64_t alone = 4; /* blocks one at a time after a group that does not qualify: twice as many each time no
                          group did (at 10 % changed nearly none does: their tries cost ~8 % of the check) */
    if (at > nbytes) return 1;
    while (b < nbk) {
        int64_t stop = nbk - 1;
#ifdef HAVE_X86
        if (trd_fast16 == FAST16_AVX512) { /* groups of 8, then a few blocks one at a time */
            int64_t b0 = b;
            b = check_groups(in, nbytes, desc, b, nbk, maxc, &at, &total, &bad);
            alone = b > b0 ? 8 : alone < nbk ? 2 * alone : alone; /* (bounded: a chunk's uncommon blocks) */
            stop = b + alone < nbk - 1 ? b + alone : nbk - 1;
        }
#endif
        for (; b < stop; b++) {
            unsigned d0 = desc[2 * b], d1 = desc[2 * b + 1], cnt = (d1 + 1) & -(unsigned)(d0 != 0);
            int64_t size = cnt + (((int64_t)cnt << (d0 & 7)) + 7) / 8;
            if (d0 > maxc || at + size + 16 > nbytes) break;
            bad |= ((d0 == 0) & (d1 != 0)) | not_ascending(in + at, (int)cnt);
            at += size;
            total += cnt;
        }
        if (b == stop && b < nbk - 1) continue;
        if (b == nbk) break;
        int blen = (int)(len - b * BLOCK < BLOCK ? len - b * BLOCK : BLOCK), cnt;
        int64_t size = check_block(desc + 2 * b, in + at, nbytes - at, blen, e, &cnt);
        if (size < 0) return 1;
        at += size;
        total += cnt;
        b++;
    }
    return bad || pad16(at) != nbytes || total != count;
}

/* check_chunk compiled once per element size */
HIDDEN int trd_check_narrow(const uint8_t *in, int64_t len, int64_t count, int64_t nbytes, int e) {
    switch (e) {
    case 1: return check_chunk(in, len, count, nbytes, 1);
    case 2: return check_chunk(in, len, count, nbytes, 2);
    case 4: return check_chunk(in, len, count, nbytes, 4);
    default: return check_chunk(in, len, count, nbytes, 8);
    }
}
