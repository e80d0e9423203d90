/* The sparse apply's common run of blocks on AVX-512 (csrc/delta_apply.c stages a narrow chunk's changes, then
 * applies them with their destination lines prefetched; the format: triton_reshard/ops/delta_v2.py): at 1 %
 * changed nearly every block is empty or holds ~2.5 offsets and their 2-bit differences. Staged one at a time,
 * such a block cost ~40 cycles, most of them the mispredicted loop over its 0 .. 8 changes: the decode, not
 * the memory, was ~2/3 of the apply. Here each block is staged whole, without a branch on its count: its first
 * 8 offset bytes widened to 8 positions and its first 8 values (whatever their width) sign-extended to 8 lanes,
 * both stored, the count of slots kept its count of changes (the slots past it are overwritten by the next
 * block's; the scratch has 8 slots of slack). */
#include "delta_codec.h"

#ifdef HAVE_X86
/* Per code 0 .. 3 (values of 1 << code bits; 0: an empty block, nothing kept): lane i's value is the bits
 * [w i, w i + w) of the 64 bits after its offsets, shifted to the top and back down with its sign */
static const int64_t shl[4][8] = {{0}, {62, 60, 58, 56, 54, 52, 50, 48}, {60, 56, 52, 48, 44, 40, 36, 32},
                                  {56, 48, 40, 32, 24, 16, 8, 0}};
static const int64_t sra[4] = {0, 62, 60, 56};
#ifndef PREFETCHED
#define PREFETCHED 5 /* a block's changes prefetched without a branch: at 1 % changed ~96 % of blocks hold <= 5 */
#endif

/* Stage blocks b .. of a narrow chunk of 16-bit elements (its descriptors desc, nbk of them; body in .. in +
 * nbytes; r: the position in it) while each is empty or offsets, unpatched, 2 .. 8-bit values and at most 8
 * changes, and is not the chunk's last (which may be short: the generic path checks its offsets' bound); each
 * change's element offset (the block's first element is a + 256 b) into pos, its difference (neg: negated)
 * into val, from slot r->k, its destination lines (elements d + 2 pos) prefetched (the apply comes a chunk
 * later: csrc/delta_apply.c). Returns the first block not staged. */
__attribute__((target("avx512f,avx512vl,avx512dq"))) HIDDEN int64_t
trd_stage_run16(stage_run *r, const uint8_t *in, int64_t nbytes, const uint8_t *desc, int64_t b, int64_t nbk,
                int64_t a, int neg, uint8_t *d, int64_t *pos, uint64_t *val) {
    int64_t at = r->at, k = r->k, total = r->total;
    unsigned bad = r->bad;
    const __m512i sgn = _mm512_set1_epi64(neg ? -1 : 0);
    uint8_t *prev = d + 2 * (a + BLOCK * b);
    for (; b < nbk - 1; b++) {
        unsigned d0 = desc[2 * b], d1 = desc[2 * b + 1];
        if (d0 > 3 || d1 > 7 || at + 16 > nbytes) break;
        unsigned cnt = (d1 + 1) & -(unsigned)(d0 != 0);
        const uint8_t *p = in + at;
        uint64_t o, x;
        memcpy(&o, p, 8);
        memcpy(&x, p + cnt, 8);
        __m512i posv = _mm512_add_epi64(_mm512_set1_epi64(a + BLOCK * b), _mm512_cvtepu8_epi64(_mm_cvtsi64_si128((long long)o)));
        __m512i v = _mm512_sllv_epi64(_mm512_set1_epi64((long long)x), _mm512_loadu_si512((const void *)shl[d0]));
        v = _mm512_srav_epi64(v, _mm512_set1_epi64(sra[d0]));
        v = _mm512_sub_epi64(_mm512_xor_si512(v, sgn), sgn);
        _mm512_storeu_si512((void *)(pos + k), posv);
        _mm512_storeu_si512((void *)(val + k), v);
        /* its lines: those of its first PREFETCHED changes without a branch (fewer: the last again; none: the
           previous block's last), any more after */
        uint8_t *db = d + 2 * (a + BLOCK * b), *line = prev;
        int last = cnt ? (int)cnt - 1 : 0;
        for (int i = 0; i < PREFETCHED; i++) {
            line = cnt ? db + 2 * p[i < last ? i : last] : prev;
            __builtin_prefetch(line, 1, 1);
        }
        for (int i = PREFETCHED; i < (int)cnt; i++) __builtin_prefetch(db + 2 * p[i], 1, 1);
        prev = line;
        bad |= (d0 == 0) & (d1 != 0);
        k += cnt, total += cnt;
        at += cnt + (((int64_t)cnt << d0) + 7) / 8;
    }
    r->at = at, r->k = k, r->total = total, r->bad = bad;
    return b;
}
#endif
