/* The int4 and int6 matmuls on AMX tiles (the `amx` variant: AMX-TILE and AMX-INT8 beside AVX512_BF16):
 * the same integers and the same fp32 steps as gemm4.c's and gemm6.c's AVX-512 kernels, so the same
 * bits, for passes of AMX4_MIN_ROWS / AMX6_MIN_ROWS rows and more (prefill, wide verify passes); fewer
 * rows take the vector kernels.
 *
 * A group's integer sums I[m, n, g] of 16 rows and 16 columns are one tile product: tdpbssd multiplies
 * an A tile of 16 rows × 32 int8 (the rows' q8 of group g, in Q8_ORDER, read in place with the row
 * stride K) by a B tile of 8 rows × 64 bytes (B[i][4c + t] = q[c, the k at stored position 4i + t], a
 * weight level 0 … 15 as an int8) into a C tile of 16 × 16 int32: C[m][c] = I[m, c, g], the exact sum
 * vpdpbusd forms. gemm4.c's words give B directly: (word & 0x0F0F0F0F) of chunk j is B row 2j and
 * ((word >> 4) & 0x0F0F0F0F) row 2j + 1. A super-block's B tiles are unpacked once for up to PANEL sweeps
 * of 16 rows; each sweep's eight C tiles are stored to memory and scaled row by row in zmm registers
 * (lane = column) in the AVX-512 kernel's order: per group isc = float(I) · float(sc), sa = fma(isc, s8,
 * sa), sm = fma(m, X, sm); per super-block acc = fma(d, sa, acc), acc = fma(−dmin, sm, acc). A last sweep
 * of fewer than 16 rows reads 16 in place (q8 has room for them: kernels.h) and scales only its own; the
 * sums of the rows past M are never read.
 *
 * Measured on a 2-core Xeon with AMX (docs/results/xeon/kernel.json, docs/PERFORMANCE_LOG.md): the 1.5B's
 * int4 matmuls of 16–72 rows run 1.2–1.35x the AVX-512 kernel's speed; at 8 rows they ran slower, hence
 * AMX4_MIN_ROWS. The scaling bounds it, not the tile products: a group's four fp32 steps per row and
 * column are the same work on either path, and the tile work (a product and a 1 KB store of its sums per
 * 16 × 16 outputs) and the vector work did not overlap in any order tried (the scaling of one sweep
 * issued between the products of the next and their stores ran slower).
 *
 * int6 (Q6_K) weighs half-groups of 16 by their own scales, so a tile product covers one half-group: A
 * 16 rows × 16 int8 (in place as above), B 4 rows × 64 bytes unpacked from gemm6.c's words as its
 * AVX-512 kernel unpacks them, less 32 per byte (q − 32 fits an int8), so that C[m][c] is I − 32 Q, the
 * integer that kernel starts at −32 Q and adds to. Each group's two C tiles are then joined and scaled
 * row by row in its order: J = fma(float(sc0), float(I0'), float(sc1) · float(I1')), acc = fma(J, d · s8,
 * acc). The 1.5B's int6 matmuls (its LM head, half its down projections) ran 1.15x the vector kernel's
 * speed at 16 rows and 1.25–1.3x at 32–64; at 12 rows the two were even, hence AMX6_MIN_ROWS = 13.
 *
 * Linux hands a process the tile state only on request (arch_prctl ARCH_REQ_XCOMP_PERM):
 * verispec_amx_enable asks for it once, and the tile path runs only after it was granted. Every
 * thread loads the tile configuration (a constant: built on the stack, gcc may load it before the
 * stores that fill it — ggml-org/llama.cpp#20824) at the start of each matmul and releases the tiles
 * at its end.
 */
#include "kernels.h"

#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
#include <errno.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#define PANEL 4                 /* 16-row sweeps per panel: a super-block's B tiles serve them all */

static int amx_granted;

int verispec_amx_enable(void) {
    if (!amx_granted && syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)) return errno ? errno : -1;
    amx_granted = 1;
    return 0;
}

/* Palette 1. Tiles 0 … 3: C, 16 rows × 16 int32; 4, 5: A, 16 rows × 32 int8; 6, 7: B, 8 rows × 64 bytes. */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;
static const tile_config AMX4 __attribute__((aligned(64))) = {
    .palette = 1,
    .colsb = {64, 64, 64, 64, 32, 32, 64, 64},
    .rows = {16, 16, 16, 16, 16, 16, 8, 8},
};

/* A super-block's gn groups of sums, rows 0 … R-1, into acc (lane = column), in gemm4.c's order. */
static inline __attribute__((always_inline)) void scale_rows(
        int32_t (*isum)[16][16], const __m512 *scf, const __m512 *mf, __m512 dv, __m512 ndmin, const float *s8,
        const float *xs, long G, long R, long gn, __m512 *acc) {
    for (long r = 0; r < R; r++) {
        const float *s8r = s8 + r * G, *xsr = xs + r * G;
        __m512 sa = _mm512_setzero_ps(), sm = _mm512_setzero_ps();
        for (long gi = 0; gi < gn; gi++) {                   /* float(I) · float(sc) is I · sc, exact */
            __m512 isc = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_load_si512(isum[gi][r])), scf[gi]);
            sa = _mm512_fmadd_ps(isc, _mm512_set1_ps(s8r[gi]), sa);
            sm = _mm512_fmadd_ps(mf[gi], _mm512_set1_ps(xsr[gi]), sm);
        }
        acc[r] = _mm512_fmadd_ps(dv, sa, acc[r]);
        acc[r] = _mm512_fmadd_ps(ndmin, sm, acc[r]);
    }
}

/* B tiles of super-block s of block b: gn groups of 8 rows × 64 bytes. */
static inline void unpack_b(const uint32_t *wp, long G, long b, long s, long gn, int32_t (*bt)[8][16]) {
    const __m512i lo4 = _mm512_set1_epi32(0x0F0F0F0F);
    for (long gi = 0; gi < gn; gi++) {
        const uint32_t *wg = wp + (b * G + 8 * s + gi) * 64;
        _mm_prefetch((const char *)(wg + PF4 * 64), _MM_HINT_T1);
        _mm_prefetch((const char *)(wg + PF4 * 64 + 16), _MM_HINT_T1);
        _mm_prefetch((const char *)(wg + PF4 * 64 + 32), _MM_HINT_T1);
        _mm_prefetch((const char *)(wg + PF4 * 64 + 48), _MM_HINT_T1);
        for (int j = 0; j < 4; j++) {
            __m512i d = _mm512_loadu_si512((const void *)(wg + 16 * j));
#ifdef VERISPEC_BROKEN_AMX_B     /* tests only: chunk 0's two B rows swapped, a layout slip they must catch */
            int lo_row = 2 * j + (j == 0), hi_row = 2 * j + (j != 0);
#else
            int lo_row = 2 * j, hi_row = 2 * j + 1;
#endif
            _mm512_store_si512((void *)bt[gi][lo_row], _mm512_and_si512(d, lo4));
            _mm512_store_si512((void *)bt[gi][hi_row], _mm512_and_si512(_mm512_srli_epi32(d, 4), lo4));
        }
    }
}

/* The sums of gn groups for one 16-row sweep whose group-gi A tile starts at a + 32 gi (row stride
   astride) into isum: four products, then their four stores (a store waits for its product). */
static inline void sweep_sums(const int8_t *a, long astride, long gn, int32_t (*bt)[8][16], int32_t (*isum)[16][16]) {
    long gi = 0;
    for (; gi + 4 <= gn; gi += 4) {
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
        _tile_loadd(6, bt[gi], 64); _tile_loadd(4, a + 32 * gi, astride);
        _tile_loadd(7, bt[gi + 1], 64); _tile_loadd(5, a + 32 * gi + 32, astride);
        _tile_dpbssd(0, 4, 6); _tile_dpbssd(1, 5, 7);
        _tile_loadd(6, bt[gi + 2], 64); _tile_loadd(4, a + 32 * gi + 64, astride);
        _tile_loadd(7, bt[gi + 3], 64); _tile_loadd(5, a + 32 * gi + 96, astride);
        _tile_dpbssd(2, 4, 6); _tile_dpbssd(3, 5, 7);
        _tile_stored(0, isum[gi], 64); _tile_stored(1, isum[gi + 1], 64);
        _tile_stored(2, isum[gi + 2], 64); _tile_stored(3, isum[gi + 3], 64);
    }
    for (; gi < gn; gi++) {
        _tile_zero(0);
        _tile_loadd(6, bt[gi], 64); _tile_loadd(4, a + 32 * gi, astride);
        _tile_dpbssd(0, 4, 6);
        _tile_stored(0, isum[gi], 64);
    }
}

/* The int6 matmul's tiles (gemm6.c's Q6_K layout). Its scales weigh half-groups of 16, so each tile
   product covers one half-group: A 16 rows × 16 int8, B 4 rows × 64 bytes. B holds q − 32 (−32 … 31),
   so a product is I − 32 Q itself, the integer gemm6.c's AVX-512 kernel forms. Tiles 0 … 3: C; 4, 5: A;
   6, 7: B. */
static const tile_config AMX6 __attribute__((aligned(64))) = {
    .palette = 1,
    .colsb = {64, 64, 64, 64, 16, 16, 64, 64},
    .rows = {16, 16, 16, 16, 16, 16, 4, 4},
};

/* B tiles of super-block s of block b: gn groups of 8 rows (half-group 0: rows 0 … 3, 1: rows 4 … 7),
   each byte q − 32; gemm6.c's words give q as its AVX-512 kernel unpacks them. */
static inline void unpack_b6(const uint32_t *wp, long G, long b, long s, long gn, int32_t (*bt)[8][16]) {
    const __m512i lo4 = _mm512_set1_epi32(0x0F0F0F0F), hi2 = _mm512_set1_epi32(0x30303030);
    const __m512i bias = _mm512_set1_epi8(32);
    for (long gi = 0; gi < gn; gi++) {
        const uint32_t *wg = wp + (b * G + 8 * s + gi) * W6;
        for (int l = 0; l < 6; l++) _mm_prefetch((const char *)(wg + PF6 * W6 + 16 * l), _MM_HINT_T1);
        for (int j = 0; j < 4; j++) {
            __m512i d = _mm512_loadu_si512((const void *)(wg + 16 * j));
            __m512i hw = _mm512_loadu_si512((const void *)(wg + 64 + 16 * (j / 2)));
            __m512i ha = (j & 1) ? hw : _mm512_slli_epi32(hw, 4);
            __m512i hb = (j & 1) ? _mm512_srli_epi32(hw, 2) : _mm512_slli_epi32(hw, 2);
            __m512i lo = _mm512_or_si512(_mm512_and_si512(d, lo4), _mm512_and_si512(ha, hi2));
            __m512i hi = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(d, 4), lo4), _mm512_and_si512(hb, hi2));
#ifdef VERISPEC_BROKEN_AMX_B6    /* tests only: no −32 bias on chunk 3's high weights, a slip they must catch */
            __m512i hbias = j == 3 ? _mm512_setzero_si512() : bias;
#else
            __m512i hbias = bias;
#endif
            _mm512_store_si512((void *)bt[gi][2 * j], _mm512_sub_epi8(lo, bias));
            _mm512_store_si512((void *)bt[gi][2 * j + 1], _mm512_sub_epi8(hi, hbias));
        }
    }
}

/* The half-group sums of gn groups for one 16-row sweep whose group-gi A tiles start at a + 32 gi and
   a + 32 gi + 16 (row stride astride) into isum[2 gi] and isum[2 gi + 1]: two groups' four products,
   then their four stores. */
static inline void sweep_sums6(const int8_t *a, long astride, long gn, int32_t (*bt)[8][16], int32_t (*isum)[16][16]) {
    long gi = 0;
    for (; gi + 2 <= gn; gi += 2) {
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
        _tile_loadd(6, bt[gi][0], 64); _tile_loadd(4, a + 32 * gi, astride);
        _tile_loadd(7, bt[gi][4], 64); _tile_loadd(5, a + 32 * gi + 16, astride);
        _tile_dpbssd(0, 4, 6); _tile_dpbssd(1, 5, 7);
        _tile_loadd(6, bt[gi + 1][0], 64); _tile_loadd(4, a + 32 * gi + 32, astride);
        _tile_loadd(7, bt[gi + 1][4], 64); _tile_loadd(5, a + 32 * gi + 48, astride);
        _tile_dpbssd(2, 4, 6); _tile_dpbssd(3, 5, 7);
        _tile_stored(0, isum[2 * gi], 64); _tile_stored(1, isum[2 * gi + 1], 64);
        _tile_stored(2, isum[2 * gi + 2], 64); _tile_stored(3, isum[2 * gi + 3], 64);
    }
    if (gi < gn) {
        _tile_zero(0); _tile_zero(1);
        _tile_loadd(6, bt[gi][0], 64); _tile_loadd(4, a + 32 * gi, astride);
        _tile_loadd(7, bt[gi][4], 64); _tile_loadd(5, a + 32 * gi + 16, astride);
        _tile_dpbssd(0, 4, 6); _tile_dpbssd(1, 5, 7);
        _tile_stored(0, isum[2 * gi], 64); _tile_stored(1, isum[2 * gi + 1], 64);
    }
}

/* A super-block's gn groups of half-group sums, rows 0 … R-1, into acc, in gemm6.c's AVX-512 order: per
   group J = fma(sc0, float(I0'), sc1 · float(I1')), acc = fma(J, d · s8, acc). */
static inline __attribute__((always_inline)) void scale_rows6(
        int32_t (*isum)[16][16], const __m512 *sc0f, const __m512 *sc1f, __m512 dv, const float *s8, long G, long R,
        long gn, __m512 *acc) {
    for (long r = 0; r < R; r++) {
        const float *s8r = s8 + r * G;
        __m512 a = acc[r];
        for (long gi = 0; gi < gn; gi++) {
            __m512 jf = _mm512_fmadd_ps(sc0f[gi], _mm512_cvtepi32_ps(_mm512_load_si512(isum[2 * gi][r])),
                                        _mm512_mul_ps(sc1f[gi], _mm512_cvtepi32_ps(_mm512_load_si512(isum[2 * gi + 1][r]))));
            a = _mm512_fmadd_ps(jf, _mm512_mul_ps(dv, _mm512_set1_ps(s8r[gi])), a);
        }
        acc[r] = a;
    }
}

/* Rows 0 … R-1 (R ≤ 16 · PANEL) of q8 (row stride K, room for R rounded up to 16) through column block b
   -> y (rows of N): int4 (six = 0; scales: gs, supers: ss, xs the groups' sums) or int6 (six = 1;
   scales: sc, supers: ds). Per super-block its B tiles and factors, then each 16-row sweep's products
   and their scaling. */
static inline __attribute__((always_inline)) void amx_rows(
        int six, const int8_t *q8, long K, const float *s8, const float *xs, const uint32_t *wp, const void *scales,
        const uint16_t *supers, float *y, long N, long G, long b, long R) {
    static __thread int32_t isum[16][16][16] __attribute__((aligned(64)));    /* a sweep's (half-)group sums */
    static __thread int32_t bt[8][8][16] __attribute__((aligned(64)));        /* a super-block's B tiles */
    static __thread __m512 acc[16 * PANEL];
    const long S = (G + 7) / 8, sweeps = (R + 15) / 16, last = R - 16 * (sweeps - 1);
    for (long r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (long s = 0; s < S; s++) {
        long gn = G - 8 * s < 8 ? G - 8 * s : 8;
        __m512 f0[8], f1[8], dv, ndmin = _mm512_setzero_ps();   /* int4: sc, m, d, −dmin; int6: sc0, sc1, d */
        if (six) {
            unpack_b6(wp, G, b, s, gn, bt);
            for (long gi = 0; gi < gn; gi++) {
                const int8_t *sg = (const int8_t *)scales + (b * G + 8 * s + gi) * 32;
                f0[gi] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)sg)));
                f1[gi] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(sg + 16))));
            }
            dv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(supers + (b * S + s) * 16)));
        } else {
            unpack_b(wp, G, b, s, gn, bt);
            for (long gi = 0; gi < gn; gi++) {
                const uint8_t *gg = (const uint8_t *)scales + (b * G + 8 * s + gi) * 32;
                f0[gi] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)gg)));
                f1[gi] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(gg + 16))));
            }
            const uint16_t *sg = supers + (b * S + s) * 32;
            dv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)sg));
            ndmin = _mm512_sub_ps(_mm512_setzero_ps(), _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sg + 16))));
        }
        for (long j = 0; j < sweeps; j++) {
            long r0 = 16 * j, rows = j < sweeps - 1 ? 16 : last;     /* a short sweep's products read 16 rows */
            const int8_t *a = q8 + r0 * K + 256 * s;
            const float *s8r = s8 + r0 * G + 8 * s;
            if (six) {
                sweep_sums6(a, K, gn, bt, isum);
                if (gn == 8)                              /* a whole super-block: the loop unrolled */
                    scale_rows6(isum, f0, f1, dv, s8r, G, rows, 8, acc + r0);
                else
                    scale_rows6(isum, f0, f1, dv, s8r, G, rows, gn, acc + r0);
            } else {
                sweep_sums(a, K, gn, bt, isum);
                if (gn == 8)
                    scale_rows(isum, f0, f1, dv, ndmin, s8r, xs + r0 * G + 8 * s, G, rows, 8, acc + r0);
                else
                    scale_rows(isum, f0, f1, dv, ndmin, s8r, xs + r0 * G + 8 * s, G, rows, gn, acc + r0);
            }
        }
    }
    long c = 16 * b, left = N - c;
    __mmask16 k = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
    for (long r = 0; r < R; r++) _mm512_mask_storeu_ps(y + r * N + c, k, acc[r]);
}

/* Every column block of y (M, N) in panels of up to 16 · PANEL rows (amx_rows' arguments), the tiles as
   cfg. */
static inline __attribute__((always_inline)) void amx_gemm(
        int six, const tile_config *cfg, const int8_t *q8, const float *s8, const float *xs, const uint32_t *wp,
        const void *scales, const uint16_t *supers, float *y, long M, long N, long K) {
    long G = K / 32, blocks = (N + 15) / 16;
    _tile_loadconfig(cfg);
#pragma omp for schedule(static)
    for (long b = 0; b < blocks; b++)
        for (long m0 = 0; m0 < M; m0 += 16 * PANEL)
            amx_rows(six, q8 + m0 * K, K, s8 + m0 * G, six ? xs : xs + m0 * G, wp, scales, supers, y + m0 * N, N,
                     G, b, M - m0 < 16 * PANEL ? M - m0 : 16 * PANEL);
    _tile_release();
}

int vs_int6_amx_ws(const int8_t *q8, const float *s8, const uint32_t *wp, const int8_t *sc, const uint16_t *ds,
                   float *y, long M, long N, long K) {
    if (!amx_granted || M < AMX6_MIN_ROWS) return 0;
    amx_gemm(1, &AMX6, q8, s8, 0, wp, sc, ds, y, M, N, K);
    return 1;
}

int vs_int4_amx_ws(const int8_t *q8, const float *s8, const float *xs, const uint32_t *wp, const uint8_t *gs,
                   const uint16_t *ss, float *y, long M, long N, long K) {
    if (!amx_granted || M < AMX4_MIN_ROWS) return 0;
    amx_gemm(0, &AMX4, q8, s8, xs, wp, gs, ss, y, M, N, K);
    return 1;
}

#else
int verispec_amx_enable(void) { return -1; }
int vs_int4_amx_ws(const int8_t *q8, const float *s8, const float *xs, const uint32_t *wp, const uint8_t *gs,
                   const uint16_t *ss, float *y, long M, long N, long K) {
    (void)q8, (void)s8, (void)xs, (void)wp, (void)gs, (void)ss, (void)y, (void)M, (void)N, (void)K;
    return 0;
}
int vs_int6_amx_ws(const int8_t *q8, const float *s8, const uint32_t *wp, const int8_t *sc, const uint16_t *ds,
                   float *y, long M, long N, long K) {
    (void)q8, (void)s8, (void)wp, (void)sc, (void)ds, (void)y, (void)M, (void)N, (void)K;
    return 0;
}
#endif
