/* Row-wise steps between the matmuls, as llama.cpp computes them on the CPU: RMS norm and
 * rotary embeddings. A decode step makes about a hundred of these on rows of a few hundred
 * floats, where each torch operation costs more to dispatch than to compute. Every row is
 * computed alone, in one order, so a row's result does not depend on the rows beside it.
 * SwiGLU's silu(gate) * up is here too, with an exp of its own (vectorized: a scalar expf
 * cost a 512-token prefill 16 % and eight streams 12 %). */

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "localllm_native.h"

/* y = x / sqrt(mean(x^2) + eps) * w per row of n: the squares summed in double one after
 * another, the scale 1 / sqrtf(mean + eps) in float, then x * scale and that times w, each
 * rounded to float (ggml_compute_forward_rms_norm_f32, then ggml_mul). */
int lm_rms_norm(const float *x, const float *w, float *y, int rows, int n, float eps) {
    if (rows < 0 || n <= 0) return LM_EINVAL;
    for (int r = 0; r < rows; r++) {
        const float *xr = x + (size_t)r * n;
        float *yr = y + (size_t)r * n;
        double sum = 0.0;
        for (int i = 0; i < n; i++) sum += (double)(xr[i] * xr[i]);
        const float mean = (float)(sum / n);
        const float scale = 1.0f / sqrtf(mean + eps);
        for (int i = 0; i < n; i++) {
            const float v = xr[i] * scale;
            yr[i] = v * w[i];
        }
    }
    return LM_OK;
}

/* Rotary embeddings of rows (tokens) of heads of hd, in place of out: pair (a, b) of a head,
 * with cos c and sin s of the token's angle for that pair, becomes (a c - b s, a s + b c).
 * neox: the pairs are (i, i + hd/2), else (2i, 2i + 1). cs / sn: (rows, hd/2). */
int lm_rope(const float *x, float *out, const float *cs, const float *sn, int rows, int heads, int hd, int neox) {
    if (rows < 0 || heads <= 0 || hd <= 0 || hd % 2) return LM_EINVAL;
    const int half = hd / 2;
    for (int r = 0; r < rows; r++) {
        const float *c = cs + (size_t)r * half, *s = sn + (size_t)r * half;
        for (int h = 0; h < heads; h++) {
            const float *xh = x + ((size_t)r * heads + h) * hd;
            float *oh = out + ((size_t)r * heads + h) * hd;
            for (int i = 0; i < half; i++) {
                const int ia = neox ? i : 2 * i, ib = neox ? i + half : 2 * i + 1;
                const float a = xh[ia], b = xh[ib];
                oh[ia] = a * c[i] - b * s[i];
                oh[ib] = a * s[i] + b * c[i];
            }
        }
    }
    return LM_OK;
}

/* silu(g) * u = g / (1 + exp(-g)) * u, with exp(y) = 2^n * p(r): n = y / ln 2 rounded to
 * nearest even, r = y - n ln 2 (in two parts, each an fma), p the Taylor polynomial of degree
 * 7 by Horner's rule in fmas (within about an ulp for |r| <= ln 2 / 2), and 2^n added to p's
 * exponent as an integer. y is held to [-86, 88], where 2^n p stays a normal float. Every
 * step is one rounding in one order, written out (fma where it is one, never a product
 * feeding a sum the compiler could fuse), so the vector loop and the portable one give the
 * same bits. */
#define EXP_LO -86.0f
#define EXP_HI 88.0f
#define LOG2E 1.44269504088896341f
#define LN2_HI 0.693145751953125f
#define LN2_LO 1.42860682030941723e-6f
static const float exp_c[8] = {1.0f / 5040, 1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f};

static inline float silu_mul_one(float g, float u) {
    float y = -g;
    y = y < EXP_LO ? EXP_LO : y > EXP_HI ? EXP_HI : y;
    const float n = __builtin_nearbyintf(y * LOG2E);
    float r = fmaf(n, -LN2_HI, y);
    r = fmaf(n, -LN2_LO, r);
    float p = exp_c[0];
    for (int i = 1; i < 8; i++) p = fmaf(p, r, exp_c[i]);
    int32_t bits;
    memcpy(&bits, &p, 4);
    bits += (int32_t)n * (1 << 23);
    float e;
    memcpy(&e, &bits, 4);
    const float d = 1.0f + e;
    const float s = g / d;
    return s * u;
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

__attribute__((target("avx2,fma"))) static void silu_mul_avx2(const float *g, const float *u, float *out, int n) {
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 gv = _mm256_loadu_ps(g + i);
        __m256 y = _mm256_sub_ps(_mm256_setzero_ps(), gv);
        y = _mm256_min_ps(_mm256_max_ps(y, _mm256_set1_ps(EXP_LO)), _mm256_set1_ps(EXP_HI));
        const __m256 nf = _mm256_round_ps(_mm256_mul_ps(y, _mm256_set1_ps(LOG2E)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        __m256 r = _mm256_fmadd_ps(nf, _mm256_set1_ps(-LN2_HI), y);
        r = _mm256_fmadd_ps(nf, _mm256_set1_ps(-LN2_LO), r);
        __m256 p = _mm256_set1_ps(exp_c[0]);
        for (int k = 1; k < 8; k++) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(exp_c[k]));
        const __m256i e = _mm256_add_epi32(_mm256_castps_si256(p), _mm256_slli_epi32(_mm256_cvtps_epi32(nf), 23));
        const __m256 d = _mm256_add_ps(_mm256_set1_ps(1.0f), _mm256_castsi256_ps(e));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_div_ps(gv, d), _mm256_loadu_ps(u + i)));
    }
    for (; i < n; i++) out[i] = silu_mul_one(g[i], u[i]);
}
#endif

/* out (rows, n) = silu(gate) * up, gate and up rows ld_gate / ld_up floats apart. */
int lm_silu_mul(const float *gate, const float *up, float *out, int rows, int n, int ld_gate, int ld_up) {
    if (rows < 0 || n < 0 || ld_gate < n || ld_up < n) return LM_EINVAL;
    for (int r = 0; r < rows; r++) {
        const float *g = gate + (size_t)r * ld_gate, *u = up + (size_t)r * ld_up;
        float *o = out + (size_t)r * n;
#if defined(__x86_64__) && defined(__GNUC__)
        if (lm_isa() >= LM_ISA_AVX2) {
            silu_mul_avx2(g, u, o, n);
            continue;
        }
#endif
        for (int i = 0; i < n; i++) o[i] = silu_mul_one(g[i], u[i]);
    }
    return LM_OK;
}
