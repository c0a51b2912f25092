/* Weight-only quantized matmuls for decode and verify shapes: int8 per channel, int4 per group.
 *
 * int8: y (M, N) = x (M, K) · dequant(w)ᵀ, with w int8 (N, K) and per-output-channel fp32 scales:
 *   y[m, n] = scale[n] · Σ_k x[m, k] · w[n, k]        (fp32 activations, fp32 accumulation)
 *
 * The weight is packed k-major in blocks of 16 output columns (kernels.pack_int8): for each k the 16
 * weights of a block are 16 contiguous bytes. A step widens them to two 8-lane fp32 vectors once,
 * broadcasts x[m, k] for each activation row m and does one FMA per (row, vector): a weight comes
 * from memory once per pass, and a K+1-row verify pass is bound by FMA throughput (M FMAs per 8
 * weights) rather than by loads. A 1-row decode step is bound by reading the weights from memory.
 *
 * Row exactness: every output is two chains of FMAs (even and odd k, in order), their sum, then one
 * multiply by its scale — the same sequence of operations whatever M is and however rows and columns are
 * grouped or split across threads. A token's logits then do not depend on how many rows share the
 * pass: a K+1 verify row equals a 1-row decode step bit for bit, which keeps greedy speculative
 * output identical to greedy plain output.
 */
#include <immintrin.h>
#include <stdint.h>

#define BLK 16          /* output columns per packed block */
#define MG 6            /* activation rows per group: at most 12 accumulators + 2 registers */
#define U _Pragma("GCC unroll 16")
#define PF 32           /* prefetch distance in k steps (32 × 16 bytes ahead of the loads) */

/* Packed weight wp: (ceil(N/16), K, 16) int8, zero rows past N; wp[(b·K + k)·16 + j] = w[16b + j, k]. */
static inline __m256 widen8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

/* NV 8-column vectors from column c (a multiple of 8) for MM activation rows. Two accumulators per
   output, over even and odd k, keep enough independent FMA chains in flight; y = (even + odd) · scale. */
#define KERNEL_P(NV, MM)                                                                          \
    static void p_##NV##_##MM(const float *x, const int8_t *wp, const float *scale, float *y,     \
                              long N, long K, long c) {                                           \
        const int8_t *bp[NV];                                                                    \
        U for (int v = 0; v < NV; v++) {                                                         \
            long cv = c + 8 * v;                                                                 \
            bp[v] = wp + (cv / BLK) * K * BLK + cv % BLK;                                        \
        }                                                                                        \
        __m256 acc[2][NV][MM];                                                                   \
        U for (int h = 0; h < 2; h++) U for (int v = 0; v < NV; v++)                             \
            U for (int m = 0; m < MM; m++) acc[h][v][m] = _mm256_setzero_ps();                   \
        long k = 0;                                                                              \
        for (; k + 2 <= K; k += 2) {                                                             \
            U for (int v = 0; v < NV; v += 2)                                                    \
                _mm_prefetch((const char *)(bp[v] + (k + PF) * BLK), _MM_HINT_T0);               \
            U for (int h = 0; h < 2; h++) {                                                      \
                __m256 wv[NV];                                                                   \
                U for (int v = 0; v < NV; v++) wv[v] = widen8(bp[v] + (k + h) * BLK);            \
                U for (int m = 0; m < MM; m++) {                                                 \
                    __m256 xb = _mm256_broadcast_ss(x + m * K + k + h);                          \
                    U for (int v = 0; v < NV; v++)                                               \
                        acc[h][v][m] = _mm256_fmadd_ps(wv[v], xb, acc[h][v][m]);                 \
                }                                                                                \
            }                                                                                    \
        }                                                                                        \
        if (k < K) {                                                                             \
            __m256 wv[NV];                                                                       \
            U for (int v = 0; v < NV; v++) wv[v] = widen8(bp[v] + k * BLK);                      \
            U for (int m = 0; m < MM; m++) {                                                     \
                __m256 xb = _mm256_broadcast_ss(x + m * K + k);                                  \
                U for (int v = 0; v < NV; v++) acc[0][v][m] = _mm256_fmadd_ps(wv[v], xb, acc[0][v][m]); \
            }                                                                                    \
        }                                                                                        \
        U for (int v = 0; v < NV; v++) {                                                         \
            long cv = c + 8 * v, left = N - cv;                                                  \
            __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(left < 8 ? (int)left : 8),       \
                                              _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));        \
            __m256 sc = _mm256_maskload_ps(scale + cv, mask);                                    \
            U for (int m = 0; m < MM; m++)                                                       \
                _mm256_maskstore_ps(y + m * N + cv, mask,                                        \
                                    _mm256_mul_ps(_mm256_add_ps(acc[0][v][m], acc[1][v][m]), sc)); \
        }                                                                                        \
    }

KERNEL_P(4, 1) KERNEL_P(2, 1) KERNEL_P(2, 2) KERNEL_P(2, 3) KERNEL_P(1, 4) KERNEL_P(1, 5) KERNEL_P(1, 6)

typedef void (*blk_fn)(const float *, const int8_t *, const float *, float *, long, long, long);
/* By rows in a group: 16 columns at a time up to 3 rows, 8 (twice per block) for 4 … 6 rows. */
static const blk_fn BY_ROWS[MG + 1] = {0, p_2_1, p_2_2, p_2_3, p_1_4, p_1_5, p_1_6};
static const long COLS[MG + 1] = {0, 16, 16, 16, 8, 8, 8};

#define TILE 64         /* columns per thread work item */

int verispec_int8_gemm(const float *x, const int8_t *wp, const float *scale, float *y,
                       long M, long N, long K, int threads) {
    long npad = (N + BLK - 1) / BLK * BLK;
    long tiles = (npad + TILE - 1) / TILE, groups = (M + MG - 1) / MG;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (long t = 0; t < tiles; t++) {
        long c0 = t * TILE, c1 = c0 + TILE < npad ? c0 + TILE : npad, c = c0;
        if (M == 1)                              /* a decode step: 32 columns at a time */
            for (; c + 32 <= c1; c += 32) p_4_1(x, wp, scale, y, N, K, c);
        for (; c < c1; c += BLK)                 /* each 16-column block, rows in near-equal groups */
            for (long g = 0, m0 = 0; g < groups; g++) {
                long mm = (M - m0) / (groups - g) + ((M - m0) % (groups - g) != 0);
                for (long cc = c; cc < c + BLK; cc += COLS[mm])
                    BY_ROWS[mm](x + m0 * K, wp, scale, y + m0 * N, N, K, cc);
                m0 += mm;
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
static inline float hsum(__m256 v) {
    __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    __m128 sh = _mm_movehdup_ps(lo);
    __m128 s = _mm_add_ps(lo, sh);
    sh = _mm_movehl_ps(sh, s);
    return _mm_cvtss_f32(_mm_add_ss(s, sh));
}

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
int verispec_kernels_abi(void) { return 6; }
