// SPDX-License-Identifier: MIT
// Writes the golden files of the formats linattn wrote before format 4 (RecurrentState's
// format 3, "LNATTNS" v3, and DeltaRuleState's "LNATTND" v1) and prints what they hold.
//
// It was built and run ONCE against main at 82af5ab, the last commit writing those formats;
// run against a later version it would write that version's format instead, so the committed
// .bin files, not this program, are the reference. Kept to show what they contain:
//   g++ -std=c++17 -O1 -I include tests/data/make_state_v3.cpp -o /tmp/make_state_v3
//   /tmp/make_state_v3 tests/data
//
// state_v3_double_identity.bin  RecurrentState<double>, C = 3, Dv = 2, eps 1e-5, decay 0.5,
//     normalize on, scale 0.5, saved with Identity; three tokens of small dyadic values, so
//     every sum is exact: S = 0.25 k1 v1^T + 0.5 k2 v2^T + k3 v3^T, z likewise.
// delta_v1_float_deltanet.bin   DeltaRuleState<float>, Dk = 3, Dv = 2, scale 0.5, no L2
//     normalisation, beta 0.5 (DeltaNet, no gates); three dyadic tokens, exact in float:
//     S_t = S_{t-1} + beta k_t (v_t - S_{t-1}^T k_t)^T.
#include <cstdio>
#include <fstream>
#include <linattn/linattn.hpp>
#include <string>

namespace {

template <class State, class... Args>
bool write(const State& state, const std::string& path, const Args&... args) {
  std::ofstream os(path, std::ios::binary | std::ios::trunc);
  state.save(os, args...);
  return static_cast<bool>(os);
}

template <class Derived>
void print(const char* name, const Eigen::MatrixBase<Derived>& m) {
  for (Eigen::Index r = 0; r < m.rows(); ++r) {
    for (Eigen::Index c = 0; c < m.cols(); ++c) {
      std::printf("  %s(%lld, %lld) = %a\n", name, static_cast<long long>(r),
                  static_cast<long long>(c), static_cast<double>(m(r, c)));
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: make_state_v3 <dir>\n");
    return 2;
  }
  const std::string dir = std::string(argv[1]) + "/";
  bool ok = true;
  const double k[3][3] = {{1.0, 0.5, -2.0}, {0.25, 3.0, 1.0}, {-1.5, 0.75, 2.0}};
  const double v[3][2] = {{2.0, -1.0}, {0.5, 4.0}, {-3.0, 0.125}};
  {
    linattn::Options options;
    options.eps = 1e-5;
    options.decay = 0.5;
    options.scale = 0.5;
    linattn::RecurrentState<double> state(3, 2, options);
    for (int t = 0; t < 3; ++t) {
      const Eigen::Map<const linattn::Vector<double>> kt(k[t], 3), vt(v[t], 2);
      (void)state.step(kt, kt, vt, linattn::Identity{});
    }
    ok &= write(state, dir + "state_v3_double_identity.bin", linattn::Identity{});
    std::printf("state_v3_double_identity.bin: tokens %lld\n",
                static_cast<long long>(state.tokens()));
    print("S", state.s());
    print("z", state.z());
  }
  {
    const float kd[3][3] = {{0.5f, -0.25f, 1.0f}, {0.25f, 0.5f, -0.5f}, {-1.0f, 0.25f, 0.5f}};
    const float vd[3][2] = {{2.0f, -1.0f}, {0.5f, 4.0f}, {-3.0f, 0.125f}};
    linattn::DeltaOptions options;
    options.scale = 0.5;
    linattn::DeltaRuleState<float> state(3, 2, options);
    for (int t = 0; t < 3; ++t) {
      const Eigen::Map<const linattn::Vector<float>> kt(kd[t], 3), vt(vd[t], 2);
      (void)state.step(kt, kt, vt, 0.5f);
    }
    ok &= write(state, dir + "delta_v1_float_deltanet.bin");
    std::printf("delta_v1_float_deltanet.bin: tokens %lld\n",
                static_cast<long long>(state.tokens()));
    print("S", state.s());
  }
  return ok ? 0 : 1;
}
