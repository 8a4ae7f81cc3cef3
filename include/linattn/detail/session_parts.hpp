// SPDX-License-Identifier: MIT
// What a SessionPool<> knows of each kind of layer state: how one session's part is kept, how
// the parts of many sessions are lent to one batch for a call and taken back, and how a part
// is written into a session's blob and read back, checked, in the storage asked for.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <linattn/config.hpp>
#include <linattn/detail/fingerprint.hpp>
#include <linattn/detail/serialize.hpp>
#include <linattn/detail/state_record.hpp>
#include <linattn/short_conv.hpp>
#include <linattn/softmax.hpp>
#include <linattn/state_batch.hpp>
#include <linattn/state_io.hpp>
#include <ostream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace linattn {

/// How a session's numbers are written into its blob (SessionPool<>::save_bytes). The states
/// are always kept and computed in their own type; a smaller storage rounds them once per
/// save, and a loaded session continues from the rounded numbers.
enum class SessionStorage : std::uint8_t {
  exact = 0,  ///< every number in its own type: a reload continues bit for bit
  bf16 = 1,   ///< bfloat16, rounded to nearest even: 2 bytes a number, about 3 digits
  int8 = 2,   ///< int8 with one float scale per row (each head's row of S, z, each token
              ///< of a window or a cache): 1 byte a number, max |row| / 127 per step
};

/// "exact", "bf16", "int8".
inline const char* session_storage_name(SessionStorage storage) {
  switch (storage) {
    case SessionStorage::exact:
      return "exact";
    case SessionStorage::bf16:
      return "bf16";
    case SessionStorage::int8:
      return "int8";
  }
  return "?";
}

}  // namespace linattn

namespace linattn::detail {

/// The containers inside the batches a pool lends: their parts move, their memory stays.
struct PoolAccess {
  template <class State>
  static std::vector<State>& parts(StateBatch<State>& batch) {
    return batch.states_;
  }
  template <class T>
  static std::vector<Matrix<T>>& parts(ConvWindows<T>& windows) {
    return windows.windows_;
  }
  template <class T>
  static std::vector<SoftmaxKVCache<T>>& parts(KVCacheBatch<T>& caches) {
    return caches.caches_;
  }
};

/// The feature-map fingerprint a layer's linear states save with (none for other layers).
template <class Layer, class = void>
struct LayerMapPrint {
  static MapFingerprint of(const Layer&) { return {}; }
};
template <class Layer>
struct LayerMapPrint<Layer, std::void_t<decltype(std::declval<const Layer&>().feature_map())>> {
  static MapFingerprint of(const Layer& layer) {
    return fingerprint_of(layer.feature_map(), layer.feature_dim());
  }
};

// --- Numbers in a blob: exact, bf16 or int8 rows ---

/// bfloat16 bits of x, rounded to nearest even; x finite and within bfloat16's range.
inline std::uint16_t to_bf16(float x) {
  std::uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  return static_cast<std::uint16_t>(bits >> 16);
}
inline float from_bf16(std::uint16_t half) {
  const std::uint32_t bits = static_cast<std::uint32_t>(half) << 16;
  float x;
  std::memcpy(&x, &bits, sizeof(x));
  return x;
}

/// The scale a row whose largest |q| is 127 gets back when it is loaded (its largest number
/// is the float 127 * scale) and saved again: an int8 scale is canonical when this is itself.
inline float int8_rescale(float scale) {
  const float largest = 127.0f * scale;  // as get_rows decodes q = 127
  return static_cast<float>(static_cast<double>(largest) / 127.0);
}

/// The canonical int8 scale of a row whose largest |number| is `top`: top / 127 in float,
/// nudged up by an ulp or two where loading and saving again would move it (1 row in about
/// 128: 127 * scale a tie in float), 0 below 127 x the smallest normal float.
inline float int8_scale(double top) {
  float scale = static_cast<float>(top / 127.0);
  if (!(scale >= std::numeric_limits<float>::min())) return 0.0f;
  for (int nudge = 0; nudge < 8 && int8_rescale(scale) != scale; ++nudge) {
    scale = std::nextafter(scale, std::numeric_limits<float>::infinity());
  }
  return scale;
}

/// Writes rows x cols numbers (row-major at `data`) in `storage`. Throws, having written part
/// of them, when a number does not fit the storage (the caller's bytes are then dropped).
template <class S>
void put_rows(LittleEndianWriter& out, const S* data, Eigen::Index rows, Eigen::Index cols,
              SessionStorage storage, const char* where) {
  const auto too_large = [&](double x) {
    return Error(std::string(where) + ": a number (" + format_double(x) + ") is beyond " +
                 session_storage_name(storage) + "'s range; save this session exact");
  };
  for (Eigen::Index i = 0; i < rows * cols; ++i) {
    if (!std::isfinite(static_cast<double>(data[i]))) {
      throw Error(std::string(where) + ": the session holds a non-finite number (" +
                  format_double(static_cast<double>(data[i])) +
                  "), which no load would accept; it cannot be saved");
    }
  }
  std::vector<unsigned char> bytes;  // one row's encoding: one checksum pass, one write
  for (Eigen::Index r = 0; r < rows; ++r) {
    const S* row = data + r * cols;
    switch (storage) {
      case SessionStorage::exact:
        bytes.resize(static_cast<std::size_t>(cols) * sizeof(S));
        for (Eigen::Index c = 0; c < cols; ++c)
          encode_little_endian(row[c], bytes.data() + c * sizeof(S));
        out.put_bytes(bytes.data(), bytes.size());
        break;
      case SessionStorage::bf16:
        bytes.resize(static_cast<std::size_t>(cols) * 2);
        for (Eigen::Index c = 0; c < cols; ++c) {
          const std::uint16_t half = to_bf16(static_cast<float>(row[c]));
          if (!std::isfinite(from_bf16(half))) throw too_large(static_cast<double>(row[c]));
          encode_little_endian(half, bytes.data() + c * 2);
        }
        out.put_bytes(bytes.data(), bytes.size());
        break;
      case SessionStorage::int8: {
        double top = 0.0;
        for (Eigen::Index c = 0; c < cols; ++c) top = std::max(top, std::abs(double(row[c])));
        if (!std::isfinite(static_cast<float>(top / 127.0))) throw too_large(top);
        const float scale = int8_scale(top);
        if (!std::isfinite(127.0f * scale)) throw too_large(top);
        out.put<float>(scale);
        bytes.resize(static_cast<std::size_t>(cols));
        for (Eigen::Index c = 0; c < cols; ++c) {
          const double q = scale > 0.0f ? std::nearbyint(double(row[c]) / double(scale)) : 0.0;
          bytes[static_cast<std::size_t>(c)] =
              static_cast<unsigned char>(static_cast<std::int8_t>(std::clamp(q, -127.0, 127.0)));
        }
        out.put_bytes(bytes.data(), bytes.size());
        break;
      }
    }
  }
}

/// Reads what put_rows wrote into rows x cols numbers at `data`; throws on a non-finite one
/// (`what` names them) or a bad int8 scale.
template <class S>
void get_rows(LittleEndianReader& in, S* data, Eigen::Index rows, Eigen::Index cols,
              SessionStorage storage, const char* what, const char* where) {
  std::vector<unsigned char> bytes;  // one row's encoding, read at once
  for (Eigen::Index r = 0; r < rows; ++r) {
    S* row = data + r * cols;
    switch (storage) {
      case SessionStorage::exact:
        bytes.resize(static_cast<std::size_t>(cols) * sizeof(S));
        in.get_bytes(bytes.data(), bytes.size(), what);
        for (Eigen::Index c = 0; c < cols; ++c)
          row[c] = decode_little_endian<S>(bytes.data() + c * sizeof(S));
        break;
      case SessionStorage::bf16:
        bytes.resize(static_cast<std::size_t>(cols) * 2);
        in.get_bytes(bytes.data(), bytes.size(), what);
        for (Eigen::Index c = 0; c < cols; ++c) {
          row[c] =
              static_cast<S>(from_bf16(decode_little_endian<std::uint16_t>(bytes.data() + c * 2)));
        }
        break;
      case SessionStorage::int8: {
        const float scale = in.get<float>(what);
        if (!(scale >= 0.0f) || !std::isfinite(scale) || std::signbit(scale)) {
          throw Error(std::string(where) + ": " + what + " has an invalid int8 scale " +
                      format_double(scale));
        }
        bytes.resize(static_cast<std::size_t>(cols));
        in.get_bytes(bytes.data(), bytes.size(), what);
        int top = 0;
        for (Eigen::Index c = 0; c < cols; ++c) {
          const auto q = static_cast<std::int8_t>(bytes[static_cast<std::size_t>(c)]);
          if (q == std::numeric_limits<std::int8_t>::min()) {
            throw Error(std::string(where) + ": " + what + " holds int8 -128 (not written)");
          }
          top = std::max(top, std::abs(int(q)));
          row[c] = static_cast<S>(static_cast<float>(q) * scale);
        }
        // Canonical rows only (as put_rows writes them): a row's largest |q| is 127 under a
        // normal scale that survives a load and a save, or the row is zero with scale 0, so
        // that equal sessions are equal bytes.
        const bool canonical =
            scale == 0.0f ? top == 0
                          : top == 127 && scale >= std::numeric_limits<float>::min() &&
                                std::isfinite(127.0f * scale) && int8_rescale(scale) == scale;
        if (!canonical) {
          throw Error(std::string(where) + ": " + what + " holds an int8 row not as written " +
                      "(scale " + format_double(scale) + ", largest |q| " + std::to_string(top) +
                      ")");
        }
        break;
      }
    }
    for (Eigen::Index c = 0; c < cols; ++c) {
      if (!std::isfinite(static_cast<double>(row[c]))) {
        throw Error(std::string(where) + ": " + what + " holds a non-finite value");
      }
    }
  }
}

/// Throws unless a count read from a blob is `expected` (what this pool's layer holds).
inline void require_count(std::uint64_t got, std::uint64_t expected, const char* what,
                          const char* where) {
  if (got != expected) {
    throw Error(std::string(where) + ": the blob's " + what + " is " + std::to_string(got) +
                " but this pool's layer has " + std::to_string(expected) +
                ": a session of another model shape");
  }
}

// --- Each kind of part ---

/// The kinds of layer state a blob names (one byte per layer).
enum class PartKind : std::uint8_t {
  linear_states = 0,  ///< RecurrentStateBatch: H states
  delta_states = 1,   ///< DeltaRuleStateBatch: H states
  conv_windows = 2,   ///< ConvWindows: one window
  kv_caches = 3,      ///< KVCacheBatch: H caches
  gated_delta_net = 4,
  mamba2 = 5,
  dplr_states = 6,     ///< DplrDeltaRuleStateBatch: H states
  rwkv7_time_mix = 7,  ///< Rwkv7TimeMixStates: the last x, then H states
};

/// What a pool knows of each kind K of layer state, a session holding one K of batch 1:
///   kind, name; lend(into, ones, at) moving sessions ones[at[i]]'s parts into `into` (a
///   batch of at.size() sequences), give_back(from, ones, at) moving them back; reset(one);
///   save(out, one, storage, print) and load(in, storage, fresh, print, where) -> one.
/// `print` is the fingerprint of the layer's feature map (checked for linear states).
template <class K>
struct SessionParts;

/// Moves the parts of sessions ones[at[0]], ones[at[1]], ... (each of_one(ones[s]), a
/// batch of one sequence) into `into`'s container, in that order.
template <class Batch, class Ones, class OfOne>
void lend_parts(Batch& into, Ones& ones, const std::vector<std::size_t>& at, const OfOne& of_one) {
  auto& held = PoolAccess::parts(into);
  held.clear();
  held.reserve(at.size() * PoolAccess::parts(of_one(ones[at.front()])).size());
  // Nothing below throws: moves into reserved room.
  for (std::size_t s : at) {
    for (auto& part : PoolAccess::parts(of_one(ones[s]))) held.push_back(std::move(part));
  }
}

/// Moves them back where lend_parts took them from.
template <class Batch, class Ones, class OfOne>
void give_back_parts(Batch& from, Ones& ones, const std::vector<std::size_t>& at,
                     const OfOne& of_one) noexcept {
  auto& held = PoolAccess::parts(from);
  std::size_t i = 0;
  for (std::size_t s : at) {
    for (auto& part : PoolAccess::parts(of_one(ones[s]))) part = std::move(held[i++]);
  }
  held.clear();
}

/// Parts kept as a vector inside the batch (states, windows, caches): lending moves them.
template <class K>
struct VectorParts {
  template <class Ones>
  static void lend(K& into, Ones& ones, const std::vector<std::size_t>& at) {
    lend_parts(into, ones, at, [](K& one) -> K& { return one; });
  }
  template <class Ones>
  static void give_back(K& from, Ones& ones, const std::vector<std::size_t>& at) noexcept {
    give_back_parts(from, ones, at, [](K& one) -> K& { return one; });
  }
  static void reset(K& one) { one.reset(); }
  /// The parts a batch holds (a lent batch's sessions x parts per session).
  static std::size_t count(K& batch) { return PoolAccess::parts(batch).size(); }
  /// Drops them (a lent batch between calls holds none).
  static void empty(K& batch) { PoolAccess::parts(batch).clear(); }
};

/// A linear or delta-rule state as its record (settings as format 4 writes them) and payload.
template <class Batch, class State, class Acc, StateFamily Family>
struct StateParts : VectorParts<Batch> {
  static constexpr bool linear = Family == StateFamily::linear;

  static void save(LittleEndianWriter& out, const Batch& one, SessionStorage storage,
                   const MapFingerprint& print, const char* where) {
    const auto& heads = PoolAccess::parts(const_cast<Batch&>(one));
    out.put<std::uint32_t>(static_cast<std::uint32_t>(heads.size()));
    for (const State& head : heads) {
      if constexpr (linear) {
        const StateRecord record = StateAccess::record(head, print);
        const ScaledSums<Acc> sums = head.sums();
        put_header(out, record);
        put_rows(out, sums.s.data(), sums.s.rows(), sums.s.cols(), storage, where);
        put_rows(out, sums.z.data(), 1, sums.z.size(), storage, where);
      } else {
        const StateRecord record = StateAccess::record(head);
        const Matrix<Acc>& s = StateAccess::held_s(head);
        put_header(out, record);
        put_rows(out, s.data(), s.rows(), s.cols(), storage, where);
      }
    }
  }

  static Batch load(LittleEndianReader& in, SessionStorage storage, const Batch& fresh,
                    const MapFingerprint& print, const char* where) {
    const auto& heads = PoolAccess::parts(const_cast<Batch&>(fresh));
    require_count(in.get<std::uint32_t>("the head count"), heads.size(), "head count", where);
    Batch one = fresh;
    auto& loaded = PoolAccess::parts(one);
    for (std::size_t h = 0; h < heads.size(); ++h) {
      const State& model = heads[h];
      StateRecord record;
      record.rows = in.get<std::uint64_t>("the rows of S");
      record.cols = in.get<std::uint64_t>("the columns of S");
      require_count(record.rows, static_cast<std::uint64_t>(StateAccess::held_s(model).rows()),
                    "rows of S", where);
      require_count(record.cols, static_cast<std::uint64_t>(model.value_dim()), "columns of S",
                    where);
      record.scalar_bytes = in.get<std::uint8_t>("the scalar size");
      require_count(record.scalar_bytes, sizeof(Acc), "scalar size of S", where);
      record.family = record::read_family(in, where);
      if (record.family != Family) {
        throw Error(std::string(where) + ": the blob holds a " + state_family_class(record.family) +
                    " where this pool's layer keeps a " + state_family_class(Family));
      }
      record::SettingBytes bytes;
      record::read_settings(in, record, bytes);
      const auto rows = static_cast<Eigen::Index>(record.rows);
      const auto cols = static_cast<Eigen::Index>(record.cols);
      Matrix<Acc> s(rows, cols);
      get_rows(in, s.data(), rows, cols, storage, "S", where);
      Vector<Acc> z;
      if constexpr (linear) {
        z.resize(rows);
        get_rows(in, z.data(), 1, rows, storage, "z", where);
      }
      record.payload.resize(static_cast<std::size_t>(s.size() + z.size()) * sizeof(Acc));
      unsigned char* at = record.payload.data();
      for (Eigen::Index i = 0; i < s.size(); ++i, at += sizeof(Acc))
        encode_little_endian(s.data()[i], at);
      for (Eigen::Index i = 0; i < z.size(); ++i, at += sizeof(Acc)) encode_little_endian(z(i), at);
      record::check_record(record, record::Layout::current, bytes, where);
      if constexpr (linear) {
        loaded[h] = StateAccess::restore<State>(record, print, model.options(), where);
        require_own_settings(record, StateAccess::record(loaded[h], print), where);
      } else {
        loaded[h] = StateAccess::restore<State>(record, model.options(), where);
        require_own_settings(record, StateAccess::record(loaded[h]), where);
      }
    }
    return one;
  }

 private:
  /// Throws unless the blob's settings are, byte for byte, those this pool's layer writes
  /// (load accepts equivalent ones: a negative scale for any other, a random map's seed): a
  /// session's bytes are canonical.
  static void require_own_settings(const StateRecord& read, const StateRecord& own,
                                   const char* where) {
    const auto bytes_of = [](const StateRecord& record) {
      std::vector<std::uint8_t> bytes;
      ByteSink sink(bytes);
      std::ostream os(&sink);
      LittleEndianWriter out(os);
      write_record_settings(out, record);
      return bytes;
    };
    if (bytes_of(read) != bytes_of(own)) {
      throw Error(std::string(where) + ": a state's settings are not written as this pool's " +
                  "layer writes them (its options or feature map record differ in a field " +
                  "that does not change results): not a blob this pool saved");
    }
  }

  static void put_header(LittleEndianWriter& out, const StateRecord& record) {
    out.put<std::uint64_t>(record.rows);
    out.put<std::uint64_t>(record.cols);
    out.put<std::uint8_t>(static_cast<std::uint8_t>(sizeof(Acc)));
    write_record_settings(out, record);
  }
};

template <class T, class Acc>
struct SessionParts<RecurrentStateBatch<T, Acc>>
    : StateParts<RecurrentStateBatch<T, Acc>, RecurrentState<T, Acc>, Acc, StateFamily::linear> {
  static constexpr PartKind kind = PartKind::linear_states;
  static constexpr const char* name = "RecurrentStateBatch (linear attention)";
};

template <class T, class Acc>
struct SessionParts<DeltaRuleStateBatch<T, Acc>>
    : StateParts<DeltaRuleStateBatch<T, Acc>, DeltaRuleState<T, Acc>, Acc,
                 StateFamily::delta_rule> {
  static constexpr PartKind kind = PartKind::delta_states;
  static constexpr const char* name = "DeltaRuleStateBatch (delta rule)";
};

template <class T, class Acc>
struct SessionParts<DplrDeltaRuleStateBatch<T, Acc>>
    : StateParts<DplrDeltaRuleStateBatch<T, Acc>, DplrDeltaRuleState<T, Acc>, Acc,
                 StateFamily::dplr_delta_rule> {
  static constexpr PartKind kind = PartKind::dplr_states;
  static constexpr const char* name = "DplrDeltaRuleStateBatch (generalized delta rule)";
};

template <class T>
struct SessionParts<ConvWindows<T>> : VectorParts<ConvWindows<T>> {
  static constexpr PartKind kind = PartKind::conv_windows;
  static constexpr const char* name = "ConvWindows (short convolution)";

  static void save(LittleEndianWriter& out, const ConvWindows<T>& one, SessionStorage storage,
                   const MapFingerprint&, const char* where) {
    out.put<std::uint64_t>(static_cast<std::uint64_t>(one.rows()));
    out.put<std::uint64_t>(static_cast<std::uint64_t>(one.channels()));
    out.put<std::uint8_t>(static_cast<std::uint8_t>(sizeof(T)));
    put_rows(out, one.window(0).data(), one.rows(), one.channels(), storage, where);
  }
  static ConvWindows<T> load(LittleEndianReader& in, SessionStorage storage,
                             const ConvWindows<T>& fresh, const MapFingerprint&,
                             const char* where) {
    require_count(in.get<std::uint64_t>("the window's rows"),
                  static_cast<std::uint64_t>(fresh.rows()), "window rows", where);
    require_count(in.get<std::uint64_t>("the window's channels"),
                  static_cast<std::uint64_t>(fresh.channels()), "window channels", where);
    require_count(in.get<std::uint8_t>("the scalar size"), sizeof(T), "window scalar size", where);
    ConvWindows<T> one = fresh;
    Matrix<T>& window = PoolAccess::parts(one).front();
    get_rows(in, window.data(), window.rows(), window.cols(), storage, "a window", where);
    return one;
  }
};

template <class T>
struct SessionParts<KVCacheBatch<T>> : VectorParts<KVCacheBatch<T>> {
  static constexpr PartKind kind = PartKind::kv_caches;
  static constexpr const char* name = "KVCacheBatch (softmax attention)";

  static void save(LittleEndianWriter& out, const KVCacheBatch<T>& one, SessionStorage storage,
                   const MapFingerprint&, const char* where) {
    out.put<std::uint32_t>(static_cast<std::uint32_t>(one.heads()));
    for (Eigen::Index h = 0; h < one.heads(); ++h) {
      const SoftmaxKVCache<T>& cache = one.cache(0, h);
      out.put<std::uint64_t>(static_cast<std::uint64_t>(cache.key_dim()));
      out.put<std::uint64_t>(static_cast<std::uint64_t>(cache.value_dim()));
      out.put<std::uint8_t>(static_cast<std::uint8_t>(sizeof(T)));
      out.put<double>(static_cast<double>(cache.scale()));
      out.put<std::uint64_t>(static_cast<std::uint64_t>(cache.tokens()));
      put_rows(out, cache.keys().data(), cache.tokens(), cache.key_dim(), storage, where);
      put_rows(out, cache.values().data(), cache.tokens(), cache.value_dim(), storage, where);
    }
  }
  static KVCacheBatch<T> load(LittleEndianReader& in, SessionStorage storage,
                              const KVCacheBatch<T>& fresh, const MapFingerprint&,
                              const char* where) {
    require_count(in.get<std::uint32_t>("the head count"),
                  static_cast<std::uint64_t>(fresh.heads()), "KV head count", where);
    KVCacheBatch<T> one = fresh;
    for (Eigen::Index h = 0; h < fresh.heads(); ++h) {
      SoftmaxKVCache<T>& cache = one.cache(0, h);
      cache.reset();
      const Eigen::Index dk = cache.key_dim(), dv = cache.value_dim();
      require_count(in.get<std::uint64_t>("Dk"), static_cast<std::uint64_t>(dk), "Dk", where);
      require_count(in.get<std::uint64_t>("Dv"), static_cast<std::uint64_t>(dv), "Dv", where);
      require_count(in.get<std::uint8_t>("the scalar size"), sizeof(T), "cache scalar size", where);
      const double scale = in.get<double>("the scale");
      if (!(scale == static_cast<double>(cache.scale()))) {
        throw Error(std::string(where) + ": the blob's cache has scale " + format_double(scale) +
                    " but this pool's layer " + format_double(double(cache.scale())));
      }
      const std::uint64_t tokens = in.get<std::uint64_t>("the cached tokens");
      if (tokens > static_cast<std::uint64_t>(kMaxStateEntries)) {
        throw Error(std::string(where) + ": the blob's cache holds " + std::to_string(tokens) +
                    " tokens, over the limit of 2^26");
      }
      // Token by token: a hostile count cannot allocate more than the blob really holds.
      Matrix<T> key(1, dk), value(1, dv);
      std::vector<T> keys, values;
      for (std::uint64_t t = 0; t < tokens; ++t) {
        get_rows(in, key.data(), 1, dk, storage, "a cached key", where);
        keys.insert(keys.end(), key.data(), key.data() + dk);
      }
      for (std::uint64_t t = 0; t < tokens; ++t) {
        get_rows(in, value.data(), 1, dv, storage, "a cached value", where);
        values.insert(values.end(), value.data(), value.data() + dv);
      }
      const auto n = static_cast<Eigen::Index>(tokens);
      cache.append(Eigen::Map<const Matrix<T>>(keys.data(), n, dk),
                   Eigen::Map<const Matrix<T>>(values.data(), n, dv));
    }
    return one;
  }
};

/// A mixer's states: its convolution's windows and its recurrence's states (members conv and
/// recurrent), lent and saved in that order.
template <class K>
struct MixerParts {
  using Conv = SessionParts<decltype(K::conv)>;
  using Recurrent = SessionParts<decltype(K::recurrent)>;

  template <class Ones>
  static void lend(K& into, Ones& ones, const std::vector<std::size_t>& at) {
    const auto conv = [](K & one) -> auto& { return one.conv; };
    const auto recurrent = [](K & one) -> auto& { return one.recurrent; };
    lend_parts(into.conv, ones, at, conv);
    try {
      lend_parts(into.recurrent, ones, at, recurrent);
    } catch (...) {
      give_back_parts(into.conv, ones, at, conv);
      throw;
    }
  }
  template <class Ones>
  static void give_back(K& from, Ones& ones, const std::vector<std::size_t>& at) noexcept {
    give_back_parts(
        from.conv, ones, at, [](K & one) -> auto& { return one.conv; });
    give_back_parts(
        from.recurrent, ones, at, [](K & one) -> auto& { return one.recurrent; });
  }
  static void reset(K& one) {
    one.conv.reset();
    one.recurrent.reset();
  }
  static std::size_t count(K& batch) {
    return Conv::count(batch.conv) + Recurrent::count(batch.recurrent);
  }
  static void empty(K& batch) {
    Conv::empty(batch.conv);
    Recurrent::empty(batch.recurrent);
  }
  static void save(LittleEndianWriter& out, const K& one, SessionStorage storage,
                   const MapFingerprint& print, const char* where) {
    Conv::save(out, one.conv, storage, print, where);
    Recurrent::save(out, one.recurrent, storage, print, where);
  }
  static K load(LittleEndianReader& in, SessionStorage storage, const K& fresh,
                const MapFingerprint& print, const char* where) {
    K one = fresh;
    one.conv = Conv::load(in, storage, fresh.conv, print, where);
    one.recurrent = Recurrent::load(in, storage, fresh.recurrent, print, where);
    return one;
  }
};

}  // namespace linattn::detail
