// Membership on its own: ids, re-registration, hearing from nodes, and the
// liveness pass (silence, leaving, a stalled scheduler, retention), with
// times given by the test.
#include "server/coordinator/membership.h"

#include <string>

#include <catch2/catch.hpp>

namespace fulcrum {
namespace {

const absl::Time kStart = absl::FromUnixSeconds(1800000000);

Membership::Options Opts(absl::Duration timeout = absl::Seconds(5), absl::Duration retention = absl::Minutes(10)) {
  return {.node_timeout = timeout, .dead_node_retention = retention, .tick = absl::Milliseconds(100)};
}

v1::NodeInfo Server(const std::string& address) {
  v1::NodeInfo n;
  n.set_role(v1::SERVER);
  n.set_address(address);
  return n;
}

v1::NodeInfo Worker(uint32_t slots = 0, const std::string& job = "") {
  v1::NodeInfo n;
  n.set_role(v1::WORKER);
  n.set_slots(slots);
  n.set_job_id(job);
  return n;
}

// Registers `info`, which must succeed.
Membership::Registered Reg(Membership& m, v1::NodeInfo info, absl::Time now) {
  auto r = m.Register(std::move(info), now);
  REQUIRE(r.ok());
  return *std::move(r);
}

// Liveness passes every 100 ms from `*t` for `d`, as the scheduler runs them;
// the nodes declared dead meanwhile.
std::vector<std::string> Pass(Membership& m, absl::Time* t, absl::Duration d) {
  std::vector<std::string> died;
  for (absl::Duration done; done < d; done += absl::Milliseconds(100)) {
    *t += absl::Milliseconds(100);
    for (const auto& [id, n] : m.CheckLiveness(*t).died) died.push_back(id);
  }
  return died;
}

TEST_CASE("membership gives each new node an id of its role never given twice", "[membership]") {
  Membership m(Opts(), kStart);
  const auto s = Reg(m, Server("h:1"), kStart);
  const auto w = Reg(m, Worker(), kStart);
  CHECK(s.node_id == "server-0");
  CHECK(w.node_id == "worker-1");
  CHECK((s.fresh && w.fresh));
  CHECK(m.Get(w.node_id)->info.slots() == 1);  // 0 means one slot
  // A node re-registering under its id (after a coordinator restart) keeps it.
  v1::NodeInfo again = Worker(4);
  again.set_node_id(w.node_id);
  const auto re = Reg(m, again, kStart);
  CHECK(re.node_id == w.node_id);
  CHECK_FALSE(re.fresh);
  CHECK(m.Get(w.node_id)->info.slots() == 4);
  // An id of the other role is not taken over.
  v1::NodeInfo other = Server("h:2");
  other.set_node_id(w.node_id);
  CHECK(Reg(m, other, kStart).node_id == "server-2");
  // An unsaved registration is undone; its id is not given again.
  const auto undone = Reg(m, Worker(), kStart);
  m.Unregister(undone.node_id);
  CHECK_FALSE(m.Get(undone.node_id).has_value());
  CHECK(Reg(m, Worker(), kStart).node_id == "worker-4");
  CHECK(m.next_serial() == 5);
  m.set_next_serial(3);  // never goes back
  CHECK(m.next_serial() == 5);
}

TEST_CASE("a server registering at a known address displaces the old process at the next pass", "[membership]") {
  Membership m(Opts(), kStart);
  const std::string old_id = Reg(m, Server("h:1"), kStart).node_id;
  absl::Time t = kStart + absl::Seconds(1);
  const auto fresh = Reg(m, Server("h:1"), t);
  CHECK(fresh.displaced == std::vector<std::string>{old_id});
  const auto pass = m.CheckLiveness(t + absl::Milliseconds(100));
  REQUIRE(pass.died.size() == 1);
  CHECK(pass.died[0].first == old_id);
  CHECK(m.LiveServerAddresses() == std::vector<std::string>{"h:1"});
  CHECK(m.Get(fresh.node_id)->alive);
}

v1::NodeInfo WithCertificate(v1::NodeInfo n, const std::string& certificate, const std::string& node_id = "") {
  n.set_certificate(certificate);
  n.set_node_id(node_id);
  return n;
}

TEST_CASE("a node is bound to the certificate it registered with: no other takes its id, address or calls",
          "[membership][security]") {
  Membership m(Opts(), kStart);
  const std::string s0_cert = "spiffe://fulcrum/server/server-0", s1_cert = "spiffe://fulcrum/server/server-1";
  const std::string w0_cert = "spiffe://fulcrum/worker/worker-0", w1_cert = "spiffe://fulcrum/worker/worker-1";
  const std::string s0 = Reg(m, WithCertificate(Server("h:1"), s0_cert), kStart).node_id;
  const std::string w0 = Reg(m, WithCertificate(Worker(), w0_cert), kStart).node_id;
  CHECK(m.Get(s0)->info.certificate() == s0_cert);

  // Calls as a node: only with its certificate.
  CHECK(m.CheckCaller(s0, s0_cert, "heartbeat").ok());
  CHECK(m.CheckCaller(w0, w0_cert, "progress report").ok());
  absl::Status s = m.CheckCaller(s0, w1_cert, "heartbeat");
  CHECK(s.code() == absl::StatusCode::kPermissionDenied);
  CHECK(s.message() ==
        "heartbeat as node 'server-0', which registered with certificate spiffe://fulcrum/server/server-0; the "
        "caller's is spiffe://fulcrum/worker/worker-1: a member acts only as the node it registered");
  CHECK(m.CheckCaller(w0, w1_cert, "progress report").code() == absl::StatusCode::kPermissionDenied);
  CHECK(m.CheckCaller(w0, s1_cert, "heartbeat").code() == absl::StatusCode::kPermissionDenied);  // another role
  CHECK(m.CheckCaller(w0, "", "heartbeat").code() == absl::StatusCode::kPermissionDenied);  // no certificate
  CHECK(m.CheckCaller("worker-99", w1_cert, "heartbeat").ok());  // unknown: the caller's own answer says so

  // Registering again under another node's id with another certificate
  // makes a new node; the old one keeps its binding.
  const auto taken = Reg(m, WithCertificate(Worker(), w1_cert, w0), kStart);
  CHECK(taken.fresh);
  CHECK(taken.node_id != w0);
  CHECK(m.Get(w0)->info.certificate() == w0_cert);
  // With its own certificate a node keeps its id.
  const auto again = Reg(m, WithCertificate(Worker(2), w0_cert, w0), kStart);
  CHECK_FALSE(again.fresh);
  CHECK(again.node_id == w0);

  // A live server's address cannot be taken over by another certificate
  // (that would declare it dead); with its own, a restarted server can.
  auto refused = m.Register(WithCertificate(Server("h:1"), s1_cert), kStart + absl::Seconds(1));
  REQUIRE(refused.status().code() == absl::StatusCode::kPermissionDenied);
  CHECK(refused.status().message().find("address h:1 belongs to live server server-0 (certificate "
                                        "spiffe://fulcrum/server/server-0); the caller's certificate is "
                                        "spiffe://fulcrum/server/server-1") != std::string::npos);
  CHECK(m.Get(s0)->alive);
  CHECK(m.CheckLiveness(kStart + absl::Seconds(1)).died.empty());
  const auto restarted = Reg(m, WithCertificate(Server("h:1"), s0_cert), kStart + absl::Seconds(2));
  CHECK(restarted.displaced == std::vector<std::string>{s0});

  // A node from state saved before bindings has none: it must register
  // again, and its own server may take over its address.
  v1::NodeInfo legacy = Server("h:2");
  legacy.set_node_id("server-50");
  m.Restore(legacy, kStart);
  CHECK(m.CheckCaller("server-50", s1_cert, "heartbeat").code() == absl::StatusCode::kNotFound);
  CHECK(Reg(m, WithCertificate(Server("h:2"), s1_cert), kStart).displaced == std::vector<std::string>{"server-50"});
}

TEST_CASE("a node silent for node_timeout is declared dead and must register again", "[membership]") {
  Membership m(Opts(absl::Seconds(1)), kStart);
  const std::string quiet = Reg(m, Worker(), kStart).node_id;
  const std::string talking = Reg(m, Worker(), kStart).node_id;
  absl::Time t = kStart;
  std::vector<std::string> died;
  for (int i = 0; i < 9; ++i) {
    CHECK(m.Hear(talking, t) == Membership::Heard::kOk);
    const auto d = Pass(m, &t, absl::Milliseconds(100));
    died.insert(died.end(), d.begin(), d.end());
  }
  CHECK(died.empty());  // 0.9 s of silence
  CHECK(m.Hear(talking, t) == Membership::Heard::kOk);
  CHECK(Pass(m, &t, absl::Milliseconds(100)) == std::vector<std::string>{quiet});
  CHECK_FALSE(m.Get(quiet)->alive);
  CHECK(m.Get(quiet)->dead_since == t);
  CHECK(m.Hear(quiet, t) == Membership::Heard::kDead);  // not revived by a late heartbeat
  CHECK(m.Hear("worker-99", t) == Membership::Heard::kUnknown);
  CHECK(m.Get(talking)->alive);
}

TEST_CASE("a leaving node goes at the next pass and is not listed as dead", "[membership]") {
  Membership m(Opts(), kStart);
  const std::string w = Reg(m, Worker(), kStart).node_id;
  m.MarkLeaving(w);
  absl::Time t = kStart;
  CHECK(Pass(m, &t, absl::Milliseconds(100)) == std::vector<std::string>{w});
  Pass(m, &t, absl::Milliseconds(100));
  CHECK_FALSE(m.Get(w).has_value());
  CHECK(m.size() == 0);
}

TEST_CASE("after a stall of the passes every node gets a fresh node_timeout", "[membership]") {
  Membership m(Opts(absl::Seconds(2)), kStart);
  const std::string w = Reg(m, Worker(), kStart).node_id;
  absl::Time t = kStart + absl::Milliseconds(1500);  // one gap: past node_timeout / 2
  Membership::Pass pass = m.CheckLiveness(t);
  CHECK(pass.stall == absl::Milliseconds(1500));
  CHECK(pass.spared == 1);
  CHECK(pass.died.empty());
  // The grace is one node_timeout from the end of the stall, no more.
  CHECK(Pass(m, &t, absl::Milliseconds(1900)).empty());
  CHECK(Pass(m, &t, absl::Milliseconds(100)) == std::vector<std::string>{w});
  // Regular passes are no stall.
  CHECK(m.CheckLiveness(t + absl::Milliseconds(100)).stall == absl::ZeroDuration());
}

TEST_CASE("a dead node is listed for dead_node_retention then forgotten", "[membership]") {
  Membership m(Opts(absl::Milliseconds(300), absl::Seconds(1)), kStart);
  const std::string w = Reg(m, Worker(), kStart).node_id;
  absl::Time t = kStart;
  REQUIRE(Pass(m, &t, absl::Milliseconds(300)) == std::vector<std::string>{w});
  Pass(m, &t, absl::Milliseconds(1000));
  CHECK(m.Get(w).has_value());
  t += absl::Milliseconds(100);
  CHECK(m.CheckLiveness(t).forgotten == 1);
  CHECK_FALSE(m.Get(w).has_value());
}

TEST_CASE("nodes restored after a restart get no slots until heard from", "[membership]") {
  Membership m(Opts(), kStart);
  v1::NodeInfo known = Worker(2);
  known.set_node_id("worker-7");
  m.Restore(known, kStart);
  CHECK(m.next_serial() == 8);
  CHECK(m.WorkerSlots("").empty());
  CHECK(m.LiveWorkers().unheard == 1);
  CHECK(m.LiveWorkers().heard == 0);
  REQUIRE(m.Hear("worker-7", kStart + absl::Seconds(1)) == Membership::Heard::kOk);
  CHECK(m.WorkerSlots("") == std::map<std::string, int>{{"worker-7", 2}});
  CHECK(m.LiveWorkers().heard == 1);
}

TEST_CASE("live servers come oldest first and workers are pooled by job", "[membership]") {
  Membership m(Opts(), kStart);
  m.set_next_serial(9);
  Reg(m, Server("b:1"), kStart);  // server-9
  Reg(m, Worker(3), kStart);      // worker-10
  Reg(m, Server("a:1"), kStart);  // server-11: after server-9, though "server-11" < "server-9"
  Reg(m, Worker(1, "job-1"), kStart);
  CHECK(m.LiveServerAddresses() == std::vector<std::string>{"b:1", "a:1"});
  CHECK(m.WorkerSlots("") == std::map<std::string, int>{{"worker-10", 3}});
  CHECK(m.WorkerSlots("job-1") == std::map<std::string, int>{{"worker-12", 1}});
  CHECK(m.WorkerSlots("job-2").empty());
  CHECK(m.All().size() == 4);
}

}  // namespace
}  // namespace fulcrum
