/* The delta codec of format v2 in one pass (issue 44; the format: triton_reshard/ops/delta_v2.py).
 *
 * pack:   per 256-element block, compare source and snapshot (SIMD where the CPU has it), then per changed
 *         element only: its difference, the block's width, the positions and the bit-packed values, and the
 *         snapshot update, while the block is in L1. The same bytes as the numpy reference.
 * unpack: a check pass over the message's narrow bodies (no write), then the apply pass.
 *
 * Built by setuptools as the extension module triton_reshard._delta_codec (optional: without a compiler the
 * numpy reference runs); Python calls the exported functions through ctypes (ops/delta_native.py). Plain C99;
 * the only machine-specific code is the block compare, behind one guard (x86-64 GCC/Clang: AVX-512BW or
 * AVX2 chosen at run time, else portable C).
 */
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define BLOCK 256
#define KIND_DENSE 0
#define KIND_OFFSETS 2
#define KIND_NARROW 3
#define RAW 6
#define MODE_OFFSETS 0
#define MODE_BITMASK 1
#define MODE_ALL 2
#define MAGIC 0x544C4454u
#define VERSION2 2u

#if defined(_MSC_VER)
#define EXPORT __declspec(dllexport)
#else
#define EXPORT __attribute__((visibility("default")))
#endif

static inline int64_t pad16(int64_t n) { return (n + 15) & ~(int64_t)15; }

static inline uint64_t load(const uint8_t *p, int64_t i, int e) {
    switch (e) {
    case 1: return p[i];
    case 2: { uint16_t v; memcpy(&v, p + 2 * i, 2); return v; }
    case 4: { uint32_t v; memcpy(&v, p + 4 * i, 4); return v; }
    default: { uint64_t v; memcpy(&v, p + 8 * i, 8); return v; }
    }
}

static inline void store(uint8_t *p, int64_t i, int e, uint64_t v) {
    switch (e) {
    case 1: p[i] = (uint8_t)v; break;
    case 2: { uint16_t x = (uint16_t)v; memcpy(p + 2 * i, &x, 2); break; }
    case 4: { uint32_t x = (uint32_t)v; memcpy(p + 4 * i, &x, 4); break; }
    default: memcpy(p + 8 * i, &v, 8); break;
    }
}

/* ---- the block compare: bit i of m[] set iff element i of the block differs ------------------------- */

static void mask_portable(const uint8_t *s, const uint8_t *q, int n, int e, uint64_t m[4]) {
    m[0] = m[1] = m[2] = m[3] = 0;
    for (int i = 0; i < n; i++)
        m[i >> 6] |= (uint64_t)(memcmp(s + (int64_t)i * e, q + (int64_t)i * e, (size_t)e) != 0) << (i & 63);
}

static void mask_portable2(const uint8_t *s, const uint8_t *q, int n, int e, uint64_t m[4]) {
    if (e != 2) { mask_portable(s, q, n, e, m); return; }
    const uint16_t *a = (const uint16_t *)(const void *)s, *b = (const uint16_t *)(const void *)q;
    m[0] = m[1] = m[2] = m[3] = 0;
    for (int w = 0; w * 64 < n; w++) {
        uint64_t x = 0;
        int lim = n - w * 64 < 64 ? n - w * 64 : 64;
        for (int i = 0; i < lim; i++) x |= (uint64_t)(a[w * 64 + i] != b[w * 64 + i]) << i;
        m[w] = x;
    }
}

typedef void (*mask_fn)(const uint8_t *, const uint8_t *, int, int, uint64_t *);

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define HAVE_X86 1

__attribute__((target("avx512f,avx512bw"))) static void mask_avx512(const uint8_t *s, const uint8_t *q, int n,
                                                                     int e, uint64_t m[4]) {
    if (n != BLOCK) { mask_portable(s, q, n, e, m); return; }
    for (int w = 0; w < 4; w++) {  /* 64 elements per word */
        uint64_t x = 0;
        int per = 64 / e; /* elements per 64-byte vector */
        for (int k = 0; k < e; k++) {
            __m512i a = _mm512_loadu_si512((const void *)(s + (w * 64 + k * per) * e));
            __m512i b = _mm512_loadu_si512((const void *)(q + (w * 64 + k * per) * e));
            uint64_t part;
            switch (e) {
            case 1: part = _mm512_cmpneq_epi8_mask(a, b); break;
            case 2: part = _mm512_cmpneq_epi16_mask(a, b); break;
            case 4: part = _mm512_cmpneq_epi32_mask(a, b); break;
            default: part = _mm512_cmpneq_epi64_mask(a, b); break;
            }
            x |= part << (k * per);
        }
        m[w] = x;
    }
}

__attribute__((target("avx2,bmi2"))) static void mask_avx2(const uint8_t *s, const uint8_t *q, int n, int e,
                                                           uint64_t m[4]) {
    if (n != BLOCK || e != 2) { mask_portable2(s, q, n, e, m); return; }
    for (int w = 0; w < 4; w++) {
        uint64_t x = 0;
        for (int k = 0; k < 4; k++) { /* 16 bf16 per 32-byte vector */
            __m256i a = _mm256_loadu_si256((const __m256i *)(const void *)(s + (w * 64 + k * 16) * 2));
            __m256i b = _mm256_loadu_si256((const __m256i *)(const void *)(q + (w * 64 + k * 16) * 2));
            uint32_t eq = (uint32_t)_mm256_movemask_epi8(_mm256_cmpeq_epi16(a, b));
            x |= (uint64_t)(~_pext_u32(eq, 0x55555555u) & 0xFFFFu) << (k * 16);
        }
        m[w] = x;
    }
}

/* The w-bit differences (w = 2, 4, 8) of a 16-bit block, sign-extended */
static inline void decode16(const uint8_t *p, int16_t *v, int n, int w) {
    if (w == 2)
        for (int j = 0; j < n; j++) v[j] = (int16_t)((int8_t)(uint8_t)(p[j >> 2] << (6 - 2 * (j & 3))) >> 6);
    else if (w == 4)
        for (int j = 0; j < n; j++) v[j] = (int16_t)((int8_t)(uint8_t)(p[j >> 1] << (4 - 4 * (j & 1))) >> 4);
    else
        for (int j = 0; j < n; j++) v[j] = (int16_t)(int8_t)p[j];
}

/* Apply one narrow block of 16-bit elements at db (not raw): its positions (offsets, bitmask or all) as a mask
 * of 4 words, its n values decoded once, then per 32-element group with a change one load, an add of the values
 * expanded to their lanes (0 in the others), one store; a group past the block's end masked to its changed
 * lanes: no byte outside the destination is touched. */
__attribute__((target("avx512f,avx512bw,avx512vbmi2,popcnt"))) static void
add_block16(uint8_t *db, int blen, int mode, const uint8_t *pos, const uint8_t *p, int n, int w) {
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
#endif

static mask_fn block_mask = 0;
static int fast16 = 0; /* add_block16 usable (AVX-512 VBMI2) */

static void choose_mask(void) {
    block_mask = mask_portable2;
#ifdef HAVE_X86
    __builtin_cpu_init();
    fast16 = __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vbmi2");
    if (__builtin_cpu_supports("avx512bw")) block_mask = mask_avx512;
    else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("bmi2")) block_mask = mask_avx2;
#endif
}

EXPORT int trd_simd(void) {
    if (!block_mask) choose_mask();
#ifdef HAVE_X86
    if (block_mask == mask_avx512) return 512;
    if (block_mask == mask_avx2) return 256;
#endif
    return 0;
}

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

static inline const uint8_t *get_values(const uint8_t *p, uint64_t *v, int n, int w) {
    if (w == 2) {
        for (int j = 0; j < n; j++) v[j] = (p[j >> 2] >> (2 * (j & 3))) & 3;
        return p + (n + 3) / 4;
    }
    if (w == 4) {
        for (int j = 0; j < n; j++) v[j] = (p[j >> 1] >> (4 * (j & 1))) & 15;
        return p + (n + 1) / 2;
    }
    if (w == 8) {
        for (int j = 0; j < n; j++) v[j] = p[j];
        return p + n;
    }
    for (int j = 0; j < n; j++) {
        uint64_t x = 0;
        for (int k = 0; k < w / 8; k++) x |= (uint64_t)p[k] << (8 * k);
        v[j] = x;
        p += w / 8;
    }
    return p;
}

static inline int64_t vbytes(int64_t n, int w) { return (n * w + 7) / 8; }

static inline int width_of(int code, int e) { return code == RAW ? 8 * e : 1 << code; }

/* code of the narrowest width holding every m = d ^ (d >> 63) < orv's bound; RAW when it reaches the element */
static inline int code_of(uint64_t orv, int e) {
    int c = 1;
    while (c < 6 && orv >= ((uint64_t)1 << ((1 << c) - 1))) c++;
    return (1 << c) >= 8 * e ? RAW : c;
}

static inline int64_t sext(uint64_t v, int e) {
    int sh = 64 - 8 * e;
    return sh ? (int64_t)(v << sh) >> sh : (int64_t)v;
}

/* ---- pack ------------------------------------------------------------------------------------------ */

/* One block: writes descriptor and payload, updates the snapshot; returns the payload bytes. */
#define INLINE static inline __attribute__((always_inline))

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
    if (update && cnt * 16 >= blen)  /* every line of the block written anyway: one copy */
        memcpy(q, s, (size_t)blen * (size_t)e);
    else if (update)
        for (int j = 0; j < cnt; j++) store(q, idx[j], e, load(s, idx[j], e));
    int code = code_of(orv, e), w = width_of(code, e);
    if (code == RAW)
        for (int j = 0; j < cnt; j++) val[j] = load(s, idx[j], e);
    int64_t vb = vbytes(cnt, w), off = cnt + vb, bm = (blen + 7) / 8 + vb, al = vbytes(blen, w);
    int mode = (off <= bm && off <= al) ? MODE_OFFSETS : (bm <= al ? MODE_BITMASK : MODE_ALL);
    desc[0] = (uint8_t)(code | (mode << 4));
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
        if (code == RAW)
            for (int i = 0; i < blen; i++) full[i] = load(s, i, e);
        else
            memset(full, 0, sizeof(uint64_t) * (size_t)blen);
        for (int j = 0; j < cnt; j++) full[idx[j]] = val[j];
        p = put_values(p, full, blen, w);
    }
    return p - pay;
}

#ifdef HAVE_X86
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
        _mm512_mask_compressstoreu_epi16(val + c, bits, d);
        _mm256_mask_compressstoreu_epi8(idx + c, bits, _mm256_add_epi8(iota, _mm256_set1_epi8((char)(32 * l))));
        if (update) _mm512_storeu_si512((void *)(q + 64 * l), a);
        c += __builtin_popcount(bits);
    }
    uint16_t lanes[32];
    _mm512_storeu_si512((void *)lanes, orv);
    uint64_t o = 0;
    for (int k = 0; k < 32; k++) o |= lanes[k];
    int code = code_of(o, 2), w = width_of(code, 2);
    if (code == RAW)
        for (int j = 0; j < cnt; j++) val[j] = (uint16_t)load(s, idx[j], 2);
    int64_t vb = vbytes(cnt, w), off = cnt + vb, bm = BLOCK / 8 + vb, al = vbytes(BLOCK, w);
    int mode = (off <= bm && off <= al) ? MODE_OFFSETS : (bm <= al ? MODE_BITMASK : MODE_ALL);
    desc[0] = (uint8_t)(code | (mode << 4));
    desc[1] = (uint8_t)(cnt - 1);
    uint8_t *p = pay;
    if (mode == MODE_OFFSETS) {
        memcpy(p, idx, (size_t)cnt);
        p = put_values16(p + cnt, val, cnt, w);
    } else if (mode == MODE_BITMASK) {
        memcpy(p, m, BLOCK / 8);  /* little-endian: element 8 j + k is bit k of byte j */
        p = put_values16(p + BLOCK / 8, val, cnt, w);
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

static int count_block(const uint64_t m[4]) {
    return __builtin_popcountll(m[0]) + __builtin_popcountll(m[1]) + __builtin_popcountll(m[2]) +
           __builtin_popcountll(m[3]);
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
        block_mask(sb, qb, blen, e, m);
        int cnt = count_block(m);
        if (!cnt) { desc[2 * b] = desc[2 * b + 1] = 0; continue; }
        count += cnt;
#ifdef HAVE_X86
        if (e == 2 && blen == BLOCK && fast16)
            at += pack_block16(sb, qb, m, cnt, desc + 2 * b, out + at, update);
        else
#endif
            at += pack_block(sb, qb, blen, e, m, cnt, desc + 2 * b, out + at, update);
        if (pad16(at) >= dense) break;  /* the narrow chunk is not smaller: dense */
    }
    uint32_t h[4];
    if (b < nbk) {
        for (b++; b < nbk; b++) {
            int blen = (int)(len - b * BLOCK < BLOCK ? len - b * BLOCK : BLOCK);
            block_mask(s + b * BLOCK * e, q + b * BLOCK * e, blen, e, m);
            count += count_block(m);
        }
        memcpy(out + 16, s, (size_t)(len * e));
        memset(out + 16 + len * e, 0, (size_t)(dense - 16 - len * e));
        if (update) memcpy(q, s, (size_t)(len * e));
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
    if (!block_mask) choose_mask();
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
    if (!block_mask) choose_mask();
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

/* ---- unpack ---------------------------------------------------------------------------------------- */

/* The decoded changes of one chunk: element index (bit 31: a raw value) and value (raw bits or the
 * sign-extended difference); applied after the whole chunk is decoded. The destination's line of each change
 * is prefetched as it is decoded (the decode of a chunk takes about as long as the memory needs to bring its
 * lines: they are in cache by the apply) and again ahead of the apply (the writes are scattered: without
 * either the apply waits on each line in turn). */
typedef struct { uint32_t *pos; uint64_t *val; } changes;

#define PREFETCH 24
#define DIRECT_ABOVE 32 /* changed fraction above 1/32: apply as decoded */

INLINE void apply_changes(const changes *ch, int64_t k, uint8_t *d, int e) {
    for (int64_t j = 0; j < k; j++) {
        if (j + PREFETCH < k) __builtin_prefetch(d + (int64_t)(ch->pos[j + PREFETCH] & 0x7FFFFFFFu) * e, 1, 0);
        uint32_t pj = ch->pos[j];
        int64_t i = pj & 0x7FFFFFFFu;
        store(d, i, e, (pj >> 31) ? ch->val[j] : load(d, i, e) + ch->val[j]);
    }
}

/* Check (ch == NULL) or decode and apply one narrow chunk's body; returns 0 when it agrees with its header. */
INLINE int narrow_chunk(const uint8_t *in, int64_t len, int64_t count, int64_t nbytes, int e, uint8_t *d,
                        const changes *ch) {
    int64_t nbk = (len + BLOCK - 1) / BLOCK, at = 16 + 2 * nbk, total = 0, k = 0;
    const uint8_t *desc = in + 16;
    /* dense changes touch nearly every line of the destination (the hardware prefetcher streams it): apply
       as decoded; sparse ones: decode the chunk, then apply with the touched lines prefetched */
    int direct = ch && count * DIRECT_ABOVE > len;
    if (16 + 2 * nbk > nbytes) return 1;
    for (int64_t b = 0; b < nbk; b++) {
        int code = desc[2 * b] & 0x0F, mode = desc[2 * b] >> 4, cnt = desc[2 * b + 1] + 1;
        int blen = (int)(len - b * BLOCK < BLOCK ? len - b * BLOCK : BLOCK);
        if (code == 0) {
            if (desc[2 * b] || desc[2 * b + 1]) return 1;
            continue;
        }
        if (code > RAW || mode > MODE_ALL || cnt > blen || (code != RAW && (1 << code) >= 8 * e)) return 1;
        int w = width_of(code, e);
        int64_t vb = vbytes(cnt, w);
        int64_t size = mode == MODE_OFFSETS ? cnt + vb : mode == MODE_BITMASK ? (blen + 7) / 8 + vb : vbytes(blen, w);
        if (at + size > nbytes) return 1;
        const uint8_t *p = in + at;
        at += size;
        total += cnt;
        uint8_t idxb[BLOCK];
        const uint8_t *idx = idxb;
        int nv = cnt, vec = direct && e == 2 && code != RAW && fast16; /* add_block16 applies it */
        if (mode == MODE_OFFSETS) {
            unsigned bad = p[cnt - 1] >= blen;  /* ascending and the last inside: every one inside */
            if (!ch)  /* (the apply follows a check pass over the same bytes) */
                for (int j = 1; j < cnt; j++) bad |= p[j] <= p[j - 1];
            if (bad) return 1;
            idx = p;
            p += cnt;
        } else if (mode == MODE_BITMASK) {
            int c = 0;
            if (!ch) {
                for (int q = 0; q < (blen + 7) / 8; q++) c += __builtin_popcount(p[q]);
                if (c != cnt || ((blen & 7) && (p[blen / 8] >> (blen & 7)))) return 1;
            }
            if (ch && !vec) {
                c = 0;
                for (int q = 0; q < (blen + 7) / 8; q++)
                    for (unsigned x = p[q]; x; x &= x - 1) idxb[c++] = (uint8_t)(8 * q + __builtin_ctz(x));
            }
            p += (blen + 7) / 8;
        } else {
            nv = blen;
        }
        if (!ch) continue;
#ifdef HAVE_X86
        if (vec) {
            add_block16(d + b * BLOCK * 2, blen, mode, mode == MODE_BITMASK ? p - (blen + 7) / 8 : idx, p, nv, w);
            continue;
        }
#endif
        uint32_t base = (uint32_t)(b * BLOCK), rawbit = code == RAW ? 0x80000000u : 0;
        uint64_t v[BLOCK];
        get_values(p, v, nv, w);
        if (!rawbit) {
            int sh = 64 - w;
            for (int j = 0; j < nv; j++) v[j] = (uint64_t)((int64_t)(v[j] << sh) >> sh);
        }
        if (direct) {
            uint8_t *db = d + (int64_t)base * e;
            if (mode == MODE_ALL && rawbit)
                for (int j = 0; j < nv; j++) store(db, j, e, v[j]);
            else if (mode == MODE_ALL)
                for (int j = 0; j < nv; j++) store(db, j, e, load(db, j, e) + v[j]);
            else if (rawbit)
                for (int j = 0; j < nv; j++) store(db, idx[j], e, v[j]);
            else
                for (int j = 0; j < nv; j++) store(db, idx[j], e, load(db, idx[j], e) + v[j]);
        } else {
            for (int j = 0; j < nv; j++) {
                if (!rawbit && !v[j]) continue;  /* an unchanged element of an "all" block */
                uint32_t at = base + (uint32_t)(mode == MODE_ALL ? j : idx[j]);
                __builtin_prefetch(d + (int64_t)at * e, 1, 3);
                ch->pos[k] = at | rawbit;
                ch->val[k++] = v[j];
            }
        }
    }
    if (pad16(at) != nbytes || total != count) return 1;
    if (ch && !direct) apply_changes(ch, k, d, e);
    return 0;
}

static int narrow_chunk_e(const uint8_t *in, int64_t len, int64_t count, int64_t nbytes, int e, uint8_t *d,
                          const changes *ch) {
    switch (e) {
    case 1: return narrow_chunk(in, len, count, nbytes, 1, d, ch);
    case 2: return narrow_chunk(in, len, count, nbytes, 2, d, ch);
    case 4: return narrow_chunk(in, len, count, nbytes, 4, d, ch);
    default: return narrow_chunk(in, len, count, nbytes, 8, d, ch);
    }
}

/* Check (check == 1: no write) or apply a v2 message to n contiguous destinations. Headers and directory were
 * checked by the caller; an apply (check == 0) only after a check of the same bytes returned -1 (it leaves out
 * the checks of positions that check made). Returns -1 when done, the index of the first chunk whose body disagrees with its
 * header, or -2 when the message holds a chunk kind this codec does not write (the caller falls back). */
EXPORT int64_t trd_unpack(const uint8_t *msg, int64_t n, const int64_t *dst, const int64_t *numel,
                          const int64_t *esize, int64_t ce, int check) {
    if (!block_mask) choose_mask();
    int64_t c = 0, r = -1;
    changes chs = {NULL, NULL}, *ch = NULL;
    if (!check) {
        chs.pos = (uint32_t *)malloc(sizeof(uint32_t) * (size_t)ce);
        chs.val = (uint64_t *)malloc(sizeof(uint64_t) * (size_t)ce);
        if (!chs.pos || !chs.val) { free(chs.pos); free(chs.val); return -3; }
        ch = &chs;
    }
    for (int64_t i = 0; i < n; i++) {
        int e = (int)esize[i];
        uint8_t *d = (uint8_t *)(intptr_t)dst[i];
        for (int64_t a = 0; a < numel[i]; a += ce, c++) {
            int64_t off;
            uint32_t h[4];
            memcpy(&off, msg + 16 + 8 * c, 8);
            memcpy(h, msg + off, 16);
            int kind = (int)(h[0] & 0xFF);
            int64_t len = h[1], count = h[2], nbytes = h[3];
            if (kind == KIND_NARROW) {
                if (narrow_chunk_e(msg + off, len, count, nbytes, e, d + a * e, ch)) { r = c; goto done; }
            } else if (kind == KIND_DENSE) {
                if (!check) memcpy(d + a * e, msg + off + 16, (size_t)(len * e));
            } else if (!(kind == KIND_OFFSETS && count == 0)) {
                r = -2;
                goto done;
            }
        }
    }
done:
    free(chs.pos);
    free(chs.val);
    return r;
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

static struct PyModuleDef moddef = {PyModuleDef_HEAD_INIT, "_delta_codec",
                                    "The native delta codec (called through ctypes: ops/delta_native.py).", -1,
                                    NULL, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__delta_codec(void) { return PyModule_Create(&moddef); }
