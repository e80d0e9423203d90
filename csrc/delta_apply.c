/* The apply half of the native delta codec (csrc/delta_codec.c describes the codec; the format:
 * triton_reshard/ops/delta_v2.py): a check pass over a message's narrow bodies (no write: trd_check_narrow,
 * csrc/delta_check.c, per chunk), the apply pass into
 * destinations that are contiguous or rows (a column block of a row-major tensor: rows of `cols` elements,
 * `rstride` apart, written where they lie), the commit and undo of a pack made with update 2, and the check
 * of a message's directory. */
#include "delta_codec.h"
#include <pthread.h>

#define TRD_APPLY 0
#define TRD_CHECK 1  /* no write */
#define TRD_COMMIT 2 /* the raw blocks and the dense chunks only: completes a pack made with update 2 */
#define TRD_UNDO 3   /* the narrow blocks' differences subtracted: undoes a pack made with update 2 */

/* A destination view: rows of w elements st apart (w == st: contiguous) from d */
typedef struct { uint8_t *d; int64_t w, st; } view_t;

static inline int64_t elem_at(const view_t *v, int64_t i) { return v->w == v->st ? i : i / v->w * v->st + i % v->w; }

/* The 256-bit mask of a block's n offsets, built in registers (an OR into m[] in memory waits on the last one
 * each time: ~25 of them per block at 10 % changed, the most of a 16-bit block's AVX-512 apply, measured) */
static inline void offsets_mask(const uint8_t *pos, int n, uint64_t *m) {
    uint64_t m0 = 0, m1 = 0, m2 = 0, m3 = 0;
    for (int j = 0; j < n; j++) {
        uint64_t bit = (uint64_t)1 << (pos[j] & 63), h = pos[j] >> 6;
        m0 |= h == 0 ? bit : 0, m1 |= h == 1 ? bit : 0, m2 |= h == 2 ? bit : 0, m3 |= h == 3 ? bit : 0;
    }
    m[0] = m0, m[1] = m1, m[2] = m2, m[3] = m3;
}

#ifdef HAVE_X86
static inline void decode16(const uint8_t *p, int16_t *v, int n, int w) {
    if (w == 2)
        for (int j = 0; j < n; j++) v[j] = (int16_t)((int8_t)(uint8_t)(p[j >> 2] << (6 - 2 * (j & 3))) >> 6);
    else if (w == 4)
        for (int j = 0; j < n; j++) v[j] = (int16_t)((int8_t)(uint8_t)(p[j >> 1] << (4 - 4 * (j & 1))) >> 4);
    else
        for (int j = 0; j < n; j++) v[j] = (int16_t)(int8_t)p[j];
}

/* Apply one narrow block of 16-bit elements at db (not raw; neg: subtract): its positions (offsets, bitmask or
 * all) as a mask of 4 words, its n values decoded once, then per 32-element group with a change one load, an
 * add of the values expanded to their lanes (0 in the others), one store; a group past the block's end masked
 * to its changed lanes: no byte outside the block is touched. */
__attribute__((target("avx512f,avx512bw,avx512vbmi2,popcnt"))) static void
add_block16(uint8_t *db, int blen, int mode, const uint8_t *pos, const uint8_t *p, int n, int w, int neg) {
    uint64_t m[4] = {0, 0, 0, 0};
    int16_t v[BLOCK];
    if (mode == MODE_OFFSETS)
        for (int j = 0; j < n; j++) m[pos[j] >> 6] |= (uint64_t)1 << (pos[j] & 63);
    else if (mode == MODE_BITMASK)
        memcpy(m, pos, (size_t)(blen + 7) / 8);  /* little-endian: bit k of byte j is element 8 j + k */
    else
        for (int k = 0; k < 4; k++)
            m[k] = blen >= 64 * (k + 1) ? ~(uint64_t)0 : blen > 64 * k ? ((uint64_t)1 << (blen - 64 * k)) - 1 : 0;
    decode16(p, v, n, w);
    if (neg)
        for (int j = 0; j < n; j++) v[j] = (int16_t)-v[j];
    int k = 0;
    for (int l = 0; l < BLOCK / 32; l++) {
        uint32_t bits = (uint32_t)(m[l >> 1] >> (32 * (l & 1)));
        if (!bits) continue;
        __m512i x = _mm512_maskz_expandloadu_epi16(bits, v + k);
        if (32 * (l + 1) <= blen) { /* inside the block: the whole group (its unchanged lanes add 0) */
            __m512i a = _mm512_loadu_si512((const void *)(db + 64 * l));
            _mm512_storeu_si512((void *)(db + 64 * l), _mm512_add_epi16(a, x));
        } else { /* the block's end: its changed lanes only (nothing past the destination is touched) */
            __m512i a = _mm512_maskz_loadu_epi16(bits, db + 64 * l);
            _mm512_mask_storeu_epi16(db + 64 * l, bits, _mm512_add_epi16(a, x));
        }
        k += __builtin_popcount(bits);
    }
}

/* The 8 values k .. k+7 of a block's values of w bits (2, 4 or 8) at p, sign-extended to 16-bit lanes (those
 * past the block's: whatever follows, never read past the chunk's avail bytes from p); straight from the
 * message (not decoded to memory and read back 8 at a time, which may wait on the store buffer; no gain of
 * either measured at 10 % here: the apply then takes the scalar path anyway) */
__attribute__((target("avx2"))) static inline __m128i vals8(const uint8_t *p, int64_t avail, int k, int w) {
    int64_t at = (int64_t)k * w / 8;
    uint64_t x = 0;
    if (at + 8 <= avail) memcpy(&x, p + at, 8);
    else
        for (int64_t b = at; b < avail && b < at + 8; b++) x |= (uint64_t)p[b] << (8 * (b - at));
    x >>= ((int64_t)k * w) & 7;
    if (w == 8) return _mm_cvtepi8_epi16(_mm_cvtsi64_si128((long long)x));
    if (w == 2) {
        __m128i b = _mm_set1_epi16((short)x);
        return _mm_srai_epi16(_mm_mullo_epi16(b, _mm_setr_epi16(1 << 14, 1 << 12, 1 << 10, 1 << 8, 1 << 6, 1 << 4,
                                                                1 << 2, 1)), 14);
    }
    __m128i b = _mm_shuffle_epi8(_mm_set1_epi32((int)x), _mm_setr_epi8(0, 1, 0, 1, 0, 1, 0, 1, 2, 3, 2, 3, 2, 3, 2, 3));
    return _mm_srai_epi16(_mm_mullo_epi16(b, _mm_setr_epi16(1 << 12, 1 << 8, 1 << 4, 1, 1 << 12, 1 << 8, 1 << 4, 1)), 12);
}

/* add_block16 on AVX2: per 16-element group with a change, each 8-lane half's next values (vals8) expanded to
 * its changed lanes by a pshufb (trd_ex16; 0 in the others), one load, add and store; a group past the block's
 * end element by element (no byte outside the block is touched). */
__attribute__((target("avx2,popcnt"))) static void
add_block16_avx2(uint8_t *db, int blen, int mode, const uint8_t *pos, const uint8_t *p, int64_t avail, int n, int w,
                 int neg) {
    uint64_t m[4] = {0, 0, 0, 0};
    if (mode == MODE_OFFSETS) {
        offsets_mask(pos, n, m);
    } else if (mode == MODE_BITMASK) {
        memcpy(m, pos, (size_t)(blen + 7) / 8);
    } else {
        for (int k = 0; k < 4; k++)
            m[k] = blen >= 64 * (k + 1) ? ~(uint64_t)0 : blen > 64 * k ? ((uint64_t)1 << (blen - 64 * k)) - 1 : 0;
    }
    __m128i sign = _mm_set1_epi16(neg ? -1 : 0); /* (x ^ -1) - (-1) = -x */
    int k = 0;
    for (int l = 0; l < BLOCK / 16; l++) {
        unsigned bits = (unsigned)(m[l >> 2] >> (16 * (l & 3))) & 0xFFFFu, lo = bits & 0xFFu, hi = bits >> 8;
        if (!bits) continue;
        __m128i vl = _mm_sub_epi16(_mm_xor_si128(vals8(p, avail, k, w), sign), sign);
        __m128i xl = _mm_shuffle_epi8(vl, _mm_loadu_si128((const __m128i *)(const void *)trd_ex16[lo]));
        k += __builtin_popcount(lo);
        __m128i vh = _mm_sub_epi16(_mm_xor_si128(vals8(p, avail, k, w), sign), sign);
        __m128i xh = _mm_shuffle_epi8(vh, _mm_loadu_si128((const __m128i *)(const void *)trd_ex16[hi]));
        k += __builtin_popcount(hi);
        __m256i x = _mm256_inserti128_si256(_mm256_castsi128_si256(xl), xh, 1);
        if (16 * (l + 1) > blen) { /* the block's end: its changed lanes only */
            uint16_t t[16];
            _mm256_storeu_si256((__m256i *)(void *)t, x);
            for (; bits; bits &= bits - 1) {
                uint8_t *e = db + 2 * (16 * l + __builtin_ctz(bits));
                uint16_t y;
                memcpy(&y, e, 2);
                y = (uint16_t)(y + t[__builtin_ctz(bits)]);
                memcpy(e, &y, 2);
            }
            continue;
        }
        __m256i a = _mm256_loadu_si256((const __m256i *)(const void *)(db + 32 * l));
        _mm256_storeu_si256((__m256i *)(void *)(db + 32 * l), _mm256_add_epi16(a, x));
    }
}
#endif

/* Add one narrow block's n values of w bits (2, 4 or 8; sign-extended; neg: subtracted) at p to the 16-bit
 * elements at db + 2 idx[j]: decoded as they are added (no pass into a buffer first), one loop per width.
 * The apply of an offsets block of dense changes (~25 per block at 10 %): faster than the AVX-512 expand
 * and add (whose mask of the offsets cost more than the adds, measured) */
#define ADD_OFFSETS16(W, GET)                                                                                   \
    for (int j = 0; j < n; j++) {                                                                              \
        uint16_t y, v = (uint16_t)(GET);                                                                       \
        memcpy(&y, db + 2 * idx[j], 2);                                                                        \
        y = (uint16_t)(y + ((v ^ sign) - sign));                                                               \
        memcpy(db + 2 * idx[j], &y, 2);                                                                        \
    }
static inline void add_offsets16(uint8_t *db, const uint8_t *idx, const uint8_t *p, int n, int w, int neg) {
    uint16_t sign = neg ? 0xFFFFu : 0; /* (v ^ -1) - (-1) = -v */
    if (w == 2)
        ADD_OFFSETS16(2, (int8_t)(uint8_t)(p[j >> 2] << (6 - 2 * (j & 3))) >> 6)
    else if (w == 4)
        ADD_OFFSETS16(4, (int8_t)(uint8_t)(p[j >> 1] << (4 - 4 * (j & 1))) >> 4)
    else
        ADD_OFFSETS16(8, (int8_t)p[j])
}

/* The decoded changes of one chunk: element offset from the view's start (bit 63: a raw value) and value (raw
 * bits or the sign-extended difference); applied once the next chunk is decoded too (queue_t below). The
 * destination's line of each change is prefetched as it is decoded, into L2 (prefetcht2: prefetcht0, nta or
 * w made the 1 % apply 2x slower here, measured on Zen 4: they hold the core's few L1 miss buffers). */
typedef struct { int64_t *pos; uint64_t *val; } changes;

#define DIRECT_ABOVE 32 /* changed fraction above 1/32: apply as decoded */
#define RAWBIT ((uint64_t)1 << 63)

INLINE void apply_changes(const changes *ch, int64_t k, uint8_t *d, int e) {
    for (int64_t j = 0; j < k; j++) {
        uint64_t pj = (uint64_t)ch->pos[j];
        int64_t i = (int64_t)(pj & ~RAWBIT);
        store(d, i, e, (pj & RAWBIT) ? ch->val[j] : load(d, i, e) + ch->val[j]);
    }
}

/* The staged chunks waiting for their apply: a chunk's changes are applied after the next chunk's decode (which
 * prefetched their lines), not at its own end: the memory brings them while the core decodes (at 1 % changed,
 * with the decode's run of csrc/delta_stage.c, the apply alone 6.7 -> 5.9 ms, measured; a queue of 3 gained
 * nothing more). Chunks are disjoint: the order of their applies does not matter. */
#define QUEUE 2
typedef struct { changes ch[QUEUE]; int64_t k[QUEUE]; uint8_t *d[QUEUE]; int e[QUEUE], n; } queue_t;

static void apply_slot(queue_t *q, int s) {
    switch (q->e[s]) {
    case 1: apply_changes(&q->ch[s], q->k[s], q->d[s], 1); break;
    case 2: apply_changes(&q->ch[s], q->k[s], q->d[s], 2); break;
    case 4: apply_changes(&q->ch[s], q->k[s], q->d[s], 4); break;
    default: apply_changes(&q->ch[s], q->k[s], q->d[s], 8); break;
    }
    q->k[s] = 0;
}

/* Stage one narrow 16-bit offsets block's n values of w bits (2, 4 or 8; sign-extended; neg: negated) at p for
 * the chunk's prefetched apply (as apply_block, without its pass of the values into a buffer first): the
 * sparse apply's common block (~2.5 changes each at 1 %), whose fixed costs were most of its decode */
#define STAGE16(GET)                                                                                            \
    for (int j = 0; j < n; j++) {                                                                              \
        int64_t off = boff + idx[j];                                                                           \
        int64_t v = (int8_t)(GET);                                                                             \
        __builtin_prefetch(d + 2 * off, 1, 1);                                                                 \
        ch->pos[k] = off;                                                                                      \
        ch->val[k++] = (uint64_t)(neg ? -v : v);                                                               \
    }
static inline int64_t stage_offsets16(uint8_t *d, int64_t boff, const uint8_t *idx, const uint8_t *p, int n, int w,
                                      int neg, const changes *ch, int64_t k) {
    if (w == 2)
        STAGE16((int8_t)(uint8_t)(p[j >> 2] << (6 - 2 * (j & 3))) >> 6)
    else if (w == 4)
        STAGE16((int8_t)(uint8_t)(p[j >> 1] << (4 - 4 * (j & 1))) >> 4)
    else
        STAGE16(p[j])
    return k;
}

/* Apply one checked block of a chunk (positions idx, or every element in mode "all"; nv values at p of width
 * w; its first element i0 of the view, boff where it lies, -1 across a row end): as decoded when the chunk's
 * changes are dense and the block lies in one row, else into ch for the chunk's prefetched apply. Returns
 * the count of changes in ch. */
INLINE int64_t apply_block(const view_t *vw, int64_t i0, int64_t boff, int e, int mode, int raw, int op,
                           const uint8_t *idx, const uint8_t *p, int nv, int w, int nexc, int direct,
                           const changes *ch, int64_t k) {
    uint64_t v[BLOCK];
    const uint8_t *xp = get_values(p, v, nv, w);
    if (!raw) {
        int sh = 64 - w;
        for (int j = 0; j < nv; j++) v[j] = (uint64_t)((int64_t)(v[j] << sh) >> sh);
        patch_values(xp, nexc, e, v);
        if (op == TRD_UNDO)
            for (int j = 0; j < nv; j++) v[j] = (uint64_t)0 - v[j];
    }
    if (direct && boff >= 0) {
        uint8_t *db = vw->d + boff * e;
        if (mode == MODE_ALL && raw)
            for (int j = 0; j < nv; j++) store(db, j, e, v[j]);
        else if (mode == MODE_ALL)
            for (int j = 0; j < nv; j++) store(db, j, e, load(db, j, e) + v[j]);
        else if (raw)
            for (int j = 0; j < nv; j++) store(db, idx[j], e, v[j]);
        else
            for (int j = 0; j < nv; j++) store(db, idx[j], e, load(db, idx[j], e) + v[j]);
    } else {
        uint64_t rawbit = raw ? RAWBIT : 0;
        for (int j = 0; j < nv; j++) {
            if (!raw && !v[j]) continue;  /* an unchanged element of an "all" block */
            int64_t ij = mode == MODE_ALL ? j : idx[j];
            int64_t off = boff >= 0 ? boff + ij : elem_at(vw, i0 + ij);
            __builtin_prefetch(vw->d + off * e, 1, 1);  /* (into L2: measured faster than L1 here) */
            ch->pos[k] = (int64_t)((uint64_t)off | rawbit);
            ch->val[k++] = v[j];
        }
    }
    return k;
}

/* Decode and apply one narrow chunk's body (op: TRD_APPLY, TRD_COMMIT, TRD_UNDO; checked first by
 * trd_check_narrow, csrc/delta_check.c, unless it is the codec's own message) to the elements a .. a + len - 1
 * of view v; returns 0 when it agrees with its header. The common block (offsets, unpatched, 2 .. 8-bit values,
 * 16-bit elements of a contiguous view: nearly every block at a few % changed) first, in a few instructions
 * (the generic parse below cost as much as its apply at 1 % changed). */
INLINE int narrow_chunk(const uint8_t *in, int64_t len, int64_t count, int64_t nbytes, int e, const view_t *vw,
                        int64_t a, const changes *ch, int op, int64_t *staged) {
    int64_t nbk = (len + BLOCK - 1) / BLOCK, at = 16 + 2 * nbk, total = 0, k = 0;
    const uint8_t *desc = in + 16;
    /* dense changes touch nearly every line of the destination (the hardware prefetcher streams it): apply
       as decoded; sparse ones: decode the chunk, then apply with the touched lines prefetched */
    int direct = count * DIRECT_ABOVE > len, contig = vw->w == vw->st, neg = op == TRD_UNDO;
    int fast = e == 2 && contig && op != TRD_COMMIT;
    int64_t rr = 0, cc = 0; /* a row view's apply: the row and column of block b's first element */
    if (!contig) rr = a / vw->w, cc = a % vw->w;
    if (at > nbytes) return 1;
#ifdef HAVE_X86
    int run = !direct && fast && trd_fast16 == FAST16_AVX512; /* the common blocks' runs: csrc/delta_stage.c */
    unsigned bad = 0;
#endif
    for (int64_t b = 0; b < nbk; b++) {
#ifdef HAVE_X86
        if (run) {
            stage_run r = {at, k, total, bad};
            b = trd_stage_run16(&r, in, nbytes, desc, b, nbk, a, neg, vw->d, ch->pos, ch->val);
            at = r.at, k = r.k, total = r.total, bad = r.bad;
        }
#endif
        if (!contig && b && (cc += BLOCK) >= vw->w) rr += cc / vw->w, cc %= vw->w;
        unsigned d0 = desc[2 * b];
        int cnt = desc[2 * b + 1] + 1, blen = (int)(len - b * BLOCK < BLOCK ? len - b * BLOCK : BLOCK);
        if (fast && d0 - 1u < 3u) { /* offsets, unpatched, 1 << d0 bits */
            const uint8_t *p = in + at;
            at += cnt + (((int64_t)cnt << d0) + 7) / 8;
            if (at > nbytes || p[cnt - 1] >= blen) return 1;
            total += cnt;
            if (direct)
                add_offsets16(vw->d + 2 * (a + b * BLOCK), p, p + cnt, cnt, 1 << d0, neg);
            else
                k = stage_offsets16(vw->d, a + b * BLOCK, p, p + cnt, cnt, 1 << d0, neg, ch, k);
            continue;
        }
        int code = d0 & 0x0F, mode = pos_mode(d0 >> 4), nexc = exceptions_of(d0 >> 4), w = width_of(code, e);
        if (code == 0) {
            if (d0 || desc[2 * b + 1]) return 1;
            continue;
        }
        int64_t size = block_bytes((int)d0, cnt, blen, e);
        if (size < 0 || at + size > nbytes) return 1;
        const uint8_t *p = in + at;
        at += size;
        total += cnt;
        int raw = code == RAW;
        if (op == TRD_COMMIT ? !raw : op == TRD_UNDO && raw) continue;  /* not this op's block */
        /* the block's first element in the view; -1: it straddles two rows (each element placed alone) */
        int64_t i0 = a + b * BLOCK, boff = contig ? i0 : cc + blen <= vw->w ? rr * vw->st + cc : -1;
        /* AVX2: positions as a bitmask or all (the scalar apply of offsets is faster: measured at 10 %) */
        int vec = direct && e == 2 && !raw && !nexc && boff >= 0 &&
                  (trd_fast16 == FAST16_AVX512 || trd_fast16 == FAST16_AVX2) && mode != MODE_OFFSETS;
        uint8_t idxb[BLOCK];
        const uint8_t *idx = idxb;
        int nv = cnt;
        if (mode == MODE_OFFSETS) {
            if (p[cnt - 1] >= blen) return 1; /* ascending (checked) and the last inside: every one inside */
            idx = p;
            p += cnt;
        } else if (mode == MODE_BITMASK) {
            for (int q = 0, c = 0; !vec && q < (blen + 7) / 8; q++)
                for (unsigned x = p[q]; x; x &= x - 1) idxb[c++] = (uint8_t)(8 * q + __builtin_ctz(x));
            p += (blen + 7) / 8;
        } else {
            nv = blen;
        }
        if (e == 2 && !raw && !nexc && boff >= 0 && mode == MODE_OFFSETS) {
            if (direct)
                add_offsets16(vw->d + boff * 2, idx, p, nv, w, neg);
            else
                k = stage_offsets16(vw->d, boff, idx, p, nv, w, neg, ch, k);
            continue;
        }
#ifdef HAVE_X86
        if (vec) {
            const uint8_t *pos = mode == MODE_BITMASK ? p - (blen + 7) / 8 : idx;
            if (trd_fast16 == FAST16_AVX512)
                add_block16(vw->d + boff * 2, blen, mode, pos, p, nv, w, neg);
            else
                add_block16_avx2(vw->d + boff * 2, blen, mode, pos, p, in + nbytes - p, nv, w, neg);
            continue;
        }
#endif
        k = apply_block(vw, i0, boff, e, mode, raw, op, idx, p, nv, w, nexc, direct, ch, k);
    }
#ifdef HAVE_X86
    if (bad) return 1;
#endif
    if (pad16(at) != nbytes || total != count) return 1;
    *staged = k;
    return 0;
}

static int narrow_chunk_e(const uint8_t *in, int64_t len, int64_t count, int64_t nbytes, int e, const view_t *vw,
                          int64_t a, queue_t *q, int op) {
    int s = q->n++ % QUEUE, r;
    if (q->k[s]) apply_slot(q, s); /* the oldest staged chunk: its lines came in while the ones since decoded */
    q->d[s] = vw->d, q->e[s] = e;
    switch (e) {
    case 1: r = narrow_chunk(in, len, count, nbytes, 1, vw, a, &q->ch[s], op, &q->k[s]); break;
    case 2: r = narrow_chunk(in, len, count, nbytes, 2, vw, a, &q->ch[s], op, &q->k[s]); break;
    case 4: r = narrow_chunk(in, len, count, nbytes, 4, vw, a, &q->ch[s], op, &q->k[s]); break;
    default: r = narrow_chunk(in, len, count, nbytes, 8, vw, a, &q->ch[s], op, &q->k[s]); break;
    }
    return r;
}

/* A dense chunk's len elements from src into the elements a .. of view v */
static void put_dense(const view_t *vw, int64_t a, int64_t len, int e, const uint8_t *src) {
    if (vw->w == vw->st) {
        memcpy(vw->d + a * e, src, (size_t)(len * e));
        return;
    }
    for (int64_t k = 0, r = a / vw->w, c = a % vw->w; k < len; r++, c = 0) {
        int64_t take = vw->w - c < len - k ? vw->w - c : len - k;
        memcpy(vw->d + (r * vw->st + c) * e, src + k * e, (size_t)(take * e));
        k += take;
    }
}

/* The arguments of one trd_unpack_rows call, and one part of its chunks: c0 .. c1 - 1, the first in view i0
 * from its element a0; r: the part's first event (-1: none; else the chunk that disagrees, or -2: a chunk
 * kind this codec does not write) */
typedef struct {
    const uint8_t *msg;
    const int64_t *dst, *numel, *esize, *cols, *rstride;
    int64_t n, ce;
    int op;
} unpack_args;
typedef struct {
    const unpack_args *u;
    int64_t i0, a0, c0, c1, r;
    queue_t q; /* its staged chunks (not a check's) */
} part_t;

/* One part's chunks, in order */
static void *unpack_part(void *arg) {
    part_t *pt = (part_t *)arg;
    const unpack_args *u = pt->u;
    queue_t *q = u->op == TRD_CHECK ? NULL : &pt->q;
    pt->r = -1;
    int64_t c = pt->c0;
    for (int64_t i = pt->i0; i < u->n && c < pt->c1; i++) {
        int e = (int)u->esize[i];
        view_t vw = {(uint8_t *)(intptr_t)u->dst[i], u->cols ? u->cols[i] : 1, u->cols ? u->rstride[i] : 1};
        for (int64_t a = i == pt->i0 ? pt->a0 : 0; a < u->numel[i] && c < pt->c1; a += u->ce, c++) {
            int64_t off;
            uint32_t h[4];
            memcpy(&off, u->msg + 16 + 8 * c, 8);
            memcpy(h, u->msg + off, 16);
            int kind = (int)(h[0] & 0xFF);
            int64_t len = h[1], count = h[2], nbytes = h[3];
            if (kind == KIND_NARROW) {
                if (q ? narrow_chunk_e(u->msg + off, len, count, nbytes, e, &vw, a, q, u->op)
                       : trd_check_narrow(u->msg + off, len, count, nbytes, e)) {
                    pt->r = c;
                    goto done;
                }
            } else if (kind == KIND_DENSE) {
                if (u->op == TRD_APPLY || u->op == TRD_COMMIT) put_dense(&vw, a, len, e, u->msg + off + 16);
            } else if (!(kind == KIND_OFFSETS && count == 0)) {
                pt->r = -2;
                goto done;
            }
        }
    }
done:
    for (int s = 0; q && s < QUEUE; s++) /* (a chunk that disagrees staged none) */
        if (q->k[s]) apply_slot(q, s);
    return NULL;
}

static int trd_nthreads = 1; /* trd_codec_threads */

static inline int64_t chunk_bytes(const uint8_t *msg, int64_t off) {
    uint32_t nb;
    memcpy(&nb, msg + off + 12, 4);
    return nb;
}
#define SPLIT_BYTES (1 << 20) /* messages from this many bytes of chunks (headers and bodies) are split */

/* Cut the chunks in two of about equal message bytes (the work of a check and, at a few % changed, of an
 * apply: one line of the destination per change; a dense chunk's bytes are its copy's) plus a fixed cost
 * per chunk: p[1] starts at the cut (none: p[1].c0 == p[1].c1) */
static void split_parts(const unpack_args *u, part_t *p) {
    int64_t nc = 0, tot = 0, cut = 0;
    for (int64_t i = 0; i < u->n; i++) nc += (u->numel[i] + u->ce - 1) / u->ce;
    p[0] = (part_t){u, 0, 0, 0, nc, -1, {{{NULL, NULL}}, {0}, {NULL}, {0}, 0}};
    p[1] = (part_t){u, u->n, 0, nc, nc, -1, {{{NULL, NULL}}, {0}, {NULL}, {0}, 0}};
    for (int64_t c = 0; c < nc; c++) {
        int64_t off;
        memcpy(&off, u->msg + 16 + 8 * c, 8);
        tot += 256 + chunk_bytes(u->msg, off);
    }
    if (tot < SPLIT_BYTES || nc < 2) return;
    for (int64_t i = 0, c = 0; i < u->n; i++)
        for (int64_t a = 0; a < u->numel[i]; a += u->ce, c++) {
            int64_t off;
            memcpy(&off, u->msg + 16 + 8 * c, 8);
            cut += 256 + chunk_bytes(u->msg, off);
            if (2 * cut >= tot && c + 1 < nc) {  /* chunk c + 1 starts part 1 */
                int64_t a1 = a + u->ce, i1 = i;
                if (a1 >= u->numel[i]) a1 = 0, i1 = i + 1;
                while (i1 < u->n && !u->numel[i1]) i1++;
                p[0].c1 = p[1].c0 = c + 1, p[1].i0 = i1, p[1].a0 = a1;
                return;
            }
        }
}

/* Check (op TRD_CHECK: no write), apply (TRD_APPLY), commit or undo (TRD_COMMIT / TRD_UNDO: a message the
 * pack made with update 2, on the snapshot it packed against) a v2 message into n destination views: view i
 * is numel[i] elements of esize[i] bytes at dst[i], in rows of cols[i] elements rstride[i] elements apart
 * (cols == NULL: every view contiguous). Headers and directory were checked by the caller; an apply only
 * after a check of the same bytes returned -1 (it leaves out the checks of positions that check made).
 * Returns -1 when done, the index of the first chunk whose body disagrees with its header, -2 when the
 * message holds a chunk kind this codec does not write (the caller falls back), -3 when the per-chunk
 * scratch cannot be allocated (nothing written). With trd_codec_threads(2) a message of >= SPLIT_BYTES runs
 * as two parts of its chunks, the second on a thread of its own (the views' chunks are disjoint: so are the
 * writes); the result is the same: the event of the lowest chunk. Why: at a few % changed the apply waits
 * on the memory (one scattered line per change) and one core keeps too few lines in flight to use it; the
 * check is compute bound. */
EXPORT int64_t trd_unpack_rows(const uint8_t *msg, int64_t n, const int64_t *dst, const int64_t *numel,
                               const int64_t *esize, const int64_t *cols, const int64_t *rstride, int64_t ce,
                               int op) {
    if (!trd_block_mask) trd_choose();
    unpack_args u = {msg, dst, numel, esize, cols, rstride, n, ce, op};
    part_t p[2];
    if (trd_nthreads > 1) {
        split_parts(&u, p);
    } else {
        p[0] = (part_t){&u, 0, 0, 0, INT64_MAX, -1, {{{NULL, NULL}}, {0}, {NULL}, {0}, 0}};
        p[1] = (part_t){&u, n, 0, 0, 0, -1, {{{NULL, NULL}}, {0}, {NULL}, {0}, 0}};
    }
    int nparts = p[1].c0 < p[1].c1 ? 2 : 1, bad = 0;
    for (int k = 0; k < nparts && op != TRD_CHECK; k++) { /* every part's scratch before the first write */
        size_t slot = (size_t)ce + 8; /* 8 of slack: csrc/delta_stage.c */
        int64_t *m = (int64_t *)malloc(2 * sizeof(int64_t) * slot * QUEUE);
        for (int s = 0; s < QUEUE; s++)
            p[k].q.ch[s] = (changes){m ? m + 2 * slot * s : NULL, m ? (uint64_t *)(m + 2 * slot * s + slot) : NULL};
        bad |= !m;
    }
    if (!bad) {
        pthread_t th;
        int two = nparts == 2 && !pthread_create(&th, NULL, unpack_part, &p[1]);
        unpack_part(&p[0]);
        if (two) pthread_join(th, NULL);
        else if (nparts == 2) unpack_part(&p[1]); /* (no thread: in turn) */
    }
    for (int k = 0; k < nparts; k++) free(p[k].q.ch[0].pos);
    return bad ? -3 : p[0].r != -1 ? p[0].r : p[1].r;
}

/* trd_codec_threads(n): run trd_unpack_rows on up to n (1 or 2) threads in this process; returns the
 * previous setting (n < 1: only returns it) */
EXPORT int trd_codec_threads(int n) {
    int prev = trd_nthreads;
    if (n >= 1) trd_nthreads = n > 2 ? 2 : n;
    return prev;
}

/* trd_unpack_rows into contiguous views: check (check == 1) or apply */
EXPORT int64_t trd_unpack(const uint8_t *msg, int64_t n, const int64_t *dst, const int64_t *numel,
                          const int64_t *esize, int64_t ce, int check) {
    return trd_unpack_rows(msg, n, dst, numel, esize, NULL, NULL, ce, check ? TRD_CHECK : TRD_APPLY);
}

/* The directory of a v2 message of `length` bytes against n destinations (numel, esize: the live ones, in
 * order), every check of ops/delta_cpu.py read_directory_np for version 2: header, chunk count, each chunk's
 * offset, kind, element size, length, count and byte size. Returns 0 when it agrees; 1 otherwise (the caller
 * then runs the numpy reader, which raises the error naming the chunk). */
EXPORT int trd_directory(const uint8_t *msg, int64_t length, int64_t n, const int64_t *numel,
                         const int64_t *esize) {
    uint32_t h[4];
    if (length < 16 || length % 16) return 1;
    memcpy(h, msg, 16);
    int64_t ce = h[3];
    if (h[0] != MAGIC || h[1] != VERSION2 || ce < 1 || ce > 65536) return 1;
    int64_t nc = 0;
    for (int64_t i = 0; i < n; i++) nc += (numel[i] + ce - 1) / ce;
    if ((int64_t)h[2] != nc) return 1;
    int64_t start = 16 + pad16(8 * nc), c = 0;
    if (nc && length < start) return 1;
    for (int64_t i = 0; i < n; i++) {
        int64_t e = esize[i];
        for (int64_t a = 0; a < numel[i]; a += ce, c++) {
            int64_t len = numel[i] - a < ce ? numel[i] - a : ce, off;
            uint32_t w[4];
            memcpy(&off, msg + 16 + 8 * c, 8);
            if (off < start || off % 16 || off > length - 16) return 1;
            memcpy(w, msg + off, 16);
            int64_t kind = w[0] & 0xFF, es = w[0] >> 8, nel = w[1], count = w[2], nbytes = w[3], want;
            if (kind > KIND_NARROW || es != e || nel != len || count > len) return 1;
            if (kind == KIND_NARROW) {
                int64_t lo = 16 + 2 * ((len + BLOCK - 1) / BLOCK), hi = 16 + pad16(len * e);
                want = (nbytes % 16 == 0 && nbytes >= lo && nbytes < hi) ? nbytes : -1;
            } else if (kind == KIND_DENSE) {
                want = 16 + pad16(len * e);
            } else {
                int64_t values = pad16(count * e);
                want = 16 + (kind == 1 ? pad16(4 * ((len + 31) / 32)) : pad16(2 * count)) + values;
            }
            if (nbytes != want || off + nbytes > length) return 1;
        }
    }
    return 0;
}
