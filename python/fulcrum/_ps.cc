// fulcrum._ps: the C++ parameter-server client (GrpcPsClient) for Python,
// and the safetensors writer of checkpoint exports (fulcrum.Client.export).
//
// Arrays are NumPy's own memory: pushes read it and pulls write into it
// where it lies, so an array must already be float32 (keys uint64) and
// C-contiguous, and a pull's target writeable; anything else is a
// ValueError naming the table, never a silent copy. Calls release the GIL.
// A refused call raises fulcrum.FulcrumError with the gRPC code and the
// message. Slicing, routing to servers, retries, shared memory and the
// wire's 16-bit types are the C++ client's.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/logging.h"
#include "common/checkpoint_export.h"
#include "common/config/spec_text.h"
#include "common/dtype.h"
#include "common/process.h"
#include "common/rpc/security.h"
#include "worker/rpc/grpc_ps_client.h"

namespace py = pybind11;

namespace fulcrum {
namespace {

// The C++ client's log lines, held for Python's logging (fulcrum.tables
// takes them after each call): a C++ thread never calls into Python, so no
// line waits on the GIL. At most kMaxHeldLines are held; past that the
// oldest go, counted.
class HeldLogs {
 public:
  static constexpr size_t kMaxHeldLines = 1000;
  static HeldLogs& Get() {
    static HeldLogs* logs = new HeldLogs();
    return *logs;
  }
  static void Sink(LogSeverity severity, const std::string& line) { Get().Add(severity, line); }
  void Add(LogSeverity severity, const std::string& line) {
    absl::MutexLock lock(&mu_);
    if (lines_.size() >= kMaxHeldLines) {
      lines_.pop_front();
      ++dropped_;
    }
    lines_.emplace_back(static_cast<int>(severity), line);
  }
  // (severity 0 info, 1 warning, 2 error; the line), oldest first, and how
  // many were dropped since the last take.
  std::pair<std::vector<std::pair<int, std::string>>, uint64_t> Take() {
    absl::MutexLock lock(&mu_);
    std::vector<std::pair<int, std::string>> out(std::make_move_iterator(lines_.begin()),
                                                 std::make_move_iterator(lines_.end()));
    lines_.clear();
    const uint64_t dropped = dropped_;
    dropped_ = 0;
    return {std::move(out), dropped};
  }

 private:
  absl::Mutex mu_;
  std::deque<std::pair<int, std::string>> lines_ ABSL_GUARDED_BY(mu_);
  uint64_t dropped_ ABSL_GUARDED_BY(mu_) = 0;
};

// An absl::Status on its way to Python as fulcrum.FulcrumError.
struct StatusError {
  std::string call;
  absl::Status status;
};

void Check(const std::string& call, absl::Status s) {
  if (!s.ok()) throw StatusError{call, std::move(s)};
}

template <typename T>
const T* ArrayData(const py::array& a, const std::string& what, bool writeable, size_t* n) {
  if (!py::isinstance<py::array_t<T>>(a) || !py::dtype::of<T>().is(a.dtype())) {
    throw py::value_error(absl::StrCat(what, ": expected a ", std::string(py::str(py::dtype::of<T>())),
                                       " array, got ", std::string(py::str(a.dtype()))));
  }
  if (!(a.flags() & py::array::c_style)) throw py::value_error(absl::StrCat(what, ": the array must be C-contiguous"));
  if (writeable && !a.writeable()) throw py::value_error(absl::StrCat(what, ": the array is read-only"));
  *n = static_cast<size_t>(a.size());
  return static_cast<const T*>(a.data());
}

DType WireDType(const std::string& name) {
  for (DType d : {DType::kFp32, DType::kBf16, DType::kFp16}) {
    if (name == DTypeName(d)) return d;
  }
  throw py::value_error(absl::StrCat("wire_dtype must be fp32, bf16 or fp16, got '", name, "'"));
}

// One sparse entry, {table: (keys, rows)}: the keys and the rows' memory,
// checked to be whole rows. `rows_name` says what the rows are in messages.
struct SparseArrays {
  std::string table;
  const uint64_t* keys = nullptr;
  size_t num_keys = 0;
  const float* rows = nullptr;
};
SparseArrays Sparse(const py::handle& name, const py::handle& value, const char* rows_name, bool writeable) {
  SparseArrays a;
  a.table = py::str(name);
  const auto pair = value.cast<py::tuple>();
  if (pair.size() != 2) throw py::value_error(absl::StrCat("sparse ", a.table, ": give (keys, ", rows_name, ")"));
  size_t num_values = 0;
  a.keys = ArrayData<uint64_t>(pair[0].cast<py::array>(), "sparse " + a.table + " keys", false, &a.num_keys);
  a.rows = ArrayData<float>(pair[1].cast<py::array>(), absl::StrCat("sparse ", a.table, " ", rows_name), writeable,
                            &num_values);
  // A table's rows are its dimension wide: the server knows it, the rows
  // array must hold a whole number of them.
  if (a.num_keys == 0 ? num_values != 0 : num_values % a.num_keys != 0) {
    throw py::value_error(absl::StrCat("sparse ", a.table, ": ", num_values, " values are not whole rows for ",
                                       a.num_keys, " keys"));
  }
  return a;
}

// A push in flight (Tables.push_async): holds the arrays it reads until it
// is done; wait() raises what the push failed with.
class PendingPush {
 public:
  PendingPush(Future<absl::Status> done, py::list arrays, std::string what)
      : done_(std::move(done)), arrays_(std::move(arrays)), what_(std::move(what)) {}
  PendingPush(PendingPush&&) = default;
  // Dropped unwaited: the arrays stay alive until the push read them.
  ~PendingPush() {
    if (waited_ || !arrays_) return;
    py::gil_scoped_release release;
    done_.Wait();
  }
  void Wait() {
    absl::Status s;
    {
      py::gil_scoped_release release;
      s = done_.Wait();
    }
    waited_ = true;
    arrays_ = py::list();
    Check(what_, s);
  }

 private:
  bool waited_ = false;
  Future<absl::Status> done_;
  py::list arrays_;
  std::string what_;
};

class Tables {
 public:
  Tables(std::vector<std::string> servers, std::string worker_id, uint32_t rank, const std::string& wire_dtype,
         std::optional<std::vector<std::string>> tls, bool shared_memory, int channels_per_server,
         double rpc_timeout_s, uint32_t incarnation) {
    GrpcPsClientOptions o;
    o.bootstrap_servers = std::move(servers);
    o.worker_id = std::move(worker_id);
    o.rank = rank;
    o.incarnation = incarnation;
    o.shared_memory = shared_memory;
    o.channels_per_server = channels_per_server;
    o.rpc_timeout = absl::Seconds(rpc_timeout_s);
    o.wire_dtype = WireDType(wire_dtype);
    if (tls.has_value()) {
      if (tls->size() != 3) throw py::value_error("tls: give (ca_file, cert_file, key_file)");
      auto t = security::Transport::Member({(*tls)[0], (*tls)[1], (*tls)[2], ""});
      Check("tls", t.status());
      o.security = *std::move(t);
    }
    py::gil_scoped_release release;
    auto c = GrpcPsClient::Create(std::move(o));
    Check("connect", c.status());
    client_ = *std::move(c);
  }

  void CreateJob(const std::string& spec_text) {
    v1::PsJobSpec spec;
    Check("create_job", config::ParseSpecText(spec_text, "spec", &spec));
    py::gil_scoped_release release;
    Check(absl::StrCat("create_job ", spec.job_id()), client_->CreateJob(spec));
  }
  void OpenJob(const std::string& job) {
    py::gil_scoped_release release;
    Check(absl::StrCat("open_job ", job), client_->OpenJob(job));
  }
  void DeleteJob(const std::string& job) {
    py::gil_scoped_release release;
    Check(absl::StrCat("delete_job ", job), client_->DeleteJob(job));
  }

  void Push(const std::string& job, uint64_t step, const py::dict& dense, const py::dict& sparse, bool last,
            float lr_scale) {
    PushBatch b = Batch(dense, sparse, step, last, lr_scale);
    py::gil_scoped_release release;
    Check(absl::StrCat("push ", job), client_->Push(job, b));
  }

  // The push started; the arrays must not change until it is waited for.
  PendingPush PushAsync(const std::string& job, uint64_t step, const py::dict& dense, const py::dict& sparse,
                        bool last, float lr_scale) {
    PushBatch b = Batch(dense, sparse, step, last, lr_scale);
    py::list arrays;
    for (auto [name, value] : dense) arrays.append(value);
    for (auto [name, value] : sparse) arrays.append(value);
    Future<absl::Status> done;
    {
      py::gil_scoped_release release;
      done = client_->PushAsync(job, b);
    }
    return PendingPush(std::move(done), std::move(arrays), absl::StrCat("push ", job));
  }

  PushBatch Batch(const py::dict& dense, const py::dict& sparse, uint64_t step, bool last, float lr_scale) {
    PushBatch b;
    b.step = step;
    b.last = last;
    b.lr_scale = lr_scale;
    for (auto [name, value] : dense) {
      const std::string table = py::str(name);
      size_t n = 0;
      const float* data = ArrayData<float>(value.cast<py::array>(), "dense " + table, false, &n);
      b.dense.push_back({table, data, n});
    }
    for (auto [name, value] : sparse) {
      SparseArrays a = Sparse(name, value, "gradients", false);
      b.sparse.push_back({std::move(a.table), a.keys, a.num_keys, a.rows});
    }
    return b;
  }

  void Pull(const std::string& job, uint64_t step, const py::dict& dense, const py::dict& sparse) {
    PullBatch b;
    b.step = step;
    for (auto [name, value] : dense) {
      const std::string table = py::str(name);
      size_t n = 0;
      float* out = const_cast<float*>(ArrayData<float>(value.cast<py::array>(), "dense " + table, true, &n));
      b.dense.push_back({table, out, n});
    }
    for (auto [name, value] : sparse) {
      SparseArrays a = Sparse(name, value, "out", true);
      b.sparse.push_back({std::move(a.table), a.keys, a.num_keys, const_cast<float*>(a.rows)});
    }
    py::gil_scoped_release release;
    Check(absl::StrCat("pull ", job), client_->Pull(job, b));
  }

  py::dict Stats(const std::string& job, size_t server) {
    absl::StatusOr<v1::GetJobResponse> r;
    {
      py::gil_scoped_release release;
      r = client_->GetJobStats(job, server);
    }
    Check(absl::StrCat("stats ", job), r.status());
    py::dict d;
    d["applied_step"] = r->applied_step();
    d["sparse_rows"] = r->sparse_rows();
    d["bytes_used"] = r->bytes_used();
    d["pushes_applied"] = r->pushes_applied();
    d["sparse_rows_admitted"] = r->sparse_rows_admitted();
    d["sparse_rows_rejected"] = r->sparse_rows_rejected();
    d["sparse_rows_evicted"] = r->sparse_rows_evicted_cap() + r->sparse_rows_evicted_ttl();
    d["sparse_rows_cold"] = r->sparse_rows_cold();
    d["sparse_rows_demoted"] = r->sparse_rows_demoted();
    d["sparse_rows_promoted"] = r->sparse_rows_promoted();
    d["rank_clock"] = std::vector<uint64_t>(r->rank_clock().begin(), r->rank_clock().end());
    return d;
  }

 private:
  std::unique_ptr<GrpcPsClient> client_;
};

// A checkpoint cut as safetensors, from the coordinator's ExportCheckpoint
// stream as it arrives (the serialized ExportCheckpointChunk messages):
// the writer fulcrumctl export uses.
class Export {
 public:
  void AddChunk(const std::string& call, const py::bytes& bytes) {
    v1::ExportCheckpointChunk chunk;
    char* data = nullptr;
    Py_ssize_t size = 0;
    if (PyBytes_AsStringAndSize(bytes.ptr(), &data, &size) != 0) throw py::error_already_set();
    if (!chunk.ParseFromArray(data, static_cast<int>(size))) {
      Check(call, absl::DataLossError("a checkpoint chunk does not parse"));
    }
    py::gil_scoped_release release;
    if (!begun_) {
      info_ = chunk.checkpoint();
      Check(call, out_.Begin(chunk.meta()));
      begun_ = true;
    }
    for (const auto& r : chunk.records()) Check(call, out_.Add(r));
  }
  py::dict Write(const std::string& call, const std::string& job, const std::string& path) {
    if (!begun_) Check(call, absl::NotFoundError("the coordinator sent no checkpoint"));
    {
      py::gil_scoped_release release;
      Check(call, out_.Write(path, {{"format", "pt"},
                                    {"fulcrum_job", job},
                                    {"fulcrum_checkpoint", absl::StrCat(info_.cut_id())},
                                    {"fulcrum_step", absl::StrCat(info_.step())}}));
    }
    py::dict d;
    d["cut_id"] = info_.cut_id();
    d["step"] = info_.step();
    d["tensors"] = out_.tensors();
    d["bytes"] = out_.bytes();
    return d;
  }

 private:
  CutExport out_;
  v1::CheckpointInfo info_;
  bool begun_ = false;
};

}  // namespace
}  // namespace fulcrum

PYBIND11_MODULE(_ps, m) {
  m.doc() = "Parameter-server tables from NumPy: fulcrum's C++ client (see fulcrum.Tables).";
  // Imported when the module loads, so a broken install fails at import.
  py::module_::import("fulcrum.client");
  py::module_::import("grpc");
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const fulcrum::StatusError& e) {
      py::object error = py::module_::import("fulcrum.client").attr("FulcrumError");
      py::object codes = py::module_::import("grpc").attr("StatusCode");
      const std::string code = absl::StatusCodeToString(e.status.code());
      py::object instance = error(e.call, codes.attr(code.c_str()), std::string(e.status.message()));
      PyErr_SetObject(error.ptr(), instance.ptr());
    }
  });
  py::class_<fulcrum::Tables>(m, "Tables")
      .def(py::init<std::vector<std::string>, std::string, uint32_t, const std::string&,
                    std::optional<std::vector<std::string>>, bool, int, double, uint32_t>(),
           py::arg("servers"), py::arg("worker_id"), py::arg("rank") = 0, py::arg("wire_dtype") = "fp32",
           py::arg("tls") = py::none(), py::arg("shared_memory") = true, py::arg("channels_per_server") = 4,
           py::arg("rpc_timeout") = 60.0, py::arg("incarnation") = 0)
      .def("create_job", &fulcrum::Tables::CreateJob, py::arg("spec_text"))
      .def("open_job", &fulcrum::Tables::OpenJob, py::arg("job_id"))
      .def("delete_job", &fulcrum::Tables::DeleteJob, py::arg("job_id"))
      .def("push", &fulcrum::Tables::Push, py::arg("job_id"), py::arg("step"), py::arg("dense") = py::dict(),
           py::arg("sparse") = py::dict(), py::arg("last") = true, py::arg("lr_scale") = 1.0f)
      .def("pull", &fulcrum::Tables::Pull, py::arg("job_id"), py::arg("step"), py::arg("dense") = py::dict(),
           py::arg("sparse") = py::dict())
      .def("stats", &fulcrum::Tables::Stats, py::arg("job_id"), py::arg("server"))
      .def("push_async", &fulcrum::Tables::PushAsync, py::arg("job_id"), py::arg("step"),
           py::arg("dense") = py::dict(), py::arg("sparse") = py::dict(), py::arg("last") = true,
           py::arg("lr_scale") = 1.0f);
  // The client's log lines go to Python's logging (logger "fulcrum"), not
  // to the user's stderr.
  fulcrum::SetLogSink(&fulcrum::HeldLogs::Sink);
  m.def("take_logs", [] { return fulcrum::HeldLogs::Get().Take(); },
        "The C++ client's log lines since the last call: ([(severity, line)], lines dropped).");
  m.def("tune_heap", [] { return fulcrum::TuneHeapForLargeMessages(); },
        "The serving processes' heap settings for megabyte messages (common/process.h); once per process.");
  py::class_<fulcrum::PendingPush>(m, "PendingPush").def("wait", &fulcrum::PendingPush::Wait);
  py::class_<fulcrum::Export>(m, "Export")
      .def(py::init<>())
      .def("add_chunk", &fulcrum::Export::AddChunk, py::arg("call"), py::arg("chunk"))
      .def("write", &fulcrum::Export::Write, py::arg("call"), py::arg("job_id"), py::arg("path"));
}
