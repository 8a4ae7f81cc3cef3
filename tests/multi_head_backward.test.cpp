// The multi-head (view) and varlen backward: each head against the matrix backward on that
// head, grouped heads' sums, packed sequences, gate views, errors, threads, and central finite
// differences of the view forward.
#include <algorithm>
#include <array>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <linattn/backward.hpp>
#include <linattn/feature_maps.hpp>
#include <linattn/gated.hpp>
#include <linattn/heads_view.hpp>
#include <linattn/multi_head.hpp>
#include <linattn/multi_head_backward.hpp>
#include <string>
#include <type_traits>
#include <vector>

#include "heads_support.hpp"
#include "support.hpp"

// Every name of this file, apart from the other files of its bundle (LINATTN_TEST_BUNDLES).
namespace linattn_test_multi_head_backward {

using linattn::GatedAttentionGradients;
using linattn::HeadShape;
using linattn::HeadStrides;
using linattn::HeadsView;
using linattn::Matrix;
using linattn_test::gaussian;
using linattn_test::Heads;
using linattn_test::Layout;
using linattn_test::layout_name;

namespace {

constexpr Eigen::Index kDk = 6;  // q, k (and C: Identity and EluPlusOne keep the width)
constexpr Eigen::Index kDv = 5;

template <class T>
constexpr T kSentinel = T(-7.25);  // fills gradient views before a call

/// Gaussian heads, NaN in every gap (a read of a gap would show); `positive`: elu + 1 of them
/// (featurized inputs, well away from the denominator guard).
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

/// Log gates g = log sigmoid(x + 2) <= 0 (a in (0.5, 1) mostly) and their a = exp(g).
template <class T>
struct GatePair {
  Heads<T> log;
  Heads<T> plain;
};

template <class T>
GatePair<T> random_gates(Layout layout, Eigen::Index batch, Eigen::Index heads, Eigen::Index tokens,
                         Eigen::Index dim, std::uint64_t seed) {
  GatePair<T> gates{Heads<T>(layout, batch, heads, tokens, dim, T(0)),
                    Heads<T>(layout, batch, heads, tokens, dim, T(1))};
  for (Eigen::Index b = 0; b < batch; ++b) {
    for (Eigen::Index h = 0; h < heads; ++h) {
      const Matrix<double> x =
          gaussian<double>(tokens, dim, seed + 131 * static_cast<std::uint64_t>(b * heads + h));
      const Matrix<double> a = (1.0 / (1.0 + (-(x.array() + 2.0)).exp())).matrix();
      gates.log.set_head(b, h, a.array().log().matrix().template cast<T>());
      gates.plain.set_head(b, h, a.template cast<T>());
    }
  }
  return gates;
}

/// The inputs of one view call: q, k, v with their own head counts, and grad_out with H.
template <class T>
struct Problem {
  Heads<T> q, k, v, grad_out;
};

template <class T>
Problem<T> make_problem(Layout layout, Eigen::Index batch, Eigen::Index heads, Eigen::Index hq,
                        Eigen::Index hk, Eigen::Index hv, Eigen::Index tokens, bool featurized,
                        std::uint64_t seed) {
  return Problem<T>{random_heads<T>(layout, batch, hq, tokens, kDk, seed, featurized),
                    random_heads<T>(layout, batch, hk, tokens, kDk, seed + 1, featurized),
                    random_heads<T>(layout, batch, hv, tokens, kDv, seed + 2),
                    random_heads<T>(layout, batch, heads, tokens, kDv, seed + 3)};
}

/// The gradient views of a call, filled with the sentinel.
template <class T>
struct GradViews {
  Heads<T> q, k, v, gates;
};

template <class T>
GradViews<T> sentinel_grads(Layout layout, const Problem<T>& p, Eigen::Index batch,
                            Eigen::Index tokens, Eigen::Index gate_heads, Eigen::Index gate_dim) {
  return GradViews<T>{Heads<T>(layout, batch, p.q.heads(), tokens, kDk, kSentinel<T>),
                      Heads<T>(layout, batch, p.k.heads(), tokens, kDk, kSentinel<T>),
                      Heads<T>(layout, batch, p.v.heads(), tokens, kDv, kSentinel<T>),
                      Heads<T>(layout, batch, gate_heads, tokens,
                               std::max<Eigen::Index>(1, gate_dim), kSentinel<T>)};
}

/// Per input head (b * H_in + h_in), N x D: what the view call must write, built from the
/// matrix backward of each output head. A shared input head's gradient is the sum over the
/// output heads that read it (h / (H / H_in) = h_in), added in increasing h.
template <class T>
struct Expected {
  std::vector<Matrix<T>> q, k, v, gates;
};

/// head(b, h, begin, rows): the matrix backward of output head h of batch entry b on rows
/// [begin, begin + rows) (its gates member empty without gates). `sequences` lists (b, begin,
/// rows) of every sequence.
template <class T, class HeadCall>
Expected<T> reference(Eigen::Index batch, Eigen::Index heads, Eigen::Index hq, Eigen::Index hk,
                      Eigen::Index hv, Eigen::Index tokens, Eigen::Index gate_dim,
                      const std::vector<std::array<Eigen::Index, 3>>& sequences,
                      const HeadCall& head) {
  Expected<T> e;
  auto zeros = [&](std::vector<Matrix<T>>& m, Eigen::Index count, Eigen::Index dim) {
    m.assign(static_cast<std::size_t>(batch * count), Matrix<T>::Zero(tokens, dim));
  };
  zeros(e.q, hq, kDk);
  zeros(e.k, hk, kDk);
  zeros(e.v, hv, kDv);
  zeros(e.gates, heads, std::max<Eigen::Index>(1, gate_dim));
  for (const auto& sequence : sequences) {
    const Eigen::Index b = sequence[0], begin = sequence[1], rows = sequence[2];
    if (rows == 0) continue;
    for (Eigen::Index h = 0; h < heads; ++h) {
      const GatedAttentionGradients<T> g = head(b, h, begin, rows);
      auto add = [&](std::vector<Matrix<T>>& m, Eigen::Index count, const Matrix<T>& grad) {
        const Eigen::Index group = heads / count;  // output heads per input head
        auto block = m[static_cast<std::size_t>(b * count + h / group)].middleRows(begin, rows);
        if (h % group == 0) {
          block = grad;  // the first reader
        } else {
          block += grad;  // each later reader adds, in increasing h
        }
      };
      add(e.q, hq, g.q);
      add(e.k, hk, g.k);
      add(e.v, hv, g.v);
      if (gate_dim > 0) add(e.gates, heads, g.gates);
    }
  }
  return e;
}

/// (b, 0, N) for each batch entry of a padded batch.
std::vector<std::array<Eigen::Index, 3>> padded_sequences(Eigen::Index batch, Eigen::Index tokens) {
  std::vector<std::array<Eigen::Index, 3>> s;
  for (Eigen::Index b = 0; b < batch; ++b) s.push_back({b, 0, tokens});
  return s;
}

/// (0, offsets[s], length) for each packed sequence.
std::vector<std::array<Eigen::Index, 3>> packed_sequences(
    const std::vector<std::int64_t>& offsets) {
  std::vector<std::array<Eigen::Index, 3>> s;
  for (std::size_t i = 0; i + 1 < offsets.size(); ++i) {
    s.push_back({0, offsets[i], offsets[i + 1] - offsets[i]});
  }
  return s;
}

/// Tallies how close the view gradients come to the per-head matrix backward. The view call
/// runs the same public matrix function on the same memory, so it is expected bit for bit (and
/// is, today: the tallies say how many heads differ and by how much). The causal calls read a
/// view with adjacent features through a row map (head_rows) where the reference reads
/// head(b, h), with dynamic strides; a kernel that reduced such rows in place with Eigen's
/// vectorised sums would add in another order (as the non-causal backward's dot over grad_out's
/// rows did through a row map, up to 3.5 eps of the largest gradient here). So the bound allows
/// 16 eps of each gradient's largest entry: a few reordered sums carried through one product.
struct Tally {
  int compared = 0;
  int differing = 0;
  double worst = 0.0;  ///< in units of eps * max|expected|
};

template <class T>
void require_matches(const Matrix<T>& got, const Matrix<T>& want, const std::string& what,
                     Tally& tally) {
  const double eps = std::numeric_limits<T>::epsilon();
  const double scale = std::max(want.template cast<double>().cwiseAbs().maxCoeff(), 1e-300);
  const double diff =
      (got.template cast<double>() - want.template cast<double>()).cwiseAbs().maxCoeff();
  ++tally.compared;
  if (!(got == want)) ++tally.differing;
  tally.worst = std::max(tally.worst, diff / (eps * scale));
  INFO(what << ": max |got - want| = " << diff << ", max |want| = " << scale);
  REQUIRE(got.allFinite());
  REQUIRE(diff <= 16 * eps * scale);
}

/// Compares the gradient views with the expected per-input-head gradients.
template <class T>
void require_expected(const GradViews<T>& got, const Expected<T>& e, Eigen::Index batch, bool gates,
                      Tally& tally) {
  auto each = [&](const Heads<T>& view, const std::vector<Matrix<T>>& want, const char* name) {
    for (Eigen::Index b = 0; b < batch; ++b) {
      for (Eigen::Index h = 0; h < view.heads(); ++h) {
        require_matches<T>(
            view.head(b, h), want[static_cast<std::size_t>(b * view.heads() + h)],
            std::string(name) + "[b=" + std::to_string(b) + ", h=" + std::to_string(h) + "]",
            tally);
      }
    }
  };
  each(got.q, e.q, "grad_q");
  each(got.k, e.k, "grad_k");
  each(got.v, e.v, "grad_v");
  if (gates) each(got.gates, e.gates, "grad_gates");
}

/// Runs body(map) with Identity{} (featurized inputs) or EluPlusOne{}.
template <class Body>
void with_map(bool featurized, const Body& body) {
  if (featurized) {
    body(linattn::Identity{});
  } else {
    body(linattn::EluPlusOne{});
  }
}

template <class T>
bool untouched(const Heads<T>& h) {
  return std::all_of(h.data().begin(), h.data().end(), [](T x) { return x == kSentinel<T>; });
}

/// True when every element outside the view's heads still holds the sentinel.
template <class T>
bool gaps_hold(const Heads<T>& h, Eigen::Index batch) {
  Heads<T> copy = h;
  for (Eigen::Index b = 0; b < batch; ++b) {
    for (Eigen::Index i = 0; i < h.heads(); ++i) {
      copy.view().head(b, i).setConstant(kSentinel<T>);
    }
  }
  return untouched(copy);
}

}  // namespace

TEMPLATE_TEST_CASE("view backward: each head gets the matrix backward, every layout and map",
                   "[multi_head_backward]", float, double) {
  using T = TestType;
  const Eigen::Index B = 2, H = 3, N = 37;
  const auto sequences = padded_sequences(B, N);
  Tally causal_tally, non_causal_tally;
  for (const Layout layout : {Layout::bhnd, Layout::bnhd, Layout::padded}) {
    for (const bool featurized : {true, false}) {
      for (const bool causal : {true, false}) {
        const Problem<T> p = make_problem<T>(layout, B, H, H, H, H, N, featurized,
                                             100 + 10 * static_cast<std::uint64_t>(layout));
        linattn::Options options;
        options.threads = 2;
        options.chunk = 8;
        options.decay = causal ? 0.9 : 1.0;
        GradViews<T> grads = sentinel_grads<T>(layout, p, B, N, H, 0);
        with_map(featurized, [&](const auto& map) {
          if (causal) {
            linattn::causal_linear_attention_backward_into(p.q.cview(), p.k.cview(), p.v.cview(),
                                                           p.grad_out.cview(), map, grads.q.view(),
                                                           grads.k.view(), grads.v.view(), options);
          } else {
            linattn::linear_attention_backward_into(p.q.cview(), p.k.cview(), p.v.cview(),
                                                    p.grad_out.cview(), map, grads.q.view(),
                                                    grads.k.view(), grads.v.view(), options);
          }
          const Expected<T> e = reference<T>(
              B, H, H, H, H, N, 0, sequences,
              [&](Eigen::Index b, Eigen::Index h, Eigen::Index, Eigen::Index) {
                GatedAttentionGradients<T> g{Matrix<T>(N, kDk), Matrix<T>(N, kDk),
                                             Matrix<T>(N, kDv), Matrix<T>()};
                if (causal) {
                  linattn::causal_linear_attention_backward_into(
                      p.q.cview().head(b, h), p.k.cview().head(b, h), p.v.cview().head(b, h),
                      p.grad_out.cview().head(b, h), map, g.q, g.k, g.v, options);
                } else {
                  linattn::linear_attention_backward_into(
                      p.q.cview().head(b, h), p.k.cview().head(b, h), p.v.cview().head(b, h),
                      p.grad_out.cview().head(b, h), map, g.q, g.k, g.v, options);
                }
                return g;
              });
          INFO(layout_name(layout) << ", " << (featurized ? "Identity" : "EluPlusOne") << ", "
                                   << (causal ? "causal" : "non-causal"));
          require_expected(grads, e, B, false, causal ? causal_tally : non_causal_tally);
          CHECK(gaps_hold(grads.q, B));
          CHECK(gaps_hold(grads.v, B));
        });
      }
    }
  }
  WARN("view backward vs per-head matrix backward, heads not bit-identical: causal "
       << causal_tally.differing << " of " << causal_tally.compared << " (worst "
       << causal_tally.worst << " eps * max|grad|), non-causal " << non_causal_tally.differing
       << " of " << non_causal_tally.compared << " (worst " << non_causal_tally.worst << ")");
}

TEMPLATE_TEST_CASE(
    "grouped heads: a shared input head's gradient is the sum over its readers, "
    "interleaved and tiled",
    "[multi_head_backward][grouped]", float, double) {
  using T = TestType;
  const Eigen::Index B = 2, N = 29;
  struct Grouping {
    Eigen::Index h, hq, hk, hv;
  };
  // 6 output heads: q pairs (3 heads), k triples (2 heads), one v head each: the groups of
  // 6 = lcm(2, 3, 1) heads; then multi-query (1 k/v head) and Qwen3-Next's fewer q/k heads.
  // Both groupings: FLA's and HF's interleaved (output head h reads h / (H / H_in)) and ggml's
  // tiled (h % H_in), each written out here.
  Tally tally;
  for (const linattn::HeadGrouping grouping :
       {linattn::HeadGrouping::interleaved, linattn::HeadGrouping::tiled}) {
    const bool tiled = grouping == linattn::HeadGrouping::tiled;
    for (const Grouping g : {Grouping{6, 3, 2, 6}, Grouping{4, 4, 1, 1}, Grouping{4, 2, 2, 4}}) {
      const auto reads = [&](Eigen::Index h, Eigen::Index count) {
        return tiled ? h % count : h / (g.h / count);
      };
      for (const Layout layout : {Layout::bhnd, Layout::bnhd, Layout::padded}) {
        if (tiled && layout != Layout::bnhd) continue;  // layouts are covered interleaved
        const Problem<T> p = make_problem<T>(layout, B, g.h, g.hq, g.hk, g.hv, N, false, 300);
        linattn::Options options;
        options.chunk = 8;
        options.head_grouping = grouping;
        Matrix<T> previous_q;
        for (const int threads : {1, 4}) {
          options.threads = threads;
          GradViews<T> grads = sentinel_grads<T>(layout, p, B, N, g.h, 0);
          linattn::causal_linear_attention_backward_into(
              p.q.cview(), p.k.cview(), p.v.cview(), p.grad_out.cview(), linattn::EluPlusOne{},
              grads.q.view(), grads.k.view(), grads.v.view(), options);
          // The reference sum, written out: head i of an input with H_in heads collects the
          // output heads that read it, in increasing h, each by its own matrix backward.
          Expected<T> e;
          auto sum_into = [&](std::vector<Matrix<T>>& want, Eigen::Index count, Eigen::Index dim,
                              int which) {
            for (Eigen::Index b = 0; b < B; ++b) {
              for (Eigen::Index i = 0; i < count; ++i) {
                Matrix<T> total = Matrix<T>::Zero(N, dim);
                bool first = true;
                for (Eigen::Index h = 0; h < g.h; ++h) {
                  if (reads(h, count) != i) continue;
                  const auto head = linattn::causal_linear_attention_backward(
                      p.q.cview().head(b, reads(h, g.hq)), p.k.cview().head(b, reads(h, g.hk)),
                      p.v.cview().head(b, reads(h, g.hv)), p.grad_out.cview().head(b, h),
                      linattn::EluPlusOne{}, options);
                  const Matrix<T>& part = which == 0 ? head.q : which == 1 ? head.k : head.v;
                  if (first) {
                    total = part;
                  } else {
                    total += part;
                  }
                  first = false;
                }
                want.push_back(total);
              }
            }
          };
          sum_into(e.q, g.hq, kDk, 0);
          sum_into(e.k, g.hk, kDk, 1);
          sum_into(e.v, g.hv, kDv, 2);
          INFO("H = " << g.h << ", Hq = " << g.hq << ", Hk = " << g.hk << ", Hv = " << g.hv << ", "
                      << layout_name(layout) << ", threads = " << threads
                      << (tiled ? ", tiled" : ", interleaved"));
          require_expected(grads, e, B, false, tally);
          // The sums are race-free and in a fixed order: any thread count gives the same bits.
          const Matrix<T> q0 = grads.q.head(B - 1, g.hq - 1);
          if (threads > 1) CHECK(q0 == previous_q);
          previous_q = q0;
        }
      }
    }
  }
  WARN("grouped heads: " << tally.differing << " of " << tally.compared
                         << " heads not bit-identical, worst " << tally.worst
                         << " eps * max|grad|");
}

TEMPLATE_TEST_CASE("varlen: packed sequences, an empty and a one-token one among them",
                   "[multi_head_backward][varlen]", float, double) {
  using T = TestType;
  const std::vector<std::int64_t> offsets{0, 9, 9, 10, 31, 31};  // lengths 9, 0, 1, 21, 0
  const Eigen::Index total = 31, H = 4, Hq = 2, Hk = 4, Hv = 1;
  const auto sequences = packed_sequences(offsets);
  Tally tally;
  for (const Layout layout : {Layout::bhnd, Layout::bnhd, Layout::padded}) {
    for (const bool causal : {true, false}) {
      const Problem<T> p = make_problem<T>(layout, 1, H, Hq, Hk, Hv, total, true, 400);
      linattn::Options options;
      options.threads = 3;
      options.chunk = 4;
      GradViews<T> grads = sentinel_grads<T>(layout, p, 1, total, H, 0);
      if (causal) {
        linattn::causal_linear_attention_varlen_backward_into(
            p.q.cview(), p.k.cview(), p.v.cview(), p.grad_out.cview(), linattn::Identity{}, offsets,
            grads.q.view(), grads.k.view(), grads.v.view(), options);
      } else {
        linattn::linear_attention_varlen_backward_into(
            p.q.cview(), p.k.cview(), p.v.cview(), p.grad_out.cview(), linattn::Identity{}, offsets,
            grads.q.view(), grads.k.view(), grads.v.view(), options);
      }
      const Expected<T> e =
          reference<T>(1, H, Hq, Hk, Hv, total, 0, sequences,
                       [&](Eigen::Index b, Eigen::Index h, Eigen::Index begin, Eigen::Index rows) {
                         GatedAttentionGradients<T> g{Matrix<T>(rows, kDk), Matrix<T>(rows, kDk),
                                                      Matrix<T>(rows, kDv), Matrix<T>()};
                         const auto q = p.q.cview().head(b, h / (H / Hq)).middleRows(begin, rows);
                         const auto k = p.k.cview().head(b, h / (H / Hk)).middleRows(begin, rows);
                         const auto v = p.v.cview().head(b, h / (H / Hv)).middleRows(begin, rows);
                         const auto go = p.grad_out.cview().head(b, h).middleRows(begin, rows);
                         if (causal) {
                           linattn::causal_linear_attention_backward_into(
                               q, k, v, go, linattn::Identity{}, g.q, g.k, g.v, options);
                         } else {
                           linattn::linear_attention_backward_into(q, k, v, go, linattn::Identity{},
                                                                   g.q, g.k, g.v, options);
                         }
                         return g;
                       });
      INFO(layout_name(layout) << ", " << (causal ? "causal" : "non-causal"));
      require_expected(grads, e, 1, false, tally);
    }
  }
  WARN("varlen backward: " << tally.differing << " of " << tally.compared
                           << " heads not bit-identical, worst " << tally.worst
                           << " eps * max|grad|");
}

TEMPLATE_TEST_CASE("gated views: scalar and per-feature gates, plain and log, padded and packed",
                   "[multi_head_backward][gated]", float, double) {
  using T = TestType;
  const Eigen::Index B = 2, H = 4, Hq = 2, Hk = 4, Hv = 1, N = 23;
  const std::vector<std::int64_t> offsets{0, 7, 7, 8, 23};
  Tally tally;
  for (const Layout layout : {Layout::bhnd, Layout::bnhd, Layout::padded}) {
    for (const bool packed : {false, true}) {
      const Eigen::Index batch = packed ? 1 : B;
      const auto sequences = packed ? packed_sequences(offsets) : padded_sequences(B, N);
      for (const bool featurized : {true, false}) {
        const Problem<T> p = make_problem<T>(layout, batch, H, Hq, Hk, Hv, N, featurized, 500);
        for (const Eigen::Index gate_dim : {Eigen::Index(1), kDk}) {
          const GatePair<T> gates = random_gates<T>(layout, batch, H, N, gate_dim, 600);
          for (const bool log_space : {true, false}) {
            linattn::Options options;
            options.threads = 2;
            options.chunk = 4;
            options.normalize = gate_dim == 1;
            options.scale = log_space ? 0.5 : 1.0;
            GradViews<T> grads = sentinel_grads<T>(layout, p, batch, N, H, gate_dim);
            with_map(featurized, [&](const auto& map) {
              auto call = [&](const auto& gate_arg) {
                if (packed) {
                  linattn::causal_gated_linear_attention_varlen_backward_into(
                      p.q.cview(), p.k.cview(), p.v.cview(), gate_arg, p.grad_out.cview(), map,
                      offsets, grads.q.view(), grads.k.view(), grads.v.view(), grads.gates.view(),
                      options);
                } else {
                  linattn::causal_gated_linear_attention_backward_into(
                      p.q.cview(), p.k.cview(), p.v.cview(), gate_arg, p.grad_out.cview(), map,
                      grads.q.view(), grads.k.view(), grads.v.view(), grads.gates.view(), options);
                }
              };
              if (log_space) {
                call(linattn::log_gates(gates.log.cview()));
              } else {
                call(gates.plain.cview());
              }
              const Expected<T> e = reference<T>(
                  batch, H, Hq, Hk, Hv, N, gate_dim, sequences,
                  [&](Eigen::Index b, Eigen::Index h, Eigen::Index begin, Eigen::Index rows) {
                    const auto q = p.q.cview().head(b, h / (H / Hq)).middleRows(begin, rows);
                    const auto k = p.k.cview().head(b, h / (H / Hk)).middleRows(begin, rows);
                    const auto v = p.v.cview().head(b, h / (H / Hv)).middleRows(begin, rows);
                    const auto go = p.grad_out.cview().head(b, h).middleRows(begin, rows);
                    GatedAttentionGradients<T> g;
                    if (log_space) {
                      const auto gh = gates.log.cview().head(b, h).middleRows(begin, rows);
                      linattn::causal_gated_linear_attention_backward_into(
                          q, k, v, linattn::log_gates(gh), go, map, g, options);
                    } else {
                      const auto ah = gates.plain.cview().head(b, h).middleRows(begin, rows);
                      linattn::causal_gated_linear_attention_backward_into(q, k, v, ah, go, map, g,
                                                                           options);
                    }
                    return g;
                  });
              INFO(layout_name(layout)
                   << (packed ? ", packed" : ", padded") << ", "
                   << (featurized ? "Identity" : "EluPlusOne") << ", gate_dim = " << gate_dim
                   << ", log_space = " << log_space);
              require_expected(grads, e, batch, true, tally);
            });
          }
        }
      }
    }
  }
  WARN("gated view backward: " << tally.differing << " of " << tally.compared
                               << " heads not bit-identical, worst " << tally.worst
                               << " eps * max|grad|");
}

TEMPLATE_TEST_CASE("HeadDecays: each head gets the backward with its own decay",
                   "[multi_head_backward][gated]", float, double) {
  using T = TestType;
  const Eigen::Index B = 2, H = 3, N = 19;
  const Problem<T> p = make_problem<T>(Layout::bnhd, B, H, H, H, H, N, false, 700);
  const linattn::HeadDecays decays{{0.5, 0.9, 1.0}};
  linattn::Options options;
  options.chunk = 4;
  GradViews<T> grads = sentinel_grads<T>(Layout::bnhd, p, B, N, H, 0);
  linattn::causal_gated_linear_attention_backward_into(
      p.q.cview(), p.k.cview(), p.v.cview(), decays, p.grad_out.cview(), linattn::EluPlusOne{},
      grads.q.view(), grads.k.view(), grads.v.view(), options);
  const Expected<T> e =
      reference<T>(B, H, H, H, H, N, 0, padded_sequences(B, N),
                   [&](Eigen::Index b, Eigen::Index h, Eigen::Index, Eigen::Index) {
                     linattn::Options head = options;
                     head.decay = decays.values[static_cast<std::size_t>(h)];
                     const auto g = linattn::causal_linear_attention_backward(
                         p.q.cview().head(b, h), p.k.cview().head(b, h), p.v.cview().head(b, h),
                         p.grad_out.cview().head(b, h), linattn::EluPlusOne{}, head);
                     return GatedAttentionGradients<T>{g.q, g.k, g.v, Matrix<T>()};
                   });
  Tally tally;
  require_expected(grads, e, B, false, tally);
  // The varlen form: one packed row of two sequences.
  const std::vector<std::int64_t> offsets{0, 4, 19};
  const Problem<T> packed = make_problem<T>(Layout::bhnd, 1, H, H, H, H, N, false, 710);
  GradViews<T> packed_grads = sentinel_grads<T>(Layout::bhnd, packed, 1, N, H, 0);
  linattn::causal_gated_linear_attention_varlen_backward_into(
      packed.q.cview(), packed.k.cview(), packed.v.cview(), decays, packed.grad_out.cview(),
      linattn::EluPlusOne{}, offsets, packed_grads.q.view(), packed_grads.k.view(),
      packed_grads.v.view(), options);
  const Expected<T> packed_e =
      reference<T>(1, H, H, H, H, N, 0, packed_sequences(offsets),
                   [&](Eigen::Index b, Eigen::Index h, Eigen::Index begin, Eigen::Index rows) {
                     linattn::Options head = options;
                     head.decay = decays.values[static_cast<std::size_t>(h)];
                     const auto g = linattn::causal_linear_attention_backward(
                         packed.q.cview().head(b, h).middleRows(begin, rows),
                         packed.k.cview().head(b, h).middleRows(begin, rows),
                         packed.v.cview().head(b, h).middleRows(begin, rows),
                         packed.grad_out.cview().head(b, h).middleRows(begin, rows),
                         linattn::EluPlusOne{}, head);
                     return GatedAttentionGradients<T>{g.q, g.k, g.v, Matrix<T>()};
                   });
  require_expected(packed_grads, packed_e, 1, false, tally);
}

TEMPLATE_TEST_CASE("errors: bad shapes and values throw linattn::Error and write no gradient",
                   "[multi_head_backward][errors]", float) {
  using T = TestType;
  const Eigen::Index B = 2, H = 4, N = 12;
  const Layout layout = Layout::bnhd;
  const Problem<T> p = make_problem<T>(layout, B, H, 2, H, H, N, true, 800);
  const GatePair<T> gates = random_gates<T>(layout, B, H, N, 1, 810);
  GradViews<T> grads = sentinel_grads<T>(layout, p, B, N, H, 1);
  const auto none_written = [&] {
    return untouched(grads.q) && untouched(grads.k) && untouched(grads.v) && untouched(grads.gates);
  };
  const linattn::Identity map;
  const linattn::Options options;
  auto causal = [&](const auto& q, const auto& k, const auto& v, const auto& go, const auto& gq,
                    const auto& gk, const auto& gv, const linattn::Options& o) {
    linattn::causal_linear_attention_backward_into(q, k, v, go, map, gq, gk, gv, o);
  };
  const auto q = p.q.cview();
  const auto k = p.k.cview();
  const auto v = p.v.cview();
  const auto go = p.grad_out.cview();
  const auto gq = grads.q.view();
  const auto gk = grads.k.view();
  const auto gv = grads.v.view();

  // A gradient view of another shape than its input.
  Heads<T> wide_q(layout, B, 2, N, kDk + 1, kSentinel<T>);
  REQUIRE_THROWS_WITH(causal(q, k, v, go, wide_q.view(), gk, gv, options),
                      Catch::Contains("causal_linear_attention_backward") &&
                          Catch::Contains("grad_q is [2, 2, 12, 7]") &&
                          Catch::Contains("phi_q is [2, 2, 12, 6]"));
  Heads<T> grouped_k(layout, B, 2, N, kDk, kSentinel<T>);
  REQUIRE_THROWS_WITH(
      causal(q, k, v, go, gq, grouped_k.view(), gv, options),
      Catch::Contains("grad_k is [2, 2, 12, 6]") && Catch::Contains("phi_k is [2, 4, 12, 6]"));
  Heads<T> short_v(layout, B, H, N - 1, kDv, kSentinel<T>);
  REQUIRE_THROWS_AS(causal(q, k, v, go, gq, gk, short_v.view(), options), linattn::Error);
  // grad_out of another width, or with heads that q's do not divide.
  const Heads<T> narrow_out = random_heads<T>(layout, B, H, N, kDv - 1, 820);
  REQUIRE_THROWS_WITH(causal(q, k, v, narrow_out.cview(), gq, gk, gv, options),
                      Catch::Contains("grad_out is [2, 4, 12, 4]"));
  const Heads<T> odd_out = random_heads<T>(layout, B, 3, N, kDv, 821);
  REQUIRE_THROWS_WITH(causal(q, k, v, odd_out.cview(), gq, gk, gv, options),
                      Catch::Contains("but grad_out is [2, 3, 12, 5]"));
  // A NaN in grad_out (or in an input) while check_finite is on, named by its head.
  Heads<T> nan_out = random_heads<T>(layout, B, H, N, kDv, 822);
  nan_out.view().head(1, 3)(5, 2) = std::numeric_limits<T>::quiet_NaN();
  REQUIRE_THROWS_WITH(causal(q, k, v, nan_out.cview(), gq, gk, gv, options),
                      Catch::Contains("grad_out[b=1, h=3]"));
  Heads<T> nan_v = random_heads<T>(layout, B, H, N, kDv, 823);
  nan_v.view().head(0, 2)(N - 1, 0) = std::numeric_limits<T>::infinity();
  REQUIRE_THROWS_WITH(causal(q, k, nan_v.cview(), go, gq, gk, gv, options),
                      Catch::Contains("v[b=0, h=2]"));
  // Bad options.
  linattn::Options bad = options;
  bad.eps = -1;
  REQUIRE_THROWS_WITH(causal(q, k, v, go, gq, gk, gv, bad), Catch::Contains("Options::eps"));
  // Cross-attention has no backward.
  const Heads<T> long_k = random_heads<T>(layout, B, H, N + 3, kDk, 824, true);
  const Heads<T> long_v = random_heads<T>(layout, B, H, N + 3, kDv, 825);
  Heads<T> long_gk(layout, B, H, N + 3, kDk, kSentinel<T>);
  Heads<T> long_gv(layout, B, H, N + 3, kDv, kSentinel<T>);
  REQUIRE_THROWS_WITH(
      linattn::linear_attention_backward_into(q, long_k.cview(), long_v.cview(), go, map, gq,
                                              long_gk.view(), long_gv.view(), options),
      Catch::Contains("linear_attention_backward") && Catch::Contains("cross-attention"));
  CHECK(untouched(long_gk));
  CHECK(untouched(long_gv));
  // Packed batches: B must be 1 and the offsets must cover the tokens.
  REQUIRE_THROWS_WITH(linattn::causal_linear_attention_varlen_backward_into(
                          q, k, v, go, map, std::vector<std::int64_t>{0, N}, gq, gk, gv, options),
                      Catch::Contains("B must be 1"));
  const Problem<T> one = make_problem<T>(layout, 1, H, H, H, H, N, true, 830);
  GradViews<T> one_grads = sentinel_grads<T>(layout, one, 1, N, H, 0);
  for (const std::vector<std::int64_t>& offsets :
       {std::vector<std::int64_t>{0, 5, 4, N}, std::vector<std::int64_t>{0, N - 1},
        std::vector<std::int64_t>{1, N}}) {
    REQUIRE_THROWS_WITH(
        linattn::causal_linear_attention_varlen_backward_into(
            one.q.cview(), one.k.cview(), one.v.cview(), one.grad_out.cview(), map, offsets,
            one_grads.q.view(), one_grads.k.view(), one_grads.v.view(), options),
        Catch::Contains("causal_linear_attention_varlen_backward") && Catch::Contains("offsets"));
  }
  CHECK(untouched(one_grads.q));
  CHECK(untouched(one_grads.k));
  CHECK(untouched(one_grads.v));
  // Gates: out of range (checked always), grad_gates of another shape, decay not 1.
  Heads<T> high = random_gates<T>(layout, B, H, N, 1, 840).plain;
  high.view().head(1, 1)(3, 0) = T(1.5);
  auto gated = [&](const auto& gate_arg, const HeadsView<T>& grad_gates,
                   const linattn::Options& o) {
    linattn::causal_gated_linear_attention_backward_into(q, k, v, gate_arg, go, map, gq, gk, gv,
                                                         grad_gates, o);
  };
  REQUIRE_THROWS_WITH(gated(high.cview(), grads.gates.view(), options),
                      Catch::Contains("causal_gated_linear_attention_backward") &&
                          Catch::Contains("gates[b=1, h=1]"));
  Heads<T> positive_log = random_gates<T>(layout, B, H, N, 1, 841).log;
  positive_log.view().head(0, 3)(0, 0) = T(0.25);
  REQUIRE_THROWS_WITH(gated(linattn::log_gates(positive_log.cview()), grads.gates.view(), options),
                      Catch::Contains("gates[b=0, h=3]"));
  Heads<T> wide_gates(layout, B, H, N, kDk, kSentinel<T>);
  REQUIRE_THROWS_WITH(
      gated(gates.plain.cview(), wide_gates.view(), options),
      Catch::Contains("grad_gates is [2, 4, 12, 6]") && Catch::Contains("gates is [2, 4, 12, 1]"));
  CHECK(untouched(wide_gates));
  const Heads<T> bad_width = random_gates<T>(layout, B, H, N, 3, 842).plain;
  REQUIRE_THROWS_WITH(gated(bad_width.cview(), grads.gates.view(), options),
                      Catch::Contains("gates is [2, 4, 12, 3]"));
  linattn::Options decayed = options;
  decayed.decay = 0.5;
  REQUIRE_THROWS_AS(gated(gates.plain.cview(), grads.gates.view(), decayed), linattn::Error);
  REQUIRE_THROWS_WITH(linattn::causal_gated_linear_attention_backward_into(
                          q, k, v, linattn::HeadDecays{{0.5, 0.5}}, go, map, gq, gk, gv, options),
                      Catch::Contains("HeadDecays holds 2 decays"));
  CHECK(none_written());
  // The same calls with good arguments do write.
  gated(gates.plain.cview(), grads.gates.view(), options);
  CHECK_FALSE(untouched(grads.gates));
  CHECK_FALSE(untouched(grads.q));
}

TEST_CASE("view backward matches central finite differences of the view forward",
          "[multi_head_backward][finite_differences]") {
  // Tiny double problem: 2 output heads reading 1 q head (grouped), EluPlusOne, loss =
  // sum(grad_out o out) over every head; the gradients of q's shared head, k's and v's head 1
  // and (gated, log per-feature gates) the gates of head 1, by central differences.
  using T = double;
  const Eigen::Index B = 1, H = 2, Hq = 1, N = 6;
  const Layout layout = Layout::bnhd;
  Problem<T> p = make_problem<T>(layout, B, H, Hq, H, H, N, false, 900);
  GatePair<T> gates = random_gates<T>(layout, B, H, N, kDk, 910);
  for (const bool gated : {false, true}) {
    linattn::Options options;
    options.chunk = 2;
    const linattn::EluPlusOne map;
    auto loss = [&] {
      Heads<T> out(layout, B, H, N, kDv, T(0));
      if (gated) {
        options.normalize = false;
        linattn::causal_gated_linear_attention_into(p.q.cview(), p.k.cview(), p.v.cview(),
                                                    linattn::log_gates(gates.log.cview()), map,
                                                    out.view(), options);
      } else {
        linattn::causal_linear_attention_into(p.q.cview(), p.k.cview(), p.v.cview(), map,
                                              out.view(), options);
      }
      double total = 0.0;
      for (Eigen::Index h = 0; h < H; ++h) {
        total += p.grad_out.head(0, h).cwiseProduct(out.head(0, h)).sum();
      }
      return total;
    };
    auto differences = [&](Heads<T>& x, Eigen::Index h) {
      Matrix<double> grad(N, x.dim());
      for (Eigen::Index r = 0; r < N; ++r) {
        for (Eigen::Index c = 0; c < x.dim(); ++c) {
          T& entry = x.view().head(0, h)(r, c);
          const T saved = entry;
          const T step = 1e-6 * std::max(1.0, std::abs(saved));
          entry = saved + step;
          const double up = loss();
          entry = saved - step;
          const double down = loss();
          entry = saved;
          grad(r, c) = (up - down) / (2 * step);
        }
      }
      return grad;
    };
    GradViews<T> grads = sentinel_grads<T>(layout, p, B, N, H, gated ? kDk : 0);
    if (gated) {
      options.normalize = false;
      linattn::causal_gated_linear_attention_backward_into(
          p.q.cview(), p.k.cview(), p.v.cview(), linattn::log_gates(gates.log.cview()),
          p.grad_out.cview(), map, grads.q.view(), grads.k.view(), grads.v.view(),
          grads.gates.view(), options);
    } else {
      linattn::causal_linear_attention_backward_into(p.q.cview(), p.k.cview(), p.v.cview(),
                                                     p.grad_out.cview(), map, grads.q.view(),
                                                     grads.k.view(), grads.v.view(), options);
    }
    INFO((gated ? "gated (log, per feature)" : "plain") << ", grouped q");
    const double tolerance = 1e-6;
    CHECK(linattn_test::relative_error(grads.q.head(0, 0), differences(p.q, 0)) <= tolerance);
    CHECK(linattn_test::relative_error(grads.k.head(0, 1), differences(p.k, 1)) <= tolerance);
    CHECK(linattn_test::relative_error(grads.v.head(0, 1), differences(p.v, 1)) <= tolerance);
    if (gated) {
      CHECK(linattn_test::relative_error(grads.gates.head(0, 1), differences(gates.log, 1)) <=
            tolerance);
    }
  }
}

}  // namespace linattn_test_multi_head_backward
