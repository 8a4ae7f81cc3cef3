// FAVOR+ (Performer) random features approximating exact softmax attention.
//
// PositiveRandomFeatures(Dk, m, seed) maps x to exp(W u - |u|^2 / 2) / sqrt(m) with
// u = x / Dk^(1/4), so E[phi(q) . phi(k)] = exp(q . k / sqrt(Dk)): linear attention with it
// estimates softmax_attention at its default scale 1/sqrt(Dk), in O(N m) instead of O(N^2).
// The estimate improves as the number of features m grows (error ~ 1/sqrt(m)); orthogonal
// blocks of W (the default) lower its variance against iid Gaussian rows.
//
// The program prints, for m = 16 .. 512, the relative error against exact softmax
// (||approx - exact||_F / ||exact||_F, the mean over a few seeds) for orthogonal and iid
// features, non-causal, and orthogonal causal; and the time of one non-causal FAVOR+ call
// (features included, one thread) next to the exact (tiled) softmax. It checks that the
// error at the largest m is below the error at the smallest, and that orthogonal features
// are not worse than iid on average (10% margin).
//
// Cost: FAVOR+ does about 2 N m (2 Dk + 2 Dv) FLOPs plus 2 N m exponentials, softmax about
// 2 N^2 (Dk + Dv): FAVOR+ pays off when N is well above m. At the default 512 tokens it is
// only faster for small m; run with 4096 tokens to see it win at every m.
//
// Inputs: the estimator's relative variance grows like exp(|u_q + u_k|^2), and
// |u|^2 = |x|^2 / sqrt(Dk) ~ sigma^2 sqrt(Dk) for entries ~ N(0, sigma^2). At Dk = 64 the
// entries are drawn with sigma = 0.25 (|u|^2 ~ 0.5), where the softmax kernel is
// well-behaved and the error follows 1/sqrt(m); at sigma = 0.5 (|u|^2 ~ 2) the heavy tail
// leaves ~35% error even at m = 512. Real models keep q . k / sqrt(Dk) small (e.g. with
// layer norms) or need many more features.
//
// Usage: example_performer_vs_softmax [tokens]   (default 512)
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <linattn/linattn.hpp>
#include <random>
#include <vector>

namespace {

using Mat = linattn::Matrix<double>;
using Clock = std::chrono::steady_clock;

Mat random_matrix(Eigen::Index rows, Eigen::Index cols, double stddev, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> normal(0.0, stddev);
  Mat m(rows, cols);
  for (Eigen::Index i = 0; i < m.size(); ++i) m.data()[i] = normal(rng);
  return m;
}

double relative_error(const Mat& approx, const Mat& exact) {
  return (approx - exact).norm() / exact.norm();
}

/// Fastest of `repeats` runs of f, in milliseconds (the first run also warms the caches).
template <class F>
double time_ms(int repeats, const F& f) {
  double best = 1e300;
  for (int r = 0; r < repeats; ++r) {
    const auto start = Clock::now();
    f();
    best = std::min(best, std::chrono::duration<double, std::milli>(Clock::now() - start).count());
  }
  return best;
}

/// FAVOR+ with m features, orthogonal or iid rows, drawn from `seed`.
linattn::PositiveRandomFeatures favor(Eigen::Index key_dim, Eigen::Index m, std::uint64_t seed,
                                      linattn::Projection projection) {
  linattn::RandomFeatureOptions options;
  options.projection = projection;  // row norms chi-distributed, temperature 1/sqrt(Dk)
  return linattn::PositiveRandomFeatures(key_dim, m, seed, options);
}

}  // namespace

int main(int argc, char** argv) {
  const Eigen::Index tokens = argc > 1 ? std::atol(argv[1]) : 512;
  if (tokens < 16) {  // with a handful of tokens there is little to approximate
    std::fprintf(stderr, "usage: %s [tokens >= 16]\n", argv[0]);
    return 2;
  }
  const Eigen::Index key_dim = 64, value_dim = 64;
  const std::vector<Eigen::Index> features = {16, 32, 64, 128, 256, 512};
  const int seeds = 4;  // each error is the mean over this many draws of W
  const int repeats = 3;
  bool ok = true;
  // Every timing below is one thread: Options::threads = 1 for FAVOR+, and linattn keeps
  // Eigen's own products on the calling thread even in an OpenMP build.

  try {
    const double sigma = 0.25;
    const Mat q = random_matrix(tokens, key_dim, sigma, 1);
    const Mat k = random_matrix(tokens, key_dim, sigma, 2);
    const Mat v = random_matrix(tokens, value_dim, 1.0, 3);

    // Exact softmax attention (tiled, scale 1/sqrt(Dk)), both ways.
    const Mat exact = linattn::softmax_attention(
        q, k, v, /*causal=*/false ? linattn::Mask::causal : linattn::Mask::none);
    const Mat exact_causal = linattn::softmax_attention(
        q, k, v, /*causal=*/true ? linattn::Mask::causal : linattn::Mask::none);
    Mat out(tokens, value_dim);  // the timed calls write here
    const double softmax_ms = time_ms(
        repeats, [&] { linattn::softmax_attention_into(q, k, v, linattn::Mask::none, out); });
    linattn::Options one_thread;  // softmax_attention runs on one thread: time FAVOR+ alike
    one_thread.threads = 1;

    std::printf(
        "N = %lld tokens, Dk = Dv = %lld, q, k ~ N(0, %.2f^2), v ~ N(0, 1); error = "
        "mean over %d seeds of ||favor - softmax||_F / ||softmax||_F\n",
        static_cast<long long>(tokens), static_cast<long long>(key_dim), sigma, seeds);
    std::printf("%5s | %12s | %12s | %13s | %10s | %10s\n", "m", "orthogonal", "iid",
                "orth. causal", "FAVOR+ ms", "softmax ms");
    std::vector<double> orthogonal_error, iid_error, causal_error;
    for (const Eigen::Index m : features) {
      double orthogonal = 0.0, iid = 0.0, causal = 0.0;
      for (int s = 0; s < seeds; ++s) {
        const std::uint64_t seed = 100 + static_cast<std::uint64_t>(s);
        const auto map_o = favor(key_dim, m, seed, linattn::Projection::orthogonal);
        const auto map_i = favor(key_dim, m, seed, linattn::Projection::iid);
        orthogonal += relative_error(linattn::linear_attention(q, k, v, map_o), exact);
        iid += relative_error(linattn::linear_attention(q, k, v, map_i), exact);
        causal += relative_error(linattn::causal_linear_attention(q, k, v, map_o), exact_causal);
      }
      orthogonal_error.push_back(orthogonal / seeds);
      iid_error.push_back(iid / seeds);
      causal_error.push_back(causal / seeds);
      const auto map = favor(key_dim, m, 100, linattn::Projection::orthogonal);
      const double favor_ms =
          time_ms(repeats, [&] { linattn::linear_attention_into(q, k, v, map, out, one_thread); });
      std::printf("%5lld | %12.4g | %12.4g | %13.4g | %10.3f | %10.3f\n", static_cast<long long>(m),
                  orthogonal_error.back(), iid_error.back(), causal_error.back(), favor_ms,
                  softmax_ms);
    }

    // The error falls as m grows (by about sqrt(512 / 16) = 5.7 for a 1/sqrt(m) law).
    const auto falls = [](const std::vector<double>& e) { return e.back() < e.front(); };
    std::printf(
        "error at m = %lld over error at m = %lld: orthogonal %.2f, iid %.2f, causal "
        "%.2f (1/sqrt(m) predicts %.2f)\n",
        static_cast<long long>(features.front()), static_cast<long long>(features.back()),
        orthogonal_error.front() / orthogonal_error.back(), iid_error.front() / iid_error.back(),
        causal_error.front() / causal_error.back(),
        std::sqrt(static_cast<double>(features.back() / features.front())));
    if (!falls(orthogonal_error) || !falls(iid_error) || !falls(causal_error)) {
      std::printf("FAIL: the error does not fall as the number of features grows\n");
      ok = false;
    }
    double mean_orthogonal = 0.0, mean_iid = 0.0;
    for (std::size_t i = 0; i < features.size(); ++i) {
      mean_orthogonal += orthogonal_error[i] / static_cast<double>(features.size());
      mean_iid += iid_error[i] / static_cast<double>(features.size());
    }
    std::printf("mean error: orthogonal %.4g, iid %.4g\n", mean_orthogonal, mean_iid);
    std::printf("time: FAVOR+ grows with N m, softmax with N^2; FAVOR+ wins when N >> m\n");
    if (!(mean_orthogonal <= 1.1 * mean_iid)) {
      std::printf("FAIL: orthogonal features are worse than iid beyond the 10%% margin\n");
      ok = false;
    }
  } catch (const linattn::Error& e) {
    std::printf("FAIL: %s\n", e.what());
    return 1;
  }
  std::printf("%s\n", ok ? "OK" : "FAILED");
  return ok ? 0 : 1;
}
