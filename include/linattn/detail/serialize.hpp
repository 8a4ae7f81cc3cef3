// SPDX-License-Identifier: MIT
// Little-endian binary encoding with a running CRC-32: the framing of every saved state
// (detail/state_record.hpp writes and reads the format over it).
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

/// CRC-32 (IEEE 802.3, reflected polynomial 0xEDB88320), tables built at compile time; eight
/// bytes a step (slicing-by-8), the same value as the byte-wise form.
class Crc32 {
 public:
  void update(const unsigned char* data, std::size_t size) {
    const auto& t = tables();
    std::uint32_t crc = crc_;
    std::size_t i = 0;
    for (; i + 8 <= size; i += 8) {
      const std::uint32_t low =
          crc ^ (std::uint32_t(data[i]) | std::uint32_t(data[i + 1]) << 8 |
                 std::uint32_t(data[i + 2]) << 16 | std::uint32_t(data[i + 3]) << 24);
      crc = t[7][low & 0xFFu] ^ t[6][(low >> 8) & 0xFFu] ^ t[5][(low >> 16) & 0xFFu] ^
            t[4][low >> 24] ^ t[3][data[i + 4]] ^ t[2][data[i + 5]] ^ t[1][data[i + 6]] ^
            t[0][data[i + 7]];
    }
    for (; i < size; ++i) crc = t[0][(crc ^ data[i]) & 0xFFu] ^ (crc >> 8);
    crc_ = crc;
  }
  std::uint32_t value() const { return crc_ ^ 0xFFFFFFFFu; }

 private:
  using Tables = std::array<std::array<std::uint32_t, 256>, 8>;
  static const Tables& tables() {
    static constexpr Tables entries = [] {
      Tables t{};
      for (std::uint32_t n = 0; n < 256; ++n) {
        std::uint32_t c = n;
        for (int bit = 0; bit < 8; ++bit) c = (c & 1u) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
        t[0][n] = c;
      }
      // t[k][n]: the CRC of byte n followed by k zero bytes.
      for (std::size_t k = 1; k < 8; ++k) {
        for (std::uint32_t n = 0; n < 256; ++n) {
          t[k][n] = t[0][t[k - 1][n] & 0xFFu] ^ (t[k - 1][n] >> 8);
        }
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

/// The little-endian value of T (an integer, float or double) at `bytes`, whatever the host.
template <class T>
T decode_little_endian(const unsigned char* bytes) {
  static_assert(std::is_arithmetic_v<T>);
  bits_of<T> bits = 0;
  for (std::size_t i = 0; i < sizeof(T); ++i) {
    bits = static_cast<bits_of<T>>(bits | (static_cast<bits_of<T>>(bytes[i]) << (8 * i)));
  }
  T value;
  std::memcpy(&value, &bits, sizeof(T));
  return value;
}

/// Writes the little-endian bytes of `value` (an integer, float or double) at `bytes`.
template <class T>
void encode_little_endian(T value, unsigned char* bytes) {
  static_assert(std::is_arithmetic_v<T>);
  bits_of<T> bits;
  std::memcpy(&bits, &value, sizeof(T));
  for (std::size_t i = 0; i < sizeof(T); ++i) {
    bytes[i] = static_cast<unsigned char>((bits >> (8 * i)) & 0xFFu);
  }
}

/// Writes values little-endian whatever the host, checksumming every byte.
class LittleEndianWriter {
 public:
  explicit LittleEndianWriter(std::ostream& os) : os_(os) {}

  template <class T>
  void put(T value) {
    unsigned char bytes[sizeof(T)];
    encode_little_endian(value, bytes);
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
  explicit LittleEndianReader(std::istream& is, const char* where) : is_(is), where_(where) {}

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
    return decode_little_endian<T>(bytes);
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

/// Writes the fields that open every linattn state stream: magic (8 bytes), format version
/// u32, sizeof(Acc) u32, rows u64, cols u64 (detail/state_record.hpp reads them).
template <class Acc>
void write_state_header(LittleEndianWriter& out, const char (&magic)[8], std::uint32_t version,
                        std::uint64_t rows, std::uint64_t cols) {
  out.put_bytes(reinterpret_cast<const unsigned char*>(magic), sizeof(magic));
  out.put<std::uint32_t>(version);
  out.put<std::uint32_t>(static_cast<std::uint32_t>(sizeof(Acc)));
  out.put<std::uint64_t>(rows);
  out.put<std::uint64_t>(cols);
}

}  // namespace linattn::detail
