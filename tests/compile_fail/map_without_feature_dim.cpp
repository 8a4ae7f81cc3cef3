// expect: needs a member .Eigen::Index feature_dim
// A user map missing feature_dim().
#include <linattn/linattn.hpp>
struct NoDim {
  template <class X>
  linattn::Matrix<typename X::Scalar> queries(const Eigen::MatrixBase<X>& x) const {
    return x;
  }
  template <class X>
  linattn::Matrix<typename X::Scalar> keys(const Eigen::MatrixBase<X>& x) const {
    return x;
  }
};
struct Complete : NoDim {
  Eigen::Index feature_dim(Eigen::Index d) const { return d; }
};
int main() {
  const linattn::Matrix<float> q = linattn::Matrix<float>::Random(8, 4);
  const linattn::Matrix<float> k = linattn::Matrix<float>::Random(8, 4);
  const linattn::Matrix<float> v = linattn::Matrix<float>::Random(8, 3);
#ifdef LINATTN_COMPILE_FAIL_CONTROL
  linattn::RecurrentState<float> state(4, 3);
  (void)state.step(q.row(0), k.row(0), v.row(0), Complete{});
#else
  linattn::RecurrentState<float> state(4, 3);
  (void)state.step(q.row(0), k.row(0), v.row(0), NoDim{});
#endif
  return 0;
}
