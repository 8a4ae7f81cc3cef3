// SPDX-License-Identifier: MIT
// Writes the format-1 golden files of tests/data/ (linattn 0.1.0's RecurrentState::save) and
// prints the sums they hold as hex-float literals for tests/recurrent_state.test.cpp.
//
// It was built and run ONCE against linattn 0.1.0 (main at a19fee2, the last commit writing
// format 1); run against a later version it would write that version's format instead, so the
// committed .bin files, not this program, are the reference. Kept to show what they contain:
//   g++ -std=c++17 -O1 -I include tests/data/make_state_v1.cpp -o /tmp/make_state_v1
//   /tmp/make_state_v1 tests/data
//
// state_v1_double_identity.bin  RecurrentState<double>, C = 3, Dv = 2, eps 1e-5, decay 0.5,
//     normalize off, chunk 16, check_finite on; three precomputed-feature tokens of small
//     dyadic values, so every sum is exact: S = 0.25 k1 v1^T + 0.5 k2 v2^T + k3 v3^T.
// state_v1_float_favor.bin      RecurrentState<float>, PositiveRandomFeatures(2, 4, seed 3),
//     default options, four tokens: a non-zero log scale.
#include <cstdio>
#include <fstream>
#include <linattn/linattn.hpp>
#include <sstream>
#include <string>

namespace {

template <class State>
bool write(const State& state, const std::string& path) {
  std::ofstream os(path, std::ios::binary | std::ios::trunc);
  state.save(os);
  return static_cast<bool>(os);
}

template <class State>
void print(const State& state, const char* name) {
  std::printf("%s: tokens %lld, log_scale %a\n", name, static_cast<long long>(state.tokens()),
              state.log_scale());
  for (Eigen::Index r = 0; r < state.s().rows(); ++r) {
    for (Eigen::Index c = 0; c < state.s().cols(); ++c) {
      std::printf("  S(%lld, %lld) = %a\n", static_cast<long long>(r), static_cast<long long>(c),
                  static_cast<double>(state.s()(r, c)));
    }
  }
  for (Eigen::Index r = 0; r < state.z().size(); ++r) {
    std::printf("  z(%lld) = %a\n", static_cast<long long>(r), static_cast<double>(state.z()(r)));
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: make_state_v1 <dir>\n");
    return 2;
  }
  const std::string dir = std::string(argv[1]) + "/";
  bool ok = true;
  {
    linattn::Options options;
    options.eps = 1e-5;
    options.decay = 0.5;
    options.normalize = false;
    options.chunk = 16;
    linattn::RecurrentState<double> state(3, 2, options);
    const double k[3][3] = {{1.0, 0.5, -2.0}, {0.25, 3.0, 1.0}, {-1.5, 0.75, 2.0}};
    const double v[3][2] = {{2.0, -1.0}, {0.5, 4.0}, {-3.0, 0.125}};
    for (int t = 0; t < 3; ++t) {
      const Eigen::Map<const linattn::Vector<double>> kt(k[t], 3), vt(v[t], 2);
      (void)state.step(kt, kt, vt, linattn::Identity{});
    }
    ok &= write(state, dir + "state_v1_double_identity.bin");
    print(state, "state_v1_double_identity.bin");
  }
  {
    const linattn::PositiveRandomFeatures map(2, 4, 3);
    linattn::RecurrentState<float> state(4, 3);
    const float q[4][2] = {{0.5f, -1.0f}, {1.5f, 0.25f}, {-0.75f, 2.0f}, {1.0f, 1.0f}};
    const float v[4][3] = {
        {1.0f, 2.0f, -1.0f}, {0.5f, -0.5f, 3.0f}, {-2.0f, 1.0f, 0.25f}, {4.0f, 0.0f, -3.0f}};
    for (int t = 0; t < 4; ++t) {
      const Eigen::Map<const linattn::Vector<float>> qt(q[t], 2), vt(v[t], 3);
      (void)state.step(qt, qt, vt, map);
    }
    ok &= write(state, dir + "state_v1_float_favor.bin");
    print(state, "state_v1_float_favor.bin");
  }
  return ok ? 0 : 1;
}
