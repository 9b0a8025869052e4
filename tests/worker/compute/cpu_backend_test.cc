// The CPU backend against naive reference loops, op by op.
#include <cmath>
#include <random>
#include <random>
#include <vector>

#include <catch2/catch.hpp>

#include "tests/testing/test_util.h"
#include "worker/compute/backend.h"

namespace fulcrum::compute {
namespace {

std::vector<float> Random(size_t n, uint32_t seed, float lo = -1, float hi = 1) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(lo, hi);
  std::vector<float> v(n);
  for (auto& x : v) x = u(rng);
  return v;
}

// C = op(A) op(B), row-major, in double.
std::vector<float> RefGemm(bool ta, bool tb, int M, int N, int K, const std::vector<float>& A,
                           const std::vector<float>& B) {
  std::vector<float> C(size_t{1} * M * N);
  for (int i = 0; i < M; ++i) {
    for (int j = 0; j < N; ++j) {
      double s = 0;
      for (int k = 0; k < K; ++k) {
        const float a = ta ? A[size_t{1} * k * M + i] : A[size_t{1} * i * K + k];
        const float b = tb ? B[size_t{1} * j * K + k] : B[size_t{1} * k * N + j];
        s += double{a} * b;
      }
      C[size_t{1} * i * N + j] = static_cast<float>(s);
    }
  }
  return C;
}

TEST_CASE("CPU GEMM matches a reference in every transpose combination") {
  auto be = NewCpuBackend(2);
  for (bool ta : {false, true}) {
    for (bool tb : {false, true}) {
      const int M = 7, N = 5, K = 9;
      auto A = Random(M * K, 1), B = Random(K * N, 2), C = Random(M * N, 3);
      auto want = RefGemm(ta, tb, M, N, K, A, B);
      // C = 2 AB + 0.5 C
      std::vector<float> got = C;
      REQUIRE_OK(be->Gemm(ta, tb, M, N, K, 2.0f, A.data(), B.data(), 0.5f, got.data()));
      for (int i = 0; i < M * N; ++i) REQUIRE(got[i] == Approx(2 * want[i] + 0.5f * C[i]).margin(1e-5));
    }
  }
}

TEST_CASE("CPU GEMM with bf16 and fp16 inputs rounds the inputs and accumulates in fp32") {
  auto be = NewCpuBackend(1);
  const int M = 16, N = 8, K = 32;
  auto A = Random(M * K, 4), B = Random(K * N, 5);
  auto want = RefGemm(false, false, M, N, K, A, B);
  for (DType t : {DType::kBf16, DType::kFp16}) {
    std::vector<uint16_t> a16(A.size()), b16(B.size());
    REQUIRE_OK(be->Cast(DType::kFp32, t, A.size(), A.data(), a16.data()));
    REQUIRE_OK(be->Cast(DType::kFp32, t, B.size(), B.data(), b16.data()));
    std::vector<float> got(M * N);
    REQUIRE_OK(be->GemmLowp(t, false, false, M, N, K, 1.0f, a16.data(), b16.data(), 0.0f, got.data()));
    // bf16 keeps 8 bits of mantissa: relative error per product ~2^-8, sums of 32 terms.
    const double tol = t == DType::kBf16 ? 0.1 : 0.01;
    double max_err = 0;
    for (int i = 0; i < M * N; ++i) max_err = std::max(max_err, std::fabs(double{got[i]} - want[i]));
    CHECK(max_err < tol);
    CHECK(max_err > 0);  // the inputs really were rounded
  }
  REQUIRE_STATUS(be->GemmLowp(DType::kFp32, false, false, 1, 1, 1, 1, nullptr, nullptr, 0, nullptr),
                 absl::StatusCode::kInvalidArgument, "bf16 or fp16");
}

TEST_CASE("bias, column sums, activations and their gradients") {
  auto be = NewCpuBackend(1);
  const int M = 3, N = 4;
  auto y = Random(M * N, 6), b = Random(N, 7);
  auto y0 = y;
  REQUIRE_OK(be->BiasAdd(M, N, b.data(), y.data()));
  for (int i = 0; i < M; ++i)
    for (int j = 0; j < N; ++j) REQUIRE(y[i * N + j] == Approx(y0[i * N + j] + b[j]));
  std::vector<float> cs(N);
  REQUIRE_OK(be->ColumnSum(M, N, y0.data(), cs.data()));
  for (int j = 0; j < N; ++j) REQUIRE(cs[j] == Approx(y0[j] + y0[N + j] + y0[2 * N + j]));

  auto x = Random(1000, 8, -3, 3);
  std::vector<float> out(x.size()), dx(x.size()), ones(x.size(), 1.0f);
  REQUIRE_OK(be->Activate(Activation::kRelu, x.size(), x.data(), out.data()));
  REQUIRE_OK(be->ActivateGrad(Activation::kRelu, x.size(), x.data(), ones.data(), dx.data()));
  for (size_t i = 0; i < x.size(); ++i) {
    REQUIRE(out[i] == std::max(x[i], 0.0f));
    REQUIRE(dx[i] == (x[i] > 0 ? 1.0f : 0.0f));
  }
  REQUIRE_OK(be->Activate(Activation::kGelu, x.size(), x.data(), out.data()));
  REQUIRE_OK(be->ActivateGrad(Activation::kGelu, x.size(), x.data(), ones.data(), dx.data()));
  for (size_t i = 0; i < x.size(); ++i) {
    const double v = x[i];
    REQUIRE(out[i] == Approx(0.5 * v * (1 + std::erf(v / std::sqrt(2.0)))).margin(1e-6));
    // derivative by central difference of the exact GELU
    const double e = 1e-4;
    auto g = [](double z) { return 0.5 * z * (1 + std::erf(z / std::sqrt(2.0))); };
    REQUIRE(dx[i] == Approx((g(v + e) - g(v - e)) / (2 * e)).margin(1e-4));
  }
}

TEST_CASE("softmax cross-entropy: loss, argmax and gradient") {
  auto be = NewCpuBackend(1);
  const int M = 4, N = 5;
  auto z = Random(M * N, 9, -4, 4);
  std::vector<int32_t> labels = {0, 4, 2, 2}, pred(M);
  std::vector<float> loss(M), d(M * N);
  REQUIRE_OK(be->SoftmaxCrossEntropy(M, N, z.data(), labels.data(), 0.5f, loss.data(), pred.data(), d.data()));
  for (int i = 0; i < M; ++i) {
    double mx = -1e30, sum = 0;
    int arg = 0;
    for (int j = 0; j < N; ++j) {
      if (z[i * N + j] > mx) { mx = z[i * N + j]; arg = j; }
    }
    for (int j = 0; j < N; ++j) sum += std::exp(z[i * N + j] - mx);
    REQUIRE(loss[i] == Approx(std::log(sum) - (z[i * N + labels[i]] - mx)).epsilon(1e-5));
    REQUIRE(pred[i] == arg);
    double row = 0;
    for (int j = 0; j < N; ++j) {
      const double p = std::exp(z[i * N + j] - mx) / sum;
      REQUIRE(d[i * N + j] == Approx(0.5 * (p - (j == labels[i]))).margin(1e-6));
      row += d[i * N + j];
    }
    REQUIRE(row == Approx(0).margin(1e-6));  // softmax gradients sum to zero per row
  }
  labels[1] = 5;
  REQUIRE_STATUS(be->SoftmaxCrossEntropy(M, N, z.data(), labels.data(), 1, loss.data(), pred.data(), nullptr),
                 absl::StatusCode::kInvalidArgument, "label 5 of row 1");
}

TEST_CASE("sigmoid cross-entropy is stable for large logits") {
  auto be = NewCpuBackend(1);
  std::vector<float> z = {-100, -2, 0, 3, 100}, y = {0, 1, 1, 0, 1}, loss(5), p(5), d(5);
  REQUIRE_OK(be->SigmoidCrossEntropy(5, z.data(), y.data(), 1, loss.data(), p.data(), d.data()));
  for (int i = 0; i < 5; ++i) {
    REQUIRE(std::isfinite(loss[i]));
    const double pp = 1 / (1 + std::exp(-double{z[i]}));
    REQUIRE(p[i] == Approx(pp).margin(1e-7));
    REQUIRE(d[i] == Approx(pp - y[i]).margin(1e-7));
  }
  REQUIRE(loss[0] == Approx(0).margin(1e-6));
  REQUIRE(loss[1] == Approx(std::log1p(std::exp(2.0))));
  REQUIRE(loss[3] == Approx(3 + std::log1p(std::exp(-3.0))));
}

TEST_CASE("gather, scatter-add with duplicate indices, embedding bags and their gradients") {
  auto be = NewCpuBackend(1);
  const int U = 4, dim = 3;
  auto rows = Random(U * dim, 10);
  std::vector<int32_t> idx = {2, 0, 2, 3};  // 2 twice
  std::vector<float> out(idx.size() * dim);
  REQUIRE_OK(be->Gather(4, dim, rows.data(), idx.data(), out.data()));
  for (int i = 0; i < 4; ++i)
    for (int k = 0; k < dim; ++k) REQUIRE(out[i * dim + k] == rows[idx[i] * dim + k]);
  std::vector<float> acc(U * dim, 0.0f);
  REQUIRE_OK(be->ScatterAdd(4, dim, out.data(), idx.data(), acc.data()));
  for (int k = 0; k < dim; ++k) {
    REQUIRE(acc[2 * dim + k] == Approx(2 * rows[2 * dim + k]));  // duplicates add up
    REQUIRE(acc[1 * dim + k] == 0.0f);
  }

  // Bags: b0 = {2 (x0.5), 0 (x2)}, b1 = {}, b2 = {2, 2 (x-1), 3}
  std::vector<int32_t> offsets = {0, 2, 2, 5}, bidx = {2, 0, 2, 2, 3};
  std::vector<float> vals = {0.5f, 2.0f, 1.0f, -1.0f, 3.0f};
  std::vector<float> bag(3 * dim), sq(3 * dim);
  REQUIRE_OK(be->EmbeddingBag(3, dim, rows.data(), offsets.data(), bidx.data(), vals.data(), false, bag.data()));
  REQUIRE_OK(be->EmbeddingBag(3, dim, rows.data(), offsets.data(), bidx.data(), vals.data(), true, sq.data()));
  for (int k = 0; k < dim; ++k) {
    REQUIRE(bag[k] == Approx(0.5f * rows[2 * dim + k] + 2 * rows[k]));
    REQUIRE(bag[dim + k] == 0.0f);
    REQUIRE(bag[2 * dim + k] == Approx(3 * rows[3 * dim + k]).margin(1e-6));
    const float r2 = rows[2 * dim + k], r3 = rows[3 * dim + k];
    REQUIRE(sq[2 * dim + k] == Approx(2 * r2 * r2 + 9 * r3 * r3));
  }
  std::vector<float> dout = Random(3 * dim, 11), grad(U * dim, 0.0f), gsq(U * dim, 0.0f);
  REQUIRE_OK(be->EmbeddingBagGrad(3, dim, dout.data(), offsets.data(), bidx.data(), vals.data(), false, nullptr,
                                  grad.data()));
  REQUIRE_OK(be->EmbeddingBagGrad(3, dim, dout.data(), offsets.data(), bidx.data(), vals.data(), true, rows.data(),
                                  gsq.data()));
  for (int k = 0; k < dim; ++k) {
    REQUIRE(grad[k] == Approx(2 * dout[k]));
    REQUIRE(grad[2 * dim + k] == Approx(0.5f * dout[k] + 0 * dout[2 * dim + k]).margin(1e-6));  // +1 and -1 cancel
    REQUIRE(grad[3 * dim + k] == Approx(3 * dout[2 * dim + k]));
    REQUIRE(gsq[2 * dim + k] == Approx(2 * 0.25f * rows[2 * dim + k] * dout[k] + 2 * 2 * rows[2 * dim + k] * dout[2 * dim + k]));
  }
}

TEST_CASE("row dots, row scaling, reductions and finiteness") {
  auto be = NewCpuBackend(1);
  std::vector<float> a = {1, 2, 3, 9, 4, 5, 6, 9}, b = {1, 1, 1, 2, 2, 2}, out(2);
  REQUIRE_OK(be->RowDot(2, 3, a.data(), 4, b.data(), 3, out.data()));
  REQUIRE(out[0] == 6);
  REQUIRE(out[1] == 30);
  std::vector<float> s = {2, -1}, y(8, 7.0f);
  REQUIRE_OK(be->ScaleRows(2, 3, s.data(), a.data(), 4, y.data(), 4));
  REQUIRE(y == std::vector<float>{2, 4, 6, 7, -4, -5, -6, 7});
  REQUIRE_OK(be->ScaleRows(2, 2, s.data(), nullptr, 0, y.data(), 4));
  REQUIRE(y == std::vector<float>{2, 2, 6, 7, -1, -1, -6, 7});
  REQUIRE_OK_AND_ASSIGN(double ss, be->SumSquares(3, a.data()));
  REQUIRE(ss == 14);
  REQUIRE_OK_AND_ASSIGN(bool finite, be->AllFinite(a.size(), a.data()));
  REQUIRE(finite);
  a[5] = std::nanf("");
  REQUIRE_OK_AND_ASSIGN(finite, be->AllFinite(a.size(), a.data()));
  REQUIRE_FALSE(finite);
}

TEST_CASE("backend selection by name") {
  std::string why;
  REQUIRE_OK_AND_ASSIGN(auto cpu, CreateBackend("cpu", &why));
  REQUIRE_FALSE(cpu->is_gpu());
  REQUIRE(cpu->name().find("cpu") == 0);
  REQUIRE_OK_AND_ASSIGN(auto any, CreateBackend("auto", &why));
  INFO(why);
  REQUIRE(!why.empty());
  REQUIRE_STATUS(CreateBackend("tpu:0", &why).status(), absl::StatusCode::kInvalidArgument, "allowed values are auto, cpu, cuda:N");
  REQUIRE_STATUS(CreateBackend("cuda:x", &why).status(), absl::StatusCode::kInvalidArgument, "cuda:N");
  // The worker checks its --device flag with this before touching a device.
  for (const char* ok : {"auto", "cpu", "cuda", "cuda:0", "cuda:7"}) REQUIRE_OK(CheckDeviceName(ok));
  REQUIRE_STATUS(CheckDeviceName("cuda:-1"), absl::StatusCode::kInvalidArgument, "cuda:N");
  REQUIRE_STATUS(CheckDeviceName("gpu"), absl::StatusCode::kInvalidArgument, "allowed values are auto, cpu, cuda:N");
  REQUIRE_STATUS(CheckDeviceName(""), absl::StatusCode::kInvalidArgument, "allowed values");
  if (!any->is_gpu()) {
    // No GPU here: asking for one says why instead of crashing.
    auto gpu = CreateBackend("cuda:0", &why);
    REQUIRE_FALSE(gpu.ok());
    REQUIRE(gpu.status().code() == absl::StatusCode::kFailedPrecondition);
  }
}

}  // namespace
}  // namespace fulcrum::compute

namespace fulcrum::compute {
namespace {

TEST_CASE("multi-threaded embedding bags and their gradients equal the single-threaded ones bit for bit") {
  auto one = NewCpuBackend(1), many = NewCpuBackend(4);
  const int U = 5000, dim = 16, B = 2048;
  auto rows = Random(size_t{1} * U * dim, 30);
  std::mt19937 rng(31);
  std::vector<int32_t> offsets = {0}, idx;
  for (int b = 0; b < B; ++b) {
    const int n = 1 + rng() % 40;
    for (int j = 0; j < n; ++j) idx.push_back(rng() % 2 ? rng() % 50 : rng() % U);  // hot rows repeat
    offsets.push_back(static_cast<int32_t>(idx.size()));
  }
  REQUIRE(size_t{1} * idx.size() * dim > (size_t{1} << 18));  // large enough to be split
  auto vals = Random(idx.size(), 32), dout = Random(size_t{1} * B * dim, 33);
  for (bool square : {false, true}) {
    std::vector<float> o1(size_t{1} * B * dim), o2(o1.size()), g1(size_t{1} * U * dim, 0.0f), g2(g1.size(), 0.0f);
    REQUIRE_OK(one->EmbeddingBag(B, dim, rows.data(), offsets.data(), idx.data(), vals.data(), square, o1.data()));
    REQUIRE_OK(many->EmbeddingBag(B, dim, rows.data(), offsets.data(), idx.data(), vals.data(), square, o2.data()));
    REQUIRE(o1 == o2);
    REQUIRE_OK(one->EmbeddingBagGrad(B, dim, dout.data(), offsets.data(), idx.data(), vals.data(), square, rows.data(),
                                     g1.data()));
    REQUIRE_OK(many->EmbeddingBagGrad(B, dim, dout.data(), offsets.data(), idx.data(), vals.data(), square,
                                      rows.data(), g2.data()));
    REQUIRE(g1 == g2);
  }
}

}  // namespace
}  // namespace fulcrum::compute
