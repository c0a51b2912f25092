/* Attention for decode and verify rows: each query row attends over exactly its own prefix.
 *   q(r, h) = q + r · q_rs + h · D for rows r = b · T + t (a (B, T, H, D) tensor has q_rs = H · D; the
 *   fused decoder passes its q/k/v buffer, q_rs = (H + 2 H_kv) · D);
 *   keys and values through a kv_view (kernels.h): a static cache row or a paged sequence's blocks,
 *   read in place;
 *   pos (B, T) int64: row (b, t) sees keys 0 … pos[b, t];  out (R, H, D) contiguous (o_proj's input).
 * A work item is one row and one KV head with its G query heads, so each key and value row is read
 * once for all G heads (G independent FMA chains). Per head: scores in order over s, softmax (max,
 * exp, sum in 8 lanes then across them), then Σ_s p_s · v_s in order — a fixed sequence of operations
 * that depends only on that row's query and prefix, never on how many rows share the pass or how the
 * cache is laid out, so a K+1 verify row equals a 1-token decode step bit for bit. The AVX-512 build
 * uses 16-wide vectors for the dot products and the value mix (the AVX2 build 8-wide).
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

/* G ≤ GMAX query rows qr[g] (each D floats) against keys 0 … p: w[g·SP + s] = scale · q_g · k_s
   (int8 keys: k_s dequantized a vector at a time, k8 · its group's scale). */
static inline __attribute__((always_inline)) void scores(const float *const *qr, const int G, const kv_view *kv,
                                                         const int64_t *table, long kh, long p, long D,
                                                         float scale, float *w, long SP) {
    for (long s0 = 0; s0 <= p; s0 += kv->bs) {
        long blk = table[s0 / kv->bs], n = p + 1 - s0 < kv->bs ? p + 1 - s0 : kv->bs;
        const float *kb = (const float *)kv->k + blk * kv->blk_stride + kh * kv->head_stride;
        const int8_t *kb8 = (const int8_t *)kv->k + blk * kv->blk_stride + kh * kv->head_stride;
        const float *ksb = kv->ks ? kv->ks + blk * kv->sc_blk_stride + kh * kv->sc_head_stride : NULL;
        for (long j = 0; j < n; j++) {
            vec acc[GMAX];
            for (int g = 0; g < G; g++) acc[g] = vzero();
            long d = 0;
            if (ksb) {
                const int8_t *k = kb8 + j * D;
                const float *sc = ksb + j * (D / kv->sg);
                for (; d + VL <= D; d += VL) {
                    vec kvec = vmul(vload8(k + d), vset1(sc[d / kv->sg]));
                    for (int g = 0; g < G; g++) acc[g] = vfma(vload(qr[g] + d), kvec, acc[g]);
                }
                for (int g = 0; g < G; g++) {
                    float v = vsum(acc[g]);
                    for (long dd = d; dd < D; dd++) v = fmaf(qr[g][dd], (float)k[dd] * sc[dd / kv->sg], v);
                    w[g * SP + s0 + j] = v * scale;
                }
                continue;
            }
            const float *k = kb + j * D;
            for (; d + VL <= D; d += VL) {
                vec kvec = vload(k + d);
                for (int g = 0; g < G; g++) acc[g] = vfma(vload(qr[g] + d), kvec, acc[g]);
            }
            for (int g = 0; g < G; g++) {
                float v = vsum(acc[g]);
                for (long dd = d; dd < D; dd++) v = fmaf(qr[g][dd], k[dd], v);
                w[g * SP + s0 + j] = v * scale;
            }
        }
    }
}

/* In place: w[0 … p] -> exp(w - max); returns 1 / Σ. Lanes past p are set to zero. A NaN score (a
   broken model) makes the whole row NaN, as the torch fallback's softmax does. */
static float softmax_row(float *w, long p) {
    long n = p + 1, n8 = spad(n);
    float mx = -INFINITY;
    int nan = 0;
    for (long s = 0; s < n; s++) {
        nan |= w[s] != w[s];
        mx = w[s] > mx ? w[s] : mx;
    }
    if (nan) return NAN;
    for (long s = n; s < n8; s++) w[s] = -INFINITY;
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

/* One stored value row's element d as a float (int8 stores: times its group's scale). */
static inline float value_at(const kv_view *kv, long blk, long kh, long j, long D, long d) {
    if (kv->vs)
        return (float)((const int8_t *)kv->v)[blk * kv->blk_stride + kh * kv->head_stride + j * D + d] *
               kv->vs[blk * kv->sc_blk_stride + kh * kv->sc_head_stride + j * (D / kv->sg) + d / kv->sg];
    return ((const float *)kv->v)[blk * kv->blk_stride + kh * kv->head_stride + j * D + d];
}

/* out_g[d] = inv[g] · Σ_{s ≤ p} w[g·SP + s] · v_s[d], 2·VL dimensions at a time for all G heads
   (int8 values dequantized a vector at a time, v8 · its group's scale). */
static inline __attribute__((always_inline)) void mix_values(const float *w, long SP, const float *inv, const int G,
                                                             const kv_view *kv, const int64_t *table, long kh,
                                                             long p, long D, float *const *out) {
    long d = 0;
    for (; d + 2 * VL <= D; d += 2 * VL) {
        vec acc[GMAX][2];
        for (int g = 0; g < G; g++) acc[g][0] = acc[g][1] = vzero();
        for (long s0 = 0; s0 <= p; s0 += kv->bs) {
            long blk = table[s0 / kv->bs], n = p + 1 - s0 < kv->bs ? p + 1 - s0 : kv->bs;
            if (kv->vs) {
                const int8_t *vb = (const int8_t *)kv->v + blk * kv->blk_stride + kh * kv->head_stride;
                const float *vsb = kv->vs + blk * kv->sc_blk_stride + kh * kv->sc_head_stride;
                for (long j = 0; j < n; j++) {
                    const float *sc = vsb + j * (D / kv->sg);
                    vec v0 = vmul(vload8(vb + j * D + d), vset1(sc[d / kv->sg]));
                    vec v1 = vmul(vload8(vb + j * D + d + VL), vset1(sc[(d + VL) / kv->sg]));
                    for (int g = 0; g < G; g++) {
                        vec ws = vset1(w[g * SP + s0 + j]);
                        acc[g][0] = vfma(ws, v0, acc[g][0]);
                        acc[g][1] = vfma(ws, v1, acc[g][1]);
                    }
                }
                continue;
            }
            const float *vb = (const float *)kv->v + blk * kv->blk_stride + kh * kv->head_stride;
            for (long j = 0; j < n; j++) {
                vec v0 = vload(vb + j * D + d), v1 = vload(vb + j * D + d + VL);
                for (int g = 0; g < G; g++) {
                    vec ws = vset1(w[g * SP + s0 + j]);
                    acc[g][0] = vfma(ws, v0, acc[g][0]);
                    acc[g][1] = vfma(ws, v1, acc[g][1]);
                }
            }
        }
        for (int g = 0; g < G; g++) {
            vstore(out[g] + d, vmul(acc[g][0], vset1(inv[g])));
            vstore(out[g] + d + VL, vmul(acc[g][1], vset1(inv[g])));
        }
    }
    for (; d < D; d++)
        for (int g = 0; g < G; g++) {
            float acc = 0.0f;
            for (long s = 0; s <= p; s++)
                acc = fmaf(w[g * SP + s], value_at(kv, table[s / kv->bs], kh, s % kv->bs, D, d), acc);
            out[g][d] = acc * inv[g];
        }
}

/* One row and one KV head: G query heads (a compile-time constant, so the G accumulators live in
   registers), scratch w of G × SP floats. */
#define ATTEND_GROUP(G)                                                                          \
    static void group_##G(const float *const *qr, float *const *o, const kv_view *kv, const int64_t *table, \
                          long kh, long p, long D, float scale, float *w, long SP) {             \
        float inv[G];                                                                            \
        scores(qr, G, kv, table, kh, p, D, scale, w, SP);                                        \
        for (int g = 0; g < G; g++) inv[g] = softmax_row(w + g * SP, p);                         \
        mix_values(w, SP, inv, G, kv, table, kh, p, D, o);                                       \
    }
ATTEND_GROUP(1) ATTEND_GROUP(2) ATTEND_GROUP(3) ATTEND_GROUP(4)
ATTEND_GROUP(5) ATTEND_GROUP(6) ATTEND_GROUP(7) ATTEND_GROUP(8)
typedef void (*group_fn)(const float *const *, float *const *, const kv_view *, const int64_t *, long, long, long,
                         float, float *, long);
static const group_fn GROUPS[GMAX + 1] = {0, group_1, group_2, group_3, group_4, group_5, group_6, group_7, group_8};

void vs_attend_ws(const float *q, long q_rs, const kv_view *kv, const int64_t *pos, float *out, long B,
                  long H, long Hkv, long T, long D, float scale, float *scratch, long SP) {
    long G = H / Hkv, items = B * T * Hkv;
    float *w = scratch;
#ifdef _OPENMP
    w += SP * GMAX * omp_get_thread_num();
#endif
#pragma omp for schedule(static)
    for (long it = 0; it < items; it++) {
        long r = it / Hkv, b = r / T, kh = it % Hkv, p = pos[r];
        const int64_t *table = kv->tables + b * kv->nb;
        for (long g0 = 0; g0 < G; g0 += GMAX) {
            int gn = G - g0 < GMAX ? (int)(G - g0) : GMAX;
            const float *qr[GMAX];
            float *o[GMAX];
            for (int g = 0; g < gn; g++) {
                long h = kh * G + g0 + g;
                qr[g] = q + r * q_rs + h * D;
                o[g] = out + (r * H + h) * D;
            }
            GROUPS[gn](qr, o, kv, table, kh, p, D, scale, w, SP);
        }
    }
}

/* q (B, T, H, D) contiguous; keys/values and their addressing as in kv_view; returns 0, or -1 when
   the scratch cannot be allocated. */
int verispec_attend_rows(const float *q, const float *keys, const float *values, const int64_t *tables, long nb,
                         long bs, long blk_stride, long head_stride, const int64_t *pos, float *out, long B, long H,
                         long Hkv, long T, long D, float scale, int threads) {
    long maxp = 0;
    for (long r = 0; r < B * T; r++) maxp = pos[r] > maxp ? pos[r] : maxp;
    long SP = spad(maxp + 1);
    float *scratch = malloc(sizeof(float) * SP * GMAX * threads);
    if (!scratch) return -1;
    kv_view kv = {keys, values, NULL, NULL, tables, nb, bs, blk_stride, head_stride, 0, 0, D};
#pragma omp parallel num_threads(threads)
    vs_attend_ws(q, H * D, &kv, pos, out, B, H, Hkv, T, D, scale, scratch, SP);
    free(scratch);
    return 0;
}
