/* A whole decoder pass over R = B · T new rows in one call and one OpenMP region, for decode, verify
 * and draft steps (T ≤ a few tens): per layer
 *   xn = RMSNorm(x) · ln1;  qkv = xn · W_qkvᵀ (+ bias);  RoPE on q and k;  k, v written into the cache;
 *   att = row-by-row attention (attention.c);  x += att · W_oᵀ;
 *   xn = RMSNorm(x) · ln2;  [gate | up] = xn · W_guᵀ;  x += (silu(gate) · up) · W_downᵀ.
 * The matmuls are gemm.c's int8, gemm4.c's int4 or gemm6.c's int6 kernel (per linear), the attention
 * attention.c's; the steps between them are worksharing loops over rows (or row × head), each ended by
 * the loop's barrier, so the threads stay in one region for the whole pass instead of forking and
 * joining ~10 times per layer. verispec_pass adds the model's two ends to the same region: the token
 * embeddings before the first layer, the final norm and the LM head on the rows whose logits are wanted
 * after the last — one native call per decode, verify or draft step.
 * A wide pass (prefill: several pieces of up to 65 rows) runs each layer's per-row steps in row chunks
 * of at most CHUNK_ROWS: the norm, QKV projection and cache write of every chunk, then the attention
 * of all rows (a row may read keys that a later row of the pass writes), then o_proj to the MLP's
 * residual chunk by chunk. A chunk's activations and MLP buffers stay in the caches where the whole
 * pass's would not (Zen 4, the 3,090-token long copy in passes of 8 × 65 rows: prefill 20.2 -> 19.2 s).
 *
 * Row exactness: every step computes a row from that row alone (plus the cached prefix it attends),
 * by one fixed sequence of operations, whatever R is — so a verify row equals a decode step bit for
 * bit, as in the torch model. The torch model (models/transformer.py) is the reference; bias, RoPE,
 * the cache write, the matmuls and the attention are the same operations on the same values, while
 * RMSNorm's sum of squares and SiLU's exponential differ from torch's in the last bits (the tests
 * compare the two passes with a tolerance, and each path with itself bit for bit).
 *
 * Layout: x (R, C) float32, updated in place (the residual stream); cos, sin (P, D), the rotary angles
 * of positions 0 … P-1 (a row at position p reads row p); pos (R) int64, each in 0 … P-1;
 * the cache of layer l is kv_view's addressing over kstore/vstore + l · layer_stride (elements: float32,
 * bf16 (bf16 set), or int8 with a scale per sg dimensions of each position and head in kscale/vscale
 * + l · sc_layer_stride, kernels.h).
 */
#include "kernels.h"

/* Rows per chunk of a wide pass: more rows run in near-equal chunks of at most this many (a 65-row
   piece stays whole). */
#ifndef CHUNK_ROWS
#define CHUNK_ROWS 72
#endif

/* One linear layer: format 0 = int8 (w: gemm.c's packed int8, scale: (N) float32, super unused), 1 = int4
   (w, scale, super: gemm4.c's packed nibbles, the groups' 8-bit multipliers, the super-blocks' fp16 factors),
   2 = int6 (w, scale, super: gemm6.c's packed words, the half-groups' int8 scales, the fp16 factors). */
typedef struct {
    int64_t format;
    const void *w, *scale, *super;
} linear_weights;

typedef struct {
    const float *ln1, *ln2;                                 /* (C) RMSNorm weights */
    const float *qkv_bias;                                  /* (H + 2 H_kv) · D, or NULL */
    linear_weights qkv;                                     /* (H + 2 H_kv) · D outputs from C */
    linear_weights o;                                       /* C outputs from H · D */
    linear_weights gu;                                      /* 2I outputs from C: gate rows, then up rows */
    linear_weights down;                                    /* C outputs from I */
} layer_weights;

/* y (R, N) = x (R, K) through one linear, its rows rounded as the linear's format wants (int8: 16-bit
   per row; int4 and int6: 8-bit per group of 32). Scratch: qx (R · kpad(K) int16), sx (R + 2 R · K/32
   floats + R · K/16 int32). */
static void linear_ws(const linear_weights *lw, const float *x, int16_t *qx, float *sx, float *y,
                      long R, long N, long K) {
    if (lw->format == 2) {
        float *xs = sx + R * (K / 32);
        int32_t *qs = (int32_t *)(xs + R * (K / 32));
        vs_quantize_groups8_ws(x, R, K, (int8_t *)qx, sx, xs);
        vs_int6_gemm_ws((const int8_t *)qx, sx, qs, lw->w, lw->scale, lw->super, y, R, N, K);
    } else if (lw->format == 1) {
        float *xs = sx + R * (K / 32);
        vs_quantize_groups8_ws(x, R, K, (int8_t *)qx, sx, xs);
        vs_int4_gemm_ws((const int8_t *)qx, sx, xs, lw->w, lw->scale, lw->super, y, R, N, K);
    } else {
        vs_quantize_rows_ws(x, R, K, qx, sx);
        vs_int8_gemm_ws(qx, sx, lw->w, lw->scale, y, R, N, K);
    }
}

typedef struct {
    long layers, C, H, Hkv, D, I;
    float eps, scale;                                       /* RMSNorm epsilon; attention scale D^-1/2 */
} decoder_dims;

/* y = w · (x / sqrt(mean(x²) + eps)) for one row of C, the torch model's order of the last two products. */
static void rmsnorm_row(const float *xr, const float *w, float *y, long C, float eps) {
    __m256 acc = _mm256_setzero_ps();
    long c = 0;
    for (; c + 8 <= C; c += 8) {
        __m256 v = _mm256_loadu_ps(xr + c);
        acc = _mm256_add_ps(acc, _mm256_mul_ps(v, v));
    }
    float ss = hsum(acc);
    for (; c < C; c++) ss += xr[c] * xr[c];
    float inv = 1.0f / sqrtf(ss / (float)C + eps);
    for (c = 0; c < C; c++) y[c] = w[c] * (xr[c] * inv);
}

static void rmsnorm_ws(const float *x, const float *w, float *y, long R, long C, float eps) {
#pragma omp for schedule(static)
    for (long r = 0; r < R; r++) rmsnorm_row(x + r * C, w, y + r * C, C, eps);
}

/* Element-wise steps run over (row, span of SPAN columns) work items, so that a pass of one or two
   rows keeps every thread busy; an element's operations do not depend on its span (SPAN is a multiple
   of 8, the vector width, so the same elements take the vector loop and the scalar tail). */
#define SPAN 512

static void add_rows_ws(float *x, const float *y, long R, long C) {
    long spans = (C + SPAN - 1) / SPAN;
#pragma omp for schedule(static)
    for (long it = 0; it < R * spans; it++) {
        long r = it / spans, c0 = it % spans * SPAN, c1 = c0 + SPAN < C ? c0 + SPAN : C;
        for (long c = c0; c < c1; c++) x[r * C + c] += y[r * C + c];
    }
}

/* act[r, i] = silu(gate[r, i]) · up[r, i] with gu = [gate | up] (R, 2I); silu(x) = x · σ(x), σ from
   e = exp(-|x|): 1 / (1 + e) for x ≥ 0, e / (1 + e) below. */
static void silu_mul_ws(const float *gu, float *act, long R, long I) {
    long spans = (I + SPAN - 1) / SPAN;
#pragma omp for schedule(static)
    for (long it = 0; it < R * spans; it++) {
        long r = it / spans, i = it % spans * SPAN, end = i + SPAN < I ? i + SPAN : I;
        const float *g = gu + r * 2 * I, *u = g + I;
        float *a = act + r * I;
        const __m256 one = _mm256_set1_ps(1.0f), absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
        for (; i + 8 <= end; i += 8) {
            __m256 x = _mm256_loadu_ps(g + i);
            __m256 e = exp_neg(_mm256_sub_ps(_mm256_setzero_ps(), _mm256_and_ps(x, absmask)));
            __m256 den = _mm256_add_ps(one, e);
            __m256 pos = _mm256_div_ps(one, den), neg = _mm256_div_ps(e, den);
            __m256 sig = _mm256_blendv_ps(neg, pos, _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_GE_OQ));
            _mm256_storeu_ps(a + i, _mm256_mul_ps(_mm256_mul_ps(x, sig), _mm256_loadu_ps(u + i)));
        }
        for (; i < end; i++) {
            float x = g[i], e = expf(-fabsf(x)), sig = x >= 0.0f ? 1.0f / (1.0f + e) : e / (1.0f + e);
            a[i] = (x * sig) * u[i];
        }
    }
}

/* Bias, RoPE (rotate-half: v·cos + rot(v)·sin with rot(v) = [-v₂, v₁], cos and sin the tables' rows
   at the row's position) and the cache write, one head vector of one row per work item, for R rows that
   start at row r0 of the pass (a chunk; its rows' batch rows, and so their block tables, count from
   there). */
static void qkv_post_ws(float *qkv, const float *bias, const float *cos, const float *sin, const int64_t *pos,
                        const kv_view *kv, long r0, long R, long T, long H, long Hkv, long D) {
    long heads = H + 2 * Hkv, half = D / 2;
#pragma omp for schedule(static)
    for (long it = 0; it < R * heads; it++) {
        long r = it / heads, j = it % heads;
        float *v = qkv + r * heads * D + j * D;
        if (bias)
            for (long d = 0; d < D; d++) v[d] = v[d] + bias[j * D + d];
        if (j < H + Hkv) {
            float rot[512], tmp[512];
            const float *cr = cos + pos[r] * D, *sr = sin + pos[r] * D;
            for (long d = 0; d < half; d++) rot[d] = -v[d + half];
            for (long d = half; d < D; d++) rot[d] = v[d - half];
            for (long d = 0; d < D; d++) {
                float a = v[d] * cr[d], b = rot[d] * sr[d];
                tmp[d] = a + b;
            }
            memcpy(v, tmp, sizeof(float) * D);
        }
        if (j >= H) {
            long kh = (j - H) % Hkv, p = pos[r], is_k = j < H + Hkv;
            const int64_t *table = kv->tables + ((r0 + r) / T) * kv->nb;
            long chunk = table[p / kv->bs] * kv->blk_stride + kh * kv->head_stride, at = chunk + (p % kv->bs) * D;
            if (kv->ks) {
                long sat = table[p / kv->bs] * kv->sc_blk_stride + kh * kv->sc_head_stride + (p % kv->bs) * (D / kv->sg);
                int8_t *store = (int8_t *)(is_k ? kv->k : kv->v);
                float *scales = (float *)(is_k ? kv->ks : kv->vs);
                kv_quantize(v, D, kv->sg, store + at, scales + sat);
            } else if (kv->bf16) {
                uint16_t *store = (uint16_t *)(is_k ? kv->k : kv->v) + chunk;
                for (long d = 0; d < D; d++)
                    store[is_k ? bf16_key_at(p % kv->bs, d, D) : bf16_value_at(p % kv->bs, d, D)] = f32_to_bf16(v[d]);
            } else {
                memcpy((float *)(is_k ? kv->k : kv->v) + at, v, sizeof(float) * D);
            }
        }
    }
}

/* The two ends of a whole-model pass (verispec_pass): the token embeddings going in; the final norm and
   the LM head on the rows whose logits are wanted coming out. */
typedef struct {
    const int64_t *ids;                                     /* (R) token ids, each in 0 … vocab-1 */
    int64_t embed_format;                                   /* 0: float32 rows (vocab, C); 1: gemm4.c's int4 layout */
    const void *embed_w, *embed_scale, *embed_super;        /* the table; int4: its groups' and super-blocks' numbers */
    long vocab;
    const float *norm;                                      /* (C) the final RMSNorm's weight */
    float norm_eps;
    linear_weights head;                                    /* N outputs from C, no bias */
    long N;
    const int64_t *rows;                                    /* (Bn, Rn): rows t of the first Bn batch rows; */
    long Bn, Rn;                                            /*   any order, repeats allowed */
    float *states;                                          /* (Bn, Rn, C) out: those rows final-normed */
    float *logits;                                          /* (Bn, Rn, N) out */
} pass_ends;

static void embed_ws(const pass_ends *e, float *x, long R, long C) {
#pragma omp for schedule(static)
    for (long r = 0; r < R; r++) {
        if (e->embed_format == 1)
            vs_int4_row(e->embed_w, e->embed_scale, e->embed_super, e->ids[r], C, x + r * C);
        else
            memcpy(x + r * C, (const float *)e->embed_w + e->ids[r] * C, sizeof(float) * C);
    }
}

/* The layers over x (R, C), then, with ends, the final norm and the LM head on the n rows out[0 … n-1] of
   the pass (flat indices), in chunks of at most RC rows (the scratch's row count). keep as
   verispec_decoder's. */
static int run_pass(float *x, const pass_ends *ends, const int64_t *out, long n_out, const layer_weights *lw,
                    const decoder_dims *dm, const float *cos, const float *sin, long P, const int64_t *pos, long B,
                    long T, void *kstore, void *vstore, long layer_stride, const int64_t *tables, long nb,
                    long bs, long blk_stride, long head_stride, float *kscale, float *vscale, long sc_layer_stride,
                    long sc_blk_stride, long sc_head_stride, long sg, int bf16, const int64_t *keep, long nkeep,
                    int threads) {
    bf16 = bf16 && !kscale;
    size_t esize = (size_t)kv_esize(kscale != NULL, bf16);
    long R = B * T, C = dm->C, H = dm->H, Hkv = dm->Hkv, D = dm->D, I = dm->I;
    long QW = (H + 2 * Hkv) * D, KMAX = kpad(C > H * D ? (C > I ? C : I) : (H * D > I ? H * D : I));
    long chunks = (R + CHUNK_ROWS - 1) / CHUNK_ROWS, RC = (R + chunks - 1) / chunks;   /* near-equal chunks */
    long maxp = 0;
    for (long r = 0; r < R; r++) {
        if (pos[r] < 0 || pos[r] >= P) return -2;
        maxp = pos[r] > maxp ? pos[r] : maxp;
    }
    long SP = spad(maxp + 1);
    size_t floats = (size_t)R * (2 * C + QW + H * D) + (size_t)RC * (3 * I) + (size_t)RC * (2 * (KMAX / 32) + KMAX / 16 + 1)
                    + (size_t)att_scratch(T, SP) * threads + (ends ? (size_t)R * C : 0);
    float *arena = malloc(sizeof(float) * floats + sizeof(int16_t) * RC * KMAX + 64);
    if (!arena) return -1;
    float *xn = arena, *tmp = xn + R * C, *qkv = tmp + R * C, *att = qkv + R * QW, *gu = att + R * H * D;
    float *act = gu + RC * 2 * I, *sx = act + RC * I, *scratch = sx + RC * (2 * (KMAX / 32) + KMAX / 16 + 1);
    float *embedded = scratch + (size_t)att_scratch(T, SP) * threads;
    int16_t *qx = (int16_t *)(embedded + (ends ? R * C : 0));
    if (ends) x = embedded;
#pragma omp parallel num_threads(threads)
    {
        if (ends) embed_ws(ends, x, R, C);
        for (long l = 0; l < dm->layers; l++) {
            const layer_weights *w = lw + l;
            kv_view kv = {(char *)kstore + esize * l * layer_stride, (char *)vstore + esize * l * layer_stride,
                          kscale ? kscale + l * sc_layer_stride : NULL, vscale ? vscale + l * sc_layer_stride : NULL,
                          tables, nb, bs, blk_stride, head_stride, sc_blk_stride, sc_head_stride, kscale ? sg : D,
                          bf16};
            for (long r0 = 0; r0 < R; r0 += RC) {                  /* every row's keys and values first */
                long n = R - r0 < RC ? R - r0 : RC;
                rmsnorm_ws(x + r0 * C, w->ln1, xn + r0 * C, n, C, dm->eps);
                linear_ws(&w->qkv, xn + r0 * C, qx, sx, qkv + r0 * QW, n, QW, C);
                qkv_post_ws(qkv + r0 * QW, w->qkv_bias, cos, sin, pos + r0, &kv, r0, n, T, H, Hkv, D);
            }
            if (nkeep != 0 || l != dm->layers - 1)                /* no row kept: the last attention unread */
                vs_attend_ws(qkv, QW, &kv, pos, att, B, H, Hkv, T, D, dm->scale, scratch, SP);
            long RL = R;                                           /* rows that go on past the attention */
            if (nkeep >= 0 && l == dm->layers - 1) {               /* the last layer: only the rows kept */
#pragma omp single
                for (long i = 0; i < nkeep; i++)                   /* keep[i] >= i: moves towards the front */
                    if (keep[i] != i) {
                        memmove(x + i * C, x + keep[i] * C, sizeof(float) * C);
                        memmove(att + i * H * D, att + keep[i] * H * D, sizeof(float) * H * D);
                    }
                RL = nkeep;
            }
            for (long r0 = 0; r0 < RL; r0 += RC) {                 /* then each row's own steps, chunk by chunk */
                long n = RL - r0 < RC ? RL - r0 : RC;
                float *xr = x + r0 * C, *xnr = xn + r0 * C, *tr = tmp + r0 * C;
                linear_ws(&w->o, att + r0 * H * D, qx, sx, tr, n, C, H * D);
                add_rows_ws(xr, tr, n, C);
                rmsnorm_ws(xr, w->ln2, xnr, n, C, dm->eps);
                linear_ws(&w->gu, xnr, qx, sx, gu, n, 2 * I, C);
                silu_mul_ws(gu, act, n, I);
                linear_ws(&w->down, act, qx, sx, tr, n, C, I);
                add_rows_ws(xr, tr, n, C);
            }
            if (RL < R) {
#pragma omp single
                for (long i = nkeep - 1; i >= 0; i--)              /* back to their rows, the last first */
                    if (keep[i] != i) memcpy(x + keep[i] * C, x + i * C, sizeof(float) * C);
            }
        }
        if (ends) {                                                /* the final norm and the LM head */
#pragma omp for schedule(static)
            for (long i = 0; i < n_out; i++)
                rmsnorm_row(x + out[i] * C, ends->norm, ends->states + i * C, C, ends->norm_eps);
            for (long r0 = 0; r0 < n_out; r0 += RC) {
                long n = n_out - r0 < RC ? n_out - r0 : RC;
                linear_ws(&ends->head, ends->states + r0 * C, qx, sx, ends->logits + r0 * ends->N, n, ends->N, C);
            }
        }
    }
    free(arena);
    return 0;
}

/* keep (nkeep row indices into the R rows, strictly ascending; nkeep < 0 for all rows): the rows whose
   hidden states the caller reads. A prefill piece needs only its keys and values, which every layer
   writes before its attention, so the last layer's o_proj and MLP run on the kept rows alone, each
   the same operations as in a full pass (row-exact), and its attention not at all when none is kept;
   the other rows of x then hold no meaningful values. The caller checks the indices
   (kernels._decoder).
   Returns 0, -1 when the scratch buffers cannot be allocated, or -2 when a position is outside 0 … P-1
   (nothing is computed). */
int verispec_decoder(float *x, const layer_weights *lw, const decoder_dims *dm, const float *cos, const float *sin,
                     long P, const int64_t *pos, long B, long T, void *kstore, void *vstore, long layer_stride,
                     const int64_t *tables, long nb, long bs, long blk_stride, long head_stride,
                     float *kscale, float *vscale, long sc_layer_stride, long sc_blk_stride, long sc_head_stride,
                     long sg, int bf16, const int64_t *keep, long nkeep, int threads) {
    return run_pass(x, NULL, NULL, 0, lw, dm, cos, sin, P, pos, B, T, kstore, vstore, layer_stride, tables, nb, bs,
                    blk_stride, head_stride, kscale, vscale, sc_layer_stride, sc_blk_stride, sc_head_stride, sg, bf16,
                    keep, nkeep, threads);
}

/* A whole model's pass in one call: the embeddings of ends->ids, the decoder layers (as verispec_decoder,
   the cache arguments alike), then the final norm and the LM head on ends->rows, into ends->states and
   ends->logits — the same operations as the separate calls (int4_rows, decoder, rmsnorm_rows and the
   head's matmul), so the same bits. The last layer runs o_proj and the MLP on those rows alone.
   Returns 0, -1 when the buffers cannot be allocated, -2 when a position is outside 0 … P-1, -3 when a
   token id is outside 0 … vocab-1, -4 when Bn > B or a row is outside 0 … T-1 (for the last three,
   nothing is computed or written). */
int verispec_pass(const pass_ends *ends, const layer_weights *lw, const decoder_dims *dm, const float *cos,
                  const float *sin, long P, const int64_t *pos, long B, long T, void *kstore, void *vstore,
                  long layer_stride, const int64_t *tables, long nb, long bs, long blk_stride, long head_stride,
                  float *kscale, float *vscale, long sc_layer_stride, long sc_blk_stride, long sc_head_stride,
                  long sg, int bf16, int threads) {
    long R = B * T, n = ends->Bn * ends->Rn;
    for (long r = 0; r < R; r++)
        if (ends->ids[r] < 0 || ends->ids[r] >= ends->vocab) return -3;
    if (ends->Bn < 0 || ends->Rn < 0 || ends->Bn > B) return -4;
    for (long i = 0; i < n; i++)
        if (ends->rows[i] < 0 || ends->rows[i] >= T) return -4;
    int64_t *keep = malloc(sizeof(int64_t) * (R + n + 1));  /* the rows read, ascending, each once */
    if (!keep) return -1;
    int64_t *out = keep + R;                                /* each output's flat row */
    for (long r = 0; r < R; r++) keep[r] = 0;
    for (long i = 0; i < n; i++) {
        out[i] = i / ends->Rn * T + ends->rows[i];
        keep[out[i]] = 1;
    }
    long nkeep = 0;
    for (long r = 0; r < R; r++)
        if (keep[r]) keep[nkeep++] = r;
    int status = run_pass(NULL, ends, out, n, lw, dm, cos, sin, P, pos, B, T, kstore, vstore, layer_stride, tables,
                          nb, bs, blk_stride, head_stride, kscale, vscale, sc_layer_stride, sc_blk_stride,
                          sc_head_stride, sg, bf16, keep, nkeep == R ? -1 : nkeep, threads);
    free(keep);
    return status;
}

/* The final norm on gathered rows: out[b, i] = rmsnorm(x[b, rows[b, i]]) for x (B, T, C), rows (B, n),
   out (B, n, C) — the decoder's per-row norm, one thread (a few rows). Returns 0, or -1 when a row is
   outside 0 … T-1. */
int verispec_rmsnorm_rows(const float *x, const int64_t *rows, long B, long n, long T, long C, const float *w,
                          float eps, float *out) {
    for (long i = 0; i < B * n; i++)
        if (rows[i] < 0 || rows[i] >= T) return -1;
    for (long b = 0; b < B; b++)
        for (long i = 0; i < n; i++)
            rmsnorm_row(x + (b * T + rows[b * n + i]) * C, w, out + (b * n + i) * C, C, eps);
    return 0;
}
