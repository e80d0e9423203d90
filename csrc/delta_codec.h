/* What the parts of the native delta codec share (csrc/delta_codec.c: the pack; csrc/delta_simd.c: the block
 * compare and the run-time SIMD choice; csrc/delta_check.c: the check of a narrow chunk;
 * csrc/delta_apply.c: the apply and the directory): the format's constants, element loads and
 * stores, the widths of the narrow values, and the run-time choice of the SIMD paths. The format:
 * triton_reshard/ops/delta_v2.py. */
#ifndef TRD_DELTA_CODEC_H
#define TRD_DELTA_CODEC_H
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
#define FIRST_PATCHED 3 /* mode nibbles 3..14: patched blocks (ops/delta_patch.py) */
#define MAX_EXC 4
#define LAST_PATCHED (FIRST_PATCHED + 3 * MAX_EXC - 1)
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


typedef int (*mask_fn)(const uint8_t *, const uint8_t *, int, int, uint64_t *); /* returns the bits set */

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define HAVE_X86 1
#endif

#define HIDDEN __attribute__((visibility("hidden")))
#define INLINE static inline __attribute__((always_inline))

/* the block compare chosen for this CPU (bit i of m[] set iff element i of the block differs; returns their
 * count) and which paths of whole 16-bit blocks run (FAST16_AVX512: AVX-512 VBMI2 compress / expand, and
 * the 8-lane runs of the sparse apply and of the check, csrc/delta_stage.c and csrc/delta_check.c;
 * FAST16_AVX2: AVX2 left-pack / expand through the pshufb tables below; 0: portable C); set by trd_choose
 * (csrc/delta_simd.c) on the first call, or by trd_codec_use (the tests run each path this CPU has) */
#define FAST16_AVX512 512
#define FAST16_AVX2 256
extern HIDDEN mask_fn trd_block_mask;
extern HIDDEN int trd_fast16;
HIDDEN void trd_choose(void);
/* 0 when a narrow chunk's body (at in) agrees with its header (csrc/delta_check.c; no write) */
HIDDEN int trd_check_narrow(const uint8_t *in, int64_t len, int64_t count, int64_t nbytes, int e);
/* Per 8-bit mask k of 8 16-bit lanes (built by trd_choose): trd_lp16[k] the pshufb control that left-packs the
 * lanes of k's set bits; trd_ex16[k] the one that expands the first popcount(k) lanes to those lanes (the
 * others 0) */
extern HIDDEN uint8_t trd_lp16[256][16], trd_ex16[256][16];
/* The sparse apply's place in a narrow chunk it stages (csrc/delta_stage.c): body bytes read, changes staged
 * and counted, and its disagreements OR-ed */
typedef struct { int64_t at, k, total; unsigned bad; } stage_run;
#ifdef HAVE_X86
HIDDEN int64_t trd_stage_run16(stage_run *r, const uint8_t *in, int64_t nbytes, const uint8_t *desc, int64_t b,
                               int64_t nbk, int64_t a, int neg, uint8_t *d, int64_t *pos, uint64_t *val);
#endif

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

/* A descriptor's mode nibble: its positions mode (0..2) and exceptions (0: not patched) */
static inline int pos_mode(int mode) { return mode >= FIRST_PATCHED ? (mode - FIRST_PATCHED) / MAX_EXC : mode; }
static inline int exceptions_of(int mode) { return mode >= FIRST_PATCHED ? (mode - FIRST_PATCHED) % MAX_EXC + 1 : 0; }

/* A patched block's exceptions (at xp: nexc slots, then nexc values of e bytes) replace its decoded values v
 * (sign-extended differences) */
static inline void patch_values(const uint8_t *xp, int nexc, int e, uint64_t *v) {
    for (int k = 0; k < nexc; k++) {
        uint64_t x = load(xp + nexc, k, e);
        int sh = 64 - 8 * e;
        v[xp[k]] = sh ? (uint64_t)((int64_t)(x << sh) >> sh) : x;
    }
}

static inline int width_of(int code, int e) { return code == RAW ? 8 * e : 1 << code; }

/* code of the narrowest width holding every m = d ^ (d >> 63) < orv's bound; RAW when it reaches the element */
static inline int code_of(uint64_t orv, int e) {
    int c = 1;
    while (c < 6 && orv >= ((uint64_t)1 << ((1 << c) - 1))) c++;
    return (1 << c) >= 8 * e ? RAW : c;
}

/* The payload bytes of a changed block (descriptor byte d0 with a nonzero code, cnt changes, blen elements of
 * e bytes), or -1 when the descriptor is not one the format allows */
static inline int64_t block_bytes(int d0, int cnt, int blen, int e) {
    int code = d0 & 0x0F, dmode = d0 >> 4, mode = pos_mode(dmode), nexc = exceptions_of(dmode);
    if (code > RAW || dmode > LAST_PATCHED || cnt > blen || (code != RAW && (1 << code) >= 8 * e)) return -1;
    if (nexc && (code == RAW || nexc > (mode == MODE_ALL ? blen : cnt))) return -1;
    int w = width_of(code, e);
    int64_t vb = vbytes(cnt, w);
    int64_t size = mode == MODE_OFFSETS ? cnt + vb : mode == MODE_BITMASK ? (blen + 7) / 8 + vb : vbytes(blen, w);
    return size + (int64_t)nexc * (1 + e);
}

static inline int64_t sext(uint64_t v, int e) {
    int sh = 64 - 8 * e;
    return sh ? (int64_t)(v << sh) >> sh : (int64_t)v;
}

#endif
