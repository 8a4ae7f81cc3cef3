// SPDX-License-Identifier: MIT
// The one format of every saved state (format 4: one framing, header, family record and
// CRC-32 for every family), its one writer, and its one reader, which also reads every format
// an earlier linattn wrote. A family adds its settings and payload here, and nowhere else.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <istream>
#include <limits>
#include <linattn/config.hpp>
#include <linattn/detail/map_record.hpp>
#include <linattn/detail/serialize.hpp>
#include <linattn/detail/validate.hpp>
#include <linattn/gates.hpp>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

namespace linattn {

/// The recurrence family of a saved state: format 4 records it (byte 32), earlier formats
/// imply it by their magic.
enum class StateFamily : std::uint8_t {
  linear = 0,           ///< RecurrentState: linear attention with a feature map, decays and gates
  delta_rule = 1,       ///< DeltaRuleState: DeltaNet, Gated DeltaNet, KDA
  dplr_delta_rule = 2,  ///< DplrDeltaRuleState: the generalized delta rule (RWKV-7)
};

/// The state class that saves and loads a family, for messages: "RecurrentState".
inline const char* state_family_class(StateFamily family) {
  switch (family) {
    case StateFamily::linear:
      return "RecurrentState";
    case StateFamily::delta_rule:
      return "DeltaRuleState";
    case StateFamily::dplr_delta_rule:
      return "DplrDeltaRuleState";
  }
  return "?";
}

}  // namespace linattn

namespace linattn::detail {

/// The highest StateFamily value this build reads.
inline constexpr std::uint8_t kLastStateFamily =
    static_cast<std::uint8_t>(StateFamily::dplr_delta_rule);
/// The format every state writes; the reader takes 1 to this.
inline constexpr std::uint32_t kStateFormatVersion = 4;
/// The magic of every format but the delta rule's first.
inline constexpr char kStateMagic[8] = {'L', 'N', 'A', 'T', 'T', 'N', 'S', '\0'};
/// The delta rule's format before format 4 (DeltaRuleState of linattn 0.4), version 1 only.
inline constexpr char kLegacyDeltaMagic[8] = {'L', 'N', 'A', 'T', 'T', 'N', 'D', '\0'};
/// Token counts past this are refused (load) or would overflow (step, prefill).
inline constexpr std::int64_t kMaxStateTokens = std::int64_t{1} << 62;

/// What a linear-attention state records beyond the common fields.
struct LinearRecord {
  double eps = 0.0;
  double decay = 1.0;
  bool normalize = false;
  double scale = 1.0;
  MapFingerprint map;      ///< kind unknown when saved without a map, and in format 1
  double log_scale = 0.0;  ///< the payload's S and z are exp(log_scale) times the true sums
  // Format 1 (linattn 0.1.0) also recorded two kernel settings; later formats leave them to
  // the caller.
  bool has_kernel_settings = false;
  bool check_finite = true;
  std::uint64_t chunk = 0;
};

/// What a delta-rule state records beyond the common fields.
struct DeltaRecord {
  double scale = -1.0;  ///< as given: negative means Dk^-1/2
  bool l2_normalize = false;
  bool allow_negative_eigenvalues = false;
};

/// What a generalized delta-rule state records beyond the common fields.
struct DplrRecord {
  double scale = -1.0;  ///< as given: negative means Dk^-1/2
};

/// A saved state, read and verified (checksum, ranges, canonical bytes), not yet a state.
struct StateRecord {
  std::uint32_t version = kStateFormatVersion;
  std::uint32_t scalar_bytes = 0;  ///< sizeof(Acc) of the state that saved it: 4 or 8
  StateFamily family = StateFamily::linear;
  std::uint64_t rows = 0;  ///< of S: C (linear) or Dk (delta rule)
  std::uint64_t cols = 0;  ///< of S: Dv
  TransitionKind transition = TransitionKind::none;
  std::int64_t tokens = 0;
  LinearRecord linear;  ///< family linear only
  DeltaRecord delta;    ///< family delta_rule only
  DplrRecord dplr;      ///< family dplr_delta_rule only
  /// S row-major (rows x cols), then for the linear family z (rows): the stream's
  /// little-endian bytes of scalar_bytes each, decoded by record_s / record_z (bit for bit).
  std::vector<unsigned char> payload;
};

/// What a state's load asks of a stream before reading its payload (nothing, for a tool).
struct RecordExpectation {
  std::uint32_t scalar_bytes = 0;  ///< 0: any
  std::optional<StateFamily> family;
};

/// Entries of S and, for the linear family, z that a record of `family` holds.
inline std::uint64_t payload_entries(StateFamily family, std::uint64_t rows, std::uint64_t cols) {
  switch (family) {
    case StateFamily::linear:
      return rows * cols + rows;
    case StateFamily::delta_rule:
    case StateFamily::dplr_delta_rule:
      return rows * cols;
  }
  return 0;
}

inline const char* accumulation_name(std::uint32_t scalar_bytes) {
  return scalar_bytes == 4 ? "float" : scalar_bytes == 8 ? "double" : "?";
}

/// Writes what format 4 holds between the dims and the payload (bytes 32 to 41 and the
/// family's record): the family, the transition, the tokens and the family's settings. A
/// session saved by a SessionPool holds each state's the same way (detail/session_parts.hpp).
inline void write_record_settings(LittleEndianWriter& out, const StateRecord& record) {
  out.put<std::uint8_t>(static_cast<std::uint8_t>(record.family));
  out.put<std::uint8_t>(static_cast<std::uint8_t>(record.transition));
  out.put<std::int64_t>(record.tokens);
  switch (record.family) {
    case StateFamily::linear: {
      const LinearRecord& linear = record.linear;
      out.put<double>(linear.eps);
      out.put<double>(linear.decay);
      out.put<std::uint8_t>(linear.normalize ? 1 : 0);
      out.put<double>(linear.scale);
      write_fingerprint(out, linear.map);
      out.put<double>(linear.log_scale);
      break;
    }
    case StateFamily::delta_rule:
      out.put<double>(record.delta.scale);
      out.put<std::uint8_t>(record.delta.l2_normalize ? 1 : 0);
      out.put<std::uint8_t>(record.delta.allow_negative_eigenvalues ? 1 : 0);
      break;
    case StateFamily::dplr_delta_rule:
      out.put<double>(record.dplr.scale);
      break;
  }
}

/// Writes a state in format 4, in this order (little-endian; offsets in bytes):
///   0 magic "LNATTNS\0" (8) | 8 version u32 = 4 | 12 sizeof(Acc) u32 | 16 rows u64
///   24 cols u64 | 32 family u8 (StateFamily) | 33 transition u8 (TransitionKind)
///   34 tokens i64 | 42 the family's record | its payload | CRC-32 u32 of every byte before it.
/// linear:     42 eps f64 | 50 decay f64 | 58 normalize u8 | 59 scale f64 | 67 map record (44
///             bytes, detail/map_record.hpp) | 111 log scale f64 | 119 S (C x Dv, row-major,
///             Acc) | z (C, Acc)
/// delta_rule: 42 scale f64 (as given: negative means Dk^-1/2) | 50 l2_normalize u8 |
///             51 allow_negative_eigenvalues u8 | 52 S (Dk x Dv, row-major, Acc)
/// dplr_delta_rule: 42 scale f64 (as given) | 50 S (Dk x Dv, row-major, Acc)
/// The encoding is canonical (one byte value per setting): equal states save equal bytes.
///
/// The formats before it, which read_state_record still reads (each ends with the CRC-32):
///   LNATTNS 3 (RecurrentState, 0.2): 0-31 as above with version 3 (rows C, cols Dv) | 32 eps
///     f64 | 40 decay f64 | 48 normalize u8 | 49 scale f64 | 57 map record (44) | 101
///     transition u8 | 102 tokens i64 | 110 log scale f64 | 118 S | z
///   LNATTNS 2: format 3 without the transition byte (version 2; S at 117); the transition is
///     decay when decay != 1, else none (set by the next call)
///   LNATTNS 1 (0.1.0): 0-31 with version 1 | 32 eps f64 | 40 decay f64 | 48 normalize u8 | 49
///     check_finite u8 | 50 chunk u64 | 58 tokens i64 | 66 log scale f64 | 74 S | z (no scale,
///     no map record; normalize and check_finite read as != 0); the transition is decay once a
///     token was seen
///   LNATTND 1 (DeltaRuleState before format 4): magic "LNATTND\0" | 8 version u32 = 1 | 12-31
///     as above (rows Dk) | 32 scale f64 | 40 l2_normalize u8 | 41 allow_negative_eigenvalues
///     u8 | 42 transition u8 | 43 tokens i64 | 51 S
/// @param record  every field but payload (rows and cols must be s's)
/// @param s       S, rows x cols
/// @param z       z (rows) for the linear family, nullptr for the delta rule
template <class Acc>
void write_state_record(std::ostream& os, const StateRecord& record, const Matrix<Acc>& s,
                        const Vector<Acc>* z, const char* where) {
  LINATTN_ASSERT((z != nullptr) == (record.family == StateFamily::linear));
  LittleEndianWriter out(os);
  write_state_header<Acc>(out, kStateMagic, kStateFormatVersion, record.rows, record.cols);
  write_record_settings(out, record);
  for (Eigen::Index r = 0; r < s.rows(); ++r) {
    for (Eigen::Index c = 0; c < s.cols(); ++c) out.put<Acc>(s(r, c));
  }
  if (z != nullptr) {
    for (Eigen::Index r = 0; r < z->size(); ++r) out.put<Acc>((*z)(r));
  }
  const std::uint32_t checksum = out.checksum();
  out.put<std::uint32_t>(checksum);
  if (!os) throw Error(std::string(where) + ": the stream failed while writing");
}

/// The options a linear record was saved with (format 1 also chunk and check_finite; the rest
/// default): what load_unchecked gives the state, and what the reader validates.
inline Options saved_options(const LinearRecord& saved) {
  Options options;
  options.eps = saved.eps;
  options.decay = saved.decay;
  options.normalize = saved.normalize;
  options.scale = saved.scale;
  if (saved.has_kernel_settings) {
    options.check_finite = saved.check_finite;
    options.chunk = static_cast<Eigen::Index>(saved.chunk);
  }
  return options;
}

/// The options a generalized delta-rule record was saved with (the rest default).
inline DplrOptions saved_options(const DplrRecord& saved) {
  DplrOptions options;
  options.scale = saved.scale;
  return options;
}

/// The options a delta-rule record was saved with (the rest default).
inline DeltaOptions saved_options(const DeltaRecord& saved) {
  DeltaOptions options;
  options.scale = saved.scale;
  options.l2_normalize = saved.l2_normalize;
  options.allow_negative_eigenvalues = saved.allow_negative_eigenvalues;
  return options;
}

namespace record {

/// The layouts the reader knows: format 4 and what came before it.
enum class Layout {
  current,       ///< format 4, either family
  linear_v1,     ///< LNATTNS 1 (0.1.0): eps, decay, normalize, check_finite, chunk, no map
  linear_v2,     ///< LNATTNS 2: eps, decay, normalize, scale, map, no transition byte
  linear_v3,     ///< LNATTNS 3: format 2 with the transition byte before the token count
  delta_legacy,  ///< LNATTND 1: scale, l2_normalize, allow_negative_eigenvalues, transition
};

inline void read_linear_settings(LittleEndianReader& in, Layout layout, LinearRecord& linear,
                                 std::uint8_t& normalize) {
  linear.eps = in.get<double>("eps");
  linear.decay = in.get<double>("decay");
  normalize = in.get<std::uint8_t>("normalize");
  if (layout == Layout::linear_v1) {
    linear.has_kernel_settings = true;
    linear.check_finite = in.get<std::uint8_t>("check_finite") != 0;
    linear.chunk = in.get<std::uint64_t>("chunk");
    return;
  }
  linear.scale = in.get<double>("scale");
  linear.map = read_fingerprint(in);
}

/// Throws unless a verified linear record is one a RecurrentState could have saved; infers
/// the transition the formats before 3 did not record.
inline void check_linear(StateRecord& record, Layout layout, std::uint8_t normalize,
                         std::uint8_t transition, const char* where) {
  LinearRecord& linear = record.linear;
  if (!(linear.scale > 0.0 && std::isfinite(linear.scale))) {
    throw Error(std::string(where) + ": invalid scale " + format_double(linear.scale) +
                " (positive and finite)");
  }
  validate_options(saved_options(linear), where);
  // The format is canonical from format 2 on (one byte value per setting); 0.1.0 read != 0.
  if (normalize > 1 && layout != Layout::linear_v1) {
    throw Error(std::string(where) + ": invalid normalize byte " + std::to_string(normalize));
  }
  linear.normalize = normalize != 0;
  if (layout != Layout::linear_v1) validate_fingerprint(linear.map, record.rows, where);
  if (std::isnan(linear.log_scale) || linear.log_scale == std::numeric_limits<double>::infinity()) {
    throw Error(std::string(where) + ": invalid log scale " + format_double(linear.log_scale));
  }
  const bool decays = linear.decay != 1.0;
  if (layout == Layout::linear_v1) {
    // 0.1.0 had no gates: a stepped state was moved by its decay.
    record.transition = record.tokens > 0 ? TransitionKind::decay : TransitionKind::none;
    return;
  }
  if (layout == Layout::linear_v2) {
    // Format 2 did not record gates: without a decay the kind is left to the next call.
    record.transition = decays ? TransitionKind::decay : TransitionKind::none;
    return;
  }
  const std::string head = std::string(where) + ": invalid transition record: ";
  if (transition > static_cast<std::uint8_t>(TransitionKind::feature_gates)) {
    throw Error(head + "unknown kind " + std::to_string(transition));
  }
  record.transition = static_cast<TransitionKind>(transition);
  if (decays && record.transition != TransitionKind::decay &&
      record.transition != TransitionKind::none) {
    throw Error(head + transition_name(record.transition) + " on a state with decay " +
                format_double(linear.decay));
  }
}

/// Throws unless a verified delta-rule record is one a DeltaRuleState could have saved.
inline void check_delta(StateRecord& record, std::uint8_t l2, std::uint8_t negative,
                        std::uint8_t transition, const char* where) {
  if (l2 > 1 || negative > 1) {
    throw Error(std::string(where) + ": invalid option byte (l2_normalize " + std::to_string(l2) +
                ", allow_negative_eigenvalues " + std::to_string(negative) + ")");
  }
  record.delta.l2_normalize = l2 != 0;
  record.delta.allow_negative_eigenvalues = negative != 0;
  const double scale = record.delta.scale;
  if (std::isnan(scale) || std::isinf(scale) || scale == 0.0) {
    throw Error(std::string(where) + ": invalid scale " + format_double(scale));
  }
  if (transition > static_cast<std::uint8_t>(TransitionKind::feature_gates)) {
    throw Error(std::string(where) + ": invalid transition record: unknown kind " +
                std::to_string(transition));
  }
  record.transition = static_cast<TransitionKind>(transition);
  if ((record.tokens == 0) != (record.transition == TransitionKind::none)) {
    throw Error(std::string(where) + ": invalid token count " + std::to_string(record.tokens) +
                " for the transition record");
  }
}

/// Throws unless a verified generalized delta-rule record is one a DplrDeltaRuleState could
/// have saved: a valid scale, and per-feature decays once a token was seen (a scalar gate is
/// one broadcast over the features).
inline void check_dplr(StateRecord& record, std::uint8_t transition, const char* where) {
  const double scale = record.dplr.scale;
  if (std::isnan(scale) || std::isinf(scale) || scale == 0.0) {
    throw Error(std::string(where) + ": invalid scale " + format_double(scale));
  }
  const auto expected = record.tokens == 0 ? TransitionKind::none : TransitionKind::feature_gates;
  if (transition != static_cast<std::uint8_t>(expected)) {
    throw Error(std::string(where) + ": invalid transition record " + std::to_string(transition) +
                " for " + std::to_string(record.tokens) + " tokens of the generalized delta rule");
  }
  record.transition = expected;
}

/// The bytes of a record's settings that are checked once the whole record is read.
struct SettingBytes {
  std::uint8_t transition = 0, normalize = 0, l2 = 0, negative = 0;
};

/// The family byte (format 4), refused past the last family this build knows.
inline StateFamily read_family(LittleEndianReader& in, const char* where) {
  const auto family = in.get<std::uint8_t>("the state family");
  if (family > kLastStateFamily) {
    throw Error(std::string(where) + ": unknown state family " + std::to_string(family) +
                " (a later linattn's?); this build reads 0 (RecurrentState), 1 "
                "(DeltaRuleState) and 2 (DplrDeltaRuleState)");
  }
  return static_cast<StateFamily>(family);
}

/// What write_record_settings wrote after the family byte (record.family set), unchecked.
inline void read_settings(LittleEndianReader& in, StateRecord& record, SettingBytes& bytes) {
  bytes.transition = in.get<std::uint8_t>("the transition kind");
  record.tokens = in.get<std::int64_t>("the token count");
  switch (record.family) {
    case StateFamily::linear:
      read_linear_settings(in, Layout::current, record.linear, bytes.normalize);
      record.linear.log_scale = in.get<double>("the log scale");
      break;
    case StateFamily::delta_rule:
      record.delta.scale = in.get<double>("scale");
      bytes.l2 = in.get<std::uint8_t>("l2_normalize");
      bytes.negative = in.get<std::uint8_t>("allow_negative_eigenvalues");
      break;
    case StateFamily::dplr_delta_rule:
      record.dplr.scale = in.get<double>("scale");
      break;
  }
}

}  // namespace record

/// Payload entry i of a record, widened to double (for checks; states decode in their Acc).
inline double payload_entry(const StateRecord& record, std::size_t i) {
  const unsigned char* at = record.payload.data() + i * record.scalar_bytes;
  return record.scalar_bytes == 4 ? static_cast<double>(decode_little_endian<float>(at))
                                  : decode_little_endian<double>(at);
}

namespace record {

/// The checks of a record read whole (after its checksum): the token count, the family's
/// settings (canonical bytes, valid options, the transition against the tokens), a finite
/// payload. Throws Error starting with `where`.
inline void check_record(StateRecord& record, Layout layout, const SettingBytes& bytes,
                         const char* where) {
  if (record.tokens < 0 || record.tokens > kMaxStateTokens) {
    throw Error(std::string(where) + ": invalid token count " + std::to_string(record.tokens));
  }
  switch (record.family) {
    case StateFamily::linear:
      check_linear(record, layout, bytes.normalize, bytes.transition, where);
      break;
    case StateFamily::delta_rule:
      check_delta(record, bytes.l2, bytes.negative, bytes.transition, where);
      break;
    case StateFamily::dplr_delta_rule:
      check_dplr(record, bytes.transition, where);
      break;
  }
  const std::size_t entries =
      static_cast<std::size_t>(payload_entries(record.family, record.rows, record.cols));
  for (std::size_t i = 0; i < entries; ++i) {
    if (!std::isfinite(payload_entry(record, i))) {
      throw Error(std::string(where) + (record.family == StateFamily::linear ? ": S or z" : ": S") +
                  " holds a non-finite value");
    }
  }
}

}  // namespace record

/// Reads one saved state of any format linattn wrote (format 4 of either family; LNATTNS 1-3,
/// RecurrentState's before it; LNATTND 1, DeltaRuleState's before it) up to its last byte, and
/// verifies it: the magic, the version, the dims (within 2^26 entries), then the family and the
/// scalar size against `expect` (before the rest is read, so a stream of the other family is
/// named as such, whatever its scalar type), the checksum, then every field (canonical bytes,
/// valid settings, the transition against the token count, a finite payload). Allocates no
/// more than about twice the bytes the stream really holds (a hostile header cannot force a
/// huge allocation). Throws Error starting with `where`, naming what is wrong.
inline StateRecord read_state_record(std::istream& is, const char* where,
                                     const RecordExpectation& expect = {}) {
  using record::Layout;
  LittleEndianReader in(is, where);
  unsigned char magic[8];
  in.get_first_bytes(magic, sizeof(magic), "the magic bytes");
  const bool legacy_delta = std::memcmp(magic, kLegacyDeltaMagic, sizeof(magic)) == 0;
  if (!legacy_delta && std::memcmp(magic, kStateMagic, sizeof(magic)) != 0) {
    throw Error(std::string(where) + ": wrong magic bytes, not a linattn state");
  }
  StateRecord record;
  record.version = in.get<std::uint32_t>("the format version");
  const std::uint32_t max_version = legacy_delta ? 1 : kStateFormatVersion;
  if (record.version < 1 || record.version > max_version) {
    throw Error(std::string(where) + ": format version " + std::to_string(record.version) +
                (legacy_delta
                     ? " of the delta rule's LNATTND format, which had only version 1"
                     : ", this build reads versions 1 to " + std::to_string(kStateFormatVersion)));
  }
  record.scalar_bytes = in.get<std::uint32_t>("the scalar type");
  if (record.scalar_bytes != 4 && record.scalar_bytes != 8) {
    throw Error(std::string(where) + ": the stream holds " + std::to_string(record.scalar_bytes) +
                "-byte scalars; a state accumulates in float (4) or double (8)");
  }
  record.rows = in.get<std::uint64_t>("the rows of S");
  record.cols = in.get<std::uint64_t>("the columns of S");
  if (record.rows < 1 || record.cols < 1 || record.rows > kMaxStateEntries ||
      record.cols > kMaxStateEntries || record.rows * record.cols > kMaxStateEntries) {
    throw Error(std::string(where) + ": dims " + std::to_string(record.rows) + " x " +
                std::to_string(record.cols) + " are empty or over the limit of 2^26 entries");
  }
  Layout layout = Layout::current;
  if (legacy_delta) {
    layout = Layout::delta_legacy;
    record.family = StateFamily::delta_rule;
  } else if (record.version < kStateFormatVersion) {
    layout = record.version == 1   ? Layout::linear_v1
             : record.version == 2 ? Layout::linear_v2
                                   : Layout::linear_v3;
    record.family = StateFamily::linear;
  } else {
    record.family = record::read_family(in, where);
  }
  if (expect.family && *expect.family != record.family) {
    throw Error(std::string(where) + ": the stream holds a " + state_family_class(record.family) +
                ", not a " + state_family_class(*expect.family) + ": load it with " +
                state_family_class(record.family) +
                "::load (linattn::saved_state_info says what a stream holds)");
  }
  if (expect.scalar_bytes != 0 && record.scalar_bytes != expect.scalar_bytes) {
    throw Error(std::string(where) + ": the stream holds " + std::to_string(record.scalar_bytes) +
                "-byte scalars, a state accumulating in " + accumulation_name(expect.scalar_bytes) +
                " needs " + std::to_string(expect.scalar_bytes));
  }

  record::SettingBytes bytes;
  if (layout == Layout::current) {
    record::read_settings(in, record, bytes);
  } else if (layout == Layout::delta_legacy) {
    record.delta.scale = in.get<double>("scale");
    bytes.l2 = in.get<std::uint8_t>("l2_normalize");
    bytes.negative = in.get<std::uint8_t>("allow_negative_eigenvalues");
    bytes.transition = in.get<std::uint8_t>("the transition kind");
    record.tokens = in.get<std::int64_t>("the token count");
  } else {
    record::read_linear_settings(in, layout, record.linear, bytes.normalize);
    if (layout == Layout::linear_v3) bytes.transition = in.get<std::uint8_t>("the transition kind");
    record.tokens = in.get<std::int64_t>("the token count");
    record.linear.log_scale = in.get<double>("the log scale");
  }

  const std::uint64_t s_entries = record.rows * record.cols;
  const std::uint64_t entries = payload_entries(record.family, record.rows, record.cols);
  const std::size_t width = record.scalar_bytes;
  record.payload.reserve(static_cast<std::size_t>(std::min<std::uint64_t>(entries, 4096)) * width);
  unsigned char entry[8];
  for (std::uint64_t i = 0; i < entries; ++i) {
    in.get_bytes(entry, width, i < s_entries ? "S" : "z");
    record.payload.insert(record.payload.end(), entry, entry + width);
  }
  const std::uint32_t computed = in.checksum();
  if (in.get<std::uint32_t>("the checksum") != computed) {
    throw Error(std::string(where) + ": checksum mismatch, the state is corrupt");
  }

  record::check_record(record, layout, bytes, where);
  return record;
}

/// A state of `family` accumulating in Acc, read and verified: what each state's load reads.
template <class Acc>
StateRecord read_state_of(std::istream& is, StateFamily family, const char* where) {
  RecordExpectation expect;
  expect.scalar_bytes = sizeof(Acc);
  expect.family = family;
  return read_state_record(is, where, expect);
}

/// S of a verified record read for a state of Acc (record.scalar_bytes == sizeof(Acc)): the
/// saved bits.
template <class Acc>
Matrix<Acc> record_s(const StateRecord& record) {
  LINATTN_ASSERT(record.scalar_bytes == sizeof(Acc));
  Matrix<Acc> s(static_cast<Eigen::Index>(record.rows), static_cast<Eigen::Index>(record.cols));
  for (Eigen::Index i = 0; i < s.size(); ++i) {  // Matrix is row-major, as the stream
    s.data()[i] = decode_little_endian<Acc>(record.payload.data() +
                                            static_cast<std::size_t>(i) * sizeof(Acc));
  }
  return s;
}

/// z of a verified linear record read for a state of Acc: the saved bits.
template <class Acc>
Vector<Acc> record_z(const StateRecord& record) {
  LINATTN_ASSERT(record.scalar_bytes == sizeof(Acc) && record.family == StateFamily::linear);
  const auto rows = static_cast<Eigen::Index>(record.rows);
  const std::size_t first = static_cast<std::size_t>(record.rows * record.cols) * sizeof(Acc);
  Vector<Acc> z(rows);
  for (Eigen::Index i = 0; i < rows; ++i) {
    z(i) = decode_little_endian<Acc>(record.payload.data() + first +
                                     static_cast<std::size_t>(i) * sizeof(Acc));
  }
  return z;
}

}  // namespace linattn::detail
