// Options, Error, version macros and the LINATTN_ASSERT override.
#include <stdexcept>
#include <string>

// A user may route internal assertions elsewhere by defining the macro before any include.
struct AssertionFired : std::runtime_error {
  using std::runtime_error::runtime_error;
};
#define LINATTN_ASSERT(cond) \
  ((cond) ? static_cast<void>(0) : throw AssertionFired("LINATTN_ASSERT: " #cond))

#include <catch2/catch.hpp>
#include <linattn/config.hpp>

TEST_CASE("Options has the documented defaults", "[config]") {
  const linattn::Options options;
  CHECK(options.eps == 1e-6);
  CHECK(options.decay == 1.0);
  CHECK(options.normalize);
  CHECK(options.chunk == 64);
  CHECK(options.check_finite);
}

TEST_CASE("Error is an invalid_argument that says it comes from linattn", "[config]") {
  try {
    throw linattn::Error("q is 3 x 4");
  } catch (const std::invalid_argument& e) {
    CHECK(std::string(e.what()) == "linattn: q is 3 x 4");
  }
}

TEST_CASE("version macros are set", "[config]") {
  CHECK(LINATTN_VERSION_MAJOR >= 0);
  CHECK(LINATTN_VERSION_MINOR >= 0);
  CHECK(LINATTN_VERSION_PATCH >= 0);
  CHECK(LINATTN_VERSION_MAJOR * 10000 + LINATTN_VERSION_MINOR * 100 + LINATTN_VERSION_PATCH > 0);
}

TEST_CASE("LINATTN_ASSERT can be overridden by the user", "[config]") {
  CHECK_NOTHROW(LINATTN_ASSERT(1 + 1 == 2));
  CHECK_THROWS_AS(LINATTN_ASSERT(1 + 1 == 3), AssertionFired);
}

TEST_CASE("Matrix is row-major and Vector is a column", "[config]") {
  CHECK(linattn::Matrix<float>::IsRowMajor);
  CHECK(linattn::Vector<double>::ColsAtCompileTime == 1);
}
