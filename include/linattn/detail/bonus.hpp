// SPDX-License-Identifier: MIT
// RWKV-6's bonus form (gates.hpp, BonusGates) on the gated kernel: each output reads the state
// before its token (the gated kernel with the queries one row ahead), plus the bonus term
// s (phi(q_t) o u) . phi(k_t) v_t, added chunk by chunk.
#pragma once

#include <algorithm>
#include <linattn/config.hpp>
#include <linattn/detail/chunked.hpp>
#include <linattn/detail/parallel.hpp>
#include <linattn/detail/validate.hpp>
#include <linattn/feature_map.hpp>
#include <linattn/gates.hpp>
#include <string>

namespace linattn::detail {

/// Compiles only for maps whose features come plain: the bonus form reads the state before
/// the token, which a per-token log scale would have to carry through.
template <class Map>
constexpr void require_plain_features() {
  static_assert(!is_log_scaled<Map>::value,
                "RWKV-6's bonus u takes plain features: Identity, EluPlusOne, Relu or a user map "
                "without scaled_features");
}

/// out += s (phi(q_t) o u) . phi(k_t) v_t for every row: the bonus term of RWKV-6, chunk by
/// chunk in the accumulation type T (plain features only). `out` is any N x Dv row expression
/// (a matrix's Ref, a view head's strided rows).
template <class T, class DQ, class DK, class DV, class DU, class Map, class Out>
void add_bonus(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
               const Eigen::MatrixBase<DV>& v, const Eigen::MatrixBase<DU>& u, const Map& map,
               const Options& options, Out&& out, const char* where) {
  using Scalar = typename DQ::Scalar;
  const Eigen::Index n = q.rows(), c = u.size(), block = 64;
  const Eigen::Array<T, 1, Eigen::Dynamic> weights = u.reshaped().transpose().template cast<T>();
  const T scale = static_cast<T>(options.scale);
  Matrix<T> phi_q(block, c), phi_k(block, c), x;
  Vector<T> coefficient(block);
  for (Eigen::Index begin = 0; begin < n; begin += block) {
    const Eigen::Index len = std::min(block, n - begin);
    if constexpr (is_identity_map<Map>) {
      phi_q.topRows(len) = q.middleRows(begin, len).template cast<T>();
      phi_k.topRows(len) = k.middleRows(begin, len).template cast<T>();
    } else {
      x = q.middleRows(begin, len).template cast<T>();
      map_queries_into(map, x, phi_q.topRows(len));
      x = k.middleRows(begin, len).template cast<T>();
      map_keys_into(map, x, phi_k.topRows(len));
      if (options.check_finite &&
          !(phi_q.topRows(len).allFinite() && phi_k.topRows(len).allFinite())) {
        throw Error(std::string(where) + ": the feature map gave a non-finite feature");
      }
    }
    coefficient.head(len) = scale *
                            (phi_q.topRows(len).array() * phi_k.topRows(len).array()).matrix() *
                            weights.matrix().transpose();
    for (Eigen::Index r = 0; r < len; ++r) {
      const Eigen::Index row = begin + r;
      out.row(row) =
          (out.row(row).template cast<T>() + coefficient(r) * v.row(row).template cast<T>())
              .template cast<Scalar>();
    }
  }
}

/// The bonus form from an empty state into `out` (N x Dv rows, any strides), inputs validated:
/// row 0 reads the empty state, row t > 0 is the gated kernel's row t - 1 given q_t (queries
/// one row ahead of the keys, values and gates), then every row adds its bonus term.
/// @param gates  N x 1 or N x C gate argument (a_t, or log_gates(g)); its last row is not read
/// @param u      C bonus weights
template <class T, class DQ, class DK, class DV, class Gates, class DU, class Map, class Out>
void bonus_rows(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                const Eigen::MatrixBase<DV>& v, const Gates& gates, const Eigen::MatrixBase<DU>& u,
                const Map& map, Out&& out, const Options& options, int threads, const char* where) {
  const Eigen::Index n = q.rows();
  if (n == 0) return;
  out.row(0).setZero();
  if (n > 1) {
    with_gate_block(gates, 0, n - 1, [&](const auto& ahead) {
      const GateMatrix<std::decay_t<decltype(ahead)>> rows(ahead);
      with_source<T>(q.bottomRows(n - 1), k.topRows(n - 1), v.topRows(n - 1), map, &rows,
                     options.check_finite, where, [&](ChunkSource<T>& source) {
                       CarriedState<T> state(source.feature_dim(), source.value_dim());
                       const SerialEigenScope serial_eigen;
                       run_causal(source, state, out.bottomRows(n - 1), options, threads);
                     });
    });
  }
  add_bonus<T>(q, k, v, u, map, options, out, where);
}

}  // namespace linattn::detail
