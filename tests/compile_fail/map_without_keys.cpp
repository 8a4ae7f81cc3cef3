// expect: needs a const member .keys
// A user map missing keys().
#include <linattn/linattn.hpp>
struct NoKeys {
  Eigen::Index feature_dim(Eigen::Index d) const { return d; }
  template <class X>
  linattn::Matrix<typename X::Scalar> queries(const Eigen::MatrixBase<X>& x) const {
    return x;
  }
};
struct Complete : NoKeys {
  template <class X>
  linattn::Matrix<typename X::Scalar> keys(const Eigen::MatrixBase<X>& x) const {
    return x;
  }
};
int main() {
  const linattn::Matrix<float> q = linattn::Matrix<float>::Random(8, 4);
  const linattn::Matrix<float> k = linattn::Matrix<float>::Random(8, 4);
  const linattn::Matrix<float> v = linattn::Matrix<float>::Random(8, 3);
#ifdef LINATTN_COMPILE_FAIL_CONTROL
  (void)linattn::causal_linear_attention(q, k, v, Complete{});
#else
  (void)linattn::causal_linear_attention(q, k, v, NoKeys{});
#endif
  return 0;
}
