/* Every transformer layer of a step in one call: the torch runner's forward on the CPU where
 * each matrix is read in place (models/llama.py, models/gemma3.py hand over here). A decode
 * step of a 0.5B model runs some twenty small operations a layer between its matmuls; each
 * cost a torch dispatch and Python's turn, about 6 ms a token on a 2-core laptop-class CPU,
 * a fifth of the step. Here they are loops over rows.
 *
 * A layer, for the N tokens of the step (x: (N, d) float32, updated in place):
 *   h = rms_norm(x, attn_norm); q | k | v = h W_qkv^T (+ bias), in the groups the weights are
 *   joined in; gemma3: q, k rms-normed per head; q, k rotated (the step's cos / sin rows of the
 *   layer's rope); k, v written to the layer's pool at the tokens' slots (f32, f16, or q8_0
 *   with per-token scales, keys divided by the layer's smoothing first); attention
 *   (attention.c) with the queries times that smoothing; o = a W_o^T; gemma3: o rms-normed;
 *   x += o; h = rms_norm(x, ffn_norm); gate | up = h W^T; f = act(gate) * up; f = f W_down^T;
 *   gemma3: f rms-normed; x += f.
 * Each row is computed alone, in one order, with the very kernels the torch path calls, so a
 * token's result does not depend on the tokens beside it (a position decoded alone equals the
 * same position checked among drafts) nor on the CPU's tier.
 *
 * act: silu (rows.c's lm_silu_mul, as the torch path calls it), or GELU through the table of
 * 65,536 floats indexed by the float16 bits of gate (rounded to nearest even) with llama.cpp's
 * rule (0 at or below -10, gate at or above 10), as layers.gelu_ggml looks it up. */

#include <stdlib.h>
#include <string.h>

#include "localllm_native.h"

typedef struct {
    const uint8_t *w; /* the blocks, (n_out, row bytes) */
    int wtype, n_out;
    const float *bias; /* (n_out) or NULL */
} lm_mat_t;

typedef struct {
    const float *attn_norm, *q_norm, *k_norm, *post_attn_norm, *ffn_norm, *post_ffn_norm; /* NULL: none */
    lm_mat_t qkv[3];
    int n_qkv;
    lm_mat_t o;
    lm_mat_t gate_up[2];
    int n_gate_up;
    lm_mat_t down;
    void *k_cache, *v_cache;         /* this layer's pool, (slots, n_kv, hd) */
    uint16_t *k_scales, *v_scales;   /* q8_0: (slots, n_kv) float16 */
    const float *k_smooth;           /* q8_0: (n_kv, hd) or NULL */
    int rope;                        /* which of the step's rope tables (0 or 1) */
    int n_swa;
} lm_layer_t;

typedef struct {
    int n_layer, d, n_head, n_kv, hd, d_ff, neox, kv_type, block_size, act; /* act: LM_ACT_* */
    float eps, scale;
    const float *act_table; /* GELU's (65536); NULL for silu */
    const lm_layer_t *layers;
} lm_model_t;

#define LM_ACT_SILU 0
#define LM_ACT_GELU 1

/* float16 bits of x, rounded to nearest even (as torch's .to(float16)). */
static inline uint16_t half_bits(float x) {
#ifdef __FLT16_MAX__
    _Float16 h = (_Float16)x;
    uint16_t b;
    memcpy(&b, &h, 2);
    return b;
#else
    uint32_t f;
    memcpy(&f, &x, 4);
    const uint32_t sign = (f >> 16) & 0x8000;
    f &= 0x7fffffff;
    if (f >= 0x7f800000) return (uint16_t)(sign | 0x7c00 | (f > 0x7f800000 ? 0x200 : 0)); /* inf, NaN */
    if (f >= 0x477ff000) return (uint16_t)(sign | 0x7c00); /* rounds past the largest half */
    if (f < 0x38800000) { /* a subnormal half (or zero): round x * 2^24 to an integer */
        float a;
        memcpy(&a, &f, 4);
        const float v = a * 16777216.0f + 12582912.0f; /* ties to even in the float add */
        uint32_t i;
        memcpy(&i, &v, 4);
        return (uint16_t)(sign | ((i & 0x7fffff) - 0x400000));
    }
    const uint32_t mant_odd = (f >> 13) & 1;
    f += 0xfff + mant_odd; /* round to nearest even at bit 13 */
    return (uint16_t)(sign | ((f - 0x38000000) >> 13));
#endif
}

/* llama.cpp's GELU: 0 at or below -10, g at or above 10, else the table at g's float16 bits. */
static inline float gelu_of(const float *table, float g) {
    return g <= -10.0f ? 0.0f : g >= 10.0f ? g : table[half_bits(g)];
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define F16C_TARGET __attribute__((target("avx2,fma,f16c")))

/* GELU * up for n values, 8 at a time (F16C's rounding is the same as half_bits'). */
F16C_TARGET static void gelu_mul_f16c(const float *table, const float *gate, const float *up, float *out, int n) {
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 g = _mm256_loadu_ps(gate + i);
        const __m128i h = _mm256_cvtps_ph(g, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        __m256 a = _mm256_i32gather_ps(table, _mm256_cvtepu16_epi32(h), 4);
        a = _mm256_blendv_ps(a, g, _mm256_cmp_ps(g, _mm256_set1_ps(10.0f), _CMP_GE_OQ));
        a = _mm256_blendv_ps(a, _mm256_setzero_ps(), _mm256_cmp_ps(g, _mm256_set1_ps(-10.0f), _CMP_LE_OQ));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(a, _mm256_loadu_ps(up + i)));
    }
    for (; i < n; i++) out[i] = gelu_of(table, gate[i]) * up[i];
}

/* Halves of n floats (the f16 pool's rows). */
F16C_TARGET static void halves_of_f16c(const float *x, uint16_t *out, int n) {
    int i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(out + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    for (; i < n; i++) out[i] = half_bits(x[i]);
}
#endif

/* out = act(gate) * up for n values: silu (rows.c), or GELU through its table. */
static void act_mul(const lm_model_t *m, const float *gate, const float *up, float *out, int n) {
    if (m->act == LM_ACT_SILU) {
        lm_silu_mul(gate, up, out, 1, n, n, n);
        return;
    }
#if defined(__x86_64__) && defined(__GNUC__)
    if (lm_isa_f16c()) {
        gelu_mul_f16c(m->act_table, gate, up, out, n);
        return;
    }
#endif
    for (int i = 0; i < n; i++) out[i] = gelu_of(m->act_table, gate[i]) * up[i];
}

static void halves_of(const float *x, uint16_t *out, int n) {
#if defined(__x86_64__) && defined(__GNUC__)
    if (lm_isa_f16c()) {
        halves_of_f16c(x, out, n);
        return;
    }
#endif
    for (int i = 0; i < n; i++) out[i] = half_bits(x[i]);
}

/* One row of hd values as q8_0 (attention.py's quantize_rows): scale = absmax / 127 rounded
 * to float16, q = x / scale rounded to nearest even, within [-127, 127]; a zero row: 0s. */
static void q8_row(const float *x, int hd, int8_t *q, uint16_t *scale) {
    float amax = 0.0f;
    for (int i = 0; i < hd; i++) {
        const float a = x[i] < 0 ? -x[i] : x[i];
        if (a > amax) amax = a;
    }
    const uint16_t sb = half_bits(amax / 127.0f);
    const float s = lm_half_to_float(sb);
    *scale = sb;
    for (int i = 0; i < hd; i++) {
        float v = s > 0 ? __builtin_nearbyintf(x[i] / s) : 0.0f;
        v = v < -127.0f ? -127.0f : v > 127.0f ? 127.0f : v;
        q[i] = (int8_t)v;
    }
}

/* y (N, a->n_out) = x (N, K) W^T (+ bias), written at column ``col`` of rows of ``ld``. */
static int matmul(const lm_mat_t *a, const float *x, int N, int K, float *y, int ld, int col, float *tmp,
                  int n_threads) {
    float *out = ld == a->n_out && col == 0 ? y : tmp;
    const int rc = lm_qmatmul(x, N, K, a->w, a->wtype, a->n_out, out, n_threads, 0);
    if (rc) return rc;
    for (int t = 0; t < N; t++) {
        float *row = y + (size_t)t * ld + col;
        if (out != y) memcpy(row, out + (size_t)t * a->n_out, sizeof(float) * a->n_out);
        if (a->bias)
            for (int j = 0; j < a->n_out; j++) row[j] = row[j] + a->bias[j];
    }
    return LM_OK;
}

static void add_rows(float *x, const float *y, size_t n) {
    for (size_t i = 0; i < n; i++) x[i] = x[i] + y[i];
}

int lm_layers_forward(const lm_model_t *m, float *x, int N, const int64_t *slots, int num_seqs,
                      const int32_t *q_start, const int32_t *q_len, const int32_t *ctx_len, const int32_t *tables,
                      const int32_t *table_start, const float *const *cos, const float *const *sin, int n_threads) {
    const int d = m->d, hd = m->hd, nq = m->n_head * hd, nk = m->n_kv * hd, ff = m->d_ff;
    const int qkv_n = nq + 2 * nk, group = m->n_head / (m->n_kv > 0 ? m->n_kv : 1);
    if (N <= 0) return N == 0 ? LM_OK : LM_EINVAL;
    if (m->n_kv <= 0 || m->n_head % m->n_kv || hd % 2) return LM_EINVAL;
    size_t widest = (size_t)d; /* the widest matmul output: tmp's rows */
    if ((size_t)qkv_n > widest) widest = (size_t)qkv_n;
    if ((size_t)2 * ff > widest) widest = (size_t)2 * ff;
    /* h (N, d), qkv (N, qkv_n), q (N, nq), k and v (N, nk), attn (N, nq), gu (N, 2 ff), act (N, ff), tmp */
    const size_t sizes[] = {(size_t)N * d, (size_t)N * qkv_n, (size_t)N * nq, (size_t)N * nk, (size_t)N * nk,
                            (size_t)N * nq, (size_t)N * 2 * ff, (size_t)N * ff, (size_t)N * widest};
    size_t total = 0;
    for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]); i++) total += sizes[i];
    float *buf = malloc(sizeof(float) * total), *p = buf;
    if (buf == NULL) return LM_ENOMEM;
    float *h = p; p += sizes[0];
    float *qkv = p; p += sizes[1];
    float *q = p; p += sizes[2];
    float *k = p; p += sizes[3];
    float *v = p; p += sizes[4];
    float *attn = p; p += sizes[5];
    float *gu = p; p += sizes[6];
    float *act = p; p += sizes[7];
    float *tmp = p;
    int rc = LM_OK;
    for (int li = 0; li < m->n_layer && rc == LM_OK; li++) {
        const lm_layer_t *L = m->layers + li;
        lm_rms_norm(x, L->attn_norm, h, N, d, m->eps);
        for (int g = 0, col = 0; g < L->n_qkv && rc == LM_OK; col += L->qkv[g].n_out, g++)
            rc = matmul(&L->qkv[g], h, N, d, qkv, qkv_n, col, tmp, n_threads);
        if (rc) break;
        for (int t = 0; t < N; t++) {
            const float *row = qkv + (size_t)t * qkv_n;
            memcpy(q + (size_t)t * nq, row, sizeof(float) * nq);
            memcpy(k + (size_t)t * nk, row + nq, sizeof(float) * nk);
            memcpy(v + (size_t)t * nk, row + nq + nk, sizeof(float) * nk);
        }
        if (L->q_norm) lm_rms_norm(q, L->q_norm, q, N * m->n_head, hd, m->eps);
        if (L->k_norm) lm_rms_norm(k, L->k_norm, k, N * m->n_kv, hd, m->eps);
        lm_rope(q, q, cos[L->rope], sin[L->rope], N, m->n_head, hd, m->neox);
        lm_rope(k, k, cos[L->rope], sin[L->rope], N, m->n_kv, hd, m->neox);
        /* the new keys and values to the pool */
        for (int t = 0; t < N; t++) {
            const size_t at = (size_t)slots[t] * nk;
            float *kt = k + (size_t)t * nk, *vt = v + (size_t)t * nk;
            if (m->kv_type == LM_KV_F32) {
                memcpy((float *)L->k_cache + at, kt, sizeof(float) * nk);
                memcpy((float *)L->v_cache + at, vt, sizeof(float) * nk);
            } else if (m->kv_type == LM_KV_F16) {
                halves_of(kt, (uint16_t *)L->k_cache + at, nk);
                halves_of(vt, (uint16_t *)L->v_cache + at, nk);
            } else {
                if (L->k_smooth)
                    for (int j = 0; j < nk; j++) kt[j] = kt[j] / L->k_smooth[j];
                for (int hh = 0; hh < m->n_kv; hh++) {
                    const size_t row = (size_t)slots[t] * m->n_kv + hh;
                    q8_row(kt + (size_t)hh * hd, hd, (int8_t *)L->k_cache + at + (size_t)hh * hd, L->k_scales + row);
                    q8_row(vt + (size_t)hh * hd, hd, (int8_t *)L->v_cache + at + (size_t)hh * hd, L->v_scales + row);
                }
            }
        }
        if (L->k_smooth) /* the queries carry the keys' smoothing: head h takes KV head h / group's */
            for (int t = 0; t < N; t++)
                for (int hh = 0; hh < m->n_head; hh++) {
                    float *qh = q + ((size_t)t * m->n_head + hh) * hd;
                    const float *s = L->k_smooth + (size_t)(hh / group) * hd;
                    for (int j = 0; j < hd; j++) qh[j] = qh[j] * s[j];
                }
        rc = lm_paged_attention(q, attn, L->k_cache, L->v_cache, L->k_scales, L->v_scales, m->kv_type, num_seqs,
                                q_start, q_len, ctx_len, tables, table_start, m->block_size, m->n_head, m->n_kv, hd,
                                m->scale, L->n_swa, n_threads);
        if (rc || (rc = matmul(&L->o, attn, N, nq, h, d, 0, tmp, n_threads))) break;
        if (L->post_attn_norm) lm_rms_norm(h, L->post_attn_norm, h, N, d, m->eps);
        add_rows(x, h, (size_t)N * d);
        lm_rms_norm(x, L->ffn_norm, h, N, d, m->eps);
        for (int g = 0, col = 0; g < L->n_gate_up && rc == LM_OK; col += L->gate_up[g].n_out, g++)
            rc = matmul(&L->gate_up[g], h, N, d, gu, 2 * ff, col, tmp, n_threads);
        if (rc) break;
        for (int t = 0; t < N; t++)
            act_mul(m, gu + (size_t)t * 2 * ff, gu + (size_t)t * 2 * ff + ff, act + (size_t)t * ff, ff);
        if ((rc = matmul(&L->down, act, N, ff, h, d, 0, tmp, n_threads))) break;
        if (L->post_ffn_norm) lm_rms_norm(h, L->post_ffn_norm, h, N, d, m->eps);
        add_rows(x, h, (size_t)N * d);
    }
    free(buf);
    return rc;
}
