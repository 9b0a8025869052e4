// Prometheus metrics for every Fulcrum process (docs/metrics.md).
//
// Components keep their own numbers (atomic counters, Histogram below) next
// to the state they describe, and render them when Prometheus scrapes: a
// MetricsServer calls each registered Collector, which appends samples to a
// Scrape. A job's series exist while the job does and vanish with it, so
// label values stay bounded by what the process holds.
//
//   auto server = MetricsServer::Start("0.0.0.0:9400", "server");
//   (*server)->Add(collector);   // a std::shared_ptr<Collector>
#ifndef FULCRUM_COMMON_METRICS_METRICS_H_
#define FULCRUM_COMMON_METRICS_METRICS_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/metrics/endpoint_security.h"
#include "prometheus/metric_family.h"

namespace fulcrum::metrics {

// Upper bounds (seconds) for request and step latencies: 50 us to 60 s.
const std::vector<double>& LatencyBuckets();
// Upper bounds for counts of steps (staleness).
const std::vector<double>& StalenessBuckets();

// A cumulative histogram with fixed bucket bounds; Observe is lock-free.
class Histogram {
 public:
  explicit Histogram(const std::vector<double>& bounds = LatencyBuckets());
  Histogram(const Histogram&) = delete;
  Histogram& operator=(const Histogram&) = delete;

  void Observe(double v);
  // Observes v n times at once.
  void Observe(double v, uint64_t n);
  uint64_t count() const;
  double sum() const;
  prometheus::ClientMetric::Histogram Snapshot() const;

 private:
  const std::vector<double>& bounds_;
  std::unique_ptr<std::atomic<uint64_t>[]> counts_;  // per bucket, +Inf last
  std::atomic<double> sum_{0};
};

// Adds to an atomic double (counters of seconds or bytes).
void AtomicAdd(std::atomic<double>* a, double v);

using Labels = std::vector<std::pair<std::string, std::string>>;

// The samples of one scrape, grouped by metric name.
class Scrape {
 public:
  void Gauge(const std::string& name, const std::string& help, const Labels& labels, double value);
  void Counter(const std::string& name, const std::string& help, const Labels& labels, double value);
  void Histogram(const std::string& name, const std::string& help, const Labels& labels,
                 const metrics::Histogram& h);
  std::vector<prometheus::MetricFamily> Take() { return std::move(families_); }

 private:
  prometheus::ClientMetric& Add(const std::string& name, const std::string& help, prometheus::MetricType type,
                                const Labels& labels);
  std::vector<prometheus::MetricFamily> families_;
};

// Something that renders its metrics into a scrape; called on the scrape
// thread, so it must be thread-safe.
class Collector {
 public:
  virtual ~Collector() = default;
  virtual void Collect(Scrape* out) const = 0;
};

// A Collector from a function.
class FunctionCollector : public Collector {
 public:
  explicit FunctionCollector(std::function<void(Scrape*)> fn) : fn_(std::move(fn)) {}
  void Collect(Scrape* out) const override { fn_(out); }

 private:
  std::function<void(Scrape*)> fn_;
};

// Process-wide series every component exports: fulcrum_build_info and the
// process_* gauges (start time, CPU seconds, resident and virtual memory,
// open file descriptors) read from /proc.
void CollectProcess(const std::string& component, Scrape* out);

// The HTTP endpoint Prometheus scrapes: GET /metrics (text format 0.0.4),
// and GET /healthz ("ok", for liveness probes). A small server of our own
// rather than prometheus-cpp's civetweb Exposer: civetweb starts its threads
// with a 100 KiB stack, too small for the static TLS of processes that load
// cuBLAS and OpenBLAS (pthread_create fails with EINVAL).
class MetricsServer {
 public:
  // `address` is host:port (port 0: any free port). Fails with a message
  // naming the address when it cannot listen.
  // With `security`: HTTPS and/or HTTP basic auth (GET /healthz stays
  // open, for probes; it tells nothing).
  static absl::StatusOr<std::unique_ptr<MetricsServer>> Start(const std::string& address,
                                                              const std::string& component,
                                                              const EndpointSecurity& security = {});
  ~MetricsServer();

  // Collectors are held weakly: one destroyed drops out of later scrapes.
  void Add(std::weak_ptr<Collector> collector);
  // host:port actually listened on.
  const std::string& address() const { return address_; }
  int port() const { return port_; }

 private:
  class Endpoint;
  MetricsServer() = default;
  void Serve();
  friend absl::StatusOr<std::unique_ptr<MetricsServer>> ServeMetrics(const std::string&, const std::string&,
                                                                     std::function<void(Scrape*)>,
                                                                     const EndpointSecurity&);
  std::string Answer(const std::string& head);
  std::unique_ptr<TlsContext> tls_;
  std::unique_ptr<BasicAuth> auth_;
  std::shared_ptr<Endpoint> endpoint_;
  std::shared_ptr<Collector> owned_;  // ServeMetrics' collector
  int listen_fd_ = -1;
  std::atomic<bool> stopping_{false};
  std::thread thread_;
  std::string address_;
  int port_ = 0;
};

// For a binary's --metrics_addr: starts the endpoint rendering `collect`
// (held by the server, so it must not outlive what `collect` reads) and logs
// where it serves; an empty address serves nothing (null, logged).
absl::StatusOr<std::unique_ptr<MetricsServer>> ServeMetrics(const std::string& address,
                                                           const std::string& component,
                                                           std::function<void(Scrape*)> collect,
                                                           const EndpointSecurity& security = {});

// A label value from an enum or status-code name: "NOT FOUND" -> "not_found".
std::string LabelValue(std::string name);

// Renders collectors in the text exposition format (tests, fulcrumctl).
std::string RenderText(const std::vector<const Collector*>& collectors);

// Reads a NVIDIA GPU's utilization and memory through NVML, loaded at run
// time (libnvidia-ml.so.1): a machine without the driver has no GPU series.
class Nvml {
 public:
  struct Device {
    int index;
    std::string name;
    double utilization;  // 0-1, over the driver's last sample period
    double memory_used_bytes;
    double memory_total_bytes;
  };
  // Null when the library or a GPU is missing (the reason is logged once).
  static std::unique_ptr<Nvml> Load();
  ~Nvml();
  std::vector<Device> Read() const;

 private:
  struct Api;
  Nvml() = default;
  void* handle_ = nullptr;
  std::unique_ptr<Api> api_;
  int count_ = 0;
};

}  // namespace fulcrum::metrics

#endif  // FULCRUM_COMMON_METRICS_METRICS_H_
