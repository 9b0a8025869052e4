#include "common/metrics/metrics.h"

#include <dirent.h>
#include <dlfcn.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <thread>

#include <cmath>
#include <exception>
#include <fstream>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "prometheus/text_serializer.h"

#ifndef FULCRUM_VERSION
#define FULCRUM_VERSION "unknown"
#endif
#ifndef FULCRUM_REVISION
#define FULCRUM_REVISION "unknown"
#endif

namespace fulcrum::metrics {

const std::vector<double>& LatencyBuckets() {
  static const std::vector<double> b = {0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025,
                                        0.05,    0.1,    0.25,    0.5,    1,     2.5,    5,     10,   30,   60};
  return b;
}

const std::vector<double>& StalenessBuckets() {
  static const std::vector<double> b = {0, 1, 2, 3, 4, 6, 8, 12, 16, 32, 64};
  return b;
}

Histogram::Histogram(const std::vector<double>& bounds)
    : bounds_(bounds), counts_(new std::atomic<uint64_t>[bounds.size() + 1]) {
  for (size_t i = 0; i <= bounds_.size(); ++i) counts_[i].store(0, std::memory_order_relaxed);
}

void AtomicAdd(std::atomic<double>* a, double v) {
  double cur = a->load(std::memory_order_relaxed);
  while (!a->compare_exchange_weak(cur, cur + v, std::memory_order_relaxed)) {
  }
}

void Histogram::Observe(double v) {
  size_t i = 0;
  while (i < bounds_.size() && v > bounds_[i]) ++i;
  counts_[i].fetch_add(1, std::memory_order_relaxed);
  AtomicAdd(&sum_, v);
}

void Histogram::Observe(double v, uint64_t n) {
  if (n == 0) return;
  size_t i = 0;
  while (i < bounds_.size() && v > bounds_[i]) ++i;
  counts_[i].fetch_add(n, std::memory_order_relaxed);
  AtomicAdd(&sum_, v * static_cast<double>(n));
}

uint64_t Histogram::count() const {
  uint64_t n = 0;
  for (size_t i = 0; i <= bounds_.size(); ++i) n += counts_[i].load(std::memory_order_relaxed);
  return n;
}

double Histogram::sum() const { return sum_.load(std::memory_order_relaxed); }

prometheus::ClientMetric::Histogram Histogram::Snapshot() const {
  prometheus::ClientMetric::Histogram h;
  uint64_t cumulative = 0;
  for (size_t i = 0; i <= bounds_.size(); ++i) {
    cumulative += counts_[i].load(std::memory_order_relaxed);
    prometheus::ClientMetric::Bucket b;
    b.cumulative_count = cumulative;
    b.upper_bound = i < bounds_.size() ? bounds_[i] : std::numeric_limits<double>::infinity();
    h.bucket.push_back(b);
  }
  h.sample_count = cumulative;
  h.sample_sum = sum();
  return h;
}

prometheus::ClientMetric& Scrape::Add(const std::string& name, const std::string& help,
                                      prometheus::MetricType type, const Labels& labels) {
  prometheus::MetricFamily* family = nullptr;
  for (auto& f : families_) {
    if (f.name == name) family = &f;
  }
  if (family == nullptr) {
    families_.push_back(prometheus::MetricFamily{name, help, type, {}});
    family = &families_.back();
  }
  prometheus::ClientMetric& m = family->metric.emplace_back();
  for (const auto& [k, v] : labels) m.label.push_back({k, v});
  return m;
}

void Scrape::Gauge(const std::string& name, const std::string& help, const Labels& labels, double value) {
  Add(name, help, prometheus::MetricType::Gauge, labels).gauge.value = value;
}

void Scrape::Counter(const std::string& name, const std::string& help, const Labels& labels, double value) {
  Add(name, help, prometheus::MetricType::Counter, labels).counter.value = value;
}

void Scrape::Histogram(const std::string& name, const std::string& help, const Labels& labels,
                       const metrics::Histogram& h) {
  Add(name, help, prometheus::MetricType::Histogram, labels).histogram = h.Snapshot();
}

namespace {

// /proc/self/stat fields after the command name: state is field 3.
struct ProcStat {
  double cpu_seconds = 0;
  double start_time_seconds = 0;
  double virtual_bytes = 0;
  double resident_bytes = 0;
};

bool ReadProcStat(ProcStat* out) {
  std::ifstream in("/proc/self/stat");
  std::string line;
  if (!std::getline(in, line)) return false;
  const size_t paren = line.rfind(')');
  if (paren == std::string::npos) return false;
  std::vector<std::string> f = absl::StrSplit(line.substr(paren + 2), ' ');
  // f[0] is field 3 (state): field k is f[k - 3].
  if (f.size() < 22) return false;
  const double ticks = static_cast<double>(sysconf(_SC_CLK_TCK));
  double utime = 0, stime = 0, start = 0, vsize = 0, rss = 0;
  if (!absl::SimpleAtod(f[11], &utime) || !absl::SimpleAtod(f[12], &stime) || !absl::SimpleAtod(f[19], &start) ||
      !absl::SimpleAtod(f[20], &vsize) || !absl::SimpleAtod(f[21], &rss)) {
    return false;
  }
  out->cpu_seconds = (utime + stime) / ticks;
  out->virtual_bytes = vsize;
  out->resident_bytes = rss * static_cast<double>(sysconf(_SC_PAGESIZE));
  // The boot time never changes: read it once.
  static const double btime = [] {
    std::ifstream st("/proc/stat");
    std::string word;
    double t = 0;
    while (st >> word) {
      if (word == "btime") {
        st >> t;
        break;
      }
    }
    return t;
  }();
  out->start_time_seconds = btime + start / ticks;
  return true;
}

double OpenFds() {
  DIR* d = opendir("/proc/self/fd");
  if (d == nullptr) return 0;
  double n = 0;
  while (dirent* e = readdir(d)) {
    if (e->d_name[0] != '.') ++n;
  }
  closedir(d);
  return n - 1;  // the directory stream itself
}

}  // namespace

void CollectProcess(const std::string& component, Scrape* out) {
  out->Gauge("fulcrum_build_info", "Fulcrum build: version and source revision; always 1",
             {{"component", component}, {"version", FULCRUM_VERSION}, {"revision", FULCRUM_REVISION}}, 1);
  ProcStat st;
  if (ReadProcStat(&st)) {
    out->Gauge("process_start_time_seconds", "Start time of the process since the Unix epoch", {},
               st.start_time_seconds);
    out->Counter("process_cpu_seconds_total", "User and system CPU time spent", {}, st.cpu_seconds);
    out->Gauge("process_resident_memory_bytes", "Resident memory size", {}, st.resident_bytes);
    out->Gauge("process_virtual_memory_bytes", "Virtual memory size", {}, st.virtual_bytes);
  }
  out->Gauge("process_open_fds", "Open file descriptors", {}, OpenFds());
}

// The collectors a MetricsServer renders; shared with its serving thread.
class MetricsServer::Endpoint {
 public:
  explicit Endpoint(std::string component) : component_(std::move(component)) {}
  void Add(std::weak_ptr<Collector> c) {
    absl::MutexLock l(&mu_);
    collectors_.push_back(std::move(c));
  }
  std::string Render() {
    std::vector<std::shared_ptr<Collector>> live;
    {
      absl::MutexLock l(&mu_);
      for (auto it = collectors_.begin(); it != collectors_.end();) {
        if (auto c = it->lock()) {
          live.push_back(std::move(c));
          ++it;
        } else {
          it = collectors_.erase(it);
        }
      }
    }
    Scrape scrape;
    CollectProcess(component_, &scrape);
    for (const auto& c : live) c->Collect(&scrape);
    std::ostringstream out;
    prometheus::TextSerializer().Serialize(out, scrape.Take());
    return out.str();
  }

 private:
  const std::string component_;
  absl::Mutex mu_;
  std::vector<std::weak_ptr<Collector>> collectors_ ABSL_GUARDED_BY(mu_);
};

namespace {

bool WriteAll(int fd, std::string_view data) {
  while (!data.empty()) {
    const ssize_t n = send(fd, data.data(), data.size(), MSG_NOSIGNAL);
    if (n <= 0) return false;
    data.remove_prefix(static_cast<size_t>(n));
  }
  return true;
}

std::string HttpResponse(int code, const char* reason, const char* type, const std::string& body,
                         const char* extra_headers = "") {
  return absl::StrCat("HTTP/1.1 ", code, " ", reason, "\r\n", extra_headers, "Content-Type: ", type,
                      "\r\nContent-Length: ", body.size(), "\r\nConnection: close\r\n\r\n", body);
}

}  // namespace

// The response to one request head.
std::string MetricsServer::Answer(const std::string& head) {
  const size_t eol = head.find_first_of("\r\n");
  const std::vector<std::string> parts = absl::StrSplit(head.substr(0, eol), ' ');
  if (parts.size() < 2 || (parts[0] != "GET" && parts[0] != "HEAD")) {
    return HttpResponse(405, "Method Not Allowed", "text/plain", "only GET /metrics and GET /healthz\n");
  }
  const std::string path = parts[1].substr(0, parts[1].find('?'));
  std::string reply;
  if (path == "/healthz" || path == "/") {
    reply = HttpResponse(200, "OK", "text/plain", "ok\n");
  } else if (path != "/metrics") {
    reply = HttpResponse(404, "Not Found", "text/plain", "not found: try /metrics\n");
  } else {
    std::string authorization;
    for (absl::string_view line : absl::StrSplit(head, '\n')) {
      const size_t colon = line.find(':');
      if (colon == absl::string_view::npos || !absl::EqualsIgnoreCase(line.substr(0, colon), "authorization")) continue;
      authorization = std::string(absl::StripAsciiWhitespace(line.substr(colon + 1)));
    }
    if (auth_ != nullptr && !auth_->Check(authorization)) {
      reply = HttpResponse(401, "Unauthorized", "text/plain", "unauthorized: basic auth required\n",
                           "WWW-Authenticate: Basic realm=\"fulcrum metrics\"\r\n");
    } else {
      reply = HttpResponse(200, "OK", "text/plain; version=0.0.4; charset=utf-8", endpoint_->Render());
    }
  }
  if (parts[0] == "HEAD") reply.resize(reply.find("\r\n\r\n") + 4);
  return reply;
}

// One request per connection (Prometheus opens a connection per scrape when
// the server closes it): the TLS handshake when HTTPS, the request head (8
// KiB at most, 5 s at most), the answer, close.
void MetricsServer::Serve() {
  while (true) {
    const int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EINTR || errno == ECONNABORTED || errno == EMFILE || errno == ENFILE) {
        if (errno == EMFILE || errno == ENFILE) std::this_thread::sleep_for(std::chrono::milliseconds(100));
        continue;
      }
      return;  // shut down (the socket was shut down) or broken
    }
    if (stopping_.load()) {
      close(fd);
      return;
    }
    timeval tv{5, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
    SSL* ssl = nullptr;
    if (tls_ != nullptr) {
      SSL_CTX* ctx = tls_->Acquire();
      ssl = SSL_new(ctx);
      SSL_CTX_free(ctx);  // the SSL holds its own reference
      SSL_set_fd(ssl, fd);
      if (SSL_accept(ssl) != 1) {  // a plaintext client, a bad handshake, a timeout
        ERR_clear_error();
        SSL_free(ssl);
        close(fd);
        continue;
      }
    }
    auto read = [&](char* buf, size_t n) -> ssize_t {
      return ssl != nullptr ? SSL_read(ssl, buf, static_cast<int>(n)) : recv(fd, buf, n, 0);
    };
    std::string head;
    char buf[2048];
    while (head.find("\r\n\r\n") == std::string::npos && head.find("\n\n") == std::string::npos &&
           head.size() < 8192) {
      const ssize_t n = read(buf, sizeof(buf));
      if (n <= 0) break;
      head.append(buf, static_cast<size_t>(n));
    }
    const std::string reply = Answer(head);
    if (ssl != nullptr) {
      size_t done = 0;
      while (done < reply.size()) {
        const int n = SSL_write(ssl, reply.data() + done, static_cast<int>(reply.size() - done));
        if (n <= 0) break;
        done += static_cast<size_t>(n);
      }
      SSL_shutdown(ssl);
      ERR_clear_error();
      SSL_free(ssl);
    } else {
      WriteAll(fd, reply);
    }
    close(fd);
  }
}

absl::StatusOr<std::unique_ptr<MetricsServer>> MetricsServer::Start(const std::string& address,
                                                                     const std::string& component,
                                                                     const EndpointSecurity& security) {
  std::unique_ptr<TlsContext> tls;
  std::unique_ptr<BasicAuth> auth;
  if (security.tls() || !security.tls_key_file.empty()) {
    ASSIGN_OR_RETURN(tls, TlsContext::Open(security.tls_cert_file, security.tls_key_file));
  }
  if (!security.basic_auth_file.empty()) {
    ASSIGN_OR_RETURN(auth, BasicAuth::Open(security.basic_auth_file));
  }
  const size_t colon = address.rfind(':');
  int port = -1;
  if (colon == std::string::npos || !absl::SimpleAtoi(address.substr(colon + 1), &port) || port < 0 ||
      port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics address '", address, "' is not host:port (e.g. 0.0.0.0:9400)"));
  }
  std::string host = address.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* res = nullptr;
  const std::string service = absl::StrCat(port);
  if (const int rc = getaddrinfo(host.empty() ? nullptr : host.c_str(), service.c_str(), &hints, &res); rc != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics address '", address, "': cannot resolve '", host, "': ", gai_strerror(rc)));
  }
  int fd = -1;
  std::string why;
  for (addrinfo* ai = res; ai != nullptr && fd < 0; ai = ai->ai_next) {
    fd = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol);
    if (fd < 0) continue;
    const int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (bind(fd, ai->ai_addr, ai->ai_addrlen) != 0 || listen(fd, 64) != 0) {
      why = std::strerror(errno);
      close(fd);
      fd = -1;
    }
  }
  freeaddrinfo(res);
  if (fd < 0) {
    return absl::UnavailableError(absl::StrCat("cannot serve metrics on ", address, ": ", why,
                                               " (port in use? pass --metrics_addr=HOST:PORT, or "
                                               "--metrics_addr= to turn metrics off)"));
  }
  sockaddr_storage bound{};
  socklen_t len = sizeof(bound);
  getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &len);
  const int actual = ntohs(bound.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port
                                                       : reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
  std::unique_ptr<MetricsServer> s(new MetricsServer());
  s->tls_ = std::move(tls);
  s->auth_ = std::move(auth);
  s->endpoint_ = std::make_shared<Endpoint>(component);
  s->listen_fd_ = fd;
  s->port_ = actual;
  s->address_ = absl::StrCat(address.substr(0, colon), ":", actual);
  s->thread_ = std::thread([srv = s.get()] { srv->Serve(); });
  return s;
}

MetricsServer::~MetricsServer() {
  stopping_.store(true);
  shutdown(listen_fd_, SHUT_RDWR);  // wakes accept()
  if (thread_.joinable()) thread_.join();
  close(listen_fd_);
}

void MetricsServer::Add(std::weak_ptr<Collector> collector) { endpoint_->Add(std::move(collector)); }

absl::StatusOr<std::unique_ptr<MetricsServer>> ServeMetrics(const std::string& address,
                                                           const std::string& component,
                                                           std::function<void(Scrape*)> collect,
                                                           const EndpointSecurity& security) {
  if (address.empty()) {
    FLOG(INFO) << "--metrics_addr is empty: no metrics endpoint";
    return std::unique_ptr<MetricsServer>();
  }
  ASSIGN_OR_RETURN(std::unique_ptr<MetricsServer> server, MetricsServer::Start(address, component, security));
  server->owned_ = std::make_shared<FunctionCollector>(std::move(collect));
  server->Add(server->owned_);
  FLOG(INFO) << "metrics on " << (security.tls() ? "https" : "http") << "://" << server->address() << "/metrics"
             << (security.basic_auth_file.empty() ? "" : " (basic auth)");
  return server;
}

std::string LabelValue(std::string name) {
  for (char& c : name) c = c == ' ' ? '_' : static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return name;
}

std::string RenderText(const std::vector<const Collector*>& collectors) {
  Scrape scrape;
  for (const Collector* c : collectors) c->Collect(&scrape);
  std::ostringstream out;
  prometheus::TextSerializer().Serialize(out, scrape.Take());
  return out.str();
}

// ---- NVML, loaded at run time ----------------------------------------------

struct Nvml::Api {
  struct Utilization {
    unsigned int gpu, memory;
  };
  struct Memory {
    unsigned long long total, free, used;
  };
  using Device = void*;
  int (*shutdown)();
  int (*get_handle)(unsigned int, Device*);
  int (*get_utilization)(Device, Utilization*);
  int (*get_memory)(Device, Memory*);
  int (*get_name)(Device, char*, unsigned int);
};

std::unique_ptr<Nvml> Nvml::Load() {
  void* h = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
  if (h == nullptr) {
    FLOG(INFO) << "no GPU metrics: libnvidia-ml.so.1 not loadable (no NVIDIA driver)";
    return nullptr;
  }
  auto sym = [h](const char* name) { return dlsym(h, name); };
  auto init = reinterpret_cast<int (*)()>(sym("nvmlInit_v2"));
  auto count = reinterpret_cast<int (*)(unsigned int*)>(sym("nvmlDeviceGetCount_v2"));
  auto api = std::make_unique<Api>();
  api->shutdown = reinterpret_cast<int (*)()>(sym("nvmlShutdown"));
  api->get_handle = reinterpret_cast<int (*)(unsigned int, Api::Device*)>(sym("nvmlDeviceGetHandleByIndex_v2"));
  api->get_utilization =
      reinterpret_cast<int (*)(Api::Device, Api::Utilization*)>(sym("nvmlDeviceGetUtilizationRates"));
  api->get_memory = reinterpret_cast<int (*)(Api::Device, Api::Memory*)>(sym("nvmlDeviceGetMemoryInfo"));
  api->get_name = reinterpret_cast<int (*)(Api::Device, char*, unsigned int)>(sym("nvmlDeviceGetName"));
  unsigned int n = 0;
  if (init == nullptr || count == nullptr || api->shutdown == nullptr || api->get_handle == nullptr ||
      api->get_utilization == nullptr || api->get_memory == nullptr || api->get_name == nullptr) {
    FLOG(WARNING) << "no GPU metrics: libnvidia-ml.so.1 lacks the NVML functions used";
    dlclose(h);
    return nullptr;
  }
  if (const int rc = init(); rc != 0) {
    FLOG(INFO) << "no GPU metrics: nvmlInit failed (code " << rc << ")";
    dlclose(h);
    return nullptr;
  }
  if (count(&n) != 0 || n == 0) {
    FLOG(INFO) << "no GPU metrics: NVML sees no GPU";
    api->shutdown();
    dlclose(h);
    return nullptr;
  }
  std::unique_ptr<Nvml> nvml(new Nvml());
  nvml->handle_ = h;
  nvml->api_ = std::move(api);
  nvml->count_ = static_cast<int>(n);
  FLOG(INFO) << "GPU metrics from NVML: " << n << " GPU(s)";
  return nvml;
}

Nvml::~Nvml() {
  if (api_) api_->shutdown();
  if (handle_ != nullptr) dlclose(handle_);
}

std::vector<Nvml::Device> Nvml::Read() const {
  std::vector<Device> out;
  for (int i = 0; i < count_; ++i) {
    Api::Device d = nullptr;
    if (api_->get_handle(static_cast<unsigned int>(i), &d) != 0) continue;
    Device dev{i, "", 0, 0, 0};
    char name[96] = {0};
    if (api_->get_name(d, name, sizeof(name)) == 0) dev.name = name;
    Api::Utilization u{};
    if (api_->get_utilization(d, &u) == 0) dev.utilization = u.gpu / 100.0;
    Api::Memory m{};
    if (api_->get_memory(d, &m) == 0) {
      dev.memory_used_bytes = static_cast<double>(m.used);
      dev.memory_total_bytes = static_cast<double>(m.total);
    }
    out.push_back(std::move(dev));
  }
  return out;
}

}  // namespace fulcrum::metrics
