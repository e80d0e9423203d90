/* The per-message integrity digest in one read pass (issue 46; the definition: triton_reshard/ops/digest.py).
 *
 * A message of n bytes, read as nw = n / 8 little-endian uint64 words then n % 8 tail bytes, hashes to
 *     H = sum_r coef[r] * (sum of the words of row r)  +  sum_t coef[R + t] * tail byte t      (mod 2**64)
 * with rows of 128 words (1 KiB; the last one may be shorter) and R = ceil(nw / 128) rows. H is linear in the
 * bytes: byte k adds b_k * coef[k / 1024] << 8 (k % 8) (or b_k * coef[R + k - 8 nw] in the tail), so the
 * digest of a message can be summed over pieces of it wherever they lie: the sender's contiguous buffer, or
 * the receiver's destination views (the unpack's output read in place, strided, no rebuild copy).
 *
 * trd_digest(nd, desc, n, coef): the sum over nd views of the message. A view is 12 int64: its address, its
 * offset in the message, the bytes of its contiguous inner run, the number of outer dimensions (0..4), then
 * 4 sizes and 4 byte strides of those (outermost first). Part of the same extension as the delta codec
 * (setup.py), called through ctypes (ops/digest.py); plain C99, with an AVX2 loop chosen at run time.
 * trd_digest_many: the same for several messages in one call.
 */
#include <stdint.h>
#include <string.h>

#if defined(_MSC_VER)
#define EXPORT __declspec(dllexport)
#else
#define EXPORT __attribute__((visibility("default")))
#endif

#define ROW_SHIFT 10 /* 1 KiB rows */

/* The weighted row sums of the whole words at message offsets [a, z) (both multiples of 8), read from q (the
 * byte at offset a): per 1 KiB row, coef[row] * (the sum of its words), summed. The sum of a row's words is
 * the same in any order (mod 2**64), so the loop may keep as many lanes as the machine has: the portable one
 * keeps 4 scalar sums, the AVX2 one 4 x 4 in vector registers (chosen once at run time, as the delta codec's
 * SIMD paths are: no -march, the wheel runs on any x86-64). */
typedef uint64_t (*words_fn)(const uint8_t *q, int64_t a, int64_t z, const uint64_t *coef);

static uint64_t words_portable(const uint8_t *q, int64_t a, int64_t z, const uint64_t *coef) {
    uint64_t h = 0;
    const int64_t base = a;
    while (a < z) {
        int64_t row_end = ((a >> ROW_SHIFT) + 1) << ROW_SHIFT, e = z < row_end ? z : row_end;
        const uint8_t *r = q + (a - base);
        uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
        int64_t k = 0, m = e - a;
        for (; k + 32 <= m; k += 32) {
            uint64_t w[4];
            memcpy(w, r + k, 32);
            s0 += w[0];
            s1 += w[1];
            s2 += w[2];
            s3 += w[3];
        }
        for (; k < m; k += 8) {
            uint64_t w;
            memcpy(&w, r + k, 8);
            s0 += w;
        }
        h += coef[a >> ROW_SHIFT] * ((s0 + s1) + (s2 + s3));
        a = e;
    }
    return h;
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define DIGEST_X86 1
__attribute__((target("avx2"))) static uint64_t words_avx2(const uint8_t *q, int64_t a, int64_t z,
                                                            const uint64_t *coef) {
    uint64_t h = 0;
    const int64_t base = a;
    while (a < z) {
        int64_t row_end = ((a >> ROW_SHIFT) + 1) << ROW_SHIFT, e = z < row_end ? z : row_end;
        const uint8_t *r = q + (a - base);
        __m256i v0 = _mm256_setzero_si256(), v1 = v0, v2 = v0, v3 = v0;
        int64_t k = 0, m = e - a;
        for (; k + 128 <= m; k += 128) {
            v0 = _mm256_add_epi64(v0, _mm256_loadu_si256((const __m256i *)(r + k)));
            v1 = _mm256_add_epi64(v1, _mm256_loadu_si256((const __m256i *)(r + k + 32)));
            v2 = _mm256_add_epi64(v2, _mm256_loadu_si256((const __m256i *)(r + k + 64)));
            v3 = _mm256_add_epi64(v3, _mm256_loadu_si256((const __m256i *)(r + k + 96)));
        }
        for (; k + 32 <= m; k += 32) v0 = _mm256_add_epi64(v0, _mm256_loadu_si256((const __m256i *)(r + k)));
        v0 = _mm256_add_epi64(_mm256_add_epi64(v0, v1), _mm256_add_epi64(v2, v3));
        uint64_t t[4], s;
        _mm256_storeu_si256((__m256i *)t, v0);
        s = (t[0] + t[1]) + (t[2] + t[3]);
        for (; k < m; k += 8) {
            uint64_t w;
            memcpy(&w, r + k, 8);
            s += w;
        }
        h += coef[a >> ROW_SHIFT] * s;
        a = e;
    }
    return h;
}
#endif

static words_fn words = 0;
static int has_avx2 = -1; /* whether the machine has AVX2 (-1: not asked yet) */
static void pick_copy(void);

static words_fn choose_words(void) {
    words_fn f = words_portable;
#ifdef DIGEST_X86
    if (has_avx2 < 0) {
        __builtin_cpu_init();
        has_avx2 = __builtin_cpu_supports("avx2") ? 1 : 0;
    }
    if (has_avx2) f = words_avx2;
#endif
    words = f; /* a benign race: every thread stores the same pointers */
    pick_copy();
    return f;
}

/* trd_digest_simd(): the lanes the hash loop runs on this machine (256: AVX2, 0: the portable loop). */
EXPORT int trd_digest_simd(void) {
    words_fn f = words ? words : choose_words();
#ifdef DIGEST_X86
    if (f == words_avx2) return 256;
#endif
    return 0;
}

/* The contribution of the bytes p[0..len) lying at message offsets [o, o + len). */
static uint64_t run(const uint8_t *p, int64_t o, int64_t len, int64_t lim, int64_t rows, const uint64_t *coef) {
    uint64_t h = 0;
    int64_t a = o, end = o + len, z = end < lim ? end : lim;
    for (; a < z && (a & 7); a++) /* the bytes of a word this run holds only the end of */
        h += coef[a >> ROW_SHIFT] * ((uint64_t)p[a - o] << (8 * (a & 7)));
    if (a < z) {
        int64_t zw = a + ((z - a) & ~(int64_t)7); /* whole words */
        if (zw > a) h += (words ? words : choose_words())(p + (a - o), a, zw, coef);
        for (a = zw; a < z; a++) /* the bytes of a word this run holds only the start of */
            h += coef[a >> ROW_SHIFT] * ((uint64_t)p[a - o] << (8 * (a & 7)));
    }
    for (a = o > lim ? o : lim; a < end; a++) h += coef[rows + (a - lim)] * (uint64_t)p[a - o];
    return h;
}

static uint64_t views(int64_t nd, const int64_t *desc, int64_t n, const uint64_t *coef) {
    int64_t lim = n & ~(int64_t)7, rows = ((n >> 3) + 127) >> 7;
    uint64_t h = 0;
    for (int64_t v = 0; v < nd; v++) {
        const int64_t *d = desc + 12 * v;
        const uint8_t *base = (const uint8_t *)(intptr_t)d[0];
        int64_t off = d[1], inner = d[2], outer = d[3];
        int64_t size[4] = {1, 1, 1, 1}, stride[4] = {0, 0, 0, 0};
        for (int i = 0; i < outer; i++) {
            size[4 - outer + i] = d[4 + i];
            stride[4 - outer + i] = d[8 + i];
        }
        if (inner <= 0 || size[0] <= 0 || size[1] <= 0 || size[2] <= 0 || size[3] <= 0) continue;
        for (int64_t i0 = 0; i0 < size[0]; i0++)
            for (int64_t i1 = 0; i1 < size[1]; i1++)
                for (int64_t i2 = 0; i2 < size[2]; i2++) {
                    const uint8_t *p = base + i0 * stride[0] + i1 * stride[1] + i2 * stride[2];
                    for (int64_t i3 = 0; i3 < size[3]; i3++) {
                        h += run(p, off, inner, lim, rows, coef);
                        p += stride[3];
                        off += inner;
                    }
                }
    }
    return h;
}

EXPORT uint64_t trd_digest(int64_t nd, const int64_t *desc, int64_t n, const uint64_t *coef) {
    return views(nd, desc, n, coef);
}

/* trd_digest_many(nm, counts, desc, lens, coef, out): the hashes of nm messages in one call (a step's
 * messages: one call instead of one per message). Message m is made of counts[m] views (12 int64 each, as
 * trd_digest's), those of message 0 first, then message 1's, ...; it is lens[m] bytes long; out[m] = its
 * hash. */
EXPORT void trd_digest_many(int64_t nm, const int64_t *counts, const int64_t *desc, const int64_t *lens,
                            const uint64_t *coef, uint64_t *out) {
    for (int64_t m = 0; m < nm; m++) {
        out[m] = views(counts[m], desc, lens[m], coef);
        desc += 12 * counts[m];
    }
}

/* trd_digest_use(lanes): run the hash loop with 256-bit lanes (AVX2, where the machine has them) or the
 * portable loop (0), for the tests that check both give the same value; returns the lanes now in use. */
EXPORT int trd_digest_use(int lanes) {
    choose_words();
    if (lanes == 0) {
        words = words_portable;
        pick_copy();
    }
    return trd_digest_simd();
}

/* The fused copy (issue 46: the hash in the same pass as the pack's or the unpack's copy). */

#define BLOCK 4096 /* bytes copied, then hashed back from where they were written while still in L1 */

/* Copy the whole words at message offsets [a, z) (multiples of 8) from src to dst (both at offset a) and
 * return their weighted row sums as dst holds them (words()'s value of dst afterwards). The portable way:
 * memcpy a block, then hash it back from dst while it is in L1. */
typedef uint64_t (*copy_words_fn)(uint8_t *dst, const uint8_t *src, int64_t a, int64_t z, const uint64_t *coef);

static uint64_t copy_words_block(uint8_t *dst, const uint8_t *src, int64_t a, int64_t z, const uint64_t *coef) {
    uint64_t h = 0;
    for (int64_t k = 0, len = z - a; k < len;) {
        int64_t b = len - k < BLOCK ? len - k : BLOCK;
        memcpy(dst + k, src + k, (size_t)b);
        h += words(dst + k, a + k, a + k + b, coef);
        k += b;
    }
    return h;
}

#ifdef DIGEST_X86
/* The AVX2 way, one pass: 128 bytes loaded, stored, then loaded back from dst (the compiler barrier makes the
 * second load a real read of the destination, served from the store buffer / L1) and summed per row. */
__attribute__((target("avx2"))) static uint64_t copy_words_avx2(uint8_t *dst, const uint8_t *src, int64_t a,
                                                                 int64_t z, const uint64_t *coef) {
    uint64_t h = 0;
    const int64_t base = a;
    while (a < z) {
        int64_t row_end = ((a >> ROW_SHIFT) + 1) << ROW_SHIFT, e = z < row_end ? z : row_end;
        const uint8_t *s = src + (a - base);
        uint8_t *d = dst + (a - base);
        __m256i v0 = _mm256_setzero_si256(), v1 = v0, v2 = v0, v3 = v0;
        int64_t k = 0, m = e - a;
        for (; k + 128 <= m; k += 128) {
            __m256i x0 = _mm256_loadu_si256((const __m256i *)(s + k));
            __m256i x1 = _mm256_loadu_si256((const __m256i *)(s + k + 32));
            __m256i x2 = _mm256_loadu_si256((const __m256i *)(s + k + 64));
            __m256i x3 = _mm256_loadu_si256((const __m256i *)(s + k + 96));
            _mm256_storeu_si256((__m256i *)(d + k), x0);
            _mm256_storeu_si256((__m256i *)(d + k + 32), x1);
            _mm256_storeu_si256((__m256i *)(d + k + 64), x2);
            _mm256_storeu_si256((__m256i *)(d + k + 96), x3);
            __asm__ volatile("" ::: "memory");
            v0 = _mm256_add_epi64(v0, _mm256_loadu_si256((const __m256i *)(d + k)));
            v1 = _mm256_add_epi64(v1, _mm256_loadu_si256((const __m256i *)(d + k + 32)));
            v2 = _mm256_add_epi64(v2, _mm256_loadu_si256((const __m256i *)(d + k + 64)));
            v3 = _mm256_add_epi64(v3, _mm256_loadu_si256((const __m256i *)(d + k + 96)));
        }
        if (k < m) { /* the row's last < 128 bytes (whole words): copied, then read back */
            memcpy(d + k, s + k, (size_t)(m - k));
            __asm__ volatile("" ::: "memory");
        }
        v0 = _mm256_add_epi64(_mm256_add_epi64(v0, v1), _mm256_add_epi64(v2, v3));
        uint64_t t[4], sum;
        _mm256_storeu_si256((__m256i *)t, v0);
        sum = (t[0] + t[1]) + (t[2] + t[3]);
        for (; k < m; k += 8) {
            uint64_t w;
            memcpy(&w, d + k, 8);
            sum += w;
        }
        h += coef[a >> ROW_SHIFT] * sum;
        a = e;
    }
    return h;
}
#endif

static copy_words_fn copy_words = copy_words_block;

/* The fused copy's loop: the AVX2 one where the hash loop is AVX2, else memcpy-then-hash blocks. */
static void pick_copy(void) {
#ifdef DIGEST_X86
    if (words == words_avx2) {
        copy_words = copy_words_avx2;
        return;
    }
#endif
    copy_words = copy_words_block;
}

/* Copy src[0..len) to dst[0..len) (message offsets [o, o + len)) and hash the bytes as the destination holds
 * them: each word is read back from dst right after it was written (hot), so the hash covers the written
 * memory, not a register copy of the source. The bytes of words the run holds only part of (its edges) and
 * the message's tail bytes: copied, then run() reads them back. */
static uint64_t copy_run(uint8_t *dst, const uint8_t *src, int64_t o, int64_t len, int64_t lim, int64_t rows,
                         const uint64_t *coef) {
    uint64_t h = 0;
    int64_t a = o, end = o + len, z = end < lim ? end : lim;
    while (a < z && (a & 7)) a++;
    if (a > o) { /* the leading bytes of a partial word */
        memcpy(dst, src, (size_t)(a - o));
        h += run(dst, o, a - o, lim, rows, coef);
    }
    if (a < z) {
        int64_t zw = a + ((z - a) & ~(int64_t)7);
        if (zw > a) h += copy_words(dst + (a - o), src + (a - o), a, zw, coef);
        a = zw;
    }
    if (end > a) { /* the trailing bytes of a partial word, and the message's tail bytes */
        memcpy(dst + (a - o), src + (a - o), (size_t)(end - a));
        h += run(dst + (a - o), a, end - a, lim, rows, coef);
    }
    return h;
}

/* One copy of trd_copy_digest (its 18 int64 at d), of the bytes at message offsets [lo, hi) only; its hash.
 * piece: NULL (the copy's own source), or where the message's byte lo lies (the message's piece [lo, hi) held
 * elsewhere, e.g. in a same-host lane's ring): each byte is read from there instead. */
static uint64_t copy_one(const int64_t *d, const int64_t *lens, const uint64_t *coef, int64_t lo, int64_t hi,
                         const uint8_t *piece) {
    const uint8_t *src = (const uint8_t *)(intptr_t)d[0];
    uint8_t *dst = (uint8_t *)(intptr_t)d[1];
    int64_t m = d[2], off = d[3], inner = d[4], outer = d[5];
    int64_t n = lens[m], lim = n & ~(int64_t)7, rows = ((n >> 3) + 127) >> 7;
    int64_t size[4] = {1, 1, 1, 1}, ss[4] = {0, 0, 0, 0}, ds[4] = {0, 0, 0, 0};
    for (int i = 0; i < outer; i++) {
        size[4 - outer + i] = d[6 + i];
        ss[4 - outer + i] = d[10 + i];
        ds[4 - outer + i] = d[14 + i];
    }
    if (inner <= 0 || size[0] <= 0 || size[1] <= 0 || size[2] <= 0 || size[3] <= 0) return 0;
    uint64_t h = 0;
    for (int64_t i0 = 0; i0 < size[0]; i0++)
        for (int64_t i1 = 0; i1 < size[1]; i1++)
            for (int64_t i2 = 0; i2 < size[2]; i2++) {
                const uint8_t *s = src + i0 * ss[0] + i1 * ss[1] + i2 * ss[2];
                uint8_t *t = dst + i0 * ds[0] + i1 * ds[1] + i2 * ds[2];
                for (int64_t i3 = 0; i3 < size[3]; i3++) {
                    if (off >= hi) return h; /* the message side is in message order: nothing more in the span */
                    if (off + inner > lo) {
                        int64_t a = off > lo ? off : lo, z = off + inner < hi ? off + inner : hi;
                        const uint8_t *from = piece ? piece + (a - lo) : s + (a - off);
                        h += copy_run(t + (a - off), from, a, z - a, lim, rows, coef);
                    }
                    s += ss[3];
                    t += ds[3];
                    off += inner;
                }
            }
    return h;
}

/* trd_copy_digest(nd, desc, lens, coef, out): nd copies; a copy is 18 int64: source address, destination
 * address, its message's index m, the offset of its first byte in message m, the bytes of its contiguous
 * inner run (contiguous on both sides), the number of outer dimensions (0..4), then 4 sizes, 4 source byte
 * strides and 4 destination byte strides of those (outermost first). The message side (the destination of a
 * pack, the source of an unpack) is contiguous, so the message offset advances by the inner run. out[m] +=
 * the hash of the copied bytes of message m (lens[m] bytes long), as written into the destination. */
EXPORT void trd_copy_digest(int64_t nd, const int64_t *desc, const int64_t *lens, const uint64_t *coef,
                            uint64_t *out) {
    if (!words) choose_words(); /* the loops of this machine (copy_words with them) */
    for (int64_t v = 0; v < nd; v++) out[desc[18 * v + 2]] += copy_one(desc + 18 * v, lens, coef, 0, INT64_MAX, NULL);
}

/* trd_copy_digest_span(nd, desc, lens, coef, out, lo, hi, piece): trd_copy_digest of an unpack, of the bytes
 * at message offsets [lo, hi) only, read from piece (where the message's byte lo lies) instead of each copy's
 * source: a message unpacked piece by piece as the pieces arrive (the sum of the pieces' hashes is the
 * message's). */
EXPORT void trd_copy_digest_span(int64_t nd, const int64_t *desc, const int64_t *lens, const uint64_t *coef,
                                 uint64_t *out, int64_t lo, int64_t hi, const uint8_t *piece) {
    if (!words) choose_words();
    for (int64_t v = 0; v < nd; v++) out[desc[18 * v + 2]] += copy_one(desc + 18 * v, lens, coef, lo, hi, piece);
}
