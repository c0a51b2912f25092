/* y (M, N) = x (M, K) · dequant(w)ᵀ, with w int8 (N, K) and per-output-channel fp32 scales:
 *   y[m, n] = scale[n] · Σ_k x[m, k] · w[n, k]        (fp32 activations, fp32 accumulation)
 *
 * Built for the shapes of decode and verify passes (M = a few rows) on AVX2 + FMA CPUs: each int8
 * weight is loaded and widened once per group of up to 6 activation rows, so a K+1-row verify pass
 * reads the weights about as often as a 1-row decode step (memory-bound instead of compute-bound).
 *
 * Row exactness: every row is computed with the same sequence of operations whatever M is and
 * however rows and columns are grouped or split across threads (two 8-lane accumulators over
 * k ≡ 0..7 and 8..15 mod 16, summed in a fixed order, then a scalar tail). A token's logits then
 * do not depend on how many rows share the pass — a K+1 verify row equals a 1-row decode step
 * bit for bit, which keeps greedy speculative output identical to greedy plain output.
 */
#include <immintrin.h>
#include <stdint.h>

#define NTILE 64   /* output columns per tile: 64 weight rows of K bytes stay in L2 */
#define MG 6       /* activation rows per group: 2 x 6 accumulators + 6 x 2 inputs fit 16 ymm registers */

static inline float hsum(__m256 v) {
    __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    __m128 sh = _mm_movehdup_ps(lo);
    __m128 s = _mm_add_ps(lo, sh);
    sh = _mm_movehl_ps(sh, s);
    return _mm_cvtss_f32(_mm_add_ss(s, sh));
}

static inline __m256 widen8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

/* One weight row n against MM activation rows. */
#define ROW_KERNEL(MM)                                                                             \
    static void row_##MM(const float *x, const int8_t *wr, float s, float *y, long K, long N) {  \
        __m256 a0[MM], a1[MM];                                                                   \
        for (int m = 0; m < MM; m++) { a0[m] = _mm256_setzero_ps(); a1[m] = _mm256_setzero_ps(); } \
        long k = 0;                                                                              \
        for (; k + 16 <= K; k += 16) {                                                           \
            __m256 w0 = widen8(wr + k), w1 = widen8(wr + k + 8);                                 \
            for (int m = 0; m < MM; m++) {                                                       \
                a0[m] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + m * K + k), a0[m]);             \
                a1[m] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + m * K + k + 8), a1[m]);         \
            }                                                                                    \
        }                                                                                        \
        for (int m = 0; m < MM; m++) {                                                           \
            float acc = hsum(_mm256_add_ps(a0[m], a1[m]));                                      \
            for (long t = k; t < K; t++) acc += x[m * K + t] * (float)wr[t];                     \
            y[m * N] = acc * s;                                                                  \
        }                                                                                        \
    }

ROW_KERNEL(1)
ROW_KERNEL(2)
ROW_KERNEL(3)
ROW_KERNEL(4)
ROW_KERNEL(5)
ROW_KERNEL(6)

typedef void (*row_fn)(const float *, const int8_t *, float, float *, long, long);
static const row_fn ROWS[MG + 1] = {0, row_1, row_2, row_3, row_4, row_5, row_6};

int verispec_int8_gemm(const float *x, const int8_t *w, const float *scale, float *y,
                       long M, long N, long K, int threads) {
    long tiles = (N + NTILE - 1) / NTILE;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (long t = 0; t < tiles; t++) {
        long n0 = t * NTILE, n1 = n0 + NTILE < N ? n0 + NTILE : N;
        for (long m0 = 0; m0 < M; m0 += MG) {
            long mm = M - m0 < MG ? M - m0 : MG;
            for (long n = n0; n < n1; n++)
                ROWS[mm](x + m0 * K, w + n * K, scale[n], y + m0 * N + n, K, N);
        }
    }
    return 0;
}

/* Lets the loader check that the library it opened is this file's build. */
int verispec_int8_gemm_abi(void) { return 1; }
