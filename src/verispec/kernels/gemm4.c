/* The int4 matmul: weights on a 16-level affine grid per group of 32 along k (how Q4_K GGUF tensors
 * are stored), w[n, k] = min[n, g] + q[n, k] · scale[n, g] with q in 0 … 15 and g = k / 32; scale
 * and min in fp16. Activations are rounded to 16-bit integers per row exactly as for int8 (gemm.c:
 * qx, sx), so with X[m, g] = Σ_{k in g} qx[m, k] and I[m, n, g] = Σ_{k in g} q[n, k] · qx[m, k]
 *   y[m, n] = sx[m] · Σ_g ( scale[n, g] · I[m, n, g] + min[n, g] · X[m, g] )
 * where I (|I| ≤ 32 · 15 · 32767 < 2²⁴) and X are exact integers, exact in fp32 too; the sum over g is
 * two fp32 FMAs per group in ascending g, then one product with sx. A row's result is that one
 * sequence of operations whatever M is (row-exact), and the AVX2 and AVX-512 variants run the same
 * integer sums and fp32 operations lane for lane (the same bits).
 *
 * Layout (kernels.pack_int4), 16 output columns per block, zero past N:
 *   wp (ceil(N/16), K/32, 4, 16) uint32: for block b, group g, chunk j (k = 32g + 8j … 32g + 8j + 7),
 *     column c, one 32-bit word whose bits 4i … 4i+3 hold q[c, 32g + 8j + 2i] and bits 16 + 4i …
 *     16 + 4i + 3 hold q[c, 32g + 8j + 2i + 1] (i = 0 … 3): (word >> 4i) & 0x000F000F is then the
 *     int16 pair (q[k], q[k+1]) that vpdpwssd / vpmaddwd multiply with the activation pair.
 *   scale, min (ceil(N/16), K/32, 16) fp16.
 * 5 bits per weight (4 + 2 × 16 / 32): a 1-row pass reads ~60 % of what int8 reads.
 */
#include "kernels.h"

#define MG4 6           /* activation rows per group */

static inline int32_t pair32(const int16_t *p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
/* One 16-column block for MM rows: a zmm lane is a column. */
#define KERNEL4(MM)                                                                                \
    static void q4_##MM(const int16_t *qx, long KP, const float *sx, const float *xs, const uint32_t *wp, \
                        const uint16_t *sc, const uint16_t *mn, float *y, long N, long G, long b) {  \
        const __m512i lo4 = _mm512_set1_epi32(0x000F000F);                                        \
        __m512 acc[MM];                                                                           \
        for (int m = 0; m < MM; m++) acc[m] = _mm512_setzero_ps();                                \
        for (long g = 0; g < G; g++) {                                                            \
            __m512i isum[MM];                                                                     \
            for (int m = 0; m < MM; m++) isum[m] = _mm512_setzero_si512();                        \
            const uint32_t *wg = wp + (b * G + g) * 64;                                          \
            _mm_prefetch((const char *)(wg + 4 * 64), _MM_HINT_T0);                              \
            _mm_prefetch((const char *)(wg + 4 * 64 + 16), _MM_HINT_T0);                         \
            _mm_prefetch((const char *)(wg + 4 * 64 + 32), _MM_HINT_T0);                         \
            _mm_prefetch((const char *)(wg + 4 * 64 + 48), _MM_HINT_T0);                         \
            for (int j = 0; j < 4; j++) {                                                         \
                __m512i d = _mm512_loadu_si512((const void *)(wg + 16 * j));                      \
                __m512i w[4] = {_mm512_and_si512(d, lo4), _mm512_and_si512(_mm512_srli_epi32(d, 4), lo4), \
                                _mm512_and_si512(_mm512_srli_epi32(d, 8), lo4), _mm512_srli_epi16(d, 12)}; \
                for (int m = 0; m < MM; m++) {                                                    \
                    const int16_t *xr = qx + m * KP + 32 * g + 8 * j;                             \
                    for (int i = 0; i < 4; i++)                                                   \
                        isum[m] = _mm512_dpwssd_epi32(isum[m], w[i], _mm512_set1_epi32(pair32(xr + 2 * i))); \
                }                                                                                 \
            }                                                                                     \
            __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sc + (b * G + g) * 16)));   \
            __m512 mv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(mn + (b * G + g) * 16)));  \
            for (int m = 0; m < MM; m++) {                                                        \
                acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[m]), s, acc[m]);                 \
                acc[m] = _mm512_fmadd_ps(mv, _mm512_set1_ps(xs[m * G + g]), acc[m]);              \
            }                                                                                     \
        }                                                                                         \
        long c = 16 * b, left = N - c;                                                            \
        __mmask16 k = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);             \
        for (int m = 0; m < MM; m++)                                                              \
            _mm512_mask_storeu_ps(y + m * N + c, k, _mm512_mul_ps(acc[m], _mm512_set1_ps(sx[m]))); \
    }
#else
/* One 16-column block for MM rows as two halves of 8 columns (ymm lanes). */
#define KERNEL4(MM)                                                                                \
    static void q4_##MM(const int16_t *qx, long KP, const float *sx, const float *xs, const uint32_t *wp, \
                        const uint16_t *sc, const uint16_t *mn, float *y, long N, long G, long b) {  \
        const __m256i lo4 = _mm256_set1_epi32(0x000F000F);                                        \
        for (int h = 0; h < 2; h++) {                                                             \
            __m256 acc[MM];                                                                       \
            for (int m = 0; m < MM; m++) acc[m] = _mm256_setzero_ps();                            \
            for (long g = 0; g < G; g++) {                                                        \
                __m256i isum[MM];                                                                 \
                for (int m = 0; m < MM; m++) isum[m] = _mm256_setzero_si256();                    \
                const uint32_t *wg = wp + (b * G + g) * 64 + 8 * h;                              \
                _mm_prefetch((const char *)(wg + 4 * 64), _MM_HINT_T0);                          \
                _mm_prefetch((const char *)(wg + 4 * 64 + 32), _MM_HINT_T0);                     \
                for (int j = 0; j < 4; j++) {                                                     \
                    __m256i d = _mm256_loadu_si256((const __m256i *)(wg + 16 * j));               \
                    __m256i w[4] = {_mm256_and_si256(d, lo4), _mm256_and_si256(_mm256_srli_epi32(d, 4), lo4), \
                                    _mm256_and_si256(_mm256_srli_epi32(d, 8), lo4), _mm256_srli_epi16(d, 12)}; \
                    for (int m = 0; m < MM; m++) {                                                \
                        const int16_t *xr = qx + m * KP + 32 * g + 8 * j;                         \
                        for (int i = 0; i < 4; i++)                                               \
                            isum[m] = _mm256_add_epi32(isum[m], _mm256_madd_epi16(                \
                                w[i], _mm256_set1_epi32(pair32(xr + 2 * i))));                    \
                    }                                                                             \
                }                                                                                 \
                __m256 s = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sc + (b * G + g) * 16 + 8 * h))); \
                __m256 mv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(mn + (b * G + g) * 16 + 8 * h))); \
                for (int m = 0; m < MM; m++) {                                                    \
                    acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[m]), s, acc[m]);             \
                    acc[m] = _mm256_fmadd_ps(mv, _mm256_set1_ps(xs[m * G + g]), acc[m]);          \
                }                                                                                 \
            }                                                                                     \
            long c = 16 * b + 8 * h, left = N - c;                                                \
            if (left <= 0) break;                                                                 \
            __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(left < 8 ? (int)left : 8),        \
                                              _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));         \
            for (int m = 0; m < MM; m++)                                                          \
                _mm256_maskstore_ps(y + m * N + c, mask, _mm256_mul_ps(acc[m], _mm256_set1_ps(sx[m]))); \
        }                                                                                         \
    }
#endif

KERNEL4(1) KERNEL4(2) KERNEL4(3) KERNEL4(4) KERNEL4(5) KERNEL4(6)
typedef void (*q4_fn)(const int16_t *, long, const float *, const float *, const uint32_t *, const uint16_t *,
                      const uint16_t *, float *, long, long, long);
static const q4_fn Q4[MG4 + 1] = {0, q4_1, q4_2, q4_3, q4_4, q4_5, q4_6};

void vs_group_sums_ws(const int16_t *qx, long M, long K, float *xs) {
    long G = K / 32;
#pragma omp for schedule(static)
    for (long m = 0; m < M; m++)
        for (long g = 0; g < G; g++) {
            int32_t s = 0;
            for (int t = 0; t < 32; t++) s += qx[m * kpad(K) + 32 * g + t];
            xs[m * G + g] = (float)s;
        }
}

void vs_int4_gemm_ws(const int16_t *qx, const float *sx, const float *xs, const uint32_t *wp, const uint16_t *sc,
                     const uint16_t *mn, float *y, long M, long N, long K) {
    long G = K / 32, blocks = (N + 15) / 16, groups = (M + MG4 - 1) / MG4;
#pragma omp for schedule(static)
    for (long b = 0; b < blocks; b++)
        for (long gi = 0, m0 = 0; gi < groups; gi++) {          /* rows in near-equal groups */
            long mm = (M - m0) / (groups - gi) + ((M - m0) % (groups - gi) != 0);
            Q4[mm](qx + m0 * kpad(K), kpad(K), sx + m0, xs + m0 * G, wp, sc, mn, y + m0 * N, N, G, b);
            m0 += mm;
        }
}

/* x (M, K) float32 with K a multiple of 32 -> y (M, N). Returns 0, -1 when K is not a multiple of 32,
   -2 when the scratch cannot be allocated. */
int verispec_int4_gemm(const float *x, const uint32_t *wp, const uint16_t *sc, const uint16_t *mn, float *y,
                       long M, long N, long K, int threads) {
    if (K % 32) return -1;
    float *xs = malloc(sizeof(float) * (M * (K / 32) + M) + sizeof(int16_t) * M * kpad(K) + 64);
    if (!xs) return -2;
    float *sx = xs + M * (K / 32);
    int16_t *qx = (int16_t *)(sx + M);
#pragma omp parallel num_threads(threads)
    {
        vs_quantize_rows_ws(x, M, K, qx, sx);
        vs_group_sums_ws(qx, M, K, xs);
        vs_int4_gemm_ws(qx, sx, xs, wp, sc, mn, y, M, N, K);
    }
    free(xs);
    return 0;
}
