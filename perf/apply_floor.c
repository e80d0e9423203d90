/* The floor of a sparse delta apply (issue 44 item 1): at a changed fraction f of the 125M Llama's 249 MB of bf16
 * weights (uniform random positions, ascending, as the decoded chunks give them), touch only the changed
 * elements (load, add, store: what any apply must do), next to one memcpy of all bytes, in the same run. At 1 %
 * the changes fall in ~27.5 % of the 64-byte lines (32 bf16 per line), and each touched line is read and
 * written back whole: a line-granular floor near 0.5x a copy, whatever the decode costs. Also: with the
 * destination lines prefetched 24 changes ahead, and a read-only touch (no write-back).
 *
 *     gcc -O2 perf/apply_floor.c -o /tmp/apply_floor && /tmp/apply_floor 0.01 && /tmp/apply_floor 0.02
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
int main(int argc, char **argv) {
    int64_t n = 124649472;  /* the 125M Llama's 86 weights, bf16 elements */
    double frac = argc > 1 ? atof(argv[1]) : 0.01;
    uint16_t *a = malloc(n * 2), *b = malloc(n * 2);
    memset(a, 1, n * 2); memset(b, 2, n * 2);
    int64_t k = 0, cap = (int64_t)(frac * n * 1.1) + 16;
    int64_t *pos = malloc(cap * 8);
    uint64_t r = 88172645463325252ull;
    for (int64_t i = 0; i < n && k < cap; i++) { r ^= r << 13; r ^= r >> 7; r ^= r << 17; if ((r >> 11) * (1.0 / 9007199254740992.0) < frac) pos[k++] = i; }
    int64_t lines = 0; for (int64_t j = 0, last = -1; j < k; j++) if (pos[j] / 32 != last) { lines++; last = pos[j] / 32; }
    printf("%.1f %% changed: %ld elements, %.1f %% of the 64-byte lines\n", frac * 100, (long)k, 100.0 * lines / (n / 32));
    for (int rnd = 0; rnd < 4; rnd++) {
        double t0 = now(); memcpy(b, a, n * 2); double t1 = now();
        for (int64_t j = 0; j < k; j++) a[pos[j]] += 1;
        double t2 = now();
        for (int64_t j = 0; j < k; j++) { if (j + 24 < k) __builtin_prefetch(a + pos[j + 24], 1, 0); a[pos[j]] += 1; }
        double t3 = now();
        /* read-only touch of the same lines (no write-back) */
        uint64_t s = 0; for (int64_t j = 0; j < k; j++) s += a[pos[j]];
        double t4 = now();
        printf("copy %.1f ms; touch %.2fx copy, touch+prefetch %.2fx, read-only %.2fx (%lu)\n", (t1 - t0) * 1e3,
               (t2 - t1) / (t1 - t0), (t3 - t2) / (t1 - t0), (t4 - t3) / (t1 - t0), (unsigned long)(s & 1));
    }
    return 0;
}
