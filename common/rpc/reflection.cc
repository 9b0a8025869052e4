#include "common/rpc/reflection.h"

#include <set>
#include <utility>

#include <google/protobuf/descriptor.h>
#include <google/protobuf/descriptor.pb.h>
#include <grpcpp/grpcpp.h>

#include "absl/strings/str_cat.h"
#include "grpc/reflection/v1/reflection.grpc.pb.h"

namespace fulcrum {
namespace {

namespace rv1 = grpc::reflection::v1;
using google::protobuf::DescriptorPool;
using google::protobuf::FileDescriptor;

// Adds `file` and, depth first, every file it imports, each once.
void AddFileAndImports(const FileDescriptor* file, std::set<std::string>* seen, rv1::FileDescriptorResponse* out) {
  if (!seen->insert(file->name()).second) return;
  google::protobuf::FileDescriptorProto proto;
  file->CopyTo(&proto);
  out->add_file_descriptor_proto(proto.SerializeAsString());
  for (int i = 0; i < file->dependency_count(); ++i) AddFileAndImports(file->dependency(i), seen, out);
}

void Error(rv1::ServerReflectionResponse* resp, grpc::StatusCode code, const std::string& message) {
  rv1::ErrorResponse* e = resp->mutable_error_response();
  e->set_error_code(static_cast<int32_t>(code));
  e->set_error_message(message);
}

class ReflectionV1 final : public rv1::ServerReflection::CallbackService {
 public:
  explicit ReflectionV1(std::vector<std::string> services) : services_(std::move(services)) {
    services_.push_back("grpc.health.v1.Health");
    services_.push_back("grpc.reflection.v1.ServerReflection");
    services_.push_back("grpc.reflection.v1alpha.ServerReflection");
  }

  grpc::ServerBidiReactor<rv1::ServerReflectionRequest, rv1::ServerReflectionResponse>* ServerReflectionInfo(
      grpc::CallbackServerContext*) override {
    return new Reactor(this);
  }

  void Answer(const rv1::ServerReflectionRequest& req, rv1::ServerReflectionResponse* resp) const {
    resp->Clear();
    resp->set_valid_host(req.host());
    *resp->mutable_original_request() = req;
    const DescriptorPool* pool = DescriptorPool::generated_pool();
    std::set<std::string> seen;
    switch (req.message_request_case()) {
      case rv1::ServerReflectionRequest::kListServices:
        for (const std::string& s : services_) resp->mutable_list_services_response()->add_service()->set_name(s);
        return;
      case rv1::ServerReflectionRequest::kFileByFilename: {
        const FileDescriptor* f = pool->FindFileByName(req.file_by_filename());
        if (f == nullptr) return Error(resp, grpc::StatusCode::NOT_FOUND, "file not found");
        return AddFileAndImports(f, &seen, resp->mutable_file_descriptor_response());
      }
      case rv1::ServerReflectionRequest::kFileContainingSymbol: {
        const FileDescriptor* f = pool->FindFileContainingSymbol(req.file_containing_symbol());
        if (f == nullptr) return Error(resp, grpc::StatusCode::NOT_FOUND, "symbol not found");
        return AddFileAndImports(f, &seen, resp->mutable_file_descriptor_response());
      }
      case rv1::ServerReflectionRequest::kFileContainingExtension: {
        const auto& ext = req.file_containing_extension();
        const auto* type = pool->FindMessageTypeByName(ext.containing_type());
        const auto* field = type == nullptr ? nullptr : pool->FindExtensionByNumber(type, ext.extension_number());
        if (field == nullptr) return Error(resp, grpc::StatusCode::NOT_FOUND, "extension not found");
        return AddFileAndImports(field->file(), &seen, resp->mutable_file_descriptor_response());
      }
      case rv1::ServerReflectionRequest::kAllExtensionNumbersOfType: {
        const auto* type = pool->FindMessageTypeByName(req.all_extension_numbers_of_type());
        if (type == nullptr) return Error(resp, grpc::StatusCode::NOT_FOUND, "type not found");
        std::vector<const google::protobuf::FieldDescriptor*> fields;
        pool->FindAllExtensions(type, &fields);
        auto* out = resp->mutable_all_extension_numbers_response();
        out->set_base_type_name(type->full_name());
        for (const auto* f : fields) out->add_extension_number(f->number());
        return;
      }
      case rv1::ServerReflectionRequest::MESSAGE_REQUEST_NOT_SET:
        return Error(resp, grpc::StatusCode::INVALID_ARGUMENT, "the request names nothing to look up");
    }
  }

 private:
  // Reads a request, writes its answer, until the client stops writing.
  class Reactor final : public grpc::ServerBidiReactor<rv1::ServerReflectionRequest, rv1::ServerReflectionResponse> {
   public:
    explicit Reactor(const ReflectionV1* service) : service_(service) { StartRead(&req_); }
    void OnReadDone(bool ok) override {
      if (!ok) return Finish(grpc::Status::OK);
      service_->Answer(req_, &resp_);
      StartWrite(&resp_);
    }
    void OnWriteDone(bool ok) override {
      if (!ok) return Finish(grpc::Status(grpc::StatusCode::UNAVAILABLE, "the client went away"));
      StartRead(&req_);
    }
    void OnDone() override { delete this; }

   private:
    const ReflectionV1* const service_;
    rv1::ServerReflectionRequest req_;
    rv1::ServerReflectionResponse resp_;
  };

  std::vector<std::string> services_;
};

}  // namespace

std::unique_ptr<grpc::Service> NewReflectionV1Service(std::vector<std::string> services) {
  return std::make_unique<ReflectionV1>(std::move(services));
}

}  // namespace fulcrum
