// Denormal (subnormal) floats, |x| < 1.2e-38, take a microcode assist on
// every x86 arithmetic instruction that reads or produces one: a vector
// multiply that touches them runs ~40x slower (measured here: Adam over
// 203k parameters, 0.19 ms with normal moments, 8.1 ms with denormal ones).
// Training produces them as a matter of course: Adam's first moment decays
// by beta1 = 0.9 per step, so a parameter whose gradient stays zero for
// ~800 steps (an MNIST border pixel) has a denormal moment from then on.
//
// The optimizer loops and the CPU compute backend therefore run with
// flush-to-zero (results that would be denormal become 0) and
// denormals-are-zero (denormal inputs read as 0), as TensorFlow's CPU
// kernels and PyTorch's set_flush_denormal do. Values that small are below
// anything a float32 model can use, and the result is still deterministic,
// so BSP's bit-for-bit reproducibility holds. On other architectures these
// are no-ops.
#ifndef FULCRUM_COMMON_FLOAT_ENV_H_
#define FULCRUM_COMMON_FLOAT_ENV_H_

#if defined(__SSE__) || defined(__x86_64__)
#include <xmmintrin.h>
#define FULCRUM_HAS_MXCSR 1
#endif

namespace fulcrum {

#ifdef FULCRUM_HAS_MXCSR
// MXCSR bits: flush-to-zero (15) and denormals-are-zero (6).
inline constexpr unsigned kFlushDenormalBits = 0x8040;
#endif

// Sets flush-to-zero and denormals-are-zero on the calling thread for the
// scope's lifetime and restores the caller's mode after. Costs two MXCSR
// accesses: hold one around a batch, not around each element.
class ScopedFlushDenormals {
 public:
#ifdef FULCRUM_HAS_MXCSR
  ScopedFlushDenormals() : saved_(_mm_getcsr()) {
    if ((saved_ & kFlushDenormalBits) != kFlushDenormalBits) _mm_setcsr(saved_ | kFlushDenormalBits);
  }
  ~ScopedFlushDenormals() {
    if ((saved_ & kFlushDenormalBits) != kFlushDenormalBits) _mm_setcsr(saved_);
  }
#else
  ScopedFlushDenormals() = default;
#endif
  ScopedFlushDenormals(const ScopedFlushDenormals&) = delete;
  ScopedFlushDenormals& operator=(const ScopedFlushDenormals&) = delete;

 private:
#ifdef FULCRUM_HAS_MXCSR
  unsigned saved_;
#endif
};

// True when the calling thread flushes denormals (always false without MXCSR).
inline bool FlushingDenormals() {
#ifdef FULCRUM_HAS_MXCSR
  return (_mm_getcsr() & kFlushDenormalBits) == kFlushDenormalBits;
#else
  return false;
#endif
}

}  // namespace fulcrum

#endif  // FULCRUM_COMMON_FLOAT_ENV_H_
