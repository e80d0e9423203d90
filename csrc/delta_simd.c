/* The run-time choice of the native delta codec's SIMD paths (csrc/delta_codec.c describes the codec) and the
 * pack's block compare: bit i of m[] set iff element i of a block differs between source and snapshot; each
 * returns the count of set bits (the AVX paths with the popcnt instruction; without it __builtin_popcountll
 * calls libgcc, 4 calls per block, ~2 % of a pack). */
#include "delta_codec.h"

/* Bits set in the 4 words of m without the popcnt instruction (the portable build) */
static int count4(const uint64_t m[4]) {
    int c = 0;
    for (int k = 0; k < 4; k++) {
        uint64_t x = m[k];
        x -= (x >> 1) & 0x5555555555555555ull;
        x = (x & 0x3333333333333333ull) + ((x >> 2) & 0x3333333333333333ull);
        x = (x + (x >> 4)) & 0x0F0F0F0F0F0F0F0Full;
        c += (int)((x * 0x0101010101010101ull) >> 56);
    }
    return c;
}

static int mask_portable(const uint8_t *s, const uint8_t *q, int n, int e, uint64_t m[4]) {
    m[0] = m[1] = m[2] = m[3] = 0;
    for (int i = 0; i < n; i++)
        m[i >> 6] |= (uint64_t)(memcmp(s + (int64_t)i * e, q + (int64_t)i * e, (size_t)e) != 0) << (i & 63);
    return count4(m);
}

static int mask_portable2(const uint8_t *s, const uint8_t *q, int n, int e, uint64_t m[4]) {
    if (e != 2) return mask_portable(s, q, n, e, m);
    const uint16_t *a = (const uint16_t *)(const void *)s, *b = (const uint16_t *)(const void *)q;
    m[0] = m[1] = m[2] = m[3] = 0;
    for (int w = 0; w * 64 < n; w++) {
        uint64_t x = 0;
        int lim = n - w * 64 < 64 ? n - w * 64 : 64;
        for (int i = 0; i < lim; i++) x |= (uint64_t)(a[w * 64 + i] != b[w * 64 + i]) << i;
        m[w] = x;
    }
    return count4(m);
}

#ifdef HAVE_X86
__attribute__((target("avx512f,avx512bw,popcnt"))) static int mask_avx512(const uint8_t *s, const uint8_t *q, int n,
                                                                           int e, uint64_t m[4]) {
    if (n != BLOCK) return mask_portable(s, q, n, e, m);
    int c = 0;
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
        c += __builtin_popcountll(x);
    }
    return c;
}

__attribute__((target("avx2,bmi2,popcnt"))) static int mask_avx2(const uint8_t *s, const uint8_t *q, int n, int e,
                                                                 uint64_t m[4]) {
    if (n != BLOCK || e != 2) return mask_portable2(s, q, n, e, m);
    int c = 0;
    for (int w = 0; w < 4; w++) {
        uint64_t x = 0;
        for (int k = 0; k < 4; k++) { /* 16 bf16 per 32-byte vector */
            __m256i a = _mm256_loadu_si256((const __m256i *)(const void *)(s + (w * 64 + k * 16) * 2));
            __m256i b = _mm256_loadu_si256((const __m256i *)(const void *)(q + (w * 64 + k * 16) * 2));
            uint32_t eq = (uint32_t)_mm256_movemask_epi8(_mm256_cmpeq_epi16(a, b));
            x |= (uint64_t)(~_pext_u32(eq, 0x55555555u) & 0xFFFFu) << (k * 16);
        }
        m[w] = x;
        c += __builtin_popcountll(x);
    }
    return c;
}

#endif

HIDDEN mask_fn trd_block_mask = 0;
HIDDEN int trd_fast16 = 0; /* FAST16_AVX512, FAST16_AVX2 or 0 (delta_codec.h) */
HIDDEN uint8_t trd_lp16[256][16], trd_ex16[256][16];
static int tables_built = 0;

static void build_tables(void) {
    for (int k = 0; k < 256; k++) {
        memset(trd_lp16[k], 0x80, 16);
        memset(trd_ex16[k], 0x80, 16);
        for (int i = 0, c = 0; i < 8; i++)
            if (k >> i & 1) {
                trd_lp16[k][2 * c] = (uint8_t)(2 * i), trd_lp16[k][2 * c + 1] = (uint8_t)(2 * i + 1);
                trd_ex16[k][2 * i] = (uint8_t)(2 * c), trd_ex16[k][2 * i + 1] = (uint8_t)(2 * c + 1);
                c++;
            }
    }
    tables_built = 1;
}

/* the fastest paths this CPU has, up to cap (512: any; 256: AVX2 at most; 0: portable C) */
static void choose_upto(int cap) {
    mask_fn m = mask_portable2;
    int fast = 0;
    if (!tables_built) build_tables();
#ifdef HAVE_X86
    __builtin_cpu_init();
    int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("bmi2") && __builtin_cpu_supports("popcnt");
    if (cap >= 512 && __builtin_cpu_supports("avx512bw")) {
        m = mask_avx512;
        if (__builtin_cpu_supports("avx512vbmi2") && __builtin_cpu_supports("avx512vl") &&
            __builtin_cpu_supports("avx512dq")) /* (vl, dq: the sparse apply's run and the check's groups) */
            fast = FAST16_AVX512;
        else if (avx2) fast = FAST16_AVX2;
    } else if (cap >= 256 && avx2) {
        m = mask_avx2;
        fast = FAST16_AVX2;
    }
#endif
    trd_fast16 = fast;
    trd_block_mask = m;
}

HIDDEN void trd_choose(void) { choose_upto(512); }

EXPORT int trd_simd(void) {
    if (!trd_block_mask) trd_choose();
#ifdef HAVE_X86
    if (trd_block_mask == mask_avx512) return 512;
    if (trd_block_mask == mask_avx2) return 256;
#endif
    return 0;
}

/* trd_codec_use(simd): run the fastest paths this CPU has up to simd (512, 256: AVX2, 0: portable C) in this
 * process, for the tests that check every path writes the same bytes; returns trd_simd() now. */
EXPORT int trd_codec_use(int simd) {
    choose_upto(simd);
    return trd_simd();
}

