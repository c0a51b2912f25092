/* Shared by the native kernels (gemm.c, attention.c, decoder.c), which build into one library per
 * instruction-set variant (see __init__.py). Functions named vs_*_ws are OpenMP worksharing loops:
 * call them from inside a parallel region (every thread calls, each takes its share, a barrier ends
 * each loop), so one region can run a whole decoder pass. */
#ifndef VERISPEC_KERNELS_H
#define VERISPEC_KERNELS_H
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define ABI 22

static inline float hsum(__m256 v) {
    __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    __m128 sh = _mm_movehdup_ps(lo);
    __m128 s = _mm_add_ps(lo, sh);
    sh = _mm_movehl_ps(sh, s);
    return _mm_cvtss_f32(_mm_add_ss(s, sh));
}

/* Pins v to a register at this point of the code. Integer sums are associative, so the compiler is free
   to regroup a chain of 16-bit adds, and in the AVX2 int4 kernel it hoisted every row's vpmaddubsw of a
   group ahead of the adds, spilling most of them to the stack (measured: passes of 2–16 rows 5–15 %
   slower). The value, and so every bit of the result, is the same either way. */
#define keep_in_register(v) __asm__("" : "+x"(v))

/* The 4 bytes at p as one int32 (any alignment). */
static inline int32_t word32(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* rows rows of 8 columns starting at column c of y (rows of N floats), acc[m] holding row m's: the
   columns at N and beyond are left alone (a weight block's padding). */
static inline void store_cols8(float *y, long N, long c, const __m256 *acc, int rows) {
    long left = N - c;
    if (left <= 0) return;
    __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(left < 8 ? (int)left : 8),
                                      _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    for (int m = 0; m < rows; m++) _mm256_maskstore_ps(y + m * N + c, mask, acc[m]);
}

#if defined(__AVX512VNNI__)
/* acc + Σ of 4 u8 · s8 products per lane (vpdpbusd), the 4 int8 at p broadcast to every lane as the
   instruction's own memory operand ({1to16}). GCC loads a set1 of them with a separate vpbroadcastd,
   one more vector instruction per multiply; folded, the int4 and int6 matmuls of 3–16 rows ran
   1.1–1.2x faster (the same bits: the same instruction on the same values). */
static inline __attribute__((always_inline)) __m512i dpbusd_bcast(__m512i acc, __m512i w, const int8_t *p) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*(const int32_t *)p));
    return acc;
}
#endif

/* exp for x ≤ 0 (softmax arguments), Cephes' range reduction and polynomial: relative error ~1e-7.
   exp_neg on 8 lanes, exp_neg512 on 16 (AVX-512 builds): the same operations lane for lane. */
#define EXP_NEG(NAME, V, VI, P, CASTF, ROUND)                                                           \
    static inline V NAME(V x) {                                                                     \
        x = P##_max_ps(x, P##_set1_ps(-87.0f));                                                     \
        V n = ROUND(P##_mul_ps(x, P##_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); \
        V r = P##_sub_ps(x, P##_mul_ps(n, P##_set1_ps(0.693359375f)));                              \
        r = P##_sub_ps(r, P##_mul_ps(n, P##_set1_ps(-2.12194440e-4f)));                             \
        V y = P##_set1_ps(1.9875691500E-4f);                                                        \
        y = P##_fmadd_ps(y, r, P##_set1_ps(1.3981999507E-3f));                                      \
        y = P##_fmadd_ps(y, r, P##_set1_ps(8.3334519073E-3f));                                      \
        y = P##_fmadd_ps(y, r, P##_set1_ps(4.1665795894E-2f));                                      \
        y = P##_fmadd_ps(y, r, P##_set1_ps(1.6666665459E-1f));                                      \
        y = P##_fmadd_ps(y, r, P##_set1_ps(5.0000001201E-1f));                                      \
        y = P##_fmadd_ps(y, P##_mul_ps(r, r), P##_add_ps(r, P##_set1_ps(1.0f)));                    \
        VI e = P##_slli_epi32(P##_add_epi32(P##_cvtps_epi32(n), P##_set1_epi32(127)), 23);          \
        return P##_mul_ps(y, CASTF(e));                                                             \
    }
EXP_NEG(exp_neg, __m256, __m256i, _mm256, _mm256_castsi256_ps, _mm256_round_ps)
#if defined(__AVX512F__)
EXP_NEG(exp_neg512, __m512, __m512i, _mm512, _mm512_castsi512_ps, _mm512_roundscale_ps)
#endif

/* int8 matmul in two worksharing steps (gemm.c): round each row of x (M, K) to 16-bit integers with
   its own scale (qx: M × kpad(K) int16, sx: M floats), then y (M, N) = qx · wᵀ · scale · sx. */
static inline long kpad(long K) { return (K + 1) / 2 * 2; }
void vs_quantize_rows_ws(const float *x, long M, long K, int16_t *qx, float *sx);
void vs_int8_gemm_ws(const int16_t *qx, const float *sx, const int8_t *wp, const float *scale, float *y,
                     long M, long N, long K);

/* int4 matmul (gemm4.c): round each row of x (M, K) to int8 per group of 32 (q8: M × K int8 in the
   kernel's order, s8: the groups' scales, xs: their exact sums, both M × K/32), then y (M, N) from the
   packed nibbles wp, the groups' 8-bit multipliers gs and the super-blocks' fp16 factors ss. */
void vs_quantize_groups8_ws(const float *x, long M, long K, int8_t *q8, float *s8, float *xs);
/* Software prefetch into L2, PF4 groups (256 bytes of a block's weights each, 32 KB) ahead: a pass of
   several rows computes long enough per group that the hardware prefetcher alone left the memory
   idle between bursts (measured: 3 rows 44 -> 33 ms, 5 rows 50 -> 40 ms of 28 layers' matmuls; 1 KB
   ahead into L1 before). Past a block's end it fetches the next block, which the same thread takes. */
#ifndef PF4
#define PF4 128
#endif
/* The int4 and int6 kernels of the AVX2-class variants: per row count 1 … SWEPT_ROWS, 1 = a 16-column block's
   two 8-column halves in one sweep, 0 = one half per sweep (the same bits); row [0] for a pass's first group
   of rows (the block's weights from memory), [1] for the groups after it (from cache). Written only between
   kernel calls (kernels/sweeps.py). */
#define SWEPT_ROWS 6
typedef int sweep_table[2][SWEPT_ROWS + 1];
#define SWEEP_DEFAULTS(NH) {{0, 1 <= (NH), 2 <= (NH), 3 <= (NH), 4 <= (NH), 5 <= (NH), 6 <= (NH)}, \
                            {0, 1 <= (NH), 2 <= (NH), 3 <= (NH), 4 <= (NH), 5 <= (NH), 6 <= (NH)}}
/* The twelve kernels of a format (KERNEL(rows, halves per sweep)): P_1_1 … P_6_1, P_1_2 … P_6_2. */
#define SWEPT_KERNELS(KERNEL) KERNEL(1, 1) KERNEL(2, 1) KERNEL(3, 1) KERNEL(4, 1) KERNEL(5, 1) KERNEL(6, 1) \
                              KERNEL(1, 2) KERNEL(2, 2) KERNEL(3, 2) KERNEL(4, 2) KERNEL(5, 2) KERNEL(6, 2)
#define SWEPT_TABLE(P) {{0, P##_1_1, P##_2_1, P##_3_1, P##_4_1, P##_5_1, P##_6_1}, \
                        {0, P##_1_2, P##_2_2, P##_3_2, P##_4_2, P##_5_2, P##_6_2}}
/* Groups a kernel of MM rows with NH halves per sweep leaves out: none, except in a build with
   VERISPEC_BROKEN_SWEEP (tests only: the one-sweep kernels of 3 rows skip a block's last group, a slip
   the comparison of the two schedules must catch). */
#ifdef VERISPEC_BROKEN_SWEEP
#define SWEEP_SLIP(MM, NH) ((MM) == 3 && (NH) == 2)
#else
#define SWEEP_SLIP(MM, NH) 0
#endif
/* one[0 … 2·SWEPT_ROWS − 1]: rows 1 … SWEPT_ROWS of the first group, then of the later ones. With set, the
   table takes them (each 0 or 1, else -2 and nothing changes); then one gets the table's values. 0 on
   success. */
static inline int sweeps_io(sweep_table t, int *one, int set) {
    if (set) {
        for (int i = 0; i < 2 * SWEPT_ROWS; i++)
            if (one[i] != 0 && one[i] != 1) return -2;
        for (int i = 0; i < 2 * SWEPT_ROWS; i++) t[i / SWEPT_ROWS][1 + i % SWEPT_ROWS] = one[i];
    }
    for (int i = 0; i < 2 * SWEPT_ROWS; i++) one[i] = t[i / SWEPT_ROWS][1 + i % SWEPT_ROWS];
    return 0;
}
void vs_int4_gemm_ws(const int8_t *q8, const float *s8, const float *xs, const uint32_t *wp, const uint8_t *gs,
                     const uint16_t *ss, float *y, long M, long N, long K);
/* The same matmul on AMX tiles (amx.c), the same bits: returns 1 when it ran (the amx variant, the tile
   state granted, M ≥ AMX4_MIN_ROWS), else 0 and does nothing. It reads q8 in whole tiles of 16 rows, so
   q8 must have room for M rounded up to 16 rows (what lies past row M is read but never used): a buffer
   sized for M rows of int16, as decoder.c's is, holds them whenever M ≥ 8. */
#ifndef AMX4_MIN_ROWS
#define AMX4_MIN_ROWS 12
#endif
#if AMX4_MIN_ROWS < 8
#error "AMX4_MIN_ROWS below 8: decoder.c's q8 scratch would not hold whole tiles"
#endif
int vs_int4_amx_ws(const int8_t *q8, const float *s8, const float *xs, const uint32_t *wp, const uint8_t *gs,
                   const uint16_t *ss, float *y, long M, long N, long K);
/* Row `id` of the weight that layout holds (K a multiple of 32) -> out (K) float32, dequantized (an
   embedding lookup). */
void vs_int4_row(const uint32_t *wp, const uint8_t *gs, const uint16_t *ss, long id, long K, float *out);

/* int6 matmul (gemm6.c): activations rounded as for int4, then y (M, N) from the packed 6-bit words wp,
   the half-groups' int8 scales sc and the super-blocks' fp16 factors ds. qs: scratch for M × K/16 int32,
   where the vector kernels keep the half-groups' activation sums. */
#define W6 96           /* uint32 words per block and group of gemm6.c's layout: 6 × 16 */
/* Software prefetch into L2, PF6 groups (384 bytes of a block's weights each, 36 KB) ahead, as PF4. */
#ifndef PF6
#define PF6 96
#endif
/* The same matmul on AMX tiles (amx.c), the same bits, from AMX6_MIN_ROWS rows: as vs_int4_amx_ws (q8
   room for whole tiles of 16 rows). */
#ifndef AMX6_MIN_ROWS
#define AMX6_MIN_ROWS 13
#endif
#if AMX6_MIN_ROWS < 8
#error "AMX6_MIN_ROWS below 8: decoder.c's q8 scratch would not hold whole tiles"
#endif
int vs_int6_amx_ws(const int8_t *q8, const float *s8, const uint32_t *wp, const int8_t *sc, const uint16_t *ds,
                   float *y, long M, long N, long K);
void vs_int6_gemm_ws(const int8_t *q8, const float *s8, int32_t *qs, const uint32_t *wp, const int8_t *sc,
                     const uint16_t *ds, float *y, long M, long N, long K);

/* Where a layer's keys and values live: position s of batch row b, KV head h, dimension d is at
   store[tables[b · nb + s / bs] · blk_stride + h · head_stride + (s % bs) · D + d]. A static cache is
   one block per row (bs = its length); a paged cache reads its blocks in place. Stores are float32,
   or int8 when ks and vs are set: then element d of a position's key (value) vector is its int8 times
   ks (vs)[tables[…] · sc_blk_stride + h · sc_head_stride + (s % bs) · (D / sg) + d / sg], one scale
   per sg dimensions (kv_quantize). With bf16 set (and no scales) they are bfloat16 — each element the top
   16 bits of a float32 (f32_to_bf16) — with each block's elements paired in 32-bit words (bf16_key_at,
   bf16_value_at): keys pair dimensions 2p and 2p + 1 of a position, in groups of KV_KEY_GROUP positions,
   values pair positions 2m and 2m + 1 of a dimension. A bf16 block then holds a multiple of
   KV_KEY_GROUP positions (bs rounded up; blk_stride and head_stride say where blocks and heads start)
   and D is even. */
typedef struct {
    const void *k, *v;
    const float *ks, *vs;
    const int64_t *tables;
    long nb, bs, blk_stride, head_stride, sc_blk_stride, sc_head_stride, sg;
    int bf16;
} kv_view;

/* float32 -> bfloat16 bits, rounded to nearest with ties to even; a NaN becomes 0x7FC0 (torch's
   conversion, so a cache written here and one written by torch hold the same bits). */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7FC0;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
/* bf16 stores: the element index, within one block and head, of dimension d of position j's key
   (value). A load of KV_KEY_GROUP words at the key of (j, 2p) holds dimensions 2p, 2p + 1 of keys j …
   j + 15; one at the value of (2m, d) holds dimensions d … of positions 2m and 2m + 1. */
#define KV_KEY_GROUP 16
static inline long bf16_key_at(long j, long d, long D) {
    return 2 * ((j / KV_KEY_GROUP) * (D / 2) * KV_KEY_GROUP + (d / 2) * KV_KEY_GROUP + j % KV_KEY_GROUP) + d % 2;
}
static inline long bf16_value_at(long j, long d, long D) { return 2 * ((j / 2) * D + d) + j % 2; }

/* Bytes per stored element of a KV store: int8, bf16 or float32. */
static inline long kv_esize(int int8, int bf16) { return int8 ? 1 : bf16 ? 2 : (long)sizeof(float); }

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* x (n floats) -> q (n int8) and n / sg scales: per group of sg, q = round(x · 127 / max|x|) (ties to
   even) and scale = max|x| / 127 (the torch side, models/kv_cache.py, does the same operations). */
static inline void kv_quantize(const float *x, long n, long sg, int8_t *q, float *scales) {
    for (long g0 = 0; g0 < n; g0 += sg) {
        float amax = 0.0f;
        for (long i = g0; i < g0 + sg; i++) amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
        float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        for (long i = g0; i < g0 + sg; i++) {
            long v = lrintf(x[i] * inv);
            q[i] = (int8_t)(v > 127 ? 127 : v < -127 ? -127 : v);
        }
        scales[g0 / sg] = amax / 127.0f;
    }
}

/* Each query row attends over exactly its own prefix (attention.c). q(r, h) = q + r · q_rs + h · D for
   rows r = b · T + t; out (R, H, D) contiguous; scratch of threads × att_scratch(T, SP) floats with
   SP = spad(max pos + 1). Past ATT_SHARED positions a work item takes up to att_rows(T, SP) rows of
   one batch row together, so that they share each read of the cache while their scores (rows × GMAX
   × SP floats) stay within ATT_BUDGET floats per thread. Every row reads bf16 keys and values as they
   are stored (in pairs); with AVX512_BF16, below 6,144 positions the cache of a layer stays in the
   last-level cache and one row per work item is faster (measured on a Zen 4). Elsewhere rows share
   from the first position: an int8 cache is widened to float32 once per tile for all of them (on a
   Zen 2, 16 rows over 4,000 positions took 30 % less time shared than one by one). */
#define GMAX 8
#define ATT_BUDGET (1L << 17)
#if defined(__AVX512BF16__)
#define ATT_SHARED 6144
#else
#define ATT_SHARED 0
#endif
static inline long spad(long s) { return (s + 7) / 8 * 8; }
static inline long att_rows(long T, long SP) {
    long rows = SP < ATT_SHARED ? 1 : ATT_BUDGET / (GMAX * SP);
    return rows < 1 ? 1 : rows > T ? T : rows;
}
static inline long att_scratch(long T, long SP) { return att_rows(T, SP) * GMAX * (SP + 1); }
void vs_attend_ws(const float *q, long q_rs, const kv_view *kv, const int64_t *pos, float *out, long B,
                  long H, long Hkv, long T, long D, float scale, float *scratch, long SP);
#endif
