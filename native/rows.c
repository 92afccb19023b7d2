/* Row-wise steps between the matmuls, as llama.cpp computes them on the CPU: RMS norm and
 * rotary embeddings. A decode step makes about a hundred of these on rows of a few hundred
 * floats, where each torch operation costs more to dispatch than to compute. Every row is
 * computed alone, in one order, so a row's result does not depend on the rows beside it.
 * (SwiGLU's silu(gate) * up stays torch's: it is vectorized there; a scalar expf here cost a
 * 512-token prefill 16 % and eight streams 12 %.) */

#include <math.h>
#include <stddef.h>

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
