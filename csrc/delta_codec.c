/* The delta codec of format v2 in one pass (issue 44; the format: triton_reshard/ops/delta_v2.py): the pack
 * here, the block compares and the run-time SIMD choice in csrc/delta_simd.c, the check of the narrow bodies in
 * csrc/delta_check.c, the apply and the directory in csrc/delta_apply.c, what they share in csrc/delta_codec.h.
 *
 * pack:   per 256-element block, compare source and snapshot (SIMD where the CPU has it), then per changed
 *         element only: its difference, the block's width, the positions and the bit-packed values, and the
 *         snapshot update, while the block is in L1. The same bytes as the numpy reference.
 * unpack: a check pass over the message's narrow bodies (no write), then the apply pass.
 *
 * Built by setuptools as the extension module triton_reshard._delta_codec (optional: without a compiler the
 * numpy reference runs); Python calls the exported functions through ctypes (ops/delta_native.py). Plain C99;
 * the only machine-specific code is the block compare and the 16-bit block paths, behind one guard (x86-64
 * GCC/Clang: AVX-512BW or AVX2 chosen at run time, else portable C).
 *
 * The flags of a pack (update): NO_PATCH (4) writes no patched block (ops/delta_patch.py: the bytes of the
 * Triton pack, which writes none); the snapshot update in the low two bits: 0 none; 1 every change, in the pass; 2 the narrow blocks' changes
 * in the pass, not the raw blocks' nor the dense chunks' (the message holds their new values, not the
 * difference): a pack made before it is known whether the message will be used (a delta refit diffs during
 * its handshake) leaves a snapshot that trd_unpack_rows' TRD_COMMIT completes, or TRD_UNDO restores (the
 * narrow differences subtracted), both reading only the message and the blocks it names.
 */
#include <Python.h>
#include "delta_codec.h"
/* ---- values: a little-endian bit stream of w-bit values ----------------------------------------------- */

#define PUT_VALUES(NAME, T)                                                                                     \
    static inline uint8_t *NAME(uint8_t *p, const T *v, int n, int w) {                                         \
        int j = 0;                                                                                              \
        if (w == 2) {                                                                                           \
            for (; j + 4 <= n; j += 4)                                                                          \
                *p++ = (uint8_t)((v[j] & 3) | (v[j + 1] & 3) << 2 | (v[j + 2] & 3) << 4 | (v[j + 3] & 3) << 6); \
        } else if (w == 4) {                                                                                    \
            for (; j + 2 <= n; j += 2) *p++ = (uint8_t)((v[j] & 15) | (v[j + 1] & 15) << 4);                    \
        } else {                                                                                                \
            for (; j < n; j++)                                                                                  \
                for (int k = 0; k < w / 8; k++) *p++ = (uint8_t)(v[j] >> (8 * k));                              \
            return p;                                                                                           \
        }                                                                                                       \
        if (j < n) {                                                                                            \
            uint64_t acc = 0;                                                                                   \
            for (int t = 0; j < n; j++, t += w) acc |= ((uint64_t)v[j] & ((1u << w) - 1)) << t;                 \
            *p++ = (uint8_t)acc;                                                                                \
        }                                                                                                       \
        return p;                                                                                               \
    }

PUT_VALUES(put_values, uint64_t)
PUT_VALUES(put_values16, uint16_t) /* a 16-bit block's differences (two's complement bits) */

/* ---- pack ------------------------------------------------------------------------------------------ */

#define NO_PATCH 4 /* a pack's flag: no patched blocks */

/* The layout of a changed block (the twin of ops/delta_patch.py choose_layout): the smallest of the unpatched
 * modes at the block's code, then of the patched ones (base code c below it with 1..MAX_EXC exceptions);
 * a later candidate only when strictly smaller. val: the cnt differences (sign-extended). */
typedef struct { int code, pm, nexc; int64_t size; } layout_t;

INLINE layout_t choose_layout(const uint64_t *val, int cnt, int blen, int e, int code, int maxexc) {
    int w = width_of(code, e);
    int64_t vb = vbytes(cnt, w), off = cnt + vb, bm = (blen + 7) / 8 + vb, al = vbytes(blen, w);
    layout_t L = {code, (off <= bm && off <= al) ? MODE_OFFSETS : (bm <= al ? MODE_BITMASK : MODE_ALL), 0, 0};
    L.size = L.pm == MODE_OFFSETS ? off : L.pm == MODE_BITMASK ? bm : al;
    if (code < 2 || !maxexc) return L;
    int o[6] = {0, 0, 0, 0, 0, 0};  /* o[c]: elements wider than code c's width (branch-free counts) */
    for (int j = 0; j < cnt; j++) {
        uint64_t a = val[j] ^ (uint64_t)((int64_t)val[j] >> 63);
        o[1] += a >= 2, o[2] += a >= 8, o[3] += a >= 128, o[4] += a >= 32768, o[5] += a >= (1ull << 31);
    }
    for (int c = 1; c < 6 && (1 << c) < 8 * e; c++) {
        int over = o[c];
        if (over < 1 || over > maxexc) continue;
        int64_t vc = vbytes(cnt, 1 << c), exc = (int64_t)over * (1 + e);
        int64_t sz[3] = {cnt + vc + exc, (blen + 7) / 8 + vc + exc, vbytes(blen, 1 << c) + exc};
        for (int pm = 0; pm < 3; pm++)
            if (sz[pm] < L.size) { L.code = c; L.pm = pm; L.nexc = over; L.size = sz[pm]; }
    }
    return L;
}

/* The descriptor and payload of a changed block (s: its source elements, m: its change mask, idx / val: the
 * cnt changed elements' indices and differences, code: its width code); returns the payload bytes. */
INLINE int64_t write_block(const uint8_t *s, int blen, int e, const uint64_t m[4], const uint8_t *idx,
                           uint64_t *val, int cnt, int code, uint8_t *desc, uint8_t *pay, int update) {
    layout_t L = choose_layout(val, cnt, blen, e, code, update & NO_PATCH ? 0 : MAX_EXC);
    int w = width_of(L.code, e), mode = L.pm, nexc = 0;
    uint8_t xs[MAX_EXC];
    uint64_t xv[MAX_EXC];
    if (L.code == RAW)
        for (int j = 0; j < cnt; j++) val[j] = load(s, idx[j], e);
    if (L.nexc) {  /* the exceptions: slot and full-width difference; their base value 0 */
        uint64_t lim = (uint64_t)1 << (w - 1);
        for (int j = 0; j < cnt; j++)
            if ((val[j] ^ (uint64_t)((int64_t)val[j] >> 63)) >= lim) {
                xs[nexc] = (uint8_t)(mode == MODE_ALL ? idx[j] : j);
                xv[nexc++] = val[j];
                val[j] = 0;
            }
    }
    desc[0] = (uint8_t)(L.code | ((L.nexc ? FIRST_PATCHED + MAX_EXC * mode + L.nexc - 1 : mode) << 4));
    desc[1] = (uint8_t)(cnt - 1);
    uint8_t *p = pay;
    if (mode == MODE_OFFSETS) {
        for (int j = 0; j < cnt; j += 16) memcpy(p + j, idx + j, 16);  /* fixed size: no rep movs; the
                                                                        bytes past cnt are overwritten next */
        p = put_values(p + cnt, val, cnt, w);
    } else if (mode == MODE_BITMASK) {
        for (int k = 0; k < (blen + 7) / 8; k++) *p++ = (uint8_t)(m[k >> 3] >> (8 * (k & 7)));
        p = put_values(p, val, cnt, w);
    } else {
        uint64_t full[BLOCK];
        if (L.code == RAW)
            for (int i = 0; i < blen; i++) full[i] = load(s, i, e);
        else
            memset(full, 0, sizeof(uint64_t) * (size_t)blen);
        for (int j = 0; j < cnt; j++) full[idx[j]] = val[j];
        p = put_values(p, full, blen, w);
    }
    if (nexc) {
        memcpy(p, xs, (size_t)nexc);
        p += nexc;
        for (int k = 0; k < nexc; k++, p += e) store(p, 0, e, xv[k]);
    }
    return p - pay;
}

/* One block: writes descriptor and payload, updates the snapshot; returns the payload bytes. */
INLINE int64_t pack_block(const uint8_t *s, uint8_t *q, int blen, int e, const uint64_t m[4], int cnt,
                          uint8_t *desc, uint8_t *pay, int update) {
    uint8_t idx[BLOCK + 16];
    uint64_t val[BLOCK];
    uint64_t orv = 0;
    int c = 0;
    for (int w = 0; w < 4; w++)
        for (uint64_t x = m[w]; x; x &= x - 1) idx[c++] = (uint8_t)(w * 64 + __builtin_ctzll(x));
    for (int j = 0; j < cnt; j++) {
        int64_t d = sext(load(s, idx[j], e) - load(q, idx[j], e), e);
        orv |= (uint64_t)(d ^ (d >> 63));
        val[j] = (uint64_t)d;
    }
    int64_t n = write_block(s, blen, e, m, idx, val, cnt, code_of(orv, e), desc, pay, update);
    if ((update & 3) == 1 || ((update & 3) == 2 && (desc[0] & 0x0F) != RAW)) {  /* the snapshot update (update 2: the
                                                                       blocks of differences only) */
        if (cnt * 16 >= blen)  /* every line of the block written anyway: one copy */
            memcpy(q, s, (size_t)blen * (size_t)e);
        else
            for (int j = 0; j < cnt; j++) store(q, idx[j], e, load(s, idx[j], e));
    }
    return n;
}

#ifdef HAVE_X86
/* put_values16 of n narrow values (w: 2, 4 or 8 bits) on AVX-512, the same bytes: 32 values per step, their low
 * bytes (vpmovwb) merged 2 or 4 to a byte by multiply-adds; the lanes past n loaded as 0 (the last byte's
 * unused bits 0). Writes up to 31 bytes past the values (the pack's output has the slack; they are overwritten
 * next). (The scalar loop of 4 values per byte was ~15 % of a 10 % pack.) */
__attribute__((target("avx512f,avx512bw,avx512vl"))) static inline uint8_t *
put_narrow16(uint8_t *p, const uint16_t *v, int n, int w) {
    for (int j = 0; j < n; j += 32) {
        __mmask32 k = n - j >= 32 ? ~(__mmask32)0 : ((__mmask32)1 << (n - j)) - 1;
        __m256i b = _mm512_cvtepi16_epi8(_mm512_maskz_loadu_epi16(k, v + j));
        if (w == 8) {
            _mm256_storeu_si256((__m256i *)(void *)(p + j), b);
        } else if (w == 4) { /* bytes (lo, hi) -> lo + 16 hi */
            __m256i h = _mm256_maddubs_epi16(_mm256_and_si256(b, _mm256_set1_epi8(15)), _mm256_set1_epi16(0x1001));
            _mm_storeu_si128((__m128i *)(void *)(p + j / 2), _mm256_cvtepi16_epi8(h));
        } else { /* bytes (a, b, c, d) -> (a + 4 b) + 16 (c + 4 d) */
            __m256i h = _mm256_maddubs_epi16(_mm256_and_si256(b, _mm256_set1_epi8(3)), _mm256_set1_epi16(0x0401));
            __m256i q = _mm256_madd_epi16(h, _mm256_set1_epi32(0x00100001));
            _mm_storel_epi64((__m128i *)(void *)(p + j / 4), _mm256_cvtepi32_epi8(q));
        }
    }
    return p + vbytes(n, w);
}

/* pack_block for a whole block of 16-bit elements (AVX-512 VBMI2): per 32-element group with a change, one
 * vector difference, its changed lanes compressed into the values and their indices into the offsets, the
 * group's line of the snapshot rewritten from the source (its unchanged elements are equal); the same bytes. */
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vbmi2,popcnt"))) static int64_t
pack_block16(const uint8_t *s, uint8_t *q, const uint64_t m[4], int cnt, uint8_t *desc, uint8_t *pay, int update) {
    uint16_t val[BLOCK + 32];
    uint8_t idx[BLOCK + 32];
    __m512i orv = _mm512_setzero_si512();
    __m256i iota = _mm256_setr_epi8(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21,
                                    22, 23, 24, 25, 26, 27, 28, 29, 30, 31);
    int c = 0;
    for (int l = 0; l < BLOCK / 32; l++) {
        uint32_t bits = (uint32_t)(m[l >> 1] >> (32 * (l & 1)));
        if (!bits) continue;
        __m512i a = _mm512_loadu_si512((const void *)(s + 64 * l));
        __m512i d = _mm512_sub_epi16(a, _mm512_loadu_si512((const void *)(q + 64 * l)));
        orv = _mm512_or_si512(orv, _mm512_xor_si512(d, _mm512_srai_epi16(d, 15)));
        /* compressed in a register, then one plain store (val, idx have 32 lanes of slack): a compress
           straight to memory is microcoded on AMD Zen 4 (~80 ns each, measured: 3x the whole pack at 1 %) */
        _mm512_storeu_si512((void *)(val + c), _mm512_maskz_compress_epi16(bits, d));
        _mm256_storeu_si256((__m256i *)(void *)(idx + c),
                            _mm256_maskz_compress_epi8(bits, _mm256_add_epi8(iota, _mm256_set1_epi8((char)(32 * l)))));
        if ((update & 3) == 1) _mm512_storeu_si512((void *)(q + 64 * l), a);
        c += __builtin_popcount(bits);
    }
    uint32_t o32 = (uint32_t)_mm512_reduce_or_epi32(orv); /* (a loop over the 32 lanes: ~20 % of this function) */
    int code = code_of((o32 | o32 >> 16) & 0xFFFFu, 2), w = width_of(code, 2);
    if (code >= 2) {  /* a block that may patch: the generic writer (the same bytes) */
        uint64_t v64[BLOCK];
        for (int j = 0; j < cnt; j++) v64[j] = (uint64_t)(int64_t)(int16_t)val[j];
        int64_t n = write_block(s, BLOCK, 2, m, idx, v64, cnt, code, desc, pay, update);
        code = desc[0] & 0x0F;
        if ((update & 3) == 2 && code != RAW)
            for (int l = 0; l < BLOCK / 32; l++)
                if ((uint32_t)(m[l >> 1] >> (32 * (l & 1))))
                    _mm512_storeu_si512((void *)(q + 64 * l), _mm512_loadu_si512((const void *)(s + 64 * l)));
        return n;
    }
    if ((update & 3) == 2 && code != RAW)  /* narrow blocks only: the changed groups' lines, still in L1 */
        for (int l = 0; l < BLOCK / 32; l++)
            if ((uint32_t)(m[l >> 1] >> (32 * (l & 1))))
                _mm512_storeu_si512((void *)(q + 64 * l), _mm512_loadu_si512((const void *)(s + 64 * l)));
    if (code == RAW)
        for (int j = 0; j < cnt; j++) val[j] = (uint16_t)load(s, idx[j], 2);
    int mode = choose_layout(NULL, cnt, BLOCK, 2, code, 0).pm;  /* unpatched: val is not read */
    desc[0] = (uint8_t)(code | (mode << 4));
    desc[1] = (uint8_t)(cnt - 1);
    uint8_t *p = pay;
    if (mode == MODE_OFFSETS) {
        for (int j = 0; j < cnt; j += 32) /* fixed size (idx has the slack; the bytes past cnt are overwritten next) */
            _mm256_storeu_si256((__m256i *)(void *)(p + j), _mm256_loadu_si256((const __m256i *)(const void *)(idx + j)));
        p = code == RAW ? put_values16(p + cnt, val, cnt, w) : put_narrow16(p + cnt, val, cnt, w);
    } else if (mode == MODE_BITMASK) {
        memcpy(p, m, BLOCK / 8);  /* little-endian: element 8 j + k is bit k of byte j */
        p = code == RAW ? put_values16(p + BLOCK / 8, val, cnt, w) : put_narrow16(p + BLOCK / 8, val, cnt, w);
    } else {
        uint16_t full[BLOCK];
        if (code == RAW)
            memcpy(full, s, sizeof full);
        else
            memset(full, 0, sizeof full);
        for (int j = 0; j < cnt; j++) full[idx[j]] = val[j];
        p = put_values16(p, full, BLOCK, w);
    }
    return p - pay;
}
#endif

/* The rest of a whole 16-bit block's pack after its vector pass (the AVX2 path): val the cnt differences, o
 * the OR of their magnitudes; as pack_block16's end (the same bytes as the generic writer). The indices from
 * m here, byte by byte where they go (written to memory in the vector pass and read back as a run, they wait
 * on the store buffer). */
INLINE int64_t finish_block16(const uint8_t *s, uint8_t *q, const uint64_t m[4], int cnt, const uint16_t *val,
                              uint64_t o, uint8_t *desc, uint8_t *pay, int update) {
    int code = code_of(o, 2), w = width_of(code, 2);
    if (code >= 2) {  /* a block that may patch: the generic writer (the same bytes) */
        uint64_t v64[BLOCK];
        uint8_t idx[BLOCK + 16];
        for (int k = 0, c = 0; k < 4; k++)
            for (uint64_t x = m[k]; x; x &= x - 1) idx[c++] = (uint8_t)(64 * k + __builtin_ctzll(x));
        for (int j = 0; j < cnt; j++) v64[j] = (uint64_t)(int64_t)(int16_t)val[j];
        int64_t n = write_block(s, BLOCK, 2, m, idx, v64, cnt, code, desc, pay, update);
        code = desc[0] & 0x0F;
        if ((update & 3) == 2 && code != RAW)
            for (int l = 0; l < BLOCK / 32; l++)
                if ((uint32_t)(m[l >> 1] >> (32 * (l & 1)))) memcpy(q + 64 * l, s + 64 * l, 64);
        return n;
    }
    if ((update & 3) == 2)  /* narrow blocks only (code < 2 is narrow): the changed groups' lines, still in L1 */
        for (int l = 0; l < BLOCK / 32; l++)
            if ((uint32_t)(m[l >> 1] >> (32 * (l & 1)))) memcpy(q + 64 * l, s + 64 * l, 64);
    int mode = choose_layout(NULL, cnt, BLOCK, 2, code, 0).pm;  /* unpatched: val is not read */
    desc[0] = (uint8_t)(code | (mode << 4));
    desc[1] = (uint8_t)(cnt - 1);
    uint8_t *p = pay;
    if (mode == MODE_OFFSETS) {
        for (int k = 0; k < 4; k++)
            for (uint64_t x = m[k]; x; x &= x - 1) *p++ = (uint8_t)(64 * k + __builtin_ctzll(x));
        p = put_values16(p, val, cnt, w);
    } else if (mode == MODE_BITMASK) {
        memcpy(p, m, BLOCK / 8);  /* little-endian: element 8 j + k is bit k of byte j */
        p = put_values16(p + BLOCK / 8, val, cnt, w);
    } else {
        uint16_t full[BLOCK];
        memset(full, 0, sizeof full);
        for (int k = 0, j = 0; k < 4; k++)
            for (uint64_t x = m[k]; x; x &= x - 1) full[64 * k + __builtin_ctzll(x)] = val[j++];
        p = put_values16(p, full, BLOCK, w);
    }
    return p - pay;
}

#ifdef HAVE_X86
/* pack_block for a whole block of 16-bit elements (AVX2): per 16-element group with a change, one vector
 * difference, the changed lanes of each 8-lane half left-packed into the values by a pshufb (trd_lp16), the
 * group's line of the snapshot rewritten from the source (update 1); the same bytes. */
__attribute__((target("avx2,popcnt"))) static int64_t
pack_block16_avx2(const uint8_t *s, uint8_t *q, const uint64_t m[4], int cnt, uint8_t *desc, uint8_t *pay,
                  int update) {
    uint16_t val[BLOCK + 16];
    __m256i orv = _mm256_setzero_si256();
    int c = 0;
    for (int l = 0; l < BLOCK / 16; l++) {
        unsigned bits = (unsigned)(m[l >> 2] >> (16 * (l & 3))) & 0xFFFFu, lo = bits & 0xFFu, hi = bits >> 8;
        if (!bits) continue;
        __m256i a = _mm256_loadu_si256((const __m256i *)(const void *)(s + 32 * l));
        __m256i d = _mm256_sub_epi16(a, _mm256_loadu_si256((const __m256i *)(const void *)(q + 32 * l)));
        orv = _mm256_or_si256(orv, _mm256_xor_si256(d, _mm256_srai_epi16(d, 15)));
        /* 8 lanes (16 bytes) stored whole each time: val has the slack */
        __m128i pl = _mm_loadu_si128((const __m128i *)(const void *)trd_lp16[lo]);
        __m128i ph = _mm_loadu_si128((const __m128i *)(const void *)trd_lp16[hi]);
        _mm_storeu_si128((__m128i *)(void *)(val + c), _mm_shuffle_epi8(_mm256_castsi256_si128(d), pl));
        c += __builtin_popcount(lo);
        _mm_storeu_si128((__m128i *)(void *)(val + c), _mm_shuffle_epi8(_mm256_extracti128_si256(d, 1), ph));
        c += __builtin_popcount(hi);
        if ((update & 3) == 1) _mm256_storeu_si256((__m256i *)(void *)(q + 32 * l), a);
    }
    __m128i o8 = _mm_or_si128(_mm256_castsi256_si128(orv), _mm256_extracti128_si256(orv, 1));
    o8 = _mm_or_si128(o8, _mm_srli_si128(o8, 8));
    o8 = _mm_or_si128(o8, _mm_srli_si128(o8, 4));
    o8 = _mm_or_si128(o8, _mm_srli_si128(o8, 2));
    return finish_block16(s, q, m, cnt, val, (uint64_t)(uint16_t)_mm_extract_epi16(o8, 0), desc, pay, update);
}
#endif


/* Update 2 of a chunk that went dense after its blocks 0 .. last were packed: subtract their narrow differences
 * from the snapshot again (the raw blocks were not written). Rare: only a chunk whose changes are dense. */
static void undo_blocks(const uint8_t *desc, const uint8_t *p, int64_t last, int64_t len, int e, uint8_t *q) {
    for (int64_t b = 0; b <= last; b++) {
        int code = desc[2 * b] & 0x0F, mode = pos_mode(desc[2 * b] >> 4), cnt = desc[2 * b + 1] + 1;
        int nexc = exceptions_of(desc[2 * b] >> 4);
        int blen = (int)(len - b * BLOCK < BLOCK ? len - b * BLOCK : BLOCK);
        if (code == 0) continue;
        int w = width_of(code, e), nv = mode == MODE_ALL ? blen : cnt;
        uint8_t idx[BLOCK];
        uint64_t v[BLOCK];
        const uint8_t *vp = p;
        if (mode == MODE_OFFSETS) {
            memcpy(idx, p, (size_t)cnt);
            vp = p + cnt;
        } else if (mode == MODE_BITMASK) {
            int c = 0;
            for (int k = 0; k < (blen + 7) / 8; k++)
                for (unsigned x = p[k]; x; x &= x - 1) idx[c++] = (uint8_t)(8 * k + __builtin_ctz(x));
            vp = p + (blen + 7) / 8;
        } else {
            for (int j = 0; j < blen; j++) idx[j] = (uint8_t)j;
        }
        p = get_values(vp, v, nv, w);
        for (int j = 0; j < nv; j++) v[j] = (uint64_t)((int64_t)(v[j] << (64 - w)) >> (64 - w));
        patch_values(p, nexc, e, v);
        p += nexc * (1 + e);
        if (code == RAW) continue;
        uint8_t *qb = q + b * BLOCK * e;
        for (int j = 0; j < nv; j++) store(qb, idx[j], e, load(qb, idx[j], e) - v[j]);
    }
}

/* One chunk of len elements at out: its header and body; returns its bytes. */
INLINE int64_t pack_chunk(const uint8_t *s, uint8_t *q, int64_t len, int e, uint8_t *out, int update) {
    int64_t nbk = (len + BLOCK - 1) / BLOCK, dense = 16 + pad16(len * e);
    uint8_t *desc = out + 16, *pay = desc + 2 * nbk;
    int64_t count = 0, at = 16 + 2 * nbk;
    int64_t b = 0;
    uint64_t m[4];
    for (; b < nbk; b++) {
        int blen = (int)(len - b * BLOCK < BLOCK ? len - b * BLOCK : BLOCK);
        const uint8_t *sb = s + b * BLOCK * e;
        uint8_t *qb = q + b * BLOCK * e;
        int cnt = trd_block_mask(sb, qb, blen, e, m);
        if (!cnt) { desc[2 * b] = desc[2 * b + 1] = 0; continue; }
        count += cnt;
#ifdef HAVE_X86
        if (e == 2 && blen == BLOCK && trd_fast16 == FAST16_AVX512)
            at += pack_block16(sb, qb, m, cnt, desc + 2 * b, out + at, update);
        else if (e == 2 && blen == BLOCK && trd_fast16 == FAST16_AVX2 && cnt > BLOCK / 8)  /* sparser: the
            scalar pack is as fast (measured: 16-element groups holding one or two changes each) */
            at += pack_block16_avx2(sb, qb, m, cnt, desc + 2 * b, out + at, update);
        else
#endif
            at += pack_block(sb, qb, blen, e, m, cnt, desc + 2 * b, out + at, update);
        if (pad16(at) >= dense) break;  /* the narrow chunk is not smaller: dense */
    }
    uint32_t h[4];
    if (b < nbk) {
        int64_t broke = b;  /* blocks 0 .. broke were packed (and, update 2, their narrow changes written) */
        for (b++; b < nbk; b++) {
            int blen = (int)(len - b * BLOCK < BLOCK ? len - b * BLOCK : BLOCK);
            count += trd_block_mask(s + b * BLOCK * e, q + b * BLOCK * e, blen, e, m);
        }
        if ((update & 3) == 2)  /* the chunk goes dense: its blocks' updates undone (the dense body holds no difference) */
            undo_blocks(desc, pay, broke, len, e, q);
        memcpy(out + 16, s, (size_t)(len * e));
        memset(out + 16 + len * e, 0, (size_t)(dense - 16 - len * e));
        if ((update & 3) == 1) memcpy(q, s, (size_t)(len * e));
        h[0] = KIND_DENSE | (uint32_t)e << 8; h[1] = (uint32_t)len; h[2] = (uint32_t)count; h[3] = (uint32_t)dense;
        memcpy(out, h, 16);
        return dense;
    }
    if (!count) {
        h[0] = KIND_OFFSETS | (uint32_t)e << 8; h[1] = (uint32_t)len; h[2] = 0; h[3] = 16;
        memcpy(out, h, 16);
        return 16;
    }
    int64_t nbytes = pad16(at);
    memset(out + at, 0, (size_t)(nbytes - at));
    h[0] = KIND_NARROW | (uint32_t)e << 8; h[1] = (uint32_t)len; h[2] = (uint32_t)count; h[3] = (uint32_t)nbytes;
    memcpy(out, h, 16);
    (void)pay;
    return nbytes;
}

/* pack_chunk / narrow_chunk compiled once per element size (e a constant: no switch per element) */
static int64_t pack_chunk_e(const uint8_t *s, uint8_t *q, int64_t len, int e, uint8_t *out, int update) {
    switch (e) {
    case 1: return pack_chunk(s, q, len, 1, out, update);
    case 2: return pack_chunk(s, q, len, 2, out, update);
    case 4: return pack_chunk(s, q, len, 4, out, update);
    default: return pack_chunk(s, q, len, 8, out, update);
    }
}

/* The whole message of n views (contiguous src/snap pointers, numels, element sizes) in chunks of ce elements.
 * out holds at least max_message_bytes + 4096 bytes. Returns the message length. */
EXPORT int64_t trd_pack(int64_t n, const int64_t *src, const int64_t *snap, const int64_t *numel,
                        const int64_t *esize, int64_t ce, uint8_t *out, int update) {
    if (!trd_block_mask) trd_choose();
    int64_t nc = 0;
    for (int64_t i = 0; i < n; i++) nc += (numel[i] + ce - 1) / ce;
    int64_t start = 16 + pad16(8 * nc), at = start, c = 0;
    uint32_t h[4] = {MAGIC, VERSION2, (uint32_t)nc, (uint32_t)ce};
    memcpy(out, h, 16);
    memset(out + 16, 0, (size_t)(start - 16));
    for (int64_t i = 0; i < n; i++) {
        int e = (int)esize[i];
        const uint8_t *s = (const uint8_t *)(intptr_t)src[i];
        uint8_t *q = (uint8_t *)(intptr_t)snap[i];
        for (int64_t a = 0; a < numel[i]; a += ce, c++) {
            int64_t len = numel[i] - a < ce ? numel[i] - a : ce;
            memcpy(out + 16 + 8 * c, &at, 8);
            at += pack_chunk_e(s + a * e, q + a * e, len, e, out + at, update);
        }
    }
    return at;
}

/* trd_pack for sources that may be row-strided: view i is rows of cols[i] elements, rstride[i] elements apart
 * (cols[i] == rstride[i]: contiguous); the snapshots are contiguous. A strided view's chunk is gathered into a
 * scratch buffer (ce elements: it stays in cache) and packed from there: no staging copy through memory.
 * Returns the message length, or -3 when the scratch cannot be allocated (nothing written). */
EXPORT int64_t trd_pack_rows(int64_t n, const int64_t *src, const int64_t *snap, const int64_t *numel,
                             const int64_t *esize, const int64_t *cols, const int64_t *rstride, int64_t ce,
                             uint8_t *out, int update) {
    if (!trd_block_mask) trd_choose();
    uint8_t *scratch = NULL;
    for (int64_t i = 0; i < n; i++)
        if (cols[i] != rstride[i] && !scratch && !(scratch = (uint8_t *)malloc((size_t)(8 * ce)))) return -3;
    int64_t nc = 0;
    for (int64_t i = 0; i < n; i++) nc += (numel[i] + ce - 1) / ce;
    int64_t start = 16 + pad16(8 * nc), at = start, c = 0;
    uint32_t h[4] = {MAGIC, VERSION2, (uint32_t)nc, (uint32_t)ce};
    memcpy(out, h, 16);
    memset(out + 16, 0, (size_t)(start - 16));
    for (int64_t i = 0; i < n; i++) {
        int e = (int)esize[i];
        int64_t w = cols[i], st = rstride[i];
        const uint8_t *s = (const uint8_t *)(intptr_t)src[i];
        uint8_t *q = (uint8_t *)(intptr_t)snap[i];
        for (int64_t a = 0; a < numel[i]; a += ce, c++) {
            int64_t len = numel[i] - a < ce ? numel[i] - a : ce;
            const uint8_t *sc = s + a * e;
            if (w != st) {  /* gather elements a .. a+len-1 of the row-strided view */
                int64_t k = 0, r = a / w, col = a % w;
                while (k < len) {
                    int64_t take = w - col < len - k ? w - col : len - k;
                    memcpy(scratch + k * e, s + (r * st + col) * e, (size_t)(take * e));
                    k += take;
                    r++;
                    col = 0;
                }
                sc = scratch;
            }
            memcpy(out + 16 + 8 * c, &at, 8);
            at += pack_chunk_e(sc, q + a * e, len, e, out + at, update);
        }
    }
    free(scratch);
    return at;
}

static struct PyModuleDef moddef = {PyModuleDef_HEAD_INIT, "_delta_codec",
                                    "The native delta codec (called through ctypes: ops/delta_native.py).", -1,
                                    NULL, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__delta_codec(void) { return PyModule_Create(&moddef); }
