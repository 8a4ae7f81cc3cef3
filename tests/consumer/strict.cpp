// Built by the consumer_strict ctest case with -O3 -DNDEBUG -Wall -Wextra -Werror and no -march:
// the kernels, a state stepped token by token and the layer, at sizes that are compile-time
// constants here, so GCC inlines and specialises the kernels as a real caller's build does.
#include <algorithm>
#include <cstdio>
#include <linattn/linattn.hpp>

bool strict_repeated_steps();  // strict_steps.cpp, a translation unit of its own

namespace {

// max |a - b| / max |b|
template <class A, class B>
double relative_error(const A& a, const B& b) {
  return static_cast<double>((a - b).cwiseAbs().maxCoeff()) /
         std::max(1e-30, static_cast<double>(b.cwiseAbs().maxCoeff()));
}

// The parallel form against token-by-token steps of a RecurrentState, d x d heads.
template <class T>
bool parallel_matches_steps(Eigen::Index tokens, Eigen::Index d, double tolerance) {
  const linattn::Matrix<T> q = linattn::Matrix<T>::Random(tokens, d);
  const linattn::Matrix<T> k = linattn::Matrix<T>::Random(tokens, d);
  const linattn::Matrix<T> v = linattn::Matrix<T>::Random(tokens, d);
  const linattn::EluPlusOne map;
  const linattn::Matrix<T> parallel = linattn::causal_linear_attention(q, k, v, map);

  linattn::RecurrentState<T> state(map.feature_dim(d), d);
  linattn::Matrix<T> stepped(tokens, d);
  linattn::Vector<T> out(d);
  for (Eigen::Index t = 0; t < tokens; ++t) {
    state.step_into(q.row(t).transpose(), k.row(t).transpose(), v.row(t).transpose(), map, out);
    stepped.row(t) = out.transpose();
  }
  const double error = relative_error(stepped, parallel);
  const bool ok = parallel.allFinite() && error <= tolerance;
  std::printf("  causal, %zu-byte scalars, N = %ld, d = %ld: steps vs parallel %.2e%s\n", sizeof(T),
              static_cast<long>(tokens), static_cast<long>(d), error, ok ? "" : "  FAILED");
  return ok;
}

// Non-causal attention: every query reads the sums over all keys.
bool non_causal() {
  constexpr Eigen::Index n = 48, d = 32;
  const linattn::Matrix<float> q = linattn::Matrix<float>::Random(n, d);
  const linattn::Matrix<float> v = linattn::Matrix<float>::Random(n, d);
  const linattn::Matrix<float> out = linattn::linear_attention(q, q, v, linattn::Relu{});
  const bool ok = out.rows() == n && out.cols() == d && out.allFinite();
  std::printf("  non-causal, N = %ld, d = %ld%s\n", static_cast<long>(n), static_cast<long>(d),
              ok ? "" : "  FAILED");
  return ok;
}

// The layer: one token for each of B sequences, H heads each.
bool layer_steps() {
  constexpr Eigen::Index batch = 2, heads = 4, dk = 8, dv = 16;
  const linattn::LinearAttentionLayer<float, linattn::EluPlusOne> layer(linattn::EluPlusOne{},
                                                                        heads, dk, dv);
  auto states = layer.make_states(batch);
  const linattn::Matrix<float> q = linattn::Matrix<float>::Random(batch * heads, dk);
  const linattn::Matrix<float> v = linattn::Matrix<float>::Random(batch * heads, dv);
  linattn::Matrix<float> out(batch * heads, dv);
  for (int t = 0; t < 8; ++t) layer.step_into(states, q, q, v, out);
  const bool ok = out.allFinite();
  std::printf("  layer, B = %ld, H = %ld, 8 steps%s\n", static_cast<long>(batch),
              static_cast<long>(heads), ok ? "" : "  FAILED");
  return ok;
}

}  // namespace

int main() {
  std::printf("linattn_consumer_strict:\n");
  bool ok = true;
  ok = parallel_matches_steps<float>(300, 16, 2e-5) && ok;
  ok = parallel_matches_steps<float>(130, 32, 2e-5) && ok;
  ok = parallel_matches_steps<double>(200, 24, 1e-12) && ok;
  ok = strict_repeated_steps() && ok;
  ok = non_causal() && ok;
  ok = layer_steps() && ok;
  return ok ? 0 : 1;
}
