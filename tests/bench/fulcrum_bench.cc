// fulcrum-bench: throughput of the parameter-server data path on this
// machine, printed next to bounds measured in the same run:
//   - loopback TCP (iperf3 -c 127.0.0.1), the bound for push+pull;
//   - memory bandwidth of a read-modify-write pass, the bound for Adam;
//   - round-trip latency: a 1-byte TCP ping-pong on 127.0.0.1 and an empty
//     unary gRPC call (GetShardMap) to the first server, which with
//     iperf3's throughput gives a floor for one tensor at a time: a push
//     and then a pull wait for two calls (one in the worker's pattern), so
//     no client of these calls beats
//     calls x (empty call) + (bytes on the wire) / (iperf3 throughput);
//   - a bare push+pull over one TCP connection with no RPC layer, fp32 and
//     bf16 (the same conversions and SGD update the servers run): its
//     bf16 / fp32 ratio is what halving the bytes can buy on this machine,
//     next to which the bf16 rows' own ratio is printed.
// Servers run in this process on 127.0.0.1 ports (gRPC over real TCP), or
// as fulcrum-server processes with --server_binary.
//
//   fulcrum-bench            full run (about 9 minutes on 2 cores)
//   fulcrum-bench --quick    tiny sizes, for the smoke test in ctest
//   fulcrum-bench --bounds_only   iperf3 and the round trips alone (tests/bench/cluster_bench.sh)
//   fulcrum-bench --server_binary=build/server/fulcrum-server   servers in their own processes
//   tests/bench/shaped_link.sh --rate 1gbit   servers across a rate-limited link (runs this with
//                                             --netns, --server_host)
#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <mutex>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/dtype.h"
#include "common/logging.h"
#include "common/process.h"
#include "common/rpc/grpc_util.h"
#include "common/rpc/security.h"
#include "fulcrum/v1/ps.grpc.pb.h"
#include "server/optimizer.h"
#include "server/parameter_server.h"
#include "server/rpc/ps_service.h"
#include "tests/testing/subprocess.h"
#include "worker/rpc/grpc_ps_client.h"

namespace fulcrum {
namespace {

using Clock = std::chrono::steady_clock;
double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

bool g_quick = false;
size_t g_chunk_elements = 0;       // 0: the table default
size_t g_message_bytes = 1 << 20;  // client max_payload_bytes
int g_channels = 4;
bool g_only_dense = false;
int g_dtype_filter = 0;  // 0: fp32 and bf16
int g_pattern_filter = 0;  // 0: both; 1: serial; 2: worker (see Pattern)
bool g_bounds_only = false;  // loopback throughput and round trips only (tests/bench/cluster_bench.sh)
bool g_stream = false;
bool g_shm = false;  // shared memory in front of the transport (--transport=shm)
std::string g_tls_dir;  // certificates from deploy/tls/gen-certs.sh: mutual TLS
// In-process servers and the client share one server certificate, which may
// also delete the bench's jobs (--tls_dir); plaintext without it.
std::shared_ptr<const security::Transport> g_transport = security::Transport::Plaintext();
// Tensors pushed and pulled concurrently, one thread each; 0: 1, and 4 for
// tensors of 1 MiB and up (a worker sends all of a model's tensors at once).
int g_inflight = 0;
// When set, the servers are processes of this fulcrum-server binary (their
// own address space, allocator and gRPC threads, as in a deployment) rather
// than objects in the bench's process.
std::string g_server_binary;
// With --netns: the servers (and iperf3's server) run in this network
// namespace and listen on g_server_host, reached over whatever link joins
// the namespaces (tests/bench/shaped_link.sh: a veth pair with a rate limit).
std::string g_netns;
std::string g_server_host = "127.0.0.1";
size_t g_max_bytes = size_t{64} << 20;  // largest dense tensor

// ------------------------------------------------------------------ bounds

std::string Run(const std::string& cmd) {
  std::string out;
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) return out;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), p)) > 0) out.append(buf, n);
  pclose(p);
  return out;
}

// iperf3's received throughput on loopback in GB/s (0 when unavailable).
double IperfGBps(int seconds) {
  if (Run("command -v iperf3").empty()) return 0;
  const int port = testing::FreeLoopbackPort();
  const std::string server = absl::StrCat(g_netns.empty() ? "" : "ip netns exec " + g_netns + " ", "iperf3 -s -1 -p ",
                                          port, " >/dev/null 2>&1 &");
  std::system(server.c_str());
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // let the server listen
  const std::string json =
      Run(absl::StrCat("iperf3 -c ", g_server_host, " -p ", port, " -t ", seconds, " -J"));
  const size_t at = json.find("\"sum_received\"");
  if (at == std::string::npos) return 0;
  const size_t bps = json.find("\"bits_per_second\"", at);
  if (bps == std::string::npos) return 0;
  return std::strtod(json.c_str() + json.find(':', bps) + 1, nullptr) / 8e9;
}

// Best GB/s over `reps` runs of work(thread) on `threads` threads, each run
// moving `bytes` in all.
template <typename Work>
double BestGBps(int threads, int reps, double bytes, Work work) {
  double best = 0;
  for (int r = 0; r < reps; ++r) {
    auto t0 = Clock::now();
    std::vector<std::thread> ts;
    for (int t = 0; t < threads; ++t) ts.emplace_back([&, t] { work(t, r); });
    for (auto& t : ts) t.join();
    best = std::max(best, bytes / Seconds(t0, Clock::now()) / 1e9);
  }
  return best;
}

// GB/s of acc[i] += g[i] over n floats on `threads` threads (12 bytes/element).
double RmwGBps(size_t n, int threads, int reps) {
  std::vector<float> acc(n, 1.0f), g(n, 0.5f);
  const double gbps = BestGBps(threads, reps, 12.0 * n, [&](int t, int) {
    const size_t b = n * t / threads, e = n * (t + 1) / threads;
    float* __restrict a = acc.data();
    const float* __restrict gg = g.data();
    for (size_t i = b; i < e; ++i) a[i] += gg[i];
  });
  if (acc[n / 2] == 0) std::printf("?");  // keep the loop observable
  return gbps;
}

// The median of `v` (reordered); 0 when empty.
double Median(std::vector<double>& v) {
  if (v.empty()) return 0;
  std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
  return v[v.size() / 2];
}

// A TCP socket listening on an ephemeral port of 127.0.0.1, whose address
// goes to *addr; -1 on failure.
int LoopbackListener(sockaddr_in* addr, socklen_t* len) {
  const int listener = socket(AF_INET, SOCK_STREAM, 0);
  addr->sin_family = AF_INET;
  addr->sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  *len = sizeof(*addr);
  if (listener < 0 || bind(listener, reinterpret_cast<sockaddr*>(addr), *len) != 0 ||
      getsockname(listener, reinterpret_cast<sockaddr*>(addr), len) != 0 || listen(listener, 1) != 0) {
    if (listener >= 0) close(listener);
    return -1;
  }
  return listener;
}

// Median microseconds of a 1-byte TCP round trip between two threads over
// 127.0.0.1 (TCP_NODELAY): what the kernel and the scheduler cost per
// request and response before any RPC layer. 0 when sockets fail.
double TcpRoundTripUs(int rounds) {
  sockaddr_in addr{};
  socklen_t len = sizeof(addr);
  const int listener = LoopbackListener(&addr, &len);
  if (listener < 0) return 0;
  const int one = 1;
  std::thread echo([&] {
    const int c = accept(listener, nullptr, nullptr);
    if (c < 0) return;
    setsockopt(c, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    char b;
    while (read(c, &b, 1) == 1 && write(c, &b, 1) == 1) {
    }
    close(c);
  });
  const int c = socket(AF_INET, SOCK_STREAM, 0);
  std::vector<double> us;
  if (c >= 0 && connect(c, reinterpret_cast<sockaddr*>(&addr), len) == 0) {
    setsockopt(c, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    char b = 'x';
    for (int i = 0; i < rounds; ++i) {
      const auto t0 = Clock::now();
      if (write(c, &b, 1) != 1 || read(c, &b, 1) != 1) break;
      us.push_back(Seconds(t0, Clock::now()) * 1e6);
    }
  }
  if (c >= 0) close(c);           // ends the echo thread's read
  shutdown(listener, SHUT_RDWR);  // or its accept, when connect failed
  echo.join();
  close(listener);
  return Median(us);
}

// Median microseconds of an empty unary call (GetShardMap, a few bytes each
// way) to `address` over a channel made as the client library makes its
// own: gRPC's per-call cost on this machine, the latency part of the floor.
double GrpcRoundTripUs(const std::string& address, int calls) {
  auto stub = v1::ParameterService::NewStub(CreateFulcrumChannel(address, 0, *g_transport));
  std::vector<double> us;
  for (int i = 0; i < calls + 20; ++i) {  // the first calls connect and warm up
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    v1::GetShardMapRequest request;
    v1::ShardMap response;
    const auto t0 = Clock::now();
    if (!stub->GetShardMap(&ctx, request, &response).ok()) return 0;
    if (i >= 20) us.push_back(Seconds(t0, Clock::now()) * 1e6);
  }
  return Median(us);
}

// GB/s of the server's Adam apply (w, m, v read and written, g read: 28 bytes/element).
double AdamGBps(size_t n, int threads, int reps) {
  v1::OptimizerSpec spec;
  spec.set_kind(v1::OptimizerSpec::ADAM);
  spec.set_learning_rate(0.001f);
  auto config = OptimizerConfigFromProto(spec, "bench");
  // Blocks of 64K elements (256 KiB), as the server's default dense chunks.
  constexpr size_t kChunk = 65536;
  const size_t chunks = n / kChunk;
  std::vector<std::vector<float>> blocks(chunks, std::vector<float>(3 * kChunk, 0.1f));
  std::vector<float> g(kChunk * chunks, 0.01f);
  return BestGBps(threads, reps, 28.0 * kChunk * chunks, [&](int t, int r) {
    for (size_t c = t; c < chunks; c += threads) {
      ApplyOptimizer(*config, blocks[c].data(), kChunk, g.data() + c * kChunk, r + 1);
    }
  });
}

// Sends or receives all `len` bytes on a blocking socket; false on error.
bool SendAll(int fd, const void* data, size_t len) {
  const char* p = static_cast<const char*>(data);
  while (len > 0) {
    const ssize_t k = send(fd, p, len, MSG_NOSIGNAL);
    if (k <= 0) return false;
    p += k;
    len -= static_cast<size_t>(k);
  }
  return true;
}
bool RecvAll(int fd, void* data, size_t len) {
  char* p = static_cast<char*>(data);
  while (len > 0) {
    const ssize_t k = recv(fd, p, len, 0);
    if (k <= 0) return false;
    p += k;
    len -= static_cast<size_t>(k);
  }
  return true;
}

// Sends n floats from `src` in pieces of `piece`, encoded into `buffer`
// (room for a piece in fp32) unless the wire is fp32; false on error.
bool SendPieces(int fd, const float* src, size_t n, DType dtype, size_t piece, char* buffer) {
  for (size_t b = 0; b < n; b += piece) {
    const size_t m = std::min(piece, n - b);
    const void* out = src + b;
    if (dtype != DType::kFp32) {
      EncodeFloats(src + b, m, dtype, buffer);
      out = buffer;
    }
    if (!SendAll(fd, out, m * DTypeSize(dtype))) return false;
  }
  return true;
}

// Million parameters per second (pushed plus pulled), over one window of
// `seconds`, of the least work a parameter server's dense push+pull can do
// over one TCP connection on 127.0.0.1, with no RPC layer: the client sends
// the gradient in pieces of `piece` parameters; the server receives each
// piece and applies SGD to its fp32 weights; it then sends the weights back
// and the client receives them into its tensor. fp32 sends straight from
// the gradient and receives straight into the tensor. bf16 adds the
// conversions no bf16 wire can avoid: the client encodes each piece of the
// gradient, the server widens each piece in L1-sized blocks inside the
// update and encodes the weights it sends, the client decodes them. With the
// conversion and optimizer routines the servers use, bf16 / fp32 of this
// measures how many more parameters per second halving the bytes can buy
// on this machine. 0 when sockets fail.
double BarePushPullMParams(size_t n, DType dtype, size_t piece, double seconds) {
  sockaddr_in addr{};
  socklen_t len = sizeof(addr);
  const int listener = LoopbackListener(&addr, &len);
  if (listener < 0) return 0;
  const int one = 1;
  const size_t elem = DTypeSize(dtype);
  v1::OptimizerSpec spec;
  spec.set_kind(v1::OptimizerSpec::SGD);
  spec.set_learning_rate(0.001f);
  const auto config = *OptimizerConfigFromProto(spec, "bare");
  std::thread server([&] {
    const int c = accept(listener, nullptr, nullptr);
    if (c < 0) return;
    setsockopt(c, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    std::vector<float> w(n, 0.1f);
    std::vector<char> buffer(piece * 4);
    std::vector<float> block(kDecodeBlock);
    for (;;) {
      for (size_t b = 0; b < n; b += piece) {  // the push, applied piece by piece
        const size_t m = std::min(piece, n - b);
        if (!RecvAll(c, buffer.data(), m * elem)) {
          close(c);
          return;
        }
        if (dtype == DType::kFp32) {
          ApplyOptimizerRange(config, w.data() + b, m, 0, m, reinterpret_cast<const float*>(buffer.data()), 1);
          continue;
        }
        for (size_t i = 0; i < m; i += kDecodeBlock) {
          const size_t k = std::min(kDecodeBlock, m - i);
          DecodeFloats(buffer.data() + i * elem, k, dtype, block.data());
          ApplyOptimizerRange(config, w.data() + b + i, k, 0, k, block.data(), 1);
        }
      }
      if (!SendPieces(c, w.data(), n, dtype, piece, buffer.data())) {  // the pull
        close(c);
        return;
      }
    }
  });
  const int c = socket(AF_INET, SOCK_STREAM, 0);
  double rate = 0;
  if (c >= 0 && connect(c, reinterpret_cast<sockaddr*>(&addr), len) == 0) {
    setsockopt(c, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    std::vector<float> g(n, 0.5f), w(n);
    std::vector<char> buffer(piece * 4);
    bool ok = true;
    int iters = 0;
    const auto t0 = Clock::now();
    do {
      ok = SendPieces(c, g.data(), n, dtype, piece, buffer.data());
      for (size_t b = 0; ok && b < n; b += piece) {
        const size_t m = std::min(piece, n - b);
        if (dtype == DType::kFp32) {
          ok = RecvAll(c, w.data() + b, m * 4);
        } else if ((ok = RecvAll(c, buffer.data(), m * elem))) {
          DecodeFloats(buffer.data(), m, dtype, w.data() + b);
        }
      }
      ++iters;
    } while (ok && Seconds(t0, Clock::now()) < seconds);
    if (ok) rate = 2.0 * n * iters / Seconds(t0, Clock::now()) / 1e6;
    if (w[n / 2] == 0) std::printf("?");  // keep the received weights observable
  }
  if (c >= 0) close(c);           // ends the server thread's receive
  shutdown(listener, SHUT_RDWR);  // or its accept, when connect failed
  server.join();
  close(listener);
  return rate;
}

// ------------------------------------------------------------------ cluster

struct Cluster {
  std::vector<std::unique_ptr<ParameterServer>> ps;
  std::vector<std::unique_ptr<PsGrpcServer>> grpc;
  std::vector<pid_t> processes;  // with --server_binary
  std::string dir;               // their data directories and logs
  v1::ShardMap map;
  size_t size() const { return processes.empty() ? ps.size() : processes.size(); }
  ~Cluster() {
    for (pid_t p : processes) kill(p, SIGTERM);
    for (pid_t p : processes) waitpid(p, nullptr, 0);
    if (!dir.empty()) std::system(absl::StrCat("rm -rf '", dir, "'").c_str());
  }
};

// `n` fulcrum-server processes with a static shard map; exits on failure.
std::unique_ptr<Cluster> StartProcesses(int n) {
  auto c = std::make_unique<Cluster>();
  char tmpl[] = "/tmp/fulcrum-bench-XXXXXX";
  if (mkdtemp(tmpl) == nullptr) {
    std::perror("fulcrum-bench: mkdtemp");
    std::exit(1);
  }
  c->dir = tmpl;
  std::vector<int> ports;
  std::vector<std::string> addresses;
  for (int i = 0; i < n; ++i) {
    ports.push_back(testing::FreeLoopbackPort());
    addresses.push_back(absl::StrCat(g_server_host, ":", ports.back()));
  }
  for (int i = 0; i < n; ++i) {
    std::vector<std::string> args = {g_server_binary, "--listen=" + addresses[i], absl::StrCat("--server_index=", i),
                                     "--shard_map=" + absl::StrJoin(addresses, ","), "--metrics_addr=",
                                     absl::StrCat("--data_dir=", c->dir, "/server-", i)};
    if (g_tls_dir.empty()) {
      args.push_back("--insecure");
    } else {
      args.push_back("--tls_ca_file=" + g_tls_dir + "/ca.crt");
      args.push_back(absl::StrCat("--tls_cert_file=", g_tls_dir, "/server-", i, ".crt"));
      args.push_back(absl::StrCat("--tls_key_file=", g_tls_dir, "/server-", i, ".key"));
    }
    if (!g_netns.empty()) args.insert(args.begin(), {"/usr/sbin/ip", "netns", "exec", g_netns});  // execs in place
    const pid_t pid = testing::StartProcess(args, absl::StrCat(c->dir, "/server-", i, ".log"));
    if (pid < 0) {
      std::fprintf(stderr, "fulcrum-bench: cannot start %s: %s\n", g_server_binary.c_str(), std::strerror(errno));
      c.reset();  // stops the servers already started
      std::exit(1);
    }
    c->processes.push_back(pid);
  }
  for (int i = 0; i < n; ++i) {
    if (!testing::WaitForListening(ports[i], 30000, c->processes[i], g_server_host)) {
      std::fprintf(stderr,
                   "fulcrum-bench: server %d exited or does not listen on %s after 30 s (log: %s/server-%d.log)\n", i,
                   addresses[i].c_str(), c->dir.c_str(), i);
      c->dir.clear();  // keep the logs
      c.reset();       // stops the servers
      std::exit(1);
    }
  }
  c->map = ShardMap::RoundRobin(1, 256, addresses)->ToProto();
  return c;
}

std::unique_ptr<Cluster> StartCluster(int n) {
  if (!g_server_binary.empty()) return StartProcesses(n);
  auto c = std::make_unique<Cluster>();
  std::vector<std::string> addresses;
  for (int i = 0; i < n; ++i) {
    ParameterServerOptions o;
    o.server_index = i;
    c->ps.push_back(*ParameterServer::Create(o));
    PsGrpcServer::Options go;
    go.security = g_transport;
    c->grpc.push_back(*PsGrpcServer::Start(c->ps.back().get(), "127.0.0.1:0", go));
    addresses.push_back(c->grpc.back()->address());
  }
  c->map = ShardMap::RoundRobin(1, 256, addresses)->ToProto();
  for (auto& p : c->ps) (void)p->SetShardMap(c->map);
  return c;
}

std::unique_ptr<GrpcPsClient> Client(const Cluster& c, DType dtype) {
  GrpcPsClientOptions o;
  o.shard_map = c.map;
  o.worker_id = "bench";
  o.wire_dtype = dtype;
  o.channels_per_server = g_channels;
  o.max_payload_bytes = g_message_bytes;
  o.transport = g_stream ? GrpcPsClientOptions::Transport::kStream : GrpcPsClientOptions::Transport::kUnary;
  o.shared_memory = g_shm;
  o.security = g_transport;
  return *GrpcPsClient::Create(o);
}

int g_job = 0;

// How a tensor's push and pull follow each other.
enum class Pattern {
  // ASP: push, wait for its answer, pull, wait: two calls one after the other.
  kSerial,
  // As fulcrum-worker does under BSP: a one-worker BSP job whose step s+1
  // pull goes out together with step s's push; the server answers it from
  // the thread that applied step s, so a push+pull costs one round trip.
  kWorker,
};

// Dense push+pull of one tensor of `bytes` (fp32 size): GB/s on the wire and
// parameters/s, best of a few windows.
// Returns the table row without its last column, and the wire GB/s.
struct DenseResult {
  std::string row;
  int inflight = 0;
  double per_second = 0;   // push+pull pairs per second, all threads
  double wire_bytes = 0;   // payload bytes of one push plus one pull
  int calls = 2;           // round trips one push+pull waits for
  size_t servers = 0;
  size_t bytes = 0;        // the tensor's fp32 size
  DType dtype = DType::kFp32;
  Pattern pattern = Pattern::kSerial;
  double mparams() const { return 2.0 * bytes / 4 * per_second / 1e6; }
  double wire_gbps() const { return wire_bytes * per_second / 1e9; }
};


DenseResult DensePushPull(const Cluster& c, size_t bytes, DType dtype, int inflight, Pattern pattern) {
  const size_t n = bytes / 4;
  auto client = Client(c, dtype);
  // kSerial: one ASP job with one table per tensor in flight (a model of
  // `inflight` equal tensors). kWorker: one BSP job per tensor, as a BSP
  // step is one push per worker.
  const bool worker = pattern == Pattern::kWorker;
  std::vector<std::string> jobs;
  for (int j = 0; j < (worker ? inflight : 1); ++j) {
    jobs.push_back(absl::StrCat("dense", g_job++));
    v1::PsJobSpec spec;
    spec.set_job_id(jobs.back());
    spec.set_num_workers(1);
    spec.mutable_consistency()->set_model(worker ? v1::ConsistencySpec::BSP : v1::ConsistencySpec::ASP);
    for (int i = 0; i < (worker ? 1 : inflight); ++i) {
      auto* t = spec.add_tables();
      t->set_name(absl::StrCat("w", worker ? j : i));
      t->set_kind(v1::TableSpec::DENSE);
      t->add_shape(static_cast<int64_t>(n));
      t->set_chunk_elements(static_cast<uint32_t>(g_chunk_elements));
      t->mutable_optimizer()->set_kind(v1::OptimizerSpec::SGD);
      t->mutable_optimizer()->set_learning_rate(0.001f);
    }
    if (absl::Status s = client->CreateJob(spec); !s.ok()) {
      return {absl::StrCat("| dense | error: ", s.ToString())};
    }
  }
  // Best of three windows of about a second each (one short one with --quick).
  // Each thread pushes its tensor and pulls it back, as one layer of a worker
  // does; with inflight > 1 the tensors' round trips overlap.
  const double window_s = g_quick ? 0.05 : 1.0;
  double best = 0;
  absl::Status error;
  std::mutex mu;
  // Each thread's gradient and weights, allocated (and faulted in) once,
  // outside the timed windows; and its BSP clock, which runs on across them.
  std::vector<std::vector<float>> grads(inflight, std::vector<float>(n, 0.5f));
  std::vector<std::vector<float>> weights(inflight, std::vector<float>(n));
  std::vector<uint64_t> steps(inflight, 0);
  for (int window = 0; window < (g_quick ? 1 : 3); ++window) {
    std::atomic<int> iters{0};
    const auto t0 = Clock::now();
    std::vector<std::thread> threads;
    for (int i = 0; i < inflight; ++i) {
      threads.emplace_back([&, i] {
        const std::string table = absl::StrCat("w", i);
        const std::string& job = jobs[worker ? i : 0];
        std::vector<float>& g = grads[i];
        std::vector<float>& w = weights[i];
        do {
          absl::Status s;
          if (worker) {
            const uint64_t step = steps[i]++;
            Future<absl::Status> pulled = client->PullAsync(job, {step + 1, {{table, w.data(), n}}, {}});
            s = client->Push(job, {step, {{table, g.data(), n}}, {}});
            s.Update(pulled.Wait());
          } else {
            s = client->Push(job, {0, {{table, g.data(), n}}, {}});
            if (s.ok()) s = client->Pull(job, {0, {{table, w.data(), n}}, {}});
          }
          if (!s.ok()) {
            std::lock_guard<std::mutex> l(mu);
            error = s;
            return;
          }
          iters.fetch_add(1);
        } while (Seconds(t0, Clock::now()) < window_s);
      });
    }
    for (auto& t : threads) t.join();
    if (!error.ok()) return {absl::StrCat("| dense | error: ", error.ToString())};
    best = std::max(best, iters.load() / Seconds(t0, Clock::now()));
  }
  DenseResult result{"", inflight, best, 2.0 * n * DTypeSize(dtype), worker ? 1 : 2, c.size(), bytes, dtype, pattern};
  const double params = 2.0 * n * best / 1e6;
  char size[32];
  if (bytes >= (1 << 20)) std::snprintf(size, sizeof(size), "%zu MiB", bytes >> 20);
  else std::snprintf(size, sizeof(size), "%zu KiB", bytes >> 10);
  char row[256];
  std::snprintf(row, sizeof(row), "| %s | %zu | %d | %s | %s | %.0f | %.2f | %.0f |",
                worker ? "dense, worker" : "dense", c.size(), inflight, size, DTypeName(dtype), best,
                result.wire_gbps(), params);
  for (const std::string& job : jobs) (void)client->DeleteJob(job);
  result.row = row;
  return result;
}

void SparseRate(const Cluster& c, size_t keys, uint32_t dim) {
  auto client = Client(c, DType::kFp32);
  const std::string job = absl::StrCat("sparse", g_job++);
  v1::PsJobSpec spec;
  spec.set_job_id(job);
  spec.set_num_workers(1);
  spec.mutable_consistency()->set_model(v1::ConsistencySpec::ASP);
  auto* t = spec.add_tables();
  t->set_name("emb");
  t->set_kind(v1::TableSpec::SPARSE);
  t->set_dim(dim);
  t->mutable_optimizer()->set_kind(v1::OptimizerSpec::ADAGRAD);
  t->mutable_optimizer()->set_learning_rate(0.05f);
  if (!client->CreateJob(spec).ok()) return;
  std::mt19937_64 rng(1);
  std::vector<uint64_t> pool(std::max<size_t>(keys * 4, 1000));
  for (auto& k : pool) k = rng();
  std::vector<float> vals(keys * dim, 0.1f);
  std::vector<uint64_t> batch(keys);
  // Create every row first so the timed loop measures steady-state rates.
  for (size_t i = 0; i < pool.size(); i += keys) {
    const size_t m = std::min(keys, pool.size() - i);
    (void)client->Pull(job, {0, {}, {{"emb", pool.data() + i, m, vals.data()}}});
  }
  double pull_s = 0, push_s = 0;
  int iters = 0;
  for (auto start = Clock::now(); iters < 2 || Seconds(start, Clock::now()) < (g_quick ? 0.05 : 2.0); ++iters) {
    for (auto& k : batch) k = pool[rng() % pool.size()];
    auto t0 = Clock::now();
    absl::Status s = client->Pull(job, {0, {}, {{"emb", batch.data(), keys, vals.data()}}});
    auto t1 = Clock::now();
    if (s.ok()) s = client->Push(job, {0, {}, {{"emb", batch.data(), keys, vals.data()}}});
    auto t2 = Clock::now();
    if (!s.ok()) {
      std::printf("error: %s\n", s.ToString().c_str());
      return;
    }
    pull_s += Seconds(t0, t1);
    push_s += Seconds(t1, t2);
  }
  std::printf("| sparse | %zu | %zu keys | dim %u | %.2f M rows/s pull | %.2f M rows/s push |\n",
              c.size(), keys, dim, keys * iters / pull_s / 1e6, keys * iters / push_s / 1e6);
  (void)client->DeleteJob(job);
}

}  // namespace
}  // namespace fulcrum

int main(int argc, char** argv) {
  using namespace fulcrum;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--quick") g_quick = true;
    else if (a == "--dense_only") g_only_dense = true;
    else if (a == "--bounds_only") g_bounds_only = true;
    else if (a == "--dtype=fp32") g_dtype_filter = 1;
    else if (a == "--transport=stream") g_stream = true;
    else if (a == "--transport=unary") g_stream = false;
    else if (a == "--transport=shm") g_shm = true;
    else if (a == "--dtype=bf16") g_dtype_filter = 3;
    else if (a == "--pattern=serial") g_pattern_filter = 1;
    else if (a == "--pattern=worker") g_pattern_filter = 2;
    else if (a.rfind("--chunk_kib=", 0) == 0) g_chunk_elements = std::stoul(a.substr(12)) * 256;
    else if (a.rfind("--message_kib=", 0) == 0) g_message_bytes = std::stoul(a.substr(14)) << 10;
    else if (a.rfind("--channels=", 0) == 0) g_channels = std::stoi(a.substr(11));
    else if (a.rfind("--inflight=", 0) == 0) g_inflight = std::stoi(a.substr(11));
    else if (a.rfind("--tls_dir=", 0) == 0) g_tls_dir = a.substr(10);
    else if (a.rfind("--server_binary=", 0) == 0) g_server_binary = a.substr(16);
    else if (a.rfind("--netns=", 0) == 0) g_netns = a.substr(8);
    else if (a.rfind("--server_host=", 0) == 0) g_server_host = a.substr(14);
    else if (a.rfind("--max_mib=", 0) == 0) g_max_bytes = std::stoul(a.substr(10)) << 20;
    else {
      std::fprintf(stderr, "usage: fulcrum-bench [--quick] [--dense_only|--bounds_only] [--dtype=fp32|bf16] [--pattern=serial|worker] "
                           "[--transport=unary|stream|shm] [--chunk_kib=N] "
                           "[--message_kib=N] [--channels=N] [--inflight=N] [--tls_dir=DIR] [--server_binary=PATH] "
                           "[--netns=NAME --server_host=IP] [--max_mib=N]\n");
      return 2;
    }
  }
  if (!g_netns.empty() && (g_server_binary.empty() || g_server_host == "127.0.0.1")) {
    std::fprintf(stderr, "fulcrum-bench: --netns=%s needs --server_binary (servers run in the namespace) and "
                         "--server_host (their address there)\n", g_netns.c_str());
    return 2;
  }
  SetMinLogSeverity(LogSeverity::kWarning);
  InitServingProcess();
  if (!g_tls_dir.empty()) {
    auto t = security::Transport::Member({g_tls_dir + "/ca.crt", g_tls_dir + "/server-0.crt",
                                          g_tls_dir + "/server-0.key", ""});
    if (!t.ok()) {
      std::fprintf(stderr, "fulcrum-bench: --tls_dir=%s: %s\n", g_tls_dir.c_str(), t.status().ToString().c_str());
      return 2;
    }
    g_transport = *std::move(t);
  }
  setvbuf(stdout, nullptr, _IOLBF, 0);
  std::printf("# fulcrum-bench%s on %u cores: chunks of %zu KiB, messages of at most %zu KiB, "
              "%d %s connections per server%s%s\n\n",
              g_quick ? " --quick" : "", std::thread::hardware_concurrency(),
              (g_chunk_elements ? g_chunk_elements : 65536) / 256, g_message_bytes >> 10, g_channels,
              g_stream ? "streaming" : "unary", g_tls_dir.empty() ? "" : ", mutual TLS",
              g_server_binary.empty() ? ", servers in this process" : ", servers as fulcrum-server processes");

  // Loopback throughput swings between time windows (shared/ENVIRONMENT.md):
  // measure it before and after the dense runs and divide by the larger.
  const int iperf_s = g_quick ? 1 : 3;
  const double iperf_before = IperfGBps(iperf_s);
  std::printf("%s bound: iperf3 -c %s = %.2f GB/s%s\n", g_netns.empty() ? "loopback" : "link",
              g_server_host.c_str(), iperf_before,
              iperf_before > 0 ? "" : " (iperf3 not installed: ratios omitted)");

  const size_t mem_n = g_quick ? (1 << 20) : (64 << 20);  // 256 MiB per array: out of cache
  const int reps = g_quick ? 1 : 5;
  for (int threads : {1, 2}) {
    if (g_only_dense || g_bounds_only) break;
    const double rmw = RmwGBps(mem_n, threads, reps);
    const double adam = AdamGBps(mem_n, threads, reps);
    std::printf("memory bound (acc += g, %d thread%s): %.1f GB/s; Adam apply: %.1f GB/s = %.2f x bound\n",
                threads, threads > 1 ? "s" : "", rmw, adam, adam / rmw);
  }

  std::vector<size_t> sizes = g_quick ? std::vector<size_t>{4 << 10, 1 << 20}
                                      : std::vector<size_t>{4 << 10, 64 << 10, 1 << 20, 4 << 20,
                                                            16 << 20, 64 << 20};
  std::erase_if(sizes, [](size_t b) { return b > g_max_bytes; });
  // Latency: measured once, against the first server of the 1-server cluster.
  const int rounds = g_quick ? 200 : 2000;
  const double tcp_us = g_netns.empty() ? TcpRoundTripUs(rounds) : 0;
  double grpc_us = 0;
  std::vector<DenseResult> rows;
  if (g_bounds_only) sizes.clear();
  // What halving the bytes can buy here: a bare push+pull (no RPC layer)
  // per tensor size of 1 MiB and up, fp32 and bf16, back to back.
  struct Bare {
    size_t bytes;
    double fp32, bf16;
  };
  std::vector<Bare> bare;
  if (g_netns.empty() && g_dtype_filter == 0) {
    for (size_t bytes : sizes) {
      if (bytes < (1 << 20)) continue;
      // fp32 and bf16 windows alternate, so a swing of this machine's speed
      // hits both; pieces of 64 Ki and 256 Ki parameters (the best piece
      // size differs from run to run); the best window of each dtype.
      Bare b{bytes, 0, 0};
      for (int rep = 0; rep < (g_quick ? 1 : 3); ++rep) {
        for (size_t piece : {size_t{65536}, size_t{262144}}) {
          const double window_s = g_quick ? 0.05 : 0.3;
          b.fp32 = std::max(b.fp32, BarePushPullMParams(bytes / 4, DType::kFp32, piece, window_s));
          b.bf16 = std::max(b.bf16, BarePushPullMParams(bytes / 4, DType::kBf16, piece, window_s));
        }
      }
      bare.push_back(b);
      std::printf("bare TCP push+pull (no RPC layer), %zu MiB: fp32 %.0f, bf16 %.0f M params/s = %.2fx\n",
                  bytes >> 20, b.fp32, b.bf16, b.fp32 > 0 ? b.bf16 / b.fp32 : 0.0);
    }
  }
  for (int servers : {1, 2}) {
    if (g_bounds_only && servers > 1) break;
    auto cluster = StartCluster(servers);
    if (servers == 1) {
      grpc_us = GrpcRoundTripUs(cluster->map.servers(0), rounds);
      if (tcp_us > 0) std::printf("round trip: 1-byte TCP ping-pong on 127.0.0.1 = %.0f us (median of %d)\n", tcp_us, rounds);
      std::printf("round trip: empty unary gRPC call (GetShardMap) to %s = %.0f us (median of %d)\n",
                  cluster->map.servers(0).c_str(), grpc_us, rounds);
    }
    for (int inflight : g_inflight > 0 ? std::vector<int>{g_inflight} : std::vector<int>{1, 4}) {
      for (size_t bytes : sizes) {
        if (g_inflight == 0 && inflight > 1 && bytes < (1 << 20)) continue;
        for (DType dt : {DType::kFp32, DType::kBf16}) {
          if (g_dtype_filter != 0 && g_dtype_filter != static_cast<int>(dt)) continue;
          for (Pattern pattern : {Pattern::kSerial, Pattern::kWorker}) {
            if (g_pattern_filter == 0 || g_pattern_filter == static_cast<int>(pattern) + 1) {
              rows.push_back(DensePushPull(*cluster, bytes, dt, inflight, pattern));
            }
          }
        }
      }
    }
  }
  if (g_bounds_only) return 0;
  const double iperf_after = IperfGBps(iperf_s);
  const double iperf = std::max(iperf_before, iperf_after);
  std::printf("%s bound after the dense runs: %.2f GB/s; ratios below use %.2f GB/s\n",
              g_netns.empty() ? "loopback" : "link", iperf_after, iperf);
  // The floor for one tensor at a time: the round trips a push+pull waits
  // for (two one after the other, or one in the worker's pattern), each at
  // least an empty call's, and the payload at iperf3's rate.
  // "x floor" is the achieved rate over the rate that floor allows; "max x
  // iperf3" is the best "x iperf3" that floor leaves possible.
  std::printf("\n| kind | servers | in flight | tensor | wire | push+pull/s | GB/s on wire | M params/s | x iperf3 "
              "| floor ms | x floor | max x iperf3 |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  for (const DenseResult& r : rows) {
    std::printf("%s %.2f |", r.row.c_str(), iperf > 0 ? r.wire_gbps() / iperf : 0.0);
    if (r.inflight == 1 && iperf > 0 && grpc_us > 0) {
      const double floor_s = r.calls * grpc_us * 1e-6 + r.wire_bytes / (iperf * 1e9);
      std::printf(" %.2f | %.2f | %.2f |\n", floor_s * 1e3, r.per_second * floor_s,
                  r.wire_bytes / floor_s / (iperf * 1e9));
    } else {
      std::printf(" - | - | - |\n");
    }
  }
  if (!bare.empty()) {
    // Each bf16 row against the fp32 row of the same shape, and that ratio
    // against what the bare push+pull of the same size reached.
    std::printf("\nbf16 against fp32, parameters per second; \"bare\" is the bare TCP push+pull above:\n\n"
                "| servers | in flight | pattern | tensor | bf16 / fp32 | bare bf16 / fp32 | x bare |\n"
                "|---|---|---|---|---|---|---|\n");
    for (const DenseResult& b : rows) {
      if (b.dtype != DType::kBf16 || b.per_second <= 0) continue;
      const auto f = std::find_if(rows.begin(), rows.end(), [&](const DenseResult& r) {
        return r.dtype == DType::kFp32 && r.servers == b.servers && r.inflight == b.inflight &&
               r.bytes == b.bytes && r.pattern == b.pattern && r.per_second > 0;
      });
      const auto bb = std::find_if(bare.begin(), bare.end(), [&](const Bare& x) { return x.bytes == b.bytes; });
      if (f == rows.end() || bb == bare.end() || bb->fp32 <= 0) continue;
      const double ratio = b.mparams() / f->mparams(), bare_ratio = bb->bf16 / bb->fp32;
      std::printf("| %zu | %d | %s | %zu MiB | %.2f | %.2f | %.2f |\n", b.servers, b.inflight,
                  b.pattern == Pattern::kWorker ? "worker" : "serial", b.bytes >> 20, ratio, bare_ratio,
                  ratio / bare_ratio);
    }
  }
  if (g_only_dense) return 0;
  std::printf("\n| kind | servers | keys/request | dim | pull | push (Adagrad) |\n|---|---|---|---|---|---|\n");
  std::vector<size_t> key_counts = g_quick ? std::vector<size_t>{1000}
                                           : std::vector<size_t>{1000, 10000, 100000};
  for (int servers : {1, 2}) {
    auto cluster = StartCluster(servers);
    for (uint32_t dim : {16u, 64u}) {
      for (size_t k : key_counts) SparseRate(*cluster, k, dim);
    }
  }
  return 0;
}
