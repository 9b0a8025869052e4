// fulcrumctl: the command-line client of the coordinator's job API.
//
//   fulcrumctl [--coordinator=host:port] [--output=text|json] COMMAND ...
//
// Credentials: TLS to the coordinator, verified against --tls_ca_file
// ($FULCRUM_TLS_CA_FILE; the system's roots when neither is set), or
// plaintext with --insecure ($FULCRUM_INSECURE=1). The bearer token comes
// from --token_file, else $FULCRUM_TOKEN, else the file $FULCRUM_TOKEN_FILE.
// deploy/local/cluster.sh writes all of these to RUN_DIR/env.
//     submit -f SPEC.yaml [--no-wait] [--validate]   submit, then watch to the end
//     list                                           every job, one line each
//     status JOB                                     one job in detail
//     watch JOB                                      live progress until the job ends (reconnects
//                                                    to a restarted coordinator)
//     cancel JOB
//     cluster                                        nodes, devices, shard map, health
//     checkpoint JOB                                 take a checkpoint now; wait for its commit
//     restore JOB [--cut=N]                          roll the job back to a checkpoint (default: the latest)
//     export JOB [--cut=N] -o FILE.safetensors       a checkpoint's parameters as safetensors
//
// Exit codes (for scripts): 0 success (a watched job SUCCEEDED); 1 the job
// FAILED or was CANCELLED; 2 bad usage or an invalid spec; 3 no such job;
// 4 the coordinator is unreachable; 5 the request does not fit the job's
// state (e.g. cancelling a finished job); 6 any other error; 7 missing or
// wrong credentials, or another user's job.
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <future>
#include <map>
#include <optional>
#include <variant>
#include <iostream>
#include <string>
#include <vector>

#include <google/protobuf/util/json_util.h>
#include <grpcpp/grpcpp.h>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/backoff.h"
#include "common/checkpoint_export.h"
#include "common/safetensors.h"
#include "server/ctl/status_text.h"
#include "common/config/job_spec.h"
#include "common/config/model_graph.h"
#include "common/config/spec_text.h"
#include "common/flags_usage.h"
#include "common/logging.h"
#include "common/rpc/grpc_util.h"
#include "common/rpc/security.h"
#include "fulcrum/v1/cluster.grpc.pb.h"

ABSL_FLAG(std::string, coordinator, "127.0.0.1:7070", "host:port of fulcrum-coordinator (or $FULCRUM_COORDINATOR)");
ABSL_FLAG(std::string, output, "text", "text or json");
ABSL_FLAG(std::string, tls_ca_file, "", "CA that the coordinator's certificate must chain to (or $FULCRUM_TLS_CA_FILE)");
ABSL_FLAG(bool, insecure, false, "talk plaintext to a coordinator started with --insecure (or $FULCRUM_INSECURE=1)");
ABSL_FLAG(std::string, token_file, "", "file holding the bearer token (or $FULCRUM_TOKEN, $FULCRUM_TOKEN_FILE)");
ABSL_FLAG(std::string, f, "", "submit: the job spec file (YAML or JSON)");
ABSL_FLAG(bool, no_wait, false, "submit: print the job id and return without watching");
ABSL_FLAG(bool, validate, false, "submit: only validate the spec (locally and on the coordinator)");
ABSL_FLAG(int32_t, timeout_seconds, 10, "deadline of each unary call");
ABSL_FLAG(int32_t, reconnect_seconds, 300,
          "submit, watch: how long to keep reconnecting to a coordinator that went away mid-watch "
          "(0: give up at once)");
ABSL_FLAG(uint64_t, cut, 0, "restore, export: the checkpoint id (0: the latest)");
ABSL_FLAG(std::string, o, "", "export: the output file (safetensors)");

namespace {

using fulcrum::v1::Job;
using fulcrum::v1::JobState;
using fulcrum::safetensors::JsonQuoted;
using fulcrum::ctl::CheckpointLine;
using fulcrum::ctl::Duration;
using fulcrum::ctl::FinalFigures;
using fulcrum::ctl::JobLine;
using fulcrum::ctl::PrintStatus;
using fulcrum::ctl::State;
using fulcrum::ctl::WorkerLines;

enum Exit {
  kOk = 0, kJobFailed = 1, kUsage = 2, kNotFound = 3, kUnavailable = 4, kPrecondition = 5, kOther = 6, kAuth = 7
};

int ExitFor(const grpc::Status& s) {
  switch (s.error_code()) {
    case grpc::StatusCode::OK: return kOk;
    case grpc::StatusCode::INVALID_ARGUMENT: return kUsage;
    case grpc::StatusCode::NOT_FOUND: return kNotFound;
    case grpc::StatusCode::UNAVAILABLE:
    case grpc::StatusCode::DEADLINE_EXCEEDED: return kUnavailable;
    case grpc::StatusCode::FAILED_PRECONDITION: return kPrecondition;
    case grpc::StatusCode::UNAUTHENTICATED:
    case grpc::StatusCode::PERMISSION_DENIED: return kAuth;
    default: return kOther;
  }
}

std::string Env(const char* name) {
  const char* v = std::getenv(name);
  return v == nullptr ? "" : v;
}

// The CA the coordinator's certificate is checked against ("": the
// system's roots).
std::string CaFile() {
  const std::string flag = absl::GetFlag(FLAGS_tls_ca_file);
  return flag.empty() ? Env("FULCRUM_TLS_CA_FILE") : flag;
}

bool Insecure() { return absl::GetFlag(FLAGS_insecure) || Env("FULCRUM_INSECURE") == "1"; }

// What this client expects the coordinator to serve, for the hint of an
// unreachable coordinator.
std::string ExpectedTransport() {
  if (Insecure()) return "plaintext (--insecure)";
  const std::string ca = CaFile();
  if (ca.empty()) {
    return "TLS signed by a CA of this system's trust store (no --tls_ca_file or $FULCRUM_TLS_CA_FILE given; a "
           "local cluster's CA is RUN_DIR/tls/ca.crt)";
  }
  return absl::StrCat("TLS signed by the CA in ", ca);
}

int Fail(const grpc::Status& s, const std::string& what) {
  std::string hint;
  // A coordinator that answered UNAVAILABLE itself (it cannot save its
  // state) was reached: the hint is for one that could not be.
  if (s.error_code() == grpc::StatusCode::UNAVAILABLE && !absl::StartsWith(s.error_message(), "the coordinator ")) {
    hint = absl::StrCat(" (is fulcrum-coordinator running at ", absl::GetFlag(FLAGS_coordinator),
                        "? set --coordinator; does it serve ", ExpectedTransport(), " as this client expects?)");
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

// What every call carries, set up once from the flags and environment.
struct Session {
  std::string token;  // bearer token; empty: none
  // Plaintext (--insecure) or TLS that checks the coordinator's certificate.
  std::shared_ptr<const fulcrum::security::Transport> transport;
};

// Every call carries the bearer token.
void Authorize(const Session& session, grpc::ClientContext* ctx) {
  if (!session.token.empty()) ctx->AddMetadata("authorization", "Bearer " + session.token);
}

// A bearer token as read from `source`, trimmed of surrounding whitespace
// (a file's or a variable's trailing newline); an error naming the source
// and the position of a character an HTTP header cannot carry (gRPC would
// abort on it). The token itself is never printed.
std::string CleanToken(std::string* token, const std::string& source) {
  *token = std::string(absl::StripAsciiWhitespace(*token));
  if (token->empty()) return absl::StrCat("the bearer token from ", source, " is empty");
  for (size_t i = 0; i < token->size(); ++i) {
    const unsigned char c = static_cast<unsigned char>((*token)[i]);
    if (c <= ' ' || c > '~') {
      return absl::StrCat("the bearer token from ", source, " has a character not allowed in a token at position ",
                          i + 1, " of ", token->size(), " (", c < 0x80 ? "a space or control character" : "a non-ASCII byte",
                          "); tokens are printable ASCII (openssl rand -hex 32 makes one)");
    }
  }
  return "";
}

// Reads the credentials the header comment describes. Empty on success, else
// what is wrong.
std::string SetUpCredentials(Session* session) {
  std::string token_file = absl::GetFlag(FLAGS_token_file);
  if (token_file.empty() && !Env("FULCRUM_TOKEN").empty()) {
    session->token = Env("FULCRUM_TOKEN");
    if (std::string bad = CleanToken(&session->token, "$FULCRUM_TOKEN"); !bad.empty()) return bad;
  } else {
    if (token_file.empty()) token_file = Env("FULCRUM_TOKEN_FILE");
    if (!token_file.empty()) {
      std::ifstream in(token_file);
      if (!in) return absl::StrCat("cannot read the token file ", token_file);
      std::getline(in, session->token);
      if (std::string bad = CleanToken(&session->token, absl::StrCat("the token file ", token_file)); !bad.empty()) {
        return bad;
      }
    }
  }
  if (Insecure()) {
    session->transport = fulcrum::security::Transport::Plaintext();
    return "";
  }
  auto transport = fulcrum::security::Transport::Client(CaFile());
  if (!transport.ok()) return std::string(transport.status().message());
  session->transport = *std::move(transport);
  return "";
}

std::unique_ptr<grpc::ClientContext> Ctx(const Session& session) {
  auto ctx = std::make_unique<grpc::ClientContext>();
  Authorize(session, ctx.get());
  ctx->set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(absl::GetFlag(FLAGS_timeout_seconds))));
  return ctx;
}

int ExitForJob(const Job& j) {
  return j.status().state() == fulcrum::v1::SUCCEEDED ? kOk : kJobFailed;
}

// How `watch` shows a job's events: JSON lines; on a terminal, the job's
// and its workers' lines redrawn in place (milestones stay on screen);
// otherwise one line per milestone and per second of progress.
class WatchView {
 public:
  void Show(const fulcrum::v1::JobEvent& e) {
    const Job& job = e.job();
    if (Json()) {
      std::cout << ToJson(e) << std::endl;
      return;
    }
    if (tty_) {
      if (drawn_ > 0) std::cout << "\033[" << drawn_ << "F\033[J";
      std::vector<std::string> lines = {JobLine(job)};
      for (auto& l : WorkerLines(job)) lines.push_back(std::move(l));
      for (const auto& l : lines) std::cout << l << "\n";
      drawn_ = lines.size();
      std::cout.flush();
      if (e.kind() == "epoch" || e.kind() == "state") drawn_ = 0;  // keep milestones on screen
      return;
    }
    // Plain lines: milestones always, progress at most once a second.
    if (e.kind() == "progress" && absl::Now() - last_plain_ < absl::Seconds(1)) return;
    last_plain_ = absl::Now();
    std::cout << JobLine(job) << std::endl;
  }
  // What is on screen stays: the next lines go below it.
  void KeepDrawn() { drawn_ = 0; }

 private:
  const bool tty_ = isatty(STDOUT_FILENO) && !Json();
  size_t drawn_ = 0;
  absl::Time last_plain_ = absl::InfinitePast();
};

// Streams the job's events until it ends. A coordinator that goes away
// mid-watch (restarted, rescheduled) loses nothing, so the watch reconnects
// for up to --reconnect_seconds and goes on from the job's state then.
int Watch(const Session& session, fulcrum::v1::JobService::Stub* first_stub, const std::string& id) {
  fulcrum::v1::JobRef ref;
  ref.set_job_id(id);
  WatchView view;
  Job last;
  bool have = false;
  std::unique_ptr<fulcrum::v1::JobService::Stub> own_stub;
  fulcrum::v1::JobService::Stub* stub = first_stub;
  const absl::Duration reconnect = absl::Seconds(absl::GetFlag(FLAGS_reconnect_seconds));
  absl::Time give_up = absl::InfiniteFuture();
  bool reconnecting = false;
  int channels = 1000;  // distinct from the first channel's index (0)
  fulcrum::Backoff backoff({.initial = absl::Milliseconds(250), .max = absl::Seconds(2)});
  for (;;) {
    grpc::ClientContext ctx;  // no deadline: runs as long as the job
    Authorize(session, &ctx);
    auto reader = stub->WatchJob(&ctx, ref);
    fulcrum::v1::JobEvent e;
    bool got = false;
    while (reader->Read(&e)) {
      if (reconnecting) {
        std::cerr << "fulcrumctl: watch " << id << ": reconnected to the coordinator" << std::endl;
        reconnecting = false;
      }
      got = true;
      last = e.job();
      have = true;
      view.Show(e);
    }
    grpc::Status s = reader->Finish();
    if (s.ok()) break;
    // Only a watch that was under way reconnects: a coordinator that is not
    // there at all, or an error of the request, fails at once.
    if (s.error_code() != grpc::StatusCode::UNAVAILABLE || !have || reconnect <= absl::ZeroDuration()) {
      return Fail(s, absl::StrCat("watch ", id));
    }
    if (got || !reconnecting) {
      std::cerr << "fulcrumctl: watch " << id << ": lost the coordinator (" << s.error_message()
                << "); reconnecting for up to " << absl::FormatDuration(reconnect) << std::endl;
      view.KeepDrawn();  // the live lines above the notice stay as they are
      reconnecting = true;
      give_up = absl::Now() + reconnect;
      backoff.Reset();
    }
    if (absl::Now() >= give_up) {
      return Fail(s, absl::StrCat("watch ", id, " (no coordinator for ", absl::FormatDuration(reconnect), ")"));
    }
    absl::SleepFor(backoff.Next());
    // A fresh channel each time: gRPC's own reconnect backoff grows to two
    // minutes, and a restarted coordinator should be found within seconds.
    own_stub = fulcrum::v1::JobService::NewStub(
        fulcrum::CreateFulcrumChannel(absl::GetFlag(FLAGS_coordinator), ++channels, *session.transport));
    stub = own_stub.get();
  }
  if (!have) return kOther;
  if (!Json()) {
    std::cout << "job " << id << " " << State(last.status().state());
    if (last.status().state() == fulcrum::v1::SUCCEEDED) {
      std::cout << ": " << FinalFigures(last);
    } else {
      std::cout << ": " << last.status().reason() << ": " << last.status().message();
    }
    std::cout << std::endl;
  }
  return ExitForJob(last);
}

// ---- checkpoints

// A progress line on stderr: redrawn in place on a terminal, one line each
// into a log.
class ProgressLine {
 public:
  ProgressLine() : tty_(isatty(STDERR_FILENO) != 0) {}
  bool tty() const { return tty_; }
  // `keep`: the line stays on a terminal too, and the next goes below it.
  void Show(const std::string& line, bool keep = false) const {
    std::cerr << (tty_ ? "\r\033[K" : "") << line << (tty_ && !keep ? "" : "\n") << std::flush;
  }
  // Clears a live line.
  void Clear() const {
    if (tty_) std::cerr << "\r\033[K" << std::flush;
  }

 private:
  const bool tty_;
};

// Takes a cut of a running job now and waits for its commit (up to 5
// minutes: a BSP cut waits for its step boundary), showing meanwhile how
// long it has waited and where the job is, so a stalled job shows as one.
int Checkpoint(const Session& session, fulcrum::v1::JobService::Stub* jobs, const std::string& job) {
  fulcrum::v1::JobRef ref;
  ref.set_job_id(job);
  fulcrum::v1::CheckpointInfo info;
  grpc::ClientContext ctx;
  Authorize(session, &ctx);
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Minutes(5)));
  const absl::Time t0 = absl::Now();
  std::cerr << "checkpoint of job " << job << ": asked; every server writes its part, then the coordinator commits it"
            << std::endl;
  std::future<grpc::Status> call =
      std::async(std::launch::async, [&] { return jobs->CheckpointJob(&ctx, ref, &info); });
  const ProgressLine progress;
  absl::Time printed = t0;
  std::optional<std::string> last_error;  // the first one seen is an old failure, not this cut's
  while (call.wait_for(std::chrono::seconds(1)) != std::future_status::ready) {
    Job j;
    if (!jobs->GetJob(Ctx(session).get(), ref, &j).ok()) continue;
    const std::string& error = j.status().last_checkpoint_error();
    if (!last_error) last_error = error;
    const absl::Time now = absl::Now();
    const bool new_error = !error.empty() && error != *last_error;
    if (!progress.tty() && !new_error && now - printed < absl::Seconds(10)) continue;
    printed = now;
    last_error = error;
    progress.Show(absl::StrFormat("  waiting %ds: job %s, step %d of %d, epoch %d%s",
                                  static_cast<int>(absl::ToInt64Seconds(now - t0)), State(j.status().state()),
                                  j.status().step(), j.status().total_steps(), j.status().epoch(),
                                  new_error ? absl::StrCat("; a cut failed: ", error) : std::string()),
                  /*keep=*/new_error);
  }
  progress.Clear();
  const grpc::Status s = call.get();
  if (!s.ok()) return Fail(s, absl::StrCat("checkpoint ", job));
  std::cout << (Json() ? ToJson(info) : absl::StrCat("job ", job, CheckpointLine(info).substr(1))) << std::endl;
  return kOk;
}

// An export's progress on stderr: a live line on a terminal; otherwise a
// line each time another tenth has come (at most one a second), so that a
// long export into a log is not silent either.
class ExportProgress {
 public:
  ExportProgress(const std::string& job, const fulcrum::v1::CheckpointInfo& info, const std::string& path)
      : total_(info.bytes()) {
    std::cerr << "exporting checkpoint " << info.cut_id() << " of job " << job << " (step " << info.step() << ", "
              << fulcrum::HumanBytes(total_) << " on " << info.servers_size() << " server(s)) to " << path
              << std::endl;
  }
  void Add(uint64_t bytes) {
    got_ += bytes;
    const absl::Time now = absl::Now();
    const int tenth = total_ == 0 ? 10 : static_cast<int>(std::min<uint64_t>(10, got_ * 10 / total_));
    if (line_.tty() ? now - last_ < absl::Milliseconds(250) : (tenth <= tenth_ || now - last_ < absl::Seconds(1))) {
      return;
    }
    last_ = now;
    tenth_ = tenth;
    Print();
  }
  // Clears a live line, or ends the plain lines with the last figure.
  void Done() {
    if (line_.tty()) {
      line_.Clear();
    } else if (printed_ != got_) {
      Print();
    }
  }

 private:
  void Print() {
    line_.Show(absl::StrFormat(
        "  received %s of %s (%.0f%%)", fulcrum::HumanBytes(got_), fulcrum::HumanBytes(total_),
        total_ == 0 ? 100.0 : std::min(100.0, 100.0 * static_cast<double>(got_) / static_cast<double>(total_))));
    printed_ = got_;
  }

  const ProgressLine line_;
  const uint64_t total_;
  uint64_t got_ = 0, printed_ = 0;
  int tenth_ = 0;
  absl::Time last_ = absl::InfinitePast();
};

int Export(const Session& session, const std::string& coordinator, const std::string& job, uint64_t cut,
           const std::string& path) {
  // Records can outgrow the job API's message limit: a channel of its own.
  auto stub = fulcrum::v1::JobService::NewStub(fulcrum::CreateCheckpointChannel(coordinator, *session.transport));
  grpc::ClientContext ctx;
  Authorize(session, &ctx);
  fulcrum::v1::ExportCheckpointRequest req;
  req.set_job_id(job);
  req.set_cut_id(cut);
  auto reader = stub->ExportCheckpoint(&ctx, req);
  fulcrum::v1::ExportCheckpointChunk chunk;
  fulcrum::CutExport out;
  fulcrum::v1::CheckpointInfo info;
  bool begun = false;
  size_t records = 0;
  std::optional<ExportProgress> progress;
  while (reader->Read(&chunk)) {
    if (!begun) {
      info = chunk.checkpoint();
      if (absl::Status s = out.Begin(chunk.meta()); !s.ok()) {
        ctx.TryCancel();
        std::cerr << "fulcrumctl: export " << job << ": " << s.message() << "\n";
        return kOther;
      }
      begun = true;
      progress.emplace(job, info, path);
    }
    uint64_t bytes = 0;
    for (const auto& r : chunk.records()) {
      if (absl::Status s = out.Add(r); !s.ok()) {
        if (progress) progress->Done();
        ctx.TryCancel();
        std::cerr << "fulcrumctl: export " << job << ": " << s.message() << "\n";
        return kOther;
      }
      ++records;
      bytes += r.value().size();
    }
    if (progress) progress->Add(bytes);
  }
  if (progress) progress->Done();
  grpc::Status s = reader->Finish();
  if (!s.ok()) return Fail(s, absl::StrCat("export ", job));
  if (!begun) {
    std::cerr << "fulcrumctl: export " << job << ": the coordinator sent no checkpoint\n";
    return kOther;
  }
  absl::Status w = out.Write(path, {{"format", "pt"},
                                    {"fulcrum_job", job},
                                    {"fulcrum_checkpoint", absl::StrCat(info.cut_id())},
                                    {"fulcrum_step", absl::StrCat(info.step())}});
  if (!w.ok()) {
    std::cerr << "fulcrumctl: export " << job << ": " << w.message() << "\n";
    return kOther;
  }
  if (Json()) {
    std::cout << "{\"path\":" << JsonQuoted(path) << ",\"checkpoint\":" << ToJson(info) << ",\"tensors\":" << out.tensors()
              << ",\"bytes\":" << out.bytes() << "}" << std::endl;
  } else {
    std::cout << "exported checkpoint " << info.cut_id() << " of job " << job << " (step " << info.step() << ", "
              << records << " records) to " << path << ": " << out.tensors() << " tensors, " << out.bytes()
              << " bytes" << std::endl;
  }
  return kOk;
}

constexpr char kUsageText[] =
    "submit, watch and manage Fulcrum jobs\n"
    "usage: fulcrumctl [--coordinator=host:port] [--output=text|json] COMMAND\n"
    "  submit -f SPEC [--no-wait] [--validate]\n"
    "  list | status JOB | watch JOB | cancel JOB | cluster\n"
    "  checkpoint JOB | restore JOB [--cut=N] | export JOB [--cut=N] -o FILE.safetensors\n"
    "credentials: --tls_ca_file (or $FULCRUM_TLS_CA_FILE) or --insecure ($FULCRUM_INSECURE=1);\n"
    "  a bearer token from --token_file, $FULCRUM_TOKEN or $FULCRUM_TOKEN_FILE\n"
    "  (deploy/local/cluster.sh writes them all to RUN_DIR/env)\n";

int Usage() {
  std::cerr << kUsageText;
  return kUsage;
}

// ---- commands: each returns the process's exit code.

int Submit(const Session& session, fulcrum::v1::JobService::Stub* jobs) {
  const std::string file = absl::GetFlag(FLAGS_f);
  if (file.empty()) {
    std::cerr << "fulcrumctl submit: give the spec file with -f SPEC.yaml\n";
    return kUsage;
  }
  fulcrum::v1::SubmitJobRequest req;
  absl::Status parsed = fulcrum::config::ParseSpecFile(file, req.mutable_spec());
  fulcrum::config::NormalizeJobSpec(req.mutable_spec());
  if (parsed.ok()) parsed = fulcrum::config::ValidateJobSpec(req.spec());
  if (!parsed.ok()) {
    std::cerr << "fulcrumctl: " << parsed.message() << "\n";
    return kUsage;
  }
  req.set_validate_only(absl::GetFlag(FLAGS_validate));
  if (req.spec().model().type() == "graph" && !Json()) {
    // The graph as the workers will compute it, before anything is sent.
    auto graph = fulcrum::config::BuildModelGraph(req.spec().model());
    if (graph.ok()) std::cout << fulcrum::config::ModelGraphText(*graph) << std::flush;
  }
  fulcrum::v1::SubmitJobResponse resp;
  grpc::Status s = jobs->SubmitJob(Ctx(session).get(), req, &resp);
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
  return Watch(session, jobs, resp.job_id());
}

int List(const Session& session, fulcrum::v1::JobService::Stub* jobs) {
  // Every page, into one list.
  fulcrum::v1::ListJobsResponse resp;
  fulcrum::v1::ListJobsRequest req;
  req.set_page_size(500);
  do {
    fulcrum::v1::ListJobsResponse page;
    grpc::Status s = jobs->ListJobs(Ctx(session).get(), req, &page);
    if (!s.ok()) return Fail(s, "list");
    for (Job& j : *page.mutable_jobs()) *resp.add_jobs() = std::move(j);
    req.set_page_token(page.next_page_token());
  } while (!req.page_token().empty());
  if (Json()) {
    std::cout << ToJson(resp) << std::endl;
  } else {
    for (const Job& j : resp.jobs()) std::cout << JobLine(j) << "\n";
    if (resp.jobs_size() == 0) std::cout << "no jobs\n";
  }
  return kOk;
}

// status, cancel and watch JOB.
int JobCommand(const Session& session, fulcrum::v1::JobService::Stub* jobs, const std::string& cmd, const std::string& job) {
  if (job.empty()) {
    std::cerr << "fulcrumctl " << cmd << ": name the job (fulcrumctl list shows them)\n";
    return kUsage;
  }
  fulcrum::v1::JobRef ref;
  ref.set_job_id(job);
  if (cmd == "watch") return Watch(session, jobs, job);
  Job j;
  grpc::Status s = cmd == "status" ? jobs->GetJob(Ctx(session).get(), ref, &j) : jobs->CancelJob(Ctx(session).get(), ref, &j);
  if (!s.ok()) return Fail(s, absl::StrCat(cmd, " ", job));
  if (Json()) {
    std::cout << ToJson(j) << std::endl;
  } else if (cmd == "status") {
    PrintStatus(j);
  } else {
    std::cout << "job " << j.id() << " " << State(j.status().state()) << std::endl;
  }
  return kOk;
}

// checkpoint, restore and export JOB.
int CutCommand(const Session& session, fulcrum::v1::JobService::Stub* jobs, const std::string& cmd, const std::string& job) {
  if (job.empty()) {
    std::cerr << "fulcrumctl " << cmd << ": name the job (fulcrumctl list shows them)\n";
    return kUsage;
  }
  if (cmd == "export") {
    if (absl::GetFlag(FLAGS_o).empty()) {
      std::cerr << "fulcrumctl export: give the output file with -o FILE.safetensors\n";
      return kUsage;
    }
    return Export(session, absl::GetFlag(FLAGS_coordinator), job, absl::GetFlag(FLAGS_cut), absl::GetFlag(FLAGS_o));
  }
  if (cmd == "checkpoint") return Checkpoint(session, jobs, job);
  fulcrum::v1::RestoreJobRequest req;
  req.set_job_id(job);
  req.set_cut_id(absl::GetFlag(FLAGS_cut));
  Job j;
  grpc::Status s = jobs->RestoreJob(Ctx(session).get(), req, &j);
  if (!s.ok()) return Fail(s, absl::StrCat("restore ", job));
  std::cout << (Json() ? ToJson(j) : absl::StrCat("job ", j.id(), " ", State(j.status().state()), ": ", j.status().message()))
            << std::endl;
  return kOk;
}

int Cluster(const Session& session, fulcrum::v1::ClusterService::Stub* cluster) {
  fulcrum::v1::ClusterState c;
  grpc::Status s = cluster->GetCluster(Ctx(session).get(), fulcrum::v1::GetClusterRequest(), &c);
  if (!s.ok()) return Fail(s, "cluster");
  if (Json()) {
    std::cout << ToJson(c) << std::endl;
    return kOk;
  }
  const int64_t now = absl::ToUnixMillis(absl::Now());
  // PID tells apart the processes of one host (several workers, or a
  // node id that does not match the name of its log file).
  std::cout << absl::StrFormat("%-10s %-7s %-6s %-22s %-8s %-14s %s\n", "NODE", "ROLE", "HEALTH", "ADDRESS/HOST",
                               "PID", "LAST BEAT", "DEVICES / ASSIGNMENTS");
  for (const auto& n : c.nodes()) {
    std::vector<std::string> devices;
    for (const auto& d : n.info().devices()) devices.push_back(d.name());
    std::string what = n.info().role() == fulcrum::v1::SERVER
                           ? ""
                           : absl::StrCat(absl::StrJoin(devices, "; "), " [", n.info().slots(), " slot(s)",
                                          n.info().job_id().empty() ? "" : ", user process of " + n.info().job_id(),
                                          "]");
    if (n.assignments_size() > 0) absl::StrAppend(&what, " running ", absl::StrJoin(n.assignments(), ", "));
    std::cout << absl::StrFormat("%-10s %-7s %-6s %-22s %-8d %-14s %s\n", n.info().node_id(),
                                 n.info().role() == fulcrum::v1::SERVER ? "server" : "worker",
                                 n.alive() ? "alive" : "dead",
                                 n.info().role() == fulcrum::v1::SERVER ? n.info().address() : n.info().hostname(),
                                 n.info().pid(), absl::StrCat(absl::StrFormat("%.1f", (now - n.last_heartbeat_unix_ms()) / 1000.0), "s ago"),
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

// Parses the command line: --no-wait is accepted as --no_wait (flags are
// spelled with '_'), and $FULCRUM_COORDINATOR stands in for a
// --coordinator not given. Returns the positional arguments, or an exit
// code when the global flags are unusable.
std::variant<std::vector<std::string>, int> ParseArgs(int argc, char** argv) {
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
  if (absl::GetFlag(FLAGS_coordinator).empty()) {
    std::cerr << "fulcrumctl: --coordinator is empty; give the coordinator's host:port (or set $FULCRUM_COORDINATOR)\n";
    return kUsage;
  }
  if (absl::GetFlag(FLAGS_output) != "text" && absl::GetFlag(FLAGS_output) != "json") {
    std::cerr << "fulcrumctl: --output must be text or json\n";
    return kUsage;
  }
  return std::vector<std::string>(args.begin(), args.end());
}

}  // namespace

int main(int argc, char** argv) {
  fulcrum::SetUsage(kUsageText);
  // Every failed call is reported once, as a line naming the command and a
  // hint; gRPC's own log lines (a TLS handshake failure) would repeat it in
  // its internal terms. GRPC_VERBOSITY=ERROR in the environment brings them back.
  setenv("GRPC_VERBOSITY", "NONE", /*overwrite=*/0);
  auto parsed = ParseArgs(argc, argv);
  if (const int* code = std::get_if<int>(&parsed)) return *code;
  const auto& args = std::get<std::vector<std::string>>(parsed);
  if (args.size() < 2) return Usage();
  Session session;
  if (std::string err = SetUpCredentials(&session); !err.empty()) {
    std::cerr << "fulcrumctl: " << err << "\n";
    return kUsage;
  }
  const std::string& cmd = args[1];
  const std::string job = args.size() >= 3 ? args[2] : "";
  auto channel = fulcrum::CreateFulcrumChannel(absl::GetFlag(FLAGS_coordinator), 0, *session.transport);
  auto jobs = fulcrum::v1::JobService::NewStub(channel);
  if (cmd == "submit") return Submit(session, jobs.get());
  if (cmd == "list") return List(session, jobs.get());
  if (cmd == "status" || cmd == "cancel" || cmd == "watch") return JobCommand(session, jobs.get(), cmd, job);
  if (cmd == "checkpoint" || cmd == "restore" || cmd == "export") return CutCommand(session, jobs.get(), cmd, job);
  if (cmd == "cluster") return Cluster(session, fulcrum::v1::ClusterService::NewStub(channel).get());
  std::cerr << "fulcrumctl: unknown command '" << cmd << "'\n";
  return Usage();
}
