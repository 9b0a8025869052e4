#include "common/rpc/malformed.h"

#include <utility>

#include "absl/algorithm/container.h"
#include "absl/strings/str_cat.h"
#include "common/rpc/grpc_util.h"

namespace fulcrum {
namespace {

using grpc::experimental::InterceptionHookPoints;

class MalformedRequestInterceptor final : public grpc::experimental::Interceptor {
 public:
  MalformedRequestInterceptor(grpc::experimental::ServerRpcInfo* info, const CallerCheck* check)
      : info_(info), check_(check) {}

  void Intercept(grpc::experimental::InterceptorBatchMethods* m) override {
    // gRPC hands interceptors no message when the bytes did not parse (and
    // at the end of a client stream, whose status is then not an error).
    if (m->QueryInterceptionHookPoint(InterceptionHookPoints::POST_RECV_MESSAGE) && m->GetRecvMessage() == nullptr) {
      unparsed_ = true;
    }
    if (unparsed_ && m->QueryInterceptionHookPoint(InterceptionHookPoints::PRE_SEND_STATUS)) {
      const grpc::Status st = m->GetSendStatus();
      // Fulcrum's handlers give every error a message: an empty one with
      // these codes is gRPC's answer to bytes it could not parse.
      if ((st.error_code() == grpc::StatusCode::UNIMPLEMENTED || st.error_code() == grpc::StatusCode::INTERNAL) &&
          st.error_message().empty()) {
        const std::string method = info_->method() != nullptr ? info_->method() : "";
        absl::Status refused = absl::OkStatus();
        if (*check_ && info_->server_context() != nullptr) refused = (*check_)(method, *info_->server_context());
        m->ModifySendStatus(
            !refused.ok()
                ? ToGrpcStatus(refused)
                : grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                               absl::StrCat("the request to ", method,
                                            " does not parse as its request message (bytes of another message, "
                                            "cut short, or a string field that is not UTF-8); see proto/fulcrum/v1")));
      }
    }
    m->Proceed();
  }

 private:
  grpc::experimental::ServerRpcInfo* const info_;
  const CallerCheck* const check_;
  bool unparsed_ = false;
};

class Factory final : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  Factory(CallerCheck check, std::vector<std::string> raw_methods)
      : check_(std::move(check)), raw_methods_(std::move(raw_methods)) {}
  grpc::experimental::Interceptor* CreateServerInterceptor(grpc::experimental::ServerRpcInfo* info) override {
    // No interceptor at all (gRPC takes nullptr as "not this call").
    if (info->method() != nullptr && absl::c_linear_search(raw_methods_, info->method())) return nullptr;
    return new MalformedRequestInterceptor(info, &check_);
  }

 private:
  const CallerCheck check_;
  const std::vector<std::string> raw_methods_;
};

}  // namespace

std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> NewMalformedRequestInterceptor(
    CallerCheck check, std::vector<std::string> raw_methods) {
  return std::make_unique<Factory>(std::move(check), std::move(raw_methods));
}

}  // namespace fulcrum
