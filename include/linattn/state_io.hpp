// SPDX-License-Identifier: MIT
// A saved state in a byte buffer (a database blob) or a file replaced atomically, for every
// state type that saves to a stream (RecurrentState, DeltaRuleState), and what a saved state
// holds, read without knowing its type.
#pragma once

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <ios>
#include <istream>
#include <iterator>
#include <linattn/config.hpp>
#include <linattn/detail/state_record.hpp>
#include <ostream>
#include <streambuf>
#include <string>
#include <vector>

#if !defined(_WIN32)
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#else
#include <filesystem>
#endif

namespace linattn {
namespace detail {

/// A read-only stream buffer over caller memory: a state loads from a blob without a copy.
class ByteSource final : public std::streambuf {
 public:
  ByteSource(const void* data, std::size_t size) {
    // The get area is only read; streambuf's interface wants char*.
    char* begin = const_cast<char*>(static_cast<const char*>(data));
    setg(begin, begin, begin + size);
  }
  /// Bytes not read yet.
  std::size_t left() const { return static_cast<std::size_t>(egptr() - gptr()); }
};

/// A stream buffer that appends every byte written to a vector.
class ByteSink final : public std::streambuf {
 public:
  explicit ByteSink(std::vector<std::uint8_t>& bytes) : bytes_(bytes) {}

 protected:
  int_type overflow(int_type c) override {
    if (!traits_type::eq_int_type(c, traits_type::eof())) {
      bytes_.push_back(static_cast<std::uint8_t>(traits_type::to_char_type(c)));
    }
    return traits_type::not_eof(c);
  }
  std::streamsize xsputn(const char* s, std::streamsize n) override {
    bytes_.insert(bytes_.end(), reinterpret_cast<const std::uint8_t*>(s),
                  reinterpret_cast<const std::uint8_t*>(s) + n);
    return n;
  }

 private:
  std::vector<std::uint8_t>& bytes_;
};

/// "where: what 'path': the system's reason".
inline Error file_error(const char* where, const std::string& what, const std::string& path,
                        int error) {
  return Error(std::string(where) + ": " + what + " '" + path + "': " + std::strerror(error));
}

#if !defined(_WIN32)
/// Writes all of `bytes` to `fd`, retrying short writes and interrupts; false on an error.
inline bool write_all(int fd, const std::vector<std::uint8_t>& bytes) {
  std::size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t wrote = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (wrote < 0 && errno == EINTR) continue;
    if (wrote <= 0) return false;
    done += static_cast<std::size_t>(wrote);
  }
  return true;
}

/// The directory part of a path ("." for a bare name), whose entry a rename changes.
inline std::string parent_directory(const std::string& path) {
  const std::size_t slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : path.substr(0, slash);
}
#endif

/// Replaces the file at `path` by `bytes` so that a crash at any moment leaves either the old
/// file or the new one, whole: a temporary file beside it, written and fsynced, renamed over
/// it, then the directory fsynced so that the rename itself survives.
inline void replace_file(const std::string& path, const std::vector<std::uint8_t>& bytes,
                         const char* where) {
#if !defined(_WIN32)
  std::string temporary = path + ".tmp-XXXXXX";
  const int fd = ::mkstemp(temporary.data());
  if (fd < 0) throw file_error(where, "cannot create a temporary file beside", path, errno);
  const auto fail = [&](const char* what) {
    const int error = errno;
    ::close(fd);
    ::unlink(temporary.c_str());
    return file_error(where, what, temporary, error);
  };
  if (!write_all(fd, bytes)) throw fail("cannot write");
  if (::fsync(fd) != 0) throw fail("cannot fsync");
  if (::close(fd) != 0) {
    const int error = errno;
    ::unlink(temporary.c_str());
    throw file_error(where, "cannot close", temporary, error);
  }
  if (::rename(temporary.c_str(), path.c_str()) != 0) {
    const int error = errno;
    ::unlink(temporary.c_str());
    throw file_error(where, "cannot rename the temporary file over", path, error);
  }
  const std::string directory = parent_directory(path);
  const int dir = ::open(directory.c_str(), O_RDONLY | O_DIRECTORY);
  if (dir < 0) throw file_error(where, "cannot open the directory", directory, errno);
  const int synced = ::fsync(dir);
  const int error = errno;
  ::close(dir);
  if (synced != 0) throw file_error(where, "cannot fsync the directory", directory, error);
#else
  // Windows: the write is flushed and the rename replaces the file (MoveFileEx), but without
  // fsync a power loss may still leave the new file empty.
  const std::string temporary = path + ".tmp";
  {
    std::ofstream out(temporary, std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(bytes.data()),
              static_cast<std::streamsize>(bytes.size()));
    out.flush();
    if (!out) throw file_error(where, "cannot write", temporary, errno);
  }
  std::error_code error;
  std::filesystem::rename(temporary, path, error);
  if (error) {
    std::filesystem::remove(temporary, error);
    throw Error(std::string(where) + ": cannot rename the temporary file over '" + path + "'");
  }
#endif
}

}  // namespace detail

/// What a saved state holds, as saved_state_info reads it from any format linattn wrote.
struct SavedStateInfo {
  StateFamily family = StateFamily::linear;  ///< which class loads it (state_family_class)
  std::uint32_t format_version = 0;          ///< 4 for what this release writes
  std::uint32_t scalar_bytes = 0;  ///< sizeof(Acc): 4 loads as <T, float>, 8 as <T, double>
  std::uint64_t rows = 0;          ///< of S: C (RecurrentState) or Dk (DeltaRuleState)
  std::uint64_t cols = 0;          ///< of S: Dv
  TransitionKind transition = TransitionKind::none;  ///< what moved it (none: no token yet)
  std::int64_t tokens = 0;                           ///< tokens it has seen
};

/// What the saved state at `is` holds (one state, read up to its last byte and verified as
/// load_unchecked verifies it, whatever its family and scalar type): for tools, and to pick
/// the class and type that load it. Reads every format linattn wrote; a session saved by
/// SessionPool::save is one state per head, read one call at a time. Throws Error naming what
/// is wrong for a stream no load would accept.
/// @param is  binary stream positioned at a saved state
inline SavedStateInfo saved_state_info(std::istream& is) {
  const detail::StateRecord record = detail::read_state_record(is, "linattn::saved_state_info");
  SavedStateInfo info;
  info.family = record.family;
  info.format_version = record.version;
  info.scalar_bytes = record.scalar_bytes;
  info.rows = record.rows;
  info.cols = record.cols;
  info.transition = record.transition;
  info.tokens = record.tokens;
  return info;
}

/// What the saved state in a byte buffer holds; refused unless the buffer holds that one
/// state and nothing after it, as load_bytes refuses it.
/// @param data  the buffer's first byte
/// @param size  its length in bytes
inline SavedStateInfo saved_state_info(const void* data, std::size_t size) {
  detail::ByteSource source(data, size);
  std::istream is(&source);
  const SavedStateInfo info = saved_state_info(is);
  if (source.left() != 0) {
    throw Error("linattn::saved_state_info: the buffer holds " + std::to_string(source.left()) +
                " bytes after the state (" + std::to_string(size) +
                " in all): not one saved state");
  }
  return info;
}

/// As saved_state_info(data, size) over a vector.
inline SavedStateInfo saved_state_info(const std::vector<std::uint8_t>& bytes) {
  return saved_state_info(bytes.data(), bytes.size());
}

/// The bytes `state.save(os, args...)` writes, e.g. for a database blob.
/// @param state  RecurrentState or DeltaRuleState (any state with save(std::ostream&, ...))
/// @param args   what that save takes after the stream (RecurrentState: its feature map)
/// @return       the saved state, format and checksum included
template <class State, class... Args>
std::vector<std::uint8_t> save_bytes(const State& state, const Args&... args) {
  std::vector<std::uint8_t> bytes;
  detail::ByteSink sink(bytes);
  std::ostream os(&sink);
  state.save(os, args...);
  return bytes;
}

/// The state held by a byte buffer that save_bytes (or a save to a stream) wrote, checked as
/// `State::load(is, args...)` checks it, and refused unless the buffer holds that one state and
/// nothing after it. Throws Error, and returns nothing, for what load refuses.
/// @tparam State  RecurrentState<T, Acc> or DeltaRuleState<T, Acc>
/// @param data    the buffer's first byte
/// @param size    its length in bytes
/// @param args    what State::load takes after the stream (RecurrentState: the map and the
///                options; DeltaRuleState: the options)
template <class State, class... Args>
State load_bytes(const void* data, std::size_t size, const Args&... args) {
  detail::ByteSource source(data, size);
  std::istream is(&source);
  State state = State::load(is, args...);
  if (source.left() != 0) {
    throw Error("linattn::load_bytes: the buffer holds " + std::to_string(source.left()) +
                " bytes after the state (" + std::to_string(size) +
                " in all): not one saved state");
  }
  return state;
}

/// As load_bytes over a vector.
template <class State, class... Args>
State load_bytes(const std::vector<std::uint8_t>& bytes, const Args&... args) {
  return load_bytes<State>(bytes.data(), bytes.size(), args...);
}

/// Saves the state to `path` atomically: a crash or power loss at any moment leaves the file
/// as it was or the new state whole, never a torn one (a temporary file beside it, fsynced,
/// renamed over it, the directory fsynced; POSIX). Throws Error naming the file and the
/// system's reason, leaving no temporary file behind.
/// @param state  RecurrentState or DeltaRuleState
/// @param path   the file to create or replace
/// @param args   what state.save takes after the stream (RecurrentState: its feature map)
template <class State, class... Args>
void save_file(const State& state, const std::string& path, const Args&... args) {
  detail::replace_file(path, save_bytes(state, args...), "linattn::save_file");
}

/// The state saved in the file at `path`, checked as load_bytes checks a buffer.
/// @tparam State  RecurrentState<T, Acc> or DeltaRuleState<T, Acc>
/// @param path    a file written by save_file (or a save to a file stream)
/// @param args    what State::load takes after the stream
template <class State, class... Args>
State load_file(const std::string& path, const Args&... args) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw detail::file_error("linattn::load_file", "cannot open", path, errno);
  const std::vector<std::uint8_t> bytes((std::istreambuf_iterator<char>(in)),
                                        std::istreambuf_iterator<char>());
  if (in.bad()) throw detail::file_error("linattn::load_file", "cannot read", path, errno);
  return load_bytes<State>(bytes, args...);
}

}  // namespace linattn
