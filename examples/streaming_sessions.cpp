// A session server over SQLite, and a test that kills it with SIGKILL hundreds of times.
//
// A chat server keeps each conversation's state between turns. Here every live session's
// states sit in one linattn::SessionPool<> over a hybrid model (linear attention, softmax
// attention with its growing KV caches, a Gated DeltaNet mixer with its convolution windows),
// and each session has one row in a SQLite database in WAL mode: its whole state as one blob
// (every layer, one CRC-32), the blob's format version,
// the tokens it has seen and a digest of every output it has produced. A request (a turn of 1
// to 8 tokens for one session) runs through the pool, then ONE transaction writes the
// session's row and the index of the next request. Whenever the server dies, the database
// holds a request boundary: the transaction committed (the row is after the request, and the
// next request is the one after it) or it did not (the row is before it, and the restarted
// server runs the request again, from the same state, to the same outputs bit for bit).
//
// The crash test checks exactly that. It runs an uninterrupted reference server to the end,
// then, in a second database, starts a server in a child process and kills it (kill -9) after
// a random delay of 0-30 ms, over and over (a database whose requests are all served starts
// again from empty); after every kill it opens the database and checks every row:
// the blob loads (linattn's add_bytes refuses a torn or corrupt session: its CRC-32 and every
// field are checked), and its bytes, tokens and digest are bit for bit those of the session
// replayed from scratch to exactly the request boundary that the stored next-request index
// implies. At the end a server runs to completion and every row must equal the reference's:
// outputs that continued across hundreds of crashes are the outputs of a server that never
// crashed.
//
// The model: three layers over rows of 64 floats (H = 4 heads of 16), each layer's inputs
// the previous layer's outputs through fixed matrices.
//   layer 0: RetNet-style retention, elu(x) + 1 features, a fixed decay per head
//            (1 - 2^(-5-h)), unnormalised
//   layer 1: softmax attention over every token of the session: 2 heads of 8 (a KV cache
//            each, 64 bytes a token in all), its output projected back to 64
//   layer 2: Qwen3.5's Gated DeltaNet mixer (2 q/k heads over 4 v heads of 16, a causal
//            convolution of 4 taps whose last 3 inputs are part of the session's state)
// Token t of session s comes from a seed made of (s, t), and request i (which session, how
// many tokens) from i alone, so anyone can replay any session from scratch.
//
// Usage:
//   example_streaming_sessions                           a short self-check: the crash test in a
//                                                        temporary directory, 20 kills
//   example_streaming_sessions serve <db> <requests>     serves requests until <requests> are
//                                                        done; restartable at any point
//   example_streaming_sessions crash-test <dir> <kills>  the crash test, databases in <dir>
//
// POSIX only (fork, kill, waitpid); CMake builds it when SQLite is found
// (LINATTN_EXAMPLES_SQLITE; Debian: apt-get install libsqlite3-dev).
#include <sqlite3.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <linattn/linattn.hpp>
#include <list>
#include <map>
#include <new>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

namespace {

using Batch = linattn::RecurrentStateBatch<float>;
using Caches = linattn::KVCacheBatch<float>;
using Pool = linattn::SessionPool<>;
using Key = Pool::Key;
using Mat = linattn::Matrix<float>;  // row-major: one row per token
using View = linattn::HeadsView<const float>;
using OutView = linattn::HeadsView<float>;
using Clock = std::chrono::steady_clock;

constexpr Eigen::Index kHeads = 4;
constexpr Eigen::Index kDim = 16;               // Dk = C (elu(x) + 1 keeps the size) = Dv
constexpr Eigen::Index kWidth = kHeads * kDim;  // a token's row: its H heads side by side
constexpr Eigen::Index kAttentionHeads = 2, kAttentionDim = 8;  // the softmax layer's
constexpr Eigen::Index kAttentionWidth = kAttentionHeads * kAttentionDim;
constexpr Key kSessions = 12;              // conversations in the traffic
constexpr Eigen::Index kMaxTokens = 8;     // tokens per request: 1 to 8
constexpr Eigen::Index kLiveSessions = 4;  // sessions the server keeps in its pool
constexpr std::int64_t kFormat = 2;        // the model's layers, see Blob below
constexpr std::int64_t kCrashTestRequests = 1200;

// --- Deterministic inputs: a session is replayable from its number alone ---

/// SplitMix64: a tiny generator whose numbers are the same on every platform.
std::uint64_t next_random(std::uint64_t& x) {
  std::uint64_t z = (x += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

/// Uniform in [-1, 1), from 24 random bits: exact in float, the same everywhere.
float next_uniform(std::uint64_t& x) {
  return static_cast<float>(next_random(x) >> 40) * 0x1p-23f - 1.0f;
}

/// One request: a turn of `tokens` tokens for session `session`.
struct Request {
  Key session;
  Eigen::Index tokens;
};

/// Request i of the traffic: half go to three hot sessions, half spread over all of them, so
/// the server's pool both hits and evicts.
Request request(std::int64_t i) {
  std::uint64_t seed = 0x5E55105ull ^ static_cast<std::uint64_t>(i);
  const std::uint64_t r = next_random(seed);
  const Key session = static_cast<Key>((r & 1) != 0 ? (r >> 8) % 3 : (r >> 8) % kSessions);
  return {session, 1 + static_cast<Eigen::Index>((r >> 40) % kMaxTokens)};
}

// --- The model ---

/// Three layers of three kinds and the fixed projections between them. It owns no session
/// state: the pool holds that, so one model serves any number of sessions.
class Model {
 public:
  Model()
      : retention_(linattn::EluPlusOne{}, kHeads, kDim, kDim, retention_decays(),
                   retention_options()),
        attention_(1, kAttentionHeads, kAttentionDim, kAttentionDim),
        mixer_(mixer_shape(), mixer_weights(), mixer_options()),
        w_q_(projection(1, kAttentionWidth)),
        w_k_(projection(2, kAttentionWidth)),
        w_v_(projection(3, kAttentionWidth)),
        w_o_(projection(6, kWidth).topRows(kAttentionWidth)),
        w_mixer_(projection(4, mixer_width())) {}

  /// A pool for this model: each session holds what its three layers make (layer 0's H
  /// states, layer 1's H KV caches, layer 2's convolution window and 4 delta-rule states).
  Pool make_pool() const { return Pool(retention_, attention_, mixer_); }

  /// Tokens session `key` has seen (its retention states count them).
  static std::int64_t tokens(const Pool& pool, Key key) {
    return pool.states<Batch>(key, 0)[0].tokens();
  }

  /// Runs tokens first .. first + n - 1 of session `key`, live in `pool`, through the three
  /// layers and returns the mixer's outputs (n x 64). A turn's tokens arrive together, so
  /// layers 0 and 2 take them in one pool call for this session (the chunked form, which
  /// leaves the states where stepping each token would); the softmax layer steps its caches
  /// token by token. The pool's other sessions are not touched.
  Mat run(Pool& pool, Key key, std::int64_t first, Eigen::Index n) const {
    Mat q(n, kWidth), k(n, kWidth), v(n, kWidth);
    for (Eigen::Index t = 0; t < n; ++t) {
      std::uint64_t seed = 0xC0FFEEull ^ (static_cast<std::uint64_t>(key) << 40) ^
                           static_cast<std::uint64_t>(first + t);
      for (Mat* x : {&q, &k, &v}) {
        for (Eigen::Index j = 0; j < kWidth; ++j) (*x)(t, j) = next_uniform(seed);
      }
    }
    const linattn::BnhdShape heads(1, n, kHeads, kDim);
    Mat retained(n, kWidth), attended(n, kWidth), out(n, kWidth);
    pool.prefill_into(0, {key}, retention_, View::bnhd(q.data(), heads),
                      View::bnhd(k.data(), heads), View::bnhd(v.data(), heads),
                      OutView::bnhd(retained.data(), heads));
    Mat heads_out(n, kAttentionWidth);
    softmax(pool, key, retained * w_q_, retained * w_k_, retained * w_v_, heads_out);
    attended.noalias() = heads_out * w_o_;
    // The mixer's four projections as one GEMM, read in place: [qkv | z | b | a] per token.
    const Mat fused = attended * w_mixer_;
    const linattn::GatedDeltaNetShape shape = mixer_shape();
    const Eigen::Index c = shape.conv_channels(), hv = shape.value_heads, w = fused.cols();
    const auto view = [&](Eigen::Index column, Eigen::Index heads_in_view, Eigen::Index dim) {
      return View(fused.data() + column, 1, heads_in_view, n, dim,
                  linattn::HeadStrides{n * w, dim, w, 1});
    };
    pool.prefill_into(
        2, {key}, mixer_,
        linattn::GatedDeltaNetInputs<float>{view(0, 1, c), view(c, hv, shape.value_dim),
                                            view(c + shape.value_channels(), hv, 1),
                                            view(c + shape.value_channels() + hv, hv, 1)},
        OutView::bnhd(out.data(), heads));
    return out;
  }

 private:
  using Layer = linattn::LinearAttentionLayer<float, linattn::EluPlusOne>;

  // One thread: H = 4 heads of 16 gain nothing from more, and the crash test forks, which an
  // OpenMP program's thread pool does not survive.
  static linattn::Options retention_options() {
    linattn::Options retention;
    retention.normalize = false;   // RetNet reads the state without a denominator...
    retention.scale = 1.0 / kDim;  // ...so a scale keeps its outputs moderate
    retention.threads = 1;
    return retention;
  }
  static linattn::HeadDecays retention_decays() {
    linattn::HeadDecays decays;
    for (Eigen::Index h = 0; h < kHeads; ++h)
      decays.values.push_back(1.0 - std::ldexp(1.0, -5 - static_cast<int>(h)));
    return decays;
  }
  static linattn::GatedDeltaNetShape mixer_shape() {
    linattn::GatedDeltaNetShape shape;  // Qwen3.5's layout, small: 2 q/k heads, 4 v heads
    shape.key_heads = 2;
    shape.value_heads = kHeads;
    shape.key_dim = kDim;
    shape.value_dim = kDim;
    shape.conv_kernel = 4;
    return shape;
  }
  static Eigen::Index mixer_width() {
    const linattn::GatedDeltaNetShape shape = mixer_shape();
    return shape.conv_channels() + shape.value_channels() + 2 * shape.value_heads;
  }
  static linattn::GatedDeltaNetWeights<float> mixer_weights() {
    const linattn::GatedDeltaNetShape shape = mixer_shape();
    linattn::GatedDeltaNetWeights<float> w;
    w.conv_weight.resize(shape.conv_channels(), shape.conv_kernel);
    std::uint64_t seed = 5;
    for (Eigen::Index i = 0; i < w.conv_weight.size(); ++i)
      w.conv_weight.data()[i] = 0.5f * next_uniform(seed);
    w.a_log = linattn::Vector<float>::Constant(shape.value_heads, -1.0f);
    w.dt_bias = linattn::Vector<float>::Ones(shape.value_heads);
    w.norm_weight = linattn::Vector<float>::Ones(shape.value_dim);
    return w;
  }
  static linattn::GatedDeltaNetOptions mixer_options() {
    linattn::GatedDeltaNetOptions options;
    options.threads = 1;
    return options;
  }

  /// The softmax layer for session `key`: each token attends over every token cached for it.
  void softmax(Pool& pool, Key key, const Mat& q, const Mat& k, const Mat& v, Mat& out) const {
    constexpr Eigen::Index d = kAttentionDim;
    pool.lend<Caches>(1, {key}, [&](Caches& caches) {
      linattn::Vector<float> head(d);
      for (Eigen::Index t = 0; t < q.rows(); ++t) {
        for (Eigen::Index h = 0; h < kAttentionHeads; ++h) {
          caches.cache(0, h).step_into(q.block(t, h * d, 1, d), k.block(t, h * d, 1, d),
                                       v.block(t, h * d, 1, d), head);
          out.block(t, h * d, 1, d) = head.transpose();
        }
      }
    });
  }

  /// A fixed 64 x cols matrix, uniform entries scaled to keep the rows' size.
  static Mat projection(std::uint64_t seed, Eigen::Index cols) {
    Mat w(kWidth, cols);
    for (Eigen::Index i = 0; i < w.size(); ++i) {
      w.data()[i] = next_uniform(seed) * (1.7f / std::sqrt(static_cast<float>(kWidth)));
    }
    return w;
  }

  Layer retention_;   // layer 0: RetNet's multi-scale decays, no denominator
  Caches attention_;  // layer 1: softmax attention's KV caches (one session's shape)
  linattn::GatedDeltaNet<float> mixer_;  // layer 2
  Mat w_q_, w_k_, w_v_;                  // layer 1's q, k, v from layer 0's outputs
  Mat w_o_;                              // layer 1's heads back to 64
  Mat w_mixer_;                          // layer 2's projections from layer 1's outputs
};

/// FNV-1a over the bits of every output, in order: two runs share a digest only when every
/// output they produced is the same, bit for bit.
constexpr std::uint64_t kFnvBasis = 0xCBF29CE484222325ull;
std::uint64_t digest(std::uint64_t hash, const Mat& out) {
  for (Eigen::Index i = 0; i < out.size(); ++i) {
    std::uint32_t bits = 0;
    std::memcpy(&bits, out.data() + i, sizeof bits);
    for (int byte = 0; byte < 4; ++byte) {
      hash = (hash ^ ((bits >> (8 * byte)) & 0xFFu)) * 0x100000001B3ull;
    }
  }
  return hash;
}

// --- A session as a blob ---

/// A session's blob: SessionPool<>::save_bytes, every layer of the session (layer 0's states,
/// layer 1's KV caches, layer 2's window and states) under one CRC-32, the session format
/// versioned by linattn. SessionPool<>::add_bytes reads it back in place and checks it whole
/// (a torn, corrupt or truncated blob, or one of another model shape or saved with other
/// options or another map, throws linattn::Error) before the session joins the pool. kFormat
/// names the model's layers (1: the two linear layers of an earlier version of this example),
/// so that a server refuses a row of another model with its own message.
using Blob = std::vector<std::uint8_t>;

// --- SQLite: one row per session, one transaction per request ---

/// Throws SQLite's own message unless `rc` is SQLITE_OK.
void check(sqlite3* db, int rc, const char* what) {
  if (rc != SQLITE_OK) {
    throw std::runtime_error(std::string("sqlite: ") + what + ": " + sqlite3_errmsg(db));
  }
}

/// The connection, closed last (after every statement on it is finalized).
class Connection {
 public:
  explicit Connection(const std::string& path) {
    const int rc =
        sqlite3_open_v2(path.c_str(), &db_, SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE, nullptr);
    if (rc != SQLITE_OK) {
      const std::string message = db_ ? sqlite3_errmsg(db_) : sqlite3_errstr(rc);
      sqlite3_close(db_);
      throw std::runtime_error("sqlite: cannot open '" + path + "': " + message);
    }
  }
  ~Connection() {
    // Fails only while a statement is unfinalized, which the members' order rules out.
    if (sqlite3_close(db_) != SQLITE_OK) {
      std::fprintf(stderr, "sqlite: close: %s\n", sqlite3_errmsg(db_));
      std::abort();
    }
  }
  Connection(const Connection&) = delete;
  Connection& operator=(const Connection&) = delete;
  sqlite3* get() const { return db_; }

  /// Runs SQL that returns no rows.
  void exec(const char* sql) const {
    check(db_, sqlite3_exec(db_, sql, nullptr, nullptr, nullptr), sql);
  }

 private:
  sqlite3* db_ = nullptr;
};

/// A prepared statement, reused for every request.
class Statement {
 public:
  Statement(const Connection& db, const char* sql) : db_(db.get()), sql_(sql) {
    check(db_, sqlite3_prepare_v2(db_, sql, -1, &stmt_, nullptr), sql_);
  }
  ~Statement() { sqlite3_finalize(stmt_); }  // repeats the last step's error, checked there
  Statement(const Statement&) = delete;
  Statement& operator=(const Statement&) = delete;

  Statement& bind(int i, std::int64_t value) {
    check(db_, sqlite3_bind_int64(stmt_, i, value), sql_);
    return *this;
  }
  /// Binds a blob without a copy: `bytes` must live until the statement has run.
  Statement& bind(int i, const Blob& bytes) {
    check(db_,
          sqlite3_bind_blob(stmt_, i, bytes.data(), static_cast<int>(bytes.size()), SQLITE_STATIC),
          sql_);
    return *this;
  }

  /// The next row: true while there is one, false when done (then ready to run again).
  bool step() {
    const int rc = sqlite3_step(stmt_);
    if (rc == SQLITE_ROW) return true;
    if (rc != SQLITE_DONE) check(db_, rc, sql_);
    check(db_, sqlite3_reset(stmt_), sql_);
    return false;
  }
  /// Runs a statement that returns no rows.
  void run() {
    if (step()) throw std::runtime_error(std::string("sqlite: unexpected row from ") + sql_);
  }

  std::int64_t integer(int column) const { return sqlite3_column_int64(stmt_, column); }
  std::string text(int column) const {
    const unsigned char* chars = sqlite3_column_text(stmt_, column);
    return chars ? reinterpret_cast<const char*>(chars) : "";
  }
  Blob blob(int column) const {
    const auto* data = static_cast<const std::uint8_t*>(sqlite3_column_blob(stmt_, column));
    return data ? Blob(data, data + sqlite3_column_bytes(stmt_, column)) : Blob();
  }

 private:
  sqlite3* db_;
  const char* sql_;
  sqlite3_stmt* stmt_ = nullptr;
};

/// A session's row.
struct Row {
  Key id = 0;
  std::int64_t format = 0;   // the blob's layout, kFormat
  std::int64_t tokens = 0;   // tokens seen
  std::uint64_t digest = 0;  // FNV-1a of every output so far (stored as the signed 64-bit integer
                             // with the same bits)
  Blob state;                // SessionPool::save_bytes
};

/// The server's database: sessions(id, format, tokens, digest, state) and the index of the
/// next request in meta.
class Database {
 public:
  explicit Database(const std::string& path) : db_(path) {
    // WAL: a commit appends the changed pages and a commit record to the log, and readers
    // ignore frames after the last commit record, so a process killed at any instant leaves
    // every transaction whole or absent. journal_mode answers with the mode in force ("wal"
    // unless the file system cannot share memory between processes).
    {
      Statement mode(db_, "PRAGMA journal_mode=WAL");
      const std::string in_force = mode.step() ? mode.text(0) : "";
      if (in_force != "wal") {
        throw std::runtime_error("sqlite: '" + path + "' cannot use WAL mode (journal_mode is '" +
                                 in_force + "')");
      }
      mode.step();  // done
    }
    // NORMAL syncs the log to disk at checkpoints only: a commit survives a killed process (the
    // kernel holds its pages), but the last commits before a power loss may be lost, never torn.
    // FULL adds durability on power loss at the cost of an fsync per request.
    db_.exec("PRAGMA synchronous=NORMAL");
    // The schema in one transaction, so a server killed while creating it leaves none.
    db_.exec(
        "BEGIN IMMEDIATE;"
        "CREATE TABLE IF NOT EXISTS sessions(id INTEGER PRIMARY KEY, format INTEGER NOT NULL,"
        " tokens INTEGER NOT NULL, digest INTEGER NOT NULL, state BLOB NOT NULL);"
        "CREATE TABLE IF NOT EXISTS meta(name TEXT PRIMARY KEY, value INTEGER NOT NULL);"
        "INSERT OR IGNORE INTO meta VALUES('next_request', 0);"
        "COMMIT");
    select_next_.emplace(db_, "SELECT value FROM meta WHERE name = 'next_request'");
    update_next_.emplace(db_, "UPDATE meta SET value = ? WHERE name = 'next_request'");
    select_row_.emplace(db_, "SELECT id, format, tokens, digest, state FROM sessions WHERE id = ?");
    select_rows_.emplace(db_, "SELECT id, format, tokens, digest, state FROM sessions ORDER BY id");
    put_row_.emplace(db_,
                     "INSERT OR REPLACE INTO sessions(id, format, tokens, digest, state) "
                     "VALUES(?, ?, ?, ?, ?)");
  }

  /// The index of the first request not committed yet.
  std::int64_t next_request() {
    if (!select_next_->step()) throw std::runtime_error("sqlite: meta has no next_request");
    const std::int64_t next = select_next_->integer(0);
    select_next_->step();  // done
    return next;
  }

  /// Session `id`'s row, or nothing for a session never served.
  std::optional<Row> row(Key id) {
    select_row_->bind(1, id);
    if (!select_row_->step()) return std::nullopt;
    Row row = read(*select_row_);
    select_row_->step();  // done (id is the primary key)
    return row;
  }

  /// Every row, by id.
  std::vector<Row> rows() {
    std::vector<Row> rows;
    while (select_rows_->step()) rows.push_back(read(*select_rows_));
    return rows;
  }

  /// Writes a session's row and the next request's index in one transaction: a crash leaves
  /// both or neither. BEGIN IMMEDIATE takes the write lock up front (no upgrade that could
  /// fail half way).
  void commit(const Row& row, std::int64_t next_request) {
    db_.exec("BEGIN IMMEDIATE");
    try {
      put_row_->bind(1, row.id)
          .bind(2, row.format)
          .bind(3, row.tokens)
          .bind(4, static_cast<std::int64_t>(row.digest))
          .bind(5, row.state)
          .run();
      update_next_->bind(1, next_request).run();
      db_.exec("COMMIT");
    } catch (...) {
      // Best effort: the error that brought us here is the one to report.
      sqlite3_exec(db_.get(), "ROLLBACK", nullptr, nullptr, nullptr);
      throw;
    }
  }

 private:
  static Row read(const Statement& s) {
    return Row{s.integer(0), s.integer(1), s.integer(2), static_cast<std::uint64_t>(s.integer(3)),
               s.blob(4)};
  }

  Connection db_;  // first: destroyed after the statements
  std::optional<Statement> select_next_, update_next_, select_row_, select_rows_, put_row_;
};

// --- The server ---

/// Where a server is, for the crash test to see where each kill landed.
enum class Phase : int { starting, between, loading, computing, committing };
constexpr int kPhases = 5;
const char* const kPhaseNames[kPhases] = {"starting up", "between requests", "loading a session",
                                          "computing", "in the transaction"};

/// Serves requests in order, each committed before the next one starts. Sessions stay live in
/// the pool after their request (the next turn of a conversation comes soon); when kLiveSessions
/// are live and another one is needed, the least recently served one is dropped, which costs
/// nothing: its row was written when its request ended.
class Server {
 public:
  Server(const Model& model, Database& db) : model_(model), db_(db), pool_(model.make_pool()) {}

  /// Reports each phase to `phase` (the crash test's shared memory), or to nowhere.
  void watch(std::atomic<int>* phase) { phase_ = phase; }

  /// Makes requests arrive over time, as clients send them, in bursts: before one request in
  /// 16 the server waits up to `most` for the next burst (0: every request is waiting already).
  void pace(std::chrono::microseconds most) { pace_ = most; }

  /// Serves from the database's next request until `requests` are done.
  void run(std::int64_t requests) {
    mark(Phase::starting);
    for (std::int64_t i = db_.next_request(); i < requests; ++i) {
      std::uint64_t seed = static_cast<std::uint64_t>(i);
      const std::uint64_t r = next_random(seed);
      if (pace_.count() > 0 && r % 16 == 0) {
        mark(Phase::between);
        const auto wait = (r >> 8) % static_cast<std::uint64_t>(pace_.count() + 1);
        std::this_thread::sleep_for(std::chrono::microseconds(wait));
      }
      serve(i);
    }
  }

  std::int64_t served() const { return served_; }
  std::int64_t loads() const { return loads_; }
  std::int64_t hits() const { return hits_; }

 private:
  void serve(std::int64_t index) {
    const Request r = request(index);
    std::uint64_t& hash = make_live(r.session);
    try {
      mark(Phase::computing);
      const std::int64_t seen = Model::tokens(pool_, r.session);
      const Mat out = model_.run(pool_, r.session, seen, r.tokens);
      const Row row{r.session, kFormat, seen + r.tokens, digest(hash, out),
                    pool_.save_bytes(r.session)};
      mark(Phase::committing);
      db_.commit(row, index + 1);
      mark(Phase::between);
      hash = row.digest;
    } catch (...) {
      forget(r.session);  // its states may be ahead of its row: the next request reloads it
      throw;
    }
    ++served_;
  }

  /// Session `key` live in the pool, from its row if it has one; returns its running digest.
  std::uint64_t& make_live(Key key) {
    const auto live = digests_.find(key);
    if (live != digests_.end()) {
      recent_.remove(key);
      recent_.push_front(key);
      ++hits_;
      return live->second;
    }
    mark(Phase::loading);
    while (pool_.size() >= kLiveSessions) forget(recent_.back());
    std::uint64_t hash = kFnvBasis;
    const std::optional<Row> row = db_.row(key);
    if (!row) {
      pool_.add(key);  // a new session: fresh states
    } else {
      if (row->format != kFormat) {
        throw std::runtime_error("session " + std::to_string(key) + ": blob format " +
                                 std::to_string(row->format) + ", this server reads " +
                                 std::to_string(kFormat));
      }
      // Checked whole before the session is added: a refused blob leaves the pool as it was.
      pool_.add_bytes(key, row->state.data(), row->state.size());
      if (Model::tokens(pool_, key) != row->tokens) {
        const std::int64_t held = Model::tokens(pool_, key);
        pool_.drop(key);
        throw std::runtime_error("session " + std::to_string(key) + ": the row says " +
                                 std::to_string(row->tokens) + " tokens, its states " +
                                 std::to_string(held));
      }
      hash = row->digest;
      ++loads_;
    }
    recent_.push_front(key);
    return digests_.emplace(key, hash).first->second;
  }

  /// Drops a live session from memory; its row stays.
  void forget(Key key) {
    pool_.drop(key);
    digests_.erase(key);
    recent_.remove(key);
  }

  void mark(Phase phase) {
    if (phase_) phase_->store(static_cast<int>(phase), std::memory_order_relaxed);
  }

  const Model& model_;
  Database& db_;
  Pool pool_;                                       // the live sessions' states
  std::unordered_map<Key, std::uint64_t> digests_;  // the live sessions' running digests
  std::list<Key> recent_;                           // live sessions, most recently served first
  std::atomic<int>* phase_ = nullptr;
  std::chrono::microseconds pace_{0};
  std::int64_t served_ = 0, loads_ = 0, hits_ = 0;
};

// --- The check: every row against a replay from scratch ---

/// Every session replayed from scratch, alone in a pool of its own, its tokens regenerated
/// from their seeds: no database, no eviction, no save or load. After each of its requests it
/// records what the session's row must then hold.
class Replay {
 public:
  struct Boundary {
    std::int64_t request;            // the session's last request so far
    std::int64_t tokens;             // tokens seen after it
    std::uint64_t digest;            // of every output up to it
    std::vector<std::uint8_t> blob;  // the session's whole state
  };

  Replay(const Model& model, std::int64_t requests) {
    std::map<Key, Pool> pools;
    for (std::int64_t i = 0; i < requests; ++i) {
      const Request r = request(i);
      auto [at, fresh] = pools.try_emplace(r.session, model.make_pool());
      Pool& pool = at->second;
      if (fresh) pool.add(r.session);
      std::vector<Boundary>& done = boundaries_[r.session];
      const std::int64_t seen = done.empty() ? 0 : done.back().tokens;
      const std::uint64_t before = done.empty() ? kFnvBasis : done.back().digest;
      const Mat out = model.run(pool, r.session, seen, r.tokens);
      done.push_back({i, seen + r.tokens, digest(before, out), pool.save_bytes(r.session)});
    }
  }

  /// What session `key`'s row must hold once requests 0 .. next - 1 have committed: its state
  /// after the last of them that named it, or nothing (no row) when none did.
  const Boundary* expected(Key key, std::int64_t next) const {
    const Boundary* last = nullptr;
    const auto found = boundaries_.find(key);
    if (found == boundaries_.end()) return nullptr;
    for (const Boundary& b : found->second) {
      if (b.request < next) last = &b;
    }
    return last;
  }

  /// The boundary at which session `key` has seen `tokens` tokens, or nothing: a row with any
  /// other count stopped inside a request.
  const Boundary* at_tokens(Key key, std::int64_t tokens) const {
    const auto found = boundaries_.find(key);
    if (found == boundaries_.end()) return nullptr;
    for (const Boundary& b : found->second) {
      if (b.tokens == tokens) return &b;
    }
    return nullptr;
  }

 private:
  std::map<Key, std::vector<Boundary>> boundaries_;
};

/// Checks every row of the database at `path` against the replay, printing each failure.
/// Returns the number of failures; `next` receives the stored next-request index.
int check_database(const std::string& path, const Model& model, const Replay& replay,
                   std::int64_t& next) {
  int failures = 0;
  const auto fail = [&](Key id, const std::string& what) {
    std::printf("FAIL: %s: session %lld: %s\n", path.c_str(), static_cast<long long>(id),
                what.c_str());
    ++failures;
  };
  Database db(path);
  next = db.next_request();
  std::vector<bool> has_row(static_cast<std::size_t>(kSessions), false);
  for (const Row& row : db.rows()) {
    if (row.id < 0 || row.id >= kSessions) {
      fail(row.id, "no such session");
      continue;
    }
    has_row[static_cast<std::size_t>(row.id)] = true;
    if (row.format != kFormat) fail(row.id, "format " + std::to_string(row.format));
    Pool pool = model.make_pool();
    try {
      pool.add_bytes(row.id, row.state.data(), row.state.size());  // never torn
    } catch (const std::exception& e) {
      fail(row.id, std::string("the blob does not load: ") + e.what());
      continue;
    }
    const Replay::Boundary* at = replay.at_tokens(row.id, row.tokens);
    const Replay::Boundary* expected = replay.expected(row.id, next);
    if (at == nullptr) {
      fail(row.id, std::to_string(row.tokens) + " tokens: not at the end of any of its requests");
    } else if (at != expected) {
      fail(row.id, "its row ends at request " + std::to_string(at->request) + " but next_request " +
                       std::to_string(next) + " says request " +
                       (expected ? std::to_string(expected->request) : std::string("none")));
    } else {
      if (Model::tokens(pool, row.id) != row.tokens) fail(row.id, "tokens differ from its states'");
      if (pool.save_bytes(row.id) != at->blob) fail(row.id, "states differ from the replay's");
      if (row.digest != at->digest) fail(row.id, "the digest differs from the replay's outputs'");
    }
  }
  for (Key id = 0; id < kSessions; ++id) {
    const Replay::Boundary* expected = replay.expected(id, next);
    if (!has_row[static_cast<std::size_t>(id)] && expected) {
      fail(id, "no row, but request " + std::to_string(expected->request) + " committed");
    }
  }
  return failures;
}

// --- Modes ---

/// A server on `path` until `requests` are done; 0 on success.
int serve(const std::string& path, std::int64_t requests) {
  const Model model;
  Database db(path);
  const std::int64_t first = db.next_request();
  Server server(model, db);
  server.run(requests);
  std::printf(
      "%s: %lld of %lld requests done before, %lld served now (%lld sessions loaded from their "
      "rows, %lld already live, the others new)\n",
      path.c_str(), static_cast<long long>(first), static_cast<long long>(requests),
      static_cast<long long>(server.served()), static_cast<long long>(server.loads()),
      static_cast<long long>(server.hits()));
  return 0;
}

void remove_database(const std::string& path) {
  for (const char* suffix : {"", "-wal", "-shm"}) std::filesystem::remove(path + suffix);
}

/// An int in memory that a forked child shares with its parent.
class SharedPhase {
 public:
  SharedPhase() {
    void* memory = mmap(nullptr, sizeof(std::atomic<int>), PROT_READ | PROT_WRITE,
                        MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (memory == MAP_FAILED) {
      throw std::runtime_error(std::string("mmap: ") + std::strerror(errno));
    }
    static_assert(std::atomic<int>::is_always_lock_free,
                  "a lock-free atomic works across processes");
    phase_ = new (memory) std::atomic<int>(0);
  }
  ~SharedPhase() { munmap(phase_, sizeof(std::atomic<int>)); }
  SharedPhase(const SharedPhase&) = delete;
  SharedPhase& operator=(const SharedPhase&) = delete;
  std::atomic<int>* get() const { return phase_; }

 private:
  std::atomic<int>* phase_ = nullptr;
};

/// The crash test in `dir`; 0 when every check passed.
int crash_test(const std::string& dir, int kills) {
  const auto start = Clock::now();
  const Model model;
  const std::int64_t requests = kCrashTestRequests;
  std::filesystem::create_directories(dir);
  const std::string reference_path = dir + "/reference.db", crashed_path = dir + "/crashed.db";
  remove_database(reference_path);
  remove_database(crashed_path);

  // What every row must be, computed without a database, then the server that never crashes.
  const Replay replay(model, requests);
  {
    Database db(reference_path);
    Server(model, db).run(requests);
  }
  std::int64_t next = 0;
  if (check_database(reference_path, model, replay, next) != 0 || next != requests) {
    std::printf("FAIL: the uninterrupted server disagrees with the replay\n");
    return 1;
  }

  // Where each kill landed: the child reports its phase in memory shared across fork.
  const SharedPhase shared;
  std::atomic<int>* const phase = shared.get();
  int landed[kPhases] = {};
  int too_late = 0;  // kills that came after the server had served every request and exited
  int afresh = 0;    // databases started again from empty
  std::mt19937_64 random(20261203);
  std::uniform_int_distribution<int> delay_us(0, 30000);

  for (int kill_number = 0; kill_number < kills; ++kill_number) {
    phase->store(static_cast<int>(Phase::starting));
    std::fflush(stdout);
    const pid_t child = fork();
    if (child < 0) throw std::runtime_error(std::string("fork: ") + std::strerror(errno));
    if (child == 0) {
      // The child opens its own connection (an open SQLite connection must not cross fork)
      // and leaves with _exit: no destructor or atexit handler of the parent's runs twice.
      try {
        Database db(crashed_path);
        Server server(model, db);
        server.watch(phase);
        server.pace(std::chrono::microseconds(500));
        server.run(requests);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "server: %s\n", e.what());
        _exit(1);
      } catch (...) {
        _exit(1);
      }
      _exit(0);
    }
    std::this_thread::sleep_for(std::chrono::microseconds(delay_us(random)));
    // The child exists until waitpid reaps it (a zombie if it finished), so this cannot miss.
    if (kill(child, SIGKILL) != 0) {
      throw std::runtime_error(std::string("kill: ") + std::strerror(errno));
    }
    int status = 0;
    if (waitpid(child, &status, 0) != child) {
      throw std::runtime_error(std::string("waitpid: ") + std::strerror(errno));
    }
    const bool killed = WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL;
    if (!killed && !(WIFEXITED(status) && WEXITSTATUS(status) == 0)) {
      std::printf("FAIL: the server failed on its own (status %d) before kill %d\n", status,
                  kill_number + 1);
      return 1;
    }
    if (killed) ++landed[phase->load()];
    if (check_database(crashed_path, model, replay, next) != 0) {
      std::printf("FAIL: after kill %d (%s, next request %lld)\n", kill_number + 1,
                  killed ? kPhaseNames[phase->load()] : "finished", static_cast<long long>(next));
      return 1;
    }
    if (!killed) ++too_late;
    if (next == requests) {
      // Every request done: start again from an empty database, so that the kills still land
      // in a server at work.
      ++afresh;
      remove_database(crashed_path);
    }
  }

  // The last server runs to the end; every row must be the uninterrupted server's.
  {
    Database db(crashed_path);
    Server(model, db).run(requests);
  }
  int failures = check_database(crashed_path, model, replay, next);
  {
    Database crashed(crashed_path), reference(reference_path);
    const std::vector<Row> a = crashed.rows(), b = reference.rows();
    bool same = a.size() == b.size() && crashed.next_request() == reference.next_request();
    for (std::size_t i = 0; same && i < a.size(); ++i) {
      same = a[i].id == b[i].id && a[i].format == b[i].format && a[i].tokens == b[i].tokens &&
             a[i].digest == b[i].digest && a[i].state == b[i].state;
    }
    if (!same) {
      std::printf("FAIL: after the crashes the rows differ from the uninterrupted server's\n");
      ++failures;
    }
  }

  const int mid_request = landed[static_cast<int>(Phase::loading)] +
                          landed[static_cast<int>(Phase::computing)] +
                          landed[static_cast<int>(Phase::committing)];
  const int between =
      landed[static_cast<int>(Phase::starting)] + landed[static_cast<int>(Phase::between)];
  std::printf("%d kills (SIGKILL after 0-30 ms) of a server of %lld requests over %lld sessions:\n",
              kills, static_cast<long long>(requests), static_cast<long long>(kSessions));
  std::printf("  %d mid-request: %d loading a session, %d computing, %d in the transaction\n",
              mid_request, landed[static_cast<int>(Phase::loading)],
              landed[static_cast<int>(Phase::computing)],
              landed[static_cast<int>(Phase::committing)]);
  std::printf("  %d between requests: %d starting up, %d after a commit\n", between,
              landed[static_cast<int>(Phase::starting)], landed[static_cast<int>(Phase::between)]);
  std::printf("  %d too late (the server had served every request and exited)\n", too_late);
  std::printf("databases served to the end and started afresh: %d\n", afresh);
  std::printf(
      "after every kill every row loaded and was bit for bit its replay at the request "
      "boundary of next_request; after the last, every row equals the uninterrupted "
      "server's: %s\n",
      failures == 0 ? "yes" : "NO");
  std::printf("%.1f s\n", std::chrono::duration<double>(Clock::now() - start).count());
  return failures == 0 ? 0 : 1;
}

/// A directory of its own under the system's temporary directory, removed at scope exit.
class TempDir {
 public:
  TempDir() {
    std::string name =
        (std::filesystem::temp_directory_path() / "linattn-sessions-XXXXXX").string();
    if (mkdtemp(name.data()) == nullptr) {
      throw std::runtime_error(std::string("mkdtemp: ") + std::strerror(errno));
    }
    path_ = name;
  }
  ~TempDir() {
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

/// A count given on the command line, or -1 unless it is all digits.
long long count(const char* text) {
  char* end = nullptr;
  errno = 0;
  const long long value = std::strtoll(text, &end, 10);
  return end != text && *end == '\0' && errno == 0 && value >= 0 ? value : -1;
}

}  // namespace

int main(int argc, char** argv) {
  const auto usage = [&] {
    std::fprintf(stderr,
                 "usage: %s                           (the crash test, 20 kills, in a temporary "
                 "directory)\n"
                 "       %s serve <db> <requests>\n"
                 "       %s crash-test <dir> <kills>\n",
                 argv[0], argv[0], argv[0]);
    return 2;
  };
  try {
    const std::string mode = argc > 1 ? argv[1] : "";
    if (argc == 1) {
      const TempDir dir;
      const int rc = crash_test(dir.path(), 20);
      std::printf("%s\n", rc == 0 ? "OK" : "FAILED");
      return rc;
    }
    if (argc == 4 && mode == "serve") {
      const long long requests = count(argv[3]);
      if (requests < 0) return usage();
      return serve(argv[2], requests);
    }
    if (argc == 4 && mode == "crash-test") {
      const long long kills = count(argv[3]);
      if (kills < 1 || kills > 1000000) return usage();
      const int rc = crash_test(argv[2], static_cast<int>(kills));
      std::printf("%s\n", rc == 0 ? "OK" : "FAILED");
      return rc;
    }
    return usage();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
