// SPDX-License-Identifier: MIT
// The live sessions of a server: every recurrent layer's states of every session, added,
// dropped and reordered without copying the others, stepped one layer at a time in one call.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <istream>
#include <linattn/config.hpp>
#include <linattn/detail/fingerprint.hpp>
#include <linattn/detail/session_keys.hpp>
#include <linattn/detail/session_parts.hpp>
#include <linattn/detail/state_batch.hpp>
#include <linattn/state_batch.hpp>
#include <linattn/state_io.hpp>
#include <memory>
#include <ostream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace linattn {
namespace detail {

/// The scalar type of a batch of states.
template <class Batch>
struct batch_traits {
  static_assert(always_false<Batch>,
                "linattn: SessionPool<Batch> needs Batch = RecurrentStateBatch<T, Acc>, "
                "DeltaRuleStateBatch<T, Acc> or DplrDeltaRuleStateBatch<T, Acc>");
  using Scalar = float;
};
template <class T, class Acc>
struct batch_traits<RecurrentStateBatch<T, Acc>> {
  using Scalar = T;
};
template <class T, class Acc>
struct batch_traits<DeltaRuleStateBatch<T, Acc>> {
  using Scalar = T;
};
template <class T, class Acc>
struct batch_traits<DplrDeltaRuleStateBatch<T, Acc>> {
  using Scalar = T;
};

/// Whether K is a batch of states (what a SessionPool<Batch> holds).
template <class K>
inline constexpr bool is_state_batch = false;
template <class T, class Acc>
inline constexpr bool is_state_batch<RecurrentStateBatch<T, Acc>> = true;
template <class T, class Acc>
inline constexpr bool is_state_batch<DeltaRuleStateBatch<T, Acc>> = true;
template <class T, class Acc>
inline constexpr bool is_state_batch<DplrDeltaRuleStateBatch<T, Acc>> = true;

/// Whether Layer is a layer whose make_states gives a Batch (the layers of a SessionPool).
template <class Layer, class Batch, class = void>
inline constexpr bool is_layer_of = false;
template <class Layer, class Batch>
inline constexpr bool
    is_layer_of<Layer, Batch,
                std::enable_if_t<
                    std::is_same_v<decltype(std::declval<const Layer&>().make_states(1)), Batch>>> =
        true;

}  // namespace detail

/// The decoding states of many sessions of one model: for each of its recurrent layers, each
/// session holds that layer's H states (one per head). Sessions are named by a caller's key
/// and ordered by position, 0 to size() - 1; a batch call on layer l takes its rows session by
/// session, head by head (state s * H + h is head h of the session at position s, as in a
/// batch of states), so the caller stacks each session's token rows in position order.
///
/// Adding, dropping and reordering sessions moves the states' handles, never their S and z:
/// the other sessions' memory stays where it is. Each call lends one layer's states of the
/// live sessions (or of the sessions named) to a `Batch` and runs the batch's call on them,
/// so a step checks every state and input before the first state moves and splits the
/// sessions x heads across the threads of the layer's options, exactly as that batch would.
/// Layers run one after another (layer l + 1 reads layer l's outputs): one call per layer.
/// A pool is made from the model's layers (SessionPool pool(layer_0, layer_1, ...)), so every
/// session's states have their layer's heads, options and decays.
/// @tparam Batch  RecurrentStateBatch<T, Acc> or DeltaRuleStateBatch<T, Acc>
template <class Batch>
class SessionPool {
 public:
  /// The type of each state.
  using State = typename Batch::State;
  /// The inputs' and outputs' type.
  using Scalar = typename detail::batch_traits<Batch>::Scalar;
  /// How the caller names a session (a user or conversation id).
  using Key = std::int64_t;

  /// A pool for a model's recurrent layers, in order: each session holds, for layer l, the
  /// states layer l's make_states(1) makes (its H heads, its options, its decays), so no
  /// session runs with other settings than its layer (a pool of hand-made batches could).
  /// @param first, rest  LinearAttentionLayer or DeltaRuleLayer whose States is Batch
  template <class First, class... Rest,
            class = std::enable_if_t<detail::is_layer_of<First, Batch> &&
                                     (detail::is_layer_of<Rest, Batch> && ...)>>
  explicit SessionPool(const First& first, const Rest&... rest)
      : SessionPool(FromLayers{},
                    std::vector<Batch>{first.make_states(1), rest.make_states(1)...}) {}

  /// A pool for `layers` layers in order (a model's layers of one type), each as above.
  /// @param layers  at least one
  template <class Layer, class = std::enable_if_t<detail::is_layer_of<Layer, Batch>>>
  explicit SessionPool(const std::vector<Layer>& layers)
      : SessionPool(FromLayers{}, fresh_of(layers)) {}

  /// A pool is made from its layers (above): batches made by hand could hold other options
  /// than the layers that feed them, and ran with them silently. Does not compile.
  template <class B = Batch>
  explicit SessionPool(std::vector<Batch>) {
    static_assert(detail::always_false<B>,
                  "linattn: a SessionPool is made from the model's layers: SessionPool "
                  "pool(layer_0, layer_1, ...) or pool(layers_vector), each session holding "
                  "layer_l.make_states(1) (batches made by hand could hold other options than "
                  "their layer's)");
  }
  /// As above: SessionPool(count, layer) instead.
  template <class B = Batch>
  SessionPool(Eigen::Index, const Batch&) {
    static_assert(detail::always_false<B>,
                  "linattn: a SessionPool is made from the model's layers: SessionPool "
                  "pool(count, layer) for count layers alike, each session holding "
                  "layer.make_states(1)");
  }

  /// A pool for `layers` layers alike, each `layer`.
  /// @param layers  number of layers, >= 1
  template <class Layer, class = std::enable_if_t<detail::is_layer_of<Layer, Batch>>>
  SessionPool(Eigen::Index layers, const Layer& layer)
      : SessionPool(FromLayers{},
                    std::vector<Batch>(static_cast<std::size_t>(detail::require_positive_dim(
                                           layers, "SessionPool", "layers")),
                                       layer.make_states(1))) {}

  /// Number of layers.
  Eigen::Index layers() const { return static_cast<Eigen::Index>(fresh_.size()); }
  /// H of layer `layer`: the states each session holds there.
  Eigen::Index heads(Eigen::Index layer) const {
    return fresh_[checked_layer(layer, "SessionPool::heads")].size();
  }
  /// Number of live sessions.
  Eigen::Index size() const { return keys_.size(); }
  /// The live sessions' keys in position order (the order of a batch call's rows).
  const std::vector<Key>& keys() const { return keys_.keys(); }
  /// Whether a session named `key` is live.
  bool contains(Key key) const { return keys_.contains(key); }
  /// The position of session `key` (its rows in a batch call); throws if it is not live.
  Eigen::Index position(Key key) const { return position_of(key, "SessionPool::position"); }

  /// Adds a new session at the end, with each layer's fresh states; throws if `key` is live.
  /// @return its position, size() - 1
  Eigen::Index add(Key key) {
    keys_.require_new(key, "SessionPool::add");
    std::vector<std::vector<State>> states;
    states.reserve(fresh_.size());
    for (const Batch& layer : fresh_) states.push_back(states_of(layer));
    return insert(key, states);
  }

  /// Adds session `key` at the end with the states save(key, os, args...) wrote, every layer's
  /// heads read (and checked, as `load` checks them) before the session is added: a throwing
  /// call changes nothing.
  /// @param is    a stream positioned at the session; read up to its last state's last byte
  /// @param args  what State::load takes before the options (RecurrentState: the map)
  /// @return      its position, size() - 1
  template <class... Args>
  Eigen::Index add(Key key, std::istream& is, const Args&... args) {
    constexpr const char* where = "SessionPool::add";
    keys_.require_new(key, where);
    std::vector<std::vector<State>> states = read_session(is, args...);
    return insert(key, states);
  }

  /// As add(key, is, args...) from a blob in caller memory (a database column), read in place
  /// and refused unless it holds the session's states and nothing after them.
  /// @param data  the blob's first byte, as save_bytes(key, args...) wrote it
  /// @param size  its length in bytes
  template <class... Args>
  Eigen::Index add_bytes(Key key, const void* data, std::size_t size, const Args&... args) {
    constexpr const char* where = "SessionPool::add_bytes";
    keys_.require_new(key, where);
    detail::ByteSource source(data, size);
    std::istream is(&source);
    std::vector<std::vector<State>> states = read_session(is, args...);
    if (source.left() != 0) {
      throw Error(std::string(where) + ": the blob holds " + std::to_string(source.left()) +
                  " bytes after the session's states (" + std::to_string(size) +
                  " in all): not one saved session of this pool's layers and heads");
    }
    return insert(key, states);
  }

  /// Removes session `key`; the sessions after it move up one position, their states where
  /// they were in memory.
  void drop(Key key) {
    const std::size_t at = static_cast<std::size_t>(position_of(key, "SessionPool::drop"));
    for (std::size_t l = 0; l < live_.size(); ++l) {
      const std::size_t h = heads_of(l);
      live_[l].erase(live_[l].begin() + static_cast<std::ptrdiff_t>(at * h),
                     live_[l].begin() + static_cast<std::ptrdiff_t>((at + 1) * h));
    }
    keys_.erase(at);
  }

  /// Puts the sessions in the order of `order`, a permutation of keys(); the states stay
  /// where they are in memory.
  void reorder(const std::vector<Key>& order) {
    const std::vector<std::size_t> from = keys_.permutation_of(order, "SessionPool::reorder");
    std::vector<Key> keys = order;
    std::vector<std::vector<State>> next(live_.size());
    for (std::size_t l = 0; l < live_.size(); ++l) next[l].reserve(live_[l].size());
    // Nothing below allocates or throws: the moves take the handles only.
    for (std::size_t l = 0; l < live_.size(); ++l) {
      const std::size_t h = heads_of(l);
      for (std::size_t s : from) {
        for (std::size_t j = 0; j < h; ++j) next[l].push_back(std::move(live_[l][s * h + j]));
      }
      live_[l].swap(next[l]);
    }
    keys_.reorder(keys);
  }

  /// Clears every state of session `key` (a new conversation under the same key).
  void reset(Key key) {
    const std::size_t at = static_cast<std::size_t>(position_of(key, "SessionPool::reset"));
    for (std::size_t l = 0; l < live_.size(); ++l) {
      for (std::size_t j = 0; j < heads_of(l); ++j) live_[l][at * heads_of(l) + j].reset();
    }
  }

  /// Head `head` of session `key` in layer `layer`.
  State& state(Key key, Eigen::Index layer, Eigen::Index head) {
    return live_[checked_layer(layer, "SessionPool::state")][state_index(key, layer, head)];
  }
  /// Head `head` of session `key` in layer `layer`, read-only.
  const State& state(Key key, Eigen::Index layer, Eigen::Index head) const {
    return live_[checked_layer(layer, "SessionPool::state")][state_index(key, layer, head)];
  }

  /// Writes session `key`'s H states of layer `layer`, head by head, each as State::save
  /// writes it (`args`: the feature map a RecurrentState saves with, or nothing).
  template <class... Args>
  void save(Key key, Eigen::Index layer, std::ostream& os, const Args&... args) const {
    constexpr const char* where = "SessionPool::save";
    const std::size_t l = checked_layer(layer, where);
    const std::size_t at = static_cast<std::size_t>(position_of(key, where));
    for (std::size_t j = 0; j < heads_of(l); ++j) live_[l][at * heads_of(l) + j].save(os, args...);
  }

  /// Writes every layer's states of session `key`, layer by layer, head by head: what
  /// add(key, is, args...) reads back.
  /// @param args  what State::save takes after the stream (RecurrentState: the map)
  template <class... Args>
  void save(Key key, std::ostream& os, const Args&... args) const {
    for (Eigen::Index l = 0; l < layers(); ++l) save(key, l, os, args...);
  }

  /// The bytes save(key, os, args...) writes: a session as one database blob.
  template <class... Args>
  std::vector<std::uint8_t> save_bytes(Key key, const Args&... args) const {
    std::vector<std::uint8_t> bytes;
    detail::ByteSink sink(bytes);
    std::ostream os(&sink);
    save(key, os, args...);
    return bytes;
  }

  /// Replaces session `key`'s H states of layer `layer` with ones `save` wrote. Each head loads
  /// as State::load(is, args..., options) with that head's fresh options, which checks them
  /// (and the feature map, for a RecurrentState); every head is read before any is replaced.
  template <class... Args>
  void load(Key key, Eigen::Index layer, std::istream& is, const Args&... args) {
    constexpr const char* where = "SessionPool::load";
    const std::size_t l = checked_layer(layer, where);
    const std::size_t at = static_cast<std::size_t>(position_of(key, where));
    const std::vector<State>& fresh = states_of(fresh_[l]);
    std::vector<State> loaded;
    loaded.reserve(fresh.size());
    for (const State& head : fresh) loaded.push_back(State::load(is, args..., head.options()));
    for (std::size_t j = 0; j < loaded.size(); ++j) {
      live_[l][at * loaded.size() + j] = std::move(loaded[j]);
    }
  }

  /// One token for every live session's heads of layer `layer`: Batch::step_into(args...) on
  /// a batch of size() * H states (rows session by session; a state numbered in an error is
  /// position * H + head). Throws if no session is live.
  /// @param args  as the batch's step_into: q, k, v (size() * H rows, or grouped), the gates
  ///              and beta where the recurrence has them, the map for the engine, out
  template <class... Args>
  void step_into(Eigen::Index layer, Args&&... args) {
    lend_live(layer, "SessionPool::step",
              [&](Batch& batch) { batch.step_into(std::forward<Args>(args)...); });
  }

  /// As step_into, returning the size() * H x Dv outputs (`args` without out).
  template <class... Args>
  Matrix<Scalar> step(Eigen::Index layer, Args&&... args) {
    const std::size_t l = checked_layer(layer, "SessionPool::step");
    Matrix<Scalar> out(size() * heads(layer), states_of(fresh_[l]).front().value_dim());
    step_into(layer, std::forward<Args>(args)..., out);
    return out;
  }

  /// One token for the sessions named only (the others stay as they are): the batch's
  /// step_into(args...) on their states, session sessions[b]'s heads at rows b * H + h.
  /// @param sessions  B distinct live keys
  /// @param args      as the batch's step_into, with B * H rows (or grouped)
  template <class... Args>
  void step_sessions_into(Eigen::Index layer, const std::vector<Key>& sessions, Args&&... args) {
    lend_some(layer, sessions, "SessionPool::step_sessions",
              [&](Batch& batch) { batch.step_into(std::forward<Args>(args)...); });
  }

  /// Prompts of equal length for the sessions named, through the chunked form: the batch's
  /// prefill_into(args...) with sequence b the session sessions[b], which ends where stepping
  /// each token would leave it. The other sessions are not touched.
  /// @param sessions  B distinct live keys
  /// @param args      as the batch's prefill_into: B x H views (q, k, v, gates / beta, map), out
  template <class... Args>
  void prefill_into(Eigen::Index layer, const std::vector<Key>& sessions, Args&&... args) {
    lend_some(layer, sessions, "SessionPool::prefill",
              [&](Batch& batch) { batch.prefill_into(std::forward<Args>(args)...); });
  }

  /// Prompts of different lengths packed along N (offsets, FLA's cu_seqlens) for the sessions
  /// named: the batch's prefill_varlen_into(args...) with sequence s the session sessions[s].
  /// The other sessions are not touched.
  /// @param sessions  S distinct live keys, S + 1 == offsets.size()
  /// @param args      as the batch's prefill_varlen_into: 1 x H x T views, offsets, out
  template <class... Args>
  void prefill_varlen_into(Eigen::Index layer, const std::vector<Key>& sessions, Args&&... args) {
    lend_some(layer, sessions, "SessionPool::prefill_varlen",
              [&](Batch& batch) { batch.prefill_varlen_into(std::forward<Args>(args)...); });
  }

 private:
  /// Marks the one constructor that takes the fresh batches: the layers' make_states(1).
  struct FromLayers {};

  SessionPool(FromLayers, std::vector<Batch> fresh)
      : fresh_(std::move(fresh)), live_(fresh_.size()) {
    if (fresh_.empty()) throw Error("SessionPool: no layers given; give the model's layers");
  }

  template <class Layer>
  static std::vector<Batch> fresh_of(const std::vector<Layer>& layers) {
    std::vector<Batch> fresh;
    fresh.reserve(layers.size());
    for (const Layer& layer : layers) fresh.push_back(layer.make_states(1));
    return fresh;
  }

  static std::vector<State>& states_of(Batch& batch) {
    return static_cast<detail::StateBatch<State>&>(batch).states_;
  }
  static const std::vector<State>& states_of(const Batch& batch) {
    return static_cast<const detail::StateBatch<State>&>(batch).states_;
  }

  std::size_t heads_of(std::size_t layer) const { return states_of(fresh_[layer]).size(); }

  std::size_t checked_layer(Eigen::Index layer, const char* where) const {
    return detail::checked_layer(layer, layers(), where);
  }

  Eigen::Index position_of(Key key, const char* where) const {
    return keys_.position_of(key, where);
  }

  std::size_t state_index(Key key, Eigen::Index layer, Eigen::Index head) const {
    constexpr const char* where = "SessionPool::state";
    const std::size_t l = checked_layer(layer, where);
    if (head < 0 || head >= heads(layer)) {
      throw Error(std::string(where) + ": head " + std::to_string(head) + " but layer " +
                  std::to_string(layer) + " has " + std::to_string(heads(layer)) + " heads");
    }
    return static_cast<std::size_t>(position_of(key, where)) * heads_of(l) +
           static_cast<std::size_t>(head);
  }

  /// Every layer's heads of one session as save(key, os, args...) wrote them, each loaded with
  /// its head's fresh options.
  template <class... Args>
  std::vector<std::vector<State>> read_session(std::istream& is, const Args&... args) const {
    std::vector<std::vector<State>> states(fresh_.size());
    for (std::size_t l = 0; l < fresh_.size(); ++l) {
      states[l].reserve(heads_of(l));
      for (const State& head : states_of(fresh_[l])) {
        states[l].push_back(State::load(is, args..., head.options()));
      }
    }
    return states;
  }

  /// Appends session `key` with `states` (per layer, its H states), moved in. Everything that
  /// can throw (allocations) happens before the first change.
  Eigen::Index insert(Key key, std::vector<std::vector<State>>& states) {
    // Room grows geometrically; a reallocation moves the states' handles, never S or z.
    for (std::size_t l = 0; l < live_.size(); ++l) {
      std::vector<State>& v = live_[l];
      const std::size_t more = heads_of(l);
      if (v.capacity() < v.size() + more) v.reserve(std::max(v.size() + more, 2 * v.capacity()));
    }
    keys_.reserve_one();
    keys_.append(key);
    // Nothing below throws: moves into reserved room.
    for (std::size_t l = 0; l < live_.size(); ++l) {
      for (State& state : states[l]) live_[l].push_back(std::move(state));
    }
    return size() - 1;
  }

  /// Swaps `states` into layer `layer`'s batch for body(batch), and back whatever happens.
  template <class Body>
  void lend(std::size_t layer, std::vector<State>& states, const Body& body) {
    struct SwapBack {
      std::vector<State>& a;
      std::vector<State>& b;
      ~SwapBack() { a.swap(b); }
    };
    std::vector<State>& held = states_of(fresh_[layer]);
    held.swap(states);
    const SwapBack swap_back{held, states};
    body(fresh_[layer]);
  }

  template <class Body>
  void lend_live(Eigen::Index layer, const char* where, const Body& body) {
    const std::size_t l = checked_layer(layer, where);
    if (keys_.size() == 0) throw Error(std::string(where) + ": the pool has no live session");
    lend(l, live_[l], body);
  }

  /// Lends the states of the sessions named, in that order, moved out of their places and
  /// back whatever happens.
  template <class Body>
  void lend_some(Eigen::Index layer, const std::vector<Key>& sessions, const char* where,
                 const Body& body) {
    const std::size_t l = checked_layer(layer, where);
    if (sessions.empty()) throw Error(std::string(where) + ": sessions is empty");
    const std::vector<std::size_t> at = keys_.positions_of(sessions, where, "sessions");
    const std::size_t h = heads_of(l);
    std::vector<State> some;
    some.reserve(at.size() * h);
    for (std::size_t s : at) {
      for (std::size_t j = 0; j < h; ++j) some.push_back(std::move(live_[l][s * h + j]));
    }
    struct MoveBack {
      std::vector<State>& live;
      std::vector<State>& some;
      const std::vector<std::size_t>& at;
      std::size_t h;
      ~MoveBack() {
        for (std::size_t i = 0; i < at.size(); ++i) {
          for (std::size_t j = 0; j < h; ++j) live[at[i] * h + j] = std::move(some[i * h + j]);
        }
      }
    };
    const MoveBack move_back{live_[l], some, at, h};
    lend(l, some, body);
  }

  std::vector<Batch> fresh_;  // per layer: a new session's states; lent the live ones per call
  std::vector<std::vector<State>> live_;  // per layer: size() * H states, session-major
  detail::SessionKeys keys_;
};

namespace detail {
/// SessionPool<Batch> for layers whose States are all one batch of states, else SessionPool<>.
template <class First, class... Rest>
using pool_of_layers_t =
    std::conditional_t<(std::is_same_v<typename First::States, typename Rest::States> && ...) &&
                           is_state_batch<typename First::States>,
                       typename First::States, void>;
}  // namespace detail

/// SessionPool pool(layer_0, layer_1, ...) holds those layers' States: a SessionPool<Batch>
/// when every layer's States is the same batch of states, else a SessionPool<> (hybrid).
template <class First, class... Rest>
SessionPool(const First&, const Rest&...) -> SessionPool<detail::pool_of_layers_t<First, Rest...>>;
template <class Layer>
SessionPool(const std::vector<Layer>&) -> SessionPool<typename Layer::States>;
template <class Layer>
SessionPool(Eigen::Index, const Layer&) -> SessionPool<typename Layer::States>;

}  // namespace linattn

namespace linattn {
namespace detail {

/// A new address for every type K: which kind a type-erased pool layer holds (without RTTI).
template <class K>
const void* pool_kind_id() {
  static const char id = 0;
  return &id;
}

/// A staged part of one session (fresh or loaded) before it joins its layer.
struct StagedPart {
  virtual ~StagedPart() = default;
};

/// One layer of a SessionPool<>: its live sessions' parts, whatever their kind.
class PoolLayer {
 public:
  virtual ~PoolLayer() = default;
  virtual const void* kind_id() const = 0;
  virtual PartKind kind() const = 0;
  virtual const char* name() const = 0;
  /// A new session's part (may throw; nothing changes).
  virtual std::unique_ptr<StagedPart> fresh() const = 0;
  /// A session's part read from a blob, checked against this layer (may throw).
  virtual std::unique_ptr<StagedPart> load(LittleEndianReader& in, SessionStorage storage,
                                           const char* where) const = 0;
  /// Room for one more session (may throw); push then cannot.
  virtual void reserve_one() = 0;
  virtual void push(StagedPart& part) noexcept = 0;
  virtual void erase(std::size_t at) = 0;
  /// Session from[s] moves to position s (no part's memory moves), in place: `done` is the
  /// caller's room of size() flags, so nothing here allocates or throws.
  virtual void permute(const std::vector<std::size_t>& from, std::vector<char>& done) noexcept = 0;
  virtual void reset(std::size_t at) = 0;
  virtual void save(LittleEndianWriter& out, std::size_t at, SessionStorage storage,
                    const char* where) const = 0;
  /// A copy of session `at`'s part (may throw; nothing changes).
  virtual std::unique_ptr<StagedPart> copy(std::size_t at) const = 0;
  /// A copy of a staged part of this layer (may throw).
  virtual std::unique_ptr<StagedPart> clone(const StagedPart& part) const = 0;
  /// Session `at`'s part replaced by a staged one of this layer, moved in.
  virtual void replace(std::size_t at, StagedPart& part) noexcept = 0;
};

/// A pool layer of kind K: one K of batch 1 per session, lent as one K of B for a call.
template <class K>
class TypedPoolLayer final : public PoolLayer {
  using Parts = SessionParts<K>;
  struct Staged final : StagedPart {
    explicit Staged(K part) : value(std::move(part)) {}
    K value;
  };

 public:
  TypedPoolLayer(K fresh, const MapFingerprint& print)
      : fresh_(fresh), lent_(std::move(fresh)), print_(print) {}

  const void* kind_id() const override { return pool_kind_id<K>(); }
  PartKind kind() const override { return Parts::kind; }
  const char* name() const override { return Parts::name; }
  std::unique_ptr<StagedPart> fresh() const override { return std::make_unique<Staged>(fresh_); }
  std::unique_ptr<StagedPart> load(LittleEndianReader& in, SessionStorage storage,
                                   const char* where) const override {
    return std::make_unique<Staged>(Parts::load(in, storage, fresh_, print_, where));
  }
  void reserve_one() override {
    if (ones_.capacity() < ones_.size() + 1)
      ones_.reserve(std::max<std::size_t>(4, 2 * ones_.size()));
  }
  void push(StagedPart& part) noexcept override {
    ones_.push_back(std::move(static_cast<Staged&>(part).value));
  }
  void erase(std::size_t at) override {
    ones_.erase(ones_.begin() + static_cast<std::ptrdiff_t>(at));
  }
  void permute(const std::vector<std::size_t>& from, std::vector<char>& done) noexcept override {
    // Cycle by cycle: position s takes from[s]'s part, one move each.
    std::fill(done.begin(), done.end(), char(0));
    for (std::size_t start = 0; start < ones_.size(); ++start) {
      if (done[start] || from[start] == start) continue;
      K held = std::move(ones_[start]);
      std::size_t s = start;
      while (from[s] != start) {
        ones_[s] = std::move(ones_[from[s]]);
        done[s] = 1;
        s = from[s];
      }
      ones_[s] = std::move(held);
      done[s] = 1;
    }
  }
  void reset(std::size_t at) override { Parts::reset(ones_[at]); }
  void save(LittleEndianWriter& out, std::size_t at, SessionStorage storage,
            const char* where) const override {
    Parts::save(out, ones_[at], storage, print_, where);
  }

  std::unique_ptr<StagedPart> copy(std::size_t at) const override {
    return std::make_unique<Staged>(ones_[at]);
  }
  std::unique_ptr<StagedPart> clone(const StagedPart& part) const override {
    return std::make_unique<Staged>(static_cast<const Staged&>(part).value);
  }
  void replace(std::size_t at, StagedPart& part) noexcept override {
    ones_[at] = std::move(static_cast<Staged&>(part).value);
  }

  /// Session at[i]'s part as sequence i of one K for body(K&), and back whatever happens.
  template <class Body>
  void lend(const std::vector<std::size_t>& at, const Body& body) {
    Parts::lend(lent_, ones_, at);
    struct GiveBack {
      TypedPoolLayer& layer;
      const std::vector<std::size_t>& at;
      std::size_t parts;  // what the lent batch holds: a body that replaced it changes this
      ~GiveBack() {
        if (Parts::count(layer.lent_) == parts) {
          Parts::give_back(layer.lent_, layer.ones_, at);
          return;
        }
        // The body assigned another batch to the one it was lent: the sessions' parts left
        // with the old one. They start afresh rather than keep moved-from parts.
        for (std::size_t s : at) layer.ones_[s] = layer.fresh_;
        layer.lent_ = layer.fresh_;
        Parts::empty(layer.lent_);
      }
    };
    const GiveBack give_back{*this, at, Parts::count(lent_)};
    body(lent_);
  }

  K& one(std::size_t at) { return ones_[at]; }
  const K& one(std::size_t at) const { return ones_[at]; }

 private:
  K fresh_;               // a new session's part: the layer's make_states(1)
  K lent_;                // the batch lent for each call (its containers empty between calls)
  MapFingerprint print_;  // the layer's feature map, recorded with linear states
  std::vector<K> ones_;   // by position: each session's part, a batch of one
};

/// The pool layer of a model layer (anything whose make_states(1) is a kind SessionParts knows).
template <class Layer>
std::unique_ptr<PoolLayer> make_pool_layer(const Layer& layer) {
  using K = std::decay_t<decltype(layer.make_states(1))>;
  return std::make_unique<TypedPoolLayer<K>>(layer.make_states(1), LayerMapPrint<Layer>::of(layer));
}

/// The magic of a session blob.
inline constexpr char kSessionMagic[8] = {'L', 'N', 'A', 'T', 'T', 'N', 'P', '\0'};
/// The session blob format this build writes (and the last it reads).
inline constexpr std::uint32_t kSessionFormatVersion = 1;

}  // namespace detail

/// A copy of one session of a SessionPool<>, every layer: a checkpoint to start sessions from
/// (a shared prompt's prefix), or the state before speculative drafts to go back to. Only the
/// pool that took it restores it.
class SessionSnapshot {
 public:
  /// Empty: restores nothing (a pool refuses it).
  SessionSnapshot() = default;

 private:
  template <class>
  friend class SessionPool;
  std::vector<std::shared_ptr<const detail::StagedPart>> parts_;  // per layer, immutable
  std::shared_ptr<const char> pool_;  // the identity of the pool that took it
};

/// The sessions of a whole hybrid model: for each layer, whatever that layer carries from one
/// call to the next, of any kind: a linear-attention or delta-rule layer's states, a mixer's
/// windows and states (GatedDeltaNet, Mamba2), a gated short convolution's windows
/// (GatedShortConv), a softmax layer's KV caches (KVCacheBatch). Made from the model's layers in
/// order; sessions are named by key and ordered by position as in SessionPool<Batch>, and a
/// call on layer l lends that layer's parts of the sessions named (or of every live one) to
/// one batch of the layer's kind, sequence b being the b-th session, then takes them back:
/// adding, dropping and reordering sessions never moves a state's memory.
///
/// A session saves as one blob: every layer, one CRC-32, the format versioned (the layout is
/// in docs/design.md), in the storage asked for (exact, bf16, int8); add_bytes reads and
/// checks the whole blob before the session joins.
template <>
class SessionPool<void> {
 public:
  /// How the caller names a session.
  using Key = std::int64_t;

  /// A pool for a model's layers, in order: each session holds layer l's make_states(1).
  /// @param layers  LinearAttentionLayer, DeltaRuleLayer, GatedDeltaNet, Mamba2,
  ///                GatedShortConv, or a KVCacheBatch (a softmax layer's caches:
  ///                its heads, Dk, Dv and scale); at least one
  template <class First, class... Rest>
  explicit SessionPool(const First& first, const Rest&... rest) {
    layers_.reserve(1 + sizeof...(Rest));
    layers_.push_back(detail::make_pool_layer(first));
    (layers_.push_back(detail::make_pool_layer(rest)), ...);
  }

  /// A pool without layers yet: add_layer each of the model's layers in order (a model of
  /// many layers held in vectors), then add sessions.
  SessionPool() = default;

  /// Appends `layer` as the pool's next layer (as the constructor takes it); throws once a
  /// session is live (its states would lack the layer).
  /// @return the layer's index
  template <class Layer>
  Eigen::Index add_layer(const Layer& layer) {
    require_not_lending("SessionPool::add_layer");
    if (keys_.size() != 0) {
      throw Error("SessionPool::add_layer: " + std::to_string(keys_.size()) +
                  " sessions are live; add every layer before the first session");
    }
    std::shared_ptr<const char> identity = std::make_shared<const char>('\0');
    layers_.push_back(detail::make_pool_layer(layer));
    identity_.swap(identity);  // snapshots taken before lack this layer: another pool's
    return layers() - 1;
  }

  /// Number of layers.
  Eigen::Index layers() const { return static_cast<Eigen::Index>(layers_.size()); }
  /// What layer `layer` holds per session, e.g. "GatedDeltaNetStates (...)".
  const char* layer_kind(Eigen::Index layer) const {
    return layers_[checked_layer(layer, "SessionPool::layer_kind")]->name();
  }
  /// Number of live sessions.
  Eigen::Index size() const { return keys_.size(); }
  /// The live sessions' keys in position order (the order of a call's sequences).
  const std::vector<Key>& keys() const { return keys_.keys(); }
  /// Whether a session named `key` is live.
  bool contains(Key key) const { return keys_.contains(key); }
  /// The position of session `key`; throws if it is not live.
  Eigen::Index position(Key key) const { return keys_.position_of(key, "SessionPool::position"); }

  /// Adds a new session at the end, every layer fresh; throws if `key` is live.
  /// @return its position, size() - 1
  Eigen::Index add(Key key) {
    require_not_lending("SessionPool::add");
    keys_.require_new(key, "SessionPool::add");
    std::vector<std::unique_ptr<detail::StagedPart>> parts;
    parts.reserve(layers_.size());
    for (const auto& layer : layers_) parts.push_back(layer->fresh());
    return insert(key, parts);
  }

  /// Adds session `key` at the end from the blob save_bytes wrote (any storage), read and
  /// checked whole (magic, version, every layer's kind and shape, options, feature maps, the
  /// CRC, nothing after it) before the session joins: a throwing call changes nothing.
  /// @param data  the blob's first byte
  /// @param size  its length in bytes
  /// @return      its position, size() - 1
  Eigen::Index add_bytes(Key key, const void* data, std::size_t size) {
    constexpr const char* where = "SessionPool::add_bytes";
    require_not_lending(where);
    keys_.require_new(key, where);
    detail::ByteSource source(data, size);
    std::istream is(&source);
    std::vector<std::unique_ptr<detail::StagedPart>> parts = read_session(is, where);
    if (source.left() != 0) {
      throw Error(std::string(where) + ": the blob holds " + std::to_string(source.left()) +
                  " bytes after the session (" + std::to_string(size) + " in all)");
    }
    return insert(key, parts);
  }
  /// As add_bytes over a vector.
  Eigen::Index add_bytes(Key key, const std::vector<std::uint8_t>& bytes) {
    return add_bytes(key, bytes.data(), bytes.size());
  }
  /// As add_bytes from a stream positioned at a blob, read up to its last byte.
  Eigen::Index add(Key key, std::istream& is) {
    constexpr const char* where = "SessionPool::add";
    require_not_lending(where);
    keys_.require_new(key, where);
    std::vector<std::unique_ptr<detail::StagedPart>> parts = read_session(is, where);
    return insert(key, parts);
  }

  /// Writes session `key`, every layer, as one blob (add and add_bytes read it back).
  /// @param storage  exact (bit for bit), bf16 or int8: the numbers' bytes in the blob
  void save(Key key, std::ostream& os, SessionStorage storage = SessionStorage::exact) const {
    constexpr const char* where = "SessionPool::save";
    require_not_lending(where);
    const std::size_t at = static_cast<std::size_t>(keys_.position_of(key, where));
    if (storage != SessionStorage::exact && storage != SessionStorage::bf16 &&
        storage != SessionStorage::int8) {
      throw Error(std::string(where) + ": storage is not a SessionStorage");
    }
    detail::LittleEndianWriter out(os);
    out.put_bytes(reinterpret_cast<const unsigned char*>(detail::kSessionMagic),
                  sizeof(detail::kSessionMagic));
    out.put<std::uint32_t>(detail::kSessionFormatVersion);
    out.put<std::uint8_t>(static_cast<std::uint8_t>(storage));
    out.put<std::uint32_t>(static_cast<std::uint32_t>(layers_.size()));
    for (const auto& layer : layers_) {
      out.put<std::uint8_t>(static_cast<std::uint8_t>(layer->kind()));
      layer->save(out, at, storage, where);
    }
    const std::uint32_t checksum = out.checksum();
    out.put<std::uint32_t>(checksum);
    if (!os) throw Error(std::string(where) + ": the stream failed while writing");
  }

  /// The bytes save(key, os, storage) writes: a session as one database blob.
  std::vector<std::uint8_t> save_bytes(Key key,
                                       SessionStorage storage = SessionStorage::exact) const {
    std::vector<std::uint8_t> bytes;
    detail::ByteSink sink(bytes);
    std::ostream os(&sink);
    save(key, os, storage);
    return bytes;
  }

  /// Removes session `key`; the sessions after it move up one position.
  void drop(Key key) {
    require_not_lending("SessionPool::drop");
    const std::size_t at = static_cast<std::size_t>(keys_.position_of(key, "SessionPool::drop"));
    for (const auto& layer : layers_) layer->erase(at);
    keys_.erase(at);
  }

  /// A copy of session `key`, every layer: restore(key, snapshot) goes back to it (before
  /// speculative drafts), add(new_key, snapshot) starts a session from it (a shared prefix).
  SessionSnapshot snapshot(Key key) const {
    require_not_lending("SessionPool::snapshot");
    const std::size_t at =
        static_cast<std::size_t>(keys_.position_of(key, "SessionPool::snapshot"));
    SessionSnapshot snapshot;
    snapshot.parts_.reserve(layers_.size());
    for (const auto& layer : layers_) snapshot.parts_.push_back(layer->copy(at));
    snapshot.pool_ = identity_;
    return snapshot;
  }

  /// Session `key`, every layer, back to `snapshot` (this pool's, of any of its sessions):
  /// copied whole before the first layer changes.
  void restore(Key key, const SessionSnapshot& snapshot) {
    constexpr const char* where = "SessionPool::restore";
    require_not_lending(where);
    const std::size_t at = static_cast<std::size_t>(keys_.position_of(key, where));
    std::vector<std::unique_ptr<detail::StagedPart>> parts = copy_of(snapshot, where);
    // Nothing below throws: moves.
    for (std::size_t l = 0; l < layers_.size(); ++l) layers_[l]->replace(at, *parts[l]);
  }

  /// Adds session `key` at the end as a copy of `snapshot` (this pool's).
  /// @return its position, size() - 1
  Eigen::Index add(Key key, const SessionSnapshot& snapshot) {
    constexpr const char* where = "SessionPool::add";
    require_not_lending(where);
    keys_.require_new(key, where);
    std::vector<std::unique_ptr<detail::StagedPart>> parts = copy_of(snapshot, where);
    return insert(key, parts);
  }

  /// Puts the sessions in the order of `order`, a permutation of keys().
  void reorder(const std::vector<Key>& order) {
    constexpr const char* where = "SessionPool::reorder";
    require_not_lending(where);
    const std::vector<std::size_t> from = keys_.permutation_of(order, where);
    std::vector<char> done(from.size());
    std::vector<Key> keys = order;
    // Nothing below allocates or throws: every layer moves its parts in place.
    for (const auto& layer : layers_) layer->permute(from, done);
    keys_.reorder(keys);
  }

  /// Clears every layer of session `key` (a new conversation under the same key).
  void reset(Key key) {
    require_not_lending("SessionPool::reset");
    const std::size_t at = static_cast<std::size_t>(keys_.position_of(key, "SessionPool::reset"));
    for (const auto& layer : layers_) layer->reset(at);
  }

  /// Session `key`'s part of layer `layer` (a batch of one sequence), to read or set.
  /// @tparam States  the layer's kind (its make_states' type); another throws
  template <class States>
  States& states(Key key, Eigen::Index layer) {
    constexpr const char* where = "SessionPool::states";
    require_not_lending(where);
    return typed<States>(layer, where).one(static_cast<std::size_t>(keys_.position_of(key, where)));
  }
  /// Read-only.
  template <class States>
  const States& states(Key key, Eigen::Index layer) const {
    constexpr const char* where = "SessionPool::states";
    require_not_lending(where);
    return const_cast<SessionPool&>(*this)
        .typed<States>(layer, where)
        .one(static_cast<std::size_t>(keys_.position_of(key, where)));
  }

  /// body(states) with the sessions named as one batch of layer `layer`'s kind, session
  /// sessions[b] its sequence b; the parts go back whatever body does.
  /// @tparam States  the layer's kind; another throws
  /// @param sessions  distinct live keys, at least one
  template <class States, class Body>
  void lend(Eigen::Index layer, const std::vector<Key>& sessions, const Body& body) {
    constexpr const char* where = "SessionPool::lend";
    require_not_lending(where);
    auto& typed_layer = typed<States>(layer, where);
    if (sessions.empty()) throw Error(std::string(where) + ": sessions is empty");
    const std::vector<std::size_t> at = keys_.positions_of(sessions, where, "sessions");
    struct Lending {
      bool& flag;
      ~Lending() { flag = false; }
    };
    lending_ = true;
    const Lending lending{lending_};
    typed_layer.lend(at, body);
  }
  /// As lend over every live session in position order.
  template <class States, class Body>
  void lend_live(Eigen::Index layer, const Body& body) {
    lend<States>(layer, keys_.keys(), body);
  }

  /// One step of every live session through layer `layer`, the model's `mixer` (the layer the
  /// pool was made with): mixer.step_into(states, args...), sequence b the session at
  /// position b. Throws if no session is live.
  template <class Layer, class... Args>
  void step_into(Eigen::Index layer, const Layer& mixer, Args&&... args) {
    lend_live<typename Layer::States>(
        layer, [&](typename Layer::States& states) { mixer.step_into(states, args...); });
  }
  /// Prompts for the sessions named through layer `layer`: mixer.prefill_into(states, args...)
  /// with sequence b the session sessions[b]. The other sessions are not touched.
  template <class Layer, class... Args>
  void prefill_into(Eigen::Index layer, const std::vector<Key>& sessions, const Layer& mixer,
                    Args&&... args) {
    lend<typename Layer::States>(layer, sessions, [&](typename Layer::States& states) {
      mixer.prefill_into(states, args...);
    });
  }

 private:
  std::size_t checked_layer(Eigen::Index layer, const char* where) const {
    return detail::checked_layer(layer, layers(), where);
  }

  template <class States>
  detail::TypedPoolLayer<States>& typed(Eigen::Index layer, const char* where) {
    detail::PoolLayer& held = *layers_[checked_layer(layer, where)];
    if (held.kind_id() != detail::pool_kind_id<States>()) {
      throw Error(std::string(where) + ": layer " + std::to_string(layer) + " holds " +
                  held.name() + ", not " + detail::SessionParts<States>::name +
                  " of this scalar type: pass the layer's own States");
    }
    return static_cast<detail::TypedPoolLayer<States>&>(held);
  }

  /// Throws while a lend's body runs: the sessions' parts are lent out then, and positions
  /// must not move under the body.
  void require_not_lending(const char* where) const {
    if (lending_) {
      throw Error(std::string(where) + ": called from inside a lend's body, while the layer's " +
                  "parts are lent out; call it after lend returns");
    }
  }

  /// A copy of every layer's part in `snapshot`, refused unless this pool took it.
  std::vector<std::unique_ptr<detail::StagedPart>> copy_of(const SessionSnapshot& snapshot,
                                                           const char* where) const {
    if (snapshot.pool_ != identity_ || snapshot.parts_.size() != layers_.size()) {
      throw Error(std::string(where) + ": the snapshot was " +
                  (snapshot.pool_ ? "taken by another pool" : "never taken (empty)") +
                  ": a pool restores only its own snapshots (another pool's layers may differ; "
                  "move sessions between pools as blobs)");
    }
    std::vector<std::unique_ptr<detail::StagedPart>> parts;
    parts.reserve(layers_.size());
    for (std::size_t l = 0; l < layers_.size(); ++l)
      parts.push_back(layers_[l]->clone(*snapshot.parts_[l]));
    return parts;
  }

  /// Every layer's part of one session from a blob, checked.
  std::vector<std::unique_ptr<detail::StagedPart>> read_session(std::istream& is,
                                                                const char* where) const {
    detail::LittleEndianReader in(is, where);
    unsigned char magic[8];
    in.get_first_bytes(magic, sizeof(magic), "the magic bytes");
    if (std::memcmp(magic, detail::kSessionMagic, sizeof(magic)) != 0) {
      throw Error(std::string(where) +
                  (std::memcmp(magic, detail::kStateMagic, sizeof(magic)) == 0
                       ? ": the bytes hold one state, not a session blob (SessionPool<>::save)"
                       : ": wrong magic bytes, not a linattn session"));
    }
    const auto version = in.get<std::uint32_t>("the format version");
    if (version < 1 || version > detail::kSessionFormatVersion) {
      throw Error(std::string(where) + ": session format version " + std::to_string(version) +
                  ", this build reads 1 to " + std::to_string(detail::kSessionFormatVersion));
    }
    const auto storage = in.get<std::uint8_t>("the storage");
    if (storage > static_cast<std::uint8_t>(SessionStorage::int8)) {
      throw Error(std::string(where) + ": unknown storage " + std::to_string(storage));
    }
    detail::require_count(in.get<std::uint32_t>("the layer count"), layers_.size(), "layer count",
                          where);
    std::vector<std::unique_ptr<detail::StagedPart>> parts;
    parts.reserve(layers_.size());
    for (std::size_t l = 0; l < layers_.size(); ++l) {
      const auto kind = in.get<std::uint8_t>("a layer's kind");
      if (kind != static_cast<std::uint8_t>(layers_[l]->kind())) {
        throw Error(std::string(where) + ": the blob's layer " + std::to_string(l) +
                    " is of kind " + std::to_string(kind) + " but this pool's holds " +
                    layers_[l]->name() + ": a session of another model");
      }
      parts.push_back(layers_[l]->load(in, static_cast<SessionStorage>(storage), where));
    }
    const std::uint32_t computed = in.checksum();
    if (in.get<std::uint32_t>("the checksum") != computed) {
      throw Error(std::string(where) + ": checksum mismatch, the session is corrupt");
    }
    return parts;
  }

  /// Appends session `key` with its staged parts. Everything that can throw happens first.
  Eigen::Index insert(Key key, std::vector<std::unique_ptr<detail::StagedPart>>& parts) {
    if (layers_.empty()) {
      throw Error("SessionPool::add: the pool has no layers; add_layer the model's layers first");
    }
    for (const auto& layer : layers_) layer->reserve_one();
    keys_.reserve_one();
    keys_.append(key);
    // Nothing below throws: moves into reserved room.
    for (std::size_t l = 0; l < layers_.size(); ++l) layers_[l]->push(*parts[l]);
    return size() - 1;
  }

  std::vector<std::unique_ptr<detail::PoolLayer>> layers_;
  detail::SessionKeys keys_;
  std::shared_ptr<const char> identity_ = std::make_shared<const char>('\0');  // snapshots' owner
  bool lending_ = false;  // a lend's body is running
};

}  // namespace linattn
