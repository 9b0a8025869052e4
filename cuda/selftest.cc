// fulcrum-cuda-selftest: checks the CUDA library on this machine's GPU
// against host references, using the CUDA toolkit alone (so it runs on GPU
// machines without our Debian libraries). Exit codes: 0 pass, 1 fail,
// 77 no usable GPU (reported as skipped by ctest, with the reason printed).
#include <cmath>
#include <cstdio>
#include <cstring>
#include <vector>

#include <cuda_runtime_api.h>

#include "cuda/casts.h"
#include "cuda/device.h"

namespace {

uint16_t HostBf16(float f) {  // round to nearest even, as common/dtype.cc
  uint32_t b;
  std::memcpy(&b, &f, 4);
  b += 0x7fffu + ((b >> 16) & 1u);
  return static_cast<uint16_t>(b >> 16);
}

int failures = 0;
void Check(bool ok, const char* what) {
  std::printf("%s: %s\n", ok ? "PASS" : "FAIL", what);
  if (!ok) ++failures;
}

}  // namespace

int main() {
  std::string why;
  auto devices = fulcrum::cuda::ListDevices(&why);
  if (devices.empty()) {
    std::printf("SKIPPED: no usable GPU (%s); the CUDA library compiled, its kernels were not run\n",
                why.c_str());
    return 77;
  }
  for (const auto& d : devices) {
    std::printf("GPU %d: %s, sm_%d%d, %.1f GiB\n", d.ordinal, d.name.c_str(), d.compute_major,
                d.compute_minor, d.memory_bytes / 1073741824.0);
  }
  const size_t n = 1 << 20;
  std::vector<float> host(n);
  for (size_t i = 0; i < n; ++i) host[i] = std::sin(static_cast<float>(i)) * 1000.0f;
  float* d_in = nullptr;
  uint16_t* d_half = nullptr;
  float* d_back = nullptr;
  cudaStream_t stream;
  if (cudaMalloc(reinterpret_cast<void**>(&d_in), n * 4) != cudaSuccess ||
      cudaMalloc(reinterpret_cast<void**>(&d_half), n * 2) != cudaSuccess ||
      cudaMalloc(reinterpret_cast<void**>(&d_back), n * 4) != cudaSuccess ||
      cudaStreamCreate(&stream) != cudaSuccess) {
    std::printf("FAIL: cannot allocate device memory\n");
    return 1;
  }
  cudaMemcpy(d_in, host.data(), n * 4, cudaMemcpyHostToDevice);
  auto s = fulcrum::cuda::CastFp32ToBf16(d_in, d_half, n, stream);
  Check(s.ok, "CastFp32ToBf16 launches");
  std::vector<uint16_t> bf(n);
  cudaStreamSynchronize(stream);
  cudaMemcpy(bf.data(), d_half, n * 2, cudaMemcpyDeviceToHost);
  size_t mismatches = 0;
  for (size_t i = 0; i < n; ++i) mismatches += bf[i] != HostBf16(host[i]);
  Check(mismatches == 0, "fp32->bf16 matches the host conversion bit for bit");
  s = fulcrum::cuda::CastBf16ToFp32(d_half, d_back, n, stream);
  std::vector<float> back(n);
  cudaStreamSynchronize(stream);
  cudaMemcpy(back.data(), d_back, n * 4, cudaMemcpyDeviceToHost);
  bool close = s.ok;
  for (size_t i = 0; i < n && close; ++i) close = std::fabs(back[i] - host[i]) <= std::fabs(host[i]) / 256;
  Check(close, "bf16 round trip within 2^-8 relative");
  s = fulcrum::cuda::CastFp32ToFp16(d_in, d_half, n, stream);
  Check(s.ok, "CastFp32ToFp16 launches");
  s = fulcrum::cuda::CastFp16ToFp32(d_half, d_back, n, stream);
  cudaStreamSynchronize(stream);
  cudaMemcpy(back.data(), d_back, n * 4, cudaMemcpyDeviceToHost);
  close = s.ok;
  for (size_t i = 0; i < n && close; ++i) close = std::fabs(back[i] - host[i]) <= std::fabs(host[i]) / 2048;
  Check(close, "fp16 round trip within 2^-11 relative");
  cudaFree(d_in);
  cudaFree(d_half);
  cudaFree(d_back);
  cudaStreamDestroy(stream);
  return failures == 0 ? 0 : 1;
}
