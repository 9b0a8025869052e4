// fulcrumctl: the command-line client of the coordinator's job API.
//
//   fulcrumctl [--coordinator=host:port] [--output=text|json] COMMAND ...
//     submit -f SPEC.yaml [--no-wait] [--validate]   submit, then watch to the end
//     list                                           every job, one line each
//     status JOB                                     one job in detail
//     watch JOB                                      live progress until the job ends
//     cancel JOB
//     cluster                                        nodes, devices, shard map, health
//
// Exit codes (for scripts): 0 success (a watched job SUCCEEDED); 1 the job
// FAILED or was CANCELLED; 2 bad usage or an invalid spec; 3 no such job;
// 4 the coordinator is unreachable; 5 the request does not fit the job's
// state (e.g. cancelling a finished job); 6 any other error.
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <iostream>
#include <string>
#include <vector>

#include <google/protobuf/util/json_util.h>
#include <grpcpp/grpcpp.h>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/config/job_spec.h"
#include "common/config/spec_text.h"
#include "common/rpc/grpc_util.h"
#include "fulcrum/v1/cluster.grpc.pb.h"

ABSL_FLAG(std::string, coordinator, "127.0.0.1:7070", "host:port of fulcrum-coordinator (or $FULCRUM_COORDINATOR)");
ABSL_FLAG(std::string, output, "text", "text or json");
ABSL_FLAG(std::string, f, "", "submit: the job spec file (YAML or JSON)");
ABSL_FLAG(bool, no_wait, false, "submit: print the job id and return without watching");
ABSL_FLAG(bool, validate, false, "submit: only validate the spec (locally and on the coordinator)");
ABSL_FLAG(int32_t, timeout_seconds, 10, "deadline of each unary call");

namespace {

using fulcrum::v1::Job;
using fulcrum::v1::JobState;

enum Exit { kOk = 0, kJobFailed = 1, kUsage = 2, kNotFound = 3, kUnavailable = 4, kPrecondition = 5, kOther = 6 };

int ExitFor(const grpc::Status& s) {
  switch (s.error_code()) {
    case grpc::StatusCode::OK: return kOk;
    case grpc::StatusCode::INVALID_ARGUMENT: return kUsage;
    case grpc::StatusCode::NOT_FOUND: return kNotFound;
    case grpc::StatusCode::UNAVAILABLE:
    case grpc::StatusCode::DEADLINE_EXCEEDED: return kUnavailable;
    case grpc::StatusCode::FAILED_PRECONDITION: return kPrecondition;
    default: return kOther;
  }
}

int Fail(const grpc::Status& s, const std::string& what) {
  std::string hint;
  if (s.error_code() == grpc::StatusCode::UNAVAILABLE) {
    hint = absl::StrCat(" (is fulcrum-coordinator running at ", absl::GetFlag(FLAGS_coordinator),
                        "? set --coordinator)");
  }
  std::cerr << "fulcrumctl: " << what << ": " << s.error_message() << hint << "\n";
  return ExitFor(s);
}

bool Json() { return absl::GetFlag(FLAGS_output) == "json"; }

std::string ToJson(const google::protobuf::Message& m) {
  std::string out;
  google::protobuf::util::JsonPrintOptions o;
  o.add_whitespace = false;
  o.preserve_proto_field_names = true;
  (void)google::protobuf::util::MessageToJsonString(m, &out, o);
  return out;
}

std::unique_ptr<grpc::ClientContext> Ctx() {
  auto ctx = std::make_unique<grpc::ClientContext>();
  ctx->set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(absl::GetFlag(FLAGS_timeout_seconds))));
  return ctx;
}

std::string State(JobState s) { return fulcrum::v1::JobState_Name(s); }

std::string Duration(double seconds) {
  if (seconds <= 0) return "-";
  const int64_t s = static_cast<int64_t>(seconds + 0.5);
  if (s < 60) return absl::StrCat(s, "s");
  if (s < 3600) return absl::StrFormat("%dm%02ds", s / 60, s % 60);
  return absl::StrFormat("%dh%02dm", s / 3600, (s / 60) % 60);
}

std::string JobLine(const Job& j) {
  const auto& s = j.status();
  std::string line = absl::StrFormat("%-20s %-9s", j.id(), State(s.state()));
  if (s.state() == fulcrum::v1::RUNNING || fulcrum::config::JobEnded(s.state())) {
    const double pct = s.total_steps() > 0 ? 100.0 * s.step() / s.total_steps() : 0;
    absl::StrAppendFormat(&line, " epoch %u/%u step %llu/%llu (%.0f%%)", std::min(s.epoch() + 1, j.spec().epochs()),
                          j.spec().epochs(), static_cast<unsigned long long>(s.step()),
                          static_cast<unsigned long long>(s.total_steps()), pct);
    if (s.loss() > 0) absl::StrAppendFormat(&line, " loss %.4f acc %.4f", s.loss(), s.train_accuracy());
    if (s.epochs_size() > 0) absl::StrAppendFormat(&line, " test_acc %.4f", s.test_accuracy());
    if (s.samples_per_second() > 0 && s.state() == fulcrum::v1::RUNNING) {
      absl::StrAppendFormat(&line, " %.0f samples/s ETA %s", s.samples_per_second(), Duration(s.eta_seconds()));
    }
  }
  if (!s.message().empty() && s.state() != fulcrum::v1::RUNNING) absl::StrAppend(&line, " - ", s.message());
  return line;
}

std::vector<std::string> WorkerLines(const Job& j) {
  std::vector<std::string> out;
  for (const auto& w : j.status().workers()) {
    out.push_back(absl::StrFormat("  rank %-3u %-10s %-10s epoch %u step %llu loss %.4f acc %.4f %.0f samples/s%s",
                                  w.rank(), w.worker_id().empty() ? "-" : w.worker_id(), w.state(), w.epoch() + 1,
                                  static_cast<unsigned long long>(w.step()), w.loss(), w.train_accuracy(),
                                  w.samples_per_second(),
                                  w.incarnation() > 0 ? absl::StrCat(" (replacement ", w.incarnation(), ")") : ""));
  }
  return out;
}

void PrintStatus(const Job& j) {
  const auto& s = j.status();
  std::cout << "job " << j.id() << "\n"
            << "  state:     " << State(s.state()) << (s.reason().empty() ? "" : " (" + s.reason() + ")") << "\n"
            << "  message:   " << s.message() << "\n"
            << "  model:     " << j.spec().model().type() << ", " << j.spec().num_workers() << " workers, batch "
            << j.spec().batch_size() << ", " << j.spec().epochs() << " epochs, "
            << fulcrum::v1::ConsistencySpec::Model_Name(j.spec().consistency().model()) << "\n"
            << "  progress:  " << JobLine(j) << "\n";
  for (const auto& l : WorkerLines(j)) std::cout << l << "\n";
  for (const auto& e : s.epochs()) {
    std::cout << absl::StrFormat("  epoch %u: train loss %.4f acc %.4f, test loss %.4f acc %.4f, %.1fs\n",
                                 e.epoch() + 1, e.train_loss(), e.train_accuracy(), e.test_loss(),
                                 e.test_accuracy(), e.seconds());
  }
  if (!s.weights_fingerprint().empty()) std::cout << "  weights:   fingerprint " << s.weights_fingerprint() << "\n";
  std::cout << "  restarts:  " << s.restarts() << "\n";
  for (const auto& c : s.conditions()) {
    std::cout << "  " << absl::FormatTime("%H:%M:%S", absl::FromUnixMillis(c.time_unix_ms()), absl::LocalTimeZone())
              << " " << c.type() << " " << c.reason() << ": " << c.message() << "\n";
  }
}

int ExitForJob(const Job& j) {
  return j.status().state() == fulcrum::v1::SUCCEEDED ? kOk : kJobFailed;
}

int Watch(fulcrum::v1::JobService::Stub* stub, const std::string& id) {
  grpc::ClientContext ctx;  // no deadline: runs as long as the job
  fulcrum::v1::JobRef ref;
  ref.set_job_id(id);
  auto reader = stub->WatchJob(&ctx, ref);
  fulcrum::v1::JobEvent e;
  const bool tty = isatty(STDOUT_FILENO) && !Json();
  size_t drawn = 0;
  absl::Time last_plain = absl::InfinitePast();
  Job last;
  bool have = false;
  while (reader->Read(&e)) {
    last = e.job();
    have = true;
    if (Json()) {
      std::cout << ToJson(e) << std::endl;
      continue;
    }
    if (tty) {
      if (drawn > 0) std::cout << "\033[" << drawn << "F\033[J";
      std::vector<std::string> lines = {JobLine(last)};
      for (auto& l : WorkerLines(last)) lines.push_back(std::move(l));
      for (const auto& l : lines) std::cout << l << "\n";
      drawn = lines.size();
      std::cout.flush();
      if (e.kind() == "epoch" || e.kind() == "state") drawn = 0;  // keep milestones on screen
      continue;
    }
    // Plain lines: milestones always, progress at most once a second.
    if (e.kind() == "progress" && absl::Now() - last_plain < absl::Seconds(1)) continue;
    last_plain = absl::Now();
    std::cout << JobLine(last) << std::endl;
  }
  grpc::Status s = reader->Finish();
  if (!s.ok()) return Fail(s, absl::StrCat("watch ", id));
  if (!have) return kOther;
  if (!Json()) {
    std::cout << "job " << id << " " << State(last.status().state());
    if (last.status().state() == fulcrum::v1::SUCCEEDED) {
      std::cout << absl::StrFormat(": test accuracy %.4f", last.status().test_accuracy());
    } else {
      std::cout << ": " << last.status().reason() << ": " << last.status().message();
    }
    std::cout << std::endl;
  }
  return ExitForJob(last);
}

int Usage() {
  std::cerr << "usage: fulcrumctl [--coordinator=host:port] [--output=text|json] COMMAND\n"
               "  submit -f SPEC [--no-wait] [--validate]\n"
               "  list | status JOB | watch JOB | cancel JOB | cluster\n";
  return kUsage;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage("fulcrumctl: submit, watch and manage Fulcrum jobs");
  // Accept --no-wait as well as --no_wait (flags are spelled with '_').
  std::vector<std::string> storage(argv, argv + argc);
  std::vector<char*> argv2;
  for (std::string& a : storage) {
    if (a.rfind("--", 0) == 0) {
      for (size_t i = 2; i < a.size() && a[i] != '='; ++i) a[i] = a[i] == '-' ? '_' : a[i];
    }
    argv2.push_back(a.data());
  }
  std::vector<char*> args = absl::ParseCommandLine(argc, argv2.data());
  if (const char* env = std::getenv("FULCRUM_COORDINATOR"); env != nullptr && *env != 0) {
    // The flag wins when given explicitly.
    bool explicit_flag = false;
    for (int i = 1; i < argc; ++i) explicit_flag |= std::string(argv[i]).rfind("--coordinator", 0) == 0;
    if (!explicit_flag) absl::SetFlag(&FLAGS_coordinator, env);
  }
  if (absl::GetFlag(FLAGS_output) != "text" && absl::GetFlag(FLAGS_output) != "json") {
    std::cerr << "fulcrumctl: --output must be text or json\n";
    return kUsage;
  }
  if (args.size() < 2) return Usage();
  const std::string cmd = args[1];
  auto channel = fulcrum::CreateFulcrumChannel(absl::GetFlag(FLAGS_coordinator), 0);
  auto jobs = fulcrum::v1::JobService::NewStub(channel);
  auto cluster = fulcrum::v1::ClusterService::NewStub(channel);
  auto job_arg = [&]() -> std::string { return args.size() >= 3 ? args[2] : ""; };

  if (cmd == "submit") {
    const std::string file = absl::GetFlag(FLAGS_f);
    if (file.empty()) {
      std::cerr << "fulcrumctl submit: give the spec file with -f SPEC.yaml\n";
      return kUsage;
    }
    fulcrum::v1::SubmitJobRequest req;
    absl::Status parsed = fulcrum::config::ParseSpecFile(file, req.mutable_spec());
    if (parsed.ok()) parsed = fulcrum::config::ValidateJobSpec(req.spec());
    if (!parsed.ok()) {
      std::cerr << "fulcrumctl: " << parsed.message() << "\n";
      return kUsage;
    }
    req.set_validate_only(absl::GetFlag(FLAGS_validate));
    fulcrum::v1::SubmitJobResponse resp;
    grpc::Status s = jobs->SubmitJob(Ctx().get(), req, &resp);
    if (!s.ok()) return Fail(s, "submit");
    if (req.validate_only()) {
      std::cout << (Json() ? "{\"valid\":true}" : absl::StrCat(file, ": valid")) << std::endl;
      return kOk;
    }
    if (Json()) {
      if (absl::GetFlag(FLAGS_no_wait)) std::cout << ToJson(resp) << std::endl;
    } else {
      std::cout << "submitted job " << resp.job_id() << std::endl;
    }
    if (absl::GetFlag(FLAGS_no_wait)) return kOk;
    return Watch(jobs.get(), resp.job_id());
  }
  if (cmd == "list") {
    fulcrum::v1::ListJobsResponse resp;
    grpc::Status s = jobs->ListJobs(Ctx().get(), fulcrum::v1::ListJobsRequest(), &resp);
    if (!s.ok()) return Fail(s, "list");
    if (Json()) {
      std::cout << ToJson(resp) << std::endl;
    } else {
      for (const Job& j : resp.jobs()) std::cout << JobLine(j) << "\n";
      if (resp.jobs_size() == 0) std::cout << "no jobs\n";
    }
    return kOk;
  }
  if (cmd == "status" || cmd == "cancel" || cmd == "watch") {
    if (job_arg().empty()) {
      std::cerr << "fulcrumctl " << cmd << ": name the job (fulcrumctl list shows them)\n";
      return kUsage;
    }
    fulcrum::v1::JobRef ref;
    ref.set_job_id(job_arg());
    if (cmd == "watch") return Watch(jobs.get(), job_arg());
    Job j;
    grpc::Status s = cmd == "status" ? jobs->GetJob(Ctx().get(), ref, &j) : jobs->CancelJob(Ctx().get(), ref, &j);
    if (!s.ok()) return Fail(s, absl::StrCat(cmd, " ", job_arg()));
    if (Json()) {
      std::cout << ToJson(j) << std::endl;
    } else if (cmd == "status") {
      PrintStatus(j);
    } else {
      std::cout << "job " << j.id() << " " << State(j.status().state()) << std::endl;
    }
    return kOk;
  }
  if (cmd == "cluster") {
    fulcrum::v1::ClusterState c;
    grpc::Status s = cluster->GetCluster(Ctx().get(), fulcrum::v1::GetClusterRequest(), &c);
    if (!s.ok()) return Fail(s, "cluster");
    if (Json()) {
      std::cout << ToJson(c) << std::endl;
      return kOk;
    }
    const int64_t now = absl::ToUnixMillis(absl::Now());
    std::cout << absl::StrFormat("%-10s %-7s %-6s %-22s %-14s %s\n", "NODE", "ROLE", "HEALTH", "ADDRESS/HOST",
                                 "LAST BEAT", "DEVICES / ASSIGNMENTS");
    for (const auto& n : c.nodes()) {
      std::vector<std::string> devices;
      for (const auto& d : n.info().devices()) devices.push_back(d.name());
      std::string what = n.info().role() == fulcrum::v1::SERVER
                             ? ""
                             : absl::StrCat(absl::StrJoin(devices, "; "), " [", n.info().slots(), " slot(s)]");
      if (n.assignments_size() > 0) absl::StrAppend(&what, " running ", absl::StrJoin(n.assignments(), ", "));
      std::cout << absl::StrFormat("%-10s %-7s %-6s %-22s %-14s %s\n", n.info().node_id(),
                                   n.info().role() == fulcrum::v1::SERVER ? "server" : "worker",
                                   n.alive() ? "alive" : "dead",
                                   n.info().role() == fulcrum::v1::SERVER ? n.info().address() : n.info().hostname(),
                                   absl::StrCat(absl::StrFormat("%.1f", (now - n.last_heartbeat_unix_ms()) / 1000.0), "s ago"),
                                   what);
    }
    if (c.has_shard_map() && c.shard_map().servers_size() > 0) {
      std::cout << "shard map version " << c.shard_map().version() << ": " << c.shard_map().num_virtual_shards()
                << " virtual shards over " << absl::StrJoin(c.shard_map().servers(), ", ") << "\n";
    } else {
      std::cout << "shard map: none yet (no parameter server registered)\n";
    }
    return kOk;
  }
  std::cerr << "fulcrumctl: unknown command '" << cmd << "'\n";
  return Usage();
}
