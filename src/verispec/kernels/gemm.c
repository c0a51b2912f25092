/* Weight-only quantized matmuls for decode and verify shapes: int8 per channel, int4 per group.
 *
 * int8: y (M, N) = x (M, K) · dequant(w)ᵀ, with w int8 (N, K) and per-output-channel fp32 scales:
 *   y[m, n] = scale[n] · Σ_k x[m, k] · w[n, k]        (fp32 activations, fp32 accumulation)
 *
 * Built for the shapes of decode and verify passes (M = a few rows) on AVX2 + FMA CPUs: each int8
 * weight is loaded and widened once per group of up to 6 activation rows and each activation load
 * feeds several weight rows, so a K+1-row verify pass costs little more than a 1-row decode step.
 *
 * Row exactness: every row is computed with the same sequence of operations whatever M is and
 * however rows and columns are grouped or split across threads (the accumulation scheme depends on
 * the weight's shape only, never on M; then a fixed horizontal sum and a scalar tail). A token's logits then
 * do not depend on how many rows share the pass — a K+1 verify row equals a 1-row decode step
 * bit for bit, which keeps greedy speculative output identical to greedy plain output.
 */
#include <immintrin.h>
#include <stdint.h>

#define MG 6            /* activation rows per group */
#define LONG_K 4096     /* rows longer than this use the single-accumulator scheme */

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

/* Scheme D (K <= LONG_K): two 8-lane accumulators per output, over k ≡ 0..7 and 8..15 (mod 16).
   Scheme S (K > LONG_K): one 8-lane accumulator per output, over k in steps of 8; blocking NB
   weight rows lets one activation load (from L2, since long rows do not fit L1) feed NB FMAs.
   Either way an output is the same sequence of operations for any NB, MM or thread split. */
#define KERNEL_D(NB, MM)                                                                          \
    static void d_##NB##_##MM(const float *x, const int8_t *w, const float *scale, float *y,      \
                              long N, long K, long n) {                                           \
        __m256 a0[NB][MM], a1[NB][MM];                                                           \
        for (int j = 0; j < NB; j++)                                                             \
            for (int m = 0; m < MM; m++) a0[j][m] = a1[j][m] = _mm256_setzero_ps();              \
        long kv = K - K % 16, k = 0;                                                             \
        for (; k < kv; k += 16)                                                                  \
            for (int j = 0; j < NB; j++) {                                                       \
                __m256 w0 = widen8(w + (n + j) * K + k), w1 = widen8(w + (n + j) * K + k + 8);   \
                for (int m = 0; m < MM; m++) {                                                   \
                    a0[j][m] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + m * K + k), a0[j][m]);   \
                    a1[j][m] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + m * K + k + 8), a1[j][m]); \
                }                                                                                \
            }                                                                                    \
        for (int j = 0; j < NB; j++)                                                             \
            for (int m = 0; m < MM; m++) {                                                       \
                float sum = hsum(_mm256_add_ps(a0[j][m], a1[j][m]));                             \
                for (long t = kv; t < K; t++) sum += x[m * K + t] * (float)w[(n + j) * K + t];   \
                y[m * N + n + j] = sum * scale[n + j];                                           \
            }                                                                                    \
    }

#define KERNEL_S(NB, MM)                                                                          \
    static void s_##NB##_##MM(const float *x, const int8_t *w, const float *scale, float *y,      \
                              long N, long K, long n) {                                           \
        __m256 acc[NB][MM];                                                                      \
        for (int j = 0; j < NB; j++)                                                             \
            for (int m = 0; m < MM; m++) acc[j][m] = _mm256_setzero_ps();                        \
        long kv = K - K % 8, k = 0;                                                              \
        for (; k < kv; k += 8) {                                                                 \
            __m256 wv[NB];                                                                       \
            for (int j = 0; j < NB; j++) wv[j] = widen8(w + (n + j) * K + k);                    \
            for (int m = 0; m < MM; m++) {                                                       \
                __m256 xv = _mm256_loadu_ps(x + m * K + k);                                      \
                for (int j = 0; j < NB; j++) acc[j][m] = _mm256_fmadd_ps(wv[j], xv, acc[j][m]);  \
            }                                                                                    \
        }                                                                                        \
        for (int j = 0; j < NB; j++)                                                             \
            for (int m = 0; m < MM; m++) {                                                       \
                float sum = hsum(acc[j][m]);                                                     \
                for (long t = kv; t < K; t++) sum += x[m * K + t] * (float)w[(n + j) * K + t];   \
                y[m * N + n + j] = sum * scale[n + j];                                           \
            }                                                                                    \
    }

KERNEL_D(1, 1) KERNEL_D(1, 2) KERNEL_D(1, 3) KERNEL_D(1, 4) KERNEL_D(1, 5) KERNEL_D(1, 6)
KERNEL_S(4, 1) KERNEL_S(1, 1) KERNEL_S(4, 2) KERNEL_S(1, 2) KERNEL_S(3, 3) KERNEL_S(1, 3)
KERNEL_S(3, 4) KERNEL_S(1, 4) KERNEL_S(2, 5) KERNEL_S(1, 5) KERNEL_S(2, 6) KERNEL_S(1, 6)

typedef void (*blk_fn)(const float *, const int8_t *, const float *, float *, long, long, long);
struct scheme { blk_fn wide[MG + 1], narrow[MG + 1]; int width[MG + 1]; long tile, group; };
static const struct scheme D = {{0, d_1_1, d_1_2, d_1_3, d_1_4, d_1_5, d_1_6},
                                {0, d_1_1, d_1_2, d_1_3, d_1_4, d_1_5, d_1_6}, {0, 1, 1, 1, 1, 1, 1}, 64, 5};
static const struct scheme S = {{0, s_4_1, s_4_2, s_3_3, s_3_4, s_2_5, s_2_6},
                                {0, s_1_1, s_1_2, s_1_3, s_1_4, s_1_5, s_1_6}, {0, 4, 4, 3, 3, 2, 2}, 32, 6};

int verispec_int8_gemm(const float *x, const int8_t *w, const float *scale, float *y,
                       long M, long N, long K, int threads) {
    const struct scheme *sc = K > LONG_K ? &S : &D;     /* chosen by the weight's shape, never by M */
    long tiles = (N + sc->tile - 1) / sc->tile;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (long t = 0; t < tiles; t++) {
        long n0 = t * sc->tile, n1 = n0 + sc->tile < N ? n0 + sc->tile : N;
        for (long m0 = 0; m0 < M; m0 += sc->group) {      /* D: 6 rows would spill registers */
            long mm = M - m0 < sc->group ? M - m0 : sc->group;
            long nb = sc->width[mm], n = n0;
            for (; n + nb <= n1; n += nb) sc->wide[mm](x + m0 * K, w, scale, y + m0 * N, N, K, n);
            for (; n < n1; n++) sc->narrow[mm](x + m0 * K, w, scale, y + m0 * N, N, K, n);
        }
    }
    return 0;
}

/* ---------------------------------------------------------------------------------------------
 * int4: y[m, n] = Σ_g ( scale[n, g] · Σ_{k in g} q[n, k] · x[m, k] + min[n, g] · Σ_{k in g} x[m, k] )
 * with q in 0..15, groups of 32 along k, packed 16 bytes per group: byte j = q[j] | q[j + 16] << 4.
 * An affine 16-level grid per group of 32 is exactly how Q4_K GGUF weights are stored, so such
 * weights run in int4 with no loss against the file. Same row-exactness rule as above: each output
 * is one fixed sequence of operations whatever M is.
 */
#define G4 32
#define MG4 4

static inline void unpack32(const uint8_t *p, __m256 w[4]) {
    const __m128i mask = _mm_set1_epi8(0x0F);
    __m128i b = _mm_loadu_si128((const __m128i *)p);
    __m128i lo = _mm_and_si128(b, mask), hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
    w[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
    w[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
    w[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
    w[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
}

#define KERNEL4(MM)                                                                                \
    static void q4_##MM(const float *x, const float *xs, const uint8_t *q, const float *sc,        \
                        const float *mn, float *y, long N, long K, long n) {                       \
        long G = K / G4;                                                                           \
        __m256 acc[MM];                                                                            \
        for (int m = 0; m < MM; m++) acc[m] = _mm256_setzero_ps();                                 \
        const uint8_t *row = q + n * (K / 2);                                                      \
        for (long g = 0; g < G; g++) {                                                             \
            __m256 w[4];                                                                           \
            unpack32(row + g * 16, w);                                                             \
            __m256 s = _mm256_set1_ps(sc[n * G + g]);                                              \
            for (int m = 0; m < MM; m++) {                                                         \
                const float *xr = x + m * K + g * G4;                                              \
                __m256 part = _mm256_mul_ps(w[0], _mm256_loadu_ps(xr));                            \
                part = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xr + 8), part);                       \
                part = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xr + 16), part);                      \
                part = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xr + 24), part);                      \
                acc[m] = _mm256_fmadd_ps(part, s, acc[m]);                                         \
            }                                                                                      \
        }                                                                                          \
        for (int m = 0; m < MM; m++) {                                                             \
            float sum = hsum(acc[m]);                                                              \
            for (long g = 0; g < G; g++) sum += mn[n * G + g] * xs[m * G + g];                     \
            y[m * N + n] = sum;                                                                    \
        }                                                                                          \
    }

KERNEL4(1)
KERNEL4(2)
KERNEL4(3)
KERNEL4(4)

typedef void (*q4_fn)(const float *, const float *, const uint8_t *, const float *, const float *, float *,
                      long, long, long);
static const q4_fn Q4[MG4 + 1] = {0, q4_1, q4_2, q4_3, q4_4};

/* xs: caller-provided scratch of M × K/32 floats (per-group sums of each activation row). */
int verispec_int4_gemm(const float *x, const uint8_t *q, const float *scale, const float *mins, float *xs,
                       float *y, long M, long N, long K, int threads) {
    if (K % G4) return -1;
    long G = K / G4;
    for (long m = 0; m < M; m++)
        for (long g = 0; g < G; g++) {
            float s = 0.0f;
            for (long t = 0; t < G4; t++) s += x[m * K + g * G4 + t];
            xs[m * G + g] = s;
        }
    long tiles = (N + 63) / 64;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (long t = 0; t < tiles; t++) {
        long n0 = t * 64, n1 = n0 + 64 < N ? n0 + 64 : N;
        for (long m0 = 0; m0 < M; m0 += MG4) {
            long mm = M - m0 < MG4 ? M - m0 : MG4;
            for (long n = n0; n < n1; n++) Q4[mm](x + m0 * K, xs + m0 * G, q, scale, mins, y + m0 * N, N, K, n);
        }
    }
    return 0;
}

/* Lets the loader check that the library it opened is this file's build. */
int verispec_kernels_abi(void) { return 5; }
