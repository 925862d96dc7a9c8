// Weight-only int8 products for decoding on CPU, called from JAX through the
// XLA FFI (kernels/int8.py builds and registers this file).
//
// y[m, n] = scale[n] * sum_k x[m, k] * q[n, k]. A decoding pass multiplies a
// few token rows by every weight, so it is bound by reading the weights: each
// int8 weight row is read once, widened to float32 in a buffer that stays in
// L1, and multiplied by every token row. XLA:CPU does not fuse an int8 -> f32
// convert into a dot (it writes the float32 weight out first), which is why
// this is a kernel of its own.
#include <cstdint>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

static ffi::Error Int8MatmulImpl(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> q, ffi::Buffer<ffi::F32> scale,
                                 ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions();
  auto qd = q.dimensions();
  if (xd.size() != 2 || qd.size() != 2 || xd[1] != qd[1] || scale.element_count() != qd[0]) {
    return ffi::Error::InvalidArgument("int8_matmul: want x [m, k], q [n, k] and scale [n]");
  }
  const int64_t m = xd[0], k = xd[1], n = qd[0];
  const float* xp = x.typed_data();
  const int8_t* qp = q.typed_data();
  const float* sp = scale.typed_data();
  float* yp = y->typed_data();
#pragma omp parallel
  {
    std::vector<float> w(k);
#pragma omp for schedule(static)
    for (int64_t j = 0; j < n; ++j) {
      const int8_t* row = qp + j * k;
#pragma omp simd
      for (int64_t i = 0; i < k; ++i) w[i] = static_cast<float>(row[i]);
      for (int64_t r = 0; r < m; ++r) {
        const float* xr = xp + r * k;
        float acc = 0.f;
#pragma omp simd reduction(+ : acc)
        for (int64_t i = 0; i < k; ++i) acc += xr[i] * w[i];
        yp[r * n + j] = acc * sp[j];
      }
    }
  }
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(Int8Matmul, Int8MatmulImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
