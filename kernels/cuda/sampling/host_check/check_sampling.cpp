// Host check of the sampling kernel (kernels/cuda/sampling/sampling.cuh) under the emulation of
// cuda_host.h; no GPU needed. Build and run from the repository root:
//
//   g++ -std=c++20 -O2 -ffp-contract=off -Ikernels/cuda -o /tmp/check_sampling
//       kernels/cuda/sampling/host_check/check_sampling.cpp -lpthread   (one line)
//   /tmp/check_sampling sums   # ordered_sum against the sequential loop (~1 min)
//   /tmp/check_sampling        # + sample_rows against a port of sampling.rs, vocab 1..3001 (~3 min)
//   /tmp/check_sampling big    # + 6 rows at vocab 129 280 (~6 min more)
//
// ordered_sum is checked bit for bit against the CPU's sequential f64 loop on adversarial
// addends (dyadic values, so round-half-even ties are frequent; powers of two; descending top-p
// shares with stop targets); sample_rows against `ref_sample`, a direct port of
// deepinfer-model's sampling::sample (full sort, sequential sums), over greedy / temperature /
// top-k / top-p rows and logits with ties, flat rows and NaNs.
#include "cuda_host.h"
#include "sampling/sampling.cuh"
#include <algorithm>
#include <cstdio>
#include <random>
#include <chrono>
#include <string>
using namespace sampling;

// Port of deepinfer-model sampling.rs::sample (the reference), with the header's noise functions.
static u32_t ref_sample(const float* l, u32_t vocab, const SampleRow& r) {
    if (r.temperature == 0.0f) {
        u32_t best = 0;
        for (u32_t i = 0; i < vocab; ++i)
            if (l[i] > l[best] || (std::isnan(l[best]) && !std::isnan(l[i]))) best = i;
        return best;
    }
    double inv_t = 1.0 / (double)r.temperature;
    bool rk = r.top_k > 0 && r.top_k < vocab, rp = r.top_p < 1.0f;
    std::vector<u32_t> ids(vocab);
    for (u32_t i = 0; i < vocab; ++i) ids[i] = i;
    bool listed = rk || rp;
    if (listed) {
        std::sort(ids.begin(), ids.end(), [&](u32_t a, u32_t b) {
            u32_t ka = descending_key(l[a]), kb = descending_key(l[b]);
            return ka != kb ? ka < kb : a < b;
        });
        if (rk) ids.resize(r.top_k);
        if (rp) {
            double max = (double)l[ids[0]] * inv_t;
            std::vector<double> w;
            for (u32_t t : ids) w.push_back(exp_f64((double)l[t] * inv_t - max));
            double total = 0;
            for (double x : w) total = total + x;
            double cum = 0;
            size_t keep = ids.size();
            for (size_t i = 0; i < w.size(); ++i) {
                cum += w[i] / total;
                if (cum >= (double)r.top_p) { keep = i + 1; break; }
            }
            ids.resize(keep);
        }
    }
    bool have = false; double bs = 0; u32_t bt = 0;
    for (u32_t t : ids) {
        double score = (double)l[t] * inv_t + gumbel(r.seed, r.position, t);
        if (!have || score > bs || (score == bs && t < bt)) { have = true; bs = score; bt = t; }
    }
    return bt;
}

static int failures = 0;

static void run_case(const char* name, const std::vector<float>& logits, u32_t vocab, const std::vector<SampleRow>& rows) {
    u32_t n = rows.size();
    u32_t padded = 1; while (padded < vocab) padded <<= 1;
    std::vector<u64_t> keys((size_t)n * padded);
    std::vector<double> weights((size_t)n * padded);
    std::vector<u32_t> out(n, 0xdeadbeef);
    SampleParams p{n, vocab, padded};
    auto t0 = std::chrono::steady_clock::now();
    launch(n, THREADS, [&] { sample_rows(logits.data(), rows.data(), keys.data(), weights.data(), out.data(), p); });
    double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    int bad = 0;
    for (u32_t i = 0; i < n; ++i) {
        u32_t want = ref_sample(logits.data() + (size_t)i * vocab, vocab, rows[i]);
        if (want != out[i]) {
            ++bad;
            if (bad < 6) printf("  %s row %u (T %g k %u p %g): got %u want %u\n", name, i, rows[i].temperature, rows[i].top_k, rows[i].top_p, out[i], want);
        }
    }
    failures += bad;
    printf("%s: vocab %u rows %u: %d mismatches (%.1f s)\n", name, vocab, n, bad, secs);
}

static std::vector<float> make_logits(std::mt19937_64& rng, u32_t vocab, u32_t rows, int kind_base) {
    std::vector<float> v((size_t)rows * vocab);
    std::normal_distribution<float> normal(0.0f, 3.0f);
    for (u32_t r = 0; r < rows; ++r) {
        int kind = (kind_base + r) % 5;
        float* row = v.data() + (size_t)r * vocab;
        for (u32_t i = 0; i < vocab; ++i) {
            float x = normal(rng);
            if (kind == 1) x = std::round(x * 2.0f) / 2.0f;        // many ties
            if (kind == 2) x = 1.0f;                                // flat
            if (kind == 3) x = x * 6.0f;                            // wide
            row[i] = x;
        }
        if (kind == 4 && vocab > 2) { row[vocab / 3] = NAN; row[vocab - 1] = NAN; }
    }
    return v;
}

static std::vector<SampleRow> make_rows(u32_t rows, u32_t vocab, u64_t seed) {
    const float ts[] = {0.0f, 1.0f, 0.7f, 1.3f, 0.05f, 2.5f};
    const u32_t ks[] = {0, 50, 1, 5, vocab > 1 ? vocab - 1 : 0, vocab, 40};
    const float ps[] = {1.0f, 0.9f, 0.95f, 0.5f, 1e-6f, 0.999999f};
    std::vector<SampleRow> out;
    for (u32_t i = 0; i < rows; ++i)
        out.push_back(SampleRow{seed + i * 7919ull, (i * 104729ull) % 100003, ts[i % 6], ps[(i / 2) % 6], ks[(i / 3) % 7], 0});
    return out;
}

// ordered_sum against the sequential loop on adversarial addends (dyadic values: frequent ties).
static void test_ordered_sum(std::mt19937_64& rng, u32_t n, int style, bool stops, double target) {
    std::vector<double> a(n);
    for (u32_t i = 0; i < n; ++i) {
        u64_t bits = rng();
        double x;
        if (style == 0) x = std::ldexp((double)(bits >> 11), -53);                  // uniform [0,1)
        else if (style == 1) x = std::ldexp((double)((bits >> 40) | 1), -20 - (int)(bits % 40)); // short dyadic
        else if (style == 2) x = std::ldexp(1.0, -(int)(bits % 60));                 // powers of two
        else x = (i == 0) ? 1.0 : std::ldexp((double)(bits >> 11), -53 - (int)(bits % 8));
        a[i] = x;
    }
    if (style == 4) {  // descending shares of exp-like weights, as the top-p cumulative sees them
        for (u32_t i = 0; i < n; ++i) a[i] = exp_f64(-(double)(rng() % 100000) / 5000.0);
        std::sort(a.begin(), a.end(), [](double x, double y) { return x > y; });
        double total = 0; for (double x : a) total = total + x;
        for (double& x : a) x = x / total;
    }
    double seq = 0; u32_t taken = n;
    for (u32_t i = 0; i < n; ++i) { seq += a[i]; if (stops && seq >= target) { taken = i + 1; break; } }
    static double got; static u32_t got_stop;
    launch(1, THREADS, [&] {
        static SumShared s;
        ordered_sum(Addends{a.data()}, n, stops, target, s);
        if (threadIdx.x == 0) { got = s.result; got_stop = s.stop; }
    });
    bool ok = got == seq && got_stop == taken;
    if (!ok) { ++failures; printf("  ordered_sum n %u style %d stops %d: got %.17g (%u) want %.17g (%u)\n", n, style, stops, got, got_stop, seq, taken); }
    else printf("ordered_sum n %u style %d stops %d target %g: equal (%.17g, %u)\n", n, style, stops, target, seq, taken);
}

int main(int argc, char** argv) {
    std::mt19937_64 rng(12345);
    bool big = argc > 1 && std::string(argv[1]) == "big";
    for (double target : {0.5, 0.9, 0.95, 0.999999})
        for (u32_t n : {129280u, 3001u, 50u}) test_ordered_sum(rng, n, 4, true, target);
    test_ordered_sum(rng, 129280, 4, false, 0);
    for (int style = 0; style < 4; ++style) {
        test_ordered_sum(rng, 100000, style, false, 0);
        test_ordered_sum(rng, 3001, style, false, 0);
        test_ordered_sum(rng, 100000, style, true, 1000.5);
    }
    if (argc > 1 && std::string(argv[1]) == "sums") { printf("%d failures\n", failures); return failures != 0; }
    for (u32_t vocab : {1u, 7u, 513u, 3001u}) {
        u32_t rows = vocab == 3001 ? 48 : 40;
        auto logits = make_logits(rng, vocab, rows, vocab % 5);
        run_case("mixed", logits, vocab, make_rows(rows, vocab, vocab * 11));
    }
    // Equal logits, top-p at a share boundary.
    {
        std::vector<float> flat(4 * 16, 1.0f);
        std::vector<SampleRow> rows;
        for (u32_t i = 0; i < 16; ++i) rows.push_back(SampleRow{i, i, 1.0f, 0.5f, 0, 0});
        run_case("flat4", flat, 4, rows);
    }
    if (big) {
        u32_t vocab = 129280, rows = 6;
        auto logits = make_logits(rng, vocab, rows, 0);
        std::vector<SampleRow> rs = {
            {1, 10, 1.3f, 0.95f, 0, 0}, {2, 11, 0.7f, 0.9f, 50, 0}, {3, 12, 1.0f, 0.9f, 0, 0},
            {4, 13, 1.3f, 0.9f, 0, 0}, {5, 14, 0.7f, 0.95f, 0, 0}, {6, 15, 1.3f, 1.0f, 50, 0}};
        run_case("vocab129280", logits, vocab, rs);
    }
    printf("%s: %d failures\n", failures ? "FAIL" : "PASS", failures);
    return failures != 0;
}
