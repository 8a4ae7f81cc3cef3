// A serving loop with many concurrent sessions, each a linattn::RecurrentState persisted to
// disk.
//
// Requests arrive interleaved from many sessions (chat turns, say). The server keeps a few
// hot sessions in memory (an LRU cache); any other session is loaded from its file. After
// every request the session is saved (write-through, to a temporary file renamed over the
// old one, so a crash never leaves a half-written state). Half way through, the server
// "restarts": its memory is dropped and a fresh server continues from the files alone.
//
// The program checks that
//   * every output is bit-identical to a reference that kept every session in memory and
//     never saved or loaded anything (save/load is an exact round trip);
//   * after the restart each session file holds exactly the reference's S, z and counters;
//   * a session's memory is constant: S (C x Dv) and z (C), whatever its context length,
//     while a softmax KV cache of the same context grows by (Dk + Dv) scalars per token.
//
// The feature map is part of the model, not of the session: the file records only its
// fingerprint (for FAVOR+, a hash of W), and the options (eps, decay, ...) that change results;
// load(in, map, options) refuses a file saved with another map or other options. To decode many
// sessions in one call, see RecurrentStateBatch (its operator[] gives each session's state, to save
// and load the same way).
//
// Usage: example_streaming_sessions [sessions]   (default 64; 20 requests per session)
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <linattn/linattn.hpp>
#include <list>
#include <map>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace {

namespace fs = std::filesystem;
using State = linattn::RecurrentState<float>;
using Mat = linattn::Matrix<float>;

constexpr Eigen::Index kKeyDim = 32;    // Dk (= C with elu(x) + 1)
constexpr Eigen::Index kValueDim = 32;  // Dv

/// One request: a few tokens (already projected to q, k, v by the model) for one session.
struct Request {
  int session = 0;
  Mat q, k, v;  // tokens x Dk, tokens x Dk, tokens x Dv
};

/// Interleaved requests from `sessions` sessions, 1 to 32 tokens each, reproducible.
class Traffic {
 public:
  Traffic(int sessions, std::uint64_t seed) : rng_(seed), pick_(0, sessions - 1), length_(1, 32) {}

  Request next() {
    Request r;
    r.session = pick_(rng_);
    const Eigen::Index tokens = length_(rng_);
    r.q = random(tokens, kKeyDim);
    r.k = random(tokens, kKeyDim);
    r.v = random(tokens, kValueDim);
    return r;
  }

 private:
  Mat random(Eigen::Index rows, Eigen::Index cols) {
    Mat m(rows, cols);
    for (Eigen::Index i = 0; i < m.size(); ++i) m.data()[i] = normal_(rng_);
    return m;
  }

  std::mt19937_64 rng_;
  std::uniform_int_distribution<int> pick_;
  std::uniform_int_distribution<Eigen::Index> length_;
  std::normal_distribution<float> normal_{0.0f, 1.0f};
};

/// What the model does with a request: the tokens through the session's state (the chunked
/// prefill; a decoding step would call state.step the same way). Returns tokens x Dv.
Mat process(State& state, const Request& r, const linattn::EluPlusOne& map) {
  return state.prefill(r.q, r.k, r.v, map);
}

/// One file per session in a directory, for one model (feature map and options).
class SessionStore {
 public:
  SessionStore(fs::path dir, const linattn::EluPlusOne& map, const linattn::Options& options)
      : dir_(std::move(dir)), map_(map), options_(options) {}

  fs::path path(int session) const {
    return dir_ / ("session-" + std::to_string(session) + ".state");
  }

  /// Writes the state next to its file and renames it over the old one (atomic on POSIX).
  void save(int session, const State& state) const {
    const fs::path final_path = path(session);
    fs::path temp_path = final_path;
    temp_path += ".tmp";
    {
      std::ofstream out(temp_path, std::ios::binary | std::ios::trunc);
      state.save(out, map_);  // throws linattn::Error if the stream fails
      out.close();
      if (!out) throw std::runtime_error("cannot write " + temp_path.string());
    }
    fs::rename(temp_path, final_path);
  }

  /// The saved state, or nothing for a session never seen. A corrupt file, or one saved with
  /// another map or other options, throws linattn::Error (load checks a CRC-32 and every
  /// field).
  std::optional<State> load(int session) const {
    std::ifstream in(path(session), std::ios::binary);
    if (!in) return std::nullopt;
    return State::load(in, map_, options_);
  }

 private:
  fs::path dir_;
  linattn::EluPlusOne map_;
  linattn::Options options_;
};

/// The server: an LRU cache of hot sessions in front of the store.
class Server {
 public:
  Server(const SessionStore& store, const linattn::EluPlusOne& map, const linattn::Options& options,
         std::size_t capacity)
      : store_(store), map_(map), options_(options), capacity_(capacity) {}

  Mat handle(const Request& r) {
    State& state = acquire(r.session);
    Mat out = process(state, r, map_);
    store_.save(r.session, state);  // durable before we answer
    ++saves_;
    return out;
  }

  int loads() const { return loads_; }
  int saves() const { return saves_; }
  int hits() const { return hits_; }

 private:
  /// The session's state: from the cache, else from its file, else a new one.
  State& acquire(int session) {
    const auto found = cache_.find(session);
    if (found != cache_.end()) {
      ++hits_;
      order_.splice(order_.begin(), order_, found->second.second);  // most recent first
      return found->second.first;
    }
    std::optional<State> loaded = store_.load(session);
    if (loaded) ++loads_;
    State state = loaded ? std::move(*loaded) : State(kKeyDim, kValueDim, options_);
    if (cache_.size() >= capacity_) {  // evict the least recent (already on disk)
      cache_.erase(order_.back());
      order_.pop_back();
    }
    order_.push_front(session);
    return cache_.emplace(session, std::make_pair(std::move(state), order_.begin()))
        .first->second.first;
  }

  const SessionStore& store_;
  linattn::EluPlusOne map_;
  linattn::Options options_;
  std::size_t capacity_;
  std::list<int> order_;
  std::unordered_map<int, std::pair<State, std::list<int>::iterator>> cache_;
  int loads_ = 0, saves_ = 0, hits_ = 0;
};

bool same_bits(const Mat& a, const Mat& b) {
  return a.rows() == b.rows() && a.cols() == b.cols() &&
         std::memcmp(a.data(), b.data(), sizeof(float) * static_cast<std::size_t>(a.size())) == 0;
}

bool same_state(const State& a, const State& b) {
  const double log_a = a.log_scale(), log_b = b.log_scale();
  return a.tokens() == b.tokens() && a.options().decay == b.options().decay &&
         a.options().eps == b.options().eps && std::memcmp(&log_a, &log_b, sizeof(double)) == 0 &&
         a.s().rows() == b.s().rows() && a.s().cols() == b.s().cols() &&
         a.z().size() == b.z().size() &&
         std::memcmp(a.s().data(), b.s().data(),
                     sizeof(float) * static_cast<std::size_t>(a.s().size())) == 0 &&
         std::memcmp(a.z().data(), b.z().data(),
                     sizeof(float) * static_cast<std::size_t>(a.z().size())) == 0;
}

/// Bytes of a state's sums: S (C x Dv) and z (C).
std::size_t state_bytes(const State& s) {
  return sizeof(float) * static_cast<std::size_t>(s.s().size() + s.z().size());
}

/// A fresh directory under the system temp dir, removed (with its files) on scope exit.
class TempDir {
 public:
  TempDir() {
    std::random_device entropy;
    path_ = fs::temp_directory_path() /
            ("linattn-sessions-" + std::to_string(entropy()) + std::to_string(entropy()));
    fs::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ignored;
    fs::remove_all(path_, ignored);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const fs::path& path() const { return path_; }

 private:
  fs::path path_;
};

}  // namespace

int main(int argc, char** argv) {
  const int sessions = argc > 1 ? std::atoi(argv[1]) : 64;
  if (sessions < 1) {
    std::fprintf(stderr, "usage: %s [sessions >= 1]\n", argv[0]);
    return 2;
  }
  const int requests = 20 * sessions;
  const std::size_t cache_capacity = 16;  // hot sessions kept in memory
  linattn::Options options;
  options.decay = 0.999;  // recorded with each state and checked when it loads
  const linattn::EluPlusOne map;
  bool ok = true;

  try {
    const TempDir dir;
    const SessionStore store(dir.path(), map, options);
    std::optional<Server> server(std::in_place, store, map, options, cache_capacity);

    // The reference: every session in memory, never saved, plus the KV cache a softmax model
    // would keep for the same tokens (keys and values appended, for its bytes()).
    std::map<int, State> reference;
    std::map<int, linattn::SoftmaxKVCache<float>> kv_cache;
    Traffic traffic(sessions, /*seed=*/2024);
    int mismatches = 0;
    int saves = 0, loads = 0, hits = 0;  // over both server lifetimes
    auto count = [&](const Server& s) {
      saves += s.saves();
      loads += s.loads();
      hits += s.hits();
    };
    std::size_t first_state_bytes = 0;
    std::uintmax_t first_file_bytes = 0;

    std::printf("%d sessions, %d requests, %zu hot sessions cached, files in %s\n", sessions,
                requests, cache_capacity, dir.path().string().c_str());
    std::printf("%8s | %16s | %8s | %8s | %10s | %14s\n", "requests", "session 0 tokens", "S bytes",
                "z bytes", "file bytes", "KV cache bytes");
    for (int i = 0; i < requests; ++i) {
      if (i == requests / 2) {
        // Simulated restart: the server's memory is gone, only the files remain.
        count(*server);
        server.reset();
        int restored = 0;
        for (const auto& [id, ref] : reference) {
          const std::optional<State> loaded = store.load(id);
          if (!loaded || !same_state(*loaded, ref)) {
            std::printf("FAIL: session %d does not load back as saved\n", id);
            ok = false;
          }
          ++restored;
        }
        std::printf("-- restart: %d session files restored bit for bit: %s --\n", restored,
                    ok ? "yes" : "NO");
        server.emplace(store, map, options, cache_capacity);
      }

      const Request r = traffic.next();
      const Mat served = server->handle(r);
      State& ref = reference.try_emplace(r.session, kKeyDim, kValueDim, options).first->second;
      const Mat expected = process(ref, r, map);
      if (!same_bits(served, expected)) ++mismatches;
      kv_cache.try_emplace(r.session, kKeyDim, kValueDim).first->second.append(r.k, r.v);

      if ((i + 1) % (requests / 8 > 0 ? requests / 8 : 1) == 0 && reference.count(0) != 0) {
        const State& s0 = reference.at(0);
        const std::uintmax_t file_bytes = fs::file_size(store.path(0));
        if (first_state_bytes == 0) {
          first_state_bytes = state_bytes(s0);
          first_file_bytes = file_bytes;
        }
        if (state_bytes(s0) != first_state_bytes || file_bytes != first_file_bytes) ok = false;
        std::printf("%8d | %16lld | %8zu | %8zu | %10ju | %14zu\n", i + 1,
                    static_cast<long long>(s0.tokens()),
                    sizeof(float) * static_cast<std::size_t>(s0.s().size()),
                    sizeof(float) * static_cast<std::size_t>(s0.z().size()), file_bytes,
                    kv_cache.at(0).bytes());
      }
    }

    // Every session: constant state size, and the cache's size is what the formula says.
    std::int64_t longest = 0;
    for (const auto& [id, ref] : reference) {
      longest = std::max(longest, ref.tokens());
      const std::size_t kv = kv_cache.at(id).bytes();
      if (state_bytes(ref) != sizeof(float) * (kKeyDim * kValueDim + kKeyDim) ||
          kv != sizeof(float) * static_cast<std::size_t>(ref.tokens()) * (kKeyDim + kValueDim)) {
        ok = false;
      }
    }
    count(*server);
    std::printf("server: %d saves, %d loads from disk, %d cache hits\n", saves, loads, hits);
    std::printf(
        "per session: S + z = %zu bytes at any context; a softmax KV cache holds %zu "
        "bytes per token (%zu at the longest session's %lld tokens)\n",
        sizeof(float) * (kKeyDim * kValueDim + kKeyDim), sizeof(float) * (kKeyDim + kValueDim),
        sizeof(float) * static_cast<std::size_t>(longest) * (kKeyDim + kValueDim),
        static_cast<long long>(longest));
    std::printf("outputs bit-identical to never-saved sessions: %s (%d of %d requests differ)\n",
                mismatches == 0 ? "yes" : "NO", mismatches, requests);
    if (mismatches != 0) ok = false;
  } catch (const std::exception& e) {
    std::printf("FAIL: %s\n", e.what());
    return 1;
  }
  std::printf("%s\n", ok ? "OK" : "FAILED");
  return ok ? 0 : 1;
}
