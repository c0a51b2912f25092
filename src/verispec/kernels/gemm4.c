/* The int4 matmul: weights as Q4_K GGUF tensors store them, w[n, k] = d[n, s] · sc[n, g] · q[n, k]
 * − dmin[n, s] · m[n, g], with q in 0 … 15, g = k / 32 the group, s = g / 8 the super-block of 256;
 * sc and m are 8-bit integers per group (Q4_K's are 6-bit; 8 bits also hold finer ones), d and dmin
 * fp16 per super-block. Activations are rounded to 8-bit integers per row and group of 32 (as
 * llama.cpp's Q8 activations are): x[m, k] ≈ q8[m, k] · s8[m, g] with s8 = max |x| / 127 over the
 * group. With I[m, n, g] = Σ_{k in g} q[n, k] · q8[m, k] (an exact integer, |I| ≤ 32 · 15 · 127) and
 * the group's exact float sum X[m, g] = Σ_{k in g} x[m, k], per super-block s
 *   A[m, n, s] = Σ_{g in s} float(I[m, n, g] · sc[n, g]) · s8[m, g]
 *   B[m, n, s] = Σ_{g in s} float(m[n, g]) · X[m, g]
 *   y[m, n]    = Σ_s ( d[n, s] · A[m, n, s] + (−dmin[n, s]) · B[m, n, s] )
 * as fp32 FMAs in ascending g and s: two per row and group, two per row and super-block. I · sc is an
 * exact integer below 2²⁴ (32 · 15 · 127 · 255), so its float is exact. A u8 × s8 dot product of 4
 * pairs is one lane of vpdpbusd (AVX-512 VNNI, AVX-VNNI), or vpmaddubsw on AVX2, whose 16-bit pair sums (at most
 * 2 · 15 · 127) are added in 16 bits over the group's 32 k (8 of them: below 2¹⁵, so nothing saturates
 * or wraps) and widened by one vpmaddwd per group against (sc, sc) pairs, which yields I · sc itself:
 * 64 multiply-adds per instruction where 16-bit activations gave 32. AVX-512 forms float(I) ·
 * float(sc), the same exact value. A row's result is that one sequence of operations whatever M is
 * (row-exact), and the AVX2 and AVX-512 variants run the same integer sums and fp32 operations lane for
 * lane (the same bits). d and dmin enter once per super-block, not as d · sc and dmin · m per group,
 * which takes the per-group products off the fp32 steps (and on AVX2, where the multiplier rides in
 * the widening vpmaddwd, a product per row and group): on a Zen/Zen+ the 1.5B's 1-token pass ran
 * 1.05x faster (docs/PERFORMANCE_LOG.md).
 *
 * Layout (kernels.pack_int4), 16 output columns per block, zero past N:
 *   wp (ceil(N/16), K/32, 4, 16) uint32: for block b, group g, chunk j (k = 32g + 8j … 32g + 8j + 7),
 *     column c, one 32-bit word whose bits 4i … 4i+3 hold q[c, 32g + 8j + 2i] and bits 16 + 4i …
 *     16 + 4i + 3 hold q[c, 32g + 8j + 2i + 1] (i = 0 … 3).
 *   gs (ceil(N/16), K/32, 2, 16) uint8: sc then m of each column of the group.
 *   ss (ceil(N/16), ceil(K/256), 2, 16) fp16: d then dmin of each column of the super-block.
 * 4.625 bits per weight (4 + 2 · 8 / 32 + 2 · 16 / 256; Q4_K itself 4.5).
 * In a word, (word & 0x0F0F0F0F) holds the bytes (q[k], q[k+4], q[k+1], q[k+5]) and
 * ((word >> 4) & 0x0F0F0F0F) the bytes (q[k+2], q[k+6], q[k+3], q[k+7]) with k = 32g + 8j, so the
 * activations are stored in that order within each 8 (Q8_ORDER) and a word of four meets its weights.
 */
#include "kernels.h"

#define MG4 SWEPT_ROWS  /* activation rows per group (each row count has its sweep schedule: kernels.h) */

/* x (M, K) float32 -> q8 (M, K) int8 in Q8_ORDER within each 8, s8 and xsum (M, K/32). One group of 32
   in four 8-lane vectors (AVX2 in every variant, so every variant gives the same bits): amax exact in
   any order; the sum as ((x0..7 + x8..15) + (x16..23 + x24..31)) lane by lane, then hsum; each value
   x · (127 / amax) rounded to the nearest integer, ties to even (as lrintf in the default mode), clamped
   to ±127. Q8_ORDER (0, 4, 1, 5, 2, 6, 3, 7): stored position i holds x[k + Q8_ORDER[i]]. */
void vs_quantize_groups8_ws(const float *x, long M, long K, int8_t *q8, float *s8, float *xsum) {
    long G = K / 32;
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    const __m256i lim = _mm256_set1_epi32(127), nlim = _mm256_set1_epi32(-127);
    const __m256i dwords = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    const __m256i order = _mm256_setr_epi8(0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15,
                                           0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15);
#pragma omp for schedule(static)
    for (long it = 0; it < M * G; it++) {              /* by (row, group): one row keeps every thread busy */
        long m = it / G, g = it % G;
        const float *xg = x + m * K + 32 * g;
        __m256 a0 = _mm256_loadu_ps(xg), a1 = _mm256_loadu_ps(xg + 8);
        __m256 a2 = _mm256_loadu_ps(xg + 16), a3 = _mm256_loadu_ps(xg + 24);
        __m256 mx = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(a0, absmask), _mm256_and_ps(a1, absmask)),
                                  _mm256_max_ps(_mm256_and_ps(a2, absmask), _mm256_and_ps(a3, absmask)));
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        h = _mm_max_ss(h, _mm_movehdup_ps(h));
        float amax = _mm_cvtss_f32(h);
        float sum = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
        __m256 inv = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
        __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(a0, inv)), i1 = _mm256_cvtps_epi32(_mm256_mul_ps(a1, inv));
        __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(a2, inv)), i3 = _mm256_cvtps_epi32(_mm256_mul_ps(a3, inv));
        i0 = _mm256_max_epi32(_mm256_min_epi32(i0, lim), nlim);
        i1 = _mm256_max_epi32(_mm256_min_epi32(i1, lim), nlim);
        i2 = _mm256_max_epi32(_mm256_min_epi32(i2, lim), nlim);
        i3 = _mm256_max_epi32(_mm256_min_epi32(i3, lim), nlim);
        /* packs work within 128-bit halves: dwords come out as x0-3, x8-11, x16-19, x24-27, x4-7, … */
        __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
        b = _mm256_shuffle_epi8(_mm256_permutevar8x32_epi32(b, dwords), order);
        _mm256_storeu_si256((__m256i *)(q8 + m * K + 32 * g), b);
        s8[m * G + g] = amax / 127.0f;
        xsum[m * G + g] = sum;
    }
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
/* One 16-column block for MM rows: a zmm lane is a column. */
#define KERNEL4(MM)                                                                                \
    static void q4_##MM(const int8_t *q8, long K, const float *s8, const float *xs, const uint32_t *wp, \
                        const uint8_t *gs, const uint16_t *ss, float *y, long N, long G, long b) {  \
        const __m512i lo4 = _mm512_set1_epi32(0x0F0F0F0F);                                        \
        const long S = (G + 7) / 8;                                                               \
        __m512 acc[MM], sa[MM], sm[MM];             /* sa, sm: the super-block's A and B */     \
        for (int m = 0; m < MM; m++) acc[m] = _mm512_setzero_ps();                                \
        for (long g = 0; g < G; g++) {                                                            \
            if (g % 8 == 0)                                                                       \
                for (int m = 0; m < MM; m++) sa[m] = sm[m] = _mm512_setzero_ps();                 \
            __m512i isum[MM];                                                                     \
            for (int m = 0; m < MM; m++) isum[m] = _mm512_setzero_si512();                        \
            const uint32_t *wg = wp + (b * G + g) * 64;                                          \
            _mm_prefetch((const char *)(wg + PF4 * 64), _MM_HINT_T1);                             \
            _mm_prefetch((const char *)(wg + PF4 * 64 + 16), _MM_HINT_T1);                        \
            _mm_prefetch((const char *)(wg + PF4 * 64 + 32), _MM_HINT_T1);                        \
            _mm_prefetch((const char *)(wg + PF4 * 64 + 48), _MM_HINT_T1);                        \
            for (int j = 0; j < 4; j++) {                                                         \
                __m512i d = _mm512_loadu_si512((const void *)(wg + 16 * j));                      \
                __m512i lo = _mm512_and_si512(d, lo4), hi = _mm512_and_si512(_mm512_srli_epi32(d, 4), lo4); \
                for (int m = 0; m < MM; m++) {                                                    \
                    const int8_t *xr = q8 + m * K + 32 * g + 8 * j;                               \
                    isum[m] = dpbusd_bcast(isum[m], lo, xr);                                      \
                    isum[m] = dpbusd_bcast(isum[m], hi, xr + 4);                                  \
                }                                                                                 \
            }                                                                                     \
            const uint8_t *gg = gs + (b * G + g) * 32;                                            \
            __m512 scf = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)gg))); \
            __m512 mf = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(gg + 16)))); \
            for (int m = 0; m < MM; m++) {        /* float(I) · float(sc) is I · sc, exact */          \
                __m512 isc = _mm512_mul_ps(_mm512_cvtepi32_ps(isum[m]), scf);                     \
                sa[m] = _mm512_fmadd_ps(isc, _mm512_set1_ps(s8[m * G + g]), sa[m]);               \
                sm[m] = _mm512_fmadd_ps(mf, _mm512_set1_ps(xs[m * G + g]), sm[m]);                \
            }                                                                                     \
            if (g % 8 == 7 || g == G - 1) {                      /* the super-block's d and −dmin */ \
                const uint16_t *sg = ss + (b * S + g / 8) * 32;                                   \
                __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)sg));            \
                __m512 ndmin = _mm512_sub_ps(_mm512_setzero_ps(),                                 \
                                             _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sg + 16)))); \
                for (int m = 0; m < MM; m++) {                                                    \
                    acc[m] = _mm512_fmadd_ps(dv, sa[m], acc[m]);                                  \
                    acc[m] = _mm512_fmadd_ps(ndmin, sm[m], acc[m]);                               \
                }                                                                                 \
            }                                                                                     \
        }                                                                                         \
        long c = 16 * b, left = N - c;                                                            \
        __mmask16 k = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);             \
        for (int m = 0; m < MM; m++) _mm512_mask_storeu_ps(y + m * N + c, k, acc[m]);            \
    }
#else
/* One 16-column block for MM rows as two halves of 8 columns (ymm lanes): both halves in one sweep
   over the groups (NH = 2: two independent accumulator chains per row, each group's scales loaded
   once) or one half per sweep (NH = 1: half the accumulators, the block's weights read twice). Either
   way each column lane sees the same operations in the same order, so the schedule changes the speed
   only: each row count's is chosen at run time (q4_one_sweep, verispec_int4_sweeps), apart for a pass's
   first group of rows, which reads the block from memory, and the groups after it, which find it in
   cache; by default one sweep up to NH4 rows. verispec times both on the machine (kernels/sweeps.py),
   since which is faster depends on the core (registers spilled, multiply ports) and its memory.
   A group's sum per row and column: with AVX-VNNI (the avxvnni variant: Intel cores since Alder Lake
   without AVX-512) I itself in 32 bits, one vpdpbusd per 4 k as on AVX-512, and float(I) · float(sc)
   at the group's end, as there; otherwise the 16-bit pair sums of vpmaddubsw, widened by vpmaddwd
   against (sc, sc) into I · sc. Both are the same exact integer below 2²⁴, so the same float. */
#ifndef NH4
#if defined(__AVXVNNI__)
#define NH4 6           /* int32 sums need no 16-bit stage: both halves fit for every row count */
#else
#define NH4 3
#endif
#endif
#if defined(__AVXVNNI__)
static inline __attribute__((always_inline)) __m256i q4_chunk(__m256i s, __m256i lo, __m256i hi, const int8_t *xr) {
    s = _mm256_dpbusd_avx_epi32(s, lo, _mm256_set1_epi32(word32(xr)));
#ifdef VERISPEC_BROKEN_VNNI     /* tests only: the high nibbles meet the low nibbles' activations, a slip they must catch */
    xr -= 4;
#endif
    return _mm256_dpbusd_avx_epi32(s, hi, _mm256_set1_epi32(word32(xr + 4)));
}
static inline __attribute__((always_inline)) __m256 q4_isc(__m256i s, __m256i scp, __m256 scf) {
    (void)scp;
    return _mm256_mul_ps(_mm256_cvtepi32_ps(s), scf);
}
#else
static inline __attribute__((always_inline)) __m256i q4_chunk(__m256i s, __m256i lo, __m256i hi, const int8_t *xr) {
    s = _mm256_add_epi16(s, _mm256_maddubs_epi16(lo, _mm256_set1_epi32(word32(xr))));
    return _mm256_add_epi16(s, _mm256_maddubs_epi16(hi, _mm256_set1_epi32(word32(xr + 4))));
}
static inline __attribute__((always_inline)) __m256 q4_isc(__m256i s, __m256i scp, __m256 scf) {
    (void)scf;
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(s, scp));
}
#endif
#define KERNEL4(MM, NHV)                                                                           \
    static void q4_##MM##_##NHV(const int8_t *q8, long K, const float *s8, const float *xs, const uint32_t *wp, \
                                const uint8_t *gs, const uint16_t *ss, float *y, long N, long G, long b) { \
        enum { NH = NHV };                                                                        \
        const __m256i lo4 = _mm256_set1_epi32(0x0F0F0F0F);                                       \
        /* byte c of 8 scales -> 16-bit lanes 2c and 2c + 1 (column c's (sc, sc) pair) */          \
        const __m256i pairs = _mm256_setr_epi8(0, -1, 0, -1, 1, -1, 1, -1, 2, -1, 2, -1, 3, -1, 3, -1, \
                                               4, -1, 4, -1, 5, -1, 5, -1, 6, -1, 6, -1, 7, -1, 7, -1); \
        const long S = (G + 7) / 8;                                                               \
        for (int h0 = 0; h0 < 2; h0 += NH) {                                                      \
            __m256 acc[NH][MM], sa[NH][MM], sm[NH][MM];   /* sa, sm: the super-block's A and B */ \
            for (int h = 0; h < NH; h++)                                                          \
                for (int m = 0; m < MM; m++) acc[h][m] = _mm256_setzero_ps();                     \
            for (long g = 0; g < G - SWEEP_SLIP(MM, NHV); g++) {                                  \
                const uint32_t *wb = wp + (b * G + g) * 64;                                      \
                if (g % 8 == 0)                                                                   \
                    for (int h = 0; h < NH; h++)                                                  \
                        for (int m = 0; m < MM; m++) sa[h][m] = sm[h][m] = _mm256_setzero_ps();   \
                if (h0 == 0) {                                   /* the second sweep re-reads */  \
                    _mm_prefetch((const char *)(wb + PF4 * 64), _MM_HINT_T1);                     \
                    _mm_prefetch((const char *)(wb + PF4 * 64 + 16), _MM_HINT_T1);                \
                    _mm_prefetch((const char *)(wb + PF4 * 64 + 32), _MM_HINT_T1);                \
                    _mm_prefetch((const char *)(wb + PF4 * 64 + 48), _MM_HINT_T1);                \
                }                                                                                 \
                __m256i psum[NH][MM];     /* AVX2: pair sums in 16 bits, 8 of at most 2·15·127 < 2¹⁵ */ \
                for (int h = 0; h < NH; h++)                                                      \
                    for (int m = 0; m < MM; m++) psum[h][m] = _mm256_setzero_si256();             \
                for (int j = 0; j < 4; j++)                                                       \
                    for (int h = 0; h < NH; h++) {                                                \
                        __m256i d = _mm256_loadu_si256((const __m256i *)(wb + 16 * j + 8 * (h0 + h))); \
                        __m256i lo = _mm256_and_si256(d, lo4), hi = _mm256_and_si256(_mm256_srli_epi32(d, 4), lo4); \
                        for (int m = 0; m < MM; m++) {                                            \
                            psum[h][m] = q4_chunk(psum[h][m], lo, hi, q8 + m * K + 32 * g + 8 * j); \
                            keep_in_register(psum[h][m]);                                         \
                        }                                                                         \
                    }                                                                             \
                for (int h = 0; h < NH; h++) {                                                    \
                    const uint8_t *gg = gs + (b * G + g) * 32 + 8 * (h0 + h);                     \
                    int64_t scb;                                                                  \
                    memcpy(&scb, gg, sizeof scb);                                                 \
                    __m256i scp = _mm256_shuffle_epi8(_mm256_set1_epi64x(scb), pairs);            \
                    __m256 scf = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)gg))); \
                    __m256 mf = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(gg + 16)))); \
                    for (int m = 0; m < MM; m++) {     /* float(I · sc), exact */                  \
                        __m256 isc = q4_isc(psum[h][m], scp, scf);                               \
                        sa[h][m] = _mm256_fmadd_ps(isc, _mm256_set1_ps(s8[m * G + g]), sa[h][m]); \
                        sm[h][m] = _mm256_fmadd_ps(mf, _mm256_set1_ps(xs[m * G + g]), sm[h][m]);  \
                    }                                                                             \
                }                                                                                 \
                if (g % 8 == 7 || g == G - 1)                  /* the super-block's d and −dmin */ \
                    for (int h = 0; h < NH; h++) {                                                \
                        const uint16_t *sg = ss + (b * S + g / 8) * 32 + 8 * (h0 + h);            \
                        __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)sg));        \
                        __m256 ndmin = _mm256_sub_ps(_mm256_setzero_ps(),                         \
                                                     _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sg + 16)))); \
                        for (int m = 0; m < MM; m++) {                                            \
                            acc[h][m] = _mm256_fmadd_ps(dv, sa[h][m], acc[h][m]);                 \
                            acc[h][m] = _mm256_fmadd_ps(ndmin, sm[h][m], acc[h][m]);              \
                        }                                                                         \
                    }                                                                             \
            }                                                                                     \
            for (int h = 0; h < NH; h++) store_cols8(y, N, 16 * b + 8 * (h0 + h), acc[h], MM);     \
        }                                                                                         \
    }
#endif

typedef void (*q4_fn)(const int8_t *, long, const float *, const float *, const uint32_t *, const uint8_t *,
                      const uint16_t *, float *, long, long, long);
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
KERNEL4(1) KERNEL4(2) KERNEL4(3) KERNEL4(4) KERNEL4(5) KERNEL4(6)
static const q4_fn Q4[MG4 + 1] = {0, q4_1, q4_2, q4_3, q4_4, q4_5, q4_6};
#define Q4_FOR(mm, later) Q4[mm]

/* A 16-column block is one vector: no schedule to choose. */
int verispec_int4_sweeps(int *one, int set) { (void)one, (void)set; return -1; }
#else
SWEPT_KERNELS(KERNEL4)
static const q4_fn Q4[2][MG4 + 1] = SWEPT_TABLE(q4);
static sweep_table q4_one_sweep = SWEEP_DEFAULTS(NH4);     /* see kernels.h */
#define Q4_FOR(mm, later) Q4[q4_one_sweep[later][mm]][mm]

/* The schedules in force, or new ones (sweeps_io); -1 where there is none to choose (the AVX-512 kernels). */
int verispec_int4_sweeps(int *one, int set) { return sweeps_io(q4_one_sweep, one, set); }
#endif

void vs_int4_gemm_ws(const int8_t *q8, const float *s8, const float *xs, const uint32_t *wp, const uint8_t *gs,
                     const uint16_t *ss, float *y, long M, long N, long K) {
    if (vs_int4_amx_ws(q8, s8, xs, wp, gs, ss, y, M, N, K)) return;         /* the amx variant's tiles */
    long G = K / 32, blocks = (N + 15) / 16, groups = (M + MG4 - 1) / MG4;
#pragma omp for schedule(static)
    for (long b = 0; b < blocks; b++)
        for (long gi = 0, m0 = 0; gi < groups; gi++) {          /* rows in near-equal groups */
            long mm = (M - m0) / (groups - gi) + ((M - m0) % (groups - gi) != 0);
            Q4_FOR(mm, gi > 0)(q8 + m0 * K, K, s8 + m0 * G, xs + m0 * G, wp, gs, ss, y + m0 * N, N, G, b);
            m0 += mm;
        }
}

/* x (M, K) float32 with K a multiple of 32 -> y (M, N). Returns 0, -1 when K is not a multiple of 32,
   -2 when the scratch cannot be allocated. */
int verispec_int4_gemm(const float *x, const uint32_t *wp, const uint8_t *gs, const uint16_t *ss, float *y,
                       long M, long N, long K, int threads) {
    if (K % 32) return -1;
    float *s8 = malloc(sizeof(float) * 2 * M * (K / 32) + (M + 15) / 16 * 16 * K + 64);   /* q8: whole tiles */
    if (!s8) return -2;
    float *xs = s8 + M * (K / 32);
    int8_t *q8 = (int8_t *)(xs + M * (K / 32));
#pragma omp parallel num_threads(threads)
    {
        vs_quantize_groups8_ws(x, M, K, q8, s8, xs);
        vs_int4_gemm_ws(q8, s8, xs, wp, gs, ss, y, M, N, K);
    }
    free(s8);
    return 0;
}

/* Row id of the weight: q · (d · sc) − (dmin · m), one fp32 product each for the two factors, then one
   product and one difference per weight — packing.int4_rows' operations, so the same bits. */
void vs_int4_row(const uint32_t *wp, const uint8_t *gs, const uint16_t *ss, long id, long K, float *out) {
    long G = K / 32, S = (G + 7) / 8, b = id / 16, c = id % 16;
    for (long g = 0; g < G; g++) {
        const uint8_t *gg = gs + (b * G + g) * 32;
        const uint16_t *sg = ss + (b * S + g / 8) * 32;
        float scale = _cvtsh_ss(sg[c]) * (float)gg[c], low = _cvtsh_ss(sg[16 + c]) * (float)gg[16 + c];
        for (int j = 0; j < 4; j++) {
            uint32_t word = wp[((b * G + g) * 4 + j) * 16 + c];
            for (int t = 0; t < 8; t++) {               /* bits 4i (+16 for the odd weight): k = 8j + 2i + t' */
                int i2 = t / 2, odd = t % 2;
                float q = (float)((word >> (4 * i2 + 16 * odd)) & 0xF);
                out[32 * g + 8 * j + t] = q * scale - low;
            }
        }
    }
}

/* Rows ids[0 … n-1] of the weight the layout holds (N rows of K) -> out (n, K) float32 (an embedding
   lookup that reads only its rows). Returns 0, or -1 when an id is outside 0 … N-1 or K is not a
   multiple of 32. */
int verispec_int4_rows(const uint32_t *wp, const uint8_t *gs, const uint16_t *ss, const int64_t *ids, long n,
                       long N, long K, float *out) {
    if (K % 32) return -1;
    for (long i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= N) return -1;
    for (long i = 0; i < n; i++) vs_int4_row(wp, gs, ss, ids[i], K, out + i * K);
    return 0;
}
