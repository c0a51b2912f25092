/* Attention for decode and verify rows: each query row attends over exactly its own prefix.
 *   q(r, h) = q + r · q_rs + h · D for rows r = b · T + t (a (B, T, H, D) tensor has q_rs = H · D; the
 *   fused decoder passes its q/k/v buffer, q_rs = (H + 2 H_kv) · D);
 *   keys and values through a kv_view (kernels.h): a static cache row or a paged sequence's blocks,
 *   read in place;
 *   pos (B, T) int64: row (b, t) sees keys 0 … pos[b, t];  out (R, H, D) contiguous (o_proj's input).
 * A work item is a run of rows of one batch row and one KV head with its G query heads: each tile of
 * key and value rows is read from memory once for all those rows and heads (a verify pass over T rows
 * at a long context reads the cache once, not T times), and each key row feeds G independent FMA
 * chains. Per row and head: scores in order over s, softmax (max,
 * exp, sum in 8 lanes then across them), then Σ_s p_s · v_s in order — a fixed sequence of operations
 * that depends only on that row's query and prefix, never on how many rows share the pass or where the
 * cache's blocks lie, so a K+1 verify row equals a 1-token decode step bit for bit. (bf16 stores pair
 * positions within a block: blocks of an odd size pair them otherwise than one contiguous cache, a
 * fixed choice of the engine's layout.) The AVX-512 build uses 16-wide vectors for the dot products and
 * the value mix (the AVX2 build 8-wide); with AVX512_BF16 a one-row work item sweeps its whole prefix
 * with its sums in registers (row_paired) instead of tile by tile, the same operations in the same order.
 */
#include "kernels.h"

#if defined(__AVX512F__)
/* AVX-512: 16 dimensions per FMA. The sums run in another order than AVX2's 8 lanes, so the two
   variants differ in the last bits here (each is row-exact on its own). */
#define VL 16
typedef __m512 vec;
#define vzero _mm512_setzero_ps
#define vload _mm512_loadu_ps
#define vstore _mm512_storeu_ps
#define vfma _mm512_fmadd_ps
#define vmul _mm512_mul_ps
#define vset1 _mm512_set1_ps
#define vsum _mm512_reduce_add_ps
#define vload8(p) _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p))))
#else
#define VL 8
typedef __m256 vec;
#define vzero _mm256_setzero_ps
#define vload _mm256_loadu_ps
#define vstore _mm256_storeu_ps
#define vfma _mm256_fmadd_ps
#define vmul _mm256_mul_ps
#define vset1 _mm256_set1_ps
#define vsum hsum
#define vload8(p) _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p))))
#endif

/* Keys and values are visited in tiles of at most KT positions inside one block when a work item has
   several rows: it runs every one of its rows over a tile before the next, so a tile is read from
   memory once per work item and then from cache. A one-row work item takes a block as one tile. Each
   row sees its own positions in ascending order either way, so the tiling never changes a bit. */
#define KT 32

/* One KV head's rows in one block of a float32 or int8 key (or value) store (kv_view): row j, dimension d
   at element j · D + d of base; int8 rows scaled per sg dimensions by sc. (bf16 stores pair their
   elements instead and have functions of their own, below.) */
typedef struct {
    const char *base;
    const float *sc;
    long D, sg;
} kv_rows;

static inline kv_rows kv_rows_at(const kv_view *kv, const void *store, const float *scales, long blk, long kh,
                                 long D) {
    long at = kv_esize(kv->ks != NULL, 0) * (blk * kv->blk_stride + kh * kv->head_stride);   /* bytes */
    kv_rows r = {(const char *)store + at, scales ? scales + blk * kv->sc_blk_stride + kh * kv->sc_head_stride : NULL,
                 D, kv->sg};
    return r;
}

enum { ROWS_F32, ROWS_INT8 };
static inline int rows_format(const kv_rows *r) { return r->sc ? ROWS_INT8 : ROWS_F32; }

/* Dimensions d … d+VL-1 of row j as float32: stored floats or int8 · its group's scale (fmt =
   rows_format(r); a hot loop passes it as a constant, so each format gets its own loop). */
static inline __attribute__((always_inline)) vec row_vec(const kv_rows *r, long j, long d, const int fmt) {
    if (fmt == ROWS_INT8)
        return vmul(vload8((const int8_t *)r->base + j * r->D + d), vset1(r->sc[j * (r->D / r->sg) + d / r->sg]));
    return vload((const float *)r->base + j * r->D + d);
}

static inline float row_at(const kv_rows *r, long j, long d) {
    if (r->sc) return (float)((const int8_t *)r->base)[j * r->D + d] * r->sc[j * (r->D / r->sg) + d / r->sg];
    return ((const float *)r->base)[j * r->D + d];
}

/* G ≤ GMAX query vectors qr[g] (each D floats) against positions s0 … s0+n-1, which sit at offsets
   j0 … j0+n-1 of block blk, one key at a time (head sizes that are not a multiple of VL): w[g·SP + s] =
   scale · q_g · k_s, with k_s as row_vec reads it. */
static inline __attribute__((always_inline)) void score_keys_each(const float *const *qr, const int G, const kv_view *kv,
                                                             long blk, long j0, long n, long s0, long kh, long D,
                                                             float scale, float *w, long SP) {
    kv_rows kr = kv_rows_at(kv, kv->k, kv->ks, blk, kh, D);
    for (long j = 0; j < n; j++) {
        vec acc[GMAX];
        for (int g = 0; g < G; g++) acc[g] = vzero();
        long d = 0;
        for (; d + VL <= D; d += VL) {
            vec kvec = row_vec(&kr, j0 + j, d, rows_format(&kr));
            for (int g = 0; g < G; g++) acc[g] = vfma(vload(qr[g] + d), kvec, acc[g]);
        }
        for (int g = 0; g < G; g++) {
            float v = vsum(acc[g]);
            for (long dd = d; dd < D; dd++) v = fmaf(qr[g][dd], row_at(&kr, j0 + j, dd), v);
            w[g * SP + s0 + j] = v * scale;
        }
    }
}

#if defined(__AVX512F__)
/* VL accumulators, one per key -> one vector of their sums (key j in lane j). Lanes are paired in
   vsum's tree — lane i with i + 8, then with i + 4, + 2, + 1 (GCC's _mm512_reduce_add_ps) — so a
   key's score has the same bits reduced alone or with 15 others. */
static inline __attribute__((always_inline)) vec reduce_keys(const vec *a) {
    vec b[8], c[4], e[2];
    for (int m = 0; m < 8; m++)              /* lanes i + (i + 8); keys 2m, 2m+1 in halves */
        b[m] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * m], a[2 * m + 1], 0x44),
                             _mm512_shuffle_f32x4(a[2 * m], a[2 * m + 1], 0xEE));
    for (int m = 0; m < 4; m++)              /* + 4 lanes on; keys 4m … 4m+3 in 128-bit chunks */
        c[m] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * m], b[2 * m + 1], 0x88),
                             _mm512_shuffle_f32x4(b[2 * m], b[2 * m + 1], 0xDD));
    for (int m = 0; m < 2; m++)              /* [0] + [2], [1] + [3] */
        e[m] = _mm512_add_ps(_mm512_shuffle_ps(c[2 * m], c[2 * m + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(c[2 * m], c[2 * m + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    vec f = _mm512_add_ps(_mm512_shuffle_ps(e[0], e[1], _MM_SHUFFLE(2, 0, 2, 0)),
                          _mm512_shuffle_ps(e[0], e[1], _MM_SHUFFLE(3, 1, 3, 1)));   /* lane 4c + m: key 4m + c */
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), f);
}
static inline void store_keys(float *w, vec s, long cnt) { _mm512_mask_storeu_ps(w, (__mmask16)((1u << cnt) - 1), s); }
#else
/* The same for 8 keys in hsum's tree: lane i with i + 4, then pairs (0, 1), (2, 3), then the two. */
static inline __attribute__((always_inline)) vec reduce_keys(const vec *a) {
    vec b[4], c[2];
    for (int m = 0; m < 4; m++)              /* lanes i + (i + 4); keys 2m, 2m+1 in halves */
        b[m] = _mm256_add_ps(_mm256_permute2f128_ps(a[2 * m], a[2 * m + 1], 0x20),
                             _mm256_permute2f128_ps(a[2 * m], a[2 * m + 1], 0x31));
    for (int m = 0; m < 2; m++)              /* [0] + [1], [2] + [3] */
        c[m] = _mm256_add_ps(_mm256_shuffle_ps(b[2 * m], b[2 * m + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm256_shuffle_ps(b[2 * m], b[2 * m + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    vec f = _mm256_add_ps(_mm256_shuffle_ps(c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0)),
                          _mm256_shuffle_ps(c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1)));   /* lane 4h + m: key 2m + h */
    return _mm256_permutevar8x32_ps(f, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}
static inline void store_keys(float *w, vec s, long cnt) {
    if (cnt == 8)                                         /* a masked store costs many µops on Zen */
        _mm256_storeu_ps(w, s);
    else
        _mm256_maskstore_ps(w, _mm256_cmpgt_epi32(_mm256_set1_epi32((int)cnt), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)), s);
}
#endif

/* Into L1: the keys at offsets j0 … j0+n-1 of block blk (float or int8 rows). A group of VL keys is
   read head by head, each key row in D / VL pieces, a pattern the hardware prefetcher follows less
   well than one key row after another; so the next group is fetched ahead. */
static inline void prefetch_keys(const kv_view *kv, long blk, long j0, long n, long kh, long D) {
    long size = kv_esize(kv->ks != NULL, kv->bf16);
    const char *p = (const char *)kv->k + size * (blk * kv->blk_stride + kh * kv->head_stride + j0 * D);
    for (long off = 0; off < n * D * size; off += 64) _mm_prefetch(p + off, _MM_HINT_T0);
}

/* bf16 stores pair their elements (kernels.h, KV_KEY_GROUP): keys pair dimensions — the 32-bit word
   (p, j) of a block's group of 16 key rows holds dimensions 2p and 2p + 1 of key j — and values pair
   positions — the word (m, d) holds dimension d of positions 2m and 2m + 1. A vector load of keys then
   holds one pair of dimensions of consecutive keys (a key per lane: the dot products need no sum across
   lanes) and one of values a dimension per lane for two positions (the pair `vdpbf16ps` multiplies).
   Tiles start at a multiple of KV_KEY_GROUP positions inside a block (block starts, or KT = 32 on),
   so a tile's keys begin a group and its positions begin a pair. */
static inline const uint32_t *paired_words(const kv_view *kv, const void *store, long blk, long kh) {
    return (const uint32_t *)((const uint16_t *)store + blk * kv->blk_stride + kh * kv->head_stride);
}

/* Word (p, j) of the keys j0 + j onwards: groups of KV_KEY_GROUP keys, D / 2 words each. */
static inline const uint32_t *key_words(const uint32_t *chunk, long j, long D) {
    return chunk + (j / KV_KEY_GROUP) * (D / 2) * KV_KEY_GROUP + j % KV_KEY_GROUP;
}

#if defined(__AVX512BF16__)
static inline __mmask16 lanes16(long n) { return n >= 16 ? (__mmask16)0xFFFF : n <= 0 ? 0 : (__mmask16)((1u << n) - 1); }

/* NV = 1 or 2 vectors of 16 keys (cnt ≤ 16 · NV of them) against G queries as bf16 pairs qp[g]: a
   score is Σ_p in order of `vdpbf16ps`'s k_{2p} q_{2p} + k_{2p+1} q_{2p+1}, in the key's own lane. */
static inline __attribute__((always_inline)) void score_pairs_bf16(const uint32_t (*qp)[272], const int G, const int NV,
                                                                   const uint32_t *k0, const uint32_t *k1, long cnt,
                                                                   long P, float scale, float *w, long SP, long s) {
    __mmask16 m[2] = {lanes16(cnt), lanes16(cnt - 16)};
    const uint32_t *k[2] = {k0, k1};                      /* keys s … s+15 and s+16 … s+31 */
    __m512 acc[GMAX][2];
    for (int g = 0; g < G; g++)
        for (int v = 0; v < NV; v++) acc[g][v] = _mm512_setzero_ps();
    for (long p = 0; p < P; p++) {
        __m512i x[2];
        for (int v = 0; v < NV; v++) x[v] = _mm512_maskz_loadu_epi32(m[v], k[v] + p * 16);
        for (int g = 0; g < G; g++) {
            __m512bh b = (__m512bh)_mm512_set1_epi32((int)qp[g][p]);
            for (int v = 0; v < NV; v++) acc[g][v] = _mm512_dpbf16_ps(acc[g][v], (__m512bh)x[v], b);
        }
    }
    for (int g = 0; g < G; g++)
        for (int v = 0; v < NV; v++)
            _mm512_mask_storeu_ps(w + g * SP + s + 16 * v, m[v], _mm512_mul_ps(acc[g][v], _mm512_set1_ps(scale)));
}

/* The G queries qr[g] rounded to bf16 (`vcvtne2ps2bf16`, nearest, ties to even) in pairs: qp[g][p] holds
   dimensions 2p and 2p + 1. */
static inline __attribute__((always_inline)) void queries_bf16(const float *const *qr, const int G, long D,
                                                               uint32_t (*qp)[272]) {
    const long P = D / 2;
    for (int g = 0; g < G; g++)
        for (long p = 0; p < P; p += 16)
            _mm512_storeu_si512(qp[g] + p, (__m512i)_mm512_cvtne2ps_pbh(
                                               _mm512_maskz_loadu_ps(lanes16(2 * (P - p) - 16), qr[g] + 2 * p + 16),
                                               _mm512_maskz_loadu_ps(lanes16(2 * (P - p)), qr[g] + 2 * p)));
}

static inline __attribute__((always_inline)) void score_paired_bf16(const uint32_t (*qp)[272], const int G,
                                                                    const kv_view *kv, long blk, long j0, long n,
                                                                    long s0, long kh, long D, float scale, float *w,
                                                                    long SP);

/* G query vectors qr[g] against positions s0 … s0+n-1 (offsets j0 … of block blk) of a bf16 store: each
   query rounded to bf16 (`vcvtne2ps2bf16`, nearest, ties to even), 32 keys at a time. Twice the multiply
   rate of float32 FMAs; the price is the query's rounding (the keys are bf16 already). */
static inline __attribute__((always_inline)) void score_paired(const float *const *qr, const int G, const kv_view *kv,
                                                               long blk, long j0, long n, long s0, long kh, long D,
                                                               float scale, float *w, long SP) {
    uint32_t qp[GMAX][272];                               /* D ≤ 512: 256 pairs, and a vector's slack */
    queries_bf16(qr, G, D, qp);
    score_paired_bf16(qp, G, kv, blk, j0, n, s0, kh, D, scale, w, SP);
}

/* score_paired with the queries already in pairs. */
static inline __attribute__((always_inline)) void score_paired_bf16(const uint32_t (*qp)[272], const int G,
                                                                    const kv_view *kv, long blk, long j0, long n,
                                                                    long s0, long kh, long D, float scale, float *w,
                                                                    long SP) {
    const uint32_t *chunk = paired_words(kv, kv->k, blk, kh);
    const long P = D / 2;
    for (long j = 0; j < n; j += 32) {
        long cnt = n - j < 32 ? n - j : 32;
        const uint32_t *k = key_words(chunk, j0 + j, D);
        if (cnt > 16)
            score_pairs_bf16(qp, G, 2, k, k + P * 16, cnt, P, scale, w, SP, s0 + j);
        else
            score_pairs_bf16(qp, G, 1, k, k, cnt, P, scale, w, SP, s0 + j);
    }
}

/* out_g[d] += w_s · v_s[d] + w_{s+1} · v_{s+1}[d] for each pair of positions (s, s + 1) from s0 on, in
   ascending order, by `vdpbf16ps` on the weights rounded to bf16: 16 · NV dimensions at a time for all
   G heads. A lone last position (n odd) pairs with a zero weight and a zeroed value. */
static inline __attribute__((always_inline)) void mix_pairs_bf16(const uint32_t (*wp)[16], const int G, const int NV,
                                                                 const uint32_t *v, long np, long odd, long D, long d,
                                                                 float *const *out) {
    __m512 acc[GMAX][4];
    for (int g = 0; g < G; g++)
        for (int c = 0; c < NV; c++) acc[g][c] = _mm512_loadu_ps(out[g] + d + 16 * c);
    for (long m = 0; m < np; m++) {
        __m512i x[4];
        for (int c = 0; c < NV; c++) {
            x[c] = _mm512_loadu_si512(v + m * D + d + 16 * c);
            if (odd && m == np - 1) x[c] = _mm512_and_si512(x[c], _mm512_set1_epi32(0xFFFF));
        }
        for (int g = 0; g < G; g++) {
            __m512bh b = (__m512bh)_mm512_set1_epi32((int)wp[g][m]);
            for (int c = 0; c < NV; c++) acc[g][c] = _mm512_dpbf16_ps(acc[g][c], (__m512bh)x[c], b);
        }
    }
    for (int g = 0; g < G; g++)
        for (int c = 0; c < NV; c++) _mm512_storeu_ps(out[g] + d + 16 * c, acc[g][c]);
}

static inline __attribute__((always_inline)) void mix_paired(const float *w, long SP, const int G, const kv_view *kv,
                                                             long blk, long j0, long n, long s0, long kh, long D,
                                                             float *const *out) {
    const uint32_t *chunk = paired_words(kv, kv->v, blk, kh) + (j0 / 2) * D;
    const int NV = G <= 6 ? 4 : 2;                        /* accumulators G · NV, within 32 registers */
    uint32_t wp[GMAX][16];                                /* per head: 16 pairs of bf16 weights */
    for (long c = 0; c < n; c += 32) {
        long cn = n - c < 32 ? n - c : 32, np = (cn + 1) / 2, odd = cn % 2;
        const uint32_t *v = chunk + (c / 2) * D;
        for (int g = 0; g < G; g++) {
            const float *ws = w + g * SP + s0 + c;
            _mm512_storeu_si512(wp[g], (__m512i)_mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(lanes16(cn - 16), ws + 16),
                                                                    _mm512_maskz_loadu_ps(lanes16(cn), ws)));
        }
        long d = 0;
        for (; d + 16 * NV <= D; d += 16 * NV) mix_pairs_bf16(wp, G, NV, v, np, odd, D, d, out);
        for (; d + 16 <= D; d += 16) mix_pairs_bf16(wp, G, 1, v, np, odd, D, d, out);
        for (; d < D; d++)                                /* head sizes not a multiple of 16: the rest */
            for (int g = 0; g < G; g++) {
                float acc = out[g][d];
                for (long m = 0; m < np; m++) {
                    uint32_t x = v[m * D + d];
                    acc = fmaf(w[g * SP + s0 + c + 2 * m], bf16_to_f32((uint16_t)x), acc);
                    if (2 * m + 1 < cn) acc = fmaf(w[g * SP + s0 + c + 2 * m + 1], bf16_to_f32((uint16_t)(x >> 16)), acc);
                }
                out[g][d] = acc;
            }
    }
}

/* One row against its whole prefix 0 … p of a bf16 store (block table `table`), G heads: what the tile
   loop of group_G computes, bit for bit, with less work per block. The queries are rounded to pairs once
   (not once per tile); each head's weights are rounded to pairs once, in place (word m of head g at
   ((uint32_t *)(w + g · SP))[m], the pair of positions 2m and 2m + 1); and the value sums stay in
   registers from the first block to the last instead of being stored and reloaded at every tile — the
   same `vdpbf16ps` per pair in the same ascending order, so the same floats. A decode or verify row at a
   long context on 16-position blocks spent about a quarter of its attention on those per-tile steps.
   Needs blocks of an even size (or one block: pairs are then the prefix's own) and D a multiple of the
   16 · NV dimensions a sweep takes (row_paired_fits). stream: one row per sequence in the pass, whose
   values come from memory (prefetched two blocks ahead); the rows of a verify pass share theirs from
   the caches after the first. */
#define ROW_PAIRED 1
static float softmax_row(float *w, long p);
static inline int row_paired_fits(const kv_view *kv, int G, long D, long p) {
    return (kv->bs % 2 == 0 || kv->bs > p) && D % (16 * (G <= 6 ? 4 : 2)) == 0 && D <= 512;
}

static inline __attribute__((always_inline)) void row_paired(const float *q, const int G, const kv_view *kv,
                                                             const int64_t *table, long p, long kh, long D,
                                                             float scale, float *w, long SP, float *out, int stream) {
    const long n = p + 1, bs = kv->bs;
    const float *qr[GMAX];
    uint32_t qp[GMAX][272];
    for (int g = 0; g < G; g++) qr[g] = q + g * D;
    queries_bf16(qr, G, D, qp);
    if (bs == 16)                                         /* two blocks' keys per sweep of the queries */
        for (long s0 = 0; s0 < n; s0 += 32) {
            long cnt = n - s0 < 32 ? n - s0 : 32;
            if (s0 + 32 < n) {
                prefetch_keys(kv, table[s0 / 16 + 2], 0, n - s0 - 32 < 16 ? n - s0 - 32 : 16, kh, D);
                if (s0 + 48 < n) prefetch_keys(kv, table[s0 / 16 + 3], 0, n - s0 - 48 < 16 ? n - s0 - 48 : 16, kh, D);
            }
            const uint32_t *k0 = paired_words(kv, kv->k, table[s0 / 16], kh);
            if (cnt > 16)
                score_pairs_bf16(qp, G, 2, k0, paired_words(kv, kv->k, table[s0 / 16 + 1], kh), cnt, D / 2, scale, w,
                                 SP, s0);
            else
                score_pairs_bf16(qp, G, 1, k0, k0, cnt, D / 2, scale, w, SP, s0);
        }
    else
        for (long s0 = 0; s0 < n; s0 += bs) {
            long cnt = n - s0 < bs ? n - s0 : bs;
            if (s0 + bs < n) prefetch_keys(kv, table[(s0 + bs) / bs], 0, n - s0 - bs < VL ? n - s0 - bs : VL, kh, D);
            score_paired_bf16(qp, G, kv, table[s0 / bs], 0, cnt, s0, kh, D, scale, w, SP);
        }
    float inv[GMAX];
    for (int g = 0; g < G; g++) {
        inv[g] = softmax_row(w + g * SP, p);              /* zero from n to spad(n) */
        float *ws = w + g * SP;
        for (long c = 0; c < n; c += 32)                  /* word c/2 + i from floats c + 2i, c + 2i + 1: read first */
            _mm512_mask_storeu_epi32((uint32_t *)ws + c / 2, lanes16((n - c + 1) / 2),
                                     (__m512i)_mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(lanes16(n - c - 16), ws + c + 16),
                                                                  _mm512_maskz_loadu_ps(lanes16(n - c), ws + c)));
    }
    const int NV = G <= 6 ? 4 : 2;
    for (long d = 0; d < D; d += 16 * NV) {
        __m512 acc[GMAX][4];
        for (int g = 0; g < G; g++)
            for (int c = 0; c < NV; c++) acc[g][c] = _mm512_setzero_ps();
        for (long s0 = 0; s0 < n; s0 += bs) {
            long cnt = n - s0 < bs ? n - s0 : bs, np = (cnt + 1) / 2;
            const uint32_t *v = paired_words(kv, kv->v, table[s0 / bs], kh) + d;
            if (stream && d == 0 && s0 + 2 * bs < n) {        /* the block after next, into L2 */
                const char *nv = (const char *)paired_words(kv, kv->v, table[s0 / bs + 2], kh);
                long bytes = ((n - s0 - 2 * bs < bs ? n - s0 - 2 * bs : bs) + 1) / 2 * D * 4;
                for (long off = 0; off < bytes; off += 64) _mm_prefetch(nv + off, _MM_HINT_T1);
            }
            for (long m = 0; m < np; m++) {
                __m512i x[4];
                for (int c = 0; c < NV; c++) {
                    x[c] = _mm512_loadu_si512(v + m * D + 16 * c);
                    if (2 * m + 1 == cnt) x[c] = _mm512_and_si512(x[c], _mm512_set1_epi32(0xFFFF));   /* lone last */
                }
                for (int g = 0; g < G; g++) {
                    __m512bh b = (__m512bh)_mm512_set1_epi32((int)((const uint32_t *)(w + g * SP))[s0 / 2 + m]);
                    for (int c = 0; c < NV; c++) acc[g][c] = _mm512_dpbf16_ps(acc[g][c], (__m512bh)x[c], b);
                }
            }
        }
        for (int g = 0; g < G; g++)
            for (int c = 0; c < NV; c++)
                _mm512_storeu_ps(out + g * D + d + 16 * c, _mm512_mul_ps(acc[g][c], _mm512_set1_ps(inv[g])));
    }
}
#else
/* Without AVX512_BF16 the pairs are widened to float32 in registers: a word's low half (x << 16) is the
   first element of its pair, its high half (x & 0xFFFF0000) the second. */
#if defined(__AVX512F__)
typedef __m512i ivec;
static inline ivec ivec_load(const uint32_t *p, long cnt) {
    return cnt >= 16 ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi32((__mmask16)((1u << cnt) - 1), p);
}
static inline vec widen_lo(ivec x) { return _mm512_castsi512_ps(_mm512_slli_epi32(x, 16)); }
static inline vec widen_hi(ivec x) { return _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32((int)0xFFFF0000))); }
#else
typedef __m256i ivec;
static inline ivec ivec_load(const uint32_t *p, long cnt) {
    if (cnt >= 8) return _mm256_loadu_si256((const __m256i *)p);
    return _mm256_maskload_epi32((const int *)p, _mm256_cmpgt_epi32(_mm256_set1_epi32((int)cnt),
                                                                    _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
}
static inline vec widen_lo(ivec x) { return _mm256_castsi256_ps(_mm256_slli_epi32(x, 16)); }
static inline vec widen_hi(ivec x) { return _mm256_castsi256_ps(_mm256_and_si256(x, _mm256_set1_epi32((int)0xFFFF0000))); }
#endif

/* NV vectors of VL keys from pointers k[v] (cnt ≤ VL · NV keys), a key per lane, against G queries: a
   score is Σ_p in order of q_{2p} k_{2p} then q_{2p+1} k_{2p+1}, float32 FMAs. The widened halves are
   taken from a reload of the words (one register per vector), so G · NV + NV + 1 registers suffice. */
static inline __attribute__((always_inline)) void score_pairs_f32(const float *const *qr, const int G, const int NV,
                                                                  const uint32_t *const *k, long cnt, long P,
                                                                  float scale, float *w, long SP, long s) {
    vec acc[GMAX][2];
    long c[2] = {cnt < VL ? cnt : VL, cnt - VL};
    for (int g = 0; g < G; g++)
        for (int v = 0; v < NV; v++) acc[g][v] = vzero();
    for (long p = 0; p < P; p++) {
        vec x[2];
        for (int v = 0; v < NV; v++) x[v] = widen_lo(ivec_load(k[v] + p * KV_KEY_GROUP, c[v]));
        for (int g = 0; g < G; g++) {
            vec b = vset1(qr[g][2 * p]);
            for (int v = 0; v < NV; v++) acc[g][v] = vfma(b, x[v], acc[g][v]);
        }
        for (int v = 0; v < NV; v++) x[v] = widen_hi(ivec_load(k[v] + p * KV_KEY_GROUP, c[v]));
        for (int g = 0; g < G; g++) {
            vec b = vset1(qr[g][2 * p + 1]);
            for (int v = 0; v < NV; v++) acc[g][v] = vfma(b, x[v], acc[g][v]);
        }
    }
    for (int g = 0; g < G; g++)
        for (int v = 0; v < NV; v++) store_keys(w + g * SP + s + VL * v, vmul(acc[g][v], vset1(scale)), c[v]);
}

/* Vectors a step takes at once: two where G · 2 accumulators and the operands fit the registers (32
   with AVX-512, 16 with AVX2), else one. */
#define PAIRED_NV(G) ((G) <= (VL == 16 ? 6 : 4) ? 2 : 1)

/* G query vectors against positions s0 … s0+n-1 (offsets j0 … of block blk), PAIRED_NV · VL keys at a
   time. */
static inline __attribute__((always_inline)) void score_paired(const float *const *qr, const int G, const kv_view *kv,
                                                               long blk, long j0, long n, long s0, long kh, long D,
                                                               float scale, float *w, long SP) {
    const uint32_t *chunk = paired_words(kv, kv->k, blk, kh);
    const int NV = PAIRED_NV(G);
    for (long j = 0; j < n; j += NV * VL) {
        long cnt = n - j < NV * VL ? n - j : NV * VL;
        const uint32_t *k[2] = {key_words(chunk, j0 + j, D), key_words(chunk, j0 + j + VL, D)};
        if (NV == 2 && cnt > VL)
            score_pairs_f32(qr, G, 2, k, cnt, D / 2, scale, w, SP, s0 + j);
        else
            score_pairs_f32(qr, G, 1, k, cnt, D / 2, scale, w, SP, s0 + j);
    }
}

/* out_g[d] += w_s · v_s[d] in ascending s from s0 on, NV · VL dimensions at a time for all G heads. */
static inline __attribute__((always_inline)) void mix_pairs_f32(const float *ws, long SP, const int G, const int NV,
                                                                const uint32_t *v, long n, long D, long d,
                                                                float *const *out) {
    vec acc[GMAX][2];
    for (int g = 0; g < G; g++)
        for (int c = 0; c < NV; c++) acc[g][c] = vload(out[g] + d + VL * c);
    for (long m = 0; 2 * m < n; m++) {
        vec x[2];
        for (int c = 0; c < NV; c++) x[c] = widen_lo(ivec_load(v + m * D + d + VL * c, VL));
        for (int g = 0; g < G; g++) {
            vec b = vset1(ws[g * SP + 2 * m]);
            for (int c = 0; c < NV; c++) acc[g][c] = vfma(b, x[c], acc[g][c]);
        }
        if (2 * m + 1 < n) {
            for (int c = 0; c < NV; c++) x[c] = widen_hi(ivec_load(v + m * D + d + VL * c, VL));
            for (int g = 0; g < G; g++) {
                vec b = vset1(ws[g * SP + 2 * m + 1]);
                for (int c = 0; c < NV; c++) acc[g][c] = vfma(b, x[c], acc[g][c]);
            }
        }
    }
    for (int g = 0; g < G; g++)
        for (int c = 0; c < NV; c++) vstore(out[g] + d + VL * c, acc[g][c]);
}

static inline __attribute__((always_inline)) void mix_paired(const float *w, long SP, const int G, const kv_view *kv,
                                                             long blk, long j0, long n, long s0, long kh, long D,
                                                             float *const *out) {
    const uint32_t *v = paired_words(kv, kv->v, blk, kh) + (j0 / 2) * D;
    const float *ws = w + s0;
    const int NV = PAIRED_NV(G);
    long d = 0;
    for (; d + NV * VL <= D; d += NV * VL) mix_pairs_f32(ws, SP, G, NV, v, n, D, d, out);
    for (; d + VL <= D; d += VL) mix_pairs_f32(ws, SP, G, 1, v, n, D, d, out);
    for (; d < D; d++)                                    /* head sizes not a multiple of VL: the rest */
        for (int g = 0; g < G; g++) {
            float acc = out[g][d];
            for (long s = 0; s < n; s++) {
                uint32_t x = v[(s / 2) * D + d];
                acc = fmaf(ws[g * SP + s], bf16_to_f32((uint16_t)(s % 2 ? x >> 16 : x)), acc);
            }
            out[g][d] = acc;
        }
}
#endif

#if !defined(__AVX512BF16__)
#define ROW_PAIRED 0
static inline int row_paired_fits(const kv_view *kv, int G, long D, long p) { (void)kv, (void)G, (void)D, (void)p; return 0; }
static inline void row_paired(const float *q, const int G, const kv_view *kv, const int64_t *table, long p, long kh,
                              long D, float scale, float *w, long SP, float *out, int stream) {
    (void)q, (void)G, (void)kv, (void)table, (void)p, (void)kh, (void)D, (void)scale, (void)w, (void)SP, (void)out;
    (void)stream;
}
#endif

/* G query vectors against VL keys, rows of D floats at k (D a multiple of VL): the scores of the
   first cnt keys go to w[g·SP + s0 …]. Per key and head the same operations as score_keys_each —
   lane partial sums over d in order, then vsum's tree — but each head's query vector is read once
   per VL keys and the VL keys are reduced together, where one key at a time re-reads G query
   vectors per key vector and reduces every (key, head) alone. With D a constant (the callers pass
   64 and 128 literally) the key rows sit at fixed offsets from one pointer. */
static inline __attribute__((always_inline)) void score_keys(const float *const *qr, const int G, const float *k,
                                                             long cnt, const long D, float scale, float *w, long SP,
                                                             long s0) {
    for (int g = 0; g < G; g++) {
        vec acc[VL];
        for (int j = 0; j < VL; j++) acc[j] = vzero();
        for (long d = 0; d < D; d += VL) {
            vec qv = vload(qr[g] + d);
            for (int j = 0; j < VL; j++) acc[j] = vfma(qv, vload(k + j * D + d), acc[j]);
        }
        store_keys(w + g * SP + s0, vmul(reduce_keys(acc), vset1(scale)), cnt);
    }
}

/* score_keys with the head sizes of the embedded models as constants (their key rows at fixed offsets). */
static inline __attribute__((always_inline)) void score_group(const float *const *qr, const int G, const float *k,
                                                              long cnt, long D, float scale, float *w, long SP,
                                                              long s0) {
    if (D == 128)
        score_keys(qr, G, k, cnt, 128, scale, w, SP, s0);
    else if (D == 64)
        score_keys(qr, G, k, cnt, 64, scale, w, SP, s0);
    else
        score_keys(qr, G, k, cnt, D, scale, w, SP, s0);
}

/* G ≤ GMAX query vectors qr[g] (each D floats) against positions s0 … s0+n-1, which sit at offsets
   j0 … j0+n-1 of block blk: w[g·SP + s] = scale · q_g · k_s, VL keys at a time. A short last group
   and int8 keys (dequantized, k8 · its group's scale, exactly as score_keys_each does) go through a
   small buffer first, zero rows padding the group; bf16 stores take score_paired. */
static inline __attribute__((always_inline)) void score_tile(const float *const *qr, const int G, const kv_view *kv,
                                                             long blk, long j0, long n, long s0, long kh, long D,
                                                             float scale, float *w, long SP) {
    if (kv->bf16) {
        score_paired(qr, G, kv, blk, j0, n, s0, kh, D, scale, w, SP);
        return;
    }
    if (D % VL) {
        score_keys_each(qr, G, kv, blk, j0, n, s0, kh, D, scale, w, SP);
        return;
    }
    kv_rows kr = kv_rows_at(kv, kv->k, kv->ks, blk, kh, D);
    const float *kb = (const float *)kr.base;
    float buf[VL * D];
    for (long j = 0; j < n; j += VL) {
        long cnt = n - j < VL ? n - j : VL;
        const float *k = kb + (j0 + j) * D;
        if (j + VL < n) prefetch_keys(kv, blk, j0 + j + VL, n - j - VL < VL ? n - j - VL : VL, kh, D);
        if (kr.sc || cnt < VL) {
            for (long r = 0; r < VL; r++)
                for (long d = 0; d < D; d += VL)
                    vstore(buf + r * D + d, r < cnt ? row_vec(&kr, j0 + j + r, d, rows_format(&kr)) : vzero());
            k = buf;
        }
        score_group(qr, G, k, cnt, D, scale, w, SP, s0 + j);
    }
}

/* A work item of several rows converts each tile of int8 keys (and then values) to float32 once, into
   tb, and every row reads the floats: row_vec's values, so the same bits as a row that converts for
   itself, without converting the tile once per row. Only for head sizes a multiple of VL whose tile
   fits tb (bf16 stores are read in place as pairs). Rows past n up to a multiple of VL are zero. */
#define TB_D 256
static inline int tile_shared(const kv_view *kv, long D) { return kv->ks != NULL && D % VL == 0 && D <= TB_D; }

static inline __attribute__((always_inline)) void convert_tile(const kv_rows *r, long j0, long n, long D, float *tb) {
    long npad = (n + VL - 1) / VL * VL;
    for (long j = 0; j < npad; j++)
        for (long d = 0; d < D; d += VL)
            vstore(tb + j * D + d, j < n ? row_vec(r, j0 + j, d, rows_format(r)) : vzero());
}

/* score_tile over a converted tile: n keys of D floats at tb (zero rows to a multiple of VL). */
static inline __attribute__((always_inline)) void score_floats(const float *const *qr, const int G, const float *tb,
                                                               long n, long s0, long D, float scale, float *w,
                                                               long SP) {
    for (long j = 0; j < n; j += VL) score_group(qr, G, tb + j * D, n - j < VL ? n - j : VL, D, scale, w, SP, s0 + j);
}

/* In place: w[0 … p] -> exp(w - max); returns 1 / Σ. Lanes past p (to a multiple of 8) are set to
   zero. A NaN score (a broken model) makes the whole row NaN, as the torch fallback's softmax does.
   The AVX-512 builds run 16 lanes, max and sum alike (a scalar max loop was a fifth of the attention
   time at 5,000 positions); their sum runs in another order than AVX2's 8 lanes, so the variants
   differ in the last bits (each is row-exact). */
#if defined(__AVX512F__)
static inline __mmask16 first_lanes(long n) { return n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1); }

static float softmax_row(float *w, long p) {
    long n = p + 1;
    __m512 vmx = _mm512_set1_ps(-INFINITY);
    __mmask16 nan = 0;
    for (long s = 0; s < n; s += 16) {
        __mmask16 k = first_lanes(n - s);
        __m512 x = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), k, w + s);
        nan |= _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
        vmx = _mm512_max_ps(vmx, x);
    }
    if (nan) return NAN;
    __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(vmx)), sum = _mm512_setzero_ps();
    for (long s = 0; s < n; s += 16) {
        __mmask16 k = first_lanes(n - s);
        __m512 e = _mm512_maskz_mov_ps(k, exp_neg512(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, w + s), mx)));
        _mm512_mask_storeu_ps(w + s, k, e);
        sum = _mm512_add_ps(sum, e);
    }
    for (long s = n; s < spad(n); s++) w[s] = 0.0f;
    return 1.0f / _mm512_reduce_add_ps(sum);
}
#else
static float softmax_row(float *w, long p) {
    long n = p + 1, n8 = spad(n);
    for (long s = n; s < n8; s++) w[s] = -INFINITY;
    __m256 lmx = _mm256_set1_ps(-INFINITY), nan = _mm256_setzero_ps();
    for (long s = 0; s < n8; s += 8) {                    /* the max is the same in any order */
        __m256 x = _mm256_loadu_ps(w + s);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
        lmx = _mm256_max_ps(lmx, x);
    }
    if (_mm256_movemask_ps(nan)) return NAN;
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(lmx), _mm256_extractf128_ps(lmx, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    float mx = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
    __m256 vmx = _mm256_set1_ps(mx), sum = _mm256_setzero_ps();
    for (long s = 0; s < n8; s += 8) {
        __m256 e = exp_neg(_mm256_sub_ps(_mm256_loadu_ps(w + s), vmx));
        e = s + 8 > n ? _mm256_and_ps(e, _mm256_castsi256_ps(_mm256_cmpgt_epi32(
                            _mm256_set1_epi32((int)(n - s)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)))) : e;
        _mm256_storeu_ps(w + s, e);
        sum = _mm256_add_ps(sum, e);
    }
    return 1.0f / hsum(sum);
}
#endif


/* out_g[d] += Σ_{s0 ≤ s < s0+n} w[g·SP + s] · v_s[d] in ascending s, for positions s0 … s0+n-1 at
   offsets j0 … of block blk; the running sums live in out between tiles (a float stored and loaded is
   the same float, so this is the order and the result of one long sum). 2·VL dimensions at a time
   for all G heads (int8 values dequantized a vector at a time, v8 · its group's scale). */
static inline __attribute__((always_inline)) void mix_rows(const float *w, long SP, const int G, const kv_rows *vr,
                                                           long j0, long n, long s0, long D, float *const *out,
                                                           const int fmt) {
    long d = 0;
    for (; d + 2 * VL <= D; d += 2 * VL) {
        vec acc[GMAX][2];
        for (int g = 0; g < G; g++) acc[g][0] = vload(out[g] + d), acc[g][1] = vload(out[g] + d + VL);
        for (long j = 0; j < n; j++) {
            vec v0 = row_vec(vr, j0 + j, d, fmt), v1 = row_vec(vr, j0 + j, d + VL, fmt);
            for (int g = 0; g < G; g++) {
                vec ws = vset1(w[g * SP + s0 + j]);
                acc[g][0] = vfma(ws, v0, acc[g][0]);
                acc[g][1] = vfma(ws, v1, acc[g][1]);
            }
        }
        for (int g = 0; g < G; g++) vstore(out[g] + d, acc[g][0]), vstore(out[g] + d + VL, acc[g][1]);
    }
    for (; d < D; d++)
        for (int g = 0; g < G; g++) {
            float acc = out[g][d];
            for (long j = 0; j < n; j++) acc = fmaf(w[g * SP + s0 + j], row_at(vr, j0 + j, d), acc);
            out[g][d] = acc;
        }
}

static inline __attribute__((always_inline)) void mix_tile(const float *w, long SP, const int G, const kv_view *kv,
                                                           long blk, long j0, long n, long s0, long kh, long D,
                                                           float *const *out) {
    if (kv->bf16) {
        mix_paired(w, SP, G, kv, blk, j0, n, s0, kh, D, out);
        return;
    }
    kv_rows vr = kv_rows_at(kv, kv->v, kv->vs, blk, kh, D);
    switch (rows_format(&vr)) {
    case ROWS_INT8: mix_rows(w, SP, G, &vr, j0, n, s0, D, out, ROWS_INT8); break;
    default: mix_rows(w, SP, G, &vr, j0, n, s0, D, out, ROWS_F32);
    }
}

/* The tile that starts at position s0 of a row with block table `table`: its block and offset there;
   returns its length (at most kt, within the block, and not past pmax). */
static inline long tile_at(const kv_view *kv, const int64_t *table, long s0, long pmax, long kt, long *blk,
                           long *j0) {
    long n = kv->bs - s0 % kv->bs;
    n = n < kt ? n : kt;
    *blk = table[s0 / kv->bs], *j0 = s0 % kv->bs;
    return pmax + 1 - s0 < n ? pmax + 1 - s0 : n;
}

/* Rows r0 … r0+nr-1 of one batch row (block table `table`), one KV head kh and its G query heads
   h0 … h0+G-1 (G a compile-time constant, so the accumulators live in registers). Scratch w holds
   nr · G score rows of SP floats, then nr · G reciprocal sums. Scores of every row over each key
   tile, a softmax per row and head, then the values tile by tile, then the scaling by 1 / Σ. */
#define ATTEND_GROUP(G)                                                                                  \
    static void group_##G(const float *q, long q_rs, float *out, long H, const kv_view *kv,              \
                          const int64_t *table, const int64_t *pos, long r0, long nr, long kh, long h0,  \
                          long D, float scale, float *w, long SP, int stream) {                          \
        float *inv = w + nr * G * SP;                                                                    \
        long pmax = 0, kt = nr > 1 ? KT : kv->bs;                                                        \
        const int shared = nr > 1 && tile_shared(kv, D);                                                 \
        float tb[shared ? KT * D : 1];                       /* a converted tile (KT a multiple of VL) */ \
        if (ROW_PAIRED && nr == 1 && kv->bf16 && row_paired_fits(kv, G, D, pos[r0])) {   /* writes all of out */ \
            row_paired(q + r0 * q_rs + h0 * D, G, kv, table, pos[r0], kh, D, scale, w, SP, out + (r0 * H + h0) * D, \
                       stream);                                                                          \
            return;                                                                                      \
        }                                                                                                \
        for (long i = 0; i < nr; i++) {                                                                  \
            pmax = pos[r0 + i] > pmax ? pos[r0 + i] : pmax;                                              \
            memset(out + ((r0 + i) * H + h0) * D, 0, sizeof(float) * G * D);                             \
        }                                                                                                \
        for (long s0 = 0, n, blk, j0; s0 <= pmax; s0 += n) {                                             \
            n = tile_at(kv, table, s0, pmax, kt, &blk, &j0);                                             \
            if (s0 + n <= pmax) {                       /* the next tile's first keys */                 \
                long nblk, nj0, nn = tile_at(kv, table, s0 + n, pmax, kt, &nblk, &nj0);                  \
                prefetch_keys(kv, nblk, nj0, nn < VL ? nn : VL, kh, D);                                  \
            }                                                                                            \
            if (shared) {                                                                                \
                kv_rows kr = kv_rows_at(kv, kv->k, kv->ks, blk, kh, D);                                  \
                convert_tile(&kr, j0, n, D, tb);                                                         \
            }                                                                                            \
            for (long i = 0; i < nr; i++) {                                                              \
                long m = pos[r0 + i] + 1 - s0 < n ? pos[r0 + i] + 1 - s0 : n;   /* this row's part */    \
                if (m <= 0) continue;                                                                    \
                const float *qr[G];                                                                      \
                for (int g = 0; g < G; g++) qr[g] = q + (r0 + i) * q_rs + (h0 + g) * D;                  \
                if (shared)                                                                              \
                    score_floats(qr, G, tb, m, s0, D, scale, w + i * G * SP, SP);                        \
                else                                                                                     \
                    score_tile(qr, G, kv, blk, j0, m, s0, kh, D, scale, w + i * G * SP, SP);             \
            }                                                                                            \
        }                                                                                                \
        for (long i = 0; i < nr; i++)                                                                    \
            for (int g = 0; g < G; g++) inv[i * G + g] = softmax_row(w + (i * G + g) * SP, pos[r0 + i]); \
        const kv_rows vt = {(const char *)tb, NULL, D, 1};          /* the converted value tile */ \
        for (long s0 = 0, n, blk, j0; s0 <= pmax; s0 += n) {                                             \
            n = tile_at(kv, table, s0, pmax, kt, &blk, &j0);                                             \
            if (shared) {                                                                                \
                kv_rows vr = kv_rows_at(kv, kv->v, kv->vs, blk, kh, D);                                  \
                convert_tile(&vr, j0, n, D, tb);                                                         \
            }                                                                                            \
            for (long i = 0; i < nr; i++) {                                                              \
                long m = pos[r0 + i] + 1 - s0 < n ? pos[r0 + i] + 1 - s0 : n;                            \
                if (m <= 0) continue;                                                                    \
                float *o[G];                                                                             \
                for (int g = 0; g < G; g++) o[g] = out + ((r0 + i) * H + h0 + g) * D;                    \
                if (shared)                                                                              \
                    mix_rows(w + i * G * SP, SP, G, &vt, 0, m, s0, D, o, ROWS_F32);                      \
                else                                                                                     \
                    mix_tile(w + i * G * SP, SP, G, kv, blk, j0, m, s0, kh, D, o);                       \
            }                                                                                            \
        }                                                                                                \
        for (long i = 0; i < nr; i++)                                                                    \
            for (int g = 0; g < G; g++) {                                                                \
                float *o = out + ((r0 + i) * H + h0 + g) * D;                                            \
                long d = 0;                                                                              \
                for (; d + VL <= D; d += VL) vstore(o + d, vmul(vload(o + d), vset1(inv[i * G + g])));   \
                for (; d < D; d++) o[d] = o[d] * inv[i * G + g];                                         \
            }                                                                                            \
    }
ATTEND_GROUP(1) ATTEND_GROUP(2) ATTEND_GROUP(3) ATTEND_GROUP(4)
ATTEND_GROUP(5) ATTEND_GROUP(6) ATTEND_GROUP(7) ATTEND_GROUP(8)
typedef void (*group_fn)(const float *, long, float *, long, const kv_view *, const int64_t *, const int64_t *, long,
                         long, long, long, long, float, float *, long, int);
static const group_fn GROUPS[GMAX + 1] = {0, group_1, group_2, group_3, group_4, group_5, group_6, group_7, group_8};

void vs_attend_ws(const float *q, long q_rs, const kv_view *kv, const int64_t *pos, float *out, long B,
                  long H, long Hkv, long T, long D, float scale, float *scratch, long SP) {
    long G = H / Hkv, ngroups = (G + GMAX - 1) / GMAX, chunk = att_rows(T, SP), threads = 1;
    float *w = scratch;
#ifdef _OPENMP
    w += att_scratch(T, SP) * omp_get_thread_num();
    threads = omp_get_num_threads();
#endif
    /* Fewer (batch row, KV head) pairs than threads: split the rows further (the result of a row does
       not depend on which rows share its work item). */
    long pairs = B * Hkv * ngroups, split = (threads + pairs - 1) / pairs;
    if ((T + chunk - 1) / chunk < split) chunk = (T + split - 1) / split;
    long nchunks = (T + chunk - 1) / chunk, items = pairs * nchunks;
#pragma omp for schedule(static)
    for (long it = 0; it < items; it++) {
        long c = it % nchunks, rest = it / nchunks, gi = rest % ngroups, kh = (rest / ngroups) % Hkv;
        long b = rest / ngroups / Hkv, t0 = c * chunk, nr = T - t0 < chunk ? T - t0 : chunk;
        long g0 = gi * GMAX, gn = G - g0 < GMAX ? G - g0 : GMAX;
        GROUPS[gn](q, q_rs, out, H, kv, kv->tables + b * kv->nb, pos, b * T + t0, nr, kh, kh * G + g0, D, scale, w, SP,
                   T == 1);
    }
}

/* q (B, T, H, D) contiguous; keys/values (float32, or bf16 when bf16 is set) and their addressing as in
   kv_view; returns 0, or -1 when the scratch cannot be allocated. */
int verispec_attend_rows(const float *q, const void *keys, const void *values, const int64_t *tables, long nb,
                         long bs, long blk_stride, long head_stride, const int64_t *pos, float *out, long B, long H,
                         long Hkv, long T, long D, float scale, int bf16, int threads) {
    long maxp = 0;
    for (long r = 0; r < B * T; r++) maxp = pos[r] > maxp ? pos[r] : maxp;
    long SP = spad(maxp + 1);
    float *scratch = malloc(sizeof(float) * att_scratch(T, SP) * threads);
    if (!scratch) return -1;
    kv_view kv = {keys, values, NULL, NULL, tables, nb, bs, blk_stride, head_stride, 0, 0, D, bf16};
#pragma omp parallel num_threads(threads)
    vs_attend_ws(q, H * D, &kv, pos, out, B, H, Hkv, T, D, scale, scratch, SP);
    free(scratch);
    return 0;
}
