#include "proto/standard_services.h"

#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/health_check_service_interface.h"

namespace dd {

void EnableStandardServices() {
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
}

void ListenOn(grpc::ServerBuilder& builder, const std::string& address,
              std::shared_ptr<grpc::ServerCredentials> credentials, int* port) {
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.AddListeningPort(address, std::move(credentials), port);
}

void MarkServing(grpc::Server& server, const std::vector<std::string>& services) {
  grpc::HealthCheckServiceInterface* health = server.GetHealthCheckService();
  if (health == nullptr) return;
  health->SetServingStatus("", true);
  for (const std::string& s : services) health->SetServingStatus(s, true);
}

void MarkNotServing(grpc::Server& server) {
  if (grpc::HealthCheckServiceInterface* health = server.GetHealthCheckService()) {
    health->SetServingStatus(false);  // every name set so far, "" included
  }
}

}  // namespace dd
