/* The int8 matmul for decode, verify and prefill shapes (int8 weights per channel; int4 is gemm4.c).
 *
 * int8: y (M, N) = x (M, K) · dequant(w)ᵀ, with w int8 (N, K) in [-127, 127] and per-output-channel
 * fp32 scales. Each activation row is first rounded to 16-bit integers with one scale per row,
 *   sx[m] = max_k |x[m, k]| / 32767,   qx[m, k] = round(x[m, k] / sx[m])     (round half to even),
 * which keeps 15 bits of every row relative to its largest entry (row-relative error ≤ 1.5e-5). Then
 *   y[m, n] = (Σ_k qx[m, k] · w[n, k]) · scale[n] · sx[m]
 * with the sum done in integers (vpmaddwd: 16 products and 8 pair-sums per instruction, twice the
 * multiply-adds per instruction of an fp32 FMA), in int32 over chunks of 512 k (cannot overflow:
 * 256 · 2 · 127 · 32767 < 2³¹) and in fp32 across chunks, in order.
 *
 * The weight is packed in blocks of 16 output columns, k-pair-major (kernels.pack_int8): for each pair
 * (2p, 2p+1) a block holds 32 bytes, columns 0–7 then 8–15, each column's two weights adjacent. A step
 * widens 8 columns × 2 k to one 16 × int16 vector, broadcasts the pair (qx[m, 2p], qx[m, 2p+1]) of each
 * activation row m and does one vpmaddwd + vpaddd per (row, vector): a weight comes from memory once
 * per pass; a 1-row decode step is bound by reading the weights, a K+1-row verify pass and prefill by
 * integer multiply throughput.
 *
 * Row exactness: a row's rounding depends on that row alone, integer sums are exact, and the fp32 steps
 * (chunk sums in order, then · scale · sx) are the same sequence of operations whatever M is and
 * however rows and columns are grouped or split across threads. A token's logits then do not depend
 * on how many rows share the pass: a K+1 verify row equals a 1-row decode step bit for bit, which keeps
 * greedy speculative output identical to greedy plain output.
 */
#include "kernels.h"

#define BLK 16          /* output columns per packed block */
#define MG 6            /* activation rows per group */
#define U _Pragma("GCC unroll 16")
#ifndef PF
#define PF 16           /* prefetch distance in k pairs (16 × 32 bytes ahead of the loads) */
#endif
#ifndef PFF
#define PFF 1024        /* and into L2 1024 pairs (32 KB) ahead: keeps memory busy while several rows compute */
#endif
#define CHUNK 256       /* k pairs summed in int32 before converting to fp32 */
#define QMAX 32767.0f

/* Packed weight wp: (ceil(N/16), Kp/2, 32) int8 with Kp = K rounded up to even, zero past N and K;
   wp[(b·Kp/2 + p)·32 + 16h + 2j + t] = w[16b + 8h + j, 2p + t]. */
static inline __m256i widen16(const int8_t *p) {
    return _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p));
}

static inline __m256i pair(const int16_t *p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return _mm256_set1_epi32(v);
}

/* acc + the pair sums of w · x (vpmaddwd + vpaddd; with AVX-VNNI one vpdpwssd, the same integers). */
static inline __attribute__((always_inline)) __m256i madd_acc(__m256i acc, __m256i w, __m256i x) {
#if defined(__AVXVNNI__)
    return _mm256_dpwssd_avx_epi32(acc, w, x);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(w, x));
#endif
}

/* NV 8-column vectors from column c (a multiple of 8) for MM activation rows. */
#define KERNEL_P(NV, MM)                                                                          \
    static void p_##NV##_##MM(const int16_t *qx, const float *sx, const int8_t *wp, const float *scale, \
                              float *y, long N, long P, long c) {                                 \
        const int8_t *bp[NV];                                                                    \
        U for (int v = 0; v < NV; v++) {                                                         \
            long cv = c + 8 * v;                                                                 \
            bp[v] = wp + (cv / BLK) * P * 32 + (cv % BLK) / 8 * 16;                              \
        }                                                                                        \
        __m256 fsum[NV][MM];                                                                     \
        U for (int v = 0; v < NV; v++) U for (int m = 0; m < MM; m++) fsum[v][m] = _mm256_setzero_ps(); \
        for (long p0 = 0; p0 < P; p0 += CHUNK) {                                                 \
            long p1 = p0 + CHUNK < P ? p0 + CHUNK : P;                                           \
            __m256i acc[NV][MM];                                                                 \
            U for (int v = 0; v < NV; v++) U for (int m = 0; m < MM; m++) acc[v][m] = _mm256_setzero_si256(); \
            for (long p = p0; p < p1; p++) {                                                     \
                U for (int v = 0; v < NV; v += 2) {                                              \
                    _mm_prefetch((const char *)(bp[v] + (p + PF) * 32), _MM_HINT_T0);            \
                    _mm_prefetch((const char *)(bp[v] + (p + PFF) * 32), _MM_HINT_T1);           \
                }                                                                                \
                __m256i wv[NV];                                                                  \
                U for (int v = 0; v < NV; v++) wv[v] = widen16(bp[v] + p * 32);                  \
                U for (int m = 0; m < MM; m++) {                                                 \
                    __m256i xb = pair(qx + m * 2 * P + 2 * p);                                   \
                    U for (int v = 0; v < NV; v++)                                               \
                        acc[v][m] = madd_acc(acc[v][m], wv[v], xb);                              \
                }                                                                                \
            }                                                                                    \
            U for (int v = 0; v < NV; v++) U for (int m = 0; m < MM; m++)                        \
                fsum[v][m] = _mm256_add_ps(fsum[v][m], _mm256_cvtepi32_ps(acc[v][m]));           \
        }                                                                                        \
        U for (int v = 0; v < NV; v++) {                                                         \
            long cv = c + 8 * v, left = N - cv;                                                  \
            __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(left < 8 ? (int)left : 8),       \
                                              _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));        \
            __m256 sc = _mm256_maskload_ps(scale + cv, mask);                                    \
            U for (int m = 0; m < MM; m++)                                                       \
                _mm256_maskstore_ps(y + m * N + cv, mask,                                        \
                                    _mm256_mul_ps(_mm256_mul_ps(fsum[v][m], sc), _mm256_set1_ps(sx[m]))); \
        }                                                                                        \
    }

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define USE_ZMM 1
#else
#define USE_ZMM 0
#endif

typedef void (*blk_fn)(const int16_t *, const float *, const int8_t *, const float *, float *, long, long, long);
#if !USE_ZMM
KERNEL_P(2, 1) KERNEL_P(2, 2) KERNEL_P(2, 3) KERNEL_P(2, 4) KERNEL_P(2, 5) KERNEL_P(2, 6)
/* By rows in a group, one 16-column block at a time (measured against 8 columns for 4-6 rows, which
   keeps every accumulator in registers: 15-25 % slower, the widened weights then serve fewer rows). */
static const blk_fn BY_ROWS[MG + 1] = {0, p_2_1, p_2_2, p_2_3, p_2_4, p_2_5, p_2_6};
#endif

/* A decode step (one row) over one 16-column block, read as one stream: the block's k pairs in order,
   two pairs per step into separate accumulators so that the adds do not wait on each other, and the
   L2 prefetch PFF pairs ahead runs into the next block, which the same thread reads next. Integer
   sums are exact in any order, so a chunk's int32 total, and every fp32 step after it, are those of
   the kernels above: the same bits. */
#define ONE_ROW_STEP(MADD, ACC_T)                                                                 \
    for (long p0 = 0; p0 < P; p0 += CHUNK) {                                                     \
        long p1 = p0 + CHUNK < P ? p0 + CHUNK : P, p = p0;                                        \
        ACC_T a0 = ZERO_I, a1 = ZERO_I, b0 = ZERO_I, b1 = ZERO_I;                                 \
        for (; p + 2 <= p1; p += 2) {                                                            \
            _mm_prefetch((const char *)(bp + (p + PFF) * 32), _MM_HINT_T1);                       \
            _mm_prefetch((const char *)(bp + (p + PF) * 32), _MM_HINT_T0);                        \
            MADD(a0, a1, p);                                                                      \
            MADD(b0, b1, p + 1);                                                                  \
        }                                                                                         \
        if (p < p1) MADD(a0, a1, p);                                                              \
        FINISH_CHUNK(a0, a1, b0, b1);                                                             \
    }

/* One row to 16-bit integers: qx (Kp) with a zero past K, sx = max |x| / 32767. */
static void quantize_row(const float *x, long K, int16_t *qx, float *sx) {
    __m256 amax = _mm256_setzero_ps();
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    long k = 0;
    for (; k + 8 <= K; k += 8) amax = _mm256_max_ps(amax, _mm256_and_ps(_mm256_loadu_ps(x + k), absmask));
    float lanes[8], mx = 0.0f;
    _mm256_storeu_ps(lanes, amax);
    for (int i = 0; i < 8; i++) mx = lanes[i] > mx ? lanes[i] : mx;
    for (; k < K; k++) mx = fabsf(x[k]) > mx ? fabsf(x[k]) : mx;
    float inv = mx > 0.0f ? QMAX / mx : 0.0f;
    *sx = mx / QMAX;
    const __m256 vinv = _mm256_set1_ps(inv);
    for (k = 0; k + 16 <= K; k += 16) {
        __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + k), vinv));      /* half to even */
        __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + k + 8), vinv));
        __m256i ab = _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8);            /* back in k order */
        _mm256_storeu_si256((__m256i *)(qx + k), ab);
    }
    for (; k < K; k++) qx[k] = (int16_t)lrintf(x[k] * inv);
    if (K & 1) qx[K] = 0;
}

#if !USE_ZMM
#define ZERO_I _mm256_setzero_si256()
#define MADD8(lo, hi, q)                                                                          \
    do {                                                                                          \
        __m256i xb = pair(qx + 2 * (q));                                                          \
        lo = madd_acc(lo, widen16(bp + (q) * 32), xb);                                            \
        hi = madd_acc(hi, widen16(bp + (q) * 32 + 16), xb);                                       \
    } while (0)
#define FINISH_CHUNK(a0, a1, b0, b1)                                                              \
    do {                                                                                          \
        f0 = _mm256_add_ps(f0, _mm256_cvtepi32_ps(_mm256_add_epi32(a0, b0)));                     \
        f1 = _mm256_add_ps(f1, _mm256_cvtepi32_ps(_mm256_add_epi32(a1, b1)));                     \
    } while (0)
static void one_row(const int16_t *qx, const float *sx, const int8_t *wp, const float *scale, float *y,
                    long N, long P, long c) {
    const int8_t *bp = wp + (c / BLK) * P * 32;
    __m256 f0 = _mm256_setzero_ps(), f1 = _mm256_setzero_ps();
    ONE_ROW_STEP(MADD8, __m256i)
    __m256 fs[2] = {f0, f1};
    for (int h = 0; h < 2; h++) {
        long cv = c + 8 * h, left = N - cv;
        if (left <= 0) break;
        __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(left < 8 ? (int)left : 8),
                                          _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        __m256 sc = _mm256_maskload_ps(scale + cv, mask);
        _mm256_maskstore_ps(y + cv, mask, _mm256_mul_ps(_mm256_mul_ps(fs[h], sc), _mm256_set1_ps(sx[0])));
    }
}
#endif

#if USE_ZMM
/* AVX-512 VNNI: one zmm holds a whole 16-column block for one k pair (32 int8 widened to 32 int16,
   lane = column), and vpdpwssd does the 32 multiply-adds and the accumulation in one instruction
   (vpmaddwd + vpaddd on AVX2). The products, the int32 chunk sums (wrapping is impossible, as above),
   their conversion and the fp32 steps are the same operations on the same values as the AVX2 code
   below, so both variants give the same bits. */
#if defined(__AMX_INT8__)
#define VARIANT "amx"                  /* avx512bf16 plus the int4 matmul's wide passes on tiles (amx.c) */
#elif defined(__AVX512BF16__)
#define VARIANT "avx512bf16"           /* the same matmuls; attention.c reads bf16 caches with vdpbf16ps */
#else
#define VARIANT "avx512vnni"
#endif
static inline __m512i widen32(const int8_t *p) {
    return _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)p));
}

/* NB 16-column blocks from column c (a multiple of 16) for MM activation rows. */
#define KERNEL_Z(NB, MM)                                                                          \
    static void z_##NB##_##MM(const int16_t *qx, const float *sx, const int8_t *wp, const float *scale, \
                              float *y, long N, long P, long c) {                                 \
        const int8_t *bp[NB];                                                                    \
        U for (int v = 0; v < NB; v++) bp[v] = wp + (c / BLK + v) * P * 32;                      \
        __m512 fsum[NB][MM];                                                                     \
        U for (int v = 0; v < NB; v++) U for (int m = 0; m < MM; m++) fsum[v][m] = _mm512_setzero_ps(); \
        for (long p0 = 0; p0 < P; p0 += CHUNK) {                                                 \
            long p1 = p0 + CHUNK < P ? p0 + CHUNK : P;                                           \
            __m512i acc[NB][MM];                                                                 \
            U for (int v = 0; v < NB; v++) U for (int m = 0; m < MM; m++) acc[v][m] = _mm512_setzero_si512(); \
            for (long p = p0; p < p1; p++) {                                                     \
                __m512i wv[NB];                                                                  \
                U for (int v = 0; v < NB; v++) {                                                 \
                    _mm_prefetch((const char *)(bp[v] + (p + PF) * 32), _MM_HINT_T0);            \
                    _mm_prefetch((const char *)(bp[v] + (p + PFF) * 32), _MM_HINT_T1);           \
                    wv[v] = widen32(bp[v] + p * 32);                                             \
                }                                                                                \
                U for (int m = 0; m < MM; m++) {                                                 \
                    int32_t xp;                                                                  \
                    memcpy(&xp, qx + m * 2 * P + 2 * p, sizeof xp);                              \
                    __m512i xb = _mm512_set1_epi32(xp);                                          \
                    U for (int v = 0; v < NB; v++) acc[v][m] = _mm512_dpwssd_epi32(acc[v][m], wv[v], xb); \
                }                                                                                \
            }                                                                                    \
            U for (int v = 0; v < NB; v++) U for (int m = 0; m < MM; m++)                        \
                fsum[v][m] = _mm512_add_ps(fsum[v][m], _mm512_cvtepi32_ps(acc[v][m]));           \
        }                                                                                        \
        U for (int v = 0; v < NB; v++) {                                                         \
            long cv = c + BLK * v, left = N - cv;                                                \
            __mmask16 k = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);        \
            __m512 sc = _mm512_maskz_loadu_ps(k, scale + cv);                                    \
            U for (int m = 0; m < MM; m++)                                                       \
                _mm512_mask_storeu_ps(y + m * N + cv, k,                                         \
                                      _mm512_mul_ps(_mm512_mul_ps(fsum[v][m], sc), _mm512_set1_ps(sx[m]))); \
        }                                                                                        \
    }

#define ZERO_I _mm512_setzero_si512()
#define MADD16(acc, unused, q)                                                                    \
    do {                                                                                          \
        int32_t xp;                                                                               \
        memcpy(&xp, qx + 2 * (q), sizeof xp);                                                     \
        acc = _mm512_dpwssd_epi32(acc, widen32(bp + (q) * 32), _mm512_set1_epi32(xp));            \
    } while (0)
#define FINISH_CHUNK(a0, a1, b0, b1) (void)a1, (void)b1, f0 = _mm512_add_ps(f0, _mm512_cvtepi32_ps(_mm512_add_epi32(a0, b0)))  /* one vector a step: a1, b1 unused */
static void one_row(const int16_t *qx, const float *sx, const int8_t *wp, const float *scale, float *y,
                    long N, long P, long c) {
    const int8_t *bp = wp + (c / BLK) * P * 32;
    __m512 f0 = _mm512_setzero_ps();
    ONE_ROW_STEP(MADD16, __m512i)
    long left = N - c;
    __mmask16 k = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
    __m512 sc = _mm512_maskz_loadu_ps(k, scale + c);
    _mm512_mask_storeu_ps(y + c, k, _mm512_mul_ps(_mm512_mul_ps(f0, sc), _mm512_set1_ps(sx[0])));
}

KERNEL_Z(2, 1) KERNEL_Z(2, 2) KERNEL_Z(2, 3) KERNEL_Z(2, 4) KERNEL_Z(2, 5) KERNEL_Z(2, 6)
KERNEL_Z(1, 1) KERNEL_Z(1, 2) KERNEL_Z(1, 3) KERNEL_Z(1, 4) KERNEL_Z(1, 5) KERNEL_Z(1, 6)
/* By rows in a group: two 16-column blocks at a time, one for an odd last block. */
static const blk_fn Z_ROWS[2][MG + 1] = {{0, z_1_1, z_1_2, z_1_3, z_1_4, z_1_5, z_1_6},
                                         {0, z_2_1, z_2_2, z_2_3, z_2_4, z_2_5, z_2_6}};

/* One tile [c0, c1) of the padded columns (multiples of 16) for all M rows. */
static void int8_tile(const int16_t *qx, const float *sx, const int8_t *wp, const float *scale, float *y,
                      long M, long N, long P, long c0, long c1) {
    long c = c0, groups = (M + MG - 1) / MG;
    if (M == 1)                                  /* a decode step: one block at a time, one stream */
        for (; c < c1; c += BLK) one_row(qx, sx, wp, scale, y, N, P, c);
    for (; c < c1; c += 2 * BLK) {               /* 32 columns (or the last 16), rows in near-equal groups */
        int two = c + 2 * BLK <= c1;
        for (long g = 0, m0 = 0; g < groups; g++) {
            long mm = (M - m0) / (groups - g) + ((M - m0) % (groups - g) != 0);
            Z_ROWS[two][mm](qx + m0 * 2 * P, sx + m0, wp, scale, y + m0 * N, N, P, c);
            m0 += mm;
        }
    }
}
#else
#if defined(__AVXVNNI__)
#define VARIANT "avxvnni"              /* avx2 with vpdpbusd / vpdpwssd on ymm in the int4, int6 and int8 matmuls */
#else
#define VARIANT "avx2"
#endif
static void int8_tile(const int16_t *qx, const float *sx, const int8_t *wp, const float *scale, float *y,
                      long M, long N, long P, long c0, long c1) {
    long c = c0, groups = (M + MG - 1) / MG;
    if (M == 1)                                  /* a decode step: one block at a time, one stream */
        for (; c < c1; c += BLK) one_row(qx, sx, wp, scale, y, N, P, c);
    for (; c < c1; c += BLK)                     /* each 16-column block, rows in near-equal groups */
        for (long g = 0, m0 = 0; g < groups; g++) {
            long mm = (M - m0) / (groups - g) + ((M - m0) % (groups - g) != 0);
            BY_ROWS[mm](qx + m0 * 2 * P, sx + m0, wp, scale, y + m0 * N, N, P, c);
            m0 += mm;
        }
}
#endif

#define TILE 64         /* columns per thread work item */

void vs_quantize_rows_ws(const float *x, long M, long K, int16_t *qx, float *sx) {
#pragma omp for schedule(static)
    for (long m = 0; m < M; m++) quantize_row(x + m * K, K, qx + m * kpad(K), sx + m);
}

void vs_int8_gemm_ws(const int16_t *qx, const float *sx, const int8_t *wp, const float *scale, float *y,
                     long M, long N, long K) {
    long P = kpad(K) / 2, npad = (N + BLK - 1) / BLK * BLK, tiles = (npad + TILE - 1) / TILE;
#pragma omp for schedule(static)
    for (long t = 0; t < tiles; t++) {
        long c0 = t * TILE, c1 = c0 + TILE < npad ? c0 + TILE : npad;
        int8_tile(qx, sx, wp, scale, y, M, N, P, c0, c1);
    }
}

/* Returns 0, or -1 when the scratch buffer cannot be allocated. */
int verispec_int8_gemm(const float *x, const int8_t *wp, const float *scale, float *y,
                       long M, long N, long K, int threads) {
    int16_t *qx = malloc(sizeof(int16_t) * kpad(K) * M + sizeof(float) * M + 64);
    if (!qx) return -1;
    float *sx = (float *)(qx + kpad(K) * M);
#pragma omp parallel num_threads(threads)
    {
        vs_quantize_rows_ws(x, M, K, qx, sx);
        vs_int8_gemm_ws(qx, sx, wp, scale, y, M, N, K);
    }
    free(qx);
    return 0;
}

/* Lets the loader check that the library it opened is this build. */
int verispec_kernels_abi(void) { return ABI; }

/* The instruction-set variant this build was compiled for. */
const char *verispec_kernels_variant(void) { return VARIANT; }
