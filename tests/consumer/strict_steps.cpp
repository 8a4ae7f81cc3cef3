// Part of linattn_consumer_strict (see strict.cpp), in a translation unit of its own: one
// token of precomputed features (Identity) stepped many times through one state, the only call
// of the decoding kernel here, so GCC inlines all of it into this loop with d known. That is
// the shape in which g++ 12 -O3 warned in detail/stream.hpp (-Waggressive-loop-optimizations,
// an error under -Werror) until its tail loops counted with int; with more call sites, or with
// a map's featurization in between, GCC inlines less and stays quiet, so keep this file small.
#include <cstdio>
#include <linattn/linattn.hpp>

bool strict_repeated_steps() {
  constexpr Eigen::Index d = 32;
  linattn::RecurrentState<float> state(d, d);
  const linattn::Vector<float> x = linattn::Vector<float>::Constant(d, 0.5f);
  linattn::Vector<float> out(d);
  float sum = 0;
  for (int t = 0; t < 100; ++t) {
    state.step_into(x, x, x, linattn::Identity{}, out);
    sum += out.sum();
  }
  const bool ok = state.tokens() == 100 && sum > 0;
  std::printf("  100 steps of one token of features, d = 32: sum %g%s\n", static_cast<double>(sum),
              ok ? "" : "  FAILED");
  return ok;
}
