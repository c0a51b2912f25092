/* The int6 matmul: weights as Q6_K GGUF tensors store them, w[n, k] = d[n, s] · sc[n, h] · (q[n, k] − 32),
 * with q in 0 … 63, h = k / 16 the half-group, s = k / 256 the super-block; sc an int8 per half-group,
 * d fp16 per super-block. Activations are rounded as for int4 (gemm4.c): q8[m, k] · s8[m, g] per row and
 * group g of 32. With the exact integers I[m, n, h] = Σ_{k in h} q[n, k] · q8[m, k] and
 * Q[m, h] = Σ_{k in h} q8[m, k] (q8_sums16_ws),
 *   J[m, n, g] = sc[n, 2g] · (I[m, n, 2g] − 32 Q[m, 2g]) + sc[n, 2g+1] · (I[m, n, 2g+1] − 32 Q[m, 2g+1])
 *   y[m, n]    = Σ_g float(J[m, n, g]) · (d[n, g / 8] · s8[m, g])
 * in ascending g: J is an exact integer (|J| < 2³¹), rounded once to fp32, then one product and one FMA
 * per group — the same operations in every variant and for every row count (row-exact; the AVX2 and
 * AVX-512 variants give the same bits). q · q8 pairs are u8 × s8: vpdpbusd on AVX-512 VNNI and AVX-VNNI, vpmaddubsw +
 * vpmaddwd on AVX2 (a pair sum stays at most 2 · 63 · 127, so nothing saturates, and two of them, added
 * in 16 bits, at most 32,004 < 2¹⁵). On AVX2 the vpmaddwd that widens them also weighs them by their
 * half-group's scale, and the Q term is one more vpmaddwd per group, (32 sc0, 32 sc1) · (−Q0, −Q1),
 * which starts the sum:
 *   J = −32 · (sc0 · Q0 + sc1 · Q1) + sc0 · I0 + sc1 · I1
 * the same integer as above (|sc · I| ≤ 128 · 16 · 63 · 127, so no int32 sum wraps), with no 32-bit
 * multiply (vpmulld) per row and the row's (−Q0, −Q1) pair ready in qs. On AVX-512 and AVX-VNNI the join is in fp32
 * instead of two vpmulld: I' = I − 32 Q of a half-group is below 16 · 32 · 127 in magnitude and sc · I'
 * below 2²⁴, so float(sc1) · float(I1') is exact and fma(float(sc0), float(I0'), that) rounds the exact
 * integer J once — float(J), the same bits (2–4 % faster at 6–256 rows than the two vpmulld, alternated
 * in one process).
 *
 * Layout (kernels.pack_int6), 16 output columns per block, zero past N:
 *   wp (ceil(N/16), K/32, 6, 16) uint32: words 0 … 3 of group g hold the low nibbles of chunk j (k = 32g
 *     + 8j … + 7) exactly as gemm4.c's words hold q; words 4 and 5 hold the high bit pairs of chunks
 *     (0, 1) and (2, 3): byte t of the word has, for the pair's first chunk, the high bits of byte lane
 *     t of (nibbles & 0x0F0F0F0F) in bits 0-1 and of ((nibbles >> 4) & 0x0F0F0F0F) in bits 2-3, and for
 *     its second chunk the same in bits 4-5 and 6-7 — so shifting by 4, 2, 0 or −2 and masking with
 *     0x30303030 puts a chunk's high bits beside its nibbles.
 *   sc (ceil(N/16), K/32, 2, 16) int8: the two half-groups' scales of each column.
 *   d (ceil(N/16), ceil(K/256), 16) fp16.
 * 6.5625 bits per weight, as Q6_K.
 */
#include "kernels.h"

#define MG6 SWEPT_ROWS  /* activation rows per group, as MG4 */

/* q8 (M, K) int8 -> qs: each half-group's sum Q (Q8_ORDER permutes within each 8 only). AVX-512 and
   AVX-VNNI: (M, K/16) int32, one per half-group. AVX2: (M, K/32) int32, a group's two sums negated as
   16-bit halves (−Q0 low, −Q1 high; |Q| ≤ 16 · 127), the operand of the vpmaddwd that forms the group's
   Q term. */
#if defined(__AVX512F__) || defined(__AVXVNNI__)
#define QS_HALVES 1
#define QS_ROW(K) ((K) / 16)    /* qs entries per row */
#else
#define QS_HALVES 0
#define QS_ROW(K) ((K) / 32)
#endif
static void q8_sums16_ws(const int8_t *q8, long M, long K, int32_t *qs) {
#if QS_HALVES
#pragma omp for schedule(static)
    for (long it = 0; it < M * (K / 16); it++) {       /* by (row, 16 values): one row keeps every thread busy */
        int32_t s = 0;
        for (int t = 0; t < 16; t++) s += q8[16 * it + t];
        qs[it] = s;
    }
#else
#pragma omp for schedule(static)
    for (long it = 0; it < M * (K / 32); it++) {       /* by (row, group) */
        int32_t s0 = 0, s1 = 0;
        for (int t = 0; t < 16; t++) s0 += q8[32 * it + t], s1 += q8[32 * it + 16 + t];
        qs[it] = (int32_t)(((uint32_t)-s1 << 16) | ((uint32_t)-s0 & 0xFFFFu));
    }
#endif
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define KERNEL6(MM)                                                                                \
    static void q6_##MM(const int8_t *q8, long K, const float *s8, const int32_t *qs, const uint32_t *wp, \
                        const int8_t *sc, const uint16_t *ds, float *y, long N, long G, long b) {   \
        const __m512i lo4 = _mm512_set1_epi32(0x0F0F0F0F), hi2 = _mm512_set1_epi32(0x30303030);  \
        const long S = (G + 7) / 8, H = 2 * G;                                                    \
        __m512 acc[MM], dv;                              /* dv: the super-block's d */          \
        for (int m = 0; m < MM; m++) acc[m] = _mm512_setzero_ps();                                \
        for (long g = 0; g < G; g++) {                                                            \
            if (g % 8 == 0) dv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(ds + (b * S + g / 8) * 16))); \
            const uint32_t *wg = wp + (b * G + g) * W6;                                          \
            for (int l = 0; l < 6; l++) _mm_prefetch((const char *)(wg + PF6 * W6 + 16 * l), _MM_HINT_T1); \
            __m512i isum[2][MM];        /* I − 32 Q of each half-group: the sums start at −32 Q */ \
            for (int m = 0; m < MM; m++) {                                                        \
                isum[0][m] = _mm512_set1_epi32(-32 * qs[m * H + 2 * g]);                          \
                isum[1][m] = _mm512_set1_epi32(-32 * qs[m * H + 2 * g + 1]);                      \
            }                                                                                     \
            for (int j = 0; j < 4; j++) {                                                         \
                __m512i d = _mm512_loadu_si512((const void *)(wg + 16 * j));                      \
                __m512i hw = _mm512_loadu_si512((const void *)(wg + 64 + 16 * (j / 2)));          \
                __m512i ha = (j & 1) ? hw : _mm512_slli_epi32(hw, 4);                             \
                __m512i hb = (j & 1) ? _mm512_srli_epi32(hw, 2) : _mm512_slli_epi32(hw, 2);       \
                __m512i lo = _mm512_or_si512(_mm512_and_si512(d, lo4), _mm512_and_si512(ha, hi2)); \
                __m512i hi = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(d, 4), lo4),      \
                                             _mm512_and_si512(hb, hi2));                          \
                for (int m = 0; m < MM; m++) {                                                    \
                    const int8_t *xr = q8 + m * K + 32 * g + 8 * j;                               \
                    isum[j / 2][m] = dpbusd_bcast(isum[j / 2][m], lo, xr);                        \
                    isum[j / 2][m] = dpbusd_bcast(isum[j / 2][m], hi, xr + 4);                    \
                }                                                                                 \
            }                                                                                     \
            const int8_t *sg = sc + (b * G + g) * 32;                                             \
            __m512i sc0 = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)sg));             \
            __m512i sc1 = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(sg + 16)));      \
            __m512 sc0f = _mm512_cvtepi32_ps(sc0), sc1f = _mm512_cvtepi32_ps(sc1);                \
            for (int m = 0; m < MM; m++) {  /* J in fp32: sc1 · I1' exact, one rounding of the sum */ \
                __m512 jf = _mm512_fmadd_ps(sc0f, _mm512_cvtepi32_ps(isum[0][m]),                \
                                            _mm512_mul_ps(sc1f, _mm512_cvtepi32_ps(isum[1][m])));  \
                __m512 t = _mm512_mul_ps(dv, _mm512_set1_ps(s8[m * G + g]));                      \
                acc[m] = _mm512_fmadd_ps(jf, t, acc[m]);                                          \
            }                                                                                     \
        }                                                                                         \
        long c = 16 * b, left = N - c;                                                            \
        __mmask16 k = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);             \
        for (int m = 0; m < MM; m++) _mm512_mask_storeu_ps(y + m * N + c, k, acc[m]);            \
    }
#else
/* One 16-column block for MM rows as two halves of 8 columns (ymm lanes): both halves in one sweep
   over the groups or one half per sweep, each row count's schedule (for a pass's first group of rows and
   for the later ones) chosen at run time as in gemm4.c (q6_one_sweep, verispec_int6_sweeps; by default
   one sweep up to NH6 rows). In both variants a
   super-block's d is widened once for its 8 groups, not per group (the same values).
   A group's J per row and 8 columns (j6_*): on AVX2 the integer J itself, started by the Q term and
   summed by vpmaddwd against the scales (the header); with AVX-VNNI (the avxvnni variant) the two
   half-groups' I − 32 Q, summed by vpdpbusd from −32 Q, and joined in fp32 at the group's end as on
   AVX-512 — float(J) either way, the same bits. */
#ifndef NH6
#if defined(__AVXVNNI__)
#define NH6 3
#else
#define NH6 2
#endif
#endif
typedef struct { __m256i w0, w1, q; __m256 f0, f1; } sc6;   /* a group's scales for 8 columns, as each path uses them */
typedef struct { __m256i s0, s1; } j6;                      /* AVX2: s0 = J so far; AVX-VNNI: I0', I1' */
static inline __attribute__((always_inline)) sc6 sc6_load(const int8_t *sg) {
    __m256i s0 = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)sg));
    __m256i s1 = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(sg + 16)));
    sc6 r;
    r.f0 = _mm256_cvtepi32_ps(s0), r.f1 = _mm256_cvtepi32_ps(s1);
    /* (sc0, sc0) and (sc1, sc1) weigh a chunk's pair sums as vpmaddwd widens them, (32 sc0, 32 sc1)
       (|·| ≤ 4,096) the row's (−Q0, −Q1) to start J at −32 (sc0 · Q0 + sc1 · Q1) */
    const __m256i low16 = _mm256_set1_epi32(0xFFFF);
    s0 = _mm256_and_si256(s0, low16), s1 = _mm256_and_si256(s1, low16);
    r.w0 = _mm256_or_si256(s0, _mm256_slli_epi32(s0, 16));
    r.w1 = _mm256_or_si256(s1, _mm256_slli_epi32(s1, 16));
    r.q = _mm256_slli_epi16(_mm256_or_si256(s0, _mm256_slli_epi32(s1, 16)), 5);
    return r;
}
#if defined(__AVXVNNI__)
static inline __attribute__((always_inline)) j6 j6_start(const int32_t *q, const sc6 *sc) {   /* q: Q0, Q1 */
    (void)sc;
#ifdef VERISPEC_BROKEN_VNNI     /* tests only: the second half-group without its −32 Q, a slip they must catch */
    return (j6){_mm256_set1_epi32(-32 * q[0]), _mm256_setzero_si256()};
#endif
    return (j6){_mm256_set1_epi32(-32 * q[0]), _mm256_set1_epi32(-32 * q[1])};
}
static inline __attribute__((always_inline)) j6 j6_chunk(j6 s, int half, __m256i lo, __m256i hi, const int8_t *xr,
                                                         const sc6 *sc) {
    (void)sc;
    __m256i t = half ? s.s1 : s.s0;
    t = _mm256_dpbusd_avx_epi32(t, lo, _mm256_set1_epi32(word32(xr)));
    t = _mm256_dpbusd_avx_epi32(t, hi, _mm256_set1_epi32(word32(xr + 4)));
    if (half) s.s1 = t; else s.s0 = t;
    return s;
}
static inline __attribute__((always_inline)) __m256 j6_float(j6 s, const sc6 *sc) {   /* sc1 · I1' exact, one rounding */
    return _mm256_fmadd_ps(sc->f0, _mm256_cvtepi32_ps(s.s0), _mm256_mul_ps(sc->f1, _mm256_cvtepi32_ps(s.s1)));
}
#else
static inline __attribute__((always_inline)) j6 j6_start(const int32_t *q, const sc6 *sc) {   /* q: (−Q0, −Q1) */
    return (j6){_mm256_madd_epi16(sc->q, _mm256_set1_epi32(q[0])), _mm256_setzero_si256()};
}
static inline __attribute__((always_inline)) j6 j6_chunk(j6 s, int half, __m256i lo, __m256i hi, const int8_t *xr,
                                                         const sc6 *sc) {
    __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(word32(xr))),
                                 _mm256_maddubs_epi16(hi, _mm256_set1_epi32(word32(xr + 4))));
    s.s0 = _mm256_add_epi32(s.s0, _mm256_madd_epi16(p, half ? sc->w1 : sc->w0));
    return s;
}
static inline __attribute__((always_inline)) __m256 j6_float(j6 s, const sc6 *sc) {
    (void)sc;
    return _mm256_cvtepi32_ps(s.s0);
}
#endif
#define KERNEL6(MM, NHV)                                                                           \
    static void q6_##MM##_##NHV(const int8_t *q8, long K, const float *s8, const int32_t *qs, const uint32_t *wp, \
                                const int8_t *sc, const uint16_t *ds, float *y, long N, long G, long b) { \
        enum { NH = NHV };                                                                        \
        const __m256i lo4 = _mm256_set1_epi32(0x0F0F0F0F), hi2 = _mm256_set1_epi32(0x30303030);  \
        const long S = (G + 7) / 8, QR = QS_ROW(K), QG = QR / G;  /* qs per row, per group */      \
        for (int h0 = 0; h0 < 2; h0 += NH) {                                                      \
            __m256 acc[NH][MM];                                                                   \
            for (int h = 0; h < NH; h++)                                                          \
                for (int m = 0; m < MM; m++) acc[h][m] = _mm256_setzero_ps();                     \
            __m256 dv[NH];               /* the super-block's d, converted once */               \
            for (long g = 0; g < G - SWEEP_SLIP(MM, NHV); g++) {                                 \
                const uint32_t *wb = wp + (b * G + g) * W6;                                      \
                if (g % 8 == 0)                                                                   \
                    for (int h = 0; h < NH; h++)                                                  \
                        dv[h] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(ds + (b * S + g / 8) * 16 + 8 * (h0 + h)))); \
                if (h0 == 0)                                     /* the second sweep re-reads */  \
                    for (int l = 0; l < 6; l++) _mm_prefetch((const char *)(wb + PF6 * W6 + 16 * l), _MM_HINT_T1); \
                sc6 scs[NH];                                                                      \
                for (int h = 0; h < NH; h++) scs[h] = sc6_load(sc + (b * G + g) * 32 + 8 * (h0 + h)); \
                j6 isum[NH][MM];                                                                  \
                for (int h = 0; h < NH; h++)                                                      \
                    for (int m = 0; m < MM; m++) isum[h][m] = j6_start(qs + m * QR + QG * g, &scs[h]); \
                for (int j = 0; j < 4; j++)                                                       \
                    for (int h = 0; h < NH; h++) {                                                \
                        const uint32_t *wg = wb + 8 * (h0 + h);                                   \
                        __m256i d = _mm256_loadu_si256((const __m256i *)(wg + 16 * j));           \
                        __m256i hw = _mm256_loadu_si256((const __m256i *)(wg + 64 + 16 * (j / 2))); \
                        __m256i ha = (j & 1) ? hw : _mm256_slli_epi32(hw, 4);                     \
                        __m256i hb = (j & 1) ? _mm256_srli_epi32(hw, 2) : _mm256_slli_epi32(hw, 2); \
                        __m256i lo = _mm256_or_si256(_mm256_and_si256(d, lo4), _mm256_and_si256(ha, hi2)); \
                        __m256i hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(d, 4), lo4), \
                                                     _mm256_and_si256(hb, hi2));                  \
                        for (int m = 0; m < MM; m++)                                              \
                            isum[h][m] = j6_chunk(isum[h][m], j / 2, lo, hi, q8 + m * K + 32 * g + 8 * j, &scs[h]); \
                    }                                                                             \
                for (int h = 0; h < NH; h++) {                                                    \
                    for (int m = 0; m < MM; m++) {                                                \
                        __m256 t = _mm256_mul_ps(dv[h], _mm256_set1_ps(s8[m * G + g]));           \
                        acc[h][m] = _mm256_fmadd_ps(j6_float(isum[h][m], &scs[h]), t, acc[h][m]);  \
                    }                                                                             \
                }                                                                                 \
            }                                                                                     \
            for (int h = 0; h < NH; h++) store_cols8(y, N, 16 * b + 8 * (h0 + h), acc[h], MM);     \
        }                                                                                         \
    }
#endif

typedef void (*q6_fn)(const int8_t *, long, const float *, const int32_t *, const uint32_t *, const int8_t *,
                      const uint16_t *, float *, long, long, long);
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
KERNEL6(1) KERNEL6(2) KERNEL6(3) KERNEL6(4) KERNEL6(5) KERNEL6(6)
static const q6_fn Q6[MG6 + 1] = {0, q6_1, q6_2, q6_3, q6_4, q6_5, q6_6};
#define Q6_FOR(mm, later) Q6[mm]

/* A 16-column block is one vector: no schedule to choose. */
int verispec_int6_sweeps(int *one, int set) { (void)one, (void)set; return -1; }
#else
SWEPT_KERNELS(KERNEL6)
static const q6_fn Q6[2][MG6 + 1] = SWEPT_TABLE(q6);
static sweep_table q6_one_sweep = SWEEP_DEFAULTS(NH6);     /* see kernels.h */
#define Q6_FOR(mm, later) Q6[q6_one_sweep[later][mm]][mm]

/* As verispec_int4_sweeps, for the int6 kernels. */
int verispec_int6_sweeps(int *one, int set) { return sweeps_io(q6_one_sweep, one, set); }
#endif

void vs_int6_gemm_ws(const int8_t *q8, const float *s8, int32_t *qs, const uint32_t *wp, const int8_t *sc,
                     const uint16_t *ds, float *y, long M, long N, long K) {
    if (vs_int6_amx_ws(q8, s8, wp, sc, ds, y, M, N, K)) return;             /* the amx variant's tiles */
    q8_sums16_ws(q8, M, K, qs);                       /* the vector kernels' Q terms (the tiles need none) */
    long G = K / 32, blocks = (N + 15) / 16, groups = (M + MG6 - 1) / MG6;
#pragma omp for schedule(static)
    for (long b = 0; b < blocks; b++)
        for (long gi = 0, m0 = 0; gi < groups; gi++) {          /* rows in near-equal groups */
            long mm = (M - m0) / (groups - gi) + ((M - m0) % (groups - gi) != 0);
            Q6_FOR(mm, gi > 0)(q8 + m0 * K, K, s8 + m0 * G, qs + m0 * QS_ROW(K), wp, sc, ds, y + m0 * N, N, G, b);
            m0 += mm;
        }
}

/* x (M, K) float32 with K a multiple of 32 -> y (M, N). Returns 0, -1 when K is not a multiple of 32,
   -2 when the scratch cannot be allocated. */
int verispec_int6_gemm(const float *x, const uint32_t *wp, const int8_t *sc, const uint16_t *ds, float *y,
                       long M, long N, long K, int threads) {
    if (K % 32) return -1;
    float *s8 = malloc(sizeof(float) * 2 * M * (K / 32) + sizeof(int32_t) * M * (K / 16) + (M + 15) / 16 * 16 * K + 64);
    if (!s8) return -2;
    float *xs = s8 + M * (K / 32);
    int32_t *qs = (int32_t *)(xs + M * (K / 32));
    int8_t *q8 = (int8_t *)(qs + M * (K / 16));
#pragma omp parallel num_threads(threads)
    {
        vs_quantize_groups8_ws(x, M, K, q8, s8, xs);
        vs_int6_gemm_ws(q8, s8, qs, wp, sc, ds, y, M, N, K);
    }
    free(s8);
    return 0;
}
