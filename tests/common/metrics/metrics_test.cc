// Metrics: histograms, the text exposition, the HTTP endpoint on 127.0.0.1,
// and the series a parameter server exports after real pushes and pulls.
#include "common/metrics/metrics.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cmath>
#include <string>

#include "absl/synchronization/notification.h"
#include "server/parameter_server.h"
#include "tests/testing/test_util.h"

namespace fulcrum {
namespace {

using testing::DenseTableSpec;
using testing::JobSpec;
using testing::SparseTableSpec;

// GET `path` from 127.0.0.1:`port`; returns the whole response.
std::string HttpGet(int port, const std::string& path) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  REQUIRE(fd >= 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0);
  const std::string req = "GET " + path + " HTTP/1.1\r\nHost: x\r\n\r\n";
  REQUIRE(send(fd, req.data(), req.size(), 0) == static_cast<ssize_t>(req.size()));
  std::string out;
  char buf[4096];
  ssize_t n;
  while ((n = recv(fd, buf, sizeof(buf), 0)) > 0) out.append(buf, static_cast<size_t>(n));
  close(fd);
  return out;
}

// The value of the sample line starting with `series` (name and labels
// exactly as rendered), or NaN when there is none.
double Sample(const std::string& text, const std::string& series) {
  size_t pos = 0;
  while ((pos = text.find(series + " ", pos)) != std::string::npos) {
    if (pos == 0 || text[pos - 1] == '\n') return std::stod(text.substr(pos + series.size() + 1));
    pos += series.size();
  }
  return std::nan("");
}

TEST_CASE("a histogram's buckets are cumulative and its sum exact", "[metrics]") {
  metrics::Histogram h(metrics::StalenessBuckets());  // 0, 1, 2, 3, 4, 6, ...
  for (double v : {0.0, 1.0, 1.0, 5.0, 100.0}) h.Observe(v);
  const auto snap = h.Snapshot();
  REQUIRE(snap.sample_count == 5);
  REQUIRE(snap.sample_sum == 107.0);
  REQUIRE(snap.bucket.front().upper_bound == 0.0);
  REQUIRE(snap.bucket.front().cumulative_count == 1);
  REQUIRE(snap.bucket[1].cumulative_count == 3);   // <= 1
  REQUIRE(snap.bucket[5].cumulative_count == 4);   // <= 6
  REQUIRE(std::isinf(snap.bucket.back().upper_bound));
  REQUIRE(snap.bucket.back().cumulative_count == 5);
}

TEST_CASE("the metrics endpoint serves collectors, build info and health over HTTP", "[metrics]") {
  REQUIRE_OK_AND_ASSIGN(auto server, metrics::MetricsServer::Start("127.0.0.1:0", "test"));
  REQUIRE(server->port() > 0);
  REQUIRE(server->address() == "127.0.0.1:" + std::to_string(server->port()));
  auto collector = std::make_shared<metrics::FunctionCollector>([](metrics::Scrape* out) {
    out->Gauge("fulcrum_test_value", "a test gauge", {{"job", "a\"b"}}, 42);
    out->Counter("fulcrum_test_total", "a test counter", {}, 7);
  });
  server->Add(collector);

  const std::string r = HttpGet(server->port(), "/metrics");
  INFO(r);
  REQUIRE(r.rfind("HTTP/1.1 200 OK\r\n", 0) == 0);
  REQUIRE(r.find("Content-Type: text/plain; version=0.0.4") != std::string::npos);
  REQUIRE(r.find("# TYPE fulcrum_test_total counter") != std::string::npos);
  REQUIRE(Sample(r, "fulcrum_test_value{job=\"a\\\"b\"}") == 42);  // label values escaped
  REQUIRE(Sample(r, "fulcrum_test_total") == 7);
  REQUIRE(r.find("fulcrum_build_info{component=\"test\",version=\"") != std::string::npos);
  REQUIRE(Sample(r, "process_resident_memory_bytes") > 1e6);
  REQUIRE(Sample(r, "process_start_time_seconds") > 1.7e9);

  REQUIRE(HttpGet(server->port(), "/healthz").find("\r\n\r\nok\n") != std::string::npos);
  REQUIRE(HttpGet(server->port(), "/nope").rfind("HTTP/1.1 404", 0) == 0);

  // A collector that is gone drops out of later scrapes.
  collector.reset();
  REQUIRE(HttpGet(server->port(), "/metrics").find("fulcrum_test_value") == std::string::npos);
}

TEST_CASE("a metrics address that cannot be served is refused with a message naming it", "[metrics]") {
  REQUIRE_OK_AND_ASSIGN(auto first, metrics::MetricsServer::Start("127.0.0.1:0", "test"));
  const std::string taken = first->address();
  REQUIRE_STATUS(metrics::MetricsServer::Start(taken, "test").status(), absl::StatusCode::kUnavailable,
                 "cannot serve metrics on " + taken);
  REQUIRE_STATUS(metrics::MetricsServer::Start("no-port", "test").status(), absl::StatusCode::kInvalidArgument,
                 "is not host:port");
  REQUIRE_OK_AND_ASSIGN(auto none, metrics::ServeMetrics("", "test", {}));
  REQUIRE(none == nullptr);
}

TEST_CASE("a parameter server counts requests, bytes, waits and rejections per job", "[metrics][server]") {
  ParameterServerOptions o;
  o.shard_map = ShardMap::FromServerList("self:1", 4)->ToProto();
  REQUIRE_OK_AND_ASSIGN(auto ps, ParameterServer::Create(o));
  REQUIRE_OK(ps->CreateJob(JobSpec("m", {DenseTableSpec("w", 4)}, 2, v1::ConsistencySpec::SSP, 1)).status());

  std::vector<float> g(4, 0.5f);
  PushMessage push;
  push.job_id = "m";
  push.worker_id = "w0";
  push.seq = 1;
  push.rank = 0;
  push.step = 0;
  push.dense.push_back({"w", 0, DType::kFp32, Payload(g.data(), g.size() * 4)});
  PushResult pr;
  REQUIRE_OK(ps->Push(push, &pr));
  REQUIRE_OK(ps->Push(push, &pr));  // a retry: deduplicated
  PushMessage bad = push;
  bad.job_id = "nope";
  REQUIRE(ps->Push(bad, &pr).code() == absl::StatusCode::kNotFound);

  auto pull = std::make_shared<PullMessage>();
  pull->job_id = "m";
  pull->worker_id = "w0";
  pull->rank = 0;
  pull->step = 1;  // rank 1 is at clock 0: within the bound of 1
  pull->dense.push_back({"w", 0});
  absl::Notification done;
  ps->Pull(pull, absl::InfiniteFuture(), [&](absl::StatusOr<PullResult> r) {
    CHECK(r.ok());
    done.Notify();
  });
  done.WaitForNotification();

  metrics::FunctionCollector c([&](metrics::Scrape* out) { ps->CollectMetrics(out); });
  const std::string text = metrics::RenderText({&c});
  INFO(text);
  REQUIRE(Sample(text, "fulcrum_server_requests_total{job=\"m\",op=\"push\"}") == 2);
  REQUIRE(Sample(text, "fulcrum_server_requests_total{job=\"m\",op=\"pull\"}") == 1);
  REQUIRE(Sample(text, "fulcrum_server_payload_bytes_total{job=\"m\",op=\"push\"}") == 32);
  REQUIRE(Sample(text, "fulcrum_server_payload_bytes_total{job=\"m\",op=\"pull\"}") == 16);
  REQUIRE(Sample(text, "fulcrum_server_dedup_hits_total{job=\"m\"}") == 1);
  REQUIRE(Sample(text, "fulcrum_server_pushes_applied_total{job=\"m\"}") == 1);
  REQUIRE(Sample(text, "fulcrum_server_rejected_requests_total{op=\"push\",reason=\"not_found\"}") == 1);
  REQUIRE(Sample(text, "fulcrum_server_rejected_requests_total{op=\"pull\",reason=\"not_found\"}") == 0);
  REQUIRE(Sample(text, "fulcrum_server_request_duration_seconds_count{job=\"m\",op=\"push\"}") == 2);
  REQUIRE(Sample(text, "fulcrum_server_consistency_wait_seconds_count{job=\"m\"}") == 1);
  // SSP: the pull's clock 1 was one step ahead of rank 1's clock 0.
  REQUIRE(Sample(text, "fulcrum_server_staleness_steps_bucket{job=\"m\",le=\"0\"}") == 0);
  REQUIRE(Sample(text, "fulcrum_server_staleness_steps_bucket{job=\"m\",le=\"1\"}") == 1);
  REQUIRE(Sample(text, "fulcrum_server_optimizer_apply_seconds_count{job=\"m\"}") == 1);
  REQUIRE(Sample(text, "fulcrum_server_parameters{job=\"m\",table=\"w\"}") == 4);
  REQUIRE(Sample(text, "fulcrum_server_job_memory_bytes{job=\"m\"}") > 0);
  REQUIRE(Sample(text, "fulcrum_server_jobs") == 1);
  REQUIRE(Sample(text, "fulcrum_server_owned_virtual_shards") == 4);

  // A deleted job's series are gone.
  REQUIRE_OK(ps->DeleteJob("m").status());
  const std::string after = metrics::RenderText({&c});
  REQUIRE(after.find("job=\"m\"") == std::string::npos);
  REQUIRE(Sample(after, "fulcrum_server_jobs") == 0);
}

TEST_CASE("a parameter server reports a sparse table's rows, bytes, admissions, rejections and evictions",
          "[metrics][server]") {
  ParameterServerOptions o;
  o.shard_map = ShardMap::FromServerList("self:1", 1)->ToProto();
  REQUIRE_OK_AND_ASSIGN(auto ps, ParameterServer::Create(o));
  v1::TableSpec emb = SparseTableSpec("emb", 2);
  emb.mutable_admission()->set_min_count(2);
  emb.mutable_eviction()->set_max_rows(2);
  REQUIRE_OK(ps->CreateJob(JobSpec("s", {emb}, 1, v1::ConsistencySpec::ASP)).status());
  // Keys 1, 2, 3 pushed twice each: three first pushes rejected, three
  // admissions, the third past the cap of 2 evicts one row.
  uint64_t seq = 0;
  for (int round = 0; round < 2; ++round) {
    for (uint64_t key : {1, 2, 3}) {
      std::vector<float> g(2, 1.0f);
      PushMessage push;
      push.job_id = "s";
      push.worker_id = "w0";
      push.seq = ++seq;
      push.step = seq;
      push.sparse.push_back({"emb", DType::kFp32, Payload(&key, 8), Payload(g.data(), 8)});
      PushResult pr;
      REQUIRE_OK(ps->Push(push, &pr));
    }
  }
  metrics::FunctionCollector c([&](metrics::Scrape* out) { ps->CollectMetrics(out); });
  const std::string text = metrics::RenderText({&c});
  INFO(text);
  CHECK(Sample(text, "fulcrum_server_sparse_rows{job=\"s\",table=\"emb\"}") == 2);
  CHECK(Sample(text, "fulcrum_server_sparse_table_bytes{job=\"s\",table=\"emb\"}") > 0);
  CHECK(Sample(text, "fulcrum_server_sparse_admitted_total{job=\"s\",table=\"emb\"}") == 3);
  CHECK(Sample(text, "fulcrum_server_sparse_rejected_total{job=\"s\",table=\"emb\"}") == 3);
  CHECK(Sample(text, "fulcrum_server_sparse_evicted_total{job=\"s\",table=\"emb\",cause=\"cap\"}") == 1);
  CHECK(Sample(text, "fulcrum_server_sparse_evicted_total{job=\"s\",table=\"emb\",cause=\"ttl\"}") == 0);
  CHECK(Sample(text, "fulcrum_server_sparse_sketch_bytes{job=\"s\",table=\"emb\"}") == 4 * 4096 * 2);
}

}  // namespace
}  // namespace fulcrum
