// SPDX-License-Identifier: MIT
// Little-endian binary encoding with a running CRC-32, for RecurrentState::save/load, and
// the Options fields a saved state records.
#pragma once

#include <array>
#include <cstdint>
#include <cstring>
#include <istream>
#include <linattn/config.hpp>
#include <ostream>
#include <string>
#include <type_traits>
#include <utility>

namespace linattn::detail {

/// CRC-32 (IEEE 802.3, reflected polynomial 0xEDB88320), table built at compile time.
class Crc32 {
 public:
  void update(const unsigned char* data, std::size_t size) {
    for (std::size_t i = 0; i < size; ++i) {
      crc_ = table()[(crc_ ^ data[i]) & 0xFFu] ^ (crc_ >> 8);
    }
  }
  std::uint32_t value() const { return crc_ ^ 0xFFFFFFFFu; }

 private:
  static const std::array<std::uint32_t, 256>& table() {
    static constexpr std::array<std::uint32_t, 256> entries = [] {
      std::array<std::uint32_t, 256> t{};
      for (std::uint32_t n = 0; n < 256; ++n) {
        std::uint32_t c = n;
        for (int bit = 0; bit < 8; ++bit) c = (c & 1u) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
        t[n] = c;
      }
      return t;
    }();
    return entries;
  }
  std::uint32_t crc_ = 0xFFFFFFFFu;
};

/// The unsigned integer with the same width as T (T: an integer or float/double).
template <class T>
using bits_of = std::conditional_t<
    sizeof(T) == 8, std::uint64_t,
    std::conditional_t<sizeof(T) == 4, std::uint32_t,
                       std::conditional_t<sizeof(T) == 2, std::uint16_t, std::uint8_t>>>;

/// Writes values little-endian whatever the host, checksumming every byte.
class LittleEndianWriter {
 public:
  explicit LittleEndianWriter(std::ostream& os) : os_(os) {}

  template <class T>
  void put(T value) {
    static_assert(std::is_arithmetic_v<T>);
    bits_of<T> bits;
    std::memcpy(&bits, &value, sizeof(T));
    unsigned char bytes[sizeof(T)];
    for (std::size_t i = 0; i < sizeof(T); ++i) {
      bytes[i] = static_cast<unsigned char>((bits >> (8 * i)) & 0xFFu);
    }
    put_bytes(bytes, sizeof(T));
  }
  void put_bytes(const unsigned char* data, std::size_t size) {
    crc_.update(data, size);
    os_.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
  }
  std::uint32_t checksum() const { return crc_.value(); }

 private:
  std::ostream& os_;
  Crc32 crc_;
};

/// Reads what LittleEndianWriter wrote; throws Error on a short stream.
class LittleEndianReader {
 public:
  /// `where` starts every message (the calling function).
  explicit LittleEndianReader(std::istream& is, const char* where = "RecurrentState::load")
      : is_(is), where_(where) {}

  /// The first read of a stream: as get_bytes, but a stream that is already failed, or gives
  /// no byte at all, gets its own message (not "truncated").
  void get_first_bytes(unsigned char* data, std::size_t size, const char* what) {
    if (is_.fail()) {
      throw Error(std::string(where_) +
                  ": the stream could not be read (it was already in a failed state: a file "
                  "that did not open?)");
    }
    is_.read(reinterpret_cast<char*>(data), static_cast<std::streamsize>(size));
    if (is_.gcount() == 0) {
      throw Error(std::string(where_) + ": the stream is empty (no byte could be read)");
    }
    check_count(size, what);
    crc_.update(data, size);
  }

  template <class T>
  T get(const char* what) {
    static_assert(std::is_arithmetic_v<T>);
    unsigned char bytes[sizeof(T)];
    get_bytes(bytes, sizeof(T), what);
    bits_of<T> bits = 0;
    for (std::size_t i = 0; i < sizeof(T); ++i) {
      bits = static_cast<bits_of<T>>(bits | (static_cast<bits_of<T>>(bytes[i]) << (8 * i)));
    }
    T value;
    std::memcpy(&value, &bits, sizeof(T));
    return value;
  }
  void get_bytes(unsigned char* data, std::size_t size, const char* what) {
    is_.read(reinterpret_cast<char*>(data), static_cast<std::streamsize>(size));
    check_count(size, what);
    crc_.update(data, size);
  }
  std::uint32_t checksum() const { return crc_.value(); }

 private:
  void check_count(std::size_t size, const char* what) const {
    if (static_cast<std::size_t>(is_.gcount()) != size) {
      throw Error(std::string(where_) + ": stream ends inside " + what + " (truncated state)");
    }
  }

  std::istream& is_;
  const char* where_;
  Crc32 crc_;
};

/// Entries past this many (rows x cols of a saved state) are refused by every load.
inline constexpr std::uint64_t kMaxStateEntries = std::uint64_t{1} << 26;

/// The fields that open every linattn state stream: magic (8 bytes), format version u32,
/// sizeof(Acc) u32, rows u64, cols u64.
struct StateHeader {
  std::uint32_t version = 0;
  std::uint64_t rows = 0, cols = 0;
};

/// Writes a StateHeader for a state of `rows` x `cols` Acc entries.
template <class Acc>
void write_state_header(LittleEndianWriter& out, const char (&magic)[8], std::uint32_t version,
                        std::uint64_t rows, std::uint64_t cols) {
  out.put_bytes(reinterpret_cast<const unsigned char*>(magic), sizeof(magic));
  out.put<std::uint32_t>(version);
  out.put<std::uint32_t>(static_cast<std::uint32_t>(sizeof(Acc)));
  out.put<std::uint64_t>(rows);
  out.put<std::uint64_t>(cols);
}

/// Reads and checks a StateHeader: the magic (`what` names the expected kind of state), a
/// version in [1, max_version], the scalar size of Acc, and dims of 1 to kMaxStateEntries.
template <class Acc>
StateHeader read_state_header(LittleEndianReader& in, const char (&magic)[8],
                              std::uint32_t max_version, const char* where, const char* what,
                              const char* rows_name, const char* cols_name) {
  unsigned char magic_bytes[sizeof(magic)];
  in.get_first_bytes(magic_bytes, sizeof(magic), "the magic bytes");
  if (std::memcmp(magic_bytes, magic, sizeof(magic)) != 0) {
    throw Error(std::string(where) + ": wrong magic bytes, not " + what);
  }
  StateHeader header;
  header.version = in.get<std::uint32_t>("the format version");
  if (header.version < 1 || header.version > max_version) {
    throw Error(std::string(where) + ": format version " + std::to_string(header.version) +
                ", this build reads versions 1 to " + std::to_string(max_version));
  }
  const auto scalar_size = in.get<std::uint32_t>("the scalar type");
  if (scalar_size != sizeof(Acc)) {
    throw Error(std::string(where) + ": the stream holds " + std::to_string(scalar_size) +
                "-byte scalars, a state accumulating in " +
                (std::is_same_v<Acc, float> ? "float" : "double") + " needs " +
                std::to_string(sizeof(Acc)));
  }
  header.rows = in.get<std::uint64_t>(rows_name);
  header.cols = in.get<std::uint64_t>(cols_name);
  if (header.rows < 1 || header.cols < 1 || header.rows > kMaxStateEntries ||
      header.cols > kMaxStateEntries || header.rows * header.cols > kMaxStateEntries) {
    throw Error(std::string(where) + ": dims " + std::to_string(header.rows) + " x " +
                std::to_string(header.cols) + " are empty or over the limit of 2^26 entries");
  }
  return header;
}

/// Options::scale where Options has one (docs/design.md lists it), 1 (its meaning: no scaling)
/// where it does not yet: formats 2 and 3 always record a scale, so adding the member later changes
/// no stream.
template <class O, class = void>
struct has_scale_member : std::false_type {};
template <class O>
struct has_scale_member<O, std::void_t<decltype(std::declval<O&>().scale)>> : std::true_type {};

template <class O>
double options_scale(const O& options) {
  if constexpr (has_scale_member<O>::value) {
    return static_cast<double>(options.scale);
  } else {
    static_cast<void>(options);
    return 1.0;
  }
}

/// Sets options.scale; false when O has no scale member and `scale` is not 1.
template <class O>
bool set_options_scale(O& options, double scale) {
  if constexpr (has_scale_member<O>::value) {
    options.scale = scale;
    return true;
  } else {
    static_cast<void>(options);
    return scale == 1.0;
  }
}

}  // namespace linattn::detail
