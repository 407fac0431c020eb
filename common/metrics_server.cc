#include "common/metrics_server.h"

#include "absl/strings/str_cat.h"
#include "prometheus/text_serializer.h"

namespace dd {

absl::StatusOr<std::unique_ptr<MetricsServer>> MetricsServer::Start(const std::string& listen) {
  std::unique_ptr<MetricsServer> m(new MetricsServer());
  http::ServerOptions o;
  o.listen = listen;
  o.threads = 2;  // scrapes are short; a few at once are plenty
  o.queue = 16;
  o.max_per_client = 64;
  o.request_timeout_ms = 5000;
  o.write_timeout_ms = 10000;
  o.max_body_bytes = 0;
  o.name = "metrics";
  MetricsServer* self = m.get();
  auto server = http::Server::Start(o, [self](http::Connection& c) { self->Handle(c); });
  if (!server.ok()) return server.status();
  m->server_ = std::move(*server);
  return m;
}

MetricsServer::~MetricsServer() { server_.reset(); }

void MetricsServer::RegisterCollectable(const std::weak_ptr<prometheus::Collectable>& c) {
  std::lock_guard<std::mutex> lock(mu_);
  collectables_.push_back(c);
}

void MetricsServer::Handle(http::Connection& c) {
  const http::Request& r = c.request();
  if (r.method != "GET" || r.path != "/metrics") {
    const std::string body = "only GET /metrics is served here\n";
    c.Write(absl::StrCat("HTTP/1.1 404 Not Found\r\nContent-Type: text/plain\r\nContent-Length: ", body.size(),
                         "\r\nConnection: close\r\n\r\n", body));
    return;
  }
  std::vector<prometheus::MetricFamily> families;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& weak : collectables_) {
      if (auto c = weak.lock()) {
        std::vector<prometheus::MetricFamily> f = c->Collect();
        families.insert(families.end(), std::make_move_iterator(f.begin()), std::make_move_iterator(f.end()));
      }
    }
  }
  const std::string body = prometheus::TextSerializer().Serialize(families);
  c.Write(absl::StrCat("HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: ", body.size(),
                       "\r\nConnection: close\r\n\r\n", body));
}

}  // namespace dd
