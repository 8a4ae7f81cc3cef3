// A million tokens through one recurrent state, in constant memory.
//
// Causal linear attention needs only S (C x Dv) and z (C) to continue a sequence, so a
// stream of any length runs in the memory of the state plus one block of inputs. Here the
// tokens are made on the fly, block by block (as a model would project them from its
// input), turned into features once per block, and stepped one at a time with step_into,
// which writes into the caller's output row and allocates nothing.
//
// The program prints the state size, the throughput (tokens/s) of the steps alone and of
// the whole loop, and checks that
//   * every output is finite (and so is the state at the end);
//   * prefilling a block (the chunked, parallel form) from the state before it gives the
//     outputs and the state that stepping it gives, within 2e-5 relative (float), for the
//     first block and for the last, a million tokens in;
//   * in builds with assertions on, Eigen aborts if the step loop allocates anything
//     (EIGEN_RUNTIME_NO_MALLOC).
// A float state carries about 1e-5 relative error after a million tokens; for more digits
// use RecurrentState<float, double> (float inputs, double sums, about half the speed).
//
// Usage: example_long_context [tokens]   (default 1,000,000; 100,000 in builds without
// NDEBUG, such as the sanitizer build, where each step is many times slower)

// Lets the program forbid Eigen heap allocations around the step loop (checked by
// eigen_assert, so only where assertions are on). Must come before any Eigen header.
#define EIGEN_RUNTIME_NO_MALLOC

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <linattn/linattn.hpp>
#include <optional>

namespace {

using Mat = linattn::Matrix<float>;
using State = linattn::RecurrentState<float>;
using Clock = std::chrono::steady_clock;

#ifdef NDEBUG
constexpr std::int64_t kDefaultTokens = 1000000;
#else
constexpr std::int64_t kDefaultTokens = 100000;
#endif

/// Reproducible inputs in [-1, 1), made on demand: a stand-in for the model's projections.
class TokenSource {
 public:
  explicit TokenSource(std::uint64_t seed) : x_(seed | 1) {}

  /// Fills the first `rows` rows of m.
  void fill(Mat& m, Eigen::Index rows) {
    for (Eigen::Index r = 0; r < rows; ++r) {
      for (Eigen::Index c = 0; c < m.cols(); ++c) m(r, c) = next();
    }
  }

 private:
  float next() {  // xorshift64*: fast, and enough for test inputs
    x_ ^= x_ >> 12;
    x_ ^= x_ << 25;
    x_ ^= x_ >> 27;
    const std::uint64_t bits = (x_ * 0x2545F4914F6CDD1DULL) >> 40;  // 24 random bits
    return static_cast<float>(bits) * (2.0f / 16777216.0f) - 1.0f;
  }

  std::uint64_t x_;
};

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

/// max|a - b| / max|b|.
template <class A, class B>
double relative_error(const A& a, const B& b) {
  const double scale = b.template cast<double>().cwiseAbs().maxCoeff();
  return (a.template cast<double>() - b.template cast<double>()).cwiseAbs().maxCoeff() / scale;
}

}  // namespace

int main(int argc, char** argv) {
  const std::int64_t tokens = argc > 1 ? std::atoll(argv[1]) : kDefaultTokens;
  if (tokens < 1) {
    std::fprintf(stderr, "usage: %s [tokens >= 1]\n", argv[0]);
    return 2;
  }
  const Eigen::Index key_dim = 64, value_dim = 64, block = 4096;
  constexpr double kTolerance = 2e-5;  // parallel vs recurrent in float, as the tests prove
  const linattn::EluPlusOne map;       // C = Dk; any positive feature map works the same way
  const Eigen::Index features = map.feature_dim(key_dim);
  bool ok = true;

  try {
    State state(features, value_dim);
    // Everything the loop touches, allocated once: one block of inputs, features, outputs.
    Mat q(block, key_dim), k(block, key_dim), v(block, value_dim);
    Mat phi_q(block, features), phi_k(block, features);
    Mat out(block, value_dim), prefilled(block, value_dim);
    TokenSource source(/*seed=*/42);

    const std::size_t state_bytes =
        sizeof(float) * static_cast<std::size_t>((state.value_dim() + 1) * state.feature_dim());
    const std::size_t block_bytes =
        sizeof(float) * static_cast<std::size_t>(q.size() + k.size() + v.size() + phi_q.size() +
                                                 phi_k.size() + out.size() + prefilled.size());
    std::printf("%lld tokens, Dk = Dv = %lld (float), elu(x) + 1 features, blocks of %lld%s\n",
                static_cast<long long>(tokens), static_cast<long long>(key_dim),
                static_cast<long long>(block),
                argc <= 1 && kDefaultTokens < 1000000
                    ? " (fewer by default: assertions are on, NDEBUG is not defined)"
                    : "");
    std::printf(
        "state: S %lld x %lld + z %lld = %zu bytes, the same after every token; block "
        "buffers %zu bytes\n",
        static_cast<long long>(state.feature_dim()), static_cast<long long>(state.value_dim()),
        static_cast<long long>(state.feature_dim()), state_bytes, block_bytes);
    std::printf("a softmax KV cache of this context would hold %.1f MiB\n",
                static_cast<double>(tokens) * static_cast<double>(key_dim + value_dim) *
                    sizeof(float) / (1024.0 * 1024.0));

    double step_seconds = 0.0;
    double first_error = -1.0, last_error = -1.0;
    bool finite = true;
    const auto start = Clock::now();
    for (std::int64_t begin = 0; begin < tokens; begin += block) {
      const Eigen::Index n =
          static_cast<Eigen::Index>(std::min<std::int64_t>(block, tokens - begin));
      source.fill(q, n);
      source.fill(k, n);
      source.fill(v, n);
      // Features once per block (this allocates the map's result, per block, not per token).
      phi_q.topRows(n) = map.queries(q.topRows(n));
      phi_k.topRows(n) = map.keys(k.topRows(n));

      // First and last block: the same tokens through the parallel form, from a copy.
      const bool check = begin == 0 || begin + block >= tokens;
      std::optional<State> copy;
      if (check) {
        copy = state;
        copy->prefill_into(phi_q.topRows(n), phi_k.topRows(n), v.topRows(n), linattn::Identity{},
                           prefilled.topRows(n));
      }

      const auto step_start = Clock::now();
      Eigen::internal::set_is_malloc_allowed(false);
      for (Eigen::Index i = 0; i < n; ++i) {
        state.step_into(phi_q.row(i), phi_k.row(i), v.row(i), linattn::Identity{},
                        out.row(i).transpose());
      }
      Eigen::internal::set_is_malloc_allowed(true);
      step_seconds += seconds_since(step_start);

      finite = finite && out.topRows(n).allFinite();
      if (check) {
        const double error = std::max(
            relative_error(prefilled.topRows(n), out.topRows(n)),
            std::max(relative_error(copy->s(), state.s()), relative_error(copy->z(), state.z())));
        (begin == 0 ? first_error : last_error) = error;
        if (!(error <= kTolerance)) ok = false;
      }
    }
    const double total_seconds = seconds_since(start);
    finite = finite && state.s().allFinite() && state.z().allFinite();

    std::printf("steps: %lld tokens in %.3f s = %.3g tokens/s (%.0f ns per token)\n",
                static_cast<long long>(state.tokens()), step_seconds,
                static_cast<double>(tokens) / step_seconds, 1e9 * step_seconds / tokens);
    std::printf("whole loop (making inputs, features, checks): %.3f s = %.3g tokens/s\n",
                total_seconds, static_cast<double>(tokens) / total_seconds);
    std::printf(
        "prefill vs steps (outputs, S, z): first block %.3g, last block %.3g "
        "(bound %.0e)\n",
        first_error, last_error < 0 ? first_error : last_error, kTolerance);
    std::printf("outputs and state finite: %s\n", finite ? "yes" : "NO");
    if (state.tokens() != tokens || !finite) ok = false;
  } catch (const linattn::Error& e) {
    std::printf("FAIL: %s\n", e.what());
    return 1;
  }
  std::printf("%s\n", ok ? "OK" : "FAILED");
  return ok ? 0 : 1;
}
