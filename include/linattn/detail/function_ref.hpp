// SPDX-License-Identifier: MIT
// A non-owning reference to a callable: what lets a driver compiled once, in the library,
// call back into its caller's lambda without a template parameter per caller.
#pragma once

#include <type_traits>
#include <utility>

namespace linattn::detail {

/// A reference to a callable of the given signature (declared here, defined for R(Args...)).
template <class Signature>
class FunctionRef;

/// Refers to any callable with the signature R(Args...), like C++26's std::function_ref:
/// two pointers, no allocation. Only while the callable lives (pass lambdas straight to the
/// call that takes one).
template <class R, class... Args>
class FunctionRef<R(Args...)> {
 public:
  template <class F, class = std::enable_if_t<!std::is_same_v<std::decay_t<F>, FunctionRef> &&
                                              std::is_invocable_r_v<R, const F&, Args...>>>
  FunctionRef(const F& f)  // NOLINT(google-explicit-constructor): stands in for the lambda
      : object_(&f), call_(&call<F>) {}

  R operator()(Args... args) const { return call_(object_, std::forward<Args>(args)...); }

 private:
  /// Calls the callable `object` points to, as an F.
  template <class F>
  static R call(const void* object, Args... args) {
    return (*static_cast<const F*>(object))(std::forward<Args>(args)...);
  }

  const void* object_;               ///< the callable referred to
  R (*call_)(const void*, Args...);  ///< call<F> for its type F
};

}  // namespace linattn::detail
