// Host check of the log-probability kernel (sampling.cuh `token_logprobs`) under the emulation of
// cuda_host.h; no GPU needed. Build and run from the repository root:
//
//   g++ -std=c++20 -O2 -ffp-contract=off -Ikernels/cuda -o /tmp/check_logprobs
//       kernels/cuda/sampling/host_check/check_logprobs.cpp -lpthread   (one line)
//   /tmp/check_logprobs   # vocab 1..2000 and 129 280, bit for bit against the port (~3 min)
//
// `ref_logprobs` is a direct port of deepinfer-model's sampling::token_logprobs (lanes summed in
// the CPU's order, a full sort for the alternatives); rows mix ties, NaN, -inf (masked) logits,
// a lone finite logit and very spread values.
#include "cuda_host.h"
#include "sampling/sampling.cuh"
#include <algorithm>
#include <cstdio>
#include <random>
using namespace sampling;

struct Result {
    float chosen;
    std::vector<u32_t> ids;
    std::vector<float> logprobs;
};

static Result ref_logprobs(const std::vector<float>& l, u32_t chosen, u32_t top) {
    const float neg_inf = -INFINITY;
    auto kept = [&](u32_t t) { return l[t] > neg_inf; };
    float m = neg_inf;
    for (u32_t t = 0; t < l.size(); ++t) if (kept(t) && l[t] > m) m = l[t];
    double max = (double)m;
    std::vector<double> lanes(LOGPROB_LANES, 0.0);
    for (u32_t t = 0; t < l.size(); ++t) if (kept(t)) lanes[t % LOGPROB_LANES] += exp_f64((double)l[t] - max);
    for (u32_t half = LOGPROB_LANES / 2; half > 0; half /= 2)
        for (u32_t i = 0; i < half; ++i) lanes[i] += lanes[i + half];
    double ln_total = ln_f64(lanes[0]);
    auto lp = [&](u32_t t) { return kept(t) ? (float)(((double)l[t] - max) - ln_total) : neg_inf; };
    std::vector<u32_t> ids;
    for (u32_t t = 0; t < l.size(); ++t) if (kept(t)) ids.push_back(t);
    std::sort(ids.begin(), ids.end(), [&](u32_t a, u32_t b) { return l[a] > l[b] || (l[a] == l[b] && a < b); });
    if (ids.size() > top) ids.resize(top);
    Result r{chosen < l.size() ? lp(chosen) : neg_inf, ids, {}};
    for (u32_t t : ids) r.logprobs.push_back(lp(t));
    return r;
}

static bool same(float a, float b) { return __float_as_uint(a) == __float_as_uint(b); }

int main() {
    std::mt19937_64 rng(7);
    int checked = 0, failed = 0;
    std::vector<u32_t> vocabs;
    for (u32_t v = 1; v <= 2000; v += (v < 300 ? 1 : 97)) vocabs.push_back(v);
    vocabs.push_back(129280);
    for (u32_t vocab : vocabs) {
        const u32_t rows = 3;
        std::vector<float> logits((size_t)rows * vocab);
        for (u32_t r = 0; r < rows; ++r) {
            for (u32_t t = 0; t < vocab; ++t) {
                float x;
                switch ((r + t) % 11 == 0 ? rng() % 4 : 9) {
                    case 0: x = NAN; break;
                    case 1: x = -INFINITY; break;
                    case 2: x = 3.0f; break;  // ties
                    default: x = (float)((int)(rng() % 4001) - 2000) / (r == 2 ? 7.0f : 173.0f);
                }
                logits[(size_t)r * vocab + t] = x;
            }
        }
        // A row with one finite logit.
        if (vocab > 4) {
            for (u32_t t = 0; t < vocab; ++t) logits[t] = -INFINITY;
            logits[vocab / 2] = 1.5f;
        }
        std::vector<u32_t> chosen(rows);
        for (u32_t r = 0; r < rows; ++r) chosen[r] = (u32_t)(rng() % vocab);
        const u32_t top = 1 + (u32_t)(vocab % MAX_TOP_LOGPROBS);
        std::vector<float> out_chosen(rows), out_lp((size_t)rows * MAX_TOP_LOGPROBS, 0.0f);
        std::vector<u32_t> out_ids((size_t)rows * MAX_TOP_LOGPROBS, 0u);
        LogprobParams p{rows, vocab, top};
        launch(rows, LOGPROB_LANES, [&] {
            token_logprobs(logits.data(), chosen.data(), out_chosen.data(), out_ids.data(), out_lp.data(), p);
        });
        for (u32_t r = 0; r < rows; ++r) {
            std::vector<float> row(logits.begin() + (size_t)r * vocab, logits.begin() + (size_t)(r + 1) * vocab);
            Result want = ref_logprobs(row, chosen[r], top);
            bool ok = same(out_chosen[r], want.chosen);
            for (u32_t k = 0; k < top; ++k) {
                const size_t at = (size_t)r * MAX_TOP_LOGPROBS + k;
                if (k < want.ids.size()) ok &= out_ids[at] == want.ids[k] && same(out_lp[at], want.logprobs[k]);
                else { ok &= out_ids[at] == 0xffffffffu; break; }
            }
            ++checked;
            if (!ok) {
                ++failed;
                std::printf("MISMATCH vocab %u row %u: chosen %.9g vs %.9g\n", vocab, r, out_chosen[r], want.chosen);
            }
        }
    }
    std::printf("%d rows checked, %d mismatches\n", checked, failed);
    return failed == 0 ? 0 : 1;
}
