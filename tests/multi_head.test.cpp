// Multi-head views ([B, H, N, D], [B, N, H, D], any strides), packed variable-length batches,
// threads and segmented prefill, against the plain single-head routines on Matrix copies.
#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <limits>
#include <linattn/feature_maps.hpp>
#include <linattn/gated.hpp>
#include <linattn/heads_view.hpp>
#include <linattn/linear_attention.hpp>
#include <linattn/multi_head.hpp>
#include <linattn/recurrent_state.hpp>
#include <linattn/softmax.hpp>
#include <linattn/state_batch.hpp>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "heads_support.hpp"
#include "support.hpp"

#ifdef _OPENMP
#include <omp.h>
#endif

// Every name of this file, apart from the other files of its bundle (LINATTN_TEST_BUNDLES).
namespace linattn_test_multi_head {

using linattn::HeadStrides;
using linattn::HeadsView;
using linattn::Matrix;
using linattn_test::gaussian;
using linattn_test::Heads;
using linattn_test::Kind;
using linattn_test::kind_name;
using linattn_test::Layout;
using linattn_test::layout_name;
using linattn_test::relative_error;

namespace {

constexpr Eigen::Index kDk = 6;  // q, k (and C for featurized inputs); Dk != Dv on purpose
constexpr Eigen::Index kDv = 5;

template <class T>
double tolerance() {  // docs/design.md's agreement bound
  return std::is_same_v<T, float> ? 2e-5 : 1e-12;
}

template <class T>
constexpr T kSentinel = T(-7.25);  // fills output gaps; must survive every call

/// Gaussian heads (each from its own seed) with NaN in every gap: a kernel that reads a gap
/// throws (check_finite) or returns NaN. `positive`: elu + 1 of them, i.e. featurized inputs.
template <class T>
Heads<T> random_heads(Layout layout, Eigen::Index batch, Eigen::Index heads, Eigen::Index tokens,
                      Eigen::Index dim, std::uint64_t seed, bool positive = false) {
  Heads<T> x(layout, batch, heads, tokens, dim, std::numeric_limits<T>::quiet_NaN());
  for (Eigen::Index b = 0; b < batch; ++b) {
    for (Eigen::Index h = 0; h < heads; ++h) {
      const Matrix<T> g =
          gaussian<T>(tokens, dim, seed + 7919 * static_cast<std::uint64_t>(b * heads + h));
      x.set_head(b, h, positive ? linattn::EluPlusOne{}.queries(g) : g);
    }
  }
  return x;
}

/// The part of a view holding tokens [begin, begin + count).
template <class T>
HeadsView<T> token_range(const HeadsView<T>& view, Eigen::Index begin, Eigen::Index count) {
  return HeadsView<T>(view.data() + begin * view.strides().token, view.batch(), view.heads(), count,
                      view.dim(), view.strides());
}

const linattn::PositiveRandomFeatures& prf_map() {
  static const linattn::PositiveRandomFeatures map(kDk, 16, 5);
  return map;
}

Eigen::Index feature_dim(Kind kind) { return kind == Kind::prf ? 16 : kDk; }

/// The multi-head routine under test.
template <class T>
void attend_views(Kind kind, bool causal, const HeadsView<const T>& q, const HeadsView<const T>& k,
                  const HeadsView<const T>& v, const HeadsView<T>& out,
                  const linattn::Options& options) {
  switch (kind) {
    case Kind::featurized:
      if (causal) {
        linattn::causal_linear_attention_into(q, k, v, linattn::Identity{}, out, options);
      } else {
        linattn::linear_attention_into(q, k, v, linattn::Identity{}, out, options);
      }
      return;
    case Kind::elu:
      if (causal) {
        linattn::causal_linear_attention_into(q, k, v, linattn::EluPlusOne{}, out, options);
      } else {
        linattn::linear_attention_into(q, k, v, linattn::EluPlusOne{}, out, options);
      }
      return;
    case Kind::prf:
      if (causal) {
        linattn::causal_linear_attention_into(q, k, v, prf_map(), out, options);
      } else {
        linattn::linear_attention_into(q, k, v, prf_map(), out, options);
      }
      return;
  }
}

/// The plain single-head routine on matrices: the reference.
template <class T, class DQ, class DK, class DV>
Matrix<T> attend_plain(Kind kind, bool causal, const Eigen::MatrixBase<DQ>& q,
                       const Eigen::MatrixBase<DK>& k, const Eigen::MatrixBase<DV>& v,
                       const linattn::Options& options) {
  switch (kind) {
    case Kind::featurized:
      return causal ? linattn::causal_linear_attention(q, k, v, linattn::Identity{}, options)
                    : linattn::linear_attention(q, k, v, linattn::Identity{}, options);
    case Kind::elu:
      return causal ? linattn::causal_linear_attention(q, k, v, linattn::EluPlusOne{}, options)
                    : linattn::linear_attention(q, k, v, linattn::EluPlusOne{}, options);
    case Kind::prf:
      return causal ? linattn::causal_linear_attention(q, k, v, prf_map(), options)
                    : linattn::linear_attention(q, k, v, prf_map(), options);
  }
  return {};
}

struct Layouts {
  Layout q, k, v, out;
};

const std::vector<Layouts> kLayoutSets = {
    {Layout::bhnd, Layout::bhnd, Layout::bhnd, Layout::bhnd},
    {Layout::bnhd, Layout::bnhd, Layout::bnhd, Layout::bnhd},
    {Layout::padded, Layout::padded, Layout::padded, Layout::padded},
    {Layout::bnhd, Layout::bhnd, Layout::padded, Layout::bnhd},  // mixed: the strided path
    {Layout::bhnd, Layout::bnhd, Layout::bnhd, Layout::padded},
};

/// q, k (B x H x N x Dk, featurized for Kind::featurized) and v (B x H x N x Dv).
template <class T>
struct Problem {
  Heads<T> q, k, v;
};

template <class T>
Problem<T> make_problem(Kind kind, const Layouts& layouts, Eigen::Index batch, Eigen::Index heads,
                        Eigen::Index tokens, std::uint64_t seed) {
  const bool positive = kind == Kind::featurized;
  return {random_heads<T>(layouts.q, batch, heads, tokens, kDk, seed, positive),
          random_heads<T>(layouts.k, batch, heads, tokens, kDk, seed + 1, positive),
          random_heads<T>(layouts.v, batch, heads, tokens, kDv, seed + 2)};
}

/// Worst relative error and the number of heads that are not bit-identical.
struct Tally {
  double worst = 0.0;
  int differing = 0;
  int compared = 0;

  template <class DA, class DB>
  void add(const Eigen::MatrixBase<DA>& got, const Eigen::MatrixBase<DB>& expected) {
    const double error = relative_error(got, expected);
    worst = std::max(worst, error);
    if (!(got == expected)) ++differing;
    ++compared;
  }
};

/// Element-wise equality of two buffers, without printing them when they differ.
template <class T>
bool same_data(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin());
}

}  // namespace

TEMPLATE_TEST_CASE("HeadsView addresses the documented layouts", "[multi_head][heads_view]",
                   float) {
  using T = TestType;
  const Eigen::Index B = 2, H = 3, N = 4, D = 5;
  std::vector<T> data(static_cast<std::size_t>(B * H * N * D));
  for (std::size_t i = 0; i < data.size(); ++i) data[i] = static_cast<T>(i);

  const auto bhnd = HeadsView<T>::bhnd(data.data(), {B, H, N, D});
  const auto bnhd = HeadsView<const T>::bnhd(data.data(), linattn::BnhdShape{B, N, H, D});
  CHECK(bhnd.batch() == B);
  CHECK(bhnd.heads() == H);
  CHECK(bhnd.tokens() == N);
  CHECK(bhnd.dim() == D);
  CHECK(bnhd.heads() == H);
  CHECK(bnhd.tokens() == N);
  CHECK(bhnd.sizes_string() == "[2, 3, 4, 5]");
  CHECK(bhnd.strides().batch == H * N * D);
  CHECK(bhnd.strides().head == N * D);
  CHECK(bhnd.strides().token == D);
  CHECK(bhnd.strides().dim == 1);
  CHECK(bnhd.strides().batch == N * H * D);
  CHECK(bnhd.strides().head == D);
  CHECK(bnhd.strides().token == H * D);
  CHECK(bnhd.strides().dim == 1);
  int wrong = 0;
  for (Eigen::Index b = 0; b < B; ++b) {
    for (Eigen::Index h = 0; h < H; ++h) {
      const Matrix<T> a = bhnd.head(b, h), a_rows = bhnd.head_rows(b, h);
      const Matrix<T> c = bnhd.head(b, h), c_rows = bnhd.head_rows(b, h);
      if (!(a == a_rows) || !(c == c_rows)) ++wrong;
      for (Eigen::Index n = 0; n < N; ++n) {
        for (Eigen::Index d = 0; d < D; ++d) {
          if (a(n, d) != static_cast<T>(((b * H + h) * N + n) * D + d)) ++wrong;
          if (c(n, d) != static_cast<T>(((b * N + n) * H + h) * D + d)) ++wrong;
        }
      }
    }
  }
  CHECK(wrong == 0);

  // Any strides: every other feature of every other token of head 1, sequence 0 only.
  const HeadsView<const T> odd(data.data() + 1, 1, 2, 2, 2, HeadStrides{0, N * D, 2 * D, 2});
  CHECK(odd.head(0, 1)(1, 1) == static_cast<T>(1 + N * D + 2 * D + 2));
  CHECK(odd.head(0, 0)(0, 0) == T(1));

  // Writable views write the caller's memory; the const conversion sees the same elements.
  bhnd.head(1, 2)(3, 4) = T(-1);
  CHECK(data.back() == T(-1));
  const HeadsView<const T> as_const = bhnd;
  CHECK(as_const.head(1, 2)(3, 4) == T(-1));
  CHECK(as_const.data() == data.data());
  STATIC_REQUIRE(HeadsView<T>::is_writable);
  STATIC_REQUIRE_FALSE(HeadsView<const T>::is_writable);
}

TEMPLATE_TEST_CASE("views: every layout gives each head the plain routine's result", "[multi_head]",
                   float, double) {
  using T = TestType;
  const Eigen::Index B = 2, H = 3, N = 150;  // chunks of 64: two full, one partial
  Tally tally;
  for (std::size_t set = 0; set < kLayoutSets.size(); ++set) {
    const Layouts& layouts = kLayoutSets[set];
    for (const Kind kind : {Kind::featurized, Kind::elu, Kind::prf}) {
      const Problem<T> p = make_problem<T>(kind, layouts, B, H, N, 100 + 10 * set);
      for (const bool causal : {true, false}) {
        for (const double decay : {1.0, 0.97}) {
          if (!causal && decay != 1.0) continue;  // non-causal has no decay
          for (const bool normalize : {true, false}) {
            linattn::Options options;
            options.decay = decay;
            options.normalize = normalize;
            options.threads = 1;
            Heads<T> out(layouts.out, B, H, N, kDv, kSentinel<T>);
            attend_views<T>(kind, causal, p.q.cview(), p.k.cview(), p.v.cview(), out.view(),
                            options);
            INFO("layouts " << layout_name(layouts.q) << ", " << layout_name(layouts.k) << ", "
                            << layout_name(layouts.v) << " -> " << layout_name(layouts.out) << "; "
                            << kind_name(kind) << ", causal = " << causal << ", decay = " << decay
                            << ", normalize = " << normalize);
            CHECK(out.gaps_hold(kSentinel<T>));
            for (Eigen::Index b = 0; b < B; ++b) {
              for (Eigen::Index h = 0; h < H; ++h) {
                const Matrix<T> expected = attend_plain<T>(kind, causal, p.q.head(b, h),
                                                           p.k.head(b, h), p.v.head(b, h), options);
                const Matrix<T> got = out.head(b, h);
                REQUIRE(got.allFinite());
                CHECK(relative_error(got, expected) <= tolerance<T>());
                tally.add(got, expected);
              }
            }
          }
        }
      }
    }
  }
  WARN("views vs plain routines: " << tally.compared << " heads, " << tally.differing
                                   << " not bit-identical, worst relative error " << tally.worst);
  // threads = 1 runs the same kernel on the same (copied) chunks: bit for bit.
  CHECK(tally.differing == 0);
}

TEMPLATE_TEST_CASE("views: softmax_attention_into gives each head softmax_attention",
                   "[multi_head][softmax]", float, double) {
  using T = TestType;
  const Eigen::Index B = 2, H = 2, N = 300;  // more than one key tile (256)
  Tally tally;
  for (std::size_t set = 0; set < kLayoutSets.size(); ++set) {
    const Layouts& layouts = kLayoutSets[set];
    const Problem<T> p = make_problem<T>(Kind::elu, layouts, B, H, N, 200 + 10 * set);
    for (const bool causal : {true, false}) {
      for (const double scale : {-1.0, 0.3}) {
        Heads<T> out(layouts.out, B, H, N, kDv, kSentinel<T>);
        linattn::softmax_attention_into(p.q.cview(), p.k.cview(), p.v.cview(),
                                        causal ? linattn::Mask::causal : linattn::Mask::none,
                                        out.view(), scale, 1);
        INFO("set " << set << ", causal = " << causal << ", scale = " << scale);
        CHECK(out.gaps_hold(kSentinel<T>));
        for (Eigen::Index b = 0; b < B; ++b) {
          for (Eigen::Index h = 0; h < H; ++h) {
            const Matrix<T> expected = linattn::softmax_attention(
                p.q.head(b, h), p.k.head(b, h), p.v.head(b, h),
                causal ? linattn::Mask::causal : linattn::Mask::none, scale);
            const Matrix<T> got = out.head(b, h);
            CHECK(relative_error(got, expected) <= tolerance<T>());
            tally.add(got, expected);
          }
        }
      }
    }
  }
  WARN("softmax views vs softmax_attention: " << tally.differing << " of " << tally.compared
                                              << " heads not bit-identical, worst relative error "
                                              << tally.worst);
  CHECK(tally.differing == 0);
}

TEMPLATE_TEST_CASE("views: a head stride of 0 shares k and v across heads (multi-query)",
                   "[multi_head]", float) {
  using T = TestType;
  const Eigen::Index B = 2, H = 4, N = 200;
  const Heads<T> q = random_heads<T>(Layout::bnhd, B, H, N, kDk, 1300);
  // One k and one v per sequence, [B, N, D], seen by every head.
  const Matrix<T> k = gaussian<T>(B * N, kDk, 1301), v = gaussian<T>(B * N, kDv, 1302);
  const HeadsView<const T> kv(k.data(), B, H, N, kDk, HeadStrides{N * kDk, 0, kDk, 1});
  const HeadsView<const T> vv(v.data(), B, H, N, kDv, HeadStrides{N * kDv, 0, kDv, 1});
  Tally tally;
  for (const Kind kind : {Kind::elu, Kind::prf}) {
    for (const bool causal : {true, false}) {
      linattn::Options options;
      options.decay = causal ? 0.99 : 1.0;
      options.threads = 2;
      Heads<T> out(Layout::bhnd, B, H, N, kDv, kSentinel<T>);
      attend_views<T>(kind, causal, q.cview(), kv, vv, out.view(), options);
      INFO(kind_name(kind) << ", causal = " << causal);
      options.threads = 1;
      for (Eigen::Index b = 0; b < B; ++b) {
        for (Eigen::Index h = 0; h < H; ++h) {
          const Matrix<T> expected = attend_plain<T>(
              kind, causal, q.head(b, h), k.middleRows(b * N, N), v.middleRows(b * N, N), options);
          const Matrix<T> got = out.head(b, h);
          CHECK(relative_error(got, expected) <= tolerance<T>());
          tally.add(got, expected);
        }
      }
    }
  }
  // A token stride of 0: one value row per sequence and head, read by every token. Softmax
  // weights sum to 1, so every output row is that row.
  const Matrix<T> v_rows = gaussian<T>(B * H, kDv, 1303);
  const HeadsView<const T> one_v(v_rows.data(), B, H, N, kDv, HeadStrides{H * kDv, kDv, 0, 1});
  Heads<T> same(Layout::bhnd, B, H, N, kDv, kSentinel<T>);
  linattn::softmax_attention_into(q.cview(), kv, one_v, linattn::Mask::causal, same.view(), -1, 2);
  for (Eigen::Index b = 0; b < B; ++b) {
    for (Eigen::Index h = 0; h < H; ++h) {
      const Matrix<T> got = same.head(b, h);
      CHECK(relative_error(got, v_rows.row(b * H + h).replicate(N, 1)) <= tolerance<T>());
    }
  }
  Heads<T> out(Layout::bhnd, B, H, N, kDv, kSentinel<T>);
  linattn::softmax_attention_into(q.cview(), kv, vv, linattn::Mask::causal, out.view(), -1, 2);
  for (Eigen::Index b = 0; b < B; ++b) {
    for (Eigen::Index h = 0; h < H; ++h) {
      const Matrix<T> expected = linattn::softmax_attention(
          q.head(b, h), k.middleRows(b * N, N), v.middleRows(b * N, N), linattn::Mask::causal);
      const Matrix<T> got = out.head(b, h);
      CHECK(relative_error(got, expected) <= tolerance<T>());
      tally.add(got, expected);
    }
  }
  WARN("multi-query views vs plain routines: " << tally.differing << " of " << tally.compared
                                               << " heads not bit-identical, worst relative error "
                                               << tally.worst);
  CHECK(tally.differing == 0);
}

TEMPLATE_TEST_CASE("varlen: packed sequences of uneven lengths equal one call per sequence",
                   "[multi_head][varlen]", float) {
  using T = TestType;
  // An empty first sequence, a length-1 one, another empty one, then 70, 5 and 190 tokens.
  const std::vector<std::int64_t> offsets = {0, 0, 1, 1, 71, 76, 266};
  const Eigen::Index H = 3, total = 266;
  Tally tally;
  for (const Layout layout : {Layout::bhnd, Layout::bnhd, Layout::padded}) {
    const Layouts layouts{layout, layout, layout, layout};
    for (const Kind kind : {Kind::featurized, Kind::elu, Kind::prf}) {
      const Problem<T> p = make_problem<T>(kind, layouts, 1, H, total, 300);
      for (const bool causal : {true, false}) {
        if (!causal && kind != Kind::featurized) continue;  // featurized overload only
        for (const double decay : {1.0, 0.95}) {
          if (!causal && decay != 1.0) continue;
          for (const int threads : {1, 3}) {  // 18 (sequence, head) pairs: threads over pairs
            linattn::Options options;
            options.decay = decay;
            options.threads = threads;
            Heads<T> out(layout, 1, H, total, kDv, kSentinel<T>);
            if (!causal) {
              linattn::linear_attention_varlen_into(p.q.cview(), p.k.cview(), p.v.cview(),
                                                    linattn::Identity{}, offsets, out.view(),
                                                    options);
            } else if (kind == Kind::featurized) {
              linattn::causal_linear_attention_varlen_into(p.q.cview(), p.k.cview(), p.v.cview(),
                                                           linattn::Identity{}, offsets, out.view(),
                                                           options);
            } else if (kind == Kind::elu) {
              linattn::causal_linear_attention_varlen_into(p.q.cview(), p.k.cview(), p.v.cview(),
                                                           linattn::EluPlusOne{}, offsets,
                                                           out.view(), options);
            } else {
              linattn::causal_linear_attention_varlen_into(p.q.cview(), p.k.cview(), p.v.cview(),
                                                           prf_map(), offsets, out.view(), options);
            }
            INFO(layout_name(layout) << ", " << kind_name(kind) << ", causal = " << causal
                                     << ", decay = " << decay << ", threads = " << threads);
            CHECK(out.gaps_hold(kSentinel<T>));
            linattn::Options plain = options;
            plain.threads = 1;
            for (Eigen::Index h = 0; h < H; ++h) {
              const Matrix<T> q = p.q.head(0, h), k = p.k.head(0, h), v = p.v.head(0, h);
              const Matrix<T> got_head = out.head(0, h);
              for (std::size_t s = 0; s + 1 < offsets.size(); ++s) {
                const Eigen::Index begin = offsets[s], len = offsets[s + 1] - offsets[s];
                if (len == 0) continue;
                const Matrix<T> expected =
                    attend_plain<T>(kind, causal, q.middleRows(begin, len),
                                    k.middleRows(begin, len), v.middleRows(begin, len), plain);
                const Matrix<T> got = got_head.middleRows(begin, len);
                CHECK(relative_error(got, expected) <= tolerance<T>());
                tally.add(got, expected);
              }
            }
          }
        }
      }
    }
  }
  WARN("varlen vs per-sequence calls: " << tally.differing << " of " << tally.compared
                                        << " sequences not bit-identical, worst relative error "
                                        << tally.worst);
  CHECK(tally.differing == 0);
}

TEMPLATE_TEST_CASE("threads: results do not depend on Options::threads", "[multi_head][threads]",
                   float) {
  using T = TestType;
#ifdef _OPENMP
  WARN("_OPENMP is defined (" << _OPENMP << "): Options::threads runs OpenMP threads");
#else
  WARN("_OPENMP is not defined: Options::threads is ignored and every run is serial");
#endif
  SECTION("threads over heads: bit for bit") {
    const Eigen::Index B = 2, H = 3, N = 300;
    const Layouts layouts{Layout::bnhd, Layout::bnhd, Layout::bnhd, Layout::bhnd};
    int differing = 0, runs = 0;
    for (const Kind kind : {Kind::featurized, Kind::elu, Kind::prf}) {
      const Problem<T> p = make_problem<T>(kind, layouts, B, H, N, 400);
      for (const bool causal : {true, false}) {
        linattn::Options options;
        options.decay = causal ? 0.98 : 1.0;
        options.threads = 1;
        Heads<T> serial(layouts.out, B, H, N, kDv, kSentinel<T>);
        attend_views<T>(kind, causal, p.q.cview(), p.k.cview(), p.v.cview(), serial.view(),
                        options);
        // Up to 4: libomp 14 leaks (LeakSanitizer) when a team grows past 4 after a smaller one.
        for (const int threads : {0, 2, 3, 4}) {
          options.threads = threads;
          Heads<T> out(layouts.out, B, H, N, kDv, kSentinel<T>);
          attend_views<T>(kind, causal, p.q.cview(), p.k.cview(), p.v.cview(), out.view(), options);
          INFO(kind_name(kind) << ", causal = " << causal << ", threads = " << threads);
          const bool same = same_data(out.data(), serial.data());
          CHECK(same);
          differing += same ? 0 : 1;
          ++runs;
        }
      }
    }
    const Problem<T> p = make_problem<T>(Kind::elu, layouts, B, H, N, 410);
    Heads<T> serial(layouts.out, B, H, N, kDv, kSentinel<T>);
    linattn::softmax_attention_into(p.q.cview(), p.k.cview(), p.v.cview(), linattn::Mask::causal,
                                    serial.view(), -1, 1);
    for (const int threads : {0, 2, 3, 4}) {
      Heads<T> out(layouts.out, B, H, N, kDv, kSentinel<T>);
      linattn::softmax_attention_into(p.q.cview(), p.k.cview(), p.v.cview(), linattn::Mask::causal,
                                      out.view(), -1, threads);
      INFO("softmax, threads = " << threads);
      const bool same = same_data(out.data(), serial.data());
      CHECK(same);
      differing += same ? 0 : 1;
      ++runs;
    }
    WARN("threads over heads: " << differing << " of " << runs << " runs differ from threads = 1");
  }

  SECTION("one long sequence split across threads, N = 20000") {
    // Without decay and log-scales (featurized, EluPlusOne) the split may go over the features
    // of S; with decay or PositiveRandomFeatures over segments of the sequence.
    const Eigen::Index N = 20000;
    const Layouts layouts{Layout::bhnd, Layout::bhnd, Layout::bhnd, Layout::bhnd};
    double worst = 0.0;
    for (const Kind kind : {Kind::featurized, Kind::elu, Kind::prf}) {
      const Problem<T> p = make_problem<T>(kind, layouts, 1, 1, N, 500);
      const Matrix<T> q = p.q.head(0, 0), k = p.k.head(0, 0), v = p.v.head(0, 0);
      for (const bool causal : {true, false}) {
        for (const double decay : {1.0, 0.99}) {
          if (!causal && decay != 1.0) continue;
          linattn::Options options;
          options.decay = decay;
          options.threads = 1;
          const Matrix<T> plain = attend_plain<T>(kind, causal, q, k, v, options);
          for (const int threads : {1, 2, 3, 4}) {
            options.threads = threads;
            Heads<T> out(Layout::bhnd, 1, 1, N, kDv, kSentinel<T>);
            attend_views<T>(kind, causal, p.q.cview(), p.k.cview(), p.v.cview(), out.view(),
                            options);
            const Matrix<T> got = out.head(0, 0);
            const double error = relative_error(got, plain);
            INFO(kind_name(kind) << ", causal = " << causal << ", decay = " << decay
                                 << ", threads = " << threads);
            REQUIRE(got.allFinite());
            CHECK(error <= tolerance<T>());
            if (threads == 1) CHECK(got == plain);  // the same kernel, serially
            if (threads == 2) {  // the plain routine splits the sequence in the same way
              const Matrix<T> plain_threaded = attend_plain<T>(kind, causal, q, k, v, options);
              CHECK(relative_error(plain_threaded, plain) <= tolerance<T>());
            }
            worst = std::max(worst, error);
          }
        }
      }
    }
    WARN("one sequence of 20000 tokens, threads 2-4 vs 1: worst relative error " << worst);
  }

  SECTION("chunks as long as a segment or longer, strong decay, N = 2100") {
    // Just past the 2 x 1024 rows a split needs; the segment bounds are aligned to the chunk,
    // so a chunk of 1000 or 5000 leaves segments short or empty; 40 does not divide N.
    const Eigen::Index N = 2100;
    const Layouts layouts{Layout::bhnd, Layout::bhnd, Layout::bhnd, Layout::bhnd};
    const Problem<T> p = make_problem<T>(Kind::prf, layouts, 1, 1, N, 550);
    const Matrix<T> q = p.q.head(0, 0), k = p.k.head(0, 0), v = p.v.head(0, 0);
    double worst = 0.0;
    for (const Eigen::Index chunk : {40, 1000, 5000}) {
      for (const double decay : {1.0, 0.3}) {
        linattn::Options options;
        options.chunk = chunk;
        options.decay = decay;
        options.threads = 1;
        const Matrix<T> serial = attend_plain<T>(Kind::prf, true, q, k, v, options);
        for (const int threads : {2, 3}) {
          options.threads = threads;
          Heads<T> out(Layout::bhnd, 1, 1, N, kDv, kSentinel<T>);
          attend_views<T>(Kind::prf, true, p.q.cview(), p.k.cview(), p.v.cview(), out.view(),
                          options);
          const double error = relative_error(out.head(0, 0), serial);
          INFO("chunk = " << chunk << ", decay = " << decay << ", threads = " << threads);
          CHECK(error <= tolerance<T>());
          worst = std::max(worst, error);
        }
      }
    }
    WARN("N = 2100, chunks 40 / 1000 / 5000, threads 2-3 vs 1: worst relative error " << worst);
  }

  SECTION("two heads: 2 threads go over heads, 3 and 4 split each sequence") {
    const Eigen::Index N = 4500;
    const Layouts layouts{Layout::bnhd, Layout::bnhd, Layout::bnhd, Layout::bnhd};
    const Problem<T> p = make_problem<T>(Kind::prf, layouts, 1, 2, N, 600);
    linattn::Options options;
    options.decay = 0.995;
    options.threads = 1;
    Heads<T> serial(Layout::bnhd, 1, 2, N, kDv, kSentinel<T>);
    attend_views<T>(Kind::prf, true, p.q.cview(), p.k.cview(), p.v.cview(), serial.view(), options);
    double worst = 0.0;
    for (const int threads : {2, 3, 4}) {
      options.threads = threads;
      Heads<T> out(Layout::bnhd, 1, 2, N, kDv, kSentinel<T>);
      attend_views<T>(Kind::prf, true, p.q.cview(), p.k.cview(), p.v.cview(), out.view(), options);
      INFO("threads = " << threads);
      if (threads == 2) CHECK(same_data(out.data(), serial.data()));
      for (Eigen::Index h = 0; h < 2; ++h) {
        const double error = relative_error(out.head(0, h), serial.head(0, h));
        CHECK(error <= tolerance<T>());
        worst = std::max(worst, error);
      }
    }
    WARN("two heads of 4500 tokens, threads 3-4 vs 1: worst relative error " << worst);
  }

  SECTION("varlen: a long sequence among short ones") {
    const std::vector<std::int64_t> offsets = {0, 5, 4100, 4101};
    const Eigen::Index N = 4101;
    const Layouts layouts{Layout::bhnd, Layout::bhnd, Layout::bhnd, Layout::bhnd};
    const Problem<T> p = make_problem<T>(Kind::featurized, layouts, 1, 1, N, 700);
    const Matrix<T> q = p.q.head(0, 0), k = p.k.head(0, 0), v = p.v.head(0, 0);
    double worst = 0.0;
    for (const bool causal : {true, false}) {
      for (const int threads : {1, 2, 4}) {  // 3 pairs: 4 threads split each sequence
        linattn::Options options;
        options.decay = causal ? 0.999 : 1.0;
        options.threads = threads;
        Heads<T> out(Layout::bhnd, 1, 1, N, kDv, kSentinel<T>);
        if (causal) {
          linattn::causal_linear_attention_varlen_into(p.q.cview(), p.k.cview(), p.v.cview(),
                                                       linattn::Identity{}, offsets, out.view(),
                                                       options);
        } else {
          linattn::linear_attention_varlen_into(p.q.cview(), p.k.cview(), p.v.cview(),
                                                linattn::Identity{}, offsets, out.view(), options);
        }
        options.threads = 1;
        const Matrix<T> got_head = out.head(0, 0);
        for (std::size_t s = 0; s + 1 < offsets.size(); ++s) {
          const Eigen::Index begin = offsets[s], len = offsets[s + 1] - offsets[s];
          const Matrix<T> expected =
              attend_plain<T>(Kind::featurized, causal, q.middleRows(begin, len),
                              k.middleRows(begin, len), v.middleRows(begin, len), options);
          const double error = relative_error(got_head.middleRows(begin, len), expected);
          INFO("causal = " << causal << ", threads = " << threads << ", sequence " << s);
          CHECK(error <= tolerance<T>());
          if (threads < 4) CHECK(got_head.middleRows(begin, len) == expected);
          worst = std::max(worst, error);
        }
      }
    }
    WARN("varlen with a 4095-token sequence, threads 1-4: worst relative error " << worst);
  }
}

TEMPLATE_TEST_CASE("segments: a RecurrentStateBatch prefilled in segments equals one call",
                   "[multi_head][state_batch][segments]", float) {
  using T = TestType;
  const Eigen::Index B = 2, H = 2, N = 1000;
  const std::vector<std::vector<Eigen::Index>> splits = {{0, 333, 700, 1000}, {0, 512, 1000}};
  double worst_out = 0.0, worst_state = 0.0;
  for (const Layout layout : {Layout::bhnd, Layout::bnhd, Layout::padded}) {
    const Layouts layouts{layout, layout, layout, layout};
    for (const Kind kind : {Kind::featurized, Kind::prf}) {
      const Problem<T> p = make_problem<T>(kind, layouts, B, H, N, 800);
      for (const double decay : {1.0, 0.99}) {
        linattn::Options options;
        options.decay = decay;
        options.threads = 2;
        // One call over the whole N, through the plain multi-head routine and a fresh batch.
        Heads<T> whole(layout, B, H, N, kDv, kSentinel<T>);
        attend_views<T>(kind, true, p.q.cview(), p.k.cview(), p.v.cview(), whole.view(), options);
        linattn::RecurrentStateBatch<T> one(B * H, feature_dim(kind), kDv, options);
        Heads<T> one_out(layout, B, H, N, kDv, kSentinel<T>);
        if (kind == Kind::prf) {
          one.prefill_into(p.q.cview(), p.k.cview(), p.v.cview(), prf_map(), one_out.view());
        } else {
          one.prefill_into(p.q.cview(), p.k.cview(), p.v.cview(), linattn::Identity{},
                           one_out.view());
        }
        INFO(layout_name(layout) << ", " << kind_name(kind) << ", decay = " << decay);
        CHECK(same_data(one_out.data(), whole.data()));  // the same kernel, from empty

        for (const auto& bounds : splits) {
          linattn::RecurrentStateBatch<T> states(B * H, feature_dim(kind), kDv, options);
          Heads<T> out(layout, B, H, N, kDv, kSentinel<T>);
          for (std::size_t s = 0; s + 1 < bounds.size(); ++s) {
            const Eigen::Index begin = bounds[s], len = bounds[s + 1] - bounds[s];
            const auto q = token_range(p.q.cview(), begin, len);
            const auto k = token_range(p.k.cview(), begin, len);
            const auto v = token_range(p.v.cview(), begin, len);
            if (kind == Kind::prf) {
              states.prefill_into(q, k, v, prf_map(), token_range(out.view(), begin, len));
            } else {
              states.prefill_into(q, k, v, linattn::Identity{},
                                  token_range(out.view(), begin, len));
            }
          }
          INFO(bounds.size() - 1 << " segments");
          CHECK(out.gaps_hold(kSentinel<T>));
          for (Eigen::Index b = 0; b < B; ++b) {
            for (Eigen::Index h = 0; h < H; ++h) {
              const double error = relative_error(out.head(b, h), whole.head(b, h));
              CHECK(error <= tolerance<T>());
              worst_out = std::max(worst_out, error);
              // The true sums exp(log_scale) S and z agree too.
              const auto& a = states[b * H + h];
              const auto& c = one[b * H + h];
              CHECK(a.tokens() == N);
              const linattn::ScaledSums<T> ha = a.sums(), hc = c.sums();
              const Matrix<double> sa = ha.s.template cast<double>() * std::exp(ha.log_scale);
              const Matrix<double> sc = hc.s.template cast<double>() * std::exp(hc.log_scale);
              const Eigen::VectorXd za = ha.z.template cast<double>() * std::exp(ha.log_scale);
              const Eigen::VectorXd zc = hc.z.template cast<double>() * std::exp(hc.log_scale);
              const double state_error = std::max(relative_error(sa, sc), relative_error(za, zc));
              CHECK(state_error <= tolerance<T>());
              worst_state = std::max(worst_state, state_error);
            }
          }
        }
      }
    }
  }
  WARN("batch prefill in segments vs one call: worst relative error, outputs "
       << worst_out << ", states " << worst_state);
}

TEMPLATE_TEST_CASE(
    "segments: RecurrentState::prefill in segments with threads = 2 equals one call, N = 20000",
    "[multi_head][segments][threads]", float) {
  using T = TestType;
  const Eigen::Index N = 20000;
  const std::vector<Eigen::Index> bounds = {0, 7000, 13001, 20000};  // each >= 2048: split
  const Matrix<T> q = gaussian<T>(N, kDk, 901), k = gaussian<T>(N, kDk, 902);
  const Matrix<T> v = gaussian<T>(N, kDv, 903);
  const linattn::EluPlusOne elu;
  const Matrix<T> phi_q = elu.queries(q), phi_k = elu.keys(k);
  double worst = 0.0;
  for (const double decay : {1.0, 0.99}) {
    linattn::Options serial;
    serial.decay = decay;
    serial.threads = 1;
    linattn::Options threaded = serial;
    threaded.threads = 2;
    const Matrix<T> whole_prf = linattn::causal_linear_attention(q, k, v, prf_map(), serial);
    const Matrix<T> whole_elu =
        linattn::causal_linear_attention(phi_q, phi_k, v, linattn::Identity{}, serial);
    linattn::RecurrentState<T> with_prf(16, kDv, threaded), with_elu(kDk, kDv, threaded);
    Matrix<T> out_prf(N, kDv), out_elu(N, kDv);
    for (std::size_t s = 0; s + 1 < bounds.size(); ++s) {
      const Eigen::Index begin = bounds[s], len = bounds[s + 1] - bounds[s];
      out_prf.middleRows(begin, len) = with_prf.prefill(
          q.middleRows(begin, len), k.middleRows(begin, len), v.middleRows(begin, len), prf_map());
      out_elu.middleRows(begin, len) =
          with_elu.prefill(phi_q.middleRows(begin, len), phi_k.middleRows(begin, len),
                           v.middleRows(begin, len), linattn::Identity{});
    }
    INFO("decay = " << decay);
    REQUIRE(out_prf.allFinite());
    REQUIRE(out_elu.allFinite());
    CHECK(with_prf.tokens() == N);
    CHECK(with_elu.tokens() == N);
    const double e_prf = relative_error(out_prf, whole_prf);
    const double e_elu = relative_error(out_elu, whole_elu);
    CHECK(e_prf <= tolerance<T>());
    CHECK(e_elu <= tolerance<T>());
    // And the threaded whole-sequence call.
    const double e_threaded =
        relative_error(linattn::causal_linear_attention(q, k, v, prf_map(), threaded), whole_prf);
    CHECK(e_threaded <= tolerance<T>());
    worst = std::max({worst, e_prf, e_elu, e_threaded});
  }
  WARN("RecurrentState::prefill in 3 segments, threads = 2, N = 20000: worst relative error "
       << worst);
}

TEMPLATE_TEST_CASE("errors: bad views, offsets and inputs throw linattn::Error naming them",
                   "[multi_head][errors]", float) {
  using T = TestType;
  using Catch::Contains;
  const Eigen::Index B = 2, H = 3, N = 10;
  auto heads = [&](Eigen::Index b, Eigen::Index h, Eigen::Index n, Eigen::Index d,
                   std::uint64_t seed) {
    return random_heads<T>(Layout::bhnd, b, h, n, d, seed, true);
  };
  const Heads<T> q = heads(B, H, N, kDk, 1), k = heads(B, H, N, kDk, 2), v = heads(B, H, N, kDv, 3);
  Heads<T> out(Layout::bhnd, B, H, N, kDv, kSentinel<T>);
  out.view().head(0, 0).setConstant(T(5));
  const std::vector<T> untouched = out.data();
  const linattn::EluPlusOne elu;
  const linattn::Options ok;

  auto causal = [&](const Heads<T>& a, const Heads<T>& b, const Heads<T>& c, HeadsView<T> o,
                    const linattn::Options& options) {
    linattn::causal_linear_attention_into(a.cview(), b.cview(), c.cview(), linattn::Identity{}, o,
                                          options);
  };
  auto non_causal = [&](const Heads<T>& a, const Heads<T>& b, const Heads<T>& c, HeadsView<T> o,
                        const linattn::Options& options) {
    linattn::linear_attention_into(a.cview(), b.cview(), c.cview(), linattn::Identity{}, o,
                                   options);
  };
  auto mapped = [&](const Heads<T>& a, const Heads<T>& b, const Heads<T>& c, HeadsView<T> o,
                    const linattn::Options& options) {
    linattn::causal_linear_attention_into(a.cview(), b.cview(), c.cview(), elu, o, options);
  };

  SECTION("mismatched B, H, N or D between views") {
    CHECK_THROWS_WITH(causal(q, heads(1, H, N, kDk, 4), v, out.view(), ok),
                      Contains("phi_k is [1, 3, 10, 6]") && Contains("B, H and N must match"));
    CHECK_THROWS_WITH(causal(q, heads(B, 2, N, kDk, 4), v, out.view(), ok),
                      Contains("phi_k is [2, 2, 10, 6]"));
    CHECK_THROWS_WITH(causal(q, k, heads(B, H, 9, kDv, 4), out.view(), ok),
                      Contains("v is [2, 3, 9, 5]"));
    CHECK_THROWS_WITH(causal(q, heads(B, H, N, kDk + 1, 4), v, out.view(), ok),
                      Contains("phi_k is [2, 3, 10, 7]") && Contains("D must match"));
    CHECK_THROWS_WITH(non_causal(q, k, heads(1, H, N, kDv, 4), out.view(), ok),
                      Contains("v is [1, 3, 10, 5]"));
    CHECK_THROWS_WITH(mapped(q, heads(B, H, N + 1, kDk, 4), v, out.view(), ok),
                      Contains("k is [2, 3, 11, 6]"));
    Heads<T> short_out(Layout::bhnd, B, H, N - 1, kDv, T(0));
    CHECK_THROWS_WITH(causal(q, k, v, short_out.view(), ok), Contains("out is [2, 3, 9, 5]"));
    // 2 heads do not divide q's and out's 3 (1 would: multi-query, a grouping).
    CHECK_THROWS_WITH(linattn::softmax_attention_into(q.cview(), heads(B, 2, N, kDk, 4).cview(),
                                                      v.cview(), linattn::Mask::causal, out.view()),
                      Contains("softmax_attention") && Contains("k is [2, 2, 10, 6]"));
    // A feature map built for another input width.
    const linattn::PositiveRandomFeatures other(kDk + 1, 8, 1);
    CHECK_THROWS_AS(
        linattn::causal_linear_attention_into(q.cview(), k.cview(), v.cview(), other, out.view()),
        linattn::Error);
    CHECK_THROWS_AS(
        linattn::linear_attention_into(q.cview(), k.cview(), v.cview(), other, out.view()),
        linattn::Error);
  }
  SECTION("wrong out dim") {
    Heads<T> narrow(Layout::bnhd, B, H, N, kDv - 2, T(0));
    const std::vector<T> before = narrow.data();
    CHECK_THROWS_WITH(causal(q, k, v, narrow.view(), ok),
                      Contains("out is [2, 3, 10, 3]") && Contains("the result has D = 5"));
    CHECK_THROWS_WITH(non_causal(q, k, v, narrow.view(), ok), Contains("out is [2, 3, 10, 3]"));
    CHECK_THROWS_WITH(mapped(q, k, v, narrow.view(), ok), Contains("out is [2, 3, 10, 3]"));
    CHECK_THROWS_WITH(linattn::softmax_attention_into(q.cview(), k.cview(), v.cview(),
                                                      linattn::Mask::none, narrow.view()),
                      Contains("out is [2, 3, 10, 3]"));
    CHECK(same_data(narrow.data(), before));
  }
  SECTION("options out of range") {
    linattn::Options bad;
    bad.decay = 0.0;
    CHECK_THROWS_WITH(causal(q, k, v, out.view(), bad), Contains("Options::decay"));
    bad = ok;
    bad.eps = -1.0;
    CHECK_THROWS_WITH(non_causal(q, k, v, out.view(), bad), Contains("Options::eps"));
    bad = ok;
    bad.chunk = 0;
    CHECK_THROWS_WITH(mapped(q, k, v, out.view(), bad), Contains("Options::chunk"));
    bad = ok;
    bad.threads = -1;
    CHECK_THROWS_WITH(causal(q, k, v, out.view(), bad), Contains("Options::threads"));
    CHECK_THROWS_WITH(linattn::softmax_attention_into(q.cview(), k.cview(), v.cview(),
                                                      linattn::Mask::causal, out.view(), -1, -2),
                      Contains("Options::threads"));
    CHECK_THROWS_WITH(
        linattn::softmax_attention_into(q.cview(), k.cview(), v.cview(), linattn::Mask::causal,
                                        out.view(), std::numeric_limits<double>::quiet_NaN()),
        Contains("scale must be finite"));
  }
  SECTION("bad offsets for a packed batch") {
    const Heads<T> pq = heads(1, H, N, kDk, 5), pk = heads(1, H, N, kDk, 6);
    const Heads<T> pv = heads(1, H, N, kDv, 7);
    Heads<T> pout(Layout::bhnd, 1, H, N, kDv, kSentinel<T>);
    const std::vector<T> pout_before = pout.data();
    using Offsets = std::vector<std::int64_t>;
    auto all_three = [&](const Offsets& offsets, const auto& matcher) {
      CHECK_THROWS_WITH(
          linattn::causal_linear_attention_varlen_into(pq.cview(), pk.cview(), pv.cview(),
                                                       linattn::Identity{}, offsets, pout.view()),
          Contains("causal_linear_attention_varlen") && matcher);
      CHECK_THROWS_WITH(linattn::causal_linear_attention_varlen_into(
                            pq.cview(), pk.cview(), pv.cview(), elu, offsets, pout.view()),
                        Contains("causal_linear_attention_varlen") && matcher);
      CHECK_THROWS_WITH(
          linattn::linear_attention_varlen_into(pq.cview(), pk.cview(), pv.cview(),
                                                linattn::Identity{}, offsets, pout.view()),
          Contains("linear_attention_varlen") && matcher);
    };
    all_three(Offsets{1, 10}, Contains("offsets[0] must be 0, got 1"));
    all_three(Offsets{-1, 10}, Contains("offsets[0] must be 0, got -1"));
    all_three(Offsets{0, 6, 4, 10}, Contains("must not decrease") && Contains("offsets[2] = 4"));
    all_three(Offsets{0, 5, 9}, Contains("offsets.back() = 9") && Contains("10 tokens"));
    all_three(Offsets{0, 5, 11}, Contains("offsets.back() = 11"));
    all_three(Offsets{0}, Contains("at least 2 entries"));
    all_three(Offsets{}, Contains("at least 2 entries"));
    CHECK(same_data(pout.data(), pout_before));
    // B != 1: a packed batch is one row of sequences.
    CHECK_THROWS_WITH(
        linattn::causal_linear_attention_varlen_into(
            q.cview(), k.cview(), v.cview(), linattn::Identity{}, Offsets{0, 4, 10}, out.view()),
        Contains("B must be 1") && Contains("phi_q is [2, 3, 10, 6]"));
    CHECK_THROWS_WITH(
        linattn::linear_attention_varlen_into(q.cview(), k.cview(), v.cview(), linattn::Identity{},
                                              Offsets{0, 10}, out.view()),
        Contains("B must be 1"));
    CHECK_THROWS_WITH(linattn::causal_linear_attention_varlen_into(q.cview(), k.cview(), v.cview(),
                                                                   elu, Offsets{0, 10}, out.view()),
                      Contains("B must be 1") && Contains("q is [2, 3, 10, 6]"));
  }
  SECTION("NaN or Inf in an input, named by head, row and column") {
    // Every input is scanned before any work, so out stays untouched (checked below).
    Heads<T> scratch(Layout::bhnd, B, H, N, kDv, T(0));
    for (const T poison :
         {std::numeric_limits<T>::quiet_NaN(), std::numeric_limits<T>::infinity()}) {
      Heads<T> bad_q = q, bad_v = v;
      bad_q.view().head(1, 2)(3, 1) = poison;
      bad_v.view().head(0, 1)(9, 4) = -poison;
      CHECK_THROWS_WITH(causal(bad_q, k, v, scratch.view(), ok),
                        Contains("causal_linear_attention") && Contains("phi_q[b=1, h=2]") &&
                            Contains("row 3, column 1"));
      CHECK_THROWS_WITH(causal(k, bad_q, v, scratch.view(), ok), Contains("phi_k[b=1, h=2]"));
      CHECK_THROWS_WITH(non_causal(q, k, bad_v, scratch.view(), ok),
                        Contains("v[b=0, h=1]") && Contains("row 9, column 4"));
      CHECK_THROWS_WITH(mapped(bad_q, k, v, scratch.view(), ok),
                        Contains("q[b=1, h=2]") && Contains("row 3, column 1"));
      CHECK_THROWS_WITH(linattn::softmax_attention_into(bad_q.cview(), k.cview(), v.cview(),
                                                        linattn::Mask::causal, scratch.view()),
                        Contains("q[b=1, h=2]") && Contains("row 3, column 1"));
      // A packed batch is one [1, H, total, D] tensor: the row is the packed token index.
      const Heads<T> pq = heads(1, H, N, kDk, 5), pk = heads(1, H, N, kDk, 6);
      Heads<T> pv = heads(1, H, N, kDv, 7);
      pv.view().head(0, 2)(7, 0) = poison;
      Heads<T> pout(Layout::bhnd, 1, H, N, kDv, kSentinel<T>);
      CHECK_THROWS_WITH(
          linattn::causal_linear_attention_varlen_into(
              pq.cview(), pk.cview(), pv.cview(), linattn::Identity{}, {0, 3, 10}, pout.view()),
          Contains("causal_linear_attention_varlen") && Contains("v[b=0, h=2]") &&
              Contains("row 7, column 0"));
      // With the check off there is no throw (the caller gets what the arithmetic gives).
      linattn::Options unchecked;
      unchecked.check_finite = false;
      CHECK_NOTHROW(causal(bad_q, k, v, scratch.view(), unchecked));
    }
  }
  // No throw above wrote into out (every one is found before any work starts).
  CHECK(same_data(out.data(), untouched));
}

TEMPLATE_TEST_CASE("errors: a NaN deep in a long sequence split across threads throws",
                   "[multi_head][errors][threads]", float) {
  // The throw comes from inside a parallel region (any thread's segment or share): it must
  // reach the caller as linattn::Error naming the input, and no state may move.
  using T = TestType;
  using Catch::Contains;
  const Eigen::Index N = 5000;
  const linattn::EluPlusOne elu;
  const Matrix<T> phi_q = elu.queries(gaussian<T>(N, kDk, 1400));
  const Matrix<T> phi_k = elu.keys(gaussian<T>(N, kDk, 1401));
  const Matrix<T> q = gaussian<T>(N, kDk, 1402), k = gaussian<T>(N, kDk, 1403);
  const Matrix<T> v = gaussian<T>(N, kDv, 1404);
  Matrix<T> out(N, kDv);
  for (const Eigen::Index row : {Eigen::Index(10), Eigen::Index(2500), N - 1}) {
    for (const int threads : {2, 3, 4}) {
      for (const double decay : {1.0, 0.99}) {
        linattn::Options options;
        options.threads = threads;
        options.decay = decay;
        INFO("NaN at row " << row << ", threads = " << threads << ", decay = " << decay);
        Matrix<T> bad_k = phi_k, bad_v = v;
        bad_k(row, 1) = std::numeric_limits<T>::quiet_NaN();
        bad_v(row, 2) = std::numeric_limits<T>::infinity();
        const std::string at = "row " + std::to_string(row);
        CHECK_THROWS_WITH(linattn::causal_linear_attention_into(phi_q, bad_k, v,
                                                                linattn::Identity{}, out, options),
                          Contains("phi_k") && Contains(at + ", column 1"));
        CHECK_THROWS_WITH(linattn::causal_linear_attention_into(phi_q, phi_k, bad_v,
                                                                linattn::Identity{}, out, options),
                          Contains("v has a non-finite value") && Contains(at + ", column 2"));
        CHECK_THROWS_WITH(
            linattn::linear_attention_into(phi_q, bad_k, v, linattn::Identity{}, out, options),
            Contains("phi_k") && Contains(at + ", column 1"));
        Matrix<T> bad_q = q;
        bad_q(row, 0) = -std::numeric_limits<T>::infinity();
        CHECK_THROWS_WITH(
            linattn::causal_linear_attention_into(bad_q, k, v, prf_map(), out, options),
            Contains("q has a non-finite value") && Contains(at + ", column 0"));

        // A state half-way through a sequence stays where it was.
        linattn::RecurrentState<T> plain(kDk, kDv, options), mapped(16, kDv, options);
        plain.prefill(phi_q.topRows(100), phi_k.topRows(100), v.topRows(100), linattn::Identity{});
        mapped.prefill(q.topRows(100), k.topRows(100), v.topRows(100), prf_map());
        const linattn::RecurrentState<T> plain_before = plain, mapped_before = mapped;
        CHECK_THROWS_AS(plain.prefill(phi_q, bad_k, v, linattn::Identity{}), linattn::Error);
        CHECK_THROWS_AS(mapped.prefill(bad_q, k, v, prf_map()), linattn::Error);
        CHECK(plain.tokens() == 100);
        CHECK(mapped.tokens() == 100);
        CHECK(plain.s() == plain_before.s());
        CHECK(plain.z() == plain_before.z());
        CHECK(mapped.s() == mapped_before.s());
        CHECK(mapped.sums().log_scale == mapped_before.sums().log_scale);
      }
    }
  }
}

// docs/design.md: bad input, NaN included, "throws linattn::Error ... and leaves every caller
// object as it was": the inputs are scanned before any output is written, so a NaN in the last
// chunk of the last head leaves out as it was, and no state moves.
TEMPLATE_TEST_CASE("a NaN found mid-run leaves out as it was", "[multi_head][errors]", float) {
  using T = TestType;
  const Eigen::Index B = 1, H = 4, N = 300;
  const Layouts layouts{Layout::bhnd, Layout::bhnd, Layout::bhnd, Layout::bhnd};
  Problem<T> p = make_problem<T>(Kind::featurized, layouts, B, H, N, 1200);
  p.v.view().head(0, H - 1)(N - 1, 0) = std::numeric_limits<T>::quiet_NaN();  // last chunk
  for (const int threads : {1, 2}) {
    linattn::Options options;
    options.threads = threads;
    INFO("threads = " << threads);
    Heads<T> out(Layout::bhnd, B, H, N, kDv, kSentinel<T>);
    const std::vector<T> before = out.data();
    CHECK_THROWS_AS(attend_views<T>(Kind::featurized, true, p.q.cview(), p.k.cview(), p.v.cview(),
                                    out.view(), options),
                    linattn::Error);
    CHECK(same_data(out.data(), before));
    CHECK_THROWS_AS(linattn::causal_linear_attention_varlen_into(
                        p.q.cview(), p.k.cview(), p.v.cview(), linattn::Identity{}, {0, 100, 300},
                        out.view(), options),
                    linattn::Error);
    CHECK(same_data(out.data(), before));
    linattn::RecurrentStateBatch<T> batch(B * H, kDk, kDv, options);
    CHECK_THROWS_AS(
        batch.prefill_into(p.q.cview(), p.k.cview(), p.v.cview(), linattn::Identity{}, out.view()),
        linattn::Error);
    CHECK(same_data(out.data(), before));
    for (Eigen::Index i = 0; i < B * H; ++i) CHECK(batch[i].tokens() == 0);

    // One sequence, plain matrices.
    const Matrix<T> q = p.q.head(0, H - 1), k = p.k.head(0, H - 1), v = p.v.head(0, H - 1);
    Matrix<T> plain_out = Matrix<T>::Constant(N, kDv, kSentinel<T>);
    CHECK_THROWS_AS(
        linattn::causal_linear_attention_into(q, k, v, linattn::Identity{}, plain_out, options),
        linattn::Error);
    CHECK((plain_out.array() == kSentinel<T>).all());
    linattn::RecurrentState<T> state(kDk, kDv, options);
    CHECK_THROWS_AS(state.prefill_into(q, k, v, linattn::Identity{}, plain_out), linattn::Error);
    CHECK(state.tokens() == 0);
    CHECK((plain_out.array() == kSentinel<T>).all());
  }
}

TEMPLATE_TEST_CASE("errors: HeadsView rejects empty sizes, null data and negative strides",
                   "[multi_head][heads_view][errors]", float) {
  using T = TestType;
  using Catch::Contains;
  std::vector<T> data(64, T(0));
  const HeadStrides strides{16, 8, 2, 1};
  CHECK_NOTHROW(HeadsView<T>(data.data(), 1, 2, 3, 2, strides));
  CHECK_THROWS_WITH(HeadsView<T>(data.data(), 0, 2, 3, 2, strides),
                    Contains("sizes must be >= 1") && Contains("[0, 2, 3, 2]"));
  CHECK_THROWS_WITH(HeadsView<T>(data.data(), 1, 0, 3, 2, strides),
                    Contains("sizes must be >= 1") && Contains("[1, 0, 3, 2]"));
  CHECK_THROWS_WITH(HeadsView<const T>(data.data(), 1, 2, 0, 2, strides),
                    Contains("sizes must be >= 1") && Contains("[1, 2, 0, 2]"));
  CHECK_THROWS_WITH(HeadsView<T>(data.data(), 1, 2, 3, -1, strides),
                    Contains("sizes must be >= 1") && Contains("[1, 2, 3, -1]"));
  CHECK_THROWS_WITH(HeadsView<T>::bhnd(data.data(), {2, 0, 4, 4}), Contains("sizes must be >= 1"));
  CHECK_THROWS_WITH(HeadsView<const T>::bnhd(data.data(), linattn::BnhdShape{2, 4, 2, 0}),
                    Contains("sizes must be >= 1"));
  CHECK_THROWS_WITH(HeadsView<T>(nullptr, 1, 2, 3, 2, strides), Contains("data is null"));
  CHECK_THROWS_WITH(HeadsView<const T>::bhnd(nullptr, {1, 1, 1, 1}), Contains("data is null"));
  CHECK_THROWS_WITH(HeadsView<T>(data.data(), 1, 2, 3, 2, HeadStrides{-1, 8, 2, 1}),
                    Contains("strides must be >= 0") && Contains("batch -1"));
  CHECK_THROWS_WITH(HeadsView<T>(data.data(), 1, 2, 3, 2, HeadStrides{16, -8, 2, 1}),
                    Contains("strides must be >= 0") && Contains("head -8"));
  CHECK_THROWS_WITH(HeadsView<T>(data.data(), 1, 2, 3, 2, HeadStrides{16, 8, -2, 1}),
                    Contains("strides must be >= 0") && Contains("token -2"));
  CHECK_THROWS_WITH(HeadsView<const T>(data.data(), 1, 2, 3, 2, HeadStrides{16, 8, 2, -1}),
                    Contains("strides must be >= 0") && Contains("dim -1"));
  CHECK_THROWS_AS(HeadsView<T>(data.data(), 1, 2, 3, 2, HeadStrides{16, 8, 2, -1}), linattn::Error);
}

#ifdef _OPENMP
// Eigen's products inside a call run on the calling thread (its OpenMP thread count is 1 for
// the call), and the caller's setting comes back afterwards, also after a throw.
TEST_CASE("OpenMP: calls leave the caller's thread count as they found it",
          "[multi_head][threads]") {
  const int before = omp_get_max_threads();
  omp_set_num_threads(3);
  const Matrix<double> q = gaussian<double>(300, kDk, 41), k = gaussian<double>(300, kDk, 42),
                       v = gaussian<double>(300, kDv, 43);
  const linattn::EluPlusOne elu;
  linattn::Options one;
  one.threads = 1;
  Matrix<double> out(300, kDv);
  linattn::linear_attention_into(q, k, v, elu, out, one);
  CHECK(omp_get_max_threads() == 3);
  linattn::softmax_attention_into(q, k, v, linattn::Mask::causal, out);
  CHECK(omp_get_max_threads() == 3);
  Matrix<double> bad = q;
  bad(7, 2) = std::numeric_limits<double>::quiet_NaN();
  linattn::RecurrentState<double> state(kDk, kDv, one);
  CHECK_THROWS_AS(state.prefill_into(bad, k, v, elu, out), linattn::Error);
  CHECK(omp_get_max_threads() == 3);
  state.prefill_into(q, k, v, elu, out);
  CHECK(omp_get_max_threads() == 3);
  omp_set_num_threads(before);
}
#endif

// ---------------------------------------------------------------------------------------------
// Transitions per head: gate views ([B, H, N, 1] and [B, H, N, C]) and HeadDecays.

namespace {

/// The naive gated recurrence of one head in double, from the formula:
/// S_t = diag(exp(g_t)) S_{t-1} + phi_k_t v_t^T, z alike, out_t = phi_q_t^T S_t / guard(. + eps)
/// (the numerator alone without normalize); g is N x 1 or N x C log gates (-inf resets).
Matrix<double> naive_gated(const Matrix<double>& phi_q, const Matrix<double>& phi_k,
                           const Matrix<double>& v, const Matrix<double>& g,
                           const linattn::Options& options) {
  const Eigen::Index n = phi_q.rows(), c = phi_q.cols();
  Matrix<double> s = Matrix<double>::Zero(c, v.cols());
  Eigen::VectorXd z = Eigen::VectorXd::Zero(c);
  Matrix<double> out(n, v.cols());
  for (Eigen::Index t = 0; t < n; ++t) {
    for (Eigen::Index i = 0; i < c; ++i) {
      const double a = std::exp(g(t, g.cols() == 1 ? 0 : i));
      s.row(i) = a * s.row(i) + phi_k(t, i) * v.row(t);
      z(i) = a * z(i) + phi_k(t, i);
    }
    const Eigen::RowVectorXd num = options.scale * (phi_q.row(t) * s);
    if (!options.normalize) {
      out.row(t) = num;
      continue;
    }
    double den = options.scale * phi_q.row(t).dot(z) + options.eps;
    if (std::abs(den) < options.eps) den = den < 0 ? -options.eps : options.eps;
    out.row(t) = num / den;
  }
  return out;
}

/// Log gates for B x H heads in a layout, D = 1 (scalar) or kDk (per feature): log a_t drawn
/// from -0.3 * |N(0, 1)| with a -infinity reset at token 37 of every other head (mid-chunk).
template <class T>
Heads<T> random_log_gates(Layout layout, Eigen::Index batch, Eigen::Index heads,
                          Eigen::Index tokens, Eigen::Index dim, std::uint64_t seed) {
  Heads<T> g(layout, batch, heads, tokens, dim, std::numeric_limits<T>::quiet_NaN());
  for (Eigen::Index b = 0; b < batch; ++b) {
    for (Eigen::Index h = 0; h < heads; ++h) {
      Matrix<T> x =
          -T(0.3) * gaussian<T>(tokens, dim, seed + 31 * static_cast<std::uint64_t>(b * heads + h))
                        .cwiseAbs();
      if ((b + h) % 2 == 1 && tokens > 37) {
        x.row(37).setConstant(-std::numeric_limits<T>::infinity());
      }
      g.set_head(b, h, x);
    }
  }
  return g;
}

/// The same gates as a_t = exp(g) (a reset becomes a_t = 0, out of range, so it is clamped to
/// the smallest normal: the gate forms are compared without resets).
template <class T>
Heads<T> exp_gates(const Heads<T>& log_gates, Layout layout, Eigen::Index batch, Eigen::Index heads,
                   Eigen::Index tokens, Eigen::Index dim) {
  Heads<T> a(layout, batch, heads, tokens, dim, std::numeric_limits<T>::quiet_NaN());
  for (Eigen::Index b = 0; b < batch; ++b) {
    for (Eigen::Index h = 0; h < heads; ++h) {
      a.set_head(b, h,
                 log_gates.head(b, h).array().exp().max(std::numeric_limits<T>::min()).matrix());
    }
  }
  return a;
}

}  // namespace

TEMPLATE_TEST_CASE("gated views: every layout and gate form gives each head the matrix call",
                   "[multi_head][gated]", float, double) {
  using T = TestType;
  const Eigen::Index B = 2, H = 3, N = 150;
  // Token-major views run block by block across heads: the same kernel, but a block edge may
  // split a chunk the matrix call keeps whole (before a reset), so within rounding only.
  Tally tally, token_major;
  double worst_naive = 0.0;
  for (std::size_t set = 0; set < kLayoutSets.size(); ++set) {
    const Layouts& layouts = kLayoutSets[set];
    const bool interleaved = layouts.q == Layout::bnhd || layouts.k == Layout::bnhd ||
                             layouts.v == Layout::bnhd || layouts.out == Layout::bnhd;
    for (const Kind kind : {Kind::featurized, Kind::elu, Kind::prf}) {
      const Problem<T> p = make_problem<T>(kind, layouts, B, H, N, 500 + 10 * set);
      for (const Eigen::Index gate_dim : {Eigen::Index(1), feature_dim(kind)}) {
        const Heads<T> g = random_log_gates<T>(layouts.k, B, H, N, gate_dim, 600 + set);
        const Heads<T> a = exp_gates(g, layouts.k, B, H, N, gate_dim);
        for (const bool log_space : {true, false}) {
          linattn::Options options;
          options.threads = 1;
          options.normalize = gate_dim == 1;
          options.scale = log_space ? 0.5 : 1.0;
          Heads<T> out(layouts.out, B, H, N, kDv, kSentinel<T>);
          auto run = [&](const auto& map) {
            if (log_space) {
              linattn::causal_gated_linear_attention_into(p.q.cview(), p.k.cview(), p.v.cview(),
                                                          linattn::log_gates(g.cview()), map,
                                                          out.view(), options);
            } else {
              linattn::causal_gated_linear_attention_into(p.q.cview(), p.k.cview(), p.v.cview(),
                                                          a.cview(), map, out.view(), options);
            }
          };
          if (kind == Kind::featurized) run(linattn::Identity{});
          if (kind == Kind::elu) run(linattn::EluPlusOne{});
          if (kind == Kind::prf) run(prf_map());
          INFO("layouts " << layout_name(layouts.q) << ", " << layout_name(layouts.k) << " -> "
                          << layout_name(layouts.out) << "; " << kind_name(kind)
                          << ", gate_dim = " << gate_dim << ", log_space = " << log_space);
          CHECK(out.gaps_hold(kSentinel<T>));
          for (Eigen::Index b = 0; b < B; ++b) {
            for (Eigen::Index h = 0; h < H; ++h) {
              const Matrix<T> q = p.q.head(b, h), k = p.k.head(b, h), v = p.v.head(b, h);
              const Matrix<T> gh = g.head(b, h), ah = a.head(b, h);
              Matrix<T> expected;
              auto plain = [&](const auto& map) {
                expected = log_space
                               ? linattn::causal_gated_linear_attention(
                                     q, k, v, linattn::log_gates(gh), map, options)
                               : linattn::causal_gated_linear_attention(q, k, v, ah, map, options);
              };
              if (kind == Kind::featurized) plain(linattn::Identity{});
              if (kind == Kind::elu) plain(linattn::EluPlusOne{});
              if (kind == Kind::prf) plain(prf_map());
              const Matrix<T> got = out.head(b, h);
              REQUIRE(got.allFinite());
              CHECK(relative_error(got, expected) <= tolerance<T>());
              (interleaved ? token_major : tally).add(got, expected);
              if (kind == Kind::featurized) {
                // Independent of the engine: the recurrence in double, resets included.
                const Matrix<double> gates =
                    log_space ? Matrix<double>(gh.template cast<double>())
                              : Matrix<double>(ah.template cast<double>().array().log().matrix());
                const Matrix<double> reference =
                    naive_gated(q.template cast<double>(), k.template cast<double>(),
                                v.template cast<double>(), gates, options);
                const double error = relative_error(got.template cast<double>(), reference);
                CHECK(error <= (std::is_same_v<T, float> ? 2e-5 : 1e-12));
                worst_naive = std::max(worst_naive, error);
              }
            }
          }
        }
      }
    }
  }
  WARN("gated views vs matrix calls: "
       << tally.differing << " of " << tally.compared
       << " heads not bit-identical, worst relative error " << tally.worst
       << "; token-major: " << token_major.differing << " of " << token_major.compared << ", worst "
       << token_major.worst << "; vs the naive recurrence " << worst_naive);
  CHECK(tally.differing == 0);
  CHECK(token_major.compared > 0);
}

TEMPLATE_TEST_CASE("HeadDecays: RetNet's multi-scale decay in one call", "[multi_head][gated]",
                   float, double) {
  using T = TestType;
  const Eigen::Index B = 2, H = 4, N = 200;
  linattn::HeadDecays decays;
  for (Eigen::Index h = 0; h < H; ++h) decays.values.push_back(1.0 - std::exp2(-5.0 - double(h)));
  Tally tally;
  double worst_naive = 0.0;
  for (const Layout layout : {Layout::bhnd, Layout::bnhd, Layout::padded}) {
    const Layouts layouts{layout, layout, layout, layout};
    const Problem<T> p = make_problem<T>(Kind::featurized, layouts, B, H, N, 700);
    for (const bool normalize : {true, false}) {
      linattn::Options options;
      options.threads = 1;
      options.normalize = normalize;
      Heads<T> out(layout, B, H, N, kDv, kSentinel<T>);
      linattn::causal_gated_linear_attention_into(p.q.cview(), p.k.cview(), p.v.cview(), decays,
                                                  linattn::Identity{}, out.view(), options);
      CHECK(out.gaps_hold(kSentinel<T>));
      for (Eigen::Index b = 0; b < B; ++b) {
        for (Eigen::Index h = 0; h < H; ++h) {
          INFO(layout_name(layout) << ", normalize = " << normalize << ", head " << h);
          linattn::Options head = options;
          head.decay = decays.values[std::size_t(h)];
          const Matrix<T> expected = linattn::causal_linear_attention(
              p.q.head(b, h), p.k.head(b, h), p.v.head(b, h), linattn::Identity{}, head);
          const Matrix<T> got = out.head(b, h);
          tally.add(got, expected);
          const Matrix<double> g =
              Matrix<double>::Constant(N, 1, std::log(decays.values[std::size_t(h)]));
          const double error =
              relative_error(got.template cast<double>(),
                             naive_gated(p.q.head(b, h).template cast<double>(),
                                         p.k.head(b, h).template cast<double>(),
                                         p.v.head(b, h).template cast<double>(), g, options));
          CHECK(error <= tolerance<T>());
          worst_naive = std::max(worst_naive, error);
        }
      }
    }
  }
  WARN("HeadDecays vs per-head Options::decay: " << tally.differing << " of " << tally.compared
                                                 << " heads not bit-identical; vs the naive "
                                                 << "recurrence " << worst_naive);
  CHECK(tally.differing == 0);
}

TEMPLATE_TEST_CASE("gated varlen: packed sequences with gates equal one call per sequence",
                   "[multi_head][gated][varlen]", float) {
  using T = TestType;
  const std::vector<std::int64_t> offsets = {0, 0, 1, 71, 76, 266};
  const Eigen::Index H = 3, total = 266;
  Tally tally, token_major;  // token-major: within rounding (see the gated views case)
  for (const Layout layout : {Layout::bhnd, Layout::bnhd, Layout::padded}) {
    const Layouts layouts{layout, layout, layout, layout};
    const Problem<T> p = make_problem<T>(Kind::elu, layouts, 1, H, total, 800);
    for (const Eigen::Index gate_dim : {Eigen::Index(1), kDk}) {
      const Heads<T> g = random_log_gates<T>(layout, 1, H, total, gate_dim, 810);
      for (const int threads : {1, 3}) {  // 15 pairs: threads over pairs
        linattn::Options options;
        options.threads = threads;
        Heads<T> out(layout, 1, H, total, kDv, kSentinel<T>);
        linattn::causal_gated_linear_attention_varlen_into(
            p.q.cview(), p.k.cview(), p.v.cview(), linattn::log_gates(g.cview()),
            linattn::EluPlusOne{}, offsets, out.view(), options);
        CHECK(out.gaps_hold(kSentinel<T>));
        linattn::Options plain = options;
        plain.threads = 1;
        for (Eigen::Index h = 0; h < H; ++h) {
          const Matrix<T> q = p.q.head(0, h), k = p.k.head(0, h), v = p.v.head(0, h);
          const Matrix<T> gh = g.head(0, h), got_head = out.head(0, h);
          for (std::size_t s = 0; s + 1 < offsets.size(); ++s) {
            const Eigen::Index begin = offsets[s], len = offsets[s + 1] - offsets[s];
            if (len == 0) continue;
            INFO(layout_name(layout) << ", gate_dim = " << gate_dim << ", threads = " << threads
                                     << ", head " << h << ", sequence " << s);
            const Matrix<T> gs = gh.middleRows(begin, len);
            const Matrix<T> expected = linattn::causal_gated_linear_attention(
                q.middleRows(begin, len), k.middleRows(begin, len), v.middleRows(begin, len),
                linattn::log_gates(gs), linattn::EluPlusOne{}, plain);
            const Matrix<T> got = got_head.middleRows(begin, len);
            CHECK(relative_error(got, expected) <= tolerance<T>());
            (layout == Layout::bnhd ? token_major : tally).add(got, expected);
          }
        }
      }
    }
  }
  WARN("gated varlen vs per-sequence calls: "
       << tally.differing << " of " << tally.compared << " not bit-identical, worst relative error "
       << tally.worst << "; token-major: " << token_major.differing << " of "
       << token_major.compared << ", worst " << token_major.worst);
  CHECK(tally.differing == 0);
}

TEMPLATE_TEST_CASE("gated views: threads over heads and over one long sequence",
                   "[multi_head][gated][threads]", float) {
  using T = TestType;
  SECTION("16 heads: bit for bit") {
    const Eigen::Index B = 1, H = 16, N = 300;
    const Layouts layouts{Layout::bnhd, Layout::bnhd, Layout::bnhd, Layout::bnhd};
    const Problem<T> p = make_problem<T>(Kind::featurized, layouts, B, H, N, 900);
    for (const Eigen::Index gate_dim : {Eigen::Index(1), kDk}) {
      const Heads<T> g = random_log_gates<T>(Layout::bnhd, B, H, N, gate_dim, 910);
      std::vector<T> serial;
      for (const int threads : {1, 2, 4}) {
        linattn::Options options;
        options.threads = threads;
        Heads<T> out(layouts.out, B, H, N, kDv, kSentinel<T>);
        linattn::causal_gated_linear_attention_into(p.q.cview(), p.k.cview(), p.v.cview(),
                                                    linattn::log_gates(g.cview()),
                                                    linattn::Identity{}, out.view(), options);
        if (threads == 1) {
          serial = out.data();
        } else {
          INFO("gate_dim = " << gate_dim << ", threads = " << threads);
          CHECK(same_data(out.data(), serial));
        }
      }
    }
  }
  SECTION("one head of 8192 tokens split across threads") {
    const Eigen::Index N = 8192;
    const Layouts layouts{Layout::bhnd, Layout::bhnd, Layout::bhnd, Layout::bhnd};
    const Problem<T> p = make_problem<T>(Kind::featurized, layouts, 1, 1, N, 920);
    for (const Eigen::Index gate_dim : {Eigen::Index(1), kDk}) {
      const Heads<T> g = random_log_gates<T>(Layout::bhnd, 1, 1, N, gate_dim, 930);
      linattn::Options options;
      options.threads = 1;
      Heads<T> serial(Layout::bhnd, 1, 1, N, kDv, kSentinel<T>);
      linattn::causal_gated_linear_attention_into(p.q.cview(), p.k.cview(), p.v.cview(),
                                                  linattn::log_gates(g.cview()),
                                                  linattn::Identity{}, serial.view(), options);
      options.threads = 2;
      Heads<T> out(Layout::bhnd, 1, 1, N, kDv, kSentinel<T>);
      linattn::causal_gated_linear_attention_into(p.q.cview(), p.k.cview(), p.v.cview(),
                                                  linattn::log_gates(g.cview()),
                                                  linattn::Identity{}, out.view(), options);
      INFO("gate_dim = " << gate_dim);
      const Matrix<T> got = out.head(0, 0);
      REQUIRE(got.allFinite());
      CHECK(relative_error(got, serial.head(0, 0)) <= tolerance<T>());
    }
  }
}

TEMPLATE_TEST_CASE("gated views: bad gates and decays throw before anything is written",
                   "[multi_head][gated][errors]", float) {
  using T = TestType;
  using Catch::Contains;
  const Eigen::Index B = 2, H = 3, N = 10;
  const Layouts layouts{Layout::bhnd, Layout::bhnd, Layout::bhnd, Layout::bhnd};
  const Problem<T> p = make_problem<T>(Kind::featurized, layouts, B, H, N, 1000);
  Heads<T> out(Layout::bhnd, B, H, N, kDv, kSentinel<T>);
  out.view().head(0, 0).setConstant(T(5));
  const std::vector<T> untouched = out.data();
  auto gated = [&](const auto& gates, const linattn::Options& options = {}) {
    linattn::causal_gated_linear_attention_into(p.q.cview(), p.k.cview(), p.v.cview(), gates,
                                                linattn::Identity{}, out.view(), options);
  };
  const Heads<T> good = random_log_gates<T>(Layout::bhnd, B, H, N, 1, 1010);
  // Shapes: wrong D, wrong N, wrong H.
  const Heads<T> wide = random_log_gates<T>(Layout::bhnd, B, H, N, 2, 1020);
  const Heads<T> short_gates = random_log_gates<T>(Layout::bhnd, B, H, N - 1, 1, 1030);
  const Heads<T> few = random_log_gates<T>(Layout::bhnd, B, H - 1, N, 1, 1040);
  CHECK_THROWS_WITH(gated(linattn::log_gates(wide.cview())),
                    Contains("gates is [2, 3, 10, 2]") && Contains("[2, 3, 10, 6]"));
  CHECK_THROWS_WITH(gated(linattn::log_gates(short_gates.cview())),
                    Contains("gates is [2, 3, 9, 1]"));
  CHECK_THROWS_WITH(gated(linattn::log_gates(few.cview())), Contains("gates is [2, 2, 10, 1]"));
  // Ranges, in the last head: a log gate > 0, NaN; a_t = 0 and a_t > 1.
  for (const T bad : {T(0.5), std::numeric_limits<T>::quiet_NaN()}) {
    Heads<T> g = good;
    Matrix<T> last = g.head(1, 2);
    last(7, 0) = bad;
    g.set_head(1, 2, last);
    CHECK_THROWS_WITH(gated(linattn::log_gates(g.cview())),
                      Contains("gates[b=1, h=2]") && Contains("row 7"));
  }
  for (const T bad : {T(0), T(1.5)}) {
    Heads<T> a = exp_gates(good, Layout::bhnd, B, H, N, 1);
    Matrix<T> last = a.head(1, 2);
    last(3, 0) = bad;
    a.set_head(1, 2, last);
    CHECK_THROWS_WITH(gated(a.cview()), Contains("gates[b=1, h=2]") && Contains("(0, 1]"));
  }
  linattn::Options decayed;
  decayed.decay = 0.9;
  CHECK_THROWS_WITH(gated(linattn::log_gates(good.cview()), decayed),
                    Contains("Options::decay must be 1"));
  // HeadDecays: the count, the range, and Options::decay.
  CHECK_THROWS_WITH(gated(linattn::HeadDecays{{0.9, 0.8}}), Contains("H = 3"));
  CHECK_THROWS_WITH(gated(linattn::HeadDecays{{0.9, 0.0, 0.8}}), Contains("values[1]"));
  CHECK_THROWS_WITH(gated(linattn::HeadDecays{{0.9, 1.5, 0.8}}), Contains("values[1]"));
  CHECK_THROWS_WITH(gated(linattn::HeadDecays{{0.9, 0.8, 0.7}}, decayed),
                    Contains("Options::decay must be 1"));
  // A NaN in the last head's values with check_finite, after the gates are fine.
  Problem<T> nan = p;
  Matrix<T> v_last = nan.v.head(1, 2);
  v_last(9, 4) = std::numeric_limits<T>::quiet_NaN();
  nan.v.set_head(1, 2, v_last);
  CHECK_THROWS_WITH(linattn::causal_gated_linear_attention_into(
                        nan.q.cview(), nan.k.cview(), nan.v.cview(),
                        linattn::log_gates(good.cview()), linattn::Identity{}, out.view()),
                    Contains("v[b=1, h=2]"));
  CHECK(same_data(out.data(), untouched));
}

TEMPLATE_TEST_CASE("token-major views: a bad value is named by its head and nothing is written",
                   "[multi_head][gated][errors]", float) {
  using T = TestType;
  using Catch::Contains;
  // [B, N, H, D]: the scans pass over whole tokens first, then name the head that failed.
  const Eigen::Index B = 2, H = 4, N = 600;
  const Layouts layouts{Layout::bnhd, Layout::bnhd, Layout::bnhd, Layout::bnhd};
  const Problem<T> p = make_problem<T>(Kind::featurized, layouts, B, H, N, 1100);
  const Heads<T> g = random_log_gates<T>(Layout::bnhd, B, H, N, kDk, 1110);
  Heads<T> out(Layout::bnhd, B, H, N, kDv, kSentinel<T>);
  const std::vector<T> untouched = out.data();
  for (const int threads : {1, 2}) {
    linattn::Options options;
    options.threads = threads;
    Problem<T> nan = p;
    Matrix<T> k_head = nan.k.head(1, 2);
    k_head(N - 1, 3) = std::numeric_limits<T>::infinity();
    nan.k.set_head(1, 2, k_head);
    CHECK_THROWS_WITH(linattn::causal_gated_linear_attention_into(
                          nan.q.cview(), nan.k.cview(), nan.v.cview(),
                          linattn::log_gates(g.cview()), linattn::Identity{}, out.view(), options),
                      Contains("phi_k[b=1, h=2]") && Contains("row 599"));
    Heads<T> bad = g;
    Matrix<T> g_head = bad.head(0, 3);
    g_head(450, 1) = T(0.5);
    bad.set_head(0, 3, g_head);
    CHECK_THROWS_WITH(linattn::causal_gated_linear_attention_into(
                          p.q.cview(), p.k.cview(), p.v.cview(), linattn::log_gates(bad.cview()),
                          linattn::Identity{}, out.view(), options),
                      Contains("gates[b=0, h=3]") && Contains("row 450"));
    CHECK(same_data(out.data(), untouched));
  }
}

TEMPLATE_TEST_CASE(
    "grouped heads: output head h reads head h / (H / H_in) of each input, or "
    "h % H_in tiled",
    "[multi_head][grouped]", float) {
  using T = TestType;
  // FLA's and HF's grouping (repeat_interleave): Qwen3-Next's fewer q/k heads than v heads, and
  // grouped-query / multi-query attention's fewer k/v heads than q heads; and ggml's
  // (ggml_repeat over heads: h % H_in) with HeadGrouping::tiled.
  const Eigen::Index B = 2, H = 4, N = 150;
  struct Grouping {
    Eigen::Index q, k, v;
  };
  Tally tally, token_major;
  double worst = 0.0;
  for (const Grouping heads :
       {Grouping{2, 2, 4}, Grouping{4, 2, 2}, Grouping{4, 1, 1}, Grouping{1, 4, 2}}) {
    for (const linattn::HeadGrouping grouping :
         {linattn::HeadGrouping::interleaved, linattn::HeadGrouping::tiled}) {
      const bool tiled = grouping == linattn::HeadGrouping::tiled;
      // The grouping written out: output head h reads input head h * H_in / H, or h % H_in.
      const auto reads = [&](Eigen::Index h, Eigen::Index count) {
        return tiled ? h % count : h * count / H;
      };
      for (const Layout layout : {Layout::bhnd, Layout::bnhd, Layout::padded}) {
        if (tiled && layout == Layout::padded) continue;  // layouts are covered interleaved
        const Heads<T> q = random_heads<T>(layout, B, heads.q, N, kDk, 1200, true);
        const Heads<T> k = random_heads<T>(layout, B, heads.k, N, kDk, 1210, true);
        const Heads<T> v = random_heads<T>(layout, B, heads.v, N, kDv, 1220);
        const Heads<T> g = random_log_gates<T>(layout, B, H, N, 1, 1230);
        for (const bool gated : {false, true}) {
          linattn::Options options;
          options.threads = 2;
          options.head_grouping = grouping;
          Heads<T> out(layout, B, H, N, kDv, kSentinel<T>);
          if (gated) {
            linattn::causal_gated_linear_attention_into(q.cview(), k.cview(), v.cview(),
                                                        linattn::log_gates(g.cview()),
                                                        linattn::Identity{}, out.view(), options);
          } else {
            linattn::causal_linear_attention_into(q.cview(), k.cview(), v.cview(),
                                                  linattn::Identity{}, out.view(), options);
          }
          CHECK(out.gaps_hold(kSentinel<T>));
          for (Eigen::Index b = 0; b < B; ++b) {
            for (Eigen::Index h = 0; h < H; ++h) {
              INFO("heads q " << heads.q << ", k " << heads.k << ", v " << heads.v << ", "
                              << layout_name(layout) << ", gated = " << gated << ", head " << h
                              << (tiled ? ", tiled" : ", interleaved"));
              const Matrix<T> qh = q.head(b, reads(h, heads.q)), kh = k.head(b, reads(h, heads.k)),
                              vh = v.head(b, reads(h, heads.v)), gh = g.head(b, h);
              const Matrix<T> expected =
                  gated
                      ? linattn::causal_gated_linear_attention(qh, kh, vh, linattn::log_gates(gh),
                                                               linattn::Identity{}, options)
                      : linattn::causal_linear_attention(qh, kh, vh, linattn::Identity{}, options);
              const Matrix<T> got = out.head(b, h);
              const double error = relative_error(got, expected);
              CHECK(error <= tolerance<T>());
              worst = std::max(worst, error);
              (layout == Layout::bnhd ? token_major : tally).add(got, expected);
            }
          }
        }
      }
    }
    // Softmax groups its heads the same way.
    const Heads<T> q = random_heads<T>(Layout::bnhd, B, heads.q, N, kDk, 1240);
    const Heads<T> k = random_heads<T>(Layout::bnhd, B, heads.k, N, kDk, 1250);
    const Heads<T> v = random_heads<T>(Layout::bnhd, B, heads.v, N, kDv, 1260);
    Heads<T> out(Layout::bnhd, B, H, N, kDv, kSentinel<T>);
    linattn::softmax_attention_into(q.cview(), k.cview(), v.cview(), linattn::Mask::causal,
                                    out.view());
    for (Eigen::Index h = 0; h < H; ++h) {
      const Matrix<T> expected =
          linattn::softmax_attention(q.head(1, h * heads.q / H), k.head(1, h * heads.k / H),
                                     v.head(1, h * heads.v / H), linattn::Mask::causal);
      CHECK(relative_error(out.head(1, h), expected) <= tolerance<T>());
    }
  }
  WARN("grouped heads vs per-head calls: "
       << tally.differing << " of " << tally.compared << " not bit-identical; token-major "
       << token_major.differing << " of " << token_major.compared << "; worst " << worst);
  CHECK(tally.differing == 0);
  // A batch prefill groups alike: state b * H + h holds output head h.
  const Heads<T> q = random_heads<T>(Layout::bnhd, B, 2, N, kDk, 1270, true);
  const Heads<T> k = random_heads<T>(Layout::bnhd, B, 2, N, kDk, 1280, true);
  const Heads<T> v = random_heads<T>(Layout::bnhd, B, H, N, kDv, 1290);
  Heads<T> out(Layout::bnhd, B, H, N, kDv, kSentinel<T>);
  linattn::RecurrentStateBatch<T> batch(B * H, kDk, kDv);
  batch.prefill_into(q.cview(), k.cview(), v.cview(), linattn::Identity{}, out.view());
  for (Eigen::Index i = 0; i < B * H; ++i) {
    linattn::RecurrentState<T> state(kDk, kDv);
    const Matrix<T> expected = state.prefill(q.head(i / H, (i % H) / 2), k.head(i / H, (i % H) / 2),
                                             v.head(i / H, i % H), linattn::Identity{});
    CHECK(Matrix<T>(out.head(i / H, i % H)) == expected);
    CHECK(batch[i].s() == state.s());
  }
  // Heads that do not divide out's throw, naming the rule.
  const Heads<T> three = random_heads<T>(Layout::bhnd, B, 3, N, kDk, 1300, true);
  Heads<T> out4(Layout::bhnd, B, H, N, kDv, kSentinel<T>);
  const std::vector<T> untouched = out4.data();
  CHECK_THROWS_WITH(
      linattn::causal_linear_attention_into(three.cview(), three.cview(), v.cview(),
                                            linattn::Identity{}, out4.view()),
      Catch::Contains("phi_q is [2, 3, 150, 6]") && Catch::Contains("H divide out's"));
  CHECK(same_data(out4.data(), untouched));
}

// ---------------------------------------------------------------------------------------------
// RWKV-6's bonus u on views: with_bonus(gate view, u) with u H x C, one row per head.

TEMPLATE_TEST_CASE("bonus views: every layout gives each head the matrix call and FLA's recurrence",
                   "[multi_head][gated][bonus]", float, double) {
  using T = TestType;
  const Eigen::Index B = 2, H = 3, N = 150;
  Tally tally;
  double worst_naive = 0.0;
  for (std::size_t set = 0; set < kLayoutSets.size(); ++set) {
    const Layouts& layouts = kLayoutSets[set];
    for (const Kind kind : {Kind::featurized, Kind::elu}) {
      const Problem<T> p = make_problem<T>(kind, layouts, B, H, N, 700 + 10 * set);
      const Matrix<T> u = gaussian<T>(H, kDk, 710 + set);
      for (const Eigen::Index gate_dim : {Eigen::Index(1), kDk}) {
        const Heads<T> g = random_log_gates<T>(layouts.k, B, H, N, gate_dim, 720 + set);
        const Heads<T> a = exp_gates(g, layouts.k, B, H, N, gate_dim);
        for (const bool log_space : {true, false}) {
          linattn::Options options;
          options.normalize = false;
          options.chunk = 32;
          options.scale = 1.0 / std::sqrt(double(kDk));
          Heads<T> out(layouts.out, B, H, N, kDv, kSentinel<T>);
          auto run = [&](const auto& map) {
            if (log_space) {
              linattn::causal_gated_linear_attention_into(
                  p.q.cview(), p.k.cview(), p.v.cview(),
                  linattn::with_bonus(linattn::log_gates(g.cview()), u), map, out.view(), options);
            } else {
              linattn::causal_gated_linear_attention_into(p.q.cview(), p.k.cview(), p.v.cview(),
                                                          linattn::with_bonus(a.cview(), u), map,
                                                          out.view(), options);
            }
          };
          if (kind == Kind::featurized) run(linattn::Identity{});
          if (kind == Kind::elu) run(linattn::EluPlusOne{});
          INFO("layouts " << layout_name(layouts.q) << ", " << layout_name(layouts.k) << " -> "
                          << layout_name(layouts.out) << "; " << kind_name(kind)
                          << ", gate_dim = " << gate_dim << ", log_space = " << log_space);
          CHECK(out.gaps_hold(kSentinel<T>));
          for (Eigen::Index b = 0; b < B; ++b) {
            for (Eigen::Index h = 0; h < H; ++h) {
              const Matrix<T> q = p.q.head(b, h), k = p.k.head(b, h), v = p.v.head(b, h);
              const Matrix<T> gh = g.head(b, h), ah = a.head(b, h);
              const Matrix<T> uh = u.row(h);
              Matrix<T> expected;
              auto plain = [&](const auto& map) {
                expected = log_space ? linattn::causal_gated_linear_attention(
                                           q, k, v, linattn::with_bonus(linattn::log_gates(gh), uh),
                                           map, options)
                                     : linattn::causal_gated_linear_attention(
                                           q, k, v, linattn::with_bonus(ah, uh), map, options);
              };
              if (kind == Kind::featurized) plain(linattn::Identity{});
              if (kind == Kind::elu) plain(linattn::EluPlusOne{});
              const Matrix<T> got = out.head(b, h);
              REQUIRE(got.allFinite());
              tally.add(got, expected);
              if (kind == Kind::featurized) {
                const Matrix<double> w =
                    log_space ? Matrix<double>(gh.template cast<double>())
                              : Matrix<double>(ah.template cast<double>().array().log().matrix());
                Matrix<double> state = Matrix<double>::Zero(kDk, kDv);
                const Matrix<double> reference = linattn_test::naive_rwkv6(
                    q.template cast<double>(), k.template cast<double>(), v.template cast<double>(),
                    w, uh.transpose().template cast<double>(), options.scale, state);
                const double error = relative_error(got.template cast<double>(), reference);
                CHECK(error <= (std::is_same_v<T, float> ? 2e-5 : 1e-12));
                worst_naive = std::max(worst_naive, error);
              }
            }
          }
        }
      }
    }
  }
  WARN("bonus views vs matrix calls: " << tally.differing << " of " << tally.compared
                                       << " heads not bit-identical, worst " << tally.worst
                                       << "; vs FLA's recurrence " << worst_naive);
  // Every head runs the matrix call's kernel on the same rows and chunks.
  CHECK(tally.differing == 0);
  CHECK(tally.compared == static_cast<int>(kLayoutSets.size()) * 2 * 2 * 2 * B * H);
}

TEMPLATE_TEST_CASE("bonus views: varlen sequences, threads, and one long head on two threads",
                   "[multi_head][gated][bonus][threads]", float) {
  using T = TestType;
  const Eigen::Index H = 2, total = 2400;
  const std::vector<std::int64_t> offsets = {0, 37, 37, 1300, total};
  const Problem<T> p = make_problem<T>(Kind::featurized, kLayoutSets[1], 1, H, total, 740);
  const Heads<T> g = random_log_gates<T>(Layout::bnhd, 1, H, total, kDk, 741);
  const Matrix<T> u = gaussian<T>(H, kDk, 742);
  linattn::Options options;
  options.normalize = false;
  options.threads = 1;
  Heads<T> one(Layout::bnhd, 1, H, total, kDv, kSentinel<T>);
  const auto bonus = linattn::with_bonus(linattn::log_gates(g.cview()), u);
  linattn::causal_gated_linear_attention_varlen_into(p.q.cview(), p.k.cview(), p.v.cview(), bonus,
                                                     linattn::Identity{}, offsets, one.view(),
                                                     options);
  CHECK(one.gaps_hold(kSentinel<T>));
  for (Eigen::Index h = 0; h < H; ++h) {
    for (std::size_t s = 0; s + 1 < offsets.size(); ++s) {
      const Eigen::Index begin = offsets[s], len = offsets[s + 1] - offsets[s];
      if (len == 0) continue;
      const Matrix<T> q = p.q.head(0, h).middleRows(begin, len),
                      k = p.k.head(0, h).middleRows(begin, len),
                      v = p.v.head(0, h).middleRows(begin, len),
                      w = g.head(0, h).middleRows(begin, len);
      const Matrix<T> uh = u.row(h);
      const Matrix<T> expected = linattn::causal_gated_linear_attention(
          q, k, v, linattn::with_bonus(linattn::log_gates(w), uh), linattn::Identity{}, options);
      INFO("head " << h << ", sequence " << s);
      CHECK(Matrix<T>(one.head(0, h).middleRows(begin, len)) == expected);
    }
  }
  // Two threads: over the 2 x 4 (sequence, head) pairs, and over one long head's tokens.
  linattn::Options threaded = options;
  threaded.threads = 2;
  Heads<T> two(Layout::bnhd, 1, H, total, kDv, kSentinel<T>);
  linattn::causal_gated_linear_attention_varlen_into(p.q.cview(), p.k.cview(), p.v.cview(), bonus,
                                                     linattn::Identity{}, offsets, two.view(),
                                                     threaded);
  CHECK(same_data(two.data(), one.data()));
  Heads<T> long_one(Layout::bhnd, 1, 1, total, kDv, kSentinel<T>),
      long_two(Layout::bhnd, 1, 1, total, kDv, kSentinel<T>);
  const HeadsView<const T> q1(p.q.cview().data(), 1, 1, total, kDk, p.q.strides()),
      k1(p.k.cview().data(), 1, 1, total, kDk, p.k.strides()),
      v1(p.v.cview().data(), 1, 1, total, kDv, p.v.strides()),
      g1(g.cview().data(), 1, 1, total, kDk, g.strides());
  const Matrix<T> u1 = u.topRows(1);
  linattn::causal_gated_linear_attention_into(q1, k1, v1,
                                              linattn::with_bonus(linattn::log_gates(g1), u1),
                                              linattn::Identity{}, long_one.view(), options);
  linattn::causal_gated_linear_attention_into(q1, k1, v1,
                                              linattn::with_bonus(linattn::log_gates(g1), u1),
                                              linattn::Identity{}, long_two.view(), threaded);
  const double error = relative_error(long_two.head(0, 0), long_one.head(0, 0));
  INFO("two threads on one head: " << error);
  CHECK(error <= 2e-5);
}

TEMPLATE_TEST_CASE("bonus views: bad u and options throw before anything is written",
                   "[multi_head][gated][bonus][errors]", float) {
  using T = TestType;
  const Eigen::Index B = 1, H = 2, N = 40;
  const Problem<T> p = make_problem<T>(Kind::featurized, kLayoutSets[0], B, H, N, 750);
  const Heads<T> g = random_log_gates<T>(Layout::bhnd, B, H, N, kDk, 751);
  Heads<T> out(Layout::bhnd, B, H, N, kDv, kSentinel<T>);
  linattn::Options options;
  options.normalize = false;
  auto call = [&](const Matrix<T>& u, const linattn::Options& o) {
    linattn::causal_gated_linear_attention_into(
        p.q.cview(), p.k.cview(), p.v.cview(),
        linattn::with_bonus(linattn::log_gates(g.cview()), u), linattn::Identity{}, out.view(), o);
  };
  const Matrix<T> good = gaussian<T>(H, kDk, 752);
  CHECK_THROWS_WITH(call(good.topRows(1), options),
                    Catch::Contains("the bonus u is 1 x 6 but must be 2 x 6"));
  CHECK_THROWS_WITH(call(good.leftCols(kDk - 1), options), Catch::Contains("the bonus u"));
  Matrix<T> bad = good;
  bad(1, 3) = std::numeric_limits<T>::quiet_NaN();
  CHECK_THROWS_AS(call(bad, options), linattn::Error);
  linattn::Options normalized = options;
  normalized.normalize = true;
  CHECK_THROWS_WITH(call(good, normalized), Catch::Contains("normalize = false"));
  Heads<T> positive = g;
  positive.set_head(0, 1, Matrix<T>::Constant(N, kDk, T(0.5)));
  CHECK_THROWS_WITH(linattn::causal_gated_linear_attention_into(
                        p.q.cview(), p.k.cview(), p.v.cview(),
                        linattn::with_bonus(linattn::log_gates(positive.cview()), good),
                        linattn::Identity{}, out.view(), options),
                    Catch::Contains("gates[b=0, h=1]"));
  CHECK(out.gaps_hold(kSentinel<T>));
  CHECK(std::all_of(out.data().begin(), out.data().end(), [](T x) { return x == kSentinel<T>; }));
}

// ---------------------------------------------------------------------------------------------
// Non-causal cross-attention on views: N_q queries over N_k keys and values.

TEMPLATE_TEST_CASE("cross views: N_q queries over N_k keys give each head the matrix call",
                   "[multi_head][cross]", float) {
  using T = TestType;
  const Eigen::Index B = 2, H = 4;
  Tally tally;
  double worst_naive = 0.0;
  for (const auto& [n_q, n_k] : {std::pair<Eigen::Index, Eigen::Index>{37, 300}, {500, 20}}) {
    for (std::size_t set = 0; set < kLayoutSets.size(); ++set) {
      const Layouts& layouts = kLayoutSets[set];
      for (const Kind kind : {Kind::featurized, Kind::elu, Kind::prf}) {
        // Grouped heads too: 2 key/value heads for 4 query and output heads (multi-query-like).
        for (const Eigen::Index kv_heads : {H, Eigen::Index(2)}) {
          const bool positive = kind == Kind::featurized;
          const std::uint64_t seed = 800 + 10 * set + static_cast<std::uint64_t>(n_q);
          const Heads<T> q = random_heads<T>(layouts.q, B, H, n_q, kDk, seed, positive);
          const Heads<T> k = random_heads<T>(layouts.k, B, kv_heads, n_k, kDk, seed + 1, positive);
          const Heads<T> v = random_heads<T>(layouts.v, B, kv_heads, n_k, kDv, seed + 2);
          for (const int threads : {1, 2}) {
            linattn::Options options;
            options.threads = threads;
            Heads<T> out(layouts.out, B, H, n_q, kDv, kSentinel<T>);
            attend_views<T>(kind, false, q.cview(), k.cview(), v.cview(), out.view(), options);
            INFO("N_q = " << n_q << ", N_k = " << n_k << ", layouts " << layout_name(layouts.q)
                          << ", " << layout_name(layouts.k) << " -> " << layout_name(layouts.out)
                          << "; " << kind_name(kind) << ", " << kv_heads
                          << " key heads, threads = " << threads);
            CHECK(out.gaps_hold(kSentinel<T>));
            for (Eigen::Index b = 0; b < B; ++b) {
              for (Eigen::Index h = 0; h < H; ++h) {
                const Eigen::Index hk = h / (H / kv_heads);
                const Matrix<T> qh = q.head(b, h), kh = k.head(b, hk), vh = v.head(b, hk);
                linattn::Options one = options;
                one.threads = 1;
                const Matrix<T> expected = attend_plain<T>(kind, false, qh, kh, vh, one);
                const Matrix<T> got = out.head(b, h);
                REQUIRE(got.allFinite());
                CHECK(relative_error(got, expected) <= tolerance<T>());
                if (threads == 1) tally.add(got, expected);
                if (kind == Kind::featurized) {
                  const Matrix<double> reference = linattn_test::naive_linear_attention(
                      qh.template cast<double>(), kh.template cast<double>(),
                      vh.template cast<double>(), false, 1.0, options.eps, true);
                  const double error = relative_error(got.template cast<double>(), reference);
                  CHECK(error <= tolerance<T>());
                  worst_naive = std::max(worst_naive, error);
                }
              }
            }
          }
        }
      }
    }
  }
  WARN("cross views vs matrix calls: " << tally.differing << " of " << tally.compared
                                       << " heads not bit-identical, worst " << tally.worst
                                       << "; vs the naive formula " << worst_naive);
  CHECK(tally.differing == 0);
}

TEMPLATE_TEST_CASE("cross views: mismatched keys and values, causal and varlen calls throw",
                   "[multi_head][cross][errors]", float) {
  using T = TestType;
  using Catch::Contains;
  const Eigen::Index B = 1, H = 2;
  const Heads<T> q = random_heads<T>(Layout::bhnd, B, H, 30, kDk, 900, true);
  const Heads<T> k = random_heads<T>(Layout::bhnd, B, H, 50, kDk, 901, true);
  const Heads<T> v = random_heads<T>(Layout::bhnd, B, H, 50, kDv, 902);
  const Heads<T> v_short = random_heads<T>(Layout::bhnd, B, H, 49, kDv, 903);
  Heads<T> out(Layout::bhnd, B, H, 30, kDv, kSentinel<T>);
  const linattn::Identity id;
  CHECK_THROWS_WITH(
      linattn::linear_attention_into(q.cview(), k.cview(), v_short.cview(), id, out.view()),
      Contains("v's N be phi_k's"));
  CHECK_THROWS_WITH(
      linattn::causal_linear_attention_into(q.cview(), k.cview(), v.cview(), id, out.view()),
      Contains("B, H and N must match"));
  const std::vector<std::int64_t> offsets = {0, 10, 30};
  CHECK_THROWS_AS(linattn::linear_attention_varlen_into(q.cview(), k.cview(), v.cview(), id,
                                                        offsets, out.view()),
                  linattn::Error);
  Heads<T> wide(Layout::bhnd, B, H, 50, kDv, kSentinel<T>);
  CHECK_THROWS_WITH(
      linattn::linear_attention_into(q.cview(), k.cview(), v.cview(), id, wide.view()),
      Contains("out is"));
  CHECK(std::all_of(out.data().begin(), out.data().end(), [](T x) { return x == kSentinel<T>; }));
}

}  // namespace linattn_test_multi_head
