/* See kernels.h (llmc_experts). A step's (token, slot) pairs are sorted by expert, each expert's
 * rows gathered into one block, and each chosen expert then runs as two GEMMs over its block:
 * its weights stream once per step however many of the step's rows chose it, and an expert no
 * row chose is never read. */
#include "kernels.h"
#include "simd.h"

#include <stdatomic.h>
#include <string.h>

/* Bytes of expert weights (and biases) the op has read since the library loaded: each call adds
 * its chosen experts' once. What a benchmark reads to count a MoE decode step's expert reads. */
static _Atomic uint64_t bytes_read;

LLMC_EXPORT uint64_t llmc_experts_bytes_read(void) { return atomic_load(&bytes_read); }

/* One expert's weight (and bias) bytes in the call's format. */
static int64_t expert_bytes(const llmc_experts *a) {
    int64_t h = a->hidden, i = a->inter, bytes;
    if (llmc_format_bits(a->format))
        bytes = llmc_quant_bytes(h, 2 * i, a->format, a->block_size, a->zero_points) +
                llmc_quant_bytes(i, h, a->format, a->block_size, a->zero_points);
    else if (a->packed)
        bytes = (llmc_experts_groups(2 * i) * h + llmc_experts_groups(h) * i) * LLMC_PANEL * (int64_t)sizeof(float);
    else
        bytes = 3 * h * i * (int64_t)sizeof(float);
    return bytes + (a->gate_up_bias ? 2 * i * 4 : 0) + (a->down_bias ? h * 4 : 0);
}

const char *llmc_experts_plan(llmc_experts *a) {
    int64_t pairs = a->tokens * a->top_k;
    memset(a->start, 0, (size_t)(a->experts + 1) * sizeof *a->start);
    for (int64_t p = 0; p < pairs; p++) {
        if (a->ids[p] < 0 || a->ids[p] >= a->experts)
            return "an expert id is outside [0, number of experts)";
        a->start[a->ids[p] + 1]++;
    }
    for (int64_t e = 0; e < a->experts; e++)
        a->start[e + 1] += a->start[e];
    int64_t *next = a->used; /* each expert's next free row; used is filled in below */
    memcpy(next, a->start, (size_t)a->experts * sizeof *next);
    for (int64_t p = 0; p < pairs; p++)
        a->slot[next[a->ids[p]]++] = p;
    for (int64_t r = 0; r < pairs; r++) {
        a->row_of[a->slot[r]] = r;
        memcpy(a->rows + r * a->hidden, a->x + a->slot[r] / a->top_k * a->hidden, (size_t)a->hidden * sizeof(float));
    }
    int64_t used = 0;
    for (int64_t e = 0; e < a->experts; e++)
        if (a->start[e + 1] > a->start[e])
            a->used[used++] = e;
    a->num_used = used;
    atomic_fetch_add(&bytes_read, (uint64_t)(used * expert_bytes(a)));
    return NULL;
}

/* y[m, n] = x[m, k] @ w[n, k]^T for columns [c0, c1): an expert's weight as the checkpoint holds it. */
LLMC_CLONES
static void rows_times_rows(const float *x, const float *w, float *y, int64_t m, int64_t k, int64_t n, int64_t c0,
                            int64_t c1) {
    for (int64_t c = c0; c < c1; c++) {
        const float *wc = w + c * k;
        for (int64_t r = 0; r < m; r++) {
            const float *xr = x + r * k;
            float acc[16] = {0};
            int64_t i = 0;
            for (; i + 16 <= k; i += 16)
                for (int j = 0; j < 16; j++)
                    acc[j] += xr[i + j] * wc[i + j];
            float sum = 0;
            for (; i < k; i++)
                sum += xr[i] * wc[i];
            for (int j = 0; j < 16; j++)
                sum += acc[j];
            y[r * n + c] = sum;
        }
    }
}

/* One expert's product over its rows (r0 onward), for column group [g0, g1) of llmc_experts_groups;
 * `act`, for the quantized formats, the phase's rows quantized. */
static void product(const llmc_experts *a, const llmc_qact *act, int64_t e, const float *x, const void *w, float *y,
                    int64_t k, int64_t n, int64_t g0, int64_t g1) {
    int64_t r0 = a->start[e], m = a->start[e + 1] - r0, panels = llmc_experts_groups(n);
    g1 = g1 < panels ? g1 : panels;
    if (llmc_format_bits(a->format)) {
        llmc_qact rows = *act;
        rows.q += r0 * k;
        rows.scale += r0 * (k / act->block);
        rows.sum += r0 * (k / 32);
        rows.m = m;
        const uint8_t *blob = (const uint8_t *)w + e * llmc_quant_bytes(k, n, a->format, a->block_size, a->zero_points);
        llmc_linear_quant(&rows, blob, y + r0 * n, n, a->format, a->zero_points, g0, g1);
    } else if (a->packed) {
        llmc_linear_panels(x + r0 * k, (const float *)w + e * panels * k * LLMC_PANEL, y + r0 * n, m, k, n, g0, g1);
    } else {
        int64_t c1 = g1 * LLMC_PANEL < n ? g1 * LLMC_PANEL : n;
        rows_times_rows(x + r0 * k, (const float *)w + e * n * k, y + r0 * n, m, k, n, g0 * LLMC_PANEL, c1);
    }
}

int64_t llmc_experts_groups(int64_t n) { return (n + LLMC_PANEL - 1) / LLMC_PANEL; }

void llmc_experts_up(const llmc_experts *a, int64_t e, int64_t g0, int64_t g1) {
    product(a, &a->up_rows, e, a->rows, a->gate_up, a->gate_up_out, a->hidden, 2 * a->inter, g0, g1);
}

void llmc_experts_down(const llmc_experts *a, int64_t e, int64_t g0, int64_t g1) {
    product(a, &a->down_rows, e, a->act, a->down, a->down_out, a->inter, a->hidden, g0, g1);
}

LLMC_CLONES
void llmc_experts_activate(const llmc_experts *a, int64_t r0, int64_t r1) {
    int64_t width = a->inter;
    for (int64_t r = r0; r < r1; r++) {
        float *gate = a->gate_up_out + r * 2 * width, *up = gate + width, *dst = a->act + r * width;
        if (a->gate_up_bias != NULL) {
            const float *bias = a->gate_up_bias + a->ids[a->slot[r]] * 2 * width;
#pragma omp simd
            for (int64_t i = 0; i < 2 * width; i++)
                gate[i] += bias[i];
        }
        if (a->activation != LLMC_ACT_CLAMPED_SWIGLU) {
            llmc_swiglu_rows(gate, dst, width, 0, 1, a->activation);
            continue;
        }
        float limit = a->limit, alpha = a->alpha;
#pragma omp simd
        for (int64_t i = 0; i < width; i++) {
            float g = gate[i] < limit ? gate[i] : limit, u = up[i] < -limit ? -limit : up[i] > limit ? limit : up[i];
            dst[i] = (u + 1.0f) * g / (1.0f + exp_f(-alpha * g));
        }
    }
}

/* Tokens [t0, t1): each the sum of its slots' outputs (plus their expert's bias) times their
 * weights, slot by slot. */
void llmc_experts_combine(const llmc_experts *a, int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; t++) {
        float *out = a->out + t * a->hidden;
        memset(out, 0, (size_t)a->hidden * sizeof *out);
        for (int64_t s = 0; s < a->top_k; s++) {
            const float *y = a->down_out + a->row_of[t * a->top_k + s] * a->hidden;
            float w = a->weights[t * a->top_k + s];
            for (int64_t h = 0; h < a->hidden; h++)
                out[h] += w * y[h];
            if (a->down_bias != NULL) {
                const float *bias = a->down_bias + a->ids[t * a->top_k + s] * a->hidden;
                for (int64_t h = 0; h < a->hidden; h++)
                    out[h] += w * bias[h];
            }
        }
    }
}
