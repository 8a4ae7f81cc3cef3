// expect: a SessionPool is made from the model's layers
// A pool of batches made by hand could hold other options than the layer that feeds it (here
// no l2_normalize) and ran them silently; a pool is made from the layers.
#include <linattn/layer.hpp>
#include <linattn/session_pool.hpp>
int main() {
  linattn::DeltaOptions options;
  options.l2_normalize = true;
  const linattn::DeltaRuleLayer<float> layer(4, 8, 8, options);
#ifdef LINATTN_COMPILE_FAIL_CONTROL
  linattn::SessionPool pool(2, layer);
#else
  linattn::SessionPool<linattn::DeltaRuleStateBatch<float> > pool(
      2, linattn::DeltaRuleStateBatch<float>(4, 8, 8));
#endif
  return pool.layers() == 2 ? 0 : 1;
}
