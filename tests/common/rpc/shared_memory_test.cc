// Shared memory between a worker and the servers on its host
// (common/rpc/shared_memory.h, worker/rpc/shm_conn.h): the same results as
// over gRPC, the fallback to gRPC, and a server that stays up whatever a
// worker writes into the memory file.
#include <arpa/inet.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <netinet/in.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/rpc/grpc_util.h"
#include "common/rpc/shared_memory.h"
#include "common/rpc/wire_codec.h"
#include "common/spare_core.h"
#include "common/shard_map.h"
#include "fulcrum/v1/ps.grpc.pb.h"
#include "tests/testing/test_util.h"

namespace fulcrum {
namespace {

using testing::DenseTableSpec;
using testing::JobSpec;
using testing::SparseTableSpec;
using testing::TestCluster;

// Waits up to 10 s for server `g` to have `n` sessions open; returns how many it has.
size_t WaitForSessions(PsGrpcServer* g, size_t n) {
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (g->shared_memory_sessions() != n && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(5));
  return g->shared_memory_sessions();
}

GrpcPsClientOptions ShmOptions(bool on) {
  GrpcPsClientOptions o;
  o.transport = GrpcPsClientOptions::Transport::kStream;
  o.shared_memory = on;
  return o;
}

// Runs 20 steps of SGD (lr 0.5; Adam for the dense table under ASP and SSP)
// on a dense and a sparse table with gradients that depend on the step, and
// returns the final weights and rows.
std::vector<float> Train(TestCluster& cluster, const std::string& job, GrpcPsClientOptions o, uint64_t* shm_requests,
                         v1::ConsistencySpec::Model model = v1::ConsistencySpec::BSP, uint64_t* shm_polled = nullptr) {
  auto c = cluster.Client(0, o);
  constexpr size_t n = 70000;  // several chunks of 16384 on each server
  const auto dense_kind = model == v1::ConsistencySpec::BSP ? v1::OptimizerSpec::SGD : v1::OptimizerSpec::ADAM;
  REQUIRE_OK(c->CreateJob(JobSpec(job, {DenseTableSpec("w", n, 0.5f, dense_kind, 16384),
                                        SparseTableSpec("emb", 8, 0.5f)},
                                  1, model, model == v1::ConsistencySpec::SSP ? 2 : 0)));
  std::vector<float> w(n), g(n);
  std::vector<uint64_t> keys = {3, 17, 99, 1000003, 42, 7};
  std::vector<float> rows(keys.size() * 8), sg(keys.size() * 8);
  for (uint64_t step = 0; step < 20; ++step) {
    REQUIRE_OK(c->Pull(job, {step, {{"w", w.data(), n}}, {{"emb", keys.data(), keys.size(), rows.data()}}}));
    for (size_t i = 0; i < n; ++i) g[i] = std::sin(static_cast<float>(i + step)) + 0.01f * w[i];
    for (size_t i = 0; i < sg.size(); ++i) sg[i] = 0.1f * static_cast<float>(i % 7) - rows[i];
    REQUIRE_OK(c->Push(job, {step, {{"w", g.data(), n}}, {{"emb", keys.data(), keys.size(), sg.data()}}}));
  }
  REQUIRE_OK(c->Pull(job, {20, {{"w", w.data(), n}}, {{"emb", keys.data(), keys.size(), rows.data()}}}));
  *shm_requests = c->shared_memory_requests();
  if (shm_polled != nullptr) *shm_polled = c->shared_memory_polled();
  w.insert(w.end(), rows.begin(), rows.end());
  return w;
}

TEST_CASE("pushes and pulls through shared memory give the weights gRPC gives, bit for bit", "[shm]") {
  auto cluster = TestCluster::Start();
  uint64_t over_shm = 0, over_grpc = 0;
  const std::vector<float> a = Train(*cluster, "via-shm", ShmOptions(true), &over_shm);
  const std::vector<float> b = Train(*cluster, "via-grpc", ShmOptions(false), &over_grpc);
  // 20 pushes, each a message to each of the 2 servers, and 21 pulls, each
  // a message to one or both: all through shared memory; none without it.
  CHECK(over_shm >= 2 * 20 + 21);
  CHECK(over_shm <= 2 * 41);
  CHECK(over_grpc == 0);
  REQUIRE(a.size() == b.size());
  REQUIRE(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
  REQUIRE(WaitForSessions(cluster->grpc(0), 0) == 0);  // each client closed its session on the way out
}

TEST_CASE("under ASP and SSP too, pushes decoded in place in shared memory give gRPC's weights", "[shm]") {
  // The server reads pushes where they lie in the slot, copying each
  // gradient out before its NaN check; under ASP and SSP it otherwise
  // applies gradients straight from the request (PushMessage::volatile_payload).
  auto cluster = TestCluster::Start();
  for (auto model : {v1::ConsistencySpec::ASP, v1::ConsistencySpec::SSP}) {
    const std::string name = v1::ConsistencySpec::Model_Name(model);
    INFO(name);
    uint64_t over_shm = 0, over_grpc = 0;
    const std::vector<float> a = Train(*cluster, "shm-" + name, ShmOptions(true), &over_shm, model);
    const std::vector<float> b = Train(*cluster, "grpc-" + name, ShmOptions(false), &over_grpc, model);
    CHECK(over_shm >= 2 * 20 + 21);
    CHECK(over_grpc == 0);
    REQUIRE(a.size() == b.size());
    REQUIRE(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
  }
}

// Polling happens only while the host has a core to spare; these tests of
// what polling does give probes that say it has, or has not
// (tests/common/future_test.cc checks SpareCore itself).
bool Spare() { return true; }
bool NoneSpare() { return false; }

TEST_CASE("a thread waiting for an answer reads it out of shared memory itself, unless told not to poll", "[shm]") {
  TestCluster::Options co;
  co.spare_core = &Spare;
  auto cluster = TestCluster::Start(co);
  uint64_t requests = 0, polled = 0;
  GrpcPsClientOptions o = ShmOptions(true);
  o.shared_memory_poll = absl::Seconds(1);
  o.spare_core = &Spare;
  // Every Push and Pull here is synchronous: its thread waits, polling, so
  // nearly every response is read by it. The session's dispatcher, woken by
  // the server, may win the race for some; on a machine crowded by other
  // tests' threads it can win every race of a run (the scheduler favours a
  // thread that slept over one that spins). So runs go on, for up to 10 s,
  // until one has a response read by its waiting thread.
  std::vector<float> a;
  int runs = 0;
  for (const absl::Time end = absl::Now() + absl::Seconds(10); polled == 0 && absl::Now() < end;) {
    a = Train(*cluster, absl::StrCat("poll-", runs++), o, &requests, v1::ConsistencySpec::BSP, &polled);
  }
  INFO(runs << " runs of " << requests << " requests through shared memory each");
  CHECK(requests >= 2 * 20 + 21);
  CHECK(polled > 0);
  CHECK(polled <= requests);
  if (runs > 1) WARN("the waiting thread read a response itself only in run " << runs);
  o.shared_memory_poll = absl::ZeroDuration();
  uint64_t requests_off = 0, polled_off = 0;
  const std::vector<float> b = Train(*cluster, "no-poll", o, &requests_off, v1::ConsistencySpec::BSP, &polled_off);
  CHECK(requests_off == requests);
  CHECK(polled_off == 0);
  REQUIRE(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}

// Announces a push, gives the session threads time to wake, pushes, and
// returns how many pushes server 0 found polling.
uint64_t AnnouncedPush(absl::Duration server_poll, SpareCoreProbe spare = &Spare) {
  TestCluster::Options co;
  co.shared_memory_poll = server_poll;
  co.spare_core = spare;
  auto cluster = TestCluster::Start(co);
  auto c = cluster->Client(0, ShmOptions(true));
  constexpr size_t n = 1000;
  REQUIRE_OK(c->CreateJob(JobSpec("announce", {DenseTableSpec("w", n, 1.0f)}, 1, v1::ConsistencySpec::ASP)));
  std::vector<float> w(n), g(n, 0.25f);
  REQUIRE_OK(c->Pull("announce", {0, {{"w", w.data(), n}}, {}}));  // opens the sessions
  REQUIRE(WaitForSessions(cluster->grpc(0), 1) == 1);
  const uint64_t before = cluster->grpc(0)->shared_memory_polled();
  absl::SleepFor(absl::Milliseconds(100));  // the session threads sleep again
  c->ExpectPush();
  absl::SleepFor(absl::Milliseconds(100));  // and wake to poll
  REQUIRE_OK(c->Push("announce", {0, {{"w", g.data(), n}}, {}}));
  REQUIRE_OK(c->Pull("announce", {1, {{"w", w.data(), n}}, {}}));
  CHECK(w[0] == -0.25f);
  return cluster->grpc(0)->shared_memory_polled() - before;
}

TEST_CASE("a server polls for a push its worker announced, and only when told to", "[shm]") {
  // The session thread polls for up to a second after the announcement, so
  // the push 100 ms later finds it polling, not asleep.
  CHECK(AnnouncedPush(absl::Seconds(1)) == 1);
  CHECK(AnnouncedPush(absl::ZeroDuration()) == 0);
  // Nor on a host without a core to spare.
  CHECK(AnnouncedPush(absl::Seconds(1), &NoneSpare) == 0);
}

// This host's non-loopback IPv4 addresses.
std::vector<std::string> HostAddresses() {
  std::vector<std::string> out;
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) return out;
  for (const ifaddrs* a = list; a != nullptr; a = a->ifa_next) {
    if (a->ifa_addr == nullptr || a->ifa_addr->sa_family != AF_INET) continue;
    char buf[INET_ADDRSTRLEN];
    inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(a->ifa_addr)->sin_addr, buf, sizeof(buf));
    if (std::string(buf).rfind("127.", 0) != 0) out.push_back(buf);
  }
  freeifaddrs(list);
  return out;
}

TEST_CASE("shared memory is offered to peers on this host only", "[shm]") {
  CHECK(shm::PeerOnThisHost("ipv4:127.0.0.1:5000"));
  CHECK(shm::PeerOnThisHost("ipv4:127.8.9.10:1"));
  CHECK(shm::PeerOnThisHost("ipv6:[::1]:5000"));
  CHECK(shm::PeerOnThisHost("ipv6:%5B::1%5D:5000"));
  CHECK(shm::PeerOnThisHost("ipv6:%5B%3A%3A1%5D:5000"));
  CHECK(shm::PeerOnThisHost("ipv6:[::ffff:127.0.0.1]:5000"));
  CHECK(shm::PeerOnThisHost("unix:/run/fulcrum.sock"));
  // An address from TEST-NET-3 (RFC 5737) that none of this host's interfaces has.
  const std::vector<std::string> mine = HostAddresses();
  std::string other = "203.0.113.7";
  while (std::find(mine.begin(), mine.end(), other) != mine.end()) other += "7";  // .77, .777 (invalid: still not)
  CHECK_FALSE(shm::PeerOnThisHost("ipv4:" + other + ":5000"));
  CHECK_FALSE(shm::PeerOnThisHost("ipv6:[2001:db8::1]:5000"));  // the documentation prefix
  CHECK_FALSE(shm::PeerOnThisHost("ipv4:not-an-address:1"));
  CHECK_FALSE(shm::PeerOnThisHost("ipv6:[::1"));
  CHECK_FALSE(shm::PeerOnThisHost("ipv6:::1"));
  CHECK_FALSE(shm::PeerOnThisHost(""));
  for (const std::string& a : mine) CHECK(shm::PeerOnThisHost("ipv4:" + a + ":7000"));
}

TEST_CASE("a worker reaching a server on its host by the host's address gets shared memory", "[shm]") {
  const std::vector<std::string> addresses = HostAddresses();
  if (addresses.empty()) {
    WARN("SKIPPED: this host has no non-loopback IPv4 address; only loopback peers were tested");
    return;
  }
  ParameterServerOptions po;
  auto ps = ParameterServer::Create(po);
  REQUIRE_OK(ps.status());
  auto grpc = PsGrpcServer::Start(ps->get(), "0.0.0.0:0");
  REQUIRE_OK(grpc.status());
  const std::string address = addresses[0] + ":" + std::to_string((*grpc)->port());
  auto map = ShardMap::RoundRobin(1, 16, {address});
  REQUIRE_OK(map.status());
  REQUIRE_OK((*ps)->SetShardMap(map->ToProto()));
  GrpcPsClientOptions o = ShmOptions(true);
  o.shard_map = map->ToProto();
  o.worker_id = "by-host-address";
  auto c = GrpcPsClient::Create(o);
  REQUIRE_OK(c.status());
  REQUIRE_OK((*c)->CreateJob(JobSpec("far", {DenseTableSpec("w", 100)}, 1, v1::ConsistencySpec::ASP)));
  std::vector<float> g(100, 0.5f), w(100);
  REQUIRE_OK((*c)->Push("far", {0, {{"w", g.data(), 100}}, {}}));
  REQUIRE_OK((*c)->Pull("far", {1, {{"w", w.data(), 100}}, {}}));
  for (float x : w) REQUIRE(x == -0.5f);
  INFO("server at " << address);
  REQUIRE((*c)->shared_memory_requests() == 2);
  c->reset();
  (*grpc)->Shutdown();
}

TEST_CASE("errors through shared memory keep their codes and messages", "[shm]") {
  auto cluster = TestCluster::Start();
  auto c = cluster->Client(0, ShmOptions(true));
  REQUIRE_OK(c->CreateJob(JobSpec("errs", {DenseTableSpec("w", 512, 1.0f, v1::OptimizerSpec::SGD, 32)}, 1,
                                  v1::ConsistencySpec::ASP)));
  std::vector<float> g(512, 1.0f), w(512);
  g[3] = std::nanf("");
  REQUIRE_STATUS(c->Push("errs", {0, {{"w", g.data(), 512}}, {}}), absl::StatusCode::kInvalidArgument,
                 "contains NaN or Inf");
  // A shard-map change is still seen and retried: every virtual shard moves.
  v1::ShardMap v2 = cluster->shard_map();
  v2.set_version(2);
  for (int v = 0; v < v2.owner_size(); ++v) v2.set_owner(v, 1 - v2.owner(v));
  cluster->SetShardMap(v2);
  g[3] = 1.0f;
  REQUIRE_OK(c->Push("errs", {1, {{"w", g.data(), 512}}, {}}));
  REQUIRE(c->shard_map_version() == 2);
  REQUIRE_OK(c->Pull("errs", {2, {{"w", w.data(), 512}}, {}}));
  for (float x : w) REQUIRE(x == -1.0f);
  REQUIRE(c->shared_memory_requests() > 0);
}

TEST_CASE("with every slot held by a waiting pull a push goes over gRPC instead of waiting for a slot", "[shm]") {
  TestCluster::Options co;
  co.num_servers = 1;
  auto cluster = TestCluster::Start(co);
  GrpcPsClientOptions o = ShmOptions(true);
  o.shared_memory_slots = 1;
  auto c = cluster->Client(0, o);
  REQUIRE_OK(c->CreateJob(JobSpec("held", {DenseTableSpec("w", 64)}, 1, v1::ConsistencySpec::BSP)));
  std::vector<float> g(64, 2.0f), w1(64), w2(64), w3(64);
  // Step 1's pulls wait for step 0: the first holds the only slot, the
  // others and then the push that releases them all take gRPC.
  auto p1 = c->PullAsync("held", {1, {{"w", w1.data(), 64}}, {}});
  auto p2 = c->PullAsync("held", {1, {{"w", w2.data(), 64}}, {}});
  auto p3 = c->PullAsync("held", {1, {{"w", w3.data(), 64}}, {}});
  REQUIRE_OK(c->Push("held", {0, {{"w", g.data(), 64}}, {}}));
  REQUIRE_OK(p1.Wait());
  REQUIRE_OK(p2.Wait());
  REQUIRE_OK(p3.Wait());
  for (size_t i = 0; i < 64; ++i) {
    REQUIRE(w1[i] == -2.0f);
    REQUIRE(w2[i] == -2.0f);
    REQUIRE(w3[i] == -2.0f);
  }
  REQUIRE(c->shared_memory_requests() == 1);
}

TEST_CASE("with more than one slot, pulls parked beyond their share wait for a slot and the push takes the reserved one",
          "[shm]") {
  TestCluster::Options co;
  co.num_servers = 1;
  auto cluster = TestCluster::Start(co);
  GrpcPsClientOptions o = ShmOptions(true);
  o.shared_memory_slots = 4;  // one of them kept for pushes
  auto c = cluster->Client(0, o);
  REQUIRE_OK(c->CreateJob(JobSpec("queued", {DenseTableSpec("w", 64)}, 1, v1::ConsistencySpec::BSP)));
  std::vector<float> g(64, 2.0f);
  std::vector<std::vector<float>> w(8, std::vector<float>(64));
  // Eight pulls of step 1 wait for step 0: three hold slots, five wait for
  // one; the push goes through the fourth and releases them all.
  std::vector<Future<absl::Status>> pulls;
  for (auto& x : w) pulls.push_back(c->PullAsync("queued", {1, {{"w", x.data(), 64}}, {}}));
  absl::SleepFor(absl::Milliseconds(50));
  REQUIRE_OK(c->Push("queued", {0, {{"w", g.data(), 64}}, {}}));
  for (auto& p : pulls) REQUIRE_OK(p.Wait());
  for (const auto& x : w) {
    for (float v : x) REQUIRE(v == -2.0f);
  }
  // Every request went through shared memory, none over gRPC.
  REQUIRE(c->shared_memory_requests() == 9);
  REQUIRE(c->shared_memory_waited() >= 5);
}

TEST_CASE("a server with shared memory off, or one asked for too much, leaves the worker on gRPC", "[shm]") {
  TestCluster::Options co;
  co.shared_memory = false;
  auto cluster = TestCluster::Start(co);
  auto c = cluster->Client(0, ShmOptions(true));
  REQUIRE_OK(c->CreateJob(JobSpec("off", {DenseTableSpec("w", 1000)}, 1, v1::ConsistencySpec::ASP)));
  std::vector<float> g(1000, 1.0f), w(1000);
  REQUIRE_OK(c->Push("off", {0, {{"w", g.data(), 1000}}, {}}));
  REQUIRE_OK(c->Pull("off", {1, {{"w", w.data(), 1000}}, {}}));
  for (float x : w) REQUIRE(x == -1.0f);
  REQUIRE(c->shared_memory_requests() == 0);

  auto stub = v1::ParameterService::NewStub(CreateFulcrumChannel(cluster->address(0), 7, *security::Transport::Plaintext()));
  grpc::ClientContext ctx;
  auto reader = stub->OpenSharedMemory(&ctx, v1::OpenSharedMemoryRequest());
  v1::SharedMemoryEvent ev;
  REQUIRE_FALSE(reader->Read(&ev));
  const absl::Status s = FromGrpcStatus(reader->Finish());
  REQUIRE_STATUS(s, absl::StatusCode::kFailedPrecondition, "--shared_memory=false");
}

// A raw session: what a worker that writes anything into the file can do.
struct RawSession {
  grpc::ClientContext ctx;
  std::unique_ptr<grpc::ClientReader<v1::SharedMemoryEvent>> reader;
  std::shared_ptr<shm::Segment> seg;

  RawSession(const std::string& address, uint32_t slots, uint64_t slot_bytes) {
    stub = v1::ParameterService::NewStub(CreateFulcrumChannel(address, 8, *security::Transport::Plaintext()));
    v1::OpenSharedMemoryRequest req;
    req.set_slots(slots);
    req.set_slot_bytes(slot_bytes);
    reader = stub->OpenSharedMemory(&ctx, req);
    v1::SharedMemoryEvent ev;
    REQUIRE(reader->Read(&ev));
    auto s = shm::Segment::Attach(ev.pid(), ev.fd(), ev.nonce(), ev.slots(), ev.slot_bytes(), ev.file_bytes());
    REQUIRE_OK(s.status());
    seg = *s;
  }
  ~RawSession() {
    ctx.TryCancel();
    v1::SharedMemoryEvent ev;
    while (reader->Read(&ev)) {
    }
    (void)reader->Finish();
  }

  // Posts `bytes` (claiming `claimed` bytes) in slot `i` and waits for the
  // server's response; returns it decoded.
  wire::StreamResponseView Roundtrip(uint32_t i, const std::string& bytes, uint32_t claimed) {
    std::memcpy(seg->request(i), bytes.data(), std::min<size_t>(bytes.size(), seg->slot_bytes()));
    seg->slot(i).request_bytes.store(claimed);
    seg->slot(i).state.store(shm::kRequest);
    shm::Ring(seg->server_bell());
    const absl::Time deadline = absl::Now() + absl::Seconds(10);
    while (seg->slot(i).state.load() != shm::kResponse && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(1));
    REQUIRE(seg->slot(i).state.load() == shm::kResponse);
    const uint32_t n = seg->slot(i).response_bytes.load();
    REQUIRE(n <= seg->slot_bytes());
    held.emplace_back(reinterpret_cast<const char*>(seg->response(i)), n);
    wire::StreamResponseView r;
    REQUIRE_OK(wire::DecodeStreamResponse(Payload(held.back().data(), n), &r));
    seg->slot(i).state.store(shm::kFree);
    return r;
  }

  std::unique_ptr<v1::ParameterService::Stub> stub;
  std::vector<std::string> held;
};

TEST_CASE("a server survives whatever a worker writes into the shared memory and names what was wrong", "[shm]") {
  TestCluster::Options co;
  co.num_servers = 1;
  auto cluster = TestCluster::Start(co);
  auto good = cluster->Client(0, ShmOptions(true));
  REQUIRE_OK(good->CreateJob(JobSpec("victim", {DenseTableSpec("w", 256)}, 1, v1::ConsistencySpec::ASP)));
  {
    RawSession raw(cluster->address(0), 4, 64 << 10);
    REQUIRE(raw.seg->slot_bytes() == 64 << 10);
    // The file is sealed: the worker cannot shrink it under the server.
    REQUIRE(ftruncate(raw.seg->fd(), 4096) != 0);

    SECTION("random bytes") {
      std::mt19937 rng(7);
      for (int round = 0; round < 200; ++round) {
        std::string junk(rng() % 3000, '\0');
        for (char& ch : junk) ch = static_cast<char>(rng());
        const wire::StreamResponseView r = raw.Roundtrip(round % 4, junk, static_cast<uint32_t>(junk.size()));
        // Junk either fails to decode or names no body or job; it is never applied.
        REQUIRE(r.code != 0);
      }
    }
    SECTION("a length past the slot") {
      const wire::StreamResponseView r = raw.Roundtrip(1, "", 0xFFFFFFFFu);
      REQUIRE(r.code == static_cast<int>(absl::StatusCode::kInvalidArgument));
      REQUIRE(r.message.find("in a slot of 65536") != std::string::npos);
    }
    SECTION("a well-formed push for an unknown job") {
      PushMessage m;
      m.job_id = "nope";
      m.worker_id = "raw";
      m.seq = 1;
      m.num_parts = 1;
      grpc::ByteBuffer buf = wire::EncodeStreamRequest(5, true, wire::EncodePush(m)).Finish();
      std::vector<grpc::Slice> slices;
      (void)buf.Dump(&slices);
      std::string bytes;
      for (auto& s : slices) bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
      const wire::StreamResponseView r = raw.Roundtrip(2, bytes, static_cast<uint32_t>(bytes.size()));
      REQUIRE(r.id == 5);
      REQUIRE(r.code == static_cast<int>(absl::StatusCode::kNotFound));
    }
    // Slot states set at random: the server only ever takes kRequest.
    for (uint32_t i = 0; i < 4; ++i) raw.seg->slot(i).state.store(0xdead0000u + i);
    shm::Ring(raw.seg->server_bell());
  }
  // The server still serves the well-behaved worker, through shared memory.
  std::vector<float> g(256, 3.0f), w(256);
  REQUIRE_OK(good->Push("victim", {0, {{"w", g.data(), 256}}, {}}));
  REQUIRE_OK(good->Pull("victim", {1, {{"w", w.data(), 256}}, {}}));
  for (float x : w) REQUIRE(x == -3.0f);
  REQUIRE(good->shared_memory_requests() == 2);
}

TEST_CASE("a server ends its shared-memory sessions when the worker goes and when it shuts down", "[shm]") {
  TestCluster::Options co;
  co.num_servers = 1;
  auto cluster = TestCluster::Start(co);
  {
    auto c = cluster->Client(0, ShmOptions(true));
    REQUIRE_OK(c->CreateJob(JobSpec("bye", {DenseTableSpec("w", 16)}, 1, v1::ConsistencySpec::ASP)));
    std::vector<float> w(16);
    REQUIRE_OK(c->Pull("bye", {0, {{"w", w.data(), 16}}, {}}));
    REQUIRE(cluster->grpc(0)->shared_memory_sessions() == 1);
  }
  // The worker's client is gone: its call ended, and the server let go.
  REQUIRE(WaitForSessions(cluster->grpc(0), 0) == 0);

  // A session open at shutdown ends with it; the worker's next request
  // fails UNAVAILABLE (no server), it does not hang on the memory.
  GrpcPsClientOptions o = ShmOptions(true);
  o.retry_budget = absl::Milliseconds(300);
  auto c = cluster->Client(0, o);
  REQUIRE_OK(c->OpenJob("bye"));
  std::vector<float> w(16);
  REQUIRE_OK(c->Pull("bye", {0, {{"w", w.data(), 16}}, {}}));
  REQUIRE(cluster->grpc(0)->shared_memory_sessions() == 1);
  cluster->grpc(0)->Shutdown();
  REQUIRE(WaitForSessions(cluster->grpc(0), 0) == 0);
  const absl::Time start = absl::Now();
  REQUIRE(c->Push("bye", {1, {{"w", w.data(), 16}}, {}}).code() == absl::StatusCode::kUnavailable);
  REQUIRE(absl::Now() - start < absl::Seconds(20));  // the retry budget, not a hang
}

}  // namespace
}  // namespace fulcrum
