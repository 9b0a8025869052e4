// GPU tests: every CUDA kernel and cuBLAS call against the CPU backend, and
// every model's gradients on the GPU against the CPU's. Where there is no
// usable GPU (or the build has no CUDA) each case prints "SKIPPED: no GPU"
// with the reason, and ctest reports it as skipped.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include "tests/testing/source_dir.h"
#include "tests/testing/test_util.h"
#include "worker/compute/backend.h"
#include "common/config/spec_text.h"
#include "worker/models/model.h"

namespace fulcrum::compute {
namespace {

using testing::SourceDir;

std::unique_ptr<Backend> Gpu() {
  std::string why;
  auto b = CreateBackend("auto", &why);
  if (!b.ok() || !(*b)->is_gpu()) {
    std::printf("SKIPPED: no GPU (%s)\n", b.ok() ? why.c_str() : std::string(b.status().message()).c_str());
    return nullptr;
  }
  std::printf("running on %s\n", (*b)->name().c_str());
  return std::move(*b);
}

template <typename T>
std::vector<T> Random(size_t n, uint32_t seed, float lo = -1, float hi = 1) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(lo, hi);
  std::vector<T> v(n);
  for (auto& x : v) x = static_cast<T>(u(rng));
  return v;
}

// A device copy of a host vector, and back.
template <typename T>
Buffer Up(Backend& be, const std::vector<T>& v) {
  auto b = be.Allocate(v.size() * sizeof(T));
  REQUIRE_OK(b.status());
  REQUIRE_OK(be.CopyToDevice(b->data(), v.data(), v.size() * sizeof(T)));
  return std::move(*b);
}
template <typename T>
std::vector<T> Down(Backend& be, const Buffer& b, size_t n) {
  std::vector<T> v(n);
  REQUIRE_OK(be.CopyToHost(v.data(), b.data(), n * sizeof(T)));
  REQUIRE_OK(be.Synchronize());
  return v;
}

void Close(const std::vector<float>& gpu, const std::vector<float>& cpu, double rel = 1e-5, double abs = 1e-5) {
  REQUIRE(gpu.size() == cpu.size());
  for (size_t i = 0; i < gpu.size(); ++i) {
    INFO("element " << i);
    REQUIRE(gpu[i] == Approx(cpu[i]).epsilon(rel).margin(abs));
  }
}

TEST_CASE("GPU: GEMMs (fp32, bf16, fp16) match the CPU backend", "[gpu]") {
  auto gpu = Gpu();
  if (!gpu) return;
  auto cpu = NewCpuBackend(0);
  for (bool ta : {false, true}) {
    for (bool tb : {false, true}) {
      const int M = 67, N = 33, K = 129;
      auto A = Random<float>(M * K, 1), B = Random<float>(K * N, 2), C = Random<float>(M * N, 3);
      auto want = C;
      REQUIRE_OK(cpu->Gemm(ta, tb, M, N, K, 1.5f, A.data(), B.data(), 0.5f, want.data()));
      Buffer a = Up(*gpu, A), b = Up(*gpu, B), c = Up(*gpu, C);
      REQUIRE_OK(gpu->Gemm(ta, tb, M, N, K, 1.5f, a.as<float>(), b.as<float>(), 0.5f, c.as<float>()));
      // cuBLAS may use TF32-free fp32 but a different summation order.
      Close(Down<float>(*gpu, c, M * N), want, 1e-4, 1e-4);
      for (DType t : {DType::kBf16, DType::kFp16}) {
        std::vector<uint16_t> a16(A.size()), b16(B.size());
        REQUIRE_OK(cpu->Cast(DType::kFp32, t, A.size(), A.data(), a16.data()));
        REQUIRE_OK(cpu->Cast(DType::kFp32, t, B.size(), B.data(), b16.data()));
        std::vector<float> w(M * N);
        REQUIRE_OK(cpu->GemmLowp(t, ta, tb, M, N, K, 1.0f, a16.data(), b16.data(), 0.0f, w.data()));
        Buffer a2 = Up(*gpu, a16), b2 = Up(*gpu, b16), c2 = Up(*gpu, std::vector<float>(M * N));
        REQUIRE_OK(gpu->GemmLowp(t, ta, tb, M, N, K, 1.0f, a2.as<uint16_t>(), b2.as<uint16_t>(), 0.0f, c2.as<float>()));
        // Same rounded inputs, fp32 accumulation on both sides.
        Close(Down<float>(*gpu, c2, M * N), w, 1e-3, 1e-3);
      }
    }
  }
}

TEST_CASE("GPU: fused dense layers (cuBLASLt epilogues) match the CPU's composed calls", "[gpu]") {
  auto gpu = Gpu();
  if (!gpu) return;
  auto cpu = NewCpuBackend(0);
  // Widths that need padded aux rows (100: not a multiple of 8 or 128).
  const int M = 96, N = 100, K = 72;
  for (DType t : {DType::kFp32, DType::kBf16, DType::kFp16}) {
    for (Activation act : {Activation::kNone, Activation::kRelu, Activation::kGelu}) {
      INFO(DTypeName(t) << " " << ActivationName(act));
      const bool lowp = t != DType::kFp32;
      const size_t es = lowp ? 2 : 4;
      auto X = Random<float>(size_t{1} * M * K, 11), W = Random<float>(size_t{1} * K * N, 12),
           bias = Random<float>(N, 13), dZ = Random<float>(size_t{1} * M * K, 14);
      // The GEMM inputs in the layer's type, the same bits on both devices.
      auto typed = [&](const std::vector<float>& v) {
        std::vector<uint8_t> out(v.size() * es);
        if (lowp) REQUIRE_OK(cpu->Cast(DType::kFp32, t, v.size(), v.data(), out.data()));
        else std::memcpy(out.data(), v.data(), out.size());
        return out;
      };
      const auto x = typed(X), w = typed(W), dz = typed(dZ);
      // CPU: forward K -> N, the gradient from a layer above (N -> K, its
      // weight W's values as N x K) into it, its weight gradient.
      std::vector<float> y(size_t{1} * M * N), aux(cpu->DenseAuxBytes(t, act, M, N) / 4 + 1);
      std::vector<uint16_t> y16(size_t{1} * M * N);
      REQUIRE_OK(cpu->DenseForward(t, M, N, K, x.data(), w.data(), bias.data(), act, aux.data(), y.data(),
                                   lowp ? y16.data() : nullptr));
      std::vector<float> dx(size_t{1} * M * N), db_below(N), dw(size_t{1} * K * N), db(N);
      std::vector<uint16_t> dx16(size_t{1} * M * N);
      if (act != Activation::kNone) {
        REQUIRE_OK(cpu->DenseInputGrad(t, M, K, N, dz.data(), w.data(), act, aux.data(), dx.data(),
                                       lowp ? dx16.data() : nullptr, db_below.data()));
      }
      std::vector<float> dzf(size_t{1} * M * N);
      for (size_t i = 0; i < dzf.size(); ++i) dzf[i] = dZ[i % dZ.size()];
      const auto dzt = typed(dzf);
      REQUIRE_OK(cpu->DenseWeightGrad(t, M, N, K, x.data(), dzt.data(), dzf.data(), dw.data(), db.data()));

      Buffer gx = Up(*gpu, x), gw = Up(*gpu, w), gb = Up(*gpu, bias), gdz = Up(*gpu, dz), gdzt = Up(*gpu, dzt),
             gdzf = Up(*gpu, dzf);
      auto alloc = [&](size_t bytes) {
        auto b = gpu->Allocate(std::max<size_t>(1, bytes));
        REQUIRE_OK(b.status());
        return std::move(*b);
      };
      Buffer gaux = alloc(gpu->DenseAuxBytes(t, act, M, N)), gy = alloc(4 * y.size()), gy16 = alloc(2 * y.size()),
             gdx = alloc(4 * dx.size()), gdx16 = alloc(2 * dx.size()), gdbb = alloc(4 * N), gdw = alloc(4 * dw.size()),
             gdb = alloc(4 * N);
      REQUIRE_OK(gpu->DenseForward(t, M, N, K, gx.data(), gw.data(), gb.as<float>(), act, gaux.data(), gy.as<float>(),
                                   lowp ? gy16.as<uint16_t>() : nullptr));
      const double tol = lowp ? 2e-2 : 1e-4;
      // 16-bit layers are compared as the 16-bit outputs the next GEMM reads,
      // except the last (kNone), whose fp32 logits are the output.
      auto widen = [&](const std::vector<uint16_t>& h) {
        std::vector<float> f(h.size());
        REQUIRE_OK(cpu->Cast(t, DType::kFp32, h.size(), h.data(), f.data()));
        return f;
      };
      if (lowp && act != Activation::kNone) {
        Close(widen(Down<uint16_t>(*gpu, gy16, y16.size())), widen(y16), tol, tol);
      } else {
        Close(Down<float>(*gpu, gy, y.size()), y, tol, tol);
      }
      if (act != Activation::kNone) {
        REQUIRE_OK(gpu->DenseInputGrad(t, M, K, N, gdz.data(), gw.data(), act, gaux.data(), gdx.as<float>(),
                                       lowp ? gdx16.as<uint16_t>() : nullptr, gdbb.as<float>()));
        if (lowp) Close(widen(Down<uint16_t>(*gpu, gdx16, dx16.size())), widen(dx16), tol, tol);
        else Close(Down<float>(*gpu, gdx, dx.size()), dx, tol, tol);
        Close(Down<float>(*gpu, gdbb, N), db_below, lowp ? 5e-2 : 1e-4, lowp ? 5e-2 : 1e-3);
      }
      REQUIRE_OK(gpu->DenseWeightGrad(t, M, N, K, gx.data(), gdzt.data(), gdzf.as<float>(), gdw.as<float>(),
                                      gdb.as<float>()));
      Close(Down<float>(*gpu, gdw, dw.size()), dw, tol, tol);
      Close(Down<float>(*gpu, gdb, N), db, lowp ? 5e-2 : 1e-4, lowp ? 5e-2 : 1e-3);
    }
  }
}

TEST_CASE("GPU: casts are bit-identical to the CPU's", "[gpu]") {
  auto gpu = Gpu();
  if (!gpu) return;
  auto cpu = NewCpuBackend(1);
  auto x = Random<float>(100003, 4, -70000, 70000);
  x[0] = 0;
  x[1] = -0.0f;
  x[2] = 1e-8f;
  for (DType t : {DType::kBf16, DType::kFp16}) {
    std::vector<uint16_t> want(x.size());
    REQUIRE_OK(cpu->Cast(DType::kFp32, t, x.size(), x.data(), want.data()));
    Buffer in = Up(*gpu, x), out = Up(*gpu, std::vector<uint16_t>(x.size()));
    REQUIRE_OK(gpu->Cast(DType::kFp32, t, x.size(), in.data(), out.data()));
    REQUIRE(Down<uint16_t>(*gpu, out, x.size()) == want);
    std::vector<float> back(x.size());
    REQUIRE_OK(cpu->Cast(t, DType::kFp32, x.size(), want.data(), back.data()));
    Buffer f = Up(*gpu, std::vector<float>(x.size()));
    REQUIRE_OK(gpu->Cast(t, DType::kFp32, x.size(), out.data(), f.data()));
    auto got = Down<float>(*gpu, f, x.size());
    REQUIRE(std::memcmp(got.data(), back.data(), back.size() * 4) == 0);
  }
}

TEST_CASE("GPU: element-wise kernels, reductions and losses match the CPU backend", "[gpu]") {
  auto gpu = Gpu();
  if (!gpu) return;
  auto cpu = NewCpuBackend(1);
  const int M = 300, N = 37;
  auto y = Random<float>(M * N, 5, -3, 3), bias = Random<float>(N, 6);
  {
    auto want = y;
    REQUIRE_OK(cpu->BiasAdd(M, N, bias.data(), want.data()));
    Buffer d = Up(*gpu, y), b = Up(*gpu, bias);
    REQUIRE_OK(gpu->BiasAdd(M, N, b.as<float>(), d.as<float>()));
    Close(Down<float>(*gpu, d, M * N), want);
    std::vector<float> cs(N);
    REQUIRE_OK(cpu->ColumnSum(M, N, y.data(), cs.data()));
    Buffer x = Up(*gpu, y), o = Up(*gpu, std::vector<float>(N));
    REQUIRE_OK(gpu->ColumnSum(M, N, x.as<float>(), o.as<float>()));
    Close(Down<float>(*gpu, o, N), cs, 1e-4, 1e-4);
  }
  for (Activation a : {Activation::kRelu, Activation::kGelu}) {
    auto dy = Random<float>(y.size(), 7);
    std::vector<float> f(y.size()), g(y.size());
    REQUIRE_OK(cpu->Activate(a, y.size(), y.data(), f.data()));
    REQUIRE_OK(cpu->ActivateGrad(a, y.size(), y.data(), dy.data(), g.data()));
    Buffer x = Up(*gpu, y), d = Up(*gpu, dy), of = Up(*gpu, f), og = Up(*gpu, g);
    REQUIRE_OK(gpu->Activate(a, y.size(), x.as<float>(), of.as<float>()));
    REQUIRE_OK(gpu->ActivateGrad(a, y.size(), x.as<float>(), d.as<float>(), og.as<float>()));
    Close(Down<float>(*gpu, of, y.size()), f);
    Close(Down<float>(*gpu, og, y.size()), g);
  }
  {
    std::vector<int32_t> labels(M);
    for (int i = 0; i < M; ++i) labels[i] = i % N;
    std::vector<float> loss(M), d(M * N);
    std::vector<int32_t> pred(M);
    REQUIRE_OK(cpu->SoftmaxCrossEntropy(M, N, y.data(), labels.data(), 0.25f, loss.data(), pred.data(), d.data()));
    Buffer z = Up(*gpu, y), l = Up(*gpu, labels), gl = Up(*gpu, loss), gp = Up(*gpu, pred), gd = Up(*gpu, d);
    REQUIRE_OK(gpu->SoftmaxCrossEntropy(M, N, z.as<float>(), l.as<int32_t>(), 0.25f, gl.as<float>(), gp.as<int32_t>(),
                                        gd.as<float>()));
    Close(Down<float>(*gpu, gl, M), loss, 1e-5, 1e-5);
    REQUIRE(Down<int32_t>(*gpu, gp, M) == pred);
    Close(Down<float>(*gpu, gd, M * N), d, 1e-4, 1e-6);
  }
  {
    auto z = Random<float>(M, 8, -30, 30), lab = Random<float>(M, 9, 0, 1);
    for (auto& v : lab) v = v > 0.5f ? 1.0f : 0.0f;
    std::vector<float> loss(M), p(M), d(M), sq(M), sd(M);
    REQUIRE_OK(cpu->SigmoidCrossEntropy(M, z.data(), lab.data(), 0.5f, loss.data(), p.data(), d.data()));
    REQUIRE_OK(cpu->SquaredError(M, z.data(), lab.data(), 0.5f, sq.data(), sd.data()));
    Buffer gz = Up(*gpu, z), gy = Up(*gpu, lab), a = Up(*gpu, loss), b = Up(*gpu, p), c = Up(*gpu, d),
           e = Up(*gpu, sq), f = Up(*gpu, sd);
    REQUIRE_OK(gpu->SigmoidCrossEntropy(M, gz.as<float>(), gy.as<float>(), 0.5f, a.as<float>(), b.as<float>(),
                                        c.as<float>()));
    REQUIRE_OK(gpu->SquaredError(M, gz.as<float>(), gy.as<float>(), 0.5f, e.as<float>(), f.as<float>()));
    Close(Down<float>(*gpu, a, M), loss, 1e-5, 1e-6);
    Close(Down<float>(*gpu, b, M), p, 1e-5, 1e-7);
    Close(Down<float>(*gpu, c, M), d, 1e-5, 1e-7);
    Close(Down<float>(*gpu, e, M), sq);
    Close(Down<float>(*gpu, f, M), sd);
  }
  {
    auto x = Random<float>(1 << 20, 10);
    Buffer d = Up(*gpu, x);
    REQUIRE_OK_AND_ASSIGN(double want, cpu->SumSquares(x.size(), x.data()));
    REQUIRE_OK_AND_ASSIGN(double got, gpu->SumSquares(x.size(), d.as<float>()));
    REQUIRE(got == Approx(want).epsilon(1e-9));
    REQUIRE_OK_AND_ASSIGN(bool finite, gpu->AllFinite(x.size(), d.as<float>()));
    REQUIRE(finite);
    x[777777] = INFINITY;
    Buffer e = Up(*gpu, x);
    REQUIRE_OK_AND_ASSIGN(finite, gpu->AllFinite(x.size(), e.as<float>()));
    REQUIRE_FALSE(finite);
  }
}

TEST_CASE("GPU: a download on its own stream sees the work queued before it and lands before its wait returns", "[gpu]") {
  auto gpu = Gpu();
  if (!gpu) return;
  const size_t n = size_t{1} << 22;  // 16 MiB: long enough for the copy to be in flight
  auto x = Random<float>(n, 77);
  Buffer d = Up(*gpu, x);
  REQUIRE_OK(gpu->Synchronize());
  REQUIRE_OK(gpu->Scale(n, 2.0f, d.as<float>()));  // queued, not waited for
  auto host = gpu->AllocateHost(n * 4);
  REQUIRE_OK(host.status());
  UploadEvent done;
  REQUIRE_OK(gpu->DownloadAsync(host->data(), d.data(), n * 4, &done));
  REQUIRE(done.handle != nullptr);
  REQUIRE_OK(gpu->WaitForDownload(done));
  const float* got = host->as<float>();
  for (size_t i = 0; i < n; i += 4099) {
    INFO("element " << i);
    REQUIRE(got[i] == 2.0f * x[i]);
  }
  REQUIRE(got[n - 1] == 2.0f * x[n - 1]);
}

TEST_CASE("GPU: the inner optimizers (local steps) update weights and state as the CPU backend does", "[gpu]") {
  auto gpu = Gpu();
  if (!gpu) return;
  auto cpu = NewCpuBackend(1);
  const size_t n = 4099;  // not a multiple of a block
  using Kind = InnerOptimizer::Kind;
  for (Kind kind : {Kind::kSgd, Kind::kMomentum, Kind::kAdam, Kind::kAdamW}) {
    for (bool variant : {false, true}) {  // Nesterov for momentum; weight decay for the others
      InnerOptimizer o;
      o.kind = kind;
      o.learning_rate = kind == Kind::kSgd || kind == Kind::kMomentum ? 0.05f : 0.001f;
      o.momentum = kind == Kind::kMomentum ? 0.9f : 0;
      o.nesterov = kind == Kind::kMomentum && variant;
      o.weight_decay = kind != Kind::kMomentum && variant ? 0.01f : 0;
      INFO("kind " << static_cast<int>(kind) << " variant " << variant);
      auto w = Random<float>(n, 31), m = std::vector<float>(n), v = std::vector<float>(n);
      Buffer dw = Up(*gpu, w), dm = Up(*gpu, m), dv = Up(*gpu, v);
      for (uint64_t t = 1; t <= 3; ++t) {
        auto g = Random<float>(n, 40 + static_cast<uint32_t>(t));
        REQUIRE_OK(cpu->OptimizerUpdate(o, n, w.data(), g.data(), m.data(), v.data(), t));
        Buffer dg = Up(*gpu, g);
        REQUIRE_OK(gpu->OptimizerUpdate(o, n, dw.as<float>(), dg.as<float>(), dm.as<float>(), dv.as<float>(), t));
      }
      Close(Down<float>(*gpu, dw, n), w, 1e-5, 1e-6);
      if (o.slots() >= 1) Close(Down<float>(*gpu, dm, n), m, 1e-5, 1e-6);
      if (o.slots() >= 2) Close(Down<float>(*gpu, dv, n), v, 1e-5, 1e-9);
    }
  }
}

TEST_CASE("GPU: gather, scatter-add with duplicates, embedding bags, row ops match the CPU backend", "[gpu]") {
  auto gpu = Gpu();
  if (!gpu) return;
  auto cpu = NewCpuBackend(1);
  const int U = 50, dim = 19, B = 64;
  auto rows = Random<float>(U * dim, 11);
  std::mt19937 rng(12);
  std::vector<int32_t> offsets = {0}, idx;
  for (int b = 0; b < B; ++b) {
    const int n = rng() % 6;  // empty bags included
    for (int j = 0; j < n; ++j) idx.push_back(rng() % 8);  // few distinct rows: many duplicates
    offsets.push_back(static_cast<int32_t>(idx.size()));
  }
  auto vals = Random<float>(idx.size(), 13);
  auto dout = Random<float>(B * dim, 14);
  Buffer r = Up(*gpu, rows), o = Up(*gpu, offsets), ix = Up(*gpu, idx), v = Up(*gpu, vals), d = Up(*gpu, dout);
  for (bool square : {false, true}) {
    std::vector<float> bag(B * dim), grad(U * dim, 0.0f);
    REQUIRE_OK(cpu->EmbeddingBag(B, dim, rows.data(), offsets.data(), idx.data(), vals.data(), square, bag.data()));
    REQUIRE_OK(cpu->EmbeddingBagGrad(B, dim, dout.data(), offsets.data(), idx.data(), vals.data(), square, rows.data(),
                                     grad.data()));
    Buffer gb = Up(*gpu, bag), gg = Up(*gpu, std::vector<float>(U * dim, 0.0f));
    REQUIRE_OK(gpu->EmbeddingBag(B, dim, r.as<float>(), o.as<int32_t>(), ix.as<int32_t>(), v.as<float>(), square,
                                 gb.as<float>()));
    REQUIRE_OK(gpu->EmbeddingBagGrad(B, dim, d.as<float>(), o.as<int32_t>(), ix.as<int32_t>(), v.as<float>(), square,
                                     r.as<float>(), gg.as<float>()));
    Close(Down<float>(*gpu, gb, B * dim), bag, 1e-5, 1e-6);
    Close(Down<float>(*gpu, gg, U * dim), grad, 1e-4, 1e-5);  // atomics add in another order
  }
  {
    std::vector<float> g(idx.size() * dim), acc(U * dim, 0.0f);
    REQUIRE_OK(cpu->Gather(static_cast<int>(idx.size()), dim, rows.data(), idx.data(), g.data()));
    REQUIRE_OK(cpu->ScatterAdd(static_cast<int>(idx.size()), dim, g.data(), idx.data(), acc.data()));
    Buffer gg = Up(*gpu, g), ga = Up(*gpu, std::vector<float>(U * dim, 0.0f));
    REQUIRE_OK(gpu->Gather(static_cast<int>(idx.size()), dim, r.as<float>(), ix.as<int32_t>(), gg.as<float>()));
    REQUIRE(Down<float>(*gpu, gg, g.size()) == g);
    REQUIRE_OK(gpu->ScatterAdd(static_cast<int>(idx.size()), dim, gg.as<float>(), ix.as<int32_t>(), ga.as<float>()));
    Close(Down<float>(*gpu, ga, U * dim), acc, 1e-5, 1e-5);
  }
  {
    const int M = 40, K = 7, lda = 9;
    auto a = Random<float>(M * lda, 15), b = Random<float>(M * K, 16), s = Random<float>(M, 17);
    std::vector<float> dot(M), y(M * lda, 3.0f), y2(M * lda, 3.0f);
    REQUIRE_OK(cpu->RowDot(M, K, a.data(), lda, b.data(), K, dot.data()));
    REQUIRE_OK(cpu->ScaleRows(M, K, s.data(), a.data(), lda, y.data(), lda));
    REQUIRE_OK(cpu->ScaleRows(M, K, s.data(), nullptr, 0, y2.data(), lda));
    Buffer ga = Up(*gpu, a), gb2 = Up(*gpu, b), gs = Up(*gpu, s), gd = Up(*gpu, std::vector<float>(M)),
           gy = Up(*gpu, std::vector<float>(M * lda, 3.0f)), gy2 = Up(*gpu, std::vector<float>(M * lda, 3.0f));
    REQUIRE_OK(gpu->RowDot(M, K, ga.as<float>(), lda, gb2.as<float>(), K, gd.as<float>()));
    REQUIRE_OK(gpu->ScaleRows(M, K, gs.as<float>(), ga.as<float>(), lda, gy.as<float>(), lda));
    REQUIRE_OK(gpu->ScaleRows(M, K, gs.as<float>(), nullptr, 0, gy2.as<float>(), lda));
    Close(Down<float>(*gpu, gd, M), dot, 1e-5, 1e-6);
    Close(Down<float>(*gpu, gy, M * lda), y);
    Close(Down<float>(*gpu, gy2, M * lda), y2);
    auto x = Random<float>(1000, 18);
    auto yy = Random<float>(1000, 19);
    auto want = yy;
    REQUIRE_OK(cpu->Axpy(1000, 0.3f, x.data(), want.data()));
    REQUIRE_OK(cpu->Scale(1000, -2.0f, want.data()));
    Buffer gx = Up(*gpu, x), gyy = Up(*gpu, yy);
    REQUIRE_OK(gpu->Axpy(1000, 0.3f, gx.as<float>(), gyy.as<float>()));
    REQUIRE_OK(gpu->Scale(1000, -2.0f, gyy.as<float>()));
    Close(Down<float>(*gpu, gyy, 1000), want);
  }
}

// Runs one training step of `config` on a backend with fixed parameter
// values; returns every table's gradient.
std::vector<std::vector<float>> Grads(Backend& be, const models::ModelConfig& config, const data::Batch& batch) {
  auto model = models::CreateModel(config, &be);
  REQUIRE_OK(model.status());
  REQUIRE_OK((*model)->Prepare(batch));
  std::mt19937 rng(21);
  std::normal_distribution<float> n(0, 0.3f);
  for (models::Table& t : (*model)->tables()) {
    std::vector<float> v(t.elements);
    for (auto& x : v) x = n(rng);
    REQUIRE_OK(be.CopyToDevice(t.value.data(), v.data(), v.size() * 4));
  }
  absl::StatusOr<models::Metrics> m = (*model)->Run(batch, true);
  REQUIRE_OK(m.status());
  REQUIRE_FALSE(m->skipped);  // an fp16 step that overflowed compares nothing
  std::vector<std::vector<float>> out;
  for (models::Table& t : (*model)->tables()) out.push_back(Down<float>(be, t.grad, t.elements));
  return out;
}

TEST_CASE("GPU: batches gathered and decoded from stored bytes equal the CPU's, bit for bit", "[gpu]") {
  auto gpu = Gpu();
  if (!gpu) return;
  auto cpu = NewCpuBackend(1);
  const int rows = 1000, cols = 784, B = 513;  // MNIST rows; a batch not a multiple of a warp
  std::mt19937 rng(21);
  std::vector<uint8_t> table(size_t{1} * rows * cols);
  for (auto& b : table) b = static_cast<uint8_t>(rng());
  std::vector<int32_t> idx(B);
  for (auto& i : idx) i = static_cast<int32_t>(rng() % rows);  // duplicates too
  const float scale = 1.0f / 255;
  std::vector<float> want(size_t{1} * B * cols);
  REQUIRE_OK(cpu->GatherScaleU8(B, cols, table.data(), idx.data(), scale, want.data()));
  Buffer t = Up(*gpu, table), ix = Up(*gpu, idx), out = Up(*gpu, std::vector<float>(want.size(), -1.0f));
  REQUIRE_OK(gpu->GatherScaleU8(B, cols, t.as<uint8_t>(), ix.as<int32_t>(), scale, out.as<float>()));
  REQUIRE(Down<float>(*gpu, out, want.size()) == want);
}

TEST_CASE("GPU: every model's gradients match the CPU's, bf16 and fp16 within their precision", "[gpu]") {
  auto gpu = Gpu();
  if (!gpu) return;
  auto cpu = NewCpuBackend(0);
  std::mt19937 rng(22);
  std::normal_distribution<float> n(0, 1);
  data::Batch dense;
  dense.size = 128;
  dense.num_features = 100;
  for (int i = 0; i < 128 * 100; ++i) dense.dense.push_back(n(rng));
  for (int i = 0; i < 128; ++i) dense.labels.push_back(static_cast<float>(i % 10));
  data::Batch sparse;
  sparse.size = 128;
  sparse.offsets.push_back(0);
  for (int i = 0; i < 128; ++i) {
    for (int j = 0; j < 2; ++j) {
      sparse.keys.push_back(j == 0 ? rng() % 20 : 1000 + rng() % 20);
      sparse.values.push_back(1.0f);
    }
    sparse.offsets.push_back(static_cast<int32_t>(sparse.keys.size()));
    sparse.labels.push_back(static_cast<float>(i % 2));
  }
  for (const char* type : {"softmax", "mlp", "sparse_lr", "fm", "mf"}) {
    models::ModelConfig c;
    c.type = type;
    c.num_features = 100;
    c.num_classes = 10;
    c.hidden = {64, 32};
    c.activation = Activation::kGelu;
    c.factors = 6;
    const data::Batch& b = (c.type == "softmax" || c.type == "mlp") ? dense : sparse;
    auto want = Grads(*cpu, c, b);
    auto got = Grads(*gpu, c, b);
    for (size_t t = 0; t < want.size(); ++t) {
      INFO(type << " table " << t);
      Close(got[t], want[t], 1e-3, 1e-5);
    }
    if (c.type != "mlp") continue;
    for (DType p : {DType::kBf16, DType::kFp16}) {
      c.precision = p;
      auto lowp_cpu = Grads(*cpu, c, b);
      auto lowp_gpu = Grads(*gpu, c, b);
      for (size_t t = 0; t < want.size(); ++t) {
        double num = 0, den = 0, num_cpu = 0;
        for (size_t i = 0; i < want[t].size(); ++i) {
          num += (lowp_gpu[t][i] - want[t][i]) * (lowp_gpu[t][i] - want[t][i]);
          num_cpu += (lowp_gpu[t][i] - lowp_cpu[t][i]) * (lowp_gpu[t][i] - lowp_cpu[t][i]);
          den += want[t][i] * want[t][i];
        }
        INFO(DTypeName(p) << " table " << t);
        REQUIRE(std::sqrt(num / den) < (p == DType::kBf16 ? 3e-2 : 5e-3));  // vs fp32
        REQUIRE(std::sqrt(num_cpu / den) < 1e-3);  // vs the CPU's emulation of the same rounding
      }
    }
  }
}

TEST_CASE("GPU: model-graph ops (dot interaction and fm and layer norm and sigmoid and tanh) match the CPU backend", "[gpu]") {
  auto gpu = Gpu();
  if (!gpu) return;
  auto cpu = NewCpuBackend(0);
  const int B = 67, n = 27, d = 16, P = n * (n - 1) / 2;
  const auto x = Random<float>(size_t{1} * B * n * d, 31);
  const auto dout = Random<float>(size_t{1} * B * P, 32);
  Buffer gx = Up(*gpu, x), gd = Up(*gpu, dout);
  {
    std::vector<float> want(size_t{1} * B * P), want_dx(x.size());
    REQUIRE_OK(cpu->DotInteraction(B, n, d, x.data(), want.data()));
    REQUIRE_OK(cpu->DotInteractionGrad(B, n, d, x.data(), dout.data(), want_dx.data()));
    Buffer out = Up(*gpu, want), dx = Up(*gpu, want_dx);
    REQUIRE_OK(gpu->Zero(out.data(), want.size() * 4));
    REQUIRE_OK(gpu->DotInteraction(B, n, d, gx.as<float>(), out.as<float>()));
    REQUIRE_OK(gpu->DotInteractionGrad(B, n, d, gx.as<float>(), gd.as<float>(), dx.as<float>()));
    Close(Down<float>(*gpu, out, want.size()), want, 1e-4, 1e-5);
    Close(Down<float>(*gpu, dx, want_dx.size()), want_dx, 1e-4, 1e-4);
  }
  {
    std::vector<float> want(B), want_dx(x.size());
    REQUIRE_OK(cpu->FmInteraction(B, n, d, x.data(), want.data()));
    REQUIRE_OK(cpu->FmInteractionGrad(B, n, d, x.data(), dout.data(), want_dx.data()));
    Buffer out = Up(*gpu, want), dx = Up(*gpu, want_dx);
    REQUIRE_OK(gpu->FmInteraction(B, n, d, gx.as<float>(), out.as<float>()));
    REQUIRE_OK(gpu->FmInteractionGrad(B, n, d, gx.as<float>(), gd.as<float>(), dx.as<float>()));
    Close(Down<float>(*gpu, out, want.size()), want, 1e-4, 1e-4);
    Close(Down<float>(*gpu, dx, want_dx.size()), want_dx, 1e-4, 1e-4);
  }
  {
    const int M = B, N = n * d;
    const auto gamma = Random<float>(N, 33), beta = Random<float>(N, 34), dy = Random<float>(x.size(), 35);
    std::vector<float> y(x.size()), mean(M), rstd(M), dx(x.size()), dg(N), db(N);
    REQUIRE_OK(cpu->LayerNorm(M, N, x.data(), gamma.data(), beta.data(), 1e-5f, y.data(), mean.data(), rstd.data()));
    REQUIRE_OK(cpu->LayerNormGrad(M, N, x.data(), gamma.data(), mean.data(), rstd.data(), dy.data(), dx.data(),
                                  dg.data(), db.data()));
    Buffer g = Up(*gpu, gamma), b = Up(*gpu, beta), gdy = Up(*gpu, dy), gy = Up(*gpu, y), gm = Up(*gpu, mean),
           gr = Up(*gpu, rstd), gdx = Up(*gpu, dx), gdg = Up(*gpu, dg), gdb = Up(*gpu, db);
    REQUIRE_OK(gpu->LayerNorm(M, N, gx.as<float>(), g.as<float>(), b.as<float>(), 1e-5f, gy.as<float>(),
                              gm.as<float>(), gr.as<float>()));
    REQUIRE_OK(gpu->LayerNormGrad(M, N, gx.as<float>(), g.as<float>(), gm.as<float>(), gr.as<float>(),
                                  gdy.as<float>(), gdx.as<float>(), gdg.as<float>(), gdb.as<float>()));
    Close(Down<float>(*gpu, gy, y.size()), y, 1e-4, 1e-4);
    Close(Down<float>(*gpu, gdx, dx.size()), dx, 1e-3, 1e-4);
    Close(Down<float>(*gpu, gdg, dg.size()), dg, 1e-4, 1e-4);
    Close(Down<float>(*gpu, gdb, db.size()), db, 1e-4, 1e-4);
  }
  for (Activation a : {Activation::kSigmoid, Activation::kTanh}) {
    INFO(ActivationName(a));
    std::vector<float> y(x.size()), dx(x.size());
    const auto dy = Random<float>(x.size(), 36);
    REQUIRE_OK(cpu->Activate(a, x.size(), x.data(), y.data()));
    REQUIRE_OK(cpu->ActivateGrad(a, x.size(), x.data(), dy.data(), dx.data()));
    Buffer gy = Up(*gpu, y), gdy = Up(*gpu, dy), gdx = Up(*gpu, dx);
    REQUIRE_OK(gpu->Activate(a, x.size(), gx.as<float>(), gy.as<float>()));
    REQUIRE_OK(gpu->ActivateGrad(a, x.size(), gx.as<float>(), gdy.as<float>(), gdx.as<float>()));
    Close(Down<float>(*gpu, gy, y.size()), y, 1e-5, 1e-6);
    Close(Down<float>(*gpu, gdx, dx.size()), dx, 1e-5, 1e-6);
  }
}

TEST_CASE("GPU: the click-through examples' and every graph op's gradients match the CPU's in fp32 and bf16 and fp16",
          "[gpu]") {
  auto gpu = Gpu();
  if (!gpu) return;
  auto cpu = NewCpuBackend(0);
  std::mt19937 rng(23);
  std::normal_distribution<float> n(0, 1);
  data::Batch b;
  b.size = 256;
  b.offsets.push_back(0);
  for (int i = 0; i < b.size; ++i) {
    for (int k = 0; k < 13; ++k) {
      b.keys.push_back(k);
      b.values.push_back(std::abs(n(rng)));
    }
    for (int f = 0; f < 26; ++f) {
      if (rng() % 10 == 0) continue;  // absent
      const int count = rng() % 4 == 0 ? 2 : 1;  // two values: pooling fm has pairs within the field
      for (int j = 0; j < count; ++j) {
        b.keys.push_back(13 + (uint64_t{static_cast<uint32_t>(f)} << 20) + rng() % 50);
        b.values.push_back(1);
      }
    }
    b.offsets.push_back(static_cast<int32_t>(b.keys.size()));
    b.labels.push_back(static_cast<float>(rng() % 2));
  }
  // 16-bit GEMMs round the same inputs on both; only the sums' order differs.
  const std::pair<DType, double> precisions[] = {{DType::kFp32, 1e-4}, {DType::kBf16, 1e-2}, {DType::kFp16, 1e-2}};
  for (const auto& [precision, bound] : precisions) {
    for (const char* file : {"deploy/examples/ctr-dlrm.yaml", "deploy/examples/ctr-wide-deep.yaml",
                             "deploy/examples/ctr-deepfm.yaml", "tests/gpu/graph_all_ops.yaml"}) {
      INFO(file << " " << DTypeName(precision));
      v1::JobSpec spec;
      REQUIRE_OK(config::ParseSpecFile(SourceDir() + "/" + file, &spec));
      models::ModelConfig c;
      c.type = "graph";
      c.graph = spec.model();
      c.dense_keys = 13;
      c.field_bits = 20;
      c.precision = precision;
      auto want = Grads(*cpu, c, b);
      auto got = Grads(*gpu, c, b);
      REQUIRE(want.size() == got.size());
      for (size_t t = 0; t < want.size(); ++t) {
        double num = 0, den = 0;
        for (size_t i = 0; i < want[t].size(); ++i) {
          num += (got[t][i] - want[t][i]) * (got[t][i] - want[t][i]);
          den += want[t][i] * want[t][i];
        }
        INFO("table " << t << ": relative L2 difference " << std::sqrt(num / std::max(den, 1e-30)));
        REQUIRE(std::sqrt(num / std::max(den, 1e-30)) < bound);
      }
    }
  }
}

TEST_CASE("GPU: the mf preset graph's gradients (field and slice over keys by position) match the CPU's", "[gpu]") {
  auto gpu = Gpu();
  if (!gpu) return;
  auto cpu = NewCpuBackend(0);
  std::mt19937 rng(29);
  std::normal_distribution<float> n(0, 1);
  data::Batch b;  // ratings: a user key and an item key (the same range) by position
  b.size = 300;
  b.offsets.push_back(0);
  for (int i = 0; i < b.size; ++i) {
    b.keys.push_back(rng() % 40);
    b.keys.push_back(rng() % 40);
    b.values.insert(b.values.end(), {1.0f, 1.0f});
    b.offsets.push_back(static_cast<int32_t>(b.keys.size()));
    b.labels.push_back(3 + n(rng));
  }
  v1::JobSpec spec;
  REQUIRE_OK(config::ParseSpecFile(SourceDir() + "/tests/gpu/graph_mf.yaml", &spec));
  models::ModelConfig c;
  c.type = "graph";
  c.graph = spec.model();
  auto want = Grads(*cpu, c, b);
  auto got = Grads(*gpu, c, b);
  REQUIRE(want.size() == 3);
  REQUIRE(want.size() == got.size());
  for (size_t t = 0; t < want.size(); ++t) {
    INFO("table " << t);
    Close(got[t], want[t], 1e-4, 1e-5);
  }
}

}  // namespace
}  // namespace fulcrum::compute
